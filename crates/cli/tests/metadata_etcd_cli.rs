//! `multirail target` publishing through a real etcd (Debian's `etcd-server`, started by the
//! test): killed with SIGKILL, so it withdraws nothing, its key still disappears once its lease
//! runs out.

mod common;
#[path = "../../multirail/tests/common/etcd.rs"]
mod etcd;

use std::time::{Duration, Instant};

use common::TargetProcess;
use etcd::Etcd;
use multirail::metadata::{EtcdMetadata, MetadataStore};
use multirail::Error;

fn registered(store: &EtcdMetadata, name: &str) -> bool {
    match store.fetch(name) {
        Ok(_) => true,
        Err(Error::SegmentUnreachable { reason, .. }) if reason.contains("not registered") => false,
        Err(e) => panic!("etcd lookup of {name} failed: {e}"),
    }
}

#[test]
fn a_target_killed_with_sigkill_disappears_from_etcd_within_the_lease_ttl() {
    const TTL_S: u64 = 3;
    let etcd = Etcd::start();
    let url = etcd.url();
    let mut target = TargetProcess::start_configured(
        "1MiB",
        Some(&format!(r#"{{"metadata": {{"lease_ttl_s": {TTL_S}}}}}"#)),
        &[],
        |cmd| {
            cmd.env("MULTIRAIL_METADATA", &url);
        },
    );
    let store = EtcdMetadata::new(&url, "multirail/", None, Duration::from_secs(5), 10).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !registered(&store, &target.name) {
        assert!(
            Instant::now() < deadline,
            "the target never published itself"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Alive for longer than its lease: the keeper renews it.
    std::thread::sleep(Duration::from_secs(TTL_S + 1));
    assert!(registered(&store, &target.name), "the lease is kept alive");

    target.signal(libc::SIGKILL);
    let _ = target.child.wait();
    let killed = Instant::now();
    while registered(&store, &target.name) {
        assert!(
            killed.elapsed() < Duration::from_secs(TTL_S),
            "still registered {:?} after SIGKILL",
            killed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "gone from etcd {:?} after SIGKILL (lease_ttl_s {TTL_S})",
        killed.elapsed()
    );
}

#[test]
fn a_target_started_while_etcd_is_down_registers_once_etcd_is_up() {
    // Before, the first publish failed, no lease was ever granted, and the keeper skipped
    // every pass: the target stayed unregistered for as long as it lived.
    const TTL_S: u64 = 3;
    let mut etcd = Etcd::stopped();
    let url = etcd.url();
    let conf = format!(
        r#"{{"metadata": {{"type": "etcd", "servers": "{url}", "segment_name": "seg-b",
             "lease_ttl_s": {TTL_S}, "timeout_ms": 500}}}}"#
    );
    let mut cmd = std::process::Command::new(common::multirail_bin());
    cmd.args(["target", "--listen", "127.0.0.1:0", "--size", "1MiB"])
        .env("MULTIRAIL_CONF", &conf)
        .env_remove("MULTIRAIL_METADATA")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped());
    let mut target = Killed(cmd.spawn().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(target.0.stdout.take().unwrap()),
        &mut first,
    )
    .unwrap();
    assert!(first.starts_with("127.0.0.1:"), "{first}");
    // Down for longer than a lease, so the target has failed several passes.
    std::thread::sleep(Duration::from_secs(TTL_S + 1));
    etcd.restart();
    let up = Instant::now();
    let store = EtcdMetadata::new(&url, "multirail/", None, Duration::from_secs(5), 10).unwrap();
    // One refresh period (a third of the lease) plus one back-off step, capped by it.
    let bound = Duration::from_millis(TTL_S * 1000 * 2 / 3) + Duration::from_secs(1);
    while !registered(&store, "seg-b") {
        assert!(
            up.elapsed() < bound,
            "seg-b not registered {:?} after etcd came up",
            up.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("seg-b registered {:?} after etcd came up", up.elapsed());
}

/// A child process killed and reaped when the test ends, passed or not.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_wiped_etcd_gets_a_live_targets_key_back_within_the_lease() {
    const TTL_S: u64 = 3;
    let mut etcd = Etcd::start();
    let url = etcd.url();
    let conf = format!(r#"{{"metadata": {{"lease_ttl_s": {TTL_S}, "timeout_ms": 500}}}}"#);
    let target = TargetProcess::start_configured("1MiB", Some(&conf), &[], |cmd| {
        cmd.env("MULTIRAIL_METADATA", &url);
    });
    let store = EtcdMetadata::new(&url, "multirail/", None, Duration::from_secs(5), 10).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !registered(&store, &target.name) {
        assert!(Instant::now() < deadline, "never published");
        std::thread::sleep(Duration::from_millis(20));
    }
    etcd.restart_empty();
    let up = Instant::now();
    while !registered(&store, &target.name) {
        assert!(
            up.elapsed() < Duration::from_secs(TTL_S + 1),
            "not back {:?} after etcd was wiped",
            up.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("back in etcd {:?} after it was wiped", up.elapsed());
}
