//! Regression tests beside the fuzz targets in `fuzz/` (run with `scripts/fuzz`): each feeds the
//! same decoder a target drives (wire frames, hello, server handshake, segment descriptor,
//! configuration) the inputs at its edges, boundary lengths and truncations, and any input a
//! fuzzer once crashed on, asserting an answer (Ok or an error) and never a panic.

use multirail::config::MAX_BLOCK_SIZE;
use multirail::segment::{BufferDescriptor, SegmentDescriptor, PROTOCOL_VERSION};
use multirail::transport::handshake::{
    Membership, Outcome, ServerHandshake, CHALLENGE_LEN, NONCE_LEN, PROOF_LEN, VERDICT_LEN,
};
use multirail::transport::wire::{
    self, ConnKind, MsgHeader, MsgKind, RequestHeader, RequestOp, ResponseHeader, Status,
    HELLO_LEN, MAX_SLICE_LEN, MSG_HEADER_LEN, REQUEST_LEN, RESPONSE_LEN,
};
use multirail::{Config, Location};

fn request(len: u32) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    RequestHeader {
        op: RequestOp::Read,
        len,
        id: u64::MAX,
        addr: u64::MAX,
        key: u64::MAX,
        priority: multirail::Priority::Low,
    }
    .encode(&mut b);
    b
}

#[test]
fn request_length_boundaries() {
    for len in [0, MAX_SLICE_LEN + 1, u32::MAX] {
        let b = request(len);
        let e = RequestHeader::decode(&b).unwrap_err();
        assert!(e.contains(&len.to_string()), "{e}");
    }
    for len in [1, MAX_SLICE_LEN] {
        assert_eq!(RequestHeader::decode(&request(len)).unwrap().len, len);
    }
}

#[test]
fn request_fields_outside_their_range_are_refused() {
    let good = request(4096);
    for (at, value) in [(0, 0u8), (0, 4), (0, 255), (1, 3), (1, 255)] {
        let mut b = good;
        b[at] = value;
        assert!(RequestHeader::decode(&b).is_err(), "byte {at} = {value}");
    }
    for priority in 0..=2 {
        let mut b = good;
        b[1] = priority;
        assert_eq!(
            RequestHeader::decode(&b).unwrap().priority.as_u8(),
            priority
        );
    }
}

#[test]
fn truncated_headers_are_errors_and_trailing_bytes_are_not_read() {
    let req = request(4096);
    let mut resp = [0u8; RESPONSE_LEN];
    ResponseHeader {
        status: Status::Ok,
        len: MAX_SLICE_LEN,
        id: 9,
    }
    .encode(&mut resp);
    let mut msg = [0u8; MSG_HEADER_LEN];
    MsgHeader {
        kind: MsgKind::Message,
        len: 8192,
    }
    .encode(&mut msg);
    for n in 0..REQUEST_LEN {
        assert!(RequestHeader::decode(&req[..n]).is_err(), "{n} bytes");
    }
    for n in 0..RESPONSE_LEN {
        assert!(ResponseHeader::decode(&resp[..n]).is_err(), "{n} bytes");
    }
    for n in 0..MSG_HEADER_LEN {
        assert!(MsgHeader::decode(&msg[..n], 8192).is_err(), "{n} bytes");
    }
    let mut longer = req.to_vec();
    longer.extend_from_slice(&[0xFF; 7]);
    assert_eq!(RequestHeader::decode(&longer), RequestHeader::decode(&req));
    let mut longer = resp.to_vec();
    longer.push(0xFF);
    assert_eq!(ResponseHeader::decode(&longer).unwrap().len, MAX_SLICE_LEN);
    let mut longer = msg.to_vec();
    longer.push(0xFF);
    assert_eq!(MsgHeader::decode(&longer, 8192).unwrap().len, 8192);
}

