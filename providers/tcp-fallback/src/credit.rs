//! The iWARP credit protocol, spoken with this framework's iwarp provider (and only with
//! it: [`fabric_api::pdata`]).
//!
//! An iWARP Send that finds no posted receive is fatal at an iWARP target, so the iwarp
//! provider sends only while its peer has a receive for the message, and tells its peer
//! how many receives it ever posted by RDMA-Writing the count into the peer's credit area
//! (word [`area::POSTED`]). Against that provider the tcp provider does the same, both
//! ways:
//!
//! * it owns an area ([`LocalArea`]: [`area::LEN`] bytes, and the sink of its delivery
//!   reads after them, registered for remote write and read in the domain's STag table),
//!   which it names to the peer: in its reply's frame as the responder, and as the
//!   initiator (whose request carried no frame) by writing the descriptor at
//!   [`area::AREA_OF_PEER`] of the peer's area right before its hello mark;
//! * a message that consumes a receive at the peer (a Send) leaves only while
//!   `sent + 1 <= peer_posted` ([`credit_allows`]); it is held back in the connection's
//!   backlog, with everything posted after it, until the peer's count grows (the receive
//!   machine re-checks the backlog after every RDMA Write it places);
//! * every receive posted is counted, and the count written into the peer's area: at once
//!   when nothing is queued for the socket, else coalesced into the one update that is
//!   written next (at most one update is queued at a time, and when it has left a newer
//!   count follows if receives were posted meanwhile, so the peer never waits on a stale
//!   count).
//!
//! Between two tcp endpoints and against a foreign iWARP stack none of this runs: tcp
//! targets buffer unexpected sends (delivery acks say when they landed).

use std::sync::Arc;

use fabric_api::pdata::{self, area};
use fabric_api::{Access, Buffer};

use crate::keys::KeyTable;

/// Our credit area: the peer writes its posted-receive count (and its close mark) here,
/// and reads the count back with its delivery reads. Its STag dies with it.
#[derive(Debug)]
pub(crate) struct LocalArea {
    buf: Arc<Buffer>,
    stag: u32,
    keys: Arc<KeyTable>,
}

impl LocalArea {
    /// Allocates the area and registers it in the domain's STag table.
    pub fn new(keys: &Arc<KeyTable>) -> LocalArea {
        let buf = Arc::new(Buffer::new(area::LOCAL_LEN));
        let stag = keys.insert(
            buf.clone(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        );
        LocalArea {
            buf,
            stag,
            keys: keys.clone(),
        }
    }

    /// The area's descriptor for the peer.
    pub fn desc(&self) -> pdata::AreaDesc {
        pdata::AreaDesc {
            addr: self.buf.addr(),
            stag: self.stag,
        }
    }

    /// The peer's count of receives it ever posted (an atomic word copy: the receive
    /// machine places the peer's writes concurrently).
    pub fn peer_posted(&self) -> u64 {
        self.buf.read_pod::<u64>(area::POSTED)
    }

    /// The peer marked a graceful close here ([`area::CLOSED`]): the iwarp provider writes
    /// the mark before it disconnects, so an end without it was not a close.
    pub fn peer_closed(&self) -> bool {
        self.buf.read_pod::<u64>(area::CLOSED) != 0
    }

    /// Where our delivery reads land: the sink after the area ([`area::SINK`]). They read
    /// the peer's whole area ([`area::READ_LEN`] bytes, only for the ordering of the
    /// response): siw builds a response of at most 32 bytes in a way that can fail the
    /// connection (see [`area::READ_LEN`]).
    pub fn sink(&self) -> (Arc<Buffer>, usize, usize) {
        (self.buf.clone(), area::SINK, area::READ_LEN)
    }

    /// The descriptor as the initiator writes it at [`area::AREA_OF_PEER`]: two words in
    /// host order (the owner's: both ends are on this framework and the iwarp provider reads
    /// the words as `u64`s), address then steering tag.
    pub fn announcement(&self) -> Vec<u8> {
        let d = self.desc();
        let mut v = d.addr.to_ne_bytes().to_vec();
        v.extend_from_slice(&u64::from(d.stag).to_ne_bytes());
        v
    }
}

impl Drop for LocalArea {
    fn drop(&mut self) {
        self.keys.remove(self.stag);
    }
}

/// Whether `sends` more receive-consuming messages may leave after `sent` of them left,
/// when the peer posted `peer_posted` receives in all.
pub(crate) fn credit_allows(sent: u64, sends: u64, peer_posted: u64) -> bool {
    sends == 0 || sent.checked_add(sends).is_some_and(|n| n <= peer_posted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_leave_only_against_the_peers_receives() {
        assert!(credit_allows(0, 0, 0), "no send needs no credit");
        assert!(!credit_allows(0, 1, 0));
        assert!(credit_allows(0, 1, 1));
        assert!(!credit_allows(1, 1, 1));
        assert!(credit_allows(4, 1, 5));
        assert!(
            !credit_allows(4, 2, 5),
            "a group leaves whole or not at all"
        );
        assert!(credit_allows(u64::MAX, 0, 0));
        assert!(!credit_allows(u64::MAX, 1, u64::MAX));
    }

    #[test]
    fn the_area_is_remotely_writable_and_readable_until_dropped() {
        let keys = Arc::new(KeyTable::default());
        let a = LocalArea::new(&keys);
        let d = a.desc();
        assert_ne!(d.stag, 0);
        assert_eq!(a.peer_posted(), 0);
        let Ok(t) = keys.lookup(
            d.stag,
            d.addr + area::POSTED as u64,
            8,
            Access::REMOTE_WRITE | Access::REMOTE_READ,
        ) else {
            panic!("registered for remote write and read");
        };
        t.buffer.write(t.offset, &7u64.to_ne_bytes());
        assert_eq!(a.peer_posted(), 7);
        let ann = a.announcement();
        assert_eq!(ann.len(), 16);
        assert_eq!(u64::from_ne_bytes(ann[..8].try_into().unwrap()), d.addr);
        assert_eq!(
            u64::from_ne_bytes(ann[8..].try_into().unwrap()),
            u64::from(d.stag)
        );
        assert!(area::AREA_OF_PEER + ann.len() <= area::LEN);
        drop(a);
        assert!(keys
            .lookup(d.stag, d.addr, 8, Access::REMOTE_WRITE)
            .is_err());
    }
}
