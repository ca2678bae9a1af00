//! The frame decoders of `transport::wire` on arbitrary bytes: `RequestHeader::decode`,
//! `ResponseHeader::decode`, `MsgHeader::decode` (under a receive-buffer limit taken from the
//! input) and `decode_hello`.
//!
//! Properties: no decoder panics; a header that decodes has its lengths within the documented
//! limits; encoding it gives back the input's bytes except the reserved (ignored) ones, and
//! decoding that gives the same header (round trip of meaning).
#![no_main]

use libfuzzer_sys::fuzz_target;
use multirail::transport::wire::{
    self, MsgHeader, MsgKind, RequestHeader, ResponseHeader, HELLO_LEN, MAX_SLICE_LEN,
    MSG_HEADER_LEN, REQUEST_LEN, RESPONSE_LEN,
};

/// Bytes 2..4 of a request header are reserved: the decoder ignores them, the encoder zeroes them.
const REQUEST_RESERVED: std::ops::Range<usize> = 2..4;
/// Bytes 2..4 of a response header are reserved likewise.
const RESPONSE_RESERVED: std::ops::Range<usize> = 2..4;
/// Bytes 5..8 of a message header are reserved likewise.
const MSG_RESERVED: std::ops::Range<usize> = 5..8;

/// `encoded` equals `input` on every byte outside `reserved`, and is zero inside it.
fn same_meaning(input: &[u8], encoded: &[u8], reserved: std::ops::Range<usize>) {
    for (i, (&a, &b)) in input.iter().zip(encoded).enumerate() {
        if reserved.contains(&i) {
            assert_eq!(b, 0, "encoder left reserved byte {i} non-zero");
        } else {
            assert_eq!(a, b, "byte {i} changed in the round trip");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    match RequestHeader::decode(data) {
        Ok(h) => {
            assert!(data.len() >= REQUEST_LEN);
            assert!((1..=MAX_SLICE_LEN).contains(&h.len), "{h:?}");
            assert!(h.priority.as_u8() <= 2, "{h:?}");
            let mut out = [0u8; REQUEST_LEN];
            h.encode(&mut out);
            same_meaning(&data[..REQUEST_LEN], &out, REQUEST_RESERVED);
            assert_eq!(RequestHeader::decode(&out), Ok(h));
        }
        Err(e) => assert!(!e.is_empty()),
    }

    match ResponseHeader::decode(data) {
        Ok(h) => {
            assert!(data.len() >= RESPONSE_LEN);
            assert!(h.len <= MAX_SLICE_LEN, "{h:?}");
            let mut out = [0u8; RESPONSE_LEN];
            h.encode(&mut out);
            same_meaning(&data[..RESPONSE_LEN], &out, RESPONSE_RESERVED);
            assert_eq!(ResponseHeader::decode(&out), Ok(h));
        }
        Err(e) => assert!(!e.is_empty()),
    }

    // The receive-buffer limit comes from the bytes after the header when there are some, so
    // the fuzzer explores both sides of it (0 and u32::MAX included).
    let max_len = data
        .get(MSG_HEADER_LEN..MSG_HEADER_LEN + 4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .unwrap_or(8192);
    match MsgHeader::decode(data, max_len) {
        Ok(h) => {
            assert!(data.len() >= MSG_HEADER_LEN);
            // Credit and ReverseAccept carry a count in `len`, not a payload; their users
            // bound the count.
            if !matches!(h.kind, MsgKind::Credit | MsgKind::ReverseAccept) {
                assert!(h.len <= max_len, "{h:?} above {max_len}");
            }
            let mut out = [0u8; MSG_HEADER_LEN];
            h.encode(&mut out);
            same_meaning(&data[..MSG_HEADER_LEN], &out, MSG_RESERVED);
            assert_eq!(MsgHeader::decode(&out, max_len), Ok(h));
        }
        Err(e) => assert!(!e.is_empty()),
    }

    if let Some(hello) = data.get(..HELLO_LEN) {
        let hello: &[u8; HELLO_LEN] = hello.try_into().unwrap();
        if let Ok(kind) = wire::decode_hello(hello) {
            // Every byte of a hello has a meaning: it round-trips exactly.
            let again = wire::encode_hello_with_nonce(kind, &wire::hello_nonce(hello));
            assert_eq!(&again, hello);
        }
    }
});
