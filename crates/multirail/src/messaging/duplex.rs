//! Duplex dedicated tcp lanes: one socket carries a dedicated lane each way.
//!
//! A lane is one direction (see `dynamic`), so two engines that each give the other a
//! dedicated tcp lane would otherwise hold two sockets, one per direction. Then no message
//! carries the TCP acknowledgement of the one it answers: every message costs its receiver a
//! pure ACK segment on the other socket, and on loopback that alone made a 128-byte one-way
//! trip ~1 µs (30 %) slower than over one socket (`bench/tcp_busypoll.c`, `two`). So the end
//! that *accepted* a dedicated tcp lane starts its own dedicated lane to the other end on the
//! same socket instead of opening one:
//!
//! - the acceptor sends [`MsgKind::ReverseOpen`] with the new lane's epoch; the opener makes
//!   the receive pool for it (it is a dedicated lane its granting side agreed to) and answers
//!   [`MsgKind::ReverseAccept`] with its buffer size, then credits, or
//!   [`MsgKind::ReverseRefuse`] (the acceptor then opens a socket of its own);
//! - each direction of the socket carries the writer's lane (messages, notifications, lane
//!   requests, its fence) and the writer's answers for the reader's lane (credits,
//!   [`MsgKind::LaneAnswer`]); the reader tells them apart by kind;
//! - one reader per end: the receive poll (`Rx`), which hands credits and answers for this
//!   end's own lane to it through [`Duplex`]. A sender waiting for credits polls the receive
//!   side itself when nobody else does (never waiting for its lock);
//! - writers of whole frames take [`Duplex`]'s write lock; the receive side never waits for
//!   it (a sender may hold it in a write that waits for the peer to read): what it cannot
//!   write at once is owed and goes out with the next frame written;
//! - fences take no credit here. A fence on either lane ends both: the end that reads the
//!   other's fence fences its own lane on the socket too, and its next message takes a new
//!   connection (after everything before that fence, by epoch, as for any switch). Each end
//!   shuts its writing half once both lanes are over and closes after reading the other's
//!   end, so nothing either wrote is lost to a reset.

use super::*;

/// Size of a [`MsgKind::ReverseRefuse`] reason at most.
const REASON_MAX: usize = 64;

/// Credits one frame header carries at most (its three spare bytes, see `send_lane`).
const PIGGYBACK_MAX: u32 = (1 << 24) - 1;

/// Frames the receive side could not write at once (the write lock was held). Credits owed
/// are counted apart, in [`Duplex::owed_credits`]: they are owed on every message taken in,
/// and an atomic add costs that path less than this lock.
#[derive(Default)]
struct Owed {
    /// Whole frames, in order.
    frames: Vec<u8>,
    /// This end's lane is to be fenced after them (and after the credits owed).
    fence: bool,
}

/// What one end's two lanes of a duplex socket share.
pub(super) struct Duplex {
    /// Held while whole frames are written.
    wr: Mutex<()>,
    owed: Mutex<Owed>,
    /// `owed` holds a frame or a fence.
    owed_any: AtomicBool,
    /// Credits owed to the other end's lane, told after the frames owed.
    owed_credits: AtomicU64,
    /// Credits the other end granted this end's lane, in total.
    granted: AtomicU64,
    /// Lane answers for this end's lane, in order.
    answers: Mutex<Vec<LaneMsg>>,
    answers_any: AtomicBool,
    /// The socket ended (the reader saw its end or an error).
    closed: AtomicBool,
    /// This end has a lane on the socket (the opener from the start; the acceptor once it
    /// sent `ReverseOpen`).
    out_attached: AtomicBool,
    /// This end's lane is fenced: nothing of it is written any more.
    out_fenced: AtomicBool,
    /// The other end's receive buffer size for this end's lane (0: not told yet).
    peer_max_len: AtomicUsize,
    /// The other end refused this end's reverse lane.
    refused: AtomicBool,
    /// The socket carries the other end's lane to us now.
    in_carried: AtomicBool,
    /// Credits may wait for this end's next frame (see [`Duplex::grant`]).
    defer_credits: bool,
}

