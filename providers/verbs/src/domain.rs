//! Domains (device, port, protection domain, connection manager), provider discovery,
//! memory registration, listeners, and connection setup through rdma_cm.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use fabric_api::pdata;
use fabric_api::spi::{self, EndpointConfig};
use fabric_api::{
    Access, Availability, Buffer, Capabilities, DeviceInfo, Error, ErrorKind, Limits, MemoryRegion,
    OpSet, ProviderCode, ProviderInfo, Registration, Result,
};

use crate::cm::{self, Cm, Mailbox, Rnr, Target};
use crate::connecting::VerbsConnecting;
use crate::cq::{CqInner, VerbsCq};
use crate::device::{self, DeviceFacts};
use crate::emu::{self, AtomicKeys, ExtDesc};
use crate::ep::{CreditArea, EarlyRing, EmuLink, EpCore, EpParts, VerbsEndpoint, HELLO_WAIT};
use crate::ffi::{self, access, cm_event, CmEvent, CmId, ConnParam, Ctx, HwCq, Mr, Pd, QpCaps};
use crate::{Flavor, Profile, Selection, Transport, VerbsOptions};

/// The peer's credit area: address and key.
type PeerArea = (u64, u32);

/// Completion-queue entries the provider keeps for its own requests, on top of twice the
/// application's capacity, where the profile adds requests (iWARP).
const INTERNAL_EXTRA: usize = 64;
/// Hardware send-queue room for credit updates and close marks (iWARP).
const CREDIT_SLOTS: usize = 32;
/// Outstanding reads/atomics asked for (capped by the device, and by the peer's when the
/// connection is set up): 128, what perftest asks of rxe and siw (their maximum). At 16 a
/// stream of 64 KiB reads ran dry once the target's CPU was busy too: A/B in one soft-RDMA
/// boot, 4 rounds, against `ib_read_bw` (perftest's server polling, as ours): iwarp 64 KiB
/// 0.95x -> 1.26x (higher in 4 of 4), 1 MiB 0.82x -> 0.95x, roce 64 KiB 0.99x -> 1.17x
/// (docs/benchmarks-record.md, twenty-ninth session). The price is the device's per-connection
/// read state (siw: 128-entry ORQ and IRQ; rxe: 128 responder resources).
const WANT_RD_ATOM: u32 = 128;

/// Everything discovery learns for one flavor: the usable device, or why there is none.
struct Found {
    devices: Vec<(DeviceFacts, Result<Selection, String>)>,
    problem: Option<String>,
}

fn find<F: Flavor>(opts: &VerbsOptions) -> Found {
    let all = match device::probe_recent() {
        Ok(d) => d,
        Err(e) => {
            return Found {
                devices: Vec::new(),
                problem: Some(format!("{}: {}", F::no_device(), e.reason())),
            }
        }
    };
    let mine: Vec<DeviceFacts> = all
        .iter()
        .filter(|d| F::accepts(d).is_ok())
        .filter(|d| opts.device.as_ref().is_none_or(|n| *n == d.name))
        .cloned()
        .collect();
    if mine.is_empty() {
        let others: Vec<String> = all
            .iter()
            .map(|d| {
                format!(
                    "{} ({})",
                    d.name,
                    F::accepts(d).err().unwrap_or_else(|| "not selected".into())
                )
            })
            .collect();
        let mut reason = F::no_device();
        if let Some(n) = &opts.device {
            reason = format!("{reason}; configured device {n} not found or not of this kind");
        }
        if !others.is_empty() {
            reason = format!("{reason}; devices present: {}", others.join(", "));
        }
        return Found {
            devices: Vec::new(),
            problem: Some(reason),
        };
    }
    let devices: Vec<_> = mine
        .into_iter()
        .map(|d| {
            let s = F::select(&d, opts);
            (d, s)
        })
        .collect();
    let mut problem = None;
    if !devices.iter().any(|(_, s)| s.is_ok()) {
        let why: Vec<String> = devices
            .iter()
            .map(|(d, s)| {
                format!(
                    "{}: {}",
                    d.name,
                    s.as_ref().err().cloned().unwrap_or_default()
                )
            })
            .collect();
        problem = Some(why.join("; "));
    } else if let Some(m) = device::memlock_problem() {
        problem = Some(m);
    }
    Found { devices, problem }
}

fn limits_of(dev: &DeviceFacts, p: &Profile, port: u8) -> Limits {
    let ord = dev
        .max_qp_init_rd_atom
        .min(dev.max_qp_rd_atom)
        .min(WANT_RD_ATOM);
    let max_msg = dev
        .ports
        .iter()
        .find(|x| x.num == port)
        .map_or(1 << 31, |x| u64::from(x.max_msg))
        .max(1);
    let header = pdata::HEADER
        + if p.credits { pdata::AREA_DESC_LEN } else { 0 }
        + if emulates(dev, p) { emu::EXT_LEN } else { 0 };
    let pieces = pieces(dev, p);
    let extra_sq = if p.credits { CREDIT_SLOTS as u32 } else { 0 };
    let (cq_div, cq_extra) = if p.delivery_reads || p.split_reads || p.credits {
        (pieces as u32 + 1, INTERNAL_EXTRA as u32)
    } else {
        (1, 0)
    };
    Limits {
        max_msg_size: max_msg,
        max_inline: if dev.max_inline >= 8 || !p.credits {
            dev.max_inline
        } else {
            0
        },
        max_sge: dev.max_sge,
        max_send_queue: (dev.max_qp_wr.saturating_sub(extra_sq)) / pieces as u32,
        max_recv_queue: dev.max_qp_wr,
        max_cq_entries: dev.max_cqe.saturating_sub(cq_extra) / cq_div,
        max_outstanding_reads: ord,
        max_private_data: p.transport_private_data.saturating_sub(header as u32),
    }
}

/// Hardware requests one application request may need at most.
fn pieces(dev: &DeviceFacts, p: &Profile) -> usize {
    let reads = if p.split_reads {
        dev.max_sge.max(1) as usize
    } else {
        1
    };
    // Small page-crossing reads and writes are split in two (see the profile).
    let reads = if p.small_page_crossing {
        reads * 2
    } else {
        reads
    };
    let writes = if p.delivery_reads { 2 } else { 1 };
    // An emulated write with immediate: the write (two where a small page crossing is
    // split), the immediate's record, a zero-length send, the delivery read.
    let emulated = if p.emulate { 5 } else { 1 };
    reads.max(writes).max(emulated)
}

/// True when the profile emulates atomics and immediate data and the device can carry the
/// emulation's messages (inline writes of an atomic request).
pub(crate) fn emulates(dev: &DeviceFacts, p: &Profile) -> bool {
    p.emulate && p.credits && dev.max_inline >= emu::NEEDS_INLINE
}

fn ops_of(p: &Profile, limits: &Limits) -> OpSet {
    // RC retries receiver-not-ready forever (rnr_retry 7); iWARP holds sends for credits.
    let mut ops = OpSet::SEND | OpSet::WRITE | OpSet::READ | OpSet::RNR_WAIT;
    if p.read_protection {
        ops |= OpSet::READ_PROTECTION;
    }
    if p.listen_early_close {
        ops |= OpSet::LISTEN_EARLY_CLOSE;
    }
    if limits.max_inline > 0 {
        ops |= OpSet::INLINE;
    }
    if p.immediate {
        ops |= OpSet::SEND_IMM | OpSet::WRITE_IMM;
    }
    if p.atomics {
        ops |= OpSet::ATOMICS;
    }
    if p.emulate && p.credits && limits.max_inline >= emu::NEEDS_INLINE {
        ops |= OpSet::ATOMICS | OpSet::SEND_IMM | OpSet::WRITE_IMM;
    }
    ops
}

