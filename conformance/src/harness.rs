//! Running cases: provider availability, the unsupported check, timeouts, and the helpers
//! cases are written with.

use fabric::sync::mpsc;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric::{discover, Availability, ProviderInfo, Selector};

use crate::report::CaseResult;

/// Result of a case body: `Err` carries the failure message.
pub type CaseResultOf = Result<(), String>;

/// One case of the suite.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// Stable name (`section.what`).
    pub name: &'static str,
    /// Section of the contract (docs/contract.md).
    pub section: &'static str,
    /// Operations the case needs; when the provider's capabilities lack them the case
    /// checks that posting returns Unsupported and reports `unsupported`.
    pub needs: OpSet,
    /// The body.
    pub run: fn(&Ctx) -> CaseResultOf,
}

/// A case's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The provider behaves as the contract says.
    Pass,
    /// It does not, or the case could not complete; the message says what went wrong.
    Fail(String),
    /// The provider declares the needed operation unsupported, and posting it said so.
    Unsupported(String),
    /// The provider could not run here (no device, not built), with the reason.
    NoDevice(String),
}

impl Outcome {
    /// The report name of the outcome.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Fail(_) => "fail",
            Outcome::Unsupported(_) => "unsupported",
            Outcome::NoDevice(_) => "no-device",
        }
    }
}

/// What a case runs against.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// Report label: the provider's name, or `initiator>target` for a mixed pair.
    pub provider: String,
    /// Provider of the connecting side, and of domains a case opens on its own.
    pub initiator: String,
    /// Provider of the listening side: targets of one-sided operations, peer processes.
    pub target: String,
    /// The `fabric` executable used to start peer processes.
    pub peer_exe: Option<PathBuf>,
    /// Address to listen on (`FABRIC_CONFORMANCE_ADDR`, default 127.0.0.1).
    pub bind: IpAddr,
    /// How long any single wait may take before the case fails.
    pub timeout: Duration,
}

fn bind_addr(provider: &str) -> IpAddr {
    let guest = match provider {
        "roce" => Some("FABRIC_SOFT_RDMA_RXE_ADDR"),
        "iwarp" => Some("FABRIC_SOFT_RDMA_SIW_ADDR"),
        _ => None,
    };
    [
        Some(format!(
            "FABRIC_CONFORMANCE_ADDR_{}",
            provider.to_uppercase()
        )),
        Some("FABRIC_CONFORMANCE_ADDR".into()),
        guest.map(Into::into),
    ]
    .into_iter()
    .flatten()
    .find_map(|var| std::env::var(var).ok().and_then(|a| a.parse().ok()))
    .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Environment variable prefix: `FABRIC_CONFORMANCE_WIRE_<PROVIDER>=A,B` names two local
/// addresses of that provider whose traffic to each other crosses the network stack (see
/// [`Wire`]).
pub const ENV_WIRE_PREFIX: &str = "FABRIC_CONFORMANCE_WIRE_";

/// Two addresses of one provider whose traffic to each other crosses the network stack,
/// for cases whose peer must be another host as far as the packets go
/// (`fault.silent_peer_host` drops the peer's packets with nftables). Two queue pairs of one
/// soft-RoCE device talk through rxe's in-kernel loopback, which no packet filter sees; the
/// soft-RDMA guest (`scripts/soft-rdma`) has rxe1 and rxe2 on the two ends of a veth pair
/// for this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wire {
    /// The initiating side's address (its domain is opened on the device holding it).
    pub initiator: IpAddr,
    /// The target side's address: the peer host, where the target's domain is opened and
    /// listens.
    pub target: IpAddr,
    /// Where the addresses came from (environment variable names), for reports.
    pub source: String,
}

/// The wire configured for `provider`: `FABRIC_CONFORMANCE_WIRE_<PROVIDER>=A,B`, else, for
/// roce, the soft-RDMA guest's `FABRIC_SOFT_RDMA_RXE_WIRE_ADDR` and
/// `FABRIC_SOFT_RDMA_RXE_WIRE_PEER_ADDR`; `Ok(None)` when none is, an error when one is
/// malformed.
pub fn wire_of(provider: &str) -> Result<Option<Wire>, String> {
    wire_from(provider, |var| std::env::var(var).ok())
}

