//! `fabric perf` end to end on tcp: every test with every operation, both sides as two
//! processes on loopback, a few iterations each; the JSON rows must say what ran.

use std::process::Command;

/// `fabric perf ARGS` (split at spaces), which must succeed and print JSON.
fn perf_json(args: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_fabric"))
        .arg("perf")
        .args(args.split_whitespace())
        .output()
        .expect("run fabric perf");
    assert!(
        out.status.success(),
        "fabric perf {args} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "fabric perf {args}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn perf(test: &str, op: &str) -> serde_json::Value {
    perf_json(&format!(
        "{test} --op {op} --size 8 --iters 20 --provider tcp --format json"
    ))
}

/// The `bytes` of every row.
fn sizes(v: &serde_json::Value) -> Vec<Option<u64>> {
    v["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| r["bytes"].as_u64())
        .collect()
}

#[test]
fn every_test_and_operation_runs_on_tcp() {
    for op in [
        "send",
        "write",
        "write_imm",
        "read",
        "fetch_add",
        "compare_swap",
    ] {
        for test in ["pingpong", "lat", "bw"] {
            let v = perf(test, op);
            assert_eq!(v["provider"], "tcp", "{test} {op}: {v}");
            let rows = v["rows"].as_array().expect("rows");
            assert_eq!(rows.len(), 1, "{test} {op}: {v}");
            let r = &rows[0];
            assert_eq!(
                (r["test"].as_str(), r["op"].as_str()),
                (Some(test), Some(op))
            );
            assert_eq!(
                (r["bytes"].as_u64(), r["iters"].as_u64()),
                (Some(8), Some(20))
            );
            assert!(
                r["usec_per_xfer"].as_f64().is_some_and(|u| u > 0.0),
                "{test} {op}: {r}"
            );
        }
    }
}

/// A send test whose window exceeds the receives a server's queues hold (1 008 for a
/// bandwidth test) runs with as many as it holds, which its reply tells the client:
/// before, the server failed to post its 1 025th receive ("receive queue of depth 1024
/// is full"). A latency test with a wide window gets the receives it asks for.
#[test]
fn a_send_window_wider_than_the_servers_queues_runs_with_what_they_hold() {
    for args in [
        "bw --op send --window 2048 --size 8 --iters 3000 --provider tcp --format json",
        "lat --op send --window 300 --size 8 --iters 500 --provider tcp --format json",
    ] {
        let v = perf_json(args);
        assert!(
            v["rows"][0]["usec_per_xfer"]
                .as_f64()
                .is_some_and(|u| u > 0.0),
            "{args}: {v}"
        );
    }
}

#[test]
fn the_tagged_pingpong_runs_over_rdm_endpoints_and_refuses_bw() {
    for test in ["pingpong", "lat"] {
        let v = perf(test, "tagged");
        let r = &v["rows"][0];
        assert_eq!(
            (r["test"].as_str(), r["op"].as_str(), r["iters"].as_u64()),
            (Some(test), Some("tagged"), Some(20)),
            "{v}"
        );
        assert!(r["usec_per_xfer"].as_f64().is_some_and(|u| u > 0.0), "{r}");
    }
    // Above the eager size: the rendezvous (an RDMA Read of the sender's memory).
    let v = perf_json("pingpong --op tagged --sizes 8,64K --iters 10 --provider tcp --format json");
    assert_eq!(sizes(&v), [Some(8), Some(65536)]);
    let out = Command::new(env!("CARGO_BIN_EXE_fabric"))
        .args(["perf", "bw", "--op", "tagged", "--provider", "tcp"])
        .output()
        .expect("run fabric perf");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("pingpong and lat"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_polling_server_serves_one_sided_phases_and_the_output_says_which() {
    // Two sizes: between the phases the server waits for the next control message in
    // the client's mode (spinning here), and through each read phase it only waits.
    let run = |extra: &str| {
        let v = perf_json(&format!(
            "lat --op read --sizes 8,64 --iters 20 --spin --provider tcp --format json {extra}"
        ));
        assert_eq!(sizes(&v), [Some(8), Some(64)], "{v}");
        v["server"].as_str().map(str::to_owned)
    };
    assert_eq!(run("--server-polls").as_deref(), Some("polls"));
    assert_eq!(run("").as_deref(), Some("waits"));
    // Meaningless combinations are refused, saying why.
    for (args, says) in [
        ("lat --op read --wait --server-polls", "--wait"),
        ("lat --op tagged --server-polls", "tagged"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_fabric"))
            .arg("perf")
            .args(args.split_whitespace())
            .args(["--provider", "tcp"])
            .output()
            .expect("run fabric perf");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args}: {err}");
        assert!(err.contains(says), "{args}: {err}");
    }
}
