//! The engine's listening port: it answers descriptor queries (control connections) and serves
//! slices (data connections). Target side of the `tcp` transport: every slice is checked against
//! the buffer's key and bounds before a byte lands, WRITE payloads are received straight into
//! registered memory, READ payloads are sent straight from it.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::memory::{MemoryRegistry, Region};
use crate::messaging::Messaging;
use crate::transport::cpu_priority::{NiceTable, ThreadNice};
use crate::transport::sockio::{self, iovec};
use crate::transport::wire::{self, ConnKind, RequestHeader, RequestOp, ResponseHeader, Status};

/// Responses gathered before one `writev`.
const RESPONSES_PER_WRITE: usize = 64;
/// Longest a finished slice's response may wait for company. Batching responses saves
/// syscalls at high slice rates, but a held-back acknowledgement delays the initiator's
/// completion and distorts the bandwidth it measures per rail.
const RESPONSE_DELAY: Duration = Duration::from_micros(100);
/// How long a new connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Produces the current segment descriptor as JSON for control queries.
pub(crate) type DescriptorSource = Arc<dyn Fn() -> Vec<u8> + Send + Sync>;

/// A running listener and the connections it accepted.
pub(crate) struct Server {
    local_addr: SocketAddr,
    listener: TcpListener,
    stopping: Arc<AtomicBool>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    accept_thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds `listen` and starts accepting. Port 0 picks a free port.
    pub(crate) fn start(
        listen: SocketAddr,
        registry: Arc<MemoryRegistry>,
        descriptor: DescriptorSource,
        messages: Arc<Messaging>,
        nice: NiceTable,
    ) -> Result<Server> {
        let listener = TcpListener::bind(listen)
            .map_err(|e| Error::io(format!("binding control port {listen}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading bound address", e))?;
        let stopping = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<HashMap<u64, TcpStream>>> = Arc::default();
        let accept_listener = listener
            .try_clone()
            .map_err(|e| Error::io("cloning listener", e))?;
        let (stop, conns2) = (stopping.clone(), conns.clone());
        let accept_thread = thread::Builder::new()
            .name("mr-accept".into())
            .spawn(move || {
                accept_loop(
                    accept_listener,
                    stop,
                    conns2,
                    registry,
                    descriptor,
                    messages,
                    nice,
                )
            })
            .map_err(|e| Error::io("spawning accept thread", e))?;
        Ok(Server {
            local_addr,
            listener,
            stopping,
            conns,
            accept_thread: Some(accept_thread),
        })
    }

    /// The address actually bound.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        // SAFETY: shutting down our own listening socket only wakes the blocked accept(); the
        // descriptor stays open until `self.listener` drops.
        unsafe {
            libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR);
        }
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        for (_, s) in self.conns.lock().expect("server poisoned").drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    stopping: Arc<AtomicBool>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    registry: Arc<MemoryRegistry>,
    descriptor: DescriptorSource,
    messages: Arc<Messaging>,
    nice: NiceTable,
) {
    let next_id = AtomicU64::new(0);
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) => {
                if stopping.load(Ordering::Acquire) {
                    return;
                }
                tracing::warn!(error = %e, "accept failed");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if stopping.load(Ordering::Acquire) {
            return;
        }
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            conns.lock().expect("server poisoned").insert(id, clone);
        }
        let (registry, descriptor, conns) = (registry.clone(), descriptor.clone(), conns.clone());
        let messages = messages.clone();
        let spawned = thread::Builder::new()
            .name(format!("mr-serve-{id}"))
            .spawn(move || {
                if let Err(reason) = serve(stream, &registry, &descriptor, &messages, nice) {
                    tracing::warn!(%peer, %reason, "closed connection");
                }
                conns.lock().expect("server poisoned").remove(&id);
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot spawn a thread for a new connection");
        }
    }
}

fn serve(
    mut stream: TcpStream,
    registry: &MemoryRegistry,
    descriptor: &DescriptorSource,
    messages: &Messaging,
    nice: NiceTable,
) -> Result<(), String> {
    stream
        .set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut hello = [0u8; wire::HELLO_LEN];
    stream
        .read_exact(&mut hello)
        .map_err(|e| format!("reading hello: {e}"))?;
    let kind = wire::decode_hello(&hello)?;
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    match kind {
        ConnKind::Control => serve_control(stream, descriptor),
        ConnKind::Data => serve_data(stream.as_raw_fd(), registry, nice),
        ConnKind::Message => messages.accept(stream),
    }
}

