//! One initiator-side connection of the `tcp` transport: a sender thread that writes many slices
//! per `writev` straight from registered memory, and a reader thread that reaps responses in
//! order and reads READ payloads straight into registered memory. Many slices are in flight at
//! once. When the connection dies, its slices go back to the peer to be retried on another rail.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, Sender};

use multirail_policy::dispatch::SliceId;
use multirail_policy::qos::Priority;

use crate::error::{Error, Result};
use crate::stats::RailCounters;
use crate::transport::cpu_priority::{NiceTable, ThreadNice};
use crate::transport::handshake::{self, Membership};
use crate::transport::sockio::{self, iovec};
use crate::transport::wire::{self, ConnKind, RequestHeader, RequestOp};
use crate::transport::Opcode;

mod reap;

use reap::{reader_loop, Reaping};

/// Most slices one `writev` carries.
const SLICES_PER_WRITE: usize = 64;
/// Largest HIGH slice a submitting thread writes itself (see [`Conn::send_now`]): one default
/// slice, which an idle connection's socket buffer takes whole.
const DIRECT_WRITE_MAX: u64 = 64 * 1024;
/// READ answers of at most this many bytes are read through the reader's staging, with the
/// answers behind them, as many as the socket holds: copying 4 KiB out of staging costs less
/// than the two system calls (header, then payload) that would read it alone. Larger payloads
/// go straight from the socket to their destination.
const SMALL_READ: usize = 16 * 1024;

/// Settings of the tcp transport, taken from `transports.tcp`.
#[derive(Debug, Clone)]
pub(crate) struct TcpSettings {
    pub connections_per_rail: usize,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub max_inflight_bytes: u64,
    pub max_retries: u32,
    /// CPU priority of the connection's threads by the priority of what they carry.
    pub nice: NiceTable,
    /// What this engine proves in every connection's handshake.
    pub membership: Membership,
    /// Idle time before TCP keepalive probes a connection.
    pub keepalive: Duration,
    /// How long a slice may keep the peer's fastest rail busy (`slice_time_us`; zero keeps
    /// `workers.block_size`).
    pub slice_time: Duration,
    /// Dispatcher settings beyond the timeout and retries above (window controller, bulk
    /// chunking beside HIGH, rail health).
    pub dispatch: multirail_policy::dispatch::DispatchConfig,
    /// `nontemporal_copies`: small READ answers leave staging with streaming stores.
    pub nontemporal_copies: bool,
}

/// One slice to post: the target buffer's key is what it presents.
pub(crate) type Outgoing = crate::transport::driver::OutSlice<u64>;

/// What a connection reports to: the peer that owns it.
pub(crate) trait ConnOwner: Send + Sync {
    /// A slice posted at `posted` was answered: `ok` when its bytes are in place, false when the
    /// target refused it (which no retry can fix).
    fn answered(&self, id: SliceId, posted: Instant, now: Instant, ok: bool);
    /// The connection on `rail` died with `err` (reported once per connection).
    fn connection_lost(&self, rail: usize, err: &Error);
    /// The peer closed a connection (end of stream or reset) where an answer was due to begin:
    /// its process may have exited, and the one listening on its address next may be another.
    /// Reported before [`connection_lost`](Self::connection_lost). A connection this end
    /// dropped (a rail's link down, a timeout) is not reported here.
    fn closed_by_peer(&self);
    /// Slices that were in flight or queued on a dead connection of `rail`; each must be
    /// retried elsewhere or failed.
    fn slices_returned(&self, rail: usize, slices: Vec<Outgoing>, err: Error);
}

enum Msg {
    Slice(Outgoing),
    Stop,
}

/// A slice written to the socket whose response has not arrived yet.
struct Inflight {
    seq: u64,
    slice: Outgoing,
    posted: Instant,
    /// Written by the submitting thread itself ([`Conn::send_now`]), which happens only with
    /// nothing else in flight: such a slice is always at the front of the queue.
    direct: bool,
}

struct ConnState {
    /// Responses come back in request order, so the oldest slice is always at the front.
    queue: VecDeque<Inflight>,
    next_seq: u64,
    dead: Option<Error>,
}

