//! Endpoints: an RC queue pair, the ledger of what is in flight on it, and the contract's
//! rules on top of the device (error state, flushes, queue depths, iWARP credits).
//!
//! The ledger is the truth about every request: each hardware request has a record that
//! holds the regions it uses (so memory outlives it), its completion-queue reservation and,
//! for the application's requests, the context and opcode to report (verbs leaves the
//! opcode of a flushed completion undefined; ours never is). Records are kept in posting
//! order; requests the provider holds back (iWARP credits) sit unposted at the tail.

use std::collections::VecDeque;
use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

// Byte offsets in the iWARP credit area (shared with the tcp provider).
use fabric_api::pdata::{self, area as credit};
use fabric_api::spi::Endpoint;
use fabric_api::{
    Access, AtomicOp, Buffer, Completion, EndpointEvent, EndpointEvents, EndpointState, Error,
    ErrorKind, OpSet, Opcode, ProviderCode, RecvWr, RegionRef, Result, SendFlags, SendOp, SendWr,
    Slice, Status,
};

use crate::cq::{CompletionTarget, CqInner, CqState};
use crate::domain::DomainInner;
use crate::emu::{self, AmoOp, AmoReply, AmoReq, EmuWatch, ExtDesc, ImmRec};
use crate::ffi::{self, CmId, HwCq, HwOp, HwWr, Inline, Mr, Sge, Sges, Wc};
use crate::fifo::{self, Fifo};
use crate::status::{self, wc};
use crate::sync::{Patience, Rank, Ranked, RankedGuard};
use crate::{Flavor, Transport};
use smallvec::{smallvec, SmallVec};

/// Receive requests carry this bit in their `wr_id`.
const RECV_BIT: u64 = 1 << 63;
/// Early receives (see [`EarlyRing`]) carry this bit too, and their slot number.
const EARLY_BIT: u64 = 1 << 62;

/// True for the `wr_id` of an early receive.
pub(crate) fn is_early(wr_id: u64) -> bool {
    wr_id & (RECV_BIT | EARLY_BIT) == RECV_BIT | EARLY_BIT
}

/// Receives the provider posts before it accepts a connection from a foreign iWARP peer:
/// such a peer (rdma-core's `rping`, any verbs application) may send as soon as the
/// connection is up, before the application here could post a receive (it has no
/// endpoint before `accept` returns), and an iWARP Send that finds no receive is fatal
/// (DDP "no buffer" Terminate). The first [`EarlyRing::SLOTS`] messages land in these
/// buffers; the application's first receives are matched to them in order and completed
/// with a copy; later receives go to the device as usual. A message longer than a slot
/// ([`EarlyRing::SLOT_LEN`]) completes `LocalLength`. Peers of this framework need none:
/// they send only against credits.
#[derive(Debug)]
pub(crate) struct EarlyRing {
    buf: Arc<Buffer>,
    _mr: Mr,
    /// The peer is this framework's tcp provider (it wrote its hello mark): it consumes
    /// the early receives with zero-length filler sends, which are dropped, and the
    /// application's receives go to the device from the first.
    pub fillers: bool,
}

impl EarlyRing {
    /// Early receives per connection.
    pub const SLOTS: usize = 4;
    /// Bytes per early receive.
    pub const SLOT_LEN: usize = 64 << 10;

    /// Registers the ring and posts its receives on a queue pair not yet connected.
    pub fn post(dom: &DomainInner, id: &CmId) -> Result<EarlyRing> {
        let buf = Arc::new(Buffer::new(Self::SLOTS * Self::SLOT_LEN));
        let mr = dom.register_raw(&buf, ffi::access::LOCAL_WRITE)?;
        for j in 0..Self::SLOTS {
            let sge = Sge {
                addr: buf.addr() + (j * Self::SLOT_LEN) as u64,
                len: Self::SLOT_LEN as u32,
                lkey: mr.lkey(),
            };
            // SAFETY: the entry names the ring, registered LOCAL_WRITE in this domain; the
            // ring lives in the endpoint (or is dropped after the identifier when the
            // accept fails), which destroys the queue pair before it.
            #[allow(unsafe_code)]
            unsafe { id.post_recv(RECV_BIT | EARLY_BIT | j as u64, std::slice::from_ref(&sge)) }
                .map_err(|e| post_error(&e))?;
        }
        Ok(EarlyRing {
            buf,
            _mr: mr,
            fillers: false,
        })
    }
}

/// An error completion: the neutral kind and the provider's code.
type WcError = (ErrorKind, Option<ProviderCode>);

/// The application's receive matched to an early receive: context, and where to copy.
type EarlyApp = (u64, Vec<(RegionRef, usize, usize)>);

/// How long an accept waits for the hello mark of a peer whose request had no frame of
/// this framework and that sends nothing (see [`CreditArea::hello_seen`]).
pub(crate) const HELLO_WAIT: Duration = Duration::from_secs(5);

/// An early receive's state: the message that landed (length, error), and the
/// application's receive matched to it.
#[derive(Debug, Default)]
struct EarlySlot {
    done: Option<(u32, Option<WcError>)>,
    app: Option<EarlyApp>,
}

/// A word of one of our credit areas, written by the peer's device. Inlined: read on
/// every receive posted on a connection with credits.
#[inline]
fn area_word(buf: &Buffer, off: usize) -> u64 {
    let w = buf.atomic_u64(off).expect("aligned word");
    // The peer's device writes the word with a copy: read until two reads agree.
    loop {
        let a = w.load(Ordering::Acquire);
        if w.load(Ordering::Acquire) == a {
            return a;
        }
    }
}

/// The iWARP credit area: a small region the peer writes into, and the peer's own.
#[derive(Debug)]
pub(crate) struct CreditArea {
    pub buf: Arc<Buffer>,
    pub mr: Mr,
    /// The peer's area: address and key.
    pub peer: (u64, u32),
}

impl CreditArea {
    /// Allocates and registers our area (remote write and read for the peer).
    pub fn local(dom: &DomainInner) -> Result<(Arc<Buffer>, Mr)> {
        let buf = Arc::new(Buffer::new(credit::LOCAL_LEN));
        let mr = dom.register_raw(
            &buf,
            ffi::access::LOCAL_WRITE | ffi::access::REMOTE_WRITE | ffi::access::REMOTE_READ,
        )?;
        Ok((buf, mr))
    }

    #[inline]
    fn word(&self, off: usize) -> u64 {
        area_word(&self.buf, off)
    }

    /// The word the peer writes after every receive it posts: its posted-receive count,
    /// packed with its completed-receive count where the connection counts deliveries
    /// ([`pdata::CreditWord`]; see [`EpCore::peer_counts`]).
    #[inline]
    pub fn peer_word(&self) -> u64 {
        self.word(credit::POSTED)
    }

    /// True when the peer said it closes gracefully.
    pub fn peer_closed(&self) -> bool {
        self.word(credit::CLOSED) != 0
    }

    /// Our area and the peer's; with a peer not of this framework (no credit area in its
    /// private data) no credits, and our area kept only as the sink of delivery reads.
    #[allow(clippy::type_complexity)]
    pub fn pair(
        local: Option<(Arc<Buffer>, Mr)>,
        peer: Option<(u64, u32)>,
    ) -> (Option<CreditArea>, Option<(Arc<Buffer>, Mr)>) {
        match (local, peer) {
            (Some((buf, mr)), Some(peer)) => (Some(CreditArea { buf, mr, peer }), None),
            (None, _) => (None, None),
            // Said by the caller once the peer's kind is known: a frame-less initiator may
            // still be this framework's tcp provider, which announces its area later.
            (Some(local), None) => (None, Some(local)),
        }
    }

    /// After accepting a peer whose request had no frame of this framework, one look
    /// (never a wait): `Some(true)` when it wrote the hello mark into our area (`sink`),
    /// as this framework's tcp provider does first thing once it read our reply's frame,
    /// before its filler sends; `Some(false)` for a foreign iWARP stack: no area, or a
    /// message in an early receive of queue pair `qpn` without the mark (RDMAP places the
    /// mark before a later send completes, so a message without it is from a foreign
    /// peer); `None` while neither happened (the caller gives up after [`HELLO_WAIT`] of
    /// silence). Drains `recv_cq` (no endpoint lock may be held): early completions of the
    /// not yet registered queue pair are kept as orphans.
    pub fn hello_seen(
        sink: Option<&(Arc<Buffer>, Mr)>,
        recv_cq: &CqInner,
        qpn: u32,
    ) -> Option<bool> {
        let Some((buf, _)) = sink else {
            return Some(false);
        };
        if area_word(buf, credit::HELLO) != 0 {
            return Some(true);
        }
        let sent = {
            let mut cst = recv_cq.lock();
            recv_cq.drain(&mut cst);
            cst.orphans.iter().any(|w| w.qp_num == qpn)
        };
        sent.then(|| area_word(buf, credit::HELLO) != 0)
    }

    /// After [`hello_seen`](Self::hello_seen) said yes: the credit area the peer named in our area
    /// (the tcp provider as the initiator writes its descriptor at `AREA_OF_PEER` before
    /// its hello mark): our area becomes the connection's credit area. A peer that named
    /// none keeps the sink only, as before.
    #[allow(clippy::type_complexity)]
    pub fn announced(
        sink: Option<(Arc<Buffer>, Mr)>,
    ) -> (Option<CreditArea>, Option<(Arc<Buffer>, Mr)>) {
        let Some((buf, mr)) = sink else {
            return (None, None);
        };
        let addr = area_word(&buf, credit::AREA_OF_PEER);
        let stag = area_word(&buf, credit::AREA_OF_PEER + 8) as u32;
        if addr == 0 && stag == 0 {
            return (None, Some((buf, mr)));
        }
        (
            Some(CreditArea {
                buf,
                mr,
                peer: (addr, stag),
            }),
            None,
        )
    }

    /// After [`hello_seen`](Self::hello_seen) said yes: the emulation area the peer named
    /// in our area (the tcp provider as the initiator writes it at `EMU_OF_PEER` before
    /// its hello mark, see [`emu::Announcement`]), if it named a valid one.
    pub fn announced_emu(sink: Option<&(Arc<Buffer>, Mr)>) -> Option<ExtDesc> {
        let (buf, _) = sink?;
        emu::Announcement::decode(
            area_word(buf, credit::EMU_OF_PEER),
            area_word(buf, credit::EMU_OF_PEER + 8),
        )
    }

    /// Our area's descriptor for the peer (private data).
    pub fn desc(buf: &Buffer, mr: &Mr) -> pdata::AreaDesc {
        pdata::AreaDesc {
            addr: buf.addr(),
            stag: mr.rkey(),
        }
    }
}

/// The emulation of atomics and immediate data on a connection (both sides offered it):
/// our emulation area and the peer's (see [`crate::emu`]).
#[derive(Debug)]
pub(crate) struct EmuLink {
    /// Our area's registration (alive as long as the endpoint; the area itself is the
    /// watch's, [`EmuWatch::area`]).
    _mr: Mr,
    /// Immediate-data slots in our area.
    pub slots: u32,
    /// The peer's area.
    pub peer: ExtDesc,
    /// What the application's polls look at without the ledger's lock (listed in both
    /// completion queues' `CqState::looked`).
    pub watch: Arc<EmuWatch>,
}

impl EmuLink {
    /// Our area's trailer for the private data.
    pub fn desc((buf, mr, slots): &(Arc<Buffer>, Mr, u32)) -> ExtDesc {
        ExtDesc {
            flags: emu::FLAG_ATOMICS
                | emu::FLAG_IMMEDIATE
                | emu::FLAG_RECEIVED
                | emu::FLAG_LAZY_CREDITS,
            imm_slots: *slots,
            addr: buf.addr(),
            stag: mr.rkey(),
        }
    }

    /// The link when both sides offered the whole emulation and the peer runs credits
    /// (immediate data relies on them); else none, and the area is dropped.
    pub fn pair(
        local: Option<(Arc<Buffer>, Mr, u32)>,
        peer: Option<ExtDesc>,
        credits: bool,
    ) -> Option<EmuLink> {
        let (buf, mr, slots) = local?;
        let all = emu::FLAG_ATOMICS | emu::FLAG_IMMEDIATE;
        match peer {
            Some(p) if credits && p.flags & all == all => {
                tracing::debug!(
                    local = buf.addr(),
                    len = buf.len(),
                    peer = p.addr,
                    peer_stag = p.stag,
                    slots = p.imm_slots,
                    "emulation of atomics and immediate data on"
                );
                Some(EmuLink {
                    watch: Arc::new(EmuWatch::new(buf)),
                    _mr: mr,
                    slots,
                    peer: p,
                })
            }
            _ => {
                tracing::debug!("the peer offers no emulation of atomics and immediate data: neither is available on this connection");
                None
            }
        }
    }
}

/// A provider-internal record that is filled in when its group goes to the device.
#[derive(Debug, Clone)]
enum EmuRec {
    /// The write of an immediate-data record into the peer's ring.
    Imm(ImmRec),
    /// An emulated atomic (the application's request): its request write, then the wait
    /// for the reply.
    Amo(Box<AmoRec>),
}

/// An emulated atomic in flight.
#[derive(Debug, Clone)]
struct AmoRec {
    op: AmoOp,
    addr: u64,
    rkey: u32,
    /// The result buffer (8 bytes at `off`).
    result: RegionRef,
    off: usize,
    /// Sequence number, once the request went to the device.
    seq: u64,
    /// The request write completed: the record waits for the reply only.
    sent: bool,
}

/// What to report for an application request.
#[derive(Debug, Clone, Copy)]
struct UserRec {
    context: u64,
    opcode: Opcode,
    signaled: bool,
    byte_len: u64,
}

/// A failure of a request, or of an earlier piece of its group: the kind to report and the
/// provider's code.
type Failure = (ErrorKind, Option<ProviderCode>);

/// What only some send-queue records carry (a failure, an emulation record), apart from
/// the record so that the common one stays small: a record is built and moved into the
/// ledger on every post, and taken apart on every completion; at 64 bytes instead of 120
/// that is half the memory traffic (in the guest every memory access is dear:
/// docs/benchmarks-record.md, thirty-second session).
#[derive(Debug, Default)]
struct SqRare {
    /// Failed to post: complete with this error when its turn comes.
    failed: Option<Failure>,
    /// The real error of an earlier piece of this record's group (the group's last
    /// record reports it instead of its own flush).
    group_err: Option<Failure>,
    /// Filled in when posted (emulated immediate data and atomics).
    emu: Option<EmuRec>,
}

/// One hardware send-queue request.
#[derive(Debug)]
struct SqRec {
    seq: u64,
    /// Not handed to the device yet: its request waits in [`Ledger::unposted`]. (The
    /// request lives there, not here, so that a record stays small enough to move
    /// without a `memcpy` call: measured, record moves were a fifth of the roce
    /// provider's instructions per 8-byte send.)
    unposted: bool,
    /// Part of an application request's group (the group ends at the record with `user`).
    grouped: bool,
    /// The application request this record completes.
    user: Option<UserRec>,
    /// Reserved from the provider's budget (else the application's).
    internal: bool,
    /// A Send (consumes one of the peer's receives: credits).
    is_send: bool,
    /// An RDMA Read (the application's, a delivery read, a probe): what a fenced request
    /// waits for under [`Profile::soft_fence`](crate::Profile::soft_fence).
    is_read: bool,
    /// The delivery read of a send on a connection that counts deliveries: held back after
    /// the send left ([`Ledger::deferred`]) and never posted if the peer's count confirms
    /// the send first.
    deferrable: bool,
    /// Regions in use: memory stays alive until the record completes.
    _holds: Holds,
    /// A failure or an emulation record, if any ([`SqRare`]).
    rare: Option<Box<SqRare>>,
}

// The common records stay within a cache line: what every post writes and every
// completion reads (see `SqRare`).
const _: () = assert!(std::mem::size_of::<SqRec>() <= 64);
const _: () = assert!(std::mem::size_of::<RqRec>() <= 32);

impl SqRec {
    /// On the device (posted, not completed by it).
    fn posted(&self) -> bool {
        !self.unposted && self.failed().is_none() && !self.awaiting_reply()
    }

    /// An emulated atomic whose request the device sent: it waits for the peer's reply.
    fn awaiting_reply(&self) -> bool {
        matches!(self.emu(), Some(EmuRec::Amo(a)) if a.sent)
    }

    /// The rare part of a record that has an emulation record (none otherwise).
    fn rare_with(emu: Option<EmuRec>) -> Option<Box<SqRare>> {
        emu.map(|e| {
            Box::new(SqRare {
                emu: Some(e),
                ..SqRare::default()
            })
        })
    }

    /// Its failure to post, if it failed.
    fn failed(&self) -> Option<Failure> {
        self.rare.as_ref().and_then(|r| r.failed)
    }

    /// The error of an earlier piece of its group, if one failed.
    fn group_err(&self) -> Option<Failure> {
        self.rare.as_ref().and_then(|r| r.group_err)
    }

    /// Its emulation record, if any.
    fn emu(&self) -> Option<&EmuRec> {
        self.rare.as_ref().and_then(|r| r.emu.as_ref())
    }

    /// Its emulation record, if any, to fill in.
    fn emu_mut(&mut self) -> Option<&mut EmuRec> {
        self.rare.as_mut().and_then(|r| r.emu.as_mut())
    }

    /// Records that it failed to post.
    fn set_failed(&mut self, e: Failure) {
        self.rare.get_or_insert_with(Box::default).failed = Some(e);
    }

    /// Records the error of an earlier piece of its group, unless one is recorded already
    /// (the first error is the one to report).
    fn note_group_err(&mut self, e: Option<Failure>) {
        if let (None, Some(e)) = (self.group_err(), e) {
            self.rare.get_or_insert_with(Box::default).group_err = Some(e);
        }
    }
}

/// The send queue's records in posting order (a [`Fifo`]: a post's push is inlined), and
/// how many of them are reads.
///
/// A transmit-complete request on iWARP asks on every post whether a read that carries a
/// completion is outstanding ([`EpCore::completing_read_out`]); the count answers "none"
/// at once where a scan walked every record in flight (a bandwidth test's window, up to
/// the send queue's depth). Every change of the queue goes through these methods, which
/// keep the count; a record's `is_read` is set when it is made and never changed (debug
/// builds check the count against a scan at every question).
#[derive(Debug, Default)]
struct SqRecs {
    q: Fifo<SqRec>,
    /// Records in `q` whose `is_read` is set.
    reads: usize,
}

impl std::ops::Deref for SqRecs {
    type Target = Fifo<SqRec>;

    fn deref(&self) -> &Fifo<SqRec> {
        &self.q
    }
}

impl std::ops::Index<usize> for SqRecs {
    type Output = SqRec;

    fn index(&self, i: usize) -> &SqRec {
        &self.q[i]
    }
}

impl std::ops::IndexMut<usize> for SqRecs {
    fn index_mut(&mut self, i: usize) -> &mut SqRec {
        &mut self.q[i]
    }
}

impl SqRecs {
    #[inline(always)]
    fn push_back(&mut self, r: SqRec) {
        self.reads += usize::from(r.is_read);
        self.q.push_back(r);
    }

    fn insert(&mut self, at: usize, r: SqRec) {
        self.reads += usize::from(r.is_read);
        self.q.insert(at, r);
    }

    /// Counts `r` out of the queue, when it left it.
    #[inline(always)]
    fn left(&mut self, r: Option<SqRec>) -> Option<SqRec> {
        if let Some(r) = &r {
            self.reads -= usize::from(r.is_read);
        }
        r
    }

    fn pop_back(&mut self) -> Option<SqRec> {
        let r = self.q.pop_back();
        self.left(r)
    }

    #[inline(always)]
    fn pop_front(&mut self) -> Option<SqRec> {
        let r = self.q.pop_front();
        self.left(r)
    }

    fn remove(&mut self, at: usize) -> Option<SqRec> {
        let r = self.q.remove(at);
        self.left(r)
    }

    /// Takes every record out, in order.
    fn drain_all(&mut self) -> impl Iterator<Item = SqRec> + '_ {
        self.reads = 0;
        self.q.drain_all()
    }

    fn range_mut<R: std::ops::RangeBounds<usize>>(&mut self, range: R) -> fifo::IterMut<'_, SqRec> {
        self.q.range_mut(range)
    }

    fn iter_mut(&mut self) -> fifo::IterMut<'_, SqRec> {
        self.q.iter_mut()
    }

    /// Whether a read is among the records (its count; debug builds check it by a scan).
    #[inline(always)]
    fn has_reads(&self) -> bool {
        debug_assert_eq!(
            self.reads,
            self.q.iter().filter(|r| r.is_read).count(),
            "the send queue's count of reads"
        );
        self.reads != 0
    }
}

#[derive(Debug)]
struct RqRec {
    seq: u64,
    context: u64,
    _holds: Holds,
}

