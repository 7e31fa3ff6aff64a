//! The connection items of the provider interface on a real device (the soft-RDMA guest:
//! `scripts/soft-rdma`). Ignored by a plain `cargo test`; `scripts/test` runs it in the
//! guest with `--ignored`, and without a device it fails. The sequence is the verbs core's
//! (`providers/verbs/testsuite/conn_items.rs`), shared by roce and iwarp.

#[path = "../../verbs/testsuite/conn_items.rs"]
mod conn_items;

#[test]
#[ignore = "needs the roce device of the soft-RDMA guest: scripts/test runs it there (--ignored)"]
fn connection_items_on_a_device() {
    let (d, ip) = conn_items::open::<fabric_roce::Roce>("FABRIC_SOFT_RDMA_RXE_ADDR");
    conn_items::conn_items(d, ip);
}
