//! The sending side of messages: one connection per peer, credits, and sending against them.

use super::duplex;
use super::*;

/// How long a sender waits for the other end of a duplex socket to take the lane it starts
/// there before it fences that lane and opens a connection of its own (see `await_accept`).
const ACCEPT_WAIT: Duration = Duration::from_millis(50);

pub(super) enum OutIo {
    Tcp,
    /// Our dedicated lane on a duplex tcp socket (see `duplex`): credits and answers come
    /// through the receive poll, which reads the socket.
    TcpDuplex {
        duplex: Arc<Duplex>,
        /// Credits taken from the receiver's total so far.
        seen: u64,
    },
    Rdma {
        qp: Box<SendQueuePair>,
        /// Credits taken from the receiver's total so far.
        seen: u64,
        /// Credit checks since the stream was last checked for the receiver leaving.
        polls: u32,
    },
    Shm {
        ring: Ring,
        /// Base address of each receive chunk in this process.
        chunks: Vec<usize>,
        per_chunk: usize,
        buffer_size: usize,
        /// Next completion slot.
        tail: u64,
        _maps: Vec<Arc<PeerMapping>>,
    },
    /// The receiver's shared ring (the shared lane under dynamic lanes), written under `tag`.
    ShmShared {
        ring: SharedRing,
        tag: u32,
        _maps: Vec<Arc<PeerMapping>>,
    },
}

/// Our message connection to one peer: the lane its messages take now.
pub(super) struct OutConn {
    pub(super) peer: String,
    pub(super) stream: TcpStream,
    pub(super) credits: Credits,
    pub(super) max_len: usize,
    pub(super) io: OutIo,
    pub(super) lane: Lane,
    /// Set once the connection's fence was sent: a sender that was waiting for it must take
    /// the peer's current connection instead.
    pub(super) retired: bool,
    /// What the receiver wrote back and is not a whole frame yet.
    pub(super) reverse: Vec<u8>,
    /// Lane messages the receiver wrote back, for the lanes driver.
    pub(super) lanes_in: Vec<LaneMsg>,
    /// Sends since the stream was last read for answers (shm and rdma, whose credits do not
    /// come on the stream).
    pub(super) unread_sends: u32,
    /// Sends that had to wait for a credit (or ring space) since the sender last took the
    /// count into the engine's counters.
    pub(super) credit_waits: u64,
}

/// The lane messages to one peer take, and the epoch of the next connection made to it (the
/// receiver delivers a connection's messages after those of every earlier epoch).
#[derive(Default)]
pub(super) struct PeerLane {
    pub(super) lane: Lane,
    next_epoch: u32,
}

impl Messaging {
    pub(super) fn out_conn(
        &self,
        engine: &dyn Peers,
        peer: &Arc<Peer>,
    ) -> Result<Arc<Mutex<OutConn>>> {
        if let Some(c) = self.out.lock().expect("out poisoned").get(&peer.id) {
            return Ok(c.clone());
        }
        let lane = self.next_lane(peer.id, None);
        let conn = Arc::new(Mutex::new(self.connect_lane(engine, peer, lane)?));
        let mut out = self.out.lock().expect("out poisoned");
        Ok(out.entry(peer.id).or_insert(conn).clone())
    }

    /// The lane for the next connection to peer `id` (switched to `to` when given), and that
    /// connection's epoch.
    fn next_lane(&self, id: u64, to: Option<Lane>) -> (Lane, u32) {
        let mut lanes = self.lanes.lock().expect("lanes poisoned");
        let l = lanes.entry(id).or_default();
        if let Some(to) = to {
            l.lane = to;
        }
        let epoch = l.next_epoch;
        l.next_epoch = l.next_epoch.wrapping_add(1);
        (l.lane, epoch)
    }

    /// The lane messages to peer `id` take (shared until switched).
    pub(crate) fn lane(&self, id: u64) -> Lane {
        self.lanes
            .lock()
            .expect("lanes poisoned")
            .get(&id)
            .map_or(Lane::Shared, |l| l.lane)
    }