/// One connection to a peer on one rail pair.
pub(crate) struct Conn {
    peer: String,
    rail: usize,
    fd: RawFd,
    stream: TcpStream,
    tx: Sender<Msg>,
    state: Mutex<ConnState>,
    /// Held by whoever writes to the socket (the sender thread, or a thread writing a HIGH slice
    /// itself), from taking sequence numbers to the last byte, so frames never interleave and
    /// go out in sequence order.
    writer: Mutex<()>,
    inflight_bytes: AtomicU64,
    /// What the taker of answers keeps between them: locked by whichever thread takes them.
    reaping: Mutex<Reaping>,
    /// Highest priority (lowest level) in the sender's last write; the reader thread takes on
    /// the same CPU priority, since it completes those slices.
    carrying: AtomicU8,
    reads_outstanding: AtomicU32,
    dead: AtomicBool,
    sender: OnceLock<Thread>,
    counters: Arc<RailCounters>,
    owner: Weak<dyn ConnOwner>,
    settings: TcpSettings,
}

/// Where and how to open a connection.
pub(crate) struct ConnTarget<'a> {
    pub peer: &'a str,
    pub remote: SocketAddr,
    /// Local address to bind, and the interface to pin the socket to.
    pub bind: Option<(IpAddr, Option<&'a str>)>,
    pub rail: usize,
}

fn open_socket(target: &ConnTarget<'_>, settings: &TcpSettings) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(
        Domain::for_address(target.remote),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    if let Some((addr, iface)) = target.bind {
        if let Some(iface) = iface {
            // Pinning to the interface keeps the kernel from routing this rail's traffic out of
            // another one. It needs CAP_NET_RAW; without it the address binding still steers
            // traffic on any sane routing table.
            if let Err(e) = socket.bind_device(Some(iface.as_bytes())) {
                static WARNED: OnceLock<()> = OnceLock::new();
                if WARNED.set(()).is_ok() {
                    tracing::warn!(interface = iface, error = %e, "SO_BINDTODEVICE refused; binding rails by address only");
                }
            }
        }
        socket.bind(&SocketAddr::new(addr, 0).into())?;
    }
    socket.connect_timeout(&target.remote.into(), settings.connect_timeout)?;
    let stream: TcpStream = socket.into();
    configure_stream(&stream, settings)?;
    Ok(stream)
}

impl Conn {
    /// Opens a data connection and starts its two threads.
    pub(crate) fn open(
        target: &ConnTarget<'_>,
        settings: &TcpSettings,
        counters: Arc<RailCounters>,
        owner: Weak<dyn ConnOwner>,
    ) -> Result<Arc<Conn>> {
        let stream = open_socket(target, settings).map_err(|e| Error::SegmentUnreachable {
            name: target.peer.to_owned(),
            reason: format!("data connection to {}: {e}", target.remote),
        })?;
        handshake::client(
            &stream,
            ConnKind::Data,
            &settings.membership,
            target.peer,
            settings.connect_timeout,
        )?;
        let (tx, rx) = channel::unbounded();
        let conn = Arc::new(Conn {
            peer: target.peer.to_owned(),
            rail: target.rail,
            fd: stream.as_raw_fd(),
            stream,
            tx,
            state: Mutex::new(ConnState {
                queue: VecDeque::with_capacity(1024),
                next_seq: 0,
                dead: None,
            }),
            writer: Mutex::new(()),
            inflight_bytes: AtomicU64::new(0),
            reaping: Mutex::new(Reaping::new(settings.nontemporal_copies)),
            carrying: AtomicU8::new(0),
            reads_outstanding: AtomicU32::new(0),
            dead: AtomicBool::new(false),
            sender: OnceLock::new(),
            counters,
            owner,
            settings: settings.clone(),
        });
        let c = conn.clone();
        let sender = thread::Builder::new()
            .name(format!("mr-tcp-send-{}", target.rail))
            .spawn(move || sender_loop(&c, rx))
            .map_err(|e| Error::io("spawning tcp sender thread", e))?;
        let _ = conn.sender.set(sender.thread().clone());
        let c = conn.clone();
        thread::Builder::new()
            .name(format!("mr-tcp-recv-{}", target.rail))
            .spawn(move || reader_loop(&c))
            .map_err(|e| Error::io("spawning tcp reader thread", e))?;
        Ok(conn)
    }

