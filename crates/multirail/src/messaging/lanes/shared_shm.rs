//! The shared lane over shm under dynamic lanes: one multi-producer ring per receiving engine
//! ([`SharedRing`]) that every sender on the lane writes into by an atomic reservation, instead
//! of a ring and credits per sender. Its memory is the same whatever the number of senders, and
//! a sender that sends now and then holds nothing while it is quiet, so nothing it holds can
//! keep busy senders waiting.
//!
//! Each sender on the lane is told a tag (its intent word in the ring) when its connection is
//! accepted; its records carry the tag, so the receiver hands them to that connection's
//! ordering (fences, held-back lanes) like any other lane's. The stream of the connection stays
//! open to notice the sender leaving and to carry lane answers back.

use super::shared_ring::{self, SharedRing};
use crate::messaging::*;

/// Senders the shared ring has intent words for; one more on the lane is refused.
pub(in crate::messaging) const SHARED_SENDERS: usize = 1024;
/// Records taken from the ring in one poll: a bound on what one poll copies onto the heap.
const RECORDS_PER_POLL: usize = 256;
/// How long the ring's head may wait on a reservation that a gone sender made before it is
/// skipped. A live sender publishes within microseconds of reserving; this only guards the
/// case where a gone sender's last reservation attempt lost its race to a live sender that is
/// still writing the record.
const ABANDONED_AFTER: Duration = Duration::from_millis(20);

/// The sending half of the shared shm lane: the receiver's shared ring, written under `tag`.
pub(in crate::messaging) struct SharedShmSend {
    pub(in crate::messaging) ring: SharedRing,
    pub(in crate::messaging) tag: u32,
    /// The receiver's doorbell eventfd, when it could be fetched (see `doorbell`).
    pub(in crate::messaging) bell: Option<std::os::fd::OwnedFd>,
    pub(in crate::messaging) _maps: Vec<Arc<PeerMapping>>,
}

