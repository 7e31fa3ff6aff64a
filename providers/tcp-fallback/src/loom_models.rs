//! loom models of the provider's two lock-free-ish protocols, run on the real code:
//!
//! * the completion queue ([`crate::cq::Inner`]: `reserve`, `unreserve`, `push`, `poll`,
//!   `wait`) and its poll set's sleep / wake protocol ([`PollSet::run_unless`],
//!   [`PollSet::run_now`], [`PollSet::wake`]), with the `epoll` instance and its waker
//!   replaced by a model event ([`ModelPoller`]): a waiter that finds the queue empty and
//!   sleeps is always woken by a concurrent `push`, and reservations never let the queue
//!   overrun;
//! * connection progress ([`serialised`], what `Conn::progress` runs): every arrival of
//!   work is handled by a run of the work function that starts after it arrived, and the
//!   work function never runs concurrently with itself;
//! * the domain progress thread's nap ([`PollSet::nap`], [`PollSet::end_nap`], with
//!   `park` / `unpark` of the model's thread): the thread naps only while an application
//!   sleeps in a wait that drives its connection, and the wait's return or the domain's
//!   stop always ends the nap;
//! * its hand-off sleep (`Handoff::sleep`, with the `timerfd` replaced by a model timer,
//!   `handoff::ModelTimer`) while the lessee's polls push the timer back (`Lease::poll`): the
//!   domain's stop and a new connection always end it.
//!
//! Run with:
//!
//! ```sh
//! CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" cargo test -p fabric-tcp --release --lib loom
//! ```
//!
//! A lost wake-up leaves the waiter asleep for good (the model event and the model nap
//! have no timeout), so loom reports it as a deadlock; lost progress fails the final check
//! of the progress models. All were seen to fail that way with the protocol broken on
//! purpose: `run_unless` sleeping without its re-check of `done`, or checking `done`
//! before it counts itself a sleeper (deadlock at once); `serialised` without its second
//! look at the flag after letting go (an arrival never handled); `nap_begin` announcing
//! the nap after its checks instead of before, or without its fence, `end_nap` without its
//! fence (the wait's return missed), `wake` without `end_nap_fenced` (the stop missed);
//! a push that does not check that its lease still holds, or a grant that does not check
//! for an end (the stop's or the addition's end forgotten).
//! The fences of the real code are loom's in these builds (`sync::fence`).
//!
//! loom treats sequentially consistent accesses as acquire / release only, so the flag is
//! raised with a swap (the same instruction as a sequentially consistent store on x86):
//! with a plain store loom reports lost progress that the stronger ordering rules out.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use loom::sync::atomic::{AtomicBool, AtomicUsize};
use loom::sync::{Condvar, Mutex};
use loom::thread;
use mio::Events;

use fabric_api::{Completion, ErrorKind};

use super::handoff::{Handoff, ModelTimer};
use super::sync::{serialised, TryLock};
use super::{PollSet, Poller, HANDOFF_NS};
use crate::cq::Inner;

/// The model of an `epoll` instance's waker: set by a wake, cleared by the next wait
/// (edge-triggered `eventfd`: a wake while nobody waits is seen by the next wait).
#[derive(Debug, Default)]
struct Event {
    set: Mutex<bool>,
    cv: Condvar,
}

/// The model of an `epoll` instance with no sockets, only a waker. A wait with a timeout
/// other than zero lasts until a wake (loom has no clock): one that a real `epoll_wait`
/// would only end by timing out is a lost wake-up, and shows as a deadlock.
#[derive(Debug)]
struct ModelPoller(Arc<Event>);

impl Poller for ModelPoller {
    type Registry = ();
    type Waker = Arc<Event>;

    fn wait(&mut self, _events: &mut Events, timeout: Option<Duration>) -> io::Result<()> {
        let mut set = self.0.set.lock().unwrap();
        if timeout != Some(Duration::ZERO) {
            while !*set {
                set = self.0.cv.wait(set).unwrap();
            }
        }
        *set = false;
        Ok(())
    }

    fn wake(waker: &Arc<Event>) -> io::Result<()> {
        *waker.set.lock().unwrap() = true;
        waker.cv.notify_one();
        Ok(())
    }

