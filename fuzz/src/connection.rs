//! The whole-connection harness: a hostile peer's bytes into a listening tcp-provider
//! endpoint, through the provider's public API only (`fabric_tcp`, `fabric_api`).
//!
//! One [`Harness`] per process: a domain, a completion queue, a listener on 127.0.0.1 and
//! a fixed set of memory slots (registered regions with various access rights, a
//! deregistered one, receive buffers, and unregistered canary buffers). Each input:
//!
//! 1. a raw `TcpStream` connects and (modes 0-2) completes a valid MPA handshake, or
//!    (mode 3) sends the input itself as its MPA request and everything after it;
//! 2. the input's bytes follow: built from `arbitrary` operations (modes 0, 1), or sent
//!    as they are (modes 2, 3) after the key and address placeholders of
//!    [`crate::stream`] are substituted (and, with CRC, each complete FPDU's CRC fixed);
//! 3. the peer half-closes its stream and reads whatever the target answers until the
//!    target ends the connection, within a bounded time (a hang is a crash);
//! 4. every slot is compared with the pattern it was filled with: a byte may have changed
//!    only inside a receive buffer posted for this connection, or where an RDMA Write or
//!    Atomic Request of the stream named a region whose key and access allow it (computed
//!    independently from the sent bytes, [`crate::stream::placements`]). Bytes of
//!    read-only, local-only and deregistered regions and of the canaries never change.
//!
//! The first input byte configures the connection: bits 0-1 the mode, bit 2 offer this
//! framework's extensions (atomics, immediate data, acks), bit 3 ask for CRC, bit 4 MPA
//! revision 1 instead of 2, bit 5 post no receives.
//!
//! Threads and file descriptors are counted every 256 inputs: a leak is a crash too.

use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use fabric_api::spi::{CompletionQueue, Domain, Endpoint, EndpointConfig, Listener};
use fabric_api::{Access, Buffer, EndpointState, MemoryRegion, RecvWr, Status};
use fabric_tcp::wire::ddp::{opcode, qn, AtomicRequest, AtomicResponse, Header, ReadRequest};
use fabric_tcp::wire::mpa::{self, Enhanced, MpaFrame, RtrKinds, Setup};
use fabric_tcp::{TcpCq, TcpDomain, TcpEndpoint, TcpListener, TcpOptions};

use crate::stream::{self, Placement};

/// What a slot is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A registered region, remotely accessible as its access says.
    Region,
    /// A region registered, then deregistered: its key is dead.
    Dead,
    /// A receive buffer (LOCAL_WRITE only), posted for each connection unless told not to.
    Recv,
    /// Never registered.
    Canary,
}

/// One piece of memory the harness watches.
#[derive(Debug)]
struct Slot {
    kind: Kind,
    buffer: Arc<Buffer>,
    /// Kept registered for the harness's life (`None` for dead regions and canaries).
    mr: Option<MemoryRegion>,
    access: Access,
    key: u32,
    fill: u8,
}

/// The slots: (kind, length, access).
const SLOTS: [(Kind, usize, Access); 10] = [
    (
        Kind::Region,
        64,
        Access::LOCAL_WRITE.union(Access::REMOTE_WRITE),
    ),
    (Kind::Region, 64, Access::REMOTE_READ),
    (
        Kind::Region,
        64,
        Access::LOCAL_WRITE.union(Access::REMOTE_ATOMIC),
    ),
    (
        Kind::Region,
        128,
        Access::LOCAL_WRITE
            .union(Access::REMOTE_WRITE)
            .union(Access::REMOTE_READ)
            .union(Access::REMOTE_ATOMIC),
    ),
    (Kind::Region, 64, Access::LOCAL_WRITE),
    (
        Kind::Dead,
        64,
        Access::LOCAL_WRITE
            .union(Access::REMOTE_WRITE)
            .union(Access::REMOTE_READ)
            .union(Access::REMOTE_ATOMIC),
    ),
    (Kind::Recv, 32, Access::LOCAL_WRITE),
    (Kind::Recv, 32, Access::LOCAL_WRITE),
    (Kind::Canary, 64, Access::empty()),
    (Kind::Canary, 64, Access::empty()),
];

/// Longest wait for one connection (handshake, input, the target's end): a hang past it
/// is reported as a crash. `FABRIC_FUZZ_DEADLINE_MS` overrides it.
const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);

/// Thread and descriptor counts above which the process is leaking.
const MAX_THREADS: usize = 256;
const MAX_FDS: usize = 512;

