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
//!   when the sender holds at most half its share. When two engines each give the other a
//!   dedicated lane, one socket carries both lanes (`duplex`): the second lane starts on the
//!   first one's socket, and credits ride in the headers of the frames going that way.
//! * **shm**: the receive buffers are memfd-backed registered chunks the sender maps; per
//!   connection a ring region holds the grant ring (buffer ids the receiver posted for this
//!   sender) and the completion ring (buffer id, length, kind of each message written). Both
//!   sides poll; the TCP connection stays open to notice the sender leaving and to carry the
//!   byte that wakes a receiver asleep on its doorbell (`doorbell`). Under dynamic
//!   lanes that is the dedicated lane; the shared lane is one multi-producer ring per receiver
//!   that every sender on it writes into by an atomic reservation (`shared_ring`,
//!   `shared_shm`), with the ring's free space as the flow control instead of credits.
//!
//! * **rdma**: every message is one SEND on a reliable-connected queue pair, into a receive
//!   buffer of the port's shared receive queue (or the queue pair's own receive queue); the
//!   queue pair is agreed in the opening of the message connection, and credits come back as
//!   RDMA writes of the sender's credit total (see `lanes::rdma`).
//!
//! Receiving is polled by the caller's thread (`recv`, `receive_notifications`): no thread
//! hand-off on the receive path, which keeps round trips short. A `recv` that finds nothing
//! polls for a short, adaptive spin and then sleeps on a doorbell until something arrives
//! (`doorbell`): an idle receiver costs no CPU, and a busy sender pays nothing for it.

mod delivery;
mod doorbell;
mod dynamic;
mod inbound;
mod lane;
mod lanes;
mod outbound;

pub use dynamic::{LanesReport, PeerLane as PeerLaneReport};

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

pub use multirail_policy::lanes::Lane;
use multirail_policy::lanes::LaneMsg;
use multirail_policy::receive::{
    BufferId, ConnId, Credits, ReceiveQueue, ReceiveSettings, ReturnOrder,
};
use multirail_verbs::{
    CompletionChannel, CompletionQueue, QueuePair, SharedReceiveQueue, WorkCompletion,
};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

use crate::cadence::Cadence;
use crate::config::{Config, TransportChoice};
use crate::core_share;
use crate::error::{Error, Result};
use crate::mapping::PeerMapping;
use crate::memory::{Buffer, Location, MemoryRegistry};
use crate::peer::Peer;
use crate::segment::SegmentId;
use crate::server::ConnPermit;
use crate::spin::{Spin, YIELD_AFTER};
use crate::transport::handshake::{self, Membership};
use crate::transport::rdma::messages::{MessageEndpoint, MessageVerbs, ENDPOINT_LEN};
use crate::transport::sockio;
use crate::transport::wire::{self, ConnKind, MsgHeader, MsgKind, MSG_HEADER_LEN};
use delivery::*;
use doorbell::{Doorbell, Woke};
use dynamic::{parse_back, Dynamic, Retiring, RetiringFrom};
use inbound::*;
use lane::{credit, Link, ReaderParts, RecvCx, RecvLane, SendLane};
use lanes::duplex::{Duplex, DuplexRecv, DuplexSend, Reader};
use lanes::rdma::PostedReceives;
use lanes::ring::{Ring, INLINE_MAX};
use lanes::shared_shm::{connect_shared, poll_shared, SharedShm};
use lanes::shm::{connect_shm, SHM_SHARED_RING};
use lanes::tcp::{frame_header, payload_len, receive_frames, staging, SharedTcp, Staging, TcpSend};
use outbound::*;

/// How the opening names a lane.
fn lane_code(lane: Lane) -> u8 {
    match lane {
        Lane::Shared => 0,
        Lane::Dedicated => 1,
    }
}

/// The lane and epoch in an opening's `tail` (what follows the sender's name). Fails on an
/// unknown lane.
fn parse_lane(tail: &[u8]) -> std::result::Result<(Lane, u32), String> {
    if tail.len() < LANE_LEN {
        return Err("incomplete message opening".into());
    }
    let lane = match tail[0] {
        0 => Lane::Shared,
        1 => Lane::Dedicated,
        l => return Err(format!("unknown lane {l}")),
    };
    Ok((
        lane,
        u32::from_le_bytes(tail[1..5].try_into().expect("4 bytes")),
    ))
}

