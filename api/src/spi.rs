//! The provider interface: the traits every provider implements.
//!
//! These traits are statically typed (a domain's endpoints take that domain's completion
//! queues). The `fabric` crate erases the provider type behind `enum_dispatch` enums for
//! applications that pick a provider at run time.

use std::fmt::Debug;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::notify::EndpointEvent;
use crate::{
    Access, Buffer, Completion, EndpointState, MemoryRegion, ProviderInfo, RecvWr, Result, SendWr,
};

/// How to set up an endpoint, for connect and accept.
#[derive(Debug)]
pub struct EndpointConfig<'a, C> {
    /// Completion queue for send-queue operations.
    pub send_cq: &'a C,
    /// Completion queue for receives.
    pub recv_cq: &'a C,
    /// Send queue depth (outstanding send-queue requests).
    pub sq_depth: u32,
    /// Receive queue depth (posted receives).
    pub rq_depth: u32,
    /// Private data carried on connect (initiator) or accept (listener).
    pub private_data: &'a [u8],
    /// Connection establishment timeout.
    pub timeout: Duration,
    /// A value of the application's, carried by every completion of this endpoint
    /// ([`Completion::ep_context`]): which endpoint a completion came from, on a queue
    /// that many endpoints share. 0 unless set.
    pub ep_context: u64,
    /// The most gather/scatter entries a request of this endpoint may carry (libfabric's
    /// `iov_limit`): `None` for the domain's [`Limits::max_sge`](crate::Limits::max_sge),
    /// else 1 up to it. A request with more is refused (`InvalidArgument`) as one above
    /// the domain's limit is. Less than the domain's can make every request cheaper: a
    /// verbs queue pair's entries are sized to the largest list and inline payload it
    /// takes.
    pub max_sge: Option<u32>,
    /// The largest inline payload of this endpoint (libfabric's `inject_size`): `None`
    /// for the domain's [`Limits::max_inline`](crate::Limits::max_inline), else 0 up to
    /// it. An inline request above it is refused (`InvalidArgument`).
    pub max_inline: Option<u32>,
}

impl<C> Clone for EndpointConfig<'_, C> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<C> Copy for EndpointConfig<'_, C> {}

impl<'a, C> EndpointConfig<'a, C> {
    /// A configuration with both queues on `cq`, depth 256 each, no private data, 10 s.
    pub fn new(cq: &'a C) -> Self {
        EndpointConfig {
            send_cq: cq,
            recv_cq: cq,
            sq_depth: 256,
            rq_depth: 256,
            private_data: &[],
            timeout: Duration::from_secs(10),
            ep_context: 0,
            max_sge: None,
            max_inline: None,
        }
    }

    /// The gather/scatter and inline limits of an endpoint of this configuration in a
    /// domain of `limits`: the configured ones, or the domain's. An error
    /// (`InvalidArgument`) names a limit outside what the domain allows.
    pub fn request_limits(&self, limits: &crate::Limits) -> Result<(u32, u32)> {
        let sge = match self.max_sge {
            None => limits.max_sge,
            Some(n) if (1..=limits.max_sge).contains(&n) => n,
            Some(n) => {
                return Err(crate::Error::invalid(format!(
                    "max_sge {n} outside 1..={} (the domain's)",
                    limits.max_sge
                )))
            }
        };
        let inline = match self.max_inline {
            None => limits.max_inline,
            Some(n) if n <= limits.max_inline => n,
            Some(n) => {
                return Err(crate::Error::invalid(format!(
                    "max_inline {n} above the domain's {}",
                    limits.max_inline
                )))
            }
        };
        Ok((sge, inline))
    }

    /// The same configuration over other completion queues (used by run-time dispatch).
    pub fn with_cqs<'b, D>(&self, send_cq: &'b D, recv_cq: &'b D) -> EndpointConfig<'b, D>
    where
        'a: 'b,
    {
        EndpointConfig {
            send_cq,
            recv_cq,
            sq_depth: self.sq_depth,
            rq_depth: self.rq_depth,
            private_data: self.private_data,
            timeout: self.timeout,
            ep_context: self.ep_context,
            max_sge: self.max_sge,
            max_inline: self.max_inline,
        }
    }
}

/// An [`EndpointConfig`] that owns its parts (the queue handles cloned, the private data
/// copied): what a connection in the making keeps while the caller's borrow ends.
#[derive(Debug, Clone)]
pub struct OwnedEndpointConfig<C> {
    /// Completion queue for send-queue operations.
    pub send_cq: C,
    /// Completion queue for receives.
    pub recv_cq: C,
    /// Send queue depth.
    pub sq_depth: u32,
    /// Receive queue depth.
    pub rq_depth: u32,
    /// Private data carried on connect or accept.
    pub private_data: Vec<u8>,
    /// Connection establishment timeout.
    pub timeout: Duration,
    /// The application's value for the endpoint's completions.
    pub ep_context: u64,
    /// Gather/scatter entries per request (`None`: the domain's limit).
    pub max_sge: Option<u32>,
    /// Largest inline payload (`None`: the domain's limit).
    pub max_inline: Option<u32>,
}

