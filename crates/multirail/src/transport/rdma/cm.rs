//! Connecting queue pairs: what the two ends tell each other, over a control connection of the
//! engine's own listener (a `ConnKind::Rdma` connection, through the membership handshake like
//! every other), and the target's side of it.
//!
//! The initiator creates its queue pairs for every path it wants (one per local port, paired
//! with a port of the target), moves them to INIT and sends their numbers, first PSNs and its
//! ports' GIDs, LIDs and MTUs. The target creates a queue pair for each, takes them to RTR
//! (ready to receive: to be written and read) and RTS, and answers with its own numbers, or
//! with why a path failed (`ibv_modify_qp(RTR)` refuses a GID it has no route to). The
//! initiator then takes its own to RTR and RTS. A path that failed at either end is left
//! unused; the others carry slices.
//!
//! The connection stays open for as long as the initiator uses the queue pairs: the target
//! destroys its queue pairs when it closes, so an initiator that exits or evicts the peer
//! leaves nothing behind, and later requests on it (remaking the queue pairs of a path whose
//! queue pair failed) reuse it. Frames are a 4-byte little-endian length and JSON; a frame
//! over [`MAX_FRAME`] or that does not parse closes the connection.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use multirail_verbs::{Access, PathOptions, QpCaps, QueuePair, RemoteQp};
use serde::{Deserialize, Serialize};

use super::devices::{Port, UnregisterWatcher};
use crate::config::RdmaConfig;

/// Largest frame either side accepts.
pub(super) const MAX_FRAME: u32 = 1 << 20;

/// Most queue pairs one path may ask for (bulk and HIGH today).
pub(super) const MAX_QPS_PER_PATH: usize = 4;

/// Most paths one request may carry: more than any host has ports.
const MAX_PATHS: usize = 256;

/// One queue pair end: its number and the first packet sequence number it sends with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct QpEnd {
    pub qp_num: u32,
    pub psn: u32,
}

/// An initiator's port as the target must know it to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct PortEnd {
    pub gid: [u8; 16],
    pub lid: u16,
    pub mtu: u32,
}

/// One path the initiator asks for: a target rail, and the initiator's queue pairs on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct PathRequest {
    /// Index of the target's rail in its descriptor's `rdma` list.
    pub target_rail: usize,
    pub port: PortEnd,
    pub qps: Vec<QpEnd>,
}

/// What the initiator sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ConnectRequest {
    /// Segment name of the initiator, for the target's logs.
    pub initiator: String,
    pub paths: Vec<PathRequest>,
    /// Target queue pairs, by number, that the initiator has given up on (their path failed
    /// and is being remade): the target destroys them.
    #[serde(default)]
    pub abandon: Vec<u32>,
}

/// The target's answer for one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum PathReply {
    /// The target's queue pairs, in the order asked, and the path MTU it chose.
    Ready { qps: Vec<QpEnd>, mtu: u32 },
    /// Why the target could not connect this path.
    Failed(String),
}

/// What the target answers: one reply per path asked for, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ConnectReply {
    pub paths: Vec<PathReply>,
}

/// What the target sends on the control connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum TargetFrame {
    /// The answer to the last request.
    Reply(ConnectReply),
    /// The target no longer serves the buffer `addr..addr+len`: its keys are gone.
    Unregistered { addr: u64, len: u64 },
}

/// The write side of a peer's control connection tells the peer of a buffer unregistered
/// here with a [`TargetFrame::Unregistered`].
impl UnregisterWatcher for Mutex<TcpStream> {
    fn unregistered(&self, addr: u64, len: u64) {
        let frame = TargetFrame::Unregistered { addr, len };
        // A peer that cannot take a few bytes finds out from its next failed request.
        let _ = send_frame(&mut self.lock().expect("cm writer poisoned"), &frame);
    }
}

/// Writes one frame.
pub(super) fn send_frame<T: Serialize>(stream: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    let json = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let len = u32::try_from(json.len())
        .ok()
        .filter(|&l| l <= MAX_FRAME)
        .ok_or_else(|| std::io::Error::other(format!("frame of {} bytes", json.len())))?;
    let mut out = Vec::with_capacity(4 + json.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&json);
    stream.write_all(&out)
}

