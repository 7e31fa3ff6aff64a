// A vector taken over by a buffer (no copy) cannot be used through its old name: its
// memory is the buffer's now, to be registered and written by peers.
use fabric_api::Buffer;

fn main() {
    let mut samples = vec![0.0f32; 1024];
    let buffer = Buffer::from_vec(samples);
    samples[0] = 1.0;
    drop(buffer);
}
