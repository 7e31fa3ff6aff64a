//! DDP segments (RFC 5041) carrying RDMAP messages (RFC 5040), and our extensions.
//!
//! ```text
//! tagged   | ctrl (16) | STag (32) | TO (64) |                                   14 bytes
//! untagged | ctrl (16) | reserved for the ULP (32) | QN (32) | MSN (32) | MO (32) | 18 bytes
//! ctrl: T(0x8000) tagged, L(0x4000) last segment, DDP version 1 (0x0100),
//!       RDMAP version 1 (0x0040), RDMAP opcode (low 4 bits)
//! ```
//!
//! Base RDMAP opcodes are 0 (Write), 1 (Read Request), 2 (Read Response), 3-6 (Send
//! variants) and 7 (Terminate). Untagged queues: 0 Send, 1 Read Request, 2 Terminate.
//!
//! Extensions, only ever sent when both peers announced them in the MPA setup:
//!
//! | opcode | message | queue | payload |
//! |---|---|---|---|
//! | 0x8 | Send with Immediate | 0 | like Send; the 32-bit "reserved for ULP" field carries the immediate value |
//! | 0x9 | Delivery Ack | 4 | none; the ULP field: bit 31 set acknowledges Sends / Immediate Data that landed in receives, clear acknowledges placed Writes; bits 0-30 count them |
//! | 0xA | Atomic Request (RFC 7306 layout) | 3 | op, request id, STag, TO, add/swap, mask, compare, mask |
//! | 0xB | Atomic Response (RFC 7306 layout) | 3 | request id, original value |
//! | 0xC | Immediate Data (RFC 7306) | 0 | 8 bytes: the 32-bit immediate value, 4 reserved |
//!
//! 0xA-0xC follow the message layouts of RFC 7306; 0x8 and 0x9 are this framework's own.

use super::{be32, be64, WireError};

/// RDMAP opcodes.
pub mod opcode {
    /// RDMA Write (tagged).
    pub const WRITE: u8 = 0x0;
    /// RDMA Read Request (untagged, queue 1).
    pub const READ_REQUEST: u8 = 0x1;
    /// RDMA Read Response (tagged).
    pub const READ_RESPONSE: u8 = 0x2;
    /// Send.
    pub const SEND: u8 = 0x3;
    /// Send with Invalidate.
    pub const SEND_INVALIDATE: u8 = 0x4;
    /// Send with Solicited Event.
    pub const SEND_SE: u8 = 0x5;
    /// Send with Solicited Event and Invalidate.
    pub const SEND_SE_INVALIDATE: u8 = 0x6;
    /// Terminate (untagged, queue 2).
    pub const TERMINATE: u8 = 0x7;
    /// Extension: Send with Immediate.
    pub const SEND_IMM: u8 = 0x8;
    /// Extension: Delivery Ack.
    pub const ACK: u8 = 0x9;
    /// Extension: Atomic Request.
    pub const ATOMIC_REQUEST: u8 = 0xA;
    /// Extension: Atomic Response.
    pub const ATOMIC_RESPONSE: u8 = 0xB;
    /// Extension: Immediate Data.
    pub const IMMEDIATE: u8 = 0xC;
}

/// Untagged queue numbers.
pub mod qn {
    /// Sends (and immediate data).
    pub const SEND: u32 = 0;
    /// Read requests.
    pub const READ: u32 = 1;
    /// Terminate.
    pub const TERMINATE: u32 = 2;
    /// Extension: atomic requests and responses.
    pub const ATOMIC: u32 = 3;
    /// Extension: delivery acks.
    pub const ACK: u32 = 4;
    /// Number of queues.
    pub const COUNT: usize = 5;
}

const FLAG_TAGGED: u16 = 0x8000;
const FLAG_LAST: u16 = 0x4000;
const DDP_VERSION: u16 = 1;
const RDMAP_VERSION: u16 = 1;

/// Tagged header length, including the 2-byte control field.
pub const TAGGED_LEN: usize = 14;
/// Untagged header length, including the 2-byte control field.
pub const UNTAGGED_LEN: usize = 18;

