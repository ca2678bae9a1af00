//! The engine's listening port. Every connection opens with the membership handshake
//! (`protocol::handshake`), then answers descriptor queries (control), serves slices (data,
//! see `data`: the tcp transport's target side) or is handed to messaging or the rdma
//! transport. What it hands out and reports (permits, the traits of those that take
//! connections over, [`ConnectionStats`]) lives in `server`, below every transport.
//!
//! A fixed pool of `transports.tcp.serve_threads` threads serves every connection, each thread
//! from an epoll set of its own: a connection is homed on the thread with the fewest
//! connections when it arrives, and armed one-shot, so exactly one thread serves it at a time
//! and a connection waiting for bytes holds no thread. One set per thread rather than one set
//! for all: a request arriving in several segments (a 64 KiB slice and its header are two on
//! loopback) makes the kernel wake one more waiter of the set per segment, and with the pool
//! sharing a set every second wake-up found nothing to do. As many more threads serve the data
//! connections whose latest request was HIGH (a client keeps one per rail for HIGH slices
//! alone), each from a HIGH set of its own, one per home: a HIGH slice never waits for a pool
//! thread to finish a bulk turn, and those threads keep HIGH's CPU priority instead of waking
//! at the bulk one of their last turn. (As many, not one: HIGH is the default priority, so on
//! a host with many rails HIGH connections may carry everything.) What a connection costs is
//! an fd and a small state, so the port bounds them: `max_connections` in all,
//! `max_pending_connections` that have not finished the handshake (the oldest makes room, and
//! none lingers past `connect_timeout_ms`). When the process runs out of fds, the oldest
//! unproven connection is shed, then the member connection idle the longest, and accepting
//! backs off; members' connections are otherwise kept however long they stay idle.
//!
//! What data connections serve is counted per rail (the local address a connection arrived
//! on), operation, priority and peer address ([`crate::stats::ServedTraffic`]).

use std::fs::File;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::EventFd;
use slab::Slab;

use crate::error::{Error, Result};
use crate::memory::MemoryRegistry;
use crate::protocol::handshake::{self, Membership, Outcome, ServerHandshake};
use crate::protocol::wire::{self, ConnKind};
use crate::server::{ConnPermit, ConnectionStats, MessageListener, RdmaListener};
use crate::stats::{ServedStats, ServedTally, ServedTraffic};
use crate::transport::cpu_priority::{NiceTable, ThreadNice};
use crate::transport::sockio;

use crate::transport::tcp::serve::{DataConn, Wait};

/// Produces the current segment descriptor as JSON for control queries.
pub(crate) type DescriptorSource = Arc<dyn Fn() -> Vec<u8> + Send + Sync>;

const LISTENER: u64 = u64::MAX;
const WAKE: u64 = u64::MAX - 1;
/// How often a serving thread looks for handshakes past their deadline and a paused listener.
const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// A member's connection idle at least this long may be shed when fds run out: one that
/// moved bytes more recently is probably in use.
const IDLE_BEFORE_SHED: Duration = Duration::from_secs(1);
/// Most connections shed in one round of accepting before accepting backs off: enough to take
/// a backlog's worth of newcomers, few enough that a flood cannot keep a thread shedding.
const SHED_PER_ACCEPT: usize = 64;
/// Control answers queued before the connection stops reading queries.
const CONTROL_BACKLOG: usize = 1 << 20;

/// Limits and policy of the listening port.
#[derive(Debug, Clone)]
pub(crate) struct ServerSettings {
    pub max_connections: usize,
    pub max_pending: usize,
    pub serve_threads: usize,
    /// A connection that has not finished the handshake by then is closed.
    pub handshake_timeout: Duration,
    /// Idle time before keepalive probes a connection, and how long a probe or sent data may
    /// go unanswered before the kernel drops it.
    pub keepalive: Duration,
    pub timeout: Duration,
    pub membership: Membership,
    pub nice: NiceTable,
    /// `transports.tcp.nontemporal_copies`, for data connections' staging.
    pub nontemporal_copies: bool,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    not_members: AtomicU64,
    shed_pending: AtomicU64,
    shed_idle: AtomicU64,
    refused_full: AtomicU64,
    accept_errors: AtomicU64,
}

