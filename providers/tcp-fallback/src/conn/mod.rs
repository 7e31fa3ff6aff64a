//! One connection: send-queue bookkeeping, completions, errors and close. The receive
//! state machine is in [`rx`], the transmit queue in [`crate::tx`], and what drives both
//! (no thread per connection) in [`crate::engine`].
//!
//! Lock order: `rx` (the receive machine, try-locked) before `st` (this state) before `tx`
//! (the transmit queue) before a completion queue's own lock. The transmit queue is never
//! held while taking `st`.
//!
//! Completion order: send-queue requests complete in post order. Each one waits for its
//! responses (a delivery ack per Send / Write / Immediate message when the peer acknowledges,
//! the last Read Response segment, the Atomic Response) and for its bytes to leave; the
//! target handles its stream in order, so responses arrive in request order.

mod rx;

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_api::sync::{Mutex, MutexGuard};

use mio::Token;

use fabric_api::pdata;
use fabric_api::{
    Access, AtomicOp, Buffer, Completion, EndpointEvent, EndpointEvents, EndpointState, Error,
    ErrorKind, Opcode, ProviderCode, RecvWr, Result, SendFlags, SendOp, SendWr, Status,
};

use crate::cq::TcpCq;
use crate::credit::{credit_allows, LocalArea};
use crate::emu::{Announcement, LocalEmu};
use crate::engine::Engine;
use crate::keys::{random_u32, KeyTable};
use crate::tx::{copy_sges, encode_fpdu, Kind, Msgs, OutMsg, Payload, Queued, Sges, TxQueue};
use crate::wire::ddp::{
    self, atomic_op, opcode, qn, term, AtomicRequest, AtomicResponse, ReadRequest, Terminate,
};
use crate::wire::mpa::features;
use fabric_api::emu_wire::{self, AmoOp, AmoReq, ExtDesc, ImmRec};

use rx::{violation, Rx, RxEnd};

/// Bytes of unmatched incoming messages buffered per endpoint before the receive machine
/// stops reading (TCP back-pressure then holds the sender: nothing is lost). A message
/// larger than what is left waits, part-buffered, for a receive and is then placed into it
/// directly, so one endpoint never buffers more than this (docs/contract.md section 8).
pub(crate) const UNEXPECTED_LIMIT: usize = 8 << 20;

/// What one buffered unexpected message costs against [`UNEXPECTED_LIMIT`] beyond its
/// payload: a flood of zero-byte messages is bounded too.
pub(crate) const UNEXPECTED_ENTRY_COST: usize = 64;

/// Messages queued for transmission beyond which the receive machine stops reading
/// from the peer: a peer that sends and never reads cannot grow our output (acks,
/// responses) without bound; TCP back-pressure then holds it.
pub(crate) const TX_QUEUE_LIMIT: usize = 4096;

/// What the connection setup agreed on.
#[derive(Debug, Clone)]
pub(crate) struct Negotiated {
    /// Extension features both peers speak ([`features`]).
    pub features: u8,
    /// CRC32c in use.
    pub crc: bool,
    /// Outstanding reads and atomics we may have in flight (min of our ORD, peer IRD).
    pub ord: u32,
    /// MPA revision in use.
    pub revision: u8,
    /// The peer's application private data.
    pub peer_private: Vec<u8>,
    /// Swallow the first zero-length Send (a peer-to-peer RTR).
    pub expect_send_rtr: bool,
    /// The credit area of a peer on this framework's iwarp provider (from its private-data
    /// frame): a graceful close writes the close mark there first ([`pdata`]).
    pub peer_area: Option<pdata::AreaDesc>,
    /// Our credit area, with a peer on this framework's iwarp provider that knows of it
    /// (our reply's frame named it, or, as the initiator, we name it first thing): then
    /// the connection runs the iwarp provider's credit protocol ([`crate::credit`]).
    pub area: Option<Arc<LocalArea>>,
    /// Our emulation area, with a peer on this framework's iwarp provider that offered the
    /// emulation of atomics and immediate data ([`crate::emu`]).
    pub emu: Option<Arc<LocalEmu>>,
    /// That peer's emulation area (its trailer).
    pub peer_emu: Option<ExtDesc>,
    /// We initiated the connection (a peer on the iwarp provider then has early receives
    /// posted, which our filler sends consume: see [`EARLY_FILLERS`]).
    pub initiator: bool,
}

/// Receives this framework's iwarp provider posts before it accepts a connection whose
/// request carries no frame of this framework (its `EarlyRing`: a foreign peer may send
/// at once). An initiator on this provider consumes them with as many zero-length sends,
/// right after its hello mark, so the application's messages meet the application's
/// receives (and their length checks) as with any other peer.
pub(crate) const EARLY_FILLERS: usize = 4;

impl Negotiated {
    fn has(&self, f: u8) -> bool {
        self.features & f != 0
    }

    /// Our credit area and the peer's, when the connection runs credits.
    fn credits(&self) -> Option<(&LocalArea, pdata::AreaDesc)> {
        Some((self.area.as_deref()?, self.peer_area?))
    }

    /// Our emulation area and the peer's, when the connection speaks the iwarp provider's
    /// emulation of atomics and immediate data (it needs the credit protocol too).
    pub fn emu(&self) -> Option<(&LocalEmu, ExtDesc)> {
        self.credits()?;
        Some((self.emu.as_deref()?, self.peer_emu?))
    }

    /// Sends wait for the peer's receives: by credits (the iwarp provider), or because
    /// the peer buffers them and acknowledges their delivery (this provider).
    pub fn rnr_wait(&self) -> bool {
        self.has(features::ACKS) || self.credits().is_some()
    }
}

/// The `sent_seq` of our credit updates (never a send-queue sequence number): when one
/// has left, a newer count follows if receives were posted meanwhile.
const CREDIT_UPDATE: u64 = u64::MAX;

/// What a send-queue request still waits for.
#[derive(Debug)]
enum Resp {
    /// Delivery acks (or nothing, with a foreign peer).
    Acks,
    /// The last Read Response segment for this sink STag.
    Read { sink: u32 },
    /// The Atomic Response with this id, whose value lands at (buffer, offset).
    Atomic {
        req_id: u32,
        result: Arc<Buffer>,
        offset: usize,
    },
    /// The reply to our emulated atomic (the one outstanding: `State::amo_wait`) in our
    /// emulation area's reply slot, whose value lands at (buffer, offset).
    EmuAtomic { result: Arc<Buffer>, offset: usize },
}

#[derive(Debug)]
struct Pending {
    seq: u64,
    context: u64,
    opcode: Opcode,
    signaled: bool,
    /// Write acks still expected (Write messages are acknowledged when placed).
    wait_write: u32,
    /// Message acks still expected (Send and Immediate Data are acknowledged when they
    /// land in a receive, which may be long after later writes were placed).
    wait_msg: u32,
    /// A Read or Atomic Response is still expected.
    wait_resp: bool,
    /// All bytes handed to the kernel.
    sent: bool,
    byte_len: u64,
    resp: Resp,
    error: Option<(ErrorKind, Option<ProviderCode>)>,
    /// An RDMA Write's target (STag, tagged offset, length): what a foreign peer's
    /// Terminate names when it refuses the write.
    write_target: Option<(u32, u64, u64)>,
}

impl Pending {
    fn done(&self) -> bool {
        self.error.is_some()
            || (self.wait_write == 0 && self.wait_msg == 0 && !self.wait_resp && self.sent)
    }
    fn is_read_like(&self) -> bool {
        matches!(
            self.resp,
            Resp::Read { .. } | Resp::Atomic { .. } | Resp::EmuAtomic { .. }
        )
    }
}

#[derive(Debug)]
struct PostedRecv {
    context: u64,
    sges: Sges,
    total: usize,
}

#[derive(Debug)]
enum Arrived {
    Send { data: Vec<u8>, imm: Option<u32> },
    WriteImm { imm: u32, len: u64 },
}

impl Arrived {
    /// What the message costs against [`UNEXPECTED_LIMIT`].
    fn cost(&self) -> usize {
        UNEXPECTED_ENTRY_COST
            + match self {
                Arrived::Send { data, .. } => data.len(),
                Arrived::WriteImm { .. } => 0,
            }
    }
}

/// A request held back by a fence, the ORD limit or the peer's credits, with the
/// messages that carry it.
#[derive(Debug)]
struct Gated {
    msgs: Msgs,
    read_like: bool,
    fence: bool,
    /// Messages that consume a receive at the peer (credits).
    sends: u64,
    /// Read Requests beyond the first (a split read), each outstanding until its last
    /// response segment.
    extra_reads: u32,
    /// The emulation's record this request writes into the peer's area, filled in when
    /// the request starts (its ordinal or sequence number is known then): the index of
    /// the placeholder message in `msgs`.
    emu: Option<(usize, EmuFill)>,
}

/// A write into the peer's emulation area ([`crate::emu`]), filled in at start.
#[derive(Debug, Clone, Copy)]
enum EmuFill {
    /// An immediate-data record into the ring slot of the next send's ordinal.
    Imm(ImmRec),
    /// An atomic request into the request slot.
    Amo { op: AmoOp, addr: u64, rkey: u32 },
}

