//! The connection private data of this framework's verbs providers, and the iWARP credit
//! area it names.
//!
//! The verbs providers wrap the application's private data in a small frame: a magic byte,
//! the application's length, on iWARP the 12-byte descriptor of the endpoint's credit area,
//! then the application's bytes. The length byte matters: an InfiniBand CM REQ pads private
//! data to a fixed size, so the receiver could not tell the length otherwise.
//!
//! The credit area is a small registered region the peer writes into with plain RDMA Writes
//! (base RDMAP, nothing beyond RFC 5040): the count of receives the peer ever posted, and a
//! mark set when the peer closes gracefully. iWARP gives a close and a failure the same
//! signal (the LLP stream ends and the queue pair enters ERROR), so the mark is how an
//! endpoint tells them apart. The tcp provider reads the frame too: against an iwarp
//! provider it writes the close mark before it closes, and runs the same credit protocol
//! with an area of its own (named in its reply's frame as the responder, and at
//! [`area::AREA_OF_PEER`] as the initiator, whose request carries no frame).

use crate::{Error, ErrorKind, Result};

/// First byte of the frame.
pub const MAGIC: u8 = 0xfb;
/// Frame header: magic, application length.
pub const HEADER: usize = 2;
/// Size of a credit-area descriptor in the frame.
pub const AREA_DESC_LEN: usize = 12;

/// Byte offsets in the credit area: `u64` words the peer writes with RDMA Writes, in the
/// owner's byte order; for [`CLOSED`](area::CLOSED) only zero versus non-zero matters.
pub mod area {
    /// The peer's count of receives it ever posted (written by the peer): the whole count,
    /// or, where both sides offered `emu_wire::FLAG_RECEIVED`, a packed
    /// [`CreditWord`](super::CreditWord) that also carries its count of receives completed.
    pub const POSTED: usize = 0;
    /// Non-zero once the peer closed gracefully (written by the peer).
    pub const CLOSED: usize = 8;
    /// Where the owner's zero-length entries point (a receive for zero-byte messages, a
    /// zero-length read to a peer without an area): nothing is ever placed there.
    pub const SCRATCH: usize = 16;
    /// Non-zero once the peer announced that it is of this framework although its
    /// connection request carried no frame (the tcp provider, as the initiator, writes it
    /// first thing when the reply's frame names the iwarp provider's area): it answers
    /// zero-length RDMA Reads correctly, which a foreign iWARP stack may not.
    pub const HELLO: usize = 24;
    /// Where a peer that announced itself with [`HELLO`] (the tcp provider as the
    /// initiator) names its own credit area, written before the hello mark: the area's
    /// address in the word at this offset, its steering tag in the low 32 bits of the
    /// word after it. Both zero: the peer takes no credits.
    pub const AREA_OF_PEER: usize = 32;
    /// Where a peer that announced itself with [`HELLO`] names its emulation area
    /// (`crate::emu_wire::Announcement`), written before the hello mark. Both words
    /// zero: it offers no emulation.
    pub const EMU_OF_PEER: usize = 48;
    /// Size of the area.
    pub const LEN: usize = 64;
    /// Bytes a delivery read (or liveness probe) reads of the peer's area: all of it, from
    /// [`POSTED`] on. More than siw's `MAX_HDR_INLINE` (32 bytes) on purpose: siw (Linux 6.1
    /// `siw_try_1seg`) copies a payload of at most 32 bytes with `copy_from_user` whenever
    /// the queue pair's `in_syscall` flag is set, and the flag is still set for a moment
    /// after the owner's `ibv_post_send` finished transmitting. A Read Response that siw's
    /// transmit thread builds in that moment is copied from no user address space, fails
    /// with `EFAULT`, and siw drops the connection (`siw_qp_sq_process: wqe type 9
    /// processing failed: -14`). A longer response is built from the registered pages.
    pub const READ_LEN: usize = LEN;
    /// Where the owner's delivery reads land: a sink of [`READ_LEN`] bytes right after the
    /// area, in the same registration. Local to the owner, never named on the wire.
    pub const SINK: usize = LEN;
    /// Bytes the owner allocates and registers for its area: the area and the sink.
    pub const LOCAL_LEN: usize = SINK + READ_LEN;