/// A DDP segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// Tagged: placed at `to` in the buffer named by `stag`.
    Tagged {
        /// Last segment of the message.
        last: bool,
        /// RDMAP opcode.
        opcode: u8,
        /// Steering tag.
        stag: u32,
        /// Tagged offset (target virtual address).
        to: u64,
    },
    /// Untagged: placed at `mo` in the next buffer of queue `qn`.
    Untagged {
        /// Last segment of the message.
        last: bool,
        /// RDMAP opcode.
        opcode: u8,
        /// Field reserved for the ULP (Invalidate STag, our immediate value or ack count).
        ulp: u32,
        /// Queue number.
        qn: u32,
        /// Message sequence number (starts at 1 per queue).
        msn: u32,
        /// Message offset.
        mo: u32,
    },
}

impl Header {
    /// Encoded length.
    pub fn len(&self) -> usize {
        match self {
            Header::Tagged { .. } => TAGGED_LEN,
            Header::Untagged { .. } => UNTAGGED_LEN,
        }
    }

    /// Always false: a header is never empty (for clippy's `len` convention).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The RDMAP opcode.
    pub fn opcode(&self) -> u8 {
        match *self {
            Header::Tagged { opcode, .. } | Header::Untagged { opcode, .. } => opcode,
        }
    }

    /// The L flag.
    pub fn last(&self) -> bool {
        match *self {
            Header::Tagged { last, .. } | Header::Untagged { last, .. } => last,
        }
    }

    /// Appends the encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let mut b = [0u8; UNTAGGED_LEN];
        let n = self.write_to(&mut b);
        out.extend_from_slice(&b[..n]);
    }

    /// Writes the encoding to the start of `out`, which must have room for it
    /// ([`UNTAGGED_LEN`] bytes fit either kind); returns its length. Allocates nothing.
    pub fn write_to(&self, out: &mut [u8]) -> usize {
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        let ctrl = |tagged: bool, last: bool, op: u8| -> u16 {
            (if tagged { FLAG_TAGGED } else { 0 })
                | (if last { FLAG_LAST } else { 0 })
                | (DDP_VERSION << 8)
                | (RDMAP_VERSION << 6)
                | u16::from(op & 0xf)
        };
        match *self {
            Header::Tagged {
                last,
                opcode,
                stag,
                to,
            } => {
                put(&ctrl(true, last, opcode).to_be_bytes());
                put(&stag.to_be_bytes());
                put(&to.to_be_bytes());
            }
            Header::Untagged {
                last,
                opcode,
                ulp,
                qn,
                msn,
                mo,
            } => {
                put(&ctrl(false, last, opcode).to_be_bytes());
                put(&ulp.to_be_bytes());
                put(&qn.to_be_bytes());
                put(&msn.to_be_bytes());
                put(&mo.to_be_bytes());
            }
        }
        at
    }

    /// The header length announced by the first two ULPDU bytes (the control field).
    pub fn len_for_ctrl(ctrl: u16) -> usize {
        if ctrl & FLAG_TAGGED != 0 {
            TAGGED_LEN
        } else {
            UNTAGGED_LEN
        }
    }

    /// Decodes a header from the start of a ULPDU.
    pub fn decode(b: &[u8]) -> Result<Header, WireError> {
        if b.len() < 2 {
            return Err(WireError::new(
                "DDP header",
                format!("ULPDU of {} bytes has no control field", b.len()),
            ));
        }
        let ctrl = u16::from_be_bytes([b[0], b[1]]);
        let need = Self::len_for_ctrl(ctrl);
        if b.len() < need {
            return Err(WireError::new(
                "DDP header",
                format!("needs {need} bytes, ULPDU has {}", b.len()),
            ));
        }
        let ddp_version = (ctrl >> 8) & 0x3;
        if ddp_version != DDP_VERSION {
            return Err(WireError::new(
                "DDP version",
                format!("{ddp_version}, expected {DDP_VERSION}"),
            ));
        }
        let rdmap_version = (ctrl >> 6) & 0x3;
        if rdmap_version != RDMAP_VERSION {
            return Err(WireError::new(
                "RDMAP version",
                format!("{rdmap_version}, expected {RDMAP_VERSION}"),
            ));
        }
        let opcode = (ctrl & 0xf) as u8;
        let last = ctrl & FLAG_LAST != 0;
        let tagged_op = matches!(opcode, opcode::WRITE | opcode::READ_RESPONSE);
        if ctrl & FLAG_TAGGED != 0 {
            if !tagged_op {
                return Err(WireError::new(
                    "RDMAP opcode",
                    format!("{opcode:#x} is not a tagged message"),
                ));
            }
            Ok(Header::Tagged {
                last,
                opcode,
                stag: be32(b, 2),
                to: be64(b, 6),
            })
        } else {
            if tagged_op || opcode > opcode::IMMEDIATE {
                return Err(WireError::new(
                    "RDMAP opcode",
                    format!("{opcode:#x} is not an untagged message"),
                ));
            }
            Ok(Header::Untagged {
                last,
                opcode,
                ulp: be32(b, 2),
                qn: be32(b, 6),
                msn: be32(b, 10),
                mo: be32(b, 14),
            })
        }
    }
}

