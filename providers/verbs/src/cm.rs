//! The connection manager: one rdma_cm event channel per domain, read by one thread that
//! acknowledges every event at once and hands it to whoever waits for it (a connect or
//! accept in progress, a listener) or acts on it (a peer's disconnect of an established
//! endpoint: `Disconnected`, and the queue pair flushed).
//!
//! Also the RNR thread of iWARP domains: it retries sends held back for lack of credits.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use fabric_api::{Error, ErrorKind, Notifier};

use crate::ep::{EpCore, Retry};
use crate::ffi::{self, cm_event, CmEvent, CmId, EventChannel, EventFd};
use crate::sync::Patience;

/// Events for one identifier, waited on with a deadline.
///
/// A listener's mailbox also reports, through [`Mailbox::requests`], whether a connection
/// request waits in it: raised on every push of one, lowered when the last is taken.
#[derive(Debug, Default)]
pub(crate) struct Mailbox {
    q: Mutex<VecDeque<CmEvent>>,
    cv: Condvar,
    /// Raised while a CONNECT_REQUEST waits (the listener's descriptor).
    requests: Notifier,
}

fn is_request(ev: &CmEvent) -> bool {
    ev.kind == cm_event::RDMA_CM_EVENT_CONNECT_REQUEST
}

impl Mailbox {
    pub(crate) fn push(&self, ev: CmEvent) {
        let request = is_request(&ev);
        self.q.lock().expect("mailbox poisoned").push_back(ev);
        self.cv.notify_all();
        // After the request is queued and with the queue's lock released: a taker that
        // lowers the level looks at the queue under the notifier's lock, so either it
        // sees this request and keeps the level, or this raise comes after its lowering.
        if request {
            self.requests.raise();
        }
    }

    /// The next event, or `None` once `deadline` passed.
    pub fn wait(&self, deadline: Instant) -> Option<CmEvent> {
        let mut q = self.q.lock().expect("mailbox poisoned");
        let ev = loop {
            if let Some(ev) = q.pop_front() {
                break Some(ev);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break None;
            }
            q = self.cv.wait_timeout(q, left).expect("mailbox poisoned").0;
        };
        drop(q);
        if ev.as_ref().is_some_and(is_request) {
            self.lower_requests();
        }
        ev
    }

    /// The oldest connection request, waiting for one until `deadline` (`None`: not at
    /// all). Other events ahead of it are dropped (a listener acts on requests only; every
    /// event was acknowledged when it was read, and only a request owns an identifier).
    pub fn take_request(&self, deadline: Option<Instant>) -> Option<CmEvent> {
        let mut q = self.q.lock().expect("mailbox poisoned");
        let ev = loop {
            let upto = q.iter().position(is_request).unwrap_or(q.len());
            for ev in q.drain(..upto) {
                tracing::trace!(kind = ev.kind, status = ev.status, "listener event ignored");
            }
            if let Some(ev) = q.pop_front() {
                break Some(ev);
            }
            let left = deadline.map_or(Duration::ZERO, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                break None;
            }
            q = self.cv.wait_timeout(q, left).expect("mailbox poisoned").0;
        };
        drop(q);
        self.lower_requests();
        ev
    }

    /// Lowers the request level unless a request still waits (checked under the
    /// notifier's lock, see [`Mailbox::push`]).
    pub fn lower_requests(&self) {
        self.requests.lower_unless(|| {
            self.q
                .lock()
                .expect("mailbox poisoned")
                .iter()
                .any(is_request)
        });
    }

    /// The level raised while a connection request waits.
    pub fn requests(&self) -> &Notifier {
        &self.requests
    }

    /// Everything queued now.
    pub fn take_all(&self) -> Vec<CmEvent> {
        let all = self.q.lock().expect("mailbox poisoned").drain(..).collect();
        self.lower_requests();
        all
    }
}

/// Who gets an identifier's events.
#[derive(Debug)]
pub(crate) enum Target {
    /// Someone waits (connect, accept, listen).
    Mailbox(Arc<Mailbox>),
    /// An established endpoint.
    Endpoint(Weak<EpCore>),
}

#[derive(Debug)]
struct CmShared {
    chan: EventChannel,
    stop: EventFd,
    reg: Mutex<HashMap<usize, Target>>,
}

