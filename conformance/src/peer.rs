//! The other end of multi-process cases: a separate process started from the `fabric`
//! binary (`fabric peer ...`), and the handle the case holds on it.
//!
//! The peer listens, prints `LISTEN <addr>` on stdout, accepts one connection, registers a
//! 1 MiB region with every remote access right (byte `i` holds `pattern(i)`), sends its
//! remote descriptor as the first message, then either
//! * `--mode echo`: answers every message `echo:<bytes>` with `<bytes>`; on `quit` it exits
//!   once its stdin closes ([`PeerProcess::wait_exit`] closes it), so that it is still there
//!   when the sender's `quit` completes: over iWARP that completion waits for a delivery
//!   read the peer answers, and a peer gone first fails it `Flushed`, as the contract says
//!   of operations outstanding when the peer closes;
//! * `--mode idle`: never touches its completion queue again (one-sided operations must
//!   complete without it) and exits when its stdin closes;
//! * `--mode writer`: receives a remote descriptor (the first message), then keeps
//!   [`WRITER_DEPTH`] RDMA Writes of [`WRITER_CHUNK`] bytes of its region (`pattern`) in
//!   flight into it, chunk after chunk, until one fails; it reports on stdout `WRITING`
//!   after the first write completed, `ERROR <kind> after <n> writes` at the first failure
//!   (`<kind>` as [`ErrorKind::as_str`]), then `DONE flushed <f> other <o>` once the writes
//!   still outstanding completed, and exits when its stdin closes
//!   ([`PeerProcess::line`] reads these lines).
//!
//! `--recv N` sets how many receives it keeps posted (0: none, so sends to it wait).

use fabric::sync::mpsc;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fabric::prelude::*;
use fabric::Selector;

use crate::harness::{next, region, Ctx};

/// Bytes per RDMA Write of `--mode writer`.
pub const WRITER_CHUNK: usize = 64 << 10;

/// RDMA Writes `--mode writer` keeps in flight.
pub const WRITER_DEPTH: usize = 8;

/// Size of the peer's exposed region.
pub const PEER_REGION: usize = 1 << 20;

/// The byte the peer's region holds at `i` before anyone writes.
pub fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(7).wrapping_add(3) % 251) as u8
}

/// A running peer process and our connection to it.
#[derive(Debug)]
pub struct PeerProcess {
    child: Child,
    /// Our domain.
    pub domain: AnyDomain,
    /// Our completion queue.
    pub cq: AnyCq,
    /// Our endpoint, connected to the peer.
    pub ep: AnyEndpoint,
    /// The peer's region.
    pub desc: RemoteDesc,
    /// Process id of the peer.
    pub pid: u32,
    lines: mpsc::Receiver<String>,
}

/// Starts `fabric SUBCOMMAND --provider <target> --bind <address> ARGS` (the executable of
/// `ctx`, else `FABRIC_PEER_EXE`) with piped stdin and stdout; its stdout lines arrive on the
/// receiver.
pub(crate) fn spawn(
    ctx: &Ctx,
    subcommand: &str,
    args: &[&str],
) -> Result<(Child, mpsc::Receiver<String>), String> {
    let exe = ctx
        .peer_exe
        .clone()
        .or_else(|| std::env::var_os("FABRIC_PEER_EXE").map(Into::into))
        .ok_or(
            "multi-process case needs the fabric executable (FABRIC_PEER_EXE) to start its peer",
        )?;
    let mut child = Command::new(&exe)
        .arg(subcommand)
        .args(["--provider", &ctx.target, "--bind", &ctx.bind.to_string()])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting {} {subcommand}: {e}", exe.display()))?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok((child, rx))
}