fn device_info(d: &DeviceFacts, sel: &Result<Selection, String>) -> DeviceInfo {
    let mut details = d.details();
    match sel {
        Ok(s) => {
            details.insert("selected".into(), s.summary.clone());
        }
        Err(e) => {
            details.insert("unusable".into(), e.clone());
        }
    }
    DeviceInfo {
        name: d.name.clone(),
        transport: d.transport.name(),
        link_layer: d
            .ports
            .first()
            .map_or("-", |p| p.link_layer.name())
            .to_string(),
        details,
    }
}

fn empty_caps() -> Capabilities {
    Capabilities {
        ops: OpSet::empty(),
        limits: Limits {
            max_msg_size: 0,
            max_inline: 0,
            max_sge: 0,
            max_send_queue: 0,
            max_recv_queue: 0,
            max_cq_entries: 0,
            max_outstanding_reads: 0,
            max_private_data: 0,
        },
        imm_size: 0,
        emulated: Vec::new(),
        unsupported: BTreeMap::new(),
    }
}

fn caps_of(d: &DeviceFacts, p: &Profile, port: u8) -> Capabilities {
    let limits = limits_of(d, p, port);
    let ops = ops_of(p, &limits);
    Capabilities {
        ops,
        limits,
        imm_size: if ops.contains(OpSet::SEND_IMM) { 4 } else { 0 },
        emulated: p.emulated.clone(),
        unsupported: p.unsupported.clone(),
    }
}

/// What `discover()` reports for the provider `F`.
pub fn provider_info<F: Flavor>(opts: &VerbsOptions) -> ProviderInfo {
    let found = find::<F>(opts);
    let devices: Vec<DeviceInfo> = found
        .devices
        .iter()
        .map(|(d, s)| device_info(d, s))
        .collect();
    let usable = found.devices.iter().find(|(_, s)| s.is_ok());
    let caps = match usable {
        Some((d, Ok(s))) => caps_of(d, &F::profile(d), s.port),
        _ => empty_caps(),
    };
    ProviderInfo {
        name: F::NAME.into(),
        availability: match found.problem {
            None => Availability::Available,
            Some(reason) => Availability::Unavailable { reason },
        },
        devices,
        caps,
    }
}

/// The shared part of a domain.
pub(crate) struct DomainInner {
    pub id: u64,
    pub dev: DeviceFacts,
    pub sel: Selection,
    pub profile: Profile,
    pub limits: Limits,
    pub info: ProviderInfo,
    pub opts: VerbsOptions,
    pub ctx: Ctx,
    pub pd: Arc<Pd>,
    pub rnr: Rnr,
    pub cm: Cm,
    /// The dead-peer timeout, where the provider detects dead peers itself
    /// ([`Profile::liveness_probes`]).
    pub dead_peer: Option<std::time::Duration>,
    /// The keys granting emulated atomics (regions registered with REMOTE_ATOMIC where
    /// the profile emulates them).
    pub atomic_keys: Arc<AtomicKeys>,
    /// The profile emulates atomics and immediate data on this device.
    pub emulates: bool,
}

impl fmt::Debug for DomainInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DomainInner")
            .field("id", &self.id)
            .field("device", &self.dev.name)
            .field("selection", &self.sel.summary)
            .finish()
    }
}

/// A queue the device library failed to create, as an error that says which. On siw, a
/// failure without an errno is most likely libsiw's mmap sentinel
/// (`Profile::mmap_sentinel_guard`), met when the guard was not the first queue on the
/// process's context: the message says so.
fn creation_error(profile: &crate::Profile, what: &str, e: std::io::Error) -> Error {
    let hint = if profile.mmap_sentinel_guard && e.raw_os_error().is_none() {
        " (libsiw fails a queue that the kernel mapped at offset 0x90000 this way; the \
         domain's guard against it comes too late when the process created queues on this \
         device before its first domain)"
    } else {
        ""
    };
    let code = e.raw_os_error().map(ProviderCode::Errno);
    let err = Error::from(e);
    let err = Error::new(err.kind(), format!("{what}: {}{hint}", err.message()));
    match code {
        Some(c) => err.with_code(c),
        None => err,
    }
}

impl DomainInner {
    /// Registers a buffer with raw verbs access flags.
    pub fn register_raw(&self, buf: &Arc<Buffer>, flags: u32) -> Result<Mr> {
        Mr::register(&self.pd, buf, flags).map_err(|e| {
            let hint = if e.raw_os_error() == Some(libc::ENOMEM)
                || e.raw_os_error() == Some(libc::EPERM)
            {
                format!(
                    " (memory lock limit: {})",
                    ffi::memlock_limit()
                        .map_or("unlimited".into(), |l| format!("{} KiB", l / 1024))
                )
            } else {
                String::new()
            };
            Error::new(
                ErrorKind::Io,
                format!("ibv_reg_mr of {} bytes failed: {e}{hint}", buf.len()),
            )
            .with_code(ProviderCode::Errno(e.raw_os_error().unwrap_or(0)))
        })
    }

    fn check_cfg<F: Flavor>(&self, cfg: &EndpointConfig<'_, VerbsCq<F>>) -> Result<()> {
        for (name, d, max) in [
            ("send queue", cfg.sq_depth, self.limits.max_send_queue),
            ("receive queue", cfg.rq_depth, self.limits.max_recv_queue),
        ] {
            if d == 0 || d > max {
                return Err(Error::invalid(format!(
                    "{name} depth {d} outside 1..={max}"
                )));
            }
        }
        cfg.request_limits(&self.limits)?;
        if cfg.private_data.len() > self.limits.max_private_data as usize {
            return Err(Error::invalid(format!(
                "{} bytes of private data exceed the maximum of {} on {}",
                cfg.private_data.len(),
                self.limits.max_private_data,
                self.dev.name
            )));
        }
        for cq in [cfg.send_cq, cfg.recv_cq] {
            if cq.inner.hw.ctx != self.ctx {
                return Err(Error::invalid("completion queue belongs to another device"));
            }
        }
        Ok(())
    }

    fn frame(
        &self,
        app: &[u8],
        credit: Option<&(Arc<Buffer>, Mr)>,
        emu: Option<&(Arc<Buffer>, Mr, u32)>,
    ) -> Vec<u8> {
        let mut v = pdata::frame(app, credit.map(|(b, m)| CreditArea::desc(b, m)));
        if let (Some(_), Some(e)) = (credit, emu) {
            v.extend_from_slice(&EmuLink::desc(e).encode());
        }
        v
    }

    fn unframe(&self, raw: &[u8]) -> Result<(Vec<u8>, Option<PeerArea>)> {
        let (app, area) = pdata::unframe(raw, self.profile.credits)?;
        // A frame naming no area (address and key 0) comes from a peer of this framework
        // that takes no credits (the tcp provider answering us).
        Ok((
            app,
            area.filter(|a| a.addr != 0 || a.stag != 0)
                .map(|a| (a.addr, a.stag)),
        ))
    }

