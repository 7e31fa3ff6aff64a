//! Section 6: completions and errors (fields, order, unsignaled requests, the error state,
//! queue limits, waiting and polling, provider codes).

use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Token};

use fabric::prelude::*;

use super::cases;
use crate::ensure;
use crate::harness::{
    expect_err, expect_none, expect_ok, next, region, wait_state, Case, CaseResultOf, Ctx, Ctxt,
    PairOpts,
};

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "cq.completion_fields", "6", OpSet::SEND | OpSet::SEND_IMM => fields;
        "cq.completions_name_their_endpoint", "6", OpSet::SEND => name_their_endpoint;
        "cq.completions_in_post_order", "6", OpSet::SEND | OpSet::WRITE | OpSet::READ => post_order;
        "cq.unsignaled_no_completion", "6", OpSet::WRITE => unsignaled;
        "cq.drain_waits_for_unsignaled", "6", OpSet::WRITE => drain_unsignaled;
        "cq.unsignaled_error_among_unsignaled", "6", OpSet::WRITE => unsignaled_error;
        "cq.error_state_flushes_and_refuses", "6", OpSet::SEND | OpSet::WRITE => error_state;
        "cq.remote_access_error_both_ends", "6", OpSet::READ => remote_error_both_ends;
        "cq.overrun_refused", "6", OpSet::SEND | OpSet::RNR_WAIT => overrun_refused;
        "cq.send_queue_full", "6", OpSet::SEND | OpSet::RNR_WAIT => send_queue_full;
        "cq.recv_queue_full", "6", OpSet::SEND => recv_queue_full;
        "cq.refused_recv_not_queued", "6", OpSet::SEND | OpSet::RNR_WAIT => refused_recv_not_queued;
        "cq.wait_times_out", "6", OpSet::empty() => wait_times_out;
        "cq.wait_wakes_on_completion", "6", OpSet::SEND => wait_wakes;
        "cq.poll_non_blocking", "6", OpSet::SEND | OpSet::RNR_WAIT => poll_non_blocking;
        "cq.fd_readable_after_arm", "6", OpSet::SEND => fd_readable_after_arm;
        "cq.error_keeps_provider_code", "6", OpSet::WRITE => provider_code;
    }
}

/// Contexts that use all 64 bits, so a truncated or mixed-up context shows.
const CTX_SEND: u64 = 0xDEAD_BEEF_0000_0001;
const CTX_RECV: u64 = 0x8000_0000_FFFF_FFFE;

/// A remote address that no region grants: the region's address with the key inverted.
fn bad_key(desc: RemoteDesc) -> RemoteAddr {
    RemoteAddr {
        addr: desc.addr,
        key: !desc.key,
    }
}

/// Checks that a post is refused at once with `kind`.
fn refused(r: fabric::Result<()>, kind: ErrorKind, what: &str) -> CaseResultOf {
    match r {
        Err(e) if e.kind() == kind => Ok(()),
        other => Err(format!("{what}: expected {kind}, got {other:?}")),
    }
}

/// CPU time this thread has used, where the platform tells (Linux `schedstat`).
fn thread_cpu() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

