//! Collectives over `fabric-rdm` tagged messages: barrier, broadcast, allgather,
//! reduce-scatter and allreduce, on any provider.
//!
//! * Allreduce: up to [`CommConfig::gather_max`] bytes on a power-of-two group, every
//!   rank's data gathered by recursive doubling and folded in rank order; up to
//!   [`CommConfig::small_max`] bytes recursive doubling (a group that is not a power of two
//!   first folds its extra ranks into their neighbours); else, when the provider has RDMA
//!   Write, recursive halving and doubling up to [`CommConfig::halving_max`] bytes on a
//!   power-of-two group and a ring (reduce-scatter, then allgather) above it or on other
//!   groups, both RDMA-written segment by segment; without RDMA Write a ring of tagged
//!   messages.
//! * Allreduce on memory the caller registered ([`Comm::allreduce_region`],
//!   [`Comm::allreduce_region_bytes`]): the large paths send from, reduce into and gather
//!   into the caller's region itself, with no copy in or out (the small paths copy); the
//!   same bits as [`Comm::allreduce`] on the same values.
//! * Allgather: recursive doubling for small payloads on power-of-two groups, else a ring.
//! * Reduce-scatter: a ring. Broadcast: a binomial tree up to
//!   [`CommConfig::bcast_small_max`], else a chain pipelined in chunks. Barrier:
//!   dissemination.
//! * Types `u8, i32, u32, i64, u64, f32, f64`; operators sum (wrapping for integers), min,
//!   max.
//!
//! **Bit-identical results.** Every element's reduction is computed in one fixed order and
//! then copied: in the ring each block is reduced once along the ring and then gathered;
//! in halving and doubling each block is reduced on its own rank in a fixed pairwise tree
//! and then gathered;
//! in recursive doubling both ranks of a pair compute `lower op higher` on the same bits;
//! a gathered small payload is folded in rank order everywhere.
//! So every rank holds exactly the same bits, floating point included (the order depends
//! on the algorithm, hence on the size, never on the rank).
//!
//! Ranks find each other through [`bootstrap`]: rank and size from the launcher's
//! environment (Open MPI, PMIx, Slurm, or `FABRIC_RANK`/`FABRIC_SIZE`) and a small TCP
//! rendezvous that exchanges endpoint names.
//!
//! # Example: three ranks
//! `run_rank` is what every rank of a job runs: it opens its domain and RDM endpoint,
//! exchanges endpoint names with the other ranks, builds its [`Comm`] from all the names
//! in rank order, sums a `Vec<f32>` with [`Comm::allreduce`], checks the result and meets
//! the others at a [`Comm::barrier`]. A real job (`job_main`, compiled here but not run)
//! starts one process per rank and gets the rank, the size and the names from
//! [`bootstrap`]. The doctest runs three ranks as threads of one process instead, each
//! with its own domain (the tcp provider over loopback) and its own endpoint, as three
//! processes would have; they publish their names in a vector they share, which stands in
//! for [`bootstrap::exchange_or_serve`].
//!
//! ```
//! use std::sync::{Arc, Barrier, Mutex};
//! use std::time::Duration;
//! use fabric_collectives::{bootstrap, Comm, CommConfig, ReduceOp};
//! use fabric_rdm::{RdmConfig, RdmEndpoint};
//!
//! const LEN: usize = 1000;
//!
//! /// One rank: `exchange` takes this rank's endpoint name and returns every rank's.
//! fn run_rank(
//!     selector: fabric::Selector,
//!     rank: usize,
//!     size: usize,
//!     exchange: impl FnOnce(&[u8]) -> fabric::Result<Vec<Vec<u8>>>,
//! ) -> fabric::Result<Vec<f32>> {
//!     let (domain, _) = selector.open()?;
//!     let domain = Arc::new(domain);
//!     let ep = RdmEndpoint::new(domain.clone(), RdmConfig::default())?;
//!     let names = exchange(&ep.name())?;
//!     let mut comm = Comm::new(domain, ep, rank, &names, CommConfig::default())?;
//!     assert_eq!((comm.rank(), comm.size()), (rank, size));
//!
//!     let mut v: Vec<f32> = (0..LEN).map(|i| ((rank + 1) * i) as f32).collect();
//!     comm.allreduce(&mut v, ReduceOp::Sum)?;
//!     let ranks_sum = size * (size + 1) / 2; // 1 + 2 + ... + size
//!     for (i, x) in v.iter().enumerate() {
//!         assert_eq!(*x, (ranks_sum * i) as f32, "rank {rank}, element {i}");
//!     }
//!     comm.barrier()?;
//!     Ok(v)
//! }
//!
//! /// A real job: one process per rank, started by a launcher.
//! fn job_main() -> fabric::Result<()> {
//!     let (rank, size) = bootstrap::rank_size_from_env()?.expect("started by a launcher");
//!     let rdv = bootstrap::rdv_addr_from_env()?;
//!     let timeout = Duration::from_secs(30);
//!     run_rank(fabric::Selector::from_env()?, rank, size, |name| {
//!         bootstrap::exchange_or_serve(rdv, rank, size, name, rank == 0, timeout)
//!     })?;
//!     Ok(())
//! }
//!
//! # fn main() -> fabric::Result<()> {
//! const SIZE: usize = 3;
//! let names = Arc::new(Mutex::new(vec![Vec::new(); SIZE]));
//! let all_named = Arc::new(Barrier::new(SIZE));
//! let ranks: Vec<_> = (0..SIZE)
//!     .map(|rank| {
//!         let (names, all_named) = (names.clone(), all_named.clone());
//!         std::thread::spawn(move || {
//!             let tcp = fabric::Selector::new().providers("tcp")?;
//!             run_rank(tcp, rank, SIZE, |name| {
//!                 names.lock().unwrap()[rank] = name.to_vec();
//!                 all_named.wait(); // every rank has published its name
//!                 Ok(names.lock().unwrap().clone())
//!             })
//!         })
//!     })
//!     .collect();
//! let results = ranks
//!     .into_iter()
//!     .map(|t| t.join().expect("rank thread"))
//!     .collect::<fabric::Result<Vec<_>>>()?;
//! assert!(results.iter().all(|v| v == &results[0])); // the same on every rank
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod bootstrap;
mod comm;
pub mod reduce;

pub use comm::{Comm, CommConfig};
pub use reduce::{DataType, Element, ReduceOp};
