//! The metadata server's request parser (`multirail_metadata_server::request`) and its query
//! decoding on arbitrary bytes, as a client's connection would deliver them.
//!
//! The first byte picks how many bytes each simulated socket read returns (1 to 64); the rest
//! is the byte stream. Properties: nothing panics; every refusal has a status the server sends
//! (400, 413, 431, 501) and a non-empty one-line reason; a parsed request's body has its
//! Content-Length and stays within the limit; a query is decoded into a key or prefix within the
//! key limit, or refused with a one-line reason; and reading the stream in small pieces, as the
//! server's connection loop does, parses the same requests and refuses the same way as parsing it
//! whole.
#![no_main]

use libfuzzer_sys::fuzz_target;
use multirail_metadata_server::query::{self, BadQuery, Target};
use multirail_metadata_server::request::{
    parse_head, parse_request, BodyLength, BodyReader, Head, ParseLimits, Reject, RejectKind,
};

const LIMITS: ParseLimits = ParseLimits {
    max_head_bytes: 2048,
    max_body_bytes: 512,
};
const MAX_KEY_BYTES: usize = 64;

/// What one request in the stream came to.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Request(Head, Vec<u8>),
    Refused(u16, RejectKind),
}

fn check_reject(reject: &Reject) {
    assert!(
        matches!(reject.status, 400 | 413 | 431 | 501),
        "status {}",
        reject.status
    );
    assert!(!reject.reason.is_empty(), "{reject:?}");
    assert!(!reject.reason.contains(['\r', '\n']), "{reject:?}");
}

fn check_request(head: &Head, body: &[u8]) {
    assert!(body.len() <= LIMITS.max_body_bytes);
    if let BodyLength::Length(n) = head.body {
        assert_eq!(body.len() as u64, n);
    }
    assert!(
        head.path.starts_with('/') || head.path == "*",
        "{:?}",
        head.path
    );
    match query::parse(head.query.as_deref(), MAX_KEY_BYTES) {
        Ok(Target::Key(key)) => assert!(!key.is_empty() && key.len() <= MAX_KEY_BYTES),
        Ok(Target::Prefix(prefix)) => assert!(prefix.len() <= MAX_KEY_BYTES),
        Err(BadQuery(reason)) => assert!(!reason.is_empty() && !reason.contains(['\r', '\n'])),
    }
}

/// The whole stream at once, request after request.
fn whole(data: &[u8]) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut rest = data;
    loop {
        match parse_request(rest, &LIMITS) {
            Ok(Some((request, used))) => {
                assert!(used > 0 && used <= rest.len());
                check_request(&request.head, &request.body);
                outcomes.push(Outcome::Request(request.head, request.body));
                rest = &rest[used..];
            }
            Ok(None) => return outcomes,
            Err(reject) => {
                check_reject(&reject);
                outcomes.push(Outcome::Refused(reject.status, reject.kind));
                return outcomes;
            }
        }
    }
}

/// The stream in reads of `chunk` bytes, as the connection loop takes it.
fn streamed(data: &[u8], chunk: usize) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut buf = Vec::new();
    let mut pos = 0;
    let mut read = |buf: &mut Vec<u8>| {
        let end = (pos + chunk).min(data.len());
        buf.extend_from_slice(&data[pos..end]);
        let n = end - pos;
        pos = end;
        n
    };
    loop {
        let (head, used) = loop {
            match parse_head(&buf, &LIMITS) {
                Ok(Some(parsed)) => break parsed,
                Ok(None) => {
                    if read(&mut buf) == 0 {
                        return outcomes;
                    }
                }
                Err(reject) => {
                    check_reject(&reject);
                    outcomes.push(Outcome::Refused(reject.status, reject.kind));
                    return outcomes;
                }
            }
        };
        buf.drain(..used);
        let refused = |reject: Reject, outcomes: &mut Vec<Outcome>| {
            check_reject(&reject);
            outcomes.push(Outcome::Refused(reject.status, reject.kind));
        };
        let mut reader = match BodyReader::new(head.body, LIMITS.max_body_bytes) {
            Ok(reader) => reader,
            Err(reject) => {
                refused(reject, &mut outcomes);
                return outcomes;
            }
        };
        loop {
            match reader.feed(&buf) {
                Ok(used) => {
                    assert!(used <= buf.len());
                    buf.drain(..used);
                }
                Err(reject) => {
                    refused(reject, &mut outcomes);
                    return outcomes;
                }
            }
            if reader.is_done() {
                break;
            }
            assert!(buf.is_empty(), "an unfinished body left input unread");
            if read(&mut buf) == 0 {
                // The server answers this with 400; parsing the whole stream just runs out.
                let reject = reader.incomplete();
                check_reject(&reject);
                return outcomes;
            }
        }
        let body = reader.into_body();
        check_request(&head, &body);
        outcomes.push(Outcome::Request(head, body));
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, stream)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(first % 64) + 1;
    let at_once = whole(stream);
    let in_pieces = streamed(stream, chunk);
    assert_eq!(at_once, in_pieces, "read {chunk} bytes at a time");
});