/// What [`Duplex::send_lane`] did.
pub(super) enum Sent {
    Written,
    /// This end's lane was fenced (the other end fenced its own): nothing was written.
    Fenced,
}

impl Duplex {
    /// Shared state of a fresh duplex socket: `out_attached` for the opener, whose lane is on
    /// it from the start, with the receiver's buffer size `peer_max_len`; else the acceptor's,
    /// which reads the opener's lane from the start. `defer_credits` when a lanes driver runs
    /// (see [`Duplex::grant`]).
    pub(super) fn new(out_attached: bool, peer_max_len: usize, defer_credits: bool) -> Arc<Duplex> {
        Arc::new(Duplex {
            wr: Mutex::new(()),
            owed: Mutex::default(),
            owed_any: AtomicBool::new(false),
            owed_credits: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            answers: Mutex::default(),
            answers_any: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            out_attached: AtomicBool::new(out_attached),
            out_fenced: AtomicBool::new(false),
            peer_max_len: AtomicUsize::new(peer_max_len),
            refused: AtomicBool::new(false),
            in_carried: AtomicBool::new(!out_attached),
            defer_credits,
        })
    }

    /// Credits granted so far, in total.
    pub(super) fn granted(&self) -> u64 {
        self.granted.load(Ordering::Acquire)
    }

