//! Device discovery: what libibverbs and sysfs say about every RDMA device, as plain data.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::ffi;
use crate::gid::{Gid, GidEntry, GidKind};

/// Transport of a device (`ibv_transport_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// InfiniBand transport: InfiniBand and RoCE devices.
    InfiniBand,
    /// iWARP.
    Iwarp,
    /// Anything else (usNIC, unknown), with the raw value.
    Other(i32),
}

impl Transport {
    fn from_raw(v: i32) -> Transport {
        match v {
            0 => Transport::InfiniBand,
            1 => Transport::Iwarp,
            o => Transport::Other(o),
        }
    }
    /// Name as `fabric info` prints it.
    pub fn name(&self) -> String {
        match self {
            Transport::InfiniBand => "InfiniBand".into(),
            Transport::Iwarp => "iWARP".into(),
            Transport::Other(v) => format!("other ({v})"),
        }
    }
}

/// Link layer of a port (`IBV_LINK_LAYER_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// Unspecified (old InfiniBand drivers report this for IB ports).
    Unspecified,
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE, iWARP).
    Ethernet,
}

impl LinkLayer {
    fn from_raw(v: u8) -> LinkLayer {
        match v {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            _ => LinkLayer::Unspecified,
        }
    }
    /// Name as `fabric info` prints it.
    pub fn name(&self) -> &'static str {
        match self {
            LinkLayer::Unspecified => "unspecified",
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
        }
    }
}

/// `ibv_port_state` names.
pub fn port_state_name(s: u32) -> &'static str {
    match s {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

/// `ibv_mtu` in bytes.
pub fn mtu_bytes(m: u32) -> u32 {
    match m {
        1..=5 => 128 << m,
        _ => 0,
    }
}

/// `ibv_atomic_cap` names.
pub fn atomic_cap_name(a: u32) -> &'static str {
    match a {
        0 => "ATOMIC_NONE",
        1 => "ATOMIC_HCA",
        2 => "ATOMIC_GLOB",
        _ => "unknown",
    }
}

/// One port of a device.
#[derive(Debug, Clone)]
pub struct PortFacts {
    /// Port number (from 1).
    pub num: u8,
    /// `ibv_port_state`.
    pub state: u32,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Largest MTU in bytes.
    pub max_mtu: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Largest message.
    pub max_msg: u32,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// Subnet manager's LID (InfiniBand).
    pub sm_lid: u16,
    /// LID mask control (InfiniBand).
    pub lmc: u8,
    /// Non-empty GID table entries.
    pub gids: Vec<GidEntry>,
    /// The network device under the port (Ethernet link layer), if known.
    pub netdev: Option<String>,
    /// IP addresses of that network device.
    pub addrs: Vec<IpAddr>,
}

impl PortFacts {
    /// True when the port is ACTIVE.
    pub fn is_active(&self) -> bool {
        self.state == 4
    }
}

/// One device, as discovery found it: capabilities come from here, never hard-coded.
#[derive(Debug, Clone)]
pub struct DeviceFacts {
    /// Device name (`rxe0`, `siw0`, `mlx5_0`).
    pub name: String,
    /// Transport.
    pub transport: Transport,
    /// Node GUID.
    pub node_guid: u64,
    /// Firmware version text.
    pub fw_ver: String,
    /// IEEE vendor id (`0xffffff` for soft-RoCE rxe).
    pub vendor_id: u32,
    /// Largest registration.
    pub max_mr_size: u64,
    /// Deepest queue pair queue.
    pub max_qp_wr: u32,
    /// Largest gather/scatter list (what a probe queue pair accepted).
    pub max_sge: u32,
    /// Largest scatter list of an RDMA Read.
    pub max_sge_rd: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
    /// Reads/atomics a queue pair may serve (IRD).
    pub max_qp_rd_atom: u32,
    /// Reads/atomics a queue pair may issue (ORD).
    pub max_qp_init_rd_atom: u32,
    /// `ibv_atomic_cap`.
    pub atomic_cap: u32,
    /// Largest inline payload (probed by creating a queue pair).
    pub max_inline: u32,
    /// Ports.
    pub ports: Vec<PortFacts>,
}

