// A buffer shared with a region or an operation (an Arc) gives no typed view, not even a
// shared one: a peer may change the bytes under a `&[T]` at any moment.
use std::sync::Arc;
use fabric_api::Buffer;

fn main() {
    let shared = Arc::new(Buffer::from_vec(vec![0u32; 16]));
    let also = shared.clone();
    let view: &[u32] = shared.as_slice_of::<u32>().unwrap();
    println!("{}", view[0]);
    drop(also);
}