/// [`wire_of`] with the variables read through `get`.
fn wire_from(provider: &str, get: impl Fn(&str) -> Option<String>) -> Result<Option<Wire>, String> {
    let parse = |var: &str, text: &str| {
        text.trim()
            .parse::<IpAddr>()
            .map_err(|e| format!("{var}: {text:?} is not an IP address: {e}"))
    };
    let var = format!("{ENV_WIRE_PREFIX}{}", provider.to_uppercase());
    if let Some(v) = get(&var) {
        let (a, b) = v
            .split_once(',')
            .ok_or_else(|| format!("{var}={v:?}: expected INITIATOR_ADDR,TARGET_ADDR"))?;
        return Ok(Some(Wire {
            initiator: parse(&var, a)?,
            target: parse(&var, b)?,
            source: var,
        }));
    }
    if provider != "roce" {
        return Ok(None);
    }
    const A: &str = "FABRIC_SOFT_RDMA_RXE_WIRE_ADDR";
    const B: &str = "FABRIC_SOFT_RDMA_RXE_WIRE_PEER_ADDR";
    match (get(A), get(B)) {
        (Some(a), Some(b)) => Ok(Some(Wire {
            initiator: parse(A, &a)?,
            target: parse(B, &b)?,
            source: format!("{A}, {B}"),
        })),
        _ => Ok(None),
    }
}

fn provider_info(name: &str) -> ProviderInfo {
    discover()
        .into_iter()
        .find(|p| p.name == name)
        .expect("known provider")
}

/// Opens a domain on `name` with the provider options of the environment's configuration
/// (`FABRIC_CONFIG`), so the suite tests what applications get.
fn open_domain(name: &str) -> Result<AnyDomain, String> {
    open_domain_at(name, None)
}

/// [`open_domain`] on the device holding `addr` (the `address` key of the provider's
/// section; tcp has none: its endpoints take their address from the listener and the
/// route).
fn open_domain_at(name: &str, addr: Option<IpAddr>) -> Result<AnyDomain, String> {
    let at = addr.map_or(String::new(), |a| format!(" at {a}"));
    Selector::from_env()
        .and_then(|s| match addr {
            Some(a) if name != "tcp" => s.config_str(&format!("[{name}]\naddress = \"{a}\"\n")),
            _ => Ok(s),
        })
        .and_then(|s| s.providers(name))
        .and_then(|s| s.open())
        .map(|(d, _)| d)
        .map_err(|e| format!("opening a {name} domain{at}: {e}"))
}