    /// Sets the profile's local ACK timeout on a connection identifier (before route
    /// resolution or accept): the dead-peer bound of the crate docs depends on it, so a
    /// kernel that refuses it fails the connection rather than silently keeping its own.
    fn set_ack_timeout(&self, id: &CmId) -> Result<()> {
        let Some(t) = self.profile.ack_timeout else {
            return Ok(());
        };
        id.set_ack_timeout(t).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("setting the local ACK timeout (4.096 us x 2^{t}) through rdma_cm: {e}"),
            )
        })
    }

    /// The queue pair for an endpoint of these depths whose requests carry at most `sge`
    /// entries and `inline` bytes inline. Its entries are sized to those (an rxe entry
    /// has room for the larger of `sge` entries and `inline` bytes: sized to the device's
    /// maximum, its rings span hundreds of KiB; docs/benchmarks-record.md, fortieth
    /// session), except where the provider posts requests of its own (credits,
    /// emulation, inlined small payloads: iWARP), which keep the device's.
    fn qp_caps(&self, sq: u32, rq: u32, sge: u32, inline: u32) -> QpCaps {
        let pieces = pieces(&self.dev, &self.profile) as u32;
        let extra = if self.profile.credits {
            CREDIT_SLOTS as u32
        } else {
            0
        };
        // Room for the early receives of a connection from a foreign peer (iWARP).
        let early = if self.profile.credits {
            EarlyRing::SLOTS as u32
        } else {
            0
        };
        let p = &self.profile;
        let own = p.credits || p.emulate || p.delivery_reads || p.small_page_crossing;
        QpCaps {
            send_wr: (sq * pieces + extra).min(self.dev.max_qp_wr),
            recv_wr: (rq + early).min(self.dev.max_qp_wr),
            send_sge: if own { self.dev.max_sge } else { sge },
            recv_sge: if own { self.dev.max_sge } else { sge },
            inline: if own { self.limits.max_inline } else { inline },
        }
    }

    fn rd_atom(&self) -> u8 {
        self.limits.max_outstanding_reads.min(255) as u8
    }
}

/// A protection domain of a verbs provider on one device and port.
pub struct VerbsDomain<F: Flavor> {
    pub(crate) inner: Arc<DomainInner>,
    _f: PhantomData<fn() -> F>,
}

impl<F: Flavor> Clone for VerbsDomain<F> {
    fn clone(&self) -> Self {
        VerbsDomain {
            inner: self.inner.clone(),
            _f: PhantomData,
        }
    }
}

impl<F: Flavor> fmt::Debug for VerbsDomain<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsDomain")
            .field("provider", &F::NAME)
            .field("inner", &self.inner)
            .finish()
    }
}

impl<F: Flavor> VerbsDomain<F> {
    /// Opens a domain on the first usable device of this provider.
    pub fn open(opts: VerbsOptions) -> Result<Self> {
        let found = find::<F>(&opts);
        if let Some(p) = found.problem {
            return Err(Error::new(ErrorKind::NoDevice, format!("{}: {p}", F::NAME)));
        }
        let (dev, sel) = found
            .devices
            .into_iter()
            .find_map(|(d, s)| s.ok().map(|s| (d, s)))
            .ok_or_else(|| Error::new(ErrorKind::NoDevice, F::no_device()))?;
        let profile = F::profile(&dev);
        let dead_peer = match opts.dead_peer_timeout {
            Some(t) if !crate::DEAD_PEER_TIMEOUT_RANGE.contains(&t) => {
                return Err(Error::invalid(format!(
                    "{}: dead_peer_timeout {t:?} outside 2 s..=3600 s",
                    F::NAME
                )))
            }
            t => profile
                .liveness_probes
                .then(|| t.unwrap_or(crate::DEFAULT_DEAD_PEER_TIMEOUT)),
        };
        let caps = caps_of(&dev, &profile, sel.port);
        let limits = caps.limits;
        let ctx = Ctx::by_name(&dev.name).map_err(|e| {
            // The facts may be out of date (a device removed since): probe afresh next time.
            device::forget_probe();
            Error::new(
                ErrorKind::NoDevice,
                format!("librdmacm cannot open {}: {e}", dev.name),
            )
        })?;
        if profile.mmap_sentinel_guard {
            crate::ffi::guard_siw_sentinel(ctx);
        }
        let pd = Pd::alloc(ctx).map_err(Error::from)?;
        let info = ProviderInfo {
            name: F::NAME.into(),
            availability: Availability::Available,
            devices: vec![device_info(&dev, &Ok(sel.clone()))],
            caps,
        };
        let cm = Cm::new(F::NAME).map_err(Error::from)?;
        tracing::debug!(provider = F::NAME, device = %dev.name, selection = %sel.summary, "verbs domain opened");
        Ok(VerbsDomain {
            inner: Arc::new(DomainInner {
                id: fabric_api::region::next_domain_id(),
                rnr: Rnr::new(F::NAME, dead_peer.map(crate::liveness_tick)),
                dead_peer,
                atomic_keys: Arc::default(),
                emulates: emulates(&dev, &profile),
                dev,
                sel,
                profile,
                limits,
                info,
                opts,
                ctx,
                pd,
                cm,
            }),
            _f: PhantomData,
        })
    }

    /// The device, port, address and GID in use, in words (for the selection report).
    pub fn selection(&self) -> &Selection {
        &self.inner.sel
    }

    /// The device's facts.
    pub fn device(&self) -> &DeviceFacts {
        &self.inner.dev
    }

    /// What the provider does on this device: which features it emulates, how it confirms
    /// delivery, whether sends wait for credits.
    pub fn profile(&self) -> &crate::Profile {
        &self.inner.profile
    }

    fn endpoint(
        &self,
        id: CmId,
        cfg: &EndpointConfig<'_, VerbsCq<F>>,
        peer_private: Vec<u8>,
        (credit, sink): CreditPair,
        (emu, foreign, early): (Option<EmuLink>, bool, Option<EarlyRing>),
        hw_sq_cap: usize,
    ) -> VerbsEndpoint<F> {
        let (max_sge, max_inline) = cfg
            .request_limits(&self.inner.limits)
            .expect("checked with the configuration (check_cfg)");
        let core = EpCore::new(EpParts {
            id,
            dom: self.inner.clone(),
            send_cq: cfg.send_cq.inner.clone(),
            recv_cq: cfg.recv_cq.inner.clone(),
            sq_depth: cfg.sq_depth as usize,
            rq_depth: cfg.rq_depth as usize,
            hw_sq_cap,
            max_sge,
            max_inline,
            peer_private,
            credit,
            sink,
            emu,
            foreign,
            early,
            ep_context: cfg.ep_context,
        });
        VerbsEndpoint {
            core,
            _f: PhantomData,
        }
    }

    /// Switches an identifier's events to its endpoint, replaying what came meanwhile.
    fn go_live(&self, ep: &VerbsEndpoint<F>, mb: &Mailbox) {
        self.inner
            .cm
            .register(ep.core.id.key(), Target::Endpoint(Arc::downgrade(&ep.core)));
        for ev in mb.take_all() {
            cm::handle_endpoint_event(&ep.core, &ev);
        }
    }

