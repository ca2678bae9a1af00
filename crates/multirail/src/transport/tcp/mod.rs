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
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use multirail_policy::health::{HealthConfig, RailHealth};
use multirail_policy::pairing::{pair_rails, RailInfo, Reach};
use multirail_policy::qos::{PriorityQueues, LEVELS};
use multirail_policy::selector::SliceShape;
use multirail_policy::slicing::SlicePlan;

use crate::error::{Error, Result};
use crate::peer::Peer;
use crate::qos::Qos;
use crate::rails::RailScheduler;
use crate::segment::BufferDescriptor;
use crate::stats::TrafficStats;
use crate::topology;
use crate::transport::{Prepared, Transport};

pub(crate) use conn::{keep_alive, TcpSettings};
use conn::{Conn, ConnOwner, ConnTarget, Outgoing};

/// One (local rail, remote rail) pair to a peer.
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
    health: Mutex<RailHealth>,
    /// Health is up and at least one connection is alive.
    usable: AtomicBool,
    /// A reconnect or probe of this path is under way on its own thread.
    reconnecting: AtomicBool,
}

impl Path {
    /// A live connection for a slice of `priority`: HIGH takes the reserved connection, the
    /// rest take turns on the others; either falls back to any live connection.
    fn pick(&self, priority: u8) -> Option<Arc<Conn>> {
        let high = self
            .high
            .lock()
            .expect("path poisoned")
            .clone()
            .filter(|c| !c.is_dead());
        if priority == multirail_policy::qos::HIGH {
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

    /// Makes a live connection the HIGH one if the current one is gone.
    fn elect_high(&self) {
        let mut high = self.high.lock().expect("path poisoned");
        if high.as_ref().is_some_and(|h| !h.is_dead()) {
            return;
        }
        *high = self
            .conns
            .lock()
            .expect("path poisoned")
            .iter()
            .find(|c| !c.is_dead())
            .cloned();
    }

    fn refresh_usable(&self) {
        self.elect_high();
        let up = self.health.lock().expect("path poisoned").is_up();
        let live = self
            .conns
            .lock()
            .expect("path poisoned")
            .iter()
            .any(|c| !c.is_dead());
        self.usable.store(up && live, Ordering::Release);
    }

    fn is_up(&self) -> bool {
        self.health.lock().expect("path poisoned").is_up()
    }

    /// The longest any live connection's oldest slice has waited for its answer (zero when
    /// nothing is in flight); `None` without a live connection.
    fn longest_wait(&self, now: Instant) -> Option<Duration> {
        let conns: Vec<Arc<Conn>> = self.conns.lock().expect("path poisoned").clone();
        conns
            .iter()
            .filter(|c| !c.is_dead())
            .map(|c| c.oldest_wait(now))
            .max()
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

/// A slice waiting for a rail.
struct Queued {
    slice: Outgoing,
    since: Instant,
    /// Why it was handed back, if it was.
    error: Option<Error>,
}

impl Queued {
    fn len_bytes(&self) -> u64 {
        self.slice.len as u64
    }
}

/// A slice dealt to a connection of path `path`, handed to it once the peer's lock is released:
/// handing over wakes the connection's sender thread (or, for HIGH, writes the slice), and
/// neither should happen while other threads wait for the lock.
struct Handoff {
    path: usize,
    conn: Arc<Conn>,
    queued: Queued,
    prio: u8,
}

thread_local! {
    /// Reused by `pump` so dealing allocates nothing; a nested pump (a connection dying during a
    /// handoff) finds it taken and uses a fresh one.
    static HANDOFFS: std::cell::RefCell<Vec<Handoff>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Window used before a path has measured a round trip.
const INITIAL_WINDOW: u64 = 1 << 20;
/// Bandwidth-delay products a window holds before the time cap: on a CPU-bound link such as
/// loopback the smallest round trip understates what keeps the pipe full (4 MiB writes: 2.9 GB/s
/// with 4, 3.7 with 8; 16 let a bulk process on the same host double another's HIGH p99).
const WINDOW_BDPS: f64 = 8.0;
/// Bandwidth-delay products bulk may keep in flight on a rail while HIGH work is active: what
/// keeps the rail busy, so a HIGH slice finds almost nothing queued ahead of it.
const LEAN_BDPS: f64 = 1.0;
/// Most time's worth of a rail's bandwidth one bulk slice carries while HIGH work is active.
const HIGH_WAIT_NS: u64 = 250_000;
/// Bulk slices are not cut below this while HIGH work is active: smaller ones cost more per
/// byte than the wait they save.
const MIN_BULK_CHUNK: u64 = 16 << 10;
/// Most time's worth of a rail's bandwidth a window holds.
const WINDOW_MAX_QUEUE_NS: u64 = 1_000_000;

/// What one path may hold in flight, bytes.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// For full speed: several bandwidth-delay products, time-capped.
    full: u64,
    /// For bulk beside HIGH: about what keeps the rail busy.
    lean: u64,
}

/// The peer's queue of slices and what each path has in flight.
struct Dispatch {
    /// Strict HIGH → MEDIUM → LOW with promotion (multirail-policy::qos).
    queue: PriorityQueues<Queued>,
    /// Depths last reported to the engine-wide QoS counters.
    reported: [usize; LEVELS],
    /// Per path: bytes handed to its connections and not yet answered.
    posted: Vec<u64>,
    /// Per path: smallest time from posting to answer seen, less the time to put that slice on
    /// the wire at the rail's estimated bandwidth, ns; `u64::MAX` = none yet. What the path
    /// adds to any slice whatever its length, so the bandwidth-delay product does not grow
    /// with the slices that happened to be measured.
    min_fixed_ns: Vec<u64>,
    rails: Vec<usize>,
    ewma: Vec<f64>,
    /// Since when (scheduler ns) this peer has had slices queued or in flight without a break;
    /// `None` while it has none. With `TcpPeer::last_heard_ns`, when the peer's silence began.
    outstanding_since: Option<u64>,
}

impl Dispatch {
    fn has_outstanding(&self) -> bool {
        !self.queue.is_empty() || self.posted.iter().any(|&b| b > 0)
    }
}

/// Everything needed to reach one peer.
pub(crate) struct TcpPeer {
    name: String,
    paths: Vec<Path>,
    /// Local rail → index into `paths`.
    rail_path: Vec<Option<usize>>,
    dispatch: Mutex<Dispatch>,
    scheduler: Arc<RailScheduler>,
    qos: Arc<Qos>,
    settings: TcpSettings,
    stats: Arc<TrafficStats>,
    me: Weak<TcpPeer>,
    closed: AtomicBool,
    /// Scheduler ns of the last answer on any connection; 0 = none yet.
    last_heard_ns: AtomicU64,
    /// Set once the peer was found silent for the timeout: every slice of it fails, none is
    /// retried, until its connections are gone and a fresh `TcpPeer` takes over. Set under the
    /// `dispatch` lock, so `post` either queues before the verdict or sees it.
    silent: AtomicBool,
    /// Why the last connection died: what queued slices fail with once every rail is down
    /// (a timeout stays a timeout).
    last_loss: Mutex<Option<Error>>,
}

impl TcpPeer {
    /// Pairs rails with the peer's and opens every path. Fails when no path connects.
    fn connect(
        peer: &Peer,
        scheduler: &Arc<RailScheduler>,
        qos: &Arc<Qos>,
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
        let health = || Mutex::new(RailHealth::new(HealthConfig::default()));
        let mut paths = Vec::new();
        let mut rail_path = vec![None; local.len().max(1)];
        for (l, pair) in pairs.iter().enumerate() {
            let Some(r) = *pair else { continue };
            rail_path[l] = Some(paths.len());
            paths.push(Path {
                rail: l,
                remote: SocketAddr::new(remote[r].1, port),
                bind: Some((
                    local[l].address,
                    local[l].is_interface.then(|| local[l].name.clone()),
                )),
                conns: Mutex::default(),
                high: Mutex::default(),
                next: AtomicUsize::new(0),
                health: health(),
                usable: AtomicBool::new(false),
                reconnecting: AtomicBool::new(false),
            });
        }
        if paths.is_empty() {
            // No rail shares a subnet with the peer: one path the kernel routes, charged to
            // rail 0 for scheduling.
            tracing::info!(peer = %peer.name, "no local rail pairs with the peer's rails; using the routed path");
            rail_path[0] = Some(0);
            paths.push(Path {
                rail: 0,
                remote: peer.addr,
                bind: None,
                conns: Mutex::default(),
                high: Mutex::default(),
                next: AtomicUsize::new(0),
                health: health(),
                usable: AtomicBool::new(false),
                reconnecting: AtomicBool::new(false),
            });
        }
        let npaths = paths.len();
        let tcp = Arc::new_cyclic(|me| TcpPeer {
            name: peer.name.clone(),
            paths,
            rail_path,
            dispatch: Mutex::new(Dispatch {
                queue: PriorityQueues::new(qos.promotion),
                reported: [0; LEVELS],
                posted: vec![0; npaths],
                min_fixed_ns: vec![u64::MAX; npaths],
                rails: Vec::new(),
                ewma: Vec::new(),
                outstanding_since: None,
            }),
            scheduler: scheduler.clone(),
            qos: qos.clone(),
            settings: settings.clone(),
            stats: stats.clone(),
            me: me.clone(),
            closed: AtomicBool::new(false),
            last_heard_ns: AtomicU64::new(0),
            silent: AtomicBool::new(false),
            last_loss: Mutex::new(None),
        });
        let open_path = |path: &Path| -> Option<Error> {
            let mut failed = None;
            for _ in 0..settings.connections_per_rail + 1 {
                match tcp.open(path) {
                    Ok(c) => path.conns.lock().expect("path poisoned").push(c),
                    Err(e) => {
                        path.health
                            .lock()
                            .expect("path poisoned")
                            .on_error(tcp.scheduler.now_ns());
                        failed = Some(e);
                        break;
                    }
                }
            }
            path.refresh_usable();
            failed
        };
        // Paths connect side by side: against a peer that is up but silent, each waits
        // `connect_timeout_ms` for its handshake, and one after another they would hold the
        // submitter that long per rail.
        let failures: Vec<Option<Error>> = if tcp.paths.len() == 1 {
            vec![open_path(&tcp.paths[0])]
        } else {
            std::thread::scope(|scope| {
                let running: Vec<_> = tcp
                    .paths
                    .iter()
                    .map(|path| {
                        std::thread::Builder::new()
                            .name("mr-connect".into())
                            .spawn_scoped(scope, || open_path(path))
                            .map_err(|_| path)
                    })
                    .collect();
                running
                    .into_iter()
                    .map(|r| match r {
                        Ok(h) => h.join().expect("connect thread panicked"),
                        // No thread to spare: connect here.
                        Err(path) => open_path(path),
                    })
                    .collect()
            })
        };
        let last_err = failures.into_iter().flatten().last();
        if !tcp.paths.iter().any(|p| p.usable.load(Ordering::Acquire)) {
            return Err(last_err.unwrap_or_else(|| Error::SegmentUnreachable {
                name: peer.name.clone(),
                reason: "no rail reaches it".into(),
            }));
        }
        Ok(tcp)
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

    /// True when no path can carry slices and none is coming back soon, or the peer went
    /// silent (a fresh `TcpPeer` then gives new requests their own full timeout).
    pub(crate) fn is_dead(&self) -> bool {
        self.closed.load(Ordering::Acquire)
            || self.silent.load(Ordering::Acquire)
            || self.paths.iter().all(|p| !p.is_up())
    }

    /// When the peer's silence began, if it has work outstanding: the later of its last
    /// answer and the moment the outstanding work began.
    fn silent_since(&self, d: &Dispatch) -> Option<u64> {
        let since = d.outstanding_since?;
        Some(since.max(self.last_heard_ns.load(Ordering::Acquire)))
    }

    fn timeout_error(&self) -> Error {
        Error::Timeout {
            peer: self.name.clone(),
            timeout_ms: self.settings.timeout.as_millis() as u64,
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
        let now = Instant::now();
        let now_ns = self.scheduler.ns(now);
        {
            let mut d = self.dispatch.lock().expect("peer poisoned");
            if self.silent.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
                return Err(req);
            }
            req.task.add_parts(slices.len() as u32);
            // Work outstanding from now on, unless some already is: then the peer's silence is
            // still counted from the older work (or its last answer).
            if d.outstanding_since.is_none() || !d.has_outstanding() {
                d.outstanding_since = Some(now_ns);
            }
            for s in slices {
                let q = Queued {
                    slice: Outgoing {
                        op: req.op,
                        local: req.local + s.offset as usize,
                        remote: req.remote + s.offset,
                        key: req.buffer.key,
                        len: s.length as u32,
                        task: req.task.clone(),
                        rail: usize::MAX,
                        location: req.location,
                        priority: req.priority,
                        attempts: 0,
                        first_posted: None,
                    },
                    since: now,
                    error: None,
                };
                d.queue.push_back(q, req.priority, now_ns);
            }
            self.report_depths(&mut d);
        }
        self.pump();
        Ok(())
    }

    /// Brings the engine-wide queue depths up to date with this peer's queues.
    fn report_depths(&self, d: &mut Dispatch) {
        let now = d.queue.depths();
        if now != d.reported {
            self.qos.depths_changed(d.reported, now);
            d.reported = now;
        }
    }

    /// Window of path `p` for slices of `slice` bytes. `full` is [`WINDOW_BDPS`] times its
    /// bandwidth-delay product (EWMA bandwidth × the fixed part of the smallest round trip),
    /// but never more than [`WINDOW_MAX_QUEUE_NS`] of the rail's bandwidth; `lean` is
    /// [`LEAN_BDPS`] bandwidth-delay products; each at least one slice. The margin of `full`
    /// covers what the estimate misses on a CPU-bound link such as loopback; the time bound
    /// keeps a slow rail's queue (a shaped link's, a switch's) from holding more than a
    /// millisecond's worth.
    fn window(d: &Dispatch, p: usize, rail: usize, slice: u64) -> Window {
        let fixed = d.min_fixed_ns[p];
        if fixed == u64::MAX {
            let w = INITIAL_WINDOW.max(slice);
            return Window { full: w, lean: w };
        }
        let bytes_per_sec = d.ewma.get(rail).copied().unwrap_or(0.0);
        let bdp = bytes_per_sec * fixed as f64 / 1e9;
        let cap = bytes_per_sec * WINDOW_MAX_QUEUE_NS as f64 / 1e9;
        Window {
            full: ((WINDOW_BDPS * bdp).min(cap) as u64).max(slice),
            lean: ((LEAN_BDPS * bdp).min(cap) as u64).max(slice),
        }
    }

    /// Largest bulk slice rail `rail` may carry while HIGH work is active: [`HIGH_WAIT_NS`] of
    /// its estimated bandwidth, in whole pages, at least [`MIN_BULK_CHUNK`]. A bulk slice
    /// already on the wire cannot be passed, so this bounds what a HIGH slice waits behind on a
    /// slow rail; fast rails carry whole slices (their bound exceeds any slice).
    fn bulk_chunk(d: &Dispatch, rail: usize) -> u64 {
        match d.ewma.get(rail).copied() {
            Some(bw) if bw > 0.0 => {
                let bytes = (bw * HIGH_WAIT_NS as f64 / 1e9).min(u32::MAX as f64) as u64;
                (bytes & !4095).max(MIN_BULK_CHUNK)
            }
            _ => u64::MAX,
        }
    }

    /// Bytes a path may have in flight for slices of `prio`. Two full windows keep a rail busy
    /// at full speed; bulk gets them while HIGH is quiet (work-conserving: alone, LOW moves as
    /// fast as HIGH). While HIGH is active, bulk keeps to the lean window: whatever bulk has in
    /// flight is a queue (socket buffers, the kernel's backlog, a switch) that a HIGH slice
    /// finds ahead of it on the link, so bulk gives up the margin it uses for throughput. HIGH
    /// beside bulk may post one window past the most it could use alone: it has its own
    /// connection, so it does not queue behind bulk bytes in a TCP stream, and it never waits
    /// for whichever rail drains first (a slow one, often).
    fn allowance(prio: u8, window: Window, high_active: bool, bulk_active: bool) -> u64 {
        if prio == multirail_policy::qos::HIGH && bulk_active {
            3 * window.full
        } else if prio == multirail_policy::qos::HIGH || !high_active {
            2 * window.full
        } else {
            window.lean
        }
    }

    /// Deals queued slices to rails, highest priority first, while some usable rail that the
    /// priority may use has room in its window and the global slot admits the priority; then
    /// hands them to their connections outside the lock. A slice whose connection turns out
    /// dead goes back to the head of its level and is dealt again.
    fn pump(&self) {
        let mut out = HANDOFFS.with(|v| std::mem::take(&mut *v.borrow_mut()));
        loop {
            {
                let mut d = self.dispatch.lock().expect("peer poisoned");
                self.deal(&mut d, &mut out);
            }
            if out.is_empty() || !self.hand_over(&mut out) {
                break;
            }
        }
        HANDOFFS.with(|v| {
            let mut v = v.borrow_mut();
            if v.capacity() < out.capacity() {
                *v = out;
            }
        });
    }

    /// Gives each dealt slice to its connection: HIGH ones written at once where the connection
    /// allows (no sender-thread wake-up on their path), the rest queued for the sender thread.
    /// Slices refused by a dead connection go back to the head of their level; returns whether
    /// any did, so the caller deals again.
    fn hand_over(&self, out: &mut Vec<Handoff>) -> bool {
        let mut refused: Vec<Handoff> = Vec::new();
        for h in out.drain(..) {
            let Handoff {
                path,
                conn,
                queued,
                prio,
            } = h;
            let Queued {
                slice,
                since,
                error,
            } = queued;
            let sent = if prio == multirail_policy::qos::HIGH {
                conn.send_now(slice)
            } else {
                conn.send(slice)
            };
            if let Err(slice) = sent {
                refused.push(Handoff {
                    path,
                    conn,
                    queued: Queued {
                        slice,
                        since,
                        error,
                    },
                    prio,
                });
            }
        }
        if refused.is_empty() {
            return false;
        }
        let mut d = self.dispatch.lock().expect("peer poisoned");
        let now_ns = self.scheduler.now_ns();
        // Back to the head in dealing order: push the last first.
        for h in refused.into_iter().rev() {
            let len = h.queued.len_bytes();
            d.posted[h.path] = d.posted[h.path].saturating_sub(len);
            self.scheduler.unassigned(h.queued.slice.rail, len);
            self.paths[h.path].refresh_usable();
            let mut q = h.queued;
            q.slice.rail = usize::MAX;
            let queued_ns = self.scheduler.ns(q.since);
            d.queue.push_front(q, h.prio, queued_ns, now_ns);
        }
        true
    }

    /// The dealing half of [`pump`](Self::pump), under the peer's lock: picks rails and
    /// connections and records what each path will have in flight; `out` receives the slices.
    fn deal(&self, d: &mut Dispatch, out: &mut Vec<Handoff>) {
        let now = Instant::now();
        let now_ns = self.scheduler.ns(now);
        let promoted = d.queue.on_timeout(now_ns);
        if promoted > 0 {
            self.qos.promoted(promoted);
        }
        self.scheduler.fill_ewma_bytes_per_sec(&mut d.ewma);
        let smart = self.scheduler.smart();
        let nrails = self.scheduler.topology().rails.len();
        let qos = &self.qos;
        // Priorities whose turn it is; one that finds no rail is skipped this round so lower
        // ones may still use rails reserved away from it.
        let mut blocked = [false; LEVELS];
        while let Some((head, prio)) = d
            .queue
            .front(|p| !blocked[p as usize] && qos.slot_admits(p))
        {
            let len = head.len_bytes();
            // Baseline mode chose this slice's rail without looking at load: it waits for room
            // on that rail, as plain round-robin striping does.
            if head.slice.rail != usize::MAX {
                let rail = head.slice.rail;
                let Some(p) = self.rail_path.get(rail).copied().flatten() else {
                    break;
                };
                // Dealt while the rail admitted its priority; the rotation may have reserved
                // the rail since, and filtering holds on every path that assigns rails.
                if !self.paths[p].usable.load(Ordering::Acquire)
                    || !qos.rail_admits(now, rail, nrails, prio)
                {
                    self.scheduler.unassigned(rail, len);
                    d.queue.front_mut(prio).expect("head exists").slice.rail = usize::MAX;
                    continue;
                }
                if d.posted[p] >= Self::window(d, p, rail, len).full {
                    blocked[prio as usize] = true;
                    continue;
                }
                let q = d.queue.pop(prio, now_ns).expect("head exists");
                qos.dequeued(prio, q.waited_ns, now);
                self.post_on(d, p, q.item, prio, now_ns, out);
                continue;
            }
            // Engine-wide, as the rails are: HIGH to one peer shares them with bulk to another.
            let high_active = qos.has_work(multirail_policy::qos::HIGH, now);
            let bulk_active = qos.has_work(multirail_policy::qos::MEDIUM, now)
                || qos.has_work(multirail_policy::qos::LOW, now);
            // Bulk beside HIGH goes out in pieces a HIGH slice can pass soon (slow rails only).
            let split = prio != multirail_policy::qos::HIGH && high_active;
            let tiers = self.scheduler.tiers(head.slice.location);
            let mut candidates: [Vec<usize>; 3] = Default::default();
            let mut room = 0u64;
            for (p, path) in self.paths.iter().enumerate() {
                if !path.usable.load(Ordering::Acquire)
                    || !qos.rail_admits(now, path.rail, nrails, prio)
                {
                    continue;
                }
                let slice = if split {
                    len.min(Self::bulk_chunk(d, path.rail))
                } else {
                    len
                };
                let window = Self::window(d, p, path.rail, slice);
                self.scheduler.note_window(path.rail, window.full);
                let allowed = Self::allowance(prio, window, high_active, bulk_active);
                if !smart || d.posted[p] < allowed {
                    let tier = tiers.get(path.rail).copied().unwrap_or(0).min(2) as usize;
                    candidates[tier].push(path.rail);
                    room += allowed.saturating_sub(d.posted[p]);
                }
            }
            if candidates.iter().all(Vec::is_empty) {
                blocked[prio as usize] = true;
                continue;
            }
            // A run of equal slices at the head of this level, as many as the windows hold.
            let mut k = 1;
            while k < d.queue.level_len(prio).min(64)
                && d.queue
                    .get(prio, k)
                    .is_some_and(|q| q.len_bytes() == len && q.slice.rail == usize::MAX)
                && (k as u64 + 1) * len <= room
            {
                k += 1;
            }
            let mut rails = std::mem::take(&mut d.rails);
            self.scheduler
                .select(&candidates, SliceShape::uniform(k, len), &mut rails);
            tracing::trace!(?candidates, k, ?rails, "dealt");
            if rails.len() != k {
                d.rails = rails;
                break;
            }
            let mut waiting = Vec::new();
            let mut rests = Vec::new();
            for &rail in rails.iter() {
                let mut q = d.queue.pop(prio, now_ns).expect("k slices queued");
                q.item.slice.rail = rail;
                let p = self.rail_path[rail].expect("candidates have paths");
                if smart || d.posted[p] < Self::window(d, p, rail, len).full {
                    let chunk = Self::bulk_chunk(d, rail);
                    if split && u64::from(q.item.slice.len) > chunk {
                        let rest = q.item.slice.split_off(chunk as u32);
                        self.scheduler.unassigned(rail, u64::from(rest.len));
                        let queued = Queued {
                            slice: rest,
                            since: q.item.since,
                            error: None,
                        };
                        rests.push((queued, q.waited_ns));
                    }
                    qos.dequeued(prio, q.waited_ns, now);
                    self.post_on(d, p, q.item, prio, now_ns, out);
                } else {
                    // Baseline: charged to its rail, it waits at the head for room there.
                    waiting.push((q.item, q.waited_ns));
                }
            }
            // What was cut off or could not go waits at the head, in request order.
            for (item, waited_ns) in waiting.into_iter().chain(rests).rev() {
                d.queue
                    .push_front(item, prio, now_ns.saturating_sub(waited_ns), now_ns);
            }
            d.rails = rails;
        }
        self.expire_queue(d, now);
        self.report_depths(d);
        if (0..LEVELS as u8).any(|p| d.queue.level_len(p) > 0 && !qos.slot_admits(p)) {
            qos.slot_holds_work();
        }
    }

    /// Charges a slice with a chosen rail to path `p` and a live connection of it, to be handed
    /// over by `out`'s owner; puts it back at the head of its level (without a rail) if the path
    /// has no live connection.
    fn post_on(
        &self,
        d: &mut Dispatch,
        p: usize,
        mut q: Queued,
        prio: u8,
        now_ns: u64,
        out: &mut Vec<Handoff>,
    ) {
        let len = q.len_bytes();
        match self.paths[p].pick(prio) {
            Some(conn) => {
                // A promoted slice travels, and is counted, at the level it was dealt at.
                q.slice.priority = prio;
                d.posted[p] += len;
                out.push(Handoff {
                    path: p,
                    conn,
                    queued: q,
                    prio,
                });
            }
            None => {
                self.scheduler.unassigned(q.slice.rail, len);
                self.paths[p].refresh_usable();
                q.slice.rail = usize::MAX;
                let queued_ns = self.scheduler.ns(q.since);
                d.queue.push_front(q, prio, queued_ns, now_ns);
            }
        }
    }

    /// Fails queued slices that can no longer go anywhere in time: all of them once the peer
    /// was found silent (with the timeout error); when no rail can take them, at once if every
    /// rail is paused or the engine closed the peer, and otherwise (rails reconnecting) once
    /// the peer's deadline has passed, so a retry waiting for a rail never outlives it.
    fn expire_queue(&self, d: &mut Dispatch, now: Instant) {
        if d.queue.is_empty() {
            return;
        }
        let silent = self.silent.load(Ordering::Acquire);
        if !silent && self.paths.iter().any(|p| p.usable.load(Ordering::Acquire)) {
            return;
        }
        let all_down = self.closed.load(Ordering::Acquire) || self.paths.iter().all(|p| !p.is_up());
        // The peer's deadline, not each slice's: a slice handed back and queued again must not
        // restart the clock, or retries would stretch the wait past the timeout.
        let timeout_ns = self.settings.timeout.as_nanos() as u64;
        let now_ns = self.scheduler.ns(now);
        let expired = silent
            || self
                .silent_since(d)
                .is_some_and(|since| now_ns.saturating_sub(since) > timeout_ns);
        if !all_down && !expired {
            return;
        }
        for q in d.queue.take_if(|_, _| true) {
            if q.slice.rail != usize::MAX {
                self.scheduler.unassigned(q.slice.rail, q.slice.len as u64);
            }
            let err = if silent || !all_down {
                self.timeout_error()
            } else {
                // Every rail went down: say why, from the slice's own failure or the peer's
                // last lost connection. Rails lost to timeouts mean the peer went silent.
                let last = q.error.clone().or_else(|| {
                    (!self.closed.load(Ordering::Acquire))
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
            };
            q.slice.task.part_done(Err(err));
        }
    }

    fn down_error(&self) -> Error {
        Error::PeerDisconnected {
            peer: self.name.clone(),
            reason: "every rail to it is down".into(),
        }
    }

    /// True when a usable path other than `rail`'s can take retries: it has live connections
    /// and none of them has a slice waiting more than half the timeout (it answers, or has
    /// nothing to answer). Whether the peer as a whole still answers is not asked here: its
    /// deadline bounds every retry (`fail_if_silent`).
    fn progress_elsewhere(&self, rail: usize, now: Instant) -> bool {
        let suspect = self.settings.timeout / 2;
        self.paths
            .iter()
            .filter(|p| p.rail != rail && p.usable.load(Ordering::Acquire))
            .any(|p| p.longest_wait(now).is_some_and(|w| w <= suspect))
    }

    /// Periodic upkeep: the peer's silence, timeouts, link state, reconnects and probes (on
    /// their own threads), parked slices.
    pub(crate) fn maintain(&self, now: Instant) {
        if self.closed.load(Ordering::Acquire) || self.silent.load(Ordering::Acquire) {
            return;
        }
        let now_ns = self.scheduler.ns(now);
        if self.fail_if_silent(now_ns) {
            return;
        }
        // A rail that stalls while the others answer or stand idle is given up on after half the
        // timeout when its slices may retry on another: answered there, they prove the peer
        // alive before its deadline. Waiting the whole timeout would make a stalled rail look
        // like a silent peer whenever the other rails went idle meanwhile (a batch waiting for
        // the stalled rail's last slices), and the peer's deadline would fail everything.
        let suspect = self.settings.timeout / 2;
        let waits: Vec<Option<Duration>> = self.paths.iter().map(|p| p.longest_wait(now)).collect();
        for (p, path) in self.paths.iter().enumerate() {
            let conns: Vec<Arc<Conn>> = path.conns.lock().expect("path poisoned").clone();
            let elsewhere = self.settings.max_retries > 0
                && self.paths.iter().enumerate().any(|(q, other)| {
                    q != p
                        && other.usable.load(Ordering::Acquire)
                        && waits[q].is_some_and(|w| w <= suspect)
                });
            if elsewhere && waits[p].is_some_and(|w| w > suspect) {
                // The whole path goes, idle connections too: they share the stalled link, and a
                // retry dealt to one of them would stall again while the peer's deadline runs.
                // Until a reconnect proves the path again, retries go to the other rails.
                for c in conns.iter().filter(|c| !c.is_dead()) {
                    c.kill(self.timeout_error());
                }
            } else {
                for c in conns.iter().filter(|c| !c.is_dead()) {
                    c.check_timeout(now, self.settings.timeout);
                }
            }
            if path.link_down() {
                for c in conns.iter().filter(|c| !c.is_dead()) {
                    c.kill(Error::PeerDisconnected {
                        peer: self.name.clone(),
                        reason: format!(
                            "link of rail {} is down",
                            self.scheduler.topology().rails[path.rail].name
                        ),
                    });
                }
            }
            if path.reconnecting.load(Ordering::Acquire) {
                continue;
            }
            let probe = path
                .health
                .lock()
                .expect("path poisoned")
                .poll_probe(now_ns);
            let up = path.is_up();
            let dead = conns.iter().filter(|c| c.is_dead()).count();
            let missing =
                (self.settings.connections_per_rail + 1).saturating_sub(conns.len() - dead);
            if (probe || up) && missing > 0 && !path.link_down() {
                self.reconnect_in_background(p, missing, probe);
            } else if probe {
                // Nothing to reconnect: the connections survived the pause.
                path.health
                    .lock()
                    .expect("path poisoned")
                    .on_probe(now_ns, true);
            }
            path.refresh_usable();
        }
        self.pump();
    }

    /// Fails every slice of the peer, queued or in flight, with the timeout error once it has
    /// had work outstanding and answered nothing for the timeout; its connections are killed
    /// (so no late byte lands in memory whose request already failed) and none is retried.
    /// Returns whether it did.
    fn fail_if_silent(&self, now_ns: u64) -> bool {
        let timeout_ns = self.settings.timeout.as_nanos() as u64;
        {
            let mut d = self.dispatch.lock().expect("peer poisoned");
            if !d.has_outstanding() {
                d.outstanding_since = None;
            }
            let silent = self
                .silent_since(&d)
                .is_some_and(|since| now_ns.saturating_sub(since) > timeout_ns);
            if !silent {
                return false;
            }
            // Under the lock: a request posted from here on goes to a fresh `TcpPeer`.
            self.silent.store(true, Ordering::Release);
        }
        tracing::warn!(
            peer = %self.name,
            timeout_ms = self.settings.timeout.as_millis() as u64,
            "peer answered nothing for the timeout: its requests fail"
        );
        let err = self.timeout_error();
        for path in &self.paths {
            // Killing calls back into this peer (slices handed back): no lock held across it.
            let conns: Vec<Arc<Conn>> = path.conns.lock().expect("path poisoned").clone();
            for c in conns {
                c.kill(err.clone());
            }
            path.refresh_usable();
        }
        let mut d = self.dispatch.lock().expect("peer poisoned");
        self.expire_queue(&mut d, Instant::now());
        self.report_depths(&mut d);
        d.outstanding_since = None;
        true
    }

    /// Opens `missing` connections of path `p` (a probe when `probe`) on a thread of its own:
    /// a handshake with a peer that does not answer takes up to `connect_timeout_ms`, and the
    /// upkeep thread must keep every peer's timeouts on time meanwhile. At most one per path.
    fn reconnect_in_background(&self, p: usize, missing: usize, probe: bool) {
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

    fn reconnect(&self, p: usize, missing: usize, probe: bool) {
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
            let mut h = path.health.lock().expect("path poisoned");
            if probe {
                h.on_probe(now_ns, ok);
                if ok {
                    tracing::info!(peer = %self.name, rail = path.rail, "rail rejoined after a successful probe");
                }
            } else if !ok && h.on_error(now_ns) {
                tracing::warn!(peer = %self.name, rail = path.rail, "rail paused after repeated errors");
            }
        }
        path.refresh_usable();
    }

    /// Closes every connection; slices in flight fail with `reason`.
    pub(crate) fn close(&self, reason: &str) {
        self.closed.store(true, Ordering::Release);
        for path in &self.paths {
            // Killing calls back into the path (health, HIGH election): no lock held across it.
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
            path.usable.store(false, Ordering::Release);
        }
        let mut d = self.dispatch.lock().expect("peer poisoned");
        self.expire_queue(&mut d, Instant::now());
        self.report_depths(&mut d);
    }
}

impl ConnOwner for TcpPeer {
    fn answered(&self, rail: usize, bytes: u64, posted: Instant, now: Instant, ok: bool) {
        if ok {
            self.scheduler.completed(rail, bytes, posted, now);
        } else {
            self.scheduler.failed(rail, bytes);
        }
        self.last_heard_ns
            .store(self.scheduler.ns(now).max(1), Ordering::Release);
        let mut refill = true;
        if let Some(p) = self.rail_path.get(rail).copied().flatten() {
            let mut d = self.dispatch.lock().expect("peer poisoned");
            d.posted[p] = d.posted[p].saturating_sub(bytes);
            if !d.has_outstanding() {
                d.outstanding_since = None;
            }
            let rtt = now.saturating_duration_since(posted).as_nanos() as u64;
            let serialization_ns = match d.ewma.get(rail).copied() {
                Some(bw) if bw > 0.0 => (bytes as f64 * 1e9 / bw) as u64,
                _ => 0,
            };
            let fixed = rtt.saturating_sub(serialization_ns);
            if rtt > 0 && fixed < d.min_fixed_ns[p] {
                d.min_fixed_ns[p] = fixed;
            }
            // Refill a path once half of what the waiting priority may hold (at most half a full
            // window) has drained, so the sender gets several slices per wake-up and per
            // writev instead of one; HIGH work never waits for that.
            let depths = d.queue.depths();
            refill = match depths.iter().position(|&n| n > 0) {
                None => false,
                Some(0) => true,
                Some(level) => {
                    let window = Self::window(&d, p, self.paths[p].rail, bytes);
                    let high_active = self.qos.has_work(multirail_policy::qos::HIGH, now);
                    let allowed = Self::allowance(level as u8, window, high_active, true);
                    d.posted[p] + (window.full / 2).min(allowed / 2) <= allowed
                }
            };
        }
        if refill {
            self.pump();
        }
    }

    fn connection_lost(&self, rail: usize, err: &Error) {
        *self.last_loss.lock().expect("peer poisoned") = Some(err.clone());
        if let Some(p) = self.rail_path.get(rail).copied().flatten() {
            let path = &self.paths[p];
            if path
                .health
                .lock()
                .expect("path poisoned")
                .on_error(self.scheduler.now_ns())
            {
                tracing::warn!(peer = %self.name, rail, error = %err, "rail paused after repeated errors");
            }
            path.refresh_usable();
        }
    }

    fn slices_returned(&self, rail: usize, slices: Vec<Outgoing>, err: Error) {
        let now = Instant::now();
        let silent = self.silent.load(Ordering::Acquire);
        // Once the peer was found silent, whatever killed the connection first (a send error,
        // the kernel's timeout), its slices fail by the peer's verdict.
        let err = if silent { self.timeout_error() } else { err };
        let timed_out = matches!(err, Error::Timeout { .. });
        let elsewhere = timed_out && self.progress_elsewhere(rail, now);
        let closed = self.closed.load(Ordering::Acquire) || silent;
        {
            let mut d = self.dispatch.lock().expect("peer poisoned");
            for mut s in slices {
                self.scheduler.failed(s.rail, s.len as u64);
                if let Some(p) = self.rail_path.get(s.rail).copied().flatten() {
                    d.posted[p] = d.posted[p].saturating_sub(s.len as u64);
                }
                s.attempts += 1;
                s.rail = usize::MAX;
                // A peer that answers on no rail is gone or stuck: retrying would only stretch
                // the wait past the timeout.
                if closed || (timed_out && !elsewhere) || s.attempts > self.settings.max_retries {
                    s.task.part_done(Err(err.clone()));
                } else {
                    let prio = s.priority;
                    let queued_ns = self.scheduler.ns(now);
                    d.queue.push_front(
                        Queued {
                            slice: s,
                            since: now,
                            error: Some(err.clone()),
                        },
                        prio,
                        queued_ns,
                        queued_ns,
                    );
                }
            }
        }
        self.pump();
    }
}

impl Drop for TcpPeer {
    fn drop(&mut self) {
        self.close("engine shut down");
    }
}

/// The tcp transport: each `Peer` keeps its `TcpPeer`; the rail scheduler is engine-wide.
pub(crate) struct TcpTransport {
    settings: TcpSettings,
    scheduler: Arc<RailScheduler>,
    qos: Arc<Qos>,
    stats: Arc<TrafficStats>,
}

impl TcpTransport {
    pub(crate) fn new(
        settings: TcpSettings,
        scheduler: Arc<RailScheduler>,
        qos: Arc<Qos>,
        stats: Arc<TrafficStats>,
    ) -> Self {
        TcpTransport {
            settings,
            scheduler,
            qos,
            stats,
        }
    }

    /// The peer's live connections, made afresh when there are none or they were given up on.
    /// Connecting happens outside `peer.tcp` (one thread at a time, under `peer.tcp_connect`):
    /// a stopped peer keeps it waiting `connect_timeout_ms`, and the upkeep thread takes
    /// `peer.tcp` every 50 ms for the timeouts of every peer.
    fn connected(&self, peer: &Peer) -> Result<Arc<TcpPeer>> {
        let live = || {
            peer.tcp
                .lock()
                .expect("peer poisoned")
                .clone()
                .filter(|p| !p.is_dead())
        };
        if let Some(p) = live() {
            return Ok(p);
        }
        let asked = Instant::now();
        let mut last_failure = peer.tcp_connect.lock().expect("peer poisoned");
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
            &self.settings,
            &self.stats,
        ) {
            Ok(fresh) => {
                *last_failure = None;
                *peer.tcp.lock().expect("peer poisoned") = Some(fresh.clone());
                Ok(fresh)
            }
            Err(e) => {
                *last_failure = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Deals `peer`'s queued slices if any rail and slot allow.
    pub(crate) fn pump(&self, peer: &Peer) {
        let tcp = peer.tcp.lock().expect("peer poisoned").clone();
        if let Some(t) = tcp {
            t.pump();
        }
    }

    /// Periodic upkeep of `peer`'s paths.
    pub(crate) fn maintain(&self, peer: &Peer, now: Instant) {
        let tcp = peer.tcp.lock().expect("peer poisoned").clone();
        if let Some(t) = tcp {
            t.maintain(now);
        }
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn prepare(&self, peer: &Peer, _buffer: &BufferDescriptor) -> Result<()> {
        self.connected(peer).map(|_| ())
    }

    fn post(&self, peer: &Peer, req: Prepared, plan: &SlicePlan) {
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
