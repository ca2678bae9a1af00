//! The server's side of the connection handshake (`transport::handshake::ServerHandshake`)
//! driven with arbitrary byte chunks, for an open server and for one that requires a token.
//!
//! Input: a mode byte (bit 0: the server requires a token; bit 1: an honest client, which sends
//! a valid hello and the right proof, else the stream is arbitrary), the server's nonce, and
//! the client's bytes cut into chunks (a length byte before each chunk, or, for the honest
//! client, chunk lengths taken from the input).
//!
//! Properties: `on_bytes` never panics and never takes more than `wants()` nor more than it is
//! given; it refuses a malformed hello (at the first byte of a wrong magic) and answers nothing
//! to it; after a well-formed hello it sends the 72-byte challenge the module documents (server
//! proof = HMAC-SHA256 over the nonces); after 32 more bytes it sends the 4-byte verdict and
//! accepts exactly the right proof (any proof when open); bytes fed after that are refused and
//! left unread.
#![no_main]

use arbitrary::Unstructured;
use hmac::{Hmac, Mac};
use libfuzzer_sys::fuzz_target;
use multirail::segment::PROTOCOL_VERSION;
use multirail::transport::handshake::{
    Membership, Outcome, ServerHandshake, CHALLENGE_LEN, CHALLENGE_MAGIC, NONCE_LEN, PROOF_LEN,
    VERDICT_LEN,
};
use multirail::transport::wire::{self, ConnKind, HELLO_LEN};
use sha2::Sha256;

const TOKEN: &[u8] = b"fuzz-membership-token-0123456789";

/// The documented proof: HMAC-SHA256(token, label ‖ kind ‖ first ‖ second), zeros without a token.
fn proof(
    token: Option<&[u8]>,
    label: &[u8],
    kind: ConnKind,
    first: &[u8],
    second: &[u8],
) -> [u8; 32] {
    let Some(token) = token else { return [0; 32] };
    let mut mac = Hmac::<Sha256>::new_from_slice(token).expect("any key size");
    mac.update(label);
    mac.update(&[kind as u8]);
    mac.update(first);
    mac.update(second);
    mac.finalize().into_bytes().into()
}