#[test]
fn response_boundaries() {
    let encode = |status, len| {
        let mut b = [0u8; RESPONSE_LEN];
        ResponseHeader { status, len, id: 1 }.encode(&mut b);
        b
    };
    assert_eq!(
        ResponseHeader::decode(&encode(Status::BadKey, 0))
            .unwrap()
            .status,
        Status::BadKey
    );
    assert!(ResponseHeader::decode(&encode(Status::Ok, MAX_SLICE_LEN)).is_ok());
    assert!(ResponseHeader::decode(&encode(Status::Ok, MAX_SLICE_LEN + 1)).is_err());
    let mut b = encode(Status::Ok, 1);
    b[0] = 0xA4;
    assert!(ResponseHeader::decode(&b).unwrap_err().contains("marker"));
    let mut b = encode(Status::Ok, 1);
    b[1] = 3;
    assert!(ResponseHeader::decode(&b).unwrap_err().contains("status"));
}

#[test]
fn message_header_limits() {
    let encode = |kind, len| {
        let mut b = [0u8; MSG_HEADER_LEN];
        MsgHeader { kind, len }.encode(&mut b);
        b
    };
    for kind in [
        MsgKind::Message,
        MsgKind::Notification,
        MsgKind::Lane,
        MsgKind::LaneAnswer,
        MsgKind::ReverseOpen,
        MsgKind::ReverseRefuse,
    ] {
        assert!(MsgHeader::decode(&encode(kind, 8192), 8192).is_ok());
        assert!(MsgHeader::decode(&encode(kind, 8193), 8192).is_err());
        assert!(MsgHeader::decode(&encode(kind, 0), 0).is_ok());
        assert!(MsgHeader::decode(&encode(kind, u32::MAX), u32::MAX).is_ok());
    }
    // Credits count buffers, not bytes: the receive-buffer limit does not apply.
    for kind in [MsgKind::Credit, MsgKind::ReverseAccept] {
        let h = MsgHeader::decode(&encode(kind, u32::MAX), 0).unwrap();
        assert_eq!((h.kind, h.len), (kind, u32::MAX));
    }
    for kind in [0u8, 10, 255] {
        let mut b = encode(MsgKind::Message, 1);
        b[4] = kind;
        assert!(MsgHeader::decode(&b, 8192).unwrap_err().contains("kind"));
    }
}

#[test]
fn hello_accepts_exactly_the_documented_hellos() {
    let nonce: [u8; NONCE_LEN] = std::array::from_fn(|i| i as u8 ^ 0x5A);
    for kind in [
        ConnKind::Control,
        ConnKind::Data,
        ConnKind::Message,
        ConnKind::Rdma,
    ] {
        let h = wire::encode_hello_with_nonce(kind, &nonce);
        assert_eq!(wire::decode_hello(&h), Ok(kind));
        assert_eq!(wire::hello_nonce(&h), nonce);
    }
    let good = wire::encode_hello_with_nonce(ConnKind::Data, &nonce);
    let refused = |at: usize, value: u8, what: &str| {
        let mut b = good;
        b[at] = value;
        let e = wire::decode_hello(&b).unwrap_err();
        assert!(e.contains(what), "byte {at} = {value}: {e}");
    };
    refused(0, b'm', "magic");
    refused(3, 0, "magic");
    refused(
        4,
        PROTOCOL_VERSION.to_le_bytes()[0].wrapping_add(1),
        "version",
    );
    refused(
        4,
        PROTOCOL_VERSION.to_le_bytes()[0].wrapping_sub(1),
        "version",
    );
    refused(5, 1, "version");
    refused(6, 0, "kind");
    refused(6, 5, "kind");
    refused(7, 1, "flags");
    refused(7, 0x80, "flags");
    assert!(wire::decode_hello(&[0; HELLO_LEN]).is_err());
    assert!(wire::decode_hello(&[0xFF; HELLO_LEN]).is_err());
}

