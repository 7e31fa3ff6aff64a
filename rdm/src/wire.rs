//! The wire format of the RDM layer: one fixed header in front of every message it sends
//! over a provider's connected endpoint.
//!
//! ```text
//! 0      1      2             4             8                16               24               32               40
//! | kind | flags| credits u16 | key u32     | tag u64        | len u64        | op u64         | addr u64       |
//! ```
//! All fields are little-endian. `credits` returns receive buffers the sender of this header
//! reposted since its last message (credit-based flow control, see [`crate`]). `op` names
//! the sender's operation (echoed in acknowledgements); `addr` and `key` locate the payload
//! of a rendezvous request (read by the receiver with RDMA Read).

use fabric::{Error, Result};

/// Bytes of the header.
pub const HDR_LEN: usize = 40;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A whole message follows the header.
    Eager,
    /// Rendezvous request: the receiver reads `len` bytes at `addr`/`key`, then sends `Fin`.
    Rts,
    /// The receiver matched a synchronous eager send `op`.
    Ack,
    /// The receiver finished reading rendezvous `op` (it was matched).
    Fin,
    /// Only returns credits.
    Credit,
    /// The sender is closing: answer `ByeAck`, then send nothing more on this connection.
    Bye,
    /// Answers `Bye`: nothing more follows on this connection.
    ByeAck,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Eager => 1,
            Kind::Rts => 2,
            Kind::Ack => 3,
            Kind::Fin => 4,
            Kind::Credit => 5,
            Kind::Bye => 6,
            Kind::ByeAck => 7,
        }
    }

    fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::Eager,
            2 => Kind::Rts,
            3 => Kind::Ack,
            4 => Kind::Fin,
            5 => Kind::Credit,
            6 => Kind::Bye,
            7 => Kind::ByeAck,
            _ => return None,
        })
    }

    /// True for messages that carry application data (and are matched).
    pub fn is_data(self) -> bool {
        matches!(self, Kind::Eager | Kind::Rts)
    }
}

/// Header flag: the message is tagged (else it is an untagged message).
pub const F_TAGGED: u8 = 1;
/// Header flag: synchronous send (the sender waits until a receive matched it).
pub const F_SYNC: u8 = 2;

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the message is.
    pub kind: Kind,
    /// [`F_TAGGED`], [`F_SYNC`].
    pub flags: u8,
    /// Credits returned to the receiver of this header.
    pub credits: u16,
    /// Remote key of a rendezvous payload.
    pub key: u32,
    /// Tag (tagged messages).
    pub tag: u64,
    /// Length of the application message.
    pub len: u64,
    /// The sender's operation.
    pub op: u64,
    /// Address of a rendezvous payload.
    pub addr: u64,
}

impl Header {
    /// A header of `kind` with every other field zero.
    pub fn new(kind: Kind) -> Self {
        Header {
            kind,
            flags: 0,
            credits: 0,
            key: 0,
            tag: 0,
            len: 0,
            op: 0,
            addr: 0,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0] = self.kind.code();
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.credits.to_le_bytes());
        b[4..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..40].copy_from_slice(&self.addr.to_le_bytes());
        b
    }

    /// Decodes a header; a short buffer or an unknown kind is a protocol error.
    pub fn decode(b: &[u8]) -> Result<Header> {
        if b.len() < HDR_LEN {
            return Err(Error::new(
                fabric::ErrorKind::Protocol,
                format!(
                    "rdm message of {} bytes is shorter than its header",
                    b.len()
                ),
            ));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let kind = Kind::from_code(b[0]).ok_or_else(|| {
            Error::new(
                fabric::ErrorKind::Protocol,
                format!("unknown rdm message kind {}", b[0]),
            )
        })?;
        Ok(Header {
            kind,
            flags: b[1],
            credits: u16::from_le_bytes([b[2], b[3]]),
            key: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            tag: u64_at(8),
            len: u64_at(16),
            op: u64_at(24),
            addr: u64_at(32),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header {
            kind: Kind::Rts,
            flags: F_TAGGED | F_SYNC,
            credits: 513,
            key: 0xdead_beef,
            tag: u64::MAX - 5,
            len: 1 << 33,
            op: 77,
            addr: 0x1234_5678_9abc,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn short_or_unknown_is_a_protocol_error() {
        assert_eq!(
            Header::decode(&[1; 10]).unwrap_err().kind(),
            fabric::ErrorKind::Protocol
        );
        let mut b = Header::new(Kind::Eager).encode();
        b[0] = 99;
        assert_eq!(
            Header::decode(&b).unwrap_err().kind(),
            fabric::ErrorKind::Protocol
        );
    }
}
