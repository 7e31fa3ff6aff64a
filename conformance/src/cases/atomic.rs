//! Section 5: atomics (64-bit fetch-and-add and compare-and-swap).

use std::time::Duration;

use fabric::prelude::*;

use super::cases;
use crate::ensure;
use crate::harness::{
    expect_err, expect_ok, next, region, wait_state, Case, CaseResultOf, Client, Ctx, Ctxt, Star,
};
use crate::peer::pattern;

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "atomic.fetch_add", "5", OpSet::FETCH_ADD => fetch_add;
        "atomic.fetch_add_wraps", "5", OpSet::FETCH_ADD => fetch_add_wraps;
        "atomic.compare_swap_success", "5", OpSet::COMPARE_SWAP => cas_success;
        "atomic.compare_swap_failure", "5", OpSet::COMPARE_SWAP => cas_failure;
        "atomic.misaligned_target", "5", OpSet::FETCH_ADD => misaligned;
        "atomic.needs_remote_atomic_access", "5", OpSet::FETCH_ADD => needs_remote_atomic;
        "atomic.many_endpoints_one_counter", "5", OpSet::FETCH_ADD => many_endpoints;
        "atomic.compare_swap_lock_handoff", "5", OpSet::ATOMICS | OpSet::READ | OpSet::WRITE => cas_lock;
        "atomic.two_processes", "5", OpSet::FETCH_ADD | OpSet::READ | OpSet::WRITE => two_processes;
    }
}

/// A value whose bytes all differ, so any byte-order mistake shows.
const ODD: u64 = 0x0102_0304_0506_0708;

/// Sentinel byte around the words under test.
const FENCE_BYTE: u8 = 0xA5;

/// Access of an atomic target region.
fn atomic_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_ATOMIC
}

/// The 64-bit word at `off` in `mr`, host byte order.
fn word(mr: &MemoryRegion, off: usize) -> u64 {
    u64::from_ne_bytes(mr.buffer().to_vec(off, 8).try_into().expect("8 bytes"))
}

/// Stores `v` at `off` in `mr`, host byte order.
fn set_word(mr: &MemoryRegion, off: usize, v: u64) {
    mr.buffer().write(off, &v.to_ne_bytes());
}

/// Checks that every byte of `mr` outside `[off, off + 8)` still holds [`FENCE_BYTE`].
fn fences_intact(mr: &MemoryRegion, off: usize, what: &str) -> CaseResultOf {
    let all = mr.buffer().to_vec(0, mr.len());
    let bad: Vec<usize> = all
        .iter()
        .enumerate()
        .filter(|&(i, &b)| !(off..off + 8).contains(&i) && b != FENCE_BYTE)
        .map(|(i, _)| i)
        .collect();
    ensure!(
        bad.is_empty(),
        "{what}: bytes outside the 8-byte word changed at offsets {bad:?}"
    );
    Ok(())
}

/// A target region of 64 bytes filled with [`FENCE_BYTE`] except the word at 8, plus a
/// 16-byte local result region filled with [`FENCE_BYTE`].
fn word_setup(p: &crate::harness::Pair, v: u64) -> Result<(MemoryRegion, MemoryRegion), String> {
    let target = region(&p.db, 64, atomic_access())?;
    target.buffer().fill(0, 64, FENCE_BYTE);
    set_word(&target, 8, v);
    let result = region(&p.da, 16, Access::LOCAL_WRITE)?;
    result.buffer().fill(0, 16, FENCE_BYTE);
    Ok((target, result))
}

/// Posts one atomic and returns the old value it brought back.
fn one_atomic(
    ep: &AnyEndpoint,
    cq: &AnyCq,
    result: &MemoryRegion,
    wr: SendWr<'_>,
) -> Result<u64, String> {
    let opcode = wr.opcode();
    ep.post_send(&wr).ctx("post atomic")?;
    expect_ok(cq, wr.context, opcode)?;
    Ok(word(result, 0))
}

