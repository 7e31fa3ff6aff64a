//! The wire format: iWARP as the RFCs define it, plus our negotiated extensions.
//!
//! * [`mpa`]: MPA (RFC 5044) connection setup with the enhanced establishment of RFC 6581
//!   (revision 2, IRD/ORD), FPDU framing (length, pad, CRC32c), markers never used.
//! * [`ddp`]: DDP (RFC 5041) tagged and untagged headers and RDMAP (RFC 5040) messages,
//!   Terminate, and the extension messages (atomics and immediate data modelled on
//!   RFC 7306, delivery acknowledgements).
//!
//! Decoding never panics on peer bytes: every failure is a [`WireError`] naming the field.

pub mod ddp;
pub mod mpa;

use std::fmt;

/// A decode failure: which field was wrong and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    /// The field (e.g. `"MPA key"`, `"DDP version"`).
    pub field: &'static str,
    /// What was wrong with it.
    pub detail: String,
}

impl WireError {
    pub(crate) fn new(field: &'static str, detail: impl Into<String>) -> Self {
        WireError {
            field,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad {}: {}", self.field, self.detail)
    }
}

impl std::error::Error for WireError {}

impl From<WireError> for fabric_api::Error {
    fn from(e: WireError) -> Self {
        fabric_api::Error::new(fabric_api::ErrorKind::Protocol, e.to_string())
    }
}

pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
