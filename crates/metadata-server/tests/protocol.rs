//! Mooncake's HTTP metadata protocol, answer by answer.

mod common;

use common::{key_query, Client};

#[test]
fn put_then_get_returns_the_exact_bytes() {
    let server = common::start_default();
    let client = Client::new(&server);

    let put = client.put("mooncake/ram/node0:12345", br#"{"name":"test"}"#);
    assert_eq!(put.status, 200);
    assert_eq!(put.text(), "metadata updated");
    assert_eq!(put.content_type.as_deref(), Some("application/json"));

    let get = client.get("mooncake/ram/node0:12345");
    assert_eq!(get.status, 200);
    assert_eq!(get.body, br#"{"name":"test"}"#);
    assert_eq!(get.content_type.as_deref(), Some("application/json"));

    // Values are bytes, not text: every byte value, invalid UTF-8 included.
    let binary: Vec<u8> = (0..=255u8).chain([0xff, 0xfe, 0x00, 0xc3]).collect();
    assert_eq!(client.put("binary", &binary).status, 200);
    let get = client.get("binary");
    assert_eq!(get.status, 200);
    assert_eq!(get.body, binary);

    // An empty value is a value.
    assert_eq!(client.put("empty", b"").status, 200);
    let get = client.get("empty");
    assert_eq!(get.status, 200);
    assert!(get.body.is_empty());
}

#[test]
fn put_replaces_the_old_value() {
    let server = common::start_default();
    let client = Client::new(&server);
    assert_eq!(client.put("k", b"first").status, 200);
    assert_eq!(client.put("k", b"second, longer").status, 200);
    assert_eq!(client.get("k").body, b"second, longer");
}

#[test]
fn get_of_an_absent_key_is_404_metadata_not_found() {
    let server = common::start_default();
    let client = Client::new(&server);
    let get = client.get("never-stored");
    assert_eq!(get.status, 404);
    assert_eq!(get.text(), "metadata not found");
    assert_eq!(get.content_type.as_deref(), Some("application/json"));
}

#[test]
fn delete_then_get_is_404() {
    let server = common::start_default();
    let client = Client::new(&server);
    assert_eq!(client.put("k", b"v").status, 200);
    let delete = client.delete("k");
    assert_eq!(delete.status, 200);
    assert_eq!(delete.text(), "metadata deleted");
    assert_eq!(client.get("k").status, 404);
}

#[test]
fn delete_of_an_absent_key_is_404() {
    let server = common::start_default();
    let client = Client::new(&server);
    let delete = client.delete("nonexistent_key");
    assert_eq!(delete.status, 404);
    assert_eq!(delete.text(), "metadata not found");
}

#[test]
fn url_encoded_keys_round_trip() {
    let server = common::start_default();
    let client = Client::new(&server);
    let keys = [
        "mooncake/ram/host name:123?x=1&y=2",
        "100% sure",
        "plus+sign",
        "emoji \u{1f96e} and \u{00e9}\u{4e2d}\u{6587}",
        "trailing space ",
        "=&#",
    ];
    for (i, key) in keys.iter().enumerate() {
        let value = format!("value {i}");
        assert_eq!(client.put(key, value.as_bytes()).status, 200, "{key:?}");
    }
    for (i, key) in keys.iter().enumerate() {
        let get = client.get(key);
        assert_eq!(get.status, 200, "{key:?}");
        assert_eq!(get.text(), format!("value {i}"), "{key:?}");
    }
    // Each key is stored once, under its decoded form.
    let mut expected: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    expected.sort();
    assert_eq!(client.list(""), expected);
}

#[test]
fn plus_and_percent_20_are_both_spaces_but_percent_2b_is_a_plus() {
    let server = common::start_default();
    let client = Client::new(&server);
    assert_eq!(client.put_raw("/metadata?key=a+b", b"space").status, 200);
    assert_eq!(client.get_raw("/metadata?key=a%20b").body, b"space");
    assert_eq!(client.get("a b").body, b"space");
    assert_eq!(client.get_raw("/metadata?key=a%2Bb").status, 404);
    // Unknown parameters are ignored, wherever they are.
    assert_eq!(client.get_raw("/metadata?x=1&key=a+b&y").body, b"space");
}

#[test]
fn prefix_lists_matching_keys_sorted() {
    let server = common::start_default();
    let client = Client::new(&server);
    for key in [
        "mooncake/ram/b",
        "mooncake/rpc_meta/a",
        "mooncake/ram/a",
        "mooncake/ram",
        "other/ram/x",
        "mooncake/ramz",
    ] {
        assert_eq!(client.put(key, b"v").status, 200);
    }
    assert_eq!(
        client.list("mooncake/ram/"),
        vec!["mooncake/ram/a", "mooncake/ram/b"]
    );
    assert_eq!(
        client.list("mooncake/ram"),
        vec![
            "mooncake/ram",
            "mooncake/ram/a",
            "mooncake/ram/b",
            "mooncake/ramz"
        ]
    );
    assert!(client.list("nothing/").is_empty());
    assert_eq!(client.list("").len(), 6);

    let answer = client.get_raw("/metadata?prefix=other%2F");
    assert_eq!(answer.status, 200);
    assert_eq!(answer.content_type.as_deref(), Some("application/json"));
    assert_eq!(answer.text(), r#"["other/ram/x"]"#);
}

#[test]
fn rpc_meta_keys_are_write_once_like_mooncake() {
    let server = common::start_default();
    let client = Client::new(&server);
    let key = "mooncake/rpc_meta/10.0.0.1:12384";
    let original = br#"{"ip_or_host_name":"10.0.0.1","rpc_port":15228}"#;
    let changed = br#"{"ip_or_host_name":"10.0.0.1","rpc_port":16000}"#;

    assert_eq!(client.put(key, original).text(), "metadata updated");
    let again = client.put(key, original);
    assert_eq!(again.status, 200);
    assert_eq!(again.text(), "metadata unchanged");
    let conflict = client.put(key, changed);
    assert_eq!(conflict.status, 400);
    assert_eq!(conflict.text(), "Duplicate rpc_meta key not allowed");
    assert_eq!(client.get(key).body, original);

    // Deleting frees the name.
    assert_eq!(client.delete(key).status, 200);
    assert_eq!(client.put(key, changed).status, 200);
    assert_eq!(client.get(key).body, changed);
}

#[test]
fn other_methods_paths_and_health() {
    let server = common::start_default();
    let client = Client::new(&server);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();

    let post = agent
        .post(client.url(&key_query("k")))
        .send(&b"v"[..])
        .expect("POST answered");
    assert_eq!(post.status(), 405);
    assert_eq!(
        post.headers().get("allow").and_then(|v| v.to_str().ok()),
        Some("GET, HEAD, PUT, DELETE")
    );
    assert_eq!(client.get("k").status, 404, "POST must not store");

    assert_eq!(client.get_raw("/nowhere").status, 404);
    assert_eq!(client.get_raw("/metadata/extra?key=k").status, 404);
    assert_eq!(client.delete_raw("/metrics").status, 405);

    let health = client.get_raw("/health");
    assert_eq!(health.status, 200);
    assert_eq!(health.text(), "OK");

    assert_eq!(client.put("k", b"v").status, 200);
    let head = agent
        .head(client.url(&key_query("k")))
        .call()
        .expect("HEAD answered");
    assert_eq!(head.status(), 200);
}

#[test]
fn url_points_at_the_metadata_endpoint() {
    let server = common::start_default();
    let url = server.url();
    assert_eq!(url, format!("http://{}/metadata", server.local_addr()));
    assert_ne!(server.local_addr().port(), 0);
    server.shutdown();
}
