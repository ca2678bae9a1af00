//! Only engines holding the cluster's token get in; the listening port bounds what strangers and
//! idle clients can hold.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use multirail::transport::handshake::{self, Membership, CHALLENGE_LEN, PROOF_LEN, VERDICT_LEN};
use multirail::transport::wire::{self, ConnKind, RequestHeader, RequestOp};
use multirail::{Config, Engine, Error, Location, Request, TransportChoice};

const TOKEN: &str = "correct-horse-battery-staple";

fn engine(conf: &str) -> Engine {
    Engine::new(Config::from_json_str(conf, "test").unwrap(), "127.0.0.1:0").unwrap()
}

fn with_token(token: &str) -> Engine {
    engine(&format!(r#"{{"auth": {{"token": "{token}"}}}}"#))
}

fn fill(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

/// Writes a pattern to `target` over tcp, reads it back into another buffer, compares.
fn round_trip(init: &Engine, target: &Engine, len: usize) -> multirail::Result<()> {
    let dst = target.allocate(len, Location::Any).unwrap();
    let src = init.allocate(len, Location::Any).unwrap();
    let back = init.allocate(len, Location::Any).unwrap();
    // SAFETY: nothing is in flight on `src` yet.
    fill(unsafe { src.as_mut_slice() }, 7);
    let seg = init.open_segment(&target.name())?;
    let tcp = |r: Request| Request {
        transport: Some(TransportChoice::Tcp),
        ..r
    };
    let batch = init.allocate_batch(1)?;
    init.submit(
        batch,
        &[tcp(Request::write(src.addr(), seg, dst.addr(), len as u64))],
    )?;
    init.wait(batch, Some(Duration::from_secs(10)))?;
    init.free_batch(batch)?;
    let batch = init.allocate_batch(1)?;
    init.submit(
        batch,
        &[tcp(Request::read(back.addr(), seg, dst.addr(), len as u64))],
    )?;
    init.wait(batch, Some(Duration::from_secs(10)))?;
    init.free_batch(batch)?;
    // SAFETY: both transfers finished.
    unsafe {
        assert!(
            src.as_slice() == back.as_slice(),
            "bytes differ after the round trip"
        )
    };
    Ok(())
}

#[test]
fn members_holding_the_same_token_move_bytes() {
    let target = with_token(TOKEN);
    let init = with_token(TOKEN);
    round_trip(&init, &target, 8 << 20).unwrap();
    assert_eq!(target.connection_stats().not_members, 0);
}

#[test]
fn an_engine_without_the_token_gets_no_descriptor_and_moves_no_byte() {
    let target = with_token(TOKEN);
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let outsider = engine("{}");
    let err = outsider.open_segment(&target.name()).unwrap_err();
    assert!(matches!(err, Error::NotAMember { .. }), "{err}");
    assert!(
        err.to_string().contains("requires a membership token"),
        "{err}"
    );
    assert!(target.connection_stats().not_members >= 1);
    // SAFETY: nothing writes to `dst`.
    assert!(unsafe { dst.as_slice() }.iter().all(|&b| b == 0));
}

#[test]
fn a_wrong_token_is_refused_at_both_ends() {
    let target = with_token(TOKEN);
    let outsider = with_token("a-different-token-entirely");
    let err = outsider.open_segment(&target.name()).unwrap_err();
    assert!(err.to_string().contains("tokens differ"), "{err}");
    // The outsider hung up without a proof: the target counted it as refused.
    let deadline = Instant::now() + Duration::from_secs(2);
    while target.connection_stats().not_members == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(target.connection_stats().not_members >= 1);
}

#[test]
fn a_member_does_not_talk_to_an_engine_that_lets_anyone_in() {
    let open = engine("{}");
    let member = with_token(TOKEN);
    let err = member.open_segment(&open.name()).unwrap_err();
    assert!(err.to_string().contains("accepts anyone"), "{err}");
}

/// A raw client that skips the proof gets a refusal and then nothing: its slice is not served
/// and no byte lands.
#[test]
fn a_stranger_speaking_the_wire_protocol_is_refused_before_any_slice() {
    let target = with_token(TOKEN);
    let dst = target.allocate(4096, Location::Any).unwrap();
    let mut s = TcpStream::connect(target.name()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.write_all(&wire::encode_hello(ConnKind::Data)).unwrap();
    let mut challenge = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut challenge).unwrap();
    assert_eq!(challenge[6], 1, "the challenge says a token is required");
    s.write_all(&[0u8; PROOF_LEN]).unwrap();
    let mut verdict = [0u8; VERDICT_LEN];
    s.read_exact(&mut verdict).unwrap();
    assert_eq!(verdict[1], 1, "refused");
    let mut frame = [0u8; wire::REQUEST_LEN];
    RequestHeader {
        op: RequestOp::Write,
        len: 16,
        id: 0,
        addr: dst.addr(),
        key: dst.key(),
        priority: multirail::Priority::High,
    }
    .encode(&mut frame);
    // The target closes after the verdict; these bytes go nowhere.
    let _ = s.write_all(&frame);
    let _ = s.write_all(&[0xAB; 16]);
    let mut rest = [0u8; 16];
    assert!(matches!(s.read(&mut rest), Ok(0) | Err(_)));
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: nothing writes to `dst`.
    assert!(unsafe { dst.as_slice() }.iter().all(|&b| b == 0));
    assert!(target.connection_stats().not_members >= 1);
}

#[test]
fn the_token_never_shows_in_the_descriptor_config_or_debug_output() {
    let target = with_token(TOKEN);
    target.allocate(4096, Location::Any).unwrap();
    let descriptor = serde_json::to_string(&target.local_descriptor()).unwrap();
    assert!(!descriptor.contains(TOKEN));
    let shown = target.config().to_json_pretty();
    assert!(
        !shown.contains(TOKEN) && shown.contains("<redacted>"),
        "{shown}"
    );
    assert!(!format!("{:?}", target.config()).contains(TOKEN));
    // What `config show` prints cannot be fed back as a token by mistake.
    let err = Config::from_json_str(&shown, "shown").unwrap_err();
    assert_eq!(err.key, "auth.token");
}

#[test]
fn a_short_token_is_a_config_error_naming_the_key() {
    let err = Config::from_json_str(r#"{"auth": {"token": "short"}}"#, "t").unwrap_err();
    assert_eq!(err.key, "auth.token");
    assert!(!err.message.contains("short"), "the token is not echoed");
}

/// Connections that never finish the handshake are capped and closed at their deadline; a
/// member gets in beside them.
#[test]
fn unproven_connections_are_capped_and_closed_at_their_deadline() {
    let target = engine(
        r#"{"transports": {"tcp": {"max_pending_connections": 8, "connect_timeout_ms": 400}}}"#,
    );
    let idle: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(target.name()).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(2);
    while target.connection_stats().accepted < 20 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let stats = target.connection_stats();
    assert!(stats.pending <= 8, "{stats:?}");
    assert!(stats.shed_pending >= 12, "{stats:?}");
    round_trip(&engine("{}"), &target, 1 << 20).unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let stats = target.connection_stats();
    assert_eq!(stats.pending, 0, "{stats:?}");
    drop(idle);
}

/// Past `max_connections` a new connection is closed at once; the members already in keep
/// working.
#[test]
fn connections_past_max_connections_are_refused() {
    let target = engine(r#"{"transports": {"tcp": {"max_connections": 16}}}"#);
    let open = Membership::open();
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..24 {
        let s = TcpStream::connect(target.name()).unwrap();
        match handshake::client(&s, ConnKind::Data, &open, "target", Duration::from_secs(2)) {
            Ok(()) => held.push(s),
            Err(_) => refused += 1,
        }
    }
    let stats = target.connection_stats();
    assert_eq!(held.len(), 16, "{stats:?}");
    assert_eq!(refused, 8);
    assert!(stats.refused_full >= 8, "{stats:?}");
    assert_eq!(stats.open, 16, "{stats:?}");
    drop(held);
    // Closed connections free their places.
    let deadline = Instant::now() + Duration::from_secs(2);
    while target.connection_stats().open > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    round_trip(&engine("{}"), &target, 1 << 20).unwrap();
}

/// With a metadata store, a descriptor reaches anyone who asks the store, not only members; and
/// shared memory opens no connection whose handshake would refuse them. So before an engine
/// reaches a same-host peer's memory over shm it proves membership over the peer's control
/// port, in both directions, whenever either side requires a token.
#[test]
fn a_descriptor_from_a_store_does_not_open_shared_memory_to_a_non_member() {
    let server = common::metadata_server_on("127.0.0.1:0");
    let store = |auth: &str| {
        engine(&format!(
            r#"{{"metadata": {{"type": "http", "servers": "{}"}}{auth}}}"#,
            server.url()
        ))
    };
    let member_auth = format!(r#", "auth": {{"token": "{TOKEN}"}}"#);
    let target = store(&member_auth);
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let open_target = store("");
    let open_dst = open_target.allocate(1 << 20, Location::Any).unwrap();

    let write = |init: &Engine, target: &Engine, dst: u64, transport: Option<TransportChoice>| {
        let src = init.allocate(1 << 20, Location::Any).unwrap();
        // SAFETY: nothing is in flight on `src`.
        fill(unsafe { src.as_mut_slice() }, 3);
        let seg = init.open_segment(&target.name())?;
        let batch = init.allocate_batch(1)?;
        let submitted = init.submit(
            batch,
            &[Request {
                transport,
                ..Request::write(src.addr(), seg, dst, 1 << 20)
            }],
        );
        let done = submitted.and_then(|()| init.wait(batch, Some(Duration::from_secs(10))));
        init.free_batch(batch)?;
        done
    };
    for transport in [None, Some(TransportChoice::Shm)] {
        // No token, and a wrong one, against a member.
        for outsider in [
            store(""),
            store(r#", "auth": {"token": "a-different-token-entirely"}"#),
        ] {
            let err = write(&outsider, &target, dst.addr(), transport).unwrap_err();
            assert!(
                matches!(err, Error::NotAMember { .. }),
                "{transport:?}: {err}"
            );
        }
        // A member against an engine that lets anyone in.
        let err = write(
            &store(&member_auth),
            &open_target,
            open_dst.addr(),
            transport,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("accepts anyone"),
            "{transport:?}: {err}"
        );
    }
    // SAFETY: nothing wrote to either buffer.
    assert!(unsafe { dst.as_slice() }.iter().all(|&b| b == 0));
    assert!(unsafe { open_dst.as_slice() }.iter().all(|&b| b == 0));
    assert!(target.connection_stats().not_members >= 2);

    // A member still moves its bytes over shm, proving membership once.
    let member = store(&member_auth);
    write(&member, &target, dst.addr(), Some(TransportChoice::Shm)).unwrap();
    write(&member, &target, dst.addr(), None).unwrap();
    // SAFETY: the writes finished.
    let landed = unsafe { dst.as_slice() };
    let mut want = vec![0u8; 1 << 20];
    fill(&mut want, 3);
    assert!(landed == &want[..], "the member's bytes landed");
}
