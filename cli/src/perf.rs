//! `fabric perf`: latency and bandwidth of one operation over the selected provider, in the
//! columns of fabtests (bytes, iters, total, time, MB/sec, usec/xfer, Mxfers/sec).
//!
//! ```text
//! fabric perf pingpong|bw|lat --op send|write|write_imm|read|fetch_add|compare_swap|tagged
//!             [--size N | --sizes 8,64,1K,64K,1M] [--iters N] [--provider P]
//!             [--role server --listen ADDR | --role client --connect ADDR] [--format text|json]
//!             [--completion delivery|transmit] [--wait | --spin] [--server-polls]
//! ```
//!
//! With no role the command runs both sides on loopback as two processes: it starts itself
//! as the server (`--role server`), reads the address the server prints, and runs the client.
//!
//! What each test measures (the client does the timing):
//! * `pingpong`: send: the client sends, the server echoes the message back; write: each side
//!   writes into the other's memory and polls the last byte for the iteration's marker, as
//!   `ib_write_lat` does; write_imm: each side writes with immediate data into the other's
//!   memory and waits for the receive it consumes there, as the send pingpong does (what
//!   a middleware's "data is there" notification costs). usec/xfer is one-way: half a round trip (fabtests' pingpong counts
//!   two transfers per iteration). For read and the atomics one transfer is itself a round
//!   trip (request and response): usec/xfer is the whole operation, as `ib_read_lat` and
//!   `ib_atomic_lat` report it, and the server application does nothing. tagged: the send
//!   ping-pong over reliable datagram endpoints with tagged messages (fabric-rdm, see
//!   `perf/tagged.rs`), as `fi_pingpong -e rdm` measures libfabric's RDM layer; pingpong
//!   and lat only.
//! * `lat`: the same exchange with every iteration timed; adds the minimum, median, 99th
//!   percentile and maximum (the columns of perftest's `_lat` tools).
//! * `bw`: the client keeps `--window` requests outstanding (signaling one in four), the
//!   server only reposts receives (send) or does nothing (one-sided operations); the time
//!   runs from the first post to the last completion at the client.
//!
//! Completions are busy-polled by default (poll, and `sched_yield` when the queue is empty,
//! so a provider's own threads are not starved on small machines); `--spin` polls without
//! yielding, `--wait` blocks in the completion queue's `wait`. The output says which. The
//! server echoes in the client's mode; while it only waits for the client's next control
//! message (all through a one-sided phase) it blocks, or with `--server-polls` polls in
//! the client's mode too, as perftest's server over rdma_cm does.
//!
//! Each side sizes its queues to the test it is given (`run::Queues`): a latency or
//! ping-pong test's hold what its loop keeps outstanding, and its endpoints ask for one
//! gather entry and inline payloads up to its largest message, as perftest's latency tools
//! keep theirs small; a bandwidth test's hold its window. A server given another test than
//! its client still serves it, keeping as many receives as its queues hold.

mod run;
mod tagged;

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::SocketAddr;
use std::process::{Command, ExitCode, Stdio};

use clap::{Args, ValueEnum};
use fabric::prelude::*;

