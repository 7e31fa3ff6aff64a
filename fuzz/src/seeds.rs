//! The seed corpus: valid (and a few deliberately refused) frames made by the wire
//! encoders. `cargo run --example gen_corpus` (in `fuzz/`) writes them to
//! `fuzz/corpus/<target>/<name>`.

use fabric_tcp::wire::ddp::{
    atomic_op, opcode, qn, term, AtomicRequest, AtomicResponse, Header, ReadRequest,
};
use fabric_tcp::wire::mpa::{features, Enhanced, ExtBlock, MpaFrame, RtrKinds, Setup};

use crate::connection::{config, request, slot};
use crate::stream::{fpdu, STAG_PLACEHOLDER, TO_PLACEHOLDER};

/// One seed: target, file name, bytes.
pub type Seed = (&'static str, &'static str, Vec<u8>);

/// Every seed of every target.
pub fn all() -> Vec<Seed> {
    let mut v = mpa();
    v.extend(ddp());
    v.extend(connection());
    v
}

fn enhanced(p2p: bool) -> Enhanced {
    Enhanced {
        ird: 64,
        ord: 8,
        peer_to_peer: p2p,
        rtr: RtrKinds {
            send: p2p,
            write: false,
            read: p2p,
        },
    }
}

fn frame(reply: bool, revision: u8, crc: bool, ext_offer: bool, pd: Vec<u8>) -> MpaFrame {
    MpaFrame {
        reply,
        markers: false,
        crc,
        reject: false,
        enhanced: revision >= 2,
        ext_offer,
        revision,
        private_data: pd,
    }
}

fn mpa() -> Vec<Seed> {
    let req_pd = Setup {
        enhanced: Some(enhanced(false)),
        ext: None,
        user: b"app".to_vec(),
    }
    .encode();
    let rep_pd = Setup {
        enhanced: Some(enhanced(false)),
        ext: Some(ExtBlock {
            version: ExtBlock::VERSION,
            features: features::ALL,
        }),
        user: b"ok".to_vec(),
    }
    .encode();
    let p2p_pd = Setup {
        enhanced: Some(enhanced(true)),
        ext: None,
        user: Vec::new(),
    }
    .encode();
    let mut reject = frame(
        true,
        2,
        false,
        false,
        b"MPA markers are not supported".to_vec(),
    );
    reject.reject = true;
    reject.enhanced = false;
    let mut markers = frame(false, 2, false, false, req_pd.clone());
    markers.markers = true;
    vec![
        (
            "mpa",
            "request-v2",
            frame(false, 2, false, false, req_pd.clone()).encode(),
        ),
        (
            "mpa",
            "request-v2-crc-ext",
            frame(false, 2, true, true, req_pd).encode(),
        ),
        (
            "mpa",
            "request-v1",
            frame(false, 1, false, false, b"v1".to_vec()).encode(),
        ),
        (
            "mpa",
            "request-p2p-rtr",
            frame(false, 2, false, false, p2p_pd).encode(),
        ),
        ("mpa", "request-markers", markers.encode()),
        (
            "mpa",
            "reply-ext-block",
            frame(true, 2, false, true, rep_pd).encode(),
        ),
        ("mpa", "reply-reject", reject.encode()),
    ]
}

fn ulpdu(h: Header, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    h.encode_into(&mut b);
    b.extend_from_slice(payload);
    b
}

fn untagged(op: u8, ulp: u32, q: u32, msn: u32, mo: u32, last: bool) -> Header {
    Header::Untagged {
        last,
        opcode: op,
        ulp,
        qn: q,
        msn,
        mo,
    }
}

fn tagged(op: u8, stag: u32, to: u64, last: bool) -> Header {
    Header::Tagged {
        last,
        opcode: op,
        stag,
        to,
    }
}

fn read_request(src_stag: u32, src_to: u64, size: u32) -> [u8; ReadRequest::LEN] {
    ReadRequest {
        sink_stag: 0x77,
        sink_to: 0x1000,
        size,
        src_stag,
        src_to,
    }
    .encode()
}

fn atomic(op: u32, stag: u32, to: u64) -> [u8; AtomicRequest::LEN] {
    AtomicRequest {
        op,
        req_id: 1,
        stag,
        to,
        add_swap: 5,
        add_swap_mask: !0,
        compare: 0xa2a2_a2a2_a2a2_a2a2,
        compare_mask: !0,
    }
    .encode()
}

