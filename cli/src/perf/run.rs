//! The two sides of `fabric perf` and the small protocol between them.
//!
//! Control messages are 64-byte sends on the measured endpoint itself:
//! * hello (client to server): the test, the operation, the largest size, the window and the
//!   client's target region; the server answers with its own region and how many receives
//!   it keeps posted;
//! * phase (client to server): one size: run `warmup + iters` iterations of the test;
//! * bye.
//!
//! Receives complete in order, so the server tells control messages from data messages by
//! counting. Write ping-pongs put an iteration marker in the last byte of every write: each
//! side polls its own memory for it (never 0; it continues across phases, so a byte left by
//! an earlier phase never matches).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fabric::prelude::*;

use super::{Mode, Op, Plan, Row, Test};

const CTRL_LEN: usize = 64;
const MAGIC: &[u8; 4] = b"FPRF";
const HELLO: u8 = 1;
/// In the hello's `c` (beside the completion mode): sends and writes are transmit
/// complete.
const HELLO_TRANSMIT: u64 = 1 << 8;
/// In the hello's `c`: the server polls in the client's mode whenever it waits
/// (`--server-polls`), not only for its echoes.
const HELLO_SERVER_POLLS: u64 = 1 << 9;
const REPLY: u8 = 2;
const PHASE: u8 = 3;
const BYE: u8 = 4;
/// Contexts of control sends; data requests count up from 0.
const CTRL_TAG: u64 = 1 << 63;
/// How long a side waits without any progress before giving up.
const STALL: Duration = Duration::from_secs(120);
/// How long the server waits for the client's next control message.
const IDLE: Duration = Duration::from_secs(1800);
/// How long a polling wait goes without progress before its stall check asks whether the
/// endpoint left. Asking is a system call on verbs (`ibv_query_qp`, at most once a
/// millisecond), one perftest's loops never make, and a ping-pong's waits are tens to
/// hundreds of microseconds. Asked after every 1 024 empty polls, as before, the soft-RDMA
/// guest's iwarp 8-byte send made one query per 30-36 doorbells inside the iterations it
/// timed (627 and 750 per run); asked after this long, 18 and 26 per run in all
/// (docs/benchmarks-record.md, fifty-eighth session).
/// A peer that leaves is still seen within a few milliseconds, and at once where its
/// leaving flushes what is posted.
const STATE_AFTER: Duration = Duration::from_millis(2);
/// One ping-pong send or write in this many is signaled.
const PINGPONG_SIGNAL: u64 = 32;
/// Looks at a write ping-pong's marker between two polls of the completion queue, when
/// spinning: about a poll's cost in loads and compares (a poll of an empty queue is a few
/// hundred instructions; a look, the marker's word, about five).
const MARKER_LOOKS: u32 = 32;
/// Memory the server may register for receive buffers of send tests.
const RECV_POOL_BYTES: u64 = 64 << 20;
/// Receives each side of a send ping-pong keeps posted (at most; the server's pool also
/// stops at `RECV_POOL_BYTES`), as perftest's `ib_send_lat` keeps up to 512: a receiver
/// that always has receives posted ahead lets a provider batch its credit updates
/// (iwarp: `emu_wire::FLAG_LAZY_CREDITS`).
const ECHO_RECVS: u64 = 64;

const _: () = assert!(24 + RemoteDesc::ENCODED_LEN <= CTRL_LEN);

fn e(what: &'static str) -> impl Fn(fabric::Error) -> String {
    move |err| format!("{what}: {err}")
}

/// A control message.
#[derive(Debug, Clone, Copy)]
struct Ctrl {
    kind: u8,
    test: u8,
    op: u8,
    /// hello: largest size; reply: receives the server keeps posted; phase: size.
    a: u64,
    /// hello: window; phase: warmup + iters.
    b: u64,
    /// phase: the first iteration marker's sequence number.
    c: u64,
    desc: Option<RemoteDesc>,
}

impl Ctrl {
    fn new(kind: u8) -> Ctrl {
        Ctrl {
            kind,
            test: 0,
            op: 0,
            a: 0,
            b: 0,
            c: 0,
            desc: None,
        }
    }

    fn encode(&self) -> [u8; CTRL_LEN] {
        let mut m = [0u8; CTRL_LEN];
        m[..4].copy_from_slice(MAGIC);
        m[4] = self.kind;
        m[5] = self.test;
        m[6] = self.op;
        m[7] = self.desc.is_some() as u8;
        // a and c share bytes 8..16 and 32..40; b at 16..24; desc at 40..60.
        m[8..16].copy_from_slice(&self.a.to_le_bytes());
        m[16..24].copy_from_slice(&self.b.to_le_bytes());
        m[24..32].copy_from_slice(&self.c.to_le_bytes());
        if let Some(d) = self.desc {
            m[32..32 + RemoteDesc::ENCODED_LEN].copy_from_slice(&d.to_bytes());
        }
        m
    }

    fn decode(m: &[u8]) -> Result<Ctrl, String> {
        if m.len() != CTRL_LEN || &m[..4] != MAGIC {
            return Err(format!(
                "expected a {CTRL_LEN}-byte control message, got {} bytes: is the peer `fabric perf`?",
                m.len()
            ));
        }
        let word = |r: std::ops::Range<usize>| u64::from_le_bytes(m[r].try_into().expect("8"));
        let desc = if m[7] == 1 {
            Some(
                RemoteDesc::from_bytes(&m[32..32 + RemoteDesc::ENCODED_LEN])
                    .map_err(|e| format!("control message: {e}"))?,
            )
        } else {
            None
        };
        Ok(Ctrl {
            kind: m[4],
            test: m[5],
            op: m[6],
            a: word(8..16),
            b: word(16..24),
            c: word(24..32),
            desc,
        })
    }
}

/// Where a write ping-pong's iteration marker lives: the end of `[0, size)` of a region.
/// The marker of iteration `seq` is the 64-bit `seq + 1` (little-endian) in the last 8
/// bytes (never repeats, never 0), or below 8 bytes `seq % 255 + 1` in the last byte.
///
/// When those 8 bytes are an aligned word (a size that is a multiple of 8: every size of
/// the benches), the marker is read and written as that one word, found once per phase,
/// as perftest reads and writes its one volatile byte: a look is a load and a compare,
/// where the buffer's general copy checks the range and splits words (about 70
/// instructions a look and 80 a put; callgrind, forty-fourth session), and the look that
/// finds the peer's write and the put after it are on the ping-pong's critical path.
#[derive(Clone, Copy)]
struct Marker<'a> {
    mr: &'a MemoryRegion,
    size: usize,
    word: Option<&'a AtomicU64>,
}