/// A domain's connection manager.
pub(crate) struct Cm {
    shared: Arc<CmShared>,
    thread: Option<(JoinHandle<()>, ThreadId)>,
}

impl fmt::Debug for Cm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cm")
            .field("fd", &self.shared.chan.fd())
            .finish()
    }
}

impl Cm {
    pub fn new(name: &str) -> std::io::Result<Cm> {
        let shared = Arc::new(CmShared {
            chan: EventChannel::new()?,
            stop: EventFd::new()?,
            reg: Mutex::new(HashMap::new()),
        });
        let s2 = shared.clone();
        let h = std::thread::Builder::new()
            .name(format!("fabric-{name}-cm"))
            .spawn(move || run(s2))?;
        let tid = h.thread().id();
        Ok(Cm {
            shared,
            thread: Some((h, tid)),
        })
    }

    /// A new identifier on this domain's channel.
    pub fn create_id(&self) -> std::io::Result<CmId> {
        CmId::new(&self.shared.chan)
    }

    pub fn register(&self, key: usize, t: Target) {
        self.shared
            .reg
            .lock()
            .expect("cm registry poisoned")
            .insert(key, t);
    }

    pub fn unregister(&self, key: usize) {
        self.shared
            .reg
            .lock()
            .expect("cm registry poisoned")
            .remove(&key);
    }

    /// Something that keeps the event channel alive (for helper threads).
    pub fn keep_alive(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        self.shared.clone()
    }

    /// Like [`Cm::reap`] for an identifier a helper thread may still hold: whoever drops
    /// the last reference destroys it, never the caller's thread. `qp_uses` (the
    /// protection domain and completion queues of the identifier's queue pair) is dropped
    /// after the identifier: the queue pair, destroyed with the last reference, goes
    /// before them (a protection domain or queue still in use cannot be freed: the kernel
    /// refuses with EBUSY and it would leak).
    pub fn reap_shared<K: Send + 'static>(&self, id: Arc<CmId>, qp_uses: K) {
        // A tuple drops its fields in order: the identifier first.
        self.drop_in_background((id, qp_uses));
    }

    /// Drops `victim` on a thread of its own that also keeps the event channel alive.
    fn drop_in_background<T: Send + 'static>(&self, victim: T) {
        let keep = self.shared.clone();
        let r = std::thread::Builder::new()
            .name("fabric-cm-reap".into())
            .spawn(move || {
                drop(victim);
                drop(keep);
            });
        if let Err(e) = r {
            tracing::warn!("cannot start a thread to destroy a connection identifier: {e}");
        }
    }

    /// Destroys an identifier of a failed connection setup in the background: on iWARP
    /// `rdma_destroy_id` of a connect in progress waits for the TCP connect to give up
    /// (minutes), and the caller must not. The thread keeps the event channel alive.
    pub fn reap(&self, id: CmId) {
        self.unregister(id.key());
        id.destroy_qp();
        self.drop_in_background(id);
    }
}

impl Drop for Cm {
    fn drop(&mut self) {
        self.shared.stop.signal();
        if let Some((h, tid)) = self.thread.take() {
            // The thread itself may drop the last domain reference (through an endpoint it
            // was handling): then it exits on its own after this.
            if std::thread::current().id() != tid {
                let _ = h.join();
            }
        }
    }
}

fn run(s: Arc<CmShared>) {
    loop {
        let ready = match ffi::poll_fds(&[s.chan.fd(), s.stop.fd()], None) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("connection manager poll failed: {e}");
                return;
            }
        };
        if ready[1] {
            return;
        }
        while let Some(ev) = s.chan.next() {
            dispatch(&s, ev);
        }
    }
}

fn dispatch(s: &CmShared, ev: CmEvent) {
    tracing::trace!(kind = ev.kind, status = ev.status, "rdma_cm event");
    let reg = s.reg.lock().expect("cm registry poisoned");
    if ev.kind == cm_event::RDMA_CM_EVENT_CONNECT_REQUEST {
        if let Some(Target::Mailbox(mb)) = reg.get(&ev.listen_id) {
            mb.push(ev);
            return;
        }
        drop(reg);
        // Nobody listens any more: refuse and destroy the request's identifier.
        // SAFETY: the event's identifier is a new one that nobody else adopted.
        #[allow(unsafe_code)]
        let id = unsafe { CmId::adopt(ev.id) };
        id.reject();
        return;
    }
    match reg.get(&ev.id) {
        Some(Target::Mailbox(mb)) => mb.push(ev),
        Some(Target::Endpoint(w)) => {
            let ep = w.upgrade();
            drop(reg);
            if let Some(ep) = ep {
                handle_endpoint_event(&ep, &ev);
            }
        }
        None => {}
    }
}

