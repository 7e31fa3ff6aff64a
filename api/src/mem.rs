//! Registered memory: the one audited module of this crate that uses `unsafe`.
//!
//! A [`Buffer`] is a byte allocation whose address never changes while it lives. It is
//! shared (`Arc<Buffer>`) between the application's [`MemoryRegion`](crate::MemoryRegion)
//! and every operation in flight on it, so the memory cannot be freed or moved while an
//! operation uses it: the last owner frees it.
//!
//! # Where the memory comes from
//! * [`Buffer::new`] / [`Buffer::try_new`]: a page-aligned, zeroed allocation of the
//!   framework's own ([`BUFFER_ALIGN`]).
//! * [`Buffer::from_vec`] / [`Buffer::from_boxed_slice`]: memory the application already
//!   owns, taken over without a copy (a `Vec<T>` of any [`bytemuck::Pod`] type) and given
//!   back by [`Buffer::into_vec`] / [`Buffer::into_boxed_slice`]. A vector whose pointer is
//!   not 8-byte aligned, or which is empty, is copied instead
//!   ([`Buffer::is_borrowed_allocation`] tells which happened).
//! * [`Buffer::try_new_huge`]: an anonymous mapping backed by 2 MiB pages ([`HugePages`]).
//! * [`Buffer::from_raw_parts`]: memory of a foreign allocator (a GPU runtime, a pool),
//!   freed by dropping the owner handle it came with.
//!
//! Whatever the source, every buffer keeps one invariant, which the access model below
//! relies on: its base address is 8-byte aligned, and every byte of the aligned 64-bit words
//! that cover `[0, len)` (that is, `max(len, 1)` rounded up to a multiple of 8 bytes) lies
//! inside the allocation, is initialised, and belongs to the buffer alone. A vector's spare
//! capacity is zero-filled up to that rounded length (after `reserve_exact` if the capacity
//! is short), mappings are zeroed by the kernel, and the caller of `from_raw_parts`
//! promises it.
//!
//! # Access model (docs/contract.md section 2)
//! Registered memory is memory that something outside the program's borrow structure may
//! write at any moment: a NIC by DMA, the kernel copying a socket's bytes, or a software
//! provider's thread placing a remote peer's write. Rust's rules forbid a reference to such
//! memory (a `&[u8]` promises that nothing changes the bytes while it lives, a `&mut [u8]`
//! that nothing else sees them), and forbid a plain access racing with any other access.
//! So a shared buffer hands out no references at all:
//!
//! * **Every access from Rust code is atomic, and always 64 bits wide.** [`Buffer::read`],
//!   [`Buffer::write`], [`Buffer::fill`], the typed copies ([`Buffer::read_pod`],
//!   [`Buffer::write_pod`], [`Buffer::read_slice`], [`Buffer::write_slice`]) and the
//!   providers' placement go through `AtomicU64` on the aligned words that cover the range
//!   (a partial word is merged with a compare-and-swap, so the neighbouring bytes are never
//!   rewritten with stale values; the bytes of the last word past `len` are the buffer's
//!   own, initialised padding, so merging into them is sound too).
//!   [`Buffer::atomic_u64`], which the providers' emulated atomics use, is the same width
//!   on the same words: atomics and plain placement never mix sizes on one location, which
//!   Rust's memory model would not allow when they race. Racing copies are therefore never
//!   undefined behaviour; their bytes are unspecified while an operation targets them,
//!   exactly as with DMA, and only a completion gives them meaning.
//! * **The kernel and the NIC touch the memory through raw pointers** ([`send_gather`],
//!   [`Buffer::recv_into`], `ibv_reg_mr` on [`Buffer::as_mut_ptr`]): they are outside the
//!   Rust abstract machine, as any DMA engine is, and no Rust reference is created.
//! * **Exclusive views need exclusive ownership.** [`Buffer::as_mut_slice`] and the typed
//!   [`Buffer::as_mut_slice_of`] / [`Buffer::as_slice_of`] take `&mut self`: a buffer that
//!   is not shared with any region or operation (before registration, or after
//!   [`MemoryRegion::into_buffer`](crate::MemoryRegion::into_buffer)) can be viewed and
//!   filled in place at full speed. Nothing that can be registered can be viewed that way,
//!   which the compile-fail tests in `api/tests/ui` prove. Typed views and copies need
//!   [`bytemuck::Pod`] types: every bit pattern a peer can write is a valid value.
//!
//! Sizes are checked: a size that overflows is an error ([`Buffer::try_new`]), never a
//! smaller allocation; every range is checked against the buffer's length.

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use bytemuck::Pod;

use crate::{Error, ErrorKind, ProviderCode, Result};

/// Alignment of the buffers the framework allocates itself ([`Buffer::new`]): a page.
/// Buffers made from application memory ([`Buffer::from_vec`], [`Buffer::from_raw_parts`])
/// are 8-byte aligned at least; NICs register any alignment (they pin the pages covering
/// the range).
pub const BUFFER_ALIGN: usize = 4096;

/// Largest buffer: the largest layout size the allocator accepts, rounded down to a page.
pub const MAX_BUFFER_LEN: usize = (isize::MAX as usize) & !(BUFFER_ALIGN - 1);

/// Size and alignment of the pages [`Buffer::try_new_huge`] maps with
/// [`HugePages::Transparent`] (the x86-64 and arm64 PMD size).
pub const HUGE_PAGE_LEN: usize = 2 << 20;

const WORD: usize = 8;

/// Which kind of huge pages [`Buffer::try_new_huge`] asks the kernel for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HugePages {
    /// Transparent huge pages: an ordinary anonymous mapping, 2 MiB aligned and rounded up
    /// to 2 MiB, advised with `madvise(MADV_HUGEPAGE)`. It always succeeds when memory is
    /// available; whether the kernel really backs it with huge pages depends on
    /// `/sys/kernel/mm/transparent_hugepage/enabled` and on free contiguous memory: with
    /// `never` the memory is in normal pages, and a kernel built without THP answers the
    /// `madvise` with `EINVAL`, which is ignored (normal pages too). Either way the buffer
    /// works; only the TLB savings are lost (`AnonHugePages` in `/proc/self/smaps` tells).
    Transparent,
    /// Explicit (hugetlbfs) huge pages of the system's default size: `mmap(MAP_HUGETLB)`,
    /// which fails unless pages were reserved beforehand
    /// (`echo N > /proc/sys/vm/nr_hugepages`); that failure is an [`ErrorKind::Config`]
    /// error naming the fix.
    Explicit,
}

/// Where a buffer's memory comes from, and so how it is freed.
enum Backing {
    /// The framework's allocation (`try_new`): global allocator, this layout.
    Aligned { layout: Layout },
    /// A `Vec<T>`'s allocation taken over by `from_vec`: global allocator, freed with
    /// `Layout::array::<T>(capacity)`, which is `cap_bytes` bytes aligned to `align`.
    Vec { cap_bytes: usize, align: usize },
    /// An anonymous mapping of `map_len` bytes (`try_new_huge`), freed with `munmap`.
    Huge { map_len: usize },
    /// Foreign memory (`from_raw_parts`): dropping `owner` frees it.
    Foreign { _owner: Box<dyn Any + Send + Sync> },
}

