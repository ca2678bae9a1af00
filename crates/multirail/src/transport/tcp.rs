//! The `tcp` transport, initiator side: several persistent connections per peer, each with a
//! sender thread that writes many slices per `writev` straight from registered memory and a
//! reader thread that reaps responses in order and reads READ payloads straight into
//! registered memory. Many slices are in flight on every connection.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, Sender};

use crate::batch::Task;
use crate::error::{Error, Result};
use crate::stats::{RailCounters, TrafficStats};
use crate::topology;
use crate::transport::sockio::{self, iovec};
use crate::transport::wire::{self, ConnKind, RequestHeader, RequestOp, ResponseHeader};
use crate::transport::Opcode;

/// Most slices one `writev` carries.
const SLICES_PER_WRITE: usize = 64;

/// Settings of the tcp transport, taken from `transports.tcp`.
#[derive(Debug, Clone)]
pub(crate) struct TcpSettings {
    pub connections_per_rail: usize,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub max_inflight_bytes: u64,
}

/// One slice to post.
pub(crate) struct Outgoing {
    pub op: Opcode,
    pub local: usize,
    pub remote: u64,
    pub key: u64,
    pub len: u32,
    pub task: Arc<Task>,
}

enum Msg {
    Slice(Outgoing),
    Stop,
}

/// A slice written to the socket whose response has not arrived yet.
struct Inflight {
    seq: u64,
    op: Opcode,
    local: usize,
    len: u32,
    task: Arc<Task>,
    posted: Instant,
}

struct ConnState {
    /// Responses come back in request order, so the oldest slice is always at the front.
    queue: VecDeque<Inflight>,
    next_seq: u64,
    dead: Option<Error>,
}

/// One connection to a peer.
struct Conn {
    peer: String,
    fd: RawFd,
    stream: TcpStream,
    tx: Sender<Msg>,
    state: Mutex<ConnState>,
    inflight_bytes: AtomicU64,
    reads_outstanding: AtomicU32,
    dead: AtomicBool,
    sender: OnceLock<Thread>,
    rail: Arc<RailCounters>,
    settings: TcpSettings,
}

