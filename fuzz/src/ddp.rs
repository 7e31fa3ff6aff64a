//! Properties of the DDP / RDMAP codecs (`fabric_tcp::wire::ddp`).
//!
//! On the raw input, for `Header::decode` and every payload decoder (Read Request, Atomic
//! Request / Response, Terminate, `decode_foreign`, `terminated_header`):
//! * it fails exactly when RFC 5040 / 5041 (and this framework's extensions) say the bytes
//!   are malformed, checked against an independent reading of the fields;
//! * what it returns re-encodes to the input, modulo the bits the type does not model
//!   (reserved bits, the Terminate's header-copy flags), and decodes back to itself;
//! * as a ULPDU: the header, then the payload by opcode.
//!
//! On values built from the input (`arbitrary`): `decode(encode(x)) == x` for headers and
//! payloads, and a Terminate that copies an encoded header names that header's message.

use arbitrary::{Result, Unstructured};
use fabric_tcp::wire::ddp::{
    opcode, AtomicRequest, AtomicResponse, Header, ReadRequest, Terminate, TerminatedHeader,
    TAGGED_LEN, UNTAGGED_LEN,
};

use crate::{be16, be32, be64};

/// The control-field bits `Header` does not model (DDP reserved bits 13..10, RDMAP 5..4).
const CTRL_RESERVED: u16 = 0x3c30;

/// Runs every DDP / RDMAP property on one fuzz input.
pub fn check(data: &[u8]) {
    // As a ULPDU: header, then the payload its opcode announces.
    if let Some(h) = check_header(data) {
        let p = &data[h.len()..];
        match (h, h.opcode()) {
            (Header::Untagged { .. }, opcode::READ_REQUEST) => check_read_request(p),
            (Header::Untagged { .. }, opcode::TERMINATE) => check_terminate(p),
            (Header::Untagged { .. }, opcode::ATOMIC_REQUEST) => check_atomic_request(p),
            (Header::Untagged { .. }, opcode::ATOMIC_RESPONSE) => check_atomic_response(p),
            (Header::Untagged { ulp, .. }, opcode::ACK) => {
                assert_eq!(ulp & fabric_tcp::wire::ddp::ACK_COUNT, ulp & 0x7fff_ffff)
            }
            _ => {}
        }
    }
    // Every payload decoder on the whole input.
    check_read_request(data);
    check_atomic_request(data);
    check_atomic_response(data);
    check_terminate(data);
    let _ = round_trips(&mut Unstructured::new(data));
}

/// `Header::decode` against an independent reading of RFC 5041's control field.
fn check_header(b: &[u8]) -> Option<Header> {
    let expect = (|| {
        let ctrl = be16(b.get(..2)?, 0);
        let tagged = ctrl & 0x8000 != 0;
        let need = if tagged { TAGGED_LEN } else { UNTAGGED_LEN };
        let op = (ctrl & 0xf) as u8;
        let op_ok = if tagged {
            matches!(op, opcode::WRITE | opcode::READ_RESPONSE)
        } else {
            !matches!(op, opcode::WRITE | opcode::READ_RESPONSE) && op <= opcode::IMMEDIATE
        };
        let ok = b.len() >= need && (ctrl >> 8) & 3 == 1 && (ctrl >> 6) & 3 == 1 && op_ok;
        ok.then_some((ctrl, need))
    })();
    let h = match Header::decode(b) {
        Err(e) => {
            assert!(expect.is_none(), "valid header refused: {e} ({b:02x?})");
            assert!(
                ["DDP header", "DDP version", "RDMAP version", "RDMAP opcode"].contains(&e.field),
                "unexpected field {:?}",
                e.field
            );
            return None;
        }
        Ok(h) => h,
    };
    let Some((ctrl, need)) = expect else {
        panic!("invalid header accepted: {h:?} ({b:02x?})");
    };
    assert_eq!(h.len(), need);
    assert_eq!(Header::len_for_ctrl(ctrl), need);
    assert!(!h.is_empty());
    assert_eq!(h.last(), ctrl & 0x4000 != 0);
    assert_eq!(h.opcode(), (ctrl & 0xf) as u8);
    match h {
        Header::Tagged { stag, to, .. } => {
            assert_eq!((stag, to), (be32(b, 2), be64(b, 6)))
        }
        Header::Untagged {
            ulp, qn, msn, mo, ..
        } => assert_eq!(
            (ulp, qn, msn, mo),
            (be32(b, 2), be32(b, 6), be32(b, 10), be32(b, 14))
        ),
    }
    // encode(decode(b)) == b with the reserved bits cleared; decode(encode(h)) == h.
    let mut enc = Vec::new();
    h.encode_into(&mut enc);
    let mut want = b[..need].to_vec();
    want[..2].copy_from_slice(&(ctrl & !CTRL_RESERVED).to_be_bytes());
    assert_eq!(enc, want, "re-encoded header differs from its input");
    assert_eq!(Header::decode(&enc).expect("re-decode"), h);
    Some(h)
}

