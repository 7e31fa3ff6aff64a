//! The connection items of the provider interface on a real device (the soft-RDMA guest:
//! `scripts/soft-rdma`); skipped, saying so, where there is none. The sequence is the
//! verbs core's (`providers/verbs/testsuite/conn_items.rs`), shared by roce and iwarp.

#[path = "../../verbs/testsuite/conn_items.rs"]
mod conn_items;

#[test]
fn connection_items_on_a_device() {
    if let Some((d, ip)) = conn_items::open::<fabric_iwarp::Iwarp>("FABRIC_SOFT_RDMA_SIW_ADDR") {
        conn_items::conn_items(d, ip);
    }
}