/// The per-process state of the connection target.
#[derive(Debug)]
pub struct Harness {
    // Field order is drop order: the listener before its domain.
    listener: TcpListener,
    cq: TcpCq,
    _domain: TcpDomain,
    addr: SocketAddr,
    slots: Vec<Slot>,
    deadline: Duration,
    inputs: u64,
}

/// One operation of a structured input (modes 0 and 1), encoded with the wire encoders.
/// MSNs and MOs are right unless the operation says otherwise.
#[derive(Debug, Arbitrary)]
enum Op {
    /// RDMA Write segment of `len` bytes of `fill`.
    Write {
        at: Target,
        len: u8,
        fill: u8,
        last: bool,
    },
    /// RDMA Read Request for `size` bytes at `src`.
    ReadRequest {
        sink_stag: u32,
        sink_to: u64,
        src: Target,
        size: u16,
    },
    /// A Send (variant 0-3: Send, with Invalidate, with SE, both; 4: Send with Immediate)
    /// in segments of the given lengths.
    Send {
        variant: u8,
        ulp: u32,
        segments: Vec<u8>,
        fill: u8,
    },
    /// Immediate Data after a Write.
    Immediate { imm: u32 },
    /// Atomic Request (op 0 fetch-add, 1 compare-swap, others refused).
    Atomic {
        at: Target,
        op: u32,
        req_id: u32,
        add_swap: u64,
        compare: u64,
        masks: Option<(u64, u64)>,
    },
    /// An Atomic Response nobody asked for.
    AtomicResponse { req_id: u32, original: u64 },
    /// A Read Response nobody asked for.
    ReadResponse {
        stag: u32,
        to: u64,
        len: u8,
        last: bool,
    },
    /// Delivery Ack.
    Ack { ulp: u32 },
    /// Terminate with a control word and whatever follows it.
    Terminate { control: [u8; 4], tail: Vec<u8> },
    /// Any well-framed header (wrong MSNs, queues, opcodes) with a payload of `len` bytes.
    Any { header: AnyHeader, len: u8 },
    /// Bytes spliced into the stream as they are (framing errors).
    Raw(Vec<u8>),
    /// The next FPDU's CRC is wrong (when CRC is in use).
    CorruptCrc,
}

/// A region and an offset from its first byte.
#[derive(Debug, Arbitrary)]
struct Target {
    slot: u8,
    offset: i8,
}

/// A DDP header with every field chosen by the input.
#[derive(Debug, Arbitrary)]
struct AnyHeader {
    tagged: bool,
    last: bool,
    opcode: u8,
    stag_or_ulp: u32,
    to: u64,
    qn: u8,
    msn: u32,
    mo: u32,
}

/// Encodes structured operations as a peer's stream.
struct Builder<'a> {
    slots: &'a [(u32, u64)],
    crc: bool,
    corrupt_next: bool,
    msn: [u32; 5],
    out: Vec<u8>,
}

