//! Choosing a provider from a TOML file: the file names the providers in order of
//! preference, the operations the application needs and per-provider options; the program
//! opens whatever qualifies, prints the selection report (what was chosen, what was passed
//! over and why, what is emulated), then moves one message and one fetch-and-add to prove
//! the choice works.
//!
//! ```sh
//! cargo run -p fabric-examples --example provider_from_toml                          # examples/fabric.toml
//! cargo run -p fabric-examples --example provider_from_toml -- my-fabric.toml
//! ```
//!
//! Any program using `Selector::from_env()` reads the same file from `FABRIC_CONFIG`
//! (`FABRIC_CONFIG=examples/fabric.toml fabric info`). Unknown keys and bad values are
//! errors that name the key.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use fabric::prelude::*;
use fabric::Selector;
use fabric_examples::{await_peer_close, run_roles, wait, wait_all, Result, Role, DEADLINE};

/// Opens the provider a TOML file chooses and uses it.
#[derive(Debug, Parser)]
struct Args {
    /// The configuration file.
    #[arg(default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/fabric.toml"))]
    config: PathBuf,
    /// Address the server listens on (port 0: any; on roce and iwarp the device's address).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
}

fn server(domain: &AnyDomain, listener: &AnyListener) -> Result<()> {
    let cq = domain.create_cq(16)?;
    let counter = domain.alloc(8, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
    counter.buffer().write(0, &41u64.to_ne_bytes());
    let desc = counter.desc().to_bytes();
    let ep = listener.accept(
        &EndpointConfig {
            private_data: &desc,
            ..EndpointConfig::new(&cq)
        },
        DEADLINE,
    )?;
    let inbox = domain.alloc(64, Access::LOCAL_WRITE)?;
    ep.post_recv(&RecvWr::new(0, &[inbox.all()]))?;
    let c = wait(&cq, 0)?;
    println!(
        "server: received {:?}",
        String::from_utf8_lossy(&inbox.buffer().to_vec(0, c.byte_len as usize))
    );
    // A second message says the client's fetch-and-add is done.
    ep.post_recv(&RecvWr::new(1, &[inbox.all()]))?;
    wait(&cq, 1)?;
    let mut word = [0u8; 8];
    counter.buffer().read(0, &mut word);
    let v = u64::from_ne_bytes(word);
    if v != 42 {
        return Err(
            format!("server: the counter is {v} after one fetch-and-add of 1 to 41").into(),
        );
    }
    println!("server: the counter went from 41 to {v}");
    // The client's note was the last message; it closes once the note's send completed.
    await_peer_close(&ep)?;
    Ok(())
}

fn client(domain: &AnyDomain, addr: SocketAddr) -> Result<()> {
    let cq = domain.create_cq(16)?;
    let ep = domain.connect(addr, &EndpointConfig::new(&cq))?;
    let counter = RemoteDesc::from_bytes(&ep.peer_private_data())?;
    let msg = domain.alloc(64, Access::LOCAL_WRITE)?;
    let hello = b"hello from the provider the file chose";
    msg.buffer().write(0, hello);
    ep.post_send(&SendWr::send(1, &[msg.slice(0..hello.len())?]))?;
    ep.post_send(&SendWr::fetch_add(2, msg.slice(56..64)?, counter.at(0), 1))?;
    wait_all(&cq, &[1, 2])?;
    let mut old = [0u8; 8];
    msg.buffer().read(56, &mut old);
    let old = u64::from_ne_bytes(old);
    if old != 41 {
        return Err(format!("client: fetch-and-add fetched {old}, expected 41").into());
    }
    println!("client: fetch-and-add fetched {old}");
    ep.post_send(&SendWr::send(3, &[msg.slice(0..1)?]))?;
    wait(&cq, 3)?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    fabric_examples::exit(run())
}

fn run() -> Result<()> {
    let args = Args::parse();
    let selector = Selector::new()
        .config_file(&args.config)
        .map_err(|e| format!("{}: {e}", args.config.display()))?;
    println!("configuration: {}", args.config.display());
    run_roles(&selector, Role::Both, args.listen, None, server, client)
}
