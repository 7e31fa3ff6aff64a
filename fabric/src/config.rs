//! Discovery and selection (docs/contract.md section 1): which providers exist, which are
//! usable, and which one a configuration picks.
//!
//! Selection sources, later ones overriding earlier ones: the builder's defaults, a TOML
//! config file (`FABRIC_CONFIG`), the `FABRIC_PROVIDER` environment variable. A provider
//! spec is a comma list such as `roce,tcp` (only these, in this order of preference) or
//! `^ib,^roce` (anything but these); with no spec the best available provider wins in
//! the order ib, roce, iwarp, tcp.
//!
//! ```toml
//! provider = "roce,tcp"              # same syntax as FABRIC_PROVIDER
//! require = ["FETCH_ADD", "READ"]    # OpSet flag names the provider must support
//! strict = false                     # true: an operation required but only emulated is an error
//!
//! [roce]
//! device = "rxe0"                    # a device by name (default: the first usable one)
//! address = "192.168.77.1"           # the local address (its RoCE v2 GID is used)
//! traffic_class = 106                # IP TOS byte of RoCE v2 traffic: DSCP 26, ECT(0)
//!
//! [iwarp]                            # device, address as for roce, and:
//! dead_peer_timeout_ms = 10000       # a silent peer host fails the endpoint within this (probes)
//! [ib]                               # device, address (IPoIB) as for roce
//!
//! [tcp]
//! crc = false                        # ask for MPA CRC32c
//! extensions = true                  # announce atomics / immediate data / acks to our peers
//! max_segment = 65472                # payload bytes per FPDU
//! dead_peer_timeout_ms = 10000       # a silent peer host fails the endpoint within this
//! progress = "auto"                  # "auto": a progress thread per domain; "manual": polls only
//! ack_hold_us = 1000                 # how long polls may hold a deferred delivery ack
//!                                    # (default 1000 with "auto", 0 with "manual")
//!
//! hooks = ["trace", "fault"]         # wrap the provider (FABRIC_HOOKS=trace,fault)
//!
//! [fault]                            # what the fault hook injects (FABRIC_FAULT overrides)
//! seed = 42                          # default: random, shown in the selection report
//! fail_post = { every_nth = 10, kind = "QueueFull" }      # the post returns this error
//! delay = { probability = 0.1, ms = 50 }                  # completions held back
//! drop = { every_nth = 100, status = "RetryExceeded" }    # success reported as this error
//! cut = { every_nth = 1000 }                              # connection closed after a post
//! ```
//!
//! `FABRIC_HOOKS` replaces the file's hook list (empty: none); `FABRIC_FAULT` holds
//! `key=value` pairs of the `[fault]` table (`seed=7,fail_post.every_nth=3`) and replaces
//! the sections it names. See [`fabric_hook`] for what each fault does.

use std::fmt;
use std::path::Path;

use fabric_api::{Availability, Error, ErrorKind, OpSet, ProviderInfo, Result};
use fabric_hook::{FaultConfig, HookConfig};
#[cfg(feature = "verbs")]
use fabric_ib::IbDomain;
#[cfg(feature = "verbs")]
use fabric_iwarp::IwarpDomain;
#[cfg(feature = "verbs")]
use fabric_roce::RoceDomain;
use fabric_tcp::{TcpDomain, TcpOptions};
#[cfg(feature = "verbs")]
use fabric_verbs::VerbsOptions;
use serde::Deserialize;

use crate::AnyDomain;

/// Options of a verbs provider in a build without them (no `verbs` feature): parsed and
/// checked exactly as in a full build, so a configuration file means the same to every
/// build, and then unused.
#[cfg(not(feature = "verbs"))]
#[derive(Debug, Clone, Default)]
#[allow(dead_code)] // written by the configuration parser; nothing reads options of a provider not built in
struct VerbsOptions {
    device: Option<String>,
    address: Option<std::net::IpAddr>,
    traffic_class: Option<u8>,
    dead_peer_timeout: Option<std::time::Duration>,
}