/// Mutable state of an endpoint.
#[derive(Debug)]
struct Ledger {
    status: EndpointState,
    torn_down: bool,
    sq: SqRecs,
    rq: Fifo<RqRec>,
    /// Unposted records at the tail of `sq`.
    pending: usize,
    /// The requests of those records, in the same order (`pending` of them).
    unposted: VecDeque<HwWr>,
    next_seq: u64,
    /// Application requests in `sq`.
    user_sq: usize,
    /// Hardware requests posted and not completed.
    hw_sq: usize,
    /// Receives ever posted (iWARP credits).
    recvs_posted: u64,
    /// Sends ever handed to the device (iWARP credits).
    sends_hw: u64,
    /// A credit update is owed to the peer.
    credit_dirty: bool,
    /// Our count of receives posted as our last credit update wrote it (the peer may
    /// send this many in all).
    advertised: u64,
    /// The RNR thread's last look at this endpoint's receives (connections that batch
    /// credit updates): the count of receives posted plus completed, and when that count
    /// was first seen. [`EpCore::retry_blocked`] reaps the receive queue when it stayed
    /// for [`DEFER`]. The helper keeps it, so that neither posting nor polling reads the
    /// clock for it.
    recv_seen: (u64, Instant),
    /// The RNR thread's last look here found only receives to announce while the
    /// application worked ([`Retry::Watching`]): it may look again only after its slower
    /// pace, so a request held back or an update owed since asks it to look soon.
    rnr_slow: bool,
    /// What we last wrote into the peer's mode word (`emu_wire::MODE_OFF`): true when it
    /// says our sends need no confirmation (connections that batch credit updates).
    told_lazy: bool,
    /// Registered with the domain's RNR thread.
    blocked: bool,
    /// Closed by us (not by the peer, not by an error).
    closed_locally: bool,
    /// The cause of the queue pair's death was reported (or needs no inference).
    attributed: bool,
    /// The last transmit-complete request ([`SendFlags::TRANSMIT_COMPLETE`]) posted
    /// without a delivery read, while no read posted after it has completed: its sequence
    /// number and opcode. While set, a refusal may have been of that request, which
    /// completed already, so a death blames no outstanding request.
    unconfirmed_tc: Option<(u64, Opcode)>,
    /// When the endpoint left `Connected`.
    dead_since: Option<Instant>,
    /// Regions of requests the provider completed itself after the device failed to
    /// flush them: kept until the queue pair is destroyed.
    graveyard: Vec<RegionRef>,
    /// Completions handled, of any kind (dead-peer detection: a sign of life).
    progress: u64,
    /// Dead-peer detection: `progress` when the helper thread last looked, and the last
    /// sign of life it knows of.
    seen: u64,
    last_life: Instant,
    /// The liveness probe in flight (its record's sequence number).
    probe: Option<u64>,
    /// The kernel could not tell when the TCP socket last heard the peer (logged once).
    tcp_blind: bool,
    /// Emulated atomics: the last request sequence number we sent, the one whose reply we
    /// wait for, and the last request of the peer we served.
    amo_sent: u64,
    amo_wait: Option<u64>,
    amo_served: u64,
    /// Receives completed (the ordinal of the next send to arrive: emulated immediates;
    /// and what our credit updates tell a peer that counts deliveries).
    recvs_done: u64,
    /// The delivery read held back behind a send that left (connections that count
    /// deliveries): it is the first unposted record while this is set.
    deferred: Option<Deferred>,
    /// Listed with the send queue's completion queue for [`EpCore::settle`].
    watched: bool,
    /// A refused emulated atomic: disconnect once this reply record completed.
    kill_after: Option<u64>,
    /// Early receives (foreign peers) and how many application receives were matched to
    /// them.
    early: Vec<EarlySlot>,
    early_matched: usize,
    /// When `state()` last asked the device for the queue pair's state (at most once per
    /// [`QP_STATE_EVERY`]: `ibv_query_qp` is a system call).
    qp_checked: Option<Instant>,
    /// The device said the queue pair is in the error state ([`EpCore::qp_failed`]).
    qp_err: bool,
    /// The device has refused the first held-back request since this time, with this
    /// error (a full queue, `ENOMEM`, not counted: that passes). Past
    /// [`EpCore::FLUSH_GRACE`] on a connected endpoint, the request fails and the endpoint
    /// with it ([`EpCore::fail_refused`]).
    refused: Option<(Instant, Error)>,
}

/// Whether a batched credit update is due (connections that batch them, while the peer's
/// sends need no confirmation): we have posted receives the peer was not told of, and what
/// it may still send (`advertised`, our last update's count of receives posted, less the
/// `done` it filled) is at most half of what we hold posted and unfilled. Looked at when a
/// receive is posted and when one completes: once the peer has filled all it was told of,
/// an update is due at once. (A receiver that does neither for [`DEFER`] has the RNR
/// thread reap its receive queue, which looks at the fills: [`EpCore::retry_blocked`].)
/// With one receive posted at a time that is every receive, as without batching; with a
/// window of `w`, one update per `w / 2` receives.
fn credit_due(advertised: u64, posted: u64, done: u64) -> bool {
    posted > advertised && advertised.saturating_sub(done) * 2 <= posted.saturating_sub(done)
}

/// What the RNR thread's look at a blocked endpoint found ([`EpCore::retry_blocked`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Nothing left to do: out of the blocked list.
    Done,
    /// Still blocked: look again soon.
    Again,
    /// Nothing is left but receives not announced (or none yet), and the application
    /// posted or filled some since the previous look: it is at work, and its own posts and
    /// polls write the updates that come due. The thread may look again at its slower
    /// pace (`cm::WATCH_MAX`).
    Watching,
    /// Not looked at: the application held the endpoint's lock ([`Patience::Skip`]). The
    /// next pass looks, waiting for the lock.
    Skipped,
}

impl Retry {
    /// What a look at a blocked endpoint found: `still`, work left for the thread (held
    /// requests, an owed update, receives not announced); `slow`, the application posted
    /// or filled receives since the previous look and nothing is held back or owed.
    ///
    /// An endpoint whose application works stays, at the slower pace, even with every
    /// receive announced: its next repost has one to announce again. A look that landed
    /// just after a credit update (one receive in 32) used to let it leave, and the next
    /// repost joined it again at the quickest pace, doubling from 100 usec: beside an
    /// 8-byte ping-pong in the soft-RDMA guest the thread ran about 75 passes a second
    /// instead of about 40, each taking a vCPU from a spinning application
    /// (docs/benchmarks-record.md, fifty-sixth session). A look that finds nothing posted
    /// or filled since the previous one, and nothing left, lets it leave.
    fn after_look(still: bool, slow: bool) -> Retry {
        if slow {
            Retry::Watching
        } else if still {
            Retry::Again
        } else {
            Retry::Done
        }
    }
}

/// A send's delivery read held back (see [`EpCore::resolve_deferred`]).
#[derive(Debug, Clone, Copy)]
struct Deferred {
    /// The send's ordinal: the peer's completed-receive count that confirms it.
    ordinal: u64,
    /// When the send left.
    since: Instant,
    /// Post the read at the next look ([`EpCore::drain`] wants everything confirmed).
    forced: bool,
    /// Released: the read goes to the device at the next post (it no longer waits for the
    /// count). Kept until it reached the device, so that a connection that dies before
    /// then still reports the send as the request the peer most likely refused.
    released: bool,
}

/// How long a send's delivery read waits for the peer's count before it is posted, when
/// nothing else is posted behind the send (anything posted behind it posts the read at
/// once). A peer that reposts its receives as it completes them, as every request/reply
/// protocol does, confirms well within it; one that does not costs its sender this much
/// on the send's completion, plus the helper thread's retry period.
const DEFER: Duration = Duration::from_millis(1);

/// How often `state()` may query the queue pair's state: its death is otherwise learned
/// from completions and connection events; the query only catches a queue pair that went to
/// the error state silently.
const QP_STATE_EVERY: Duration = Duration::from_millis(1);

/// The shared core of an endpoint.
pub(crate) struct EpCore {
    pub id: CmId,
    pub qpn: u32,
    pub dom: Arc<DomainInner>,
    pub send_cq: Arc<CqInner>,
    pub recv_cq: Arc<CqInner>,
    pub sq_depth: usize,
    pub rq_depth: usize,
    pub hw_sq_cap: usize,
    /// The most gather/scatter entries, and the largest inline payload, of the
    /// application's requests: the endpoint's configuration or the domain's limits. The
    /// queue pair may take more (on iWARP its own requests need the device's inline).
    pub max_sge: u32,
    pub max_inline: u32,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub peer_private: Vec<u8>,
    pub credit: Option<CreditArea>,
    /// A peer not of this framework (no credit area): our own area, the sink of the
    /// zero-length delivery reads.
    sink: Option<(Arc<Buffer>, Mr)>,
    /// Emulated atomics and immediate data, when both sides offered them.
    emu: Option<EmuLink>,
    /// Both sides count deliveries (`emu_wire::FLAG_RECEIVED`): credit updates carry the
    /// completed-receive count, and a send's delivery read is held back in the hope that
    /// the count confirms the send first ([`EpCore::resolve_deferred`]).
    counted: bool,
    /// Both sides batch credit updates (`emu_wire::FLAG_LAZY_CREDITS`; connections that
    /// count deliveries): while the peer's mode word says its sends need no confirmation,
    /// our updates go only as [`credit_due`] says, and we keep the peer's mode word
    /// telling it what ours need ([`EpCore::tell_mode`]).
    lazy: bool,
    /// This endpoint, for lists that must not keep it alive.
    me: std::sync::Weak<EpCore>,
    /// The peer is not of this framework at all (its private data has no frame): a
    /// foreign iWARP stack gets no zero-length RDMA Reads (no delivery reads, no liveness
    /// probes), because siw answers them with the length of an earlier response (Linux 6.1
    /// `siw_init_rresp` leaves the transmit work's byte count of the previous operation;
    /// seen as `siw: rresp len: 64 != 0` and a Terminate), which kills the connection.
    foreign: bool,
    /// Receives posted before the accept (a foreign peer may send at once).
    early: Option<EarlyRing>,
    /// The application's value for this endpoint
    /// ([`EndpointConfig::ep_context`](fabric_api::spi::EndpointConfig::ep_context)),
    /// carried by every completion of it, the provider's own included.
    pub ep_context: u64,
    /// Requests may take [`post_direct`](Self::post_direct): nothing about this
    /// connection (emulation, credits, delivery reads, the page-crossing workaround)
    /// makes a request more than the one hardware request the application asked for.
    direct: bool,
    /// Connection events: one per change of the ledger's `status` (pushed by
    /// [`EpCore::leave`], the one place that changes it). A leaf lock: pushed under the
    /// ledger's lock.
    events: EndpointEvents,
    /// The ledger. Ranks after completion-queue locks (see [`crate::sync`]): code holding
    /// it never takes a completion queue's lock.
    st: Ranked<Ledger>,
}

impl fmt::Debug for EpCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EpCore")
            .field("qpn", &self.qpn)
            .field("local", &self.local)
            .field("peer", &self.peer)
            .finish()
    }
}

fn invalid_state(s: EndpointState) -> Error {
    match s {
        EndpointState::Error => {
            Error::new(ErrorKind::InvalidState, "endpoint is in the error state")
        }
        _ => Error::new(ErrorKind::InvalidState, "endpoint is disconnected"),
    }
}

fn post_error(e: &std::io::Error) -> Error {
    let code = ProviderCode::Errno(e.raw_os_error().unwrap_or(0));
    let kind = match e.raw_os_error() {
        Some(libc::ENOMEM) => ErrorKind::QueueFull,
        Some(libc::EINVAL) => ErrorKind::InvalidArgument,
        _ => ErrorKind::InvalidState,
    };
    Error::new(kind, format!("the device refused the request: {e}")).with_code(code)
}

/// A planned application request: its hardware requests and what to report.
struct Plan {
    wrs: Planned,
    /// The last request is a send's delivery read that may be held back (`counted`).
    deferrable: bool,
    /// A transmit-complete send or write ([`SendFlags::TRANSMIT_COMPLETE`]) whose last
    /// request is its delivery read: [`EpCore::post_send`] drops the read unless a read
    /// that carries an earlier request's completion is outstanding (the device would
    /// complete this request first: completions stay in post order).
    /// Its first request is not yet fenced behind earlier reads: `post_send` fences it
    /// when it keeps the read.
    transmit: bool,
    user: UserRec,
    holds: Holds,
}

/// The regions a request uses, kept alive until it completes: the first in place, any
/// more (a gather list over several regions) in a boxed vector. A request usually holds
/// one region, and then taking and dropping its hold is a counted reference and a test
/// (callgrind, roce fetch_add: 16 instructions per request fewer than a `SmallVec` of
/// two, whose every access checks whether it spilled); boxed, the rest is one word of the
/// record (16 bytes in all, not 32).
#[derive(Debug, Default)]
struct Holds {
    first: Option<RegionRef>,
    #[allow(
        clippy::box_collection,
        reason = "one word in the record, not three: the vector is rare"
    )]
    more: Option<Box<Vec<RegionRef>>>,
}

impl Holds {
    /// No region.
    const fn new() -> Holds {
        Holds {
            first: None,
            more: None,
        }
    }

    /// Holds `r` too. Inlined (every post and receive holds its region here), a second
    /// region apart.
    #[inline(always)]
    fn push(&mut self, r: RegionRef) {
        if self.first.is_none() {
            self.first = Some(r);
        } else {
            self.push_more(r);
        }
    }

    #[cold]
    #[inline(never)]
    fn push_more(&mut self, r: RegionRef) {
        self.more.get_or_insert_with(Box::default).push(r);
    }

    /// The regions held, in the order they were pushed.
    fn iter(&self) -> impl Iterator<Item = &RegionRef> {
        self.first
            .iter()
            .chain(self.more.iter().flat_map(|m| m.iter()))
    }

    /// Holds what `other` held too.
    fn extend(&mut self, other: Holds) {
        for r in other {
            self.push(r);
        }
    }
}

impl IntoIterator for Holds {
    type Item = RegionRef;
    type IntoIter = std::iter::Chain<
        std::option::IntoIter<RegionRef>,
        std::iter::Flatten<std::option::IntoIter<Vec<RegionRef>>>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.first
            .into_iter()
            .chain(self.more.map(|m| *m).into_iter().flatten())
    }
}

/// Hardware requests planned for one application request, each with its emulation
/// record: a send or write with an emulation record and a delivery read fits in place.
type Planned = SmallVec<[(HwWr, Option<EmuRec>); 3]>;

/// Page size of the registered-memory layout that
/// [`Profile::small_page_crossing`](crate::Profile::small_page_crossing) is about.
const PAGE: u64 = 4096;
/// Largest payload siw copies into its packet header directly, the copy that garbles a
/// page crossing ([`pdata::SIW_HDR_INLINE`]).
const SMALL_PAYLOAD: u32 = pdata::SIW_HDR_INLINE as u32;

/// Whether siw gets a send or write of `total` bytes inline: a payload siw would copy into
/// its packet header from registered memory (at most [`SMALL_PAYLOAD`] bytes), when the
/// device takes that much inline. siw makes that copy with `copy_from_user` while the queue
/// pair's `in_syscall` flag is set, and the flag outlives the poster's `ibv_post_send` for a
/// moment: the copy fails when siw's transmit thread makes it then (`EFAULT`, the connection
/// dropped; `pdata::area::READ_LEN`). An inline payload is copied from the request itself.
#[inline]
fn inlines_on_siw(total: u64, max_inline: u32) -> bool {
    total > 0 && total <= u64::from(SMALL_PAYLOAD.min(max_inline))
}

/// Whether `len` bytes at `addr` are a small payload ([`SMALL_PAYLOAD`]) that crosses a
/// page boundary.
fn crosses_small(addr: u64, len: u64) -> bool {
    len > 0 && len <= u64::from(SMALL_PAYLOAD) && (addr % PAGE) + len > PAGE
}

/// Works around a device that garbles a payload of at most [`SMALL_PAYLOAD`] bytes
/// from registered memory when it crosses a page boundary
/// ([`Profile::small_page_crossing`](crate::Profile::small_page_crossing)): such a read
/// is split at the remote page boundary, such a write at the local one, and such a send
/// goes inline (a copy).
fn avoid_small_page_crossing(
    wrs: Planned,
    copy: impl Fn(&Sge) -> Result<Inline>,
) -> Result<Planned> {
    let crosses = |addr: u64, len: u32| crosses_small(addr, u64::from(len));
    let mut out = Planned::new();
    for (w, e) in wrs {
        let single = w.inline.is_none() && w.sges.len() == 1 && e.is_none();
        match w.op {
            HwOp::Read { addr, rkey } if single && crosses(addr, w.sges[0].len) => {
                let first = (PAGE - addr % PAGE) as u32;
                let s = w.sges[0];
                let mut a = w.clone();
                a.sges = smallvec![Sge { len: first, ..s }];
                let mut b = w;
                b.op = HwOp::Read {
                    addr: addr + u64::from(first),
                    rkey,
                };
                b.sges = smallvec![Sge {
                    addr: s.addr + u64::from(first),
                    len: s.len - first,
                    lkey: s.lkey,
                }];
                out.push((a, None));
                out.push((b, None));
            }
            HwOp::Write {
                addr,
                rkey,
                imm: None,
            } if single && crosses(w.sges[0].addr, w.sges[0].len) => {
                let s = w.sges[0];
                let first = (PAGE - s.addr % PAGE) as u32;
                let mut a = w.clone();
                a.sges = smallvec![Sge { len: first, ..s }];
                let mut b = w;
                b.fence = false;
                b.op = HwOp::Write {
                    addr: addr.wrapping_add(u64::from(first)),
                    rkey,
                    imm: None,
                };
                b.sges = smallvec![Sge {
                    addr: s.addr + u64::from(first),
                    len: s.len - first,
                    lkey: s.lkey,
                }];
                out.push((a, None));
                out.push((b, None));
            }
            HwOp::Send { .. } if single && crosses(w.sges[0].addr, w.sges[0].len) => {
                let mut w = w;
                w.inline = Some(copy(&w.sges[0])?);
                out.push((w, None));
            }
            _ => out.push((w, e)),
        }
    }
    Ok(out)
}

/// The hardware request of a native atomic on 8 bytes at `addr` under `rkey`.
fn hw_atomic(op: AtomicOp, addr: u64, rkey: u32) -> HwOp {
    match op {
        AtomicOp::FetchAdd { add } => HwOp::FetchAdd { addr, rkey, add },
        AtomicOp::CompareSwap { compare, swap } => HwOp::CompareSwap {
            addr,
            rkey,
            compare,
            swap,
        },
    }
}

/// A provider-internal inline write into the peer's emulation area: address and payload
/// are filled in when its group goes to the device (`EpCore::post_next_group`).
fn emu_write(fence: bool) -> HwWr {
    HwWr {
        wr_id: 0,
        op: HwOp::Write {
            addr: 0,
            rkey: 0,
            imm: None,
        },
        sges: Sges::new(),
        inline: Some(Inline::new()),
        fence,
    }
}

/// Construction parameters of an endpoint.
pub(crate) struct EpParts {
    pub id: CmId,
    pub dom: Arc<DomainInner>,
    pub send_cq: Arc<CqInner>,
    pub recv_cq: Arc<CqInner>,
    pub sq_depth: usize,
    pub rq_depth: usize,
    pub hw_sq_cap: usize,
    /// The application's gather/scatter and inline limits
    /// ([`EndpointConfig::request_limits`](fabric_api::spi::EndpointConfig::request_limits)).
    pub max_sge: u32,
    pub max_inline: u32,
    pub peer_private: Vec<u8>,
    pub credit: Option<CreditArea>,
    pub sink: Option<(Arc<Buffer>, Mr)>,
    pub emu: Option<EmuLink>,
    pub foreign: bool,
    pub early: Option<EarlyRing>,
    pub ep_context: u64,
}