/// Counts of the messages an engine sent and received (see [`crate::Engine::message_stats`]).
/// Notifications and lane negotiation travel as messages too and count here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MessageStats {
    /// Messages sent successfully.
    pub sent: u64,
    /// Their payload bytes.
    pub sent_bytes: u64,
    /// Sends that failed (timeout, peer gone, refused).
    pub send_failures: u64,
    /// Sends that found no credit in hand (on the shm shared ring: no free space) and waited
    /// for the receiver to grant one.
    pub credit_waits: u64,
    /// Messages handed to the application by `recv`.
    pub received: u64,
    /// Their payload bytes.
    pub received_bytes: u64,
    /// Waits in `recv` that stopped spinning and slept on the doorbell until something came
    /// (see `transports.<tcp|shm|rdma>.receive.spin_us`).
    pub recv_sleeps: u64,
    /// Messages a waiting `recv` (or notification wait) was already polling for when they
    /// came, having woken on a timer shortly before they were due at the cadence messages had
    /// been arriving (see `transports.<tcp|shm|rdma>.receive.cadence_lead_us`).
    pub recv_anticipated: u64,
    /// Times a waiting `recv` (or notification wait) that had polled ahead of a message found
    /// that another task had taken its CPU meanwhile, and moved its thread to another CPU the
    /// thread may run on before sleeping (see
    /// `transports.<tcp|shm|rdma>.receive.leave_shared_cpu`).
    pub recv_cpu_moves: u64,
}

/// The engine's message counters; received messages are counted under the receive lock
/// instead (`Rx::received`, two atomic adds fewer per message).
#[derive(Default)]
struct MessageCounters {
    sent: AtomicU64,
    sent_bytes: AtomicU64,
    send_failures: AtomicU64,
    credit_waits: AtomicU64,
}

impl MessageCounters {
    fn snapshot(&self) -> MessageStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MessageStats {
            sent: get(&self.sent),
            sent_bytes: get(&self.sent_bytes),
            send_failures: get(&self.send_failures),
            credit_waits: get(&self.credit_waits),
            received: 0,
            received_bytes: 0,
            recv_sleeps: 0,
            recv_anticipated: 0,
            recv_cpu_moves: 0,
        }
    }
}

/// A message received with [`crate::Engine::recv`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Segment name of the sender, shared by every message of its connection (a clone is a
    /// reference count, not a copy).
    pub from: Arc<str>,
    /// The bytes sent.
    pub data: Vec<u8>,
}

/// A notification received with [`crate::Engine::receive_notifications`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Segment name of the sender.
    pub from: String,
    /// The text sent.
    pub msg: String,
}

const MODE_TCP: u8 = 1;
const MODE_SHM: u8 = 2;
const MODE_RDMA: u8 = 3;
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// Pool keys of the shared pools; per-connection pools use the connection id (from 2).
const SHARED_TCP: u64 = 0;
const SHARED_SHM: u64 = 1;
/// The shared pool of RDMA rail `r` (the buffers of its shared receive queue) is
/// `SHARED_RDMA + r`; connection ids never get this far.
const SHARED_RDMA: u64 = 1 << 62;

