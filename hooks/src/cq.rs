//! The hooked completion queue: maps tokens back to contexts, applies completion faults,
//! and traces what it delivers.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fabric_api::sync::Mutex;
use std::time::{Duration, Instant};

use fabric_api::spi::CompletionQueue;
use fabric_api::{Completion, ErrorKind, Result, Status};

use crate::endpoint::EpCore;
use crate::fault::{Armed, Counters, Rng};
use crate::{Shared, TARGET};

/// The operations in flight towards one completion queue, under the wrapper's tokens.
#[derive(Debug)]
pub(crate) struct Ledger {
    ops: Mutex<HashMap<u64, Record>>,
    next: AtomicU64,
}

#[derive(Debug)]
struct Record {
    context: u64,
    ep: Arc<EpCore>,
}

impl Ledger {
    fn new() -> Self {
        Ledger {
            ops: Mutex::new(HashMap::new()),
            // A random base keeps tokens away from the small contexts applications use, which
            // unsignaled sends keep (see the crate docs).
            next: AtomicU64::new(crate::random_u64()),
        }
    }

    /// Records an operation of `ep` posted with `context`; returns the token to post it under.
    pub(crate) fn insert(&self, context: u64, ep: Arc<EpCore>) -> u64 {
        let mut ops = self.ops.lock().expect("ledger poisoned");
        let mut token = self.next.fetch_add(1, Ordering::Relaxed);
        while ops.contains_key(&token) {
            token = self.next.fetch_add(1, Ordering::Relaxed);
        }
        ops.insert(token, Record { context, ep });
        token
    }

    /// Forgets a token (its post failed, or its completion arrived).
    pub(crate) fn take(&self, token: u64) -> Option<(u64, Arc<EpCore>)> {
        let mut ops = self.ops.lock().expect("ledger poisoned");
        ops.remove(&token).map(|r| (r.context, r.ep))
    }
}

struct Staged {
    ready: Instant,
    c: Completion,
    ep: Option<Arc<EpCore>>,
}

struct State {
    staged: VecDeque<Staged>,
    rng: Rng,
    delay: Option<(Armed, Duration)>,
    drop: Option<(Armed, ErrorKind)>,
}

struct CqShared<C> {
    inner: C,
    id: u64,
    ledger: Arc<Ledger>,
    dom: Arc<Shared>,
    /// Lock order: this, then the provider's queue, then the ledger; never the reverse.
    state: Mutex<State>,
}

/// A completion queue of any provider, hooked. Cloning shares the queue.
pub struct HookCq<C> {
    shared: Arc<CqShared<C>>,
}

impl<C> Clone for HookCq<C> {
    fn clone(&self) -> Self {
        HookCq {
            shared: self.shared.clone(),
        }
    }
}

impl<C: fmt::Debug> fmt::Debug for HookCq<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookCq")
            .field("id", &self.shared.id)
            .field("inner", &self.shared.inner)
            .finish()
    }
}

impl<C: CompletionQueue> HookCq<C> {
    pub(crate) fn new(inner: C, dom: Arc<Shared>) -> Self {
        let id = dom.next_cq.fetch_add(1, Ordering::Relaxed) + 1;
        let fault = dom.fault.as_ref();
        let state = State {
            staged: VecDeque::new(),
            // Streams of queues are apart from those of endpoints (odd and even).
            rng: Rng::new(dom.seed, id * 2 + 1),
            delay: fault
                .and_then(|f| f.delay)
                .map(|d| (Armed::new(d.trigger), d.delay)),
            drop: fault
                .and_then(|f| f.drop)
                .map(|d| (Armed::new(d.trigger), d.status)),
        };
        HookCq {
            shared: Arc::new(CqShared {
                inner,
                id,
                ledger: Arc::new(Ledger::new()),
                dom,
                state: Mutex::new(state),
            }),
        }
    }

    /// The provider's queue underneath.
    pub fn inner(&self) -> &C {
        &self.shared.inner
    }

    pub(crate) fn ledger(&self) -> &Arc<Ledger> {
        &self.shared.ledger
    }

