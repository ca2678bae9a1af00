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

mod socket;

pub(in crate::messaging) use socket::{Duplex, Sent};

use crate::messaging::*;

/// Size of a [`MsgKind::ReverseRefuse`] reason at most.
const REASON_MAX: usize = 64;

/// A [`MsgKind::ReverseRefuse`] frame saying `why` (cut to a few dozen bytes).
pub(in crate::messaging) fn refuse_frame(why: &str) -> Vec<u8> {
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
pub(in crate::messaging) fn open_frame(epoch: u32, from: &str) -> Vec<u8> {
    let mut f = frame_header(MsgKind::ReverseOpen, 4 + from.len() as u32).to_vec();
    f.extend_from_slice(&epoch.to_le_bytes());
    f.extend_from_slice(from.as_bytes());
    f
}

/// One end of a duplex socket while it carries no lane of the other end's: the opener's end
/// before (or without) a reverse lane, either end after the other's lane ended. It reads the
/// answers for this end's lane, a reverse opening (the opener's end, once), and the end.
pub(in crate::messaging) struct Reader {
    pub(in crate::messaging) from: Arc<str>,
    pub(in crate::messaging) stream: TcpStream,
    pub(in crate::messaging) staging: Box<[u8]>,
    pub(in crate::messaging) start: usize,
    pub(in crate::messaging) end: usize,
    pub(in crate::messaging) duplex: Arc<Duplex>,
    /// The other end may still start its lane here (the opener's end, until one started).
    pub(in crate::messaging) may_open: bool,
    /// This end's writing half is shut.
    pub(in crate::messaging) shut: bool,
    pub(in crate::messaging) _permit: Option<ConnPermit>,
}

/// What a reader's poll found.
pub(in crate::messaging) enum ReaderEvent {
    Nothing,
    /// The other end, named so, starts its lane of `epoch` here.
    Open(u32, Arc<str>),
    /// The socket ended; the reader goes.
    Ended,
}

impl Reader {
    /// Reads what arrived and takes in the frames meant for this end's lane, up to a reverse
    /// opening (what follows it is the new lane's, read by its connection). Shuts this end's
    /// writing half once its own lane is over too. Fails on a frame no end may send here.
    pub(in crate::messaging) fn poll(&mut self) -> std::result::Result<ReaderEvent, String> {
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

/// The sending half of our dedicated lane on a duplex socket: credits and answers come
/// through the receive poll, which reads the socket.
pub(in crate::messaging) struct DuplexSend {
    duplex: Arc<Duplex>,
    /// Credits taken from the receiver's total so far.
    seen: u64,
}

/// How long a sender waits for the other end of a duplex socket to take the lane it starts
/// there before it fences that lane and opens a connection of its own (see `await_accept`).
const ACCEPT_WAIT: Duration = Duration::from_millis(50);

impl DuplexSend {
    /// The opener's lane on a fresh dedicated tcp connection `stream` to `from`, whose
    /// receive buffers hold `max_len` bytes, and the reader of the socket for our receive
    /// poll, which takes in the lane the other end may start on it (staging frames of up to
    /// `buffer_size` bytes). `defer_credits` when a lanes driver runs. Fails when the socket
    /// cannot be shared.
    pub(in crate::messaging) fn opener(
        from: &str,
        stream: &TcpStream,
        max_len: usize,
        buffer_size: usize,
        defer_credits: bool,
    ) -> std::io::Result<(DuplexSend, Reader)> {
        let d = Duplex::new(true, max_len, defer_credits);
        let reader = Reader {
            from: from.into(),
            stream: stream.try_clone()?,
            staging: staging(buffer_size),
            start: 0,
            end: 0,
            duplex: d.clone(),
            may_open: true,
            shut: false,
            _permit: None,
        };
        Ok((DuplexSend { duplex: d, seen: 0 }, reader))
    }

    /// Waits for the other end of a duplex lane to accept it (its buffer size). Its receive
    /// poll reads the opening, so an application that does not poll for a while would hold
    /// our send: after [`ACCEPT_WAIT`] (or `timeout`, if shorter) we fence the lane instead
    /// and the message takes a connection of its own. Fails when the lane was refused,
    /// fenced (also by us, so), or the connection went away.
    fn await_accept(&mut self, link: &mut Link, timeout: Duration, poke: &dyn Fn()) -> Result<()> {
        let d = &self.duplex;
        let timeout = timeout.min(ACCEPT_WAIT);
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            if let Some(n) = d.peer_max_len() {
                link.max_len = n;
                return Ok(());
            }
            if d.refused() || d.out_fenced() {
                return Err(link.broken("opening a lane", "the receiver did not take it"));
            }
            if d.closed() {
                return Err(link.broken("opening a lane", "the connection closed"));
            }
            poke();
            let waited = start.elapsed();
            if waited >= timeout {
                // A fence takes no credit: the other end closes the lane when it gets to it.
                d.send_lane(&link.stream, MsgKind::Fence, &[])
                    .map_err(|e| link.broken("leaving an unanswered lane", e))?;
                return Err(link.broken("opening a lane", "no answer in time"));
            }
            idle = idle.wrapping_add(1);
            if waited > SPIN && idle.is_multiple_of(16) {
                back_off(waited);
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl SendLane for DuplexSend {
    fn send(
        &mut self,
        link: &mut Link,
        kind: MsgKind,
        data: &[u8],
        timeout: Duration,
        poke: &dyn Fn(),
    ) -> Result<()> {
        if kind == MsgKind::Fence {
            // Fences take no credit on a duplex lane: the other end may have stopped
            // granting (its own lane's fence came first).
            return self
                .duplex
                .send_lane(&link.stream, kind, data)
                .map(|_| ())
                .map_err(|e| link.broken("fencing a lane", e));
        }
        if link.max_len == 0 {
            self.await_accept(link, timeout, poke)?;
        }
        link.check_len(data)?;
        credit(self, link, timeout, poke)?;
        match self.duplex.send_lane(&link.stream, kind, data) {
            Ok(Sent::Written) => Ok(()),
            Ok(Sent::Fenced) => Err(link.broken("sending a message", "the lane was fenced")),
            Err(e) => Err(link.broken("sending a message", e)),
        }
    }

    fn collect_credits(&mut self, link: &mut Link) -> Result<()> {
        let total = self.duplex.granted();
        let closed = self.duplex.closed();
        if total > self.seen {
            let n = total - self.seen;
            self.seen = total;
            link.take_credits(n)?;
        }
        if closed {
            return Err(link.closed());
        }
        Ok(())
    }

    /// Our receive side reads the credits: poll it when nobody else does.
    fn waiting(&mut self, link: &Link, poke: &dyn Fn()) -> Result<()> {
        if self.duplex.out_fenced() {
            return Err(link.broken("waiting for a credit", "the lane was fenced"));
        }
        poke();
        Ok(())
    }

    fn read_back(&mut self, link: &mut Link) -> Result<()> {
        self.duplex.take_answers(&mut link.lanes_in);
        if self.duplex.closed() {
            return Err(link.closed());
        }
        Ok(())
    }

    fn ended_by_peer(&self) -> bool {
        self.duplex.out_fenced() || self.duplex.refused()
    }

    fn duplex(&self) -> Option<&Arc<Duplex>> {
        Some(&self.duplex)
    }

    /// The receive poll reads the socket on (and shuts it once both lanes are over); answers
    /// it reads come here until then, under dynamic lanes (nothing else needs them).
    fn retire(&self, _link: &Link, dynamic: bool) -> Option<RetiringFrom> {
        dynamic.then(|| RetiringFrom::Duplex(self.duplex.clone()))
    }
}

/// The receiving half of a dedicated tcp lane, whose socket may carry a lane of ours the other
/// way: what it shares with that lane.
pub(in crate::messaging) struct DuplexRecv {
    pub(in crate::messaging) staging: Staging,
    pub(in crate::messaging) duplex: Arc<Duplex>,
}

impl RecvLane for DuplexRecv {
    fn receive(&mut self, cx: &mut RecvCx<'_>) -> std::result::Result<(), String> {
        receive_frames(&mut self.staging, Some(&self.duplex), cx)
    }

    /// Maybe with our next frame (see [`Duplex::grant`]).
    fn grant(
        &mut self,
        stream: &TcpStream,
        buffers: &[BufferId],
    ) -> std::result::Result<(), String> {
        self.duplex
            .grant(stream, buffers.len())
            .map_err(|e| e.to_string())
    }

    fn reads_socket(&self) -> bool {
        true
    }

    fn duplex(&self) -> Option<&Arc<Duplex>> {
        Some(&self.duplex)
    }

    fn answer(&self, stream: &TcpStream, frame: &[u8]) -> std::io::Result<()> {
        self.duplex.control(stream, frame)
    }

    /// A lane that was fenced and whose socket did not end: read on for our lane the other
    /// way and so that nothing is lost to a reset. Anything else closes the socket.
    fn into_reader(self: Box<Self>, rest: ReaderParts) -> Option<Reader> {
        let DuplexRecv { staging, duplex } = *self;
        duplex.set_in_carried(false);
        if rest.fenced && !rest.ended {
            Some(Reader {
                from: rest.from,
                stream: rest.stream,
                staging: staging.buf,
                start: staging.start,
                end: staging.end,
                duplex,
                may_open: false,
                shut: false,
                _permit: rest.permit,
            })
        } else {
            duplex.set_closed();
            None
        }
    }
}

impl Messaging {
    /// Our dedicated lane of `epoch` to `peer` on the socket of its dedicated lane to us, when
    /// there is one that carries no lane of ours yet: its first frame says so, with our name
    /// `local_name`, which our other connections to `peer` carry too.
    /// `None` when there is none. Fails when the socket does.
    pub(in crate::messaging) fn attach_reverse(
        &self,
        peer: &Arc<Peer>,
        local_name: &str,
        epoch: u32,
    ) -> Result<Option<OutConn>> {
        let rx = self.rx.lock().expect("rx poisoned");
        let Some((c, d)) = rx.conns.iter().find_map(|c| {
            let d = c.io.duplex()?;
            let usable = *c.from == *peer.name
                && c.lane == Lane::Dedicated
                && !(c.dead || c.fenced || d.closed() || d.attached());
            usable.then_some((c, d))
        }) else {
            return Ok(None);
        };
        let broken = |e: std::io::Error| Error::PeerDisconnected {
            peer: peer.name.clone(),
            reason: format!("opening a lane on its duplex connection: {e}"),
        };
        let stream = c.stream.try_clone().map_err(broken)?;
        if !d.attach() {
            return Ok(None);
        }
        d.control(&stream, &open_frame(epoch, local_name))
            .map_err(broken)?;
        tracing::debug!(peer = %peer.name, epoch, "dedicated lane on the peer's duplex connection");
        // The buffer size is told by the receiver's answer, before its first credits.
        let link = Link::new(peer.name.clone(), stream, 0);
        let io = DuplexSend {
            duplex: d.clone(),
            seen: 0,
        };
        Ok(Some(OutConn::new(link, Box::new(io), Lane::Dedicated)))
    }

    /// Polls the duplex sockets that carry no lane to us; one whose other end starts a lane
    /// on it becomes that lane's connection.
    pub(in crate::messaging) fn poll_readers(&self, rx: &mut Rx) {
        let mut i = 0;
        while i < rx.readers.len() {
            match rx.readers[i].poll() {
                Ok(ReaderEvent::Nothing) => i += 1,
                Ok(ReaderEvent::Ended) => {
                    rx.readers.swap_remove(i);
                }
                Ok(ReaderEvent::Open(epoch, from)) => {
                    let r = rx.readers.swap_remove(i);
                    self.open_reverse(rx, r, from, epoch);
                }
                Err(reason) => {
                    let r = rx.readers.swap_remove(i);
                    tracing::warn!(peer = %r.from, %reason, "closed a duplex message connection");
                    r.duplex.set_closed();
                }
            }
        }
    }

    /// The other end of duplex socket `r`, `from`, starts its dedicated lane of `epoch` to us
    /// on it:
    /// a receive pool of its own (our granting side agreed to the lane), the buffer size,
    /// then credits. Refused, telling why, when the pool cannot be made; the reader stays.
    fn open_reverse(&self, rx: &mut Rx, r: Reader, from: Arc<str>, epoch: u32) {
        let settings = ReceiveSettings {
            shared_receive_queue: false,
            ..self.tcp
        };
        let id = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        let pool = Pool::new(&self.registry, settings, false).and_then(|mut p| {
            p.queue
                .add_connection(id)
                .map_err(|e| Error::invalid("receive", e.to_string()))?;
            Ok(p)
        });
        let pool = match pool {
            Ok(p) => p,
            Err(e) => {
                let why = format!("receive pool: {e}");
                tracing::warn!(peer = %r.from, reason = %why, "refused a reverse lane");
                if let Err(e) = r.duplex.control(&r.stream, &refuse_frame(&why)) {
                    tracing::warn!(peer = %r.from, error = %e, "cannot refuse a reverse lane");
                    r.duplex.set_closed();
                    return;
                }
                rx.readers.push(r);
                return;
            }
        };
        let accept = frame_header(MsgKind::ReverseAccept, settings.buffer_size as u32);
        if let Err(e) = r.duplex.control(&r.stream, &accept) {
            tracing::warn!(peer = %r.from, error = %e, "cannot accept a reverse lane");
            r.duplex.set_closed();
            pool.release(&self.registry);
            return;
        }
        let key = id.0;
        rx.pools.insert(key, pool);
        let Reader {
            stream,
            staging,
            start,
            end,
            duplex,
            _permit,
            ..
        } = r;
        duplex.set_in_carried(true);
        let io = DuplexRecv {
            staging: Staging {
                buf: staging,
                start,
                end,
            },
            duplex,
        };
        let conn = InConn::new(
            id,
            from,
            key,
            stream,
            Box::new(io),
            (Lane::Dedicated, epoch),
            _permit,
        );
        rx.add_conn(conn);
        // A receiver asleep on the doorbell does not watch the new lane yet.
        self.bell.ring_local();
        rx.lanes_dirty = true;
        let Rx { conns, pools, .. } = rx;
        grant(conns, pools, key);
        // The first credits go at once: the other end waits for them to send anything.
        if let Some(c) = conns.iter().find(|c| c.id == id) {
            if let Some(d) = c.io.duplex() {
                if let Err(e) = d.try_flush(&c.stream) {
                    tracing::warn!(peer = %c.from, error = %e, "cannot grant a reverse lane");
                }
            }
        }
    }
}