impl PeerProcess {
    /// Starts `fabric peer` with `args` and connects to it.
    pub fn start(ctx: &Ctx, args: &[&str]) -> Result<Self, String> {
        let (mut child, rx) = spawn(ctx, "peer", args)?;
        let pid = child.id();
        let line = rx.recv_timeout(ctx.timeout).map_err(|_| {
            let _ = child.kill();
            "peer did not report its address".to_string()
        })?;
        let addr: SocketAddr = line
            .strip_prefix("LISTEN ")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("peer said {line:?}, expected LISTEN <addr>"))?;
        let connect = || -> Result<(AnyDomain, AnyCq, AnyEndpoint, RemoteDesc), String> {
            let domain = ctx.domain()?;
            let cq = domain.create_cq(256).map_err(|e| e.to_string())?;
            let ep = domain
                .connect(addr, &EndpointConfig::new(&cq))
                .map_err(|e| format!("connect to peer: {e}"))?;
            let mr = region(&domain, 64, Access::LOCAL_WRITE)?;
            ep.post_recv(&RecvWr::new(0, &[mr.all()]))
                .map_err(|e| e.to_string())?;
            let c = next(&cq, ctx.timeout)?;
            if !c.is_ok() {
                return Err(format!("receiving the peer's descriptor: {c:?}"));
            }
            let desc = RemoteDesc::from_bytes(&mr.buffer().to_vec(0, c.byte_len as usize))
                .map_err(|e| e.to_string())?;
            Ok((domain, cq, ep, desc))
        };
        match connect() {
            Ok((domain, cq, ep, desc)) => Ok(PeerProcess {
                child,
                domain,
                cq,
                ep,
                desc,
                pid,
                lines: rx,
            }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Kills the peer with SIGKILL.
    pub fn kill(&mut self) -> Result<(), String> {
        self.child.kill().map_err(|e| format!("kill peer: {e}"))?;
        self.child.wait().map_err(|e| format!("reap peer: {e}"))?;
        Ok(())
    }

    /// Closes the peer's stdin, then waits for it to exit and returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<i32, String> {
        // An echo peer told `quit` exits once its stdin closes (see the module docs).
        self.close_stdin();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Ok(s.code().unwrap_or(-1));
            }
            if std::time::Instant::now() >= deadline {
                return Err(format!("peer did not exit within {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The next line the peer printed on its stdout after `LISTEN` (`--mode writer`
    /// reports there), waiting at most `timeout`.
    pub fn line(&self, timeout: Duration) -> Result<String, String> {
        self.lines.recv_timeout(timeout).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => {
                format!("the peer printed nothing within {timeout:?}")
            }
            mpsc::RecvTimeoutError::Disconnected => "the peer closed its stdout".to_string(),
        })
    }

    /// Closes the peer's stdin (an idle peer exits).
    pub fn close_stdin(&mut self) {
        drop(self.child.stdin.take());
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// The peer process: `fabric peer --provider P [--bind ADDR] [--mode echo|idle|writer]
/// [--recv N]`.
/// Returns the exit code.
pub fn main(args: &[String]) -> i32 {
    match serve(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("fabric peer: {e}");
            1
        }
    }
}

fn serve(args: &[String]) -> Result<(), String> {
    let provider = arg(args, "--provider").ok_or("--provider is required")?;
    let bind = arg(args, "--bind").unwrap_or("127.0.0.1");
    let mode = arg(args, "--mode").unwrap_or("echo");
    let recvs: usize = arg(args, "--recv")
        .unwrap_or("16")
        .parse()
        .map_err(|e| format!("--recv: {e}"))?;
    if !matches!(mode, "echo" | "idle" | "writer") {
        return Err(format!("unknown --mode {mode:?} (echo, idle, writer)"));
    }
    let (domain, _) = Selector::new()
        .providers(provider)
        .and_then(|s| s.open())
        .map_err(|e| e.to_string())?;
    let cq = domain.create_cq(1024).map_err(|e| e.to_string())?;
    let listener = domain
        .listen(SocketAddr::new(
            bind.parse().map_err(|e| format!("--bind: {e}"))?,
            0,
        ))
        .map_err(|e| e.to_string())?;
    println!("LISTEN {}", listener.local_addr());
    let ep = listener
        .accept(&EndpointConfig::new(&cq), Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let exposed = region(&domain, PEER_REGION, Access::all())?;
    for i in 0..PEER_REGION {
        exposed.buffer().write(i, &[pattern(i)]);
    }
    let msgs = region(&domain, 4096 * recvs.max(1), Access::LOCAL_WRITE)?;
    for i in 0..recvs {
        ep.post_recv(&RecvWr::new(
            i as u64,
            &[msgs
                .slice(i * 4096..(i + 1) * 4096)
                .map_err(|e| e.to_string())?],
        ))
        .map_err(|e| e.to_string())?;
    }
    let desc = region(&domain, RemoteDesc::ENCODED_LEN, Access::LOCAL_WRITE)?;
    desc.buffer().write(0, &exposed.desc().to_bytes());
    ep.post_send(&SendWr::send(u64::MAX, &[desc.all()]))
        .map_err(|e| e.to_string())?;
    if mode == "writer" {
        write_until_error(&ep, &cq, &exposed, &msgs, recvs)?;
    }
    if mode == "idle" || mode == "writer" {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        return Ok(());
    }
    let reply = region(&domain, 4096, Access::LOCAL_WRITE)?;
    loop {
        let c = next(&cq, Duration::from_secs(120))?;
        if c.context == u64::MAX || c.opcode == Opcode::Send {
            continue;
        }
        if !c.is_ok() {
            return Err(format!("peer saw {c:?}"));
        }
        let i = c.context as usize;
        let msg = msgs.buffer().to_vec(i * 4096, c.byte_len as usize);
        if msg == b"quit" {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
            return Ok(());
        }
        if let Some(body) = msg.strip_prefix(b"echo:") {
            reply.buffer().write(0, body);
            ep.post_send(&SendWr::send(
                u64::MAX - 1,
                &[reply.slice(0..body.len()).map_err(|e| e.to_string())?],
            ))
            .map_err(|e| e.to_string())?;
        }
        ep.post_recv(&RecvWr::new(
            i as u64,
            &[msgs
                .slice(i * 4096..(i + 1) * 4096)
                .map_err(|e| e.to_string())?],
        ))
        .map_err(|e| e.to_string())?;
    }
}

/// `--mode writer`: takes the target's descriptor from the first message, then writes into
/// it until a write fails, reporting on stdout (see the module docs).
fn write_until_error(
    ep: &AnyEndpoint,
    cq: &AnyCq,
    exposed: &MemoryRegion,
    msgs: &MemoryRegion,
    recvs: usize,
) -> Result<(), String> {
    if recvs == 0 {
        return Err(
            "--mode writer needs --recv 1 or more (the descriptor arrives as a message)".into(),
        );
    }
    let target = loop {
        let c = next(cq, Duration::from_secs(60))?;
        if c.context == u64::MAX {
            continue; // our own descriptor's send
        }
        if !c.is_ok() {
            return Err(format!("receiving the target's descriptor: {c:?}"));
        }
        let i = c.context as usize;
        break RemoteDesc::from_bytes(&msgs.buffer().to_vec(i * 4096, c.byte_len as usize))
            .map_err(|e| format!("the target's descriptor: {e}"))?;
    };
    let chunks = (target.len as usize / WRITER_CHUNK).max(1);
    let len = WRITER_CHUNK.min(target.len as usize);
    const BASE: u64 = 1 << 32;
    let src = [exposed.slice(0..len).map_err(|e| e.to_string())?];
    let post = |n: u64| {
        let at = target.at(((n as usize % chunks) * WRITER_CHUNK) as u64);
        ep.post_send(&SendWr::write(BASE + n, &src, at))
    };
    let (mut posted, mut ok) = (0u64, 0u64);
    while posted < WRITER_DEPTH as u64 {
        post(posted).map_err(|e| format!("post write {posted}: {e}"))?;
        posted += 1;
    }
    let kind = loop {
        let c = next(cq, Duration::from_secs(60))?;
        if c.context < BASE {
            continue; // a receive of ours, flushed once the connection fails
        }
        match c.status {
            Status::Success => {
                ok += 1;
                if ok == 1 {
                    println!("WRITING");
                }
                match post(posted) {
                    Ok(()) => posted += 1,
                    // The connection failed after this completion: the failure is in the
                    // queue or the post says why.
                    Err(e) if e.kind() == ErrorKind::InvalidState => {}
                    Err(e) => return Err(format!("post write {posted}: {e}")),
                }
            }
            Status::Error(kind) => break kind,
        }
    };
    println!("ERROR {} after {ok} writes", kind.as_str());
    let (mut flushed, mut other) = (0u64, 0u64);
    let outstanding = posted - ok - 1;
    while flushed + other < outstanding {
        let c = next(cq, Duration::from_secs(10))?;
        if c.context < BASE {
            continue;
        }
        match c.status {
            Status::Error(ErrorKind::Flushed) => flushed += 1,
            _ => other += 1,
        }
    }
    println!("DONE flushed {flushed} other {other}");
    Ok(())
}