impl Builder<'_> {
    /// Slot numbers past the real slots name keys nobody registered.
    fn key(&self, slot: u8) -> u32 {
        let i = usize::from(slot) % (self.slots.len() + 2);
        self.slots.get(i).map_or(0x0101_0101 * (i as u32), |s| s.0)
    }

    /// The address `t.offset` bytes from the first byte of slot `t.slot` (the slots past
    /// the real ones alias the first two).
    fn addr(&self, t: &Target) -> u64 {
        let i = usize::from(t.slot) % (self.slots.len() + 2) % self.slots.len();
        self.slots[i].1.wrapping_add_signed(i64::from(t.offset))
    }

    fn push(&mut self, h: Header, payload: &[u8]) {
        let mut f = stream::fpdu(&h, payload, self.crc);
        if std::mem::take(&mut self.corrupt_next) {
            let n = f.len();
            f[n - 1] ^= 0x5a;
        }
        self.out.extend_from_slice(&f);
    }

    /// An untagged message on queue `q`, with the queue's next MSN, in one segment.
    fn untagged(&mut self, op: u8, ulp: u32, q: u32, payload: &[u8]) {
        let msn = self.next_msn(q);
        self.push(
            Header::Untagged {
                last: true,
                opcode: op,
                ulp,
                qn: q,
                msn,
                mo: 0,
            },
            payload,
        );
    }

    fn next_msn(&mut self, q: u32) -> u32 {
        let m = &mut self.msn[q as usize];
        *m = m.wrapping_add(1);
        *m
    }

    fn op(&mut self, op: Op) {
        match op {
            Op::Write {
                at,
                len,
                fill,
                last,
            } => {
                let h = Header::Tagged {
                    last,
                    opcode: opcode::WRITE,
                    stag: self.key(at.slot),
                    to: self.addr(&at),
                };
                self.push(h, &vec![fill; usize::from(len)]);
            }
            Op::ReadRequest {
                sink_stag,
                sink_to,
                src,
                size,
            } => {
                let r = ReadRequest {
                    sink_stag,
                    sink_to,
                    size: u32::from(size),
                    src_stag: self.key(src.slot),
                    src_to: self.addr(&src),
                };
                self.untagged(opcode::READ_REQUEST, 0, qn::READ, &r.encode());
            }
            Op::Send {
                variant,
                ulp,
                segments,
                fill,
            } => {
                let op = match variant % 5 {
                    4 => opcode::SEND_IMM,
                    v => opcode::SEND + v,
                };
                let msn = self.next_msn(qn::SEND);
                let n = segments.len().clamp(1, 8);
                let mut mo = 0u32;
                for i in 0..n {
                    let len = segments.get(i).copied().unwrap_or(0);
                    let h = Header::Untagged {
                        last: i + 1 == n,
                        opcode: op,
                        ulp,
                        qn: qn::SEND,
                        msn,
                        mo,
                    };
                    self.push(h, &vec![fill; usize::from(len)]);
                    mo += u32::from(len);
                }
            }
            Op::Immediate { imm } => {
                let mut p = [0u8; 8];
                p[..4].copy_from_slice(&imm.to_be_bytes());
                self.untagged(opcode::IMMEDIATE, 0, qn::SEND, &p);
            }
            Op::Atomic {
                at,
                op,
                req_id,
                add_swap,
                compare,
                masks,
            } => {
                let (add_swap_mask, compare_mask) = masks.unwrap_or((!0, !0));
                let a = AtomicRequest {
                    op,
                    req_id,
                    stag: self.key(at.slot),
                    to: self.addr(&at),
                    add_swap,
                    add_swap_mask,
                    compare,
                    compare_mask,
                };
                self.untagged(opcode::ATOMIC_REQUEST, 0, qn::ATOMIC, &a.encode());
            }
            Op::AtomicResponse { req_id, original } => {
                let a = AtomicResponse { req_id, original };
                self.untagged(opcode::ATOMIC_RESPONSE, 0, qn::ATOMIC, &a.encode());
            }
            Op::ReadResponse {
                stag,
                to,
                len,
                last,
            } => {
                let h = Header::Tagged {
                    last,
                    opcode: opcode::READ_RESPONSE,
                    stag,
                    to,
                };
                self.push(h, &vec![0xee; usize::from(len)]);
            }
            Op::Ack { ulp } => self.untagged(opcode::ACK, ulp, qn::ACK, &[]),
            Op::Terminate { control, mut tail } => {
                tail.truncate(64);
                let mut p = control.to_vec();
                p.extend_from_slice(&tail);
                self.untagged(opcode::TERMINATE, 0, qn::TERMINATE, &p);
            }
            Op::Any { header: a, len } => {
                let h = if a.tagged {
                    Header::Tagged {
                        last: a.last,
                        opcode: a.opcode,
                        stag: self.key((a.stag_or_ulp & 0xf) as u8),
                        to: a.to,
                    }
                } else {
                    Header::Untagged {
                        last: a.last,
                        opcode: a.opcode,
                        ulp: a.stag_or_ulp,
                        qn: u32::from(a.qn % 8),
                        msn: a.msn,
                        mo: a.mo,
                    }
                };
                self.push(h, &vec![0x77; usize::from(len)]);
            }
            Op::Raw(mut b) => {
                b.truncate(64);
                self.out.extend_from_slice(&b);
            }
            Op::CorruptCrc => self.corrupt_next = self.crc,
        }
    }
}

/// The input's first byte.
#[derive(Debug, Clone, Copy)]
struct Config {
    mode: u8,
    ext: bool,
    crc: bool,
    revision: u8,
    receives: bool,
}

impl Config {
    fn of(b: u8) -> Config {
        Config {
            mode: b & 3,
            ext: b & 4 != 0,
            crc: b & 8 != 0,
            revision: if b & 16 != 0 { 1 } else { 2 },
            receives: b & 32 == 0,
        }
    }
}

