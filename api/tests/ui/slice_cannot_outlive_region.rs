// A work request's slice borrows its region: the region cannot be dropped (its key
// revoked, its memory released) while a slice naming it is still in use.
use fabric_api::{MemoryRegion, Slice};

fn keep(_: &Slice<'_>) {}

fn make(mr: MemoryRegion) {
    let s = mr.slice(0..8).unwrap();
    drop(mr);
    keep(&s);
}

fn main() {}
