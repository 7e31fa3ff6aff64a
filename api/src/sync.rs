//! Locks that tell valgrind's race detector what they order.
//!
//! Rust's `std::sync` locks are built on futexes and atomics, which valgrind's helgrind does
//! not see as synchronisation: every access a `std::sync::Mutex` orders looks like a data
//! race to it. [`Mutex`], [`Condvar`] and [`RwLock`] here are std's, plus one valgrind client
//! request per acquisition and per release naming the happens-before edge the lock creates
//! (helgrind's `ANNOTATE_HAPPENS_AFTER` on acquiring, `ANNOTATE_HAPPENS_BEFORE` before
//! releasing, both on the lock's address). Their API is std's, so swapping one in is a
//! `use` line. For protocols built on atomics, [`happens_before`] and [`happens_after`]
//! name the edge a release store and the acquire load that reads it create.
//!
//! Outside valgrind a client request is a few register instructions that do nothing (the
//! "magic" preamble of `valgrind.h`, x86-64 only; other targets compile them away), so the
//! annotations are always compiled in and `scripts/valgrind --tool helgrind` checks the
//! same binary that the tests run. Measured (the ignored test `annotation_cost`, release,
//! 2026-11-23, a loaded 2-core host): an uncontended lock and unlock pair took 5.5 to 6.0
//! ns with the annotations and 5.6 to 6.3 ns with std's mutex alone, a difference below
//! the noise. The socket annotations ([`stream_sending`], [`stream_received`]) cost one
//! client request per system call outside valgrind; only under valgrind do they look up
//! the connection's addresses.
//!
//! What has no annotation here: a value published through `OnceLock` or `LazyLock` (std's
//! `Once`, also invisible to helgrind) is ordered for the threads that read it, but
//! helgrind reports their first read as a race with its initialisation whenever nothing
//! else it sees lies between the two threads. Such a value cannot be annotated from the
//! outside (the read happens inside `get`, before any annotation after it), so code that
//! threads share makes such values before it shares them or reads them under one of the
//! locks here (the tcp engine's hand-off timer and `Notifier`'s pipe: a CI failure of the
//! helgrind job, 2026-12-02).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{LockResult, PoisonError, TryLockError, TryLockResult, WaitTimeoutResult};
use std::time::Duration;

/// The client requests, as `valgrind.h` and `helgrind.h` define them.
#[allow(unsafe_code)]
mod request {
    /// `VG_USERREQ_TOOL_BASE('H','G')`.
    const HG_BASE: usize = (b'H' as usize) << 24 | (b'G' as usize) << 16;
    /// `_VG_USERREQ__HG_USERSO_SEND_PRE` (`ANNOTATE_HAPPENS_BEFORE`).
    pub(super) const SEND_PRE: usize = HG_BASE + 256 + 33;
    /// `_VG_USERREQ__HG_USERSO_RECV_POST` (`ANNOTATE_HAPPENS_AFTER`).
    pub(super) const RECV_POST: usize = HG_BASE + 256 + 34;
    /// `_VG_USERREQ__HG_USERSO_FORGET_ALL` (`ANNOTATE_HAPPENS_BEFORE_FORGET_ALL`).
    pub(super) const FORGET_ALL: usize = HG_BASE + 256 + 35;
    /// `_VG_USERREQ__HG_ARANGE_MAKE_UNTRACKED` (`VALGRIND_HG_DISABLE_CHECKING`).
    pub(super) const UNTRACKED: usize = HG_BASE + 256 + 39;
    /// `VG_USERREQ__RUNNING_ON_VALGRIND`.
    pub(super) const RUNNING_ON_VALGRIND: usize = 0x1001;

    /// Issues client request `code` with one argument; returns valgrind's answer, or 0
    /// when the program does not run under valgrind.
    #[inline(always)]
    pub(super) fn one(code: usize, arg: usize) -> usize {
        two(code, arg, 0)
    }

