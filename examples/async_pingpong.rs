//! Async ping-pong with tokio: [`pingpong`](../pingpong.rs) with every completion awaited
//! through the completion queue's file descriptor (`fabric::tokio::AsyncCq`, feature
//! `tokio`): the server awaits `AsyncCq::completion`, the client takes completions from the
//! queue as a `Stream`. Each side runs a single-threaded tokio runtime, so a task waiting
//! for a completion holds no thread: the runtime sleeps in `epoll_wait` until the queue's
//! descriptor becomes readable.
//!
//! ```sh
//! cargo run -p fabric-examples --example async_pingpong                  # both sides here
//! FABRIC_PROVIDER=tcp cargo run -p fabric-examples --example async_pingpong -- --iters 10000
//! cargo run -p fabric-examples --example async_pingpong -- --role server --listen 0.0.0.0:7472
//! cargo run -p fabric-examples --example async_pingpong -- --role client --connect SERVER:7472
//! ```
//!
//! Connecting and accepting are awaited too (`fabric::tokio::connect` and `accept`: the
//! connection is started without blocking and finished as the peer answers, with the
//! connection's and the listener's descriptors registered with the runtime). The server
//! sends the last message (the last echo), so it closes once that echo completed, and the
//! client, having received it, awaits the connection event of the server's close before it
//! closes (closing first would be abortive for the server's echo, whose completion on iWARP
//! waits for a delivery read the client answers).

use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Instant;

use clap::Parser;
use fabric::prelude::*;
use fabric::tokio::AsyncCq;
use fabric::Selector;
use fabric_examples::{run_roles, Result, Role, DEADLINE};
use futures_core::Stream;

/// Async ping-pong over any provider (FABRIC_PROVIDER / FABRIC_CONFIG choose it).
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

/// Runs `f` to completion on a single-threaded tokio runtime of this thread.
fn block_on<F: std::future::Future<Output = Result<()>>>(f: F) -> Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async { tokio::time::timeout(DEADLINE * 10, f).await? })
}

/// Checks that `c` is a successful completion of `context`.
fn expect(c: Completion, context: u64) -> Result<Completion> {
    if c.context != context || c.status != Status::Success {
        return Err(format!("unexpected completion {c:?}, expected context {context}").into());
    }
    Ok(c)
}

/// The server: accepts, awaits each message, sends the same bytes back; closes once the
/// last echo completed.
async fn server(domain: &AnyDomain, listener: &AnyListener, args: &Args) -> Result<()> {
    let size = args.size as usize;
    let cq = domain.create_cq(16)?;
    let ep = fabric::tokio::accept(listener, &EndpointConfig::new(&cq)).await?;
    let mut cq = AsyncCq::new(cq)?;
    let buf = domain.alloc(size, Access::LOCAL_WRITE)?;
    ep.post_recv(&RecvWr::new(0, &[buf.all()]))?;
    for i in 0..args.iters {
        let got = expect(cq.completion().await?, 0)?;
        if got.byte_len != size as u64 {
            return Err(format!("round trip {i}: {} bytes, expected {size}", got.byte_len).into());
        }
        // The receive buffer is echoed as it is; the next receive is posted once the echo
        // completed, since both use the one buffer.
        ep.post_send(&SendWr::send(1, &[buf.all()]))?;
        expect(cq.completion().await?, 1)?;
        if i + 1 < args.iters {
            ep.post_recv(&RecvWr::new(0, &[buf.all()]))?;
        }
    }
    println!("server: echoed {} messages of {size} B", args.iters);
    ep.close()?;
    Ok(())
}

/// The client: connects, sends, awaits the echo (completions taken as a `Stream`), checks
/// it; after the last echo awaits the server's close.
async fn client(domain: &AnyDomain, addr: SocketAddr, args: &Args) -> Result<()> {
    let size = args.size as usize;
    let cq = domain.create_cq(16)?;
    let ep = fabric::tokio::connect(domain, addr, &EndpointConfig::new(&cq)).await?;
    let mut completions = AsyncCq::new(cq)?;
    let ping = domain.alloc(size, Access::empty())?;
    let pong = domain.alloc(size, Access::LOCAL_WRITE)?;
    let start = Instant::now();
    for i in 0..args.iters {
        let msg: Vec<u8> = (0..size).map(|j| pattern(i, j)).collect();
        ping.buffer().write(0, &msg);
        ep.post_recv(&RecvWr::new(2, &[pong.all()]))?;
        ep.post_send(&SendWr::send(1, &[ping.all()]))?;
        // The send's and the echo's completions, in either order.
        let mut seen = [false; 2];
        while !(seen[0] && seen[1]) {
            let c = poll_fn(|cx| Pin::new(&mut completions).poll_next(cx))
                .await
                .ok_or("the completion stream ended")??;
            match c.context {
                1 | 2 if c.status == Status::Success && !seen[c.context as usize - 1] => {
                    seen[c.context as usize - 1] = true
                }
                _ => return Err(format!("round trip {i}: unexpected completion {c:?}").into()),
            }
        }
        if pong.buffer().to_vec(0, size) != msg {
            return Err(format!("round trip {i}: the echo differs from the message").into());
        }
    }
    let took = start.elapsed();
    let rtt = took.as_secs_f64() * 1e6 / args.iters as f64;
    println!(
        "client: {} round trips of {size} B awaited with tokio, every echo verified, in {:.3} s: {rtt:.2} us per round trip",
        args.iters,
        took.as_secs_f64(),
    );
    match fabric::tokio::next_event(&ep).await? {
        EndpointEvent::PeerClosed => println!("client: the server closed the connection"),
        other => return Err(format!("unexpected connection event {other:?}").into()),
    }
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
        |d, l| block_on(server(d, l, &args)),
        |d, a| block_on(client(d, a, &args)),
    )
}
