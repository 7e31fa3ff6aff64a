//! The fabric framework: one provider-neutral API for endpoints, memory registration and
//! completion queues, dispatched at run time to a provider: `ib`, `roce` and `iwarp` on
//! rdma-core's verbs (loaded at run time; the `verbs` feature), or `tcp`, a pure-Rust
//! provider that speaks iWARP on the wire and runs on every machine.
//!
//! Every provider obeys one semantic contract, `docs/contract.md` in the repository
//! (sections 1 to 9: selection, memory registration, messaging, RMA, atomics, completions
//! and errors, connections, bad input, RDM endpoints); the conformance suite
//! (`fabric conformance`) holds each provider to it, case by case. Where a provider cannot
//! do something natively it emulates it and says so in its capabilities and the selection
//! report, or declares it unsupported and refuses it at post with
//! [`ErrorKind::Unsupported`].
//!
//! # Guide
//! 1. **Open a domain.** [`Selector`] picks the provider: [`Selector::from_env`] reads
//!    `FABRIC_PROVIDER` (`roce,tcp`, `^ib`) and `FABRIC_CONFIG` (a TOML file), else the
//!    best available provider in the order ib, roce, iwarp, tcp wins. [`Selector::open`]
//!    returns the [`AnyDomain`] and a [`SelectionReport`] that names the provider, the
//!    device, the providers passed over and why, and what is emulated (contract section 1).
//!    [`discover`] lists every provider, available or not, with its capabilities.
//! 2. **Register memory.** [`DomainOps::alloc`] (or [`DomainOps::register`] with a
//!    [`Buffer`]) gives a [`MemoryRegion`] with [`Access`] rights. Its [`RemoteDesc`]
//!    (address, length, key) is plain data to hand to a peer; the buffer is read and
//!    written through copies ([`Buffer::read`], [`Buffer::write`], [`Buffer::to_vec`])
//!    that are sound while a peer writes into it (contract section 2).
//! 3. **Connect.** A completion queue ([`DomainOps::create_cq`]), then
//!    [`DomainOps::listen`] and [`ListenerOps::accept`] on one side and
//!    [`DomainOps::connect`] on the other, each with an [`EndpointConfig`]; a little
//!    private data may ride on both (contract section 7). `connect` blocks until the peer's
//!    application accepts; [`DomainOps::connect_start`] and [`ListenerOps::try_accept`]
//!    never block, so one thread can connect and accept at once (a ring of ranks), and
//!    their descriptors ([`AnyConnecting`], [`AnyListener`] are `AsFd`) fit an event loop
//!    (`fabric::tokio::{connect, accept}` with the `tokio` feature). An endpoint reports
//!    what happens to its connection as events ([`EndpointOps::next_event`]);
//!    [`EndpointOps::close_drained`] lets what was posted finish before it closes.
//! 4. **Post and complete.** [`EndpointOps::post_recv`] and [`EndpointOps::post_send`]
//!    take work requests ([`RecvWr`], [`SendWr::send`], [`SendWr::write`],
//!    [`SendWr::read`], [`SendWr::fetch_add`], [`SendWr::compare_swap`]); each yields one
//!    [`Completion`], in post order per queue, taken with [`CqOps::poll`] (never blocks) or
//!    after [`CqOps::wait`] (sleeps on an event) (contract sections 3 to 6).
//!
//! # A client and a server
//! Both sides in one process over loopback on the tcp provider (two domains, as two
//! processes would have). The server hands its region's descriptor to the client in the
//! accept's private data; the client writes into that region with one RDMA Write, then
//! sends a message. The server never polls during the write: a send posted after a write
//! arrives only once the written data is in place (contract section 4), so when the
//! message's receive completes, the region holds the written bytes.
//!
//! ```
//! use std::time::Duration;
//! use fabric::prelude::*;
//! use fabric::Selector;
//!
//! /// Waits (up to 10 s) for the next completion and checks that it succeeded.
//! fn next(cq: &AnyCq) -> fabric::Result<Completion> {
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
//! # fn main() -> fabric::Result<()> {
//! let selector = Selector::new().providers("tcp")?;
//!
//! // The server: a region peers may write, a listener on any free loopback port.
//! let (server, report) = selector.open()?;
//! println!("{report}");
//! let listener = server.listen("127.0.0.1:0".parse().unwrap())?;
//! let addr = listener.local_addr();
//! let server_thread = std::thread::spawn(move || -> fabric::Result<Vec<u8>> {
//!     let cq = server.create_cq(16)?;
//!     let target = server.alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//!     let desc = target.desc().to_bytes();
//!     let cfg = EndpointConfig { private_data: &desc, ..EndpointConfig::new(&cq) };
//!     let ep = listener.accept(&cfg, Duration::from_secs(10))?;
//!     let inbox = server.alloc(64, Access::LOCAL_WRITE)?;
//!     ep.post_recv(&RecvWr::new(7, &[inbox.all()]))?;
//!     let c = next(&cq)?; // the client's message
//!     assert_eq!((c.context, c.opcode, c.byte_len), (7, Opcode::Recv, 5));
//!     assert_eq!(inbox.buffer().to_vec(0, 5), b"done!");
//!     // The RDMA Write landed before the message: no poll was needed for it.
//!     Ok(target.buffer().to_vec(0, 11))
//! });
//!
//! // The client: its own domain, the server's descriptor from the private data.
//! let (client, _) = selector.open()?;
//! let cq = client.create_cq(16)?;
//! let ep = client.connect(addr, &EndpointConfig::new(&cq))?;
//! let remote = RemoteDesc::from_bytes(&ep.peer_private_data())?;
//! let src = client.alloc(64, Access::empty())?;
//! src.buffer().write(0, b"hello, RDMA");
//! ep.post_send(&SendWr::write(1, &[src.slice(0..11)?], remote.at(0)))?;
//! let c = next(&cq)?; // complete: the bytes are in the server's memory
//! assert_eq!((c.context, c.opcode), (1, Opcode::Write));
//! src.buffer().write(16, b"done!");
//! ep.post_send(&SendWr::send(2, &[src.slice(16..21)?]))?;
//! assert_eq!(next(&cq)?.context, 2);
//!
//! let written = server_thread.join().expect("server thread")?;
//! assert_eq!(written, b"hello, RDMA");
//! # Ok(()) }
//! ```
//!
//! The same program runs on any provider: with `Selector::from_env()?` instead of
//! `providers("tcp")`, and on roce or iwarp with the device's address instead of
//! 127.0.0.1. The repository's `examples/` (crate `fabric-examples`: pingpong, RMA with the
//! descriptor in private data, an atomic counter, choosing a provider from a TOML file) are
//! complete programs with a `--role server|client` switch for two hosts; the README's
//! "Selecting a provider", "Tracing and fault injection", "Providers" and "Conformance"
//! sections and `docs/contract.md` go further.
//!
//! # Why two sets of traits
//! Providers implement the statically typed traits of [`fabric_api::spi`] (a domain's
//! endpoints take that domain's completion queues). `enum_dispatch` needs its trait and its
//! enum in one crate, and `fabric_api` cannot name the providers that depend on it, so this
//! crate defines the type-erased traits ([`DomainOps`], [`CqOps`], [`EndpointOps`],
//! [`ListenerOps`]) next to the enums ([`AnyDomain`], [`AnyCq`], [`AnyEndpoint`],
//! [`AnyListener`]) and implements them once, generically, for every provider type. The
//! only per-provider code is one line in [`dispatch`] naming its types.
//!
//! # Features
//! `verbs` (on by default) builds the roce, iwarp and ib providers on the verbs core, which
//! loads rdma-core (libibverbs, librdmacm) at run time: a binary with them starts on a
//! machine without rdma-core and reports them unavailable with the reason. Building them
//! needs rdma-core's headers; without the feature only tcp is built, with no rdma-core at
//! build or run time, and roce, iwarp and ib report that they are not built in.
//!
//! `tokio` (off by default) adds [`tokio`](mod@crate::tokio): [`tokio::AsyncCq`] awaits a
//! completion queue through its notification descriptor (every queue has one:
//! [`CqOps::arm`], and [`AsFd`](std::os::fd::AsFd) on [`AnyCq`], for any event loop) and is
//! a `Stream` of completions; `tokio::connect`, `tokio::accept` and `tokio::next_event` set
//! up connections and await their events without blocking the runtime.
//!
//! # Hooks
//! `FABRIC_HOOKS=trace,fault`, `hooks = [...]` with a `[fault]` table in the config file, or
//! [`Selector::hooks`] wrap the selected provider in [`hook`]'s tracing and fault-injecting
//! wrappers: the domain is then [`AnyDomain::Hooked`] and its queues, endpoints and
//! listeners are hooked too; the selection report lists the active hooks.
#![forbid(unsafe_code)]

