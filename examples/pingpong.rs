//! Ping-pong: the client sends a message, the server sends it back, `--iters` times; the
//! client checks every byte of every echo and prints the round-trip time.
//!
//! ```sh
//! cargo run -p fabric-examples --example pingpong                       # both sides here, best provider
//! FABRIC_PROVIDER=tcp cargo run -p fabric-examples --example pingpong -- --size 4096 --iters 10000
//! cargo run -p fabric-examples --example pingpong -- --role server --listen 0.0.0.0:7471
//! cargo run -p fabric-examples --example pingpong -- --role client --connect SERVER:7471
//! ```
//!
//! On roce and iwarp, listen on the device's address (`--listen 192.168.77.1:0` for rxe0 in
//! the soft-RDMA guest): rdma_cm binds to the RDMA device that holds the address.
//!
//! What it shows: a completion queue shared by both directions, a receive posted before
//! the message that fills it arrives, and that a send's buffer may be reused as soon as its
//! completion is polled.

use std::net::SocketAddr;
use std::time::Instant;

use clap::Parser;
use fabric::prelude::*;
use fabric::Selector;
use fabric_examples::{await_peer_close, run_roles, wait, wait_all, Result, Role, DEADLINE};

/// Ping-pong over any provider (FABRIC_PROVIDER / FABRIC_CONFIG choose it).
#[derive(Debug, Parser)]
struct Args {
    /// Which side(s) to run.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    role: Role,
    /// Address the server listens on (port 0: any).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Address the client connects to (with --role client).
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=(1 << 24)))]
    size: u32,
    /// Round trips.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    iters: u64,
}

/// The message of round trip `i`: every byte depends on its position and on `i`.
fn pattern(i: u64, j: usize) -> u8 {
    (j as u64).wrapping_mul(31).wrapping_add(i) as u8
}

/// The server: receives a message, sends the same bytes back; closes (drops its endpoint)
/// once the last echo completed.
fn server(domain: &AnyDomain, listener: &AnyListener, args: &Args) -> Result<()> {
    let size = args.size as usize;
    let cq = domain.create_cq(16)?;
    let ep = listener.accept(&EndpointConfig::new(&cq), DEADLINE)?;
    let buf = domain.alloc(size, Access::LOCAL_WRITE)?;
    ep.post_recv(&RecvWr::new(0, &[buf.all()]))?;
    for i in 0..args.iters {
        let got = wait(&cq, 0)?;
        if got.byte_len != size as u64 {
            return Err(format!("round trip {i}: {} bytes, expected {size}", got.byte_len).into());
        }
        // The receive buffer is echoed as it is; the next receive is posted only once the
        // echo completed, since both use the one buffer.
        ep.post_send(&SendWr::send(1, &[buf.all()]))?;
        wait(&cq, 1)?;
        if i + 1 < args.iters {
            ep.post_recv(&RecvWr::new(0, &[buf.all()]))?;
        }
    }
    println!("server: echoed {} messages of {size} B", args.iters);
    Ok(())
}

/// The client: sends, waits for the echo, checks it. The server sent the last message, so
/// the client waits for the server's close before closing (see [`await_peer_close`]).
fn client(domain: &AnyDomain, addr: SocketAddr, args: &Args) -> Result<()> {
    let size = args.size as usize;
    let cq = domain.create_cq(16)?;
    let ep = domain.connect(addr, &EndpointConfig::new(&cq))?;
    let ping = domain.alloc(size, Access::empty())?;
    let pong = domain.alloc(size, Access::LOCAL_WRITE)?;
    let start = Instant::now();
    for i in 0..args.iters {
        let msg: Vec<u8> = (0..size).map(|j| pattern(i, j)).collect();
        ping.buffer().write(0, &msg);
        // Receive first, so the echo always finds its buffer.
        ep.post_recv(&RecvWr::new(2, &[pong.all()]))?;
        ep.post_send(&SendWr::send(1, &[ping.all()]))?;
        wait_all(&cq, &[1, 2])?;
        if pong.buffer().to_vec(0, size) != msg {
            return Err(format!("round trip {i}: the echo differs from the message").into());
        }
    }
    let took = start.elapsed();
    let rtt = took.as_secs_f64() * 1e6 / args.iters as f64;
    println!(
        "client: {} round trips of {size} B, every echo verified, in {:.3} s: {rtt:.2} us per round trip ({:.2} us one way)",
        args.iters,
        took.as_secs_f64(),
        rtt / 2.0
    );
    await_peer_close(&ep)?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    fabric_examples::exit(run())
}

fn run() -> Result<()> {
    let args = Args::parse();
    let selector = Selector::from_env()?;
    run_roles(
        &selector,
        args.role,
        args.listen,
        args.connect,
        |d, l| server(d, l, &args),
        |d, a| client(d, a, &args),
    )
}
