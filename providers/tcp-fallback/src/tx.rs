//! The transmit path: messages cut into FPDUs and written to the socket in post order.
//!
//! Whoever posts writes straight to the socket when nothing is queued ahead (a non-blocking
//! `send`, so a post never blocks); whatever the kernel does not take at once is queued and
//! written by whoever makes progress next, when the socket has room again (the progress
//! engine: [`crate::engine`]). Nothing here blocks.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::Arc;

use fabric_api::{send_gather, Buffer, IoPiece};

use crate::wire::ddp::{self, Header};
use crate::wire::mpa;

/// Where a message's payload comes from.
#[derive(Debug)]
pub(crate) enum Payload {
    /// Bytes copied at post time (inline sends, control messages).
    Inline(Vec<u8>),
    /// Ranges of registered memory, read when the FPDU is written (no copy).
    Memory(Sges),
}

/// A gather or scatter list: (buffer, offset, length) ranges of registered memory, inline
/// up to two entries (the common case allocates nothing per post).
pub(crate) type Sges = smallvec::SmallVec<[(Arc<Buffer>, usize, usize); 2]>;

/// The messages one request puts on the wire (one, two for a split read or an emulated
/// immediate), inline up to two.
pub(crate) type Msgs = smallvec::SmallVec<[OutMsg; 2]>;

impl Payload {
    pub fn len(&self) -> usize {
        match self {
            Payload::Inline(v) => v.len(),
            Payload::Memory(parts) => parts.iter().map(|p| p.2).sum(),
        }
    }

    /// Calls `f` with copies of the bytes covering `[off, off+len)` of the payload, a chunk
    /// at a time (registered memory is copied out word-atomically, never borrowed).
    fn pieces(&self, off: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        match self {
            Payload::Inline(v) => f(&v[off..off + len]),
            Payload::Memory(_) => {
                let mut chunk = [0u8; 4096];
                self.for_each_range(off, len, &mut |buf, start, take| {
                    let mut done = 0;
                    while done < take {
                        let n = (take - done).min(chunk.len());
                        buf.read(start + done, &mut chunk[..n]);
                        f(&chunk[..n]);
                        done += n;
                    }
                });
            }
        }
    }

    /// Copies the whole payload into `out`, which is exactly as long (registered memory
    /// copied out word-atomically).
    fn copy_to(&self, out: &mut [u8]) {
        match self {
            Payload::Inline(v) => out.copy_from_slice(v),
            Payload::Memory(parts) => copy_sges(parts, out),
        }
    }

    /// Appends the bytes covering `[off, off+len)` of the payload to `out` (registered
    /// memory copied out word-atomically, straight into `out`: no staging chunk to clear
    /// per message).
    fn append_to(&self, off: usize, len: usize, out: &mut Vec<u8>) {
        match self {
            Payload::Inline(v) => out.extend_from_slice(&v[off..off + len]),
            Payload::Memory(_) => self.for_each_range(off, len, &mut |buf, start, take| {
                let at = out.len();
                out.resize(at + take, 0);
                buf.read(start, &mut out[at..]);
            }),
        }
    }

    /// Calls `f(buffer, offset, len)` for the registered-memory ranges covering
    /// `[off, off+len)` of a `Memory` payload.
    fn for_each_range<'a>(
        &'a self,
        off: usize,
        len: usize,
        f: &mut dyn FnMut(&'a Buffer, usize, usize),
    ) {
        let Payload::Memory(parts) = self else {
            return;
        };
        let (mut skip, mut left) = (off, len);
        for (buf, start, plen) in parts {
            if left == 0 {
                break;
            }
            if skip >= *plen {
                skip -= plen;
                continue;
            }
            let take = (plen - skip).min(left);
            f(buf, start + skip, take);
            left -= take;
            skip = 0;
        }
    }
}

/// The header of every segment of a message, before segmentation.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    /// Tagged, starting at `to`.
    Tagged { opcode: u8, stag: u32, to: u64 },
    /// Untagged on queue `qn` with sequence number `msn`.
    Untagged {
        opcode: u8,
        ulp: u32,
        qn: u32,
        msn: u32,
    },
}

