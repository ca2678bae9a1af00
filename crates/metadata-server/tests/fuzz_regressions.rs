//! Regression tests beside the `metadata_request` fuzz target in `fuzz/` (run with
//! `scripts/fuzz metadata_request`): the committed seeds and the inputs at the parser's edges
//! go through the same checks the target makes, parsed whole and read a few bytes at a time as
//! the connection loop reads them, asserting an answer (a request or a refusal with a one-line
//! reason) and never a panic.

use std::path::Path;

use multirail_metadata_server::query;
use multirail_metadata_server::request::{
    parse_head, parse_request, BodyLength, BodyReader, Head, ParseLimits, RejectKind,
};

const LIMITS: ParseLimits = ParseLimits {
    max_head_bytes: 2048,
    max_body_bytes: 512,
};

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Request(Head, Vec<u8>),
    Refused(u16, RejectKind),
}

fn whole(data: &[u8]) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut rest = data;
    loop {
        match parse_request(rest, &LIMITS) {
            Ok(Some((request, used))) => {
                assert!(used > 0 && used <= rest.len());
                if let BodyLength::Length(n) = request.head.body {
                    assert_eq!(request.body.len() as u64, n);
                }
                let _ = query::parse(request.head.query.as_deref(), 64);
                outcomes.push(Outcome::Request(request.head, request.body));
                rest = &rest[used..];
            }
            Ok(None) => return outcomes,
            Err(reject) => {
                assert!(!reject.reason.is_empty() && !reject.reason.contains(['\r', '\n']));
                outcomes.push(Outcome::Refused(reject.status, reject.kind));
                return outcomes;
            }
        }
    }
}

fn streamed(data: &[u8], chunk: usize) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut buf = Vec::new();
    let mut chunks = data.chunks(chunk);
    loop {
        let (head, used) = loop {
            match parse_head(&buf, &LIMITS) {
                Ok(Some(parsed)) => break parsed,
                Ok(None) => match chunks.next() {
                    Some(more) => buf.extend_from_slice(more),
                    None => return outcomes,
                },
                Err(reject) => {
                    outcomes.push(Outcome::Refused(reject.status, reject.kind));
                    return outcomes;
                }
            }
        };
        buf.drain(..used);
        let mut reader = match BodyReader::new(head.body, LIMITS.max_body_bytes) {
            Ok(reader) => reader,
            Err(reject) => {
                outcomes.push(Outcome::Refused(reject.status, reject.kind));
                return outcomes;
            }
        };
        loop {
            match reader.feed(&buf) {
                Ok(used) => {
                    buf.drain(..used);
                }
                Err(reject) => {
                    outcomes.push(Outcome::Refused(reject.status, reject.kind));
                    return outcomes;
                }
            }
            if reader.is_done() {
                break;
            }
            match chunks.next() {
                Some(more) => buf.extend_from_slice(more),
                None => return outcomes,
            }
        }
        outcomes.push(Outcome::Request(head, reader.into_body()));
    }
}

fn check(data: &[u8]) -> Vec<Outcome> {
    let at_once = whole(data);
    for chunk in [1, 2, 3, 7, 64] {
        assert_eq!(
            streamed(data, chunk),
            at_once,
            "{:?} read {chunk} bytes at a time",
            String::from_utf8_lossy(data)
        );
    }
    at_once
}

#[test]
fn the_committed_seeds_parse_the_same_whole_and_in_pieces() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/metadata_request");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("the fuzz corpus is in the repository") {
        let path = entry.expect("corpus entry").path();
        if !path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("seed-")
        {
            continue;
        }
        let data = std::fs::read(&path).expect("read seed");
        // The target's first byte is its read size; the stream follows.
        if let Some((_, stream)) = data.split_first() {
            check(stream);
        }
        seen += 1;
    }
    assert!(seen >= 5, "{seen} seeds in {}", dir.display());
}

