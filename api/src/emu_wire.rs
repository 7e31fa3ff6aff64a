//! The wire records of the emulation of atomics and immediate data between peers of this
//! framework on transports that have neither (iWARP: RFC 5040 RDMAP has no atomic opcodes and no immediate data, and the
//! kernel's siw implements none of RFC 7306's), over base RDMAP only.
//!
//! # Negotiation
//! Each side appends an extension trailer to its connection private data, after the
//! application's bytes (which the frame's length byte delimits, so a peer that does not
//! know the trailer ignores it): a magic byte, a version, flags (atomics, immediate data),
//! the number of immediate-data slots and the descriptor of the endpoint's *emulation
//! area*. Only when both sides sent a valid trailer (and a credit area, which immediate
//! data needs) does the connection emulate; otherwise everything is as without it (a
//! foreign iWARP peer, or an older peer of this framework, sees nothing new).
//!
//! # The emulation area
//! A registered region per endpoint that only the peer writes into, with plain RDMA Writes
//! (base RDMAP), in little-endian 64-bit words:
//!
//! * the **atomic request slot** ([`REQ_OFF`]): `stamp, op, addr, rkey, operand, operand,
//!   check`;
//! * the **atomic reply slot** ([`REPLY_OFF`]): `stamp, status, old value, check`;
//! * the **immediate-data ring** ([`IMM_OFF`]): one 24-byte slot per posted receive the
//!   owner can have: `stamp, kind << 32 | immediate, length`.
//!
//! The check word is a hash of the others: the owner reads a slot while the peer's device
//! may be writing it, so a torn read is told from a whole one by the check, never by luck.
//!
//! # Atomics (UCX's `amo_sw` and libfabric rxm's atomic protocol, as provider-internal
//! # messages)
//! The initiator writes the request into the target's request slot (one inline RDMA
//! Write). The target's provider, not its application, executes it. On the iwarp provider
//! (`fabric-verbs`) the domain's helper thread (the one that already retries held sends and probes dead peers) polls the request
//! slots of the domain's emulating endpoints, adaptively (without sleeping while atomics
//! flow and for a millisecond after, then backing off when idle), checks the key (a region registered with
//! REMOTE_ATOMIC in that domain), the bounds and the alignment, and runs the operation with
//! the same `AtomicU64` on the same 8-byte word that every framework atomic on the word
//! uses (`Buffer::atomic_u64`), so it is atomic with respect to all of them. It writes the
//! old value (or the error) into the initiator's reply slot; the initiator's helper thread
//! sees it, stores the old value into the application's result buffer and completes the
//! request. One emulated atomic is outstanding per endpoint: requests posted after it are
//! held back until its reply arrived, so completions stay in posting order and the slots
//! need no ring. A refused atomic (no such key, no REMOTE_ATOMIC, out of bounds) completes
//! `RemoteAccess` at the initiator and puts both endpoints in the error state: the target
//! disconnects once its reply left.
//!
//! # Immediate data
//! A send with immediate data is preceded by a write of the immediate into the target's
//! ring slot of that send's ordinal (the number of sends before it on the connection);
//! a write with immediate data is the RDMA Write, the ring write, then a zero-length Send.
//! RDMAP delivers a Send only after the RDMA Writes before it were placed, so when the
//! target's receive completes, its slot holds the immediate (and, for a write, the written
//! length), and the written data is visible: the receive completes with the immediate,
//! as `RecvWriteWithImm` with the written length for a write. The credit protocol bounds
//! the ring: a send's ordinal is below the count of receives the target ever posted, at
//! most the receive-queue depth ahead of the receives it has completed, so one slot per
//! receive-queue entry is never overwritten before it was read.
//!
//! # Hostile peers
//! A peer writes only its connection's own area. Every field is validated (opcode, key,
//! bounds, alignment, kind, length); a request whose check fails is not executed; the
//! target serves one request at a time per connection, so a peer cannot make it spend more
//! than one reply write and one slot of its send queue at once.

