//! The opening of every connection: a hello, then a challenge-response that lets in only engines
//! holding the cluster's membership token (`auth.token` or `MULTIRAIL_TOKEN`).
//!
//! ```text
//! client -> server  hello      40 B  "MRAL", version u16, kind u8, flags u8, client nonce [32]
//! server -> client  challenge  72 B  "MRAC", version u16, auth u8, 0, server nonce [32], server proof [32]
//! client -> server  proof      32 B  client proof
//! server -> client  verdict     4 B  0xA7, status u8 (0 accepted, 1 refused), 0, 0
//! ```
//!
//! With a token, `server proof = HMAC-SHA256(token, "multirail-server\0" ‖ kind ‖ client nonce ‖
//! server nonce)` and `client proof = HMAC-SHA256(token, "multirail-client\0" ‖ kind ‖ server nonce
//! ‖ client nonce)`: each side proves it holds the token over a nonce the other chose, so neither
//! a recorded exchange nor a reflected proof opens a connection, and the token itself never
//! crosses the wire. Without a token (`auth` 0) both proofs are zeros. A client holding a token
//! refuses a server that does not prove it (a server without a token, or with another one):
//! membership runs both ways, so a member never sends bytes to, or takes bytes from, an outsider.
//! Nothing the connection is for (descriptor, key, slice, message) is served before the verdict.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};
use crate::protocol::wire::{self, ConnKind};

/// Bytes of a nonce and of a proof.
pub const NONCE_LEN: usize = 32;
/// Size of the server's challenge.
pub const CHALLENGE_LEN: usize = 72;
/// Size of the client's proof.
pub const PROOF_LEN: usize = 32;
/// Size of the server's verdict.
pub const VERDICT_LEN: usize = 4;
/// First bytes of a challenge.
pub const CHALLENGE_MAGIC: [u8; 4] = *b"MRAC";
const VERDICT_MARK: u8 = 0xA7;
const SERVER_LABEL: &[u8] = b"multirail-server\0";
const CLIENT_LABEL: &[u8] = b"multirail-client\0";

/// The shared secret that makes an engine a member, or none (anyone may connect).
///
/// Its `Debug` never shows the token, so it cannot reach a log through a `{:?}`.
#[derive(Clone, Default)]
pub struct Membership {
    token: Option<Arc<[u8]>>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.token {
            Some(_) => f.write_str("Membership(token: <redacted>)"),
            None => f.write_str("Membership(open)"),
        }
    }
}

impl Membership {
    /// Anyone who speaks the protocol gets in.
    pub fn open() -> Self {
        Membership { token: None }
    }

    /// Only engines holding `token` get in.
    pub fn with_token(token: &[u8]) -> Self {
        Membership {
            token: Some(token.into()),
        }
    }

    /// True when a token is required.
    pub fn is_required(&self) -> bool {
        self.token.is_some()
    }

    /// The MAC over one side's proof input, or `None` without a token.
    fn mac(
        &self,
        label: &[u8],
        kind: ConnKind,
        first: &[u8],
        second: &[u8],
    ) -> Option<Hmac<Sha256>> {
        let token = self.token.as_ref()?;
        let mut mac = Hmac::<Sha256>::new_from_slice(token).expect("HMAC takes keys of any size");
        mac.update(label);
        mac.update(&[kind as u8]);
        mac.update(first);
        mac.update(second);
        Some(mac)
    }

    fn proof(&self, label: &[u8], kind: ConnKind, first: &[u8], second: &[u8]) -> [u8; 32] {
        self.mac(label, kind, first, second)
            .map_or([0; 32], |m| m.finalize().into_bytes().into())
    }

    /// Checks `proof` in constant time; anything passes without a token.
    fn verify(
        &self,
        label: &[u8],
        kind: ConnKind,
        first: &[u8],
        second: &[u8],
        proof: &[u8],
    ) -> bool {
        match self.mac(label, kind, first, second) {
            Some(m) => m.verify_slice(proof).is_ok(),
            None => true,
        }
    }
}

