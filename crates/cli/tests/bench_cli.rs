//! `multirail bench` as a user runs it: verification that holds for any thread count and after
//! earlier benches, usage errors for numbers out of range, and a target smaller than 1 GiB.

mod common;

use std::process::Output;

use common::{multirail, TargetProcess};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a bench that must succeed and returns its JSON report.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = multirail(&all);
    assert!(
        out.status.success(),
        "bench {args:?} exited {:?}: {}",
        out.status.code(),
        stderr(&out)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn verify_passes_when_the_threads_do_not_divide_the_size() {
    // 40 MiB / 3 threads = 13981013.33 bytes: thread 1's share starts mid-word.
    for (transport, op) in [("shm", "write"), ("tcp", "read"), ("tcp", "write")] {
        let v = bench_json(&[
            "--local",
            "--transport",
            transport,
            "--op",
            op,
            "--size",
            "40MiB",
            "--threads",
            "3",
            "--block-size",
            "256KiB",
            "--batch-size",
            "4",
            "--duration",
            "300ms",
            "--verify",
        ]);
        assert_eq!(v["threads"], 3);
        assert!(
            v["verified_bytes"].as_u64().unwrap() > 0,
            "{transport} {op}"
        );
    }
}

#[test]
fn more_threads_than_the_size_holds_is_a_usage_error() {
    // 4 MiB over 8 threads is 512 KiB each: not one 1 MiB block.
    let out = multirail(&[
        "bench",
        "--local",
        "--size",
        "4MiB",
        "--threads",
        "8",
        "--block-size",
        "1MiB",
        "--batch-size",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--threads"), "{}", stderr(&out));
}

#[test]
fn read_verify_holds_after_earlier_benches_on_one_target() {
    let target = TargetProcess::start("32MiB", None);
    let common = [
        "--target",
        target.name.as_str(),
        "--size",
        "32MiB",
        "--block-size",
        "256KiB",
        "--batch-size",
        "4",
        "--duration",
        "200ms",
        "--verify",
    ];
    let runs: [&[&str]; 5] = [
        &["--op", "write"],
        &["--op", "read"],
        &["--op", "write", "--threads", "3", "--transport", "tcp"],
        &["--op", "read", "--threads", "2", "--transport", "tcp"],
        &["--op", "read", "--threads", "3"],
    ];
    for run in runs {
        let mut args: Vec<&str> = common.to_vec();
        args.extend_from_slice(run);
        let v = bench_json(&args);
        assert!(v["verified_bytes"].as_u64().unwrap() > 0, "{run:?}");
    }
}

/// Asserts that `bench` with `args` (after `--local`) exits 2 at once, naming `flag` on stderr.
fn assert_usage(args: &[&str], flag: &str) {
    let mut all = vec!["bench", "--local", "--duration", "200ms"];
    all.extend_from_slice(args);
    let out = multirail(&all);
    assert_eq!(
        out.status.code(),
        Some(2),
        "bench {args:?}: stderr {}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains(flag),
        "bench {args:?}: stderr does not name {flag}: {}",
        stderr(&out)
    );
}

#[test]
fn numbers_out_of_range_exit_2_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        // Was a divide by zero (exit 101): 1 MiB × 2^44 wraps to 0.
        (&["--batch-size", "17592186044416"], "--batch-size"),
        // Was an allocation of 2^44 requests (exit 134).
        (&["--batch-size", "17592186044417"], "--batch-size"),
        (&["--threads", "1000000000000"], "--threads"),
        (&["--batch-size", "0"], "--batch-size"),
        (&["--threads", "0"], "--threads"),
        (&["--threads", "1025"], "--threads"),
        (&["--block-size", "0"], "--block-size"),
        (&["--size", "0"], "--size"),
        (&["--size", "1000TiB"], "--size"),
        (&["--size", "1MiB", "--block-size", "2MiB"], "--block-size"),
        (&["--total", "0"], "--total"),
        (&["--size", "64MiB", "--total", "1KiB"], "--total"),
        (&["--interval", "0"], "--interval"),
        (&["--interval", "1e300"], "--interval"),
        (&["--interval", "10us"], "--interval"),
        (&["--interval", "0.0000001"], "--interval"),
        (&["--interval", "2s"], "--interval"),
        (&["--duration", "0"], "--duration"),
        (&["--duration", "0.0000001"], "--duration"),
        (&["--mix", "high:64KiB:1000000000000"], "--mix"),
        (&["--mix", "high:64KiB:0"], "--mix"),
        (&["--mix", "high:0:1"], "--mix"),
        (&["--mix", "high:64KiB:600,low:1MiB:600"], "--mix"),
        // The local target would serve more than a target may, or than this host holds.
        (&["--target-offset", "1TiB"], "--target-offset"),
        (
            &["--size", "8GiB", "--target-offset", "1000GiB"],
            "--target-offset",
        ),
    ];
    for (args, flag) in cases {
        assert_usage(args, flag);
    }
}

#[test]
fn size_defaults_to_a_smaller_target() {
    let target = TargetProcess::start("64MiB", None);
    let out = multirail(&[
        "bench",
        "--target",
        &target.name,
        "--block-size",
        "256KiB",
        "--duration",
        "200ms",
        "--verify",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("--size 64 MiB"), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["size"], 64 << 20);
    assert!(v["verified_bytes"].as_u64().unwrap() > 0);

    // Asked for more than the target serves: a usage error that says what it serves.
    let out = multirail(&[
        "bench",
        "--target",
        &target.name,
        "--size",
        "128MiB",
        "--duration",
        "200ms",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--size"), "{}", stderr(&out));
    assert!(stderr(&out).contains("64 MiB"), "{}", stderr(&out));
}

#[test]
fn one_report_by_default_and_tent_text_on_request() {
    let base = [
        "bench",
        "--local",
        "--transport",
        "shm",
        "--size",
        "32MiB",
        "--block-size",
        "256KiB",
        "--duration",
        "200ms",
    ];
    let out = multirail(&base);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("queue"), "the priority table: {text}");
    assert!(!text.contains("Priority Queue Statistics"), "{text}");
    assert!(!text.contains("Device Traffic Statistics"), "{text}");
    assert!(!text.contains("EWMA BW"), "{text}");

    let mut args = base.to_vec();
    args.push("--tent-stats");
    let out = multirail(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(
        text.matches("Device Traffic Statistics").count(),
        1,
        "{text}"
    );
    assert_eq!(
        text.matches("Priority Queue Statistics").count(),
        1,
        "{text}"
    );
    // Over shm no network rail carries a slice, so none has a bandwidth to show.
    for line in text.lines().filter(|l| l.starts_with("Dev ")) {
        assert!(line.contains("EWMA BW=- (no samples)"), "{line}");
    }

    // Over tcp the local target served every byte written, and says so at the end.
    let out = multirail(&[
        "bench",
        "--local",
        "--transport",
        "tcp",
        "--size",
        "8MiB",
        "--block-size",
        "256KiB",
        "--duration",
        "200ms",
        "--tent-stats",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let moved = report["bytes"].as_u64().expect("bytes in the report");
    let text = stderr(&out);
    let target = &text[text.find("=== Target ===").expect("the target's section")..];
    let served: u64 = target
        .lines()
        .filter(|l| l.starts_with("Rail "))
        .filter_map(|l| l.split("WRITE Bytes=").nth(1))
        .filter_map(|rest| rest.split(',').next()?.parse::<u64>().ok())
        .sum();
    assert!(
        served >= moved && moved > 0,
        "served {served}, moved {moved}: {target}"
    );

    let help = stdout(&multirail(&["bench", "--help"]));
    let flag = &help[help.find("--tent-stats").expect("--tent-stats in help")..];
    let flag = &flag[..flag.find("\n  -").unwrap_or(flag.len())];
    // Words, not lines: clap wraps the text to the widest flag's column.
    let words = flag.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(words.contains("Default: off"), "{flag}");
}

#[test]
fn rails_without_samples_report_no_bandwidth() {
    let mut args = vec![
        "--local",
        "--transport",
        "shm",
        "--size",
        "32MiB",
        "--block-size",
        "256KiB",
        "--duration",
        "200ms",
    ];
    let v = bench_json(&args);
    for r in v["rails"].as_array().unwrap() {
        if r["slices"] == 0 {
            assert!(r["ewma_gbps"].is_null(), "{r}");
        }
    }
    // Over tcp the loopback rail carries every slice and has a measured bandwidth.
    args[2] = "tcp";
    let v = bench_json(&args);
    let lo = v["rails"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["slices"].as_u64().unwrap_or(0) > 0 && r["name"] != "shm")
        .expect("a network rail carried the slices");
    assert!(lo["ewma_gbps"].as_f64().unwrap() > 0.0, "{lo}");
}

#[test]
fn a_local_tcp_bench_ends_without_pausing_a_rail() {
    // Ending the run must neither stop the local target under connections still in use nor
    // count our own shutdown against the rail: either made every such run warn "rail paused
    // after repeated errors". With --tent-stats the target stops early on purpose (for its
    // served report), after this engine has shut down.
    for extra in [None, Some("--tent-stats")] {
        let mut args = vec![
            "bench",
            "--local",
            "--transport",
            "tcp",
            "--size",
            "64MiB",
            "--duration",
            "300ms",
        ];
        args.extend(extra);
        let out = multirail(&args);
        let err = stderr(&out);
        assert!(out.status.success(), "{args:?}: {err}");
        assert!(!err.contains("rail paused"), "{args:?}: {err}");
        if extra.is_some() {
            let text = format!("{}{err}", stdout(&out));
            assert!(text.contains("=== Target ==="), "{args:?}: {text}");
        }
    }
}

/// Runs `multirail bench` with `args` as a child process without waiting for it.
fn spawn_bench(args: &[&str]) -> std::process::Child {
    std::process::Command::new(common::multirail_bin())
        .arg("bench")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning bench")
}

#[test]
fn benches_with_their_own_target_offsets_verify_at_the_same_time() {
    let target = TargetProcess::start("64MiB", None);
    for op in ["write", "read"] {
        // Two clients on one target at once, one over tcp and one over shm, each on its own
        // half of the buffer: each checks its own bytes, so neither sees the other's pattern.
        let run = |offset: &str, transport: &str| {
            spawn_bench(&[
                "--target",
                target.name.as_str(),
                "--target-offset",
                offset,
                "--size",
                "32MiB",
                "--block-size",
                "256KiB",
                "--batch-size",
                "4",
                "--duration",
                "500ms",
                "--op",
                op,
                "--transport",
                transport,
                "--verify",
                "--json",
            ])
        };
        let clients = [run("0", "tcp"), run("32MiB", "shm")];
        for c in clients {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "{op}: {}", stderr(&out));
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert!(v["verified_bytes"].as_u64().unwrap() > 0, "{op}");
            // A client of a loopback target listens on loopback only.
            assert!(
                !stderr(&out).contains("listening beyond loopback"),
                "{op}: {}",
                stderr(&out)
            );
        }
    }

    // Without --size the run takes the rest of the buffer from its offset, and says so.
    let out = multirail(&[
        "bench",
        "--target",
        &target.name,
        "--target-offset",
        "48MiB",
        "--block-size",
        "256KiB",
        "--duration",
        "200ms",
        "--verify",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("--size 16 MiB"), "{}", stderr(&out));

    // Offsets that leave no room are usage errors naming what the target serves.
    for (offset, size) in [("64MiB", None), ("48MiB", Some("32MiB"))] {
        let mut args = vec![
            "bench",
            "--target",
            &target.name,
            "--target-offset",
            offset,
            "--duration",
            "200ms",
        ];
        args.extend(size.map(|s| ["--size", s]).into_iter().flatten());
        let out = multirail(&args);
        assert_eq!(out.status.code(), Some(2), "{offset}: {}", stderr(&out));
        assert!(stderr(&out).contains("--target-offset"), "{}", stderr(&out));
        assert!(stderr(&out).contains("64 MiB"), "{}", stderr(&out));
    }
}