/// Arguments of `fabric perf`.
#[derive(Debug, Clone, Args)]
pub(crate) struct PerfArgs {
    /// Which test: a ping-pong (one-way latency), every iteration timed (latency
    /// distribution), or a stream of outstanding requests (bandwidth).
    #[arg(value_enum)]
    test: Test,
    /// The operation measured.
    #[arg(long, value_enum, default_value_t = Op::Send)]
    op: Op,
    /// One message size in bytes (suffixes K = 2^10, M = 2^20, G = 2^30).
    #[arg(long, value_parser = parse_size, conflicts_with = "sizes")]
    size: Option<u64>,
    /// Message sizes to sweep, comma separated [default: 8,64,1K,64K,1M; 8 for atomics].
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Timed iterations per size [default: by test and size, see --help].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    iters: Option<u64>,
    /// Untimed iterations before the timed ones [default: a tenth of --iters, at most 1000].
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1_000_000_000))]
    warmup: Option<u64>,
    /// bw: requests kept outstanding (reads and atomics: at most the provider's ORD).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    window: u64,
    /// Provider spec (overrides FABRIC_PROVIDER), e.g. `tcp`.
    #[arg(long)]
    provider: Option<String>,
    /// Run one side only: `server` (with --listen) or `client` (with --connect). Without a
    /// role both run on loopback as two processes.
    #[arg(long, value_enum)]
    role: Option<Role>,
    /// Address the server listens on [default: 127.0.0.1:0, any port].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Address of the server (`--role client`).
    #[arg(long, required_if_eq("role", "client"))]
    connect: Option<SocketAddr>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Block in the completion queue's wait instead of busy polling.
    #[arg(long, conflicts_with = "spin")]
    wait: bool,
    /// Busy poll without yielding the CPU (or pausing) between empty polls.
    #[arg(long)]
    spin: bool,
    /// What a send's or write's completion means: `delivery`, its data is at the target
    /// (the contract's default), or `transmit`, it has left for the peer
    /// (`SendFlags::TRANSMIT_COMPLETE`, libfabric's FI_TRANSMIT_COMPLETE; what perftest
    /// measures on iWARP). Both sides use it. It changes the cost only on iWARP.
    #[arg(long, value_enum, default_value_t = CompletionLevel::Delivery)]
    completion: CompletionLevel,
    /// The server application polls its completion queue in the client's mode (busy or
    /// `--spin`) whenever it waits, also while the client runs one-sided operations,
    /// instead of blocking in `wait` there: what perftest's server does over rdma_cm
    /// (`-R`), which busy-polls its handshake's receive queue until the client is done.
    /// Where the provider answers a request from a kernel thread on the target's CPU
    /// (siw's transmit thread sends a Read Response), a polling target keeps that CPU
    /// from sleeping. Without it the target application takes no part (the contract's
    /// one-sided case). Given to the client (or to the command without a role); the
    /// server learns it from the client, as it learns the polling mode.
    #[arg(long, conflicts_with = "wait")]
    server_polls: bool,
}

/// The completion level of the data sends and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum CompletionLevel {
    /// Complete when the data is at the target.
    Delivery,
    /// Complete when the request has left (`SendFlags::TRANSMIT_COMPLETE`).
    Transmit,
}

/// The three tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Test {
    /// Alternating transfers; usec/xfer one-way (fabtests' fi_pingpong).
    Pingpong,
    /// Outstanding transfers; MB/sec (perftest's _bw tools).
    Bw,
    /// Alternating transfers, each timed; minimum, median, p99, maximum (perftest's _lat).
    Lat,
}

/// The operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Op {
    /// Two-sided send / receive.
    Send,
    /// RDMA write.
    Write,
    /// RDMA write with immediate data (consumes a receive at the target).
    #[value(name = "write_imm", alias = "write-imm")]
    WriteImm,
    /// RDMA read.
    Read,
    /// 64-bit fetch-and-add.
    #[value(name = "fetch_add", alias = "fetch-add")]
    FetchAdd,
    /// 64-bit compare-and-swap.
    #[value(name = "compare_swap", alias = "compare-swap")]
    CompareSwap,
    /// Tagged send / receive over reliable datagram endpoints (fabric-rdm): eager below
    /// its eager size, a rendezvous by RDMA Read above.
    Tagged,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    Server,
    Client,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Json,
}

/// How completions are waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Poll; `sched_yield` when the queue is empty.
    Busy,
    /// Poll in a tight loop, as perftest's `_lat` tools and `fi_pingpong` poll: the next
    /// poll follows an empty one at once, with no `pause` (`std::hint::spin_loop`) between.
    /// A pause is a courtesy to a hyperthread sibling on hardware; under QEMU's TCG (the
    /// soft-RDMA guest) it ends the translated block and returns to the emulator's loop,
    /// which takes its global lock each time: without it the 8-byte write ping-pongs and
    /// roce's send ping-pong ran 13-28% faster there, reads and atomics unchanged
    /// (docs/benchmarks-record.md, twenty-eighth session).
    Spin,
    /// Block in `CqOps::wait`.
    Block,
}

