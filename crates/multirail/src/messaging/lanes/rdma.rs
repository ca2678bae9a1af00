//! The rdma lane: two-sided SEND / RECV on reliable-connected queue pairs, with the receive
//! path of RAMCloud's InfRc transport, whose latency its ping-pong study measures. The verbs
//! side (ports, queue pairs, completion queues) is `transport::rdma::messages`.
//!
//! A sender has one queue pair per peer it sends to, on a local port that reaches one of the
//! peer's rails; the queue pair is agreed in the opening of the message connection. Every
//! message is one `SEND_WITH_IMM` (the immediate carries the message kind, so the payload
//! needs no header): inline when it fits `transports.rdma.max_inline_data` (RAMCloud's 400
//! bytes; the CPU copies it into the request and nothing needs registering), otherwise from a
//! registered staging slot. Every send is signalled, as InfRc's are, and completions are
//! reaped lazily, when a slot or room in the send queue is wanted: a sender knows when each
//! message reached the receiver, and closing waits for that, so nothing sent before a close is
//! lost.
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
//! credits it ever granted there (inline, signalled every 16th). The sender reads the word;
//! no system call on either side. An earlier version returned credits over the TCP stream, as
//! `tcp` does: in the soft-RoCE VM every such write showed as a round trip several times
//! slower than the others, once per half a queue of messages (the period RAMCloud's InfRc
//! ping-pong study finds for late buffer returns), and at depth 1 on every message. The stream
//! stays, to notice either side leaving.

mod queues;

pub(in crate::messaging) use queues::{CreditWriter, PostedReceives, QueueSender, ReceiveTarget};

use crate::messaging::*;

/// The sending half of an rdma lane.
pub(in crate::messaging) struct RdmaSend {
    sender: QueueSender,
    /// Credits taken from the receiver's total so far.
    seen: u64,
    /// Credit checks since the stream was last checked for the receiver leaving.
    polls: u32,
}

impl SendLane for RdmaSend {
    fn send(
        &mut self,
        link: &mut Link,
        kind: MsgKind,
        data: &[u8],
        timeout: Duration,
        poke: &dyn Fn(),
    ) -> Result<()> {
        link.check_len(data)?;
        credit(self, link, timeout, poke)?;
        self.sender
            .send(kind as u8, data, timeout)
            .map_err(|reason| Error::PeerDisconnected {
                peer: link.peer.clone(),
                reason,
            })
    }

    fn collect_credits(&mut self, link: &mut Link) -> Result<()> {
        let total = self.sender.granted();
        if total > self.seen {
            link.credits.on_grant(std::iter::repeat_n(
                BufferId(0),
                (total - self.seen) as usize,
            ));
            self.seen = total;
            self.polls = 0;
            return Ok(());
        }
        // Waiting: now and then, see whether the receiver left or answered a lane
        // request (a system call).
        self.polls += 1;
        if self.polls.is_multiple_of(256) {
            self.read_back(link)?;
        }
        Ok(())
    }

    /// The connection is dropped after this: do not wait for sends that cannot land.
    fn abandon(&mut self) {
        self.sender.abandon();
    }
}

/// The receiving half of an rdma lane: messages arrive through the queue pair into the pool's
/// receive queue and are taken in by polling the rail's completion queue
/// ([`Messaging::poll_rdma`]); credits go back as RDMA writes through the same queue pair.
/// The stream only tells when the sender leaves.
pub(in crate::messaging) struct RdmaRecv {
    credits: Box<CreditWriter>,
    port: usize,
}

impl RecvLane for RdmaRecv {
    fn receive(&mut self, cx: &mut RecvCx<'_>) -> std::result::Result<(), String> {
        // Messages come through the completion queue; the stream only says when the
        // sender leaves (checked while waiting, as for shm).
        if cx.liveness {
            let mut b = [0u8; 1];
            match sockio::recv_nonblocking(cx.stream.as_raw_fd(), &mut b) {
                Ok(Some(0)) => *cx.dead = true,
                Ok(Some(_)) => return Err("a sender wrote on its RDMA message stream".into()),
                Ok(None) => {}
                Err(e) => return Err(format!("message stream: {e}")),
            }
        }
        Ok(())
    }

    fn grant(
        &mut self,
        _stream: &TcpStream,
        buffers: &[BufferId],
    ) -> std::result::Result<(), String> {
        self.credits.grant(buffers.len())
    }
}

