//! Target side of the `tcp` transport on one data connection, as a non-blocking state machine a
//! serving thread advances whenever the connection is ready: every slice is checked against the
//! buffer's key and bounds before a byte lands, WRITE payloads are received straight into
//! registered memory, READ payloads are sent straight from it. A connection waiting for bytes
//! holds no thread.
//!
//! Each connection counts what it serves in its own [`ServedTally`] (plain integers; one clock
//! read per socket read that brings request headers, per WRITE completed and per socket write
//! that completes READ answers) and folds it into the engine's shared counters before it
//! sends acknowledgements and after a write completes READ answers.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Instant;

use multirail_policy::qos::Priority;

use crate::memory::{MemoryRegistry, Region};
use crate::protocol::wire::{self, RequestHeader, RequestOp, ResponseHeader, Status};
use crate::stats::{ServedOp, ServedTally};
use crate::transport::cpu_priority::ThreadNice;
use crate::transport::sockio::{self, iovec};
use crate::transport::staging::Staging;

/// Responses gathered before one `writev`.
const RESPONSES_PER_WRITE: usize = 64;
/// Payload bytes queued in responses before they are written.
const RESPONSE_BYTES: usize = 8 << 20;
/// Bytes one turn may receive before the connection goes to the back of the ready list, so a
/// connection streaming bulk does not keep a serving thread from the others (a HIGH slice on
/// another connection waits at most this much copying).
const TURN_BYTES: usize = 4 << 20;
/// Staging for request headers (and, after READ requests or small WRITEs, several of them at
/// once).
const STAGING: usize = 64 * 1024;
/// WRITE payloads up to this many bytes are read through staging, with the frames behind them,
/// as many as the socket holds: copying a 4 KiB payload out of staging costs less than the
/// system call that would read it alone, and scattered small requests otherwise cost one
/// `readv` each. Larger payloads go straight from the socket to their destination.
const SMALL_PAYLOAD: usize = 16 * 1024;

/// What the connection waits for after a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Bytes to read.
    Read,
    /// Room in the socket for responses (nothing more is read until they are out, so a peer
    /// that does not read its answers stops being served instead of growing our memory).
    Write,
    /// Its turn ended with work left: serve it again after the others.
    Again,
}

/// Responses waiting to be written, in request order, and how far a partial write got. They
/// go out when the socket has nothing more to read (so an acknowledgement never waits for
/// bytes that are not coming), or once many are queued: a stream of slices is answered in
/// batches, one `writev` per many slices. A timer would add a clock read per slice and, at
/// 100 µs, one write per 128 KiB slice on loopback (12 times the writes for the same bytes).
struct Responses {
    headers: Vec<[u8; wire::RESPONSE_LEN]>,
    payloads: Vec<Option<(usize, usize)>>,
    /// Regions whose bytes READ responses send: kept registered until written.
    held: Vec<Arc<Region>>,
    /// The READs answered with bytes in this batch, counted as served once their answer is
    /// written.
    reads: Vec<ReadAnswer>,
    /// Of those, the ones counted already.
    reads_counted: usize,
    /// Bytes of this batch (headers and payloads) queued, and written so far.
    queued: u64,
    written: u64,
    bytes: usize,
    iov: Vec<libc::iovec>,
    /// A write is under way (`iov` is built and partly sent).
    writing: bool,
    /// A HIGH slice's answer is queued: it goes out before a request of lower priority is
    /// served, instead of waiting for the socket to run dry, which a connection streaming bulk
    /// behind it may not do for a whole turn (`TURN_BYTES`, a millisecond or more of copying).
    /// Behind more HIGH requests answers still go out together, as bulk's do.
    urgent: bool,
}

impl Responses {
    fn new() -> Self {
        Responses {
            headers: Vec::with_capacity(RESPONSES_PER_WRITE),
            payloads: Vec::with_capacity(RESPONSES_PER_WRITE),
            held: Vec::with_capacity(RESPONSES_PER_WRITE),
            reads: Vec::with_capacity(RESPONSES_PER_WRITE),
            reads_counted: 0,
            queued: 0,
            written: 0,
            bytes: 0,
            iov: Vec::with_capacity(RESPONSES_PER_WRITE * 2),
            urgent: false,
            writing: false,
        }
    }