#[test]
fn edges_of_the_head() {
    let refused = |text: &[u8]| match check(text).pop() {
        Some(Outcome::Refused(status, kind)) => (status, kind),
        other => panic!("{:?} gave {other:?}", String::from_utf8_lossy(text)),
    };
    assert_eq!(refused(b"GARBAGE\r\n\r\n").0, 400);
    assert_eq!(refused(b"\0\r\n\r\n").0, 400);
    assert_eq!(refused(b"GET / HTTP/1.1\r\n\0: x\r\n\r\n").0, 400);
    assert_eq!(refused(b"GET / HTTP/1.1\r\nA: \x7f\r\n\r\n").0, 400);
    assert_eq!(refused(b"GET /\xff HTTP/1.1\r\n\r\n").0, 400);
    assert_eq!(
        refused(b"PUT / HTTP/1.1\r\nContent-Length: \r\n\r\n"),
        (400, RejectKind::ContentLength)
    );
    assert_eq!(
        refused(b"PUT / HTTP/1.1\r\nContent-Length: +1\r\n\r\nx"),
        (400, RejectKind::ContentLength)
    );
    assert_eq!(
        refused(b"PUT / HTTP/1.1\r\nTransfer-Encoding: \r\n\r\n"),
        (400, RejectKind::TransferEncoding)
    );
    // Exactly at the head limit is fine; one byte more is not.
    let fill = |n: usize| {
        let mut text = b"GET /".to_vec();
        text.resize(n - b" HTTP/1.1\r\n\r\n".len(), b'a');
        text.extend_from_slice(b" HTTP/1.1\r\n\r\n");
        text
    };
    assert!(matches!(
        check(&fill(LIMITS.max_head_bytes)).as_slice(),
        [Outcome::Request(..)]
    ));
    assert_eq!(
        refused(&fill(LIMITS.max_head_bytes + 1)),
        (431, RejectKind::HeadTooLarge)
    );
    // A fault past the limit is not looked at: the head is too large, whether the reads
    // stopped before the fault (as they do at the limit) or the whole stream was there.
    // The fuzzer found these two disagreeing.
    let mut long = b"PUT /metadata?".to_vec();
    long.resize(LIMITS.max_head_bytes + 30, b'f');
    long.extend_from_slice(b"@\x01 HTTP/1.1\r\n\r\n");
    assert_eq!(refused(&long), (431, RejectKind::HeadTooLarge));
    // A fault within the limit is found first, in any case.
    long[20] = b' ';
    assert_eq!(refused(&long), (400, RejectKind::MalformedHead));
}

#[test]
fn edges_of_the_body() {
    let body = |text: &[u8]| match check(text).pop() {
        Some(Outcome::Request(_, body)) => Ok(body),
        Some(Outcome::Refused(status, kind)) => Err((status, kind)),
        None => Err((0, RejectKind::BodyIncomplete)),
    };
    let at_limit = format!(
        "PUT / HTTP/1.1\r\nContent-Length: 512\r\n\r\n{}",
        "x".repeat(512)
    );
    assert_eq!(body(at_limit.as_bytes()).unwrap().len(), 512);
    assert_eq!(
        body(b"PUT / HTTP/1.1\r\nContent-Length: 513\r\n\r\n"),
        Err((413, RejectKind::BodyTooLarge))
    );
    assert_eq!(
        body(b"PUT / HTTP/1.1\r\nContent-Length: 18446744073709551616\r\n\r\n"),
        Err((413, RejectKind::BodyTooLarge))
    );
    let chunked =
        |chunks: &str| format!("PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n{chunks}");
    assert_eq!(
        body(chunked(&format!("200\r\n{}\r\n0\r\n\r\n", "y".repeat(512))).as_bytes())
            .unwrap()
            .len(),
        512
    );
    assert_eq!(
        body(chunked(&format!("200\r\n{}\r\n1\r\n", "y".repeat(512))).as_bytes()),
        Err((413, RejectKind::BodyTooLarge))
    );
    // A size past u64 is too large, not an overflow.
    assert_eq!(
        body(chunked("fffffffffffffffff\r\n").as_bytes()),
        Err((413, RejectKind::BodyTooLarge))
    );
    // Leading zeros are a number, up to the size line's bound.
    assert_eq!(
        body(chunked("0000000000000000000001\r\nz\r\n0\r\n\r\n").as_bytes()),
        Ok(b"z".to_vec())
    );
    assert_eq!(
        body(chunked(&format!("{}1\r\n", "0".repeat(5000))).as_bytes()),
        Err((400, RejectKind::BodyMalformed))
    );
    for bad in [
        "\r\n", "1\n", "1\rx", "1\r\nzz", "1\r\nz\n", "0\r\nx\n", "0\r\n\n", ";\r\n",
    ] {
        assert_eq!(
            body(chunked(bad).as_bytes()),
            Err((400, RejectKind::BodyMalformed)),
            "{bad:?}"
        );
    }
}
