//! The RDM endpoint: address vector, connections on demand, the eager and rendezvous
//! protocols, credit flow control and the dispatch of completions.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fabric::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric::{Error, RegionRef, Result, Slice};

use crate::matching::{Matcher, Spec, Src};
use crate::slab::Slab;
use crate::wire::{Header, Kind, F_SYNC, F_TAGGED, HDR_LEN};
use crate::IdMap;

/// Configuration of an [`RdmEndpoint`].
#[derive(Debug, Clone)]
pub struct RdmConfig {
    /// Where the endpoint listens for peers' connections (port 0 picks one).
    pub bind: SocketAddr,
    /// The address put in the endpoint's name when `bind` is a wildcard address.
    pub advertise: Option<IpAddr>,
    /// Largest message sent eagerly (copied through bounce buffers); larger ones use the
    /// rendezvous protocol (the receiver reads the sender's memory with RDMA Read).
    pub eager_max: usize,
    /// Receive buffers posted per connection (the credits a sender has towards us).
    pub recv_depth: u32,
    /// Send-queue depth per connection.
    pub sq_depth: u32,
    /// Bytes of unexpected messages kept per endpoint before senders are made to wait.
    pub max_unexpected_bytes: usize,
    /// Completion-queue capacity shared by every connection; it bounds how many
    /// connections the endpoint can hold (`sq_depth + recv_depth` entries each). Lowered to
    /// the provider's `max_cq_entries` when larger.
    pub cq_capacity: usize,
    /// Connection establishment timeout: the first operation to a peer waits this long at
    /// most for its connection, which is tried again within it after a transient failure
    /// (`Io`, `TimedOut`: siw's 5 s MPA reply timeout, for one).
    pub connect_timeout: Duration,
    /// How long [`RdmEndpoint::wait`] polls before it sleeps in the completion queue
    /// (lower latency for a core spent; zero sleeps at once).
    pub busy_poll: Duration,
    /// How long dropping the endpoint waits for its last messages to leave and its peers
    /// to answer that they will send nothing more ([`RdmEndpoint::close`]; a peer that does
    /// not make progress meanwhile costs the whole time).
    pub linger: Duration,
}

impl Default for RdmConfig {
    fn default() -> Self {
        RdmConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            eager_max: 8192,
            recv_depth: 32,
            sq_depth: 64,
            max_unexpected_bytes: 4 << 20,
            cq_capacity: 32768,
            connect_timeout: Duration::from_secs(10),
            busy_poll: Duration::from_micros(100),
            linger: Duration::from_millis(200),
        }
    }
}

impl RdmConfig {
    fn validate(&self) -> Result<()> {
        if self.recv_depth < 8 || self.recv_depth >= (1 << 20) {
            return Err(Error::invalid(format!(
                "recv_depth {} must be in 8..1048576 (credit flow control keeps 3 in reserve)",
                self.recv_depth
            )));
        }
        if self.sq_depth < 2 {
            return Err(Error::invalid("sq_depth must be at least 2"));
        }
        if self.eager_max > (1 << 20) {
            return Err(Error::invalid(format!(
                "eager_max {} is over 1 MiB: use the rendezvous protocol for large messages",
                self.eager_max
            )));
        }
        if self.cq_capacity < (self.sq_depth + self.recv_depth) as usize {
            return Err(Error::invalid(
                "cq_capacity cannot hold one connection (sq_depth + recv_depth)",
            ));
        }
        Ok(())
    }
}

/// A peer in the address vector: a small handle. A handle whose entry was removed is
/// refused with `InvalidArgument`, even if its slot is reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Peer {
    idx: u32,
    gen: u32,
}

impl Peer {
    /// The handle's slot in the address vector (stable while the entry lives).
    pub fn index(&self) -> u32 {
        self.idx
    }
}

/// Where a tagged receive accepts messages from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Any peer.
    Any,
    /// One peer.
    Peer(Peer),
}

/// A receive buffer: a range of a registered region (needs `LOCAL_WRITE`, and must belong
/// to the endpoint's domain: large messages are read straight into it).
#[derive(Debug, Clone)]
pub struct RecvBuf {
    /// The region.
    pub region: Arc<MemoryRegion>,
    /// Offset of the buffer in the region.
    pub offset: usize,
    /// Length of the buffer.
    pub len: usize,
}

impl RecvBuf {
    /// The whole region.
    pub fn whole(region: Arc<MemoryRegion>) -> Self {
        let len = region.len();
        RecvBuf {
            region,
            offset: 0,
            len,
        }
    }

    /// `len` bytes at `offset` of the region.
    pub fn new(region: Arc<MemoryRegion>, offset: usize, len: usize) -> Self {
        RecvBuf {
            region,
            offset,
            len,
        }
    }
}

/// Names a posted receive, for [`RdmEndpoint::cancel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecvId(u64);

/// The operation a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmOp {
    /// An untagged send.
    Send,
    /// An untagged receive.
    Recv,
    /// A tagged send (synchronous or not).
    TaggedSend,
    /// A tagged receive.
    TaggedRecv,
    /// A message placed in a multi-receive buffer, or the buffer's release.
    MultiRecv,
    /// RDMA Write.
    Write,
    /// RDMA Read.
    Read,
    /// Fetch-and-add.
    FetchAdd,
    /// Compare-and-swap.
    CompareSwap,
}

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmStatus {
    /// Done.
    Success,
    /// A receive cancelled before it matched.
    Canceled,
    /// A multi-receive buffer has less than its minimum free space left: it is released.
    Released,
    /// Failed: `LocalLength` for a receive shorter than its message (holding its first
    /// bytes), the transport's error (`RetryExceeded`, `Flushed`...) for an operation
    /// addressed to a peer that failed.
    Error(ErrorKind),
}

/// One completion of an RDM endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmCompletion {
    /// The caller's context.
    pub context: u64,
    /// The operation.
    pub op: RdmOp,
    /// The outcome.
    pub status: RdmStatus,
    /// The peer the operation was addressed to or the message came from.
    pub peer: Option<Peer>,
    /// The message's tag (tagged operations).
    pub tag: u64,
    /// Bytes placed (receives) or moved.
    pub len: u64,
    /// The message's length at its sender (receives; more than `len` when truncated).
    pub msg_len: u64,
    /// Where the message starts in a multi-receive buffer.
    pub offset: u64,
}

impl RdmCompletion {
    /// True on success.
    pub fn is_ok(&self) -> bool {
        self.status == RdmStatus::Success
    }
}

/// What [`RdmEndpoint::probe`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeInfo {
    /// The sender.
    pub peer: Option<Peer>,
    /// The tag.
    pub tag: u64,
    /// The message's length.
    pub len: u64,
}

/// A message taken off the unexpected queue by [`RdmEndpoint::probe_claim`]; receive it
/// with [`RdmEndpoint::recv_claimed`] (no other receive can match it any more).
#[derive(Debug)]
#[must_use = "a claimed message holds its sender's flow-control credit until received"]
pub struct Claimed(u64);

const RECV_BIT: u64 = 1 << 63;
/// The context of an unsignaled wire send: this bit over its connection's key. Such a send
/// completes only in error (the contract's "an error always completes"), and then names
/// the connection that failed.
const UNSIG_BIT: u64 = 1 << 62;
/// At least one wire send in this many (and in half the send queue) is signaled: at most
/// `SIGNAL_EVERY - 1` go unsignaled in a row, and the next one's completion frees their
/// slots too.
const SIGNAL_EVERY: u32 = 16;
/// Credits kept back from data messages (for acknowledgements and credit returns).
const RESERVE: u32 = 3;
const SLOTS_PER_CHUNK: usize = 64;

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// An endpoint name: the listener's address and the endpoint's nonce (which tells apart two
/// endpoints that used the same address one after the other), as bytes to exchange out of
/// band: version 1, family 4 or 6, the IP, the port (big-endian), the nonce (u64 LE).
fn encode_name(addr: SocketAddr, nonce: u64) -> Vec<u8> {
    let mut v = vec![1u8];
    match addr.ip() {
        IpAddr::V4(ip) => {
            v.push(4);
            v.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            v.push(6);
            v.extend_from_slice(&ip.octets());
        }
    }
    v.extend_from_slice(&addr.port().to_be_bytes());
    v.extend_from_slice(&nonce.to_le_bytes());
    v
}

/// The address and nonce in an endpoint name.
fn decode_full(b: &[u8]) -> Result<(SocketAddr, u64)> {
    let bad = || Error::invalid(format!("not an rdm endpoint name: {b:02x?}"));
    let (ip, rest): (IpAddr, &[u8]) = match b {
        [1, 4, rest @ ..] if rest.len() == 4 + 2 + 8 => {
            let ip: [u8; 4] = rest[..4].try_into().map_err(|_| bad())?;
            (ip.into(), &rest[4..])
        }
        [1, 6, rest @ ..] if rest.len() == 16 + 2 + 8 => {
            let ip: [u8; 16] = rest[..16].try_into().map_err(|_| bad())?;
            (ip.into(), &rest[16..])
        }
        _ => return Err(bad()),
    };
    let port = u16::from_be_bytes([rest[0], rest[1]]);
    let nonce = u64::from_le_bytes(rest[2..10].try_into().map_err(|_| bad())?);
    if nonce == 0 {
        return Err(bad());
    }
    Ok((SocketAddr::new(ip, port), nonce))
}

/// The address in an endpoint name made by [`RdmEndpoint::name`].
pub fn decode_name(b: &[u8]) -> Result<SocketAddr> {
    Ok(decode_full(b)?.0)
}

/// A nonzero number no other endpoint is likely to pick (std's randomly seeded hasher over
/// the time, the process and a counter).
fn new_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
    h.finish().max(1)
}

