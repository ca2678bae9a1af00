//! `multirail lanes-bench --local`: short runs over shm (and tcp, dynamic) whose JSON parses,
//! with messages from every hot peer and receive buffers at the receiver; every peer dedicated
//! in `dedicated` mode and none in `shared`; bad arguments refused with exit code 2. No speed
//! and no timing of dynamic promotions is asserted.

mod common;

use common::multirail;

const PEERS: u64 = 6;
const HOT: u64 = 2;

fn lanes_bench(mode: &str, transport: &str, pattern: &str) -> serde_json::Value {
    let out = multirail(&[
        "lanes-bench",
        "--local",
        "--peers",
        "6",
        "--hot",
        "2",
        "--max-dedicated",
        "3",
        "--pattern",
        pattern,
        "--mode",
        mode,
        "--transport",
        transport,
        "--duration",
        "3",
        "--warmup",
        "1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "lanes-bench {mode} {transport} {pattern} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "JSON on stdout ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    assert_eq!(v["mode"], mode);
    assert_eq!(v["transport"], transport);
    assert_eq!(v["pattern"], pattern);
    assert_eq!(v["peers"], PEERS);
    assert_eq!(v["max_dedicated"], 3);
    assert_eq!(v["duration_s"], 3.0);
    let hot = if pattern == "alltoall" { PEERS } else { HOT };
    assert_eq!(v["hot"], hot);
    let rates = v["hot_rates_msgs_per_s"]
        .as_array()
        .expect("per-peer rates");
    assert_eq!(rates.len() as u64, hot);
    for (i, r) in rates.iter().enumerate() {
        assert!(
            r.as_f64().unwrap() > 0.0,
            "no messages from hot peer {i} after warm-up: {v}"
        );
    }
    assert!(v["hot_rate_msgs_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["hot_latency_samples"].as_u64().unwrap() > 0);
    let (p50, p99) = (
        v["hot_p50_us"].as_f64().unwrap(),
        v["hot_p99_us"].as_f64().unwrap(),
    );
    assert!(p50 > 0.0 && p50 <= p99, "{v}");
    if pattern == "mbw_mr" {
        // Four cold peers, one message each per 100 ms.
        assert!(v["cold_rate_msgs_per_s"].as_f64().unwrap() > 0.0, "{v}");
    }
    assert!(v["receive_bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(v["switches_after_warmup"].is_u64());
    assert!(v["cold_dedicated_after_1s"].is_boolean());
    assert!(v["all_hot_dedicated_after_s"].is_null() || v["all_hot_dedicated_after_s"].is_f64());
    assert_eq!(
        v["dedicated_unknown"].as_array().map(Vec::len),
        Some(0),
        "{v}"
    );
    v
}

fn dedicated(v: &serde_json::Value) -> Vec<u64> {
    v["dedicated_peers"]
        .as_array()
        .expect("dedicated_peers")
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn dedicated_mode_dedicates_every_peer_shm() {
    let v = lanes_bench("dedicated", "shm", "mbw_mr");
    assert_eq!(dedicated(&v), (0..PEERS).collect::<Vec<_>>(), "{v}");
    assert_eq!(v["dedicated_hot"], HOT);
    assert!(v["note"].as_str().unwrap().contains("all peers dedicated"));
}

#[test]
fn shared_mode_dedicates_no_peer_shm() {
    let v = lanes_bench("shared", "shm", "mbw_mr");
    assert!(dedicated(&v).is_empty(), "{v}");
    assert_eq!(v["dedicated_hot"], 0);
    assert_eq!(v["cold_dedicated_after_1s"], false);
    assert_eq!(v["switches_after_warmup"], 0);
    assert!(v["note"].is_null());
}

// Under dynamic lanes, which peers get promoted, and when, depends on timing: only that the
// run works (every send arrives) and reports consistently.

#[test]
fn dynamic_mode_runs_shm_mbw_mr() {
    let v = lanes_bench("dynamic", "shm", "mbw_mr");
    assert!(dedicated(&v).iter().all(|&i| i < PEERS), "{v}");
    assert_eq!(v["send_failures"], 0, "{v}");
}

#[test]
fn dynamic_mode_runs_tcp_alltoall() {
    let v = lanes_bench("dynamic", "tcp", "alltoall");
    assert!(dedicated(&v).iter().all(|&i| i < PEERS), "{v}");
    assert_eq!(v["send_failures"], 0, "{v}");
}

#[test]
fn bad_arguments_exit_2_naming_the_flag() {
    let out = multirail(&["lanes-bench", "--local", "--peers", "2", "--hot", "3"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--hot"), "{err}");

    let out = multirail(&["lanes-bench", "--local", "--duration", "2", "--warmup", "2"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--duration"), "{err}");

    let out = multirail(&["lanes-bench", "--local", "--peers", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--peers"));

    let out = multirail(&["lanes-bench", "--local", "--mode", "sometimes"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--mode"));
}
