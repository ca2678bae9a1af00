//! The `tcp` transport, initiator side. Each peer is reached over paths, one per (local rail,
//! remote rail) pair, each with `connections_per_rail` connections bound to the local rail's
//! address and interface. The engine's rail scheduler deals each request's slices over the rails
//! whose paths are usable; a slice whose connection fails is retried on another rail; a rail
//! that keeps failing is paused and probed back (rail health).

mod conn;

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use multirail_policy::health::{HealthConfig, RailHealth};
use multirail_policy::pairing::{pair_rails, RailInfo, Reach};
use multirail_policy::selector::SliceShape;
use multirail_policy::slicing::SlicePlan;

use crate::error::{Error, Result};
use crate::peer::Peer;
use crate::rails::RailScheduler;
use crate::segment::BufferDescriptor;
use crate::stats::TrafficStats;
use crate::topology;
use crate::transport::{Prepared, Transport};

pub(crate) use conn::TcpSettings;
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
    health: Mutex<RailHealth>,
    /// Health is up and at least one connection is alive.
    usable: AtomicBool,
}

impl Path {
    fn pick(&self) -> Option<Arc<Conn>> {
        let conns = self.conns.lock().expect("path poisoned");
        let n = conns.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| &conns[(start + k) % n])
            .find(|c| !c.is_dead())
            .cloned()
    }

    fn refresh_usable(&self) {
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

fn s_fail(slice: Outgoing, err: Error) {
    slice.task.part_done(Err(err));
}

/// A slice waiting for a usable path, with the error that sent it here.
struct Pending {
    slice: Outgoing,
    error: Error,
    since: Instant,
}

/// Everything needed to reach one peer.
pub(crate) struct TcpPeer {
    name: String,
    paths: Vec<Path>,
    /// Local rail → index into `paths`.
    rail_path: Vec<Option<usize>>,
    pending: Mutex<VecDeque<Pending>>,
    scheduler: Arc<RailScheduler>,
    settings: TcpSettings,
    stats: Arc<TrafficStats>,
    me: Weak<TcpPeer>,
    closed: AtomicBool,
}

impl TcpPeer {
    /// Pairs rails with the peer's and opens every path. Fails when no path connects.
    fn connect(
        peer: &Peer,
        scheduler: &Arc<RailScheduler>,
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
                next: AtomicUsize::new(0),
                health: health(),
                usable: AtomicBool::new(false),
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
                next: AtomicUsize::new(0),
                health: health(),
                usable: AtomicBool::new(false),
            });
        }
        let tcp = Arc::new_cyclic(|me| TcpPeer {
            name: peer.name.clone(),
            paths,
            rail_path,
            pending: Mutex::default(),
            scheduler: scheduler.clone(),
            settings: settings.clone(),
            stats: stats.clone(),
            me: me.clone(),
            closed: AtomicBool::new(false),
        });
        let mut last_err = None;
        for path in &tcp.paths {
            for _ in 0..settings.connections_per_rail {
                match tcp.open(path) {
                    Ok(c) => path.conns.lock().expect("path poisoned").push(c),
                    Err(e) => {
                        path.health
                            .lock()
                            .expect("path poisoned")
                            .on_error(tcp.scheduler.now_ns());
                        last_err = Some(e);
                        break;
                    }
                }
            }
            path.refresh_usable();
        }
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
        Conn::open(
            &target,
            &self.settings,
            counters,
            owner,
            self.scheduler.epoch(),
        )
    }

    /// True when no path can carry slices and none is coming back soon.
    pub(crate) fn is_dead(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.paths.iter().all(|p| !p.is_up())
    }

    /// Candidate rails per tier for memory at `location`: only rails with a usable path.
    fn candidates(&self, location: crate::memory::Location) -> [Vec<usize>; 3] {
        let tiers = self.scheduler.tiers(location);
        let mut out: [Vec<usize>; 3] = Default::default();
        for path in &self.paths {
            if path.usable.load(Ordering::Acquire) {
                let tier = tiers.get(path.rail).copied().unwrap_or(0).min(2) as usize;
                out[tier].push(path.rail);
            }
        }
        out
    }

    /// Deals the slices of one request over the usable rails.
    fn post(&self, req: Prepared, plan: &SlicePlan) {
        let slices = match plan.slices(req.len) {
            Ok(s) => s,
            Err(e) => {
                req.task.add_parts(1);
                req.task
                    .part_done(Err(Error::invalid("length", e.to_string())));
                return;
            }
        };
        req.task.add_parts(slices.len() as u32);
        let candidates = self.candidates(req.location);
        let make = |s: multirail_policy::slicing::Slice, rail: usize| Outgoing {
            op: req.op,
            local: req.local + s.offset as usize,
            remote: req.remote + s.offset,
            key: req.buffer.key,
            len: s.length as u32,
            task: req.task.clone(),
            rail,
            attempts: 0,
            first_posted: None,
        };
        if candidates.iter().all(Vec::is_empty) {
            let err = self.down_error();
            for s in slices {
                self.park(make(s, usize::MAX), err.clone());
            }
            self.dispatch_pending(Instant::now());
            return;
        }
        let mut rails = Vec::with_capacity(slices.len());
        self.scheduler
            .select(&candidates, SliceShape::of(&slices), &mut rails);
        if rails.len() != slices.len() {
            let err = self.down_error();
            for s in slices {
                s_fail(make(s, usize::MAX), err.clone());
            }
            return;
        }
        for (s, rail) in slices.zip(rails) {
            self.send_on(rail, make(s, rail));
        }
    }

    /// Puts a slice on a connection of `rail`'s path, or retries it elsewhere.
    fn send_on(&self, rail: usize, slice: Outgoing) {
        let conn = self
            .rail_path
            .get(rail)
            .copied()
            .flatten()
            .and_then(|p| self.paths[p].pick());
        let Some(conn) = conn else {
            self.scheduler.unassigned(rail, slice.len as u64);
            self.retry(slice, self.down_error());
            return;
        };
        if let Err(slice) = conn.send(slice) {
            self.scheduler.unassigned(rail, slice.len as u64);
            self.retry(slice, self.down_error());
        }
    }

    fn down_error(&self) -> Error {
        Error::PeerDisconnected {
            peer: self.name.clone(),
            reason: "every rail to it is down".into(),
        }
    }

    /// True when some usable path other than `rail`'s got an answer within the timeout.
    fn progress_elsewhere(&self, rail: usize, now: Instant) -> bool {
        self.paths
            .iter()
            .filter(|p| p.rail != rail && p.usable.load(Ordering::Acquire))
            .any(|p| {
                p.conns.lock().expect("path poisoned").iter().any(|c| {
                    !c.is_dead()
                        && c.last_answer().is_some_and(|t| {
                            now.saturating_duration_since(t) < self.settings.timeout
                        })
                })
            })
    }

    /// Gives a slice that lost its connection another try on another rail, or fails it.
    fn retry(&self, mut slice: Outgoing, err: Error) {
        slice.attempts += 1;
        if slice.attempts > self.settings.max_retries || self.closed.load(Ordering::Acquire) {
            slice.task.part_done(Err(err));
            return;
        }
        self.park(slice, err);
        self.dispatch_pending(Instant::now());
    }

    fn park(&self, slice: Outgoing, error: Error) {
        self.pending
            .lock()
            .expect("peer poisoned")
            .push_back(Pending {
                slice,
                error,
                since: Instant::now(),
            });
    }

    /// Sends parked slices to usable rails; fails them when every rail is paused or they waited
    /// longer than the timeout.
    fn dispatch_pending(&self, now: Instant) {
        loop {
            let Some(p) = self.pending.lock().expect("peer poisoned").pop_front() else {
                return;
            };
            let candidates = self.candidates(crate::memory::Location::Any);
            if candidates.iter().all(Vec::is_empty) {
                let all_down = self.is_dead();
                let expired = now.saturating_duration_since(p.since) > self.settings.timeout;
                if all_down || expired {
                    let err = if all_down {
                        self.down_error_with(&p.error)
                    } else {
                        p.error
                    };
                    p.slice.task.part_done(Err(err));
                    continue;
                }
                self.pending.lock().expect("peer poisoned").push_front(p);
                return;
            }
            let mut rails = Vec::with_capacity(1);
            self.scheduler.select(
                &candidates,
                SliceShape::uniform(1, p.slice.len as u64),
                &mut rails,
            );
            let mut slice = p.slice;
            let Some(&rail) = rails.first() else {
                slice.task.part_done(Err(p.error));
                continue;
            };
            slice.rail = rail;
            self.send_on(rail, slice);
        }
    }

    fn down_error_with(&self, last: &Error) -> Error {
        match last {
            Error::Timeout { .. } => last.clone(),
            _ => Error::PeerDisconnected {
                peer: self.name.clone(),
                reason: format!("every rail to it is down (last error: {last})"),
            },
        }
    }

    /// Periodic upkeep: timeouts, link state, reconnects and probes, parked slices.
    pub(crate) fn maintain(&self, now: Instant) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let now_ns = self.scheduler.ns(now);
        for path in &self.paths {
            let conns: Vec<Arc<Conn>> = path.conns.lock().expect("path poisoned").clone();
            for c in conns.iter().filter(|c| !c.is_dead()) {
                c.check_timeout(now);
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
            let probe = path
                .health
                .lock()
                .expect("path poisoned")
                .poll_probe(now_ns);
            let up = path.is_up();
            let dead = conns.iter().filter(|c| c.is_dead()).count();
            let missing = self
                .settings
                .connections_per_rail
                .saturating_sub(conns.len() - dead);
            if (probe || up) && missing > 0 && !path.link_down() {
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
                {
                    let mut cs = path.conns.lock().expect("path poisoned");
                    cs.retain(|c| !c.is_dead());
                    cs.extend(fresh);
                }
                let mut h = path.health.lock().expect("path poisoned");
                if probe {
                    h.on_probe(now_ns, ok);
                    if ok {
                        tracing::info!(peer = %self.name, rail = path.rail, "rail rejoined after a successful probe");
                    }
                } else if !ok && h.on_error(now_ns) {
                    tracing::warn!(peer = %self.name, rail = path.rail, "rail paused after repeated errors");
                }
            } else if probe {
                // Nothing to reconnect: the connections survived the pause.
                path.health
                    .lock()
                    .expect("path poisoned")
                    .on_probe(now_ns, true);
            }
            path.refresh_usable();
        }
        self.dispatch_pending(now);
    }

    /// Closes every connection; slices in flight fail with `reason`.
    pub(crate) fn close(&self, reason: &str) {
        self.closed.store(true, Ordering::Release);
        for path in &self.paths {
            for c in path.conns.lock().expect("path poisoned").drain(..) {
                c.kill(Error::PeerDisconnected {
                    peer: self.name.clone(),
                    reason: reason.to_owned(),
                });
            }
            path.usable.store(false, Ordering::Release);
        }
        self.dispatch_pending(Instant::now());
    }
}