impl Mode {
    fn describe(self) -> &'static str {
        match self {
            Mode::Busy => "busy polling (poll; sched_yield when empty)",
            Mode::Spin => "busy polling (poll in a tight loop, no yield or pause)",
            Mode::Block => "blocking wait (CqOps::wait between polls)",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Mode::Busy => "busy-poll",
            Mode::Spin => "spin",
            Mode::Block => "wait",
        }
    }
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::Pingpong => "pingpong",
            Test::Bw => "bw",
            Test::Lat => "lat",
        }
    }
    fn code(self) -> u8 {
        self as u8
    }
    fn from_code(c: u8) -> Option<Test> {
        [Test::Pingpong, Test::Bw, Test::Lat]
            .into_iter()
            .find(|t| t.code() == c)
    }
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Send => "send",
            Op::Write => "write",
            Op::WriteImm => "write_imm",
            Op::Read => "read",
            Op::FetchAdd => "fetch_add",
            Op::CompareSwap => "compare_swap",
            Op::Tagged => "tagged",
        }
    }
    fn code(self) -> u8 {
        self as u8
    }
    fn from_code(c: u8) -> Option<Op> {
        [
            Op::Send,
            Op::Write,
            Op::WriteImm,
            Op::Read,
            Op::FetchAdd,
            Op::CompareSwap,
        ]
        .into_iter()
        .find(|o| o.code() == c)
    }
    fn needs(self) -> OpSet {
        match self {
            Op::Send => OpSet::SEND,
            Op::Write => OpSet::WRITE,
            Op::WriteImm => OpSet::WRITE_IMM,
            Op::Read => OpSet::READ,
            Op::FetchAdd => OpSet::FETCH_ADD,
            Op::CompareSwap => OpSet::COMPARE_SWAP,
            // Eager messages are sends; the rendezvous reads the sender's memory.
            Op::Tagged => OpSet::SEND | OpSet::READ,
        }
    }
    fn is_atomic(self) -> bool {
        matches!(self, Op::FetchAdd | Op::CompareSwap)
    }
    /// Whether one transfer of a ping-pong is one way (send, write) rather than a round
    /// trip (read, atomics).
    fn one_way(self) -> bool {
        matches!(self, Op::Send | Op::Write | Op::WriteImm | Op::Tagged)
    }

    /// Whether each transfer consumes a receive at the target (send, write_imm).
    fn consumes_recv(self) -> bool {
        matches!(self, Op::Send | Op::WriteImm | Op::Tagged)
    }
}

/// The clock and samples of a ping-pong loop. The clock is read once per iteration as
/// perftest's `_lat` tools do: each sample is the time between two reads, so it covers one
/// whole iteration. Reading the clock once instead of twice per iteration matters where a
/// read is dear: in the soft-RDMA guest every instruction and call costs tens of
/// nanoseconds. The read comes right after an iteration's request left
/// ([`sent`](Self::sent)), where it overlaps the wait for the peer's reply; perftest
/// reads its clock just before the post, and taken there ours (`clock_gettime` through
/// the vDSO, where perftest reads the TSC inline) delayed every request
/// (docs/benchmarks-record.md, forty-sixth session).
pub(crate) struct Laps {
    /// The clock at the start, then after the first request of every iteration but the
    /// first, then at the end (when timed). The differences are taken after the loop:
    /// inside it an iteration costs one clock read and a store, as perftest's one
    /// `get_cycles` per iteration into an array.
    stamps: Vec<std::time::Instant>,
}

impl Laps {
    /// Starts the clock of `n` iterations when `timed` (otherwise it is never read and
    /// nothing is recorded).
    pub(crate) fn start(timed: bool, n: u64) -> Laps {
        let mut stamps = Vec::with_capacity(if timed { n as usize + 1 } else { 0 });
        if timed {
            stamps.push(std::time::Instant::now());
        }
        Laps { stamps }
    }

    /// Iteration `i`'s (first) request left: iteration `i - 1` ends here (when timed).
    #[inline]
    pub(crate) fn sent(&mut self, i: u64) {
        if i > 0 && !self.stamps.is_empty() {
            self.stamps.push(std::time::Instant::now());
        }
    }

    /// The end of iteration `i`: advances the progress bar every 256 iterations (the
    /// loop's end adds `n & 255`).
    #[inline]
    pub(crate) fn done(&self, i: u64, bar: &indicatif::ProgressBar) {
        if i & 255 == 255 {
            bar.inc(256);
        }
    }

    /// Ends the last iteration; seconds per iteration, in order (empty when untimed).
    pub(crate) fn into_samples(mut self) -> Vec<f64> {
        if !self.stamps.is_empty() {
            self.stamps.push(std::time::Instant::now());
        }
        self.stamps
            .windows(2)
            .map(|w| w[1].duration_since(w[0]).as_secs_f64())
            .collect()
    }
}

/// A message size: 1 byte to 1 GiB, binary suffixes ([`crate::units::parse_size`]).
fn parse_size(s: &str) -> Result<u64, String> {
    crate::units::parse_size_in(s, 1, 1 << 30)
}