impl<'a> Marker<'a> {
    fn new(mr: &'a MemoryRegion, size: usize) -> Self {
        let word = size
            .checked_sub(8)
            .and_then(|at| mr.buffer().atomic_u64(at));
        Marker { mr, size, word }
    }

    /// Writes the marker of iteration `seq`.
    #[inline(always)]
    fn put(&self, seq: u64) {
        match self.word {
            Some(w) => w.store((seq + 1).to_le(), Ordering::Relaxed),
            None => self.put_bytes(seq),
        }
    }

    /// Whether the marker of iteration `seq` is there.
    #[inline(always)]
    fn is(&self, seq: u64) -> bool {
        match self.word {
            Some(w) => u64::from_le(w.load(Ordering::Relaxed)) == seq + 1,
            None => self.is_bytes(seq),
        }
    }

    fn put_bytes(&self, seq: u64) {
        let b = self.mr.buffer();
        if self.size >= 8 {
            b.write(self.size - 8, &(seq + 1).to_le_bytes());
        } else {
            b.write(self.size - 1, &[(seq % 255) as u8 + 1]);
        }
    }

    fn is_bytes(&self, seq: u64) -> bool {
        let b = self.mr.buffer();
        if self.size >= 8 {
            let mut w = [0u8; 8];
            b.read(self.size - 8, &mut w);
            u64::from_le_bytes(w) == seq + 1
        } else {
            let mut w = [0u8];
            b.read(self.size - 1, &mut w);
            w[0] == (seq % 255) as u8 + 1
        }
    }
}

/// Whether the ping-pong send or write with context `ctx` asks for a completion: one in
/// `PINGPONG_SIGNAL` (the others free their send-queue slots with it), as fabtests injects
/// small messages without completions.
fn signal(ctx: u64) -> bool {
    ctx % PINGPONG_SIGNAL == PINGPONG_SIGNAL - 1
}

/// Receives the server keeps posted, from the client's hello.
fn server_recvs(op: Op, max_size: u64, window: u64) -> (u64, u64) {
    if op.consumes_recv() {
        let slot = max_size.max(CTRL_LEN as u64);
        (
            (RECV_POOL_BYTES / slot).clamp(4, window.max(ECHO_RECVS)),
            slot,
        )
    } else {
        (4, CTRL_LEN as u64)
    }
}

/// What the loops use of a receive's completion.
#[derive(Debug, Clone, Copy)]
struct Received {
    context: u64,
    byte_len: u64,
}

/// Receives in arrival order: a vector and the position of the next to take. Its push is
/// `Vec::push`, inlined, where `VecDeque::push_back` is a call (callgrind in the
/// soft-RDMA guest, each side of the 8-byte send ping-pong: 23 instructions per iteration
/// in the `VecDeque`, 11 here; docs/benchmarks-record.md, thirty-seventh session).
#[derive(Debug, Default)]
struct Arrivals {
    items: Vec<Received>,
    next: usize,
}

impl Arrivals {
    #[inline]
    fn push(&mut self, r: Received) {
        self.items.push(r);
    }

    #[inline]
    fn is_empty(&self) -> bool {
        self.next == self.items.len()
    }

    /// The oldest receive not taken yet.
    #[inline]
    fn pop(&mut self) -> Option<Received> {
        let r = *self.items.get(self.next)?;
        self.next += 1;
        if self.next == self.items.len() {
            self.items.clear();
            self.next = 0;
        } else if self.next >= 1024 {
            // Never emptied (a stream that keeps a backlog): forget what was taken.
            self.items.drain(..self.next);
            self.next = 0;
        }
        Some(r)
    }
}

/// Polls one completion queue, sorting what it finds: receives are queued in order, data
/// requests advance `done_upto` (send queues complete in order, so a signaled completion
/// covers every earlier unsignaled request).
struct Reaper<'a> {
    cq: &'a AnyCq,
    ep: &'a AnyEndpoint,
    mode: Mode,
    out: Vec<Completion>,
    recvs: Arrivals,
    done_upto: u64,
    /// The endpoint left the connected state (seen while idle).
    gone: bool,
}

impl<'a> Reaper<'a> {
    fn new(cq: &'a AnyCq, ep: &'a AnyEndpoint, mode: Mode) -> Self {
        Reaper {
            cq,
            ep,
            mode,
            out: Vec::with_capacity(64),
            recvs: Arrivals::default(),
            done_upto: 0,
            gone: false,
        }
    }

    /// One non-blocking poll; returns how many completions it took. Inlined into the
    /// waits: a spinning caller's every poll runs it.
    #[inline(always)]
    fn poll_once(&mut self) -> Result<usize, String> {
        self.out.clear();
        let n = self.cq.poll(&mut self.out, 64).map_err(e("poll"))?;
        for c in &self.out {
            if c.status == Status::Error(ErrorKind::Flushed) {
                // The connection is closing: what was still posted comes back flushed.
                // Whatever completed before it is still used; waiting for more fails.
                self.gone = true;
                continue;
            }
            if c.status != Status::Success {
                return Err(format!(
                    "{:?} (context {}) failed: {} {:?}",
                    c.opcode, c.context, c.status, c.provider_code
                ));
            }
            match c.opcode {
                Opcode::Recv | Opcode::RecvWriteWithImm => self.recvs.push(Received {
                    context: c.context,
                    byte_len: c.byte_len,
                }),
                _ if c.context & CTRL_TAG != 0 => {}
                _ => self.done_upto = self.done_upto.max(c.context + 1),
            }
        }
        Ok(n)
    }

    /// Waits until `ready` holds, polling per the mode; `limit` without progress is an error.
    /// Inlined into its two callers: a read's or atomic's completion is usually queued
    /// when its post returns (rxe runs the whole round trip inside the doorbell's system
    /// call), and the call was one more on that iteration's way to the next post
    /// (callgrind, docs/benchmarks-record.md, forty-sixth session).
    #[inline(always)]
    fn wait_until(
        &mut self,
        mode: Mode,
        limit: Duration,
        what: &str,
        mut ready: impl FnMut(&Self) -> bool,
    ) -> Result<(), String> {
        let mut idle = 0u32;
        let mut since = None::<Instant>;
        while !ready(self) {
            if self.poll_once()? > 0 {
                idle = 0;
                since = None;
                continue;
            }
            if self.gone {
                return Err(format!(
                    "endpoint {:?} while waiting for {what}",
                    self.ep.state()
                ));
            }
            idle = idle.wrapping_add(1);
            if !Self::just_spin(mode, idle) {
                self.idle(mode, idle, &mut since, limit, what)?;
            }
        }
        Ok(())
    }

