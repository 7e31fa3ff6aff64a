// The atomic view of a word borrows its buffer: it cannot outlive the memory.
use std::sync::atomic::AtomicU64;
use fabric_api::Buffer;

fn word() -> &'static AtomicU64 {
    let b = Buffer::new(8);
    b.atomic_u64(0).unwrap()
}

fn main() {
    let _ = word();
}
