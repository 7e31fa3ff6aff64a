//! The pure-Rust TCP fallback provider.
//!
//! It speaks iWARP on the wire (MPA revision 2 per RFC 5044 / RFC 6581, DDP per RFC 5041,
//! RDMAP per RFC 5040, Terminate for errors) over ordinary TCP sockets, so it runs on every
//! machine, and a peer that is not ours (the kernel's siw, an iWARP NIC) can use base RDMAP
//! with it: send, write, read.
//!
//! Between two peers of this framework it negotiates extensions at connection time (see
//! [`wire::mpa::ExtBlock`] and [`wire::ddp`]): 64-bit atomics and immediate data modelled on
//! RFC 7306, and delivery acknowledgements, which make a write's completion mean "in target
//! memory" and let a send complete with the target's verdict (LocalLength there,
//! RemoteInvalidRequest here). Against a foreign peer those operations report `Unsupported`
//! at post time, and sends and writes complete once handed to TCP.
//!
//! What is emulated rather than native (it has no RDMA hardware):
//! * remote placement, reads and atomics are executed by the target's progress engine
//!   ([`engine`]): a progress thread per domain sleeping in `epoll_wait` (progress without
//!   the application, no spinning when idle) and the application's own polls;
//! * atomics use `AtomicU64` on the target word: atomic with respect to every other atomic
//!   issued through the framework, not with respect to plain CPU stores;
//! * receiver-not-ready: a send that finds no posted receive is buffered at the target
//!   (up to 8 MiB per endpoint), then TCP back-pressure holds the sender; nothing is lost.
#![forbid(unsafe_code)]

mod conn;
mod connecting;
mod cq;
mod credit;
mod emu;
pub mod engine;
mod keys;
pub mod listen;
mod setup;
mod tx;
pub mod wire;

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener as StdListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

use fabric_api::spi::{self, EndpointConfig};
use fabric_api::{
    Access, Availability, Buffer, Capabilities, DeviceInfo, Emulation, EndpointEvent,
    EndpointState, Error, ErrorKind, Limits, MemoryRegion, OpSet, ProviderInfo, RecvWr, Result,
    SendWr,
};

pub use connecting::TcpConnecting;
pub use cq::TcpCq;
pub use engine::ProgressMode;

/// Provider name.
pub const NAME: &str = "tcp";
/// Largest message.
pub const MAX_MSG_SIZE: u64 = 1 << 31;
/// Largest inline payload.
pub const MAX_INLINE: u32 = 4096;
/// Largest gather / scatter list.
pub const MAX_SGE: u32 = 16;
/// Deepest send or receive queue.
pub const MAX_QUEUE_DEPTH: u32 = 16384;
/// Largest completion queue.
pub const MAX_CQ_ENTRIES: u32 = 1 << 20;
/// Largest application private data on connect / accept (MPA's limit less our prefixes).
pub const MAX_PRIVATE_DATA: u32 =
    (wire::mpa::MAX_PRIVATE_DATA - wire::mpa::Enhanced::LEN - wire::mpa::ExtBlock::LEN) as u32;

/// Provider options (from configuration: `[tcp]` in the config file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpOptions {
    /// Ask for MPA CRC32c (the peer may also ask; then it is used).
    pub crc: bool,
    /// Announce this framework's extensions (atomics, immediate data, delivery acks).
    pub extensions: bool,
    /// Largest payload per FPDU (bounded by MPA's 16-bit length).
    pub max_segment: usize,
    /// How long a silent peer host may stay silent before its endpoints fail with
    /// `RetryExceeded` (docs/contract.md section 7): TCP keepalive probes an idle connection
    /// (idle for a third of this, then 5 probes spread over the rest) and
    /// `TCP_USER_TIMEOUT` bounds unacknowledged output by the same figure.
    pub dead_peer_timeout: Duration,
    /// Who makes progress: a progress thread per domain plus the application (`Auto`), or
    /// the application's polls alone (`Manual`). See [`engine`].
    pub progress: ProgressMode,
    /// How long the application's polls may keep a delivery ack that its own pass
    /// deferred held, for its next message to that peer to carry (docs/contract.md section
    /// 4): `None` is 1 ms in progress mode `Auto` and nothing (the next poll sends it) in
    /// `Manual`; zero never holds one across a poll. Only on a connection where a message
    /// of the application has carried acks since a hold last expired; waits, arms, closes
    /// and the progress thread send held acks whatever this says.
    pub ack_hold: Option<Duration>,
}

