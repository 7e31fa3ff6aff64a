//! The fabric framework: one provider-neutral API, dispatched at run time to a provider.
//!
//! ```no_run
//! use std::sync::Arc;
//! use fabric::prelude::*;
//!
//! # fn main() -> fabric::Result<()> {
//! // FABRIC_PROVIDER / FABRIC_CONFIG, else the best available provider.
//! let (domain, report) = fabric::Selector::from_env()?.open()?;
//! println!("{report}");
//! let cq = domain.create_cq(64)?;
//! let mr = domain.register(Arc::new(Buffer::new(4096)), Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let ep = domain.connect("127.0.0.1:7471".parse().unwrap(), &EndpointConfig::new(&cq))?;
//! ep.post_send(&SendWr::send(1, &[mr.slice(0..64)?]))?;
//! # Ok(()) }
//! ```
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
//! # Hooks
//! `FABRIC_HOOKS=trace,fault`, `hooks = [...]` with a `[fault]` table in the config file, or
//! [`Selector::hooks`] wrap the selected provider in [`hook`]'s tracing and fault-injecting
//! wrappers: the domain is then [`AnyDomain::Hooked`] and its queues, endpoints and
//! listeners are hooked too; the selection report lists the active hooks.
#![forbid(unsafe_code)]

pub mod config;
pub mod dispatch;

pub use config::{discover, SelectionReport, Selector, PROVIDER_NAMES};
pub use dispatch::{
    AnyCq, AnyDomain, AnyEndpoint, AnyListener, CqOps, DomainOps, EndpointOps, ErasedCq,
    ErasedDomain, ErasedEndpoint, ErasedListener, ListenerOps,
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
        AnyCq, AnyDomain, AnyEndpoint, AnyListener, CqOps, DomainOps, EndpointOps, ListenerOps,
    };
    pub use fabric_api::spi::EndpointConfig;
    pub use fabric_api::{
        Access, Buffer, Completion, EndpointState, ErrorKind, MemoryRegion, OpSet, Opcode, RecvWr,
        RemoteAddr, RemoteDesc, SendWr, Status,
    };
}