    /// Issues client request `code` with two arguments (as [`one`]).
    #[inline(always)]
    pub(super) fn two(code: usize, arg: usize, arg2: usize) -> usize {
        #[cfg(target_arch = "x86_64")]
        {
            let args: [usize; 6] = [code, arg, arg2, 0, 0, 0];
            let result: usize;
            // SAFETY: valgrind.h's x86-64 client request. Natively the four rotations of
            // rdi add up to 128 bits (rdi is unchanged, declared clobbered anyway) and
            // `xchg rbx, rbx` changes nothing; only the flags change (not preserved).
            // Under valgrind the sequence reads the six words at rax (alive until the asm
            // ends) and writes the answer to rdx, which starts at the default 0.
            unsafe {
                std::arch::asm!(
                    "rol rdi, 3",
                    "rol rdi, 13",
                    "rol rdi, 61",
                    "rol rdi, 51",
                    "xchg rbx, rbx",
                    inout("rdx") 0usize => result,
                    in("rax") args.as_ptr(),
                    out("rdi") _,
                    options(nostack),
                );
            }
            result
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (code, arg, arg2);
            0
        }
    }
}

fn addr<T: ?Sized>(obj: &T) -> usize {
    (obj as *const T).cast::<()>() as usize
}

/// Tells valgrind's helgrind that everything this thread did so far happens before
/// whatever a later [`happens_after`] on the same object does (`ANNOTATE_HAPPENS_BEFORE`).
/// Call it just before the release store (or read-modify-write) that publishes the work.
/// Outside valgrind it does nothing, in a few instructions.
#[inline(always)]
pub fn happens_before<T: ?Sized>(obj: &T) {
    request::one(request::SEND_PRE, addr(obj));
}

/// The other end of [`happens_before`] (`ANNOTATE_HAPPENS_AFTER`): call it just after the
/// acquire load (or read-modify-write) that saw the published value.
#[inline(always)]
pub fn happens_after<T: ?Sized>(obj: &T) {
    request::one(request::RECV_POST, addr(obj));
}

/// `CLOCK_MONOTONIC` in nanoseconds since an unspecified start (the system's boot; never 0
/// once the system is up): a cheap timestamp any thread can compare with any other
/// thread's. It has no shared state: a clock measured from a lazily set process-wide
/// epoch (`LazyLock<Instant>`) publishes the epoch through std's `Once`, which helgrind
/// does not see, so each thread's first read of it looks like a race once the read is
/// inlined into its caller (an optimised build), where no suppression can name it.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through the pointer, which points to a
    // live local that nothing else references during the call.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    // CLOCK_MONOTONIC exists on every Linux kernel and the pointer is valid: it cannot fail.
    debug_assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

/// Tells helgrind that `atomic`'s own bytes are only ever accessed atomically, so that
/// it stops checking them (`VALGRIND_HG_DISABLE_CHECKING` on them): atomic accesses never
/// race, but helgrind sees an atomic load or store as a plain one (only read-modify-writes
/// look different to it, and only to each other). Call it before a plain atomic store
/// (`Relaxed`, `Release`; a `SeqCst` store is a read-modify-write on x86-64) to a location
/// other threads load. It says nothing about the data the atomic publishes: name that edge
/// with [`happens_before`] and [`happens_after`]. The bytes are checked again once their
/// memory is freed and allocated anew.
#[inline(always)]
pub fn atomic_only<T: Sync>(atomic: &T) {
    request::two(
        request::UNTRACKED,
        addr(atomic),
        std::mem::size_of_val(atomic),
    );
}

/// Whether the program runs under valgrind (`RUNNING_ON_VALGRIND`).
#[inline(always)]
fn on_valgrind() -> bool {
    request::one(request::RUNNING_ON_VALGRIND, 0) != 0
}

/// The identity of one direction of a TCP connection (`from` sends, `to` receives), the
/// same in both of its endpoints' processes: a hash of the two addresses with the top bit
/// set (never a heap address, so it never meets a lock's edges).
fn stream_tag(from: std::net::SocketAddr, to: std::net::SocketAddr) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    (from, to).hash(&mut h);
    (h.finish() as usize) | 1 << (usize::BITS - 1)
}

/// The connected TCP socket `fd`'s local and peer addresses; `None` for anything else
/// (only asked under valgrind: two system calls and a duplicate descriptor).
fn stream_ends(
    fd: std::os::fd::BorrowedFd<'_>,
) -> Option<(std::net::SocketAddr, std::net::SocketAddr)> {
    let s = std::net::TcpStream::from(fd.try_clone_to_owned().ok()?);
    Some((s.local_addr().ok()?, s.peer_addr().ok()?))
}