impl EpCore {
    pub fn new(p: EpParts) -> Arc<EpCore> {
        let qpn = p.id.qp_num();
        let early_slots = if p.early.is_some() {
            EarlyRing::SLOTS
        } else {
            0
        };
        let early_matched = if p.early.as_ref().is_some_and(|e| e.fillers) {
            EarlyRing::SLOTS
        } else {
            0
        };
        let local =
            p.id.local_addr()
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let peer =
            p.id.peer_addr()
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let prof = &p.dom.profile;
        let direct = p.credit.is_none()
            && p.emu.is_none()
            && !prof.delivery_reads
            && !prof.small_page_crossing;
        let counted = prof.delivery_reads
            && p.credit.is_some()
            && p.emu
                .as_ref()
                .is_some_and(|e| e.peer.flags & emu::FLAG_RECEIVED != 0);
        let lazy = counted
            && p.emu
                .as_ref()
                .is_some_and(|e| e.peer.flags & emu::FLAG_LAZY_CREDITS != 0);
        let core = Arc::new_cyclic(|me| EpCore {
            id: p.id,
            qpn,
            dom: p.dom,
            send_cq: p.send_cq,
            recv_cq: p.recv_cq,
            sq_depth: p.sq_depth,
            rq_depth: p.rq_depth,
            hw_sq_cap: p.hw_sq_cap,
            max_sge: p.max_sge,
            max_inline: p.max_inline,
            local,
            peer,
            peer_private: p.peer_private,
            credit: p.credit,
            sink: p.sink,
            emu: p.emu,
            counted,
            lazy,
            me: me.clone(),
            foreign: p.foreign,
            early: p.early,
            ep_context: p.ep_context,
            direct,
            events: EndpointEvents::new(),
            st: Ranked::new(
                Rank::Endpoint,
                Ledger {
                    status: EndpointState::Connected,
                    torn_down: false,
                    sq: SqRecs::default(),
                    rq: Fifo::default(),
                    pending: 0,
                    unposted: VecDeque::new(),
                    next_seq: 1,
                    user_sq: 0,
                    hw_sq: 0,
                    recvs_posted: 0,
                    sends_hw: 0,
                    credit_dirty: false,
                    blocked: false,
                    closed_locally: false,
                    attributed: false,
                    unconfirmed_tc: None,
                    dead_since: None,
                    graveyard: Vec::new(),
                    progress: 0,
                    seen: 0,
                    last_life: Instant::now(),
                    probe: None,
                    tcp_blind: false,
                    amo_sent: 0,
                    amo_wait: None,
                    amo_served: 0,
                    recvs_done: 0,
                    advertised: 0,
                    recv_seen: (0, Instant::now()),
                    rnr_slow: false,
                    told_lazy: false,
                    deferred: None,
                    watched: false,
                    kill_after: None,
                    early: (0..early_slots).map(|_| EarlySlot::default()).collect(),
                    early_matched,
                    qp_checked: None,
                    qp_err: false,
                    refused: None,
                },
            ),
        });
        core.send_cq.lock().qps.insert(qpn, core.clone());
        if !Arc::ptr_eq(&core.send_cq, &core.recv_cq) {
            core.recv_cq.lock().qps.insert(qpn, core.clone());
        }
        if core.early.is_some() {
            // Early receives that completed before the endpoint was registered.
            let mut cst = core.recv_cq.lock();
            let mine: Vec<Wc> = cst
                .orphans
                .iter()
                .filter(|w| w.qp_num == qpn)
                .copied()
                .collect();
            cst.orphans.retain(|w| w.qp_num != qpn);
            for w in mine {
                core.handle_completion(&core.recv_cq, &mut cst, &w);
            }
        }
        if core.dom.dead_peer.is_some() && !core.foreign {
            core.dom.rnr.watch(Arc::downgrade(&core));
        }
        if let Some(e) = &core.emu {
            // Served by the helper, and looked at by the application's polls of either
            // queue (`EmuWatch::look`), which let the helper look less often.
            let entry = || (e.watch.clone(), Arc::downgrade(&core));
            core.send_cq.lock().looked.push(entry());
            if !Arc::ptr_eq(&core.send_cq, &core.recv_cq) {
                core.recv_cq.lock().looked.push(entry());
            }
            core.dom.rnr.serve(Arc::downgrade(&core));
        }
        if let Some(t) = core.dom.profile.min_rnr_timer {
            if let Err(e) = core.id.set_min_rnr_timer(t) {
                tracing::debug!("setting the RNR timer to {t} failed: {e}");
            }
        }
        core
    }

