//! The receiving side of messages: accepted connections, receive buffers and credits,
//! and the caller's polling of them (`recv`, notifications).

use super::*;

pub(super) enum InIo {
    Tcp {
        staging: Box<[u8]>,
        start: usize,
        end: usize,
    },
    Shm {
        ring: Ring,
        ring_buf: Buffer,
    },
    /// Messages arrive through the queue pair into the pool's receive queue and are taken in
    /// by polling the rail's completion queue; credits go back as RDMA writes through the same
    /// queue pair. The stream only tells when the sender leaves.
    Rdma {
        credits: Box<CreditWriter>,
        port: usize,
    },
}

/// A connection some sender opened to us.
pub(super) struct InConn {
    pub(super) id: ConnId,
    pub(super) from: Arc<str>,
    pub(super) pool: u64,
    pub(super) stream: TcpStream,
    pub(super) io: InIo,
    pub(super) dead: bool,
    /// Counts the connection against the port's `max_connections` until it is dropped.
    pub(super) _permit: ConnPermit,
}

pub(super) struct Ready {
    pub(super) from: Arc<str>,
    pub(super) pool: u64,
    pub(super) buf: BufferId,
    pub(super) len: usize,
}

#[derive(Default)]
pub(super) struct Rx {
    pub(super) conns: Vec<InConn>,
    pub(super) pools: Pools,
    pub(super) ready: VecDeque<Ready>,
    pub(super) notifications: VecDeque<Notification>,
    /// Consumed buffers to return after the next reply (`return_order: after_reply`).
    pub(super) after_reply: Vec<(u64, BufferId)>,
    /// Pools that took in messages during a poll (kept to avoid allocating per poll).
    pub(super) touched: Vec<u64>,
    /// The next poll also checks that shm and rdma senders are still connected.
    pub(super) liveness_due: bool,
    /// The receive completion queue of every RDMA rail a message connection uses.
    pub(super) rdma_cqs: Vec<(usize, CompletionQueue)>,
    /// Completions polled at once (kept to avoid allocating per poll).
    pub(super) wcs: Vec<WorkCompletion>,
}

impl Messaging {
    /// Target side: a sender opened a message connection and the server read its `opening`
    /// (mode, name length, name; see [`opening_len`]) on one of its threads.
    pub(crate) fn accept(
        &self,
        mut stream: TcpStream,
        opening: &[u8],
        permit: ConnPermit,
    ) -> std::result::Result<(), String> {
        if opening_len(opening)? != Some(opening.len()) {
            return Err("incomplete message opening".into());
        }
        let mode = opening[0];
        let shm = match mode {
            MODE_TCP => false,
            MODE_SHM => true,
            MODE_RDMA => {
                let name_end = opening.len() - ENDPOINT_LEN;
                let from: Arc<str> = String::from_utf8(opening[3..name_end].to_vec())
                    .map_err(|_| "sender name is not UTF-8".to_string())?
                    .into();
                return self.accept_rdma(stream, from, &opening[name_end..], permit);
            }
            m => return Err(format!("unknown message mode {m}")),
        };
        let from: Arc<str> = String::from_utf8(opening[3..].to_vec())
            .map_err(|_| "sender name is not UTF-8".to_string())?
            .into();
        let settings = if shm { self.shm } else { self.tcp };
        let id = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        let key = match (settings.shared_receive_queue, shm) {
            (true, false) => SHARED_TCP,
            (true, true) => SHARED_SHM,
            (false, _) => id.0,
        };
        // Allocate outside the lock; a shared pool made twice by a race is dropped again.
        let fresh = {
            let exists = self
                .rx
                .lock()
                .expect("rx poisoned")
                .pools
                .contains_key(&key);
            if exists {
                None
            } else {
                // Grants go out in batches on shm too: posting one at a time costs the receiver
                // a ring write per message and saves the sender nothing.
                match Pool::new(&self.registry, settings, false) {
                    Ok(p) => Some(p),
                    Err(e) => return Err(refuse(stream, format!("receive pool: {e}"))),
                }
            }
        };
        let ring_buf = if shm {
            match self
                .registry
                .allocate(Ring::bytes(settings.queue_depth), Location::Any)
            {
                Ok(b) => Some(b),
                Err(e) => return Err(refuse(stream, format!("message ring: {e}"))),
            }
        } else {
            None
        };
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(None).map_err(|e| e.to_string())?;
        let mut rx = self.rx.lock().expect("rx poisoned");
        if let Some(p) = fresh {
            if let Some(extra) = rx.pools.insert(key, p) {
                // Keep the pool already serving connections.
                let mine = rx.pools.insert(key, extra).expect("just inserted");
                mine.release(&self.registry);
            }
        }
        let pool = rx.pools.get_mut(&key).expect("pool present");
        if let Err(e) = pool.queue.add_connection(id) {
            drop(rx);
            return Err(refuse(stream, e.to_string()));
        }
        let mut reply = vec![0u8];
        reply.extend_from_slice(&(settings.buffer_size as u32).to_le_bytes());
        let io = match ring_buf {
            None => InIo::Tcp {
                staging: vec![0u8; (64 << 10).max(2 * (MSG_HEADER_LEN + settings.buffer_size))]
                    .into_boxed_slice(),
                start: 0,
                end: 0,
            },
            Some(ring_buf) => {
                reply.extend_from_slice(&(settings.queue_depth as u32).to_le_bytes());
                reply.extend_from_slice(&(settings.buffers_per_chunk() as u32).to_le_bytes());
                reply.extend_from_slice(&ring_buf.addr().to_le_bytes());
                reply.extend_from_slice(&(ring_buf.len() as u64).to_le_bytes());
                reply.extend_from_slice(&(pool.chunks.len() as u32).to_le_bytes());
                for c in &pool.chunks {
                    reply.extend_from_slice(&c.addr().to_le_bytes());
                }
                reply.extend_from_slice(&(settings.chunk_bytes() as u64).to_le_bytes());
                InIo::Shm {
                    // SAFETY: a fresh zeroed mapping of `Ring::bytes(depth)` bytes, kept alive
                    // by `ring_buf` beside it.
                    ring: unsafe { Ring::new(ring_buf.as_ptr(), settings.queue_depth) },
                    ring_buf,
                }
            }
        };
        stream
            .write_all(&reply)
            .map_err(|e| format!("answering message opening: {e}"))?;
        rx.conns.push(InConn {
            id,
            from,
            pool: key,
            stream,
            io,
            dead: false,
            _permit: permit,
        });
        let Rx { conns, pools, .. } = &mut *rx;
        grant(conns, pools, key);
        Ok(())
    }