fn fetch_add(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let (target, result) = word_setup(&p, ODD)?;
    let at = target.desc().at(8);
    let add = 0x0010_0000_0000_0101;
    let old = one_atomic(
        &p.a,
        &p.cqa,
        &result,
        SendWr::fetch_add(1, result.slice(0..8).ctx("slice")?, at, add),
    )?;
    ensure!(
        old == ODD,
        "fetch_add returned {old:#018x}, expected the old value {ODD:#018x} in host byte order"
    );
    ensure!(
        word(&target, 8) == ODD + add,
        "target word is {:#018x} after adding {add:#x} to {ODD:#018x}",
        word(&target, 8)
    );
    ensure!(
        result
            .buffer()
            .to_vec(8, 8)
            .iter()
            .all(|&b| b == FENCE_BYTE),
        "fetch_add wrote beyond its 8-byte result buffer"
    );
    fences_intact(&target, 8, "fetch_add")?;
    // A second one sees the first one's sum.
    let old = one_atomic(
        &p.a,
        &p.cqa,
        &result,
        SendWr::fetch_add(2, result.slice(0..8).ctx("slice")?, at, 1),
    )?;
    ensure!(
        old == ODD + add,
        "second fetch_add returned {old:#018x}, expected {:#018x}",
        ODD + add
    );
    ensure!(
        word(&target, 8) == ODD + add + 1,
        "target word is {:#018x} after the second add",
        word(&target, 8)
    );
    // The target took no part: no completion there.
    let mut out = Vec::new();
    ensure!(
        p.cqb.poll(&mut out, 4).ctx("poll")? == 0,
        "an atomic produced a target completion: {out:?}"
    );
    Ok(())
}

fn fetch_add_wraps(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let start = u64::MAX - 1;
    let (target, result) = word_setup(&p, start)?;
    let old = one_atomic(
        &p.a,
        &p.cqa,
        &result,
        SendWr::fetch_add(1, result.slice(0..8).ctx("slice")?, target.desc().at(8), 5),
    )?;
    ensure!(
        old == start,
        "fetch_add returned {old:#x}, expected {start:#x}"
    );
    ensure!(
        word(&target, 8) == 3,
        "u64::MAX - 1 + 5 left {:#x}, expected 3 (wrapping add)",
        word(&target, 8)
    );
    fences_intact(&target, 8, "wrapping fetch_add")
}

fn cas_success(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let (target, result) = word_setup(&p, ODD)?;
    let swap = 0xFEDC_BA98_7654_3210;
    let old = one_atomic(
        &p.a,
        &p.cqa,
        &result,
        SendWr::compare_swap(
            1,
            result.slice(0..8).ctx("slice")?,
            target.desc().at(8),
            ODD,
            swap,
        ),
    )?;
    ensure!(
        old == ODD,
        "compare_swap returned {old:#018x}, expected {ODD:#018x}"
    );
    ensure!(
        word(&target, 8) == swap,
        "matching compare_swap left {:#018x}, expected the swap value {swap:#018x}",
        word(&target, 8)
    );
    ensure!(
        result
            .buffer()
            .to_vec(8, 8)
            .iter()
            .all(|&b| b == FENCE_BYTE),
        "compare_swap wrote beyond its 8-byte result buffer"
    );
    fences_intact(&target, 8, "compare_swap")
}

fn cas_failure(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let (target, result) = word_setup(&p, ODD)?;
    let old = one_atomic(
        &p.a,
        &p.cqa,
        &result,
        SendWr::compare_swap(
            1,
            result.slice(0..8).ctx("slice")?,
            target.desc().at(8),
            ODD ^ 1,
            0x7777,
        ),
    )?;
    ensure!(
        old == ODD,
        "failed compare_swap returned {old:#018x}, expected the old value {ODD:#018x}"
    );
    ensure!(
        word(&target, 8) == ODD,
        "compare_swap with a wrong compare value changed the word to {:#018x}",
        word(&target, 8)
    );
    fences_intact(&target, 8, "failed compare_swap")
}

/// Not an error completion (docs/contract.md section 5): real RC hardware refuses the request at
/// post instead (rxe: `validate_send_wr` returns -EINVAL for a misaligned atomic address),
/// so every provider does that: InvalidArgument, the target untouched, the endpoint fine.
fn misaligned(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let target = region(&p.db, 64, atomic_access())?;
    target.buffer().fill(0, 64, FENCE_BYTE);
    let before = target.buffer().to_vec(0, 64);
    let result = region(&p.da, 8, Access::LOCAL_WRITE)?;
    for (what, at) in [("fetch_add", 4u64), ("compare_swap", 12)] {
        let wr = if what == "fetch_add" {
            SendWr::fetch_add(1, result.all(), target.desc().at(at), 0x0101_0101_0101_0101)
        } else {
            SendWr::compare_swap(1, result.all(), target.desc().at(at), 0, !0)
        };
        match p.a.post_send(&wr) {
            Err(e) if e.kind() == ErrorKind::InvalidArgument => {}
            other => return Err(format!("{what} at a target 8-byte misaligned by {} returned {other:?}, expected InvalidArgument at post", at % 8)),
        }
    }
    ensure!(
        target.buffer().to_vec(0, 64) == before,
        "misaligned atomic modified target memory (torn write): {:02x?}",
        target.buffer().to_vec(0, 16)
    );
    // Nothing was posted: the endpoint works on.
    set_word(&target, 8, 41);
    let old = one_atomic(
        &p.a,
        &p.cqa,
        &result,
        SendWr::fetch_add(2, result.all(), target.desc().at(8), 1),
    )?;
    ensure!(
        old == 41 && word(&target, 8) == 42,
        "aligned fetch_add after the refusal returned {old}, word {}",
        word(&target, 8)
    );
    Ok(())
}

