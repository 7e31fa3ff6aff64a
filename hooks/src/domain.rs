//! The hooked domain and listener.

use std::fmt;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use fabric_api::sync::Mutex;
use std::time::{Duration, Instant};

use fabric_api::spi::{CompletionQueue, Connecting, Domain, Endpoint, EndpointConfig, Listener};
use fabric_api::{Access, Buffer, MemoryRegion, ProviderInfo, RegionRef, Registration, Result};

use crate::config::HookConfig;
use crate::cq::HookCq;
use crate::endpoint::HookEndpoint;
use crate::fault::{Counters, FaultStats};
use crate::{Shared, TARGET};

/// A domain of any provider with hooks: its queues, endpoints and listeners are hooked.
pub struct HookDomain<D> {
    inner: Arc<D>,
    shared: Arc<Shared>,
}

impl<D: fmt::Debug> fmt::Debug for HookDomain<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookDomain")
            .field("hooks", &self.describe())
            .field("inner", &self.inner)
            .finish()
    }
}

impl<D: Domain> HookDomain<D> {
    /// Wraps `inner` with the hooks of `config` (a configuration with no hook active still
    /// wraps, and only counts).
    pub fn new(inner: D, config: HookConfig) -> Self {
        let seed = config
            .fault
            .as_ref()
            .and_then(|f| f.seed)
            .unwrap_or_else(crate::random_u64);
        let provider = inner.info().name.clone();
        let d = HookDomain {
            inner: Arc::new(inner),
            shared: Arc::new(Shared {
                trace: config.trace,
                fault: config.fault,
                seed,
                stats: Counters::default(),
                next_ep: AtomicU64::new(0),
                next_cq: AtomicU64::new(0),
                provider,
            }),
        };
        tracing::info!(target: TARGET, provider = %d.shared.provider, hooks = ?d.describe(), "fabric hooks active");
        d
    }
}

impl<D> HookDomain<D> {
    /// The provider's domain underneath.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The faults injected so far, over all of this domain's queues and endpoints.
    pub fn stats(&self) -> FaultStats {
        self.shared.stats.snapshot()
    }

    /// The fault seed in use (the configured one, or the one picked at random); `None`
    /// without the fault hook.
    pub fn seed(&self) -> Option<u64> {
        self.shared.fault.as_ref().map(|_| self.shared.seed)
    }

    /// The active hooks, one line each, as the selection report shows them.
    pub fn describe(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.shared.trace {
            v.push(format!(
                "trace (tracing target {TARGET}: DEBUG lifecycle and registrations, TRACE posts and completions)"
            ));
        }
        if let Some(f) = &self.shared.fault {
            v.push(format!(
                "fault (seed {}; set fault.seed to repeat): {f}",
                self.shared.seed
            ));
        }
        v
    }
}

/// A registration that logs its revocation; keys are the provider's.
#[derive(Debug)]
struct TracedRegistration {
    lkey: u32,
    rkey: u32,
    /// The provider's region: dropped (revoking the provider's key, once) on revoke.
    region: Mutex<Option<MemoryRegion>>,
    /// Keeps the provider's registration alive until no operation uses the region.
    _keep: RegionRef,
}

impl Registration for TracedRegistration {
    fn local_key(&self) -> u32 {
        self.lkey
    }
    fn remote_key(&self) -> u32 {
        self.rkey
    }
    fn revoke(&self) {
        let region = self.region.lock().expect("registration poisoned").take();
        if let Some(r) = region {
            tracing::debug!(target: TARGET, key = %format_args!("{:#x}", self.rkey),
                addr = %format_args!("{:#x}", r.desc().addr), len = r.len(), "deregister");
            drop(r);
        }
    }
}

