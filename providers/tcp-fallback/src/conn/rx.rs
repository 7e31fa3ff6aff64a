//! The receive state machine: bytes from a non-blocking socket into a prefetch buffer,
//! whole FPDUs out of it, each handled at once (writes placed, reads answered, atomics
//! executed, sends matched, acks and responses credited).
//!
//! An FPDU is at most 64 KiB plus framing (MPA's 16-bit length), so the prefetch buffer
//! always holds a whole one; one `recv` pulls as many small FPDUs as have arrived. Handling
//! never blocks: when the endpoint cannot take an FPDU yet (no receive and the unexpected
//! buffer full, or too much output owed to the peer), the machine stops reading, leaves
//! the FPDU in the buffer, and TCP back-pressure holds the sender; posting a receive, or
//! the output draining, resumes it. Every placement into application memory happens under
//! the endpoint lock while the operation it belongs to is still outstanding, by
//! word-atomic copies ([`fabric_api::Buffer::write`]).
//!
//! **Direct placement.** Without MPA CRCs, the payload of a large tagged RDMA Write
//! (from [`DIRECT_MIN`] bytes) goes from the socket straight into the target memory
//! ([`fabric_api::Buffer::recv_into`], the kernel writing it as a NIC's DMA would), with no
//! staging copy: the header is validated and the STag checked for the whole range before
//! the first byte, and again before every `recv`, so a deregistration stops placement as it
//! does between FPDUs. With CRCs on, every FPDU is staged whole and checked before
//! anything of it is placed.

use std::io::{self, Read};
use std::os::fd::AsFd;
use std::sync::atomic::Ordering as AtomicOrdering;

use fabric_api::{Access, EndpointEvent, EndpointState, Error, ErrorKind, Opcode, ProviderCode};

use fabric_api::emu_wire::{self, AmoReply, AmoReq, ImmRec};

use super::{
    scatter, Arrived, Conn, Resp, State, Unit, TX_QUEUE_LIMIT, UNEXPECTED_ENTRY_COST,
    UNEXPECTED_LIMIT,
};
use crate::setup::IRD;
use crate::tx::{Kind, OutMsg, Payload};
use crate::wire::ddp::{
    self, atomic_op, opcode, qn, term, AtomicRequest, AtomicResponse, Header, ReadRequest,
    Terminate, TerminatedHeader,
};
use crate::wire::mpa::{self, features};
use crate::wire::WireError;

/// Prefetch buffer: room for several whole FPDUs of the largest size.
const RX_BUF: usize = 256 << 10;

/// Smallest RDMA Write payload (one FPDU's) placed directly from the socket.
const DIRECT_MIN: usize = 8 << 10;

/// The most the first read of a receive pass asks for. A poll of a one-connection set
/// reads its socket on every call, mostly finding it empty (`PollSet::run_now`), and
/// helgrind's system-call wrapper costs in proportion to the buffer handed to `recv`
/// (about 3 ms per call for the whole 256 KiB prefetch buffer). A ping-pong's message fits
/// in it; a large write's first FPDU is then read only up to here before the rest of it
/// goes direct (`start_direct`), and anything else goes on with the whole room.
const FIRST_READ: usize = 16 << 10;

/// Non-write FPDUs in a row that leave a stream of large writes streaming (see `Rx::
/// streaming`): room for a notification and its acks between two segment writes.
const STREAM_GRACE: u8 = 4;

/// An RDMA Write FPDU whose payload is arriving straight into the target memory.
#[derive(Debug)]
struct Direct {
    stag: u32,
    /// Target address of the next byte.
    to: u64,
    /// Payload bytes still to come.
    left: usize,
    /// The FPDU's whole payload.
    len: usize,
    last: bool,
}

/// Why the receive side stopped for good.
#[derive(Debug)]
pub(super) enum RxEnd {
    /// The peer closed the stream (graceful close or process exit).
    Eof,
    /// The stream failed.
    Io(io::Error),
    /// The peer sent something we must refuse: tell it with this Terminate.
    Violation(Terminate, String),
    /// The peer sent a Terminate.
    PeerTerminate(Terminate, Option<TerminatedHeader>),
    /// We closed or failed locally.
    Local,
}

pub(super) fn violation(t: Terminate, detail: impl Into<String>) -> RxEnd {
    RxEnd::Violation(t, detail.into())
}

fn wire_violation(e: WireError) -> RxEnd {
    wire_violation_in(e, false)
}

/// A decoding error as the Terminate RFC 5040 / 5041 name for it (`tagged`: the DDP
/// control field's T bit, which decides the DDP error type).
fn wire_violation_in(e: WireError, tagged: bool) -> RxEnd {
    let t = match e.field {
        "RDMAP opcode" => term::INVALID_OPCODE,
        "DDP version" if tagged => term::DDP_VERSION_TAGGED,
        "DDP version" => term::DDP_VERSION_UNTAGGED,
        "RDMAP version" => term::RDMAP_VERSION,
        _ => term::FPDU,
    };
    violation(t, e.to_string())
}

/// What a pass of the receive machine ([`Conn::rx_step`]) came to.
pub(super) enum Step {
    /// Nothing was buffered and nothing arrived: the pass read an empty socket and did
    /// nothing else (no lock taken, nothing queued for the peer).
    Quiet,
    /// The pass ran; `deferred`: the delivery acks of what it placed stay owed
    /// ([`Conn::flush_acks`]).
    Ran { deferred: bool },
}

/// What handling an FPDU came to.
enum Flow {
    /// Handled: consume it.
    Done,
    /// Not now: leave it in the buffer and stop reading until something frees up.
    Blocked,
}

