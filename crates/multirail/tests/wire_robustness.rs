//! Bad bytes from the wire close that connection and never take the engine down, on either
//! side of a transfer.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use multirail::segment::{BufferDescriptor, SegmentDescriptor, PROTOCOL_VERSION};
use multirail::transport::handshake::{self, Membership, Outcome, ServerHandshake};
use multirail::transport::wire::{self, ConnKind, RequestHeader, RequestOp};
use multirail::{Config, Engine, Error, Location, Request, TransportChoice};

/// A connection to `target` that has passed the handshake as an open (tokenless) member.
fn member(target: &Engine, kind: ConnKind) -> TcpStream {
    let s = TcpStream::connect(target.name()).unwrap();
    handshake::client(
        &s,
        kind,
        &Membership::open(),
        &target.name(),
        Duration::from_secs(5),
    )
    .unwrap();
    s
}

/// The server's side of the handshake on a blocking stream; returns the connection's kind.
fn accept_member(s: &mut TcpStream) -> ConnKind {
    let mut hs = ServerHandshake::new(Membership::open(), handshake::nonce());
    let mut out = Vec::new();
    loop {
        let mut buf = vec![0u8; hs.wants()];
        s.read_exact(&mut buf).unwrap();
        let (_, outcome) = hs.on_bytes(&buf, &mut out).unwrap();
        s.write_all(&out).unwrap();
        out.clear();
        match outcome {
            Some(Outcome::Accepted(kind)) => return kind,
            Some(Outcome::Refused(r)) => panic!("refused: {r}"),
            None => {}
        }
    }
}

fn engine() -> Engine {
    Engine::new(Config::default(), "127.0.0.1:0").unwrap()
}

/// True once the peer has closed `s` (EOF or reset) within two seconds.
fn closed_by_peer(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::TimedOut
            }
        }
    }
}

fn still_serves(target: &Engine) {
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let init = engine();
    let src = init.allocate(1 << 20, Location::Any).unwrap();
    let seg = init.open_segment(&target.name()).unwrap();
    let batch = init.allocate_batch(1).unwrap();
    let r = Request {
        transport: Some(TransportChoice::Tcp),
        ..Request::write(src.addr(), seg, dst.addr(), 1 << 20)
    };
    init.submit(batch, &[r]).unwrap();
    init.wait(batch, Some(Duration::from_secs(10))).unwrap();
}