/// Connection private data: `b'R'`, the sender's receive depth (u32 LE), its name.
fn private_data(depth: u32, name: &[u8]) -> Vec<u8> {
    let mut v = vec![b'R'];
    v.extend_from_slice(&depth.to_le_bytes());
    v.extend_from_slice(name);
    v
}

/// Receive depth, address and nonce from connection private data.
fn parse_private(b: &[u8]) -> Result<(u32, SocketAddr, u64)> {
    match b {
        [b'R', d0, d1, d2, d3, name @ ..] => {
            let (addr, nonce) = decode_full(name)?;
            Ok((u32::from_le_bytes([*d0, *d1, *d2, *d3]), addr, nonce))
        }
        _ => Err(Error::new(
            ErrorKind::Protocol,
            "connection from something that is not an rdm endpoint",
        )),
    }
}

#[derive(Debug)]
struct AvEntry {
    addr: SocketAddr,
    /// The endpoint's nonce; 0 while unknown (inserted by address, not yet connected).
    nonce: u64,
    gen: u32,
    live: bool,
    send_conn: Option<u64>,
}

#[derive(Debug)]
struct PendingData {
    hdr: Header,
    payload: Option<(RegionRef, usize, usize)>,
    op: u64,
}

#[derive(Debug)]
struct PendingRead {
    op: u64,
    sender_op: u64,
    buf: RecvBuf,
    at: usize,
    len: usize,
    addr: u64,
    key: u32,
}

#[derive(Debug)]
struct Conn {
    ep: AnyEndpoint,
    peer: u32,
    credits: u32,
    to_return: u32,
    sq_inflight: u32,
    reads_inflight: u32,
    recv: MemoryRegion,
    ctrl: VecDeque<Header>,
    data: VecDeque<PendingData>,
    reads: VecDeque<PendingRead>,
    /// Send slots of unsignaled wire sends still on the send queue, in post order: a later
    /// signaled request's completion frees them (a queue completes in post order).
    unsig: VecDeque<usize>,
    /// How many of the last entries of `unsig` no signaled request posted after them
    /// covers yet ([`RdmEndpoint::flush`] sends one to cover them).
    uncovered: u32,
    /// We sent `ByeAck`: nothing more goes out on this connection.
    quiet: bool,
    /// We sent `Bye` and wait for `ByeAck`.
    bye_sent: bool,
    /// The peer answered our `Bye`.
    bye_acked: bool,
    /// The peer means to keep this connection: we made it (the peer accepted it knowing our
    /// name), or a message of the peer's came over it. One we accepted is not settled until
    /// then: its initiator closes it at once if it was looking for an endpoint that held our
    /// address before us (`Inner::adopt`), so `Inner::live_send_conn` checks its state.
    settled: bool,
}

#[derive(Debug)]
enum Inflight {
    /// A signaled wire message; its completion also frees the first `covers` slots of
    /// the connection's unsignaled sends, which were posted before it.
    Wire {
        conn: u64,
        slot: usize,
        covers: u32,
    },
    Rma {
        conn: u64,
        op: u64,
    },
    Read {
        conn: u64,
        op: u64,
        sender_op: u64,
    },
}

#[derive(Debug)]
struct UserOp {
    context: u64,
    op: RdmOp,
    peer: Option<u32>,
    tag: u64,
    len: u64,
    msg_len: u64,
    offset: u64,
    waiting: u32,
    status: RdmStatus,
    /// The connection whose peer must still answer (acknowledgement, FIN, read).
    conn: Option<u64>,
    /// A registered copy of a rendezvous payload whose region the peer could not read.
    staging: Option<MemoryRegion>,
    /// A receive: the matcher it was posted to (tagged or not) and its number there, for
    /// `cancel` (a receive that has matched is no longer in the matcher: cancel finds
    /// nothing there).
    posted: Option<(bool, u64)>,
}

impl UserOp {
    fn new(context: u64, op: RdmOp, peer: Option<u32>, tag: u64, waiting: u32) -> UserOp {
        UserOp {
            context,
            op,
            peer,
            tag,
            len: 0,
            msg_len: 0,
            offset: 0,
            waiting,
            status: RdmStatus::Success,
            conn: None,
            staging: None,
            posted: None,
        }
    }
}

#[derive(Debug)]
struct Posted {
    op: u64,
    buf: RecvBuf,
    /// Multi-receive: bytes used, minimum free space.
    multi: Option<(usize, usize)>,
}

#[derive(Debug)]
struct Unexp {
    conn: u64,
    hdr: Header,
    data: Vec<u8>,
    withheld: bool,
    cost: usize,
}

#[derive(Debug)]
struct Slots {
    size: usize,
    chunks: Vec<MemoryRegion>,
    free: Vec<usize>,
}

impl Slots {
    fn get(&mut self, domain: &AnyDomain) -> Result<usize> {
        if let Some(s) = self.free.pop() {
            return Ok(s);
        }
        let base = self.chunks.len() * SLOTS_PER_CHUNK;
        self.chunks
            .push(domain.alloc(self.size * SLOTS_PER_CHUNK, Access::LOCAL_WRITE)?);
        self.free.extend((base + 1..base + SLOTS_PER_CHUNK).rev());
        Ok(base)
    }

    fn at(&self, slot: usize) -> (&MemoryRegion, usize) {
        (
            &self.chunks[slot / SLOTS_PER_CHUNK],
            (slot % SLOTS_PER_CHUNK) * self.size,
        )
    }
}

#[derive(Debug)]
struct Inner {
    domain: Arc<AnyDomain>,
    domain_id: u64,
    cq: AnyCq,
    cfg: RdmConfig,
    name: Vec<u8>,
    max_chunk: u64,
    max_reads: u32,
    slot: usize,
    av: Vec<AvEntry>,
    by_addr: HashMap<(SocketAddr, u64), u32>,
    /// Keys below 2^43: a receive's context carries its connection's key above the
    /// buffer's index (20 bits) and under [`RECV_BIT`].
    conns: Slab<Conn, 20, 23>,
    cq_reserved: usize,
    /// Signaled requests on the connections' send queues, by their context (keys below
    /// 2^62: never [`RECV_BIT`] nor [`UNSIG_BIT`]).
    inflight: Slab<Inflight, 32, 30>,
    /// Operations in progress; their keys are the `op` of wire headers (a peer echoes them
    /// in acknowledgements and FINs) and [`RecvId`]s.
    ops: Slab<UserOp, 32, 31>,
    tagged: Matcher<Posted, Unexp>,
    untagged: Matcher<Posted, Unexp>,
    unexp_bytes: usize,
    claimed: IdMap<(u32, Unexp)>,
    slots: Slots,
    done: VecDeque<RdmCompletion>,
    /// The provider completions of one progress pass (kept to reuse its allocation).
    cq_batch: Vec<Completion>,
    /// A received wire message, read out of its receive slot (kept, as `cq_batch`).
    rx_buf: Vec<u8>,
    /// An eager payload on its way into a send slot (kept, as `cq_batch`).
    tx_buf: Vec<u8>,
}

