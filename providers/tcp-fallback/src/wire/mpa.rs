//! MPA (RFC 5044) with enhanced connection establishment (RFC 6581).
//!
//! Connection setup: the initiator sends an MPA Request frame, the responder an MPA Reply:
//!
//! ```text
//!  0               16      18       20
//!  | key (16 bytes) | bits | pd_len | private data (pd_len bytes)
//!  bits: M(0x8000) markers, C(0x4000) CRC, R(0x2000) reject,
//!        E(0x1000) enhanced connection establishment, X(0x0100) this framework's
//!        extensions offered (a reserved bit: foreign peers send 0 and ignore it),
//!        low 8 bits revision
//! ```
//!
//! With revision 2 and the E bit, the private data starts with IRD and ORD (16 bits each,
//! 14-bit values). The E bit is what the kernel's siw (`MPA_RR_FLAG_ENHANCED`) and Chelsio's
//! cxgb4 (`MPA_ENHANCED_RDMA_CONN`) set and test: siw parses IRD/ORD only when it is set, and
//! refuses a revision-2 reply without it when its request had it.
//! IRD bit 15 asks for peer-to-peer mode (the initiator sends the first message, an RTR),
//! IRD bit 14 offers a zero-length Send RTR, ORD bit 15 a zero-length Write RTR, ORD bit 14
//! a zero-length Read RTR.
//!
//! A responder of this framework answers a request with the X bit with a further block in
//! its reply (see [`ExtBlock`]); the application's private data comes last. A request never
//! carries the block, so a foreign responder's application sees exactly the private data
//! ours sent, and a foreign initiator (which never sets X) gets a reply without it.
//!
//! After setup the stream carries FPDUs: a 16-bit ULPDU length, the ULPDU (DDP segment),
//! 0-3 pad bytes to a 4-byte boundary, and a 4-byte CRC32c over everything before it (sent
//! as zero when CRC was not negotiated). Markers are never used.

use super::{be16, WireError};

/// Key of an MPA Request frame.
pub const KEY_REQ: &[u8; 16] = b"MPA ID Req Frame";
/// Key of an MPA Reply frame.
pub const KEY_REP: &[u8; 16] = b"MPA ID Rep Frame";
/// Size of the fixed part of a request or reply.
pub const HEADER_LEN: usize = 20;
/// Largest private data we send or accept (what the kernel's iWARP stack accepts).
pub const MAX_PRIVATE_DATA: usize = 256;

const FLAG_MARKERS: u16 = 0x8000;
const FLAG_CRC: u16 = 0x4000;
const FLAG_REJECT: u16 = 0x2000;
const FLAG_ENHANCED: u16 = 0x1000;
const FLAG_EXTENSIONS: u16 = 0x0100;
const MASK_REVISION: u16 = 0x00ff;

/// IRD/ORD value mask (14 bits).
pub const IRD_ORD_MASK: u16 = 0x3fff;
const IRD_PEER_TO_PEER: u16 = 0x8000;
const IRD_ZERO_LENGTH_SEND_RTR: u16 = 0x4000;
const ORD_WRITE_RTR: u16 = 0x8000;
const ORD_READ_RTR: u16 = 0x4000;

/// An MPA Request or Reply frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpaFrame {
    /// Reply (true) or request (false).
    pub reply: bool,
    /// M: the sender wants markers.
    pub markers: bool,
    /// C: the sender wants CRC (in a reply: CRC is in use).
    pub crc: bool,
    /// R: the responder rejects the connection.
    pub reject: bool,
    /// E: the private data starts with the RFC 6581 IRD/ORD block.
    pub enhanced: bool,
    /// X (request): this framework's extensions are offered. A reply's X bit means
    /// nothing (siw echoes the request's bits); only its [`ExtBlock`] counts.
    pub ext_offer: bool,
    /// MPA revision (1 or 2).
    pub revision: u8,
    /// Private data, including the RFC 6581 and extension prefixes.
    pub private_data: Vec<u8>,
}

