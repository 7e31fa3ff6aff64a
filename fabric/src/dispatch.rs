//! Run-time dispatch over providers with `enum_dispatch`.
//!
//! The traits here mirror [`fabric_api::spi`] with the provider types erased into enums.
//! They are implemented once, generically, for every type implementing the provider traits;
//! a provider joins by adding its variants to the four enums and one [`ProviderTypes`] line.
//!
//! Each enum also has a `Hooked` variant: the generic wrappers of [`fabric_hook`] over the
//! erased provider ([`ErasedDomain`] and friends implement the provider traits by
//! forwarding to the enums), so hooks work over every provider without a variant per pair.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use enum_dispatch::enum_dispatch;
use fabric_api::spi::{self, EndpointConfig};
use fabric_api::{
    Access, Buffer, Completion, EndpointEvent, EndpointState, Error, MemoryRegion, OpSet,
    ProviderInfo, RecvWr, Result, SendWr,
};
use fabric_hook::{HookCq, HookDomain, HookEndpoint, HookListener};
#[cfg(feature = "verbs")]
use fabric_ib::{IbCq, IbDomain, IbEndpoint, IbListener};
#[cfg(feature = "verbs")]
use fabric_iwarp::{IwarpCq, IwarpDomain, IwarpEndpoint, IwarpListener};
#[cfg(feature = "verbs")]
use fabric_roce::{RoceCq, RoceDomain, RoceEndpoint, RoceListener};
use fabric_tcp::{TcpCq, TcpDomain, TcpEndpoint, TcpListener};

