//! An opened segment reached over RDMA: its paths (one per local port, paired with a port of
//! the peer), their queue pairs, and the dispatcher that deals slices to them.
//!
//! The dispatcher is the one the tcp transport drives (`multirail_policy::dispatch`): the
//! same windows, HIGH/bulk allowances, retries, silence deadline, stalled-path rule and rail
//! health, over this transport's own rail scheduler (RDMA ports, their NUMA tiers and EWMA
//! bandwidths) and the engine's QoS. Each path has two queue pairs: HIGH slices take the
//! reserved one, so they never wait behind bulk work requests in a send queue.
//!
//! A queue pair that fails (an error completion: the peer's port unreachable past its retries,
//! a remote access error) hands back every slice it held; they are retried on the other paths
//! and the path is remade on a thread of its own. A path whose port goes down is dropped at the
//! next link check. A peer silent for `timeout_ms` has every request failed with the timeout
//! and its queue pairs moved to the error state, so no late READ lands in memory whose request
//! already failed.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use multirail_policy::dispatch::{
    Cause, Connection, Dispatcher, Event, Failed, PathId, Post, SliceId, Verdict,
};
use multirail_policy::pairing::{pair_rails, RailInfo, Reach};
use multirail_policy::slicing::SlicePlan;
use multirail_verbs::{PortState, QueuePair};

use super::cm::{
    self, ConnectReply, ConnectRequest, PathReply, PathRequest, PortEnd, QpEnd, TargetFrame,
};
use super::devices::Port;
use super::rc::{RcQp, RdmaSlice, Reaped};
use super::Runtime;
use crate::error::{Error, Result};
use crate::peer::Peer;
use crate::segment::RdmaRailDescriptor;
use crate::transport::rails_view::EngineRails;
use crate::transport::{handshake, wire, Prepared};
use crate::upkeep::TimerKey;

/// Queue pairs per path: bulk, and the one reserved for HIGH.
const QPS_PER_PATH: usize = 2;

/// One (local port, remote rail) pair.
struct RdmaPath {
    port: Arc<Port>,
    /// Index of the remote rail in the peer's descriptor (which rkey a slice presents).
    remote_rail: usize,
    remote: RdmaRailDescriptor,
    /// Bulk and HIGH queue pairs; `None` until connected, and while remade.
    qps: Mutex<Option<[Arc<RcQp>; QPS_PER_PATH]>>,
    /// A remake of this path is under way on its own thread.
    reconnecting: AtomicBool,
    /// The path has carried queue pairs: when it loses them, the link check remakes them. A
    /// pair that never connected (no route between the ports) is left unused instead of being
    /// tried again every link check.
    connected_once: AtomicBool,
    /// Why the path last failed to connect, for the error when no path works.
    failure: Mutex<Option<String>>,
}

impl RdmaPath {
    fn live(&self) -> Option<[Arc<RcQp>; QPS_PER_PATH]> {
        self.qps
            .lock()
            .expect("path poisoned")
            .clone()
            .filter(|q| q.iter().all(|qp| !qp.is_dead()))
    }

    fn port_down(&self) -> bool {
        self.port
            .context
            .port_info(self.port.port)
            .map(|i| i.state != PortState::Active)
            .unwrap_or(true)
    }
}

/// Everything needed to reach one peer over RDMA.
pub(crate) struct RdmaPeer {
    name: String,
    peer_id: u64,
    /// The engine's record of the segment, whose cached descriptor forgets buffers the target
    /// says it unregistered.
    peer: Weak<Peer>,
    paths: Vec<RdmaPath>,
    dispatch: Mutex<Dispatcher<RdmaSlice>>,
    rt: Arc<Runtime>,
    /// The control connection the queue pairs were agreed on; the target keeps its queue
    /// pairs while it is open.
    cm: Mutex<TcpStream>,
    me: Weak<RdmaPeer>,
    closed: AtomicBool,
    silent: AtomicBool,
    /// The deadline last given to the timer table (scheduler ns; 0 = none).
    armed_ns: AtomicU64,
    last_loss: Mutex<Option<Error>>,
    /// When a request last used this peer (scheduler ns), for eviction.
    pub(super) last_used_ns: AtomicU64,
}