/// Where a connection is in its life.
enum State {
    /// The membership handshake; `out` holds what is still to be sent of the challenge or
    /// the verdict.
    Handshake {
        hs: ServerHandshake,
        out: Vec<u8>,
        outcome: Option<Outcome>,
    },
    /// Descriptor queries; `out` holds unsent answers.
    Control { out: Vec<u8> },
    /// A message connection's opening (mode, name) being read before it goes to messaging.
    Opening { buf: Vec<u8> },
    /// Slices.
    Data(Box<DataConn>),
}

struct Entry {
    token: u64,
    /// The socket, closed when the last holder of this entry lets go (so its fd number is
    /// never reused while a serving thread may still use it), or taken by messaging.
    stream: Mutex<Option<TcpStream>>,
    fd: RawFd,
    peer: SocketAddr,
    opened: Instant,
    /// Still counted as pending (not through the handshake); cleared exactly once.
    pending: AtomicBool,
    /// Closed or handed off; set exactly once by whoever does it.
    gone: AtomicBool,
    /// Nanoseconds after the server's epoch of the last time it was served.
    last_active_ns: AtomicU64,
    /// In its home's HIGH set (see the module documentation) rather than its pool set;
    /// changed only by the thread serving the connection, while it is disarmed.
    high: AtomicBool,
    /// The serving thread (pool and HIGH) whose sets the connection is in.
    home: usize,
    state: Mutex<State>,
}

struct Shared {
    /// One set per pool thread; the listener is in the first.
    pool_sets: Vec<Epoll>,
    /// One set per HIGH serving thread, for the connections carrying HIGH slices.
    high_sets: Vec<Epoll>,
    /// Connections homed on each thread, to home a new one on the least loaded.
    homed: Vec<AtomicUsize>,
    wake: EventFd,
    listener: TcpListener,
    entries: Mutex<Slab<Arc<Entry>>>,
    generation: AtomicU64,
    open: Arc<AtomicUsize>,
    pending: AtomicUsize,
    counters: Counters,
    settings: ServerSettings,
    registry: Arc<MemoryRegistry>,
    descriptor: DescriptorSource,
    messages: Arc<dyn MessageListener>,
    rdma: Arc<dyn RdmaListener>,
    stopping: AtomicBool,
    /// Held open so that, out of fds with nothing to shed, one waiting client can still be
    /// accepted and closed instead of left hanging.
    spare: Mutex<Option<File>>,
    epoch: Instant,
    next_sweep: Mutex<Instant>,
    /// Accepting is paused after an accept failure until the next sweep.
    listener_paused: AtomicBool,
    /// Last time a refusal was logged, so a flood of strangers cannot flood the log.
    last_refusal_log: Mutex<Option<Instant>>,
    /// Last time a failed accept was logged, for the same reason.
    last_accept_log: Mutex<Option<Instant>>,
    /// What data connections served.
    served: Arc<ServedStats>,
    /// The rails this engine publishes (address, name), read from its descriptor when the
    /// first data connection needs a rail's name: rails do not change while the engine runs.
    published_rails: OnceLock<Vec<(IpAddr, String)>>,
}

