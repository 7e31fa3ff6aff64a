// A typed view taken before registration cannot be used once the buffer is handed over.
use std::sync::Arc;
use fabric_api::Buffer;

fn main() {
    let mut b = Buffer::from_vec(vec![0.0f64; 8]);
    let view = b.as_mut_slice_of::<f64>().unwrap();
    let for_registration = Arc::new(b);
    view[0] = 1.0;
    drop(for_registration);
}