fn check_read_request(b: &[u8]) {
    match ReadRequest::decode(b) {
        Err(e) => {
            assert_ne!(b.len(), ReadRequest::LEN, "refused: {e}");
        }
        Ok(r) => {
            assert_eq!(&r.encode()[..], b, "Read Request re-encodes to its input");
            assert_eq!(ReadRequest::decode(&r.encode()).expect("re-decode"), r);
        }
    }
}

fn check_atomic_request(b: &[u8]) {
    match AtomicRequest::decode(b) {
        Err(e) => {
            assert!(
                b.len() != AtomicRequest::LEN || be32(b, 0) & 0xf > 1,
                "refused: {e}"
            );
        }
        Ok(a) => {
            assert!(b.len() == AtomicRequest::LEN && a.op <= 1);
            let enc = a.encode();
            // The op field's upper 28 bits are reserved: not modelled, sent as zero.
            assert_eq!(be32(&enc, 0), be32(b, 0) & 0xf);
            assert_eq!(&enc[4..], &b[4..], "Atomic Request re-encodes to its input");
            assert_eq!(AtomicRequest::decode(&enc).expect("re-decode"), a);
        }
    }
}

fn check_atomic_response(b: &[u8]) {
    match AtomicResponse::decode(b) {
        Err(e) => assert_ne!(b.len(), AtomicResponse::LEN, "refused: {e}"),
        Ok(a) => {
            assert_eq!(
                &a.encode()[..],
                b,
                "Atomic Response re-encodes to its input"
            );
            assert_eq!(AtomicResponse::decode(&a.encode()).expect("re-decode"), a);
        }
    }
}

fn swapped(t: Terminate) -> Terminate {
    Terminate {
        layer: t.etype,
        etype: t.layer,
        ecode: t.ecode,
    }
}

fn check_terminate(b: &[u8]) {
    let t = match Terminate::decode(b) {
        Err(e) => {
            assert!(b.len() < 4, "refused: {e}");
            assert!(Terminate::decode_foreign(b).is_err());
            return;
        }
        Ok(t) => t,
    };
    assert!(t.layer < 16 && t.etype < 16);
    // Layer, type and code re-encode; the Hdr Ct (M, D, R) and reserved bits are not kept.
    assert_eq!(&t.encode()[..2], &b[..2]);
    assert_eq!(&t.encode()[2..], &[0, 0]);
    assert_eq!(Terminate::decode(&t.encode()).expect("re-decode"), t);
    // A foreign Terminate reads one of the two nibble orders, never anything else.
    let f = Terminate::decode_foreign(b).expect("decode_foreign");
    assert!(
        f == t || f == swapped(t),
        "{f:?} is neither reading of {t:?}"
    );
    let _ = (t.error_kind(), t.code(), f.error_kind(), f.code());

    // The copied DDP header, read independently (RFC 5040 section 4.8: control, then the
    // DDP segment length, then the header).
    let expect = (|| {
        let ctrl = be16(b.get(6..8)?, 0);
        if (ctrl >> 8) & 3 != 1 || ctrl & 0x3c00 != 0 {
            return None;
        }
        if ctrl & 0x8000 != 0 {
            (b.len() >= 6 + TAGGED_LEN).then(|| TerminatedHeader::Tagged {
                stag: be32(b, 8),
                to: be64(b, 12),
            })
        } else {
            (b.len() >= 6 + UNTAGGED_LEN).then(|| TerminatedHeader::Untagged {
                qn: be32(b, 12),
                msn: be32(b, 16),
            })
        }
    })();
    assert_eq!(Terminate::terminated_header(b), expect);
}