//!
//! # Who speaks it
//! The iwarp provider with a peer of its own kind, and the tcp provider with the iwarp
//! provider (`fabric-tcp`'s `emu` module): this module is the one codec of both. The tcp
//! provider sees every RDMA Write land in its area itself, so it executes a request the
//! moment the request slot is written, and completes its own atomic the moment the reply
//! is written, without polling. As the initiator of a connection its request carries no
//! frame (a foreign stack must see only the application's bytes), so it names its area by
//! RDMA-Writing [`Announcement`] at [`pdata::area::EMU_OF_PEER`] of the iwarp provider's
//! credit area, before its hello mark.

use std::sync::atomic::Ordering;

use crate::{pdata, Buffer, ErrorKind};

/// First byte of the extension trailer.
pub const EXT_MAGIC: u8 = 0xe7;
/// Version of the extension protocol.
pub const EXT_VERSION: u8 = 1;
/// Length of the extension trailer.
pub const EXT_LEN: usize = 20;
/// Trailer flag: emulated atomics.
pub const FLAG_ATOMICS: u8 = 1;
/// Trailer flag: emulated immediate data.
pub const FLAG_IMMEDIATE: u8 = 2;
/// Trailer flag: this side's credit updates carry its count of completed receives beside
/// its count of posted ones, packed into one word ([`pdata::CreditWord`]), and it reads the
/// peer's updates so. Only when both sides offer it does a connection use the packed word;
/// the peer's sends are then confirmed by the count, without a delivery read, whenever the
/// count arrives before anything else needs them confirmed.
pub const FLAG_RECEIVED: u8 = 4;
/// Trailer flag (with [`FLAG_RECEIVED`]): this side batches its credit updates while the
/// peer's word at [`MODE_OFF`] of its area reads [`MODE_LAZY`], and writes that word of
/// the peer's area to say whether its own sends need the peer's count. A credit update
/// per receive posted is what confirms a delivery-complete send; a transmit-complete one
/// needs none, so while the sender posts only those, the receiver writes an update only
/// when the sender may run short of credit. Only when both sides offer it.
pub const FLAG_LAZY_CREDITS: u8 = 8;

/// Offset of the atomic request slot in the area.
pub const REQ_OFF: usize = 0;
/// Size of an atomic request (seven words).
pub const REQ_LEN: usize = 56;
/// Offset of the atomic reply slot.
pub const REPLY_OFF: usize = 64;
/// Size of an atomic reply (four words).
pub const REPLY_LEN: usize = 32;
/// Offset of the mode word ([`FLAG_LAZY_CREDITS`]): written by the peer, [`MODE_LAZY`]
/// while its sends need no confirmation by our count, anything else while they do.
pub const MODE_OFF: usize = 96;
/// The mode word's value that lets the area's owner batch its credit updates.
pub const MODE_LAZY: u64 = 1;
/// Offset of the immediate-data ring.
pub const IMM_OFF: usize = 128;
const _: () = assert!(REPLY_OFF + REPLY_LEN <= MODE_OFF && MODE_OFF + 8 <= IMM_OFF);
/// Size of an immediate-data slot (three words).
pub const IMM_SLOT: usize = 24;
/// Most immediate-data slots a peer may announce (the largest receive queue of any device
/// we know, siw's 32768, rounded up).
pub const MAX_IMM_SLOTS: u32 = 1 << 16;

/// Opcode of an atomic request: fetch-and-add.
pub const OP_FETCH_ADD: u64 = 1;
/// Opcode of an atomic request: compare-and-swap.
pub const OP_COMPARE_SWAP: u64 = 2;

/// Kind of an immediate-data record: a send with immediate.
pub const IMM_SEND: u32 = 1;
/// Kind of an immediate-data record: a write with immediate.
pub const IMM_WRITE: u32 = 2;

