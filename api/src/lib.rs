//! Provider-neutral API of the fabric framework.
//!
//! This crate holds everything that is the same on every provider: the error vocabulary
//! ([`ErrorKind`], contract section 6), memory regions that own their buffer
//! ([`MemoryRegion`], [`Slice`], [`RemoteDesc`]; section 2), work requests and completions
//! ([`SendWr`], [`RecvWr`], [`Completion`]; sections 3 to 6), capability descriptions
//! ([`Capabilities`], [`OpSet`]; section 1), and the provider traits in [`spi`] that every
//! provider implements. "Contract section N" is a section of `docs/contract.md` in the
//! repository: the semantics every provider obeys, which the conformance suite checks.
//!
//! **Applications** normally use the `fabric` crate: it re-exports everything here, selects
//! a provider at run time and dispatches to it (its crate docs have the guide). Use this
//! crate directly to **write a provider** (implement [`spi::Domain`], [`spi::Listener`],
//! [`spi::CompletionQueue`] and [`spi::Endpoint`]) or to write code generic over providers,
//! as below.
//!
//! `unsafe` code lives in [`mem`], the audited module that owns registered memory (and in
//! one `poll(2)` call, [`notify::wait_readable`], and in [`sync`]'s valgrind client
//! requests, which annotate its locks for the race detector): [`Buffer`] is an allocation with a stable
//! address (the framework's own, page-aligned, or memory the application handed over: a
//! `Vec`, huge pages, a foreign allocator's), shared by its region and by every operation in
//! flight, and read and written from Rust only through 64-bit atomic copies
//! ([`Buffer::read`], [`Buffer::write`]), so a peer writing into it at the same moment is
//! never undefined behaviour (contract section 2; the README's "Registered memory without
//! undefined behaviour").
//!
//! # A client and a server, generic over the provider
//! The statically typed traits of [`spi`]: a domain's endpoints take that domain's
//! completion queues. Here they run on the tcp provider (crate `fabric-tcp`) over loopback;
//! any other provider's domain type works the same. The server hands its region's
//! descriptor over in the accept's private data, the client writes into the region with
//! one RDMA Write and then sends a message; the message arrives only after the written
//! data (contract section 4), so the server checks both once the receive completes.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use fabric_api::spi::{CompletionQueue, Domain, Endpoint, EndpointConfig, Listener};
//! use fabric_api::{Access, Buffer, Completion, Opcode, RecvWr, RemoteDesc, Result, SendWr, Status};
//!
//! /// Waits (up to 10 s) for the next completion and checks that it succeeded.
//! fn next(cq: &impl CompletionQueue) -> Result<Completion> {
//!     let mut out = Vec::new();
//!     for _ in 0..100 {
//!         if cq.poll(&mut out, 1)? == 1 {
//!             let c = out.remove(0);
//!             assert_eq!(c.status, Status::Success, "{c:?}");
//!             return Ok(c);
//!         }
//!         cq.wait(Duration::from_millis(100))?;
//!     }
//!     panic!("no completion within 10 s");
//! }
//!
//! /// Accepts one connection, receives one message, returns what was written into its region.
//! fn server<D: Domain>(domain: &D, listener: &D::Listener) -> Result<Vec<u8>> {
//!     let cq = domain.create_cq(16)?;
//!     let target = domain.register(
//!         Arc::new(Buffer::new(4096)),
//!         Access::LOCAL_WRITE | Access::REMOTE_WRITE,
//!     )?;
//!     let desc = target.desc().to_bytes();
//!     let cfg = EndpointConfig { private_data: &desc, ..EndpointConfig::new(&cq) };
//!     let ep = listener.accept(&cfg, Duration::from_secs(10))?;
//!     let inbox = domain.register(Arc::new(Buffer::new(64)), Access::LOCAL_WRITE)?;
//!     ep.post_recv(&RecvWr::new(7, &[inbox.all()]))?;
//!     let c = next(&cq)?;
//!     assert_eq!((c.context, c.opcode, c.byte_len), (7, Opcode::Recv, 5));
//!     assert_eq!(inbox.buffer().to_vec(0, 5), b"done!");
//!     Ok(target.buffer().to_vec(0, 11))
//! }
//!
//! /// Connects, writes into the server's region, then sends a message.
//! fn client<D: Domain>(domain: &D, addr: std::net::SocketAddr) -> Result<()> {
//!     let cq = domain.create_cq(16)?;
//!     let ep = domain.connect(addr, &EndpointConfig::new(&cq))?;
//!     let remote = RemoteDesc::from_bytes(&ep.peer_private_data())?;
//!     let src = domain.register(Arc::new(Buffer::new(64)), Access::empty())?;
//!     src.buffer().write(0, b"hello, RDMA");
//!     ep.post_send(&SendWr::write(1, &[src.slice(0..11)?], remote.at(0)))?;
//!     assert_eq!(next(&cq)?.opcode, Opcode::Write); // in the server's memory now
//!     src.buffer().write(16, b"done!");
//!     ep.post_send(&SendWr::send(2, &[src.slice(16..21)?]))?;
//!     assert_eq!(next(&cq)?.context, 2);
//!     Ok(())
//! }
//!
//! # fn main() -> Result<()> {
//! use fabric_tcp::{TcpDomain, TcpOptions};
//! let (server_domain, client_domain) =
//!     (TcpDomain::open(TcpOptions::default())?, TcpDomain::open(TcpOptions::default())?);
//! let listener = server_domain.listen("127.0.0.1:0".parse().unwrap())?;
//! let addr = listener.local_addr();
//! let written = std::thread::scope(|s| {
//!     let srv = s.spawn(|| server(&server_domain, &listener));
//!     client(&client_domain, addr)?;
//!     srv.join().expect("server thread")
//! })?;
//! assert_eq!(written, b"hello, RDMA");
//! # Ok(()) }
//! ```
#![deny(unsafe_code)]

pub mod caps;
pub mod emu_wire;
pub mod error;
pub mod hash;
#[allow(unsafe_code)]
pub mod mem;
pub mod notify;
pub mod pdata;
pub mod region;
pub mod spi;
pub mod sync;
pub mod wr;

pub use caps::{Availability, Capabilities, DeviceInfo, Emulation, Limits, OpSet, ProviderInfo};
pub use error::{Error, ErrorKind, ProviderCode, Result};
pub use mem::{send_gather, Buffer, HugePages, IoPiece};
pub use notify::{EndpointEvent, EndpointEvents, Notifier};
pub use region::{Access, MemoryRegion, RegionRef, Registration, RemoteDesc, Slice};
pub use wr::{
    AtomicOp, Completion, EndpointState, Opcode, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr,
    Status,
};
