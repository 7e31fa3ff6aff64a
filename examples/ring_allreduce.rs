//! A ring allreduce written against the public API, the way middleware would: no copy of
//! the application's data, and no thread beyond the application's own.
//!
//! * **No copy.** Each rank's `Vec<f32>` is registered as it is (`Buffer::from_vec`: the
//!   region is the vector's own allocation) and given back at the end
//!   (`MemoryRegion::into_buffer`, `Buffer::into_vec`). Chunks travel by RDMA Write
//!   straight out of one rank's vector into the next rank's memory: into a scratch region
//!   during the reduce-scatter (where the chunk is added into the vector), into the vector
//!   itself during the allgather.
//! * **No extra thread.** Every rank connects to the next rank and accepts the previous one
//!   on its own thread: `connect_start` returns at once and `try_accept` never waits, so a
//!   ring where everybody connects before anybody accepts comes up without deadlock (a
//!   blocking `connect` waits for the peer's `accept`, and would need a second thread).
//!
//! The ranks here are threads of one process, standing in for processes on separate
//! hosts: they share nothing but the bootstrap (each rank's listening address) and a start
//! barrier, which a launcher provides in real life. Each has its own domain, queue and
//! endpoints.
//!
//! ```sh
//! cargo run -p fabric-examples --example ring_allreduce               # 4 ranks, 1 Mi floats
//! cargo run -p fabric-examples --example ring_allreduce -- --np 8 --count 4000000
//! FABRIC_PROVIDER=roce cargo run -p fabric-examples --example ring_allreduce -- --addr 192.168.77.1
//! ```
//!
//! Each step writes one chunk and then sends a zero-byte message: a message posted after a
//! write arrives only once the written data is in place (contract section 4), so the
//! message's receive says the chunk is there.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Parser;
use fabric::prelude::*;
use fabric::{Selector, Slice};
use fabric_examples::{Result, DEADLINE};

/// A ring allreduce (sum of f32) over every provider, zero-copy.
#[derive(Debug, Parser)]
struct Args {
    /// Number of ranks.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    np: u32,
    /// Elements per rank.
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1..=(1 << 28)))]
    count: u64,
    /// Address the ranks listen on (the RDMA device's address for roce and iwarp).
    #[arg(long, default_value = "127.0.0.1")]
    addr: IpAddr,
}

/// Context values: step numbers of the two phases, and what completes.
const SEND_CTX: u64 = 1 << 32;
const RECV_CTX: u64 = 2 << 32;

/// Rank `r`'s initial data: small integers, so every sum is exact in f32 and the result
/// can be checked bit for bit.
fn initial(r: usize, i: usize) -> f32 {
    ((r * 7 + i) % 1000) as f32
}

/// The chunk `k` of `count` elements split in `np`: (first element, elements).
fn chunk(k: usize, count: usize, np: usize) -> (usize, usize) {
    let base = count / np;
    let extra = count % np;
    let start = k * base + k.min(extra);
    (start, base + usize::from(k < extra))
}

struct Ring {
    cq: AnyCq,
    /// To the next rank (we connected), and from the previous one (we accepted).
    next: AnyEndpoint,
    prev: AnyEndpoint,
    /// The next rank's vector and scratch region.
    next_data: RemoteDesc,
    next_scratch: RemoteDesc,
}

/// Connects to the next rank and accepts the previous one, on this thread.
fn connect_ring(
    domain: &AnyDomain,
    listener: &AnyListener,
    next_addr: SocketAddr,
    cq: AnyCq,
    my_descs: &[u8],
) -> Result<Ring> {
    let cfg = EndpointConfig {
        private_data: my_descs,
        ..EndpointConfig::new(&cq)
    };
    let mut connecting = Some(domain.connect_start(next_addr, &cfg)?);
    let (mut next, mut prev) = (None, None);
    let deadline = Instant::now() + DEADLINE;
    while next.is_none() || prev.is_none() {
        if Instant::now() > deadline {
            return Err(format!("ring not connected within {DEADLINE:?}").into());
        }
        if let Some(c) = connecting.as_mut() {
            if let Some(ep) = c.poll()? {
                next = Some(ep);
                connecting = None;
            }
        }
        if prev.is_none() {
            prev = listener.try_accept(&cfg)?;
        }
        // A real event loop would wait on the descriptors of `connecting` and `listener`
        // (`AsFd`); a short sleep keeps the example plain.
        std::thread::sleep(Duration::from_micros(200));
    }
    let next = next.expect("connected");
    let pd = next.peer_private_data();
    if pd.len() != 2 * RemoteDesc::ENCODED_LEN {
        return Err(format!("next rank sent {} bytes of descriptors", pd.len()).into());
    }
    Ok(Ring {
        next_data: RemoteDesc::from_bytes(&pd[..RemoteDesc::ENCODED_LEN])?,
        next_scratch: RemoteDesc::from_bytes(&pd[RemoteDesc::ENCODED_LEN..])?,
        next,
        prev: prev.expect("accepted"),
        cq,
    })
}

/// Waits for the next completion for `want` (skipping the other kind: the sends' and the
/// receives' completions share the queue and are not ordered against each other).
fn wait_for(ring: &Ring, pending: &mut Vec<Completion>, want: u64) -> Result<()> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(i) = pending.iter().position(|c| c.context == want) {
            pending.swap_remove(i);
            return Ok(());
        }
        let mut out = Vec::new();
        if ring.cq.poll(&mut out, 16)? == 0 {
            if Instant::now() > deadline {
                return Err(format!("no completion {want:#x} within {DEADLINE:?}").into());
            }
            ring.cq.wait(Duration::from_millis(100))?;
        }
        for c in out {
            if c.status != Status::Success {
                return Err(format!("operation {:#x} failed: {}", c.context, c.status).into());
            }
            pending.push(c);
        }
    }
}