/// The extension trailer: what a peer offers and where its emulation area is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtDesc {
    /// [`FLAG_ATOMICS`] | [`FLAG_IMMEDIATE`], and [`FLAG_RECEIVED`] and
    /// [`FLAG_LAZY_CREDITS`] where offered.
    pub flags: u8,
    /// Immediate-data slots in the area.
    pub imm_slots: u32,
    /// Address of the area.
    pub addr: u64,
    /// Steering tag of the area.
    pub stag: u32,
}

impl ExtDesc {
    /// The trailer's wire form (big-endian fields, as the rest of the frame).
    pub fn encode(&self) -> [u8; EXT_LEN] {
        let mut b = [0u8; EXT_LEN];
        b[0] = EXT_MAGIC;
        b[1] = EXT_VERSION;
        b[2] = self.flags;
        b[4..8].copy_from_slice(&self.imm_slots.to_be_bytes());
        b[8..16].copy_from_slice(&self.addr.to_be_bytes());
        b[16..20].copy_from_slice(&self.stag.to_be_bytes());
        b
    }

    /// Reads a trailer; `None` for anything that is not a valid one of this version
    /// (padding, a foreign peer, an announced ring of no or too many slots).
    pub fn decode(b: &[u8]) -> Option<ExtDesc> {
        let b = b.get(..EXT_LEN)?;
        if b[0] != EXT_MAGIC || b[1] != EXT_VERSION {
            return None;
        }
        let d = ExtDesc {
            flags: b[2] & (FLAG_ATOMICS | FLAG_IMMEDIATE | FLAG_RECEIVED | FLAG_LAZY_CREDITS),
            imm_slots: u32::from_be_bytes(b[4..8].try_into().ok()?),
            addr: u64::from_be_bytes(b[8..16].try_into().ok()?),
            stag: u32::from_be_bytes(b[16..20].try_into().ok()?),
        };
        if d.imm_slots == 0 || d.imm_slots > MAX_IMM_SLOTS {
            return None;
        }
        Some(d)
    }

    /// The trailer in a peer's raw private data, given the framed application length:
    /// after the frame header, the credit-area descriptor and the application's bytes.
    pub fn find(raw: &[u8], app_len: usize) -> Option<ExtDesc> {
        if raw.first() != Some(&pdata::MAGIC) {
            return None;
        }
        let at = pdata::HEADER + pdata::AREA_DESC_LEN + app_len;
        ExtDesc::decode(raw.get(at..)?)
    }
}

/// Size of an emulation area with `slots` immediate-data slots.
pub fn area_len(slots: u32) -> usize {
    IMM_OFF + IMM_SLOT * slots as usize
}

/// The check word of a slot: a hash of its other words, never zero.
pub fn check(words: &[u64]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for &w in words {
        h = (h ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
    }
    h | 1
}

fn le_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Reads `N` little-endian words of an area at `off` (aligned, inside the area).
#[inline]
fn read_words<const N: usize>(buf: &Buffer, off: usize) -> Option<[u64; N]> {
    // An array, not a vector: the verbs provider's helper thread reads the request and
    // reply slots on every look, and a look allocates nothing.
    let mut w = [0u64; N];
    for (i, v) in w.iter_mut().enumerate() {
        *v = u64::from_le(buf.atomic_u64(off + 8 * i)?.load(Ordering::Acquire));
    }
    Some(w)
}

/// An atomic operation as the request carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmoOp {
    /// Fetch-and-add.
    FetchAdd {
        /// Added (wrapping).
        add: u64,
    },
    /// Compare-and-swap.
    CompareSwap {
        /// Compared with the word.
        compare: u64,
        /// Stored when equal.
        swap: u64,
    },
}

/// An atomic request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AmoReq {
    /// Sequence number (1, 2, ... per connection).
    pub seq: u64,
    /// The operation.
    pub op: AmoOp,
    /// Target address.
    pub addr: u64,
    /// Target key.
    pub rkey: u32,
}

impl AmoReq {
    fn words(&self) -> [u64; 6] {
        let (op, a, b) = match self.op {
            AmoOp::FetchAdd { add } => (OP_FETCH_ADD, add, 0),
            AmoOp::CompareSwap { compare, swap } => (OP_COMPARE_SWAP, compare, swap),
        };
        [self.seq, op, self.addr, u64::from(self.rkey), a, b]
    }

