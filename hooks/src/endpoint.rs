//! The hooked endpoint: traces posts, applies post faults (fail, cut), and posts signaled
//! operations under tokens its completion queues map back.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};

use fabric_api::sync::Mutex;

use fabric_api::spi::Endpoint;
use fabric_api::{
    EndpointEvent, EndpointState, Error, ErrorKind, OpSet, RecvWr, Result, SendFlags, SendOp,
    SendWr, Slice,
};
use tracing::Span;

use crate::cq::Ledger;
use crate::fault::{Armed, Counters, Rng};
use crate::{Shared, TARGET};

const HEALTHY: u8 = 0;
const CUT: u8 = 1;
const DROPPED: u8 = 2;

/// Closes the provider's endpoint underneath (implemented by the generic part).
trait Cutter: Send + Sync {
    fn close_inner(&self) -> Result<()>;
}

/// The part of an endpoint its completion queues see (records hold it, not the provider's
/// endpoint, so dropping a [`HookEndpoint`] still drops and closes the provider's).
pub(crate) struct EpCore {
    pub(crate) id: u64,
    pub(crate) span: Span,
    fault: AtomicU8,
    cutter: Weak<dyn Cutter>,
    dom: Arc<Shared>,
}

impl fmt::Debug for EpCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EpCore")
            .field("id", &self.id)
            .field("fault", &self.fault.load(Ordering::Relaxed))
            .finish()
    }
}

impl EpCore {
    /// True once a dropped completion put the endpoint in the error state.
    pub(crate) fn dropped(&self) -> bool {
        self.fault.load(Ordering::Acquire) == DROPPED
    }

