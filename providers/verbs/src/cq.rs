//! Completion queues: the device queue with its completion channel, a software queue of
//! completions ready for the application, and the reservations that make overrun
//! impossible (see the crate docs).

use std::fmt;
use std::marker::PhantomData;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use fabric_api::hash::IdMap;
use fabric_api::spi::CompletionQueue;
use fabric_api::{Completion, Error, ErrorKind, Result};

use crate::emu::EmuWatch;
use crate::ep::EpCore;
use crate::ffi::{self, EventFd, HwCq, Wc};
use crate::sync::{AtomicUsize, Ordering, Rank, Ranked, RankedGuard};
use crate::Flavor;

/// Early-receive completions kept for endpoints not registered yet, at most.
const ORPHANS: usize = 256;

/// Completions one device poll of [`CqInner::drain`] takes at most.
const DRAIN_BATCH: usize = 32;

/// The least capacity of a caller's empty vector that a poll takes in trade for the ready
/// queue's (see [`CqInner::poll_ready`]): a smaller one would have the queue grow its
/// buffer again at the next completions.
const READY_KEEP: usize = 16;

/// The longest a blocking wait sleeps while an endpoint is watched ([`CqInner::watch`]):
/// what it waits for is a count written into memory, which raises no event.
const WATCH_NAP: Duration = Duration::from_micros(250);

/// A device completion queue as the core drains it.
pub(crate) trait DeviceQueue: Send + Sync {
    /// Takes up to `out.len()` completions; returns how many.
    fn poll(&self, out: &mut [Wc]) -> std::io::Result<usize>;
    /// The completion channel's descriptor, if the queue has one (the device's has; the
    /// loom models' queues have none).
    fn channel_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

impl DeviceQueue for HwCq {
    #[inline(always)]
    fn poll(&self, out: &mut [Wc]) -> std::io::Result<usize> {
        HwCq::poll(self, out)
    }
    fn channel_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.fd())
    }
}

/// What a drained completion is handed to: the endpoint of its queue pair.
pub(crate) trait CompletionTarget<Q: DeviceQueue>: Send + Sync + Sized {
    /// Handles one completion of this target's queue pair. Called with the queue's lock
    /// held (`st`): takes the target's own lock, which ranks after it.
    fn on_completion(self: &Arc<Self>, cq: &CqInner<Q, Self>, st: &mut CqState<Self>, wc: &Wc);

    /// The common case of [`on_completion`](Self::on_completion), tried first: handles
    /// `wc` if it needs nothing of the queue's state but its ready list, and returns
    /// whether it did (else the drain hands it to `on_completion`, having changed
    /// nothing). Borrowed from the queue's map, so the drain takes no counted reference
    /// to the target for it (two atomic operations per completion, dear in the guest:
    /// docs/benchmarks-record.md, thirty-second and thirty-fourth sessions).
    fn complete_common(
        &self,
        _cq: &CqInner<Q, Self>,
        _ready: &mut Vec<Completion>,
        _wc: &Wc,
    ) -> bool {
        false
    }

    /// Settles what the target waits for outside the device queue (see
    /// [`CqInner::watch`]); called with the queue's lock held, after a drain. Returns
    /// whether to keep watching the target.
    fn settle(self: &Arc<Self>, _cq: &CqInner<Q, Self>, _st: &mut CqState<Self>) -> bool {
        false
    }

    /// Serves what a poll's look at the target's emulation area found
    /// ([`CqState::looked`]); called with no lock held.
    fn serve(self: &Arc<Self>) {}
}

/// The endpoints reporting into a queue, by queue-pair number: a short vector scanned
/// while they are few (a queue usually serves one or two queue pairs), a hash map once
/// they are more ([`IdMap`]'s multiplicative hash: numbers the local device hands out,
/// never a peer's). Every completion the drain routes looks its endpoint up here, and
/// a scan of one entry is a compare where the map's probe is some thirty instructions.
#[derive(Debug)]
pub(crate) struct QpMap<E> {
    few: Vec<(u32, Arc<E>)>,
    many: IdMap<u32, Arc<E>>,
}