fn serve_control(mut stream: TcpStream, descriptor: &DescriptorSource) -> Result<(), String> {
    let mut op = [0u8; 1];
    loop {
        match stream.read(&mut op) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) => return Err(format!("reading control request: {e}")),
        }
        match op[0] {
            wire::CONTROL_GET_DESCRIPTOR => {
                let json = descriptor();
                let mut msg = Vec::with_capacity(4 + json.len());
                msg.extend_from_slice(&(json.len() as u32).to_le_bytes());
                msg.extend_from_slice(&json);
                stream
                    .write_all(&msg)
                    .map_err(|e| format!("sending descriptor: {e}"))?;
            }
            other => return Err(format!("unknown control request {other}")),
        }
    }
}

/// Checks a slice against the registry: the buffer exists, the key matches, the range fits.
fn check(registry: &MemoryRegistry, h: &RequestHeader) -> Result<Arc<Region>, Status> {
    let region = registry.find(h.addr, 1).ok_or(Status::BadKey)?;
    if region.key() != h.key {
        return Err(Status::BadKey);
    }
    if !region.contains(h.addr, h.len as u64) {
        return Err(Status::OutOfBounds);
    }
    Ok(region)
}

/// Responses waiting for one `writev`, in request order.
struct Responses {
    /// When the oldest unsent response was queued.
    oldest: Option<std::time::Instant>,
    headers: Vec<[u8; wire::RESPONSE_LEN]>,
    payloads: Vec<Option<(usize, usize)>>,
    held: Vec<Arc<Region>>,
    bytes: usize,
    iov: Vec<libc::iovec>,
}

impl Responses {
    fn push(&mut self, status: Status, id: u64, payload: Option<(usize, usize, Arc<Region>)>) {
        let mut h = [0u8; wire::RESPONSE_LEN];
        let len = payload.as_ref().map_or(0, |p| p.1);
        ResponseHeader {
            status,
            len: len as u32,
            id,
        }
        .encode(&mut h);
        self.headers.push(h);
        self.payloads.push(payload.as_ref().map(|p| (p.0, p.1)));
        if let Some((_, len, region)) = payload {
            self.bytes += len;
            self.held.push(region);
        }
    }

    fn due(&self) -> bool {
        self.headers.len() >= RESPONSES_PER_WRITE
            || self.bytes >= 8 << 20
            || self.oldest.is_some_and(|t| t.elapsed() >= RESPONSE_DELAY)
    }

    fn flush(&mut self, fd: RawFd) -> Result<(), String> {
        if self.headers.is_empty() {
            return Ok(());
        }
        self.iov.clear();
        for (h, p) in self.headers.iter().zip(&self.payloads) {
            self.iov.push(iovec(h.as_ptr(), h.len()));
            if let Some((ptr, len)) = p {
                self.iov.push(iovec(*ptr as *const u8, *len));
            }
        }
        // Payloads point into regions held in `self.held` until this write returns.
        sockio::write_all_vectored(fd, &mut self.iov)
            .map_err(|e| format!("sending responses: {e}"))?;
        self.headers.clear();
        self.payloads.clear();
        self.held.clear();
        self.bytes = 0;
        self.oldest = None;
        Ok(())
    }
}

struct Staging {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Staging {
    fn available(&self) -> usize {
        self.end - self.start
    }
    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }
}

