//! STags: the domain's table of remotely accessible regions.
//!
//! STags are drawn from the operating system's random source, never sequential; a
//! deregistered STag is removed at once, and the first invalid access tears the connection
//! down (Terminate), so guessing costs a reconnect per try.

use std::collections::HashMap;
use std::sync::Arc;

use fabric_api::sync::RwLock;

use fabric_api::{Access, Buffer, Registration};

use crate::wire::ddp::{term, Terminate};

#[derive(Debug)]
struct Entry {
    buffer: Arc<Buffer>,
    access: Access,
}

/// The STag table of one domain.
#[derive(Debug, Default)]
pub(crate) struct KeyTable {
    map: RwLock<HashMap<u32, Entry>>,
}

/// A validated remote access: the buffer and the offset of the first byte in it.
pub(crate) struct Target {
    pub buffer: Arc<Buffer>,
    pub offset: usize,
}

pub(crate) fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    getrandom::getrandom(&mut b).expect("the operating system's random source failed");
    u32::from_ne_bytes(b)
}

impl KeyTable {
    /// Registers `buffer`, returning a fresh random STag (never 0).
    pub fn insert(&self, buffer: Arc<Buffer>, access: Access) -> u32 {
        let mut map = self.map.write().expect("key table poisoned");
        loop {
            let stag = random_u32();
            if stag != 0 && !map.contains_key(&stag) {
                map.insert(stag, Entry { buffer, access });
                return stag;
            }
        }
    }

    /// Kills `stag` at once.
    pub fn remove(&self, stag: u32) {
        self.map.write().expect("key table poisoned").remove(&stag);
    }

    /// Validates a remote access of `len` bytes at virtual address `to` needing `need`.
    pub fn lookup(&self, stag: u32, to: u64, len: u64, need: Access) -> Result<Target, Terminate> {
        let map = self.map.read().expect("key table poisoned");
        let e = map.get(&stag).ok_or(term::INVALID_STAG)?;
        if !e.access.contains(need) {
            return Err(term::ACCESS_RIGHTS);
        }
        let base = e.buffer.addr();
        let end = to.checked_add(len).ok_or(term::BASE_BOUNDS)?;
        if to < base || end > base + e.buffer.len() as u64 {
            return Err(term::BASE_BOUNDS);
        }
        Ok(Target {
            buffer: e.buffer.clone(),
            offset: (to - base) as usize,
        })
    }
}

/// The provider side of a registration: removing the STag on revoke.
#[derive(Debug)]
pub(crate) struct TcpRegistration {
    pub table: Arc<KeyTable>,
    pub stag: u32,
}

impl Registration for TcpRegistration {
    fn local_key(&self) -> u32 {
        self.stag
    }
    fn remote_key(&self) -> u32 {
        self.stag
    }
    fn revoke(&self) {
        self.table.remove(self.stag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_check_key_access_and_bounds() {
        let t = KeyTable::default();
        let buf = Arc::new(Buffer::new(64));
        let base = buf.addr();
        let k = t.insert(buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        assert_eq!(
            t.lookup(k, base + 8, 8, Access::REMOTE_WRITE)
                .unwrap()
                .offset,
            8
        );
        assert_eq!(
            t.lookup(k ^ 1, base, 8, Access::REMOTE_WRITE).err(),
            Some(term::INVALID_STAG)
        );
        assert_eq!(
            t.lookup(k, base, 8, Access::REMOTE_READ).err(),
            Some(term::ACCESS_RIGHTS)
        );
        assert_eq!(
            t.lookup(k, base + 60, 8, Access::REMOTE_WRITE).err(),
            Some(term::BASE_BOUNDS)
        );
        assert_eq!(
            t.lookup(k, base - 1, 1, Access::REMOTE_WRITE).err(),
            Some(term::BASE_BOUNDS)
        );
        assert_eq!(
            t.lookup(k, u64::MAX, 2, Access::REMOTE_WRITE).err(),
            Some(term::BASE_BOUNDS)
        );
        t.remove(k);
        assert_eq!(
            t.lookup(k, base, 8, Access::REMOTE_WRITE).err(),
            Some(term::INVALID_STAG)
        );
    }

    #[test]
    fn stags_are_not_sequential() {
        let t = KeyTable::default();
        let keys: Vec<u32> = (0..64)
            .map(|_| t.insert(Arc::new(Buffer::new(1)), Access::empty()))
            .collect();
        let sequential = keys
            .windows(2)
            .filter(|w| w[1].wrapping_sub(w[0]) < 1024)
            .count();
        assert!(sequential < 4, "keys look sequential: {keys:x?}");
    }
}