impl<E> Default for QpMap<E> {
    fn default() -> Self {
        QpMap {
            few: Vec::new(),
            many: IdMap::default(),
        }
    }
}

impl<E> QpMap<E> {
    /// Entries kept in the scanned vector; the map takes them all beyond.
    const FEW: usize = 4;

    /// The endpoint of queue pair `qpn`.
    #[inline(always)]
    pub fn get(&self, qpn: &u32) -> Option<&Arc<E>> {
        if self.many.is_empty() {
            self.few.iter().find(|(q, _)| q == qpn).map(|(_, e)| e)
        } else {
            self.many.get(qpn)
        }
    }

    /// Registers `ep` for `qpn`; returns the endpoint it replaces.
    pub fn insert(&mut self, qpn: u32, ep: Arc<E>) -> Option<Arc<E>> {
        if !self.many.is_empty() {
            return self.many.insert(qpn, ep);
        }
        if let Some((_, e)) = self.few.iter_mut().find(|(q, _)| *q == qpn) {
            return Some(std::mem::replace(e, ep));
        }
        if self.few.len() < Self::FEW {
            self.few.push((qpn, ep));
        } else {
            self.many.extend(self.few.drain(..));
            self.many.insert(qpn, ep);
        }
        None
    }

    /// Forgets queue pair `qpn`; returns its endpoint.
    pub fn remove(&mut self, qpn: &u32) -> Option<Arc<E>> {
        if !self.many.is_empty() {
            return self.many.remove(qpn);
        }
        let i = self.few.iter().position(|(q, _)| q == qpn)?;
        Some(self.few.swap_remove(i).1)
    }

    /// Forgets every queue pair.
    #[cfg(all(loom, test))]
    pub fn clear(&mut self) {
        self.few.clear();
        self.many.clear();
    }

    /// How many queue pairs are registered.
    #[cfg(all(test, not(loom)))]
    pub fn len(&self) -> usize {
        self.few.len() + self.many.len()
    }
}

/// State behind the queue's lock.
#[derive(Debug)]
pub(crate) struct CqState<E = EpCore> {
    /// Completions for the application, in order: pushed at the back, and usually all
    /// taken at once by the next poll (a move of the whole vector's contents).
    pub ready: Vec<Completion>,
    /// Endpoints whose queue pairs report into this queue, by QP number.
    pub qps: QpMap<E>,
    /// Completions of early receives (posted before an accept, see `ep::EarlyRing`) of a
    /// queue pair whose endpoint is not registered yet: handed to it when it is.
    pub orphans: Vec<Wc>,
    /// What [`CqInner::drain`] polls the device into.
    scratch: [Wc; DRAIN_BATCH],
    /// Emulation areas that polls look at ([`EmuWatch::look`]), one per poll in turn
    /// (`look_at` is the next), so that a poll's cost does not grow with them, and their
    /// targets; an entry leaves the list when its target is gone.
    pub looked: Vec<(Arc<EmuWatch>, Weak<E>)>,
    look_at: usize,
}

impl<E> Default for CqState<E> {
    fn default() -> Self {
        CqState {
            // At least what a poll trades for it (`READY_KEEP`), so that the trade goes on.
            ready: Vec::with_capacity(READY_KEEP),
            qps: QpMap::default(),
            orphans: Vec::new(),
            scratch: [Wc::default(); DRAIN_BATCH],
            looked: Vec::new(),
            look_at: 0,
        }
    }
}

