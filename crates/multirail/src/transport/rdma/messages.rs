//! The verbs side of messages over RDMA: the ports and their receive completion queues, the
//! queue pairs of message connections (made, connected, and their credit word registered), and
//! the endpoint the opening of a message connection carries. The lane itself (one
//! `SEND_WITH_IMM` per message, receive buffers, credits as RDMA writes) is
//! `messaging::lanes::rdma`, which drives these queue pairs.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use multirail_policy::pairing::{pair_rails, RailInfo};
use multirail_policy::receive::ReceiveSettings;
use multirail_verbs::{
    Access, CompletionChannel, CompletionQueue, MemoryRegion, QpCaps, QueuePair, SharedReceiveQueue,
};

use super::cm::{self, PortEnd, QpEnd};
use super::devices::{Port, Registrations};
use crate::config::RdmaConfig;
use crate::memory::Buffer;
use crate::segment::RdmaRailDescriptor;

/// Bytes of an encoded [`MessageEndpoint`].
pub(crate) const ENDPOINT_LEN: usize = 44;

/// Credit writes a receiver's queue pair may have outstanding.
pub(crate) const CREDIT_DEPTH: u32 = 64;

/// Depth of each port's receive completion queue (or the device's most, if lower): the
/// receive buffers posted on a port, over every queue, may not exceed it.
const RECV_CQ_DEPTH: u32 = 65536;

/// One end of a message queue pair, as the other end must know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MessageEndpoint {
    /// Index of the receiver's rail the queue pair is (to be) on.
    pub rail: u16,
    pub gid: [u8; 16],
    pub lid: u16,
    pub mtu: u32,
    pub qp_num: u32,
    pub psn: u32,
    /// Where the receiver writes the sender's credit total, and the key that opens it (a
    /// sender's endpoint; zero in the receiver's).
    pub credit_addr: u64,
    pub credit_rkey: u32,
}

impl MessageEndpoint {
    /// The bytes on the wire (little-endian).
    pub(crate) fn encode(&self) -> [u8; ENDPOINT_LEN] {
        let mut b = [0u8; ENDPOINT_LEN];
        b[0..2].copy_from_slice(&self.rail.to_le_bytes());
        b[2..18].copy_from_slice(&self.gid);
        b[18..20].copy_from_slice(&self.lid.to_le_bytes());
        b[20..24].copy_from_slice(&self.mtu.to_le_bytes());
        b[24..28].copy_from_slice(&self.qp_num.to_le_bytes());
        b[28..32].copy_from_slice(&self.psn.to_le_bytes());
        b[32..40].copy_from_slice(&self.credit_addr.to_le_bytes());
        b[40..44].copy_from_slice(&self.credit_rkey.to_le_bytes());
        b
    }