    fn make_qp(&self, id: &mut CmId, cfg: &EndpointConfig<'_, VerbsCq<F>>) -> Result<usize> {
        let d = &self.inner;
        let (sge, inline) = cfg.request_limits(&d.limits)?;
        let caps = d.qp_caps(cfg.sq_depth, cfg.rq_depth, sge, inline);
        let got = id
            .create_qp(&d.pd, &cfg.send_cq.inner.hw, &cfg.recv_cq.inner.hw, caps)
            .map_err(|e| creation_error(&d.profile, "creating the queue pair", e))?;
        Ok(got.send_wr as usize)
    }

    /// The endpoint's emulation area, where the domain emulates atomics and immediate
    /// data: one immediate-data slot per receive-queue entry.
    fn emu_area(&self, rq_depth: u32) -> Result<Option<(Arc<Buffer>, Mr, u32)>> {
        if !self.inner.emulates {
            return Ok(None);
        }
        let slots = rq_depth.clamp(1, emu::MAX_IMM_SLOTS);
        let buf = Arc::new(Buffer::new(emu::area_len(slots)));
        let mr = self
            .inner
            .register_raw(&buf, ffi::access::LOCAL_WRITE | ffi::access::REMOTE_WRITE)?;
        tracing::debug!(
            addr = buf.addr(),
            len = buf.len(),
            stag = mr.rkey(),
            "emulation area registered"
        );
        Ok(Some((buf, mr, slots)))
    }

    fn credit_area(&self) -> Result<Option<(Arc<Buffer>, Mr)>> {
        if self.inner.profile.credits {
            CreditArea::local(&self.inner).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// A local TCP port for an iWARP connection or listener, held by a bound socket until the
/// connection is up or the listener listens.
///
/// siw connects and listens with kernel TCP sockets bound to the port rdma_cm picks at
/// random from its own port space, which knows nothing of plain TCP sockets: a port held by
/// one (the tcp provider's connections, any application's) makes `rdma_connect` or
/// `rdma_listen` fail with EADDRINUSE. Measured in the mixed tcp/iwarp conformance runs:
/// about one connection or listener in a few hundred. The kernel's own allocator hands out
/// a port no TCP socket holds; the reservation is SO_REUSEADDR and never listens, so siw's
/// bind (SO_REUSEADDR too, in `siw_connect` and `siw_create_listen`) shares it. `None` when
/// no socket can be had: rdma_cm then picks.
fn reserve_tcp_port(ip: IpAddr) -> Option<(socket2::Socket, u16)> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(SocketAddr::new(ip, 0)),
        socket2::Type::STREAM,
        None,
    )
    .ok()?;
    sock.set_reuse_address(true).ok()?;
    sock.bind(&SocketAddr::new(ip, 0).into()).ok()?;
    let port = sock.local_addr().ok()?.as_socket()?.port();
    Some((sock, port))
}

fn unreachable_err(addr: SocketAddr, e: std::io::Error) -> Error {
    Error::new(ErrorKind::TimedOut, format!("{addr} is unreachable: {e}"))
        .with_code(ProviderCode::Errno(e.raw_os_error().unwrap_or(0)))
}

fn event_error(addr: SocketAddr, what: &str, ev: &CmEvent) -> Error {
    let code = ProviderCode::Errno(ev.status.abs());
    let kind = match ev.kind {
        cm_event::RDMA_CM_EVENT_REJECTED => ErrorKind::ConnectionRefused,
        cm_event::RDMA_CM_EVENT_CONNECT_ERROR if ev.status.abs() == libc::ECONNREFUSED => {
            ErrorKind::ConnectionRefused
        }
        cm_event::RDMA_CM_EVENT_ADDR_ERROR
        | cm_event::RDMA_CM_EVENT_ROUTE_ERROR
        | cm_event::RDMA_CM_EVENT_UNREACHABLE => ErrorKind::TimedOut,
        _ => ErrorKind::Io,
    };
    let msg = match kind {
        ErrorKind::ConnectionRefused => format!(
            "nobody listens at {addr} (connection rejected, status {})",
            ev.status
        ),
        ErrorKind::TimedOut => format!(
            "{addr} is unreachable ({what}: event {}, status {})",
            ev.kind, ev.status
        ),
        _ => format!(
            "{what} with {addr} failed: event {}, status {}",
            ev.kind, ev.status
        ),
    };
    Error::new(kind, msg).with_code(code)
}

/// Waits for `want` on `mb`; other events are errors.
fn expect(
    mb: &Mailbox,
    deadline: Instant,
    want: u32,
    addr: SocketAddr,
    what: &str,
    timeout: Duration,
) -> Result<CmEvent> {
    loop {
        let Some(ev) = mb.wait(deadline) else {
            return Err(Error::new(
                ErrorKind::TimedOut,
                format!("{what} with {addr}: no answer within {timeout:?}"),
            ));
        };
        if ev.kind == want {
            return Ok(ev);
        }
        if ev.kind == cm_event::RDMA_CM_EVENT_TIMEWAIT_EXIT
            || ev.kind == cm_event::RDMA_CM_EVENT_ADDR_CHANGE
        {
            continue;
        }
        return Err(event_error(addr, what, &ev));
    }
}

/// Reaps an identifier when connection setup fails (see [`Cm::reap`]).
struct IdGuard<'a> {
    cm: &'a Cm,
    id: Option<CmId>,
}

impl Drop for IdGuard<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.cm.reap(id);
        }
    }
}

/// Unregisters an identifier when setup fails.
struct RegGuard<'a> {
    cm: &'a Cm,
    key: usize,
    armed: bool,
}

impl Drop for RegGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.cm.unregister(self.key);
        }
    }
}

impl<F: Flavor> spi::Domain for VerbsDomain<F> {
    type Cq = VerbsCq<F>;
    type Endpoint = VerbsEndpoint<F>;
    type Listener = VerbsListener<F>;
    type Connecting = VerbsConnecting<F>;

    fn info(&self) -> &ProviderInfo {
        &self.inner.info
    }

    fn register(&self, buffer: Arc<Buffer>, acc: Access) -> Result<MemoryRegion> {
        acc.validate()?;
        let d = &self.inner;
        let mut local = 0;
        if acc.contains(Access::LOCAL_WRITE) {
            local |= access::LOCAL_WRITE;
            if d.profile.sink_remote_write {
                local |= access::REMOTE_WRITE;
            }
        }
        let mut remote = 0;
        if acc.contains(Access::REMOTE_WRITE) {
            remote |= access::REMOTE_WRITE;
        }
        if acc.contains(Access::REMOTE_READ) {
            remote |= access::REMOTE_READ;
        }
        let emulated_atomic = acc.contains(Access::REMOTE_ATOMIC) && !d.profile.atomics;
        if acc.contains(Access::REMOTE_ATOMIC) {
            if d.profile.atomics {
                remote |= access::REMOTE_ATOMIC;
            } else {
                // iWARP has no atomics: the device key grants none, but it must exist (a
                // key the peer names in emulated atomics, which the provider checks).
                remote |= access::LOCAL_WRITE;
            }
        }
        let local_mr = d.register_raw(&buffer, local)?;
        let remote_mr = if remote != 0 {
            if acc.contains(Access::LOCAL_WRITE) {
                remote |= access::LOCAL_WRITE;
            }
            Some(d.register_raw(&buffer, remote)?)
        } else {
            None
        };
        let rkey = remote_mr.as_ref().map_or(0, Mr::rkey);
        let atomic_keys = (emulated_atomic && d.emulates).then(|| {
            d.atomic_keys.insert(rkey, buffer.clone());
            d.atomic_keys.clone()
        });
        let reg = VerbsRegistration {
            lkey: local_mr.lkey(),
            rkey,
            _local: local_mr,
            remote: Mutex::new(remote_mr),
            atomic_keys,
        };
        Ok(MemoryRegion::new(buffer, acc, d.id, Box::new(reg)))
    }