    #[inline]
    fn lock(&self) -> RankedGuard<'_, Ledger> {
        self.st.lock()
    }

    fn iwarp(&self) -> bool {
        self.dom.dev.transport == Transport::Iwarp
    }

    // ----- planning ---------------------------------------------------------------------

    fn sges(&self, sgl: &[Slice<'_>], need: Access) -> Result<(Sges, Holds, u64)> {
        let mut sges = Sges::new();
        let mut holds = Holds::new();
        let total = self.gather(sgl, need, &mut sges, Some(&mut holds))?;
        Ok((sges, holds, total))
    }

    /// Checks a gather/scatter list and appends its non-empty entries to `sges`, with a
    /// counted reference to each region in `holds` (memory the device uses after the call
    /// returns) or, without `holds`, none (an inline payload, which the device library
    /// copies during the call while the caller borrows it). Returns the total bytes.
    /// Inlined into every caller: on every message's path (a post's and a receive's),
    /// where a call costs as much as twenty plain instructions in the guest.
    #[inline(always)]
    fn gather(
        &self,
        sgl: &[Slice<'_>],
        need: Access,
        sges: &mut Sges,
        mut holds: Option<&mut Holds>,
    ) -> Result<u64> {
        let max = self.max_sge as usize;
        if sgl.len() > max {
            return Err(Error::invalid(format!(
                "{} gather/scatter entries exceed the endpoint's maximum of {max}",
                sgl.len()
            )));
        }
        let mut total = 0u64;
        for s in sgl {
            let (addr, lkey) = match holds.as_deref_mut() {
                Some(h) => {
                    let r = s.check_local(self.dom.id, need)?;
                    let at = (r.buffer().addr() + s.offset() as u64, r.local_key());
                    h.push(r);
                    at
                }
                None => s.check_local_now(self.dom.id, need)?,
            };
            if !s.is_empty() {
                sges.push(Sge {
                    addr,
                    len: s.len() as u32,
                    lkey,
                });
            }
            total += s.len() as u64;
        }
        if total > self.dom.limits.max_msg_size {
            return Err(Error::invalid(format!(
                "message of {total} bytes exceeds the maximum of {}",
                self.dom.limits.max_msg_size
            )));
        }
        Ok(total)
    }

    fn unsupported(&self, what: &str) -> Error {
        let why = self
            .dom
            .profile
            .unsupported
            .get(what)
            .cloned()
            .unwrap_or_else(|| "not supported by this device".into());
        Error::unsupported(format!("{what} on {}: {why}", self.dom.dev.name))
    }

    /// The connection's emulation of atomics and immediate data, or why `what` is not
    /// available on it.
    fn emulation(&self, what: &str) -> Result<&EmuLink> {
        match &self.emu {
            Some(e) => Ok(e),
            None if self.dom.emulates => Err(Error::unsupported(format!(
                "{what} on {}: emulated only between peers of this framework, and this peer did not offer the emulation (a foreign iWARP stack, or the emulation is off)",
                self.dom.dev.name
            ))),
            None => Err(self.unsupported(what)),
        }
    }

    /// Refuses an inline request whose payload exceeds the endpoint's inline limit.
    #[cold]
    fn check_inline(&self, wr: &SendWr<'_>) -> Result<()> {
        let sgl = match wr.op {
            SendOp::Send { sgl, .. } | SendOp::Write { sgl, .. } => sgl,
            // An inline read or atomic is refused where it is planned.
            SendOp::Read { .. } | SendOp::Atomic { .. } => return Ok(()),
        };
        let total: u64 = sgl.iter().map(|s| s.len() as u64).sum();
        let max = self.max_inline;
        if total > u64::from(max) {
            return Err(Error::invalid(format!(
                "inline payload of {total} bytes exceeds the endpoint's max inline {max}"
            )));
        }
        Ok(())
    }

    /// Copies an inline payload: the application's (within the endpoint's limit, checked
    /// by [`Self::check_inline`]) or one the provider inlines itself (within the queue
    /// pair's, the domain's on the devices where it does: `inlines_small`).
    fn inline_copy(&self, sges: &[Sge], holds: &Holds, total: u64) -> Result<Inline> {
        let max = self.dom.limits.max_inline;
        if total > u64::from(max) {
            return Err(Error::invalid(format!(
                "inline payload of {total} bytes exceeds max inline {max}"
            )));
        }
        let mut v = Inline::with_capacity(total as usize);
        for s in sges {
            // The region this entry lies in.
            let r = holds.iter().find(|h| {
                s.addr >= h.buffer().addr()
                    && s.addr + u64::from(s.len) <= h.buffer().addr() + h.buffer().len() as u64
            });
            let r = r.ok_or_else(|| Error::invalid("inline entry outside its region"))?;
            let start = v.len();
            v.resize(start + s.len as usize, 0);
            r.buffer()
                .read((s.addr - r.buffer().addr()) as usize, &mut v[start..]);
        }
        Ok(v)
    }

    /// Whether a send or write of `total` bytes goes inline although the application did
    /// not ask: on siw ([`Profile::small_page_crossing`](crate::Profile::small_page_crossing))
    /// every payload siw would copy into its header from registered memory.
    #[inline]
    fn inlines_small(&self, total: u64) -> bool {
        self.dom.profile.small_page_crossing && inlines_on_siw(total, self.dom.limits.max_inline)
    }

    fn delivery_read(&self) -> Option<HwWr> {
        let Some(c) = self.credit.as_ref() else {
            // A peer not of this framework: a zero-length RDMA Read (remote address 0,
            // STag 0). RDMAP orders a Read Request behind the messages before it, so its
            // response confirms their delivery; it names no memory on either side. One
            // entry of length 0 in our own area rather than none: siw takes the sink
            // STag from the first entry even when there is none. Never to a foreign
            // stack (see `foreign`).
            if self.foreign {
                return None;
            }
            let (buf, mr) = self.sink.as_ref()?;
            return Some(HwWr {
                wr_id: 0,
                op: HwOp::Read { addr: 0, rkey: 0 },
                sges: smallvec![Sge {
                    addr: buf.addr() + credit::SCRATCH as u64,
                    len: 0,
                    lkey: mr.lkey(),
                }],
                inline: None,
                fence: false,
            });
        };
        // The peer's whole area into our sink: a response longer than siw's 32-byte
        // header-inline limit, which siw can build safely from its transmit thread (see
        // `credit::READ_LEN`).
        Some(HwWr {
            wr_id: 0,
            op: HwOp::Read {
                addr: c.peer.0 + credit::POSTED as u64,
                rkey: c.peer.1,
            },
            sges: smallvec![Sge {
                addr: c.buf.addr() + credit::SINK as u64,
                len: credit::READ_LEN as u32,
                lkey: c.mr.lkey(),
            }],
            inline: None,
            fence: false,
        })
    }

    fn plan(&self, wr: &SendWr<'_>) -> Result<Plan> {
        let p = &self.dom.profile;
        let inline = wr.flags.contains(SendFlags::INLINE);
        if inline {
            self.check_inline(wr)?;
        }
        let fence = wr.flags.contains(SendFlags::FENCE);
        let hw = |op: HwOp, sges: Sges, inline: Option<Inline>| HwWr {
            wr_id: 0,
            op,
            sges,
            inline,
            fence,
        };
        let (wrs, holds, byte_len): (Planned, Holds, u64) = match wr.op {
            SendOp::Send { sgl, imm } => {
                let emulated = match imm {
                    Some(v) if !p.immediate => {
                        self.emulation("SEND_IMM")?;
                        Some(v)
                    }
                    _ => None,
                };
                let (sges, holds, total) = self.sges(sgl, Access::empty())?;
                let data = if inline || self.inlines_small(total) {
                    Some(self.inline_copy(&sges, &holds, total)?)
                } else {
                    None
                };
                let mut v = Planned::new();
                if let Some(imm) = emulated {
                    // The immediate goes into the peer's ring slot of this send first.
                    let rec = ImmRec {
                        kind: emu::IMM_SEND,
                        imm,
                        len: 0,
                    };
                    v.push((emu_write(fence), Some(EmuRec::Imm(rec))));
                }
                let imm = if emulated.is_some() { None } else { imm };
                v.push((hw(HwOp::Send { imm }, sges, data), None));
                (v, holds, total)
            }
            SendOp::Write { sgl, remote, imm } => {
                let emulated = match imm {
                    Some(v) if !p.immediate => {
                        self.emulation("WRITE_IMM")?;
                        Some(v)
                    }
                    _ => None,
                };
                let (sges, holds, total) = self.sges(sgl, Access::empty())?;
                let data = if inline || self.inlines_small(total) {
                    Some(self.inline_copy(&sges, &holds, total)?)
                } else {
                    None
                };
                let mut v: Planned = smallvec![(
                    hw(
                        HwOp::Write {
                            addr: remote.addr,
                            rkey: remote.key,
                            imm: if emulated.is_some() { None } else { imm },
                        },
                        sges,
                        data,
                    ),
                    None,
                )];
                if let Some(imm) = emulated {
                    // Then the immediate and the written length into the peer's ring, then
                    // a zero-length send that consumes one posted receive: RDMAP delivers
                    // it only after both writes were placed.
                    let rec = ImmRec {
                        kind: emu::IMM_WRITE,
                        imm,
                        len: total,
                    };
                    v.push((emu_write(false), Some(EmuRec::Imm(rec))));
                    v.push((hw(HwOp::Send { imm: None }, Sges::new(), None), None));
                }
                (v, holds, total)
            }
            SendOp::Read { sgl, remote } => {
                if inline {
                    return Err(Error::invalid("a read cannot be inline"));
                }
                let (sges, holds, total) = self.sges(sgl, Access::LOCAL_WRITE)?;
                if total == 0 && self.iwarp() {
                    // A zero-length RDMA Read names no memory and checks no key; siw
                    // mishandles it (it takes the sink STag of an entry that is not there
                    // and sometimes fails the response, IBV_WC_GENERAL_ERR). Same meaning,
                    // well-formed: a delivery read (the peer's credit area into our sink).
                    if let Some(r) = self.delivery_read() {
                        let mut r = r;
                        r.fence = fence;
                        return Ok(Plan {
                            wrs: smallvec![(r, None)],
                            deferrable: false,
                            transmit: false,
                            user: UserRec {
                                context: wr.context,
                                opcode: Opcode::Read,
                                signaled: wr.flags.contains(SendFlags::SIGNALED),
                                byte_len: 0,
                            },
                            holds,
                        });
                    }
                }
                let max_rd = self.dom.dev.max_sge_rd.max(1) as usize;
                let wrs = if p.split_reads && sges.len() > max_rd {
                    let mut off = 0u64;
                    sges.into_iter()
                        .map(|s| {
                            let w = hw(
                                HwOp::Read {
                                    addr: remote.addr.wrapping_add(off),
                                    rkey: remote.key,
                                },
                                smallvec![s],
                                None,
                            );
                            off += u64::from(s.len);
                            (w, None)
                        })
                        .collect()
                } else {
                    smallvec![(
                        hw(
                            HwOp::Read {
                                addr: remote.addr,
                                rkey: remote.key,
                            },
                            sges,
                            None,
                        ),
                        None,
                    )]
                };
                (wrs, holds, total)
            }
            SendOp::Atomic { result, remote, op } => {
                if !p.atomics {
                    self.emulation(match op {
                        AtomicOp::FetchAdd { .. } => "FETCH_ADD",
                        AtomicOp::CompareSwap { .. } => "COMPARE_SWAP",
                    })?;
                }
                if result.len() != 8 {
                    return Err(Error::invalid(format!(
                        "atomic result buffer must be 8 bytes, got {}",
                        result.len()
                    )));
                }
                if remote.addr % 8 != 0 {
                    // Verbs devices may check this at post (rxe: validate_send_wr returns
                    // -EINVAL): say so clearly rather than as an opaque device refusal.
                    return Err(Error::invalid(format!(
                        "atomic target {:#x} is not 8-byte aligned",
                        remote.addr
                    )));
                }
                if inline {
                    return Err(Error::invalid("an atomic cannot be inline"));
                }
                let (sges, holds, _) =
                    self.sges(std::slice::from_ref(&result), Access::LOCAL_WRITE)?;
                if !p.atomics {
                    // Emulated: the request goes into the peer's request slot; the record
                    // completes when the reply is back (see `poll_emu`).
                    let amo = AmoRec {
                        op: match op {
                            AtomicOp::FetchAdd { add } => AmoOp::FetchAdd { add },
                            AtomicOp::CompareSwap { compare, swap } => {
                                AmoOp::CompareSwap { compare, swap }
                            }
                        },
                        addr: remote.addr,
                        rkey: remote.key,
                        result: holds
                            .first
                            .clone()
                            .expect("the result entry's region is held"),
                        off: result.offset(),
                        seq: 0,
                        sent: false,
                    };
                    let w = (emu_write(fence), Some(EmuRec::Amo(Box::new(amo))));
                    return Ok(Plan {
                        wrs: smallvec![w],
                        deferrable: false,
                        transmit: false,
                        user: UserRec {
                            context: wr.context,
                            opcode: wr.opcode(),
                            signaled: wr.flags.contains(SendFlags::SIGNALED),
                            byte_len: 8,
                        },
                        holds,
                    });
                }
                let op = hw_atomic(op, remote.addr, remote.key);
                (smallvec![(hw(op, sges, None), None)], holds, 8)
            }
        };
        let mut wrs = if p.small_page_crossing {
            avoid_small_page_crossing(wrs, |s| {
                self.inline_copy(std::slice::from_ref(s), &holds, u64::from(s.len))
            })?
        } else {
            wrs
        };
        let mut deferrable = false;
        let mut transmit = false;
        if p.delivery_reads && matches!(wr.op, SendOp::Send { .. } | SendOp::Write { .. }) {
            if let Some(r) = self.delivery_read() {
                // Transmit complete: the read may go (decided under the ledger's lock).
                transmit = wr.flags.contains(SendFlags::TRANSMIT_COMPLETE);
                // Fenced behind every earlier read: the previous request's delivery was
                // confirmed before this one leaves, so when the peer terminates the
                // connection the first unconfirmed request is the one it refused.
                wrs[0].0.fence |= !transmit;
                wrs.push((r, None));
                // A send consumes one of the peer's receives, which the peer's count of
                // completed receives confirms; a write it never sees.
                deferrable = self.counted && matches!(wr.op, SendOp::Send { .. });
            }
        }
        Ok(Plan {
            wrs,
            deferrable,
            transmit,
            user: UserRec {
                context: wr.context,
                opcode: wr.opcode(),
                signaled: wr.flags.contains(SendFlags::SIGNALED),
                byte_len,
            },
            holds,
        })
    }

    // ----- posting ----------------------------------------------------------------------

    #[inline]
    pub fn post_send(self: &Arc<Self>, wr: &SendWr<'_>) -> Result<()> {
        match self.post_direct(wr) {
            Direct::Posted => Ok(()),
            Direct::Declined => self.post_planned(wr),
            Direct::Invalid(e) => Err(*e),
            Direct::Refused(e) => Err(post_error(&e)),
        }
    }

    /// The ledger's path of [`post_send`](Self::post_send): plans the request into
    /// hardware requests, records them and posts or holds them back. Apart from the direct
    /// path, which is inlined into the caller: this function's entry and exit (the
    /// registers a large function saves) are not paid by a request that goes direct.
    #[inline(never)]
    fn post_planned(self: &Arc<Self>, wr: &SendWr<'_>) -> Result<()> {
        let mut plan = self.plan(wr)?;
        {
            let l = self.lock();
            if l.status != EndpointState::Connected || l.torn_down {
                return Err(invalid_state(l.status));
            }
        }
        let mut internal = plan.wrs.len() - 1;
        self.send_cq.reserve(internal)?;
        let mut l = self.lock();
        // A transmit-complete request goes without its delivery read unless a read that
        // carries an earlier request's completion is outstanding.
        let unconfirmed = plan.transmit && !Self::completing_read_out(&l);
        if unconfirmed {
            plan.wrs.pop();
            plan.deferrable = false;
            self.send_cq.release_internal(1);
            internal -= 1;
        } else if plan.transmit {
            // The read stays: fenced as in `plan`.
            plan.wrs[0].0.fence = true;
        }
        let undo = |cq: &CqInner| {
            cq.release(1);
            cq.release_internal(internal);
        };
        if l.status != EndpointState::Connected || l.torn_down {
            undo(&self.send_cq);
            return Err(invalid_state(l.status));
        }
        if l.user_sq >= self.sq_depth {
            undo(&self.send_cq);
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!("send queue of depth {} is full", self.sq_depth),
            ));
        }
        if let SendOp::Send { .. } | SendOp::Write { imm: Some(_), .. } = wr.op {
            // It fills one of the peer's receives: the peer batches its credit updates
            // only while none of ours waits for its count (a delivery read held back in
            // the hope of the count; a transmit-complete send that keeps its read too).
            self.tell_mode(&mut l, !plan.deferrable);
        }
        let n = plan.wrs.len();
        let mut holds = Some(plan.holds);
        for (i, (w, emu)) in plan.wrs.into_iter().enumerate() {
            let last = i + 1 == n;
            let is_send = matches!(w.op, HwOp::Send { .. });
            let is_read = matches!(w.op, HwOp::Read { .. });
            let seq = l.next_seq;
            l.next_seq += 1;
            l.unposted.push_back(w);
            l.sq.push_back(SqRec {
                seq,
                unposted: true,
                grouped: true,
                user: last.then_some(plan.user),
                internal: !last,
                is_send,
                is_read,
                deferrable: last && plan.deferrable,
                _holds: if last {
                    holds.take().unwrap_or_default()
                } else {
                    Holds::new()
                },
                rare: SqRec::rare_with(emu),
            });
        }
        l.pending += n;
        l.user_sq += 1;
        if l.pending == n {
            // Nothing held back before it: post now, and report a refusal synchronously.
            match self.post_next_group(&mut l) {
                // Nothing reached the device: the caller learns it now and the request
                // never existed.
                Posted::Refused(e) => {
                    for _ in 0..n {
                        l.sq.pop_back();
                        l.unposted.pop_back();
                    }
                    l.pending -= n;
                    l.user_sq -= 1;
                    undo(&self.send_cq);
                    return Err(e);
                }
                // Part of it reached the device: the request exists, and the rest is
                // held back, retried below and then by the RNR thread.
                Posted::Cut(e) => Self::note_refused(&mut l, e),
                Posted::Yes | Posted::Later => {}
            }
        }
        if unconfirmed {
            l.unconfirmed_tc = Some((l.next_seq - 1, plan.user.opcode));
        }
        self.release_pending(&mut l);
        self.note_blocked(&mut l);
        Ok(())
    }

    /// The direct path of [`post_send`](Self::post_send): a send, write, read or native
    /// atomic that is one hardware request as the application gave it, on a connection
    /// with nothing held back, goes to the device from here, built on the stack. Returns
    /// [`Direct::Declined`], having changed nothing, for anything else: the ledger's path
    /// plans it, holds it back, or reports what is wrong with it. What it returns is two
    /// words, an error boxed or left to the caller to build: an `Option<Result<()>>` was
    /// copied out of a slot as large as an `Error` on every request (callgrind: a post
    /// 16 instructions fewer without it).
    ///
    /// Where [`direct`](Self::direct) is set (no emulation, no credits, no delivery
    /// reads, no page-crossing workaround) every such request. Elsewhere (iwarp) only
    /// the requests to which the ledger's path would add nothing ([`Self::adds_nothing`]):
    /// transmit-complete sends and writes with no read outstanding (no delivery read),
    /// sends only with a credit in hand and the peer told it need not confirm them, and
    /// reads; payloads of at most 32 bytes inline, reads that do not cross a page. So the
    /// request is exactly what the ledger's path would post. An inline payload is not
    /// copied first: nothing holds it back, so the device library copies it from
    /// registered memory during the call.
    ///
    /// On siw this is most of a small transfer's cost in the guest: the ledger's path
    /// was about 4 100 instructions per 8-byte transmit-complete write, this one about
    /// 900 (callgrind, docs/benchmarks-record.md, twenty-sixth session).
    #[inline]
    fn post_direct(self: &Arc<Self>, wr: &SendWr<'_>) -> Direct {
        let p = &self.dom.profile;
        let mut inline = wr.flags.contains(SendFlags::INLINE);
        let fence = wr.flags.contains(SendFlags::FENCE);
        let transmit = wr.flags.contains(SendFlags::TRANSMIT_COMPLETE);
        // Requests the ledger's path would add to, or hold back behind a read (a fence in
        // software), go there.
        let picky = !self.direct;
        if picky && ((fence && p.soft_fence) || !self.adds_nothing(wr, transmit)) {
            return Direct::Declined;
        }
        let atomic_result;
        // The entries, the hardware operation, the access its local memory needs, and
        // whether it moves the gather list's bytes (else 8: an atomic).
        let (sgl, op, need, moves) = match wr.op {
            SendOp::Send { sgl, imm } if imm.is_none() || p.immediate => {
                (sgl, HwOp::Send { imm }, Access::empty(), true)
            }
            SendOp::Write { sgl, remote, imm } if imm.is_none() || p.immediate => (
                sgl,
                HwOp::Write {
                    addr: remote.addr,
                    rkey: remote.key,
                    imm,
                },
                Access::empty(),
                true,
            ),
            SendOp::Read { sgl, remote }
                if !inline
                    && (!p.split_reads || sgl.len() <= self.dom.dev.max_sge_rd.max(1) as usize) =>
            {
                (
                    sgl,
                    HwOp::Read {
                        addr: remote.addr,
                        rkey: remote.key,
                    },
                    Access::LOCAL_WRITE,
                    true,
                )
            }
            SendOp::Atomic { result, remote, op }
                if p.atomics && !inline && result.len() == 8 && remote.addr % 8 == 0 =>
            {
                atomic_result = [result];
                let op = hw_atomic(op, remote.addr, remote.key);
                (&atomic_result[..], op, Access::LOCAL_WRITE, false)
            }
            _ => return Direct::Declined,
        };
        if sgl.len() > ffi::ONE_SGES {
            return Direct::Declined;
        }
        #[cfg(debug_assertions)]
        if crate::fault::armed() {
            return Direct::Declined;
        }
        if picky && p.small_page_crossing {
            // The workaround's cases: a small payload goes inline (or, too long for the
            // device's inline, is split by the ledger's path), a small read that crosses
            // a remote page is split there.
            let total: u64 = sgl.iter().map(|s| s.len() as u64).sum();
            match wr.op {
                SendOp::Read { remote, .. } if total == 0 || crosses_small(remote.addr, total) => {
                    return Direct::Declined;
                }
                SendOp::Read { .. } => {}
                _ if total <= u64::from(SMALL_PAYLOAD) && total > 0 => {
                    if !self.inlines_small(total) {
                        return Direct::Declined;
                    }
                    inline = true;
                }
                _ => {}
            }
        }
        let mut sges = Sges::new();
        let mut holds = Holds::new();
        // An inline payload is read during the call: no counted reference to take.
        let total = match self.gather(sgl, need, &mut sges, (!inline).then_some(&mut holds)) {
            Ok(x) => x,
            Err(e) => return Direct::Invalid(Box::new(e)),
        };
        // The ledger's path reports an application's inline payload above the endpoint's
        // limit. One inlined by the workaround above is bounded by the queue pair's (the
        // domain's on the devices where it applies), not by the application's.
        if (wr.flags.contains(SendFlags::INLINE) && total > u64::from(self.max_inline))
            || (inline && total > u64::from(self.dom.limits.max_inline))
        {
            return Direct::Declined;
        }
        let byte_len = if moves { total } else { 8 };
        if self.send_cq.reserve(0).is_err() {
            return Direct::Declined;
        }
        let mut l = self.lock();
        let is_send = matches!(op, HwOp::Send { .. });
        if l.status != EndpointState::Connected
            || l.torn_down
            || l.pending > 0
            || l.user_sq >= self.sq_depth
            || l.hw_sq >= self.hw_sq_cap
            || (picky && !self.adds_nothing_now(&l, is_send, transmit))
        {
            drop(l);
            self.send_cq.release(1);
            return Direct::Declined;
        }
        let seq = l.next_seq;
        // SAFETY: every entry names memory registered in this domain (checked by
        // `gather`), held by the record pushed below until it completes or the queue pair
        // is destroyed (teardown destroys it before dropping records); an inline payload,
        // of which no reference is held, is read during the call, while `wr` borrows its
        // region (which cannot be dropped meanwhile).
        #[allow(unsafe_code)]
        let posted = unsafe {
            self.id
                .post_one(seq, op, &sges, inline, wr.flags.contains(SendFlags::FENCE))
        };
        if let Err(e) = posted {
            // Nothing reached the device: the request never existed (as on the ledger's
            // path, whose first group this would have been).
            drop(l);
            self.send_cq.release(1);
            return Direct::Refused(e);
        }
        l.next_seq += 1;
        if picky && transmit {
            // As the ledger's path records a transmit-complete request posted without
            // its delivery read.
            l.unconfirmed_tc = Some((seq, wr.opcode()));
        }
        l.sq.push_back(SqRec {
            seq,
            unposted: false,
            grouped: true,
            user: Some(UserRec {
                context: wr.context,
                opcode: wr.opcode(),
                signaled: wr.flags.contains(SendFlags::SIGNALED),
                byte_len,
            }),
            internal: false,
            is_send,
            is_read: matches!(op, HwOp::Read { .. }),
            deferrable: false,
            _holds: holds,
            rare: None,
        });
        l.user_sq += 1;
        l.hw_sq += 1;
        l.sends_hw += u64::from(is_send);
        // A refusal is only ever of a held-back request, and none is held back.
        debug_assert!(l.refused.is_none(), "a refusal with nothing held back");
        #[cfg(debug_assertions)]
        crate::fault::note_direct();
        Direct::Posted
    }

    /// Whether a read that carries a request's completion (a user read, or a delivery
    /// read that reports the request before it) is outstanding. A transmit-complete
    /// request then keeps its delivery read: the device completes it at transmit, and it
    /// must not complete before that earlier request.
    #[inline(always)]
    fn completing_read_out(l: &Ledger) -> bool {
        // A queue without reads (a write or send ping-pong's or stream's) walks no
        // records: a scan looks at every record in flight.
        l.sq.has_reads() && l.sq.iter().any(|r| r.is_read && r.user.is_some())
    }

    /// Whether the ledger's path would post `wr` as it is (on a connection that adds to
    /// requests), as far as the request alone tells: a read, or a transmit-complete send
    /// or write without immediate data (emulated here). [`Self::adds_nothing_now`] asks
    /// the ledger the rest.
    fn adds_nothing(&self, wr: &SendWr<'_>, transmit: bool) -> bool {
        match wr.op {
            SendOp::Read { .. } => true,
            SendOp::Send { imm, .. } | SendOp::Write { imm, .. } => transmit && imm.is_none(),
            SendOp::Atomic { .. } => false,
        }
    }

    /// The ledger's part of [`Self::adds_nothing`], under its lock (with nothing held
    /// back): a transmit-complete request keeps its delivery read while a read carrying
    /// an earlier request's completion is outstanding (see `post_send`); requests wait
    /// behind an emulated atomic awaiting its reply; a send needs a credit, and, where
    /// the peer batches its credit updates, the peer told that our sends do not wait
    /// for its count (`tell_mode`, a write of its own). Inlined into the direct path,
    /// which asks on every transmit-complete send and write on iWARP.
    #[inline(always)]
    fn adds_nothing_now(&self, l: &Ledger, is_send: bool, transmit: bool) -> bool {
        if l.amo_wait.is_some() || l.deferred.is_some() {
            return false;
        }
        if transmit && Self::completing_read_out(l) {
            return false;
        }
        if !is_send {
            return true;
        }
        (!self.lazy || l.told_lazy)
            && (self.credit.is_none() || self.peer_counts(l).posted > l.sends_hw)
    }

    /// Posts held-back groups in order while credits and queue room allow.
    fn release_pending(&self, l: &mut Ledger) {
        while l.pending > 0 && l.status == EndpointState::Connected && !l.torn_down {
            match self.post_next_group(l) {
                Posted::Yes => {}
                Posted::Later => break,
                Posted::Refused(e) | Posted::Cut(e) => {
                    // What the device refused stays held back (retried by the RNR
                    // thread) rather than refused again in a loop here.
                    tracing::debug!("posting a held-back request failed: {e}");
                    Self::note_refused(l, e);
                    break;
                }
            }
        }
    }

    /// Notes that the device refused the first held-back request (see
    /// [`Ledger::refused`]): from now, unless it was already refusing it.
    fn note_refused(l: &mut Ledger, e: Error) {
        if e.kind() != ErrorKind::QueueFull && l.refused.is_none() {
            l.refused = Some((Instant::now(), e));
        }
    }

    /// Posts the first unposted group.
    fn post_next_group(&self, l: &mut Ledger) -> Posted {
        if l.amo_wait.is_some() {
            // An emulated atomic waits for its reply: what was posted after it waits too
            // (completions in posting order; one request slot per connection).
            return Posted::Later;
        }
        debug_assert_eq!(
            l.unposted.len(),
            l.pending,
            "one request per unposted record"
        );
        if self.resolve_deferred(l, None) {
            return Posted::Later;
        }
        if l.pending == 0 {
            return Posted::Yes; // the held-back delivery read was all there was
        }
        let start = l.sq.len() - l.pending;
        let mut end = start;
        while end < l.sq.len() {
            let r = &l.sq[end];
            end += 1;
            if r.user.is_some() || !r.grouped {
                break;
            }
        }
        let group = start..end;
        // A send's delivery read stays behind when the send leaves (`resolve_deferred`).
        let defer = group.len() > 1 && l.sq[end - 1].deferrable;
        let post_n = group.len() - usize::from(defer);
        let sends = l.sq.range(group.clone()).filter(|r| r.is_send).count() as u64;
        if sends > 0 && self.credit.is_some() && self.peer_counts(l).posted < l.sends_hw + sends {
            return Posted::Later;
        }
        if l.hw_sq + group.len() > self.hw_sq_cap {
            return Posted::Later;
        }
        let soft_fence = self.dom.profile.soft_fence;
        if soft_fence && l.unposted.iter().take(group.len()).any(|w| w.fence) {
            // A fence in software: the group waits here until every read before it has
            // completed, then goes to the device unfenced (`Profile::soft_fence`). What
            // completes the last of those reads posts it (`handle_completion`, or the
            // helper thread's reap in `retry_blocked`).
            if l.sq.range(..start).any(|r| r.is_read && r.posted()) {
                return Posted::Later;
            }
        }
        // The group's requests are the first `group.len()` of `unposted`: numbered and,
        // for emulation records, filled in where they lie, then posted from there.
        let mut sends_before = 0u64;
        let mut amo_seq = None;
        let (sends_hw, amo_sent) = (l.sends_hw, l.amo_sent);
        let Ledger { sq, unposted, .. } = &mut *l;
        let wrs = &mut unposted.make_contiguous()[..post_n];
        // Bit i: the group's request i asked for a fence, kept off the device (below) and
        // given back if the device takes none of the group, which then waits again.
        let mut fences = 0u64;
        for (i, (r, w)) in sq.range(group.clone()).zip(wrs.iter_mut()).enumerate() {
            w.wr_id = r.seq;
            if soft_fence && w.fence && i < 64 {
                // No read of ours is outstanding (above): the device's fence is not needed,
                // and on siw it could deadlock the connection.
                fences |= 1 << i;
                w.fence = false;
            }
            if let (Some(rec), Some(e)) = (r.emu(), &self.emu) {
                let (off, payload) = match rec {
                    EmuRec::Imm(imm) => {
                        // Sends reach the device in ledger order: this one's ordinal.
                        let ordinal = sends_hw + sends_before;
                        let slot = (ordinal % u64::from(e.peer.imm_slots)) as usize;
                        (emu::IMM_OFF + emu::IMM_SLOT * slot, imm.encode(ordinal))
                    }
                    EmuRec::Amo(a) => {
                        let seq = amo_sent + 1;
                        amo_seq = Some(seq);
                        let req = AmoReq {
                            seq,
                            op: a.op,
                            addr: a.addr,
                            rkey: a.rkey,
                        };
                        (emu::REQ_OFF, req.encode())
                    }
                };
                w.op = HwOp::Write {
                    addr: e.peer.addr.wrapping_add(off as u64),
                    rkey: e.peer.stag,
                    imm: None,
                };
                w.inline = Some(Inline::from_slice(&payload));
            }
            if r.is_send {
                sends_before += 1;
            }
            tracing::trace!(qp = self.qpn, seq = w.wr_id, op = ?w.op, sges = ?w.sges, fence = w.fence, "posting");
        }
        // Debug builds: a refusal the device tests asked for (`crate::fault`), where the
        // device refuses request `at` (those before it reach it).
        #[cfg(debug_assertions)]
        let refusal = crate::fault::take(wrs.len());
        #[cfg(not(debug_assertions))]
        let refusal: Option<(usize, i32)> = None;
        let r = match refusal {
            None => {
                // SAFETY: every entry names memory registered in this domain and held by
                // the record (`_holds`, or the endpoint's credit area) until the record
                // completes or the queue pair is destroyed (teardown destroys it before
                // dropping records).
                #[allow(unsafe_code)]
                unsafe {
                    self.id.post_send(wrs)
                }
            }
            Some((at, errno)) => {
                // SAFETY: as above, for the first `at` of them.
                #[allow(unsafe_code)]
                unsafe { self.id.post_send(&wrs[..at]) }
                    .and(Err((at, std::io::Error::from_raw_os_error(errno))))
            }
        };
        let posted = match &r {
            Ok(()) => wrs.len(),
            Err((k, _)) => *k,
        };
        // What reached the device leaves `unposted` (nothing did: the group stays there,
        // unposted, as it was).
        unposted.drain(..posted);
        for r in sq.range_mut(start..start + posted) {
            r.unposted = false;
        }
        l.hw_sq += posted;
        l.pending -= posted;
        l.sends_hw +=
            l.sq.range(start..start + posted)
                .filter(|r| r.is_send)
                .count() as u64;
        if let Some(seq) = amo_seq {
            // The atomic is alone in its group.
            if posted == 1 {
                if let Some(EmuRec::Amo(a)) = l.sq[start].emu_mut() {
                    a.seq = seq;
                }
                l.amo_sent = seq;
                self.set_amo_wait(l, Some(seq));
                self.dom.rnr.hurry();
            }
        }
        if posted > 0 {
            l.refused = None; // the device takes requests again
            if l.deferred.is_some_and(|d| d.released) {
                // The released read was the first of what just reached the device: from
                // here its completion reports the send.
                l.deferred = None;
            }
        }
        if defer && posted == post_n {
            l.deferred = Some(Deferred {
                ordinal: l.sends_hw,
                since: Instant::now(),
                forced: false,
                released: false,
            });
            if !l.watched {
                l.watched = true;
                self.send_cq.watch(self.me.clone());
            }
        }
        match r {
            Ok(()) => Posted::Yes,
            Err((_, e)) => {
                let err = post_error(&e);
                if posted == 0 {
                    for (i, w) in l.unposted.iter_mut().take(64).enumerate() {
                        w.fence |= fences >> i & 1 == 1;
                    }
                    return Posted::Refused(err);
                }
                // Part of the group reached the device: the rest stays the unposted
                // tail, held back, and goes when the device takes it (nothing can pass it:
                // later requests are held back behind it).
                tracing::debug!(qp = self.qpn, posted, "part of a group refused: {err}");
                Posted::Cut(err)
            }
        }
    }

    /// Resolves the send's delivery read held back in [`Ledger::deferred`] (connections
    /// that count deliveries), which is the first unposted record.
    ///
    /// When the peer's completed-receive count covers the send, the send was placed at the
    /// target and the read is never posted: its record, the application's, completes in
    /// its place. Unsignaled, at once (nothing to report). Signaled, only where `cst` (the
    /// send queue's locked state) lets us report it and no earlier application request is
    /// still outstanding, so that completions stay in posting order; until then it waits,
    /// and so does everything posted behind it.
    ///
    /// Not covered yet: the read stays back until something is posted behind it, [`DEFER`]
    /// passed, or [`drain`](Self::drain) forced it; then it is released to go to the device
    /// as the first unposted group, exactly as it would have gone without the count. On a
    /// dead endpoint it stays for [`retire`](Self::retire).
    ///
    /// Returns whether it is still held back.
    fn resolve_deferred(&self, l: &mut Ledger, cst: Option<&mut CqState>) -> bool {
        let Some(d) = l.deferred.filter(|d| !d.released) else {
            return false;
        };
        let at = l.sq.len() - l.pending;
        debug_assert!(
            l.sq.get(at).is_some_and(|r| r.deferrable && r.unposted),
            "the held-back delivery read is the first unposted record"
        );
        if self.peer_counts(l).received >= d.ordinal {
            let Some(u) = l.sq[at].user else {
                debug_assert!(false, "a delivery read ends its group");
                return true;
            };
            if !u.signaled {
                self.finish_deferred(l, at);
                self.send_cq.release(1);
                return false;
            }
            let Some(cst) = cst else {
                return true;
            };
            if l.sq.range(..at).any(|r| r.user.is_some()) {
                return true;
            }
            self.finish_deferred(l, at);
            self.push_user(&self.send_cq, &mut cst.ready, u, None);
            // No device event announces it: wake whoever waits on the queue.
            self.send_cq.notify();
            return false;
        }
        // A dead endpoint keeps it: `retire` reports it (confirmed, or the request the
        // peer most likely refused).
        let live = l.status == EndpointState::Connected && !l.torn_down;
        let late = d.since.elapsed() >= DEFER;
        if live && late && !d.forced && l.pending == 1 && self.qp_failed(l) {
            // No count came because the connection is gone (siw: a Terminate moved the
            // queue pair to the error state, and the connection event is on its way). A
            // read posted now would never complete (siw does not flush what is posted to
            // a queue pair in the error state), so the read stays back for `retire`.
            return true;
        }
        if live && (d.forced || l.pending > 1 || late) {
            if let Some(d) = l.deferred.as_mut() {
                d.released = true;
            }
            return false;
        }
        true
    }

    /// Whether the device said the queue pair is in the error state (final: remembered),
    /// asked at most once per [`QP_STATE_EVERY`] (a system call).
    fn qp_failed(&self, l: &mut Ledger) -> bool {
        if l.qp_err || l.qp_checked.is_some_and(|t| t.elapsed() < QP_STATE_EVERY) {
            return l.qp_err;
        }
        l.qp_checked = Some(Instant::now());
        l.qp_err = matches!(self.id.qp_state(), Ok(ffi::QPS_ERR));
        l.qp_err
    }

    /// Drops the held-back delivery read's record at `at` (confirmed by the peer's count).
    /// The group's regions move to the send's record while the device has not completed
    /// it: memory outlives every request that names it, confirmed or not.
    fn finish_deferred(&self, l: &mut Ledger, at: usize) {
        l.deferred = None;
        #[cfg(debug_assertions)]
        crate::fault::note_confirmed();
        let Some(mut r) = l.sq.remove(at) else {
            return;
        };
        l.unposted.pop_front();
        l.pending -= 1;
        l.user_sq -= 1;
        if let Some(send) =
            l.sq.range_mut(..at)
                .rev()
                .find(|x| x.grouped && x.user.is_none())
        {
            send._holds.extend(std::mem::take(&mut r._holds));
        }
    }

    /// Receives posted that no credit update has told the peer of (batched updates): a
    /// receiver that stops posting and polling would otherwise keep them from a peer that
    /// ran out of credit, so the RNR thread watches them and reaps the receive queue
    /// ([`Self::retry_blocked`]).
    fn unannounced(&self, l: &Ledger) -> bool {
        self.lazy && l.recvs_posted > l.advertised
    }

    /// Whether the RNR thread has work here: requests held back, an owed credit update,
    /// or receives not announced. A send's delivery read held back for the peer's count
    /// counts too: the send queue's completion queue looks at it in `poll` and `wait`
    /// ([`EpCore::settle`]), but an application that waits on the queue's descriptor
    /// (the `fabric` crate's tokio support, an epoll loop) is woken by no event when the
    /// count arrives, and only the RNR thread releases the read once its time is up, whose
    /// completion wakes the descriptor (a build that left such reads to the queue kept
    /// the async example's iwarp ping-pong waiting for good).
    fn wants_rnr(&self, l: &Ledger) -> bool {
        l.pending > 0 || l.credit_dirty || self.unannounced(l)
    }

    /// Registers the endpoint with the RNR thread, or asks it to look soon, when it has
    /// work there ([`Self::wants_rnr`]). Inlined (every receive posted on a connection with
    /// credits runs it, and nearly always finds nothing to do), the registration apart.
    #[inline(always)]
    fn note_blocked(self: &Arc<Self>, l: &mut Ledger) {
        let want = self.wants_rnr(l);
        if !want
            || l.status != EndpointState::Connected
            || (l.blocked && !(l.rnr_slow && (l.pending > 0 || l.credit_dirty)))
        {
            return;
        }
        self.tell_rnr(l);
    }

    /// [`Self::note_blocked`]'s action: registers the endpoint, or brings the RNR thread's
    /// next look forward.
    #[cold]
    #[inline(never)]
    fn tell_rnr(self: &Arc<Self>, l: &mut Ledger) {
        if !l.blocked {
            l.blocked = true;
            l.rnr_slow = false;
            self.dom.rnr.add(Arc::downgrade(self));
        } else if l.rnr_slow && (l.pending > 0 || l.credit_dirty) {
            // More than receives to announce now: the 2 ms pace again, from a look soon.
            l.rnr_slow = false;
            self.dom.rnr.soon();
        }
    }

    /// Called by the RNR thread: retries held-back work, and says whether and how soon
    /// to look again. With [`Patience::Skip`], a ledger locked by another thread is not
    /// looked at ([`Retry::Skipped`]); once looked at, the reaps below wait for their locks.
    ///
    /// A credit update owed for lack of an internal slot needs the device queue reaped
    /// (completions of the provider's own requests give their slots back). Reaping takes
    /// the queue's lock and calls back into the endpoints with completions, this one
    /// included, so it runs with the ledger's lock released, then the ledger is looked
    /// at again (lock order: [`crate::sync`]). Reaping under the ledger's lock was a
    /// self-deadlock: the drain's call into this endpoint waited for the lock its own
    /// thread held.
    pub fn retry_blocked(self: &Arc<Self>, patience: Patience) -> Retry {
        // Batched credit updates: when nothing was posted or filled here for `DEFER`
        // while receives are not announced, the receive queue is reaped. The application
        // may have stopped looking while the peer, out of credit, waits: the fills found
        // make an update due (`handle_completion`) exactly when the peer may run short.
        let Some(mut l) = self.st.lock_with(patience) else {
            return Retry::Skipped;
        };
        let active = self.lazy && {
            let now = l.recvs_posted + l.recvs_done;
            let moved = l.recv_seen.0 != now;
            if moved {
                l.recv_seen = (now, Instant::now());
            }
            moved
        };
        let stale = self.unannounced(&l) && l.recv_seen.1.elapsed() >= DEFER;
        if stale {
            drop(l);
            self.recv_cq.reap();
            l = self.lock();
        }
        let mut reaped = false;
        loop {
            if l.status != EndpointState::Connected || l.torn_down {
                drop(l);
                return if self.flush_stuck() {
                    Retry::Again
                } else {
                    Retry::Done
                };
            }
            self.release_pending(&mut l);
            if l.pending > 0
                && l.refused
                    .as_ref()
                    .is_some_and(|(t, _)| t.elapsed() >= Self::FLUSH_GRACE)
            {
                self.fail_refused(&mut l);
                self.end_connection(l);
                return Retry::Again; // dead now: looked at again (`flush_stuck`)
            }
            // Owed credits may wait for internal slots, and requests behind a software
            // fence for a read's completion: reaping the device queue gives both.
            let short = self.send_credit(&mut l) || (self.dom.profile.soft_fence && l.pending > 0);
            if !short || reaped {
                let still =
                    self.wants_rnr(&l) && l.status == EndpointState::Connected && !l.torn_down;
                let verdict = Retry::after_look(still, active && l.pending == 0 && !l.credit_dirty);
                l.blocked = verdict != Retry::Done;
                l.rnr_slow = verdict == Retry::Watching;
                return verdict;
            }
            drop(l);
            self.send_cq.reap();
            reaped = true;
            l = self.lock();
        }
    }

    /// How long a dead endpoint waits for the device to flush what it holds, and how
    /// long a connected one lets the device refuse a held-back request before failing it
    /// ([`Self::fail_refused`]).
    const FLUSH_GRACE: Duration = Duration::from_secs(2);

    /// The device has refused the first held-back request for [`Self::FLUSH_GRACE`] on
    /// a connected endpoint (not a full queue: [`Ledger::refused`]): it will not take it.
    /// The request fails with the device's error and the endpoint enters the error state
    /// (docs/contract.md section 6: the first error completion does that). The caller then
    /// ends the connection ([`Self::end_connection`]): the queue pair disconnects, which
    /// flushes what the device holds, and the requests behind it complete `Flushed`. A
    /// refusal while the connection goes down (the peer closed, the queue pair is leaving)
    /// never gets here: the connection event comes first and the endpoint's requests are
    /// flushed as for any close.
    fn fail_refused(&self, l: &mut Ledger) {
        let Some((_, err)) = l.refused.take() else {
            return;
        };
        l.deferred = None;
        let start = l.sq.len() - l.pending;
        let mut end = start;
        while end < l.sq.len() {
            let r = &mut l.sq[end];
            end += 1;
            r.unposted = false;
            r.set_failed((err.kind(), err.code()));
            if r.user.is_some() {
                break; // the end of the first held-back request
            }
        }
        l.unposted.drain(..end - start);
        l.pending -= end - start;
        let why = format!(
            "the device refused a request for {:?}: {err}",
            Self::FLUSH_GRACE
        );
        tracing::debug!(qp = self.qpn, "{why}");
        self.leave(l, || EndpointEvent::Failed(Error::new(err.kind(), why)));
    }

    /// Registers a dead endpoint with the RNR thread, which completes what the device
    /// never flushes (siw leaves fenced requests in its send queue when a Terminate
    /// arrives while its transmitter is idle).
    fn note_dead(self: &Arc<Self>, l: &mut Ledger) {
        if l.status == EndpointState::Connected || l.dead_since.is_some() {
            return;
        }
        l.dead_since = Some(Instant::now());
        if !l.blocked {
            l.blocked = true;
            self.dom.rnr.add(Arc::downgrade(self));
        }
    }

    /// Completes `Flushed` whatever the device has not flushed a while after the endpoint
    /// died. The regions stay alive (graveyard) until the queue pair is destroyed.
    /// Returns whether the endpoint must be looked at again.
    fn flush_stuck(&self) -> bool {
        {
            let l = self.lock();
            let Some(t) = l.dead_since else {
                return false;
            };
            if l.torn_down || (l.sq.is_empty() && l.rq.is_empty()) {
                return false;
            }
            if t.elapsed() < Self::FLUSH_GRACE {
                return true;
            }
        }
        {
            let mut cst = self.send_cq.lock();
            self.send_cq.drain(&mut cst);
            let mut l = self.lock();
            let recs: Vec<SqRec> = l.sq.drain_all().collect();
            if !recs.is_empty() {
                tracing::debug!(qp = self.qpn, n = recs.len(), "device did not flush these send-queue requests: the provider completes them Flushed");
            }
            for mut r in recs {
                if !r.unposted && r.failed().is_none() {
                    l.hw_sq -= 1;
                }
                self.retire(&mut l, &mut cst, &mut r);
                l.graveyard.extend(r._holds);
            }
            self.send_cq.notify();
        }
        {
            let mut cst = self.recv_cq.lock();
            self.recv_cq.drain(&mut cst);
            let mut l = self.lock();
            let recs: Vec<RqRec> = l.rq.drain_all().collect();
            for r in recs {
                cst.ready.push(
                    Completion::flushed(r.context, Opcode::Recv).on_endpoint(self.ep_context),
                );
                l.graveyard.extend(r._holds);
            }
            self.recv_cq.notify();
        }
        self.lock().blocked = false;
        false
    }

    // ----- dead-peer detection (iWARP) --------------------------------------------------

    /// Dead-peer detection: called by the domain's helper thread once per liveness tick,
    /// with no lock held. Returns whether to keep watching the endpoint.
    ///
    /// A sign of life is any completion of the endpoint's queue pair (the application's
    /// requests, credit updates, delivery reads, probes) and any TCP segment the
    /// connection's socket received from the peer (the kernel's `tcp_info`, so a long
    /// transfer that is making progress counts even before it completes). After a quarter
    /// of the timeout without one the endpoint is probed (a delivery read, which any live
    /// peer answers, posted ahead of held-back work; one at a time); once the quiet time
    /// reaches the timeout, less one tick, the peer is declared dead ([`Self::declare_dead`]).
    pub fn check_liveness(self: &Arc<Self>) -> bool {
        let Some(timeout) = self.dom.dead_peer else {
            return false;
        };
        let tick = crate::liveness_tick(timeout);
        let probe_after = timeout / 4;
        if !self.quiet_for(probe_after) {
            return true;
        }
        // Quiet: reap (completions waiting in the device queue are signs of life) with no
        // endpoint lock held (lock order), and ask the kernel when TCP last heard the peer.
        self.send_cq.reap();
        if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            self.recv_cq.reap();
        }
        let heard = ffi::tcp_last_heard(self.local, self.peer);
        let mut l = self.lock();
        if l.status != EndpointState::Connected || l.torn_down {
            return false;
        }
        let now = Instant::now();
        if l.progress != l.seen {
            l.seen = l.progress;
            l.last_life = now;
            return true;
        }
        match heard.and_then(|ago| now.checked_sub(ago)) {
            Some(t) => l.last_life = l.last_life.max(t),
            None if !l.tcp_blind => {
                l.tcp_blind = true;
                tracing::warn!(
                    qp = self.qpn,
                    local = %self.local,
                    peer = %self.peer,
                    "the kernel does not tell when this connection's TCP socket last heard the peer (no inet_diag?): dead-peer detection counts completions only, so a transfer taking longer than the dead-peer timeout without any completion is declared dead"
                );
            }
            None => {}
        }
        let quiet = now.saturating_duration_since(l.last_life);
        if quiet + tick >= timeout {
            drop(l);
            self.declare_dead(quiet, timeout);
            return false;
        }
        if quiet >= probe_after {
            let in_flight = l.probe.is_some_and(|seq| l.sq.iter().any(|r| r.seq == seq));
            if !in_flight && self.post_probe(&mut l) {
                tracing::trace!(
                    qp = self.qpn,
                    quiet_ms = quiet.as_millis() as u64,
                    "liveness probe posted"
                );
            }
        }
        true
    }

    /// True when the endpoint has shown no sign of life the ledger knows of for `d` (a
    /// cheap look under the ledger's lock; new completions count as life now).
    fn quiet_for(&self, d: Duration) -> bool {
        let mut l = self.lock();
        if l.progress != l.seen {
            l.seen = l.progress;
            l.last_life = Instant::now();
            return false;
        }
        l.last_life.elapsed() >= d
    }

    /// Posts a liveness probe: the endpoint's delivery read (the peer's whole credit
    /// area, or a zero-length read of a peer without one, which base RDMAP carries to any
    /// peer), as an internal request ahead of held-back work. Needs a free internal slot
    /// and send-queue room (never reaps: the ledger's lock is held). Returns whether it
    /// was posted.
    fn post_probe(&self, l: &mut Ledger) -> bool {
        let Some(mut w) = self.delivery_read() else {
            return false;
        };
        if l.hw_sq >= self.hw_sq_cap || !self.send_cq.reserve_internal(1) {
            return false;
        }
        let seq = l.next_seq;
        l.next_seq += 1;
        w.wr_id = seq;
        // SAFETY: the one entry names the endpoint's own area (credit area or delivery-read
        // sink), registered in this domain and alive as long as the endpoint, whose queue
        // pair is destroyed before it.
        #[allow(unsafe_code)]
        let r = unsafe { self.id.post_send(std::slice::from_ref(&w)) };
        if let Err((_, e)) = r {
            tracing::debug!(qp = self.qpn, "liveness probe refused: {e}");
            self.send_cq.release_internal(1);
            return false;
        }
        Self::record_internal(l, seq, true);
        l.probe = Some(seq);
        true
    }

    /// Declares the peer dead after `quiet` without a sign of life (helper thread, no lock
    /// held): the endpoint enters `Error`, the connection is closed and the queue pair
    /// destroyed (nothing it was asked to do lands later), and every outstanding request
    /// completes in posting order, the oldest application request `RetryExceeded`, the
    /// rest `Flushed`; receives complete `Flushed`.
    fn declare_dead(self: &Arc<Self>, quiet: Duration, timeout: Duration) {
        let (sq, rq) = {
            let mut l = self.lock();
            if l.status != EndpointState::Connected || l.torn_down || l.progress != l.seen {
                return;
            }
            tracing::warn!(
                qp = self.qpn,
                local = %self.local,
                peer = %self.peer,
                quiet_ms = quiet.as_millis() as u64,
                timeout_ms = timeout.as_millis() as u64,
                outstanding = l.user_sq,
                receives = l.rq.len(),
                on_device = l.hw_sq,
                held_back = l.pending,
                sends_posted = l.sends_hw,
                peer_receives = self.credit.is_some().then(|| self.peer_counts(&l).posted),
                credit_owed = l.credit_dirty,
                probe_in_flight = l.probe.is_some_and(|seq| l.sq.iter().any(|r| r.seq == seq)),
                "no sign of life from the peer within the dead-peer timeout: endpoint declared dead, its queue pair destroyed; outstanding requests complete RetryExceeded (the oldest) and Flushed"
            );
            self.leave(&mut l, || {
                EndpointEvent::Failed(Error::new(
                    ErrorKind::RetryExceeded,
                    format!(
                        "no sign of life from the peer {} for {} ms (dead-peer timeout {} ms): endpoint declared dead",
                        self.peer,
                        quiet.as_millis(),
                        timeout.as_millis()
                    ),
                ))
            });
            l.attributed = true;
            l.dead_since = Some(Instant::now());
            let _ = self.id.disconnect();
            // Under the ledger lock, as in teardown: nothing posts to a destroyed pair.
            l.torn_down = true;
            self.id.destroy_qp();
            l.hw_sq = 0;
            l.probe = None;
            (std::mem::take(&mut l.sq), std::mem::take(&mut l.rq))
        };
        {
            let mut cst = self.send_cq.lock();
            // What the device completed before the pair died finds no record: dropped.
            self.send_cq.drain(&mut cst);
            let mut l = self.lock();
            let mut first = true;
            for mut r in sq.q {
                if r.user.is_some() && std::mem::take(&mut first) && r.group_err().is_none() {
                    let e = r.failed().unwrap_or((ErrorKind::RetryExceeded, None));
                    r.note_group_err(Some(e));
                }
                self.retire(&mut l, &mut cst, &mut r);
            }
            self.send_cq.notify();
        }
        let mut cst = self.recv_cq.lock();
        self.recv_cq.drain(&mut cst);
        for r in rq {
            cst.ready
                .push(Completion::flushed(r.context, Opcode::Recv).on_endpoint(self.ep_context));
        }
        self.recv_cq.notify();
    }

    // ----- emulated atomics (see `crate::emu`) ---------------------------------------

    /// Sets the atomic waiting for its reply, in the ledger and in what polls look at.
    fn set_amo_wait(&self, l: &mut Ledger, wait: Option<u64>) {
        l.amo_wait = wait;
        if let Some(e) = &self.emu {
            e.watch.wait.store(wait.unwrap_or(0), Ordering::Release);
        }
    }

    /// Serves the emulation of atomics (called by the domain's helper thread, and by a
    /// poll of the application whose look found work, `EmuWatch::look`; no lock held):
    /// completes our atomic whose reply arrived and executes the peer's request. With
    /// [`Patience::Skip`], an endpoint whose ledger another thread holds is passed over
    /// (`EmuPass::skipped`); once work is found, every lock is waited for.
    pub fn poll_emu(self: &Arc<Self>, patience: Patience) -> EmuPass {
        let Some(e) = &self.emu else {
            return EmuPass::default();
        };
        let covered = e.watch.looked.swap(false, Ordering::AcqRel);
        let (wait, killing, served, keep) = {
            let Some(l) = self.st.lock_with(patience) else {
                return EmuPass {
                    busy: e.watch.wait.load(Ordering::Acquire) != 0,
                    keep: true,
                    covered,
                    skipped: true,
                };
            };
            if l.torn_down {
                return EmuPass::default();
            }
            (
                l.amo_wait,
                l.kill_after.is_some(),
                l.amo_served,
                Self::served(&l),
            )
        };
        let mut busy = wait.is_some() || killing;
        if let Some(seq) = wait {
            if let Some(reply) = AmoReply::read(e.watch.area()).filter(|r| r.seq == seq) {
                self.complete_amo(reply);
            }
        }
        if killing {
            // The reply to a refused atomic is on its way: reap its completion, which
            // disconnects (the target application may never poll).
            self.send_cq.reap();
        }
        if let Some(req) = AmoReq::read(e.watch.area()).filter(|r| r.seq == served.wrapping_add(1))
        {
            self.serve_amo(e, req);
            busy = true;
        }
        if !busy {
            // Nothing done: the look under the lock above still holds.
            return EmuPass {
                busy,
                keep,
                covered,
                skipped: false,
            };
        }
        EmuPass {
            busy,
            keep: Self::served(&self.lock()),
            covered,
            skipped: false,
        }
    }

    /// Whether the helper keeps serving the endpoint's emulation: while it is connected,
    /// or until a refused atomic's reply has left.
    fn served(l: &Ledger) -> bool {
        !l.torn_down && (l.status == EndpointState::Connected || l.kill_after.is_some())
    }

    /// Completes our emulated atomic with the peer's reply (helper thread, no lock held).
    fn complete_amo(self: &Arc<Self>, reply: AmoReply) {
        let mut cst = self.send_cq.lock();
        // The request's own completion first (it must have left before its reply counts).
        self.send_cq.drain(&mut cst);
        let mut l = self.lock();
        if l.amo_wait != Some(reply.seq) {
            return;
        }
        let Some(pos) = l
            .sq
            .iter()
            .position(|r| matches!(r.emu(), Some(EmuRec::Amo(a)) if a.seq == reply.seq && a.sent))
        else {
            return;
        };
        let mut r = l.sq.remove(pos).expect("position is valid");
        self.set_amo_wait(&mut l, None);
        l.progress = l.progress.wrapping_add(1);
        let Some(u) = r.user.take() else {
            return;
        };
        l.user_sq -= 1;
        match (reply.result, r.emu()) {
            (Ok(old), Some(EmuRec::Amo(a))) => {
                tracing::trace!(
                    qp = self.qpn,
                    seq = reply.seq,
                    old,
                    result = a.result.buffer().addr() + a.off as u64,
                    "emulated atomic completed"
                );
                a.result.buffer().write(a.off, &old.to_ne_bytes());
                self.push_user(&self.send_cq, &mut cst.ready, u, None);
            }
            (res, _) => {
                let kind = res.err().unwrap_or(ErrorKind::RemoteOperation);
                tracing::debug!(
                    qp = self.qpn,
                    seq = reply.seq,
                    ?kind,
                    "the peer refused an emulated atomic: endpoint enters the error state"
                );
                self.leave(&mut l, || {
                    EndpointEvent::Failed(Error::new(
                        kind,
                        format!("the peer refused an emulated atomic ({kind})"),
                    ))
                });
                l.attributed = true;
                self.push_user(&self.send_cq, &mut cst.ready, u, Some((kind, None)));
                let _ = self.id.disconnect();
            }
        }
        self.note_dead(&mut l);
        if l.status == EndpointState::Connected {
            self.release_pending(&mut l);
            self.send_credit(&mut l);
            self.note_blocked(&mut l);
        } else {
            self.flush_unposted(&mut l, &mut cst);
        }
        drop(l);
        drop(cst);
        self.send_cq.notify();
    }

    /// Executes the peer's atomic request and writes the reply (helper thread, no lock
    /// held). A refused request puts the endpoint in the error state; it disconnects once
    /// the reply left.
    fn serve_amo(self: &Arc<Self>, e: &EmuLink, req: AmoReq) {
        // A slot for the reply; reaping for it takes the queue's lock (no ledger lock).
        if !self.send_cq.reserve_internal_reaping(1) {
            return;
        }
        let mut l = self.lock();
        if l.status != EndpointState::Connected
            || l.torn_down
            || req.seq != l.amo_served.wrapping_add(1)
            || l.hw_sq >= self.hw_sq_cap
        {
            drop(l);
            self.send_cq.release_internal(1);
            return;
        }
        let result = self.dom.atomic_keys.execute(&req);
        tracing::trace!(qp = self.qpn, seq = req.seq, op = ?req.op, addr = req.addr, rkey = req.rkey, ?result, "emulated atomic executed");
        l.amo_served = req.seq;
        e.watch.served.store(req.seq, Ordering::Release);
        l.progress = l.progress.wrapping_add(1);
        let seq = l.next_seq;
        l.next_seq += 1;
        let w = HwWr {
            wr_id: seq,
            op: HwOp::Write {
                addr: e.peer.addr.wrapping_add(emu::REPLY_OFF as u64),
                rkey: e.peer.stag,
                imm: None,
            },
            sges: Sges::new(),
            inline: Some(Inline::from_slice(
                &AmoReply {
                    seq: req.seq,
                    result,
                }
                .encode(),
            )),
            fence: false,
        };
        // SAFETY: an inline request: the payload is copied at post time, no memory is
        // named after the call.
        #[allow(unsafe_code)]
        let r = unsafe { self.id.post_send(std::slice::from_ref(&w)) };
        if let Err((_, err)) = r {
            tracing::debug!(qp = self.qpn, "reply to an emulated atomic refused: {err}");
            self.send_cq.release_internal(1);
            return;
        }
        Self::record_internal(&mut l, seq, false);
        if let Err(kind) = result {
            tracing::debug!(
                qp = self.qpn,
                ?kind,
                addr = req.addr,
                rkey = req.rkey,
                "emulated atomic refused: endpoint enters the error state"
            );
            self.leave(&mut l, || {
                EndpointEvent::Failed(Error::new(
                    kind,
                    format!(
                        "refused the peer's emulated atomic at {:#x} (key {:#x}): {kind}",
                        req.addr, req.rkey
                    ),
                ))
            });
            l.attributed = true;
            l.kill_after = Some(seq);
            self.note_dead(&mut l);
        }
    }

    /// Completes the application's receive matched to early receive `j` once both the
    /// message and the receive are there: a copy of the message (receive CQ's lock held).
    fn finish_early(&self, l: &mut Ledger, cst: &mut CqState, j: usize) {
        let Some(slot) = l.early.get_mut(j) else {
            return;
        };
        let (Some((len, err)), Some(_)) = (slot.done, &slot.app) else {
            return;
        };
        let (context, targets) = slot.app.take().expect("checked");
        let ring = self.early.as_ref().expect("early slots come with the ring");
        let room: usize = targets.iter().map(|t| t.2).sum();
        let mut status = err;
        if status.is_none() && len as usize > room {
            status = Some((ErrorKind::LocalLength, None));
            self.leave(l, || {
                EndpointEvent::Failed(Error::new(
                    ErrorKind::LocalLength,
                    format!("a message of {len} bytes arrived for a receive of {room} bytes"),
                ))
            });
        }
        if status.is_none() {
            let mut at = j * EarlyRing::SLOT_LEN;
            let mut left = len as usize;
            for (r, off, n) in &targets {
                let take = left.min(*n);
                if take == 0 {
                    break;
                }
                r.buffer().write(*off, &ring.buf.to_vec(at, take));
                at += take;
                left -= take;
            }
        }
        l.recvs_done += 1;
        cst.ready.push(Completion {
            context,
            opcode: Opcode::Recv,
            status: status.map_or(Status::Success, |e| Status::Error(e.0)),
            provider_code: status.and_then(|e| e.1),
            byte_len: if status.is_none() { u64::from(len) } else { 0 },
            imm: None,
            ep_context: self.ep_context,
        });
        self.recv_cq.notify();
    }

    pub fn post_recv(self: &Arc<Self>, wr: &RecvWr<'_>) -> Result<()> {
        let mut sges = Sges::new();
        let mut holds = Holds::new();
        self.gather(wr.sgl, Access::LOCAL_WRITE, &mut sges, Some(&mut holds))?;
        if sges.is_empty() {
            // A receive for zero-byte messages: siw's user-space provider refuses a
            // receive without entries (EINVAL); one entry of length 0 in our own area is
            // the same receive. rxe and InfiniBand take none, and have no area.
            let area = (self.credit.as_ref().map(|c| (&c.buf, &c.mr)))
                .or_else(|| self.sink.as_ref().map(|(b, m)| (b, m)));
            if let Some((buf, mr)) = area {
                sges.push(Sge {
                    addr: buf.addr() + credit::SCRATCH as u64,
                    len: 0,
                    lkey: mr.lkey(),
                });
            }
        }
        if self.early.is_some() {
            let l = self.lock();
            if l.early_matched < l.early.len() {
                if l.status != EndpointState::Connected || l.torn_down {
                    return Err(invalid_state(l.status));
                }
                drop(l);
                self.recv_cq.reserve(0)?;
                // Matched to the next early receive, in order; completed by a copy.
                let targets: Vec<(RegionRef, usize, usize)> = wr
                    .sgl
                    .iter()
                    .zip(holds)
                    .map(|(s, r)| (r, s.offset(), s.len()))
                    .collect();
                let mut cst = self.recv_cq.lock();
                let mut l = self.lock();
                let j = l.early_matched;
                if j >= l.early.len() || l.status != EndpointState::Connected || l.torn_down {
                    drop(l);
                    drop(cst);
                    self.recv_cq.release(1);
                    return Err(Error::new(
                        ErrorKind::InvalidState,
                        "endpoint changed while posting a receive",
                    ));
                }
                l.early_matched += 1;
                l.early[j].app = Some((wr.context, targets));
                self.finish_early(&mut l, &mut cst, j);
                return Ok(());
            }
        }
        if let Err(e) = self.recv_cq.reserve(0) {
            // A dead endpoint says so rather than that its queue is full (its state is
            // looked at once, below, when the slot was had).
            let l = self.lock();
            if l.status != EndpointState::Connected || l.torn_down {
                return Err(invalid_state(l.status));
            }
            return Err(e);
        }
        let mut l = self.lock();
        let undo = |me: &Self| me.recv_cq.release(1);
        if l.status != EndpointState::Connected || l.torn_down {
            undo(self);
            return Err(invalid_state(l.status));
        }
        if l.rq.len() >= self.rq_depth {
            undo(self);
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!("receive queue of depth {} is full", self.rq_depth),
            ));
        }
        let seq = l.next_seq;
        l.next_seq += 1;
        // SAFETY: the entries name LOCAL_WRITE memory of this domain held by the record
        // pushed below until the receive completes or the queue pair is destroyed.
        #[allow(unsafe_code)]
        if let Err(e) = unsafe { self.id.post_recv(RECV_BIT | seq, &sges) } {
            undo(self);
            return Err(post_error(&e));
        }
        l.rq.push_back(RqRec {
            seq,
            context: wr.context,
            _holds: holds,
        });
        if self.credit.is_some() {
            l.recvs_posted += 1;
            if !self.batching() || credit_due(l.advertised, l.recvs_posted, l.recvs_done) {
                l.credit_dirty = true;
            }
            // An internal slot is reserved only for an update that is due (most receives
            // of a batching connection owe none: no reservation to take and give back).
            // Short of a slot, the send queue is reaped with the ledger's lock released
            // (lock order: `crate::sync`), then the update tried once more; still short,
            // it stays owed and the RNR thread retries it (`note_blocked`).
            if l.credit_dirty && self.send_credit(&mut l) {
                drop(l);
                self.send_cq.reap();
                l = self.lock();
                self.send_credit(&mut l);
            }
            self.note_blocked(&mut l);
        }
        Ok(())
    }

    /// Whether our credit updates are batched now: the connection batches them
    /// ([`lazy`](Self::lazy)) and the peer's mode word says its sends need no
    /// confirmation. Otherwise every receive posted writes one (each confirms the
    /// peer's sends by our count of receives completed). Inlined: every receive posted
    /// and completed on a connection with credits asks.
    #[inline(always)]
    fn batching(&self) -> bool {
        self.lazy
            && self
                .emu
                .as_ref()
                .is_some_and(|e| area_word(e.watch.area(), emu::MODE_OFF) == emu::MODE_LAZY)
    }

    /// Tells the peer whether its credit updates may be batched (`lazy`: the request
    /// about to be posted, which consumes one of its receives, is transmit complete and
    /// needs no count to confirm it), when that changes: a write of its mode word, posted
    /// ahead of the request. Without an internal slot or room on the device the mode
    /// stays as it was: batching is then missed, or a delivery-complete send is
    /// confirmed by its delivery read instead of the count; nothing else depends on it.
    fn tell_mode(&self, l: &mut Ledger, lazy: bool) {
        let Some(e) = &self.emu else { return };
        if !self.lazy || l.told_lazy == lazy || !self.send_cq.reserve_internal(1) {
            return;
        }
        let value = if lazy { emu::MODE_LAZY } else { 0 };
        if self.post_area_write(l, (e.peer.addr + emu::MODE_OFF as u64, e.peer.stag), value) {
            l.told_lazy = lazy;
        } else {
            self.send_cq.release_internal(1);
        }
    }

    /// The initiator of a connection with credits speaks first: a credit update (its count
    /// of posted receives, zero so far), so that a responder that must not send before the
    /// initiator's first FPDU (MPA; the tcp provider waits for it: siw's initiator reads
    /// its MPA Reply with a look-ahead and fails the connection on bytes behind it) hears
    /// from us even when we have nothing else to send.
    pub(crate) fn speak_first(self: &Arc<Self>) {
        if self.credit.is_none() {
            return;
        }
        let mut l = self.lock();
        l.credit_dirty = true;
        self.send_credit(&mut l);
        self.note_blocked(&mut l);
    }

    /// Sends an owed credit update if an internal slot is free now (never reaps: the
    /// ledger's lock is held). Returns true when the update is still owed for lack of a
    /// slot, which reaping the send queue may cure.
    fn send_credit(&self, l: &mut Ledger) -> bool {
        if !l.credit_dirty
            || self.credit.is_none()
            || l.status != EndpointState::Connected
            || l.torn_down
        {
            return false;
        }
        if !self.send_cq.reserve_internal(1) {
            return true;
        }
        let v = self.credit_word(l);
        if !self.post_credit(l, credit::POSTED, v) {
            self.send_cq.release_internal(1);
        }
        false
    }

    /// What our credit updates write: the count of receives ever posted, packed with the
    /// count completed where the connection counts deliveries.
    fn credit_word(&self, l: &Ledger) -> u64 {
        if self.counted {
            pdata::CreditWord {
                posted: l.recvs_posted,
                received: l.recvs_done,
            }
            .pack()
        } else {
            l.recvs_posted
        }
    }

    /// The peer's counts, as its last credit update left them in our area: receives it
    /// ever posted and, where the connection counts deliveries, ever completed (else 0).
    #[inline(always)]
    fn peer_counts(&self, l: &Ledger) -> pdata::CreditWord {
        let w = match &self.credit {
            Some(c) => c.peer_word(),
            None => 0,
        };
        if self.counted {
            pdata::CreditWord::unpack(w, l.sends_hw)
        } else {
            pdata::CreditWord {
                posted: w,
                received: 0,
            }
        }
    }

    /// Records an internal request the device now holds (credit update, liveness probe):
    /// ahead of the application requests still held back, so completions stay in order.
    fn record_internal(l: &mut Ledger, seq: u64, is_read: bool) {
        let at = l.sq.len() - l.pending;
        l.sq.insert(
            at,
            SqRec {
                seq,
                unposted: false,
                grouped: false,
                user: None,
                internal: true,
                is_send: false,
                is_read,
                deferrable: false,
                _holds: Holds::new(),
                rare: None,
            },
        );
        l.hw_sq += 1;
    }

    /// Writes `value` into the peer's credit area at `off` (an internal record, posted
    /// ahead of held-back application requests). Needs an internal slot already reserved.
    fn post_credit(&self, l: &mut Ledger, off: usize, value: u64) -> bool {
        let Some(c) = &self.credit else { return false };
        if !self.post_area_write(l, (c.peer.0 + off as u64, c.peer.1), value) {
            return false;
        }
        if off == credit::POSTED {
            #[cfg(debug_assertions)]
            crate::fault::note_credit_update();
            l.advertised = l.recvs_posted;
            if value == self.credit_word(l) {
                l.credit_dirty = false;
            }
        }
        true
    }

    /// Writes one word of the peer's (at `addr` under `rkey`), inline: an internal
    /// record posted ahead of held-back application requests. Needs an internal slot
    /// already reserved.
    fn post_area_write(&self, l: &mut Ledger, (addr, rkey): (u64, u32), value: u64) -> bool {
        if l.hw_sq >= self.hw_sq_cap {
            return false;
        }
        let seq = l.next_seq;
        l.next_seq += 1;
        let w = HwWr {
            wr_id: seq,
            op: HwOp::Write {
                addr,
                rkey,
                imm: None,
            },
            sges: Sges::new(),
            inline: Some(Inline::from_slice(&value.to_ne_bytes())),
            fence: false,
        };
        // SAFETY: an inline request: the payload is copied at post time, no memory is
        // named after the call.
        #[allow(unsafe_code)]
        let r = unsafe { self.id.post_send(std::slice::from_ref(&w)) };
        if let Err((_, e)) = r {
            tracing::debug!("write of the peer's area failed: {e}");
            return false;
        }
        Self::record_internal(l, seq, false);
        true
    }

    // ----- completions ------------------------------------------------------------------

    /// Handles one device completion of this endpoint's queue pair (CQ lock held) that
    /// the common path ([`complete_common`](CompletionTarget::complete_common), tried
    /// first by the drain) declined, or an early receive's: the general path, which is
    /// right for any completion.
    #[inline]
    fn handle_completion(self: &Arc<Self>, cq: &CqInner, cst: &mut CqState, w: &Wc) {
        let mut l = self.lock();
        l.progress = l.progress.wrapping_add(1);
        self.handle_completion_fully(l, cq, cst, w);
    }

    /// The general path of a completion: errors, emulation, credits, held-back
    /// requests, and the common case too ([`complete_in_order`](Self::complete_in_order)
    /// handles that alone when the drain tries it first). Apart, so that the common case,
    /// inlined into the queue's drain, pays no large function's entry and exit.
    #[inline(never)]
    fn handle_completion_fully(
        self: &Arc<Self>,
        mut l: RankedGuard<'_, Ledger>,
        cq: &CqInner,
        cst: &mut CqState,
        w: &Wc,
    ) {
        let failed = w.status != wc::SUCCESS;
        let mut err = failed.then(|| {
            let (k, c) = status::error_of(w.status);
            (k, Some(c))
        });
        if self.dom.profile.length_as_malformed_wqe {
            let is_recv = w.wr_id & RECV_BIT != 0;
            let is_send = !is_recv
                && l.sq
                    .iter()
                    .find(|r| r.seq == w.wr_id)
                    .is_some_and(|r| r.is_send);
            if is_recv && w.status == wc::LOC_QP_OP_ERR {
                err = Some((
                    ErrorKind::LocalLength,
                    Some(ProviderCode::WcStatus(w.status)),
                ));
            } else if is_send && w.status == wc::REM_OP_ERR {
                err = Some((
                    ErrorKind::RemoteInvalidRequest,
                    Some(ProviderCode::WcStatus(w.status)),
                ));
            }
        }
        if w.status != wc::SUCCESS
            && w.status != wc::WR_FLUSH_ERR
            && !(self.dom.profile.infer_terminate && w.status == wc::LOC_QP_OP_ERR)
            && l.status == EndpointState::Connected
        {
            tracing::debug!(
                qp = self.qpn,
                status = status::name_of(w.status),
                vendor = w.vendor_err,
                "error completion: endpoint enters the error state"
            );
            let what = if w.wr_id & RECV_BIT != 0 {
                "a receive".to_string()
            } else {
                match l.sq.iter().find(|r| r.seq == w.wr_id).and_then(|r| r.user) {
                    Some(u) => format!("a {:?} request", u.opcode),
                    None => "a request of the provider's".to_string(),
                }
            };
            let (kind, code) = err.unwrap_or_else(|| {
                let (k, c) = status::error_of(w.status);
                (k, Some(c))
            });
            self.leave(&mut l, || {
                let e = Error::new(
                    kind,
                    format!(
                        "{what} completed with {} (vendor error {:#x}): endpoint in the error state",
                        status::name_of(w.status),
                        w.vendor_err
                    ),
                );
                EndpointEvent::Failed(match code {
                    Some(c) => e.with_code(c),
                    None => e,
                })
            });
        }
        if is_early(w.wr_id) {
            let j = (w.wr_id & 0xffff) as usize;
            if let Some(slot) = l.early.get_mut(j) {
                if slot.done.is_none() {
                    cq.release_internal(1);
                    slot.done = Some((w.byte_len, err));
                }
            }
            self.finish_early(&mut l, cst, j);
        } else if w.wr_id & RECV_BIT != 0 {
            let seq = w.wr_id & !RECV_BIT;
            let Some(pos) = l.rq.iter().position(|r| r.seq == seq) else {
                tracing::debug!(
                    qp = self.qpn,
                    seq,
                    "receive completion for a request already completed by the provider"
                );
                return;
            };
            let r = l.rq.remove(pos).expect("position is valid");
            // The send that landed here is the connection's `recvs_done`-th: its emulated
            // immediate, if any, is in that slot of our ring (placed before the send).
            let ordinal = l.recvs_done;
            l.recvs_done += 1;
            // The count first: it is due once in many receives, and `batching` reads the
            // peer's mode word.
            if credit_due(l.advertised, l.recvs_posted, l.recvs_done) && self.batching() {
                // The peer may run short before we post another receive.
                l.credit_dirty = true;
                self.send_credit(&mut l);
                self.note_blocked(&mut l);
            }
            let (opcode, byte_len, imm) = if failed {
                (Opcode::Recv, u64::from(w.byte_len), None)
            } else {
                self.received(w, ordinal)
            };
            cst.ready.push(Completion {
                context: r.context,
                opcode,
                status: err.map_or(Status::Success, |e| Status::Error(e.0)),
                provider_code: err.and_then(|e| e.1),
                byte_len,
                imm,
                ep_context: self.ep_context,
            });
        } else {
            let Some(pos) = l.sq.iter().position(|r| r.seq == w.wr_id) else {
                tracing::debug!(
                    qp = self.qpn,
                    seq = w.wr_id,
                    "send completion for a request already completed by the provider"
                );
                return;
            };
            if pos != 0 {
                // siw flushes its outstanding reads before the send queue.
                tracing::trace!(qp = self.qpn, pos, "send completion out of order");
            }
            if !failed && matches!(l.sq[pos].emu(), Some(EmuRec::Amo(_))) {
                // An emulated atomic's request left: it now waits for the reply (the
                // helper thread completes it, see `poll_emu`).
                if let Some(EmuRec::Amo(a)) = l.sq[pos].emu_mut() {
                    a.sent = true;
                }
                l.hw_sq -= 1;
            } else {
                let r = l.sq.remove(pos).expect("position is valid");
                l.hw_sq -= 1;
                if !failed && r.is_read && l.unconfirmed_tc.is_some_and(|(tc, _)| r.seq > tc) {
                    // RDMAP answers a Read Request only behind the requests before it:
                    // the peer took the transmit-complete one too.
                    l.unconfirmed_tc = None;
                }
                if let Some(EmuRec::Amo(a)) = r.emu() {
                    if l.amo_wait == Some(a.seq) {
                        self.set_amo_wait(&mut l, None);
                    }
                }
                if l.kill_after == Some(r.seq) {
                    // The reply to a refused atomic left: now the connection ends.
                    l.kill_after = None;
                    let _ = self.id.disconnect();
                }
                if failed {
                    tracing::debug!(
                        qp = self.qpn,
                        seq = w.wr_id,
                        status = status::name_of(w.status),
                        user = ?r.user.map(|u| (u.context, u.opcode)),
                        grouped = r.grouped,
                        "send-queue request failed"
                    );
                }
                if r.internal {
                    cq.release_internal(1);
                }
                // siw reports every transmit failure as LOC_QP_OP_ERR, including a send or
                // write cut off because the peer terminated the connection; our own entries
                // are valid by construction, so there it means what a flush means.
                let flushlike = w.status == wc::WR_FLUSH_ERR
                    || (self.dom.profile.infer_terminate && w.status == wc::LOC_QP_OP_ERR);
                if failed && r.user.is_none() && r.grouped && !flushlike {
                    // Hand the real error to the group's last record (completions may come out
                    // of order: siw flushes outstanding reads first).
                    if let Some(last) = l.sq.range_mut(pos..).find(|x| x.user.is_some()) {
                        last.note_group_err(err);
                    }
                }
                if failed && !flushlike {
                    l.attributed = true;
                }
                if let Some(u) = r.user {
                    l.user_sq -= 1;
                    let mut e = r.group_err().or(err);
                    if flushlike && r.group_err().is_none() {
                        match self.infer_cause(&mut l, u.opcode) {
                            Some(k) => e = Some((k, Some(ProviderCode::WcStatus(w.status)))),
                            None => {
                                e = Some((
                                    ErrorKind::Flushed,
                                    Some(ProviderCode::WcStatus(w.status)),
                                ))
                            }
                        }
                    }
                    self.push_user(cq, &mut cst.ready, u, e);
                }
            }
        }
        self.note_dead(&mut l);
        if std::ptr::eq(cq, Arc::as_ptr(&self.send_cq)) {
            // Records the device refused after part of their group reached it complete
            // now if their turn came (dead, everything unposted does).
            self.flush_unposted(&mut l, cst);
            if l.status == EndpointState::Connected {
                self.release_pending(&mut l);
                self.send_credit(&mut l);
            }
        }
    }

    /// What a successful receive reports: its opcode, length and immediate data, the
    /// device's or, on a connection that emulates immediate data, those of the record the
    /// peer placed for the connection's `ordinal`-th send (before the send).
    #[inline]
    fn received(&self, w: &Wc, ordinal: u64) -> (Opcode, u64, Option<u32>) {
        let mut opcode = if w.opcode == ffi::wc_opcode::RECV_RDMA_WITH_IMM {
            Opcode::RecvWriteWithImm
        } else {
            Opcode::Recv
        };
        let mut byte_len = u64::from(w.byte_len);
        let mut imm = w.imm;
        if let Some(e) = &self.emu {
            match ImmRec::read(
                e.watch.area(),
                e.slots,
                ordinal,
                self.dom.limits.max_msg_size,
            ) {
                Some(rec) if rec.kind == emu::IMM_WRITE && w.byte_len == 0 => {
                    opcode = Opcode::RecvWriteWithImm;
                    byte_len = rec.len;
                    imm = Some(rec.imm);
                }
                Some(rec) if rec.kind == emu::IMM_SEND => imm = Some(rec.imm),
                Some(rec) => tracing::warn!(
                    qp = self.qpn,
                    ?rec,
                    bytes = w.byte_len,
                    "peer's write-with-immediate record does not match its send: ignored"
                ),
                None => {}
            }
        }
        (opcode, byte_len, imm)
    }

    /// The common case of a completion, tried first by the queue's drain
    /// ([`complete_common`](CompletionTarget::complete_common)): a successful
    /// completion of the oldest request of its queue, on a connected endpoint with nothing
    /// held back and nothing owed. Does what the general path does for it, without the
    /// searches and checks that only errors, emulated atomics, held-back requests and owed
    /// credit updates need. Returns false, having changed nothing, for anything else.
    ///
    /// On a connection with credits and emulation (iWARP) that includes the receive's
    /// emulated immediate data and the count of receives completed, unless a batched
    /// credit update comes due with it: the general path sends that. In the guest this
    /// path was half of a receive's instructions on each side of an 8-byte send
    /// ping-pong (docs/benchmarks-record.md, thirty-third session).
    #[inline(always)]
    fn complete_in_order(
        &self,
        l: &mut Ledger,
        cq: &CqInner,
        ready: &mut Vec<Completion>,
        w: &Wc,
    ) -> bool {
        if l.status != EndpointState::Connected
            || l.pending > 0
            || l.credit_dirty
            || l.kill_after.is_some()
            || is_early(w.wr_id)
        {
            return false;
        }
        if w.wr_id & RECV_BIT != 0 {
            let seq = w.wr_id & !RECV_BIT;
            if l.rq.front().is_none_or(|r| r.seq != seq)
                || (credit_due(l.advertised, l.recvs_posted, l.recvs_done + 1) && self.batching())
            {
                return false;
            }
            // Taken apart as the send's record below: no drop call for the hold.
            let RqRec {
                context,
                _holds: Holds { first, more },
                ..
            } = l.rq.pop_front().expect("front exists");
            let ordinal = l.recvs_done;
            l.recvs_done += 1;
            let (opcode, byte_len, imm) = self.received(w, ordinal);
            drop(first);
            drop(more);
            ready.push(Completion {
                context,
                opcode,
                status: Status::Success,
                provider_code: None,
                byte_len,
                imm,
                ep_context: self.ep_context,
            });
        } else {
            if l.sq
                .front()
                .is_none_or(|r| r.seq != w.wr_id || r.rare.is_some())
            {
                return false;
            }
            // Taken apart as it leaves the queue: only the fields used are read, and only
            // the hold (and the rare part, none here) need dropping, so the record
            // is not copied whole for a drop call (in the guest every memory access and
            // call is dear: docs/benchmarks-record.md, thirty-second session).
            let SqRec {
                seq,
                internal,
                is_read,
                user,
                _holds: holds,
                rare,
                ..
            } = l.sq.pop_front().expect("front exists");
            debug_assert!(rare.is_none(), "checked above");
            l.hw_sq -= 1;
            if is_read && l.unconfirmed_tc.is_some_and(|(tc, _)| seq > tc) {
                // RDMAP answers a Read Request only behind the requests before it: the
                // peer took the transmit-complete one too.
                l.unconfirmed_tc = None;
            }
            if internal {
                cq.release_internal(1);
            }
            if let Some(u) = user {
                l.user_sq -= 1;
                self.push_user(cq, ready, u, None);
            }
            // The hold, taken apart too (its drop would be one more call): the first
            // region's counted reference, and the vector of any more (usually empty: most
            // requests gather from one region; up to `ffi::ONE_SGES` entries may name
            // others, and they are dropped here alike).
            let Holds { first, more } = holds;
            drop(first);
            drop(more);
        }
        // The general path's tail (flushing records that failed to post, posting held-back
        // ones, owed credit updates) has nothing to do here: a connected endpoint with
        // nothing held back has no record that failed to post (`fail_refused` ends the
        // connection), and none is owed.
        debug_assert!(
            l.sq.iter().all(|r| r.posted() || r.awaiting_reply()),
            "a connected endpoint with nothing held back holds an unposted record"
        );
        true
    }

    /// On devices that hide why a connection died: the kind to report for the first
    /// request flushed by a death that was neither our close nor the peer's.
    fn infer_cause(&self, l: &mut Ledger, op: Opcode) -> Option<ErrorKind> {
        if !self.dom.profile.infer_terminate || l.attributed || l.closed_locally {
            return None;
        }
        if self.peer_closed() {
            return None;
        }
        l.attributed = true;
        if let Some((_, tc)) = l.unconfirmed_tc {
            // The refused request may be the transmit-complete one, completed already:
            // the event says so, and no outstanding request takes the blame.
            let event = Self::unconfirmed_event("the connection died", tc);
            self.leave(l, || event);
            return None;
        }
        let kind = pdata::inferred_refusal(op);
        self.leave(l, || {
            EndpointEvent::Failed(Error::new(
                kind,
                format!(
                    "the connection died without the peer's close mark while a {op:?} was outstanding: the peer most likely refused it ({kind}; the device does not tell)"
                ),
            ))
        });
        Some(kind)
    }

    /// The failure of a connection that died while a transmit-complete request of
    /// opcode `tc` was unconfirmed: most likely the peer refused it or one after it.
    fn unconfirmed_event(how: &str, tc: Opcode) -> EndpointEvent {
        let kind = pdata::inferred_refusal(tc);
        EndpointEvent::Failed(Error::new(
            kind,
            format!(
                "{how} without the peer's close mark after a transmit-complete {tc:?} that nothing confirmed: the peer most likely refused it or a request after it ({kind}; the device does not tell which, so outstanding requests complete Flushed)"
            ),
        ))
    }

    #[inline]
    fn push_user(
        &self,
        cq: &CqInner,
        ready: &mut Vec<Completion>,
        u: UserRec,
        e: Option<(ErrorKind, Option<ProviderCode>)>,
    ) {
        match e {
            None if !u.signaled => cq.release(1),
            None => ready.push(Completion {
                context: u.context,
                opcode: u.opcode,
                status: Status::Success,
                provider_code: None,
                byte_len: u.byte_len,
                imm: None,
                ep_context: self.ep_context,
            }),
            Some((kind, code)) => ready.push(Completion {
                context: u.context,
                opcode: u.opcode,
                status: Status::Error(kind),
                provider_code: code,
                byte_len: 0,
                imm: None,
                ep_context: self.ep_context,
            }),
        }
    }

    /// Retires a send-queue record the device will never complete: gives back its ledger
    /// and completion-queue slots and reports its application request (Flushed, or the
    /// error of its group). Returns whether an application completion was pushed.
    fn retire(&self, l: &mut Ledger, cst: &mut CqState, r: &mut SqRec) -> bool {
        if r.unposted {
            // Retired in order from the front: its request is the first still unposted.
            l.pending -= 1;
            l.unposted.pop_front();
        }
        if r.internal {
            self.send_cq.release_internal(1);
        }
        let Some(u) = r.user.take() else {
            return false;
        };
        l.user_sq -= 1;
        let mut e = r
            .group_err()
            .or(r.failed())
            .unwrap_or((ErrorKind::Flushed, None));
        if r.deferrable && r.group_err().is_none() && r.failed().is_none() {
            // A send's delivery read, on a connection that ended. Held back (never
            // posted): the send was delivered if the peer's count says so. Else, held back
            // or posted and never completed by the device (siw leaves what was posted to a
            // queue pair already in the error state), the send is the first unconfirmed
            // request, which the peer most likely refused: as when the device flushes its
            // read.
            let held = if r.unposted { l.deferred.take() } else { None };
            if held.is_some_and(|d| self.peer_counts(l).received >= d.ordinal) {
                #[cfg(debug_assertions)]
                crate::fault::note_confirmed();
                self.push_user(&self.send_cq, &mut cst.ready, u, None);
                return true;
            }
            if held.is_some() || !r.unposted {
                if let Some(k) = self.infer_cause(l, u.opcode) {
                    e = (k, None);
                }
            }
        }
        if let (Some(EmuRec::Amo(a)), Some(link)) = (r.emu(), &self.emu) {
            // An emulated atomic whose connection died: its reply may have landed before
            // the connection ended (the peer refused it and disconnected, as RC hardware
            // would): report that, not a flush.
            if a.sent && l.amo_wait == Some(a.seq) {
                self.set_amo_wait(l, None);
                match AmoReply::read(link.watch.area()).filter(|x| x.seq == a.seq) {
                    Some(AmoReply {
                        result: Ok(old), ..
                    }) => {
                        a.result.buffer().write(a.off, &old.to_ne_bytes());
                        self.push_user(&self.send_cq, &mut cst.ready, u, None);
                        return true;
                    }
                    Some(AmoReply { result: Err(k), .. }) => {
                        l.attributed = true;
                        e = (k, None);
                    }
                    None => {}
                }
            }
        }
        self.push_user(&self.send_cq, &mut cst.ready, u, Some(e));
        true
    }

    /// Completes records that never reached the device, once everything posted before
    /// them has completed: Flushed when the endpoint is dead, else their post error.
    /// Called with the send CQ's lock held.
    fn flush_unposted(&self, l: &mut Ledger, cst: &mut CqState) {
        let mut any = false;
        while let Some(front) = l.sq.front() {
            if front.posted() {
                break;
            }
            let dead = l.status != EndpointState::Connected || l.torn_down;
            if front.failed().is_none() && !dead {
                break;
            }
            let mut r = l.sq.pop_front().expect("front exists");
            if self.retire(l, cst, &mut r) {
                any = true;
            } else if let Some(e) = r.failed() {
                if r.grouped {
                    if let Some(last) = l.sq.iter_mut().find(|x| x.user.is_some()) {
                        last.note_group_err(Some(e));
                    }
                }
            }
        }
        if any {
            self.send_cq.notify();
        }
    }

    /// Flushes held-back requests of a dead endpoint (takes the send CQ lock).
    fn flush_dead(&self) {
        let mut cst = self.send_cq.lock();
        let mut l = self.lock();
        if l.status != EndpointState::Connected || l.torn_down {
            self.flush_unposted(&mut l, &mut cst);
        }
    }

    // ----- state ------------------------------------------------------------------------

    /// Leaves `Connected` for the state `event` stands for, and reports `event` (ledger
    /// lock held). Every change of the endpoint's status goes through here, and the status
    /// only ever changes from `Connected`, so the endpoint reports exactly one event per
    /// change: the first cause wins, later ones (a close after a failure) change nothing.
    /// Returns whether the state changed.
    fn leave(&self, l: &mut Ledger, event: impl FnOnce() -> EndpointEvent) -> bool {
        if l.status != EndpointState::Connected {
            return false;
        }
        let ev = event();
        l.status = ev.state();
        tracing::debug!(qp = self.qpn, event = ?ev, "endpoint state changed");
        self.events.push(ev);
        true
    }

    /// Takes the oldest unread connection event.
    pub fn next_event(&self) -> Option<EndpointEvent> {
        self.events.next()
    }

    /// The descriptor readable while a connection event is unread.
    pub fn event_fd(&self) -> Result<std::os::fd::BorrowedFd<'_>> {
        self.events.fd()
    }

    /// What a queue pair that died under us means: the peer's close when it left its close
    /// mark (on iWARP a graceful close is told apart from a failure by that mark in our
    /// credit area), else a failure saying `how` it was noticed.
    ///
    /// On a device that hides why a connection died ([`Profile::infer_terminate`]), with
    /// an application request outstanding, the failure names the error that request's
    /// completion will carry ([`Self::infer_cause`], inferred the same way from the oldest
    /// one): the flushes are often reaped after the connection manager reported the end,
    /// and the event must not tell another story than the completion.
    ///
    /// [`Profile::infer_terminate`]: crate::Profile::infer_terminate
    fn dead_event(&self, l: &Ledger, how: &str) -> EndpointEvent {
        if self.peer_closed() {
            return EndpointEvent::PeerClosed;
        }
        if let Some((_, tc)) = l
            .unconfirmed_tc
            .filter(|_| !l.attributed && !l.closed_locally)
        {
            return Self::unconfirmed_event(how, tc);
        }
        let oldest = l.sq.iter().find_map(|r| r.user.map(|u| u.opcode));
        if let Some(op) = oldest
            .filter(|_| self.dom.profile.infer_terminate && !l.attributed && !l.closed_locally)
        {
            let kind = pdata::inferred_refusal(op);
            EndpointEvent::Failed(Error::new(
                kind,
                format!(
                    "{how} without the peer's close mark while a {op:?} was outstanding: the peer most likely refused it ({kind}; the device does not tell)"
                ),
            ))
        } else if self.iwarp() {
            EndpointEvent::Failed(Error::new(
                ErrorKind::RetryExceeded,
                format!(
                    "{how} without the peer's close mark: the peer's process ended, it terminated the connection, or a stack not of this framework closed it (siw does not tell which)"
                ),
            ))
        } else {
            EndpointEvent::Failed(Error::new(
                ErrorKind::RemoteOperation,
                format!(
                    "{how}: the peer refused one of its requests, or the connection failed (the device reports no completion for it here)"
                ),
            ))
        }
    }

    /// The state, refreshed from the queue pair (a remote error leaves no completion at
    /// the responder on InfiniBand transports: its queue pair just enters ERR).
    pub fn state(self: &Arc<Self>) -> EndpointState {
        let mut l = self.lock();
        let due = l.qp_checked.is_none_or(|t| t.elapsed() >= QP_STATE_EVERY);
        if l.status == EndpointState::Connected && !l.torn_down && due {
            l.qp_checked = Some(Instant::now());
            if let Ok(ffi::QPS_ERR) = self.id.qp_state() {
                // Connected (checked above): the event is the change.
                let event = self.dead_event(&l, "the queue pair entered the error state");
                self.leave(&mut l, || event);
                self.note_dead(&mut l);
                drop(l);
                self.flush_dead();
                return self.lock().status;
            }
        }
        l.status
    }

    /// The peer wrote its close mark: into the credit area, or, for a peer without credits
    /// (the tcp provider writes the mark too), into our delivery-read sink, which is the
    /// same kind of area. A truly foreign peer never writes it: its close reads as Error.
    fn peer_closed(&self) -> bool {
        match (&self.credit, &self.sink) {
            (Some(c), _) => c.peer_closed(),
            (None, Some((buf, _))) => area_word(buf, credit::CLOSED) != 0,
            (None, None) => false,
        }
    }

    /// The peer disconnected (connection-manager thread), or, with `failure`, the
    /// connection manager reported the connection failed (the device was removed).
    pub fn on_disconnected(self: &Arc<Self>, failure: Option<Error>) {
        let mut l = self.lock();
        if l.status == EndpointState::Connected {
            let event = match failure {
                Some(e) => EndpointEvent::Failed(e),
                None if self.iwarp() => self.dead_event(&l, "the connection ended"),
                None => EndpointEvent::PeerClosed,
            };
            tracing::debug!(qp = self.qpn, ?event, "peer disconnected");
            self.leave(&mut l, || event);
        }
        self.end_connection(l);
    }

    /// After the endpoint left `Connected`: disconnects the queue pair, registers the
    /// dead endpoint with the RNR thread (what the device never flushes), and flushes
    /// what was held back, once the ledger's lock is released.
    fn end_connection(self: &Arc<Self>, mut l: RankedGuard<'_, Ledger>) {
        if !l.torn_down {
            // InfiniBand transports: this moves our queue pair to ERR, flushing it. Under
            // the ledger lock: teardown destroys the queue pair under it too.
            let _ = self.id.disconnect();
        }
        self.note_dead(&mut l);
        drop(l);
        self.flush_dead();
    }

    /// Graceful close.
    pub fn close(self: &Arc<Self>) {
        let mut l = self.lock();
        let was = l.status == EndpointState::Connected && !l.torn_down;
        l.closed_locally = true;
        self.leave(&mut l, || EndpointEvent::Closed);
        self.note_dead(&mut l);
        let mut marker_seq = None;
        if was && self.credit.is_some() && self.send_cq.reserve_internal(1) {
            let seq = l.next_seq;
            if self.post_credit(&mut l, credit::CLOSED, 1) {
                marker_seq = Some(seq);
            } else {
                self.send_cq.release_internal(1);
            }
        }
        drop(l);
        if let Some(seq) = marker_seq {
            // Let the close mark leave before the connection closes (siw flushes a busy
            // send queue on disconnect).
            let deadline = Instant::now() + Duration::from_millis(200);
            while Instant::now() < deadline {
                {
                    let mut cst = self.send_cq.lock();
                    self.send_cq.drain(&mut cst);
                }
                if !self.lock().sq.iter().any(|r| r.seq == seq) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        if was {
            let l = self.lock();
            if !l.torn_down {
                let _ = self.id.disconnect();
            }
        }
        self.flush_dead();
    }

    /// Waits up to `timeout` until every application send-queue request posted before the
    /// call has completed: its completion queued (or, unsignaled and successful, its slot
    /// given back). Makes progress itself by reaping the send queue's device queue, which
    /// hands completions to their endpoints; held-back requests (credits), emulated
    /// atomics and a dead endpoint's flushes progress on the domain's helper thread
    /// meanwhile. Receives are not waited for.
    ///
    /// Lock order ([`crate::sync`]): reaping takes the queue's lock and, under it, this
    /// endpoint's ledger lock; so the ledger's lock is taken only between reaps, never
    /// held across one.
    pub fn drain(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let deadline = start + timeout;
        // Requests posted before the call: sequence numbers below the next one. A send's
        // delivery read held back for the peer's count goes now if the count is not there.
        let mark = {
            let mut l = self.lock();
            if let Some(d) = l.deferred.as_mut() {
                d.forced = true;
                self.release_pending(&mut l);
            }
            l.next_seq
        };
        let outstanding = || {
            self.lock()
                .sq
                .iter()
                .filter(|r| r.user.is_some() && r.seq < mark)
                .count()
        };
        let mut nap = Duration::from_micros(20);
        loop {
            self.send_cq.reap();
            let left = outstanding();
            if left == 0 {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::TimedOut,
                    format!(
                        "drain: {left} send-queue operation{} of this endpoint still outstanding after {timeout:?}",
                        if left == 1 { "" } else { "s" }
                    ),
                ));
            }
            // Short naps: the completion channel belongs to the application's waits (its
            // events are consumed by `wait` and `arm`), so a drain does not take them.
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// Final teardown (the application dropped the endpoint): close, destroy the queue
    /// pair, give back every reservation, drop every record.
    pub fn teardown(self: &Arc<Self>) {
        self.close();
        self.dom.cm.unregister(self.id.key());
        {
            let mut l = self.lock();
            l.torn_down = true;
            // After this no request of the queue pair touches memory.
            self.id.destroy_qp();
        }
        for cq in [&self.send_cq, &self.recv_cq] {
            let mut cst = cq.lock();
            cq.drain(&mut cst);
            if cst.qps.remove(&self.qpn).is_none() {
                continue;
            }
            let mut l = self.lock();
            if Arc::ptr_eq(cq, &self.send_cq) {
                for r in l.sq.drain_all() {
                    if r.internal {
                        cq.release_internal(1);
                    } else {
                        cq.release(1);
                    }
                }
                l.pending = 0;
                l.unposted.clear();
                l.user_sq = 0;
                l.deferred = None;
            }
            if Arc::ptr_eq(cq, &self.recv_cq) {
                let n = l.rq.len();
                l.rq.clear();
                cq.release(n);
            }
        }
    }
}

impl CompletionTarget<HwCq> for EpCore {
    #[inline]
    fn on_completion(self: &Arc<Self>, cq: &CqInner, st: &mut CqState, wc: &Wc) {
        self.handle_completion(cq, st, wc);
    }

    /// The ledger's common case ([`EpCore::complete_in_order`]); anything else (an
    /// error, emulation, credits, held-back requests) goes to `on_completion`, which
    /// takes the ledger's lock again (the first look changed nothing, not even the
    /// progress count).
    #[inline]
    fn complete_common(&self, cq: &CqInner, ready: &mut Vec<Completion>, wc: &Wc) -> bool {
        if wc.status != wc::SUCCESS {
            return false;
        }
        let mut l = self.lock();
        if !self.complete_in_order(&mut l, cq, ready, wc) {
            return false;
        }
        l.progress = l.progress.wrapping_add(1);
        true
    }

    fn serve(self: &Arc<Self>) {
        self.poll_emu(Patience::Wait);
    }

    /// A send whose delivery read is held back: completed once the peer's count confirms
    /// it, else the read released when it can wait no longer; then what waited behind it
    /// is posted.
    fn settle(self: &Arc<Self>, cq: &CqInner, st: &mut CqState) -> bool {
        let mut l = self.lock();
        if l.torn_down || !std::ptr::eq(cq, Arc::as_ptr(&self.send_cq)) {
            l.watched = false;
            return false;
        }
        // While the device refuses the first held-back request, the helper thread retries
        // it at its pace: not at every poll.
        if !self.resolve_deferred(&mut l, Some(st)) && l.refused.is_none() {
            self.release_pending(&mut l);
        }
        l.watched = l.deferred.is_some_and(|d| !d.released);
        l.watched
    }
}

/// What a pass of [`EpCore::poll_emu`] found.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct EmuPass {
    /// Work is in flight: look again soon.
    pub busy: bool,
    /// Keep serving the endpoint.
    pub keep: bool,
    /// A poll of the application looked at the area since the previous pass
    /// (`EmuWatch::look`).
    pub covered: bool,
    /// The look was skipped: another thread held the endpoint's lock ([`Patience::Skip`]).
    pub skipped: bool,
}