/// A protection domain of any provider.
#[enum_dispatch]
pub trait DomainOps {
    /// Provider, device and capabilities.
    fn info(&self) -> &ProviderInfo;
    /// Registers `buffer` with `access`.
    fn register(&self, buffer: Arc<Buffer>, access: Access) -> Result<MemoryRegion>;
    /// Allocates a zeroed buffer of `len` bytes and registers it.
    fn alloc(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        self.register(Arc::new(Buffer::new(len)), access)
    }
    /// Creates a completion queue of `capacity` entries.
    fn create_cq(&self, capacity: usize) -> Result<AnyCq>;
    /// Listens at `addr`.
    fn listen(&self, addr: SocketAddr) -> Result<AnyListener>;
    /// Connects to a listener at `addr`; blocks until the peer's application accepts
    /// (see [`spi::Domain::connect`]).
    fn connect(&self, addr: SocketAddr, cfg: &EndpointConfig<'_, AnyCq>) -> Result<AnyEndpoint>;
    /// Starts connecting to a listener at `addr` without blocking; [`AnyConnecting::poll`]
    /// finishes (see [`spi::Domain::connect_start`]).
    fn connect_start(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, AnyCq>,
    ) -> Result<AnyConnecting>;
}

/// A completion queue of any provider.
#[enum_dispatch]
pub trait CqOps {
    /// Moves up to `max` completions into `out` without blocking.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize>;
    /// Blocks until a completion is ready or `timeout` passes.
    fn wait(&self, timeout: Duration) -> Result<bool>;
    /// Capacity.
    fn capacity(&self) -> usize;
    /// Arms the queue's file descriptor: `false` when completions are pending already
    /// (poll instead of waiting). See [`fabric_api::spi::CompletionQueue`] for the loop.
    fn arm(&self) -> Result<bool>;
    /// The descriptor that becomes readable after [`arm`](Self::arm) when a completion may
    /// be pending (also [`AsFd`] on [`AnyCq`]).
    fn notify_fd(&self) -> BorrowedFd<'_>;
}

/// A connected endpoint of any provider.
#[enum_dispatch]
pub trait EndpointOps {
    /// Posts a send-queue request.
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()>;
    /// Posts a receive.
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()>;
    /// Current state.
    fn state(&self) -> EndpointState;
    /// The peer's private data.
    fn peer_private_data(&self) -> Vec<u8>;
    /// Local address.
    fn local_addr(&self) -> SocketAddr;
    /// Peer address.
    fn peer_addr(&self) -> SocketAddr;
    /// What is emulated on this connection.
    fn emulated(&self) -> Vec<String>;
    /// Operations and guarantees this connection provides after negotiation.
    fn ops(&self) -> OpSet;
    /// Abortive close: outstanding operations complete Flushed (see
    /// [`spi::Endpoint::close`]).
    fn close(&self) -> Result<()>;
    /// Waits until what was posted on the send queue has completed (see
    /// [`spi::Endpoint::drain`]).
    fn drain(&self, timeout: Duration) -> Result<()>;
    /// Draining close: [`drain`](Self::drain), then [`close`](Self::close).
    fn close_drained(&self, timeout: Duration) -> Result<()>;
    /// The oldest unread connection event (see [`spi::Endpoint::next_event`]).
    fn next_event(&self) -> Option<EndpointEvent>;
    /// A descriptor readable while a connection event is unread.
    fn event_fd(&self) -> Result<BorrowedFd<'_>>;
}

/// A listener of any provider.
#[enum_dispatch]
pub trait ListenerOps {
    /// Bound address.
    fn local_addr(&self) -> SocketAddr;
    /// Accepts the next connection request within `timeout`.
    fn accept(&self, cfg: &EndpointConfig<'_, AnyCq>, timeout: Duration) -> Result<AnyEndpoint>;
    /// Accepts a request that is already waiting; `None` when none is.
    fn try_accept(&self, cfg: &EndpointConfig<'_, AnyCq>) -> Result<Option<AnyEndpoint>>;
    /// The descriptor readable while a connection request waits (also [`AsFd`] on
    /// [`AnyListener`]).
    fn notify_fd(&self) -> BorrowedFd<'_>;
}

/// A domain of the selected provider.
#[enum_dispatch(DomainOps)]
#[derive(Debug)]
pub enum AnyDomain {
    /// The TCP fallback provider.
    Tcp(TcpDomain),
    /// RoCE v2 on the verbs core.
    #[cfg(feature = "verbs")]
    Roce(RoceDomain),
    /// iWARP on the verbs core.
    #[cfg(feature = "verbs")]
    Iwarp(IwarpDomain),
    /// InfiniBand on the verbs core.
    #[cfg(feature = "verbs")]
    Ib(IbDomain),
    /// Any of the above with hooks (tracing, fault injection): see [`fabric_hook`].
    Hooked(HookDomain<ErasedDomain>),
}

/// A completion queue of the selected provider.
#[enum_dispatch(CqOps)]
#[derive(Debug, Clone)]
pub enum AnyCq {
    /// The TCP fallback provider.
    Tcp(TcpCq),
    /// RoCE v2 on the verbs core.
    #[cfg(feature = "verbs")]
    Roce(RoceCq),
    /// iWARP on the verbs core.
    #[cfg(feature = "verbs")]
    Iwarp(IwarpCq),
    /// InfiniBand on the verbs core.
    #[cfg(feature = "verbs")]
    Ib(IbCq),
    /// Any of the above with hooks (tracing, fault injection): see [`fabric_hook`].
    Hooked(HookCq<ErasedCq>),
}

/// The queue's notification descriptor: see [`CqOps::arm`].
impl AsFd for AnyCq {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.notify_fd()
    }
}

/// An endpoint of the selected provider.
#[enum_dispatch(EndpointOps)]
#[derive(Debug)]
pub enum AnyEndpoint {
    /// The TCP fallback provider.
    Tcp(TcpEndpoint),
    /// RoCE v2 on the verbs core.
    #[cfg(feature = "verbs")]
    Roce(RoceEndpoint),
    /// iWARP on the verbs core.
    #[cfg(feature = "verbs")]
    Iwarp(IwarpEndpoint),
    /// InfiniBand on the verbs core.
    #[cfg(feature = "verbs")]
    Ib(IbEndpoint),
    /// Any of the above with hooks (tracing, fault injection): see [`fabric_hook`].
    Hooked(HookEndpoint<ErasedEndpoint>),
}

/// A listener of the selected provider.
#[enum_dispatch(ListenerOps)]
#[derive(Debug)]
pub enum AnyListener {
    /// The TCP fallback provider.
    Tcp(TcpListener),
    /// RoCE v2 on the verbs core.
    #[cfg(feature = "verbs")]
    Roce(RoceListener),
    /// iWARP on the verbs core.
    #[cfg(feature = "verbs")]
    Iwarp(IwarpListener),
    /// InfiniBand on the verbs core.
    #[cfg(feature = "verbs")]
    Ib(IbListener),
    /// Any of the above with hooks (tracing, fault injection): see [`fabric_hook`].
    Hooked(HookListener<ErasedListener>),
}

/// The listener's descriptor: see [`ListenerOps::notify_fd`].
impl AsFd for AnyListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.notify_fd()
    }
}