/// Keepalive probes sent before a silent peer is declared dead.
const KEEPALIVE_PROBES: u32 = 5;

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            crc: false,
            extensions: true,
            max_segment: 65_472,
            dead_peer_timeout: Duration::from_secs(10),
            progress: ProgressMode::Auto,
            ack_hold: None,
        }
    }
}

/// Everything this provider declares about itself.
pub fn info() -> ProviderInfo {
    let mut details = BTreeMap::new();
    details.insert("wire".into(), "MPA rev 2 (RFC 5044/6581), DDP (RFC 5041), RDMAP (RFC 5040); markers off; CRC32c negotiable".into());
    details.insert(
        "extensions".into(),
        "atomics + immediate data (RFC 7306 layouts), delivery acks; negotiated per connection"
            .into(),
    );
    ProviderInfo {
        name: NAME.into(),
        availability: Availability::Available,
        devices: vec![DeviceInfo {
            name: "sockets".into(),
            transport: "TCP (iWARP framing)".into(),
            link_layer: "any IP".into(),
            details,
        }],
        caps: capabilities(),
    }
}

/// This provider's limits.
const LIMITS: Limits = Limits {
    max_msg_size: MAX_MSG_SIZE,
    max_inline: MAX_INLINE,
    max_sge: MAX_SGE,
    max_send_queue: MAX_QUEUE_DEPTH,
    max_recv_queue: MAX_QUEUE_DEPTH,
    max_cq_entries: MAX_CQ_ENTRIES,
    max_outstanding_reads: setup::ORD as u32,
    max_private_data: MAX_PRIVATE_DATA,
};

fn capabilities() -> Capabilities {
    let emu = |f: &str, ops: OpSet, how: &str| Emulation {
        feature: f.into(),
        ops,
        how: how.into(),
    };
    Capabilities {
        ops: OpSet::all(),
        limits: LIMITS,
        imm_size: 4,
        emulated: vec![
            emu("RMA", OpSet::WRITE | OpSet::READ | OpSet::WRITE_IMM, "placement, reads and responses by the target's progress engine (one thread per domain plus the application's polls) over TCP"),
            emu("atomics", OpSet::ATOMICS, "executed at the target on AtomicU64 (peers of this framework only: RFC 7306-style extension with the tcp provider, the iwarp provider's emulation with it)"),
            emu("immediate data", OpSet::SEND_IMM | OpSet::WRITE_IMM, "peers of this framework only: RFC 7306-style Immediate Data extension with the tcp provider, the iwarp provider's emulation with it (a ring of records written before the send)"),
            emu("delivery-complete writes", OpSet::WRITE, "target acknowledges each message once placed (extension)"),
            emu("receiver not ready", OpSet::RNR_WAIT, "target buffers up to 8 MiB of unmatched sends, then TCP back-pressure"),
        ],
        unsupported: BTreeMap::new(),
    }
}

#[derive(Debug)]
struct DomainShared {
    id: u64,
    keys: Arc<keys::KeyTable>,
    opts: TcpOptions,
    info: ProviderInfo,
    /// The poll set and progress thread of every endpoint of this domain.
    engine: Arc<engine::Engine>,
}

/// A tcp domain: a key (STag) table and the options its endpoints use.
#[derive(Debug, Clone)]
pub struct TcpDomain {
    shared: Arc<DomainShared>,
}