impl DeviceFacts {
    /// True when the device executes 64-bit atomics.
    pub fn has_atomics(&self) -> bool {
        self.atomic_cap != 0
    }

    /// Facts for `fabric info` (`DeviceInfo::details`).
    pub fn details(&self) -> BTreeMap<String, String> {
        let mut d = BTreeMap::new();
        d.insert("node guid".into(), format!("{:016x}", self.node_guid));
        d.insert("vendor id".into(), format!("{:#x}", self.vendor_id));
        if !self.fw_ver.is_empty() {
            d.insert("firmware".into(), self.fw_ver.clone());
        }
        d.insert("atomics".into(), atomic_cap_name(self.atomic_cap).into());
        d.insert(
            "device limits".into(),
            format!(
                "max_qp_wr {}, max_sge {}, max_sge_rd {}, max_cqe {}, max_qp_rd_atom {}, max_qp_init_rd_atom {}, max_inline {} (probed), max_mr_size {}",
                self.max_qp_wr, self.max_sge, self.max_sge_rd, self.max_cqe, self.max_qp_rd_atom, self.max_qp_init_rd_atom, self.max_inline, self.max_mr_size
            ),
        );
        for p in &self.ports {
            let k = format!("port {}", p.num);
            let mut v = format!(
                "state {}, link layer {}, active MTU {}, max MTU {}, max message {}",
                port_state_name(p.state),
                p.link_layer.name(),
                p.active_mtu,
                p.max_mtu,
                p.max_msg
            );
            if p.link_layer != LinkLayer::Ethernet {
                v.push_str(&format!(
                    ", LID {:#x}, SM LID {:#x}, LMC {}",
                    p.lid, p.sm_lid, p.lmc
                ));
            }
            if let Some(n) = &p.netdev {
                let addrs: Vec<String> = p.addrs.iter().map(|a| a.to_string()).collect();
                v.push_str(&format!(", netdev {n} [{}]", addrs.join(" ")));
            }
            d.insert(k.clone(), v);
            let gids: Vec<String> = p.gids.iter().map(GidEntry::describe).collect();
            d.insert(
                format!("{k} gid table"),
                if gids.is_empty() {
                    "empty".into()
                } else {
                    gids.join("; ")
                },
            );
        }
        d
    }
}

/// Why no device could be listed at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeError {
    /// rdma-core itself could not be loaded (not installed, or too old).
    NoLibrary(crate::LoadError),
    /// libibverbs could not list devices (no kernel RDMA support: `/sys/class/infiniband_verbs` absent).
    NoKernelSupport(String),
    /// The kernel has RDMA devices but rdma-core has no user-space driver for them.
    NoUserDriver(Vec<String>),
}

impl ProbeError {
    /// The reason in words.
    pub fn reason(&self) -> String {
        match self {
            ProbeError::NoLibrary(e) => e.to_string(),
            ProbeError::NoKernelSupport(e) => format!("no RDMA devices: libibverbs cannot list devices ({e}); this kernel has no RDMA support loaded (no /sys/class/infiniband_verbs)"),
            ProbeError::NoUserDriver(names) => format!("rdma-core has no user-space driver for the kernel's RDMA devices {} (install ibverbs-providers)", names.join(", ")),
        }
    }
}

const SYSFS: &str = "/sys/class/infiniband";

fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The network device whose MAC address is `mac` (iWARP GIDs carry the MAC).
fn netdev_by_mac(mac: &[u8]) -> Option<String> {
    if mac.iter().all(|&b| b == 0) {
        return None;
    }
    let want: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
    let want = want.join(":");
    let dir = std::fs::read_dir("/sys/class/net").ok()?;
    for e in dir.flatten() {
        if read_trim(e.path().join("address")).as_deref() == Some(want.as_str()) {
            return Some(e.file_name().to_string_lossy().into_owned());
        }
    }
    None
}

/// Lists every RDMA device with everything discovery needs.
pub fn probe() -> Result<Vec<DeviceFacts>, ProbeError> {
    crate::rdma_core().map_err(ProbeError::NoLibrary)?;
    let raw = match ffi::probe_devices() {
        Ok(r) => r,
        Err(e) => return Err(ProbeError::NoKernelSupport(e.to_string())),
    };
    if raw.is_empty() {
        let kernel: Vec<String> = std::fs::read_dir(SYSFS)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        if !kernel.is_empty() {
            return Err(ProbeError::NoUserDriver(kernel));
        }
    }
    Ok(raw.into_iter().map(facts).collect())
}

