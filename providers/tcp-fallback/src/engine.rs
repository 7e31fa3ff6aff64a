//! The progress engine: no thread per connection.
//!
//! Every socket is non-blocking and sits in two `epoll` sets (through `mio`), both
//! edge-triggered:
//!
//! * the **domain's**, where one progress thread per domain (progress mode `auto`, the
//!   default) sleeps in `epoll_wait` and never spins. It keeps one-sided operations and
//!   emulated atomics completing while the target application never polls
//!   (docs/contract.md section 4);
//! * the **completion queue's**, which the application drives itself: `poll` runs a
//!   zero-timeout `epoll_wait` and makes progress on whatever is ready (a queue of one
//!   connection reads that socket directly instead: `PollSet::run_now`), and `wait`
//!   sleeps in it, so a waiting application is woken by the socket directly, with no
//!   hand-off.
//!
//! **Hand-off.** While the application drives a connection itself (it polled one of the
//! connection's completion queues within `HANDOFF` (1 ms), or sleeps in `wait` on one), the
//! progress thread leaves that connection alone and stops waking up for it: it sleeps on a
//! timer instead of in `epoll_wait`, and readiness that arrives meanwhile waits
//! in the epoll ready list. Otherwise every message would wake two threads, and on a
//! machine with fewer cores than busy threads the progress thread would preempt the
//! polling application, or hold the connection's progress while preempted (measured with
//! `fabric perf pingpong`: see docs/benchmarks-record.md). A connection the progress thread skipped
//! stays on its list until it is progressed, so when the application stops polling the
//! thread takes over within `HANDOFF`: no readiness is lost. The thread sleeps until the
//! first of its skipped connections would stop counting as driven, on a timer
//! (`handoff`): when one completion queue drives every connection of the domain, that
//! queue's polls push the timer back, so a thread that would only find the application
//! still polling does not wake every `HANDOFF` to find it. While every connection of the
//! domain is driven by an application blocked in `wait` (which its socket wakes directly),
//! the thread naps instead of looking every `HANDOFF` (`PollSet::nap_begin`): the wait's
//! return, any wake of the domain's set (a hello repeat, a stop) and a new connection end
//! the nap (`PollSet::end_nap`), so the bound after the application's last look holds.
//!
//! Whoever sees a connection ready calls the connection's `progress`,
//! which is serialised per connection with a try-lock and a "more to do" flag: a second
//! caller never waits, and no readiness is lost. Posting threads write straight to the
//! socket when it has room. In progress mode `manual` there is no thread: progress happens
//! only inside the application's `poll` and `wait` (and posts), as with libfabric's
//! `FI_PROGRESS_MANUAL`.
//!
//! **Deferred acks.** A receive that the application's own pass placed (its poll, wait or
//! arm) does not send its delivery ack ahead of the completion: the ack waits for the
//! application's next message on that connection and leaves in the same `send` (a
//! ping-pong then costs one system call and one segment per message instead of two). The
//! connection is noted in the poll sets of both its completion queues and of the domain
//! (`PollSet::note_held`), so the ack leaves at the latest at the application's next
//! wait or arm on either queue, at its first poll once the ack is due, or, once it stops
//! polling, from the progress thread within `HANDOFF` (which never sleeps without a limit
//! while a note is pending). An ack is due `ack_hold` after its deferral (`TcpOptions::
//! ack_hold`: `ACK_HOLD`, 1 ms, in `auto` mode; zero, the next poll, in `manual` mode),
//! or at once when the connection owes acks of more than `ACK_HOLD_MAX` operations, or
//! when no message of the application has carried acks on that connection since a hold
//! last expired (a target that never answers that peer, whose sender may be waiting for
//! each completion, pays the hold once at most): polls in between leave it held, so that a
//! rank of a collective, which polls while it waits for another partner, sends it with its
//! next message to that peer instead of in a `send` of its own (and its peer saves a
//! `recv`). A poll finds nothing due with one clock read. Passes of the progress thread, a
//! close or a drain send acks before the completions, as before.
//! Requests posted with `SendFlags::MORE` are held the same way (libfabric's `FI_MORE`):
//! small messages then leave together, in one `send`, with the next post without `MORE`.
//! Reads stop at a short `recv` (the socket was empty; a later arrival raises a new edge)
//! instead of asking once more to see `EAGAIN`, except once an event reported the peer's
//! FIN, a reset or an error: those may have come before the short read, with no edge
//! after it, so from then on the machine reads on to the end of the stream.
//!
//! What a poll set sleeps in is behind the `Poller` trait (mio's `epoll` here), so that the loom
//! models (`loom_models`, see `sync`) can run the real sleep / wake protocol over a
//! model event.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Registry, Token, Waker};

use crate::conn::Conn;
use sync::{AtomicUsize, Mutex};

// The modules' own files sit next to this one (`src/sync.rs`, `src/loom_models.rs`).
#[path = "sync.rs"]
pub(crate) mod sync;

// The hand-off timer's own file sits next to this one too (`src/handoff.rs`).
#[path = "handoff.rs"]
pub(crate) mod handoff;
use handoff::{Handoff, Lease};

#[cfg(all(test, loom))]
#[path = "loom_models.rs"]
mod loom_models;

/// How long after the application's last poll of a connection's completion queue the
/// progress thread leaves that connection to it (see the module docs).
pub(crate) const HANDOFF: Duration = Duration::from_millis(1);

