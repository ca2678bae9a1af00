//! The shm lane with a ring of its own: the receive buffers are memfd-backed registered chunks
//! the sender maps; per connection a ring region (`ring`) holds the grant ring (buffer ids the
//! receiver posted for this sender) and the completion ring (buffer id, length, kind of each
//! message written). Both sides poll; the TCP connection stays open only to notice the sender
//! leaving (and, under dynamic lanes, to carry lane answers back).

use crate::messaging::*;

/// The opening answer's first byte for shm: the sender's own ring and buffers follow.
pub(in crate::messaging) const SHM_OWN_RING: u8 = 0;
/// The opening answer's first byte for shm: the shared ring follows (see `shared_shm`).
pub(in crate::messaging) const SHM_SHARED_RING: u8 = 1;

/// The sending half of an shm lane: writes into the receive buffers granted to it.
pub(in crate::messaging) struct ShmSend {
    ring: Ring,
    /// Base address of each receive chunk in this process.
    chunks: Vec<usize>,
    per_chunk: usize,
    buffer_size: usize,
    /// Next completion slot.
    tail: u64,
    /// The receiver's doorbell eventfd, when it could be fetched (see `doorbell`).
    bell: Option<std::os::fd::OwnedFd>,
    _maps: Vec<Arc<PeerMapping>>,
}

impl SendLane for ShmSend {
    fn send(
        &mut self,
        link: &mut Link,
        kind: MsgKind,
        data: &[u8],
        timeout: Duration,
        poke: &dyn Fn(),
    ) -> Result<()> {
        link.check_len(data)?;
        let buf = credit(self, link, timeout, poke)?;
        let i = buf.0 as usize;
        let (chunk, offset) = (i / self.per_chunk, (i % self.per_chunk) * self.buffer_size);
        let Some(base) = self.chunks.get(chunk) else {
            return Err(protocol(
                &link.peer,
                format!("granted buffer {i} out of range"),
            ));
        };
        if data.len() <= INLINE_MAX {
            self.ring
                .complete(self.tail, buf, data.len(), kind as u8, Some(data));
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
            self.ring
                .complete(self.tail, buf, data.len(), kind as u8, None);
        }
        self.tail += 1;
        self.ring.wake_receiver(&link.stream, self.bell.as_ref());
        Ok(())
    }

    fn collect_credits(&mut self, link: &mut Link) -> Result<()> {
        let credits = &mut link.credits;
        self.ring.take_grants(|id| credits.on_grant([id]));
        Ok(())
    }
}

/// Sender side: reads the rest of an shm opening answer (its format byte, then what that
/// format says) and maps the receiver's memory. Fails when the answer is short or
/// inconsistent, or the memory cannot be mapped.
pub(in crate::messaging) fn connect_shm(
    stream: &mut TcpStream,
    peer: &Peer,
    max_len: usize,
) -> Result<Box<dyn SendLane>> {
    let unreachable = |e: std::io::Error| Error::SegmentUnreachable {
        name: peer.name.clone(),
        reason: format!("message connection: {e}"),
    };
    let p = &peer.name;
    let format = read_words(stream, 1, 1).map_err(unreachable)?[0] as u8;
    if format == SHM_SHARED_RING {
        return Ok(Box::new(connect_shared(stream, peer)?));
    }
    if format != SHM_OWN_RING {
        return Err(protocol(
            p,
            format!("unknown shm answer format {:?}", Some(format)),
        ));
    }
    let v = read_words(stream, 2, 4).map_err(unreachable)?;
    let (depth, per_chunk) = (v[0] as usize, v[1] as usize);
    let ring = read_words(stream, 2, 8).map_err(unreachable)?;
    let nchunks = read_words(stream, 1, 4).map_err(unreachable)?[0] as usize;
    if nchunks == 0 || nchunks > multirail_policy::receive::MAX_QUEUE_DEPTH {
        return Err(protocol(p, format!("{nchunks} receive chunks")));
    }
    let chunk_addrs = read_words(stream, nchunks, 8).map_err(unreachable)?;
    let chunk_len = read_words(stream, 1, 8).map_err(unreachable)?[0];
    if ring[1] < Ring::bytes(depth) as u64
        || chunk_len < (per_chunk * max_len) as u64
        || per_chunk == 0
    {
        return Err(protocol(p, "message ring or chunks too small"));
    }
    // The memfds of the ring and the chunks, as the receiver holds them now.
    let pid = read_words(stream, 1, 4).map_err(unreachable)?[0] as u32;
    let fds = read_words(stream, nchunks + 1, 4).map_err(unreachable)?;
    let bell = read_words(stream, 1, 4).map_err(unreachable)?[0] as u32;
    let bell = doorbell::fetch_bell(pid, bell);
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
    Ok(Box::new(ShmSend {
        // SAFETY: `ring_base` maps at least `Ring::bytes(depth)` bytes (checked above),
        // kept alive by `maps`.
        ring: unsafe { Ring::new(ring_base as *mut u8, depth) },
        chunks,
        per_chunk,
        buffer_size: max_len,
        tail: 0,
        bell,
        _maps: maps,
    }))
}