    fn create_cq(&self, capacity: usize) -> Result<VerbsCq<F>> {
        let d = &self.inner;
        let max = d.limits.max_cq_entries as usize;
        if capacity == 0 || capacity > max {
            return Err(Error::invalid(format!(
                "completion queue capacity {capacity} outside 1..={max}"
            )));
        }
        let p = &d.profile;
        let internal = if p.credits || p.delivery_reads || p.split_reads {
            capacity * (pieces(&d.dev, p) - 1).max(1) + INTERNAL_EXTRA
        } else {
            0
        };
        let hw = HwCq::new(d.ctx, capacity + internal)
            .map_err(|e| creation_error(&d.profile, "creating the completion queue", e))?;
        Ok(VerbsCq::new(CqInner::new(hw, capacity, internal)?))
    }

    fn listen(&self, addr: SocketAddr) -> Result<VerbsListener<F>> {
        let d = &self.inner;
        let id = d.cm.create_id()?;
        let mb = Arc::new(Mailbox::default());
        d.cm.register(id.key(), Target::Mailbox(mb.clone()));
        let mut guard = RegGuard {
            cm: &d.cm,
            key: id.key(),
            armed: true,
        };
        // The listener's descriptor, made now: `AsFd` cannot fail later.
        mb.requests().fd()?;
        // iWARP with port 0: a port the kernel's TCP allocator hands out (see
        // `reserve_tcp_port`), held until the listening socket has it.
        let reserved = match d.dev.transport {
            Transport::Iwarp if addr.port() == 0 => reserve_tcp_port(addr.ip()),
            _ => None,
        };
        let bound = match &reserved {
            Some((_, port)) => match id.bind(SocketAddr::new(addr.ip(), *port)) {
                // rdma_cm's own port space holds it: let rdma_cm pick.
                Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => id.bind(addr),
                r => r,
            },
            None => id.bind(addr),
        };
        bound.map_err(|e| {
            let kind = if e.raw_os_error() == Some(libc::EADDRNOTAVAIL)
                || e.raw_os_error() == Some(libc::ENODEV)
            {
                ErrorKind::InvalidArgument
            } else {
                Error::from(std::io::Error::from_raw_os_error(
                    e.raw_os_error().unwrap_or(0),
                ))
                .kind()
            };
            Error::new(kind, format!("rdma_bind_addr({addr}): {e}"))
                .with_code(ProviderCode::Errno(e.raw_os_error().unwrap_or(0)))
        })?;
        if let Some(c) = id.ctx() {
            if c != d.ctx {
                return Err(Error::invalid(format!(
                    "{addr} belongs to another RDMA device than {} (the {} provider's)",
                    d.dev.name,
                    F::NAME
                )));
            }
        }
        id.listen(64)?;
        drop(reserved);
        let local = id.local_addr().unwrap_or(addr);
        guard.armed = false;
        Ok(VerbsListener {
            dom: self.clone(),
            id: Some(id),
            mb,
            local,
            hello: Mutex::new(None),
        })
    }

    fn connect(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, VerbsCq<F>>,
    ) -> Result<VerbsEndpoint<F>> {
        self.inner.check_cfg(cfg)?;
        self.establish(addr, cfg, Instant::now() + cfg.timeout)
    }

    fn connect_start(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, VerbsCq<F>>,
    ) -> Result<VerbsConnecting<F>> {
        self.inner.check_cfg(cfg)?;
        VerbsConnecting::start(self.clone(), addr, cfg)
    }
}