/// [`HANDOFF`] in nanoseconds ([`now_ns`]'s unit).
pub(crate) const HANDOFF_NS: u64 = HANDOFF.as_nanos() as u64;

/// How long a poll of the application may keep a deferred delivery ack held, by default
/// in progress mode `auto` (`TcpOptions::ack_hold`; see the module docs): as long as the
/// progress thread takes to send it once the application stops polling.
pub(crate) const ACK_HOLD: Duration = HANDOFF;

/// The longest nap of the progress thread while every connection of its domain is driven
/// by an application blocked in `wait` ([`PollSet::nap_begin`]): a safety net, since the
/// wait's return, any wake of the domain's set and a new connection end the nap.
const NAP_MAX: Duration = Duration::from_millis(100);

/// Acks held across polls at most, per connection (messages and writes they acknowledge):
/// more go at the next poll, so that a sender with a window of messages in flight is
/// never kept waiting for them.
pub(crate) const ACK_HOLD_MAX: u32 = 4;

/// The provider's clock, in nanoseconds ([`fabric_api::sync::monotonic_ns`]): cheap and
/// monotonic, for [`PollSet::app_driven`] and the deadlines of held acks; 0 is never a
/// reading, so callers use it for "never".
pub(crate) fn now_ns() -> u64 {
    fabric_api::sync::monotonic_ns()
}

/// When an initiator repeats its hello mark to this framework's iwarp provider, after
/// [`Conn::start`] wrote it (see [`PollSet::note_hello`]): siw (Linux 6.1, `siw_accept`)
/// sends its MPA Reply before it hands the socket's input to the queue pair, and bytes that
/// arrive in between raise no event it acts on. They wait in the socket until the next
/// segment comes, so a hello mark (and its filler sends) written right upon the reply can
/// sit there unseen, and the acceptor, which waits at most 5 s for the mark, takes us for
/// a foreign stack (no credits, no emulation: seen as a rare conformance flake). So can a
/// first message the application sent at once: an RDM endpoint's tagged message, which
/// then never arrived (another rare flake, `rdm.endpoint_in_a_reused_address_is_another_peer`
/// in `tcp --peer iwarp`). Any later segment makes siw read the whole backlog, in order; a
/// repeat of the mark (the same word, written again) is one that changes nothing else.
/// Every repeat is written, whatever else went out meanwhile (what went out may have been
/// in that moment too), until the connection left the connected state; all fall well
/// within the acceptor's 5 s, and they are four 8-byte writes per connection.
pub(crate) const HELLO_REPEATS: [Duration; 4] = [
    Duration::from_millis(20),
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_millis(2500),
];

/// A connection whose hello mark is repeated at `due` ([`now_ns`]), the `next`-th of
/// [`HELLO_REPEATS`] after `start`.
#[derive(Debug)]
struct HelloRepeat {
    conn: Weak<Conn>,
    start: u64,
    next: usize,
}

impl HelloRepeat {
    fn due(&self) -> u64 {
        self.start + HELLO_REPEATS[self.next].as_nanos() as u64
    }
}

/// Events taken from `epoll` per wait.
const EVENTS: usize = 64;

/// The waker's token in every poll set; connection tokens start above it.
pub(crate) const WAKER: Token = Token(0);

static NEXT_TOKEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

/// A process-unique token for a new connection.
pub(crate) fn next_token() -> Token {
    Token(NEXT_TOKEN.fetch_add(1, Ordering::Relaxed))
}

/// How progress is made (configuration: `[tcp] progress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressMode {
    /// One progress thread per domain, sleeping in `epoll_wait`, plus the application's
    /// own `poll` and `wait`.
    #[default]
    Auto,
    /// Only the application's `poll`, `wait` and posts make progress: one-sided operations
    /// at a target complete only while its application polls.
    Manual,
}

/// What a poll set's threads sleep in, and how another thread wakes the sleeper: mio's
/// `epoll` instance and waker; a model event in the loom models.
pub(crate) trait Poller: std::fmt::Debug {
    /// Watches sockets (used without the poll set's lock).
    type Registry: std::fmt::Debug;
    /// Wakes a thread in [`wait`](Self::wait) (used without the poll set's lock).
    type Waker: std::fmt::Debug;
    /// Waits up to `timeout` (`None`: no limit; zero: only looks) for readiness or a
    /// wake-up. A wake-up while no thread waits is kept for the next wait.
    fn wait(&mut self, events: &mut Events, timeout: Option<Duration>) -> io::Result<()>;
    /// Wakes the thread in `wait`, or the next one.
    fn wake(waker: &Self::Waker) -> io::Result<()>;
    /// A handle on a thread that naps ([`park`](Self::park)).
    type Thread: std::fmt::Debug;
    /// The calling thread's handle.
    fn current() -> Self::Thread;
    /// Naps the calling thread up to `limit`, or until [`unpark`](Self::unpark) of its
    /// handle (an unpark that came first ends the next nap at once).
    fn park(limit: Duration);
    /// Ends the nap of `thread`, or its next one.
    fn unpark(thread: &Self::Thread);
    /// What the progress thread's hand-off sleep sleeps on (`handoff`).
    type Timer: handoff::Timer;
}

impl Poller for Poll {
    type Registry = Registry;
    type Waker = Waker;
    fn wait(&mut self, events: &mut Events, timeout: Option<Duration>) -> io::Result<()> {
        self.poll(events, timeout)
    }
    fn wake(waker: &Waker) -> io::Result<()> {
        waker.wake()
    }
    type Thread = std::thread::Thread;
    fn current() -> std::thread::Thread {
        std::thread::current()
    }
    fn park(limit: Duration) {
        std::thread::park_timeout(limit);
    }
    fn unpark(thread: &std::thread::Thread) {
        thread.unpark();
    }
    type Timer = handoff::Timerfd;
}