#[derive(Debug)]
struct State {
    status: EndpointState,
    sq: VecDeque<Pending>,
    backlog: VecDeque<Gated>,
    /// Reads and atomics transmitted and not yet answered.
    reads_out: u32,
    read_sinks: HashMap<u32, Sges>,
    /// Sinks of the first half of a split read ([`SMALL_PAYLOAD`]): their last segment
    /// completes no request, the second half's does.
    partial_sinks: HashSet<u32>,
    rq: VecDeque<PostedRecv>,
    /// The receive the current incoming message is being placed into: older than every
    /// receive in `rq`, and flushed with them if the connection ends mid-message.
    placing: Option<PostedRecv>,
    unexpected: VecDeque<Arrived>,
    unexpected_bytes: usize,
    next_seq: u64,
    msn: [u32; qn::COUNT],
    next_req_id: u32,
    /// The receive machine is handling a batch: delivery acks are counted here and sent
    /// as one ack per kind when the batch ends ([`Conn::flush_acks`]).
    batching: bool,
    /// Acks owed: RDMA Writes placed, messages matched.
    acks_owed: [u32; 2],
    /// When a poll of the application must send the acks owed ([`crate::engine::now_ns`];
    /// 1: at its next look; 0: none deferred), set when an application's pass first defers
    /// them (see [`Conn::send_held_due`]).
    held_due: u64,
    /// Whether polls may hold deferred acks: set when a message the application posted
    /// carried acks owed, cleared when a held ack expired instead. A target that never
    /// sends to this peer (a stream, a sender waiting for each completion) then pays the
    /// hold once at most; until a message has carried acks, none is held.
    hold_ok: bool,
    /// Messages of requests posted with `SendFlags::MORE`, held back to leave with the
    /// next ones in one `send` (at most `DIRECT_LIMIT` bytes of payload), and their bytes.
    corked: Vec<OutMsg>,
    corked_bytes: usize,
    /// Scratch of the direct transmit path, kept so that a message allocates nothing
    /// there: the messages of one `send`, their encoding, and where each one ends.
    spare_msgs: Vec<OutMsg>,
    spare_bytes: Vec<u8>,
    spare_ends: Vec<(usize, Option<u64>, bool)>,
    /// Receive completions of the batch, delivered after its acks are sent.
    received: Vec<Completion>,
    /// Credits ([`crate::credit`]): messages that consume a receive at the peer sent so
    /// far (our filler sends not counted: they meet the peer's early receives), receives
    /// ever posted, the count last handed to the transmit queue, and whether that update
    /// is still queued.
    sends_out: u64,
    recvs_posted: u64,
    posted_told: u64,
    update_queued: bool,
    /// Emulated atomics ([`crate::emu`]): requests we sent (the last one's sequence
    /// number), the one waiting for its reply, and the peer's requests we served.
    amo_sent: u64,
    amo_wait: Option<u64>,
    amo_served: u64,
    /// How many repeats of our hello mark were written (see
    /// [`crate::engine::HELLO_REPEATS`]).
    hello_repeats: usize,
}

/// The gather/scatter and inline limits of an endpoint's requests
/// ([`EndpointConfig::request_limits`](fabric_api::spi::EndpointConfig::request_limits)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestLimits {
    pub max_sge: usize,
    pub max_inline: usize,
}

/// The shared state of one connection.
#[derive(Debug)]
pub(crate) struct Conn {
    pub domain_id: u64,
    pub keys: Arc<KeyTable>,
    pub sock: TcpStream,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub neg: Negotiated,
    pub max_seg: usize,
    pub send_cq: TcpCq,
    pub recv_cq: TcpCq,
    pub sq_depth: usize,
    pub rq_depth: usize,
    pub limits: RequestLimits,
    st: Mutex<State>,
    tx: Mutex<TxQueue>,
    /// The receive machine; whoever makes progress try-locks it.
    rx: Mutex<Rx>,
    /// More progress is wanted than the thread holding `rx` has done yet.
    rx_pending: AtomicBool,
    /// The receive machine stopped reading until a receive is posted or room frees up.
    rx_blocked: AtomicBool,
    /// The application closed the endpoint (not a failure): see [`Conn::shutdown`].
    graceful: AtomicBool,
    /// An event reported the peer's FIN, a reset or an error ([`Conn::hung_up`]).
    hangup: AtomicBool,
    /// How far the socket was shut down: 0 not, 1 for writing, 2 both ways.
    shut: std::sync::atomic::AtomicU8,
    /// We may send: false only while we are the responder of a connection with credits
    /// and the initiator's first FPDU has not arrived. An MPA responder must not send
    /// before that (siw's initiator reads the MPA Reply with a look-ahead and fails the
    /// connection on bytes right behind it); until then everything posted is held back,
    /// and credit updates wait. The iwarp provider as the initiator speaks first (a credit
    /// update), so the wait is short and never a deadlock.
    heard: AtomicBool,
    /// This connection's token in the poll sets.
    pub(crate) token: Token,
    /// The domain's engine (its poll set and progress thread).
    engine: Arc<Engine>,
    /// The application's value for this endpoint, in every completion.
    ep_context: u64,
    /// Connection events: one per change of `State::status`.
    pub(crate) events: EndpointEvents,
}