/// Serves slices until the peer closes the connection (`Ok`) or sends a malformed frame (`Err`).
fn serve_data(fd: RawFd, registry: &MemoryRegistry, nice: NiceTable) -> Result<(), String> {
    let mut nice = ThreadNice::for_this_thread(nice);
    let mut st = Staging {
        buf: vec![0u8; 64 * 1024].into_boxed_slice(),
        start: 0,
        end: 0,
    };
    let mut scratch = vec![0u8; 64 * 1024];
    let mut out = Responses {
        oldest: None,
        headers: Vec::with_capacity(RESPONSES_PER_WRITE),
        payloads: Vec::with_capacity(RESPONSES_PER_WRITE),
        held: Vec::with_capacity(RESPONSES_PER_WRITE),
        bytes: 0,
        iov: Vec::with_capacity(RESPONSES_PER_WRITE * 2),
    };
    let mut last_was_read = false;
    loop {
        // Get one request header. Read one header at a time unless requests are READs (no
        // payload follows them), so WRITE payloads go straight to memory, not through here.
        while st.available() < wire::REQUEST_LEN {
            st.compact();
            let want = if last_was_read {
                (st.buf.len() - st.end).min(16 * wire::REQUEST_LEN)
            } else {
                wire::REQUEST_LEN - st.available()
            };
            let end = st.end;
            let n = match sockio::recv_nonblocking(fd, &mut st.buf[end..end + want]) {
                Ok(Some(n)) => n,
                Ok(None) => {
                    // Nothing waiting: answer what we have before blocking.
                    out.flush(fd)?;
                    sockio::read_raw(fd, st.buf[end..].as_mut_ptr(), want)
                        .map_err(|e| format!("reading request: {e}"))?
                }
                Err(e) => return Err(format!("reading request: {e}")),
            };
            if n == 0 {
                out.flush(fd).ok();
                return if st.available() == 0 {
                    Ok(())
                } else {
                    Err("connection closed inside a request header".into())
                };
            }
            st.end += n;
        }
        let h = RequestHeader::decode(&st.buf[st.start..st.start + wire::REQUEST_LEN])?;
        st.start += wire::REQUEST_LEN;
        nice.follow(h.priority);
        match h.op {
            RequestOp::Write => {
                last_was_read = false;
                let len = h.len as usize;
                match check(registry, &h) {
                    Ok(region) => {
                        receive_payload(fd, &mut st, h.addr as usize as *mut u8, len, &mut out)?;
                        drop(region);
                        out.push(Status::Ok, h.id, None);
                    }
                    Err(status) => {
                        // Consume the payload so the stream stays in step, then refuse.
                        let mut left = len;
                        while left > 0 {
                            let chunk = left.min(scratch.len());
                            receive_payload(fd, &mut st, scratch.as_mut_ptr(), chunk, &mut out)?;
                            left -= chunk;
                        }
                        out.push(status, h.id, None);
                    }
                }
            }
            RequestOp::Read => {
                last_was_read = true;
                match check(registry, &h) {
                    Ok(region) => out.push(
                        Status::Ok,
                        h.id,
                        Some((h.addr as usize, h.len as usize, region)),
                    ),
                    Err(status) => out.push(status, h.id, None),
                }
            }
        }
        if out.due() {
            out.flush(fd)?;
        }
    }
}

/// Receives `len` payload bytes into `dst`: first what is already staged, then straight from the
/// socket, picking up the next request header in the same `readv` when it has arrived. Answers
/// queued responses before waiting for bytes, so a slow payload never holds back the
/// acknowledgements of slices already in place.
fn receive_payload(
    fd: RawFd,
    st: &mut Staging,
    dst: *mut u8,
    len: usize,
    out: &mut Responses,
) -> Result<(), String> {
    let staged = st.available().min(len);
    // SAFETY: `dst..dst+len` was checked against a registered region (or is our scratch
    // buffer) and `staged <= len`.
    unsafe { std::ptr::copy_nonoverlapping(st.buf[st.start..].as_ptr(), dst, staged) };
    st.start += staged;
    let mut done = staged;
    if done == len {
        return Ok(());
    }
    // Staging is empty now.
    st.start = 0;
    st.end = 0;
    while done < len {
        let iov = [
            // SAFETY: `done < len`, so the pointer stays inside the destination range.
            iovec(unsafe { dst.add(done) }, len - done),
            iovec(st.buf.as_mut_ptr(), wire::REQUEST_LEN),
        ];
        let ready = if out.headers.is_empty() {
            None
        } else {
            sockio::readv_nonblocking(fd, &iov).map_err(|e| format!("reading payload: {e}"))?
        };
        let n = match ready {
            Some(n) => n,
            None => {
                out.flush(fd)?;
                sockio::readv_raw(fd, &iov).map_err(|e| format!("reading payload: {e}"))?
            }
        };
        if n == 0 {
            return Err("connection closed inside a payload".into());
        }
        if n <= len - done {
            done += n;
        } else {
            st.end = n - (len - done);
            done = len;
        }
    }
    Ok(())
}
