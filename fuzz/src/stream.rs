//! Byte streams as a peer sends them after the MPA handshake: FPDU framing, placeholders for
//! the target's keys and addresses, and where a stream may legitimately change target memory.
//!
//! The fuzzer cannot guess the target's STags (random) or addresses (heap), so inputs name
//! them with placeholders that the connection harness substitutes before sending:
//!
//! * [`STAG_PLACEHOLDER`]` | n` (4 bytes, big-endian) becomes the key of slot `n`;
//! * [`TO_PLACEHOLDER`]` | n << 32 | off` (8 bytes) becomes slot `n`'s address plus `off`
//!   read as a signed 32-bit number, so inputs can aim just below or beyond a region.

use fabric_tcp::wire::ddp::{opcode, qn, AtomicRequest, Header};
use fabric_tcp::wire::mpa::{crc_bytes, pad_len, HEADER_LEN};

use crate::{be16, be32};

/// High 16 bits of a 4-byte STag placeholder; the low 16 bits are the slot number.
pub const STAG_PLACEHOLDER: u32 = 0x5eed_0000;
/// High 16 bits of an 8-byte tagged-offset placeholder; bits 32..48 are the slot number,
/// the low 32 bits a signed offset from the slot's first byte.
pub const TO_PLACEHOLDER: u64 = 0x5eee_0000_0000_0000;

/// Encodes one FPDU: ULPDU length, DDP header, payload, pad, CRC32c (zero when `crc` is off).
pub fn fpdu(h: &Header, payload: &[u8], crc: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + h.len() + payload.len() + 7);
    out.extend_from_slice(&((h.len() + payload.len()) as u16).to_be_bytes());
    h.encode_into(&mut out);
    out.extend_from_slice(payload);
    out.resize(out.len() + pad_len(h.len() + payload.len()), 0);
    let c = if crc { crc32c::crc32c(&out) } else { 0 };
    out.extend_from_slice(&crc_bytes(c));
    out
}

/// Replaces the placeholders in `b` by the keys and addresses of `slots` (key, address);
/// slot numbers past the end are left alone.
pub fn substitute(b: &mut [u8], slots: &[(u32, u64)]) {
    let mut i = 0;
    while i + 4 <= b.len() {
        let slot = usize::from(be16(b, i + 2));
        if i + 8 <= b.len() && be16(b, i) == (TO_PLACEHOLDER >> 48) as u16 && slot < slots.len() {
            let off = be32(b, i + 4) as i32;
            let to = slots[slot].1.wrapping_add_signed(i64::from(off));
            b[i..i + 8].copy_from_slice(&to.to_be_bytes());
            i += 8;
        } else if be16(b, i) == (STAG_PLACEHOLDER >> 16) as u16 && slot < slots.len() {
            b[i..i + 4].copy_from_slice(&slots[slot].0.to_be_bytes());
            i += 4;
        } else {
            i += 1;
        }
    }
}

/// Rewrites the CRC of every complete FPDU of `stream` (starting at `at`) to the right value.
pub fn fix_crcs(stream: &mut [u8], mut at: usize) {
    while let Some(len) = stream.get(at..at + 2).map(|b| usize::from(be16(b, 0))) {
        let crc_at = at + 2 + len + pad_len(len);
        let Some(c) = stream.get(at..crc_at).map(crc32c::crc32c) else {
            return;
        };
        let Some(slot) = stream.get_mut(crc_at..crc_at + 4) else {
            return;
        };
        slot.copy_from_slice(&crc_bytes(c));
        at = crc_at + 4;
    }
}

/// Bytes a message may change at the target: `len` bytes at tagged offset `to` in the
/// region named by `stag`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The region's remote key.
    pub stag: u32,
    /// First byte (target virtual address).
    pub to: u64,
    /// Length in bytes.
    pub len: u64,
    /// True for an atomic (needs REMOTE_ATOMIC), false for an RDMA Write (REMOTE_WRITE).
    pub atomic: bool,
}

/// Where `stream` (FPDUs, from offset `at`) could change target memory: every RDMA Write
/// segment and every Atomic Request, whether or not the target accepts it, and for a
/// segment cut short by the end of the stream its whole announced length. This is a
/// superset of what a correct target changes; bytes it changes outside all of these were
/// changed by no message of the peer.
pub fn placements(stream: &[u8], mut at: usize) -> Vec<Placement> {
    let mut out = Vec::new();
    while let Some(len) = stream.get(at..at + 2).map(|b| usize::from(be16(b, 0))) {
        let ulpdu = &stream[at + 2..stream.len().min(at + 2 + len)];
        if let Ok(h) = Header::decode(ulpdu) {
            let payload = &ulpdu[h.len()..];
            match h {
                Header::Tagged {
                    opcode: opcode::WRITE,
                    stag,
                    to,
                    ..
                } => out.push(Placement {
                    stag,
                    to,
                    len: len.saturating_sub(h.len()) as u64,
                    atomic: false,
                }),
                Header::Untagged {
                    opcode: opcode::ATOMIC_REQUEST,
                    qn: qn::ATOMIC,
                    ..
                } => {
                    if let Ok(a) = AtomicRequest::decode(payload) {
                        out.push(Placement {
                            stag: a.stag,
                            to: a.to,
                            len: 8,
                            atomic: true,
                        });
                    }
                }
                _ => {}
            }
        }
        at += 2 + len + pad_len(len) + 4;
    }
    out
}

/// Where the FPDUs start in a whole client stream that begins with an MPA request: after
/// the request's header and private data.
pub fn after_request(stream: &[u8]) -> usize {
    match stream.get(..HEADER_LEN) {
        Some(h) => HEADER_LEN + usize::from(be16(h, 18)),
        None => stream.len(),
    }
}
