//! Each fault, observed through the public API over the tcp provider on loopback.

mod common;

use std::time::{Duration, Instant};

use common::{pair, take, wait_not_connected, PATIENCE};
use fabric_api::spi::{CompletionQueue, Endpoint};
use fabric_api::{EndpointState, ErrorKind, Opcode, RecvWr, SendWr, Status};
use fabric_hook::{FaultConfig, FaultStats, HookConfig, Trigger};

fn faults(f: FaultConfig) -> HookConfig {
    HookConfig {
        trace: false,
        fault: Some(f.seed(1)),
    }
}

#[test]
fn fail_post_returns_the_configured_kind_and_the_endpoint_stays_usable() {
    let p = pair(faults(
        FaultConfig::new().fail_post(Trigger::every(2), ErrorKind::RemoteOperation),
    ));
    let sgl = [p.mr.slice(0..64).unwrap()];
    let mut results = Vec::new();
    for ctx in 1..=4 {
        results.push(p.ep.post_recv(&RecvWr::new(ctx, &sgl)));
    }
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    for r in [&results[1], &results[3]] {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RemoteOperation);
        assert!(e.message().contains("fault.fail_post"), "{e}");
    }
    assert_eq!(p.domain.stats().posts_failed, 2);
    assert_eq!(p.ep.state(), EndpointState::Connected);

    // The refused receives were never posted: two messages land in receives 1 and 3.
    let peer_sgl = [p.peer_mr.slice(0..8).unwrap()];
    p.peer_ep.post_send(&SendWr::send(10, &peer_sgl)).unwrap();
    p.peer_ep.post_send(&SendWr::send(11, &peer_sgl)).unwrap();
    let got = take(&p.cq, 2);
    let ctxs: Vec<u64> = got.iter().map(|(c, _)| c.context).collect();
    assert_eq!(ctxs, [1, 3]);
    assert!(got
        .iter()
        .all(|(c, _)| c.is_ok() && c.opcode == Opcode::Recv && c.byte_len == 8));
    take(&p.peer_cq, 2);
}

#[test]
fn delayed_completions_arrive_later_and_in_order() {
    const DELAY: Duration = Duration::from_millis(300);
    let p = pair(faults(FaultConfig::new().delay(Trigger::every(2), DELAY)));
    let sgl = [p.mr.slice(0..16).unwrap()];
    let remote = p.peer_mr.desc();
    // The first completion is not chosen: it comes as soon as the provider has it.
    p.ep.post_send(&SendWr::write(1, &sgl, remote.at(0)))
        .unwrap();
    assert_eq!(take(&p.cq, 1)[0].0.context, 1);

    // The second is chosen: the provider has it, the hooked queue holds it back.
    let t0 = Instant::now();
    p.ep.post_send(&SendWr::write(2, &sgl, remote.at(16)))
        .unwrap();
    assert!(
        p.cq.inner().wait(PATIENCE).unwrap(),
        "the provider completes the write"
    );
    let mut early = Vec::new();
    assert_eq!(p.cq.poll(&mut early, 8).unwrap(), 0, "{early:?}");
    // The third is not chosen but waits behind the second: order is kept.
    p.ep.post_send(&SendWr::write(3, &sgl, remote.at(32)))
        .unwrap();
    let got = take(&p.cq, 2);
    let ctxs: Vec<u64> = got.iter().map(|(c, _)| c.context).collect();
    assert_eq!(ctxs, [2, 3]);
    assert!(got.iter().all(|(c, _)| c.is_ok()), "{got:?}");
    for (_, at) in &got {
        assert!(*at - t0 >= DELAY, "{:?}", *at - t0);
    }
    assert_eq!(p.domain.stats().completions_delayed, 1);
    assert_eq!(
        p.domain.stats(),
        FaultStats {
            completions_delayed: 1,
            ..FaultStats::default()
        }
    );
}