/// One rank: returns its vector after the allreduce, and how long the allreduce took.
fn rank(
    r: usize,
    np: usize,
    data: Vec<f32>,
    addrs: &[SocketAddr],
    listener: AnyListener,
    domain: AnyDomain,
    start: &Barrier,
) -> Result<(Vec<f32>, Duration)> {
    let count = data.len();
    let f = std::mem::size_of::<f32>();
    // The application's vector, registered where it lies.
    let buffer = Buffer::from_vec(data);
    assert!(buffer.is_borrowed_allocation(), "the vector was copied");
    let data = domain.register(Arc::new(buffer), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    // One slot per reduce-scatter step, so a fast neighbour never overwrites a chunk
    // before it was added.
    let slot = chunk(0, count, np).1 * f;
    let scratch = domain.alloc(
        slot * (np - 1).max(1),
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    )?;
    let mut descs = data.desc().to_bytes().to_vec();
    descs.extend_from_slice(&scratch.desc().to_bytes());
    let cq = domain.create_cq(4 * np + 8)?;
    let ring = connect_ring(&domain, &listener, addrs[(r + 1) % np], cq, &descs)?;
    let steps = 2 * (np - 1);
    for s in 0..steps {
        ring.prev
            .post_recv(&RecvWr::new(RECV_CTX | s as u64, &[]))?;
    }
    start.wait(); // every rank has its receives posted
    let t = Instant::now();
    let mut pending = Vec::new();
    let empty: [Slice<'_>; 0] = [];
    for s in 0..steps {
        // Reduce-scatter (s < np-1): send the chunk reduced so far into the next rank's
        // scratch slot. Allgather: send the finished chunk into the next rank's vector.
        let (k, to) = if s < np - 1 {
            let k = (r + np - s) % np;
            (k, ring.next_scratch.at((s * slot) as u64))
        } else {
            let k = (r + 1 + np - (s - (np - 1))) % np;
            (k, ring.next_data.at((chunk(k, count, np).0 * f) as u64))
        };
        let (first, n) = chunk(k, count, np);
        let src = [data.slice(first * f..(first + n) * f)?];
        ring.next
            .post_send(&SendWr::write(SEND_CTX | (2 * s) as u64, &src, to).unsignaled())?;
        ring.next
            .post_send(&SendWr::send(SEND_CTX | (2 * s + 1) as u64, &empty))?;
        // The previous rank's chunk for this step is in place once its message is here.
        wait_for(&ring, &mut pending, RECV_CTX | s as u64)?;
        if s < np - 1 {
            // Add the incoming chunk into ours: k - 1 is the chunk the previous rank sent.
            let k = (r + np - s - 1) % np;
            let (first, n) = chunk(k, count, np);
            let mut mine = vec![0f32; n];
            let mut theirs = vec![0f32; n];
            data.buffer().read_slice(first * f, &mut mine);
            scratch.buffer().read_slice(s * slot, &mut theirs);
            for (m, t) in mine.iter_mut().zip(&theirs) {
                *m += t;
            }
            data.buffer().write_slice(first * f, &mine);
        }
        wait_for(&ring, &mut pending, SEND_CTX | (2 * s + 1) as u64)?;
    }
    let took = t.elapsed();
    // Everybody is done writing into everybody before anybody closes.
    start.wait();
    drop(ring);
    let buffer = data
        .into_buffer()
        .map_err(|_| "an operation still holds the region")?;
    let back: Vec<f32> = buffer
        .into_vec()
        .map_err(|_| "the region does not hold whole f32s")?;
    Ok((back, took))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (np, count) = (args.np as usize, args.count as usize);
    let selector = Selector::from_env()?;
    // The bootstrap: each rank's domain and listener, and the list of addresses.
    let mut setup = Vec::new();
    for _ in 0..np {
        let (domain, report) = selector.open()?;
        if setup.is_empty() {
            println!("{report}");
        }
        let listener = domain.listen(SocketAddr::new(args.addr, 0))?;
        setup.push((domain, listener));
    }
    let addrs: Vec<SocketAddr> = setup.iter().map(|(_, l)| l.local_addr()).collect();
    let start = Barrier::new(np);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = setup
            .into_iter()
            .enumerate()
            .map(|(r, (domain, listener))| {
                let (addrs, start) = (&addrs, &start);
                s.spawn(move || {
                    let data: Vec<f32> = (0..count).map(|i| initial(r, i)).collect();
                    rank(r, np, data, addrs, listener, domain, start)
                        .map_err(|e| format!("rank {r}: {e}"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect::<Vec<_>>()
    });
    let mut took = Duration::ZERO;
    let mut vectors = Vec::new();
    for r in results {
        let (v, t) = r?;
        took = took.max(t);
        vectors.push(v);
    }
    let expect: Vec<f32> = (0..count)
        .map(|i| (0..np).map(|r| initial(r, i)).sum())
        .collect();
    for (r, v) in vectors.iter().enumerate() {
        let wrong = v
            .iter()
            .zip(&expect)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        if wrong > 0 {
            return Err(format!("rank {r}: {wrong} of {count} elements wrong").into());
        }
    }
    let bytes = count * std::mem::size_of::<f32>();
    let algbw = bytes as f64 / took.as_secs_f64() / 1e9;
    println!(
        "{np} ranks, {count} f32 each ({bytes} bytes): allreduce in {:.3} ms, algbw {algbw:.3} GB/s \
         (GB = 10^9 B), busbw {:.3} GB/s; every rank holds the exact sum",
        took.as_secs_f64() * 1e3,
        algbw * 2.0 * (np - 1) as f64 / np as f64
    );
    Ok(())
}