    fn push(&mut self, status: Status, id: u64, payload: Option<(usize, usize, Arc<Region>)>) {
        self.push_timed(status, id, payload, None);
    }

    /// As `push`; `read` is the priority and frame time of a READ whose payload this sends.
    fn push_timed(
        &mut self,
        status: Status,
        id: u64,
        payload: Option<(usize, usize, Arc<Region>)>,
        read: Option<(Priority, Instant)>,
    ) {
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
        self.queued += wire::RESPONSE_LEN as u64;
        if let Some((_, len, region)) = payload {
            self.bytes += len;
            self.queued += len as u64;
            self.held.push(region);
            if let Some((priority, read_at)) = read {
                self.reads.push(ReadAnswer {
                    priority,
                    len: len as u32,
                    read_at,
                    end: self.queued,
                });
            }
        }
    }

    /// Counts the READs whose answers are now written in full, and folds them in.
    fn count_written_reads(&mut self, served: &mut ServedTally) {
        let pending = &self.reads[self.reads_counted..];
        let done = pending.iter().take_while(|r| r.end <= self.written).count();
        if done == 0 {
            return;
        }
        let now = Instant::now();
        for r in &pending[..done] {
            served.served(
                ServedOp::Read,
                r.priority,
                u64::from(r.len),
                now.saturating_duration_since(r.read_at),
            );
        }
        self.reads_counted += done;
        served.fold();
    }

    fn due(&self) -> bool {
        self.headers.len() >= RESPONSES_PER_WRITE || self.bytes >= RESPONSE_BYTES
    }

    /// Writes what is queued without blocking. `Ok(true)` when everything went out, `Ok(false)`
    /// when the socket is full (the rest goes out on the next call, before anything new).
    /// Folds `served` in before a batch starts out, so a peer that sees its WRITE acknowledged
    /// finds it counted, and counts each READ once its answer is out.
    fn flush(&mut self, fd: RawFd, served: &mut ServedTally) -> Result<bool, String> {
        if self.headers.is_empty() {
            served.fold();
            return Ok(true);
        }
        if !self.writing {
            served.fold();
            self.iov.clear();
            for (h, p) in self.headers.iter().zip(&self.payloads) {
                self.iov.push(iovec(h.as_ptr(), h.len()));
                if let Some((ptr, len)) = p {
                    self.iov.push(iovec(*ptr as *const u8, *len));
                }
            }
            self.writing = true;
        }
        loop {
            // Rebuilt from the start each time: `advance` trims the iovecs in place.
            let rest = sockio::advance(&mut self.iov, 0);
            if rest.is_empty() {
                break;
            }
            // Payloads point into regions held in `self.held` until the write completes;
            // headers live in `self.headers`, untouched while `writing`.
            match sockio::write_vectored_nonblocking(fd, rest) {
                Ok(Some(0)) | Ok(None) => return Ok(false),
                Ok(Some(n)) => {
                    let left = sockio::advance(&mut self.iov, n).len();
                    let drop_front = self.iov.len() - left;
                    self.iov.drain(..drop_front);
                    self.written += n as u64;
                    if self.reads_counted < self.reads.len() {
                        self.count_written_reads(served);
                    }
                }
                Err(e) => return Err(format!("sending responses: {e}")),
            }
        }
        self.reads.clear();
        self.reads_counted = 0;
        self.queued = 0;
        self.written = 0;
        self.headers.clear();
        self.payloads.clear();
        self.held.clear();
        self.bytes = 0;
        self.writing = false;
        self.urgent = false;
        Ok(true)
    }
}

/// A READ answered with bytes: counted as served once `end`, its last byte's place in the
/// batch, is written.
struct ReadAnswer {
    priority: Priority,
    len: u32,
    /// When its request frame was read.
    read_at: Instant,
    end: u64,
}

/// A WRITE payload being received.
struct Payload {
    /// Where its bytes go: checked registered memory, or `None` to drop them (a refused slice
    /// whose bytes must still be read to keep the stream in step).
    dst: Option<(*mut u8, Arc<Region>)>,
    len: usize,
    done: usize,
    id: u64,
    status: Status,
    priority: Priority,
    /// When its request frame was read.
    read_at: Instant,
    /// A probe's payload: dropped, answered `Ok`, counted as neither served nor refused.
    probe: bool,
}

