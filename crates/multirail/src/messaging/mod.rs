//! Two-sided messages and notifications: `send` / `recv`, TENT's `send_notification` /
//! `receive_notifications`, and a notification sent once every request of a batch landed.
//!
//! Each sending engine opens one dedicated message connection to each peer it sends to
//! (`ConnKind::Message` on the peer's port); everything it sends that peer goes over it, so a
//! peer's messages arrive in order. The receiver owns receive buffers, accounted by
//! [`multirail_policy::receive::ReceiveQueue`] with the knobs of `transports.<tcp|shm>.receive`
//! (queue depth, shared pool, registration chunks, return policy and order), and grants the
//! sender one credit per buffer posted for it. A sender sends only against a credit, so the
//! receiver never runs out of buffers; a sender without credits waits (up to
//! `transports.tcp.timeout_ms`) until the receiver consumes messages.
//!
//! * **tcp**: frames are an 8-byte header (length, kind) and the bytes, one `writev` per
//!   message; credits come back on the same connection in 8-byte frames, batched: one frame
//!   when the sender holds at most half its share.
//! * **shm**: the receive buffers are memfd-backed registered chunks the sender maps; per
//!   connection a ring region holds the grant ring (buffer ids the receiver posted for this
//!   sender) and the completion ring (buffer id, length, kind of each message written). Both
//!   sides poll; the TCP connection stays open only to notice the sender leaving.
//!
//! Receiving is polled by the caller's thread (`recv`, `receive_notifications`): no thread
//! hand-off on the receive path, which keeps round trips short.

mod ring;

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use multirail_policy::receive::{
    BufferId, ConnId, Credits, ReceiveQueue, ReceiveSettings, ReturnOrder,
};

use crate::config::{Config, TransportChoice};
use crate::engine::{BatchId, Engine, Request, SegmentId};
use crate::error::{Error, Result};
use crate::memory::{Buffer, Location, MemoryRegistry, PeerMapping};
use crate::peer::Peer;
use crate::server::ConnPermit;
use crate::transport::handshake::{self, Membership};
use crate::transport::sockio;
use crate::transport::wire::{self, ConnKind, MsgHeader, MsgKind, MSG_HEADER_LEN};
use ring::{Ring, INLINE_MAX};

/// A message received with [`Engine::recv`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Segment name of the sender, shared by every message of its connection (a clone is a
    /// reference count, not a copy).
    pub from: Arc<str>,
    /// The bytes sent.
    pub data: Vec<u8>,
}

/// A notification received with [`Engine::receive_notifications`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Segment name of the sender.
    pub from: String,
    /// The text sent.
    pub msg: String,
}

const MODE_TCP: u8 = 1;
const MODE_SHM: u8 = 2;
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// Pool keys of the shared pools; per-connection pools use the connection id (from 2).
const SHARED_TCP: u64 = 0;
const SHARED_SHM: u64 = 1;
/// Spinning this long without progress makes a wait yield the CPU now and then.
const SPIN: Duration = Duration::from_micros(200);
/// Waiting this long without progress makes a wait sleep in short steps.
const DOZE: Duration = Duration::from_millis(20);

/// A wait without progress: yield first, so a peer polling on the same core (more pollers than
/// cores) runs at once instead of after a sleep's timer slack; sleep once the wait is long.
fn back_off(waited: Duration) {
    if waited > DOZE {
        thread::sleep(Duration::from_micros(50));
    } else {
        thread::yield_now();
    }
}

/// Pools by key; keys are small integers, so hashing is the identity (the receive loop looks a
/// pool up on every poll).
type Pools = HashMap<u64, Pool, BuildHasherDefault<IdHasher>>;

#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ *b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Receive buffers: the accounting and the registered chunks holding the bytes.
struct Pool {
    queue: ReceiveQueue,
    chunks: Vec<Buffer>,
    /// Tell grants at once instead of when a sender holds half its share or less.
    eager: bool,
    /// The grant being told, reused so granting after every message allocates nothing.
    granting: Vec<BufferId>,
}

