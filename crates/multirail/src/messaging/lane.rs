//! The two halves every lane kind implements: [`SendLane`] on the sender's connection and
//! [`RecvLane`] on the receiver's. What all kinds share stays generic: the stream of the
//! opening, credits and waiting for them, lane switches and fences, holding a later lane back
//! until the earlier ones ended (`outbound`, `inbound`). A lane kind (`lanes::*`) only moves
//! bytes and credits its own way.
//!
//! Both are trait objects: a send costs one virtual call per message and a receive poll one per
//! connection polled, each covering a whole frame or every frame that arrived; the per-byte
//! work stays inside the lane, statically dispatched.

use std::any::Any;

use super::*;

/// What a sender's connection holds whatever its lane kind.
pub(super) struct Link {
    /// Segment name of the receiver, for errors.
    pub(super) peer: String,
    /// The stream the connection was opened on: the lane's bytes on tcp, else only how the
    /// receiver answers lane requests and how either side notices the other leaving.
    pub(super) stream: TcpStream,
    /// Credits in hand (on the shared shm ring none: its free space is the flow control).
    pub(super) credits: Credits,
    /// The receiver's buffer size: the most bytes one message may carry.
    pub(super) max_len: usize,
    /// What the receiver wrote back and is not a whole frame yet.
    pub(super) reverse: Vec<u8>,
    /// Lane messages the receiver wrote back, for the lanes driver.
    pub(super) lanes_in: Vec<LaneMsg>,
    /// Sends since the stream was last read for answers (lanes whose credits do not come on
    /// the stream).
    pub(super) unread_sends: u32,
    /// Sends that had to wait for a credit (or ring space) since the sender last took the
    /// count into the engine's counters.
    pub(super) credit_waits: u64,
}

impl Link {
    /// A connection's shared part, before any credit came.
    pub(super) fn new(peer: String, stream: TcpStream, max_len: usize) -> Link {
        Link {
            peer,
            stream,
            credits: Credits::default(),
            max_len,
            reverse: Vec::new(),
            lanes_in: Vec::new(),
            unread_sends: 0,
            credit_waits: 0,
        }
    }

    /// Fails for bytes over the receiver's buffer size.
    pub(super) fn check_len(&self, data: &[u8]) -> Result<()> {
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
        Ok(())
    }

    /// The connection broke while `doing`, for `e`.
    pub(super) fn broken(&self, doing: &str, e: impl std::fmt::Display) -> Error {
        Error::PeerDisconnected {
            peer: self.peer.clone(),
            reason: format!("{doing}: {e}"),
        }
    }

    /// The receiver closed the connection.
    pub(super) fn closed(&self) -> Error {
        Error::PeerDisconnected {
            peer: self.peer.clone(),
            reason: "the receiver closed the message connection".into(),
        }
    }

    /// No credit (or room) came within `timeout`.
    pub(super) fn timed_out(&self, timeout: Duration) -> Error {
        Error::Timeout {
            peer: self.peer.clone(),
            timeout_ms: timeout.as_millis() as u64,
            detail: " for room to send a message: the receiver took none of this engine's \
                     messages in meanwhile (it is not calling recv, or is frozen), and the room \
                     it gives them (credits, ring space) is used up",
        }
    }

    /// Reads what the receiver wrote back on the stream, without waiting: credit frames (only
    /// where `credits_allowed`: tcp) and lane messages (into `lanes_in`). Fails when the
    /// receiver closed the stream or wrote a frame it may not.
    pub(super) fn read_stream(&mut self, credits_allowed: bool) -> Result<()> {
        let mut b = [0u8; 256];
        match sockio::recv_nonblocking(self.stream.as_raw_fd(), &mut b) {
            Ok(None) => return Ok(()),
            Ok(Some(0)) => return Err(self.closed()),
            Ok(Some(n)) => self.reverse.extend_from_slice(&b[..n]),
            Err(e) => return Err(Error::io("reading the message stream", e)),
        }
        let granted = parse_back(
            &self.peer,
            &mut self.reverse,
            credits_allowed,
            &mut self.lanes_in,
        )?;
        self.take_credits(granted as u64)
    }