fn arbitrary_header(u: &mut Unstructured<'_>) -> Result<Header> {
    Ok(if u.arbitrary()? {
        Header::Tagged {
            last: u.arbitrary()?,
            opcode: *u.choose(&[opcode::WRITE, opcode::READ_RESPONSE])?,
            stag: u.arbitrary()?,
            to: u.arbitrary()?,
        }
    } else {
        Header::Untagged {
            last: u.arbitrary()?,
            opcode: *u.choose(&[1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])?,
            ulp: u.arbitrary()?,
            qn: u.arbitrary()?,
            msn: u.arbitrary()?,
            mo: u.arbitrary()?,
        }
    })
}

fn round_trips(u: &mut Unstructured<'_>) -> Result<()> {
    let h = arbitrary_header(u)?;
    let mut enc = Vec::new();
    h.encode_into(&mut enc);
    assert_eq!(enc.len(), h.len());
    assert_eq!(Header::decode(&enc).expect("decode"), h);
    // With a payload behind it, the header still decodes alone.
    let n = u.int_in_range(0..=8)?;
    enc.extend_from_slice(u.bytes(n)?);
    assert_eq!(Header::decode(&enc).expect("decode"), h);

    let r = ReadRequest {
        sink_stag: u.arbitrary()?,
        sink_to: u.arbitrary()?,
        size: u.arbitrary()?,
        src_stag: u.arbitrary()?,
        src_to: u.arbitrary()?,
    };
    assert_eq!(ReadRequest::decode(&r.encode()).expect("decode"), r);

    let a = AtomicRequest {
        op: u.int_in_range(0..=1)?,
        req_id: u.arbitrary()?,
        stag: u.arbitrary()?,
        to: u.arbitrary()?,
        add_swap: u.arbitrary()?,
        add_swap_mask: u.arbitrary()?,
        compare: u.arbitrary()?,
        compare_mask: u.arbitrary()?,
    };
    assert_eq!(AtomicRequest::decode(&a.encode()).expect("decode"), a);

    let ar = AtomicResponse {
        req_id: u.arbitrary()?,
        original: u.arbitrary()?,
    };
    assert_eq!(AtomicResponse::decode(&ar.encode()).expect("decode"), ar);

    let t = Terminate {
        layer: u.int_in_range(0..=15)?,
        etype: u.int_in_range(0..=15)?,
        ecode: u.arbitrary()?,
    };
    assert_eq!(Terminate::decode(&t.encode()).expect("decode"), t);
    let f = Terminate::decode_foreign(&t.encode()).expect("decode_foreign");
    assert!(f == t || f == swapped(t));
    // Our own Terminates copy no header.
    assert_eq!(Terminate::terminated_header(&t.encode()), None);
    // A Terminate that copies `h` (control, DDP segment length, header) names its message.
    let mut term = t.encode().to_vec();
    term.extend_from_slice(&(h.len() as u16).to_be_bytes());
    h.encode_into(&mut term);
    let named = match h {
        Header::Tagged { stag, to, .. } => TerminatedHeader::Tagged { stag, to },
        Header::Untagged { qn, msn, .. } => TerminatedHeader::Untagged { qn, msn },
    };
    assert_eq!(Terminate::terminated_header(&term), Some(named));
    // Cut short by a byte: no name rather than a wrong one.
    assert_eq!(Terminate::terminated_header(&term[..term.len() - 1]), None);

    Ok(())
}