fn ddp() -> Vec<Seed> {
    // A Terminate as siw sends it for a refused RDMA Write: control (layer in the low
    // nibble), MPA length, then the copied tagged header.
    let mut siw_term = vec![0x11, 0x00, 0x03, 0x00, 0x00, 0x0e];
    tagged(opcode::WRITE, 0xabcd, 0x1122_3344, true).encode_into(&mut siw_term);
    let mut imm = [0u8; 8];
    imm[..4].copy_from_slice(&7u32.to_be_bytes());
    vec![
        (
            "ddp",
            "write",
            ulpdu(tagged(opcode::WRITE, 0x1234, 0x10_0000, true), b"data"),
        ),
        (
            "ddp",
            "read-response",
            ulpdu(tagged(opcode::READ_RESPONSE, 0x77, 0x1000, true), b"3456"),
        ),
        (
            "ddp",
            "send",
            ulpdu(untagged(opcode::SEND, 0, qn::SEND, 1, 0, true), b"hello"),
        ),
        (
            "ddp",
            "read-request",
            ulpdu(
                untagged(opcode::READ_REQUEST, 0, qn::READ, 1, 0, true),
                &read_request(0x42, 0x2000, 16),
            ),
        ),
        (
            "ddp",
            "terminate",
            ulpdu(
                untagged(opcode::TERMINATE, 0, qn::TERMINATE, 1, 0, true),
                &term::BASE_BOUNDS.encode(),
            ),
        ),
        (
            "ddp",
            "terminate-siw-copy",
            ulpdu(
                untagged(opcode::TERMINATE, 0, qn::TERMINATE, 1, 0, true),
                &siw_term,
            ),
        ),
        (
            "ddp",
            "atomic-request",
            ulpdu(
                untagged(opcode::ATOMIC_REQUEST, 0, qn::ATOMIC, 1, 0, true),
                &atomic(atomic_op::COMPARE_SWAP, 0x42, 0x2008),
            ),
        ),
        (
            "ddp",
            "atomic-response",
            ulpdu(
                untagged(opcode::ATOMIC_RESPONSE, 0, qn::ATOMIC, 1, 0, true),
                &AtomicResponse {
                    req_id: 1,
                    original: 9,
                }
                .encode(),
            ),
        ),
        (
            "ddp",
            "immediate",
            ulpdu(untagged(opcode::IMMEDIATE, 0, qn::SEND, 2, 0, true), &imm),
        ),
        (
            "ddp",
            "ack",
            ulpdu(untagged(opcode::ACK, 0x8000_0002, qn::ACK, 1, 0, true), &[]),
        ),
    ]
}

fn stag(slot: u16) -> u32 {
    STAG_PLACEHOLDER | u32::from(slot)
}

fn to(slot: u16, offset: i32) -> u64 {
    TO_PLACEHOLDER | (u64::from(slot) << 32) | u64::from(offset as u32)
}

/// FPDUs as a peer sends them (CRC zero: the harness fixes CRCs when CRC is in use).
fn fpdus(msgs: &[(Header, &[u8])]) -> Vec<u8> {
    msgs.iter().flat_map(|(h, p)| fpdu(h, p, false)).collect()
}

fn with_config(cfg: u8, stream: Vec<u8>) -> Vec<u8> {
    let mut v = vec![cfg];
    v.extend(stream);
    v
}