    /// Queues a slice; hands it back when the connection is dead.
    pub(crate) fn send(&self, slice: Outgoing) -> std::result::Result<(), Outgoing> {
        // Checking and queueing under the state lock orders every queued slice before the
        // Stop that `kill` queues, so the sender thread hands back everything it was given.
        let st = self.state.lock().expect("conn poisoned");
        if st.dead.is_some() {
            return Err(slice);
        }
        let sent = self.tx.send(Msg::Slice(slice));
        drop(st);
        match sent {
            Ok(()) => Ok(()),
            Err(channel::SendError(Msg::Slice(s))) => Err(s),
            Err(_) => unreachable!("only slices are sent here"),
        }
    }

    /// Writes a slice of at most [`DIRECT_WRITE_MAX`] bytes on the calling thread when the
    /// connection is idle (nothing in flight, nothing waiting for the sender thread, no other
    /// thread writing) and the socket takes the first bytes at once; otherwise queues it like
    /// [`send`](Self::send). This spares a
    /// HIGH slice the sender thread's wake-up, which on a host whose cores are busy moving bulk
    /// bytes can cost more than the write. Hands the slice back when the connection is dead.
    pub(crate) fn send_now(self: &Arc<Self>, slice: Outgoing) -> std::result::Result<(), Outgoing> {
        let len = u64::from(slice.len);
        // Only a small slice on an idle connection: the write then costs one system call that
        // returns at once. A stream of slices is better served by the sender thread, which
        // writes them in batches while the submitter goes on posting; written here one by one
        // they cut a 1 MiB HIGH write stream from 3.0 to 1.1 GB/s.
        if len > DIRECT_WRITE_MAX
            || self.inflight_bytes.load(Ordering::Acquire) > 0
            || !self.tx.is_empty()
        {
            return self.send(slice);
        }
        let Ok(writing) = self.writer.try_lock() else {
            return self.send(slice);
        };
        let mut header = [0u8; wire::REQUEST_LEN];
        let is_write = slice.op == Opcode::Write;
        let payload = (slice.local as *const u8, slice.len as usize);
        let task = slice.task.clone();
        let seq = {
            let mut st = self.state.lock().expect("conn poisoned");
            if st.dead.is_some() {
                return Err(slice);
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            RequestHeader {
                op: request_op(&slice),
                len: slice.len,
                id: seq,
                addr: slice.remote,
                key: slice.key,
                priority: slice.priority,
            }
            .encode(&mut header);
            let now = Instant::now();
            // Queued before the first byte goes out: the response can arrive at once.
            st.queue.push_back(Inflight {
                seq,
                slice,
                posted: now,
                direct: true,
            });
            seq
        };
        self.inflight_bytes.fetch_add(len, Ordering::AcqRel);
        if !is_write {
            self.reads_outstanding.fetch_add(1, Ordering::AcqRel);
        }
        let mut iov = [
            iovec(header.as_ptr(), wire::REQUEST_LEN),
            iovec(payload.0, payload.1),
        ];
        let iov = if is_write {
            &mut iov[..]
        } else {
            &mut iov[..1]
        };
        // Payload iovec: registered memory the submitter keeps registered until the request
        // completes; the header lives on this stack until the write returns.
        match sockio::write_vectored_nonblocking(self.fd, iov) {
            Ok(Some(0)) | Ok(None) => {
                // The socket is full: take the slice back (nothing of it went out, so no
                // answer can have taken it) and leave it to the sender thread.
                let back = {
                    let mut st = self.state.lock().expect("conn poisoned");
                    match st.queue.back() {
                        Some(b) if b.seq == seq => {
                            st.next_seq -= 1;
                            st.queue.pop_back()
                        }
                        // `kill` drained it and handed it back to the owner already.
                        _ => None,
                    }
                };
                self.inflight_bytes.fetch_sub(len, Ordering::AcqRel);
                if !is_write {
                    self.reads_outstanding.fetch_sub(1, Ordering::AcqRel);
                }
                drop(writing);
                match back {
                    Some(b) => self.send(b.slice),
                    None => Ok(()),
                }
            }
            Ok(Some(n)) => {
                // The frame has begun: finish it here, blocking if need be, so no other frame
                // lands inside it.
                let rest = sockio::advance(iov, n);
                if let Err(e) = sockio::write_all_vectored(self.fd, rest) {
                    drop(writing);
                    self.kill(self.io_failure("send failed: ", &e));
                    return Ok(());
                }
                drop(writing);
                // The thread waiting for this slice may take its answer itself.
                let source: Weak<Conn> = Arc::downgrade(self);
                task.answered_on(source);
                Ok(())
            }
            Err(e) => {
                drop(writing);
                // The slice is in flight on this connection: `kill` hands it back to the owner.
                self.kill(self.io_failure("send failed: ", &e));
                Ok(())
            }
        }
    }

    /// Kills the connection as [`kill`](Self::kill) does, and makes its close abortive: when
    /// the last handle drops, the kernel discards what the socket still holds unsent and resets
    /// the connection, instead of delivering it after a FIN. For a connection given up on while
    /// its peer may still be there (a stalled rail, a link that went down, a silent peer): its
    /// slices are retried on other connections, and bytes of an old WRITE that reached the
    /// target afterwards (once the link came back) would land over whatever the range was
    /// written with since.
    pub(crate) fn abort(&self, err: Error) {
        if let Err(e) = socket2::SockRef::from(&self.stream).set_linger(Some(Duration::ZERO)) {
            tracing::debug!(peer = %self.peer, rail = self.rail, error = %e, "SO_LINGER refused: the close will not reset");
        }
        self.kill(err);
    }

    /// Marks the connection dead with `err` and hands every slice in flight on it back to the
    /// owner. Idempotent: the first error wins and slices are handed back once.
    pub(crate) fn kill(&self, err: Error) {
        let (drained, reason) = {
            let mut st = self.state.lock().expect("conn poisoned");
            if st.dead.is_none() {
                st.dead = Some(err);
            }
            let reason = st.dead.clone().expect("just set");
            (
                st.queue.drain(..).map(|i| i.slice).collect::<Vec<_>>(),
                reason,
            )
        };
        let first = !self.dead.swap(true, Ordering::AcqRel);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if first {
            if let Some(owner) = self.owner.upgrade() {
                owner.connection_lost(self.rail, &reason);
            }
        }
        self.hand_back(drained, reason);
        if first {
            let _ = self.tx.send(Msg::Stop);
        }
        if let Some(t) = self.sender.get() {
            t.unpark();
        }
    }

    fn hand_back(&self, slices: Vec<Outgoing>, err: Error) {
        if slices.is_empty() {
            return;
        }
        for _ in &slices {
            self.counters.record_error();
        }
        match self.owner.upgrade() {
            Some(owner) => owner.slices_returned(self.rail, slices, err),
            None => {
                for s in slices {
                    s.task.part_done(Err(err.clone()));
                }
            }
        }
    }

    fn dead_error(&self) -> Error {
        self.state
            .lock()
            .expect("conn poisoned")
            .dead
            .clone()
            .unwrap_or_else(|| Error::PeerDisconnected {
                peer: self.peer.clone(),
                reason: "connection closed".into(),
            })
    }

    /// What a socket error `e` means for this connection; `doing` prefixes the reason.
    /// `ETIMEDOUT` is the kernel's `TCP_USER_TIMEOUT`, which [`keep_alive`] sets to
    /// `timeout_ms`: the peer acknowledged nothing for the timeout, the very verdict of
    /// [`check_timeout`](Self::check_timeout), so it is reported as [`Error::Timeout`] and the
    /// owner treats it alike (no retry unless another rail answers), whichever fires first.
    fn io_failure(&self, doing: &str, e: &std::io::Error) -> Error {
        if e.raw_os_error() == Some(libc::ETIMEDOUT) {
            Error::Timeout {
                peer: self.peer.clone(),
                timeout_ms: self.settings.timeout.as_millis() as u64,
                detail: "",
            }
        } else {
            Error::PeerDisconnected {
                peer: self.peer.clone(),
                reason: format!("{doing}{e}"),
            }
        }
    }

    /// True once the connection has failed or was closed.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }
}

/// Socket options every data connection gets, on both ends.
pub(crate) fn configure_stream(stream: &TcpStream, settings: &TcpSettings) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    keep_alive(stream, settings.keepalive, settings.timeout)
}

