//! A hostile peer against the tcp provider, in raw bytes (issue 9, item 5).
//!
//! Every test attacks one connection of a listening domain and then proves three things
//! (docs/contract.md sections 2, 6 and 8):
//! * canaries: registered regions around the target (and the target's own bytes outside the
//!   addressed range) keep their known patterns: nothing outside the target changed;
//! * the attacked connection ends with an error naming the fault: a Terminate read back
//!   with the expected layer / error type / code, and the provider's endpoint in `Error`
//!   (handshake attacks: the connection is refused or closed, never accepted);
//! * the process keeps serving: a well-behaved connection opened before the attack, and a
//!   new one accepted after it, both complete a send / receive and an RDMA Write.
//!
//! Every wait is bounded (socket timeouts, deadlines) and fails with a message saying what
//! did not happen.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_api::spi::{CompletionQueue, Domain, Endpoint, EndpointConfig, Listener};
use fabric_api::{
    Access, Buffer, Completion, EndpointState, ErrorKind, MemoryRegion, RecvWr, SendWr, Status,
};
use fabric_tcp::wire::ddp::{
    atomic_op, opcode, qn, term, AtomicRequest, AtomicResponse, Header, ReadRequest, Terminate,
};
use fabric_tcp::wire::mpa::{self, Enhanced, MpaFrame, RtrKinds, Setup};
use fabric_tcp::{TcpCq, TcpDomain, TcpEndpoint, TcpListener, TcpOptions};

/// Socket timeouts of the raw peer: a provider that never answers fails the test here.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline for completions and state changes.
const DEADLINE: Duration = Duration::from_secs(10);
/// The provider's documented bound on buffered unexpected bytes per endpoint (README:
/// "Receiver not ready", 8 MiB).
const UNEXPECTED_LIMIT: u64 = 8 << 20;

const ALL_ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

// ----- the provider side ----------------------------------------------------------------

struct Server {
    domain: TcpDomain,
    cq: TcpCq,
    listener: TcpListener,
}

fn server() -> Server {
    let domain = TcpDomain::open(TcpOptions::default()).unwrap();
    let cq = domain.create_cq(1024).unwrap();
    let listener = domain.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    Server {
        domain,
        cq,
        listener,
    }
}

impl Server {
    fn addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }
    fn accept(&self, timeout: Duration) -> fabric_api::Result<TcpEndpoint> {
        self.listener
            .accept(&EndpointConfig::new(&self.cq), timeout)
    }
}

fn wait_state(ep: &TcpEndpoint, want: EndpointState, why: &str) {
    let deadline = Instant::now() + DEADLINE;
    while ep.state() != want {
        assert!(
            Instant::now() < deadline,
            "{why}: the provider's endpoint is {:?}, expected {want:?} within {DEADLINE:?}",
            ep.state()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn completion(cq: &TcpCq, what: &str) -> Completion {
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    loop {
        cq.poll(&mut out, 1).unwrap();
        if let Some(c) = out.pop() {
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "no completion for {what} within {DEADLINE:?}"
        );
        cq.wait(Duration::from_millis(100)).unwrap();
    }
}

// ----- canaries ---------------------------------------------------------------------------

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(u32::from(seed)) as u8 | 1)
        .collect()
}

/// A target region between two guard regions, all filled with known patterns. The
/// guards grant every access, so a lookup that slid into a neighbour would be allowed.
struct Canaries {
    lo: MemoryRegion,
    target: MemoryRegion,
    hi: MemoryRegion,
}

fn canaries(domain: &TcpDomain, len: usize, access: Access) -> Canaries {
    let reg = |seed: u8, len: usize, access: Access| {
        domain
            .register(Arc::new(Buffer::from_slice(&pattern(seed, len))), access)
            .unwrap()
    };
    let lo = reg(0x11, 4096, ALL_ACCESS);
    let target = reg(0x5a, len, access);
    let hi = reg(0x77, 4096, ALL_ACCESS);
    Canaries { lo, target, hi }
}

impl Canaries {
    fn base(&self) -> u64 {
        self.target.desc().addr
    }
    fn key(&self) -> u32 {
        self.target.desc().key
    }
    fn len(&self) -> usize {
        self.target.len()
    }
    /// Checks every canary byte; `may_change` (offsets into the target) is what the attack
    /// addressed inside the region, whose bytes are unspecified after a failed operation.
    fn check(&self, may_change: Range<usize>) {
        for (name, r, seed) in [
            ("low guard", &self.lo, 0x11),
            ("high guard", &self.hi, 0x77),
        ] {
            let want = pattern(seed, r.len());
            let got = r.buffer().to_vec(0, r.len());
            if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                panic!(
                    "{name} region changed at offset {i}: {:#x}, expected {:#x}",
                    got[i], want[i]
                );
            }
        }
        let want = pattern(0x5a, self.len());
        let got = self.target.buffer().to_vec(0, self.len());
        if let Some(i) = (0..want.len()).find(|&i| !may_change.contains(&i) && got[i] != want[i]) {
            panic!(
                "target region changed at offset {i} outside the addressed range {may_change:?}: {:#x}, expected {:#x}",
                got[i], want[i]
            );
        }
    }
}

// ----- a well-behaved connection on the same domain ----------------------------------------

/// A fabric client connected to the server's listener: it must keep working whatever a
/// hostile peer does to another connection of the same domain.
struct Healthy {
    _client: TcpDomain,
    ccq: TcpCq,
    cep: TcpEndpoint,
    scq: TcpCq,
    sep: TcpEndpoint,
    sbuf: MemoryRegion,
    cbuf: MemoryRegion,
}

fn try_healthy(srv: &Server, accept_for: Duration) -> Result<Healthy, String> {
    let client = TcpDomain::open(TcpOptions::default()).unwrap();
    let ccq = client.create_cq(64).unwrap();
    let scq = srv.domain.create_cq(64).unwrap();
    let addr = srv.addr();
    let (cep, sep) = std::thread::scope(|s| {
        let c = s.spawn(|| client.connect(addr, &EndpointConfig::new(&ccq)));
        let sep = srv.listener.accept(&EndpointConfig::new(&scq), accept_for);
        (c.join().unwrap(), sep)
    });
    let cep = cep.map_err(|e| format!("a well-behaved client could not connect: {e}"))?;
    let sep = sep.map_err(|e| format!("the listener did not accept a well-behaved client: {e}"))?;
    let sbuf = srv
        .domain
        .register(
            Arc::new(Buffer::new(4096)),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let cbuf = client
        .register(Arc::new(Buffer::new(4096)), Access::LOCAL_WRITE)
        .unwrap();
    Ok(Healthy {
        _client: client,
        ccq,
        cep,
        scq,
        sep,
        sbuf,
        cbuf,
    })
}

fn healthy(srv: &Server) -> Healthy {
    try_healthy(srv, DEADLINE).unwrap_or_else(|e| panic!("{e}"))
}

impl Healthy {
    /// A send / receive and an RDMA Write, both checked byte for byte.
    fn exercise(&self, round: u8) {
        assert_eq!(
            (self.cep.state(), self.sep.state()),
            (EndpointState::Connected, EndpointState::Connected),
            "the well-behaved connection was disturbed by the attack on another one"
        );
        self.cbuf.buffer().fill(0, 64, round);
        self.sep
            .post_recv(&RecvWr::new(1, &[self.sbuf.slice(0..64).unwrap()]))
            .unwrap();
        self.cep
            .post_send(&SendWr::send(2, &[self.cbuf.slice(0..64).unwrap()]))
            .unwrap();
        let r = completion(&self.scq, "the well-behaved receive");
        assert_eq!((r.context, r.status, r.byte_len), (1, Status::Success, 64));
        let s = completion(&self.ccq, "the well-behaved send");
        assert_eq!((s.context, s.status), (2, Status::Success));
        assert_eq!(self.sbuf.buffer().to_vec(0, 64), vec![round; 64]);

        self.cbuf.buffer().fill(64, 64, !round);
        self.cep
            .post_send(&SendWr::write(
                3,
                &[self.cbuf.slice(64..128).unwrap()],
                self.sbuf.desc().at(1024),
            ))
            .unwrap();
        let w = completion(&self.ccq, "the well-behaved RDMA Write");
        assert_eq!((w.context, w.status), (3, Status::Success));
        assert_eq!(self.sbuf.buffer().to_vec(1024, 64), vec![!round; 64]);
    }
}

/// After an attack: the connection opened before it still works, and the listener still
/// accepts and serves a new one.
fn still_serving(srv: &Server, before: &Healthy) {
    before.exercise(0xa1);
    healthy(srv).exercise(0xb2);
}

// ----- the raw peer ---------------------------------------------------------------------

#[derive(Debug, Clone, Copy, Default)]
struct RawOpts {
    /// Ask for MPA CRC.
    crc: bool,
    /// Offer this framework's extensions (X bit), as its own initiators do.
    ext: bool,
    /// SO_RCVBUF of the raw socket (small: the provider's output backs up early).
    rcvbuf: Option<usize>,
    /// SO_SNDBUF of the raw socket.
    sndbuf: Option<usize>,
}

/// A raw peer after a completed handshake.
struct Raw {
    s: TcpStream,
    crc: bool,
    /// The IRD the provider advertised in its MPA Reply.
    ird: u16,
    features: u8,
}

fn tcp_connect(addr: SocketAddr, o: RawOpts) -> io::Result<TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    if let Some(n) = o.rcvbuf {
        sock.set_recv_buffer_size(n)?;
    }
    if let Some(n) = o.sndbuf {
        sock.set_send_buffer_size(n)?;
    }
    sock.connect_timeout(&addr.into(), Duration::from_secs(5))?;
    let s: TcpStream = sock.into();
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(s)
}