fn connection() -> Vec<Seed> {
    let w = slot::WRITABLE;
    // Base RDMAP: a write, a read, a two-segment send, a zero-length read.
    let base = fpdus(&[
        (tagged(opcode::WRITE, stag(w), to(w, 8), true), b"written!"),
        (
            untagged(opcode::READ_REQUEST, 0, qn::READ, 1, 0, true),
            &read_request(stag(slot::READABLE), to(slot::READABLE, 4), 16),
        ),
        (untagged(opcode::SEND, 0, qn::SEND, 1, 0, false), b"hello "),
        (untagged(opcode::SEND, 0, qn::SEND, 1, 6, true), b"iwarp"),
        (
            untagged(opcode::READ_REQUEST, 0, qn::READ, 2, 0, true),
            &read_request(0, 0, 0),
        ),
    ]);
    // The extensions: atomics, write with immediate, send with immediate, acks.
    let ext = fpdus(&[
        (
            untagged(opcode::ATOMIC_REQUEST, 0, qn::ATOMIC, 1, 0, true),
            &atomic(
                atomic_op::FETCH_ADD,
                stag(slot::ATOMIC),
                to(slot::ATOMIC, 8),
            ),
        ),
        (
            untagged(opcode::ATOMIC_REQUEST, 0, qn::ATOMIC, 2, 0, true),
            &atomic(atomic_op::COMPARE_SWAP, stag(slot::ALL), to(slot::ALL, 16)),
        ),
        (
            tagged(opcode::WRITE, stag(slot::ALL), to(slot::ALL, 100), true),
            b"imm",
        ),
        (
            untagged(opcode::IMMEDIATE, 0, qn::SEND, 1, 0, true),
            &[0, 0, 0, 9, 0, 0, 0, 0],
        ),
        (
            untagged(opcode::SEND_IMM, 0xfeed, qn::SEND, 2, 0, true),
            b"si",
        ),
        (untagged(opcode::ACK, 0x8000_0001, qn::ACK, 1, 0, true), &[]),
    ]);
    // Refused: beyond the end, a read-only region, a dead key, a canary's address, a
    // misaligned atomic, a send longer than the receive, a bad MSN.
    let refused = |h: Header, p: &[u8]| fpdus(&[(h, p)]);
    let mut v = vec![
        ("connection", "base", with_config(config::RAW, base.clone())),
        (
            "connection",
            "base-crc",
            with_config(config::RAW | config::CRC, base.clone()),
        ),
        (
            "connection",
            "base-rev1",
            with_config(config::RAW | config::REV1, base.clone()),
        ),
        (
            "connection",
            "ext",
            with_config(config::RAW | config::EXT, ext.clone()),
        ),
        (
            "connection",
            "ext-no-receives",
            with_config(config::RAW | config::EXT | config::NO_RECEIVES, ext),
        ),
        (
            "connection",
            "write-beyond-end",
            with_config(
                config::RAW,
                refused(tagged(opcode::WRITE, stag(w), to(w, 60), true), b"12345678"),
            ),
        ),
        (
            "connection",
            "write-read-only",
            with_config(
                config::RAW,
                refused(
                    tagged(
                        opcode::WRITE,
                        stag(slot::READABLE),
                        to(slot::READABLE, 0),
                        true,
                    ),
                    b"x",
                ),
            ),
        ),
        (
            "connection",
            "write-dead-key",
            with_config(
                config::RAW,
                refused(
                    tagged(opcode::WRITE, stag(slot::DEAD), to(slot::DEAD, 0), true),
                    b"x",
                ),
            ),
        ),
        (
            "connection",
            "write-canary-address",
            with_config(
                config::RAW,
                refused(
                    tagged(opcode::WRITE, stag(w), to(slot::CANARY, 0), true),
                    b"x",
                ),
            ),
        ),
        (
            "connection",
            "atomic-misaligned",
            with_config(
                config::RAW | config::EXT,
                refused(
                    untagged(opcode::ATOMIC_REQUEST, 0, qn::ATOMIC, 1, 0, true),
                    &atomic(
                        atomic_op::FETCH_ADD,
                        stag(slot::ATOMIC),
                        to(slot::ATOMIC, 3),
                    ),
                ),
            ),
        ),
        (
            "connection",
            "send-too-long",
            with_config(
                config::RAW,
                refused(untagged(opcode::SEND, 0, qn::SEND, 1, 0, true), &[0x55; 40]),
            ),
        ),
        (
            "connection",
            "bad-msn",
            with_config(
                config::RAW,
                refused(untagged(opcode::SEND, 0, qn::SEND, 5, 0, true), b"late"),
            ),
        ),
        (
            "connection",
            "read-local-only",
            with_config(
                config::RAW,
                refused(
                    untagged(opcode::READ_REQUEST, 0, qn::READ, 1, 0, true),
                    &read_request(stag(slot::LOCAL), to(slot::LOCAL, 0), 8),
                ),
            ),
        ),
    ];
    // Whole streams: the MPA request is part of the input.
    let mut whole = request(2, false, true);
    whole.extend(fpdus(&[(
        tagged(opcode::WRITE, stag(slot::ALL), to(slot::ALL, 0), true),
        b"whole",
    )]));
    v.push(("connection", "whole-ext", with_config(config::WHOLE, whole)));
    let mut whole = request(1, true, false);
    whole.extend(base);
    v.push((
        "connection",
        "whole-v1-crc",
        with_config(config::WHOLE, whole),
    ));
    let mut markers = request(2, false, false);
    markers[16] |= 0x80;
    v.push((
        "connection",
        "whole-markers",
        with_config(config::WHOLE, markers),
    ));
    // Structured inputs (modes 0 and 1): any bytes make operations.
    v.push((
        "connection",
        "ops",
        with_config(config::EXT, (0u8..=255).rev().step_by(3).collect()),
    ));
    v.push((
        "connection",
        "ops-crc",
        with_config(
            config::EXT | config::CRC | 1,
            (0u8..=255).step_by(5).collect(),
        ),
    ));
    v
}