impl Conn {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        domain_id: u64,
        keys: Arc<KeyTable>,
        sock: TcpStream,
        neg: Negotiated,
        max_seg: usize,
        send_cq: TcpCq,
        recv_cq: TcpCq,
        sq_depth: usize,
        rq_depth: usize,
        limits: RequestLimits,
        engine: Arc<Engine>,
        ep_context: u64,
    ) -> io::Result<Arc<Conn>> {
        let local = sock.local_addr()?;
        let peer = sock.peer_addr()?;
        sock.set_nonblocking(true)?;
        let crc = neg.crc;
        let heard = neg.initiator || neg.credits().is_none();
        Ok(Arc::new(Conn {
            domain_id,
            keys,
            sock,
            local,
            peer,
            neg,
            max_seg,
            send_cq,
            recv_cq,
            sq_depth,
            rq_depth,
            limits,
            st: Mutex::new(State {
                status: EndpointState::Connected,
                sq: VecDeque::new(),
                backlog: VecDeque::new(),
                reads_out: 0,
                read_sinks: HashMap::new(),
                partial_sinks: HashSet::new(),
                rq: VecDeque::new(),
                placing: None,
                unexpected: VecDeque::new(),
                unexpected_bytes: 0,
                next_seq: 0,
                msn: [1; qn::COUNT],
                next_req_id: 1,
                batching: false,
                acks_owed: [0; 2],
                held_due: 0,
                hold_ok: false,
                corked: Vec::new(),
                corked_bytes: 0,
                spare_msgs: Vec::new(),
                spare_bytes: Vec::new(),
                spare_ends: Vec::new(),
                received: Vec::new(),
                sends_out: 0,
                recvs_posted: 0,
                posted_told: 0,
                update_queued: false,
                amo_sent: 0,
                amo_wait: None,
                amo_served: 0,
                hello_repeats: 0,
            }),
            tx: Mutex::new(TxQueue::default()),
            rx: Mutex::new(Rx::new(crc)),
            rx_pending: AtomicBool::new(false),
            rx_blocked: AtomicBool::new(false),
            heard: AtomicBool::new(heard),
            graceful: AtomicBool::new(false),
            hangup: AtomicBool::new(false),
            shut: std::sync::atomic::AtomicU8::new(0),
            token: crate::engine::next_token(),
            engine,
            ep_context,
            events: EndpointEvents::new(),
        }))
    }

    /// Puts the socket into the domain's and the completion queues' poll sets and starts
    /// the domain's progress thread if it is not running; then makes progress once (bytes
    /// may have arrived before the socket was watched).
    pub fn start(self: &Arc<Self>) -> io::Result<()> {
        self.engine.set.add(self.token, &self.sock, self)?;
        self.send_cq.set().add(self.token, &self.sock, self)?;
        self.recv_cq.set().add(self.token, &self.sock, self)?;
        self.engine.ensure_thread()?;
        if let (Some(area), true) = (self.neg.peer_area, self.neg.initiator) {
            // This framework's iwarp provider is the peer, and our request carried no frame
            // (we could not know): tell it that we answer zero-length RDMA Reads (its
            // delivery reads and liveness probes), which it sends no foreign iWARP stack
            // (siw answers them with a stale length). As the initiator we may send first.
            // (As the responder our reply's frame said so.) Our credit area is named
            // before the mark: the peer reads it once it sees the mark.
            let mut st = self.lock();
            if let (Some(ours), Some(_)) = (self.neg.emu.as_deref(), self.neg.peer_emu) {
                // Our emulation area too, where the peer reads it once it sees the mark.
                self.transmit(
                    &mut st,
                    OutMsg::control(
                        Kind::Tagged {
                            opcode: opcode::WRITE,
                            stag: area.stag,
                            to: area.addr + pdata::area::EMU_OF_PEER as u64,
                        },
                        Announcement::encode(&ours.desc()).to_vec(),
                    ),
                );
            }
            if let Some(ours) = &self.neg.area {
                self.transmit(
                    &mut st,
                    OutMsg::control(
                        Kind::Tagged {
                            opcode: opcode::WRITE,
                            stag: area.stag,
                            to: area.addr + pdata::area::AREA_OF_PEER as u64,
                        },
                        ours.announcement(),
                    ),
                );
            }
            self.mark_peer_area(&mut st, area, pdata::area::HELLO);
            for _ in 0..EARLY_FILLERS {
                self.transmit(&mut st, empty_send());
            }
            drop(st);
            // The mark (and whatever follows it at once) may have reached siw before it
            // listens to the socket: repeated (see `HELLO_REPEATS`) by the progress thread,
            // or with none by the application's looks at either completion queue.
            let now = crate::engine::now_ns();
            match self.engine.mode {
                crate::engine::ProgressMode::Auto => self.engine.set.note_hello(self, now),
                crate::engine::ProgressMode::Manual => {
                    self.send_cq.set().note_hello(self, now);
                    if !std::ptr::eq(self.send_cq.set(), self.recv_cq.set()) {
                        self.recv_cq.set().note_hello(self, now);
                    }
                }
            }
        }
        self.progress();
        Ok(())
    }

    /// Writes our hello mark into the peer's area for the `n`-th time again (see
    /// [`crate::engine::HELLO_REPEATS`]) unless the connection left the connected state;
    /// a repeat that another poll set already wrote (both completion queues' in manual
    /// mode) is not written twice. Returns whether to go on repeating.
    pub fn repeat_hello(&self, n: usize) -> bool {
        let Some(area) = self.neg.peer_area else {
            return false;
        };
        let mut st = self.lock();
        if st.status != EndpointState::Connected {
            return false;
        }
        if st.hello_repeats > n {
            return true;
        }
        tracing::debug!(peer = %self.peer, "hello mark repeated");
        self.mark_peer_area(&mut st, area, pdata::area::HELLO);
        st.hello_repeats = n + 1;
        true
    }

    /// Takes the socket out of every poll set (the endpoint is being dropped).
    pub fn unwatch(&self) {
        self.engine.set.remove(self.token, &self.sock);
        self.send_cq.set().remove(self.token, &self.sock);
        self.recv_cq.set().remove(self.token, &self.sock);
    }

    /// An event reported the peer's FIN, a reset or an error: it may have arrived before
    /// the receive machine's last (short) read, and no later edge will announce it, so the
    /// machine reads until the socket says so (EOF, error or `EAGAIN`) from now on.
    pub fn hung_up(&self) {
        self.hangup.store(true, AtomicOrdering::SeqCst);
    }

    /// Whether the application drives this connection through one of its completion
    /// queues (see [`crate::engine::PollSet::app_driven`]).
    pub fn app_driven(&self) -> bool {
        self.send_cq.set().app_driven() || self.recv_cq.set().app_driven()
    }

    /// The poll set of the connection's domain (its progress thread's).
    pub fn domain_set(&self) -> &Arc<crate::engine::PollSet> {
        &self.engine.set
    }

    /// Makes progress: writes what the socket takes, then reads and handles what has
    /// arrived, until the socket would block (or the receive side waits for room).
    /// Serialised per connection without blocking: a caller that finds another thread at
    /// work leaves it a note, and that thread goes round once more.
    /// (The protocol is [`serialised`](crate::engine::sync::serialised); a loom model
    /// checks it.)
    pub fn progress(&self) {
        self.progress_as(false);
    }

    /// [`progress`](Self::progress) on behalf of the application (its poll, wait or arm on
    /// one of this connection's completion queues). The delivery acks of what this pass
    /// places are deferred instead of sent ahead of the receive completions: the
    /// application is about to see them and, in a ping-pong, to answer, and its next send
    /// carries the acks in the same `send` (one system call and one segment instead of
    /// two). At the latest they leave at the application's next wait or arm on either
    /// queue, its first poll once they are due ([`Conn::send_held_due`]), a close, or, when
    /// it stops polling, within `HANDOFF` from the domain's progress thread
    /// (docs/contract.md section 4).
    pub fn progress_app(self: &Arc<Self>) {
        if self.progress_as(true) {
            self.defer_output();
        }
    }

    /// Notes that output is held back (acks deferred by the application's pass, requests
    /// posted with `SendFlags::MORE`) in the poll sets of both completion queues and of
    /// the domain, which send it when the application is back or stops polling.
    pub fn defer_output(self: &Arc<Self>) {
        let due = {
            let st = self.lock();
            if st.corked.is_empty() && st.held_due != 0 {
                st.held_due
            } else {
                1
            }
        };
        let sets = [
            self.engine.set.as_ref(),
            self.send_cq.set(),
            self.recv_cq.set(),
        ];
        for (i, set) in sets.iter().enumerate() {
            if !sets[..i].iter().any(|s| std::ptr::eq(*s, *set)) {
                set.note_held(self, due);
            }
        }
    }

    /// Returns whether acks were deferred (only when `defer`).
    fn progress_as(&self, defer: bool) -> bool {
        let mut deferred = false;
        crate::engine::sync::serialised(&self.rx, &self.rx_pending, |rx| {
            self.flush_tx();
            if let rx::Step::Ran { deferred: d } = self.rx_step(rx, defer) {
                deferred = d;
                // What the receive side queued (responses, acks) goes out now.
                self.flush_tx();
            }
        });
        deferred
    }

    /// Sends what was held back (acks a pass of the application deferred, requests
    /// posted with `SendFlags::MORE`), unless a later message carried it already.
    pub fn send_held(&self) {
        let mut st = self.lock();
        if !st.batching {
            self.transmit_held(&mut st);
        }
    }

    /// [`Conn::send_held`] for a poll of the application at `now`
    /// ([`crate::engine::now_ns`]), only if it is due: requests posted with
    /// `SendFlags::MORE` are due at once, and deferred acks once they acknowledge more than
    /// [`ACK_HOLD_MAX`](crate::engine::ACK_HOLD_MAX) operations or were deferred the
    /// engine's `ack_hold` ago, or at once unless a message of the application has carried
    /// acks to this peer since the last hold expired (`State::hold_ok`). Until then they
    /// stay held for the next message to this peer to carry (a rank of a collective polls
    /// between two messages to one partner).
    /// Returns when they are due if they stay held.
    pub fn send_held_due(&self, now: u64) -> Option<u64> {
        let mut st = self.lock();
        if st.batching {
            return None; // the batch's end sends or defers them again
        }
        if st.corked.is_empty() && st.held_due != 0 && now < st.held_due {
            return Some(st.held_due);
        }
        if st.held_due > 1 && now >= st.held_due && st.acks_owed != [0; 2] {
            // Held for the whole `ack_hold` and no message came to carry it: this peer
            // is not answered the way a hold pays for.
            st.hold_ok = false;
        }
        self.transmit_held(&mut st);
        None
    }

    /// Writes what the socket takes of the transmit queue, then marks what went out.
    fn flush_tx(&self) {
        let mut tx = self.tx.lock().expect("tx poisoned");
        if tx.is_idle() {
            // Under the same lock: a pass comes here twice.
            return self.shutdown_if_over(tx);
        }
        let done = tx.flush(&self.sock, self.max_seg, self.neg.crc);
        drop(tx);
        if let Some(e) = &done.error {
            tracing::debug!(peer = %self.peer, "transmit failed: {e}");
            self.shutdown();
        }
        if !done.sent.is_empty() {
            let mut st = self.lock();
            for seq in done.sent {
                self.mark_sent(&mut st, seq);
            }
        }
        self.maybe_shutdown();
    }

    /// Ends the stream. After a graceful local close only the write side shuts (the peer
    /// sees the stream end on an FPDU boundary, and what it still sends is drained: Linux
    /// answers data on a socket shut for reading with a reset, which can destroy output
    /// the peer has not read yet). After a failure both sides shut: a peer that goes on
    /// sending gets a reset.
    fn shutdown(&self) {
        let (how, level) = if self.graceful.load(AtomicOrdering::SeqCst) {
            (Shutdown::Write, 1)
        } else {
            (Shutdown::Both, 2)
        };
        // Once per level: progress passes over a finished connection come here each time.
        if self.shut.fetch_max(level, AtomicOrdering::SeqCst) < level {
            let _ = self.sock.shutdown(how);
        }
    }

    /// Once the connection is over and its last output (a Terminate) is out, the socket
    /// shuts down.
    fn maybe_shutdown(&self) {
        self.shutdown_if_over(self.tx.lock().expect("tx poisoned"));
    }

    /// [`maybe_shutdown`](Self::maybe_shutdown) with the transmit queue already locked.
    fn shutdown_if_over(&self, tx: MutexGuard<'_, TxQueue>) {
        if tx.closed && tx.is_idle() {
            drop(tx);
            self.shutdown();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().expect("endpoint state poisoned")
    }

    pub fn state(&self) -> EndpointState {
        self.lock().status
    }

    fn check_connected(st: &State) -> Result<()> {
        match st.status {
            EndpointState::Connected => Ok(()),
            EndpointState::Error => Err(Error::new(
                ErrorKind::InvalidState,
                "endpoint is in the error state",
            )),
            EndpointState::Disconnected => Err(Error::new(
                ErrorKind::InvalidState,
                "endpoint is disconnected",
            )),
        }
    }

    // ----- posting -----------------------------------------------------------------

    fn gather(&self, sgl: &[fabric_api::Slice<'_>], need: Access) -> Result<(Sges, usize)> {
        if sgl.len() > self.limits.max_sge {
            return Err(Error::invalid(format!(
                "{} gather entries exceed the endpoint's maximum of {}",
                sgl.len(),
                self.limits.max_sge
            )));
        }
        let mut sges = Sges::with_capacity(sgl.len());
        let mut total = 0usize;
        for s in sgl {
            let r = s.check_local(self.domain_id, need)?;
            total += s.len();
            sges.push((r.shared_buffer(), s.offset(), s.len()));
        }
        if total as u64 > crate::MAX_MSG_SIZE {
            return Err(Error::invalid(format!(
                "message of {total} bytes exceeds the maximum of {}",
                crate::MAX_MSG_SIZE
            )));
        }
        Ok((sges, total))
    }

    fn need_feature(&self, f: u8, what: &str) -> Result<()> {
        if self.neg.has(f) || self.neg.emu().is_some() {
            Ok(())
        } else {
            Err(Error::unsupported(format!(
                "{what} needs this framework's extension on both ends; the peer did not negotiate it (a foreign iWARP peer, or extensions disabled)"
            )))
        }
    }

    /// Posts a request; returns whether its messages were held back (`SendFlags::MORE`:
    /// the caller then notes the connection with [`Self::defer_output`]).
    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<bool> {
        if let Some(done) = self.send_direct(wr) {
            return done;
        }
        let acks = self.neg.has(features::ACKS);
        let inline = wr.flags.contains(SendFlags::INLINE);
        let mut msgs = Msgs::new();
        let (wait_write, wait_msg, byte_len, resp_kind, read_like);
        enum R {
            Acks,
            Read(Sges),
            Atomic(Arc<Buffer>, usize),
            EmuAtomic(Arc<Buffer>, usize),
            /// A read split at the remote page boundary: the two halves' sinks.
            SplitRead(Sges, Sges),
        }
        // With this framework's iwarp provider: its emulation (crate::emu) instead of the
        // extension's opcodes, which it does not speak.
        let emulating = self.neg.emu().is_some();
        let mut emu_fill = None;
        let payload = |sges: Sges, total: usize| -> Result<Payload> {
            if inline {
                if total > self.limits.max_inline {
                    return Err(Error::invalid(format!(
                        "inline payload of {total} bytes exceeds the endpoint's max inline {}",
                        self.limits.max_inline
                    )));
                }
                let mut v = Vec::with_capacity(total);
                for (b, off, len) in &sges {
                    let start = v.len();
                    v.resize(start + len, 0);
                    b.read(*off, &mut v[start..]);
                }
                Ok(Payload::Inline(v))
            } else {
                Ok(Payload::Memory(sges))
            }
        };
        match wr.op {
            SendOp::Send { sgl, imm } => {
                if imm.is_some() {
                    self.need_feature(features::IMMEDIATE, "send with immediate data")?;
                }
                let (sges, total) = self.gather(sgl, Access::empty())?;
                let imm = match imm {
                    Some(v) if emulating => {
                        // The immediate goes into the peer's ring slot of this send first.
                        emu_fill = Some((
                            msgs.len(),
                            EmuFill::Imm(ImmRec {
                                kind: emu_wire::IMM_SEND,
                                imm: v,
                                len: 0,
                            }),
                        ));
                        msgs.push(emu_placeholder());
                        None
                    }
                    other => other,
                };
                let op = if imm.is_some() {
                    opcode::SEND_IMM
                } else {
                    opcode::SEND
                };
                msgs.push(OutMsg {
                    kind: Kind::Untagged {
                        opcode: op,
                        ulp: imm.unwrap_or(0),
                        qn: qn::SEND,
                        msn: 0,
                    },
                    payload: payload(sges, total)?,
                    sent_seq: None,
                    inbound: false,
                });
                (wait_write, wait_msg, byte_len, resp_kind, read_like) =
                    (0, u32::from(acks), total as u64, R::Acks, false);
            }
            SendOp::Write { sgl, remote, imm } => {
                if imm.is_some() {
                    self.need_feature(features::IMMEDIATE, "write with immediate data")?;
                }
                let (sges, total) = self.gather(sgl, Access::empty())?;
                msgs.push(OutMsg {
                    kind: Kind::Tagged {
                        opcode: opcode::WRITE,
                        stag: remote.key,
                        to: remote.addr,
                    },
                    payload: payload(sges, total)?,
                    sent_seq: None,
                    inbound: false,
                });
                if let (Some(v), true) = (imm, emulating) {
                    // Then the immediate and the written length into the peer's ring, then a
                    // zero-length Send that consumes one posted receive there: it is
                    // delivered after both writes were placed.
                    emu_fill = Some((
                        msgs.len(),
                        EmuFill::Imm(ImmRec {
                            kind: emu_wire::IMM_WRITE,
                            imm: v,
                            len: total as u64,
                        }),
                    ));
                    msgs.push(emu_placeholder());
                    msgs.push(empty_send());
                } else if let Some(v) = imm {
                    let mut p = vec![0u8; ddp::IMMEDIATE_LEN];
                    p[..4].copy_from_slice(&v.to_be_bytes());
                    msgs.push(OutMsg::control(
                        Kind::Untagged {
                            opcode: opcode::IMMEDIATE,
                            ulp: 0,
                            qn: qn::SEND,
                            msn: 0,
                        },
                        p,
                    ));
                }
                let imm_msgs = if emulating { 0 } else { msgs.len() as u32 - 1 };
                (wait_write, wait_msg, byte_len, resp_kind, read_like) = (
                    u32::from(acks),
                    if acks { imm_msgs } else { 0 },
                    total as u64,
                    R::Acks,
                    false,
                );
            }
            SendOp::Read { sgl, remote } => {
                let (sges, total) = self.gather(sgl, Access::LOCAL_WRITE)?;
                if inline {
                    return Err(Error::invalid("a read cannot be inline"));
                }
                if self.neg.credits().is_some() && crosses_small(remote.addr, total) {
                    // The iwarp provider's peer is siw, which garbles a small Read Response
                    // crossing a page of its memory: two reads, split at the page boundary
                    // (as the iwarp provider's own reads are).
                    let first = (REMOTE_PAGE - remote.addr % REMOTE_PAGE) as usize;
                    let (a, b) = split_sges(sges, first);
                    msgs.push(read_request(first as u32, remote.key, remote.addr));
                    msgs.push(read_request(
                        (total - first) as u32,
                        remote.key,
                        remote.addr + first as u64,
                    ));
                    (wait_write, wait_msg, byte_len, resp_kind, read_like) =
                        (0, 0, total as u64, R::SplitRead(a, b), true);
                } else {
                    (wait_write, wait_msg, byte_len, resp_kind, read_like) =
                        (0, 0, total as u64, R::Read(sges), true);
                    msgs.push(read_request(total as u32, remote.key, remote.addr));
                }
            }
            SendOp::Atomic { result, remote, op } => {
                self.need_feature(features::ATOMICS, "64-bit atomics")?;
                // Refused at post, as rxe refuses it (validate_send_wr: -EINVAL); the
                // target still checks, for peers that do not.
                if remote.addr % 8 != 0 {
                    return Err(Error::invalid(format!(
                        "atomic target {:#x} is not 8-byte aligned",
                        remote.addr
                    )));
                }
                if result.len() != 8 {
                    return Err(Error::invalid(format!(
                        "atomic result buffer must be 8 bytes, got {}",
                        result.len()
                    )));
                }
                let (sges, _) = self.gather(std::slice::from_ref(&result), Access::LOCAL_WRITE)?;
                let (b, off, _) = sges.into_iter().next().expect("one entry");
                if emulating {
                    // The request goes into the peer's request slot; the request completes
                    // when the reply is written into ours.
                    emu_fill = Some((
                        0,
                        EmuFill::Amo {
                            op: match op {
                                AtomicOp::FetchAdd { add } => AmoOp::FetchAdd { add },
                                AtomicOp::CompareSwap { compare, swap } => {
                                    AmoOp::CompareSwap { compare, swap }
                                }
                            },
                            addr: remote.addr,
                            rkey: remote.key,
                        },
                    ));
                    msgs.push(emu_placeholder());
                    (wait_write, wait_msg, byte_len, resp_kind, read_like) =
                        (0, 0, 8, R::EmuAtomic(b, off), true);
                } else {
                    let (code, add_swap, compare) = match op {
                        AtomicOp::FetchAdd { add } => (atomic_op::FETCH_ADD, add, 0),
                        AtomicOp::CompareSwap { compare, swap } => {
                            (atomic_op::COMPARE_SWAP, swap, compare)
                        }
                    };
                    msgs.push(OutMsg::control(
                        Kind::Untagged {
                            opcode: opcode::ATOMIC_REQUEST,
                            ulp: 0,
                            qn: qn::ATOMIC,
                            msn: 0,
                        },
                        AtomicRequest {
                            op: code,
                            req_id: 0,
                            stag: remote.key,
                            to: remote.addr,
                            add_swap,
                            add_swap_mask: !0,
                            compare,
                            compare_mask: !0,
                        }
                        .encode()
                        .to_vec(),
                    ));
                    (wait_write, wait_msg, byte_len, resp_kind, read_like) =
                        (0, 0, 8, R::Atomic(b, off), true);
                }
            }
        }
        // A foreign peer sends no delivery acks. Base RDMAP still orders a Read Request
        // after the Sends and Writes before it, so a zero-length Read right behind them comes
        // back only once they were placed (or after the Terminate that refused them): the
        // request completes with that response. siw answers zero-length Reads without
        // checking any STag (siw_qp_rx.c, siw_init_rresp: no SGE when the length is 0).
        // With this framework's iwarp provider (credits) the Read is not empty: the peer's
        // whole credit area into our sink, as that provider's delivery reads are (longer
        // than siw's 32-byte header-inline limit: `pdata::area::READ_LEN`). siw
        // answers a zero-length Read it serves from its IRQ (while it is transmitting) with
        // the previous WQE's stale SGE, and when that was an inline write (the peer's credit
        // updates) its key is no key: siw then fails the connection (Terminate, invalid STag).
        let (resp_kind, read_like) = match resp_kind {
            R::Acks if !acks => match self.neg.credits() {
                Some((ours, peer)) => {
                    msgs.push(read_request(
                        pdata::area::READ_LEN as u32,
                        peer.stag,
                        peer.addr + pdata::area::POSTED as u64,
                    ));
                    (R::Read(smallvec::smallvec![ours.sink()]), true)
                }
                None => {
                    msgs.push(read_request(0, 0, 0));
                    (R::Read(Sges::new()), true)
                }
            },
            other => (other, read_like),
        };

        let mut st = self.lock();
        self.check_sq_room(&st)?;
        self.send_cq.reserve()?;
        let seq = st.next_seq;
        st.next_seq += 1;
        let new_sink = |st: &State| loop {
            let s = random_u32();
            if s != 0 && !st.read_sinks.contains_key(&s) {
                break s;
            }
        };
        let resp = match resp_kind {
            R::Acks => Resp::Acks,
            R::SplitRead(a, b) => {
                let n = msgs.len();
                let mut sinks = [0u32; 2];
                for (i, sges) in [a, b].into_iter().enumerate() {
                    let sink = new_sink(&st);
                    st.read_sinks.insert(sink, sges);
                    sinks[i] = sink;
                    if let Payload::Inline(v) = &mut msgs[n - 2 + i].payload {
                        v[..4].copy_from_slice(&sink.to_be_bytes());
                    }
                }
                st.partial_sinks.insert(sinks[0]);
                Resp::Read { sink: sinks[1] }
            }
            R::Read(sges) => {
                let sink = new_sink(&st);
                st.read_sinks.insert(sink, sges);
                // The Read Request is the request's last message.
                let body = match &mut msgs.last_mut().expect("a read request").payload {
                    Payload::Inline(v) => v,
                    Payload::Memory(_) => unreachable!("read requests are inline"),
                };
                body[..4].copy_from_slice(&sink.to_be_bytes());
                Resp::Read { sink }
            }
            R::EmuAtomic(result, offset) => Resp::EmuAtomic { result, offset },
            R::Atomic(result, offset) => {
                let req_id = st.next_req_id;
                st.next_req_id = st.next_req_id.wrapping_add(1);
                if let Payload::Inline(v) = &mut msgs[0].payload {
                    v[4..8].copy_from_slice(&req_id.to_be_bytes());
                }
                Resp::Atomic {
                    req_id,
                    result,
                    offset,
                }
            }
        };
        let write_target = match msgs.first() {
            Some(OutMsg {
                kind:
                    Kind::Tagged {
                        opcode: opcode::WRITE,
                        stag,
                        to,
                    },
                payload,
                ..
            }) => Some((*stag, *to, payload.len() as u64)),
            _ => None,
        };
        msgs.last_mut().expect("at least one message").sent_seq = Some(seq);
        st.sq.push_back(Pending {
            seq,
            context: wr.context,
            opcode: wr.opcode(),
            signaled: wr.flags.contains(SendFlags::SIGNALED),
            wait_write,
            wait_msg,
            wait_resp: read_like,
            sent: false,
            byte_len,
            resp,
            error: None,
            write_target,
        });
        // What consumes a receive at the peer: Sends and Immediate Data messages.
        let sends = msgs
            .iter()
            .filter(|m| matches!(m.kind, Kind::Untagged { qn: qn::SEND, .. }))
            .count() as u64;
        // Reads beyond the first (a split read) count against the ORD too.
        let extra_reads = (msgs
            .iter()
            .filter(|m| {
                matches!(
                    m.kind,
                    Kind::Untagged {
                        opcode: opcode::READ_REQUEST,
                        ..
                    }
                )
            })
            .count() as u32)
            .saturating_sub(1);
        let gated = Gated {
            extra_reads,
            msgs,
            read_like,
            fence: wr.flags.contains(SendFlags::FENCE),
            sends,
            emu: emu_fill,
        };
        if st.backlog.is_empty() && self.may_start(&st, &gated) {
            let more = wr.flags.contains(SendFlags::MORE);
            return Ok(self.start_gated(&mut st, gated, more));
        }
        st.backlog.push_back(gated);
        Ok(false)
    }

    /// The endpoint is connected and its send queue has room for one more request.
    fn check_sq_room(&self, st: &State) -> Result<()> {
        Self::check_connected(st)?;
        if st.sq.len() >= self.sq_depth {
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!("send queue of depth {} is full", self.sq_depth),
            ));
        }
        Ok(())
    }

    /// The direct path of [`post_send`](Self::post_send), for what a ping-pong or an
    /// eager protocol posts most: a small Send without immediate data, not held back
    /// (`SendFlags::MORE`), to a peer that acknowledges deliveries, while nothing waits
    /// to go before it (no request held back, nothing corked or queued for the socket).
    /// Its payload is copied from the gather list straight into the encoding buffer,
    /// behind the delivery acks owed to the peer, and the whole goes out in one `send`.
    /// What the general path does for the same request, minus building its messages:
    /// the same checks, the same sequence and MSNs, the same completion. Returns `None`
    /// when the request does not qualify; the general path then takes it from the start.
    fn send_direct(&self, wr: &SendWr<'_>) -> Option<Result<bool>> {
        let SendOp::Send { sgl, imm: None } = wr.op else {
            return None;
        };
        if wr.flags.contains(SendFlags::MORE)
            || !self.neg.has(features::ACKS)
            || self.neg.credits().is_some()
        {
            return None;
        }
        let (sges, total) = match self.gather(sgl, Access::empty()) {
            Ok(g) => g,
            Err(e) => return Some(Err(e)),
        };
        if total > DIRECT_LIMIT.min(self.max_seg)
            || (wr.flags.contains(SendFlags::INLINE) && total > self.limits.max_inline)
        {
            return None;
        }
        let mut st = self.lock();
        if let Err(e) = self.check_sq_room(&st) {
            return Some(Err(e));
        }
        if !st.backlog.is_empty()
            || !st.corked.is_empty()
            || !self.heard.load(AtomicOrdering::SeqCst)
            || (wr.flags.contains(SendFlags::FENCE) && st.reads_out > 0)
        {
            return None;
        }
        let mut tx = self.tx.lock().expect("tx poisoned");
        if tx.closed || !tx.is_idle() {
            return None;
        }
        if let Err(e) = self.send_cq.reserve() {
            return Some(Err(e));
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        st.sends_out += 1;
        let mut bytes = std::mem::take(&mut st.spare_bytes);
        bytes.clear();
        if st.acks_owed != [0; 2] {
            st.hold_ok = true; // this message carries them
            st.held_due = 0;
            Self::take_acks(&mut st, |st, ulp| {
                let h = Self::header_of(st, ack_kind(ulp));
                encode_fpdu(&mut bytes, &h, 0, self.neg.crc, |_| {});
            });
        }
        let acks_end = bytes.len();
        let h = Self::header_of(&mut st, send_kind());
        encode_fpdu(&mut bytes, &h, total, self.neg.crc, |b| copy_sges(&sges, b));
        let n = self.send_now(&bytes);
        let ends = [(acks_end, None, false), (bytes.len(), Some(seq), false)];
        queue_unsent(&mut tx, &bytes, n, &ends);
        drop(tx);
        st.sq.push_back(Pending {
            seq,
            context: wr.context,
            opcode: Opcode::Send,
            signaled: wr.flags.contains(SendFlags::SIGNALED),
            wait_write: 0,
            wait_msg: 1,
            wait_resp: false,
            sent: n == bytes.len(),
            byte_len: total as u64,
            resp: Resp::Acks,
            error: None,
            write_target: None,
        });
        Self::keep_spare(&mut st, bytes);
        Some(Ok(false))
    }

    fn may_start(&self, st: &State, g: &Gated) -> bool {
        // One emulated atomic at a time: the peer's request slot holds one.
        let amo = matches!(g.emu, Some((_, EmuFill::Amo { .. })));
        self.heard.load(AtomicOrdering::SeqCst)
            && !(amo && st.amo_wait.is_some())
            && !(g.fence && st.reads_out > 0
                || g.read_like && st.reads_out + g.extra_reads >= self.neg.ord)
            && self
                .neg
                .credits()
                .is_none_or(|(ours, _)| credit_allows(st.sends_out, g.sends, ours.peer_posted()))
    }

    /// Starts a request's messages; with `more` (`SendFlags::MORE`) small ones are held
    /// back to leave with what follows (`State::corked`). Returns whether they were.
    fn start_gated(&self, st: &mut State, mut g: Gated, more: bool) -> bool {
        if g.read_like {
            st.reads_out += 1 + g.extra_reads;
        }
        if let Some((i, fill)) = g.emu {
            self.fill_emu(st, &mut g.msgs, i, fill);
        }
        st.sends_out += g.sends;
        if st.acks_owed != [0; 2] {
            st.hold_ok = true; // this message carries them (below, or with the cork)
        }
        let len: usize = g.msgs.iter().map(|m| m.payload.len()).sum();
        if more && st.corked_bytes + len <= DIRECT_LIMIT {
            st.corked_bytes += len;
            st.corked.extend(g.msgs);
            return true;
        }
        for m in g.msgs {
            self.transmit(st, m);
        }
        false
    }

    /// Fills in the write into the peer's emulation area at `msgs[at]`: an immediate-data
    /// record goes into the ring slot of the ordinal of the next Send among `msgs` (the
    /// sends that left before it: they reach the peer in this order), an atomic request
    /// into the request slot with the next sequence number.
    fn fill_emu(&self, st: &mut State, msgs: &mut [OutMsg], at: usize, fill: EmuFill) {
        let Some((_, peer)) = self.neg.emu() else {
            return; // not posted without the emulation
        };
        let (off, bytes) = match fill {
            EmuFill::Imm(rec) => {
                let before = msgs[..at]
                    .iter()
                    .filter(|m| matches!(m.kind, Kind::Untagged { qn: qn::SEND, .. }))
                    .count() as u64;
                let ordinal = st.sends_out + before;
                let slot = (ordinal % u64::from(peer.imm_slots.max(1))) as usize;
                (
                    emu_wire::IMM_OFF + emu_wire::IMM_SLOT * slot,
                    rec.encode(ordinal),
                )
            }
            EmuFill::Amo { op, addr, rkey } => {
                st.amo_sent += 1;
                st.amo_wait = Some(st.amo_sent);
                let req = AmoReq {
                    seq: st.amo_sent,
                    op,
                    addr,
                    rkey,
                };
                (emu_wire::REQ_OFF, req.encode())
            }
        };
        let m = &mut msgs[at];
        m.kind = Kind::Tagged {
            opcode: opcode::WRITE,
            stag: peer.stag,
            to: peer.addr.wrapping_add(off as u64),
        };
        m.payload = Payload::Inline(bytes);
    }

    fn release_backlog(&self, st: &mut State) {
        while let Some(g) = st.backlog.front() {
            if !self.may_start(st, g) {
                break;
            }
            let g = st.backlog.pop_front().expect("front exists");
            self.start_gated(st, g, false);
        }
    }

    /// Posts a receive; returns whether the delivery ack of a message it took from the
    /// unexpected queue was deferred (the caller then notes the connection with
    /// [`Self::defer_output`]).
    pub fn post_recv(&self, wr: &RecvWr<'_>) -> Result<bool> {
        let (sges, total) = self.gather(wr.sgl, Access::LOCAL_WRITE)?;
        let mut st = self.lock();
        Self::check_connected(&st)?;
        if st.rq.len() >= self.rq_depth {
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!("receive queue of depth {} is full", self.rq_depth),
            ));
        }
        self.recv_cq.reserve()?;
        let recv = PostedRecv {
            context: wr.context,
            sges,
            total,
        };
        let mut deferred = false;
        if let Some(arrived) = st.unexpected.pop_front() {
            st.unexpected_bytes -= arrived.cost();
            if st.batching {
                // A receive pass is under way on another thread: its end acks this too.
                self.deliver_buffered(&mut st, recv, arrived);
            } else {
                // The application placed it with this call and sees the completion at its
                // next poll: the ack is deferred as if its own poll had placed it (it rides
                // on the next message, or leaves at that poll: see `progress_app`).
                st.batching = true;
                self.deliver_buffered(&mut st, recv, arrived);
                deferred = self.flush_acks(&mut st, true);
            }
        } else {
            st.rq.push_back(recv);
        }
        if self.neg.credits().is_some() {
            st.recvs_posted += 1;
            self.update_posted(&mut st);
        }
        drop(st);
        // The receive machine may be waiting for a receive or for room (back-pressure).
        if self.rx_blocked.load(AtomicOrdering::SeqCst) {
            self.progress();
        }
        Ok(deferred)
    }

    /// Delivers a message that arrived before its receive was posted.
    fn deliver_buffered(&self, st: &mut State, recv: PostedRecv, arrived: Arrived) {
        match arrived {
            Arrived::Send { data, imm } => {
                if data.len() > recv.total {
                    self.message_too_long(st, recv, data.len());
                    return;
                }
                scatter(&recv.sges, 0, &data);
                self.complete_recv(st, recv.context, Opcode::Recv, data.len() as u64, imm);
            }
            Arrived::WriteImm { imm, len } => {
                self.complete_recv(st, recv.context, Opcode::RecvWriteWithImm, len, Some(imm))
            }
        }
    }

    fn complete_recv(
        &self,
        st: &mut State,
        context: u64,
        opcode: Opcode,
        byte_len: u64,
        imm: Option<u32>,
    ) {
        let c = Completion {
            context,
            opcode,
            status: Status::Success,
            provider_code: None,
            byte_len,
            imm,
            ep_context: self.ep_context,
        };
        // Counted into the batch: at its end the ack leaves before the application can see
        // the receive, unless the application's own pass placed it (then it rides on the
        // application's next message: see `progress_app`).
        if self.neg.has(features::ACKS) {
            self.send_ack(st, ddp::ACK_MESSAGES | 1);
        }
        self.push_recv(st, c);
    }

    /// Delivers a receive completion, in order: held back while a receive batch is under
    /// way (its acks go out first, see [`Self::flush_acks`]).
    fn push_recv(&self, st: &mut State, c: Completion) {
        let c = c.on_endpoint(self.ep_context);
        if st.batching {
            st.received.push(c);
        } else {
            self.recv_cq.push(c);
        }
    }

    /// A message longer than its receive: the receive completes LocalLength, the sender is
    /// told (Terminate, DDP "message too long", RemoteInvalidRequest there), both ends fail.
    fn message_too_long(&self, st: &mut State, recv: PostedRecv, len: usize) {
        tracing::debug!(
            len,
            room = recv.total,
            "message longer than the matched receive"
        );
        self.push_recv(
            st,
            Completion {
                context: recv.context,
                opcode: Opcode::Recv,
                status: Status::Error(ErrorKind::LocalLength),
                provider_code: Some(term::MSG_TOO_LONG.code()),
                byte_len: len as u64,
                imm: None,
                ep_context: self.ep_context,
            },
        );
        self.send_terminate(st, term::MSG_TOO_LONG);
        let why = format!(
            "a message of {len} bytes arrived for a receive of {} bytes",
            recv.total
        );
        self.enter_error(
            st,
            None,
            EndpointEvent::Failed(Error::new(ErrorKind::LocalLength, why)),
        );
    }

    // ----- transmit ------------------------------------------------------------------

    /// Hands the message to the socket, or queues it behind others; what is held back
    /// (acks deferred by the application's last pass, requests posted with
    /// `SendFlags::MORE`) goes first, in the same `send` when all of it is small.
    fn transmit(&self, st: &mut State, m: OutMsg) {
        let mut held = Self::take_held(st);
        if held.is_empty() {
            return self.transmit_one(st, m);
        }
        held.push(m);
        self.transmit_all(st, held);
    }

    /// Transmits `msgs` in order: encoded into one buffer and handed to the socket with
    /// one `send` when they are small and nothing is queued, else one by one.
    fn transmit_all(&self, st: &mut State, mut msgs: Vec<OutMsg>) {
        let small = msgs.iter().map(|m| m.payload.len()).sum::<usize>() <= DIRECT_LIMIT;
        let idle = {
            let tx = self.tx.lock().expect("tx poisoned");
            tx.is_idle() && !tx.closed
        };
        if !small || !idle || msgs.len() == 1 {
            for m in msgs.drain(..) {
                self.transmit_one(st, m);
            }
            st.spare_msgs = msgs;
            return;
        }
        let mut bytes = std::mem::take(&mut st.spare_bytes);
        bytes.clear();
        // Where each message ends in `bytes`, and what its last byte leaving means.
        let mut ends = std::mem::take(&mut st.spare_ends);
        ends.clear();
        for mut m in msgs.drain(..) {
            Self::number(st, &mut m);
            m.encode_into(&mut bytes, self.max_seg, self.neg.crc);
            ends.push((bytes.len(), m.sent_seq, m.inbound));
        }
        st.spare_msgs = msgs;
        let n = self.send_now(&bytes);
        queue_unsent(&mut self.tx.lock().expect("tx poisoned"), &bytes, n, &ends);
        for &(end, seq, _) in &ends {
            if let (true, Some(seq)) = (end <= n, seq) {
                self.mark_sent(st, seq);
            }
        }
        Self::keep_spare(st, bytes);
        st.spare_ends = ends;
    }

    /// Keeps an encoding buffer for the next direct transmit, unless a large message grew
    /// it (an idle connection keeps at most `SPARE_KEEP` bytes).
    fn keep_spare(st: &mut State, bytes: Vec<u8>) {
        if bytes.capacity() <= SPARE_KEEP {
            st.spare_bytes = bytes;
        }
    }

    /// One non-blocking `send` of `bytes`; how many the socket took (none on an error:
    /// the receive side sees the broken stream and fails the endpoint).
    fn send_now(&self, bytes: &[u8]) -> usize {
        fabric_api::sync::stream_sending(std::os::fd::AsFd::as_fd(&self.sock));
        match socket2::SockRef::from(&self.sock)
            .send_with_flags(bytes, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        {
            Ok(n) => n,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                0
            }
            Err(e) => {
                tracing::debug!(peer = %self.peer, "send failed: {e}");
                0
            }
        }
    }

    /// Assigns an untagged message its MSN.
    fn number(st: &mut State, m: &mut OutMsg) {
        Self::number_kind(st, &mut m.kind);
    }

    /// [`number`](Self::number) for a message's header fields alone.
    fn number_kind(st: &mut State, kind: &mut Kind) {
        if let Kind::Untagged { qn, msn, .. } = kind {
            *msn = st.msn[*qn as usize];
            st.msn[*qn as usize] = msn.wrapping_add(1);
        }
    }

    /// The header of a message of one FPDU of `kind`, numbered ([`Self::number`]).
    fn header_of(st: &mut State, mut kind: Kind) -> ddp::Header {
        Self::number_kind(st, &mut kind);
        kind.header(0, true)
    }

    /// Assigns the MSN and hands the message to the socket, or queues it behind others.
    fn transmit_one(&self, st: &mut State, mut m: OutMsg) {
        Self::number(st, &mut m);
        let mut tx = self.tx.lock().expect("tx poisoned");
        if tx.closed {
            return;
        }
        if tx.is_idle() && m.payload.len() <= DIRECT_LIMIT {
            let mut bytes = std::mem::take(&mut st.spare_bytes);
            bytes.clear();
            m.encode_into(&mut bytes, self.max_seg, self.neg.crc);
            let n = self.send_now(&bytes);
            if n == bytes.len() {
                drop(tx);
                Self::keep_spare(st, bytes);
                if let Some(seq) = m.sent_seq {
                    self.mark_sent(st, seq);
                }
                return;
            }
            queue_unsent(&mut tx, &bytes, n, &[(bytes.len(), m.sent_seq, m.inbound)]);
            Self::keep_spare(st, bytes);
            return;
        }
        tx.inbound += u32::from(m.inbound);
        let inbound = m.inbound;
        tx.queue.push_back(Queued::Msg(m));
        // Behind others: whoever flushes them goes on with it. A response is queued by the
        // receive machine, which flushes once it has handled what arrived: streaming it
        // here would hold the machine while the peer drains it, and the peer's next
        // requests would be read only as fast as responses leave (so a flood beyond the
        // IRD would be answered, not refused).
        if tx.queue.len() > 1 || inbound {
            return;
        }
        // Alone in the queue (a large message): start it now, without blocking.
        let done = tx.flush(&self.sock, self.max_seg, self.neg.crc);
        drop(tx);
        if let Some(e) = &done.error {
            tracing::debug!(peer = %self.peer, "transmit failed: {e}");
            self.shutdown();
        }
        for seq in done.sent {
            self.mark_sent(st, seq);
        }
    }

    /// Acknowledges `ulp & ACK_COUNT` placed messages: writes, or (with [`ddp::ACK_MESSAGES`])
    /// sends and immediate data that landed in receives.
    fn send_ack(&self, st: &mut State, ulp: u32) {
        if st.batching {
            let kind = usize::from(ulp & ddp::ACK_MESSAGES != 0);
            st.acks_owed[kind] = st.acks_owed[kind].saturating_add(ulp & ddp::ACK_COUNT);
            return;
        }
        self.transmit_ack(st, ulp);
    }

    /// Ends a receive batch: sends the acks counted during it, one per kind carrying the
    /// count (the wire's ack counts; the peer credits that many operations in order), then
    /// delivers the batch's receive completions.
    /// With `defer` (the application's own pass) the acks stay owed and the completions
    /// are delivered at once: the acks ride on the next message this connection sends
    /// ([`Self::transmit`]), or leave when the application is back (see
    /// [`Self::progress_app`]). Returns whether acks stay owed.
    fn flush_acks(&self, st: &mut State, defer: bool) -> bool {
        st.batching = false;
        let deferred = defer && st.acks_owed != [0; 2] && st.status == EndpointState::Connected;
        if !deferred {
            self.transmit_held(st);
        } else {
            let hold = self.engine.ack_hold_ns;
            let owed = st.acks_owed[0].saturating_add(st.acks_owed[1]);
            if hold == 0 || !st.hold_ok || owed > crate::engine::ACK_HOLD_MAX {
                st.held_due = 1;
            } else if st.held_due == 0 {
                st.held_due = crate::engine::now_ns().saturating_add(hold).max(2);
            }
        }
        for c in st.received.drain(..) {
            self.recv_cq.push(c);
        }
        deferred
    }

    /// Transmits what is held back: the acks owed, one per kind carrying the count (the
    /// wire's ack counts; the peer credits that many operations in order), and the
    /// messages of requests posted with `SendFlags::MORE`, in one `send` when small.
    fn transmit_held(&self, st: &mut State) {
        let held = Self::take_held(st);
        if !held.is_empty() {
            self.transmit_all(st, held);
        }
    }

    /// The messages held back: acks owed, then corked requests (none when nothing is).
    fn take_held(st: &mut State) -> Vec<OutMsg> {
        if st.acks_owed == [0; 2] && st.corked.is_empty() {
            return Vec::new();
        }
        st.held_due = 0;
        let mut held = std::mem::take(&mut st.spare_msgs);
        held.clear();
        Self::take_acks(st, |_, ulp| held.push(ack_msg(ulp)));
        st.corked_bytes = 0;
        held.append(&mut st.corked);
        held
    }

    /// Takes the acks owed, calling `each` with the ULP field of each ack that carries
    /// them: one per kind, or more when a count exceeds what one ack carries.
    fn take_acks(st: &mut State, mut each: impl FnMut(&mut State, u32)) {
        for (kind, flag) in [(0, 0), (1, ddp::ACK_MESSAGES)] {
            let mut n = std::mem::take(&mut st.acks_owed[kind]);
            while n > 0 {
                let take = n.min(ddp::ACK_COUNT);
                each(st, flag | take);
                n -= take;
            }
        }
    }

    fn transmit_ack(&self, st: &mut State, ulp: u32) {
        self.transmit(st, ack_msg(ulp));
    }

    /// Sets the word at `offset` of the credit area of a peer on this framework's iwarp
    /// provider to 1 (an RDMA Write): the hello and close marks.
    fn mark_peer_area(&self, st: &mut State, area: pdata::AreaDesc, offset: usize) {
        self.transmit(
            st,
            OutMsg::control(
                Kind::Tagged {
                    opcode: opcode::WRITE,
                    stag: area.stag,
                    to: area.addr + offset as u64,
                },
                1u64.to_ne_bytes().to_vec(),
            ),
        );
    }

    fn send_terminate(&self, st: &mut State, t: Terminate) {
        self.transmit(
            st,
            OutMsg::control(
                Kind::Untagged {
                    opcode: opcode::TERMINATE,
                    ulp: 0,
                    qn: qn::TERMINATE,
                    msn: 0,
                },
                t.encode().to_vec(),
            ),
        );
    }

    /// Tells the peer our count of receives ever posted (an RDMA Write into its area's
    /// POSTED word), unless it knows it or an update is still queued (then the newest
    /// count follows when that one has left: see [`CREDIT_UPDATE`]).
    fn update_posted(&self, st: &mut State) {
        let Some((_, peer)) = self.neg.credits() else {
            return;
        };
        if st.update_queued
            || st.posted_told == st.recvs_posted
            || st.status != EndpointState::Connected
            || !self.heard.load(AtomicOrdering::SeqCst)
        {
            return;
        }
        st.update_queued = true;
        st.posted_told = st.recvs_posted;
        let mut m = OutMsg::control(
            Kind::Tagged {
                opcode: opcode::WRITE,
                stag: peer.stag,
                to: peer.addr + pdata::area::POSTED as u64,
            },
            st.recvs_posted.to_ne_bytes().to_vec(),
        );
        m.sent_seq = Some(CREDIT_UPDATE);
        self.transmit(st, m);
    }

    /// The receive machine is about to handle the peer's first FPDU: as the responder of a
    /// connection with credits we may send from now on (see `heard`).
    fn peer_spoke(&self) {
        self.heard.store(true, AtomicOrdering::SeqCst);
        let mut st = self.lock();
        if st.status == EndpointState::Connected {
            self.release_backlog(&mut st);
            self.update_posted(&mut st);
        }
    }

    /// After an RDMA Write was placed: the peer may have written its posted-receive count
    /// into our area, so sends held back for credits may go.
    fn credits_may_have_grown(&self) {
        if self.neg.credits().is_none() {
            return;
        }
        let mut st = self.lock();
        if st.status == EndpointState::Connected && !st.backlog.is_empty() {
            self.release_backlog(&mut st);
        }
    }

    fn mark_sent(&self, st: &mut State, seq: u64) {
        if seq == CREDIT_UPDATE {
            st.update_queued = false;
            return self.update_posted(st);
        }
        if let Some(p) = st.sq.iter_mut().find(|p| p.seq == seq) {
            p.sent = true;
        }
        self.drain_sq(st);
    }

    /// Stops output: with `flush`, what is queued (a Terminate, a close mark) still goes
    /// out as the socket takes it, and the socket shuts down after; without, at once.
    fn close_tx(&self, flush: bool) {
        let mut tx = self.tx.lock().expect("tx poisoned");
        tx.closed = true;
        if !flush {
            tx.clear();
        }
        drop(tx);
        if flush {
            self.flush_tx();
        } else {
            self.shutdown();
        }
    }

    // ----- completion and errors -------------------------------------------------------

    fn drain_sq(&self, st: &mut State) {
        while st.sq.front().is_some_and(Pending::done) {
            let p = st.sq.pop_front().expect("front exists");
            match p.error {
                None if !p.signaled => self.send_cq.unreserve(),
                None => self.send_cq.push(Completion {
                    context: p.context,
                    opcode: p.opcode,
                    status: Status::Success,
                    provider_code: None,
                    byte_len: p.byte_len,
                    imm: None,
                    ep_context: self.ep_context,
                }),
                Some((kind, code)) => self.send_cq.push(Completion {
                    context: p.context,
                    opcode: p.opcode,
                    status: Status::Error(kind),
                    provider_code: code,
                    byte_len: 0,
                    imm: None,
                    ep_context: self.ep_context,
                }),
            }
        }
    }

    /// Enters the state `event` leaves the endpoint in (error or disconnected) and
    /// reports the event: the first unfinished request gets `head`, every request after it
    /// and every receive completes Flushed. That includes requests the peer already
    /// confirmed behind an unfinished one (a write placed while the send before it waits
    /// for a receive): completions come in post order, and nothing may succeed after a
    /// flush (docs/contract.md section 6).
    fn enter_error(
        &self,
        st: &mut State,
        head: Option<(ErrorKind, Option<ProviderCode>)>,
        event: EndpointEvent,
    ) {
        if st.status != EndpointState::Connected {
            return;
        }
        st.status = event.state();
        self.events.push(event);
        // What finished at the head (a write `blame_write` marked placed, say) completes
        // first, as it is; from the first unfinished request on, everything fails.
        self.drain_sq(st);
        let mut head = head;
        for p in st.sq.iter_mut().filter(|p| p.error.is_none()) {
            p.error = Some(head.take().unwrap_or((ErrorKind::Flushed, None)));
        }
        st.backlog.clear();
        st.corked.clear();
        st.corked_bytes = 0;
        st.read_sinks.clear();
        st.partial_sinks.clear();
        self.drain_sq(st);
        let placing = st.placing.take();
        let flushed: Vec<Completion> = placing
            .into_iter()
            .chain(st.rq.drain(..))
            .map(|r| Completion::flushed(r.context, Opcode::Recv))
            .collect();
        for c in flushed {
            self.push_recv(st, c);
        }
        st.unexpected.clear();
        st.unexpected_bytes = 0;
    }

    /// A foreign peer's Terminate named the RDMA Write it refused (its STag and tagged
    /// offset): that write takes the error, and the Sends and Writes posted before it were
    /// placed (the peer processes its stream in order) even where their confirming
    /// zero-length Read never came back: siw may send its Terminate ahead of Read Responses
    /// it still owes. Reads and atomics before it stay unfinished (their responses will
    /// not come) and are flushed. Returns whether a write matched; without a match nothing
    /// changes.
    fn blame_write(
        st: &mut State,
        stag: u32,
        to: u64,
        head: (ErrorKind, Option<ProviderCode>),
    ) -> bool {
        let hit = st.sq.iter().position(|p| {
            !p.done()
                && p.write_target
                    .is_some_and(|(s, base, len)| s == stag && to >= base && to - base < len.max(1))
        });
        let Some(i) = hit else { return false };
        for p in st.sq.iter_mut().take(i).filter(|p| !p.done()) {
            if matches!(p.opcode, Opcode::Send | Opcode::Write) {
                p.sent = true;
                p.wait_write = 0;
                p.wait_msg = 0;
                p.wait_resp = false;
            }
        }
        st.sq[i].error = Some(head);
        true
    }

    /// Waits up to `timeout` until every send-queue request posted before the call has
    /// completed (see [`spi::Endpoint::drain`](fabric_api::spi::Endpoint::drain)), making
    /// progress itself: the application may not be polling, and in manual progress mode
    /// nobody else would.
    pub fn drain(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        // Requests are numbered in post order: those below `upto` were posted before.
        let upto = self.lock().next_seq;
        loop {
            let left = {
                let st = self.lock();
                st.sq.iter().take_while(|p| p.seq < upto).count()
            };
            if left == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::TimedOut,
                    format!("{left} send-queue requests still outstanding after {timeout:?}"),
                ));
            }
            self.progress();
            self.flush_tx();
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Local graceful close. Against this framework's iwarp provider the close mark goes
    /// into the peer's credit area first: iWARP gives the peer the same signal for a close
    /// and a failure, and the mark is how it tells them apart.
    pub fn close(&self) {
        // What already arrived is handled first, as a NIC would have: requests waiting in
        // the socket (a delivery read right behind the last send, say) are answered before
        // the close, instead of being lost with the connection.
        if self.state() == EndpointState::Connected {
            self.progress();
        }
        let mut st = self.lock();
        if st.status == EndpointState::Connected {
            self.graceful.store(true, AtomicOrdering::SeqCst);
        }
        let mark = (st.status == EndpointState::Connected)
            .then_some(self.neg.peer_area)
            .flatten();
        self.enter_error(&mut st, None, EndpointEvent::Closed);
        // Nothing more is sent but the rest of an FPDU already begun: the peer sees the
        // stream end on a boundary (a cut FPDU is an error there, not a close).
        {
            let mut tx = self.tx.lock().expect("tx poisoned");
            if !tx.closed {
                tx.cut_to_boundary();
            }
        }
        if let Some(area) = mark {
            self.mark_peer_area(&mut st, area, pdata::area::CLOSED);
        }
        drop(st);
        self.close_tx(true);
        // Bounded: a peer that stops reading must not hold up the close.
        let deadline = Instant::now() + CLOSE_MARK_WAIT;
        while !self.tx.lock().expect("tx poisoned").is_idle() {
            if Instant::now() >= deadline {
                tracing::debug!(peer = %self.peer, "last output not written within {CLOSE_MARK_WAIT:?}");
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
            self.flush_tx();
        }
        // The stream ends on an FPDU boundary; what the peer still sends is drained and
        // dropped by the receive machine (see `maybe_shutdown`) while this endpoint lives.
        self.shutdown();
    }

    /// Credits a response to the oldest request waiting for one of its kind. Each kind
    /// arrives in request order (writes are placed in order, receives are matched in order,
    /// reads and atomics are answered in order), but kinds may overtake one another: a
    /// write is placed while an earlier send waits for a receive.
    fn response_unit(&self, st: &mut State, unit: Unit) -> std::result::Result<(), RxEnd> {
        let found =
            st.sq
                .iter_mut()
                .filter(|p| p.error.is_none())
                .find(|p| match (&unit, &p.resp) {
                    (Unit::WriteAck, _) => p.wait_write > 0,
                    (Unit::MessageAck, _) => p.wait_msg > 0,
                    (Unit::ReadDone(_), Resp::Read { .. })
                    | (Unit::Atomic(_), Resp::Atomic { .. }) => p.wait_resp,
                    _ => false,
                });
        let Some(p) = found else {
            return Err(violation(
                term::INVALID_OPCODE,
                format!("{unit:?} with no request waiting for it"),
            ));
        };
        match (&unit, &p.resp) {
            (Unit::WriteAck, _) => p.wait_write -= 1,
            (Unit::MessageAck, _) => p.wait_msg -= 1,
            (Unit::ReadDone(s), Resp::Read { sink }) if s == sink => p.wait_resp = false,
            (
                Unit::Atomic(a),
                Resp::Atomic {
                    req_id,
                    result,
                    offset,
                },
            ) if *req_id == a.req_id => {
                result.write(*offset, &a.original.to_ne_bytes());
                p.wait_resp = false;
            }
            _ => {
                return Err(violation(
                    term::INVALID_OPCODE,
                    format!("{unit:?} does not answer the oldest outstanding request of its kind"),
                ))
            }
        }
        if p.is_read_like() && !p.wait_resp {
            st.reads_out -= 1;
            self.release_backlog(st);
        }
        self.drain_sq(st);
        Ok(())
    }
}