/// The default number of timed iterations for a test at one size.
fn default_iters(test: Test, size: u64) -> u64 {
    match test {
        // about 64 MiB moved per size, between 100 and 10,000 transfers
        Test::Bw => ((64u64 << 20) / size).clamp(100, 10_000),
        // latency: 5,000 small transfers, fewer above 16 KiB
        Test::Pingpong | Test::Lat => ((80u64 << 20) / size).clamp(100, 5_000),
    }
}

/// One measured size: the row of the report.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    /// The test.
    pub test: Test,
    /// The operation.
    pub op: Op,
    /// Bytes per transfer.
    pub bytes: u64,
    /// Timed iterations.
    pub iters: u64,
    /// Transfers per iteration (2 for send and write ping-pongs, else 1).
    pub xfers_per_iter: u64,
    /// Elapsed seconds of the timed iterations.
    pub secs: f64,
    /// lat only: per-transfer microseconds (min, median, p99, max).
    pub dist: Option<[f64; 4]>,
}

impl Row {
    fn total(&self) -> u64 {
        self.bytes * self.iters * self.xfers_per_iter
    }
    fn xfers(&self) -> f64 {
        (self.iters * self.xfers_per_iter) as f64
    }
    fn mb_per_sec(&self) -> f64 {
        self.total() as f64 / self.secs / 1e6
    }
    fn usec_per_xfer(&self) -> f64 {
        self.secs * 1e6 / self.xfers()
    }
    fn mxfers_per_sec(&self) -> f64 {
        self.xfers() / self.secs / 1e6
    }
    fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "test": self.test.name(),
            "op": self.op.name(),
            "bytes": self.bytes,
            "iters": self.iters,
            "total": self.total(),
            "secs": self.secs,
            "mb_per_sec": self.mb_per_sec(),
            "usec_per_xfer": self.usec_per_xfer(),
            "mxfers_per_sec": self.mxfers_per_sec(),
        });
        if let Some([min, p50, p99, max]) = self.dist {
            let o = v.as_object_mut().expect("object");
            o.insert("usec_min".into(), min.into());
            o.insert("usec_p50".into(), p50.into());
            o.insert("usec_p99".into(), p99.into());
            o.insert("usec_max".into(), max.into());
        }
        v
    }
}

/// One phase the client asks the server to run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Phase {
    /// Bytes per transfer.
    pub size: u64,
    /// Untimed iterations.
    pub warmup: u64,
    /// Timed iterations.
    pub iters: u64,
}

/// The resolved plan of a run.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// The test.
    pub test: Test,
    /// The operation.
    pub op: Op,
    /// One phase per size.
    pub phases: Vec<Phase>,
    /// bw: outstanding requests.
    pub window: u64,
    /// Completion waiting.
    pub mode: Mode,
    /// Sends and writes are transmit complete.
    pub transmit: bool,
    /// The server polls in `mode` whenever it waits (`--server-polls`).
    pub server_polls: bool,
}

impl Plan {
    fn from_args(a: &PerfArgs) -> Result<Plan, String> {
        let sizes: Vec<u64> = match (a.size, a.sizes.is_empty()) {
            (Some(s), _) => vec![s],
            (None, false) => a.sizes.clone(),
            (None, true) if a.op.is_atomic() => vec![8],
            (None, true) => vec![8, 64, 1 << 10, 64 << 10, 1 << 20],
        };
        if a.op.is_atomic() && sizes.iter().any(|&s| s != 8) {
            return Err(format!(
                "--op {} moves one 64-bit word: the size must be 8",
                a.op.name()
            ));
        }
        if a.op == Op::Tagged && a.test == Test::Bw {
            return Err(
                "--op tagged runs the pingpong and lat tests (a ping-pong over rdm \
                 endpoints, as fi_pingpong -e rdm); for bandwidth use --op send or write"
                    .into(),
            );
        }
        if a.op == Op::Tagged && a.server_polls {
            return Err(
                "--server-polls is for the connected-endpoint tests: the tagged ping-pong's \
                 server echoes every message and polls in the client's mode already"
                    .into(),
            );
        }
        let mode = if a.wait {
            Mode::Block
        } else if a.spin {
            Mode::Spin
        } else {
            Mode::Busy
        };
        if mode == Mode::Block && a.op == Op::Write && a.test != Test::Bw {
            return Err("a write ping-pong polls memory for the peer's write (as ib_write_lat does): \
                 it has no completion to wait for, so --wait does not apply; use --op send or the bw test"
                .into());
        }
        let phases = sizes
            .into_iter()
            .map(|size| {
                let iters = a.iters.unwrap_or_else(|| default_iters(a.test, size));
                Phase {
                    size,
                    warmup: a.warmup.unwrap_or((iters / 10).min(1000)),
                    iters,
                }
            })
            .collect();
        Ok(Plan {
            test: a.test,
            op: a.op,
            phases,
            window: a.window,
            mode,
            transmit: a.completion == CompletionLevel::Transmit,
            server_polls: a.server_polls,
        })
    }