/// Probes `stream` once it has been idle for `idle`, and has the kernel drop it when sent data
/// or a probe goes unanswered for `timeout`: a dead host is noticed even with nothing in flight
/// at our level, and a peer whose FIN was lost does not hold the connection forever.
pub(crate) fn keep_alive(
    stream: &TcpStream,
    idle: Duration,
    timeout: Duration,
) -> std::io::Result<()> {
    let sock = socket2::SockRef::from(stream);
    let interval = (idle / 3).max(Duration::from_secs(1));
    sock.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(idle.max(Duration::from_secs(1)))
            .with_interval(interval)
            .with_retries(3),
    )?;
    sock.set_tcp_user_timeout(Some(timeout))?;
    Ok(())
}

fn sender_loop(conn: &Arc<Conn>, rx: Receiver<Msg>) {
    let mut batch: Vec<Outgoing> = Vec::with_capacity(SLICES_PER_WRITE);
    let mut headers = vec![[0u8; wire::REQUEST_LEN]; SLICES_PER_WRITE];
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(SLICES_PER_WRITE * 2);
    let mut stopping = false;
    let mut nice = ThreadNice::for_this_thread(conn.settings.nice);
    while !stopping {
        match rx.recv() {
            Ok(Msg::Slice(s)) => batch.push(s),
            Ok(Msg::Stop) | Err(_) => break,
        }
        let mut bytes = batch[0].len as u64;
        while batch.len() < SLICES_PER_WRITE && bytes < conn.settings.max_inflight_bytes / 4 {
            match rx.try_recv() {
                Ok(Msg::Slice(s)) => {
                    bytes += s.len as u64;
                    batch.push(s);
                }
                Ok(Msg::Stop) => {
                    stopping = true;
                    break;
                }
                Err(_) => break,
            }
        }
        let carrying = batch
            .iter()
            .map(|s| s.priority)
            .min()
            .unwrap_or(Priority::High);
        nice.follow(carrying);
        conn.carrying.store(carrying.as_u8(), Ordering::Relaxed);
        // Keep at most the window in flight, so a slow peer backs up here and not without bound
        // in socket buffers.
        while !conn.is_dead()
            && conn.inflight_bytes.load(Ordering::Acquire) > 0
            && conn.inflight_bytes.load(Ordering::Acquire) + bytes
                > conn.settings.max_inflight_bytes
        {
            thread::park_timeout(Duration::from_millis(5));
        }
        iov.clear();
        let mut reads = 0;
        let writing = conn.writer.lock().expect("conn poisoned");
        {
            let mut st = conn.state.lock().expect("conn poisoned");
            if let Some(err) = st.dead.clone() {
                drop(st);
                drop(writing);
                conn.hand_back(std::mem::take(&mut batch), err);
                continue;
            }
            let now = Instant::now();
            for (i, s) in batch.drain(..).enumerate() {
                let seq = st.next_seq;
                st.next_seq += 1;
                RequestHeader {
                    op: request_op(&s),
                    len: s.len,
                    id: seq,
                    addr: s.remote,
                    key: s.key,
                    priority: s.priority,
                }
                .encode(&mut headers[i]);
                iov.push(iovec(headers[i].as_ptr(), wire::REQUEST_LEN));
                if s.op == Opcode::Write {
                    iov.push(iovec(s.local as *const u8, s.len as usize));
                } else {
                    reads += 1;
                }
                st.queue.push_back(Inflight {
                    seq,
                    slice: s,
                    posted: now,
                    direct: false,
                });
            }
        }
        conn.inflight_bytes.fetch_add(bytes, Ordering::AcqRel);
        conn.reads_outstanding.fetch_add(reads, Ordering::AcqRel);
        // Payload iovecs point into registered memory that the submitter keeps registered until
        // the request completes; headers live in `headers`, untouched until the next round.
        let written = sockio::write_all_vectored(conn.fd, &mut iov);
        drop(writing);
        if let Err(e) = written {
            conn.kill(conn.io_failure("send failed: ", &e));
        }
    }
    // Hand back whatever is still queued so no task waits forever.
    let mut rest = std::mem::take(&mut batch);
    while let Ok(msg) = rx.try_recv() {
        if let Msg::Slice(s) = msg {
            rest.push(s);
        }
    }
    conn.hand_back(rest, conn.dead_error());
}

/// The wire op of `slice`: a probe travels as one, its payload dropped by the target.
fn request_op(slice: &Outgoing) -> RequestOp {
    match slice.op {
        _ if slice.probe => RequestOp::Probe,
        Opcode::Write => RequestOp::Write,
        Opcode::Read => RequestOp::Read,
    }
}