    /// Target side of a message connection over RDMA: makes the queue pair for the sender's
    /// `endpoint`, its receives from the rail's shared pool or a pool of its own, and answers
    /// with the queue pair's endpoint. Fails (telling the sender why) when RDMA is off here,
    /// the rail does not exist or the path does not connect.
    fn accept_rdma(
        &self,
        stream: TcpStream,
        from: Arc<str>,
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
        let made = if settings.shared_receive_queue {
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
        let cq = verbs.recv_cq(port)?;
        let mut rx = self.rx.lock().expect("rx poisoned");
        if let Some(p) = own {
            rx.pools.insert(key, p);
        }
        let pool = rx.pools.get_mut(&key).expect("pool present");
        if let Err(e) = pool.queue.add_connection(id) {
            drop(rx);
            return Err(refuse(stream, e.to_string()));
        }
        let mut reply = vec![0u8];
        reply.extend_from_slice(&(settings.buffer_size as u32).to_le_bytes());
        reply.extend_from_slice(&local.encode());
        (&stream)
            .write_all(&reply)
            .map_err(|e| format!("answering message opening: {e}"))?;
        if !rx.rdma_cqs.iter().any(|(p, _)| *p == port) {
            rx.rdma_cqs.push((port, cq));
        }
        if rx.wcs.is_empty() {
            rx.wcs = vec![WorkCompletion::default(); 32];
        }
        rx.conns.push(InConn {
            id,
            from,
            pool: key,
            stream,
            io: InIo::Rdma {
                credits: Box::new(credits),
                port,
            },
            dead: false,
            _permit: permit,
        });
        let Rx { conns, pools, .. } = &mut *rx;
        grant(conns, pools, key);
        Ok(())
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
        let settings = self.rdma;
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

    /// Receives what arrived on every connection into receive buffers.
    pub(super) fn poll(&self, rx: &mut Rx) {
        let Rx {
            conns,
            pools,
            ready,
            notifications,
            touched,
            liveness_due,
            rdma_cqs,
            wcs,
            ..
        } = rx;
        let liveness = std::mem::take(liveness_due);
        touched.clear();
        for c in conns.iter_mut().filter(|c| !c.dead) {
            let pool = pools.get_mut(&c.pool).expect("connection's pool");
            let before = ready.len() + notifications.len();
            if let Err(reason) = receive(c, pool, ready, notifications, liveness) {
                tracing::warn!(peer = %c.from, %reason, "closed message connection");
                c.dead = true;
            }
            if c.dead || ready.len() + notifications.len() != before {
                touched.push(c.pool);
            }
        }
        // After the connections: a sender that closed waited for its last messages to land, so
        // they are all in the completion queues now.
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
                    take_in_rdma(*port, wc, conns, pools, ready, notifications, touched);
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
        if conns.iter().any(|c| c.dead) {
            self.reap(rx);
        }
        let Rx {
            conns,
            pools,
            touched,
            ..
        } = rx;
        touched.dedup();
        for &key in touched.iter() {
            grant(conns, pools, key);
        }
    }

    /// Drops dead connections and per-connection pools nothing refers to any more.
    pub(super) fn reap(&self, rx: &mut Rx) {
        let mut i = 0;
        while i < rx.conns.len() {
            if !rx.conns[i].dead {
                i += 1;
                continue;
            }
            let c = rx.conns.swap_remove(i);
            let (key, id) = (c.pool, c.id);
            if let InIo::Shm { ring_buf, .. } = &c.io {
                let _ = self.registry.unregister(ring_buf.addr());
            }
            // The queue pair goes now: nothing lands in the buffers granted to it any more.
            drop(c);
            if let Some(p) = rx.pools.get_mut(&key) {
                p.queue.remove_connection(id);
            }
            let in_use =
                rx.ready.iter().any(|r| r.pool == key) || rx.after_reply.iter().any(|r| r.0 == key);
            if per_connection(key) && !in_use {
                if let Some(p) = rx.pools.remove(&key) {
                    p.release(&self.registry);
                }
            }
        }
    }

    pub(super) fn consume(&self, rx: &mut Rx, pool: u64, buf: BufferId) {
        if let Some(p) = rx.pools.get_mut(&pool) {
            if let Err(e) = p.consumed(buf) {
                tracing::error!(error = %e, "receive accounting");
            }
        }
        let Rx { conns, pools, .. } = rx;
        grant(conns, pools, pool);
    }

    /// Returns the buffers held for `after_reply`.
    pub(super) fn release_after_reply(&self) {
        let mut rx = self.rx.lock().expect("rx poisoned");
        self.after_reply_pending.store(false, Ordering::Relaxed);
        let held = std::mem::take(&mut rx.after_reply);
        for (pool, buf) in held {
            self.consume(&mut rx, pool, buf);
        }
    }

    pub(super) fn take_ready(&self, rx: &mut Rx) -> Option<Message> {
        let r = rx.ready.pop_front()?;
        let pool = rx.pools.get(&r.pool).expect("pool of a ready message");
        // SAFETY: the buffer holds `len <= buffer_size` bytes of a message no sender may
        // overwrite until we post it again below.
        let data = unsafe { std::slice::from_raw_parts(pool.ptr(r.buf), r.len) }.to_vec();
        let order = pool.queue.settings().return_order;
        match order {
            ReturnOrder::BeforeReply => self.consume(rx, r.pool, r.buf),
            ReturnOrder::AfterReply => {
                rx.after_reply.push((r.pool, r.buf));
                self.after_reply_pending.store(true, Ordering::Relaxed);
            }
        }
        Some(Message { from: r.from, data })
    }

    pub(crate) fn recv(&self, timeout: Option<Duration>) -> Result<Option<Message>> {
        // The clock is read only once a wait gets long enough to look at it.
        let mut start: Option<Instant> = None;
        if self.after_reply_pending.load(Ordering::Relaxed) {
            // A receive with buffers still held for a reply that never came: return them.
            self.release_after_reply();
        }
        let mut idle = 0u32;
        loop {
            {
                let mut rx = self.rx.lock().expect("rx poisoned");
                if let Some(m) = self.take_ready(&mut rx) {
                    return Ok(Some(m));
                }
                self.poll(&mut rx);
                if let Some(m) = self.take_ready(&mut rx) {
                    return Ok(Some(m));
                }
            }
            // Reading the clock costs as much as a poll: look at it every 32 polls.
            idle = idle.wrapping_add(1);
            if !idle.is_multiple_of(32) {
                std::hint::spin_loop();
                continue;
            }
            let waited = start.get_or_insert_with(Instant::now).elapsed();
            if timeout.is_some_and(|t| waited >= t) {
                return Ok(None);
            }
            if waited > SPIN && idle.is_multiple_of(64) {
                self.rx.lock().expect("rx poisoned").liveness_due = true;
                back_off(waited);
            }
        }
    }

    pub(crate) fn notifications(&self) -> Vec<Notification> {
        let mut rx = self.rx.lock().expect("rx poisoned");
        rx.liveness_due = true;
        self.poll(&mut rx);
        rx.notifications.drain(..).collect()
    }
}

/// Tells senders about buffers posted for them.
pub(super) fn grant(conns: &mut [InConn], pools: &mut Pools, key: u64) {
    let Some(pool) = pools.get_mut(&key) else {
        return;
    };
    while let Some(to) = pool.queue.poll_grant_into(pool.eager, &mut pool.granting) {
        let Some(c) = conns.iter_mut().find(|c| c.id == to) else {
            continue;
        };
        match &mut c.io {
            InIo::Rdma { credits, .. } => {
                if let Err(e) = credits.grant(pool.granting.len()) {
                    tracing::warn!(peer = %c.from, error = %e, "cannot send credits");
                    c.dead = true;
                }
            }
            InIo::Tcp { .. } => {
                let mut h = [0u8; MSG_HEADER_LEN];
                MsgHeader {
                    kind: MsgKind::Credit,
                    len: pool.granting.len() as u32,
                }
                .encode(&mut h);
                if let Err(e) = (&c.stream).write_all(&h) {
                    tracing::warn!(peer = %c.from, error = %e, "cannot send credits");
                    c.dead = true;
                }
            }
            InIo::Shm { ring, .. } => ring.post(&pool.granting),
        }
    }
}

/// Takes in what one connection has delivered.
pub(super) fn receive(
    c: &mut InConn,
    pool: &mut Pool,
    ready: &mut VecDeque<Ready>,
    notifications: &mut VecDeque<Notification>,
    liveness: bool,
) -> std::result::Result<(), String> {
    let max_len = pool.queue.settings().buffer_size as u32;
    let (id, key) = (c.id, c.pool);
    let from = &c.from;
    let mut deliver = |pool: &mut Pool,
                       kind: MsgKind,
                       named: Option<BufferId>,
                       src: Option<&[u8]>,
                       len: usize|
     -> std::result::Result<(), String> {
        let buf = pool
            .queue
            .on_arrival(id, named)
            .map_err(|e| e.to_string())?;
        if let Some(src) = src {
            // SAFETY: a posted buffer of `buffer_size >= len` bytes nothing else touches
            // until it is consumed.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), pool.ptr(buf), len) };
        }
        take_in(from, key, pool, kind, buf, len, ready, notifications)
    };
    match &mut c.io {
        InIo::Tcp {
            staging,
            start,
            end,
        } => {
            if *start > 0 && staging.len() - *end < MSG_HEADER_LEN + max_len as usize {
                staging.copy_within(*start..*end, 0);
                *end -= *start;
                *start = 0;
            }
            match sockio::recv_nonblocking(c.stream.as_raw_fd(), &mut staging[*end..]) {
                Ok(None) => return Ok(()),
                Ok(Some(0)) => {
                    c.dead = true;
                    return if start == end {
                        Ok(())
                    } else {
                        Err("closed inside a message".into())
                    };
                }
                Ok(Some(n)) => *end += n,
                Err(e) => return Err(format!("reading messages: {e}")),
            }
            while *end - *start >= MSG_HEADER_LEN {
                let h = MsgHeader::decode(&staging[*start..*end], max_len)?;
                if h.kind == MsgKind::Credit {
                    return Err("a sender sent credits".into());
                }
                let total = MSG_HEADER_LEN + h.len as usize;
                if *end - *start < total {
                    break;
                }
                let body = &staging[*start + MSG_HEADER_LEN..*start + total];
                deliver(pool, h.kind, None, Some(body), h.len as usize)?;
                *start += total;
            }
            if start == end {
                *start = 0;
                *end = 0;
            }
        }
        InIo::Shm { ring, .. } => {
            ring.completions(|buf, len, kind, inline| {
                let kind = match kind {
                    1 => MsgKind::Message,
                    2 => MsgKind::Notification,
                    k => return Err(format!("unknown message kind {k}")),
                };
                if len > max_len as usize {
                    return Err(format!("message of {len} bytes above {max_len}"));
                }
                deliver(pool, kind, Some(buf), inline, len)
            })?;
            // Only while waiting: a syscall every so many polls would show up as a periodic
            // pattern in the round trips (pingpong found one every ~4096 polls).
            if liveness {
                let mut b = [0u8; 1];
                if let Ok(Some(0)) = sockio::recv_nonblocking(c.stream.as_raw_fd(), &mut b) {
                    // Gone; whatever it wrote before closing was taken in above.
                    c.dead = true;
                }
            }
        }
        InIo::Rdma { .. } => {
            // Messages come through the completion queue; the stream only says when the
            // sender leaves (checked while waiting, as for shm).
            if liveness {
                let mut b = [0u8; 1];
                match sockio::recv_nonblocking(c.stream.as_raw_fd(), &mut b) {
                    Ok(Some(0)) => c.dead = true,
                    Ok(Some(_)) => return Err("a sender wrote on its RDMA message stream".into()),
                    Ok(None) => {}
                    Err(e) => return Err(format!("message stream: {e}")),
                }
            }
        }
    }
    Ok(())
}

/// A message of `len` bytes is in buffer `buf` of `pool`: a notification is taken out and the
/// buffer returned at once; a message waits for `recv`.
#[allow(clippy::too_many_arguments)]
fn take_in(
    from: &Arc<str>,
    key: u64,
    pool: &mut Pool,
    kind: MsgKind,
    buf: BufferId,
    len: usize,
    ready: &mut VecDeque<Ready>,
    notifications: &mut VecDeque<Notification>,
) -> std::result::Result<(), String> {
    if kind == MsgKind::Notification {
        // SAFETY: the buffer holds the message's `len` bytes until it is consumed below.
        let bytes = unsafe { std::slice::from_raw_parts(pool.ptr(buf), len) };
        notifications.push_back(Notification {
            from: from.to_string(),
            msg: String::from_utf8_lossy(bytes).into_owned(),
        });
        pool.consumed(buf)
    } else {
        ready.push_back(Ready {
            from: from.clone(),
            pool: key,
            buf,
            len,
        });
        Ok(())
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
    ready: &mut VecDeque<Ready>,
    notifications: &mut VecDeque<Notification>,
    touched: &mut Vec<u64>,
) {
    let buf = BufferId(u32::try_from(wc.wr_id()).unwrap_or(u32::MAX));
    let qp_num = wc.qp_num();
    let shared_key = SHARED_RDMA + port as u64;
    // A connection marked dead is still found: its last messages landed before it closed.
    let conn = conns.iter_mut().find(
        |c| matches!(&c.io, InIo::Rdma { credits, port: p } if *p == port && credits.qp().qp_num() == qp_num),
    );
    let Some(c) = conn else {
        if let Some(pool) = pools.get_mut(&shared_key) {
            pool.repost_unaccounted(buf);
        }
        return;
    };
    let Some(pool) = pools.get_mut(&c.pool) else {
        return;
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
            _ if len > max_len => Err(format!("message of {len} bytes above {max_len}")),
            Some(1) => Ok((MsgKind::Message, len)),
            Some(2) => Ok((MsgKind::Notification, len)),
            Some(k) => Err(format!("unknown message kind {k}")),
            None => Err("a message without its kind".into()),
        }
    };
    let accounted = arrived.and_then(|(kind, len)| {
        pool.queue
            .on_arrival_posted(c.id, buf)
            .map(|landed| (kind, landed, len))
            .map_err(|e| e.to_string())
    });
    let failed = match accounted {
        Ok((kind, landed, len)) => take_in(
            &c.from,
            c.pool,
            pool,
            kind,
            landed,
            len,
            ready,
            notifications,
        )
        .err(),
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
}

/// Refuses a message connection, telling the sender why; returns the reason.
fn refuse(mut stream: TcpStream, reason: String) -> String {
    let mut msg = vec![1u8];
    let text = &reason.as_bytes()[..reason.len().min(u16::MAX as usize)];
    msg.extend_from_slice(&(text.len() as u16).to_le_bytes());
    msg.extend_from_slice(text);
    let _ = stream.write_all(&msg);
    reason
}

impl crate::server::MessageListener for Messaging {
    fn opening_len(&self, prefix: &[u8]) -> std::result::Result<Option<usize>, String> {
        opening_len(prefix)
    }

    fn accept(
        &self,
        stream: TcpStream,
        opening: &[u8],
        permit: ConnPermit,
    ) -> std::result::Result<(), String> {
        Messaging::accept(self, stream, opening, permit)
    }
}
