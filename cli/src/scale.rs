//! `fabric scale`: many connected endpoints in one process.
//!
//! ```text
//! fabric scale [--pairs 1,16,128,512,1024] [--messages N] [--window W] [--provider P]
//!              [--listen ADDR] [--format text|json]
//! ```
//!
//! For each N, one process opens two domains (a client side and a server side, as two
//! processes would), connects N endpoint pairs through one listener, and reports:
//!
//! * **threads**: the process's threads once the N pairs are connected (`/proc/self/task`),
//!   and how many of them the pairs added: a provider with no thread per connection adds
//!   the same few whatever N is;
//! * **KiB/ep**: resident memory added per endpoint by connecting (RSS from
//!   `/proc/self/statm`, before the message buffers are registered);
//! * **connect**: wall time to connect and accept the N pairs, one after the other, and per
//!   pair;
//! * **Kmsg/s**: the aggregate rate of 8-byte messages, every client sending to its server
//!   endpoint with up to `--window` sends outstanding (refilled in one burst, posted with
//!   `SendWr::more`, whenever half the window completed), the server reposting each receive; one
//!   application thread busy-polls the two completion queues. K = 10^3.
//!
//! Each pair needs two sockets or queue pairs: raise the open-file limit (`ulimit -n`) for
//! large N; the command says so before it starts rather than failing half-way.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fabric::prelude::*;

/// Arguments of `fabric scale`.
#[derive(Debug, Clone, Args)]
pub(crate) struct ScaleArgs {
    /// Numbers of connected pairs to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 128, 512, 1024],
          value_parser = clap::value_parser!(usize))]
    pairs: Vec<usize>,
    /// Messages per measurement, spread evenly over the pairs (at least 64 per pair).
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    messages: u64,
    /// Sends each client keeps outstanding (and receives each server endpoint keeps posted).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    window: u32,
    /// Provider spec (overrides FABRIC_PROVIDER), e.g. `tcp`.
    #[arg(long)]
    provider: Option<String>,
    /// Address the server side listens on [default: 127.0.0.1:0; a verbs provider needs its
    /// device's address].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Json,
}

/// One measurement.
#[derive(Debug)]
struct Row {
    pairs: usize,
    threads: usize,
    threads_added: usize,
    kib_per_endpoint: f64,
    connect: Duration,
    messages: u64,
    secs: f64,
}

impl Row {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.secs
    }
}