    /// Reads an endpoint. Fails on a short buffer, an MTU below 256 or a PSN over 24 bits.
    pub(crate) fn decode(b: &[u8]) -> Result<MessageEndpoint, String> {
        if b.len() < ENDPOINT_LEN {
            return Err(format!(
                "RDMA endpoint of {} bytes, {ENDPOINT_LEN} expected",
                b.len()
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[2..18]);
        let e = MessageEndpoint {
            rail: u16::from_le_bytes([b[0], b[1]]),
            gid,
            lid: u16::from_le_bytes([b[18], b[19]]),
            mtu: u32_at(20),
            qp_num: u32_at(24),
            psn: u32_at(28),
            credit_addr: u64::from_le_bytes(b[32..40].try_into().expect("8 bytes")),
            credit_rkey: u32_at(40),
        };
        if e.mtu < 256 {
            return Err(format!("RDMA endpoint MTU {} is below 256", e.mtu));
        }
        if e.psn > multirail_verbs::MAX_PSN {
            return Err(format!("RDMA endpoint PSN {:#x} exceeds 24 bits", e.psn));
        }
        Ok(e)
    }

    fn port_end(&self) -> PortEnd {
        PortEnd {
            gid: self.gid,
            lid: self.lid,
            mtu: self.mtu,
        }
    }

    fn qp_end(&self) -> QpEnd {
        QpEnd {
            qp_num: self.qp_num,
            psn: self.psn,
        }
    }
}

/// Counts of messages over verbs, for [`super::RdmaStats`].
#[derive(Default)]
pub(crate) struct MessageCounters {
    pub sent: AtomicU64,
    /// Of those, sent inline (the payload copied into the work request).
    pub inline: AtomicU64,
    pub received: AtomicU64,
}

/// A port's receive completion queue of messages and the channel it reports to, if any.
type RecvCq = (CompletionQueue, Option<CompletionChannel>);

/// What messaging needs of the RDMA transport: its ports, their registrations of engine
/// memory, and one receive completion queue per port for every message queue pair on it.
pub(crate) struct MessageVerbs {
    ports: Vec<Arc<Port>>,
    registrations: Arc<Registrations>,
    config: RdmaConfig,
    /// Per port: the receive completion queue of messages, and the completion channel it
    /// reports to once armed (`None` where the device would not make one).
    recv_cqs: Mutex<Vec<Option<RecvCq>>>,
    /// Receive buffers posted per port, over all its queues (bounded by its CQ's depth).
    posted: Vec<AtomicUsize>,
    pub(crate) counters: Arc<MessageCounters>,
}

impl MessageVerbs {
    pub(super) fn new(
        ports: Vec<Arc<Port>>,
        registrations: Arc<Registrations>,
        config: RdmaConfig,
    ) -> MessageVerbs {
        MessageVerbs {
            recv_cqs: Mutex::new(vec![None; ports.len()]),
            posted: ports.iter().map(|_| AtomicUsize::new(0)).collect(),
            counters: Arc::default(),
            ports,
            registrations,
            config,
        }
    }

    /// Local port and remote rail pairs that can carry messages to a peer with `remote`
    /// rails, best first (the pairing the data path uses: same subnet, then routed).
    pub(crate) fn pairs(&self, remote: &[RdmaRailDescriptor]) -> Vec<(usize, usize)> {
        let info = |d: &RdmaRailDescriptor| RailInfo {
            name: d.device.clone(),
            numa_node: d.numa_node,
        };
        let local: Vec<RailInfo> = self.ports.iter().map(|p| info(&p.descriptor)).collect();
        let theirs: Vec<RailInfo> = remote.iter().map(info).collect();
        pair_rails(&local, &theirs, |l, r| {
            super::peer::reach(&self.ports[l], &remote[r])
        })
        .into_iter()
        .enumerate()
        .filter_map(|(l, r)| Some((l, r?)))
        .collect()
    }

    /// The receive completion queue of `port`, made on first use.
    pub(crate) fn recv_cq(&self, port: usize) -> Result<CompletionQueue, String> {
        self.recv_cq_and_channel(port).map(|(cq, _)| cq)
    }

    /// The receive completion queue of `port` (made on first use) and the completion channel it
    /// reports to when armed, on which a sleeping receiver waits (`None` where the device
    /// would not make a channel, or its descriptor could not be made non-blocking: the receiver
    /// then naps instead).
    pub(crate) fn recv_cq_and_channel(&self, port: usize) -> Result<RecvCq, String> {
        let p = self.port(port)?;
        let mut cqs = self.recv_cqs.lock().expect("message CQs poisoned");
        if let Some(made) = &cqs[port] {
            return Ok(made.clone());
        }
        let depth = p.context.attr().max_cqe.min(RECV_CQ_DEPTH);
        let channel = match CompletionChannel::new(&p.context) {
            Ok(ch) if set_nonblocking(ch.fd()) => Some(ch),
            Ok(_) => {
                tracing::warn!(rail = %p.descriptor.name(), "cannot make a completion channel non-blocking; a receiver asleep naps instead");
                None
            }
            Err(e) => {
                tracing::warn!(rail = %p.descriptor.name(), error = %e, "no completion channel; a receiver asleep naps instead");
                None
            }
        };
        let cq = match &channel {
            Some(ch) => CompletionQueue::with_channel(&p.context, depth, ch, port, 0),
            None => CompletionQueue::new(&p.context, depth),
        }
        .map_err(|e| format!("message completion queue on {}: {e}", p.descriptor.name()))?;
        cqs[port] = Some((cq.clone(), channel.clone()));
        Ok((cq, channel))
    }

    fn port(&self, port: usize) -> Result<&Arc<Port>, String> {
        self.ports
            .get(port)
            .ok_or_else(|| format!("no RDMA rail {port} here"))
    }

    /// Name of rail `port`, for messages.
    pub(crate) fn port_name(&self, port: usize) -> String {
        self.ports
            .get(port)
            .map_or_else(|| format!("rail {port}"), |p| p.descriptor.name())
    }

    /// Counts `n` more receive buffers posted on `port`. Fails when its completion queue could
    /// then overflow.
    pub(crate) fn reserve(&self, port: usize, n: usize) -> Result<(), String> {
        let cq = self.recv_cq(port)?;
        let cap = cq.depth() as usize;
        self.posted[port]
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                (now + n <= cap).then_some(now + n)
            })
            .map(|_| ())
            .map_err(|now| {
                format!(
                    "{now} receive buffers are posted on {} and its completion queue holds \
                     {cap}: lower transports.rdma.receive.queue_depth or set \
                     shared_receive_queue",
                    self.port_name(port)
                )
            })
    }