/// A running listener and the threads that serve its connections.
pub(crate) struct Server {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Server {
    /// Binds `listen` and starts serving. Port 0 picks a free port. Fails when the port cannot
    /// be bound or the serving threads cannot be started.
    pub(crate) fn start(
        listen: SocketAddr,
        registry: Arc<MemoryRegistry>,
        descriptor: DescriptorSource,
        messages: Arc<dyn MessageListener>,
        rdma: Arc<dyn RdmaListener>,
        settings: ServerSettings,
    ) -> Result<Server> {
        raise_fd_limit();
        let listener = TcpListener::bind(listen)
            .map_err(|e| Error::io(format!("binding control port {listen}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading bound address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the listener non-blocking", e))?;
        if !settings.membership.is_required() && !listen.ip().is_loopback() {
            tracing::warn!(
                %local_addr,
                "listening beyond loopback without a membership token: anyone who can connect \
                 can read and write registered memory; set auth.token or MULTIRAIL_TOKEN"
            );
        }
        let os = |what: &'static str| move |e: nix::Error| Error::io(what, e.into());
        let wake = EventFd::new().map_err(os("creating eventfd"))?;
        let pool = settings.serve_threads.max(1);
        let mut sets = Vec::with_capacity(2 * pool);
        for _ in 0..2 * pool {
            let set = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(os("creating epoll"))?;
            // Level-triggered and not one-shot: once written at shutdown it wakes every thread.
            set.add(&wake, EpollEvent::new(EpollFlags::EPOLLIN, WAKE))
                .map_err(os("watching the wake-up eventfd"))?;
            sets.push(set);
        }
        let high_sets = sets.split_off(pool);
        let pool_sets = sets;
        pool_sets[0]
            .add(
                &listener,
                EpollEvent::new(armed(EpollFlags::EPOLLIN), LISTENER),
            )
            .map_err(os("watching the listener"))?;
        let shared = Arc::new(Shared {
            pool_sets,
            high_sets,
            homed: (0..pool).map(|_| AtomicUsize::new(0)).collect(),
            wake,
            listener,
            entries: Mutex::new(Slab::new()),
            generation: AtomicU64::new(1),
            open: Arc::new(AtomicUsize::new(0)),
            pending: AtomicUsize::new(0),
            counters: Counters::default(),
            registry,
            descriptor,
            messages,
            rdma,
            stopping: AtomicBool::new(false),
            spare: Mutex::new(File::open("/dev/null").ok()),
            epoch: Instant::now(),
            next_sweep: Mutex::new(Instant::now() + SWEEP_EVERY),
            listener_paused: AtomicBool::new(false),
            last_refusal_log: Mutex::new(None),
            last_accept_log: Mutex::new(None),
            served: Arc::default(),
            published_rails: OnceLock::new(),
            settings,
        });
        let mut threads = Vec::new();
        for i in 0..2 * pool {
            let s = shared.clone();
            let (high, home) = (i >= pool, i % pool);
            let name = if high {
                format!("mr-serve-high-{home}")
            } else {
                format!("mr-serve-{home}")
            };
            let spawned = thread::Builder::new()
                .name(name)
                .spawn(move || serve_loop(&s, high, home));
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    let server = Server {
                        local_addr,
                        shared,
                        threads,
                    };
                    drop(server);
                    return Err(Error::io("spawning a serving thread", e));
                }
            }
        }
        Ok(Server {
            local_addr,
            shared,
            threads,
        })
    }

    /// The address actually bound.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What the port holds and has refused.
    pub(crate) fn stats(&self) -> ConnectionStats {
        let s = &self.shared;
        let c = &s.counters;
        ConnectionStats {
            open: s.open.load(Ordering::Acquire),
            pending: s.pending.load(Ordering::Acquire),
            accepted: c.accepted.load(Ordering::Relaxed),
            not_members: c.not_members.load(Ordering::Relaxed),
            shed_pending: c.shed_pending.load(Ordering::Relaxed),
            shed_idle: c.shed_idle.load(Ordering::Relaxed),
            refused_full: c.refused_full.load(Ordering::Relaxed),
            accept_errors: c.accept_errors.load(Ordering::Relaxed),
            serve_threads: self.threads.len(),
        }
    }

    /// What data connections have served so far (connections still open fold their counts in
    /// before each batch of acknowledgements and after each batch of READ answers).
    pub(crate) fn served(&self) -> ServedTraffic {
        self.shared.served.snapshot()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        let _ = self.shared.wake.write(1);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let entries: Vec<Arc<Entry>> = self
            .shared
            .entries
            .lock()
            .expect("server poisoned")
            .iter()
            .map(|(_, e)| e.clone())
            .collect();
        for e in entries {
            self.shared.close(&e);
        }
    }
}

/// One-shot interest: after an event the connection is disarmed until its server re-arms it,
/// so no two threads ever serve it at once.
fn armed(flags: EpollFlags) -> EpollFlags {
    flags | EpollFlags::EPOLLONESHOT
}

/// Raises the soft fd limit to the hard one: every connection costs an fd, and the default
/// soft limit (often 1024) is far below what a busy engine holds.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::debug!(error = %e, "cannot raise the fd limit");
            }
        }
    }
}

