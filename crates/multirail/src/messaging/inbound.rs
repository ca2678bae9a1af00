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
    /// The next poll also checks that shm senders are still connected.
    pub(super) liveness_due: bool,
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
        let from: Arc<str> = String::from_utf8(opening[3..].to_vec())
            .map_err(|_| "sender name is not UTF-8".to_string())?
            .into();
        let shm = match mode {
            MODE_TCP => false,
            MODE_SHM => true,
            m => return Err(format!("unknown message mode {m}")),
        };
        let settings = if shm { self.shm } else { self.tcp };
        let id = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        let key = match (settings.shared_receive_queue, shm) {
            (true, false) => SHARED_TCP,
            (true, true) => SHARED_SHM,
            (false, _) => id.0,
        };
        let refuse = |mut stream: TcpStream, reason: String| {
            let mut msg = vec![1u8];
            msg.extend_from_slice(&(reason.len() as u16).to_le_bytes());
            msg.extend_from_slice(reason.as_bytes());
            let _ = stream.write_all(&msg);
            reason
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

    /// Receives what arrived on every connection into receive buffers.
    pub(super) fn poll(&self, rx: &mut Rx) {
        let Rx {
            conns,
            pools,
            ready,
            notifications,
            touched,
            liveness_due,
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
            if let Some(p) = rx.pools.get_mut(&c.pool) {
                p.queue.remove_connection(c.id);
            }
            if let InIo::Shm { ring_buf, .. } = &c.io {
                let _ = self.registry.unregister(ring_buf.addr());
            }
            let in_use = rx.ready.iter().any(|r| r.pool == c.pool)
                || rx.after_reply.iter().any(|r| r.0 == c.pool);
            if c.pool >= 2 && !in_use {
                if let Some(p) = rx.pools.remove(&c.pool) {
                    p.release(&self.registry);
                }
            }
        }
    }

    pub(super) fn consume(&self, rx: &mut Rx, pool: u64, buf: BufferId) {
        if let Some(p) = rx.pools.get_mut(&pool) {
            if let Err(e) = p.queue.on_consumed(buf) {
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
    let key = c.pool;
    let mut deliver = |pool: &mut Pool,
                       kind: MsgKind,
                       named: Option<BufferId>,
                       src: Option<&[u8]>,
                       len: usize|
     -> std::result::Result<(), String> {
        let buf = pool
            .queue
            .on_arrival(c.id, named)
            .map_err(|e| e.to_string())?;
        let dst = pool.ptr(buf);
        if let Some(src) = src {
            // SAFETY: `dst` is a posted buffer of `buffer_size >= len` bytes nothing else
            // touches until it is consumed.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len) };
        }
        if kind == MsgKind::Notification {
            // SAFETY: as above; the bytes are in place.
            let bytes = unsafe { std::slice::from_raw_parts(dst, len) };
            notifications.push_back(Notification {
                from: c.from.to_string(),
                msg: String::from_utf8_lossy(bytes).into_owned(),
            });
            pool.queue.on_consumed(buf).map_err(|e| e.to_string())?;
        } else {
            ready.push_back(Ready {
                from: c.from.clone(),
                pool: key,
                buf,
                len,
            });
        }
        Ok(())
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
    }
    Ok(())
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
