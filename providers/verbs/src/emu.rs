//! Emulated atomics and immediate data between peers of this framework on iWARP (RFC 5040
//! RDMAP has no atomic opcodes and no immediate data, and the kernel's siw implements none
//! of RFC 7306's), over base RDMAP only. The protocol and its wire records (trailer, slot
//! layouts, check word) are [`fabric_api::emu_wire`], shared with the tcp provider, which
//! speaks it with this provider; this module adds what only this provider needs: the
//! helper thread's polling pace and the domain's table of keys that grant atomics.
//!
//! # Atomics here
//! The domain's helper thread (the one that already retries held sends and probes dead
//! peers) polls the request slots of the domain's emulating endpoints, adaptively (without
//! sleeping while atomics flow and for [`SPIN`] after, then backing off to [`POLL_MAX`] when
//! idle, slower the longer no atomic came ([`QUIET_SHARE`], up to [`POLL_STRETCH`]), and to
//! [`POLL_STRETCH`] at once while the application's own polls look at the areas and
//! serve what they find, see [`EmuWatch`]), checks the key (a region registered with
//! REMOTE_ATOMIC in that domain, see [`AtomicKeys`]), the bounds and the alignment, and runs the operation with the same
//! `AtomicU64` on the same 8-byte word that every framework atomic on the word uses
//! (`Buffer::atomic_u64`). The initiator's helper thread sees the reply in its reply slot,
//! stores the old value into the application's result buffer and completes the request.
//! One emulated atomic is outstanding per endpoint: requests posted after it are held back
//! until its reply arrived. A refused atomic completes `RemoteAccess` at the initiator and
//! puts both endpoints in the error state: the target disconnects once its reply left.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fabric_api::{Buffer, ErrorKind};

pub(crate) use fabric_api::emu_wire::*;

/// The largest inline write the emulation needs (an atomic request).
pub(crate) const NEEDS_INLINE: u32 = REQ_LEN as u32;
/// The helper thread's quickest poll of the emulation areas (while atomics flow).
pub(crate) const POLL_MIN: Duration = Duration::from_micros(20);
/// How long the helper thread keeps polling the emulation areas without sleeping (it
/// yields between passes) after the last sign of an atomic in flight: a sleep on a timer
/// costs a millisecond or more on a loaded or emulated machine, more than the atomic.
pub(crate) const SPIN: Duration = Duration::from_millis(1);
/// The helper thread's slowest poll of the emulation areas while the application does not
/// poll and its domain saw an atomic in the last `POLL_MAX * QUIET_SHARE` (32 ms): the
/// latency an atomic arriving at such a target waits at most before it is executed.
pub(crate) const POLL_MAX: Duration = Duration::from_millis(2);
/// Past that, the helper's slowest pace is this share of the time since its domain's last
/// atomic (up to [`POLL_STRETCH`]): an atomic arriving at a target whose application does
/// not poll waits at most a sixteenth of how long the target's domain went without one.
/// Each pass of the helper wakes a thread that takes a CPU from whatever runs: at the 2 ms
/// pace, the 8-byte read ping-pong on siw (whose target application waits, and never
/// polls) ran at 2.03x `ib_read_lat` at its median, and 1.46x with the helper slowed to
/// a stop (an A/B in one soft-RDMA boot, docs/benchmarks-record.md, twenty-eighth session).
pub(crate) const QUIET_SHARE: u32 = 16;
/// The helper thread's slowest poll of the emulation areas while every area was looked
/// at by a poll of its application since the helper's last pass ([`EmuWatch::look`]: a
/// poll that finds a request or a reply serves it itself); also the slowest pace of a
/// long-quiet domain ([`QUIET_SHARE`]). Each wake-up of the helper costs a spinning
/// application its CPU for a moment: at the 2 ms pace, the 8-byte transmit-complete write
/// ping-pong on siw ran at 1.30x `ib_write_lat` and 1.07x with this (docs/benchmarks-record.md,
/// twenty-seventh session). The price: an atomic arriving just as its target's
/// application stopped polling waits up to about twice this once.
pub(crate) const POLL_STRETCH: Duration = Duration::from_millis(32);

/// The helper thread's slowest pace of looking at the emulation areas, `quiet` after its
/// domain's last atomic: [`POLL_STRETCH`] while the applications' polls look at every
/// area (`covered`), else `quiet / QUIET_SHARE` between [`POLL_MAX`] and [`POLL_STRETCH`].
pub(crate) fn slowest(quiet: Duration, covered: bool) -> Duration {
    if covered {
        POLL_STRETCH
    } else {
        (quiet / QUIET_SHARE).clamp(POLL_MAX, POLL_STRETCH)
    }
}

/// What a poll of the application compares with an endpoint's emulation area without the
/// endpoint's lock: the ledger's emulation state (kept equal to it under that lock) and
/// the area. A completion queue lists the watches of its endpoints (`CqState::looked`) and
/// every poll looks at one of them in turn; a look that finds a request or a reply has the
/// endpoint serve it (`EpCore::poll_emu`) once the queue's lock is released. While every
/// area was looked at since the helper's last pass, the helper looks only every
/// [`POLL_STRETCH`]. A look is a few loads and a store: no read-modify-write, which the
/// soft-RDMA guest's emulated CPUs make expensive (a look that took and dropped a counted
/// reference per poll made the 8-byte write ping-pong slower, not faster:
/// docs/benchmarks-record.md).
#[derive(Debug)]
pub(crate) struct EmuWatch {
    /// Our emulation area (the peer writes into it).
    area: Arc<Buffer>,
    /// The peer's last request we served (`Ledger::amo_served`).
    pub served: AtomicU64,
    /// Our atomic waiting for its reply (`Ledger::amo_wait`; 0: none, sequence numbers
    /// start at 1).
    pub wait: AtomicU64,
    /// A poll looked at the area since the helper last asked.
    pub looked: AtomicBool,
}