    /// Moves what the provider has (as much as fits) into the staging queue, restoring
    /// contexts and deciding the completion faults. Endpoints to cut are returned, to be
    /// cut once the state lock is released.
    fn pull(&self, st: &mut State, cuts: &mut Vec<Arc<EpCore>>) -> Result<()> {
        let s = &*self.shared;
        let room = s.inner.capacity().saturating_sub(st.staged.len());
        if room == 0 {
            return Ok(());
        }
        let mut got = Vec::new();
        s.inner.poll(&mut got, room)?;
        let now = Instant::now();
        for mut c in got {
            let ep = match s.ledger.take(c.context) {
                Some((context, ep)) => {
                    c.context = context;
                    Some(ep)
                }
                None => None,
            };
            if let (Some(ep), Status::Success) = (&ep, c.status) {
                if ep.dropped() {
                    c.status = Status::Error(ErrorKind::Flushed);
                    Counters::bump(&s.dom.stats.completions_flushed);
                } else if let Some((armed, status)) = &mut st.drop {
                    if armed.fires(&mut st.rng) {
                        c.status = Status::Error(*status);
                        c.provider_code = None;
                        Counters::bump(&s.dom.stats.completions_dropped);
                        tracing::warn!(target: TARGET, parent: &ep.span, ep = ep.id, cq = s.id,
                            context = c.context, opcode = ?c.opcode, status = %c.status,
                            "injected fault: completion dropped (fault.drop); the endpoint enters the error state");
                        if ep.fail_by_drop() {
                            cuts.push(ep.clone());
                        }
                    }
                }
            }
            let mut ready = now;
            if let Some((armed, delay)) = &mut st.delay {
                if armed.fires(&mut st.rng) {
                    ready = now + *delay;
                    Counters::bump(&s.dom.stats.completions_delayed);
                    tracing::debug!(target: TARGET, cq = s.id, context = c.context, opcode = ?c.opcode,
                        delay = ?delay, "injected fault: completion delayed (fault.delay)");
                }
            }
            st.staged.push_back(Staged { ready, c, ep });
        }
        Ok(())
    }

    fn finish(&self, cuts: Vec<Arc<EpCore>>) {
        for ep in cuts {
            ep.close_inner();
        }
    }
}

impl<C: CompletionQueue> CompletionQueue for HookCq<C> {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut cuts = Vec::new();
        let mut st = self.shared.state.lock().expect("hooked cq poisoned");
        let pulled = self.pull(&mut st, &mut cuts);
        let now = Instant::now();
        let mut n = 0;
        while n < max && st.staged.front().is_some_and(|f| f.ready <= now) {
            let Staged { c, ep, .. } = st.staged.pop_front().expect("front checked");
            if self.shared.dom.trace {
                let span = ep
                    .as_ref()
                    .map(|e| e.span.clone())
                    .unwrap_or_else(tracing::Span::none);
                tracing::trace!(target: TARGET, parent: &span, ep = ep.as_ref().map(|e| e.id),
                    cq = self.shared.id, context = c.context, opcode = ?c.opcode, status = %c.status,
                    provider_code = c.provider_code.map(tracing::field::display),
                    byte_len = c.byte_len, imm = c.imm, "completion");
            }
            out.push(c);
            n += 1;
        }
        drop(st);
        self.finish(cuts);
        // A provider error after some completions were staged still reports them first.
        match pulled {
            Err(e) if n == 0 => Err(e),
            _ => Ok(n),
        }
    }

    fn wait(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut cuts = Vec::new();
            let mut st = self.shared.state.lock().expect("hooked cq poisoned");
            let pulled = self.pull(&mut st, &mut cuts);
            let now = Instant::now();
            let head = st.staged.front().map(|f| f.ready);
            drop(st);
            self.finish(cuts);
            pulled?;
            match head {
                Some(ready) if ready <= now => return Ok(true),
                _ if now >= deadline => return Ok(false),
                // Held back: nothing behind it can be delivered earlier.
                Some(ready) => std::thread::sleep(ready.min(deadline) - now),
                None => {
                    if !self.shared.inner.wait(deadline - now)? {
                        return Ok(false);
                    }
                }
            }
        }
    }

    fn capacity(&self) -> usize {
        self.shared.inner.capacity()
    }

    /// Arms the provider's queue, unless completions are staged here already (`false`,
    /// including one held back by `fault.delay`: nothing would make the descriptor
    /// readable when its delay ends, so the caller polls again, as it would spin in
    /// `poll`) or in the provider's queue.
    fn arm(&self) -> Result<bool> {
        let mut cuts = Vec::new();
        let mut st = self.shared.state.lock().expect("hooked cq poisoned");
        let pulled = self.pull(&mut st, &mut cuts);
        // Lock order: this queue's state, then the provider's queue.
        let armed = match pulled {
            Ok(()) if st.staged.is_empty() => self.shared.inner.arm(),
            Ok(()) => Ok(false),
            Err(e) => Err(e),
        };
        drop(st);
        self.finish(cuts);
        armed
    }
}

/// The provider queue's descriptor: completions reach this queue only through it.
impl<C: CompletionQueue> AsFd for HookCq<C> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.inner.as_fd()
    }
}