impl Kind {
    /// The DDP header of the segment that starts at payload offset `off`.
    pub fn header(self, off: usize, last: bool) -> Header {
        match self {
            Kind::Tagged { opcode, stag, to } => Header::Tagged {
                last,
                opcode,
                stag,
                to: to.wrapping_add(off as u64),
            },
            Kind::Untagged {
                opcode,
                ulp,
                qn,
                msn,
            } => Header::Untagged {
                last,
                opcode,
                ulp,
                qn,
                msn,
                mo: off as u32,
            },
        }
    }
}

/// One RDMAP message to transmit.
#[derive(Debug)]
pub(crate) struct OutMsg {
    pub kind: Kind,
    pub payload: Payload,
    /// Send-queue sequence number to mark as sent once fully written.
    pub sent_seq: Option<u64>,
    /// A Read or Atomic Response: counts against the IRD we advertised until the
    /// transmit queue starts writing it.
    pub inbound: bool,
}

impl OutMsg {
    pub fn control(kind: Kind, payload: Vec<u8>) -> Self {
        OutMsg {
            kind,
            payload: Payload::Inline(payload),
            sent_seq: None,
            inbound: false,
        }
    }

    fn header(&self, off: usize, last: bool) -> Header {
        self.kind.header(off, last)
    }

    /// The FPDU that carries payload bytes from `off`: its MPA length and DDP header, its
    /// payload length, and its trailer (pad and CRC).
    fn fpdu_at(&self, off: usize, max_seg: usize, crc: bool) -> Fpdu {
        let total = self.payload.len();
        let seg = (total - off).min(max_seg);
        let last = off + seg == total;
        let h = self.header(off, last);
        let head = Head::new(&h, seg);
        let pad = mpa::pad_len(h.len() + seg);
        let crc_val = if crc {
            let mut c = crc32c::crc32c(&head);
            self.payload
                .pieces(off, seg, &mut |s| c = crc32c::crc32c_append(c, s));
            crc32c::crc32c_append(c, &[0u8; 3][..pad])
        } else {
            0
        };
        let mut trailer = [0u8; 8];
        trailer[pad..pad + 4].copy_from_slice(&mpa::crc_bytes(crc_val));
        Fpdu {
            head,
            off,
            seg,
            trailer,
            trailer_len: pad + 4,
            last,
            staged: None,
        }
    }

    /// Encodes the whole message, appending to `out` (small messages, for the direct path).
    pub fn encode_into(&self, out: &mut Vec<u8>, max_seg: usize, crc: bool) {
        let total = self.payload.len();
        if total <= max_seg {
            // One FPDU (every message of a ping-pong, every ack): written in place.
            return encode_fpdu(out, &self.header(0, true), total, crc, |b| {
                self.payload.copy_to(b)
            });
        }
        self.encode_segments(out, max_seg, crc)
    }

    /// [`encode_into`](Self::encode_into) FPDU by FPDU, for any length.
    fn encode_segments(&self, out: &mut Vec<u8>, max_seg: usize, crc: bool) {
        out.reserve(self.payload.len() + 32);
        let mut off = 0;
        loop {
            let f = self.fpdu_at(off, max_seg, crc);
            out.extend_from_slice(&f.head);
            self.payload.append_to(off, f.seg, out);
            out.extend_from_slice(&f.trailer[..f.trailer_len]);
            off += f.seg;
            if f.last {
                return;
            }
        }
    }
}

/// Copies the registered-memory ranges `sges` one after the other into `out`, which is
/// exactly as long as they are together (word-atomic copies: [`Buffer::read`]).
pub(crate) fn copy_sges(sges: &Sges, out: &mut [u8]) {
    let mut at = 0;
    for (buf, start, len) in sges {
        buf.read(*start, &mut out[at..at + len]);
        at += len;
    }
}

