//! Waiting that costs nothing: a receive wait spins for a short while (adaptive, see
//! [`Spin`]), then sleeps on a doorbell until something arrives.
//!
//! * **The doorbell.** One epoll set per engine holds the stream of every connection a message
//!   can arrive on (and duplex readers), plus an eventfd the engine rings itself ([`Doorbell::
//!   ring_local`]): when another thread of ours took in a message while a receiver slept, or a
//!   connection was added. A tcp sender needs do nothing: its bytes make its socket readable.
//!   An shm sender writes into a ring, which no kernel watches, so the ring's header holds a
//!   **sleeping flag** the receiver sets before it sleeps; a sender that finds it set after
//!   publishing clears it and writes one byte on its connection's stream (which is in the set),
//!   and the receiver drains such bytes when it checks the stream (`drain_stream`).
//!   RDMA message lanes complete into completion queues that have no completion channel here,
//!   so a receiver with RDMA connections sleeps in naps of [`RDMA_NAP`] instead (a thousand
//!   wake-ups a second cost well under 1 % of a core; a message may wait up to a nap).
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

use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, AtomicU32};
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
/// by one byte on the connection's `stream`. The fence pairs with the receiver's (see the
/// module's documentation); while the receiver is awake this is the fence and one load.
#[inline]
pub(super) fn wake_if_asleep(flag: &AtomicU32, stream: &TcpStream) {
    fence(Ordering::SeqCst);
    if flag.load(Ordering::Relaxed) == AWAKE {
        return;
    }
    // One ring per sleep: the first sender to clear the flag rings, later ones need not.
    if flag.swap(AWAKE, Ordering::AcqRel) == AWAKE {
        return;
    }
    let b = [1u8];
    // SAFETY: a one-byte buffer that lives for the call, on a socket we hold open.
    let rc = unsafe {
        libc::send(
            stream.as_raw_fd(),
            b.as_ptr() as *const libc::c_void,
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if rc < 0 {
        // A full socket already holds rings the receiver has not read, and a broken one is the
        // sender leaving, which the receiver notices anyway.
        tracing::trace!(error = %std::io::Error::last_os_error(), "ringing a receiver's doorbell");
    }
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

/// How long a receive wait spins before it sleeps: `transports.<t>.receive.spin_us` at most
/// and, when adaptive, twice the time recent waits took until a message came, so that a
/// receiver whose messages come quickly keeps spinning through the gap while one whose
/// messages come seldom sleeps almost at once.
pub(super) struct Spin {
    /// The most a wait spins, ns.
    cap: u64,
    /// The least an adaptive spin shrinks to, ns.
    floor: u64,
    adaptive: bool,
    /// The spin the next wait takes, ns.
    current: AtomicU64,
}

impl Spin {
    /// A spin of at most `cap`, adapting when `adaptive`.
    pub(super) fn new(cap: Duration, adaptive: bool) -> Spin {
        let cap = cap.as_nanos().min(u64::MAX as u128) as u64;
        Spin {
            cap,
            floor: cap / 16,
            adaptive,
            current: AtomicU64::new(cap),
        }
    }

    /// The spin the next wait takes.
    pub(super) fn current(&self) -> Duration {
        Duration::from_nanos(self.current.load(Ordering::Relaxed))
    }

    /// A wait ended after `waited`: a message came then (`Some`-like: `came`), or it timed
    /// out. Waits that end within the cap pull the spin up to twice their length (a longer
    /// spin would have caught the message without sleeping); longer ones halve it, down to a
    /// sixteenth of the cap.
    pub(super) fn learn(&self, waited: Duration, came: bool) {
        if !self.adaptive {
            return;
        }
        let w = waited.as_nanos().min(u64::MAX as u128) as u64;
        let cur = self.current.load(Ordering::Relaxed);
        let next = if came && w < self.cap {
            cur.max(w.saturating_mul(2)).min(self.cap)
        } else {
            (cur / 2).max(self.floor)
        };
        if next != cur {
            self.current.store(next, Ordering::Relaxed);
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
    followers: Mutex<()>,
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
    /// The last poll before sleeping found a message: no sleep.
    Ready,
    /// Another thread sleeps on the set; this one waited for it to wake.
    Followed,
}

impl Doorbell {
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
            followers: Mutex::new(()),
            woke: Condvar::new(),
            sleepers: AtomicU32::new(0),
            sleeps: AtomicU64::new(0),
        })
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
        if self.epoll.is_some() && self.want == self.fds {
            return Ok(());
        }
        // A new set rather than edits: a descriptor closed since (its connection reaped) left
        // the old set by itself, and its number may already name another socket.
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(local, EpollEvent::new(EpollFlags::EPOLLIN, 0))?;
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
        self.epoll = Some(epoll);
        std::mem::swap(&mut self.fds, &mut self.want);
        Ok(())
    }
}

impl Rx {
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
    /// Sleeps until something may have arrived or `left` passed (`None`: no limit): on the
    /// doorbell when no other thread does, else until that thread wakes; with `nap`, a plain
    /// nap of a millisecond instead (see [`FRUITLESS_WAKES`]). The caller polls again
    /// afterwards.
    pub(super) fn sleep(&self, left: Option<Duration>, nap: bool) -> Woke {
        let bell = &self.bell;
        let mut set = match bell.set.try_lock() {
            Ok(set) => set,
            Err(_) => {
                let g = bell.followers.lock().expect("followers poisoned");
                // Checked again under the followers' lock, which the sleeper takes to signal:
                // a sleeper that left in between is not waited for.
                if bell.set.try_lock().is_ok() {
                    return Woke::Followed;
                }
                let wait = left.unwrap_or(SLEEP_CAP).min(SLEEP_CAP);
                let _ = bell.woke.wait_timeout(g, wait).expect("followers poisoned");
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
            // Pairs with the senders' fence after publishing (see the module documentation).
            fence(Ordering::SeqCst);
            rx.liveness_due = true;
            self.poll(&mut rx);
            if !rx.delivered.ready.is_empty() {
                rx.set_asleep(false);
                return Woke::Ready;
            }
            bell.sleepers.fetch_add(1, Ordering::Relaxed);
            if rx.rdma_cqs.is_empty() {
                SLEEP_CAP
            } else {
                RDMA_NAP
            }
        };
        bell.sleeps.fetch_add(1, Ordering::Relaxed);
        let wait = left.unwrap_or(limit).min(limit);
        let asleep = Instant::now();
        let s = &mut *set;
        let readable = if nap {
            thread::sleep(wait.min(FRUITLESS_NAP));
            false
        } else {
            // Rounded up: a wait never ends before its deadline.
            let ms = wait.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32;
            let epoll = s.epoll.as_ref().expect("synced above");
            let timeout = EpollTimeout::try_from(ms).unwrap_or(EpollTimeout::NONE);
            match epoll.wait(&mut s.events, timeout) {
                Ok(n) => n > 0,
                Err(nix::errno::Errno::EINTR) => false,
                Err(e) => {
                    tracing::warn!(error = %e, "waiting on the message doorbell");
                    thread::sleep(FRUITLESS_NAP.min(wait));
                    false
                }
            }
        };
        let _ = bell.local.read();
        {
            let mut rx = self.rx.lock().expect("rx poisoned");
            bell.sleepers.fetch_sub(1, Ordering::Relaxed);
            rx.set_asleep(false);
            rx.liveness_due = true;
        }
        let quick = readable && asleep.elapsed() < Duration::from_micros(100);
        drop(set);
        let _g = bell.followers.lock().expect("followers poisoned");
        bell.woke.notify_all();
        if quick {
            Woke::Quick
        } else {
            Woke::Slept
        }
    }
}