fn needs_remote_atomic(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let target = region(
        &p.db,
        64,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    target.buffer().fill(0, 64, FENCE_BYTE);
    set_word(&target, 8, ODD);
    let result = region(&p.da, 8, Access::LOCAL_WRITE)?;
    p.a.post_send(&SendWr::fetch_add(1, result.all(), target.desc().at(8), 1))
        .ctx("post fetch_add")?;
    expect_err(&p.cqa, 1, ErrorKind::RemoteAccess)?;
    ensure!(
        word(&target, 8) == ODD,
        "atomic without REMOTE_ATOMIC access changed the word to {:#018x}",
        word(&target, 8)
    );
    fences_intact(&target, 8, "refused atomic")?;
    wait_state(&p.a, EndpointState::Error, Duration::from_secs(5))?;
    wait_state(&p.b, EndpointState::Error, Duration::from_secs(5))?;
    Ok(())
}

/// Runs `f` for every client on its own thread and collects the results in client order.
fn on_each<T: Send>(
    star: &Star,
    f: impl Fn(usize, &Client) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    std::thread::scope(|s| {
        let handles: Vec<_> = star
            .clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let f = &f;
                s.spawn(move || f(i, c))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                h.join()
                    .map_err(|_| format!("client {i} panicked"))?
                    .map_err(|e| format!("client {i}: {e}"))
            })
            .collect()
    })
}

fn many_endpoints(ctx: &Ctx) -> CaseResultOf {
    const CLIENTS: usize = 8;
    const EACH: usize = 250;
    const WINDOW: usize = 16;
    let star = ctx.star(CLIENTS)?;
    let counter = region(&star.server, 64, atomic_access())?;
    counter.buffer().fill(0, 64, FENCE_BYTE);
    set_word(&counter, 16, 0);
    let at = counter.desc().at(16);
    let olds = on_each(&star, |_, c| {
        let results = region(&c.domain, EACH * 8, Access::LOCAL_WRITE)?;
        let (mut posted, mut done) = (0usize, 0usize);
        while done < EACH {
            while posted < EACH && posted - done < WINDOW {
                let slot = results.slice(posted * 8..posted * 8 + 8).ctx("slice")?;
                c.ep.post_send(&SendWr::fetch_add(posted as u64, slot, at, 1))
                    .ctx("post fetch_add")?;
                posted += 1;
            }
            let comp = next(&c.cq, ctx.timeout)?;
            ensure!(
                comp.is_ok() && comp.opcode == Opcode::FetchAdd && comp.context == done as u64,
                "expected fetch_add {done} to complete successfully, got {comp:?}"
            );
            done += 1;
        }
        Ok((0..EACH).map(|i| word(&results, i * 8)).collect::<Vec<_>>())
    })?;
    let total = (CLIENTS * EACH) as u64;
    ensure!(
        word(&counter, 16) == total,
        "{CLIENTS} endpoints x {EACH} fetch_adds of 1 left the counter at {}, expected {total}",
        word(&counter, 16)
    );
    fences_intact(&counter, 16, "concurrent fetch_adds")?;
    for (i, v) in olds.iter().enumerate() {
        ensure!(
            v.windows(2).all(|w| w[0] < w[1]),
            "client {i}: old values on one endpoint are not increasing"
        );
    }
    let mut all: Vec<u64> = olds.into_iter().flatten().collect();
    all.sort_unstable();
    let dup = all.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]);
    ensure!(
        all.iter().copied().eq(0..total),
        "returned old values are not exactly 0..{total} (duplicate {dup:?}, first {:?}, last {:?})",
        all.first(),
        all.last()
    );
    Ok(())
}

