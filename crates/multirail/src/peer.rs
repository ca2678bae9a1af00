//! What the engine keeps about an opened segment: its descriptor (cached, refetched when a target
//! address is not in it) and whether it shares this host. Each transport keeps its own state
//! for the peer, by its id.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::segment::SegmentDescriptor;

/// Numbers peers in the order they are made (see [`Peer::incarnation`]).
static INCARNATIONS: AtomicU64 = AtomicU64::new(1);

/// An opened segment.
pub(crate) struct Peer {
    pub id: u64,
    /// Which of the peers made for segments this is, in the order they were made: when a
    /// segment is followed to a new process, the new peer's is the greater, so a transport can
    /// tell state made for the earlier process (replace it) from a request routed to the
    /// earlier process (refuse it).
    pub incarnation: u64,
    pub name: String,
    pub addr: SocketAddr,
    descriptor: RwLock<Arc<SegmentDescriptor>>,
    /// Same host and PID namespace: shared memory can reach it.
    pub same_host: bool,
    /// This very engine (a segment opened by its own name).
    pub same_process: bool,
    /// Becomes readable when the peer process exits; only for same-host peers.
    pidfd: Option<OwnedFd>,
    /// This process proved membership to the peer's, and the peer to it, over the handshake
    /// of its control port, or neither side requires a token. Connections of the network
    /// transports each prove it themselves; shared memory opens no connection, so it checks
    /// this first.
    membership_proven: AtomicBool,
    /// Set when the peer refused a request for a key it no longer serves (a buffer it
    /// unregistered, perhaps registered again under a new key): the next request fetches the
    /// descriptor again instead of trusting the cached one. Shared with the transports, which
    /// see the refusals.
    keys_refused: Arc<AtomicBool>,
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; no memory is
    // passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

impl Peer {
    pub(crate) fn new(
        id: u64,
        name: String,
        addr: SocketAddr,
        descriptor: SegmentDescriptor,
        local_host_id: &str,
    ) -> Peer {
        let same_host = descriptor.host_id == local_host_id;
        let same_process = same_host && descriptor.pid == std::process::id();
        let pidfd = if same_host && !same_process {
            pidfd_open(descriptor.pid)
        } else {
            None
        };
        Peer {
            id,
            incarnation: INCARNATIONS.fetch_add(1, Ordering::Relaxed),
            name,
            addr,
            descriptor: RwLock::new(Arc::new(descriptor)),
            same_host,
            same_process,
            pidfd,
            membership_proven: AtomicBool::new(false),
            keys_refused: Arc::new(AtomicBool::new(false)),
        }
    }

    /// What a transport sets when the peer refuses a key (see
    /// [`take_keys_refused`](Self::take_keys_refused)).
    pub(crate) fn keys_refused(&self) -> Arc<AtomicBool> {
        self.keys_refused.clone()
    }

    /// Records that the peer refused a key (or its descriptor named what is gone): the next
    /// request fetches the descriptor again.
    pub(crate) fn mark_keys_refused(&self) {
        self.keys_refused.store(true, Ordering::Relaxed);
    }

    /// Whether the peer refused a key since the last call: the cached descriptor is stale.
    pub(crate) fn take_keys_refused(&self) -> bool {
        self.keys_refused.load(Ordering::Relaxed) && self.keys_refused.swap(false, Ordering::AcqRel)
    }

    /// Whether this process and the peer's proved membership to each other (see
    /// [`mark_membership_proven`](Self::mark_membership_proven)).
    pub(crate) fn membership_proven(&self) -> bool {
        self.membership_proven.load(Ordering::Acquire)
    }

    /// Records that a handshake with the peer's process succeeded, or that neither side asks
    /// for one. A new process serving the segment is a new `Peer`, which is asked again.
    pub(crate) fn mark_membership_proven(&self) {
        self.membership_proven.store(true, Ordering::Release);
    }

    /// The cached descriptor.
    pub(crate) fn descriptor(&self) -> Arc<SegmentDescriptor> {
        self.descriptor.read().expect("peer poisoned").clone()
    }

    /// Drops the buffer `addr..addr+len` from the cached descriptor: the segment said it no
    /// longer serves it, so the next request there fetches the descriptor again instead of
    /// presenting keys that are gone.
    pub(crate) fn forget_buffer(&self, addr: u64, len: u64) {
        let mut d = self.descriptor.write().expect("peer poisoned");
        if d.buffers.iter().any(|b| b.addr == addr && b.len == len) {
            let mut fresh = (**d).clone();
            fresh.buffers.retain(|b| !(b.addr == addr && b.len == len));
            *d = Arc::new(fresh);
        }
    }

    /// Replaces the cached descriptor with a fresh one from the same process. Hands `fresh`
    /// back (and keeps the old one) if the segment is now a different process, which needs a
    /// new `Peer`.
    pub(crate) fn update_descriptor(
        &self,
        fresh: SegmentDescriptor,
    ) -> std::result::Result<(), Box<SegmentDescriptor>> {
        let mut d = self.descriptor.write().expect("peer poisoned");
        if fresh.pid != d.pid || fresh.host_id != d.host_id {
            return Err(Box::new(fresh));
        }
        *d = Arc::new(fresh);
        Ok(())
    }

    /// The error for a request or message to this peer once its process is known to have
    /// exited: a handle keeps the process it was opened on (a restarted one has other buffers,
    /// keys and message connections), so the caller must do `what` to reach whoever serves the
    /// segment now.
    pub(crate) fn exited_error(&self, what: &str) -> crate::error::Error {
        crate::error::Error::PeerDisconnected {
            peer: self.name.clone(),
            reason: format!(
                "the process serving the segment has exited; {what} to reach a process serving it now"
            ),
        }
    }

    /// True when the peer is known to have exited (same-host peers only; remote peers are
    /// judged by their connections).
    pub(crate) fn process_exited(&self) -> bool {
        let Some(fd) = &self.pidfd else { return false };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout; poll only writes `revents`.
        let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
        rc > 0 && pfd.revents & libc::POLLIN != 0
    }
}
