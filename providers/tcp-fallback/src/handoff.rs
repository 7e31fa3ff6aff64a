//! The progress thread's hand-off sleep, which a polling application pushes back.
//!
//! While the application drives the connections of a domain itself, the domain's progress
//! thread leaves them to it and looks again once `HANDOFF` has passed since the
//! application's last look (the engine's module docs). A plain timed sleep would wake the
//! thread every `HANDOFF` as long as the application polls, only to find it still polling:
//! two context switches and a timer a millisecond, each of which takes the core from a
//! polling thread that shares it (the 99th percentile of an 8-byte `fabric perf lat`
//! ping-pong on the pinned host: 15-23 usec with them, 5-7 with no progress thread at all;
//! docs/benchmarks-record.md, forty-fifth session).
//!
//! So the thread sleeps on a timer ([`Handoff`], a `timerfd`), and when one completion
//! queue's poll set drives every connection of the domain, the thread **leases** that set
//! the timer ([`Lease`]): each poll of the set that finds the timer due within an eighth
//! of `HANDOFF` pushes it to `HANDOFF` after itself (one `timerfd_settime` per seven
//! eighths of a millisecond of polling, instead of two context switches and a timer per
//! millisecond). The bound still holds: every deadline the timer ever holds is a look of
//! the application plus `HANDOFF` at most, so it fires at the latest `HANDOFF` after the
//! last poll, and the thread takes over.
//!
//! A timer pushed back could also hide what only the thread looks at: a new connection
//! (not yet the lessee's), a stop, a hello repeat. Whoever makes such a change ends the
//! sleep ([`Handoff::end`]): it takes the lease back and fires the timer, under the same
//! lock under which a push checks that its lease still holds, so no push lands after an
//! end (a push resets the timer's expirations, which would lose the fire), and the thread
//! grants no lease after one.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
    Timespec,
};

use crate::engine::sync::{fence, AtomicBool, AtomicU64, Mutex};
use crate::engine::{now_ns, HANDOFF, HANDOFF_NS};

/// What the hand-off sleep sleeps on: a `timerfd` ([`Timerfd`]), and in the loom models
/// a model timer that fires only when set to zero (`loom_models`).
pub(crate) trait Timer: std::fmt::Debug + Send + Sync {
    /// Arms the timer to fire once, `after` from now (zero: at once). A fire that nobody
    /// waited for yet is forgotten, as `timerfd_settime` forgets it.
    fn set(&self, after: Duration) -> io::Result<()>;
    /// Blocks until the timer fires (or a signal interrupts), and consumes the fire.
    /// `leased`: whether a lease may push the timer back meanwhile (the loom model has no
    /// clock, so it ends a sleep that nobody can push at once: such a sleep ends by its
    /// deadline anyway; a leased one only by a fire, since its deadline moves with polls).
    fn wait(&self, leased: bool);
}

/// A `timerfd` on the monotonic clock.
#[derive(Debug)]
pub(crate) struct Timerfd(OwnedFd);

impl Timerfd {
    /// An unarmed timer.
    pub fn new() -> io::Result<Timerfd> {
        Ok(Timerfd(timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::CLOEXEC,
        )?))
    }
}

impl Timer for Timerfd {
    fn set(&self, after: Duration) -> io::Result<()> {
        // At least a nanosecond: a zero value disarms a timerfd.
        let after = after.max(Duration::from_nanos(1));
        let spec = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: Timespec {
                tv_sec: i64::try_from(after.as_secs()).unwrap_or(i64::MAX),
                tv_nsec: i64::from(after.subsec_nanos()),
            },
        };
        timerfd_settime(&self.0, TimerfdTimerFlags::empty(), &spec)?;
        Ok(())
    }

    fn wait(&self, _leased: bool) {
        let mut ticks = [0u8; 8];
        // An error (EINTR) ends the wait early: the thread looks, and sleeps again.
        let _ = rustix::io::read(&self.0, &mut ticks);
    }
}

/// How near its deadline a poll pushes the leased timer: an eighth of `HANDOFF`, so that
/// an application polling in a loop pushes it once every seven eighths (each push costs a
/// `timerfd_settime`, which reprograms the core's timer: about 10 usec on the benches'
/// virtual machine, against 0.5 for one that fires after the next tick), and one whose
/// polls come up to an eighth of `HANDOFF` apart still keeps the thread asleep.
const PUSH_WITHIN: u64 = HANDOFF_NS / 8;