/// How local port `l` reaches remote rail `r`: on its subnet, through a router (RoCE v2
/// routes), or on InfiniBand (no IP: one fabric).
pub(super) fn reach(local: &Port, remote: &RdmaRailDescriptor) -> Reach {
    match (local.descriptor.ipv4(), remote.ipv4()) {
        (Some(a), Some(b)) => {
            let bits = u32::from(crate::topology::prefix_len_of(a).unwrap_or(32).min(32));
            let mask = if bits == 0 {
                0
            } else {
                u32::MAX << (32 - bits)
            };
            if u32::from(a) & mask == u32::from(b) & mask {
                Reach::SameSubnet
            } else {
                Reach::Routed
            }
        }
        (None, None) => Reach::SameSubnet,
        _ => Reach::No,
    }
}

impl RdmaPeer {
    /// Pairs local ports with the peer's RDMA rails, opens the control connection and connects
    /// every pair. Fails when the peer has no RDMA rail, or no pair connects.
    pub(super) fn connect(peer: &Arc<Peer>, rt: &Arc<Runtime>) -> Result<Arc<RdmaPeer>> {
        let desc = peer.descriptor();
        let unavailable = |reason: String| Error::TransportUnavailable {
            transport: "rdma",
            reason,
        };
        if desc.rdma.is_empty() {
            return Err(unavailable(format!(
                "segment {} has no RDMA device",
                peer.name
            )));
        }
        let info = |name: String, numa: i32| RailInfo {
            name,
            numa_node: numa,
        };
        let local: Vec<RailInfo> = rt
            .ports
            .iter()
            .map(|p| info(p.descriptor.device.clone(), p.descriptor.numa_node))
            .collect();
        let remote: Vec<RailInfo> = desc
            .rdma
            .iter()
            .map(|r| info(r.device.clone(), r.numa_node))
            .collect();
        let pairs = pair_rails(&local, &remote, |l, r| reach(&rt.ports[l], &desc.rdma[r]));
        let paths: Vec<RdmaPath> = pairs
            .iter()
            .enumerate()
            .filter_map(|(l, r)| {
                let r = (*r)?;
                Some(RdmaPath {
                    port: rt.ports[l].clone(),
                    remote_rail: r,
                    remote: desc.rdma[r].clone(),
                    qps: Mutex::new(None),
                    reconnecting: AtomicBool::new(false),
                    connected_once: AtomicBool::new(false),
                    failure: Mutex::new(None),
                })
            })
            .collect();
        if paths.is_empty() {
            return Err(unavailable(format!(
                "no local RDMA port reaches a port of {}",
                peer.name
            )));
        }
        let cm = open_cm(peer, rt)?;
        let path_rails: Vec<usize> = paths.iter().map(|p| p.port.index).collect();
        let me = Arc::new_cyclic(|me| RdmaPeer {
            name: peer.name.clone(),
            peer_id: peer.id,
            peer: Arc::downgrade(peer),
            paths,
            dispatch: Mutex::new(Dispatcher::new(rt.dispatch_config(), &path_rails)),
            rt: rt.clone(),
            cm: Mutex::new(cm),
            me: me.clone(),
            closed: AtomicBool::new(false),
            silent: AtomicBool::new(false),
            armed_ns: AtomicU64::new(0),
            last_loss: Mutex::new(None),
            last_used_ns: AtomicU64::new(rt.scheduler.now_ns()),
        });
        let all: Vec<PathId> = (0..me.paths.len()).collect();
        me.connect_paths(&all)?;
        let usable = (0..me.paths.len()).filter(|&p| me.paths[p].live().is_some());
        if usable.count() == 0 {
            let why: Vec<String> = me
                .paths
                .iter()
                .filter_map(|p| {
                    p.failure.lock().expect("path poisoned").clone().map(|f| {
                        format!("{} -> {}: {f}", p.port.descriptor.name(), p.remote.name())
                    })
                })
                .collect();
            return Err(Error::SegmentUnreachable {
                name: peer.name.clone(),
                reason: format!("no RDMA path connects ({})", why.join("; ")),
            });
        }
        Ok(me)
    }

