// A view taken before registration cannot be used once the buffer is handed over.
use std::sync::Arc;
use fabric_api::Buffer;

fn main() {
    let mut b = Buffer::new(64);
    let view = b.as_mut_slice();
    let for_registration = Arc::new(b);
    view[0] = 1;
    drop(for_registration);
}
