//! Hooks through run-time selection and dispatch: a hooked tcp domain on loopback.

use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric::{FaultConfig, Selector, Trigger};

const PATIENCE: Duration = Duration::from_secs(20);

struct Side {
    cq: AnyCq,
    ep: AnyEndpoint,
}

fn open(text: &str) -> (AnyDomain, fabric::SelectionReport) {
    Selector::new()
        .config_str(text)
        .unwrap()
        .providers("tcp")
        .unwrap()
        .open()
        .unwrap()
}

/// Both ends from `domain`: the client connects to a listener of the same domain.
fn connect(domain: &AnyDomain) -> (Side, Side) {
    let listener = domain.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr();
    let server_cq = domain.create_cq(64).unwrap();
    let client_cq = domain.create_cq(64).unwrap();
    std::thread::scope(|s| {
        let accepting = s.spawn(|| {
            listener
                .accept(&EndpointConfig::new(&server_cq), PATIENCE)
                .unwrap()
        });
        let client = domain
            .connect(addr, &EndpointConfig::new(&client_cq))
            .unwrap();
        let server = accepting.join().unwrap();
        (
            Side {
                cq: client_cq.clone(),
                ep: client,
            },
            Side {
                cq: server_cq.clone(),
                ep: server,
            },
        )
    })
}

fn take(cq: &AnyCq, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + PATIENCE;
    let mut got = Vec::new();
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "only {got:?} of {n} completions");
        cq.wait(left).unwrap();
        let want = n - got.len();
        cq.poll(&mut got, want).unwrap();
    }
    got
}

const RW: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ);

#[test]
fn a_hooked_domain_moves_data_and_fails_posts_as_configured() {
    let (domain, report) = open(
        "hooks = [\"trace\", \"fault\"]\n[fault]\nseed = 1\n\
         fail_post = { every_nth = 3, kind = \"RemoteOperation\" }\n",
    );
    assert!(matches!(domain, AnyDomain::Hooked(_)));
    assert!(
        report.to_string().contains("hook active: fault (seed 1"),
        "{report}"
    );
    let (client, server) = connect(&domain);
    assert!(matches!(client.cq, AnyCq::Hooked(_)));
    assert!(matches!(client.ep, AnyEndpoint::Hooked(_)));

    // Regions of the hooked domain work with the provider underneath.
    let src = domain.alloc(64, RW).unwrap();
    let dst = domain.alloc(64, RW).unwrap();
    src.buffer().write(0, b"hooked");
    let sgl = [src.slice(0..6).unwrap()];
    client
        .ep
        .post_send(&SendWr::write(1, &sgl, dst.desc().at(8)))
        .unwrap(); // post 1
    let rsgl = [dst.slice(32..64).unwrap()];
    server.ep.post_recv(&RecvWr::new(2, &rsgl)).unwrap(); // the server's post 1
    client.ep.post_send(&SendWr::send(3, &sgl)).unwrap(); // post 2
    let e = client.ep.post_send(&SendWr::send(4, &sgl)).unwrap_err(); // post 3: refused
    assert_eq!(e.kind(), ErrorKind::RemoteOperation);
    let got = take(&client.cq, 2);
    assert_eq!(
        got.iter()
            .map(|c| (c.context, c.is_ok()))
            .collect::<Vec<_>>(),
        [(1, true), (3, true)]
    );
    let got = take(&server.cq, 1);
    assert_eq!((got[0].context, got[0].byte_len), (2, 6));
    let mut bytes = [0u8; 6];
    dst.buffer().read(8, &mut bytes);
    assert_eq!(&bytes, b"hooked");
    dst.buffer().read(32, &mut bytes);
    assert_eq!(&bytes, b"hooked");
    assert_eq!(domain.hooks().unwrap().stats().posts_failed, 1);

    // A queue of an unhooked domain is refused by the hooked one.
    let (plain, _) = open("");
    let plain_cq = plain.create_cq(4).unwrap();
    let e = domain
        .connect(server.ep.local_addr(), &EndpointConfig::new(&plain_cq))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[test]
fn a_cut_through_dispatch_reaches_the_peer() {
    let (domain, report) = Selector::new()
        .providers("tcp")
        .unwrap()
        .fault(FaultConfig::new().seed(2).cut(Trigger::every(2)))
        .open()
        .unwrap();
    assert!(
        report.to_string().contains("cut the connection"),
        "{report}"
    );
    let (client, server) = connect(&domain);
    let buf = domain.alloc(64, RW).unwrap();
    let sgl = [buf.slice(0..64).unwrap()];
    server.ep.post_recv(&RecvWr::new(7, &sgl)).unwrap();
    client.ep.post_recv(&RecvWr::new(8, &sgl)).unwrap();
    assert_eq!(client.ep.state(), EndpointState::Connected);
    client.ep.post_recv(&RecvWr::new(9, &sgl)).unwrap(); // the client's 2nd post: cut
    assert_eq!(client.ep.state(), EndpointState::Error);
    let c = take(&client.cq, 2);
    assert!(
        c.iter()
            .all(|c| c.status == Status::Error(ErrorKind::Flushed)),
        "{c:?}"
    );
    let s = take(&server.cq, 1);
    assert_eq!(s[0].context, 7);
    assert!(!s[0].is_ok(), "{:?}", s[0]);
    assert_ne!(server.ep.state(), EndpointState::Connected);
    assert!(!client.ep.hooks().unwrap().cut_connection(), "already cut");
    assert_eq!(domain.hooks().unwrap().stats().connections_cut, 1);
}