impl<C: Clone> OwnedEndpointConfig<C> {
    /// Clones the queue handles of `cfg` and copies its private data.
    pub fn of(cfg: &EndpointConfig<'_, C>) -> Self {
        OwnedEndpointConfig {
            send_cq: cfg.send_cq.clone(),
            recv_cq: cfg.recv_cq.clone(),
            sq_depth: cfg.sq_depth,
            rq_depth: cfg.rq_depth,
            private_data: cfg.private_data.to_vec(),
            timeout: cfg.timeout,
            ep_context: cfg.ep_context,
            max_sge: cfg.max_sge,
            max_inline: cfg.max_inline,
        }
    }

    /// The configuration, borrowed from this one.
    pub fn config(&self) -> EndpointConfig<'_, C> {
        EndpointConfig {
            send_cq: &self.send_cq,
            recv_cq: &self.recv_cq,
            sq_depth: self.sq_depth,
            rq_depth: self.rq_depth,
            private_data: &self.private_data,
            timeout: self.timeout,
            ep_context: self.ep_context,
            max_sge: self.max_sge,
            max_inline: self.max_inline,
        }
    }
}

/// A protection domain on one device: registers memory, creates queues, connects.
pub trait Domain: Send + Sync + Debug {
    /// The provider's completion queue.
    type Cq: CompletionQueue;
    /// The provider's endpoint.
    type Endpoint: Endpoint;
    /// The provider's listener.
    type Listener: Listener<Cq = Self::Cq, Endpoint = Self::Endpoint>;
    /// The provider's connection in the making ([`connect_start`](Self::connect_start)).
    type Connecting: Connecting<Endpoint = Self::Endpoint>;

    /// Provider name, device and capabilities of this domain.
    fn info(&self) -> &ProviderInfo;
    /// Registers `buffer` with `access` (validated per the contract).
    fn register(&self, buffer: Arc<Buffer>, access: Access) -> Result<MemoryRegion>;
    /// Creates a completion queue that can hold `capacity` completions.
    fn create_cq(&self, capacity: usize) -> Result<Self::Cq>;
    /// Listens for connections at `addr` (port 0 picks one).
    fn listen(&self, addr: SocketAddr) -> Result<Self::Listener>;
    /// Connects a reliable endpoint to a listener at `addr`. Blocks until the peer's
    /// application has accepted (or refused) the connection, or `cfg.timeout` passed: two
    /// applications that each connect to the other before accepting need
    /// [`connect_start`](Self::connect_start) instead.
    fn connect(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, Self::Cq>,
    ) -> Result<Self::Endpoint>;
    /// Starts connecting to a listener at `addr` and returns at once, whatever the peer
    /// does; [`Connecting::poll`] finishes the connection. `cfg.timeout` counts from here.
    /// The queues of `cfg` are shared with the connection in the making (they are handles),
    /// its private data copied.
    fn connect_start(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, Self::Cq>,
    ) -> Result<Self::Connecting>;
}

/// A connection being set up without blocking the application (contract section 7):
/// what [`Domain::connect_start`] returns.
///
/// Its descriptor ([`AsFd`]) is readable when [`poll`](Self::poll) may make progress,
/// level-triggered, with spurious readiness allowed (poll again). A connection that
/// nobody answers makes no readiness: wait at most until [`deadline`](Self::deadline),
/// then poll, which reports the time-out. Dropping an unfinished connection abandons it.
pub trait Connecting: Send + Debug + AsFd {
    /// The endpoint it becomes.
    type Endpoint;
    /// Makes progress without blocking: `Ok(Some(endpoint))` once connected, `Ok(None)`
    /// while the peer has not answered yet, and the connection's error once it failed
    /// (refused, rejected, unreachable, timed out). After a result other than `Ok(None)`,
    /// further calls return [`ErrorKind::InvalidState`](crate::ErrorKind::InvalidState).
    fn poll(&mut self) -> Result<Option<Self::Endpoint>>;
    /// When the connection times out ([`EndpointConfig::timeout`] after it started).
    fn deadline(&self) -> Instant;
}