fn run(data: &[u8]) -> arbitrary::Result<()> {
    let mut u = Unstructured::new(data);
    let mode: u8 = u.arbitrary()?;
    let token = (mode & 1 == 1).then_some(TOKEN);
    let honest = mode & 2 == 2;
    let server_nonce: [u8; NONCE_LEN] = u.arbitrary()?;
    let membership = match token {
        Some(t) => Membership::with_token(t),
        None => Membership::open(),
    };

    // The client's byte stream, and where it is cut into chunks.
    let mut stream = Vec::new();
    let mut cuts = Vec::new();
    if honest {
        let kind = *u.choose(&[ConnKind::Control, ConnKind::Data, ConnKind::Message])?;
        let client_nonce: [u8; NONCE_LEN] = u.arbitrary()?;
        stream.extend_from_slice(&wire::encode_hello_with_nonce(kind, &client_nonce));
        stream.extend_from_slice(&proof(
            token,
            b"multirail-client\0",
            kind,
            &server_nonce,
            &client_nonce,
        ));
        // What follows belongs to the connection, not the handshake.
        stream.push(wire::CONTROL_GET_DESCRIPTOR);
        let mut at = 0;
        while at < stream.len() {
            let n = 1 + usize::from(u.arbitrary::<u8>()? % 48);
            cuts.push(n.min(stream.len() - at));
            at += n;
        }
    } else {
        while !u.is_empty() {
            let n = usize::from(u.arbitrary::<u8>()?);
            let chunk = u.bytes(n.min(u.len()))?;
            cuts.push(chunk.len());
            stream.extend_from_slice(chunk);
        }
    }

    // Fed as a server does: every chunk until it is used up, handing back what was not taken.
    let mut hs = ServerHandshake::new(membership, server_nonce);
    let mut out = Vec::new();
    let mut taken = 0usize;
    let mut outcome = None;
    let mut at = 0;
    'feed: for n in cuts {
        let mut rest = &stream[at..at + n];
        at += n;
        loop {
            let wants = hs.wants();
            let result = hs.on_bytes(rest, &mut out);
            if outcome.is_some() {
                assert!(result.is_err(), "bytes accepted after the outcome");
                assert_eq!(wants, 0);
                break 'feed;
            }
            match result {
                Ok((took, o)) => {
                    assert_eq!(
                        took,
                        wants.min(rest.len()),
                        "took {took} of {} with {wants} wanted",
                        rest.len()
                    );
                    taken += took;
                    rest = &rest[took..];
                    assert_eq!(hs.said_hello(), taken >= HELLO_LEN);
                    // A wrong magic is refused as soon as its first wrong byte arrives.
                    let head = taken.min(wire::MAGIC.len());
                    assert_eq!(stream[..head], wire::MAGIC[..head], "took a wrong magic");
                    assert_eq!(
                        o.is_some(),
                        taken == HELLO_LEN + PROOF_LEN,
                        "outcome {o:?} after {taken} bytes"
                    );
                    if o.is_some() {
                        assert_eq!(hs.wants(), 0);
                        outcome = o;
                    }
                    if rest.is_empty() {
                        break;
                    }
                }
                Err(e) => {
                    assert!(!e.is_empty());
                    // Only a malformed hello is an error; the challenge was never sent.
                    assert!(taken < HELLO_LEN, "error {e:?} after a well-formed hello");
                    assert!(out.is_empty(), "answered a malformed hello");
                    let seen = &stream[..(taken + rest.len()).min(HELLO_LEN)];
                    let magic_ok = seen.iter().zip(&wire::MAGIC).all(|(a, b)| a == b);
                    if magic_ok {
                        assert!(
                            seen.len() == HELLO_LEN,
                            "refused a good magic before the whole hello: {e}"
                        );
                        let hello: &[u8; HELLO_LEN] = seen.try_into().unwrap();
                        assert!(
                            wire::decode_hello(hello).is_err(),
                            "refused a well-formed hello: {e}"
                        );
                    }
                    assert!(!honest, "refused an honest hello: {e}");
                    return Ok(());
                }
            }
        }
    }

    if taken < HELLO_LEN {
        assert!(out.is_empty());
        assert!(!hs.said_hello());
        assert!(!honest);
        return Ok(());
    }
    let hello: &[u8; HELLO_LEN] = stream[..HELLO_LEN].try_into().unwrap();
    let kind = wire::decode_hello(hello).expect("the server went on after a malformed hello");
    let client_nonce = wire::hello_nonce(hello);
    assert!(out.len() >= CHALLENGE_LEN);
    let challenge = &out[..CHALLENGE_LEN];
    assert_eq!(challenge[..4], CHALLENGE_MAGIC);
    assert_eq!(challenge[4..6], PROTOCOL_VERSION.to_le_bytes());
    assert_eq!(challenge[6], u8::from(token.is_some()));
    assert_eq!(challenge[7], 0);
    assert_eq!(challenge[8..40], server_nonce);
    assert_eq!(
        challenge[40..72],
        proof(
            token,
            b"multirail-server\0",
            kind,
            &client_nonce,
            &server_nonce
        )
    );
    let Some(outcome) = outcome else {
        assert_eq!(out.len(), CHALLENGE_LEN);
        assert!(!honest);
        return Ok(());
    };
    assert_eq!(out.len(), CHALLENGE_LEN + VERDICT_LEN);
    let sent = &stream[HELLO_LEN..HELLO_LEN + PROOF_LEN];
    let right = token.is_none()
        || sent
            == proof(
                token,
                b"multirail-client\0",
                kind,
                &server_nonce,
                &client_nonce,
            );
    match &outcome {
        Outcome::Accepted(k) => {
            assert!(right, "accepted a wrong proof");
            assert_eq!(*k, kind);
        }
        Outcome::Refused(r) => {
            assert!(!right, "refused the right proof: {r}");
        }
    }
    assert_eq!(out[CHALLENGE_LEN..], [0xA7, u8::from(!right), 0, 0]);
    if honest {
        assert_eq!(outcome, Outcome::Accepted(kind));
        assert_eq!(
            taken,
            stream.len() - 1,
            "the byte after the proof was taken"
        );
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