/// The discovery entry of a verbs provider in a build without them.
#[cfg(not(feature = "verbs"))]
fn not_built_in(name: &str) -> ProviderInfo {
    ProviderInfo {
        name: name.into(),
        availability: Availability::Unavailable {
            reason: format!("not built into this binary: the fabric crate was built without its `verbs` feature (tcp only); build with default features for {name}"),
        },
        devices: Vec::new(),
        caps: fabric_api::Capabilities {
            ops: OpSet::empty(),
            limits: fabric_api::Limits {
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
            unsupported: Default::default(),
        },
    }
}

/// Every provider name, in order of preference.
pub const PROVIDER_NAMES: [&str; 4] = ["ib", "roce", "iwarp", "tcp"];

/// Environment variable holding a provider spec.
pub const ENV_PROVIDER: &str = "FABRIC_PROVIDER";
/// Environment variable naming a TOML config file.
pub const ENV_CONFIG: &str = "FABRIC_CONFIG";
/// Environment variable holding the hook list (`trace,fault`).
pub const ENV_HOOKS: &str = "FABRIC_HOOKS";
/// Environment variable holding fault settings (`seed=7,fail_post.every_nth=3`).
pub const ENV_FAULT: &str = "FABRIC_FAULT";

/// Every provider this framework knows, with availability, devices and capabilities.
pub fn discover() -> Vec<ProviderInfo> {
    Selector::new().discover()
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Spec {
    /// No preference: every provider in the default order.
    Any,
    /// Only these, in this order.
    Only(Vec<String>),
    /// Everything but these.
    Except(Vec<String>),
}

fn parse_spec(spec: &str) -> Result<Spec> {
    let mut only = Vec::new();
    let mut except = Vec::new();
    for raw in spec.split(',') {
        let item = raw.trim();
        if item.is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                format!("empty provider name in {spec:?}"),
            ));
        }
        let (neg, name) = match item.strip_prefix('^') {
            Some(n) => (true, n.trim()),
            None => (false, item),
        };
        if !PROVIDER_NAMES.contains(&name) {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "unknown provider {name:?} in {spec:?}; valid names: {}",
                    PROVIDER_NAMES.join(", ")
                ),
            ));
        }
        if neg { &mut except } else { &mut only }.push(name.to_string());
    }
    match (only.is_empty(), except.is_empty()) {
        (false, true) => Ok(Spec::Only(only)),
        (true, false) => Ok(Spec::Except(except)),
        (false, false) => Ok(Spec::Only(
            only.into_iter().filter(|n| !except.contains(n)).collect(),
        )),
        (true, true) => Ok(Spec::Any),
    }
}

fn parse_ops(names: &[String]) -> Result<OpSet> {
    let mut ops = OpSet::empty();
    for n in names {
        ops |= OpSet::from_name(n).ok_or_else(|| {
            let valid: Vec<_> = OpSet::all().iter_names().map(|(n, _)| n).collect();
            Error::new(
                ErrorKind::Config,
                format!("unknown operation {n:?}; valid: {}", valid.join(", ")),
            )
        })?;
    }
    Ok(ops)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    provider: Option<String>,
    #[serde(default)]
    require: Vec<String>,
    strict: Option<bool>,
    tcp: Option<TcpSection>,
    roce: Option<VerbsSection>,
    iwarp: Option<VerbsSection>,
    ib: Option<VerbsSection>,
    hooks: Option<Vec<String>>,
    fault: Option<FaultConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VerbsSection {
    device: Option<String>,
    address: Option<std::net::IpAddr>,
    traffic_class: Option<u8>,
    dead_peer_timeout_ms: Option<u64>,
}

impl VerbsSection {
    fn apply(self, name: &str, o: &mut VerbsOptions) -> Result<()> {
        if let Some(d) = self.device {
            o.device = Some(d);
        }
        if let Some(a) = self.address {
            o.address = Some(a);
        }
        if let Some(t) = self.traffic_class {
            if name == "iwarp" {
                return Err(Error::new(
                    ErrorKind::Config,
                    "[iwarp] traffic_class: iWARP runs over TCP; set the socket priority of the netdev instead",
                ));
            }
            o.traffic_class = Some(t);
        }
        if let Some(ms) = self.dead_peer_timeout_ms {
            if name != "iwarp" {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("[{name}] dead_peer_timeout_ms: the device's ACK timeout and retry count bound dead peers on {name} (fabric_verbs::DEAD_PEER_BOUND, 1.879 s); only [iwarp] takes this key"),
                ));
            }
            if !(2_000..=3_600_000).contains(&ms) {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("[iwarp] dead_peer_timeout_ms = {ms}: expected 2000..=3600000"),
                ));
            }
            o.dead_peer_timeout = Some(std::time::Duration::from_millis(ms));
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TcpSection {
    crc: Option<bool>,
    extensions: Option<bool>,
    max_segment: Option<usize>,
    dead_peer_timeout_ms: Option<u64>,
    progress: Option<String>,
    ack_hold_us: Option<u64>,
}