/// What the direct path of a post did ([`EpCore::post_direct`]).
enum Direct {
    /// The request is on the device.
    Posted,
    /// Not for the direct path (nothing changed): the ledger's path takes it.
    Declined,
    /// Its gather list is wrong.
    Invalid(Box<Error>),
    /// The device refused it; nothing reached the device.
    Refused(std::io::Error),
}

// Two words: returned in registers, not copied out of a slot as large as an `Error`.
const _: () = assert!(std::mem::size_of::<Direct>() <= 16);

/// What posting the first unposted group did.
enum Posted {
    /// The group is on the device.
    Yes,
    /// Held back (credits, queue room, an emulated atomic's reply).
    Later,
    /// Nothing reached the device: the group is still the unposted tail.
    Refused(Error),
    /// Part of the group reached the device, and the device refused the rest, which is
    /// now the unposted tail.
    Cut(Error),
}

/// A connected endpoint of a verbs provider. Dropping it closes the connection.
pub struct VerbsEndpoint<F: Flavor> {
    pub(crate) core: Arc<EpCore>,
    pub(crate) _f: PhantomData<fn() -> F>,
}

impl<F: Flavor> fmt::Debug for VerbsEndpoint<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsEndpoint")
            .field("provider", &F::NAME)
            .field("core", &self.core)
            .finish()
    }
}