/// A map keyed by connection tokens (numbers this provider hands out, one per connection,
/// never chosen by a peer), looked up on every readiness event and every deferral: hashed
/// by [`fabric_api::hash::IdHasher`] instead of SipHash (SipHash was 3 % of the
/// instructions of an 8-byte ping-pong, measured with callgrind).
pub(crate) type TokenMap<V> = fabric_api::hash::IdMap<Token, V>;

/// What a poll set's lock guards: the poller, its event buffer and the list of connections
/// a look found ready, each allocated once (an empty poll or a busy one allocates nothing).
type Looker<P> = (P, Events, Vec<Arc<Conn>>);

/// A set of connections watched by one `epoll` instance, with a waker.
#[derive(Debug)]
pub(crate) struct PollSet<P: Poller = Poll> {
    /// The poller, its event buffer and the ready list.
    poll: Mutex<Looker<P>>,
    registry: P::Registry,
    waker: P::Waker,
    conns: Mutex<TokenMap<Weak<Conn>>>,
    /// Connections holding output back (see [`PollSet::note_held`]),
    /// and 1 while there may be any (checked without the lock on every look).
    owed: Mutex<TokenMap<Weak<Conn>>>,
    owes: AtomicUsize,
    /// The earliest time ([`now_ns`]) at which a poll must send what a connection in
    /// `owed` holds back (`u64::MAX`: none is due before the table changes); see
    /// [`PollSet::send_due`].
    owed_due: AtomicU64,
    /// Threads inside `epoll_wait` on this set (wake them when something else completes).
    pub sleepers: AtomicUsize,
    /// 1 while the application waits for this (completion queue's) set's descriptor to
    /// become readable ([`PollSet::arm`]): the next [`wake`](PollSet::wake) fires the waker
    /// even with no sleeper, and disarms. Not a sleeper for [`PollSet::app_driven`]: an
    /// armed application may never come back, and the progress thread must not leave its
    /// connections to it.
    armed: AtomicUsize,
    /// When a thread last looked at this set ([`now_ns`]); for a completion queue's set,
    /// the application (see [`PollSet::app_driven`]).
    driven_at: AtomicU64,
    /// Connections repeating their hello mark ([`PollSet::note_hello`]), and the earliest
    /// repeat due (`u64::MAX`: none; checked without the lock on every look).
    hellos: Mutex<Vec<HelloRepeat>>,
    hello_due: AtomicU64,
    /// 1 while the domain's progress thread naps ([`PollSet::nap_begin`]), and the thread
    /// to unpark then (set by the thread itself; a completion queue's set has none).
    napping: AtomicUsize,
    nap_thread: Mutex<Option<P::Thread>>,
    /// The domain's progress thread's hand-off timer (see `handoff`; `auto` mode's set
    /// only, and none when `timerfd_create` failed), and, for a completion queue's set,
    /// its side of a lease of one (its polls push the timer back). The timer is made
    /// with the set, before the set is shared, rather than by the thread once it runs:
    /// a value published later through a `OnceLock` is ordered by its `Once`, which
    /// valgrind's helgrind does not see, so an application thread that read it before
    /// any other synchronisation with the progress thread was reported as racing with
    /// its initialisation (a CI failure of the atomic cases' helgrind job).
    handoff: Option<Arc<Handoff<P::Timer>>>,
    lease: Arc<Lease<P::Timer>>,
}

impl PollSet {
    pub fn new() -> io::Result<PollSet> {
        let poll = Poll::new()?;
        let registry = poll.registry().try_clone()?;
        let waker = Waker::new(&registry, WAKER)?;
        Ok(PollSet::with(poll, registry, waker))
    }

    /// Watches `conn`'s socket for input and output readiness.
    pub fn add(&self, token: Token, sock: &TcpStream, conn: &Arc<Conn>) -> io::Result<()> {
        self.watch(token, Arc::downgrade(conn), || {
            self.registry.register(
                &mut SourceFd(&sock.as_raw_fd()),
                token,
                Interest::READABLE | Interest::WRITABLE,
            )
        })
    }

    /// The `epoll` descriptor (a duplicate sharing the instance): readable while
    /// readiness or a wake-up waits in the set.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.registry.as_fd()
    }

    /// Stops watching a connection.
    pub fn remove(&self, token: Token, sock: &TcpStream) {
        let mut conns = self.conns.lock().expect("poll set poisoned");
        if conns.remove(&token).is_some() {
            let _ = self.registry.deregister(&mut SourceFd(&sock.as_raw_fd()));
        }
    }
}

impl<P: Poller> PollSet<P> {
    /// A poll set sleeping in `poll`.
    pub fn with(poll: P, registry: P::Registry, waker: P::Waker) -> PollSet<P> {
        PollSet {
            poll: Mutex::new((poll, Events::with_capacity(EVENTS), Vec::new())),
            registry,
            waker,
            conns: Mutex::new(TokenMap::default()),
            owed: Mutex::new(TokenMap::default()),
            owes: AtomicUsize::new(0),
            owed_due: AtomicU64::new(u64::MAX),
            sleepers: AtomicUsize::new(0),
            armed: AtomicUsize::new(0),
            driven_at: AtomicU64::new(0),
            hellos: Mutex::new(Vec::new()),
            hello_due: AtomicU64::new(u64::MAX),
            napping: AtomicUsize::new(0),
            nap_thread: Mutex::new(None),
            handoff: None,
            lease: Arc::default(),
        }
    }

