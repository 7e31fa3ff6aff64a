//! Section 6 (and 7: nothing hangs): a backlog of provider bookkeeping. Many receives are
//! posted behind a long RDMA Write while the application never polls its send queue, then
//! everything must complete.
//!
//! Providers may send requests of their own when receives are posted (the iwarp
//! provider's credit updates, RDMA Writes into the peer's credit area) and take them from
//! a small budget of the send completion queue that only draining the queue refills. Here
//! the budget runs out while the long write still holds the send queue, so credits are
//! owed with no slot to send them, and the provider's own retry must reap the queue while
//! completions of that very endpoint wait in it. The verbs core once did that holding the
//! endpoint's lock, and the drain took the lock again: a self-deadlock. The case runs
//! under its own watchdog and reports a hang as one, naming the step.

use fabric::sync::mpsc;
use std::sync::Arc;

use fabric::sync::Mutex;
use std::time::{Duration, Instant};

use fabric::prelude::*;

use super::cases;
use crate::ensure;
use crate::harness::{next, region, Case, CaseResultOf, Ctx, Ctxt};

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "cq.receives_behind_long_write_unpolled", "6", OpSet::SEND | OpSet::WRITE => receives_behind_long_write;
    }
}

/// The long write, at most (capped by the providers' largest message): long enough to
/// still be in flight after every receive is posted (soft iWARP under emulation moves
/// some 100 MB/s).
const WRITE_MAX: u64 = 64 << 20;
/// Receives posted while the write is in flight: more than the iwarp provider's internal
/// budget of a two-entry send queue (2 x 5 + 64 on siw: one slot per credit update).
const RECVS: usize = 200;
/// The watchdog: well inside the harness's per-case limit, so a hang is named here.
const WATCHDOG: Duration = Duration::from_secs(60);

fn receives_behind_long_write(ctx: &Ctx) -> CaseResultOf {
    let step = Arc::new(Mutex::new(String::from("starting")));
    let (tx, rx) = mpsc::channel();
    let (c2, s2) = (ctx.clone(), step.clone());
    std::thread::Builder::new()
        .name("backlog body".into())
        .spawn(move || {
            let r = body(&c2, &s2);
            let _ = tx.send(r);
        })
        .map_err(|e| format!("spawning the case body: {e}"))?;
    match rx.recv_timeout(WATCHDOG) {
        Ok(r) => r,
        // The body keeps its endpoints and queues: a deadlocked provider cannot be torn
        // down, so they are left to the process.
        Err(_) => Err(format!(
            "hang: no progress within {WATCHDOG:?} while {} (the provider deadlocked or \
             lost work it owed)",
            step.lock().map(|s| s.clone()).unwrap_or_default()
        )),
    }
}

fn body(ctx: &Ctx, step: &Mutex<String>) -> CaseResultOf {
    let at = |s: String| {
        if let Ok(mut g) = step.lock() {
            *g = s;
        }
    };
    let da = ctx.domain()?;
    let db = ctx.target_domain()?;
    // The initiator: a send queue reporting into a two-entry queue it never polls until
    // the end, receives into a queue of their own.
    let send_cq = da.create_cq(2).ctx("create_cq(2)")?;
    let recv_cq = da.create_cq(RECVS).ctx("create_cq(RECVS)")?;
    let cqb = db.create_cq(2 * RECVS).ctx("create_cq(2 x RECVS)")?;
    let listener = db.listen(ctx.any_port()).ctx("listen")?;
    let mut cfg_a = EndpointConfig::new(&send_cq);
    cfg_a.recv_cq = &recv_cq;
    cfg_a.sq_depth = 32;
    cfg_a.rq_depth = RECVS as u32;
    let mut cfg_b = EndpointConfig::new(&cqb);
    cfg_b.sq_depth = RECVS as u32;
    cfg_b.rq_depth = 16;
    at("connecting".into());
    let addr = listener.local_addr();
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| da.connect(addr, &cfg_a));
        let accepted = listener.accept(&cfg_b, ctx.timeout);
        (h.join().expect("connect thread"), accepted)
    });
    let a = a.ctx("connect")?;
    let b = b.ctx("accept")?;

    let max = [ctx.info(), ctx.target_info()]
        .iter()
        .map(|i| i.caps.limits.max_msg_size)
        .fold(WRITE_MAX, u64::min);
    let write_len = max as usize;
    let src = region(&da, write_len, Access::empty())?;
    let dst = region(&db, write_len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    src.buffer().write(write_len - 8, b"lastword");
    let sinks = region(&da, RECVS * 64, Access::LOCAL_WRITE)?;
    let msgs = region(&db, RECVS * 8, Access::empty())?;
    for i in 0..RECVS {
        msgs.buffer().write(i * 8, &(i as u64).to_le_bytes());
    }

    at(format!("posting a {write_len}-byte write"));
    a.post_send(&SendWr::write(1, &[src.all()], dst.desc().at(0)))
        .ctx("post write")?;
    let t0 = Instant::now();
    for i in 0..RECVS {
        at(format!("posting receive {i} of {RECVS} behind the write"));
        a.post_recv(&RecvWr::new(
            100 + i as u64,
            &[sinks.slice(i * 64..(i + 1) * 64).ctx("slice")?],
        ))
        .ctx("post_recv")?;
    }
    let posting = t0.elapsed();
    // Never polling: the write completes meanwhile, and whatever the provider keeps
    // waiting in the device queue waits there.
    at(format!(
        "waiting unpolled (the receives took {posting:?} to post)"
    ));
    std::thread::sleep(Duration::from_secs(2));

    at("polling the send queue for the write's completion".into());
    let c = next(&send_cq, ctx.timeout)?;
    ensure!(
        c.context == 1 && c.opcode == Opcode::Write && c.status == Status::Success,
        "expected the write's success, got {c:?}"
    );
    ensure!(
        dst.buffer().to_vec(write_len - 8, 8) == b"lastword",
        "the write completed but its last bytes are not in target memory"
    );

    // Every receive must have been advertised to the peer: one send per receive, all of
    // them arrive (a credit update owed and never sent would hold the last sends).
    for i in 0..RECVS {
        at(format!("peer posting send {i} of {RECVS}"));
        b.post_send(&SendWr::send(
            1000 + i as u64,
            &[msgs.slice(i * 8..(i + 1) * 8).ctx("slice")?],
        ))
        .ctx("peer post_send")?;
    }
    for i in 0..RECVS {
        at(format!("waiting for receive {i} of {RECVS}"));
        let r = next(&recv_cq, ctx.timeout)?;
        ensure!(
            r.context == 100 + i as u64 && r.status == Status::Success && r.byte_len == 8,
            "receive {i}: expected context {} with 8 bytes, got {r:?}",
            100 + i
        );
        let got = sinks.buffer().to_vec(i * 64, 8);
        ensure!(
            got == (i as u64).to_le_bytes(),
            "receive {i} holds {got:?}, expected message {i}"
        );
    }
    for i in 0..RECVS {
        at(format!("peer waiting for send completion {i} of {RECVS}"));
        let s = next(&cqb, ctx.timeout)?;
        ensure!(
            s.context == 1000 + i as u64 && s.status == Status::Success,
            "peer send {i}: expected context {} success, got {s:?}",
            1000 + i
        );
    }
    at("closing".into());
    drop((a, b));
    Ok(())
}