impl Conn {
    /// Marks the connection dead with `err`, fails every slice in flight on it and wakes both
    /// threads. Idempotent: the first error wins.
    fn kill(&self, err: Error) {
        let drained: Vec<Inflight> = {
            let mut st = self.state.lock().expect("conn poisoned");
            if st.dead.is_none() {
                st.dead = Some(err.clone());
            }
            st.queue.drain(..).collect()
        };
        self.dead.store(true, Ordering::Release);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let reason = self
            .state
            .lock()
            .expect("conn poisoned")
            .dead
            .clone()
            .unwrap_or(err);
        for slice in drained {
            self.rail.record_error();
            slice.task.part_done(Err(reason.clone()));
        }
        if let Some(t) = self.sender.get() {
            t.unpark();
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

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Fails the oldest slice if it waited longer than the timeout, killing the connection: a
    /// peer that stopped answering is treated as gone.
    fn check_timeout(&self, now: Instant) {
        let expired = {
            let st = self.state.lock().expect("conn poisoned");
            st.queue
                .front()
                .is_some_and(|f| now.duration_since(f.posted) > self.settings.timeout)
        };
        if expired {
            self.kill(Error::Timeout {
                peer: self.peer.clone(),
                timeout_ms: self.settings.timeout.as_millis() as u64,
            });
        }
    }
}

/// The connections to one peer.
pub(crate) struct TcpPeer {
    conns: Vec<Arc<Conn>>,
    next: AtomicUsize,
}

impl TcpPeer {
    /// Opens `settings.connections_per_rail` data connections to `addr` and starts their threads.
    pub(crate) fn connect(
        peer: &str,
        addr: SocketAddr,
        settings: &TcpSettings,
        stats: &TrafficStats,
    ) -> Result<Arc<TcpPeer>> {
        let mut conns = Vec::with_capacity(settings.connections_per_rail);
        for i in 0..settings.connections_per_rail {
            let stream =
                TcpStream::connect_timeout(&addr, settings.connect_timeout).map_err(|e| {
                    Error::SegmentUnreachable {
                        name: peer.to_owned(),
                        reason: format!("data connection {i} to {addr}: {e}"),
                    }
                })?;
            configure_stream(&stream, settings)
                .map_err(|e| Error::io(format!("configuring connection to {peer}"), e))?;
            let hello = wire::encode_hello(ConnKind::Data);
            let mut iov = [iovec(hello.as_ptr(), hello.len())];
            sockio::write_all_vectored(stream.as_raw_fd(), &mut iov)
                .map_err(|e| Error::io(format!("hello to {peer}"), e))?;
            let rail_name = stream
                .local_addr()
                .ok()
                .and_then(|a| topology::interface_for_address(a.ip()))
                .unwrap_or_else(|| "tcp".to_owned());
            let (tx, rx) = channel::unbounded();
            let conn = Arc::new(Conn {
                peer: peer.to_owned(),
                fd: stream.as_raw_fd(),
                stream,
                tx,
                state: Mutex::new(ConnState {
                    queue: VecDeque::with_capacity(1024),
                    next_seq: 0,
                    dead: None,
                }),
                inflight_bytes: AtomicU64::new(0),
                reads_outstanding: AtomicU32::new(0),
                dead: AtomicBool::new(false),
                sender: OnceLock::new(),
                rail: stats.rail(&rail_name),
                settings: settings.clone(),
            });
            let c = conn.clone();
            let sender = thread::Builder::new()
                .name(format!("mr-tcp-send-{i}"))
                .spawn(move || sender_loop(&c, rx))
                .map_err(|e| Error::io("spawning tcp sender thread", e))?;
            let _ = conn.sender.set(sender.thread().clone());
            let c = conn.clone();
            thread::Builder::new()
                .name(format!("mr-tcp-recv-{i}"))
                .spawn(move || reader_loop(&c))
                .map_err(|e| Error::io("spawning tcp reader thread", e))?;
            conns.push(conn);
        }
        Ok(Arc::new(TcpPeer {
            conns,
            next: AtomicUsize::new(0),
        }))
    }

    /// True once every connection has failed; the peer must be reconnected.
    pub(crate) fn is_dead(&self) -> bool {
        self.conns.iter().all(|c| c.is_dead())
    }

    /// Hands slices to live connections, spreading consecutive slices across them. A slice that
    /// finds no live connection fails its task part with the connection's error.
    pub(crate) fn post(&self, slices: impl Iterator<Item = Outgoing>) {
        let n = self.conns.len();
        for slice in slices {
            let start = self.next.fetch_add(1, Ordering::Relaxed);
            let conn = (0..n)
                .map(|k| &self.conns[(start + k) % n])
                .find(|c| !c.is_dead());
            match conn {
                Some(conn) => {
                    if let Err(channel::SendError(Msg::Slice(s))) = conn.tx.send(Msg::Slice(slice))
                    {
                        s.task.part_done(Err(conn.dead_error()));
                    }
                }
                None => slice.task.part_done(Err(self.conns[0].dead_error())),
            }
        }
    }

    /// Fails slices that waited longer than the timeout.
    pub(crate) fn check_timeouts(&self, now: Instant) {
        for c in &self.conns {
            if !c.is_dead() {
                c.check_timeout(now);
            }
        }
    }

    /// Closes every connection; slices in flight fail with `reason`.
    pub(crate) fn close(&self, reason: &str) {
        for c in &self.conns {
            c.kill(Error::PeerDisconnected {
                peer: c.peer.clone(),
                reason: reason.to_owned(),
            });
            let _ = c.tx.send(Msg::Stop);
        }
    }
}

impl Drop for TcpPeer {
    fn drop(&mut self) {
        self.close("engine shut down");
    }
}

/// Socket options every data connection gets, on both ends.
pub(crate) fn configure_stream(stream: &TcpStream, settings: &TcpSettings) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = socket2::SockRef::from(stream);
    sock.set_keepalive(true)?;
    // The kernel drops a connection whose sent data goes unacknowledged this long, so a dead
    // host is noticed even with nothing in flight at our level.
    sock.set_tcp_user_timeout(Some(settings.timeout))?;
    Ok(())
}

fn sender_loop(conn: &Arc<Conn>, rx: Receiver<Msg>) {
    let mut batch: Vec<Outgoing> = Vec::with_capacity(SLICES_PER_WRITE);
    let mut headers = vec![[0u8; wire::REQUEST_LEN]; SLICES_PER_WRITE];
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(SLICES_PER_WRITE * 2);
    let mut stopping = false;
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
        {
            let mut st = conn.state.lock().expect("conn poisoned");
            if let Some(err) = st.dead.clone() {
                drop(st);
                for s in batch.drain(..) {
                    s.task.part_done(Err(err.clone()));
                }
                continue;
            }
            let now = Instant::now();
            for (i, s) in batch.drain(..).enumerate() {
                let seq = st.next_seq;
                st.next_seq += 1;
                let op = match s.op {
                    Opcode::Write => RequestOp::Write,
                    Opcode::Read => RequestOp::Read,
                };
                RequestHeader {
                    op,
                    len: s.len,
                    id: seq,
                    addr: s.remote,
                    key: s.key,
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
                    op: s.op,
                    local: s.local,
                    len: s.len,
                    task: s.task,
                    posted: now,
                });
            }
        }
        conn.inflight_bytes.fetch_add(bytes, Ordering::AcqRel);
        conn.reads_outstanding.fetch_add(reads, Ordering::AcqRel);
        // Payload iovecs point into registered memory that the submitter keeps registered until
        // the request completes; headers live in `headers`, untouched until the next round.
        if let Err(e) = sockio::write_all_vectored(conn.fd, &mut iov) {
            conn.kill(Error::PeerDisconnected {
                peer: conn.peer.clone(),
                reason: format!("send failed: {e}"),
            });
        }
    }
    // Fail whatever is still queued so no task waits forever.
    let err = conn.dead_error();
    for s in batch.drain(..) {
        s.task.part_done(Err(err.clone()));
    }
    while let Ok(msg) = rx.try_recv() {
        if let Msg::Slice(s) = msg {
            s.task.part_done(Err(err.clone()));
        }
    }
}