impl Backing {
    fn name(&self) -> &'static str {
        match self {
            Backing::Aligned { .. } => "aligned",
            Backing::Vec { .. } => "vec",
            Backing::Huge { .. } => "huge",
            Backing::Foreign { .. } => "foreign",
        }
    }
}

/// A byte buffer with a stable, 8-byte aligned address, suitable for registration.
///
/// See the [module docs](self) for where its memory can come from and how it is accessed.
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: `Buffer` owns its allocation (a foreign owner is `Send + Sync` by its type);
// shared access (`&Buffer`) only ever touches the bytes through `AtomicU64` or hands raw
// pointers to the kernel, so sharing it between threads cannot create a data race; `&mut`
// access is exclusive by the borrow rules.
unsafe impl Send for Buffer {}
// SAFETY: as above: no method on `&self` creates a reference to the bytes.
unsafe impl Sync for Buffer {}

// A foreign owner (`dyn Any`) is never touched before it is dropped, so a panic cannot leave
// it observably broken; the bytes are only ever copied with word atomics. Buffers stay
// usable across `catch_unwind`, as they were before foreign owners existed.
impl std::panic::UnwindSafe for Buffer {}
impl std::panic::RefUnwindSafe for Buffer {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("backing", &self.backing.name())
            .finish()
    }
}

