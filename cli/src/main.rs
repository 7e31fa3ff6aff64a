//! `fabric`: show providers, run the demo, run the conformance suite.
#![forbid(unsafe_code)]

mod allreduce;
mod demo;
mod doctor;
mod info;
mod perf;
mod reliability;
mod rping;
mod scale;
mod units;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use fabric::{Selector, PROVIDER_NAMES};

/// One API over InfiniBand, RoCEv2, iWARP and a pure-Rust TCP fallback.
#[derive(Debug, Parser)]
#[command(name = "fabric", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Every provider: available or why not, devices, capabilities, limits.
    Info {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// A client and a server moving data with send/receive, write, read and atomics.
    Demo(demo::DemoArgs),
    /// Checks the system before you blame the framework: rdma-core, kernel modules, devices
    /// and ports, RoCE v2 GIDs, MTUs, memlock, traffic class / PFC / ECN; each pass, warn or
    /// fail with the fix (exit code 1 when one fails).
    Doctor(doctor::DoctorArgs),
    /// rdma-core's rping protocol, to check a provider against rdma-core's `rping`.
    Rping(rping::RpingArgs),
    /// Latency and bandwidth of one operation, in fabtests' columns (pingpong, bw, lat).
    Perf(perf::PerfArgs),
    /// N connected pairs in one process: threads, memory per endpoint, connect time and
    /// aggregate message rate, for each N.
    Scale(scale::ScaleArgs),
    /// Allreduce across ranks over the rdm layer, in nccl-tests' columns (`--np N` starts N
    /// ranks here; under mpirun/srun ranks come from the launcher's environment).
    Allreduce(allreduce::CollArgs),
    /// Allgather across ranks, in nccl-tests' columns.
    Allgather(allreduce::CollArgs),
    /// Broadcast across ranks, in nccl-tests' columns.
    Broadcast(allreduce::CollArgs),
    /// Run the conformance suite (docs/contract.md as tests) against providers.
    Conformance {
        /// Providers to test, comma separated.
        #[arg(long, default_value = "tcp")]
        provider: String,
        /// Also pair each provider with this one, in both directions (`tcp>iwarp`: tcp
        /// connects to an iwarp listener; `iwarp>tcp`: the reverse).
        #[arg(long)]
        peer: Option<String>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        /// Only cases whose name contains this; several, comma separated, select the cases
        /// that contain any of them (`--filter msg.,rma.write`).
        #[arg(long)]
        filter: Option<String>,
        /// List the cases and exit.
        #[arg(long)]
        list: bool,
    },
    /// Print a saved JSON conformance report as text or JUnit; exit non-zero on any fail.
    Report {
        /// The JSON file (`fabric conformance --format json > FILE`).
        file: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        /// Providers that must have run: a no-device outcome for one of them is a failure.
        #[arg(long, value_delimiter = ',')]
        require_device: Vec<String>,
        /// A failure that does not fail the exit code, named exactly as PROVIDER:CASE (for
        /// a scenario this machine cannot produce); it is still printed, loudly, with its
        /// detail. Repeatable.
        #[arg(long = "known-fail", value_name = "PROVIDER:CASE")]
        known_fail: Vec<String>,
    },
    /// RELIABILITY.md from saved JSON conformance reports: the fault and reliability cases,
    /// scenario x provider, with outcomes, times, bounds and what each case observed.
    Reliability {
        /// JSON reports (`fabric conformance --format json > FILE`), host and guest.
        files: Vec<PathBuf>,
        /// Write the document here instead of stdout.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
    /// The peer process of multi-process conformance cases (internal).
    #[command(hide = true)]
    Peer {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The peer process of the rdm and tagged-message conformance cases (internal).
    #[command(hide = true, name = "rdm-peer")]
    RdmPeer {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
    Junit,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Info { json } => info::run(json),
        Cmd::Demo(args) => demo::run(args),
        Cmd::Doctor(args) => doctor::run(args),
        Cmd::Rping(args) => rping::run(args),
        Cmd::Perf(args) => perf::run(args),
        Cmd::Allreduce(args) => allreduce::run(allreduce::Coll::Allreduce, args),
        Cmd::Allgather(args) => allreduce::run(allreduce::Coll::Allgather, args),
        Cmd::Broadcast(args) => allreduce::run(allreduce::Coll::Broadcast, args),
        Cmd::Scale(args) => scale::run(args),
        Cmd::Conformance {
            provider,
            peer,
            format,
            filter,
            list,
        } => conformance(&provider, peer.as_deref(), format, filter.as_deref(), list),
        Cmd::Report {
            file,
            format,
            require_device,
            known_fail,
        } => report(&file, format, &require_device, &known_fail),
        Cmd::Reliability { files, output } => reliability::run(&files, output.as_deref()),
        Cmd::Peer { args } => return ExitCode::from(fabric_conformance::peer::main(&args) as u8),
        Cmd::RdmPeer { args } => return ExitCode::from(allreduce::rdm_peer(&args) as u8),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fabric: {e}");
            ExitCode::from(2)
        }
    }
}

/// Builds the selector from the environment plus a `--provider` override.
pub(crate) fn selector(provider: Option<&str>) -> Result<Selector, String> {
    let s = Selector::from_env().map_err(|e| e.to_string())?;
    match provider {
        Some(p) => s.providers(p).map_err(|e| e.to_string()),
        None => Ok(s),
    }
}

fn conformance(
    provider: &str,
    peer: Option<&str>,
    format: Format,
    filter: Option<&str>,
    list: bool,
) -> Result<ExitCode, String> {
    if list {
        for c in fabric_conformance::all_cases() {
            println!("{:<44} section {}", c.name, c.section);
        }
        return Ok(ExitCode::SUCCESS);
    }
    let names: Vec<String> = provider.split(',').map(|s| s.trim().to_string()).collect();
    for p in names.iter().map(String::as_str).chain(peer) {
        if !PROVIDER_NAMES.contains(&p) {
            return Err(format!(
                "unknown provider {p:?}; valid names: {}",
                PROVIDER_NAMES.join(", ")
            ));
        }
    }
    // With --peer, each provider runs against the peer provider in both directions.
    let providers: Vec<String> = match peer {
        None => names,
        Some(peer) => names
            .iter()
            .flat_map(|p| [format!("{p}>{peer}"), format!("{peer}>{p}")])
            .collect(),
    };
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find own executable for peer processes: {e}"))?;
    // Progress on stderr whatever the format: stdout carries only the report.
    let report = fabric_conformance::run(&providers, filter, Some(exe), |r| {
        eprintln!(
            "{:<11} {:<9} {:<44} {:>6.1}s",
            r.outcome, r.provider, r.name, r.seconds
        );
    });
    if report.cases.is_empty() {
        return Err(format!(
            "no case matches the filter {:?} (see --list)",
            filter.unwrap_or_default()
        ));
    }
    print_report(&report, format);
    Ok(if report.any_fail() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn print_report(report: &fabric_conformance::Report, format: Format) {
    match format {
        Format::Text => print!("{}", report.to_text()),
        Format::Json => println!("{}", report.to_json()),
        Format::Junit => print!("{}", report.to_junit()),
    }
}

fn report(
    file: &Path,
    format: Format,
    require_device: &[String],
    known_fail: &[String],
) -> Result<ExitCode, String> {
    for k in known_fail {
        if k.split_once(':')
            .is_none_or(|(p, c)| p.is_empty() || c.is_empty())
        {
            return Err(format!("--known-fail {k:?}: expected PROVIDER:CASE"));
        }
    }
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let report = fabric_conformance::Report::from_json(&text)
        .map_err(|e| format!("{}: {e}", file.display()))?;
    print_report(&report, format);
    let missing: Vec<&fabric_conformance::CaseResult> = report
        .cases
        .iter()
        .filter(|c| {
            c.outcome == "no-device"
                && c.provider
                    .split('>')
                    .any(|p| require_device.iter().any(|r| r == p))
        })
        .collect();
    if let Some(c) = missing.first() {
        eprintln!(
            "fabric: {} case(s) of required provider(s) could not run: {}: {}",
            missing.len(),
            c.provider,
            c.detail
        );
        return Ok(ExitCode::from(1));
    }
    let mut failed = false;
    for c in report.cases.iter().filter(|c| c.outcome == "fail") {
        let label = format!("{}:{}", c.provider, c.name);
        if known_fail.contains(&label) {
            eprintln!(
                "fabric: KNOWN FAILURE, not gating (--known-fail {label}): {}",
                c.detail
            );
        } else {
            failed = true;
        }
    }
    for k in known_fail {
        let seen = report
            .cases
            .iter()
            .any(|c| format!("{}:{}", c.provider, c.name) == *k && c.outcome == "fail");
        if !seen {
            eprintln!("fabric: --known-fail {k} did not fail in this report: drop the exception");
        }
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