/// The serving thread of the connections homed on `home`: of the pool, or with `high` the one
/// serving those of them that carry HIGH slices.
fn serve_loop(s: &Shared, high: bool, home: usize) {
    let set = s.set(high, home);
    let mut nice = ThreadNice::for_this_thread(s.settings.nice);
    // One event per wait: a thread holding several ready connections would serve them in turn
    // while another thread sits idle.
    let mut events = [EpollEvent::empty(); 1];
    let timeout = u16::try_from(SWEEP_EVERY.as_millis()).unwrap_or(u16::MAX);
    loop {
        let n = match set.wait(&mut events, timeout) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => 0,
            Err(e) => {
                tracing::error!(error = %e, "epoll_wait failed; this serving thread stops");
                return;
            }
        };
        if s.stopping.load(Ordering::Acquire) {
            return;
        }
        s.maybe_sweep();
        if n == 0 {
            continue;
        }
        match events[0].data() {
            WAKE => {}
            LISTENER => s.accept_burst(),
            token => s.serve(token, &mut nice),
        }
    }
}

/// What a turn on a connection leads to.
enum Next {
    Wait(Wait),
    Close,
    /// To messaging, with the opening read.
    HandOff(Vec<u8>),
    /// To the rdma transport.
    HandOffRdma,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn lookup(&self, token: u64) -> Option<Arc<Entry>> {
        let idx = (token & 0xffff_ffff) as usize;
        self.entries
            .lock()
            .expect("server poisoned")
            .get(idx)
            .filter(|e| e.token == token)
            .cloned()
    }

    /// The set of the connections homed on `home`: those carrying HIGH slices when `high`.
    fn set(&self, high: bool, home: usize) -> &Epoll {
        if high {
            &self.high_sets[home]
        } else {
            &self.pool_sets[home]
        }
    }

    /// The set connection `e` is in.
    fn set_of(&self, e: &Entry) -> &Epoll {
        self.set(e.high.load(Ordering::Acquire), e.home)
    }

    /// Arms `e` again for `wait`, in the HIGH set when `high`, else the pool's (moving it when
    /// that changed).
    fn rearm(&self, e: &Entry, wait: Wait, high: bool) {
        let flags = match wait {
            Wait::Read | Wait::Again => EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP,
            Wait::Write => EpollFlags::EPOLLOUT,
        };
        let mut ev = EpollEvent::new(armed(flags), e.token);
        // SAFETY: the entry owns the socket until its last holder drops it, and we hold it.
        let fd = unsafe { BorrowedFd::borrow_raw(e.fd) };
        let armed = if e.high.load(Ordering::Acquire) == high {
            self.set_of(e).modify(fd, &mut ev)
        } else {
            // Disarmed (one-shot) and served by this thread alone: no event is lost between.
            let _ = self.set_of(e).delete(fd);
            e.high.store(high, Ordering::Release);
            let added = self.set_of(e).add(fd, ev);
            if e.gone.load(Ordering::Acquire) {
                // Closed meanwhile; its close took it out of the old set only.
                let _ = self.set_of(e).delete(fd);
            }
            added
        };
        if let Err(err) = armed {
            // Closed by another thread meanwhile (shed, deadline): nothing to re-arm.
            if !e.gone.load(Ordering::Acquire) {
                tracing::warn!(peer = %e.peer, error = %err, "cannot re-arm a connection");
                self.close(e);
            }
        }
    }

    /// Closes a connection: out of the set and the table now, its fd when the last thread
    /// holding it lets go. Idempotent.
    fn close(&self, e: &Entry) {
        if e.gone.swap(true, Ordering::AcqRel) {
            return;
        }
        self.forget(e);
        // SAFETY: shutting down a socket we still own; it only wakes and fails its I/O.
        unsafe { libc::shutdown(e.fd, libc::SHUT_RDWR) };
        self.open.fetch_sub(1, Ordering::AcqRel);
    }

