//! The shared verbs core of the `ib`, `roce` and `iwarp` providers.
//!
//! Everything that talks to rdma-core (libibverbs and librdmacm) lives here, in two audited
//! private modules: `ffi`, owning wrappers over rdma-core's objects, and `sys`, which loads
//! the libraries at run time (`dlopen`; [`rdma_core`] says from where, or why not) and
//! keeps `rdma-sys`'s C types. Every `unsafe` block carries a `// SAFETY:` line. The three providers are thin layers: each names its devices (a
//! [`Flavor`]: transport and link layer), picks its port and address (RoCE: a RoCE v2 GID
//! matching the address in use; InfiniBand: LID addressing), and declares a [`Profile`]:
//! which operations the transport has and which contract rules the core must emulate.
//!
//! # What the core does
//! * Discovery ([`device::probe`]): devices, ports, GID tables with their RoCE types (sysfs
//!   `gid_attrs`), and capabilities from the device (`atomic_cap`, `max_sge`, `max_qp_wr`,
//!   `max_qp_rd_atom`, MTU, link layer, transport; max inline by creating a probe QP).
//! * A protection domain per [`VerbsDomain`], memory registration (`spi::Domain::register`;
//!   semantics below), completion queues with a completion channel ([`VerbsCq`]), RC queue
//!   pairs connected through rdma_cm with private data ([`VerbsEndpoint`],
//!   [`VerbsListener`]), and a connection-manager thread per domain that turns peer
//!   disconnects into `EndpointState::Disconnected` and flushes.
//! * Connections without blocking the application: a listener's descriptor is readable
//!   while a connection request waits (the connection-manager thread raises it), and
//!   [`VerbsConnecting`] runs the blocking connection setup on a short-lived thread of its
//!   own. Every change of an endpoint's state is reported once as an
//!   [`EndpointEvent`](fabric_api::EndpointEvent) (`next_event`, `event_fd`), and every
//!   completion carries the endpoint's `ep_context`, the provider's own completions
//!   (flushes, emulated atomics and immediate data, delivery reads) included.
//!
//! # Memory registration and deregistration
//! A region with remote rights is registered twice: a *local* registration (its `lkey`
//! names the memory in our own requests) and a *remote* one (its `rkey` is the key in the
//! region's [`RemoteDesc`](fabric_api::RemoteDesc)). Deregistration (dropping the
//! `MemoryRegion`) deregisters the remote registration at once, so the key is dead at
//! once, as the contract says; the local registration, and the memory, live until the last
//! operation using the region completed (operations hold a `RegionRef`) or its queue pair
//! was destroyed. So `ibv_dereg_mr` never runs under an in-flight local operation. (An
//! inline payload is read during the post itself: its operation holds nothing after.)
//!
//! # Two posting paths
//! Every send-queue request is recorded in the endpoint's ledger, in posting order, until
//! its completion. A request that needs more than the one hardware request the application
//! asked for (emulated atomics and immediate data, credit updates, iWARP's delivery reads,
//! a page-crossing workaround), or that must wait (held-back requests before it, a full
//! device queue), is planned and posted by the ledger. On a connection that needs none of
//! that (roce, ib), a request with nothing held back goes straight from `post_send`
//! to the device, built on the stack, and its successful completion is reported without
//! the ledger's searches: the same requests and completions, fewer instructions (about 2 900
//! against 5 500 per 8-byte send iteration on rxe; see docs/benchmarks-record.md).
//!
//! # Completion queues never overrun
//! Every hardware request is posted signaled; a request the application posted unsignaled
//! has its successful completion swallowed by the provider. Each posted request reserves a
//! slot of the application's queue (as the tcp provider does) and requests the provider
//! adds for its own purposes reserve from a separate internal budget; the device queue is
//! sized for both, so it cannot overrun, and a post that would exceed the application's
//! capacity fails `QueueFull` (after reaping what the device already completed).
//!
//! # Lock order
//! A completion queue's lock, then an endpoint's lock, never the other way round (see the
//! private `sync` module): draining a device queue runs under the queue's lock and calls
//! into the endpoints with completions in it. An endpoint that needs provider slots while
//! holding its lock takes them only if free; reaping for them happens with its lock
//! released (`EpCore::retry_blocked`). Debug builds check the order on every acquisition
//! and panic naming both locks; loom models (`src/loom_models.rs`, run with
//! `CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" cargo test -p fabric-verbs --release --lib loom`)
//! explore the RNR thread's reap, and its dead-peer path (liveness probe, declaring a
//! peer dead), against the application's polling and posting.
//!
//! # Dead peers: how long until `RetryExceeded`
//! *InfiniBand transports (roce, ib).* Every queue pair gets the local ACK timeout
//! [`RC_ACK_TIMEOUT`] = 16 (rdma_cm `RDMA_OPTION_ID_ACK_TIMEOUT`, set before route
//! resolution on the active side and before accept on the passive side; a kernel that
//! refuses it fails the connection) and the transport retry count [`RC_RETRY_COUNT`] = 6
//! (rdma_cm's `retry_count`, the queue pair's `retry_cnt`). A request to a peer that no
//! longer answers (host down, link cut; a killed process's queue pair is gone and soft-RoCE
//! drops packets for it) is sent once and retransmitted `retry_cnt` times, each try
//! waiting for the ACK timeout, then completes `IBV_WC_RETRY_EXC_ERR`, reported
//! `RetryExceeded`; everything behind it flushes. The bound ([`DEAD_PEER_BOUND`]):
//!
//! ```text
//! 4.096 us x 2^timeout x (retry_cnt + 1) = 4.096 us x 65536 x 7 = 268.4 ms x 7 = 1.879 s
//! ```
//!
//! nominally: InfiniBand lets a device's timer run longer than the nominal value (up to
//! four times per try), and soft-RoCE rounds it up to whole jiffies.
//! Why 6 and not 7 retries: soft-RoCE treats `retry_cnt` 7 as "retry forever"
//! (`rxe_comp.c` in Linux 6.1: `if (qp->comp.retry_cnt != 7) qp->comp.retry_cnt--;`), so
//! 7 would never fail there. The receiver-not-ready retry count stays 7 (retry forever,
//! the contract's "a send with no posted receive waits"): it counts RNR NAKs, which only
//! a live peer sends. Without the explicit timeout Linux 6.1's rdma_cm would give a RoCE
//! queue pair timeout 19 (`CMA_IBOE_PACKET_LIFETIME` 18, plus one): 2.15 s per try.
//!
//! *iWARP (siw).* An iWARP queue pair has no ACK timer: it runs over a kernel TCP socket,
//! and siw (`siw_cm.c`) sets only `TCP_NODELAY` and `SO_REUSEADDR` on it: no keepalive,
//! no `TCP_USER_TIMEOUT`. Left to TCP, a silent peer is noticed only while data is
//! unacknowledged, after `net.ipv4.tcp_retries2` (default 15) retransmissions, some 924.6 s,
//! and never on an idle connection. So the core detects dead peers itself there
//! ([`Profile::liveness_probes`]), as UCX's keepalive does, at the protocol level:
//!
//! * The domain's helper thread (the RNR thread: one per domain, no thread per endpoint)
//!   looks at every endpoint once per [`liveness_tick`], a twentieth of the dead-peer
//!   timeout ([`VerbsOptions::dead_peer_timeout`], default [`DEFAULT_DEAD_PEER_TIMEOUT`]
//!   = 10 s, configured as `[iwarp] dead_peer_timeout_ms`).
//! * A sign of life is any completion of the endpoint's queue pair (the application's
//!   requests, credit updates, delivery reads, probes), and any TCP segment the
//!   connection's socket received from the peer (`tcp_info`'s `tcpi_last_ack_recv` and
//!   `tcpi_last_data_recv`, read through `NETLINK_SOCK_DIAG`, which sees siw's kernel
//!   socket): a healthy peer in the middle of a long transfer keeps acknowledging or
//!   sending, so it is never declared dead; a peer that merely posts no receives (sends
//!   held for credits) answers probes.
//! * After a quarter of the timeout without a sign of life (idle or not) the endpoint is
//!   probed: its delivery read (the peer's whole credit area, 64 bytes; a zero-length RDMA Read
//!   of a peer without one, which base RDMAP carries to any peer), posted unfenced ahead of
//!   held-back work, one probe at a time. An idle endpoint of a live peer thus costs a
//!   small read every few seconds.
//! * Once the quiet time reaches the timeout less one tick the peer is declared dead
//!   (logged as a warning): the endpoint enters `Error`, the connection is closed and the
//!   queue pair destroyed (nothing it was asked to do lands later), the oldest outstanding
//!   application request completes `RetryExceeded` and every other one `Flushed`, in
//!   posting order, receives `Flushed`.
//!
//! The bound: an operation outstanding to a dead peer completes `RetryExceeded` within the
//! dead-peer timeout of the peer's last sign of life, hence of the later of the silence
//! and the operation's posting (between 19/20 of it and all of it, give or take the helper
//! thread's scheduling). Where the kernel cannot tell when the socket last heard the peer
//! (no `inet_diag`), completions alone count, which is logged once per endpoint: then a
//! single transfer taking longer than the timeout without a completion is declared dead.
//! It is an emulation, declared as such in the provider's emulated features.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(unsafe_code)]