    /// The request slot's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let w = self.words();
        let mut v = le_bytes(&w);
        v.extend_from_slice(&check(&w).to_le_bytes());
        debug_assert_eq!(v.len(), REQ_LEN);
        v
    }

    /// Decodes request words; `None` when the check fails (torn or garbage) or a field is
    /// invalid.
    pub fn decode(w: &[u64]) -> Option<AmoReq> {
        if w.len() != 7 || check(&w[..6]) != w[6] {
            return None;
        }
        let op = match w[1] {
            OP_FETCH_ADD => AmoOp::FetchAdd { add: w[4] },
            OP_COMPARE_SWAP => AmoOp::CompareSwap {
                compare: w[4],
                swap: w[5],
            },
            _ => return None,
        };
        Some(AmoReq {
            seq: w[0],
            op,
            addr: w[2],
            rkey: u32::try_from(w[3]).ok()?,
        })
    }

    /// The request in an area's slot, if a whole valid one is there.
    pub fn read(area: &Buffer) -> Option<AmoReq> {
        AmoReq::decode(&read_words::<7>(area, REQ_OFF)?)
    }
}

/// Reply status: success.
const ST_OK: u64 = 0;
/// Reply status: the key, its rights or the bounds refused the request.
const ST_ACCESS: u64 = 1;
/// Reply status: a malformed request (misaligned target).
const ST_INVALID: u64 = 2;

/// An atomic reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AmoReply {
    /// The request's sequence number.
    pub seq: u64,
    /// The old value, or why the target refused.
    pub result: Result<u64, ErrorKind>,
}

impl AmoReply {
    fn words(&self) -> [u64; 3] {
        match self.result {
            Ok(old) => [self.seq, ST_OK, old],
            Err(ErrorKind::RemoteInvalidRequest) => [self.seq, ST_INVALID, 0],
            Err(_) => [self.seq, ST_ACCESS, 0],
        }
    }

    /// The reply slot's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let w = self.words();
        let mut v = le_bytes(&w);
        v.extend_from_slice(&check(&w).to_le_bytes());
        debug_assert_eq!(v.len(), REPLY_LEN);
        v
    }

    /// Decodes reply words; `None` when the check fails. An unknown status is a
    /// `RemoteOperation` error (the peer speaks a protocol we do not).
    pub fn decode(w: &[u64]) -> Option<AmoReply> {
        if w.len() != 4 || check(&w[..3]) != w[3] {
            return None;
        }
        let result = match w[1] {
            ST_OK => Ok(w[2]),
            ST_ACCESS => Err(ErrorKind::RemoteAccess),
            ST_INVALID => Err(ErrorKind::RemoteInvalidRequest),
            _ => Err(ErrorKind::RemoteOperation),
        };
        Some(AmoReply { seq: w[0], result })
    }

    /// The reply in an area's slot, if a whole valid one is there.
    pub fn read(area: &Buffer) -> Option<AmoReply> {
        AmoReply::decode(&read_words::<4>(area, REPLY_OFF)?)
    }
}

/// An immediate-data record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImmRec {
    /// [`IMM_SEND`] or [`IMM_WRITE`].
    pub kind: u32,
    /// The immediate value.
    pub imm: u32,
    /// A write's length (0 for a send).
    pub len: u64,
}

impl ImmRec {
    /// The bytes of the record for the send of ordinal `ordinal` (its stamp is
    /// `ordinal + 1`, so a zeroed slot matches no send).
    pub fn encode(&self, ordinal: u64) -> Vec<u8> {
        le_bytes(&[
            ordinal.wrapping_add(1),
            u64::from(self.kind) << 32 | u64::from(self.imm),
            self.len,
        ])
    }