/// Appends one whole FPDU to `out`: the MPA length, the DDP header `h` (its L flag set by
/// the caller), `len` payload bytes that `fill` writes into the slice it is given, the pad
/// and the CRC field (CRC32c over all before it with `crc`, else zero). Writes in place:
/// no staging of header, payload or trailer.
pub(crate) fn encode_fpdu(
    out: &mut Vec<u8>,
    h: &Header,
    len: usize,
    crc: bool,
    fill: impl FnOnce(&mut [u8]),
) {
    let ulpdu = h.len() + len;
    let body = 2 + ulpdu + mpa::pad_len(ulpdu);
    let start = out.len();
    out.resize(start + body + 4, 0);
    let b = &mut out[start..];
    b[..2].copy_from_slice(&(ulpdu as u16).to_be_bytes());
    let at = 2 + h.write_to(&mut b[2..]);
    fill(&mut b[at..at + len]);
    if crc {
        let c = crc32c::crc32c(&b[..body]);
        b[body..].copy_from_slice(&mpa::crc_bytes(c));
    }
}

/// An FPDU's MPA length and DDP header, on the stack (no allocation per FPDU).
#[derive(Debug, Clone, Copy)]
struct Head {
    bytes: [u8; 2 + ddp::UNTAGGED_LEN],
    len: usize,
}

impl Head {
    /// The MPA length field (header plus `seg` payload bytes) and header `h`.
    fn new(h: &Header, seg: usize) -> Head {
        let mut bytes = [0u8; 2 + ddp::UNTAGGED_LEN];
        bytes[..2].copy_from_slice(&((h.len() + seg) as u16).to_be_bytes());
        let n = h.write_to(&mut bytes[2..]);
        Head { bytes, len: 2 + n }
    }
}

impl std::ops::Deref for Head {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// One FPDU of a queued message, being written.
#[derive(Debug)]
struct Fpdu {
    head: Head,
    /// Payload offset of its first byte in the message.
    off: usize,
    seg: usize,
    trailer: [u8; 8],
    trailer_len: usize,
    last: bool,
    /// The payload copied out (with CRC, so the CRC covers exactly the bytes sent; and
    /// for gather lists too long for one `sendmsg`).
    staged: Option<Vec<u8>>,
}

impl Fpdu {
    fn len(&self) -> usize {
        self.head.len() + self.seg + self.trailer_len
    }
}

/// A queued item: a message written FPDU by FPDU, or bytes already encoded.
#[derive(Debug)]
pub(crate) enum Queued {
    Msg(OutMsg),
    /// Bytes, the send-queue sequence number to mark as sent, and whether it is a response
    /// counted against our IRD.
    Tail(Vec<u8>, Option<u64>, bool),
}

impl Queued {
    /// A Read or Atomic Response (counted against our IRD while queued).
    pub fn inbound(&self) -> bool {
        match self {
            Queued::Msg(m) => m.inbound,
            Queued::Tail(_, _, inbound) => *inbound,
        }
    }

    fn sent_seq(&self) -> Option<u64> {
        match self {
            Queued::Msg(m) => m.sent_seq,
            Queued::Tail(_, seq, _) => *seq,
        }
    }
}

/// The transmit queue of one endpoint: written by whoever makes progress (the posting
/// thread, an application polling, the domain's progress thread), never blocking.
#[derive(Debug, Default)]
pub(crate) struct TxQueue {
    pub queue: VecDeque<Queued>,
    /// The FPDU of the front message being written, and how many of its bytes are out.
    current: Option<(Fpdu, usize)>,
    /// Bytes of the front `Tail` already written.
    tail_done: usize,
    /// The front item has begun (its IRD count was released).
    started: bool,
    /// No more output.
    pub closed: bool,
    /// Read and Atomic Responses queued and not yet started.
    pub inbound: u32,
}

/// What a flush achieved.
#[derive(Debug, Default)]
pub(crate) struct Flushed {
    /// Send-queue sequence numbers whose last byte went out.
    pub sent: Vec<u64>,
    /// The socket failed (the connection is over).
    pub error: Option<std::io::Error>,
}

impl TxQueue {
    /// True when nothing waits to be written.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty()
    }

    /// Drops everything queued (the connection is over).
    pub fn clear(&mut self) {
        self.queue.clear();
        self.current = None;
        self.tail_done = 0;
        self.started = false;
        self.inbound = 0;
    }