impl MpaFrame {
    /// An MPA Reply that rejects a request of `revision`, with the reason as its private
    /// data.
    pub fn reject(revision: u8, why: &str) -> Self {
        MpaFrame {
            reply: true,
            markers: false,
            crc: false,
            reject: true,
            enhanced: false,
            ext_offer: false,
            revision: revision.clamp(1, 2),
            private_data: why.as_bytes().to_vec(),
        }
    }

    /// Encodes the frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.private_data.len());
        out.extend_from_slice(if self.reply { KEY_REP } else { KEY_REQ });
        let mut bits = u16::from(self.revision) & MASK_REVISION;
        if self.markers {
            bits |= FLAG_MARKERS;
        }
        if self.crc {
            bits |= FLAG_CRC;
        }
        if self.reject {
            bits |= FLAG_REJECT;
        }
        if self.enhanced {
            bits |= FLAG_ENHANCED;
        }
        if self.ext_offer {
            bits |= FLAG_EXTENSIONS;
        }
        out.extend_from_slice(&bits.to_be_bytes());
        out.extend_from_slice(&(self.private_data.len() as u16).to_be_bytes());
        out.extend_from_slice(&self.private_data);
        out
    }

    /// Decodes the fixed header, returning the frame without private data and the
    /// private-data length still to read.
    pub fn decode_header(
        h: &[u8; HEADER_LEN],
        expect_reply: bool,
    ) -> Result<(MpaFrame, usize), WireError> {
        let key = if expect_reply { KEY_REP } else { KEY_REQ };
        if &h[..16] != key {
            return Err(WireError::new(
                "MPA key",
                format!(
                    "expected {:?}, got {:?}",
                    String::from_utf8_lossy(key),
                    String::from_utf8_lossy(&h[..16])
                ),
            ));
        }
        let bits = be16(h, 16);
        let pd_len = usize::from(be16(h, 18));
        if pd_len > MAX_PRIVATE_DATA {
            return Err(WireError::new(
                "MPA private data length",
                format!("{pd_len} exceeds {MAX_PRIVATE_DATA}"),
            ));
        }
        let revision = (bits & MASK_REVISION) as u8;
        if revision == 0 {
            return Err(WireError::new("MPA revision", "revision 0 does not exist"));
        }
        Ok((
            MpaFrame {
                reply: expect_reply,
                markers: bits & FLAG_MARKERS != 0,
                crc: bits & FLAG_CRC != 0,
                reject: bits & FLAG_REJECT != 0,
                enhanced: bits & FLAG_ENHANCED != 0,
                ext_offer: bits & FLAG_EXTENSIONS != 0,
                revision,
                private_data: Vec::new(),
            },
            pd_len,
        ))
    }
}

/// The RTR (ready-to-receive) message kinds of RFC 6581 peer-to-peer mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RtrKinds {
    /// Zero-length Send.
    pub send: bool,
    /// Zero-length RDMA Write.
    pub write: bool,
    /// Zero-length RDMA Read.
    pub read: bool,
}

/// The RFC 6581 enhanced-establishment parameters at the start of revision-2 private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enhanced {
    /// Inbound RDMA read (and atomic) requests the sender can have outstanding.
    pub ird: u16,
    /// Outbound reads the sender wants to have outstanding.
    pub ord: u16,
    /// Peer-to-peer mode: the initiator sends the first message (an RTR).
    pub peer_to_peer: bool,
    /// RTR kinds offered (request) or chosen (reply, exactly one).
    pub rtr: RtrKinds,
}

impl Enhanced {
    /// Encoded length.
    pub const LEN: usize = 4;

    /// Encodes IRD then ORD.
    pub fn encode(&self) -> [u8; 4] {
        let mut ird = self.ird & IRD_ORD_MASK;
        let mut ord = self.ord & IRD_ORD_MASK;
        if self.peer_to_peer {
            ird |= IRD_PEER_TO_PEER;
        }
        if self.rtr.send {
            ird |= IRD_ZERO_LENGTH_SEND_RTR;
        }
        if self.rtr.write {
            ord |= ORD_WRITE_RTR;
        }
        if self.rtr.read {
            ord |= ORD_READ_RTR;
        }
        let mut b = [0; 4];
        b[..2].copy_from_slice(&ird.to_be_bytes());
        b[2..].copy_from_slice(&ord.to_be_bytes());
        b
    }

