//! `fabric allreduce` end to end on tcp: three ranks as processes, with registered buffers
//! (the default) and with slices, small and write-ring sizes; every result must be exact.

use std::process::Command;

fn allreduce(extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_fabric"))
        .args(["allreduce", "--np", "3", "--provider", "tcp"])
        .args(["--sizes", "8,5000,100K,1M", "--iters", "2", "--warmup", "1"])
        .args([
            "--small-max",
            "4K",
            "--write-segment",
            "64K",
            "--format",
            "json",
        ])
        .args(extra)
        .output()
        .expect("run fabric allreduce");
    assert!(
        out.status.success(),
        "fabric allreduce {extra:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "fabric allreduce {extra:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn registered_and_slice_buffers_give_exact_results() {
    for (buffer, args) in [
        ("registered", &["--type", "f32"][..]),
        ("registered", &["--type", "i64", "--op", "max"][..]),
        (
            "registered",
            &["--buffer", "registered", "--type", "u8"][..],
        ),
        (
            "slice",
            &["--buffer", "slice", "--type", "f64", "--op", "min"][..],
        ),
    ] {
        let v = allreduce(args);
        assert_eq!(v["np"], 3, "{v}");
        assert_eq!(v["buffer"], buffer, "{args:?}: {v}");
        let rows = v["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), 4, "{args:?}: {v}");
        for r in rows {
            assert_eq!(r["wrong"], 0, "{args:?}: {r}");
        }
    }
}
