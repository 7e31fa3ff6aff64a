//! Section 9: reliable datagram endpoints and tagged messages (`fabric-rdm`), on every
//! provider. Multi-process cases start their peers as `fabric rdm-peer` processes.

use fabric::sync::mpsc;
use std::io::Write;
use std::net::SocketAddr;
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric_rdm::{Peer, RdmCompletion, RdmConfig, RdmEndpoint, RdmOp, RdmStatus, RecvBuf, Source};

use super::cases;
use crate::ensure;
use crate::harness::{note, region, Case, CaseResultOf, Ctx, Ctxt};

/// What every case needs: messages, RDMA Read (rendezvous) and the receiver-not-ready wait
/// (a message sent right after connecting may arrive before the acceptor posted its
/// receive buffers; after that, credits keep senders behind posted buffers).
const MSG: OpSet = OpSet::SEND.union(OpSet::READ).union(OpSet::RNR_WAIT);

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "rdm.av_insert_remove_handles", "9", MSG => av_insert_remove;
        "rdm.connect_on_first_use", "9", MSG => connect_on_first_use;
        "rdm.peer_that_connects_first_is_named", "9", MSG => peer_connects_first;
        "rdm.untagged_in_order", "9", MSG => untagged_in_order;
        "rdm.many_peers_no_thread_per_peer", "9", MSG => many_peers;
        "rdm.endpoint_in_a_reused_address_is_another_peer", "9", MSG => reused_address;
        "rdm.rma_by_handle", "9", MSG | OpSet::WRITE => rma_by_handle;
        "rdm.atomics_by_handle", "9", MSG | OpSet::ATOMICS => atomics_by_handle;
        "rdm.dying_peer_among_healthy", "9", MSG => dying_peer;
        "tag.tag_and_ignore_mask", "9", MSG => tag_and_mask;
        "tag.first_posted_receive_wins", "9", MSG => first_posted_wins;
        "tag.non_overtaking_eager_and_rendezvous", "9", MSG => non_overtaking;
        "tag.many_senders_any_source", "9", MSG => many_senders;
        "tag.unexpected_flood_waits_bounded", "9", MSG => unexpected_flood;
        "tag.unexpected_then_posted", "9", MSG => unexpected_then_posted;
        "tag.truncating_receive", "9", MSG => truncating;
        "tag.truncating_receive_two_processes", "9", MSG => truncating_two_processes;
        "tag.probe_and_claim", "9", MSG => probe_claim;
        "tag.synchronous_send_waits_for_match", "9", MSG => sync_send;
        "tag.cancel_receive", "9", MSG => cancel;
        "tag.multi_receive", "9", MSG => multi_receive;
        "tag.sizes_across_protocols", "9", MSG => sizes;
        "tag.send_buffer_reusable_at_completion", "9", MSG => buffer_reusable;
        "tag.staged_rendezvous_without_remote_read", "9", MSG => staged_rendezvous;
    }
}

/// Two RDM endpoints, each in its own domain; `ab` names b in a's address vector.
struct RdmPair {
    da: Arc<AnyDomain>,
    db: Arc<AnyDomain>,
    a: RdmEndpoint,
    b: RdmEndpoint,
    ab: Peer,
}

fn cfg(ctx: &Ctx) -> RdmConfig {
    RdmConfig {
        bind: SocketAddr::new(ctx.bind, 0),
        connect_timeout: ctx.timeout,
        ..RdmConfig::default()
    }
}

fn rdm_pair(ctx: &Ctx) -> Result<RdmPair, String> {
    rdm_pair_with(ctx, cfg(ctx), cfg(ctx))
}

fn rdm_pair_with(ctx: &Ctx, ca: RdmConfig, cb: RdmConfig) -> Result<RdmPair, String> {
    let da = Arc::new(ctx.domain()?);
    let db = Arc::new(ctx.target_domain()?);
    let a = RdmEndpoint::new(da.clone(), ca).ctx("rdm endpoint a")?;
    let b = RdmEndpoint::new(db.clone(), cb).ctx("rdm endpoint b")?;
    let ab = a.av_insert_name(&b.name()).ctx("av_insert_name")?;
    Ok(RdmPair { da, db, a, b, ab })
}

fn fill(mr: &MemoryRegion, seed: u8) {
    let v: Vec<u8> = (0..mr.len())
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    mr.buffer().write(0, &v);
}

fn recv_region(d: &AnyDomain, len: usize) -> Result<Arc<MemoryRegion>, String> {
    Ok(Arc::new(region(
        d,
        len,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    )?))
}

/// Waits for the next completion of `ep` (progressing it).
fn next(ep: &RdmEndpoint, ctx: &Ctx) -> Result<RdmCompletion, String> {
    ep.next_completion(ctx.timeout)
        .ctx("waiting for an rdm completion")
}

/// Waits for completions with each context in `want`, progressing `others` meanwhile
/// (peers in this process make progress only when polled); returns them in `want`'s order.
fn expect_each(
    ep: &RdmEndpoint,
    others: &[&RdmEndpoint],
    want: &[u64],
    ctx: &Ctx,
) -> Result<Vec<RdmCompletion>, String> {
    let deadline = Instant::now() + ctx.timeout;
    let mut got: Vec<Option<RdmCompletion>> = vec![None; want.len()];
    let mut out = Vec::new();
    while got.iter().any(Option::is_none) {
        ensure!(
            Instant::now() < deadline,
            "waited {:?} for completions {want:?}; have {:?}",
            ctx.timeout,
            got.iter().flatten().map(|c| c.context).collect::<Vec<_>>()
        );
        for o in others {
            o.progress().ctx("progress")?;
        }
        out.clear();
        ep.wait(Duration::from_millis(5)).ctx("wait")?;
        ep.poll(&mut out).ctx("poll")?;
        for c in out.drain(..) {
            match want.iter().position(|&w| w == c.context) {
                Some(i) if got[i].is_none() => got[i] = Some(c),
                _ => {
                    return Err(format!(
                        "unexpected completion {c:?} (waiting for {want:?})"
                    ))
                }
            }
        }
    }
    Ok(got.into_iter().flatten().collect())
}

fn ok(c: &RdmCompletion) -> CaseResultOf {
    ensure!(c.is_ok(), "expected success, got {c:?}");
    Ok(())
}