    /// Decodes from the start of revision-2 private data.
    pub fn decode(pd: &[u8]) -> Result<Enhanced, WireError> {
        if pd.len() < Self::LEN {
            return Err(WireError::new(
                "MPA v2 IRD/ORD",
                format!(
                    "revision 2 private data needs 4 bytes of IRD/ORD, got {}",
                    pd.len()
                ),
            ));
        }
        let ird = be16(pd, 0);
        let ord = be16(pd, 2);
        Ok(Enhanced {
            ird: ird & IRD_ORD_MASK,
            ord: ord & IRD_ORD_MASK,
            peer_to_peer: ird & IRD_PEER_TO_PEER != 0,
            rtr: RtrKinds {
                send: ird & IRD_ZERO_LENGTH_SEND_RTR != 0,
                write: ord & ORD_WRITE_RTR != 0,
                read: ord & ORD_READ_RTR != 0,
            },
        })
    }
}

/// Extension features negotiated between two peers of this framework.
pub mod features {
    /// 64-bit atomics (Atomic Request / Response, modelled on RFC 7306).
    pub const ATOMICS: u8 = 1;
    /// Immediate data on sends and writes (modelled on RFC 7306 Immediate Data).
    pub const IMMEDIATE: u8 = 1 << 1;
    /// Delivery acknowledgements: the target acknowledges every Send, Write and Immediate
    /// message once placed, so initiator completions mean "in target memory".
    pub const ACKS: u8 = 1 << 2;
    /// Everything this version implements.
    pub const ALL: u8 = ATOMICS | IMMEDIATE | ACKS;
}

/// Our extension block, sent after IRD/ORD in the private data of a reply to a request
/// that offered extensions (X bit).
///
/// ```text
/// | "RFAB" | version (1) | features (bit 0 atomics, 1 immediate, 2 acks) | reserved (2) |
/// ```
///
/// The features are the responder's; an initiator offering version 1 speaks all of them, so
/// the reply's features are what both use. No block in the reply: a foreign responder, no
/// extension is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtBlock {
    /// Extension protocol version (1).
    pub version: u8,
    /// Feature bits (see [`features`]).
    pub features: u8,
}

impl ExtBlock {
    /// Magic that starts the block.
    pub const MAGIC: &'static [u8; 4] = b"RFAB";
    /// Encoded length.
    pub const LEN: usize = 8;
    /// The version this code speaks.
    pub const VERSION: u8 = 1;

    /// Encodes the block.
    pub fn encode(&self) -> [u8; 8] {
        let mut b = [0; 8];
        b[..4].copy_from_slice(Self::MAGIC);
        b[4] = self.version;
        b[5] = self.features;
        b
    }

    /// Splits an extension block off the front of `pd`, if one is there.
    pub fn split(pd: &[u8]) -> (Option<ExtBlock>, &[u8]) {
        if pd.len() >= Self::LEN && &pd[..4] == Self::MAGIC {
            (
                Some(ExtBlock {
                    version: pd[4],
                    features: pd[5],
                }),
                &pd[Self::LEN..],
            )
        } else {
            (None, pd)
        }
    }
}

/// The parsed private data of a request or reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    /// RFC 6581 parameters (revision 2 only).
    pub enhanced: Option<Enhanced>,
    /// Our extension block, when the peer is ours.
    pub ext: Option<ExtBlock>,
    /// The application's private data.
    pub user: Vec<u8>,
}

impl Setup {
    /// Builds the private data for `revision`.
    pub fn encode(&self) -> Vec<u8> {
        let mut pd = Vec::new();
        if let Some(e) = &self.enhanced {
            pd.extend_from_slice(&e.encode());
        }
        if let Some(x) = &self.ext {
            pd.extend_from_slice(&x.encode());
        }
        pd.extend_from_slice(&self.user);
        pd
    }