thread_local! {
    static NOTE: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Records what a passing case observed (timings, counts, the bound it was held to): it
/// becomes the case's `detail` in the report when the case passes. Cases that measure
/// (the fault cases) call it so that reports carry the observation, not only the verdict.
pub fn note(text: impl Into<String>) {
    NOTE.with(|n| *n.borrow_mut() = Some(text.into()));
}

/// Per-case time limit at the default timeout (see [`case_limit`]).
pub const CASE_LIMIT: Duration = Duration::from_secs(90);

/// How much slower than native a run with this timeout says it is: the timeout over its
/// default of 10 s, at least 1 (valgrind runs set [`ENV_TIMEOUT`] to 60: 6x).
fn slowdown(timeout: Duration) -> u32 {
    (timeout.as_secs() / 10).clamp(1, 360) as u32
}

/// The per-case time limit: [`CASE_LIMIT`], scaled by the run's slowdown (a raised
/// [`ENV_TIMEOUT`]), so a case that needs 30 s natively is not called a hang under valgrind.
pub fn case_limit() -> Duration {
    CASE_LIMIT * slowdown(default_timeout())
}

impl Ctx {
    /// A context for `provider`. The address its endpoints listen on comes from
    /// `FABRIC_CONFORMANCE_ADDR_<PROVIDER>`, else `FABRIC_CONFORMANCE_ADDR`, else the
    /// soft-RDMA guest's address for that provider (`FABRIC_SOFT_RDMA_RXE_ADDR` for roce,
    /// `FABRIC_SOFT_RDMA_SIW_ADDR` for iwarp), else 127.0.0.1.
    pub fn new(provider: &str, peer_exe: Option<PathBuf>) -> Self {
        Self::mixed(provider, provider, peer_exe)
    }

    /// A context whose connecting side runs `initiator` and whose listening side runs
    /// `target` (interoperability between providers, e.g. tcp against iwarp over siw). Both
    /// listen on the address of whichever side is not tcp.
    pub fn mixed(initiator: &str, target: &str, peer_exe: Option<PathBuf>) -> Self {
        let provider = if initiator == target {
            initiator.to_string()
        } else {
            format!("{initiator}>{target}")
        };
        let addr_of = if target != "tcp" { target } else { initiator };
        Ctx {
            provider,
            initiator: initiator.to_string(),
            target: target.to_string(),
            peer_exe,
            bind: bind_addr(addr_of),
            timeout: default_timeout(),
        }
    }

    /// Parses a report label: `tcp`, or `tcp>iwarp` for a mixed pair.
    pub fn from_label(label: &str, peer_exe: Option<PathBuf>) -> Self {
        match label.split_once('>') {
            Some((i, t)) => Self::mixed(i.trim(), t.trim(), peer_exe),
            None => Self::new(label.trim(), peer_exe),
        }
    }

    /// True when the two sides run different providers.
    pub fn is_mixed(&self) -> bool {
        self.initiator != self.target
    }

    /// The initiating provider's discovery entry.
    pub fn info(&self) -> ProviderInfo {
        provider_info(&self.initiator)
    }

    /// The target provider's discovery entry.
    pub fn target_info(&self) -> ProviderInfo {
        provider_info(&self.target)
    }

    /// A fresh domain on the initiating provider.
    pub fn domain(&self) -> Result<AnyDomain, String> {
        open_domain(&self.initiator)
    }

    /// A fresh domain on the target provider.
    pub fn target_domain(&self) -> Result<AnyDomain, String> {
        open_domain(&self.target)
    }

    /// Address with port 0 for listening.
    pub fn any_port(&self) -> SocketAddr {
        SocketAddr::new(self.bind, 0)
    }

    /// Two endpoints connected to each other, each in its own domain, with default options.
    pub fn pair(&self) -> Result<Pair, String> {
        self.pair_with(PairOpts::default())
    }

    /// The wire configured for this context's provider ([`wire_of`]); `None` for a mixed
    /// pair, whose two providers cannot share one.
    pub fn wire(&self) -> Result<Option<Wire>, String> {
        if self.is_mixed() {
            return Ok(None);
        }
        wire_of(&self.provider)
    }

    /// Two endpoints connected across `wire`: the connecting one in a domain on the
    /// initiator's address, the accepting one in a domain on the target's address,
    /// listening there; default options.
    pub fn wire_pair(&self, wire: &Wire) -> Result<Pair, String> {
        let da = open_domain_at(&self.initiator, Some(wire.initiator))?;
        let db = open_domain_at(&self.target, Some(wire.target))?;
        self.pair_in(da, db, wire.target, PairOpts::default())
    }

    /// Two connected endpoints with `opts`.
    pub fn pair_with(&self, opts: PairOpts) -> Result<Pair, String> {
        self.pair_in(self.domain()?, self.target_domain()?, self.bind, opts)
    }

    /// Two connected endpoints, `a` in `da` connecting to a listener of `db` on `listen`.
    fn pair_in(
        &self,
        da: AnyDomain,
        db: AnyDomain,
        listen: IpAddr,
        opts: PairOpts,
    ) -> Result<Pair, String> {
        let cqa = da
            .create_cq(opts.cq_capacity)
            .map_err(|e| format!("create_cq: {e}"))?;
        let cqb = db
            .create_cq(opts.cq_capacity)
            .map_err(|e| format!("create_cq: {e}"))?;
        let listener = db
            .listen(SocketAddr::new(listen, 0))
            .map_err(|e| format!("listen: {e}"))?;
        let mut cfg_a = EndpointConfig::new(&cqa);
        cfg_a.sq_depth = opts.sq_depth;
        cfg_a.rq_depth = opts.rq_depth;
        cfg_a.private_data = &opts.private_a;
        cfg_a.ep_context = opts.ep_context_a;
        cfg_a.max_sge = opts.max_sge;
        cfg_a.max_inline = opts.max_inline;
        let mut cfg_b = EndpointConfig::new(&cqb);
        cfg_b.sq_depth = opts.sq_depth;
        cfg_b.rq_depth = opts.rq_depth;
        cfg_b.private_data = &opts.private_b;
        cfg_b.ep_context = opts.ep_context_b;
        cfg_b.max_sge = opts.max_sge;
        cfg_b.max_inline = opts.max_inline;
        let (a, b) = connect_accept(&listener, &da, &cfg_a, &cfg_b, self.timeout)?;
        Ok(Pair {
            da,
            db,
            cqa,
            cqb,
            a,
            b,
        })
    }

    /// A server domain listening, with no client yet (see [`Star::connect`]).
    pub fn listening(&self) -> Result<Star, String> {
        let server = self.target_domain()?;
        let server_cq = server
            .create_cq(1024)
            .map_err(|e| format!("create_cq: {e}"))?;
        let listener = server
            .listen(self.any_port())
            .map_err(|e| format!("listen: {e}"))?;
        Ok(Star {
            server,
            server_cq,
            listener,
            clients: Vec::new(),
            accepted: Vec::new(),
        })
    }

    /// `n` clients, each in its own domain, connected to one listener of one server domain.
    pub fn star(&self, n: usize) -> Result<Star, String> {
        let mut star = self.listening()?;
        star.connect(self, n)?;
        Ok(star)
    }

    /// A native duration scaled by the run's slowdown like the timeout: a bound on how
    /// quickly something must happen (a non-blocking call: a blocking one still misses it by
    /// seconds), or a window in which something is given the time to happen before the case
    /// looks. Under valgrind, which runs code tens of times slower, both are longer.
    pub fn slack(&self, native: Duration) -> Duration {
        native * slowdown(self.timeout)
    }

    /// Starts a peer process (see [`crate::peer`]) and connects to it.
    pub fn peer(&self, args: &[&str]) -> Result<crate::peer::PeerProcess, String> {
        crate::peer::PeerProcess::start(self, args)
    }
}

/// Environment variable: seconds a case waits for a completion, a state or a connection
/// (default 10). Raise it for runs under valgrind or in an emulated guest, which are many
/// times slower; a failure still names what it waited for.
pub const ENV_TIMEOUT: &str = "FABRIC_CONFORMANCE_TIMEOUT_SECS";

fn default_timeout() -> Duration {
    let secs = std::env::var(ENV_TIMEOUT)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| (1..=3600).contains(s))
        .unwrap_or(10);
    Duration::from_secs(secs)
}

