//! Memory regions: registered buffers, their access rights and their remote descriptors.

use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Buffer, Error, ErrorKind, Result};

bitflags::bitflags! {
    /// Access rights of a memory region (local read is always implied).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
    pub struct Access: u32 {
        /// The local endpoint may write into the region (receives, read sinks, atomic results).
        const LOCAL_WRITE = 1;
        /// Remote peers may write into the region.
        const REMOTE_WRITE = 1 << 1;
        /// Remote peers may read the region.
        const REMOTE_READ = 1 << 2;
        /// Remote peers may perform atomics on the region.
        const REMOTE_ATOMIC = 1 << 3;
    }
}

impl Access {
    /// Checks the contract's registration rule: REMOTE_WRITE or REMOTE_ATOMIC without
    /// LOCAL_WRITE is rejected, on every provider.
    pub fn validate(self) -> Result<()> {
        if self.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
            && !self.contains(Access::LOCAL_WRITE)
        {
            return Err(Error::invalid(format!(
                "access {self:?} grants remote write or atomic access without LOCAL_WRITE"
            )));
        }
        Ok(())
    }
}

/// What a peer needs to address a region remotely: plain data, safe to send anywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteDesc {
    /// Virtual address of the first byte at the target.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key (rkey / STag).
    pub key: u32,
}

impl RemoteDesc {
    /// Size of the wire encoding.
    pub const ENCODED_LEN: usize = 20;

    /// Big-endian wire encoding (addr, len, key), for exchanging descriptors in messages.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..].copy_from_slice(&self.key.to_be_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes); a short input is an error naming the length.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() < Self::ENCODED_LEN {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "remote descriptor needs {} bytes, got {}",
                    Self::ENCODED_LEN,
                    b.len()
                ),
            ));
        }
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(RemoteDesc {
            addr: u64_at(0),
            len: u64_at(8),
            key: u32::from_be_bytes(b[16..20].try_into().expect("4 bytes")),
        })
    }

    /// The remote address `offset` bytes into the region.
    pub fn at(&self, offset: u64) -> crate::RemoteAddr {
        crate::RemoteAddr {
            addr: self.addr.wrapping_add(offset),
            key: self.key,
        }
    }
}

/// A provider's side of a registration: keys, and what to do when it is revoked or freed.
///
/// Dropping the registration (when the last operation using the region has completed and
/// the application has dropped its handle) releases the provider's resources.
pub trait Registration: Send + Sync + fmt::Debug {
    /// Key the local endpoint uses to name the region (lkey).
    fn local_key(&self) -> u32;
    /// Key remote peers use (rkey / STag).
    fn remote_key(&self) -> u32;
    /// Makes the remote key dead at once (deregistration); the memory itself stays alive
    /// until no operation uses it.
    fn revoke(&self);
}

static NEXT_DOMAIN_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh process-unique domain identity, for providers to tag their regions with.
pub fn next_domain_id() -> u64 {
    NEXT_DOMAIN_ID.fetch_add(1, Ordering::Relaxed)
}

struct RegionInner {
    buffer: Arc<Buffer>,
    access: Access,
    domain_id: u64,
    revoked: AtomicBool,
    /// The registration's local key, read once: it names the region on every request.
    local_key: u32,
    registration: Box<dyn Registration>,
}

impl RegionInner {
    /// The checks of [`Slice::check_local`]: the passing case inline (every post runs
    /// it), the error's text apart.
    #[inline]
    fn check_local(&self, domain_id: u64, need: Access) -> Result<()> {
        if self.domain_id == domain_id
            && !self.revoked.load(Ordering::Acquire)
            && self.access.contains(need)
        {
            return Ok(());
        }
        self.local_refusal(domain_id, need)
    }