    /// This set with the progress thread's hand-off timer `h`, if any (before it is
    /// shared).
    pub fn with_handoff(self, h: Option<Arc<Handoff<P::Timer>>>) -> PollSet<P> {
        PollSet { handoff: h, ..self }
    }

    /// Has `conn`, which wrote its hello mark at `start` ([`now_ns`]), repeat it at the
    /// times of [`HELLO_REPEATS`] (see there) from this set: its progress thread (mode
    /// `auto`, the domain's set) or, with no thread, the application's looks at it (both
    /// completion queues' sets; each repeat is written once).
    pub fn note_hello(&self, conn: &Arc<Conn>, start: u64) {
        let r = HelloRepeat {
            conn: Arc::downgrade(conn),
            start,
            next: 0,
        };
        self.hello_due.fetch_min(r.due(), Ordering::SeqCst);
        self.hellos.lock().expect("poll set poisoned").push(r);
        // The progress thread may sleep without a limit: it recomputes its limit.
        self.wake();
    }

    /// Repeats the hello marks due at `now`; a look costs one load while none is due.
    fn repeat_hellos(&self, now: u64) {
        if now < self.hello_due.load(Ordering::Relaxed) {
            return;
        }
        let mut due = Vec::new();
        {
            let mut hellos = self.hellos.lock().expect("poll set poisoned");
            let mut i = 0;
            while i < hellos.len() {
                if hellos[i].due() <= now {
                    due.push(hellos.swap_remove(i));
                } else {
                    i += 1;
                }
            }
        }
        // No set lock is held while connections run (they take their own locks).
        due.retain_mut(|r| {
            let again = r.conn.upgrade().is_some_and(|c| c.repeat_hello(r.next));
            r.next += 1;
            again && r.next < HELLO_REPEATS.len()
        });
        let mut hellos = self.hellos.lock().expect("poll set poisoned");
        hellos.append(&mut due);
        let next = hellos
            .iter()
            .map(HelloRepeat::due)
            .min()
            .unwrap_or(u64::MAX);
        self.hello_due.store(next, Ordering::SeqCst);
    }

    /// How long the progress thread may sleep before a hello mark is due (`None`: none).
    fn until_hello(&self) -> Option<Duration> {
        let due = self.hello_due.load(Ordering::SeqCst);
        // Never zero: a zero wait is a look, which does not count as a sleep (`ready`).
        (due != u64::MAX).then(|| Duration::from_nanos(due.saturating_sub(now_ns()).max(1)))
    }

    /// Whether the application drives this (completion queue's) set: a thread sleeps in
    /// it, or polled it within [`HANDOFF`]. A hint for the progress thread, never needed
    /// for correctness.
    pub fn app_driven(&self) -> bool {
        let now = now_ns();
        self.driven_until(now) > now
    }