impl EmuWatch {
    /// The watch of the emulation area `area`.
    pub fn new(area: Arc<Buffer>) -> EmuWatch {
        EmuWatch {
            area,
            served: AtomicU64::new(0),
            wait: AtomicU64::new(0),
            looked: AtomicBool::new(false),
        }
    }

    /// Our emulation area.
    pub fn area(&self) -> &Buffer {
        &self.area
    }

    /// A poll's look: whether the reply to our atomic or the peer's next request waits in
    /// the area (a hint: only the sequence words are compared; `poll_emu` checks the
    /// record). Notes the look for the helper. Inlined: every poll of a queue with areas
    /// to watch looks at one.
    #[inline]
    pub fn look(&self) -> bool {
        let seq = |off| {
            self.area
                .atomic_u64(off)
                .map_or(0, |w| u64::from_le(w.load(Ordering::Acquire)))
        };
        let wait = self.wait.load(Ordering::Acquire);
        let due = (wait != 0 && seq(REPLY_OFF) == wait)
            || seq(REQ_OFF) == self.served.load(Ordering::Acquire).wrapping_add(1);
        self.looked.store(true, Ordering::Release);
        due
    }
}

/// The keys of a domain that grant emulated atomics (regions registered with
/// REMOTE_ATOMIC): remote key to the region's memory. A key leaves the map when it is
/// revoked, before the device may hand it out again.
#[derive(Debug, Default)]
pub(crate) struct AtomicKeys {
    map: Mutex<HashMap<u32, Arc<Buffer>>>,
}

impl AtomicKeys {
    /// Grants emulated atomics through `rkey` on `buf`.
    pub fn insert(&self, rkey: u32, buf: Arc<Buffer>) {
        self.map.lock().expect("keys poisoned").insert(rkey, buf);
    }

    /// Revokes `rkey` (deregistration).
    pub fn remove(&self, rkey: u32) {
        self.map.lock().expect("keys poisoned").remove(&rkey);
    }

    /// Executes a request: the old value, or why not. Runs under the map's lock, so a key
    /// revoked meanwhile is never used after its revocation returned.
    pub fn execute(&self, req: &AmoReq) -> Result<u64, ErrorKind> {
        let map = self.map.lock().expect("keys poisoned");
        let buf = map.get(&req.rkey).ok_or(ErrorKind::RemoteAccess)?;
        if !req.addr.is_multiple_of(8) {
            return Err(ErrorKind::RemoteInvalidRequest);
        }
        let off = req
            .addr
            .checked_sub(buf.addr())
            .and_then(|o| usize::try_from(o).ok())
            .ok_or(ErrorKind::RemoteAccess)?;
        let word = buf.atomic_u64(off).ok_or(ErrorKind::RemoteAccess)?;
        Ok(match req.op {
            AmoOp::FetchAdd { add } => word.fetch_add(add, Ordering::SeqCst),
            AmoOp::CompareSwap { compare, swap } => {
                match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_helper_slows_with_the_quiet_and_stretches_while_polls_look() {
        let ms = Duration::from_millis;
        // Polls look at every area: the stretched pace, however recent the last atomic.
        assert_eq!(slowest(ms(0), true), POLL_STRETCH);
        // Nobody polls: 2 ms while atomics came lately, then a sixteenth of the quiet.
        assert_eq!(slowest(ms(0), false), POLL_MAX);
        assert_eq!(slowest(ms(32), false), POLL_MAX);
        assert_eq!(slowest(ms(160), false), ms(10));
        assert_eq!(slowest(ms(512), false), POLL_STRETCH);
        assert_eq!(slowest(Duration::from_secs(3600), false), POLL_STRETCH);
    }

    #[test]
    fn atomics_check_key_bounds_alignment_and_wrap() {
        let keys = AtomicKeys::default();
        let buf = Arc::new(Buffer::new(64));
        keys.insert(5, buf.clone());
        let base = buf.addr();
        let req = |rkey, addr, op| AmoReq {
            seq: 1,
            op,
            addr,
            rkey,
        };
        buf.write(8, &(u64::MAX - 1).to_ne_bytes());
        let add = AmoOp::FetchAdd { add: 5 };
        assert_eq!(keys.execute(&req(5, base + 8, add)), Ok(u64::MAX - 1));
        assert_eq!(buf.atomic_u64(8).unwrap().load(Ordering::SeqCst), 3);
        let cas = |compare, swap| AmoOp::CompareSwap { compare, swap };
        assert_eq!(keys.execute(&req(5, base + 8, cas(4, 9))), Ok(3));
        assert_eq!(buf.atomic_u64(8).unwrap().load(Ordering::SeqCst), 3);
        assert_eq!(keys.execute(&req(5, base + 8, cas(3, 9))), Ok(3));
        assert_eq!(buf.atomic_u64(8).unwrap().load(Ordering::SeqCst), 9);
        assert_eq!(
            keys.execute(&req(6, base + 8, add)),
            Err(ErrorKind::RemoteAccess)
        );
        assert_eq!(
            keys.execute(&req(5, base + 4, add)),
            Err(ErrorKind::RemoteInvalidRequest)
        );
        for addr in [base + 64, base - 8, base + 60, 0, u64::MAX - 7] {
            assert!(keys.execute(&req(5, addr, add)).is_err(), "{addr:#x}");
        }
        keys.remove(5);
        assert_eq!(
            keys.execute(&req(5, base + 8, add)),
            Err(ErrorKind::RemoteAccess),
            "a revoked key"
        );
    }
}