/// The MPA Request this framework's initiators send (revision 2, enhanced, IRD/ORD; the X
/// bit when offering extensions; the request never carries the extension block).
fn mpa_request(o: RawOpts) -> Vec<u8> {
    MpaFrame {
        reply: false,
        markers: false,
        crc: o.crc,
        reject: false,
        enhanced: true,
        ext_offer: o.ext,
        revision: 2,
        private_data: Setup {
            enhanced: Some(Enhanced {
                ird: 8,
                ord: 8,
                peer_to_peer: false,
                rtr: RtrKinds::default(),
            }),
            ext: None,
            user: b"hostile".to_vec(),
        }
        .encode(),
    }
    .encode()
}

fn raw_handshake(addr: SocketAddr, o: RawOpts) -> Raw {
    let mut s = tcp_connect(addr, o).unwrap();
    s.write_all(&mpa_request(o)).unwrap();
    let mut h = [0u8; mpa::HEADER_LEN];
    s.read_exact(&mut h)
        .expect("no MPA Reply from the provider");
    let (mut rep, pd_len) = MpaFrame::decode_header(&h, true).unwrap();
    rep.private_data = vec![0; pd_len];
    s.read_exact(&mut rep.private_data).unwrap();
    assert!(!rep.reject, "the provider rejected a good request");
    assert_eq!(rep.crc, o.crc, "CRC asked for must be used");
    let setup = Setup::of(&rep).unwrap();
    let ird = setup.enhanced.expect("an enhanced reply with IRD/ORD").ird;
    let features = setup.ext.map_or(0, |x| x.features);
    assert_eq!(
        features != 0,
        o.ext,
        "the extension block answers the X bit, and only it"
    );
    Raw {
        s,
        crc: rep.crc,
        ird,
        features,
    }
}

/// A raw peer connected and accepted: the provider's endpoint and the raw stream.
fn attach(srv: &Server, o: RawOpts) -> (TcpEndpoint, Raw) {
    let addr = srv.addr();
    std::thread::scope(|s| {
        let raw = s.spawn(move || raw_handshake(addr, o));
        let ep = srv
            .accept(DEADLINE)
            .expect("the provider did not accept the raw peer's good request");
        (ep, raw.join().unwrap())
    })
}

/// Encodes one FPDU: length, header, payload, pad, CRC (zero unless `crc`).
fn fpdu(h: Header, payload: &[u8], crc: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(h.len() + payload.len() + 8);
    out.extend_from_slice(&((h.len() + payload.len()) as u16).to_be_bytes());
    h.encode_into(&mut out);
    out.extend_from_slice(payload);
    out.resize(out.len() + mpa::pad_len(h.len() + payload.len()), 0);
    let c = if crc { crc32c::crc32c(&out) } else { 0 };
    out.extend_from_slice(&mpa::crc_bytes(c));
    out
}

fn untagged(op: u8, q: u32, msn: u32, mo: u32, last: bool) -> Header {
    Header::Untagged {
        last,
        opcode: op,
        ulp: 0,
        qn: q,
        msn,
        mo,
    }
}

fn send_hdr(msn: u32, mo: u32, last: bool) -> Header {
    untagged(opcode::SEND, qn::SEND, msn, mo, last)
}

fn write_hdr(stag: u32, to: u64, last: bool) -> Header {
    Header::Tagged {
        last,
        opcode: opcode::WRITE,
        stag,
        to,
    }
}

fn read_req(msn: u32, size: u32, stag: u32, to: u64) -> Vec<u8> {
    let rr = ReadRequest {
        sink_stag: 0x5151,
        sink_to: 0,
        size,
        src_stag: stag,
        src_to: to,
    };
    fpdu(
        untagged(opcode::READ_REQUEST, qn::READ, msn, 0, true),
        &rr.encode(),
        false,
    )
}

fn atomic_req(msn: u32, op: u32, stag: u32, to: u64, add: u64) -> Vec<u8> {
    let a = AtomicRequest {
        op,
        req_id: msn,
        stag,
        to,
        add_swap: add,
        add_swap_mask: !0,
        compare: 0,
        compare_mask: !0,
    };
    fpdu(
        untagged(opcode::ATOMIC_REQUEST, qn::ATOMIC, msn, 0, true),
        &a.encode(),
        false,
    )
}

impl Raw {
    fn send_bytes(&mut self, b: &[u8]) {
        self.s
            .write_all(b)
            .expect("the provider stopped reading a short attack");
    }
    fn send(&mut self, h: Header, payload: &[u8]) {
        let b = fpdu(h, payload, self.crc);
        self.send_bytes(&b);
    }

    /// Reads one FPDU (checking its CRC when negotiated); `Ok(None)` at the end of the
    /// stream.
    fn read(&mut self) -> io::Result<Option<(Header, Vec<u8>)>> {
        let mut len = [0u8; 2];
        match self.s.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let ulpdu = usize::from(u16::from_be_bytes(len));
        let mut body = vec![0u8; ulpdu + mpa::trailer_len(ulpdu)];
        self.s.read_exact(&mut body)?;
        if self.crc {
            let mut all = len.to_vec();
            all.extend_from_slice(&body[..body.len() - 4]);
            assert_eq!(
                mpa::crc_bytes(crc32c::crc32c(&all)),
                body[body.len() - 4..],
                "the provider's FPDU has a bad CRC"
            );
        }
        let h = Header::decode(&body[..ulpdu])
            .unwrap_or_else(|e| panic!("the provider sent a malformed FPDU: {e}"));
        Ok(Some((h, body[h.len()..ulpdu].to_vec())))
    }

    /// Reads up to the provider's Terminate (skipping delivery acks only), checks it is
    /// one of `want`, then checks the stream ends right after it.
    fn expect_terminate(&mut self, want: &[Terminate], what: &str) -> Terminate {
        let t = loop {
            match self.read() {
                Ok(Some((
                    Header::Untagged {
                        opcode: opcode::TERMINATE,
                        qn: q,
                        ..
                    },
                    payload,
                ))) => {
                    assert_eq!(q, qn::TERMINATE, "{what}: Terminate on queue {q}");
                    break Terminate::decode(&payload).unwrap();
                }
                Ok(Some((
                    Header::Untagged {
                        opcode: opcode::ACK,
                        ..
                    },
                    _,
                ))) => continue,
                Ok(Some((h, _))) => panic!("{what}: expected a Terminate, got {h:?}"),
                Ok(None) => panic!("{what}: the provider closed the stream without a Terminate"),
                Err(e) => panic!("{what}: no Terminate from the provider: {e}"),
            }
        };
        assert!(
            want.contains(&t),
            "{what}: the Terminate names {t:?}, expected one of {want:?}"
        );
        self.expect_end(what);
        t
    }