    /// Why [`check_local`](Self::check_local) refuses. A second look finds the same: the
    /// domain and the access never change, and a region once revoked stays revoked.
    #[cold]
    #[inline(never)]
    fn local_refusal(&self, domain_id: u64, need: Access) -> Result<()> {
        if self.domain_id != domain_id {
            return Err(Error::new(
                ErrorKind::LocalProtection,
                "region belongs to another domain or provider",
            ));
        }
        if self.revoked.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::LocalProtection,
                "region is deregistered",
            ));
        }
        if !self.access.contains(need) {
            return Err(Error::new(
                ErrorKind::LocalProtection,
                format!("region lacks {need:?} access"),
            ));
        }
        Ok(())
    }
}

/// A registered memory region. It owns (shares) its buffer; operations in flight hold a
/// [`RegionRef`], so the memory outlives them whatever the application does.
///
/// Dropping the region, or calling [`deregister`](Self::deregister), kills its remote key at
/// once.
pub struct MemoryRegion {
    inner: Arc<RegionInner>,
}

/// A counted reference to a region, held by operations in flight and by providers.
#[derive(Clone)]
pub struct RegionRef {
    inner: Arc<RegionInner>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("desc", &self.desc())
            .field("access", &self.inner.access)
            .finish()
    }
}

impl fmt::Debug for RegionRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionRef")
            .field("addr", &format_args!("{:#x}", self.inner.buffer.addr()))
            .field("len", &self.inner.buffer.len())
            .finish()
    }
}

impl MemoryRegion {
    /// Builds a region; called by providers after they registered `buffer`.
    pub fn new(
        buffer: Arc<Buffer>,
        access: Access,
        domain_id: u64,
        registration: Box<dyn Registration>,
    ) -> Self {
        MemoryRegion {
            inner: Arc::new(RegionInner {
                buffer,
                access,
                domain_id,
                revoked: AtomicBool::new(false),
                local_key: registration.local_key(),
                registration,
            }),
        }
    }

    /// The remote descriptor to hand to peers.
    pub fn desc(&self) -> RemoteDesc {
        RemoteDesc {
            addr: self.inner.buffer.addr(),
            len: self.inner.buffer.len() as u64,
            key: self.inner.registration.remote_key(),
        }
    }

    /// The underlying buffer: read and write its bytes through copies ([`Buffer::read`],
    /// [`Buffer::write`]), which are sound whatever a peer does meanwhile.
    pub fn buffer(&self) -> &Buffer {
        &self.inner.buffer
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.buffer.len()
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Access rights.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// A slice of the region for use in a work request; out of bounds is an error.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<Slice<'_>> {
        // Checked: `..=usize::MAX` or an excluded `usize::MAX` start is out of bounds, never
        // a wrapped-around small range.
        let start = match range.start_bound() {
            Bound::Included(&s) => Some(s),
            Bound::Excluded(&s) => s.checked_add(1),
            Bound::Unbounded => Some(0),
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.checked_add(1),
            Bound::Excluded(&e) => Some(e),
            Bound::Unbounded => Some(self.len()),
        };
        let (start, end) = match (start, end) {
            (Some(s), Some(e)) => (s, e),
            _ => (usize::MAX, 0),
        };
        if start > end || end > self.len() {
            return Err(Error::new(
                ErrorKind::LocalProtection,
                format!(
                    "slice {start}..{end} outside region of {} bytes",
                    self.len()
                ),
            ));
        }
        Ok(Slice {
            region: self,
            offset: start,
            len: end - start,
        })
    }

    /// The whole region as a slice.
    pub fn all(&self) -> Slice<'_> {
        Slice {
            region: self,
            offset: 0,
            len: self.len(),
        }
    }

    /// Kills the remote key now; the memory is freed when nothing uses it any more.
    pub fn deregister(self) {
        drop(self)
    }

    /// Deregisters the region and gives its memory back for exclusive use
    /// ([`Buffer::as_mut_slice`]). The remote key dies first; if an operation still holds
    /// the memory, the shared buffer comes back instead (copies work on it; try again with
    /// `Arc::try_unwrap` once the operations have completed).
    pub fn into_buffer(self) -> std::result::Result<Buffer, Arc<Buffer>> {
        let inner = self.inner.clone();
        drop(self); // revokes the key: no peer can reach the memory any more
        match Arc::try_unwrap(inner) {
            Ok(inner) => {
                let RegionInner {
                    buffer,
                    registration,
                    ..
                } = inner;
                drop(registration); // the provider releases its registration first
                Arc::try_unwrap(buffer).inspect(crate::sync::owned_again)
            }
            Err(inner) => Err(inner.buffer.clone()),
        }
    }

    /// A counted reference for providers and operations in flight.
    pub fn to_ref(&self) -> RegionRef {
        RegionRef {
            inner: self.inner.clone(),
        }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if !self.inner.revoked.swap(true, Ordering::AcqRel) {
            self.inner.registration.revoke();
        }
    }
}

