//! The receiving side of messages: accepted connections, receive buffers and credits,
//! and the caller's polling of them (`recv`, notifications).

use super::*;

/// A connection some sender opened to us.
pub(super) struct InConn {
    pub(super) id: ConnId,
    pub(super) from: Arc<str>,
    pub(super) pool: u64,
    pub(super) stream: TcpStream,
    /// How the lane's kind takes messages in and tells credits.
    pub(super) io: Box<dyn RecvLane>,
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
    /// The sender closed the stream (its end was read).
    pub(super) ended: bool,
    /// Counts an accepted connection against the port's `max_connections` until it is
    /// dropped (a reverse lane on a socket we opened has none).
    pub(super) _permit: Option<ConnPermit>,
}

impl InConn {
    /// A connection on `lane` whose messages land in pool `pool`, taken in by `io`.
    pub(super) fn new(
        id: ConnId,
        from: Arc<str>,
        pool: u64,
        stream: TcpStream,
        io: Box<dyn RecvLane>,
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
            ended: false,
            _permit: permit,
        }
    }

    /// What is left of a dead connection on a duplex socket that did not end: a reader of the
    /// socket's other lane and end (see `duplex`). Anything else closes (the queue pair of an
    /// RDMA lane goes now: nothing lands in the buffers granted to it any more).
    fn into_reader(self) -> Option<Reader> {
        let InConn {
            from,
            stream,
            io,
            ended,
            fenced,
            _permit,
            ..
        } = self;
        io.into_reader(ReaderParts {
            from,
            stream,
            fenced,
            ended,
            permit: _permit,
        })
    }

    /// Read on every poll by itself, rather than through the shared lane's epoll set or
    /// shared ring, or the RDMA completion queues.
    fn polled_alone(&self) -> bool {
        !self.watched && self.io.polled_alone()
    }
}

/// The receive side, under `Messaging::rx`: connections, pools, and what arrived.
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
    /// The completion channel each of `rdma_cqs` reports to once armed, same order (`None`:
    /// that rail has none, and a receiver asleep naps).
    pub(super) rdma_channels: Vec<Option<CompletionChannel>>,
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
    /// The last poll read a socket (a tcp connection, the shared lane's set, a duplex reader).
    pub(super) polled_sockets: bool,
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

/// Whether a wait reads the clock after a poll that found nothing (counted in `idle`):
/// reading it costs as much as a poll of memory, so every 32 such polls, but after every poll
/// that made system calls (`costly`: a tcp read costs a µs), and once at once when `look_now`
/// (which it clears). Counting a costly poll as 32 cheap ones instead let a wait that began
/// with a cheap poll never come back to a multiple of 32: it never read the clock again, never
/// timed out and never slept (a `recv` with a 10 s timeout spun for 20 minutes).
fn looks_at_clock(idle: &mut u32, costly: bool, look_now: &mut bool) -> bool {
    *idle = idle.wrapping_add(1);
    std::mem::take(look_now) || costly || idle.is_multiple_of(32)
}

/// A thread whose waits have not looked at the clock for this long was quiet (or only ever
/// found its messages at once); see [`QUIET_UNTIL`].
const QUIET: Duration = Duration::from_millis(1);

thread_local! {
    /// When this thread's last wait last read the clock, and whether that wait slept. A wait
    /// that starts after a silence or a sleep yields once as soon as it reads the clock: its
    /// thread has just sent the first message after a silence (or the answer to one), and the
    /// kernel likes to wake that message's receiver (or the first message's sender, which went
    /// on to spin for this answer) on this very core, where it would wait [`YIELD_AFTER`] for
    /// it. A thread in a busy exchange never meets the condition, so it pays nothing.
    static QUIET_UNTIL: std::cell::Cell<(Option<Instant>, bool)> =
        const { std::cell::Cell::new((None, false)) };
}

