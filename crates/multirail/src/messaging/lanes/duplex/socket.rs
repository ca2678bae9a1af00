//! The state one end's two lanes of a duplex socket share (see `duplex`): the write lock,
//! what the receive side owes the other end, and what it read for this end's lane.

use crate::messaging::*;

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
pub(in crate::messaging) struct Duplex {
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
pub(in crate::messaging) enum Sent {
    Written,
    /// This end's lane was fenced (the other end fenced its own): nothing was written.
    Fenced,
}

impl Duplex {
    /// Shared state of a fresh duplex socket: `out_attached` for the opener, whose lane is on
    /// it from the start, with the receiver's buffer size `peer_max_len`; else the acceptor's,
    /// which reads the opener's lane from the start. `defer_credits` when a lanes driver runs
    /// (see [`Duplex::grant`]).
    pub(in crate::messaging) fn new(
        out_attached: bool,
        peer_max_len: usize,
        defer_credits: bool,
    ) -> Arc<Duplex> {
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
    pub(in crate::messaging) fn granted(&self) -> u64 {
        self.granted.load(Ordering::Acquire)
    }

    pub(in crate::messaging) fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(in crate::messaging) fn set_closed(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub(in crate::messaging) fn out_fenced(&self) -> bool {
        self.out_fenced.load(Ordering::Acquire)
    }

    pub(in crate::messaging) fn refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    /// The other end's buffer size for this end's lane, once told.
    pub(in crate::messaging) fn peer_max_len(&self) -> Option<usize> {
        Some(self.peer_max_len.load(Ordering::Acquire)).filter(|&n| n > 0)
    }

    /// Nothing more of this end's lane will be written: fenced, refused, or never started.
    pub(in crate::messaging) fn out_done(&self) -> bool {
        !self.out_attached.load(Ordering::Acquire) || self.out_fenced() || self.refused()
    }

    /// Whether the other end's lane to us is on the socket (or no longer is).
    pub(in crate::messaging) fn set_in_carried(&self, carried: bool) {
        self.in_carried.store(carried, Ordering::Release);
    }

    /// The socket carries a lane each way now.
    pub(in crate::messaging) fn both_ways(&self) -> bool {
        self.in_carried.load(Ordering::Acquire) && !self.out_done()
    }

    /// This end's lane is on the socket, or was.
    pub(in crate::messaging) fn attached(&self) -> bool {
        self.out_attached.load(Ordering::Acquire)
    }

    /// Claims the socket for this end's reverse lane; false when one was started before.
    pub(in crate::messaging) fn attach(&self) -> bool {
        !self.out_attached.swap(true, Ordering::AcqRel)
    }

    /// Moves the lane answers read so far into `out`.
    pub(in crate::messaging) fn take_answers(&self, out: &mut Vec<LaneMsg>) {
        if self.answers_any.swap(false, Ordering::AcqRel) {
            out.append(&mut self.answers.lock().expect("duplex answers poisoned"));
        }
    }

    /// A frame of this end's lane (`kind` and `data`), after whatever is owed. Writes nothing
    /// and returns [`Sent::Fenced`] when the lane is fenced. Fails when the socket does.
    pub(in crate::messaging) fn send_lane(
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
    pub(in crate::messaging) fn control(
        &self,
        stream: &TcpStream,
        frame: &[u8],
    ) -> std::io::Result<()> {
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
    pub(in crate::messaging) fn grant(&self, stream: &TcpStream, n: usize) -> std::io::Result<()> {
        self.owed_credits.fetch_add(n as u64, Ordering::AcqRel);
        if self.defer_credits && self.both_ways() {
            return Ok(());
        }
        self.try_flush(stream)
    }

    /// Takes in the credits that ride in the header of a whole frame `frame`.
    pub(in crate::messaging) fn on_piggyback(&self, frame: &[u8]) {
        let n = u32::from_le_bytes([frame[5], frame[6], frame[7], 0]);
        if n > 0 {
            self.granted.fetch_add(n as u64, Ordering::AcqRel);
        }
    }

    /// Fences this end's lane (the other end fenced its own), after anything written or owed
    /// before. Nothing to do when the lane is over already.
    pub(in crate::messaging) fn fence_soon(&self, stream: &TcpStream) -> std::io::Result<()> {
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
    pub(in crate::messaging) fn try_flush(&self, stream: &TcpStream) -> std::io::Result<()> {
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
    pub(in crate::messaging) fn on_control(
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
