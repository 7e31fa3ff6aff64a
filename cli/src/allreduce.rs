//! `fabric allreduce | allgather | broadcast`: collectives over `fabric-rdm`, measured as
//! nccl-tests prints them; and `fabric rdm-peer`, the peer process of the `rdm.*` / `tag.*`
//! conformance cases.

use std::io::BufRead;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fabric::prelude::*;
use fabric_rdm::{RdmConfig, RdmEndpoint, RecvBuf, Source};

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
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin.read_line(&mut line).map_err(|e| e.to_string())?;
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