/// A completion queue's side of the hand-off timer: while it holds a lease, the deadline
/// its polls push back.
#[derive(Debug)]
pub(crate) struct Lease<T: Timer = Timerfd> {
    /// The timer's deadline ([`now_ns`]) while this set holds the lease; 0 otherwise.
    /// Read without a lock on every poll.
    deadline: AtomicU64,
    /// The timer leased (set with the lease, never cleared: a stale one is checked).
    of: Mutex<Weak<Handoff<T>>>,
}

impl<T: Timer> Default for Lease<T> {
    fn default() -> Self {
        Lease {
            deadline: AtomicU64::new(0),
            of: Mutex::new(Weak::new()),
        }
    }
}

impl<T: Timer> Lease<T> {
    /// Stores the deadline (under the timer's lock: its writers are serialised there).
    fn set_deadline(&self, at: u64) {
        fabric_api::sync::atomic_only(&self.deadline); // read by polls without a lock
        self.deadline.store(at, Ordering::Relaxed);
    }

    /// The set's poll at `now` ([`now_ns`]): pushes the leased timer back to `HANDOFF`
    /// after `now` if it is due within [`PUSH_WITHIN`]. One load while it is not.
    pub fn poll(self: &Arc<Self>, now: u64) {
        let due = self.deadline.load(Ordering::Relaxed);
        if due == 0 || now.saturating_add(PUSH_WITHIN) < due {
            return;
        }
        self.push(now);
    }

    /// [`poll`](Self::poll)'s push, once it found the deadline near: it may find the lease
    /// taken back meanwhile, and then pushes nothing.
    fn push(self: &Arc<Self>, now: u64) {
        let Some(h) = self.of.lock().expect("lease poisoned").upgrade() else {
            return;
        };
        let st = h.st.lock().expect("hand-off poisoned");
        // Only while this lease holds: an end (or the thread's wake) took it back under
        // this lock, and a push after it would reset the timer's expirations.
        if st.lease.as_ref().is_some_and(|l| Arc::ptr_eq(l, self)) {
            let until = now.saturating_add(HANDOFF_NS);
            if h.timer.set(HANDOFF).is_ok() {
                self.set_deadline(until);
            }
        }
    }
}

/// What [`Handoff`]'s lock guards.
#[derive(Debug)]
struct State<T: Timer> {
    /// The lease granted for the current sleep, if any.
    lease: Option<Arc<Lease<T>>>,
    /// The current sleep was ended ([`Handoff::end`]): grant no lease, push nothing.
    ended: bool,
}

/// How [`Handoff::sleep`] sleeps.
enum Sleep {
    /// On the timer (leased or not).
    Timer(bool),
    /// A plain timed sleep (the timer failed to arm).
    Plain,
    /// Not at all: ended or stopped already.
    Not,
}

/// The domain progress thread's hand-off timer (see the module docs).
#[derive(Debug)]
pub(crate) struct Handoff<T: Timer = Timerfd> {
    timer: T,
    st: Mutex<State<T>>,
    /// True while the thread sleeps on the timer (or is about to): an
    /// [`end`](Self::end) looks at it without the lock.
    sleeping: AtomicBool,
}

impl Handoff {
    /// On a `timerfd`, unarmed.
    pub fn new() -> io::Result<Arc<Handoff>> {
        Ok(Handoff::with(Timerfd::new()?))
    }
}

impl<T: Timer> Handoff<T> {
    /// On `timer`, unarmed.
    pub fn with(timer: T) -> Arc<Handoff<T>> {
        Arc::new(Handoff {
            timer,
            st: Mutex::new(State {
                lease: None,
                ended: false,
            }),
            sleeping: AtomicBool::new(false),
        })
    }

