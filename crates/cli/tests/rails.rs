//! Multi-rail transfers over real shaped links: `scripts/rails` builds 4 veth rails at 800, 400,
//! 200 and 200 Mbit/s between two network namespaces; a target runs in one, `multirail bench`
//! in the other. Needs root (network namespaces, tc): without it each test prints why it skips.

mod netns;

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netns::Rails;

fn config(smart: bool) -> String {
    // veth reports 10 Gbps while tbf holds the rails to a few hundred Mbit/s: let the EWMA
    // go down to 1% of the reported speed so it can learn the real rates. (The namespaces share
    // one kernel, so same-host shared memory would bypass the rails: the bench forces tcp.)
    format!(
        r#"{{"transports": {{"rdma": {{"enable_smart_scheduling": {smart}, "ewma_min_bandwidth_multiplier": 0.01}},
             "tcp": {{"timeout_ms": 3000}}}}}}"#
    )
}

fn finish(child: Child) -> serde_json::Value {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// The entry of rail `name` in a bench report's `rails`, if it has one.
fn rail_report<'a>(report: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    report["rails"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
}

fn rail_bytes(report: &serde_json::Value, name: &str) -> u64 {
    rail_report(report, name).map_or(0, |r| r["bytes"].as_u64().unwrap())
}

const TOTAL: u64 = 256 << 20;

/// What a bench's throughput report per interval (on stderr) holds: bytes are flowing.
const FLOWING: &str = "\"gb_per_s\"";

/// Drains `bench`'s stderr on a thread of its own, so the bench never blocks on it: each line
/// also goes to the receiver as it comes, and the thread returns the whole log.
fn watch(bench: &mut Child) -> (Receiver<String>, JoinHandle<String>) {
    let stderr = BufReader::new(bench.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let drain = std::thread::spawn(move || {
        let mut log = String::new();
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            log.push_str(&line);
            log.push('\n');
        }
        log
    });
    (rx, drain)
}

/// Starts `bench` writing 256 MiB to the target `name` over the rails (smart mode, every byte
/// verified at the end, throughput per 100 ms on stderr) with the block, batch and length of
/// `run`, and returns once bytes have flowed for a moment: the bench, its stderr's lines as
/// they come, and the thread that returns its whole stderr.
fn flowing_writes(
    rails: &Rails,
    name: &str,
    run: &[&str],
) -> (Child, Receiver<String>, JoinHandle<String>) {
    let mut args = vec!["--target", name, "--op", "write", "--size", "256MiB"];
    args.extend_from_slice(run);
    args.extend_from_slice(&["--verify", "--interval", "100ms"]);
    let mut bench = rails.bench(&config(true), &args);
    let (lines, drain) = watch(&mut bench);
    wait_for(&lines, "the bench moving bytes", |l| l.contains(FLOWING));
    std::thread::sleep(Duration::from_millis(300));
    (bench, lines, drain)
}

/// Waits (30 s at most) for a line of `lines` that `wanted`; fails naming `what` otherwise.
fn wait_for(lines: &Receiver<String>, what: &str, wanted: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if wanted(&line) => return,
            Ok(_) => {}
            Err(_) => panic!("never saw {what} on the bench's stderr"),
        }
    }
}