    /// Makes fresh queue pairs for `paths` and agrees them with the target over the control
    /// connection; each path that connects is handed to the dispatcher, each that fails is
    /// marked unusable with why. Fails only when the control connection does.
    fn connect_paths(&self, paths: &[PathId]) -> Result<()> {
        let cfg = &self.rt.config;
        let mut made: Vec<(PathId, Vec<(QueuePair, u32)>)> = Vec::new();
        let mut abandon = Vec::new();
        let mut requests = Vec::new();
        for &p in paths {
            let path = &self.paths[p];
            if let Some(old) = path.qps.lock().expect("path poisoned").take() {
                for qp in &old {
                    abandon.push(qp.remote_qp_num);
                    self.rt.poller.unroute(path.port.index, qp.qp.qp_num());
                    self.give_back(qp.kill(), None, Cause::Lost);
                }
            }
            let mut qps = Vec::with_capacity(QPS_PER_PATH);
            for _ in 0..QPS_PER_PATH {
                let qp = QueuePair::new_rc(
                    &path.port.pd,
                    &path.port.cq,
                    &path.port.cq,
                    None,
                    cm::qp_caps(cfg),
                )
                .and_then(|qp| qp.to_init(path.port.port, cm::qp_access()).map(|()| qp));
                match qp {
                    Ok(qp) => qps.push((qp, cm::random_psn())),
                    Err(e) => {
                        *path.failure.lock().expect("path poisoned") = Some(e.to_string());
                        break;
                    }
                }
            }
            if qps.len() < QPS_PER_PATH {
                continue;
            }
            requests.push(PathRequest {
                target_rail: path.remote_rail,
                port: PortEnd {
                    gid: path.port.descriptor.gid,
                    lid: path.port.descriptor.lid,
                    mtu: path.port.descriptor.mtu,
                },
                qps: qps
                    .iter()
                    .map(|(qp, psn)| QpEnd {
                        qp_num: qp.qp_num(),
                        psn: *psn,
                    })
                    .collect(),
            });
            made.push((p, qps));
        }
        let reply: ConnectReply = {
            let mut cm = self.cm.lock().expect("cm poisoned");
            let request = ConnectRequest {
                initiator: self.rt.own_name(),
                paths: requests,
                abandon,
            };
            let lost = |e: std::io::Error| Error::PeerDisconnected {
                peer: self.name.clone(),
                reason: format!("RDMA control connection: {e}"),
            };
            cm::send_frame(&mut cm, &request).map_err(lost)?;
            loop {
                match cm::recv_frame(&mut cm).map_err(lost)? {
                    Some(TargetFrame::Reply(r)) => break r,
                    Some(f) => self.on_frame(f),
                    None => {
                        return Err(Error::PeerDisconnected {
                            peer: self.name.clone(),
                            reason: "RDMA control connection closed".into(),
                        })
                    }
                }
            }
        };
        if reply.paths.len() != made.len() {
            return Err(Error::Protocol {
                peer: self.name.clone(),
                reason: format!(
                    "{} RDMA paths answered for {} asked",
                    reply.paths.len(),
                    made.len()
                ),
            });
        }
        let now_ns = self.rt.scheduler.now_ns();
        for ((p, qps), answer) in made.into_iter().zip(reply.paths) {
            let path = &self.paths[p];
            let connected = match answer {
                PathReply::Failed(why) => Err(format!("the target could not connect it: {why}")),
                PathReply::Ready { qps: theirs, mtu } if theirs.len() == qps.len() => {
                    let remote = PortEnd {
                        gid: path.remote.gid,
                        lid: path.remote.lid,
                        mtu,
                    };
                    let mtu = cm::path_mtu(path.port.descriptor.mtu, mtu, cfg);
                    qps.into_iter()
                        .zip(theirs)
                        .map(|((qp, psn), end)| {
                            cm::connect_qp(&qp, &path.port, &remote, end, psn, mtu, cfg).map(|()| {
                                Arc::new(RcQp::new(
                                    qp,
                                    path.port.clone(),
                                    end.qp_num,
                                    cfg.signal_interval,
                                ))
                            })
                        })
                        .collect::<std::result::Result<Vec<_>, String>>()
                }
                PathReply::Ready { .. } => {
                    Err("the target answered the wrong number of queue pairs".into())
                }
            };
            match connected {
                Ok(qps) => {
                    for qp in &qps {
                        self.rt
                            .poller
                            .route(path.port.index, qp, self.me.clone(), p);
                    }
                    let Ok(qps) = <[Arc<RcQp>; QPS_PER_PATH]>::try_from(qps) else {
                        unreachable!("one queue pair made per end answered");
                    };
                    *path.qps.lock().expect("path poisoned") = Some(qps);
                    *path.failure.lock().expect("path poisoned") = None;
                    path.connected_once.store(true, Ordering::Release);
                    self.lock().on_path(now_ns, p, QPS_PER_PATH);
                }
                Err(why) => {
                    tracing::info!(
                        peer = %self.name,
                        local = %path.port.descriptor.name(),
                        remote = %path.remote.name(),
                        %why,
                        "RDMA path unusable"
                    );
                    *path.failure.lock().expect("path poisoned") = Some(why);
                    let mut d = self.lock();
                    d.on_path(now_ns, p, 0);
                    d.on_path_error(now_ns, p);
                    self.arm(&mut d);
                }
            }
        }
        Ok(())
    }