/// RDMA Read Request payload (RFC 5040 section 4.4), 28 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    /// Where the response goes (initiator's STag).
    pub sink_stag: u32,
    /// Offset in the sink.
    pub sink_to: u64,
    /// Bytes to read.
    pub size: u32,
    /// The target's STag.
    pub src_stag: u32,
    /// The target's address.
    pub src_to: u64,
}

impl ReadRequest {
    /// Encoded length.
    pub const LEN: usize = 28;
    /// Encodes.
    pub fn encode(&self) -> [u8; 28] {
        let mut b = [0; 28];
        b[0..4].copy_from_slice(&self.sink_stag.to_be_bytes());
        b[4..12].copy_from_slice(&self.sink_to.to_be_bytes());
        b[12..16].copy_from_slice(&self.size.to_be_bytes());
        b[16..20].copy_from_slice(&self.src_stag.to_be_bytes());
        b[20..28].copy_from_slice(&self.src_to.to_be_bytes());
        b
    }
    /// Decodes.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() != Self::LEN {
            return Err(WireError::new(
                "Read Request",
                format!("payload of {} bytes, expected 28", b.len()),
            ));
        }
        Ok(ReadRequest {
            sink_stag: be32(b, 0),
            sink_to: be64(b, 4),
            size: be32(b, 12),
            src_stag: be32(b, 16),
            src_to: be64(b, 20),
        })
    }
}

/// Atomic operation codes of the Atomic Request (RFC 7306 layout).
pub mod atomic_op {
    /// Fetch and add.
    pub const FETCH_ADD: u32 = 0;
    /// Compare and swap.
    pub const COMPARE_SWAP: u32 = 1;
}

/// Atomic Request payload (RFC 7306 section 5 layout), 52 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicRequest {
    /// [`atomic_op`] code.
    pub op: u32,
    /// Request identifier echoed in the response.
    pub req_id: u32,
    /// Target STag.
    pub stag: u32,
    /// Target address.
    pub to: u64,
    /// Addend (fetch-add) or swap value (compare-swap).
    pub add_swap: u64,
    /// Mask for masked variants (all ones here).
    pub add_swap_mask: u64,
    /// Compare value.
    pub compare: u64,
    /// Compare mask (all ones here).
    pub compare_mask: u64,
}

