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
