// Not even a shared typed view (`&[T]`) of registered memory: operations in flight and
// providers hold a `RegionRef`, and a peer may write the bytes under the view.
use fabric_api::RegionRef;

fn peek(r: &RegionRef) -> f32 {
    let view: &[f32] = r.buffer().as_slice_of::<f32>().unwrap();
    view[0]
}

fn main() {}