mod cm;
mod connecting;
mod cq;
pub mod device;
mod domain;
mod emu;
mod ep;
#[cfg(debug_assertions)]
pub mod fault;
#[allow(unsafe_code)]
mod ffi;
mod fifo;
pub mod gid;
#[cfg(all(test, loom))]
mod loom_models;
pub mod status;
mod sync;
#[allow(unsafe_code)]
mod sys;

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use fabric_api::Emulation;

pub use connecting::VerbsConnecting;
pub use cq::VerbsCq;
pub use device::{DeviceFacts, LinkLayer, PortFacts, ProbeError, Transport};
pub use domain::{provider_info, VerbsDomain, VerbsListener};
pub use ep::VerbsEndpoint;
pub use gid::{Gid, GidEntry, GidKind};
pub use sys::{rdma_core, LoadError, RdmaCore, LIBIBVERBS, LIBRDMACM};

/// What one provider built on the core is: which devices it takes and how it uses them.
pub trait Flavor: Send + Sync + fmt::Debug + 'static {
    /// Provider name (`roce`, `iwarp`, `ib`).
    const NAME: &'static str;

    /// `Ok` when the device belongs to this provider, else why not (in words).
    fn accepts(dev: &DeviceFacts) -> Result<(), String>;

    /// Picks the port, address and GID to use on an accepted device.
    fn select(dev: &DeviceFacts, opts: &VerbsOptions) -> Result<Selection, String>;

    /// How the core must behave on this transport.
    fn profile(dev: &DeviceFacts) -> Profile;

    /// The reason given when no device of this provider exists.
    fn no_device() -> String;
}