/// Acts on an event of an established endpoint.
pub(crate) fn handle_endpoint_event(ep: &Arc<EpCore>, ev: &CmEvent) {
    match ev.kind {
        cm_event::RDMA_CM_EVENT_DISCONNECTED => ep.on_disconnected(None),
        cm_event::RDMA_CM_EVENT_DEVICE_REMOVAL => ep.on_disconnected(Some(Error::new(
            ErrorKind::NoDevice,
            format!(
                "the RDMA device was removed (rdma_cm event {}, status {})",
                ev.kind, ev.status
            ),
        ))),
        _ => {}
    }
}

/// The RNR thread of a domain: while an endpoint holds sends back for lack of credits (or
/// owes its peer a credit update), it retries on a timer, as a device retries after an RNR
/// NAK. Where the domain detects dead peers itself (iWARP), the same thread also looks at
/// every watched endpoint once per liveness tick (`EpCore::check_liveness`). It sleeps
/// without a timeout when nothing is blocked or watched.
#[derive(Debug)]
pub(crate) struct Rnr {
    shared: Arc<RnrShared>,
    thread: Mutex<Option<(JoinHandle<()>, ThreadId)>>,
    name: String,
    /// The liveness tick, when the domain detects dead peers.
    tick: Option<Duration>,
}

/// The endpoints the thread looks after.
#[derive(Debug, Default)]
struct RnrLists {
    /// Blocked (held-back work, owed credit updates) or dead with work to flush.
    blocked: Vec<Weak<EpCore>>,
    /// An endpoint joined `blocked`, or one there needs more than its slower pace, since
    /// the thread last looked: it looks soon (`Rnr::add`, `Rnr::soon`).
    soon: bool,
    /// Watched for signs of life.
    watched: Vec<Weak<EpCore>>,
    /// Served: emulated atomics (`EpCore::poll_emu`), polled adaptively.
    served: Vec<Weak<EpCore>>,
}

#[derive(Debug, Default)]
struct RnrShared {
    lists: Mutex<RnrLists>,
    cv: Condvar,
    stop: AtomicBool,
    /// An emulated atomic was just posted: poll the served endpoints quickly again.
    hurry: AtomicBool,
}

impl Rnr {
    /// The helper of a domain; `tick`: how often watched endpoints are looked at.
    pub fn new(name: &str, tick: Option<Duration>) -> Rnr {
        Rnr {
            shared: Arc::default(),
            thread: Mutex::new(None),
            name: name.to_string(),
            tick,
        }
    }

    fn start(&self) {
        let mut t = self.thread.lock().expect("rnr poisoned");
        if t.is_none() {
            let s = self.shared.clone();
            let tick = self.tick;
            match std::thread::Builder::new()
                .name(format!("fabric-{}-rnr", self.name))
                .spawn(move || rnr_main(s, tick))
            {
                Ok(h) => {
                    let id = h.thread().id();
                    *t = Some((h, id));
                }
                Err(e) => tracing::error!("cannot start the RNR thread: {e}"),
            }
        }
    }

    /// Registers a blocked endpoint (starting the thread on first use).
    pub fn add(&self, ep: Weak<EpCore>) {
        self.start();
        {
            let mut l = self.shared.lists.lock().expect("rnr poisoned");
            l.blocked.push(ep);
            l.soon = true;
        }
        self.shared.cv.notify_all();
    }

    /// Has the thread look at its blocked endpoints soon (after [`BLOCKED_MIN`]): one of
    /// them, left at the slower pace ([`WATCH_MAX`]), now holds requests back or owes an
    /// update.
    pub fn soon(&self) {
        self.shared.lists.lock().expect("rnr poisoned").soon = true;
        self.shared.cv.notify_all();
    }

