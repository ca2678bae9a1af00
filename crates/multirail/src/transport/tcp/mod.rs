//! The `tcp` transport, initiator side. Each peer is reached over paths, one per (local rail,
//! remote rail) pair, each with `connections_per_rail` connections bound to the local rail's
//! address and interface.
//!
//! Slices wait in the peer's queue and are dealt to rails only while a rail's window has room:
//! a small multiple of its bandwidth-delay product (EWMA bandwidth × smallest round trip seen). So the rail scheduler decides with little in flight, when its predicted completion
//! times mean something, and backlog waits here rather than in socket buffers. A slice whose
//! connection fails goes back to the front of the queue for another rail; a rail that keeps
//! failing is paused and probed back (rail health).
//!
//! Timeouts are the peer's, not each slice's: a peer with work outstanding (queued or in
//! flight) that answers nothing on any rail for `timeout_ms`, counted from the later of its
//! last answer and the moment that work began, has all of it failed with `Error::Timeout` and
//! its connections closed; no retry, reconnect or requeue restarts that clock. Within it, a
//! rail whose oldest slice waits half the timeout while another rail answers or stands idle is
//! dropped and its slices retried there (at most `max_retries` times), which tells a stalled
//! rail from a silent peer before the peer's deadline. Connecting (which waits for the peer's
//! handshake) never runs on the upkeep thread that checks these clocks.

mod conn;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use multirail_policy::dispatch::{
    Cause, Connection, DispatchConfig, Dispatcher, Event, Failed, PathId, Payload, Post, SliceId,
    Verdict,
};
use multirail_policy::pairing::{pair_rails, RailInfo, Reach};
use multirail_policy::qos::Priority;
use multirail_policy::slicing::SlicePlan;

use crate::error::{Error, Result};
use crate::peer::Peer;
use crate::qos::Qos;
use crate::rails::RailScheduler;
use crate::segment::BufferDescriptor;
use crate::stats::TrafficStats;
use crate::topology;
use crate::transport::{Prepared, Transport};
use crate::upkeep::{TimerKey, Timers};

use crate::transport::rails_view::{EngineRails, Located};
pub(crate) use conn::{keep_alive, TcpSettings};
use conn::{Conn, ConnOwner, ConnTarget, Outgoing};

/// One (local rail, remote rail) pair to a peer: its connections. What may go on it, and when,
/// is the dispatcher's.
struct Path {
    /// Local rail (scheduler index).
    rail: usize,
    remote: SocketAddr,
    /// Local address and interface the connections bind to; `None` for the fallback path used
    /// when no rail pairs (the kernel picks the route).
    bind: Option<(IpAddr, Option<String>)>,
    conns: Mutex<Vec<Arc<Conn>>>,
    next: AtomicUsize,
    /// One of `conns`, kept for HIGH slices so they never queue behind bulk bytes in a TCP
    /// stream or behind a bulk payload in the target's serving thread.
    high: Mutex<Option<Arc<Conn>>>,
    /// A reconnect or probe of this path is under way on its own thread.
    reconnecting: AtomicBool,
}

impl Path {
    /// A live connection for `connection`: the reserved one takes the HIGH connection, the
    /// rest take turns on the others; either falls back to any live connection.
    fn pick(&self, connection: Connection) -> Option<Arc<Conn>> {
        let high = self
            .high
            .lock()
            .expect("path poisoned")
            .clone()
            .filter(|c| !c.is_dead());
        if connection == Connection::Reserved {
            if let Some(h) = high {
                return Some(h);
            }
        }
        let conns = self.conns.lock().expect("path poisoned");
        let n = conns.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let is_high = |c: &Arc<Conn>| high.as_ref().is_some_and(|h| Arc::ptr_eq(h, c));
        (0..n)
            .map(|k| &conns[(start + k) % n])
            .find(|c| !c.is_dead() && !is_high(c))
            .or(high.as_ref())
            .cloned()
    }

    /// Makes a live connection the HIGH one if the current one is gone; returns how many
    /// connections are alive.
    fn elect_high(&self) -> usize {
        let mut high = self.high.lock().expect("path poisoned");
        let conns = self.conns.lock().expect("path poisoned");
        if high.as_ref().is_none_or(|h| h.is_dead()) {
            *high = conns.iter().find(|c| !c.is_dead()).cloned();
        }
        conns.iter().filter(|c| !c.is_dead()).count()
    }