impl<F: Flavor> Endpoint for VerbsEndpoint<F> {
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        self.core.post_send(wr)
    }
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        self.core.post_recv(wr)
    }
    fn state(&self) -> EndpointState {
        self.core.state()
    }
    fn peer_private_data(&self) -> Vec<u8> {
        self.core.peer_private.clone()
    }
    fn local_addr(&self) -> SocketAddr {
        self.core.local
    }
    fn peer_addr(&self) -> SocketAddr {
        self.core.peer
    }
    fn emulated(&self) -> Vec<String> {
        let p = &self.core.dom.profile;
        let emulation = |e: &fabric_api::Emulation| {
            self.core.emu.is_some()
                || !e
                    .ops
                    .intersects(OpSet::ATOMICS | OpSet::SEND_IMM | OpSet::WRITE_IMM)
        };
        if p.credits && self.core.foreign {
            return vec!["none: the peer is not of this framework, so no credit flow control (a send finding no posted receive breaks the connection), no delivery-complete sends and writes, and no dead-peer detection (its probes would be zero-length RDMA Reads, which siw answers with a stale length, breaking the connection)".to_string()];
        }
        if p.credits && self.core.credit.is_none() {
            let mut v = vec!["none but dead-peer detection: the peer is not of this framework, so no credit flow control (a send finding no posted receive breaks the connection) and no delivery-complete sends and writes".to_string()];
            if let Some(t) = self.core.dom.dead_peer {
                v.push(format!("dead-peer detection: zero-length RDMA Read probes; declared dead after {} ms without a sign of life", t.as_millis()));
            }
            return v;
        }
        p.emulated
            .iter()
            .filter(|e| emulation(e))
            .map(|e| format!("{}: {}", e.feature, e.how))
            .collect()
    }
    fn ops(&self) -> OpSet {
        let mut ops = self.core.dom.info.caps.ops;
        // Without the peer's credits (it is not of this framework) a send that finds no
        // posted receive is fatal on iWARP.
        if self.core.dom.profile.credits && self.core.credit.is_none() {
            ops -= OpSet::RNR_WAIT;
        }
        // Emulated atomics and immediate data need a peer that offered the emulation.
        if self.core.dom.emulates && self.core.emu.is_none() {
            ops -= OpSet::ATOMICS | OpSet::SEND_IMM | OpSet::WRITE_IMM;
        }
        ops
    }
    fn close(&self) -> Result<()> {
        self.core.close();
        Ok(())
    }
    fn drain(&self, timeout: Duration) -> Result<()> {
        self.core.drain(timeout)
    }
    fn next_event(&self) -> Option<EndpointEvent> {
        self.core.next_event()
    }
    fn event_fd(&self) -> Result<std::os::fd::BorrowedFd<'_>> {
        self.core.event_fd()
    }
}