fn cas_lock(ctx: &Ctx) -> CaseResultOf {
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 50;
    let star = ctx.star(CLIENTS)?;
    let shared = region(
        &star.server,
        128,
        Access::LOCAL_WRITE | Access::REMOTE_ATOMIC | Access::REMOTE_READ | Access::REMOTE_WRITE,
    )?;
    // Lock word at 0, counter at 64 (a different cache line).
    set_word(&shared, 0, 0);
    set_word(&shared, 64, 0);
    let lock = shared.desc().at(0);
    let count = shared.desc().at(64);
    let seen = on_each(&star, |i, c| {
        let me = i as u64 + 1;
        let res = region(&c.domain, 8, Access::LOCAL_WRITE)?;
        let val = region(&c.domain, 8, Access::LOCAL_WRITE)?;
        let mut ctxid = 0u64;
        let mut seen = Vec::with_capacity(ROUNDS);
        let mut tries = 0u64;
        for round in 0..ROUNDS {
            loop {
                ctxid += 1;
                tries += 1;
                ensure!(tries < 1_000_000, "lock never acquired (round {round})");
                let old = one_atomic(
                    &c.ep,
                    &c.cq,
                    &res,
                    SendWr::compare_swap(ctxid, res.all(), lock, 0, me),
                )?;
                if old == 0 {
                    break;
                }
                ensure!(
                    old != me,
                    "lock word says we ({me}) hold it before we acquired it"
                );
                ensure!(
                    old <= CLIENTS as u64,
                    "lock word holds {old:#x}, not a client id"
                );
                std::thread::yield_now();
            }
            ctxid += 1;
            c.ep.post_send(&SendWr::read(ctxid, &[val.all()], count))
                .ctx("post read")?;
            expect_ok(&c.cq, ctxid, Opcode::Read)?;
            let v = word(&val, 0);
            seen.push(v);
            set_word(&val, 0, v + 1);
            ctxid += 1;
            c.ep.post_send(&SendWr::write(ctxid, &[val.all()], count))
                .ctx("post write")?;
            expect_ok(&c.cq, ctxid, Opcode::Write)?;
            ctxid += 1;
            let old = one_atomic(
                &c.ep,
                &c.cq,
                &res,
                SendWr::compare_swap(ctxid, res.all(), lock, me, 0),
            )?;
            ensure!(
                old == me,
                "releasing: lock word held {old}, expected our id {me} (mutual exclusion broken)"
            );
        }
        Ok(seen)
    })?;
    let total = (CLIENTS * ROUNDS) as u64;
    ensure!(
        word(&shared, 64) == total,
        "counter is {} after {total} locked increments (lost updates)",
        word(&shared, 64)
    );
    ensure!(
        word(&shared, 0) == 0,
        "lock word is {} at the end, expected 0 (released)",
        word(&shared, 0)
    );
    let mut all: Vec<u64> = seen.into_iter().flatten().collect();
    all.sort_unstable();
    ensure!(
        all.iter().copied().eq(0..total),
        "the values read inside the critical sections are not exactly 0..{total}: a read \
         missed an earlier write or two holders overlapped"
    );
    Ok(())
}

fn two_processes(ctx: &Ctx) -> CaseResultOf {
    const OFF: usize = 4096;
    const N: u64 = 100;
    let peer = ctx.peer(&["--mode", "idle"])?;
    let local = region(&peer.domain, 64, Access::LOCAL_WRITE)?;
    local.buffer().fill(0, 64, 0);
    let at = peer.desc.at(OFF as u64);
    // The peer's bytes start as pattern(i): zero the word first.
    peer.ep
        .post_send(&SendWr::write(1, &[local.slice(0..8).ctx("slice")?], at))
        .ctx("post write")?;
    expect_ok(&peer.cq, 1, Opcode::Write)?;
    for i in 0..N {
        let old = one_atomic(
            &peer.ep,
            &peer.cq,
            &local,
            SendWr::fetch_add(100 + i, local.slice(0..8).ctx("slice")?, at, 1),
        )?;
        ensure!(
            old == i,
            "fetch_add {i} on the peer process returned {old}, expected {i}"
        );
    }
    peer.ep
        .post_send(&SendWr::read(
            2,
            &[local.slice(8..32).ctx("slice")?],
            peer.desc.at(OFF as u64 - 8),
        ))
        .ctx("post read")?;
    expect_ok(&peer.cq, 2, Opcode::Read)?;
    let got = word(&local, 16);
    ensure!(got == N, "peer's word is {got} after {N} fetch_adds of 1");
    let around = local.buffer().to_vec(8, 24);
    ensure!(
        (0..8).all(|i| around[i] == pattern(OFF - 8 + i))
            && (16..24).all(|i| around[i] == pattern(OFF - 8 + i)),
        "bytes next to the peer's word changed: {around:02x?}"
    );
    Ok(())
}