#[test]
fn a_dropped_completion_is_an_error_and_puts_the_endpoint_in_error() {
    let p = pair(faults(
        FaultConfig::new().drop_completions(Trigger::every(2), ErrorKind::RetryExceeded),
    ));
    let sgl = [p.mr.slice(0..16).unwrap()];
    let remote = p.peer_mr.desc();
    // One completion at a time, so the drop lands on a known operation.
    p.ep.post_send(&SendWr::write(1, &sgl, remote.at(0)))
        .unwrap();
    let first = take(&p.cq, 1);
    assert_eq!(first[0].0.status, Status::Success);
    p.ep.post_send(&SendWr::write(2, &sgl, remote.at(16)))
        .unwrap();
    // Receives outstanding when the endpoint fails are flushed, not lost.
    let rsgl = [p.mr.slice(64..128).unwrap()];
    p.ep.post_recv(&RecvWr::new(3, &rsgl)).unwrap();
    let got = take(&p.cq, 2);
    let (dropped, _) = &got[0];
    assert_eq!(dropped.context, 2);
    assert_eq!(dropped.opcode, Opcode::Write);
    assert_eq!(dropped.status, Status::Error(ErrorKind::RetryExceeded));
    assert_eq!(got[1].0.context, 3);
    assert_eq!(got[1].0.status, Status::Error(ErrorKind::Flushed));
    assert_eq!(p.ep.state(), EndpointState::Error);
    let e =
        p.ep.post_send(&SendWr::write(4, &sgl, remote.at(0)))
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidState);
    // The peer sees the connection end.
    assert_ne!(wait_not_connected(&p.peer_ep), EndpointState::Connected);
    let stats = p.domain.stats();
    assert_eq!(stats.completions_dropped, 1);
    // Nothing more arrives: every posted operation had exactly one completion.
    let mut more = Vec::new();
    p.cq.wait(Duration::from_millis(200)).unwrap();
    p.cq.poll(&mut more, 16).unwrap();
    assert!(more.is_empty(), "{more:?}");
}

#[test]
fn a_cut_connection_flushes_locally_and_the_peer_sees_it() {
    let p = pair(faults(FaultConfig::new().cut(Trigger::every(3))));
    // The peer has a receive outstanding: it must not hang.
    let peer_sgl = [p.peer_mr.slice(0..64).unwrap()];
    p.peer_ep.post_recv(&RecvWr::new(50, &peer_sgl)).unwrap();

    let sgl = [p.mr.slice(0..64).unwrap()];
    p.ep.post_recv(&RecvWr::new(1, &sgl)).unwrap();
    p.ep.post_recv(&RecvWr::new(2, &sgl)).unwrap();
    assert_eq!(p.ep.state(), EndpointState::Connected);
    // The third post is handed to the provider, then the connection is cut.
    p.ep.post_recv(&RecvWr::new(3, &sgl)).unwrap();
    assert_eq!(p.ep.state(), EndpointState::Error);
    let got = take(&p.cq, 3);
    let mut ctxs: Vec<u64> = got.iter().map(|(c, _)| c.context).collect();
    ctxs.sort();
    assert_eq!(ctxs, [1, 2, 3]);
    for (c, _) in &got {
        assert_eq!(c.status, Status::Error(ErrorKind::Flushed), "{c:?}");
    }
    let e = p.ep.post_recv(&RecvWr::new(4, &sgl)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidState);
    assert!(e.message().contains("cut"), "{e}");

    // The peer: a disconnect (or error), and its outstanding receive completes with an error.
    assert_ne!(wait_not_connected(&p.peer_ep), EndpointState::Connected);
    let peer = take(&p.peer_cq, 1);
    assert_eq!(peer[0].0.context, 50);
    assert!(!peer[0].0.is_ok(), "{:?}", peer[0].0);
    assert_eq!(p.domain.stats().connections_cut, 1);
}

#[test]
fn cut_connection_on_demand_and_seeded_probabilities_repeat() {
    let p = pair(faults(FaultConfig::new()));
    assert!(p.ep.cut_connection());
    assert!(!p.ep.cut_connection(), "only once");
    assert_eq!(p.ep.state(), EndpointState::Error);
    assert_ne!(wait_not_connected(&p.peer_ep), EndpointState::Connected);

    // The same seed refuses the same posts.
    let pattern = |seed: u64| {
        let p = pair(HookConfig {
            trace: false,
            fault: Some(
                FaultConfig::new()
                    .seed(seed)
                    .fail_post(Trigger::probability(0.5), ErrorKind::QueueFull),
            ),
        });
        let sgl = [p.mr.slice(0..8).unwrap()];
        (0..32)
            .map(|i| p.ep.post_recv(&RecvWr::new(i, &sgl)).is_ok())
            .collect::<Vec<_>>()
    };
    let a = pattern(77);
    assert_eq!(a, pattern(77));
    assert!(a.iter().any(|&ok| ok) && a.iter().any(|&ok| !ok), "{a:?}");
}