fn transfer_256_mib(prefix: &str, smart: bool) {
    let Some(rails) = Rails::up_or_skip(prefix) else {
        return;
    };
    let (mut target, name) = rails.target("256MiB");
    let before = rails.counters();
    let args = [
        "--target",
        &name,
        "--op",
        "write",
        "--block-size",
        "4MiB",
        "--batch-size",
        "4",
        "--size",
        "256MiB",
        "--total",
        "256MiB",
        "--verify",
    ];
    let report = finish(rails.bench(&config(smart), &args));
    let after = rails.counters();
    target.kill().ok();
    target.wait().ok();
    assert_eq!(report["bytes"].as_u64().unwrap(), TOTAL);
    assert_eq!(
        report["verified_bytes"].as_u64().unwrap(),
        TOTAL,
        "every byte checked"
    );
    let mut carried = 0;
    for i in 0..4 {
        let iface = format!("{prefix}b{i}");
        let engine = rail_bytes(&report, &iface);
        carried += engine;
        // The interface sent at least the payload the engine put on it, plus headers and the
        // verification's small read requests, and not much more.
        let tx = after[&iface]["tx_bytes"].as_u64().unwrap()
            - before[&iface]["tx_bytes"].as_u64().unwrap();
        assert!(engine > 0, "rail {iface} carried nothing: {report}");
        assert!(
            tx >= engine,
            "{iface}: interface sent {tx} bytes, engine says {engine}"
        );
        assert!(
            tx <= engine + engine / 10 + (4 << 20),
            "{iface}: interface sent {tx} bytes, engine says {engine}"
        );
    }
    assert_eq!(
        carried, TOTAL,
        "the rails carried the whole transfer: {report}"
    );
    if !smart {
        // Round-robin deals equal shares whatever the rail's speed.
        let shares: Vec<u64> = (0..4)
            .map(|i| rail_bytes(&report, &format!("{prefix}b{i}")))
            .collect();
        let (min, max) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
        assert!(max - min <= 8 << 20, "round-robin shares {shares:?}");
    } else {
        // The fast rail carries more than a slow one.
        assert!(
            rail_bytes(&report, &format!("{prefix}b0"))
                > rail_bytes(&report, &format!("{prefix}b3"))
        );
    }
}

#[test]
fn smart_mode_moves_256_mib_over_four_shaped_rails() {
    transfer_256_mib("mrts", true);
}

#[test]
fn baseline_mode_moves_256_mib_over_four_shaped_rails() {
    transfer_256_mib("mrtb", false);
}

#[test]
fn transfer_survives_a_rail_going_down() {
    let prefix = "mrtf";
    let Some(rails) = Rails::up_or_skip(prefix) else {
        return;
    };
    let (mut target, name) = rails.target("256MiB");
    let run = [
        "--block-size",
        "4MiB",
        "--batch-size",
        "4",
        "--total",
        "512MiB",
    ];
    // The rail goes down only once bytes are flowing.
    let (bench, _lines, drain) = flowing_writes(&rails, &name, &run);
    let t0 = Instant::now();
    rails.run(&["down", "0"]);
    let out = bench.wait_with_output().unwrap();
    let log = drain.join().unwrap();
    assert!(out.status.success(), "bench failed: {log}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("finished {:?} after rail 0 went down", t0.elapsed());
    rails.run(&["restore", "0"]);
    target.kill().ok();
    target.wait().ok();
    assert_eq!(report["bytes"].as_u64().unwrap(), 512 << 20);
    assert_eq!(
        report["verified_bytes"].as_u64().unwrap(),
        TOTAL,
        "every byte checked"
    );
    let errors: u64 = report["rails"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["errors"].as_u64().unwrap())
        .sum();
    eprintln!("slices retried after the rail went down: {errors}");
}

/// A rail paused because its link went down rejoins as soon as the link is back, not when its
/// pause (30 s) ends: its interface carries the bench's bytes again within the run.
#[test]
fn a_rail_paused_by_a_dead_link_rejoins_once_the_link_is_back() {
    let prefix = "mrtl";
    let Some(rails) = Rails::up_or_skip(prefix) else {
        return;
    };
    let (mut target, name) = rails.target("256MiB");
    let run = [
        "--block-size",
        "1MiB",
        "--batch-size",
        "8",
        "--duration",
        "6",
    ];
    let (bench, lines, drain) = flowing_writes(&rails, &name, &run);
    rails.run(&["down", "0"]);
    let rail = format!("{prefix}b0");
    wait_for(&lines, "rail 0 paused", |l| {
        l.contains("paused after repeated errors") && l.contains(&rail)
    });
    let before = rails.counters();
    let restored = Instant::now();
    rails.run(&["restore", "0"]);
    let out = bench.wait_with_output().unwrap();
    let after = rails.counters();
    let log = drain.join().unwrap();
    target.kill().ok();
    target.wait().ok();
    assert!(out.status.success(), "bench failed: {log}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["verified_bytes"].as_u64().unwrap(),
        TOTAL,
        "every byte checked"
    );
    let sent =
        after[&rail]["tx_bytes"].as_u64().unwrap() - before[&rail]["tx_bytes"].as_u64().unwrap();
    eprintln!(
        "rail 0 sent {sent} bytes in the {:?} after its link came back",
        restored.elapsed()
    );
    assert!(
        sent >= 16 << 20,
        "rail 0 sent only {sent} bytes after its link came back: still paused? {log}"
    );
}

/// An initiator killed while every link to the target is down never gets its FIN through; the
/// target's keepalive probes go unanswered and it drops those connections (and their fds)
/// instead of holding them forever.
#[test]
fn a_target_drops_connections_of_an_initiator_that_vanished_behind_dead_links() {
    let prefix = "mrka";
    let Some(rails) = Rails::up_or_skip(prefix) else {
        return;
    };
    let conf = r#"{"transports": {"tcp": {"keepalive_ms": 1000, "timeout_ms": 1500}}}"#;
    let (mut target, name) = rails.target_with("64MiB", Some(conf));
    let fds = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let idle_fds = fds(target.id());
    let args = [
        "--target",
        &name,
        "--op",
        "write",
        "--block-size",
        "1MiB",
        "--size",
        "64MiB",
        "--duration",
        "30",
    ];
    let mut bench = rails.bench(conf, &args);
    let deadline = Instant::now() + Duration::from_secs(20);
    while fds(target.id()) < idle_fds + 4 {
        assert!(Instant::now() < deadline, "the bench never connected");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let busy_fds = fds(target.id());
    for i in 0..4 {
        rails.run(&["down", &i.to_string()]);
    }
    bench.kill().unwrap();
    bench.wait().unwrap();
    let t0 = Instant::now();
    let mut now_fds = fds(target.id());
    while now_fds > idle_fds && t0.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(100));
        now_fds = fds(target.id());
    }
    for i in 0..4 {
        rails.run(&["restore", &i.to_string()]);
    }
    target.kill().ok();
    target.wait().ok();
    eprintln!(
        "target fds: {idle_fds} idle, {busy_fds} with the bench, {now_fds} {:?} after it vanished",
        t0.elapsed()
    );
    assert!(
        now_fds <= idle_fds,
        "the target still holds {} connections of a vanished initiator",
        now_fds - idle_fds
    );
}