impl Pool {
    fn new(registry: &MemoryRegistry, settings: ReceiveSettings, eager: bool) -> Result<Pool> {
        let queue =
            ReceiveQueue::new(settings).map_err(|e| Error::invalid("receive", e.to_string()))?;
        let chunks = (0..settings.registration_chunks)
            .map(|_| registry.allocate(settings.chunk_bytes(), Location::Any))
            .collect::<Result<Vec<_>>>()?;
        for c in &chunks {
            populate(c.as_ptr(), c.len());
        }
        Ok(Pool {
            queue,
            chunks,
            eager,
            granting: Vec::new(),
        })
    }

    fn ptr(&self, id: BufferId) -> *mut u8 {
        let (chunk, offset) = self.queue.location(id);
        // SAFETY: `location` keeps the offset inside the chunk (validated settings).
        unsafe { self.chunks[chunk].as_ptr().add(offset) }
    }

    fn release(self, registry: &MemoryRegistry) {
        for c in &self.chunks {
            let _ = registry.unregister(c.addr());
        }
    }
}

enum InIo {
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
struct InConn {
    id: ConnId,
    from: Arc<str>,
    pool: u64,
    stream: TcpStream,
    io: InIo,
    dead: bool,
    /// Counts the connection against the port's `max_connections` until it is dropped.
    _permit: ConnPermit,
}

struct Ready {
    from: Arc<str>,
    pool: u64,
    buf: BufferId,
    len: usize,
}

#[derive(Default)]
struct Rx {
    conns: Vec<InConn>,
    pools: Pools,
    ready: VecDeque<Ready>,
    notifications: VecDeque<Notification>,
    /// Consumed buffers to return after the next reply (`return_order: after_reply`).
    after_reply: Vec<(u64, BufferId)>,
    /// Pools that took in messages during a poll (kept to avoid allocating per poll).
    touched: Vec<u64>,
    /// The next poll also checks that shm senders are still connected.
    liveness_due: bool,
}

enum OutIo {
    Tcp {
        /// Partial credit frames.
        inbox: Vec<u8>,
    },
    Shm {
        ring: Ring,
        /// Base address of each receive chunk in this process.
        chunks: Vec<usize>,
        per_chunk: usize,
        buffer_size: usize,
        /// Next completion slot.
        tail: u64,
        _maps: Vec<Arc<PeerMapping>>,
    },
}

/// Our dedicated message connection to one peer.
struct OutConn {
    peer: String,
    stream: TcpStream,
    credits: Credits,
    max_len: usize,
    io: OutIo,
}

/// The engine's messaging state.
pub(crate) struct Messaging {
    registry: Arc<MemoryRegistry>,
    tcp: ReceiveSettings,
    shm: ReceiveSettings,
    transport: TransportChoice,
    shm_enabled: bool,
    timeout: Duration,
    connect_timeout: Duration,
    membership: Membership,
    rx: Mutex<Rx>,
    /// Whether `Rx::after_reply` holds buffers (read without taking the lock on every send).
    after_reply_pending: AtomicBool,
    out: Mutex<HashMap<u64, Arc<Mutex<OutConn>>, BuildHasherDefault<IdHasher>>>,
    next_conn: AtomicU64,
}

/// Length of a message connection's opening (mode u8, name length u16, name) once its first
/// three bytes are in `prefix`; `None` before that. Fails on a name longer than
/// [`wire::MAX_NAME_LEN`] or an unknown mode.
pub(crate) fn opening_len(prefix: &[u8]) -> std::result::Result<Option<usize>, String> {
    if prefix.len() < 3 {
        return Ok(None);
    }
    if prefix[0] != MODE_TCP && prefix[0] != MODE_SHM {
        return Err(format!("unknown message mode {}", prefix[0]));
    }
    let name_len = u16::from_le_bytes([prefix[1], prefix[2]]) as usize;
    if name_len > wire::MAX_NAME_LEN {
        return Err(format!("sender name of {name_len} bytes"));
    }
    Ok(Some(3 + name_len))
}

fn protocol(peer: &str, reason: impl Into<String>) -> Error {
    Error::Protocol {
        peer: peer.to_owned(),
        reason: reason.into(),
    }
}

impl Messaging {
    pub(crate) fn new(
        config: &Config,
        registry: Arc<MemoryRegistry>,
        membership: Membership,
    ) -> Result<Messaging> {
        let t = &config.transports;
        Ok(Messaging {
            registry,
            tcp: t.tcp.receive.settings(),
            shm: t.shm.receive.settings(),
            transport: config.transport,
            shm_enabled: t.shm.enable,
            timeout: Duration::from_millis(t.tcp.timeout_ms),
            connect_timeout: Duration::from_millis(t.tcp.connect_timeout_ms),
            membership,
            rx: Mutex::default(),
            after_reply_pending: AtomicBool::new(false),
            out: Mutex::default(),
            next_conn: AtomicU64::new(2),
        })
    }

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
    fn poll(&self, rx: &mut Rx) {
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
    fn reap(&self, rx: &mut Rx) {
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

    fn consume(&self, rx: &mut Rx, pool: u64, buf: BufferId) {
        if let Some(p) = rx.pools.get_mut(&pool) {
            if let Err(e) = p.queue.on_consumed(buf) {
                tracing::error!(error = %e, "receive accounting");
            }
        }
        let Rx { conns, pools, .. } = rx;
        grant(conns, pools, pool);
    }

    /// Returns the buffers held for `after_reply`.
    fn release_after_reply(&self) {
        let mut rx = self.rx.lock().expect("rx poisoned");
        self.after_reply_pending.store(false, Ordering::Relaxed);
        let held = std::mem::take(&mut rx.after_reply);
        for (pool, buf) in held {
            self.consume(&mut rx, pool, buf);
        }
    }

    fn take_ready(&self, rx: &mut Rx) -> Option<Message> {
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

    fn recv(&self, timeout: Option<Duration>) -> Result<Option<Message>> {
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

    fn notifications(&self) -> Vec<Notification> {
        let mut rx = self.rx.lock().expect("rx poisoned");
        rx.liveness_due = true;
        self.poll(&mut rx);
        rx.notifications.drain(..).collect()
    }

    fn out_conn(&self, engine: &Engine, peer: &Arc<Peer>) -> Result<Arc<Mutex<OutConn>>> {
        if let Some(c) = self.out.lock().expect("out poisoned").get(&peer.id) {
            return Ok(c.clone());
        }
        let shm = match self.transport {
            TransportChoice::Tcp => false,
            TransportChoice::Shm => {
                if !peer.same_host {
                    return Err(Error::TransportUnavailable {
                        transport: "shm",
                        reason: format!("segment {} is on another host", peer.name),
                    });
                }
                true
            }
            TransportChoice::Auto => peer.same_host && self.shm_enabled,
        };
        let conn = Arc::new(Mutex::new(self.connect(engine, peer, shm)?));
        let mut out = self.out.lock().expect("out poisoned");
        Ok(out.entry(peer.id).or_insert(conn).clone())
    }

    fn connect(&self, engine: &Engine, peer: &Arc<Peer>, shm: bool) -> Result<OutConn> {
        let unreachable = |e: std::io::Error| Error::SegmentUnreachable {
            name: peer.name.clone(),
            reason: format!("message connection: {e}"),
        };
        let mut stream =
            TcpStream::connect_timeout(&peer.addr, self.connect_timeout).map_err(unreachable)?;
        let _ = stream.set_nodelay(true);
        handshake::client(
            &stream,
            ConnKind::Message,
            &self.membership,
            &peer.name,
            self.connect_timeout,
        )?;
        stream
            .set_read_timeout(Some(OPEN_TIMEOUT))
            .map_err(unreachable)?;
        let name = engine.name();
        let mut open = vec![if shm { MODE_SHM } else { MODE_TCP }];
        open.extend_from_slice(&(name.len() as u16).to_le_bytes());
        open.extend_from_slice(name.as_bytes());
        stream.write_all(&open).map_err(unreachable)?;
        let p = &peer.name;
        let mut status = [0u8; 1];
        stream.read_exact(&mut status).map_err(unreachable)?;
        if status[0] != 0 {
            let mut len = [0u8; 2];
            stream.read_exact(&mut len).map_err(unreachable)?;
            let mut reason = vec![0u8; u16::from_le_bytes(len) as usize];
            stream.read_exact(&mut reason).map_err(unreachable)?;
            return Err(Error::RemoteRejected {
                peer: p.clone(),
                reason: String::from_utf8_lossy(&reason).into_owned(),
            });
        }
        let max_len = read_words(&mut stream, 1, 4).map_err(unreachable)?[0] as usize;
        let io = if !shm {
            OutIo::Tcp { inbox: Vec::new() }
        } else {
            let v = read_words(&mut stream, 2, 4).map_err(unreachable)?;
            let (depth, per_chunk) = (v[0] as usize, v[1] as usize);
            let ring = read_words(&mut stream, 2, 8).map_err(unreachable)?;
            let nchunks = read_words(&mut stream, 1, 4).map_err(unreachable)?[0] as usize;
            if nchunks == 0 || nchunks > multirail_policy::receive::MAX_QUEUE_DEPTH {
                return Err(protocol(p, format!("{nchunks} receive chunks")));
            }
            let chunk_addrs = read_words(&mut stream, nchunks, 8).map_err(unreachable)?;
            let chunk_len = read_words(&mut stream, 1, 8).map_err(unreachable)?[0];
            if ring[1] < Ring::bytes(depth) as u64
                || chunk_len < (per_chunk * max_len) as u64
                || per_chunk == 0
            {
                return Err(protocol(p, "message ring or chunks too small"));
            }
            let mut maps = Vec::new();
            let mut map = |addr: u64, len: u64| -> Result<usize> {
                if peer.same_process {
                    return Ok(addr as usize);
                }
                let b = engine.target_buffer(peer, addr, len)?;
                let handle = b
                    .shm
                    .as_ref()
                    .ok_or_else(|| protocol(p, "receive buffers are not in shared memory"))?;
                let m = Arc::new(PeerMapping::open(handle, b.len as usize)?);
                let base = m.base() + (addr - b.addr) as usize;
                maps.push(m);
                Ok(base)
            };
            let ring_base = map(ring[0], ring[1])?;
            let chunks = chunk_addrs
                .iter()
                .map(|&a| map(a, chunk_len))
                .collect::<Result<Vec<_>>>()?;
            for &c in &chunks {
                populate(c as *mut u8, chunk_len as usize);
            }
            OutIo::Shm {
                // SAFETY: `ring_base` maps at least `Ring::bytes(depth)` bytes (checked above),
                // kept alive by `maps`.
                ring: unsafe { Ring::new(ring_base as *mut u8, depth) },
                chunks,
                per_chunk,
                buffer_size: max_len,
                tail: 0,
                _maps: maps,
            }
        };
        stream.set_read_timeout(None).map_err(unreachable)?;
        Ok(OutConn {
            peer: p.clone(),
            stream,
            credits: Credits::default(),
            max_len,
            io,
        })
    }

    fn send(&self, engine: &Engine, segment: SegmentId, kind: MsgKind, data: &[u8]) -> Result<()> {
        let known = self
            .out
            .lock()
            .expect("out poisoned")
            .get(&segment.0)
            .cloned();
        let conn = match known {
            Some(c) => c,
            None => self.out_conn(engine, &engine.peer(segment)?)?,
        };
        let outcome =
            conn.lock()
                .expect("message connection poisoned")
                .send(kind, data, self.timeout);
        match &outcome {
            Err(Error::InvalidArgument { .. }) | Ok(()) => {}
            Err(_) => {
                // Broken: the next send connects again.
                let mut out = self.out.lock().expect("out poisoned");
                if out.get(&segment.0).is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                    out.remove(&segment.0);
                }
            }
        }
        if kind == MsgKind::Message && self.after_reply_pending.load(Ordering::Relaxed) {
            self.release_after_reply();
        }
        outcome
    }
}

/// Faults in the pages of a receive area now, writable, without touching its bytes, as memory
/// registration pins them: otherwise the first message into each buffer pays for page faults
/// on both sides. A kernel without MADV_POPULATE_WRITE (before 5.14) just faults later.
fn populate(ptr: *mut u8, len: usize) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    let page = 4096usize;
    let start = ptr as usize / page * page;
    let end = ptr as usize + len;
    // SAFETY: advice over a range this process mapped; POPULATE_WRITE only faults pages in.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, MADV_POPULATE_WRITE) };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "madvise(MADV_POPULATE_WRITE) refused");
    }
}

/// Reads `n` little-endian words of `width` bytes (4 or 8).
fn read_words(stream: &mut TcpStream, n: usize, width: usize) -> std::io::Result<Vec<u64>> {
    let mut b = vec![0u8; width * n];
    stream.read_exact(&mut b)?;
    Ok(b.chunks(width)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..width].copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect())
}

/// Tells senders about buffers posted for them.
fn grant(conns: &mut [InConn], pools: &mut Pools, key: u64) {
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
fn receive(
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

impl OutConn {
    fn send(&mut self, kind: MsgKind, data: &[u8], timeout: Duration) -> Result<()> {
        if data.len() > self.max_len {
            return Err(Error::invalid(
                "bytes",
                format!(
                    "{} bytes exceed the receiver's {}-byte receive buffers",
                    data.len(),
                    self.max_len
                ),
            ));
        }
        let buf = self.credit(timeout)?;
        match &mut self.io {
            OutIo::Tcp { .. } => {
                let mut h = [0u8; MSG_HEADER_LEN];
                MsgHeader {
                    kind,
                    len: data.len() as u32,
                }
                .encode(&mut h);
                let mut iov = [
                    sockio::iovec(h.as_ptr(), h.len()),
                    sockio::iovec(data.as_ptr(), data.len()),
                ];
                let n = if data.is_empty() { 1 } else { 2 };
                sockio::write_all_vectored(self.stream.as_raw_fd(), &mut iov[..n]).map_err(|e| {
                    Error::PeerDisconnected {
                        peer: self.peer.clone(),
                        reason: format!("sending a message: {e}"),
                    }
                })
            }
            OutIo::Shm {
                ring,
                chunks,
                per_chunk,
                buffer_size,
                tail,
                ..
            } => {
                let i = buf.0 as usize;
                let (chunk, offset) = (i / *per_chunk, (i % *per_chunk) * *buffer_size);
                let Some(base) = chunks.get(chunk) else {
                    return Err(protocol(
                        &self.peer,
                        format!("granted buffer {i} out of range"),
                    ));
                };
                if data.len() <= INLINE_MAX {
                    ring.complete(*tail, buf, data.len(), kind as u8, Some(data));
                } else {
                    // SAFETY: the receiver granted us buffer `i`, inside a chunk we mapped
                    // whole; it reads the bytes only after the completion entry below is
                    // published.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            data.as_ptr(),
                            (*base + offset) as *mut u8,
                            data.len(),
                        )
                    };
                    ring.complete(*tail, buf, data.len(), kind as u8, None);
                }
                *tail += 1;
                Ok(())
            }
        }
    }

    /// One credit, waiting for the receiver to grant one if none is in hand.
    fn credit(&mut self, timeout: Duration) -> Result<BufferId> {
        if let Some(b) = self.credits.take() {
            return Ok(b);
        }
        // The clock is read only once the credits in hand are spent.
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            self.collect_credits()?;
            if let Some(b) = self.credits.take() {
                return Ok(b);
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::Timeout {
                    peer: self.peer.clone(),
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            idle = idle.wrapping_add(1);
            if waited > SPIN && idle.is_multiple_of(16) {
                back_off(waited);
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn collect_credits(&mut self) -> Result<()> {
        match &mut self.io {
            OutIo::Tcp { inbox } => {
                let mut b = [0u8; 256];
                match sockio::recv_nonblocking(self.stream.as_raw_fd(), &mut b) {
                    Ok(None) => return Ok(()),
                    Ok(Some(0)) => {
                        return Err(Error::PeerDisconnected {
                            peer: self.peer.clone(),
                            reason: "the receiver closed the message connection".into(),
                        })
                    }
                    Ok(Some(n)) => inbox.extend_from_slice(&b[..n]),
                    Err(e) => return Err(Error::io("reading credits", e)),
                }
                let whole = inbox.len() / MSG_HEADER_LEN * MSG_HEADER_LEN;
                let mut granted = 0usize;
                for f in inbox[..whole].chunks(MSG_HEADER_LEN) {
                    let h = MsgHeader::decode(f, u32::MAX).map_err(|r| protocol(&self.peer, r))?;
                    if h.kind != MsgKind::Credit {
                        return Err(protocol(&self.peer, "a receiver sent a message frame"));
                    }
                    granted += h.len as usize;
                }
                inbox.drain(..whole);
                self.credits
                    .on_grant(std::iter::repeat_n(BufferId(0), granted));
            }
            OutIo::Shm { ring, .. } => {
                let credits = &mut self.credits;
                ring.take_grants(|id| credits.on_grant([id]));
            }
        }
        Ok(())
    }
}

/// Two-sided messages and notifications.
impl Engine {
    /// Sends `bytes` to segment `segment` (opened with `open_segment`); the peer gets them
    /// from [`Engine::recv`], after every message this engine sent it before. Waits while the
    /// peer has no receive buffer posted for us, up to `transports.tcp.timeout_ms`. Fails when
    /// `bytes` exceeds the peer's receive buffers, on a timeout or a broken connection.
    pub fn send(&self, segment: SegmentId, bytes: &[u8]) -> Result<()> {
        self.messaging()
            .send(self, segment, MsgKind::Message, bytes)
    }

    /// The next message from any peer, waiting (busy polling) up to `timeout` (`None`: no
    /// limit); `Ok(None)` when none came in time.
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Option<Message>> {
        self.messaging().recv(timeout)
    }

    /// Sends a notification to `segment`; it arrives in order with this engine's messages.
    pub fn send_notification(&self, segment: SegmentId, msg: &str) -> Result<()> {
        self.messaging()
            .send(self, segment, MsgKind::Notification, msg.as_bytes())
    }

    /// Notifications received since the last call, in arrival order (per peer: send order).
    pub fn receive_notifications(&self) -> Vec<Notification> {
        self.messaging().notifications()
    }

    /// Submits `requests` like [`Engine::submit`] and, once every one of them completed (its
    /// bytes are in place at the target), sends `msg` as a notification to each segment they
    /// target, so the notification arrives after the data. A failed batch sends no
    /// notification (its error is in the batch's status).
    pub fn submit_with_notification(
        &self,
        batch: BatchId,
        requests: &[Request],
        msg: &str,
    ) -> Result<()> {
        // Hold the batch itself, not its id: a caller that waits and frees the batch at once
        // must not make the notification disappear with it.
        let pending = self.batch(batch)?;
        self.submit(batch, requests)?;
        let mut targets: Vec<SegmentId> = requests.iter().map(|r| r.target).collect();
        targets.sort_by_key(|t| t.0);
        targets.dedup();
        let (engine, msg) = (self.clone(), msg.to_owned());
        thread::Builder::new()
            .name("mr-notify".into())
            .spawn(move || match pending.wait(None, Duration::ZERO) {
                Ok(()) => {
                    for t in targets {
                        if let Err(e) = engine.send_notification(t, &msg) {
                            tracing::warn!(error = %e, "batch notification not sent");
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "batch failed; notification not sent"),
            })
            .map_err(|e| Error::io("spawning notification thread", e))?;
        Ok(())
    }
}