pub mod config;
pub mod dispatch;
#[cfg(feature = "tokio")]
pub mod tokio;

pub use config::{discover, SelectionReport, Selector, PROVIDER_NAMES};
pub use dispatch::{
    AnyConnecting, AnyCq, AnyDomain, AnyEndpoint, AnyListener, CqOps, DomainOps, EndpointOps,
    ErasedConnecting, ErasedCq, ErasedDomain, ErasedEndpoint, ErasedListener, ListenerOps,
};
pub use fabric_api::spi::EndpointConfig;
pub use fabric_api::*;
/// The tracing and fault-injecting wrappers ([`fabric_hook`]).
pub use fabric_hook as hook;
pub use fabric_hook::{FaultConfig, FaultStats, HookConfig, Trigger};
/// The verbs core under the roce, iwarp and ib providers ([`fabric_verbs`]): device facts
/// and rdma-core's loading, for diagnosis (`fabric doctor`). Only with the `verbs` feature.
#[cfg(feature = "verbs")]
pub use fabric_verbs as verbs;

/// Everything an application needs in scope.
pub mod prelude {
    pub use crate::dispatch::{
        AnyConnecting, AnyCq, AnyDomain, AnyEndpoint, AnyListener, CqOps, DomainOps, EndpointOps,
        ListenerOps,
    };
    pub use fabric_api::spi::EndpointConfig;
    pub use fabric_api::{
        Access, Buffer, Completion, EndpointEvent, EndpointState, ErrorKind, MemoryRegion, OpSet,
        Opcode, RecvWr, RemoteAddr, RemoteDesc, SendWr, Status,
    };
}