impl AtomicRequest {
    /// Encoded length.
    pub const LEN: usize = 52;
    /// Encodes.
    pub fn encode(&self) -> [u8; 52] {
        let mut b = [0; 52];
        b[0..4].copy_from_slice(&self.op.to_be_bytes());
        b[4..8].copy_from_slice(&self.req_id.to_be_bytes());
        b[8..12].copy_from_slice(&self.stag.to_be_bytes());
        b[12..20].copy_from_slice(&self.to.to_be_bytes());
        b[20..28].copy_from_slice(&self.add_swap.to_be_bytes());
        b[28..36].copy_from_slice(&self.add_swap_mask.to_be_bytes());
        b[36..44].copy_from_slice(&self.compare.to_be_bytes());
        b[44..52].copy_from_slice(&self.compare_mask.to_be_bytes());
        b
    }
    /// Decodes.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() != Self::LEN {
            return Err(WireError::new(
                "Atomic Request",
                format!("payload of {} bytes, expected 52", b.len()),
            ));
        }
        let op = be32(b, 0) & 0xf;
        if op > atomic_op::COMPARE_SWAP {
            return Err(WireError::new(
                "Atomic Request opcode",
                format!("{op} is not supported"),
            ));
        }
        Ok(AtomicRequest {
            op,
            req_id: be32(b, 4),
            stag: be32(b, 8),
            to: be64(b, 12),
            add_swap: be64(b, 20),
            add_swap_mask: be64(b, 28),
            compare: be64(b, 36),
            compare_mask: be64(b, 44),
        })
    }
}

/// Atomic Response payload, 12 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicResponse {
    /// The request's identifier.
    pub req_id: u32,
    /// The word's value before the operation.
    pub original: u64,
}

impl AtomicResponse {
    /// Encoded length.
    pub const LEN: usize = 12;
    /// Encodes.
    pub fn encode(&self) -> [u8; 12] {
        let mut b = [0; 12];
        b[0..4].copy_from_slice(&self.req_id.to_be_bytes());
        b[4..12].copy_from_slice(&self.original.to_be_bytes());
        b
    }
    /// Decodes.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() != Self::LEN {
            return Err(WireError::new(
                "Atomic Response",
                format!("payload of {} bytes, expected 12", b.len()),
            ));
        }
        Ok(AtomicResponse {
            req_id: be32(b, 0),
            original: be64(b, 4),
        })
    }
}

/// Ack ULP-field flag: the ack counts Send / Immediate Data messages matched to receives
/// (clear: RDMA Write messages placed).
pub const ACK_MESSAGES: u32 = 1 << 31;
/// Ack ULP-field mask of the count.
pub const ACK_COUNT: u32 = ACK_MESSAGES - 1;

/// Length of the Immediate Data payload.
pub const IMMEDIATE_LEN: usize = 8;

/// A Terminate message's error (RFC 5040 section 4.8): layer, type, code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terminate {
    /// 0 RDMAP, 1 DDP, 2 LLP (MPA).
    pub layer: u8,
    /// Error type.
    pub etype: u8,
    /// Error code.
    pub ecode: u8,
}

/// The message a Terminate names by the DDP header it copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TerminatedHeader {
    /// A tagged segment (RDMA Write or Read Response): its STag and tagged offset.
    Tagged {
        /// The segment's STag.
        stag: u32,
        /// The segment's tagged offset (a later segment's, when that one failed).
        to: u64,
    },
    /// An untagged message: its queue and message sequence number.
    Untagged {
        /// Queue number.
        qn: u32,
        /// Message sequence number.
        msn: u32,
    },
}