    /// The provider ends the stream (FIN or reset) and sends nothing more.
    fn expect_end(&mut self, what: &str) {
        let mut rest = Vec::new();
        match self.s.read_to_end(&mut rest) {
            Ok(_) => assert!(
                rest.is_empty(),
                "{what}: {} bytes after the Terminate",
                rest.len()
            ),
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("{what}: the provider did not end the stream: {e}"),
        }
    }
}

/// One attack on a fresh raw connection: `bytes` after the handshake, then a Terminate
/// from `want`, the provider's endpoint in `Error`, canaries intact.
fn attack(srv: &Server, o: RawOpts, bytes: &[u8], want: &[Terminate], what: &str) -> Raw {
    let (ep, mut raw) = attach(srv, o);
    raw.send_bytes(bytes);
    raw.expect_terminate(want, what);
    wait_state(&ep, EndpointState::Error, what);
    raw
}

fn rdmap(etype: u8, ecode: u8) -> Terminate {
    Terminate {
        layer: 0,
        etype,
        ecode,
    }
}
fn ddp(etype: u8, ecode: u8) -> Terminate {
    Terminate {
        layer: 1,
        etype,
        ecode,
    }
}
fn llp(ecode: u8) -> Terminate {
    Terminate {
        layer: 2,
        etype: 0,
        ecode,
    }
}

/// The protection errors: RDMAP (RFC 5040, layer 0) or DDP tagged buffer (RFC 5041,
/// layer 1) naming the same fault.
fn protection(code: u8) -> Vec<Terminate> {
    vec![rdmap(1, code), ddp(1, code)]
}

fn proc_value(path: &str, field: usize) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().nth(field)?.parse().ok())
        .unwrap_or(64 << 20)
}

// ----- MPA handshake --------------------------------------------------------------------

/// What a refused handshake looked like to the raw peer.
#[derive(Debug)]
enum Refusal {
    /// The provider closed (or reset) the connection without a reply.
    Closed,
    /// An MPA Reply with the reject bit, and its reason.
    Rejected(String),
}

/// Sends `bytes` as a connection request; the provider must refuse it (close, or reject
/// with a reason), accept nothing, and keep serving.
fn refused_handshake(srv: &Server, bytes: &[u8], what: &str) -> Refusal {
    let addr = srv.addr();
    std::thread::scope(|s| {
        let raw = s.spawn(move || {
            let mut c = tcp_connect(addr, RawOpts::default()).unwrap();
            // The provider may close before it has read everything: not a failure.
            let _ = c.write_all(bytes);
            let _ = c.shutdown(std::net::Shutdown::Write);
            let mut got = Vec::new();
            match c.read_to_end(&mut got) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
                Err(e) => {
                    panic!("{what}: the provider neither refused nor closed the request: {e}")
                }
            }
            got
        });
        match srv.accept(Duration::from_millis(1500)) {
            Ok(_) => panic!("{what}: the provider accepted a bad connection request"),
            Err(e) => assert_eq!(e.kind(), ErrorKind::TimedOut, "{what}: {e}"),
        }
        let got = raw.join().unwrap();
        if got.is_empty() {
            return Refusal::Closed;
        }
        assert!(
            got.len() >= mpa::HEADER_LEN,
            "{what}: {} stray bytes instead of an MPA Reply",
            got.len()
        );
        let (rep, pd_len) =
            MpaFrame::decode_header(got[..mpa::HEADER_LEN].try_into().unwrap(), true)
                .unwrap_or_else(|e| panic!("{what}: the answer is no MPA Reply: {e}"));
        assert!(
            rep.reject,
            "{what}: the provider answered with a non-reject reply"
        );
        let reason = got[mpa::HEADER_LEN..]
            .get(..pd_len)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default();
        Refusal::Rejected(reason)
    })
}

fn header(key: &[u8; 16], bits: u16, pd_len: u16) -> Vec<u8> {
    let mut h = key.to_vec();
    h.extend_from_slice(&bits.to_be_bytes());
    h.extend_from_slice(&pd_len.to_be_bytes());
    h
}

#[test]
fn mpa_bad_key_is_refused() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let mut req = mpa_request(RawOpts::default());
    req[..16].copy_from_slice(mpa::KEY_REP); // a Reply's key in a request
    refused_handshake(&srv, &req, "request with the Reply key");
    let mut req = mpa_request(RawOpts::default());
    req[..16].copy_from_slice(b"GET / HTTP/1.1\r\n");
    refused_handshake(&srv, &req, "request with a foreign key");
    c.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn mpa_bad_revision_is_refused() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    // Revision 0 does not exist.
    let mut req = mpa_request(RawOpts::default());
    req[17] = 0;
    refused_handshake(&srv, &req, "revision 0");
    // Revision 2 with the E bit but no room for IRD/ORD: rejected, naming the field.
    let mut req = header(mpa::KEY_REQ, 0x1002, 2);
    req.extend_from_slice(&[0, 8]);
    if let Refusal::Rejected(why) = refused_handshake(&srv, &req, "revision 2 without IRD/ORD") {
        assert!(why.contains("IRD"), "the reject names no reason: {why:?}");
    }
    c.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn mpa_oversized_private_data_is_refused() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    // 65535 bytes announced (and sent): far beyond MPA's 256-byte private data.
    let mut req = header(mpa::KEY_REQ, 0x1002, u16::MAX);
    req.extend_from_slice(&[0x42; u16::MAX as usize]);
    refused_handshake(&srv, &req, "65535 bytes of private data");
    // Just over the limit.
    let mut req = header(mpa::KEY_REQ, 0x1002, 257);
    req.extend_from_slice(&[0, 8, 0, 8]);
    req.extend_from_slice(&[0x42; 253]);
    refused_handshake(&srv, &req, "257 bytes of private data");
    c.check(0..0);
    still_serving(&srv, &before);
}