    /// Takes the entry out of the epoll set, the table, its home's count and the pending count.
    fn forget(&self, e: &Entry) {
        // SAFETY: as in `rearm`: the caller holds the entry, which owns the socket.
        let fd = unsafe { BorrowedFd::borrow_raw(e.fd) };
        let _ = self.set_of(e).delete(fd);
        self.homed[e.home].fetch_sub(1, Ordering::Relaxed);
        {
            let mut entries = self.entries.lock().expect("server poisoned");
            let idx = (e.token & 0xffff_ffff) as usize;
            if entries.get(idx).is_some_and(|x| x.token == e.token) {
                entries.remove(idx);
            }
        }
        if e.pending.swap(false, Ordering::AcqRel) {
            self.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn log_refusal(&self, peer: SocketAddr, reason: &str) {
        if once_a_second(&self.last_refusal_log) {
            tracing::warn!(
                %peer,
                reason,
                refused_so_far = self.counters.not_members.load(Ordering::Relaxed),
                "refused a connection that did not prove membership (logged at most once a second)"
            );
        }
    }

    fn accept_burst(&self) {
        let mut shed = 0;
        loop {
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            match self.listener.accept() {
                Ok((stream, peer)) => self.admit(stream, peer),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ECONNABORTED) | Some(libc::EINTR) | Some(libc::EPROTO)
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    self.counters.accept_errors.fetch_add(1, Ordering::Relaxed);
                    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if out_of_fds && shed < SHED_PER_ACCEPT && self.shed_for_fd() {
                        shed += 1;
                        continue;
                    }
                    if out_of_fds {
                        self.refuse_with_spare();
                    }
                    if once_a_second(&self.last_accept_log) {
                        tracing::warn!(
                            error = %e,
                            failed_so_far = self.counters.accept_errors.load(Ordering::Relaxed),
                            "accept failed; accepting pauses until the next sweep (logged at most once a second)"
                        );
                    }
                    self.listener_paused.store(true, Ordering::Release);
                    return;
                }
            }
        }
        self.rearm_listener();
    }

    fn rearm_listener(&self) {
        let mut ev = EpollEvent::new(armed(EpollFlags::EPOLLIN), LISTENER);
        if let Err(e) = self.pool_sets[0].modify(&self.listener, &mut ev) {
            tracing::error!(error = %e, "cannot re-arm the listener");
        }
    }

    /// Out of fds with nothing to shed: accept one waiting client with the spare fd and close
    /// it, so it hears a refusal instead of waiting in the backlog.
    fn refuse_with_spare(&self) {
        let mut spare = self.spare.lock().expect("server poisoned");
        if spare.take().is_some() {
            if let Ok((s, _)) = self.listener.accept() {
                self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
                drop(s);
            }
            *spare = File::open("/dev/null").ok();
        }
    }