/// A fresh random nonce from the operating system.
pub fn nonce() -> [u8; NONCE_LEN] {
    use rand::RngCore;
    let mut n = [0u8; NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// How a server-side handshake ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The client proved membership (or none is required): serve a connection of this kind.
    Accepted(ConnKind),
    /// The client did not prove membership; the verdict telling it so is in the output.
    Refused(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Hello,
    Proof,
    Done,
}

/// The server's side of the handshake, without I/O: feed it what arrives with
/// [`on_bytes`](Self::on_bytes), send what it puts in `out`, and serve the connection once it
/// reports [`Outcome::Accepted`]. A malformed hello is an error (close without answering).
pub struct ServerHandshake {
    membership: Membership,
    server_nonce: [u8; NONCE_LEN],
    client_nonce: [u8; NONCE_LEN],
    kind: ConnKind,
    stage: Stage,
    buf: [u8; wire::HELLO_LEN],
    have: usize,
}

impl ServerHandshake {
    /// A handshake that will challenge the client with `server_nonce` (use [`nonce`]).
    pub fn new(membership: Membership, server_nonce: [u8; NONCE_LEN]) -> Self {
        ServerHandshake {
            membership,
            server_nonce,
            client_nonce: [0; NONCE_LEN],
            kind: ConnKind::Control,
            stage: Stage::Hello,
            buf: [0; wire::HELLO_LEN],
            have: 0,
        }
    }

    /// True once the client has sent a well-formed hello (it speaks the protocol).
    pub fn said_hello(&self) -> bool {
        self.stage != Stage::Hello
    }

    /// Bytes the handshake still needs before it can say more (0 once it is over), so a
    /// server can read exactly that much and leave what follows in the socket.
    pub fn wants(&self) -> usize {
        match self.stage {
            Stage::Hello => wire::HELLO_LEN - self.have,
            Stage::Proof => PROOF_LEN - self.have,
            Stage::Done => 0,
        }
    }

    /// Takes bytes from `input` (never more than the handshake needs: what follows belongs to
    /// the connection's own protocol) and appends what to send to `out`. Returns how many
    /// bytes it took and the outcome once there is one. Fails on a malformed hello, naming
    /// what is wrong, and on bytes fed after the outcome.
    pub fn on_bytes(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> std::result::Result<(usize, Option<Outcome>), String> {
        let need = match self.stage {
            Stage::Hello => wire::HELLO_LEN,
            Stage::Proof => PROOF_LEN,
            Stage::Done => return Err("handshake already finished".into()),
        };
        let take = (need - self.have).min(input.len());
        self.buf[self.have..self.have + take].copy_from_slice(&input[..take]);
        self.have += take;
        if self.stage == Stage::Hello {
            // Something that is not a multirail engine (an HTTP probe, a port scanner) is
            // turned away at its first bytes, not after a full hello's worth.
            let seen = self.have.min(wire::MAGIC.len());
            if self.buf[..seen] != wire::MAGIC[..seen] {
                return Err(format!("bad magic {:02x?}", &self.buf[..seen]));
            }
        }
        if self.have < need {
            return Ok((take, None));
        }
        self.have = 0;
        match self.stage {
            Stage::Hello => {
                let hello: &[u8; wire::HELLO_LEN] = &self.buf;
                self.kind = wire::decode_hello(hello)?;
                self.client_nonce = wire::hello_nonce(hello);
                let mut challenge = [0u8; CHALLENGE_LEN];
                challenge[..4].copy_from_slice(&CHALLENGE_MAGIC);
                challenge[4..6].copy_from_slice(&crate::segment::PROTOCOL_VERSION.to_le_bytes());
                challenge[6] = u8::from(self.membership.is_required());
                challenge[8..40].copy_from_slice(&self.server_nonce);
                let proof = self.membership.proof(
                    SERVER_LABEL,
                    self.kind,
                    &self.client_nonce,
                    &self.server_nonce,
                );
                challenge[40..72].copy_from_slice(&proof);
                out.extend_from_slice(&challenge);
                self.stage = Stage::Proof;
                Ok((take, None))
            }
            Stage::Proof => {
                self.stage = Stage::Done;
                let ok = self.membership.verify(
                    CLIENT_LABEL,
                    self.kind,
                    &self.server_nonce,
                    &self.client_nonce,
                    &self.buf[..PROOF_LEN],
                );
                out.extend_from_slice(&[VERDICT_MARK, u8::from(!ok), 0, 0]);
                let outcome = if ok {
                    Outcome::Accepted(self.kind)
                } else {
                    Outcome::Refused("membership proof missing or wrong".into())
                };
                Ok((take, Some(outcome)))
            }
            Stage::Done => unreachable!("checked above"),
        }
    }
}

/// `bytes` as text when they are printable ASCII (what an HTTP server or an SSH daemon sends
/// first), else as hex.
fn printable(bytes: &[u8]) -> String {
    if bytes.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        format!("{:?}", String::from_utf8_lossy(bytes))
    } else {
        format!("{bytes:02x?}")
    }
}

/// Parsed server challenge.
struct Challenge {
    auth: bool,
    server_nonce: [u8; NONCE_LEN],
    proof: [u8; 32],
}

fn decode_challenge(b: &[u8; CHALLENGE_LEN]) -> std::result::Result<Challenge, String> {
    if b[..4] != CHALLENGE_MAGIC {
        return Err(format!(
            "it is not a multirail engine: its first bytes {} are not a handshake's",
            printable(&b[..4])
        ));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != crate::segment::PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {version}, this engine speaks {}",
            crate::segment::PROTOCOL_VERSION
        ));
    }
    let auth = match b[6] {
        0 => false,
        1 => true,
        a => return Err(format!("unknown authentication scheme {a}")),
    };
    Ok(Challenge {
        auth,
        server_nonce: b[8..40].try_into().expect("32 bytes"),
        proof: b[40..72].try_into().expect("32 bytes"),
    })
}

