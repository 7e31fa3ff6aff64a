//! The tcp provider against a raw socket speaking the RFC framing by hand: a peer that is
//! not this framework (no extension block), and hostile bytes after a valid handshake.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_api::spi::{CompletionQueue, Domain, Endpoint, EndpointConfig, Listener};
use fabric_api::{Access, Buffer, EndpointState, ErrorKind, Opcode, RecvWr, SendWr, Status};
use fabric_tcp::wire::ddp::{opcode, qn, Header, ReadRequest, Terminate};
use fabric_tcp::wire::mpa::{self, Enhanced, MpaFrame, RtrKinds, Setup};
use fabric_tcp::{TcpCq, TcpDomain, TcpEndpoint, TcpListener, TcpOptions};

struct Server {
    domain: TcpDomain,
    cq: TcpCq,
    listener: TcpListener,
}

fn server(opts: TcpOptions) -> Server {
    let domain = TcpDomain::open(opts).unwrap();
    let cq = domain.create_cq(64).unwrap();
    let listener = domain.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    Server {
        domain,
        cq,
        listener,
    }
}

/// A raw client: sends an MPA request (revision, CRC wish, optional RFC 6581 block, no
/// extension block: it looks like a foreign iWARP peer) and reads the reply.
fn raw_connect(
    addr: SocketAddr,
    revision: u8,
    crc: bool,
    markers: bool,
) -> (TcpStream, MpaFrame, Setup) {
    raw_connect_with(addr, revision, crc, markers, b"raw")
}

/// [`raw_connect`] with the given private data.
fn raw_connect_with(
    addr: SocketAddr,
    revision: u8,
    crc: bool,
    markers: bool,
    user: &[u8],
) -> (TcpStream, MpaFrame, Setup) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let setup = Setup {
        enhanced: (revision >= 2).then_some(Enhanced {
            ird: 8,
            ord: 8,
            peer_to_peer: false,
            rtr: RtrKinds::default(),
        }),
        ext: None,
        user: user.to_vec(),
    };
    let req = MpaFrame {
        reply: false,
        markers,
        crc,
        reject: false,
        enhanced: revision >= 2,
        ext_offer: false,
        revision,
        private_data: setup.encode(),
    };
    s.write_all(&req.encode()).unwrap();
    let mut h = [0u8; mpa::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let (mut rep, pd_len) = MpaFrame::decode_header(&h, true).unwrap();
    rep.private_data = vec![0; pd_len];
    s.read_exact(&mut rep.private_data).unwrap();
    let setup = Setup::of(&rep).unwrap();
    (s, rep, setup)
}

fn accept(srv: &Server, timeout: Duration) -> fabric_api::Result<TcpEndpoint> {
    srv.listener.accept(&EndpointConfig::new(&srv.cq), timeout)
}

/// Encodes one FPDU: length, header, payload, pad, CRC (when `crc`).
fn fpdu(h: Header, payload: &[u8], crc: bool) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&((h.len() + payload.len()) as u16).to_be_bytes());
    h.encode_into(&mut out);
    out.extend_from_slice(payload);
    out.resize(out.len() + mpa::pad_len(h.len() + payload.len()), 0);
    let c = if crc { crc32c::crc32c(&out) } else { 0 };
    out.extend_from_slice(&mpa::crc_bytes(c));
    out
}

// Where an initiator's repeats of its hello mark go (STag, offset), when `read_fpdu` and
// `expect_silence` pass over them: it writes the mark again (`engine::HELLO_REPEATS`) at
// times a test does not control.
thread_local! {
    static SKIP_HELLO: std::cell::Cell<Option<(u32, u64)>> = const { std::cell::Cell::new(None) };
}

/// Whether `h` and `payload` are a repeat of the hello mark that `SKIP_HELLO` names.
fn skipped_hello(h: &Header, payload: &[u8]) -> bool {
    match (h, SKIP_HELLO.get()) {
        (
            Header::Tagged {
                opcode: opcode::WRITE,
                stag,
                to,
                ..
            },
            Some(at),
        ) => (*stag, *to) == at && payload == 1u64.to_ne_bytes(),
        _ => false,
    }
}

/// Reads one FPDU (passing over the hello repeats `SKIP_HELLO` names) and returns its
/// header and payload.
fn read_fpdu(s: &mut TcpStream) -> (Header, Vec<u8>) {
    loop {
        let mut len = [0u8; 2];
        s.read_exact(&mut len).unwrap();
        let (h, payload) = read_fpdu_rest(s, len);
        if !skipped_hello(&h, &payload) {
            return (h, payload);
        }
    }
}

/// The rest of an FPDU whose length field was `len`.
fn read_fpdu_rest(s: &mut TcpStream, len: [u8; 2]) -> (Header, Vec<u8>) {
    let ulpdu = u16::from_be_bytes(len) as usize;
    let mut body = vec![0u8; ulpdu + mpa::trailer_len(ulpdu)];
    s.read_exact(&mut body).unwrap();
    let h = Header::decode(&body[..ulpdu]).unwrap();
    (h, body[h.len()..ulpdu].to_vec())
}

fn send(msn: u32, last: bool, mo: u32) -> Header {
    Header::Untagged {
        last,
        opcode: opcode::SEND,
        ulp: 0,
        qn: qn::SEND,
        msn,
        mo,
    }
}

/// The header of an RDMA Read Request with `msn`.
fn read_request(msn: u32) -> Header {
    Header::Untagged {
        last: true,
        opcode: opcode::READ_REQUEST,
        ulp: 0,
        qn: qn::READ,
        msn,
        mo: 0,
    }
}