    fn max_size(&self) -> u64 {
        self.phases.iter().map(|p| p.size).max().unwrap_or(8)
    }
}

/// `fabric perf`.
pub(crate) fn run(args: PerfArgs) -> Result<ExitCode, String> {
    let plan = Plan::from_args(&args)?;
    match args.role {
        Some(Role::Server) => {
            if args.connect.is_some() {
                return Err("--connect is for --role client; the server takes --listen".into());
            }
            server(&args, &plan)
        }
        Some(Role::Client) => {
            if args.listen.is_some() {
                return Err("--listen is for --role server; the client takes --connect".into());
            }
            let addr = args
                .connect
                .expect("clap requires --connect with --role client");
            let opened = open(&args, plan.op)?;
            client(&args, &plan, opened, addr)
        }
        None => {
            if args.connect.is_some() {
                return Err(
                    "--connect needs --role client (without a role both sides run here)".into(),
                );
            }
            both(&args, &plan)
        }
    }
}

fn open(args: &PerfArgs, op: Op) -> Result<(AnyDomain, fabric::SelectionReport), String> {
    crate::selector(args.provider.as_deref())?
        .require(op.needs())
        .open()
        .map_err(|e| e.to_string())
}

fn server(args: &PerfArgs, plan: &Plan) -> Result<ExitCode, String> {
    let (domain, _) = open(args, args.op)?;
    let listen = args
        .listen
        .unwrap_or_else(|| "127.0.0.1:0".parse().expect("address"));
    if args.op == Op::Tagged {
        tagged::serve(domain, listen)?;
        return Ok(ExitCode::SUCCESS);
    }
    let listener = domain
        .listen(listen)
        .map_err(|e| format!("listen on {listen}: {e}"))?;
    // The one line the server prints: `fabric perf` without a role reads it.
    println!("listening on {}", listener.local_addr());
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // Its queues sized to its own test (a client that asks for more receives is told
    // fewer: `run::serve`).
    let queues = run::Queues::for_test(
        plan.test,
        plan.window,
        true,
        plan.max_size(),
        &domain.info().caps.limits,
    );
    run::serve(&domain, &listener, queues)?;
    Ok(ExitCode::SUCCESS)
}

/// Both sides: this process is the client; the server is this executable again.
fn both(args: &PerfArgs, plan: &Plan) -> Result<ExitCode, String> {
    // Selection errors are reported once, here, before a server is started.
    let opened = open(args, plan.op)?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own executable: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .args(["--role", "server"]);
    if args.listen.is_none() {
        cmd.args(["--listen", "127.0.0.1:0"]);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start the server process: {e}"))?;
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| format!("reading the server's address: {e}"))?;
    let addr = match line.trim().strip_prefix("listening on ") {
        Some(a) => a
            .parse::<SocketAddr>()
            .map_err(|e| format!("server printed {line:?}: {e}"))?,
        None => {
            let status = child.wait().map_err(|e| e.to_string())?;
            return Err(format!("the server process did not start ({status})"));
        }
    };
    let result = client(args, plan, opened, addr);
    if result.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let code = result?;
    if !status.success() {
        return Err(format!("the server process failed ({status})"));
    }
    Ok(code)
}

fn client(
    args: &PerfArgs,
    plan: &Plan,
    (domain, report): (AnyDomain, fabric::SelectionReport),
    addr: SocketAddr,
) -> Result<ExitCode, String> {
    let total: u64 = plan.phases.iter().map(|p| p.warmup + p.iters).sum();
    let bar = if std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} [{bar:30}] {pos}/{len} iterations {msg}",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        b.set_prefix(format!("perf {} {}", plan.test.name(), plan.op.name()));
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let rows = if plan.op == Op::Tagged {
        tagged::client(&std::sync::Arc::new(domain), addr, plan, &bar)?
    } else {
        run::client(&domain, addr, plan, &bar)?
    };
    bar.finish_and_clear();
    match args.format {
        Format::Json => {
            let v = serde_json::json!({
                "provider": report.provider,
                "device": report.device,
                "completions": plan.mode.name(),
                "completion_level": if plan.transmit { "transmit" } else { "delivery" },
                "server": if plan.server_polls { "polls" } else { "waits" },
                "rows": rows.iter().map(Row::to_json).collect::<Vec<_>>(),
            });
            println!("{v}");
        }
        Format::Text => print_text(&report, plan, &rows),
    }
    Ok(ExitCode::SUCCESS)
}