    /// Keeps only what the stream needs to end on an FPDU boundary (a graceful close): the
    /// unwritten rest of an FPDU or encoded message already begun; everything else is
    /// dropped (its operations are flushed by the caller).
    pub fn cut_to_boundary(&mut self) {
        let rest = match self.queue.front() {
            // A tail at the front is the rest of a message the posting thread began
            // writing itself: it always finishes.
            Some(Queued::Tail(bytes, _, _)) => Some(bytes[self.tail_done..].to_vec()),
            Some(Queued::Msg(m)) => match &self.current {
                Some((f, written)) if *written > 0 => {
                    let mut all = f.head.to_vec();
                    match &f.staged {
                        Some(v) => all.extend_from_slice(v),
                        None => m.payload.append_to(f.off, f.seg, &mut all),
                    }
                    all.extend_from_slice(&f.trailer[..f.trailer_len]);
                    Some(all[*written..].to_vec())
                }
                _ => None,
            },
            _ => None,
        };
        self.clear();
        if let Some(rest) = rest {
            self.queue.push_back(Queued::Tail(rest, None, false));
            self.started = true;
        }
    }

    /// Writes as much as the socket takes without blocking.
    pub fn flush(&mut self, sock: &TcpStream, max_seg: usize, crc: bool) -> Flushed {
        let mut done = Flushed::default();
        loop {
            let Some(front) = self.queue.front() else {
                return done;
            };
            if !self.started {
                self.started = true;
                // Started now: by the time the peer has this response (and may ask
                // again), it no longer counts against the IRD.
                self.inbound -= u32::from(front.inbound());
            }
            let res = match front {
                Queued::Tail(bytes, _, _) => {
                    match send_gather(
                        sock.as_fd(),
                        &[IoPiece::Bytes(bytes)],
                        self.tail_done,
                        libc::MSG_DONTWAIT,
                    ) {
                        Ok(n) => {
                            self.tail_done += n;
                            Ok(self.tail_done == bytes.len())
                        }
                        Err(e) => Err(e),
                    }
                }
                Queued::Msg(m) => {
                    let (fpdu, written) = self
                        .current
                        .get_or_insert_with(|| (m.fpdu_at(0, max_seg, crc), 0));
                    // The FPDUs after it go in the same `sendmsg` (without CRC: no staging),
                    // up to GATHER_FPDUS in all.
                    let mut followers = Vec::new();
                    if !crc {
                        let mut last = fpdu.last;
                        let mut at = fpdu.off + fpdu.seg;
                        while !last && followers.len() + 1 < GATHER_FPDUS {
                            let f = m.fpdu_at(at, max_seg, crc);
                            (at, last) = (f.off + f.seg, f.last);
                            followers.push(f);
                        }
                    }
                    match write_fpdus(sock, m, fpdu, *written, &followers, crc) {
                        Ok(mut n) => {
                            let left = fpdu.len() - *written;
                            if n < left {
                                *written += n;
                                Ok(false)
                            } else if fpdu.last {
                                self.current = None;
                                Ok(true)
                            } else {
                                n -= left;
                                let mut next = None;
                                for f in followers {
                                    if n < f.len() {
                                        next = Some((f, n));
                                        break;
                                    }
                                    n -= f.len();
                                    if f.last {
                                        next = None;
                                        break;
                                    }
                                    next = Some((m.fpdu_at(f.off + f.seg, max_seg, crc), 0));
                                }
                                match next {
                                    // The whole message went out (its last FPDU).
                                    None => {
                                        self.current = None;
                                        Ok(true)
                                    }
                                    Some((f, done)) => {
                                        let partial = done > 0;
                                        self.current = Some((f, done));
                                        if partial {
                                            Ok(false) // the socket is full
                                        } else {
                                            continue;
                                        }
                                    }
                                }
                            }
                        }
                        Err(e) => Err(e),
                    }
                }
            };
            match res {
                Ok(true) => {
                    let item = self.queue.pop_front().expect("front exists");
                    self.tail_done = 0;
                    self.started = false;
                    if let Some(seq) = item.sent_seq() {
                        done.sent.push(seq);
                    }
                }
                // The socket took less than offered: it is full; its writable edge brings
                // us back.
                Ok(false) => return done,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return done,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    done.error = Some(e);
                    self.closed = true;
                    self.clear();
                    return done;
                }
            }
        }
    }
}

