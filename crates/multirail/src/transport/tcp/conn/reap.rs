//! The answers of one initiator-side connection, taken off the socket in order: READ payloads
//! go straight into registered memory, and each answer finishes its slice.
//!
//! The connection's reader thread takes them. A small HIGH slice on an idle connection is
//! written by the submitting thread itself ([`Conn::send_now`]), and the thread then waiting
//! for that slice's batch may take its answer too ([`AnswerSource`]): while nothing is in
//! flight, or such a slice is, the reader thread waits for the socket to become readable
//! without holding the staging buffer, and reads only what is there, so a waiter holding the
//! buffer takes the answer as it lands. Beside bulk, where every wake-up waits for a core, the
//! waiter no longer waits for the reader thread to run and then for its own wake-up in turn.
//! Behind slices the sender thread wrote, the reader thread blocks in the read itself.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use multirail_policy::qos::Priority;

use super::{Conn, Inflight, SMALL_READ};
use crate::batch::{AnswerSource, Task};
use crate::error::{Error, Result};
use crate::spin::YIELD_AFTER;
use crate::transport::cpu_priority::ThreadNice;
use crate::transport::sockio;
use crate::transport::staging::Staging;
use crate::transport::wire::{self, ResponseHeader};
use crate::transport::Opcode;

/// Longest a waiting thread waits for the socket before it looks at its task and the
/// connection again (a connection that dies wakes it at once, as its socket is shut down).
const WAITER_POLL: Duration = Duration::from_millis(10);
/// Most slices a waiter looks through to see whether its own is in flight here.
const WAITER_SCAN: usize = 64;

/// What the taker of answers keeps between answers: bytes read ahead of the next answer.
pub(super) struct Reaping {
    staging: Staging,
    /// The latest READ answer was small: more like it probably follow, so reads do not stop
    /// at a header.
    small_reads: bool,
    /// When the bytes being taken arrived: answers that arrive in one read share one arrival
    /// time, so the selector sees them delivered together rather than as a burst of impossibly
    /// short intervals.
    arrived: Instant,
    /// The latest read took less than it was offered: the socket was empty after it.
    drained: bool,
}

impl Reaping {
    pub(super) fn new(nontemporal: bool) -> Reaping {
        Reaping {
            staging: Staging::new(64 * 1024, &[]).streaming(nontemporal),
            small_reads: false,
            arrived: Instant::now(),
            drained: false,
        }
    }
}

/// The reader thread: takes answers until the connection fails, then kills it.
pub(super) fn reader_loop(conn: &Arc<Conn>) {
    if let Err(err) = read_answers(conn) {
        conn.kill(err);
    }
}

fn read_answers(conn: &Conn) -> Result<()> {
    let mut nice = ThreadNice::for_this_thread(conn.settings.nice);
    loop {
        nice.follow(
            Priority::from_u8(conn.carrying.load(Ordering::Relaxed)).unwrap_or(Priority::High),
        );
        let mut r = conn.reaping.lock().expect("conn poisoned");
        if r.staging.available() < wire::RESPONSE_LEN && conn.leaves_socket_free() {
            while take_ready(conn, &mut r)? {}
            drop(r);
            wait_readable(conn.fd, None).map_err(|e| conn.io_failure("", &e))?;
            continue;
        }
        // Answers to slices the sender thread wrote are due: nobody else waits for them on
        // the socket, so block in the read itself.
        let reads = conn.reads_outstanding.load(Ordering::Acquire) > 0;
        let must_read = r.staging.available() < wire::RESPONSE_LEN;
        let exact = reads && !r.small_reads;
        r.staging
            .fill_to(conn.fd, wire::RESPONSE_LEN, exact, "between answers")
            .map_err(|e| read_failure(conn, &e))?;
        if must_read {
            r.arrived = Instant::now();
        }
        take_staged(conn, &mut r)?;
    }
}