    type Thread = thread::Thread;
    fn current() -> thread::Thread {
        thread::current()
    }
    /// Lasts until an unpark (loom has no clock): a nap that only its limit would end is
    /// a lost end, and shows as a deadlock.
    fn park(_limit: Duration) {
        thread::park();
    }
    fn unpark(thread: &thread::Thread) {
        thread.unpark();
    }
    type Timer = ModelTimer;
}

type Cq = Inner<ModelPoller>;

impl Event {
    /// Waits until the model descriptor is readable (the event set), without consuming
    /// it, as an event loop waits on the real one.
    fn wait_readable(&self) {
        let mut set = self.set.lock().unwrap();
        while !*set {
            set = self.cv.wait(set).unwrap();
        }
    }
}

/// A completion queue of `capacity` entries over a model event.
fn cq(capacity: usize) -> Arc<Cq> {
    cq_and_event(capacity).0
}

/// A completion queue of `capacity` entries and its model event.
fn cq_and_event(capacity: usize) -> (Arc<Cq>, Arc<Event>) {
    EXECUTIONS.fetch_add(1, Ordering::Relaxed);
    let event = Arc::new(Event::default());
    let set = PollSet::with(ModelPoller(event.clone()), (), event.clone());
    (Arc::new(Inner::new(capacity, set)), event)
}

fn c(context: u64) -> Completion {
    crate::cq::sent(context)
}

/// Longer than any model runs: a wait that ends by its deadline is a lost wake-up.
const FOREVER: Duration = Duration::from_secs(3600);

/// Executions explored (instrumentation, not a loom object).
static EXECUTIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs `model` under loom (bounded to `preemptions` if given) and prints how many
/// executions it explored and how long that took.
fn explore(name: &str, preemptions: Option<usize>, model: impl Fn() + Sync + Send + 'static) {
    let e0 = EXECUTIONS.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let mut b = loom::model::Builder::new();
    if preemptions.is_some() {
        b.preemption_bound = preemptions;
    }
    b.check(model);
    println!(
        "{name}: {} executions in {:.1?}",
        EXECUTIONS.load(Ordering::Relaxed) - e0,
        t0.elapsed()
    );
}

#[test]
fn loom_cq_wait_is_woken_by_push() {
    // The application waits on an empty queue while the engine pushes a completion and
    // another application thread polls (its zero-timeout look competes for the poll set
    // and can take a wake-up meant for nobody).
    explore("cq: wait against push and poll", None, || {
        let cq = cq(2);
        let pusher = {
            let cq = cq.clone();
            thread::spawn(move || {
                cq.reserve().unwrap();
                cq.push(c(1));
            })
        };
        let poller = {
            let cq = cq.clone();
            thread::spawn(move || {
                let mut out = Vec::new();
                cq.poll(&mut out, 0).unwrap();
            })
        };
        assert!(cq.wait(FOREVER).unwrap(), "the wait timed out");
        let mut out = Vec::new();
        assert_eq!(cq.poll(&mut out, 8).unwrap(), 1);
        pusher.join().unwrap();
        poller.join().unwrap();
    });
}

#[test]
fn loom_cq_waits_again_after_a_stale_wake() {
    // Two completions pushed one after the other, each awaited: the second wait can find
    // the first push's wake-up still set, wake early and must sleep again.
    explore("cq: two waits against two pushes", None, || {
        let cq = cq(2);
        let pusher = {
            let cq = cq.clone();
            thread::spawn(move || {
                for i in 0..2 {
                    cq.reserve().unwrap();
                    cq.push(c(i));
                }
            })
        };
        let mut out = Vec::new();
        while out.len() < 2 {
            assert!(cq.wait(FOREVER).unwrap(), "the wait timed out");
            cq.poll(&mut out, 1).unwrap();
        }
        assert_eq!(out.iter().map(|c| c.context).collect::<Vec<_>>(), [0, 1]);
        pusher.join().unwrap();
    });
}

