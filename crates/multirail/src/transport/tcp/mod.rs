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
pub(crate) mod serve;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use multirail_policy::dispatch::{Cause, Connection, DispatchConfig, PathId, Post, SliceId};
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
use crate::transport::driver::{
    offer, Driver, DriverEnv, Handed, Link, OutSlice, Peers, ProbeNeed,
};
use crate::transport::{Plans, Prepared, Transport};
use crate::upkeep::{TimerKey, Timers};

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
}

impl Path {
    /// A live connection for `connection`: the reserved one takes the HIGH connection, the
    /// rest (shared and spread) take turns on the others; either falls back to any live
    /// connection.
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
        let is_high = |c: &Arc<Conn>| high.as_ref().is_some_and(|h| Arc::ptr_eq(h, c));
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        match whose_turn(&conns, |c| !c.is_dead() && !is_high(c), turn) {
            Some(i) => Some(conns[i].clone()),
            None => high,
        }
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

/// The index in `conns` of the one whose turn `turn` is: the turns go round those for which
/// `takes_turns` holds, so each gets the same share; `None` when none takes turns. (Turns
/// counted over all of them, skipping the ones that take none, fell on the one after a skipped
/// one: of three connections, one kept for HIGH, the next took two slices in three.)
fn whose_turn<T>(conns: &[T], takes_turns: impl Fn(&T) -> bool, turn: usize) -> Option<usize> {
    let n = conns.iter().filter(|c| takes_turns(c)).count();
    if n == 0 {
        return None;
    }
    conns
        .iter()
        .enumerate()
        .filter(|(_, c)| takes_turns(c))
        .nth(turn % n)
        .map(|(i, _)| i)
}

/// A peer reached over tcp: the driver over its paths' connections.
type TcpPeer = Driver<TcpLink>;

/// The tcp link to one peer: a path per paired rail, each with its connections.
pub(crate) struct TcpLink {
    paths: Vec<Path>,
    /// Each path's local rail name, for logs.
    names: Vec<String>,
    settings: TcpSettings,
    stats: Arc<TrafficStats>,
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

impl TcpLink {
    /// Pairs rails with the peer's and opens every path. Fails when no path connects.
    fn connect(
        peer: &Peer,
        env: &DriverEnv,
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
        let local = &env.scheduler.topology().rails;
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
        let names = path_rails
            .iter()
            .map(|&r| {
                local
                    .get(r)
                    .map_or_else(|| r.to_string(), |l| l.name.clone())
            })
            .collect();
        let link = TcpLink {
            paths,
            names,
            settings: settings.clone(),
            stats: stats.clone(),
        };
        let tcp = Driver::new(
            peer,
            TimerKey::Peer(peer.id),
            dispatch_config(settings, &env.qos),
            path_rails,
            env,
            link,
        );
        let open_path = |p: PathId| -> Option<Error> {
            let path = &tcp.link.paths[p];
            let mut failed = None;
            for _ in 0..settings.connections_per_rail + 1 {
                match tcp.link.open(&tcp, path) {
                    Ok(c) => path.conns.lock().expect("path poisoned").push(c),
                    Err(e) => {
                        tcp.path_error(p);
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
        let failures: Vec<Option<Error>> = if tcp.paths() == 1 {
            vec![open_path(0)]
        } else {
            std::thread::scope(|scope| {
                let running: Vec<_> = (0..tcp.paths())
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
            (0..tcp.paths()).any(|p| d.is_usable(p))
        };
        if !usable {
            return Err(last_err.unwrap_or_else(|| Error::SegmentUnreachable {
                name: peer.name.clone(),
                reason: "no rail reaches it".into(),
            }));
        }
        Ok(tcp)
    }

    fn open(&self, driver: &TcpPeer, path: &Path) -> Result<Arc<Conn>> {
        let target = ConnTarget {
            peer: &driver.name,
            remote: path.remote,
            bind: path.bind.as_ref().map(|(a, i)| (*a, i.as_deref())),
            rail: path.rail,
        };
        let counters = match &path.bind {
            Some(_) => driver.env.scheduler.counters(path.rail),
            None => self.stats.rail(
                &topology::interface_for_address(path.remote.ip())
                    .unwrap_or_else(|| "tcp".to_owned()),
            ),
        };
        let owner: Weak<dyn ConnOwner> = driver.weak();
        Conn::open(&target, &self.settings, counters, owner)
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
}

/// Over tcp a probe is a frame of its own (`RequestOp::Probe`): its key is never looked at.
impl crate::transport::driver::ProbeKey for u64 {
    fn for_probe(&self) -> Option<u64> {
        Some(0)
    }
}

impl Link for TcpLink {
    type Key = u64;

    const PATH: &'static str = "rail";

    fn slice_time_ns(&self) -> u64 {
        self.settings.slice_time.as_nanos() as u64
    }

    fn slices(&self, req: &Prepared, plan: &SlicePlan, out: &mut Vec<Outgoing>) -> Result<()> {
        let slices = plan
            .slices(req.len)
            .map_err(|e| Error::invalid("length", e.to_string()))?;
        out.extend(slices.map(|s| OutSlice::of(req, s.offset, s.length, req.buffer.key)));
        Ok(())
    }

    /// HIGH slices are written at once where the connection allows (no sender-thread wake-up
    /// on their path), the rest queued for the sender thread.
    fn hand_over(&self, _driver: &TcpPeer, out: &mut Vec<Post<Outgoing>>) -> Handed<u64> {
        let mut handed = Handed::default();
        for post in out.drain(..) {
            let Some(conn) = self.paths[post.path].pick(post.connection) else {
                handed.changed.push(post.path);
                handed.refused.push(post);
                continue;
            };
            let (path, high) = (post.path, post.priority == Priority::High);
            let sent = offer(post, |item| {
                if high {
                    conn.send_now(item)
                } else {
                    conn.send(item)
                }
            });
            if let Err(post) = sent {
                handed.changed.push(path);
                handed.refused.push(post);
            }
        }
        handed
    }

    fn live(&self, p: PathId) -> usize {
        self.paths[p].elect_high()
    }

    fn path_name(&self, p: PathId) -> String {
        self.names[p].clone()
    }

    fn link_down(&self, p: PathId) -> bool {
        self.paths[p].link_down()
    }

    /// Aborts every connection of the path; each hands its slices back through
    /// [`ConnOwner::slices_returned`] and counts its loss. The path lets go of them at once, so
    /// each closes (with a reset, discarding what it had not sent) as soon as its two threads
    /// have seen it die, rather than when the path is remade.
    fn drop_path(&self, _driver: &TcpPeer, p: PathId, err: &Error) {
        let path = &self.paths[p];
        for c in path.conns().iter().filter(|c| !c.is_dead()) {
            c.abort(err.clone());
        }
        path.conns
            .lock()
            .expect("path poisoned")
            .retain(|c| !c.is_dead());
        let mut high = path.high.lock().expect("path poisoned");
        if high.as_ref().is_some_and(|h| h.is_dead()) {
            *high = None;
        }
    }

    fn probe(&self, p: PathId) -> ProbeNeed {
        if self.missing(p) == 0 {
            ProbeNeed::Whole
        } else if self.paths[p].link_down() {
            ProbeNeed::Unreachable
        } else {
            ProbeNeed::Remake
        }
    }

    fn needs_remake(&self, p: PathId) -> bool {
        self.missing(p) > 0
    }

    fn remake(&self, driver: &TcpPeer, p: PathId) -> bool {
        let path = &self.paths[p];
        let mut ok = true;
        let mut fresh = Vec::new();
        for _ in 0..self.missing(p) {
            match self.open(driver, path) {
                Ok(c) => fresh.push(c),
                Err(e) => {
                    tracing::debug!(peer = %driver.name, rail = path.rail, error = %e, "reconnect failed");
                    ok = false;
                    break;
                }
            }
        }
        if driver.given_up() {
            // The peer was closed or given up on while we connected.
            for c in fresh {
                c.kill(driver.down_error());
            }
            return false;
        }
        let mut cs = path.conns.lock().expect("path poisoned");
        cs.retain(|c| !c.is_dead());
        cs.extend(fresh);
        ok
    }

    fn close(&self, _driver: &TcpPeer, err: &Error) {
        for path in &self.paths {
            // Killing calls back into the driver (slices handed back): no lock held across it.
            let conns: Vec<Arc<Conn>> = path
                .conns
                .lock()
                .expect("path poisoned")
                .drain(..)
                .collect();
            path.high.lock().expect("path poisoned").take();
            for c in conns {
                c.kill(err.clone());
            }
        }
    }
}

impl ConnOwner for TcpPeer {
    fn answered(&self, id: SliceId, posted: Instant, now: Instant, ok: bool) {
        if self.on_answers(now, [(id, posted, ok)]) {
            self.pump();
        }
    }

    fn connection_lost(&self, rail: usize, err: &Error) {
        self.set_last_loss(err);
        if self.given_up() {
            // Closing the peer (or giving up on it) takes its connections down: that is no
            // rail's fault, and counting it would pause healthy rails with a warning.
            return;
        }
        let p = self.lock().path_of(rail);
        if let Some(p) = p {
            if self.path_error(p) {
                tracing::warn!(peer = %self.name, rail, error = %err, "rail paused after repeated errors");
            }
            self.refresh_path(p);
        }
    }

    fn closed_by_peer(&self) {
        if !self.given_up() {
            self.recheck_descriptor();
        }
    }

    fn slices_returned(&self, _rail: usize, slices: Vec<Outgoing>, err: Error) {
        let cause = if matches!(err, Error::Timeout { .. }) {
            Cause::Timeout
        } else {
            Cause::Lost
        };
        self.give_back(slices, Some(&err), cause);
        self.pump();
    }
}

/// The tcp transport: a driver per peer it reaches, by the engine's peer id; the rail
/// scheduler is engine-wide.
pub(crate) struct TcpTransport {
    peers: Peers<TcpLink>,
    settings: TcpSettings,
    env: DriverEnv,
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
            peers: Peers::default(),
            env: DriverEnv {
                scheduler,
                qos,
                timers,
                timeout: settings.timeout,
            },
            settings,
            stats,
        }
    }

    /// The peer's live connections, made afresh when there are none or they were given up on.
    fn connected(&self, peer: &Peer) -> Result<Arc<TcpPeer>> {
        self.peers
            .connected(peer, || {
                TcpLink::connect(peer, &self.env, &self.settings, &self.stats)
            })
            .map(|(tcp, _)| tcp)
    }

    /// The health of every path to every peer with connections: its local rail (scheduler
    /// index) and state.
    pub(crate) fn path_health(&self) -> Vec<(usize, multirail_policy::health::RailState)> {
        self.peers.path_health()
    }

    /// Deals every peer's queued slices that rails and slots now allow.
    pub(crate) fn pump_all(&self) {
        self.peers.pump_all();
    }

    /// Runs the dispatcher deadline of peer `id`.
    pub(crate) fn on_timer(&self, id: u64, now: Instant) {
        self.peers.on_timer(id, now);
    }

    /// The link check of every peer's paths.
    pub(crate) fn check_links(&self) {
        self.peers.check_links();
    }

    /// Closes the connections to peer `id` and forgets it (its segment was closed); its slices
    /// in flight fail with `reason`. A peer never connected is no error.
    pub(crate) fn close_peer(&self, id: u64, reason: &str) {
        self.peers.close_peer(id, reason);
    }

    /// Closes every peer's connections; their slices in flight fail.
    pub(crate) fn shutdown(&self, reason: &str) {
        self.peers.shutdown(reason);
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn prepare(&self, peer: &Arc<Peer>, _buffer: &BufferDescriptor) -> Result<()> {
        self.connected(peer).map(|_| ())
    }

    fn post(&self, reqs: Vec<(Arc<Peer>, Prepared)>, plans: &Plans) {
        self.peers.post(reqs, plans, |peer| self.connected(peer));
    }
}

#[cfg(test)]
mod tests {
    use super::whose_turn;

    #[test]
    fn bulk_turns_are_shared_evenly_by_the_connections_that_take_them() {
        // Three connections, the first kept for HIGH (takes no turns).
        let takes = [false, true, true];
        let mut share = [0u32; 3];
        for turn in 0..300 {
            share[whose_turn(&takes, |t| *t, turn).unwrap()] += 1;
        }
        assert_eq!(share, [0, 150, 150]);
        // The HIGH one in the middle, four in all, and a counter that wraps.
        let takes = [true, false, true, true];
        let mut share = [0u32; 4];
        for k in 0..300 {
            share[whose_turn(&takes, |t| *t, (usize::MAX - 150).wrapping_add(k)).unwrap()] += 1;
        }
        assert!(share[1] == 0 && share.iter().all(|&s| s == 0 || s.abs_diff(100) <= 1));
        assert_eq!(whose_turn(&[false, false], |t| *t, 7), None);
    }
}
