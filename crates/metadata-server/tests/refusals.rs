//! Requests refused before any handler sees them (not HTTP/1.1, bad framing, too slow): each
//! answer carries a one-line reason, the connection is closed, and `/metrics` counts the
//! refusal by status code and reason.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use common::Client;
use multirail_metadata_server::{Limits, MetadataServer};

/// Sends `request` on a new connection and reads until the server closes it; returns the
/// status code and the body.
fn exchange(server: &MetadataServer, request: &[u8], half_close: bool) -> (u16, String) {
    let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("read timeout");
    stream.write_all(request).expect("write");
    if half_close {
        stream.shutdown(Shutdown::Write).expect("half close");
    }
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => panic!("no answer to {:?}: {e}", String::from_utf8_lossy(request)),
        }
    }
    parse_answer(&answer)
}

fn parse_answer(answer: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(answer).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status: {head:?}"));
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or_else(|| panic!("no content-length: {head:?}"));
    assert_eq!(body.len(), length, "{text:?}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head:?}"
    );
    (status, body.to_owned())
}

fn assert_one_line_reason(body: &str, what: &str) {
    assert!(!body.is_empty(), "{what}: empty body");
    assert!(!body.contains(['\r', '\n']), "{what}: {body:?}");
}

fn rejected(text: &str, code: u16, reason: &str) -> Option<f64> {
    let series =
        format!("multirail_metadata_rejected_total{{code=\"{code}\",reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn parse_level_refusals_carry_a_one_line_reason_and_are_counted() {
    let server = common::start_default();
    let cases: &[(&[u8], u16, &str, &str)] = &[
        (b"GARBAGE\r\n\r\n", 400, "malformed_head", "request line"),
        (
            b"PUT /metadata?key=k HTTP/1.1\r\nHost: t\r\nContent-Length: -5\r\n\r\n",
            400,
            "content_length",
            "\"-5\"",
        ),
        (
            b"PUT /metadata?key=k HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            400,
            "content_length",
            "twice",
        ),
        (
            b"GET /metadata?key=k HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n",
            400,
            "malformed_head",
            "header field name",
        ),
        (
            b"PUT /metadata?key=k HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            501,
            "transfer_encoding",
            "gzip",
        ),
        (
            b"PUT /metadata?key=k HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            400,
            "body_malformed",
            "chunk size",
        ),
    ];
    for &(request, status, _, words) in cases {
        let what = String::from_utf8_lossy(request).into_owned();
        let (got, body) = exchange(&server, request, false);
        assert_eq!(got, status, "{what:?}: {body}");
        assert_one_line_reason(&body, &what);
        assert!(body.contains(words), "{what:?}: reason {body:?}");
    }
    // Cut off mid-head and mid-body: the client can still read why.
    let (status, body) = exchange(&server, b"GET /metadata?key=k HTTP/1.1\r\nHo", true);
    assert_eq!(status, 400);
    assert_one_line_reason(&body, "cut head");
    let (status, body) = exchange(
        &server,
        b"PUT /metadata?key=k HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc",
        true,
    );
    assert_eq!(status, 400);
    assert!(body.contains("after 3 bytes"), "{body}");

    let client = Client::new(&server);
    assert_eq!(client.get("k").status, 404, "nothing was stored");
    let text = client.get_raw("/metrics").text();
    assert_eq!(rejected(&text, 400, "malformed_head"), Some(2.0), "{text}");
    assert_eq!(rejected(&text, 400, "content_length"), Some(2.0), "{text}");
    assert_eq!(
        rejected(&text, 501, "transfer_encoding"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(rejected(&text, 400, "body_malformed"), Some(1.0), "{text}");
    assert_eq!(rejected(&text, 400, "head_incomplete"), Some(1.0), "{text}");
    assert_eq!(rejected(&text, 400, "body_incomplete"), Some(1.0), "{text}");
    for &(request, status, class, _) in cases {
        assert!(
            rejected(&text, status, class).is_some(),
            "{:?} not counted: {text}",
            String::from_utf8_lossy(request)
        );
    }
    // Requests to /metadata whose head parsed are counted by method as well.
    assert!(
        text.contains("multirail_metadata_requests_total{method=\"PUT\",code=\"400\"} 2"),
        "{text}"
    );
}

#[test]
fn timeouts_answer_408_with_a_reason_and_are_counted() {
    let timeout = Duration::from_millis(300);
    let server = common::start(
        None,
        Limits {
            request_timeout: timeout,
            ..Limits::default()
        },
    );
    // Half a head, then silence.
    let started = Instant::now();
    let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    stream
        .write_all(b"GET /metadata?key=k HTTP/1.1\r\nHost")
        .expect("write");
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    assert!(started.elapsed() >= timeout);
    let (status, body) = parse_answer(&answer);
    assert_eq!(status, 408);
    assert_one_line_reason(&body, "head timeout");
    assert!(body.contains("head"), "{body}");
    // A head, then half a body.
    let (status, body) = exchange(
        &server,
        b"PUT /metadata?key=k HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nab",
        false,
    );
    assert_eq!(status, 408);
    assert!(body.contains("body"), "{body}");
    // An idle connection is closed without an answer and without being counted.
    let mut idle = TcpStream::connect(server.local_addr()).expect("connect");
    idle.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut nothing = Vec::new();
    let _ = idle.read_to_end(&mut nothing);
    assert!(
        nothing.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&nothing)
    );

    let text = Client::new(&server).get_raw("/metrics").text();
    assert_eq!(rejected(&text, 408, "head_timeout"), Some(1.0), "{text}");
    assert_eq!(rejected(&text, 408, "body_timeout"), Some(1.0), "{text}");
    assert!(
        text.contains("multirail_metadata_requests_total{method=\"PUT\",code=\"408\"} 1"),
        "{text}"
    );
}

#[test]
fn oversized_heads_and_bodies_are_refused_with_a_reason() {
    let server = common::start(
        None,
        Limits {
            max_key_bytes: 16,
            max_value_bytes: 32,
            ..Limits::default()
        },
    );
    let mut long = b"GET /metadata?key=".to_vec();
    long.extend_from_slice(&vec![b'a'; 64 * 1024]);
    long.extend_from_slice(b" HTTP/1.1\r\n\r\n");
    let (status, body) = exchange(&server, &long, false);
    assert_eq!(status, 431);
    assert!(body.contains("longer than"), "{body}");
    let (status, body) = exchange(
        &server,
        b"PUT /metadata?key=k HTTP/1.1\r\nHost: t\r\nContent-Length: 33\r\n\r\n",
        false,
    );
    assert_eq!(status, 413);
    assert!(body.contains("32"), "{body}");
    let text = Client::new(&server).get_raw("/metrics").text();
    assert_eq!(rejected(&text, 431, "head_too_large"), Some(1.0), "{text}");
    assert_eq!(rejected(&text, 413, "body_too_large"), Some(1.0), "{text}");
}

#[test]
fn keep_alive_pipelining_and_100_continue() {
    let server = common::start_default();
    let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    // Two requests in one write, the second asking to close.
    stream
        .write_all(
            b"PUT /metadata?key=p HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc\
              GET /metadata?key=p HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
        .expect("write");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("read");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.ends_with("\r\n\r\nabc"), "{text}");
    assert_eq!(text.matches("HTTP/1.1 200").count(), 2, "{text}");

    // A client that waits for 100 Continue before its body.
    let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    stream
        .write_all(
            b"PUT /metadata?key=c HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\
              Expect: 100-continue\r\nConnection: close\r\n\r\n",
        )
        .expect("write");
    let mut interim = [0u8; 25];
    stream.read_exact(&mut interim).expect("100 Continue");
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    stream.write_all(b"ok").expect("body");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("read");
    assert!(answer.starts_with(b"HTTP/1.1 200"));
    assert_eq!(Client::new(&server).get("c").body, b"ok");
}