fn wait_state(ep: &TcpEndpoint, want: EndpointState) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while ep.state() != want {
        assert!(
            Instant::now() < deadline,
            "endpoint is {:?}, expected {want:?}",
            ep.state()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A 64-byte write source registered in `srv`'s domain (no access rights: it is only
/// read locally), and a remote address that the raw peer never checks.
fn write_source(srv: &Server) -> (fabric_api::MemoryRegion, fabric_api::RemoteAddr) {
    let src = srv
        .domain
        .register(Arc::new(Buffer::new(64)), Access::empty())
        .unwrap();
    let remote = fabric_api::RemoteAddr {
        addr: 0x1000,
        key: 0x11,
    };
    (src, remote)
}

/// Waits up to 5 s for `n` completions on `cq`; returns their contexts and statuses (what
/// came, if fewer).
fn statuses(cq: &TcpCq, n: usize) -> Vec<(u64, Status)> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while out.len() < n && Instant::now() < deadline {
        cq.wait(Duration::from_millis(100)).unwrap();
        cq.poll(&mut out, 8).unwrap();
    }
    out.iter().map(|c| (c.context, c.status)).collect()
}

#[test]
fn foreign_peer_gets_base_rdmap_and_no_extensions() {
    let srv = server(TcpOptions::default());
    let addr = srv.listener.local_addr();
    let t = std::thread::spawn(move || raw_connect(addr, 2, false, false));
    let ep = accept(&srv, Duration::from_secs(10)).unwrap();
    let (mut raw, rep, setup) = t.join().unwrap();
    assert_eq!(rep.revision, 2);
    assert!(
        rep.enhanced,
        "a revision-2 reply to an enhanced request must set the E bit (siw requires it)"
    );
    assert!(
        rep.enhanced,
        "a revision-2 reply to an enhanced request must set the E bit (siw requires it)"
    );
    assert!(!rep.crc && !rep.reject && !rep.markers);
    assert!(
        setup.ext.is_none(),
        "extension block offered to a peer that did not announce one"
    );
    assert_eq!(
        setup.enhanced.unwrap().ord,
        8,
        "ORD must not exceed the peer's IRD"
    );
    assert_eq!(ep.peer_private_data(), b"raw");
    assert_eq!(ep.negotiated().2, 0);

    // Base RDMAP Send from the foreign peer, in two segments, lands in a posted receive.
    let mr = srv
        .domain
        .register(Arc::new(Buffer::new(64)), Access::LOCAL_WRITE)
        .unwrap();
    ep.post_recv(&RecvWr::new(5, &[mr.all()])).unwrap();
    raw.write_all(&fpdu(send(1, false, 0), b"hello ", false))
        .unwrap();
    raw.write_all(&fpdu(send(1, true, 6), b"iwarp", false))
        .unwrap();
    assert!(srv.cq.wait(Duration::from_secs(5)).unwrap());
    let mut out = Vec::new();
    srv.cq.poll(&mut out, 4).unwrap();
    assert_eq!(out[0].context, 5);
    assert_eq!(out[0].byte_len, 11);
    assert_eq!(mr.buffer().to_vec(0, 11), b"hello iwarp");

    // Extensions are refused at post time, with the reason.
    let target = srv
        .domain
        .register(Arc::new(Buffer::new(8)), Access::LOCAL_WRITE)
        .unwrap();
    let e = ep
        .post_send(&SendWr::fetch_add(1, target.all(), target.desc().at(0), 1))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.message().contains("extension"), "{e}");

    // An RDMA Read Request from the foreign peer is answered with a Read Response.
    let exposed = srv
        .domain
        .register(
            Arc::new(Buffer::from_slice(b"0123456789")),
            Access::REMOTE_READ,
        )
        .unwrap();
    let d = exposed.desc();
    let rr = ReadRequest {
        sink_stag: 0x77,
        sink_to: 0x1000,
        size: 4,
        src_stag: d.key,
        src_to: d.addr + 3,
    };
    raw.write_all(&fpdu(read_request(1), &rr.encode(), false))
        .unwrap();
    let (h, payload) = read_fpdu(&mut raw);
    assert_eq!(
        h,
        Header::Tagged {
            last: true,
            opcode: opcode::READ_RESPONSE,
            stag: 0x77,
            to: 0x1000
        }
    );
    assert_eq!(payload, b"3456");

    // A send from our side arrives as plain RDMAP Send followed by a zero-length Read
    // Request; it completes only when the Read Response says everything before it was
    // placed (no acks from a foreign peer).
    let src = srv
        .domain
        .register(Arc::new(Buffer::from_slice(b"bye")), Access::empty())
        .unwrap();
    ep.post_send(&SendWr::send(9, &[src.all()])).unwrap();
    let (h, payload) = read_fpdu(&mut raw);
    assert_eq!(h, send(1, true, 0));
    assert_eq!(payload, b"bye");
    let (h, payload) = read_fpdu(&mut raw);
    assert_eq!(h, read_request(1));
    let flush = ReadRequest::decode(&payload).unwrap();
    assert_eq!((flush.size, flush.src_stag, flush.src_to), (0, 0, 0));
    assert!(
        !srv.cq.wait(Duration::from_millis(200)).unwrap(),
        "send completed before the target confirmed it"
    );
    raw.write_all(&fpdu(
        Header::Tagged {
            last: true,
            opcode: opcode::READ_RESPONSE,
            stag: flush.sink_stag,
            to: flush.sink_to,
        },
        &[],
        false,
    ))
    .unwrap();
    assert!(srv.cq.wait(Duration::from_secs(5)).unwrap());
    out.clear();
    srv.cq.poll(&mut out, 4).unwrap();
    assert_eq!(
        (out[0].context, out[0].opcode, out[0].status),
        (9, Opcode::Send, Status::Success)
    );
}

#[test]
fn foreign_terminate_fails_the_send_it_refused() {
    let (srv, ep, mut raw) = connected_raw(false);
    let src = srv
        .domain
        .register(Arc::new(Buffer::new(64)), Access::empty())
        .unwrap();
    ep.post_send(&SendWr::send(3, &[src.all()])).unwrap();
    let _send = read_fpdu(&mut raw);
    let _flush = read_fpdu(&mut raw);
    // The foreign target had no receive big enough: DDP "message too long".
    let term = fabric_tcp::wire::ddp::term::MSG_TOO_LONG;
    raw.write_all(&fpdu(
        Header::Untagged {
            last: true,
            opcode: opcode::TERMINATE,
            ulp: 0,
            qn: qn::TERMINATE,
            msn: 1,
            mo: 0,
        },
        &term.encode(),
        false,
    ))
    .unwrap();
    assert!(srv.cq.wait(Duration::from_secs(5)).unwrap());
    let mut out = Vec::new();
    srv.cq.poll(&mut out, 4).unwrap();
    assert_eq!(
        (out[0].context, out[0].status),
        (3, Status::Error(ErrorKind::RemoteInvalidRequest))
    );
    assert_eq!(out[0].provider_code, Some(term.code()));
    wait_state(&ep, EndpointState::Error);
}

#[test]
fn revision_1_request_gets_a_revision_1_reply() {
    let srv = server(TcpOptions::default());
    let addr = srv.listener.local_addr();
    let t = std::thread::spawn(move || raw_connect(addr, 1, false, false));
    let ep = accept(&srv, Duration::from_secs(10)).unwrap();
    let (_raw, rep, setup) = t.join().unwrap();
    assert_eq!(rep.revision, 1);
    assert!(!rep.enhanced);
    assert!(!rep.enhanced && setup.enhanced.is_none());
    assert_eq!(ep.negotiated().0, 1);
}

#[test]
fn markers_are_rejected_with_a_reason_and_the_listener_survives() {
    let srv = server(TcpOptions::default());
    let addr = srv.listener.local_addr();
    let t = std::thread::spawn(move || raw_connect(addr, 2, false, true));
    assert_eq!(
        accept(&srv, Duration::from_millis(1500))
            .unwrap_err()
            .kind(),
        ErrorKind::TimedOut
    );
    let (_raw, rep, setup) = t.join().unwrap();
    assert!(rep.reject);
    assert!(
        String::from_utf8_lossy(&setup.user).contains("markers"),
        "{:?}",
        setup.user
    );
    // A good client is still served.
    let t = std::thread::spawn(move || raw_connect(addr, 2, false, false));
    accept(&srv, Duration::from_secs(10)).unwrap();
    assert!(!t.join().unwrap().1.reject);
}

fn expect_terminate(raw: &mut TcpStream, want: Terminate) {
    let (h, payload) = read_fpdu(raw);
    match h {
        Header::Untagged {
            opcode: opcode::TERMINATE,
            qn: qn::TERMINATE,
            ..
        } => {}
        other => panic!("expected a Terminate, got {other:?}"),
    }
    assert_eq!(Terminate::decode(&payload).unwrap(), want);
    let mut rest = Vec::new();
    raw.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "bytes after Terminate");
}

fn connected_raw(crc: bool) -> (Server, TcpEndpoint, TcpStream) {
    connected_raw_with(crc, b"raw")
}

