//! Device tests of the connection items of the provider interface on a verbs flavour:
//! `connect_start`, the listener's descriptor and `try_accept`, `ep_context`, endpoint
//! events and `drain`. Shared by the roce and iwarp crates' tests (`#[path]`); they need a
//! device (the soft-RDMA guest: `scripts/soft-rdma`), so they are `#[ignore]`d, and
//! `scripts/test` runs them there with `--ignored`; without a device they fail.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_api::spi::{CompletionQueue, Connecting, Domain, Endpoint, EndpointConfig, Listener};
use fabric_api::{
    Access, Buffer, Completion, EndpointEvent, EndpointState, ErrorKind, MemoryRegion, RecvWr,
    RemoteAddr, SendWr, Status,
};
use fabric_verbs::{Flavor, VerbsCq, VerbsDomain, VerbsOptions};

const T: Duration = Duration::from_secs(10);

/// Opens the flavour's domain on the address named by `env` (the test is ignored unless
/// asked for, and then a missing device is a failure, never a skip).
pub fn open<F: Flavor>(env: &str) -> (VerbsDomain<F>, IpAddr) {
    let ip = std::env::var(env)
        .ok()
        .and_then(|a| a.parse::<IpAddr>().ok())
        .unwrap_or_else(|| panic!("{env} names no address: run this in the soft-RDMA guest"));
    match VerbsDomain::<F>::open(VerbsOptions {
        address: Some(ip),
        ..VerbsOptions::default()
    }) {
        Ok(d) => (d, ip),
        Err(e) => panic!("opening the {} domain on {ip}: {e}", F::NAME),
    }
}

fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    fabric_api::notify::wait_readable(fd, timeout).expect("poll(2)")
}

fn readable(fd: BorrowedFd<'_>) -> bool {
    wait_readable(fd, Duration::ZERO)
}

fn next<F: Flavor>(cq: &VerbsCq<F>) -> Completion {
    let deadline = Instant::now() + T;
    let mut out = Vec::new();
    while Instant::now() < deadline {
        if cq.poll(&mut out, 1).unwrap() == 1 {
            return out.pop().unwrap();
        }
        cq.wait(Duration::from_millis(50)).unwrap();
    }
    panic!("no completion within {T:?}");
}

/// Connects to a port of `ip` where nobody listens: the connection fails through poll,
/// refused.
fn connect_refused<F: Flavor>(d: &VerbsDomain<F>, ip: IpAddr, cq: &VerbsCq<F>) {
    let l = d.listen(SocketAddr::new(ip, 0)).unwrap();
    let gone = l.local_addr();
    drop(l);
    let mut c = d.connect_start(gone, &cfg(cq, 1)).unwrap();
    assert!(wait_readable(c.as_fd(), T + Duration::from_secs(2)));
    let e = c.poll().map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
}

fn region<F: Flavor>(d: &VerbsDomain<F>, acc: Access) -> MemoryRegion {
    d.register(Arc::new(Buffer::new(4096)), acc).unwrap()
}

fn cfg<F: Flavor>(cq: &VerbsCq<F>, ep_context: u64) -> EndpointConfig<'_, VerbsCq<F>> {
    let mut c = EndpointConfig::new(cq);
    c.sq_depth = 16;
    c.rq_depth = 16;
    c.timeout = T;
    c.ep_context = ep_context;
    c
}