    /// Adds `n` credits the receiver granted. Fails when that puts more in hand than any
    /// receive queue holds (a broken or hostile receiver), instead of holding that many.
    pub(super) fn take_credits(&mut self, n: u64) -> Result<()> {
        if self.credits.available() as u64 + n > multirail_policy::receive::MAX_QUEUE_DEPTH as u64 {
            return Err(protocol(
                &self.peer,
                format!("{n} credits granted, more than a receive queue holds"),
            ));
        }
        self.credits
            .on_grant(std::iter::repeat_n(BufferId(0), n as usize));
        Ok(())
    }

    /// The stream of a fenced lane, to be read until the receiver closes its end (see
    /// `Messaging::retire`).
    pub(super) fn retiring_stream(&self) -> Option<RetiringFrom> {
        let stream = self.stream.try_clone().ok()?;
        let _ = stream.set_nonblocking(true);
        Some(RetiringFrom::Stream {
            stream,
            partial: self.reverse.clone(),
        })
    }
}

/// The sending half of a lane kind: how one message reaches the receiver and how its credits
/// come back.
pub(super) trait SendLane: Send {
    /// Sends one frame of `kind`: checks its length against [`Link::max_len`], takes a credit
    /// (see [`credit`]) unless the lane has another flow control, and writes it, waiting up
    /// to `timeout` for room. `poke` polls our receive side, which reads what comes back on
    /// a duplex socket. Fails on a timeout, a broken connection or too many bytes.
    fn send(
        &mut self,
        link: &mut Link,
        kind: MsgKind,
        data: &[u8],
        timeout: Duration,
        poke: &dyn Fn(),
    ) -> Result<()>;

    /// Moves the credits the receiver granted since into `link.credits`, without waiting.
    /// Fails when the connection broke.
    fn collect_credits(&mut self, link: &mut Link) -> Result<()>;

    /// Called on every round of a wait for credits that found none. Fails when the wait can
    /// no longer succeed.
    fn waiting(&mut self, _link: &Link, _poke: &dyn Fn()) -> Result<()> {
        Ok(())
    }

    /// Reads what the receiver wrote back (lane answers, and the stream's end), without
    /// waiting. Fails when the receiver closed the connection or wrote what it may not.
    fn read_back(&mut self, link: &mut Link) -> Result<()> {
        link.read_stream(false)
    }

    /// Answers come with the credits, read on every wait for one: a sender need not look for
    /// them now and then.
    fn answers_with_credits(&self) -> bool {
        false
    }

    /// The receiver is gone: nothing in flight needs waiting for on close.
    fn abandon(&mut self) {}

    /// The other end ended this lane (a duplex lane it fenced or never accepted): nothing
    /// more goes on it, and the next message takes a new connection.
    fn ended_by_peer(&self) -> bool {
        false
    }

    /// The duplex socket the lane is on, if it is one.
    fn duplex(&self) -> Option<&Arc<Duplex>> {
        None
    }

    /// What to read after the lane's fence until the receiver closes its end, if anything
    /// (see `Messaging::retire`); `dynamic` when dynamic lanes are on, whose answers may come
    /// after the fence. By default the stream, under dynamic lanes only.
    fn retire(&self, link: &Link, dynamic: bool) -> Option<RetiringFrom> {
        if dynamic {
            link.retiring_stream()
        } else {
            None
        }
    }
}