/// [`connected_raw`] with the given private data.
fn connected_raw_with(crc: bool, user: &[u8]) -> (Server, TcpEndpoint, TcpStream) {
    let srv = server(TcpOptions::default());
    let addr = srv.listener.local_addr();
    let user = user.to_vec();
    let t = std::thread::spawn(move || raw_connect_with(addr, 2, crc, false, &user));
    let ep = accept(&srv, Duration::from_secs(10)).unwrap();
    let (raw, rep, _) = t.join().unwrap();
    assert_eq!(rep.crc, crc, "CRC asked for by the initiator must be used");
    (srv, ep, raw)
}

#[test]
fn write_with_an_invalid_stag_is_terminated() {
    let (srv, ep, mut raw) = connected_raw(false);
    let mr = srv
        .domain
        .register(
            Arc::new(Buffer::new(64)),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let d = mr.desc();
    let h = Header::Tagged {
        last: true,
        opcode: opcode::WRITE,
        stag: d.key.wrapping_add(1),
        to: d.addr,
    };
    raw.write_all(&fpdu(h, &[0xee; 32], false)).unwrap();
    expect_terminate(&mut raw, fabric_tcp::wire::ddp::term::INVALID_STAG);
    wait_state(&ep, EndpointState::Error);
    assert!(mr.buffer().to_vec(0, 64).iter().all(|&b| b == 0));
}

#[test]
fn bad_ddp_version_is_terminated_not_a_crash() {
    let (_srv, ep, mut raw) = connected_raw(false);
    let mut bytes = fpdu(send(1, true, 0), b"x", false);
    bytes[2] = 0x42; // DDP version 2
    raw.write_all(&bytes).unwrap();
    // RFC 5041 section 7.2: DDP layer, untagged buffer error, invalid DDP version.
    expect_terminate(&mut raw, fabric_tcp::wire::ddp::term::DDP_VERSION_UNTAGGED);
    wait_state(&ep, EndpointState::Error);
}

#[test]
fn crc_mismatch_is_terminated() {
    let (srv, ep, mut raw) = connected_raw(true);
    let mr = srv
        .domain
        .register(Arc::new(Buffer::new(64)), Access::LOCAL_WRITE)
        .unwrap();
    ep.post_recv(&RecvWr::new(1, &[mr.all()])).unwrap();
    // A correct CRC is accepted...
    raw.write_all(&fpdu(send(1, true, 0), b"good", true))
        .unwrap();
    assert!(srv.cq.wait(Duration::from_secs(5)).unwrap());
    // ...a corrupted one is not.
    let mut bytes = fpdu(send(2, true, 0), b"evil", true);
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    raw.write_all(&bytes).unwrap();
    expect_terminate(&mut raw, fabric_tcp::wire::ddp::term::CRC);
    wait_state(&ep, EndpointState::Error);
}

#[test]
fn wrong_msn_and_short_ulpdu_are_terminated() {
    let (_srv, ep, mut raw) = connected_raw(false);
    raw.write_all(&fpdu(send(7, true, 0), b"out of sequence", false))
        .unwrap();
    expect_terminate(&mut raw, fabric_tcp::wire::ddp::term::INVALID_MSN);
    wait_state(&ep, EndpointState::Error);

    let (_srv, ep, mut raw) = connected_raw(false);
    // ULPDU length 4 claims less than an untagged header.
    raw.write_all(&[0, 4, 0x41, 0x43, 0, 0, 0, 0, 0, 0])
        .unwrap();
    expect_terminate(&mut raw, fabric_tcp::wire::ddp::term::FPDU);
    wait_state(&ep, EndpointState::Error);
}

#[test]
fn stale_payload_on_a_zero_length_read_response_is_dropped() {
    // The kernel's siw may answer a zero-length Read with the previous WQE's bytes (see
    // conn.rs, on_read_response): the send it flushes still completes, nothing is placed.
    let (srv, ep, mut raw) = connected_raw(false);
    let src = srv
        .domain
        .register(Arc::new(Buffer::from_slice(b"hi")), Access::empty())
        .unwrap();
    ep.post_send(&SendWr::send(4, &[src.all()])).unwrap();
    let _send = read_fpdu(&mut raw);
    let (_, payload) = read_fpdu(&mut raw);
    let flush = ReadRequest::decode(&payload).unwrap();
    let stale = Header::Tagged {
        last: true,
        opcode: opcode::READ_RESPONSE,
        stag: flush.sink_stag,
        to: flush.sink_to,
    };
    raw.write_all(&fpdu(stale, &[0xab; 16], false)).unwrap();
    assert!(srv.cq.wait(Duration::from_secs(5)).unwrap());
    let mut out = Vec::new();
    srv.cq.poll(&mut out, 4).unwrap();
    assert_eq!((out[0].context, out[0].status), (4, Status::Success));
    assert_eq!(ep.state(), EndpointState::Connected);
}

/// A Terminate laid out as the kernel's siw sends it for a DDP tagged-buffer error: the
/// control field with layer and error type in swapped nibbles (x86 bitfields), the Hdr Ct
/// bits in the third byte's low bits, then the faulting segment's MPA length, DDP/RDMAP
/// control, STag and tagged offset.
fn siw_tagged_terminate(ecode: u8, stag: u32, to: u64) -> Vec<u8> {
    let mut b = vec![(1 << 4) | 1, ecode, 0b011, 0];
    b.extend_from_slice(&14u16.to_be_bytes());
    b.extend_from_slice(&0xc140u16.to_be_bytes()); // tagged, last, DDP 1, RDMAP 1, Write
    b.extend_from_slice(&stag.to_be_bytes());
    b.extend_from_slice(&to.to_be_bytes());
    b
}

#[test]
fn foreign_terminate_naming_a_write_spares_the_writes_before_it() {
    // siw may send its Terminate for a bad write before the Read Response that confirms
    // an earlier good write: the Terminate names the bad write, so the earlier one was
    // placed and succeeds.
    let (srv, ep, mut raw) = connected_raw(false);
    let (src, good) = write_source(&srv);
    let bad = fabric_api::RemoteAddr {
        addr: 0x2000,
        key: 0x22,
    };
    ep.post_send(&SendWr::write(1, &[src.all()], good)).unwrap();
    ep.post_send(&SendWr::send(2, &[src.slice(0..8).unwrap()]))
        .unwrap();
    ep.post_send(&SendWr::write(3, &[src.all()], bad)).unwrap();
    ep.post_send(&SendWr::write(4, &[src.all()], good)).unwrap();
    for _ in 0..8 {
        let _ = read_fpdu(&mut raw); // four messages, each with its zero-length Read
    }
    // Refuse the third request (by its second segment's offset, were it segmented), with
    // none of the zero-length Reads answered.
    raw.write_all(&fpdu(
        Header::Untagged {
            last: true,
            opcode: opcode::TERMINATE,
            ulp: 0,
            qn: qn::TERMINATE,
            msn: 1,
            mo: 0,
        },
        &siw_tagged_terminate(0x00, bad.key, bad.addr + 16),
        false,
    ))
    .unwrap();
    let got = statuses(&srv.cq, 4);
    assert_eq!(
        got,
        [
            (1, Status::Success),
            (2, Status::Success),
            (3, Status::Error(ErrorKind::RemoteAccess)),
            (4, Status::Error(ErrorKind::Flushed)),
        ]
    );
    wait_state(&ep, EndpointState::Error);
}

#[test]
fn terminate_without_a_copied_header_blames_the_oldest_request() {
    let (srv, ep, mut raw) = connected_raw(false);
    let (src, remote) = write_source(&srv);
    ep.post_send(&SendWr::write(1, &[src.all()], remote))
        .unwrap();
    ep.post_send(&SendWr::write(2, &[src.all()], remote))
        .unwrap();
    for _ in 0..4 {
        let _ = read_fpdu(&mut raw);
    }
    raw.write_all(&fpdu(
        Header::Untagged {
            last: true,
            opcode: opcode::TERMINATE,
            ulp: 0,
            qn: qn::TERMINATE,
            msn: 1,
            mo: 0,
        },
        &fabric_tcp::wire::ddp::term::DDP_INVALID_STAG.encode(),
        false,
    ))
    .unwrap();
    let got = statuses(&srv.cq, 2);
    assert_eq!(
        got,
        [
            (1, Status::Error(ErrorKind::RemoteAccess)),
            (2, Status::Error(ErrorKind::Flushed)),
        ]
    );
    let _ = ep;
}

#[test]
fn graceful_close_writes_the_close_mark_into_an_iwarp_provider_peer() {
    // The iwarp provider's private-data frame names its credit area; a graceful close
    // writes the close mark there before the stream ends (iWARP gives a close and a
    // failure the same signal otherwise).
    let area = fabric_api::pdata::AreaDesc {
        addr: 0x7000_0000,
        stag: 0x4242,
    };
    let (_srv, ep, mut raw) =
        connected_raw_with(false, &fabric_api::pdata::frame(b"app", Some(area)));
    assert_eq!(ep.peer_private_data(), b"app");
    // As the acceptor: no hello mark and no filler sends (the reply's frame told the peer
    // who we are; an MPA responder must not send before the initiator's first FPDU).
    drop(ep);
    let (h, payload) = read_fpdu(&mut raw);
    match h {
        Header::Tagged {
            opcode: opcode::WRITE,
            stag,
            to,
            last: true,
        } => {
            assert_eq!(stag, area.stag);
            assert_eq!(to, area.addr + fabric_api::pdata::area::CLOSED as u64);
        }
        other => panic!("expected the close mark (an RDMA Write), got {other:?}"),
    }
    assert_eq!(payload.len(), 8);
    assert_ne!(payload, [0; 8], "the close mark is a non-zero word");
    let mut rest = Vec::new();
    raw.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "bytes after the close mark: {rest:?}");
}