/// The receiving half of an shm lane: its ring and the memory holding it.
pub(in crate::messaging) struct ShmRecv {
    ring: Ring,
    ring_buf: Buffer,
}

/// Takes in every completion the ring holds.
fn take_completions(ring: &mut Ring, cx: &mut RecvCx<'_>) -> std::result::Result<(), String> {
    let max_len = cx.max_len();
    ring.completions(|buf, len, kind: u8, inline: Option<&[u8]>| {
        let kind = arrived_kind(kind.into(), len, max_len)?;
        cx.deliver(kind, Some(buf), inline, len)
    })
}

impl RecvLane for ShmRecv {
    fn receive(&mut self, cx: &mut RecvCx<'_>) -> std::result::Result<(), String> {
        take_completions(&mut self.ring, cx)?;
        // Only while waiting (or after a fence): a syscall every so many polls would show
        // up as a periodic pattern in the round trips (pingpong found one every ~4096).
        if cx.liveness || cx.fenced {
            // Doorbell bytes (see `doorbell`) are drained on the way.
            if doorbell::drain_stream(cx.stream) {
                // Gone. What it wrote before closing may have landed after the pass
                // above: take it in now, then the connection ends.
                take_completions(&mut self.ring, cx)?;
                *cx.dead = true;
            }
        }
        Ok(())
    }

    fn grant(
        &mut self,
        _stream: &TcpStream,
        buffers: &[BufferId],
    ) -> std::result::Result<(), String> {
        self.ring.post(buffers);
        Ok(())
    }

    fn ring_bytes(&self) -> u64 {
        self.ring_buf.len() as u64
    }

    fn set_asleep(&self, asleep: bool) {
        self.ring.set_asleep(asleep);
    }

    fn release(&self, registry: &MemoryRegistry, _shared: Option<&mut SharedShm>) {
        let _ = registry.unregister(self.ring_buf.addr());
    }
}

impl Messaging {
    /// Target side of an shm lane with a ring of its own: the receive pool (the shared one
    /// for a shared lane when the configuration says so, else one of its own), the ring, and
    /// the answer telling the sender how to map both. Refuses, telling the sender why, when
    /// the memory cannot be made.
    pub(in crate::messaging) fn accept_shm(
        &self,
        stream: TcpStream,
        from: Arc<str>,
        lane: (Lane, u32),
        permit: ConnPermit,
    ) -> std::result::Result<(), String> {
        // What can fail without a pool or ring to give back goes first.
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(None).map_err(|e| e.to_string())?;
        let (id, key, settings, fresh) = match self.receive_pool(lane.0, self.shm, SHARED_SHM) {
            Ok(p) => p,
            Err(e) => return Err(refuse(stream, e)),
        };
        let ring_buf = match self
            .registry
            .allocate(Ring::bytes(settings.queue_depth), Location::Any)
        {
            Ok(b) => b,
            Err(e) => {
                // A pool made for this connection alone is registered memory: give it back.
                if let Some(p) = fresh {
                    p.release(&self.registry);
                }
                return Err(refuse(stream, format!("message ring: {e}")));
            }
        };
        let mut rx = self.rx.lock().expect("rx poisoned");
        self.keep_pool(&mut rx, key, fresh);
        let (ring_addr, ring_len, ring_handle) =
            (ring_buf.addr(), ring_buf.len(), ring_buf.shm_handle());
        let io = ShmRecv {
            // SAFETY: a fresh zeroed mapping of `Ring::bytes(depth)` bytes, kept alive by
            // `ring_buf` beside it.
            ring: unsafe { Ring::new(ring_buf.as_ptr(), settings.queue_depth) },
            ring_buf,
        };
        let conn = InConn::new(id, from, key, stream, Box::new(io), lane, Some(permit));
        self.admit(rx, conn, |pool| {
            let mut reply = vec![SHM_OWN_RING];
            reply.extend_from_slice(&(settings.queue_depth as u32).to_le_bytes());
            reply.extend_from_slice(&(settings.buffers_per_chunk() as u32).to_le_bytes());
            reply.extend_from_slice(&ring_addr.to_le_bytes());
            reply.extend_from_slice(&(ring_len as u64).to_le_bytes());
            reply.extend_from_slice(&(pool.chunks.len() as u32).to_le_bytes());
            for c in &pool.chunks {
                reply.extend_from_slice(&c.addr().to_le_bytes());
            }
            reply.extend_from_slice(&(settings.chunk_bytes() as u64).to_le_bytes());
            // How to map them, from the memory itself: a descriptor the sender cached may
            // name a buffer freed since, whose address (and descriptor number) was reused.
            let handles = std::iter::once(ring_handle)
                .chain(pool.chunks.iter().map(Buffer::shm_handle))
                .collect::<Option<Vec<_>>>()
                .ok_or("receive buffers are not in shared memory")?;
            reply.extend_from_slice(&handles[0].pid.to_le_bytes());
            for h in &handles {
                reply.extend_from_slice(&(h.fd as u32).to_le_bytes());
            }
            // The doorbell's eventfd, which the sender fetches from this process.
            reply.extend_from_slice(&self.bell.fd_number().to_le_bytes());
            Ok(reply)
        })
    }
}