/// Terminate codes this provider sends (and the ones it maps from a peer).
pub mod term {
    use super::Terminate;
    /// RDMAP: invalid STag.
    pub const INVALID_STAG: Terminate = Terminate {
        layer: 0,
        etype: 1,
        ecode: 0x00,
    };
    /// RDMAP: base or bounds violation.
    pub const BASE_BOUNDS: Terminate = Terminate {
        layer: 0,
        etype: 1,
        ecode: 0x01,
    };
    /// RDMAP: access rights violation.
    pub const ACCESS_RIGHTS: Terminate = Terminate {
        layer: 0,
        etype: 1,
        ecode: 0x02,
    };
    /// RDMAP remote operation: invalid opcode (also: misaligned atomic target).
    pub const INVALID_OPCODE: Terminate = Terminate {
        layer: 0,
        etype: 2,
        ecode: 0x06,
    };
    /// RDMAP remote operation: the atomic's target word is not 8-byte aligned (our code;
    /// reported as RemoteInvalidRequest, as rxe reports a misaligned atomic).
    pub const MISALIGNED_ATOMIC: Terminate = Terminate {
        layer: 0,
        etype: 2,
        ecode: 0x0a,
    };
    /// RDMAP remote operation: unspecified.
    pub const REMOTE_OPERATION: Terminate = Terminate {
        layer: 0,
        etype: 2,
        ecode: 0xff,
    };
    /// DDP untagged: message too long for the receive buffer.
    pub const MSG_TOO_LONG: Terminate = Terminate {
        layer: 1,
        etype: 2,
        ecode: 0x05,
    };
    /// DDP untagged: no buffer for the message.
    pub const NO_BUFFER: Terminate = Terminate {
        layer: 1,
        etype: 2,
        ecode: 0x02,
    };
    /// DDP untagged: invalid queue number.
    pub const INVALID_QN: Terminate = Terminate {
        layer: 1,
        etype: 2,
        ecode: 0x01,
    };
    /// DDP tagged: invalid STag.
    pub const DDP_INVALID_STAG: Terminate = Terminate {
        layer: 1,
        etype: 1,
        ecode: 0x00,
    };
    /// DDP tagged: base or bounds.
    pub const DDP_BASE_BOUNDS: Terminate = Terminate {
        layer: 1,
        etype: 1,
        ecode: 0x01,
    };
    /// DDP untagged: invalid MSN, out of range (RFC 5041 section 7.2).
    pub const INVALID_MSN: Terminate = Terminate {
        layer: 1,
        etype: 2,
        ecode: 0x03,
    };
    /// DDP untagged: invalid MO.
    pub const INVALID_MO: Terminate = Terminate {
        layer: 1,
        etype: 2,
        ecode: 0x04,
    };
    /// DDP untagged: invalid DDP version.
    pub const DDP_VERSION_UNTAGGED: Terminate = Terminate {
        layer: 1,
        etype: 2,
        ecode: 0x06,
    };
    /// DDP tagged: invalid DDP version.
    pub const DDP_VERSION_TAGGED: Terminate = Terminate {
        layer: 1,
        etype: 1,
        ecode: 0x04,
    };
    /// RDMAP remote operation: invalid RDMAP version.
    pub const RDMAP_VERSION: Terminate = Terminate {
        layer: 0,
        etype: 2,
        ecode: 0x05,
    };
    /// LLP (MPA): the stream was lost (it ended inside an FPDU).
    pub const STREAM_LOST: Terminate = Terminate {
        layer: 2,
        etype: 0,
        ecode: 0x01,
    };
    /// LLP (MPA): CRC error.
    pub const CRC: Terminate = Terminate {
        layer: 2,
        etype: 0,
        ecode: 0x02,
    };
    /// LLP (MPA): invalid FPDU.
    pub const FPDU: Terminate = Terminate {
        layer: 2,
        etype: 0,
        ecode: 0x03,
    };
}