    /// Marks the endpoint failed by a dropped completion; true the first time (the caller
    /// then closes the connection, outside its locks).
    pub(crate) fn fail_by_drop(&self) -> bool {
        self.fault
            .compare_exchange(HEALTHY, DROPPED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Closes the provider's endpoint (the peer sees a disconnect; outstanding operations
    /// are flushed by the provider).
    pub(crate) fn close_inner(&self) {
        if let Some(c) = self.cutter.upgrade() {
            if let Err(e) = c.close_inner() {
                tracing::warn!(target: TARGET, parent: &self.span, ep = self.id, "closing the cut connection failed: {e}");
            }
        }
    }

    /// Cuts the connection; false when the endpoint had already failed.
    fn cut(&self, why: &str) -> bool {
        if self
            .fault
            .compare_exchange(HEALTHY, CUT, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        Counters::bump(&self.dom.stats.connections_cut);
        tracing::warn!(target: TARGET, parent: &self.span, ep = self.id, "injected fault: connection cut ({why})");
        self.close_inner();
        true
    }

    fn check(&self) -> Result<()> {
        match self.fault.load(Ordering::Acquire) {
            HEALTHY => Ok(()),
            CUT => Err(Error::new(
                ErrorKind::InvalidState,
                "endpoint is in the error state: its connection was cut (injected fault)",
            )),
            _ => Err(Error::new(
                ErrorKind::InvalidState,
                "endpoint is in the error state: a completion was dropped (injected fault)",
            )),
        }
    }
}

struct PostFaults {
    rng: Rng,
    fail: Option<(Armed, ErrorKind)>,
    cut: Option<Armed>,
}

struct EpShared<E> {
    inner: E,
    core: Arc<EpCore>,
    send: Arc<Ledger>,
    recv: Arc<Ledger>,
    faults: Mutex<PostFaults>,
}

impl<E: Endpoint> Cutter for EpShared<E> {
    fn close_inner(&self) -> Result<()> {
        self.inner.close()
    }
}

/// An endpoint of any provider, hooked.
pub struct HookEndpoint<E> {
    shared: Arc<EpShared<E>>,
}

impl<E: fmt::Debug> fmt::Debug for HookEndpoint<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookEndpoint")
            .field("id", &self.shared.core.id)
            .field("inner", &self.shared.inner)
            .finish()
    }
}

/// Shows a number in hexadecimal in trace fields.
struct Hex(u64);

impl fmt::Display for Hex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

fn total(sgl: &[Slice<'_>]) -> usize {
    sgl.iter().map(|s| s.len()).sum()
}

fn trace_send(wr: &SendWr<'_>) {
    let (len, sge, remote, imm, add, compare, swap) = match wr.op {
        SendOp::Send { sgl, imm } => (total(sgl), sgl.len(), None, imm, None, None, None),
        SendOp::Write { sgl, remote, imm } => {
            (total(sgl), sgl.len(), Some(remote), imm, None, None, None)
        }
        SendOp::Read { sgl, remote } => {
            (total(sgl), sgl.len(), Some(remote), None, None, None, None)
        }
        SendOp::Atomic { result, remote, op } => {
            let (a, c, s) = match op {
                fabric_api::AtomicOp::FetchAdd { add } => (Some(add), None, None),
                fabric_api::AtomicOp::CompareSwap { compare, swap } => {
                    (None, Some(compare), Some(swap))
                }
            };
            (result.len(), 1, Some(remote), None, a, c, s)
        }
    };
    tracing::trace!(target: TARGET, opcode = ?wr.opcode(), context = wr.context, len, sge,
        remote_addr = remote.map(|r| tracing::field::display(Hex(r.addr))),
        remote_key = remote.map(|r| tracing::field::display(Hex(r.key.into()))),
        imm, add, compare, swap, flags = ?wr.flags, "post_send");
}

impl<E: Endpoint + 'static> HookEndpoint<E> {
    pub(crate) fn new(
        inner: E,
        dom: Arc<Shared>,
        send: Arc<Ledger>,
        recv: Arc<Ledger>,
        how: &'static str,
    ) -> Self {
        let id = dom.next_ep.fetch_add(1, Ordering::Relaxed) + 1;
        let span = if dom.trace {
            tracing::debug_span!(target: TARGET, "fabric_ep", ep = id, provider = %dom.provider,
                local = %inner.local_addr(), peer = %inner.peer_addr())
        } else {
            Span::none()
        };
        let fault = dom.fault.as_ref();
        let faults = PostFaults {
            rng: Rng::new(dom.seed, id * 2),
            fail: fault
                .and_then(|f| f.fail_post)
                .map(|f| (Armed::new(f.trigger), f.kind)),
            cut: fault.and_then(|f| f.cut).map(|c| Armed::new(c.trigger)),
        };
        if dom.trace {
            tracing::debug!(target: TARGET, parent: &span, ep = id,
                private_data_len = inner.peer_private_data().len(), ops = ?inner.ops(), "{how}");
        }
        let shared = Arc::new_cyclic(|weak: &Weak<EpShared<E>>| {
            let cutter: Weak<dyn Cutter> = weak.clone();
            EpShared {
                inner,
                core: Arc::new(EpCore {
                    id,
                    span,
                    fault: AtomicU8::new(HEALTHY),
                    cutter,
                    dom,
                }),
                send,
                recv,
                faults: Mutex::new(faults),
            }
        });
        HookEndpoint { shared }
    }

    /// The provider's endpoint underneath.
    pub fn inner(&self) -> &E {
        &self.shared.inner
    }

    /// This endpoint's number within its domain (as in its tracing span, `ep`).
    pub fn id(&self) -> u64 {
        self.shared.core.id
    }

    /// Cuts the connection now, as the `cut` fault does: the peer sees a disconnect, this
    /// endpoint enters the error state and its outstanding operations are flushed. False
    /// when the endpoint had already failed through a fault.
    pub fn cut_connection(&self) -> bool {
        self.shared.core.cut("requested by the application")
    }

    /// Decides the post faults for one post: `Err` refuses it; `Ok(true)` cuts after it.
    fn decide(&self, what: &str) -> Result<bool> {
        let core = &self.shared.core;
        let mut f = self.shared.faults.lock().expect("endpoint faults poisoned");
        let PostFaults { rng, fail, cut } = &mut *f;
        let refuse = fail
            .as_mut()
            .and_then(|(armed, kind)| armed.fires(rng).then_some(*kind));
        let cut = cut.as_mut().is_some_and(|armed| armed.fires(rng));
        drop(f);
        if let Some(kind) = refuse {
            Counters::bump(&core.dom.stats.posts_failed);
            tracing::info!(target: TARGET, ep = core.id, %kind, "injected fault: {what} refused (fault.fail_post)");
            return Err(Error::new(
                kind,
                format!("injected fault: {what} refused (fault.fail_post)"),
            ));
        }
        Ok(cut)
    }

    fn posted(&self, what: &str, r: &Result<()>, cut: bool) {
        let core = &self.shared.core;
        if let Err(e) = r {
            if core.dom.trace {
                tracing::debug!(target: TARGET, ep = core.id, kind = %e.kind(), "{what} failed: {e}");
            }
        }
        if cut {
            core.cut("fault.cut");
        }
    }
}

impl<E: Endpoint + 'static> Endpoint for HookEndpoint<E> {
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        let s = &*self.shared;
        let _span = s.core.span.enter();
        if s.core.dom.trace {
            trace_send(wr);
        }
        s.core.check()?;
        let cut = self.decide("post_send")?;
        let mut w = *wr;
        let token = wr.flags.contains(SendFlags::SIGNALED).then(|| {
            let t = s.send.insert(wr.context, s.core.clone());
            w.context = t;
            t
        });
        let r = s.inner.post_send(&w);
        if let (Err(_), Some(t)) = (&r, token) {
            s.send.take(t);
        }
        self.posted("post_send", &r, cut);
        r
    }

    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        let s = &*self.shared;
        let _span = s.core.span.enter();
        if s.core.dom.trace {
            tracing::trace!(target: TARGET, context = wr.context, len = total(wr.sgl), sge = wr.sgl.len(), "post_recv");
        }
        s.core.check()?;
        let cut = self.decide("post_recv")?;
        let mut w = *wr;
        let token = s.recv.insert(wr.context, s.core.clone());
        w.context = token;
        let r = s.inner.post_recv(&w);
        if r.is_err() {
            s.recv.take(token);
        }
        self.posted("post_recv", &r, cut);
        r
    }

    fn state(&self) -> EndpointState {
        if self.shared.core.fault.load(Ordering::Acquire) != HEALTHY {
            return EndpointState::Error;
        }
        self.shared.inner.state()
    }

    fn peer_private_data(&self) -> Vec<u8> {
        self.shared.inner.peer_private_data()
    }

    fn local_addr(&self) -> SocketAddr {
        self.shared.inner.local_addr()
    }

    fn peer_addr(&self) -> SocketAddr {
        self.shared.inner.peer_addr()
    }

    fn emulated(&self) -> Vec<String> {
        self.shared.inner.emulated()
    }

    fn ops(&self) -> OpSet {
        self.shared.inner.ops()
    }

    fn close(&self) -> Result<()> {
        let core = &self.shared.core;
        if core.dom.trace {
            tracing::debug!(target: TARGET, parent: &core.span, ep = core.id, "close");
        }
        self.shared.inner.close()
    }

    fn drain(&self, timeout: std::time::Duration) -> Result<()> {
        self.shared.inner.drain(timeout)
    }

    /// The provider's events, except that the close behind an injected fault reads as
    /// the failure it stands for.
    fn next_event(&self) -> Option<EndpointEvent> {
        let ev = self.shared.inner.next_event()?;
        Some(match (ev, self.shared.core.fault.load(Ordering::Acquire)) {
            (EndpointEvent::Closed, CUT) => EndpointEvent::Failed(Error::new(
                ErrorKind::InvalidState,
                "the connection was cut (injected fault)",
            )),
            (EndpointEvent::Closed, DROPPED) => EndpointEvent::Failed(Error::new(
                ErrorKind::InvalidState,
                "a completion was dropped (injected fault)",
            )),
            (ev, _) => ev,
        })
    }

    fn event_fd(&self) -> Result<std::os::fd::BorrowedFd<'_>> {
        self.shared.inner.event_fd()
    }
}
