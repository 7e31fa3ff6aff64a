//! The core's locks and the one order they are taken in.
//!
//! Two kinds of lock guard the core's state: a completion queue's (its ready queue and the
//! endpoints reporting into it) and an endpoint's (its ledger). Draining a device queue
//! runs with the queue's lock held and calls into every endpoint that has completions in
//! it, which takes that endpoint's lock. So the order is:
//!
//! 1. a completion queue's lock ([`Rank::Cq`]), at most one at a time;
//! 2. an endpoint's lock ([`Rank::Endpoint`]), at most one at a time;
//!
//! and never the other way round: code holding an endpoint lock must not take a
//! completion-queue lock, not even indirectly by reaping the device queue for slots (an
//! endpoint that needs slots it cannot get drops its lock, reaps, and takes the lock
//! again; see `EpCore::retry_blocked`). Other locks of the crate (the connection
//! manager's registry, the RNR thread's list) are leaves: nothing is locked under them.
//!
//! [`Ranked`] enforces the order: in debug builds and under loom every acquisition checks
//! the ranks this thread already holds and panics, naming both locks, before it could
//! block on a lock taken out of order. Release builds skip the check.
//!
//! Under `--cfg loom` the mutexes and atomics are loom's, so the models in `loom_models`
//! explore every interleaving of the real completion-queue code.
//!
//! Elsewhere the mutex is `parking_lot`'s: it does not poison, and its unlock is inlined.
//! std's mutex read the panic count on every lock and every unlock (to poison): in the
//! soft-RDMA guest, callgrind counted 57 instructions per iteration of the 8-byte
//! fetch_add client in locking (the poison checks and the futex), 8 with `parking_lot`;
//! 128 against 22 at the 8-byte send ping-pong's client (docs/benchmarks-record.md, thirty-seventh
//! session). Nothing rested on poisoning: a poisoned lock only turned every later lock
//! into a panic (the endpoint's teardown's too), and the state these locks guard is
//! plain safe data, whatever a panic left it as.

use std::fmt;
use std::ops::{Deref, DerefMut};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicUsize, Ordering};
#[cfg(loom)]
use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
use parking_lot::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicUsize, Ordering};

/// A lock's place in the order: a thread may only take a lock of a higher rank than
/// every lock it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    /// A completion queue's state.
    Cq = 0,
    /// An endpoint's ledger.
    Endpoint = 1,
}

impl Rank {
    // Used by the lock-order checks, which exist in debug builds and the loom models.
    #[cfg(any(debug_assertions, loom))]
    fn bit(self) -> u8 {
        1 << self as u8
    }

    #[cfg(any(debug_assertions, loom))]
    fn name(self) -> &'static str {
        match self {
            Rank::Cq => "a completion-queue",
            Rank::Endpoint => "an endpoint",
        }
    }
}

#[cfg(any(debug_assertions, loom))]
mod held {
    use super::Rank;

    #[cfg(loom)]
    loom::thread_local! {
        static HELD: std::cell::Cell<u8> = std::cell::Cell::new(0);
    }
    #[cfg(not(loom))]
    std::thread_local! {
        static HELD: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
    }
    #[cfg(loom)]
    loom::thread_local! {
        static UNCHECKED: std::cell::Cell<bool> = std::cell::Cell::new(false);
    }

    /// Panics if this thread holds a lock of `rank` or a later one; else records `rank`.
    pub(super) fn acquire(rank: Rank) {
        #[cfg(loom)]
        if UNCHECKED.with(|u| u.get()) {
            return;
        }
        HELD.with(|h| {
            let held = h.get();
            if let Some(worst) = [Rank::Endpoint, Rank::Cq]
                .into_iter()
                .find(|r| *r >= rank && held & r.bit() != 0)
            {
                panic!(
                    "lock order violated: taking {} lock while holding {} lock (the order \
                     is completion queue, then endpoint, one of each at most)",
                    rank.name(),
                    worst.name()
                );
            }
            h.set(held | rank.bit());
        });
    }

    pub(super) fn release(rank: Rank) {
        #[cfg(loom)]
        if UNCHECKED.with(|u| u.get()) {
            return;
        }
        HELD.with(|h| h.set(h.get() & !rank.bit()));
    }