    /// What the target said unprompted.
    fn on_frame(&self, frame: TargetFrame) {
        match frame {
            TargetFrame::Unregistered { addr, len } => {
                tracing::debug!(peer = %self.name, addr, len, "the target unregistered a buffer");
                if let Some(p) = self.peer.upgrade() {
                    p.forget_buffer(addr, len);
                }
            }
            TargetFrame::Reply(_) => {
                tracing::warn!(peer = %self.name, "an RDMA reply nobody asked for; ignored");
            }
        }
    }

    /// Takes in what the target sent since the last look, without waiting.
    fn read_frames(&self) {
        let Ok(mut cm) = self.cm.try_lock() else {
            // A request is under way: its reader takes these in.
            return;
        };
        loop {
            match cm::try_recv_frame::<TargetFrame>(&mut cm) {
                Ok(Some(f)) => self.on_frame(f),
                Ok(None) => return,
                Err(e) => {
                    // The target closed it (it exited or shed us): its queue pairs go with it,
                    // which the queue pairs themselves report.
                    tracing::debug!(peer = %self.name, error = %e, "RDMA control connection lost");
                    return;
                }
            }
        }
    }

    /// Paths with queue pairs: what counts against `max_endpoints`.
    pub(super) fn endpoints(&self) -> usize {
        self.paths
            .iter()
            .filter(|p| p.qps.lock().expect("path poisoned").is_some())
            .count()
    }

