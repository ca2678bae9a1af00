//! Messages over verbs: two-sided SEND / RECV on reliable-connected queue pairs, with the
//! receive path of RAMCloud's InfRc transport, whose latency its ping-pong study measures.
//!
//! A sender has one queue pair per peer it sends to, on a local port that reaches one of the
//! peer's rails. Every message is one `SEND_WITH_IMM` (the immediate carries the message
//! kind, so the payload needs no header): inline when it fits `transports.rdma.max_inline_data`
//! (RAMCloud's 400 bytes; the CPU copies it into the request and nothing needs registering),
//! otherwise from a registered staging slot. Every send is signalled, as InfRc's are, and
//! completions are reaped lazily, when a slot or room in the send queue is wanted: a sender
//! knows when each message reached the receiver, and closing waits for that, so nothing sent
//! before a close is lost.
//!
//! The receiver's queue pairs take their receives from a shared receive queue per port
//! (`transports.rdma.receive.shared_receive_queue`, default true, 63 buffers) or from a
//! receive queue of their own, and report to one completion queue per port that the caller's
//! `recv` polls. Receive buffers live in `registration_chunks` registered chunks; a receive
//! names one buffer with one scatter/gather entry, in a queue created for `max_sge`. Which
//! buffer a message lands in is the queue's choice, not the sender's: the accounting
//! (`ReceiveQueue::on_arrival_posted`) follows the hardware, and credits make sure a sender
//! never sends into an empty queue (no receiver-not-ready retries).
//!
//! Credits travel over verbs too: the sender's opening names an 8-byte word of its memory,
//! registered for remote writes, and the receiver's queue pair RDMA-writes the total of the
//! credits it ever granted there (inline, signalled every [`CREDIT_SIGNAL_INTERVAL`]-th). The
//! sender reads the word; no system call on either side. An earlier version returned credits
//! over the TCP stream, as `tcp` does: in the soft-RoCE VM every such write showed as a round
//! trip several times slower than the others, once per half a queue of messages (the period
//! RAMCloud's InfRc ping-pong study finds for late buffer returns), and at depth 1 on every
//! message. The stream stays, to notice either side leaving.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use multirail_policy::pairing::{pair_rails, RailInfo};
use multirail_policy::receive::{BufferId, ReceiveSettings};
use multirail_verbs::{
    Access, CompletionQueue, MemoryRegion, QpCaps, QueuePair, RecvBatch, SendBatch, SendFlags,
    SendOp, Sge, SharedReceiveQueue, WorkCompletion,
};

use super::cm::{self, PortEnd, QpEnd};
use super::devices::{Port, Registrations};
use crate::config::RdmaConfig;
use crate::memory::Buffer;
use crate::segment::RdmaRailDescriptor;

/// Bytes of an encoded [`MessageEndpoint`].
pub(crate) const ENDPOINT_LEN: usize = 44;

/// Credit writes a receiver's queue pair may have outstanding.
const CREDIT_DEPTH: u32 = 64;

/// One credit write in this many is signalled (the others complete with it).
const CREDIT_SIGNAL_INTERVAL: u64 = 16;

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

/// What messaging needs of the RDMA transport: its ports, their registrations of engine
/// memory, and one receive completion queue per port for every message queue pair on it.
pub(crate) struct MessageVerbs {
    ports: Vec<Arc<Port>>,
    registrations: Arc<Registrations>,
    config: RdmaConfig,
    recv_cqs: Mutex<Vec<Option<CompletionQueue>>>,
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
        let p = self.port(port)?;
        let mut cqs = self.recv_cqs.lock().expect("message CQs poisoned");
        if let Some(cq) = &cqs[port] {
            return Ok(cq.clone());
        }
        let depth = p.context.attr().max_cqe.min(RECV_CQ_DEPTH);
        let cq = CompletionQueue::new(&p.context, depth)
            .map_err(|e| format!("message completion queue on {}: {e}", p.descriptor.name()))?;
        cqs[port] = Some(cq.clone());
        Ok(cq)
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
                staging: None,
                _credit_mr: credit_mr,
                credit,
                qp,
                cq,
                port: p,
                psn,
                config: self.config.clone(),
                batch: SendBatch::new(1),
                inline_max,
                depth: u64::from(depth),
                posted: 0,
                completed: 0,
                wcs: vec![WorkCompletion::default(); 16],
                counters: self.counters.clone(),
                abandoned: false,
            },
            end,
        ))
    }
}