/// Chooses a provider from configuration and opens a domain on it.
#[derive(Debug, Clone)]
pub struct Selector {
    spec: Spec,
    require: OpSet,
    strict: bool,
    tcp: TcpOptions,
    roce: VerbsOptions,
    iwarp: VerbsOptions,
    ib: VerbsOptions,
    trace: bool,
    fault_on: bool,
    fault: FaultConfig,
    sources: Vec<String>,
}

impl Default for Selector {
    fn default() -> Self {
        Selector {
            spec: Spec::Any,
            require: OpSet::empty(),
            strict: false,
            tcp: TcpOptions::default(),
            roce: VerbsOptions::default(),
            iwarp: VerbsOptions::default(),
            ib: VerbsOptions::default(),
            trace: false,
            fault_on: false,
            fault: FaultConfig::default(),
            sources: Vec::new(),
        }
    }
}

impl Selector {
    /// No preference, nothing required.
    pub fn new() -> Self {
        Self::default()
    }

    /// The config file named by `FABRIC_CONFIG` (if set), then `FABRIC_PROVIDER` (if set).
    pub fn from_env() -> Result<Self> {
        let mut s = Selector::new();
        if let Some(path) = std::env::var_os(ENV_CONFIG) {
            s = s.config_file(Path::new(&path))?;
        }
        if let Ok(spec) = std::env::var(ENV_PROVIDER) {
            s = s.providers(&spec).map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!("{ENV_PROVIDER}: {}", e.message()),
                )
            })?;
            s.sources.push(format!("{ENV_PROVIDER}={spec}"));
        }
        if let Ok(list) = std::env::var(ENV_HOOKS) {
            s = s.hook_list(&list).map_err(|e| {
                Error::new(ErrorKind::Config, format!("{ENV_HOOKS}: {}", e.message()))
            })?;
            s.sources.push(format!("{ENV_HOOKS}={list}"));
        }
        if let Ok(spec) = std::env::var(ENV_FAULT) {
            let f = FaultConfig::from_spec(&spec).map_err(|e| {
                Error::new(ErrorKind::Config, format!("{ENV_FAULT}: {}", e.message()))
            })?;
            s.fault = std::mem::take(&mut s.fault).merge(f);
            s.sources.push(format!("{ENV_FAULT}={spec}"));
        }
        Ok(s)
    }

    /// Applies a TOML config file (see the module docs).
    pub fn config_file(mut self, path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("cannot read config file {}: {e}", path.display()),
            )
        })?;
        self = self.config_str(&text).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("config file {}: {}", path.display(), e.message()),
            )
        })?;
        self.sources.push(format!("config file {}", path.display()));
        Ok(self)
    }

    /// Applies TOML config text.
    pub fn config_str(mut self, text: &str) -> Result<Self> {
        let cfg: FileConfig =
            toml::from_str(text).map_err(|e| Error::new(ErrorKind::Config, e.to_string()))?;
        if let Some(p) = &cfg.provider {
            self.spec = parse_spec(p)?;
        }
        self.require |= parse_ops(&cfg.require)?;
        if let Some(s) = cfg.strict {
            self.strict = s;
        }
        if let Some(t) = cfg.tcp {
            if let Some(v) = t.crc {
                self.tcp.crc = v;
            }
            if let Some(v) = t.extensions {
                self.tcp.extensions = v;
            }
            if let Some(v) = t.max_segment {
                self.tcp.max_segment = v;
            }
            if let Some(ms) = t.dead_peer_timeout_ms {
                if !(2_000..=3_600_000).contains(&ms) {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!("[tcp] dead_peer_timeout_ms = {ms}: expected 2000..=3600000"),
                    ));
                }
                self.tcp.dead_peer_timeout = std::time::Duration::from_millis(ms);
            }
            if let Some(us) = t.ack_hold_us {
                if us > 1_000_000 {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!("[tcp] ack_hold_us = {us}: expected 0..=1000000"),
                    ));
                }
                self.tcp.ack_hold = Some(std::time::Duration::from_micros(us));
            }
            if let Some(p) = t.progress {
                self.tcp.progress = match p.as_str() {
                    "auto" => fabric_tcp::ProgressMode::Auto,
                    "manual" => fabric_tcp::ProgressMode::Manual,
                    other => {
                        return Err(Error::new(
                            ErrorKind::Config,
                            format!("[tcp] progress = {other:?}: expected \"auto\" or \"manual\""),
                        ))
                    }
                };
            }
        }
        if let Some(v) = cfg.roce {
            v.apply("roce", &mut self.roce)?;
        }
        if let Some(v) = cfg.iwarp {
            v.apply("iwarp", &mut self.iwarp)?;
        }
        if let Some(v) = cfg.ib {
            v.apply("ib", &mut self.ib)?;
        }
        if let Some(list) = cfg.hooks {
            self = self
                .hook_list(&list.join(","))
                .map_err(|e| Error::new(ErrorKind::Config, format!("hooks: {}", e.message())))?;
        }
        if let Some(f) = cfg.fault {
            self.fault = std::mem::take(&mut self.fault).merge(f);
        }
        Ok(self)
    }

    /// Sets the provider spec (`"roce,tcp"`, `"^ib"`); unknown names are an error listing
    /// the valid ones.
    pub fn providers(mut self, spec: &str) -> Result<Self> {
        self.spec = parse_spec(spec)?;
        Ok(self)
    }

    /// Operations the provider must support.
    pub fn require(mut self, ops: OpSet) -> Self {
        self.require |= ops;
        self
    }

    /// Strict mode: a required operation that is only emulated disqualifies a provider.
    pub fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// Options of the tcp provider.
    pub fn tcp_options(mut self, opts: TcpOptions) -> Self {
        self.tcp = opts;
        self
    }

    #[cfg(feature = "verbs")]
    /// Options of the roce provider (device, address, traffic class).
    pub fn roce_options(mut self, opts: VerbsOptions) -> Self {
        self.roce = opts;
        self
    }

    #[cfg(feature = "verbs")]
    /// Options of the iwarp provider (device, address).
    pub fn iwarp_options(mut self, opts: VerbsOptions) -> Self {
        self.iwarp = opts;
        self
    }

    #[cfg(feature = "verbs")]
    /// Options of the ib provider (device, address).
    pub fn ib_options(mut self, opts: VerbsOptions) -> Self {
        self.ib = opts;
        self
    }

    /// Switches hooks on or off from a list such as `"trace,fault"` (the syntax of
    /// `FABRIC_HOOKS`; empty turns every hook off). Unknown names are an error listing the
    /// valid ones. The fault hook injects what the `[fault]` table or
    /// [`fault`](Self::fault) set.
    pub fn hook_list(mut self, list: &str) -> Result<Self> {
        let (trace, fault) = HookConfig::parse_list(list)?;
        self.trace = trace;
        self.fault_on = fault;
        Ok(self)
    }

    /// Sets every hook at once: tracing on or off, and the faults to inject (`None`: the
    /// fault hook off).
    pub fn hooks(mut self, hooks: HookConfig) -> Self {
        self.trace = hooks.trace;
        self.fault_on = hooks.fault.is_some();
        self.fault = hooks.fault.unwrap_or_default();
        self
    }

    /// Turns the tracing hook on or off.
    pub fn trace(mut self, on: bool) -> Self {
        self.trace = on;
        self
    }

    /// Turns the fault hook on with these faults.
    pub fn fault(mut self, fault: FaultConfig) -> Self {
        self.fault_on = true;
        self.fault = fault;
        self
    }

    /// The hooks [`open`](Self::open) wraps the domain with.
    pub fn hook_config(&self) -> HookConfig {
        HookConfig {
            trace: self.trace,
            fault: self.fault_on.then(|| self.fault.clone()),
        }
    }

    /// The discovery entry of provider `name` under this selector's options.
    fn info(&self, name: &str) -> ProviderInfo {
        match name {
            #[cfg(feature = "verbs")]
            fabric_roce::NAME => fabric_roce::info(&self.roce),
            #[cfg(feature = "verbs")]
            fabric_iwarp::NAME => fabric_iwarp::info(&self.iwarp),
            #[cfg(feature = "verbs")]
            fabric_ib::NAME => fabric_ib::info(&self.ib),
            #[cfg(not(feature = "verbs"))]
            "roce" | "iwarp" | "ib" => not_built_in(name),
            _ => fabric_tcp::info(),
        }
    }

    /// Every provider's discovery entry under this selector's options (devices, addresses),
    /// in the default order: what [`discover`] says, for this configuration.
    pub fn discover(&self) -> Vec<ProviderInfo> {
        PROVIDER_NAMES.iter().map(|&name| self.info(name)).collect()
    }

    /// The options of verbs provider `name` (`roce`, `iwarp`, `ib`) as configured;
    /// `None` for other names.
    #[cfg(feature = "verbs")]
    pub fn verbs_options(&self, name: &str) -> Option<&VerbsOptions> {
        match name {
            fabric_roce::NAME => Some(&self.roce),
            fabric_iwarp::NAME => Some(&self.iwarp),
            fabric_ib::NAME => Some(&self.ib),
            _ => None,
        }
    }

    /// The candidate provider names, in order of preference.
    pub fn candidates(&self) -> Vec<String> {
        match &self.spec {
            Spec::Any => PROVIDER_NAMES.iter().map(|s| s.to_string()).collect(),
            Spec::Only(v) => v.clone(),
            Spec::Except(v) => PROVIDER_NAMES
                .iter()
                .filter(|n| !v.iter().any(|x| x == *n))
                .map(|s| s.to_string())
                .collect(),
        }
    }

    fn disqualify(&self, info: &ProviderInfo) -> Option<String> {
        if let Availability::Unavailable { reason } = &info.availability {
            return Some(reason.clone());
        }
        let missing = self.require - info.caps.ops;
        if !missing.is_empty() {
            return Some(format!("does not support required {missing:?}"));
        }
        if self.strict {
            let emulated: OpSet = info
                .caps
                .emulated
                .iter()
                .fold(OpSet::empty(), |a, e| a | e.ops);
            let only_emulated = self.require & emulated;
            if !only_emulated.is_empty() {
                return Some(format!(
                    "strict mode: required {only_emulated:?} only emulated"
                ));
            }
        }
        None
    }

    /// Picks the first qualifying provider and opens a domain on it.
    pub fn open(&self) -> Result<(AnyDomain, SelectionReport)> {
        let mut rejected = Vec::new();
        for name in self.candidates() {
            let info = self.info(&name);
            let info = &info;
            if let Some(why) = self.disqualify(info) {
                rejected.push((name, why));
                continue;
            }
            let (domain, device): (AnyDomain, String) = match name.as_str() {
                #[cfg(feature = "verbs")]
                fabric_roce::NAME => {
                    let d = RoceDomain::open(self.roce.clone())?;
                    let s = d.selection().summary.clone();
                    (d.into(), s)
                }
                #[cfg(feature = "verbs")]
                fabric_iwarp::NAME => {
                    let d = IwarpDomain::open(self.iwarp.clone())?;
                    let s = d.selection().summary.clone();
                    (d.into(), s)
                }
                #[cfg(feature = "verbs")]
                fabric_ib::NAME => {
                    let d = IbDomain::open(self.ib.clone())?;
                    let s = d.selection().summary.clone();
                    (d.into(), s)
                }
                _ => (
                    TcpDomain::open(self.tcp.clone())?.into(),
                    info.devices
                        .first()
                        .map(|d| d.name.clone())
                        .unwrap_or_default(),
                ),
            };
            let domain = domain.with_hooks(self.hook_config());
            let hooks = domain.hooks().map(|h| h.describe()).unwrap_or_default();
            let report = SelectionReport {
                provider: name,
                device,
                emulated: info
                    .caps
                    .emulated
                    .iter()
                    .map(|e| format!("{}: {}", e.feature, e.how))
                    .collect(),
                rejected,
                sources: self.sources.clone(),
                hooks,
            };
            tracing::info!(provider = %report.provider, device = %report.device, emulated = ?report.emulated, rejected = ?report.rejected, hooks = ?report.hooks, "fabric provider selected");
            return Ok((domain, report));
        }
        let why: Vec<String> = rejected.iter().map(|(n, w)| format!("{n}: {w}")).collect();
        Err(Error::new(
            ErrorKind::NoDevice,
            format!("no provider qualifies ({})", why.join("; ")),
        ))
    }
}