impl<F: Flavor> VerbsDomain<F> {
    /// Sets up a connection to `addr` (the configuration checked), blocking until it is up
    /// or failed, at the latest around `deadline`: the body of `connect`, and of the
    /// helper thread of `connect_start`.
    pub(crate) fn establish(
        &self,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, VerbsCq<F>>,
        deadline: Instant,
    ) -> Result<VerbsEndpoint<F>> {
        let d = &self.inner;
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        let mb = Arc::new(Mailbox::default());
        let mut guard = IdGuard {
            cm: &d.cm,
            id: Some(d.cm.create_id()?),
        };
        let id = guard.id.as_mut().expect("just created");
        d.cm.register(id.key(), Target::Mailbox(mb.clone()));
        if let Some(tos) = d.opts.traffic_class {
            id.set_tos(tos)
                .map_err(|e| Error::new(ErrorKind::Config, format!("traffic class {tos}: {e}")))?;
        }
        // Held until the connection is up or failed (dropped with this function's frame).
        let reserved = match (d.dev.transport, d.sel.addr) {
            (Transport::Iwarp, Some(ip)) => reserve_tcp_port(ip),
            _ => None,
        };
        let port = reserved.as_ref().map_or(0, |r| r.1);
        let src = d.sel.addr.map(|ip| SocketAddr::new(ip, port));
        match id.resolve_addr(src, addr, left()) {
            // rdma_cm's own port space holds the port: let it pick one.
            Err(e) if port != 0 && e.raw_os_error() == Some(libc::EADDRINUSE) => {
                tracing::debug!(port, "rdma_cm holds the reserved port; it picks one");
                id.resolve_addr(src.map(|s| SocketAddr::new(s.ip(), 0)), addr, left())
            }
            r => r,
        }
        .map_err(|e| unreachable_err(addr, e))?;
        expect(
            &mb,
            deadline,
            cm_event::RDMA_CM_EVENT_ADDR_RESOLVED,
            addr,
            "address resolution",
            cfg.timeout,
        )?;
        if id.ctx() != Some(d.ctx) {
            return Err(Error::invalid(format!(
                "the route to {addr} leaves through another RDMA device than {}",
                d.dev.name
            )));
        }
        d.set_ack_timeout(id)?;
        id.resolve_route(left())
            .map_err(|e| unreachable_err(addr, e))?;
        expect(
            &mb,
            deadline,
            cm_event::RDMA_CM_EVENT_ROUTE_RESOLVED,
            addr,
            "route resolution",
            cfg.timeout,
        )?;
        let hw_sq_cap = self.make_qp(id, cfg)?;
        let credit = self.credit_area()?;
        let emu_local = self.emu_area(cfg.rq_depth)?;
        let private = d.frame(cfg.private_data, credit.as_ref(), emu_local.as_ref());
        let rd = d.rd_atom();
        // rdma_connect blocks in the kernel on iWARP (siw connects its TCP socket
        // synchronously, for minutes when nobody answers): run it on a helper thread that
        // keeps everything the queue pair uses alive, and wait here with the deadline.
        let shared = Arc::new(guard.id.take().expect("identifier held"));
        // What the queue pair uses: whoever may destroy it drops these after it.
        let qp_uses = || {
            (
                d.pd.clone(),
                cfg.send_cq.inner.clone(),
                cfg.recv_cq.inner.clone(),
            )
        };
        let (tx, rx) = mpsc::channel();
        {
            let id = shared.clone();
            let keep = (d.cm.keep_alive(), qp_uses());
            let private = private.clone();
            let (retry, rnr) = (d.profile.retry, d.profile.rnr_retry);
            std::thread::Builder::new()
                .name("fabric-cm-connect".into())
                .spawn(move || {
                    let r = id.connect(&ConnParam {
                        private_data: &private,
                        responder_resources: rd,
                        initiator_depth: rd,
                        retry_count: retry,
                        rnr_retry_count: rnr,
                    });
                    let _ = tx.send(r);
                    drop(id);
                    drop(keep);
                })?;
        }
        let fail = |e: Error| {
            d.cm.unregister(shared.key());
            d.cm.reap_shared(shared.clone(), qp_uses());
            Err(e)
        };
        let ev = loop {
            if let Ok(Err(e)) = rx.try_recv() {
                let kind = match e.raw_os_error() {
                    Some(libc::ECONNREFUSED) | Some(libc::ECONNRESET) => {
                        ErrorKind::ConnectionRefused
                    }
                    Some(libc::ETIMEDOUT) | Some(libc::ENETUNREACH) | Some(libc::EHOSTUNREACH) => {
                        ErrorKind::TimedOut
                    }
                    _ => Error::from(std::io::Error::from_raw_os_error(
                        e.raw_os_error().unwrap_or(0),
                    ))
                    .kind(),
                };
                let msg = match kind {
                    ErrorKind::ConnectionRefused => format!("nobody listens at {addr} ({e})"),
                    ErrorKind::TimedOut => format!("{addr} is unreachable ({e})"),
                    _ => format!("rdma_connect to {addr}: {e}"),
                };
                return fail(
                    Error::new(kind, msg)
                        .with_code(ProviderCode::Errno(e.raw_os_error().unwrap_or(0))),
                );
            }
            let step = (Instant::now() + Duration::from_millis(20)).min(deadline);
            match mb.wait(step) {
                Some(ev) if ev.kind == cm_event::RDMA_CM_EVENT_ESTABLISHED => break ev,
                Some(ev)
                    if ev.kind == cm_event::RDMA_CM_EVENT_TIMEWAIT_EXIT
                        || ev.kind == cm_event::RDMA_CM_EVENT_ADDR_CHANGE => {}
                Some(ev) => return fail(event_error(addr, "connection", &ev)),
                None if Instant::now() >= deadline => {
                    return fail(Error::new(
                        ErrorKind::TimedOut,
                        format!("connection with {addr}: no answer within {:?}", cfg.timeout),
                    ))
                }
                None => {}
            }
        };
        // ESTABLISHED came after rdma_connect returned: the helper is done with the id.
        let _ = rx.recv_timeout(Duration::from_secs(5));
        let mut id = None;
        let mut shared = shared;
        for _ in 0..500 {
            match Arc::try_unwrap(shared) {
                Ok(i) => {
                    id = Some(i);
                    break;
                }
                Err(back) => {
                    shared = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        let Some(id) = id else {
            return Err(Error::new(
                ErrorKind::Io,
                "connection helper did not release the identifier",
            ));
        };
        let mut guard = IdGuard {
            cm: &d.cm,
            id: Some(id),
        };
        let id = guard.id.as_mut().expect("just set");
        let (peer_private, peer_credit) = match d.unframe(&ev.private_data) {
            Ok(x) => x,
            Err(e) => {
                let _ = id.disconnect();
                return Err(e);
            }
        };
        let peer_ext = ExtDesc::find(&ev.private_data, peer_private.len());
        let unframed = ev.private_data.first() != Some(&pdata::MAGIC);
        let (credit, sink) = CreditArea::pair(credit, peer_credit);
        // The tcp provider answers our frame with one: a reply without is a foreign stack.
        let foreign = unframed;
        warn_no_credits(credit.is_some(), sink.is_some());
        let emu = EmuLink::pair(emu_local, peer_ext, credit.is_some());
        let id = guard.id.take().expect("still held");
        let ep = self.endpoint(
            id,
            cfg,
            peer_private,
            (credit, sink),
            (emu, foreign, None),
            hw_sq_cap,
        );
        self.go_live(&ep, &mb);
        ep.core.speak_first();
        Ok(ep)
    }
}

/// A listener of a verbs provider (an rdma_cm identifier bound and listening).
pub struct VerbsListener<F: Flavor> {
    dom: VerbsDomain<F>,
    id: Option<CmId>,
    mb: Arc<Mailbox>,
    local: SocketAddr,
    /// An accepted connection waiting for its peer's hello mark (see [`HelloWait`]).
    hello: Mutex<Option<HelloWait<F>>>,
}

/// A connection accepted from a peer whose request carried no frame of this framework:
/// this framework's tcp provider, or a foreign iWARP stack. The tcp provider writes its
/// hello mark once its side has read the reply, which may take its application's next
/// look at its connection in the making (`Connecting::poll`): possibly on the very thread
/// that is accepting here (a ring). So the decision is taken without blocking, on this and
/// later calls of `try_accept` (`accept` waits for it), and at most [`HELLO_WAIT`] after
/// the accept a silent peer counts as foreign.
struct HelloWait<F: Flavor> {
    id: CmId,
    mb: Arc<Mailbox>,
    /// The configuration of the call that accepted it (its queues hold the queue pair).
    cfg: spi::OwnedEndpointConfig<VerbsCq<F>>,
    peer_private: Vec<u8>,
    credit: CreditPair,
    extras: AcceptExtras,
    hw_sq_cap: usize,
    since: Instant,
    /// The request carried no frame of this framework.
    frameless: bool,
}

impl<F: Flavor> HelloWait<F> {
    /// `Some(true)`: this framework's tcp provider; `Some(false)`: a foreign stack;
    /// `None`: not known yet.
    fn peer_is_ours(&self) -> Option<bool> {
        let seen = CreditArea::hello_seen(
            self.credit.1.as_ref(),
            &self.cfg.recv_cq.inner,
            self.id.qp_num(),
        );
        seen.or_else(|| (self.since.elapsed() >= HELLO_WAIT).then_some(false))
    }
}

impl<F: Flavor> fmt::Debug for VerbsListener<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsListener")
            .field("provider", &F::NAME)
            .field("local", &self.local)
            .finish()
    }
}

impl<F: Flavor> spi::Listener for VerbsListener<F> {
    type Cq = VerbsCq<F>;
    type Endpoint = VerbsEndpoint<F>;

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn accept(
        &self,
        cfg: &EndpointConfig<'_, VerbsCq<F>>,
        timeout: Duration,
    ) -> Result<VerbsEndpoint<F>> {
        self.dom.inner.check_cfg(cfg)?;
        self.accept_request(cfg, Some(Instant::now() + timeout))?
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::TimedOut,
                    format!("no connection request within {timeout:?}"),
                )
            })
    }

    fn try_accept(&self, cfg: &EndpointConfig<'_, VerbsCq<F>>) -> Result<Option<VerbsEndpoint<F>>> {
        self.dom.inner.check_cfg(cfg)?;
        self.accept_request(cfg, None)
    }
}

