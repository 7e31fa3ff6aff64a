//! Completion queues: the device queue with its completion channel, a software queue of
//! completions ready for the application, and the reservations that make overrun
//! impossible (see the crate docs).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fabric_api::spi::CompletionQueue;
use fabric_api::{Completion, Error, ErrorKind, Result};

use crate::ep::EpCore;
use crate::ffi::{self, EventFd, HwCq, Wc};
use crate::Flavor;

/// State behind the queue's lock.
#[derive(Debug, Default)]
pub(crate) struct CqState {
    /// Completions for the application, in order.
    pub ready: VecDeque<Completion>,
    /// Endpoints whose queue pairs report into this queue, by QP number.
    pub qps: HashMap<u32, Arc<EpCore>>,
}

/// The shared part of a completion queue.
pub(crate) struct CqInner {
    pub hw: HwCq,
    pub capacity: usize,
    /// Slots promised to application requests plus completions not yet polled.
    reserved: AtomicUsize,
    /// Slots of the provider's own requests (credit updates, delivery reads, split reads).
    pub internal_cap: usize,
    internal: AtomicUsize,
    st: Mutex<CqState>,
    /// Wakes waiters when the provider itself queues completions (flushes of requests that
    /// never reached the device).
    wake: EventFd,
}

impl fmt::Debug for CqInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqInner")
            .field("capacity", &self.capacity)
            .field("reserved", &self.reserved.load(Ordering::Relaxed))
            .field("internal", &self.internal.load(Ordering::Relaxed))
            .finish()
    }
}

impl CqInner {
    pub fn new(hw: HwCq, capacity: usize, internal_cap: usize) -> Result<Self> {
        Ok(CqInner {
            hw,
            capacity,
            reserved: AtomicUsize::new(0),
            internal_cap,
            internal: AtomicUsize::new(0),
            st: Mutex::new(CqState::default()),
            wake: EventFd::new()?,
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, CqState> {
        self.st.lock().expect("completion queue poisoned")
    }

    fn try_reserve(counter: &AtomicUsize, cap: usize, n: usize) -> bool {
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                (r + n <= cap).then_some(r + n)
            })
            .is_ok()
    }

    /// Reserves one application slot and `internal` provider slots; reaps the device
    /// queue once if they are short. Never called with an endpoint lock held.
    pub fn reserve(&self, internal: usize) -> Result<()> {
        for attempt in 0..2 {
            if Self::try_reserve(&self.reserved, self.capacity, 1) {
                if internal == 0 || Self::try_reserve(&self.internal, self.internal_cap, internal) {
                    return Ok(());
                }
                self.reserved.fetch_sub(1, Ordering::AcqRel);
            }
            if attempt == 0 {
                let mut st = self.lock();
                self.drain(&mut st);
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

    /// Reserves `n` provider slots (no application slot), reaping once if short.
    pub fn reserve_internal(&self, n: usize, reap: bool) -> bool {
        if Self::try_reserve(&self.internal, self.internal_cap, n) {
            return true;
        }
        if reap {
            let mut st = self.lock();
            self.drain(&mut st);
            drop(st);
            return Self::try_reserve(&self.internal, self.internal_cap, n);
        }
        false
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

    /// Moves everything the device completed into the ready queue (routing each
    /// completion to its endpoint's ledger).
    pub fn drain(&self, st: &mut CqState) {
        let mut wcs = [Wc {
            wr_id: 0,
            status: 0,
            opcode: 0,
            vendor_err: 0,
            byte_len: 0,
            imm: None,
            qp_num: 0,
        }; 32];
        loop {
            let n = match self.hw.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!("polling the device completion queue failed: {e}");
                    return;
                }
            };
            for wc in &wcs[..n] {
                match st.qps.get(&wc.qp_num).cloned() {
                    Some(ep) => ep.on_completion(self, st, wc),
                    None => tracing::debug!(
                        qp = wc.qp_num,
                        "completion of a destroyed queue pair dropped"
                    ),
                }
            }
            if n < wcs.len() {
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
        let c = &self.inner;
        let mut st = c.lock();
        c.drain(&mut st);
        let n = st.ready.len().min(max);
        out.extend(st.ready.drain(..n));
        drop(st);
        c.release(n);
        Ok(n)
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
            let ready = ffi::poll_fds(&[c.hw.fd(), c.wake.fd()], Some(left))?;
            if ready[0] {
                while c.hw.take_event() {}
            }
        }
    }

    fn capacity(&self) -> usize {
        self.inner.capacity
    }
}