/// A connection in the making, of any provider: see [`spi::Connecting`].
pub struct AnyConnecting(Box<dyn spi::Connecting<Endpoint = AnyEndpoint>>);

impl std::fmt::Debug for AnyConnecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AnyConnecting").field(&self.0).finish()
    }
}

/// A provider's connection in the making, handing out its endpoint as an [`AnyEndpoint`].
#[derive(Debug)]
struct Widened<C>(C);

impl<C: AsFd> AsFd for Widened<C> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl<C> spi::Connecting for Widened<C>
where
    C: spi::Connecting,
    C::Endpoint: Into<AnyEndpoint>,
{
    type Endpoint = AnyEndpoint;
    fn poll(&mut self) -> Result<Option<AnyEndpoint>> {
        Ok(self.0.poll()?.map(Into::into))
    }
    fn deadline(&self) -> Instant {
        self.0.deadline()
    }
}

impl AnyConnecting {
    /// Makes progress without blocking: the endpoint once connected, `None` while the
    /// peer has not answered (see [`spi::Connecting::poll`]).
    pub fn poll(&mut self) -> Result<Option<AnyEndpoint>> {
        self.0.poll()
    }

    /// When the connection times out.
    pub fn deadline(&self) -> Instant {
        self.0.deadline()
    }
}

impl AsFd for AnyConnecting {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl spi::Connecting for AnyConnecting {
    type Endpoint = AnyEndpoint;
    fn poll(&mut self) -> Result<Option<AnyEndpoint>> {
        self.0.poll()
    }
    fn deadline(&self) -> Instant {
        self.0.deadline()
    }
}

/// Ties a provider's completion-queue type to its [`AnyCq`] variant.
pub trait ProviderTypes: spi::CompletionQueue + Sized {
    /// The provider's queue inside `cq`, or an error when `cq` belongs to another provider.
    fn from_any(cq: &AnyCq) -> Result<&Self>;
}

impl ProviderTypes for TcpCq {
    #[allow(unreachable_patterns)]
    fn from_any(cq: &AnyCq) -> Result<&Self> {
        match cq {
            AnyCq::Tcp(c) => Ok(c),
            _ => Err(Error::invalid(
                "completion queue belongs to another provider",
            )),
        }
    }
}

#[cfg(feature = "verbs")]
impl ProviderTypes for RoceCq {
    fn from_any(cq: &AnyCq) -> Result<&Self> {
        match cq {
            AnyCq::Roce(c) => Ok(c),
            _ => Err(Error::invalid(
                "completion queue belongs to another provider",
            )),
        }
    }
}

#[cfg(feature = "verbs")]
impl ProviderTypes for IwarpCq {
    fn from_any(cq: &AnyCq) -> Result<&Self> {
        match cq {
            AnyCq::Iwarp(c) => Ok(c),
            _ => Err(Error::invalid(
                "completion queue belongs to another provider",
            )),
        }
    }
}

#[cfg(feature = "verbs")]
impl ProviderTypes for IbCq {
    fn from_any(cq: &AnyCq) -> Result<&Self> {
        match cq {
            AnyCq::Ib(c) => Ok(c),
            _ => Err(Error::invalid(
                "completion queue belongs to another provider",
            )),
        }
    }
}

fn narrow<'a, C: ProviderTypes>(cfg: &EndpointConfig<'a, AnyCq>) -> Result<EndpointConfig<'a, C>> {
    Ok(cfg.with_cqs(C::from_any(cfg.send_cq)?, C::from_any(cfg.recv_cq)?))
}

