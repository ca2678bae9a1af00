//! The wire format: a connection hello, then fixed-size, length-checked frames. Everything is
//! little-endian. Decoding never trusts a length it has not checked against a limit.

use multirail_policy::qos::Priority;

use crate::segment::PROTOCOL_VERSION;

/// First bytes of every connection.
pub const MAGIC: [u8; 4] = *b"MRAL";
/// Size of the hello every connection starts with: magic, version, kind, flags and the client's
/// nonce for the membership handshake (`transport::handshake`).
pub const HELLO_LEN: usize = 40;
/// Size of a request header (initiator to target).
pub const REQUEST_LEN: usize = 32;
/// Size of a response header (target to initiator).
pub const RESPONSE_LEN: usize = 16;
/// Largest slice one frame may carry; larger lengths are malformed frames.
pub const MAX_SLICE_LEN: u32 = 1 << 30;
/// Largest control message (a segment descriptor as JSON).
pub const MAX_CONTROL_LEN: u32 = 64 << 20;

/// What a connection is for, announced in its hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnKind {
    /// Descriptor queries.
    Control = 1,
    /// Slices.
    Data = 2,
    /// Two-sided messages and notifications, one connection per sending peer.
    Message = 3,
    /// Agreeing RDMA queue pairs; held open while the initiator uses them.
    Rdma = 4,
}

/// Encodes the hello for a connection of `kind` with an all-zero nonce (tests and tools that do
/// not check the server's proof).
pub fn encode_hello(kind: ConnKind) -> [u8; HELLO_LEN] {
    encode_hello_with_nonce(kind, &[0; 32])
}

/// Encodes the hello for a connection of `kind` carrying the client's handshake `nonce`.
pub fn encode_hello_with_nonce(kind: ConnKind, nonce: &[u8; 32]) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b[6] = kind as u8;
    b[8..40].copy_from_slice(nonce);
    b
}

/// The client's handshake nonce carried by a hello.
pub fn hello_nonce(b: &[u8; HELLO_LEN]) -> [u8; 32] {
    b[8..40].try_into().expect("32 bytes")
}

/// Decodes a hello; the error says what was wrong with it.
pub fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<ConnKind, String> {
    if b[..4] != MAGIC {
        return Err(format!("bad magic {:02x?}", &b[..4]));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {version}, this engine speaks {PROTOCOL_VERSION}"
        ));
    }
    if b[7] != 0 {
        return Err(format!("unknown hello flags {:#04x}", b[7]));
    }
    match b[6] {
        1 => Ok(ConnKind::Control),
        2 => Ok(ConnKind::Data),
        3 => Ok(ConnKind::Message),
        4 => Ok(ConnKind::Rdma),
        k => Err(format!("unknown connection kind {k}")),
    }
}

/// Operation of a request frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOp {
    /// Payload of `len` bytes follows; the target stores it at `addr`.
    Write = 1,
    /// The target answers with `len` bytes read at `addr`.
    Read = 2,
    /// Payload of `len` bytes (at most [`MAX_PROBE_LEN`]) follows; the target discards it and
    /// answers. It measures a rail without carrying anyone's bytes: a rail given up on as
    /// stalled is tried with probes, so no request waits on a rail that may still be down.
    /// `addr` and `key` are not looked at.
    Probe = 3,
}

/// Largest probe payload: a probe measures a rail, it need not be long.
pub const MAX_PROBE_LEN: u32 = 64 << 10;

/// A request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// What to do.
    pub op: RequestOp,
    /// Bytes to move.
    pub len: u32,
    /// Initiator's token, echoed in the response.
    pub id: u64,
    /// Address in the target's memory.
    pub addr: u64,
    /// Access key of the target buffer.
    pub key: u64,
    /// The slice's priority (on the wire 0 HIGH, 1 MEDIUM, 2 LOW), so the target serves it at a
    /// matching CPU priority. Peers that predate it send 0.
    pub priority: Priority,
}