/// Queues what a `send` of the encoded messages `bytes` did not take (it took `n` bytes):
/// the rest of each message whole, in order, each with what its last byte leaving means
/// (`ends`: where each message ends in `bytes`, its send-queue sequence number, whether it
/// is a response counted against the IRD). The socket is full: its writable edge brings
/// progress back.
fn queue_unsent(tx: &mut TxQueue, bytes: &[u8], n: usize, ends: &[(usize, Option<u64>, bool)]) {
    let mut start = 0;
    for &(end, seq, inbound) in ends {
        if end > n {
            tx.inbound += u32::from(inbound);
            tx.queue.push_back(Queued::Tail(
                bytes[start.max(n)..end].to_vec(),
                seq,
                inbound,
            ));
        }
        start = end;
    }
}

/// The message that becomes a write into the peer's emulation area when its request starts
/// ([`Conn::fill_emu`]).
fn emu_placeholder() -> OutMsg {
    OutMsg::control(
        Kind::Tagged {
            opcode: opcode::WRITE,
            stag: 0,
            to: 0,
        },
        Vec::new(),
    )
}

/// A Read Request of `size` bytes at (`stag`, `to`); the sink STag is filled in at post time.
/// A zero-length Send (the fillers that meet an iwarp peer's early receives; the Send
/// that ends an emulated write with immediate data).
fn empty_send() -> OutMsg {
    OutMsg::control(
        Kind::Untagged {
            opcode: opcode::SEND,
            ulp: 0,
            qn: qn::SEND,
            msn: 0,
        },
        Vec::new(),
    )
}