    fn conns(&self) -> Vec<Arc<Conn>> {
        self.conns.lock().expect("path poisoned").clone()
    }

    /// Reports whether the local interface says its link is down.
    fn link_down(&self) -> bool {
        let Some((_, Some(iface))) = &self.bind else {
            return false;
        };
        std::fs::read_to_string(format!("/sys/class/net/{iface}/operstate"))
            .map(|s| s.trim() == "down")
            .unwrap_or(false)
    }
}

impl Located for Outgoing {
    fn location(&self) -> crate::memory::Location {
        self.location
    }
}

impl Payload for Outgoing {
    fn len(&self) -> u64 {
        u64::from(self.len)
    }

    fn split_off(&mut self, at: u64) -> Outgoing {
        Outgoing::split_off(self, at as u32)
    }
}

thread_local! {
    /// Reused by `pump` so dealing allocates nothing; a nested pump (a connection dying during a
    /// handoff) finds it taken and uses a fresh one.
    static POSTS: std::cell::RefCell<Vec<Post<Outgoing>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Everything needed to reach one peer.
pub(crate) struct TcpPeer {
    name: String,
    /// The peer's control address these connections were made for: a segment published again
    /// at another address (metadata store) needs new ones.
    addr: std::net::SocketAddr,
    /// The engine's id of the peer: its key in the engine's timer table.
    peer_id: u64,
    paths: Vec<Path>,
    dispatch: Mutex<Dispatcher<Outgoing>>,
    scheduler: Arc<RailScheduler>,
    qos: Arc<Qos>,
    timers: Arc<Timers>,
    settings: TcpSettings,
    stats: Arc<TrafficStats>,
    me: Weak<TcpPeer>,
    /// Closed by the engine: nothing more is posted, and queued slices fail.
    closed: AtomicBool,
    /// Found silent: the dispatcher's verdict, mirrored for lock-free checks.
    silent: AtomicBool,
    /// The deadline last given to the timer table (scheduler ns; 0 = none), so an earlier one
    /// is registered and a later one is left for the timer to find.
    armed_ns: AtomicU64,
    /// Why the last connection died: what queued slices fail with once every rail is down
    /// (a timeout stays a timeout).
    last_loss: Mutex<Option<Error>>,
}

/// The dispatcher's settings from the tcp settings.
fn dispatch_config(settings: &TcpSettings, qos: &Qos) -> DispatchConfig {
    DispatchConfig {
        timeout_ns: settings.timeout.as_nanos() as u64,
        max_retries: settings.max_retries,
        promotion: qos.promotion,
        ..settings.dispatch.clone()
    }
}

impl TcpPeer {
    /// Pairs rails with the peer's and opens every path. Fails when no path connects.
    fn connect(
        peer: &Peer,
        scheduler: &Arc<RailScheduler>,
        qos: &Arc<Qos>,
        timers: &Arc<Timers>,
        settings: &TcpSettings,
        stats: &Arc<TrafficStats>,
    ) -> Result<Arc<TcpPeer>> {
        let desc = peer.descriptor();
        let port = peer.addr.port();
        let mut remote: Vec<(RailInfo, IpAddr)> = desc
            .rails
            .iter()
            .filter_map(|r| {
                let ip: IpAddr = r.address.parse().ok()?;
                Some((
                    RailInfo {
                        name: r.name.clone(),
                        numa_node: r.numa_node,
                    },
                    ip,
                ))
            })
            .collect();
        if remote.is_empty() {
            remote.push((
                RailInfo {
                    name: "peer".into(),
                    numa_node: -1,
                },
                peer.addr.ip(),
            ));
        }
        let local = &scheduler.topology().rails;
        let local_info: Vec<RailInfo> = local
            .iter()
            .map(|r| RailInfo {
                name: r.name.clone(),
                numa_node: r.numa_node,
            })
            .collect();
        let remote_info: Vec<RailInfo> = remote.iter().map(|(i, _)| i.clone()).collect();
        let pairs = pair_rails(&local_info, &remote_info, |l, r| {
            if local[l].same_subnet(remote[r].1) {
                Reach::SameSubnet
            } else {
                Reach::No
            }
        });
        let path = |rail: usize, remote: SocketAddr, bind: Option<(IpAddr, Option<String>)>| Path {
            rail,
            remote,
            bind,
            conns: Mutex::default(),
            high: Mutex::default(),
            next: AtomicUsize::new(0),
            reconnecting: AtomicBool::new(false),
        };
        let mut paths = Vec::new();
        for (l, pair) in pairs.iter().enumerate() {
            let Some(r) = *pair else { continue };
            paths.push(path(
                l,
                SocketAddr::new(remote[r].1, port),
                Some((
                    local[l].address,
                    local[l].is_interface.then(|| local[l].name.clone()),
                )),
            ));
        }
        if paths.is_empty() {
            // No rail shares a subnet with the peer: one path the kernel routes, charged to
            // rail 0 for scheduling.
            tracing::info!(peer = %peer.name, "no local rail pairs with the peer's rails; using the routed path");
            paths.push(path(0, peer.addr, None));
        }
        let path_rails: Vec<usize> = paths.iter().map(|p| p.rail).collect();
        let tcp = Arc::new_cyclic(|me| TcpPeer {
            name: peer.name.clone(),
            addr: peer.addr,
            peer_id: peer.id,
            paths,
            dispatch: Mutex::new(Dispatcher::new(dispatch_config(settings, qos), &path_rails)),
            scheduler: scheduler.clone(),
            qos: qos.clone(),
            timers: timers.clone(),
            settings: settings.clone(),
            stats: stats.clone(),
            me: me.clone(),
            closed: AtomicBool::new(false),
            silent: AtomicBool::new(false),
            armed_ns: AtomicU64::new(0),
            last_loss: Mutex::new(None),
        });
        let open_path = |p: PathId| -> Option<Error> {
            let path = &tcp.paths[p];
            let mut failed = None;
            for _ in 0..settings.connections_per_rail + 1 {
                match tcp.open(path) {
                    Ok(c) => path.conns.lock().expect("path poisoned").push(c),
                    Err(e) => {
                        tcp.lock().on_path_error(tcp.scheduler.now_ns(), p);
                        failed = Some(e);
                        break;
                    }
                }
            }
            tcp.refresh_path(p);
            failed
        };
        // Paths connect side by side: against a peer that is up but silent, each waits
        // `connect_timeout_ms` for its handshake, and one after another they would hold the
        // submitter that long per rail.
        let failures: Vec<Option<Error>> = if tcp.paths.len() == 1 {
            vec![open_path(0)]
        } else {
            std::thread::scope(|scope| {
                let running: Vec<_> = (0..tcp.paths.len())
                    .map(|p| {
                        std::thread::Builder::new()
                            .name("mr-connect".into())
                            .spawn_scoped(scope, move || open_path(p))
                            .map_err(|_| p)
                    })
                    .collect();
                running
                    .into_iter()
                    .map(|r| match r {
                        Ok(h) => h.join().expect("connect thread panicked"),
                        // No thread to spare: connect here.
                        Err(p) => open_path(p),
                    })
                    .collect()
            })
        };
        let last_err = failures.into_iter().flatten().last();
        let usable = {
            let d = tcp.lock();
            (0..tcp.paths.len()).any(|p| d.is_usable(p))
        };
        if !usable {
            return Err(last_err.unwrap_or_else(|| Error::SegmentUnreachable {
                name: peer.name.clone(),
                reason: "no rail reaches it".into(),
            }));
        }
        Ok(tcp)
    }

    fn lock(&self) -> MutexGuard<'_, Dispatcher<Outgoing>> {
        self.dispatch.lock().expect("peer poisoned")
    }

    fn rails(&self, now: Instant) -> EngineRails<'_> {
        EngineRails::new(&self.scheduler, &self.qos, now)
    }

    fn open(&self, path: &Path) -> Result<Arc<Conn>> {
        let target = ConnTarget {
            peer: &self.name,
            remote: path.remote,
            bind: path.bind.as_ref().map(|(a, i)| (*a, i.as_deref())),
            rail: path.rail,
        };
        let counters = match &path.bind {
            Some(_) => self.scheduler.counters(path.rail),
            None => self.stats.rail(
                &topology::interface_for_address(path.remote.ip())
                    .unwrap_or_else(|| "tcp".to_owned()),
            ),
        };
        let owner: Weak<dyn ConnOwner> = self.me.clone();
        Conn::open(&target, &self.settings, counters, owner)
    }

    /// Tells the dispatcher how many connections of path `p` are alive (electing a new HIGH
    /// connection if its was lost).
    fn refresh_path(&self, p: PathId) {
        let live = self.paths[p].elect_high();
        self.lock().on_path(self.scheduler.now_ns(), p, live);
    }

    /// True when no path can carry slices and none is coming back soon, or the peer went
    /// silent (a fresh `TcpPeer` then gives new requests their own full timeout).
    pub(crate) fn is_dead(&self) -> bool {
        self.closed.load(Ordering::Acquire)
            || self.silent.load(Ordering::Acquire)
            || self.lock().is_dead()
    }

    fn timeout_error(&self) -> Error {
        Error::Timeout {
            peer: self.name.clone(),
            timeout_ms: self.settings.timeout.as_millis() as u64,
        }
    }

    fn down_error(&self) -> Error {
        Error::PeerDisconnected {
            peer: self.name.clone(),
            reason: "every rail to it is down".into(),
        }
    }

    /// Queues the slices of one request and deals out what the rails' windows allow. Hands
    /// the request back untouched when this peer is dead or was found silent, for the caller
    /// to post on fresh connections: a request submitted after the verdict gets its own
    /// timeout.
    fn post(&self, req: Prepared, plan: &SlicePlan) -> std::result::Result<(), Prepared> {
        if self.is_dead() {
            return Err(req);
        }
        let Some(slices) = req.slices(plan) else {
            return Ok(());
        };
        let now_ns = self.scheduler.now_ns();
        let priority = req.priority;
        {
            let mut d = self.lock();
            if d.is_silent() || d.is_closed() {
                return Err(req);
            }
            req.task.add_parts(slices.len() as u32);
            d.on_submit(
                now_ns,
                priority,
                slices.map(|s| Outgoing {
                    op: req.op,
                    local: req.local + s.offset as usize,
                    remote: req.remote + s.offset,
                    key: req.buffer.key,
                    len: s.length as u32,
                    task: req.task.clone(),
                    id: SliceId { path: 0, seq: 0 },
                    location: req.location,
                    priority: req.priority,
                    last_error: None,
                }),
            );
            self.report_depths(&mut d);
            self.arm(&mut d);
        }
        self.pump();
        Ok(())
    }

    /// Brings the engine-wide queue depths up to date with this peer's queues.
    fn report_depths(&self, d: &mut Dispatcher<Outgoing>) {
        if let Some((old, new)) = d.take_depth_change() {
            self.qos.depths_changed(old, new);
        }
    }

    /// Registers the dispatcher's next deadline with the engine's timer table when it is
    /// earlier than the one registered. A later one is left alone: the timer fires early,
    /// finds nothing due, and registers the real one then.
    fn arm(&self, d: &mut Dispatcher<Outgoing>) {
        let Some(at) = d.poll_timeout() else {
            return;
        };
        let armed = self.armed_ns.load(Ordering::Acquire);
        if armed == 0 || at < armed {
            self.armed_ns.store(at.max(1), Ordering::Release);
            self.timers.arm(TimerKey::Peer(self.peer_id), at);
        }
    }

    /// Fails what the dispatcher gave up on, with the error each verdict means.
    fn settle(&self, d: &mut Dispatcher<Outgoing>) {
        while let Some(Failed { item, verdict, .. }) = d.poll_failed() {
            let err = match verdict {
                Verdict::Timeout => self.timeout_error(),
                Verdict::Failed(_) => item.last_error.clone().unwrap_or_else(|| self.down_error()),
                Verdict::RailsDown => {
                    // Say why, from the slice's own failure or the peer's last lost
                    // connection. Rails lost to timeouts mean the peer went silent.
                    let closed = self.closed.load(Ordering::Acquire);
                    let last = item.last_error.clone().or_else(|| {
                        (!closed)
                            .then(|| self.last_loss.lock().expect("peer poisoned").clone())
                            .flatten()
                    });
                    match last {
                        Some(e @ Error::Timeout { .. }) => e,
                        Some(e) => Error::PeerDisconnected {
                            peer: self.name.clone(),
                            reason: format!("every rail to it is down (last error: {e})"),
                        },
                        None => self.down_error(),
                    }
                }
            };
            item.task.part_done(Err(err));
        }
        self.report_depths(d);
    }

    /// Deals queued slices while the dispatcher allows, then hands them to their connections
    /// outside the lock. A slice whose connection turns out dead goes back to the dispatcher
    /// and is dealt again.
    fn pump(&self) {
        let mut out = POSTS.with(|v| std::mem::take(&mut *v.borrow_mut()));
        loop {
            {
                let now = Instant::now();
                let mut rails = self.rails(now);
                let now_ns = self.scheduler.ns(now);
                let mut d = self.lock();
                while let Some(post) = d.poll_post(now_ns, &mut rails) {
                    out.push(post);
                }
                self.settle(&mut d);
            }
            if out.is_empty() || !self.hand_over(&mut out) {
                break;
            }
        }
        POSTS.with(|v| {
            let mut v = v.borrow_mut();
            if v.capacity() < out.capacity() {
                *v = out;
            }
        });
    }

    /// Gives each dealt slice to its connection: HIGH ones written at once where the connection
    /// allows (no sender-thread wake-up on their path), the rest queued for the sender thread.
    /// Slices refused by a dead connection go back to the dispatcher; returns whether any did,
    /// so the caller deals again.
    fn hand_over(&self, out: &mut Vec<Post<Outgoing>>) -> bool {
        let mut refused: Vec<Post<Outgoing>> = Vec::new();
        for mut post in out.drain(..) {
            let Some(conn) = self.paths[post.path].pick(post.connection) else {
                refused.push(post);
                continue;
            };
            post.item.id = post.id;
            // A promoted slice travels, and is counted, at the level it was dealt at.
            post.item.priority = post.priority;
            let Post {
                id,
                item,
                path,
                rail,
                priority,
                connection,
            } = post;
            let sent = if priority == Priority::High {
                conn.send_now(item)
            } else {
                conn.send(item)
            };
            if let Err(item) = sent {
                refused.push(Post {
                    id,
                    item,
                    path,
                    rail,
                    priority,
                    connection,
                });
            }
        }
        if refused.is_empty() {
            return false;
        }
        let mut paths: Vec<PathId> = refused.iter().map(|p| p.path).collect();
        paths.sort_unstable();
        paths.dedup();
        for p in paths {
            self.refresh_path(p);
        }
        let now = Instant::now();
        let mut rails = self.rails(now);
        let now_ns = self.scheduler.ns(now);
        let mut d = self.lock();
        // Back to the head in dealing order: hand back the last first.
        for post in refused.into_iter().rev() {
            d.on_refused(now_ns, post, &mut rails);
        }
        true
    }

    /// Runs what the dispatcher has due (silence, stalled paths, probes, expiry), does what
    /// it says, and registers its next deadline.
    pub(crate) fn on_timer(&self, now: Instant) {
        if self.closed.load(Ordering::Acquire) || self.silent.load(Ordering::Acquire) {
            return;
        }
        self.armed_ns.store(0, Ordering::Release);
        let now_ns = self.scheduler.ns(now);
        let mut events = Vec::new();
        {
            let mut rails = self.rails(now);
            let mut d = self.lock();
            d.on_timeout(now_ns, &mut rails);
            while let Some(e) = d.poll_event() {
                events.push(e);
            }
            if d.is_silent() {
                // Under the lock: a request posted from here on goes to a fresh `TcpPeer`.
                self.silent.store(true, Ordering::Release);
            }
            self.settle(&mut d);
        }
        for event in events {
            match event {
                Event::Silent => {
                    tracing::warn!(
                        peer = %self.name,
                        timeout_ms = self.settings.timeout.as_millis() as u64,
                        "peer answered nothing for the timeout: its requests fail"
                    );
                    let err = self.timeout_error();
                    for path in &self.paths {
                        // Killing calls back into this peer (slices handed back): no lock
                        // held across it.
                        for c in path.conns() {
                            c.kill(err.clone());
                        }
                    }
                }
                Event::DropPath { path, stalled } => {
                    tracing::warn!(
                        peer = %self.name,
                        rail = self.paths[path].rail,
                        stalled,
                        "rail answered nothing in time: its connections are closed"
                    );
                    // The whole path goes, idle connections too: they share the stalled link,
                    // and a retry dealt to one of them would stall again while the peer's
                    // deadline runs. Until a reconnect proves the path again, retries go to
                    // the other rails.
                    for c in self.paths[path].conns() {
                        c.kill(self.timeout_error());
                    }
                    self.refresh_path(path);
                }
                Event::Probe(p) => {
                    let missing = self.missing(p);
                    if missing > 0 && !self.paths[p].link_down() {
                        self.reconnect_in_background(p, missing, true);
                    } else {
                        // Nothing to reconnect: the connections survived the pause.
                        self.lock().on_probe(now_ns, p, missing == 0);
                        self.refresh_path(p);
                    }
                }
            }
        }
        let mut d = self.lock();
        self.arm(&mut d);
        drop(d);
        self.pump();
    }

    /// Connections path `p` lacks.
    fn missing(&self, p: PathId) -> usize {
        let alive = self.paths[p]
            .conns()
            .iter()
            .filter(|c| !c.is_dead())
            .count();
        (self.settings.connections_per_rail + 1).saturating_sub(alive)
    }

    /// The link duty, on the engine's link timer: closes connections of rails whose link went
    /// down and reconnects healthy paths that lost connections (on threads of their own).
    pub(crate) fn check_links(&self) {
        if self.closed.load(Ordering::Acquire) || self.silent.load(Ordering::Acquire) {
            return;
        }
        for (p, path) in self.paths.iter().enumerate() {
            let down = path.link_down();
            if down {
                for c in path.conns().iter().filter(|c| !c.is_dead()) {
                    c.kill(Error::PeerDisconnected {
                        peer: self.name.clone(),
                        reason: format!(
                            "link of rail {} is down",
                            self.scheduler.topology().rails[path.rail].name
                        ),
                    });
                }
            }
            let missing = self.missing(p);
            if !down && missing > 0 && self.lock().is_up(p) {
                self.reconnect_in_background(p, missing, false);
            }
        }
    }

    /// Opens `missing` connections of path `p` (a probe when `probe`) on a thread of its own:
    /// a handshake with a peer that does not answer takes up to `connect_timeout_ms`, and the
    /// timer thread must keep every peer's timeouts on time meanwhile. At most one per path.
    fn reconnect_in_background(&self, p: PathId, missing: usize, probe: bool) {
        let path = &self.paths[p];
        if path.reconnecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(me) = self.me.upgrade() else {
            path.reconnecting.store(false, Ordering::Release);
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("mr-reconnect".into())
            .spawn(move || {
                me.reconnect(p, missing, probe);
                me.paths[p].reconnecting.store(false, Ordering::Release);
                me.pump();
            });
        if let Err(e) = spawned {
            tracing::warn!(peer = %self.name, error = %e, "cannot spawn a reconnect thread");
            path.reconnecting.store(false, Ordering::Release);
        }
    }

    fn reconnect(&self, p: PathId, missing: usize, probe: bool) {
        let path = &self.paths[p];
        let mut ok = true;
        let mut fresh = Vec::new();
        for _ in 0..missing {
            match self.open(path) {
                Ok(c) => fresh.push(c),
                Err(e) => {
                    tracing::debug!(peer = %self.name, rail = path.rail, error = %e, "reconnect failed");
                    ok = false;
                    break;
                }
            }
        }
        if self.closed.load(Ordering::Acquire) || self.silent.load(Ordering::Acquire) {
            // The peer was closed or given up on while we connected.
            for c in fresh {
                c.kill(self.down_error());
            }
            return;
        }
        {
            let mut cs = path.conns.lock().expect("path poisoned");
            cs.retain(|c| !c.is_dead());
            cs.extend(fresh);
        }
        let now_ns = self.scheduler.now_ns();
        {
            let mut d = self.lock();
            if probe {
                d.on_probe(now_ns, p, ok);
                if ok {
                    tracing::info!(peer = %self.name, rail = path.rail, "rail rejoined after a successful probe");
                }
            } else if !ok && d.on_path_error(now_ns, p) {
                tracing::warn!(peer = %self.name, rail = path.rail, "rail paused after repeated errors");
            }
            self.arm(&mut d);
        }
        self.refresh_path(p);
    }

    /// Closes every connection; slices in flight fail with `reason`.
    pub(crate) fn close(&self, reason: &str) {
        self.closed.store(true, Ordering::Release);
        for path in &self.paths {
            // Killing calls back into the peer (slices handed back): no lock held across it.
            let conns: Vec<Arc<Conn>> = path
                .conns
                .lock()
                .expect("path poisoned")
                .drain(..)
                .collect();
            path.high.lock().expect("path poisoned").take();
            for c in conns {
                c.kill(Error::PeerDisconnected {
                    peer: self.name.clone(),
                    reason: reason.to_owned(),
                });
            }
        }
        let now = Instant::now();
        let mut rails = self.rails(now);
        let mut d = self.lock();
        d.close(self.scheduler.ns(now), &mut rails);
        self.settle(&mut d);
        drop(d);
        self.timers.disarm(TimerKey::Peer(self.peer_id));
    }
}