/// How long [`probe_recent`] reuses an answer: a second, so that the probes a burst of
/// domain opens and discoveries would make become one, while a device or port that changes
/// is seen by the first open a second later. A probe opens every device and reads its
/// ports, GID tables, sysfs and netlink: 21-32 ms in the soft-RDMA guest, and a process
/// running one conformance case made 13 (the roce suite there took 116 s probing each
/// time, 81 s with this). libfabric's verbs provider and UCX list devices once per process
/// (at provider init, at `ucp_init`).
pub const PROBE_FRESH: Duration = Duration::from_secs(1);

/// The last probe's answer and when it was taken.
type Probed = Option<(Instant, Result<Vec<DeviceFacts>, ProbeError>)>;

static LAST_PROBE: Mutex<Probed> = Mutex::new(None);

/// [`probe`], or its answer of less than [`PROBE_FRESH`] ago in this process. The lock is
/// held through a probe, so threads that open domains at once probe once between them.
/// What discovery and [`VerbsDomain::open`](crate::VerbsDomain::open) use; `fabric doctor`
/// probes afresh.
pub fn probe_recent() -> Result<Vec<DeviceFacts>, ProbeError> {
    recent(&LAST_PROBE, Instant::now(), probe)
}

/// `slot`'s answer if it is younger than [`PROBE_FRESH`] at `now`, else `probe`'s, kept.
fn recent(
    slot: &Mutex<Probed>,
    now: Instant,
    probe: impl FnOnce() -> Result<Vec<DeviceFacts>, ProbeError>,
) -> Result<Vec<DeviceFacts>, ProbeError> {
    let mut last = slot.lock().unwrap_or_else(|e| e.into_inner());
    match &*last {
        Some((at, answer)) if now.saturating_duration_since(*at) < PROBE_FRESH => answer.clone(),
        _ => {
            let answer = probe();
            *last = Some((now, answer.clone()));
            answer
        }
    }
}

/// Forgets the last probe's answer: the next [`probe_recent`] probes. Called when the
/// facts said a device was usable and opening it failed (it may be gone).
pub(crate) fn forget_probe() {
    forget(&LAST_PROBE);
}