/// Provider options (from configuration).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerbsOptions {
    /// Use this device only (`rxe0`); default: the first usable one.
    pub device: Option<String>,
    /// Use this local IP address (RoCE: the GID matching it; iWARP: the netdev holding it).
    pub address: Option<IpAddr>,
    /// IP type-of-service byte (DSCP << 2 | ECN) for RoCE v2 traffic; maps to the traffic
    /// class of the GRH. `None`: the kernel default (0).
    pub traffic_class: Option<u8>,
    /// How long an endpoint may show no sign of life before the provider declares its peer
    /// dead, where the provider detects dead peers itself ([`Profile::liveness_probes`]:
    /// iWARP). `None`: [`DEFAULT_DEAD_PEER_TIMEOUT`]. Valid: [`DEAD_PEER_TIMEOUT_RANGE`].
    pub dead_peer_timeout: Option<std::time::Duration>,
}

/// The port, address and GID a domain uses on its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Port number.
    pub port: u8,
    /// Local IP address connections are made from (rdma_cm source address).
    pub addr: Option<IpAddr>,
    /// The GID table entry in use, when the transport has GIDs.
    pub gid: Option<GidEntry>,
    /// What was chosen, in words, for the selection report (device, port, GID, version).
    pub summary: String,
}

/// How the core must behave on a transport: what it has natively, what the core emulates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// Native 64-bit atomics (the device's `atomic_cap` is not NONE).
    pub atomics: bool,
    /// Immediate data on sends and writes.
    pub immediate: bool,
    /// Atomics and immediate data the transport lacks are emulated between peers of this
    /// framework, over base RDMAP (iWARP): provider-internal messages written into an
    /// emulation area of the peer, executed by the target's helper thread (see the `emu`
    /// module). Needs `credits` and an inline limit of at least 56 bytes.
    pub emulate: bool,
    /// Receiver-not-ready by credits: a send is held by the provider until the peer has
    /// advertised a posted receive (iWARP, where a send without a receive is fatal).
    pub credits: bool,
    /// Delivery-complete sends and writes: each is followed by a small RDMA Read of the
    /// peer and completes only when the read returns (iWARP completes them at transmit).
    /// Requests posted `SendFlags::TRANSMIT_COMPLETE` go without it.
    pub delivery_reads: bool,
    /// Reads whose scatter list is longer than the device's read limit are split into one
    /// read per entry.
    pub split_reads: bool,
    /// Read sinks need REMOTE_WRITE on the local registration (iWARP: the sink STag is
    /// carried in the Read Request and the response is a tagged placement into it).
    pub sink_remote_write: bool,
    /// Largest private data the transport carries on connect and accept (before the core's
    /// own header).
    pub transport_private_data: u32,
    /// RNR retry count for rdma_cm (7: retry forever; the contract's "sender waits").
    pub rnr_retry: u8,
    /// Transport retry count for rdma_cm (`retry_cnt`: retransmissions after the first
    /// try; at most 7).
    pub retry: u8,
    /// Local ACK timeout exponent set on every queue pair (InfiniBand transports): a try
    /// waits 4.096 us x 2^`ack_timeout`. With `retry` it bounds how long an operation to
    /// a dead peer takes to fail `RetryExceeded` (see the crate docs). `None`: the
    /// transport has no such timer (iWARP: TCP's retransmission timeout governs).
    pub ack_timeout: Option<u8>,
    /// RNR NAK timer this side advertises (IB encoding; 12 = 0.64 ms), if settable.
    pub min_rnr_timer: Option<u8>,
    /// The device reports a receive too short for its message as a malformed WQE
    /// (`IBV_WC_LOC_QP_OP_ERR` at the receiver, `IBV_WC_REM_OP_ERR` at the sender) instead
    /// of `IBV_WC_LOC_LEN_ERR` / `IBV_WC_REM_INV_REQ_ERR`: soft-RoCE in Linux 6.1
    /// (`rxe_resp.c`: `copy_data` fails with `-EINVAL` when the payload exceeds the
    /// receive, `send_data_in` turns that into `RESPST_ERR_MALFORMED_WQE`). The core's
    /// receives are well-formed by construction (every entry names a live registration of
    /// the domain), so on such a device it reports those statuses of receives and sends as
    /// `LocalLength` and `RemoteInvalidRequest`, keeping the raw status.
    pub length_as_malformed_wqe: bool,
    /// The device does not tell why a connection died (siw reports a received Terminate
    /// only in the kernel log and flushes everything): when the queue pair dies without
    /// the peer's close mark, the oldest outstanding request is reported with the error
    /// the peer's Terminate most likely carried (`RemoteAccess` for RDMA Write and Read,
    /// `RemoteInvalidRequest` for a Send), keeping the raw `IBV_WC_WR_FLUSH_ERR`; the rest
    /// complete `Flushed`.
    pub infer_terminate: bool,
    /// The device refuses remote reads of regions registered without REMOTE_READ. The
    /// kernel's siw does not: it builds Read Responses with `siw_check_sgl_tx(pd, wqe, 0)`
    /// (siw_qp_tx.c), which checks the key and bounds but no access right.
    pub read_protection: bool,
    /// A client that closes its TCP connection before the device's listener accepted it
    /// leaves the listener listening. The kernel's siw in Linux 6.1 does not: the accepted
    /// socket still in the listening socket's queue carries the listener's `sk_user_data`
    /// and state-change callback, so the client's FIN queues a peer-close work item on the
    /// *listening* endpoint (`siw_cm_llp_state_change`), whose handler releases the
    /// listening socket without telling the connection manager (`siw_cm_work_handler`,
    /// `SIW_CM_WORK_PEER_CLOSE`, siw_cm.c). Further clients are refused with a TCP reset.
    /// Not an issue where the listener is not a TCP socket (InfiniBand and RoCE: the IB CM).
    pub listen_early_close: bool,
    /// Fences are kept by the core, not the device: a request posted with a fence waits in
    /// the core until every read posted before it has completed, then goes to the device
    /// without `IBV_SEND_FENCE`. For the kernel's siw in Linux 6.1, where a fenced request
    /// can deadlock a connection: the request waits in the transmit slot
    /// (`siw_activate_tx_from_sq` sets `orq_fence`), and a Read Request that arrives
    /// meanwhile is parked in the inbound read queue without restarting the transmitter
    /// (`siw_init_rresp` in siw_qp_rx.c: `run_sq = 0` when the slot is busy), so its
    /// response waits for the fence. When both ends are fenced behind a read of the other,
    /// neither answers, and the connection stops for good (seen with the RDM layer's
    /// traffic in both directions: every send is fenced behind the previous one's delivery
    /// read).
    pub soft_fence: bool,
    /// The device garbles a payload of at most 32 bytes taken from registered memory when
    /// it crosses a page boundary: the kernel's siw in Linux 6.1 (`siw_try_1seg` in
    /// `siw_qp_tx.c` copies the length of the second piece from the first page, then the
    /// rest from the first page again), for Read Responses always and for writes and sends
    /// sent from its transmit thread. The core splits such reads at the remote page
    /// boundary and such writes at the local one, and sends such sends inline. The same
    /// copy fails (`EFAULT`, and siw drops the connection) when siw's transmit thread makes
    /// it while the queue pair's `in_syscall` flag is still set by the poster's
    /// `ibv_post_send` (`fabric_api::pdata::area::READ_LEN`): with this flag every send or
    /// write of at most 32 bytes goes inline when the device allows, and delivery reads are
    /// longer than 32 bytes everywhere.
    pub small_page_crossing: bool,
    /// The device's user library takes a good queue mapped at one mmap offset for a failed
    /// one: libsiw (rdma-core) reads offset 0x90000 as its "no mapping" sentinel, destroys
    /// the QP or CQ it was creating and returns NULL with errno untouched. The kernel hands
    /// out the offsets of a context first-fit from 0, so which queue lands there depends on
    /// the order queues were created in: about one run in ten of three endpoints opened
    /// from three threads failed to create a queue pair. The domain puts a CQ whose queue
    /// covers the offsets below 1 MiB on librdmacm's context before anything else, once per
    /// process, so no queue can begin at the sentinel.
    pub mmap_sentinel_guard: bool,
    /// Dead-peer detection by the provider (iWARP, whose queue pairs have no ACK timer):
    /// the domain's helper thread watches every endpoint and probes a quiet one with a
    /// delivery read; an endpoint that shows no sign of life within the dead-peer timeout
    /// ([`VerbsOptions::dead_peer_timeout`]) is declared dead (see the crate docs).
    pub liveness_probes: bool,
    /// Operations declared unsupported, with the reason.
    pub unsupported: BTreeMap<String, String>,
    /// What the core emulates on this transport.
    pub emulated: Vec<Emulation>,
}