/// The kind of the latest request on a connection, which says what probably follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LastRequest {
    /// A READ: more headers, and nothing else, may be read at once.
    Read,
    /// A WRITE of at most [`SMALL_PAYLOAD`] bytes: reads fill staging, payloads and all.
    SmallWrite,
    /// A larger WRITE: reads stop at the next header, so its payload goes straight to memory.
    LargeWrite,
}

/// One data connection's serving state.
pub(crate) struct DataConn {
    staging: Staging,
    /// Where refused payloads are read to be dropped; allocated on first use.
    scratch: Vec<u8>,
    out: Responses,
    /// What the latest request was: how much the next read of headers may take.
    last: LastRequest,
    payload: Option<Payload>,
    /// When the last socket read that brought request header bytes returned: the time the
    /// headers in staging were read.
    read_at: Instant,
    served: ServedTally,
    /// Whether the latest request header was HIGH (see [`DataConn::carries_high`]).
    high: bool,
}

// SAFETY: the raw destination pointer in `payload` points into a region kept alive by the Arc
// beside it; the state is only touched by the one thread serving the connection's turn.
unsafe impl Send for DataConn {}

impl DataConn {
    /// A connection whose first `early` bytes (read with the handshake) are already here,
    /// counting what it serves in `served`; with `nontemporal`, small WRITE payloads leave
    /// staging with streaming stores.
    pub(crate) fn new(early: &[u8], served: ServedTally, nontemporal: bool) -> DataConn {
        DataConn {
            staging: Staging::new(STAGING, early).streaming(nontemporal),
            scratch: Vec::new(),
            out: Responses::new(),
            last: LastRequest::LargeWrite,
            payload: None,
            read_at: Instant::now(),
            served,
            high: false,
        }
    }

    /// Whether the latest request this connection brought was HIGH: a client keeps a
    /// connection of each rail for HIGH slices alone, and the listener serves such a
    /// connection on a thread that serves nothing else.
    pub(crate) fn carries_high(&self) -> bool {
        self.high
    }

    /// Serves what the socket holds without blocking. Returns what to wait for next, or
    /// `Ok(None)` when the peer closed the connection between requests, or an error naming
    /// what was wrong (malformed frame, closed mid-frame, socket error): close it.
    pub(crate) fn turn(
        &mut self,
        fd: RawFd,
        registry: &MemoryRegistry,
        nice: &mut ThreadNice,
    ) -> Result<Option<Wait>, String> {
        let mut received = 0usize;
        loop {
            if self.out.writing && !self.out.flush(fd, &mut self.served)? {
                return Ok(Some(Wait::Write));
            }
            if received >= TURN_BYTES {
                // Answer what is done before stepping aside for the other connections.
                return if self.out.flush(fd, &mut self.served)? {
                    Ok(Some(Wait::Again))
                } else {
                    Ok(Some(Wait::Write))
                };
            }
            if self.payload.is_some() {
                match self.receive_payload(fd)? {
                    Some(n) => received += n,
                    None => return self.idle(fd),
                }
                continue;
            }
            if self.staging.available() < wire::REQUEST_LEN {
                match self.read_headers(fd)? {
                    Some(0) => {
                        self.out.flush(fd, &mut self.served).ok();
                        return if self.staging.available() == 0 {
                            Ok(None)
                        } else {
                            Err("connection closed inside a request header".into())
                        };
                    }
                    // Counted toward the turn: after small WRITEs payloads come this way.
                    Some(n) => {
                        received += n;
                        continue;
                    }
                    None => return self.idle(fd),
                }
            }
            let h = RequestHeader::decode(self.staging.peek(wire::REQUEST_LEN))?;
            self.high = h.priority == Priority::High;
            if self.out.urgent
                && h.priority != Priority::High
                && !self.out.flush(fd, &mut self.served)?
            {
                // The header stays staged; it is served once the answers are out.
                return Ok(Some(Wait::Write));
            }
            self.staging.consume(wire::REQUEST_LEN);
            nice.follow(h.priority);
            match h.op {
                RequestOp::Write => {
                    self.last = if h.len as usize <= SMALL_PAYLOAD {
                        LastRequest::SmallWrite
                    } else {
                        LastRequest::LargeWrite
                    };
                    let (dst, status) = match check(registry, &h) {
                        Ok(region) => (Some((h.addr as usize as *mut u8, region)), Status::Ok),
                        Err(status) => (None, status),
                    };
                    self.payload = Some(Payload {
                        dst,
                        len: h.len as usize,
                        done: 0,
                        id: h.id,
                        status,
                        priority: h.priority,
                        read_at: self.read_at,
                        probe: false,
                    });
                    self.take_staged_payload();
                }
                RequestOp::Probe => {
                    // Read through scratch and dropped: a probe touches no memory.
                    self.last = LastRequest::SmallWrite;
                    self.payload = Some(Payload {
                        dst: None,
                        len: h.len as usize,
                        done: 0,
                        id: h.id,
                        status: Status::Ok,
                        priority: h.priority,
                        read_at: self.read_at,
                        probe: true,
                    });
                    self.take_staged_payload();
                }
                RequestOp::Read => {
                    self.last = LastRequest::Read;
                    match check(registry, &h) {
                        Ok(region) => {
                            self.out.push_timed(
                                Status::Ok,
                                h.id,
                                Some((h.addr as usize, h.len as usize, region)),
                                Some((h.priority, self.read_at)),
                            );
                            self.out.urgent |= h.priority == Priority::High;
                        }
                        Err(status) => {
                            self.served.refused(ServedOp::Read);
                            self.out.push(status, h.id, None);
                        }
                    }
                }
            }
            if self.out.due() && !self.out.flush(fd, &mut self.served)? {
                return Ok(Some(Wait::Write));
            }
        }
    }