    /// Until when ([`now_ns`]) this (completion queue's) set counts as driving its
    /// connections ([`app_driven`](Self::app_driven)) if nobody looks at it again:
    /// [`HANDOFF`] after its last look, or after `now` while a thread sleeps in it; 0 if
    /// nobody ever looked.
    fn driven_until(&self, now: u64) -> u64 {
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            return now.saturating_add(HANDOFF_NS);
        }
        match self.driven_at.load(Ordering::Relaxed) {
            0 => 0,
            at => at.saturating_add(HANDOFF_NS),
        }
    }

    /// Notes that a thread looks at this set at `now` ([`now_ns`]).
    fn mark_driven_at(&self, now: u64) {
        fabric_api::sync::atomic_only(&self.driven_at); // a hint: publishes nothing
        self.driven_at.store(now.max(1), Ordering::Relaxed);
    }

    /// Wakes a thread sleeping in this set (call after making the change it waits for).
    pub fn wake(&self) {
        // The caller's change (a queued completion, a stop flag: often a plain release
        // store) must be visible before we look for sleepers, or a sleeper that counts
        // itself and then looks at the change could miss both: a store may otherwise pass
        // the load below (x86's store buffer does exactly that). Paired with the fence in
        // `run_unless`.
        self.wake_sleepers();
        // `wake_sleepers` fenced already: every completion pushed comes here.
        self.end_sleep_fenced();
    }

    /// [`wake`](Self::wake) but for a nap of the progress thread: for a change that only
    /// a thread sleeping in `epoll_wait` (or an armed application) must see.
    fn wake_sleepers(&self) {
        // As in `wake`.
        sync::fence();
        if self.sleepers.load(Ordering::SeqCst) > 0 || self.armed.swap(0, Ordering::SeqCst) != 0 {
            let _ = P::wake(&self.waker);
        }
    }

    /// Ends a nap of the domain's progress thread ([`PollSet::nap_begin`]) or its
    /// hand-off sleep (`handoff`), if it sleeps so: after a change it must look at (a
    /// wake, a new connection). Costs two loads when it does not.
    pub fn end_nap(&self) {
        // Paired with the store in `nap_begin` (and in `Handoff::sleep`): either this sees
        // the sleep, or the thread, deciding to sleep after it, sees the change that
        // preceded this call.
        sync::fence();
        self.end_sleep_fenced();
    }

    /// [`end_nap`](Self::end_nap) after the caller's own `SeqCst` fence.
    fn end_sleep_fenced(&self) {
        self.end_nap_fenced();
        if let Some(h) = &self.handoff {
            h.end();
        }
    }

    /// Ends a nap only (not a hand-off sleep), after the caller's own `SeqCst` fence.
    fn end_nap_fenced(&self) {
        if self.napping.load(Ordering::SeqCst) != 0 {
            if let Some(t) = &*self.nap_thread.lock().expect("poll set poisoned") {
                P::unpark(t);
            }
        }
    }

    /// Ends the naps of the progress threads of every connection this (completion
    /// queue's) set watches: the application's `wait` on it returns, so they must take
    /// those connections back within [`HANDOFF`] if it does not look again.
    pub fn end_naps_of_conns(&self) {
        // One fence for them all (paired as in `end_nap`), and one look per domain: a
        // queue's connections are mostly of one domain, and this runs at every wait's end.
        sync::fence();
        let conns = self.conns.lock().expect("poll set poisoned");
        let mut last: *const PollSet = std::ptr::null();
        for w in conns.values() {
            if let Some(c) = w.upgrade() {
                let set = c.domain_set();
                if Arc::as_ptr(set) != last {
                    last = Arc::as_ptr(set);
                    // A nap only: a hand-off sleep ends by its own deadline, `HANDOFF`
                    // after the application's last poll at the latest.
                    set.end_nap_fenced();
                }
            }
        }
    }

    /// Whether an application thread sleeps in this (completion queue's) set's `wait`.
    fn has_sleeper(&self) -> bool {
        self.sleepers.load(Ordering::SeqCst) > 0
    }

    /// [`add`](PollSet::add)'s protocol: puts connection `w` in view under `token`,
    /// `register`ing its socket first (nothing if the token is in view already: the same
    /// queue for sends and receives), then ends a nap of the progress thread, which would
    /// not see the new connection's readiness. The loom model
    /// `loom_nap_ends_when_a_connection_is_added` runs it.
    fn watch(
        &self,
        token: Token,
        w: Weak<Conn>,
        register: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        let mut conns = self.conns.lock().expect("poll set poisoned");
        if conns.contains_key(&token) {
            return Ok(());
        }
        register()?;
        conns.insert(token, w);
        drop(conns);
        self.end_nap();
        Ok(())
    }

    /// Names the calling thread as the one whose naps [`end_nap`](Self::end_nap) ends:
    /// the domain's progress thread, before its first [`nap`](Self::nap).
    fn nap_here(&self) {
        *self.nap_thread.lock().expect("poll set poisoned") = Some(P::current());
    }

    /// The progress thread, which has `skipped` connections in view, naps (until
    /// [`end_nap`](Self::end_nap), at most [`NAP_MAX`]) instead of looking again after
    /// [`HANDOFF`], if it may ([`nap_begin`](Self::nap_begin); `all_driven`: every one of
    /// them is driven by an application thread blocked in `wait`) and is not `stopped`.
    /// Returns `false`, having done nothing, when it may not; `true` once the nap is over
    /// (none if `stopped`). The loom models
    /// `loom_nap_ends_when_the_wait_returns` and `loom_nap_ends_at_the_stop` run it.
    fn nap(
        &self,
        skipped: usize,
        all_driven: impl FnOnce() -> bool,
        stopped: impl FnOnce() -> bool,
    ) -> bool {
        if !self.nap_begin(skipped, all_driven) {
            return false;
        }
        // A stop raised after this look ends the nap (its wake sees `napping`).
        if !stopped() {
            P::park(NAP_MAX);
        }
        self.napping.store(0, Ordering::SeqCst);
        true
    }

    /// Whether the progress thread may nap: every connection of the domain (`skipped`
    /// of them, and `all_driven`) is in its skipped list and driven by an application
    /// thread blocked in `wait` on one of its completion queues, which the socket wakes
    /// directly, and no hello repeat is pending. Then a look every millisecond only costs
    /// the machine a wake-up (on a 2-core virtual machine whose target waited through a
    /// 1 MiB write stream, the target's progress thread alone cost the stream 20-35 %:
    /// docs/benchmarks-record.md, forty-second session). Returns `true` with the nap announced
    /// (`napping` set before the checks, so that an [`end_nap`](Self::end_nap) racing
    /// with them unparks the thread), or `false` with nothing changed.
    fn nap_begin(&self, skipped: usize, all_driven: impl FnOnce() -> bool) -> bool {
        if skipped == 0 {
            return false;
        }
        self.napping.store(1, Ordering::SeqCst);
        sync::fence();
        let all = self.hello_due.load(Ordering::SeqCst) == u64::MAX
            && self.conns.lock().expect("poll set poisoned").len() == skipped
            && all_driven();
        if !all {
            self.napping.store(0, Ordering::SeqCst);
        }
        all
    }

    /// Arms this set's descriptor (see `TcpCq`'s `arm`). First looks for readiness once
    /// without waiting, as [`run_now`](Self::run_now), consuming what is there (a stale
    /// wake-up included). Then arms: until the next [`wake`](Self::wake), a wake fires the
    /// waker, so the `epoll` descriptor becomes readable (socket readiness makes it
    /// readable anyway). Returns `done()`, checked after arming (paired with the fence in
    /// `wake`, as in [`run_unless`](Self::run_unless)), so that either `done()` is true or
    /// the change it waits for makes the descriptor readable. Also true when the look may
    /// have left readiness in the ready list (a full batch of events): an edge-triggered
    /// watcher of the descriptor would not hear of it again.
    ///
    /// Looking after arming instead could consume the wake-up of a push that `done()`
    /// then misses (polled already) and leave the set disarmed: the loom model
    /// `loom_cq_armed_descriptor_is_woken_by_push` finds that lost wake-up.
    pub fn arm(&self, done: impl Fn() -> bool) -> bool {
        let now = now_ns();
        self.mark_driven_at(now);
        self.send_held();
        self.repeat_hellos(now);
        let full = match self.poll.try_lock() {
            Ok(mut poll) => self.dispatch(&mut poll, Some(Duration::ZERO)),
            // Another thread sleeps in (or looks at) the set: it consumes the readiness
            // and makes the progress; what that completes wakes us.
            Err(_) => false,
        };
        // A read-modify-write, as `wake`'s disarming: the flag's writes then form one
        // chain, which the loom models need to see that `wake` reads this one (with a
        // plain store, loom lets a later `wake` read an older disarming instead, which
        // the memory model excludes).
        self.armed.swap(1, Ordering::SeqCst);
        sync::fence();
        full || done()
    }

    /// Looks for readiness without waiting and makes progress on every ready connection;
    /// does nothing when another thread is polling this set (it does the work).
    /// Held output goes only once due ([`PollSet::send_due`]): the application is still
    /// polling, and a message it posts meanwhile carries the acks.
    ///
    /// A set that watches one connection only (a completion queue of one endpoint, the
    /// common case of a ping-pong) skips `epoll_wait` and makes progress on it directly:
    /// its `recv` is then the look, and a message that arrived costs one system call to
    /// find instead of two. Its readiness events stay in the epoll ready list until a wait
    /// or an arm consumes them (at most one spurious return from a wait): nothing is lost,
    /// since the pass reads until the socket is empty or ends, and sends what is queued.
    pub fn run_now(&self) {
        // One clock read serves both (a poll's own cost is mostly these few steps).
        let now = now_ns();
        self.mark_driven_at(now);
        self.lease.poll(now);
        self.send_due(now);
        self.repeat_hellos(now);
        if let Ok(mut poll) = self.poll.try_lock() {
            match self.sole() {
                Some(c) => c.progress_app(),
                None => {
                    self.dispatch(&mut poll, Some(Duration::ZERO));
                }
            }
        }
    }

    /// The one connection this set watches, if it watches exactly one.
    fn sole(&self) -> Option<Arc<Conn>> {
        let conns = self.conns.lock().expect("poll set poisoned");
        if conns.len() != 1 {
            return None;
        }
        conns.values().next().and_then(Weak::upgrade)
    }

    /// Sleeps in `epoll_wait` up to `timeout` (`None`: until something happens) unless
    /// `done()` already holds, then makes progress on every ready connection. `done` is
    /// checked after this thread counts as a sleeper, so a [`wake`](Self::wake) that
    /// follows a change `done` looks at is never lost.
    pub fn run_unless(&self, timeout: Option<Duration>, done: impl Fn() -> bool) {
        let now = now_ns();
        self.mark_driven_at(now);
        self.send_held();
        self.repeat_hellos(now);
        let mut poll = self.poll.lock().expect("poll set poisoned");
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // Paired with the fence in `wake`: either the waker sees this sleeper, or this
        // thread sees the waker's change.
        sync::fence();
        if done() {
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        self.dispatch(&mut poll, timeout);
    }

    /// Returns whether the wait filled its batch of events (more may be ready).
    fn dispatch(&self, poll: &mut Looker<P>, timeout: Option<Duration>) -> bool {
        // The set stays locked while progress runs, so that only one thread sleeps in it
        // at a time; progress itself never blocks.
        let (poller, events, ready) = poll;
        let full = self.ready(poller, events, timeout, ready);
        for c in ready.drain(..) {
            c.progress_app();
        }
        full
    }

    /// Notes that `conn` holds output back (acks deferred by an application's progress
    /// pass, see [`Conn::progress_app`]; requests posted with `SendFlags::MORE`): this
    /// set's next wait or arm sends it, and its next poll once `due` ([`now_ns`]; 1: at
    /// once), if nothing carried it before. Wakes a thread sleeping in the set without a
    /// limit (the domain's progress thread), which then keeps the connection in view.
    pub fn note_held(&self, conn: &Arc<Conn>, due: u64) {
        self.owed
            .lock()
            .expect("poll set poisoned")
            .entry(conn.token)
            .or_insert_with(|| Arc::downgrade(conn));
        self.owed_due.fetch_min(due, Ordering::SeqCst);
        self.owes.store(1, Ordering::SeqCst);
        // Not a nap's end: the progress thread naps only while every connection is driven
        // by an application blocked in `wait`, whose own loop sends held output at its
        // next turn, and whose return ends the nap (a wake per deferred ack here cost a
        // context switch per message of a write stream into a waiting target).
        self.wake_sleepers();
    }

    /// Hands `f` each connection that holds output back, taking them out of the table
    /// (the flag is cleared first: a deferral that races with this one raises it again).
    /// `f` runs without the table's lock.
    fn take_owed(&self, mut f: impl FnMut(Weak<Conn>)) {
        if self.owes.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.owes.store(0, Ordering::SeqCst);
        self.owed_due.store(u64::MAX, Ordering::SeqCst);
        let mut taken = std::mem::take(&mut *self.owed.lock().expect("poll set poisoned"));
        for (_, w) in taken.drain() {
            f(w);
        }
        // The emptied table goes back (its allocation is reused) unless a deferral has
        // started a new one meanwhile.
        let mut owed = self.owed.lock().expect("poll set poisoned");
        if owed.is_empty() {
            *owed = taken;
        }
    }

    /// The application is back (a poll, a wait, an arm): what its connections hold back
    /// goes out now unless a post carried it already.
    fn send_held(&self) {
        self.take_owed(|w| {
            if let Some(c) = w.upgrade() {
                c.send_held();
            }
        });
    }

    /// The application polls: what its connections hold back goes out if it is due
    /// ([`Conn::send_held_due`]: corked requests, acks of more than [`ACK_HOLD_MAX`]
    /// operations, acks held for the engine's `ack_hold`); the rest stays held, to ride
    /// on the next message to that peer or leave at a later look. A look costs no more than
    /// the caller's clock read (`now`) while nothing is due.
    fn send_due(&self, now: u64) {
        if self.owes.load(Ordering::Relaxed) == 0 {
            return;
        }
        if now < self.owed_due.load(Ordering::Relaxed) {
            return;
        }
        self.owes.store(0, Ordering::SeqCst);
        self.owed_due.store(u64::MAX, Ordering::SeqCst);
        let mut taken = std::mem::take(&mut *self.owed.lock().expect("poll set poisoned"));
        let mut next = u64::MAX;
        taken.retain(
            |_, w| match w.upgrade().and_then(|c| c.send_held_due(now)) {
                Some(due) => {
                    next = next.min(due);
                    true
                }
                None => false,
            },
        );
        let mut owed = self.owed.lock().expect("poll set poisoned");
        if taken.is_empty() {
            if owed.is_empty() {
                *owed = taken; // the allocation is reused
            }
            return;
        }
        if owed.is_empty() {
            *owed = taken;
        } else {
            owed.extend(taken.drain());
        }
        drop(owed);
        self.owed_due.fetch_min(next, Ordering::SeqCst);
        self.owes.store(1, Ordering::SeqCst);
    }

    /// Waits up to `timeout` for readiness; appends the connections found ready to `out`.
    /// Returns whether the batch of events was full (more may be ready).
    fn ready(
        &self,
        poller: &mut P,
        events: &mut Events,
        timeout: Option<Duration>,
        out: &mut Vec<Arc<Conn>>,
    ) -> bool {
        let res = poller.wait(events, timeout);
        let full = events.iter().count() >= EVENTS;
        if timeout != Some(Duration::ZERO) {
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        if let Err(e) = res {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::error!("epoll_wait failed: {e}");
            }
            return full;
        }
        let conns = self.conns.lock().expect("poll set poisoned");
        out.extend(
            events
                .iter()
                .filter(|e| e.token() != WAKER)
                .filter_map(|e| {
                    let c = conns.get(&e.token()).and_then(Weak::upgrade)?;
                    if e.is_read_closed() || e.is_write_closed() || e.is_error() {
                        c.hung_up();
                    }
                    Some(c)
                }),
        );
        full
    }
}