type Handled = Result<Flow, RxEnd>;

/// The incoming message in progress.
#[derive(Debug)]
enum Current {
    /// Being placed into the receive in `State::placing`, `got` bytes so far.
    Matched { got: usize },
    /// Being buffered as unexpected (no receive was posted when it began).
    Buffered(Vec<u8>),
}

/// Where the receive machine stands between FPDUs.
#[derive(Debug)]
struct Parse {
    crc: bool,
    expect_msn: [u32; qn::COUNT],
    mo: [usize; qn::COUNT],
    current: Option<Current>,
    write_len: u64,
    last_write_len: u64,
    rtr_seen: bool,
    /// Sends that arrived (the ordinal of the next one: the emulation's immediate data).
    sends_in: u64,
}

/// The receive machine of one connection.
#[derive(Debug)]
pub(super) struct Rx {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    p: Parse,
    /// The connection is over: nothing more is read.
    done: bool,
    /// A write being placed directly.
    direct: Option<Direct>,
    /// Bytes still to drop from the stream: the trailer (pad, CRC field) of a write
    /// placed directly.
    skip: usize,
    /// The last FPDU was placed directly: while large writes stream in, the next read
    /// takes only the next FPDU's header, so that its payload goes direct too instead of
    /// into the prefetch buffer.
    streaming: bool,
    /// FPDUs other than writes handled in a row while streaming.
    between: u8,
    /// What the first read of this pass returned, when [`Conn::rx_step`] made it before
    /// taking the endpoint's lock (the buffer was empty): `rx_run`'s first read.
    early: Option<io::Result<usize>>,
}

impl Rx {
    pub(super) fn new(crc: bool) -> Rx {
        Rx {
            buf: vec![0; RX_BUF],
            start: 0,
            end: 0,
            p: Parse {
                crc,
                expect_msn: [1; qn::COUNT],
                mo: [0; qn::COUNT],
                current: None,
                write_len: 0,
                last_write_len: 0,
                rtr_seen: false,
                sends_in: 0,
            },
            done: false,
            direct: None,
            skip: 0,
            streaming: false,
            between: 0,
            early: None,
        }
    }
}

/// The length of the whole FPDU at the front of `b` (MPA length, ULPDU, pad, CRC), once it
/// has all arrived.
fn complete_fpdu(b: &[u8]) -> Result<Option<(usize, usize, usize)>, RxEnd> {
    if b.len() < 4 {
        return Ok(None);
    }
    let ulpdu = usize::from(u16::from_be_bytes([b[0], b[1]]));
    let hdr_len = Header::len_for_ctrl(u16::from_be_bytes([b[2], b[3]]));
    if ulpdu < hdr_len {
        return Err(violation(
            term::FPDU,
            format!("MPA ULPDU length {ulpdu} shorter than its DDP header ({hdr_len})"),
        ));
    }
    let total = 2 + ulpdu + mpa::pad_len(ulpdu) + 4;
    Ok((b.len() >= total).then_some((total, ulpdu, hdr_len)))
}