    const _: () = assert!(READ_LEN > super::SIW_HDR_INLINE, "see READ_LEN");
}

/// The largest payload siw copies straight into its packet header (`MAX_HDR_INLINE` in
/// Linux 6.1 `siw_qp_tx.c`, `siw_try_1seg`: 32 bytes). That copy has two faults both
/// providers work around: it garbles a payload that crosses a page of registered memory,
/// and it fails (`EFAULT`, the connection dropped) when siw's transmit thread makes it
/// while the queue pair's `in_syscall` flag is still set (see [`area::READ_LEN`]).
pub const SIW_HDR_INLINE: usize = 32;

/// The word a peer writes at [`area::POSTED`] after every receive it posts, packed, where
/// both sides offered `emu_wire::FLAG_RECEIVED`: the low 32 bits of its count of receives
/// ever posted, and above them the low 32 bits of its count of receives completed (the
/// receives its provider has taken from the device's completion queue). One 8-byte RDMA
/// Write carries both, so the reader never sees one count without the other.
///
/// 32 bits of each suffice: the reader widens each against its own count of sends, which
/// no live count is ever 2^31 away from (a receiver is never more receives ahead of the
/// sender than its receive queue is deep, nor behind the sends it completed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreditWord {
    /// Receives the peer ever posted.
    pub posted: u64,
    /// Receives the peer ever completed: every send up to this ordinal was placed.
    pub received: u64,
}

impl CreditWord {
    /// The packed word.
    pub fn pack(self) -> u64 {
        (self.received & 0xffff_ffff) << 32 | (self.posted & 0xffff_ffff)
    }

    /// The counts of a packed `word`, widened against `sends`: the reader's count of sends
    /// ever handed to its device.
    pub fn unpack(word: u64, sends: u64) -> CreditWord {
        CreditWord {
            posted: widen(word as u32, sends),
            received: widen((word >> 32) as u32, sends),
        }
    }
}

/// The 64-bit count whose low 32 bits are `low`, nearest to `near` (within 2^31 of it).
pub fn widen(low: u32, near: u64) -> u64 {
    near.wrapping_add(i64::from(low.wrapping_sub(near as u32) as i32) as u64)
}

/// Where a peer's credit area is: its address and steering tag (remote key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AreaDesc {
    /// Virtual address of the area's first byte (the tagged offset of RDMA Writes to it).
    pub addr: u64,
    /// Steering tag / remote key of the area.
    pub stag: u32,
}

impl AreaDesc {
    /// The descriptor's wire form: address then key, both big-endian.
    pub fn encode(&self) -> [u8; AREA_DESC_LEN] {
        let mut b = [0u8; AREA_DESC_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..].copy_from_slice(&self.stag.to_be_bytes());
        b
    }

    /// Reads a descriptor; `None` when `b` is too short.
    pub fn decode(b: &[u8]) -> Option<AreaDesc> {
        Some(AreaDesc {
            addr: u64::from_be_bytes(b.get(..8)?.try_into().ok()?),
            stag: u32::from_be_bytes(b.get(8..12)?.try_into().ok()?),
        })
    }
}

/// The error a peer's Terminate most likely carried for a request of `op`, when the
/// connection died without the peer's close mark ([`area::CLOSED`]) and the device did not
/// say why (siw reports a Terminate only as a dead connection, and may reset before the
/// Terminate leaves): a send found no fitting receive; anything else named a key or range
/// the peer refused. Both providers infer it the same way, each for the other direction.
pub fn inferred_refusal(op: crate::Opcode) -> ErrorKind {
    match op {
        crate::Opcode::Send => ErrorKind::RemoteInvalidRequest,
        _ => ErrorKind::RemoteAccess,
    }
}