fn fields(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    src.buffer().write(0, b"thirteen byte");
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(CTX_RECV, &[dst.all()]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(CTX_SEND, &[src.slice(0..13).ctx("slice")?]).with_imm(0xA1B2_C3D4))
        .ctx("post_send")?;
    let r = next(&p.cqb, ctx.timeout)?;
    ensure!(
        r.context == CTX_RECV
            && r.opcode == Opcode::Recv
            && r.status == Status::Success
            && r.byte_len == 13
            && r.imm == Some(0xA1B2_C3D4),
        "receive completion {r:?}, expected context {CTX_RECV:#x}, Recv, Success, 13 bytes, \
         immediate 0xa1b2c3d4"
    );
    let s = next(&p.cqa, ctx.timeout)?;
    ensure!(
        s.context == CTX_SEND && s.opcode == Opcode::Send && s.status == Status::Success,
        "send completion {s:?}, expected context {CTX_SEND:#x}, Send, Success"
    );
    // A plain send carries no immediate.
    p.b.post_recv(&RecvWr::new(5, &[dst.all()]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(6, &[src.slice(0..3).ctx("slice")?]))
        .ctx("post_send")?;
    let r = expect_ok(&p.cqb, 5, Opcode::Recv)?;
    ensure!(
        r.byte_len == 3 && r.imm.is_none(),
        "plain receive completion {r:?}, expected 3 bytes and no immediate"
    );
    expect_ok(&p.cqa, 6, Opcode::Send)?;
    // Where the provider offers them, the one-sided opcodes too.
    let ops = p.a.ops() & p.b.ops();
    let remote = region(
        &p.db,
        64,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
    )?;
    let local = region(&p.da, 64, Access::LOCAL_WRITE)?;
    if ops.contains(OpSet::WRITE_IMM) {
        p.b.post_recv(&RecvWr::new(7, &[dst.all()]))
            .ctx("post_recv")?;
        p.a.post_send(
            &SendWr::write(8, &[local.slice(0..21).ctx("slice")?], remote.desc().at(0))
                .with_imm(0x0102_0304),
        )
        .ctx("post write imm")?;
        let w = expect_ok(&p.cqa, 8, Opcode::Write)?;
        ensure!(
            w.imm.is_none(),
            "initiator's write completion has immediate {:?}",
            w.imm
        );
        let r = expect_ok(&p.cqb, 7, Opcode::RecvWriteWithImm)?;
        ensure!(
            r.imm == Some(0x0102_0304) && r.byte_len == 21,
            "write-with-immediate receive completion {r:?}, expected immediate 0x01020304 and 21 bytes"
        );
    }
    if ops.contains(OpSet::READ) {
        p.a.post_send(&SendWr::read(
            9,
            &[local.slice(0..16).ctx("slice")?],
            remote.desc().at(0),
        ))
        .ctx("post read")?;
        expect_ok(&p.cqa, 9, Opcode::Read)?;
    }
    if ops.contains(OpSet::FETCH_ADD) {
        p.a.post_send(&SendWr::fetch_add(
            10,
            local.slice(0..8).ctx("slice")?,
            remote.desc().at(8),
            1,
        ))
        .ctx("post fetch_add")?;
        expect_ok(&p.cqa, 10, Opcode::FetchAdd)?;
    }
    if ops.contains(OpSet::COMPARE_SWAP) {
        p.a.post_send(&SendWr::compare_swap(
            11,
            local.slice(0..8).ctx("slice")?,
            remote.desc().at(8),
            1,
            2,
        ))
        .ctx("post compare_swap")?;
        expect_ok(&p.cqa, 11, Opcode::CompareSwap)?;
    }
    Ok(())
}

fn post_order(ctx: &Ctx) -> CaseResultOf {
    const N: usize = 20;
    let p = ctx.pair()?;
    let atomics = (p.a.ops() & p.b.ops()).contains(OpSet::FETCH_ADD);
    let big = 128 << 10;
    let src = region(&p.da, big, Access::empty())?;
    src.buffer().fill(0, big, 0x3C);
    let sink = region(&p.da, N * 64, Access::LOCAL_WRITE)?;
    let target = region(
        &p.db,
        N * big,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
    )?;
    target.buffer().fill(0, N * big, 0x11);
    let counter = region(&p.db, 8, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
    let rq = region(&p.db, N * 4096, Access::LOCAL_WRITE)?;
    for i in 0..N {
        p.b.post_recv(&RecvWr::new(
            500 + i as u64,
            &[rq.slice(i * 4096..(i + 1) * 4096).ctx("slice")?],
        ))
        .ctx("post_recv")?;
    }
    // Alternate big and small requests of every kind, so an implementation that completes
    // whatever finishes first shows.
    let mut expected = Vec::with_capacity(N);
    let mut sends = 0u64;
    let mut adds = 0usize;
    for i in 0..N {
        let c = 1000 + i as u64;
        let kind = if atomics { i % 4 } else { i % 3 };
        let sgl_w = [src
            .slice(0..if i % 2 == 0 { big } else { 16 })
            .ctx("slice")?];
        let sgl_r = [sink.slice(i * 64..i * 64 + 64).ctx("slice")?];
        let sgl_s = [src
            .slice(0..if i % 2 == 0 { 4096 } else { 1 })
            .ctx("slice")?];
        let wr = match kind {
            0 => SendWr::write(c, &sgl_w, target.desc().at((i * big) as u64)),
            1 => SendWr::read(c, &sgl_r, target.desc().at(0)),
            2 => {
                sends += 1;
                SendWr::send(c, &sgl_s)
            }
            _ => {
                adds += 1;
                SendWr::fetch_add(
                    c,
                    sink.slice(i * 64..i * 64 + 8).ctx("slice")?,
                    counter.desc().at(0),
                    1,
                )
            }
        };
        expected.push((c, wr.opcode()));
        p.a.post_send(&wr).ctx(&format!("post request {i}"))?;
    }
    for (i, (c, op)) in expected.iter().enumerate() {
        let got = next(&p.cqa, ctx.timeout)?;
        ensure!(
            got.context == *c && got.opcode == *op && got.is_ok(),
            "send-queue completion {i}: got {got:?}, expected {op:?} success for context {c} \
             (completions must come in post order)"
        );
    }
    for j in 0..sends {
        let r = expect_ok(&p.cqb, 500 + j, Opcode::Recv)?;
        ensure!(
            r.byte_len == 4096 || r.byte_len == 1,
            "receive {j} has {} bytes",
            r.byte_len
        );
    }
    expect_none(&p.cqa, Duration::from_millis(50))?;
    let olds: Vec<u64> = (0..N)
        .filter(|i| atomics && i % 4 == 3)
        .map(|i| u64::from_ne_bytes(sink.buffer().to_vec(i * 64, 8).try_into().expect("8")))
        .collect();
    ensure!(
        olds.iter().copied().eq(0..adds as u64),
        "fetch_adds in post order returned {olds:?}"
    );
    Ok(())
}

fn unsignaled(ctx: &Ctx) -> CaseResultOf {
    const N: usize = 50;
    const CAP: usize = 8;
    let p = ctx.pair_with(PairOpts {
        cq_capacity: CAP,
        ..PairOpts::default()
    })?;
    let src = region(&p.da, N * 64, Access::empty())?;
    for i in 0..N {
        src.buffer().fill(i * 64, 64, i as u8 + 1);
    }
    let dst = region(&p.db, N * 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    // An unsignaled request may still complete in error, so while it is outstanding a
    // provider may count it against the queue (QueueFull at post); once it succeeded it
    // must not hold a slot, so every post goes through within the time limit.
    let deadline = Instant::now() + ctx.timeout;
    let mut refusals = 0u32;
    let mut post = |wr: &SendWr<'_>, what: &str| -> CaseResultOf {
        loop {
            match p.a.post_send(wr) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::QueueFull && Instant::now() < deadline => {
                    refusals += 1;
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(e) => {
                    return Err(format!(
                        "{what} with a {CAP}-entry queue: {e} ({refusals} QueueFull refusals \
                         so far: successful unsignaled writes keep holding queue slots)"
                    ))
                }
            }
        }
    };
    for i in 0..N {
        let sgl = [src.slice(i * 64..(i + 1) * 64).ctx("slice")?];
        post(
            &SendWr::write(i as u64, &sgl, dst.desc().at((i * 64) as u64)).unsignaled(),
            &format!("unsignaled write {i}"),
        )?;
    }
    let last = region(&p.da, 8, Access::empty())?;
    last.buffer().fill(0, 8, 0xFF);
    post(
        &SendWr::write(999, &[last.all()], dst.desc().at(0)),
        "signaled write after 50 unsignaled ones",
    )?;
    // The signaled write is the first and only completion.
    expect_ok(&p.cqa, 999, Opcode::Write)?;
    expect_none(&p.cqa, Duration::from_millis(100))?;
    ensure!(
        dst.buffer().to_vec(0, 8).iter().all(|&b| b == 0xFF),
        "signaled write did not land"
    );
    for i in 0..N {
        let lo = if i == 0 { 8 } else { i * 64 };
        ensure!(
            dst.buffer()
                .to_vec(lo, (i + 1) * 64 - lo)
                .iter()
                .all(|&b| b == i as u8 + 1),
            "unsignaled write {i} did not land"
        );
    }
    // None of the 50 holds a slot now: the whole capacity is free for signaled requests.
    for j in 0..CAP {
        p.a.post_send(&SendWr::write(
            2000 + j as u64,
            &[last.all()],
            dst.desc().at(0),
        ))
        .ctx(&format!(
            "signaled write {j} of {CAP} after the unsignaled ones (queue slots leaked)"
        ))?;
    }
    for j in 0..CAP {
        expect_ok(&p.cqa, 2000 + j as u64, Opcode::Write)?;
    }
    Ok(())
}

/// `drain` waits for unsignaled requests too, and returns once they completed, with no
/// completion queued for any of them; what comes next completes alone. (A provider may
/// post unsignaled requests without a device completion of their own, each run then
/// completed by a later request's: a run at the tail needs `drain` to end it.)
fn drain_unsignaled(ctx: &Ctx) -> CaseResultOf {
    const N: usize = 40;
    let p = ctx.pair()?;
    let src = region(&p.da, N * 64, Access::empty())?;
    for i in 0..N {
        src.buffer().fill(i * 64, 64, i as u8 + 1);
    }
    let dst = region(&p.db, N * 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    for i in 0..N {
        let sgl = [src.slice(i * 64..(i + 1) * 64).ctx("slice")?];
        p.a.post_send(&SendWr::write(i as u64, &sgl, dst.desc().at((i * 64) as u64)).unsignaled())
            .ctx(&format!("unsignaled write {i}"))?;
    }
    p.a.drain(ctx.timeout)
        .ctx("drain after unsignaled writes only")?;
    // Completed at the initiator: on a reliable connection, placed at the target.
    for i in 0..N {
        ensure!(
            dst.buffer()
                .to_vec(i * 64, 64)
                .iter()
                .all(|&b| b == i as u8 + 1),
            "unsignaled write {i} had not landed when drain returned"
        );
    }
    expect_none(&p.cqa, Duration::from_millis(100))?;
    let last = [src.slice(0..8).ctx("slice")?];
    p.a.post_send(&SendWr::write(999, &last, dst.desc().at(0)))
        .ctx("signaled write after the drain")?;
    expect_ok(&p.cqa, 999, Opcode::Write)?;
    expect_none(&p.cqa, Duration::from_millis(50))?;
    p.a.drain(ctx.timeout)
        .ctx("drain with nothing outstanding")?;
    Ok(())
}

/// An unsignaled request that fails among unsignaled ones: its error completes (an error
/// always does), those behind it complete Flushed, and the successful ones before it
/// report nothing.
///
/// On the tcp>iwarp pair siw sometimes resets the connection before its Terminate leaves
/// (see [`Attempt::TerminateLost`]): the case then runs again, up to
/// [`UNSIGNALED_ERROR_ATTEMPTS`] times in all, and fails if no run saw the Terminate. In
/// one guest boot it took a second run in 1 of 30 runs of the case alone; inside a whole
/// `scripts/test` two runs in a row once lost it.
fn unsignaled_error(ctx: &Ctx) -> CaseResultOf {
    let mut attempt = 1;
    loop {
        match unsignaled_error_once(ctx) {
            Ok(()) => return Ok(()),
            Err(Attempt::Failed(e)) => return Err(e),
            Err(Attempt::TerminateLost(why)) if attempt < UNSIGNALED_ERROR_ATTEMPTS => {
                eprintln!(
                    "note: cq.unsignaled_error_among_unsignaled [{}]: {why}; running it again",
                    ctx.provider
                );
                attempt += 1;
            }
            Err(Attempt::TerminateLost(why)) => {
                return Err(format!("{why}, in all {attempt} runs"));
            }
        }
    }
}

/// How many runs [`unsignaled_error`] takes at most when siw loses its Terminate.
const UNSIGNALED_ERROR_ATTEMPTS: u32 = 4;

/// Why one run of [`unsignaled_error`] failed.
enum Attempt {
    /// The case's expectation does not hold.
    Failed(String),
    /// The tcp provider against the iwarp provider on siw: siw reset the connection
    /// before its Terminate left, and the tcp provider blamed the oldest write it had no
    /// confirmation of, as docs/contract.md section 7 says it does ("a Terminate siw did
    /// not send"). Nothing names the refused write then; the attribution the case checks
    /// needs the Terminate.
    TerminateLost(String),
}

impl From<String> for Attempt {
    fn from(e: String) -> Self {
        Attempt::Failed(e)
    }
}

/// Whether `c`, the first completion of [`unsignaled_error_once`], is the tcp provider's
/// inference after siw reset the connection without its Terminate: a good write (0-4)
/// blamed, with no code of the peer's (a Terminate's would be there).
fn terminate_lost(ctx: &Ctx, c: &Completion) -> bool {
    ctx.initiator == "tcp"
        && ctx.target == "iwarp"
        && c.context < 5
        && c.status == Status::Error(ErrorKind::RemoteAccess)
        && c.provider_code.is_none()
}

fn unsignaled_error_once(ctx: &Ctx) -> Result<(), Attempt> {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 64 * 8, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let sgl = [src.all()];
    for i in 0..5u64 {
        p.a.post_send(&SendWr::write(i, &sgl, dst.desc().at(i * 64)).unsignaled())
            .ctx(&format!("unsignaled write {i}"))?;
    }
    p.a.post_send(&SendWr::write(50, &sgl, bad_key(dst.desc())).unsignaled())
        .ctx("unsignaled bad-key write")?;
    // Behind it: flushed if posted before the error came back, else refused.
    let mut behind = Vec::new();
    for i in 60..63u64 {
        match p
            .a
            .post_send(&SendWr::write(i, &sgl, dst.desc().at(0)).unsignaled())
        {
            Ok(()) => behind.push(i),
            Err(e) if e.kind() == ErrorKind::InvalidState => break,
            Err(e) => {
                return Err(format!("posting write {i} behind the bad one: {e}").into());
            }
        }
    }
    let c = next(&p.cqa, Duration::from_secs(10))?;
    if c.context != 50 || c.status != Status::Error(ErrorKind::RemoteAccess) {
        let why = format!(
            "the unsignaled bad-key write after five good ones: expected RemoteAccess for context 50, got {c:?}"
        );
        return Err(if terminate_lost(ctx, &c) {
            Attempt::TerminateLost(format!("{why} (siw sent no Terminate)"))
        } else {
            Attempt::Failed(why)
        });
    }
    for i in behind {
        expect_err(&p.cqa, i, ErrorKind::Flushed)
            .map_err(|e| format!("unsignaled write {i} behind the failed one: {e}"))?;
    }
    expect_none(&p.cqa, Duration::from_millis(100))
        .map_err(|e| format!("after the error and the flushes: {e}"))?;
    wait_state(&p.a, EndpointState::Error, Duration::from_secs(5))?;
    Ok(())
}

/// What [`error_state`] works on: a pair with requests outstanding behind a bad one.
struct ErrSetup {
    p: crate::harness::Pair,
    src: MemoryRegion,
    dst: MemoryRegion,
    rq: MemoryRegion,
    arq: MemoryRegion,
}

/// Posts a `lead`-byte valid write, a bad-key write, and five requests behind them; `None`
/// when the error came back before all five were posted (the lead write was too short to
/// keep them outstanding), so the caller retries with a longer one.
fn error_setup(ctx: &Ctx, lead: usize) -> Result<Option<ErrSetup>, String> {
    let p = ctx.pair()?;
    let src = region(&p.da, lead, Access::empty())?;
    let dst = region(&p.db, lead, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let rq = region(&p.db, 4 * 256, Access::LOCAL_WRITE)?;
    let arq = region(&p.da, 256, Access::LOCAL_WRITE)?;
    for i in 0..4u64 {
        p.b.post_recv(&RecvWr::new(
            100 + i,
            &[rq.slice(i as usize * 256..(i as usize + 1) * 256)
                .ctx("slice")?],
        ))
        .ctx("post_recv")?;
    }
    p.a.post_recv(&RecvWr::new(200, &[arq.all()]))
        .ctx("post_recv at the initiator")?;
    let small = [src.slice(0..1024).ctx("slice")?];
    // The long write keeps the connection busy while the requests behind the bad one are
    // posted, so they are still outstanding when the error arrives.
    p.a.post_send(&SendWr::write(1, &[src.all()], dst.desc().at(0)))
        .ctx("post the long write")?;
    p.a.post_send(&SendWr::write(2, &small, bad_key(dst.desc())))
        .ctx("post bad-key write")?;
    let behind = [
        SendWr::write(3, &small, dst.desc().at(0)),
        SendWr::write(4, &small, dst.desc().at(0)),
        SendWr::write(5, &small, dst.desc().at(0)),
        SendWr::write(6, &small, dst.desc().at(0)).unsignaled(),
        SendWr::send(7, &small),
    ];
    for wr in &behind {
        match p.a.post_send(wr) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::InvalidState => return Ok(None),
            Err(e) => {
                return Err(format!(
                    "posting request {} behind the bad one: {e}",
                    wr.context
                ))
            }
        }
    }
    Ok(Some(ErrSetup {
        p,
        src,
        dst,
        rq,
        arq,
    }))
}

fn error_state(ctx: &Ctx) -> CaseResultOf {
    let mut setup = None;
    for lead in [4 << 20, 32 << 20, 128 << 20] {
        setup = error_setup(ctx, lead)?;
        if setup.is_some() {
            break;
        }
    }
    let ErrSetup {
        p,
        src,
        dst,
        rq,
        arq,
    } = setup.ok_or(
        "the error completion arrived before five requests could be posted behind the bad \
         one, even behind a 128 MiB write: cannot test flushing",
    )?;
    let sgl = [src.slice(0..1024).ctx("slice")?];
    // The send queue's completions: the long write before the error succeeds, the bad one
    // fails, everything outstanding behind it completes Flushed, in post order, the
    // unsignaled write included (an error always completes). The initiator's own receive
    // flushes into the same queue, in any position.
    let mut sq = Vec::new();
    let mut rq_flushed = None;
    for _ in 0..8 {
        let c = next(&p.cqa, ctx.timeout)?;
        if c.context == 200 {
            rq_flushed = Some(c);
        } else {
            sq.push(c);
        }
    }
    let want = [
        (1, Opcode::Write, Status::Success),
        (2, Opcode::Write, Status::Error(ErrorKind::RemoteAccess)),
        (3, Opcode::Write, Status::Error(ErrorKind::Flushed)),
        (4, Opcode::Write, Status::Error(ErrorKind::Flushed)),
        (5, Opcode::Write, Status::Error(ErrorKind::Flushed)),
        (6, Opcode::Write, Status::Error(ErrorKind::Flushed)),
        (7, Opcode::Send, Status::Error(ErrorKind::Flushed)),
    ];
    for (got, (c, op, status)) in sq.iter().zip(want) {
        ensure!(
            got.context == c && got.status == status,
            "send-queue completions {sq:?}: expected context {c} {op:?} {status} at this position"
        );
        // Verbs leaves the opcode of a flushed completion undefined; ours must name it.
        ensure!(
            got.opcode == op,
            "completion {got:?} should have opcode {op:?}"
        );
    }
    ensure!(
        sq.len() == want.len(),
        "got {} send-queue completions, expected {}: {sq:?}",
        sq.len(),
        want.len()
    );
    let r = rq_flushed.ok_or("the initiator's posted receive did not complete")?;
    ensure!(
        r.status == Status::Error(ErrorKind::Flushed) && r.opcode == Opcode::Recv,
        "the initiator's posted receive completed {r:?}, expected Recv Flushed"
    );
    wait_state(&p.a, EndpointState::Error, Duration::from_secs(5))?;
    // A remote access error puts both ends in error: the target's receives flush too.
    wait_state(&p.b, EndpointState::Error, Duration::from_secs(5))?;
    for c in 100..104 {
        let got = expect_err(&p.cqb, c, ErrorKind::Flushed)?;
        ensure!(
            got.opcode == Opcode::Recv,
            "flushed receive {c} has opcode {:?}",
            got.opcode
        );
    }
    expect_none(&p.cqa, Duration::from_millis(50))?;
    expect_none(&p.cqb, Duration::from_millis(10))?;
    // New posts fail at once, on both ends, for every kind of request.
    let t = Instant::now();
    refused(
        p.a.post_send(&SendWr::write(17, &sgl, dst.desc().at(0))),
        ErrorKind::InvalidState,
        "write posted in the error state",
    )?;
    refused(
        p.a.post_send(&SendWr::send(18, &sgl)),
        ErrorKind::InvalidState,
        "send posted in the error state",
    )?;
    refused(
        p.a.post_recv(&RecvWr::new(19, &[arq.all()])),
        ErrorKind::InvalidState,
        "receive posted in the error state",
    )?;
    let bsrc = region(&p.db, 16, Access::empty())?;
    refused(
        p.b.post_send(&SendWr::send(10, &[bsrc.all()])),
        ErrorKind::InvalidState,
        "send posted at the target in the error state",
    )?;
    refused(
        p.b.post_recv(&RecvWr::new(11, &[rq.slice(0..256).ctx("slice")?])),
        ErrorKind::InvalidState,
        "receive posted at the target in the error state",
    )?;
    ensure!(
        t.elapsed() < Duration::from_millis(500),
        "refusing posts in the error state took {:?}",
        t.elapsed()
    );
    // Refused posts produce no completions.
    expect_none(&p.cqa, Duration::from_millis(100))?;
    expect_none(&p.cqb, Duration::from_millis(10))?;
    Ok(())
}

fn remote_error_both_ends(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let remote = region(&p.db, 4096, Access::REMOTE_READ)?;
    let local = region(&p.da, 64, Access::LOCAL_WRITE)?;
    let rq = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(40, &[rq.all()]))
        .ctx("post_recv")?;
    // 64 bytes starting 32 bytes before the end: out of bounds.
    p.a.post_send(&SendWr::read(
        1,
        &[local.all()],
        remote.desc().at(4096 - 32),
    ))
    .ctx("post out-of-bounds read")?;
    expect_err(&p.cqa, 1, ErrorKind::RemoteAccess)?;
    wait_state(&p.a, EndpointState::Error, Duration::from_secs(5))?;
    wait_state(&p.b, EndpointState::Error, Duration::from_secs(5))?;
    expect_err(&p.cqb, 40, ErrorKind::Flushed)?;
    refused(
        p.b.post_recv(&RecvWr::new(41, &[rq.all()])),
        ErrorKind::InvalidState,
        "receive posted at the target after the remote access error",
    )
}

fn overrun_refused(ctx: &Ctx) -> CaseResultOf {
    const CAP: usize = 4;
    let p = ctx.pair_with(PairOpts {
        cq_capacity: CAP,
        ..PairOpts::default()
    })?;
    let src = region(&p.da, 64, Access::empty())?;
    for i in 0..64 {
        src.buffer().write(i, &[i as u8]);
    }
    let rq = region(&p.db, 8 * 64, Access::LOCAL_WRITE)?;
    // No receive at the peer: the sends stay outstanding.
    for c in 1..=CAP as u64 {
        p.a.post_send(&SendWr::send(c, &[src.slice(0..c as usize).ctx("slice")?]))
            .ctx(&format!("send {c} of {CAP} into a {CAP}-entry queue"))?;
    }
    refused(
        p.a.post_send(&SendWr::send(99, &[src.slice(0..9).ctx("slice")?])),
        ErrorKind::QueueFull,
        "send beyond the completion queue's capacity",
    )?;
    ensure!(
        p.a.state() == EndpointState::Connected,
        "a QueueFull refusal left the endpoint {:?}",
        p.a.state()
    );
    // Still refused while nothing completed and nothing was polled.
    refused(
        p.a.post_send(&SendWr::send(98, &[src.slice(0..9).ctx("slice")?])),
        ErrorKind::QueueFull,
        "second send beyond the completion queue's capacity",
    )?;
    for c in 0..CAP {
        p.b.post_recv(&RecvWr::new(
            10 + c as u64,
            &[rq.slice(c * 64..(c + 1) * 64).ctx("slice")?],
        ))
        .ctx("post_recv")?;
    }
    for c in 1..=CAP as u64 {
        expect_ok(&p.cqa, c, Opcode::Send)?;
        let r = expect_ok(&p.cqb, 9 + c, Opcode::Recv)?;
        ensure!(
            r.byte_len == c,
            "receive {c} holds {} bytes, expected {c} (a refused send was delivered?)",
            r.byte_len
        );
    }
    // The refused sends were never sent.
    p.b.post_recv(&RecvWr::new(20, &[rq.slice(4 * 64..5 * 64).ctx("slice")?]))
        .ctx("post_recv")?;
    expect_none(&p.cqb, Duration::from_millis(200))?;
    // Polling freed the slots: posting works again.
    p.a.post_send(&SendWr::send(7, &[src.slice(0..17).ctx("slice")?]))
        .ctx("send after polling the queue")?;
    expect_ok(&p.cqa, 7, Opcode::Send)?;
    let r = expect_ok(&p.cqb, 20, Opcode::Recv)?;
    ensure!(
        r.byte_len == 17,
        "receive holds {} bytes, expected 17",
        r.byte_len
    );
    Ok(())
}

fn send_queue_full(ctx: &Ctx) -> CaseResultOf {
    const DEPTH: u32 = 4;
    let p = ctx.pair_with(PairOpts {
        sq_depth: DEPTH,
        ..PairOpts::default()
    })?;
    let src = region(&p.da, 64, Access::empty())?;
    let rq = region(&p.db, 8 * 64, Access::LOCAL_WRITE)?;
    for c in 1..=u64::from(DEPTH) {
        p.a.post_send(&SendWr::send(c, &[src.slice(0..c as usize).ctx("slice")?]))
            .ctx(&format!("send {c} of depth {DEPTH}"))?;
    }
    refused(
        p.a.post_send(&SendWr::send(99, &[src.slice(0..9).ctx("slice")?])),
        ErrorKind::QueueFull,
        "send beyond the send queue depth",
    )?;
    ensure!(
        p.a.state() == EndpointState::Connected,
        "a QueueFull refusal left the endpoint {:?}",
        p.a.state()
    );
    for c in 0..=DEPTH as usize {
        p.b.post_recv(&RecvWr::new(
            10 + c as u64,
            &[rq.slice(c * 64..(c + 1) * 64).ctx("slice")?],
        ))
        .ctx("post_recv")?;
    }
    for c in 1..=u64::from(DEPTH) {
        expect_ok(&p.cqa, c, Opcode::Send)?;
        let r = expect_ok(&p.cqb, 9 + c, Opcode::Recv)?;
        ensure!(r.byte_len == c, "receive {c} holds {} bytes", r.byte_len);
    }
    // Completed requests left the queue: there is room again.
    p.a.post_send(&SendWr::send(7, &[src.slice(0..17).ctx("slice")?]))
        .ctx("send after the queue drained")?;
    expect_ok(&p.cqa, 7, Opcode::Send)?;
    let r = expect_ok(&p.cqb, 10 + u64::from(DEPTH), Opcode::Recv)?;
    ensure!(
        r.byte_len == 17,
        "receive holds {} bytes, expected 17",
        r.byte_len
    );
    Ok(())
}

fn recv_queue_full(ctx: &Ctx) -> CaseResultOf {
    const DEPTH: u32 = 2;
    let p = ctx.pair_with(PairOpts {
        rq_depth: DEPTH,
        ..PairOpts::default()
    })?;
    let src = region(&p.da, 64, Access::empty())?;
    let rq = region(&p.db, 4 * 64, Access::LOCAL_WRITE)?;
    let slot = |i: usize| rq.slice(i * 64..(i + 1) * 64);
    for c in 0..DEPTH as usize {
        p.b.post_recv(&RecvWr::new(c as u64, &[slot(c).ctx("slice")?]))
            .ctx(&format!("receive {c} of depth {DEPTH}"))?;
    }
    refused(
        p.b.post_recv(&RecvWr::new(9, &[slot(2).ctx("slice")?])),
        ErrorKind::QueueFull,
        "receive beyond the receive queue depth",
    )?;
    ensure!(
        p.b.state() == EndpointState::Connected,
        "a QueueFull refusal left the endpoint {:?}",
        p.b.state()
    );
    // One message consumes one receive; then there is room for exactly one more.
    p.a.post_send(&SendWr::send(1, &[src.slice(0..5).ctx("slice")?]))
        .ctx("post_send")?;
    let r = expect_ok(&p.cqb, 0, Opcode::Recv)?;
    ensure!(
        r.byte_len == 5,
        "receive holds {} bytes, expected 5",
        r.byte_len
    );
    expect_ok(&p.cqa, 1, Opcode::Send)?;
    p.b.post_recv(&RecvWr::new(2, &[slot(2).ctx("slice")?]))
        .ctx("receive after one was consumed")?;
    refused(
        p.b.post_recv(&RecvWr::new(3, &[slot(3).ctx("slice")?])),
        ErrorKind::QueueFull,
        "receive beyond the depth after refilling",
    )?;
    // The refused receive was not queued: two messages land in receives 1 and 2.
    for c in 2..4 {
        p.a.post_send(&SendWr::send(c, &[src.slice(0..c as usize).ctx("slice")?]))
            .ctx("post_send")?;
    }
    expect_ok(&p.cqb, 1, Opcode::Recv)?;
    expect_ok(&p.cqb, 2, Opcode::Recv)?;
    Ok(())
}

/// A receive refused with QueueFull is not queued behind the scenes: a message beyond the
/// posted receives waits for the next one (so this needs the sender to wait: RNR_WAIT).
fn refused_recv_not_queued(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair_with(PairOpts {
        rq_depth: 1,
        ..PairOpts::default()
    })?;
    let src = region(&p.da, 64, Access::empty())?;
    src.buffer().write(0, b"abcdefgh");
    let rq = region(&p.db, 2 * 64, Access::LOCAL_WRITE)?;
    let slot = |i: usize| rq.slice(i * 64..(i + 1) * 64);
    p.b.post_recv(&RecvWr::new(0, &[slot(0).ctx("slice")?]))
        .ctx("post_recv")?;
    refused(
        p.b.post_recv(&RecvWr::new(9, &[slot(1).ctx("slice")?])),
        ErrorKind::QueueFull,
        "receive beyond a depth of 1",
    )?;
    for c in 1..3 {
        p.a.post_send(&SendWr::send(
            c,
            &[src.slice(0..c as usize * 3).ctx("slice")?],
        ))
        .ctx("post_send")?;
    }
    let r = expect_ok(&p.cqb, 0, Opcode::Recv)?;
    ensure!(
        r.byte_len == 3,
        "first receive holds {} bytes, expected 3",
        r.byte_len
    );
    // Had the refused receive been queued, the second message would land in it now.
    expect_none(&p.cqb, Duration::from_millis(200))?;
    p.b.post_recv(&RecvWr::new(5, &[slot(1).ctx("slice")?]))
        .ctx("post_recv")?;
    let r = expect_ok(&p.cqb, 5, Opcode::Recv)?;
    ensure!(
        r.byte_len == 6,
        "second receive holds {} bytes, expected 6",
        r.byte_len
    );
    ensure!(
        rq.buffer().to_vec(64, 6) == b"abcdef",
        "second message landed wrong: {:?}",
        rq.buffer().to_vec(64, 6)
    );
    expect_ok(&p.cqa, 1, Opcode::Send)?;
    expect_ok(&p.cqa, 2, Opcode::Send)?;
    Ok(())
}

fn wait_times_out(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    let cq = d.create_cq(16).ctx("create_cq")?;
    let cpu0 = thread_cpu();
    let t = Instant::now();
    let ready = cq.wait(Duration::from_millis(200)).ctx("wait")?;
    let took = t.elapsed();
    let cpu = thread_cpu().zip(cpu0).map(|(b, a)| b.saturating_sub(a));
    ensure!(!ready, "wait on an empty queue returned true");
    ensure!(
        took >= Duration::from_millis(150),
        "wait(200 ms) on an empty queue returned after {took:?}"
    );
    ensure!(
        took < Duration::from_secs(2),
        "wait(200 ms) on an empty queue took {took:?}"
    );
    if let Some(cpu) = cpu {
        // A spinning wait is on the CPU the whole time; a blocking one hardly at all (in
        // the emulated guest, wake-up and accounting overheads measured about a quarter).
        ensure!(
            cpu < took / 2,
            "wait(200 ms) was on the CPU {cpu:?} of {took:?}: it spins instead of blocking on an event"
        );
    }
    Ok(())
}

fn wait_wakes(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(3, &[dst.all()]))
        .ctx("post_recv")?;
    let (ready, took, posted) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            p.a.post_send(&SendWr::send(4, &[src.slice(0..7).expect("in range")]))
        });
        let t = Instant::now();
        let ready = p.cqb.wait(Duration::from_secs(5));
        let took = t.elapsed();
        (ready, took, h.join().expect("sender thread"))
    });
    posted.ctx("post_send from the other thread")?;
    ensure!(
        ready.ctx("wait")?,
        "wait returned false although a completion arrived (after {took:?})"
    );
    ensure!(
        took >= Duration::from_millis(90),
        "wait returned after {took:?}, before anything was sent"
    );
    ensure!(
        took < Duration::from_secs(1),
        "wait took {took:?} to notice a completion that arrived after ~100 ms"
    );
    let r = expect_ok(&p.cqb, 3, Opcode::Recv)?;
    ensure!(r.byte_len == 7, "receive holds {} bytes", r.byte_len);
    expect_ok(&p.cqa, 4, Opcode::Send)?;
    Ok(())
}

