//! The receiving side of messages: accepted connections, receive buffers and credits,
//! and the caller's polling of them (`recv`, notifications).

use super::duplex;
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
    /// The shared lane over shm under dynamic lanes: messages come through the receiver's one
    /// shared ring (`Rx::shared_shm`) under `tag`; the stream only tells when the sender
    /// leaves and carries lane answers back.
    ShmShared {
        tag: u32,
        /// Which ring the tag is in (a corrupt ring is replaced by a new one).
        generation: u32,
        /// The ring's reservation count when the sender was seen gone: once the receiver has
        /// taken in that much, nothing more of this sender's can come.
        closing_at: Option<u64>,
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
    /// The sender's lane this connection is, and its place among the sender's connections.
    pub(super) lane: Lane,
    pub(super) epoch: u32,
    /// The sender sent this lane's fence: nothing more comes on it.
    pub(super) fenced: bool,
    /// An earlier lane of the same sender is still open: what arrives here waits in
    /// `Delivered::held` until that lane's fence (or end).
    pub(super) held_back: bool,
    /// A tcp connection on the shared lane, read when the receive poll's epoll set says it
    /// is readable rather than tried on every poll.
    pub(super) watched: bool,
    /// A dedicated tcp lane's socket, which may carry a lane of ours the other way (see
    /// `duplex`): what it shares with that lane.
    pub(super) duplex: Option<Arc<Duplex>>,
    /// The sender closed the stream (its end was read).
    pub(super) ended: bool,
    /// Counts an accepted connection against the port's `max_connections` until it is
    /// dropped (a reverse lane on a socket we opened has none).
    pub(super) _permit: Option<ConnPermit>,
}

impl InConn {
    /// What is left of a dead connection on a duplex socket that did not end: a reader of the
    /// socket's other lane and end (see `duplex`). Anything else closes (the queue pair of an
    /// RDMA lane goes now: nothing lands in the buffers granted to it any more).
    fn into_reader(self) -> Option<Reader> {
        let InConn {
            from,
            stream,
            io,
            duplex,
            ended,
            fenced,
            _permit,
            ..
        } = self;
        let duplex = duplex?;
        duplex.set_in_carried(false);
        match io {
            InIo::Tcp {
                staging,
                start,
                end,
            } if fenced && !ended => Some(Reader {
                from,
                stream,
                staging,
                start,
                end,
                duplex,
                may_open: false,
                shut: false,
                _permit,
            }),
            _ => {
                duplex.set_closed();
                None
            }
        }
    }

    /// Read on every poll by itself, rather than through the shared lane's epoll set or
    /// shared ring, or the RDMA completion queues.
    fn polled_alone(&self) -> bool {
        !self.watched && !matches!(self.io, InIo::ShmShared { .. })
    }
}

impl InConn {
    pub(super) fn new(
        id: ConnId,
        from: Arc<str>,
        pool: u64,
        stream: TcpStream,
        io: InIo,
        (lane, epoch): (Lane, u32),
        permit: Option<ConnPermit>,
    ) -> InConn {
        InConn {
            id,
            from,
            pool,
            stream,
            io,
            dead: false,
            lane,
            epoch,
            fenced: false,
            held_back: false,
            watched: false,
            duplex: None,
            ended: false,
            _permit: permit,
        }
    }
}

pub(super) struct Ready {
    pub(super) from: Arc<str>,
    pub(super) body: Body,
}

/// Where a message's bytes wait for `recv`.
pub(super) enum Body {
    /// In receive buffer `buf` of pool `pool`, which goes back to the sender once consumed.
    Pooled {
        pool: u64,
        buf: BufferId,
        len: usize,
    },
    /// Copied out of the shared shm ring when it was taken in, so the ring's space went back
    /// to every sender at once.
    Owned(Vec<u8>),
}

impl Ready {
    fn uses_pool(&self, key: u64) -> bool {
        matches!(self.body, Body::Pooled { pool, .. } if pool == key)
    }
}

/// What arrived: messages and notifications to hand out, and what waits for an earlier lane.
#[derive(Default)]
pub(super) struct Delivered {
    pub(super) ready: VecDeque<Ready>,
    pub(super) notifications: VecDeque<Notification>,
    /// Arrived on a lane whose predecessor has not ended yet, in arrival order.
    pub(super) held: VecDeque<Held>,
    /// Lane messages for the granting negotiation, with their sender, in order.
    pub(super) lanes: VecDeque<(Arc<str>, LaneMsg)>,
}

/// A message or notification held back, with the connection it came on.
pub(super) struct Held {
    conn: ConnId,
    item: HeldItem,
}

enum HeldItem {
    Message(Ready),
    Notification(Notification),
    Lane(Arc<str>, LaneMsg),
}

impl Delivered {
    fn count(&self) -> usize {
        self.ready.len() + self.notifications.len() + self.held.len() + self.lanes.len()
    }

    /// Hands out what connection `conn` had held back, in arrival order.
    fn release(&mut self, conn: ConnId) {
        let mut kept = VecDeque::with_capacity(self.held.len());
        for h in self.held.drain(..) {
            if h.conn != conn {
                kept.push_back(h);
                continue;
            }
            match h.item {
                HeldItem::Message(r) => self.ready.push_back(r),
                HeldItem::Notification(n) => self.notifications.push_back(n),
                HeldItem::Lane(from, m) => self.lanes.push_back((from, m)),
            }
        }
        self.held = kept;
    }