/// True while the provider keeps `s` open and silent (no bytes, no end).
fn still_open(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let open = matches!((&*s).read(&mut b), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    open
}

#[test]
fn unfinished_handshakes_do_not_stall_the_listener() {
    let srv = server();
    let addr = srv.addr();
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let o = RawOpts::default();
    let req = mpa_request(o);
    // Connects and says nothing.
    let silent = tcp_connect(addr, o).unwrap();
    // Half an MPA header.
    let mut half = tcp_connect(addr, o).unwrap();
    half.write_all(&req[..10]).unwrap();
    // A whole header announcing 200 bytes of private data, then 20 of them.
    let mut short = tcp_connect(addr, o).unwrap();
    let mut h = header(mpa::KEY_REQ, 0x1002, 200);
    h.extend_from_slice(&[0, 8, 0, 8]);
    h.extend_from_slice(&[0x42; 16]);
    short.write_all(&h).unwrap();
    // A good client is accepted and served while all three hang.
    let good = healthy(&srv);
    for (name, s) in [
        ("silent", &silent),
        ("half header", &half),
        ("short", &short),
    ] {
        assert!(
            still_open(s),
            "the {name} client was closed before a good client behind it was accepted: the listener waited on it"
        );
    }
    good.exercise(1);
    // Time and memory in a handshake are bounded: each is closed eventually.
    for (name, mut s) in [("silent", silent), ("half header", half), ("short", short)] {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut got = Vec::new();
        match s.read_to_end(&mut got) {
            Ok(_) => assert!(
                got.is_empty() || got.len() >= mpa::HEADER_LEN && got[16] & 0x20 != 0,
                "the {name} client got {} bytes that are no MPA reject",
                got.len()
            ),
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("the {name} client's half-open connection was never closed: {e}"),
        }
    }
    c.check(0..0);
    healthy(&srv).exercise(2);
}

#[test]
fn connection_flood_does_not_lock_out_a_good_client() {
    let srv = server();
    let addr = srv.addr();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let flood = |n: usize| -> Vec<TcpStream> {
        (0..n)
            .filter_map(|_| tcp_connect(addr, RawOpts::default()).ok())
            .collect()
    };
    // A hundred connections that never handshake: a good client gets in at once.
    let mut held = flood(100);
    assert!(held.len() >= 90, "only {} flood connections", held.len());
    healthy(&srv).exercise(1);
    // Hundreds more (beyond any sane half-open bound): a good client still gets through,
    // retrying while the provider sheds the flood.
    held.extend(flood(400));
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = String::new();
    let mut tries = 0;
    let late = loop {
        assert!(
            Instant::now() < deadline,
            "a good client never got through a flood of {} silent connections ({tries} tries; last: {last})",
            held.len()
        );
        tries += 1;
        match try_healthy(&srv, Duration::from_secs(2)) {
            Ok(h) => break h,
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    late.exercise(2);
    c.check(0..0);
    before.exercise(3);
    drop(held);
}

// ----- framing --------------------------------------------------------------------------

#[test]
fn truncated_fpdu_is_an_error() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, Access::LOCAL_WRITE);
    let (ep, mut raw) = attach(&srv, RawOpts::default());
    ep.post_recv(&RecvWr::new(7, &[c.target.slice(1024..2048).unwrap()]))
        .unwrap();
    // The length says 1000 payload bytes; 100 arrive, then the peer closes its side.
    let full = fpdu(send_hdr(1, 0, true), &[0xee; 1000], false);
    raw.send_bytes(&full[..2 + 18 + 100]);
    raw.s.shutdown(std::net::Shutdown::Write).unwrap();
    raw.expect_terminate(&[llp(0x01), llp(0x03)], "truncated FPDU");
    wait_state(&ep, EndpointState::Error, "truncated FPDU");
    let r = completion(&srv.cq, "the receive the truncated message was placed into");
    assert_eq!(
        (r.context, r.status),
        (7, Status::Error(ErrorKind::Flushed))
    );
    c.check(1024..2048);
    still_serving(&srv, &before);
}

#[test]
fn oversized_ulpdu_lengths_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let big = vec![0xee; 65_000];
    // A Read Request is 28 bytes; this one's ULPDU is 65018.
    attack(
        &srv,
        RawOpts::default(),
        &fpdu(
            untagged(opcode::READ_REQUEST, qn::READ, 1, 0, true),
            &big,
            false,
        ),
        &[llp(0x03), rdmap(2, 0xff), ddp(2, 0x05)],
        "a 65000-byte Read Request",
    );
    // A Terminate of 65000 bytes from the peer is a Terminate (its control field counts),
    // not a reason to buffer: nothing to read back, but the endpoint fails.
    {
        let (ep, mut raw) = attach(&srv, RawOpts::default());
        let mut t = term::REMOTE_OPERATION.encode().to_vec();
        t.resize(65_000, 0xee);
        raw.send(untagged(opcode::TERMINATE, qn::TERMINATE, 1, 0, true), &t);
        wait_state(&ep, EndpointState::Error, "a 65000-byte Terminate");
    }
    // A 65500-byte Send segment into a 1 KiB receive: "message too long".
    {
        let (ep, mut raw) = attach(&srv, RawOpts::default());
        ep.post_recv(&RecvWr::new(9, &[c.target.slice(1024..2048).unwrap()]))
            .unwrap();
        raw.send(send_hdr(1, 0, true), &vec![0xee; 65_500]);
        raw.expect_terminate(&[term::MSG_TOO_LONG], "a 65500-byte Send into 1 KiB");
        wait_state(&ep, EndpointState::Error, "a 65500-byte Send");
        let r = completion(&srv.cq, "the receive the Send overran");
        assert_eq!(
            (r.context, r.status),
            (9, Status::Error(ErrorKind::LocalLength))
        );
    }
    // A 65500-byte Write segment into a 4 KiB region.
    attack(
        &srv,
        RawOpts::default(),
        &fpdu(
            write_hdr(c.key(), c.base(), true),
            &vec![0xee; 65_500],
            false,
        ),
        &protection(0x01),
        "a 65500-byte Write into 4 KiB",
    );
    c.check(1024..2048);
    still_serving(&srv, &before);
}

/// Writes `next()` until the provider stops taking bytes (no progress for `stall`), a cap,
/// or `stop`; returns the bytes accepted.
fn write_until_blocked(
    s: &TcpStream,
    stall: Duration,
    cap: u64,
    stop: &AtomicBool,
    mut next: impl FnMut() -> Vec<u8>,
) -> u64 {
    s.set_write_timeout(Some(stall)).unwrap();
    let mut total = 0u64;
    let mut pending: Vec<u8> = Vec::new();
    let mut at = 0;
    while total < cap && !stop.load(Ordering::Relaxed) {
        if at == pending.len() {
            pending = next();
            at = 0;
        }
        match (&*s).write(&pending[at..]) {
            Ok(0) => break,
            Ok(n) => {
                at += n;
                total += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break, // blocked for `stall`, or the provider ended the stream
        }
    }
    total
}

/// Socket-buffer allowance for a bound measured by a blocked writer: the provider's
/// receive buffer can grow to tcp_rmem's maximum, ours is what we set (doubled by the
/// kernel), plus the provider's 64 KiB read buffer and a margin.
fn socket_allowance(sndbuf: usize) -> u64 {
    proc_value("/proc/sys/net/ipv4/tcp_rmem", 2) + 2 * sndbuf as u64 + (2 << 20)
}

#[test]
fn endless_send_without_receive_is_back_pressured() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 1 << 20, Access::LOCAL_WRITE);
    let sndbuf = 256 << 10;
    let (ep, raw) = attach(
        &srv,
        RawOpts {
            sndbuf: Some(sndbuf),
            ..RawOpts::default()
        },
    );
    let bound = UNEXPECTED_LIMIT + socket_allowance(sndbuf);
    let stop = AtomicBool::new(false);
    let accepted = AtomicU64::new(0);
    let seg = 65_000u32;
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut mo = 0u32;
            let payload = vec![0xee; seg as usize];
            let mut next = || {
                let b = fpdu(send_hdr(1, mo, false), &payload, false);
                mo += seg;
                b
            };
            // Phase 1: until the provider stops reading.
            let n = write_until_blocked(
                &raw.s,
                Duration::from_secs(2),
                bound + (8 << 20),
                &stop,
                &mut next,
            );
            accepted.store(n.max(1), Ordering::SeqCst);
            // Phase 2: keep pushing until told to stop (the provider ends the stream).
            while !stop.load(Ordering::Relaxed) {
                if write_until_blocked(
                    &raw.s,
                    Duration::from_millis(200),
                    u64::MAX,
                    &stop,
                    &mut next,
                ) == 0
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while accepted.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the raw writer never blocked");
            std::thread::sleep(Duration::from_millis(20));
        }
        let n = accepted.load(Ordering::SeqCst);
        assert!(
            n <= bound,
            "the provider took {n} bytes of one endless message with no receive posted; the bound is {UNEXPECTED_LIMIT} plus socket buffers ({bound} in all)"
        );
        assert_eq!(
            ep.state(),
            EndpointState::Connected,
            "back-pressure is not an error"
        );
        // A receive posted now is overrun by what is buffered: the connection ends.
        ep.post_recv(&RecvWr::new(5, &[c.target.slice(4096..(1 << 19)).unwrap()]))
            .unwrap();
        let mut raw2 = Raw {
            s: raw.s.try_clone().unwrap(),
            crc: false,
            ird: raw.ird,
            features: raw.features,
        };
        raw2.expect_terminate(&[term::MSG_TOO_LONG], "endless Send, then a receive");
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
    });
    wait_state(
        &ep,
        EndpointState::Error,
        "endless Send overran its receive",
    );
    let r = completion(&srv.cq, "the receive the endless Send overran");
    assert_eq!(
        (r.context, r.status),
        (5, Status::Error(ErrorKind::LocalLength))
    );
    c.check(4096..(1 << 19));
    still_serving(&srv, &before);
}