    /// After a lane's fence. On tcp, closing the socket while credit frames the receiver sent
    /// before it saw the fence sit unread would reset the connection, and a reset discards
    /// what the receiver has not read yet (the last messages and the fence). So the sender
    /// half-closes (the receiver reads everything, then the end) and keeps reading the
    /// stream until the receiver closes its end, here and in later sends, for up to the
    /// message timeout. Under dynamic lanes every transport's stream is read so, since the
    /// receiver may have answered a lane request on it before it saw the fence.
    fn retire(&self, conn: &OutConn, peer: u64) {
        let from = match &conn.io {
            // The receive poll reads the socket on (and shuts it once both lanes are over);
            // answers it reads come here until then.
            OutIo::TcpDuplex { duplex, .. } if self.dynamic.enabled() => {
                RetiringFrom::Duplex(duplex.clone())
            }
            OutIo::TcpDuplex { .. } => return,
            io => {
                let tcp = matches!(io, OutIo::Tcp);
                if !tcp && !self.dynamic.enabled() {
                    return;
                }
                if tcp {
                    let _ = conn.stream.shutdown(std::net::Shutdown::Write);
                }
                let Ok(stream) = conn.stream.try_clone() else {
                    return;
                };
                let _ = stream.set_nonblocking(true);
                RetiringFrom::Stream {
                    stream,
                    partial: conn.reverse.clone(),
                }
            }
        };
        self.retiring
            .lock()
            .expect("retiring poisoned")
            .push(Retiring {
                peer,
                from,
                give_up: Instant::now() + self.timeout,
                lanes: conn.lanes_in.clone(),
                open: true,
            });
        self.retiring_any.store(true, Ordering::Release);
    }

    /// Reads what fenced lanes received, closing each once its receiver closed it (or its
    /// time is up); lane messages read wait for the lanes driver.
    pub(super) fn drain_retiring(&self) {
        let mut r = self.retiring.lock().expect("retiring poisoned");
        let now = Instant::now();
        let mut scratch = [0u8; 256];
        let keep_lanes = self.dynamic.enabled();
        if r.iter()
            .any(|e| e.open && matches!(e.from, RetiringFrom::Duplex(_)))
        {
            // Their sockets are read by the receive poll.
            self.poke_if_idle();
        }
        for e in r.iter_mut().filter(|e| e.open) {
            match &mut e.from {
                RetiringFrom::Duplex(d) => {
                    d.take_answers(&mut e.lanes);
                    e.open = !d.closed() && now < e.give_up;
                }
                RetiringFrom::Stream { stream, partial } => {
                    e.open = loop {
                        match sockio::recv_nonblocking(stream.as_raw_fd(), &mut scratch) {
                            Ok(Some(n)) if n > 0 => partial.extend_from_slice(&scratch[..n]),
                            Ok(None) => break now < e.give_up,
                            _ => break false,
                        }
                    };
                    if let Err(err) = parse_back("", partial, true, &mut e.lanes) {
                        tracing::debug!(error = %err, "bad frame on a fenced lane");
                        partial.clear();
                        e.open = false;
                    }
                }
            }
            if !keep_lanes {
                e.lanes.clear();
            }
        }
        r.retain(|e| e.open || !e.lanes.is_empty());
        self.retiring_any.store(!r.is_empty(), Ordering::Release);
    }

    /// A connection to `peer` on `lane` over the transport the configuration picks.
    fn connect_lane(
        &self,
        engine: &dyn Peers,
        peer: &Arc<Peer>,
        l: (Lane, u32),
    ) -> Result<OutConn> {
        let tcp = match self.transport {
            TransportChoice::Tcp => true,
            // Auto takes shm on one host, verbs where both ends have them, else tcp.
            TransportChoice::Auto => {
                let shm = peer.same_host && self.shm_enabled;
                let rdma = self.verbs.is_ok() && !peer.descriptor().rdma.is_empty();
                !shm && !rdma
            }
            _ => false,
        };
        if tcp && l.0 == Lane::Dedicated {
            if let Some(c) = self.attach_reverse(peer, &engine.local_name(), l.1)? {
                return Ok(c);
            }
        }
        match self.transport {
            TransportChoice::Tcp => self.connect(engine, peer, MODE_TCP, l),
            TransportChoice::Rdma => self.connect_rdma(engine, peer, l),
            TransportChoice::Shm => {
                if !peer.same_host {
                    return Err(Error::TransportUnavailable {
                        transport: "shm",
                        reason: format!("segment {} is on another host", peer.name),
                    });
                }
                self.connect(engine, peer, MODE_SHM, l)
            }
            TransportChoice::Auto if peer.same_host && self.shm_enabled => {
                self.connect(engine, peer, MODE_SHM, l)
            }
            // Across hosts, verbs when both ends have RDMA, else (or if that fails) tcp.
            TransportChoice::Auto if self.verbs.is_ok() && !peer.descriptor().rdma.is_empty() => {
                match self.connect_rdma(engine, peer, l) {
                    Ok(c) => Ok(c),
                    Err(e) => {
                        tracing::warn!(peer = %peer.name, reason = %e, "messages cannot use rdma; using tcp");
                        self.connect(engine, peer, MODE_TCP, l)
                    }
                }
            }
            TransportChoice::Auto => self.connect(engine, peer, MODE_TCP, l),
        }
    }