/// After this many polls in a row took in tcp messages, `recv` waits
/// `transports.tcp.stream_pause_us` before the next poll (see there).
const STREAM_STREAK: u32 = 4;

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
        match mode {
            MODE_TCP => self.accept_tcp(stream, from, lane, permit),
            MODE_SHM if lane.0 == Lane::Shared && self.dynamic.enabled() => {
                self.accept_shared_shm(stream, from, lane, permit)
            }
            MODE_SHM => self.accept_shm(stream, from, lane, permit),
            MODE_RDMA => {
                let endpoint = &opening[name_end + LANE_LEN..];
                self.accept_rdma(stream, from, lane, endpoint, permit)
            }
            m => Err(format!("unknown message mode {m}")),
        }
    }

    /// The receive pool of a new connection on `lane` of a transport with `settings`: the
    /// shared one (key `shared_key`) or one of its own (see [`Messaging::shared_pool_for`]).
    /// Returns the connection's id, the pool's key, the pool's settings, and the pool when it
    /// does not exist yet (made outside the lock, see [`Messaging::keep_pool`]). Fails, with
    /// why, when the pool cannot be made.
    pub(super) fn receive_pool(
        &self,
        lane: Lane,
        settings: ReceiveSettings,
        shared_key: u64,
    ) -> std::result::Result<(ConnId, u64, ReceiveSettings, Option<Pool>), String> {
        let id = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        // A dedicated lane has buffers of its own; a shared one takes the shared pool under
        // dynamic lanes, else the configured path.
        let shared = self.shared_pool_for(lane, &settings);
        let settings = ReceiveSettings {
            shared_receive_queue: shared,
            ..settings
        };
        let key = if shared { shared_key } else { id.0 };
        // Allocate outside the lock; a shared pool made twice by a race is dropped again.
        let exists = self
            .rx
            .lock()
            .expect("rx poisoned")
            .pools
            .contains_key(&key);
        if exists {
            return Ok((id, key, settings, None));
        }
        // Grants go out in batches on shm too: posting one at a time costs the receiver
        // a ring write per message and saves the sender nothing.
        match Pool::new(&self.registry, settings, false) {
            Ok(p) => Ok((id, key, settings, Some(p))),
            Err(e) => Err(format!("receive pool: {e}")),
        }
    }

    /// Keeps `fresh`, made by [`Messaging::receive_pool`], as pool `key`, unless a pool
    /// made meanwhile already serves connections there.
    pub(super) fn keep_pool(&self, rx: &mut Rx, key: u64, fresh: Option<Pool>) {
        if let Some(p) = fresh {
            if let Some(extra) = rx.pools.insert(key, p) {
                // Keep the pool already serving connections.
                let mine = rx.pools.insert(key, extra).expect("just inserted");
                mine.release(&self.registry);
            }
        }
    }

    /// Adds connection `conn` to its pool and to the connections polled, after answering the
    /// opening with success, the receive buffer size and what `details` adds; then grants the
    /// sender its first credits. Refuses the connection, telling the sender why, when its pool
    /// takes no more connections or `details` fails.
    pub(super) fn admit(
        &self,
        mut rx: std::sync::MutexGuard<'_, Rx>,
        conn: InConn,
        details: impl FnOnce(&Pool) -> std::result::Result<Vec<u8>, String>,
    ) -> std::result::Result<(), String> {
        let key = conn.pool;
        let pool = rx.pools.get_mut(&key).expect("pool present");
        let answer = pool
            .queue
            .add_connection(conn.id)
            .map_err(|e| e.to_string())
            .and_then(|()| details(pool));
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
        // A receiver asleep on the doorbell does not watch the new connection yet.
        self.bell.ring_local();
        let Rx { conns, pools, .. } = &mut *rx;
        grant(conns, pools, key);
        Ok(())
    }

    /// A second descriptor of the shared tcp lane's epoll set (readable while one of its
    /// connections has bytes to read), for the lanes thread to wait on; `None` without dynamic
    /// lanes (there is no shared tcp lane then) or when the descriptor cannot be duplicated.
    pub(crate) fn shared_lane_fd(&self) -> Option<std::os::fd::OwnedFd> {
        let rx = self.rx.lock().expect("rx poisoned");
        let set = rx.shared_tcp.as_ref()?;
        match set.fd() {
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
        let mut sockets = false;
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
                *tcp_took_in |= c.io.reads_socket();
            }
        };
        for c in conns.iter_mut().filter(|c| !c.dead && c.polled_alone()) {
            sockets |= c.io.reads_socket();
            take(c);
        }
        if let Some(set) = shared_tcp.as_mut().filter(|s| s.watched > 0) {
            sockets = true;
            for id in set.ready() {
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
        if !rdma_cqs.is_empty() {
            *lanes_dirty |= self.poll_rdma(rdma_cqs, wcs, conns, pools, delivered, touched);
        }
        rx.polled_sockets = sockets || !rx.readers.is_empty();
        if !rx.readers.is_empty() {
            self.poll_readers(rx);
        }
        self.poll_tail(rx);
        rx.sole_tcp = rx.sole_tcp();
        if !rx.delivered.ready.is_empty() {
            // A receiver asleep on the doorbell would not see what this poll took in.
            self.bell.ring_local();
        }
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

    /// Whether a connection on `lane` takes its buffers from the shared pool: a shared lane
    /// does under dynamic lanes (that is what makes it cheap), otherwise when
    /// `shared_receive_queue` says so; a dedicated lane never does.
    pub(super) fn shared_pool_for(&self, lane: Lane, settings: &ReceiveSettings) -> bool {
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
                set.unwatch(&c);
            }
            if !c.fenced && !ended.contains(&c.from) {
                ended.push(c.from.clone());
            }
            let (key, id) = (c.pool, c.id);
            c.io.release(&self.registry, rx.shared_shm.as_mut());
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

    /// The next message, waiting up to `timeout` (`None`: no limit): polling for the spin
    /// (see [`Spin`]), then asleep on the doorbell until something arrives (see `doorbell`).
    pub(crate) fn recv(&self, timeout: Option<Duration>) -> Result<Option<Message>> {
        if self.after_reply_pending.load(Ordering::Relaxed) {
            // A receive with buffers still held for a reply that never came: return them.
            self.release_after_reply();
        }
        Ok(self.wait_for(timeout, Want::Message, |m, rx| m.take_ready(rx)))
    }

    /// The notifications received so far, waiting as [`Messaging::recv`] does up to `timeout`
    /// (`None`: no limit) for the first when there is none; empty when none came in time.
    pub(crate) fn wait_notifications(&self, timeout: Option<Duration>) -> Vec<Notification> {
        self.wait_for(timeout, Want::Notification, |_, rx| {
            if rx.delivered.notifications.is_empty() {
                None
            } else {
                Some(rx.delivered.notifications.drain(..).collect())
            }
        })
        .unwrap_or_default()
    }

    /// Waits up to `timeout` (`None`: no limit) until `take` finds what `want` names: polling
    /// for the spin, then asleep on the doorbell. `None` when nothing came in time.
    fn wait_for<T>(
        &self,
        timeout: Option<Duration>,
        want: Want,
        take: impl Fn(&Self, &mut Rx) -> Option<T>,
    ) -> Option<T> {
        // The clock is read only once a wait gets long enough to look at it.
        let mut start: Option<Instant> = None;
        let spin = self.spin.current();
        // A thread whose last wait slept has just answered the message that woke it (or sent
        // the first after a silence): the first miss reads the clock, to yield at once below.
        let mut look_now = QUIET_UNTIL.get().1;
        let mut idle = 0u32;
        // Wakes of this wait that found something readable at once and nothing wanted.
        let mut quick_wakes = 0u32;
        // Poll until then: a message due at the cadence (see `crate::cadence`).
        let mut anticipated_until: Option<Instant> = None;
        // Polled within such a window before the message came (rather than being woken by it).
        let mut polled_ahead = false;
        loop {
            let (got, costly) = self.poll_for(&take);
            if let Some(m) = got {
                if let Some(s) = start {
                    // A wait long enough to read the clock: its message's arrival time is
                    // known, and such arrivals are the ones a cadence wakes for.
                    let now = Instant::now();
                    self.spin.learn(now - s, true);
                    self.arrived(now);
                }
                if polled_ahead {
                    self.anticipated.fetch_add(1, Ordering::Relaxed);
                }
                return Some(m);
            }
            if !looks_at_clock(&mut idle, costly, &mut look_now) {
                std::hint::spin_loop();
                continue;
            }
            let first_look = start.is_none();
            let waited = start.get_or_insert_with(Instant::now).elapsed();
            if first_look {
                let s = start.expect("set above");
                let (seen, slept) = QUIET_UNTIL.get();
                QUIET_UNTIL.set((Some(s), false));
                if slept || seen.is_none_or(|t| s.saturating_duration_since(t) > QUIET) {
                    thread::yield_now();
                }
            }
            if timeout.is_some_and(|t| waited >= t) {
                self.spin.learn(waited, false);
                return None;
            }
            if self.is_closed() {
                // Shut down: nothing more can arrive, and what had arrived was polled above.
                return None;
            }
            let now = start.expect("set above") + waited;
            let ahead = anticipated_until.is_some_and(|u| now < u);
            if waited < spin || ahead {
                polled_ahead |= ahead && waited >= spin;
                if waited > YIELD_AFTER && (costly || idle.is_multiple_of(64)) {
                    // A peer on this core (more pollers than cores, or a receiver our message
                    // just woke, which the kernel likes to place here) gets to run now.
                    thread::yield_now();
                }
                continue;
            }
            if self.leave_shared_cpu && core_share::leave_if_shared() {
                self.cpu_moves.fetch_add(1, Ordering::Relaxed);
                // The move took a while (a migration onto a halted vCPU: 0.25-1.2 ms here):
                // poll again, and time the sleep from now.
                continue;
            }
            // Spun out: sleep, only until the next message is due if messages come steadily.
            let mut left = timeout.map(|t| t - waited);
            anticipated_until = None;
            // When the timer is to wake this sleep for a message due at the cadence.
            let mut timer_wake = None;
            if let Some((wake_at, until)) = self.anticipate(now) {
                anticipated_until = Some(until);
                if wake_at <= now {
                    continue;
                }
                let to_wake = wake_at - now;
                if left.is_none_or(|l| to_wake <= l) {
                    timer_wake = Some(wake_at);
                }
                left = Some(left.map_or(to_wake, |l| l.min(to_wake)));
            }
            let nap = quick_wakes >= doorbell::FRUITLESS_WAKES;
            if nap {
                quick_wakes = 0;
            }
            let woke = self.sleep(left, nap, want);
            if let Some(wake_at) = timer_wake.filter(|_| matches!(woke, Woke::Slept)) {
                // Ended at or after the time asked for: by the timer, or by a message that came
                // after it, when the timer was later still. Either way the timer was this late.
                let woke_at = Instant::now();
                if woke_at >= wake_at {
                    self.woke_late(woke_at - wake_at);
                    if self.leave_shared_cpu {
                        // Polling ahead of the message now, on a CPU it should have to itself.
                        core_share::watch();
                    }
                }
            }
            match woke {
                Woke::Quick => quick_wakes += 1,
                Woke::Slept | Woke::Ready | Woke::Followed => {}
            }
            QUIET_UNTIL.set((Some(Instant::now()), true));
        }
    }

    /// A wait took a message at `at`, after reading the clock: tells the cadence.
    fn arrived(&self, at: Instant) {
        let ns = at.saturating_duration_since(self.cadence_epoch).as_nanos() as u64;
        self.cadence.lock().expect("cadence poisoned").arrived(ns);
    }

    /// A sleep the cadence timed ended `late` after the time it asked to wake at.
    fn woke_late(&self, late: Duration) {
        self.cadence
            .lock()
            .expect("cadence poisoned")
            .woke_late(late.as_nanos().min(u64::MAX as u128) as u64);
    }

    /// When a wait at `now` that spun out should wake to poll for a message due at the
    /// cadence, and until when it polls; `None` when no message is due (sleep as usual).
    fn anticipate(&self, now: Instant) -> Option<(Instant, Instant)> {
        let ns = now.saturating_duration_since(self.cadence_epoch).as_nanos() as u64;
        let a = self
            .cadence
            .lock()
            .expect("cadence poisoned")
            .anticipate(ns)?;
        let at = |t: u64| self.cadence_epoch + Duration::from_nanos(t);
        Some((at(a.wake_at), at(a.poll_until)))
    }

    /// One round of [`Messaging::wait_for`]: what `take` finds ready or taken in by one poll
    /// (and, with one tcp peer, the reads of it that follow), if anything; and whether the
    /// poll read sockets (made system calls, a µs each).
    fn poll_for<T>(&self, take: &impl Fn(&Self, &mut Rx) -> Option<T>) -> (Option<T>, bool) {
        let mut rx = self.rx.lock().expect("rx poisoned");
        if let Some(m) = take(self, &mut rx) {
            return (Some(m), false);
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
        let costly = rx.polled_sockets;
        if let Some(m) = take(self, &mut rx) {
            return (Some(m), costly);
        }
        if let Some(i) = rx.sole_tcp {
            // One tcp peer: read it again and again before the next full poll.
            for _ in 0..SOLE_READS {
                if self.poll_sole(&mut rx, i) {
                    break;
                }
            }
            return (take(self, &mut rx), true);
        }
        (None, costly)
    }

    /// The lane each sender's current connection to us is on, by sender name (its latest
    /// lane while a switch is under way), and whether our lane to it shares the socket.
    pub(crate) fn incoming_lanes(&self) -> Vec<(String, Lane, bool)> {
        let rx = self.rx.lock().expect("rx poisoned");
        let mut latest: HashMap<&str, (u32, Lane, bool)> = HashMap::new();
        for c in rx.conns.iter().filter(|c| !c.dead) {
            let both = c.io.duplex().is_some_and(|d| d.both_ways());
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
        if let Err(e) = c.io.grant(&c.stream, &pool.granting) {
            tracing::warn!(peer = %c.from, error = %e, "cannot send credits");
            c.dead = true;
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
    let InConn {
        id,
        from,
        pool: key,
        stream,
        io,
        dead,
        fenced,
        held_back,
        ended,
        ..
    } = c;
    let mut cx = RecvCx {
        id: *id,
        key: *key,
        from,
        stream,
        hold: held_back.then_some(*id),
        dead,
        ended,
        fenced: *fenced,
        pool,
        delivered,
        liveness,
    };
    let taken = io.receive(&mut cx);
    *fenced = cx.fenced;
    taken
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
            (Some((i, c)), None) if c.io.reads_socket() => Some(i),
            _ => None,
        }
    }

    /// Adds an accepted connection, held back while an earlier lane of its sender is open or
    /// still holds back what it carried.
    pub(super) fn add_conn(&mut self, mut c: InConn) {
        c.held_back = self.conns.iter().any(|o| {
            o.from == c.from && o.epoch < c.epoch && (o.held_back || !(o.fenced || o.dead))
        });
        if let Some(set) = &mut self.shared_tcp {
            set.watch(&mut c);
        }
        self.conns.push(c);
    }
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

#[cfg(test)]
mod tests {
    use super::looks_at_clock;

    #[test]
    fn a_wait_reads_the_clock_after_every_costly_poll_whatever_came_before() {
        let (mut idle, mut look_now) = (0u32, false);
        // A cheap poll first (a message pool, no socket yet): not yet.
        assert!(!looks_at_clock(&mut idle, false, &mut look_now));
        // Then only polls that read sockets: each looks, so the timeout is seen.
        for _ in 0..100 {
            assert!(looks_at_clock(&mut idle, true, &mut look_now));
        }
        // Cheap polls look once in 32.
        let looks = (0..320)
            .filter(|_| looks_at_clock(&mut idle, false, &mut look_now))
            .count();
        assert_eq!(looks, 10);
        // Asked to look now: once, then back to the cadence.
        look_now = true;
        assert!(looks_at_clock(&mut idle, false, &mut look_now));
        assert!(!look_now);
    }
}
