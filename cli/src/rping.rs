//! `fabric rping`: rdma-core's rping protocol, so this framework's providers can be checked
//! against rdma-core's own `rping` (for example the tcp provider against the kernel's siw).
//!
//! The protocol (librdmacm/examples/rping.c): the client sends a 16-byte advertisement
//! `{be64 addr, be32 rkey, be32 size}` of its source buffer; the server RDMA-reads it, sends
//! a "go ahead", receives the advertisement of the client's sink buffer, RDMA-writes the
//! data (up to its NUL terminator) there, and sends another "go ahead"; the client checks
//! sink against source. Each ping exercises send/receive both ways, RDMA Read and RDMA Write.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use fabric::prelude::*;

const INFO_LEN: usize = 16;
const WAIT: Duration = Duration::from_secs(30);

/// Arguments of `fabric rping`.
#[derive(Debug, Args)]
pub(crate) struct RpingArgs {
    /// Provider spec (overrides FABRIC_PROVIDER), e.g. `tcp`.
    #[arg(long)]
    provider: Option<String>,
    /// Run the server side, listening on this address (rping -s -a ADDR -p PORT).
    #[arg(long, conflicts_with = "connect")]
    listen: Option<SocketAddr>,
    /// Run the client side against this server (rping -c -a ADDR -p PORT).
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Pings (client), or pings to serve before exiting (server; 0: until the client leaves).
    #[arg(long, default_value_t = 10)]
    count: u32,
    /// Ping data size in bytes (client).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(24..=(1 << 20)))]
    size: u32,
    /// Print each ping's data.
    #[arg(long)]
    verbose: bool,
}

struct Info {
    addr: u64,
    key: u32,
    len: u32,
}

impl Info {
    fn encode(&self) -> [u8; INFO_LEN] {
        let mut b = [0u8; INFO_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..12].copy_from_slice(&self.key.to_be_bytes());
        b[12..].copy_from_slice(&self.len.to_be_bytes());
        b
    }
    fn decode(b: &[u8]) -> Result<Self, String> {
        if b.len() != INFO_LEN {
            return Err(format!(
                "peer sent a {}-byte advertisement, rping's is {INFO_LEN}",
                b.len()
            ));
        }
        Ok(Info {
            addr: u64::from_be_bytes(b[..8].try_into().expect("8")),
            key: u32::from_be_bytes(b[8..12].try_into().expect("4")),
            len: u32::from_be_bytes(b[12..].try_into().expect("4")),
        })
    }
}

/// One connected side: its queue, endpoint and the 16-byte message buffers.
struct Side {
    cq: AnyCq,
    ep: AnyEndpoint,
    recv: MemoryRegion,
    send: MemoryRegion,
    /// Completions that arrived while waiting for another kind: a peer may answer a send
    /// before that send's own completion is reported (siw queues Read Responses, which the
    /// tcp provider's send completion waits for against a foreign peer, behind its Sends).
    early: RefCell<Vec<Completion>>,
}

impl Side {
    fn post_recv(&self) -> Result<(), String> {
        self.ep
            .post_recv(&RecvWr::new(0, &[self.recv.all()]))
            .map_err(|e| format!("post_recv: {e}"))
    }

    /// Waits for the next completion of `opcode`, failing on any error completion.
    fn wait(&self, opcode: Opcode) -> Result<Completion, String> {
        let stashed = self.early.borrow().iter().position(|c| c.opcode == opcode);
        if let Some(i) = stashed {
            return Ok(self.early.borrow_mut().remove(i));
        }
        let deadline = Instant::now() + WAIT;
        let mut out = Vec::with_capacity(4);
        loop {
            out.clear();
            if self.cq.poll(&mut out, 1).map_err(|e| e.to_string())? == 1 {
                let c = out.pop().expect("one");
                if c.status != Status::Success {
                    return Err(format!("{:?} completed {}", c.opcode, c.status));
                }
                if c.opcode == opcode {
                    return Ok(c);
                }
                self.early.borrow_mut().push(c);
                continue;
            }
            if Instant::now() > deadline {
                return Err(format!("no {opcode:?} completion within {WAIT:?}"));
            }
            self.cq
                .wait(Duration::from_millis(200))
                .map_err(|e| e.to_string())?;
        }
    }

    /// Receives an advertisement and re-posts the receive.
    fn recv_info(&self) -> Result<Info, String> {
        let c = self.wait(Opcode::Recv)?;
        let info = Info::decode(&self.recv.buffer().to_vec(0, c.byte_len as usize))?;
        self.post_recv()?;
        Ok(info)
    }

    fn send_info(&self, info: &Info) -> Result<(), String> {
        self.send.buffer().write(0, &info.encode());
        self.ep
            .post_send(&SendWr::send(1, &[self.send.all()]))
            .map_err(|e| format!("post_send: {e}"))?;
        self.wait(Opcode::Send).map(|_| ())
    }
}

fn side(domain: &AnyDomain, cq: AnyCq, ep: AnyEndpoint) -> Result<Side, String> {
    let reg = |access| {
        domain
            .alloc(INFO_LEN, access)
            .map_err(|e| format!("register: {e}"))
    };
    let s = Side {
        recv: reg(Access::LOCAL_WRITE)?,
        send: reg(Access::empty())?,
        cq,
        ep,
        early: RefCell::new(Vec::new()),
    };
    s.post_recv()?;
    Ok(s)
}