/// Local ACK timeout exponent of the InfiniBand transports: 4.096 us x 2^16 = 268.4 ms
/// per try. Long enough for congested fabrics and for soft-RoCE under emulation; short
/// enough that a dead peer is noticed in seconds (see [`DEAD_PEER_BOUND`]).
pub const RC_ACK_TIMEOUT: u8 = 16;

/// Transport retries of the InfiniBand transports (`retry_cnt`): 6, the most that is
/// finite everywhere (soft-RoCE retries forever at 7; see the crate docs).
pub const RC_RETRY_COUNT: u8 = 6;

/// How long an operation outstanding to a dead peer takes at most to complete
/// `RetryExceeded` on the InfiniBand transports, nominally: 4.096 us x 2^[`RC_ACK_TIMEOUT`]
/// x ([`RC_RETRY_COUNT`] + 1) = 268.4 ms x 7 = 1.879 s (see the crate docs).
pub const DEAD_PEER_BOUND: std::time::Duration =
    std::time::Duration::from_nanos(4096 * (1 << RC_ACK_TIMEOUT) * (RC_RETRY_COUNT as u64 + 1));

/// The dead-peer timeout of the providers that detect dead peers themselves (iWARP) when
/// none is configured: 10 s, as the tcp provider's.
pub const DEFAULT_DEAD_PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The dead-peer timeouts a domain accepts: 2 s to an hour (as the tcp provider's).
pub const DEAD_PEER_TIMEOUT_RANGE: std::ops::RangeInclusive<std::time::Duration> =
    std::time::Duration::from_secs(2)..=std::time::Duration::from_secs(3600);

/// How often the helper thread looks at the endpoints of a domain that detects dead peers
/// itself: a twentieth of the dead-peer timeout (500 ms for 10 s).
pub fn liveness_tick(timeout: std::time::Duration) -> std::time::Duration {
    timeout / 20
}

/// The vendor id soft-RoCE (rxe) reports.
pub const SOFT_ROCE_VENDOR_ID: u32 = 0x00ff_ffff;

/// Private data an InfiniBand CM REQ carries for rdma_cm's TCP port space (92 bytes less
/// rdma_cm's 36-byte header); the REP carries more, so the REQ bounds both.
pub const IB_CM_PRIVATE_DATA: u32 = 56;

impl Profile {
    /// The InfiniBand transport (an InfiniBand or an Ethernet link layer, RC queue pairs):
    /// everything native, atomics as the device reports them, receiver-not-ready retried
    /// forever.
    pub fn ib_transport(dev: &DeviceFacts) -> Profile {
        let mut unsupported = BTreeMap::new();
        if !dev.has_atomics() {
            for op in ["FETCH_ADD", "COMPARE_SWAP"] {
                unsupported.insert(
                    op.to_string(),
                    format!("{} reports atomic_cap ATOMIC_NONE", dev.name),
                );
            }
        }
        Profile {
            atomics: dev.has_atomics(),
            immediate: true,
            emulate: false,
            credits: false,
            delivery_reads: false,
            split_reads: false,
            sink_remote_write: false,
            transport_private_data: IB_CM_PRIVATE_DATA,
            rnr_retry: 7,
            retry: RC_RETRY_COUNT,
            ack_timeout: Some(RC_ACK_TIMEOUT),
            min_rnr_timer: Some(12),
            infer_terminate: false,
            length_as_malformed_wqe: dev.vendor_id == SOFT_ROCE_VENDOR_ID,
            read_protection: true,
            listen_early_close: true,
            soft_fence: false,
            liveness_probes: false,
            small_page_crossing: false,
            mmap_sentinel_guard: false,
            unsupported,
            emulated: Vec::new(),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn dead_peer_bound_is_the_documented_arithmetic() {
        // 4.096 us x 2^16 x (6 + 1)
        assert_eq!(DEAD_PEER_BOUND.as_nanos(), 4096 * 65536 * 7);
        assert_eq!(DEAD_PEER_BOUND.as_millis(), 1879);
        let dev = DeviceFacts {
            name: "rxe0".into(),
            transport: Transport::InfiniBand,
            node_guid: 0,
            fw_ver: String::new(),
            vendor_id: SOFT_ROCE_VENDOR_ID,
            max_mr_size: u64::MAX,
            max_qp_wr: 1024,
            max_sge: 32,
            max_sge_rd: 32,
            max_cqe: 1024,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            atomic_cap: 1,
            max_inline: 64,
            ports: Vec::new(),
        };
        let p = Profile::ib_transport(&dev);
        assert_eq!((p.ack_timeout, p.retry), (Some(16), 6));
        // rxe retries forever at retry_cnt 7: the bound needs less.
        assert!(p.retry < 7);
    }
}