impl<F: Flavor> Drop for VerbsEndpoint<F> {
    fn drop(&mut self) {
        self.core.teardown();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Every way records leave or join the send queue keeps its count of reads, against
    /// a scan (`has_reads` checks the two agree in debug builds; asserted here in any).
    #[test]
    fn the_send_queue_counts_its_reads_through_every_change() {
        let rec = |seq: u64, is_read: bool| SqRec {
            seq,
            unposted: false,
            grouped: false,
            user: None,
            internal: false,
            is_send: !is_read,
            is_read,
            deferrable: false,
            _holds: Holds::new(),
            rare: None,
        };
        let check = |q: &SqRecs| {
            assert_eq!(q.reads, q.iter().filter(|r| r.is_read).count());
            assert_eq!(q.has_reads(), q.reads > 0);
        };
        let mut q = SqRecs::default();
        check(&q);
        for seq in 0..12 {
            q.push_back(rec(seq, seq % 3 == 0));
            check(&q);
        }
        assert_eq!(q.reads, 4);
        q.insert(5, rec(100, true));
        q.insert(0, rec(101, false));
        check(&q);
        assert_eq!(q.remove(1).map(|r| r.is_read), Some(true));
        assert!(q.remove(99).is_none());
        check(&q);
        assert!(q.pop_front().is_some_and(|r| !r.is_read));
        assert!(q.pop_back().is_some());
        check(&q);
        while q.pop_front().is_some() {
            check(&q);
        }
        assert!(!q.has_reads() && q.pop_back().is_none() && q.pop_front().is_none());
        q.push_back(rec(1, true));
        q.push_back(rec(2, false));
        assert_eq!(q.drain_all().count(), 2);
        check(&q);
        q.push_back(rec(3, true));
        let taken = std::mem::take(&mut q);
        assert_eq!(taken.reads, 1);
        check(&q);
    }

    #[derive(Debug)]
    struct NoKeys;

    impl fabric_api::region::Registration for NoKeys {
        fn local_key(&self) -> u32 {
            0
        }
        fn remote_key(&self) -> u32 {
            0
        }
        fn revoke(&self) {}
    }

    #[test]
    fn holds_keep_every_region_in_order_until_dropped() {
        let regions: Vec<_> = (1..=4)
            .map(|n| {
                fabric_api::MemoryRegion::new(
                    Arc::new(fabric_api::Buffer::new(n * 8)),
                    Access::LOCAL_WRITE,
                    1,
                    Box::new(NoKeys),
                )
            })
            .collect();
        let lens = |h: &Holds| h.iter().map(|r| r.buffer().len()).collect::<Vec<_>>();
        let mut a = Holds::new();
        assert!(lens(&a).is_empty());
        a.push(regions[0].to_ref());
        a.push(regions[1].to_ref());
        let mut b = Holds::default();
        b.push(regions[2].to_ref());
        b.push(regions[3].to_ref());
        a.extend(b);
        assert_eq!(lens(&a), [8, 16, 24, 32]);
        // Each hold is a counted reference: the memory outlives the regions.
        let weak: Vec<_> = a
            .iter()
            .map(|r| Arc::downgrade(&r.shared_buffer()))
            .collect();
        drop(regions);
        assert!(weak.iter().all(|w| w.upgrade().is_some()));
        let owned: Vec<_> = a.into_iter().map(|r| r.buffer().len()).collect();
        assert_eq!(owned, [8, 16, 24, 32]);
        assert!(weak.iter().all(|w| w.upgrade().is_none()));
    }

    /// A record's rare part exists only once something rare is recorded, and keeps the
    /// first group error it is given.
    #[test]
    fn a_record_keeps_its_rare_part_apart_and_the_first_group_error() {
        let mut r = SqRec {
            seq: 7,
            unposted: false,
            grouped: true,
            user: None,
            internal: false,
            is_send: true,
            is_read: false,
            deferrable: false,
            _holds: Holds::new(),
            rare: SqRec::rare_with(None),
        };
        assert!(r.rare.is_none() && r.posted());
        r.note_group_err(None);
        assert!(r.rare.is_none(), "no error, nothing allocated");
        r.note_group_err(Some((ErrorKind::RemoteAccess, None)));
        r.note_group_err(Some((ErrorKind::Flushed, None)));
        assert_eq!(r.group_err(), Some((ErrorKind::RemoteAccess, None)));
        assert!(r.failed().is_none() && r.emu().is_none() && r.posted());
        r.set_failed((ErrorKind::QueueFull, None));
        assert_eq!(r.failed(), Some((ErrorKind::QueueFull, None)));
        assert!(
            !r.posted(),
            "a record that failed to post is not on the device"
        );
        let imm = SqRec::rare_with(Some(EmuRec::Imm(ImmRec {
            kind: emu::IMM_SEND,
            imm: 1,
            len: 0,
        })));
        assert!(imm.is_some_and(|x| x.emu.is_some() && x.failed.is_none()));
    }

    /// A receiver that batches credit updates (`credit_due`, looked at on every receive
    /// posted and every one filled) and a sender that sends whenever its credit allows;
    /// updates reach the sender one step after they are written. The receiver posts
    /// `burst` receives first, then `repost(filled)` more after each receive filled.
    /// Returns (messages delivered, updates written) once nothing moves, after checking
    /// that the sender stopped only for lack of messages or of receives posted, never
    /// with receives posted that it was not told of.
    fn run_credits(
        msgs: u64,
        burst: u64,
        mut repost: impl FnMut(u64) -> u64,
        cap: u64,
    ) -> (u64, u64) {
        let (mut posted, mut done, mut advertised, mut updates) = (0u64, 0u64, 0u64, 0u64);
        let (mut seen, mut in_flight, mut sent) = (0u64, None::<u64>, 0u64);
        let post =
            |n: u64, posted: &mut u64, advertised: &mut u64, updates: &mut u64, done: u64| {
                for _ in 0..n {
                    if *posted - done >= cap {
                        break;
                    }
                    *posted += 1;
                    if credit_due(*advertised, *posted, done) {
                        *advertised = *posted;
                        *updates += 1;
                    }
                }
            };
        post(burst, &mut posted, &mut advertised, &mut updates, done);
        for _ in 0..msgs * 4 + 16 {
            if let Some(a) = in_flight.take() {
                seen = seen.max(a);
            }
            in_flight = Some(advertised);
            if sent < msgs && sent < seen {
                sent += 1;
                // The send lands in the next posted receive.
                assert!(done < posted, "a send arrived with no receive posted");
                done += 1;
                if credit_due(advertised, posted, done) {
                    advertised = posted;
                    updates += 1;
                }
                let n = repost(done);
                post(n, &mut posted, &mut advertised, &mut updates, done);
            }
        }
        assert!(
            sent == msgs || done == posted,
            "stalled: {sent} of {msgs} sent, {posted} posted, {advertised} announced"
        );
        (done, updates)
    }

    #[test]
    fn a_working_endpoint_stays_watched_at_the_slow_pace_and_an_idle_one_leaves() {
        // Receives announced or not, an application at work: the slower pace, and no
        // leaving (which would bring the quickest pace back at its next repost).
        assert_eq!(Retry::after_look(true, true), Retry::Watching);
        assert_eq!(Retry::after_look(false, true), Retry::Watching);
        // Work left and no sign of the application (or requests held, an update owed):
        // the quicker pace.
        assert_eq!(Retry::after_look(true, false), Retry::Again);
        // Nothing left and nothing moved since the previous look: out of the list.
        assert_eq!(Retry::after_look(false, false), Retry::Done);
    }

    #[test]
    fn batched_credit_updates_never_leave_a_sender_without_credit_and_are_few() {
        // One receive at a time: an update per receive posted (101: the last is reposted
        // after the 100th message), as without batching.
        assert_eq!(run_credits(100, 1, |_| 1, 1024), (100, 101));
        // A window of 64, reposted as filled: one update per 32 receives, after the
        // ramp (1, 2, 4, ... 64).
        let (done, updates) = run_credits(3200, 64, |_| 1, 1024);
        assert_eq!(done, 3200);
        assert!((100..=110).contains(&updates), "{updates} updates");
        // 200 posted at once, none reposted: the count stops short of 200 when the
        // receives are posted (the last update said 128), and the updates due as they
        // are filled give the sender the rest.
        assert_eq!(run_credits(500, 200, |_| 0, 1024).0, 200);
        // Receives posted in odd batches after fills, and a queue limit: every receive
        // posted is filled (`run_credits` checks).
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for cap in [1, 3, 17, 256] {
            let burst = (x % 40) + 1;
            let (done, _) = run_credits(
                5000,
                burst,
                |_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % 3
                },
                cap,
            );
            assert!(done >= burst.min(cap), "cap {cap}: {done} filled");
        }
        // Whatever is posted is filled: 10, then 2 more at every third fill, runs out at
        // 26 (10 + 2 * (24 / 3) receives, the 27th fill needs one more).
        let (done, _) = run_credits(1000, 10, |d| if d % 3 == 0 { 2 } else { 0 }, 1024);
        assert_eq!(done, 26);
    }