    /// The thread sleeps until `deadline` ([`now_ns`]), an [`end`](Self::end), or, when
    /// `lessee` is given (a set that drives every connection the thread left to the
    /// application), the deadline its polls push back. `may_lease` is checked after the
    /// sleep is announced (so that a change it looks at either shows in it or ends the
    /// sleep); `stopped` likewise.
    pub fn sleep(
        self: &Arc<Self>,
        deadline: u64,
        lessee: Option<&Arc<Lease<T>>>,
        may_lease: impl FnOnce() -> bool,
        stopped: impl FnOnce() -> bool,
    ) {
        self.sleeping.store(true, Ordering::SeqCst);
        // Paired with the caller's fence in `end`: either it sees `sleeping`, or this
        // thread sees its change in `may_lease` or `stopped`.
        fence();
        let lessee = lessee.filter(|_| may_lease());
        let how = {
            let mut st = self.st.lock().expect("hand-off poisoned");
            if st.ended || stopped() {
                Sleep::Not
            } else if self
                .timer
                .set(Duration::from_nanos(deadline.saturating_sub(now_ns())))
                .is_err()
            {
                Sleep::Plain
            } else {
                if let Some(l) = lessee {
                    *l.of.lock().expect("lease poisoned") = Arc::downgrade(self);
                    l.set_deadline(deadline.max(1));
                    st.lease = Some(l.clone());
                }
                Sleep::Timer(lessee.is_some())
            }
        };
        match how {
            Sleep::Timer(leased) => self.timer.wait(leased),
            // No timer (it failed to arm): the plain sleep of old rather than a spin.
            Sleep::Plain => {
                std::thread::sleep(Duration::from_nanos(deadline.saturating_sub(now_ns())))
            }
            Sleep::Not => {}
        }
        let mut st = self.st.lock().expect("hand-off poisoned");
        self.sleeping.store(false, Ordering::SeqCst);
        st.ended = false;
        if let Some(l) = st.lease.take() {
            l.set_deadline(0);
        }
    }

    /// Ends the thread's sleep on the timer, if it sleeps (after the caller's change and
    /// its `SeqCst` fence): takes the lease back and fires the timer. One load when the
    /// thread does not sleep on it.
    pub fn end(&self) {
        if !self.sleeping.load(Ordering::SeqCst) {
            return;
        }
        let mut st = self.st.lock().expect("hand-off poisoned");
        if !self.sleeping.load(Ordering::SeqCst) {
            return; // the sleep is over (stored under this lock): the thread looks anyway
        }
        st.ended = true;
        if let Some(l) = st.lease.take() {
            l.set_deadline(0);
        }
        if let Err(e) = self.timer.set(Duration::ZERO) {
            tracing::error!("timerfd_settime failed: {e}");
        }
    }
}

/// A model of the `timerfd`, for the tests and the loom models.
#[cfg(test)]
pub(crate) use model::ModelTimer;

#[cfg(test)]
mod model {
    use std::io;
    use std::time::Duration;

    #[cfg(loom)]
    use loom::sync::{Condvar, Mutex};
    #[cfg(not(loom))]
    use std::sync::{Condvar, Mutex};

    use super::Timer;

    /// A model of the `timerfd` for the tests and the loom models (loom's lock and
    /// condition variable in those): it fires when set to zero (an end), never by itself,
    /// so that a leased sleep that misses its end blocks for good (loom reports a
    /// deadlock, a test times out); a sleep nobody can push ends at once (it would end by
    /// its own deadline). A set forgets a fire not waited for yet, as `timerfd_settime`
    /// does.
    #[derive(Debug, Default)]
    pub(crate) struct ModelTimer {
        fired: Mutex<bool>,
        cv: Condvar,
    }

    impl Timer for ModelTimer {
        fn set(&self, after: Duration) -> io::Result<()> {
            let mut fired = self.fired.lock().unwrap();
            *fired = after.is_zero();
            if *fired {
                self.cv.notify_one();
            }
            Ok(())
        }

