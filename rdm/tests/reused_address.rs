//! An endpoint that takes over the address of one that went away, over tcp: a peer that was
//! looking for the old endpoint connects to it and, reading its name, closes that
//! connection at once, without a word on it. The new endpoint's first message to that peer
//! must not go out on the closed connection and be lost (as it was before 27cb72d: this
//! test failed in 2 runs of 3 without that change; the conformance case
//! `rdm.endpoint_in_a_reused_address_is_another_peer` polls the new endpoint meanwhile, and
//! lost the message on iwarp only, about one run in 60).

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric_rdm::{RdmCompletion, RdmConfig, RdmEndpoint, RecvBuf, Source};

fn tcp() -> Arc<AnyDomain> {
    let (d, _) = fabric::Selector::new()
        .providers("tcp")
        .and_then(|s| s.open())
        .expect("tcp domain");
    Arc::new(d)
}

/// Polls `ep` (progressing `other`) until the completion `ctx` comes, which must succeed.
fn until(ep: &RdmEndpoint, other: &RdmEndpoint, out: &mut Vec<RdmCompletion>, ctx: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            Instant::now() < deadline,
            "no completion {ctx}; have {out:?}"
        );
        other.progress().unwrap();
        ep.poll(out).unwrap();
        if let Some(i) = out.iter().position(|c| c.context == ctx) {
            let c = out.remove(i);
            assert!(c.is_ok(), "{c:?}");
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_message_does_not_go_out_on_a_connection_the_peer_closed_unread() {
    let (da, db) = (tcp(), tcp());
    let a = RdmEndpoint::new(da.clone(), RdmConfig::default()).unwrap();
    let b = RdmEndpoint::new(db.clone(), RdmConfig::default()).unwrap();
    let ab = a.av_insert(b.addr());
    let src = da.alloc(8, Access::LOCAL_WRITE).unwrap();
    let dst = Arc::new(db.alloc(8, Access::LOCAL_WRITE).unwrap());
    let (mut oa, mut ob) = (Vec::new(), Vec::new());
    b.trecv(Source::Any, 1, 0, RecvBuf::whole(dst), 10).unwrap();
    a.tsend(ab, 1, src.all(), 1).unwrap();
    until(&b, &a, &mut ob, 10);
    until(&a, &b, &mut oa, 1);

    // b goes away and c takes its address.
    let addr = b.addr();
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(10);
    let c = loop {
        let cfg = RdmConfig {
            bind: addr,
            ..RdmConfig::default()
        };
        match RdmEndpoint::new(db.clone(), cfg) {
            Ok(c) => break c,
            Err(e) => {
                assert!(Instant::now() < deadline, "binding {addr} again: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    while a.stats().connections > 0 {
        assert!(
            Instant::now() < deadline,
            "a never saw b's connection close"
        );
        a.progress().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    // a's send to b's handle connects to c, and a closes that connection on reading c's
    // name: the send is refused.
    let e = a.tsend(ab, 2, src.all(), 2).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
    // c does not look at its completions meanwhile: the close is known to its provider
    // (tcp's progress thread reads it at once), not yet to c.
    std::thread::sleep(Duration::from_millis(500));

    // c's first message to a reaches it.
    let back = Arc::new(da.alloc(8, Access::LOCAL_WRITE).unwrap());
    a.trecv(Source::Any, 3, 0, RecvBuf::whole(back.clone()), 30)
        .unwrap();
    let ca = c.av_insert_name(&a.name()).unwrap();
    let s2 = db.alloc(8, Access::LOCAL_WRITE).unwrap();
    s2.buffer().write(0, &7u64.to_le_bytes());
    c.tsend(ca, 3, s2.all(), 3).unwrap();
    let mut oc = Vec::new();
    until(&a, &c, &mut oa, 30);
    until(&c, &a, &mut oc, 3);
    assert_eq!(back.buffer().to_vec(0, 8), 7u64.to_le_bytes());
}