impl TcpDomain {
    /// Opens a domain.
    pub fn open(opts: TcpOptions) -> Result<Self> {
        if opts.max_segment == 0 || opts.max_segment > 65_535 - wire::ddp::UNTAGGED_LEN {
            return Err(Error::new(
                ErrorKind::Config,
                format!("tcp max_segment {} outside 1..=65517", opts.max_segment),
            ));
        }
        if !(Duration::from_secs(2)..=Duration::from_secs(3600)).contains(&opts.dead_peer_timeout) {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "tcp dead_peer_timeout {:?} outside 2 s..=3600 s",
                    opts.dead_peer_timeout
                ),
            ));
        }
        Ok(TcpDomain {
            shared: Arc::new(DomainShared {
                id: fabric_api::region::next_domain_id(),
                keys: Arc::default(),
                engine: Arc::new(engine::Engine::new(opts.progress, opts.ack_hold)?),
                opts,
                info: info(),
            }),
        })
    }

    /// Sets up an endpoint as the responder to a request the listener read.
    fn respond(
        &self,
        mut sock: TcpStream,
        cfg: &EndpointConfig<'_, TcpCq>,
        request: wire::mpa::MpaFrame,
    ) -> Result<TcpEndpoint> {
        check_depths(cfg)?;
        let neg = setup::respond(
            &mut sock,
            request,
            &self.shared.opts,
            cfg.private_data,
            &self.shared.keys,
            cfg.rq_depth,
        )?;
        self.finish_endpoint(sock, cfg, neg)
    }

    /// Starts the endpoint of a connection whose MPA exchange is done.
    fn finish_endpoint(
        &self,
        sock: TcpStream,
        cfg: &EndpointConfig<'_, TcpCq>,
        neg: conn::Negotiated,
    ) -> Result<TcpEndpoint> {
        // Checked with the depths when the connection began (`check_depths`).
        let (max_sge, max_inline) = cfg.request_limits(&LIMITS)?;
        sock.set_nodelay(true)?;
        dead_peer_detection(&sock, self.shared.opts.dead_peer_timeout)?;
        tracing::debug!(peer = ?sock.peer_addr().ok(), features = neg.features, crc = neg.crc, ord = neg.ord, "tcp endpoint connected");
        let conn = conn::Conn::new(
            self.shared.id,
            self.shared.keys.clone(),
            sock,
            neg,
            self.shared.opts.max_segment,
            cfg.send_cq.clone(),
            cfg.recv_cq.clone(),
            cfg.sq_depth as usize,
            cfg.rq_depth as usize,
            conn::RequestLimits {
                max_sge: max_sge as usize,
                max_inline: max_inline as usize,
            },
            self.shared.engine.clone(),
            cfg.ep_context,
        )?;
        conn.start()?;
        Ok(TcpEndpoint { conn })
    }
}

/// Keepalive and `TCP_USER_TIMEOUT` so that a peer host that goes silent (powered off,
/// unplugged, its packets dropped) fails the connection within `bound`: an idle connection
/// is probed after `bound / 3`, then [`KEEPALIVE_PROBES`] times over the rest; output the
/// peer never acknowledges fails after `bound`. The receive machine then reads `ETIMEDOUT`,
/// and outstanding operations complete `RetryExceeded`.
fn dead_peer_detection(sock: &TcpStream, bound: Duration) -> Result<()> {
    let idle = (bound / 3).max(Duration::from_secs(1));
    // Keepalive timers have a resolution of one second.
    let interval = ((bound - idle) / KEEPALIVE_PROBES).max(Duration::from_secs(1));
    let ka = socket2::TcpKeepalive::new()
        .with_time(idle)
        .with_interval(interval)
        .with_retries(KEEPALIVE_PROBES);
    let s = socket2::SockRef::from(sock);
    s.set_tcp_keepalive(&ka)?;
    s.set_tcp_user_timeout(Some(bound))?;
    Ok(())
}