/// FPDUs of one message handed to the kernel in one `sendmsg` (without CRC): 1 MiB of
/// 64 KiB FPDUs, 48 of the 64 pieces one call takes. The 1 MiB write stream gained about a
/// tenth over 4 per call (6 interleaved rounds on loopback: faster in 6 of 6, 0.83-0.96x
/// of a raw TCP stream before, 0.90-1.03x after; docs/benchmarks-record.md).
const GATHER_FPDUS: usize = 16;

/// Writes what it can of `fpdu` (from byte `written` on), and of the `followers` after it,
/// without blocking. Without CRC the kernel reads the payload straight from registered
/// memory; with CRC it is staged once, so the CRC covers exactly the bytes that are sent
/// (and there are no followers).
fn write_fpdus(
    sock: &TcpStream,
    m: &OutMsg,
    fpdu: &mut Fpdu,
    written: usize,
    followers: &[Fpdu],
    crc: bool,
) -> std::io::Result<usize> {
    let mut pieces = Vec::with_capacity(4 * (1 + followers.len()));
    push_pieces(&mut pieces, m, fpdu, crc);
    for f in followers {
        let before = pieces.len();
        pieces.push(IoPiece::Bytes(&f.head));
        push_payload(&mut pieces, m, f.off, f.seg);
        pieces.push(IoPiece::Bytes(&f.trailer[..f.trailer_len]));
        if pieces.len() > fabric_api::mem::MAX_IO_PIECES {
            // Only whole FPDUs ride along.
            pieces.truncate(before);
            break;
        }
    }
    send_gather(sock.as_fd(), &pieces, written, libc::MSG_DONTWAIT)
}

/// The pieces of `[off, off + len)` of an unstaged payload: the inline bytes, or the
/// registered-memory ranges, read by the kernel with no copy.
fn push_payload<'a>(pieces: &mut Vec<IoPiece<'a>>, m: &'a OutMsg, off: usize, len: usize) {
    match &m.payload {
        Payload::Inline(v) => pieces.push(IoPiece::Bytes(&v[off..off + len])),
        Payload::Memory(_) => m
            .payload
            .for_each_range(off, len, &mut |buffer, offset, len| {
                pieces.push(IoPiece::Buffer {
                    buffer,
                    offset,
                    len,
                })
            }),
    }
}