#[test]
fn loom_cq_armed_descriptor_is_woken_by_push() {
    // The application polls, arms and waits for the descriptor (the model event being set:
    // readable until a look at the set consumes it) while the engine pushes two
    // completions: every push after an arm that returned true must make the descriptor
    // readable, or the wait below never ends.
    explore(
        "cq: arm and wait for the descriptor against pushes",
        None,
        || {
            let (cq, event) = cq_and_event(2);
            let pusher = {
                let cq = cq.clone();
                thread::spawn(move || {
                    for i in 0..2 {
                        cq.reserve().unwrap();
                        cq.push(c(i));
                    }
                })
            };
            let mut out = Vec::new();
            while out.len() < 2 {
                cq.poll(&mut out, 2).unwrap();
                if out.len() < 2 && cq.arm() {
                    event.wait_readable();
                }
            }
            assert_eq!(out.iter().map(|c| c.context).collect::<Vec<_>>(), [0, 1]);
            pusher.join().unwrap();
        },
    );
}

#[test]
fn loom_cq_reservations_never_overrun() {
    // A queue of one entry: two posters reserve concurrently (one of them posts an
    // operation that completes without an entry) while the application polls.
    explore("cq: two posters against a poll", None, || {
        let cq = cq(1);
        let posters: Vec<_> = (0..2u64)
            .map(|i| {
                let cq = cq.clone();
                thread::spawn(move || match cq.reserve() {
                    Ok(()) if i == 0 => {
                        cq.push(c(i));
                        1
                    }
                    Ok(()) => {
                        cq.unreserve();
                        0
                    }
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::QueueFull);
                        0
                    }
                })
            })
            .collect();
        let mut out = Vec::new();
        assert!(cq.poll(&mut out, usize::MAX).unwrap() <= 1, "overrun");
        let pushed: usize = posters.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(cq.poll(&mut out, usize::MAX).unwrap() <= 1, "overrun");
        assert_eq!(out.len(), pushed);
        // Every slot came back: one reservation, not two.
        cq.reserve().unwrap();
        assert_eq!(cq.reserve().unwrap_err().kind(), ErrorKind::QueueFull);
    });
}

/// A loom mutex whose release another thread's `try_lock` can come just before. loom's
/// own release is no scheduling point; std's is an atomic swap on the lock word, as its
/// `try_lock` is a compare-exchange there: `word` stands for it, with relaxed accesses
/// (they order nothing, so loom explores that interleaving without adding any ordering).
#[derive(Debug, Default)]
struct ModelLock<T> {
    m: Mutex<T>,
    word: AtomicUsize,
}

impl<T> TryLock<T> for ModelLock<T> {
    fn try_with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.word.fetch_add(1, Ordering::Relaxed);
        let mut g = self.m.try_lock().ok()?;
        let r = f(&mut g);
        self.word.fetch_add(1, Ordering::Relaxed);
        drop(g);
        Some(r)
    }
}

/// A connection reduced to its progress protocol: the receive machine behind a try-lock,
/// the "more to do" flag, and a socket that work arrives on.
#[derive(Debug, Default)]
struct Progress {
    /// The receive machine: how much arrived work it has handled.
    rx: ModelLock<usize>,
    pending: AtomicBool,
    /// Work arrived on the socket so far.
    arrived: AtomicUsize,
    /// A run of the work function is under way (to catch two at once).
    running: AtomicBool,
}

impl Progress {
    /// Work arrives and this thread, seeing it, makes progress (as `Conn::progress`).
    fn arrive_and_progress(&self) {
        self.arrived.fetch_add(1, Ordering::SeqCst);
        serialised(&self.rx, &self.pending, |handled| {
            assert!(
                !self.running.swap(true, Ordering::SeqCst),
                "the work function ran on two threads at once"
            );
            *handled = self.arrived.load(Ordering::SeqCst);
            self.running.store(false, Ordering::SeqCst);
        });
    }
}

/// `threads` threads (the model's own included) each see `arrivals` arrivals of work in
/// turn; once they are done every arrival must have been handled.
fn progress_model(threads: usize, arrivals: usize) -> impl Fn() + Sync + Send + 'static {
    move || {
        EXECUTIONS.fetch_add(1, Ordering::Relaxed);
        let p = Arc::new(Progress::default());
        let others: Vec<_> = (1..threads)
            .map(|_| {
                let p = p.clone();
                thread::spawn(move || (0..arrivals).for_each(|_| p.arrive_and_progress()))
            })
            .collect();
        (0..arrivals).for_each(|_| p.arrive_and_progress());
        others.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(
            *p.rx.m.lock().unwrap(),
            threads * arrivals,
            "an arrival of work was never handled"
        );
    }
}