    /// Models only: this thread takes locks without the order check (to show what the
    /// model checker finds without it).
    #[cfg(all(loom, test))]
    pub(crate) fn unchecked() {
        UNCHECKED.with(|u| u.set(true));
    }
}

#[cfg(all(loom, test))]
pub(crate) use held::unchecked;

/// How a thread that can put its work off takes a lock ([`Ranked::lock_with`]).
///
/// The domain's helper thread looks at endpoints on behalf of applications that may have
/// stopped calling in. Waiting for a lock an application holds parks the helper; the
/// application's unlock then has to wake it (a system call), and the woken helper takes a
/// CPU from the application that just released the lock. In the soft-RDMA guest the
/// helper preempted a spinning ping-pong application about 200 times a second, and found
/// its lock held in 10 to 33 passes a second (docs/benchmarks-record.md, fifty-sixth
/// session). A look at a locked endpoint finds an application at work, whose own posts
/// and polls do what the look was for: the helper skips it, and its next pass over that
/// list waits for the lock, so every look is at most one pass late.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Patience {
    /// Waits for the lock.
    Wait,
    /// Gives up at once while another thread holds the lock.
    Skip,
}

/// A mutex with a rank in the lock order (see the module docs).
pub(crate) struct Ranked<T> {
    rank: Rank,
    m: Mutex<T>,
}

impl<T: fmt::Debug> fmt::Debug for Ranked<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ranked")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl<T> Ranked<T> {
    /// A lock of `rank` over `value`.
    pub fn new(rank: Rank, value: T) -> Self {
        Ranked {
            rank,
            m: Mutex::new(value),
        }
    }

    /// Takes the lock (checking the order first, in debug builds and models). Inlined: it
    /// is on every post and poll, and a call costs as much as the uncontended lock.
    #[inline]
    pub fn lock(&self) -> RankedGuard<'_, T> {
        #[cfg(any(debug_assertions, loom))]
        held::acquire(self.rank);
        #[cfg(not(loom))]
        let g = self.m.lock();
        // loom's mutex poisons as std's does: a model's panic is its failure anyway.
        #[cfg(loom)]
        let g = match self.m.lock() {
            Ok(g) => g,
            Err(_) => {
                held::release(self.rank);
                panic!("{} lock is poisoned", self.rank.name());
            }
        };
        RankedGuard { g, rank: self.rank }
    }

    /// Takes the lock if no thread holds it, else returns `None` at once. The order is
    /// checked as for [`Self::lock`]: a thread that could not take the lock in order must
    /// not try it.
    #[inline]
    pub fn try_lock(&self) -> Option<RankedGuard<'_, T>> {
        #[cfg(any(debug_assertions, loom))]
        held::acquire(self.rank);
        #[cfg(not(loom))]
        let g = self.m.try_lock();
        // loom's `try_lock` refuses only a held lock (it never reports poisoning).
        #[cfg(loom)]
        let g = self.m.try_lock().ok();
        match g {
            Some(g) => Some(RankedGuard { g, rank: self.rank }),
            None => {
                #[cfg(any(debug_assertions, loom))]
                held::release(self.rank);
                None
            }
        }
    }

    /// Takes the lock as `patience` says: waiting for it, or `None` while another thread
    /// holds it.
    #[inline]
    pub fn lock_with(&self, patience: Patience) -> Option<RankedGuard<'_, T>> {
        match patience {
            Patience::Wait => Some(self.lock()),
            Patience::Skip => self.try_lock(),
        }
    }
}

/// The guard of a [`Ranked`] lock.
pub(crate) struct RankedGuard<'a, T> {
    g: MutexGuard<'a, T>,
    rank: Rank,
}

impl<T> Drop for RankedGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        #[cfg(any(debug_assertions, loom))]
        held::release(self.rank);
        #[cfg(not(any(debug_assertions, loom)))]
        let _ = self.rank;
    }
}

impl<T> Deref for RankedGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.g
    }
}

impl<T> DerefMut for RankedGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.g
    }
}

