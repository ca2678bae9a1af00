//! `/metrics` reflects the requests made and what is stored.

mod common;

use common::Client;

/// The value of the sample line starting with `series ` (exact series).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

fn scrape(client: &Client) -> String {
    let answer = client.get_raw("/metrics");
    assert_eq!(answer.status, 200);
    assert!(
        answer
            .content_type
            .as_deref()
            .is_some_and(|t| t.starts_with("application/openmetrics-text")),
        "{:?}",
        answer.content_type
    );
    answer.text()
}

#[test]
fn counters_and_gauges_follow_the_requests() {
    let server = common::start_default();
    let client = Client::new(&server);

    let text = scrape(&client);
    assert_eq!(
        sample(&text, "multirail_metadata_keys"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(sample(&text, "multirail_metadata_value_bytes"), Some(0.0));

    for i in 0..3 {
        assert_eq!(client.put(&format!("k{i}"), b"12345").status, 200);
    }
    assert_eq!(client.put("k0", b"1234567890").status, 200); // replace: 5 -> 10 bytes
    for _ in 0..4 {
        assert_eq!(client.get("k1").status, 200);
    }
    assert_eq!(client.get("absent").status, 404);
    assert_eq!(client.get("absent").status, 404);
    assert_eq!(client.delete("k2").status, 200);
    assert_eq!(client.delete("k2").status, 404);
    assert_eq!(client.get_raw("/metadata").status, 400);
    assert_eq!(client.get_raw("/metadata?prefix=k").status, 200);

    let text = scrape(&client);
    let requests = |method: &str, code: u16| {
        sample(
            &text,
            &format!("multirail_metadata_requests_total{{method=\"{method}\",code=\"{code}\"}}"),
        )
    };
    assert!(
        text.contains("# TYPE multirail_metadata_requests counter"),
        "{text}"
    );
    assert_eq!(requests("PUT", 200), Some(4.0), "{text}");
    assert_eq!(requests("GET", 200), Some(5.0), "{text}");
    assert_eq!(requests("GET", 404), Some(2.0), "{text}");
    assert_eq!(requests("GET", 400), Some(1.0), "{text}");
    assert_eq!(requests("DELETE", 200), Some(1.0), "{text}");
    assert_eq!(requests("DELETE", 404), Some(1.0), "{text}");
    assert_eq!(requests("PUT", 413), None, "{text}");
    assert_eq!(
        sample(&text, "multirail_metadata_keys"),
        Some(2.0),
        "{text}"
    );
    // k0 (10 bytes) + k1 (5 bytes).
    assert_eq!(
        sample(&text, "multirail_metadata_value_bytes"),
        Some(15.0),
        "{text}"
    );
    assert!(
        sample(&text, "multirail_metadata_connections").is_some_and(|n| n >= 1.0),
        "{text}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
}

#[test]
fn the_keys_gauge_counts_keys_loaded_from_disk() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let server = common::start(
            Some(dir.path().to_path_buf()),
            multirail_metadata_server::Limits::default(),
        );
        let client = Client::new(&server);
        assert_eq!(client.put("a", b"xy").status, 200);
        assert_eq!(client.put("b", b"z").status, 200);
    }
    let server = common::start(
        Some(dir.path().to_path_buf()),
        multirail_metadata_server::Limits::default(),
    );
    let client = Client::new(&server);
    let text = scrape(&client);
    assert_eq!(
        sample(&text, "multirail_metadata_keys"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "multirail_metadata_value_bytes"),
        Some(3.0),
        "{text}"
    );
}