impl<D> Domain for HookDomain<D>
where
    D: Domain + 'static,
{
    type Cq = HookCq<D::Cq>;
    type Endpoint = HookEndpoint<D::Endpoint>;
    type Listener = HookListener<D::Listener>;
    type Connecting = HookConnecting<D::Connecting>;

    fn info(&self) -> &ProviderInfo {
        self.inner.info()
    }

    fn register(&self, buffer: Arc<Buffer>, access: Access) -> Result<MemoryRegion> {
        let r = self.inner.register(buffer.clone(), access);
        if !self.shared.trace {
            return r;
        }
        let mr = match r {
            Ok(mr) => mr,
            Err(e) => {
                tracing::debug!(target: TARGET, len = buffer.len(), ?access, "register failed: {e}");
                return Err(e);
            }
        };
        let keep = mr.to_ref();
        let desc = mr.desc();
        tracing::debug!(target: TARGET, key = %format_args!("{:#x}", desc.key),
            addr = %format_args!("{:#x}", desc.addr), len = desc.len, ?access, "register");
        let reg = TracedRegistration {
            lkey: keep.local_key(),
            rkey: desc.key,
            region: Mutex::new(Some(mr)),
            _keep: keep.clone(),
        };
        // The same buffer, access and domain identity: the provider accepts the region as
        // its own, and its keys are the provider's.
        Ok(MemoryRegion::new(
            keep.shared_buffer(),
            access,
            keep.domain_id(),
            Box::new(reg),
        ))
    }

    fn create_cq(&self, capacity: usize) -> Result<Self::Cq> {
        let cq = HookCq::new(self.inner.create_cq(capacity)?, self.shared.clone());
        if self.shared.trace {
            tracing::debug!(target: TARGET, capacity, "create_cq");
        }
        Ok(cq)
    }

    fn listen(&self, addr: SocketAddr) -> Result<Self::Listener> {
        let l = self.inner.listen(addr);
        if self.shared.trace {
            match &l {
                Ok(l) => tracing::debug!(target: TARGET, %addr, local = %l.local_addr(), "listen"),
                Err(e) => tracing::debug!(target: TARGET, %addr, "listen failed: {e}"),
            }
        }
        Ok(HookListener {
            inner: Box::new(l?),
            shared: self.shared.clone(),
        })
    }

    fn connect(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, Self::Cq>,
    ) -> Result<Self::Endpoint> {
        let inner_cfg = cfg.with_cqs(cfg.send_cq.inner(), cfg.recv_cq.inner());
        match self.inner.connect(addr, &inner_cfg) {
            Ok(ep) => Ok(HookEndpoint::new(
                ep,
                self.shared.clone(),
                cfg.send_cq.ledger().clone(),
                cfg.recv_cq.ledger().clone(),
                "connect",
            )),
            Err(e) => {
                if self.shared.trace {
                    tracing::debug!(target: TARGET, %addr, kind = %e.kind(), "connect failed: {e}");
                }
                Err(e)
            }
        }
    }

    fn connect_start(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, Self::Cq>,
    ) -> Result<Self::Connecting> {
        let inner_cfg = cfg.with_cqs(cfg.send_cq.inner(), cfg.recv_cq.inner());
        let inner = self.inner.connect_start(addr, &inner_cfg)?;
        if self.shared.trace {
            tracing::debug!(target: TARGET, %addr, "connect started");
        }
        Ok(HookConnecting {
            inner,
            addr,
            shared: self.shared.clone(),
            send: cfg.send_cq.ledger().clone(),
            recv: cfg.recv_cq.ledger().clone(),
        })
    }
}

/// A connection in the making of any provider, hooked: the endpoint it becomes is hooked.
pub struct HookConnecting<C> {
    inner: C,
    addr: SocketAddr,
    shared: Arc<Shared>,
    send: Arc<crate::cq::Ledger>,
    recv: Arc<crate::cq::Ledger>,
}

impl<C: fmt::Debug> fmt::Debug for HookConnecting<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookConnecting")
            .field("inner", &self.inner)
            .finish()
    }
}

impl<C: AsFd> AsFd for HookConnecting<C> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

impl<C> Connecting for HookConnecting<C>
where
    C: Connecting,
    C::Endpoint: Endpoint + 'static,
{
    type Endpoint = HookEndpoint<C::Endpoint>;

    fn poll(&mut self) -> Result<Option<Self::Endpoint>> {
        match self.inner.poll() {
            Ok(Some(ep)) => Ok(Some(HookEndpoint::new(
                ep,
                self.shared.clone(),
                self.send.clone(),
                self.recv.clone(),
                "connect",
            ))),
            Ok(None) => Ok(None),
            Err(e) => {
                if self.shared.trace {
                    let addr = self.addr;
                    tracing::debug!(target: TARGET, %addr, kind = %e.kind(), "connect failed: {e}");
                }
                Err(e)
            }
        }
    }

    fn deadline(&self) -> Instant {
        self.inner.deadline()
    }
}

/// A listener of any provider, hooked: accepted endpoints are hooked.
pub struct HookListener<L> {
    /// Boxed, so a listener type may contain hooked listeners (run-time dispatch does).
    inner: Box<L>,
    shared: Arc<Shared>,
}

impl<L: fmt::Debug> fmt::Debug for HookListener<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookListener")
            .field("inner", &self.inner)
            .finish()
    }
}

impl<L: Listener> HookListener<L> {
    /// The provider's listener underneath.
    pub fn inner(&self) -> &L {
        &self.inner
    }
}

impl<L> Listener for HookListener<L>
where
    L: Listener,
    L::Cq: CompletionQueue,
    L::Endpoint: Endpoint + 'static,
{
    type Cq = HookCq<L::Cq>;
    type Endpoint = HookEndpoint<L::Endpoint>;

    fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    fn accept(
        &self,
        cfg: &EndpointConfig<'_, Self::Cq>,
        timeout: Duration,
    ) -> Result<Self::Endpoint> {
        let inner_cfg = cfg.with_cqs(cfg.send_cq.inner(), cfg.recv_cq.inner());
        match self.inner.accept(&inner_cfg, timeout) {
            Ok(ep) => Ok(HookEndpoint::new(
                ep,
                self.shared.clone(),
                cfg.send_cq.ledger().clone(),
                cfg.recv_cq.ledger().clone(),
                "accept",
            )),
            Err(e) => {
                if self.shared.trace {
                    tracing::debug!(target: TARGET, local = %self.inner.local_addr(), kind = %e.kind(), "accept failed: {e}");
                }
                Err(e)
            }
        }
    }

    fn try_accept(&self, cfg: &EndpointConfig<'_, Self::Cq>) -> Result<Option<Self::Endpoint>> {
        let inner_cfg = cfg.with_cqs(cfg.send_cq.inner(), cfg.recv_cq.inner());
        Ok(self.inner.try_accept(&inner_cfg)?.map(|ep| {
            HookEndpoint::new(
                ep,
                self.shared.clone(),
                cfg.send_cq.ledger().clone(),
                cfg.recv_cq.ledger().clone(),
                "accept",
            )
        }))
    }
}

/// The provider's listener descriptor.
impl<L: AsFd> AsFd for HookListener<L> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}