#[test]
fn loom_progress_two_threads() {
    // Bounded to three preemptions (the unbounded space takes many minutes).
    explore(
        "progress: 2 threads, 2 arrivals each",
        Some(3),
        progress_model(2, 2),
    );
}

#[test]
fn loom_progress_three_threads() {
    // Bounded to three preemptions (the unbounded space takes many minutes).
    explore(
        "progress: 3 threads, 1 arrival each",
        Some(3),
        progress_model(3, 1),
    );
}

/// A domain's poll set watching one connection (a stand-in entry: the nap's protocol only
/// counts connections), and a completion queue of that connection.
fn domain_and_cq() -> (Arc<PollSet<ModelPoller>>, Arc<Cq>) {
    domain_and_cq_with(None)
}

/// [`domain_and_cq`], the domain's set with the progress thread's hand-off timer `h`.
fn domain_and_cq_with(h: Option<Arc<Handoff<ModelTimer>>>) -> (Arc<PollSet<ModelPoller>>, Arc<Cq>) {
    let event = Arc::new(Event::default());
    let domain = PollSet::with(ModelPoller(event.clone()), (), event).with_handoff(h);
    domain
        .conns
        .lock()
        .unwrap()
        .insert(mio::Token(1), std::sync::Weak::new());
    (Arc::new(domain), cq(2))
}

/// Stops the domain from another thread, as `Engine`'s drop does (the flag, then `wake`):
/// the flag and the thread.
fn stop_from_another_thread(
    domain: &Arc<PollSet<ModelPoller>>,
) -> (Arc<AtomicBool>, thread::JoinHandle<()>) {
    let stop = Arc::new(AtomicBool::new(false));
    let stopper = {
        let (domain, stop) = (domain.clone(), stop.clone());
        thread::spawn(move || {
            stop.store(true, Ordering::SeqCst);
            domain.wake();
        })
    };
    (stop, stopper)
}

/// Adds a second connection to the domain from another thread (`PollSet::add`, its
/// socket's registration aside).
fn add_from_another_thread(domain: &Arc<PollSet<ModelPoller>>) -> thread::JoinHandle<()> {
    let domain = domain.clone();
    thread::spawn(move || {
        domain
            .watch(mio::Token(2), std::sync::Weak::new(), || Ok(()))
            .unwrap();
    })
}

#[test]
fn loom_nap_ends_when_the_wait_returns() {
    // The progress thread skipped the connection, which an application drives from a wait
    // on its completion queue; the wait returns when the engine pushes a completion. The
    // thread may nap only while that wait sleeps, and the wait's return must end the nap:
    // else the thread keeps napping (up to NAP_MAX in the provider; for good here, a
    // deadlock) while nobody drives the connection. `TcpCq::wait`'s guard reaches the
    // domain's set through each connection of the queue; here, directly.
    explore("nap: against the return of the driving wait", None, || {
        let (domain, cq) = domain_and_cq();
        let app = {
            let (domain, cq) = (domain.clone(), cq.clone());
            thread::spawn(move || {
                assert!(cq.wait(FOREVER).unwrap(), "the wait timed out");
                domain.end_nap();
            })
        };
        let pusher = {
            let cq = cq.clone();
            thread::spawn(move || {
                cq.reserve().unwrap();
                cq.push(c(1));
            })
        };
        domain.nap_here();
        domain.nap(1, || cq.set.has_sleeper(), || false);
        app.join().unwrap();
        pusher.join().unwrap();
    });
}