/// Whether `cq`'s descriptor becomes readable within `timeout`, seen from an `epoll`
/// instance of our own with an edge-triggered registration (as tokio's).
fn readable_within(cq: &AnyCq, timeout: Duration) -> Result<bool, String> {
    let err = |e: std::io::Error| format!("epoll on the queue's descriptor: {e}");
    let mut poll = mio::Poll::new().map_err(err)?;
    let fd = cq.as_fd().as_raw_fd();
    poll.registry()
        .register(&mut SourceFd(&fd), Token(0), Interest::READABLE)
        .map_err(err)?;
    let mut events = Events::with_capacity(4);
    poll.poll(&mut events, Some(timeout)).map_err(err)?;
    Ok(!events.is_empty())
}

/// The next completion of `cq`, waited for through its descriptor: poll, arm, wait until
/// readable, again.
fn next_by_fd(cq: &AnyCq, timeout: Duration) -> Result<Completion, String> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    loop {
        if cq.poll(&mut out, 1).ctx("poll")? == 1 {
            return Ok(out.remove(0));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        ensure!(!left.is_zero(), "no completion within {timeout:?}");
        if cq.arm().ctx("arm")? {
            readable_within(cq, left)?;
        }
    }
}

fn fd_readable_after_arm(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    let mut out = Vec::new();
    p.cqb.poll(&mut out, 16).ctx("poll")?;
    ensure!(out.is_empty(), "completions on a new queue: {out:?}");
    for i in 0..2 {
        p.b.post_recv(&RecvWr::new(10 + i, &[dst.all()]))
            .ctx("post_recv")?;
    }
    ensure!(
        p.cqb.arm().ctx("arm")?,
        "arming an empty queue returned false"
    );
    // Nobody polls b's queue while the message arrives: its descriptor must tell.
    p.a.post_send(&SendWr::send(20, &[src.slice(0..5).ctx("slice")?]))
        .ctx("post_send")?;
    ensure!(
        readable_within(&p.cqb, ctx.timeout)?,
        "the armed descriptor stayed unreadable for {:?} after a message was sent to it",
        ctx.timeout
    );
    let r = next_by_fd(&p.cqb, ctx.timeout)?;
    ensure!(
        r.context == 10
            && r.opcode == Opcode::Recv
            && r.status == Status::Success
            && r.byte_len == 5,
        "receive completion {r:?}, expected context 10, Recv, Success, 5 bytes"
    );
    // With a completion pending, arming refuses: poll instead.
    p.a.post_send(&SendWr::send(21, &[src.slice(0..3).ctx("slice")?]))
        .ctx("post_send")?;
    ensure!(
        p.cqb.wait(ctx.timeout).ctx("wait")?,
        "the second message never completed"
    );
    ensure!(!p.cqb.arm().ctx("arm")?, "armed with a completion pending");
    let r = next_by_fd(&p.cqb, ctx.timeout)?;
    ensure!(
        r.context == 11 && r.status == Status::Success,
        "second receive {r:?}"
    );
    ensure!(
        p.cqb.arm().ctx("arm")?,
        "arming the drained queue returned false"
    );
    // The sender's queue, through its descriptor only.
    for want in [20, 21] {
        let s = next_by_fd(&p.cqa, ctx.timeout)?;
        ensure!(
            s.context == want && s.opcode == Opcode::Send && s.status == Status::Success,
            "send completion {s:?}, expected context {want}, Send, Success"
        );
    }
    Ok(())
}