/// The receiver's side of credits on one message queue pair: RDMA writes of the total granted
/// into the sender's credit word.
pub(crate) struct CreditWriter {
    qp: Arc<QueuePair>,
    cq: CompletionQueue,
    addr: u64,
    rkey: u32,
    total: u64,
    posted: u64,
    completed: u64,
    batch: SendBatch,
    wcs: Vec<WorkCompletion>,
}

impl CreditWriter {
    /// Credits for the sender of `remote`, written through `qp` (whose send completions go to
    /// `cq`). Fails when the sender named no credit word.
    pub(crate) fn new(
        qp: Arc<QueuePair>,
        cq: CompletionQueue,
        remote: &MessageEndpoint,
    ) -> Result<CreditWriter, String> {
        if remote.credit_addr == 0 || !remote.credit_addr.is_multiple_of(8) {
            return Err(format!(
                "the sender's credit word at {:#x} is not an aligned address",
                remote.credit_addr
            ));
        }
        Ok(CreditWriter {
            qp,
            cq,
            addr: remote.credit_addr,
            rkey: remote.credit_rkey,
            total: 0,
            posted: 0,
            completed: 0,
            batch: SendBatch::new(1),
            wcs: vec![WorkCompletion::default(); 8],
        })
    }

    /// The queue pair the credits go through.
    pub(crate) fn qp(&self) -> &Arc<QueuePair> {
        &self.qp
    }

    /// Grants `n` more credits: writes the new total to the sender. Fails when the queue pair
    /// broke (the sender is gone) or its writes stop completing.
    pub(crate) fn grant(&mut self, n: usize) -> Result<(), String> {
        self.total += n as u64;
        if self.posted - self.completed >= u64::from(CREDIT_DEPTH) - 1 {
            let start = Instant::now();
            while self.posted - self.completed >= u64::from(CREDIT_DEPTH) - 1 {
                self.reap()?;
                if start.elapsed() > Duration::from_secs(5) {
                    return Err("credit writes stopped completing".into());
                }
                std::hint::spin_loop();
            }
        }
        let seq = self.posted;
        let mut flags = SendFlags::INLINE;
        if (seq + 1).is_multiple_of(CREDIT_SIGNAL_INTERVAL) {
            flags |= SendFlags::SIGNALED;
        }
        let word = self.total.to_le_bytes();
        let sge = Sge {
            addr: word.as_ptr() as u64,
            length: 8,
            lkey: 0,
        };
        self.batch.clear();
        self.batch
            .push(
                seq,
                SendOp::RdmaWrite {
                    remote_addr: self.addr,
                    rkey: self.rkey,
                },
                flags,
                &[sge],
            )
            .map_err(|e| e.to_string())?;
        // SAFETY: the 8 bytes are inline, read by the CPU during the call.
        unsafe { self.qp.post_send(&mut self.batch) }.map_err(|e| e.to_string())?;
        self.posted += 1;
        Ok(())
    }

    fn reap(&mut self) -> Result<(), String> {
        let n = self.cq.poll(&mut self.wcs).map_err(|e| e.to_string())?;
        for wc in &self.wcs[..n] {
            if !wc.is_success() {
                return Err(format!("credit write failed: {}", self.cq.status_str(wc)));
            }
            self.completed = self.completed.max(wc.wr_id() + 1);
        }
        Ok(())
    }
}

/// Receive buffers handed to a receive queue: a shared one or a queue pair's own.
pub(crate) enum ReceiveTarget {
    Shared(SharedReceiveQueue),
    Own(Arc<QueuePair>),
}

/// The hardware side of a receive pool: where its buffers are posted, with the keys that
/// open them on that port.
pub(crate) struct PostedReceives {
    pub(crate) target: ReceiveTarget,
    /// Rail the queue is on.
    port: usize,
    lkeys: Vec<u32>,
    buffer_size: u32,
    depth: usize,
    batch: RecvBatch,
    /// Counts this queue's buffers against the rail's completion queue while it lives.
    verbs: Arc<MessageVerbs>,
}