    /// Whether an empty poll needs nothing more than the next poll: spinning, and not the
    /// 1024th in a row (the stall check's). Asked inline by the waits before they call
    /// [`idle`](Self::idle): a spinning caller's every empty poll asks, and callgrind in
    /// the soft-RDMA guest found `idle` a call on every one, a call and return in the
    /// delay before the next poll sees a completion.
    #[inline(always)]
    fn just_spin(mode: Mode, idle: u32) -> bool {
        mode == Mode::Spin && !idle.is_multiple_of(1024)
    }

    /// One empty poll's pause, and the stall check (every 1024 empty polls when polling;
    /// blocking, after a wait that timed out).
    #[inline(never)]
    fn idle(
        &mut self,
        mode: Mode,
        idle: u32,
        since: &mut Option<Instant>,
        limit: Duration,
        what: &str,
    ) -> Result<(), String> {
        match mode {
            Mode::Busy => std::thread::yield_now(),
            // No pause instruction: see `Mode::Spin`.
            Mode::Spin => {}
            Mode::Block => {
                // Woken with completions ready: no stall to check. The check asks the
                // endpoint's state, which reads the clock and, on verbs, queries the
                // queue pair once a millisecond (a system call): callgrind counted about
                // 390 instructions per wake of the roce send ping-pong with `--wait`.
                if self
                    .cq
                    .wait(Duration::from_millis(500))
                    .map_err(e("wait"))?
                {
                    return Ok(());
                }
            }
        }
        if mode == Mode::Block || idle.is_multiple_of(1024) {
            return self.stall_check(since, limit, what, mode == Mode::Block);
        }
        Ok(())
    }

    /// Fails once `limit` passed without progress; notes whether the endpoint left, asked
    /// once the wait has gone [`STATE_AFTER`] without progress, or at once after a blocking
    /// wait that timed out (`blocked`).
    #[cold]
    fn stall_check(
        &mut self,
        since: &mut Option<Instant>,
        limit: Duration,
        what: &str,
        blocked: bool,
    ) -> Result<(), String> {
        let start = *since.get_or_insert_with(Instant::now);
        let waited = start.elapsed();
        if waited > limit {
            return Err(format!(
                "no progress for {limit:?} waiting for {what} (endpoint {:?})",
                self.ep.state()
            ));
        }
        if blocked || waited >= STATE_AFTER {
            // The caller polls once more before failing: what the peer sent before it left
            // may already be queued.
            self.gone = self.ep.state() != EndpointState::Connected;
        }
        Ok(())
    }

    /// The next receive, waited for per `mode`. Inlined into the ping-pong loops: its
    /// return was one more call on the way from the receive to the next post (callgrind
    /// in the soft-RDMA guest, docs/benchmarks-record.md, forty-sixth session).
    #[inline(always)]
    fn next_recv(&mut self, mode: Mode, limit: Duration) -> Result<Received, String> {
        self.wait_until(mode, limit, "a receive", |r| !r.recvs.is_empty())?;
        Ok(self.recvs.pop().expect("ready"))
    }

    #[inline]
    fn wait_done(&mut self, upto: u64) -> Result<(), String> {
        self.wait_until(self.mode, STALL, "completions", |r| r.done_upto >= upto)
    }

    /// Polls `marker` until it holds iteration `seq`, reaping completions meanwhile.
    /// Spinning, it looks at the memory [`MARKER_LOOKS`] times between two polls of the
    /// queue, as perftest's write ping-pong looks at its memory only: a poll of the
    /// queue, hundreds of instructions, no longer sits between the peer's write landing
    /// and the look that finds it on most iterations.
    fn wait_marker(&mut self, marker: &Marker<'_>, seq: u64) -> Result<(), String> {
        let mut idle = 0u32;
        let mut since = None;
        let looks = if self.mode == Mode::Spin {
            MARKER_LOOKS
        } else {
            1
        };
        loop {
            for _ in 0..looks {
                if marker.is(seq) {
                    return Ok(());
                }
            }
            if self.poll_once()? == 0 && self.gone {
                return Err(format!(
                    "endpoint {:?} while waiting for the peer's write",
                    self.ep.state()
                ));
            }
            idle = idle.wrapping_add(1);
            // Memory has nothing to block on: yield when waiting is asked for.
            let mode = if self.mode == Mode::Block {
                Mode::Busy
            } else {
                self.mode
            };
            if !Self::just_spin(mode, idle) {
                self.idle(mode, idle, &mut since, STALL, "the peer's write")?;
            }
        }
    }

    /// Posts with `post`, reaping and retrying while the send queue is full. Inlined, and
    /// the retries apart: a post that goes through (nearly every one) sets up no loop.
    #[inline(always)]
    fn post(&mut self, mut post: impl FnMut() -> fabric::Result<()>) -> Result<(), String> {
        match post() {
            Ok(()) => Ok(()),
            Err(err) => self.post_again(err, post),
        }
    }

    /// [`post`](Self::post)'s refusals: reaps and retries while the queue is full.
    #[inline(never)]
    fn post_again(
        &mut self,
        first: fabric::Error,
        mut post: impl FnMut() -> fabric::Result<()>,
    ) -> Result<(), String> {
        let mut idle = 0u32;
        let mut since = None;
        let mut result = Err(first);
        loop {
            match result {
                Ok(()) => return Ok(()),
                Err(err) if err.kind() == ErrorKind::QueueFull => {
                    if self.poll_once()? == 0 {
                        if self.gone {
                            return Err(format!("post: {err} (endpoint {:?})", self.ep.state()));
                        }
                        idle = idle.wrapping_add(1);
                        let mode = self.mode;
                        self.idle(mode, idle, &mut since, STALL, "send queue room")?;
                    }
                }
                Err(err) => return Err(format!("post: {err}")),
            }
            result = post();
        }
    }
}

fn send_ctrl(
    r: &mut Reaper<'_>,
    ep: &AnyEndpoint,
    mr: &MemoryRegion,
    seq: &mut u64,
    c: Ctrl,
) -> Result<(), String> {
    mr.buffer().write(0, &c.encode());
    let sgl = [mr.slice(0..CTRL_LEN).map_err(e("slice"))?];
    *seq += 1;
    let ctx = CTRL_TAG | *seq;
    // Inline: the buffer is reused for the next control message at once.
    r.post(|| ep.post_send(&SendWr::send(ctx, &sgl).inline()))
}

/// The queues one side of a test uses: completion-queue entries, and the depth of both
/// the send and the receive queue; and the endpoint's request limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Queues {
    cq: usize,
    depth: u32,
    /// The endpoint's gather/scatter and inline limits (`None`: the domain's).
    max_sge: Option<u32>,
    max_inline: Option<u32>,
}

impl Queues {
    /// Room beyond the data's: control messages and their replies.
    const SLACK: u64 = 16;

