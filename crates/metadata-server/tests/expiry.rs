//! Key expiry (`Limits::key_ttl`): a key not stored again within the TTL is gone, whether or
//! not anyone asks for it, from memory and from the data directory; every PUT restarts its
//! time; keys loaded at start get the full time.

mod common;

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use common::Client;
use multirail_metadata_server::{Limits, MetadataServer, ServerConfig, ServerError};

const TTL: Duration = Duration::from_millis(800);
/// How late expiry may be: the promise is the TTL plus one second; the server does far better.
const SLACK: Duration = Duration::from_millis(300);

fn with_ttl(ttl: Duration) -> Limits {
    Limits {
        key_ttl: Some(ttl),
        ..Limits::default()
    }
}

/// The series' value in a scrape of `/metrics`.
fn sample(client: &Client, series: &str) -> Option<f64> {
    let text = client.get_raw("/metrics").text();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

fn key_files(dir: &Path) -> usize {
    fs::read_dir(dir)
        .expect("list data dir")
        .filter(|e| {
            !e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with('.')
        })
        .count()
}

/// Waits until `done`, failing after `limit`.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_key_not_stored_again_is_gone_after_the_ttl() {
    let server = common::start(None, with_ttl(TTL));
    let client = Client::new(&server);
    let put_at = Instant::now();
    assert_eq!(client.put("mooncake/ram/dead", b"v").status, 200);
    assert_eq!(client.put("mooncake/ram/other", b"w").status, 200);
    assert_eq!(client.get("mooncake/ram/dead").body, b"v");
    std::thread::sleep(TTL / 2);
    assert_eq!(
        client.get("mooncake/ram/dead").status,
        200,
        "alive within the TTL"
    );
    wait_until(TTL + SLACK, || {
        client.get("mooncake/ram/dead").status == 404
    });
    assert!(put_at.elapsed() >= TTL, "gone too early");
    assert!(client.list("mooncake/").is_empty());
    assert_eq!(client.delete("mooncake/ram/dead").status, 404);
    // Readers stop seeing a key at its deadline; the expiry task removes and
    // counts it soon after, on its own time.
    wait_until(SLACK, || {
        sample(&client, "multirail_metadata_keys") == Some(0.0)
            && sample(&client, "multirail_metadata_keys_expired_total") == Some(2.0)
    });
    // Stored again, it lives again.
    assert_eq!(client.put("mooncake/ram/dead", b"back").status, 200);
    assert_eq!(client.get("mooncake/ram/dead").body, b"back");
}

#[test]
fn every_put_restarts_the_ttl() {
    let server = common::start(None, with_ttl(TTL));
    let client = Client::new(&server);
    let rpc = "mooncake/rpc_meta/engine";
    assert_eq!(client.put("kept", b"1").status, 200);
    assert_eq!(client.put(rpc, b"10.0.0.1:1").status, 200);
    let start = Instant::now();
    // Re-published every third of the TTL, as engines do, for three TTLs.
    while start.elapsed() < TTL * 3 {
        std::thread::sleep(TTL / 3);
        assert_eq!(client.put("kept", b"1").status, 200);
        // The owner republishing its endpoint unchanged keeps it too.
        let again = client.put(rpc, b"10.0.0.1:1");
        assert_eq!(
            (again.status, again.text().as_str()),
            (200, "metadata unchanged")
        );
        assert_eq!(client.get("kept").status, 200);
        assert_eq!(client.get(rpc).status, 200);
        assert_eq!(client.list("").len(), 2, "a refreshed key expired");
    }
    wait_until(TTL + SLACK, || {
        client.get("kept").status == 404 && client.get(rpc).status == 404
    });
    // An expired rpc_meta key can be claimed by a new engine with another endpoint.
    // Stored again before the expiry task got to it or after, it counts as
    // expired once.
    assert_eq!(client.put(rpc, b"10.0.0.2:1").status, 200);
    wait_until(SLACK, || {
        sample(&client, "multirail_metadata_keys_expired_total") == Some(2.0)
    });
    std::thread::sleep(TTL / 4);
    assert_eq!(
        sample(&client, "multirail_metadata_keys_expired_total"),
        Some(2.0),
        "an expiry counted twice"
    );
}

#[test]
fn expiry_needs_no_request_and_removes_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let server = common::start(Some(dir.path().to_path_buf()), with_ttl(TTL));
        let client = Client::new(&server);
        assert_eq!(client.put("dies", b"v").status, 200);
        assert_eq!(key_files(dir.path()), 1);
        // No request at all while it expires.
        wait_until(TTL + SLACK, || key_files(dir.path()) == 0);
    }
    let server = common::start(Some(dir.path().to_path_buf()), Limits::default());
    assert_eq!(
        Client::new(&server).get("dies").status,
        404,
        "not back after a restart"
    );
}

#[test]
fn keys_loaded_at_start_get_a_fresh_ttl() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let server = common::start(Some(dir.path().to_path_buf()), Limits::default());
        assert_eq!(Client::new(&server).put("old", b"v").status, 200);
    }
    // Longer ago than the TTL, but the server was not running.
    std::thread::sleep(TTL + Duration::from_millis(100));
    let started = Instant::now();
    let server = common::start(Some(dir.path().to_path_buf()), with_ttl(TTL));
    let client = Client::new(&server);
    assert_eq!(client.get("old").body, b"v");
    wait_until(TTL + SLACK, || client.get("old").status == 404);
    assert!(started.elapsed() >= TTL);
    wait_until(SLACK, || key_files(dir.path()) == 0);
}

#[test]
fn without_a_ttl_keys_stay() {
    let server = common::start_default();
    let client = Client::new(&server);
    assert_eq!(client.put("k", b"v").status, 200);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(client.get("k").status, 200);
    assert_eq!(
        sample(&client, "multirail_metadata_keys_expired_total"),
        Some(0.0)
    );
}

#[test]
fn a_ttl_out_of_range_is_refused_at_start() {
    for ttl in [
        Duration::ZERO,
        Limits::MAX_KEY_TTL + Duration::from_millis(1),
    ] {
        let err = MetadataServer::start(ServerConfig {
            listen: "127.0.0.1:0".parse().expect("address"),
            data_dir: None,
            limits: with_ttl(ttl),
        })
        .expect_err("refused");
        assert!(matches!(err, ServerError::InvalidLimits(_)), "{err}");
        assert!(err.to_string().contains("key_ttl"), "{err}");
    }
    let server = common::start(None, with_ttl(Limits::MAX_KEY_TTL));
    assert_eq!(Client::new(&server).put("k", b"v").status, 200);
}
