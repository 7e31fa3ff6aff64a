//! DDP headers and RDMAP payloads (Read Request, Atomic Request / Response, Terminate and
//! the copy of a refused header): decoders never panic, refuse exactly the malformed
//! inputs, and round-trip with the encoders (`fabric_fuzz::ddp`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fabric_fuzz::ddp::check(data));