/// Reads one frame if a whole one has arrived, without waiting; `Ok(None)` when none has.
/// Fails when the connection closed or the frame is bad.
pub(super) fn try_recv_frame<T: for<'de> Deserialize<'de>>(
    stream: &mut TcpStream,
) -> std::io::Result<Option<T>> {
    stream.set_nonblocking(true)?;
    let mut head = [0u8; 4];
    let whole = match stream.peek(&mut head) {
        Ok(0) => Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "control connection closed",
        )),
        Ok(n) if n < 4 => Ok(false),
        Ok(_) => {
            let len = u32::from_le_bytes(head);
            if len > MAX_FRAME {
                Ok(true) // `recv_frame` reports it.
            } else {
                let mut buf = vec![0u8; 4 + len as usize];
                match stream.peek(&mut buf) {
                    Ok(n) => Ok(n == buf.len()),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
                    Err(e) => Err(e),
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(e),
    };
    stream.set_nonblocking(false)?;
    if !whole? {
        return Ok(None);
    }
    match recv_frame(stream)? {
        Some(f) => Ok(Some(f)),
        None => Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "control connection closed",
        )),
    }
}

/// Reads one frame; `Ok(None)` when the other end closed the connection between frames.
pub(super) fn recv_frame<T: for<'de> Deserialize<'de>>(
    stream: &mut TcpStream,
) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is above the {MAX_FRAME}-byte limit"),
        ));
    }
    let mut json = vec![0u8; len as usize];
    stream.read_exact(&mut json)?;
    serde_json::from_slice(&json)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// A random first PSN (24 bits), so a stale packet of an earlier queue pair with the same
/// number is not taken for one of this one's.
pub(super) fn random_psn() -> u32 {
    rand::random::<u32>() & multirail_verbs::MAX_PSN
}

/// The queue pair sizes every path uses.
pub(super) fn qp_caps(config: &RdmaConfig) -> QpCaps {
    QpCaps {
        max_send_wr: config.max_wr,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

/// Rights a data queue pair gives its peer.
pub(super) fn qp_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
}

/// Path settings: as many outstanding READs against us as the device allows, up to 16.
pub(super) fn path_options(port: &Port) -> PathOptions {
    PathOptions {
        max_dest_rd_atomic: port.context.attr().max_qp_rd_atom.clamp(1, 16) as u8,
        ..PathOptions::default()
    }
}

/// The path MTU: the smallest of both ports' and the configured one (a known failure of
/// engines that take only their own when MTUs differ).
pub(super) fn path_mtu(local: u32, remote: u32, config: &RdmaConfig) -> u32 {
    let m = local.min(remote).min(config.mtu);
    // Round down to a size verbs knows.
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|&s| s <= m)
        .unwrap_or(256)
}

/// Takes `qp` to RTR towards `remote` and then RTS.
pub(super) fn connect_qp(
    qp: &QueuePair,
    port: &Port,
    remote: &PortEnd,
    remote_qp: QpEnd,
    own_psn: u32,
    mtu: u32,
    config: &RdmaConfig,
) -> Result<(), String> {
    let r = RemoteQp {
        qp_num: remote_qp.qp_num,
        psn: remote_qp.psn,
        gid: remote.gid,
        lid: remote.lid,
    };
    qp.to_rtr_with(&r, mtu, port.gid_index, port.port, &path_options(port))
        .map_err(|e| e.to_string())?;
    let initiator_depth = port.context.attr().max_qp_init_rd_atom.clamp(1, 16) as u8;
    qp.to_rts(
        own_psn,
        config.qp_timeout,
        config.retry_cnt,
        7,
        initiator_depth,
    )
    .map_err(|e| e.to_string())
}

/// The target's side: serves one handed-off connection on a thread of its own until the
/// initiator closes it, holding the queue pairs it made for it.
pub(super) fn serve(
    mut stream: TcpStream,
    writer: Arc<Mutex<TcpStream>>,
    ports: Vec<Arc<Port>>,
    config: RdmaConfig,
    io_timeout: Duration,
) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let mut held: HashMap<u32, QueuePair> = HashMap::new();
    loop {
        // A request is answered within the I/O timeout; between requests the connection may
        // stay idle for as long as the initiator keeps the peer.
        let _ = stream.set_read_timeout(None);
        let request: ConnectRequest = match recv_frame(&mut stream) {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "closing RDMA connection: bad request");
                break;
            }
        };
        let _ = writer
            .lock()
            .expect("cm writer poisoned")
            .set_write_timeout(Some(io_timeout));
        for qp_num in &request.abandon {
            held.remove(qp_num);
        }
        if request.paths.len() > MAX_PATHS {
            tracing::warn!(%peer, paths = request.paths.len(), "closing RDMA connection: too many paths");
            break;
        }
        let replies: Vec<PathReply> = request
            .paths
            .iter()
            .map(|p| match accept_path(p, &ports, &config) {
                Ok((reply, qps)) => {
                    for qp in qps {
                        held.insert(qp.qp_num(), qp);
                    }
                    reply
                }
                Err(why) => {
                    tracing::info!(
                        %peer,
                        initiator = %request.initiator,
                        target_rail = p.target_rail,
                        %why,
                        "RDMA path not connected"
                    );
                    PathReply::Failed(why)
                }
            })
            .collect();
        let sent = send_frame(
            &mut writer.lock().expect("cm writer poisoned"),
            &TargetFrame::Reply(ConnectReply { paths: replies }),
        );
        if let Err(e) = sent {
            tracing::warn!(%peer, error = %e, "closing RDMA connection: cannot answer");
            break;
        }
    }
    tracing::debug!(%peer, qps = held.len(), "RDMA connection closed; its queue pairs go");
}

