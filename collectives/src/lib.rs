//! Collectives over `fabric-rdm` tagged messages: barrier, broadcast, allgather,
//! reduce-scatter and allreduce, on any provider.
//!
//! * Allreduce: recursive doubling up to [`CommConfig::small_max`] bytes (a group that is
//!   not a power of two first folds its extra ranks into their neighbours), else a ring
//!   (reduce-scatter, then allgather).
//! * Allgather: recursive doubling for small payloads on power-of-two groups, else a ring.
//! * Reduce-scatter: a ring. Broadcast: a binomial tree up to
//!   [`CommConfig::bcast_small_max`], else a chain pipelined in chunks. Barrier:
//!   dissemination.
//! * Types `u8, i32, u32, i64, u64, f32, f64`; operators sum (wrapping for integers), min,
//!   max.
//!
//! **Bit-identical results.** Every element's reduction is computed in one fixed order and
//! then copied: in the ring each block is reduced once along the ring and then gathered;
//! in recursive doubling both ranks of a pair compute `lower op higher` on the same bits.
//! So every rank holds exactly the same bits, floating point included (the order depends
//! on the algorithm, hence on the size, never on the rank).
//!
//! Ranks find each other through [`bootstrap`]: rank and size from the launcher's
//! environment (Open MPI, PMIx, Slurm, or `FABRIC_RANK`/`FABRIC_SIZE`) and a small TCP
//! rendezvous that exchanges endpoint names.
//!
//! ```no_run
//! use std::sync::Arc;
//! use fabric_collectives::{bootstrap, Comm, CommConfig, ReduceOp};
//! use fabric_rdm::{RdmConfig, RdmEndpoint};
//! # fn main() -> fabric::Result<()> {
//! let (rank, size) = bootstrap::rank_size_from_env()?.expect("started by a launcher");
//! let (domain, _) = fabric::Selector::from_env()?.open()?;
//! let domain = Arc::new(domain);
//! let ep = RdmEndpoint::new(domain.clone(), RdmConfig::default())?;
//! let names = bootstrap::exchange_or_serve(
//!     bootstrap::rdv_addr_from_env()?, rank, size, &ep.name(), rank == 0,
//!     std::time::Duration::from_secs(30))?;
//! let mut comm = Comm::new(domain, ep, rank, &names, CommConfig::default())?;
//! let mut v = vec![rank as f32; 1024];
//! comm.allreduce(&mut v, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod bootstrap;
mod comm;
pub mod reduce;

pub use comm::{Comm, CommConfig};
pub use reduce::{DataType, Element, ReduceOp};