/// A rail given by hand (`rails`) without a speed takes its interface's (the veth's 10 Gbit/s),
/// as a discovered one does. Given a speed far above what it carries (400 Gbit/s on a rail
/// policed at 200 Mbit/s), a fresh engine still keeps its queue short: its window grows from
/// the initial one by what the rail answers (slow start), so 64 MiB queued at once by four
/// threads does not all go out at once, and no slice waits past the 2 s timeout that the whole
/// transfer (2.7 s at that rate) would exceed.
#[test]
fn a_rail_given_by_hand_takes_its_interfaces_speed_and_is_not_overrun_when_told_a_faster_one() {
    let prefix = "mrth";
    let Some(rails) = Rails::up_or_skip(prefix) else {
        return;
    };
    let (mut target, name) = rails.target("64MiB");
    let run = |speed: &str| {
        let conf = format!(
            r#"{{"rails": [{{"name": "{prefix}b3", "address": "10.77.3.2"{speed}}}],
                 "transports": {{"tcp": {{"timeout_ms": 2000}}}}}}"#
        );
        let args = [
            "--target",
            &name,
            "--op",
            "write",
            "--block-size",
            "4MiB",
            "--batch-size",
            "4",
            "--threads",
            "4",
            "--size",
            "64MiB",
            "--total",
            "64MiB",
            "--verify",
        ];
        finish(rails.bench(&conf, &args))
    };
    let by_interface = run("");
    let told = run(r#", "bandwidth_gbps": 400"#);
    target.kill().ok();
    target.wait().ok();
    let rail = |report: &serde_json::Value| {
        rail_report(report, &format!("{prefix}b3"))
            .cloned()
            .unwrap_or_else(|| panic!("no rail {prefix}b3: {report}"))
    };
    assert_eq!(rail(&by_interface)["assumed_gbps"], 10.0, "{by_interface}");
    assert_eq!(rail(&told)["assumed_gbps"], 400.0, "{told}");
    for report in [&by_interface, &told] {
        assert_eq!(report["verified_bytes"].as_u64().unwrap(), 64 << 20);
        assert_eq!(rail(report)["errors"], 0, "{report}");
    }
}
