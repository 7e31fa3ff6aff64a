//! The transmit path: messages cut into FPDUs and written to the socket in post order.
//!
//! Whoever posts writes straight to the socket when nothing is queued ahead (a non-blocking
//! `send`, so a post never blocks); whatever the kernel does not take at once is queued for
//! the endpoint's transmit thread, which sleeps on a condition variable when idle.

use std::collections::VecDeque;
use std::io::{IoSlice, Write};
use std::net::TcpStream;
use std::sync::{Arc, Condvar, Mutex};

use fabric_api::Buffer;

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

    /// Calls `f` with the pieces covering `[off, off+len)` of the payload.
    fn pieces(&self, off: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        match self {
            Payload::Inline(v) => f(&v[off..off + len]),
            Payload::Memory(parts) => {
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
                    buf.with_slice(start + skip, take, |s| f(s));
                    left -= take;
                    skip = 0;
                }
            }
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
}

impl OutMsg {
    pub fn control(kind: Kind, payload: Vec<u8>) -> Self {
        OutMsg {
            kind,
            payload: Payload::Inline(payload),
            sent_seq: None,
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

    /// Writes the message with blocking writes, payload straight from registered memory
    /// when a segment lies in one range (gather lists spanning ranges are copied).
    pub fn write_to(&self, mut sock: &TcpStream, max_seg: usize, crc: bool) -> std::io::Result<()> {
        self.for_each_fpdu(max_seg, crc, |head, off, seg, trailer| {
            let mut write = |data: &[u8]| {
                let mut slices = [
                    IoSlice::new(head),
                    IoSlice::new(data),
                    IoSlice::new(trailer),
                ];
                write_all_vectored(&mut sock, &mut slices)
            };
            match &self.payload {
                Payload::Inline(v) => write(&v[off..off + seg]),
                Payload::Memory(parts) => {
                    let mut skip = off;
                    for (buf, start, plen) in parts {
                        if skip < *plen && skip + seg <= *plen {
                            return buf.with_slice(start + skip, seg, write);
                        }
                        if skip < *plen {
                            break;
                        }
                        skip -= plen;
                    }
                    let mut joined = Vec::with_capacity(seg);
                    self.payload
                        .pieces(off, seg, &mut |s| joined.extend_from_slice(s));
                    write(&joined)
                }
            }
        })
    }
}

fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Queued output: either a whole message or the unsent tail of a directly sent one.
#[derive(Debug)]
pub(crate) enum Queued {
    Msg(OutMsg),
    Tail(Vec<u8>, Option<u64>),
}

/// The transmit queue of one endpoint.
#[derive(Debug, Default)]
pub(crate) struct TxQueue {
    pub queue: VecDeque<Queued>,
    /// The transmit thread is writing something it popped.
    pub busy: bool,
    /// No more output: the thread exits once the queue is empty.
    pub closed: bool,
}

/// Shared transmit state: the queue and its condition variable.
#[derive(Debug, Default)]
pub(crate) struct Tx {
    pub state: Mutex<TxQueue>,
    pub wake: Condvar,
}
