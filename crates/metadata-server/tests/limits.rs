//! Bounds: value size, key length, malformed queries, slow clients,
//! connection count.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::Client;
use multirail_metadata_server::{Limits, MetadataServer, ServerConfig, ServerError};

fn small_limits() -> Limits {
    Limits {
        max_value_bytes: 64 * 1024,
        max_key_bytes: 100,
        ..Limits::default()
    }
}

#[test]
fn value_over_the_limit_is_413_and_not_stored() {
    let server = common::start(None, small_limits());
    let client = Client::new(&server);

    let at_limit = vec![7u8; 64 * 1024];
    assert_eq!(client.put("fits", &at_limit).status, 200);
    assert_eq!(client.get("fits").body, at_limit);

    let over = vec![7u8; 64 * 1024 + 1];
    let put = client.put("too-big", &over);
    assert_eq!(put.status, 413);
    assert!(
        put.text().contains("65536"),
        "reason names the limit: {}",
        put.text()
    );
    assert_eq!(client.get("too-big").status, 404);

    // Replacing with an oversized value keeps the old one.
    assert_eq!(client.put("fits", &over).status, 413);
    assert_eq!(client.get("fits").body, at_limit);
}

#[test]
fn chunked_value_over_the_limit_is_413() {
    let server = common::start(None, small_limits());
    let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let chunk = vec![b'x'; 16 * 1024];
    let mut request =
        b"PUT /metadata?key=chunked HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    for _ in 0..5 {
        request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend_from_slice(&chunk);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    // The server may answer and close before reading everything.
    let _ = stream.write_all(&request);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");

    let client = Client::new(&server);
    assert_eq!(client.get("chunked").status, 404);
}

#[test]
fn key_over_the_limit_is_400() {
    let server = common::start(None, small_limits());
    let client = Client::new(&server);
    let long = "k".repeat(101);
    let put = client.put(&long, b"v");
    assert_eq!(put.status, 400);
    assert!(put.text().contains("100"), "{}", put.text());
    assert_eq!(client.get(&long).status, 400);
    assert_eq!(client.delete(&long).status, 400);
    assert_eq!(
        client.get_raw(&format!("/metadata?prefix={long}")).status,
        400
    );
    // Exactly at the limit is fine; the limit counts decoded UTF-8 bytes.
    assert_eq!(client.put(&"k".repeat(100), b"v").status, 200);
    assert_eq!(client.put(&"\u{e9}".repeat(51), b"v").status, 400);
    assert_eq!(client.put(&"\u{e9}".repeat(50), b"v").status, 200);
}

#[test]
fn missing_key_is_400() {
    let server = common::start_default();
    let client = Client::new(&server);
    for query in [
        "/metadata",
        "/metadata?",
        "/metadata?key=",
        "/metadata?other=1",
    ] {
        let put = client.put_raw(query, b"v");
        assert_eq!(put.status, 400, "{query}");
        assert_eq!(put.text(), "Missing key parameter", "{query}");
        assert_eq!(client.get_raw(query).status, 400, "{query}");
        assert_eq!(client.delete_raw(query).status, 400, "{query}");
    }
    assert!(client.list("").is_empty(), "nothing was stored");
}

#[test]
fn both_key_and_prefix_is_400() {
    let server = common::start_default();
    let client = Client::new(&server);
    let get = client.get_raw("/metadata?key=a&prefix=b");
    assert_eq!(get.status, 400);
    assert!(get.text().contains("not both"), "{}", get.text());
    assert_eq!(client.put_raw("/metadata?prefix=b&key=a", b"v").status, 400);
}

#[test]
fn other_malformed_queries_are_400_with_a_reason() {
    let server = common::start_default();
    let client = Client::new(&server);
    let cases = [
        ("/metadata?key=a&key=b", "more than once"),
        ("/metadata?key=%FF%FE", "UTF-8"),
    ];
    for (query, reason) in cases {
        let get = client.get_raw(query);
        assert_eq!(get.status, 400, "{query}");
        assert!(get.text().contains(reason), "{query}: {}", get.text());
    }
    let put = client.put_raw("/metadata?prefix=a", b"v");
    assert_eq!(put.status, 400);
    assert!(put.text().contains("prefix"), "{}", put.text());
    assert_eq!(client.delete_raw("/metadata?prefix=a").status, 400);
}

#[test]
fn a_body_that_never_arrives_times_out_with_408() {
    let server = common::start(
        None,
        Limits {
            request_timeout: Duration::from_millis(300),
            ..Limits::default()
        },
    );
    let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    stream
        .write_all(b"PUT /metadata?key=slow HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nab")
        .expect("write");
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    assert_eq!(Client::new(&server).get("slow").status, 404);
}

#[test]
fn connections_beyond_the_limit_wait_instead_of_failing() {
    let server = common::start(
        None,
        Limits {
            max_connections: 2,
            // Idle connections are closed after this, freeing their slots.
            request_timeout: Duration::from_millis(500),
            ..Limits::default()
        },
    );
    // Two silent connections take both slots.
    let idle: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(server.local_addr()).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    // A third client is queued, then served once an idle one is dropped by
    // the server's timeout.
    let client = Client::new(&server);
    assert_eq!(client.put("k", b"v").status, 200);
    assert_eq!(client.get("k").body, b"v");
    // The silent connections were closed by the server.
    for mut stream in idle {
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let mut buf = Vec::new();
        let _ = stream.read_to_end(&mut buf);
    }
}

#[test]
fn unusable_limits_are_refused_at_start() {
    for limits in [
        Limits {
            max_connections: 0,
            ..Limits::default()
        },
        Limits {
            request_timeout: Duration::ZERO,
            ..Limits::default()
        },
        Limits {
            max_key_bytes: 0,
            ..Limits::default()
        },
    ] {
        let err = MetadataServer::start(ServerConfig {
            listen: "127.0.0.1:0".parse().expect("address"),
            data_dir: None,
            limits,
        })
        .expect_err("refused");
        assert!(matches!(err, ServerError::InvalidLimits(_)), "{err}");
    }
}

#[test]
fn default_limits_are_the_documented_ones() {
    let limits = Limits::default();
    assert_eq!(limits.max_value_bytes, 1 << 20);
    assert_eq!(limits.max_key_bytes, 4096);
    assert_eq!(limits.max_connections, 1024);
    assert_eq!(limits.request_timeout, Duration::from_secs(30));
    assert_eq!(limits.key_ttl, None, "keys never expire unless asked");
    // A value of exactly 1 MiB fits under the defaults.
    let server = common::start_default();
    let client = Client::new(&server);
    let value = vec![1u8; 1 << 20];
    assert_eq!(client.put("big", &value).status, 200);
}