/// A valid MPA request from a raw peer, as a foreign iWARP peer or (with `ext`) one of this
/// framework would send it.
pub fn request(revision: u8, crc: bool, ext: bool) -> Vec<u8> {
    let setup = Setup {
        enhanced: (revision >= 2).then_some(Enhanced {
            ird: 8,
            ord: 8,
            peer_to_peer: false,
            rtr: RtrKinds::default(),
        }),
        ext: None,
        user: b"fuzz".to_vec(),
    };
    MpaFrame {
        reply: false,
        markers: false,
        crc,
        reject: false,
        enhanced: revision >= 2,
        ext_offer: ext,
        revision,
        private_data: setup.encode(),
    }
    .encode()
}

impl Harness {
    /// Opens the domain, the listener and the slots.
    pub fn new() -> Harness {
        ignore_sigpipe();
        let domain = TcpDomain::open(TcpOptions::default()).expect("tcp domain");
        let cq = domain.create_cq(1024).expect("completion queue");
        let listener = domain
            .listen("127.0.0.1:0".parse().expect("address"))
            .expect("listener");
        let addr = listener.local_addr();
        let slots = SLOTS
            .iter()
            .enumerate()
            .map(|(i, &(kind, len, access))| {
                let buffer = Arc::new(Buffer::new(len));
                let (mr, key) = match kind {
                    Kind::Canary => (None, 0xc0de_0000 | i as u32),
                    _ => {
                        let mr = domain.register(buffer.clone(), access).expect("register");
                        let key = mr.desc().key;
                        if kind == Kind::Dead {
                            mr.deregister();
                            (None, key)
                        } else {
                            (Some(mr), key)
                        }
                    }
                };
                Slot {
                    kind,
                    buffer,
                    mr,
                    access,
                    key,
                    fill: 0xa0 + i as u8,
                }
            })
            .collect();
        let deadline = std::env::var("FABRIC_FUZZ_DEADLINE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(DEFAULT_DEADLINE, Duration::from_millis);
        Harness {
            listener,
            cq,
            _domain: domain,
            addr,
            slots,
            deadline,
            inputs: 0,
        }
    }

    /// (key, address) of every slot, in slot order: what placeholders stand for.
    fn keys(&self) -> Vec<(u32, u64)> {
        self.slots
            .iter()
            .map(|s| (s.key, s.buffer.addr()))
            .collect()
    }

    /// Runs one input; panics on a crash, a hang, a leak or memory changed where no
    /// message of the peer could change it.
    pub fn run(&mut self, data: &[u8]) {
        let Some((&first, rest)) = data.split_first() else {
            return;
        };
        self.inputs += 1;
        if self.inputs.is_multiple_of(256) {
            check_leaks();
        }
        let cfg = Config::of(first);
        for s in &self.slots {
            s.buffer.fill(0, s.buffer.len(), s.fill);
        }
        let deadline = Instant::now() + self.deadline;
        let (stream, receives_posted) = match cfg.mode {
            0 | 1 => {
                let mut u = Unstructured::new(rest);
                let mut b = Builder {
                    slots: &self.keys(),
                    crc: cfg.crc,
                    corrupt_next: false,
                    msn: [0; 5],
                    out: Vec::new(),
                };
                for op in u.arbitrary_iter::<Op>().expect("iterator").take(64) {
                    match op {
                        Ok(op) => b.op(op),
                        Err(_) => break,
                    }
                }
                let bytes = b.out;
                (bytes.clone(), self.after_handshake(cfg, &bytes, deadline))
            }
            2 => {
                let mut bytes = rest.to_vec();
                stream::substitute(&mut bytes, &self.keys());
                if cfg.crc {
                    stream::fix_crcs(&mut bytes, 0);
                }
                (bytes.clone(), self.after_handshake(cfg, &bytes, deadline))
            }
            _ => {
                let mut bytes = rest.to_vec();
                stream::substitute(&mut bytes, &self.keys());
                let at = stream::after_request(&bytes);
                // The request's C bit decides whether CRC is in use (this target does
                // not ask for it).
                if bytes.get(16).is_some_and(|b| b & 0x40 != 0) {
                    stream::fix_crcs(&mut bytes, at);
                }
                let posted = self.whole_stream(&bytes, deadline);
                (bytes.split_off(at.min(bytes.len())), posted)
            }
        };
        self.check_memory(&stream::placements(&stream, 0), receives_posted);
        self.drain_cq();
    }

    /// Modes 0-2: a valid handshake, then `bytes`. Returns whether receives were posted.
    fn after_handshake(&self, cfg: Config, bytes: &[u8], deadline: Instant) -> bool {
        let mut peer = connect(self.addr, deadline);
        peer.write_all(&request(cfg.revision, cfg.crc, cfg.ext))
            .expect("send MPA request");
        let ep = self.accept(deadline);
        let reply = read_reply(&mut peer);
        assert!(!reply.reject, "valid request rejected: {reply:?}");
        if cfg.receives {
            self.post_receives(&ep);
        }
        send_and_wait(&mut peer, bytes, &ep, deadline);
        cfg.receives
    }

    /// Mode 3: `bytes` from the first byte of the MPA request on. A sentinel connection
    /// with a valid request follows, so the listener's accept returns whether the hostile
    /// request failed or not.
    fn whole_stream(&self, bytes: &[u8], deadline: Instant) -> bool {
        let mut peer = connect(self.addr, deadline);
        let _ = peer.write_all(bytes);
        let _ = peer.shutdown(Shutdown::Write);
        let mut sentinel = connect(self.addr, deadline);
        sentinel
            .write_all(&request(2, false, false))
            .expect("send MPA request");
        let ep = self.accept(deadline);
        let hostile = ep.peer_addr() == peer.local_addr().expect("local address");
        let ep = if hostile {
            // The hostile request succeeded: accept the sentinel too, then watch the
            // hostile connection end.
            let sentinel_ep = self.accept(deadline);
            read_reply(&mut sentinel);
            drop(sentinel_ep);
            Some(ep)
        } else {
            read_reply(&mut sentinel);
            drop(ep);
            None
        };
        drop(sentinel);
        // Whatever the target answered (a reply, a reject, FPDUs), until it closes.
        drain_until_closed(&mut peer, deadline);
        if let Some(ep) = ep {
            wait_not_connected(&ep, deadline);
        }
        false
    }

    fn accept(&self, deadline: Instant) -> TcpEndpoint {
        let mut cfg = EndpointConfig::new(&self.cq);
        cfg.timeout = self.deadline;
        cfg.sq_depth = 64;
        cfg.rq_depth = 64;
        let left = deadline.saturating_duration_since(Instant::now());
        self.listener
            .accept(&cfg, left)
            .unwrap_or_else(|e| panic!("accept failed or hung: {e}"))
    }

    fn post_receives(&self, ep: &TcpEndpoint) {
        let mut recv = self.slots.iter().filter(|s| s.kind == Kind::Recv);
        let a = recv
            .next()
            .and_then(|s| s.mr.as_ref())
            .expect("receive slot");
        let b = recv
            .next()
            .and_then(|s| s.mr.as_ref())
            .expect("receive slot");
        ep.post_recv(&RecvWr::new(1, &[a.all()]))
            .expect("post receive");
        let half = b.len() / 2;
        let sgl = [
            b.slice(..half).expect("slice"),
            b.slice(half..).expect("slice"),
        ];
        ep.post_recv(&RecvWr::new(2, &sgl)).expect("post receive");
    }

    /// Completions of this input: only the two receives can complete, within their length.
    fn drain_cq(&self) {
        let mut out = Vec::new();
        while self.cq.poll(&mut out, 64).expect("poll") > 0 {}
        for c in out {
            assert!(
                matches!(c.context, 1 | 2),
                "completion for a request never posted: {c:?}"
            );
            if c.status == Status::Success {
                assert!(c.byte_len <= 32, "receive longer than its buffer: {c:?}");
            }
        }
    }

    fn check_memory(&self, placements: &[Placement], receives_posted: bool) {
        let mut bytes = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            bytes.resize(s.buffer.len(), 0);
            s.buffer.read(0, &mut bytes);
            if s.kind == Kind::Recv && receives_posted {
                continue;
            }
            let base = s.buffer.addr();
            for (off, &b) in bytes.iter().enumerate() {
                if b == s.fill {
                    continue;
                }
                let a = base + off as u64;
                let allowed = s.kind == Kind::Region
                    && placements.iter().any(|p| {
                        let right = if p.atomic {
                            Access::REMOTE_ATOMIC
                        } else {
                            Access::REMOTE_WRITE
                        };
                        p.stag == s.key && s.access.contains(right) && p.to <= a && a - p.to < p.len
                    });
                assert!(
                    allowed,
                    "slot {i} ({:?}, {:?}, {} bytes): byte {off} changed from {:#04x} to \
                     {b:#04x}, and no message of the peer could write it; placements: \
                     {placements:x?}",
                    s.kind,
                    s.access,
                    s.buffer.len(),
                    s.fill
                );
            }
        }
    }
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}