/// A delivery ack carrying `ulp` (kind flag and count).
fn ack_msg(ulp: u32) -> OutMsg {
    OutMsg::control(ack_kind(ulp), Vec::new())
}

/// The header of a delivery ack carrying `ulp`, before numbering.
fn ack_kind(ulp: u32) -> Kind {
    Kind::Untagged {
        opcode: opcode::ACK,
        ulp,
        qn: qn::ACK,
        msn: 0,
    }
}

/// The header of a Send without immediate data, before numbering.
fn send_kind() -> Kind {
    Kind::Untagged {
        opcode: opcode::SEND,
        ulp: 0,
        qn: qn::SEND,
        msn: 0,
    }
}

fn read_request(size: u32, stag: u32, to: u64) -> OutMsg {
    OutMsg::control(
        Kind::Untagged {
            opcode: opcode::READ_REQUEST,
            ulp: 0,
            qn: qn::READ,
            msn: 0,
        },
        ReadRequest {
            sink_stag: 0,
            sink_to: 0,
            size,
            src_stag: stag,
            src_to: to,
        }
        .encode()
        .to_vec(),
    )
}

/// Page size of the remote memory layout whose small crossings siw garbles.
const REMOTE_PAGE: u64 = 4096;
/// Largest Read Response payload siw garbles when it crosses a page of its memory
/// ([`pdata::SIW_HDR_INLINE`]: siw takes the second piece from the first page again; the
/// iwarp provider's `small_page_crossing`).
const SMALL_PAYLOAD: usize = pdata::SIW_HDR_INLINE;