fn poll_non_blocking(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let mut out = Vec::new();
    let t = Instant::now();
    let n = p.cqa.poll(&mut out, 16).ctx("poll")?;
    let took = t.elapsed();
    ensure!(
        n == 0 && out.is_empty(),
        "poll on an empty queue returned {out:?}"
    );
    let bound = ctx.slack(Duration::from_millis(50));
    ensure!(
        took < bound,
        "poll on an empty queue took {took:?} (bound {bound:?})"
    );
    // With an operation outstanding (a send nobody receives yet) it still returns at once.
    let src = region(&p.da, 64, Access::empty())?;
    p.a.post_send(&SendWr::send(1, &[src.all()]))
        .ctx("post_send")?;
    let t = Instant::now();
    for _ in 0..100 {
        let n = p.cqa.poll(&mut out, 16).ctx("poll")?;
        ensure!(
            n == 0,
            "poll returned a completion for an unreceived send: {out:?}"
        );
    }
    let took = t.elapsed();
    ensure!(
        took < bound,
        "100 polls with an outstanding send took {took:?} (bound {bound:?})"
    );
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(2, &[dst.all()]))
        .ctx("post_recv")?;
    expect_ok(&p.cqa, 1, Opcode::Send)?;
    expect_ok(&p.cqb, 2, Opcode::Recv)?;
    Ok(())
}