/// Tells helgrind, before a send on the stream socket `fd`, that what this thread did so
/// far happens before the peer's receive of these bytes: the kernel orders a send before
/// the receive that returns its bytes (loopback between two endpoints of one process, as
/// the conformance suite runs them), which helgrind does not know. Outside valgrind it
/// costs one client request (a few instructions).
#[inline(always)]
pub fn stream_sending(fd: std::os::fd::BorrowedFd<'_>) {
    if on_valgrind() {
        if let Some((local, peer)) = stream_ends(fd) {
            request::one(request::SEND_PRE, stream_tag(local, peer));
        }
    }
}

/// The other end of [`stream_sending`]: after a receive on `fd` that returned bytes
/// (`got`), everything the peer's sends did before sending happens before what follows.
/// (It joins every send so far on that direction of the connection, including any whose
/// bytes this receive did not reach yet: a slight over-approximation.)
#[inline(always)]
pub fn stream_received(fd: std::os::fd::BorrowedFd<'_>, got: bool) {
    if got && on_valgrind() {
        if let Some((local, peer)) = stream_ends(fd) {
            request::one(request::RECV_POST, stream_tag(peer, local));
        }
    }
}

/// Registered memory, for helgrind: what has been placed into `buffer` so far (by
/// [`Buffer::write`](crate::Buffer::write) or a socket receive into it) happens before
/// whatever its owner does once it holds the buffer exclusively again ([`owned_again`]).
/// The real edge is the `Arc<Buffer>` reference count: every placer drops its reference
/// with a release decrement, and `Arc::try_unwrap` succeeds with an acquire, neither of
/// which helgrind sees. Keyed on the buffer's memory, which never moves.
#[inline(always)]
pub(crate) fn placed(buffer: &crate::Buffer) {
    request::one(request::SEND_PRE, buffer.as_mut_ptr() as usize);
}

/// The other end of the placement edge (see `placed`): call it once `buffer` is owned
/// exclusively again (`Arc::try_unwrap` or `Arc::get_mut` succeeded; `MemoryRegion::
/// into_buffer` calls it): every placement into it happens before what follows.
#[inline(always)]
pub fn owned_again(buffer: &crate::Buffer) {
    request::one(request::RECV_POST, buffer.as_mut_ptr() as usize);
}

/// Makes valgrind forget the edges recorded on `obj`'s address, so that an object later
/// allocated there starts with none. The locks here call it when dropped.
#[inline(always)]
fn forget<T: ?Sized>(obj: &T) {
    request::one(request::FORGET_ALL, addr(obj));
}

/// `std::sync::Mutex`, with its happens-before edges annotated for valgrind.
#[derive(Default)]
pub struct Mutex<T: ?Sized> {
    inner: std::sync::Mutex<T>,
}

/// The guard of a [`Mutex`]: `std::sync::MutexGuard`, annotating its release.
pub struct MutexGuard<'a, T: ?Sized + 'a> {
    lock: &'a Mutex<T>,
    // Dropped after `Drop::drop` has annotated the release: the unlock follows.
    inner: std::sync::MutexGuard<'a, T>,
}

impl<T> Mutex<T> {
    /// A mutex over `value`.
    pub const fn new(value: T) -> Self {
        Mutex {
            inner: std::sync::Mutex::new(value),
        }
    }

    /// The value (`Err` if a thread panicked holding the lock, with the value).
    pub fn into_inner(self) -> LockResult<T> {
        // Owned: no other thread can hold the lock, so there is no edge to annotate; the
        // address's edges go, as when a mutex is dropped.
        forget(&self);
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again, so its one field is moved out
        // exactly once (and `Mutex`'s `Drop`, which only forgets edges, is skipped).
        #[allow(unsafe_code)]
        let inner = unsafe { std::ptr::read(&this.inner) };
        inner.into_inner()
    }
}