    /// What a side of `test` needs. A ping-pong or latency test keeps one transfer in
    /// flight, up to [`PINGPONG_SIGNAL`] unsignaled sends awaiting a signaled one, and up
    /// to `window.max(ECHO_RECVS)` receives posted: queues sized to that, as perftest's
    /// `_lat` tools size theirs (a send queue of 1, `ib_send_lat` up to 512 receives).
    /// Deeper queues cost a latency test on a device whose queues live in host memory:
    /// each request writes a slot last written a whole ring ago, and the rings of a
    /// verbs queue pair whose entries have room for the device's maximum gather list
    /// span hundreds of KiB (rxe in the soft-RDMA guest: docs/benchmarks-record.md, fortieth
    /// session). A bandwidth test keeps `window` outstanding: the client twice that (the
    /// server's echo receives are its own), the server 1 024 (it learns the window from
    /// the client's hello, after its queues exist); at least 256 and 4 096 entries.
    ///
    /// Every request of either side has one entry, and a latency test's endpoints say so
    /// (`max_sge` 1) and take inline payloads up to the larger of its largest message
    /// (`max_size`) and a control message, within the domain's `max_inline`: a verbs
    /// queue pair's entries are then sized to those, not to the device's maximum list
    /// (rxe: 32 entries, 512 bytes of every entry; docs/benchmarks-record.md, fortieth session).
    pub(crate) fn for_test(
        test: Test,
        window: u64,
        server: bool,
        max_size: u64,
        limits: &fabric::Limits,
    ) -> Queues {
        match test {
            Test::Pingpong | Test::Lat => {
                let depth = window.max(ECHO_RECVS).max(PINGPONG_SIGNAL) + Self::SLACK;
                let inline = max_size
                    .max(CTRL_LEN as u64)
                    .min(u64::from(limits.max_inline));
                Queues {
                    cq: 2 * depth as usize,
                    depth: depth as u32,
                    max_sge: Some(1),
                    max_inline: Some(inline as u32),
                }
            }
            Test::Bw if server => Queues {
                cq: 4096,
                depth: 1024,
                max_sge: None,
                max_inline: None,
            },
            Test::Bw => Queues {
                cq: (window as usize * 4).max(4096),
                depth: (window as u32 * 2).max(256),
                max_sge: None,
                max_inline: None,
            },
        }
    }

    /// The largest payload an endpoint of these queues in a domain of `limits` sends
    /// inline.
    fn inline_limit(self, limits: &fabric::Limits) -> u64 {
        u64::from(self.max_inline.unwrap_or(limits.max_inline))
    }

    /// Receives a server of these queues can keep posted besides its control message.
    fn recvs(self) -> u64 {
        u64::from(self.depth) - Self::SLACK
    }

    fn endpoint_config(self, cq: &AnyCq) -> EndpointConfig<'_, AnyCq> {
        let mut cfg = EndpointConfig::new(cq);
        cfg.sq_depth = self.depth;
        cfg.rq_depth = self.depth;
        cfg.max_sge = self.max_sge;
        cfg.max_inline = self.max_inline;
        cfg.timeout = Duration::from_secs(30);
        cfg
    }
}

/// The hello's `c`: the client's polling mode, and the transmit and server-polls bits.
fn hello_word(plan: &Plan) -> u64 {
    let mode = match plan.mode {
        Mode::Busy => 0,
        Mode::Spin => 1,
        Mode::Block => 2,
    };
    let transmit = if plan.transmit { HELLO_TRANSMIT } else { 0 };
    let polls = if plan.server_polls {
        HELLO_SERVER_POLLS
    } else {
        0
    };
    mode | transmit | polls
}

/// How the server runs, as the client's hello says ([`hello_word`]).
#[derive(Debug, PartialEq, Eq)]
struct ServerModes {
    /// The echoes' polling mode: the client's.
    mode: Mode,
    /// While it only waits for the client's next control message (between its echoes,
    /// and all through a one-sided phase, where it has none): blocking, or polling in the
    /// client's mode when asked (perftest's server over rdma_cm busy-polls there).
    ctrl_mode: Mode,
    /// The echo's data sends and writes: transmit complete if the client's are.
    transmit: bool,
}

impl ServerModes {
    fn of_hello(c: u64) -> ServerModes {
        let mode = match c & !(HELLO_TRANSMIT | HELLO_SERVER_POLLS) {
            0 => Mode::Busy,
            1 => Mode::Spin,
            _ => Mode::Block,
        };
        ServerModes {
            mode,
            ctrl_mode: if c & HELLO_SERVER_POLLS != 0 {
                mode
            } else {
                Mode::Block
            },
            transmit: c & HELLO_TRANSMIT != 0,
        }
    }
}

/// The server: accepts one client and runs the phases it asks for.
/// Gives receive slot `i` of `pool` (slots of `slot` bytes) back to `ep`, once its
/// message was read. A bandwidth phase's sends are one-way: the client may have had its
/// last send (and its BYE) delivered and closed before this repost, which then finds the
/// endpoint gone. Nothing is lost: the client closes only once its BYE completed, so the
/// BYE is the next message the server's loop reads (and ends with), and a client that
/// left without one still fails that wait.
#[inline(always)]
fn repost(ep: &AnyEndpoint, pool: &MemoryRegion, slot: usize, i: u64) -> Result<(), String> {
    let s = i as usize * slot;
    match ep.post_recv(&RecvWr::new(
        i,
        &[pool.slice(s..s + slot).map_err(e("slice"))?],
    )) {
        Err(err) if err.kind() == ErrorKind::InvalidState => Ok(()),
        r => r.map_err(e("post_recv")),
    }
}

