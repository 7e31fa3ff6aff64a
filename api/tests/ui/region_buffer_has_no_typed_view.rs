// A registered region's buffer can be reached by peers: no typed exclusive view of it.
use fabric_api::MemoryRegion;

fn poke(mr: &MemoryRegion) {
    let view: &mut [f32] = mr.buffer().as_mut_slice_of::<f32>().unwrap();
    view[0] = 1.0;
}

fn main() {}