#[test]
fn endless_send_overruns_a_posted_receive() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 1 << 20, Access::LOCAL_WRITE);
    let (ep, raw) = attach(&srv, RawOpts::default());
    let room = 256 << 10;
    ep.post_recv(&RecvWr::new(
        5,
        &[c.target.slice(4096..4096 + room).unwrap()],
    ))
    .unwrap();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut mo = 0u32;
            let payload = vec![0xee; 65_000];
            let mut next = || {
                let b = fpdu(send_hdr(1, mo, false), &payload, false);
                mo = mo.wrapping_add(65_000);
                b
            };
            // Capped: 64 MiB is far past the receive; the provider must have ended it.
            write_until_blocked(&raw.s, Duration::from_secs(5), 64 << 20, &stop, &mut next)
        });
        let mut r = Raw {
            s: raw.s.try_clone().unwrap(),
            crc: false,
            ird: raw.ird,
            features: raw.features,
        };
        r.expect_terminate(&[term::MSG_TOO_LONG], "endless Send into a posted receive");
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
    });
    wait_state(
        &ep,
        EndpointState::Error,
        "endless Send overran its receive",
    );
    let r = completion(&srv.cq, "the receive the endless Send overran");
    assert_eq!(
        (r.context, r.status),
        (5, Status::Error(ErrorKind::LocalLength))
    );
    c.check(4096..4096 + room);
    still_serving(&srv, &before);
}

#[test]
fn zero_byte_send_flood_is_bounded() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, Access::LOCAL_WRITE);
    let sndbuf = 256 << 10;
    let (ep, raw) = attach(
        &srv,
        RawOpts {
            sndbuf: Some(sndbuf),
            ..RawOpts::default()
        },
    );
    let one = fpdu(send_hdr(1, 0, true), &[], false).len() as u64;
    // Each buffered message must cost something against the 8 MiB bound: even at 16
    // bytes apiece, 8 MiB holds 512 Ki messages; the rest sits in socket buffers.
    let bound_msgs = UNEXPECTED_LIMIT / 16 + socket_allowance(sndbuf) / one;
    let stop = AtomicBool::new(false);
    let mut msn = 0u32;
    let accepted = write_until_blocked(
        &raw.s,
        Duration::from_secs(2),
        (bound_msgs + 100_000) * one,
        &stop,
        || {
            let mut b = Vec::with_capacity(1024 * one as usize);
            for _ in 0..1024 {
                msn += 1;
                b.extend_from_slice(&fpdu(send_hdr(msn, 0, true), &[], false));
            }
            b
        },
    );
    let msgs = accepted / one;
    assert!(
        msgs <= bound_msgs,
        "the provider took {msgs} zero-byte Sends with no receive posted (bound {bound_msgs})"
    );
    assert_eq!(
        ep.state(),
        EndpointState::Connected,
        "back-pressure is not an error"
    );
    // Nothing was lost: the first of them lands in the first receive.
    ep.post_recv(&RecvWr::new(5, &[c.target.slice(0..64).unwrap()]))
        .unwrap();
    let r = completion(&srv.cq, "the first buffered zero-byte Send");
    assert_eq!((r.context, r.status, r.byte_len), (5, Status::Success, 0));
    drop(raw);
    drop(ep);
    c.check(0..0);
    still_serving(&srv, &before);
}

// ----- headers ----------------------------------------------------------------------------

#[test]
fn bad_opcodes_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let cases: Vec<(&str, Header, Vec<u8>)> = vec![
        (
            "untagged opcode 0xd",
            untagged(0xd, qn::SEND, 1, 0, true),
            b"x".to_vec(),
        ),
        (
            "untagged opcode 0xf",
            untagged(0xf, qn::SEND, 1, 0, true),
            b"x".to_vec(),
        ),
        (
            "untagged RDMA Write",
            untagged(opcode::WRITE, qn::SEND, 1, 0, true),
            b"x".to_vec(),
        ),
        (
            "tagged Send",
            Header::Tagged {
                last: true,
                opcode: opcode::SEND,
                stag: c.key(),
                to: c.base(),
            },
            b"x".to_vec(),
        ),
        (
            "Terminate opcode on the Send queue",
            untagged(opcode::TERMINATE, qn::SEND, 1, 0, true),
            term::REMOTE_OPERATION.encode().to_vec(),
        ),
        (
            "Atomic Request without the extension",
            untagged(opcode::ATOMIC_REQUEST, qn::ATOMIC, 1, 0, true),
            AtomicRequest {
                op: atomic_op::FETCH_ADD,
                req_id: 1,
                stag: c.key(),
                to: c.base(),
                add_swap: 1,
                add_swap_mask: !0,
                compare: 0,
                compare_mask: !0,
            }
            .encode()
            .to_vec(),
        ),
        (
            "Send with Immediate without the extension",
            Header::Untagged {
                last: true,
                opcode: opcode::SEND_IMM,
                ulp: 7,
                qn: qn::SEND,
                msn: 1,
                mo: 0,
            },
            b"x".to_vec(),
        ),
        (
            "Delivery Ack without the extension",
            untagged(opcode::ACK, qn::ACK, 1, 0, true),
            Vec::new(),
        ),
    ];
    for (what, h, payload) in cases {
        attack(
            &srv,
            RawOpts::default(),
            &fpdu(h, &payload, false),
            &[term::INVALID_OPCODE],
            what,
        );
    }
    c.check(0..0);
    still_serving(&srv, &before);
}

fn with_ctrl(mut b: Vec<u8>, byte0: Option<u8>, byte1: Option<u8>) -> Vec<u8> {
    if let Some(v) = byte0 {
        b[2] = v;
    }
    if let Some(v) = byte1 {
        b[3] = v;
    }
    b
}

#[test]
fn bad_rdmap_versions_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let send = fpdu(send_hdr(1, 0, true), b"x", false);
    let write = fpdu(write_hdr(c.key(), c.base(), true), b"x", false);
    // Control byte 1: RDMAP version in bits 7-6, opcode in 3-0.
    for (what, bytes) in [
        (
            "Send, RDMAP version 0",
            with_ctrl(send.clone(), None, Some(0x03)),
        ),
        (
            "Send, RDMAP version 2",
            with_ctrl(send.clone(), None, Some(0x83)),
        ),
        ("Send, RDMAP version 3", with_ctrl(send, None, Some(0xc3))),
        (
            "Write, RDMAP version 0",
            with_ctrl(write.clone(), None, Some(0x00)),
        ),
        ("Write, RDMAP version 2", with_ctrl(write, None, Some(0x80))),
    ] {
        attack(&srv, RawOpts::default(), &bytes, &[rdmap(2, 0x05)], what);
    }
    c.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn bad_ddp_versions_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let send = fpdu(send_hdr(1, 0, true), b"x", false);
    let write = fpdu(write_hdr(c.key(), c.base(), true), b"x", false);
    // Control byte 0: T, L, reserved, DDP version in bits 1-0.
    // The fault is named as a version error at the DDP (RFC 5041) or RDMAP layer.
    let named = [ddp(2, 0x06), ddp(1, 0x04), rdmap(2, 0x05)];
    for (what, bytes) in [
        (
            "Send, DDP version 0",
            with_ctrl(send.clone(), Some(0x40), None),
        ),
        (
            "Send, DDP version 2",
            with_ctrl(send.clone(), Some(0x42), None),
        ),
        ("Send, DDP version 3", with_ctrl(send, Some(0x43), None)),
        (
            "Write, DDP version 0",
            with_ctrl(write.clone(), Some(0xc0), None),
        ),
        ("Write, DDP version 3", with_ctrl(write, Some(0xc3), None)),
    ] {
        attack(&srv, RawOpts::default(), &bytes, &named, what);
    }
    c.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn bad_queue_numbers_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    for q in [5, 6, 0x8000_0000, u32::MAX] {
        attack(
            &srv,
            RawOpts::default(),
            &fpdu(untagged(opcode::SEND, q, 1, 0, true), b"queue", false),
            &[term::INVALID_QN],
            &format!("Send on queue {q}"),
        );
    }
    c.check(0..0);
    still_serving(&srv, &before);
}

