//! The iwarp provider's emulation of atomics and immediate data ([`fabric_api::emu_wire`]),
//! spoken with that provider, and only with it: when its private data carried the
//! extension trailer (and the connection runs its credit protocol, [`crate::credit`]).
//! Between two tcp endpoints the RFC 7306-style extension carries atomics and immediate
//! data instead; a foreign iWARP stack gets neither.
//!
//! * **Negotiation.** As the responder our reply's frame ends with our trailer; as the
//!   initiator (whose request carries no frame) we name our area with an RDMA Write at
//!   [`pdata::area::EMU_OF_PEER`](fabric_api::pdata::area::EMU_OF_PEER) of the peer's
//!   credit area, before the hello mark ([`Announcement`]).
//! * **Our area** ([`LocalEmu`]) is a region of the domain's STag table that the peer
//!   writes with plain RDMA Writes. The receive machine places those writes itself, so it
//!   acts the moment a slot is written: a request in the request slot is executed at once
//!   (the key looked up with REMOTE_ATOMIC in the same table every RDMA access uses, on
//!   the word's `Buffer::atomic_u64`, as every framework atomic on the word) and answered
//!   with an RDMA Write into the peer's reply slot; a reply in our reply slot completes our
//!   outstanding atomic. No polling.
//! * **Immediate data.** Before a Send with immediate data, a write of the immediate into
//!   the peer's ring slot of the send's ordinal (the number of receive-consuming sends
//!   before it, our filler sends not counted); a write with immediate is the RDMA Write,
//!   the ring write, then a zero-length Send. When a Send lands here, the immediate of its
//!   ordinal is read from our ring.
//!
//! Every field the peer wrote is validated by the codec (check word, opcode, key width,
//! kind, length); a request whose check fails or whose sequence number is not the next one
//! is ignored; a refused request (no key, no REMOTE_ATOMIC, out of bounds, misaligned) is
//! answered with its error and puts the connection in the error state, as the iwarp
//! provider does.

use std::sync::Arc;

use fabric_api::emu_wire::{self, AmoOp, AmoReq, ExtDesc};
use fabric_api::{Access, Buffer, ErrorKind};

use crate::keys::KeyTable;

pub(crate) use fabric_api::emu_wire::Announcement;

/// Both emulations, as a trailer's flags.
const ALL: u8 = emu_wire::FLAG_ATOMICS | emu_wire::FLAG_IMMEDIATE;

/// Our emulation area: the peer writes atomic requests and replies and immediate-data
/// records into it. Its STag dies with it.
#[derive(Debug)]
pub(crate) struct LocalEmu {
    buf: Arc<Buffer>,
    stag: u32,
    slots: u32,
    keys: Arc<KeyTable>,
}