    /// Watches an endpoint for signs of life until `EpCore::check_liveness` says to stop
    /// (no-op where the domain does not detect dead peers).
    pub fn watch(&self, ep: Weak<EpCore>) {
        if self.tick.is_none() {
            return;
        }
        self.start();
        self.shared
            .lists
            .lock()
            .expect("rnr poisoned")
            .watched
            .push(ep);
        self.shared.cv.notify_all();
    }
}

impl Rnr {
    /// Serves an endpoint's emulated atomics until `EpCore::poll_emu` says to stop.
    pub fn serve(&self, ep: Weak<EpCore>) {
        self.start();
        self.shared
            .lists
            .lock()
            .expect("rnr poisoned")
            .served
            .push(ep);
        self.hurry();
    }

    /// Polls the served endpoints at the quickest pace again (an atomic is in flight).
    pub fn hurry(&self) {
        self.shared.raise(&self.shared.hurry);
    }
}

impl RnrShared {
    /// Sets `flag` and wakes the thread. The store happens under the lists' lock, which the
    /// thread holds from looking at its flags until it sleeps on the condition variable: a
    /// store and notification in between, without the lock, would be lost, and the thread
    /// could sleep for good (a domain's drop hung joining it, seen once in CI).
    fn raise(&self, flag: &AtomicBool) {
        {
            let _l = self.lists.lock().unwrap_or_else(|e| e.into_inner());
            flag.store(true, Ordering::Release);
        }
        self.cv.notify_all();
    }
}

impl Drop for Rnr {
    fn drop(&mut self) {
        self.shared.raise(&self.shared.stop);
        if let Some((h, tid)) = self.thread.lock().expect("rnr poisoned").take() {
            if std::thread::current().id() != tid {
                let _ = h.join();
            }
        }
    }
}

/// The RNR thread's slowest look at blocked endpoints while every one of them is blocked
/// only for receives not yet announced (batched credit updates) and its application posted
/// or filled receives since the previous look (`ep::Retry::Watching`); otherwise 2 ms.
/// The look is for an application that stops while its peer is out of credit (it reaps
/// the receive queue once nothing moved for `DEFER`): that peer then waits up to about
/// twice this once. While the application works, its own posts and polls write the
/// updates: looking every 2 ms woke this thread 500 times a second for nothing, each
/// wake-up taking a vCPU from a spinning application in the soft-RDMA guest (an A/B:
/// docs/benchmarks-record.md, twenty-eighth session).
const WATCH_MAX: Duration = Duration::from_millis(32);

/// The RNR thread's quickest look at blocked endpoints (after a change in the list).
const BLOCKED_MIN: Duration = Duration::from_micros(100);
/// Its slowest while any of them is blocked for more than receives not announced.
const BLOCKED_MAX: Duration = Duration::from_millis(2);

/// The RNR thread's next wait for its blocked endpoints after a look that took `delay`:
/// back to the quickest when one of them `left` the list; the same when one was
/// `skipped` (`Retry::Skipped`: the next look waits for its lock, and is not put off for
/// it); else twice as long, up to [`BLOCKED_MAX`], or [`WATCH_MAX`] when every one left
/// is `watching` (`Retry::Watching`).
fn blocked_pace(delay: Duration, left: bool, watching: bool, skipped: bool) -> Duration {
    if left {
        return BLOCKED_MIN;
    }
    if skipped {
        return delay;
    }
    (delay * 2).min(if watching { WATCH_MAX } else { BLOCKED_MAX })
}

/// Whether a wake-up of the helper thread at `now` takes a list whose next look falls due
/// at `next`, at a pace of `pace`: once due, or early by up to half its pace. The thread
/// wakes only when some list is due; taking the others that are nearly due puts them on
/// that wake-up, and after one such pass lists at the same pace stay together. Each list
/// kept its own wake-up before: beside an 8-byte ping-pong in the soft-RDMA guest the
/// emulation's and the blocked endpoints' looks, both every 32 ms, fell due apart, and
/// the thread slept twice per pass (docs/benchmarks-record.md, fifty-sixth session).
fn takes(now: Instant, next: Instant, pace: Duration) -> bool {
    now + pace / 2 >= next
}