/// Takes the next answer if its header is staged or the socket holds it now. Returns false
/// when the socket has nothing more for now.
fn take_ready(conn: &Conn, r: &mut Reaping) -> Result<bool> {
    if r.staging.available() < wire::RESPONSE_LEN {
        if std::mem::take(&mut r.drained) {
            return Ok(false);
        }
        // While READs are outstanding a read stops at the header, so a large payload behind
        // it goes straight to its destination, unless the latest READ answer was small.
        let exact = conn.reads_outstanding.load(Ordering::Acquire) > 0 && !r.small_reads;
        let want = if exact {
            wire::RESPONSE_LEN - r.staging.available()
        } else {
            r.staging.room()
        };
        match r.staging.read_nonblocking(conn.fd, want) {
            Ok(None) => return Ok(false),
            // A read that did not fill what it was offered emptied the socket: the next look
            // waits for it rather than find it empty with one more system call.
            Ok(Some(n)) if n > 0 && !exact && n < want => {
                r.drained = true;
                r.arrived = Instant::now();
            }
            Ok(Some(0)) => {
                let eof = std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed by peer between answers",
                );
                return Err(read_failure(conn, &eof));
            }
            Ok(Some(_)) => r.arrived = Instant::now(),
            Err(e) => return Err(read_failure(conn, &e)),
        }
        if r.staging.available() < wire::RESPONSE_LEN {
            return Ok(true);
        }
    }
    take_staged(conn, r)?;
    Ok(true)
}

/// What a failed read means: an end of stream or a reset where an answer was due to begin
/// tells the owner the peer closed (unless this end killed the connection, which ends its
/// stream too).
fn read_failure(conn: &Conn, e: &std::io::Error) -> Error {
    if !conn.is_dead()
        && matches!(
            e.kind(),
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
        )
    {
        if let Some(owner) = conn.owner.upgrade() {
            owner.closed_by_peer();
        }
    }
    conn.io_failure("", e)
}