impl<T: ?Sized> Mutex<T> {
    fn acquired<'a>(&'a self, inner: std::sync::MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        happens_after(self);
        MutexGuard { lock: self, inner }
    }

    /// Takes the lock, blocking (`Err` if a thread panicked holding it, with the guard).
    pub fn lock(&self) -> LockResult<MutexGuard<'_, T>> {
        match self.inner.lock() {
            Ok(g) => Ok(self.acquired(g)),
            Err(p) => Err(PoisonError::new(self.acquired(p.into_inner()))),
        }
    }

    /// Takes the lock if no other thread holds it.
    pub fn try_lock(&self) -> TryLockResult<MutexGuard<'_, T>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(self.acquired(g)),
            Err(TryLockError::Poisoned(p)) => Err(TryLockError::Poisoned(PoisonError::new(
                self.acquired(p.into_inner()),
            ))),
            Err(TryLockError::WouldBlock) => Err(TryLockError::WouldBlock),
        }
    }

    /// Whether a thread panicked holding the lock.
    pub fn is_poisoned(&self) -> bool {
        self.inner.is_poisoned()
    }

    /// The value, through exclusive access (no locking needed).
    pub fn get_mut(&mut self) -> LockResult<&mut T> {
        self.inner.get_mut()
    }
}

impl<T: ?Sized> Drop for Mutex<T> {
    fn drop(&mut self) {
        forget(self);
    }
}

impl<T> From<T> for Mutex<T> {
    fn from(value: T) -> Self {
        Mutex::new(value)
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

impl<T: ?Sized> Drop for MutexGuard<'_, T> {
    fn drop(&mut self) {
        happens_before(self.lock);
    }
}

impl<T: ?Sized> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: ?Sized> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for MutexGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.inner, f)
    }
}

/// `std::sync::Condvar` over a [`Mutex`], annotating the release and the reacquisition
/// of the lock around each wait.
#[derive(Debug, Default)]
pub struct Condvar {
    inner: std::sync::Condvar,
}

impl Condvar {
    /// A condition variable with no waiters.
    pub const fn new() -> Self {
        Condvar {
            inner: std::sync::Condvar::new(),
        }
    }

    /// Releases the guard's lock and sleeps until notified (or spuriously), then takes
    /// the lock again.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> LockResult<MutexGuard<'a, T>> {
        let (lock, inner) = release(guard);
        match self.inner.wait(inner) {
            Ok(g) => Ok(lock.acquired(g)),
            Err(p) => Err(PoisonError::new(lock.acquired(p.into_inner()))),
        }
    }

    /// As [`wait`](Self::wait), for at most `timeout`.
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> LockResult<(MutexGuard<'a, T>, WaitTimeoutResult)> {
        let (lock, inner) = release(guard);
        match self.inner.wait_timeout(inner, timeout) {
            Ok((g, t)) => Ok((lock.acquired(g), t)),
            Err(p) => {
                let (g, t) = p.into_inner();
                Err(PoisonError::new((lock.acquired(g), t)))
            }
        }
    }

    /// Wakes one waiter.
    pub fn notify_one(&self) {
        self.inner.notify_one();
    }

    /// Wakes every waiter.
    pub fn notify_all(&self) {
        self.inner.notify_all();
    }
}

/// Annotates the release of `guard`'s lock (a condition variable is about to release it)
/// and takes its std guard out.
fn release<'a, T: ?Sized>(
    guard: MutexGuard<'a, T>,
) -> (&'a Mutex<T>, std::sync::MutexGuard<'a, T>) {
    happens_before(guard.lock);
    let guard = std::mem::ManuallyDrop::new(guard);
    let lock = guard.lock;
    // SAFETY: `guard` is in a `ManuallyDrop` and never used again, so its `inner` field is
    // read out exactly once and not dropped twice (the guard's own `Drop`, which would
    // annotate a second release, does not run either).
    #[allow(unsafe_code)]
    let inner = unsafe { std::ptr::read(&guard.inner) };
    (lock, inner)
}

/// `std::sync::RwLock`, with its happens-before edges annotated for valgrind: a writer's
/// release happens before every later acquisition, a reader's before the next writer's
/// (readers are also ordered after each other, which hides nothing: readers only read).
#[derive(Default)]
pub struct RwLock<T: ?Sized> {
    inner: std::sync::RwLock<T>,
}

/// The shared guard of an [`RwLock`].
pub struct RwLockReadGuard<'a, T: ?Sized + 'a> {
    lock: &'a RwLock<T>,
    inner: std::sync::RwLockReadGuard<'a, T>,
}

/// The exclusive guard of an [`RwLock`].
pub struct RwLockWriteGuard<'a, T: ?Sized + 'a> {
    lock: &'a RwLock<T>,
    inner: std::sync::RwLockWriteGuard<'a, T>,
}