#[test]
fn graceful_close_to_a_foreign_peer_just_ends_the_stream() {
    let (_srv, ep, mut raw) = connected_raw(false);
    drop(ep);
    let mut rest = Vec::new();
    raw.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "bytes on close: {rest:?}");
}

/// An RDMA Write FPDU of `payload` at (`stag`, `to`), in one segment.
fn tagged_write(stag: u32, to: u64, payload: &[u8]) -> Vec<u8> {
    fpdu(
        Header::Tagged {
            last: true,
            opcode: opcode::WRITE,
            stag,
            to,
        },
        payload,
        false,
    )
}

/// Reads one FPDU and checks that it is an RDMA Write of 8 bytes at `to` of `stag`;
/// returns the word.
fn expect_word_write(raw: &mut TcpStream, stag: u32, to: u64) -> u64 {
    let (h, payload) = read_fpdu(raw);
    match h {
        Header::Tagged {
            opcode: opcode::WRITE,
            stag: s,
            to: t,
            last: true,
        } if s == stag && t == to => {}
        other => panic!("expected an RDMA Write to {stag:#x} at {to:#x}, got {other:?}"),
    }
    u64::from_ne_bytes(payload.try_into().expect("an 8-byte word"))
}

/// Nothing arrives on `raw` for a while (a send held back for credits).
fn expect_silence(raw: &mut TcpStream) {
    let end = Instant::now() + Duration::from_millis(300);
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        raw.set_read_timeout(Some(left)).unwrap();
        let mut len = [0u8; 2];
        match raw.read(&mut len[..1]) {
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                break
            }
            Ok(1) if SKIP_HELLO.get().is_some() => {
                raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                raw.read_exact(&mut len[1..]).unwrap();
                let (h, payload) = read_fpdu_rest(raw, len);
                assert!(
                    skipped_hello(&h, &payload),
                    "expected nothing while the send waits for credits, got {h:?}"
                );
            }
            other => panic!("expected nothing while the send waits for credits, got {other:?}"),
        }
    }
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
}

