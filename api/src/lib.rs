//! Provider-neutral API of the fabric framework.
//!
//! This crate holds everything that is the same on every provider: the error vocabulary
//! ([`ErrorKind`], semantics.md section 6), memory regions that own their buffer
//! ([`MemoryRegion`], [`Slice`], [`RemoteDesc`]), work requests and completions, capability
//! descriptions, and the provider traits in [`spi`] that every provider implements.
//!
//! Applications normally use the `fabric` crate, which selects a provider at run time and
//! dispatches to it; provider crates depend on this one only.
//!
//! The only `unsafe` code lives in [`mem`], the audited module that owns registered memory.
#![deny(unsafe_code)]

pub mod caps;
pub mod error;
#[allow(unsafe_code)]
pub mod mem;
pub mod pdata;
pub mod region;
pub mod spi;
pub mod wr;

pub use caps::{Availability, Capabilities, DeviceInfo, Emulation, Limits, OpSet, ProviderInfo};
pub use error::{Error, ErrorKind, ProviderCode, Result};
pub use mem::{send_gather, Buffer, IoPiece};
pub use region::{Access, MemoryRegion, RegionRef, Registration, RemoteDesc, Slice};
pub use wr::{
    AtomicOp, Completion, EndpointState, Opcode, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr,
    Status,
};