impl RegionRef {
    /// The buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.inner.buffer
    }
    /// A shared handle on the buffer, keeping the memory alive on its own.
    pub fn shared_buffer(&self) -> Arc<Buffer> {
        self.inner.buffer.clone()
    }
    /// Access rights.
    pub fn access(&self) -> Access {
        self.inner.access
    }
    /// The domain the region was registered in.
    pub fn domain_id(&self) -> u64 {
        self.inner.domain_id
    }
    /// The registration's local key (read once, when the region was built).
    pub fn local_key(&self) -> u32 {
        self.inner.local_key
    }
    /// The provider registration (keys).
    pub fn registration(&self) -> &dyn Registration {
        &*self.inner.registration
    }
    /// True once the application deregistered (dropped) the region.
    pub fn is_revoked(&self) -> bool {
        self.inner.revoked.load(Ordering::Acquire)
    }
}

/// A byte range of a region named by a work request: the region is borrowed for the call
/// and the provider takes its own [`RegionRef`] for as long as the operation is in flight.
#[derive(Clone, Copy)]
pub struct Slice<'a> {
    region: &'a MemoryRegion,
    offset: usize,
    len: usize,
}

impl fmt::Debug for Slice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Slice({:#x}+{}..{})",
            self.region.inner.buffer.addr(),
            self.offset,
            self.offset + self.len
        )
    }
}

