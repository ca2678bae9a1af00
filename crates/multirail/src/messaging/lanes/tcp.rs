//! The tcp lane: frames are an 8-byte header (length, kind) and the bytes, one `writev` per
//! message; credits come back on the same connection in 8-byte frames, batched (one frame when
//! the sender holds at most half its share). Under dynamic lanes the shared lane's connections
//! are watched by one epoll set ([`SharedTcp`]), so that a receive poll costs one system call
//! for all of them.

use crate::messaging::*;

/// The sending half of a tcp lane: everything goes on the stream.
pub(in crate::messaging) struct TcpSend;

impl SendLane for TcpSend {
    fn send(
        &mut self,
        link: &mut Link,
        kind: MsgKind,
        data: &[u8],
        timeout: Duration,
        poke: &dyn Fn(),
    ) -> Result<()> {
        link.check_len(data)?;
        credit(self, link, timeout, poke)?;
        let mut h = [0u8; MSG_HEADER_LEN];
        MsgHeader {
            kind,
            len: data.len() as u32,
        }
        .encode(&mut h);
        sockio::send_frame(link.stream.as_raw_fd(), &h, data).map_err(|e| Error::PeerDisconnected {
            peer: link.peer.clone(),
            reason: format!("sending a message: {e}"),
        })
    }

    fn collect_credits(&mut self, link: &mut Link) -> Result<()> {
        link.read_stream(true)
    }

    fn read_back(&mut self, link: &mut Link) -> Result<()> {
        link.read_stream(true)
    }

    fn answers_with_credits(&self) -> bool {
        true
    }

    /// Closing the socket while credit frames the receiver sent before it saw the fence sit
    /// unread would reset the connection, and a reset discards what the receiver has not read
    /// yet (the last messages and the fence). So the sender half-closes (the receiver reads
    /// everything, then the end) and reads on until the receiver closes its end.
    fn retire(&self, link: &Link, _dynamic: bool) -> Option<RetiringFrom> {
        let _ = link.stream.shutdown(std::net::Shutdown::Write);
        link.retiring_stream()
    }
}

/// What a receiver read of a tcp lane and has not taken in yet.
pub(in crate::messaging) struct Staging {
    pub(in crate::messaging) buf: Box<[u8]>,
    pub(in crate::messaging) start: usize,
    pub(in crate::messaging) end: usize,
}

impl Staging {
    /// Empty staging for frames of up to `buffer_size` bytes.
    pub(in crate::messaging) fn new(buffer_size: usize) -> Staging {
        Staging {
            buf: staging(buffer_size),
            start: 0,
            end: 0,
        }
    }
}

/// The receiving half of a plain tcp lane (a shared one; a dedicated one is a duplex lane).
pub(in crate::messaging) struct TcpRecv {
    pub(in crate::messaging) staging: Staging,
}

impl RecvLane for TcpRecv {
    fn receive(&mut self, cx: &mut RecvCx<'_>) -> std::result::Result<(), String> {
        receive_frames(&mut self.staging, None, cx)
    }

    fn grant(
        &mut self,
        stream: &TcpStream,
        buffers: &[BufferId],
    ) -> std::result::Result<(), String> {
        let h = frame_header(MsgKind::Credit, buffers.len() as u32);
        (&*stream).write_all(&h).map_err(|e| e.to_string())
    }

    fn reads_socket(&self) -> bool {
        true
    }
}

/// Reads what arrived on a tcp lane's socket and takes in its whole frames; `duplex` is the
/// socket's shared state when it may carry a lane of ours the other way, whose credits and
/// answers it holds and whose frames it takes here. Fails on a frame the sender may not send.
pub(in crate::messaging) fn receive_frames(
    s: &mut Staging,
    duplex: Option<&Duplex>,
    cx: &mut RecvCx<'_>,
) -> std::result::Result<(), String> {
    let max_len = cx.max_len() as u32;
    let Staging {
        buf: staging,
        start,
        end,
    } = s;
    if *start > 0 && staging.len() - *end < MSG_HEADER_LEN + max_len as usize {
        staging.copy_within(*start..*end, 0);
        *end -= *start;
        *start = 0;
    }
    if let Some(d) = duplex {
        // What the socket's writers could not write at once (see `duplex`).
        d.try_flush(cx.stream)
            .map_err(|e| format!("writing on a duplex lane: {e}"))?;
    }
    // A reverse opening leaves the lane's first frames staged: take them in first.
    let staged = *end > *start;
    let read = match sockio::recv_nonblocking(cx.stream.as_raw_fd(), &mut staging[*end..]) {
        // A peer that closes with our credits or answers unread resets instead of
        // ending: everything it wrote before was read first, so between frames that is
        // its end like any other (a process that exits or dies closes the same way).
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && start == end => {
            tracing::debug!(peer = %cx.from, "message connection reset between frames");
            Ok(Some(0))
        }
        read => read,
    };
    match read {
        Ok(None) if !staged => return Ok(()),
        Ok(None) => {}
        Ok(Some(0)) => {
            *cx.dead = true;
            *cx.ended = true;
            if let Some(d) = duplex {
                d.set_closed();
            }
            return if start == end {
                Ok(())
            } else {
                Err("closed inside a message".into())
            };
        }
        Ok(Some(n)) => *end += n,
        Err(e) => return Err(format!("reading messages: {e}")),
    }
    while *end - *start >= MSG_HEADER_LEN {
        let h = MsgHeader::decode(&staging[*start..*end], max_len)?;
        let total = MSG_HEADER_LEN + payload_len(&h);
        if *end - *start < total {
            break;
        }
        let body = &staging[*start + MSG_HEADER_LEN..*start + total];
        if let Some(d) = duplex {
            // Credits and answers for our lane the other way.
            d.on_piggyback(&staging[*start..]);
            if d.on_control(h, body)? {
                *start += total;
                continue;
            }
            if h.kind == MsgKind::Fence {
                // Fences take no credit here; the lane ends both ways (see `duplex`).
                if cx.fenced {
                    return Err("a second fence".into());
                }
                cx.fenced = true;
                d.fence_soon(cx.stream)
                    .map_err(|e| format!("fencing our lane: {e}"))?;
                *start += total;
                continue;
            }
        }
        match h.kind {
            MsgKind::Credit => return Err("a sender sent credits".into()),
            MsgKind::LaneAnswer
            | MsgKind::ReverseOpen
            | MsgKind::ReverseAccept
            | MsgKind::ReverseRefuse => return Err(format!("a sender sent a {:?} frame", h.kind)),
            _ => {}
        }
        cx.deliver(h.kind, None, Some(body), h.len as usize)?;
        *start += total;
    }
    if start == end {
        *start = 0;
        *end = 0;
    }
    Ok(())
}