/// Against a peer that runs the iwarp provider's credit protocol (its area `peer`, ours
/// `ours`): sends wait for the peer's posted receives, in order with what follows them,
/// and our receives are counted into the peer's area.
fn credits_flow_both_ways(
    domain: &TcpDomain,
    ep: &TcpEndpoint,
    raw: &mut TcpStream,
    peer: fabric_api::pdata::AreaDesc,
    ours: fabric_api::pdata::AreaDesc,
    first_msn: u32,
    recvs_before: u64,
) {
    use fabric_api::pdata::area;
    assert!(ep.ops().contains(fabric_api::OpSet::RNR_WAIT));
    let mr = domain
        .register(
            Arc::new(Buffer::from_slice(b"credit!!")),
            Access::LOCAL_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    // No credit: the send and the write posted behind it wait.
    ep.post_send(&SendWr::send(1, &[mr.all()])).unwrap();
    ep.post_send(&SendWr::write(
        2,
        &[mr.all()],
        fabric_api::RemoteAddr {
            addr: 0x1000,
            key: 0x99,
        },
    ))
    .unwrap();
    expect_silence(raw);
    // One credit: the send leaves (with its delivery read: a foreign-style peer without
    // delivery acks), then the write behind it.
    raw.write_all(&tagged_write(
        ours.stag,
        ours.addr + area::POSTED as u64,
        &1u64.to_ne_bytes(),
    ))
    .unwrap();
    let (h, payload) = read_fpdu(raw);
    assert!(
        matches!(h, Header::Untagged { opcode: opcode::SEND, msn, .. } if msn == first_msn),
        "{h:?}"
    );
    assert_eq!(payload, b"credit!!");
    // The delivery read is not empty, and longer than siw's 32-byte header-inline limit:
    // the peer's whole area (siw fails empty reads it serves while transmitting, and can
    // fail short ones built by its transmit thread).
    let (h, payload) = read_fpdu(raw);
    assert!(
        matches!(
            h,
            Header::Untagged {
                opcode: opcode::READ_REQUEST,
                ..
            }
        ),
        "{h:?}"
    );
    let rr = ReadRequest::decode(&payload).unwrap();
    assert_eq!(
        (rr.size, rr.src_stag, rr.src_to),
        (
            area::READ_LEN as u32,
            peer.stag,
            peer.addr + area::POSTED as u64
        )
    );
    let (h, _) = read_fpdu(raw);
    assert!(
        matches!(
            h,
            Header::Tagged {
                opcode: opcode::WRITE,
                stag: 0x99,
                ..
            }
        ),
        "{h:?}"
    );
    let (h, _) = read_fpdu(raw);
    assert!(
        matches!(
            h,
            Header::Untagged {
                opcode: opcode::READ_REQUEST,
                msn: 2,
                ..
            }
        ),
        "the write's delivery read: {h:?}"
    );
    // The credit is used up: the next send waits again.
    ep.post_send(&SendWr::send(3, &[mr.all()])).unwrap();
    expect_silence(raw);
    // Our receives are counted into the peer's area, one update each here (nothing is
    // queued for the socket).
    let rmr = domain
        .register(Arc::new(Buffer::new(64)), Access::LOCAL_WRITE)
        .unwrap();
    ep.post_recv(&RecvWr::new(10, &[rmr.all()])).unwrap();
    assert_eq!(
        expect_word_write(raw, peer.stag, peer.addr + area::POSTED as u64),
        recvs_before + 1
    );
    ep.post_recv(&RecvWr::new(11, &[rmr.all()])).unwrap();
    assert_eq!(
        expect_word_write(raw, peer.stag, peer.addr + area::POSTED as u64),
        recvs_before + 2
    );
    // The peer's delivery read of our count is served (our area is remotely readable).
    let rr = ReadRequest {
        sink_stag: 0x55,
        sink_to: 0,
        size: 8,
        src_stag: ours.stag,
        src_to: ours.addr + area::POSTED as u64,
    };
    raw.write_all(&fpdu(read_request(1), &rr.encode(), false))
        .unwrap();
    let (h, payload) = read_fpdu(raw);
    assert!(
        matches!(h, Header::Tagged { stag: 0x55, .. }),
        "expected the read response, got {h:?}"
    );
    assert_eq!(u64::from_ne_bytes(payload.try_into().unwrap()), 1);
}

/// A raw peer playing this framework's iwarp provider as the initiator (its request's
/// frame names its credit area, returned last), accepted by a tcp listener.
fn accepted_from_an_iwarp_provider_peer(
    app: &[u8],
) -> (
    Server,
    TcpEndpoint,
    TcpStream,
    Setup,
    fabric_api::pdata::AreaDesc,
) {
    let peer = fabric_api::pdata::AreaDesc {
        addr: 0x7000_0000,
        stag: 0x4242,
    };
    let srv = server(TcpOptions::default());
    let addr = srv.listener.local_addr();
    let user = fabric_api::pdata::frame(app, Some(peer));
    let t = std::thread::spawn(move || raw_connect_with(addr, 2, false, false, &user));
    let ep = accept(&srv, Duration::from_secs(10)).unwrap();
    let (raw, _rep, setup) = t.join().unwrap();
    (srv, ep, raw, setup, peer)
}

#[test]
fn responder_runs_credits_with_an_iwarp_provider_peer() {
    use fabric_api::pdata;
    let (srv, ep, mut raw, setup, peer) = accepted_from_an_iwarp_provider_peer(b"app");
    assert_eq!(ep.peer_private_data(), b"app");
    // Our reply's frame names a real credit area.
    let (app, ours) = pdata::unframe(&setup.user, true).unwrap();
    assert_eq!(app, Vec::<u8>::new());
    let ours = ours.expect("a credit area in the reply's frame");
    assert!(ours.addr != 0 && ours.stag != 0, "{ours:?}");
    // As the responder nothing leaves before the initiator's first FPDU (siw's initiator
    // fails the connection on bytes right behind the MPA Reply): not even credit updates.
    let rmr = srv
        .domain
        .register(Arc::new(Buffer::new(64)), Access::LOCAL_WRITE)
        .unwrap();
    ep.post_recv(&RecvWr::new(9, &[rmr.all()])).unwrap();
    expect_silence(&mut raw);
    // The iwarp provider as the initiator speaks first: its credit update (zero).
    raw.write_all(&tagged_write(
        ours.stag,
        ours.addr + pdata::area::POSTED as u64,
        &0u64.to_ne_bytes(),
    ))
    .unwrap();
    assert_eq!(
        expect_word_write(&mut raw, peer.stag, peer.addr + pdata::area::POSTED as u64),
        1
    );
    credits_flow_both_ways(&srv.domain, &ep, &mut raw, peer, ours, 1, 1);
}

/// Connects a tcp endpoint (private data "cli") to a raw listener that plays this
/// framework's iwarp provider: it checks the request carries no frame (the listener may be any
/// iWARP stack) and replies with `user` as its private data (frame, credit area, trailer).
fn dial_iwarp_listener(user: Vec<u8>) -> (TcpDomain, TcpCq, TcpEndpoint, TcpStream) {
    let domain = TcpDomain::open(TcpOptions::default()).unwrap();
    let cq = domain.create_cq(64).unwrap();
    let (ep, raw) = dial_iwarp_listener_on(&domain, &cq, &cq, user);
    (domain, cq, ep, raw)
}

/// [`dial_iwarp_listener`] from `domain`, with the endpoint's sends completing on
/// `send_cq` and its receives on `recv_cq`.
fn dial_iwarp_listener_on(
    domain: &TcpDomain,
    send_cq: &TcpCq,
    recv_cq: &TcpCq,
    user: Vec<u8>,
) -> (TcpEndpoint, TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut h = [0u8; mpa::HEADER_LEN];
        s.read_exact(&mut h).unwrap();
        let (mut req, pd_len) = MpaFrame::decode_header(&h, false).unwrap();
        req.private_data = vec![0; pd_len];
        s.read_exact(&mut req.private_data).unwrap();
        assert_eq!(Setup::of(&req).unwrap().user, b"cli");
        let rep = MpaFrame {
            reply: true,
            markers: false,
            crc: false,
            reject: false,
            enhanced: true,
            ext_offer: false,
            revision: 2,
            private_data: Setup {
                enhanced: Some(Enhanced {
                    ird: 8,
                    ord: 8,
                    peer_to_peer: false,
                    rtr: RtrKinds::default(),
                }),
                ext: None,
                user,
            }
            .encode(),
        };
        s.write_all(&rep.encode()).unwrap();
        s
    });
    let mut cfg = EndpointConfig::new(send_cq);
    cfg.recv_cq = recv_cq;
    cfg.private_data = b"cli";
    let ep = domain.connect(addr, &cfg).unwrap();
    let raw = t.join().unwrap();
    assert_eq!(ep.peer_private_data(), b"srv");
    (ep, raw)
}

