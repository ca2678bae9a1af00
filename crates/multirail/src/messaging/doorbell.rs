//! Waiting that costs nothing: a receive wait spins for a short while (adaptive, see
//! `crate::spin::Spin`), then sleeps on a doorbell until something arrives.
//!
//! * **The doorbell.** One epoll set per engine holds the stream of every connection a message
//!   can arrive on (and duplex readers), plus an eventfd the engine rings itself ([`Doorbell::
//!   ring_local`]): when another thread of ours took in a message while a receiver slept, or a
//!   connection was added. A tcp sender needs do nothing: its bytes make its socket readable.
//!   An shm sender writes into a ring, which no kernel watches, so the ring's header holds a
//!   **sleeping flag** the receiver sets before it sleeps; a sender that finds it set after
//!   publishing clears it and rings: it writes to the receiver's eventfd, which it fetched from
//!   the receiver's process when it connected ([`fetch_bell`], `pidfd_getfd`), or, where that
//!   is not allowed, one byte on its connection's stream (which is in the set too; the receiver
//!   drains such bytes when it checks the stream, `drain_stream`). The eventfd sits in the
//!   set edge-triggered, so a woken receiver reads nothing back from it (every write is an
//!   event; its count is never read, and 2^64 rings do not fill it). The eventfd is the better
//!   bell: the kernel wakes a socket's reader as if the writer were about to sleep, on the
//!   writer's core, where a sender that goes on to spin for the answer holds it off.
//!   RDMA message lanes complete into a receive completion queue per rail that reports to a
//!   completion channel: the receiver arms each queue (`ibv_req_notify_cq`) before its last
//!   poll, and the channel's descriptor, in the set, turns readable at the next completion;
//!   waking, the receiver takes and acknowledges the events. A rail whose device made no
//!   channel (or arming failed) has the receiver sleep in naps of [`RDMA_NAP`] instead (a
//!   thousand wake-ups a second cost well under 1 % of a core; a message may wait up to a nap).
//! * **No lost wakeup.** The receiver stores the flag, issues a SeqCst fence and then polls
//!   every ring once more before sleeping; a sender publishes its record (Release), issues a
//!   SeqCst fence and then loads the flag. The two fences are ordered one way or the other:
//!   if the sender's comes first, the receiver's last poll sees the record and it does not
//!   sleep; if the receiver's comes first, the sender's load sees the flag and it rings. The
//!   byte it rings stays in the socket, so a ring that comes before the receiver reaches
//!   `epoll_wait` still wakes it. A sender that finds the flag cleared by another sender's
//!   ring relies on that ring: the receiver wakes, sets the flag again and polls again, and
//!   the same argument covers the record.
//! * **The busy path pays nothing for it**: a sender reads the flag from its own cache (the
//!   receiver writes that line only when it goes to sleep and wakes) after one fence, and
//!   makes no system call while the receiver is awake.
//!
//! Only one thread sleeps on the set at a time (the one holding [`Doorbell::set`]); other
//! waiting threads sleep on a condition variable the sleeper signals when it wakes.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU32};
use std::sync::Condvar;

use nix::sys::eventfd::{EfdFlags, EventFd};

use super::*;

/// The sleeping flag's value while the receiver is awake (zeroed memory: a new ring).
const AWAKE: u32 = 0;
/// The sleeping flag's value while the receiver sleeps.
const ASLEEP: u32 = 1;

/// The longest single sleep: what a wait without a timeout is cut into (a safety net; nothing
/// relies on it).
const SLEEP_CAP: Duration = Duration::from_secs(10);
/// The longest sleep while RDMA connections are open (see the module's documentation).
pub(super) const RDMA_NAP: Duration = Duration::from_millis(1);
/// Wakes in a row that found the set readable at once yet brought no message: after this many
/// the next sleep is a plain nap (something readable the receive poll cannot take in must not
/// make the wait spin).
pub(super) const FRUITLESS_WAKES: u32 = 8;
/// The nap after [`FRUITLESS_WAKES`].
const FRUITLESS_NAP: Duration = Duration::from_millis(1);