#[test]
fn loom_nap_ends_at_the_stop() {
    // The application sleeps in a wait on the connection's queue throughout, so the
    // progress thread naps; the domain stops (`Engine`'s drop: the flag, then `wake`).
    // The thread must see the stop: a nap that missed the wake never ends (a deadlock).
    explore("nap: against the domain's stop", None, || {
        let (domain, cq) = domain_and_cq();
        cq.set.sleepers.fetch_add(1, Ordering::SeqCst);
        let (stop, stopper) = stop_from_another_thread(&domain);
        domain.nap_here();
        while !stop.load(Ordering::Acquire) {
            let napped = domain.nap(1, || cq.set.has_sleeper(), || stop.load(Ordering::Acquire));
            assert!(napped, "the nap was refused");
        }
        stopper.join().unwrap();
    });
}

#[test]
fn loom_nap_ends_when_a_connection_is_added() {
    // The application sleeps in a wait on the one connection's queue throughout, so the
    // progress thread naps; a second connection joins the domain (`PollSet::add`, its
    // socket's registration aside). Nobody drives the new one: the thread must see it,
    // and a nap that missed the addition never ends (a deadlock). The thread naps again
    // until its look finds the set's connections are no longer the ones it skipped.
    explore("nap: a connection added", None, || {
        let (domain, cq) = domain_and_cq();
        cq.set.sleepers.fetch_add(1, Ordering::SeqCst);
        let adder = add_from_another_thread(&domain);
        domain.nap_here();
        while domain.nap(1, || cq.set.has_sleeper(), || false) {}
        adder.join().unwrap();
    });
}

/// A deadline far enough never to be reached in a model (the model timer has no clock
/// anyway), and a poll time near it: a poll then pushes the leased timer back.
const FAR: u64 = u64::MAX / 2;

/// The hand-off sleep (`handoff`): the domain's progress thread sleeps on its timer
/// with the connection's queue holding the lease, while that queue's polls push it back,
/// and `end` (what `wake` and `watch` call) ends the sleep. Returns the domain, the queue
/// and the domain's hand-off.
fn handoff_domain() -> (Arc<PollSet<ModelPoller>>, Arc<Cq>, Arc<Handoff<ModelTimer>>) {
    let h = Handoff::with(ModelTimer::default());
    let (domain, cq) = domain_and_cq_with(Some(h.clone()));
    (domain, cq, h)
}

/// Two polls of the queue, each near the leased deadline of its moment (each pushes if
/// the lease holds then).
fn push_twice(cq: &Cq) {
    cq.set.lease.poll(FAR - 1);
    cq.set.lease.poll(FAR - 1 + HANDOFF_NS);
}

#[test]
fn loom_handoff_sleep_ends_at_the_stop_while_polls_push() {
    // The progress thread sleeps on its timer, leased to the queue whose polls push it
    // back; the domain stops (`Engine`'s drop: the flag, then `wake`). The stop's end must
    // wake the thread: a push after the end (which forgets the fire), or a lease granted
    // after it, would keep the thread asleep for as long as the polls go on (here, for
    // good: a deadlock).
    explore("hand-off: against the stop, polls pushing", None, || {
        let (domain, cq, h) = handoff_domain();
        let (stop, stopper) = stop_from_another_thread(&domain);
        let poller = {
            let cq = cq.clone();
            thread::spawn(move || push_twice(&cq))
        };
        while !stop.load(Ordering::Acquire) {
            h.sleep(
                FAR,
                Some(&cq.set.lease),
                || true,
                || stop.load(Ordering::Acquire),
            );
        }
        stopper.join().unwrap();
        poller.join().unwrap();
    });
}

#[test]
fn loom_handoff_sleep_ends_when_a_connection_is_added() {
    // As above, but a second connection joins the domain (`PollSet::add`, its socket's
    // registration aside), which the lessee does not drive: either the thread's look
    // before the grant sees it (no lease: the sleep is bounded by its own deadline) or the
    // addition's end wakes it.
    explore("hand-off: a connection added, polls pushing", None, || {
        let (domain, cq, h) = handoff_domain();
        let adder = add_from_another_thread(&domain);
        let poller = {
            let cq = cq.clone();
            thread::spawn(move || push_twice(&cq))
        };
        let one = || domain.conns.lock().unwrap().len() == 1;
        while one() {
            h.sleep(FAR, Some(&cq.set.lease), one, || false);
        }
        adder.join().unwrap();
        poller.join().unwrap();
    });
}