impl ConnOwner for TcpPeer {
    fn answered(&self, rail: usize, bytes: u64, posted: Instant, now: Instant, ok: bool) {
        if ok {
            self.scheduler.completed(rail, bytes, posted, now);
        } else {
            self.scheduler.failed(rail, bytes);
        }
    }

    fn connection_lost(&self, rail: usize, err: &Error) {
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
        let timed_out = matches!(err, Error::Timeout { .. });
        let elsewhere = timed_out && self.progress_elsewhere(rail, now);
        for s in slices {
            self.scheduler.failed(s.rail, s.len as u64);
            if timed_out && !elsewhere {
                // The peer answers on no rail: it is gone or stuck, and retrying would only
                // stretch the wait past the timeout.
                s.task.part_done(Err(err.clone()));
            } else {
                self.retry(s, err.clone());
            }
        }
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
    stats: Arc<TrafficStats>,
}

impl TcpTransport {
    pub(crate) fn new(
        settings: TcpSettings,
        scheduler: Arc<RailScheduler>,
        stats: Arc<TrafficStats>,
    ) -> Self {
        TcpTransport {
            settings,
            scheduler,
            stats,
        }
    }

    fn connected(&self, peer: &Peer) -> Result<Arc<TcpPeer>> {
        let mut slot = peer.tcp.lock().expect("peer poisoned");
        if let Some(p) = slot.as_ref() {
            if !p.is_dead() {
                return Ok(p.clone());
            }
        }
        let fresh = TcpPeer::connect(peer, &self.scheduler, &self.settings, &self.stats)?;
        *slot = Some(fresh.clone());
        Ok(fresh)
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
        match self.connected(peer) {
            Ok(t) => t.post(req, plan),
            Err(e) => {
                req.task.add_parts(1);
                req.task.part_done(Err(e));
            }
        }
    }
}