/// Runs `fabric scale`.
pub(crate) fn run(args: ScaleArgs) -> Result<ExitCode, String> {
    if args.pairs.is_empty() || args.pairs.contains(&0) {
        return Err("--pairs: give one or more counts of at least 1".into());
    }
    let most = *args.pairs.iter().max().expect("not empty");
    // Two descriptors per pair (tcp: two sockets; verbs: queue pairs and rdma_cm ids), and
    // some for the rest of the process.
    let need = 2 * most as u64 + 64;
    if let Some(limit) = open_file_limit() {
        if limit < need {
            return Err(format!(
                "{most} pairs need about {need} open files, and the limit is {limit}: raise it \
                 first (ulimit -n {})",
                need.next_power_of_two()
            ));
        }
    }
    let selector = crate::selector(args.provider.as_deref())?;
    let mut rows = Vec::new();
    let mut provider = String::new();
    for &n in &args.pairs {
        let (row, name) = measure(&selector, &args, n)?;
        provider = name;
        if args.format == Format::Text {
            if rows.is_empty() {
                println!("# fabric scale, provider {provider}: N connected pairs in one process; 8 B messages, window {}, one thread busy-polling; K = 10^3", args.window);
                println!(
                    "{:>7} {:>9} {:>8} {:>8} {:>10} {:>13} {:>12} {:>10} {:>9} {:>10}",
                    "pairs",
                    "endpoints",
                    "threads",
                    "added",
                    "KiB/ep",
                    "connect(ms)",
                    "ms/pair",
                    "msgs",
                    "time",
                    "Kmsg/s"
                );
            }
            println!(
                "{:>7} {:>9} {:>8} {:>8} {:>10.1} {:>13.1} {:>12.3} {:>10} {:>8.3}s {:>10.1}",
                row.pairs,
                2 * row.pairs,
                row.threads,
                row.threads_added,
                row.kib_per_endpoint,
                row.connect.as_secs_f64() * 1e3,
                row.connect.as_secs_f64() * 1e3 / row.pairs as f64,
                row.messages,
                row.secs,
                row.rate() / 1e3
            );
        }
        rows.push(row);
    }
    if args.format == Format::Json {
        let rows: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "pairs": r.pairs,
                    "endpoints": 2 * r.pairs,
                    "threads": r.threads,
                    "threads_added": r.threads_added,
                    "kib_per_endpoint": r.kib_per_endpoint,
                    "connect_ms": r.connect.as_secs_f64() * 1e3,
                    "messages": r.messages,
                    "secs": r.secs,
                    "msg_per_sec": r.rate(),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({"provider": provider, "window": args.window, "rows": rows})
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn measure(
    selector: &fabric::Selector,
    args: &ScaleArgs,
    n: usize,
) -> Result<(Row, String), String> {
    let e = |what: &'static str| move |err: fabric::Error| format!("{n} pairs: {what}: {err}");
    let threads_before = threads();
    let (client, report) = selector.open().map_err(e("open the client domain"))?;
    let (server, _) = selector.open().map_err(e("open the server domain"))?;
    let w = args.window as usize;
    let cap = (n * w + 16).max(64);
    let ccq = client.create_cq(cap).map_err(e("create_cq"))?;
    let scq = server.create_cq(cap).map_err(e("create_cq"))?;
    let listen = args
        .listen
        .unwrap_or_else(|| "127.0.0.1:0".parse().expect("address"));
    let listener = server.listen(listen).map_err(e("listen"))?;
    let addr = listener.local_addr();
    let rss_before = rss_bytes();
    let started = Instant::now();
    let mut pairs = Vec::with_capacity(n);
    for i in 0..n {
        let mut ccfg = EndpointConfig::new(&ccq);
        ccfg.sq_depth = args.window;
        ccfg.rq_depth = 1;
        let mut scfg = EndpointConfig::new(&scq);
        scfg.sq_depth = 1;
        scfg.rq_depth = args.window;
        let (c, s) = std::thread::scope(|t| {
            let h = t.spawn(|| client.connect(addr, &ccfg));
            let s = listener.accept(&scfg, Duration::from_secs(30));
            (h.join().expect("connect thread"), s)
        });
        let c = c.map_err(|err| format!("pair {i} of {n}: connect: {err}"))?;
        let s = s.map_err(|err| format!("pair {i} of {n}: accept: {err}"))?;
        pairs.push((c, s));
    }
    let connect = started.elapsed();
    let kib_per_endpoint = rss_bytes().saturating_sub(rss_before) as f64 / 1024.0 / (2 * n) as f64;
    let threads_now = threads();

    // One source region for every send, one receive slot of 8 bytes per posted receive.
    let src = client
        .register(std::sync::Arc::new(Buffer::new(8)), Access::empty())
        .map_err(e("register"))?;
    let dst = server
        .register(
            std::sync::Arc::new(Buffer::new(8 * n * w)),
            Access::LOCAL_WRITE,
        )
        .map_err(e("register"))?;
    let slot = |pair: usize, k: usize| dst.slice((pair * w + k) * 8..(pair * w + k + 1) * 8);
    for (p, (_, s)) in pairs.iter().enumerate() {
        for k in 0..w {
            let sge = slot(p, k).map_err(e("slice"))?;
            s.post_recv(&RecvWr::new((p * w + k) as u64, &[sge]))
                .map_err(e("post_recv"))?;
        }
    }
    let per_pair = (args.messages / n as u64).max(64);
    let total = per_pair * n as u64;
    let mut sent = vec![0u64; n];
    let mut outstanding = vec![0usize; n];
    let mut received = 0u64;
    let mut out = Vec::with_capacity(256);
    let mut touched = Vec::with_capacity(256);
    let t = Instant::now();
    let mut last_progress = Instant::now();
    // Fill every window; refill it in one burst each time it has drained to half (as
    // osu_mbw_mr and ib_send_bw post a window at a time), until each pair sent its share.
    let refill_at = w / 2;
    let post = |p: usize, sent: &mut [u64], outstanding: &mut [usize]| -> Result<(), String> {
        while outstanding[p] < w && sent[p] < per_pair {
            // All but the last of a burst with MORE: the provider may send them together.
            let sge = [src.all()];
            let wr = SendWr::send(p as u64, &sge);
            let last = outstanding[p] + 1 == w || sent[p] + 1 == per_pair;
            pairs[p]
                .0
                .post_send(&if last { wr } else { wr.more() })
                .map_err(|err| format!("{n} pairs: post_send: {err}"))?;
            outstanding[p] += 1;
            sent[p] += 1;
        }
        Ok(())
    };
    for p in 0..n {
        post(p, &mut sent, &mut outstanding)?;
    }
    while received < total {
        let mut got = 0;
        out.clear();
        got += ccq.poll(&mut out, 256).map_err(e("poll"))?;
        // Reap first, then refill each pair whose window drained to half, in one burst.
        touched.clear();
        for c in out.drain(..) {
            if c.status != Status::Success {
                return Err(format!("{n} pairs: send completed {c:?}"));
            }
            let p = c.context as usize;
            outstanding[p] -= 1;
            if outstanding[p] == refill_at {
                touched.push(p);
            }
        }
        for &p in &touched {
            post(p, &mut sent, &mut outstanding)?;
        }
        got += scq.poll(&mut out, 256).map_err(e("poll"))?;
        for c in out.drain(..) {
            if c.status != Status::Success {
                return Err(format!("{n} pairs: receive completed {c:?}"));
            }
            received += 1;
            let id = c.context as usize;
            let (p, k) = (id / w, id % w);
            let sge = slot(p, k).map_err(e("slice"))?;
            pairs[p]
                .1
                .post_recv(&RecvWr::new(c.context, &[sge]))
                .map_err(e("post_recv"))?;
        }
        if got > 0 {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "{n} pairs: no completion for 30 s ({received} of {total} messages received)"
            ));
        } else {
            std::thread::yield_now();
        }
    }
    let secs = t.elapsed().as_secs_f64();
    Ok((
        Row {
            pairs: n,
            threads: threads_now,
            threads_added: threads_now.saturating_sub(threads_before),
            kib_per_endpoint,
            connect,
            messages: total,
            secs,
        },
        report.provider.clone(),
    ))
}

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Resident memory of this process (`/proc/self/statm`, pages of 4 KiB).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// The soft limit on open files (`/proc/self/limits`), if it has one.
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}