/// Receiver: stores its sleeping flag (Relaxed; the caller issues the SeqCst fence after
/// setting every flag and before its last poll).
pub(super) fn set_flag(flag: &AtomicU32, asleep: bool) {
    flag.store(if asleep { ASLEEP } else { AWAKE }, Ordering::Relaxed);
}

/// Sender, right after publishing: rings the receiver's doorbell when its flag says it sleeps,
/// by its eventfd `bell` when the sender has it, else one byte on the connection's `stream`.
/// The fence pairs with the receiver's (see the module's documentation); while the receiver is
/// awake this is the fence and one load.
#[inline]
pub(super) fn wake_if_asleep(flag: &AtomicU32, stream: &TcpStream, bell: Option<&OwnedFd>) {
    fence(Ordering::SeqCst);
    if flag.load(Ordering::Relaxed) == AWAKE {
        return;
    }
    // One ring per sleep: the first sender to clear the flag rings, later ones need not.
    if flag.swap(AWAKE, Ordering::AcqRel) == AWAKE {
        return;
    }
    let rc = match bell {
        Some(fd) => {
            let one = 1u64.to_ne_bytes();
            // SAFETY: an 8-byte buffer that lives for the call, written to an eventfd we hold
            // open (`fetch_bell` checked what it is); it is non-blocking, like the receiver's.
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr() as *const libc::c_void, 8) }
        }
        None => {
            let b = [1u8];
            // SAFETY: a one-byte buffer that lives for the call, on a socket we hold open.
            unsafe {
                libc::send(
                    stream.as_raw_fd(),
                    b.as_ptr() as *const libc::c_void,
                    1,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            }
        }
    };
    if rc < 0 {
        // A full socket already holds rings the receiver has not read, and a broken one is the
        // sender leaving, which the receiver notices anyway.
        tracing::trace!(error = %std::io::Error::last_os_error(), "ringing a receiver's doorbell");
        return;
    }
    // The kernel likes to wake the receiver on the waker's core; a sender that goes on to
    // spin (for the answer) would hold it off there for a time slice. Let it run first.
    thread::yield_now();
}

/// Sender: the receiver's doorbell eventfd, descriptor `fd` in process `pid` (as the opening
/// answer names it), duplicated into this process with `pidfd_getfd`; `None` when that is not
/// allowed (ptrace restrictions, kernels before 5.6) or the descriptor is not an eventfd (the
/// sender then rings by its stream).
pub(super) fn fetch_bell(pid: u32, fd: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; no memory
    // is passed.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return None;
    }
    // SAFETY: a descriptor just returned to us and owned by nothing else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that process and flags (0),
    // and returns a new descriptor or -1; no memory is passed.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd as i32, 0u32) };
    if got < 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "no eventfd doorbell: ringing by the stream");
        return None;
    }
    // SAFETY: as above, a new descriptor we own.
    let bell = unsafe { OwnedFd::from_raw_fd(got as i32) };
    let what = std::fs::read_link(format!("/proc/self/fd/{}", bell.as_raw_fd())).ok()?;
    (what.as_os_str() == "anon_inode:[eventfd]").then_some(bell)
}

/// Receiver: reads what a sender wrote on the stream of a lane that carries nothing that way
/// (shm): doorbell bytes, discarded. Returns true when the sender closed the stream.
pub(super) fn drain_stream(stream: &TcpStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match sockio::recv_nonblocking(stream.as_raw_fd(), &mut b) {
            Ok(Some(0)) => return true,
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return false,
        }
    }
}

/// The epoll set the sleeping receiver waits on, and what is in it.
pub(super) struct BellSet {
    epoll: Option<Epoll>,
    /// The descriptors in `epoll`, with the connection each belongs to.
    fds: Vec<(i32, u64)>,
    /// What the set should hold now (kept to avoid allocating per sleep).
    want: Vec<(i32, u64)>,
    events: Vec<EpollEvent>,
}