fn connect(addr: SocketAddr, deadline: Instant) -> TcpStream {
    let left = deadline.saturating_duration_since(Instant::now());
    let s = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
        .expect("connect to the listener");
    s.set_nodelay(true).expect("nodelay");
    // Abort on close: no TIME_WAIT, so thousands of connections a second do not use up
    // the ephemeral ports.
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .expect("linger");
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .expect("read timeout");
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .expect("write timeout");
    s
}

fn read_reply(peer: &mut TcpStream) -> MpaFrame {
    let mut h = [0u8; mpa::HEADER_LEN];
    peer.read_exact(&mut h).expect("MPA reply header");
    let (mut rep, pd_len) = MpaFrame::decode_header(&h, true).expect("MPA reply");
    rep.private_data = vec![0; pd_len];
    peer.read_exact(&mut rep.private_data)
        .expect("MPA reply private data");
    rep
}

/// Sends the input, half-closes, and reads until the target closes its end.
fn send_and_wait(peer: &mut TcpStream, bytes: &[u8], ep: &TcpEndpoint, deadline: Instant) {
    match peer.write_all(bytes) {
        Ok(()) => {}
        // The target ended the connection part-way (a Terminate): fine.
        Err(e) if matches!(e.kind(), IoKind::BrokenPipe | IoKind::ConnectionReset) => {}
        Err(e) => panic!("sending the input: {e} (the target stopped reading?)"),
    }
    let _ = peer.shutdown(Shutdown::Write);
    drain_until_closed(peer, deadline);
    wait_not_connected(ep, deadline);
}

