//! The `multirail` command as a user runs it.

mod common;

use std::process::Command;

fn multirail(args: &[&str], conf: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_multirail"));
    cmd.args(args);
    match conf {
        Some(c) => cmd.env("MULTIRAIL_CONF", c),
        None => cmd.env_remove("MULTIRAIL_CONF"),
    };
    cmd.output().expect("run multirail")
}

#[test]
fn config_show_prints_the_effective_configuration() {
    let out = multirail(
        &["config", "show"],
        Some(r#"{"transports":{"rdma":{"bandwidth_learning_rate":0.5}}}"#),
    );
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["transports"]["rdma"]["bandwidth_learning_rate"], 0.5);
    assert_eq!(v["workers"]["block_size"], 65536);
    assert_eq!(v["transports"]["tcp"]["timeout_ms"], 5000);
}

#[test]
fn malformed_config_exits_2_naming_the_key() {
    let out = multirail(
        &["config", "show"],
        Some(r#"{"transports":{"rdma":{"numa_penalties":[1.0,-5.0]}}}"#),
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("transports.rdma.numa_penalties[1]"), "{err}");
    let dir = std::env::temp_dir().join(format!("multirail-cli-{}.json", std::process::id()));
    std::fs::write(&dir, r#"{"workers": {"block_size": "big"}}"#).unwrap();
    let out = multirail(&["--config", dir.to_str().unwrap(), "config", "show"], None);
    std::fs::remove_file(&dir).ok();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("workers.block_size"));
}

#[test]
fn bad_flags_exit_2() {
    let out = multirail(&["bench", "--local", "--block-size", "lots"], None);
    assert_eq!(out.status.code(), Some(2));
    let out = multirail(
        &[
            "bench",
            "--local",
            "--size",
            "1MiB",
            "--block-size",
            "1MiB",
            "--batch-size",
            "4",
        ],
        None,
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bench_local_runs_verifies_and_reports_json() {
    for (transport, op) in [("shm", "write"), ("tcp", "read"), ("tcp", "write")] {
        let out = multirail(
            &[
                "bench",
                "--local",
                "--transport",
                transport,
                "--op",
                op,
                "--block-size",
                "256KiB",
                "--size",
                "64MiB",
                "--duration",
                "500ms",
                "--verify",
                "--json",
            ],
            None,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["op"], op);
        assert!(v["bytes"].as_u64().unwrap() > 0);
        assert!(v["verified_bytes"].as_u64().unwrap() > 0);
        let rail_bytes: u64 = v["rails"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["bytes"].as_u64().unwrap())
            .sum();
        assert!(rail_bytes >= v["bytes"].as_u64().unwrap());
    }
}

#[test]
fn unreachable_target_exits_1() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = multirail(
        &[
            "bench",
            "--target",
            &format!("127.0.0.1:{port}"),
            "--size",
            "1MiB",
            "--block-size",
            "64KiB",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unreachable"));
}
