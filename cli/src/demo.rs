//! `fabric demo`: a server and a client on the selected provider moving data with
//! send/receive, write, read and atomics, printing what was selected and measured.
//!
//! `--role both` (the default) runs both in this process on loopback; `--role server` and
//! `--role client` run them as two processes.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fabric::prelude::*;

const WAIT: Duration = Duration::from_secs(30);
const MSG: usize = 4096;
const RECVS: usize = 64;

/// Arguments of `fabric demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Provider spec (overrides FABRIC_PROVIDER), e.g. `tcp`.
    #[arg(long)]
    provider: Option<String>,
    /// Which side(s) to run.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    role: Role,
    /// Address the server listens on (port 0: any).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Address the client connects to (required with --role client).
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Bytes per RMA transfer.
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1..=(1 << 30)))]
    size: u64,
    /// Iterations per operation.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    iters: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    Both,
    Server,
    Client,
}

fn e(what: &str) -> impl FnOnce(fabric::Error) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn wait(cq: &AnyCq, context: u64) -> Result<Completion, String> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::with_capacity(1);
    loop {
        if cq.poll(&mut out, 1).map_err(e("poll"))? == 1 {
            let c = out.pop().expect("one");
            if c.status != Status::Success {
                return Err(format!("operation {} failed: {c:?}", c.context));
            }
            if c.context == context {
                return Ok(c);
            }
            continue;
        }
        if Instant::now() > deadline {
            return Err(format!("no completion for {context} within {WAIT:?}"));
        }
        cq.wait(Duration::from_millis(100)).map_err(e("wait"))?;
    }
}

