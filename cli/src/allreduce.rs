//! `fabric allreduce | allgather | broadcast`: collectives over `fabric-rdm`, measured as
//! nccl-tests prints them; and `fabric rdm-peer`, the peer process of the `rdm.*` / `tag.*`
//! conformance cases.
//!
//! `--np N` starts N ranks of this same binary on this machine and serves their rendezvous;
//! under a launcher (Open MPI's `mpirun`, Slurm's `srun`) each process takes its rank and
//! size from the launcher's environment and rank 0 serves the rendezvous at
//! `FABRIC_RDV_ADDR` (see `fabric_collectives::bootstrap`). No MPI library is linked.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fabric::prelude::*;
use fabric_collectives::{bootstrap, Comm, CommConfig, DataType, ReduceOp};
use fabric_rdm::{RdmConfig, RdmEndpoint, RecvBuf, Source};

/// Which collective a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coll {
    /// Allreduce (busbw = algbw x 2(n-1)/n).
    Allreduce,
    /// Allgather (size is the gathered total; busbw = algbw x (n-1)/n).
    Allgather,
    /// Broadcast (busbw = algbw).
    Broadcast,
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::Allreduce => "allreduce",
            Coll::Allgather => "allgather",
            Coll::Broadcast => "broadcast",
        }
    }

    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::Allreduce => 2.0 * (n - 1.0) / n,
            Coll::Allgather => (n - 1.0) / n,
            Coll::Broadcast => 1.0,
        }
    }
}

/// Output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OutFormat {
    /// nccl-tests' table.
    Text,
    /// `{"np", "provider", "rows": [...]}`.
    Json,
}

/// Arguments of `fabric allreduce`, `allgather` and `broadcast`.
#[derive(Debug, Clone, Args)]
pub struct CollArgs {
    /// Ranks to start on this machine (ignored under a launcher, whose environment names
    /// rank and size).
    #[arg(long, default_value_t = 1)]
    np: usize,
    /// Provider (else FABRIC_PROVIDER / FABRIC_CONFIG / the best available).
    #[arg(long)]
    provider: Option<String>,
    /// Sizes in bytes, comma separated (K, M, G: powers of 1024).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["min_bytes", "max_bytes"])]
    sizes: Option<Vec<String>>,
    /// Smallest size of a doubling sweep.
    #[arg(long)]
    min_bytes: Option<String>,
    /// Largest size of a doubling sweep.
    #[arg(long)]
    max_bytes: Option<String>,
    /// Element type: u8, i32, u32, i64, u64, f32, f64.
    #[arg(long = "type", default_value = "f32")]
    dtype: String,
    /// Reduction: sum, min, max (allreduce).
    #[arg(long, default_value = "sum")]
    op: String,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Broadcast root.
    #[arg(long, default_value_t = 0)]
    root: usize,
    /// Address the ranks' endpoints listen on (an address the other hosts reach when
    /// ranks run on several hosts).
    #[arg(long, default_value = "127.0.0.1")]
    bind: IpAddr,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutFormat::Text)]
    format: OutFormat,
    /// Largest message sent eagerly (RdmConfig::eager_max; K: powers of 1024); larger ones
    /// use the rendezvous protocol.
    #[arg(long)]
    eager_max: Option<String>,
    /// Microseconds a rank polls before it sleeps while waiting (RdmConfig::busy_poll).
    #[arg(long, default_value_t = 100)]
    busy_poll_us: u64,
    /// Microseconds a rank inside a collective polls without sleeping, yielding the core
    /// between polls (CommConfig::spin; default: the communicator's).
    #[arg(long)]
    spin_us: Option<u64>,
    /// Large allreduce: `write` (segments RDMA-written into the next rank's buffer, where
    /// the provider has RDMA Write) or `tagged` (the ring of tagged messages).
    #[arg(long, value_enum, default_value_t = Ring::Write)]
    ring: Ring,
    /// Allreduce buffers: `registered` (one region per size, registered once with remote
    /// write access and reduced in place by `Comm::allreduce_region_bytes`, as nccl-tests
    /// runs in place on device buffers: no copy in or out on the write ring; the input is
    /// written once before the warm-up and again before the checked call) or `slice`
    /// (`Comm::allreduce_bytes` on a fresh copy of the input in every call).
    #[arg(long, value_enum, default_value_t = BufferKind::Registered)]
    buffer: BufferKind,
    /// Segment of the write ring, in bytes (K, M: powers of 1024).
    #[arg(long)]
    write_segment: Option<String>,
    /// Transfers up to this size go as eager pieces, all in flight, not one rendezvous
    /// message (CommConfig::eager_pieces_max; K: powers of 1024; 0: never).
    #[arg(long)]
    eager_pieces_max: Option<String>,
    /// Largest allreduce payload that uses recursive doubling instead of the ring
    /// (CommConfig::small_max; K, M: powers of 1024).
    #[arg(long)]
    small_max: Option<String>,
    /// Largest allreduce payload that takes recursive halving and doubling instead of the
    /// write ring on a power-of-two group (CommConfig::halving_max; K, M: powers of 1024;
    /// 0: never).
    #[arg(long)]
    halving_max: Option<String>,
}