    fn lock(&self) -> MutexGuard<'_, Dispatcher<RdmaSlice>> {
        self.dispatch.lock().expect("peer poisoned")
    }

    fn rails(&self, now: Instant) -> EngineRails<'_> {
        EngineRails::new(&self.rt.scheduler, &self.rt.qos, now)
    }

    /// True when the peer was closed or found silent, or no path can carry slices and none is
    /// coming back: a fresh `RdmaPeer` then serves new requests.
    pub(super) fn is_dead(&self) -> bool {
        self.closed.load(Ordering::Acquire)
            || self.silent.load(Ordering::Acquire)
            || self.lock().is_dead()
    }

    /// Slices in flight or queued.
    pub(super) fn is_busy(&self) -> bool {
        self.lock().has_outstanding()
    }

    fn timeout_error(&self) -> Error {
        Error::Timeout {
            peer: self.name.clone(),
            timeout_ms: self.rt.timeout.as_millis() as u64,
        }
    }

    fn down_error(&self) -> Error {
        Error::PeerDisconnected {
            peer: self.name.clone(),
            reason: "every RDMA path to it is down".into(),
        }
    }

    /// Queues the slices of one request and posts what the windows allow. Hands the request
    /// back when this peer is dead or silent, for the caller to post on a fresh one.
    pub(super) fn post(
        &self,
        req: Prepared,
        plan: &SlicePlan,
    ) -> std::result::Result<(), Prepared> {
        if self.is_dead() {
            return Err(req);
        }
        let registration = match self
            .rt
            .registry
            .find(req.local as u64, req.len)
            .and_then(|r| self.rt.registrations.get(r.id()))
        {
            Some(r) => r,
            None => {
                req.fail(Error::SourceNotRegistered {
                    addr: req.local as u64,
                    len: req.len,
                });
                return Ok(());
            }
        };
        if req.buffer.rkeys.len()
            < self
                .paths
                .iter()
                .map(|p| p.remote_rail + 1)
                .max()
                .unwrap_or(0)
        {
            req.fail(Error::TransportUnavailable {
                transport: "rdma",
                reason: format!(
                    "the target buffer at {:#x} has no remote key for every RDMA rail of {}",
                    req.buffer.addr, self.name
                ),
            });
            return Ok(());
        }
        let Some(slices) = req.slices(plan) else {
            return Ok(());
        };
        let rkeys: Arc<[u32]> = req.buffer.rkeys.clone().into();
        let max_msg = u64::from(self.rt.max_message);
        let now_ns = self.rt.scheduler.now_ns();
        self.last_used_ns.store(now_ns, Ordering::Relaxed);
        {
            let mut d = self.lock();
            if d.is_silent() || d.is_closed() {
                return Err(req);
            }
            // Slices no larger than a port carries in one message.
            let mut items = Vec::new();
            for s in slices {
                let mut off = s.offset;
                let end = s.offset + s.length;
                while off < end {
                    let len = (end - off).min(max_msg);
                    items.push(RdmaSlice {
                        op: req.op,
                        local: req.local + off as usize,
                        remote: req.remote + off,
                        len: len as u32,
                        registration: registration.clone(),
                        rkeys: rkeys.clone(),
                        task: req.task.clone(),
                        id: SliceId { path: 0, seq: 0 },
                        location: req.location,
                        priority: req.priority,
                        last_error: None,
                    });
                    off += len;
                }
            }
            req.task.add_parts(items.len() as u32);
            d.on_submit(now_ns, req.priority, items);
            self.report_depths(&mut d);
            self.arm(&mut d);
        }
        self.pump();
        Ok(())
    }

    fn report_depths(&self, d: &mut Dispatcher<RdmaSlice>) {
        if let Some((old, new)) = d.take_depth_change() {
            self.rt.qos.depths_changed(old, new);
        }
    }

    /// Registers the dispatcher's next deadline with the engine's timer table when earlier
    /// than the one registered.
    fn arm(&self, d: &mut Dispatcher<RdmaSlice>) {
        let Some(at) = d.poll_timeout() else {
            return;
        };
        let armed = self.armed_ns.load(Ordering::Acquire);
        if armed == 0 || at < armed {
            self.armed_ns.store(at.max(1), Ordering::Release);
            let when = self.rt.scheduler.epoch() + std::time::Duration::from_nanos(at);
            self.rt
                .timers
                .arm(TimerKey::RdmaPeer(self.peer_id), self.rt.timers.ns(when));
        }
    }

    /// Fails what the dispatcher gave up on.
    fn settle(&self, d: &mut Dispatcher<RdmaSlice>) {
        while let Some(Failed { item, verdict, .. }) = d.poll_failed() {
            let err = match verdict {
                Verdict::Timeout => self.timeout_error(),
                Verdict::Failed(_) => item.last_error.clone().unwrap_or_else(|| self.down_error()),
                Verdict::RailsDown => {
                    let last = item.last_error.clone().or_else(|| {
                        (!self.closed.load(Ordering::Acquire))
                            .then(|| self.last_loss.lock().expect("peer poisoned").clone())
                            .flatten()
                    });
                    match last {
                        Some(e @ Error::Timeout { .. }) => e,
                        Some(e) => Error::PeerDisconnected {
                            peer: self.name.clone(),
                            reason: format!("every RDMA path to it is down (last error: {e})"),
                        },
                        None => self.down_error(),
                    }
                }
            };
            item.task.part_done(Err(err));
        }
        self.report_depths(d);
    }

    /// Deals queued slices and posts them, one `ibv_post_send` per queue pair.
    pub(super) fn pump(&self) {
        let mut out: Vec<Post<RdmaSlice>> = Vec::new();
        loop {
            {
                let now = Instant::now();
                let mut rails = self.rails(now);
                let now_ns = self.rt.scheduler.ns(now);
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
    }

    /// Stages each dealt slice on its queue pair and posts every queue pair touched. Returns
    /// whether slices came back from a dead queue pair (deal again: they go elsewhere).
    fn hand_over(&self, out: &mut Vec<Post<RdmaSlice>>) -> bool {
        let mut refused: Vec<Post<RdmaSlice>> = Vec::new();
        let mut touched: Vec<(PathId, Arc<RcQp>)> = Vec::new();
        let mut dead: Vec<PathId> = Vec::new();
        for mut post in out.drain(..) {
            let path = &self.paths[post.path];
            let Some(qps) = path.live() else {
                dead.push(post.path);
                refused.push(post);
                continue;
            };
            let qp = match post.connection {
                Connection::Reserved => &qps[1],
                _ => &qps[0],
            };
            post.item.id = post.id;
            post.item.priority = post.priority;
            let rkey = post.item.rkeys[path.remote_rail];
            let Post {
                id,
                item,
                path: p,
                rail,
                priority,
                connection,
            } = post;
            match qp.stage(item, rkey) {
                Ok(()) => {
                    if !touched.iter().any(|(_, q)| Arc::ptr_eq(q, qp)) {
                        touched.push((p, qp.clone()));
                    }
                }
                Err(item) => {
                    if qp.is_dead() {
                        dead.push(p);
                    }
                    refused.push(Post {
                        id,
                        item,
                        path: p,
                        rail,
                        priority,
                        connection,
                    });
                }
            }
        }
        let mut lost: Vec<(PathId, Vec<RdmaSlice>, Error)> = Vec::new();
        for (p, qp) in &touched {
            let before = qp.outstanding();
            let failed = qp.flush(&self.rt.counters);
            let posted = qp.outstanding().saturating_sub(before);
            self.rt.poller.posted(posted as i64);
            if let Some((slices, e)) = failed {
                // Counted as in flight so that handing them back balances.
                self.rt.poller.posted(slices.len() as i64);
                lost.push((*p, slices, e));
            }
        }
        let now = Instant::now();
        let now_ns = self.rt.scheduler.ns(now);
        dead.sort_unstable();
        dead.dedup();
        if !refused.is_empty() {
            let mut rails = self.rails(now);
            let mut d = self.lock();
            // A path found dead leaves the dispatcher before its slices are dealt again.
            for &p in &dead {
                d.on_path(now_ns, p, 0);
            }
            for post in refused.into_iter().rev() {
                d.on_refused(now_ns, post, &mut rails);
            }
        }
        // A full send queue frees up with the next completion, which deals again.
        let again = !dead.is_empty() || !lost.is_empty();
        for (p, slices, e) in lost {
            let e = self.named(e);
            tracing::warn!(peer = %self.name, error = %e, "posting to an RDMA queue pair failed");
            self.path_failed(p, slices, e);
        }
        again
    }

    /// Puts this peer's name into an error made without it.
    fn named(&self, e: Error) -> Error {
        match e {
            Error::PeerDisconnected { peer, reason } if peer.is_empty() => {
                Error::PeerDisconnected {
                    peer: self.name.clone(),
                    reason,
                }
            }
            Error::RemoteRejected { peer, reason } if peer.is_empty() => Error::RemoteRejected {
                peer: self.name.clone(),
                reason,
            },
            e => e,
        }
    }

    /// Hands slices that were in flight back to the dispatcher (each knows its path by its id),
    /// marked with `err` when given.
    fn give_back(&self, slices: Vec<RdmaSlice>, err: Option<&Error>, cause: Cause) {
        if slices.is_empty() {
            return;
        }
        self.rt.poller.posted(-(slices.len() as i64));
        let now = Instant::now();
        let mut rails = self.rails(now);
        let now_ns = self.rt.scheduler.ns(now);
        let mut d = self.lock();
        for mut s in slices {
            if let Some(e) = err {
                s.last_error = Some(e.clone());
            }
            let id = s.id;
            d.on_failed(now_ns, id, s, cause, &mut rails);
        }
        self.settle(&mut d);
    }

    /// A queue pair of path `p` failed with `err`, taking `slices` with it: they are retried
    /// elsewhere (a remote access error is final: the target no longer serves that memory),
    /// the path leaves the dispatcher until it is remade, and the remake starts.
    fn path_failed(&self, p: PathId, slices: Vec<RdmaSlice>, err: Error) {
        *self.last_loss.lock().expect("peer poisoned") = Some(err.clone());
        let path = &self.paths[p];
        if let Some(qps) = path.qps.lock().expect("path poisoned").as_ref() {
            for qp in qps {
                // The other queue pair of the path shares its fate: remade together.
                let rest = qp.kill();
                if !rest.is_empty() {
                    self.give_back(rest, Some(&err), Cause::Lost);
                }
            }
        }
        if matches!(err, Error::RemoteRejected { .. }) {
            // No retry can fix a refused key: fail those slices with the error.
            self.rt.poller.posted(-(slices.len() as i64));
            for s in slices {
                let id = s.id;
                let now = Instant::now();
                let mut rails = self.rails(now);
                let mut d = self.lock();
                d.on_rejected(self.rt.scheduler.ns(now), id, &mut rails);
                drop(d);
                s.task.part_done(Err(err.clone()));
            }
        } else {
            self.give_back(slices, Some(&err), Cause::Lost);
        }
        let paused = {
            let now_ns = self.rt.scheduler.now_ns();
            let mut d = self.lock();
            d.on_path(now_ns, p, 0);
            let paused = d.on_path_error(now_ns, p);
            self.arm(&mut d);
            paused
        };
        if paused {
            tracing::warn!(peer = %self.name, rail = %path.port.descriptor.name(), "RDMA rail paused after repeated errors");
        } else if !path.port_down() {
            self.reconnect_in_background(p, false);
        }
        self.pump();
    }

    /// What the poller reaped on path `p`.
    pub(super) fn on_reaped(&self, p: PathId, qp: &Arc<RcQp>, reaped: Reaped) {
        match reaped {
            Reaped::Nothing => {}
            Reaped::Done(done) => {
                let now = Instant::now();
                let counters = self.rt.scheduler.counters(self.paths[p].port.index);
                let refill = {
                    let mut rails = self.rails(now);
                    let now_ns = self.rt.scheduler.ns(now);
                    let mut d = self.lock();
                    let mut refill = false;
                    for (s, posted) in &done {
                        let sent = self.rt.scheduler.ns(*posted);
                        refill |= d.on_completed(now_ns, s.id, Some(sent), &mut rails);
                    }
                    refill
                };
                for (s, _) in done {
                    counters.record_at(s.priority, u64::from(s.len), 1);
                    s.task.part_done(Ok(()));
                }
                if refill {
                    self.pump();
                }
            }
            Reaped::Lost(slices, err) => {
                let err = self.named(err);
                tracing::warn!(peer = %self.name, qp = qp.qp.qp_num(), error = %err, "RDMA queue pair failed; its slices are retried");
                self.rt
                    .scheduler
                    .counters(self.paths[p].port.index)
                    .record_error();
                // The poller already counted these as finished.
                self.rt.poller.posted(slices.len() as i64);
                self.path_failed(p, slices, err);
            }
        }
    }

    /// Runs what the dispatcher has due and registers its next deadline.
    pub(super) fn on_timer(&self, now: Instant) {
        if self.closed.load(Ordering::Acquire) || self.silent.load(Ordering::Acquire) {
            return;
        }
        self.armed_ns.store(0, Ordering::Release);
        let now_ns = self.rt.scheduler.ns(now);
        let mut events = Vec::new();
        {
            let mut rails = self.rails(now);
            let mut d = self.lock();
            d.on_timeout(now_ns, &mut rails);
            while let Some(e) = d.poll_event() {
                events.push(e);
            }
            if d.is_silent() {
                self.silent.store(true, Ordering::Release);
            }
            self.settle(&mut d);
        }
        for event in events {
            match event {
                Event::Silent => {
                    tracing::warn!(
                        peer = %self.name,
                        timeout_ms = self.rt.timeout.as_millis() as u64,
                        "peer answered nothing for the timeout: its requests fail"
                    );
                    let err = self.timeout_error();
                    for path in &self.paths {
                        let qps = path.qps.lock().expect("path poisoned").take();
                        for qp in qps.iter().flatten() {
                            self.rt.poller.unroute(path.port.index, qp.qp.qp_num());
                            self.give_back(qp.kill(), Some(&err), Cause::Timeout);
                        }
                    }
                }
                Event::DropPath { path: p, stalled } => {
                    tracing::warn!(
                        peer = %self.name,
                        rail = %self.paths[p].port.descriptor.name(),
                        stalled,
                        "RDMA rail answered nothing in time: its queue pairs are dropped"
                    );
                    let err = self.timeout_error();
                    let qps = self.paths[p].qps.lock().expect("path poisoned").take();
                    for qp in qps.iter().flatten() {
                        self.rt
                            .poller
                            .unroute(self.paths[p].port.index, qp.qp.qp_num());
                        self.give_back(qp.kill(), Some(&err), Cause::Timeout);
                    }
                    self.lock().on_path(now_ns, p, 0);
                }
                Event::Probe(p) => {
                    if self.paths[p].live().is_some() {
                        self.lock().on_probe(now_ns, p, true);
                    } else if !self.paths[p].port_down() {
                        self.reconnect_in_background(p, true);
                    } else {
                        self.lock().on_probe(now_ns, p, false);
                    }
                }
            }
        }
        let mut d = self.lock();
        self.arm(&mut d);
        drop(d);
        self.pump();
    }

    /// The link check: drops paths whose port went down and remakes lost paths whose port is
    /// up and whose rail is not paused.
    pub(super) fn check_links(&self) {
        if self.closed.load(Ordering::Acquire) || self.silent.load(Ordering::Acquire) {
            return;
        }
        self.read_frames();
        for (p, path) in self.paths.iter().enumerate() {
            let down = path.port_down();
            if down {
                let qps = path.qps.lock().expect("path poisoned").take();
                if let Some(qps) = qps {
                    let err = Error::PeerDisconnected {
                        peer: self.name.clone(),
                        reason: format!("RDMA port {} is down", path.port.descriptor.name()),
                    };
                    tracing::warn!(peer = %self.name, rail = %path.port.descriptor.name(), "RDMA port down: its slices go to the other rails");
                    for qp in &qps {
                        self.rt.poller.unroute(path.port.index, qp.qp.qp_num());
                        self.give_back(qp.kill(), Some(&err), Cause::Lost);
                    }
                    *self.last_loss.lock().expect("peer poisoned") = Some(err);
                    let now_ns = self.rt.scheduler.now_ns();
                    let mut d = self.lock();
                    d.on_path(now_ns, p, 0);
                    self.arm(&mut d);
                }
                continue;
            }
            let missing = path.live().is_none();
            let ever = path.connected_once.load(Ordering::Acquire);
            if missing && ever && self.lock().is_up(p) {
                self.reconnect_in_background(p, false);
            }
        }
        self.pump();
    }

    /// Remakes path `p` on a thread of its own (the target answers within `connect_timeout`,
    /// and the timer thread must keep every peer's deadlines meanwhile). At most one per path.
    fn reconnect_in_background(&self, p: PathId, probe: bool) {
        let path = &self.paths[p];
        if path.reconnecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(me) = self.me.upgrade() else {
            path.reconnecting.store(false, Ordering::Release);
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("mr-rdma-reconnect".into())
            .spawn(move || {
                let ok = me.connect_paths(&[p]).is_ok() && me.paths[p].live().is_some();
                if probe {
                    let now_ns = me.rt.scheduler.now_ns();
                    me.lock().on_probe(now_ns, p, ok);
                    if ok {
                        tracing::info!(peer = %me.name, rail = %me.paths[p].port.descriptor.name(), "RDMA rail rejoined after a successful probe");
                    }
                }
                me.paths[p].reconnecting.store(false, Ordering::Release);
                let mut d = me.lock();
                me.arm(&mut d);
                drop(d);
                me.pump();
            });
        if let Err(e) = spawned {
            tracing::warn!(peer = %self.name, error = %e, "cannot spawn an RDMA reconnect thread");
            path.reconnecting.store(false, Ordering::Release);
        }
    }

    /// Closes every queue pair and the control connection; slices in flight fail with
    /// `reason`.
    pub(super) fn close(&self, reason: &str) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let err = Error::PeerDisconnected {
            peer: self.name.clone(),
            reason: reason.to_owned(),
        };
        for path in &self.paths {
            let qps = path.qps.lock().expect("path poisoned").take();
            for qp in qps.iter().flatten() {
                self.rt.poller.unroute(path.port.index, qp.qp.qp_num());
                self.give_back(qp.kill(), Some(&err), Cause::Lost);
            }
        }
        if let Ok(cm) = self.cm.lock() {
            let _ = cm.shutdown(std::net::Shutdown::Both);
        }
        let now = Instant::now();
        let mut rails = self.rails(now);
        let mut d = self.lock();
        d.close(self.rt.scheduler.ns(now), &mut rails);
        self.settle(&mut d);
        drop(d);
        self.rt.timers.disarm(TimerKey::RdmaPeer(self.peer_id));
    }
}

impl Drop for RdmaPeer {
    fn drop(&mut self) {
        self.close("engine shut down");
    }
}

/// Opens the control connection that queue pairs are agreed on, through the membership
/// handshake.
fn open_cm(peer: &Peer, rt: &Runtime) -> Result<TcpStream> {
    let unreachable = |reason: String| Error::SegmentUnreachable {
        name: peer.name.clone(),
        reason,
    };
    let stream = TcpStream::connect_timeout(&peer.addr, rt.connect_timeout)
        .map_err(|e| unreachable(format!("connecting to {}: {e}", peer.addr)))?;
    handshake::client(
        &stream,
        wire::ConnKind::Rdma,
        &rt.membership,
        &peer.name,
        rt.connect_timeout,
    )?;
    stream
        .set_read_timeout(Some(rt.connect_timeout.max(rt.timeout)))
        .and_then(|_| stream.set_write_timeout(Some(rt.connect_timeout.max(rt.timeout))))
        .and_then(|_| stream.set_nodelay(true))
        .map_err(|e| unreachable(e.to_string()))?;
    Ok(stream)
}
