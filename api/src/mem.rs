//! Registered memory: the one audited module of this crate that uses `unsafe`.
//!
//! A [`Buffer`] is a page-aligned, zero-initialised heap allocation whose address never
//! changes while it lives. It is shared (`Arc<Buffer>`) between the application's
//! [`MemoryRegion`](crate::MemoryRegion) and every operation in flight on it, so the memory
//! cannot be freed or moved while an operation uses it: the last owner frees it.
//!
//! # Concurrency model
//! Registered memory is, by its nature, memory that something outside the program's
//! borrow structure writes to: a NIC by DMA, or a software provider's progress thread on
//! behalf of a remote peer. Exactly as on RDMA hardware, the bytes of a region that a remote
//! operation targets are unspecified while that operation is in progress; the contract
//! (semantics.md) only gives meaning to them once a completion (or an application-level
//! message) says the operation is done. This module therefore hands out byte copies and
//! short-lived slices through raw pointers, never long-lived references, and 64-bit atomic
//! access for the atomic operations. A concurrent plain access and a remote write to the same
//! bytes is a race on their values (as with DMA), never on the allocation itself.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// Alignment of every buffer: a page, so buffers can be registered with any NIC.
pub const BUFFER_ALIGN: usize = 4096;

/// A page-aligned byte buffer with a stable address, suitable for registration.
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: `Buffer` owns its allocation exclusively; all access goes through methods that
// copy bytes or perform atomic operations through raw pointers (see the module docs).
unsafe impl Send for Buffer {}
// SAFETY: as above; shared access never creates overlapping `&mut` references that outlive
// a method call.
unsafe impl Sync for Buffer {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

impl Buffer {
    /// Allocates `len` zeroed bytes (a zero-length buffer still gets a distinct address).
    pub fn new(len: usize) -> Self {
        let size = len.max(1).next_multiple_of(BUFFER_ALIGN);
        let layout = Layout::from_size_align(size, BUFFER_ALIGN).expect("buffer size overflow");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        Buffer { ptr, len, layout }
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> Self {
        let b = Buffer::new(data.len());
        b.write(0, data);
        b
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer's virtual address, as remote peers address it.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Raw pointer for FFI registration (`ibv_reg_mr`). The pointer is valid for `len()`
    /// bytes for as long as this buffer lives.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} outside buffer of {} bytes",
            self.len
        );
    }

    /// Copies `dst.len()` bytes starting at `offset` into `dst`. Panics when out of bounds.
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len());
        // SAFETY: the range is inside the allocation (checked above) and `dst` is a distinct
        // Rust allocation, so the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        }
    }

    /// Copies `src` into the buffer at `offset`. Panics when out of bounds.
    pub fn write(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: the range is inside the allocation and `src` cannot overlap it (no safe
        // reference into the buffer outlives a method call of this type).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len())
        }
    }

    /// Copies `len` bytes at `offset` out into a new vector.
    pub fn to_vec(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.read(offset, &mut v);
        v
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) {
        self.check(offset, len);
        // SAFETY: the range is inside the allocation.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), byte, len) }
    }

    /// Runs `f` on the bytes `[offset, offset+len)`; used by providers to hand payload to
    /// the kernel without a copy. Panics when out of bounds.
    pub fn with_slice<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.check(offset, len);
        // SAFETY: the range is inside the allocation; the slice does not escape `f`. Bytes
        // written concurrently by a remote operation are a value race only (module docs).
        let s = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) };
        f(s)
    }

    /// Runs `f` on the bytes `[offset, offset+len)` mutably; used by providers to place
    /// payload straight from the socket. Panics when out of bounds.
    pub fn with_slice_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> R {
        self.check(offset, len);
        // SAFETY: the range is inside the allocation and the slice does not escape `f`.
        // Providers serialise their own placement per endpoint; overlap with a concurrent
        // application access is the DMA-style value race described in the module docs.
        let s = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) };
        f(s)
    }

    /// The 64-bit word at `offset` as an atomic, or `None` if it is not 8-byte aligned or
    /// not inside the buffer.
    pub fn atomic_u64(&self, offset: usize) -> Option<&AtomicU64> {
        if offset % 8 != 0 || offset.checked_add(8).is_none_or(|end| end > self.len) {
            return None;
        }
        // SAFETY: in bounds and 8-byte aligned (the base is page-aligned); the allocation
        // lives as long as `&self`; every framework atomic on this word goes through
        // `AtomicU64`, which is what makes them atomic with respect to one another.
        Some(unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(offset).cast::<u64>()) })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn buffers_are_page_aligned_zeroed_and_bounded() {
        let b = Buffer::new(10);
        assert_eq!(b.addr() % BUFFER_ALIGN as u64, 0);
        assert_eq!(b.to_vec(0, 10), vec![0; 10]);
        b.write(2, b"abc");
        assert_eq!(b.to_vec(1, 5), b"\0abc\0");
        assert!(std::panic::catch_unwind(|| b.to_vec(8, 3)).is_err());
    }

    #[test]
    fn atomics_need_alignment_and_bounds() {
        let b = Buffer::new(16);
        assert!(b.atomic_u64(4).is_none());
        assert!(b.atomic_u64(16).is_none());
        let a = b.atomic_u64(8).unwrap();
        a.fetch_add(5, Ordering::SeqCst);
        assert_eq!(b.to_vec(8, 8), 5u64.to_ne_bytes());
    }
}