fn provider_code(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    p.a.post_send(&SendWr::write(1, &[src.all()], bad_key(dst.desc())))
        .ctx("post bad-key write")?;
    let c = expect_err(&p.cqa, 1, ErrorKind::RemoteAccess)?;
    ensure!(
        c.provider_code.is_some(),
        "the RemoteAccess completion lost the provider's own code: {c:?}"
    );
    ensure!(
        dst.buffer().to_vec(0, 64).iter().all(|&b| b == 0),
        "a write with a bad key changed target memory"
    );
    Ok(())
}

/// Every completion carries the `ep_context` of the endpoint it belongs to: sends,
/// receives, and the flushed receives of a close.
fn name_their_endpoint(ctx: &Ctx) -> CaseResultOf {
    let (ca, cb) = (0xA11CE_u64, 0xB0B_u64 << 40);
    let p = ctx.pair_with(PairOpts {
        ep_context_a: ca,
        ep_context_b: cb,
        ..PairOpts::default()
    })?;
    let ra = region(&p.da, 64, Access::LOCAL_WRITE)?;
    let rb = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(1, &[rb.slice(0..32).ctx("s")?]))
        .ctx("post_recv")?;
    p.b.post_recv(&RecvWr::new(2, &[rb.slice(32..64).ctx("s")?]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(3, &[ra.slice(0..16).ctx("s")?]))
        .ctx("post_send")?;
    let sent = expect_ok(&p.cqa, 3, Opcode::Send)?;
    let got = expect_ok(&p.cqb, 1, Opcode::Recv)?;
    ensure!(
        sent.ep_context == ca && got.ep_context == cb,
        "send completion names {:#x} (want {ca:#x}), receive names {:#x} (want {cb:#x})",
        sent.ep_context,
        got.ep_context
    );
    p.b.close().ctx("close")?;
    let flushed = expect_err(&p.cqb, 2, ErrorKind::Flushed)?;
    ensure!(
        flushed.ep_context == cb,
        "flushed receive names {:#x}, want {cb:#x}",
        flushed.ep_context
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the documented inference (tcp against iwarp, a good write blamed without the
    /// peer's code) earns the case its second run.
    #[test]
    fn only_the_tcp_providers_inference_against_siw_counts_as_a_lost_terminate() {
        use fabric::ProviderCode;
        let blamed = |context, code: Option<ProviderCode>| Completion {
            context,
            opcode: Opcode::Write,
            status: Status::Error(ErrorKind::RemoteAccess),
            provider_code: code,
            byte_len: 0,
            imm: None,
            ep_context: 0,
        };
        let mixed = Ctx::mixed("tcp", "iwarp", None);
        assert!(terminate_lost(&mixed, &blamed(1, None)));
        // A Terminate's code, the bad write itself, another pair, another error: no.
        assert!(!terminate_lost(
            &mixed,
            &blamed(1, Some(ProviderCode::Errno(1)))
        ));
        assert!(!terminate_lost(&mixed, &blamed(50, None)));
        assert!(!terminate_lost(
            &Ctx::mixed("iwarp", "tcp", None),
            &blamed(1, None)
        ));
        assert!(!terminate_lost(&Ctx::new("tcp", None), &blamed(1, None)));
        let flushed = Completion {
            status: Status::Error(ErrorKind::Flushed),
            ..blamed(1, None)
        };
        assert!(!terminate_lost(&mixed, &flushed));
    }
}