    /// The record of the send of ordinal `ordinal` in an area with `slots` slots, if the
    /// slot holds one for that send with a valid kind and a length at most `max_len`.
    #[inline]
    pub fn read(area: &Buffer, slots: u32, ordinal: u64, max_len: u64) -> Option<ImmRec> {
        let off = IMM_OFF + IMM_SLOT * (ordinal % u64::from(slots.max(1))) as usize;
        // The stamp first: a send without immediate data finds another send's stamp
        // there (a receive's every completion looks), and the record's words stay unread.
        let [stamp] = read_words::<1>(area, off)?;
        if stamp != ordinal.wrapping_add(1) {
            return None;
        }
        let [word, len] = read_words::<2>(area, off + 8)?;
        let kind = (word >> 32) as u32;
        let rec = ImmRec {
            kind,
            imm: word as u32,
            len,
        };
        match kind {
            IMM_SEND if rec.len == 0 => Some(rec),
            IMM_WRITE if rec.len <= max_len => Some(rec),
            _ => None,
        }
    }
}

/// How the tcp provider, as the initiator, names its emulation area to the iwarp provider
/// (whose reply's trailer it read): two words at [`pdata::area::EMU_OF_PEER`] of that
/// provider's credit area, in host order as the credit area's other words: the area's
/// address, then `stag | imm_slots << 32`. Both zero (the area's initial state): no
/// emulation offered. Flags are implied: both emulations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announcement;

