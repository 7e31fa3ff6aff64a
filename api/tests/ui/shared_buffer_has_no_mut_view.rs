// A buffer shared with a region or an operation (an Arc) gives no exclusive view.
use std::sync::Arc;
use fabric_api::Buffer;

fn main() {
    let shared = Arc::new(Buffer::new(64));
    let also = shared.clone();
    shared.as_mut_slice()[0] = 1;
    drop(also);
}
