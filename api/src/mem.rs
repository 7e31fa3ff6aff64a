//! Registered memory: the one audited module of this crate that uses `unsafe`.
//!
//! A [`Buffer`] is a page-aligned, zero-initialised heap allocation whose address never
//! changes while it lives. It is shared (`Arc<Buffer>`) between the application's
//! [`MemoryRegion`](crate::MemoryRegion) and every operation in flight on it, so the memory
//! cannot be freed or moved while an operation uses it: the last owner frees it.
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
//!   [`Buffer::write`], [`Buffer::fill`] and the providers' placement go through
//!   `AtomicU64` on the aligned words that cover the range (a partial word is merged with a
//!   compare-and-swap, so the neighbouring bytes are never rewritten with stale values).
//!   [`Buffer::atomic_u64`], which the providers' emulated atomics use, is the same width
//!   on the same words: atomics and plain placement never mix sizes on one location, which
//!   Rust's memory model would not allow when they race. Racing copies are therefore never
//!   undefined behaviour; their bytes are unspecified while an operation targets them,
//!   exactly as with DMA, and only a completion gives them meaning.
//! * **The kernel and the NIC touch the memory through raw pointers** ([`send_gather`],
//!   [`Buffer::recv_into`], `ibv_reg_mr` on [`Buffer::as_mut_ptr`]): they are outside the
//!   Rust abstract machine, as any DMA engine is, and no Rust reference is created.
//! * **Exclusive views need exclusive ownership.** [`Buffer::as_mut_slice`] takes
//!   `&mut self`: a buffer that is not shared with any region or operation (before
//!   registration, or after [`MemoryRegion::into_buffer`](crate::MemoryRegion::into_buffer))
//!   can be viewed and filled in place at full speed. Nothing that can be registered can be
//!   viewed that way, which the compile-fail tests in `api/tests/ui` prove.
//!
//! Sizes are checked: a size that overflows is an error ([`Buffer::try_new`]), never a
//! smaller allocation; every range is checked against the buffer's length.

use std::alloc::{self, Layout};
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// Alignment of every buffer: a page, so buffers can be registered with any NIC.
pub const BUFFER_ALIGN: usize = 4096;

/// Largest buffer: the largest layout size the allocator accepts, rounded down to a page.
pub const MAX_BUFFER_LEN: usize = (isize::MAX as usize) & !(BUFFER_ALIGN - 1);

const WORD: usize = 8;

/// A page-aligned byte buffer with a stable address, suitable for registration.
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: `Buffer` owns its allocation; shared access (`&Buffer`) only ever touches the
// bytes through `AtomicU64` or hands raw pointers to the kernel, so sharing it between
// threads cannot create a data race; `&mut` access is exclusive by the borrow rules.
unsafe impl Send for Buffer {}
// SAFETY: as above: no method on `&self` creates a reference to the bytes.
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
        Ok(Buffer { ptr, len, layout })
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
    /// bytes for as long as this buffer lives; whoever dereferences it must follow the
    /// module's access model (no references, atomic access only from Rust).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// An exclusive view of the bytes. It needs `&mut self`, so it exists only while the
    /// buffer is shared with nothing: no region, no operation, no peer can reach it.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the allocation holds at least `len` initialised (zeroed, then only ever
        // written) bytes, and `&mut self` guarantees no other access for the view's life.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
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
    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i * WORD < self.layout.size());
        // SAFETY: callers pass `i` with `8i < len` rounded up to a word, which is inside
        // the allocation (its size is a multiple of the page size, so whole words are);
        // the address is 8-byte aligned (page-aligned base); the allocation lives as long
        // as `&self`; and every access from Rust code to these bytes is through
        // `AtomicU64` of this same width (module docs), so no non-atomic or mixed-size
        // access can race with it.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(i * WORD).cast::<u64>()) }
    }

    /// Copies `dst.len()` bytes starting at `offset` into `dst` (word-atomic loads).
    /// Panics when out of bounds.
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len());
        let mut at = offset;
        let mut out = dst;
        while !out.is_empty() {
            let (i, skip) = (at / WORD, at % WORD);
            let take = (WORD - skip).min(out.len());
            let w = self.word(i).load(Ordering::Relaxed).to_ne_bytes();
            out[..take].copy_from_slice(&w[skip..skip + take]);
            out = &mut out[take..];
            at += take;
        }
    }

    /// Copies `src` into the buffer at `offset` (word-atomic stores; a partial word is
    /// merged with compare-and-swap). Panics when out of bounds.
    pub fn write(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        let mut at = offset;
        let mut rest = src;
        while !rest.is_empty() {
            let (i, skip) = (at / WORD, at % WORD);
            let take = (WORD - skip).min(rest.len());
            let word = self.word(i);
            if take == WORD {
                let v = u64::from_ne_bytes(rest[..WORD].try_into().expect("8 bytes"));
                word.store(v, Ordering::Relaxed);
            } else {
                let part = &rest[..take];
                // The closure always returns Some: fetch_update cannot fail.
                let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    let mut b = old.to_ne_bytes();
                    b[skip..skip + take].copy_from_slice(part);
                    Some(u64::from_ne_bytes(b))
                });
            }
            rest = &rest[take..];
            at += take;
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
    /// every copy of this module on the same word.
    pub fn atomic_u64(&self, offset: usize) -> Option<&AtomicU64> {
        if offset % WORD != 0 || self.check_range(offset, WORD).is_err() {
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
        self.check_range(offset, len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        loop {
            // SAFETY: the range is inside the allocation (checked) and stays allocated for
            // the call (`&self`); the kernel writes it as a DMA engine would (module docs).
            let n = unsafe {
                libc::recv(
                    fd.as_raw_fd(),
                    self.ptr.as_ptr().add(offset).cast(),
                    len,
                    flags,
                )
            };
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

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `try_new` with exactly this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::sync::atomic::Ordering;

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
    }
}