/// The endpoint's credit area, or (a foreign peer) our own area as a read sink.
type CreditPair = (Option<CreditArea>, Option<(Arc<Buffer>, Mr)>);

/// Says so when a connection on an iWARP domain (where our credit area exists) runs
/// without credits: its peer named no area (a foreign stack).
fn warn_no_credits(credits: bool, own_area: bool) {
    if !credits && own_area {
        tracing::warn!("peer has no credit area (not this framework's iwarp or tcp provider): no credit flow control on this connection");
    }
}
/// The emulation of an accepted endpoint: the link, or (a frame-less initiator, which may
/// be this framework's tcp provider announcing its area with its hello mark) our area
/// kept until the peer's kind is known.
#[derive(Debug)]
enum AcceptEmu {
    Link(Option<EmuLink>),
    Undecided(Option<(Arc<Buffer>, Mr, u32)>),
}

/// The emulation and the early receives of an accepted endpoint.
type AcceptExtras = (AcceptEmu, Option<EarlyRing>);

/// Readable while a connection request waits for `try_accept` (the CM thread raises it
/// when it queues one; taking the last lowers it).
impl<F: Flavor> AsFd for VerbsListener<F> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.mb
            .requests()
            .fd()
            .expect("the listener's descriptor is made by listen")
    }
}