impl PollSet {
    /// The domain progress thread's loop (see the module docs for the hand-off): until
    /// `stop`, progresses every ready connection the application does not drive itself.
    fn progress_thread(&self, stop: &AtomicBool) {
        self.nap_here();
        // Connections found ready while their application drove them; checked again every
        // HANDOFF until the application stops (then progressed here) or they are gone.
        let mut skipped: TokenMap<Weak<Conn>> = TokenMap::default();
        let mut ready = Vec::new();
        while !stop.load(Ordering::Acquire) {
            self.repeat_hellos(now_ns());
            // Connections holding output back (deferred acks, `MORE` posts): watched like
            // skipped ones, so that it leaves within HANDOFF of the application's last poll.
            self.take_owed(|w| {
                if let Some(c) = w.upgrade() {
                    skipped.insert(c.token, w);
                }
            });
            if skipped.is_empty() {
                let mut poll = self.poll.lock().expect("poll set poisoned");
                self.sleepers.fetch_add(1, Ordering::SeqCst);
                // Paired with the fence in `wake`, as in `run_unless` (and with
                // `note_held`, which raises `owes` before it wakes).
                sync::fence();
                if stop.load(Ordering::Acquire) {
                    self.sleepers.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
                if self.owes.load(Ordering::SeqCst) != 0 {
                    self.sleepers.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
                let (poller, events, _) = &mut *poll;
                self.ready(poller, events, self.until_hello(), &mut ready);
            } else {
                // Readiness arriving now queues in the epoll ready list without waking us.
                let all_driven = || {
                    skipped.values().all(|w| {
                        w.upgrade().is_some_and(|c| {
                            c.send_cq.set().has_sleeper() || c.recv_cq.set().has_sleeper()
                        })
                    })
                };
                if !self.nap(skipped.len(), all_driven, || stop.load(Ordering::Acquire)) {
                    self.hand_off(&skipped, stop);
                }
                let mut poll = self.poll.lock().expect("poll set poisoned");
                let (poller, events, _) = &mut *poll;
                self.ready(poller, events, Some(Duration::ZERO), &mut ready);
            }
            for c in ready.drain(..) {
                skipped.insert(c.token, Arc::downgrade(&c));
            }
            skipped.retain(|_, w| match w.upgrade() {
                None => false,
                Some(c) if c.app_driven() => true,
                Some(c) => {
                    c.progress();
                    false
                }
            });
        }
    }

    /// The progress thread leaves the `skipped` connections to their application: it
    /// sleeps until the earliest time one of them would stop counting as driven
    /// ([`PollSet::app_driven`]), or until a hello repeat is due (a connection no longer
    /// driven is taken over at the next turn, so a deadline already past is no spin).
    /// When one completion queue's set drives every connection of the domain, that set
    /// holds the timer's lease for the sleep, and its polls push the deadline back (see
    /// `handoff`).
    fn hand_off(&self, skipped: &TokenMap<Weak<Conn>>, stop: &AtomicBool) {
        let now = now_ns();
        let until = skipped
            .values()
            .filter_map(Weak::upgrade)
            .map(|c| {
                c.send_cq
                    .set()
                    .driven_until(now)
                    .max(c.recv_cq.set().driven_until(now))
            })
            .min()
            .unwrap_or(now.saturating_add(HANDOFF_NS))
            .min(self.hello_due.load(Ordering::SeqCst));
        let Some(h) = &self.handoff else {
            std::thread::sleep(Duration::from_nanos(until.saturating_sub(now)));
            return;
        };
        let lessee = lessee(skipped);
        // Checked after the sleep is announced: a connection added, or a hello repeat
        // noted, either shows here or ends the sleep.
        let may_lease = || {
            self.hello_due.load(Ordering::SeqCst) == u64::MAX
                && self.conns.lock().expect("poll set poisoned").len() == skipped.len()
        };
        h.sleep(until, lessee.as_ref().map(|s| &s.lease), may_lease, || {
            stop.load(Ordering::Acquire)
        });
    }
}

/// The completion queue's set that drives every one of `skipped` (each one's send or
/// receive queue), if one does: the lessee of a hand-off sleep.
fn lessee(skipped: &TokenMap<Weak<Conn>>) -> Option<Arc<PollSet>> {
    let first = skipped.values().find_map(Weak::upgrade)?;
    let drives_all = |s: &Arc<PollSet>| {
        skipped.values().all(|w| {
            w.upgrade()
                .is_some_and(|c| Arc::ptr_eq(c.recv_cq.set(), s) || Arc::ptr_eq(c.send_cq.set(), s))
        })
    };
    let found = [first.recv_cq.set(), first.send_cq.set()]
        .into_iter()
        .find(|s| drives_all(s))
        .cloned();
    found
}

/// A domain's engine: its poll set and, in `auto` mode, its progress thread.
#[derive(Debug)]
pub(crate) struct Engine {
    pub mode: ProgressMode,
    /// How long an application's poll may keep a deferred ack held (ns; 0: not at all).
    pub ack_hold_ns: u64,
    pub set: Arc<PollSet>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// An engine in `mode`; `ack_hold` as `TcpOptions::ack_hold` (`None`: [`ACK_HOLD`]
    /// in `auto` mode, nothing in `manual` mode, where no thread sends an ack the
    /// application stopped polling for).
    pub fn new(mode: ProgressMode, ack_hold: Option<Duration>) -> io::Result<Engine> {
        // Without a timer the thread sleeps `HANDOFF` at a time, as it did before it.
        let handoff = match mode {
            ProgressMode::Auto => Handoff::new()
                .inspect_err(|e| tracing::warn!("no hand-off timer (timerfd_create: {e})"))
                .ok(),
            ProgressMode::Manual => None,
        };
        let hold = ack_hold.unwrap_or(match mode {
            ProgressMode::Auto => ACK_HOLD,
            ProgressMode::Manual => Duration::ZERO,
        });
        Ok(Engine {
            mode,
            ack_hold_ns: u64::try_from(hold.as_nanos()).unwrap_or(u64::MAX),
            set: Arc::new(PollSet::new()?.with_handoff(handoff)),
            stop: Arc::new(AtomicBool::new(false)),
            thread: Mutex::new(None),
        })
    }

    /// Starts the progress thread (auto mode) if it is not running: on the first endpoint,
    /// so a domain that never connects costs no thread.
    pub fn ensure_thread(&self) -> io::Result<()> {
        if self.mode == ProgressMode::Manual {
            return Ok(());
        }
        let mut t = self.thread.lock().expect("engine poisoned");
        if t.is_some() {
            return Ok(());
        }
        let set = self.set.clone();
        let stop = self.stop.clone();
        *t = Some(
            std::thread::Builder::new()
                .name("fabric-tcp-progress".into())
                .spawn(move || set.progress_thread(&stop))?,
        );
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.set.wake();
        if let Some(t) = self.thread.lock().expect("engine poisoned").take() {
            // The last endpoint can be dropped by the progress thread itself (it held the
            // last reference while making progress): it then exits on its own.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The hand-off timer exists from the domain's opening, before any thread can read it
    /// (a value the progress thread published later was a helgrind report: see the
    /// field's docs), and only in `auto` mode, whose thread sleeps on it.
    #[test]
    fn the_hand_off_timer_is_made_with_the_domains_set_in_auto_mode_only() {
        let auto = Engine::new(ProgressMode::Auto, None).expect("engine");
        assert!(
            auto.thread.lock().unwrap().is_none(),
            "no thread before an endpoint"
        );
        assert!(
            auto.set.handoff.is_some(),
            "auto mode: the timer before the thread"
        );
        let manual = Engine::new(ProgressMode::Manual, None).expect("engine");
        assert!(
            manual.set.handoff.is_none(),
            "manual mode: no thread, no timer"
        );
    }
}