impl Messaging {
    /// A message connection over RDMA: a queue pair on the first pair of rails (local port,
    /// peer's rail) that connects, tried in the data path's pairing order. Fails when RDMA is
    /// off at either end, or no pair connects (with each pair's reason).
    pub(in crate::messaging) fn connect_rdma(
        &self,
        engine: &dyn Peers,
        peer: &Arc<Peer>,
        lane: (Lane, u32),
    ) -> Result<OutConn> {
        let unavailable = |reason: String| Error::TransportUnavailable {
            transport: "rdma",
            reason,
        };
        let verbs = self
            .verbs
            .as_ref()
            .map_err(|why| unavailable(why.clone()))?;
        let rails = peer.descriptor().rdma.clone();
        if rails.is_empty() {
            return Err(unavailable(format!(
                "segment {} has no RDMA device",
                peer.name
            )));
        }
        let pairs = verbs.pairs(&rails);
        if pairs.is_empty() {
            return Err(unavailable(format!(
                "no local RDMA port reaches a port of {}",
                peer.name
            )));
        }
        let mut failures = Vec::new();
        for (port, rail) in pairs {
            let (mut qp, end) = verbs.sending_qp(port, rail).map_err(unavailable)?;
            let pair = format!("{} -> {}", qp.rail(), rails[rail].name());
            let (mut stream, max_len) =
                match self.open(engine, peer, MODE_RDMA, lane, &end.encode()) {
                    Ok(o) => o,
                    // The receiver could not connect this pair: try the next.
                    Err(Error::RemoteRejected { reason, .. }) => {
                        failures.push(format!("{pair}: {reason}"));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
            let mut answer = [0u8; ENDPOINT_LEN];
            let connected = stream
                .read_exact(&mut answer)
                .map_err(|e| format!("reading the receiver's queue pair: {e}"))
                .and_then(|()| MessageEndpoint::decode(&answer))
                .and_then(|remote| qp.connect(&remote))
                .and_then(|()| stream.set_read_timeout(None).map_err(|e| e.to_string()));
            match connected {
                Ok(()) => {
                    tracing::debug!(peer = %peer.name, %pair, "messages over RDMA");
                    let io = RdmaSend {
                        sender: QueueSender::new(qp),
                        seen: 0,
                        polls: 0,
                    };
                    let link = Link::new(peer.name.clone(), stream, max_len);
                    return Ok(OutConn::new(link, Box::new(io), lane.0));
                }
                Err(e) => failures.push(format!("{pair}: {e}")),
            }
        }
        Err(Error::SegmentUnreachable {
            name: peer.name.clone(),
            reason: format!("no RDMA path carries messages ({})", failures.join("; ")),
        })
    }

    /// Target side of a message connection over RDMA: makes the queue pair for the sender's
    /// `endpoint`, its receives from the rail's shared pool or a pool of its own, and answers
    /// with the queue pair's endpoint. Fails (telling the sender why) when RDMA is off here,
    /// the rail does not exist or the path does not connect.
    pub(in crate::messaging) fn accept_rdma(
        &self,
        stream: TcpStream,
        from: Arc<str>,
        lane: (Lane, u32),
        endpoint: &[u8],
        permit: ConnPermit,
    ) -> std::result::Result<(), String> {
        let verbs = match &self.verbs {
            Ok(v) => v.clone(),
            Err(why) => return Err(refuse(stream, format!("RDMA is off here: {why}"))),
        };
        let remote = match MessageEndpoint::decode(endpoint) {
            Ok(e) => e,
            Err(e) => return Err(refuse(stream, e)),
        };
        let port = remote.rail as usize;
        let settings = self.rdma;
        let id = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        // A dedicated lane has a receive queue of its own; a shared one takes the port's
        // shared receive queue under dynamic lanes or when the configuration says so.
        let made = if self.shared_pool_for(lane.0, &settings) {
            self.shared_rdma_pool(&verbs, port).and_then(|srq| {
                let (qp, cq) =
                    verbs.receiving_qp(&remote, Some(&srq), 0, settings.max_sge as u32)?;
                Ok((SHARED_RDMA + port as u64, Arc::new(qp), cq, None))
            })
        } else {
            self.own_rdma_pool(&verbs, &remote)
                .map(|(qp, cq, pool)| (id.0, qp, cq, Some(pool)))
        };
        let (key, qp, credit_cq, own) = match made {
            Ok(m) => m,
            Err(e) => return Err(refuse(stream, e)),
        };
        let credits = match CreditWriter::new(qp.clone(), credit_cq, &remote) {
            Ok(c) => c,
            Err(e) => {
                if let Some(p) = own {
                    p.release(&self.registry);
                }
                return Err(refuse(stream, e));
            }
        };
        let local = match verbs.connect(&qp, port, &remote) {
            Ok(l) => l,
            Err(e) => {
                if let Some(p) = own {
                    p.release(&self.registry);
                }
                let why = format!(
                    "no RDMA path from {} to the sender: {e}",
                    verbs.port_name(port)
                );
                return Err(refuse(stream, why));
            }
        };
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(None).map_err(|e| e.to_string())?;
        let (cq, channel) = verbs.recv_cq_and_channel(port)?;
        let mut rx = self.rx.lock().expect("rx poisoned");
        if let Some(p) = own {
            rx.pools.insert(key, p);
        }
        if !rx.rdma_cqs.iter().any(|(p, _)| *p == port) {
            rx.rdma_cqs.push((port, cq));
            rx.rdma_channels.push(channel);
        }
        if rx.wcs.is_empty() {
            rx.wcs = vec![WorkCompletion::default(); 32];
        }
        let io = RdmaRecv {
            credits: Box::new(credits),
            port,
        };
        let conn = InConn::new(id, from, key, stream, Box::new(io), lane, Some(permit));
        self.admit(rx, conn, |_| Ok(local.encode().to_vec()))
    }

    /// The shared receive queue of RDMA rail `port`, made with its pool on first use.
    fn shared_rdma_pool(
        &self,
        verbs: &Arc<MessageVerbs>,
        port: usize,
    ) -> std::result::Result<SharedReceiveQueue, String> {
        let key = SHARED_RDMA + port as u64;
        let srq_of = |p: &Pool| match p.hw.as_ref().map(|h| &h.target) {
            Some(ReceiveTarget::Shared(srq)) => Some(srq.clone()),
            _ => None,
        };
        if let Some(srq) = self
            .rx
            .lock()
            .expect("rx poisoned")
            .pools
            .get(&key)
            .and_then(srq_of)
        {
            return Ok(srq);
        }
        // Made outside the lock; one made twice by a race is dropped again.
        let settings = ReceiveSettings {
            shared_receive_queue: true,
            ..self.rdma
        };
        let mut pool = Pool::new(&self.registry, settings, false).map_err(|e| e.to_string())?;
        let made = verbs.shared_receive_queue(port, &settings).and_then(|srq| {
            let lkeys = verbs.lkeys(port, &pool.chunks)?;
            let hw = PostedReceives::new(
                verbs,
                ReceiveTarget::Shared(srq.clone()),
                port,
                lkeys,
                &settings,
            )?;
            pool.attach(hw)?;
            Ok(srq)
        });
        let srq = match made {
            Ok(s) => s,
            Err(e) => {
                pool.release(&self.registry);
                return Err(e);
            }
        };
        let mut rx = self.rx.lock().expect("rx poisoned");
        if let Some(existing) = rx.pools.get(&key).and_then(srq_of) {
            drop(rx);
            pool.release(&self.registry);
            return Ok(existing);
        }
        rx.pools.insert(key, pool);
        Ok(srq)
    }

    /// A queue pair with a receive queue of its own for `remote`, and the pool feeding it.
    fn own_rdma_pool(
        &self,
        verbs: &Arc<MessageVerbs>,
        remote: &MessageEndpoint,
    ) -> std::result::Result<(Arc<QueuePair>, CompletionQueue, Pool), String> {
        let settings = self.rdma;
        let port = remote.rail as usize;
        let (qp, credit_cq) = verbs.receiving_qp(
            remote,
            None,
            settings.queue_depth as u32,
            settings.max_sge as u32,
        )?;
        let qp = Arc::new(qp);
        let mut pool = Pool::new(&self.registry, settings, false).map_err(|e| e.to_string())?;
        let attached = verbs.lkeys(port, &pool.chunks).and_then(|lkeys| {
            let hw = PostedReceives::new(
                verbs,
                ReceiveTarget::Own(qp.clone()),
                port,
                lkeys,
                &settings,
            )?;
            pool.attach(hw)
        });
        match attached {
            Ok(()) => Ok((qp, credit_cq, pool)),
            Err(e) => {
                pool.release(&self.registry);
                Err(e)
            }
        }
    }

    /// Takes in what the receive completion queues of the RDMA rails hold. Returns true when
    /// a connection was fenced or ended (the lanes need settling).
    pub(in crate::messaging) fn poll_rdma(
        &self,
        rdma_cqs: &[(usize, CompletionQueue)],
        wcs: &mut [WorkCompletion],
        conns: &mut [InConn],
        pools: &mut Pools,
        delivered: &mut Delivered,
        touched: &mut Vec<u64>,
    ) -> bool {
        let mut dirty = false;
        for (port, cq) in rdma_cqs.iter() {
            loop {
                let n = match cq.poll(wcs) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::error!(error = %e, "polling a message completion queue");
                        break;
                    }
                };
                for wc in &wcs[..n] {
                    if take_in_rdma(*port, wc, conns, pools, delivered, touched) {
                        dirty = true;
                    }
                }
                if let (Ok(v), true) = (&self.verbs, n > 0) {
                    let landed = wcs[..n].iter().filter(|w| w.is_success()).count();
                    v.counters
                        .received
                        .fetch_add(landed as u64, Ordering::Relaxed);
                }
                if n < wcs.len() {
                    break;
                }
            }
        }
        dirty
    }
}