/// Takes the answer whose header is staged: reads its payload (a READ's) into place and
/// finishes its slice.
fn take_staged(conn: &Conn, r: &mut Reaping) -> Result<()> {
    let peer = || conn.peer.clone();
    let raw: [u8; wire::RESPONSE_LEN] = r
        .staging
        .peek(wire::RESPONSE_LEN)
        .try_into()
        .expect("length checked");
    r.staging.consume(wire::RESPONSE_LEN);
    let header = ResponseHeader::decode(&raw).map_err(|reason| Error::Protocol {
        peer: peer(),
        reason,
    })?;
    let inflight = {
        let mut st = conn.state.lock().expect("conn poisoned");
        match st.queue.front() {
            Some(f) if f.seq == header.id => st.queue.pop_front().expect("front exists"),
            Some(f) => {
                return Err(Error::Protocol {
                    peer: peer(),
                    reason: format!("response for slice {} while {} is oldest", header.id, f.seq),
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
    // A failure below leaves the slice unanswered: put it back so `kill` hands it back.
    let requeue = |inflight: Inflight, err: Error| {
        conn.state
            .lock()
            .expect("conn poisoned")
            .queue
            .push_front(inflight);
        err
    };
    let slice = &inflight.slice;
    let ok = match header.status {
        wire::Status::Ok if slice.op == Opcode::Read => {
            if header.len != slice.len {
                let reason = format!("read returned {} bytes, asked {}", header.len, slice.len);
                return Err(requeue(
                    inflight,
                    Error::Protocol {
                        peer: peer(),
                        reason,
                    },
                ));
            }
            let dst = slice.local as *mut u8;
            let len = slice.len as usize;
            r.small_reads = len <= SMALL_READ;
            if r.small_reads && r.staging.available() < len {
                // Through staging (it holds 64 KiB), with whatever answers follow.
                if let Err(e) = r
                    .staging
                    .fill_to(conn.fd, len, false, "inside a read answer")
                {
                    return Err(requeue(inflight, conn.io_failure("", &e)));
                }
                r.arrived = Instant::now();
            }
            // SAFETY: `dst..dst+len` is this READ slice's destination in registered memory,
            // which the submitter keeps registered until the slice completes, and which
            // nothing else writes meanwhile; it is not the staging buffer.
            let staged = unsafe { r.staging.take_into(dst, len) };
            // SAFETY: as above; `staged <= len`.
            if let Err(e) =
                sockio::read_exact_raw(conn.fd, unsafe { dst.add(staged) }, len - staged)
            {
                return Err(requeue(inflight, conn.io_failure("", &e)));
            }
            if staged < len {
                r.arrived = Instant::now();
            }
            true
        }
        wire::Status::Ok => true,
        _ => false,
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
    if let Some(owner) = conn.owner.upgrade() {
        owner.answered(slice.id, inflight.posted, r.arrived, ok);
    }
    let Inflight { slice, .. } = inflight;
    if ok {
        conn.counters.record_at(slice.priority, slice.len as u64, 1);
        slice.task.part_done(Ok(()));
    } else {
        conn.counters.record_error();
        slice.task.part_done(Err(Error::RemoteRejected {
            peer: peer(),
            reason: header.status.reason().to_owned(),
        }));
    }
    Ok(())
}

/// Waits until `fd` has bytes to read, has failed or was closed, or `timeout` passes (never
/// with `None`). Returns whether it is readable (or failed: the read says how).
fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> std::io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.map_or(-1, |t| t.as_millis().clamp(1, i32::MAX as u128) as i32);
    // SAFETY: `pfd` is one live pollfd, the count passed; poll only writes its `revents`.
    let n = sockio::retry_eintr(|| unsafe { libc::poll(&mut pfd, 1, ms) } as isize)?;
    Ok(n > 0)
}

impl Conn {
    /// Whether the reader thread waits for the socket without holding the staging buffer:
    /// while nothing is in flight (the next slice may be written directly) and while a slice
    /// written directly is (its waiter may take the answer). A direct write happens only with
    /// nothing in flight, so the reader never blocks in a read a waiter would need.
    fn leaves_socket_free(&self) -> bool {
        let st = self.state.lock().expect("conn poisoned");
        st.queue.front().is_none_or(|f| f.direct)
    }

    /// Whether a slice of `task` is in flight here (among the first [`WAITER_SCAN`]).
    fn carries(&self, task: &Task) -> bool {
        let st = self.state.lock().expect("conn poisoned");
        st.queue
            .iter()
            .take(WAITER_SCAN)
            .any(|i| std::ptr::eq(Arc::as_ptr(&i.slice.task), task))
    }
}

impl AnswerSource for Conn {
    fn read_until_finished(&self, task: &Task, until: Option<Instant>, poll: bool) -> bool {
        // Held by the reader thread: it is taking answers now, ours perhaps among them.
        let Ok(mut r) = self.reaping.try_lock() else {
            return false;
        };
        // From here on only this thread takes answers off the socket (the reader thread waits
        // for the staging buffer), so an answer cannot be taken between a look at the task and
        // the wait for the socket.
        let mut looks = 0u32;
        let yield_from = Instant::now() + YIELD_AFTER;
        loop {
            if task.is_finished() {
                return true;
            }
            if self.is_dead() || !self.carries(task) {
                return false;
            }
            match take_ready(self, &mut r) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    drop(r);
                    self.kill(e);
                    return task.is_finished();
                }
            }
            if poll {
                looks = looks.wrapping_add(1);
                // Reading the clock every look would cost more than the look.
                if looks.is_multiple_of(16) {
                    let now = Instant::now();
                    if until.is_some_and(|u| now >= u) {
                        return false;
                    }
                    if now >= yield_from {
                        // As a polling batch wait does: whatever else is runnable on this
                        // core (the target's thread, another process's bulk) gets it.
                        std::thread::yield_now();
                    }
                }
                std::hint::spin_loop();
                continue;
            }
            let wait = match until {
                Some(u) => u.saturating_duration_since(Instant::now()).min(WAITER_POLL),
                None => WAITER_POLL,
            };
            if wait.is_zero() || wait_readable(self.fd, Some(wait)).is_err() {
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;
    use std::sync::{Mutex, Weak};

    use multirail_policy::dispatch::SliceId;

    use super::super::{ConnOwner, ConnTarget, Outgoing, TcpSettings};
    use super::*;
    use crate::batch::Batch;
    use crate::segment::Location;
    use crate::stats::TrafficStats;
    use crate::transport::cpu_priority::NiceTable;
    use crate::transport::handshake::{self, Membership, Outcome, ServerHandshake};
    use crate::transport::wire::{RequestHeader, RequestOp, Status};

    const LEN: usize = 4096;

    /// What the connection told its owner.
    #[derive(Default)]
    struct Owner {
        answered: Mutex<Vec<SliceId>>,
        returned: Mutex<usize>,
    }

    impl ConnOwner for Owner {
        fn answered(&self, id: SliceId, _posted: Instant, _now: Instant, _ok: bool) {
            self.answered.lock().unwrap().push(id);
        }
        fn connection_lost(&self, _rail: usize, _err: &Error) {}
        fn closed_by_peer(&self) {}
        fn slices_returned(&self, _rail: usize, slices: Vec<Outgoing>, err: Error) {
            *self.returned.lock().unwrap() += slices.len();
            for s in slices {
                s.task.part_done(Err(err.clone()));
            }
        }
    }

    /// A target that takes the handshake, reports each request it reads, and answers one
    /// only when told (a READ with `LEN` bytes of `fill`); told `None`, it closes.
    fn target(
        listener: TcpListener,
        requests: mpsc::Sender<RequestHeader>,
        answers: mpsc::Receiver<Option<u8>>,
    ) {
        let (mut s, _) = listener.accept().unwrap();
        let mut hs = ServerHandshake::new(Membership::open(), handshake::nonce());
        loop {
            let mut buf = vec![0u8; hs.wants()];
            s.read_exact(&mut buf).unwrap();
            let mut out = Vec::new();
            let (_, outcome) = hs.on_bytes(&buf, &mut out).unwrap();
            s.write_all(&out).unwrap();
            if let Some(o) = outcome {
                assert!(matches!(o, Outcome::Accepted(_)));
                break;
            }
        }
        loop {
            let mut raw = [0u8; wire::REQUEST_LEN];
            if s.read_exact(&mut raw).is_err() {
                return;
            }
            let h = RequestHeader::decode(&raw).unwrap();
            if h.op == RequestOp::Write {
                let mut payload = vec![0u8; h.len as usize];
                s.read_exact(&mut payload).unwrap();
            }
            requests.send(h).unwrap();
            let Ok(Some(fill)) = answers.recv() else {
                return;
            };
            let len = if h.op == RequestOp::Read { h.len } else { 0 };
            let mut a = [0u8; wire::RESPONSE_LEN];
            ResponseHeader {
                status: Status::Ok,
                len,
                id: h.id,
            }
            .encode(&mut a);
            s.write_all(&a).unwrap();
            s.write_all(&vec![fill; len as usize]).unwrap();
        }
    }

    fn settings() -> TcpSettings {
        TcpSettings {
            connections_per_rail: 1,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            max_inflight_bytes: 1 << 20,
            max_retries: 0,
            nice: NiceTable::new(0),
            membership: Membership::open(),
            keepalive: Duration::from_secs(60),
            slice_time: Duration::ZERO,
            dispatch: Default::default(),
            nontemporal_copies: false,
        }
    }

    /// A HIGH slice of `op` between `local` and the target's address 0, for a batch of its own.
    fn slice(op: Opcode, local: &mut [u8], seq: u64) -> (Batch, Outgoing) {
        let batch = Batch::new(seq, 1);
        let task = batch.add_tasks(1).unwrap().remove(0);
        let out = Outgoing {
            op,
            local: local.as_mut_ptr() as usize,
            remote: 0,
            len: local.len() as u32,
            key: 1,
            task,
            id: SliceId { path: 0, seq },
            location: Location::Any,
            priority: Priority::High,
            last_error: None,
            probe: false,
        };
        (batch, out)
    }

    struct Rig {
        conn: Arc<Conn>,
        owner: Arc<Owner>,
        requests: mpsc::Receiver<RequestHeader>,
        answers: mpsc::Sender<Option<u8>>,
    }

    fn rig() -> Rig {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let remote = listener.local_addr().unwrap();
        let (req_tx, requests) = mpsc::channel();
        let (answers, ans_rx) = mpsc::channel();
        std::thread::spawn(move || target(listener, req_tx, ans_rx));
        let owner = Arc::new(Owner::default());
        let weak: Weak<dyn ConnOwner> = Arc::downgrade(&owner) as Weak<Owner>;
        let conn = Conn::open(
            &ConnTarget {
                peer: "target",
                remote,
                bind: None,
                rail: 0,
            },
            &settings(),
            TrafficStats::default().rail("lo"),
            weak,
        )
        .unwrap();
        Rig {
            conn,
            owner,
            requests,
            answers,
        }
    }

    const SECOND: Duration = Duration::from_secs(1);

    /// Writes a slice of `op` directly and waits until the target has read its request (it
    /// answers only when told). Returns its batch, its task and where its answer will arrive.
    fn direct(
        rig: &Rig,
        op: Opcode,
        buf: &mut [u8],
        seq: u64,
    ) -> (Batch, Arc<Task>, Arc<dyn AnswerSource>) {
        let (batch, s) = slice(op, buf, seq);
        assert!(rig.conn.send_now(s).is_ok());
        rig.requests.recv_timeout(SECOND).unwrap();
        let (task, source) = batch
            .direct_answer()
            .expect("the slice was written directly");
        (batch, task, source)
    }

    /// A thread waiting for `task` on `source` until it finished. The reader thread may still
    /// hold the staging buffer for a moment after an earlier answer, and a waiter then leaves
    /// the answer to it, so the thread tries until it holds the buffer. Returns a flag to set
    /// just before the target answers (or closes), and the thread, which returns whether the
    /// call that saw the task finish began before that.
    fn waiter(
        task: Arc<Task>,
        source: Arc<dyn AnswerSource>,
    ) -> (Arc<AtomicBool>, std::thread::JoinHandle<bool>) {
        let answered = Arc::new(AtomicBool::new(false));
        let flag = answered.clone();
        let thread = std::thread::spawn(move || loop {
            let before_answer = !flag.load(Ordering::SeqCst);
            let deadline = Instant::now() + 10 * SECOND;
            if source.read_until_finished(&task, Some(deadline), false) {
                return before_answer;
            }
            assert!(!task.is_finished(), "the reader thread took the answer");
            std::thread::sleep(Duration::from_millis(1));
        });
        (answered, thread)
    }

    /// A direct slice nobody waits for on the socket: the reader thread takes its answer.
    fn unwaited_direct_write(rig: &Rig, buf: &mut [u8], seq: u64) {
        let (batch, _, _) = direct(rig, Opcode::Write, buf, seq);
        rig.answers.send(Some(0)).unwrap();
        batch.wait(Some(10 * SECOND), Duration::ZERO).unwrap();
    }

    #[test]
    fn a_waiter_takes_the_answer_to_its_direct_slice_itself_and_the_reader_thread_the_rest() {
        let rig = rig();
        let mut buf = vec![0u8; LEN];
        unwaited_direct_write(&rig, &mut buf, 1);
        // A READ, answered only once its waiter waits on the socket.
        let (batch, task, source) = direct(&rig, Opcode::Read, &mut buf, 2);
        let (sent, waiter) = waiter(task, source);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(batch.unfinished(), 1, "nothing answered it yet");
        sent.store(true, Ordering::SeqCst);
        rig.answers.send(Some(0x5a)).unwrap();
        // It began reading before the answer existed and held the staging buffer until its
        // task finished, so it took the answer itself.
        assert!(waiter.join().unwrap(), "the waiter took its answer itself");
        assert_eq!(batch.unfinished(), 0);
        assert!(buf.iter().all(|&b| b == 0x5a), "the READ's bytes landed");
        assert_eq!(
            rig.owner.answered.lock().unwrap().last(),
            Some(&SliceId { path: 0, seq: 2 })
        );
        // With no waiter, the reader thread takes the next answer.
        unwaited_direct_write(&rig, &mut buf, 3);
        assert_eq!(rig.owner.answered.lock().unwrap().len(), 3);
    }

    #[test]
    fn a_waiter_whose_connection_closes_returns_and_its_slice_is_handed_back() {
        let rig = rig();
        let mut buf = vec![0u8; LEN];
        unwaited_direct_write(&rig, &mut buf, 1);
        let (batch, task, source) = direct(&rig, Opcode::Write, &mut buf, 2);
        let (sent, waiter) = waiter(task, source);
        std::thread::sleep(Duration::from_millis(100));
        // The target closes instead of answering.
        sent.store(true, Ordering::SeqCst);
        let closed = Instant::now();
        rig.answers.send(None).unwrap();
        // Handed back to an owner that cannot retry it, the slice failed its task, which the
        // waiter, reading since before the close, saw end.
        assert!(
            waiter.join().unwrap(),
            "the waiter was reading when it closed"
        );
        let waited = closed.elapsed();
        assert!(
            waited < 5 * SECOND,
            "the close woke the waiter ({waited:?})"
        );
        assert!(rig.conn.is_dead());
        assert_eq!(
            *rig.owner.returned.lock().unwrap(),
            1,
            "its slice went back"
        );
        assert!(matches!(
            batch.wait(Some(SECOND), Duration::ZERO),
            Err(Error::PeerDisconnected { .. })
        ));
    }
}