impl Terminate {
    /// Encodes the 4-byte Terminate Control field (no headers copied: M, D, R clear).
    pub fn encode(&self) -> [u8; 4] {
        let w = (u32::from(self.layer & 0xf) << 28)
            | (u32::from(self.etype & 0xf) << 24)
            | (u32::from(self.ecode) << 16);
        w.to_be_bytes()
    }
    /// Decodes the Terminate Control field (headers that follow are ignored).
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() < 4 {
            return Err(WireError::new(
                "Terminate control",
                format!("payload of {} bytes", b.len()),
            ));
        }
        let w = be32(b, 0);
        Ok(Terminate {
            layer: (w >> 28) as u8,
            etype: ((w >> 24) & 0xf) as u8,
            ecode: ((w >> 16) & 0xff) as u8,
        })
    }

    /// The message a Terminate names, from the DDP header it copies (RFC 5040 section 4.8:
    /// after the 4-byte control field, the DDP Segment Length and the terminated DDP
    /// header). `b` is the Terminate's payload. `None` when no header is copied, as in
    /// this provider's own Terminates. The copy is taken when the DDP control byte at its
    /// start is well-formed (DDP version 1, reserved bits clear) and the bytes are all
    /// there; the Hdr Ct bits are not trusted, because siw's sit elsewhere on x86 (see
    /// [`Terminate::decode_foreign`]).
    pub fn terminated_header(b: &[u8]) -> Option<TerminatedHeader> {
        const AT: usize = 6;
        let ctrl = u16::from_be_bytes(b.get(AT..AT + 2)?.try_into().ok()?);
        if (ctrl >> 8) & 0x3 != DDP_VERSION || ctrl & 0x3c00 != 0 {
            return None;
        }
        if ctrl & FLAG_TAGGED != 0 {
            (b.len() >= AT + TAGGED_LEN).then(|| TerminatedHeader::Tagged {
                stag: be32(b, AT + 2),
                to: be64(b, AT + 6),
            })
        } else {
            (b.len() >= AT + UNTAGGED_LEN).then(|| TerminatedHeader::Untagged {
                qn: be32(b, AT + 6),
                msn: be32(b, AT + 10),
            })
        }
    }

    /// Decodes a Terminate from a peer that is not of this framework. The kernel's siw
    /// fills the first byte through bitfields declared layer-first for little-endian hosts
    /// (`iwarp.h`, `struct iwarp_terminate`), so on x86 its layer lands in the low nibble
    /// and its error type in the high one, the reverse of RFC 5040. Of the two readings,
    /// the one that names a defined layer and error type wins; if both do, the one with a
    /// specific error type over "catastrophic" (0); if still tied, RFC 5040's.
    pub fn decode_foreign(b: &[u8]) -> Result<Self, WireError> {
        let rfc = Self::decode(b)?;
        let swapped = Terminate {
            layer: rfc.etype,
            etype: rfc.layer,
            ecode: rfc.ecode,
        };
        let defined = |t: &Terminate| match t.layer {
            0 | 1 => t.etype <= 2,
            2 => t.etype == 0,
            _ => false,
        };
        Ok(match (defined(&rfc), defined(&swapped)) {
            (false, true) => swapped,
            (true, true) if rfc.etype == 0 && swapped.etype != 0 => swapped,
            _ => rfc,
        })
    }

    /// The neutral error the initiator reports for a Terminate from its peer.
    pub fn error_kind(&self) -> fabric_api::ErrorKind {
        use fabric_api::ErrorKind as K;
        match (self.layer, self.etype) {
            (0, 1) | (1, 1) => K::RemoteAccess,
            (0, 2) if matches!(self.ecode, 0x05 | 0x06 | 0x0a) => K::RemoteInvalidRequest,
            (0, 2) => K::RemoteOperation,
            (1, 2) => K::RemoteInvalidRequest,
            _ => K::RemoteOperation,
        }
    }

    /// The provider code kept beside the neutral error.
    pub fn code(&self) -> fabric_api::ProviderCode {
        fabric_api::ProviderCode::Terminate {
            layer: self.layer,
            etype: self.etype,
            ecode: self.ecode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_match_the_kernel_layout() {
        let h = Header::Untagged {
            last: true,
            opcode: opcode::SEND,
            ulp: 0,
            qn: 0,
            msn: 1,
            mo: 0,
        };
        let mut b = Vec::new();
        h.encode_into(&mut b);
        assert_eq!(b.len(), UNTAGGED_LEN);
        // L | DDP v1 | RDMAP v1 | Send, as siw's iwarp.h lays the control field out.
        assert_eq!(&b[..2], &[0x41, 0x43]);
        assert_eq!(Header::decode(&b).unwrap(), h);
        let t = Header::Tagged {
            last: false,
            opcode: opcode::WRITE,
            stag: 0xabcd,
            to: 0x1122_3344_5566,
        };
        let mut b = Vec::new();
        t.encode_into(&mut b);
        assert_eq!(&b[..2], &[0x81, 0x40]);
        assert_eq!(Header::decode(&b).unwrap(), t);
    }

    #[test]
    fn bad_headers_name_their_field() {
        assert_eq!(
            Header::decode(&[0x41, 0x83, 0, 0]).unwrap_err().field,
            "DDP header"
        );
        let mut b = vec![0u8; 18];
        b[0] = 0x42; // DDP version 2
        b[1] = 0x43;
        assert_eq!(Header::decode(&b).unwrap_err().field, "DDP version");
        b[0] = 0x41;
        b[1] = 0x03; // RDMAP version 0
        assert_eq!(Header::decode(&b).unwrap_err().field, "RDMAP version");
        b[0] = 0xc1;
        b[1] = 0x43; // tagged Send
        assert_eq!(Header::decode(&b).unwrap_err().field, "RDMAP opcode");
    }

    #[test]
    fn payloads_round_trip() {
        let r = ReadRequest {
            sink_stag: 1,
            sink_to: 2,
            size: 3,
            src_stag: 4,
            src_to: 5,
        };
        assert_eq!(ReadRequest::decode(&r.encode()).unwrap(), r);
        let a = AtomicRequest {
            op: 1,
            req_id: 9,
            stag: 8,
            to: 64,
            add_swap: 7,
            add_swap_mask: !0,
            compare: 6,
            compare_mask: !0,
        };
        assert_eq!(AtomicRequest::decode(&a.encode()).unwrap(), a);
        let t = term::MSG_TOO_LONG;
        assert_eq!(Terminate::decode(&t.encode()).unwrap(), t);
        // siw on x86: layer in the low nibble. RDMAP protection / base-bounds arrives as
        // 0x10 0x01; DDP untagged arrives as 0x21.
        assert_eq!(
            Terminate::decode_foreign(&[0x10, 0x01, 0, 0]).unwrap(),
            term::BASE_BOUNDS
        );
        assert_eq!(
            Terminate::decode_foreign(&[0x21, 0x05, 0, 0]).unwrap(),
            term::MSG_TOO_LONG
        );
        // RFC-ordered codes from other peers keep their meaning.
        for t in [
            term::INVALID_STAG,
            term::MSG_TOO_LONG,
            term::DDP_INVALID_STAG,
            term::ACCESS_RIGHTS,
        ] {
            assert_eq!(Terminate::decode_foreign(&t.encode()).unwrap(), t);
        }
        assert_eq!(t.error_kind(), fabric_api::ErrorKind::RemoteInvalidRequest);
        assert_eq!(
            term::BASE_BOUNDS.error_kind(),
            fabric_api::ErrorKind::RemoteAccess
        );
    }

    #[test]
    fn terminated_headers_name_the_refused_message() {
        // Our own Terminates copy no header.
        assert_eq!(
            Terminate::terminated_header(&term::DDP_INVALID_STAG.encode()),
            None
        );
        // siw, DDP tagged error: control, MPA length, then the tagged header.
        let mut b = vec![0x11, 0x00, 0x03, 0x00, 0x00, 0x0e];
        Header::Tagged {
            last: true,
            opcode: opcode::WRITE,
            stag: 0xabcd,
            to: 0x1122_3344_5566_7788,
        }
        .encode_into(&mut b);
        assert_eq!(
            Terminate::terminated_header(&b),
            Some(TerminatedHeader::Tagged {
                stag: 0xabcd,
                to: 0x1122_3344_5566_7788
            })
        );
        // Cut short: no name rather than a wrong one.
        assert_eq!(Terminate::terminated_header(&b[..b.len() - 1]), None);
        // siw, DDP untagged error (no receive): QN and MSN of the refused Send.
        let mut b = vec![0x21, 0x01, 0x03, 0x00, 0x00, 0x12];
        Header::Untagged {
            last: true,
            opcode: opcode::SEND,
            ulp: 0,
            qn: qn::SEND,
            msn: 7,
            mo: 0,
        }
        .encode_into(&mut b);
        assert_eq!(
            Terminate::terminated_header(&b),
            Some(TerminatedHeader::Untagged { qn: 0, msn: 7 })
        );
        // A malformed copy (reserved bits set) names nothing.
        b[6] |= 0x3c;
        assert_eq!(Terminate::terminated_header(&b), None);
    }
}