/// Reads exactly one response header, pulling in more bytes only when no READ payload can
/// follow, so payload bytes land in registered memory and not in this staging buffer.
struct Staging {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Staging {
    fn available(&self) -> usize {
        self.end - self.start
    }

    fn fill_header(
        &mut self,
        fd: RawFd,
        reads_outstanding: bool,
    ) -> std::io::Result<[u8; wire::RESPONSE_LEN]> {
        while self.available() < wire::RESPONSE_LEN {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let want = if reads_outstanding {
                wire::RESPONSE_LEN - self.available()
            } else {
                self.buf.len() - self.end
            };
            let n = sockio::read_raw(fd, self.buf[self.end..].as_mut_ptr(), want)?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed by peer",
                ));
            }
            self.end += n;
        }
        let h: [u8; wire::RESPONSE_LEN] = self.buf[self.start..self.start + wire::RESPONSE_LEN]
            .try_into()
            .expect("length checked");
        self.start += wire::RESPONSE_LEN;
        Ok(h)
    }

    /// Moves up to `len` already-staged bytes to `dst`; returns how many.
    fn take_into(&mut self, dst: *mut u8, len: usize) -> usize {
        let n = self.available().min(len);
        // SAFETY: `dst..dst+len` is the local destination of an in-flight READ slice inside
        // registered memory, which the submitter keeps registered until the slice completes.
        unsafe { std::ptr::copy_nonoverlapping(self.buf[self.start..].as_ptr(), dst, n) };
        self.start += n;
        n
    }
}

fn reader_loop(conn: &Arc<Conn>) {
    let mut staging = Staging {
        buf: vec![0u8; 64 * 1024].into_boxed_slice(),
        start: 0,
        end: 0,
    };
    let result = reap(conn, &mut staging);
    if let Err(err) = result {
        conn.kill(err);
    }
}