/// Whether a read of `len` bytes at remote `addr` is one siw garbles.
fn crosses_small(addr: u64, len: usize) -> bool {
    len > 0 && len <= SMALL_PAYLOAD && (addr % REMOTE_PAGE) + len as u64 > REMOTE_PAGE
}

/// Splits a gather list after `at` bytes.
fn split_sges(sges: Sges, at: usize) -> (Sges, Sges) {
    let (mut a, mut b) = (Sges::new(), Sges::new());
    let mut left = at;
    for (buf, off, len) in sges {
        if left >= len {
            left -= len;
            a.push((buf, off, len));
        } else if left == 0 {
            b.push((buf, off, len));
        } else {
            a.push((buf.clone(), off, left));
            b.push((buf, off + left, len - left));
            left = 0;
        }
    }
    (a, b)
}

/// Largest message the posting thread encodes and sends itself.
const DIRECT_LIMIT: usize = 16 << 10;

/// Largest encoding buffer a connection keeps between transmits (small messages and acks
/// then allocate nothing; see [`Conn::keep_spare`]).
const SPARE_KEEP: usize = 2 << 10;

/// How long a graceful close waits for its close mark to reach the socket.
const CLOSE_MARK_WAIT: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Copy)]
enum Unit {
    WriteAck,
    MessageAck,
    ReadDone(u32),
    Atomic(AtomicResponse),
}

