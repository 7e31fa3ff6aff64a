//! The connection items of the provider interface on a real device (the soft-RDMA guest:
//! `scripts/soft-rdma`). Ignored by a plain `cargo test`; `scripts/test` runs it in the
//! guest with `--ignored`, and without a device it fails. The sequence is the verbs core's
//! (`providers/verbs/testsuite/conn_items.rs`), shared by roce and iwarp.

#[path = "../../verbs/testsuite/conn_items.rs"]
mod conn_items;

#[test]
#[ignore = "needs the iwarp device of the soft-RDMA guest: scripts/test runs it there (--ignored)"]
fn connection_items_on_a_device() {
    let (d, ip) = conn_items::open::<fabric_iwarp::Iwarp>("FABRIC_SOFT_RDMA_SIW_ADDR");
    conn_items::conn_items(d, ip);
}

/// libsiw takes a queue mapped at its "no mapping" sentinel for a failure
/// (`Profile::mmap_sentinel_guard`): on a bare context the CQ at the sentinel's page fails,
/// and behind the domain's guard CQ none does.
#[test]
#[ignore = "needs the iwarp device of the soft-RDMA guest: scripts/test runs it there (--ignored)"]
fn siw_mmap_sentinel_is_guarded() {
    let (d, _) = conn_items::open::<fabric_iwarp::Iwarp>("FABRIC_SOFT_RDMA_SIW_ADDR");
    assert!(
        d.profile().mmap_sentinel_guard,
        "the guard is for siw, the guest's iwarp device"
    );
    let c = fabric_verbs::fault::mmap_sentinel(&d.device().name).expect("private contexts");
    eprintln!("{c:?}");
    assert_eq!(
        c.bare,
        Some(c.sentinel_index),
        "libsiw no longer refuses the sentinel offset: the guard can go"
    );
    assert_eq!(c.guarded, None, "a CQ failed behind the guard");
}