    /// Parses the private data of `frame`.
    pub fn of(frame: &MpaFrame) -> Result<Setup, WireError> {
        Self::decode(frame.revision >= 2 && frame.enhanced, &frame.private_data)
    }

    /// Parses private data that starts with the IRD/ORD block when `enhanced`.
    pub fn decode(enhanced: bool, pd: &[u8]) -> Result<Setup, WireError> {
        let (enhanced, rest) = if enhanced {
            (Some(Enhanced::decode(pd)?), &pd[Enhanced::LEN..])
        } else {
            (None, pd)
        };
        let (ext, user) = ExtBlock::split(rest);
        Ok(Setup {
            enhanced,
            ext,
            user: user.to_vec(),
        })
    }
}

/// Pad bytes after a ULPDU of `ulpdu_len` bytes (the 2-byte length field included in the
/// alignment).
pub fn pad_len(ulpdu_len: usize) -> usize {
    (4 - (2 + ulpdu_len) % 4) % 4
}

/// Size of the trailer (pad + CRC) of an FPDU carrying `ulpdu_len` bytes.
pub fn trailer_len(ulpdu_len: usize) -> usize {
    pad_len(ulpdu_len) + 4
}

/// The 4 CRC bytes as sent: CRC32c over the FPDU up to the CRC, least significant byte
/// first (what the kernel's siw puts on the wire); zero when CRC is off.
pub fn crc_bytes(crc: u32) -> [u8; 4] {
    crc.to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_with_enhanced_and_ext() {
        let setup = Setup {
            enhanced: Some(Enhanced {
                ird: 16,
                ord: 8,
                peer_to_peer: false,
                rtr: RtrKinds::default(),
            }),
            ext: Some(ExtBlock {
                version: 1,
                features: features::ALL,
            }),
            user: b"hello".to_vec(),
        };
        let f = MpaFrame {
            reply: false,
            markers: false,
            crc: true,
            reject: false,
            enhanced: true,
            ext_offer: true,
            revision: 2,
            private_data: setup.encode(),
        };
        let bytes = f.encode();
        assert_eq!(&bytes[..16], KEY_REQ);
        // C and E set (what siw sends with CRC required), plus our X bit; revision 2.
        assert_eq!(&bytes[16..18], &[0x51, 0x02]);
        let (mut h, pd_len) =
            MpaFrame::decode_header(bytes[..20].try_into().unwrap(), false).unwrap();
        assert!(h.crc && !h.markers && h.enhanced && h.ext_offer && h.revision == 2);
        h.private_data = bytes[20..20 + pd_len].to_vec();
        assert_eq!(Setup::of(&h).unwrap(), setup);
        // Without E the same bytes are all application data.
        assert_eq!(
            Setup::decode(false, &h.private_data).unwrap().user.len(),
            h.private_data.len()
        );
    }

    #[test]
    fn decode_names_the_bad_field() {
        let mut h = [0u8; 20];
        h[..16].copy_from_slice(KEY_REP);
        assert_eq!(
            MpaFrame::decode_header(&h, false).unwrap_err().field,
            "MPA key"
        );
        h[..16].copy_from_slice(KEY_REQ);
        h[17] = 2;
        h[18] = 0x10; // 4096 bytes of private data
        assert_eq!(
            MpaFrame::decode_header(&h, false).unwrap_err().field,
            "MPA private data length"
        );
        assert_eq!(
            Enhanced::decode(&[0, 1]).unwrap_err().field,
            "MPA v2 IRD/ORD"
        );
    }

    #[test]
    fn enhanced_flags_use_the_rfc6581_bits() {
        let e = Enhanced {
            ird: 5,
            ord: 3,
            peer_to_peer: true,
            rtr: RtrKinds {
                send: false,
                write: true,
                read: false,
            },
        };
        assert_eq!(e.encode(), [0x80, 5, 0x80, 3]);
        assert_eq!(Enhanced::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn padding_aligns_the_whole_fpdu() {
        for len in 0..16 {
            assert_eq!((2 + len + pad_len(len)) % 4, 0);
        }
    }
}