/// Options of [`Ctx::pair_with`].
#[derive(Debug, Clone)]
pub struct PairOpts {
    /// Send queue depth.
    pub sq_depth: u32,
    /// Receive queue depth.
    pub rq_depth: u32,
    /// Completion queue capacity (each side).
    pub cq_capacity: usize,
    /// Private data from the connecting side.
    pub private_a: Vec<u8>,
    /// Private data from the accepting side.
    pub private_b: Vec<u8>,
    /// `ep_context` of the connecting side's endpoint.
    pub ep_context_a: u64,
    /// `ep_context` of the accepting side's endpoint.
    pub ep_context_b: u64,
    /// Both endpoints' gather/scatter limit (`None`: the domain's).
    pub max_sge: Option<u32>,
    /// Both endpoints' inline limit (`None`: the domain's).
    pub max_inline: Option<u32>,
}

impl Default for PairOpts {
    fn default() -> Self {
        PairOpts {
            sq_depth: 128,
            rq_depth: 128,
            cq_capacity: 512,
            private_a: Vec::new(),
            private_b: Vec::new(),
            ep_context_a: 0,
            ep_context_b: 0,
            max_sge: None,
            max_inline: None,
        }
    }
}

/// Two connected endpoints: `a` connected, `b` accepted.
#[derive(Debug)]
pub struct Pair {
    /// Domain of `a`.
    pub da: AnyDomain,
    /// Domain of `b`.
    pub db: AnyDomain,
    /// Completion queue of `a` (send and receive).
    pub cqa: AnyCq,
    /// Completion queue of `b`.
    pub cqb: AnyCq,
    /// The connecting endpoint.
    pub a: AnyEndpoint,
    /// The accepting endpoint.
    pub b: AnyEndpoint,
}

/// How long one `accept` call of [`connect_accept`] waits before it looks at the connect.
const ACCEPT_SLICE: Duration = Duration::from_millis(100);

/// Connects `client` to `listener` and accepts it, concurrently; returns (connected, accepted).
fn connect_accept(
    listener: &AnyListener,
    client: &AnyDomain,
    client_cfg: &EndpointConfig<'_, AnyCq>,
    server_cfg: &EndpointConfig<'_, AnyCq>,
    timeout: Duration,
) -> Result<(AnyEndpoint, AnyEndpoint), String> {
    let addr = listener.local_addr();
    let connect_failed = AtomicBool::new(false);
    let (c, s) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let r = client.connect(addr, client_cfg);
            fabric::sync::atomic_only(&connect_failed); // publishes nothing: the join orders
            connect_failed.store(r.is_err(), Ordering::Release);
            r
        });
        // Accept in slices, so that a connect refused at once (bad private data, nobody
        // listening) ends the wait instead of costing the whole timeout.
        let deadline = Instant::now() + timeout;
        let accepted = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match listener.accept(server_cfg, left.min(ACCEPT_SLICE)) {
                Err(e)
                    if e.kind() == ErrorKind::TimedOut
                        && !left.is_zero()
                        && !connect_failed.load(Ordering::Acquire) => {}
                Err(e) if e.kind() == ErrorKind::TimedOut => {
                    break Err(fabric::Error::new(
                        ErrorKind::TimedOut,
                        format!("no connection request within {timeout:?}"),
                    ))
                }
                r => break r,
            }
        };
        (h.join().expect("connect thread"), accepted)
    });
    Ok((
        c.map_err(|e| format!("connect: {e}"))?,
        s.map_err(|e| format!("accept: {e}"))?,
    ))
}