/// True for the pool of a single connection, which goes with it.
fn per_connection(key: u64) -> bool {
    (2..SHARED_RDMA).contains(&key)
}
/// Spinning this long without progress makes a sender's wait for credits yield the CPU now and
/// then.
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
    /// The receive queue the buffers are posted to, for messages over RDMA. Declared first:
    /// it goes before the chunks its receives point into.
    hw: Option<PostedReceives>,
    queue: ReceiveQueue,
    chunks: Vec<Buffer>,
    /// Tell grants at once instead of when a sender holds half its share or less.
    eager: bool,
    /// The grant being told, reused so granting after every message allocates nothing.
    granting: Vec<BufferId>,
    /// Buffers a consume posts again, reused likewise.
    reposted: Vec<BufferId>,
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
            hw: None,
            queue,
            chunks,
            eager,
            granting: Vec::new(),
            reposted: Vec::new(),
        })
    }

    /// Hands every buffer to the receive queue `hw`, which the pool feeds from now on.
    fn attach(&mut self, hw: PostedReceives) -> std::result::Result<(), String> {
        let hw = self.hw.insert(hw);
        let (queue, chunks) = (&self.queue, &self.chunks);
        let all =
            (0..queue.settings().queue_depth as u32).map(|i| locate(queue, chunks, BufferId(i)));
        // SAFETY: fresh buffers of this pool's chunks, which outlive `hw` (field order and
        // `release`); nothing reads them before their receive completes.
        unsafe { hw.post(all) }
    }

    /// The message in `id` was consumed: the accounting returns it (and with `bulk` maybe
    /// more), and over RDMA they are posted to the receive queue again.
    fn consumed(&mut self, id: BufferId) -> std::result::Result<(), String> {
        let Some(hw) = &mut self.hw else {
            return self.queue.on_consumed(id).map_err(|e| e.to_string());
        };
        self.reposted.clear();
        self.queue
            .on_consumed_into(id, &mut self.reposted)
            .map_err(|e| e.to_string())?;
        let (queue, chunks) = (&self.queue, &self.chunks);
        let again = self.reposted.iter().map(|&b| locate(queue, chunks, b));
        // SAFETY: consumed buffers of this pool: their messages were copied out, and the
        // accounting posts each once.
        unsafe { hw.post(again) }
    }

    /// Posts `id` again without telling the accounting: a receive the hardware filled for a
    /// connection that is gone or broke, which the accounting still counts as posted.
    fn repost_unaccounted(&mut self, id: BufferId) {
        if id.0 as usize >= self.queue.settings().queue_depth {
            return;
        }
        let (queue, chunks) = (&self.queue, &self.chunks);
        if let Some(hw) = &mut self.hw {
            // SAFETY: the buffer holds no message the engine keeps (it was dropped) and the
            // accounting has it posted, so no other receive names it.
            if let Err(e) = unsafe { hw.post([locate(queue, chunks, id)]) } {
                tracing::error!(error = %e, "cannot post a receive buffer again");
            }
        }
    }

    fn ptr(&self, id: BufferId) -> *mut u8 {
        let (chunk, offset) = self.queue.location(id);
        // SAFETY: `location` keeps the offset inside the chunk (validated settings).
        unsafe { self.chunks[chunk].as_ptr().add(offset) }
    }

    fn release(mut self, registry: &MemoryRegistry) {
        // The receive queue goes first: nothing may land in a chunk once it is unregistered.
        self.hw = None;
        for c in &self.chunks {
            let _ = registry.unregister(c.addr());
        }
    }
}

/// Buffer `id` of a pool as a receive names it: (id, address, chunk index).
fn locate(queue: &ReceiveQueue, chunks: &[Buffer], id: BufferId) -> (BufferId, u64, usize) {
    let (chunk, offset) = queue.location(id);
    (id, chunks[chunk].addr() + offset as u64, chunk)
}

/// What sending messages needs of the engine: its own segment name, its opened peers, and
/// their buffers. The engine implements it; messaging does not depend on the engine itself.
pub(crate) trait Peers {
    /// This engine's segment name, `host:port`.
    fn local_name(&self) -> String;
    /// The peer opened as `segment`. Fails when no such segment is open.
    fn peer(&self, segment: SegmentId) -> Result<Arc<Peer>>;
}