/// Checks an endpoint configuration before its connection begins: its queue depths, and
/// its gather/scatter and inline limits ([`EndpointConfig::request_limits`] against this
/// provider's; the endpoint takes them when it is made).
fn check_depths<C>(cfg: &EndpointConfig<'_, C>) -> Result<()> {
    cfg.request_limits(&LIMITS)?;
    for (name, d) in [
        ("send queue", cfg.sq_depth),
        ("receive queue", cfg.rq_depth),
    ] {
        if d == 0 || d > MAX_QUEUE_DEPTH {
            return Err(Error::invalid(format!(
                "{name} depth {d} outside 1..={MAX_QUEUE_DEPTH}"
            )));
        }
    }
    Ok(())
}

impl spi::Domain for TcpDomain {
    type Cq = TcpCq;
    type Endpoint = TcpEndpoint;
    type Listener = TcpListener;
    type Connecting = TcpConnecting;

    fn info(&self) -> &ProviderInfo {
        &self.shared.info
    }

    fn register(&self, buffer: Arc<Buffer>, access: Access) -> Result<MemoryRegion> {
        access.validate()?;
        let stag = self.shared.keys.insert(buffer.clone(), access);
        let reg = keys::TcpRegistration {
            table: self.shared.keys.clone(),
            stag,
        };
        Ok(MemoryRegion::new(
            buffer,
            access,
            self.shared.id,
            Box::new(reg),
        ))
    }

    fn create_cq(&self, capacity: usize) -> Result<TcpCq> {
        TcpCq::new(capacity)
    }

    fn listen(&self, addr: SocketAddr) -> Result<TcpListener> {
        let listener = StdListener::bind(addr)?;
        let local = listener.local_addr()?;
        Ok(TcpListener {
            domain: self.clone(),
            local,
            acceptor: listen::Acceptor::start(listener)?,
        })
    }

    fn connect(&self, addr: SocketAddr, cfg: &EndpointConfig<'_, TcpCq>) -> Result<TcpEndpoint> {
        TcpConnecting::start(self, addr, cfg)?.wait()
    }

    fn connect_start(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, TcpCq>,
    ) -> Result<TcpConnecting> {
        TcpConnecting::start(self, addr, cfg)
    }
}

/// A listener: its thread accepts TCP connections and reads their MPA Requests without
/// blocking on any one ([`listen`]); [`accept`](spi::Listener::accept) answers the next
/// complete request.
#[derive(Debug)]
pub struct TcpListener {
    domain: TcpDomain,
    local: SocketAddr,
    acceptor: listen::Acceptor,
}

impl TcpListener {
    /// Answers waiting requests until one gives an endpoint; `None` when none is left
    /// within `timeout`.
    fn accept_within(
        &self,
        cfg: &EndpointConfig<'_, TcpCq>,
        timeout: Duration,
    ) -> Result<Option<TcpEndpoint>> {
        check_depths(cfg)?;
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Some(incoming) = self.acceptor.ready.take(left) else {
                return Ok(None);
            };
            let peer = incoming.peer;
            match self.domain.respond(incoming.sock, cfg, incoming.request) {
                Ok(ep) => return Ok(Some(ep)),
                Err(e) if e.kind() == ErrorKind::InvalidArgument => return Err(e),
                // A bad request costs that peer its connection, not the listener.
                Err(e) => tracing::warn!(%peer, "connection request failed: {e}"),
            }
        }
    }
}

/// Readable while a complete connection request waits for `accept`.
impl AsFd for TcpListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.acceptor
            .ready
            .notifier
            .fd()
            .expect("created with the listener")
    }
}

impl spi::Listener for TcpListener {
    type Cq = TcpCq;
    type Endpoint = TcpEndpoint;

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn accept(&self, cfg: &EndpointConfig<'_, TcpCq>, timeout: Duration) -> Result<TcpEndpoint> {
        self.accept_within(cfg, timeout)?.ok_or_else(|| {
            Error::new(
                ErrorKind::TimedOut,
                format!("no connection request within {timeout:?}"),
            )
        })
    }

