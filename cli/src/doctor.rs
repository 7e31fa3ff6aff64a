//! `fabric doctor`: the checks a user needs before blaming the framework.
//!
//! Each check reads pass, warn or fail, says what it saw and, unless it passed, how to fix
//! it. A *fail* is something that breaks an RDMA provider this machine otherwise has (a port
//! down, a RoCE port without a v2 GID, an MTU the netdev cannot carry, a memlock limit below
//! the registration asked for, a missing kernel module); a *warn* is RDMA that is absent here
//! (the tcp provider is then used: not a fault) or a setting that costs performance or
//! losslessness. The exit code is 0 when nothing fails.
//!
//! The facts are gathered once into [`System`] (sysfs, procfs, `/boot/config-*`, rdma-core
//! through the verbs core, the provider discovery); the checks are pure functions of it, so
//! the unit tests below run them on a host without RDMA and on a guest with rxe0 and siw0.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use fabric::{Availability, ProviderInfo, Selector};

/// `fabric doctor` options.
#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = DoctorFormat::Text)]
    format: DoctorFormat,
    /// Memory a job registers at once, checked against the memlock limit (suffixes K, M, G,
    /// T: 512M, 4G).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    registration: u64,
    /// The local address RDMA traffic will use (RoCE: a v2 GID must carry it). Default: the
    /// `[roce] address` of FABRIC_CONFIG, else any address.
    #[arg(long)]
    address: Option<IpAddr>,
}

/// How the report is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DoctorFormat {
    /// One line per check, fixes indented below.
    Text,
    /// `{"summary": {...}, "checks": [{name, status, detail, fix}]}`.
    Json,
}

use crate::units::parse_size;