/// A receiver's doorbell: the set a sleeping receive waits on, the engine's own eventfd in it,
/// and the hand-off between waiting threads.
pub(super) struct Doorbell {
    local: EventFd,
    pub(super) set: Mutex<BellSet>,
    /// Threads waiting for the sleeper to wake, counted under it.
    followers: Mutex<u32>,
    woke: Condvar,
    /// Receivers asleep on the set (0 or 1), changed and read under the receive lock.
    pub(super) sleepers: AtomicU32,
    /// Waits that slept, for [`MessageStats::recv_sleeps`].
    pub(super) sleeps: AtomicU64,
}

/// How a receiver's sleep ended.
pub(super) enum Woke {
    /// Something was readable, rung, or the time passed.
    Slept,
    /// Something was readable at once (within 100 µs).
    Quick,
    /// The last poll before sleeping found what the caller waits for: no sleep.
    Ready,
    /// Another thread sleeps on the set; this one waited for it to wake.
    Followed,
}

impl Doorbell {
    /// The descriptor number of the eventfd, for the opening answers of shm lanes (senders
    /// fetch it with [`fetch_bell`]).
    pub(super) fn fd_number(&self) -> u32 {
        self.local.as_raw_fd() as u32
    }

    /// A doorbell with an empty set. Fails when the kernel refuses an eventfd.
    pub(super) fn new() -> std::io::Result<Doorbell> {
        Ok(Doorbell {
            local: EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
            set: Mutex::new(BellSet {
                epoll: None,
                fds: Vec::new(),
                want: Vec::new(),
                events: vec![EpollEvent::empty(); 16],
            }),
            followers: Mutex::new(0),
            woke: Condvar::new(),
            sleepers: AtomicU32::new(0),
            sleeps: AtomicU64::new(0),
        })
    }

    /// Wakes every waiting thread: the one asleep on the set, and those waiting for it. For
    /// the engine's shutdown; the caller has made its waits end at their next look.
    pub(super) fn wake_all(&self) {
        let _ = self.local.write(1);
        let _g = self.followers.lock().expect("followers poisoned");
        self.woke.notify_all();
    }

    /// Wakes the sleeping receiver, if any (the caller holds the receive lock, under which
    /// `sleepers` changes).
    pub(super) fn ring_local(&self) {
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            let _ = self.local.write(1);
        }
    }
}

impl BellSet {
    /// Makes the set hold the stream of every live connection and reader of `rx` (and the
    /// eventfd `local`), building a new set when that changed. Fails when epoll does.
    fn sync(&mut self, rx: &Rx, local: &EventFd) -> std::io::Result<()> {
        self.want.clear();
        for c in rx.conns.iter().filter(|c| !c.dead && !c.ended) {
            self.want.push((c.stream.as_raw_fd(), c.id.0));
        }
        for r in &rx.readers {
            self.want.push((r.stream.as_raw_fd(), u64::MAX));
        }
        for ch in rx.rdma_channels.iter().flatten() {
            self.want.push((ch.fd(), u64::MAX - 1));
        }
        if self.epoll.is_some() && self.want == self.fds {
            return Ok(());
        }
        // A new set rather than edits: a descriptor closed since (its connection reaped) left
        // the old set by itself, and its number may already name another socket.
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(
            local,
            EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLET, 0),
        )?;
        let streams = rx
            .conns
            .iter()
            .filter(|c| !c.dead && !c.ended)
            .map(|c| &c.stream)
            .chain(rx.readers.iter().map(|r| &r.stream));
        for s in streams {
            match epoll.add(s, EpollEvent::new(EpollFlags::EPOLLIN, 1)) {
                Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                Err(e) => return Err(e.into()),
            }
        }
        for ch in rx.rdma_channels.iter().flatten() {
            // SAFETY: the channel owns the descriptor and `rx` keeps the channel (and so the
            // descriptor) open while it is in this set; it leaves the set when closed.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(ch.fd()) };
            match epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 1)) {
                Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.epoll = Some(epoll);
        std::mem::swap(&mut self.fds, &mut self.want);
        Ok(())
    }
}

