//! The sending side of messages: one connection per peer, credits, and sending against them.

use super::*;

/// Our message connection to one peer: the lane its messages take now.
pub(super) struct OutConn {
    /// What every lane kind holds: the stream, credits, answers read.
    pub(super) link: Link,
    /// How the lane's kind sends.
    pub(super) io: Box<dyn SendLane>,
    pub(super) lane: Lane,
    /// Set once the connection's fence was sent: a sender that was waiting for it must take
    /// the peer's current connection instead.
    pub(super) retired: bool,
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
        if peer.process_exited() {
            // A new connection would reach whatever listens there now (a restarted process),
            // which this handle does not name: say so, as a transfer does.
            return Err(peer.exited_error("open the segment again"));
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
        let Some(from) = conn.io.retire(&conn.link, self.dynamic.enabled()) else {
            return;
        };
        self.retiring
            .lock()
            .expect("retiring poisoned")
            .push(Retiring {
                peer,
                from,
                give_up: Instant::now() + self.timeout,
                lanes: conn.link.lanes_in.clone(),
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
    pub(super) fn open(
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

    /// A message connection in `mode` (tcp or shm) to `peer` on `lane`: a dedicated tcp lane
    /// is a duplex socket our receive poll reads too (see `duplex`). Fails when the peer
    /// cannot be reached, refuses, or answers what the lane cannot use.
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
        let mut opener_reader = None;
        let io: Box<dyn SendLane> = if mode == MODE_SHM {
            connect_shm(&mut stream, peer, max_len)?
        } else if lane.0 == Lane::Dedicated {
            // The receiver may start its own dedicated lane to us on this socket: our receive
            // poll reads it from now on (see `duplex`).
            let (io, reader) = DuplexSend::opener(
                &peer.name,
                &stream,
                max_len,
                self.tcp.buffer_size,
                self.dynamic.enabled(),
            )
            .map_err(unreachable)?;
            opener_reader = Some(reader);
            Box::new(io)
        } else {
            Box::new(TcpSend)
        };
        stream.set_read_timeout(None).map_err(unreachable)?;
        if let Some(r) = opener_reader {
            self.rx.lock().expect("rx poisoned").readers.push(r);
        }
        let link = Link::new(peer.name.clone(), stream, max_len);
        Ok(OutConn::new(link, io, lane.0))
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
                if g.link.credit_waits > 0 {
                    let waits = std::mem::take(&mut g.link.credit_waits);
                    self.counters
                        .credit_waits
                        .fetch_add(waits, Ordering::Relaxed);
                }
                if !g.link.lanes_in.is_empty() && !self.retiring_any.load(Ordering::Acquire) {
                    // Answers this send read: hand them to the driver now, since a busy
                    // sender leaves it few chances to take the connection's lock. With no
                    // fenced lane still being read, nothing older can come after them.
                    self.park_answers(segment.0, &mut g.link.lanes_in);
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
    /// A connection on `lane` that `io` sends on.
    pub(super) fn new(link: Link, io: Box<dyn SendLane>, lane: Lane) -> OutConn {
        OutConn {
            link,
            io,
            lane,
            retired: false,
        }
    }

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
        let sent = self.io.send(&mut self.link, kind, data, timeout, poke);
        if sent.is_ok() && !self.io.answers_with_credits() {
            // Answers to lane requests come on the stream, which nothing else reads while
            // credits keep coming: look once in so many sends (one system call).
            self.link.unread_sends += 1;
            if self.link.unread_sends >= 256 {
                self.link.unread_sends = 0;
                // A broken stream shows at the next wait for credits or by the driver.
                let _ = self.read_back();
            }
        }
        if let Err(e) = &sent {
            if !matches!(e, Error::InvalidArgument { .. }) {
                // The connection is dropped after this: do not wait for sends that cannot land.
                self.io.abandon();
            }
        }
        sent
    }

    /// A duplex lane the other end fenced (it fenced its own) or never accepted: it takes no
    /// more messages, and the next go on a new connection.
    pub(super) fn ended_by_peer(&self) -> bool {
        self.io.ended_by_peer()
    }

    /// Reads what the receiver wrote back, without waiting: credits (tcp) and lane messages
    /// (into `lanes_in`). Fails when the receiver closed the stream or wrote a frame it may
    /// not.
    pub(super) fn read_back(&mut self) -> Result<()> {
        self.io.read_back(&mut self.link)
    }
}