/// Feeds `bytes` to a server handshake `chunk` bytes at a time, handing back what it does
/// not take, as a server does; returns what it sent, how much it took and how it ended.
fn handshake(
    membership: Membership,
    bytes: &[u8],
    chunk: usize,
) -> (Vec<u8>, usize, Result<Option<Outcome>, String>) {
    let mut hs = ServerHandshake::new(membership, [3; NONCE_LEN]);
    let mut out = Vec::new();
    let mut taken = 0;
    for piece in bytes.chunks(chunk) {
        let mut rest = piece;
        while !rest.is_empty() {
            match hs.on_bytes(rest, &mut out) {
                Ok((took, None)) => {
                    taken += took;
                    rest = &rest[took..];
                }
                Ok((took, Some(o))) => return (out, taken + took, Ok(Some(o))),
                Err(e) => return (out, taken, Err(e)),
            }
        }
    }
    (out, taken, Ok(None))
}

#[test]
fn handshake_in_any_chunking_ends_the_same() {
    let mut input = wire::encode_hello_with_nonce(ConnKind::Message, &[9; NONCE_LEN]).to_vec();
    input.extend_from_slice(&[0; PROOF_LEN]);
    input.extend_from_slice(b"connection bytes");
    for chunk in [1, 2, 3, 7, 31, 32, 39, 40, 41, 71, 72, 73, 1000] {
        let (out, taken, end) = handshake(Membership::open(), &input, chunk);
        assert_eq!(
            end,
            Ok(Some(Outcome::Accepted(ConnKind::Message))),
            "chunk {chunk}"
        );
        assert_eq!(taken, HELLO_LEN + PROOF_LEN, "chunk {chunk}");
        assert_eq!(out.len(), CHALLENGE_LEN + VERDICT_LEN, "chunk {chunk}");
        // A token-holding server refuses the all-zero proof whatever the chunking.
        let (out, _, end) = handshake(Membership::with_token(b"0123456789abcdef"), &input, chunk);
        assert!(
            matches!(end, Ok(Some(Outcome::Refused(_)))),
            "chunk {chunk}"
        );
        assert_eq!(out[CHALLENGE_LEN..], [0xA7, 1, 0, 0]);
    }
}

#[test]
fn handshake_refuses_a_stranger_at_its_first_byte_and_a_short_hello_waits() {
    let (out, taken, end) = handshake(Membership::open(), b"GET / HTTP/1.1\r\n", 1);
    assert!(end.unwrap_err().contains("magic"));
    assert_eq!((out.len(), taken), (0, 0));
    let hello = wire::encode_hello(ConnKind::Data);
    for n in 0..HELLO_LEN {
        let (out, taken, end) = handshake(Membership::open(), &hello[..n], 5);
        assert_eq!(end, Ok(None), "{n} bytes of a hello");
        assert_eq!((out.len(), taken), (0, n));
    }
    // A well-formed magic followed by a bad version is refused once the hello is whole.
    let mut bad = hello;
    bad[4] ^= 0xFF;
    let (out, _, end) = handshake(Membership::open(), &bad, 1);
    assert!(end.unwrap_err().contains("version"));
    assert!(out.is_empty());
}

fn descriptor() -> SegmentDescriptor {
    SegmentDescriptor {
        name: "127.0.0.1:7000".into(),
        host_id: "boot/pidns".into(),
        pid: 4242,
        protocol_version: PROTOCOL_VERSION,
        rails: vec![],
        rdma: vec![],
        buffers: vec![
            BufferDescriptor {
                addr: 0x1000,
                len: 0x1000,
                key: 7,
                location: Location::Cpu(0),
                shm: None,
                rkeys: vec![],
                access: None,
            },
            BufferDescriptor {
                addr: u64::MAX - 0xFFF,
                len: 0x1000,
                key: 8,
                location: Location::Any,
                shm: None,
                rkeys: vec![],
                access: None,
            },
        ],
        segment_name: None,
        members_only: false,
        groups: Vec::new(),
    }
}

#[test]
fn truncated_descriptors_are_errors() {
    let json = serde_json::to_vec(&descriptor()).unwrap();
    for n in 0..json.len() {
        assert!(
            serde_json::from_slice::<SegmentDescriptor>(&json[..n]).is_err(),
            "a descriptor cut at {n} of {} bytes parsed",
            json.len()
        );
    }
    assert_eq!(
        serde_json::from_slice::<SegmentDescriptor>(&json).unwrap(),
        descriptor()
    );
}

