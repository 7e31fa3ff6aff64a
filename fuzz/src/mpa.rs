//! Properties of the MPA codecs (`fabric_tcp::wire::mpa`).
//!
//! On the raw input:
//! * `MpaFrame::decode_header` (as a request and as a reply) fails exactly when the key is
//!   wrong, the private-data length exceeds 256 or the revision is 0, and otherwise returns
//!   the header's fields: re-encoding the frame gives the input back, reserved header bits
//!   cleared (`encode(decode(b)) == b`), and decoding that gives the same frame;
//! * `Setup::decode` (with and without the RFC 6581 block) fails exactly when an enhanced
//!   block is cut short, and re-encodes to the input (the extension block's reserved bytes
//!   cleared); `Setup::of` agrees with it; `Enhanced` and `ExtBlock` likewise.
//!
//! On values built from the input (`arbitrary`): `decode(encode(x)) == x` for frames,
//! IRD/ORD blocks, extension blocks and whole private data, and the FPDU padding rule.

use arbitrary::{Result, Unstructured};
use fabric_tcp::wire::mpa::{
    pad_len, trailer_len, Enhanced, ExtBlock, MpaFrame, RtrKinds, Setup, HEADER_LEN, IRD_ORD_MASK,
    KEY_REP, KEY_REQ, MAX_PRIVATE_DATA,
};

use crate::be16;

/// The header bits `MpaFrame` models: M, C, R, E, X and the revision byte.
const KNOWN_BITS: u16 = 0x8000 | 0x4000 | 0x2000 | 0x1000 | 0x0100 | 0x00ff;

/// Runs every MPA property on one fuzz input.
pub fn check(data: &[u8]) {
    if let Some(h) = data.get(..HEADER_LEN) {
        let h: &[u8; HEADER_LEN] = h.try_into().expect("20 bytes");
        for expect_reply in [false, true] {
            check_header(h, &data[HEADER_LEN..], expect_reply);
        }
    }
    for enhanced in [false, true] {
        check_setup_bytes(enhanced, data);
    }
    check_enhanced_bytes(data);
    check_ext_bytes(data);
    // Values built from the input: encode, then decode.
    let _ = round_trips(&mut Unstructured::new(data));
}

fn check_header(h: &[u8; HEADER_LEN], rest: &[u8], expect_reply: bool) {
    let key = if expect_reply { KEY_REP } else { KEY_REQ };
    let bits = be16(h, 16);
    let pd_len = usize::from(be16(h, 18));
    let valid = &h[..16] == key && pd_len <= MAX_PRIVATE_DATA && bits & 0xff != 0;
    let (mut f, len) = match MpaFrame::decode_header(h, expect_reply) {
        Ok(x) => x,
        Err(e) => {
            assert!(!valid, "valid header refused: {e} ({h:02x?})");
            assert!(e.field.starts_with("MPA"), "field {:?}", e.field);
            return;
        }
    };
    assert!(valid, "invalid header accepted: {f:?} ({h:02x?})");
    assert_eq!(len, pd_len);
    assert_eq!(f.reply, expect_reply);
    assert_eq!(f.revision, (bits & 0xff) as u8);
    assert_eq!(
        (f.markers, f.crc, f.reject, f.enhanced, f.ext_offer),
        (
            bits & 0x8000 != 0,
            bits & 0x4000 != 0,
            bits & 0x2000 != 0,
            bits & 0x1000 != 0,
            bits & 0x0100 != 0
        )
    );
    assert!(f.private_data.is_empty());
    let Some(pd) = rest.get(..pd_len) else {
        return;
    };
    f.private_data = pd.to_vec();
    // encode(decode(b)) == b, reserved bits cleared.
    let enc = f.encode();
    let mut want = h.to_vec();
    want[16..18].copy_from_slice(&(bits & KNOWN_BITS).to_be_bytes());
    want.extend_from_slice(pd);
    assert_eq!(enc, want, "re-encoded header differs from its input");
    // decode(encode(x)) == x.
    assert_eq!(decode_frame(&enc, expect_reply), f);
    // The private data as the connection setup reads it.
    let setup = Setup::of(&f);
    assert_eq!(setup, Setup::decode(f.revision >= 2 && f.enhanced, pd));
}

/// Decodes a whole encoded frame (header and private data); panics on failure.
fn decode_frame(b: &[u8], expect_reply: bool) -> MpaFrame {
    let h: &[u8; HEADER_LEN] = b[..HEADER_LEN].try_into().expect("20 bytes");
    let (mut f, len) = MpaFrame::decode_header(h, expect_reply)
        .unwrap_or_else(|e| panic!("encoded frame refused: {e}"));
    assert_eq!(len, b.len() - HEADER_LEN, "encoded length field");
    f.private_data = b[HEADER_LEN..].to_vec();
    f
}

/// `b` with an extension block's reserved bytes cleared, as `Setup::encode` writes them.
fn clear_ext_reserved(mut b: Vec<u8>, ext_at: usize) -> Vec<u8> {
    b[ext_at + 6..ext_at + 8].fill(0);
    b
}