impl<T> RwLock<T> {
    /// A lock over `value`.
    pub const fn new(value: T) -> Self {
        RwLock {
            inner: std::sync::RwLock::new(value),
        }
    }
}

impl<T: ?Sized> RwLock<T> {
    /// Takes the lock shared, blocking.
    pub fn read(&self) -> LockResult<RwLockReadGuard<'_, T>> {
        let guard = |inner| {
            happens_after(self);
            RwLockReadGuard { lock: self, inner }
        };
        match self.inner.read() {
            Ok(g) => Ok(guard(g)),
            Err(p) => Err(PoisonError::new(guard(p.into_inner()))),
        }
    }

    /// Takes the lock exclusively, blocking.
    pub fn write(&self) -> LockResult<RwLockWriteGuard<'_, T>> {
        let guard = |inner| {
            happens_after(self);
            RwLockWriteGuard { lock: self, inner }
        };
        match self.inner.write() {
            Ok(g) => Ok(guard(g)),
            Err(p) => Err(PoisonError::new(guard(p.into_inner()))),
        }
    }
}

impl<T: ?Sized> Drop for RwLock<T> {
    fn drop(&mut self) {
        forget(self);
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for RwLock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

impl<T: ?Sized> Drop for RwLockReadGuard<'_, T> {
    fn drop(&mut self) {
        happens_before(self.lock);
    }
}

impl<T: ?Sized> Drop for RwLockWriteGuard<'_, T> {
    fn drop(&mut self) {
        happens_before(self.lock);
    }
}

impl<T: ?Sized> Deref for RwLockReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: ?Sized> Deref for RwLockWriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: ?Sized> DerefMut for RwLockWriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for RwLockReadGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.inner, f)
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for RwLockWriteGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.inner, f)
    }
}

/// `std::sync::mpsc`, with the happens-before edge from a send to the receive that takes
/// its message annotated for valgrind (std's channel is built on atomics that helgrind does
/// not see as synchronisation). The same API as std's, so swapping it in is a `use` line.
pub mod mpsc {
    use std::sync::Arc;
    use std::time::Duration;

    pub use std::sync::mpsc::{RecvError, RecvTimeoutError, SendError, TryRecvError};

    /// The sending half of a [`channel`].
    #[derive(Debug)]
    pub struct Sender<T> {
        inner: std::sync::mpsc::Sender<T>,
        /// The channel's identity for the annotations, shared by both halves.
        tag: Arc<u8>,
    }

    /// The receiving half of a [`channel`].
    #[derive(Debug)]
    pub struct Receiver<T> {
        inner: std::sync::mpsc::Receiver<T>,
        tag: Arc<u8>,
    }