/// MSN / MO faults: (what, bytes, RFC 5041 code) -- 0x03 MSN range, 0x04 MO.
fn sequence_faults(c: &Canaries) -> Vec<(&'static str, Vec<u8>, Terminate)> {
    let two = |a: Header, b: Header| {
        let mut v = fpdu(a, &[0xee; 16], false);
        v.extend_from_slice(&fpdu(b, &[0xee; 16], false));
        v
    };
    vec![
        (
            "Send MSN 0 first",
            fpdu(send_hdr(0, 0, true), b"x", false),
            ddp(2, 0x03),
        ),
        (
            "Send MSN 2 first",
            fpdu(send_hdr(2, 0, true), b"x", false),
            ddp(2, 0x03),
        ),
        (
            "Send MSN u32::MAX first",
            fpdu(send_hdr(u32::MAX, 0, true), b"x", false),
            ddp(2, 0x03),
        ),
        (
            "Send MSN repeated",
            two(send_hdr(1, 0, true), send_hdr(1, 0, true)),
            ddp(2, 0x03),
        ),
        (
            "Send MSN skips one",
            two(send_hdr(1, 0, true), send_hdr(3, 0, true)),
            ddp(2, 0x03),
        ),
        (
            "Send first segment at MO 4",
            fpdu(send_hdr(1, 4, true), b"x", false),
            ddp(2, 0x04),
        ),
        (
            "Send continuation MO gap",
            two(send_hdr(1, 0, false), send_hdr(1, 32, true)),
            ddp(2, 0x04),
        ),
        (
            "Send continuation MO overlap",
            two(send_hdr(1, 0, false), send_hdr(1, 8, true)),
            ddp(2, 0x04),
        ),
        (
            "Send continuation changes MSN",
            two(send_hdr(1, 0, false), send_hdr(2, 16, true)),
            ddp(2, 0x03),
        ),
        (
            "Read Request MSN 2 first",
            read_req(2, 8, c.key(), c.base()),
            ddp(2, 0x03),
        ),
    ]
}

#[test]
fn msn_and_mo_out_of_sequence_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    for (what, bytes, _) in sequence_faults(&c) {
        // Named at the DDP layer (MSN range / MO) or as an invalid FPDU by the LLP.
        attack(
            &srv,
            RawOpts::default(),
            &bytes,
            &[ddp(2, 0x03), ddp(2, 0x04), llp(0x03)],
            what,
        );
    }
    c.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn ddp_faults_carry_rfc_5041_codes() {
    let srv = server();
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    for (what, bytes, want) in sequence_faults(&c) {
        attack(&srv, RawOpts::default(), &bytes, &[want], what);
    }
    let send = fpdu(send_hdr(1, 0, true), b"x", false);
    let write = fpdu(write_hdr(c.key(), c.base(), true), b"x", false);
    attack(
        &srv,
        RawOpts::default(),
        &with_ctrl(send, Some(0x42), None),
        &[ddp(2, 0x06)],
        "untagged, DDP version 2",
    );
    attack(
        &srv,
        RawOpts::default(),
        &with_ctrl(write, Some(0xc2), None),
        &[ddp(1, 0x04)],
        "tagged, DDP version 2",
    );
    c.check(0..0);
}

// ----- memory access ----------------------------------------------------------------------

#[test]
fn writes_out_of_range_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let len = 4096usize;
    let c = canaries(&srv.domain, len, ALL_ACCESS);
    let ro = canaries(&srv.domain, len, Access::LOCAL_WRITE | Access::REMOTE_READ);
    let (base, key) = (c.base(), c.key());
    let end = base + len as u64;
    let p = vec![0xee; 64];
    let two = |first: Header, second: Header| {
        let mut v = fpdu(first, &p, false);
        v.extend_from_slice(&fpdu(second, &p, false));
        v
    };
    let cases: Vec<(&str, Vec<u8>, Vec<Terminate>)> = vec![
        (
            "Write with an unknown STag",
            fpdu(write_hdr(key ^ 0x8000_0001, base, true), &p, false),
            protection(0x00),
        ),
        (
            "Write with STag 0",
            fpdu(write_hdr(0, base, true), &p, false),
            protection(0x00),
        ),
        (
            "Write below the region",
            fpdu(write_hdr(key, base - 64, true), &p, false),
            protection(0x01),
        ),
        (
            "Write one byte below the region",
            fpdu(write_hdr(key, base - 1, true), &p, false),
            protection(0x01),
        ),
        (
            "Write past the region",
            fpdu(write_hdr(key, end, true), &p, false),
            protection(0x01),
        ),
        (
            "Write straddling the region's end",
            fpdu(write_hdr(key, end - 32, true), &p, false),
            protection(0x01),
        ),
        (
            "Write whose second segment straddles the end",
            two(
                write_hdr(key, end - 96, false),
                write_hdr(key, end - 32, true),
            ),
            protection(0x01),
        ),
        (
            "Write with a wrapping offset",
            fpdu(write_hdr(key, u64::MAX - 31, true), &p, false),
            {
                let mut v = protection(0x01);
                v.extend([ddp(1, 0x03), rdmap(1, 0x04)]); // TO wrap
                v
            },
        ),
        (
            "Write without REMOTE_WRITE",
            fpdu(write_hdr(ro.key(), ro.base(), true), &p, false),
            vec![rdmap(1, 0x02)],
        ),
    ];
    for (what, bytes, want) in cases {
        attack(&srv, RawOpts::default(), &bytes, &want, what);
    }
    // The straddling writes addressed the region's last 96 bytes; nothing else moved.
    c.check(len - 96..len);
    ro.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn reads_out_of_range_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let len = 4096usize;
    let c = canaries(&srv.domain, len, ALL_ACCESS);
    let wo = canaries(&srv.domain, len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let (base, key) = (c.base(), c.key());
    let end = base + len as u64;
    let cases: Vec<(&str, Vec<u8>, Vec<Terminate>)> = vec![
        (
            "Read with an unknown STag",
            read_req(1, 64, key ^ 0x8000_0001, base),
            protection(0x00),
        ),
        (
            "Read larger than the region",
            read_req(1, len as u32 + 1, key, base),
            protection(0x01),
        ),
        (
            "Read of 4 GiB - 1",
            read_req(1, u32::MAX, key, base),
            protection(0x01),
        ),
        (
            "Read below the region",
            read_req(1, 64, key, base - 64),
            protection(0x01),
        ),
        (
            "Read past the region",
            read_req(1, 1, key, end),
            protection(0x01),
        ),
        (
            "Read straddling the region's end",
            read_req(1, 64, key, end - 32),
            protection(0x01),
        ),
        (
            "Read with a wrapping offset",
            read_req(1, 64, key, u64::MAX - 31),
            {
                let mut v = protection(0x01);
                v.extend([ddp(1, 0x03), rdmap(1, 0x04)]);
                v
            },
        ),
        (
            "Read without REMOTE_READ",
            read_req(1, 64, wo.key(), wo.base()),
            vec![rdmap(1, 0x02)],
        ),
    ];
    for (what, bytes, want) in cases {
        // No Read Response may come back: the Terminate is the first and last FPDU.
        attack(&srv, RawOpts::default(), &bytes, &want, what);
    }
    // A Read Response for a sink this provider never asked for.
    attack(
        &srv,
        RawOpts::default(),
        &fpdu(
            Header::Tagged {
                last: true,
                opcode: opcode::READ_RESPONSE,
                stag: key,
                to: base,
            },
            &[0xee; 64],
            false,
        ),
        &protection(0x00),
        "unsolicited Read Response naming a registered STag",
    );
    c.check(0..0);
    wo.check(0..0);
    still_serving(&srv, &before);
}

fn ext() -> RawOpts {
    RawOpts {
        ext: true,
        ..RawOpts::default()
    }
}