impl Buffer {
    /// Allocates `len` zeroed bytes (a zero-length buffer still gets a distinct address).
    ///
    /// A size beyond [`MAX_BUFFER_LEN`] is an `InvalidArgument` error; running out of memory
    /// aborts, as every Rust allocation does.
    pub fn try_new(len: usize) -> Result<Self> {
        if len > MAX_BUFFER_LEN {
            return Err(Error::invalid(format!(
                "buffer of {len} bytes exceeds the largest allocation ({MAX_BUFFER_LEN} bytes)"
            )));
        }
        // Cannot overflow: len <= MAX_BUFFER_LEN, which is a multiple of the page size.
        let size = len.max(1).next_multiple_of(BUFFER_ALIGN);
        let layout = Layout::from_size_align(size, BUFFER_ALIGN)
            .map_err(|e| Error::invalid(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        Ok(Buffer {
            ptr,
            len,
            backing: Backing::Aligned { layout },
        })
    }

    /// Allocates `len` zeroed bytes; panics (never a smaller buffer) when `len` exceeds
    /// [`MAX_BUFFER_LEN`]. [`try_new`](Self::try_new) returns that as an error.
    pub fn new(len: usize) -> Self {
        Self::try_new(len).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> Self {
        let mut b = Buffer::new(data.len());
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    /// Takes over the allocation of `v` without copying: the buffer's bytes are the
    /// vector's elements (`len()` is `v.len() * size_of::<T>()`), at the vector's address.
    /// [`into_vec`](Self::into_vec) gives the allocation back.
    ///
    /// Every access goes through the aligned 64-bit words covering the bytes (module docs),
    /// so the vector is prepared first: if its capacity ends before the length rounded up to
    /// 8 bytes, `reserve_exact` grows it (which may move it, once); the spare capacity up to
    /// that rounded length is zero-filled. The copy fallbacks, into a fresh
    /// [`Buffer::new`] allocation (check [`is_borrowed_allocation`](Self::is_borrowed_allocation)):
    /// an empty vector (it has no allocation, only a dangling pointer), and a vector whose
    /// pointer is not 8-byte aligned (possible for element types aligned to less than 8:
    /// Rust's allocator promises only `align_of::<T>()`; common allocators give 16).
    ///
    /// # Example: register a vector, get it back
    /// ```
    /// use std::sync::Arc;
    /// use fabric_api::spi::Domain;
    /// use fabric_api::{Access, Buffer};
    /// use fabric_tcp::TcpDomain;
    ///
    /// # fn main() -> fabric_api::Result<()> {
    /// let samples: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    /// let addr = samples.as_ptr() as u64;
    /// let buffer = Buffer::from_vec(samples); // no copy (the allocator aligns to 16)
    /// assert_eq!((buffer.addr(), buffer.len()), (addr, 4000));
    ///
    /// let domain = TcpDomain::open(Default::default())?;
    /// let region = domain.register(Arc::new(buffer), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    /// region.buffer().write_pod(4, &42.0f32); // as a peer's RDMA Write would
    /// // ... post operations on `region`, wait for their completions ...
    ///
    /// // Deregister and take the memory back (Err while an operation still holds it).
    /// let buffer = region.into_buffer().expect("no operation in flight");
    /// let samples: Vec<f32> = buffer.into_vec().expect("a whole number of f32");
    /// assert_eq!(samples.as_ptr() as u64, addr); // the same allocation, still no copy
    /// assert_eq!((samples.len(), samples[1], samples[2]), (1000, 42.0, 1.0));
    /// # Ok(()) }
    /// ```
    pub fn from_vec<T: Pod>(mut v: Vec<T>) -> Buffer {
        let size = size_of::<T>();
        let len = size_of_val(v.as_slice());
        if len == 0 || !(v.as_ptr() as usize).is_multiple_of(WORD) {
            return Buffer::from_slice(bytemuck::cast_slice(&v));
        }
        // Cannot overflow: `len <= isize::MAX`. The elements covering the rounded length:
        let elems = len.next_multiple_of(WORD).div_ceil(size);
        if v.capacity() < elems {
            v.reserve_exact(elems - v.len());
            if !(v.as_ptr() as usize).is_multiple_of(WORD) {
                return Buffer::from_slice(bytemuck::cast_slice(&v));
            }
        }
        let pad = elems - v.len();
        for slot in &mut v.spare_capacity_mut()[..pad] {
            slot.write(T::zeroed());
        }
        let mut v = ManuallyDrop::new(v);
        let cap_bytes = v.capacity() * size;
        let ptr = NonNull::new(v.as_mut_ptr().cast::<u8>()).expect("a non-empty Vec's pointer");
        Buffer {
            ptr,
            len,
            backing: Backing::Vec {
                cap_bytes,
                align: align_of::<T>(),
            },
        }
    }

    /// [`from_vec`](Self::from_vec) for a boxed slice (no copy, unless `from_vec` copies; a
    /// length that is not a multiple of 8 bytes grows the allocation by `reserve_exact`).
    pub fn from_boxed_slice<T: Pod>(b: Box<[T]>) -> Buffer {
        Buffer::from_vec(b.into_vec())
    }

    /// Turns the buffer into a `Vec<T>` of `len() / size_of::<T>()` elements.
    ///
    /// Without a copy when the buffer took over a vector ([`from_vec`](Self::from_vec),
    /// [`is_borrowed_allocation`](Self::is_borrowed_allocation)) whose allocation is a
    /// `Vec<T>`'s too: the same alignment as `T` and a capacity in bytes that is a multiple
    /// of `size_of::<T>()` (always so for the vector's own element type). Otherwise (a
    /// [`Buffer::new`] allocation, huge pages, foreign memory, a copied vector, or a vector
    /// of another layout) the bytes are copied into a new vector and the buffer is freed.
    /// The capacity may exceed the length: the rounding to 8 bytes is kept, zero-filled.
    ///
    /// Gives the buffer back unchanged (`Err`) when `T` does not fit: the length is not a
    /// multiple of `size_of::<T>()`, or `T` is zero-sized.
    pub fn into_vec<T: Pod>(self) -> std::result::Result<Vec<T>, Buffer> {
        let size = size_of::<T>();
        if size == 0 || !self.len.is_multiple_of(size) {
            return Err(self);
        }
        let n = self.len / size;
        if let Backing::Vec { cap_bytes, align } = self.backing {
            if align == align_of::<T>() && cap_bytes % size == 0 {
                let this = ManuallyDrop::new(self);
                // SAFETY: `ptr` is the allocation of a `Vec` (global allocator) of
                // `cap_bytes` bytes aligned to `align`, which is exactly the allocation of a
                // `Vec<T>` of capacity `cap_bytes / size` (same size, same alignment as `T`,
                // the conditions of `Vec::from_raw_parts`); `n * size = len <= cap_bytes`;
                // the first `len` bytes are initialised (the vector's elements, then only
                // written) and any initialised bytes are a valid `T` (`Pod`); `this` is never
                // dropped (its backing owns nothing else), so the new vector is the
                // allocation's only owner and nothing else reaches it (we own `self`).
                return Ok(unsafe {
                    Vec::from_raw_parts(this.ptr.as_ptr().cast::<T>(), n, cap_bytes / size)
                });
            }
        }
        let mut this = self;
        let mut v = vec![T::zeroed(); n];
        bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(this.as_mut_slice());
        Ok(v)
    }

    /// [`into_vec`](Self::into_vec) as a boxed slice. Dropping the spare capacity (the
    /// rounding to 8 bytes, at least) may reallocate, so this is a copy more often than
    /// `into_vec`.
    pub fn into_boxed_slice<T: Pod>(self) -> std::result::Result<Box<[T]>, Buffer> {
        self.into_vec().map(Vec::into_boxed_slice)
    }

    /// True when the buffer's memory is an allocation the caller handed over (a vector
    /// taken over by [`from_vec`](Self::from_vec) without a copy, or foreign memory from
    /// [`from_raw_parts`](Self::from_raw_parts)); false for memory the framework allocated
    /// ([`Buffer::new`], huge pages, or `from_vec`'s copy fallback).
    pub fn is_borrowed_allocation(&self) -> bool {
        matches!(self.backing, Backing::Vec { .. } | Backing::Foreign { .. })
    }

    /// Maps `len` zeroed bytes backed by huge pages (see [`HugePages`]), for large regions
    /// that a NIC then addresses with few translation entries. The mapping is rounded up to
    /// whole huge pages (a zero-length buffer still maps one) and aligned to its page size;
    /// it is unmapped when the buffer is freed.
    ///
    /// Errors: `InvalidArgument` beyond [`MAX_BUFFER_LEN`]; `Config` when explicit huge
    /// pages are not available (the message names the fix, the code is the errno); `Io`
    /// when the kernel refuses the mapping otherwise.
    pub fn try_new_huge(len: usize, pages: HugePages) -> Result<Buffer> {
        let page = match pages {
            HugePages::Transparent => HUGE_PAGE_LEN,
            HugePages::Explicit => default_hugetlb_page_len(),
        };
        let map_len = match len.max(1).checked_next_multiple_of(page) {
            Some(m) if len <= MAX_BUFFER_LEN && m <= MAX_BUFFER_LEN => m,
            _ => {
                return Err(Error::invalid(format!(
                    "huge-page buffer of {len} bytes exceeds the largest mapping \
                     ({MAX_BUFFER_LEN} bytes in whole {page}-byte pages)"
                )))
            }
        };
        let ptr = match pages {
            HugePages::Transparent => map_transparent(map_len)?,
            HugePages::Explicit => map_explicit(map_len, page)?,
        };
        Ok(Buffer {
            ptr,
            len,
            backing: Backing::Huge { map_len },
        })
    }

    /// Wraps memory of a foreign allocator (a device runtime's pinned host memory, a pool)
    /// without a copy. `owner` is dropped when the buffer is freed, after the last
    /// `Arc<Buffer>` and any provider registration are gone: its `Drop` is how the foreign
    /// allocator gets the memory back. On error `owner` is dropped at once.
    ///
    /// Errors (`InvalidArgument`): `ptr` is not 8-byte aligned (every access is an aligned
    /// 64-bit word), or `len` exceeds [`MAX_BUFFER_LEN`].
    ///
    /// # Safety
    /// The caller guarantees, for as long as the buffer lives (until `owner` is dropped):
    /// * `ptr` is valid for reads and writes of `len` bytes rounded up to a multiple of 8,
    ///   and of at least 8 bytes (also when `len` is 0): every byte of the 64-bit words
    ///   covering `[0, len)` lies inside one live allocation;
    /// * those bytes are initialised;
    /// * no Rust reference to those bytes exists, and none is created while the buffer
    ///   lives, except through the buffer's own methods; nothing else accesses them while
    ///   the buffer lives, except through the buffer (or its raw pointer handed to a NIC or
    ///   the kernel under the module's access model);
    /// * the memory stays valid until `owner` is dropped, and nothing but dropping `owner`
    ///   frees it (nothing frees it while the buffer lives).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Buffer> {
        if !(ptr.as_ptr() as usize).is_multiple_of(WORD) {
            return Err(Error::invalid(format!(
                "foreign memory at {:#x} is not 8-byte aligned (buffers are accessed in \
                 aligned 64-bit words)",
                ptr.as_ptr() as usize
            )));
        }
        if len > MAX_BUFFER_LEN {
            return Err(Error::invalid(format!(
                "foreign buffer of {len} bytes exceeds the largest buffer ({MAX_BUFFER_LEN} bytes)"
            )));
        }
        Ok(Buffer {
            ptr,
            len,
            backing: Backing::Foreign { _owner: owner },
        })
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

    /// Raw pointer for FFI registration (`ibv_reg_mr`). The pointer is 8-byte aligned and
    /// valid for `max(len(), 1)` bytes rounded up to a multiple of 8 (at least one whole
    /// word, even for an empty buffer) for as long as this buffer lives; whoever
    /// dereferences it must follow the module's access model (no references, atomic access
    /// only from Rust).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// An exclusive view of the bytes. It needs `&mut self`, so it exists only while the
    /// buffer is shared with nothing: no region, no operation, no peer can reach it.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: every backing holds at least `len` initialised bytes at `ptr` (the
        // module's invariant: zeroed by us or the kernel, a vector's elements, or promised
        // by `from_raw_parts`'s caller; then only ever written), `len <= isize::MAX`, and
        // `&mut self` guarantees no other access for the view's life.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// An exclusive typed view of the whole buffer, like [`as_mut_slice`](Self::as_mut_slice)
    /// (`&mut self`: only while nothing else can reach the memory).
    ///
    /// An `InvalidArgument` error when the length is not a multiple of `size_of::<T>()` or
    /// the address is not aligned for `T` (buffers are 8-byte aligned at least, page-aligned
    /// from [`Buffer::new`]).
    pub fn as_mut_slice_of<T: Pod>(&mut self) -> Result<&mut [T]> {
        let (addr, len) = (self.addr(), self.len);
        bytemuck::try_cast_slice_mut(self.as_mut_slice())
            .map_err(|e| typed_view_error::<T>(addr, len, e))
    }

    /// A typed view of the whole buffer; it needs `&mut self` like
    /// [`as_mut_slice_of`](Self::as_mut_slice_of), with the same errors: a shared buffer's
    /// bytes may change under any reference, so a shared buffer has no view at all.
    pub fn as_slice_of<T: Pod>(&mut self) -> Result<&[T]> {
        self.as_mut_slice_of().map(|v| &*v)
    }

    /// Checks that `[offset, offset+len)` lies inside the buffer.
    pub fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::new(
                crate::ErrorKind::LocalProtection,
                format!("range {offset}+{len} outside buffer of {} bytes", self.len),
            )),
        }
    }

    fn check(&self, offset: usize, len: usize) {
        if let Err(e) = self.check_range(offset, len) {
            panic!("{e}");
        }
    }

    /// The aligned word with index `i` (covering bytes `8i..8i+8` of the allocation).
    #[inline]
    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i * WORD < self.len.max(1).next_multiple_of(WORD));
        // SAFETY: callers pass `i` with `8i < len` (checked ranges), so the word lies in
        // the words covering `[0, len)`, which every backing keeps inside its allocation,
        // initialised and owned by this buffer (module invariant: page-sized allocations,
        // a vector's capacity reserved and zero-filled to the rounded length, whole huge
        // pages, or the promise of `from_raw_parts`'s caller); the address is 8-byte
        // aligned (every base is; checked at run time for foreign memory and vectors); the
        // allocation lives as long as `&self`; and every access from Rust code to these
        // bytes is through `AtomicU64` of this same width (module docs), so no non-atomic
        // or mixed-size access can race with it.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(i * WORD).cast::<u64>()) }
    }

    /// Copies `dst.len()` bytes starting at `offset` into `dst` (word-atomic loads).
    /// Panics when out of bounds.
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len());
        let (mut i, skip) = (offset / WORD, offset % WORD);
        let mut out = dst;
        // A partial first word.
        if skip != 0 && !out.is_empty() {
            let take = (WORD - skip).min(out.len());
            let w = self.word(i).load(Ordering::Relaxed).to_ne_bytes();
            out[..take].copy_from_slice(&w[skip..skip + take]);
            out = &mut out[take..];
            i += 1;
        }
        // Whole words: one load and one 8-byte store each (no copy call per word).
        let mut words = out.chunks_exact_mut(WORD);
        for c in &mut words {
            c.copy_from_slice(&self.word(i).load(Ordering::Relaxed).to_ne_bytes());
            i += 1;
        }
        // A partial last word.
        let rest = words.into_remainder();
        if !rest.is_empty() {
            let w = self.word(i).load(Ordering::Relaxed).to_ne_bytes();
            rest.copy_from_slice(&w[..rest.len()]);
        }
    }

    /// Copies `src` into the buffer at `offset` (word-atomic stores; a partial word is
    /// merged with compare-and-swap). Panics when out of bounds.
    pub fn write(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // A partial word is merged with compare-and-swap.
        let merge = |i: usize, skip: usize, part: &[u8]| {
            // The closure always returns Some: fetch_update cannot fail.
            let _ = self
                .word(i)
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    let mut b = old.to_ne_bytes();
                    b[skip..skip + part.len()].copy_from_slice(part);
                    Some(u64::from_ne_bytes(b))
                });
        };
        let (mut i, skip) = (offset / WORD, offset % WORD);
        let mut rest = src;
        if skip != 0 && !rest.is_empty() {
            let take = (WORD - skip).min(rest.len());
            merge(i, skip, &rest[..take]);
            rest = &rest[take..];
            i += 1;
        }
        // Whole words: one 8-byte load and one store each.
        let mut words = rest.chunks_exact(WORD);
        for c in &mut words {
            let v = u64::from_ne_bytes(c.try_into().expect("8 bytes"));
            self.word(i).store(v, Ordering::Relaxed);
            i += 1;
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            merge(i, 0, tail);
        }
        crate::sync::placed(self); // before the exclusive owner's next look, for helgrind
    }

    /// Copies `len` bytes at `offset` out into a new vector.
    pub fn to_vec(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.read(offset, &mut v);
        v
    }

    /// Copies a value of type `T` out of the buffer at `offset` (any offset: word-atomic
    /// loads, as [`read`](Self::read)). Panics when out of bounds.
    pub fn read_pod<T: Pod>(&self, offset: usize) -> T {
        let mut v = T::zeroed();
        self.read(offset, bytemuck::bytes_of_mut(&mut v));
        v
    }

    /// Copies `value` into the buffer at `offset` (any offset: word-atomic stores, as
    /// [`write`](Self::write)). Panics when out of bounds.
    pub fn write_pod<T: Pod>(&self, offset: usize, value: &T) {
        self.write(offset, bytemuck::bytes_of(value));
    }

    /// Copies `dst.len()` values of type `T` out of the buffer starting at `offset` (as
    /// [`read`](Self::read)). Panics when out of bounds.
    pub fn read_slice<T: Pod>(&self, offset: usize, dst: &mut [T]) {
        self.read(offset, bytemuck::cast_slice_mut(dst));
    }

    /// Copies the values of `src` into the buffer starting at `offset` (as
    /// [`write`](Self::write)). Panics when out of bounds.
    pub fn write_slice<T: Pod>(&self, offset: usize, src: &[T]) {
        self.write(offset, bytemuck::cast_slice(src));
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) {
        self.check(offset, len);
        let chunk = [byte; 512];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(chunk.len());
            self.write(offset + done, &chunk[..n]);
            done += n;
        }
    }

    /// The 64-bit word at `offset` as an atomic, or `None` if it is not 8-byte aligned or
    /// not inside the buffer. Atomic with respect to every other framework atomic and
    /// every copy of this module on the same word. Inlined: the verbs providers read their
    /// areas' words through it on every message (a call in another crate is not inlined
    /// otherwise, and in the soft-RDMA guest a call costs as much as a dozen instructions).
    #[inline]
    pub fn atomic_u64(&self, offset: usize) -> Option<&AtomicU64> {
        // The range check written out (`check_range` builds its error, out of line).
        if !offset.is_multiple_of(WORD) || offset.checked_add(WORD).is_none_or(|e| e > self.len) {
            return None;
        }
        Some(self.word(offset / WORD))
    }

    /// Receives up to `len` bytes from the socket `fd` straight into `[offset, offset+len)`
    /// (`recv(2)` with `flags`): the kernel writes the memory, no Rust reference exists.
    /// Returns the number of bytes received (0 at end of stream).
    pub fn recv_into(
        &self,
        fd: BorrowedFd<'_>,
        offset: usize,
        len: usize,
        flags: i32,
    ) -> io::Result<usize> {
        self.recv_into_spill(fd, offset, len, &mut [], flags)
    }
}