/// One completion of RDMA rail `port`'s receive queue: a message that landed in a receive
/// buffer, or an error that breaks its queue pair's connection. A buffer of the rail's shared
/// queue that the hardware filled for no connection (it is gone) or for a message that breaks
/// its connection goes back to the queue, as the accounting still counts it posted.
fn take_in_rdma(
    port: usize,
    wc: &WorkCompletion,
    conns: &mut [InConn],
    pools: &mut Pools,
    delivered: &mut Delivered,
    touched: &mut Vec<u64>,
) -> bool {
    let buf = BufferId(u32::try_from(wc.wr_id()).unwrap_or(u32::MAX));
    let qp_num = wc.qp_num();
    let shared_key = SHARED_RDMA + port as u64;
    // A connection marked dead is still found: its last messages landed before it closed.
    let conn = conns.iter_mut().find(|c| {
        (&*c.io as &dyn std::any::Any)
            .downcast_ref::<RdmaRecv>()
            .is_some_and(|r| r.port == port && r.credits.qp().qp_num() == qp_num)
    });
    let Some(c) = conn else {
        if let Some(pool) = pools.get_mut(&shared_key) {
            pool.repost_unaccounted(buf);
        }
        return false;
    };
    let Some(pool) = pools.get_mut(&c.pool) else {
        return false;
    };
    touched.push(c.pool);
    let max_len = pool.queue.settings().buffer_size;
    let arrived = if !wc.is_success() {
        Err(format!(
            "receive failed: status {} (vendor error {:#x})",
            wc.status().0,
            wc.vendor_err()
        ))
    } else {
        let len = wc.byte_len() as usize;
        match wc.imm_data() {
            Some(code) => arrived_kind(code, len, max_len).map(|kind| (kind, len)),
            None => Err("a message without its kind".into()),
        }
    };
    let accounted = arrived.and_then(|(kind, len)| {
        pool.queue
            .on_arrival_posted(c.id, buf)
            .map(|landed| (kind, landed, len))
            .map_err(|e| e.to_string())
    });
    let hold = c.held_back.then_some(c.id);
    let failed = match accounted {
        Ok(_) if c.fenced => Some("a message after the lane's fence".to_owned()),
        Ok((kind, landed, len)) => {
            match take_in(&c.from, c.pool, pool, kind, landed, len, hold, delivered) {
                Ok(fence) => {
                    c.fenced |= fence;
                    None
                }
                Err(e) => Some(e),
            }
        }
        Err(reason) => {
            // A queue of the connection's own is in error and goes with it; a shared one
            // takes the buffer back.
            if c.pool == shared_key {
                pool.repost_unaccounted(buf);
            }
            Some(reason)
        }
    };
    if let Some(reason) = failed {
        if !c.dead {
            tracing::warn!(peer = %c.from, %reason, "closed message connection");
            c.dead = true;
        }
    }
    c.dead || c.fenced
}