/// One client of a [`Star`].
#[derive(Debug)]
pub struct Client {
    /// The client's own domain.
    pub domain: AnyDomain,
    /// Its completion queue.
    pub cq: AnyCq,
    /// Its endpoint, connected to the server.
    pub ep: AnyEndpoint,
}

/// Many clients connected to one listener of one server domain.
#[derive(Debug)]
pub struct Star {
    /// The server's domain.
    pub server: AnyDomain,
    /// The server's completion queue (all accepted endpoints).
    pub server_cq: AnyCq,
    /// The listener.
    pub listener: AnyListener,
    /// The clients, in connection order.
    pub clients: Vec<Client>,
    /// The server's endpoints, `accepted[i]` connected to `clients[i]`.
    pub accepted: Vec<AnyEndpoint>,
}

impl Star {
    /// Connects `n` more clients, one after the other.
    pub fn connect(&mut self, ctx: &Ctx, n: usize) -> CaseResultOf {
        for i in 0..n {
            let domain = ctx.domain()?;
            let cq = domain
                .create_cq(512)
                .map_err(|e| format!("create_cq: {e}"))?;
            let server_cfg = EndpointConfig::new(&self.server_cq);
            let (ep, accepted) = connect_accept(
                &self.listener,
                &domain,
                &EndpointConfig::new(&cq),
                &server_cfg,
                ctx.timeout,
            )
            .map_err(|e| format!("client {i}: {e}"))?;
            self.accepted.push(accepted);
            self.clients.push(Client { domain, cq, ep });
        }
        Ok(())
    }
}

/// Registers `len` bytes with `access` in `d`.
pub fn region(d: &AnyDomain, len: usize, access: Access) -> Result<MemoryRegion, String> {
    d.register(Arc::new(Buffer::new(len)), access)
        .map_err(|e| format!("register {len} bytes {access:?}: {e}"))
}

/// All access rights.
pub fn all_access() -> Access {
    Access::all()
}

/// Waits up to `timeout` for the next completion.
pub fn next(cq: &AnyCq, timeout: Duration) -> Result<Completion, String> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(1);
    loop {
        if cq.poll(&mut out, 1).map_err(|e| format!("poll: {e}"))? == 1 {
            return Ok(out.pop().expect("one"));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no completion within {timeout:?}"));
        }
        cq.wait(left).map_err(|e| format!("wait: {e}"))?;
    }
}

/// Waits for a completion and checks its context, opcode and success.
pub fn expect_ok(cq: &AnyCq, context: u64, opcode: Opcode) -> Result<Completion, String> {
    let c = next(cq, Duration::from_secs(10))?;
    if c.context != context || c.opcode != opcode || c.status != Status::Success {
        return Err(format!(
            "expected {opcode:?} success for context {context}, got {c:?}"
        ));
    }
    Ok(c)
}

/// Waits for one successful completion per `(context, opcode)` in `want`, in any order
/// (send and receive completions on one queue are not ordered against each other: a
/// reply can complete before the send that caused it is confirmed). Returns them in
/// `want`'s order.
pub fn expect_ok_each(cq: &AnyCq, want: &[(u64, Opcode)]) -> Result<Vec<Completion>, String> {
    // Not `vec![None; n]`: in the optimised dev build, std's `from_elem` clones that `None`
    // with code that branches on bytes of it that were never written (its payload), which
    // memcheck reports (scripts/valgrind). Building each `None` afresh avoids the clone.
    let mut got: Vec<Option<Completion>> =
        std::iter::repeat_with(|| None).take(want.len()).collect();
    for _ in 0..want.len() {
        let c = next(cq, Duration::from_secs(10))?;
        let slot = want
            .iter()
            .zip(&got)
            .position(|(w, g)| g.is_none() && *w == (c.context, c.opcode));
        match slot {
            Some(i) if c.status == Status::Success => got[i] = Some(c),
            _ => return Err(format!("expected successes for {want:?}, got {c:?}")),
        }
    }
    Ok(got.into_iter().flatten().collect())
}