impl Buffer {
    /// [`recv_into`](Self::recv_into), and what the socket holds beyond those `len` bytes,
    /// up to `spill.len()` more, into `spill` in the same `recvmsg(2)`: a framed stream's
    /// payload goes straight into the buffer and the next frame's header into the caller's
    /// bytes, one system call per frame. Returns the total received: bytes past `len` are
    /// in `spill[..total - len]`.
    pub fn recv_into_spill(
        &self,
        fd: BorrowedFd<'_>,
        offset: usize,
        len: usize,
        spill: &mut [u8],
        flags: i32,
    ) -> io::Result<usize> {
        self.check_range(offset, len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let mut iov = [
            libc::iovec {
                // SAFETY: the range is inside the allocation (checked just above).
                iov_base: unsafe { self.ptr.as_ptr().add(offset) }.cast(),
                iov_len: len,
            },
            libc::iovec {
                iov_base: spill.as_mut_ptr().cast(),
                iov_len: spill.len(),
            },
        ];
        // SAFETY: an all-zero msghdr is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        loop {
            // SAFETY: the first iovec is a checked range of this buffer, which stays
            // allocated for the call (`&self`) and which the kernel writes as a DMA engine
            // would (module docs); the second is `spill`, borrowed mutably for the call.
            let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, flags) };
            crate::sync::stream_received(fd, n > 0); // the sends before these bytes, for helgrind
            crate::sync::placed(self); // the kernel's placement, as `write`'s
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// One piece of a gather list handed to the kernel by [`send_gather`].
#[derive(Debug, Clone, Copy)]
pub enum IoPiece<'a> {
    /// Bytes the caller owns (headers, trailers, control messages).
    Bytes(&'a [u8]),
    /// A range of a buffer, read by the kernel without a copy in user space.
    Buffer {
        /// The buffer.
        buffer: &'a Buffer,
        /// First byte.
        offset: usize,
        /// Length in bytes.
        len: usize,
    },
}

impl IoPiece<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            IoPiece::Bytes(b) => b.len(),
            IoPiece::Buffer { len, .. } => *len,
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Most pieces one [`send_gather`] call passes to the kernel (the rest is left unsent, as a
/// short write).
pub const MAX_IO_PIECES: usize = 64;

/// Sends the pieces, starting `skip` bytes in, with one `sendmsg(2)` (`flags` are added to
/// `MSG_NOSIGNAL`). Returns how many bytes the kernel took, which may be fewer than asked
/// (a short write). Buffer ranges are bounds-checked; the kernel reads them through raw
/// pointers, so no Rust reference to shared memory is created.
pub fn send_gather(
    fd: BorrowedFd<'_>,
    pieces: &[IoPiece<'_>],
    mut skip: usize,
    flags: i32,
) -> io::Result<usize> {
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; MAX_IO_PIECES];
    let mut n = 0;
    for p in pieces {
        let len = p.len();
        if skip >= len {
            skip -= len;
            continue;
        }
        if n == MAX_IO_PIECES {
            break;
        }
        let base: *const u8 = match *p {
            IoPiece::Bytes(b) => b.as_ptr(),
            IoPiece::Buffer {
                buffer,
                offset,
                len,
            } => {
                buffer
                    .check_range(offset, len)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
                // SAFETY: `offset` is inside the allocation (checked just above).
                unsafe { buffer.ptr.as_ptr().add(offset) }
            }
        };
        // SAFETY: `skip < len`, so the pointer stays inside the piece.
        iov[n].iov_base = unsafe { base.add(skip) }.cast_mut().cast();
        iov[n].iov_len = len - skip;
        skip = 0;
        n += 1;
    }
    if n == 0 {
        return Ok(0);
    }
    // SAFETY: an all-zero msghdr is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = n as _;
    crate::sync::stream_sending(fd); // what happened so far precedes the peer's receive
    loop {
        // SAFETY: every iovec names memory that is valid for reading for the whole call
        // (slices borrowed by `pieces`, or buffer ranges checked above and kept alive by
        // the borrows); the kernel only reads them.
        let r = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, flags | libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn typed_view_error<T>(addr: u64, len: usize, e: bytemuck::PodCastError) -> Error {
    Error::invalid(format!(
        "buffer at {addr:#x} of {len} bytes cannot be viewed as [{}] (size {}, align {}): {e:?}",
        std::any::type_name::<T>(),
        size_of::<T>(),
        align_of::<T>()
    ))
}

/// The default size of explicit (hugetlbfs) huge pages: `Hugepagesize` in `/proc/meminfo`,
/// 2 MiB when it cannot be read. `munmap` of such a mapping needs whole pages of this size.
fn default_hugetlb_page_len() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("Hugepagesize:"))?;
            let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024).filter(|p| p.is_power_of_two())
        })
        .unwrap_or(HUGE_PAGE_LEN)
}

