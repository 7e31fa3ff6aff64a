// A registered region's buffer can be reached by peers: no exclusive view of it.
use fabric_api::MemoryRegion;

fn poke(mr: &MemoryRegion) {
    let view: &mut [u8] = mr.buffer().as_mut_slice();
    view[0] = 1;
}

fn main() {}