pub(crate) fn run(args: RpingArgs) -> Result<ExitCode, String> {
    let (domain, report) = crate::selector(args.provider.as_deref())?
        .open()
        .map_err(|e| e.to_string())?;
    eprintln!("rping on {} (device {})", report.provider, report.device);
    let cq = domain.create_cq(64).map_err(|e| e.to_string())?;
    match (args.listen, args.connect) {
        (Some(addr), None) => {
            let listener = domain.listen(addr).map_err(|e| format!("listen: {e}"))?;
            println!("rping server listening on {}", listener.local_addr());
            let ep = listener
                .accept(&EndpointConfig::new(&cq), Duration::from_secs(120))
                .map_err(|e| format!("accept: {e}"))?;
            server(&domain, side(&domain, cq, ep)?, &args)
        }
        (None, Some(addr)) => {
            let ep = domain
                .connect(addr, &EndpointConfig::new(&cq))
                .map_err(|e| format!("connect: {e}"))?;
            client(&domain, side(&domain, cq, ep)?, &args)
        }
        _ => Err("give --listen ADDR (server) or --connect ADDR (client)".into()),
    }
}

fn server(domain: &AnyDomain, s: Side, args: &RpingArgs) -> Result<ExitCode, String> {
    let buf = domain
        .alloc(
            1 << 20,
            Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .map_err(|e| e.to_string())?;
    let mut served = 0;
    while args.count == 0 || served < args.count {
        let source = match s.recv_info() {
            Ok(i) => i,
            Err(e) if served > 0 && e.contains("Flushed") => break, // the client left
            Err(e) => return Err(e),
        };
        if source.len as usize > buf.len() {
            return Err(format!(
                "client advertises {} bytes, more than this server's {}",
                source.len,
                buf.len()
            ));
        }
        let sink = [buf
            .slice(0..source.len as usize)
            .map_err(|e| e.to_string())?];
        s.ep.post_send(&SendWr::read(
            2,
            &sink,
            RemoteAddr {
                addr: source.addr,
                key: source.key,
            },
        ))
        .map_err(|e| format!("post read: {e}"))?;
        s.wait(Opcode::Read)?;
        let data = buf.buffer().to_vec(0, source.len as usize);
        let text_len = data
            .iter()
            .position(|&b| b == 0)
            .map_or(data.len(), |n| n + 1);
        if args.verbose {
            println!(
                "server ping data: {}",
                String::from_utf8_lossy(&data[..text_len.saturating_sub(1)])
            );
        }
        s.send_info(&Info {
            addr: buf.buffer().addr(),
            key: buf.desc().key,
            len: source.len,
        })?;
        let dest = s.recv_info()?;
        let src = [buf
            .slice(0..text_len.min(dest.len as usize))
            .map_err(|e| e.to_string())?];
        s.ep.post_send(&SendWr::write(
            3,
            &src,
            RemoteAddr {
                addr: dest.addr,
                key: dest.key,
            },
        ))
        .map_err(|e| format!("post write: {e}"))?;
        s.wait(Opcode::Write)?;
        let go_ahead = Info {
            addr: buf.buffer().addr(),
            key: buf.desc().key,
            len: source.len,
        };
        match s.send_info(&go_ahead) {
            Ok(()) => {}
            // rping's client disconnects as soon as the last "go ahead" lands, possibly
            // before a foreign peer answered the Read that confirms delivery: the ping is done.
            Err(e) if e.contains("Flushed") && served + 1 == args.count => {
                served += 1;
                break;
            }
            Err(e) => return Err(e),
        }
        served += 1;
    }
    println!(
        "rping server: {served} pings served (RDMA read from and write to the client each time)"
    );
    // As rping's own server: the client ends the session. Closing first races the client's
    // last receive against its disconnect event (rping's client reports the disconnect as
    // an error if it comes first), so wait for the client to go, within a bound.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while s.ep.state() == fabric::prelude::EndpointState::Connected
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok(ExitCode::SUCCESS)
}

fn client(domain: &AnyDomain, s: Side, args: &RpingArgs) -> Result<ExitCode, String> {
    let size = args.size as usize;
    let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let start = domain.alloc(size, access).map_err(|e| e.to_string())?;
    let sink = domain.alloc(size, access).map_err(|e| e.to_string())?;
    let mut first = b'A';
    for ping in 0..args.count {
        // rping's payload: "rdma-ping-N: " then rotating letters, NUL-terminated.
        let mut data = format!("rdma-ping-{ping}: ").into_bytes();
        let mut c = first;
        while data.len() < size - 1 {
            data.push(c);
            c = if c >= b'z' { b'A' } else { c + 1 };
        }
        data.push(0);
        first = if first >= b'z' { b'A' } else { first + 1 };
        start.buffer().write(0, &data);
        sink.buffer().fill(0, size, 0);
        s.send_info(&Info {
            addr: start.buffer().addr(),
            key: start.desc().key,
            len: size as u32,
        })?;
        s.recv_info()?; // the server read our source
        s.send_info(&Info {
            addr: sink.buffer().addr(),
            key: sink.desc().key,
            len: size as u32,
        })?;
        s.recv_info()?; // the server wrote our sink
        let got = sink.buffer().to_vec(0, size);
        if got != data {
            return Err(format!(
                "ping {ping}: data differs: sent {:?}, got back {:?}",
                String::from_utf8_lossy(&data),
                String::from_utf8_lossy(&got)
            ));
        }
        if args.verbose {
            println!("ping data: {}", String::from_utf8_lossy(&data[..size - 1]));
        }
    }
    println!(
        "rping client: {} pings of {size} bytes verified",
        args.count
    );
    s.ep.close().map_err(|e| e.to_string())?;
    Ok(ExitCode::SUCCESS)
}