impl LocalEmu {
    /// Allocates the area with one immediate-data slot per receive-queue entry and
    /// registers it for remote write in the domain's STag table.
    pub fn new(keys: &Arc<KeyTable>, rq_depth: u32) -> LocalEmu {
        let slots = rq_depth.clamp(1, emu_wire::MAX_IMM_SLOTS);
        let buf = Arc::new(Buffer::new(emu_wire::area_len(slots)));
        let stag = keys.insert(buf.clone(), Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        LocalEmu {
            buf,
            stag,
            slots,
            keys: keys.clone(),
        }
    }

    /// Our trailer.
    pub fn desc(&self) -> ExtDesc {
        ExtDesc {
            flags: ALL,
            imm_slots: self.slots,
            addr: self.buf.addr(),
            stag: self.stag,
        }
    }

    /// The area's STag (the receive machine checks writes against it).
    pub fn stag(&self) -> u32 {
        self.stag
    }

    /// The area's memory.
    pub fn buf(&self) -> &Buffer {
        &self.buf
    }

    /// Immediate-data slots in the area.
    pub fn slots(&self) -> u32 {
        self.slots
    }
}

impl Drop for LocalEmu {
    fn drop(&mut self) {
        self.keys.remove(self.stag);
    }
}

/// The peer's trailer, if it offers both emulations (anything less: none, as the iwarp
/// provider decides).
pub(crate) fn offered(ext: Option<ExtDesc>) -> Option<ExtDesc> {
    ext.filter(|e| e.flags & ALL == ALL)
}

/// Executes the peer's atomic request against the domain's STag table: the old value, or
/// why not (the reply's status). Alignment first for a key that exists, as the iwarp
/// provider answers.
pub(crate) fn execute(keys: &KeyTable, req: &AmoReq) -> Result<u64, ErrorKind> {
    if !req.addr.is_multiple_of(8) {
        return match keys.lookup(req.rkey, req.addr & !7, 8, Access::REMOTE_ATOMIC) {
            Ok(_) => Err(ErrorKind::RemoteInvalidRequest),
            Err(_) => Err(ErrorKind::RemoteAccess),
        };
    }
    let t = keys
        .lookup(req.rkey, req.addr, 8, Access::REMOTE_ATOMIC)
        .map_err(|_| ErrorKind::RemoteAccess)?;
    let word = t
        .buffer
        .atomic_u64(t.offset)
        .ok_or(ErrorKind::RemoteInvalidRequest)?;
    use std::sync::atomic::Ordering::SeqCst;
    Ok(match req.op {
        AmoOp::FetchAdd { add } => word.fetch_add(add, SeqCst),
        AmoOp::CompareSwap { compare, swap } => {
            match word.compare_exchange(compare, swap, SeqCst, SeqCst) {
                Ok(v) | Err(v) => v,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_api::emu_wire::{AmoReply, ImmRec, IMM_SEND, REQ_OFF};

    #[test]
    fn the_area_is_remotely_writable_until_dropped_and_sized_by_the_receive_queue() {
        let keys = Arc::new(KeyTable::default());
        let a = LocalEmu::new(&keys, 8);
        let d = a.desc();
        assert_eq!((d.flags, d.imm_slots), (ALL, 8));
        assert_eq!(a.buf().len(), emu_wire::area_len(8));
        let t = keys
            .lookup(
                d.stag,
                d.addr + REQ_OFF as u64,
                emu_wire::REQ_LEN as u64,
                Access::REMOTE_WRITE,
            )
            .unwrap_or_else(|_| panic!("registered for remote write"));
        let req = AmoReq {
            seq: 1,
            op: AmoOp::FetchAdd { add: 2 },
            addr: 8,
            rkey: 3,
        };
        t.buffer.write(t.offset, &req.encode());
        assert_eq!(AmoReq::read(a.buf()), Some(req));
        let rec = ImmRec {
            kind: IMM_SEND,
            imm: 7,
            len: 0,
        };
        a.buf().write(emu_wire::IMM_OFF, &rec.encode(0));
        assert_eq!(ImmRec::read(a.buf(), a.slots(), 0, 1 << 20), Some(rec));
        assert_eq!(AmoReply::read(a.buf()), None);
        assert!(
            keys.lookup(d.stag, d.addr, 8, Access::REMOTE_ATOMIC)
                .is_err(),
            "not for atomics"
        );
        assert_eq!(LocalEmu::new(&keys, 0).slots(), 1);
        assert_eq!(
            LocalEmu::new(&keys, u32::MAX).slots(),
            emu_wire::MAX_IMM_SLOTS
        );
        drop(a);
        assert!(keys
            .lookup(d.stag, d.addr, 8, Access::REMOTE_WRITE)
            .is_err());
    }

    #[test]
    fn requests_check_key_rights_bounds_alignment_and_wrap() {
        let keys = KeyTable::default();
        let buf = Arc::new(Buffer::new(64));
        let key = keys.insert(buf.clone(), Access::LOCAL_WRITE | Access::REMOTE_ATOMIC);
        let plain = keys.insert(buf.clone(), Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let base = buf.addr();
        let req = |rkey, addr, op| AmoReq {
            seq: 1,
            op,
            addr,
            rkey,
        };
        buf.write(8, &(u64::MAX - 1).to_ne_bytes());
        let add = AmoOp::FetchAdd { add: 5 };
        assert_eq!(execute(&keys, &req(key, base + 8, add)), Ok(u64::MAX - 1));
        assert_eq!(buf.read_pod::<u64>(8), 3, "wraps");
        let cas = |compare, swap| AmoOp::CompareSwap { compare, swap };
        assert_eq!(execute(&keys, &req(key, base + 8, cas(4, 9))), Ok(3));
        assert_eq!(buf.read_pod::<u64>(8), 3);
        assert_eq!(execute(&keys, &req(key, base + 8, cas(3, 9))), Ok(3));
        assert_eq!(buf.read_pod::<u64>(8), 9);
        assert_eq!(
            execute(&keys, &req(plain, base + 8, add)),
            Err(ErrorKind::RemoteAccess),
            "no REMOTE_ATOMIC"
        );
        assert_eq!(
            execute(&keys, &req(key ^ 0x5a5a, base + 8, add)),
            Err(ErrorKind::RemoteAccess),
            "no such key"
        );
        assert_eq!(
            execute(&keys, &req(key, base + 4, add)),
            Err(ErrorKind::RemoteInvalidRequest)
        );
        for addr in [base + 64, base.wrapping_sub(8), base + 60, 0, u64::MAX - 7] {
            assert!(execute(&keys, &req(key, addr, add)).is_err(), "{addr:#x}");
        }
        keys.remove(key);
        assert_eq!(
            execute(&keys, &req(key, base + 8, add)),
            Err(ErrorKind::RemoteAccess),
            "a revoked key"
        );
    }

    #[test]
    fn only_a_peer_offering_both_emulations_gets_them() {
        let d = ExtDesc {
            flags: ALL,
            imm_slots: 4,
            addr: 1,
            stag: 2,
        };
        assert_eq!(offered(Some(d)), Some(d));
        for flags in [0, emu_wire::FLAG_ATOMICS, emu_wire::FLAG_IMMEDIATE] {
            assert_eq!(offered(Some(ExtDesc { flags, ..d })), None);
        }
        assert_eq!(offered(None), None);
    }
}
