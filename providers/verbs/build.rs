//! Declares the `loom` cfg (the model-checking build of the lock protocol, see
//! `src/loom_models.rs`) so that `unexpected_cfgs` stays quiet while the crate inherits
//! the workspace's lint table.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
}