pub(crate) fn serve(
    domain: &AnyDomain,
    listener: &AnyListener,
    queues: Queues,
) -> Result<(), String> {
    let cq = domain.create_cq(queues.cq).map_err(e("create_cq"))?;
    let ep = listener
        .accept(&queues.endpoint_config(&cq), IDLE)
        .map_err(e("accept"))?;
    let hello_mr = domain
        .alloc(CTRL_LEN, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    ep.post_recv(&RecvWr::new(CTRL_TAG, &[hello_mr.all()]))
        .map_err(e("post_recv"))?;
    // The mode of the hot path comes with each phase; control waits block.
    let mut r = Reaper::new(&cq, &ep, Mode::Block);
    let c = r.next_recv(Mode::Block, IDLE)?;
    let hello = Ctrl::decode(&hello_mr.buffer().to_vec(0, c.byte_len as usize))?;
    if hello.kind != HELLO {
        return Err(format!("expected hello, got control kind {}", hello.kind));
    }
    let op = Op::from_code(hello.op).ok_or("unknown operation in hello")?;
    let ServerModes {
        mode,
        ctrl_mode,
        transmit,
    } = ServerModes::of_hello(hello.c);
    r.mode = mode;
    let peer = hello.desc.ok_or("hello without the client's region")?;
    let max_size = hello.a.max(CTRL_LEN as u64) as usize;
    let target = domain
        .alloc(max_size, Access::all())
        .map_err(e("register target"))?;
    let local = domain
        .alloc(max_size, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let (nrecv, slot) = server_recvs(op, hello.a, hello.b);
    // A client whose test needs more receives than these queues hold (its window) is
    // told fewer in the reply, and keeps that many outstanding.
    let nrecv = nrecv.min(queues.recvs());
    let slot = slot as usize;
    let pool = domain
        .alloc(slot * nrecv as usize, Access::LOCAL_WRITE)
        .map_err(e("register receive pool"))?;
    let post_slot = |i: u64| repost(&ep, &pool, slot, i);
    for i in 0..nrecv {
        post_slot(i)?;
    }
    let ctrl_mr = domain
        .alloc(CTRL_LEN, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let mut seq = 0;
    let mut reply = Ctrl::new(REPLY);
    reply.a = nrecv;
    reply.desc = Some(target.desc());
    send_ctrl(&mut r, &ep, &ctrl_mr, &mut seq, reply)?;
    let mut ctx = 0u64;
    loop {
        let c = r.next_recv(ctrl_mode, IDLE)?;
        let s = c.context as usize * slot;
        let m = Ctrl::decode(&pool.buffer().to_vec(s, c.byte_len as usize))?;
        match m.kind {
            // The client may be gone already: nothing more is posted.
            BYE => return Ok(()),
            PHASE => post_slot(c.context)?,
            k => return Err(format!("unexpected control kind {k}")),
        }
        let test = Test::from_code(m.test).ok_or("unknown test in phase")?;
        let size = m.a as usize;
        let count = m.b;
        match (test, op) {
            (Test::Pingpong | Test::Lat, Op::Send) => {
                let src = [local.slice(0..size).map_err(e("slice"))?];
                let inline = size as u64 <= queues.inline_limit(&domain.info().caps.limits);
                let level = |w| level(w, transmit);
                let level = |w| if inline { level(w).inline() } else { level(w) };
                let pool = (&pool, slot);
                echo_sends(&mut r, &ep, pool, &src, &level, &mut ctx, count)?;
            }
            (Test::Pingpong | Test::Lat, Op::Write) => {
                // Only the marker is ever non-zero in what is written.
                local.buffer().fill(0, max_size, 0);
                let src = [local.slice(0..size).map_err(e("slice"))?];
                let (theirs, ours) = (Marker::new(&target, size), Marker::new(&local, size));
                for k in 0..count {
                    r.wait_marker(&theirs, m.c + k)?;
                    ours.put(m.c + k);
                    let wr = level(SendWr::write(ctx, &src, peer.at(0)), transmit);
                    let wr = if signal(ctx) { wr } else { wr.unsignaled() };
                    ctx += 1;
                    r.post(|| ep.post_send(&wr))?;
                }
            }
            (Test::Pingpong | Test::Lat, Op::WriteImm) => {
                let src = [local.slice(0..size).map_err(e("slice"))?];
                for _ in 0..count {
                    let c = r.next_recv(mode, STALL)?;
                    post_slot(c.context)?;
                    let wr = level(
                        SendWr::write(ctx, &src, peer.at(0)).with_imm(ctx as u32),
                        transmit,
                    );
                    let wr = if signal(ctx) { wr } else { wr.unsignaled() };
                    ctx += 1;
                    r.post(|| ep.post_send(&wr))?;
                }
            }
            (Test::Bw, Op::Send | Op::WriteImm) => {
                for _ in 0..count {
                    let c = r.next_recv(mode, STALL)?;
                    post_slot(c.context)?;
                }
            }
            // One-sided operations: the server application does nothing.
            _ => {}
        }
    }
}

/// The client: connects, runs every phase of `plan`, returns one row per phase.
pub(crate) fn client(
    domain: &AnyDomain,
    addr: SocketAddr,
    plan: &Plan,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<Row>, String> {
    if plan.op == Op::Tagged {
        return Err("--op tagged runs over rdm endpoints (perf/tagged.rs), not here".into());
    }
    let max_size = plan.max_size().max(CTRL_LEN as u64) as usize;
    let queues = Queues::for_test(
        plan.test,
        plan.window,
        false,
        plan.max_size(),
        &domain.info().caps.limits,
    );
    let cq = domain.create_cq(queues.cq).map_err(e("create_cq"))?;
    let ep = domain
        .connect(addr, &queues.endpoint_config(&cq))
        .map_err(|err| format!("connect to {addr}: {err}"))?;
    let target = domain
        .alloc(max_size, Access::all())
        .map_err(e("register target"))?;
    let local = domain
        .alloc(max_size, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let echo = domain
        .alloc(max_size, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let ctrl_mr = domain
        .alloc(CTRL_LEN, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let reply_mr = domain
        .alloc(CTRL_LEN, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let result = domain
        .alloc(8, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let mut r = Reaper::new(&cq, &ep, plan.mode);
    let mut seq = 0;

    ep.post_recv(&RecvWr::new(CTRL_TAG, &[reply_mr.all()]))
        .map_err(e("post_recv"))?;
    let mut hello = Ctrl::new(HELLO);
    hello.test = plan.test.code();
    hello.op = plan.op.code();
    hello.a = plan.max_size();
    hello.b = plan.window;
    hello.c = hello_word(plan);
    hello.desc = Some(target.desc());
    send_ctrl(&mut r, &ep, &ctrl_mr, &mut seq, hello)?;
    let c = r.next_recv(Mode::Block, STALL)?;
    let reply = Ctrl::decode(&reply_mr.buffer().to_vec(0, c.byte_len as usize))?;
    if reply.kind != REPLY {
        return Err(format!(
            "expected the server's reply, got kind {}",
            reply.kind
        ));
    }
    let remote = reply.desc.ok_or("reply without the server's region")?;
    let server_recvs = reply.a;
    let limits = domain.info().caps.limits;
    let window = match plan.op {
        Op::Send | Op::WriteImm => plan.window.min(server_recvs),
        Op::Write => plan.window,
        _ => plan
            .window
            .min(u64::from(limits.max_outstanding_reads).max(1)),
    };
    let max_inline = queues.inline_limit(&limits);

    let mut st = State {
        r,
        ep: &ep,
        ctx: 0,
        marker_seq: 0,
        phase_left: 0,
        echo_posted: 0,
        cas_compare: 0,
    };
    let mut rows = Vec::new();
    for ph in &plan.phases {
        bar.set_message(format!("{} bytes", ph.size));
        let mut m = Ctrl::new(PHASE);
        m.test = plan.test.code();
        m.op = plan.op.code();
        m.a = ph.size;
        m.b = ph.warmup + ph.iters;
        m.c = st.marker_seq;
        send_ctrl(&mut st.r, &ep, &ctrl_mr, &mut seq, m)?;
        let size = ph.size as usize;
        if plan.op == Op::Write && plan.test != Test::Bw {
            // Only the marker is ever non-zero in what is written.
            local.buffer().fill(0, max_size, 0);
        }
        st.phase_left = ph.warmup + ph.iters;
        let src = [local.slice(0..size).map_err(e("slice"))?];
        let sink = [local.slice(0..size).map_err(e("slice"))?];
        let echo_sgl = [echo.slice(0..size).map_err(e("slice"))?];
        let res = result.all();
        let inline = ph.size <= max_inline;
        // One request of the operation with context `ctx`.
        let wr = |ctx: u64, signaled: bool, cas_old: u64| -> SendWr<'_> {
            let w = match plan.op {
                Op::Send => SendWr::send(ctx, &src),
                Op::Write => SendWr::write(ctx, &src, remote.at(0)),
                Op::WriteImm => SendWr::write(ctx, &src, remote.at(0)).with_imm(ctx as u32),
                Op::Read => SendWr::read(ctx, &sink, remote.at(0)),
                Op::FetchAdd => SendWr::fetch_add(ctx, res, remote.at(0), 1),
                Op::CompareSwap => {
                    SendWr::compare_swap(ctx, res, remote.at(0), cas_old, cas_old.wrapping_add(1))
                }
                Op::Tagged => unreachable!("refused at the top of `client`"),
            };
            let w = if inline && matches!(plan.op, Op::Send | Op::Write) {
                w.inline()
            } else {
                w
            };
            let w = level(w, plan.transmit);
            if signaled {
                w
            } else {
                w.unsignaled()
            }
        };
        let row = match plan.test {
            Test::Bw => {
                st.stream(ph.warmup, window, &wr, bar)?;
                let t = Instant::now();
                st.stream(ph.iters, window, &wr, bar)?;
                let secs = t.elapsed().as_secs_f64();
                Row {
                    test: plan.test,
                    op: plan.op,
                    bytes: ph.size,
                    iters: ph.iters,
                    xfers_per_iter: 1,
                    secs,
                    dist: None,
                }
            }
            Test::Pingpong | Test::Lat => {
                let timed = plan.test == Test::Lat;
                let io = PingIo {
                    op: plan.op,
                    ours: Marker::new(&local, size),
                    theirs: Marker::new(&target, size),
                    echo: &echo_sgl,
                    result: &result,
                };
                if plan.op.consumes_recv() {
                    // The first echoes' receives; each iteration posts one more while
                    // the phase has echoes left that none is posted for.
                    let k = ECHO_RECVS.min(st.phase_left);
                    for _ in 0..k {
                        st.ep
                            .post_recv(&RecvWr::new(0, &echo_sgl))
                            .map_err(e("post_recv"))?;
                    }
                    st.echo_posted = k;
                }
                st.pingpong(&io, ph.warmup, false, &wr, bar)?;
                let t = Instant::now();
                let samples = st.pingpong(&io, ph.iters, timed, &wr, bar)?;
                let secs = t.elapsed().as_secs_f64();
                let xfers_per_iter = if plan.op.one_way() { 2 } else { 1 };
                let dist = timed.then(|| distribution(samples, xfers_per_iter));
                Row {
                    test: plan.test,
                    op: plan.op,
                    bytes: ph.size,
                    iters: ph.iters,
                    xfers_per_iter,
                    secs,
                    dist,
                }
            }
        };
        rows.push(row);
    }
    send_ctrl(&mut st.r, &ep, &ctrl_mr, &mut seq, Ctrl::new(BYE))?;
    // Wait until the bye has left: its completion (control sends are all signaled).
    let want = CTRL_TAG | seq;
    let mut seen = false;
    let deadline = Instant::now() + STALL;
    while !seen {
        let mut out = Vec::new();
        cq.poll(&mut out, 64).map_err(e("poll"))?;
        seen = out.iter().any(|c| c.context == want);
        if !seen {
            if Instant::now() > deadline {
                return Err("the bye message never completed".into());
            }
            cq.wait(Duration::from_millis(100)).map_err(e("wait"))?;
        }
    }
    Ok(rows)
}

/// The server's side of a send ping-pong phase: `count` echoes, each sent (`how` sets its
/// completion level and whether it goes inline) once a receive arrived and its slot of
/// `pool` (the region and its slot size) was given back. Apart from `serve`: inside that
/// large function the compiler kept the repost's and the post's closures as calls of
/// their own between the receive and the echo (callgrind in the soft-RDMA guest,
/// docs/benchmarks-record.md, forty-sixth session).
#[inline(never)]
fn echo_sends<'w>(
    r: &mut Reaper<'_>,
    ep: &AnyEndpoint,
    (pool, slot): (&MemoryRegion, usize),
    src: &'w [fabric::Slice<'w>],
    how: &impl Fn(SendWr<'w>) -> SendWr<'w>,
    ctx: &mut u64,
    count: u64,
) -> Result<(), String> {
    let mode = r.mode;
    for _ in 0..count {
        let c = r.next_recv(mode, STALL)?;
        repost(ep, pool, slot, c.context)?;
        let wr = how(SendWr::send(*ctx, src));
        let wr = if signal(*ctx) { wr } else { wr.unsignaled() };
        *ctx += 1;
        r.post(|| ep.post_send(&wr))?;
    }
    Ok(())
}

/// `w`, transmit complete if `transmit` (`--completion transmit`).
fn level(w: SendWr<'_>, transmit: bool) -> SendWr<'_> {
    if transmit {
        w.transmit_complete()
    } else {
        w
    }
}

/// Microseconds per transfer: min, median, p99, max.
pub(super) fn distribution(mut samples: Vec<f64>, xfers_per_iter: u64) -> [f64; 4] {
    for s in &mut samples {
        *s *= 1e6 / xfers_per_iter as f64;
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    [at(0.0), at(0.5), at(0.99), at(1.0)]
}

/// Regions of a ping-pong.
struct PingIo<'a> {
    op: Op,
    /// The marker this side's writes carry (write ping-pongs).
    ours: Marker<'a>,
    /// The marker the peer's writes leave in this side's target region.
    theirs: Marker<'a>,
    echo: &'a [fabric::Slice<'a>],
    result: &'a MemoryRegion,
}

/// The client's running state across phases.
struct State<'a> {
    r: Reaper<'a>,
    ep: &'a AnyEndpoint,
    /// The next data request's context.
    ctx: u64,
    /// The next write ping-pong marker's sequence number.
    marker_seq: u64,
    /// Ping-pong iterations left in this phase, warm-up included.
    phase_left: u64,
    /// The value the next compare-and-swap expects.
    cas_compare: u64,
    /// Echo receives posted and not yet filled (send and write-with-immediate ping-pongs).
    echo_posted: u64,
}

impl State<'_> {
    /// Posts `n` requests keeping at most `window` outstanding; one in four of the window
    /// (and the last) is signaled.
    fn stream<'w>(
        &mut self,
        n: u64,
        window: u64,
        wr: &impl Fn(u64, bool, u64) -> SendWr<'w>,
        bar: &indicatif::ProgressBar,
    ) -> Result<(), String> {
        let base = self.ctx;
        let end = base + n;
        let every = (window / 4).max(1);
        while self.ctx < end {
            if self.ctx - self.r.done_upto >= window {
                let need = self.ctx - window + 1;
                self.r.wait_done(need)?;
            }
            let i = self.ctx - base;
            let signaled = (i + 1).is_multiple_of(every) || self.ctx + 1 == end;
            let w = wr(self.ctx, signaled, 0);
            let ep = self.ep;
            self.r.post(|| ep.post_send(&w))?;
            self.ctx += 1;
            if i & 1023 == 1023 {
                bar.inc(1024);
            }
        }
        bar.inc(n & 1023);
        self.r.wait_done(end)
    }

    /// `n` ping-pong iterations. Returns per-iteration seconds when `timed`.
    fn pingpong<'w>(
        &mut self,
        io: &PingIo<'_>,
        n: u64,
        timed: bool,
        wr: &impl Fn(u64, bool, u64) -> SendWr<'w>,
        bar: &indicatif::ProgressBar,
    ) -> Result<Vec<f64>, String> {
        let ep = self.ep;
        let mode = self.r.mode;
        let mut laps = super::Laps::start(timed, n);
        for i in 0..n {
            let ctx = self.ctx;
            self.ctx += 1;
            self.phase_left -= 1;
            match io.op {
                Op::Send | Op::WriteImm => {
                    let w = wr(ctx, signal(ctx) || self.phase_left == 0, 0);
                    self.r.post(|| ep.post_send(&w))?;
                    laps.sent(i);
                    self.r.next_recv(mode, STALL)?;
                    self.echo_posted -= 1;
                    if self.echo_posted < self.phase_left {
                        ep.post_recv(&RecvWr::new(0, io.echo))
                            .map_err(e("post_recv"))?;
                        self.echo_posted += 1;
                    }
                }
                Op::Write => {
                    let seq = self.marker_seq;
                    self.marker_seq += 1;
                    io.ours.put(seq);
                    let w = wr(ctx, signal(ctx) || self.phase_left == 0, 0);
                    self.r.post(|| ep.post_send(&w))?;
                    laps.sent(i);
                    self.r.wait_marker(&io.theirs, seq)?;
                }
                Op::Tagged => unreachable!("refused at the top of `client`"),
                Op::Read | Op::FetchAdd | Op::CompareSwap => {
                    let w = wr(ctx, true, self.cas_compare);
                    self.r.post(|| ep.post_send(&w))?;
                    laps.sent(i);
                    self.r.wait_done(ctx + 1)?;
                    if io.op == Op::CompareSwap {
                        // The word now holds compare + 1 if the swap happened, else `old`.
                        let old = u64::from_ne_bytes(
                            io.result.buffer().to_vec(0, 8).try_into().expect("8"),
                        );
                        self.cas_compare = if old == self.cas_compare {
                            old.wrapping_add(1)
                        } else {
                            old
                        };
                    }
                }
            }
            laps.done(i, bar);
        }
        bar.inc(n & 255);
        Ok(laps.into_samples())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A domain of the tcp provider, for tests that need real endpoints or regions.
    fn tcp_domain() -> AnyDomain {
        crate::selector(Some("tcp"))
            .and_then(|s| s.open().map_err(|e| e.to_string()))
            .expect("tcp domain")
            .0
    }

    /// Receives come out in the order they went in, through emptying and through the
    /// compaction of a backlog that never empties (against a `VecDeque` model).
    #[test]
    fn arrivals_keep_their_order_through_emptying_and_a_standing_backlog() {
        let mut a = Arrivals::default();
        let mut model = std::collections::VecDeque::new();
        let mut ctx = 0u64;
        let mut emptied = 0;
        for round in 0..6000u64 {
            // Two in, one out for 1 500 rounds: a backlog of 1 500 that never empties
            // while more than 1 024 are taken (compaction); then five out until empty.
            for _ in 0..2 {
                let r = Received {
                    context: ctx,
                    byte_len: ctx * 3,
                };
                a.push(r);
                model.push_back(r);
                ctx += 1;
            }
            let outs = if round % 2000 < 1500 { 1 } else { 5 };
            for _ in 0..outs {
                let got = a.pop().map(|r| (r.context, r.byte_len));
                let want = model.pop_front().map(|r| (r.context, r.byte_len));
                assert_eq!(got, want);
                assert_eq!(a.is_empty(), model.is_empty());
            }
            assert_eq!(a.items.len() - a.next, model.len());
            assert!(a.next < 1024, "taken receives are forgotten");
            emptied += usize::from(model.is_empty());
        }
        assert!(emptied >= 3, "the backlog drained to empty in each block");
    }

    /// A marker kept in one aligned word reads and writes the same bytes as the
    /// general copy (the peer may be an older `fabric perf`, or a size that is not a
    /// multiple of 8 on the other side of a sweep), and looks only at the end of
    /// `[0, size)`.
    #[test]
    fn a_marker_in_its_word_is_the_same_bytes_as_the_general_copy() {
        let domain = tcp_domain();
        let mr = domain.alloc(64, Access::LOCAL_WRITE).unwrap();
        for size in [1usize, 3, 8, 12, 16, 64] {
            let m = Marker::new(&mr, size);
            assert_eq!(
                m.word.is_some(),
                size % 8 == 0,
                "size {size}: a word exactly when aligned"
            );
            for seq in [0u64, 1, 254, 255, 256, 1 << 40] {
                mr.buffer().fill(0, 64, 0);
                m.put(seq);
                assert!(m.is(seq) && m.is_bytes(seq), "size {size} seq {seq}");
                assert!(!m.is(seq + 1) && !m.is_bytes(seq + 1));
                let bytes = mr.buffer().to_vec(0, 64);
                mr.buffer().fill(0, 64, 0);
                m.put_bytes(seq);
                assert_eq!(mr.buffer().to_vec(0, 64), bytes, "size {size} seq {seq}");
                assert!(m.is(seq));
                let nonzero: Vec<usize> = (0..64).filter(|&i| bytes[i] != 0).collect();
                assert!(
                    nonzero.iter().all(|&i| i < size && i + 8 >= size.max(8)),
                    "size {size}: the marker is the end of the range: {nonzero:?}"
                );
            }
        }
    }

    /// A latency test's queues hold what its loop keeps outstanding (its echo receives
    /// or window, the unsignaled sends before a signaled one, and the control messages)
    /// and no more; a bandwidth test's hold its window as before.
    #[test]
    fn queues_are_sized_to_the_test() {
        let limits = fabric::Limits {
            max_msg_size: 1 << 30,
            max_inline: 400,
            max_sge: 32,
            max_send_queue: 16384,
            max_recv_queue: 16384,
            max_cq_entries: 65536,
            max_outstanding_reads: 16,
            max_private_data: 56,
        };
        for test in [Test::Lat, Test::Pingpong] {
            for server in [false, true] {
                let q = Queues::for_test(test, 64, server, 8, &limits);
                assert_eq!(q.depth, 80);
                assert!(q.recvs() >= ECHO_RECVS && q.recvs() >= PINGPONG_SIGNAL);
                assert!(
                    q.cq >= 2 * q.depth as usize,
                    "room for both queues' completions"
                );
                // One entry; inline up to a control message, or the largest message.
                assert_eq!((q.max_sge, q.max_inline), (Some(1), Some(CTRL_LEN as u32)));
                let q = Queues::for_test(test, 64, server, 256, &limits);
                assert_eq!(q.inline_limit(&limits), 256);
                let q = Queues::for_test(test, 64, server, 4096, &limits);
                assert_eq!(q.inline_limit(&limits), 400, "within the domain's");
                let wide = Queues::for_test(test, 1000, server, 8, &limits);
                assert_eq!(wide.recvs(), 1000, "a wider window gets its receives");
            }
        }
        let bw = Queues::for_test(Test::Bw, 64, false, 8, &limits);
        assert_eq!(
            (bw.cq, bw.depth, bw.max_sge, bw.max_inline),
            (4096, 256, None, None)
        );
        assert_eq!(
            Queues::for_test(Test::Bw, 2048, false, 8, &limits).depth,
            4096
        );
        assert_eq!(
            Queues::for_test(Test::Bw, 2048, true, 8, &limits).depth,
            1024
        );
    }

    /// `Reaper::post`'s retry path: a send queue of depth 2 refuses a third write until a
    /// poll frees room; every write is posted once and completes (tcp provider, loopback,
    /// in one process).
    #[test]
    fn a_post_refused_for_a_full_send_queue_is_polled_for_and_retried() {
        let domain = tcp_domain();
        let listener = domain.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr();
        let target = domain.alloc(4096, Access::all()).unwrap();
        let desc = target.desc();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let (dom, lis) = (&domain, &listener);
        std::thread::scope(|s| {
            let done_tx = done_tx;
            s.spawn(move || {
                let cq = dom.create_cq(64).unwrap();
                let _ep = lis
                    .accept(&EndpointConfig::new(&cq), Duration::from_secs(10))
                    .unwrap();
                // Held until the client saw every completion, or failed (the sender
                // dropped as its panic unwinds: the test fails, it does not hang).
                let _ = done_rx.recv();
            });
            let cq = domain.create_cq(64).unwrap();
            let mut cfg = EndpointConfig::new(&cq);
            cfg.sq_depth = 2;
            let ep = domain.connect(addr, &cfg).unwrap();
            let local = domain.alloc(64, Access::LOCAL_WRITE).unwrap();
            let src = [local.slice(0..64).unwrap()];
            let mut r = Reaper::new(&cq, &ep, Mode::Busy);
            let (mut posts, mut refused) = (0u64, 0u64);
            const WRITES: u64 = 16;
            for ctx in 0..WRITES {
                let wr = SendWr::write(ctx, &src, desc.at(0));
                r.post(|| {
                    posts += 1;
                    let res = ep.post_send(&wr);
                    refused += u64::from(
                        res.as_ref()
                            .is_err_and(|e| e.kind() == ErrorKind::QueueFull),
                    );
                    res
                })
                .unwrap();
            }
            r.wait_done(WRITES).unwrap();
            assert_eq!(r.done_upto, WRITES, "every write completed");
            assert!(refused > 0, "the queue of depth 2 never refused a write");
            assert_eq!(
                posts,
                WRITES + refused,
                "each refusal retried, nothing posted twice"
            );
            done_tx.send(()).unwrap();
        });
    }

    /// A spinning wait with nothing posted to flush (a receive awaited, none posted) sees
    /// the peer leave through the stall check's look at the endpoint's state, which comes
    /// only after [`STATE_AFTER`] without progress: well before `STALL` (tcp provider,
    /// loopback, in one process).
    #[test]
    fn a_spinning_wait_sees_the_peer_leave_without_waiting_out_the_stall_limit() {
        let domain = tcp_domain();
        let listener = domain.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr();
        let (dom, lis) = (&domain, &listener);
        std::thread::scope(|s| {
            s.spawn(move || {
                let cq = dom.create_cq(64).unwrap();
                let ep = lis
                    .accept(&EndpointConfig::new(&cq), Duration::from_secs(10))
                    .unwrap();
                std::thread::sleep(Duration::from_millis(50));
                ep.close().unwrap();
            });
            let cq = domain.create_cq(64).unwrap();
            let ep = domain.connect(addr, &EndpointConfig::new(&cq)).unwrap();
            let mut r = Reaper::new(&cq, &ep, Mode::Spin);
            let t = Instant::now();
            let err = r.next_recv(Mode::Spin, STALL).map(|_| ()).unwrap_err();
            assert!(
                err.contains("while waiting for a receive"),
                "the wait failed for the peer's leaving, not the stall limit: {err}"
            );
            assert!(
                t.elapsed() < STALL / 4,
                "seen after {:?}: the stall check stopped asking the state",
                t.elapsed()
            );
        });
    }

    #[test]
    fn the_hello_carries_the_mode_and_whether_the_server_polls_while_it_waits() {
        let plan = |mode, transmit, server_polls| Plan {
            test: Test::Lat,
            op: Op::Read,
            phases: Vec::new(),
            window: 1,
            mode,
            transmit,
            server_polls,
        };
        let modes = |p: &Plan| ServerModes::of_hello(hello_word(p));
        for mode in [Mode::Busy, Mode::Spin, Mode::Block] {
            for transmit in [false, true] {
                let polls = modes(&plan(mode, transmit, true));
                assert_eq!(
                    polls,
                    ServerModes {
                        mode,
                        ctrl_mode: mode,
                        transmit
                    }
                );
                let waits = modes(&plan(mode, transmit, false));
                assert_eq!(
                    waits,
                    ServerModes {
                        mode,
                        ctrl_mode: Mode::Block,
                        transmit
                    }
                );
            }
        }
    }
}
