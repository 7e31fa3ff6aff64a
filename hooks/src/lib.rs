//! Hooks over any fabric provider: a tracing wrapper and a fault-injecting wrapper.
//!
//! [`HookDomain`] wraps a domain of any provider (anything implementing
//! [`fabric_api::spi::Domain`]) and implements the same traits, so its completion queues
//! ([`HookCq`]), endpoints ([`HookEndpoint`]) and listeners ([`HookListener`]) stand in for
//! the provider's own, like libfabric's `prov/hook` or smoltcp's `FaultInjector` and
//! `Tracer` devices. Applications normally switch hooks on by configuration
//! (`FABRIC_HOOKS=trace,fault`, a `hooks = [...]` key and a `[fault]` table in the config
//! file, or `fabric::Selector::hooks`); the `fabric` crate then wraps the domain it opens.
//!
//! # Tracing
//! With `trace` on, every call is logged with the `tracing` crate under the target
//! `fabric_hook`: connect, accept, listen, close and memory registration and
//! deregistration at DEBUG; every post (opcode, context, lengths, gather entries, remote
//! address and key, immediate data, flags) and every completion (context, opcode, status,
//! provider code, byte length) at TRACE, inside a `fabric_ep` span per endpoint (its id,
//! provider, local and peer address). `RUST_LOG=fabric_hook=trace` shows all of it.
//!
//! # Faults
//! A [`FaultConfig`] names the faults; each fires by a [`Trigger`] (every Nth event and/or
//! with a probability drawn from a generator seeded by `seed`, one stream per endpoint and
//! per completion queue, so a single-threaded run repeats exactly):
//! * `fail_post`: the post returns an error of the chosen kind; nothing reaches the
//!   provider and no completion follows.
//! * `delay`: the completion is held back for the chosen time; completions behind it on the
//!   same queue wait for it, so order is kept.
//! * `drop`: a successful completion is lost the way an acknowledgement is lost: the
//!   operation completes with an error status (default `RetryExceeded`) and its endpoint
//!   enters the error state as after any error completion (the connection is closed, later
//!   completions of that endpoint arrive `Flushed`, posts fail). Nothing is silently
//!   missing: every posted operation still yields exactly one completion.
//! * `cut`: after the chosen post is handed to the provider the connection is closed under
//!   the endpoint: the peer sees a disconnect, the endpoint reports
//!   `EndpointState::Error`, its outstanding operations complete `Flushed`, posts fail.
//!
//! Every injected fault is counted ([`HookDomain::stats`]) and logged (WARN for drops and
//! cuts, INFO for refused posts, DEBUG for delays), whether or not `trace` is on.
//!
//! # How completions are attributed
//! Signaled operations are posted to the provider under a token of the wrapper's own in
//! place of the caller's context; the completion queue maps the token back, which tells it
//! the endpoint (for spans, `drop` and `Flushed` rewriting). Unsignaled sends keep the
//! caller's context (they complete only on error, and are then reported as the provider
//! reports them, attributed to no endpoint).
//!
//! # Costs
//! With a `delay` fault a hooked queue takes completions from the provider's queue into its
//! own (at most the queue's capacity) to hold them back, so up to twice the capacity can be
//! outstanding. Posts on a hooked endpoint take one extra lock and a map insertion.
#![forbid(unsafe_code)]

mod config;
mod cq;
mod domain;
mod endpoint;
mod fault;

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::AtomicU64;

pub use config::{
    error_kind, Cut, Delay, DropCompletion, FailPost, FaultConfig, HookConfig, Trigger,
    ERROR_KINDS, HOOK_NAMES,
};
pub use cq::HookCq;
pub use domain::{HookConnecting, HookDomain, HookListener};
pub use endpoint::HookEndpoint;
pub use fault::FaultStats;

/// The tracing target of every event of this crate.
pub const TARGET: &str = "fabric_hook";

/// What every wrapper of one domain shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) trace: bool,
    pub(crate) fault: Option<FaultConfig>,
    /// The seed in use (the configured one, or one picked at random).
    pub(crate) seed: u64,
    pub(crate) stats: fault::Counters,
    pub(crate) next_ep: AtomicU64,
    pub(crate) next_cq: AtomicU64,
    pub(crate) provider: String,
}

/// A random 64-bit value (std's per-process hash keys), for seeds and token bases.
pub(crate) fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}