fn drain_until_closed(peer: &mut TcpStream, deadline: Instant) {
    let mut buf = [0u8; 16384];
    loop {
        match peer.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => {
                assert!(
                    Instant::now() < deadline,
                    "hang: the target did not end the connection after the peer's end of stream"
                );
            }
            Err(e) if e.kind() == IoKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn wait_not_connected(ep: &TcpEndpoint, deadline: Instant) {
    while ep.state() == EndpointState::Connected {
        assert!(
            Instant::now() < deadline,
            "hang: the endpoint is still connected after its stream ended"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

/// Threads and descriptors of finished connections must go away.
fn check_leaks() {
    let settle = Instant::now() + Duration::from_secs(5);
    loop {
        let (t, f) = (count("/proc/self/task"), count("/proc/self/fd"));
        if t <= MAX_THREADS && f <= MAX_FDS {
            return;
        }
        assert!(
            Instant::now() < settle,
            "leak: {t} threads, {f} file descriptors after finished connections"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A Rust program's runtime ignores SIGPIPE before `main`; libFuzzer's C++ `main` does not,
/// so a write to a socket the peer reset would kill the fuzzer instead of returning EPIPE.
fn ignore_sigpipe() {
    // SAFETY: `signal` with `SIG_IGN` installs no handler code; it only changes the
    // disposition of SIGPIPE, as the Rust runtime does at start-up.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// The placeholder slots, for seeds: slot numbers of a writable region, a read-only one, an
/// atomic one, one with every right, a local-only one, a deregistered one.
pub mod slot {
    /// LOCAL_WRITE | REMOTE_WRITE, 64 bytes.
    pub const WRITABLE: u16 = 0;
    /// REMOTE_READ, 64 bytes.
    pub const READABLE: u16 = 1;
    /// LOCAL_WRITE | REMOTE_ATOMIC, 64 bytes.
    pub const ATOMIC: u16 = 2;
    /// Every right, 128 bytes.
    pub const ALL: u16 = 3;
    /// LOCAL_WRITE only.
    pub const LOCAL: u16 = 4;
    /// Deregistered.
    pub const DEAD: u16 = 5;
    /// A receive buffer.
    pub const RECV: u16 = 6;
    /// An unregistered canary buffer.
    pub const CANARY: u16 = 8;
}

/// Config byte bits (the input's first byte).
pub mod config {
    /// Mode 2: the rest of the input is the stream after a valid handshake.
    pub const RAW: u8 = 2;
    /// Mode 3: the rest of the input is the whole stream, MPA request first.
    pub const WHOLE: u8 = 3;
    /// Offer this framework's extensions.
    pub const EXT: u8 = 4;
    /// Ask for CRC.
    pub const CRC: u8 = 8;
    /// MPA revision 1.
    pub const REV1: u8 = 16;
    /// Post no receives.
    pub const NO_RECEIVES: u8 = 32;
}