impl ConnOwner for TcpPeer {
    fn answered(&self, id: SliceId, posted: Instant, now: Instant, ok: bool) {
        let refill = {
            let mut rails = self.rails(now);
            let now_ns = self.scheduler.ns(now);
            let mut d = self.lock();
            if ok {
                d.on_completed(now_ns, id, Some(self.scheduler.ns(posted)), &mut rails)
            } else {
                d.on_rejected(now_ns, id, &mut rails)
            }
        };
        if refill {
            self.pump();
        }
    }

    fn connection_lost(&self, rail: usize, err: &Error) {
        *self.last_loss.lock().expect("peer poisoned") = Some(err.clone());
        let p = self.lock().path_of(rail);
        if let Some(p) = p {
            let paused = {
                let mut d = self.lock();
                let paused = d.on_path_error(self.scheduler.now_ns(), p);
                self.arm(&mut d);
                paused
            };
            if paused {
                tracing::warn!(peer = %self.name, rail, error = %err, "rail paused after repeated errors");
            }
            self.refresh_path(p);
        }
    }

    fn slices_returned(&self, _rail: usize, slices: Vec<Outgoing>, err: Error) {
        let cause = if matches!(err, Error::Timeout { .. }) {
            Cause::Timeout
        } else {
            Cause::Lost
        };
        {
            let now = Instant::now();
            let mut rails = self.rails(now);
            let now_ns = self.scheduler.ns(now);
            let mut d = self.lock();
            for mut s in slices {
                s.last_error = Some(err.clone());
                let id = s.id;
                d.on_failed(now_ns, id, s, cause, &mut rails);
            }
            self.settle(&mut d);
        }
        self.pump();
    }
}