#[test]
fn target_closes_connections_that_send_garbage() {
    let target = engine();
    let buf = target.allocate(4096, Location::Any).unwrap();

    let mut bad_magic = TcpStream::connect(target.name()).unwrap();
    bad_magic.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(closed_by_peer(&mut bad_magic));

    let mut bad_version = TcpStream::connect(target.name()).unwrap();
    let mut hello = wire::encode_hello(ConnKind::Data);
    hello[4] = 0xEE;
    bad_version.write_all(&hello).unwrap();
    assert!(closed_by_peer(&mut bad_version));

    let mut bad_op = member(&target, ConnKind::Data);
    let mut frame = [0u8; wire::REQUEST_LEN];
    RequestHeader {
        op: RequestOp::Write,
        len: 16,
        id: 0,
        addr: buf.addr(),
        key: buf.key(),
        priority: multirail::Priority::High,
    }
    .encode(&mut frame);
    frame[0] = 77;
    bad_op.write_all(&frame).unwrap();
    assert!(closed_by_peer(&mut bad_op));

    let mut bad_priority = member(&target, ConnKind::Data);
    let mut unknown = frame;
    unknown[0] = RequestOp::Write as u8;
    unknown[1] = 9;
    bad_priority.write_all(&unknown).unwrap();
    assert!(closed_by_peer(&mut bad_priority));

    let mut huge = member(&target, ConnKind::Data);
    frame[0] = RequestOp::Write as u8;
    frame[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    huge.write_all(&frame).unwrap();
    assert!(closed_by_peer(&mut huge));

    let mut truncated = member(&target, ConnKind::Data);
    truncated.write_all(&frame[..10]).unwrap();
    drop(truncated);

    let mut bad_control = member(&target, ConnKind::Control);
    bad_control.write_all(&[42]).unwrap();
    assert!(closed_by_peer(&mut bad_control));

    still_serves(&target);
}

#[test]
fn target_refuses_wrong_key_and_out_of_bounds_without_closing() {
    let target = engine();
    let buf = target.allocate(4096, Location::Any).unwrap();
    let mut s = member(&target, ConnKind::Data);
    let mut frame = [0u8; wire::REQUEST_LEN];
    let mut resp = [0u8; wire::RESPONSE_LEN];
    let cases = [
        (buf.key() ^ 1, buf.addr(), 16u32, wire::Status::BadKey),
        (buf.key(), buf.addr() + 4090, 16, wire::Status::OutOfBounds),
        (buf.key(), 0x1000, 16, wire::Status::BadKey),
        (buf.key(), buf.addr(), 16, wire::Status::Ok),
    ];
    for (id, (key, addr, len, want)) in cases.into_iter().enumerate() {
        RequestHeader {
            op: RequestOp::Write,
            len,
            id: id as u64,
            addr,
            key,
            priority: multirail::Priority::Low,
        }
        .encode(&mut frame);
        s.write_all(&frame).unwrap();
        s.write_all(&vec![0xAB; len as usize]).unwrap();
        s.read_exact(&mut resp).unwrap();
        let r = wire::ResponseHeader::decode(&resp).unwrap();
        assert_eq!((r.id, r.status), (id as u64, want));
    }
    // Only the accepted write touched memory.
    // SAFETY: no transfer is in flight on `buf`.
    let bytes = unsafe { buf.as_slice() };
    assert!(bytes[..16].iter().all(|&b| b == 0xAB) && bytes[16..].iter().all(|&b| b == 0));
}

/// A fake target that answers the descriptor query properly and then sends garbage on data
/// connections: the initiator's requests fail with a protocol error, nothing panics or hangs.
#[test]
fn initiator_fails_requests_on_garbage_responses() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let name = addr.to_string();
    let descriptor = SegmentDescriptor {
        name: name.clone(),
        host_id: "another-host".into(),
        pid: 1,
        protocol_version: PROTOCOL_VERSION,
        rails: vec![],
        rdma: vec![],
        buffers: vec![BufferDescriptor {
            addr: 0x10000,
            len: 1 << 20,
            key: 7,
            location: Location::Any,
            shm: None,
            rkeys: vec![],
            access: None,
        }],
        segment_name: None,
        members_only: false,
        groups: Vec::new(),
    };
    let json = serde_json::to_vec(&descriptor).unwrap();
    // Each connection is served on its own thread: the initiator opens all of its data
    // connections, each waiting for its handshake, before it posts a slice.
    let fake = std::thread::spawn(move || {
        listener.set_nonblocking(true).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(4);
        let mut served = Vec::new();
        while std::time::Instant::now() < deadline {
            let (mut s, _) = match listener.accept() {
                Ok(x) => x,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            s.set_nonblocking(false).unwrap();
            let json = json.clone();
            served.push(std::thread::spawn(move || match accept_member(&mut s) {
                ConnKind::Control => {
                    let mut op = [0u8; 1];
                    s.read_exact(&mut op).unwrap();
                    s.write_all(&(json.len() as u32).to_le_bytes()).unwrap();
                    s.write_all(&json).unwrap();
                    let _ = s.read(&mut op);
                }
                ConnKind::Data => {
                    let mut frame = [0u8; wire::REQUEST_LEN];
                    if s.read_exact(&mut frame).is_ok() {
                        let _ = s.write_all(&[0xFF; wire::RESPONSE_LEN]);
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
                other => panic!("unexpected connection kind {other:?}"),
            }));
        }
        for t in served {
            t.join().unwrap();
        }
    });
    let conf = r#"{"transports": {"tcp": {"connections_per_rail": 2}}}"#;
    let init = Engine::new(Config::from_json_str(conf, "test").unwrap(), "127.0.0.1:0").unwrap();
    let src = init.allocate(4096, Location::Any).unwrap();
    let seg = init.open_segment(&name).unwrap();
    let batch = init.allocate_batch(2).unwrap();
    let r = Request::write(src.addr(), seg, 0x10000, 4096);
    init.submit(batch, &[r, r]).unwrap();
    let err = init.wait(batch, Some(Duration::from_secs(10))).unwrap_err();
    assert!(
        matches!(err, Error::Protocol { .. } | Error::PeerDisconnected { .. }),
        "{err}"
    );
    fake.join().unwrap();
}