impl PostedReceives {
    /// A queue of `settings.queue_depth` buffers on rail `port`, nothing posted yet. Fails
    /// when the rail's completion queue cannot take that many more receives.
    pub(crate) fn new(
        verbs: &Arc<MessageVerbs>,
        target: ReceiveTarget,
        port: usize,
        lkeys: Vec<u32>,
        settings: &ReceiveSettings,
    ) -> Result<PostedReceives, String> {
        verbs.reserve(port, settings.queue_depth)?;
        Ok(PostedReceives {
            target,
            port,
            lkeys,
            buffer_size: settings.buffer_size as u32,
            depth: settings.queue_depth,
            batch: RecvBatch::with_sges(settings.queue_depth.min(64), settings.queue_depth.min(64)),
            verbs: verbs.clone(),
        })
    }

    /// Posts `buffers` (each with its address and chunk), in order, with as few calls as the
    /// batch allows.
    ///
    /// # Safety
    /// Each address must be the start of a receive buffer of `buffer_size` bytes inside the
    /// chunk named, which the engine keeps mapped and registered while this queue lives, and
    /// that nothing reads or writes until the receive's completion has been polled.
    pub(crate) unsafe fn post(
        &mut self,
        buffers: impl IntoIterator<Item = (BufferId, u64, usize)>,
    ) -> Result<(), String> {
        let mut buffers = buffers.into_iter().peekable();
        while buffers.peek().is_some() {
            self.batch.clear();
            while self.batch.len() < self.batch.capacity() {
                let Some((id, addr, chunk)) = buffers.next() else {
                    break;
                };
                let sge = Sge {
                    addr,
                    length: self.buffer_size,
                    lkey: self.lkeys[chunk],
                };
                self.batch
                    .push(u64::from(id.0), &[sge])
                    .map_err(|e| e.to_string())?;
            }
            // SAFETY: the caller's contract covers every entry pushed above.
            let posted = unsafe {
                match &self.target {
                    ReceiveTarget::Shared(srq) => srq.post_recv(&mut self.batch),
                    ReceiveTarget::Own(qp) => qp.post_recv(&mut self.batch),
                }
            };
            posted.map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

impl Drop for PostedReceives {
    fn drop(&mut self) {
        self.verbs.unreserve(self.port, self.depth);
    }
}

/// A sender's queue pair for messages to one peer.
pub(crate) struct SendQueuePair {
    /// Registered staging slots for messages above the inline size, made on first use.
    /// Declared first: the region is deregistered before the queue pair goes.
    staging: Option<(MemoryRegion, Box<[u8]>, usize)>,
    /// The registration of `credit`, before it (dropped first); kept only to stay registered.
    _credit_mr: MemoryRegion,
    /// The receiver's credit total, written by the receiver's queue pair.
    credit: Box<AtomicU64>,
    qp: QueuePair,
    cq: CompletionQueue,
    port: Arc<Port>,
    psn: u32,
    config: RdmaConfig,
    batch: SendBatch,
    inline_max: u32,
    /// Sends the queue holds at most (and staging slots).
    depth: u64,
    /// Sends posted, and reaped (every send is signalled; completions arrive in order).
    posted: u64,
    completed: u64,
    wcs: Vec<WorkCompletion>,
    counters: Arc<MessageCounters>,
    /// The receiver is known gone: closing does not wait for sends to land.
    abandoned: bool,
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

    /// Sends `data` with `kind` in the immediate, waiting up to `timeout` for room in the
    /// send queue. Fails when the queue pair broke (the receiver is gone or unreachable) or
    /// stays full.
    pub(crate) fn send(&mut self, kind: u8, data: &[u8], timeout: Duration) -> Result<(), String> {
        if self.posted - self.completed >= self.depth {
            self.wait_for_room(timeout)?;
        }
        let seq = self.posted;
        let mut flags = SendFlags::SIGNALED;
        let inline = data.len() as u64 <= u64::from(self.inline_max);
        let sge = if inline {
            flags |= SendFlags::INLINE;
            Sge {
                addr: data.as_ptr() as u64,
                length: data.len() as u32,
                lkey: 0,
            }
        } else {
            let slot = (seq % self.depth) as usize;
            let (mr, slots, slot_len) = self.staging(data.len())?;
            let offset = slot * *slot_len;
            slots[offset..offset + data.len()].copy_from_slice(data);
            mr.sge(offset, data.len()).map_err(|e| e.to_string())?
        };
        self.batch.clear();
        self.batch
            .push(seq, SendOp::SendImm { imm: kind.into() }, flags, &[sge])
            .map_err(|e| e.to_string())?;
        // SAFETY: an inline payload is read by the CPU during the call; a staged one sits in
        // slot `seq % depth` of the registered staging area, which no later send overwrites
        // before this one's completion is reaped (at most `depth` sends are outstanding).
        unsafe { self.qp.post_send(&mut self.batch) }.map_err(|e| e.to_string())?;
        self.posted += 1;
        self.counters.sent.fetch_add(1, Ordering::Relaxed);
        if inline {
            self.counters.inline.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The staging area, made for slots of at least `len` bytes.
    fn staging(&mut self, len: usize) -> Result<&mut (MemoryRegion, Box<[u8]>, usize), String> {
        let fits = self.staging.as_ref().is_some_and(|s| s.2 >= len);
        if !fits {
            if self.posted > self.completed {
                // Slots in use must not move: let them finish first.
                self.drain(Duration::from_secs(10))?;
            }
            self.staging = None;
            let slot_len = len.next_power_of_two().max(4096);
            let mut slots = vec![0u8; slot_len * self.depth as usize].into_boxed_slice();
            // SAFETY: the slots are heap memory owned beside the region in `staging`, which
            // drops the region first (tuple order) and never reallocates them; the device only
            // reads them, for sends this queue pair posts.
            let mr = unsafe {
                MemoryRegion::register(
                    &self.port.pd,
                    slots.as_mut_ptr(),
                    slots.len(),
                    Access::LOCAL_WRITE,
                )
            }
            .map_err(|e| format!("registering message staging: {e}"))?;
            self.staging = Some((mr, slots, slot_len));
        }
        Ok(self.staging.as_mut().expect("just made"))
    }

    /// Reaps what completed. Fails on an error completion: the queue pair is broken.
    pub(crate) fn reap(&mut self) -> Result<(), String> {
        loop {
            let n = self.cq.poll(&mut self.wcs).map_err(|e| e.to_string())?;
            for wc in &self.wcs[..n] {
                if !wc.is_success() {
                    return Err(format!(
                        "message send failed on {}: {}",
                        self.port.descriptor.name(),
                        self.cq.status_str(wc)
                    ));
                }
                self.completed = self.completed.max(wc.wr_id() + 1);
            }
            if n < self.wcs.len() {
                return Ok(());
            }
        }
    }

    fn wait_for_room(&mut self, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        loop {
            self.reap()?;
            if self.posted - self.completed < self.depth {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "no send completed on {} within {} ms",
                    self.port.descriptor.name(),
                    timeout.as_millis()
                ));
            }
            std::hint::spin_loop();
        }
    }

    /// The receiver is gone (its connection closed or broke): closing need not wait for the
    /// sends in flight, which cannot land.
    pub(crate) fn abandon(&mut self) {
        self.abandoned = true;
    }

    /// Waits until every message sent has reached the receiver, up to `timeout`.
    pub(crate) fn drain(&mut self, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        while self.completed < self.posted {
            self.reap()?;
            if start.elapsed() > timeout {
                return Err(format!(
                    "{} messages unconfirmed after {} ms",
                    self.posted - self.completed,
                    timeout.as_millis()
                ));
            }
            std::thread::yield_now();
        }
        Ok(())
    }
}

impl Drop for SendQueuePair {
    fn drop(&mut self) {
        if self.abandoned {
            return;
        }
        // Destroying the queue pair drops what it has not sent yet: let it finish first.
        if let Err(e) = self.drain(Duration::from_secs(2)) {
            tracing::warn!(rail = %self.port.descriptor.name(), error = %e, "closing a message queue pair");
        }
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