impl RequestHeader {
    /// Serializes into `out`.
    pub fn encode(&self, out: &mut [u8; REQUEST_LEN]) {
        out[0] = self.op as u8;
        out[1] = self.priority.as_u8();
        out[2..4].fill(0);
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..24].copy_from_slice(&self.addr.to_le_bytes());
        out[24..32].copy_from_slice(&self.key.to_le_bytes());
    }

    /// Parses a header; an unknown op or priority, a length of 0 or above [`MAX_SLICE_LEN`], or
    /// a probe above [`MAX_PROBE_LEN`] is malformed.
    pub fn decode(b: &[u8]) -> Result<Self, String> {
        let b: &[u8; REQUEST_LEN] = b
            .get(..REQUEST_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or("short request header")?;
        let op = match b[0] {
            1 => RequestOp::Write,
            2 => RequestOp::Read,
            3 => RequestOp::Probe,
            op => return Err(format!("unknown request op {op}")),
        };
        let priority =
            Priority::from_u8(b[1]).ok_or_else(|| format!("unknown request priority {}", b[1]))?;
        let len = u32::from_le_bytes(b[4..8].try_into().unwrap());
        if len == 0 || len > MAX_SLICE_LEN {
            return Err(format!("request length {len} outside 1..={MAX_SLICE_LEN}"));
        }
        if op == RequestOp::Probe && len > MAX_PROBE_LEN {
            return Err(format!("probe length {len} above {MAX_PROBE_LEN}"));
        }
        Ok(RequestHeader {
            priority,
            op,
            len,
            id: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            addr: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            key: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        })
    }
}

/// Outcome a target reports for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Done: for a write the bytes are in place, for a read `len` payload bytes follow.
    Ok = 0,
    /// No buffer at that address, or the key did not match.
    BadKey = 1,
    /// The range runs past the end of the buffer.
    OutOfBounds = 2,
}

impl Status {
    /// Human reason for a refusal.
    pub fn reason(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::BadKey => "no buffer at that address with that key",
            Status::OutOfBounds => "range runs past the end of the buffer",
        }
    }
}

/// A response header; a successful read is followed by `len` payload bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    /// Outcome.
    pub status: Status,
    /// Payload bytes that follow (0 unless a successful read).
    pub len: u32,
    /// The request's token.
    pub id: u64,
}

impl ResponseHeader {
    /// Serializes into `out`.
    pub fn encode(&self, out: &mut [u8; RESPONSE_LEN]) {
        out[0] = 0xA5;
        out[1] = self.status as u8;
        out[2..4].fill(0);
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
    }