/// Empties `slot`: its next [`recent`] probes.
fn forget(slot: &Mutex<Probed>) {
    *slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

fn facts(r: ffi::RawDevice) -> DeviceFacts {
    let transport = Transport::from_raw(r.transport);
    let ports = r
        .ports
        .iter()
        .enumerate()
        .map(|(i, (p, gids))| {
            let num = i as u8 + 1;
            let base = format!("{SYSFS}/{}/ports/{num}/gid_attrs", r.name);
            let entries: Vec<GidEntry> = gids
                .iter()
                .map(|&(idx, g)| GidEntry {
                    index: idx,
                    gid: Gid(g),
                    // iWARP GIDs carry the MAC: sysfs' RoCE types mean nothing there.
                    kind: if transport == Transport::Iwarp {
                        GidKind::Unknown
                    } else {
                        read_trim(format!("{base}/types/{idx}"))
                            .map_or(GidKind::Unknown, |s| GidKind::parse(&s))
                    },
                    netdev: read_trim(format!("{base}/ndevs/{idx}")).filter(|s| !s.is_empty()),
                })
                .collect();
            let link_layer = LinkLayer::from_raw(p.link_layer);
            let netdev = entries.iter().find_map(|e| e.netdev.clone()).or_else(|| {
                if transport == Transport::Iwarp {
                    gids.first().and_then(|(_, g)| netdev_by_mac(&g[..6]))
                } else {
                    None
                }
            });
            let addrs = netdev.as_deref().map(ffi::if_addrs).unwrap_or_default();
            PortFacts {
                num,
                state: p.state,
                active_mtu: mtu_bytes(p.active_mtu),
                max_mtu: mtu_bytes(p.max_mtu),
                link_layer,
                max_msg: p.max_msg_sz,
                lid: p.lid,
                sm_lid: p.sm_lid,
                lmc: p.lmc,
                gids: entries,
                netdev,
                addrs,
            }
        })
        .collect();
    let pos = |v: i32| v.max(0) as u32;
    DeviceFacts {
        name: r.name,
        transport,
        node_guid: r.node_guid,
        fw_ver: r.fw_ver,
        vendor_id: r.vendor_id,
        max_mr_size: r.max_mr_size,
        max_qp_wr: pos(r.max_qp_wr),
        max_sge: if r.probe_sge > 0 {
            r.probe_sge.min(pos(r.max_sge))
        } else {
            pos(r.max_sge)
        },
        max_sge_rd: pos(r.max_sge_rd),
        max_cqe: pos(r.max_cqe),
        max_qp_rd_atom: pos(r.max_qp_rd_atom),
        max_qp_init_rd_atom: pos(r.max_qp_init_rd_atom),
        atomic_cap: r.atomic_cap,
        max_inline: r.max_inline,
        ports,
    }
}

/// The memory-lock limit as a reason to refuse, when it is too low to register memory.
pub fn memlock_problem() -> Option<String> {
    /// Registering less than this is not useful (the conformance suite pins ~16 MiB).
    const MIN: u64 = 32 << 20;
    match ffi::memlock_limit() {
        Some(l) if l < MIN => Some(format!(
            "RLIMIT_MEMLOCK is {} KiB: too low to register memory for RDMA (need at least {} MiB; raise it with `ulimit -l unlimited` or /etc/security/limits.conf)",
            l / 1024,
            MIN >> 20
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_values_have_names() {
        assert_eq!(mtu_bytes(3), 1024);
        assert_eq!(mtu_bytes(5), 4096);
        assert_eq!(mtu_bytes(0), 0);
        assert_eq!(port_state_name(4), "ACTIVE");
        assert_eq!(port_state_name(1), "DOWN");
        assert_eq!(atomic_cap_name(1), "ATOMIC_HCA");
        assert_eq!(Transport::from_raw(1), Transport::Iwarp);
        assert_eq!(LinkLayer::from_raw(2), LinkLayer::Ethernet);
        assert_eq!(LinkLayer::from_raw(0), LinkLayer::Unspecified);
    }

    /// A probe's answer serves the calls of the next [`PROBE_FRESH`], then a new probe's;
    /// a forgotten answer serves none.
    #[test]
    fn a_recent_probe_is_reused_for_its_freshness_window_only() {
        let slot = Mutex::new(None);
        let probes = std::cell::Cell::new(0u32);
        let probe = || {
            probes.set(probes.get() + 1);
            Err(ProbeError::NoUserDriver(vec![format!(
                "dev{}",
                probes.get()
            )]))
        };
        let name = |r: Result<Vec<DeviceFacts>, ProbeError>| match r {
            Err(ProbeError::NoUserDriver(n)) => n[0].clone(),
            other => panic!("unexpected {other:?}"),
        };
        let t0 = Instant::now();
        assert_eq!(name(recent(&slot, t0, probe)), "dev1");
        let just_in = t0 + PROBE_FRESH - Duration::from_millis(1);
        assert_eq!(name(recent(&slot, just_in, probe)), "dev1", "reused");
        assert_eq!(probes.get(), 1);
        assert_eq!(
            name(recent(&slot, t0 + PROBE_FRESH, probe)),
            "dev2",
            "stale"
        );
        let t2 = t0 + PROBE_FRESH;
        assert_eq!(
            name(recent(&slot, t2, probe)),
            "dev2",
            "the new answer is kept"
        );
        forget(&slot);
        assert_eq!(name(recent(&slot, t2, probe)), "dev3", "forgotten");
        assert_eq!(probes.get(), 3);
    }

    #[test]
    fn probing_never_panics_and_explains_an_empty_host() {
        match probe() {
            Ok(devs) => {
                for d in devs {
                    assert!(!d.name.is_empty());
                    let _ = d.details();
                }
            }
            Err(e) => assert!(e.reason().contains("RDMA") || e.reason().contains("rdma-core")),
        }
    }
}