/// Waits for a completion and checks its context and error status.
pub fn expect_err(cq: &AnyCq, context: u64, kind: ErrorKind) -> Result<Completion, String> {
    let c = next(cq, Duration::from_secs(10))?;
    if c.context != context || c.status != Status::Error(kind) {
        return Err(format!("expected {kind} for context {context}, got {c:?}"));
    }
    Ok(c)
}

/// Checks that no completion arrives within `dur`.
pub fn expect_none(cq: &AnyCq, dur: Duration) -> CaseResultOf {
    let mut out = Vec::new();
    cq.wait(dur).map_err(|e| format!("wait: {e}"))?;
    if cq.poll(&mut out, 16).map_err(|e| format!("poll: {e}"))? > 0 {
        return Err(format!("unexpected completion(s): {out:?}"));
    }
    Ok(())
}

/// Whether `fd` becomes readable within `timeout` (zero: is it readable now).
pub fn readable(fd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> Result<bool, String> {
    fabric::notify::wait_readable(fd, timeout).map_err(|e| format!("poll: {e}"))
}

/// Waits until `ep` reaches `state`.
pub fn wait_state(ep: &AnyEndpoint, state: EndpointState, timeout: Duration) -> CaseResultOf {
    let deadline = Instant::now() + timeout;
    while ep.state() != state {
        if Instant::now() >= deadline {
            return Err(format!(
                "endpoint is {:?}, expected {state:?} within {timeout:?}",
                ep.state()
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Fails the case with a formatted message unless the condition holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// Unwraps a fabric result, failing the case with the context.
pub trait Ctxt<T> {
    /// Maps the error into a case failure naming `what`.
    fn ctx(self, what: &str) -> Result<T, String>;
}

impl<T> Ctxt<T> for fabric::Result<T> {
    fn ctx(self, what: &str) -> Result<T, String> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

/// Where a lack of operations was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lack {
    /// The providers' declared capabilities.
    Declared,
    /// The connection, after negotiation with the peer.
    Negotiated,
}

/// The outcome of a case needing `needs` where only `have` is provided: `unsupported`
/// once the lack is confirmed. Operations must be refused at post with `Unsupported`;
/// guarantees (which cannot be posted) rest on the declaration or negotiation alone.
fn unsupported(ctx: &Ctx, needs: OpSet, have: OpSet, lack: Lack) -> Outcome {
    let missing = needs - have;
    let reason = match lack {
        Lack::Declared => [ctx.info(), ctx.target_info()]
            .iter()
            .find_map(|i| {
                i.caps
                    .why_unsupported(missing)
                    .map(|w| format!("{}: {w}", i.name))
            })
            .unwrap_or_else(|| format!("{missing:?} not declared")),
        Lack::Negotiated => {
            format!("the connection does not provide {missing:?} after negotiating with its peer")
        }
    };
    let postable = missing - OpSet::GUARANTEES;
    if postable.is_empty() {
        return Outcome::Unsupported(reason);
    }
    let run = || -> Result<String, String> {
        let p = ctx.pair()?;
        let mr = region(&p.da, 64, all_access())?;
        let remote = region(&p.db, 64, all_access())?;
        let sgl = [mr.slice(0..8).ctx("slice")?];
        let at = remote.desc().at(0);
        let wr = if postable.contains(OpSet::FETCH_ADD) {
            SendWr::fetch_add(1, sgl[0], at, 1)
        } else if postable.contains(OpSet::COMPARE_SWAP) {
            SendWr::compare_swap(1, sgl[0], at, 0, 1)
        } else if postable.contains(OpSet::WRITE_IMM) {
            SendWr::write(1, &sgl, at).with_imm(7)
        } else if postable.contains(OpSet::SEND_IMM) {
            SendWr::send(1, &sgl).with_imm(7)
        } else if postable.contains(OpSet::READ) {
            SendWr::read(1, &sgl, at)
        } else if postable.contains(OpSet::WRITE) {
            SendWr::write(1, &sgl, at)
        } else {
            SendWr::send(1, &sgl)
        };
        match p.a.post_send(&wr) {
            Err(e) if e.kind() == ErrorKind::Unsupported => Ok(e.to_string()),
            other => Err(format!(
                "{postable:?} is not provided ({reason}), but posting it returned {other:?}"
            )),
        }
    };
    match run() {
        Ok(posted) => Outcome::Unsupported(format!("{reason}; post returned {posted}")),
        Err(e) => Outcome::Fail(e),
    }
}

/// The outcome when the case cannot run as is: its needs are not declared by both
/// providers, or not provided by a connection between them; `None` to run it.
fn gate(ctx: &Ctx, needs: OpSet, declared: OpSet) -> Option<Outcome> {
    if !declared.contains(needs) {
        return Some(unsupported(ctx, needs, declared, Lack::Declared));
    }
    // What a connection provides can be less than declared: a mixed pair, or a
    // configuration (the tcp provider with extensions off) negotiates it down.
    match negotiated(ctx) {
        Err(e) => Some(Outcome::Fail(format!("connecting a probe pair: {e}"))),
        Ok(have) if !have.contains(needs) => Some(unsupported(ctx, needs, have, Lack::Negotiated)),
        Ok(_) => None,
    }
}

/// What a connection between the two sides provides after negotiation.
fn negotiated(ctx: &Ctx) -> Result<OpSet, String> {
    let p = ctx.pair()?;
    Ok(p.a.ops() & p.b.ops())
}

/// Runs one case against `ctx.provider`, never letting a hang or panic escape.
pub fn run_case(ctx: &Ctx, case: &Case) -> CaseResult {
    let start = Instant::now();
    let (info, target_info) = (ctx.info(), ctx.target_info());
    let unavailable = [&info, &target_info]
        .into_iter()
        .find_map(|i| match &i.availability {
            Availability::Unavailable { reason } => Some(if ctx.is_mixed() {
                format!("{}: {reason}", i.name)
            } else {
                reason.clone()
            }),
            Availability::Available => None,
        });
    let mut note = None;
    let outcome = if let Some(reason) = unavailable {
        Outcome::NoDevice(reason)
    } else {
        // Gating connects a probe pair: it runs under the same watchdog as the case body.
        let (tx, rx) = mpsc::channel();
        let c2 = ctx.clone();
        let case = *case;
        let declared = info.caps.ops & target_info.caps.ops;
        let (tid_tx, tid_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("case {}", case.name))
            .spawn(move || {
                let _ = tid_tx.send(this_thread_id());
                let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    match gate(&c2, case.needs, declared) {
                        Some(outcome) => outcome,
                        None => match (case.run)(&c2) {
                            Ok(()) => Outcome::Pass,
                            Err(msg) => Outcome::Fail(msg),
                        },
                    }
                }));
                let note = NOTE.with(|n| n.borrow_mut().take());
                let _ = tx.send((r, note));
            })
            .expect("spawn case thread");
        let limit = case_limit();
        match rx.recv_timeout(limit) {
            Ok((Ok(outcome), n)) => {
                note = n;
                outcome
            }
            Ok((Err(panic), _)) => Outcome::Fail(format!(
                "panicked: {}",
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            )),
            Err(_) => {
                let tid = tid_rx.try_recv().ok().flatten();
                Outcome::Fail(format!(
                    "did not finish within {limit:?} (hang){}",
                    hang_diagnosis(case.name, tid)
                ))
            }
        }
    };
    let detail = match &outcome {
        Outcome::Pass => note.unwrap_or_default(),
        Outcome::Fail(m) | Outcome::Unsupported(m) | Outcome::NoDevice(m) => m.clone(),
    };
    CaseResult {
        name: case.name.to_string(),
        section: case.section.to_string(),
        provider: ctx.provider.clone(),
        outcome: outcome.as_str().to_string(),
        detail,
        seconds: start.elapsed().as_secs_f64(),
    }
}

/// The kernel's id of the calling thread (`/proc/thread-self` names it), if readable.
fn this_thread_id() -> Option<u32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// What a hung case was doing: where its thread sleeps in the kernel (wchan and, when the
/// harness runs as root, the kernel stack) goes into the result; every thread's user
/// stack (gdb, when installed) goes to stderr, so that a hang seen once in CI names its
/// cause instead of a timeout.
fn hang_diagnosis(case: &str, tid: Option<u32>) -> String {
    let mut out = String::new();
    if let Some(tid) = tid {
        let task = format!("/proc/self/task/{tid}");
        let wchan = std::fs::read_to_string(format!("{task}/wchan")).unwrap_or_default();
        if !wchan.is_empty() && wchan != "0" {
            out.push_str(&format!("; the case thread sleeps in {wchan}"));
        }
        if let Ok(stack) = std::fs::read_to_string(format!("{task}/stack")) {
            let frames: Vec<&str> = stack
                .lines()
                .filter_map(|l| l.split_whitespace().nth(1))
                .take(8)
                .collect();
            if !frames.is_empty() {
                out.push_str(&format!(" (kernel stack: {})", frames.join(" < ")));
            }
        }
    }
    let pid = std::process::id().to_string();
    match std::process::Command::new("gdb")
        .args(["-batch", "-nx", "-p", &pid, "-ex", "thread apply all bt 24"])
        .stdin(std::process::Stdio::null())
        .output()
    {
        Ok(o) => {
            eprintln!(
                "== {case} hung: the stacks of every thread (gdb)\n{}",
                String::from_utf8_lossy(&o.stdout)
            );
            out.push_str("; every thread's stack is on stderr");
        }
        Err(e) => out.push_str(&format!("; no thread stacks (gdb: {e})")),
    }
    out
}

#[cfg(test)]
mod slowdown_tests {
    use super::*;

    #[test]
    fn slowdown_follows_the_timeout() {
        assert_eq!(slowdown(Duration::from_secs(10)), 1);
        assert_eq!(slowdown(Duration::from_secs(5)), 1);
        assert_eq!(slowdown(Duration::from_secs(60)), 6);
        assert_eq!(slowdown(Duration::from_secs(3600)), 360);
        let ctx = Ctx {
            timeout: Duration::from_secs(60),
            ..Ctx::new("tcp", None)
        };
        assert_eq!(
            ctx.slack(Duration::from_millis(50)),
            Duration::from_millis(300)
        );
        assert_eq!(CASE_LIMIT * slowdown(ctx.timeout), Duration::from_secs(540));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |var: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == var)
                    .map(|(_, v)| v.to_string())
            }
        };
        let guest = env(&[
            ("FABRIC_SOFT_RDMA_RXE_WIRE_ADDR", "192.168.79.1"),
            ("FABRIC_SOFT_RDMA_RXE_WIRE_PEER_ADDR", "192.168.79.2"),
        ]);
        let w = wire_from("roce", guest).unwrap().expect("the guest's wire");
        assert_eq!(w.initiator, IpAddr::from([192, 168, 79, 1]));
        assert_eq!(w.target, IpAddr::from([192, 168, 79, 2]));
        // The guest's rxe wire is roce's only.
        assert_eq!(wire_from("tcp", guest).unwrap(), None);
        assert_eq!(wire_from("iwarp", guest).unwrap(), None);
        assert_eq!(wire_from("roce", env(&[])).unwrap(), None);
        // The provider's own variable wins.
        let own = env(&[
            ("FABRIC_CONFORMANCE_WIRE_ROCE", "10.0.0.1, 10.0.0.2"),
            ("FABRIC_SOFT_RDMA_RXE_WIRE_ADDR", "192.168.79.1"),
            ("FABRIC_SOFT_RDMA_RXE_WIRE_PEER_ADDR", "192.168.79.2"),
        ]);
        let w = wire_from("roce", own).unwrap().expect("configured");
        assert_eq!(
            (w.initiator, w.target, w.source.as_str()),
            (
                IpAddr::from([10, 0, 0, 1]),
                IpAddr::from([10, 0, 0, 2]),
                "FABRIC_CONFORMANCE_WIRE_ROCE"
            )
        );
        // Malformed: an error naming the variable, never a silent fallback.
        for bad in [
            &[("FABRIC_CONFORMANCE_WIRE_TCP", "127.0.0.1")][..],
            &[("FABRIC_CONFORMANCE_WIRE_TCP", "127.0.0.1,nowhere")][..],
        ] {
            let e = wire_from("tcp", env(bad)).unwrap_err();
            assert!(e.contains("FABRIC_CONFORMANCE_WIRE_TCP"), "{e}");
        }
    }

    #[test]
    fn a_hang_names_where_the_thread_sleeps() {
        let (tx, rx) = mpsc::channel::<()>();
        let (tid_tx, tid_rx) = mpsc::channel();
        let t = std::thread::spawn(move || {
            let _ = tid_tx.send(this_thread_id());
            let _ = rx.recv();
        });
        let tid = tid_rx.recv().unwrap();
        assert!(tid.is_some(), "/proc/thread-self gave no thread id");
        std::thread::sleep(Duration::from_millis(50));
        let d = hang_diagnosis("unit", tid);
        assert!(d.contains("sleeps in"), "{d}");
        assert!(
            d.contains("stderr") || d.contains("no thread stacks"),
            "{d}"
        );
        drop(tx);
        t.join().unwrap();
    }
}