    /// Forgets `n` receive buffers of `port` (their queue is gone).
    pub(crate) fn unreserve(&self, port: usize, n: usize) {
        if let Some(p) = self.posted.get(port) {
            let _ = p.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                Some(now.saturating_sub(n))
            });
        }
    }

    /// A shared receive queue on `port` for a pool of `settings`.
    pub(crate) fn shared_receive_queue(
        &self,
        port: usize,
        settings: &ReceiveSettings,
    ) -> Result<SharedReceiveQueue, String> {
        let p = self.port(port)?;
        SharedReceiveQueue::new(&p.pd, settings.queue_depth as u32, settings.max_sge as u32)
            .map_err(|e| format!("shared receive queue on {}: {e}", p.descriptor.name()))
    }

    /// The local key on `port` of each chunk, which the engine registered with every port
    /// when it allocated them. Fails for a chunk no longer registered.
    pub(crate) fn lkeys(&self, port: usize, chunks: &[Buffer]) -> Result<Vec<u32>, String> {
        chunks
            .iter()
            .map(|c| {
                self.registrations
                    .get(c.region_id())
                    .map(|r| r.lkey(port))
                    .ok_or_else(|| "a receive chunk is not registered with RDMA".to_owned())
            })
            .collect()
    }

    /// The receiver's queue pair for a sender's `remote` endpoint, on the rail it names: its
    /// receives come from `srq`, or from a queue of its own of `own_depth` receives of
    /// `max_sge` entries; it sends only credit writes, which complete on a queue of their own.
    /// Returned in INIT, for the caller to post receives to, then [`MessageVerbs::connect`].
    pub(crate) fn receiving_qp(
        &self,
        remote: &MessageEndpoint,
        srq: Option<&SharedReceiveQueue>,
        own_depth: u32,
        max_sge: u32,
    ) -> Result<(QueuePair, CompletionQueue), String> {
        let port = self.port(remote.rail as usize)?;
        let cq = self.recv_cq(remote.rail as usize)?;
        let credit_cq = CompletionQueue::new(&port.context, CREDIT_DEPTH)
            .map_err(|e| format!("credit completion queue: {e}"))?;
        let caps = QpCaps {
            max_send_wr: CREDIT_DEPTH,
            max_recv_wr: own_depth,
            max_send_sge: 1,
            max_recv_sge: max_sge,
            max_inline_data: 8,
        };
        let qp =
            QueuePair::new_rc(&port.pd, &credit_cq, &cq, srq, caps).map_err(|e| e.to_string())?;
        qp.to_init(port.port, Access::LOCAL_WRITE)
            .map_err(|e| e.to_string())?;
        Ok((qp, credit_cq))
    }

    /// Takes the receiver's `qp` on rail `rail` to RTR and RTS towards the sender's `remote`;
    /// returns the endpoint to answer with. Fails when the path does not connect (no route).
    pub(crate) fn connect(
        &self,
        qp: &QueuePair,
        rail: usize,
        remote: &MessageEndpoint,
    ) -> Result<MessageEndpoint, String> {
        let port = self.port(rail)?;
        let mtu = cm::path_mtu(port.descriptor.mtu, remote.mtu, &self.config);
        let psn = cm::random_psn();
        cm::connect_qp(
            qp,
            port,
            &remote.port_end(),
            remote.qp_end(),
            psn,
            mtu,
            &self.config,
        )?;
        Ok(MessageEndpoint {
            rail: rail as u16,
            gid: port.descriptor.gid,
            lid: port.descriptor.lid,
            mtu,
            qp_num: qp.qp_num(),
            psn,
            credit_addr: 0,
            credit_rkey: 0,
        })
    }

    /// A sender's queue pair on local port `port` for the peer's rail `remote_rail`, in INIT,
    /// and the endpoint to open the connection with.
    pub(crate) fn sending_qp(
        &self,
        port: usize,
        remote_rail: usize,
    ) -> Result<(SendQueuePair, MessageEndpoint), String> {
        let p = self.port(port)?.clone();
        let depth = self.config.max_wr;
        let cq = CompletionQueue::new(&p.context, depth.min(p.context.attr().max_cqe))
            .map_err(|e| e.to_string())?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: self.config.max_inline_data,
        };
        let qp = QueuePair::new_rc(&p.pd, &cq, &cq, None, caps).map_err(|e| {
            format!(
                "message queue pair on {} (max_inline_data {}): {e}",
                p.descriptor.name(),
                self.config.max_inline_data
            )
        })?;
        // The receiver writes our credit total into `credit`.
        qp.to_init(p.port, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .map_err(|e| e.to_string())?;
        let credit = Box::new(AtomicU64::new(0));
        // SAFETY: the word is heap memory owned beside its region in the send queue pair,
        // which drops the region first (field order) and never moves the box's contents; the
        // device writes it only through remote writes of this region's key, 8 aligned bytes
        // at a time, and this process only loads it atomically.
        let credit_mr = unsafe {
            MemoryRegion::register(
                &p.pd,
                credit.as_ptr().cast::<u8>(),
                8,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
        }
        .map_err(|e| format!("registering the credit word: {e}"))?;
        let psn = cm::random_psn();
        let end = MessageEndpoint {
            rail: u16::try_from(remote_rail).map_err(|_| format!("rail {remote_rail}"))?,
            gid: p.descriptor.gid,
            lid: p.descriptor.lid,
            mtu: p.descriptor.mtu,
            qp_num: qp.qp_num(),
            psn,
            credit_addr: credit.as_ptr() as u64,
            credit_rkey: credit_mr.rkey(),
        };
        let inline_max = qp.caps().max_inline_data.min(self.config.max_inline_data);
        let depth = qp.caps().max_send_wr.min(cq.depth()).max(1);
        Ok((
            SendQueuePair {
                _credit_mr: credit_mr,
                credit,
                qp,
                cq,
                port: p,
                psn,
                config: self.config.clone(),
                inline_max,
                depth: u64::from(depth),
                counters: self.counters.clone(),
            },
            end,
        ))
    }
}