    pub(super) fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(super) fn set_closed(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub(super) fn out_fenced(&self) -> bool {
        self.out_fenced.load(Ordering::Acquire)
    }

    pub(super) fn refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    /// The other end's buffer size for this end's lane, once told.
    pub(super) fn peer_max_len(&self) -> Option<usize> {
        Some(self.peer_max_len.load(Ordering::Acquire)).filter(|&n| n > 0)
    }

    /// Nothing more of this end's lane will be written: fenced, refused, or never started.
    pub(super) fn out_done(&self) -> bool {
        !self.out_attached.load(Ordering::Acquire) || self.out_fenced() || self.refused()
    }

    /// Whether the other end's lane to us is on the socket (or no longer is).
    pub(super) fn set_in_carried(&self, carried: bool) {
        self.in_carried.store(carried, Ordering::Release);
    }

    /// The socket carries a lane each way now.
    pub(super) fn both_ways(&self) -> bool {
        self.in_carried.load(Ordering::Acquire) && !self.out_done()
    }

    /// This end's lane is on the socket, or was.
    pub(super) fn attached(&self) -> bool {
        self.out_attached.load(Ordering::Acquire)
    }

    /// Claims the socket for this end's reverse lane; false when one was started before.
    pub(super) fn attach(&self) -> bool {
        !self.out_attached.swap(true, Ordering::AcqRel)
    }

    /// Moves the lane answers read so far into `out`.
    pub(super) fn take_answers(&self, out: &mut Vec<LaneMsg>) {
        if self.answers_any.swap(false, Ordering::AcqRel) {
            out.append(&mut self.answers.lock().expect("duplex answers poisoned"));
        }
    }

    /// A frame of this end's lane (`kind` and `data`), after whatever is owed. Writes nothing
    /// and returns [`Sent::Fenced`] when the lane is fenced. Fails when the socket does.
    pub(super) fn send_lane(
        &self,
        stream: &TcpStream,
        kind: MsgKind,
        data: &[u8],
    ) -> std::io::Result<Sent> {
        let _w = self.wr.lock().expect("duplex writer poisoned");
        // Anything else owed goes first, with the credits; else credits owed ride in the
        // frame's header.
        if self.owed_any.load(Ordering::Acquire) {
            self.flush_locked(stream)?;
        }
        if self.out_fenced() {
            return Ok(Sent::Fenced);
        }
        let piggyback = self.take_credits(PIGGYBACK_MAX);
        let mut h = [0u8; MSG_HEADER_LEN];
        MsgHeader {
            kind,
            len: data.len() as u32,
        }
        .encode(&mut h);
        h[5..8].copy_from_slice(&piggyback.to_le_bytes()[..3]);
        sockio::send_frame(stream.as_raw_fd(), &h, data)?;
        if kind == MsgKind::Fence {
            self.out_fenced.store(true, Ordering::Release);
        }
        if self.owes() {
            // Owed while we wrote: nobody else may come by to write it.
            self.flush_locked(stream)?;
        }
        Ok(Sent::Written)
    }

    /// Something is owed: frames, a fence or credits.
    fn owes(&self) -> bool {
        self.owed_any.load(Ordering::Acquire) || self.owed_credits.load(Ordering::Acquire) > 0
    }

    /// Takes up to `max` of the credits owed (none without an atomic write when none are).
    fn take_credits(&self, max: u32) -> u32 {
        if self.owed_credits.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let n = self.owed_credits.swap(0, Ordering::AcqRel);
        if n > max as u64 {
            self.owed_credits
                .fetch_add(n - max as u64, Ordering::AcqRel);
            return max;
        }
        n as u32
    }

    /// Owes `frame` (whole) and writes what is owed if the write lock is free.
    pub(super) fn control(&self, stream: &TcpStream, frame: &[u8]) -> std::io::Result<()> {
        self.owe(|o| o.frames.extend_from_slice(frame));
        self.try_flush(stream)
    }

    /// Grants `n` credits for the other end's lane. While this end has a lane on the socket
    /// too and a lanes driver runs, they are owed: they ride in the header of this end's next
    /// frame, or go as a credit frame at the next receive poll or the driver's next look,
    /// whichever comes first. So a receiver that answers a message gives its buffer back
    /// with the answer instead of in a segment of its own before it, which cost one round
    /// trip in 31 some 4 µs. Otherwise they are written now (if the write lock is free).
    /// Deferring costs the other end nothing while this end polls; one that stops polling
    /// leaves the other end the half of its share it still held when the grant was due.
    pub(super) fn grant(&self, stream: &TcpStream, n: usize) -> std::io::Result<()> {
        self.owed_credits.fetch_add(n as u64, Ordering::AcqRel);
        if self.defer_credits && self.both_ways() {
            return Ok(());
        }
        self.try_flush(stream)
    }

    /// Takes in the credits that ride in the header of a whole frame `frame`.
    pub(super) fn on_piggyback(&self, frame: &[u8]) {
        let n = u32::from_le_bytes([frame[5], frame[6], frame[7], 0]);
        if n > 0 {
            self.granted.fetch_add(n as u64, Ordering::AcqRel);
        }
    }

    /// Fences this end's lane (the other end fenced its own), after anything written or owed
    /// before. Nothing to do when the lane is over already.
    pub(super) fn fence_soon(&self, stream: &TcpStream) -> std::io::Result<()> {
        if self.out_done() {
            return Ok(());
        }
        self.owe(|o| o.fence = true);
        self.try_flush(stream)
    }

    fn owe(&self, f: impl FnOnce(&mut Owed)) {
        f(&mut self.owed.lock().expect("duplex owed poisoned"));
        self.owed_any.store(true, Ordering::Release);
    }

    /// Writes what is owed unless a writer holds the lock (it writes it after its frame).
    pub(super) fn try_flush(&self, stream: &TcpStream) -> std::io::Result<()> {
        if !self.owes() {
            return Ok(());
        }
        match self.wr.try_lock() {
            Ok(_w) => self.flush_locked(stream),
            Err(_) => Ok(()),
        }
    }

    fn flush_locked(&self, stream: &TcpStream) -> std::io::Result<()> {
        let owed = if self.owed_any.load(Ordering::Acquire) {
            let mut o = self.owed.lock().expect("duplex owed poisoned");
            self.owed_any.store(false, Ordering::Release);
            std::mem::take(&mut *o)
        } else {
            Owed::default()
        };
        // After the frames: the credits owed once they were taken.
        let mut credits = self.take_credits(u32::MAX) as u64;
        if owed.frames.is_empty() && !owed.fence {
            // Credits alone, the usual case: one frame from the stack, no allocation.
            if credits > 0 {
                (&*stream).write_all(&frame_header(MsgKind::Credit, credits as u32))?;
            }
            return Ok(());
        }
        let mut bytes = owed.frames;
        while credits > 0 {
            let n = credits.min(u32::MAX as u64);
            bytes.extend_from_slice(&frame_header(MsgKind::Credit, n as u32));
            credits -= n;
        }
        let fence = owed.fence && !self.out_fenced();
        if fence {
            bytes.extend_from_slice(&frame_header(MsgKind::Fence, 0));
        }
        if !bytes.is_empty() {
            (&*stream).write_all(&bytes)?;
        }
        if fence {
            self.out_fenced.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Takes in a frame meant for this end's own lane (credits, answers, the answer to a
    /// reverse opening). Returns false for a frame of the other end's lane, which the caller
    /// delivers. Fails on a malformed answer.
    pub(super) fn on_control(
        &self,
        h: MsgHeader,
        body: &[u8],
    ) -> std::result::Result<bool, String> {
        match h.kind {
            MsgKind::Credit => {
                self.granted.fetch_add(h.len as u64, Ordering::AcqRel);
            }
            MsgKind::LaneAnswer => {
                let m = LaneMsg::decode(body).map_err(|e| format!("lane answer: {e}"))?;
                self.answers
                    .lock()
                    .expect("duplex answers poisoned")
                    .push(m);
                self.answers_any.store(true, Ordering::Release);
            }
            MsgKind::ReverseAccept => {
                if h.len == 0 {
                    return Err("a reverse lane accepted with 0-byte buffers".into());
                }
                self.peer_max_len.store(h.len as usize, Ordering::Release);
            }
            MsgKind::ReverseRefuse => {
                tracing::debug!(reason = %String::from_utf8_lossy(body), "reverse lane refused");
                self.refused.store(true, Ordering::Release);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Whether a frame of `kind` has a payload of `len` bytes to wait for (credits and reverse
/// accepts carry a count instead).
pub(super) fn payload_len(h: &MsgHeader) -> usize {
    match h.kind {
        MsgKind::Credit | MsgKind::ReverseAccept => 0,
        _ => h.len as usize,
    }
}

/// A frame header of `kind` with `len`.
pub(super) fn frame_header(kind: MsgKind, len: u32) -> [u8; MSG_HEADER_LEN] {
    let mut h = [0u8; MSG_HEADER_LEN];
    MsgHeader { kind, len }.encode(&mut h);
    h
}

/// A [`MsgKind::ReverseRefuse`] frame saying `why` (cut to a few dozen bytes).
pub(super) fn refuse_frame(why: &str) -> Vec<u8> {
    let mut end = why.len().min(REASON_MAX);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    let mut f = frame_header(MsgKind::ReverseRefuse, end as u32).to_vec();
    f.extend_from_slice(&why.as_bytes()[..end]);
    f
}

/// A [`MsgKind::ReverseOpen`] frame for a lane of `epoch` from the engine named `from` (the
/// name its other connections carry, which orders its lanes at the receiver).
pub(super) fn open_frame(epoch: u32, from: &str) -> Vec<u8> {
    let mut f = frame_header(MsgKind::ReverseOpen, 4 + from.len() as u32).to_vec();
    f.extend_from_slice(&epoch.to_le_bytes());
    f.extend_from_slice(from.as_bytes());
    f
}

/// One end of a duplex socket while it carries no lane of the other end's: the opener's end
/// before (or without) a reverse lane, either end after the other's lane ended. It reads the
/// answers for this end's lane, a reverse opening (the opener's end, once), and the end.
pub(super) struct Reader {
    pub(super) from: Arc<str>,
    pub(super) stream: TcpStream,
    pub(super) staging: Box<[u8]>,
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) duplex: Arc<Duplex>,
    /// The other end may still start its lane here (the opener's end, until one started).
    pub(super) may_open: bool,
    /// This end's writing half is shut.
    pub(super) shut: bool,
    pub(super) _permit: Option<ConnPermit>,
}

/// What a reader's poll found.
pub(super) enum ReaderEvent {
    Nothing,
    /// The other end, named so, starts its lane of `epoch` here.
    Open(u32, Arc<str>),
    /// The socket ended; the reader goes.
    Ended,
}

/// Staging for a duplex socket's reads: room for two whole frames of `buffer_size` bytes.
pub(super) fn staging(buffer_size: usize) -> Box<[u8]> {
    vec![0u8; (64 << 10).max(2 * (MSG_HEADER_LEN + buffer_size))].into_boxed_slice()
}

impl Reader {
    /// Reads what arrived and takes in the frames meant for this end's lane, up to a reverse
    /// opening (what follows it is the new lane's, read by its connection). Shuts this end's
    /// writing half once its own lane is over too. Fails on a frame no end may send here.
    pub(super) fn poll(&mut self) -> std::result::Result<ReaderEvent, String> {
        if !self.shut {
            self.duplex
                .try_flush(&self.stream)
                .map_err(|e| format!("writing on a duplex lane: {e}"))?;
        }
        if !self.shut && self.duplex.out_done() {
            let _ = self.duplex.try_flush(&self.stream);
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
            self.shut = true;
        }
        if self.start > 0 && self.staging.len() - self.end < self.staging.len() / 2 {
            self.staging.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        match sockio::recv_nonblocking(self.stream.as_raw_fd(), &mut self.staging[self.end..]) {
            Ok(None) => {}
            Ok(Some(0)) => {
                self.duplex.set_closed();
                return Ok(ReaderEvent::Ended);
            }
            Ok(Some(n)) => self.end += n,
            // Between frames, a reset is the other end closing with our frames unread (see
            // `inbound::receive_io`).
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && self.start == self.end => {
                self.duplex.set_closed();
                return Ok(ReaderEvent::Ended);
            }
            Err(e) => {
                self.duplex.set_closed();
                return Err(format!("reading a duplex lane: {e}"));
            }
        }
        let max = (self.staging.len() / 2 - MSG_HEADER_LEN) as u32;
        while self.end - self.start >= MSG_HEADER_LEN {
            let h = MsgHeader::decode(&self.staging[self.start..self.end], max)?;
            let total = MSG_HEADER_LEN + payload_len(&h);
            if self.end - self.start < total {
                break;
            }
            self.duplex.on_piggyback(&self.staging[self.start..]);
            let body = &self.staging[self.start + MSG_HEADER_LEN..self.start + total];
            if self.duplex.on_control(h, body)? {
                self.start += total;
                continue;
            }
            match h.kind {
                MsgKind::ReverseOpen if (4..=4 + wire::MAX_NAME_LEN).contains(&body.len()) => {
                    let epoch = u32::from_le_bytes(body[..4].try_into().expect("4 bytes"));
                    let from: Arc<str> = std::str::from_utf8(&body[4..])
                        .map_err(|_| "a reverse lane's sender name is not UTF-8")?
                        .into();
                    self.start += total;
                    if self.may_open && !self.shut && !self.duplex.out_fenced() {
                        self.may_open = false;
                        return Ok(ReaderEvent::Open(epoch, from));
                    }
                    // Crossed our fence: the other end reads that fence and fences the lane
                    // it meant to start, which is what comes next (or nothing).
                    if !self.shut {
                        self.duplex
                            .control(&self.stream, &refuse_frame("the lane here is ending"))
                            .map_err(|e| format!("refusing a reverse lane: {e}"))?;
                    }
                }
                // The fence of a reverse lane we did not take, or of one that ended.
                MsgKind::Fence => self.start += total,
                k => return Err(format!("a {k:?} frame on a duplex lane that carries none")),
            }
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(ReaderEvent::Nothing)
    }
}