    fn uses_pool(&self, key: u64) -> bool {
        self.ready.iter().any(|r| r.uses_pool(key))
            || self
                .held
                .iter()
                .any(|h| matches!(&h.item, HeldItem::Message(r) if r.uses_pool(key)))
    }
}

#[derive(Default)]
pub(super) struct Rx {
    /// Polls in a row that took in messages from tcp connections (see [`STREAM_STREAK`]).
    pub(super) tcp_streak: u32,
    /// The last poll took in messages from a tcp connection.
    pub(super) tcp_took_in: bool,
    pub(super) conns: Vec<InConn>,
    pub(super) pools: Pools,
    pub(super) delivered: Delivered,
    /// A connection was fenced, ended or added since the lanes were last settled.
    pub(super) lanes_dirty: bool,
    /// Pools of connections that are gone, kept until their last message is consumed.
    pub(super) orphans: Vec<u64>,
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
    /// Under dynamic lanes: the shared lane's tcp connections, asked once per poll which are
    /// readable, so a poll costs one system call for all of them instead of one each.
    pub(super) shared_tcp: Option<SharedTcp>,
    /// Under dynamic lanes: the shared lane's shm ring, made when its first sender connects.
    pub(super) shared_shm: Option<SharedShm>,
    /// The generation the next shared ring gets.
    pub(super) shared_shm_generation: u32,
    /// Duplex tcp sockets while they carry no lane to us (see `duplex`).
    pub(super) readers: Vec<Reader>,
    /// The index in `conns` of the only thing a poll reads, when that is one tcp connection
    /// (see `Messaging::poll_sole`).
    pub(super) sole_tcp: Option<usize>,
    /// Messages and bytes handed to the application (counted under this lock).
    pub(super) received: (u64, u64),
}

/// Spins for `d` without a system call (the pause is a few µs: a sleep would take tens).
fn pause(d: Duration) {
    let until = Instant::now() + d;
    loop {
        for _ in 0..32 {
            std::hint::spin_loop();
        }
        if Instant::now() >= until {
            return;
        }
    }
}

/// Reads of the only tcp connection between two full polls (see `Messaging::poll_sole`):
/// about 5 µs of system calls with the receive lock held.
const SOLE_READS: u32 = 16;

/// After this many polls in a row took in tcp messages, `recv` waits
/// `transports.tcp.stream_pause_us` before the next poll (see there).
const STREAM_STREAK: u32 = 4;

/// The epoll set of the shared lane's tcp connections and its event buffer.
pub(super) struct SharedTcp {
    epoll: Epoll,
    events: Vec<EpollEvent>,
    /// Connections in the set: with none, a poll makes no system call for it.
    watched: usize,
}

impl SharedTcp {
    /// An empty set. Fails when the kernel refuses an epoll instance.
    pub(super) fn new() -> std::io::Result<SharedTcp> {
        Ok(SharedTcp {
            epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?,
            events: vec![EpollEvent::empty(); 64],
            watched: 0,
        })
    }
}

