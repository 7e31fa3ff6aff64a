//! MPA request / reply headers and private data: decoders never panic, refuse exactly the
//! malformed inputs, and round-trip with the encoders (`fabric_fuzz::mpa`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fabric_fuzz::mpa::check(data));