impl Rx {
    /// Arms every RDMA receive completion queue to signal its channel at the next completion.
    /// Returns whether each has a channel and was armed (else the sleep must be a nap).
    fn arm_rdma(&mut self) -> bool {
        let mut all = true;
        for ((_, cq), ch) in self.rdma_cqs.iter().zip(&self.rdma_channels) {
            all &= ch.is_some()
                && cq
                    .req_notify(false)
                    .map_err(|e| tracing::debug!(error = %e, "arming a message completion queue"))
                    .is_ok();
        }
        all
    }

    /// Takes (and acknowledges) the events the channels hold, so their descriptors stop being
    /// readable; the completions themselves are polled as usual.
    fn drain_rdma_events(&mut self) {
        for ch in self.rdma_channels.iter().flatten() {
            // Non-blocking: ends at EAGAIN once no event is left.
            while ch.wait().is_ok() {}
        }
    }

    /// Sets (or clears) the sleeping flag of every shm ring messages arrive on.
    fn set_asleep(&mut self, asleep: bool) {
        for c in self.conns.iter().filter(|c| !c.dead) {
            c.io.set_asleep(asleep);
        }
        if let Some(s) = &self.shared_shm {
            s.set_asleep(asleep);
        }
    }
}

impl Messaging {
    /// Whether a receive sleeps on the doorbell now: it wakes for whatever comes on any
    /// connection, so nothing else need watch them.
    pub(crate) fn receiver_asleep(&self) -> bool {
        self.bell.sleepers.load(Ordering::Relaxed) > 0
    }

    /// Sleeps until something may have arrived or `left` passed (`None`: no limit): on the
    /// doorbell when no other thread does, else until that thread wakes; with `nap`, a plain
    /// nap of a millisecond instead (see [`FRUITLESS_WAKES`]). Returns at once when the last
    /// poll before sleeping finds what the caller `want`s. The caller polls again afterwards.
    pub(super) fn sleep(&self, left: Option<Duration>, nap: bool, want: Want) -> Woke {
        let bell = &self.bell;
        let mut set = match bell.set.try_lock() {
            Ok(set) => set,
            Err(_) => {
                let mut g = bell.followers.lock().expect("followers poisoned");
                // Checked again under the followers' lock, which the sleeper takes to signal:
                // a sleeper that left in between is not waited for.
                if bell.set.try_lock().is_ok() || self.is_closed() {
                    // (Closed: checked under the lock `wake_all` signals under, so the
                    // signal is not missed.)
                    return Woke::Followed;
                }
                *g += 1;
                let wait = left.unwrap_or(SLEEP_CAP).min(SLEEP_CAP);
                let mut g = bell
                    .woke
                    .wait_timeout(g, wait)
                    .expect("followers poisoned")
                    .0;
                *g -= 1;
                return Woke::Followed;
            }
        };
        let limit = {
            let mut rx = self.rx.lock().expect("rx poisoned");
            if let Err(e) = set.sync(&rx, &bell.local) {
                drop(rx);
                tracing::warn!(error = %e, "cannot wait on the message doorbell; napping");
                thread::sleep(FRUITLESS_NAP.min(left.unwrap_or(FRUITLESS_NAP)));
                return Woke::Slept;
            }
            rx.set_asleep(true);
            // Armed before the last poll: a completion after the poll signals the channel, one
            // before it is found by the poll.
            let rdma_armed = rx.arm_rdma();
            // Pairs with the senders' fence after publishing (see the module documentation).
            fence(Ordering::SeqCst);
            rx.liveness_due = true;
            self.poll(&mut rx);
            if rx.delivered.has(want) {
                rx.set_asleep(false);
                return Woke::Ready;
            }
            bell.sleepers.fetch_add(1, Ordering::Relaxed);
            if rdma_armed {
                SLEEP_CAP
            } else {
                RDMA_NAP
            }
        };
        bell.sleeps.fetch_add(1, Ordering::Relaxed);
        let wait = left.unwrap_or(limit).min(limit);
        let asleep = Instant::now();
        let s = &mut *set;
        // Whether something was readable, and whether that was only the eventfd (then no
        // stream changed, and the liveness check's system calls can wait for the next sleep).
        let (readable, only_bell) = if nap {
            thread::sleep(wait.min(FRUITLESS_NAP));
            (false, false)
        } else {
            let epoll = s.epoll.as_ref().expect("synced above");
            match wait_precisely(epoll, &mut s.events, wait) {
                // The eventfd is edge-triggered: every ring is an event, and nothing reads the
                // count back (a system call on the way to the message).
                Ok(n) => (n > 0, n > 0 && s.events[..n].iter().all(|e| e.data() == 0)),
                Err(nix::errno::Errno::EINTR) => (false, false),
                Err(e) => {
                    tracing::warn!(error = %e, "waiting on the message doorbell");
                    thread::sleep(FRUITLESS_NAP.min(wait));
                    (false, false)
                }
            }
        };
        {
            let mut rx = self.rx.lock().expect("rx poisoned");
            bell.sleepers.fetch_sub(1, Ordering::Relaxed);
            rx.set_asleep(false);
            rx.drain_rdma_events();
            // A stream that closed is readable, so a wake by the eventfd alone saw none close.
            rx.liveness_due |= !only_bell;
        }
        let quick = readable && asleep.elapsed() < Duration::from_micros(100);
        drop(set);
        if *bell.followers.lock().expect("followers poisoned") > 0 {
            bell.woke.notify_all();
        }
        if quick {
            Woke::Quick
        } else {
            Woke::Slept
        }
    }
}