/// A sender's queue pair for messages to one peer, with the credit word the receiver writes
/// into; the rdma lane (`messaging::lanes::rdma`) posts its sends.
pub(crate) struct SendQueuePair {
    /// The registration of `credit`, before it (dropped first); kept only to stay registered.
    _credit_mr: MemoryRegion,
    /// The receiver's credit total, written by the receiver's queue pair.
    credit: Box<AtomicU64>,
    qp: QueuePair,
    cq: CompletionQueue,
    port: Arc<Port>,
    psn: u32,
    config: RdmaConfig,
    inline_max: u32,
    /// Sends the queue holds at most.
    depth: u64,
    counters: Arc<MessageCounters>,
}

impl SendQueuePair {
    /// Takes the queue pair to RTR and RTS towards the receiver's `remote`.
    pub(crate) fn connect(&mut self, remote: &MessageEndpoint) -> Result<(), String> {
        let mtu = cm::path_mtu(self.port.descriptor.mtu, remote.mtu, &self.config);
        cm::connect_qp(
            &self.qp,
            &self.port,
            &remote.port_end(),
            remote.qp_end(),
            self.psn,
            mtu,
            &self.config,
        )
    }

    /// Credits the receiver granted so far, in all.
    pub(crate) fn granted(&self) -> u64 {
        self.credit.load(Ordering::Acquire)
    }

    /// Name of the local rail, for messages.
    pub(crate) fn rail(&self) -> String {
        self.port.descriptor.name()
    }

    /// The queue pair, to post sends on.
    pub(crate) fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The completion queue of its sends.
    pub(crate) fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// The most bytes a send carries inline.
    pub(crate) fn inline_max(&self) -> u32 {
        self.inline_max
    }

    /// Sends the queue holds at most.
    pub(crate) fn depth(&self) -> u64 {
        self.depth
    }

    /// The port's message counters.
    pub(crate) fn counters(&self) -> &MessageCounters {
        &self.counters
    }

    /// Registers `len` bytes at `ptr` for local access on the queue pair's port, for sends
    /// from them. Fails when the device refuses.
    ///
    /// # Safety
    /// The memory must stay allocated, and not move, until the region is dropped.
    pub(crate) unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<MemoryRegion, String> {
        // SAFETY: the caller keeps the memory in place for the region's life.
        unsafe { MemoryRegion::register(&self.port.pd, ptr, len, Access::LOCAL_WRITE) }
            .map_err(|e| e.to_string())
    }
}

/// Makes descriptor `fd` non-blocking, so that draining a completion channel's events never
/// sleeps. Returns whether it worked.
fn set_nonblocking(fd: std::os::fd::RawFd) -> bool {
    // SAFETY: fcntl on a descriptor the channel owns and keeps open; F_GETFL/F_SETFL read and
    // set its status flags only.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip_and_bad_ones_are_refused() {
        let e = MessageEndpoint {
            rail: 3,
            gid: [7; 16],
            lid: 9,
            mtu: 1024,
            qp_num: 0x1234,
            psn: 0xab_cdef,
            credit_addr: 0x7f00_0000_1000,
            credit_rkey: 77,
        };
        assert_eq!(MessageEndpoint::decode(&e.encode()), Ok(e));
        assert!(MessageEndpoint::decode(&e.encode()[..43])
            .unwrap_err()
            .contains("43 bytes"));
        let low = MessageEndpoint { mtu: 128, ..e };
        assert!(MessageEndpoint::decode(&low.encode())
            .unwrap_err()
            .contains("MTU"));
        let psn = MessageEndpoint {
            psn: 0x100_0000,
            ..e
        };
        assert!(MessageEndpoint::decode(&psn.encode())
            .unwrap_err()
            .contains("PSN"));
    }
}