    fn wr(op: HwOp, sges: Vec<Sge>) -> Planned {
        smallvec![(
            HwWr {
                wr_id: 0,
                op,
                sges: Sges::from_vec(sges),
                inline: None,
                fence: true,
            },
            None,
        )]
    }

    #[test]
    fn small_sends_and_writes_go_inline_on_siw_when_the_device_allows() {
        assert!(!inlines_on_siw(0, 80), "nothing to copy");
        assert!(inlines_on_siw(1, 80));
        assert!(inlines_on_siw(32, 80));
        assert!(
            !inlines_on_siw(33, 80),
            "siw sends longer payloads from the pages"
        );
        assert!(inlines_on_siw(16, 16));
        assert!(
            !inlines_on_siw(17, 16),
            "never more than the device takes inline"
        );
        assert!(!inlines_on_siw(8, 0));
    }

    #[test]
    fn small_page_crossings_are_split_or_sent_inline_and_nothing_else_changes() {
        let sge = |addr, len| Sge { addr, len, lkey: 9 };
        let read = |addr| HwOp::Read { addr, rkey: 5 };
        let write = |addr| HwOp::Write {
            addr,
            rkey: 5,
            imm: None,
        };
        let copy = |s: &Sge| Ok(Inline::from_elem(0xab, s.len as usize));
        // A 24-byte read of the peer's [4088, 4112): two reads at the remote boundary,
        // the sink split to match.
        let out =
            avoid_small_page_crossing(wr(read(0x7000 + 4088), vec![sge(0x100, 24)]), copy).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].0.op, read(0x7000 + 4088));
        assert_eq!(out[0].0.sges[..], [sge(0x100, 8)]);
        assert_eq!(out[1].0.op, read(0x8000));
        assert_eq!(out[1].0.sges[..], [sge(0x108, 16)]);
        // A 20-byte write from local [0x1ff8, 0x200c): split at the local boundary, the
        // second piece unfenced.
        let out = avoid_small_page_crossing(wr(write(0x50), vec![sge(0x1ff8, 20)]), copy).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].0.sges[..], [sge(0x1ff8, 8)]);
        assert_eq!((out[1].0.op, out[1].0.fence), (write(0x58), false));
        assert_eq!(out[1].0.sges[..], [sge(0x2000, 12)]);
        // A crossing send goes inline.
        let out =
            avoid_small_page_crossing(wr(HwOp::Send { imm: None }, vec![sge(0x2ff0, 32)]), copy)
                .unwrap();
        assert_eq!(out[0].0.inline.as_deref(), Some(&[0xab; 32][..]));
        // Untouched: larger than 32 bytes, not crossing, several entries, ending exactly at
        // the boundary.
        for (op, sges) in [
            (read(4080), vec![sge(0, 33)]),
            (read(4064), vec![sge(0, 32)]),
            (read(4090), vec![sge(0, 3), sge(8, 3)]),
            (write(0), vec![sge(4064, 32)]),
        ] {
            let out = avoid_small_page_crossing(wr(op, sges.clone()), copy).unwrap();
            assert_eq!(out.len(), 1);
            assert_eq!((out[0].0.op, &out[0].0.sges[..]), (op, &sges[..]));
            assert!(out[0].0.inline.is_none());
        }
    }
}