/// Whether a frame of `kind` has a payload of `len` bytes to wait for (credits and reverse
/// accepts carry a count instead).
pub(in crate::messaging) fn payload_len(h: &MsgHeader) -> usize {
    match h.kind {
        MsgKind::Credit | MsgKind::ReverseAccept => 0,
        _ => h.len as usize,
    }
}

/// A frame header of `kind` with `len`.
pub(in crate::messaging) fn frame_header(kind: MsgKind, len: u32) -> [u8; MSG_HEADER_LEN] {
    let mut h = [0u8; MSG_HEADER_LEN];
    MsgHeader { kind, len }.encode(&mut h);
    h
}

/// Staging for a tcp socket's reads: room for two whole frames of `buffer_size` bytes.
pub(in crate::messaging) fn staging(buffer_size: usize) -> Box<[u8]> {
    vec![0u8; (64 << 10).max(2 * (MSG_HEADER_LEN + buffer_size))].into_boxed_slice()
}

/// The epoll set of the shared lane's tcp connections and its event buffer.
pub(in crate::messaging) struct SharedTcp {
    epoll: Epoll,
    events: Vec<EpollEvent>,
    /// Connections in the set: with none, a poll makes no system call for it.
    pub(in crate::messaging) watched: usize,
}

impl SharedTcp {
    /// An empty set. Fails when the kernel refuses an epoll instance.
    pub(in crate::messaging) fn new() -> std::io::Result<SharedTcp> {
        Ok(SharedTcp {
            epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?,
            events: vec![EpollEvent::empty(); 64],
            watched: 0,
        })
    }

    /// The ids of the connections with something to read (or an end).
    pub(in crate::messaging) fn ready(&mut self) -> impl Iterator<Item = u64> + '_ {
        let n = match self.epoll.wait(&mut self.events, EpollTimeout::ZERO) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(error = %e, "polling the shared lane");
                0
            }
        };
        self.events[..n].iter().map(EpollEvent::data)
    }

    /// Adds connection `c` when it is a tcp one on the shared lane; it is read when the set
    /// says so from now on.
    pub(in crate::messaging) fn watch(&mut self, c: &mut InConn) {
        if !(c.io.reads_socket() && c.lane == Lane::Shared) {
            return;
        }
        // Level-triggered: a connection with bytes left after a poll is reported again.
        let ev = EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP, c.id.0);
        match self.epoll.add(&c.stream, ev) {
            Ok(()) => {
                c.watched = true;
                self.watched += 1;
            }
            Err(e) => tracing::debug!(error = %e, "shared lane polled directly"),
        }
    }

    /// Takes a watched connection that goes out of the set.
    pub(in crate::messaging) fn unwatch(&mut self, c: &InConn) {
        let _ = self.epoll.delete(&c.stream);
        self.watched -= 1;
    }

    /// A second descriptor of the set. Fails when it cannot be duplicated.
    pub(in crate::messaging) fn fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        self.epoll.0.try_clone()
    }
}

impl Messaging {
    /// Target side of a tcp lane: a receive pool (the shared one, or one of its own for a
    /// dedicated lane, whose socket may carry our own dedicated lane back: see `duplex`),
    /// then credits. Refuses, telling the sender why, when the pool cannot be made.
    pub(in crate::messaging) fn accept_tcp(
        &self,
        stream: TcpStream,
        from: Arc<str>,
        lane: (Lane, u32),
        permit: ConnPermit,
    ) -> std::result::Result<(), String> {
        // Before the pool is made: failing here leaves no registered memory behind.
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(None).map_err(|e| e.to_string())?;
        let (id, key, settings, fresh) = match self.receive_pool(lane.0, self.tcp, SHARED_TCP) {
            Ok(p) => p,
            Err(e) => return Err(refuse(stream, e)),
        };
        let mut rx = self.rx.lock().expect("rx poisoned");
        self.keep_pool(&mut rx, key, fresh);
        let staging = Staging::new(settings.buffer_size);
        let io: Box<dyn RecvLane> = if lane.0 == Lane::Dedicated {
            // Our own dedicated lane to this sender may start on this socket (see `duplex`).
            Box::new(DuplexRecv {
                staging,
                duplex: Duplex::new(false, 0, self.dynamic.enabled()),
            })
        } else {
            Box::new(TcpRecv { staging })
        };
        let conn = InConn::new(id, from, key, stream, io, lane, Some(permit));
        self.admit(rx, conn, |_| Ok(Vec::new()))
    }
}