fn scatter(sges: &Sges, mut at: usize, mut data: &[u8]) {
    for (b, off, len) in sges {
        if data.is_empty() {
            break;
        }
        if at >= *len {
            at -= len;
            continue;
        }
        let take = (len - at).min(data.len());
        b.write(off + at, &data[..take]);
        data = &data[take..];
        at = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_small_reads_across_a_remote_page_are_split_and_the_halves_cover_the_sink() {
        assert!(crosses_small(4096 - 8, 24));
        assert!(crosses_small(4095, 2));
        assert!(!crosses_small(4096 - 8, 8), "ends at the boundary");
        assert!(!crosses_small(4096, 32), "starts at it");
        assert!(!crosses_small(4090, 33), "larger than siw's header copy");
        assert!(!crosses_small(4090, 0));
        let a = Arc::new(Buffer::new(64));
        let b = Arc::new(Buffer::new(64));
        let sges: Sges = smallvec::smallvec![(a.clone(), 8, 10), (b.clone(), 0, 14)];
        let (x, y) = split_sges(sges.clone(), 8);
        assert_eq!(
            x.iter().map(|s| (s.1, s.2)).collect::<Vec<_>>(),
            vec![(8, 8)]
        );
        assert_eq!(
            y.iter().map(|s| (s.1, s.2)).collect::<Vec<_>>(),
            vec![(16, 2), (0, 14)]
        );
        let (x, y) = split_sges(sges, 10);
        assert_eq!((x.len(), y.len()), (1, 1));
        assert!(Arc::ptr_eq(&y[0].0, &b));
    }
}