/// One credit, waiting up to `timeout` for the receiver to grant one if none is in hand.
/// Fails on a timeout or when the connection breaks while waiting.
pub(super) fn credit<L: SendLane + ?Sized>(
    lane: &mut L,
    link: &mut Link,
    timeout: Duration,
    poke: &dyn Fn(),
) -> Result<BufferId> {
    if let Some(b) = link.credits.take() {
        return Ok(b);
    }
    link.credit_waits += 1;
    // The clock is read only once the credits in hand are spent.
    let start = Instant::now();
    let mut idle = 0u32;
    loop {
        lane.collect_credits(link)?;
        if let Some(b) = link.credits.take() {
            return Ok(b);
        }
        lane.waiting(link, poke)?;
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(link.timed_out(timeout));
        }
        idle = idle.wrapping_add(1);
        if waited > SPIN && idle.is_multiple_of(16) {
            back_off(waited);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// What a receive poll hands a lane: the connection's shared part, its pool and where what
/// arrives goes.
pub(super) struct RecvCx<'a> {
    pub(super) id: ConnId,
    /// The key of the connection's pool.
    pub(super) key: u64,
    pub(super) from: &'a Arc<str>,
    pub(super) stream: &'a TcpStream,
    /// Set when an earlier lane of the sender is still open: what arrives waits for it.
    pub(super) hold: Option<ConnId>,
    /// Set by the lane when the connection ended without an error.
    pub(super) dead: &'a mut bool,
    /// Set by the lane when the sender closed the stream (its end was read).
    pub(super) ended: &'a mut bool,
    /// The sender's fence arrived: nothing more may.
    pub(super) fenced: bool,
    pub(super) pool: &'a mut Pool,
    pub(super) delivered: &'a mut Delivered,
    /// Also check whether the sender is still there (lanes whose stream carries nothing).
    pub(super) liveness: bool,
}

impl RecvCx<'_> {
    /// The receive buffers' size: the most bytes a message may have.
    pub(super) fn max_len(&self) -> usize {
        self.pool.queue.settings().buffer_size
    }

    /// A message of `kind` and `len` bytes arrived: in buffer `named` (the sender's choice),
    /// or the next the accounting posted; `src` holds its bytes when they still need copying
    /// in. Fails on a message beyond the credits or after the fence.
    pub(super) fn deliver(
        &mut self,
        kind: MsgKind,
        named: Option<BufferId>,
        src: Option<&[u8]>,
        len: usize,
    ) -> std::result::Result<(), String> {
        let buf = self
            .pool
            .queue
            .on_arrival(self.id, named)
            .map_err(|e| e.to_string())?;
        if let Some(src) = src {
            // SAFETY: a posted buffer of `buffer_size >= len` bytes nothing else touches
            // until it is consumed.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.pool.ptr(buf), len) };
        }
        if self.fenced {
            return Err("a message after the lane's fence".into());
        }
        self.fenced = take_in(
            self.from,
            self.key,
            self.pool,
            kind,
            buf,
            len,
            self.hold,
            self.delivered,
        )?;
        Ok(())
    }
}

/// The receiving half of a lane kind: how messages are taken in and credits told. `Any`, so a
/// lane kind's own receive sources (a shared ring, a completion queue) find their connections
/// among all by upcasting to `dyn Any` and downcasting.
pub(super) trait RecvLane: Send + Any {
    /// Takes in what arrived on the connection. Fails (the connection closes) on anything
    /// the sender may not send.
    fn receive(&mut self, cx: &mut RecvCx<'_>) -> std::result::Result<(), String>;

    /// Tells the sender about `buffers`, posted for it. Fails when the connection broke.
    fn grant(
        &mut self,
        stream: &TcpStream,
        buffers: &[BufferId],
    ) -> std::result::Result<(), String>;

    /// Read from its socket by the receive poll: the stream pause and the one-connection fast
    /// path apply to it.
    fn reads_socket(&self) -> bool {
        false
    }

    /// Read on every poll by itself (not through the shared shm ring or an RDMA completion
    /// queue).
    fn polled_alone(&self) -> bool {
        true
    }

    /// The duplex socket the lane is on, if it is one.
    fn duplex(&self) -> Option<&Arc<Duplex>> {
        None
    }

    /// Writes a lane answer `frame` back to the sender. Fails when the connection broke.
    fn answer(&self, stream: &TcpStream, frame: &[u8]) -> std::io::Result<()> {
        (&*stream).write_all(frame)
    }

    /// Sets (or clears) the sleeping flag of the lane's shm ring, if it has one (see
    /// `doorbell`): while set, a sender rings the receiver's doorbell after publishing.
    fn set_asleep(&self, _asleep: bool) {}

    /// Receive memory the lane holds beside its pool's buffers.
    fn ring_bytes(&self) -> u64 {
        0
    }

    /// The connection is reaped: gives back what the lane holds outside its pool.
    fn release(&self, _registry: &MemoryRegistry, _shared: Option<&mut SharedShm>) {}

    /// What is left of a dead connection whose socket carries another lane: a reader of it
    /// (see `duplex`); `None` closes it.
    fn into_reader(self: Box<Self>, _rest: ReaderParts) -> Option<Reader> {
        None
    }
}

/// What [`RecvLane::into_reader`] takes of a dead connection.
pub(super) struct ReaderParts {
    pub(super) from: Arc<str>,
    pub(super) stream: TcpStream,
    pub(super) fenced: bool,
    pub(super) ended: bool,
    pub(super) permit: Option<ConnPermit>,
}
