//! Reliable datagram (RDM) endpoints and tagged messages over any fabric provider: what
//! MPI-like middleware builds on (docs/contract.md section 9).
//!
//! An [`RdmEndpoint`] reaches many peers through one endpoint and one completion queue.
//! Peers go into its address vector ([`RdmEndpoint::av_insert`] from an address,
//! [`RdmEndpoint::av_insert_name`] from a name exchanged out of band) and are named by
//! [`Peer`] handles. The first operation addressed to a peer connects to it over the
//! provider's connected endpoints; connections from peers are accepted by one thread per
//! RDM endpoint (never one per peer), and a peer that connects first is inserted in the
//! address vector on its own. Progress is made by the application's calls
//! ([`RdmEndpoint::poll`], [`RdmEndpoint::wait`]); one-sided operations (and the reads of
//! the rendezvous protocol) progress in the provider.
//!
//! # Example: a client and a server
//! Each side is what one process would run: its own domain (here the tcp provider over
//! loopback) and its own endpoint. The names they exchange out of band (a file, the
//! launcher, a socket) go through channels here. The client posts the receive for the
//! reply, then sends a request tagged `REQUEST | 5`; the server receives any request from
//! any peer (the low 32 bits of the tag are ignored, and the completion tells which peer
//! and which tag), and answers with the same sequence number. Every completion is awaited
//! with a deadline.
//!
//! ```
//! use std::sync::{mpsc, Arc};
//! use std::time::Duration;
//! use fabric::prelude::*;
//! use fabric_rdm::{RdmConfig, RdmEndpoint, RdmOp, RecvBuf, Source};
//!
//! const REQUEST: u64 = 1 << 32; // the kind in the high bits of the tag,
//! const REPLY: u64 = 2 << 32;
//! const SEQ: u64 = 0xffff_ffff; // a sequence number in the low ones
//! const DEADLINE: Duration = Duration::from_secs(10);
//!
//! /// What one process opens: a domain and an RDM endpoint in it.
//! fn open() -> fabric::Result<(Arc<AnyDomain>, RdmEndpoint)> {
//!     let (domain, _) = fabric::Selector::new().providers("tcp")?.open()?;
//!     let domain = Arc::new(domain);
//!     let ep = RdmEndpoint::new(domain.clone(), RdmConfig::default())?;
//!     Ok((domain, ep))
//! }
//!
//! # fn main() -> fabric::Result<()> {
//! let (server_name_tx, server_name_rx) = mpsc::channel::<Vec<u8>>();
//! let (client_name_tx, client_name_rx) = mpsc::channel::<Vec<u8>>();
//!
//! // The server.
//! let server = std::thread::spawn(move || -> fabric::Result<()> {
//!     let (domain, ep) = open()?;
//!     server_name_tx.send(ep.name()).expect("client");
//!     let client = ep.av_insert_name(&client_name_rx.recv().expect("client"))?;
//!     let req = Arc::new(domain.alloc(64, Access::LOCAL_WRITE)?);
//!     ep.trecv(Source::Any, REQUEST, SEQ, RecvBuf::whole(req.clone()), 1)?;
//!     let c = ep.next_completion(DEADLINE)?;
//!     assert!(c.is_ok() && c.op == RdmOp::TaggedRecv, "{c:?}");
//!     assert_eq!((c.peer, c.tag, c.len), (Some(client), REQUEST | 5, 5));
//!     let text = req.buffer().to_vec(0, c.len as usize);
//!     assert_eq!(text, b"hello");
//!
//!     let reply = domain.alloc(64, Access::LOCAL_WRITE)?;
//!     reply.buffer().write(0, &text.to_ascii_uppercase());
//!     ep.tsend(client, REPLY | (c.tag & SEQ), reply.slice(0..5)?, 2)?;
//!     let c = ep.next_completion(DEADLINE)?;
//!     assert!(c.is_ok() && c.op == RdmOp::TaggedSend, "{c:?}");
//!     ep.close(DEADLINE)?; // the reply is on its way before the endpoint goes
//!     Ok(())
//! });
//!
//! // The client.
//! let (domain, ep) = open()?;
//! client_name_tx.send(ep.name()).expect("server");
//! let server_peer = ep.av_insert_name(&server_name_rx.recv().expect("server"))?;
//! let reply = Arc::new(domain.alloc(64, Access::LOCAL_WRITE)?);
//! let from = Source::Peer(server_peer);
//! ep.trecv(from, REPLY | 5, 0, RecvBuf::whole(reply.clone()), 20)?;
//! let req = domain.alloc(64, Access::LOCAL_WRITE)?;
//! req.buffer().write(0, b"hello");
//! ep.tsend(server_peer, REQUEST | 5, req.slice(0..5)?, 10)?;
//! let (mut sent, mut replied) = (false, false);
//! while !(sent && replied) {
//!     let c = ep.next_completion(DEADLINE)?; // TimedOut past the deadline
//!     assert!(c.is_ok(), "{c:?}");
//!     match c.context {
//!         10 => sent = true,
//!         20 => {
//!             assert_eq!((c.peer, c.tag, c.len), (Some(server_peer), REPLY | 5, 5));
//!             replied = true;
//!         }
//!         other => unreachable!("context {other}"),
//!     }
//! }
//! assert_eq!(reply.buffer().to_vec(0, 5), b"HELLO");
//! ep.close(DEADLINE)?;
//! server.join().expect("server thread")?;
//! # Ok(()) }
//! ```
//!
//! # Protocols
//! Every message carries a 40-byte header ([`wire`]). Messages up to
//! [`RdmConfig::eager_max`] are copied through registered bounce buffers (eager). Larger
//! ones send a rendezvous request with the address and key of the sender's memory; the
//! receiver, once a receive matched, reads the payload straight into the receive buffer
//! with RDMA Read and answers `FIN`, which completes the send. Memory the peer cannot
//! read (no `REMOTE_READ`, another domain) is staged in a registered copy first.
//!
//! A send completes once its payload is copied into a bounce buffer (eager; its buffer
//! may be reused), once a receive matched it (synchronous sends), or once the receiver
//! read it (rendezvous, `FIN`). An eager send that completed and was then lost with its
//! connection is not reported again (as with libfabric's inject completion).
//!
//! On the wire, eager messages go unsignaled in runs of up to 15 (and under half the send
//! queue): a completion would only free the bounce buffer, and the next signaled request's
//! completion frees those before it too, since a send queue completes in post order.
//! Control messages and rendezvous requests are always signaled, and
//! [`RdmEndpoint::flush`] sends a credit message to cover a last run that nothing signaled
//! follows. An unsignaled send that fails still completes (every provider reports errors),
//! and fails its connection like any other.
//!
//! # Flow control
//! Each connection posts [`RdmConfig::recv_depth`] receive buffers, and a sender holds one
//! credit per buffer; every header returns the credits its sender reposted since its last
//! message, and a credit-only message goes out when enough pile up with nothing to carry
//! them. Data messages leave three credits in reserve for acknowledgements and credit
//! returns, so that a flood of data can never block the messages that unblock it.
//! Messages that match no receive are copied out of the bounce buffer into the unexpected
//! queue; once it holds [`RdmConfig::max_unexpected_bytes`], the credits of further
//! unexpected messages are withheld until a receive takes them, so senders wait: nothing is
//! lost, nothing errors, and the receiver's memory stays bounded (by the limit plus
//! `recv_depth` eager messages per connection).
//!
//! # Failure
//! A connection that fails fails what was in flight or queued on it, with the transport's
//! status (`RetryExceeded` for a silent peer, `Flushed` for one that went away), and the
//! receives naming that peer; every other peer is untouched. The bound is the provider's
//! dead-peer detection (tcp: `dead_peer_timeout_ms`, 10 s by default; a killed process is
//! seen at once). The next operation to the peer connects again. A connection we accepted
//! and over which nothing of the peer's has come yet is checked before each message: its
//! initiator may have closed it on reading our name (it was looking for an endpoint that
//! held our address before us), and a message then goes over another connection, not
//! that one.
//!
//! # Limits
//! Credits keep every message behind a posted buffer, except right after a connection is
//! made: the first messages may arrive before the accepting side posted its buffers, and
//! wait there on the provider's receiver-not-ready retry (`OpSet::RNR_WAIT`), which a pair
//! of different providers may lack (tcp against iwarp). The first operation to a peer
//! waits for the connection (up to [`RdmConfig::connect_timeout`], trying again after a
//! transient failure such as siw's 5 s MPA reply timeout); other threads keep using
//! the endpoint meanwhile. RDMA operations go to the provider at once and may overtake
//! messages to the same peer that are still waiting for credits. An RDMA error (a bad
//! key) puts the provider's connection in the error state: it is dropped, what was queued
//! on it fails `Flushed`, and the next operation reconnects.
#![forbid(unsafe_code)]

mod ep;
pub mod matching;
mod slab;
pub mod wire;

/// A map keyed by ids this layer hands out itself (operations, connections, work requests,
/// posted receives: counters, never chosen by a peer), hashed without SipHash
/// ([`fabric::hash::IdHasher`]); the maps keyed by what a peer sends use a randomly seeded
/// hash (SipHash for addresses, foldhash for the matcher's (source, tag) buckets).
pub(crate) type IdMap<V> = fabric::hash::IdMap<u64, V>;

pub use ep::{
    decode_name, Claimed, Peer, ProbeInfo, RdmCompletion, RdmConfig, RdmEndpoint, RdmOp, RdmStats,
    RdmStatus, RecvBuf, RecvId, Source,
};