impl Conn {
    /// Reads and handles until the socket would block, the machine waits for room, or the
    /// connection ends (then the endpoint fails or disconnects, as the end says). With
    /// `defer`, the batch's delivery acks may stay owed ([`Conn::flush_acks`]); returns
    /// whether they did.
    pub(super) fn rx_step(&self, rx: &mut Rx, defer: bool) -> Step {
        let mut deferred = false;
        if defer
            && !rx.done
            && rx.direct.is_none()
            && rx.skip == 0
            && !rx.streaming
            && rx.start == rx.end
        {
            // The application's pass with nothing buffered starts with a read, made here
            // before the endpoint's lock is taken. When the socket is empty (a polling
            // application's usual pass) that read is the whole pass: the batch it would
            // open and close is empty, and an empty batch of the application's changes
            // nothing (acks owed stay held as the pass that deferred them left them, and
            // noted in the poll sets). Other passes (the progress thread's, a close's) go
            // on, since their end sends what is held back. Whatever else the read returns,
            // data, the end of the stream or an error, is `rx_run`'s first read below;
            // the room is the one `rx_run` would ask for (`FIRST_READ` of an empty buffer).
            rx.start = 0;
            rx.end = 0;
            match (&self.sock).read(&mut rx.buf[..FIRST_READ]) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Quiet,
                r => rx.early = Some(r),
            }
        }
        if !rx.done {
            let over = {
                let mut st = self.lock();
                // Acks of what this batch places and matches go out together at its end.
                st.batching = st.status == EndpointState::Connected;
                !st.batching
            };
            let res = if over {
                Err(RxEnd::Local)
            } else {
                let res = self.rx_run(rx);
                deferred = self.flush_acks(&mut self.lock(), defer && res.is_ok());
                res
            };
            match res {
                Ok(()) => return Step::Ran { deferred },
                Err(end) => {
                    rx.early = None;
                    rx.done = true;
                    self.rx_end(end);
                }
            }
        }
        if self.graceful.load(AtomicOrdering::SeqCst) {
            self.rx_drain(rx);
        }
        Step::Ran { deferred: false }
    }

    /// After the end: reads and drops whatever the peer still sends, so that the socket
    /// ends with a close rather than a reset (which could destroy output the peer has not
    /// read yet), until the peer closes too.
    fn rx_drain(&self, rx: &mut Rx) {
        loop {
            match (&self.sock).read(&mut rx.buf) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }

    fn rx_run(&self, rx: &mut Rx) -> Result<(), RxEnd> {
        self.rx_blocked.store(false, AtomicOrdering::SeqCst);
        // The last read returned less than it asked for: the socket was empty then, so
        // once what arrived is handled the pass ends without one more `recv` to see
        // EAGAIN. Safe with edge-triggered epoll: every later arrival raises a new edge (a
        // FIN or reset that came before the read is seen by the event: `Conn::hung_up`).
        let mut drained = false;
        let mut first = true;
        loop {
            if rx.direct.is_some() {
                if self.rx_direct(rx)? {
                    continue;
                }
                return Ok(());
            }
            let drop = rx.skip.min(rx.end - rx.start);
            rx.start += drop;
            rx.skip -= drop;
            while let Some((total, ulpdu, hdr_len)) = complete_fpdu(&rx.buf[rx.start..rx.end])? {
                // Output owed to the peer (acks, responses) must leave before we read more.
                if self.tx.lock().expect("tx poisoned").queue.len() >= TX_QUEUE_LIMIT {
                    self.rx_blocked.store(true, AtomicOrdering::SeqCst);
                    return Ok(());
                }
                let f = &rx.buf[rx.start..rx.start + total];
                if rx.p.crc {
                    let c = crc32c::crc32c(&f[..total - 4]);
                    if mpa::crc_bytes(c) != f[total - 4..] {
                        return Err(violation(term::CRC, "MPA CRC mismatch"));
                    }
                }
                let tagged = f[2] & 0x80 != 0;
                let hdr =
                    Header::decode(&f[2..2 + hdr_len]).map_err(|e| wire_violation_in(e, tagged))?;
                // A write's short last FPDU does not end the stream of writes, and neither
                // do the few small messages that often ride between two writes (a
                // notification of the write before, acks): a ring of segment writes, each
                // followed by a note, keeps its payloads going direct. More than
                // `STREAM_GRACE` of them in a row end it, so a stream of small messages is
                // read in prefetching batches again.
                if matches!(
                    hdr,
                    Header::Tagged {
                        opcode: opcode::WRITE,
                        ..
                    }
                ) {
                    rx.between = 0;
                } else if rx.streaming {
                    rx.between += 1;
                    rx.streaming = rx.between <= STREAM_GRACE;
                }
                if !self.heard.load(AtomicOrdering::Relaxed) {
                    self.peer_spoke();
                }
                match self.handle(&mut rx.p, hdr, &f[2 + hdr_len..2 + ulpdu])? {
                    Flow::Done => rx.start += total,
                    Flow::Blocked => {
                        self.rx_blocked.store(true, AtomicOrdering::SeqCst);
                        return Ok(());
                    }
                }
            }
            if rx.skip == 0 && !rx.p.crc && self.start_direct(rx)? {
                continue;
            }
            if drained && !self.hangup.load(AtomicOrdering::SeqCst) {
                return Ok(());
            }
            if rx.start == rx.end {
                rx.start = 0;
                rx.end = 0;
            } else if rx.end == rx.buf.len() {
                rx.buf.copy_within(rx.start..rx.end, 0);
                rx.end -= rx.start;
                rx.start = 0;
            }
            // Room is never zero here: the buffer holds at most one incomplete FPDU
            // (FPDUs are far smaller than the buffer) once the complete ones are handled.
            debug_assert!(rx.end < rx.buf.len());
            let room = if rx.streaming {
                // Only the rest of the front FPDU (or of its header, and the trailer still
                // to drop): the next large write's payload must stay in the socket.
                let have = rx.end - rx.start;
                let want = if have >= 4 {
                    let ulpdu =
                        usize::from(u16::from_be_bytes([rx.buf[rx.start], rx.buf[rx.start + 1]]));
                    2 + ulpdu + mpa::trailer_len(ulpdu)
                } else {
                    2 + ddp::TAGGED_LEN
                };
                (rx.skip + want.saturating_sub(have)).min(rx.buf.len() - rx.end)
            } else {
                rx.buf.len() - rx.end
            };
            // The pass's first read asks for at most `FIRST_READ`; a full one goes on
            // with the whole room.
            let room = if first { room.min(FIRST_READ) } else { room };
            first = false;
            let got = match rx.early.take() {
                Some(r) => r,
                None => (&self.sock).read(&mut rx.buf[rx.end..rx.end + room]),
            };
            match got {
                Ok(0) if rx.start < rx.end => {
                    return Err(violation(
                        term::STREAM_LOST,
                        format!(
                            "the stream ended inside an FPDU ({} bytes of it arrived)",
                            rx.end - rx.start
                        ),
                    ))
                }
                Ok(0) => return Err(RxEnd::Eof),
                Ok(n) => {
                    fabric_api::sync::stream_received(self.sock.as_fd(), true);
                    rx.end += n;
                    drained = n < room;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RxEnd::Io(e)),
            }
        }
    }

    /// Starts placing the incomplete FPDU at the front of the buffer directly, if it is a
    /// large RDMA Write whose header has arrived (see the module docs): its STag is
    /// checked for the whole payload, what arrived of the payload is placed, and the rest
    /// will be received into the target. Returns whether it started.
    fn start_direct(&self, rx: &mut Rx) -> Result<bool, RxEnd> {
        let b = &rx.buf[rx.start..rx.end];
        if b.len() < 4 || b[2] & 0x80 == 0 {
            return Ok(false);
        }
        let ulpdu = usize::from(u16::from_be_bytes([b[0], b[1]]));
        let hdr_len = Header::len_for_ctrl(u16::from_be_bytes([b[2], b[3]]));
        // complete_fpdu refused a ULPDU shorter than its header.
        let payload = ulpdu - hdr_len;
        if payload < DIRECT_MIN || b.len() < 2 + hdr_len {
            return Ok(false);
        }
        let have = b.len() - 2 - hdr_len;
        if have >= payload {
            return Ok(false); // only the trailer is missing
        }
        if self.tx.lock().expect("tx poisoned").queue.len() >= TX_QUEUE_LIMIT {
            return Ok(false); // output owed first: the staged path waits for it
        }
        let hdr = Header::decode(&b[2..2 + hdr_len]).map_err(|e| wire_violation_in(e, true))?;
        let Header::Tagged {
            opcode: opcode::WRITE,
            stag,
            to,
            last,
        } = hdr
        else {
            return Ok(false);
        };
        let t = self
            .keys
            .lookup(stag, to, payload as u64, Access::REMOTE_WRITE)
            .map_err(|t| {
                violation(
                    t,
                    format!("RDMA Write of {payload} bytes to STag {stag:#x} at {to:#x} refused"),
                )
            })?;
        if !self.heard.load(AtomicOrdering::Relaxed) {
            self.peer_spoke();
        }
        t.buffer.write(t.offset, &b[2 + hdr_len..]);
        rx.direct = Some(Direct {
            stag,
            to: to + have as u64,
            left: payload - have,
            len: payload,
            last,
        });
        rx.skip = mpa::trailer_len(ulpdu);
        rx.start = 0;
        rx.end = 0;
        Ok(true)
    }

    /// Receives more of a directly placed write; `false` when the socket has nothing.
    fn rx_direct(&self, rx: &mut Rx) -> Result<bool, RxEnd> {
        let d = rx.direct.as_mut().expect("a direct write");
        // Checked again before every receive: a deregistration stops placement here.
        let t = self
            .keys
            .lookup(d.stag, d.to, d.left as u64, Access::REMOTE_WRITE)
            .map_err(|t| {
                violation(
                    t,
                    format!(
                        "RDMA Write of {} bytes to STag {:#x} refused after {} bytes: the region went away",
                        d.len,
                        d.stag,
                        d.len - d.left
                    ),
                )
            })?;
        // The FPDU's trailer and the next FPDU's length and tagged header come in the same
        // `recvmsg`, into the (empty) staging buffer: the next write's payload stays in the
        // socket for its own direct placement, one system call per FPDU.
        debug_assert_eq!((rx.start, rx.end), (0, 0));
        let spill = (rx.skip + 2 + ddp::TAGGED_LEN).min(rx.buf.len());
        match t.buffer.recv_into_spill(
            self.sock.as_fd(),
            t.offset,
            d.left,
            &mut rx.buf[..spill],
            libc::MSG_DONTWAIT,
        ) {
            Ok(0) => Err(violation(
                term::STREAM_LOST,
                format!(
                    "the stream ended inside an FPDU ({} of its {} payload bytes arrived)",
                    d.len - d.left,
                    d.len
                ),
            )),
            Ok(n) => {
                let beyond = n.saturating_sub(d.left);
                let n = n - beyond;
                rx.end = beyond;
                d.to += n as u64;
                d.left -= n;
                if d.left == 0 {
                    let (len, last, stag) = (d.len, d.last, d.stag);
                    rx.direct = None;
                    rx.streaming = true;
                    rx.between = 0;
                    self.emu_written(stag)?;
                    self.written(&mut rx.p, len, last);
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(RxEnd::Io(e)),
        }
    }

    /// Accounting after an RDMA Write FPDU of `len` bytes was placed: the write's length,
    /// and its delivery ack after the last FPDU.
    fn written(&self, r: &mut Parse, len: usize, last: bool) {
        r.write_len += len as u64;
        if last {
            r.last_write_len = std::mem::take(&mut r.write_len);
            if self.neg.has(features::ACKS) {
                let mut st = self.lock();
                self.send_ack(&mut st, 1);
            }
            self.credits_may_have_grown();
        }
    }

    /// The connection is over from the receive side: fail or disconnect the endpoint.
    fn rx_end(&self, end: RxEnd) {
        let mut st = self.lock();
        if st.status != EndpointState::Connected {
            // Whatever arrives after a local close or error (a late ack, say) is not the
            // peer's fault: the connection is already over. What is still queued (a
            // Terminate, the rest of an FPDU a close began) goes out, then the stream ends.
            drop(st);
            self.close_tx(true);
            return;
        }
        match end {
            RxEnd::Violation(t, detail) => {
                tracing::warn!(peer = %self.peer, "peer violated the protocol or an access right: {detail}; sending Terminate {t:?}");
                // A receive taken for a message that will never finish is in
                // `st.placing`: enter_error flushes it first.
                let err = Error::new(
                    t.error_kind(),
                    format!("the peer violated the protocol or an access right: {detail}"),
                )
                .with_code(t.code());
                self.send_terminate(&mut st, t);
                self.enter_error(&mut st, None, EndpointEvent::Failed(err));
                drop(st);
                self.close_tx(true);
            }
            RxEnd::PeerTerminate(t, named) => {
                tracing::debug!(peer = %self.peer, "peer terminated the connection: {t:?}, naming {named:?}");
                let head = (t.error_kind(), Some(t.code()));
                let blamed = match named {
                    Some(TerminatedHeader::Tagged { stag, to }) => {
                        Self::blame_write(&mut st, stag, to, head)
                    }
                    _ => false,
                };
                // Unless a write took the error, the oldest unfinished request does.
                let err = Error::new(head.0, format!("the peer terminated the connection: {t:?}"))
                    .with_code(t.code());
                self.enter_error(
                    &mut st,
                    (!blamed).then_some(head),
                    EndpointEvent::Failed(err),
                );
                drop(st);
                self.close_tx(false);
            }
            RxEnd::Eof | RxEnd::Io(_) | RxEnd::Local => {
                let mut head = match &end {
                    RxEnd::Io(e) if e.kind() == io::ErrorKind::TimedOut => Some((
                        ErrorKind::RetryExceeded,
                        e.raw_os_error().map(ProviderCode::Errno),
                    )),
                    _ => None,
                };
                tracing::debug!(peer = %self.peer, "connection ended: {end:?}");
                // A peer on this framework's iwarp provider marks a graceful close in our
                // area before it disconnects. Its device may refuse a request with a
                // Terminate and reset the connection before the Terminate leaves (siw, seen
                // in about 1 of 20 runs of `fault.deregister_while_peer_writes`): an end
                // without the mark while a request is unfinished is most likely that
                // request refused, as the iwarp provider infers in the other direction.
                let inferred = match (&end, &self.neg.area) {
                    (RxEnd::Eof | RxEnd::Io(_), Some(area))
                        if head.is_none()
                            && self.neg.peer_area.is_some()
                            && !area.peer_closed() =>
                    {
                        self.drain_sq(&mut st);
                        st.sq.iter().find(|p| p.error.is_none()).map(|p| p.opcode)
                    }
                    _ => None,
                };
                if let Some(op) = inferred {
                    head = Some((fabric_api::pdata::inferred_refusal(op), None));
                }
                // A dead peer (RetryExceeded) is an error completion: the endpoint is in
                // the error state (docs/contract.md section 6); an ended stream is a disconnect.
                let event = match (head, inferred) {
                    (Some((kind, _)), Some(op)) => EndpointEvent::Failed(Error::new(
                        kind,
                        format!(
                            "the connection ended ({end:?}) without the peer's close mark while \
                             a {op:?} was outstanding: the peer most likely refused it ({kind}; \
                             its device does not always send the Terminate)"
                        ),
                    )),
                    (Some((kind, code)), None) => {
                        let err = Error::new(kind, format!("the peer stopped answering: {end:?}"));
                        EndpointEvent::Failed(match code {
                            Some(c) => err.with_code(c),
                            None => err,
                        })
                    }
                    (None, _) => EndpointEvent::PeerClosed,
                };
                self.enter_error(&mut st, head, event);
                drop(st);
                self.close_tx(false);
            }
        }
    }

    fn handle(&self, r: &mut Parse, hdr: Header, payload: &[u8]) -> Handled {
        let len = payload.len();
        match hdr {
            Header::Tagged {
                opcode: opcode::WRITE,
                stag,
                to,
                last,
            } => {
                if len > 0 {
                    match self.keys.lookup(stag, to, len as u64, Access::REMOTE_WRITE) {
                        // The target is remote-accessible memory, not tied to a local
                        // completion: placed at once, word-atomically.
                        Ok(t) => t.buffer.write(t.offset, payload),
                        Err(t) => {
                            return Err(violation(t, format!("RDMA Write of {len} bytes to STag {stag:#x} at {to:#x} refused")));
                        }
                    }
                    self.emu_written(stag)?;
                }
                self.written(r, len, last);
                Ok(Flow::Done)
            }
            Header::Tagged {
                opcode: _,
                stag,
                to,
                last,
            } => self.on_read_response(stag, to, payload, last),
            Header::Untagged {
                opcode: op,
                ulp,
                qn: q,
                msn,
                mo,
                last,
            } => {
                if q as usize >= qn::COUNT {
                    return Err(violation(term::INVALID_QN, format!("DDP queue number {q}")));
                }
                let qi = q as usize;
                if msn != r.expect_msn[qi] || mo as usize != r.mo[qi] {
                    let t = if msn != r.expect_msn[qi] {
                        term::INVALID_MSN
                    } else {
                        term::INVALID_MO
                    };
                    return Err(violation(
                        t,
                        format!(
                            "DDP MSN/MO on queue {q}: got {msn}/{mo}, expected {}/{}",
                            r.expect_msn[qi], r.mo[qi]
                        ),
                    ));
                }
                let flow = self.handle_untagged(r, op, ulp, q, mo as usize, payload, last)?;
                if let Flow::Done = flow {
                    r.mo[qi] += len;
                    if last {
                        r.expect_msn[qi] = r.expect_msn[qi].wrapping_add(1);
                        r.mo[qi] = 0;
                    }
                }
                Ok(flow)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn handle_untagged(
        &self,
        r: &mut Parse,
        op: u8,
        ulp: u32,
        q: u32,
        mo: usize,
        payload: &[u8],
        last: bool,
    ) -> Handled {
        let len = payload.len();
        let ext_ok = |f: u8| self.neg.has(f);
        match (q, op) {
            (
                qn::SEND,
                opcode::SEND
                | opcode::SEND_SE
                | opcode::SEND_INVALIDATE
                | opcode::SEND_SE_INVALIDATE,
            ) => self.on_send(r, None, mo, payload, last),
            (qn::SEND, opcode::SEND_IMM) if ext_ok(features::IMMEDIATE) => {
                self.on_send(r, Some(ulp), mo, payload, last)
            }
            (qn::SEND, opcode::IMMEDIATE) if ext_ok(features::IMMEDIATE) && last && mo == 0 => {
                if len != ddp::IMMEDIATE_LEN {
                    return Err(violation(
                        term::FPDU,
                        format!("Immediate Data payload of {len} bytes, expected 8"),
                    ));
                }
                let imm = u32::from_be_bytes(payload[..4].try_into().expect("4 bytes"));
                let arrived = Arrived::WriteImm {
                    imm,
                    len: r.last_write_len,
                };
                let mut st = self.lock();
                if st.status != EndpointState::Connected {
                    return Err(RxEnd::Local);
                }
                if st.unexpected.is_empty() {
                    if let Some(recv) = st.rq.pop_front() {
                        self.deliver_buffered(&mut st, recv, arrived);
                        return Ok(Flow::Done);
                    }
                }
                if !Self::room_for(&st, arrived.cost()) {
                    return Ok(Flow::Blocked);
                }
                st.unexpected_bytes += arrived.cost();
                st.unexpected.push_back(arrived);
                Ok(Flow::Done)
            }
            (qn::READ, opcode::READ_REQUEST) if last && mo == 0 => self.on_read_request(payload),
            (qn::TERMINATE, opcode::TERMINATE) => {
                let b = &payload[..len.min(256)];
                // Peers of this framework follow RFC 5040; others may be siw.
                let t = if self.neg.features == 0 {
                    Terminate::decode_foreign(b)
                } else {
                    Terminate::decode(b)
                }
                .map_err(wire_violation)?;
                Err(RxEnd::PeerTerminate(t, Terminate::terminated_header(b)))
            }
            (qn::ATOMIC, opcode::ATOMIC_REQUEST)
                if ext_ok(features::ATOMICS) && last && mo == 0 =>
            {
                self.on_atomic_request(payload)
            }
            (qn::ATOMIC, opcode::ATOMIC_RESPONSE)
                if ext_ok(features::ATOMICS) && last && mo == 0 =>
            {
                if len != AtomicResponse::LEN {
                    return Err(violation(
                        term::FPDU,
                        format!("Atomic Response of {len} bytes"),
                    ));
                }
                let resp = AtomicResponse::decode(payload).map_err(wire_violation)?;
                let mut st = self.lock();
                self.response_unit(&mut st, Unit::Atomic(resp))?;
                Ok(Flow::Done)
            }
            (qn::ACK, opcode::ACK) if ext_ok(features::ACKS) && len == 0 => {
                let unit = if ulp & ddp::ACK_MESSAGES != 0 {
                    Unit::MessageAck
                } else {
                    Unit::WriteAck
                };
                let mut st = self.lock();
                for _ in 0..ulp & ddp::ACK_COUNT {
                    self.response_unit(&mut st, unit)?;
                }
                Ok(Flow::Done)
            }
            _ => Err(violation(
                term::INVALID_OPCODE,
                format!(
                    "RDMAP opcode {op:#x} on queue {q} (negotiated extensions {:#x})",
                    self.neg.features
                ),
            )),
        }
    }

    /// Whether a message costing `cost` fits the unexpected buffer.
    fn room_for(st: &State, cost: usize) -> bool {
        st.unexpected_bytes + cost <= UNEXPECTED_LIMIT
    }

    fn on_send(
        &self,
        r: &mut Parse,
        imm: Option<u32>,
        mo: usize,
        payload: &[u8],
        last: bool,
    ) -> Handled {
        let len = payload.len();
        let mut st = self.lock();
        if mo == 0 {
            if self.neg.expect_send_rtr && !r.rtr_seen && len == 0 && last {
                r.rtr_seen = true;
                return Ok(Flow::Done);
            }
            if st.status != EndpointState::Connected {
                return Err(RxEnd::Local);
            }
            let matched = st.unexpected.is_empty() && !st.rq.is_empty();
            if !matched && !Self::room_for(&st, UNEXPECTED_ENTRY_COST) {
                // Receiver not ready and the buffer full: stop reading (back-pressure).
                return Ok(Flow::Blocked);
            }
            r.current = Some(if matched {
                st.placing = st.rq.pop_front();
                Current::Matched { got: 0 }
            } else {
                Current::Buffered(Vec::new())
            });
        }
        if st.status != EndpointState::Connected {
            return Err(RxEnd::Local);
        }
        // A message too big to buffer whole waits for a receive (or room) and continues
        // straight into it: the bound holds for one message as for many.
        if let Some(Current::Buffered(data)) = &mut r.current {
            if !Self::room_for(&st, data.len() + len + UNEXPECTED_ENTRY_COST) {
                let Some(recv) = (st.unexpected.is_empty())
                    .then(|| st.rq.pop_front())
                    .flatten()
                else {
                    return Ok(Flow::Blocked);
                };
                let got = data.len();
                if got > recv.total {
                    self.message_too_long(&mut st, recv, got);
                    return Err(RxEnd::Local);
                }
                scatter(&recv.sges, 0, data);
                st.placing = Some(recv);
                r.current = Some(Current::Matched { got });
            }
        }
        match r.current.as_mut() {
            Some(Current::Matched { got }) => {
                let Some(recv) = st.placing.as_ref() else {
                    return Err(RxEnd::Local);
                };
                if *got + len > recv.total {
                    // Longer than its receive: fail it now, whatever the peer still sends.
                    let got = *got + len;
                    let recv = st.placing.take().expect("placing");
                    self.message_too_long(&mut st, recv, got);
                    return Err(RxEnd::Local);
                }
                scatter(&recv.sges, *got, payload);
                *got += len;
            }
            Some(Current::Buffered(data)) => data.extend_from_slice(payload),
            None => {
                return Err(violation(
                    term::FPDU,
                    "Send continuation without a first segment",
                ))
            }
        }
        if last {
            let emu_imm = self.emu_imm(r);
            match r.current.take().expect("current message") {
                Current::Matched { got } => {
                    let recv = st.placing.take().expect("a receive is being placed");
                    let (opcode, len, imm) = match emu_imm {
                        Some(rec) if rec.kind == emu_wire::IMM_WRITE && got == 0 => {
                            (Opcode::RecvWriteWithImm, rec.len, Some(rec.imm))
                        }
                        Some(rec) if rec.kind == emu_wire::IMM_SEND => {
                            (Opcode::Recv, got as u64, Some(rec.imm))
                        }
                        _ => (Opcode::Recv, got as u64, imm),
                    };
                    self.complete_recv(&mut st, recv.context, opcode, len, imm);
                }
                Current::Buffered(data) => {
                    let arrived = match emu_imm {
                        Some(rec) if rec.kind == emu_wire::IMM_WRITE && data.is_empty() => {
                            Arrived::WriteImm {
                                imm: rec.imm,
                                len: rec.len,
                            }
                        }
                        Some(rec) if rec.kind == emu_wire::IMM_SEND => Arrived::Send {
                            data,
                            imm: Some(rec.imm),
                        },
                        _ => Arrived::Send { data, imm },
                    };
                    if st.unexpected.is_empty() {
                        if let Some(recv) = st.rq.pop_front() {
                            self.deliver_buffered(&mut st, recv, arrived);
                            return if st.status == EndpointState::Connected {
                                Ok(Flow::Done)
                            } else {
                                Err(RxEnd::Local)
                            };
                        }
                    }
                    st.unexpected_bytes += arrived.cost();
                    st.unexpected.push_back(arrived);
                }
            }
        }
        Ok(Flow::Done)
    }

    /// With the iwarp provider's emulation ([`crate::emu`]): the immediate-data record of
    /// the Send that just arrived whole, from our ring slot of its ordinal (the peer wrote
    /// it before the Send, and RDMAP ordering placed it first); `None` for a send without.
    /// A record that does not match the send (wrong stamp, kind, a write's length beyond
    /// the largest message) is no record.
    fn emu_imm(&self, r: &mut Parse) -> Option<ImmRec> {
        let (ours, _) = self.neg.emu()?;
        let ordinal = r.sends_in;
        r.sends_in += 1;
        ImmRec::read(ours.buf(), ours.slots(), ordinal, crate::MAX_MSG_SIZE)
    }

    /// After an RDMA Write into STag `stag` was placed: when that is our emulation area
    /// ([`crate::emu`]), a new request in its request slot is executed and answered (an
    /// RDMA Write into the peer's reply slot), and a reply to our outstanding atomic in its
    /// reply slot completes it. A refusal either way puts the endpoint in the error state
    /// (the iwarp provider does the same at its end): the connection ends once the reply
    /// left.
    fn emu_written(&self, stag: u32) -> Result<(), RxEnd> {
        let Some((ours, peer)) = self.neg.emu() else {
            return Ok(());
        };
        if stag != ours.stag() {
            return Ok(());
        }
        let (req, reply) = (AmoReq::read(ours.buf()), AmoReply::read(ours.buf()));
        let mut st = self.lock();
        if st.status != EndpointState::Connected {
            return Err(RxEnd::Local);
        }
        if let Some(req) = req.filter(|q| q.seq == st.amo_served.wrapping_add(1)) {
            st.amo_served = req.seq;
            let result = crate::emu::execute(&self.keys, &req);
            tracing::trace!(seq = req.seq, op = ?req.op, addr = req.addr, rkey = req.rkey, ?result, "emulated atomic executed");
            let m = OutMsg::control(
                Kind::Tagged {
                    opcode: opcode::WRITE,
                    stag: peer.stag,
                    to: peer.addr.wrapping_add(emu_wire::REPLY_OFF as u64),
                },
                AmoReply {
                    seq: req.seq,
                    result,
                }
                .encode(),
            );
            self.transmit(&mut st, m);
            if let Err(kind) = result {
                tracing::debug!(
                    ?kind,
                    addr = req.addr,
                    rkey = req.rkey,
                    "emulated atomic refused: endpoint enters the error state"
                );
                let why = format!(
                    "refused the peer's emulated atomic at {:#x} (key {:#x}): {kind}",
                    req.addr, req.rkey
                );
                self.enter_error(&mut st, None, EndpointEvent::Failed(Error::new(kind, why)));
                return Err(RxEnd::Local);
            }
        }
        if let Some(rep) = reply.filter(|p| Some(p.seq) == st.amo_wait) {
            st.amo_wait = None;
            let Some(p) = st.sq.iter_mut().find(|p| {
                p.error.is_none() && p.wait_resp && matches!(p.resp, Resp::EmuAtomic { .. })
            }) else {
                return Ok(());
            };
            match rep.result {
                Ok(old) => {
                    if let Resp::EmuAtomic { result, offset } = &p.resp {
                        result.write(*offset, &old.to_ne_bytes());
                    }
                    p.wait_resp = false;
                    st.reads_out -= 1;
                    self.release_backlog(&mut st);
                    self.drain_sq(&mut st);
                }
                Err(kind) => {
                    tracing::debug!(
                        seq = rep.seq,
                        ?kind,
                        "the peer refused an emulated atomic: endpoint enters the error state"
                    );
                    p.error = Some((kind, None));
                    let why = format!("the peer refused an emulated atomic ({kind})");
                    self.enter_error(&mut st, None, EndpointEvent::Failed(Error::new(kind, why)));
                    return Err(RxEnd::Local);
                }
            }
        }
        Ok(())
    }

    fn on_read_request(&self, payload: &[u8]) -> Handled {
        if payload.len() != ReadRequest::LEN {
            return Err(violation(
                term::FPDU,
                format!("Read Request of {} bytes, expected 28", payload.len()),
            ));
        }
        self.check_ird("RDMA Read Request")?;
        let rr = ReadRequest::decode(payload).map_err(wire_violation)?;
        let payload = if rr.size == 0 {
            Payload::Inline(Vec::new())
        } else {
            match self.keys.lookup(
                rr.src_stag,
                rr.src_to,
                u64::from(rr.size),
                Access::REMOTE_READ,
            ) {
                Ok(t) => {
                    Payload::Memory(smallvec::smallvec![(t.buffer, t.offset, rr.size as usize)])
                }
                Err(t) => {
                    return Err(violation(
                        t,
                        format!(
                            "RDMA Read of {} bytes from STag {:#x} at {:#x} refused",
                            rr.size, rr.src_stag, rr.src_to
                        ),
                    ))
                }
            }
        };
        let mut st = self.lock();
        self.transmit(
            &mut st,
            OutMsg {
                kind: Kind::Tagged {
                    opcode: opcode::READ_RESPONSE,
                    stag: rr.sink_stag,
                    to: rr.sink_to,
                },
                payload,
                sent_seq: None,
                inbound: true,
            },
        );
        Ok(Flow::Done)
    }

    /// An inbound Read or Atomic Request beyond the IRD we advertised (responses we still
    /// owe and have not started sending) ends the connection: DDP "no buffer" on its queue,
    /// as an RNIC's full inbound read queue does.
    fn check_ird(&self, what: &str) -> Result<(), RxEnd> {
        let owed = self.tx.lock().expect("tx poisoned").inbound;
        if owed >= u32::from(IRD) {
            return Err(violation(
                term::NO_BUFFER,
                format!("{what} beyond the advertised IRD of {IRD}: {owed} responses still owed"),
            ));
        }
        Ok(())
    }

    fn on_atomic_request(&self, payload: &[u8]) -> Handled {
        if payload.len() != AtomicRequest::LEN {
            return Err(violation(
                term::FPDU,
                format!("Atomic Request of {} bytes, expected 52", payload.len()),
            ));
        }
        self.check_ird("Atomic Request")?;
        let a = AtomicRequest::decode(payload).map_err(wire_violation)?;
        let t = self
            .keys
            .lookup(a.stag, a.to, 8, Access::REMOTE_ATOMIC)
            .map_err(|t| {
                violation(
                    t,
                    format!("atomic on STag {:#x} at {:#x} refused", a.stag, a.to),
                )
            })?;
        let word = t.buffer.atomic_u64(t.offset).ok_or_else(|| {
            violation(
                term::MISALIGNED_ATOMIC,
                format!("atomic target {:#x} is not 8-byte aligned", a.to),
            )
        })?;
        let original = match a.op {
            atomic_op::FETCH_ADD => word.fetch_add(a.add_swap, AtomicOrdering::SeqCst),
            _ => match word.compare_exchange(
                a.compare,
                a.add_swap,
                AtomicOrdering::SeqCst,
                AtomicOrdering::SeqCst,
            ) {
                Ok(v) | Err(v) => v,
            },
        };
        let mut resp = OutMsg::control(
            Kind::Untagged {
                opcode: opcode::ATOMIC_RESPONSE,
                ulp: 0,
                qn: qn::ATOMIC,
                msn: 0,
            },
            AtomicResponse {
                req_id: a.req_id,
                original,
            }
            .encode()
            .to_vec(),
        );
        resp.inbound = true;
        let mut st = self.lock();
        self.transmit(&mut st, resp);
        Ok(Flow::Done)
    }

    fn on_read_response(&self, stag: u32, to: u64, payload: &[u8], last: bool) -> Handled {
        let len = payload.len();
        let mut st = self.lock();
        let Some(sges) = st.read_sinks.get(&stag) else {
            if st.status != EndpointState::Connected {
                return Err(RxEnd::Local);
            }
            return Err(violation(
                term::DDP_INVALID_STAG,
                format!("Read Response for unknown sink STag {stag:#x}"),
            ));
        };
        let total: usize = sges.iter().map(|s| s.2).sum();
        if total == 0 && len > 0 {
            // The kernel's siw answers a zero-length Read it serves from its IRQ with the
            // previous WQE's stale SGE (siw_activate_tx copies the SGE only when num_sge is
            // set, siw_qp_sq_proc_tx then forces num_sge = 1 for every Read Response). The
            // response is still ordered after everything before the Read, which is all a
            // zero-length Read is for: drop the bytes, never let them reach memory.
            tracing::debug!(
                len,
                "discarding the payload of a Read Response to a zero-length Read"
            );
        } else if to
            .checked_add(len as u64)
            .is_none_or(|end| end > total as u64)
        {
            return Err(violation(
                term::DDP_BASE_BOUNDS,
                format!("Read Response of {len} bytes at {to} overruns a {total}-byte sink"),
            ));
        } else {
            // Under the lock, while the read is outstanding: a close that flushes it
            // removes the sink first, and nothing lands after.
            scatter(sges, to as usize, payload);
        }
        if last {
            st.read_sinks.remove(&stag);
            if st.partial_sinks.remove(&stag) {
                // The first half of a split read: the second half completes the request.
                st.reads_out -= 1;
                self.release_backlog(&mut st);
                return Ok(Flow::Done);
            }
            self.response_unit(&mut st, Unit::ReadDone(stag))?;
        }
        Ok(Flow::Done)
    }
}
