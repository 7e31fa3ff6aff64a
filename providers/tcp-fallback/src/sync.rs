//! The locks and atomics of the provider's two lock-free-ish protocols, and the second of
//! them as one function:
//!
//! * a poll set's sleep / wake protocol ([`crate::engine::PollSet`], the progress
//!   thread's nap and its hand-off timer's lease included) and the completion queue built on it ([`crate::cq`]): under
//!   `--cfg loom` their mutexes, atomics and fences are loom's, so the models in
//!   `loom_models` explore every interleaving of the real code;
//! * [`serialised`], the try-lock and "more to do" flag that serialises a connection's
//!   progress without ever making a caller wait.
//!
//! Run the models with:
//!
//! ```sh
//! CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" cargo test -p fabric-tcp --release --lib loom
//! ```

use std::sync::atomic::Ordering;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
#[cfg(loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
// std's, annotated for valgrind's race detector (`fabric_api::sync`).
#[cfg(not(loom))]
pub(crate) use fabric_api::sync::Mutex;

/// A mutex that can be tried without blocking: std's (annotated), and a loom one in the
/// models.
pub(crate) trait TryLock<T> {
    /// Runs `f` on the value unless another thread holds the lock (a poisoned lock counts
    /// as held: nobody makes progress on it any more).
    fn try_with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R>;
}

impl<T> TryLock<T> for fabric_api::sync::Mutex<T> {
    fn try_with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.try_lock().ok().map(|mut g| f(&mut g))
    }
}

/// A "more to do" flag: std's `AtomicBool`, and loom's in the models. Sequentially
/// consistent throughout.
pub(crate) trait Flag {
    /// Sets the flag (a read-modify-write: the same instruction as a sequentially
    /// consistent store on x86, and one loom orders after every earlier write).
    fn raise(&self);
    /// Clears the flag; true if it was set.
    fn take(&self) -> bool;
    /// True if the flag is set.
    fn raised(&self) -> bool;
}

// The note orders the raiser's work before the run that takes it; helgrind is told so
// (`fabric_api::sync`), as it does not see atomics as synchronisation.
impl Flag for std::sync::atomic::AtomicBool {
    fn raise(&self) {
        fabric_api::sync::happens_before(self);
        self.swap(true, Ordering::SeqCst);
    }
    fn take(&self) -> bool {
        let taken = self.swap(false, Ordering::SeqCst);
        if taken {
            fabric_api::sync::happens_after(self);
        }
        taken
    }
    fn raised(&self) -> bool {
        self.load(Ordering::SeqCst)
    }
}

#[cfg(loom)]
impl Flag for loom::sync::atomic::AtomicBool {
    fn raise(&self) {
        self.swap(true, Ordering::SeqCst);
    }
    fn take(&self) -> bool {
        self.swap(false, Ordering::SeqCst)
    }
    fn raised(&self) -> bool {
        self.load(Ordering::SeqCst)
    }
}

/// Runs `work` on the value behind `lock`, serialised, without waiting: a caller that
/// finds another thread at work leaves it a note in `pending` and returns, and that
/// thread goes round once more. So `work` never runs concurrently with itself, and every
/// call is followed by a run of `work` that starts after the call did (none is lost).
pub(crate) fn serialised<T>(
    lock: &impl TryLock<T>,
    pending: &impl Flag,
    mut work: impl FnMut(&mut T),
) {
    pending.raise();
    // A failed try-lock orders nothing: the fences make "raise the note, then find the lock
    // taken" and "let the lock go, then look for a note" a store-load pair that cannot both
    // miss (Dekker), on every architecture, not only on x86 where the RMWs already fence.
    fence();
    loop {
        let ran = lock.try_with(|value| {
            while pending.take() {
                work(value);
            }
        });
        if ran.is_none() {
            return; // busy: the holder will see the note
        }
        fence();
        // A note left after our last look but before we let go would be lost without
        // this second look.
        if !pending.raised() {
            return;
        }
    }
}

/// A sequentially consistent fence (loom's under `cfg(loom)`, so that the models see it).
pub(crate) fn fence() {
    #[cfg(not(loom))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    #[cfg(loom)]
    loom::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}