    fn try_accept(&self, cfg: &EndpointConfig<'_, TcpCq>) -> Result<Option<TcpEndpoint>> {
        self.accept_within(cfg, Duration::ZERO)
    }
}

/// A connected tcp endpoint. Dropping it closes the connection.
#[derive(Debug)]
pub struct TcpEndpoint {
    conn: Arc<conn::Conn>,
}

impl spi::Endpoint for TcpEndpoint {
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        if self.conn.post_send(wr)? {
            self.conn.defer_output();
        }
        Ok(())
    }
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        if self.conn.post_recv(wr)? {
            self.conn.defer_output();
        }
        Ok(())
    }
    fn state(&self) -> EndpointState {
        self.conn.state()
    }
    fn peer_private_data(&self) -> Vec<u8> {
        self.conn.neg.peer_private.clone()
    }
    fn local_addr(&self) -> SocketAddr {
        self.conn.local
    }
    fn peer_addr(&self) -> SocketAddr {
        self.conn.peer
    }
    fn emulated(&self) -> Vec<String> {
        use wire::mpa::features as f;
        let mut v = vec!["RMA by the target's progress engine".to_string()];
        let n = &self.conn.neg;
        if n.features & f::ATOMICS != 0 {
            v.push("atomics (target AtomicU64)".into());
        }
        if n.features & f::IMMEDIATE != 0 {
            v.push("immediate data (extension)".into());
        }
        if n.emu().is_some() {
            v.push("atomics and immediate data by the iwarp provider's emulation (its peer's area written with RDMA Writes; atomics executed at the target on AtomicU64)".into());
        }
        if n.area.is_some() && n.peer_area.is_some() {
            v.push("receiver-not-ready by credits (the iwarp provider's credit protocol: sends wait for the peer's posted receives)".into());
        }
        if n.features & f::ACKS != 0 {
            v.push("delivery acks (extension)".into());
        } else {
            v.push(
                "no delivery acks: foreign peer, sends and writes complete when handed to TCP"
                    .into(),
            );
        }
        v
    }
    fn ops(&self) -> OpSet {
        use wire::mpa::features as f;
        let n = self.conn.neg.features;
        let mut ops = OpSet::SEND
            | OpSet::WRITE
            | OpSet::READ
            | OpSet::INLINE
            | OpSet::READ_PROTECTION
            | OpSet::LISTEN_EARLY_CLOSE;
        if n & f::ATOMICS != 0 {
            ops |= OpSet::ATOMICS;
        }
        if n & f::IMMEDIATE != 0 {
            ops |= OpSet::SEND_IMM | OpSet::WRITE_IMM;
        }
        // With this framework's iwarp provider: its emulation of both (crate::emu).
        if self.conn.neg.emu().is_some() {
            ops |= OpSet::ATOMICS | OpSet::SEND_IMM | OpSet::WRITE_IMM;
        }
        // Sends wait for a receive only when the target buffers them and says when they
        // landed, or when the connection runs the iwarp provider's credit protocol; a
        // foreign iWARP target refuses a send it has no receive for (Terminate).
        if self.conn.neg.rnr_wait() {
            ops |= OpSet::RNR_WAIT;
        }
        ops
    }
    fn close(&self) -> Result<()> {
        self.conn.close();
        Ok(())
    }
    fn drain(&self, timeout: Duration) -> Result<()> {
        self.conn.drain(timeout)
    }
    fn next_event(&self) -> Option<EndpointEvent> {
        self.conn.events.next()
    }
    fn event_fd(&self) -> Result<BorrowedFd<'_>> {
        self.conn.events.fd()
    }
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        self.conn.close();
        self.conn.unwatch();
    }
}

impl TcpEndpoint {
    /// The MPA revision, CRC and extension features agreed with the peer.
    pub fn negotiated(&self) -> (u8, bool, u8) {
        let n = &self.conn.neg;
        (n.revision, n.crc, n.features)
    }
}