    /// Our dedicated lane of `epoch` to `peer` on the socket of its dedicated lane to us, when
    /// there is one that carries no lane of ours yet (see `duplex`): its first frame says so,
    /// with our name `local_name`, which our other connections to `peer` carry too.
    /// `None` when there is none. Fails when the socket does.
    fn attach_reverse(
        &self,
        peer: &Arc<Peer>,
        local_name: &str,
        epoch: u32,
    ) -> Result<Option<OutConn>> {
        let rx = self.rx.lock().expect("rx poisoned");
        let Some((c, d)) = rx.conns.iter().find_map(|c| {
            let d = c.duplex.as_ref()?;
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
        d.control(&stream, &duplex::open_frame(epoch, local_name))
            .map_err(broken)?;
        tracing::debug!(peer = %peer.name, epoch, "dedicated lane on the peer's duplex connection");
        Ok(Some(OutConn {
            peer: peer.name.clone(),
            stream,
            credits: Credits::default(),
            // Told by the receiver's answer, before its first credits.
            max_len: 0,
            io: OutIo::TcpDuplex {
                duplex: d.clone(),
                seen: 0,
            },
            lane: Lane::Dedicated,
            retired: false,
            reverse: Vec::new(),
            lanes_in: Vec::new(),
            unread_sends: 0,
            credit_waits: 0,
        }))
    }

    /// Polls the receive side unless another thread is at it: what a sender waiting on a
    /// duplex lane needs read (credits, answers, its end) comes through there.
    pub(crate) fn poke(&self) {
        if let Ok(mut rx) = self.rx.try_lock() {
            self.poll(&mut rx);
        }
    }

    /// [`Messaging::poke`] for the background (the lanes driver): only when nobody polled
    /// since the last time it looked, so that it never takes the receive lock from an
    /// application polling it (which would then sleep on the lock, tens of µs).
    pub(super) fn poke_if_idle(&self) {
        let polls = self.polls.load(Ordering::Relaxed);
        if self.polls_seen.swap(polls, Ordering::Relaxed) == polls {
            self.poke();
        }
    }

    /// Moves messages to `segment` onto `lane`: a fence ends the current connection and the
    /// next message goes on a fresh one of that lane; the receiver delivers everything sent
    /// before the fence first. Nothing to do when the peer is on `lane` already. Fails when
    /// the new connection cannot be made (the next send then makes one on `lane`).
    pub(crate) fn switch_lane(
        &self,
        engine: &dyn Peers,
        segment: SegmentId,
        lane: Lane,
    ) -> Result<()> {
        self.move_lane(engine, segment, lane, false)
    }

    /// [`Messaging::switch_lane`]; with `again`, also when the peer is on `lane` already (a
    /// new connection of the same lane).
    pub(super) fn move_lane(
        &self,
        engine: &dyn Peers,
        segment: SegmentId,
        lane: Lane,
        again: bool,
    ) -> Result<()> {
        let peer = engine.peer(segment)?;
        loop {
            let current = self
                .out
                .lock()
                .expect("out poisoned")
                .get(&peer.id)
                .cloned();
            let Some(old) = current else {
                // Not connected: the next connection takes the lane.
                let mut lanes = self.lanes.lock().expect("lanes poisoned");
                lanes.entry(peer.id).or_default().lane = lane;
                return Ok(());
            };
            let mut g = old.lock().expect("message connection poisoned");
            if g.retired {
                // Another switch got here first: apply ours to what it made.
                continue;
            }
            if g.lane == lane && !again {
                return Ok(());
            }
            // The fence takes a credit like a message; on a connection that cannot take it
            // (broken), the receiver counts the connection's end as its fence.
            match g.send(MsgKind::Fence, &[], self.timeout, &|| self.poke()) {
                Ok(()) => self.retire(&g, peer.id),
                Err(e) => {
                    tracing::debug!(peer = %peer.name, error = %e, "no fence on a broken lane")
                }
            }
            g.retired = true;
            let next = self.next_lane(peer.id, Some(lane));
            let fresh = self.connect_lane(engine, &peer, next);
            let mut out = self.out.lock().expect("out poisoned");
            return match fresh {
                Ok(c) => {
                    out.insert(peer.id, Arc::new(Mutex::new(c)));
                    Ok(())
                }
                Err(e) => {
                    out.remove(&peer.id);
                    Err(e)
                }
            };
        }
    }

    /// Opens a message connection in `mode`, `extra` following the sender's name in the
    /// opening; returns the stream (its read timeout set for the rest of the opening) and the
    /// receiver's buffer size. Fails when the peer cannot be reached or refuses, with why.
    fn open(
        &self,
        engine: &dyn Peers,
        peer: &Arc<Peer>,
        mode: u8,
        (lane, epoch): (Lane, u32),
        extra: &[u8],
    ) -> Result<(TcpStream, usize)> {
        let unreachable = |e: std::io::Error| Error::SegmentUnreachable {
            name: peer.name.clone(),
            reason: format!("message connection: {e}"),
        };
        let mut stream =
            TcpStream::connect_timeout(&peer.addr, self.connect_timeout).map_err(unreachable)?;
        let _ = stream.set_nodelay(true);
        handshake::client(
            &stream,
            ConnKind::Message,
            &self.membership,
            &peer.name,
            self.connect_timeout,
        )?;
        stream
            .set_read_timeout(Some(OPEN_TIMEOUT))
            .map_err(unreachable)?;
        let name = engine.local_name();
        let mut open = vec![mode];
        open.extend_from_slice(&(name.len() as u16).to_le_bytes());
        open.extend_from_slice(name.as_bytes());
        open.push(lane_code(lane));
        open.extend_from_slice(&epoch.to_le_bytes());
        open.extend_from_slice(extra);
        stream.write_all(&open).map_err(unreachable)?;
        let mut status = [0u8; 1];
        stream.read_exact(&mut status).map_err(unreachable)?;
        if status[0] != 0 {
            let mut len = [0u8; 2];
            stream.read_exact(&mut len).map_err(unreachable)?;
            let mut reason = vec![0u8; u16::from_le_bytes(len) as usize];
            stream.read_exact(&mut reason).map_err(unreachable)?;
            return Err(Error::RemoteRejected {
                peer: peer.name.clone(),
                reason: String::from_utf8_lossy(&reason).into_owned(),
            });
        }
        let max_len = read_words(&mut stream, 1, 4).map_err(unreachable)?[0] as usize;
        Ok((stream, max_len))
    }

    /// A message connection over RDMA: a queue pair on the first pair of rails (local port,
    /// peer's rail) that connects, tried in the data path's pairing order. Fails when RDMA is
    /// off at either end, or no pair connects (with each pair's reason).
    pub(super) fn connect_rdma(
        &self,
        engine: &dyn Peers,
        peer: &Arc<Peer>,
        lane: (Lane, u32),
    ) -> Result<OutConn> {
        let unavailable = |reason: String| Error::TransportUnavailable {
            transport: "rdma",
            reason,
        };
        let verbs = self
            .verbs
            .as_ref()
            .map_err(|why| unavailable(why.clone()))?;
        let rails = peer.descriptor().rdma.clone();
        if rails.is_empty() {
            return Err(unavailable(format!(
                "segment {} has no RDMA device",
                peer.name
            )));
        }
        let pairs = verbs.pairs(&rails);
        if pairs.is_empty() {
            return Err(unavailable(format!(
                "no local RDMA port reaches a port of {}",
                peer.name
            )));
        }
        let mut failures = Vec::new();
        for (port, rail) in pairs {
            let (mut qp, end) = verbs.sending_qp(port, rail).map_err(unavailable)?;
            let pair = format!("{} -> {}", qp.rail(), rails[rail].name());
            let (mut stream, max_len) =
                match self.open(engine, peer, MODE_RDMA, lane, &end.encode()) {
                    Ok(o) => o,
                    // The receiver could not connect this pair: try the next.
                    Err(Error::RemoteRejected { reason, .. }) => {
                        failures.push(format!("{pair}: {reason}"));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
            let mut answer = [0u8; ENDPOINT_LEN];
            let connected = stream
                .read_exact(&mut answer)
                .map_err(|e| format!("reading the receiver's queue pair: {e}"))
                .and_then(|()| MessageEndpoint::decode(&answer))
                .and_then(|remote| qp.connect(&remote))
                .and_then(|()| stream.set_read_timeout(None).map_err(|e| e.to_string()));
            match connected {
                Ok(()) => {
                    tracing::debug!(peer = %peer.name, %pair, "messages over RDMA");
                    return Ok(OutConn {
                        peer: peer.name.clone(),
                        stream,
                        credits: Credits::default(),
                        max_len,
                        io: OutIo::Rdma {
                            qp: Box::new(qp),
                            seen: 0,
                            polls: 0,
                        },
                        lane: lane.0,
                        retired: false,
                        reverse: Vec::new(),
                        lanes_in: Vec::new(),
                        unread_sends: 0,
                        credit_waits: 0,
                    });
                }
                Err(e) => failures.push(format!("{pair}: {e}")),
            }
        }
        Err(Error::SegmentUnreachable {
            name: peer.name.clone(),
            reason: format!("no RDMA path carries messages ({})", failures.join("; ")),
        })
    }

    pub(super) fn connect(
        &self,
        engine: &dyn Peers,
        peer: &Arc<Peer>,
        mode: u8,
        lane: (Lane, u32),
    ) -> Result<OutConn> {
        let unreachable = |e: std::io::Error| Error::SegmentUnreachable {
            name: peer.name.clone(),
            reason: format!("message connection: {e}"),
        };
        let (mut stream, max_len) = self.open(engine, peer, mode, lane, &[])?;
        let p = &peer.name;
        let format = if mode == MODE_SHM {
            Some(read_words(&mut stream, 1, 1).map_err(unreachable)?[0] as u8)
        } else {
            None
        };
        let mut opener_reader = None;
        let io = if format.is_none() && lane.0 == Lane::Dedicated {
            // The receiver may start its own dedicated lane to us on this socket: our receive
            // poll reads it from now on (see `duplex`).
            let d = Duplex::new(true, max_len, self.dynamic.enabled());
            let reader = Reader {
                from: peer.name.as_str().into(),
                stream: stream.try_clone().map_err(unreachable)?,
                staging: duplex::staging(self.tcp.buffer_size),
                start: 0,
                end: 0,
                duplex: d.clone(),
                may_open: true,
                shut: false,
                _permit: None,
            };
            opener_reader = Some(reader);
            OutIo::TcpDuplex { duplex: d, seen: 0 }
        } else if format.is_none() {
            OutIo::Tcp
        } else if format == Some(SHM_SHARED_RING) {
            let (ring, tag, _maps) = connect_shared(&mut stream, peer)?;
            OutIo::ShmShared { ring, tag, _maps }
        } else if format != Some(SHM_OWN_RING) {
            return Err(protocol(p, format!("unknown shm answer format {format:?}")));
        } else {
            let v = read_words(&mut stream, 2, 4).map_err(unreachable)?;
            let (depth, per_chunk) = (v[0] as usize, v[1] as usize);
            let ring = read_words(&mut stream, 2, 8).map_err(unreachable)?;
            let nchunks = read_words(&mut stream, 1, 4).map_err(unreachable)?[0] as usize;
            if nchunks == 0 || nchunks > multirail_policy::receive::MAX_QUEUE_DEPTH {
                return Err(protocol(p, format!("{nchunks} receive chunks")));
            }
            let chunk_addrs = read_words(&mut stream, nchunks, 8).map_err(unreachable)?;
            let chunk_len = read_words(&mut stream, 1, 8).map_err(unreachable)?[0];
            if ring[1] < Ring::bytes(depth) as u64
                || chunk_len < (per_chunk * max_len) as u64
                || per_chunk == 0
            {
                return Err(protocol(p, "message ring or chunks too small"));
            }
            // The memfds of the ring and the chunks, as the receiver holds them now.
            let pid = read_words(&mut stream, 1, 4).map_err(unreachable)?[0] as u32;
            let fds = read_words(&mut stream, nchunks + 1, 4).map_err(unreachable)?;
            let mut maps = Vec::new();
            let mut map = |addr: u64, len: u64, fd: u64| -> Result<usize> {
                if peer.same_process {
                    return Ok(addr as usize);
                }
                let handle = crate::segment::ShmHandle {
                    pid,
                    fd: fd as u32 as i32,
                };
                let m = Arc::new(PeerMapping::open(&handle, len as usize)?);
                let base = m.base();
                maps.push(m);
                Ok(base)
            };
            let ring_base = map(ring[0], ring[1], fds[0])?;
            let chunks = chunk_addrs
                .iter()
                .zip(&fds[1..])
                .map(|(&a, &fd)| map(a, chunk_len, fd))
                .collect::<Result<Vec<_>>>()?;
            for &c in &chunks {
                populate(c as *mut u8, chunk_len as usize);
            }
            OutIo::Shm {
                // SAFETY: `ring_base` maps at least `Ring::bytes(depth)` bytes (checked above),
                // kept alive by `maps`.
                ring: unsafe { Ring::new(ring_base as *mut u8, depth) },
                chunks,
                per_chunk,
                buffer_size: max_len,
                tail: 0,
                _maps: maps,
            }
        };
        stream.set_read_timeout(None).map_err(unreachable)?;
        if let Some(r) = opener_reader {
            self.rx.lock().expect("rx poisoned").readers.push(r);
        }
        Ok(OutConn {
            peer: p.clone(),
            stream,
            credits: Credits::default(),
            max_len,
            io,
            lane: lane.0,
            retired: false,
            reverse: Vec::new(),
            lanes_in: Vec::new(),
            unread_sends: 0,
            credit_waits: 0,
        })
    }

    pub(crate) fn send(
        &self,
        engine: &dyn Peers,
        segment: SegmentId,
        kind: MsgKind,
        data: &[u8],
    ) -> Result<()> {
        if self.retiring_any.load(Ordering::Acquire) {
            self.drain_retiring();
        }
        let known = self
            .out
            .lock()
            .expect("out poisoned")
            .get(&segment.0)
            .cloned();
        let mut conn = match known {
            Some(c) => c,
            None => self.out_conn(engine, &engine.peer(segment)?)?,
        };
        let outcome = loop {
            let mut g = conn.lock().expect("message connection poisoned");
            if !g.retired && g.ended_by_peer() {
                // The other end fenced our duplex lane (with its own) or did not take it:
                // the message goes on a new connection, after what the lane carried.
                g.retired = true;
                self.retire(&g, segment.0);
                let mut out = self.out.lock().expect("out poisoned");
                if out.get(&segment.0).is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                    out.remove(&segment.0);
                }
            }
            if !g.retired {
                let sent = g.send(kind, data, self.timeout, &|| self.poke());
                if sent.is_err() && g.ended_by_peer() {
                    // Nothing was sent: go round again, onto the next connection.
                    continue;
                }
                if g.credit_waits > 0 {
                    let waits = std::mem::take(&mut g.credit_waits);
                    self.counters
                        .credit_waits
                        .fetch_add(waits, Ordering::Relaxed);
                }
                if !g.lanes_in.is_empty() && !self.retiring_any.load(Ordering::Acquire) {
                    // Answers this send read: hand them to the driver now, since a busy
                    // sender leaves it few chances to take the connection's lock. With no
                    // fenced lane still being read, nothing older can come after them.
                    self.park_answers(segment.0, &mut g.lanes_in);
                }
                break sent;
            }
            // A lane switch fenced this connection while we waited for it: its successor
            // carries the message, after everything the fence covers.
            drop(g);
            let current = self
                .out
                .lock()
                .expect("out poisoned")
                .get(&segment.0)
                .cloned();
            conn = match current {
                Some(c) => c,
                None => self.out_conn(engine, &engine.peer(segment)?)?,
            };
        };
        match &outcome {
            Err(Error::InvalidArgument { .. }) | Ok(()) => {}
            Err(_) => {
                // Broken: the next send connects again.
                let mut out = self.out.lock().expect("out poisoned");
                if out.get(&segment.0).is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                    out.remove(&segment.0);
                    drop(out);
                    self.reset_lane(segment.0);
                    self.dynamic.outgoing_gone(segment.0);
                }
            }
        }
        match &outcome {
            Ok(()) => {
                self.counters.sent.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .sent_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
            }
            Err(_) => {
                self.counters.send_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        if outcome.is_ok() && kind != MsgKind::Lane {
            self.dynamic.on_send(segment.0);
        }
        if kind == MsgKind::Message && self.after_reply_pending.load(Ordering::Relaxed) {
            self.release_after_reply();
        }
        outcome
    }
}

impl OutConn {
    /// Sends one frame of `kind` against a credit, waiting up to `timeout` for one; `poke`
    /// polls our receive side, which reads a duplex lane's credits. Fails on a timeout, a
    /// broken connection, bytes over the receiver's buffer size, and on a duplex lane the
    /// other end fenced or refused ([`OutConn::ended_by_peer`] says so: nothing was sent).
    pub(super) fn send(
        &mut self,
        kind: MsgKind,
        data: &[u8],
        timeout: Duration,
        poke: &dyn Fn(),
    ) -> Result<()> {
        let sent = self.send_inner(kind, data, timeout, poke);
        if sent.is_ok() && !matches!(self.io, OutIo::Tcp) {
            // Answers to lane requests come on the stream, which nothing else reads while
            // credits keep coming: look once in so many sends (one system call).
            self.unread_sends += 1;
            if self.unread_sends >= 256 {
                self.unread_sends = 0;
                // A broken stream shows at the next wait for credits or by the driver.
                let _ = self.read_back();
            }
        }
        if let (Err(e), OutIo::Rdma { qp, .. }) = (&sent, &mut self.io) {
            if !matches!(e, Error::InvalidArgument { .. }) {
                // The connection is dropped after this: do not wait for sends that cannot land.
                qp.abandon();
            }
        }
        sent
    }

    /// A duplex lane the other end fenced (it fenced its own) or never accepted: it takes no
    /// more messages, and the next go on a new connection.
    pub(super) fn ended_by_peer(&self) -> bool {
        match &self.io {
            OutIo::TcpDuplex { duplex, .. } => duplex.out_fenced() || duplex.refused(),
            _ => false,
        }
    }

    fn send_inner(
        &mut self,
        kind: MsgKind,
        data: &[u8],
        timeout: Duration,
        poke: &dyn Fn(),
    ) -> Result<()> {
        if let OutIo::TcpDuplex { duplex, .. } = &self.io {
            if kind == MsgKind::Fence {
                // Fences take no credit on a duplex lane: the other end may have stopped
                // granting (its own lane's fence came first).
                let d = duplex.clone();
                return d
                    .send_lane(&self.stream, kind, data)
                    .map(|_| ())
                    .map_err(|e| self.broken("fencing a lane", e));
            }
            if self.max_len == 0 {
                self.await_accept(timeout, poke)?;
            }
        }
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
        if let OutIo::ShmShared { .. } = self.io {
            return self.send_shared(kind, data, timeout);
        }
        let buf = self.credit(timeout, poke)?;
        match &mut self.io {
            OutIo::TcpDuplex { duplex, .. } => match duplex.send_lane(&self.stream, kind, data) {
                Ok(Sent::Written) => Ok(()),
                Ok(Sent::Fenced) => Err(self.broken("sending a message", "the lane was fenced")),
                Err(e) => Err(self.broken("sending a message", e)),
            },
            OutIo::Tcp => {
                let mut h = [0u8; MSG_HEADER_LEN];
                MsgHeader {
                    kind,
                    len: data.len() as u32,
                }
                .encode(&mut h);
                sockio::send_frame(self.stream.as_raw_fd(), &h, data).map_err(|e| {
                    Error::PeerDisconnected {
                        peer: self.peer.clone(),
                        reason: format!("sending a message: {e}"),
                    }
                })
            }
            OutIo::Rdma { qp, .. } => {
                qp.send(kind as u8, data, timeout)
                    .map_err(|reason| Error::PeerDisconnected {
                        peer: self.peer.clone(),
                        reason,
                    })
            }
            OutIo::Shm {
                ring,
                chunks,
                per_chunk,
                buffer_size,
                tail,
                ..
            } => {
                let i = buf.0 as usize;
                let (chunk, offset) = (i / *per_chunk, (i % *per_chunk) * *buffer_size);
                let Some(base) = chunks.get(chunk) else {
                    return Err(protocol(
                        &self.peer,
                        format!("granted buffer {i} out of range"),
                    ));
                };
                if data.len() <= INLINE_MAX {
                    ring.complete(*tail, buf, data.len(), kind as u8, Some(data));
                } else {
                    // SAFETY: the receiver granted us buffer `i`, inside a chunk we mapped
                    // whole; it reads the bytes only after the completion entry below is
                    // published.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            data.as_ptr(),
                            (*base + offset) as *mut u8,
                            data.len(),
                        )
                    };
                    ring.complete(*tail, buf, data.len(), kind as u8, None);
                }
                *tail += 1;
                Ok(())
            }
            OutIo::ShmShared { .. } => unreachable!("sent by send_shared"),
        }
    }

    /// Places a message in the receiver's shared ring, waiting while the ring is full (the
    /// receiver has not taken in what other senders wrote) for up to `timeout`. Fails on a
    /// timeout, when the receiver leaves while we wait, or when the ring refuses the message
    /// (its geometry does not fit what the receiver said).
    fn send_shared(&mut self, kind: MsgKind, data: &[u8], timeout: Duration) -> Result<()> {
        let mut start: Option<Instant> = None;
        let mut idle = 0u32;
        loop {
            let OutIo::ShmShared { ring, tag, .. } = &self.io else {
                unreachable!("called for the shared ring only");
            };
            match ring.try_send(*tag, kind as u8, data) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(protocol(&self.peer, e)),
            }
            if start.is_none() {
                self.credit_waits += 1;
            }
            let waited = start.get_or_insert_with(Instant::now).elapsed();
            if waited >= timeout {
                return Err(Error::Timeout {
                    peer: self.peer.clone(),
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            idle = idle.wrapping_add(1);
            if idle.is_multiple_of(256) {
                // A receiver that left never frees the ring: notice it (one system call).
                self.read_back()?;
            }
            if waited > SPIN && idle.is_multiple_of(16) {
                back_off(waited);
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn broken(&self, doing: &str, e: impl std::fmt::Display) -> Error {
        Error::PeerDisconnected {
            peer: self.peer.clone(),
            reason: format!("{doing}: {e}"),
        }
    }

    /// Waits for the other end of a duplex lane to accept it (its buffer size). Its receive
    /// poll reads the opening, so an application that does not poll for a while would hold
    /// our send: after [`ACCEPT_WAIT`] (or `timeout`, if shorter) we fence the lane instead
    /// and the message takes a connection of its own. Fails when the lane was refused,
    /// fenced (also by us, so), or the connection went away.
    fn await_accept(&mut self, timeout: Duration, poke: &dyn Fn()) -> Result<()> {
        let OutIo::TcpDuplex { duplex, .. } = &self.io else {
            return Ok(());
        };
        let d = duplex.clone();
        let timeout = timeout.min(ACCEPT_WAIT);
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            if let Some(n) = d.peer_max_len() {
                self.max_len = n;
                return Ok(());
            }
            if d.refused() || d.out_fenced() {
                return Err(self.broken("opening a lane", "the receiver did not take it"));
            }
            if d.closed() {
                return Err(self.broken("opening a lane", "the connection closed"));
            }
            poke();
            let waited = start.elapsed();
            if waited >= timeout {
                // A fence takes no credit: the other end closes the lane when it gets to it.
                d.send_lane(&self.stream, MsgKind::Fence, &[])
                    .map_err(|e| self.broken("leaving an unanswered lane", e))?;
                return Err(self.broken("opening a lane", "no answer in time"));
            }
            idle = idle.wrapping_add(1);
            if waited > SPIN && idle.is_multiple_of(16) {
                back_off(waited);
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// One credit, waiting for the receiver to grant one if none is in hand; `poke` polls our
    /// receive side (a duplex lane's credits come through it).
    pub(super) fn credit(&mut self, timeout: Duration, poke: &dyn Fn()) -> Result<BufferId> {
        if let Some(b) = self.credits.take() {
            return Ok(b);
        }
        self.credit_waits += 1;
        // The clock is read only once the credits in hand are spent.
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            self.collect_credits()?;
            if let Some(b) = self.credits.take() {
                return Ok(b);
            }
            if let OutIo::TcpDuplex { duplex, .. } = &self.io {
                if duplex.out_fenced() {
                    return Err(self.broken("waiting for a credit", "the lane was fenced"));
                }
                poke();
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::Timeout {
                    peer: self.peer.clone(),
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            idle = idle.wrapping_add(1);
            if waited > SPIN && idle.is_multiple_of(16) {
                back_off(waited);
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Reads what the receiver wrote back on the stream, without waiting: credits (tcp) and
    /// lane messages (into `lanes_in`). Fails when the receiver closed the stream or wrote a
    /// frame it may not.
    pub(super) fn read_back(&mut self) -> Result<()> {
        if let OutIo::TcpDuplex { duplex, .. } = &self.io {
            duplex.take_answers(&mut self.lanes_in);
            if duplex.closed() {
                return Err(Error::PeerDisconnected {
                    peer: self.peer.clone(),
                    reason: "the receiver closed the message connection".into(),
                });
            }
            return Ok(());
        }
        let mut b = [0u8; 256];
        match sockio::recv_nonblocking(self.stream.as_raw_fd(), &mut b) {
            Ok(None) => return Ok(()),
            Ok(Some(0)) => {
                return Err(Error::PeerDisconnected {
                    peer: self.peer.clone(),
                    reason: "the receiver closed the message connection".into(),
                })
            }
            Ok(Some(n)) => self.reverse.extend_from_slice(&b[..n]),
            Err(e) => return Err(Error::io("reading the message stream", e)),
        }
        let tcp = matches!(self.io, OutIo::Tcp);
        let granted = parse_back(&self.peer, &mut self.reverse, tcp, &mut self.lanes_in)?;
        self.take_credits(granted as u64)
    }

    /// Adds `n` credits the receiver granted. Fails when that puts more in hand than any
    /// receive queue holds (a broken or hostile receiver), instead of holding that many.
    fn take_credits(&mut self, n: u64) -> Result<()> {
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

    pub(super) fn collect_credits(&mut self) -> Result<()> {
        match &mut self.io {
            OutIo::Rdma { qp, seen, polls } => {
                let total = qp.granted();
                if total > *seen {
                    self.credits
                        .on_grant(std::iter::repeat_n(BufferId(0), (total - *seen) as usize));
                    *seen = total;
                    *polls = 0;
                    return Ok(());
                }
                // Waiting: now and then, see whether the receiver left or answered a lane
                // request (a system call).
                *polls += 1;
                if *polls % 256 == 0 {
                    self.read_back()?;
                }
            }
            OutIo::Tcp => self.read_back()?,
            OutIo::TcpDuplex { duplex, seen } => {
                let total = duplex.granted();
                let closed = duplex.closed();
                if total > *seen {
                    let n = total - *seen;
                    *seen = total;
                    self.take_credits(n)?;
                }
                if closed {
                    return Err(Error::PeerDisconnected {
                        peer: self.peer.clone(),
                        reason: "the receiver closed the message connection".into(),
                    });
                }
            }
            OutIo::Shm { ring, .. } => {
                let credits = &mut self.credits;
                ring.take_grants(|id| credits.on_grant([id]));
            }
            // The shared ring's space is the flow control: no credits come.
            OutIo::ShmShared { .. } => {}
        }
        Ok(())
    }
}