    /// Parses a header; a bad marker, unknown status or oversized length is malformed.
    pub fn decode(b: &[u8]) -> Result<Self, String> {
        let b: &[u8; RESPONSE_LEN] = b
            .get(..RESPONSE_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or("short response header")?;
        if b[0] != 0xA5 {
            return Err(format!("bad response marker {:#04x}", b[0]));
        }
        let status = match b[1] {
            0 => Status::Ok,
            1 => Status::BadKey,
            2 => Status::OutOfBounds,
            s => return Err(format!("unknown response status {s}")),
        };
        let len = u32::from_le_bytes(b[4..8].try_into().unwrap());
        if len > MAX_SLICE_LEN {
            return Err(format!("response length {len} above {MAX_SLICE_LEN}"));
        }
        Ok(ResponseHeader {
            status,
            len,
            id: u64::from_le_bytes(b[8..16].try_into().unwrap()),
        })
    }
}

/// Control request: send me your segment descriptor.
pub const CONTROL_GET_DESCRIPTOR: u8 = 1;

/// Size of a message-connection frame header: `len: u32, kind: u8, 3 zero bytes`. Small
/// messages carry this and nothing else, no slice header.
pub const MSG_HEADER_LEN: usize = 8;
/// Longest engine name a message connection's opening may carry.
pub const MAX_NAME_LEN: usize = 1024;

/// What a message-connection frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgKind {
    /// Sender to receiver: `len` bytes of a message follow.
    Message = 1,
    /// Sender to receiver: `len` bytes of a notification (UTF-8) follow.
    Notification = 2,
    /// Receiver to sender: `len` more receive buffers are posted for you (credits).
    Credit = 3,
    /// Sender to receiver, no payload: the last frame of a lane the sender leaves; what it
    /// sends on its next lane is delivered after everything before this.
    Fence = 4,
    /// Either way, 18 bytes of a lane negotiation message
    /// ([`multirail_policy::lanes::LaneMsg`]): in band from sender to receiver (requests,
    /// scores, demotions), on the stream back from receiver to sender (answers, evictions).
    /// The engine takes them in itself; the application never sees one.
    Lane = 5,
    /// Receiver to sender, 18 bytes: a [`multirail_policy::lanes::LaneMsg`] answering the
    /// sender's lane request or evicting its lane. Kept apart from [`MsgKind::Lane`] because
    /// a duplex socket carries both ends' requests and answers in each direction.
    LaneAnswer = 6,
    /// On a duplex dedicated tcp lane, the end that accepted the socket to the end that opened
    /// it, 4 bytes: the epoch of the lane it starts on this socket in the other direction
    /// (see `messaging::duplex`).
    ReverseOpen = 7,
    /// Answer to [`MsgKind::ReverseOpen`], no payload: `len` is the size of the receive
    /// buffers posted for the reverse lane; credits follow.
    ReverseAccept = 8,
    /// Answer to [`MsgKind::ReverseOpen`]: `len` bytes of UTF-8 saying why not.
    ReverseRefuse = 9,
}

/// A message-connection frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsgHeader {
    /// What follows.
    pub kind: MsgKind,
    /// Payload bytes, or credits for [`MsgKind::Credit`].
    pub len: u32,
}

impl MsgHeader {
    /// Serializes into `out`.
    pub fn encode(&self, out: &mut [u8; MSG_HEADER_LEN]) {
        out[..4].copy_from_slice(&self.len.to_le_bytes());
        out[4] = self.kind as u8;
        out[5..8].fill(0);
    }

