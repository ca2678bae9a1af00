//! Group multicast between members in separate processes, through `multirail mcast-bench
//! --local` (this test's process runs the command; the command runs member 0 and starts the
//! others as child processes). Every member checks every message it delivers: the length and
//! bytes that sender's next message must have (so a lost, duplicated, reordered or torn
//! message is an error), and that it delivered exactly as many as each sender says it sent.

use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

mod common;

/// One run at a time: each starts 3 or 4 processes, and the failure tests time detection,
/// which a machine busy with a million-message run beside them would stretch.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `multirail mcast-bench --local --json ARGS` with configuration `conf` (inline JSON);
/// returns the exit code and the report.
fn mcast(args: &[&str], conf: Option<&str>) -> (i32, Value) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut cmd = Command::new(common::multirail_bin());
    cmd.args(["mcast-bench", "--local", "--json"]).args(args);
    match conf {
        Some(c) => cmd.env("MULTIRAIL_CONF", c),
        None => cmd.env_remove("MULTIRAIL_CONF"),
    };
    let out = cmd.output().expect("run multirail mcast-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!("no JSON report ({e}); stdout: {stdout}\nstderr: {stderr}");
    });
    (out.status.code().unwrap_or(-1), v)
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{v} is not a count"))
}

/// A million messages of 8 to 10240 bytes from every member, each delivered exactly once at
/// every member in its sender's order.
fn a_million_messages(members: usize, transport: &str) {
    let n = members.to_string();
    let (code, v) = mcast(
        &[
            "--members",
            &n,
            "--senders",
            &n,
            "--size",
            "8-10240",
            "--messages",
            "1000000",
            "--window",
            "64",
            "--transport",
            transport,
        ],
        None,
    );
    assert_eq!(v["problems"], serde_json::json!([]), "{v}");
    assert_eq!(code, 0, "{v}");
    let per = v["per_member"].as_array().unwrap();
    assert_eq!(per.len(), members);
    let sent: u64 = per.iter().map(|m| u(&m["sent"])).sum();
    assert_eq!(sent, 1_000_000);
    for m in per {
        assert_eq!(u(&m["delivered"]), 1_000_000, "member {m}");
        assert!(m["failure"].is_null(), "{m}");
    }
}

#[test]
fn a_million_messages_three_members_shm() {
    a_million_messages(3, "shm");
}

#[test]
fn a_million_messages_three_members_tcp() {
    a_million_messages(3, "tcp");
}

#[test]
fn a_million_messages_four_members_shm() {
    a_million_messages(4, "shm");
}

#[test]
fn a_million_messages_four_members_tcp() {
    a_million_messages(4, "tcp");
}

/// Three senders, one idle for the whole run (it sends its end marker only when the run
/// ends): every member delivers the same sequence, and the others' messages are delivered
/// during the run, not held until the idle sender speaks.
fn ordered_with_an_idle_sender(transport: &str) {
    let (code, v) = mcast(
        &[
            "--members",
            "3",
            "--senders",
            "3",
            "--idle-senders",
            "1",
            "--delivery",
            "ordered",
            "--size",
            "8-1024",
            "--duration",
            "3",
            "--warmup",
            "0",
            "--transport",
            transport,
        ],
        None,
    );
    assert_eq!(v["problems"], serde_json::json!([]), "{v}");
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["order_identical"], true, "{v}");
    let per = v["per_member"].as_array().unwrap();
    let hashes: Vec<&Value> = per.iter().map(|m| &m["order_hash"]).collect();
    assert!(hashes.windows(2).all(|w| w[0] == w[1]), "{hashes:?}");
    let delivered: Vec<u64> = per.iter().map(|m| u(&m["delivered"])).collect();
    assert!(delivered[0] > 1000, "{delivered:?}");
    assert!(
        delivered.iter().all(|&d| d == delivered[0]),
        "{delivered:?}"
    );
    // The idle member (the last sender) kept the round robin going with null messages.
    assert!(u(&per[2]["stats"]["null_records"]) > 0, "{}", per[2]);
    assert_eq!(u(&per[2]["sent"]), 0);
    // A round robin stalled on the idle sender would hold the first messages until its end
    // marker, 3 s after them; delivered while it idles, none waits near that long.
    let max_us = v["latency_us"]["max"].as_f64().unwrap();
    assert!(
        max_us < 2_000_000.0,
        "a message waited {max_us} µs: the order stalled on the idle sender"
    );
}

#[test]
fn ordered_delivery_with_an_idle_sender_is_identical_everywhere_shm() {
    ordered_with_an_idle_sender("shm");
}