fn print_text(report: &fabric::SelectionReport, plan: &Plan, rows: &[Row]) {
    println!(
        "# fabric perf {} --op {}: provider {} (device {}); completions: {}; {}; {}",
        plan.test.name(),
        plan.op.name(),
        report.provider,
        report.device,
        plan.mode.describe(),
        if plan.transmit {
            "sends and writes transmit complete"
        } else {
            "sends and writes delivery complete"
        },
        if plan.server_polls {
            "the server polls the same way while it waits"
        } else {
            "the server blocks while it waits"
        }
    );
    let what = match (plan.test, plan.op.one_way()) {
        (Test::Bw, _) => format!(
            "up to {} outstanding (reads and atomics: at most the provider's ORD), one in four signaled; time from first post to last completion",
            plan.window
        ),
        (_, true) => "usec/xfer is one-way: half a round trip (2 transfers per iteration)".into(),
        (_, false) => "one transfer is a round trip (request and response): usec/xfer is the whole operation".into(),
    };
    println!("# MB = 10^6 bytes; {what}");
    let lat = plan.test == Test::Lat;
    print!(
        "{:>10} {:>9} {:>12} {:>9} {:>10} {:>10} {:>11}",
        "bytes", "iters", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec"
    );
    if lat {
        print!(" {:>9} {:>9} {:>9} {:>9}", "min", "p50", "p99", "max");
    }
    println!();
    for r in rows {
        print!(
            "{:>10} {:>9} {:>12} {:>8.3}s {:>10.2} {:>10.2} {:>11.4}",
            r.bytes,
            r.iters,
            r.total(),
            r.secs,
            r.mb_per_sec(),
            r.usec_per_xfer(),
            r.mxfers_per_sec()
        );
        if let Some(d) = r.dist {
            print!(" {:>9.2} {:>9.2} {:>9.2} {:>9.2}", d[0], d[1], d[2], d[3]);
        }
        println!();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_read_the_clock_once_per_iteration_and_count_the_gaps() {
        let bar = indicatif::ProgressBar::hidden();
        let mut untimed = Laps::start(false, 3);
        for i in 0..3 {
            untimed.sent(i);
            untimed.done(i, &bar);
        }
        assert!(
            untimed.into_samples().is_empty(),
            "untimed: nothing recorded"
        );
        // As perftest's samples: each runs from one read to the next, here from one
        // iteration's request to the next's, so time spent between two posts (here a
        // pause in iteration 1, after its post) belongs to that iteration's sample, and
        // the last ends when the loop does.
        let pause = std::time::Duration::from_millis(20);
        let begun = std::time::Instant::now();
        let mut laps = Laps::start(true, 3);
        for i in 0..3 {
            laps.sent(i);
            if i == 1 {
                std::thread::sleep(pause);
            }
            laps.done(i, &bar);
        }
        std::thread::sleep(pause);
        let s = laps.into_samples();
        let total = begun.elapsed().as_secs_f64();
        assert_eq!(s.len(), 3);
        assert!(
            s[1] >= pause.as_secs_f64() && s[0] < pause.as_secs_f64(),
            "{s:?}: the first pause is in the second lap"
        );
        assert!(
            s[2] >= pause.as_secs_f64(),
            "{s:?}: the second pause, after the loop's last post, is in the last lap"
        );
        let sum: f64 = s.iter().sum();
        assert!(
            sum <= total,
            "{s:?}: consecutive laps, summing to at most {total}"
        );
    }

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("2G").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn pingpong_counts_two_transfers_per_iteration() {
        let r = Row {
            test: Test::Pingpong,
            op: Op::Send,
            bytes: 8,
            iters: 1000,
            xfers_per_iter: 2,
            secs: 0.02,
            dist: None,
        };
        assert_eq!(r.total(), 16_000);
        assert!((r.usec_per_xfer() - 10.0).abs() < 1e-9);
        assert!((r.mb_per_sec() - 0.8).abs() < 1e-9);
        assert!((r.mxfers_per_sec() - 0.1).abs() < 1e-9);
    }
}