/// The engine's messaging state.
pub(crate) struct Messaging {
    registry: Arc<MemoryRegistry>,
    tcp: ReceiveSettings,
    shm: ReceiveSettings,
    rdma: ReceiveSettings,
    /// The RDMA ports, when RDMA is on; else why it is off.
    verbs: std::result::Result<Arc<MessageVerbs>, String>,
    transport: TransportChoice,
    shm_enabled: bool,
    timeout: Duration,
    connect_timeout: Duration,
    /// `transports.tcp.stream_pause_us`.
    stream_pause: Duration,
    membership: Membership,
    rx: Mutex<Rx>,
    /// Whether `Rx::after_reply` holds buffers (read without taking the lock on every send).
    after_reply_pending: AtomicBool,
    /// Set by [`Messaging::close_all`] (the engine shut down): nothing more can arrive, so a
    /// wait returns instead of sleeping on.
    closed: AtomicBool,
    out: Mutex<HashMap<u64, Arc<Mutex<OutConn>>, BuildHasherDefault<IdHasher>>>,
    /// Per peer: the lane its messages take and the epoch of the next connection to it.
    lanes: Mutex<HashMap<u64, PeerLane, BuildHasherDefault<IdHasher>>>,
    /// Streams of fenced lanes, read until the receiver closes its end (see
    /// `Messaging::retire`).
    retiring: Mutex<Vec<Retiring>>,
    /// `retiring` is not empty (a stream still open, or answers read from one not yet taken).
    retiring_any: AtomicBool,
    /// Answers to lane requests that senders read, by peer, in order, for the lanes driver.
    parked: Mutex<Vec<(u64, LaneMsg)>>,
    next_conn: AtomicU64,
    /// Receive polls so far, and as many as the last background look saw (see
    /// `Messaging::poke_if_idle`).
    polls: AtomicU64,
    polls_seen: AtomicU64,
    /// Dynamic lanes: the usage tracker and both negotiations.
    dynamic: Dynamic,
    counters: MessageCounters,
    /// What a waiting receive sleeps on.
    bell: Doorbell,
    /// How long a waiting receive spins before it sleeps.
    spin: Spin,
    /// When the next message is due, for waits that sleep (see `crate::cadence`), on the
    /// clock of `cadence_epoch`.
    cadence: Mutex<Cadence>,
    cadence_epoch: Instant,
    /// Messages taken by a wait polling ahead of them, for [`MessageStats::recv_anticipated`].
    anticipated: AtomicU64,
    /// Whether a wait that polled ahead of a message and found its CPU taken meanwhile moves
    /// off it before it next sleeps (see `crate::core_share`).
    leave_shared_cpu: bool,
    /// Such moves, for [`MessageStats::recv_cpu_moves`].
    cpu_moves: AtomicU64,
}

/// Bytes of an opening after the sender's name: its lane (u8) and the lane's epoch (u32).
const LANE_LEN: usize = 5;

/// Length of a message connection's opening (mode u8, name length u16, name, lane u8, epoch
/// u32, and for rdma the sender's queue pair) once its first three bytes are in `prefix`;
/// `None` before that. Fails on a name longer than [`wire::MAX_NAME_LEN`] or an unknown mode.
pub(crate) fn opening_len(prefix: &[u8]) -> std::result::Result<Option<usize>, String> {
    if prefix.len() < 3 {
        return Ok(None);
    }
    let extra = match prefix[0] {
        MODE_TCP | MODE_SHM => 0,
        // The sender's queue pair.
        MODE_RDMA => ENDPOINT_LEN,
        m => return Err(format!("unknown message mode {m}")),
    };
    let name_len = u16::from_le_bytes([prefix[1], prefix[2]]) as usize;
    if name_len > wire::MAX_NAME_LEN {
        return Err(format!("sender name of {name_len} bytes"));
    }
    Ok(Some(3 + name_len + LANE_LEN + extra))
}

fn protocol(peer: &str, reason: impl Into<String>) -> Error {
    Error::Protocol {
        peer: peer.to_owned(),
        reason: reason.into(),
    }
}

impl Messaging {
    /// Closes this engine's message connection to peer `id` and forgets its lane (its segment
    /// was closed): a later send to the peer, opened again, starts a new connection.
    pub(crate) fn forget_peer(&self, id: u64) {
        let conn = self.out.lock().expect("out poisoned").remove(&id);
        self.lanes.lock().expect("lanes poisoned").remove(&id);
        self.dynamic.outgoing_gone(id);
        drop(conn);
    }