/// Connects without blocking through the descriptors only: the listener's tells when
/// to `try_accept`, the connection's when to poll it.
fn pair<F: Flavor>(
    d: &VerbsDomain<F>,
    ip: IpAddr,
    ccq: &VerbsCq<F>,
    scq: &VerbsCq<F>,
) -> (
    fabric_verbs::VerbsEndpoint<F>,
    fabric_verbs::VerbsEndpoint<F>,
) {
    let l = d.listen(SocketAddr::new(ip, 0)).unwrap();
    assert!(
        !readable(l.as_fd()),
        "a new listener's descriptor is readable"
    );
    assert!(l.try_accept(&cfg(scq, 0xa1)).unwrap().is_none());
    let t0 = Instant::now();
    let mut c = d
        .connect_start(l.local_addr(), &{
            let mut x = cfg(ccq, 0xc1);
            x.private_data = b"client";
            x
        })
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "connect_start blocked"
    );
    assert!(c.deadline() >= t0 + T && c.deadline() <= Instant::now() + T);
    // Nobody accepted yet: the connection cannot be done.
    assert!(c.poll().unwrap().is_none());
    assert!(wait_readable(l.as_fd(), T), "no connection request came");
    let s = l
        .try_accept(&{
            let mut x = cfg(scq, 0xa1);
            x.private_data = b"server";
            x
        })
        .unwrap()
        .expect("a request waits");
    assert!(
        !readable(l.as_fd()),
        "the listener stays readable with no request"
    );
    assert!(
        wait_readable(c.as_fd(), T),
        "the connection never became ready"
    );
    let ep = c.poll().unwrap().expect("connected");
    assert_eq!(
        c.poll().map(|_| ()).unwrap_err().kind(),
        ErrorKind::InvalidState
    );
    assert_eq!(ep.peer_private_data(), b"server");
    assert_eq!(s.peer_private_data(), b"client");
    (ep, s)
}

/// Checks how many requests posted since `before` (the debug count
/// `fault::direct_posts`) went by the direct path: `want[0]` on roce, `want[1]` on iwarp.
#[cfg(debug_assertions)]
fn posted_direct<F: Flavor>(before: usize, want: [usize; 2], what: &str) {
    let direct = fabric_verbs::fault::direct_posts() - before;
    let want = want[usize::from(F::NAME == "iwarp")];
    assert_eq!(
        direct,
        want,
        "{what} posted by the direct path on {}",
        F::NAME
    );
}

