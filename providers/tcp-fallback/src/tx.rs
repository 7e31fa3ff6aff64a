//! The transmit path: messages cut into FPDUs and written to the socket in post order.
//!
//! Whoever posts writes straight to the socket when nothing is queued ahead (a non-blocking
//! `send`, so a post never blocks); whatever the kernel does not take at once is queued for
//! the endpoint's transmit thread, which sleeps on a condition variable when idle.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::{Arc, Condvar, Mutex};

use fabric_api::{send_gather, Buffer, IoPiece};

use crate::wire::ddp::Header;
use crate::wire::mpa;

/// Where a message's payload comes from.
#[derive(Debug)]
pub(crate) enum Payload {
    /// Bytes copied at post time (inline sends, control messages).
    Inline(Vec<u8>),
    /// Ranges of registered memory, read when the FPDU is written (no copy).
    Memory(Vec<(Arc<Buffer>, usize, usize)>),
}

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

/// One RDMAP message to transmit.
#[derive(Debug)]
pub(crate) struct OutMsg {
    pub kind: Kind,
    pub payload: Payload,
    /// Send-queue sequence number to mark as sent once fully written.
    pub sent_seq: Option<u64>,
    /// A Read or Atomic Response: counts against the IRD we advertised until the
    /// transmit thread takes it.
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
        match self.kind {
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

    /// Calls `f` once per FPDU with (mpa length + DDP header bytes, payload range, trailer).
    fn for_each_fpdu(
        &self,
        max_seg: usize,
        crc: bool,
        mut f: impl FnMut(&[u8], usize, usize, &[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let total = self.payload.len();
        let mut off = 0;
        let mut head = Vec::with_capacity(2 + crate::wire::ddp::UNTAGGED_LEN);
        loop {
            let seg = (total - off).min(max_seg);
            let last = off + seg == total;
            let h = self.header(off, last);
            head.clear();
            head.extend_from_slice(&((h.len() + seg) as u16).to_be_bytes());
            h.encode_into(&mut head);
            let pad = mpa::pad_len(h.len() + seg);
            let mut trailer = [0u8; 8];
            let crc_val = if crc {
                let mut c = crc32c::crc32c(&head);
                self.payload
                    .pieces(off, seg, &mut |s| c = crc32c::crc32c_append(c, s));
                crc32c::crc32c_append(c, &[0u8; 3][..pad])
            } else {
                0
            };
            trailer[pad..pad + 4].copy_from_slice(&mpa::crc_bytes(crc_val));
            f(&head, off, seg, &trailer[..pad + 4])?;
            off += seg;
            if last {
                return Ok(());
            }
        }
    }

    /// Encodes the whole message into bytes (small messages, for the direct path).
    pub fn encode(&self, max_seg: usize, crc: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.payload.len() + 32);
        self.for_each_fpdu(max_seg, crc, |head, off, seg, trailer| {
            out.extend_from_slice(head);
            self.payload
                .pieces(off, seg, &mut |s| out.extend_from_slice(s));
            out.extend_from_slice(trailer);
            Ok(())
        })
        .expect("writing to a vector cannot fail");
        out
    }

    /// Writes the message with blocking writes. Without CRC the kernel reads the payload
    /// straight from registered memory (one gather list per FPDU); with CRC the FPDU's
    /// payload is copied first, so the CRC covers exactly the bytes that are sent.
    pub fn write_to(&self, sock: &TcpStream, max_seg: usize, crc: bool) -> std::io::Result<()> {
        self.for_each_fpdu(max_seg, crc, |head, off, seg, trailer| {
            let mut pieces = Vec::with_capacity(4);
            pieces.push(IoPiece::Bytes(head));
            let joined;
            match &self.payload {
                Payload::Inline(v) => pieces.push(IoPiece::Bytes(&v[off..off + seg])),
                Payload::Memory(parts)
                    if !crc && parts.len() < fabric_api::mem::MAX_IO_PIECES - 2 =>
                {
                    self.payload
                        .for_each_range(off, seg, &mut |buffer, offset, len| {
                            pieces.push(IoPiece::Buffer {
                                buffer,
                                offset,
                                len,
                            })
                        });
                }
                Payload::Memory(_) => {
                    let mut v = Vec::with_capacity(seg);
                    self.payload
                        .pieces(off, seg, &mut |s| v.extend_from_slice(s));
                    joined = v;
                    pieces.push(IoPiece::Bytes(&joined));
                }
            }
            pieces.push(IoPiece::Bytes(trailer));
            send_all(sock, &pieces)
        })
    }
}

/// Sends every piece with blocking `sendmsg` calls.
fn send_all(sock: &TcpStream, pieces: &[IoPiece<'_>]) -> std::io::Result<()> {
    let total: usize = pieces.iter().map(IoPiece::len).sum();
    let mut sent = 0;
    while sent < total {
        match send_gather(sock.as_fd(), pieces, sent, 0)? {
            0 => return Err(std::io::ErrorKind::WriteZero.into()),
            n => sent += n,
        }
    }
    Ok(())
}

/// Queued output: either a whole message or the unsent tail of a directly sent one.
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
}

/// The transmit queue of one endpoint.
#[derive(Debug, Default)]
pub(crate) struct TxQueue {
    pub queue: VecDeque<Queued>,
    /// The transmit thread is writing something it popped.
    pub busy: bool,
    /// No more output: the thread exits once the queue is empty.
    pub closed: bool,
    /// Read and Atomic Responses queued and not yet taken by the transmit thread.
    pub inbound: u32,
}

/// Shared transmit state: the queue and its condition variable.
#[derive(Debug, Default)]
pub(crate) struct Tx {
    pub state: Mutex<TxQueue>,
    pub wake: Condvar,
    /// Signalled whenever the transmit thread takes an item (the receive thread waits on
    /// it while the queue is over its bound).
    pub drained: Condvar,
}