/// The gather list of one FPDU (its payload staged when the CRC needs it, or when the
/// payload's pieces would not fit one `sendmsg`).
fn push_pieces<'a>(pieces: &mut Vec<IoPiece<'a>>, m: &'a OutMsg, fpdu: &'a mut Fpdu, crc: bool) {
    pieces.push(IoPiece::Bytes(&fpdu.head));
    match &m.payload {
        Payload::Inline(v) => pieces.push(IoPiece::Bytes(&v[fpdu.off..fpdu.off + fpdu.seg])),
        Payload::Memory(parts) if !crc && parts.len() < fabric_api::mem::MAX_IO_PIECES - 2 => {
            push_payload(pieces, m, fpdu.off, fpdu.seg);
        }
        Payload::Memory(_) => {
            let (off, seg) = (fpdu.off, fpdu.seg);
            let staged = fpdu.staged.get_or_insert_with(|| {
                let mut v = Vec::with_capacity(seg);
                m.payload.append_to(off, seg, &mut v);
                v
            });
            pieces.push(IoPiece::Bytes(staged));
        }
    }
    pieces.push(IoPiece::Bytes(&fpdu.trailer[..fpdu.trailer_len]));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ddp::{opcode, TAGGED_LEN};
    use std::io::Read;

    /// A message of one FPDU is written in place (`encode_fpdu`) byte for byte as the
    /// FPDU-by-FPDU encoder writes it: every pad length, tagged and untagged, inline and
    /// gathered from registered memory, with and without CRCs.
    #[test]
    fn one_fpdu_in_place_matches_the_segment_encoder() {
        let data: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
        let buf = Arc::new(Buffer::from_slice(&data));
        for len in 0..=9 {
            for crc in [false, true] {
                let kinds = [
                    Kind::Tagged {
                        opcode: opcode::WRITE,
                        stag: 0xabcd,
                        to: 77,
                    },
                    Kind::Untagged {
                        opcode: opcode::SEND,
                        ulp: 5,
                        qn: 0,
                        msn: 9,
                    },
                ];
                for kind in kinds {
                    let payloads = [
                        Payload::Inline(data[3..3 + len].to_vec()),
                        Payload::Memory(smallvec::smallvec![
                            (buf.clone(), 3, len / 2),
                            (buf.clone(), 40, len - len / 2)
                        ]),
                    ];
                    for payload in payloads {
                        let m = OutMsg {
                            kind,
                            payload,
                            sent_seq: None,
                            inbound: false,
                        };
                        let (mut fast, mut slow) = (vec![1, 2], vec![1, 2]);
                        m.encode_into(&mut fast, 64, crc);
                        m.encode_segments(&mut slow, 64, crc);
                        assert_eq!(fast, slow, "len {len} crc {crc} {kind:?}");
                        assert_eq!((fast.len() - 2) % 4, 0, "FPDUs end on a word");
                    }
                }
            }
        }
    }

    /// A multi-FPDU message written through a small send buffer (so `sendmsg` takes part
    /// of an FPDU, whole FPDUs, or an FPDU and part of the next): the stream holds exactly
    /// its FPDUs, in order, each with its header, payload, pad and trailer, then the next
    /// message.
    #[test]
    fn gathered_fpdus_survive_partial_writes() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tx_sock = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut rx_sock, _) = listener.accept().unwrap();
        socket2::SockRef::from(&tx_sock)
            .set_send_buffer_size(8192)
            .unwrap();
        tx_sock.set_nonblocking(true).unwrap();
        let len = 5 * 1000 + 333;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let buf = Arc::new(Buffer::from_slice(&data));
        let max_seg = 1000;
        let mut q = TxQueue::default();
        q.queue.push_back(Queued::Msg(OutMsg {
            kind: Kind::Tagged {
                opcode: opcode::WRITE,
                stag: 0x1234,
                to: 1 << 20,
            },
            payload: Payload::Memory(smallvec::smallvec![
                (buf.clone(), 0, 2500),
                (buf, 2500, len - 2500)
            ]),
            sent_seq: Some(7),
            inbound: false,
        }));
        q.queue.push_back(Queued::Msg(OutMsg {
            kind: Kind::Tagged {
                opcode: opcode::WRITE,
                stag: 0x5678,
                to: 0,
            },
            payload: Payload::Inline(b"tail".to_vec()),
            sent_seq: Some(8),
            inbound: false,
        }));
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut chunk = [0u8; 1500];
            loop {
                let n = rx_sock.read(&mut chunk).unwrap();
                if n == 0 {
                    return got;
                }
                got.extend_from_slice(&chunk[..n]);
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        });
        let mut sent = Vec::new();
        while !q.is_idle() {
            let done = q.flush(&tx_sock, max_seg, false);
            assert!(done.error.is_none());
            sent.extend(done.sent);
            std::thread::yield_now();
        }
        assert_eq!(sent, [7, 8]);
        drop(tx_sock);
        let stream = reader.join().unwrap();
        // Decode: MPA length, tagged header, payload, pad, CRC word.
        let mut at = 0;
        let mut placed = Vec::new();
        let mut lasts = Vec::new();
        while at < stream.len() {
            let ulpdu = usize::from(u16::from_be_bytes([stream[at], stream[at + 1]]));
            let h = Header::decode(&stream[at + 2..at + 2 + TAGGED_LEN]).unwrap();
            let Header::Tagged { stag, to, last, .. } = h else {
                panic!("not tagged: {h:?}")
            };
            let payload = &stream[at + 2 + TAGGED_LEN..at + 2 + ulpdu];
            if stag == 0x1234 {
                assert_eq!(to, (1 << 20) + placed.len() as u64, "tagged offset");
                placed.extend_from_slice(payload);
            } else {
                assert_eq!((stag, payload), (0x5678, &b"tail"[..]));
            }
            lasts.push(last);
            at += 2 + ulpdu + mpa::pad_len(ulpdu) + 4;
        }
        assert_eq!(at, stream.len(), "the stream ends on an FPDU boundary");
        assert_eq!(placed, data, "the payload arrived whole and in order");
        assert_eq!(lasts, [false, false, false, false, false, true, true]);
    }
}