/// Makes and connects the target's queue pairs of one path.
fn accept_path(
    p: &PathRequest,
    ports: &[Arc<Port>],
    config: &RdmaConfig,
) -> Result<(PathReply, Vec<QueuePair>), String> {
    let port = ports
        .get(p.target_rail)
        .ok_or_else(|| format!("no RDMA rail {} here", p.target_rail))?;
    if p.qps.is_empty() || p.qps.len() > MAX_QPS_PER_PATH {
        return Err(format!(
            "{} queue pairs asked for; 1..={MAX_QPS_PER_PATH} allowed",
            p.qps.len()
        ));
    }
    if p.port.mtu < 256 {
        return Err(format!("initiator MTU {} is below 256", p.port.mtu));
    }
    let mtu = path_mtu(port.descriptor.mtu, p.port.mtu, config);
    let mut made = Vec::with_capacity(p.qps.len());
    let mut ends = Vec::with_capacity(p.qps.len());
    for remote in &p.qps {
        let qp = QueuePair::new_rc(&port.pd, &port.cq, &port.cq, None, qp_caps(config))
            .map_err(|e| e.to_string())?;
        qp.to_init(port.port, qp_access())
            .map_err(|e| e.to_string())?;
        let psn = random_psn();
        connect_qp(&qp, port, &p.port, *remote, psn, mtu, config)?;
        ends.push(QpEnd {
            qp_num: qp.qp_num(),
            psn,
        });
        made.push(qp);
    }
    Ok((PathReply::Ready { qps: ends, mtu }, made))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_mtu_is_the_smallest_of_both_ends_and_the_setting() {
        let c = RdmaConfig::default();
        assert_eq!(path_mtu(4096, 1024, &c), 1024);
        assert_eq!(path_mtu(1024, 4096, &c), 1024);
        assert_eq!(path_mtu(4096, 4096, &c), 4096);
        // rxe on a 1500-byte link reports 1024; a 9000-byte link gives 4096.
        assert_eq!(path_mtu(1500, 4096, &c), 1024);
        let small = RdmaConfig {
            mtu: 2048,
            ..RdmaConfig::default()
        };
        assert_eq!(path_mtu(4096, 4096, &small), 2048);
    }

    #[test]
    fn frames_round_trip_and_bad_ones_are_errors() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut a = TcpStream::connect(addr).unwrap();
        let (mut b, _) = listener.accept().unwrap();
        let req = ConnectRequest {
            initiator: "h:1".into(),
            paths: vec![PathRequest {
                target_rail: 1,
                port: PortEnd {
                    gid: [7; 16],
                    lid: 0,
                    mtu: 1024,
                },
                qps: vec![QpEnd {
                    qp_num: 17,
                    psn: 99,
                }],
            }],
            abandon: vec![3],
        };
        send_frame(&mut a, &req).unwrap();
        let got: ConnectRequest = recv_frame(&mut b).unwrap().unwrap();
        assert_eq!(got, req);
        // A length over the limit is refused before anything is read.
        a.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
        let err = recv_frame::<ConnectRequest>(&mut b).unwrap_err();
        assert!(err.to_string().contains("above"), "{err}");
        // Garbage that is not JSON is an error, not a panic.
        let mut c = TcpStream::connect(addr).unwrap();
        let (mut d, _) = listener.accept().unwrap();
        c.write_all(&5u32.to_le_bytes()).unwrap();
        c.write_all(b"{oops").unwrap();
        assert!(recv_frame::<ConnectRequest>(&mut d).is_err());
        // A close between frames is the end, not an error.
        drop(c);
        let e = TcpStream::connect(addr).unwrap();
        let (mut f, _) = listener.accept().unwrap();
        drop(e.shutdown(std::net::Shutdown::Write));
        assert!(recv_frame::<ConnectRequest>(&mut f).unwrap().is_none());
    }
}