/// The large allreduce's ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Ring {
    /// RDMA Write into the next rank's buffer, then a tagged notification.
    Write,
    /// Tagged messages (rendezvous above the eager threshold).
    Tagged,
}

/// Where `fabric allreduce` keeps its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BufferKind {
    /// A registered region, reduced in place.
    Registered,
    /// A plain vector (the communicator copies it through its own registered buffers).
    Slice,
}

impl BufferKind {
    fn name(self) -> &'static str {
        match self {
            BufferKind::Registered => "registered",
            BufferKind::Slice => "slice",
        }
    }
}

fn parse_size(s: &str) -> Result<usize, String> {
    let v = crate::units::parse_size(s)?;
    usize::try_from(v).map_err(|_| format!("{s:?} is too large"))
}

fn sizes(a: &CollArgs) -> Result<Vec<usize>, String> {
    if let Some(list) = &a.sizes {
        return list.iter().map(|s| parse_size(s)).collect();
    }
    let min = parse_size(a.min_bytes.as_deref().unwrap_or("8"))?;
    let max = parse_size(a.max_bytes.as_deref().unwrap_or("64M"))?;
    if min == 0 || min > max {
        return Err(format!(
            "--min-bytes {min} must be in 1..=--max-bytes {max}"
        ));
    }
    let mut v = Vec::new();
    let mut s = min;
    while s <= max {
        v.push(s);
        s = match s.checked_mul(2) {
            Some(x) => x,
            None => break,
        };
    }
    Ok(v)
}

/// Runs `fabric allreduce | allgather | broadcast`.
pub fn run(coll: Coll, a: CollArgs) -> Result<ExitCode, String> {
    let dtype: DataType = a.dtype.parse().map_err(|e: fabric::Error| e.to_string())?;
    let op: ReduceOp = a.op.parse().map_err(|e: fabric::Error| e.to_string())?;
    let sizes = sizes(&a)?;
    if a.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    match bootstrap::rank_size_from_env().map_err(|e| e.to_string())? {
        Some((rank, size)) => rank_main(coll, &a, dtype, op, &sizes, rank, size),
        None => launch(a.np),
    }
}

/// Starts `np` ranks of this binary with the same arguments and serves their rendezvous.
fn launch(np: usize) -> Result<ExitCode, String> {
    if np == 0 {
        return Err("--np must be at least 1".into());
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let rdv = listener.local_addr().map_err(|e| e.to_string())?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children = Vec::new();
    for rank in 0..np {
        let child = Command::new(&exe)
            .args(&args)
            .env("FABRIC_RANK", rank.to_string())
            .env("FABRIC_SIZE", np.to_string())
            .env("FABRIC_RDV_ADDR", rdv.to_string())
            .env("FABRIC_RDV_HOSTED", "1")
            .stdout(if rank == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting rank {rank}: {e}"))?;
        children.push(child);
    }
    let served = bootstrap::serve(&listener, np, Duration::from_secs(60));
    let mut code = 0u8;
    if let Err(e) = served {
        eprintln!("fabric: rendezvous: {e}");
        for c in &mut children {
            let _ = c.kill();
        }
        code = 2;
    }
    for (rank, mut c) in children.into_iter().enumerate() {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("fabric: rank {rank} exited with {s}");
                code = code.max(s.code().unwrap_or(2).clamp(1, 255) as u8);
            }
            Err(e) => {
                eprintln!("fabric: rank {rank}: {e}");
                code = 2;
            }
        }
    }
    Ok(ExitCode::from(code))
}

/// The value rank `r` contributes at element `i`: small integers, so that sums are exact
/// in every type (u8 included, up to 36 ranks).
fn value(r: usize, i: usize) -> u8 {
    ((r + i) % 7 + 1) as u8
}

fn encode(dtype: DataType, vals: impl Iterator<Item = u8>) -> Vec<u8> {
    let mut out = Vec::new();
    for v in vals {
        match dtype {
            DataType::U8 => out.push(v),
            DataType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
            DataType::U32 => out.extend_from_slice(&(v as u32).to_le_bytes()),
            DataType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
            DataType::U64 => out.extend_from_slice(&(v as u64).to_le_bytes()),
            DataType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DataType::F64 => out.extend_from_slice(&(v as f64).to_le_bytes()),
        }
    }
    out
}

