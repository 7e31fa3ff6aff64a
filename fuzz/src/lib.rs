//! Fuzzing support for the tcp provider: the checks behind the cargo-fuzz targets in
//! `fuzz_targets/`, the connection harness, and the seed-corpus generator.
//!
//! * [`mpa`]: MPA request / reply headers and private data (`fabric_tcp::wire::mpa`);
//! * [`ddp`]: DDP headers and the RDMAP payloads (`fabric_tcp::wire::ddp`);
//! * [`connection`]: bytes from a hostile peer into a listening tcp-provider endpoint after
//!   (or including) a valid MPA handshake, with canaries around registered memory;
//! * [`seeds`]: the committed seed corpus, produced by the wire encoders.
//!
//! Every check panics on a violated property; under libFuzzer a panic aborts the process
//! and the input is saved as a crash artifact.

pub mod connection;
pub mod ddp;
pub mod mpa;
pub mod seeds;
pub mod stream;

/// Reads a big-endian `u16` at `at` (the caller checked the length).
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Reads a big-endian `u32` at `at` (the caller checked the length).
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Reads a big-endian `u64` at `at` (the caller checked the length).
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}