    fn admit(&self, stream: TcpStream, peer: SocketAddr) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let _ = stream.set_nodelay(true);
        // A peer that vanishes while its link is down never sends its FIN: without probes its
        // connections would stay here, each holding an fd, until fd pressure sheds them.
        if let Err(e) = crate::transport::tcp::keep_alive(
            &stream,
            self.settings.keepalive,
            self.settings.timeout,
        ) {
            tracing::debug!(%peer, error = %e, "cannot set keepalive");
        }
        if self.open.load(Ordering::Acquire) >= self.settings.max_connections
            && !self.shed_oldest_pending()
        {
            self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "refused: max_connections held");
            return;
        }
        if self.pending.load(Ordering::Acquire) >= self.settings.max_pending {
            self.shed_oldest_pending();
        }
        let fd = stream.as_raw_fd();
        let now = Instant::now();
        let state = State::Handshake {
            hs: ServerHandshake::new(self.settings.membership.clone(), handshake::nonce()),
            out: Vec::new(),
            outcome: None,
        };
        let home = take_least(&self.homed);
        let entry = {
            let mut entries = self.entries.lock().expect("server poisoned");
            let slot = entries.vacant_entry();
            let idx = slot.key() as u64;
            let gen = self.generation.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff;
            let token = (gen << 32) | idx;
            let entry = Arc::new(Entry {
                token,
                stream: Mutex::new(Some(stream)),
                fd,
                peer,
                opened: now,
                pending: AtomicBool::new(true),
                gone: AtomicBool::new(false),
                last_active_ns: AtomicU64::new(self.now_ns()),
                high: AtomicBool::new(false),
                home,
                state: Mutex::new(state),
            });
            slot.insert(entry.clone());
            entry
        };
        self.open.fetch_add(1, Ordering::AcqRel);
        self.pending.fetch_add(1, Ordering::AcqRel);
        self.counters.accepted.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `entry` owns the socket and we hold it.
        let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
        let ev = EpollEvent::new(
            armed(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP),
            entry.token,
        );
        if let Err(e) = self.pool_sets[home].add(bfd, ev) {
            tracing::warn!(%peer, error = %e, "cannot watch a new connection");
            self.close(&entry);
        }
    }

    /// Closes the connection that has waited longest without finishing the handshake.
    fn shed_oldest_pending(&self) -> bool {
        let victim = self
            .entries
            .lock()
            .expect("server poisoned")
            .iter()
            .filter(|(_, e)| e.pending.load(Ordering::Acquire))
            .min_by_key(|(_, e)| e.opened)
            .map(|(_, e)| e.clone());
        match victim {
            Some(v) => {
                self.counters.shed_pending.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(peer = %v.peer, "shed an unproven connection");
                self.close(&v);
                true
            }
            None => false,
        }
    }

    /// Frees an fd: the oldest unproven connection, else the member's connection idle the
    /// longest (at least [`IDLE_BEFORE_SHED`]); the member reconnects when it needs it.
    fn shed_for_fd(&self) -> bool {
        if self.shed_oldest_pending() {
            return true;
        }
        let idle_before = self
            .now_ns()
            .saturating_sub(IDLE_BEFORE_SHED.as_nanos() as u64);
        let victim = self
            .entries
            .lock()
            .expect("server poisoned")
            .iter()
            .map(|(_, e)| (e.last_active_ns.load(Ordering::Relaxed), e))
            .filter(|(t, _)| *t <= idle_before)
            .min_by_key(|(t, _)| *t)
            .map(|(_, e)| e.clone());
        match victim {
            Some(v) => {
                self.counters.shed_idle.fetch_add(1, Ordering::Relaxed);
                tracing::info!(peer = %v.peer, "out of fds: closed an idle member connection");
                self.close(&v);
                true
            }
            None => false,
        }
    }

    /// Closes handshakes past their deadline and resumes a paused listener; at most one
    /// thread sweeps per [`SWEEP_EVERY`].
    fn maybe_sweep(&self) {
        let now = Instant::now();
        {
            let Ok(mut next) = self.next_sweep.try_lock() else {
                return;
            };
            if now < *next {
                return;
            }
            *next = now + SWEEP_EVERY;
        }
        let deadline = self.settings.handshake_timeout;
        let late: Vec<Arc<Entry>> = self
            .entries
            .lock()
            .expect("server poisoned")
            .iter()
            .filter(|(_, e)| {
                e.pending.load(Ordering::Acquire) && now.duration_since(e.opened) > deadline
            })
            .map(|(_, e)| e.clone())
            .collect();
        for e in late {
            self.counters.shed_pending.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(peer = %e.peer, "no handshake within the deadline; closed");
            self.close(&e);
        }
        if self.listener_paused.swap(false, Ordering::AcqRel) {
            self.rearm_listener();
        }
    }

    /// Serves one ready connection until it would block, then re-arms it.
    fn serve(&self, token: u64, nice: &mut ThreadNice) {
        let Some(e) = self.lookup(token) else {
            return;
        };
        e.last_active_ns.store(self.now_ns(), Ordering::Relaxed);
        let (next, high) = {
            let mut st = e.state.lock().expect("connection poisoned");
            if e.gone.load(Ordering::Acquire) {
                return;
            }
            let next = self.turn(&e, &mut st, nice);
            (next, matches!(&*st, State::Data(d) if d.carries_high()))
        };
        match next {
            Ok(Next::Wait(w)) => self.rearm(&e, w, high),
            Ok(Next::Close) => self.close(&e),
            Ok(Next::HandOff(opening)) => self.hand_off(&e, Some(&opening)),
            Ok(Next::HandOffRdma) => self.hand_off(&e, None),
            Err(reason) => {
                tracing::warn!(peer = %e.peer, %reason, "closed connection");
                self.close(&e);
            }
        }
    }

    fn turn(&self, e: &Entry, st: &mut State, nice: &mut ThreadNice) -> Result<Next, String> {
        loop {
            match st {
                State::Handshake { hs, out, outcome } => {
                    if !write_pending(e.fd, out)? {
                        return Ok(Next::Wait(Wait::Write));
                    }
                    match outcome.take() {
                        Some(Outcome::Accepted(kind)) => {
                            *st = match kind {
                                ConnKind::Control => State::Control { out: Vec::new() },
                                ConnKind::Data => State::Data(Box::new(DataConn::new(
                                    &[],
                                    self.served_tally(e),
                                    self.settings.nontemporal_copies,
                                ))),
                                ConnKind::Message => State::Opening { buf: Vec::new() },
                                ConnKind::Rdma => return Ok(Next::HandOffRdma),
                            };
                            continue;
                        }
                        // Counted when decided, below: the client may act on the verdict at once.
                        Some(Outcome::Refused(_)) => return Ok(Next::Close),
                        None => {}
                    }
                    let mut buf = [0u8; wire::HELLO_LEN];
                    let want = hs.wants().min(buf.len());
                    match sockio::recv_nonblocking(e.fd, &mut buf[..want]) {
                        Ok(None) => return Ok(Next::Wait(Wait::Read)),
                        Ok(Some(0)) | Err(_) => {
                            if hs.said_hello() && self.settings.membership.is_required() {
                                // A client that cannot prove the token hangs up after the
                                // challenge: refused all the same.
                                self.counters.not_members.fetch_add(1, Ordering::Relaxed);
                                self.log_refusal(e.peer, "closed without proving membership");
                            }
                            return Ok(Next::Close);
                        }
                        Ok(Some(n)) => {
                            let (took, o) = hs.on_bytes(&buf[..n], out)?;
                            debug_assert_eq!(took, n, "read no more than the handshake wants");
                            if let Some(Outcome::Refused(reason)) = &o {
                                self.counters.not_members.fetch_add(1, Ordering::Relaxed);
                                self.log_refusal(e.peer, reason);
                            }
                            // Proven from here: the client acts on the verdict as soon as it is
                            // written, so a connection admitted next must not find this one
                            // still pending and shed it.
                            if matches!(o, Some(Outcome::Accepted(_)))
                                && e.pending.swap(false, Ordering::AcqRel)
                            {
                                self.pending.fetch_sub(1, Ordering::AcqRel);
                            }
                            *outcome = o;
                        }
                    }
                }
                State::Control { out } => {
                    if !write_pending(e.fd, out)? {
                        return Ok(Next::Wait(Wait::Write));
                    }
                    let mut ops = [0u8; 16];
                    match sockio::recv_nonblocking(e.fd, &mut ops) {
                        Ok(None) => return Ok(Next::Wait(Wait::Read)),
                        Ok(Some(0)) => return Ok(Next::Close),
                        Err(err) => return Err(format!("reading control request: {err}")),
                        Ok(Some(n)) => {
                            for &op in &ops[..n] {
                                match op {
                                    wire::CONTROL_GET_DESCRIPTOR => {
                                        let json = (self.descriptor)();
                                        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
                                        out.extend_from_slice(&json);
                                    }
                                    other => {
                                        return Err(format!("unknown control request {other}"))
                                    }
                                }
                            }
                            if out.len() > CONTROL_BACKLOG && !write_pending(e.fd, out)? {
                                return Ok(Next::Wait(Wait::Write));
                            }
                        }
                    }
                }
                State::Opening { buf } => {
                    let need = match self.messages.opening_len(buf)? {
                        Some(total) if buf.len() == total => {
                            return Ok(Next::HandOff(std::mem::take(buf)))
                        }
                        Some(total) => total - buf.len(),
                        None => 3 - buf.len(),
                    };
                    let mut chunk = vec![0u8; need];
                    match sockio::recv_nonblocking(e.fd, &mut chunk) {
                        Ok(None) => return Ok(Next::Wait(Wait::Read)),
                        Ok(Some(0)) => return Ok(Next::Close),
                        Err(err) => return Err(format!("reading message opening: {err}")),
                        Ok(Some(n)) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                State::Data(d) => {
                    return match d.turn(e.fd, &self.registry, nice)? {
                        Some(w) => Ok(Next::Wait(w)),
                        None => Ok(Next::Close),
                    };
                }
            }
        }
    }

    /// The served counters of a data connection: its rail from the local address it reached,
    /// its peer from the address it came from. Once per connection.
    fn served_tally(&self, e: &Entry) -> ServedTally {
        let local = e
            .stream
            .lock()
            .expect("connection poisoned")
            .as_ref()
            .and_then(|s| s.local_addr().ok())
            .map(|a| a.ip().to_canonical())
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        self.served
            .tally(local, e.peer.ip().to_canonical(), || self.rail_name(local))
    }

    /// The rail holding local address `local`: the name this engine publishes for it, else the
    /// interface holding it, else `tcp`.
    fn rail_name(&self, local: IpAddr) -> String {
        let published = self.published_rails.get_or_init(|| {
            #[derive(serde::Deserialize)]
            struct Rails {
                rails: Vec<crate::segment::RailDescriptor>,
            }
            serde_json::from_slice::<Rails>(&(self.descriptor)())
                .map(|d| {
                    d.rails
                        .into_iter()
                        .filter_map(|r| Some((r.address.parse::<IpAddr>().ok()?, r.name)))
                        .collect()
                })
                .unwrap_or_default()
        });
        published
            .iter()
            .find(|(a, _)| *a == local)
            .map(|(_, n)| n.clone())
            .or_else(|| crate::topology::interface_for_address(local))
            .unwrap_or_else(|| "tcp".to_owned())
    }

    /// Gives a message connection (with its `opening`) to messaging, which polls it from the
    /// receiver's thread, or an RDMA control connection (no opening) to the rdma transport.
    fn hand_off(&self, e: &Entry, opening: Option<&[u8]>) {
        if e.gone.swap(true, Ordering::AcqRel) {
            return;
        }
        self.forget(e);
        let Some(stream) = e.stream.lock().expect("connection poisoned").take() else {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return;
        };
        let permit = ConnPermit::new(self.open.clone());
        let what = if opening.is_some() {
            "message"
        } else {
            "RDMA control"
        };
        if let Err(reason) = stream.set_nonblocking(false) {
            tracing::warn!(peer = %e.peer, %reason, "closed {what} connection");
            return;
        }
        let accepted = match opening {
            Some(opening) => self.messages.accept(stream, opening, permit),
            None => self.rdma.accept(stream, permit),
        };
        if let Err(reason) = accepted {
            tracing::warn!(peer = %e.peer, %reason, "closed {what} connection");
        }
    }
}

/// The index of the smallest of `counts` (the first of equals), which is counted as one more.
/// Homes a connection: connections arriving one after another go to every thread in turn, and
/// a thread whose connections closed gets the next ones.
fn take_least(counts: &[AtomicUsize]) -> usize {
    let i = counts
        .iter()
        .enumerate()
        .min_by_key(|(_, n)| n.load(Ordering::Relaxed))
        .map_or(0, |(i, _)| i);
    if let Some(n) = counts.get(i) {
        n.fetch_add(1, Ordering::Relaxed);
    }
    i
}

/// True at most once a second per `last`: for warnings a flood of clients could repeat.
fn once_a_second(last: &Mutex<Option<Instant>>) -> bool {
    let mut last = last.lock().expect("server poisoned");
    let now = Instant::now();
    let due = match *last {
        Some(t) => now.duration_since(t) >= Duration::from_secs(1),
        None => true,
    };
    if due {
        *last = Some(now);
    }
    due
}

/// Writes what is left of `out` without blocking; `Ok(true)` once it is all out.
fn write_pending(fd: RawFd, out: &mut Vec<u8>) -> Result<bool, String> {
    while !out.is_empty() {
        let iov = [sockio::iovec(out.as_ptr(), out.len())];
        // `out` is ours and unchanged for the call.
        match sockio::write_vectored_nonblocking(fd, &iov) {
            Ok(Some(0)) | Ok(None) => return Ok(false),
            Ok(Some(n)) => {
                out.drain(..n);
            }
            Err(e) => return Err(format!("sending: {e}")),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_homed_on_the_least_loaded_thread() {
        let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        let homes: Vec<usize> = (0..4).map(|_| take_least(&counts)).collect();
        assert_eq!(homes, [0, 1, 2, 0]);
        // Thread 1's connection closes: the next one goes there.
        counts[1].fetch_sub(1, Ordering::Relaxed);
        assert_eq!(take_least(&counts), 1);
        let held: Vec<usize> = counts.iter().map(|n| n.load(Ordering::Relaxed)).collect();
        assert_eq!(held, [2, 1, 1]);
        assert_eq!(take_least(&[]), 0, "no thread: index 0, nothing counted");
    }
}