impl Announcement {
    /// The two words' bytes for `d` (its flags must offer both emulations).
    pub fn encode(d: &ExtDesc) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&d.addr.to_ne_bytes());
        b[8..].copy_from_slice(&(u64::from(d.stag) | u64::from(d.imm_slots) << 32).to_ne_bytes());
        b
    }

    /// The descriptor from the two words as read; `None` for none announced or an invalid
    /// ring size.
    pub fn decode(addr: u64, word: u64) -> Option<ExtDesc> {
        if addr == 0 && word == 0 {
            return None;
        }
        let imm_slots = (word >> 32) as u32;
        if imm_slots == 0 || imm_slots > MAX_IMM_SLOTS {
            return None;
        }
        Some(ExtDesc {
            flags: FLAG_ATOMICS | FLAG_IMMEDIATE,
            imm_slots,
            addr,
            stag: word as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip_and_refuse_bad_rings() {
        let d = ExtDesc {
            flags: FLAG_ATOMICS | FLAG_IMMEDIATE,
            imm_slots: 256,
            addr: 0x7f12_3456_7000,
            stag: 0x8000_0001,
        };
        let b = Announcement::encode(&d);
        let w = |i: usize| u64::from_ne_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
        assert_eq!(Announcement::decode(w(0), w(1)), Some(d));
        assert_eq!(Announcement::decode(0, 0), None, "none announced");
        assert_eq!(Announcement::decode(1, 5), None, "no ring");
        assert_eq!(
            Announcement::decode(1, u64::from(MAX_IMM_SLOTS + 1) << 32),
            None,
            "too many slots"
        );
        assert!(pdata::area::EMU_OF_PEER + b.len() <= pdata::area::LEN);
    }

    fn write_bytes(buf: &Buffer, off: usize, b: &[u8]) {
        buf.write(off, b);
    }

    #[test]
    fn trailer_round_trips_and_rejects_foreign_or_hostile_bytes() {
        let d = ExtDesc {
            flags: FLAG_ATOMICS | FLAG_IMMEDIATE,
            imm_slots: 64,
            addr: 0x1122_3344_5566_7788,
            stag: 0xabcd_ef01,
        };
        assert_eq!(ExtDesc::decode(&d.encode()), Some(d));
        let mut raw = pdata::frame(b"app", Some(pdata::AreaDesc { addr: 1, stag: 2 }));
        assert_eq!(ExtDesc::find(&raw, 3), None, "no trailer: no emulation");
        raw.extend_from_slice(&d.encode());
        assert_eq!(ExtDesc::find(&raw, 3), Some(d));
        assert_eq!(ExtDesc::find(&raw[..raw.len() - 1], 3), None, "truncated");
        assert_eq!(ExtDesc::find(b"foreign private data with e7", 3), None);
        let mut bad = d.encode();
        bad[1] = EXT_VERSION + 1;
        assert_eq!(ExtDesc::decode(&bad), None, "unknown version");
        for slots in [0, MAX_IMM_SLOTS + 1] {
            let e = ExtDesc {
                imm_slots: slots,
                ..d
            };
            assert_eq!(ExtDesc::decode(&e.encode()), None, "{slots} slots");
        }
        let mut unknown = d.encode();
        unknown[2] = 0xff;
        assert_eq!(
            ExtDesc::decode(&unknown).unwrap().flags,
            FLAG_ATOMICS | FLAG_IMMEDIATE | FLAG_RECEIVED | FLAG_LAZY_CREDITS,
            "unknown flags are ignored"
        );
    }

    #[test]
    fn requests_and_replies_round_trip_through_an_area_and_torn_ones_are_refused() {
        let area = Buffer::new(area_len(4));
        assert_eq!(AmoReq::read(&area), None, "a zeroed slot holds no request");
        let req = AmoReq {
            seq: 7,
            op: AmoOp::CompareSwap {
                compare: 0x0102_0304_0506_0708,
                swap: u64::MAX,
            },
            addr: 0x7f00_0000_1008,
            rkey: 0x1234,
        };
        write_bytes(&area, REQ_OFF, &req.encode());
        assert_eq!(AmoReq::read(&area), Some(req));
        // A torn request (one word from a later one) fails its check.
        area.write(REQ_OFF + 32, &9u64.to_le_bytes());
        assert_eq!(AmoReq::read(&area), None);
        // An unknown opcode is refused even with a matching check.
        let mut w = [8u64, 3, 0, 0, 0, 0, 0];
        w[6] = check(&w[..6]);
        assert_eq!(AmoReq::decode(&w), None);
        // A key wider than 32 bits is refused.
        let mut w = [8u64, OP_FETCH_ADD, 0, 1 << 32, 0, 0, 0];
        w[6] = check(&w[..6]);
        assert_eq!(AmoReq::decode(&w), None);
        for result in [
            Ok(42),
            Err(ErrorKind::RemoteAccess),
            Err(ErrorKind::RemoteInvalidRequest),
        ] {
            let rep = AmoReply { seq: 3, result };
            write_bytes(&area, REPLY_OFF, &rep.encode());
            assert_eq!(AmoReply::read(&area), Some(rep));
        }
        let mut w = [3u64, 99, 0, 0];
        w[3] = check(&w[..3]);
        assert_eq!(
            AmoReply::decode(&w).unwrap().result,
            Err(ErrorKind::RemoteOperation)
        );
    }

    #[test]
    fn immediate_records_match_only_their_own_send() {
        let area = Buffer::new(area_len(4));
        assert_eq!(ImmRec::read(&area, 4, 0, 1 << 31), None);
        let w = ImmRec {
            kind: IMM_WRITE,
            imm: 0xdead_beef,
            len: 21,
        };
        // Ordinal 6 lives in slot 2.
        write_bytes(&area, IMM_OFF + 2 * IMM_SLOT, &w.encode(6));
        assert_eq!(ImmRec::read(&area, 4, 6, 1 << 31), Some(w));
        assert_eq!(ImmRec::read(&area, 4, 2, 1 << 31), None, "older send");
        assert_eq!(ImmRec::read(&area, 4, 10, 1 << 31), None, "newer send");
        assert_eq!(ImmRec::read(&area, 4, 6, 20), None, "length over the limit");
        let s = ImmRec {
            kind: IMM_SEND,
            imm: 1,
            len: 5,
        };
        write_bytes(&area, IMM_OFF, &s.encode(0));
        assert_eq!(
            ImmRec::read(&area, 4, 0, 1 << 31),
            None,
            "a send has no length"
        );
        let bad = ImmRec { kind: 9, ..w };
        write_bytes(&area, IMM_OFF, &bad.encode(0));
        assert_eq!(ImmRec::read(&area, 4, 0, 1 << 31), None, "unknown kind");
    }
}