/// The shared part of a completion queue.
///
/// Lock order (see [`crate::sync`]): this queue's lock ranks before every endpoint's.
/// Whatever takes it (polling, waiting, reaping for slots, flushing) must hold no endpoint
/// lock; draining calls into endpoints, which take their own locks under it.
pub(crate) struct CqInner<Q = HwCq, E = EpCore> {
    pub hw: Q,
    pub capacity: usize,
    /// Slots promised to application requests plus completions not yet polled.
    reserved: AtomicUsize,
    /// Slots of the provider's own requests (credit updates, delivery reads, split reads).
    pub internal_cap: usize,
    internal: AtomicUsize,
    st: Ranked<CqState<E>>,
    /// Wakes waiters when the provider itself queues completions (flushes of requests that
    /// never reached the device).
    wake: EventFd,
    /// The application's notification descriptor: readable while the completion channel
    /// or `wake` is (see `VerbsCq`'s `arm`).
    notify: ffi::Epoll,
    /// Targets that wait for something no device completion announces (an iWARP send
    /// whose delivery the peer confirms by a count written into memory, `EpCore::settle`),
    /// looked at after every drain while any is listed. A leaf lock (see [`crate::sync`]):
    /// pushed under an endpoint's lock, and nothing is locked under it.
    watched: Mutex<Vec<Weak<E>>>,
    /// Targets in `watched`: a drain with none takes no lock for them.
    watching: AtomicUsize,
}

impl<Q, E> fmt::Debug for CqInner<Q, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqInner")
            .field("capacity", &self.capacity)
            .field("reserved", &self.reserved.load(Ordering::Relaxed))
            .field("internal", &self.internal.load(Ordering::Relaxed))
            .finish()
    }
}

impl<Q: DeviceQueue, E: CompletionTarget<Q>> CqInner<Q, E> {
    pub fn new(hw: Q, capacity: usize, internal_cap: usize) -> Result<Self> {
        let wake = EventFd::new()?;
        let fds: Vec<_> = [Some(wake.fd()), hw.channel_fd()]
            .into_iter()
            .flatten()
            .collect();
        let notify = ffi::Epoll::new(&fds)?;
        Ok(CqInner {
            hw,
            capacity,
            reserved: AtomicUsize::new(0),
            internal_cap,
            internal: AtomicUsize::new(0),
            st: Ranked::new(Rank::Cq, CqState::default()),
            wake,
            notify,
            watched: Mutex::new(Vec::new()),
            watching: AtomicUsize::new(0),
        })
    }

    /// Has every drain (under the queue's lock) call `target`'s
    /// [`settle`](CompletionTarget::settle) until it says to stop. Takes only the leaf
    /// lock of the list: callable with an endpoint lock held. The caller registers a
    /// target once until `settle` let it go.
    pub fn watch(&self, target: Weak<E>) {
        let mut w = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        w.push(target);
        self.watching.store(w.len(), Ordering::Release);
    }

    /// Whether any target is watched.
    pub fn watching(&self) -> bool {
        self.watching.load(Ordering::Acquire) > 0
    }

    /// Calls the watched targets' `settle` (queue lock held), dropping those that are done.
    fn settle_watched(&self, st: &mut CqState<E>) {
        let mut list = std::mem::take(&mut *self.watched.lock().unwrap_or_else(|e| e.into_inner()));
        // No list lock is held while the targets run (they take their own locks).
        list.retain(|w| w.upgrade().is_some_and(|t| t.settle(self, st)));
        let mut w = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        w.append(&mut list);
        self.watching.store(w.len(), Ordering::Release);
    }