#[test]
fn ordered_delivery_with_an_idle_sender_is_identical_everywhere_tcp() {
    ordered_with_an_idle_sender("tcp");
}

/// Eight members all sending, ordered, as fast as their windows allow: the total order holds
/// many messages while it waits for the slowest sender's next message or nulls, and must keep
/// reading that sender meanwhile (it once stopped reading everyone past 4096 held messages,
/// and every window filled: the group hung until the timeout failed it).
#[test]
fn ordered_delivery_with_eight_busy_senders_does_not_hang_shm() {
    let (code, v) = mcast(
        &[
            "--members",
            "8",
            "--senders",
            "8",
            "--delivery",
            "ordered",
            "--size",
            "8-10240",
            "--messages",
            "600000",
        ],
        None,
    );
    assert_eq!(v["problems"], serde_json::json!([]), "{v}");
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["order_identical"], true, "{v}");
    for m in v["per_member"].as_array().unwrap() {
        assert_eq!(u(&m["delivered"]), 600_000, "{m}");
    }
}

/// Member 2 is killed (or frozen) 1 s into the run: every other member's group fails with an
/// error naming it, within the timeout (plus one heartbeat interval when the member that sees
/// it was waiting on a write to it).
fn a_dead_member_is_named(transport: &str, signal: &str) {
    let (code, v) = mcast(
        &[
            "--members",
            "3",
            "--senders",
            "2",
            "--duration",
            "6",
            "--kill-member",
            "2",
            "--kill-after",
            "1",
            "--kill-signal",
            signal,
            "--transport",
            transport,
        ],
        Some(r#"{"transports":{"tcp":{"timeout_ms":1000}}}"#),
    );
    assert_eq!(v["problems"], serde_json::json!([]), "{v}");
    assert_eq!(code, 0, "{v}");
    let killed = v["killed"]["name"].as_str().unwrap();
    let detections = v["detections"].as_array().unwrap();
    assert_eq!(detections.len(), 2, "{v}");
    for d in detections {
        let error = d["error"].as_str().unwrap_or("");
        assert!(error.contains(killed), "{d} does not name {killed}");
        let after = d["seconds_after_kill"].as_f64().unwrap();
        assert!(
            after < 1.5,
            "member {} took {after} s to see it",
            d["member"]
        );
    }
}

#[test]
fn a_killed_member_is_named_at_the_others_shm() {
    a_dead_member_is_named("shm", "kill");
}

#[test]
fn a_killed_member_is_named_at_the_others_tcp() {
    a_dead_member_is_named("tcp", "kill");
}

#[test]
fn a_frozen_member_is_named_at_the_others_within_the_timeout_shm() {
    a_dead_member_is_named("shm", "stop");
}

#[test]
fn a_frozen_member_is_named_at_the_others_within_the_timeout_tcp() {
    a_dead_member_is_named("tcp", "stop");
}

#[test]
fn batching_off_costs_the_seeds_ten_writes_per_multicast_between_processes() {
    let (code, v) = mcast(
        &[
            "--members",
            "3",
            "--senders",
            "1",
            "--batching",
            "off",
            "--messages",
            "2000",
        ],
        None,
    );
    assert_eq!(code, 0, "{v}");
    let w = &v["writes_per_multicast"];
    assert_eq!(w["data"].as_f64(), Some(2.0), "{v}");
    assert_eq!(w["counters"].as_f64(), Some(2.0), "{v}");
    assert_eq!(w["acks"].as_f64(), Some(6.0), "{v}");
    assert_eq!(w["total"].as_f64(), Some(10.0), "{v}");
}

#[test]
fn bad_arguments_exit_2_naming_what_is_wrong() {
    let cases: &[(&[&str], &str)] = &[
        (&["--size", "4"], "--size"),
        (&["--members", "1"], "--members"),
        (&["--members", "3", "--senders", "4"], "--senders"),
        (&["--senders", "2", "--idle-senders", "2"], "--idle-senders"),
        (&["--batching", "k:25"], "window_size"),
        (&["--batching", "nagle"], "batching"),
        (&["--batching", "k:4", "--flush-us", "0"], "flush_us"),
        (&["--window", "0"], "window_size"),
        (&["--rate", "0"], "--rate"),
        (
            &["--kill-member", "0", "--kill-after", "1"],
            "--kill-member",
        ),
        (&["--size", "20MiB"], "max_payload"),
    ];
    for (args, named) in cases {
        let out = Command::new(common::multirail_bin())
            .args(["mcast-bench", "--local"])
            .args(*args)
            .env_remove("MULTIRAIL_CONF")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(named),
            "{args:?} should name {named}: {stderr}"
        );
    }
}