/// Runs the client's side of the handshake on a connected blocking `stream`, waiting at most
/// `timeout` for each answer (the read timeout is cleared again on success).
///
/// Fails with [`Error::NotAMember`] when either side cannot prove membership (this engine has no
/// token but the peer requires one, the tokens differ, or the peer has none but this engine
/// requires one), and with [`Error::SegmentUnreachable`] when the peer does not answer in time
/// or closes the connection, or [`Error::Protocol`] on a malformed answer.
pub fn client(
    stream: &TcpStream,
    kind: ConnKind,
    membership: &Membership,
    peer: &str,
    timeout: Duration,
) -> Result<()> {
    let unreachable = |what: &str, e: std::io::Error| Error::SegmentUnreachable {
        name: peer.to_owned(),
        reason: if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            format!("{what}: no answer within {} ms", timeout.as_millis())
        } else {
            format!("{what}: {e}")
        },
    };
    let mut s = stream;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| unreachable("handshake", e))?;
    let client_nonce = nonce();
    s.write_all(&wire::encode_hello_with_nonce(kind, &client_nonce))
        .map_err(|e| unreachable("sending hello", e))?;
    let mut raw = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut raw)
        .map_err(|e| unreachable("waiting for the handshake challenge", e))?;
    let challenge = decode_challenge(&raw).map_err(|reason| Error::Protocol {
        peer: peer.to_owned(),
        reason,
    })?;
    let not_member = |reason: &str| Error::NotAMember {
        peer: peer.to_owned(),
        reason: reason.to_owned(),
    };
    if membership.is_required() {
        if !challenge.auth {
            return Err(not_member(
                "it accepts anyone (it has no membership token) but this engine requires one",
            ));
        }
        if !membership.verify(
            SERVER_LABEL,
            kind,
            &client_nonce,
            &challenge.server_nonce,
            &challenge.proof,
        ) {
            return Err(not_member(
                "it could not prove the membership token: the tokens differ",
            ));
        }
    }
    let proof = membership.proof(CLIENT_LABEL, kind, &challenge.server_nonce, &client_nonce);
    s.write_all(&proof)
        .map_err(|e| unreachable("sending membership proof", e))?;
    let mut verdict = [0u8; VERDICT_LEN];
    s.read_exact(&mut verdict)
        .map_err(|e| unreachable("waiting for the handshake verdict", e))?;
    if verdict[0] != VERDICT_MARK {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("bad verdict marker {:#04x}", verdict[0]),
        });
    }
    match verdict[1] {
        0 => {}
        1 if membership.is_required() => {
            return Err(not_member("it refused this engine's membership proof"))
        }
        1 => {
            return Err(not_member(
                "it requires a membership token (auth.token or MULTIRAIL_TOKEN) and this engine has none",
            ))
        }
        v => {
            return Err(Error::Protocol {
                peer: peer.to_owned(),
                reason: format!("unknown verdict {v}"),
            })
        }
    }
    s.set_read_timeout(None)
        .map_err(|e| unreachable("handshake", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Drives a server handshake over a real socket pair so the client code runs unchanged.
    fn run(server: Membership, client_side: Membership) -> (Result<()>, Option<Outcome>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut hs = ServerHandshake::new(server, nonce());
            let mut out = Vec::new();
            let mut buf = [0u8; 64];
            loop {
                let n = match s.read(&mut buf) {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => n,
                };
                let mut at = 0;
                while at < n {
                    let (took, outcome) = hs.on_bytes(&buf[at..n], &mut out).unwrap();
                    at += took;
                    s.write_all(&out).unwrap();
                    out.clear();
                    if outcome.is_some() {
                        return outcome;
                    }
                }
            }
        });
        let stream = TcpStream::connect(addr).unwrap();
        let r = client(
            &stream,
            ConnKind::Data,
            &client_side,
            "test-peer",
            Duration::from_secs(5),
        );
        drop(stream);
        (r, t.join().unwrap())
    }

    #[test]
    fn open_server_and_open_client_agree() {
        let (r, o) = run(Membership::open(), Membership::open());
        r.unwrap();
        assert_eq!(o, Some(Outcome::Accepted(ConnKind::Data)));
    }

    #[test]
    fn same_token_gets_in() {
        let (r, o) = run(
            Membership::with_token(b"s3cret"),
            Membership::with_token(b"s3cret"),
        );
        r.unwrap();
        assert_eq!(o, Some(Outcome::Accepted(ConnKind::Data)));
    }

    #[test]
    fn missing_token_is_refused_at_both_ends() {
        let (r, o) = run(Membership::with_token(b"s3cret"), Membership::open());
        let e = r.unwrap_err();
        assert!(matches!(e, Error::NotAMember { .. }), "{e}");
        assert!(e.to_string().contains("requires a membership token"), "{e}");
        assert!(matches!(o, Some(Outcome::Refused(_))), "{o:?}");
    }

    #[test]
    fn wrong_token_is_refused_before_any_proof_is_sent() {
        let (r, o) = run(
            Membership::with_token(b"s3cret"),
            Membership::with_token(b"guess"),
        );
        let e = r.unwrap_err();
        assert!(e.to_string().contains("tokens differ"), "{e}");
        // The client hung up instead of sending a proof: the server has no outcome.
        assert_eq!(o, None);
    }

    #[test]
    fn a_member_refuses_an_open_server() {
        let (r, _) = run(Membership::open(), Membership::with_token(b"s3cret"));
        let e = r.unwrap_err();
        assert!(e.to_string().contains("accepts anyone"), "{e}");
    }

    #[test]
    fn a_replayed_proof_does_not_open_another_connection() {
        let token = Membership::with_token(b"s3cret");
        let client_nonce = [7u8; NONCE_LEN];
        let mut first = ServerHandshake::new(token.clone(), [1u8; NONCE_LEN]);
        let mut out = Vec::new();
        let hello = wire::encode_hello_with_nonce(ConnKind::Data, &client_nonce);
        first.on_bytes(&hello, &mut out).unwrap();
        let proof = token.proof(
            CLIENT_LABEL,
            ConnKind::Data,
            &[1u8; NONCE_LEN],
            &client_nonce,
        );
        let (_, o) = first.on_bytes(&proof, &mut out).unwrap();
        assert_eq!(o, Some(Outcome::Accepted(ConnKind::Data)));
        // Same hello and proof against a server that picked another nonce.
        let mut second = ServerHandshake::new(token, [2u8; NONCE_LEN]);
        second.on_bytes(&hello, &mut out).unwrap();
        let (_, o) = second.on_bytes(&proof, &mut out).unwrap();
        assert!(matches!(o, Some(Outcome::Refused(_))), "{o:?}");
    }

    #[test]
    fn bytes_after_the_proof_are_left_for_the_connection() {
        let mut hs = ServerHandshake::new(Membership::open(), nonce());
        let mut input = wire::encode_hello_with_nonce(ConnKind::Control, &[0; 32]).to_vec();
        input.extend_from_slice(&[0u8; PROOF_LEN]);
        input.push(wire::CONTROL_GET_DESCRIPTOR);
        let mut out = Vec::new();
        let (a, _) = hs.on_bytes(&input, &mut out).unwrap();
        let (b, o) = hs.on_bytes(&input[a..], &mut out).unwrap();
        assert_eq!(a + b, input.len() - 1);
        assert_eq!(o, Some(Outcome::Accepted(ConnKind::Control)));
        assert_eq!(out.len(), CHALLENGE_LEN + VERDICT_LEN);
        assert!(hs.on_bytes(&[1], &mut out).is_err());
    }

    #[test]
    fn an_answer_from_something_else_says_it_is_not_a_multirail_engine() {
        let mut http = [b' '; CHALLENGE_LEN];
        http[..15].copy_from_slice(b"HTTP/1.1 400 Ba");
        let e = decode_challenge(&http).err().expect("not a challenge");
        assert!(e.contains("not a multirail engine"), "{e}");
        assert!(e.contains("\"HTTP\""), "{e}");
        let e = decode_challenge(&[0xffu8; CHALLENGE_LEN])
            .err()
            .expect("not a challenge");
        assert!(e.contains("[ff, ff, ff, ff]"), "{e}");
    }

    #[test]
    fn a_malformed_hello_is_an_error() {
        let mut hs = ServerHandshake::new(Membership::open(), nonce());
        let mut out = Vec::new();
        let e = hs.on_bytes(&[b'G'; wire::HELLO_LEN], &mut out).unwrap_err();
        assert!(e.contains("magic"), "{e}");
        assert!(out.is_empty());
    }

    #[test]
    fn debug_never_shows_the_token() {
        let m = Membership::with_token(b"hunter2-token");
        assert!(!format!("{m:?}").contains("hunter2"));
    }
}