#[test]
fn bad_atomics_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let len = 4096usize;
    let c = canaries(&srv.domain, len, ALL_ACCESS);
    let noatomic = canaries(&srv.domain, len, ALL_ACCESS - Access::REMOTE_ATOMIC);
    let (base, key) = (c.base(), c.key());
    let end = base + len as u64;
    let fa = atomic_op::FETCH_ADD;
    let cs = atomic_op::COMPARE_SWAP;
    let cases: Vec<(&str, Vec<u8>, Vec<Terminate>)> = vec![
        (
            "misaligned fetch-add",
            atomic_req(1, fa, key, base + 4, 1),
            vec![term::MISALIGNED_ATOMIC],
        ),
        (
            "misaligned compare-swap",
            atomic_req(1, cs, key, base + 1, 1),
            vec![term::MISALIGNED_ATOMIC],
        ),
        (
            "misaligned, straddling the end",
            atomic_req(1, fa, key, end - 4, 1),
            {
                let mut v = protection(0x01);
                v.push(term::MISALIGNED_ATOMIC);
                v
            },
        ),
        (
            "atomic past the region",
            atomic_req(1, fa, key, end, 1),
            protection(0x01),
        ),
        (
            "atomic below the region",
            atomic_req(1, fa, key, base - 8, 1),
            protection(0x01),
        ),
        (
            "atomic with an unknown STag",
            atomic_req(1, fa, key ^ 0x8000_0001, base, 1),
            protection(0x00),
        ),
        (
            "fetch-add without REMOTE_ATOMIC",
            atomic_req(1, fa, noatomic.key(), noatomic.base(), 1),
            vec![rdmap(1, 0x02)],
        ),
        (
            "compare-swap without REMOTE_ATOMIC",
            atomic_req(1, cs, noatomic.key(), noatomic.base(), 1),
            vec![rdmap(1, 0x02)],
        ),
    ];
    for (what, bytes, want) in cases {
        let raw = attack(&srv, ext(), &bytes, &want, what);
        assert_ne!(
            raw.features & mpa::features::ATOMICS,
            0,
            "atomics not negotiated"
        );
    }
    c.check(0..0);
    noatomic.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn crc_errors_are_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let crc = RawOpts {
        crc: true,
        ..RawOpts::default()
    };
    // A Send whose payload was corrupted after the CRC was computed, into a posted receive.
    {
        let (ep, mut raw) = attach(&srv, crc);
        ep.post_recv(&RecvWr::new(3, &[c.target.slice(1024..2048).unwrap()]))
            .unwrap();
        raw.send(send_hdr(1, 0, true), b"good");
        let r = completion(&srv.cq, "a Send with a good CRC");
        assert_eq!((r.context, r.status, r.byte_len), (3, Status::Success, 4));
        ep.post_recv(&RecvWr::new(4, &[c.target.slice(1024..2048).unwrap()]))
            .unwrap();
        let mut b = fpdu(send_hdr(2, 0, true), &[0xee; 100], true);
        b[40] ^= 0x01;
        raw.send_bytes(&b);
        raw.expect_terminate(&[term::CRC], "a Send with a corrupted payload");
        wait_state(&ep, EndpointState::Error, "CRC error");
        // Its receive's status is checked by `a_message_failing_its_crc_is_never_completed`.
        assert_eq!(
            completion(&srv.cq, "the receive of the corrupted Send").context,
            4
        );
    }
    // A Write with a corrupted CRC, and one with a corrupted header (its TO moved into the
    // high guard's direction: the segment must not be placed anywhere outside the target).
    for (what, flip) in [("CRC bytes", usize::MAX), ("tagged offset", 2 + 2 + 4 + 6)] {
        let (ep, mut raw) = attach(&srv, crc);
        let mut b = fpdu(write_hdr(c.key(), c.base() + 512, true), &[0xee; 64], true);
        let at = if flip == usize::MAX {
            b.len() - 1
        } else {
            flip
        };
        b[at] ^= 0x10;
        raw.send_bytes(&b);
        raw.expect_terminate(
            &[term::CRC, rdmap(1, 0x01), ddp(1, 0x01)],
            &format!("a Write with corrupted {what}"),
        );
        wait_state(&ep, EndpointState::Error, what);
    }
    c.check(512..2048);
    still_serving(&srv, &before);
}

#[test]
fn a_message_failing_its_crc_is_never_completed() {
    let srv = server();
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    let crc_ext = RawOpts {
        crc: true,
        ext: true,
        ..RawOpts::default()
    };
    {
        let (ep, mut raw) = attach(&srv, crc_ext);
        ep.post_recv(&RecvWr::new(4, &[c.target.slice(1024..2048).unwrap()]))
            .unwrap();
        let mut b = fpdu(send_hdr(1, 0, true), &[0xee; 100], true);
        b[40] ^= 0x01;
        raw.send_bytes(&b);
        let first = raw.read().unwrap();
        assert!(
            matches!(
                first,
                Some((
                    Header::Untagged {
                        opcode: opcode::TERMINATE,
                        ..
                    },
                    _
                ))
            ),
            "a Send that failed its CRC was acknowledged: {first:?}"
        );
        wait_state(&ep, EndpointState::Error, "CRC error");
        let r = completion(&srv.cq, "the receive of the corrupted Send");
        assert_eq!(r.context, 4);
        assert_ne!(
            r.status,
            Status::Success,
            "a message that failed its CRC was delivered: {r:?}"
        );
    }
    {
        let (ep, mut raw) = attach(&srv, crc_ext);
        let mut b = fpdu(write_hdr(c.key(), c.base() + 512, true), &[0xee; 64], true);
        let n = b.len();
        b[n - 1] ^= 0x10;
        raw.send_bytes(&b);
        let first = raw.read().unwrap();
        assert!(
            matches!(
                first,
                Some((
                    Header::Untagged {
                        opcode: opcode::TERMINATE,
                        ..
                    },
                    _
                ))
            ),
            "a Write that failed its CRC was acknowledged as placed: {first:?}"
        );
        wait_state(&ep, EndpointState::Error, "CRC error");
    }
    c.check(512..2048);
}

// ----- inbound read and atomic floods -----------------------------------------------------

/// Reads the provider's responses up to its Terminate: (Read Responses completed, Atomic
/// Responses, the Terminate).
fn count_responses(raw: &mut Raw, what: &str) -> (u32, u32, Terminate) {
    let (mut reads, mut atomics) = (0, 0);
    loop {
        match raw.read() {
            Ok(Some((
                Header::Tagged {
                    opcode: opcode::READ_RESPONSE,
                    last,
                    ..
                },
                _,
            ))) => reads += u32::from(last),
            Ok(Some((
                Header::Untagged {
                    opcode: opcode::ATOMIC_RESPONSE,
                    ..
                },
                p,
            ))) => {
                AtomicResponse::decode(&p).unwrap();
                atomics += 1;
            }
            Ok(Some((
                Header::Untagged {
                    opcode: opcode::TERMINATE,
                    ..
                },
                p,
            ))) => {
                let t = Terminate::decode(&p).unwrap();
                raw.expect_end(what);
                return (reads, atomics, t);
            }
            Ok(Some((Header::Untagged { opcode: opcode::ACK, .. }, _))) => {}
            Ok(Some((h, _))) => panic!("{what}: unexpected {h:?}"),
            Ok(None) => panic!(
                "{what}: the stream ended after {reads} Read and {atomics} Atomic Responses, without a Terminate"
            ),
            Err(e) => panic!(
                "{what}: no Terminate after {reads} Read and {atomics} Atomic Responses: {e}"
            ),
        }
    }
}

