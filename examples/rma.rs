//! RMA with descriptor exchange: the server registers a region for remote writes and reads
//! and hands its descriptor (`RemoteDesc`: address, length, key; 20 bytes of plain data) to
//! the client in the connection's private data. The client writes a pattern into it with
//! one RDMA Write, reads it back with one RDMA Read and compares; then it sends a one-byte
//! message, and the server, which never polled while its memory was written, checks the
//! pattern in its own region.
//!
//! ```sh
//! cargo run -p fabric-examples --example rma                            # both sides here
//! cargo run -p fabric-examples --example rma -- --size 16M
//! cargo run -p fabric-examples --example rma -- --role server --listen 0.0.0.0:7472
//! cargo run -p fabric-examples --example rma -- --role client --connect SERVER:7472
//! ```
//!
//! Descriptors can travel any way (a file, a TCP socket, MPI): they are only numbers. Private
//! data is the simplest when there is a connection anyway. On roce and iwarp, listen on the
//! device's address (`--listen 192.168.77.1:0` for rxe0 in the soft-RDMA guest).

use std::net::SocketAddr;

use clap::Parser;
use fabric::prelude::*;
use fabric::Selector;
use fabric_examples::{await_peer_close, run_roles, wait, Result, Role, DEADLINE};

/// RDMA Write and Read into a region whose descriptor came with the connection.
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
    /// Region size: bytes, or with a K or M suffix (64K, 16M).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    size: usize,
}

/// `65536`, `64K`, `16M` (at most 1 GiB).
fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?}: expected bytes such as 65536, 64K or 16M"))?;
    match n.checked_mul(mult) {
        Some(v) if (1..=1 << 30).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: expected 1 byte to 1 GiB")),
    }
}

/// Byte `j` of what the client writes.
fn pattern(j: usize) -> u8 {
    (j % 251) as u8 ^ 0x5a
}

fn server(domain: &AnyDomain, listener: &AnyListener, size: usize) -> Result<()> {
    let cq = domain.create_cq(16)?;
    let region = domain.alloc(
        size,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    let desc = region.desc().to_bytes();
    let cfg = EndpointConfig {
        private_data: &desc,
        ..EndpointConfig::new(&cq)
    };
    let ep = listener.accept(&cfg, DEADLINE)?;
    // Only the "done" message needs a receive; the writes and reads need nothing from here.
    let note = domain.alloc(1, Access::LOCAL_WRITE)?;
    ep.post_recv(&RecvWr::new(0, &[note.all()]))?;
    wait(&cq, 0)?;
    let got = region.buffer().to_vec(0, size);
    if let Some(j) = (0..size).find(|&j| got[j] != pattern(j)) {
        return Err(format!(
            "server: byte {j} of the region is {:#x}, expected {:#x}",
            got[j],
            pattern(j)
        )
        .into());
    }
    println!("server: the client wrote all {size} bytes of the region; verified here, with no poll during the transfer");
    // The client's "done" was the last message: its send completes before the client
    // closes, and closing here first could flush it.
    await_peer_close(&ep)?;
    Ok(())
}

fn client(domain: &AnyDomain, addr: SocketAddr, size: usize) -> Result<()> {
    let cq = domain.create_cq(16)?;
    let ep = domain.connect(addr, &EndpointConfig::new(&cq))?;
    let remote = RemoteDesc::from_bytes(&ep.peer_private_data())?;
    println!(
        "client: the server's region: {} bytes at {:#x}, key {:#x}",
        remote.len, remote.addr, remote.key
    );
    if (remote.len as usize) < size {
        return Err(format!(
            "the server's region has {} bytes, fewer than --size {size}",
            remote.len
        )
        .into());
    }
    let src = domain.alloc(size, Access::empty())?;
    src.buffer()
        .write(0, &(0..size).map(pattern).collect::<Vec<u8>>());
    ep.post_send(&SendWr::write(1, &[src.all()], remote.at(0)))?;
    wait(&cq, 1)?;
    let sink = domain.alloc(size, Access::LOCAL_WRITE)?;
    ep.post_send(&SendWr::read(2, &[sink.all()], remote.at(0)))?;
    wait(&cq, 2)?;
    if sink.buffer().to_vec(0, size) != src.buffer().to_vec(0, size) {
        return Err(
            "client: the RDMA Read returned other bytes than the RDMA Write put there".into(),
        );
    }
    println!("client: wrote {size} bytes with one RDMA Write, read them back with one RDMA Read: identical");
    let done = domain.alloc(1, Access::empty())?;
    ep.post_send(&SendWr::send(3, &[done.all()]))?;
    wait(&cq, 3)?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    fabric_examples::exit(run())
}

fn run() -> Result<()> {
    let args = Args::parse();
    let selector = Selector::from_env()?.require(OpSet::WRITE | OpSet::READ);
    let size = args.size;
    run_roles(
        &selector,
        args.role,
        args.listen,
        args.connect,
        |d, l| server(d, l, size),
        |d, a| client(d, a, size),
    )
}