fn check_setup_bytes(enhanced: bool, pd: &[u8]) {
    match Setup::decode(enhanced, pd) {
        Err(e) => {
            assert!(enhanced && pd.len() < Enhanced::LEN, "refused: {e}");
            assert_eq!(e.field, "MPA v2 IRD/ORD");
        }
        Ok(s) => {
            assert!(!enhanced || pd.len() >= Enhanced::LEN);
            assert_eq!(s.enhanced.is_some(), enhanced);
            let enc = s.encode();
            let want = match s.ext {
                Some(_) => clear_ext_reserved(pd.to_vec(), if enhanced { 4 } else { 0 }),
                None => pd.to_vec(),
            };
            assert_eq!(enc, want, "re-encoded private data differs from its input");
            assert_eq!(Setup::decode(enhanced, &enc).expect("re-decode"), s);
        }
    }
}

fn check_enhanced_bytes(b: &[u8]) {
    match Enhanced::decode(b) {
        Err(_) => assert!(b.len() < Enhanced::LEN),
        Ok(e) => {
            assert!(e.ird <= IRD_ORD_MASK && e.ord <= IRD_ORD_MASK);
            // Every bit of the 4 bytes is modelled: the encoding is the input.
            assert_eq!(&e.encode()[..], &b[..Enhanced::LEN]);
            assert_eq!(Enhanced::decode(&e.encode()).expect("re-decode"), e);
        }
    }
}

fn check_ext_bytes(b: &[u8]) {
    let (ext, rest) = ExtBlock::split(b);
    match ext {
        None => {
            assert_eq!(rest, b);
            assert!(b.len() < ExtBlock::LEN || &b[..4] != ExtBlock::MAGIC);
        }
        Some(x) => {
            assert_eq!(rest, &b[ExtBlock::LEN..]);
            assert_eq!(&x.encode()[..6], &b[..6]);
            assert_eq!(ExtBlock::split(&x.encode()), (Some(x), &[][..]));
        }
    }
}

fn arbitrary_enhanced(u: &mut Unstructured<'_>) -> Result<Enhanced> {
    Ok(Enhanced {
        ird: u.arbitrary::<u16>()? & IRD_ORD_MASK,
        ord: u.arbitrary::<u16>()? & IRD_ORD_MASK,
        peer_to_peer: u.arbitrary()?,
        rtr: RtrKinds {
            send: u.arbitrary()?,
            write: u.arbitrary()?,
            read: u.arbitrary()?,
        },
    })
}

fn round_trips(u: &mut Unstructured<'_>) -> Result<()> {
    // A whole frame.
    let len = u.int_in_range(0..=MAX_PRIVATE_DATA)?;
    let f = MpaFrame {
        reply: u.arbitrary()?,
        markers: u.arbitrary()?,
        crc: u.arbitrary()?,
        reject: u.arbitrary()?,
        enhanced: u.arbitrary()?,
        ext_offer: u.arbitrary()?,
        revision: u.int_in_range(1..=255)?,
        private_data: u.bytes(len)?.to_vec(),
    };
    let enc = f.encode();
    assert_eq!(enc.len(), HEADER_LEN + f.private_data.len());
    assert_eq!(decode_frame(&enc, f.reply), f);
    // The other kind of frame is refused by its key.
    let h: &[u8; HEADER_LEN] = enc[..HEADER_LEN].try_into().expect("20 bytes");
    assert_eq!(
        MpaFrame::decode_header(h, !f.reply).unwrap_err().field,
        "MPA key"
    );

    // IRD / ORD.
    let e = arbitrary_enhanced(u)?;
    assert_eq!(Enhanced::decode(&e.encode()).expect("decode"), e);

    // Extension block, with whatever follows it.
    let x = ExtBlock {
        version: u.arbitrary()?,
        features: u.arbitrary()?,
    };
    let n = u.int_in_range(0..=16)?;
    let tail = u.bytes(n)?;
    let mut b = x.encode().to_vec();
    b.extend_from_slice(tail);
    assert_eq!(ExtBlock::split(&b), (Some(x), tail));

    // Whole private data.
    let mut s = Setup {
        enhanced: if u.arbitrary()? {
            Some(arbitrary_enhanced(u)?)
        } else {
            None
        },
        ext: if u.arbitrary()? {
            Some(ExtBlock {
                version: u.arbitrary()?,
                features: u.arbitrary()?,
            })
        } else {
            None
        },
        user: Vec::new(),
    };
    let n = u.int_in_range(0..=64)?;
    s.user = u.bytes(n)?.to_vec();
    let enc = s.encode();
    let ambiguous = s.ext.is_none() && ExtBlock::split(&s.user).0.is_some();
    let back = Setup::decode(s.enhanced.is_some(), &enc).expect("decode");
    if ambiguous {
        // User data that starts like an extension block reads as one: the block is only
        // ever sent by a responder of this framework (see the module docs of wire::mpa).
        assert_eq!(
            back.encode(),
            clear_ext_reserved(enc, s.enhanced.map_or(0, |_| 4))
        );
    } else {
        assert_eq!(back, s);
    }

    // FPDU padding: the 2-byte length, the ULPDU and the pad end on a 4-byte boundary.
    let n = usize::from(u.arbitrary::<u16>()?);
    let pad = pad_len(n);
    assert!(pad < 4 && (2 + n + pad).is_multiple_of(4));
    assert_eq!(trailer_len(n), pad + 4);
    Ok(())
}