impl<D> DomainOps for D
where
    D: spi::Domain,
    D::Cq: ProviderTypes + Into<AnyCq>,
    D::Endpoint: Into<AnyEndpoint>,
    D::Listener: Into<AnyListener>,
    D::Connecting: 'static,
{
    fn info(&self) -> &ProviderInfo {
        spi::Domain::info(self)
    }
    fn register(&self, buffer: Arc<Buffer>, access: Access) -> Result<MemoryRegion> {
        spi::Domain::register(self, buffer, access)
    }
    fn create_cq(&self, capacity: usize) -> Result<AnyCq> {
        spi::Domain::create_cq(self, capacity).map(Into::into)
    }
    fn listen(&self, addr: SocketAddr) -> Result<AnyListener> {
        spi::Domain::listen(self, addr).map(Into::into)
    }
    fn connect(&self, addr: SocketAddr, cfg: &EndpointConfig<'_, AnyCq>) -> Result<AnyEndpoint> {
        spi::Domain::connect(self, addr, &narrow(cfg)?).map(Into::into)
    }
    fn connect_start(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, AnyCq>,
    ) -> Result<AnyConnecting> {
        let c = spi::Domain::connect_start(self, addr, &narrow(cfg)?)?;
        Ok(AnyConnecting(Box::new(Widened(c))))
    }
}

impl<C: spi::CompletionQueue> CqOps for C {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        spi::CompletionQueue::poll(self, out, max)
    }
    fn wait(&self, timeout: Duration) -> Result<bool> {
        spi::CompletionQueue::wait(self, timeout)
    }
    fn capacity(&self) -> usize {
        spi::CompletionQueue::capacity(self)
    }
    fn arm(&self) -> Result<bool> {
        spi::CompletionQueue::arm(self)
    }
    fn notify_fd(&self) -> BorrowedFd<'_> {
        self.as_fd()
    }
}

impl<E: spi::Endpoint> EndpointOps for E {
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        spi::Endpoint::post_send(self, wr)
    }
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        spi::Endpoint::post_recv(self, wr)
    }
    fn state(&self) -> EndpointState {
        spi::Endpoint::state(self)
    }
    fn peer_private_data(&self) -> Vec<u8> {
        spi::Endpoint::peer_private_data(self)
    }
    fn local_addr(&self) -> SocketAddr {
        spi::Endpoint::local_addr(self)
    }
    fn peer_addr(&self) -> SocketAddr {
        spi::Endpoint::peer_addr(self)
    }
    fn emulated(&self) -> Vec<String> {
        spi::Endpoint::emulated(self)
    }
    fn ops(&self) -> OpSet {
        spi::Endpoint::ops(self)
    }
    fn close(&self) -> Result<()> {
        spi::Endpoint::close(self)
    }
    fn drain(&self, timeout: Duration) -> Result<()> {
        spi::Endpoint::drain(self, timeout)
    }
    fn close_drained(&self, timeout: Duration) -> Result<()> {
        spi::Endpoint::close_drained(self, timeout)
    }
    fn next_event(&self) -> Option<EndpointEvent> {
        spi::Endpoint::next_event(self)
    }
    fn event_fd(&self) -> Result<BorrowedFd<'_>> {
        spi::Endpoint::event_fd(self)
    }
}

impl<L> ListenerOps for L
where
    L: spi::Listener,
    L::Cq: ProviderTypes,
    L::Endpoint: Into<AnyEndpoint>,
{
    fn local_addr(&self) -> SocketAddr {
        spi::Listener::local_addr(self)
    }
    fn accept(&self, cfg: &EndpointConfig<'_, AnyCq>, timeout: Duration) -> Result<AnyEndpoint> {
        spi::Listener::accept(self, &narrow(cfg)?, timeout).map(Into::into)
    }
    fn try_accept(&self, cfg: &EndpointConfig<'_, AnyCq>) -> Result<Option<AnyEndpoint>> {
        Ok(spi::Listener::try_accept(self, &narrow(cfg)?)?.map(Into::into))
    }
    fn notify_fd(&self) -> BorrowedFd<'_> {
        self.as_fd()
    }
}

