//! An atomic counter shared by many clients: the server exposes one 8-byte word with remote
//! atomic access; `--clients` clients (threads here, each with its own domain and
//! connection, as separate processes would have) each add 1 to it `--adds` times with
//! fetch-and-add. Every value the clients fetched must be distinct, together exactly
//! 0..clients*adds, and the word must end at clients*adds: no increment lost or doubled.
//!
//! ```sh
//! cargo run -p fabric-examples --example atomic_counter                 # 8 clients x 1000 adds
//! cargo run -p fabric-examples --example atomic_counter -- --clients 32 --adds 100
//! ```
//!
//! The selection requires FETCH_ADD: on a machine whose best provider lacks it (iWARP has
//! no atomics in RDMAP, and the iwarp provider emulates them only where the device allows
//! 56-byte inline writes), the next provider that has it is chosen and the report says why.
//! On roce, listen on the device's address (`--listen 192.168.77.1:0` for rxe0).

use std::net::SocketAddr;
use std::time::Instant;

use clap::Parser;
use fabric::prelude::*;
use fabric::Selector;
use fabric_examples::{await_peer_close, wait, wait_all, Result, DEADLINE};

/// Many clients, one counter.
#[derive(Debug, Parser)]
struct Args {
    /// Address the server listens on (port 0: any).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Number of clients.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    clients: u32,
    /// Fetch-and-adds per client.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    adds: u64,
}

/// Accepts every client, handing each the counter's descriptor, and waits for each to say
/// it is done; returns the counter's final value. The server never takes part in the
/// atomics: the provider (the NIC, or the tcp provider's progress engine) executes them.
fn server(domain: &AnyDomain, listener: &AnyListener, clients: u32) -> Result<u64> {
    let cq = domain.create_cq(2 * clients as usize)?;
    let counter = domain.alloc(8, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
    let desc = counter.desc().to_bytes();
    let notes = domain.alloc(clients as usize, Access::LOCAL_WRITE)?;
    let mut endpoints = Vec::new();
    for i in 0..clients as usize {
        let cfg = EndpointConfig {
            private_data: &desc,
            ..EndpointConfig::new(&cq)
        };
        let ep = listener.accept(&cfg, DEADLINE)?;
        ep.post_recv(&RecvWr::new(i as u64, &[notes.slice(i..i + 1)?]))?;
        endpoints.push(ep);
    }
    // The notes arrive in whatever order the clients finish.
    wait_all(&cq, &(0..u64::from(clients)).collect::<Vec<u64>>())?;
    // Each note was its client's last message: the client closes once its send completed,
    // and closing here first could flush that send.
    for ep in &endpoints {
        await_peer_close(ep)?;
    }
    let mut word = [0u8; 8];
    counter.buffer().read(0, &mut word);
    Ok(u64::from_ne_bytes(word))
}

/// One client: `adds` fetch-and-adds of 1, returning the values fetched.
fn client(selector: &Selector, addr: SocketAddr, adds: u64) -> Result<Vec<u64>> {
    let (domain, _) = selector.open()?;
    let cq = domain.create_cq(16)?;
    let ep = domain.connect(addr, &EndpointConfig::new(&cq))?;
    let counter = RemoteDesc::from_bytes(&ep.peer_private_data())?;
    let result = domain.alloc(8, Access::LOCAL_WRITE)?;
    let mut fetched = Vec::with_capacity(adds as usize);
    for i in 0..adds {
        ep.post_send(&SendWr::fetch_add(i, result.all(), counter.at(0), 1))?;
        wait(&cq, i)?;
        let mut old = [0u8; 8];
        result.buffer().read(0, &mut old);
        fetched.push(u64::from_ne_bytes(old));
    }
    let done = domain.alloc(1, Access::empty())?;
    ep.post_send(&SendWr::send(u64::MAX, &[done.all()]))?;
    wait(&cq, u64::MAX)?;
    Ok(fetched)
}

fn main() -> std::process::ExitCode {
    fabric_examples::exit(run())
}

fn run() -> Result<()> {
    let args = Args::parse();
    let selector = Selector::from_env()?.require(OpSet::FETCH_ADD);
    let (domain, report) = selector.open()?;
    println!("selected {report}");
    let listener = domain.listen(args.listen)?;
    let addr = listener.local_addr();
    let start = Instant::now();
    let (total, mut fetched) = std::thread::scope(|s| -> Result<(u64, Vec<u64>)> {
        let clients: Vec<_> = (0..args.clients)
            .map(|_| s.spawn(|| client(&selector, addr, args.adds)))
            .collect();
        let total = server(&domain, &listener, args.clients);
        let mut fetched = Vec::new();
        for c in clients {
            fetched.extend(c.join().map_err(|_| "a client thread panicked")??);
        }
        Ok((total?, fetched))
    })?;
    let expected = u64::from(args.clients) * args.adds;
    fetched.sort_unstable();
    if total != expected {
        return Err(format!("the counter ends at {total}, expected {expected}").into());
    }
    if let Some((i, v)) = fetched.iter().enumerate().find(|&(i, &v)| v != i as u64) {
        return Err(format!(
            "fetched values are not exactly 0..{expected}: position {i} holds {v}"
        )
        .into());
    }
    println!(
        "{} clients x {} fetch-and-adds in {:.3} s: the counter is {total}, and the values fetched are exactly 0..{expected}, each once",
        args.clients,
        args.adds,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
