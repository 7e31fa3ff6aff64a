//! Declares the `loom` cfg (the model-checking build of the completion queue's sleep /
//! wake protocol and of connection progress, see `src/loom_models.rs`) so that
//! `unexpected_cfgs` stays quiet while the crate inherits the workspace's lint table.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
}