        fn wait(&self, leased: bool) {
            let mut fired = self.fired.lock().unwrap();
            while leased && !*fired {
                fired = self.cv.wait(fired).unwrap();
            }
            *fired = false;
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Waits until `lease` holds a deadline (the sleeper granted it): the deadline, or
    /// `None` if `sleeper` was over first.
    fn granted<T: Timer>(lease: &Lease<T>, sleeper: &std::thread::JoinHandle<()>) -> Option<u64> {
        loop {
            match lease.deadline.load(Ordering::Relaxed) {
                0 if sleeper.is_finished() => return None,
                0 => std::thread::yield_now(),
                d => return Some(d),
            }
        }
    }

    /// A sleep with no lease lasts until its deadline, and one already ended or stopped
    /// does not start.
    #[test]
    fn a_sleep_lasts_until_its_deadline_unless_ended() {
        let h = Handoff::new().unwrap();
        let deadline = now_ns() + 2 * HANDOFF_NS;
        h.sleep(deadline, None, || true, || false);
        assert!(now_ns() >= deadline, "woke before the deadline");
        assert!(!h.sleeping.load(Ordering::SeqCst));
        // Stopped: returns at once, whatever the deadline.
        h.sleep(u64::MAX, None, || true, || true);
    }

    /// The lease: granted with the sleep's deadline, pushed by a poll only once the
    /// deadline is near (to `HANDOFF` after the poll), taken back by an end (which wakes
    /// the sleeper), and a poll after that pushes nothing. On the model timer, so that
    /// no clock ends the sleep before the end does.
    #[test]
    fn polls_push_a_leased_deadline_only_near_it_and_only_while_leased() {
        let h = Handoff::with(ModelTimer::default());
        let lease = Arc::new(Lease::default());
        let deadline = now_ns() + 1000 * HANDOFF_NS;
        let sleeper = {
            let (h, l) = (h.clone(), lease.clone());
            std::thread::spawn(move || h.sleep(deadline, Some(&l), || true, || false))
        };
        assert_eq!(granted(&lease, &sleeper), Some(deadline));
        lease.poll(deadline - HANDOFF_NS / 2);
        assert_eq!(
            lease.deadline.load(Ordering::Relaxed),
            deadline,
            "pushed early"
        );
        let at = deadline - PUSH_WITHIN / 2;
        lease.poll(at);
        assert_eq!(lease.deadline.load(Ordering::Relaxed), at + HANDOFF_NS);
        h.end();
        sleeper.join().unwrap();
        assert_eq!(lease.deadline.load(Ordering::Relaxed), 0);
        lease.poll(at + HANDOFF_NS);
        assert_eq!(
            lease.deadline.load(Ordering::Relaxed),
            0,
            "pushed without a lease"
        );
    }

    /// A lease the thread would grant after an end is not granted: the sleep does not
    /// start (an end that came between the announcement and the grant).
    #[test]
    fn no_lease_after_an_end() {
        let h = Handoff::new().unwrap();
        let lease = Arc::new(Lease::default());
        // `may_lease` runs after the announcement: an end there is the race.
        h.sleep(
            u64::MAX,
            Some(&lease),
            || {
                h.end();
                true
            },
            || false,
        );
        assert_eq!(lease.deadline.load(Ordering::Relaxed), 0);
    }

    /// A poll that found the deadline near just before an end, and pushes just after
    /// it, pushes nothing: had it re-armed the timer, the fire would be lost (and polls
    /// after it would see a deadline again and go on pushing).
    #[test]
    fn a_push_that_comes_after_an_end_does_nothing() {
        let h = Handoff::with(ModelTimer::default());
        let lease = Arc::new(Lease::default());
        let sleeper = {
            let (h, l) = (h.clone(), lease.clone());
            std::thread::spawn(move || h.sleep(u64::MAX / 2, Some(&l), || true, || false))
        };
        granted(&lease, &sleeper).expect("the sleeper grants the lease");
        h.end();
        lease.push(now_ns());
        assert_eq!(
            lease.deadline.load(Ordering::Relaxed),
            0,
            "pushed after the end"
        );
        sleeper.join().unwrap();
    }

    /// An end wakes the sleeper while another thread keeps polling the lease, pushing the
    /// timer back at every chance: a push that landed after the end would reset the
    /// timer's fire and keep the sleeper asleep for as long as the polls go on.
    #[test]
    fn an_end_wins_over_pushes() {
        let mut checked = 0;
        for _ in 0..1000 {
            if checked == 20 {
                break;
            }
            let h = Handoff::new().unwrap();
            let lease = Arc::new(Lease::default());
            let (done_tx, done) = mpsc::channel();
            let sleeper = {
                let (h, l) = (h.clone(), lease.clone());
                std::thread::spawn(move || {
                    h.sleep(now_ns() + HANDOFF_NS, Some(&l), || true, || false);
                    let _ = done_tx.send(());
                })
            };
            // The sleep's own deadline is a millisecond away (so that the polls push): a
            // round in which this thread missed the whole lease shows nothing; the next.
            if granted(&lease, &sleeper).is_none() {
                sleeper.join().unwrap();
                continue;
            }
            let polling = AtomicBool::new(true);
            std::thread::scope(|s| {
                s.spawn(|| {
                    while polling.load(Ordering::Relaxed) {
                        lease.poll(now_ns());
                    }
                });
                h.end();
                let woke = done.recv_timeout(Duration::from_secs(10));
                polling.store(false, Ordering::Relaxed);
                assert!(woke.is_ok(), "the end was lost to a push");
            });
            sleeper.join().unwrap();
            checked += 1;
        }
        assert!(checked > 0, "no round saw the lease granted");
    }
}