/// How the next pass over a list takes the endpoints' locks: waiting, when the last pass
/// skipped one ([`Patience`]), so that no look is put off twice.
fn patience_after(skipped: bool) -> Patience {
    if skipped {
        Patience::Wait
    } else {
        Patience::Skip
    }
}

fn rnr_main(s: Arc<RnrShared>, tick: Option<Duration>) {
    let mut delay = BLOCKED_MIN;
    let mut next_blocked = Instant::now();
    let mut next_watch = Instant::now();
    let mut emu_delay = crate::emu::POLL_MIN;
    let mut next_serve = Instant::now();
    let mut last_busy = Instant::now();
    let mut serve_patience = Patience::Skip;
    let mut blocked_patience = Patience::Skip;
    // The lists' endpoints are moved into these between looks and back (`append` keeps
    // both vectors' capacity): a look allocates nothing once they have grown.
    let mut batch: Vec<Weak<EpCore>> = Vec::new();
    let mut watch: Vec<Weak<EpCore>> = Vec::new();
    let mut serve: Vec<Weak<EpCore>> = Vec::new();
    loop {
        {
            let mut l = s.lists.lock().expect("rnr poisoned");
            loop {
                if s.stop.load(Ordering::Acquire) {
                    return;
                }
                if s.hurry.swap(false, Ordering::AcqRel) {
                    emu_delay = Duration::ZERO;
                    last_busy = Instant::now();
                    next_serve = Instant::now();
                }
                let now = Instant::now();
                if std::mem::take(&mut l.soon) {
                    // A newly blocked endpoint, or one that needs more than the slower
                    // pace, is looked at within the quickest pause.
                    delay = BLOCKED_MIN;
                    next_blocked = next_blocked.min(now + BLOCKED_MIN);
                }
                let blocked = !l.blocked.is_empty();
                let watching = tick.is_some() && !l.watched.is_empty();
                let serving = !l.served.is_empty();
                if (blocked && now >= next_blocked)
                    || (watching && now >= next_watch)
                    || (serving && now >= next_serve)
                {
                    break;
                }
                // Each list keeps its own pace: the emulation's is never held up by the
                // blocked endpoints' (nor the reverse).
                let until = [
                    blocked.then_some(next_blocked),
                    watching.then_some(next_watch),
                    serving.then_some(next_serve),
                ]
                .into_iter()
                .flatten()
                .min();
                l = match until {
                    Some(t) => {
                        let left = t.saturating_duration_since(now);
                        s.cv.wait_timeout(l, left).expect("rnr poisoned").0
                    }
                    None => s.cv.wait(l).expect("rnr poisoned"),
                };
            }
            let now = Instant::now();
            if let Some(t) = tick.filter(|t| takes(now, next_watch, *t)) {
                next_watch = now + t;
                watch.append(&mut l.watched);
            }
            if takes(now, next_serve, emu_delay) {
                serve.append(&mut l.served);
            }
            if takes(now, next_blocked, delay) {
                batch.append(&mut l.blocked);
            }
        }
        if !serve.is_empty() {
            let mut busy = false;
            let mut covered = true;
            let mut skipped = false;
            serve.retain(|w| {
                w.upgrade().is_some_and(|ep| {
                    let pass = ep.poll_emu(serve_patience);
                    busy |= pass.busy;
                    covered &= pass.covered;
                    skipped |= pass.skipped;
                    pass.keep
                })
            });
            serve_patience = patience_after(skipped);
            if busy {
                last_busy = Instant::now();
            }
            // Spin (yielding) while atomics flow and a little after; then back off, the
            // further the longer none came, and furthest while the applications' polls
            // look at every area themselves.
            let quiet = last_busy.elapsed();
            emu_delay = if quiet < crate::emu::SPIN {
                Duration::ZERO
            } else {
                (emu_delay * 2).clamp(crate::emu::POLL_MIN, crate::emu::slowest(quiet, covered))
            };
            next_serve = Instant::now() + emu_delay;
            s.lists
                .lock()
                .expect("rnr poisoned")
                .served
                .append(&mut serve);
            if emu_delay.is_zero() {
                std::thread::yield_now();
            }
        }
        // No list lock is held while endpoints run (they take queue and endpoint locks).
        if !batch.is_empty() {
            let before = batch.len();
            let mut watching = true;
            let mut skipped = false;
            batch.retain(|w| {
                w.upgrade()
                    .is_some_and(|ep| match ep.retry_blocked(blocked_patience) {
                        Retry::Done => false,
                        Retry::Watching => true,
                        Retry::Again => {
                            watching = false;
                            true
                        }
                        Retry::Skipped => {
                            skipped = true;
                            true
                        }
                    })
            });
            blocked_patience = patience_after(skipped);
            delay = blocked_pace(delay, batch.len() < before, watching, skipped);
            next_blocked = Instant::now() + delay;
            s.lists
                .lock()
                .expect("rnr poisoned")
                .blocked
                .append(&mut batch);
        }
        if !watch.is_empty() {
            watch.retain(|w| w.upgrade().is_some_and(|ep| ep.check_liveness()));
            s.lists
                .lock()
                .expect("rnr poisoned")
                .watched
                .append(&mut watch);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, BorrowedFd};

    fn readable(fd: BorrowedFd<'_>) -> bool {
        fabric_api::notify::wait_readable(fd, Duration::ZERO).expect("poll")
    }

    /// An event that owns no identifier (nothing adopts it in these tests).
    fn event(kind: u32, id: usize) -> CmEvent {
        CmEvent {
            kind,
            status: 0,
            id,
            listen_id: 0,
            private_data: Vec::new(),
            initiator_depth: 0,
            responder_resources: 0,
        }
    }

    #[test]
    fn blocked_endpoints_are_looked_at_slower_while_their_applications_work() {
        let ms = Duration::from_millis;
        // A change in the list: the quickest look.
        assert_eq!(blocked_pace(ms(8), true, true, false), BLOCKED_MIN);
        assert_eq!(blocked_pace(ms(8), true, true, true), BLOCKED_MIN);
        // Held requests or owed updates: doubling up to 2 ms.
        assert_eq!(
            blocked_pace(BLOCKED_MIN, false, false, false),
            BLOCKED_MIN * 2
        );
        assert_eq!(blocked_pace(ms(2), false, false, false), BLOCKED_MAX);
        assert_eq!(blocked_pace(ms(16), false, false, false), BLOCKED_MAX);
        // Only receives to announce, applications at work: on up to 32 ms.
        assert_eq!(blocked_pace(ms(2), false, true, false), ms(4));
        assert_eq!(blocked_pace(ms(16), false, true, false), WATCH_MAX);
        assert_eq!(blocked_pace(WATCH_MAX, false, true, false), WATCH_MAX);
        // A look skipped (the application held the lock): the same pace again, not
        // slower, for the look that then waits for the lock.
        assert_eq!(blocked_pace(BLOCKED_MIN, false, false, true), BLOCKED_MIN);
        assert_eq!(blocked_pace(ms(2), false, true, true), ms(2));
    }

    /// A pass that skipped a look is followed by one that waits for the lock, and a pass
    /// that skipped none by one that may skip: no look is put off twice in a row.
    #[test]
    fn a_skipped_look_is_taken_patiently_at_the_next_pass() {
        assert_eq!(patience_after(true), Patience::Wait);
        assert_eq!(patience_after(false), Patience::Skip);
    }

    /// The lists nearly due ride on a wake-up that another list's look causes, and then
    /// stay on one wake-up: two lists at 32 ms that fell due 10 ms apart are taken
    /// together from the first wake-up on.
    #[test]
    fn lists_nearly_due_are_taken_on_the_same_wake_up() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        assert!(takes(t0, t0, WATCH_MAX), "due");
        assert!(takes(t0, t0 - ms(5), WATCH_MAX), "overdue");
        assert!(
            takes(t0, t0 + ms(10), WATCH_MAX),
            "due within half its pace"
        );
        assert!(takes(t0, t0 + ms(16), WATCH_MAX));
        assert!(!takes(t0, t0 + ms(17), WATCH_MAX), "not yet");
        assert!(
            !takes(t0, t0 + ms(1), Duration::ZERO),
            "a spinning list waits for its time"
        );
        // Two lists at 32 ms, due at 0 and 10 ms: simulate the thread's wake-ups.
        let (mut a, mut b) = (t0, t0 + ms(10));
        let mut wakeups = Vec::new();
        for _ in 0..4 {
            let now = a.min(b); // the thread wakes when the first is due
            let (ta, tb) = (takes(now, a, WATCH_MAX), takes(now, b, WATCH_MAX));
            assert!(ta && tb, "both lists taken at {:?}", now - t0);
            a = now + WATCH_MAX;
            b = now + WATCH_MAX;
            wakeups.push(now - t0);
        }
        assert_eq!(wakeups, [ms(0), ms(32), ms(64), ms(96)]);
    }

    #[test]
    fn the_listener_descriptor_is_readable_while_a_request_waits() {
        let mb = Mailbox::default();
        let fd = mb.requests().fd().unwrap();
        assert!(!readable(fd));
        assert!(mb.take_request(None).is_none());
        // Other events raise nothing and are dropped by the taker.
        mb.push(event(cm_event::RDMA_CM_EVENT_ADDR_CHANGE, 1));
        assert!(!readable(fd));
        mb.push(event(cm_event::RDMA_CM_EVENT_CONNECT_REQUEST, 2));
        mb.push(event(cm_event::RDMA_CM_EVENT_ADDR_CHANGE, 3));
        mb.push(event(cm_event::RDMA_CM_EVENT_CONNECT_REQUEST, 4));
        assert!(readable(fd));
        assert_eq!(mb.take_request(None).map(|e| e.id), Some(2));
        // One more waits: still readable.
        assert!(readable(fd));
        assert_eq!(mb.take_request(None).map(|e| e.id), Some(4));
        assert!(!readable(fd));
        assert!(mb.take_request(None).is_none());
        assert!(mb.take_all().is_empty());
    }

    #[test]
    fn take_request_waits_until_its_deadline() {
        let mb = Arc::new(Mailbox::default());
        let t0 = Instant::now();
        assert!(mb
            .take_request(Some(t0 + Duration::from_millis(30)))
            .is_none());
        assert!(t0.elapsed() >= Duration::from_millis(30));
        let mb2 = mb.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            mb2.push(event(cm_event::RDMA_CM_EVENT_CONNECT_REQUEST, 9));
        });
        let got = mb.take_request(Some(Instant::now() + Duration::from_secs(60)));
        assert_eq!(got.map(|e| e.id), Some(9));
        h.join().unwrap();
        // The pusher raises after queueing, so its raise may come after the taker's
        // lowering: readiness with nothing to take, which the contract allows. The next
        // look that finds nothing lowers it.
        assert!(mb.take_request(None).is_none());
        assert!(!readable(mb.requests().fd().unwrap()));
    }

    /// A request pushed while another thread takes the last one is never lost: the level
    /// is raised whenever a request waits once both are done.
    #[test]
    fn a_request_racing_with_the_lowering_keeps_the_descriptor_readable() {
        let mb = Arc::new(Mailbox::default());
        let fd = mb.requests().fd().unwrap().as_raw_fd();
        for round in 0..2000 {
            mb.push(event(cm_event::RDMA_CM_EVENT_CONNECT_REQUEST, round));
            let mb2 = mb.clone();
            let pusher = std::thread::spawn(move || {
                mb2.push(event(
                    cm_event::RDMA_CM_EVENT_CONNECT_REQUEST,
                    round + 100_000,
                ));
            });
            let first = mb.take_request(None);
            pusher.join().unwrap();
            assert!(first.is_some());
            // SAFETY: the descriptor is the mailbox's, alive for the whole test.
            #[allow(unsafe_code)]
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            assert!(
                readable(fd),
                "round {round}: a waiting request left the descriptor unreadable"
            );
            assert!(mb.take_request(None).is_some());
            assert!(!readable(fd));
        }
    }

    /// A helper dropped right after it started must not sleep through the stop: the stop
    /// (and any wake-up flag) is raised under the lock the thread checks its flags under.
    /// Before, the notification could fall between the thread's check and its wait, and
    /// the drop then joined a thread asleep for good.
    #[test]
    fn a_helper_dropped_right_after_starting_stops() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..3000 {
                let r = Rnr::new("test", None);
                r.start();
                drop(r);
            }
            let _ = tx.send(());
        });
        assert!(
            rx.recv_timeout(Duration::from_secs(120)).is_ok(),
            "a helper thread slept through its stop (the drop never returned)"
        );
    }
}
