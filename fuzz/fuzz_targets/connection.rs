//! A hostile peer's bytes into a listening tcp-provider endpoint: no crash, no hang, no
//! leak, and no byte changed outside what the peer's messages may change
//! (`fabric_fuzz::connection`).
#![no_main]

use std::sync::{Mutex, OnceLock};

use fabric_fuzz::connection::Harness;
use libfuzzer_sys::fuzz_target;

static HARNESS: OnceLock<Mutex<Harness>> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    HARNESS
        .get_or_init(|| Mutex::new(Harness::new()))
        .lock()
        .expect("harness")
        .run(data)
});