#[test]
fn read_flood_beyond_ird_is_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let size = 1usize << 20;
    let c = canaries(&srv.domain, size, ALL_ACCESS);
    let rcvbuf = 64 << 10;
    let (ep, mut raw) = attach(
        &srv,
        RawOpts {
            rcvbuf: Some(rcvbuf),
            ..RawOpts::default()
        },
    );
    let ird = u32::from(raw.ird);
    assert!(ird > 0, "the provider advertised IRD 0");
    let flood = 4 * ird + 16;
    let mut bytes = Vec::new();
    for msn in 1..=flood {
        bytes.extend_from_slice(&read_req(msn, size as u32, c.key(), c.base()));
    }
    raw.send_bytes(&bytes);
    let (reads, _, t) = count_responses(&mut raw, "read flood");
    assert_eq!(
        t,
        term::NO_BUFFER,
        "the Terminate must name 'no buffer' (DDP 1/2/2)"
    );
    // Responses already on their way when the flood crossed the IRD: what the provider's
    // send buffer and ours hold, plus the one being written.
    let in_flight = (proc_value("/proc/sys/net/ipv4/tcp_wmem", 2) + 2 * rcvbuf as u64)
        .div_ceil(size as u64) as u32
        + 2;
    assert!(
        reads <= ird + in_flight,
        "the provider answered {reads} of {flood} Read Requests; IRD {ird} plus {in_flight} in flight is the most"
    );
    assert!(
        reads >= ird,
        "only {reads} responses before the Terminate (IRD {ird})"
    );
    wait_state(&ep, EndpointState::Error, "read flood");
    c.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn atomic_flood_beyond_ird_is_terminated() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 4096, ALL_ACCESS);
    // A 16 MiB Read first: its response fills every socket buffer and keeps the provider's
    // output busy while the atomics arrive.
    let plug = 16usize << 20;
    let big = srv
        .domain
        .register(Arc::new(Buffer::new(plug)), ALL_ACCESS)
        .unwrap();
    let (ep, mut raw) = attach(
        &srv,
        RawOpts {
            rcvbuf: Some(64 << 10),
            ext: true,
            ..RawOpts::default()
        },
    );
    let ird = u32::from(raw.ird);
    let flood = 4 * ird + 16;
    let mut bytes = read_req(1, plug as u32, big.desc().key, big.desc().addr);
    let word = c.base() + 64;
    for msn in 1..=flood {
        bytes.extend_from_slice(&atomic_req(msn, atomic_op::FETCH_ADD, c.key(), word, 1));
    }
    raw.send_bytes(&bytes);
    let (reads, atomics, t) = count_responses(&mut raw, "atomic flood");
    assert_eq!(
        t,
        term::NO_BUFFER,
        "the Terminate must name 'no buffer' (DDP 1/2/2)"
    );
    assert_eq!(reads, 1, "the plugging Read is answered");
    assert!(
        atomics <= ird,
        "the provider answered {atomics} of {flood} atomics behind a busy output; IRD is {ird}"
    );
    // Every atomic executed was answered, and no more than that were executed.
    let mut v = [0u8; 8];
    c.target.buffer().read(64, &mut v);
    let executed = u64::from_ne_bytes(v).wrapping_sub(u64::from_ne_bytes(
        pattern(0x5a, 72)[64..72].try_into().unwrap(),
    ));
    assert_eq!(
        executed,
        u64::from(atomics),
        "atomics executed at the target vs. answered"
    );
    wait_state(&ep, EndpointState::Error, "atomic flood");
    c.check(64..72);
    still_serving(&srv, &before);
}

// ----- large writes placed straight from the socket (no CRC) ------------------------------

/// Payload of one large RDMA Write FPDU: above the provider's direct-placement threshold
/// (8 KiB), odd so that the FPDU has padding.
const BIG: usize = 60_001;

#[test]
fn large_write_arriving_in_pieces_is_placed_and_the_stream_stays_framed() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, 2 * BIG, ALL_ACCESS);
    let rq = canaries(&srv.domain, 64, Access::LOCAL_WRITE);
    let (ep, mut raw) = attach(&srv, RawOpts::default());
    ep.post_recv(&RecvWr::new(9, &[rq.target.slice(0..64).unwrap()]))
        .unwrap();
    let data = pattern(0xc3, BIG);
    let at = 1001; // unaligned: partial words at both ends
    let w = fpdu(write_hdr(c.key(), c.base() + at as u64, true), &data, false);
    // Header and a few bytes, then the rest in uneven pieces with pauses, so the provider
    // sees the FPDU's payload arrive over many reads.
    let mut cuts = vec![2 + 14 + 3, 4096, 4097, 20_000, 51_000, w.len() - 2, w.len()];
    cuts.dedup();
    let mut from = 0;
    for to in cuts {
        raw.send_bytes(&w[from..to]);
        from = to;
        std::thread::sleep(Duration::from_millis(5));
    }
    // A send right behind it: matched only if the write's trailer was consumed exactly.
    raw.send(send_hdr(1, 0, true), b"after the big write");
    let r = completion(&srv.cq, "the send behind the large write");
    assert_eq!((r.context, r.status, r.byte_len), (9, Status::Success, 19));
    assert_eq!(rq.target.buffer().to_vec(0, 19), b"after the big write");
    assert_eq!(
        c.target.buffer().to_vec(at, BIG),
        data,
        "the large write was not placed as sent"
    );
    c.check(at..at + BIG);
    assert_eq!(ep.state(), EndpointState::Connected);
    still_serving(&srv, &before);
}

#[test]
fn large_write_out_of_range_is_refused_before_any_byte_lands() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, BIG, ALL_ACCESS);
    let (ep, mut raw) = attach(&srv, RawOpts::default());
    // Straddles the end by one byte. Only the header and 1000 payload bytes are sent: the
    // refusal must come from the header, before the FPDU is whole, with nothing placed.
    let w = fpdu(
        write_hdr(c.key(), c.base() + 1, true),
        &pattern(0x3c, BIG),
        false,
    );
    raw.send_bytes(&w[..2 + 14 + 1000]);
    raw.expect_terminate(&protection(0x01), "large write past the region");
    wait_state(&ep, EndpointState::Error, "large write past the region");
    c.check(0..0);
    still_serving(&srv, &before);
}

#[test]
fn stream_cut_inside_a_large_write_is_an_error() {
    let srv = server();
    let before = healthy(&srv);
    let c = canaries(&srv.domain, BIG, ALL_ACCESS);
    let (ep, mut raw) = attach(&srv, RawOpts::default());
    let w = fpdu(
        write_hdr(c.key(), c.base(), true),
        &pattern(0x5e, BIG),
        false,
    );
    raw.send_bytes(&w[..2 + 14 + 30_000]);
    raw.s.shutdown(std::net::Shutdown::Write).unwrap();
    raw.expect_terminate(&[llp(0x01), llp(0x03)], "stream cut inside a large write");
    wait_state(&ep, EndpointState::Error, "stream cut inside a large write");
    c.check(0..BIG);
    still_serving(&srv, &before);
}

#[test]
fn deregistration_stops_a_large_write_being_placed() {
    let srv = server();
    let before = healthy(&srv);
    let buf = Arc::new(Buffer::from_slice(&pattern(0x5a, BIG)));
    let mr = srv.domain.register(buf.clone(), ALL_ACCESS).unwrap();
    let (key, base) = (mr.desc().key, mr.desc().addr);
    let (ep, mut raw) = attach(&srv, RawOpts::default());
    let data = pattern(0x99, BIG);
    let w = fpdu(write_hdr(key, base, true), &data, false);
    let first = 2 + 14 + 20_000;
    raw.send_bytes(&w[..first]);
    // Wait until the first part is placed (the provider is inside the FPDU), then
    // deregister: nothing of the rest may land.
    let deadline = Instant::now() + DEADLINE;
    while buf.to_vec(0, 20_000) != data[..20_000] {
        assert!(
            Instant::now() < deadline,
            "the first 20000 bytes were never placed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(mr);
    raw.send_bytes(&w[first..]);
    raw.expect_terminate(&protection(0x00), "write continuing after deregistration");
    wait_state(
        &ep,
        EndpointState::Error,
        "write continuing after deregistration",
    );
    assert_eq!(
        buf.to_vec(20_000, BIG - 20_000),
        pattern(0x5a, BIG)[20_000..],
        "bytes arriving after the deregistration were placed"
    );
    still_serving(&srv, &before);
}