fn reduce_expected(op: ReduceOp, n: usize, i: usize) -> u8 {
    let vals = (0..n).map(|r| value(r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Min => vals.min().unwrap_or(0),
        ReduceOp::Max => vals.max().unwrap_or(0),
    }
}

/// Elements of `got` that differ from `want` (both encoded).
fn wrong(dtype: DataType, got: &[u8], want: &[u8]) -> u64 {
    got.chunks(dtype.size())
        .zip(want.chunks(dtype.size()))
        .filter(|(a, b)| a != b)
        .count() as u64
}

struct Row {
    bytes: usize,
    count: usize,
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: u64,
}

#[allow(clippy::too_many_arguments)]
fn rank_main(
    coll: Coll,
    a: &CollArgs,
    dtype: DataType,
    op: ReduceOp,
    sizes: &[usize],
    rank: usize,
    n: usize,
) -> Result<ExitCode, String> {
    let e = |e: fabric::Error| e.to_string();
    let (domain, _) = crate::selector(a.provider.as_deref())?.open().map_err(e)?;
    let provider = domain.info().name.clone();
    let domain = Arc::new(domain);
    let ep = RdmEndpoint::new(
        domain.clone(),
        RdmConfig {
            bind: SocketAddr::new(a.bind, 0),
            busy_poll: Duration::from_micros(a.busy_poll_us),
            eager_max: match &a.eager_max {
                Some(s) => parse_size(s)?,
                None => RdmConfig::default().eager_max,
            },
            ..RdmConfig::default()
        },
    )
    .map_err(e)?;
    let hosted = std::env::var("FABRIC_RDV_HOSTED").is_ok_and(|v| v == "1");
    let rdv = bootstrap::rdv_addr_from_env().map_err(e)?;
    let names = bootstrap::exchange_or_serve(
        rdv,
        rank,
        n,
        &ep.name(),
        rank == 0 && !hosted,
        Duration::from_secs(60),
    )
    .map_err(e)?;
    let mut cfg = CommConfig {
        write_ring: a.ring == Ring::Write,
        ..CommConfig::default()
    };
    if let Some(us) = a.spin_us {
        cfg.spin = Duration::from_micros(us);
    }
    if let Some(s) = &a.write_segment {
        cfg.write_segment = parse_size(s)?;
    }
    if let Some(s) = &a.eager_pieces_max {
        cfg.eager_pieces_max = parse_size(s)?;
    }
    if let Some(s) = &a.small_max {
        cfg.small_max = parse_size(s)?;
    }
    if let Some(s) = &a.halving_max {
        cfg.halving_max = parse_size(s)?;
    }
    let mut comm = Comm::new(domain.clone(), ep, rank, &names, cfg).map_err(e)?;
    if coll == Coll::Broadcast && a.root >= n {
        return Err(format!("--root {} of {n} ranks", a.root));
    }
    let ts = dtype.size();
    let mut rows = Vec::new();
    for &size in sizes {
        // Whole elements (and, for allgather, a whole number of them per rank), at least one.
        let unit = if coll == Coll::Allgather { ts * n } else { ts };
        let bytes = (size / unit * unit).max(unit);
        let count = bytes / ts;
        let per_rank = if coll == Coll::Allgather {
            count / n
        } else {
            count
        };
        let input = encode(dtype, (0..per_rank).map(|i| value(rank, i)));
        // Registered once per size, outside the timing.
        let region = if coll == Coll::Allreduce && a.buffer == BufferKind::Registered {
            let r = domain
                .alloc(bytes, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .map_err(e)?;
            r.buffer().write(0, &input);
            Some(r)
        } else {
            None
        };
        // One call; `check`: from the input, returning the result (the registered region is
        // reduced in place, so timed calls run on what the previous call left).
        let once = |comm: &mut Comm, check: bool| -> Result<Vec<u8>, String> {
            match coll {
                Coll::Allreduce => match &region {
                    Some(r) => {
                        if check {
                            r.buffer().write(0, &input);
                        }
                        let s = r.slice(..bytes).map_err(e)?;
                        comm.allreduce_region_bytes(s, dtype, op).map_err(e)?;
                        Ok(if check {
                            r.buffer().to_vec(0, bytes)
                        } else {
                            Vec::new()
                        })
                    }
                    None => {
                        let mut w = input.clone();
                        comm.allreduce_bytes(&mut w, dtype, op).map_err(e)?;
                        Ok(w)
                    }
                },
                Coll::Allgather => comm.allgather_bytes(&input).map_err(e),
                Coll::Broadcast => {
                    let mut w = if rank == a.root {
                        input.clone()
                    } else {
                        vec![0u8; input.len()]
                    };
                    comm.broadcast_bytes(&mut w, a.root).map_err(e)?;
                    Ok(w)
                }
            }
        };
        for _ in 0..a.warmup {
            once(&mut comm, false)?;
        }
        comm.barrier().map_err(e)?;
        let start = Instant::now();
        for _ in 0..a.iters {
            once(&mut comm, false)?;
        }
        let mine = start.elapsed().as_secs_f64() / a.iters as f64;
        let got = once(&mut comm, true)?;
        let want = match coll {
            Coll::Allreduce => encode(dtype, (0..count).map(|i| reduce_expected(op, n, i))),
            Coll::Allgather => encode(
                dtype,
                (0..n).flat_map(|r| (0..per_rank).map(move |i| value(r, i))),
            ),
            Coll::Broadcast => encode(dtype, (0..count).map(|i| value(a.root, i))),
        };
        let mut t = [mine];
        comm.allreduce(&mut t, ReduceOp::Max).map_err(e)?;
        let mut w = [wrong(dtype, &got, &want)];
        comm.allreduce(&mut w, ReduceOp::Sum).map_err(e)?;
        let secs = t[0];
        let algbw = bytes as f64 / secs / 1e9;
        rows.push(Row {
            bytes,
            count,
            time_us: secs * 1e6,
            algbw,
            busbw: algbw * coll.bus_factor(n),
            wrong: w[0],
        });
    }
    comm.barrier().map_err(e)?;
    let any_wrong = rows.iter().any(|r| r.wrong > 0);
    let buffer = if coll == Coll::Allreduce {
        a.buffer.name()
    } else {
        "slice"
    };
    if rank == 0 {
        let opname = if coll == Coll::Allreduce {
            op.name()
        } else {
            "none"
        };
        match a.format {
            OutFormat::Json => {
                let rows: Vec<_> = rows
                    .iter()
                    .map(|r| {
                        serde_json::json!({
                            "bytes": r.bytes, "count": r.count, "type": dtype.name(),
                            "op": opname, "time_us": r.time_us, "algbw": r.algbw,
                            "busbw": r.busbw, "wrong": r.wrong,
                        })
                    })
                    .collect();
                println!(
                    "{}",
                    serde_json::json!({
                        "np": n, "provider": provider, "buffer": buffer, "rows": rows
                    })
                );
            }
            OutFormat::Text => {
                println!(
                    "# fabric {}: np {n}, provider {provider}, iters {}, warmup {}{}",
                    coll.name(),
                    a.iters,
                    a.warmup,
                    match coll {
                        Coll::Broadcast => format!(", root {}", a.root),
                        Coll::Allreduce => format!(", buffer {buffer}"),
                        Coll::Allgather => String::new(),
                    }
                );
                println!("# GB = 10^9 bytes; time is the slowest rank's mean per iteration");
                println!("#");
                println!(
                    "# {:>10}  {:>12}  {:>8}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}",
                    "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"
                );
                println!(
                    "# {:>10}  {:>12}  {:>8}  {:>6}  {:>9}  {:>7}  {:>7}  {:>6}",
                    "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", ""
                );
                for r in &rows {
                    println!(
                        "  {:>10}  {:>12}  {:>8}  {:>6}  {:>9.2}  {:>7.3}  {:>7.3}  {:>6}",
                        r.bytes,
                        r.count,
                        dtype.name(),
                        opname,
                        r.time_us,
                        r.algbw,
                        r.busbw,
                        r.wrong
                    );
                }
                let avg = rows.iter().map(|r| r.busbw).sum::<f64>() / rows.len().max(1) as f64;
                println!(
                    "# Out of bounds values : {} {}",
                    rows.iter().map(|r| r.wrong).sum::<u64>(),
                    if any_wrong { "FAILED" } else { "OK" }
                );
                println!("# Avg bus bandwidth    : {avg:.4}");
            }
        }
    }
    Ok(if any_wrong {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

/// `fabric rdm-peer --provider P [--bind IP] --mode echo|send [--count N] [--size S]
/// [--tag T]`: prints `NAME <hex>`, reads `PEER <hex>` (the case's endpoint name) from
/// stdin, then
/// * `echo`: answers every tagged message with the same bytes and tag, to its source;
/// * `send`: sends `count` tagged messages of `size` bytes (the first 8 bytes hold the
///   message's number), prints `SENT <count>` once all completed;
///
/// and exits when stdin closes. Returns the exit code.
pub fn rdm_peer(args: &[String]) -> i32 {
    match serve(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("fabric rdm-peer: {e}");
            1
        }
    }
}

fn serve(args: &[String]) -> Result<(), String> {
    let provider = arg(args, "--provider").ok_or("--provider is required")?;
    let bind: IpAddr = arg(args, "--bind")
        .unwrap_or("127.0.0.1")
        .parse()
        .map_err(|e| format!("--bind: {e}"))?;
    let mode = arg(args, "--mode").unwrap_or("echo");
    let num = |name: &str, default: usize| -> Result<usize, String> {
        arg(args, name)
            .map_or(Ok(default), str::parse)
            .map_err(|e| format!("{name}: {e}"))
    };
    let (count, size, tag) = (
        num("--count", 100)?,
        num("--size", 64)?,
        num("--tag", 0)? as u64,
    );
    if !matches!(mode, "echo" | "send") {
        return Err(format!("unknown --mode {mode:?} (echo, send)"));
    }
    let (domain, _) = fabric::Selector::from_env()
        .and_then(|s| s.providers(provider))
        .and_then(|s| s.open())
        .map_err(|e| e.to_string())?;
    let domain = Arc::new(domain);
    let ep = RdmEndpoint::new(
        domain.clone(),
        RdmConfig {
            bind: SocketAddr::new(bind, 0),
            ..RdmConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    println!("NAME {}", hex(&ep.name()));
    let mut line = String::new();
    // Not locked for longer: the thread below reads the rest.
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let name = line
        .trim()
        .strip_prefix("PEER ")
        .and_then(unhex)
        .ok_or_else(|| format!("expected PEER <hex>, got {line:?}"))?;
    let peer = ep.av_insert_name(&name).map_err(|e| e.to_string())?;
    let closed = Arc::new(AtomicBool::new(false));
    {
        let closed = closed.clone();
        std::thread::spawn(move || {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
            fabric::sync::atomic_only(&*closed); // publishes nothing but itself
            closed.store(true, Ordering::Release);
        });
    }
    let e = |e: fabric::Error| e.to_string();
    match mode {
        "send" => {
            let src = domain
                .alloc(
                    (size.max(8)) * count,
                    Access::LOCAL_WRITE | Access::REMOTE_READ,
                )
                .map_err(e)?;
            for i in 0..count {
                src.buffer().fill(i * size.max(8), size.max(8), i as u8);
                src.buffer()
                    .write(i * size.max(8), &(i as u64).to_le_bytes());
                let s = src
                    .slice(i * size.max(8)..i * size.max(8) + size)
                    .map_err(e)?;
                ep.tsend(peer, tag, s, i as u64).map_err(e)?;
            }
            let mut done = 0;
            while done < count {
                let c = ep.next_completion(Duration::from_secs(120)).map_err(e)?;
                if !c.is_ok() {
                    return Err(format!("send completed {c:?}"));
                }
                done += 1;
            }
            println!("SENT {count}");
            while !closed.load(Ordering::Acquire) {
                ep.wait(Duration::from_millis(50)).map_err(e)?;
            }
        }
        _ => {
            let rbuf = Arc::new(domain.alloc(1 << 20, Access::LOCAL_WRITE).map_err(e)?);
            let sbuf = domain.alloc(1 << 20, Access::LOCAL_WRITE).map_err(e)?;
            ep.trecv(Source::Any, 0, u64::MAX, RecvBuf::whole(rbuf.clone()), 0)
                .map_err(e)?;
            while !closed.load(Ordering::Acquire) {
                if !ep.wait(Duration::from_millis(50)).map_err(e)? {
                    continue;
                }
                let mut out = Vec::new();
                ep.poll(&mut out).map_err(e)?;
                for c in out {
                    if c.context == 0 {
                        let n = c.len as usize;
                        sbuf.buffer().write(0, &rbuf.buffer().to_vec(0, n));
                        if let Some(from) = c.peer.filter(|_| c.is_ok()) {
                            ep.tsend(from, c.tag, sbuf.slice(0..n).map_err(e)?, 1)
                                .map_err(e)?;
                            // The reply is copied or read before its completion.
                            loop {
                                let r = ep.next_completion(Duration::from_secs(30)).map_err(e)?;
                                if r.context == 1 {
                                    break;
                                }
                            }
                        }
                        ep.trecv(Source::Any, 0, u64::MAX, RecvBuf::whole(rbuf.clone()), 0)
                            .map_err(e)?;
                    }
                }
            }
        }
    }
    Ok(())
}
