//! Engines find each other through a real etcd (Debian's `etcd-server`, started by each test
//! on free loopback ports): descriptors are published on a lease and withdrawn when the engine
//! goes, a peer published again by a new process on a new port is followed through the watch
//! before any request fails, and while etcd is stopped cached peers keep working and new
//! lookups fail within `metadata.timeout_ms`, naming the store.

mod common;
#[path = "common/etcd.rs"]
mod etcd;
#[path = "common/transfer.rs"]
mod transfer;
use etcd::Etcd;

use std::time::{Duration, Instant};

use multirail::metadata::{EtcdMetadata, MetadataStore};
use multirail::{Config, Engine, Error, Location, SegmentId, TransportChoice};
use xxhash_rust::xxh3::xxh3_64;

/// `{"metadata": {"type": "etcd", "servers": URL, ...extra}}`.
fn etcd_config(url: &str, extra: &str) -> Config {
    Config::from_json_str(
        &format!(r#"{{"metadata": {{"type": "etcd", "servers": "{url}"{extra}}}}}"#),
        "test",
    )
    .expect("valid configuration")
}

fn engine(config: Config) -> Engine {
    Engine::new(config, "127.0.0.1:0").expect("engine starts")
}

/// A store of its own, to look at what engines published.
fn store(etcd: &Etcd) -> EtcdMetadata {
    EtcdMetadata::new(&etcd.url(), "multirail/", None, Duration::from_secs(5), 10).unwrap()
}

fn registered(store: &EtcdMetadata, name: &str) -> bool {
    match store.fetch(name) {
        Ok(_) => true,
        Err(Error::SegmentUnreachable { reason, .. }) if reason.contains("not registered") => false,
        Err(e) => panic!("etcd lookup of {name} failed: {e}"),
    }
}

/// The verified round trip, over tcp.
fn write_and_read_back(init: &Engine, seg: SegmentId, dst_addr: u64, len: usize, seed: u64) -> u64 {
    transfer::write_and_read_back(init, seg, dst_addr, len, seed, TransportChoice::Tcp)
}

/// Waits until `init`'s descriptor of `seg` is `engine`'s (its address) and holds `addr`: the
/// watch brought it. Fails the test with `what` and what it had after 10 s.
fn wait_for_descriptor(init: &Engine, seg: SegmentId, engine: &Engine, addr: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = init.segment_descriptor(seg).unwrap();
        if d.name == engine.name() && d.find_buffer(addr, 1).is_some() {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {d:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn engines_find_each_other_through_etcd_and_move_verified_bytes() {
    let etcd = Etcd::start();
    let target = engine(etcd_config(&etcd.url(), ""));
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let init = engine(etcd_config(&etcd.url(), ""));
    let look = store(&etcd);
    let published = look
        .fetch(&target.name())
        .expect("the target published itself");
    assert!(published.find_buffer(dst.addr(), 1 << 20).is_some());
    assert!(registered(&look, &init.name()));

    let seg = init.open_segment(&target.name()).unwrap();
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 1);
    // SAFETY: the transfers completed; nothing writes `dst` now.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);

    // Memory registered after the peer cached the descriptor is found on the miss.
    let later = target.allocate(256 << 10, Location::Any).unwrap();
    let want = write_and_read_back(&init, seg, later.addr(), 256 << 10, 2);
    // SAFETY: as above.
    assert_eq!(unsafe { xxh3_64(later.as_slice()) }, want);

    let name = target.name();
    drop((dst, later));
    target.shutdown();
    assert!(!registered(&look, &name), "shutdown withdraws the key");
    drop(target);
    // Keys of a cluster id live apart.
    let other = engine(etcd_config(&etcd.url(), r#", "cluster_id": "c2""#));
    assert!(!registered(&look, &other.name()));
    let c2 = EtcdMetadata::new(
        &etcd.url(),
        "multirail/",
        Some("c2"),
        Duration::from_secs(5),
        10,
    )
    .unwrap();
    assert!(registered(&c2, &other.name()));
}

/// The keys hang on a lease the engine keeps alive: they outlive several times its time to
/// live while the engine runs.
#[test]
fn the_lease_is_kept_alive_while_the_engine_runs() {
    let etcd = Etcd::start();
    let target = engine(etcd_config(&etcd.url(), r#", "lease_ttl_s": 2"#));
    let look = store(&etcd);
    let until = Instant::now() + Duration::from_secs(7);
    while Instant::now() < until {
        assert!(
            registered(&look, &target.name()),
            "key lost while the engine runs"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A peer that restarts on another port under the same `segment_name` is followed through the
/// watch: the first request after the restart goes to the new process and succeeds.
#[test]
fn a_restarted_peer_is_found_again_through_the_watch() {
    let etcd = Etcd::start();
    let named = |extra: &str| {
        etcd_config(
            &etcd.url(),
            &format!(r#", "segment_name": "node-b"{extra}"#),
        )
    };
    let first = engine(named(""));
    assert_eq!(first.segment_name(), "node-b");
    let dst = first.allocate(1 << 20, Location::Any).unwrap();
    let init = engine(etcd_config(&etcd.url(), ""));
    let seg = init.open_segment("node-b").unwrap();
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 3);
    // SAFETY: the transfers completed; nothing writes `dst` now.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
    let old_port = first.name();
    drop(dst);
    drop(first);

    let second = engine(named(""));
    assert_ne!(
        second.name(),
        old_port,
        "the restarted peer listens elsewhere"
    );
    let dst = second.allocate(1 << 20, Location::Any).unwrap();
    wait_for_descriptor(
        &init,
        seg,
        &second,
        dst.addr(),
        "the watch never brought the new descriptor",
    );
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 4);
    // SAFETY: as above.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
    assert_eq!(init.open_segment("node-b").unwrap(), seg, "same segment id");
}

/// etcd frozen, then killed: the open peer keeps moving bytes; a lookup of a segment not yet
/// open fails within `timeout_ms`, naming the store; registering memory does not hang.
#[test]
fn with_etcd_stopped_cached_peers_work_and_new_lookups_fail_in_time() {
    let mut etcd = Etcd::start();
    let config = || etcd_config(&etcd.url(), r#", "timeout_ms": 500"#);
    let target = engine(config());
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let unopened = engine(config());
    let init = engine(config());
    let seg = init.open_segment(&target.name()).unwrap();
    let _ = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 5);

    let store_name = etcd.url();
    let check_lookup_fails = |how: &str| {
        let t0 = Instant::now();
        let err = init.open_segment(&unopened.name()).unwrap_err();
        let took = t0.elapsed();
        assert!(
            took < Duration::from_millis(1500),
            "{how}: lookup took {took:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&store_name),
            "{how}: the error names the store: {text}"
        );
    };
    etcd.pause();
    check_lookup_fails("etcd frozen");
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 6);
    // SAFETY: the transfers completed; nothing writes `dst` now.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
    let t0 = Instant::now();
    let extra = target.allocate(4096, Location::Any).unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "publish bounded by the timeout"
    );

    etcd.kill();
    check_lookup_fails("etcd killed");
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 7);
    // SAFETY: as above.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
    drop(extra);
}

/// etcd comes back empty (killed, data lost): an engine's lease is gone, so its keeper takes a
/// new one and puts its key again; an engine watching sees the store's history went back,
/// reads every key again and follows a segment published anew after the reset.
#[test]
fn an_etcd_restarted_without_its_data_gets_the_keys_back_and_the_watch_follows() {
    let mut etcd = Etcd::start();
    let url = etcd.url();
    let target = engine(etcd_config(&url, r#", "lease_ttl_s": 3"#));
    let first = engine(etcd_config(&url, r#", "segment_name": "node-c""#));
    let init = engine(etcd_config(&url, ""));
    let seg = init.open_segment("node-c").unwrap();
    // Revisions pass, so the watch stands well ahead of what a fresh store starts at.
    for _ in 0..5 {
        drop(target.allocate(4096, Location::Any).unwrap());
    }

    etcd.restart_empty();
    let look = store(&etcd);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !registered(&look, &target.name()) {
        assert!(
            Instant::now() < deadline,
            "the target's key never came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    drop(first);
    let second = engine(etcd_config(&url, r#", "segment_name": "node-c""#));
    let dst = second.allocate(1 << 20, Location::Any).unwrap();
    wait_for_descriptor(
        &init,
        seg,
        &second,
        dst.addr(),
        "the watch missed what the fresh store published",
    );
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 8);
    // SAFETY: the transfers completed; nothing writes `dst` now.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
}