/// Set once the kernel refused `epoll_pwait2` (before Linux 5.11, or a seccomp filter that
/// does not know it): waits then round up to whole milliseconds.
static NO_PWAIT2: AtomicBool = AtomicBool::new(false);

/// Waits on `epoll` for events, at most `wait` to the microsecond (`epoll_pwait2`): a wait
/// that wakes shortly before a message due at the cadence must not round up to the next
/// millisecond. Where the kernel refuses `epoll_pwait2` it rounds up to whole milliseconds (a
/// wait never ends before its deadline). Returns the number of events, or the kernel's error.
fn wait_precisely(epoll: &Epoll, events: &mut [EpollEvent], wait: Duration) -> nix::Result<usize> {
    // On 32-bit targets `libc::timespec` is not the kernel's 64-bit one: round to the ms.
    if cfg!(target_pointer_width = "64") && !NO_PWAIT2.load(Ordering::Relaxed) {
        let ts = libc::timespec {
            tv_sec: wait.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        let len = events.len().min(i32::MAX as usize) as libc::c_int;
        // The system call itself, not the C library's wrapper, which C libraries before
        // glibc 2.35 lack (the program would not link); a kernel without it says ENOSYS.
        // SAFETY: `EpollEvent` is `repr(transparent)` over `libc::epoll_event`, so the slice is
        // `len` writable `epoll_event`s the kernel fills; the timespec (the kernel's 64-bit
        // layout, on the 64-bit targets this branch runs on) outlives the call, and a null signal
        // mask leaves the thread's mask as it is (as `epoll_wait` does; its size is then
        // ignored).
        let n = unsafe {
            libc::syscall(
                libc::SYS_epoll_pwait2,
                epoll.0.as_raw_fd(),
                events.as_mut_ptr().cast::<libc::epoll_event>(),
                len,
                &ts as *const libc::timespec,
                std::ptr::null::<libc::sigset_t>(),
                std::mem::size_of::<libc::sigset_t>(),
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        match nix::errno::Errno::last() {
            nix::errno::Errno::ENOSYS | nix::errno::Errno::EPERM => {
                NO_PWAIT2.store(true, Ordering::Relaxed);
            }
            e => return Err(e),
        }
    }
    let ms = wait.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32;
    let timeout = EpollTimeout::try_from(ms).unwrap_or(EpollTimeout::NONE);
    epoll.wait(events, timeout)
}