impl<T: fmt::Debug> fmt::Debug for RankedGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.g, f)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn cq_then_endpoint_is_allowed() {
        let cq = Ranked::new(Rank::Cq, 1);
        let ep = Ranked::new(Rank::Endpoint, 2);
        let a = cq.lock();
        let b = ep.lock();
        assert_eq!(*a + *b, 3);
        drop(b);
        drop(a);
        // Released: both again, and the endpoint alone.
        let _a = cq.lock();
        drop(_a);
        let _b = ep.lock();
    }

    /// `try_lock` gives the lock when it is free, and nothing while another thread holds
    /// it; a refused try leaves no hold behind (the order check would then refuse a queue
    /// lock after it). `lock_with` skips a held lock or waits for it, as asked.
    #[test]
    fn try_lock_and_lock_with_take_a_free_lock_and_skip_or_wait_for_a_held_one() {
        let cq = Ranked::new(Rank::Cq, 0u32);
        let ep = std::sync::Arc::new(Ranked::new(Rank::Endpoint, 0u32));
        *ep.try_lock().expect("a free lock is taken") = 5;
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let ep2 = ep.clone();
        let holder = std::thread::spawn(move || {
            let _g = ep2.lock();
            held_tx.send(()).unwrap();
            done_rx.recv().unwrap();
        });
        held_rx.recv().unwrap();
        assert!(ep.try_lock().is_none(), "another thread holds it");
        // `lock_with(Skip)` gives up too, at once (run aside: a wait would hang here).
        let (skip_tx, skip_rx) = std::sync::mpsc::channel();
        let ep3 = ep.clone();
        let skipper = std::thread::spawn(move || {
            skip_tx
                .send(ep3.lock_with(Patience::Skip).is_none())
                .unwrap();
        });
        let skipped = skip_rx.recv_timeout(std::time::Duration::from_secs(30));
        assert_eq!(skipped, Ok(true), "Skip gives up while the lock is held");
        skipper.join().unwrap();
        // `lock_with(Wait)` waits for the holder, and then has the lock.
        let (got_tx, got_rx) = std::sync::mpsc::channel();
        let ep4 = ep.clone();
        let waiter = std::thread::spawn(move || {
            let g = ep4.lock_with(Patience::Wait);
            got_tx.send(g.map(|g| *g)).unwrap();
        });
        assert!(
            got_rx
                .recv_timeout(std::time::Duration::from_millis(200))
                .is_err(),
            "Wait does not take a held lock"
        );
        // The refused try recorded no hold: the queue's lock is still in order here.
        drop(cq.lock());
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        assert_eq!(
            got_rx.recv_timeout(std::time::Duration::from_secs(30)),
            Ok(Some(5)),
            "Wait has the lock once it is released"
        );
        waiter.join().unwrap();
        assert_eq!(*ep.try_lock().expect("released"), 5);
    }

    /// A panic while a lock is held does not poison it: the lock is taken again, with
    /// the value as the panic left it, and the order check forgot the unwound hold.
    #[test]
    fn a_panic_under_a_lock_leaves_it_usable() {
        let cq = Ranked::new(Rank::Cq, 0u32);
        let ep = Ranked::new(Rank::Endpoint, 0u32);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut g = ep.lock();
            *g = 7;
            panic!("a bug under the endpoint lock");
        }));
        assert!(r.is_err());
        assert_eq!(*ep.lock(), 7, "the lock is usable after the panic");
        // The endpoint's rank was released as the guard unwound: the queue's lock, then
        // the endpoint's, is still the allowed order.
        let _a = cq.lock();
        let _b = ep.lock();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(
        expected = "lock order violated: taking a completion-queue lock while holding an endpoint lock"
    )]
    fn endpoint_then_cq_panics_instead_of_deadlocking() {
        let cq = Ranked::new(Rank::Cq, ());
        let ep = Ranked::new(Rank::Endpoint, ());
        let _b = ep.lock();
        let _a = cq.lock();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "taking an endpoint lock while holding an endpoint lock")]
    fn two_endpoint_locks_panic() {
        let a = Ranked::new(Rank::Endpoint, ());
        let b = Ranked::new(Rank::Endpoint, ());
        let _a = a.lock();
        let _b = b.lock();
    }
}