/// Accepts connection requests.
///
/// Its descriptor ([`AsFd`]) is readable while a connection request waits for
/// [`try_accept`](Self::try_accept) (level-triggered; spurious readiness allowed).
pub trait Listener: Send + Sync + Debug + AsFd {
    /// Completion queue type.
    type Cq;
    /// Endpoint type.
    type Endpoint;
    /// The bound address.
    fn local_addr(&self) -> SocketAddr;
    /// Waits up to `timeout` for a connection request and accepts it.
    fn accept(
        &self,
        cfg: &EndpointConfig<'_, Self::Cq>,
        timeout: Duration,
    ) -> Result<Self::Endpoint>;
    /// Accepts a connection request that is already waiting, without waiting for one:
    /// `Ok(None)` when none is. Answering the request may still take a network round
    /// trip on some providers, never the peer application's action.
    fn try_accept(&self, cfg: &EndpointConfig<'_, Self::Cq>) -> Result<Option<Self::Endpoint>>;
}

/// A completion queue.
///
/// # Waiting on a file descriptor
///
/// Besides [`wait`](Self::wait), a queue can be waited on in an event loop (`epoll`,
/// `poll(2)`, tokio's `AsyncFd`): its file descriptor ([`AsFd`]) becomes readable when
/// completions may be pending, after [`arm`](Self::arm), with the arm-then-re-poll
/// semantics of `ibv_req_notify_cq` plus the completion channel, or `ucp_worker_arm` plus
/// the event fd:
///
/// 1. [`poll`](Self::poll) until it returns nothing;
/// 2. [`arm`](Self::arm): `false` means completions are pending already, so go back to 1;
/// 3. wait until the descriptor is readable, then go back to 1.
///
/// Readability is a hint: the descriptor may become readable with nothing to poll (go on
/// with 1 to 3), but after `arm` returned `true` it never stays unreadable while a
/// completion is pending. Never read the descriptor; polling is what consumes its events.
/// One thread at a time follows this loop on a queue. The descriptor is the same for the
/// queue's whole life and is level-triggered for `poll(2)` and `epoll`; with an
/// edge-triggered registration (tokio's), step 2 is what makes the next edge certain.
pub trait CompletionQueue: Send + Sync + Debug + AsFd {
    /// Moves up to `max` completions into `out` without blocking; returns how many.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize>;
    /// Blocks (on an event, not a spin) until a completion is ready or `timeout` passes;
    /// returns whether one is ready.
    fn wait(&self, timeout: Duration) -> Result<bool>;
    /// How many completions the queue can hold.
    fn capacity(&self) -> usize;
    /// Arms the queue's file descriptor (see the trait docs): `Ok(true)` when armed, so
    /// the descriptor becomes readable when a completion may be pending; `Ok(false)` when
    /// completions are pending already (or may be): poll instead of waiting. Never
    /// blocks.
    fn arm(&self) -> Result<bool>;
}

/// A connected, reliable endpoint (RC queue pair semantics).
pub trait Endpoint: Send + Sync + Debug {
    /// Posts a send-queue request (send, write, read, atomic).
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()>;
    /// Posts a receive.
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()>;
    /// Current state.
    fn state(&self) -> EndpointState;
    /// Private data the peer sent on connect or accept.
    fn peer_private_data(&self) -> Vec<u8>;
    /// The local socket address of the connection.
    fn local_addr(&self) -> SocketAddr;
    /// The peer's socket address.
    fn peer_addr(&self) -> SocketAddr;
    /// Operations that are emulated on this connection (after negotiation with the peer).
    fn emulated(&self) -> Vec<String>;
    /// Operations and guarantees this connection provides, after negotiation with the
    /// peer: a subset of the provider's capabilities (a peer that is not of this framework
    /// may not speak the provider's extensions or flow control).
    fn ops(&self) -> crate::OpSet;
    /// Graceful, abortive close: the connection goes down now, and every outstanding
    /// operation on both sides completes Flushed. A send that completes Flushed may still
    /// have been delivered (it was on the wire when the close came); one that completed
    /// Success before was. [`close_drained`](Self::close_drained) lets what was posted
    /// finish first.
    fn close(&self) -> Result<()>;
    /// Waits up to `timeout` until every send-queue operation (sends, writes, reads,
    /// atomics) posted before the call has completed here (its completion, if signaled, is
    /// in the queue); returns [`ErrorKind::TimedOut`](crate::ErrorKind::TimedOut) naming
    /// how many are left otherwise. Receives are not waited for: they complete only when
    /// the peer sends. Makes progress itself; the application need not poll meanwhile
    /// (but its completion queues need room).
    fn drain(&self, timeout: Duration) -> Result<()>;
    /// Draining close: [`drain`](Self::drain) up to `timeout`, then [`close`](Self::close).
    /// Returns the drain's error when something had to be flushed after all.
    fn close_drained(&self, timeout: Duration) -> Result<()> {
        let drained = self.drain(timeout);
        self.close()?;
        drained
    }
    /// Takes the oldest unread connection event: the endpoint failed, was closed, or the
    /// peer closed it. One event per change of [`state`](Self::state), in order.
    fn next_event(&self) -> Option<EndpointEvent>;
    /// A descriptor readable while [`next_event`](Self::next_event) has an event
    /// (level-triggered); created on first use, so endpoints nobody waits on cost none.
    fn event_fd(&self) -> Result<BorrowedFd<'_>>;
}