/// What was selected and why: never silent.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SelectionReport {
    /// The provider.
    pub provider: String,
    /// The device (and, for verbs providers, port and GID).
    pub device: String,
    /// Operations emulated rather than native, with how.
    pub emulated: Vec<String>,
    /// Providers passed over, with the reason.
    pub rejected: Vec<(String, String)>,
    /// Where the configuration came from.
    pub sources: Vec<String>,
    /// Hooks wrapping the provider (tracing, fault injection with its seed); empty when none.
    pub hooks: Vec<String>,
}

impl fmt::Display for SelectionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "provider: {} (device {})", self.provider, self.device)?;
        if !self.sources.is_empty() {
            writeln!(f, "configured by: {}", self.sources.join(", "))?;
        }
        for (n, why) in &self.rejected {
            writeln!(f, "passed over {n}: {why}")?;
        }
        for e in &self.emulated {
            writeln!(f, "emulated: {e}")?;
        }
        for h in &self.hooks {
            writeln!(f, "hook active: {h}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_includes_excludes_and_reject_unknown_names() {
        assert_eq!(
            parse_spec("roce,tcp").unwrap(),
            Spec::Only(vec!["roce".into(), "tcp".into()])
        );
        assert_eq!(
            parse_spec("^ib, ^roce").unwrap(),
            Spec::Except(vec!["ib".into(), "roce".into()])
        );
        let e = parse_spec("tcp,verbz").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("ib, roce, iwarp, tcp"), "{e}");
        assert!(parse_spec("tcp,,roce").is_err());
    }

    #[test]
    fn default_selection_falls_back_to_tcp_and_reports_why() {
        let (_, report) = Selector::new().open().unwrap();
        assert_eq!(report.provider, "tcp");
        assert_eq!(report.rejected.len(), 3);
        assert!(!report.emulated.is_empty());
        let (_, report) = Selector::new()
            .providers("^tcp")
            .unwrap()
            .open()
            .map(|_| ())
            .map(|_| unreachable!())
            .unwrap_or_else(|e: Error| {
                assert_eq!(e.kind(), ErrorKind::NoDevice);
                (
                    (),
                    SelectionReport {
                        provider: String::new(),
                        device: String::new(),
                        emulated: vec![],
                        rejected: vec![],
                        sources: vec![],
                        hooks: vec![],
                    },
                )
            });
        assert!(report.provider.is_empty());
    }

    #[test]
    fn strict_mode_refuses_emulated_requirements() {
        let e = Selector::new()
            .require(OpSet::FETCH_ADD)
            .strict(true)
            .open()
            .unwrap_err();
        assert!(e.message().contains("only emulated"), "{e}");
        assert!(Selector::new().require(OpSet::FETCH_ADD).open().is_ok());
    }

    #[test]
    fn hooks_and_faults_come_from_the_config_text() {
        let s = Selector::new()
            .config_str(
                "hooks = [\"trace\", \"fault\"]\n[fault]\nseed = 3\n\
                 fail_post = { every_nth = 2, kind = \"Flushed\" }\n\
                 cut = { probability = 0.25 }\n",
            )
            .unwrap();
        let h = s.hook_config();
        assert!(h.trace);
        let f = h.fault.unwrap();
        assert_eq!(f.seed, Some(3));
        assert_eq!(f.fail_post.unwrap().kind, ErrorKind::Flushed);
        assert_eq!(f.cut.unwrap().trigger.probability, 0.25);

        // A [fault] table alone configures, the hook list switches on.
        let s = Selector::new()
            .config_str("[fault]\ndelay = { every_nth = 1, ms = 5 }\n")
            .unwrap();
        assert!(!s.hook_config().is_active());
        assert!(s.hook_list("fault").unwrap().hook_config().fault.is_some());
        assert!(!Selector::new()
            .trace(true)
            .hook_list("")
            .unwrap()
            .hook_config()
            .is_active());
    }

    #[test]
    fn bad_hook_config_names_the_key() {
        let msg = |text: &str| Selector::new().config_str(text).unwrap_err().to_string();
        let m = msg("hooks = [\"trace\", \"chaos\"]");
        assert!(
            m.contains("hooks") && m.contains("chaos") && m.contains("trace, fault"),
            "{m}"
        );
        let m = msg("[fault]\ndrop = { every_nth = 0 }");
        assert!(m.contains("fault.drop"), "{m}");
        let m = msg("[fault]\nfail_post = { every_nth = 1, kind = \"Nope\" }");
        assert!(
            m.contains("fault.fail_post.kind") && m.contains("QueueFull"),
            "{m}"
        );
        let m = msg("[fault]\ndelay = { probability = 2.0, ms = 1 }");
        assert!(m.contains("fault.delay.probability"), "{m}");
        let m = msg("[fault]\ncut = { every_nth = 1, when = 3 }");
        assert!(m.contains("when"), "{m}");
        let m = msg("[fault]\nseeds = 1");
        assert!(m.contains("seeds"), "{m}");
        let m = msg("[hooks]\ntrace = true");
        assert!(m.contains("hooks"), "{m}");
        assert_eq!(
            Selector::new().hook_list("trace,x").unwrap_err().kind(),
            ErrorKind::Config
        );
    }

    #[test]
    fn the_report_names_the_active_hooks() {
        let (domain, report) = Selector::new()
            .providers("tcp")
            .unwrap()
            .fault(FaultConfig::new().seed(11))
            .trace(true)
            .open()
            .unwrap();
        assert!(domain.hooks().is_some());
        assert_eq!(report.hooks.len(), 2, "{report:?}");
        let text = report.to_string();
        assert!(text.contains("hook active: trace"), "{text}");
        assert!(text.contains("hook active: fault (seed 11"), "{text}");
        let (domain, report) = Selector::new().providers("tcp").unwrap().open().unwrap();
        assert!(domain.hooks().is_none() && report.hooks.is_empty());
        assert!(!report.to_string().contains("hook"));
    }

    #[test]
    fn config_text_is_validated() {
        let s = Selector::new()
            .config_str("provider = \"tcp\"\nrequire = [\"READ\"]\n[tcp]\ncrc = true\n")
            .unwrap();
        assert!(s.tcp.crc);
        assert_eq!(s.require, OpSet::READ);
        let e = Selector::new().config_str("provder = \"tcp\"").unwrap_err();
        assert!(e.message().contains("unknown field"), "{e}");
        assert!(Selector::new()
            .config_str("require = [\"TELEPORT\"]")
            .unwrap_err()
            .message()
            .contains("valid"));
        assert!(Selector::new()
            .config_str("[tcp]\nmax_segment = 0")
            .unwrap()
            .open()
            .is_err());
        let s = Selector::new()
            .config_str(
                "[tcp]\nprogress = \"manual\"\ndead_peer_timeout_ms = 5000\nack_hold_us = 0\n",
            )
            .unwrap();
        assert_eq!(s.tcp.progress, fabric_tcp::ProgressMode::Manual);
        assert_eq!(s.tcp.ack_hold, Some(std::time::Duration::ZERO));
        assert_eq!(s.tcp.dead_peer_timeout, std::time::Duration::from_secs(5));
        for (bad, key) in [
            ("progress = \"sometimes\"", "progress"),
            ("dead_peer_timeout_ms = 1", "dead_peer_timeout_ms"),
            ("ack_hold_us = 2000000", "ack_hold_us"),
        ] {
            let e = Selector::new()
                .config_str(&format!("[tcp]\n{bad}\n"))
                .unwrap_err();
            assert!(e.message().contains(key), "{e}");
        }
    }

    #[test]
    fn iwarp_dead_peer_timeout_is_validated() {
        let s = Selector::new()
            .config_str("[iwarp]\ndead_peer_timeout_ms = 4000\n")
            .unwrap();
        assert_eq!(
            s.iwarp.dead_peer_timeout,
            Some(std::time::Duration::from_secs(4))
        );
        assert_eq!(Selector::new().iwarp.dead_peer_timeout, None);
        for bad in [
            "[iwarp]\ndead_peer_timeout_ms = 1999",
            "[iwarp]\ndead_peer_timeout_ms = 3600001",
            "[roce]\ndead_peer_timeout_ms = 5000",
            "[ib]\ndead_peer_timeout_ms = 5000",
        ] {
            let e = Selector::new().config_str(bad).unwrap_err();
            assert!(e.message().contains("dead_peer_timeout_ms"), "{bad}: {e}");
        }
    }

    #[cfg(not(feature = "verbs"))]
    #[test]
    fn tcp_only_build_names_the_verbs_providers_not_built_in() {
        let s = Selector::new()
            .config_str("provider = \"roce,tcp\"\n[roce]\ndevice = \"rxe0\"\n")
            .unwrap();
        assert_eq!(s.roce.device.as_deref(), Some("rxe0"));
        for name in ["roce", "iwarp", "ib"] {
            let info = s.info(name);
            assert_eq!(info.name, name);
            match &info.availability {
                Availability::Unavailable { reason } => {
                    assert!(reason.contains("not built into this binary"), "{reason}")
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        // Configuration files mean the same to every build: bad verbs keys are still errors.
        assert!(Selector::new().config_str("[roce]\nbogus = 1\n").is_err());
        assert!(Selector::new()
            .config_str("[iwarp]\ntraffic_class = 8\n")
            .is_err());
        let e = Selector::new()
            .providers("roce")
            .unwrap()
            .open()
            .unwrap_err();
        assert!(
            e.message().contains("roce: not built into this binary"),
            "{e}"
        );
        let (_d, report) = s.open().unwrap();
        assert_eq!(report.provider, "tcp");
        assert!(
            report
                .rejected
                .iter()
                .any(|(n, why)| n == "roce" && why.contains("not built")),
            "{report}"
        );
    }
}