    /// Takes the queue's lock. Never with an endpoint lock held (checked in debug builds).
    pub fn lock(&self) -> RankedGuard<'_, CqState<E>> {
        self.st.lock()
    }

    fn try_reserve(counter: &AtomicUsize, cap: usize, n: usize) -> bool {
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                (r + n <= cap).then_some(r + n)
            })
            .is_ok()
    }

    /// Reserves one application slot and `internal` provider slots; reaps the device
    /// queue once if they are short. Takes the queue's lock to reap: never call it with
    /// an endpoint lock held.
    pub fn reserve(&self, internal: usize) -> Result<()> {
        for attempt in 0..2 {
            if Self::try_reserve(&self.reserved, self.capacity, 1) {
                if internal == 0 || Self::try_reserve(&self.internal, self.internal_cap, internal) {
                    return Ok(());
                }
                self.reserved.fetch_sub(1, Ordering::AcqRel);
            }
            if attempt == 0 {
                self.reap();
            }
        }
        Err(Error::new(
            ErrorKind::QueueFull,
            format!(
                "completion queue of {} entries would overrun: poll it before posting more",
                self.capacity
            ),
        ))
    }

    /// Reserves `n` provider slots (no application slot) if they are free now. Takes no
    /// lock: callable with an endpoint lock held.
    pub fn reserve_internal(&self, n: usize) -> bool {
        Self::try_reserve(&self.internal, self.internal_cap, n)
    }

    /// Reserves `n` provider slots, reaping the device queue once if they are short.
    /// Takes the queue's lock to reap: never call it with an endpoint lock held (an
    /// endpoint that must, drops its lock first: see `EpCore::retry_blocked`).
    pub fn reserve_internal_reaping(&self, n: usize) -> bool {
        if self.reserve_internal(n) {
            return true;
        }
        self.reap();
        self.reserve_internal(n)
    }

    /// Moves what the device completed into the ready queue, giving back the slots of
    /// the provider's own requests among them. Takes the queue's lock, then endpoint
    /// locks: never call it with an endpoint lock held.
    /// Out of line: a post reaps only when the queue looks full, and the drain inlined
    /// here would weigh on every post's frame.
    #[inline(never)]
    pub fn reap(&self) {
        let mut st = self.lock();
        self.drain(&mut st);
    }

    /// Provider slots in use.
    #[cfg(all(test, loom))]
    pub fn internal_in_use(&self) -> usize {
        self.internal.load(Ordering::Acquire)
    }

    /// Application slots in use.
    #[cfg(all(test, loom))]
    pub fn reserved_in_use(&self) -> usize {
        self.reserved.load(Ordering::Acquire)
    }

    /// Gives back application slots.
    pub fn release(&self, n: usize) {
        if n > 0 {
            self.reserved.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Gives back provider slots.
    pub fn release_internal(&self, n: usize) {
        if n > 0 {
            self.internal.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Tells waiters that the provider queued completions itself.
    pub fn notify(&self) {
        self.wake.signal();
    }

    /// Polls: drains the device queue, moves up to `max` ready completions to `out` and
    /// gives their slots back. Returns how many. Takes the queue's lock.
    #[inline(always)]
    pub fn poll_ready(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut st = self.lock();
        self.drain(&mut st);
        let due = if st.looked.is_empty() {
            None
        } else {
            Self::look_next(&mut st)
        };
        let n = st.ready.len().min(max);
        if n == 0 {
            // An empty poll (a spinning caller's usual one): nothing to trade or give back.
            drop(st);
            if let Some(t) = due {
                t.serve();
            }
            return 0;
        }
        if n == st.ready.len() && out.is_empty() && out.capacity() >= READY_KEEP {
            // The common case (a caller that empties its vector between polls and takes
            // everything): the two vectors trade places, no copy. The queue keeps the
            // caller's (empty) buffer, large enough not to grow at the next completion.
            std::mem::swap(out, &mut st.ready);
        } else if n == st.ready.len() {
            out.append(&mut st.ready);
        } else {
            out.extend(st.ready.drain(..n));
        }
        drop(st);
        self.release(n);
        if let Some(t) = due {
            t.serve();
        }
        n
    }

    /// Looks at the next area of [`CqState::looked`]: its target to serve, if the look
    /// found work. No counted reference is taken unless it did. Inlined, and the turn
    /// wraps by a compare rather than a division: on iWARP every poll looks, the empty
    /// ones too.
    #[inline(always)]
    fn look_next(st: &mut CqState<E>) -> Option<Arc<E>> {
        let i = if st.look_at < st.looked.len() {
            st.look_at
        } else {
            0
        };
        st.look_at = i + 1;
        let (watch, target) = &st.looked[i];
        if target.strong_count() == 0 {
            st.looked.swap_remove(i);
            return None;
        }
        if watch.look() {
            target.upgrade()
        } else {
            None
        }
    }

    /// Moves everything the device completed into the ready queue (routing each
    /// completion to its endpoint's ledger). Called with the queue's lock held (`st`).
    /// Inlined, the device's queue polled in place and the routing apart: a spinning
    /// application's polls mostly find the device's queue empty, and then make no call
    /// of ours (in the guest a call and its return cost as much as twenty plain
    /// instructions: docs/benchmarks-record.md, thirty-second session).
    #[inline(always)]
    pub fn drain(&self, st: &mut CqState<E>) {
        let n = self.poll_device(st);
        if n > 0 {
            self.route(st, n);
        }
        if self.watching() {
            self.settle_watched(st);
        }
    }

    /// Polls the device's queue into `st.scratch`; returns how many it filled (none if
    /// the poll failed, which is logged).
    #[inline(always)]
    fn poll_device(&self, st: &mut CqState<E>) -> usize {
        match self.hw.poll(&mut st.scratch) {
            Ok(n) => n,
            Err(e) => {
                Self::poll_failed(&e);
                0
            }
        }
    }

    #[cold]
    #[inline(never)]
    fn poll_failed(e: &std::io::Error) {
        tracing::error!("polling the device completion queue failed: {e}");
    }

    /// Routes the `n` completions in `st.scratch` to their endpoints, and polls again
    /// while the device fills whole batches.
    #[inline(never)]
    fn route(&self, st: &mut CqState<E>, mut n: usize) {
        loop {
            for i in 0..n {
                // One look-up: the common path on the borrowed endpoint, and only what it
                // declines pays for a counted reference (the general path needs the
                // queue's whole state, the map included) and a copy of the completion.
                let CqState {
                    qps,
                    ready,
                    scratch,
                    ..
                } = &mut *st;
                let wc = &scratch[i];
                let general = match qps.get(&wc.qp_num) {
                    Some(ep) if ep.complete_common(self, ready, wc) => continue,
                    found => found.cloned(),
                };
                let wc = *wc;
                match general {
                    Some(ep) => ep.on_completion(self, st, &wc),
                    None if crate::ep::is_early(wc.wr_id) && st.orphans.len() < ORPHANS => {
                        st.orphans.push(wc)
                    }
                    None => tracing::debug!(
                        qp = wc.qp_num,
                        "completion of a destroyed queue pair dropped"
                    ),
                }
            }
            if n < DRAIN_BATCH {
                break;
            }
            n = self.poll_device(st);
            if n == 0 {
                break;
            }
        }
    }
}

/// A completion queue of a verbs provider.
pub struct VerbsCq<F: Flavor> {
    pub(crate) inner: Arc<CqInner>,
    _f: PhantomData<fn() -> F>,
}

impl<F: Flavor> Clone for VerbsCq<F> {
    fn clone(&self) -> Self {
        VerbsCq {
            inner: self.inner.clone(),
            _f: PhantomData,
        }
    }
}

impl<F: Flavor> fmt::Debug for VerbsCq<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsCq")
            .field("provider", &F::NAME)
            .field("inner", &self.inner)
            .finish()
    }
}

impl<F: Flavor> VerbsCq<F> {
    pub(crate) fn new(inner: CqInner) -> Self {
        VerbsCq {
            inner: Arc::new(inner),
            _f: PhantomData,
        }
    }
}

impl<F: Flavor> CompletionQueue for VerbsCq<F> {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        Ok(self.inner.poll_ready(out, max))
    }

    fn wait(&self, timeout: Duration) -> Result<bool> {
        let c = &self.inner;
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut st = c.lock();
                c.drain(&mut st);
                if !st.ready.is_empty() {
                    return Ok(true);
                }
                c.hw.arm()?;
                // A completion that arrived before arming raised no event: look again.
                c.drain(&mut st);
                if !st.ready.is_empty() {
                    return Ok(true);
                }
                // Nothing queued by the provider is pending: forget old wake-ups.
                c.wake.clear();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            let nap = if c.watching() {
                left.min(WATCH_NAP)
            } else {
                left
            };
            let ready = ffi::poll_fds(&[c.hw.fd(), c.wake.fd()], Some(nap))?;
            if ready[0] {
                while c.hw.take_event() {}
            }
        }
    }

    fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Arms the device queue (`ibv_req_notify_cq`) after consuming the completion
    /// channel's old events and forgetting old wake-ups of the provider's own completions,
    /// all under the queue's lock: a completion the device makes after arming raises a
    /// channel event, one the provider queues (a flush) signals `wake` after queueing it
    /// under that lock, and one already there is found by the drains around arming.
    fn arm(&self) -> Result<bool> {
        let c = &self.inner;
        let mut st = c.lock();
        c.drain(&mut st);
        if !st.ready.is_empty() {
            return Ok(false);
        }
        while c.hw.take_event() {}
        c.wake.clear();
        c.hw.arm()?;
        // A completion that arrived before arming raised no event: look again.
        c.drain(&mut st);
        Ok(st.ready.is_empty())
    }
}