/// Wraps the application's private data (at most 255 bytes; callers check limits).
pub fn frame(app: &[u8], area: Option<AreaDesc>) -> Vec<u8> {
    debug_assert!(app.len() <= usize::from(u8::MAX));
    let mut v = vec![MAGIC, app.len() as u8];
    if let Some(a) = area {
        v.extend_from_slice(&a.encode());
    }
    v.extend_from_slice(app);
    v
}

/// Parses [`frame`]'s output, possibly padded. `with_area`: the frame carries a credit-area
/// descriptor (iWARP). Private data that does not start with [`MAGIC`] comes from a peer
/// not of this framework: all of it is the application's, and there is no area. A frame
/// that is cut short is a `Protocol` error naming what is missing.
pub fn unframe(raw: &[u8], with_area: bool) -> Result<(Vec<u8>, Option<AreaDesc>)> {
    let bad = |what: &str| {
        Error::new(
            ErrorKind::Protocol,
            format!("peer's connection private data: {what}"),
        )
    };
    if raw.first() != Some(&MAGIC) {
        return Ok((raw.to_vec(), None));
    }
    if raw.len() < HEADER {
        return Err(bad("truncated header"));
    }
    let len = usize::from(raw[1]);
    let mut at = HEADER;
    let area = if with_area {
        let d = raw
            .get(at..at + AREA_DESC_LEN)
            .and_then(AreaDesc::decode)
            .ok_or_else(|| bad("credit-area descriptor missing"))?;
        at += AREA_DESC_LEN;
        Some(d)
    } else {
        None
    };
    let app = raw
        .get(at..at + len)
        .ok_or_else(|| bad("application data truncated"))?
        .to_vec();
    Ok((app, area))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_with_and_without_an_area() {
        let mut raw = frame(b"from the client", None);
        raw.resize(56, 0); // an InfiniBand CM REQ pads
        assert_eq!(
            unframe(&raw, false).unwrap(),
            (b"from the client".to_vec(), None)
        );
        let a = AreaDesc {
            addr: 0x0102_0304_0506_0708,
            stag: 0xa0b0_c0d0,
        };
        assert_eq!(AreaDesc::decode(&a.encode()), Some(a));
        assert_eq!(
            unframe(&frame(b"x", Some(a)), true).unwrap(),
            (b"x".to_vec(), Some(a))
        );
        assert_eq!(
            unframe(&frame(b"", None), false).unwrap().0,
            Vec::<u8>::new()
        );
    }

    #[test]
    fn credit_words_carry_both_counts_across_32_bit_wraps() {
        for (posted, received, sends) in [
            (0, 0, 0),
            (5, 3, 4),
            (0x1_0000_0003, 0xffff_fffe, 0xffff_ffff),
            (0x7_0000_0010, 0x7_0000_0001, 0x7_0000_0002),
            (u64::MAX, u64::MAX - 7, u64::MAX - 3),
        ] {
            let w = CreditWord { posted, received };
            assert_eq!(CreditWord::unpack(w.pack(), sends), w, "{w:?} near {sends}");
        }
        assert_eq!(widen(0, 0), 0);
        assert_eq!(
            widen(0xffff_ffff, 1 << 32),
            (1 << 32) - 1,
            "just below a wrap"
        );
        assert_eq!(widen(2, (1 << 32) - 1), (1 << 32) + 2, "just above one");
    }

    #[test]
    fn hostile_frames_are_protocol_errors() {
        for hostile in [&[MAGIC][..], &[MAGIC, 200, 1, 2]] {
            assert_eq!(
                unframe(hostile, false).unwrap_err().kind(),
                ErrorKind::Protocol
            );
        }
        let e = unframe(&frame(b"abc", None), true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol);
        assert!(e.to_string().contains("credit-area descriptor"), "{e}");
    }

    #[test]
    fn foreign_private_data_is_all_application_data() {
        assert_eq!(
            unframe(b"GET / HTTP/1.1", true).unwrap(),
            (b"GET / HTTP/1.1".to_vec(), None)
        );
        assert_eq!(unframe(b"", false).unwrap(), (Vec::new(), None));
    }
}