    /// Nothing more to read now: answer what is finished before waiting, so a slow payload or
    /// a quiet peer never holds back acknowledgements of slices already in place.
    fn idle(&mut self, fd: RawFd) -> Result<Option<Wait>, String> {
        if self.out.flush(fd, &mut self.served)? {
            Ok(Some(Wait::Read))
        } else {
            Ok(Some(Wait::Write))
        }
    }

    /// Reads request headers into staging: one header at a time after a large WRITE (its
    /// payload follows and should go straight to memory, not through here), several after a
    /// READ, whatever the socket holds after a small WRITE (see [`SMALL_PAYLOAD`]). `None` when
    /// nothing is waiting.
    fn read_headers(&mut self, fd: RawFd) -> Result<Option<usize>, String> {
        let st = &mut self.staging;
        st.compact();
        let want = match self.last {
            LastRequest::SmallWrite => st.tail().len(),
            LastRequest::Read => st.tail().len().min(16 * wire::REQUEST_LEN),
            LastRequest::LargeWrite => wire::REQUEST_LEN - st.available(),
        };
        match sockio::recv_nonblocking(fd, &mut st.tail()[..want]) {
            Ok(Some(n)) => {
                st.filled(n);
                if n > 0 {
                    self.read_at = Instant::now();
                }
                Ok(Some(n))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(format!("reading request: {e}")),
        }
    }

    /// Moves payload bytes that arrived with the header out of staging.
    fn take_staged_payload(&mut self) {
        let p = self.payload.as_mut().expect("payload under way");
        let n = self.staging.available().min(p.len - p.done);
        if n == 0 {
            return;
        }
        match &p.dst {
            // SAFETY: `dst..dst+len` was checked against a registered region that the Arc
            // beside it keeps alive, `done + n <= len`, and registered memory is not staging.
            Some((dst, _)) => unsafe {
                self.staging.take_into(dst.add(p.done), n);
            },
            None => self.staging.consume(n),
        }
        p.done += n;
        if p.done == p.len {
            self.finish_payload(Instant::now());
        }
    }

    /// Acknowledges the payload under way, whose last byte arrived at `now`.
    fn finish_payload(&mut self, now: Instant) {
        let p = self.payload.take().expect("payload under way");
        if p.probe {
            // Neither served nor refused: nobody's bytes.
        } else if p.dst.is_some() {
            self.served.served(
                ServedOp::Write,
                p.priority,
                p.len as u64,
                now.saturating_duration_since(p.read_at),
            );
        } else {
            self.served.refused(ServedOp::Write);
        }
        self.out.push(p.status, p.id, None);
        if p.priority == Priority::High {
            self.out.urgent = true;
        }
    }

    /// Receives payload bytes straight into their destination, picking up the next request
    /// header in the same `readv` when it has arrived (after a small payload, whatever
    /// follows, up to staging's size). Returns the bytes taken, `None` when nothing is
    /// waiting.
    fn receive_payload(&mut self, fd: RawFd) -> Result<Option<usize>, String> {
        let p = self.payload.as_mut().expect("payload under way");
        // Staging is empty here: whatever it held went to the payload first.
        debug_assert_eq!(self.staging.available(), 0);
        self.staging.clear();
        let left = p.len - p.done;
        let dst = match &p.dst {
            // SAFETY: `done < len`, so the pointer stays inside the checked destination.
            Some((dst, _)) => unsafe { dst.add(p.done) },
            None => {
                if self.scratch.is_empty() {
                    self.scratch = vec![0u8; STAGING];
                }
                self.scratch.as_mut_ptr()
            }
        };
        let chunk = if p.dst.is_some() {
            left
        } else {
            left.min(self.scratch.len())
        };
        // Bytes past `chunk` are the next frame's only once the payload ends in this read: a
        // refused payload longer than the scratch buffer takes several.
        let behind = if chunk < left {
            0
        } else if p.len <= SMALL_PAYLOAD {
            self.staging.tail().len()
        } else {
            wire::REQUEST_LEN
        };
        let iov = [
            iovec(dst, chunk),
            iovec(self.staging.tail().as_mut_ptr(), behind),
        ];
        let n = match sockio::readv_nonblocking(fd, &iov)
            .map_err(|e| format!("reading payload: {e}"))?
        {
            None => return Ok(None),
            Some(0) => return Err("connection closed inside a payload".into()),
            Some(n) => n,
        };
        let header_bytes = n.saturating_sub(chunk);
        p.done += n - header_bytes;
        let finished = p.done == p.len;
        if header_bytes > 0 || finished {
            // One clock read for both: the payload's end and the next header's arrival.
            let now = Instant::now();
            if header_bytes > 0 {
                self.staging.filled(header_bytes);
                self.read_at = now;
            }
            if finished {
                self.finish_payload(now);
            }
        }
        Ok(Some(n))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Location;
    use crate::stats::ServedStats;
    use crate::transport::cpu_priority::NiceTable;
    use std::io::{Read, Write};
    use std::net::{IpAddr, Ipv4Addr};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    const PAYLOAD: usize = 4096;

    fn write_request(id: u64, addr: u64, key: u64, priority: Priority, fill: u8) -> Vec<u8> {
        write_of(PAYLOAD, id, addr, key, priority, fill)
    }

    fn write_of(len: usize, id: u64, addr: u64, key: u64, priority: Priority, fill: u8) -> Vec<u8> {
        let mut h = [0u8; wire::REQUEST_LEN];
        RequestHeader {
            op: RequestOp::Write,
            len: len as u32,
            id,
            addr,
            key,
            priority,
        }
        .encode(&mut h);
        let mut out = h.to_vec();
        out.extend(std::iter::repeat_n(fill, len));
        out
    }

    /// Sends `requests` from another thread and serves them until `answers` responses came
    /// back (failing after 30 s); returns them in the order they came.
    fn serve_all(
        registry: &MemoryRegistry,
        requests: Vec<u8>,
        answers: usize,
    ) -> Vec<ResponseHeader> {
        let (initiator, target) = UnixStream::pair().unwrap();
        target.set_nonblocking(true).unwrap();
        let mut writer = initiator.try_clone().unwrap();
        let sender = std::thread::spawn(move || writer.write_all(&requests).unwrap());
        let stats = Arc::new(ServedStats::default());
        let local = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let mut conn = DataConn::new(&[], stats.tally(local, local, || "lo".into()), true);
        let mut nice = ThreadNice::for_this_thread(NiceTable::new(0));
        let fd = target.as_raw_fd();
        let reader = std::thread::spawn(move || {
            let mut raw = vec![0u8; answers * wire::RESPONSE_LEN];
            (&initiator).read_exact(&mut raw).unwrap();
            raw.chunks(wire::RESPONSE_LEN)
                .map(|r| ResponseHeader::decode(r).unwrap())
                .collect::<Vec<_>>()
        });
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        while !reader.is_finished() {
            assert!(Instant::now() < deadline, "not every request was answered");
            conn.turn(fd, registry, &mut nice).unwrap();
            std::thread::yield_now();
        }
        sender.join().unwrap();
        reader.join().unwrap()
    }

    /// Small WRITEs queued behind one another are read through staging, several per system
    /// call: each lands where its own header says, and each is answered, in order.
    #[test]
    fn scattered_small_writes_behind_one_another_each_land_and_are_answered() {
        let registry = MemoryRegistry::default();
        let n = 64;
        let buf = registry.allocate(2 * n * PAYLOAD, Location::Any).unwrap();
        let mut requests = Vec::new();
        // Every other block, from the last to the first: nothing adjacent, nothing in order.
        for i in 0..n {
            let block = 2 * (n - 1 - i);
            let at = buf.addr() + (block * PAYLOAD) as u64;
            requests.extend(write_request(
                i as u64,
                at,
                buf.key(),
                Priority::Low,
                i as u8 + 1,
            ));
        }
        // And one large write behind them, which goes straight to memory.
        let large = SMALL_PAYLOAD * 2;
        let big = registry.allocate(large, Location::Any).unwrap();
        requests.extend(write_of(
            large,
            n as u64,
            big.addr(),
            big.key(),
            Priority::Low,
            0xEE,
        ));
        let answers = serve_all(&registry, requests, n + 1);
        for (i, a) in answers.iter().enumerate() {
            assert_eq!((a.id, a.status), (i as u64, Status::Ok));
        }
        // SAFETY: the turns that wrote these buffers have returned.
        let (s, b) = unsafe { (buf.as_slice().to_vec(), big.as_slice().to_vec()) };
        for i in 0..n {
            let block = 2 * (n - 1 - i);
            let landed = &s[block * PAYLOAD..(block + 1) * PAYLOAD];
            assert!(landed.iter().all(|&x| x == i as u8 + 1), "write {i} landed");
            let gap = &s[(block + 1) * PAYLOAD..(block + 2) * PAYLOAD];
            assert!(
                gap.iter().all(|&x| x == 0),
                "nothing landed beside write {i}"
            );
        }
        assert!(b.iter().all(|&x| x == 0xEE), "the large write landed");
    }

    /// A probe's payload lands nowhere: it is read, dropped and answered `Ok` in its turn,
    /// whatever its address says (here a registered buffer's), and the WRITE behind it lands.
    #[test]
    fn a_probe_is_answered_and_touches_no_memory() {
        let registry = MemoryRegistry::default();
        let buf = registry.allocate(2 * PAYLOAD, Location::Any).unwrap();
        let mut requests = write_of(PAYLOAD, 1, buf.addr(), buf.key(), Priority::Low, 0x33);
        // Rewritten as a probe aimed at the same buffer.
        requests[0] = RequestOp::Probe as u8;
        requests.extend(write_request(
            2,
            buf.addr() + 64,
            buf.key(),
            Priority::Low,
            0x44,
        ));
        // SAFETY: nothing serves this buffer yet.
        let before = unsafe { buf.as_slice().to_vec() };
        assert!(before.iter().all(|&x| x == 0));
        let answers = serve_all(&registry, requests, 2);
        assert_eq!((answers[0].id, answers[0].status), (1, Status::Ok));
        assert_eq!((answers[1].id, answers[1].status), (2, Status::Ok));
        // SAFETY: the turns that wrote this buffer have returned.
        let after = unsafe { buf.as_slice().to_vec() };
        assert!(
            after[..64].iter().all(|&x| x == 0),
            "the probe wrote nothing"
        );
        assert!(
            after[64..64 + PAYLOAD].iter().all(|&x| x == 0x44),
            "the write behind it landed"
        );
        assert!(after[64 + PAYLOAD..].iter().all(|&x| x == 0));
    }

    /// A refused WRITE whose payload is longer than the scratch buffer it is read into is read
    /// in several pieces, none of it taken for the next request's header: the request behind
    /// it is served as sent.
    #[test]
    fn a_long_refused_payload_keeps_the_stream_in_step() {
        let registry = MemoryRegistry::default();
        let buf = registry.allocate(PAYLOAD, Location::Any).unwrap();
        let long = 3 * STAGING + 100;
        let mut requests = write_of(long, 1, buf.addr(), buf.key() ^ 1, Priority::Low, 0x11);
        requests.extend(write_request(2, buf.addr(), buf.key(), Priority::Low, 0x22));
        let answers = serve_all(&registry, requests, 2);
        assert_eq!((answers[0].id, answers[0].status), (1, Status::BadKey));
        assert_eq!((answers[1].id, answers[1].status), (2, Status::Ok));
        // SAFETY: the turns that wrote this buffer have returned.
        let s = unsafe { buf.as_slice().to_vec() };
        assert!(
            s.iter().all(|&x| x == 0x22),
            "the write behind the refused one landed"
        );
    }

    /// A HIGH write's answer goes out before the lower-priority request behind it is served:
    /// while the answer cannot be written (the initiator is not reading), the LOW request's
    /// bytes stay in the socket, and they land once the answer is out.
    #[test]
    fn a_high_answer_goes_out_before_the_low_request_behind_it_is_served() {
        let registry = MemoryRegistry::default();
        let buf = registry.allocate(4 * PAYLOAD, Location::Any).unwrap();
        let (mut initiator, target) = UnixStream::pair().unwrap();
        target.set_nonblocking(true).unwrap();
        // Fill the target's direction so that no answer can be written for now.
        let mut filled = 0usize;
        loop {
            match (&target).write(&[0u8; 4096]) {
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling: {e}"),
            }
        }
        let (high_at, low_at) = (buf.addr(), buf.addr() + 2 * PAYLOAD as u64);
        let mut requests = write_request(1, high_at, buf.key(), Priority::High, 0xA1);
        requests.extend(write_request(2, low_at, buf.key(), Priority::Low, 0xB2));
        initiator.write_all(&requests).unwrap();

        let stats = Arc::new(ServedStats::default());
        let local = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let mut conn = DataConn::new(&[], stats.tally(local, local, || "lo".into()), true);
        let mut nice = ThreadNice::for_this_thread(NiceTable::new(0));
        let fd = target.as_raw_fd();
        let wait = conn.turn(fd, &registry, &mut nice).unwrap();
        assert_eq!(wait, Some(Wait::Write), "waits to write the HIGH answer");
        // SAFETY: nothing else writes this buffer; the turn above returned.
        let (high, low) = unsafe {
            let s = buf.as_slice();
            (s[..PAYLOAD].to_vec(), s[2 * PAYLOAD..3 * PAYLOAD].to_vec())
        };
        assert!(high.iter().all(|&b| b == 0xA1), "the HIGH write landed");
        assert!(
            low.iter().all(|&b| b == 0),
            "the LOW write was served before the HIGH answer went out"
        );

        // The initiator reads: the filler, then the answers, HIGH's first.
        let mut sink = vec![0u8; filled];
        initiator.read_exact(&mut sink).unwrap();
        let wait = conn.turn(fd, &registry, &mut nice).unwrap();
        assert_eq!(wait, Some(Wait::Read), "everything served");
        // SAFETY: as above.
        let low = unsafe { buf.as_slice()[2 * PAYLOAD..3 * PAYLOAD].to_vec() };
        assert!(low.iter().all(|&b| b == 0xB2), "the LOW write landed");
        let mut answers = [0u8; 2 * wire::RESPONSE_LEN];
        initiator.read_exact(&mut answers).unwrap();
        let first = ResponseHeader::decode(&answers[..wire::RESPONSE_LEN]).unwrap();
        let second = ResponseHeader::decode(&answers[wire::RESPONSE_LEN..]).unwrap();
        assert_eq!((first.id, first.status), (1, Status::Ok));
        assert_eq!((second.id, second.status), (2, Status::Ok));
    }
}