/// Progresses both endpoints for `dur`, returning what completed on `ep`.
fn idle(
    ep: &RdmEndpoint,
    other: &RdmEndpoint,
    dur: Duration,
) -> Result<Vec<RdmCompletion>, String> {
    let end = Instant::now() + dur;
    let mut out = Vec::new();
    while Instant::now() < end {
        other.progress().ctx("progress")?;
        ep.poll(&mut out).ctx("poll")?;
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(out)
}

/// Progresses `other` and polls `ep` (keeping `ep`'s completions) until `done` holds, for at
/// most the run's timeout. For what must happen before a case goes on (a message arriving
/// unexpected): how long that takes is the machine's load, not a property of the provider.
fn idle_until(
    ep: &RdmEndpoint,
    other: &RdmEndpoint,
    ctx: &Ctx,
    what: &str,
    done: impl Fn() -> bool,
) -> Result<Vec<RdmCompletion>, String> {
    let end = Instant::now() + ctx.timeout;
    let mut out = Vec::new();
    while !done() {
        ensure!(Instant::now() < end, "waited {:?} for {what}", ctx.timeout);
        other.progress().ctx("progress")?;
        ep.poll(&mut out).ctx("poll")?;
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(out)
}

/// Progresses endpoints for `dur` without taking their completions.
fn spin(eps: &[&RdmEndpoint], dur: Duration) -> CaseResultOf {
    let end = Instant::now() + dur;
    while Instant::now() < end {
        for e in eps {
            e.progress().ctx("progress")?;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn av_insert_remove(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let src = region(&p.da, 64, Access::LOCAL_WRITE)?;
    let dst = recv_region(&p.db, 64)?;
    p.b.trecv(Source::Any, 1, 0, RecvBuf::whole(dst.clone()), 10)
        .ctx("trecv")?;
    p.a.tsend(p.ab, 1, src.slice(0..8).ctx("slice")?, 1)
        .ctx("tsend")?;
    let c = expect_each(&p.a, &[&p.b], &[1], ctx)?;
    ok(&c[0])?;
    ok(&expect_each(&p.b, &[&p.a], &[10], ctx)?[0])?;
    ensure!(
        p.a.av_insert_name(&p.b.name()).ctx("insert again")? == p.ab,
        "inserting the same name twice gave two handles"
    );
    ensure!(
        p.a.av_lookup(p.ab).ctx("lookup")? == p.b.addr(),
        "lookup names another address"
    );
    p.a.av_remove(p.ab).ctx("av_remove")?;
    let e =
        p.a.tsend(p.ab, 1, src.slice(0..8).ctx("slice")?, 2)
            .err()
            .ok_or("a send to a removed handle was accepted")?;
    ensure!(
        e.kind() == ErrorKind::InvalidArgument,
        "send to removed handle: {e}"
    );
    let e =
        p.a.trecv(
            Source::Peer(p.ab),
            1,
            0,
            RecvBuf::whole(recv_region(&p.da, 64)?),
            3,
        )
        .err()
        .ok_or("a receive from a removed handle was accepted")?;
    ensure!(
        e.kind() == ErrorKind::InvalidArgument,
        "receive from removed handle: {e}"
    );
    ensure!(
        p.a.av_insert_name(b"garbage").is_err(),
        "a malformed endpoint name was inserted"
    );
    let again = p.a.av_insert_name(&p.b.name()).ctx("reinsert")?;
    ensure!(
        again != p.ab,
        "a reinserted peer got the removed handle back"
    );
    p.b.trecv(Source::Any, 1, 0, RecvBuf::whole(dst), 11)
        .ctx("trecv")?;
    p.a.tsend(again, 1, src.slice(0..8).ctx("slice")?, 4)
        .ctx("tsend")?;
    ok(&expect_each(&p.a, &[&p.b], &[4], ctx)?[0])?;
    ok(&expect_each(&p.b, &[&p.a], &[11], ctx)?[0])
}

fn connect_on_first_use(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    ensure!(
        p.a.stats().connections == 0,
        "connected before any operation"
    );
    let src = region(&p.da, 16, Access::LOCAL_WRITE)?;
    src.buffer().write(0, b"first use");
    let dst = recv_region(&p.db, 16)?;
    p.b.trecv(Source::Any, 5, 0, RecvBuf::whole(dst.clone()), 2)
        .ctx("trecv")?;
    p.a.tsend(p.ab, 5, src.slice(0..9).ctx("slice")?, 1)
        .ctx("tsend")?;
    ok(&expect_each(&p.a, &[&p.b], &[1], ctx)?[0])?;
    let r = expect_each(&p.b, &[&p.a], &[2], ctx)?.remove(0);
    ok(&r)?;
    ensure!(r.len == 9 && r.tag == 5, "received {r:?}");
    ensure!(dst.buffer().to_vec(0, 9) == b"first use", "wrong bytes");
    let from = r.peer.ok_or("the receive does not name its source")?;
    ensure!(
        p.b.av_lookup(from).ctx("lookup")? == p.a.addr(),
        "the source handle names {:?}, not a's address {}",
        p.b.av_lookup(from),
        p.a.addr()
    );
    ensure!(
        p.a.stats().connections == 1 && p.b.stats().connections == 1,
        "connections: a {}, b {}",
        p.a.stats().connections,
        p.b.stats().connections
    );
    Ok(())
}

fn peer_connects_first(ctx: &Ctx) -> CaseResultOf {
    // b never inserted a: a's first message names a by a handle b can answer with.
    let p = rdm_pair(ctx)?;
    let src = region(&p.da, 16, Access::LOCAL_WRITE)?;
    let dst_b = recv_region(&p.db, 16)?;
    let dst_a = recv_region(&p.da, 16)?;
    p.b.trecv(Source::Any, 0, u64::MAX, RecvBuf::whole(dst_b.clone()), 1)
        .ctx("trecv")?;
    p.a.tsend(p.ab, 77, src.slice(0..4).ctx("slice")?, 1)
        .ctx("tsend")?;
    let r = expect_each(&p.b, &[&p.a], &[1], ctx)?.remove(0);
    ok(&r)?;
    let a_handle = r.peer.ok_or("no source handle")?;
    p.a.trecv(Source::Peer(p.ab), 78, 0, RecvBuf::whole(dst_a), 2)
        .ctx("trecv")?;
    let reply = region(&p.db, 16, Access::LOCAL_WRITE)?;
    p.b.tsend(a_handle, 78, reply.slice(0..3).ctx("slice")?, 3)
        .ctx("reply")?;
    let got = expect_each(&p.a, &[&p.b], &[1, 2], ctx)?;
    ok(&got[1])?;
    ensure!(got[1].peer == Some(p.ab), "reply from {:?}", got[1].peer);
    ok(&expect_each(&p.b, &[&p.a], &[3], ctx)?[0])?;
    ensure!(
        p.b.stats().connections == 1,
        "b made a second connection to answer: {}",
        p.b.stats().connections
    );
    Ok(())
}

fn untagged_in_order(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let n = 50u64;
    let src = region(&p.da, 8 * n as usize, Access::LOCAL_WRITE)?;
    for i in 0..n {
        src.buffer().write(8 * i as usize, &i.to_le_bytes());
        let s = src
            .slice(8 * i as usize..8 * (i as usize + 1))
            .ctx("slice")?;
        p.a.send(p.ab, s, i).ctx("send")?;
    }
    let dst = recv_region(&p.db, 8 * n as usize)?;
    let ids: Vec<u64> = (100..100 + n).collect();
    for i in 0..n as usize {
        p.b.recv(RecvBuf::new(dst.clone(), 8 * i, 8), 100 + i as u64)
            .ctx("recv")?;
    }
    let got = expect_each(&p.b, &[&p.a], &ids, ctx)?;
    for (i, c) in got.iter().enumerate() {
        ok(c)?;
        ensure!(c.op == RdmOp::Recv, "op {:?}", c.op);
        let v = u64::from_le_bytes(dst.buffer().to_vec(8 * i, 8).try_into().expect("8"));
        ensure!(v == i as u64, "receive {i} holds message {v}");
    }
    let sends: Vec<u64> = (0..n).collect();
    expect_each(&p.a, &[&p.b], &sends, ctx)?
        .iter()
        .try_for_each(ok)
}

fn threads() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

fn many_peers(ctx: &Ctx) -> CaseResultOf {
    let n = 48;
    let dh = Arc::new(ctx.domain()?);
    let hub = RdmEndpoint::new(dh.clone(), cfg(ctx)).ctx("hub")?;
    let dp = Arc::new(ctx.target_domain()?);
    let mut peers = Vec::new();
    for i in 0..n {
        peers.push(RdmEndpoint::new(dp.clone(), cfg(ctx)).ctx(&format!("peer {i}"))?);
    }
    let before = threads();
    let src = region(&dh, 8, Access::LOCAL_WRITE)?;
    let mut handles = Vec::new();
    for (i, p) in peers.iter().enumerate() {
        let h = hub.av_insert(p.addr());
        handles.push(h);
        hub.tsend(h, i as u64, src.slice(0..8).ctx("slice")?, i as u64)
            .ctx("tsend")?;
    }
    let ids: Vec<u64> = (0..n as u64).collect();
    let refs: Vec<&RdmEndpoint> = peers.iter().collect();
    expect_each(&hub, &refs, &ids, ctx)?
        .iter()
        .try_for_each(ok)?;
    let dst = recv_region(&dp, 8 * n)?;
    for (i, p) in peers.iter().enumerate() {
        p.trecv(
            Source::Any,
            i as u64,
            0,
            RecvBuf::new(dst.clone(), 8 * i, 8),
            1000,
        )
        .ctx("trecv")?;
        let c = expect_each(p, &[&hub], &[1000], ctx)?.remove(0);
        ok(&c)?;
        ensure!(c.tag == i as u64, "peer {i} got tag {}", c.tag);
    }
    let after = threads();
    ensure!(
        hub.stats().connections == n,
        "hub holds {} connections",
        hub.stats().connections
    );
    if let (Some(b), Some(a)) = (before, after) {
        // Other cases may run beside this one in the process: the bound leaves them room,
        // and a thread per peer would still exceed it.
        ensure!(
            a < b + n,
            "{n} connections from one endpoint added {} threads",
            a.saturating_sub(b)
        );
        note(format!(
            "{n} peers over one endpoint: {} connections, threads {b} -> {a}",
            n
        ));
    }
    // The hub first: its peers then see their connections close and need not linger.
    drop(hub);
    Ok(())
}

fn reused_address(ctx: &Ctx) -> CaseResultOf {
    // b goes away and c takes its address: a's handle for b does not reach c, and c's
    // messages come from a new handle (the name carries the endpoint's nonce).
    let p = rdm_pair(ctx)?;
    let src = region(&p.da, 8, Access::LOCAL_WRITE)?;
    let dst = recv_region(&p.db, 8)?;
    p.b.trecv(Source::Any, 1, 0, RecvBuf::whole(dst), 1)
        .ctx("trecv")?;
    p.a.tsend(p.ab, 1, src.all(), 1).ctx("tsend")?;
    ok(&expect_each(&p.a, &[&p.b], &[1], ctx)?[0])?;
    ok(&expect_each(&p.b, &[&p.a], &[1], ctx)?[0])?;
    let addr = p.b.addr();
    let a = p.a;
    let da = p.da;
    drop(p.b);
    // The listener's port may take a moment to be free again.
    let deadline = Instant::now() + ctx.timeout;
    let c = loop {
        let r = RdmEndpoint::new(
            p.db.clone(),
            RdmConfig {
                bind: addr,
                ..cfg(ctx)
            },
        );
        match r {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(format!("binding {addr} again: {e}")),
        }
    };
    // Once a saw b's connection go, sends to b's handle fail and never reach c.
    let deadline = Instant::now() + ctx.timeout;
    while a.stats().connections > 0 {
        ensure!(
            Instant::now() < deadline,
            "a never saw b's connection close"
        );
        a.progress().ctx("progress")?;
        std::thread::sleep(Duration::from_millis(2));
    }
    let cdst = recv_region(&p.db, 8)?;
    c.trecv(Source::Any, 0, u64::MAX, RecvBuf::whole(cdst), 5)
        .ctx("trecv")?;
    match a.tsend(p.ab, 2, src.all(), 2) {
        Err(e) => ensure!(
            e.kind() == ErrorKind::ConnectionRefused,
            "a send to the old endpoint's handle failed with {e}"
        ),
        Ok(()) => return Err("a send to the old endpoint's handle was accepted".into()),
    }
    let got = idle(&c, &a, ctx.slack(Duration::from_millis(100)))?;
    ensure!(
        got.is_empty(),
        "the new endpoint received what was sent to the old one: {got:?}"
    );
    // c's own message reaches a from a handle that is not b's.
    let back = recv_region(&da, 8)?;
    a.trecv(Source::Any, 3, 0, RecvBuf::whole(back), 30)
        .ctx("trecv")?;
    let ca = c.av_insert_name(&a.name()).ctx("insert")?;
    let s2 = region(&p.db, 8, Access::LOCAL_WRITE)?;
    c.tsend(ca, 3, s2.all(), 3).ctx("tsend")?;
    let r = expect_each(&a, &[&c], &[30], ctx)?.remove(0);
    ok(&r)?;
    ensure!(
        r.peer.is_some() && r.peer != Some(p.ab),
        "c's message came from {:?}, b's handle is {:?}",
        r.peer,
        p.ab
    );
    Ok(())
}

fn rma_by_handle(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let target = region(&p.db, 4096, Access::all())?;
    fill(&target, 9);
    let local = region(&p.da, 4096, Access::LOCAL_WRITE)?;
    local.buffer().write(0, b"written by handle");
    p.a.write(
        p.ab,
        &[local.slice(0..17).ctx("slice")?],
        target.desc().at(100),
        1,
    )
    .ctx("write")?;
    ok(&expect_each(&p.a, &[&p.b], &[1], ctx)?[0])?;
    p.a.read(
        p.ab,
        &[local.slice(1000..1200).ctx("slice")?],
        target.desc().at(2000),
        2,
    )
    .ctx("read")?;
    let c = expect_each(&p.a, &[&p.b], &[2], ctx)?.remove(0);
    ok(&c)?;
    ensure!(c.op == RdmOp::Read, "op {:?}", c.op);
    ensure!(
        target.buffer().to_vec(100, 17) == b"written by handle",
        "the write did not land"
    );
    ensure!(
        local.buffer().to_vec(1000, 200) == target.buffer().to_vec(2000, 200),
        "the read brought other bytes"
    );
    Ok(())
}

fn atomics_by_handle(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let target = region(&p.db, 64, Access::all())?;
    target.buffer().write(8, &40u64.to_ne_bytes());
    let res = region(&p.da, 16, Access::LOCAL_WRITE)?;
    p.a.fetch_add(
        p.ab,
        res.slice(0..8).ctx("slice")?,
        target.desc().at(8),
        2,
        1,
    )
    .ctx("fetch_add")?;
    ok(&expect_each(&p.a, &[&p.b], &[1], ctx)?[0])?;
    p.a.compare_swap(
        p.ab,
        res.slice(8..16).ctx("slice")?,
        target.desc().at(8),
        42,
        7,
        2,
    )
    .ctx("compare_swap")?;
    ok(&expect_each(&p.a, &[&p.b], &[2], ctx)?[0])?;
    let old1 = u64::from_ne_bytes(res.buffer().to_vec(0, 8).try_into().expect("8"));
    let old2 = u64::from_ne_bytes(res.buffer().to_vec(8, 8).try_into().expect("8"));
    let now = u64::from_ne_bytes(target.buffer().to_vec(8, 8).try_into().expect("8"));
    ensure!(
        (old1, old2, now) == (40, 42, 7),
        "fetch_add/compare_swap gave {old1}, {old2}, final {now}"
    );
    Ok(())
}

fn tag_and_mask(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let src = region(&p.da, 64, Access::LOCAL_WRITE)?;
    let dst = recv_region(&p.db, 64)?;
    p.b.trecv(
        Source::Any,
        0x1_0000_0100,
        0xff,
        RecvBuf::new(dst.clone(), 0, 8),
        1,
    )
    .ctx("trecv")?;
    src.buffer().write(0, b"nomatchAmatch!!B");
    p.a.tsend(p.ab, 0x1_0000_02ff, src.slice(0..8).ctx("slice")?, 10)
        .ctx("tsend")?;
    p.a.tsend(p.ab, 0x1_0000_01ab, src.slice(8..16).ctx("slice")?, 11)
        .ctx("tsend")?;
    let c = expect_each(&p.b, &[&p.a], &[1], ctx)?.remove(0);
    ok(&c)?;
    ensure!(c.tag == 0x1_0000_01ab, "matched tag {:#x}", c.tag);
    ensure!(
        dst.buffer().to_vec(0, 8) == b"match!!B",
        "matched the wrong message"
    );
    let pr = p.b.probe(Source::Any, 0x1_0000_02ff, 0).ctx("probe")?;
    ensure!(
        pr.is_some_and(|i| i.len == 8),
        "the unmatched message is not kept: {pr:?}"
    );
    p.b.trecv(Source::Any, 0, u64::MAX, RecvBuf::new(dst.clone(), 8, 8), 2)
        .ctx("trecv")?;
    let c = expect_each(&p.b, &[&p.a], &[2], ctx)?.remove(0);
    ensure!(
        c.is_ok() && c.tag == 0x1_0000_02ff,
        "wildcard receive got {c:?}"
    );
    ensure!(dst.buffer().to_vec(8, 8) == b"nomatchA", "wrong bytes");
    Ok(())
}

fn first_posted_wins(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let dst = recv_region(&p.db, 64)?;
    // The wildcard receive is posted first, then an exact one: the first message takes the
    // wildcard one, the second the exact one.
    let ba = p.b.av_insert(p.a.addr());
    p.b.trecv(Source::Any, 0, u64::MAX, RecvBuf::new(dst.clone(), 0, 8), 1)
        .ctx("trecv")?;
    p.b.trecv(Source::Peer(ba), 3, 0, RecvBuf::new(dst.clone(), 8, 8), 2)
        .ctx("trecv")?;
    let src = region(&p.da, 16, Access::LOCAL_WRITE)?;
    src.buffer().write(0, b"firstmsgsecondms");
    p.a.tsend(p.ab, 3, src.slice(0..8).ctx("slice")?, 10)
        .ctx("tsend")?;
    p.a.tsend(p.ab, 3, src.slice(8..16).ctx("slice")?, 11)
        .ctx("tsend")?;
    let got = expect_each(&p.b, &[&p.a], &[1, 2], ctx)?;
    got.iter().try_for_each(ok)?;
    ensure!(
        dst.buffer().to_vec(0, 16) == b"firstmsgsecondms",
        "receives got {:?}",
        String::from_utf8_lossy(&dst.buffer().to_vec(0, 16))
    );
    Ok(())
}

fn non_overtaking(ctx: &Ctx) -> CaseResultOf {
    // Eager and rendezvous messages mixed, same tag: matched in the order sent, whether
    // the receives are posted before (expected) or after (unexpected).
    let p = rdm_pair(ctx)?;
    let eager = RdmConfig::default().eager_max;
    let sizes: Vec<usize> = (0..24)
        .map(|i| if i % 3 == 1 { eager * 4 + i } else { 8 + i })
        .collect();
    let total: usize = sizes.iter().sum();
    let src = region(&p.da, total, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    let dst = recv_region(&p.db, total)?;
    let mut off = 0;
    let mut offs = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        src.buffer().fill(off, n, i as u8 + 1);
        offs.push(off);
        off += n;
    }
    // Half the receives posted first.
    let half = sizes.len() / 2;
    for i in 0..half {
        p.b.trecv(
            Source::Any,
            9,
            0,
            RecvBuf::new(dst.clone(), offs[i], sizes[i]),
            100 + i as u64,
        )
        .ctx("trecv")?;
    }
    for (i, &n) in sizes.iter().enumerate() {
        p.a.tsend(
            p.ab,
            9,
            src.slice(offs[i]..offs[i] + n).ctx("slice")?,
            i as u64,
        )
        .ctx("tsend")?;
    }
    spin(&[&p.a, &p.b], ctx.slack(Duration::from_millis(50)))?;
    for i in half..sizes.len() {
        p.b.trecv(
            Source::Any,
            9,
            0,
            RecvBuf::new(dst.clone(), offs[i], sizes[i]),
            100 + i as u64,
        )
        .ctx("trecv")?;
    }
    let ids: Vec<u64> = (100..100 + sizes.len() as u64).collect();
    let sends: Vec<u64> = (0..sizes.len() as u64).collect();
    let got = expect_each(&p.b, &[&p.a], &ids, ctx)?;
    for (i, c) in got.iter().enumerate() {
        ok(c)?;
        ensure!(
            c.len == sizes[i] as u64,
            "receive {i}: {} bytes, message was {}",
            c.len,
            sizes[i]
        );
        let b = dst.buffer().to_vec(offs[i], sizes[i]);
        ensure!(
            b.iter().all(|&x| x == i as u8 + 1),
            "receive {i} holds message {} (overtaken)",
            b[0] as i64 - 1
        );
    }
    expect_each(&p.a, &[&p.b], &sends, ctx)?
        .iter()
        .try_for_each(ok)
}

fn unexpected_then_posted(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let big = RdmConfig::default().eager_max * 8;
    let src = region(&p.da, big, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    fill(&src, 3);
    p.a.tsend(p.ab, 1, src.slice(0..100).ctx("slice")?, 1)
        .ctx("eager")?;
    p.a.tsend(p.ab, 2, src.all(), 2).ctx("rendezvous")?;
    // Both arrive unexpected (however long the machine takes to deliver them), and the
    // rendezvous send stays incomplete meanwhile and for a while after.
    let mut sent = idle_until(
        &p.a,
        &p.b,
        ctx,
        "both messages to arrive unexpected",
        || p.b.stats().unexpected >= 2,
    )?;
    sent.extend(idle(&p.a, &p.b, ctx.slack(Duration::from_millis(100)))?);
    ensure!(
        !sent.iter().any(|c| c.context == 2),
        "a rendezvous send completed before any receive matched it"
    );
    ensure!(
        p.b.stats().unexpected == 2,
        "b keeps {} unexpected",
        p.b.stats().unexpected
    );
    let dst = recv_region(&p.db, big)?;
    // Posted in the other order: tags tell them apart.
    p.b.trecv(Source::Any, 2, 0, RecvBuf::whole(dst.clone()), 20)
        .ctx("trecv")?;
    let small = recv_region(&p.db, 100)?;
    p.b.trecv(Source::Any, 1, 0, RecvBuf::whole(small.clone()), 10)
        .ctx("trecv")?;
    expect_each(&p.b, &[&p.a], &[20, 10], ctx)?
        .iter()
        .try_for_each(ok)?;
    ensure!(
        dst.buffer().to_vec(0, big) == src.buffer().to_vec(0, big),
        "rendezvous bytes differ"
    );
    ensure!(
        small.buffer().to_vec(0, 100) == src.buffer().to_vec(0, 100),
        "eager bytes differ"
    );
    let mut rest = sent.iter().map(|c| c.context).collect::<Vec<_>>();
    let more: Vec<u64> = [1u64, 2]
        .into_iter()
        .filter(|c| !rest.contains(c))
        .collect();
    if !more.is_empty() {
        expect_each(&p.a, &[&p.b], &more, ctx)?
            .iter()
            .try_for_each(ok)?;
        rest.extend(more);
    }
    Ok(())
}

fn truncating(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let big = RdmConfig::default().eager_max * 4;
    let src = region(&p.da, big, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    fill(&src, 5);
    let dst = recv_region(&p.db, 4096)?;
    dst.buffer().fill(0, 4096, 0xee);
    for (k, len) in [(0u64, 100usize), (1, big)] {
        p.b.trecv(Source::Any, k, 0, RecvBuf::new(dst.clone(), 0, 10), 10 + k)
            .ctx("trecv")?;
        p.a.tsend(p.ab, k, src.slice(0..len).ctx("slice")?, k)
            .ctx("tsend")?;
        let r = expect_each(&p.b, &[&p.a], &[10 + k], ctx)?.remove(0);
        ensure!(
            r.status == RdmStatus::Error(ErrorKind::LocalLength)
                && r.len == 10
                && r.msg_len == len as u64,
            "{len}-byte message into 10 bytes: {r:?}"
        );
        ensure!(
            dst.buffer().to_vec(0, 10) == src.buffer().to_vec(0, 10),
            "first bytes differ"
        );
        ensure!(
            dst.buffer().to_vec(10, 1) == [0xee],
            "a byte past the receive was written"
        );
        ok(&expect_each(&p.a, &[&p.b], &[k], ctx)?[0])?;
    }
    // Still usable.
    p.b.trecv(Source::Any, 7, 0, RecvBuf::new(dst.clone(), 0, 100), 20)
        .ctx("trecv")?;
    p.a.tsend(p.ab, 7, src.slice(0..100).ctx("slice")?, 7)
        .ctx("tsend")?;
    ok(&expect_each(&p.b, &[&p.a], &[20], ctx)?[0])?;
    ok(&expect_each(&p.a, &[&p.b], &[7], ctx)?[0])
}

fn probe_claim(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    ensure!(
        p.b.probe(Source::Any, 4, 0).ctx("probe")?.is_none(),
        "probe found a message before any was sent"
    );
    let src = region(&p.da, 64, Access::LOCAL_WRITE)?;
    src.buffer().write(0, b"claimed message");
    p.a.tsend(p.ab, 4, src.slice(0..15).ctx("slice")?, 1)
        .ctx("tsend")?;
    let deadline = Instant::now() + ctx.timeout;
    let info = loop {
        p.a.progress().ctx("progress")?;
        if let Some(i) = p.b.probe(Source::Any, 4, 0).ctx("probe")? {
            break i;
        }
        ensure!(Instant::now() < deadline, "probe never saw the message");
        std::thread::sleep(Duration::from_millis(1));
    };
    ensure!(info.tag == 4 && info.len == 15, "probe says {info:?}");
    ensure!(
        info.peer.map(|h| p.b.av_lookup(h).ok()) == Some(Some(p.a.addr())),
        "probe names source {:?}",
        info.peer
    );
    let (_, claim) =
        p.b.probe_claim(Source::Any, 4, 0)
            .ctx("claim")?
            .ok_or("claim found nothing")?;
    let other = recv_region(&p.db, 64)?;
    p.b.trecv(Source::Any, 4, 0, RecvBuf::whole(other), 2)
        .ctx("trecv")?;
    ensure!(
        idle(&p.b, &p.a, ctx.slack(Duration::from_millis(50)))?.is_empty(),
        "a posted receive took the claimed message"
    );
    let dst = recv_region(&p.db, 64)?;
    p.b.recv_claimed(claim, RecvBuf::whole(dst.clone()), 3)
        .ctx("recv_claimed")?;
    let c = expect_each(&p.b, &[&p.a], &[3], ctx)?.remove(0);
    ok(&c)?;
    ensure!(
        dst.buffer().to_vec(0, 15) == b"claimed message",
        "claimed bytes differ"
    );
    Ok(())
}

fn sync_send(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let big = RdmConfig::default().eager_max * 2;
    let src = region(&p.da, big, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    for (k, len) in [(1u64, 64usize), (2, big)] {
        p.a.tsend_sync(p.ab, k, src.slice(0..len).ctx("slice")?, k)
            .ctx("tsend_sync")?;
        let mut early = idle_until(&p.a, &p.b, ctx, "the message to arrive unexpected", || {
            p.b.stats().unexpected >= 1
        })?;
        early.extend(idle(&p.a, &p.b, ctx.slack(Duration::from_millis(200)))?);
        ensure!(
            early.is_empty(),
            "a {len}-byte synchronous send completed before any receive: {early:?}"
        );
        ensure!(
            p.b.stats().unexpected == 1,
            "the message did not arrive (unexpected {})",
            p.b.stats().unexpected
        );
        let dst = recv_region(&p.db, big)?;
        p.b.trecv(Source::Any, k, 0, RecvBuf::whole(dst), 10 + k)
            .ctx("trecv")?;
        ok(&expect_each(&p.a, &[&p.b], &[k], ctx)?[0])?;
        ok(&expect_each(&p.b, &[&p.a], &[10 + k], ctx)?[0])?;
    }
    Ok(())
}

fn cancel(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let dst = recv_region(&p.db, 64)?;
    let id =
        p.b.trecv(Source::Any, 6, 0, RecvBuf::new(dst.clone(), 0, 8), 1)
            .ctx("trecv")?;
    ensure!(
        p.b.cancel(id).ctx("cancel")?,
        "cancel of a posted receive said it had matched"
    );
    let c = expect_each(&p.b, &[&p.a], &[1], ctx)?.remove(0);
    ensure!(
        c.status == RdmStatus::Canceled,
        "cancelled receive completed {c:?}"
    );
    ensure!(
        !p.b.cancel(id).ctx("cancel again")?,
        "a receive was cancelled twice"
    );
    let src = region(&p.da, 8, Access::LOCAL_WRITE)?;
    src.buffer().write(0, b"after!!!");
    p.a.tsend(p.ab, 6, src.all(), 2).ctx("tsend")?;
    ok(&expect_each(&p.a, &[&p.b], &[2], ctx)?[0])?;
    // (An eager send completes once its payload is copied: the message may still be on its
    // way, so the receiver's unexpected count is not looked at here.) The new receive gets
    // it, and the cancelled one's bytes never change.
    p.b.trecv(Source::Any, 6, 0, RecvBuf::new(dst.clone(), 8, 8), 3)
        .ctx("trecv")?;
    ok(&expect_each(&p.b, &[&p.a], &[3], ctx)?[0])?;
    ensure!(dst.buffer().to_vec(8, 8) == b"after!!!", "wrong bytes");
    ensure!(
        dst.buffer().to_vec(0, 8) != b"after!!!",
        "the message went to the cancelled receive"
    );
    Ok(())
}

fn multi_receive(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let (buf_len, msg, min_free) = (32 * 1024, 3000usize, 4096);
    let dst = recv_region(&p.db, buf_len)?;
    p.b.recv_multi(RecvBuf::whole(dst.clone()), min_free, 50)
        .ctx("recv_multi")?;
    let src = region(&p.da, msg * 12, Access::LOCAL_WRITE)?;
    for i in 0..12 {
        src.buffer().fill(i * msg, msg, i as u8 + 1);
        p.a.send(
            p.ab,
            src.slice(i * msg..(i + 1) * msg).ctx("slice")?,
            i as u64,
        )
        .ctx("send")?;
    }
    // 32 KiB holds 10 messages of 3000 bytes before less than 4 KiB is left (2768 after 10).
    let fits = (0..).take_while(|k| buf_len - k * msg >= min_free).count();
    let mut placed = Vec::new();
    let mut released = false;
    let deadline = Instant::now() + ctx.timeout;
    let mut out = Vec::new();
    while !released {
        ensure!(
            Instant::now() < deadline,
            "multi-receive: {} messages, no release",
            placed.len()
        );
        p.a.progress().ctx("progress")?;
        p.b.wait(Duration::from_millis(5)).ctx("wait")?;
        p.b.poll(&mut out).ctx("poll")?;
        for c in out.drain(..) {
            ensure!(
                c.context == 50 && c.op == RdmOp::MultiRecv,
                "completion {c:?}"
            );
            match c.status {
                RdmStatus::Success => placed.push(c),
                RdmStatus::Released => released = true,
                _ => return Err(format!("multi-receive completed {c:?}")),
            }
        }
    }
    ensure!(
        placed.len() == fits,
        "{} messages placed, expected {fits}",
        placed.len()
    );
    for (i, c) in placed.iter().enumerate() {
        ensure!(
            c.offset == (i * msg) as u64 && c.len == msg as u64,
            "message {i}: {c:?}"
        );
        ensure!(
            dst.buffer()
                .to_vec(i * msg, msg)
                .iter()
                .all(|&b| b == i as u8 + 1),
            "message {i} bytes differ"
        );
    }
    // The rest wait for the next buffer.
    let dst2 = recv_region(&p.db, buf_len)?;
    p.b.recv_multi(RecvBuf::whole(dst2.clone()), min_free, 51)
        .ctx("recv_multi")?;
    let mut got = 0;
    while got < 12 - fits {
        ensure!(Instant::now() < deadline, "second multi-receive got {got}");
        p.a.progress().ctx("progress")?;
        p.b.wait(Duration::from_millis(5)).ctx("wait")?;
        p.b.poll(&mut out).ctx("poll")?;
        for c in out.drain(..) {
            ok(&c)?;
            ensure!(c.context == 51, "completion {c:?}");
            ensure!(
                dst2.buffer()
                    .to_vec(c.offset as usize, msg)
                    .iter()
                    .all(|&b| b == (fits + got) as u8 + 1),
                "second buffer: message {got} bytes differ"
            );
            got += 1;
        }
    }
    Ok(())
}

fn sizes(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let e = RdmConfig::default().eager_max;
    let max = 16 << 20;
    let src = region(&p.da, max, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    fill(&src, 11);
    let dst = recv_region(&p.db, max)?;
    for (k, len) in [0usize, 1, e - 1, e, e + 1, 1 << 20, max]
        .into_iter()
        .enumerate()
    {
        let k = k as u64;
        dst.buffer().fill(0, len.min(max), 0);
        p.b.trecv(Source::Any, k, 0, RecvBuf::whole(dst.clone()), 100 + k)
            .ctx("trecv")?;
        p.a.tsend(p.ab, k, src.slice(0..len).ctx("slice")?, k)
            .ctx("tsend")?;
        let r = expect_each(&p.b, &[&p.a], &[100 + k], ctx)?.remove(0);
        ensure!(r.is_ok() && r.len == len as u64, "{len} bytes: {r:?}");
        ensure!(
            dst.buffer().to_vec(0, len) == src.buffer().to_vec(0, len),
            "{len}-byte message differs"
        );
        ok(&expect_each(&p.a, &[&p.b], &[k], ctx)?[0])?;
    }
    Ok(())
}

fn buffer_reusable(ctx: &Ctx) -> CaseResultOf {
    let p = rdm_pair(ctx)?;
    let e = RdmConfig::default().eager_max;
    for (k, len) in [(1u64, 512usize), (2, e * 3)] {
        let src = region(&p.da, len, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
        src.buffer().fill(0, len, 0xaa);
        let dst = recv_region(&p.db, len)?;
        p.b.trecv(Source::Any, k, 0, RecvBuf::whole(dst.clone()), 10 + k)
            .ctx("trecv")?;
        p.a.tsend(p.ab, k, src.all(), k).ctx("tsend")?;
        ok(&expect_each(&p.a, &[&p.b], &[k], ctx)?[0])?;
        src.buffer().fill(0, len, 0x55);
        ok(&expect_each(&p.b, &[&p.a], &[10 + k], ctx)?[0])?;
        ensure!(
            dst.buffer().to_vec(0, len).iter().all(|&b| b == 0xaa),
            "{len} bytes: reusing the buffer after the send completed changed what arrived"
        );
    }
    Ok(())
}

fn staged_rendezvous(ctx: &Ctx) -> CaseResultOf {
    // A large send from memory the peer may not read is staged, invisibly.
    let p = rdm_pair(ctx)?;
    let len = RdmConfig::default().eager_max * 5;
    let src = region(&p.da, len, Access::LOCAL_WRITE)?;
    fill(&src, 21);
    let dst = recv_region(&p.db, len)?;
    p.b.trecv(Source::Any, 3, 0, RecvBuf::whole(dst.clone()), 9)
        .ctx("trecv")?;
    p.a.tsend(p.ab, 3, src.all(), 1).ctx("tsend")?;
    ok(&expect_each(&p.b, &[&p.a], &[9], ctx)?[0])?;
    ok(&expect_each(&p.a, &[&p.b], &[1], ctx)?[0])?;
    ensure!(
        dst.buffer().to_vec(0, len) == src.buffer().to_vec(0, len),
        "bytes differ"
    );
    Ok(())
}

// ---- Multi-process cases: peers are `fabric rdm-peer` processes. ----

/// A peer process (see `fabric rdm-peer`).
struct RdmPeer {
    child: Child,
    name: Vec<u8>,
    lines: mpsc::Receiver<String>,
}

impl RdmPeer {
    fn start(ctx: &Ctx, me: &RdmEndpoint, args: &[&str]) -> Result<Self, String> {
        let (child, lines) = crate::peer::spawn(ctx, "rdm-peer", args)?;
        let mut p = RdmPeer {
            child,
            name: Vec::new(),
            lines,
        };
        let l = p.line(ctx.timeout)?;
        p.name = l
            .strip_prefix("NAME ")
            .and_then(unhex)
            .ok_or_else(|| format!("rdm-peer said {l:?}, expected NAME <hex>"))?;
        let stdin = p.child.stdin.as_mut().expect("piped");
        writeln!(stdin, "PEER {}", hex(&me.name())).map_err(|e| e.to_string())?;
        stdin.flush().map_err(|e| e.to_string())?;
        Ok(p)
    }

    fn line(&self, timeout: Duration) -> Result<String, String> {
        self.lines
            .recv_timeout(timeout)
            .map_err(|_| format!("rdm-peer said nothing within {timeout:?}"))
    }
}

impl Drop for RdmPeer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

fn my_endpoint(ctx: &Ctx, c: RdmConfig) -> Result<(Arc<AnyDomain>, RdmEndpoint), String> {
    let d = Arc::new(ctx.domain()?);
    let ep = RdmEndpoint::new(d.clone(), c).ctx("rdm endpoint")?;
    Ok((d, ep))
}

fn many_senders(ctx: &Ctx) -> CaseResultOf {
    let (d, me) = my_endpoint(ctx, cfg(ctx))?;
    let (senders, count) = (4usize, 200usize);
    let mut peers = Vec::new();
    for _ in 0..senders {
        let c = count.to_string();
        peers.push(RdmPeer::start(
            ctx,
            &me,
            &[
                "--mode", "send", "--count", &c, "--size", "64", "--tag", "7",
            ],
        )?);
    }
    let handles: Vec<Peer> = peers
        .iter()
        .map(|p| me.av_insert_name(&p.name))
        .collect::<fabric::Result<_>>()
        .ctx("av_insert_name")?;
    let total = senders * count;
    let dst = recv_region(&d, total * 64)?;
    for i in 0..total {
        me.trecv(
            Source::Any,
            7,
            0,
            RecvBuf::new(dst.clone(), i * 64, 64),
            i as u64,
        )
        .ctx("trecv")?;
    }
    let mut next_from = vec![0u64; senders];
    for _ in 0..total {
        let c = next(&me, ctx)?;
        ok(&c)?;
        let s = handles
            .iter()
            .position(|h| Some(*h) == c.peer)
            .ok_or_else(|| format!("message from unknown source {:?}", c.peer))?;
        let b = dst.buffer().to_vec(c.context as usize * 64, 16);
        let seq = u64::from_le_bytes(b[..8].try_into().expect("8"));
        ensure!(
            seq == next_from[s],
            "sender {s}: message {seq} where {} was due",
            next_from[s]
        );
        next_from[s] += 1;
    }
    for p in &peers {
        let l = p.line(ctx.timeout)?;
        ensure!(l == format!("SENT {count}"), "peer said {l:?}");
    }
    note(format!(
        "{senders} sender processes x {count} messages, any-source, per-source order kept"
    ));
    Ok(())
}

fn unexpected_flood(ctx: &Ctx) -> CaseResultOf {
    let bound = 256 << 10;
    let c = RdmConfig {
        max_unexpected_bytes: bound,
        ..cfg(ctx)
    };
    let slack = c.recv_depth as usize * (c.eager_max + 40 + 64);
    let (d, me) = my_endpoint(ctx, c)?;
    let (count, size) = (2000usize, 4096usize);
    let p = RdmPeer::start(
        ctx,
        &me,
        &[
            "--mode",
            "send",
            "--count",
            &count.to_string(),
            "--size",
            &size.to_string(),
            "--tag",
            "3",
        ],
    )?;
    let h = me.av_insert_name(&p.name).ctx("insert")?;
    let end = Instant::now() + Duration::from_millis(1500);
    let mut peak = 0;
    while Instant::now() < end {
        me.progress().ctx("progress")?;
        peak = peak.max(me.stats().unexpected_bytes);
        std::thread::sleep(Duration::from_millis(2));
    }
    let held = me.stats().unexpected;
    ensure!(
        peak <= bound + slack,
        "unexpected storage grew to {peak} bytes (bound {bound} + {slack} in flight)"
    );
    ensure!(
        held < count,
        "all {count} messages were kept unexpected: the sender never waited"
    );
    ensure!(
        p.lines.try_recv().is_err(),
        "the sender finished while the receiver held its messages"
    );
    let dst = recv_region(&d, size)?;
    for i in 0..count {
        me.trecv(Source::Peer(h), 3, 0, RecvBuf::whole(dst.clone()), i as u64)
            .ctx("trecv")?;
        let c = next(&me, ctx)?;
        ok(&c)?;
        let seq = u64::from_le_bytes(dst.buffer().to_vec(0, 8).try_into().expect("8"));
        ensure!(seq == i as u64, "message {seq} arrived as number {i}");
    }
    let l = p.line(ctx.timeout)?;
    ensure!(l == format!("SENT {count}"), "peer said {l:?}");
    note(format!(
        "{count} x {size} B flood: peak unexpected {peak} B (bound {bound}), {held} kept while the sender waited; all received in order"
    ));
    Ok(())
}

fn dying_peer(ctx: &Ctx) -> CaseResultOf {
    let (d, me) = my_endpoint(ctx, cfg(ctx))?;
    let mut peers = Vec::new();
    for _ in 0..3 {
        peers.push(RdmPeer::start(ctx, &me, &["--mode", "echo"])?);
    }
    let hs: Vec<Peer> = peers
        .iter()
        .map(|p| me.av_insert_name(&p.name))
        .collect::<fabric::Result<_>>()
        .ctx("insert")?;
    let src = region(&d, 64, Access::LOCAL_WRITE)?;
    let dst = recv_region(&d, 64 * 8)?;
    let mut ctxs = 0u64;
    let mut ping = |who: usize, me: &RdmEndpoint| -> Result<(u64, u64), String> {
        ctxs += 2;
        me.trecv(
            Source::Peer(hs[who]),
            1,
            0,
            RecvBuf::new(dst.clone(), who * 64, 64),
            ctxs,
        )
        .ctx("trecv")?;
        me.tsend(hs[who], 1, src.slice(0..16).ctx("slice")?, ctxs + 1)
            .ctx("tsend")?;
        Ok((ctxs, ctxs + 1))
    };
    for w in 0..3 {
        let (r, s) = ping(w, &me)?;
        expect_each(&me, &[], &[r, s], ctx)?
            .iter()
            .try_for_each(ok)?;
    }
    // A receive waits on peer 1; then it dies.
    let r_dead = 1000;
    me.trecv(
        Source::Peer(hs[1]),
        99,
        0,
        RecvBuf::new(dst.clone(), 64 * 4, 64),
        r_dead,
    )
    .ctx("trecv")?;
    let started = Instant::now();
    peers[1].child.kill().map_err(|e| format!("kill: {e}"))?;
    let c = expect_each(&me, &[], &[r_dead], ctx)?.remove(0);
    ensure!(
        matches!(c.status, RdmStatus::Error(_)),
        "a receive from the dead peer completed {c:?}"
    );
    let seen = started.elapsed();
    // Sends to it fail (at post, or by completion), within the bound.
    match me.tsend(hs[1], 1, src.slice(0..16).ctx("slice")?, 5000) {
        Err(_) => {}
        Ok(()) => {
            let c = expect_each(&me, &[], &[5000], ctx)?.remove(0);
            ensure!(!c.is_ok(), "a send to the dead peer succeeded");
        }
    }
    // The others still answer.
    for w in [0, 2] {
        let (r, s) = ping(w, &me)?;
        expect_each(&me, &[], &[r, s], ctx)?
            .iter()
            .try_for_each(ok)?;
    }
    note(format!(
        "peer killed: its receive failed {:?} after {seen:?}; the 2 other peer processes kept answering",
        c.status
    ));
    Ok(())
}

fn truncating_two_processes(ctx: &Ctx) -> CaseResultOf {
    // Another process sends 3 eager and 3 rendezvous messages; 16-byte receives take their
    // first bytes (the message's number), complete LocalLength, and the sender's sends all
    // complete normally (it reports SENT only then).
    let (d, me) = my_endpoint(ctx, cfg(ctx))?;
    let big = (RdmConfig::default().eager_max * 3).to_string();
    for (tag, size) in [("5", "300"), ("6", big.as_str())] {
        let p = RdmPeer::start(
            ctx,
            &me,
            &[
                "--mode", "send", "--count", "3", "--size", size, "--tag", tag,
            ],
        )?;
        let h = me.av_insert_name(&p.name).ctx("insert")?;
        let dst = recv_region(&d, 64)?;
        for i in 0..3u64 {
            dst.buffer().fill(0, 64, 0xee);
            me.trecv(
                Source::Peer(h),
                tag.parse().expect("tag"),
                0,
                RecvBuf::new(dst.clone(), 0, 16),
                i,
            )
            .ctx("trecv")?;
            let c = next(&me, ctx)?;
            ensure!(
                c.status == RdmStatus::Error(ErrorKind::LocalLength)
                    && c.len == 16
                    && c.msg_len == size.parse::<u64>().expect("size"),
                "{size}-byte message into 16 bytes: {c:?}"
            );
            let b = dst.buffer().to_vec(0, 17);
            ensure!(
                b[..8] == i.to_le_bytes()
                    && b[8..16].iter().all(|&x| x == i as u8)
                    && b[16] == 0xee,
                "{size}-byte message {i}: first bytes {:?}",
                &b
            );
        }
        let l = p.line(ctx.timeout)?;
        ensure!(l == "SENT 3", "the sender said {l:?}");
    }
    Ok(())
}