impl Messaging {
    /// Target side: a sender opened a message connection and the server read its `opening`
    /// (mode, name length, name; see [`opening_len`]) on one of its threads.
    pub(crate) fn accept(
        &self,
        stream: TcpStream,
        opening: &[u8],
        permit: ConnPermit,
    ) -> std::result::Result<(), String> {
        if opening_len(opening)? != Some(opening.len()) {
            return Err("incomplete message opening".into());
        }
        let mode = opening[0];
        let name_end = 3 + u16::from_le_bytes([opening[1], opening[2]]) as usize;
        let from: Arc<str> = String::from_utf8(opening[3..name_end].to_vec())
            .map_err(|_| "sender name is not UTF-8".to_string())?
            .into();
        let lane = parse_lane(&opening[name_end..])?;
        let shm = match mode {
            MODE_TCP => false,
            MODE_SHM if lane.0 == Lane::Shared && self.dynamic.enabled() => {
                return self.accept_shared_shm(stream, from, lane, permit);
            }
            MODE_SHM => true,
            MODE_RDMA => {
                let endpoint = &opening[name_end + LANE_LEN..];
                return self.accept_rdma(stream, from, lane, endpoint, permit);
            }
            m => return Err(format!("unknown message mode {m}")),
        };
        let settings = if shm { self.shm } else { self.tcp };
        let id = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        // A dedicated lane has buffers of its own; a shared one takes the shared pool under
        // dynamic lanes, else the configured path.
        let shared = self.shared_pool_for(lane.0, &settings);
        let settings = ReceiveSettings {
            shared_receive_queue: shared,
            ..settings
        };
        let key = match (shared, shm) {
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
        let io = match ring_buf {
            None => InIo::Tcp {
                staging: duplex::staging(settings.buffer_size),
                start: 0,
                end: 0,
            },
            Some(ring_buf) => InIo::Shm {
                // SAFETY: a fresh zeroed mapping of `Ring::bytes(depth)` bytes, kept alive by
                // `ring_buf` beside it.
                ring: unsafe { Ring::new(ring_buf.as_ptr(), settings.queue_depth) },
                ring_buf,
            },
        };
        let dedicated_tcp = !shm && lane.0 == Lane::Dedicated;
        let mut conn = InConn::new(id, from, key, stream, io, lane, Some(permit));
        if dedicated_tcp {
            // Our own dedicated lane to this sender may start on this socket (see `duplex`).
            conn.duplex = Some(Duplex::new(false, 0, self.dynamic.enabled()));
        }
        self.admit(rx, conn, |pool, io| {
            let mut reply = Vec::new();
            if let InIo::Shm { ring_buf, .. } = io {
                reply.push(SHM_OWN_RING);
                reply.extend_from_slice(&(settings.queue_depth as u32).to_le_bytes());
                reply.extend_from_slice(&(settings.buffers_per_chunk() as u32).to_le_bytes());
                reply.extend_from_slice(&ring_buf.addr().to_le_bytes());
                reply.extend_from_slice(&(ring_buf.len() as u64).to_le_bytes());
                reply.extend_from_slice(&(pool.chunks.len() as u32).to_le_bytes());
                for c in &pool.chunks {
                    reply.extend_from_slice(&c.addr().to_le_bytes());
                }
                reply.extend_from_slice(&(settings.chunk_bytes() as u64).to_le_bytes());
                // How to map them, from the memory itself: a descriptor the sender cached may
                // name a buffer freed since, whose address (and descriptor number) was reused.
                let handles = std::iter::once(ring_buf)
                    .chain(pool.chunks.iter())
                    .map(Buffer::shm_handle)
                    .collect::<Option<Vec<_>>>()
                    .ok_or("receive buffers are not in shared memory")?;
                reply.extend_from_slice(&handles[0].pid.to_le_bytes());
                for h in &handles {
                    reply.extend_from_slice(&(h.fd as u32).to_le_bytes());
                }
            }
            Ok(reply)
        })
    }

    /// Adds connection `conn` to its pool and to the connections polled, after answering the
    /// opening with success, the receive buffer size and what `details` adds; then grants the
    /// sender its first credits. Refuses the connection, telling the sender why, when its pool
    /// takes no more connections or `details` fails.
    fn admit(
        &self,
        mut rx: std::sync::MutexGuard<'_, Rx>,
        conn: InConn,
        details: impl FnOnce(&Pool, &InIo) -> std::result::Result<Vec<u8>, String>,
    ) -> std::result::Result<(), String> {
        let key = conn.pool;
        let pool = rx.pools.get_mut(&key).expect("pool present");
        let answer = pool
            .queue
            .add_connection(conn.id)
            .map_err(|e| e.to_string())
            .and_then(|()| details(pool, &conn.io));
        let sent = answer.and_then(|answer| {
            let mut reply = vec![0u8];
            reply.extend_from_slice(&(pool.queue.settings().buffer_size as u32).to_le_bytes());
            reply.extend_from_slice(&answer);
            (&conn.stream)
                .write_all(&reply)
                .map_err(|e| format!("answering message opening: {e}"))
        });
        if let Err(e) = sent {
            pool.queue.remove_connection(conn.id);
            if per_connection(key) {
                if let Some(p) = rx.pools.remove(&key) {
                    p.release(&self.registry);
                }
            }
            drop(rx);
            return Err(refuse(conn.stream, e));
        }
        rx.add_conn(conn);
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
        let cq = verbs.recv_cq(port)?;
        let mut rx = self.rx.lock().expect("rx poisoned");
        if let Some(p) = own {
            rx.pools.insert(key, p);
        }
        if !rx.rdma_cqs.iter().any(|(p, _)| *p == port) {
            rx.rdma_cqs.push((port, cq));
        }
        if rx.wcs.is_empty() {
            rx.wcs = vec![WorkCompletion::default(); 32];
        }
        let io = InIo::Rdma {
            credits: Box::new(credits),
            port,
        };
        let conn = InConn::new(id, from, key, stream, io, lane, Some(permit));
        self.admit(rx, conn, |_, _| Ok(local.encode().to_vec()))
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

    /// A second descriptor of the shared tcp lane's epoll set (readable while one of its
    /// connections has bytes to read), for the lanes thread to wait on; `None` without dynamic
    /// lanes (there is no shared tcp lane then) or when the descriptor cannot be duplicated.
    pub(crate) fn shared_lane_fd(&self) -> Option<std::os::fd::OwnedFd> {
        let rx = self.rx.lock().expect("rx poisoned");
        let set = rx.shared_tcp.as_ref()?;
        match set.epoll.0.try_clone() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(error = %e, "the shared tcp lane is read only when the application polls");
                None
            }
        }
    }