impl Drop for TcpPeer {
    fn drop(&mut self) {
        self.close("engine shut down");
    }
}

/// The tcp state of one peer: its connections, and the lock that makes them.
#[derive(Default)]
struct PeerSlot {
    /// Connections, made on first use and remade when all have failed.
    tcp: Mutex<Option<Arc<TcpPeer>>>,
    /// Held while (re)making `tcp`, so one thread connects and others wait for its result;
    /// holds when the last attempt failed and why. Apart from `tcp` because connecting to a
    /// stopped peer waits `connect_timeout_ms` for its handshake, and the timer thread, which
    /// takes `tcp` for every peer's deadlines, must not wait that long.
    connect: Mutex<Option<(Instant, Error)>>,
}

/// The tcp transport: the state of each peer it reaches, by the engine's peer id; the rail
/// scheduler is engine-wide.
pub(crate) struct TcpTransport {
    peers: std::sync::RwLock<std::collections::HashMap<u64, Arc<PeerSlot>>>,
    settings: TcpSettings,
    scheduler: Arc<RailScheduler>,
    qos: Arc<Qos>,
    timers: Arc<Timers>,
    stats: Arc<TrafficStats>,
}

impl TcpTransport {
    pub(crate) fn new(
        settings: TcpSettings,
        scheduler: Arc<RailScheduler>,
        qos: Arc<Qos>,
        timers: Arc<Timers>,
        stats: Arc<TrafficStats>,
    ) -> Self {
        TcpTransport {
            peers: Default::default(),
            settings,
            scheduler,
            qos,
            timers,
            stats,
        }
    }

