//! Engines find each other through a Mooncake-compatible HTTP metadata server
//! (`multirail-metadata-server`, started in each test): descriptors are published when an engine
//! starts and whenever its memory changes, withdrawn when it goes, cached descriptors keep working
//! while the store is down, and a store that does not answer fails lookups within
//! `metadata.timeout_ms`.

mod common;
#[path = "common/transfer.rs"]
mod transfer;
use transfer::write_and_read_back;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use multirail::segment::SegmentDescriptor;
use multirail::{Config, Engine, Error, Location, StoreState, TransportChoice};
use multirail_metadata_server::MetadataServer;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use xxhash_rust::xxh3::xxh3_64;

fn start_server() -> MetadataServer {
    common::metadata_server_on("127.0.0.1:0")
}

/// `{"metadata": {"type": "http", "servers": URL, ...extra}}`.
fn http_config(url: &str, extra: &str) -> Config {
    Config::from_json_str(
        &format!(r#"{{"metadata": {{"type": "http", "servers": "{url}"{extra}}}}}"#),
        "test",
    )
    .expect("valid configuration")
}

fn engine(config: Config) -> Engine {
    Engine::new(config, "127.0.0.1:0").expect("engine starts")
}

/// A client that takes every status as an answer, bounded by 10 s, going around any proxy.
fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

/// `URL?key=KEY`, the key encoded.
fn key_url(url: &str, key: &str) -> String {
    format!("{url}?key={}", utf8_percent_encode(key, NON_ALPHANUMERIC))
}

/// The raw answer of the server to `GET ?key=KEY`: status and body.
fn get_key(url: &str, key: &str) -> (u16, Vec<u8>) {
    let mut answer = agent()
        .get(key_url(url, key))
        .call()
        .expect("metadata server answers");
    let body = answer.body_mut().read_to_vec().expect("body read");
    (answer.status().as_u16(), body)
}

/// The body of `GET url`.
fn get_text(url: &str) -> String {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    agent
        .get(url)
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap()
}

/// The descriptor stored under `key`, if any.
fn stored(url: &str, key: &str) -> Option<SegmentDescriptor> {
    let (status, body) = get_key(url, key);
    match status {
        200 => Some(serde_json::from_slice(&body).expect("stored value is a descriptor")),
        404 => None,
        other => panic!("GET {key} answered {other}"),
    }
}

/// Waits until `key` is gone from the store: the last handle's drop may run on an engine thread
/// that held the engine for a moment.
fn assert_gone_soon(url: &str, key: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while stored(url, key).is_some() {
        assert!(Instant::now() < deadline, "{key} still stored");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn engines_find_each_other_by_name_and_leave_on_drop() {
    let server = start_server();
    let url = server.url();
    let target = engine(http_config(&url, ""));
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let init = engine(http_config(&url, ""));

    let key = format!("multirail/{}", target.name());
    let published = stored(&url, &key).expect("the target published itself");
    assert_eq!(published.name, target.name());
    assert!(published.find_buffer(dst.addr(), 1 << 20).is_some());
    assert!(stored(&url, &format!("multirail/{}", init.name())).is_some());

    let seg = init.open_segment(&target.name()).unwrap();
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 3, TransportChoice::Tcp);
    // SAFETY: the transfers completed; nothing writes `dst` now.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 4, TransportChoice::Auto);
    // SAFETY: as above.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);

    drop(dst);
    drop(target);
    assert_gone_soon(&url, &key);
    // shutdown() withdraws too, while handles still exist.
    let init_key = format!("multirail/{}", init.name());
    init.shutdown();
    assert!(stored(&url, &init_key).is_none(), "shutdown withdraws");
    drop(init);
    server.shutdown();
}

#[test]
fn memory_changes_are_republished() {
    let server = start_server();
    let url = server.url();
    let target = engine(http_config(&url, ""));
    let first = target.allocate(4096, Location::Any).unwrap();
    let init = engine(http_config(&url, ""));
    let seg = init.open_segment(&target.name()).unwrap();
    assert!(init
        .segment_descriptor(seg)
        .unwrap()
        .find_buffer(first.addr(), 4096)
        .is_some());

    // Allocated after the peer cached the descriptor: its lookup on the miss finds it.
    let later = target.allocate(256 << 10, Location::Any).unwrap();
    let key = format!("multirail/{}", target.name());
    assert!(stored(&url, &key)
        .unwrap()
        .find_buffer(later.addr(), 256 << 10)
        .is_some());
    let want = write_and_read_back(&init, seg, later.addr(), 256 << 10, 9, TransportChoice::Tcp);
    // SAFETY: the transfers completed; nothing writes `later` now.
    assert_eq!(unsafe { xxh3_64(later.as_slice()) }, want);

    // Freeing withdraws the buffer from the store's descriptor too.
    target.free(&first).unwrap();
    let d = stored(&url, &key).unwrap();
    assert!(d.find_buffer(first.addr(), 4096).is_none());
    assert!(d.find_buffer(later.addr(), 256 << 10).is_some());
    drop(init);
    drop(target);
    server.shutdown();
}

/// `PUT ?key=KEY` with `body`, as a stale writer would.
fn put_key(url: &str, key: &str, body: &[u8]) {
    let answer = agent()
        .put(key_url(url, key))
        .send(body)
        .expect("metadata server takes the PUT");
    assert_eq!(answer.status().as_u16(), 200, "PUT {key}");
}

#[test]
fn a_store_behind_its_segment_does_not_fail_transfers_to_the_segments_new_memory() {
    let server = start_server();
    let url = server.url();
    // A long lease: the target's keeper does not put the newest descriptor back mid-test.
    let config = || http_config(&url, r#", "lease_ttl_s": 600, "timeout_ms": 500"#);
    let target = engine(config());
    let first = target.allocate(4096, Location::Any).unwrap();
    let key = format!("multirail/{}", target.name());
    let (status, older) = get_key(&url, &key);
    assert_eq!(status, 200);
    let later = target.allocate(256 << 10, Location::Any).unwrap();
    // An older PUT applied last (a store frozen with both in its queue): the store's copy
    // lacks `later` until the keeper's next pass.
    put_key(&url, &key, &older);
    assert!(stored(&url, &key)
        .unwrap()
        .find_buffer(later.addr(), 256 << 10)
        .is_none());

    let init = engine(config());
    let seg = init.open_segment(&target.name()).unwrap();
    let want = write_and_read_back(&init, seg, later.addr(), 256 << 10, 5, TransportChoice::Tcp);
    // SAFETY: the transfers completed; nothing writes `later` now.
    assert_eq!(unsafe { xxh3_64(later.as_slice()) }, want);

    // The store gone altogether: memory registered meanwhile is still reached.
    server.shutdown();
    let third = target.allocate(64 << 10, Location::Any).unwrap();
    let want = write_and_read_back(&init, seg, third.addr(), 64 << 10, 6, TransportChoice::Tcp);
    // SAFETY: as above.
    assert_eq!(unsafe { xxh3_64(third.as_slice()) }, want);

    // A range the segment really does not serve is still refused, naming it.
    let src = init.allocate(4096, Location::Any).unwrap();
    let batch = init.allocate_batch(1).unwrap();
    let beyond = multirail::Request::write(src.addr(), seg, first.addr() + 4096 * 1024, 4096);
    let e = init.submit(batch, &[beyond]).unwrap_err();
    assert!(matches!(e, Error::TargetOutOfRange { .. }), "{e}");
    drop((first, later, third, src, init, target));
}

#[test]
fn cached_peers_keep_working_while_the_store_is_down() {
    let server = start_server();
    let url = server.url();
    let config = || http_config(&url, r#", "timeout_ms": 500"#);
    let target = engine(config());
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let other = engine(config());
    let init = engine(config());
    let seg = init.open_segment(&target.name()).unwrap();
    let _ = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 1, TransportChoice::Tcp);

    server.shutdown();
    // Already resolved: the cached descriptor carries on, and so does memory registration
    // (its publish fails and is logged).
    let want = write_and_read_back(&init, seg, dst.addr(), 1 << 20, 2, TransportChoice::Tcp);
    // SAFETY: the transfers completed; nothing writes `dst` now.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
    // Not yet known: the lookup fails promptly, naming the store.
    let started = Instant::now();
    let e = init.open_segment(&other.name()).unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, Error::SegmentUnreachable { .. }), "{e}");
    assert!(e.to_string().contains(&url), "{e}");
    assert!(took < Duration::from_millis(500 + 2500), "took {took:?}");
    drop((init, other, dst, target));
}

#[test]
fn a_store_that_does_not_answer_fails_lookups_within_the_timeout() {
    // Accepts connections (the kernel's backlog) but never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/metadata", silent.local_addr().unwrap());
    // Its own publish times out and is logged; the engine still starts.
    let init = engine(http_config(&url, r#", "timeout_ms": 300"#));
    let started = Instant::now();
    let e = init.open_segment("127.0.0.1:9").unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, Error::SegmentUnreachable { .. }), "{e}");
    assert!(e.to_string().contains(&url), "{e}");
    assert!(e.to_string().contains("within 300 ms"), "{e}");
    assert!(took < Duration::from_millis(300 + 2500), "took {took:?}");
    drop(init);
}

#[test]
fn cluster_id_keeps_clusters_apart() {
    let server = start_server();
    let url = server.url();
    let c1 = || http_config(&url, r#", "cluster_id": "c1""#);
    let target = engine(c1());
    let dst = target.allocate(64 << 10, Location::Any).unwrap();
    let key = format!("multirail/c1/{}", target.name());
    assert!(stored(&url, &key).is_some());
    assert!(stored(&url, &format!("multirail/{}", target.name())).is_none());

    // An engine of another cluster does not see it...
    let stranger = engine(http_config(&url, r#", "cluster_id": "c2""#));
    let e = stranger.open_segment(&target.name()).unwrap_err();
    assert!(e.to_string().contains("not registered"), "{e}");
    assert!(e.to_string().contains(&url), "{e}");
    // ...one of its own does.
    let init = engine(c1());
    let seg = init.open_segment(&target.name()).unwrap();
    let want = write_and_read_back(&init, seg, dst.addr(), 64 << 10, 5, TransportChoice::Tcp);
    // SAFETY: the transfers completed; nothing writes `dst` now.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
    drop((init, stranger, dst, target));
    assert_gone_soon(&url, &key);
    server.shutdown();
}

#[test]
fn bad_servers_are_configuration_errors() {
    for bad in [
        "127.0.0.1:8080",
        "http://127.0.0.1/metadata",
        "https://h:1/m",
    ] {
        let e = Config::from_json_str(
            &format!(r#"{{"metadata": {{"type": "http", "servers": "{bad}"}}}}"#),
            "test",
        )
        .unwrap_err();
        assert_eq!(e.key, "metadata.servers", "{bad}: {e}");
    }
    let e = Config::from_json_str(r#"{"metadata": {"type": "http"}}"#, "test").unwrap_err();
    assert_eq!(e.key, "metadata.servers");
    // A configuration built in code is checked when the engine starts.
    let mut config = Config::default();
    config.metadata.kind = multirail::config::MetadataKind::Http;
    config.metadata.servers = Some("http://h:8080".into());
    match Engine::new(config, "127.0.0.1:0") {
        Err(Error::Config(e)) => assert_eq!(e.key, "metadata.servers", "{e}"),
        Err(e) => panic!("expected a configuration error, got {e}"),
        Ok(_) => panic!("expected a configuration error"),
    }
}

/// Waits until `key` is stored, for at most `limit`; returns how long it took.
fn stored_within(url: &str, key: &str, limit: Duration) -> Duration {
    let t0 = Instant::now();
    while stored(url, key).is_none() {
        assert!(t0.elapsed() < limit, "{key} not stored within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t0.elapsed()
}

#[test]
fn an_engine_whose_server_is_down_at_start_or_restarts_empty_publishes_again_by_itself() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let url = format!("http://{listen}/metadata");
    // lease_ttl_s 3: a PUT every second while the server answers.
    let extra = r#", "lease_ttl_s": 3, "timeout_ms": 300, "segment_name": "late-b""#;
    let target = engine(http_config(&url, extra));
    let stats = target.metadata_stats();
    assert_eq!(stats.store, StoreState::Down, "{stats:?}");
    assert_eq!(stats.publish_failures, 1, "{stats:?}");
    let metrics = target.serve_metrics("127.0.0.1:0").unwrap();
    let scrape = || get_text(&metrics.url());
    assert!(
        scrape().contains("multirail_metadata_store_state{state=\"down\"} 1"),
        "{}",
        scrape()
    );
    // Down for a while: the keeper backs off, but never beyond the refresh period.
    std::thread::sleep(Duration::from_secs(2));
    let server = common::metadata_server_on(&listen);
    let bound = Duration::from_secs(2) + Duration::from_millis(500);
    let took = stored_within(&url, "multirail/late-b", bound);
    eprintln!("published {took:?} after the server came up");
    let stats = target.metadata_stats();
    assert_eq!(stats.store, StoreState::Up, "{stats:?}");
    assert!(stats.republishes >= 1, "{stats:?}");
    let text = scrape();
    assert!(
        text.contains("multirail_metadata_store_state{state=\"up\"} 1")
            && text.contains("multirail_metadata_republishes_total 1"),
        "{text}"
    );

    // Restarted without its data: the key is back within a refresh period.
    drop(server);
    let server = common::metadata_server_on(&listen);
    let took = stored_within(&url, "multirail/late-b", bound);
    eprintln!("back {took:?} after the server restarted empty");

    // A peer finds it by name and moves verified bytes.
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let peer = engine(http_config(&url, ""));
    let segment = peer.open_segment("late-b").unwrap();
    let want = write_and_read_back(
        &peer,
        segment,
        dst.addr(),
        1 << 20,
        11,
        TransportChoice::Tcp,
    );
    // SAFETY: the transfers completed; nothing writes `dst` now.
    assert_eq!(unsafe { xxh3_64(dst.as_slice()) }, want);
    drop(server);
}
