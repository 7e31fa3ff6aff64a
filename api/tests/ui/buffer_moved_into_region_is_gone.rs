// A buffer registered without an Arc copy of the caller's own cannot be written through
// the old name: once shared, every access goes through the region (copies).
use std::sync::Arc;
use fabric_api::Buffer;

fn register(_: Arc<Buffer>) {}

fn main() {
    let mut b = Buffer::new(64);
    register(Arc::new(b));
    b.as_mut_slice()[0] = 1;
}