    /// The peer's live connections, made afresh when there are none or they were given up on.
    /// Connecting happens outside `peer.tcp` (one thread at a time, under `peer.tcp_connect`):
    /// a stopped peer keeps it waiting `connect_timeout_ms`, and the upkeep thread takes
    /// `peer.tcp` every 50 ms for the timeouts of every peer.
    fn connected(&self, peer: &Peer) -> Result<Arc<TcpPeer>> {
        let slot = self.slot(peer.id);
        let live = || {
            let moved = {
                let mut current = slot.tcp.lock().expect("peer poisoned");
                match current.as_ref() {
                    Some(p) if p.addr != peer.addr => current.take(),
                    _ => None,
                }
            };
            // The segment is now served at another address: the old connections lead to a
            // process that no longer answers for it. Closed outside the lock, since closing
            // hands slices back.
            if let Some(moved) = moved {
                moved.close("the segment moved to another address");
            }
            slot.tcp
                .lock()
                .expect("peer poisoned")
                .clone()
                .filter(|p| !p.is_dead())
        };
        if let Some(p) = live() {
            return Ok(p);
        }
        let asked = Instant::now();
        let mut last_failure = slot.connect.lock().expect("peer poisoned");
        // Another thread may have connected while this one waited, or failed to: an attempt
        // that ended since this thread asked answers for it too, so submitters lining up
        // behind a stopped peer do not wait one connect timeout each.
        if let Some(p) = live() {
            return Ok(p);
        }
        if let Some((ended, err)) = last_failure.as_ref() {
            if *ended >= asked {
                return Err(err.clone());
            }
        }
        match TcpPeer::connect(
            peer,
            &self.scheduler,
            &self.qos,
            &self.timers,
            &self.settings,
            &self.stats,
        ) {
            Ok(fresh) => {
                *last_failure = None;
                *slot.tcp.lock().expect("peer poisoned") = Some(fresh.clone());
                Ok(fresh)
            }
            Err(e) => {
                *last_failure = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// The tcp state of peer `id`, made on first use.
    fn slot(&self, id: u64) -> Arc<PeerSlot> {
        if let Some(s) = self.peers.read().expect("peers poisoned").get(&id) {
            return s.clone();
        }
        self.peers
            .write()
            .expect("peers poisoned")
            .entry(id)
            .or_default()
            .clone()
    }

    /// The connections of peer `id`, if it has any.
    fn peer(&self, id: u64) -> Option<Arc<TcpPeer>> {
        let slot = self
            .peers
            .read()
            .expect("peers poisoned")
            .get(&id)
            .cloned()?;
        let tcp = slot.tcp.lock().expect("peer poisoned").clone();
        tcp
    }

    /// The health of every path to every peer with connections: its local rail (scheduler
    /// index) and state.
    pub(crate) fn path_health(&self) -> Vec<(usize, multirail_policy::health::RailState)> {
        let mut out = Vec::new();
        for peer in self.connected_peers() {
            let d = peer.lock();
            for (i, path) in peer.paths.iter().enumerate() {
                out.push((path.rail, d.health_state(i)));
            }
        }
        out
    }

    /// Every peer with connections.
    fn connected_peers(&self) -> Vec<Arc<TcpPeer>> {
        let slots: Vec<Arc<PeerSlot>> = self
            .peers
            .read()
            .expect("peers poisoned")
            .values()
            .cloned()
            .collect();
        slots
            .iter()
            .filter_map(|s| s.tcp.lock().expect("peer poisoned").clone())
            .collect()
    }

    /// Deals every peer's queued slices that rails and slots now allow.
    pub(crate) fn pump_all(&self) {
        for t in self.connected_peers() {
            t.pump();
        }
    }

    /// Runs the dispatcher deadline of peer `id`.
    pub(crate) fn on_timer(&self, id: u64, now: Instant) {
        if let Some(t) = self.peer(id) {
            t.on_timer(now);
        }
    }

    /// The link check of every peer's paths.
    pub(crate) fn check_links(&self) {
        for t in self.connected_peers() {
            t.check_links();
        }
    }

    /// Closes the connections to peer `id` and forgets it (its segment was closed); its slices
    /// in flight fail with `reason`. A peer never connected is no error.
    pub(crate) fn close_peer(&self, id: u64, reason: &str) {
        let slot = self.peers.write().expect("peers poisoned").remove(&id);
        let tcp = slot.and_then(|s| s.tcp.lock().expect("peer poisoned").take());
        if let Some(t) = tcp {
            t.close(reason);
        }
    }

    /// Closes every peer's connections; their slices in flight fail.
    pub(crate) fn shutdown(&self, reason: &str) {
        let slots: Vec<Arc<PeerSlot>> = self
            .peers
            .read()
            .expect("peers poisoned")
            .values()
            .cloned()
            .collect();
        for s in slots {
            let tcp = s.tcp.lock().expect("peer poisoned").take();
            if let Some(t) = tcp {
                t.close(reason);
            }
        }
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn prepare(&self, peer: &Arc<Peer>, _buffer: &BufferDescriptor) -> Result<()> {
        self.connected(peer).map(|_| ())
    }

    fn post(&self, peer: &Arc<Peer>, req: Prepared, plan: &SlicePlan) {
        let mut req = req;
        // The connections may be given up on between `connected` and `post` (a silent peer's
        // verdict); then once more on fresh ones.
        for _ in 0..2 {
            match self.connected(peer) {
                Ok(t) => match t.post(req, plan) {
                    Ok(()) => return,
                    Err(back) => req = back,
                },
                Err(e) => return req.fail(e),
            }
        }
        req.fail(Error::PeerDisconnected {
            peer: peer.name.clone(),
            reason: "every rail to it is down".into(),
        });
    }
}
