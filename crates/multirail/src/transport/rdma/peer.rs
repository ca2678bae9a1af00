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
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use multirail_policy::dispatch::{Cause, Connection, PathId, Post};
use multirail_policy::pairing::{pair_rails, RailInfo, Reach};
use multirail_policy::slicing::{self, SlicePlan};
use multirail_verbs::{PortState, QueuePair};

use super::cm::{
    self, ConnectReply, ConnectRequest, PathReply, PathRequest, PortEnd, QpEnd, TargetFrame,
};
use super::devices::Port;
use super::rc::{RcQp, RdmaKeys, RdmaSlice, Reaped};
use super::Runtime;
use crate::error::{Error, Result};
use crate::peer::Peer;
use crate::segment::RdmaRailDescriptor;
use crate::transport::driver::{offer, Driver, Handed, Link, OutSlice, ProbeNeed};
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

/// A peer reached over RDMA: the driver over its paths' queue pairs.
pub(crate) type RdmaPeer = Driver<RdmaLink>;

/// The RDMA link to one peer: a path per paired port, each with its queue pairs, and the
/// control connection they were agreed on.
pub(crate) struct RdmaLink {
    /// The engine's record of the segment, whose cached descriptor forgets buffers the target
    /// says it unregistered.
    peer: Weak<Peer>,
    /// The segment's name, for errors.
    name: String,
    paths: Vec<RdmaPath>,
    rt: Arc<Runtime>,
    /// The control connection the queue pairs were agreed on; the target keeps its queue
    /// pairs while it is open.
    cm: Mutex<TcpStream>,
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
    let link = RdmaLink {
        peer: Arc::downgrade(peer),
        name: peer.name.clone(),
        paths,
        rt: rt.clone(),
        cm: Mutex::new(cm),
        last_used_ns: AtomicU64::new(rt.scheduler.now_ns()),
    };
    let me = Driver::new(
        peer,
        TimerKey::RdmaPeer(peer.id),
        rt.dispatch_config(),
        path_rails,
        &rt.driver_env(),
        link,
    );
    let all: Vec<PathId> = (0..me.paths()).collect();
    me.connect_paths(&all)?;
    let mut usable = 0;
    for p in all {
        if me.link.paths[p].live().is_some() {
            usable += 1;
        } else {
            me.path_error(p);
        }
    }
    if usable == 0 {
        let why: Vec<String> =
            me.link
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

impl RdmaLink {
    /// Paths with queue pairs: what counts against `max_endpoints`.
    pub(super) fn endpoints(&self) -> usize {
        self.paths
            .iter()
            .filter(|p| p.qps.lock().expect("path poisoned").is_some())
            .count()
    }

    /// Puts the peer's name into an error made without it.
    fn named(&self, driver: &RdmaPeer, e: Error) -> Error {
        match e {
            Error::PeerDisconnected { peer, reason } if peer.is_empty() => {
                Error::PeerDisconnected {
                    peer: driver.name.clone(),
                    reason,
                }
            }
            Error::RemoteRejected { peer, reason } if peer.is_empty() => Error::RemoteRejected {
                peer: driver.name.clone(),
                reason,
            },
            e => e,
        }
    }

    /// Takes path `p`'s queue pairs out of service: unrouted from the poller, killed, and
    /// their slices handed back with `err`.
    fn take_qps(&self, driver: &RdmaPeer, p: PathId, err: &Error) {
        let path = &self.paths[p];
        let qps = path.qps.lock().expect("path poisoned").take();
        let cause = if matches!(err, Error::Timeout { .. }) {
            Cause::Timeout
        } else {
            Cause::Lost
        };
        for qp in qps.iter().flatten() {
            self.rt.poller.unroute(path.port.index, qp.qp.qp_num());
            driver.give_back(qp.kill(), Some(err), cause);
        }
    }
}

/// RDMA has no probe yet: a one-sided WRITE lands in the target's memory and a READ in ours,
/// so a path on probation is tried with a page of a request.
impl crate::transport::driver::ProbeKey for RdmaKeys {
    fn for_probe(&self) -> Option<RdmaKeys> {
        None
    }
}

impl Link for RdmaLink {
    type Key = RdmaKeys;

    const PATH: &'static str = "RDMA path";

    /// Slices no larger than a port carries in one message, presenting the local memory's
    /// registration and the target buffer's remote keys.
    fn slices(&self, req: &Prepared, plan: &SlicePlan, out: &mut Vec<RdmaSlice>) -> Result<()> {
        let registration = self
            .rt
            .registry
            .find(req.local as u64, req.len)
            .and_then(|r| self.rt.registrations.get(r.id()))
            .ok_or(Error::SourceNotRegistered {
                addr: req.local as u64,
                len: req.len,
            })?;
        let rails = self
            .paths
            .iter()
            .map(|p| p.remote_rail + 1)
            .max()
            .unwrap_or(0);
        if req.buffer.rkeys.len() < rails {
            return Err(Error::TransportUnavailable {
                transport: "rdma",
                reason: format!(
                    "the target buffer at {:#x} has no remote key for every RDMA rail of {}",
                    req.buffer.addr, self.name
                ),
            });
        }
        let slices = plan
            .slices(req.len)
            .map_err(|e| Error::invalid("length", e.to_string()))?;
        let key = RdmaKeys {
            registration,
            rkeys: req.buffer.rkeys.clone().into(),
        };
        self.last_used_ns
            .store(self.rt.scheduler.now_ns(), Ordering::Relaxed);
        out.extend(
            slicing::capped(slices, u64::from(self.rt.max_message))
                .map(|s| OutSlice::of(req, s.offset, s.length, key.clone())),
        );
        Ok(())
    }

    /// Stages each dealt slice on its queue pair and posts every queue pair touched, one
    /// `ibv_post_send` each.
    #[allow(clippy::result_large_err)] // a refused slice comes back by value, as from `stage`
    fn hand_over(&self, driver: &RdmaPeer, out: &mut Vec<Post<RdmaSlice>>) -> Handed<RdmaKeys> {
        let mut handed = Handed::default();
        let mut touched: Vec<(PathId, Arc<RcQp>)> = Vec::new();
        for post in out.drain(..) {
            let path = &self.paths[post.path];
            let Some(qps) = path.live() else {
                handed.changed.push(post.path);
                handed.refused.push(post);
                continue;
            };
            let qp = match post.connection {
                // The NIC moves the bytes whichever queue pair carries them: HIGH keeps to
                // its own, where no bulk work request is ever queued ahead of it.
                Connection::Reserved | Connection::Spread => &qps[1],
                Connection::Shared => &qps[0],
            };
            let rkey = post.item.key.rkeys[path.remote_rail];
            let p = post.path;
            match offer(post, |item| qp.stage(item, rkey)) {
                Ok(()) => {
                    if !touched.iter().any(|(_, q)| Arc::ptr_eq(q, qp)) {
                        touched.push((p, qp.clone()));
                    }
                }
                Err(post) => {
                    if qp.is_dead() {
                        handed.changed.push(p);
                    }
                    // A full send queue frees up with the next completion, which deals again.
                    handed.refused.push(post);
                }
            }
        }
        for (p, qp) in &touched {
            let before = qp.outstanding();
            let failed = qp.flush(&self.rt.counters);
            let posted = qp.outstanding().saturating_sub(before);
            self.rt.poller.posted(posted as i64);
            if let Some((slices, e)) = failed {
                // Counted as in flight so that handing them back balances.
                self.rt.poller.posted(slices.len() as i64);
                handed.lost.push((*p, slices, self.named(driver, e)));
            }
        }
        handed
    }

    fn live(&self, p: PathId) -> usize {
        if self.paths[p].live().is_some() {
            QPS_PER_PATH
        } else {
            0
        }
    }

    fn path_name(&self, p: PathId) -> String {
        self.paths[p].port.descriptor.name()
    }

    fn link_down(&self, p: PathId) -> bool {
        self.paths[p].port_down()
    }

    fn drop_path(&self, driver: &RdmaPeer, p: PathId, err: &Error) {
        self.take_qps(driver, p, err);
    }

    /// The queue pairs stay in place (killed) so that the remake tells the target to abandon
    /// its ends of them; the other queue pair of the path shares the failed one's fate.
    fn fail_path(&self, driver: &RdmaPeer, p: PathId, err: &Error) {
        if let Some(qps) = self.paths[p].qps.lock().expect("path poisoned").as_ref() {
            for qp in qps {
                driver.give_back(qp.kill(), Some(err), Cause::Lost);
            }
        }
    }

    fn probe(&self, p: PathId) -> ProbeNeed {
        if self.paths[p].live().is_some() {
            ProbeNeed::Whole
        } else if self.paths[p].port_down() {
            ProbeNeed::Unreachable
        } else {
            ProbeNeed::Remake
        }
    }

    /// A pair that never connected (no route between the ports) is left unused instead of
    /// being tried again every link check.
    fn needs_remake(&self, p: PathId) -> bool {
        self.paths[p].live().is_none() && self.paths[p].connected_once.load(Ordering::Acquire)
    }

    fn remake(&self, driver: &RdmaPeer, p: PathId) -> bool {
        driver.connect_paths(&[p]).is_ok() && self.paths[p].live().is_some()
    }

    fn before_link_check(&self, driver: &RdmaPeer) {
        driver.read_frames();
    }

    fn returned(&self, slices: usize) {
        self.rt.poller.posted(-(slices as i64));
    }

    fn close(&self, driver: &RdmaPeer, err: &Error) {
        for p in 0..self.paths.len() {
            self.take_qps(driver, p, err);
        }
        if let Ok(cm) = self.cm.lock() {
            let _ = cm.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Driver<RdmaLink> {
    /// Makes fresh queue pairs for `paths` and agrees them with the target over the control
    /// connection; each path that connects is handed to the dispatcher, each that fails is
    /// marked unusable with why (counting the error is the caller's). Fails only when the
    /// control connection does.
    fn connect_paths(&self, paths: &[PathId]) -> Result<()> {
        let rt = &self.link.rt;
        let cfg = &rt.config;
        let mut made: Vec<(PathId, Vec<(QueuePair, u32)>)> = Vec::new();
        let mut abandon = Vec::new();
        let mut requests = Vec::new();
        for &p in paths {
            let path = &self.link.paths[p];
            if let Some(old) = path.qps.lock().expect("path poisoned").take() {
                for qp in &old {
                    abandon.push(qp.remote_qp_num);
                    rt.poller.unroute(path.port.index, qp.qp.qp_num());
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
            let mut cm = self.link.cm.lock().expect("cm poisoned");
            let request = ConnectRequest {
                initiator: rt.own_name(),
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
        let now_ns = self.now_ns();
        for ((p, qps), answer) in made.into_iter().zip(reply.paths) {
            let path = &self.link.paths[p];
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
                        rt.poller.route(path.port.index, qp, self.weak(), p);
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
                    self.lock().on_path(now_ns, p, 0);
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
                if let Some(p) = self.link.peer.upgrade() {
                    p.forget_buffer(addr, len);
                }
            }
            TargetFrame::Reply(_) => {
                tracing::warn!(peer = %self.name, "an RDMA reply nobody asked for; ignored");
            }
        }
    }

    /// Takes in what the target sent since the last look, without waiting.
    /// A control connection that closed ends the peer: the target holds its ends of the queue
    /// pairs only while the connection lives (it exited, or dropped this engine), so every
    /// slice in flight or queued fails now with why, instead of when the queue pairs' retries
    /// or the peer's timeout run out; a later request opens the peer afresh.
    fn read_frames(&self) {
        let lost = {
            let Ok(mut cm) = self.link.cm.try_lock() else {
                // A request is under way: its reader takes these in.
                return;
            };
            loop {
                match cm::try_recv_frame::<TargetFrame>(&mut cm) {
                    Ok(Some(f)) => self.on_frame(f),
                    Ok(None) => return,
                    Err(e) => break e,
                }
            }
        };
        tracing::warn!(peer = %self.name, error = %lost, "RDMA control connection lost: the peer's requests fail");
        // Closing takes the connection's lock again, so it was let go above.
        self.close(&format!(
            "lost its RDMA control connection ({lost}): the target exited or dropped this \
             engine, and its queue pairs with it"
        ));
    }

    /// What the poller reaped on path `p`.
    pub(super) fn on_reaped(&self, p: PathId, qp: &Arc<RcQp>, reaped: Reaped) {
        match reaped {
            Reaped::Nothing => {}
            Reaped::Done(done) => {
                let now = Instant::now();
                let port = self.link.paths[p].port.index;
                let refill =
                    self.on_answers(now, done.iter().map(|(s, posted)| (s.id, *posted, true)));
                let counters = self.env.scheduler.counters(port);
                for (s, _) in done {
                    counters.record_at(s.priority, u64::from(s.len), 1);
                    s.task.part_done(Ok(()));
                }
                if refill {
                    self.pump();
                }
            }
            Reaped::Lost(slices, err) => {
                let err = self.link.named(self, err);
                tracing::warn!(peer = %self.name, qp = qp.qp.qp_num(), error = %err, "RDMA queue pair failed; its slices are retried");
                self.env
                    .scheduler
                    .counters(self.link.paths[p].port.index)
                    .record_error();
                // The poller already counted these as finished.
                self.link.rt.poller.posted(slices.len() as i64);
                self.path_failed(p, slices, err);
            }
        }
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