    /// Parses a header; an unknown kind or a payload above `max_len` is malformed.
    pub fn decode(b: &[u8], max_len: u32) -> Result<Self, String> {
        let b: &[u8; MSG_HEADER_LEN] = b
            .get(..MSG_HEADER_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or("short message header")?;
        let len = u32::from_le_bytes(b[..4].try_into().unwrap());
        let kind = match b[4] {
            1 => MsgKind::Message,
            2 => MsgKind::Notification,
            3 => MsgKind::Credit,
            4 => MsgKind::Fence,
            5 => MsgKind::Lane,
            6 => MsgKind::LaneAnswer,
            7 => MsgKind::ReverseOpen,
            8 => MsgKind::ReverseAccept,
            9 => MsgKind::ReverseRefuse,
            k => return Err(format!("unknown message kind {k}")),
        };
        // Credit and ReverseAccept carry a count in `len`, not a payload.
        if !matches!(kind, MsgKind::Credit | MsgKind::ReverseAccept) && len > max_len {
            return Err(format!(
                "message of {len} bytes above the {max_len}-byte receive buffers"
            ));
        }
        Ok(MsgHeader { kind, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hello_round_trip_and_rejects() {
        let h = encode_hello(ConnKind::Data);
        assert_eq!(decode_hello(&h).unwrap(), ConnKind::Data);
        let mut bad = h;
        bad[0] = b'X';
        assert!(decode_hello(&bad).unwrap_err().contains("magic"));
        let mut bad = h;
        bad[4] = 99;
        assert!(decode_hello(&bad).unwrap_err().contains("version"));
        let mut bad = h;
        bad[6] = 7;
        assert!(decode_hello(&bad).unwrap_err().contains("kind"));
    }

    #[test]
    fn malformed_requests_are_rejected() {
        let mut b = [0u8; REQUEST_LEN];
        RequestHeader {
            op: RequestOp::Write,
            len: 10,
            id: 1,
            addr: 2,
            key: 3,
            priority: Priority::Low,
        }
        .encode(&mut b);
        assert!(RequestHeader::decode(&b).is_ok());
        let mut prio = b;
        prio[1] = 3;
        assert!(RequestHeader::decode(&prio)
            .unwrap_err()
            .contains("priority 3"));
        let mut z = b;
        z[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(RequestHeader::decode(&z).is_err());
        let mut big = b;
        big[4..8].copy_from_slice(&(MAX_SLICE_LEN + 1).to_le_bytes());
        assert!(RequestHeader::decode(&big).is_err());
        let mut op = b;
        op[0] = 9;
        assert!(RequestHeader::decode(&op).is_err());
        let mut probe = b;
        probe[0] = RequestOp::Probe as u8;
        probe[4..8].copy_from_slice(&MAX_PROBE_LEN.to_le_bytes());
        assert_eq!(RequestHeader::decode(&probe).unwrap().op, RequestOp::Probe);
        probe[4..8].copy_from_slice(&(MAX_PROBE_LEN + 1).to_le_bytes());
        let err = RequestHeader::decode(&probe).unwrap_err();
        assert!(err.contains("probe length"), "{err}");
        assert!(RequestHeader::decode(&b[..10]).is_err());
    }

    #[test]
    fn message_headers() {
        let mut b = [0u8; MSG_HEADER_LEN];
        let h = MsgHeader {
            kind: MsgKind::Notification,
            len: 100,
        };
        h.encode(&mut b);
        assert_eq!(MsgHeader::decode(&b, 100).unwrap(), h);
        assert!(MsgHeader::decode(&b, 99).is_err());
        b[4] = 10;
        assert!(MsgHeader::decode(&b, 100).is_err());
        assert!(MsgHeader::decode(&b[..3], 100).is_err());
        // Counts, not payloads: above the buffer size is fine.
        for kind in [MsgKind::Credit, MsgKind::ReverseAccept] {
            MsgHeader { kind, len: 4096 }.encode(&mut b);
            assert_eq!(MsgHeader::decode(&b, 100).unwrap().len, 4096);
        }
        MsgHeader {
            kind: MsgKind::ReverseRefuse,
            len: 4096,
        }
        .encode(&mut b);
        assert!(MsgHeader::decode(&b, 100).is_err());
        assert_eq!(
            decode_hello(&encode_hello(ConnKind::Message)).unwrap(),
            ConnKind::Message
        );
    }

    proptest! {
        #[test]
        fn request_round_trip(write in any::<bool>(), len in 1..=MAX_SLICE_LEN, id in any::<u64>(), addr in any::<u64>(), key in any::<u64>(), priority in 0usize..3) {
            let priority = Priority::ALL[priority];
            let h = RequestHeader { op: if write { RequestOp::Write } else { RequestOp::Read }, len, id, addr, key, priority };
            let mut b = [0u8; REQUEST_LEN];
            h.encode(&mut b);
            prop_assert_eq!(RequestHeader::decode(&b).unwrap(), h);
        }

        #[test]
        fn response_round_trip(status in 0u8..3, len in 0..=MAX_SLICE_LEN, id in any::<u64>()) {
            let status = [Status::Ok, Status::BadKey, Status::OutOfBounds][status as usize];
            let h = ResponseHeader { status, len, id };
            let mut b = [0u8; RESPONSE_LEN];
            h.encode(&mut b);
            prop_assert_eq!(ResponseHeader::decode(&b).unwrap(), h);
        }

        #[test]
        fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = RequestHeader::decode(&bytes);
            let _ = ResponseHeader::decode(&bytes);
        }
    }
}