impl<'a> Slice<'a> {
    /// The region.
    pub fn region(&self) -> &'a MemoryRegion {
        self.region
    }
    /// Offset within the region.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Checks that the slice may be used locally by an endpoint of `domain_id` with the
    /// given access (`LOCAL_WRITE` for sinks); returns a counted reference.
    #[inline]
    pub fn check_local(&self, domain_id: u64, need: Access) -> Result<RegionRef> {
        self.region.inner.check_local(domain_id, need)?;
        Ok(self.region.to_ref())
    }

    /// The checks of [`check_local`](Self::check_local) without the counted reference,
    /// for memory used only while the caller borrows the slice (an inline payload the
    /// provider copies during the call). Returns the address of the slice's first byte
    /// and the region's local key.
    #[inline]
    pub fn check_local_now(&self, domain_id: u64, need: Access) -> Result<(u64, u32)> {
        let r = &*self.region.inner;
        r.check_local(domain_id, need)?;
        Ok((r.buffer.addr() + self.offset as u64, r.local_key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct NoReg(std::sync::Arc<AtomicBool>);
    impl Registration for NoReg {
        fn local_key(&self) -> u32 {
            1
        }
        fn remote_key(&self) -> u32 {
            2
        }
        fn revoke(&self) {
            self.0.store(true, Ordering::SeqCst)
        }
    }

    #[test]
    fn remote_write_without_local_write_is_rejected() {
        assert!((Access::REMOTE_WRITE).validate().is_err());
        assert!((Access::REMOTE_ATOMIC | Access::REMOTE_READ)
            .validate()
            .is_err());
        assert!((Access::REMOTE_WRITE | Access::LOCAL_WRITE)
            .validate()
            .is_ok());
        assert!((Access::REMOTE_READ).validate().is_ok());
    }

    #[test]
    fn descriptors_round_trip_and_reject_short_input() {
        let d = RemoteDesc {
            addr: 0x1234_5678_9abc,
            len: 77,
            key: 0xdead_beef,
        };
        assert_eq!(RemoteDesc::from_bytes(&d.to_bytes()).unwrap(), d);
        assert_eq!(
            RemoteDesc::from_bytes(&[0; 5]).unwrap_err().kind(),
            ErrorKind::Protocol
        );
    }

    #[test]
    fn dropping_revokes_but_in_flight_refs_keep_memory() {
        let flag = Arc::new(AtomicBool::new(false));
        let mr = MemoryRegion::new(
            Arc::new(Buffer::new(8)),
            Access::LOCAL_WRITE,
            7,
            Box::new(NoReg(flag.clone())),
        );
        let held = mr
            .slice(0..8)
            .unwrap()
            .check_local(7, Access::LOCAL_WRITE)
            .unwrap();
        assert!(mr.slice(4..9).is_err());
        assert!(mr.slice(0..=usize::MAX).is_err());
        assert!(mr
            .slice((Bound::Excluded(usize::MAX), Bound::Unbounded))
            .is_err());
        assert!(mr.slice(8..8).unwrap().is_empty());
        assert_eq!(
            mr.slice(..)
                .unwrap()
                .check_local(8, Access::empty())
                .unwrap_err()
                .kind(),
            ErrorKind::LocalProtection
        );
        let lacks = mr
            .slice(..)
            .unwrap()
            .check_local(7, Access::REMOTE_WRITE)
            .unwrap_err();
        assert_eq!(lacks.kind(), ErrorKind::LocalProtection);
        assert!(lacks.to_string().contains("lacks"), "{lacks}");
        assert_eq!(
            mr.slice(..)
                .unwrap()
                .check_local_now(7, Access::LOCAL_WRITE)
                .unwrap(),
            (mr.buffer().addr(), held.local_key())
        );
        drop(mr);
        assert!(flag.load(Ordering::SeqCst));
        assert!(held.is_revoked());
        held.buffer().write(0, b"still ok");
    }

    #[test]
    fn checking_without_a_reference_applies_the_same_rules_and_holds_nothing() {
        let flag = Arc::new(AtomicBool::new(false));
        let mr = MemoryRegion::new(
            Arc::new(Buffer::new(16)),
            Access::empty(),
            7,
            Box::new(NoReg(flag.clone())),
        );
        let s = mr.slice(4..12).unwrap();
        assert_eq!(
            s.check_local_now(7, Access::empty()).unwrap(),
            (mr.buffer().addr() + 4, 1),
            "the slice's first byte and the registration's local key"
        );
        for (domain, need) in [(8, Access::empty()), (7, Access::LOCAL_WRITE)] {
            let kind = |r: Result<()>| r.unwrap_err().kind();
            assert_eq!(
                kind(s.check_local_now(domain, need).map(drop)),
                ErrorKind::LocalProtection
            );
            assert_eq!(
                kind(s.check_local(domain, need).map(drop)),
                ErrorKind::LocalProtection
            );
        }
        // No counted reference was taken: the region's memory is the application's again.
        assert!(mr.into_buffer().is_ok());
        assert!(flag.load(Ordering::SeqCst));
    }

    #[test]
    fn into_buffer_is_exclusive_only_when_nothing_holds_the_memory() {
        let region = |flag: &Arc<AtomicBool>| {
            MemoryRegion::new(
                Arc::new(Buffer::from_slice(b"abcdefgh")),
                Access::LOCAL_WRITE,
                7,
                Box::new(NoReg(flag.clone())),
            )
        };
        let flag = Arc::new(AtomicBool::new(false));
        let mut b = region(&flag).into_buffer().expect("nothing else holds it");
        assert!(flag.load(Ordering::SeqCst), "the key dies first");
        b.as_mut_slice()[0] = b'A';
        assert_eq!(b.to_vec(0, 2), b"Ab");

        let flag = Arc::new(AtomicBool::new(false));
        let mr = region(&flag);
        let in_flight = mr.to_ref();
        let shared = mr.into_buffer().expect_err("an operation holds the memory");
        assert!(flag.load(Ordering::SeqCst));
        assert_eq!(shared.to_vec(0, 8), b"abcdefgh");
        drop(in_flight);
        assert!(Arc::try_unwrap(shared).is_ok());
    }
}