impl ProviderTypes for HookCq<ErasedCq> {
    fn from_any(cq: &AnyCq) -> Result<&Self> {
        match cq {
            AnyCq::Hooked(c) => Ok(c),
            _ => Err(Error::invalid(
                "completion queue is not hooked: create it from the hooked domain",
            )),
        }
    }
}

/// A domain of any provider seen through the provider traits, so that the generic hooks of
/// [`fabric_hook`] can wrap it ([`AnyDomain::Hooked`]).
#[derive(Debug)]
pub struct ErasedDomain(pub AnyDomain);

/// A completion queue of any provider seen through the provider traits (inside a hooked
/// queue).
#[derive(Debug, Clone)]
pub struct ErasedCq(pub AnyCq);

/// An endpoint of any provider seen through the provider traits (inside a hooked endpoint).
#[derive(Debug)]
pub struct ErasedEndpoint(pub AnyEndpoint);

/// A listener of any provider seen through the provider traits (inside a hooked listener).
#[derive(Debug)]
pub struct ErasedListener(pub AnyListener);

/// A connection in the making of any provider seen through the provider traits (inside a
/// hooked one).
#[derive(Debug)]
pub struct ErasedConnecting(pub AnyConnecting);

impl AsFd for ErasedConnecting {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl spi::Connecting for ErasedConnecting {
    type Endpoint = ErasedEndpoint;
    fn poll(&mut self) -> Result<Option<ErasedEndpoint>> {
        Ok(self.0.poll()?.map(ErasedEndpoint))
    }
    fn deadline(&self) -> Instant {
        self.0.deadline()
    }
}

impl AsFd for ErasedListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

fn widen<'a>(cfg: &EndpointConfig<'a, ErasedCq>) -> EndpointConfig<'a, AnyCq> {
    cfg.with_cqs(&cfg.send_cq.0, &cfg.recv_cq.0)
}

impl spi::Domain for ErasedDomain {
    type Cq = ErasedCq;
    type Endpoint = ErasedEndpoint;
    type Listener = ErasedListener;
    type Connecting = ErasedConnecting;

    fn info(&self) -> &ProviderInfo {
        self.0.info()
    }
    fn register(&self, buffer: Arc<Buffer>, access: Access) -> Result<MemoryRegion> {
        self.0.register(buffer, access)
    }
    fn create_cq(&self, capacity: usize) -> Result<ErasedCq> {
        self.0.create_cq(capacity).map(ErasedCq)
    }
    fn listen(&self, addr: SocketAddr) -> Result<ErasedListener> {
        self.0.listen(addr).map(ErasedListener)
    }
    fn connect(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, ErasedCq>,
    ) -> Result<ErasedEndpoint> {
        self.0.connect(addr, &widen(cfg)).map(ErasedEndpoint)
    }
    fn connect_start(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, ErasedCq>,
    ) -> Result<ErasedConnecting> {
        self.0
            .connect_start(addr, &widen(cfg))
            .map(ErasedConnecting)
    }
}

impl spi::CompletionQueue for ErasedCq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        self.0.poll(out, max)
    }
    fn wait(&self, timeout: Duration) -> Result<bool> {
        self.0.wait(timeout)
    }
    fn capacity(&self) -> usize {
        self.0.capacity()
    }
    fn arm(&self) -> Result<bool> {
        self.0.arm()
    }
}

impl AsFd for ErasedCq {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl spi::Endpoint for ErasedEndpoint {
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        self.0.post_send(wr)
    }
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        self.0.post_recv(wr)
    }
    fn state(&self) -> EndpointState {
        self.0.state()
    }
    fn peer_private_data(&self) -> Vec<u8> {
        self.0.peer_private_data()
    }
    fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }
    fn peer_addr(&self) -> SocketAddr {
        self.0.peer_addr()
    }
    fn emulated(&self) -> Vec<String> {
        self.0.emulated()
    }
    fn ops(&self) -> OpSet {
        self.0.ops()
    }
    fn close(&self) -> Result<()> {
        self.0.close()
    }
    fn drain(&self, timeout: Duration) -> Result<()> {
        self.0.drain(timeout)
    }
    fn next_event(&self) -> Option<EndpointEvent> {
        self.0.next_event()
    }
    fn event_fd(&self) -> Result<BorrowedFd<'_>> {
        self.0.event_fd()
    }
}