fn reap(conn: &Arc<Conn>, staging: &mut Staging) -> Result<()> {
    let peer = || conn.peer.clone();
    loop {
        let reads = conn.reads_outstanding.load(Ordering::Acquire) > 0;
        let raw = staging
            .fill_header(conn.fd, reads)
            .map_err(|e| Error::PeerDisconnected {
                peer: peer(),
                reason: e.to_string(),
            })?;
        let header = ResponseHeader::decode(&raw).map_err(|reason| Error::Protocol {
            peer: peer(),
            reason,
        })?;
        let slice = {
            let mut st = conn.state.lock().expect("conn poisoned");
            match st.queue.front() {
                Some(f) if f.seq == header.id => st.queue.pop_front().expect("front exists"),
                Some(f) => {
                    return Err(Error::Protocol {
                        peer: peer(),
                        reason: format!(
                            "response for slice {} while {} is oldest",
                            header.id, f.seq
                        ),
                    })
                }
                None => {
                    return Err(Error::Protocol {
                        peer: peer(),
                        reason: format!("response for slice {} with nothing in flight", header.id),
                    })
                }
            }
        };
        let outcome = match header.status {
            wire::Status::Ok if slice.op == Opcode::Read => {
                if header.len != slice.len {
                    let err = Error::Protocol {
                        peer: peer(),
                        reason: format!("read returned {} bytes, asked {}", header.len, slice.len),
                    };
                    slice.task.part_done(Err(err.clone()));
                    return Err(err);
                }
                let dst = slice.local as *mut u8;
                let len = slice.len as usize;
                let staged = staging.take_into(dst, len);
                // SAFETY: `dst..dst+len` is this READ slice's destination in registered memory,
                // written by nothing else until the slice completes.
                if let Err(e) =
                    sockio::read_exact_raw(conn.fd, unsafe { dst.add(staged) }, len - staged)
                {
                    let err = Error::PeerDisconnected {
                        peer: peer(),
                        reason: e.to_string(),
                    };
                    slice.task.part_done(Err(err.clone()));
                    return Err(err);
                }
                Ok(())
            }
            wire::Status::Ok => Ok(()),
            status => Err(Error::RemoteRejected {
                peer: peer(),
                reason: status.reason().to_owned(),
            }),
        };
        if slice.op == Opcode::Read {
            conn.reads_outstanding.fetch_sub(1, Ordering::AcqRel);
        }
        let before = conn
            .inflight_bytes
            .fetch_sub(slice.len as u64, Ordering::AcqRel);
        if before > conn.settings.max_inflight_bytes / 2 {
            if let Some(t) = conn.sender.get() {
                t.unpark();
            }
        }
        match &outcome {
            Ok(()) => conn.rail.record(slice.len as u64, 1),
            Err(_) => conn.rail.record_error(),
        }
        slice.task.part_done(outcome);
    }
}

/// The tcp transport: owns nothing per peer itself; each `Peer` keeps its `TcpPeer`.
pub(crate) struct TcpTransport {
    settings: TcpSettings,
    stats: Arc<TrafficStats>,
}

impl TcpTransport {
    pub(crate) fn new(settings: TcpSettings, stats: Arc<TrafficStats>) -> Self {
        TcpTransport { settings, stats }
    }

    fn connected(&self, peer: &crate::peer::Peer) -> Result<Arc<TcpPeer>> {
        let mut slot = peer.tcp.lock().expect("peer poisoned");
        if let Some(p) = slot.as_ref() {
            if !p.is_dead() {
                return Ok(p.clone());
            }
        }
        let fresh = TcpPeer::connect(&peer.name, peer.addr, &self.settings, &self.stats)?;
        *slot = Some(fresh.clone());
        Ok(fresh)
    }
}

impl crate::transport::Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn prepare(
        &self,
        peer: &crate::peer::Peer,
        _buffer: &crate::segment::BufferDescriptor,
    ) -> Result<()> {
        self.connected(peer).map(|_| ())
    }

    fn post(
        &self,
        peer: &crate::peer::Peer,
        req: crate::transport::Prepared,
        plan: &multirail_policy::slicing::SlicePlan,
    ) {
        let slices = match plan.slices(req.len) {
            Ok(s) => s,
            Err(e) => {
                req.task.add_parts(1);
                req.task
                    .part_done(Err(Error::invalid("length", e.to_string())));
                return;
            }
        };
        let tcp = match self.connected(peer) {
            Ok(t) => t,
            Err(e) => {
                req.task.add_parts(1);
                req.task.part_done(Err(e));
                return;
            }
        };
        req.task.add_parts(slices.len() as u32);
        let (op, local, remote, key, task) =
            (req.op, req.local, req.remote, req.buffer.key, &req.task);
        tcp.post(slices.map(|s| Outgoing {
            op,
            local: local + s.offset as usize,
            remote: remote + s.offset,
            key,
            len: s.length as u32,
            task: task.clone(),
        }));
    }
}

impl TcpTransport {
    /// Fails slices of `peer` that waited longer than the timeout.
    pub(crate) fn check_timeouts(&self, peer: &crate::peer::Peer, now: Instant) {
        let tcp = peer.tcp.lock().expect("peer poisoned").clone();
        if let Some(t) = tcp {
            t.check_timeouts(now);
        }
    }
}