pub(crate) fn run(args: DemoArgs) -> Result<ExitCode, String> {
    if args.role == Role::Client && args.connect.is_none() {
        return Err(
            "--role client needs --connect ADDR (the address `fabric demo --role server` printed)"
                .into(),
        );
    }
    let selector = crate::selector(args.provider.as_deref())?;
    let (domain, report) = selector.open().map_err(|e| e.to_string())?;
    println!("selected {report}");
    match args.role {
        Role::Server => {
            let listener = domain.listen(args.listen).map_err(e("listen"))?;
            println!("server listening on {}", listener.local_addr());
            serve(&domain, &listener)?;
        }
        Role::Client => client(&domain, args.connect.expect("checked"), &args)?,
        Role::Both => {
            let (server_domain, _) = selector.open().map_err(|e| e.to_string())?;
            let listener = server_domain.listen(args.listen).map_err(e("listen"))?;
            let addr = listener.local_addr();
            println!("server listening on {addr}");
            std::thread::scope(|s| -> Result<(), String> {
                let server = s.spawn(|| serve(&server_domain, &listener));
                let c = client(&domain, addr, &args);
                let sv = server
                    .join()
                    .map_err(|_| "server thread panicked".to_string())?;
                c.and(sv)
            })?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The server: exposes a region for RMA and atomics, counts the messages it receives.
fn serve(domain: &AnyDomain, listener: &AnyListener) -> Result<(), String> {
    let cq = domain.create_cq(1024).map_err(e("create_cq"))?;
    let ep = listener
        .accept(&EndpointConfig::new(&cq), WAIT)
        .map_err(e("accept"))?;
    let target = domain
        .alloc(64 << 20, Access::all())
        .map_err(e("register target"))?;
    let recvs = domain
        .alloc(MSG * RECVS, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    for i in 0..RECVS {
        ep.post_recv(&RecvWr::new(
            i as u64,
            &[recvs.slice(i * MSG..(i + 1) * MSG).map_err(e("slice"))?],
        ))
        .map_err(e("post_recv"))?;
    }
    let hello = domain
        .alloc(RemoteDesc::ENCODED_LEN, Access::empty())
        .map_err(e("register"))?;
    hello.buffer().write(0, &target.desc().to_bytes());
    ep.post_send(&SendWr::send(u64::MAX, &[hello.all()]))
        .map_err(e("send descriptor"))?;
    let (mut messages, mut bytes) = (0u64, 0u64);
    let mut out = Vec::new();
    loop {
        out.clear();
        if cq.poll(&mut out, 32).map_err(e("poll"))? == 0 {
            cq.wait(WAIT).map_err(e("wait"))?;
            continue;
        }
        for c in &out {
            if c.status != Status::Success {
                return Err(format!("server saw {c:?}"));
            }
            if c.opcode != Opcode::Recv {
                continue;
            }
            let i = c.context as usize;
            let msg = recvs.buffer().to_vec(i * MSG, c.byte_len as usize);
            if msg == b"done" {
                let counter =
                    u64::from_ne_bytes(target.buffer().to_vec(0, 8).try_into().expect("8 bytes"));
                println!("server: received {messages} messages ({bytes} bytes); counter word holds {counter}; never polled for RMA or atomics");
                // "done" was the client's last message. It closes once that send completed;
                // closing here first would be abortive for it (on iWARP the send completes
                // with the delivery read this side answers), and the client would see a
                // message that arrived reported Flushed.
                return match ep
                    .wait_event(WAIT)
                    .map_err(e("wait for the client's close"))?
                {
                    Some(EndpointEvent::PeerClosed) => Ok(()),
                    other => Err(format!(
                        "server: expected the client to close, got {other:?}"
                    )),
                };
            }
            if msg
                .iter()
                .enumerate()
                .any(|(j, &b)| b != (j as u8) ^ (messages as u8))
            {
                return Err(format!("server: message {messages} corrupted"));
            }
            messages += 1;
            bytes += c.byte_len;
            ep.post_recv(&RecvWr::new(
                i as u64,
                &[recvs.slice(i * MSG..(i + 1) * MSG).map_err(e("slice"))?],
            ))
            .map_err(e("post_recv"))?;
        }
    }
}

/// Posts `iters` requests keeping the send queue busy: every `WINDOW`-th request is
/// signaled, and at most two windows are outstanding.
fn stream<'a>(
    ep: &AnyEndpoint,
    cq: &AnyCq,
    iters: u64,
    wr: impl Fn(u64) -> SendWr<'a>,
) -> Result<(), String> {
    const WINDOW: u64 = 64;
    let mut waiting: Option<u64> = None;
    for i in 0..iters {
        let last_of_window = i % WINDOW == WINDOW - 1 || i + 1 == iters;
        let w = wr(i);
        ep.post_send(&if last_of_window { w } else { w.unsignaled() })
            .map_err(e("post"))?;
        if last_of_window {
            if let Some(prev) = waiting.replace(i) {
                wait(cq, prev)?;
            }
        }
    }
    match waiting {
        Some(last) => wait(cq, last).map(|_| ()),
        None => Ok(()),
    }
}

struct Row {
    op: &'static str,
    bytes: u64,
    iters: u64,
    secs: f64,
}

fn print_rows(rows: &[Row]) {
    println!("MB = 10^6 bytes");
    println!(
        "{:<10} {:>10} {:>8} {:>10} {:>9} {:>10} {:>10} {:>11}",
        "op", "bytes", "iters", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec"
    );
    for r in rows {
        let total = r.bytes * r.iters;
        println!(
            "{:<10} {:>10} {:>8} {:>10} {:>8.3}s {:>10.2} {:>10.2} {:>11.4}",
            r.op,
            r.bytes,
            r.iters,
            total,
            r.secs,
            total as f64 / r.secs / 1e6,
            r.secs * 1e6 / r.iters as f64,
            r.iters as f64 / r.secs / 1e6
        );
    }
}

/// The client: sends, writes, reads and atomics against the server, verifying each.
fn client(domain: &AnyDomain, addr: SocketAddr, args: &DemoArgs) -> Result<(), String> {
    let size = args.size as usize;
    let iters = args.iters;
    let cq = domain.create_cq(1024).map_err(e("create_cq"))?;
    let ep = domain
        .connect(addr, &EndpointConfig::new(&cq))
        .map_err(e("connect"))?;
    println!(
        "client connected {} -> {}; emulated here: {}",
        ep.local_addr(),
        ep.peer_addr(),
        ep.emulated().join("; ")
    );
    let desc_mr = domain
        .alloc(64, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    ep.post_recv(&RecvWr::new(u64::MAX, &[desc_mr.all()]))
        .map_err(e("post_recv"))?;
    let c = wait(&cq, u64::MAX)?;
    let remote = RemoteDesc::from_bytes(&desc_mr.buffer().to_vec(0, c.byte_len as usize))
        .map_err(e("descriptor"))?;
    if (size as u64) > remote.len / 2 {
        return Err(format!(
            "--size {size} exceeds half the server's {} byte region",
            remote.len
        ));
    }
    let local = domain
        .alloc(size.max(MSG), Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let mut rows = Vec::new();

    // send / receive: one message at a time, each checked by the server.
    let t = Instant::now();
    for i in 0..iters {
        for j in 0..MSG {
            local.buffer().write(j, &[(j as u8) ^ (i as u8)]);
        }
        ep.post_send(&SendWr::send(
            i,
            &[local.slice(0..MSG).map_err(e("slice"))?],
        ))
        .map_err(e("post_send"))?;
        wait(&cq, i)?;
    }
    rows.push(Row {
        op: "send",
        bytes: MSG as u64,
        iters,
        secs: t.elapsed().as_secs_f64(),
    });

    // write: fill a pattern, write it, later read it back.
    for j in 0..size {
        local.buffer().write(j, &[(j % 251) as u8]);
    }
    let src = [local.slice(0..size).map_err(e("slice"))?];
    let t = Instant::now();
    stream(&ep, &cq, iters, |i| SendWr::write(i, &src, remote.at(64)))?;
    rows.push(Row {
        op: "write",
        bytes: size as u64,
        iters,
        secs: t.elapsed().as_secs_f64(),
    });

    // read: into a second buffer, verified against what was written.
    let sink = domain
        .alloc(size, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let dst = [sink.all()];
    let t = Instant::now();
    stream(&ep, &cq, iters, |i| SendWr::read(i, &dst, remote.at(64)))?;
    rows.push(Row {
        op: "read",
        bytes: size as u64,
        iters,
        secs: t.elapsed().as_secs_f64(),
    });
    if sink.buffer().to_vec(0, size) != local.buffer().to_vec(0, size) {
        return Err("read returned different bytes than were written".into());
    }

    // atomics: fetch-and-add on the server's counter word, one at a time.
    let result = domain
        .alloc(8, Access::LOCAL_WRITE)
        .map_err(e("register"))?;
    let t = Instant::now();
    for i in 0..iters {
        ep.post_send(&SendWr::fetch_add(i, result.all(), remote.at(0), 1))
            .map_err(e("post fetch_add"))?;
        wait(&cq, i)?;
        let old = u64::from_ne_bytes(result.buffer().to_vec(0, 8).try_into().expect("8 bytes"));
        if old != i {
            return Err(format!("fetch_add {i} returned {old}"));
        }
    }
    rows.push(Row {
        op: "fetch_add",
        bytes: 8,
        iters,
        secs: t.elapsed().as_secs_f64(),
    });
    ep.post_send(&SendWr::compare_swap(
        1,
        result.all(),
        remote.at(0),
        iters,
        0,
    ))
    .map_err(e("post compare_swap"))?;
    wait(&cq, 1)?;

    local.buffer().write(0, b"done");
    ep.post_send(&SendWr::send(
        u64::MAX - 1,
        &[local.slice(0..4).map_err(e("slice"))?],
    ))
    .map_err(e("post_send"))?;
    wait(&cq, u64::MAX - 1)?;
    print_rows(&rows);
    println!("client: every transfer verified (send contents at the server, read-back of writes, fetch_add sequence 0..{iters}, compare_swap reset)");
    Ok(())
}