impl SendLane for SharedShmSend {
    /// Places a message in the receiver's shared ring, waiting while the ring is full (the
    /// receiver has not taken in what other senders wrote) for up to `timeout`. Fails on a
    /// timeout, when the receiver leaves while we wait, or when the ring refuses the message
    /// (its geometry does not fit what the receiver said).
    fn send(
        &mut self,
        link: &mut Link,
        kind: MsgKind,
        data: &[u8],
        timeout: Duration,
        _poke: &dyn Fn(),
    ) -> Result<()> {
        link.check_len(data)?;
        let mut start: Option<Instant> = None;
        let mut idle = 0u32;
        loop {
            match self.ring.try_send(self.tag, kind as u8, data) {
                Ok(true) => {
                    self.ring.wake_receiver(&link.stream, self.bell.as_ref());
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => return Err(protocol(&link.peer, e)),
            }
            if start.is_none() {
                link.credit_waits += 1;
            }
            let waited = start.get_or_insert_with(Instant::now).elapsed();
            if waited >= timeout {
                return Err(link.timed_out(timeout));
            }
            idle = idle.wrapping_add(1);
            if idle.is_multiple_of(256) {
                // A receiver that left never frees the ring: notice it (one system call).
                self.read_back(link)?;
            }
            if waited > SPIN && idle.is_multiple_of(16) {
                back_off(waited);
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// The shared ring's space is the flow control: no credits come.
    fn collect_credits(&mut self, _link: &mut Link) -> Result<()> {
        Ok(())
    }
}

/// The receiving half of the shared shm lane: what comes under the sender's tag is taken in
/// from the receiver's one ring by [`poll_shared`]; the stream only tells when the sender
/// leaves and carries lane answers back.
pub(in crate::messaging) struct SharedShmRecv {
    tag: u32,
    /// Which ring the tag is in (a corrupt ring is replaced by a new one).
    generation: u32,
    /// The ring's reservation count when the sender was seen gone: once the receiver has
    /// taken in that much, nothing more of this sender's can come.
    closing_at: Option<u64>,
}

impl RecvLane for SharedShmRecv {
    /// Taken in from the shared ring by [`poll_shared`].
    fn receive(&mut self, _cx: &mut RecvCx<'_>) -> std::result::Result<(), String> {
        Ok(())
    }

    /// The shared ring's space is its flow control: it takes no credits.
    fn grant(
        &mut self,
        _stream: &TcpStream,
        _buffers: &[BufferId],
    ) -> std::result::Result<(), String> {
        Ok(())
    }

    fn polled_alone(&self) -> bool {
        false
    }

    /// The tag goes back to the ring it came from.
    fn release(&self, _registry: &MemoryRegistry, shared: Option<&mut SharedShm>) {
        if let Some(s) = shared {
            if s.generation == self.generation {
                s.release(self.tag);
            }
        }
    }
}

/// Connection `c`'s lane when it is on the shared ring.
fn of_ring(c: &InConn) -> Option<&SharedShmRecv> {
    (&*c.io as &dyn std::any::Any).downcast_ref::<SharedShmRecv>()
}

/// The receiver's shared ring and who writes into it.
pub(in crate::messaging) struct SharedShm {
    ring: SharedRing,
    /// The ring's memory, a memfd every sender on the lane maps.
    buf: Buffer,
    /// Tells this ring from one made after it (a ring found corrupt is replaced).
    generation: u32,
    /// The connection holding each tag, with where it sat in `Rx::conns` when last looked up.
    tags: Vec<Option<(ConnId, usize)>>,
    /// Tags free to hand out.
    free: Vec<u32>,
    /// Tags of connections that are gone, free again once the head passes the reservation
    /// count noted (a sender that has not yet noticed its end may still write under its tag).
    quarantined: Vec<(u32, u64)>,
    /// Connections whose sender was seen gone and whose last records are still to be taken in.
    closing: usize,
    /// Since when the head has waited on an unpublished record while a sender is gone.
    stuck_since: Option<Instant>,
}

impl SharedShm {
    /// A ring for the lane, sized by the shm receive settings (queue depth × buffer size).
    /// Fails when the memory cannot be allocated.
    fn new(registry: &MemoryRegistry, settings: &ReceiveSettings, generation: u32) -> Result<Self> {
        let units = shared_ring::units_for(settings.queue_depth, settings.buffer_size);
        let buf = registry.allocate(SharedRing::bytes(units, SHARED_SENDERS), Location::Any)?;
        populate(buf.as_ptr(), buf.len());
        // SAFETY: a fresh zeroed, page-aligned mapping of `SharedRing::bytes(units, senders)`
        // bytes, kept mapped by `buf` beside the ring for the ring's whole life.
        let ring = unsafe { SharedRing::new(buf.as_ptr(), units, SHARED_SENDERS) };
        Ok(SharedShm {
            ring,
            buf,
            generation,
            tags: vec![None; SHARED_SENDERS],
            free: (0..SHARED_SENDERS as u32).rev().collect(),
            quarantined: Vec::new(),
            closing: 0,
            stuck_since: None,
        })
    }

    /// Sets (or clears) the ring's sleeping flag (see `doorbell`).
    pub(in crate::messaging) fn set_asleep(&self, asleep: bool) {
        self.ring.set_asleep(asleep);
    }

    /// Bytes of receive memory the lane takes.
    pub(in crate::messaging) fn bytes(&self) -> u64 {
        self.buf.len() as u64
    }

    /// What the opening answer carries after the format byte: the sender's tag, the ring's
    /// geometry and bytes, and how to map it. Fails when the ring is not in shared memory.
    fn opening_details(&self, tag: u32, bell: u32) -> std::result::Result<Vec<u8>, String> {
        let h = self
            .buf
            .shm_handle()
            .ok_or("the shared ring is not in shared memory")?;
        let mut r = vec![SHM_SHARED_RING];
        r.extend_from_slice(&tag.to_le_bytes());
        r.extend_from_slice(&(self.ring.units() as u32).to_le_bytes());
        r.extend_from_slice(&(SHARED_SENDERS as u32).to_le_bytes());
        r.extend_from_slice(&(self.buf.len() as u64).to_le_bytes());
        r.extend_from_slice(&h.pid.to_le_bytes());
        r.extend_from_slice(&(h.fd as u32).to_le_bytes());
        // The doorbell's eventfd, which the sender fetches from this process.
        r.extend_from_slice(&bell.to_le_bytes());
        Ok(r)
    }

    /// The tag of a connection that is gone: handed out again once nothing it may have
    /// reserved is left in the ring.
    fn release(&mut self, tag: u32) {
        if let Some(t) = self.tags.get_mut(tag as usize) {
            *t = None;
            self.quarantined.push((tag, self.ring.reserved()));
        }
    }

    fn reclaim_tags(&mut self) {
        if self.quarantined.is_empty() {
            return;
        }
        let head = self.ring.consumed();
        let (ring, free) = (&self.ring, &mut self.free);
        self.quarantined.retain(|&(tag, until)| {
            if head < until {
                return true;
            }
            ring.clear_intent(tag);
            free.push(tag);
            false
        });
    }
}

impl Messaging {
    /// Target side of a shm connection on the shared lane under dynamic lanes: hands the
    /// sender a tag in the shared ring (making the ring first if this is the lane's first
    /// sender). Refuses, telling the sender why, when the ring cannot be made or every tag is
    /// taken.
    pub(in crate::messaging) fn accept_shared_shm(
        &self,
        stream: TcpStream,
        from: Arc<str>,
        lane: (Lane, u32),
        permit: ConnPermit,
    ) -> std::result::Result<(), String> {
        let exists = self.rx.lock().expect("rx poisoned").shared_shm.is_some();
        // Allocate outside the lock; a ring made twice by a race is dropped again.
        let fresh = if exists {
            None
        } else {
            match SharedShm::new(&self.registry, &self.shm, 0) {
                Ok(s) => Some(s),
                Err(e) => return Err(refuse(stream, format!("shared message ring: {e}"))),
            }
        };
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(None).map_err(|e| e.to_string())?;
        let mut rx = self.rx.lock().expect("rx poisoned");
        if let Some(mut f) = fresh {
            match &rx.shared_shm {
                Some(_) => {
                    let _ = self.registry.unregister(f.buf.addr());
                }
                None => {
                    f.generation = rx.shared_shm_generation;
                    rx.shared_shm_generation = rx.shared_shm_generation.wrapping_add(1);
                    rx.shared_shm = Some(f);
                }
            }
        }
        let shared = rx.shared_shm.as_mut().expect("made above");
        shared.reclaim_tags();
        let Some(tag) = shared.free.pop() else {
            drop(rx);
            return Err(refuse(
                stream,
                format!("the shared lane has {SHARED_SENDERS} senders already"),
            ));
        };
        let answer = shared
            .opening_details(tag, self.bell.fd_number())
            .and_then(|details| {
                let mut reply = vec![0u8];
                reply.extend_from_slice(&(self.shm.buffer_size as u32).to_le_bytes());
                reply.extend_from_slice(&details);
                (&stream)
                    .write_all(&reply)
                    .map_err(|e| format!("answering message opening: {e}"))
            });
        if let Err(e) = answer {
            shared.free.push(tag);
            drop(rx);
            return Err(refuse(stream, e));
        }
        let id = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        shared.tags[tag as usize] = Some((id, usize::MAX));
        let io = SharedShmRecv {
            tag,
            generation: shared.generation,
            closing_at: None,
        };
        rx.add_conn(InConn::new(
            id,
            from,
            SHARED_SHM,
            stream,
            Box::new(io),
            lane,
            Some(permit),
        ));
        // A receiver asleep on the doorbell does not watch the new connection (or ring) yet.
        self.bell.ring_local();
        Ok(())
    }
}

/// Takes in what the shared ring holds, hands each record to its sender's connection, ends the
/// connections of senders that left once everything they wrote is in, and skips a reservation
/// a gone sender never wrote. `liveness` also checks every sender's stream for its end.
/// Returns true when a connection was fenced or ended (the lanes need settling). A corrupt ring
/// ends every connection on it and is dropped (the next sender gets a fresh one; senders map
/// the memory themselves, so it goes only once they are gone).
pub(in crate::messaging) fn poll_shared(
    slot: &mut Option<SharedShm>,
    registry: &MemoryRegistry,
    conns: &mut [InConn],
    delivered: &mut Delivered,
    liveness: bool,
    max_len: usize,
) -> bool {
    let Some(shared) = slot.as_mut() else {
        return false;
    };
    let mut dirty = false;
    let SharedShm { ring, tags, .. } = shared;
    let polled = ring.poll(RECORDS_PER_POLL, |tag, kind, bytes| {
        let Some(Some((id, at))) = tags.get_mut(tag as usize) else {
            tracing::debug!(tag, "a record under a tag no connection holds");
            return Ok::<(), std::convert::Infallible>(());
        };
        if conns.get(*at).is_none_or(|c| c.id != *id) {
            match conns.iter().position(|c| c.id == *id) {
                Some(i) => *at = i,
                None => return Ok(()),
            }
        }
        let c = &mut conns[*at];
        if c.dead {
            return Ok(());
        }
        let taken = arrived_kind(kind.into(), bytes.len(), max_len).and_then(|kind| {
            if c.fenced {
                return Err("a message after the lane's fence".to_owned());
            }
            take_in_bytes(&c.from, kind, bytes, c.held_back.then_some(c.id), delivered)
        });
        match taken {
            Ok(fence) => {
                c.fenced |= fence;
                dirty |= fence;
            }
            Err(reason) => {
                tracing::warn!(peer = %c.from, %reason, "closed message connection");
                c.dead = true;
                dirty = true;
            }
        }
        Ok(())
    });
    if let Err(e) = polled {
        tracing::error!(error = %e, "the shared message ring is corrupt; closing its senders");
        let generation = shared.generation;
        for c in conns.iter_mut() {
            if of_ring(c).is_some_and(|r| r.generation == generation) {
                c.dead = true;
            }
        }
        if let Some(s) = slot.take() {
            let _ = registry.unregister(s.buf.addr());
        }
        return true;
    }
    if liveness {
        for c in conns.iter_mut().filter(|c| !c.dead) {
            let InConn { io, stream, .. } = c;
            if let Some(SharedShmRecv {
                closing_at: closing @ None,
                ..
            }) = (&mut **io as &mut dyn std::any::Any).downcast_mut::<SharedShmRecv>()
            {
                // Doorbell bytes are drained on the way.
                if doorbell::drain_stream(stream) {
                    // Gone: whatever it reserved before now is in the ring or never will be.
                    *closing = Some(shared.ring.reserved());
                    shared.closing += 1;
                }
            }
        }
    }
    if shared.closing > 0 {
        dirty |= end_gone_senders(shared, conns);
    }
    shared.reclaim_tags();
    dirty
}

/// Ends the connections of gone senders whose records are all taken in; when the head waits on
/// a record nobody publishes, skips the reservation of a gone sender that covers it.
fn end_gone_senders(shared: &mut SharedShm, conns: &mut [InConn]) -> bool {
    let head = shared.ring.consumed();
    let mut ended = false;
    let mut waiting: Vec<u32> = Vec::new();
    for c in conns.iter_mut().filter(|c| !c.dead) {
        if let Some(&SharedShmRecv {
            tag,
            closing_at: Some(at),
            ..
        }) = of_ring(c)
        {
            if head >= at {
                c.dead = true;
                ended = true;
                shared.closing -= 1;
            } else {
                waiting.push(tag);
            }
        }
    }
    if waiting.is_empty() || !shared.ring.stalled() {
        shared.stuck_since = None;
        return ended;
    }
    let since = *shared.stuck_since.get_or_insert_with(Instant::now);
    if since.elapsed() < ABANDONED_AFTER {
        return ended;
    }
    for tag in waiting {
        if shared.ring.skip_abandoned(tag) {
            tracing::warn!(
                tag,
                "skipped a record a gone sender reserved and never wrote"
            );
            shared.stuck_since = None;
            break;
        }
    }
    ended
}

/// Sender side: reads the rest of a shm opening answer that names the shared ring (after its
/// format byte) and maps the ring. Fails when the answer is short or inconsistent, or the ring
/// cannot be mapped.
pub(in crate::messaging) fn connect_shared(
    stream: &mut TcpStream,
    peer: &Peer,
) -> Result<SharedShmSend> {
    let unreachable = |e: std::io::Error| Error::SegmentUnreachable {
        name: peer.name.clone(),
        reason: format!("message connection: {e}"),
    };
    let v = read_words(stream, 3, 4).map_err(unreachable)?;
    let (tag, units, senders) = (v[0] as u32, v[1] as usize, v[2] as usize);
    let len = read_words(stream, 1, 8).map_err(unreachable)?[0] as usize;
    let h = read_words(stream, 3, 4).map_err(unreachable)?;
    let valid = units.is_power_of_two()
        && units <= shared_ring::MAX_UNITS
        && senders <= SHARED_SENDERS
        && (tag as usize) < senders
        && len >= SharedRing::bytes(units, senders);
    if !valid {
        return Err(protocol(
            &peer.name,
            format!("shared ring of {units} units, {senders} senders, {len} bytes, tag {tag}"),
        ));
    }
    // Mapped anew even when the receiver is in this process: senders write into the ring
    // whenever it has room, so their mapping must outlive the receiving engine's.
    let handle = crate::segment::ShmHandle {
        pid: h[0] as u32,
        fd: h[1] as u32 as i32,
    };
    let m = Arc::new(PeerMapping::open(&handle, len)?);
    // SAFETY: the mapping holds `len >= SharedRing::bytes(units, senders)` bytes (checked
    // above) of the receiver's ring, page-aligned, and stays mapped while `m`, returned with
    // the ring, lives.
    let ring = unsafe { SharedRing::new(m.base() as *mut u8, units, senders) };
    Ok(SharedShmSend {
        ring,
        tag,
        bell: doorbell::fetch_bell(handle.pid, h[2] as u32),
        _maps: vec![m],
    })
}