/// A size in words (`8 MiB`).
fn human(n: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (u, v) in UNITS {
        if n >= v && n.is_multiple_of(v) {
            return format!("{} {u}", n / v);
        }
    }
    format!("{n} B")
}

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Status {
    Pass,
    Warn,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One check's result.
#[derive(Debug, Clone)]
struct Check {
    name: String,
    status: Status,
    detail: String,
    fix: Option<String>,
}

impl Check {
    fn pass(name: impl Into<String>, detail: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            status: Status::Pass,
            detail: detail.into(),
            fix: None,
        }
    }
    fn warn(name: impl Into<String>, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            status: Status::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
    fn fail(name: impl Into<String>, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// What the kernel's configuration says about RDMA (`CONFIG_INFINIBAND`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum KernelRdma {
    /// `=y` or `=m`, with the file it was read from.
    Enabled { how: char, source: String },
    /// `# CONFIG_INFINIBAND is not set`, with the file and whether modules are supported.
    NotSet { source: String, modules: bool },
    /// No configuration readable.
    Unknown,
}

/// What loading rdma-core gave.
#[derive(Debug, Clone, PartialEq, Eq)]
// Built from the verbs discovery, which a tcp-only build (no `verbs` feature) lacks.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
enum RdmaCore {
    Loaded {
        version: Option<String>,
        libibverbs: String,
        librdmacm: String,
    },
    Missing(String),
    /// This binary has no verbs providers (built without the `verbs` feature).
    NotBuilt,
}

/// How a device is implemented.
#[derive(Debug, Clone, PartialEq, Eq)]
// Built from the verbs discovery, which a tcp-only build (no `verbs` feature) lacks.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
enum DevKind {
    SoftRoce,
    SoftIwarp,
    Hardware(Option<String>),
}

/// The link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// Built from the verbs discovery, which a tcp-only build (no `verbs` feature) lacks.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
enum Link {
    InfiniBand,
    Ethernet,
}

/// One port, as the checks need it.
#[derive(Debug, Clone)]
struct Port {
    num: u8,
    state: String,
    active: bool,
    link: Link,
    active_mtu: u32,
    max_mtu: u32,
    netdev: Option<String>,
    addrs: Vec<IpAddr>,
    /// RoCE v2 GIDs with a routable address: (index, address).
    v2: Vec<(u32, IpAddr)>,
    /// Other non-empty GID entries (RoCE v1, link-local).
    other_gids: usize,
}

/// One RDMA device.
#[derive(Debug, Clone)]
struct Dev {
    name: String,
    kind: DevKind,
    iwarp: bool,
    atomics: String,
    ports: Vec<Port>,
}

/// Everything the checks look at, gathered once.
#[derive(Debug, Clone)]
struct System {
    kernel: String,
    kernel_rdma: KernelRdma,
    /// Loaded kernel modules (`/proc/modules`) and built-in ones with a `/sys/module` entry.
    modules: BTreeSet<String>,
    /// Entries of `/dev/infiniband`.
    dev_nodes: BTreeSet<String>,
    /// Entries of `/sys/class/infiniband` (the kernel's RDMA devices).
    kernel_devices: Vec<String>,
    rdma_core: RdmaCore,
    /// The devices rdma-core lists, or why it lists none.
    devices: Result<Vec<Dev>, String>,
    /// Soft memlock limit in bytes; `None`: unlimited.
    memlock: Option<u64>,
    cap_ipc_lock: bool,
    /// MTU of each network device under an RDMA port.
    netdev_mtu: BTreeMap<String, u32>,
    /// `dcb pfc show` per RoCE netdev: the priorities with PFC on (`None`: not exposed).
    pfc: BTreeMap<String, Option<Vec<u8>>>,
    /// mlx5-style `ecn/roce_np/enable/<prio>` per RoCE netdev: priorities with ECN on.
    ecn: BTreeMap<String, Option<Vec<u8>>>,
    /// `[roce] traffic_class` from the configuration.
    traffic_class: Option<u8>,
    /// The kernel's default ToS for rdma_cm connections per RoCE device and port
    /// (configfs `rdma_cm/<dev>/ports/<port>/default_roce_tos`, when someone set one up).
    default_tos: BTreeMap<(String, u8), u8>,
    /// The address RDMA traffic will use, if given.
    address: Option<IpAddr>,
    registration: u64,
    providers: Vec<ProviderInfo>,
}

fn read(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

fn dir_names(p: impl AsRef<Path>) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(p)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `CONFIG_INFINIBAND` (and `CONFIG_MODULES`) from a kernel configuration's text.
fn kernel_rdma_from_config(text: &str, source: &str) -> KernelRdma {
    let modules = text.lines().any(|l| l.trim() == "CONFIG_MODULES=y");
    for l in text.lines() {
        let l = l.trim();
        if let Some(v) = l.strip_prefix("CONFIG_INFINIBAND=") {
            return KernelRdma::Enabled {
                how: v.chars().next().unwrap_or('?'),
                source: source.into(),
            };
        }
        if l == "# CONFIG_INFINIBAND is not set" {
            return KernelRdma::NotSet {
                source: source.into(),
                modules,
            };
        }
    }
    KernelRdma::Unknown
}

fn kernel_rdma(release: &str) -> KernelRdma {
    let boot = format!("/boot/config-{release}");
    if let Some(t) = read(&boot) {
        return kernel_rdma_from_config(&t, &boot);
    }
    // /proc/config.gz (CONFIG_IKCONFIG_PROC): gzip-compressed.
    if Path::new("/proc/config.gz").exists() {
        if let Ok(out) = std::process::Command::new("gzip")
            .args(["-dc", "/proc/config.gz"])
            .output()
        {
            if out.status.success() {
                return kernel_rdma_from_config(
                    &String::from_utf8_lossy(&out.stdout),
                    "/proc/config.gz",
                );
            }
        }
    }
    KernelRdma::Unknown
}

/// The soft RLIMIT_MEMLOCK from `/proc/self/limits` (`Some(None)`: unlimited).
fn memlock_from_limits(text: &str) -> Option<Option<u64>> {
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    let soft = line["Max locked memory".len()..]
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        return Some(None);
    }
    soft.parse().ok().map(Some)
}

/// Whether `CapEff` in `/proc/self/status` has CAP_IPC_LOCK (bit 14), which lifts the
/// memlock limit for registrations.
fn cap_ipc_lock_from_status(text: &str) -> bool {
    text.lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// The priorities with PFC on from `dcb pfc show dev X` (`prio-pfc 0:off 1:on ...`).
fn pfc_from_dcb(text: &str) -> Option<Vec<u8>> {
    let line = text.lines().find(|l| l.contains("prio-pfc"))?;
    Some(
        line.split_whitespace()
            .filter_map(|t| t.split_once(':'))
            .filter(|(_, v)| *v == "on")
            .filter_map(|(p, _)| p.parse().ok())
            .collect(),
    )
}

#[cfg(feature = "verbs")]
fn gather_verbs(sys: &mut System) {
    use fabric::verbs::{self, gid::GidKind, LinkLayer, Transport};
    sys.rdma_core = match verbs::rdma_core() {
        Ok(r) => RdmaCore::Loaded {
            version: r.version(),
            libibverbs: r.libibverbs.display().to_string(),
            librdmacm: r.librdmacm.display().to_string(),
        },
        Err(e) => RdmaCore::Missing(e.to_string()),
    };
    sys.devices = match verbs::device::probe() {
        Err(e) => Err(e.reason()),
        Ok(list) => Ok(list
            .into_iter()
            .map(|d| {
                let kind = match (d.vendor_id, d.transport) {
                    (0xffffff, Transport::InfiniBand) => DevKind::SoftRoce,
                    (0x626d74, Transport::Iwarp) => DevKind::SoftIwarp,
                    _ => DevKind::Hardware(
                        std::fs::read_link(format!(
                            "/sys/class/infiniband/{}/device/driver",
                            d.name
                        ))
                        .ok()
                        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())),
                    ),
                };
                Dev {
                    name: d.name.clone(),
                    kind,
                    iwarp: d.transport == Transport::Iwarp,
                    atomics: verbs::device::atomic_cap_name(d.atomic_cap).into(),
                    ports: d
                        .ports
                        .iter()
                        .map(|p| Port {
                            num: p.num,
                            state: verbs::device::port_state_name(p.state).into(),
                            active: p.is_active(),
                            link: if p.link_layer == LinkLayer::Ethernet {
                                Link::Ethernet
                            } else {
                                Link::InfiniBand
                            },
                            active_mtu: p.active_mtu,
                            max_mtu: p.max_mtu,
                            netdev: p.netdev.clone(),
                            addrs: p.addrs.clone(),
                            v2: p
                                .gids
                                .iter()
                                .filter(|g| g.kind == GidKind::RoceV2 && !g.gid.is_link_local())
                                .map(|g| (g.index, g.gid.ip()))
                                .collect(),
                            other_gids: p
                                .gids
                                .iter()
                                .filter(|g| g.kind != GidKind::RoceV2 || g.gid.is_link_local())
                                .count(),
                        })
                        .collect(),
                }
            })
            .collect()),
    };
}

fn gather(args: &DoctorArgs) -> Result<System, String> {
    let selector = Selector::from_env().map_err(|e| e.to_string())?;
    let kernel = read("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let mut modules: BTreeSet<String> = read("/proc/modules")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    // Built-in modules show up in /sys/module only; keep the RDMA ones.
    for m in dir_names("/sys/module") {
        if m.starts_with("ib_") || m.starts_with("rdma_") || m.starts_with("iw_") || m == "siw" {
            modules.insert(m);
        }
    }
    #[allow(unused_mut)] // assigned by the verbs build only
    let mut sys = System {
        kernel_rdma: kernel_rdma(&kernel),
        kernel,
        modules,
        dev_nodes: dir_names("/dev/infiniband").into_iter().collect(),
        kernel_devices: dir_names("/sys/class/infiniband"),
        rdma_core: RdmaCore::NotBuilt,
        devices: Err("this binary was built without the verbs providers".into()),
        memlock: read("/proc/self/limits")
            .and_then(|t| memlock_from_limits(&t))
            .unwrap_or(Some(0)),
        cap_ipc_lock: read("/proc/self/status").is_some_and(|t| cap_ipc_lock_from_status(&t)),
        netdev_mtu: BTreeMap::new(),
        pfc: BTreeMap::new(),
        ecn: BTreeMap::new(),
        traffic_class: None,
        default_tos: BTreeMap::new(),
        address: args.address,
        registration: args.registration,
        providers: selector.discover(),
    };
    #[cfg(feature = "verbs")]
    {
        gather_verbs(&mut sys);
        if let Some(o) = selector.verbs_options("roce") {
            sys.traffic_class = o.traffic_class;
            sys.address = sys.address.or(o.address);
        }
    }
    let roce_netdevs: Vec<String> = sys
        .devices
        .iter()
        .flatten()
        .filter(|d| !d.iwarp)
        .flat_map(|d| d.ports.iter().filter(|p| p.link == Link::Ethernet))
        .filter_map(|p| p.netdev.clone())
        .collect();
    for d in sys.devices.iter().flatten() {
        for nd in d.ports.iter().filter_map(|p| p.netdev.as_ref()) {
            if let Some(m) =
                read(format!("/sys/class/net/{nd}/mtu")).and_then(|t| t.trim().parse().ok())
            {
                sys.netdev_mtu.insert(nd.clone(), m);
            }
        }
    }
    for d in sys.devices.iter().flatten().filter(|d| !d.iwarp) {
        for p in &d.ports {
            let f = format!(
                "/sys/kernel/config/rdma_cm/{}/ports/{}/default_roce_tos",
                d.name, p.num
            );
            if let Some(t) = read(&f).and_then(|t| t.trim().parse().ok()) {
                sys.default_tos.insert((d.name.clone(), p.num), t);
            }
        }
    }
    for nd in roce_netdevs {
        let pfc = std::process::Command::new("dcb")
            .args(["pfc", "show", "dev", &nd])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| pfc_from_dcb(&String::from_utf8_lossy(&o.stdout)));
        sys.pfc.insert(nd.clone(), pfc);
        let dir = format!("/sys/class/net/{nd}/ecn/roce_np/enable");
        let ecn = Path::new(&dir).is_dir().then(|| {
            dir_names(&dir)
                .iter()
                .filter(|p| read(format!("{dir}/{p}")).is_some_and(|v| v.trim() == "1"))
                .filter_map(|p| p.parse().ok())
                .collect()
        });
        sys.ecn.insert(nd, ecn);
    }
    Ok(sys)
}

const NO_RDMA_HERE: &str =
    "the tcp provider runs without RDMA; nothing to fix unless you want roce, iwarp or ib here";

fn check_rdma_core(s: &System) -> Check {
    match &s.rdma_core {
        RdmaCore::Loaded {
            version,
            libibverbs,
            librdmacm,
        } => Check::pass(
            "rdma-core",
            format!(
                "rdma-core {} loaded at run time: {libibverbs}, {librdmacm}",
                version.as_deref().unwrap_or("(release unknown)")
            ),
        ),
        RdmaCore::Missing(why) => Check::warn(
            "rdma-core",
            format!("{why}; roce, iwarp and ib are unavailable, tcp runs"),
            "install rdma-core (Debian/Ubuntu: apt install libibverbs1 librdmacm1 ibverbs-providers; RHEL/Fedora: dnf install rdma-core libibverbs librdmacm)",
        ),
        RdmaCore::NotBuilt => Check::warn(
            "rdma-core",
            "not checked: this binary was built without the verbs providers (tcp only)",
            "build fabric with default features (cargo build -p fabric-cli) for roce, iwarp and ib",
        ),
    }
}

fn check_kernel(s: &System) -> Vec<Check> {
    let mut out = Vec::new();
    if s.kernel_devices.is_empty() {
        let (detail, fix) = match &s.kernel_rdma {
            KernelRdma::NotSet { source, modules } => (
                format!(
                    "kernel {} is built without RDMA: {source} says CONFIG_INFINIBAND is not set{}, so no RDMA device (hardware, rxe or siw) can exist on this machine; {NO_RDMA_HERE}",
                    s.kernel,
                    if *modules { "" } else { " and CONFIG_MODULES is not set (no module can be loaded either)" }
                ),
                "boot a kernel with CONFIG_INFINIBAND (e.g. Debian's linux-image-amd64), or use a VM with one: scripts/soft-rdma run -- fabric doctor",
            ),
            KernelRdma::Enabled { how, source } => (
                format!(
                    "kernel {} has RDMA ({source}: CONFIG_INFINIBAND={how}) but no RDMA device: no driver is loaded or no device is configured{}",
                    s.kernel,
                    if s.modules.contains("ib_core") { "" } else { " (ib_core is not loaded)" }
                ),
                "load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re, ...) or create a software device: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <netdev> (soft-RoCE), or siw for soft-iWARP",
            ),
            KernelRdma::Unknown => (
                format!(
                    "kernel {}: no RDMA device (/sys/class/infiniband is absent or empty) and no kernel configuration readable to say why",
                    s.kernel
                ),
                "modprobe ib_core ib_uverbs rdma_ucm and the NIC's RDMA driver (or rdma_rxe / siw)",
            ),
        };
        out.push(Check::warn("kernel", detail, fix));
        return out;
    }
    let rdma: Vec<&str> = s
        .modules
        .iter()
        .map(String::as_str)
        .filter(|m| {
            m.starts_with("ib_")
                || m.starts_with("rdma_")
                || m.starts_with("iw_")
                || *m == "siw"
                || m.ends_with("_ib")
                || *m == "irdma"
                || *m == "bnxt_re"
        })
        .collect();
    out.push(Check::pass(
        "kernel",
        format!(
            "kernel {}: RDMA devices {}; RDMA modules: {}",
            s.kernel,
            s.kernel_devices.join(", "),
            if rdma.is_empty() {
                "(built in)".to_string()
            } else {
                rdma.join(", ")
            }
        ),
    ));
    if !s.dev_nodes.iter().any(|n| n.starts_with("uverbs")) {
        out.push(Check::fail(
            "kernel: ib_uverbs",
            "no /dev/infiniband/uverbs*: user space cannot open the devices",
            "modprobe ib_uverbs",
        ));
    }
    if !s.dev_nodes.contains("rdma_cm") {
        out.push(Check::fail(
            "kernel: rdma_ucm",
            "no /dev/infiniband/rdma_cm: every verbs provider connects through rdma_cm",
            "modprobe rdma_ucm",
        ));
    }
    out
}

fn kind_words(d: &Dev) -> String {
    match &d.kind {
        DevKind::SoftRoce => {
            "soft-RoCE (kernel rdma_rxe: RoCE v2 in software over a netdev)".into()
        }
        DevKind::SoftIwarp => {
            "soft-iWARP (kernel siw: iWARP in software over the kernel's TCP)".into()
        }
        DevKind::Hardware(Some(drv)) => format!("hardware, driver {drv}"),
        DevKind::Hardware(None) => "hardware".into(),
    }
}

fn takers(s: &System, dev: &str) -> Vec<String> {
    s.providers
        .iter()
        .filter(|p| p.devices.iter().any(|d| d.name == dev))
        .map(|p| p.name.clone())
        .collect()
}

/// Largest InfiniBand MTU (256..4096) whose RoCE v2 packet fits a netdev MTU: 256..4096
/// payload plus IP (up to 40), UDP (8), BTH (12), RETH/AtomicETH (up to 28), ICRC (4).
fn roce_mtu_for(netdev_mtu: u32) -> u32 {
    [4096u32, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| m + 92 <= netdev_mtu)
        .unwrap_or(0)
}

fn check_devices(s: &System) -> Vec<Check> {
    let devs = match &s.devices {
        Ok(d) => d,
        Err(why) => {
            return match s.rdma_core {
                RdmaCore::Loaded { .. } if !s.kernel_devices.is_empty() => vec![Check::fail(
                    "devices",
                    why.clone(),
                    "install the user-space drivers (Debian/Ubuntu: ibverbs-providers; RHEL: libibverbs) and check that /etc/libibverbs.d names the driver",
                )],
                RdmaCore::Loaded { .. } => vec![Check::warn("devices", why.clone(), "see the kernel check")],
                _ => vec![Check::warn("devices", format!("not listed: {}", match &s.rdma_core { RdmaCore::NotBuilt => "no verbs providers in this binary", _ => "rdma-core is not loaded" }), "see the rdma-core check")],
            };
        }
    };
    if devs.is_empty() {
        return vec![Check::warn(
            "devices",
            "rdma-core lists no RDMA device",
            "see the kernel check",
        )];
    }
    let mut out = Vec::new();
    for d in devs {
        let takers = takers(s, &d.name);
        let by = if takers.is_empty() {
            "no provider takes it".to_string()
        } else {
            format!("used by provider {}", takers.join(", "))
        };
        let caps = if d.iwarp {
            format!("transport iWARP, connections through rdma_cm over TCP, {} (atomics and immediate data are not in iWARP's RDMAP)", d.atomics)
        } else {
            format!("transport InfiniBand, {}", d.atomics)
        };
        for p in &d.ports {
            let name = format!("device {} port {}", d.name, p.num);
            let on = match (&p.netdev, p.addrs.is_empty()) {
                (Some(nd), false) => format!(
                    " on netdev {nd} [{}]",
                    p.addrs
                        .iter()
                        .map(|a| a.to_string())
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
                (Some(nd), true) => format!(" on netdev {nd} (no IP address)"),
                (None, _) => String::new(),
            };
            let link = match p.link {
                Link::Ethernet => "link layer Ethernet",
                Link::InfiniBand => "link layer InfiniBand",
            };
            let detail = format!(
                "{}: {}{on}; {link}; {caps}; port {}; {by}",
                d.name,
                kind_words(d),
                p.state
            );
            if p.active {
                out.push(Check::pass(name, detail));
            } else {
                let fix = match (&p.netdev, p.link) {
                    (Some(nd), Link::Ethernet) => format!("ip link set {nd} up (and check the cable or the switch port)"),
                    (None, Link::Ethernet) => "bring the port's network device up (ip link set <netdev> up)".to_string(),
                    (_, Link::InfiniBand) => "check the cable and that a subnet manager runs on the fabric (opensm, or the switch's)".to_string(),
                };
                out.push(Check::fail(name, detail, fix));
            }
        }
        for p in d
            .ports
            .iter()
            .filter(|p| p.link == Link::Ethernet && !d.iwarp)
        {
            out.extend(check_roce_port(s, d, p));
        }
        for p in d.ports.iter().filter(|p| d.iwarp && p.netdev.is_some()) {
            let nd = p.netdev.as_deref().unwrap_or_default();
            let mtu = s
                .netdev_mtu
                .get(nd)
                .map(|m| m.to_string())
                .unwrap_or_else(|| "unknown".into());
            out.push(Check::pass(
                format!("mtu {} port {}", d.name, p.num),
                format!("{}: iWARP runs over TCP on {nd} (MTU {mtu}): segments follow the netdev's MTU, there is no RDMA MTU to match", d.name),
            ));
        }
    }
    out
}

fn check_roce_port(s: &System, d: &Dev, p: &Port) -> Vec<Check> {
    let mut out = Vec::new();
    let nd = p.netdev.clone().unwrap_or_else(|| "<netdev>".into());
    // A v2 GID on the address in use.
    let gname = format!("roce v2 gid {} port {}", d.name, p.num);
    let listed: Vec<String> =
        p.v2.iter()
            .map(|(i, a)| format!("index {i}: {a}"))
            .collect();
    match (s.address, p.v2.is_empty()) {
        (_, true) => out.push(Check::fail(
            gname,
            format!(
                "{}: no RoCE v2 GID with a routable address ({} other entries: RoCE v1 or link-local, which the roce provider never uses); {nd} has {}",
                d.name,
                p.other_gids,
                if p.addrs.is_empty() { "no IP address".to_string() } else { format!("addresses {:?} but no v2 GID for them", p.addrs) }
            ),
            format!("give {nd} an IP address (ip addr add <address>/<prefix> dev {nd}); the kernel adds its RoCE v2 GID"),
        )),
        (Some(a), false) if !p.v2.iter().any(|(_, g)| *g == a) => out.push(Check::fail(
            gname,
            format!("{}: the address in use {a} has no RoCE v2 GID; v2 GIDs: {}", d.name, listed.join(", ")),
            format!("use an address of {nd} ([roce] address in FABRIC_CONFIG, or --address), or add {a} to {nd}"),
        )),
        (Some(a), false) => out.push(Check::pass(gname, format!("{}: the address in use {a} has a RoCE v2 GID ({})", d.name, listed.join(", ")))),
        (None, false) => out.push(Check::pass(gname, format!("{}: RoCE v2 GIDs {}; the roce provider uses the first (or the one of [roce] address)", d.name, listed.join(", ")))),
    }
    // netdev MTU against the active MTU.
    let mname = format!("mtu {} port {}", d.name, p.num);
    match s.netdev_mtu.get(&nd) {
        None => out.push(Check::warn(
            mname,
            format!(
                "{}: active MTU {}; the MTU of {nd} is unknown",
                d.name, p.active_mtu
            ),
            format!("check /sys/class/net/{nd}/mtu"),
        )),
        Some(&m) => {
            let fits = roce_mtu_for(m);
            if p.active_mtu > fits {
                out.push(Check::fail(
                    mname,
                    format!("{}: active MTU {} does not fit {nd}'s MTU {m} (RoCE v2 headers take up to 92 bytes): packets would be dropped", d.name, p.active_mtu),
                    format!("raise {nd}'s MTU to at least {} (ip link set {nd} mtu {}) on every host and switch port, or lower the port's MTU", p.active_mtu + 92, p.active_mtu + 92),
                ));
            } else if p.active_mtu < p.max_mtu {
                out.push(Check::warn(
                    mname,
                    format!("{}: active MTU {} of a possible {} because {nd}'s MTU is {m} (the largest RoCE MTU that fits is {fits}); both ends use the smaller of their active MTUs", d.name, p.active_mtu, p.max_mtu),
                    format!("for {}-byte RoCE packets set MTU {} or more on {nd}, on the peer and on every switch port between (e.g. ip link set {nd} mtu 9000)", p.max_mtu, p.max_mtu + 92),
                ));
            } else {
                out.push(Check::pass(
                    mname,
                    format!(
                        "{}: active MTU {} (the port's maximum) fits {nd}'s MTU {m}",
                        d.name, p.active_mtu
                    ),
                ));
            }
        }
    }
    // Traffic class, PFC and ECN: the lossless-RoCE checklist.
    let tname = format!("lossless {} port {}", d.name, p.num);
    let tc = match s.traffic_class {
        Some(t) => format!(
            "[roce] traffic_class = {t} (DSCP {}, ECN bits {})",
            t >> 2,
            t & 3
        ),
        None => match s.default_tos.get(&(d.name.clone(), p.num)) {
            Some(t) => format!(
                "no [roce] traffic_class: the kernel's default_roce_tos {t} (DSCP {}) applies",
                t >> 2
            ),
            None => {
                "no [roce] traffic_class and no default_roce_tos in configfs: DSCP 0 (best effort)"
                    .to_string()
            }
        },
    };
    let pfc = match s.pfc.get(&nd) {
        Some(Some(v)) if !v.is_empty() => format!("PFC on for priorities {v:?}"),
        Some(Some(_)) => "PFC off for every priority".to_string(),
        _ => format!("PFC not exposed for {nd} (dcb pfc show)"),
    };
    let ecn = match s.ecn.get(&nd) {
        Some(Some(v)) if !v.is_empty() => format!("ECN (roce_np) on for priorities {v:?}"),
        Some(Some(_)) => "ECN (roce_np) off".to_string(),
        _ => format!("ECN not exposed for {nd}"),
    };
    let pfc_on = matches!(s.pfc.get(&nd), Some(Some(v)) if !v.is_empty());
    let ecn_on = matches!(s.ecn.get(&nd), Some(Some(v)) if !v.is_empty());
    let lossless = pfc_on || ecn_on;
    if d.kind == DevKind::SoftRoce {
        out.push(Check::warn(
            tname,
            format!("{}: soft-RoCE has no PFC or ECN of its own: a lossy fabric, loss recovered by rxe's go-back-N retransmission (fine for development, not for performance); {tc}; {pfc}; {ecn}", d.name),
            "for a lossless fabric use a RoCE NIC with PFC on the traffic's priority (dcb pfc set dev <netdev> prio-pfc 3:on) and ECN, and set [roce] traffic_class to the DSCP mapped to it (e.g. 106: DSCP 26)",
        ));
    } else if lossless && s.traffic_class.is_some() {
        out.push(Check::pass(
            tname,
            format!("{}: {tc}; {pfc}; {ecn}", d.name),
        ));
    } else {
        out.push(Check::warn(
            tname,
            format!("{}: {tc}; {pfc}; {ecn}", d.name),
            "enable PFC on one priority end to end (dcb pfc set dev <netdev> prio-pfc 3:on; the switch too) and ECN, map a DSCP to it, and set [roce] traffic_class to that DSCP << 2 (e.g. 106 for DSCP 26)",
        ));
    }
    out
}

fn check_memlock(s: &System) -> Check {
    let need = s.registration;
    let have_rdma = matches!(&s.devices, Ok(d) if !d.is_empty());
    match s.memlock {
        None => Check::pass("memlock", format!("unlimited: registrations of {} and more can be pinned", human(need))),
        Some(l) if l >= need => Check::pass("memlock", format!("{} allows the {} registration asked for (--registration)", human(l), human(need))),
        Some(l) if s.cap_ipc_lock => Check::pass(
            "memlock",
            format!("{} is below the {} asked for, but this process has CAP_IPC_LOCK, which lifts the limit for registrations (other users' jobs do not)", human(l), human(need)),
        ),
        Some(l) => {
            let detail = format!(
                "{} of locked memory; registering {} would fail with ENOMEM inside ibv_reg_mr{}",
                human(l),
                human(need),
                if have_rdma { "" } else { " (only the verbs providers pin memory; tcp does not)" }
            );
            let fix = "raise it: ulimit -l unlimited (shell), '* - memlock unlimited' in /etc/security/limits.conf (login), LimitMEMLOCK=infinity (systemd), --ulimit memlock=-1 (docker)";
            if have_rdma {
                Check::fail("memlock", detail, fix)
            } else {
                Check::warn("memlock", detail, fix)
            }
        }
    }
}

/// The first clause of a provider's reason (before `: ` or `; `); the checks above give the
/// whole story.
fn summary(reason: &str) -> &str {
    let end = [reason.find(": "), reason.find("; ")]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(reason.len());
    &reason[..end]
}

fn check_providers(s: &System) -> Check {
    let words: Vec<String> = s
        .providers
        .iter()
        .map(|p| match &p.availability {
            Availability::Available => format!(
                "{}: available{}",
                p.name,
                if p.devices.is_empty() {
                    String::new()
                } else {
                    format!(
                        " on {}",
                        p.devices
                            .iter()
                            .map(|d| d.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            ),
            Availability::Unavailable { reason } => {
                // The first clause is the summary; the checks above give the whole reason.
                format!("{}: unavailable ({})", p.name, summary(reason))
            }
        })
        .collect();
    let first = s
        .providers
        .iter()
        .find(|p| p.is_available())
        .map(|p| p.name.clone());
    let rdma = s
        .providers
        .iter()
        .any(|p| p.is_available() && p.name != "tcp");
    let detail = format!(
        "{}; with no FABRIC_PROVIDER the selection takes {}",
        words.join("; "),
        first.as_deref().unwrap_or("nothing")
    );
    if rdma {
        Check::pass("providers", detail)
    } else if first.is_some() {
        Check::warn("providers", detail, NO_RDMA_HERE)
    } else {
        Check::fail(
            "providers",
            detail,
            "no provider can run: see the checks above",
        )
    }
}

/// Every check, in the order a user would fix things.
fn run_checks(s: &System) -> Vec<Check> {
    let mut v = vec![check_rdma_core(s)];
    v.extend(check_kernel(s));
    v.extend(check_devices(s));
    v.push(check_memlock(s));
    v.push(check_providers(s));
    v
}

fn to_json(checks: &[Check]) -> serde_json::Value {
    let count = |st: Status| checks.iter().filter(|c| c.status == st).count();
    serde_json::json!({
        "summary": {"pass": count(Status::Pass), "warn": count(Status::Warn), "fail": count(Status::Fail)},
        "checks": checks.iter().map(|c| serde_json::json!({
            "name": c.name, "status": c.status.as_str(), "detail": c.detail, "fix": c.fix,
        })).collect::<Vec<_>>(),
    })
}

fn to_text(checks: &[Check]) -> String {
    let count = |st: Status| checks.iter().filter(|c| c.status == st).count();
    let mut out = String::new();
    for c in checks {
        out.push_str(&format!(
            "[{}] {}: {}\n",
            c.status.as_str(),
            c.name,
            c.detail
        ));
        if let Some(f) = &c.fix {
            out.push_str(&format!("       fix: {f}\n"));
        }
    }
    out.push_str(&format!(
        "{} pass, {} warn, {} fail\n",
        count(Status::Pass),
        count(Status::Warn),
        count(Status::Fail)
    ));
    out
}

/// Runs `fabric doctor`.
pub(crate) fn run(args: DoctorArgs) -> Result<ExitCode, String> {
    let sys = gather(&args)?;
    let checks = run_checks(&sys);
    match args.format {
        DoctorFormat::Text => print!("{}", to_text(&checks)),
        DoctorFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&checks)).map_err(|e| e.to_string())?
        ),
    }
    Ok(if checks.iter().any(|c| c.status == Status::Fail) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp_only_provider(name: &str, available: bool, reason: &str) -> ProviderInfo {
        let mut p = fabric::discover()
            .into_iter()
            .find(|p| p.name == "tcp")
            .unwrap();
        p.name = name.into();
        p.availability = if available {
            Availability::Available
        } else {
            Availability::Unavailable {
                reason: reason.into(),
            }
        };
        if name != "tcp" {
            p.devices.clear();
        }
        p
    }

    /// This project's host: a kernel without CONFIG_INFINIBAND, rdma-core installed.
    fn host() -> System {
        System {
            kernel: "6.18.44-fc".into(),
            kernel_rdma: kernel_rdma_from_config(
                "# CONFIG_MODULES is not set\n# CONFIG_INFINIBAND is not set\n",
                "/proc/config.gz",
            ),
            modules: BTreeSet::new(),
            dev_nodes: BTreeSet::new(),
            kernel_devices: Vec::new(),
            rdma_core: RdmaCore::Loaded {
                version: Some("44.0".into()),
                libibverbs: "/usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0".into(),
                librdmacm: "/usr/lib/x86_64-linux-gnu/librdmacm.so.1.3.44.0".into(),
            },
            devices: Err(
                "no RDMA devices: libibverbs cannot list devices (Function not implemented)".into(),
            ),
            memlock: Some(8 << 20),
            cap_ipc_lock: false,
            netdev_mtu: BTreeMap::new(),
            pfc: BTreeMap::new(),
            ecn: BTreeMap::new(),
            traffic_class: None,
            default_tos: BTreeMap::new(),
            address: None,
            registration: 256 << 20,
            providers: vec![
                tcp_only_provider("ib", false, "no InfiniBand device"),
                tcp_only_provider("roce", false, "no RoCE device"),
                tcp_only_provider("iwarp", false, "no iWARP device"),
                tcp_only_provider("tcp", true, ""),
            ],
        }
    }

    fn rxe_port() -> Port {
        Port {
            num: 1,
            state: "ACTIVE".into(),
            active: true,
            link: Link::Ethernet,
            active_mtu: 1024,
            max_mtu: 4096,
            netdev: Some("dummy0".into()),
            addrs: vec!["192.168.77.1".parse().unwrap()],
            v2: vec![(1, "192.168.77.1".parse().unwrap())],
            other_gids: 1,
        }
    }

    /// The soft-RDMA guest: rxe0 on dummy0, siw0 on dummy1, as root.
    fn guest() -> System {
        let mut s = host();
        s.kernel = "6.1.0-56-amd64".into();
        s.kernel_rdma = kernel_rdma_from_config(
            "CONFIG_MODULES=y\nCONFIG_INFINIBAND=m\n",
            "/boot/config-6.1.0-56-amd64",
        );
        s.modules = [
            "ib_core",
            "ib_uverbs",
            "rdma_cm",
            "rdma_ucm",
            "rdma_rxe",
            "siw",
            "iw_cm",
        ]
        .iter()
        .map(|m| m.to_string())
        .collect();
        s.dev_nodes = ["uverbs0", "uverbs1", "rdma_cm"]
            .iter()
            .map(|m| m.to_string())
            .collect();
        s.kernel_devices = vec!["rxe0".into(), "siw0".into()];
        s.cap_ipc_lock = true;
        s.devices = Ok(vec![
            Dev {
                name: "rxe0".into(),
                kind: DevKind::SoftRoce,
                iwarp: false,
                atomics: "ATOMIC_HCA".into(),
                ports: vec![rxe_port()],
            },
            Dev {
                name: "siw0".into(),
                kind: DevKind::SoftIwarp,
                iwarp: true,
                atomics: "ATOMIC_NONE".into(),
                ports: vec![Port {
                    netdev: Some("dummy1".into()),
                    addrs: vec!["192.168.78.1".parse().unwrap()],
                    v2: vec![],
                    other_gids: 1,
                    max_mtu: 1024,
                    ..rxe_port()
                }],
            },
        ]);
        s.netdev_mtu = [("dummy0".to_string(), 1500), ("dummy1".to_string(), 1500)]
            .into_iter()
            .collect();
        s.pfc.insert("dummy0".into(), None);
        s.ecn.insert("dummy0".into(), None);
        let mut roce = tcp_only_provider("roce", true, "");
        roce.devices = vec![fabric::DeviceInfo {
            name: "rxe0".into(),
            transport: "InfiniBand".into(),
            link_layer: "Ethernet".into(),
            details: BTreeMap::new(),
        }];
        let mut iwarp = tcp_only_provider("iwarp", true, "");
        iwarp.devices = vec![fabric::DeviceInfo {
            name: "siw0".into(),
            transport: "iWARP".into(),
            link_layer: "Ethernet".into(),
            details: BTreeMap::new(),
        }];
        s.providers = vec![
            tcp_only_provider("ib", false, "no InfiniBand device"),
            roce,
            iwarp,
            tcp_only_provider("tcp", true, ""),
        ];
        s
    }

    fn find<'a>(c: &'a [Check], name: &str) -> &'a Check {
        c.iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no check {name}: {c:#?}"))
    }

    #[test]
    fn provider_reasons_are_summarised() {
        assert_eq!(
            summary("no InfiniBand device (x); devices present: rxe0"),
            "no InfiniBand device (x)"
        );
        assert_eq!(
            summary("no RoCE device (y): libibverbs.so.1 not found"),
            "no RoCE device (y)"
        );
        assert_eq!(summary("plain"), "plain");
    }

    #[test]
    fn sizes_in_words() {
        assert_eq!(human(8 << 20), "8 MiB");
        assert_eq!(human(1000), "1000 B");
    }

    #[test]
    fn procfs_and_tool_output_parse() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax locked memory         8388608              8388608              bytes\n";
        assert_eq!(memlock_from_limits(limits), Some(Some(8 << 20)));
        assert_eq!(
            memlock_from_limits(
                "Max locked memory         unlimited            unlimited            bytes\n"
            ),
            Some(None)
        );
        assert_eq!(memlock_from_limits("nothing\n"), None);
        assert!(cap_ipc_lock_from_status(
            "Name: x\nCapEff:\t000001ffffffffff\n"
        ));
        assert!(!cap_ipc_lock_from_status("CapEff:\t0000000000000000\n"));
        assert_eq!(pfc_from_dcb("pfc-cap 8 macsec-bypass off delay 0\nprio-pfc 0:off 1:off 2:off 3:on 4:off 5:off 6:off 7:on\n"), Some(vec![3, 7]));
        assert_eq!(pfc_from_dcb("error"), None);
        assert_eq!(
            kernel_rdma_from_config("CONFIG_A=y\n", "x"),
            KernelRdma::Unknown
        );
        assert_eq!(roce_mtu_for(1500), 1024);
        assert_eq!(roce_mtu_for(9000), 4096);
        assert_eq!(roce_mtu_for(4188), 4096);
        assert_eq!(roce_mtu_for(4187), 2048);
    }

    #[test]
    fn host_without_rdma_explains_why_and_does_not_fail() {
        let c = run_checks(&host());
        assert!(c.iter().all(|c| c.status != Status::Fail), "{c:#?}");
        let k = find(&c, "kernel");
        assert_eq!(k.status, Status::Warn);
        assert!(
            k.detail.contains("CONFIG_INFINIBAND is not set")
                && k.detail.contains("CONFIG_MODULES is not set"),
            "{}",
            k.detail
        );
        assert!(k.fix.as_deref().unwrap().contains("soft-rdma"), "{k:?}");
        assert_eq!(find(&c, "rdma-core").status, Status::Pass);
        assert!(find(&c, "rdma-core").detail.contains("rdma-core 44.0"));
        assert_eq!(find(&c, "memlock").status, Status::Warn);
        let p = find(&c, "providers");
        assert_eq!(p.status, Status::Warn);
        assert!(p.detail.contains("the selection takes tcp"), "{}", p.detail);
        let text = to_text(&c);
        assert!(text.ends_with("0 fail\n"), "{text}");
        let j = to_json(&c);
        assert_eq!(j["summary"]["fail"], 0);
        assert_eq!(j["checks"][0]["name"], "rdma-core");
    }

    #[test]
    fn host_without_rdma_core_says_so() {
        let mut s = host();
        s.rdma_core =
            RdmaCore::Missing("libibverbs.so.1 not found: rdma-core is not installed".into());
        s.devices = Err("libibverbs.so.1 not found".into());
        let c = run_checks(&s);
        let r = find(&c, "rdma-core");
        assert_eq!(r.status, Status::Warn);
        assert!(
            r.detail.contains("libibverbs.so.1 not found")
                && r.fix.as_deref().unwrap().contains("libibverbs1"),
            "{r:?}"
        );
        assert!(c.iter().all(|c| c.status != Status::Fail), "{c:#?}");
    }

    #[test]
    fn guest_explains_rxe0_and_siw0() {
        let c = run_checks(&guest());
        assert!(c.iter().all(|c| c.status != Status::Fail), "{c:#?}");
        let k = find(&c, "kernel");
        assert_eq!(k.status, Status::Pass);
        assert!(
            k.detail.contains("rxe0, siw0") && k.detail.contains("rdma_rxe"),
            "{}",
            k.detail
        );
        let rxe = find(&c, "device rxe0 port 1");
        assert_eq!(rxe.status, Status::Pass);
        assert!(
            rxe.detail.contains("soft-RoCE")
                && rxe.detail.contains("dummy0 [192.168.77.1]")
                && rxe.detail.contains("provider roce"),
            "{}",
            rxe.detail
        );
        let siw = find(&c, "device siw0 port 1");
        assert!(
            siw.detail.contains("soft-iWARP")
                && siw.detail.contains("rdma_cm")
                && siw.detail.contains("provider iwarp"),
            "{}",
            siw.detail
        );
        let gid = find(&c, "roce v2 gid rxe0 port 1");
        assert_eq!(gid.status, Status::Pass);
        assert!(
            gid.detail.contains("index 1: 192.168.77.1"),
            "{}",
            gid.detail
        );
        let mtu = find(&c, "mtu rxe0 port 1");
        assert_eq!(mtu.status, Status::Warn);
        assert!(
            mtu.detail.contains("active MTU 1024 of a possible 4096")
                && mtu.detail.contains("MTU is 1500"),
            "{}",
            mtu.detail
        );
        assert_eq!(find(&c, "mtu siw0 port 1").status, Status::Pass);
        let l = find(&c, "lossless rxe0 port 1");
        assert_eq!(l.status, Status::Warn);
        assert!(l.detail.contains("go-back-N"), "{}", l.detail);
        assert!(l.detail.contains("DSCP 0 (best effort)"), "{}", l.detail);
        let mut s = guest();
        s.default_tos.insert(("rxe0".into(), 1), 106);
        let l = run_checks(&s)
            .into_iter()
            .find(|c| c.name == "lossless rxe0 port 1")
            .unwrap();
        assert!(
            l.detail.contains("default_roce_tos 106 (DSCP 26)"),
            "{}",
            l.detail
        );
        s.traffic_class = Some(104);
        let l = run_checks(&s)
            .into_iter()
            .find(|c| c.name == "lossless rxe0 port 1")
            .unwrap();
        assert!(
            l.detail
                .contains("traffic_class = 104 (DSCP 26, ECN bits 0)"),
            "{}",
            l.detail
        );
        assert!(
            c.iter().all(|c| c.name != "roce v2 gid siw0 port 1"),
            "iWARP has no RoCE GIDs"
        );
        assert_eq!(find(&c, "memlock").status, Status::Pass);
        assert_eq!(find(&c, "providers").status, Status::Pass);
    }

    #[test]
    fn misconfigured_roce_fails_with_the_fix() {
        let mut s = guest();
        if let Ok(devs) = &mut s.devices {
            let p = &mut devs[0].ports[0];
            p.state = "DOWN".into();
            p.active = false;
            p.v2.clear();
            p.addrs.clear();
            p.active_mtu = 4096;
        }
        s.cap_ipc_lock = false;
        s.modules.remove("rdma_ucm");
        s.dev_nodes.remove("rdma_cm");
        let c = run_checks(&s);
        let port = find(&c, "device rxe0 port 1");
        assert_eq!(port.status, Status::Fail);
        assert!(
            port.fix
                .as_deref()
                .unwrap()
                .contains("ip link set dummy0 up"),
            "{port:?}"
        );
        let gid = find(&c, "roce v2 gid rxe0 port 1");
        assert_eq!(gid.status, Status::Fail);
        assert!(
            gid.fix.as_deref().unwrap().contains("ip addr add"),
            "{gid:?}"
        );
        let mtu = find(&c, "mtu rxe0 port 1");
        assert_eq!(mtu.status, Status::Fail);
        assert!(mtu.fix.as_deref().unwrap().contains("mtu 4188"), "{mtu:?}");
        assert_eq!(find(&c, "memlock").status, Status::Fail);
        assert_eq!(find(&c, "kernel: rdma_ucm").status, Status::Fail);
        assert!(to_text(&c).contains("fix: modprobe rdma_ucm"));
    }

    #[test]
    fn address_in_use_needs_its_v2_gid() {
        let mut s = guest();
        s.address = Some("10.0.0.5".parse().unwrap());
        let c = run_checks(&s);
        let gid = find(&c, "roce v2 gid rxe0 port 1");
        assert_eq!(gid.status, Status::Fail);
        assert!(
            gid.detail.contains("10.0.0.5 has no RoCE v2 GID"),
            "{}",
            gid.detail
        );
        s.address = Some("192.168.77.1".parse().unwrap());
        assert_eq!(
            find(&run_checks(&s), "roce v2 gid rxe0 port 1").status,
            Status::Pass
        );
    }
}