/// An anonymous read-write private mapping of `len` bytes with extra `flags`.
fn mmap_anonymous(len: usize, flags: i32) -> io::Result<NonNull<u8>> {
    // SAFETY: a new anonymous mapping at an address the kernel chooses: it aliases no
    // existing memory; the result is checked before use.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(NonNull::new(p.cast::<u8>()).expect("mmap does not return address 0 unasked"))
}

/// An error of `kind` for a failed system call, keeping its errno.
fn os_error(kind: ErrorKind, message: String, e: &io::Error) -> Error {
    let err = Error::new(kind, message);
    match e.raw_os_error() {
        Some(errno) => err.with_code(ProviderCode::Errno(errno)),
        None => err,
    }
}

/// Maps `map_len` (a multiple of [`HUGE_PAGE_LEN`]) bytes aligned to [`HUGE_PAGE_LEN`]:
/// maps one huge page more, unmaps the misaligned head and the rest of the tail, then
/// advises `MADV_HUGEPAGE`.
fn map_transparent(map_len: usize) -> Result<NonNull<u8>> {
    let over = map_len + HUGE_PAGE_LEN; // map_len <= MAX_BUFFER_LEN: no overflow
    let base = mmap_anonymous(over, 0).map_err(|e| {
        os_error(
            ErrorKind::Io,
            format!("mapping {over} bytes for transparent huge pages: {e}"),
            &e,
        )
    })?;
    let addr = base.as_ptr() as usize;
    let head = addr.next_multiple_of(HUGE_PAGE_LEN) - addr;
    let tail = over - head - map_len;
    // SAFETY: `head < HUGE_PAGE_LEN`, so the aligned start is inside the mapping.
    let start = unsafe { base.add(head) };
    if head > 0 {
        // SAFETY: `[base, base+head)` is a page-aligned part of the mapping just made
        // (mmap returns page-aligned addresses), which nothing references.
        unsafe { libc::munmap(base.as_ptr().cast(), head) };
    }
    if tail > 0 {
        // SAFETY: `head + map_len + tail == over`, so `[start+map_len, +tail)` is the
        // mapping's page-aligned end, which nothing references.
        unsafe { libc::munmap(start.as_ptr().add(map_len).cast(), tail) };
    }
    // SAFETY: advice on our own fresh mapping; it changes no contents.
    if unsafe { libc::madvise(start.as_ptr().cast(), map_len, libc::MADV_HUGEPAGE) } != 0 {
        let e = io::Error::last_os_error();
        // EINVAL: THP is compiled out of the kernel: normal pages, which is fine.
        if e.raw_os_error() != Some(libc::EINVAL) {
            // SAFETY: unmapping our own mapping, never handed out.
            unsafe { libc::munmap(start.as_ptr().cast(), map_len) };
            return Err(os_error(
                ErrorKind::Io,
                format!("madvise(MADV_HUGEPAGE) of {map_len} bytes: {e}"),
                &e,
            ));
        }
    }
    Ok(start)
}