impl<F: Flavor> VerbsListener<F> {
    /// Accepts the oldest connection request (the configuration checked), waiting for one
    /// until `deadline` (`None`: not at all; then `Ok(None)` when none waits). A request
    /// that cannot be served (another device, a malformed frame) is refused and the next
    /// one taken; a failure to answer one is returned once the deadline passed (at once
    /// without one). The body of `accept` and `try_accept`.
    fn accept_request(
        &self,
        cfg: &EndpointConfig<'_, VerbsCq<F>>,
        deadline: Option<Instant>,
    ) -> Result<Option<VerbsEndpoint<F>>> {
        let d = &self.dom.inner;
        loop {
            // A connection accepted earlier that waits for its peer's hello comes first.
            let mut waiting = self.hello.lock().expect("listener poisoned");
            if let Some(w) = waiting.as_ref() {
                match w.peer_is_ours() {
                    Some(ours) => {
                        let w = waiting.take().expect("checked");
                        drop(waiting);
                        self.mb.lower_requests();
                        return Ok(Some(self.go_live(w, !ours)));
                    }
                    None if deadline.is_none_or(|t| Instant::now() >= t) => {
                        // Readable until it is decided: the caller comes back.
                        self.mb.requests().raise();
                        return Ok(None);
                    }
                    None => {
                        drop(waiting);
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                }
            }
            drop(waiting);
            let Some(ev) = self.mb.take_request(deadline) else {
                return Ok(None);
            };
            // SAFETY: a connection request's identifier is new and adopted only here.
            #[allow(unsafe_code)]
            let mut id = unsafe { CmId::adopt(ev.id) };
            if id.ctx() != Some(d.ctx) {
                tracing::warn!("connection request on another device refused");
                id.reject();
                continue;
            }
            let (peer_private, peer_credit) = match d.unframe(&ev.private_data) {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("connection request refused: {e}");
                    id.reject();
                    continue;
                }
            };
            let peer_ext = ExtDesc::find(&ev.private_data, peer_private.len());
            let foreign = ev.private_data.first() != Some(&pdata::MAGIC);
            match self.finish_accept(&mut id, cfg, &ev, peer_credit, (peer_ext, foreign)) {
                Ok((mb, credit, extras, hw_sq_cap)) => {
                    let w = HelloWait {
                        id,
                        mb,
                        cfg: spi::OwnedEndpointConfig::of(cfg),
                        peer_private,
                        credit,
                        extras,
                        hw_sq_cap,
                        since: Instant::now(),
                        frameless: foreign,
                    };
                    if !foreign {
                        return Ok(Some(self.go_live(w, false)));
                    }
                    // A peer without our frame: this framework's tcp provider if it
                    // writes its hello mark, else a foreign stack (see `HelloWait`).
                    *self.hello.lock().expect("listener poisoned") = Some(w);
                }
                Err(e) => {
                    if e.kind() == ErrorKind::InvalidArgument {
                        id.reject();
                    }
                    d.cm.reap(id);
                    if e.kind() == ErrorKind::InvalidArgument {
                        return Err(e);
                    }
                    tracing::warn!("accepting a connection failed: {e}");
                    if deadline.is_none_or(|t| Instant::now() >= t) {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Makes the endpoint of an accepted connection and brings it to life; `foreign`: the
    /// peer is not of this framework.
    fn go_live(&self, w: HelloWait<F>, foreign: bool) -> VerbsEndpoint<F> {
        // A frame-less peer that wrote its hello mark is this framework's tcp provider: it
        // runs credits when it named its own area before the mark (and emulates when it
        // named its emulation area too).
        let peer_emu = (w.frameless && !foreign)
            .then(|| CreditArea::announced_emu(w.credit.1.as_ref()))
            .flatten();
        let credit = if w.frameless && !foreign {
            CreditArea::announced(w.credit.1)
        } else {
            w.credit
        };
        warn_no_credits(credit.0.is_some(), credit.1.is_some());
        let (emu, mut early) = w.extras;
        let emu = match emu {
            AcceptEmu::Link(link) => link,
            // This framework's tcp provider names its emulation area before its hello mark
            // (as it names its credit area); a foreign stack names none.
            AcceptEmu::Undecided(local) if !foreign => {
                EmuLink::pair(local, peer_emu, credit.0.is_some())
            }
            AcceptEmu::Undecided(_) => None,
        };
        if let Some(e) = early.as_mut() {
            // This framework's tcp provider consumes the early receives with fillers.
            e.fillers = !foreign;
        }
        let ep = self.dom.endpoint(
            w.id,
            &w.cfg.config(),
            w.peer_private,
            credit,
            (emu, foreign, early),
            w.hw_sq_cap,
        );
        self.dom.go_live(&ep, &w.mb);
        ep
    }

    fn finish_accept(
        &self,
        id: &mut CmId,
        cfg: &EndpointConfig<'_, VerbsCq<F>>,
        req: &CmEvent,
        peer_credit: Option<(u64, u32)>,
        (peer_ext, foreign): (Option<ExtDesc>, bool),
    ) -> Result<(Arc<Mailbox>, CreditPair, AcceptExtras, usize)> {
        let d = &self.dom.inner;
        let mb = Arc::new(Mailbox::default());
        d.cm.register(id.key(), Target::Mailbox(mb.clone()));
        let hw_sq_cap = self.dom.make_qp(id, cfg)?;
        d.set_ack_timeout(id)?;
        let credit = self.dom.credit_area()?;
        let emu_local = self.dom.emu_area(cfg.rq_depth)?;
        let private = d.frame(cfg.private_data, credit.as_ref(), emu_local.as_ref());
        // A foreign iWARP peer may send before our application can post a receive.
        let early = if foreign && d.profile.credits {
            if cfg.recv_cq.inner.reserve_internal(EarlyRing::SLOTS) {
                match EarlyRing::post(d, id) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        cfg.recv_cq.inner.release_internal(EarlyRing::SLOTS);
                        return Err(e);
                    }
                }
            } else {
                tracing::warn!("no completion-queue room for early receives: a foreign peer sending at once breaks the connection");
                None
            }
        } else {
            None
        };
        let rd = d.rd_atom();
        let established = id
            .accept(&ConnParam {
                private_data: &private,
                responder_resources: rd.min(req.initiator_depth),
                initiator_depth: rd.min(req.responder_resources),
                retry_count: d.profile.retry,
                rnr_retry_count: d.profile.rnr_retry,
            })
            .map_err(Error::from)
            .and_then(|()| {
                expect(
                    &mb,
                    Instant::now() + cfg.timeout,
                    cm_event::RDMA_CM_EVENT_ESTABLISHED,
                    self.local,
                    "accepting a connection",
                    cfg.timeout,
                )
            });
        if let Err(e) = established {
            if early.is_some() {
                // The queue pair is reaped with the identifier: its early receives never
                // reach an endpoint.
                cfg.recv_cq.inner.release_internal(EarlyRing::SLOTS);
            }
            return Err(e);
        }
        let (credit, sink) = CreditArea::pair(credit, peer_credit);
        let emu = if foreign {
            AcceptEmu::Undecided(emu_local)
        } else {
            AcceptEmu::Link(EmuLink::pair(emu_local, peer_ext, credit.is_some()))
        };
        Ok((mb, (credit, sink), (emu, early), hw_sq_cap))
    }
}

impl<F: Flavor> Drop for VerbsListener<F> {
    fn drop(&mut self) {
        let d = &self.dom.inner;
        if let Some(id) = self.id.take() {
            d.cm.unregister(id.key());
            drop(id);
        }
        let waiting = self.hello.get_mut().map(Option::take).unwrap_or(None);
        if let Some(w) = waiting {
            // Accepted, never handed out: the connection goes down with its identifier.
            if w.extras.1.is_some() {
                w.cfg.recv_cq.inner.release_internal(EarlyRing::SLOTS);
            }
            d.cm.reap(w.id);
        }
        for ev in self.mb.take_all() {
            if ev.kind == cm_event::RDMA_CM_EVENT_CONNECT_REQUEST {
                // SAFETY: a request nobody accepted: its identifier is adopted only here.
                #[allow(unsafe_code)]
                let id = unsafe { CmId::adopt(ev.id) };
                id.reject();
            }
        }
    }
}

/// A verbs registration: the local registration (lkey) lives as long as the region's
/// last user; the remote one (rkey) dies at deregistration.
struct VerbsRegistration {
    lkey: u32,
    rkey: u32,
    _local: Mr,
    remote: Mutex<Option<Mr>>,
    /// Where the key grants emulated atomics: the domain's map it is in.
    atomic_keys: Option<Arc<AtomicKeys>>,
}

impl fmt::Debug for VerbsRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsRegistration")
            .field("lkey", &format_args!("{:#x}", self.lkey))
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .finish()
    }
}

impl Registration for VerbsRegistration {
    fn local_key(&self) -> u32 {
        self.lkey
    }
    fn remote_key(&self) -> u32 {
        self.rkey
    }
    fn revoke(&self) {
        // ibv_dereg_mr of the remote registration: the key is dead when this returns. The
        // emulated-atomics grant goes first, before the device may reuse the key.
        let mut remote = self.remote.lock().expect("registration poisoned");
        if let Some(k) = &self.atomic_keys {
            if remote.is_some() {
                k.remove(self.rkey);
            }
        }
        drop(remote.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// siw's facts, as Linux 6.1 reports them.
    fn siw_facts() -> DeviceFacts {
        DeviceFacts {
            name: "siw0".into(),
            transport: crate::Transport::Iwarp,
            node_guid: 0,
            fw_ver: String::new(),
            vendor_id: 0,
            max_mr_size: u64::MAX,
            max_qp_wr: 32768,
            max_sge: 6,
            max_sge_rd: 1,
            max_cqe: 3_276_800,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            atomic_cap: 0,
            max_inline: 80,
            ports: Vec::new(),
        }
    }

    #[test]
    fn limits_leave_room_for_the_header_and_the_provider_requests() {
        let dev = siw_facts();
        let mut p = Profile {
            atomics: false,
            immediate: false,
            emulate: false,
            credits: true,
            delivery_reads: true,
            split_reads: true,
            sink_remote_write: true,
            transport_private_data: 248,
            rnr_retry: 7,
            retry: 7,
            ack_timeout: None,
            min_rnr_timer: None,
            infer_terminate: true,
            length_as_malformed_wqe: false,
            read_protection: false,
            listen_early_close: false,
            soft_fence: true,
            liveness_probes: true,
            small_page_crossing: false,
            mmap_sentinel_guard: false,
            unsupported: BTreeMap::new(),
            emulated: Vec::new(),
        };
        let l = limits_of(&dev, &p, 1);
        assert_eq!(
            l.max_private_data as usize,
            248 - pdata::HEADER - pdata::AREA_DESC_LEN
        );
        assert_eq!(pieces(&dev, &p), 6);
        assert!(l.max_send_queue as usize * 6 + CREDIT_SLOTS <= 32768);
        assert_eq!(
            ops_of(&p, &l),
            OpSet::SEND | OpSet::WRITE | OpSet::READ | OpSet::INLINE | OpSet::RNR_WAIT
        );
        p.credits = false;
        p.delivery_reads = false;
        p.split_reads = false;
        p.atomics = true;
        p.immediate = true;
        let l = limits_of(&dev, &p, 1);
        assert_eq!(l.max_send_queue, 32768);
        assert_eq!(l.max_cq_entries, 3_276_800);
        // The device's 128, as perftest asks for; a device offering fewer caps it.
        assert_eq!(l.max_outstanding_reads, 128);
        let small = DeviceFacts {
            max_qp_init_rd_atom: 8,
            ..siw_facts()
        };
        assert_eq!(limits_of(&small, &p, 1).max_outstanding_reads, 8);
        assert!(ops_of(&p, &l).contains(OpSet::ATOMICS | OpSet::SEND_IMM | OpSet::WRITE_IMM));
    }

    #[test]
    fn a_queue_created_without_an_errno_on_siw_names_the_sentinel() {
        let mut p = Profile::ib_transport(&siw_facts());
        p.mmap_sentinel_guard = true;
        let silent = std::io::Error::other("failed without an errno");
        let e = creation_error(&p, "creating the queue pair", silent);
        assert!(
            e.message()
                .starts_with("creating the queue pair: failed without an errno")
                && e.message().contains("0x90000"),
            "{e}"
        );
        assert_eq!(e.code(), None);
        let nomem = std::io::Error::from_raw_os_error(libc::ENOMEM);
        let e = creation_error(&p, "creating the completion queue", nomem);
        assert!(!e.message().contains("0x90000"), "{e}");
        assert_eq!(e.code(), Some(ProviderCode::Errno(libc::ENOMEM)));
        p.mmap_sentinel_guard = false;
        let e = creation_error(&p, "creating the queue pair", std::io::Error::other("x"));
        assert!(!e.message().contains("0x90000"), "{e}");
    }
}