/// An `epoll` descriptor readable while the completion channel or the provider's own
/// wake-up is: see [`VerbsCq::arm`](CompletionQueue::arm).
impl<F: Flavor> AsFd for VerbsCq<F> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.notify.as_fd()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use fabric_api::{Opcode, Status};
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn qp_map_finds_every_endpoint_few_or_many_through_inserts_and_removals() {
        let mut m = QpMap::<u32>::default();
        let mut model = std::collections::HashMap::new();
        // Grows past the scanned vector, shrinks to nothing, grows again; replaces.
        let steps = (1..=9u32)
            .map(|q| (q, true))
            .chain((1..=9).map(|q| (q, false)))
            .chain([(5, true), (5, true), (6, true), (5, false), (7, true)]);
        for (i, (qpn, insert)) in steps.enumerate() {
            if insert {
                let ep = Arc::new(i as u32);
                assert_eq!(
                    m.insert(qpn, ep.clone()).map(|e| *e),
                    model.insert(qpn, ep).map(|e| *e)
                );
            } else {
                assert_eq!(m.remove(&qpn).map(|e| *e), model.remove(&qpn).map(|e| *e));
            }
            assert_eq!(m.len(), model.len());
            for q in 0..=10 {
                assert_eq!(m.get(&q).map(|e| **e), model.get(&q).map(|e| **e), "qp {q}");
            }
        }
    }

    /// A device queue holding what a test put in it.
    #[derive(Default)]
    struct FakeDevice(Mutex<VecDeque<Wc>>);

    impl DeviceQueue for FakeDevice {
        fn poll(&self, out: &mut [Wc]) -> std::io::Result<usize> {
            let mut q = self.0.lock().unwrap();
            let n = q.len().min(out.len());
            for (o, wc) in out.iter_mut().zip(q.drain(..n)) {
                *o = wc;
            }
            Ok(n)
        }
    }

    /// Puts completions of queue pair `qp` with request ids `ids` in the device queue,
    /// each with its application slot reserved (as a posted request has).
    fn complete<E: CompletionTarget<FakeDevice>>(
        cq: &CqInner<FakeDevice, E>,
        qp: u32,
        ids: std::ops::Range<u64>,
    ) {
        for id in ids {
            cq.reserve(0).unwrap();
            cq.hw.0.lock().unwrap().push_back(Wc {
                wr_id: id,
                qp_num: qp,
                ..Wc::default()
            });
        }
    }

    /// An endpoint that reports every completion of its queue pair as a receive whose
    /// context is the request's id.
    struct Echo;

    impl CompletionTarget<FakeDevice> for Echo {
        fn on_completion(
            self: &Arc<Self>,
            _cq: &CqInner<FakeDevice, Self>,
            st: &mut CqState<Self>,
            wc: &Wc,
        ) {
            st.ready.push(reported(wc, Opcode::Recv));
        }
    }

    /// An endpoint whose common path takes even request ids and declines odd ones, which
    /// the general path then reports (as receives) and counts.
    #[derive(Default)]
    struct Split {
        general: AtomicUsize,
    }

    fn reported(wc: &Wc, opcode: Opcode) -> Completion {
        Completion {
            context: wc.wr_id,
            opcode,
            status: Status::Success,
            provider_code: None,
            byte_len: 0,
            imm: None,
            ep_context: 0,
        }
    }

    impl CompletionTarget<FakeDevice> for Split {
        fn on_completion(
            self: &Arc<Self>,
            _cq: &CqInner<FakeDevice, Self>,
            st: &mut CqState<Self>,
            wc: &Wc,
        ) {
            self.general.fetch_add(1, Ordering::Relaxed);
            st.ready.push(reported(wc, Opcode::Recv));
        }

        fn complete_common(
            &self,
            _cq: &CqInner<FakeDevice, Self>,
            ready: &mut Vec<Completion>,
            wc: &Wc,
        ) -> bool {
            if wc.wr_id % 2 == 1 {
                return false;
            }
            ready.push(reported(wc, Opcode::Send));
            true
        }
    }

    #[test]
    fn the_common_path_takes_what_it_can_and_hands_the_rest_on_in_order() {
        const QP: u32 = 3;
        let cq = CqInner::<FakeDevice, Split>::new(FakeDevice::default(), 64, 0).unwrap();
        let ep = Arc::new(Split::default());
        cq.lock().qps.insert(QP, ep.clone());
        let total = DRAIN_BATCH as u64 + 5;
        complete(&cq, QP, 0..total);
        let mut out = Vec::new();
        assert_eq!(cq.poll_ready(&mut out, 64), total as usize);
        let seen: Vec<(u64, Opcode)> = out.iter().map(|c| (c.context, c.opcode)).collect();
        let want: Vec<(u64, Opcode)> = (0..total)
            .map(|id| {
                (
                    id,
                    if id % 2 == 0 {
                        Opcode::Send
                    } else {
                        Opcode::Recv
                    },
                )
            })
            .collect();
        assert_eq!(seen, want);
        assert_eq!(ep.general.load(Ordering::Relaxed), (total / 2) as usize);
        // Only the map and this test hold the endpoint: the drain kept no reference.
        assert_eq!(Arc::strong_count(&ep), 2);
    }

    #[test]
    fn polls_take_completions_in_order_across_batches_and_partial_takes() {
        const QP: u32 = 7;
        let cq = CqInner::<FakeDevice, Echo>::new(FakeDevice::default(), 64, 0).unwrap();
        cq.lock().qps.insert(QP, Arc::new(Echo));
        // More than one device batch, each with its application slot.
        let total = DRAIN_BATCH as u64 + 8;
        complete(&cq, QP, 0..total);
        // What the caller already holds stays in front; a short take leaves the rest
        // queued, in order.
        let mut out = vec![Completion::flushed(999, Opcode::Send)];
        assert_eq!(cq.poll_ready(&mut out, 5), 5);
        assert_eq!(out[0].context, 999);
        let ids: Vec<u64> = out[1..].iter().map(|c| c.context).collect();
        assert_eq!(ids, (0..5).collect::<Vec<_>>());
        assert_eq!(cq.reserved.load(Ordering::Acquire), total as usize - 5);
        // The next poll takes everything left, still in order, and gives every slot back.
        out.clear();
        assert_eq!(cq.poll_ready(&mut out, 100), total as usize - 5);
        let ids: Vec<u64> = out.iter().map(|c| c.context).collect();
        assert_eq!(ids, (5..total).collect::<Vec<_>>());
        assert_eq!(cq.reserved.load(Ordering::Acquire), 0);
        assert_eq!(cq.poll_ready(&mut out, 100), 0);
    }

    #[test]
    fn a_poll_into_an_empty_vector_trades_buffers_and_the_queue_keeps_room() {
        const QP: u32 = 3;
        let cq = CqInner::<FakeDevice, Echo>::new(FakeDevice::default(), 256, 0).unwrap();
        cq.lock().qps.insert(QP, Arc::new(Echo));
        let push = |ids: std::ops::Range<u64>| complete(&cq, QP, ids);
        let mut next = 0;
        // Callers' vectors: empty with room (traded), empty without (appended to), and
        // one that holds a completion already (appended to, kept in front); each poll
        // takes everything in order and gives every slot back, and the queue's own
        // buffer never falls below what a trade needs.
        for (cap, held) in [(64, false), (1, false), (64, true), (READY_KEEP, false)] {
            for round in 0..3u64 {
                let n = 1 + round * 20;
                push(next..next + n);
                let mut out = Vec::with_capacity(cap);
                if held {
                    out.push(Completion::flushed(999, Opcode::Send));
                }
                assert_eq!(cq.poll_ready(&mut out, 1000), n as usize);
                let ids: Vec<u64> = out.iter().map(|c| c.context).collect();
                let mut want: Vec<u64> = if held { vec![999] } else { Vec::new() };
                want.extend(next..next + n);
                assert_eq!(ids, want, "caller capacity {cap}, round {round}");
                assert_eq!(cq.reserved.load(Ordering::Acquire), 0);
                assert!(cq.lock().ready.is_empty());
                assert!(cq.lock().ready.capacity() >= READY_KEEP);
                next += n;
            }
        }
    }

    /// A target that serves by reaping its queue (which takes the queue's lock), and
    /// counts its serves.
    #[derive(Default)]
    struct Watched {
        serves: AtomicUsize,
        cq: std::sync::OnceLock<Weak<CqInner<FakeDevice, Watched>>>,
    }

    impl CompletionTarget<FakeDevice> for Watched {
        fn on_completion(
            self: &Arc<Self>,
            _cq: &CqInner<FakeDevice, Self>,
            _st: &mut CqState<Self>,
            _wc: &Wc,
        ) {
        }

        fn serve(self: &Arc<Self>) {
            // The queue's lock is free again (taking it under itself would deadlock, or
            // trip the lock-order check of debug builds).
            self.cq.get().and_then(Weak::upgrade).unwrap().reap();
            self.serves.fetch_add(1, Ordering::AcqRel);
        }
    }

    #[test]
    fn polls_look_at_one_area_each_in_turn_and_serve_outside_the_lock() {
        use crate::emu::{EmuWatch, REPLY_OFF, REQ_OFF};
        let cq =
            Arc::new(CqInner::<FakeDevice, Watched>::new(FakeDevice::default(), 8, 0).unwrap());
        let target = || {
            let t = Arc::new(Watched::default());
            t.cq.set(Arc::downgrade(&cq)).ok().unwrap();
            let area = Arc::new(fabric_api::Buffer::new(4096));
            let w = Arc::new(EmuWatch::new(area.clone()));
            cq.lock().looked.push((w.clone(), Arc::downgrade(&t)));
            (t, (w, area))
        };
        let ((busy, (bw, ba)), (idle, (iw, ia))) = (target(), target());
        let seq = |a: &fabric_api::Buffer, off: usize, v: u64| {
            a.atomic_u64(off)
                .unwrap()
                .store(v.to_le(), Ordering::Release)
        };
        // A request of the peer waits in the first area (the next after the one served).
        seq(&ba, REQ_OFF, 1);
        let mut out = Vec::new();
        let looked = |w: &EmuWatch| w.looked.swap(false, Ordering::AcqRel);
        assert_eq!(cq.poll_ready(&mut out, 8), 0);
        assert!(looked(&bw) && !looked(&iw), "one area per poll");
        assert_eq!(cq.poll_ready(&mut out, 8), 0);
        assert!(!looked(&bw) && looked(&iw), "the next in turn");
        let count = |t: &Watched| t.serves.load(Ordering::Acquire);
        assert_eq!((count(&busy), count(&idle)), (1, 0));
        // Served: nothing waits there any more. A reply to the second one's atomic does.
        bw.served.store(1, Ordering::Release);
        iw.wait.store(3, Ordering::Release);
        seq(&ia, REPLY_OFF, 2);
        for _ in 0..2 {
            cq.poll_ready(&mut out, 8);
        }
        assert_eq!((count(&busy), count(&idle)), (1, 0), "a stale reply");
        seq(&ia, REPLY_OFF, 3);
        for _ in 0..2 {
            cq.poll_ready(&mut out, 8);
        }
        assert_eq!((count(&busy), count(&idle)), (1, 1));
        // A target that is gone leaves the list at its turn; the rest is looked at on.
        drop(idle);
        for _ in 0..2 {
            cq.poll_ready(&mut out, 8);
        }
        assert_eq!(cq.lock().looked.len(), 1);
        assert!(looked(&bw));
    }
}