/// Maps `map_len` bytes (a multiple of `page`) of explicit huge pages.
fn map_explicit(map_len: usize, page: usize) -> Result<NonNull<u8>> {
    mmap_anonymous(map_len, libc::MAP_HUGETLB).map_err(|e| {
        let pages = map_len / page;
        os_error(
            ErrorKind::Config,
            format!(
                "explicit huge pages: mmap(MAP_HUGETLB) of {map_len} bytes ({pages} pages of \
                 {} KiB) failed: {e}; no huge pages reserved: echo {pages} > \
                 /proc/sys/vm/nr_hugepages (as root; HugePages_Free in /proc/meminfo shows \
                 what is left), or use HugePages::Transparent",
                page / 1024
            ),
            &e,
        )
    })
}

impl Drop for Buffer {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: allocated in `try_new` with exactly this layout, freed once.
            Backing::Aligned { layout } => unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) },
            Backing::Vec { cap_bytes, align } => {
                // SAFETY: a `Vec<T>`'s allocation (global allocator, non-zero size) with
                // `cap_bytes = capacity * size_of::<T>()` and `align = align_of::<T>()`,
                // that is `Layout::array::<T>(capacity)`, which is the layout a `Vec`
                // allocates with and frees with (`Vec::from_raw_parts` accepts exactly
                // such `alloc::alloc` memory); `into_vec` did not take it (it forgets
                // the buffer), so it is freed once, here.
                unsafe {
                    let layout = Layout::from_size_align_unchecked(cap_bytes, align);
                    alloc::dealloc(self.ptr.as_ptr(), layout)
                }
            }
            Backing::Huge { map_len } => {
                // SAFETY: our own mapping of exactly `map_len` bytes at `ptr` (whole pages
                // of its page size), unmapped once; nothing outlives the buffer.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), map_len) };
            }
            // The owner field is dropped right after this: that frees the memory.
            Backing::Foreign { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn buffers_are_page_aligned_zeroed_and_bounded() {
        let b = Buffer::new(10);
        assert_eq!(b.addr() % BUFFER_ALIGN as u64, 0);
        assert_eq!(b.to_vec(0, 10), vec![0; 10]);
        b.write(2, b"abc");
        assert_eq!(b.to_vec(1, 5), b"\0abc\0");
        assert!(std::panic::catch_unwind(|| b.to_vec(8, 3)).is_err());
        assert!(std::panic::catch_unwind(|| b.write(usize::MAX, b"x")).is_err());
        assert!(std::panic::catch_unwind(|| b.fill(9, 2, 1)).is_err());
        assert!(b.check_range(10, 0).is_ok());
        assert!(b.check_range(11, 0).is_err());
        assert!(b.check_range(1, usize::MAX).is_err());
    }

    #[test]
    fn oversized_buffers_are_errors_never_smaller_allocations() {
        for len in [usize::MAX, usize::MAX - 4095, MAX_BUFFER_LEN + 1] {
            let e = Buffer::try_new(len).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument, "{len}");
        }
        assert!(std::panic::catch_unwind(|| Buffer::new(usize::MAX)).is_err());
        assert_eq!(Buffer::try_new(0).unwrap().len(), 0);
    }

    #[test]
    fn unaligned_copies_touch_exactly_their_bytes() {
        let b = Buffer::new(64);
        b.fill(0, 64, 0xee);
        let src: Vec<u8> = (0..37).collect();
        b.write(3, &src);
        let all = b.to_vec(0, 64);
        assert_eq!(&all[..3], &[0xee; 3]);
        assert_eq!(&all[3..40], &src[..]);
        assert_eq!(&all[40..], &[0xee; 24]);
        let mut mid = [0u8; 5];
        b.read(6, &mut mid);
        assert_eq!(mid, [3, 4, 5, 6, 7]);
        b.write(64, &[]);
        b.read(64, &mut []);
    }

    #[test]
    fn copies_at_every_offset_and_length_match_a_byte_model() {
        let b = Buffer::new(64);
        let mut model = [0u8; 64];
        for off in 0..24 {
            for len in 0..=40 {
                let src: Vec<u8> = (0..len).map(|i| (off * 41 + i * 7 + 1) as u8).collect();
                b.write(off, &src);
                model[off..off + len].copy_from_slice(&src);
                assert_eq!(b.to_vec(0, 64), model, "write at {off}+{len}");
                let mut got = vec![0u8; len];
                b.read(off, &mut got);
                assert_eq!(got, &model[off..off + len], "read at {off}+{len}");
            }
        }
    }

    #[test]
    fn atomics_need_alignment_and_bounds() {
        let b = Buffer::new(16);
        assert!(b.atomic_u64(4).is_none());
        assert!(b.atomic_u64(16).is_none());
        assert!(b.atomic_u64(usize::MAX - 7).is_none());
        let a = b.atomic_u64(8).unwrap();
        a.fetch_add(5, Ordering::SeqCst);
        assert_eq!(b.to_vec(8, 8), 5u64.to_ne_bytes());
    }

    #[test]
    fn partial_word_writes_never_lose_concurrent_atomics() {
        // A byte copy next to a word under fetch_add must not write back a stale value.
        let b = std::sync::Arc::new(Buffer::new(16));
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            for _ in 0..100_000 {
                b2.atomic_u64(0)
                    .unwrap()
                    .fetch_add(1 << 32, Ordering::SeqCst);
            }
        });
        for i in 0..100_000u32 {
            b.write(0, &[(i % 251) as u8]);
        }
        t.join().unwrap();
        let v = b.atomic_u64(0).unwrap().load(Ordering::SeqCst);
        assert_eq!(v >> 32, 100_000);
    }

    #[test]
    fn exclusive_views_and_kernel_io() {
        let mut b = Buffer::new(8);
        b.as_mut_slice().copy_from_slice(b"12345678");
        assert_eq!(Buffer::from_slice(b"xy").to_vec(0, 2), b"xy");
        let (mut a, c) = std::os::unix::net::UnixStream::pair().unwrap();
        let head = *b"<";
        let n = send_gather(
            c.as_fd(),
            &[
                IoPiece::Bytes(&head),
                IoPiece::Buffer {
                    buffer: &b,
                    offset: 2,
                    len: 4,
                },
                IoPiece::Bytes(b">"),
            ],
            0,
            0,
        )
        .unwrap();
        assert_eq!(n, 6);
        let mut got = [0u8; 6];
        a.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"<3456>");
        // Skipping into the second piece.
        let n = send_gather(
            c.as_fd(),
            &[IoPiece::Bytes(b"ab"), IoPiece::Bytes(b"cd")],
            3,
            0,
        )
        .unwrap();
        assert_eq!(n, 1);
        a.read_exact(&mut got[..1]).unwrap();
        assert_eq!(got[0], b'd');
        let bad = [IoPiece::Buffer {
            buffer: &b,
            offset: 6,
            len: 4,
        }];
        assert!(send_gather(c.as_fd(), &bad, 0, 0).is_err());
        a.write_all(b"zz").unwrap();
        assert_eq!(b.recv_into(c.as_fd(), 6, 2, 0).unwrap(), 2);
        assert_eq!(b.to_vec(0, 8), b"123456zz");
        assert!(b.recv_into(c.as_fd(), 7, 2, 0).is_err());
        // The payload into the buffer, the next frame's header into the spill bytes, the
        // rest left in the socket.
        a.write_all(b"PQRSthe-next-frame").unwrap();
        let mut spill = [0u8; 8];
        assert_eq!(
            b.recv_into_spill(c.as_fd(), 2, 4, &mut spill, 0).unwrap(),
            12
        );
        assert_eq!(b.to_vec(0, 8), b"12PQRSzz");
        assert_eq!(&spill, b"the-next");
        let mut rest = [0u8; 6];
        (&c).read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"-frame");
        assert!(b.recv_into_spill(c.as_fd(), 6, 4, &mut spill, 0).is_err());
    }

    #[test]
    fn vec_round_trips_keep_the_allocation_and_the_data() {
        let v: Vec<u8> = (0..64).collect();
        let (ptr, cap) = (v.as_ptr(), v.capacity());
        let b = Buffer::from_vec(v);
        assert!(b.is_borrowed_allocation(), "{b:?}");
        assert_eq!((b.addr(), b.len()), (ptr as u64, 64));
        assert_eq!(b.to_vec(60, 4), [60, 61, 62, 63]);
        let back: Vec<u8> = b.into_vec().unwrap();
        assert_eq!((back.as_ptr(), back.capacity()), (ptr, cap));
        assert_eq!(back, (0..64).collect::<Vec<u8>>());

        let v: Vec<f32> = (0..1000).map(|i| i as f32 / 4.0).collect();
        let ptr = v.as_ptr();
        let b = Buffer::from_vec(v);
        assert!(b.is_borrowed_allocation());
        assert_eq!((b.addr(), b.len()), (ptr as u64, 4000));
        assert_eq!(b.read_pod::<f32>(4 * 999), 999.0 / 4.0);
        b.write_pod(8, &-1.5f32);
        let back: Vec<f32> = b.into_vec().unwrap();
        assert_eq!(back.as_ptr(), ptr);
        assert_eq!(
            (back.len(), back[1], back[2], back[3]),
            (1000, 0.25, -1.5, 0.75)
        );

        // Boxed slices, and a vector of another element type copied back.
        let b = Buffer::from_boxed_slice(vec![7u64, 8, 9].into_boxed_slice());
        assert!(b.is_borrowed_allocation());
        assert_eq!(b.read_pod::<u64>(16), 9);
        let back: Box<[u64]> = b.into_boxed_slice().unwrap();
        assert_eq!(&*back, &[7, 8, 9]);
        let b = Buffer::from_vec(vec![1u16, 2, 3, 4]);
        let as_u64: Vec<u64> = b.into_vec().unwrap(); // align 2 != 8: copied
        assert_eq!(
            as_u64,
            [u64::from_ne_bytes(bytemuck::cast::<[u16; 4], [u8; 8]>([
                1, 2, 3, 4
            ]))]
        );
    }

    #[test]
    fn a_vec_of_13_bytes_is_padded_and_given_back_whole() {
        let mut v = Vec::with_capacity(13);
        v.extend_from_slice(b"hello, world!");
        assert_eq!(v.capacity(), 13);
        let b = Buffer::from_vec(v);
        assert_eq!(b.len(), 13);
        assert!(b.is_borrowed_allocation());
        b.write(12, b"?");
        assert_eq!(b.to_vec(0, 13), b"hello, world?");
        // The last word's padding (bytes 13..16) is initialised zeros and stays so.
        b.write(10, b"LD");
        assert_eq!(b.read_pod::<u8>(12), b'?');
        assert!(std::panic::catch_unwind(|| b.write(13, b"x")).is_err());
        assert!(std::panic::catch_unwind(|| b.read_pod::<u32>(10)).is_err());
        let back: Vec<u8> = b.into_vec().unwrap();
        assert_eq!(back, b"hello, worLD?");
        assert!(back.capacity() >= 16);
        // Odd element sizes: [u8; 3] elements, 15 bytes.
        let b = Buffer::from_vec(vec![[1u8, 2, 3]; 5]);
        assert_eq!(b.len(), 15);
        b.write(14, &[9]);
        let back: Vec<[u8; 3]> = b.into_vec().unwrap();
        assert_eq!(back[4], [1, 2, 9]);
    }

    #[test]
    fn partial_word_writes_at_the_end_keep_their_neighbours() {
        let b = Buffer::from_vec(vec![0xaau8; 21]);
        b.write(17, &[1, 2]);
        b.write(20, &[3]);
        assert_eq!(b.to_vec(16, 5), [0xaa, 1, 2, 0xaa, 3]);
        let [lo, hi] = 0x0102u16.to_ne_bytes();
        b.write_slice(15, &[0x0102u16]); // across the word boundary at 16
        assert_eq!(b.to_vec(14, 5), [0xaa, lo, hi, 1, 2]);
        let mut two = [0u16; 2];
        b.read_slice(15, &mut two);
        assert_eq!(two, [0x0102, u16::from_ne_bytes([1, 2])]);
        let back: Vec<u8> = b.into_vec().unwrap();
        assert_eq!(&back[..14], &[0xaa; 14]);
        assert_eq!(&back[14..], [0xaa, lo, hi, 1, 2, 0xaa, 3]);
    }

    #[test]
    fn empty_vecs_get_a_real_allocation() {
        let b = Buffer::from_vec(Vec::<u32>::new());
        assert!(!b.is_borrowed_allocation());
        let c = Buffer::from_vec(Vec::<u32>::with_capacity(4));
        assert!(b.addr() != c.addr() && b.addr().is_multiple_of(BUFFER_ALIGN as u64));
        assert_eq!(b.len(), 0);
        assert_eq!(b.into_vec::<u32>().unwrap(), Vec::<u32>::new());
        // Zero-sized elements: no bytes, no way back.
        let z = Buffer::from_vec(vec![(); 3]);
        assert_eq!(z.len(), 0);
        assert!(z.into_vec::<()>().is_err());
    }

    #[test]
    fn into_vec_refuses_what_does_not_fit() {
        let b = Buffer::from_vec(vec![1u32, 2, 3]);
        let addr = b.addr();
        let b = b
            .into_vec::<u64>()
            .expect_err("12 bytes are not whole u64s");
        assert_eq!((b.addr(), b.len()), (addr, 12));
        assert!(b.is_borrowed_allocation());
        assert_eq!(b.into_vec::<u32>().unwrap(), [1, 2, 3]);
        // A framework allocation is copied out.
        let b = Buffer::from_slice(&[5; 12]);
        let b = b.into_vec::<u64>().expect_err("12 bytes");
        assert_eq!(b.into_vec::<[u8; 6]>().unwrap(), [[5; 6]; 2]);
    }

    #[test]
    fn typed_views_need_fitting_length_and_alignment() {
        let mut b = Buffer::from_vec(vec![1.0f64, 2.0, 3.0]);
        b.as_mut_slice_of::<f64>().unwrap()[1] = 20.0;
        assert_eq!(b.as_slice_of::<f64>().unwrap(), [1.0, 20.0, 3.0]);
        assert_eq!(b.as_slice_of::<u32>().unwrap().len(), 6);
        let e = b.as_mut_slice_of::<[u8; 5]>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("[u8; 5]"), "{e}");
        // Misaligned for the type: a 16-byte aligned type on an 8-aligned-only address.
        let mut b = Buffer::new(64);
        assert!(b.as_mut_slice_of::<u128>().is_ok());
        assert_eq!(b.read_pod::<[u64; 2]>(3), [0, 0]);
        b.write_pod(60, &0xdead_beef_u32);
        assert_eq!(b.read_pod::<u32>(60), 0xdead_beef);
        assert!(std::panic::catch_unwind(|| b.write_pod(61, &0u32)).is_err());
        let mut dst = [0u32; 2];
        assert!(std::panic::catch_unwind(move || b.read_slice(57, &mut dst)).is_err());
    }

    #[test]
    fn transparent_huge_pages_are_aligned_zeroed_and_usable() {
        let len = 3 << 20; // 3 MiB: two huge pages mapped
        let b = Buffer::try_new_huge(len, HugePages::Transparent).unwrap();
        assert_eq!(b.len(), len);
        assert_eq!(b.addr() % HUGE_PAGE_LEN as u64, 0, "{b:?}");
        assert!(!b.is_borrowed_allocation());
        assert_eq!(b.to_vec(len - 8, 8), [0; 8]);
        b.write(len - 3, b"end");
        b.write_pod(1 << 20, &7u64);
        assert_eq!(b.to_vec(len - 4, 4), b"\0end");
        assert_eq!(b.atomic_u64(1 << 20).unwrap().load(Ordering::SeqCst), 7);
        let v: Vec<u8> = b.into_vec().unwrap(); // copied out, then unmapped
        assert_eq!(&v[len - 3..], b"end");
        let empty = Buffer::try_new_huge(0, HugePages::Transparent).unwrap();
        assert_eq!((empty.len(), empty.addr() % HUGE_PAGE_LEN as u64), (0, 0));
        let e = Buffer::try_new_huge(usize::MAX, HugePages::Transparent).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    /// A `/proc/meminfo` field, in its unit.
    fn meminfo(field: &str) -> Option<usize> {
        let m = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = m.lines().find(|l| l.starts_with(field))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    #[test]
    fn explicit_huge_pages_work_or_name_the_fix() {
        let page = default_hugetlb_page_len();
        let free = meminfo("HugePages_Free:").unwrap_or(0);
        let overcommit = std::fs::read_to_string("/proc/sys/vm/nr_overcommit_hugepages")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(0);
        match Buffer::try_new_huge(100, HugePages::Explicit) {
            Ok(b) => {
                assert!(
                    free > 0 || overcommit > 0,
                    "mapped with no page free: {b:?}"
                );
                assert_eq!(b.addr() % page as u64, 0);
                assert_eq!(b.to_vec(92, 8), [0; 8]);
                b.write(99, b"x");
                assert_eq!(b.to_vec(99, 1), b"x");
            }
            Err(e) => {
                // (Racy only if another process takes the free pages meanwhile.)
                assert_eq!(free, 0, "huge pages were free, yet: {e}");
                assert_eq!(e.kind(), ErrorKind::Config, "{e}");
                assert!(
                    matches!(e.code(), Some(ProviderCode::Errno(n)) if n > 0),
                    "{e:?}"
                );
                let text = e.to_string();
                assert!(
                    text.contains("no huge pages reserved: echo 1 > /proc/sys/vm/nr_hugepages"),
                    "{text}"
                );
                assert!(
                    text.contains("os error") && text.contains("errno"),
                    "{text}"
                );
                if free == 0 && overcommit == 0 {
                    // The errno the kernel gives for an empty pool.
                    assert_eq!(e.code(), Some(ProviderCode::Errno(libc::ENOMEM)), "{e}");
                }
            }
        }
    }

    struct Owner {
        storage: Vec<u64>,
        dropped: Arc<AtomicUsize>,
    }

    impl Drop for Owner {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Foreign memory: an owner holding 4 words, and the pointer to them.
    fn foreign(dropped: &Arc<AtomicUsize>) -> (NonNull<u8>, Box<Owner>) {
        let mut owner = Box::new(Owner {
            storage: vec![0x0101_0101_0101_0101; 4],
            dropped: dropped.clone(),
        });
        let ptr = NonNull::new(owner.storage.as_mut_ptr().cast::<u8>()).unwrap();
        (ptr, owner)
    }

    #[test]
    fn foreign_owners_drop_once_when_the_last_arc_goes() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let (ptr, owner) = foreign(&dropped);
        // SAFETY: `ptr` names the 32 initialised bytes of `owner.storage`, a heap
        // allocation that moves with the box and lives until the owner is dropped; nothing
        // else references them from here on.
        let b = unsafe { Buffer::from_raw_parts(ptr, 29, owner) }.unwrap();
        assert!(b.is_borrowed_allocation());
        assert_eq!((b.addr(), b.len()), (ptr.as_ptr() as u64, 29));
        assert_eq!(b.to_vec(27, 2), [1, 1]);
        b.write(28, &[9]);
        let shared = Arc::new(b);
        let other = shared.clone();
        let t = std::thread::spawn(move || other.read_pod::<u8>(28));
        assert_eq!(t.join().unwrap(), 9);
        let last = shared.clone();
        drop(shared);
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "an Arc still holds it");
        drop(last);
        assert_eq!(dropped.load(Ordering::SeqCst), 1);

        // Given back as a vector: copied out, then the owner is dropped, once.
        let dropped = Arc::new(AtomicUsize::new(0));
        let (ptr, owner) = foreign(&dropped);
        // SAFETY: as above.
        let b = unsafe { Buffer::from_raw_parts(ptr, 0, owner) }.unwrap();
        let b = Arc::new(b);
        let v: Vec<u8> = Arc::try_unwrap(b).unwrap().into_vec().unwrap();
        assert_eq!((v.len(), dropped.load(Ordering::SeqCst)), (0, 1));
    }

    #[test]
    fn misaligned_foreign_memory_is_refused() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let (ptr, owner) = foreign(&dropped);
        // SAFETY: `ptr + 4` is inside the owner's 32 initialised bytes, valid for the 16
        // asked; the call refuses the address before any access.
        let e = unsafe { Buffer::from_raw_parts(ptr.add(4), 16, owner) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("not 8-byte aligned"), "{e}");
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            1,
            "the owner is dropped on error"
        );
    }

    #[test]
    fn a_vec_survives_registration_and_into_buffer() {
        #[derive(Debug)]
        struct Reg;
        impl crate::Registration for Reg {
            fn local_key(&self) -> u32 {
                1
            }
            fn remote_key(&self) -> u32 {
                2
            }
            fn revoke(&self) {}
        }
        let v: Vec<u32> = (0..100).collect();
        let ptr = v.as_ptr();
        let mr = crate::MemoryRegion::new(
            Arc::new(Buffer::from_vec(v)),
            crate::Access::LOCAL_WRITE,
            1,
            Box::new(Reg),
        );
        assert_eq!(mr.desc().addr, ptr as u64);
        mr.buffer().write_pod(4 * 99, &7u32);
        let back: Vec<u32> = mr.into_buffer().unwrap().into_vec().unwrap();
        assert_eq!(back.as_ptr(), ptr);
        assert_eq!((back[98], back[99]), (98, 7));
    }
}