#[test]
fn descriptor_numbers_out_of_range_are_errors() {
    let json = serde_json::to_string(&descriptor()).unwrap();
    for (from, to) in [
        ("\"pid\":4242", "\"pid\":4294967296"),
        ("\"pid\":4242", "\"pid\":-1"),
        ("\"protocol_version\":3", "\"protocol_version\":65536"),
        ("\"addr\":4096", "\"addr\":18446744073709551616"),
        ("\"len\":4096", "\"len\":-4096"),
        ("\"len\":4096", "\"len\":1e3"),
        ("\"cpu:0\"", "\"cpu:4294967296\""),
        ("\"cpu:0\"", "\"cpu:-1\""),
        ("\"rails\":[]", "\"rails\":{}"),
    ] {
        let bad = json.replacen(from, to, 1);
        assert_ne!(bad, json, "{from} not in {json}");
        assert!(
            serde_json::from_str::<SegmentDescriptor>(&bad).is_err(),
            "accepted {to}"
        );
    }
    // Nesting past serde_json's recursion limit is an error, not a stack overflow.
    let deep = format!("{{\"unknown\":{}", "[".repeat(100_000));
    assert!(serde_json::from_str::<SegmentDescriptor>(&deep).is_err());
}

#[test]
fn find_buffer_at_the_top_of_the_address_space() {
    let d = descriptor();
    let top = &d.buffers[1];
    // The buffer ends exactly at 2^64: its last byte is reachable, nothing past it is.
    assert_eq!(d.find_buffer(u64::MAX, 1), Some(top));
    assert_eq!(d.find_buffer(u64::MAX - 0xFFF, 0x1000), Some(top));
    assert_eq!(d.find_buffer(u64::MAX, 0), Some(top));
    assert_eq!(d.find_buffer(u64::MAX, 2), None);
    assert_eq!(d.find_buffer(u64::MAX - 0xFFF, u64::MAX), None);
    assert_eq!(d.find_buffer(0x1FFF, 2), None);
    assert_eq!(d.find_buffer(0xFFF, 1), None);
    assert_eq!(d.find_buffer(0, u64::MAX), None);
    assert!(!top.contains(u64::MAX - 0x1000, 1));
}

#[test]
fn truncated_configs_are_errors() {
    let shown = Config::default().to_json_pretty();
    assert_eq!(
        Config::from_json_str(&shown, "test").unwrap(),
        Config::default()
    );
    let mut cut = 0;
    for (n, _) in shown.char_indices() {
        // Only whitespace may follow the closing brace; every shorter prefix is malformed.
        let e = Config::from_json_str(&shown[..n], "test").unwrap_err();
        assert!(e.key.is_empty(), "cut at {n}: {e}");
        cut += 1;
    }
    assert!(cut > 100);
}

#[test]
fn config_numbers_at_their_limits() {
    let block =
        |v: &str| Config::from_json_str(&format!("{{\"workers\":{{\"block_size\":{v}}}}}"), "t");
    assert_eq!(
        block(&MAX_BLOCK_SIZE.to_string())
            .unwrap()
            .workers
            .block_size,
        MAX_BLOCK_SIZE
    );
    for v in [
        "0".to_owned(),
        (MAX_BLOCK_SIZE + 1).to_string(),
        "-1".into(),
        "18446744073709551616".into(),
        "65536.5".into(),
        "\"65536\"".into(),
        "null".into(),
    ] {
        let e = block(&v).unwrap_err();
        assert_eq!(e.key, "workers.block_size", "{v}: {e}");
    }
    // A number no f64 holds is refused while reading the document, before any key is known.
    let e = block("1e400").unwrap_err();
    assert!(e.key.is_empty() && e.message.contains("line 1"), "{e}");
    let deep = format!("{{\"tiers\":{}", "{\"a\":".repeat(100_000));
    assert!(Config::from_json_str(&deep, "t").is_err());
    assert!(Config::from_json_str("{} {}", "t").is_err());
    assert!(Config::from_json_str("\u{feff}{}", "t").is_err());
    assert!(Config::from_json_str("", "t").is_err());
}