/// A reliable datagram endpoint over any provider's connected endpoints (see the crate
/// documentation).
#[derive(Debug)]
pub struct RdmEndpoint {
    inner: Arc<Mutex<Inner>>,
    cq: AnyCq,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    addr: SocketAddr,
    nonce: u64,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RdmEndpoint {
    /// Opens an endpoint in `domain`: a completion queue, a listener at `cfg.bind` and the
    /// thread that accepts peers' connections (one per endpoint, whatever the number of
    /// peers).
    pub fn new(domain: Arc<AnyDomain>, mut cfg: RdmConfig) -> Result<Self> {
        let limits = domain.info().caps.limits;
        // No larger than the device's completion queues (rxe: 32767 entries).
        cfg.cq_capacity = cfg.cq_capacity.min(limits.max_cq_entries as usize);
        cfg.validate()?;
        let cq = domain.create_cq(cfg.cq_capacity)?;
        let listener = domain.listen(cfg.bind)?;
        let mut addr = listener.local_addr();
        if addr.ip().is_unspecified() {
            match cfg.advertise {
                Some(ip) => addr.set_ip(ip),
                None => {
                    return Err(Error::invalid(format!(
                        "bound to the wildcard address {addr}: set RdmConfig::advertise to the address peers reach"
                    )))
                }
            }
        }
        let nonce = new_nonce();
        let name = encode_name(addr, nonce);
        let pdata = private_data(cfg.recv_depth, &name);
        if pdata.len() > limits.max_private_data as usize {
            return Err(Error::unsupported(format!(
                "the provider carries {} bytes of private data, the rdm layer needs {}",
                limits.max_private_data,
                pdata.len()
            )));
        }
        let slot = round_up(HDR_LEN + cfg.eager_max, 64);
        let mut slots = Slots {
            size: slot,
            chunks: Vec::new(),
            free: Vec::new(),
        };
        let first = slots.get(&domain)?;
        slots.free.push(first);
        let domain_id = slots.chunks[0].to_ref().domain_id();
        let inner = Arc::new(Mutex::new(Inner {
            domain,
            domain_id,
            cq: cq.clone(),
            max_chunk: limits.max_msg_size.clamp(1, 1 << 30),
            max_reads: limits.max_outstanding_reads.max(1),
            slot,
            cfg: cfg.clone(),
            name,
            av: Vec::new(),
            by_addr: HashMap::new(),
            conns: Slab::new(),
            cq_reserved: 0,
            inflight: Slab::new(),
            ops: Slab::new(),
            tagged: Matcher::default(),
            untagged: Matcher::default(),
            unexp_bytes: 0,
            claimed: IdMap::default(),
            slots,
            done: VecDeque::new(),
            cq_batch: Vec::with_capacity(64),
            rx_buf: Vec::new(),
            tx_buf: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let (inner, stop, cq) = (inner.clone(), stop.clone(), cq.clone());
            std::thread::Builder::new()
                .name("rdm-accept".into())
                .spawn(move || accept_loop(listener, inner, cq, stop, pdata, cfg))
                .map_err(Error::from)?
        };
        Ok(RdmEndpoint {
            inner,
            cq,
            stop,
            acceptor: Some(acceptor),
            addr,
            nonce,
        })
    }

    /// The endpoint's name, to exchange out of band and insert with
    /// [`RdmEndpoint::av_insert_name`].
    pub fn name(&self) -> Vec<u8> {
        encode_name(self.addr, self.nonce)
    }

    /// The largest message sent eagerly ([`RdmConfig::eager_max`]); larger ones take the
    /// rendezvous protocol.
    pub fn eager_max(&self) -> usize {
        lock(&self.inner).cfg.eager_max
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Inserts a peer by the address of its endpoint (see [`RdmEndpoint::addr`]); inserting
    /// an address twice returns the same handle. The first connection learns which endpoint
    /// answers there; a later one at the same address is another peer.
    pub fn av_insert(&self, addr: SocketAddr) -> Peer {
        lock(&self.inner).av_insert(addr, 0)
    }

    /// Inserts a peer by its endpoint name: exactly that endpoint (an endpoint that took
    /// its address later is refused with `ConnectionRefused`).
    pub fn av_insert_name(&self, name: &[u8]) -> Result<Peer> {
        let (addr, nonce) = decode_full(name)?;
        Ok(lock(&self.inner).av_insert(addr, nonce))
    }

    /// Removes a peer: its connections close, operations addressed to it fail `Flushed`,
    /// and its handle is refused from now on.
    pub fn av_remove(&self, peer: Peer) -> Result<()> {
        let mut g = lock(&self.inner);
        let idx = g.check(peer)?;
        let conns: Vec<u64> = g
            .conns
            .iter()
            .filter(|(_, c)| c.peer == idx)
            .map(|(k, _)| k)
            .collect();
        for c in conns {
            g.conn_failed(c, ErrorKind::Flushed);
        }
        for p in g.tagged.take_posted_from(idx) {
            g.fail_op(p.op, ErrorKind::Flushed);
        }
        let e = &mut g.av[idx as usize];
        e.live = false;
        e.gen = e.gen.wrapping_add(1);
        let key = (e.addr, e.nonce);
        g.by_addr.remove(&key);
        Ok(())
    }

    /// The address of a peer.
    pub fn av_lookup(&self, peer: Peer) -> Result<SocketAddr> {
        let g = lock(&self.inner);
        let idx = g.check(peer)?;
        Ok(g.av[idx as usize].addr)
    }

    /// Runs `f` on the endpoint with a connection carrying messages to `peer`: under one
    /// lock when there is one, else after [`RdmEndpoint::ensure_conn`] made it.
    fn with_conn<R>(&self, peer: Peer, f: impl FnOnce(&mut Inner) -> Result<R>) -> Result<R> {
        {
            let mut g = lock(&self.inner);
            let idx = g.check(peer)?;
            if g.live_send_conn(idx).is_some() {
                return f(&mut g);
            }
        }
        self.ensure_conn(peer)?;
        f(&mut lock(&self.inner))
    }

    /// Connects to `peer` if no connection carries messages to it yet. The connection is
    /// made without holding the endpoint: other threads keep using it meanwhile.
    fn ensure_conn(&self, peer: Peer) -> Result<()> {
        let (domain, cq, addr, cfg, name) = {
            let mut g = lock(&self.inner);
            let idx = g.check(peer)?;
            if g.live_send_conn(idx).is_some() {
                return Ok(());
            }
            let cfg = g.cfg.clone();
            (
                g.domain.clone(),
                g.cq.clone(),
                g.av[idx as usize].addr,
                cfg,
                g.name.clone(),
            )
        };
        let pdata = private_data(cfg.recv_depth, &name);
        let mut ecfg = EndpointConfig::new(&cq);
        ecfg.sq_depth = cfg.sq_depth;
        ecfg.rq_depth = cfg.recv_depth;
        ecfg.private_data = &pdata;
        let ep = connect_retrying(cfg.connect_timeout, |left| {
            ecfg.timeout = left;
            domain.connect(addr, &ecfg)
        })?;
        let mut g = lock(&self.inner);
        match g.check(peer) {
            Ok(idx) if g.av[idx as usize].addr == addr => g.adopt(idx, addr, ep).map(|_| ()),
            Ok(_) | Err(_) => {
                let _ = ep.close();
                g.check(peer).map(|_| ())
            }
        }
    }

    /// Sends an untagged message; `buf` may be reused once the send completes.
    pub fn send(&self, peer: Peer, buf: Slice<'_>, context: u64) -> Result<()> {
        self.with_conn(peer, |g| g.send(peer, None, buf, context, false))
    }

    /// Sends a tagged message.
    pub fn tsend(&self, peer: Peer, tag: u64, buf: Slice<'_>, context: u64) -> Result<()> {
        self.with_conn(peer, |g| g.send(peer, Some(tag), buf, context, false))
    }

    /// Sends a tagged message that completes only once a receive at the target matched it.
    pub fn tsend_sync(&self, peer: Peer, tag: u64, buf: Slice<'_>, context: u64) -> Result<()> {
        self.with_conn(peer, |g| g.send(peer, Some(tag), buf, context, true))
    }

    /// Posts an untagged receive (from any peer).
    pub fn recv(&self, buf: RecvBuf, context: u64) -> Result<RecvId> {
        let spec = Spec {
            src: Src::Any,
            tag: 0,
            ignore: 0,
        };
        lock(&self.inner).post_recv(false, spec, buf, None, context)
    }

    /// Posts a multi-receive buffer for untagged messages: each message lands after the
    /// previous one and completes with its offset; once less than `min_free` bytes are
    /// left the buffer completes `Released`.
    pub fn recv_multi(&self, buf: RecvBuf, min_free: usize, context: u64) -> Result<RecvId> {
        if min_free == 0 || min_free > buf.len {
            return Err(Error::invalid(format!(
                "min_free {min_free} must be in 1..={} (the buffer's length)",
                buf.len
            )));
        }
        let spec = Spec {
            src: Src::Any,
            tag: 0,
            ignore: 0,
        };
        lock(&self.inner).post_recv(false, spec, buf, Some(min_free), context)
    }

    /// Posts a tagged receive: a message from `src` whose tag equals `tag` on every bit not
    /// set in `ignore`.
    pub fn trecv(
        &self,
        src: Source,
        tag: u64,
        ignore: u64,
        buf: RecvBuf,
        context: u64,
    ) -> Result<RecvId> {
        let mut g = lock(&self.inner);
        let src = g.src(src)?;
        g.post_recv(true, Spec { src, tag, ignore }, buf, None, context)
    }

    /// Cancels a posted receive: it completes `Canceled` and `true` is returned; `false`
    /// when it already matched a message (its completion comes as usual).
    pub fn cancel(&self, id: RecvId) -> Result<bool> {
        let mut g = lock(&self.inner);
        let Some((tagged, seq)) = g.ops.get_mut(&id.0).and_then(|o| o.posted.take()) else {
            return Ok(false);
        };
        let m = if tagged {
            &mut g.tagged
        } else {
            &mut g.untagged
        };
        match m.take_posted(seq) {
            Some(p) => {
                if let Some(op) = g.ops.get_mut(&p.op) {
                    op.status = RdmStatus::Canceled;
                    op.waiting = 0;
                }
                g.finish(p.op);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Reports whether a tagged message matching (`src`, `tag`, `ignore`) has arrived,
    /// without receiving it.
    pub fn probe(&self, src: Source, tag: u64, ignore: u64) -> Result<Option<ProbeInfo>> {
        let mut g = lock(&self.inner);
        g.progress()?;
        let src = g.src(src)?;
        let found = g.tagged.find_unexpected(&Spec { src, tag, ignore });
        Ok(found.and_then(|a| {
            let (s, t, u) = g.tagged.unexpected(a)?;
            Some(ProbeInfo {
                peer: g.handle(s),
                tag: t,
                len: u.hdr.len,
            })
        }))
    }

    /// Like [`RdmEndpoint::probe`], and takes the message: only
    /// [`RdmEndpoint::recv_claimed`] can receive it.
    pub fn probe_claim(
        &self,
        src: Source,
        tag: u64,
        ignore: u64,
    ) -> Result<Option<(ProbeInfo, Claimed)>> {
        let mut g = lock(&self.inner);
        g.progress()?;
        let src = g.src(src)?;
        let Some(a) = g.tagged.find_unexpected(&Spec { src, tag, ignore }) else {
            return Ok(None);
        };
        let (s, t, u) = g.tagged.take_unexpected(a).expect("found");
        let info = ProbeInfo {
            peer: g.handle(s),
            tag: t,
            len: u.hdr.len,
        };
        g.claimed.insert(a, (s, u));
        Ok(Some((info, Claimed(a))))
    }

    /// Receives a claimed message into `buf`.
    pub fn recv_claimed(&self, claimed: Claimed, buf: RecvBuf, context: u64) -> Result<()> {
        let mut g = lock(&self.inner);
        g.check_buf(&buf)?;
        let (src, u) = g
            .claimed
            .remove(&claimed.0)
            .ok_or_else(|| Error::invalid("claimed message already received"))?;
        let op = g.new_op(context, RdmOp::TaggedRecv, Some(src), u.hdr.tag, 1);
        g.consume_unexpected(op, src, u, buf, 0);
        Ok(())
    }

    /// RDMA Write of `src` to `remote` at `peer`.
    pub fn write(
        &self,
        peer: Peer,
        src: &[Slice<'_>],
        remote: RemoteAddr,
        context: u64,
    ) -> Result<()> {
        self.with_conn(peer, |g| {
            g.rma(peer, RdmOp::Write, context, |wr| {
                SendWr::write(wr, src, remote)
            })
        })
    }

    /// RDMA Read from `remote` at `peer` into `dst`.
    pub fn read(
        &self,
        peer: Peer,
        dst: &[Slice<'_>],
        remote: RemoteAddr,
        context: u64,
    ) -> Result<()> {
        self.ensure_conn(peer)?;
        lock(&self.inner).rma(peer, RdmOp::Read, context, |wr| {
            SendWr::read(wr, dst, remote)
        })
    }

    /// Fetch-and-add at `remote` on `peer`; the old value lands in `result`.
    pub fn fetch_add(
        &self,
        peer: Peer,
        result: Slice<'_>,
        remote: RemoteAddr,
        add: u64,
        context: u64,
    ) -> Result<()> {
        self.ensure_conn(peer)?;
        lock(&self.inner).rma(peer, RdmOp::FetchAdd, context, |wr| {
            SendWr::fetch_add(wr, result, remote, add)
        })
    }

    /// Compare-and-swap at `remote` on `peer`; the old value lands in `result`.
    pub fn compare_swap(
        &self,
        peer: Peer,
        result: Slice<'_>,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
        context: u64,
    ) -> Result<()> {
        self.ensure_conn(peer)?;
        lock(&self.inner).rma(peer, RdmOp::CompareSwap, context, |wr| {
            SendWr::compare_swap(wr, result, remote, compare, swap)
        })
    }

    /// Makes progress: reaps the provider's completions, matches arrivals, moves queued
    /// messages as credits allow. [`RdmEndpoint::poll`] and [`RdmEndpoint::wait`] call it.
    pub fn progress(&self) -> Result<()> {
        lock(&self.inner).progress()
    }

    /// Moves completions into `out` (after making progress); returns how many.
    pub fn poll(&self, out: &mut Vec<RdmCompletion>) -> Result<usize> {
        let mut g = lock(&self.inner);
        g.progress()?;
        let n = g.done.len();
        // Two block copies, not an element-by-element drain (measured: the drain was a
        // twentieth of the layer's instructions per message in an 8-byte ping-pong).
        let (a, b) = g.done.as_slices();
        out.extend_from_slice(a);
        out.extend_from_slice(b);
        g.done.clear();
        Ok(n)
    }

    /// Makes progress until a completion is ready or `timeout` passes; returns whether one
    /// is ready. Sleeps in the provider's completion queue, not in a spin.
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        let start = Instant::now();
        let deadline = start + timeout;
        loop {
            let spin = {
                let mut g = lock(&self.inner);
                g.progress()?;
                if !g.done.is_empty() {
                    return Ok(true);
                }
                g.cfg.busy_poll
            };
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                return Ok(false);
            }
            if now < start + spin {
                std::thread::yield_now();
                continue;
            }
            self.cq.wait(left.min(Duration::from_millis(20)))?;
        }
    }

    /// Makes progress until every message already handed to the provider has been sent
    /// and every acknowledgement and credit return owed to a peer went out, or `timeout`
    /// passes; returns whether it got there. An eager send completes once its payload is
    /// copied: call this (dropping the endpoint does) before the process exits, so that
    /// the last messages are not lost with the connections.
    pub fn flush(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut g = lock(&self.inner);
                g.progress()?;
                // Unsignaled sends that nothing signaled follows would never be seen to
                // complete: a credit message (signaled, whatever it returns) covers them.
                let bare: Vec<u64> = g
                    .conns
                    .iter()
                    .filter(|(_, c)| {
                        c.uncovered > 0
                            && !c.quiet
                            && !c.ctrl.iter().any(|h| h.kind == Kind::Credit)
                    })
                    .map(|(k, _)| k)
                    .collect();
                for id in bare {
                    let c = g.conns.get_mut(&id).expect("listed");
                    c.ctrl.push_back(Header::new(Kind::Credit));
                    g.flush(id);
                }
                let sending = g
                    .inflight
                    .values()
                    .any(|f| matches!(f, Inflight::Wire { .. }))
                    || g.conns.values().any(|c| !c.unsig.is_empty());
                let owed = g.conns.values().any(|c| !c.ctrl.is_empty());
                if !sending && !owed {
                    return Ok(true);
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            self.cq.wait(left.min(Duration::from_millis(5)))?;
        }
    }

    /// Closes gracefully: [`RdmEndpoint::flush`], then tells every connected peer and
    /// waits (up to `timeout` in all) until each has answered that it will send nothing
    /// more, so that closing loses nothing still on its way (a TCP stream closed with
    /// unread data is reset, and the reset can discard what the peer had not read yet).
    /// Returns whether every peer answered. Dropping the endpoint does this with
    /// [`RdmConfig::linger`]; the connections close when it is dropped.
    pub fn close(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        if !self.flush(timeout)? {
            return Ok(false);
        }
        {
            let mut g = lock(&self.inner);
            let ids: Vec<u64> = g.conns.keys().collect();
            for id in ids {
                let c = g.conns.get_mut(&id).expect("listed");
                if !c.quiet && !c.bye_sent {
                    c.bye_sent = true;
                    c.ctrl.push_back(Header::new(Kind::Bye));
                    g.flush(id);
                }
            }
        }
        loop {
            {
                let mut g = lock(&self.inner);
                g.progress()?;
                if g.conns.values().all(|c| c.quiet || c.bye_acked) {
                    return Ok(true);
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            self.cq.wait(left.min(Duration::from_millis(5)))?;
        }
    }

    /// Waits for the next completion, up to `timeout` (`TimedOut` after it).
    pub fn next_completion(&self, timeout: Duration) -> Result<RdmCompletion> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(c) = lock(&self.inner).done.pop_front() {
                return Ok(c);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if !self.wait(left)? {
                return Err(Error::new(
                    ErrorKind::TimedOut,
                    format!("no rdm completion within {timeout:?}"),
                ));
            }
        }
    }

    /// What the endpoint holds now: connections, unexpected messages and their storage,
    /// posted receives, operations in progress.
    pub fn stats(&self) -> RdmStats {
        let g = lock(&self.inner);
        RdmStats {
            connections: g.conns.len(),
            unexpected: g.tagged.unexpected_len() + g.untagged.unexpected_len(),
            unexpected_bytes: g.unexp_bytes,
            posted: g.tagged.posted_len() + g.untagged.posted_len(),
            ops: g.ops.len(),
            bounce_chunks: g.slots.chunks.len(),
        }
    }
}

/// What an endpoint holds (see [`RdmEndpoint::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmStats {
    /// Live connections.
    pub connections: usize,
    /// Unexpected messages kept.
    pub unexpected: usize,
    /// Bytes of unexpected storage (payloads plus bookkeeping).
    pub unexpected_bytes: usize,
    /// Posted receives.
    pub posted: usize,
    /// Operations not yet completed.
    pub ops: usize,
    /// Chunks of send bounce buffers allocated (64 each).
    pub bounce_chunks: usize,
}

impl Drop for RdmEndpoint {
    /// Closes gracefully within [`RdmConfig::linger`] ([`RdmEndpoint::close`]), then closes
    /// every connection.
    fn drop(&mut self) {
        let linger = lock(&self.inner).cfg.linger;
        let _ = self.close(linger);
        fabric::sync::atomic_only(&*self.stop); // publishes nothing: the join orders
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        let mut g = lock(&self.inner);
        for c in g.conns.values() {
            let _ = c.ep.close();
        }
        g.conns.clear();
    }
}

/// The first pause before a connect is tried again ([`connect_retrying`]).
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(10);
/// The longest pause between two connect attempts.
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(500);

/// Runs `connect`, given the time left of `timeout`, until it succeeds, fails for good, or
/// the time runs out. A failure of kind `Io` or `TimedOut` while time is left is tried again
/// after a pause ([`RETRY_PAUSE_MIN`], doubling up to [`RETRY_PAUSE_MAX`]): siw gives up on
/// a connection whose MPA request has had no reply within its own 5 s (`MPAREP_TIMEOUT`,
/// an rdma_cm connect error), which a listener slow to accept a burst of on-demand
/// connections causes (seen with 64 peers connecting at once in the soft-RDMA guest under
/// load), and which a later attempt does not meet. A refusal (nobody listens), bad
/// arguments and every other error end it at once.
fn connect_retrying<T>(
    timeout: Duration,
    mut connect: impl FnMut(Duration) -> Result<T>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut pause = RETRY_PAUSE_MIN;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match connect(left) {
            Err(e)
                if matches!(e.kind(), ErrorKind::Io | ErrorKind::TimedOut)
                    && Instant::now() + pause < deadline =>
            {
                tracing::debug!(target: "fabric_rdm", "connect failed, again in {pause:?}: {e}");
                std::thread::sleep(pause);
                pause = (pause * 2).min(RETRY_PAUSE_MAX);
            }
            r => return r,
        }
    }
}

fn accept_loop(
    listener: AnyListener,
    inner: Arc<Mutex<Inner>>,
    cq: AnyCq,
    stop: Arc<AtomicBool>,
    pdata: Vec<u8>,
    cfg: RdmConfig,
) {
    let mut ecfg = EndpointConfig::new(&cq);
    ecfg.sq_depth = cfg.sq_depth;
    ecfg.rq_depth = cfg.recv_depth;
    ecfg.private_data = &pdata;
    ecfg.timeout = cfg.connect_timeout;
    while !stop.load(Ordering::Acquire) {
        match listener.accept(&ecfg, Duration::from_millis(100)) {
            Ok(ep) => {
                let mut g = lock(&inner);
                match parse_private(&ep.peer_private_data()) {
                    Ok((depth, addr, nonce)) => {
                        let idx = g.av_accepted(addr, nonce);
                        if let Err(e) = g.install(ep, idx, depth, false) {
                            tracing::warn!(target: "fabric_rdm", "accepted connection from {addr} dropped: {e}");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(target: "fabric_rdm", "refusing a connection: {e}");
                        let _ = ep.close();
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::TimedOut => {}
            Err(e) => {
                tracing::debug!(target: "fabric_rdm", "accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

impl Inner {
    /// The peer a connection from endpoint (`addr`, `nonce`) comes from: its entry, else
    /// an entry inserted by address whose endpoint is not known yet, else a new entry.
    fn av_accepted(&mut self, addr: SocketAddr, nonce: u64) -> u32 {
        if let Some(&i) = self.by_addr.get(&(addr, nonce)) {
            return i;
        }
        if let Some(i) = self.by_addr.remove(&(addr, 0)) {
            self.av[i as usize].nonce = nonce;
            self.by_addr.insert((addr, nonce), i);
            return i;
        }
        self.av_insert(addr, nonce).idx
    }

    fn av_insert(&mut self, addr: SocketAddr, nonce: u64) -> Peer {
        if let Some(&i) = self.by_addr.get(&(addr, nonce)) {
            return Peer {
                idx: i,
                gen: self.av[i as usize].gen,
            };
        }
        let idx = match self.av.iter().position(|e| !e.live) {
            Some(i) => {
                let e = &mut self.av[i];
                e.addr = addr;
                e.nonce = nonce;
                e.live = true;
                e.send_conn = None;
                i
            }
            None => {
                self.av.push(AvEntry {
                    addr,
                    nonce,
                    gen: 0,
                    live: true,
                    send_conn: None,
                });
                self.av.len() - 1
            }
        } as u32;
        self.by_addr.insert((addr, nonce), idx);
        Peer {
            idx,
            gen: self.av[idx as usize].gen,
        }
    }

    fn check(&self, p: Peer) -> Result<u32> {
        match self.av.get(p.idx as usize) {
            Some(e) if e.live && e.gen == p.gen => Ok(p.idx),
            _ => Err(Error::invalid(format!(
                "peer handle {p:?} is not in the address vector (removed or never inserted)"
            ))),
        }
    }

    fn handle(&self, idx: u32) -> Option<Peer> {
        self.av
            .get(idx as usize)
            .filter(|e| e.live)
            .map(|e| Peer { idx, gen: e.gen })
    }

    fn src(&self, s: Source) -> Result<Src> {
        Ok(match s {
            Source::Any => Src::Any,
            Source::Peer(p) => Src::Peer(self.check(p)?),
        })
    }

    fn check_buf(&self, b: &RecvBuf) -> Result<()> {
        let r = b.region.to_ref();
        if r.domain_id() != self.domain_id {
            return Err(Error::new(
                ErrorKind::LocalProtection,
                "receive buffer registered in another domain than the rdm endpoint's",
            ));
        }
        if !b.region.access().contains(Access::LOCAL_WRITE) {
            return Err(Error::new(
                ErrorKind::LocalProtection,
                "receive buffer needs LOCAL_WRITE",
            ));
        }
        let end = b
            .offset
            .checked_add(b.len)
            .ok_or_else(|| Error::invalid("receive buffer offset + length overflows"))?;
        b.region.slice(b.offset..end)?;
        Ok(())
    }

    fn new_op(
        &mut self,
        context: u64,
        op: RdmOp,
        peer: Option<u32>,
        tag: u64,
        waiting: u32,
    ) -> u64 {
        self.ops
            .insert(UserOp::new(context, op, peer, tag, waiting))
    }

    /// Keeps request `f` in flight under `id`, the [`Slab::vacant_key`] it was posted with.
    fn inflight_keep(&mut self, id: u64, f: Inflight) {
        let kept = self.inflight.insert(f);
        debug_assert_eq!(
            kept, id,
            "a request kept under another key than it was posted with"
        );
    }

    /// One awaited event of `op` happened.
    fn step(&mut self, op: u64) {
        if let Some(o) = self.ops.get_mut(&op) {
            o.waiting = o.waiting.saturating_sub(1);
            if o.waiting == 0 {
                self.finish(op);
            }
        }
    }

    fn fail_op(&mut self, op: u64, kind: ErrorKind) {
        if let Some(o) = self.ops.get_mut(&op) {
            o.status = RdmStatus::Error(kind);
            o.waiting = 0;
            self.finish(op);
        }
    }

    fn finish(&mut self, op: u64) {
        if let Some(o) = self.ops.remove(&op) {
            self.complete(o);
        }
    }

    /// Queues the completion of a finished operation.
    fn complete(&mut self, o: UserOp) {
        let peer = o.peer.and_then(|i| self.handle(i));
        self.done.push_back(RdmCompletion {
            context: o.context,
            op: o.op,
            status: o.status,
            peer,
            tag: o.tag,
            len: o.len,
            msg_len: o.msg_len,
            offset: o.offset,
        });
    }

    fn per_conn(&self) -> usize {
        (self.cfg.sq_depth + self.cfg.recv_depth) as usize
    }

    /// Installs connection `ep` to peer `idx`, which granted `credits`, and posts its
    /// receive buffers; `settled`: see [`Conn::settled`].
    fn install(&mut self, ep: AnyEndpoint, idx: u32, credits: u32, settled: bool) -> Result<u64> {
        if self.cq_reserved + self.per_conn() > self.cfg.cq_capacity {
            let _ = ep.close();
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!(
                    "{} connections fill cq_capacity {}; raise RdmConfig::cq_capacity",
                    self.conns.len(),
                    self.cfg.cq_capacity
                ),
            ));
        }
        let depth = self.cfg.recv_depth as usize;
        let recv = match self.domain.alloc(depth * self.slot, Access::LOCAL_WRITE) {
            Ok(r) => r,
            Err(e) => {
                let _ = ep.close();
                return Err(e);
            }
        };
        // Kept before its receives are posted, so that their contexts name it; a failure
        // removes it again, and the completions of those receives then find nothing.
        let id = self.conns.insert(Conn {
            ep,
            peer: idx,
            credits,
            to_return: 0,
            sq_inflight: 0,
            reads_inflight: 0,
            recv,
            ctrl: VecDeque::new(),
            data: VecDeque::new(),
            reads: VecDeque::new(),
            unsig: VecDeque::new(),
            uncovered: 0,
            quiet: false,
            bye_sent: false,
            bye_acked: false,
            settled,
        });
        let c = self.conns.get(&id).expect("just kept");
        for i in 0..depth {
            let posted = c
                .recv
                .slice(i * self.slot..(i + 1) * self.slot)
                .and_then(|s| {
                    c.ep.post_recv(&RecvWr::new(RECV_BIT | id << 20 | i as u64, &[s]))
                });
            if let Err(e) = posted {
                let c = self.conns.remove(&id).expect("just kept");
                let _ = c.ep.close();
                return Err(e);
            }
        }
        self.cq_reserved += self.per_conn();
        let e = &mut self.av[idx as usize];
        if e.send_conn.is_none() {
            e.send_conn = Some(id);
        }
        Ok(id)
    }

    /// The connection that carries messages to peer `idx`, if one can. Not an unsettled
    /// one ([`Conn::settled`]) whose endpoint is no longer connected and that holds nothing
    /// of ours: that one is let go here (`conn_failed`; no completion need have reported
    /// the loss yet), and what is about to be posted goes over another connection to the
    /// peer, or a new one, instead of failing `Flushed` to a live peer. The case: a peer
    /// connects to our address looking for the endpoint that held it before us, we accept,
    /// and it closes the connection on reading our name (`adopt`), with no `Bye`; our next
    /// message to it was posted on that connection and failed
    /// (`rdm.endpoint_in_a_reused_address_is_another_peer` on iwarp, where the loss showed
    /// only at that post: 5 runs in 292 in the soft-RDMA guest, 0 in 329 since). One with
    /// requests of ours still queued or in flight stays as it is: they fail with it, as
    /// before.
    fn live_send_conn(&mut self, idx: u32) -> Option<u64> {
        let id = self.av[idx as usize].send_conn?;
        let c = self.conns.get(&id)?;
        // A settled connection's loss shows in its completions: its endpoint (a lock in each
        // provider) is not asked on every send.
        if c.settled || c.ep.state() == EndpointState::Connected {
            return Some(id);
        }
        let idle = c.sq_inflight == 0
            && c.reads_inflight == 0
            && c.unsig.is_empty()
            && c.ctrl.is_empty()
            && c.data.is_empty()
            && c.reads.is_empty();
        if !idle {
            return Some(id);
        }
        self.conn_failed(id, ErrorKind::Flushed);
        // Another connection to the peer (one it made to us meanwhile), if any, carries our
        // messages now; else the caller makes one.
        let other = self
            .conns
            .iter()
            .find(|(_, x)| x.peer == idx && x.ep.state() == EndpointState::Connected)
            .map(|(k, _)| k);
        self.av[idx as usize].send_conn = other;
        other
    }

    /// The connection messages to peer `idx` go over, made now if there is none.
    fn conn_for(&mut self, idx: u32) -> Result<u64> {
        if let Some(c) = self.av[idx as usize].send_conn {
            if self.conns.contains_key(&c) {
                return Ok(c);
            }
        }
        if self.cq_reserved + self.per_conn() > self.cfg.cq_capacity {
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!(
                    "{} connections fill cq_capacity {}; raise RdmConfig::cq_capacity",
                    self.conns.len(),
                    self.cfg.cq_capacity
                ),
            ));
        }
        let pdata = private_data(self.cfg.recv_depth, &self.name);
        let mut ecfg = EndpointConfig::new(&self.cq);
        ecfg.sq_depth = self.cfg.sq_depth;
        ecfg.rq_depth = self.cfg.recv_depth;
        ecfg.private_data = &pdata;
        ecfg.timeout = self.cfg.connect_timeout;
        let addr = self.av[idx as usize].addr;
        let ep = self.domain.connect(addr, &ecfg)?;
        self.adopt(idx, addr, ep)
    }

    /// Installs `ep`, just connected to `addr` for peer `idx`, as the peer's sending
    /// connection, once its private data shows it reached the endpoint inserted.
    fn adopt(&mut self, idx: u32, addr: SocketAddr, ep: AnyEndpoint) -> Result<u64> {
        let (depth, _, nonce) = match parse_private(&ep.peer_private_data()) {
            Ok(p) => p,
            Err(e) => {
                let _ = ep.close();
                return Err(e);
            }
        };
        let known = self.av[idx as usize].nonce;
        if known == 0 {
            if !self.by_addr.contains_key(&(addr, nonce)) {
                self.by_addr.remove(&(addr, 0));
                self.by_addr.insert((addr, nonce), idx);
                self.av[idx as usize].nonce = nonce;
            }
        } else if known != nonce {
            let _ = ep.close();
            return Err(Error::new(
                ErrorKind::ConnectionRefused,
                format!("the endpoint at {addr} is not the one inserted (it went away and another took its address)"),
            ));
        }
        // Only when no other connection carries messages to the peer yet (one may have been
        // accepted meanwhile): one connection per direction keeps messages in order.
        self.install(ep, idx, depth, true)
    }

    fn send(
        &mut self,
        peer: Peer,
        tag: Option<u64>,
        buf: Slice<'_>,
        context: u64,
        sync: bool,
    ) -> Result<()> {
        let idx = self.check(peer)?;
        let conn = self.conn_for(idx)?;
        let len = buf.len();
        let mut hdr = Header::new(Kind::Eager);
        hdr.tag = tag.unwrap_or(0);
        hdr.len = len as u64;
        if tag.is_some() {
            hdr.flags |= F_TAGGED;
        }
        if sync {
            hdr.flags |= F_SYNC;
        }
        let kind = if tag.is_some() {
            RdmOp::TaggedSend
        } else {
            RdmOp::Send
        };
        let mut staging = None;
        let payload = if len <= self.cfg.eager_max {
            Some((buf.region().to_ref(), buf.offset(), len))
        } else {
            hdr.kind = Kind::Rts;
            let r = buf.region();
            let readable = r.to_ref().domain_id() == self.domain_id
                && r.access().contains(Access::REMOTE_READ);
            let desc = if readable {
                let d = r.desc();
                (d.addr + buf.offset() as u64, d.key)
            } else {
                // The peer cannot read this region: stage a registered copy.
                let s = self
                    .domain
                    .alloc(len, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
                s.buffer().write(0, &r.buffer().to_vec(buf.offset(), len));
                let d = s.desc();
                staging = Some(s);
                (d.addr, d.key)
            };
            hdr.addr = desc.0;
            hdr.key = desc.1;
            None
        };
        // Local completion, plus the acknowledgement (sync eager) or the FIN (rendezvous).
        let waiting = 1 + u32::from(sync || hdr.kind == Kind::Rts);
        if waiting == 1 && self.sends_now(conn) {
            // An eager send that leaves at once (nothing queued before it, credits and
            // send-queue room): complete when its payload is copied out, as `flush` would,
            // without an entry in `ops`. A failure is its error completion.
            let mut o = UserOp::new(context, kind, Some(idx), hdr.tag, 0);
            (o.len, o.msg_len) = (len as u64, len as u64);
            if let Err(e) = self.send_wire(conn, hdr, payload, None) {
                o.status = RdmStatus::Error(e.kind());
            }
            self.complete(o);
            return Ok(());
        }
        let op = self.new_op(context, kind, Some(idx), hdr.tag, waiting);
        hdr.op = op;
        let o = self.ops.get_mut(&op).expect("new op");
        o.len = len as u64;
        o.msg_len = len as u64;
        o.staging = staging;
        if waiting > 1 {
            o.conn = Some(conn);
        }
        self.conns
            .get_mut(&conn)
            .expect("conn")
            .data
            .push_back(PendingData { hdr, payload, op });
        self.flush(conn);
        Ok(())
    }

    fn post_recv(
        &mut self,
        tagged: bool,
        spec: Spec,
        buf: RecvBuf,
        multi: Option<usize>,
        context: u64,
    ) -> Result<RecvId> {
        self.check_buf(&buf)?;
        let kind = match (tagged, multi) {
            (true, _) => RdmOp::TaggedRecv,
            (false, None) => RdmOp::Recv,
            (false, Some(_)) => RdmOp::MultiRecv,
        };
        let op = self.new_op(context, kind, None, spec.tag, 1);
        let mut posted = Posted {
            op,
            buf,
            multi: multi.map(|m| (0, m)),
        };
        // Unexpected messages first, oldest first.
        loop {
            let m = if tagged {
                &mut self.tagged
            } else {
                &mut self.untagged
            };
            let Some(a) = m.find_unexpected(&spec) else {
                break;
            };
            let (src, _, u) = m.take_unexpected(a).expect("found");
            match posted.multi {
                None => {
                    self.consume_unexpected(op, src, u, posted.buf, 0);
                    return Ok(RecvId(op));
                }
                Some((used, min_free)) => {
                    let mop = self.multi_op(op, src, used);
                    let n = (u.hdr.len as usize).min(posted.buf.len - used);
                    self.consume_unexpected(mop, src, u, posted.buf.clone(), used);
                    let used = used + n;
                    posted.multi = Some((used, min_free));
                    if posted.buf.len - used < min_free {
                        self.release_multi(op);
                        return Ok(RecvId(op));
                    }
                }
            }
        }
        let m = if tagged {
            &mut self.tagged
        } else {
            &mut self.untagged
        };
        let seq = m.post(spec, posted);
        self.ops.get_mut(&op).expect("new").posted = Some((tagged, seq));
        Ok(RecvId(op))
    }

    /// A fresh operation for one message placed in multi-receive `parent` at `offset`.
    fn multi_op(&mut self, parent: u64, src: u32, offset: usize) -> u64 {
        let context = self.ops.get(&parent).map_or(0, |o| o.context);
        let op = self.new_op(context, RdmOp::MultiRecv, Some(src), 0, 1);
        self.ops.get_mut(&op).expect("new").offset = offset as u64;
        op
    }

    fn release_multi(&mut self, parent: u64) {
        if let Some(o) = self.ops.get_mut(&parent) {
            o.status = RdmStatus::Released;
            o.waiting = 0;
        }
        self.finish(parent);
    }

    /// Receives unexpected message `u` (from `src`) into `buf` at `at` for `op`, and
    /// releases its storage (and its withheld credit).
    fn consume_unexpected(&mut self, op: u64, src: u32, u: Unexp, buf: RecvBuf, at: usize) {
        self.unexp_bytes -= u.cost;
        if u.withheld {
            if let Some(c) = self.conns.get_mut(&u.conn) {
                c.to_return += 1;
            }
        }
        self.place(op, src, u.conn, u.hdr, &u.data, buf, at);
        if self.conns.contains_key(&u.conn) {
            self.flush(u.conn);
        }
    }

    /// Places a matched message into `buf` at `at`: copies an eager payload, or starts the
    /// rendezvous reads.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        op: u64,
        src: u32,
        conn: u64,
        hdr: Header,
        data: &[u8],
        buf: RecvBuf,
        at: usize,
    ) {
        let room = buf.len - at;
        let n = (hdr.len as usize).min(room);
        let fill = |o: &mut UserOp| {
            o.peer = Some(src);
            o.tag = hdr.tag;
            o.len = n as u64;
            o.msg_len = hdr.len;
            if hdr.len as usize > room {
                o.status = RdmStatus::Error(ErrorKind::LocalLength);
            }
        };
        match hdr.kind {
            Kind::Eager => {
                buf.region.buffer().write(buf.offset + at, &data[..n]);
                if hdr.flags & F_SYNC != 0 {
                    self.queue_ctrl(conn, Kind::Ack, hdr.op);
                }
                if let Some(o) = self.ops.get_mut(&op) {
                    fill(o);
                }
                self.step(op);
            }
            _ => {
                if let Some(o) = self.ops.get_mut(&op) {
                    fill(o);
                }
                if !self.conns.contains_key(&conn) {
                    self.fail_op(op, ErrorKind::Flushed);
                    return;
                }
                if let Some(o) = self.ops.get_mut(&op) {
                    o.conn = Some(conn);
                }
                let c = self.conns.get_mut(&conn).expect("conn");
                c.reads.push_back(PendingRead {
                    op,
                    sender_op: hdr.op,
                    buf,
                    at,
                    len: n,
                    addr: hdr.addr,
                    key: hdr.key,
                });
                self.flush(conn);
            }
        }
    }

    fn queue_ctrl(&mut self, conn: u64, kind: Kind, op: u64) {
        if let Some(c) = self.conns.get_mut(&conn) {
            let mut h = Header::new(kind);
            h.op = op;
            c.ctrl.push_back(h);
            self.flush(conn);
        }
    }

    fn rma<'a>(
        &mut self,
        peer: Peer,
        kind: RdmOp,
        context: u64,
        wr: impl FnOnce(u64) -> SendWr<'a>,
    ) -> Result<()> {
        let idx = self.check(peer)?;
        let conn = self.conn_for(idx)?;
        let c = self.conns.get_mut(&conn).expect("conn");
        if c.sq_inflight >= self.cfg.sq_depth {
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!("{} operations outstanding to this peer", c.sq_inflight),
            ));
        }
        let op = self.new_op(context, kind, Some(idx), 0, 1);
        // The request's context: its key once kept (below, after a successful post).
        let id = self.inflight.vacant_key();
        let c = self.conns.get_mut(&conn).expect("conn");
        match c.ep.post_send(&wr(id)) {
            Ok(()) => {
                c.sq_inflight += 1;
                self.inflight_keep(id, Inflight::Rma { conn, op });
                Ok(())
            }
            Err(e) => {
                self.ops.remove(&op);
                if c.ep.state() != EndpointState::Connected {
                    self.conn_failed(conn, ErrorKind::Flushed);
                }
                Err(e)
            }
        }
    }

    /// Whether a data message for `conn` would leave at once: `flush` has nothing to send
    /// before it, and the credits and send-queue room to send it.
    fn sends_now(&self, conn: u64) -> bool {
        self.conns.get(&conn).is_some_and(|c| {
            !c.quiet
                && c.ctrl.is_empty()
                && c.reads.is_empty()
                && c.data.is_empty()
                && c.credits > RESERVE
                && c.sq_inflight < self.cfg.sq_depth
        })
    }

    /// Posts what the connection's credits and queue room allow: control messages first,
    /// then rendezvous reads, then data in order.
    fn flush(&mut self, conn: u64) {
        loop {
            let threshold = (self.cfg.recv_depth / 4).max(2);
            let Some(c) = self.conns.get_mut(&conn) else {
                return;
            };
            if c.quiet {
                return;
            }
            if c.to_return >= threshold && !c.ctrl.iter().any(|h| h.kind == Kind::Credit) {
                c.ctrl.push_back(Header::new(Kind::Credit));
            }
            if c.sq_inflight >= self.cfg.sq_depth {
                return;
            }
            if let Some(h) = c.ctrl.front() {
                let need = match h.kind {
                    Kind::Credit | Kind::Bye | Kind::ByeAck => 1,
                    _ => 2,
                };
                if h.kind == Kind::Credit && c.to_return == 0 && c.uncovered == 0 {
                    c.ctrl.pop_front();
                    continue;
                }
                if c.credits >= need {
                    let h = c.ctrl.pop_front().expect("front");
                    let kind = h.kind;
                    if self.send_wire(conn, h, None, None).is_err() {
                        return;
                    }
                    if kind == Kind::ByeAck {
                        if let Some(c) = self.conns.get_mut(&conn) {
                            c.quiet = true;
                        }
                        return;
                    }
                    continue;
                }
            }
            let c = self.conns.get_mut(&conn).expect("conn");
            if !c.reads.is_empty() && c.reads_inflight < self.max_reads {
                let r = c.reads.pop_front().expect("front");
                self.post_read(conn, r);
                continue;
            }
            let c = self.conns.get_mut(&conn).expect("conn");
            if c.credits > RESERVE && !c.data.is_empty() {
                let d = c.data.pop_front().expect("front");
                let _ = self.send_wire(conn, d.hdr, d.payload, Some(d.op));
                continue;
            }
            return;
        }
    }

    fn post_read(&mut self, conn: u64, mut r: PendingRead) {
        let chunk = (r.len - r.at.min(r.len)).min(self.max_chunk as usize);
        if r.len == 0 {
            self.queue_ctrl(conn, Kind::Fin, r.sender_op);
            self.step(r.op);
            return;
        }
        let start = r.buf.offset + r.at;
        let slice = match r.buf.region.slice(start..start + chunk) {
            Ok(s) => s,
            Err(e) => {
                self.fail_op(r.op, e.kind());
                return;
            }
        };
        // The request's context: its key once kept (below, after a successful post).
        let id = self.inflight.vacant_key();
        let remote = RemoteAddr {
            addr: r.addr + r.at as u64,
            key: r.key,
        };
        let c = self.conns.get_mut(&conn).expect("conn");
        match c.ep.post_send(&SendWr::read(id, &[slice], remote)) {
            Ok(()) => {
                c.sq_inflight += 1;
                c.reads_inflight += 1;
                let last = r.at + chunk >= r.len;
                self.inflight_keep(
                    id,
                    Inflight::Read {
                        conn,
                        op: r.op,
                        sender_op: if last { r.sender_op } else { 0 },
                    },
                );
                if !last {
                    if let Some(o) = self.ops.get_mut(&r.op) {
                        o.waiting += 1;
                    }
                    r.at += chunk;
                    let c = self.conns.get_mut(&conn).expect("conn");
                    c.reads.push_front(r);
                }
            }
            Err(e) => {
                self.fail_op(r.op, e.kind());
                self.conn_failed(conn, ErrorKind::Flushed);
            }
        }
    }

    fn send_wire(
        &mut self,
        conn: u64,
        mut hdr: Header,
        payload: Option<(RegionRef, usize, usize)>,
        op: Option<u64>,
    ) -> Result<()> {
        let slot = match self.slots.get(&self.domain) {
            Ok(s) => s,
            Err(e) => {
                if let Some(op) = op {
                    self.fail_op(op, e.kind());
                }
                return Err(e);
            }
        };
        let c = self.conns.get_mut(&conn).expect("conn");
        let give = c.to_return.min(u16::MAX as u32);
        hdr.credits = give as u16;
        let (region, off) = self.slots.at(slot);
        // Header and payload go into the slot with one copy, through a buffer kept
        // between messages (no allocation per message).
        let tmp = &mut self.tx_buf;
        tmp.clear();
        tmp.extend_from_slice(&hdr.encode());
        let plen = match &payload {
            Some((r, o, n)) => {
                tmp.resize(HDR_LEN + *n, 0);
                r.buffer().read(*o, &mut tmp[HDR_LEN..]);
                *n
            }
            None => 0,
        };
        region.buffer().write(off, tmp);
        // An eager payload goes unsignaled, in runs shorter than `every`: its completion would
        // only free its slot, which the next signaled request's completion does as well.
        // Control messages and rendezvous requests are signaled: they are rarer, and one
        // of them covers the unsignaled sends before it when the data stops
        // (`RdmEndpoint::flush`).
        let every = (self.cfg.sq_depth / 2).clamp(1, SIGNAL_EVERY);
        let signaled = payload.is_none() || c.uncovered + 1 >= every;
        // The request's context: its key once kept (below, after a successful post).
        let id = if signaled {
            self.inflight.vacant_key()
        } else {
            UNSIG_BIT | conn
        };
        let s = region
            .slice(off..off + HDR_LEN + plen)
            .expect("slot in range");
        let sgl = [s];
        let wr = SendWr::send(id, &sgl);
        let wr = if signaled { wr } else { wr.unsignaled() };
        match c.ep.post_send(&wr) {
            Ok(()) => {
                c.to_return -= give;
                c.credits -= 1;
                c.sq_inflight += 1;
                if signaled {
                    let covers = std::mem::take(&mut c.uncovered);
                    self.inflight_keep(id, Inflight::Wire { conn, slot, covers });
                } else {
                    c.unsig.push_back(slot);
                    c.uncovered += 1;
                }
                // The payload is copied: the buffer may be reused. What the operation still
                // awaits (an acknowledgement, a FIN) fails with the connection.
                if let Some(op) = op {
                    self.step(op);
                }
                Ok(())
            }
            Err(e) => {
                self.slots.free.push(slot);
                if let Some(op) = op {
                    self.fail_op(op, e.kind());
                }
                self.conn_failed(conn, ErrorKind::Flushed);
                Err(e)
            }
        }
    }

    fn progress(&mut self) -> Result<()> {
        // The batch vector is kept between passes: a poll that finds nothing (a spinning
        // caller's usual pass) allocates nothing.
        let mut out = std::mem::take(&mut self.cq_batch);
        let r = loop {
            out.clear();
            let n = match self.cq.poll(&mut out, 64) {
                Ok(n) => n,
                Err(e) => break Err(e),
            };
            for c in out.drain(..) {
                self.on_completion(c);
            }
            if n < 64 {
                break Ok(());
            }
        };
        self.cq_batch = out;
        r
    }

    fn on_completion(&mut self, c: Completion) {
        if c.context & RECV_BIT != 0 {
            let conn = (c.context & !RECV_BIT) >> 20;
            let idx = (c.context & ((1 << 20) - 1)) as usize;
            return self.handle_recv(conn, idx, c);
        }
        if c.context & UNSIG_BIT != 0 {
            // An unsignaled send completes only in error; its slot is freed with the
            // connection's.
            if let Status::Error(k) = c.status {
                self.conn_failed(c.context & !UNSIG_BIT, k);
            }
            return;
        }
        let Some(f) = self.inflight.remove(&c.context) else {
            return;
        };
        let kind = match c.status {
            Status::Success => None,
            Status::Error(k) => Some(k),
        };
        match f {
            Inflight::Wire { conn, slot, covers } => {
                self.slots.free.push(slot);
                if let Some(k) = kind {
                    return self.conn_failed(conn, k);
                }
                if let Some(cn) = self.conns.get_mut(&conn) {
                    cn.sq_inflight -= 1 + covers;
                    let n = covers as usize;
                    debug_assert!(n <= cn.unsig.len(), "covers more than was unsignaled");
                    self.slots
                        .free
                        .extend(cn.unsig.drain(..n.min(cn.unsig.len())));
                }
                self.flush(conn);
            }
            Inflight::Rma { conn, op } => {
                if let Some(cn) = self.conns.get_mut(&conn) {
                    cn.sq_inflight -= 1;
                }
                match kind {
                    None => {
                        if let Some(o) = self.ops.get_mut(&op) {
                            o.len = c.byte_len;
                        }
                        self.step(op);
                    }
                    Some(k) => {
                        self.fail_op(op, k);
                        self.conn_failed(conn, k);
                    }
                }
                self.flush(conn);
            }
            Inflight::Read {
                conn,
                op,
                sender_op,
            } => {
                if let Some(cn) = self.conns.get_mut(&conn) {
                    cn.sq_inflight -= 1;
                    cn.reads_inflight -= 1;
                }
                match kind {
                    None => {
                        if sender_op != 0 {
                            self.queue_ctrl(conn, Kind::Fin, sender_op);
                        }
                        self.step(op);
                    }
                    Some(k) => {
                        self.fail_op(op, k);
                        self.conn_failed(conn, k);
                    }
                }
                self.flush(conn);
            }
        }
    }

    fn handle_recv(&mut self, conn: u64, idx: usize, c: Completion) {
        let slot = self.slot;
        let Some(cn) = self.conns.get_mut(&conn) else {
            return;
        };
        if let Status::Error(k) = c.status {
            return self.conn_failed(conn, k);
        }
        cn.settled = true;
        // Read out of the receive slot into a buffer kept between messages (an error path
        // drops it: the next message allocates a new one).
        let mut bytes = std::mem::take(&mut self.rx_buf);
        bytes.resize(c.byte_len as usize, 0);
        cn.recv.buffer().read(idx * slot, &mut bytes);
        let hdr = match Header::decode(&bytes) {
            Ok(h) if h.kind != Kind::Eager || bytes.len() == HDR_LEN + h.len as usize => h,
            Ok(h) => {
                tracing::warn!(target: "fabric_rdm", "eager message of {} bytes says {}", bytes.len(), h.len);
                return self.conn_failed(conn, ErrorKind::Protocol);
            }
            Err(e) => {
                tracing::warn!(target: "fabric_rdm", "{e}");
                return self.conn_failed(conn, ErrorKind::Protocol);
            }
        };
        cn.credits += u32::from(hdr.credits);
        let peer = cn.peer;
        // The buffer is free again at once: the payload was copied out.
        let s = cn
            .recv
            .slice(idx * slot..(idx + 1) * slot)
            .expect("in range");
        if let Err(e) = cn.ep.post_recv(&RecvWr::new(c.context, &[s])) {
            tracing::debug!(target: "fabric_rdm", "reposting a receive: {e}");
            return self.conn_failed(conn, ErrorKind::Flushed);
        }
        match hdr.kind {
            Kind::Credit => {
                cn.to_return += 1;
            }
            Kind::Bye => {
                // The peer is closing: answer, then leave this connection alone (messages
                // to the peer connect again, and fail if it is gone).
                cn.to_return += 1;
                cn.ctrl.push_back(Header::new(Kind::ByeAck));
                if self.av[peer as usize].send_conn == Some(conn) {
                    self.av[peer as usize].send_conn = None;
                }
            }
            Kind::ByeAck => {
                cn.bye_acked = true;
            }
            Kind::Ack | Kind::Fin => {
                cn.to_return += 1;
                let theirs = self.ops.get(&hdr.op).is_some_and(|o| o.peer == Some(peer));
                if theirs {
                    if hdr.kind == Kind::Fin {
                        if let Some(o) = self.ops.get_mut(&hdr.op) {
                            o.staging = None;
                        }
                    }
                    self.step(hdr.op);
                }
            }
            Kind::Eager | Kind::Rts => {
                self.arrive(conn, peer, hdr, &bytes[HDR_LEN..]);
            }
        }
        self.rx_buf = bytes;
        self.flush(conn);
    }

    /// A message (eager payload, or none for a rendezvous) arrived: placed into the first
    /// matching posted receive, else kept (copied) as unexpected.
    fn arrive(&mut self, conn: u64, peer: u32, hdr: Header, data: &[u8]) {
        let tagged = hdr.flags & F_TAGGED != 0;
        let tag = if tagged { hdr.tag } else { 0 };
        let m = if tagged {
            &mut self.tagged
        } else {
            &mut self.untagged
        };
        if let Some(seq) = m.find_posted(peer, tag) {
            self.conns.get_mut(&conn).expect("conn").to_return += 1;
            let multi = m.posted_mut(seq).and_then(|p| p.multi);
            match multi {
                None => {
                    let p = m.take_posted(seq).expect("found");
                    self.place(p.op, peer, conn, hdr, data, p.buf, 0);
                }
                Some((used, min_free)) => {
                    let p = m.posted_mut(seq).expect("found");
                    let buf = p.buf.clone();
                    let parent = p.op;
                    let n = (hdr.len as usize).min(buf.len - used);
                    p.multi = Some((used + n, min_free));
                    let released = buf.len - used - n < min_free;
                    if released {
                        m.take_posted(seq);
                    }
                    let op = self.multi_op(parent, peer, used);
                    self.place(op, peer, conn, hdr, data, buf, used);
                    if released {
                        self.release_multi(parent);
                    }
                }
            }
            return;
        }
        let cost = data.len() + HDR_LEN + 64;
        let withheld = self.unexp_bytes + cost > self.cfg.max_unexpected_bytes;
        self.unexp_bytes += cost;
        if !withheld {
            self.conns.get_mut(&conn).expect("conn").to_return += 1;
        }
        m.push_unexpected(
            peer,
            tag,
            Unexp {
                conn,
                hdr,
                data: data.to_vec(),
                withheld,
                cost,
            },
        );
    }

    /// A connection failed (or closed): everything in flight or queued on it fails with
    /// `kind`; so do receives naming its peer when no other connection to the peer is left.
    fn conn_failed(&mut self, conn: u64, kind: ErrorKind) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        tracing::debug!(target: "fabric_rdm", "connection {conn} to {} failed: {kind}", self.av[c.peer as usize].addr);
        let _ = c.ep.close();
        self.cq_reserved -= self.per_conn();
        if self.av[c.peer as usize].send_conn == Some(conn) {
            self.av[c.peer as usize].send_conn = None;
        }
        let ids: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, f)| match f {
                Inflight::Wire { conn: x, .. }
                | Inflight::Rma { conn: x, .. }
                | Inflight::Read { conn: x, .. } => *x == conn,
            })
            .map(|(k, _)| k)
            .collect();
        for id in ids {
            match self.inflight.remove(&id).expect("listed") {
                Inflight::Wire { slot, .. } => self.slots.free.push(slot),
                Inflight::Rma { op, .. } | Inflight::Read { op, .. } => self.fail_op(op, kind),
            }
        }
        self.slots.free.extend(c.unsig);
        for d in c.data {
            self.fail_op(d.op, kind);
        }
        for r in c.reads {
            self.fail_op(r.op, kind);
        }
        let waiting: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, o)| o.conn == Some(conn))
            .map(|(k, _)| k)
            .collect();
        for op in waiting {
            self.fail_op(op, kind);
        }
        let peer = c.peer;
        if !self.conns.values().any(|x| x.peer == peer) {
            for p in self.tagged.take_posted_from(peer) {
                self.fail_op(p.op, kind);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connect_that_fails_transiently_is_tried_again_within_its_timeout() {
        let mut calls = Vec::new();
        let got = connect_retrying(Duration::from_secs(5), |left| {
            calls.push(left);
            match calls.len() {
                1 => Err(Error::new(ErrorKind::Io, "connect error, status -22")),
                2 => Err(Error::new(ErrorKind::TimedOut, "no MPA reply")),
                _ => Ok(7),
            }
        });
        assert_eq!(got.expect("the third attempt connects"), 7);
        assert_eq!(calls.len(), 3);
        // Each attempt gets what is left of the one timeout, not a fresh one.
        assert!(calls[0] <= Duration::from_secs(5));
        assert!(calls[1] < calls[0] && calls[2] < calls[1], "{calls:?}");
    }

    #[test]
    fn a_refused_or_invalid_connect_is_not_tried_again() {
        for kind in [ErrorKind::ConnectionRefused, ErrorKind::InvalidArgument] {
            let mut calls = 0;
            let got: Result<()> = connect_retrying(Duration::from_secs(5), |_| {
                calls += 1;
                Err(Error::new(kind, "no"))
            });
            assert_eq!(got.expect_err("fails").kind(), kind);
            assert_eq!(calls, 1, "{kind:?}");
        }
    }

    #[test]
    fn retrying_a_connect_stops_at_its_timeout() {
        let start = Instant::now();
        let mut calls = 0;
        let got: Result<()> = connect_retrying(Duration::from_millis(100), |left| {
            calls += 1;
            assert!(left <= Duration::from_millis(100));
            Err(Error::new(ErrorKind::TimedOut, "unreachable"))
        });
        assert_eq!(got.expect_err("fails").kind(), ErrorKind::TimedOut);
        assert!(calls >= 2, "tried {calls} times");
        // No pause starts that would end after the timeout.
        assert!(start.elapsed() < Duration::from_millis(100) + RETRY_PAUSE_MIN * 10);
    }

    #[test]
    fn names_round_trip_and_garbage_is_refused() {
        for a in ["127.0.0.1:7000", "[::1]:65535"] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(decode_full(&encode_name(a, 77)).unwrap(), (a, 77));
            assert_eq!(decode_name(&encode_name(a, 77)).unwrap(), a);
            assert!(
                decode_full(&encode_name(a, 0)).is_err(),
                "nonce 0 means unknown"
            );
        }
        assert_eq!(
            decode_name(b"hello").unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let (d, a, n) = parse_private(&private_data(
            16,
            &encode_name("10.0.0.1:5".parse().unwrap(), 9),
        ))
        .unwrap();
        assert_eq!((d, a, n), (16, "10.0.0.1:5".parse().unwrap(), 9));
        assert!(parse_private(b"X").is_err());
    }

    #[test]
    fn bad_configuration_is_refused() {
        let c = RdmConfig {
            recv_depth: 2,
            ..RdmConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().kind(), ErrorKind::InvalidArgument);
        let c = RdmConfig {
            eager_max: 64 << 20,
            ..RdmConfig::default()
        };
        assert!(c.validate().is_err());
        assert!(RdmConfig::default().validate().is_ok());
    }
}