    /// An unbounded channel, as `std::sync::mpsc::channel`.
    pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let tag = Arc::new(0);
        (
            Sender {
                inner: tx,
                tag: tag.clone(),
            },
            Receiver { inner: rx, tag },
        )
    }

    impl<T> Clone for Sender<T> {
        fn clone(&self) -> Self {
            Sender {
                inner: self.inner.clone(),
                tag: self.tag.clone(),
            }
        }
    }

    impl<T> Sender<T> {
        /// Sends `value`; fails only when the receiver is gone.
        pub fn send(&self, value: T) -> Result<(), SendError<T>> {
            super::happens_before(&*self.tag);
            self.inner.send(value)
        }
    }

    impl<T> Receiver<T> {
        fn received<R, E>(&self, r: Result<R, E>) -> Result<R, E> {
            if r.is_ok() {
                super::happens_after(&*self.tag);
            }
            r
        }

        /// Waits for a message; fails when every sender is gone.
        pub fn recv(&self) -> Result<T, RecvError> {
            self.received(self.inner.recv())
        }

        /// Waits up to `timeout` for a message.
        pub fn recv_timeout(&self, timeout: Duration) -> Result<T, RecvTimeoutError> {
            self.received(self.inner.recv_timeout(timeout))
        }

        /// Takes a message if one waits.
        pub fn try_recv(&self) -> Result<T, TryRecvError> {
            self.received(self.inner.try_recv())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_clock_is_monotonic_nonzero_and_in_nanoseconds() {
        let (a, start) = (monotonic_ns(), std::time::Instant::now());
        std::thread::sleep(Duration::from_millis(20));
        let (b, took) = (monotonic_ns(), start.elapsed());
        assert!(a > 0, "0 is the 'never' value of the clock's users");
        assert!(
            b >= a + 20_000_000,
            "{a} then {b}: less than the 20 ms slept"
        );
        // Both clocks are CLOCK_MONOTONIC: the two intervals agree to within the time
        // between the paired reads, far under a second even on a loaded machine.
        let diff = (b - a).abs_diff(u64::try_from(took.as_nanos()).unwrap());
        assert!(
            diff < 1_000_000_000,
            "{} ns against Instant's {took:?}",
            b - a
        );
    }

    #[test]
    fn client_requests_are_inert_outside_valgrind() {
        // Outside valgrind the default (0) comes back; under it, the nesting level (1).
        let level = request::one(request::RUNNING_ON_VALGRIND, 0);
        assert!(level <= 1, "{level}");
        let x = 5u64;
        happens_before(&x);
        happens_after(&x);
        forget(&x);
    }

    #[test]
    fn mutex_and_condvar_behave_as_std() {
        let pair = Arc::new((Mutex::new(0u32), Condvar::new()));
        let p2 = pair.clone();
        let t = std::thread::spawn(move || {
            for _ in 0..1000 {
                *p2.0.lock().unwrap() += 1;
            }
            p2.1.notify_all();
        });
        let mut g = pair.0.lock().unwrap();
        while *g < 1000 {
            g = pair.1.wait_timeout(g, Duration::from_millis(50)).unwrap().0;
        }
        drop(g);
        t.join().unwrap();
        assert!(pair.0.try_lock().is_ok());
        let held = pair.0.lock().unwrap();
        assert!(matches!(pair.0.try_lock(), Err(TryLockError::WouldBlock)));
        drop(held);
        let m = Arc::try_unwrap(pair).ok().unwrap().0;
        assert_eq!(m.into_inner().unwrap(), 1000);
    }

    #[test]
    fn poisoning_is_reported_with_the_guard() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*m.lock().unwrap_err().into_inner(), 1);
        assert!(matches!(m.try_lock(), Err(TryLockError::Poisoned(_))));
    }

    #[test]
    fn rwlock_readers_share_writers_exclude() {
        let l = RwLock::new(vec![1]);
        {
            let a = l.read().unwrap();
            let b = l.read().unwrap();
            assert_eq!(a.len() + b.len(), 2);
        }
        l.write().unwrap().push(2);
        assert_eq!(*l.read().unwrap(), vec![1, 2]);
    }

    /// The annotations' cost outside valgrind, uncontended lock and unlock pairs (run with
    /// `cargo test -p fabric-api --release --lib annotation_cost -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement: prints nanoseconds per lock and unlock pair"]
    fn annotation_cost() {
        use std::hint::black_box;
        use std::time::Instant;
        const N: u32 = 20_000_000;
        let std_m = std::sync::Mutex::new(0u64);
        let ours = Mutex::new(0u64);
        for round in 0..3 {
            let t = Instant::now();
            for _ in 0..N {
                *black_box(&std_m).lock().unwrap() += 1;
            }
            let s = t.elapsed().as_secs_f64() * 1e9 / f64::from(N);
            let t = Instant::now();
            for _ in 0..N {
                *black_box(&ours).lock().unwrap() += 1;
            }
            let o = t.elapsed().as_secs_f64() * 1e9 / f64::from(N);
            println!("round {round}: std::sync::Mutex {s:.2} ns, fabric_api::sync::Mutex {o:.2} ns per pair");
        }
    }

    #[test]
    fn channel_behaves_as_std() {
        let (tx, rx) = mpsc::channel();
        let tx2 = tx.clone();
        std::thread::spawn(move || tx2.send(vec![1u8, 2]).unwrap());
        assert_eq!(rx.recv().unwrap(), vec![1, 2]);
        assert!(matches!(rx.try_recv(), Err(mpsc::TryRecvError::Empty)));
        assert!(matches!(
            rx.recv_timeout(Duration::from_millis(1)),
            Err(mpsc::RecvTimeoutError::Timeout)
        ));
        drop(tx);
        assert!(rx.recv().is_err());
    }
}