#[test]
fn manual_progress_repeats_the_hello_from_either_queue_once_each() {
    use fabric_api::pdata::{self, area};
    let peer = pdata::AreaDesc {
        addr: 0x6000_0000,
        stag: 0x1717,
    };
    let domain = TcpDomain::open(TcpOptions {
        progress: fabric_tcp::ProgressMode::Manual,
        ..TcpOptions::default()
    })
    .unwrap();
    let (scq, rcq) = (domain.create_cq(64).unwrap(), domain.create_cq(64).unwrap());
    let before = Instant::now();
    let (_ep, mut raw) =
        dial_iwarp_listener_on(&domain, &scq, &rcq, pdata::frame(b"srv", Some(peer)));
    let hello = (peer.stag, peer.addr + area::HELLO as u64);
    let is_hello = |h: &Header, payload: &[u8]| {
        matches!(h, Header::Tagged { opcode: opcode::WRITE, stag, to, .. } if (*stag, *to) == hello)
            && payload == 1u64.to_ne_bytes()
    };
    // The area's descriptor, the mark, the fillers.
    let mut marks = 0;
    for _ in 0..6 {
        let (h, payload) = read_fpdu(&mut raw);
        marks += usize::from(is_hello(&h, &payload));
    }
    assert_eq!(marks, 1);
    // No thread: the repeats come from the application's looks, at either queue, each
    // written once although both queues' sets hold it. Up to 400 ms after the connect
    // began (at least 50 ms after the fillers came, on a loaded machine), the repeats due
    // at 20 ms and 100 ms after the mark (the next is due at 500 ms).
    let end = (before + Duration::from_millis(400)).max(Instant::now() + Duration::from_millis(50));
    let mut repeats = 0;
    let mut out = Vec::new();
    raw.set_read_timeout(Some(Duration::from_millis(10)))
        .unwrap();
    while Instant::now() < end {
        scq.poll(&mut out, 8).unwrap();
        rcq.poll(&mut out, 8).unwrap();
        let mut len = [0u8; 2];
        match raw.read(&mut len[..1]) {
            Ok(1) => {
                raw.read_exact(&mut len[1..]).unwrap();
                let (h, payload) = read_fpdu_rest(&mut raw, len);
                assert!(is_hello(&h, &payload), "{h:?}");
                repeats += 1;
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(
        (1..=2).contains(&repeats),
        "{repeats} repeats in the window"
    );
}

#[test]
fn initiator_names_its_credit_area_before_the_hello_mark() {
    use fabric_api::pdata::{self, area};
    let peer = pdata::AreaDesc {
        addr: 0x6000_0000,
        stag: 0x1717,
    };
    let (domain, _cq, ep, mut raw) = dial_iwarp_listener(pdata::frame(b"srv", Some(peer)));
    // First our area's descriptor, then the hello mark, then the filler sends.
    let (h, payload) = read_fpdu(&mut raw);
    match h {
        Header::Tagged {
            opcode: opcode::WRITE,
            stag,
            to,
            last: true,
        } => {
            assert_eq!(stag, peer.stag);
            assert_eq!(to, peer.addr + area::AREA_OF_PEER as u64);
        }
        other => panic!("expected our area's descriptor, got {other:?}"),
    }
    assert_eq!(payload.len(), 16);
    let ours = pdata::AreaDesc {
        addr: u64::from_ne_bytes(payload[..8].try_into().unwrap()),
        stag: u64::from_ne_bytes(payload[8..].try_into().unwrap()) as u32,
    };
    assert!(ours.addr != 0 && ours.stag != 0, "{ours:?}");
    assert_ne!(
        expect_word_write(&mut raw, peer.stag, peer.addr + area::HELLO as u64),
        0
    );
    for msn in 1..=4 {
        let (h, payload) = read_fpdu(&mut raw);
        assert!(
            matches!(h, Header::Untagged { opcode: opcode::SEND, msn: m, .. } if m == msn),
            "{h:?}"
        );
        assert!(payload.is_empty());
    }
    // The mark is written again: siw may have missed the first one (see `HELLO_REPEATS`).
    assert_ne!(
        expect_word_write(&mut raw, peer.stag, peer.addr + area::HELLO as u64),
        0,
        "the hello mark repeated"
    );
    // The repeats go on through the rest: passed over.
    SKIP_HELLO.set(Some((peer.stag, peer.addr + area::HELLO as u64)));
    // The fillers took no credit: the application's first send needs the peer's first
    // receive.
    credits_flow_both_ways(&domain, &ep, &mut raw, peer, ours, 5, 0);
    // The application's messages do not end them (they may have met siw's deaf moment
    // too): the last repeat, 2.5 s after the mark, still comes.
    SKIP_HELLO.set(None);
    loop {
        let (h, payload) = read_fpdu(&mut raw);
        if matches!(h, Header::Tagged { opcode: opcode::WRITE, stag, to, .. }
            if stag == peer.stag && to == peer.addr + area::HELLO as u64)
        {
            assert_eq!(payload, 1u64.to_ne_bytes());
            break;
        }
    }
}

#[test]
fn no_credits_against_a_foreign_peer_or_between_tcp_endpoints() {
    // A foreign iWARP peer: no area in our reply, sends leave at once, no RNR_WAIT.
    let (_srv, ep, mut raw) = connected_raw(false);
    assert!(!ep.ops().contains(fabric_api::OpSet::RNR_WAIT));
    let mr = _srv
        .domain
        .register(Arc::new(Buffer::from_slice(b"now")), Access::LOCAL_WRITE)
        .unwrap();
    ep.post_send(&SendWr::send(1, &[mr.all()])).unwrap();
    let (h, payload) = read_fpdu(&mut raw);
    assert!(
        matches!(
            h,
            Header::Untagged {
                opcode: opcode::SEND,
                ..
            }
        ),
        "{h:?}"
    );
    assert_eq!(payload, b"now");
}

#[test]
fn credit_updates_coalesce_behind_a_full_socket() {
    use fabric_api::pdata::{self, area};
    let (srv, ep, mut raw, setup, peer) = accepted_from_an_iwarp_provider_peer(b"");
    let ours = pdata::unframe(&setup.user, true).unwrap().1.unwrap();
    // The initiator speaks first (else, as the responder, we would send nothing).
    raw.write_all(&tagged_write(
        ours.stag,
        ours.addr + area::POSTED as u64,
        &0u64.to_ne_bytes(),
    ))
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // A large write fills the socket while the peer does not read.
    const BIG: usize = 32 << 20;
    let src = srv
        .domain
        .register(Arc::new(Buffer::new(BIG)), Access::LOCAL_WRITE)
        .unwrap();
    ep.post_send(&SendWr::write(
        1,
        &[src.all()],
        fabric_api::RemoteAddr { addr: 0, key: 0x99 },
    ))
    .unwrap();
    let rmr = srv
        .domain
        .register(Arc::new(Buffer::new(64)), Access::LOCAL_WRITE)
        .unwrap();
    for i in 0..3 {
        ep.post_recv(&RecvWr::new(10 + i, &[rmr.all()])).unwrap();
    }
    // The write, its delivery read, then the first update (queued behind the write) and
    // one more carrying the newest count: the second receive's update was coalesced.
    let mut got = 0;
    loop {
        let (h, payload) = read_fpdu(&mut raw);
        match h {
            Header::Tagged {
                opcode: opcode::WRITE,
                stag: 0x99,
                last,
                ..
            } => {
                got += payload.len();
                if last {
                    break;
                }
            }
            other => panic!("expected the large write, got {other:?}"),
        }
    }
    assert_eq!(got, BIG);
    let (h, _) = read_fpdu(&mut raw);
    assert!(
        matches!(
            h,
            Header::Untagged {
                opcode: opcode::READ_REQUEST,
                ..
            }
        ),
        "{h:?}"
    );
    let posted = peer.addr + area::POSTED as u64;
    assert_eq!(expect_word_write(&mut raw, peer.stag, posted), 1);
    assert_eq!(expect_word_write(&mut raw, peer.stag, posted), 3);
    expect_silence(&mut raw);
}

/// Reads one FPDU and checks that it is an RDMA Write at `to` of `stag`; returns its
/// payload.
fn expect_write_at(raw: &mut TcpStream, stag: u32, to: u64) -> Vec<u8> {
    let (h, payload) = read_fpdu(raw);
    match h {
        Header::Tagged {
            opcode: opcode::WRITE,
            stag: s,
            to: t,
            last: true,
        } if s == stag && t == to => payload,
        other => panic!("expected an RDMA Write to {stag:#x} at {to:#x}, got {other:?}"),
    }
}

/// The little-endian words of an emulation slot's bytes.
fn le_words(b: &[u8]) -> Vec<u64> {
    b.chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn responder_speaks_the_iwarp_providers_emulation_when_offered() {
    use fabric_api::emu_wire::{
        self, AmoOp, AmoReply, AmoReq, ExtDesc, ImmRec, FLAG_ATOMICS, FLAG_IMMEDIATE,
    };
    use fabric_api::pdata::{self, area};
    let peer_credit = pdata::AreaDesc {
        addr: 0x7000_0000,
        stag: 0x4242,
    };
    let peer_emu = ExtDesc {
        flags: FLAG_ATOMICS | FLAG_IMMEDIATE,
        imm_slots: 16,
        addr: 0x7100_0000,
        stag: 0x4343,
    };
    let srv = server(TcpOptions::default());
    let addr = srv.listener.local_addr();
    let mut user = pdata::frame(b"app", Some(peer_credit));
    user.extend_from_slice(&peer_emu.encode());
    let t = std::thread::spawn(move || raw_connect_with(addr, 2, false, false, &user));
    let ep = accept(&srv, Duration::from_secs(10)).unwrap();
    let (mut raw, _rep, setup) = t.join().unwrap();
    assert_eq!(
        ep.peer_private_data(),
        b"app",
        "the trailer is not application data"
    );
    let (app, ours) = pdata::unframe(&setup.user, true).unwrap();
    let ours = ours.unwrap();
    let emu = ExtDesc::find(&setup.user, app.len()).expect("our trailer in the reply");
    assert_eq!(emu.flags, FLAG_ATOMICS | FLAG_IMMEDIATE);
    assert!(
        emu.addr != 0 && emu.stag != 0 && emu.imm_slots >= 1,
        "{emu:?}"
    );
    let all =
        fabric_api::OpSet::ATOMICS | fabric_api::OpSet::SEND_IMM | fabric_api::OpSet::WRITE_IMM;
    assert!(ep.ops().contains(all), "{:?}", ep.ops());
    // The initiator speaks first (its credit update); ours follows for the receive.
    let rmr = srv
        .domain
        .register(Arc::new(Buffer::new(64)), Access::LOCAL_WRITE)
        .unwrap();
    ep.post_recv(&RecvWr::new(9, &[rmr.all()])).unwrap();
    raw.write_all(&tagged_write(
        ours.stag,
        ours.addr + area::POSTED as u64,
        &0u64.to_ne_bytes(),
    ))
    .unwrap();
    assert_eq!(
        expect_word_write(
            &mut raw,
            peer_credit.stag,
            peer_credit.addr + area::POSTED as u64
        ),
        1
    );

    // A request executes the moment it is written, answered into the peer's reply slot.
    let target = srv
        .domain
        .register(
            Arc::new(Buffer::new(64)),
            Access::LOCAL_WRITE | Access::REMOTE_ATOMIC,
        )
        .unwrap();
    target.buffer().write(8, &40u64.to_ne_bytes());
    let req = |seq, rkey| AmoReq {
        seq,
        op: AmoOp::FetchAdd { add: 2 },
        addr: target.buffer().addr() + 8,
        rkey,
    };
    let req_at = emu.addr + emu_wire::REQ_OFF as u64;
    let reply_at = peer_emu.addr + emu_wire::REPLY_OFF as u64;
    raw.write_all(&tagged_write(
        emu.stag,
        req_at,
        &req(1, target.desc().key).encode(),
    ))
    .unwrap();
    let rep = expect_write_at(&mut raw, peer_emu.stag, reply_at);
    assert_eq!(
        AmoReply::decode(&le_words(&rep)),
        Some(AmoReply {
            seq: 1,
            result: Ok(40)
        })
    );
    assert_eq!(target.buffer().read_pod::<u64>(8), 42);
    // A request whose check fails (torn, garbage) is not executed; nor is an old one.
    let mut bad = req(2, target.desc().key).encode();
    bad[50] ^= 1;
    raw.write_all(&tagged_write(emu.stag, req_at, &bad))
        .unwrap();
    raw.write_all(&tagged_write(
        emu.stag,
        req_at,
        &req(1, target.desc().key).encode(),
    ))
    .unwrap();
    expect_silence(&mut raw);
    assert_eq!(target.buffer().read_pod::<u64>(8), 42);

    // A send lands with the immediate of its ordinal's ring slot (the first send: 0).
    let rec = ImmRec {
        kind: emu_wire::IMM_SEND,
        imm: 0xfeed_f00d,
        len: 0,
    };
    raw.write_all(&tagged_write(
        emu.stag,
        emu.addr + emu_wire::IMM_OFF as u64,
        &rec.encode(0),
    ))
    .unwrap();
    raw.write_all(&fpdu(send(1, true, 0), b"imm", false))
        .unwrap();
    let c = wait_completion(&srv.cq);
    assert_eq!(
        (c.context, c.opcode, c.byte_len, c.imm),
        (9, Opcode::Recv, 3, Some(0xfeed_f00d))
    );

    // A key without REMOTE_ATOMIC: refused with RemoteAccess in the reply, and the
    // endpoint enters the error state (the iwarp provider's peer does too).
    let plain = srv
        .domain
        .register(
            Arc::new(Buffer::new(64)),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let mut r = req(2, plain.desc().key);
    r.addr = plain.buffer().addr();
    raw.write_all(&tagged_write(emu.stag, req_at, &r.encode()))
        .unwrap();
    let rep = expect_write_at(&mut raw, peer_emu.stag, reply_at);
    assert_eq!(
        AmoReply::decode(&le_words(&rep)),
        Some(AmoReply {
            seq: 2,
            result: Err(ErrorKind::RemoteAccess)
        })
    );
    wait_state(&ep, EndpointState::Error);
}

/// Waits up to 5 s for one completion on `cq`.
fn wait_completion(cq: &TcpCq) -> fabric_api::Completion {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut out = Vec::new();
    loop {
        if cq.poll(&mut out, 1).unwrap() == 1 {
            return out.remove(0);
        }
        assert!(Instant::now() < deadline, "no completion within 5 s");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn initiator_names_its_emulation_area_and_speaks_the_emulation() {
    use fabric_api::emu_wire::{
        self, AmoOp, AmoReply, AmoReq, Announcement, ExtDesc, ImmRec, FLAG_ATOMICS, FLAG_IMMEDIATE,
    };
    use fabric_api::pdata::{self, area};
    let peer = pdata::AreaDesc {
        addr: 0x6000_0000,
        stag: 0x1717,
    };
    let peer_emu = ExtDesc {
        flags: FLAG_ATOMICS | FLAG_IMMEDIATE,
        imm_slots: 4,
        addr: 0x6100_0000,
        stag: 0x1818,
    };
    let mut user = pdata::frame(b"srv", Some(peer));
    user.extend_from_slice(&peer_emu.encode());
    let (domain, cq, ep, mut raw) = dial_iwarp_listener(user);
    let all =
        fabric_api::OpSet::ATOMICS | fabric_api::OpSet::SEND_IMM | fabric_api::OpSet::WRITE_IMM;
    assert!(ep.ops().contains(all), "{:?}", ep.ops());
    // Our emulation area first, then our credit area, then the hello mark, the fillers.
    let ann = expect_write_at(&mut raw, peer.stag, peer.addr + area::EMU_OF_PEER as u64);
    let w = |i: usize| u64::from_ne_bytes(ann[8 * i..8 * i + 8].try_into().unwrap());
    let ours = Announcement::decode(w(0), w(1)).expect("a valid announcement");
    assert!(
        ours.addr != 0 && ours.stag != 0 && ours.imm_slots >= 1,
        "{ours:?}"
    );
    let credit = expect_write_at(&mut raw, peer.stag, peer.addr + area::AREA_OF_PEER as u64);
    let our_credit = pdata::AreaDesc {
        addr: u64::from_ne_bytes(credit[..8].try_into().unwrap()),
        stag: u64::from_ne_bytes(credit[8..].try_into().unwrap()) as u32,
    };
    assert_ne!(
        expect_word_write(&mut raw, peer.stag, peer.addr + area::HELLO as u64),
        0
    );
    for _ in 0..4 {
        let (h, _) = read_fpdu(&mut raw);
        assert!(
            matches!(
                h,
                Header::Untagged {
                    opcode: opcode::SEND,
                    ..
                }
            ),
            "{h:?}"
        );
    }

    // An atomic: the request into the peer's request slot; it completes with the reply
    // written into ours.
    let result = domain
        .register(Arc::new(Buffer::new(8)), Access::LOCAL_WRITE)
        .unwrap();
    let remote = fabric_api::RemoteAddr {
        addr: 0x9000_0008,
        key: 0x77,
    };
    // Repeats of the hello mark come among what follows: passed over.
    SKIP_HELLO.set(Some((peer.stag, peer.addr + area::HELLO as u64)));
    ep.post_send(&SendWr::fetch_add(5, result.all(), remote, 3))
        .unwrap();
    let req = expect_write_at(
        &mut raw,
        peer_emu.stag,
        peer_emu.addr + emu_wire::REQ_OFF as u64,
    );
    assert_eq!(
        AmoReq::decode(&le_words(&req)),
        Some(AmoReq {
            seq: 1,
            op: AmoOp::FetchAdd { add: 3 },
            addr: remote.addr,
            rkey: remote.key
        })
    );
    // A second one waits for the first's reply (one request slot).
    ep.post_send(&SendWr::fetch_add(6, result.all(), remote, 1))
        .unwrap();
    expect_silence(&mut raw);
    let reply_at = ours.addr + emu_wire::REPLY_OFF as u64;
    // A reply with a bad check is ignored.
    let mut bad = AmoReply {
        seq: 1,
        result: Ok(1),
    }
    .encode();
    bad[20] ^= 4;
    raw.write_all(&tagged_write(ours.stag, reply_at, &bad))
        .unwrap();
    expect_silence(&mut raw);
    raw.write_all(&tagged_write(
        ours.stag,
        reply_at,
        &AmoReply {
            seq: 1,
            result: Ok(41),
        }
        .encode(),
    ))
    .unwrap();
    let c = wait_completion(&cq);
    assert_eq!((c.context, c.status, c.byte_len), (5, Status::Success, 8));
    assert_eq!(result.buffer().read_pod::<u64>(0), 41);
    let req = expect_write_at(
        &mut raw,
        peer_emu.stag,
        peer_emu.addr + emu_wire::REQ_OFF as u64,
    );
    assert_eq!(AmoReq::decode(&le_words(&req)).unwrap().seq, 2);
    raw.write_all(&tagged_write(
        ours.stag,
        reply_at,
        &AmoReply {
            seq: 2,
            result: Ok(44),
        }
        .encode(),
    ))
    .unwrap();
    assert_eq!(wait_completion(&cq).context, 6);

    // A send with immediate data: its record into the peer's ring slot of its ordinal (the
    // first send: fillers do not count), then the send, once the peer granted a receive.
    let src = domain
        .register(Arc::new(Buffer::from_slice(b"hi")), Access::LOCAL_WRITE)
        .unwrap();
    ep.post_send(&SendWr::send(7, &[src.all()]).with_imm(0xabcd))
        .unwrap();
    expect_silence(&mut raw);
    raw.write_all(&tagged_write(
        our_credit.stag,
        our_credit.addr + area::POSTED as u64,
        &1u64.to_ne_bytes(),
    ))
    .unwrap();
    let rec = expect_write_at(
        &mut raw,
        peer_emu.stag,
        peer_emu.addr + emu_wire::IMM_OFF as u64,
    );
    assert_eq!(
        rec,
        ImmRec {
            kind: emu_wire::IMM_SEND,
            imm: 0xabcd,
            len: 0
        }
        .encode(0)
    );
    let (h, payload) = read_fpdu(&mut raw);
    assert!(
        matches!(
            h,
            Header::Untagged {
                opcode: opcode::SEND,
                ulp: 0,
                ..
            }
        ),
        "a plain Send: {h:?}"
    );
    assert_eq!(payload, b"hi");

    // A refused atomic: the reply's error completes it and the endpoint is in error.
    ep.post_send(&SendWr::fetch_add(8, result.all(), remote, 1))
        .unwrap();
    loop {
        let (h, _) = read_fpdu(&mut raw);
        if matches!(h, Header::Tagged { stag, .. } if stag == peer_emu.stag) {
            break;
        }
    }
    raw.write_all(&tagged_write(
        ours.stag,
        reply_at,
        &AmoReply {
            seq: 3,
            result: Err(ErrorKind::RemoteAccess),
        }
        .encode(),
    ))
    .unwrap();
    let mut seen = Vec::new();
    while !seen.iter().any(|c: &fabric_api::Completion| c.context == 8) {
        seen.push(wait_completion(&cq));
    }
    let c = seen.iter().find(|c| c.context == 8).unwrap();
    assert_eq!(c.status, Status::Error(ErrorKind::RemoteAccess));
    wait_state(&ep, EndpointState::Error);
}

/// A peer on this framework's iwarp provider whose connection ends without its close mark
/// while a write is unfinished most likely refused that write: its device may reset the
/// connection before its Terminate leaves (siw; `fault.deregister_while_peer_writes` in the
/// mixed pairs caught it). The write fails `RemoteAccess` and the endpoint fails. With the
/// mark written first, the same end is a close: the write is flushed, the peer closed.
#[test]
fn an_end_without_the_close_mark_is_taken_as_a_refusal() {
    use fabric_api::pdata;
    for marked in [false, true] {
        let (srv, ep, mut raw, setup, _peer) = accepted_from_an_iwarp_provider_peer(b"app");
        let (_, ours) = pdata::unframe(&setup.user, true).unwrap();
        let ours = ours.expect("a credit area in the reply's frame");
        // The initiator speaks first (its credit update); then the connection runs.
        raw.write_all(&tagged_write(
            ours.stag,
            ours.addr + pdata::area::POSTED as u64,
            &0u64.to_ne_bytes(),
        ))
        .unwrap();
        let (src, remote) = write_source(&srv);
        ep.post_send(&SendWr::write(1, &[src.all()], remote))
            .unwrap();
        // Everything the endpoint sends (the write, its delivery read, a credit update) is
        // read, so that the end below is a FIN, never a reset over unread bytes.
        raw.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut sink = [0u8; 4096];
        while matches!(raw.read(&mut sink), Ok(n) if n > 0) {}
        if marked {
            raw.write_all(&tagged_write(
                ours.stag,
                ours.addr + pdata::area::CLOSED as u64,
                &1u64.to_ne_bytes(),
            ))
            .unwrap();
        }
        drop(raw);
        let want = if marked {
            (ErrorKind::Flushed, EndpointState::Disconnected)
        } else {
            (ErrorKind::RemoteAccess, EndpointState::Error)
        };
        let got = statuses(&srv.cq, 1);
        assert_eq!(got, [(1, Status::Error(want.0))], "marked {marked}");
        wait_state(&ep, want.1);
    }
}