impl spi::Listener for ErasedListener {
    type Cq = ErasedCq;
    type Endpoint = ErasedEndpoint;

    fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }
    fn accept(
        &self,
        cfg: &EndpointConfig<'_, ErasedCq>,
        timeout: Duration,
    ) -> Result<ErasedEndpoint> {
        self.0.accept(&widen(cfg), timeout).map(ErasedEndpoint)
    }
    fn try_accept(&self, cfg: &EndpointConfig<'_, ErasedCq>) -> Result<Option<ErasedEndpoint>> {
        Ok(self.0.try_accept(&widen(cfg))?.map(ErasedEndpoint))
    }
}

impl AnyDomain {
    /// The hooks of a hooked domain (`None` when no hook is active): its fault counts
    /// ([`HookDomain::stats`]), seed and description.
    pub fn hooks(&self) -> Option<&HookDomain<ErasedDomain>> {
        match self {
            AnyDomain::Hooked(h) => Some(h),
            _ => None,
        }
    }

    /// Wraps this domain with `hooks` (nothing changes when no hook is active).
    pub fn with_hooks(self, hooks: fabric_hook::HookConfig) -> AnyDomain {
        if hooks.is_active() {
            AnyDomain::Hooked(HookDomain::new(ErasedDomain(self), hooks))
        } else {
            self
        }
    }
}

impl AnyEndpoint {
    /// Waits up to `timeout` for the endpoint's next connection event and returns it;
    /// `None` when none came in time. The blocking counterpart of
    /// [`crate::tokio::next_event`].
    ///
    /// The side of a connection that received the last message waits here for
    /// [`EndpointEvent::PeerClosed`] before it closes: a close is abortive for what the peer
    /// still has outstanding (docs/contract.md section 7), and the peer's last send may not have
    /// completed yet when its message is seen (on iWARP the completion of a send is that of
    /// the delivery read behind it).
    pub fn wait_event(&self, timeout: Duration) -> Result<Option<EndpointEvent>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(ev) = self.next_event() {
                return Ok(Some(ev));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            fabric_api::notify::wait_readable(self.event_fd()?, left)?;
        }
    }

    /// The hooked endpoint, for [`HookEndpoint::cut_connection`] (`None` when its domain
    /// has no hooks).
    pub fn hooks(&self) -> Option<&HookEndpoint<ErasedEndpoint>> {
        match self {
            AnyEndpoint::Hooked(h) => Some(h),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_api::spi::EndpointConfig;

    /// `wait_event` times out with `None` on a quiet connection, wakes with `PeerClosed`
    /// when the peer closes, and the closing side reads its own `Closed`.
    #[test]
    fn wait_event_times_out_then_sees_the_peer_close() {
        let (d, _) = crate::Selector::new()
            .providers("tcp")
            .and_then(|s| s.open())
            .expect("tcp domain");
        let l = d.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let (cqa, cqb) = (d.create_cq(8).unwrap(), d.create_cq(8).unwrap());
        let (a, b) = std::thread::scope(|s| {
            let acc = s.spawn(|| {
                l.accept(&EndpointConfig::new(&cqb), Duration::from_secs(10))
                    .unwrap()
            });
            let a = d
                .connect(l.local_addr(), &EndpointConfig::new(&cqa))
                .unwrap();
            (a, acc.join().unwrap())
        });
        let t = Instant::now();
        assert_eq!(a.wait_event(Duration::from_millis(50)).unwrap(), None);
        assert!(t.elapsed() >= Duration::from_millis(50));
        b.close().unwrap();
        assert_eq!(
            a.wait_event(Duration::from_secs(10)).unwrap(),
            Some(EndpointEvent::PeerClosed)
        );
        assert_eq!(
            b.wait_event(Duration::ZERO).unwrap(),
            Some(EndpointEvent::Closed)
        );
    }
}