/// The whole sequence on one domain (one device thread set-up per run).
pub fn conn_items<F: Flavor>(d: VerbsDomain<F>, ip: IpAddr) {
    let ccq = d.create_cq(64).unwrap();
    let scq = d.create_cq(64).unwrap();
    let (c, s) = pair(&d, ip, &ccq, &scq);
    assert!(c.next_event().is_none() && s.next_event().is_none());
    assert!(!readable(c.event_fd().unwrap()));

    // ep_context on both queues, success.
    let src = region(&d, Access::LOCAL_WRITE);
    let dst = region(&d, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    for i in 0..4 {
        s.post_recv(&RecvWr::new(100 + i, &[dst.slice(0..64).unwrap()]))
            .unwrap();
    }
    #[cfg(debug_assertions)]
    let direct_before = fabric_verbs::fault::direct_posts();
    for i in 0..3 {
        c.post_send(&SendWr::send(i, &[src.slice(0..64).unwrap()]))
            .unwrap();
    }
    // Which connections post delivery-complete sends from the direct path: roce's
    // (nothing to add to a request), not iwarp's (credits and delivery reads go with them).
    #[cfg(debug_assertions)]
    posted_direct::<F>(direct_before, [3, 0], "delivery-complete sends");
    // drain waits for the three sends without anyone polling.
    c.drain(T).unwrap();
    for _ in 0..3 {
        let x = next(&ccq);
        assert_eq!((x.status, x.ep_context), (Status::Success, 0xc1), "{x:?}");
        let y = next(&scq);
        assert_eq!((y.status, y.ep_context), (Status::Success, 0xa1), "{y:?}");
    }
    // Unsignaled: drained too, no completion.
    c.post_send(&SendWr::send(9, &[src.slice(0..8).unwrap()]).unsignaled())
        .unwrap();
    c.drain(T).unwrap();
    let y = next(&scq);
    assert_eq!(y.ep_context, 0xa1);
    let mut out = Vec::new();
    assert_eq!(ccq.poll(&mut out, 8).unwrap(), 0, "{out:?}");

    // Transmit-complete writes need nothing added on any connection (no read is
    // outstanding, so no delivery read): the direct path, the 8-byte one inline on siw. A
    // delivery-complete write takes the ledger's path on iwarp (its delivery read).
    #[cfg(debug_assertions)]
    {
        let before = fabric_verbs::fault::direct_posts();
        for (ctx, len) in [(30, 8), (31, 64)] {
            let sgl = [src.slice(0..len).unwrap()];
            c.post_send(&SendWr::write(ctx, &sgl, dst.desc().at(0)).transmit_complete())
                .unwrap();
        }
        c.post_send(&SendWr::write(
            32,
            &[src.slice(0..64).unwrap()],
            dst.desc().at(0),
        ))
        .unwrap();
        posted_direct::<F>(before, [3, 2], "writes");
        c.drain(T).unwrap();
        for ctx in 30..33 {
            let x = next(&ccq);
            assert_eq!((x.status, x.context), (Status::Success, ctx), "{x:?}");
        }
        // A transmit-complete write behind a delivery-complete one whose read is still
        // outstanding (nobody reaps meanwhile) keeps a read of its own on iwarp: it must not
        // complete before the earlier write. The ledger's path, then; completions in order.
        let before = fabric_verbs::fault::direct_posts();
        c.post_send(&SendWr::write(
            33,
            &[src.slice(0..64).unwrap()],
            dst.desc().at(0),
        ))
        .unwrap();
        let sgl = [src.slice(0..8).unwrap()];
        c.post_send(&SendWr::write(34, &sgl, dst.desc().at(0)).transmit_complete())
            .unwrap();
        posted_direct::<F>(
            before,
            [2, 0],
            "a transmit-complete write behind a delivery read",
        );
        c.drain(T).unwrap();
        for ctx in 33..35 {
            let x = next(&ccq);
            assert_eq!((x.status, x.context), (Status::Success, ctx), "{x:?}");
        }
    }

    // A send with no receive at the peer waits (RNR, or held for credits): drain times out
    // naming it.
    c.post_send(&SendWr::send(10, &[src.slice(0..8).unwrap()]))
        .unwrap();
    let e = c.drain(Duration::from_millis(300)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    assert!(e.message().contains("1 send-queue operation "), "{e}");
    // The peer closes: PeerClosed there is Closed here... the other way round: the server
    // closes; its event is Closed, ours PeerClosed; the waiting send completes Flushed with
    // our ep_context.
    s.close().unwrap();
    assert_eq!(s.next_event(), Some(EndpointEvent::Closed));
    assert_eq!(s.next_event(), None);
    assert!(
        wait_readable(c.event_fd().unwrap(), T),
        "no event for the peer's close"
    );
    assert_eq!(c.next_event(), Some(EndpointEvent::PeerClosed));
    assert!(!readable(c.event_fd().unwrap()));
    assert_eq!(c.state(), EndpointState::Disconnected);
    let x = next(&ccq);
    assert_eq!((x.context, x.ep_context), (10, 0xc1), "{x:?}");
    assert_eq!(x.status, Status::Error(ErrorKind::Flushed));
    c.close().unwrap();
    assert_eq!(
        c.next_event(),
        None,
        "a close after the peer's changes no state"
    );
    drop((c, s));
    let mut out = Vec::new();
    while ccq.poll(&mut out, 64).unwrap() > 0 || scq.poll(&mut out, 64).unwrap() > 0 {}
    for x in &out {
        assert!(x.ep_context == 0xc1 || x.ep_context == 0xa1, "{x:?}");
    }

    // iwarp: both ends count deliveries, so a send is confirmed by the count the peer
    // writes when it reposts a receive, which a request/reply exchange does before it
    // replies: the send's delivery read is never posted. (Without the count every send
    // here would complete through its read, and the count below would stay put.)
    #[cfg(debug_assertions)]
    if F::NAME == "iwarp" {
        let (c, s) = pair(&d, ip, &ccq, &scq);
        let back = region(&d, Access::LOCAL_WRITE);
        let before = fabric_verbs::fault::confirmed_by_count();
        s.post_recv(&RecvWr::new(200, &[dst.slice(0..64).unwrap()]))
            .unwrap();
        const N: u64 = 20;
        for i in 0..N {
            c.post_recv(&RecvWr::new(300 + i, &[back.slice(0..64).unwrap()]))
                .unwrap();
            c.post_send(&SendWr::send(400 + i, &[src.slice(0..64).unwrap()]))
                .unwrap();
            let y = next(&scq);
            assert_eq!((y.status, y.byte_len), (Status::Success, 64), "{y:?}");
            // The server reposts, then replies: its count leaves before the reply.
            s.post_recv(&RecvWr::new(201 + i, &[dst.slice(0..64).unwrap()]))
                .unwrap();
            s.post_send(&SendWr::send(500 + i, &[src.slice(0..8).unwrap()]).unsignaled())
                .unwrap();
            let mut got = [next(&ccq), next(&ccq)];
            got.sort_by_key(|x| x.context);
            assert_eq!(
                [
                    (got[0].context, got[0].status),
                    (got[1].context, got[1].status)
                ],
                [(300 + i, Status::Success), (400 + i, Status::Success)],
                "{got:?}"
            );
        }
        let confirmed = fabric_verbs::fault::confirmed_by_count() - before;
        assert!(
            confirmed >= N as usize,
            "only {confirmed} of the {N} requests and {N} replies were confirmed by the peer's count"
        );
        c.drain(T).unwrap();
        s.drain(T).unwrap();
        drop((c, s));

        // Transmit-complete sends need no count: with a window of receives posted ahead
        // (the queue's 16), the receiver writes a credit update only when the sender may
        // run short (one per 8 receives in this steady exchange), where delivery-complete
        // sends get one per receive. (Without batching both loops below would count 200.)
        const W: u64 = 16;
        // The previous pair's receives, flushed when it closed, may still arrive.
        let next_live = |cq: &VerbsCq<F>| loop {
            let x = next(cq);
            if x.status != Status::Error(ErrorKind::Flushed) {
                break x;
            }
        };
        let (c, s) = pair(&d, ip, &ccq, &scq);
        let updates = |tc: bool| {
            for i in 0..W {
                s.post_recv(&RecvWr::new(600 + i, &[dst.slice(0..64).unwrap()]))
                    .unwrap();
            }
            let before = fabric_verbs::fault::credit_updates();
            let direct_before = fabric_verbs::fault::direct_posts();
            const M: u64 = 200;
            for i in 0..M {
                let piece = [src.slice(0..64).unwrap()];
                let w = SendWr::send(700 + i, &piece);
                c.post_send(&if tc { w.transmit_complete() } else { w })
                    .unwrap();
                let y = next_live(&scq);
                assert_eq!((y.status, y.byte_len), (Status::Success, 64), "{y:?}");
                s.post_recv(&RecvWr::new(600 + i, &[dst.slice(0..64).unwrap()]))
                    .unwrap();
                let x = next_live(&ccq);
                assert_eq!((x.context, x.status), (700 + i, Status::Success), "{x:?}");
            }
            let n = fabric_verbs::fault::credit_updates() - before;
            let direct = fabric_verbs::fault::direct_posts() - direct_before;
            // The window still posted is filled, so that the next run starts with none.
            for _ in 0..W {
                c.post_send(&SendWr::send(900, &[src.slice(0..8).unwrap()]).unsignaled())
                    .unwrap();
                next_live(&scq);
            }
            (n, direct)
        };
        let (lazy, lazy_direct) = updates(true);
        let (eager, eager_direct) = updates(false);
        // Transmit-complete sends with credit in hand go by the direct path once the peer
        // was told they need no count (the first one tells it, by the ledger's path);
        // delivery-complete ones never do.
        assert!(
            lazy_direct >= 150,
            "{lazy_direct} of 200 transmit-complete sends posted by the direct path"
        );
        assert_eq!(
            eager_direct, 0,
            "delivery-complete sends posted by the direct path"
        );
        assert!(
            lazy <= 50,
            "{lazy} credit updates for 200 transmit-complete sends into a window of {W}"
        );
        assert!(
            eager >= 200,
            "{eager} credit updates for 200 delivery-complete sends"
        );
        c.drain(T).unwrap();
        s.drain(T).unwrap();
        drop((c, s));
    }

    // A bad key: the writer's endpoint fails, with the completion's error.
    let (c, s) = pair(&d, ip, &ccq, &scq);
    let mut bad: RemoteAddr = dst.desc().at(0);
    bad.key ^= 0x5a5a_0000;
    c.post_send(&SendWr::write(20, &[src.slice(0..16).unwrap()], bad))
        .unwrap();
    let x = next(&ccq);
    assert_eq!(x.ep_context, 0xc1);
    assert!(matches!(x.status, Status::Error(_)), "{x:?}");
    assert!(wait_readable(c.event_fd().unwrap(), T));
    match c.next_event() {
        Some(EndpointEvent::Failed(e)) => {
            assert_eq!(Status::Error(e.kind()), x.status, "{e}");
        }
        other => panic!("expected a failure event, got {other:?}"),
    }
    assert_eq!(c.state(), EndpointState::Error);
    c.close().unwrap();
    assert_eq!(
        c.next_event(),
        None,
        "a close after a failure changes no state"
    );
    drop((c, s));

    // close_drained: what was posted completes Success, then the close.
    let (c, s) = pair(&d, ip, &ccq, &scq);
    s.post_recv(&RecvWr::new(1, &[dst.slice(0..64).unwrap()]))
        .unwrap();
    c.post_send(&SendWr::send(30, &[src.slice(0..64).unwrap()]))
        .unwrap();
    c.close_drained(T).unwrap();
    let x = next(&ccq);
    assert_eq!(
        (x.context, x.status, x.ep_context),
        (30, Status::Success, 0xc1)
    );
    assert_eq!(c.next_event(), Some(EndpointEvent::Closed));
    drop((c, s));

    // A receive on a dead endpoint whose completion queue is full says that the endpoint
    // is dead, not that the queue is full (its one slot holds the flushed receive).
    let tiny = d.create_cq(1).unwrap();
    let (c, s) = pair(&d, ip, &ccq, &tiny);
    s.post_recv(&RecvWr::new(40, &[dst.slice(0..64).unwrap()]))
        .unwrap();
    s.close().unwrap();
    let e = s
        .post_recv(&RecvWr::new(41, &[dst.slice(0..64).unwrap()]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidState, "{e}");
    let x = next(&tiny);
    assert_eq!(
        (x.context, x.status),
        (40, Status::Error(ErrorKind::Flushed))
    );
    drop((c, s));

    // A refused connection fails through poll.
    connect_refused(&d, ip, &ccq);

    // An abandoned connection: the listener accepts it, then sees it closed by the
    // provider's thread. Abandoned once its request reached the listener: dropped before
    // (while the connection manager still resolves the route) no request is ever sent,
    // and the accept below would wait for nothing (a fresh-clone CI run of 2c275da on
    // rxe0).
    let l = d.listen(SocketAddr::new(ip, 0)).unwrap();
    let c = d.connect_start(l.local_addr(), &cfg(&ccq, 2)).unwrap();
    assert!(wait_readable(l.as_fd(), T), "no connection request came");
    drop(c);
    let s = l.accept(&cfg(&scq, 3), T).unwrap();
    assert!(
        wait_readable(s.event_fd().unwrap(), T + Duration::from_secs(2)),
        "the abandoned connection was never closed"
    );
    assert_eq!(s.next_event(), Some(EndpointEvent::PeerClosed));
    drop(s);
    drop(l);

    #[cfg(debug_assertions)]
    refusals(&d, ip, &ccq, &scq);
    #[cfg(debug_assertions)]
    refused_connects_give_everything_back::<F>(ip);
    eprintln!("conn_items: every check passed on {} at {ip}", F::NAME);
}

/// Refused connections leave nothing on the device: a domain dropped right after them
/// frees its protection domain. (Until 2026-11-28 the identifier of a refused connect was
/// destroyed on a background thread that did not keep the protection domain: when the
/// domain went first, the kernel refused to free it, EBUSY, and it leaked.)
#[cfg(debug_assertions)]
fn refused_connects_give_everything_back<F: Flavor>(ip: IpAddr) {
    use fabric_verbs::fault;
    let (kept, live) = (
        fault::protection_domains_kept(),
        fault::protection_domains(),
    );
    for _ in 0..5 {
        let d = match VerbsDomain::<F>::open(VerbsOptions {
            address: Some(ip),
            ..VerbsOptions::default()
        }) {
            Ok(d) => d,
            Err(e) => panic!("opening a second {} domain on {ip}: {e}", F::NAME),
        };
        let cq = d.create_cq(16).unwrap();
        connect_refused(&d, ip, &cq);
        drop((cq, d));
    }
    // Whatever destroys the identifiers in the background frees the domains after them.
    let t0 = Instant::now();
    while fault::protection_domains() > live && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        fault::protection_domains_kept(),
        kept,
        "the device refused to free the protection domain of a refused connection"
    );
    assert_eq!(
        fault::protection_domains(),
        live,
        "a protection domain was never freed"
    );
}

/// What the ledger does when the device refuses a post (`fabric_verbs::fault`, debug
/// builds): refused whole, a post fails at once and leaves nothing behind; refused after
/// part of its group reached the device, the rest stays held back and goes once the
/// device takes it; a held-back group refused whole stays held back for the RNR thread,
/// retried at its pace, not in a loop, and goes once the device takes it; refused for
/// good, the request fails after the grace period and the endpoint with it.
#[cfg(debug_assertions)]
fn refusals<F: Flavor>(d: &VerbsDomain<F>, ip: IpAddr, ccq: &VerbsCq<F>, scq: &VerbsCq<F>) {
    use fabric_verbs::fault;
    const EINVAL: i32 = 22;
    let src = region(d, Access::LOCAL_WRITE);
    let dst = region(d, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let mut out = Vec::new();
    // What the sequence before left in the queues.
    while ccq.poll(&mut out, 64).unwrap() > 0 || scq.poll(&mut out, 64).unwrap() > 0 {}
    out.clear();

    // Refused whole, synchronously: the caller gets the error, and no completion ever
    // comes for it; the next write goes alone.
    let (c, s) = pair(d, ip, ccq, scq);
    let sgl = [src.slice(0..16).unwrap()];
    let write = |ctx| SendWr::write(ctx, &sgl, dst.desc().at(0));
    let before = fault::refused();
    fault::refuse_posts(0, EINVAL, 1);
    let e = c.post_send(&write(40)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(fault::refused(), before + 1);
    c.post_send(&write(41)).unwrap();
    let x = next(ccq);
    assert_eq!((x.context, x.status), (41, Status::Success), "{x:?}");
    c.drain(T).unwrap();
    assert_eq!(ccq.poll(&mut out, 8).unwrap(), 0, "{out:?}");

    // Refused after part of its group: where a write is followed by a delivery read, the
    // write reaches the device and the read does not. The post succeeds, the write lands,
    // the read stays held back and goes when the device takes it (here at the next try):
    // the request completes as if nothing happened. (A write: its delivery read always
    // goes with it, where a send's may be held back for the peer's count.)
    if d.profile().delivery_reads {
        let before = fault::refused();
        fault::refuse_posts(1, EINVAL, 1);
        c.post_send(&write(42)).unwrap();
        assert_eq!(fault::refused(), before + 1);
        let x = next(ccq);
        assert_eq!((x.context, x.status), (42, Status::Success), "{x:?}");
        c.post_send(&write(43)).unwrap();
        let x = next(ccq);
        assert_eq!((x.context, x.status), (43, Status::Success), "{x:?}");

        // Transmit complete: the write goes without its delivery read, a chain of one
        // request that a refusal of a chain's second request never reaches.
        let before = fault::refused();
        fault::refuse_posts(1, EINVAL, 1);
        c.post_send(&write(44).transmit_complete()).unwrap();
        let refused = fault::refused() - before;
        fault::stop();
        assert_eq!(
            refused, 0,
            "a transmit-complete write left with a request behind it"
        );
        let x = next(ccq);
        assert_eq!((x.context, x.status), (44, Status::Success), "{x:?}");
    }
    drop((c, s));

    // Held back for credits (the peer has no receive), then refused whole, again and
    // again, once the peer's credit lets it go: the RNR thread retries it at its pace (a
    // retry loop would refuse it millions of times a second), the application's polls
    // return, and once the device takes it the send completes.
    if d.profile().credits {
        let (c, s) = pair(d, ip, ccq, scq);
        c.post_send(&SendWr::send(50, &[src.slice(0..8).unwrap()]))
            .unwrap();
        let before = fault::refused();
        fault::refuse_posts(0, EINVAL, usize::MAX);
        s.post_recv(&RecvWr::new(300, &[dst.slice(0..64).unwrap()]))
            .unwrap();
        let t0 = Instant::now();
        while fault::refused() == before {
            assert!(t0.elapsed() < T, "the held-back send was never released");
            assert_eq!(ccq.poll(&mut out, 8).unwrap(), 0, "{out:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
        let first = fault::refused();
        let window = Instant::now();
        while window.elapsed() < Duration::from_millis(300) {
            assert_eq!(ccq.poll(&mut out, 8).unwrap(), 0, "{out:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
        let retries = fault::refused() - first;
        fault::stop();
        eprintln!("refusals: the held-back send was refused {retries} more times in 300 ms");
        assert!(
            (1..5000).contains(&retries),
            "{retries} refusals in 300 ms: the held-back send is retried in a loop (or not at all)"
        );
        let x = next(ccq);
        assert_eq!((x.context, x.status), (50, Status::Success), "{x:?}");
        let y = next(scq);
        assert_eq!((y.context, y.status), (300, Status::Success), "{y:?}");
        drop((c, s));
    }

    // Refused for good on a connected endpoint: the rest of a cut group (the delivery
    // read behind a write) refused on every try. Past the grace period (2 s) the request
    // fails with the device's error, the endpoint enters the error state and says why,
    // and what was posted behind it completes Flushed.
    if d.profile().delivery_reads {
        let (c, s) = pair(d, ip, ccq, scq);
        let sgl = [src.slice(0..16).unwrap()];
        let write = |ctx| SendWr::write(ctx, &sgl, dst.desc().at(0));
        fault::refuse_rest(1, EINVAL);
        let t0 = Instant::now();
        c.post_send(&write(60)).unwrap();
        c.post_send(&write(61)).unwrap();
        let x = next(ccq);
        let waited = t0.elapsed();
        fault::stop();
        assert_eq!(
            (x.context, x.status),
            (60, Status::Error(ErrorKind::InvalidArgument)),
            "{x:?}"
        );
        assert!(
            waited >= Duration::from_millis(1500),
            "failed after {waited:?}, before the grace period"
        );
        eprintln!("refusals: a request refused for good failed after {waited:?}");
        let y = next(ccq);
        assert_eq!(
            (y.context, y.status),
            (61, Status::Error(ErrorKind::Flushed)),
            "{y:?}"
        );
        assert_eq!(c.state(), EndpointState::Error);
        match c.next_event() {
            Some(EndpointEvent::Failed(e)) => {
                assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}")
            }
            other => panic!("event {other:?}"),
        }
        drop((c, s));
    }
}