    /// Closes every message connection this engine opened (it shuts down).
    pub(crate) fn close_all(&self) {
        let conns: Vec<_> = self.out.lock().expect("out poisoned").drain().collect();
        drop(conns);
        self.closed.store(true, Ordering::Release);
        // Whoever waits in `recv` or for notifications returns now, with what is left.
        self.bell.wake_all();
    }

    /// Whether the engine shut down (see [`Messaging::close_all`]).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Counts of messages sent and received so far.
    pub(crate) fn message_stats(&self) -> MessageStats {
        let mut s = self.counters.snapshot();
        // What the receive side counts under its lock (held briefly by any holder).
        let rx = self.rx.lock().expect("rx poisoned");
        s.received += rx.received.0;
        s.received_bytes += rx.received.1;
        s.recv_sleeps = self.bell.sleeps.load(Ordering::Relaxed);
        s.recv_anticipated = self.anticipated.load(Ordering::Relaxed);
        s.recv_cpu_moves = self.cpu_moves.load(Ordering::Relaxed);
        s
    }

    /// Messaging for an engine of `config`; `verbs` carries messages over RDMA when it is on
    /// (else it says why it is off).
    pub(crate) fn new(
        config: &Config,
        registry: Arc<MemoryRegistry>,
        membership: Membership,
        verbs: std::result::Result<Arc<MessageVerbs>, String>,
    ) -> Result<Messaging> {
        let t = &config.transports;
        // One wait covers every transport, so its settings combine the three.
        let receives = [&t.tcp.receive, &t.shm.receive, &t.rdma.receive];
        Ok(Messaging {
            registry,
            tcp: t.tcp.receive.settings(),
            shm: t.shm.receive.settings(),
            rdma: t.rdma.receive.settings(),
            verbs,
            transport: config.transport,
            shm_enabled: t.shm.enable,
            timeout: Duration::from_millis(t.tcp.timeout_ms),
            connect_timeout: Duration::from_millis(t.tcp.connect_timeout_ms),
            stream_pause: Duration::from_micros(t.tcp.stream_pause_us),
            membership,
            rx: Mutex::new(Rx {
                tcp_streak: 0,
                tcp_took_in: false,
                // Under dynamic lanes the shared lane is the one many peers use.
                shared_tcp: if config.lanes.dynamic {
                    Some(SharedTcp::new().map_err(|e| Error::io("creating an epoll set", e))?)
                } else {
                    None
                },
                ..Rx::default()
            }),
            after_reply_pending: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            out: Mutex::default(),
            lanes: Mutex::default(),
            retiring: Mutex::default(),
            retiring_any: AtomicBool::new(false),
            parked: Mutex::default(),
            next_conn: AtomicU64::new(2),
            polls: AtomicU64::new(0),
            polls_seen: AtomicU64::new(u64::MAX),
            dynamic: Dynamic::new(&config.lanes)?,
            counters: MessageCounters::default(),
            bell: Doorbell::new().map_err(|e| Error::io("creating the message doorbell", e))?,
            spin: {
                // The longest spin, adaptive unless a transport says otherwise. The floor: a
                // receiver whose peer was descheduled now and then must not fall into sleeping
                // between the messages of a ping-pong (a quarter of the default stays above a
                // busy tcp round trip).
                let cap = receives.iter().map(|r| r.spin_us).max().unwrap_or(0);
                let cap = Duration::from_micros(cap);
                Spin::new(cap, cap / 4, receives.iter().all(|r| r.adaptive_spin))
            },
            cadence: {
                let lead = if receives.iter().any(|r| r.cadence_lead_us == 0) {
                    0
                } else {
                    receives
                        .iter()
                        .map(|r| r.cadence_lead_us)
                        .max()
                        .unwrap_or(0)
                };
                Mutex::new(Cadence::new(lead.saturating_mul(1000)))
            },
            cadence_epoch: Instant::now(),
            anticipated: AtomicU64::new(0),
            leave_shared_cpu: receives.iter().all(|r| r.leave_shared_cpu),
            cpu_moves: AtomicU64::new(0),
        })
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