    /// Receive polls so far (the application's and the background's).
    pub(crate) fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }

    /// Receives what arrived on every connection into receive buffers.
    pub(super) fn poll(&self, rx: &mut Rx) {
        // Only the holder of the receive lock writes it: no atomic add on every poll.
        let polls = self.polls.load(Ordering::Relaxed);
        self.polls.store(polls.wrapping_add(1), Ordering::Relaxed);
        let Rx {
            conns,
            pools,
            delivered,
            touched,
            liveness_due,
            rdma_cqs,
            wcs,
            lanes_dirty,
            shared_tcp,
            shared_shm,
            tcp_took_in,
            ..
        } = rx;
        let liveness = std::mem::take(liveness_due);
        touched.clear();
        *tcp_took_in = false;
        let mut take = |c: &mut InConn| {
            let pool = pools.get_mut(&c.pool).expect("connection's pool");
            let before = delivered.count();
            if let Err(reason) = receive(c, pool, delivered, liveness) {
                tracing::warn!(peer = %c.from, %reason, "closed message connection");
                c.dead = true;
            }
            if c.dead || c.fenced {
                *lanes_dirty = true;
            }
            if c.dead || delivered.count() != before {
                touched.push(c.pool);
                *tcp_took_in |= matches!(c.io, InIo::Tcp { .. });
            }
        };
        for c in conns.iter_mut().filter(|c| !c.dead && c.polled_alone()) {
            take(c);
        }
        if let Some(set) = shared_tcp.as_mut().filter(|s| s.watched > 0) {
            let n = match set.epoll.wait(&mut set.events, EpollTimeout::ZERO) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(error = %e, "polling the shared lane");
                    0
                }
            };
            for ev in &set.events[..n] {
                let id = ev.data();
                if let Some(c) = conns.iter_mut().find(|c| c.id.0 == id && !c.dead) {
                    take(c);
                }
            }
        }
        if shared_shm.is_some() {
            let max_len = self.shm.buffer_size;
            *lanes_dirty |= poll_shared(
                shared_shm,
                &self.registry,
                conns,
                delivered,
                liveness,
                max_len,
            );
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
                    if take_in_rdma(*port, wc, conns, pools, delivered, touched) {
                        *lanes_dirty = true;
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
        if !rx.readers.is_empty() {
            self.poll_readers(rx);
        }
        self.poll_tail(rx);
        rx.sole_tcp = rx.sole_tcp();
    }

    /// What a poll does after reading: lanes settled and answered, dead connections reaped,
    /// buffers granted to the senders whose pools took in messages (`touched`).
    fn poll_tail(&self, rx: &mut Rx) {
        if std::mem::take(&mut rx.lanes_dirty) {
            rx.settle_lanes();
        }
        if !rx.delivered.lanes.is_empty() {
            self.answer_lanes(rx);
        }
        if rx.conns.iter().any(|c| c.dead && !c.held_back) {
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

    /// Reads the one connection a poll would read, `rx.conns[i]` (see [`Rx::sole_tcp`]),
    /// without the rest of a poll: what a receiver waiting on one tcp peer repeats between
    /// full polls, so that the read that finds a message comes sooner. Returns whether
    /// anything happened on it (the rest of a poll has then been done).
    fn poll_sole(&self, rx: &mut Rx, i: usize) -> bool {
        let Rx {
            conns,
            pools,
            delivered,
            touched,
            lanes_dirty,
            tcp_took_in,
            ..
        } = rx;
        let c = &mut conns[i];
        let Some(pool) = pools.get_mut(&c.pool) else {
            return false;
        };
        let before = delivered.count();
        if let Err(reason) = receive(c, pool, delivered, false) {
            tracing::warn!(peer = %c.from, %reason, "closed message connection");
            c.dead = true;
        }
        let took_in = delivered.count() != before;
        let ended = c.dead || c.fenced;
        if !(took_in || ended) {
            return false;
        }
        *lanes_dirty |= ended;
        *tcp_took_in = took_in;
        touched.clear();
        touched.push(c.pool);
        // Lane requests answered or a connection ended may change what a poll reads; a
        // message alone does not, and working that out again cost every message ~20 ns.
        let changes = ended || !delivered.lanes.is_empty();
        self.poll_tail(rx);
        if changes || rx.conns.get(i).is_none_or(|c| c.dead) {
            rx.sole_tcp = rx.sole_tcp();
        }
        true
    }

    /// Polls the duplex sockets that carry no lane to us; one whose other end starts a lane
    /// on it becomes that lane's connection.
    fn poll_readers(&self, rx: &mut Rx) {
        let mut i = 0;
        while i < rx.readers.len() {
            match rx.readers[i].poll() {
                Ok(ReaderEvent::Nothing) => i += 1,
                Ok(ReaderEvent::Ended) => {
                    rx.readers.swap_remove(i);
                }
                Ok(ReaderEvent::Open(epoch, from)) => {
                    let r = rx.readers.swap_remove(i);
                    self.open_reverse(rx, r, from, epoch);
                }
                Err(reason) => {
                    let r = rx.readers.swap_remove(i);
                    tracing::warn!(peer = %r.from, %reason, "closed a duplex message connection");
                    r.duplex.set_closed();
                }
            }
        }
    }

    /// The other end of duplex socket `r`, `from`, starts its dedicated lane of `epoch` to us
    /// on it:
    /// a receive pool of its own (our granting side agreed to the lane), the buffer size,
    /// then credits. Refused, telling why, when the pool cannot be made; the reader stays.
    fn open_reverse(&self, rx: &mut Rx, r: Reader, from: Arc<str>, epoch: u32) {
        let settings = ReceiveSettings {
            shared_receive_queue: false,
            ..self.tcp
        };
        let id = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        let pool = Pool::new(&self.registry, settings, false).and_then(|mut p| {
            p.queue
                .add_connection(id)
                .map_err(|e| Error::invalid("receive", e.to_string()))?;
            Ok(p)
        });
        let pool = match pool {
            Ok(p) => p,
            Err(e) => {
                let why = format!("receive pool: {e}");
                tracing::warn!(peer = %r.from, reason = %why, "refused a reverse lane");
                if let Err(e) = r.duplex.control(&r.stream, &duplex::refuse_frame(&why)) {
                    tracing::warn!(peer = %r.from, error = %e, "cannot refuse a reverse lane");
                    r.duplex.set_closed();
                    return;
                }
                rx.readers.push(r);
                return;
            }
        };
        let accept = duplex::frame_header(MsgKind::ReverseAccept, settings.buffer_size as u32);
        if let Err(e) = r.duplex.control(&r.stream, &accept) {
            tracing::warn!(peer = %r.from, error = %e, "cannot accept a reverse lane");
            r.duplex.set_closed();
            pool.release(&self.registry);
            return;
        }
        let key = id.0;
        rx.pools.insert(key, pool);
        let Reader {
            stream,
            staging,
            start,
            end,
            duplex,
            _permit,
            ..
        } = r;
        let io = InIo::Tcp {
            staging,
            start,
            end,
        };
        let mut conn = InConn::new(id, from, key, stream, io, (Lane::Dedicated, epoch), _permit);
        duplex.set_in_carried(true);
        conn.duplex = Some(duplex);
        rx.add_conn(conn);
        rx.lanes_dirty = true;
        let Rx { conns, pools, .. } = rx;
        grant(conns, pools, key);
        // The first credits go at once: the other end waits for them to send anything.
        if let Some(c) = conns.iter().find(|c| c.id == id) {
            if let Some(d) = &c.duplex {
                if let Err(e) = d.try_flush(&c.stream) {
                    tracing::warn!(peer = %c.from, error = %e, "cannot grant a reverse lane");
                }
            }
        }
    }

    /// Whether a connection on `lane` takes its buffers from the shared pool: a shared lane
    /// does under dynamic lanes (that is what makes it cheap), otherwise when
    /// `shared_receive_queue` says so; a dedicated lane never does.
    fn shared_pool_for(&self, lane: Lane, settings: &ReceiveSettings) -> bool {
        lane == Lane::Shared && (settings.shared_receive_queue || self.dynamic.enabled())
    }

    /// Drops dead connections and per-connection pools nothing refers to any more.
    pub(super) fn reap(&self, rx: &mut Rx) {
        let mut ended: Vec<Arc<str>> = Vec::new();
        let mut i = 0;
        while i < rx.conns.len() {
            // A lane held back keeps its connection until what it delivered is handed out.
            if !rx.conns[i].dead || rx.conns[i].held_back {
                i += 1;
                continue;
            }
            let c = rx.conns.swap_remove(i);
            if let (true, Some(set)) = (c.watched, &mut rx.shared_tcp) {
                let _ = set.epoll.delete(&c.stream);
                set.watched -= 1;
            }
            if !c.fenced && !ended.contains(&c.from) {
                ended.push(c.from.clone());
            }
            let (key, id) = (c.pool, c.id);
            if let InIo::Shm { ring_buf, .. } = &c.io {
                let _ = self.registry.unregister(ring_buf.addr());
            }
            release_tag(rx.shared_shm.as_mut(), &c.io);
            if let Some(r) = c.into_reader() {
                // A duplex socket whose lane to us ended: it is read on until its other end
                // closes, for our lane the other way and so that nothing is lost to a reset.
                rx.readers.push(r);
            }
            if let Some(p) = rx.pools.get_mut(&key) {
                p.queue.remove_connection(id);
            }
            if per_connection(key) {
                self.release_if_unused(rx, key);
            }
        }
        if !ended.is_empty() {
            self.senders_gone(rx, &ended);
        }
    }

    /// Releases the pool of a connection that is gone once no message in it waits, else
    /// keeps it as an orphan until then.
    fn release_if_unused(&self, rx: &mut Rx, key: u64) {
        let in_use = rx.delivered.uses_pool(key) || rx.after_reply.iter().any(|r| r.0 == key);
        if in_use {
            if !rx.orphans.contains(&key) {
                rx.orphans.push(key);
            }
            return;
        }
        rx.orphans.retain(|k| *k != key);
        if let Some(p) = rx.pools.remove(&key) {
            p.release(&self.registry);
        }
    }

    pub(super) fn consume(&self, rx: &mut Rx, pool: u64, buf: BufferId) {
        if let Some(p) = rx.pools.get_mut(&pool) {
            if let Err(e) = p.consumed(buf) {
                tracing::error!(error = %e, "receive accounting");
            }
        }
        if !rx.orphans.is_empty() && rx.orphans.contains(&pool) {
            self.release_if_unused(rx, pool);
            return;
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
        let m = self.take_ready_uncounted(rx)?;
        rx.received.0 += 1;
        rx.received.1 += m.data.len() as u64;
        Some(m)
    }

    fn take_ready_uncounted(&self, rx: &mut Rx) -> Option<Message> {
        let r = rx.delivered.ready.pop_front()?;
        let (pool_key, buf, len) = match r.body {
            Body::Owned(data) => return Some(Message { from: r.from, data }),
            Body::Pooled { pool, buf, len } => (pool, buf, len),
        };
        let Rx {
            pools,
            conns,
            orphans,
            ..
        } = rx;
        let pool = pools.get_mut(&pool_key).expect("pool of a ready message");
        // SAFETY: the buffer holds `len <= buffer_size` bytes of a message no sender may
        // overwrite until we post it again below.
        let data = unsafe { std::slice::from_raw_parts(pool.ptr(buf), len) }.to_vec();
        let order = pool.queue.settings().return_order;
        match order {
            // `consume` with the pool in hand, the usual case: one lookup a message.
            ReturnOrder::BeforeReply if orphans.is_empty() => {
                if let Err(e) = pool.consumed(buf) {
                    tracing::error!(error = %e, "receive accounting");
                }
                grant_from(conns, pool);
            }
            ReturnOrder::BeforeReply => self.consume(rx, pool_key, buf),
            ReturnOrder::AfterReply => {
                rx.after_reply.push((pool_key, buf));
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
                if rx.tcp_streak >= STREAM_STREAK && !self.stream_pause.is_zero() {
                    drop(rx);
                    pause(self.stream_pause);
                    rx = self.rx.lock().expect("rx poisoned");
                }
                self.poll(&mut rx);
                rx.tcp_streak = if rx.tcp_took_in {
                    rx.tcp_streak.saturating_add(1)
                } else {
                    0
                };
                if let Some(m) = self.take_ready(&mut rx) {
                    return Ok(Some(m));
                }
                if let Some(i) = rx.sole_tcp {
                    // One tcp peer: read it again and again before the next full poll.
                    for _ in 0..SOLE_READS {
                        if self.poll_sole(&mut rx, i) {
                            break;
                        }
                    }
                    if let Some(m) = self.take_ready(&mut rx) {
                        return Ok(Some(m));
                    }
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

    /// The lane each sender's current connection to us is on, by sender name (its latest
    /// lane while a switch is under way), and whether our lane to it shares the socket.
    pub(crate) fn incoming_lanes(&self) -> Vec<(String, Lane, bool)> {
        let rx = self.rx.lock().expect("rx poisoned");
        let mut latest: HashMap<&str, (u32, Lane, bool)> = HashMap::new();
        for c in rx.conns.iter().filter(|c| !c.dead) {
            let both = c.duplex.as_ref().is_some_and(|d| d.both_ways());
            let e = latest.entry(&c.from).or_insert((c.epoch, c.lane, both));
            if c.epoch >= e.0 {
                *e = (c.epoch, c.lane, both);
            }
        }
        let mut out: Vec<(String, Lane, bool)> = latest
            .into_iter()
            .map(|(k, (_, l, d))| (k.to_owned(), l, d))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    pub(crate) fn notifications(&self) -> Vec<Notification> {
        let mut rx = self.rx.lock().expect("rx poisoned");
        rx.liveness_due = true;
        self.poll(&mut rx);
        rx.delivered.notifications.drain(..).collect()
    }
}

/// Tells senders about buffers posted for them.
pub(super) fn grant(conns: &mut [InConn], pools: &mut Pools, key: u64) {
    if let Some(pool) = pools.get_mut(&key) {
        grant_from(conns, pool);
    }
}

/// [`grant`] for a pool in hand.
fn grant_from(conns: &mut [InConn], pool: &mut Pool) {
    while let Some(to) = pool.queue.poll_grant_into(pool.eager, &mut pool.granting) {
        // A fenced lane takes no more credits: its sender is closing it.
        let Some(c) = conns.iter_mut().find(|c| c.id == to && !c.fenced) else {
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
                let h = duplex::frame_header(MsgKind::Credit, pool.granting.len() as u32);
                let told = match &c.duplex {
                    // Maybe with our next frame (see `Duplex::grant`).
                    Some(d) => d.grant(&c.stream, pool.granting.len()),
                    None => (&c.stream).write_all(&h),
                };
                if let Err(e) = told {
                    tracing::warn!(peer = %c.from, error = %e, "cannot send credits");
                    c.dead = true;
                }
            }
            InIo::Shm { ring, .. } => ring.post(&pool.granting),
            // The shared ring's space is its flow control: it takes no credits.
            InIo::ShmShared { .. } => {}
        }
    }
}

/// Takes in what one connection has delivered.
pub(super) fn receive(
    c: &mut InConn,
    pool: &mut Pool,
    delivered: &mut Delivered,
    liveness: bool,
) -> std::result::Result<(), String> {
    let fenced = std::cell::Cell::new(c.fenced);
    let taken = receive_io(c, pool, delivered, liveness, &fenced);
    c.fenced = fenced.get();
    taken
}

fn receive_io(
    c: &mut InConn,
    pool: &mut Pool,
    delivered: &mut Delivered,
    liveness: bool,
    fenced: &std::cell::Cell<bool>,
) -> std::result::Result<(), String> {
    let max_len = pool.queue.settings().buffer_size as u32;
    let (id, key) = (c.id, c.pool);
    let hold = c.held_back.then_some(id);
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
        if fenced.get() {
            return Err("a message after the lane's fence".into());
        }
        fenced.set(take_in(from, key, pool, kind, buf, len, hold, delivered)?);
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
            if let Some(d) = &c.duplex {
                // What the socket's writers could not write at once (see `duplex`).
                d.try_flush(&c.stream)
                    .map_err(|e| format!("writing on a duplex lane: {e}"))?;
            }
            // A reverse opening leaves the lane's first frames staged: take them in first.
            let staged = *end > *start;
            let read = match sockio::recv_nonblocking(c.stream.as_raw_fd(), &mut staging[*end..]) {
                // A peer that closes with our credits or answers unread resets instead of
                // ending: everything it wrote before was read first, so between frames that is
                // its end like any other (a process that exits or dies closes the same way).
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && start == end => {
                    tracing::debug!(peer = %c.from, "message connection reset between frames");
                    Ok(Some(0))
                }
                read => read,
            };
            match read {
                Ok(None) if !staged => return Ok(()),
                Ok(None) => {}
                Ok(Some(0)) => {
                    c.dead = true;
                    c.ended = true;
                    if let Some(d) = &c.duplex {
                        d.set_closed();
                    }
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
                let total = MSG_HEADER_LEN + duplex::payload_len(&h);
                if *end - *start < total {
                    break;
                }
                let body = &staging[*start + MSG_HEADER_LEN..*start + total];
                if let Some(d) = &c.duplex {
                    // Credits and answers for our lane the other way.
                    d.on_piggyback(&staging[*start..]);
                    if d.on_control(h, body)? {
                        *start += total;
                        continue;
                    }
                    if h.kind == MsgKind::Fence {
                        // Fences take no credit here; the lane ends both ways (see `duplex`).
                        if fenced.get() {
                            return Err("a second fence".into());
                        }
                        fenced.set(true);
                        d.fence_soon(&c.stream)
                            .map_err(|e| format!("fencing our lane: {e}"))?;
                        *start += total;
                        continue;
                    }
                }
                match h.kind {
                    MsgKind::Credit => return Err("a sender sent credits".into()),
                    MsgKind::LaneAnswer
                    | MsgKind::ReverseOpen
                    | MsgKind::ReverseAccept
                    | MsgKind::ReverseRefuse => {
                        return Err(format!("a sender sent a {:?} frame", h.kind))
                    }
                    _ => {}
                }
                deliver(pool, h.kind, None, Some(body), h.len as usize)?;
                *start += total;
            }
            if start == end {
                *start = 0;
                *end = 0;
            }
        }
        InIo::Shm { ring, .. } => {
            let mut take = |buf, len, kind: u8, inline: Option<&[u8]>| {
                let kind = arrived_kind(kind.into(), len, max_len as usize)?;
                deliver(pool, kind, Some(buf), inline, len)
            };
            ring.completions(&mut take)?;
            // Only while waiting (or after a fence): a syscall every so many polls would show
            // up as a periodic pattern in the round trips (pingpong found one every ~4096).
            if liveness || fenced.get() {
                let mut b = [0u8; 1];
                if let Ok(Some(0)) = sockio::recv_nonblocking(c.stream.as_raw_fd(), &mut b) {
                    // Gone. What it wrote before closing may have landed after the pass
                    // above: take it in now, then the connection ends.
                    ring.completions(&mut take)?;
                    c.dead = true;
                }
            }
        }
        // Taken in from the shared ring by `poll_shared`.
        InIo::ShmShared { .. } => {}
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

/// The kind of a message that arrived with kind code `code` (a ring entry's or an RDMA
/// immediate: the values of [`MsgKind`]) and `len` bytes. Fails on a code a sender may not
/// send or a length above the receive buffers.
pub(super) fn arrived_kind(
    code: u32,
    len: usize,
    max_len: usize,
) -> std::result::Result<MsgKind, String> {
    if len > max_len {
        return Err(format!("message of {len} bytes above {max_len}"));
    }
    match code {
        1 => Ok(MsgKind::Message),
        2 => Ok(MsgKind::Notification),
        4 => Ok(MsgKind::Fence),
        5 => Ok(MsgKind::Lane),
        k => Err(format!("unknown message kind {k}")),
    }
}

/// A message of `len` bytes is in buffer `buf` of `pool`: a notification is taken out and the
/// buffer returned at once; a message waits for `recv`; both wait in `held` instead when the
/// lane is held back (`hold` names its connection). A fence's buffer is returned at once;
/// returns true for a fence.
#[allow(clippy::too_many_arguments)]
fn take_in(
    from: &Arc<str>,
    key: u64,
    pool: &mut Pool,
    kind: MsgKind,
    buf: BufferId,
    len: usize,
    hold: Option<ConnId>,
    out: &mut Delivered,
) -> std::result::Result<bool, String> {
    let item = match kind {
        MsgKind::Fence => {
            pool.consumed(buf)?;
            return Ok(true);
        }
        MsgKind::Notification => {
            // SAFETY: the buffer holds the message's `len` bytes until it is consumed below.
            let bytes = unsafe { std::slice::from_raw_parts(pool.ptr(buf), len) };
            let n = Notification {
                from: from.to_string(),
                msg: String::from_utf8_lossy(bytes).into_owned(),
            };
            pool.consumed(buf)?;
            HeldItem::Notification(n)
        }
        MsgKind::Message => HeldItem::Message(Ready {
            from: from.clone(),
            body: Body::Pooled {
                pool: key,
                buf,
                len,
            },
        }),
        MsgKind::Lane => {
            // SAFETY: the buffer holds the message's `len` bytes until it is consumed below.
            let bytes = unsafe { std::slice::from_raw_parts(pool.ptr(buf), len) };
            let m = LaneMsg::decode(bytes);
            pool.consumed(buf)?;
            HeldItem::Lane(from.clone(), m.map_err(|e| format!("lane message: {e}"))?)
        }
        k @ (MsgKind::Credit
        | MsgKind::LaneAnswer
        | MsgKind::ReverseOpen
        | MsgKind::ReverseAccept
        | MsgKind::ReverseRefuse) => return Err(format!("a sender sent a {k:?} frame")),
    };
    hand_out(item, hold, out);
    Ok(false)
}

/// A message of `kind` whose bytes were copied out of the shared shm ring: as [`take_in`],
/// with a message keeping `bytes` itself. Returns true for a fence.
pub(super) fn take_in_bytes(
    from: &Arc<str>,
    kind: MsgKind,
    bytes: &[u8],
    hold: Option<ConnId>,
    out: &mut Delivered,
) -> std::result::Result<bool, String> {
    let item = match kind {
        MsgKind::Fence => return Ok(true),
        MsgKind::Notification => HeldItem::Notification(Notification {
            from: from.to_string(),
            msg: String::from_utf8_lossy(bytes).into_owned(),
        }),
        MsgKind::Message => HeldItem::Message(Ready {
            from: from.clone(),
            body: Body::Owned(bytes.to_vec()),
        }),
        MsgKind::Lane => HeldItem::Lane(
            from.clone(),
            LaneMsg::decode(bytes).map_err(|e| format!("lane message: {e}"))?,
        ),
        k @ (MsgKind::Credit
        | MsgKind::LaneAnswer
        | MsgKind::ReverseOpen
        | MsgKind::ReverseAccept
        | MsgKind::ReverseRefuse) => return Err(format!("a sender sent a {k:?} frame")),
    };
    hand_out(item, hold, out);
    Ok(false)
}

/// Queues what arrived for the application, or holds it back behind an earlier lane.
fn hand_out(item: HeldItem, hold: Option<ConnId>, out: &mut Delivered) {
    match (hold, item) {
        (Some(conn), item) => out.held.push_back(Held { conn, item }),
        (None, HeldItem::Message(r)) => out.ready.push_back(r),
        (None, HeldItem::Notification(n)) => out.notifications.push_back(n),
        (None, HeldItem::Lane(from, m)) => out.lanes.push_back((from, m)),
    }
}

impl Rx {
    /// The index of the one connection a poll reads when it reads nothing else (no shared
    /// lane, ring, completion queue or duplex reader) and that one is a tcp connection.
    fn sole_tcp(&self) -> Option<usize> {
        let others = !self.readers.is_empty()
            || self.shared_shm.is_some()
            || !self.rdma_cqs.is_empty()
            || self.shared_tcp.as_ref().is_some_and(|s| s.watched > 0);
        if others {
            return None;
        }
        let mut polled = self
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.dead && c.polled_alone());
        match (polled.next(), polled.next()) {
            (Some((i, c)), None) if matches!(c.io, InIo::Tcp { .. }) => Some(i),
            _ => None,
        }
    }

    /// Adds an accepted connection, held back while an earlier lane of its sender is open or
    /// still holds back what it carried.
    pub(super) fn add_conn(&mut self, mut c: InConn) {
        c.held_back = self.conns.iter().any(|o| {
            o.from == c.from && o.epoch < c.epoch && (o.held_back || !(o.fenced || o.dead))
        });
        if let (Some(set), InIo::Tcp { .. }, Lane::Shared) = (&mut self.shared_tcp, &c.io, c.lane) {
            // Level-triggered: a connection with bytes left after a poll is reported again.
            let ev = EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP, c.id.0);
            match set.epoll.add(&c.stream, ev) {
                Ok(()) => {
                    c.watched = true;
                    set.watched += 1;
                }
                Err(e) => tracing::debug!(error = %e, "shared lane polled directly"),
            }
        }
        self.conns.push(c);
    }

    /// After fences and ends: a sender's lane is delivered once every earlier lane of it has
    /// ended (fenced, or closed with everything it carried taken in); what it held back is
    /// handed out then, before anything that arrives later. A fenced lane that is delivered
    /// is done and closes.
    fn settle_lanes(&mut self) {
        let mut order: Vec<usize> = (0..self.conns.len()).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (&self.conns[a], &self.conns[b]);
            x.from.cmp(&y.from).then(x.epoch.cmp(&y.epoch))
        });
        // The sender whose open lane blocks its later ones (the name, shared by reference).
        let mut blocked: Option<Arc<str>> = None;
        let mut released = Vec::new();
        for &i in &order {
            let c = &mut self.conns[i];
            if blocked.as_ref().is_some_and(|b| *b != c.from) {
                blocked = None;
            }
            let hold = blocked.is_some();
            if c.held_back && !hold {
                released.push(c.id);
            }
            c.held_back = hold;
            if !hold && c.fenced {
                c.dead = true;
            }
            if !(c.fenced || c.dead) && blocked.is_none() {
                blocked = Some(c.from.clone());
            }
        }
        for id in released {
            self.delivered.release(id);
        }
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
    let conn = conns.iter_mut().find(
        |c| matches!(&c.io, InIo::Rdma { credits, port: p } if *p == port && credits.qp().qp_num() == qp_num),
    );
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

/// Refuses a message connection, telling the sender why; returns the reason.
pub(super) fn refuse(mut stream: TcpStream, reason: String) -> String {
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
