//! Dynamic lanes (UCX's dynamic transport selection): the busiest peers get dedicated lanes,
//! negotiated with them, and the choice follows the traffic.
//!
//! A lane is a direction: the messages one engine sends to one peer, which land in the peer's
//! receive buffers. So each engine runs two [`Lanes`] machines:
//!
//! - the *requesting* one, for the lanes of what it sends. The send path samples one send in
//!   `lanes.sample_period` into a [`UsageTracker`] (UCX's: an LRU touched at most once per
//!   `lanes.switch_interval_us`, scored every `lanes.progress_factor` rounds); the driver
//!   thread feeds its promotions, demotions and scores to the machine and performs the
//!   switches it decides with [`Messaging::switch_lane`] (a fence on the old lane keeps
//!   order). Its `Promote`, `Score` and `Demote` go to the peer *in band*, as
//!   [`MsgKind::Lane`] messages on the lane itself, so they stay in order with each other
//!   across switches.
//! - the *granting* one, for the lanes of what it receives: bounded by `lanes.max_dedicated`
//!   receive pools of their own. It answers when the application's receive poll takes a lane
//!   message in, writing `Accept`, `Deny` or `Demote` back on the stream of the sender's
//!   current connection, where the sender reads it (with its credits, on tcp; by the driver
//!   thread otherwise). A sender reads what came back on a fenced connection before anything
//!   on its successor, so answers, too, stay in order.
//!
//! A connection that breaks counts as the peer gone at both ends: its dedicated lane is freed
//! at once ([`Lanes::on_peer_gone`]) and the sender's next connection starts shared.

use std::collections::HashSet;
use std::sync::atomic::AtomicU32;

use multirail_policy::lanes::{LaneMsg, Lanes, LanesStats, NodeId};
use multirail_policy::usage::{UsageEvent, UsageTracker};

use super::*;
use crate::config::DynamicLanesConfig;

/// The id both machines give themselves: no peer id or name hash is expected to take it.
const SELF: NodeId = NodeId(u64::MAX);

/// Every so many driver ticks, every connection's stream is read for lane messages, not only
/// those of peers with a request outstanding or a dedicated lane.
const FULL_SWEEP_TICKS: u64 = 16;

/// The granting machine names a sender by a hash of its segment name (local to this
/// process, so any stable hash does).
fn node_of(name: &str) -> NodeId {
    use std::hash::{DefaultHasher, Hash};
    let mut h = DefaultHasher::new();
    name.hash(&mut h);
    NodeId(h.finish() & (u64::MAX >> 1))
}

/// How one peer's lane fared, as [`crate::Engine::lanes`] reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerLane {
    /// The peer's segment name.
    pub peer: String,
    /// The lane now.
    pub lane: Lane,
    /// This engine's usage score for the peer (outgoing lanes only; `None` when untracked).
    pub score: Option<f64>,
    /// Switches of this lane to dedicated.
    pub promotions: u64,
    /// Switches of this lane to shared.
    pub demotions: u64,
    /// Requests for a dedicated lane denied: received from the peer (outgoing) or sent to it
    /// (incoming).
    pub denials: u64,
    /// The lane shares its tcp connection with the lane the other way (a duplex dedicated
    /// lane: one socket, so each message carries the acknowledgement of the last one).
    pub duplex: bool,
}

/// The lanes of an engine: what it sends (outgoing) and receives (incoming), and the counters
/// of both negotiations.
#[derive(Debug, Clone, PartialEq)]
pub struct LanesReport {
    /// `lanes.dynamic`.
    pub dynamic: bool,
    /// `lanes.max_dedicated`.
    pub max_dedicated: usize,
    /// One entry per peer this engine sends messages to, by name.
    pub outgoing: Vec<PeerLane>,
    /// One entry per peer sending messages to this engine, by name.
    pub incoming: Vec<PeerLane>,
    /// The negotiation of outgoing lanes (requests sent, answers received).
    pub requesting: LanesStats,
    /// The negotiation of incoming lanes (requests answered, evictions).
    pub granting: LanesStats,
    /// Bytes of receive buffers this engine holds for messages now: the shared pools and
    /// every dedicated lane's own.
    pub receive_bytes: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    promotions: u64,
    demotions: u64,
    denials: u64,
}

impl Counts {
    fn switched(&mut self, to: Lane) {
        match to {
            Lane::Dedicated => self.promotions += 1,
            Lane::Shared => self.demotions += 1,
        }
    }
}

struct State {
    tracker: UsageTracker<u64>,
    requesting: Lanes,
    granting: Lanes,
    /// Names of the senders the granting machine knows, by node id.
    senders: HashMap<NodeId, Arc<str>>,
    /// The tracker's progress whose scores were last fed to the requesting machine.
    scored_at: Option<u64>,
    outgoing: HashMap<u64, Counts>,
    incoming: HashMap<Arc<str>, Counts>,
}

/// The engine's dynamic-lanes state (see the module documentation).
pub(crate) struct Dynamic {
    enabled: bool,
    max_dedicated: usize,
    sends: AtomicU32,
    sample_period: u32,
    /// One scoring round of the tracker while sending: `switch_interval × progress_factor`.
    progress_ns: u64,
    epoch: Instant,
    ticks: AtomicU64,
    state: Mutex<State>,
}

impl State {
    /// Peer `id` (one this engine sends to) is gone: its lane freed, its score dropped.
    fn forget(&mut self, now: u64, id: u64) {
        self.requesting.on_peer_gone(now, NodeId(id));
        self.tracker.remove(id);
    }
}

impl Dynamic {
    /// The state for `config`, which was validated with the engine's configuration.
    pub(crate) fn new(config: &DynamicLanesConfig) -> Result<Dynamic> {
        let invalid = |e: String| Error::invalid("lanes", e);
        let mut negotiation = config.negotiation();
        if !config.dynamic {
            // Requests from peers that negotiate are denied: no lane is granted unasked.
            negotiation.max_dedicated = 0;
        }
        let usage = config.usage();
        Ok(Dynamic {
            enabled: config.dynamic,
            max_dedicated: config.max_dedicated,
            sends: AtomicU32::new(0),
            sample_period: usage.sample_period.max(1),
            progress_ns: config
                .switch_interval_us
                .saturating_mul(1000)
                .saturating_mul(config.progress_factor.into()),
            epoch: Instant::now(),
            ticks: AtomicU64::new(0),
            state: Mutex::new(State {
                tracker: UsageTracker::new(usage).map_err(|e| invalid(e.to_string()))?,
                requesting: Lanes::new(SELF, negotiation).map_err(|e| invalid(e.to_string()))?,
                granting: Lanes::new(SELF, negotiation).map_err(|e| invalid(e.to_string()))?,
                senders: HashMap::new(),
                scored_at: None,
                outgoing: HashMap::new(),
                incoming: HashMap::new(),
            }),
        })
    }

    /// True when lanes follow the traffic.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// How long the driver thread sleeps between passes: half a scoring round, within
    /// [1 ms, 20 ms], so an answer or a promotion waits at most that long.
    pub(crate) fn tick(&self) -> Duration {
        Duration::from_nanos(self.progress_ns / 2)
            .clamp(Duration::from_millis(1), Duration::from_millis(20))
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Send path: a message or notification went to peer `id`. One atomic add; one send in
    /// `sample_period` also reads the clock and touches the tracker, unless the driver holds
    /// it (a sample skipped changes nothing a later one does not).
    #[inline]
    pub(crate) fn on_send(&self, id: u64) {
        if !self.enabled
            || !self
                .sends
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(self.sample_period)
        {
            return;
        }
        let now = self.now_ns();
        if let Ok(mut s) = self.state.try_lock() {
            s.tracker.on_sample(now, id);
        }
    }

    /// The connection to peer `id` broke: its lane is freed and forgotten.
    pub(crate) fn outgoing_gone(&self, id: u64) {
        let now = self.now_ns();
        self.state.lock().expect("lanes poisoned").forget(now, id);
    }
}

/// A sender's lane connection that was fenced, read until its receiver closes it: lane
/// messages the receiver wrote before it saw the fence come first.
pub(super) struct Retiring {
    pub(super) peer: u64,
    pub(super) from: RetiringFrom,
    pub(super) give_up: Instant,
    pub(super) lanes: Vec<LaneMsg>,
    pub(super) open: bool,
}

/// Where a fenced lane's answers come from.
pub(super) enum RetiringFrom {
    /// Its stream, read here; `partial` holds what is not a whole frame yet.
    Stream { stream: TcpStream, partial: Vec<u8> },
    /// A duplex socket, which the receive poll reads and hands the answers over through.
    Duplex(Arc<Duplex>),
}

/// Takes the whole frames of what a receiver wrote back out of `buf`: credit frames (counted
/// and returned; only tcp sends them) and lane messages (into `lanes`). Fails on any other
/// frame, naming `peer`.
pub(super) fn parse_back(
    peer: &str,
    buf: &mut Vec<u8>,
    credits_allowed: bool,
    lanes: &mut Vec<LaneMsg>,
) -> Result<usize> {
    let mut at = 0;
    let mut granted = 0usize;
    while buf.len() - at >= MSG_HEADER_LEN {
        let h = MsgHeader::decode(&buf[at..], LaneMsg::ENCODED_LEN as u32)
            .map_err(|r| protocol(peer, r))?;
        match h.kind {
            MsgKind::Credit if credits_allowed => {
                granted += h.len as usize;
                at += MSG_HEADER_LEN;
            }
            MsgKind::LaneAnswer => {
                let end = at + MSG_HEADER_LEN + h.len as usize;
                if buf.len() < end {
                    break;
                }
                let m = LaneMsg::decode(&buf[at + MSG_HEADER_LEN..end])
                    .map_err(|e| protocol(peer, format!("lane message: {e}")))?;
                lanes.push(m);
                at = end;
            }
            k => {
                return Err(protocol(
                    peer,
                    format!("a receiver sent a {k:?} frame back"),
                ))
            }
        }
    }
    buf.drain(..at);
    Ok(granted)
}

/// A lane answer as a frame on a stream back to a sender: header and the 18 bytes.
fn lane_frame(m: &LaneMsg) -> [u8; MSG_HEADER_LEN + LaneMsg::ENCODED_LEN] {
    let mut f = [0u8; MSG_HEADER_LEN + LaneMsg::ENCODED_LEN];
    let mut h = [0u8; MSG_HEADER_LEN];
    MsgHeader {
        kind: MsgKind::LaneAnswer,
        len: LaneMsg::ENCODED_LEN as u32,
    }
    .encode(&mut h);
    f[..MSG_HEADER_LEN].copy_from_slice(&h);
    f[MSG_HEADER_LEN..].copy_from_slice(&m.encode());
    f
}

impl Messaging {
    /// One pass of the driver thread: reads the receivers' answers, scores and negotiates,
    /// then sends the lane messages and performs the switches decided (outside the lock,
    /// since a fence may wait for a credit).
    ///
    /// Returns whether the pass had anything to do or left something under way (answers read,
    /// events, messages to send, switches, a request waiting for its answer, a fenced lane
    /// still being read): the driver sleeps longer after passes that had not. Also returns
    /// how soon work falls due by the clock (the tracker's next idle progress, a request's
    /// timeout), which the driver does not sleep past.
    pub(crate) fn drive_lanes(&self, engine: &dyn Peers) -> (bool, Option<Duration>) {
        let d = &self.dynamic;
        let tick = d.ticks.fetch_add(1, Ordering::Relaxed);
        let mut back = Vec::new();
        let mut gone = Vec::new();
        self.read_answers(tick.is_multiple_of(FULL_SWEEP_TICKS), &mut back, &mut gone);
        let now = d.now_ns();
        let mut transmits = Vec::new();
        let mut switches = Vec::new();
        let mut active = !back.is_empty() || !gone.is_empty();
        let due: Option<u64>;
        {
            let mut guard = d.state.lock().expect("lanes poisoned");
            let s = &mut *guard;
            for id in gone {
                s.forget(now, id);
            }
            // A sender that stopped sending runs no scoring rounds of its own: decay here, so
            // a peer gone quiet cools and gives its lane back.
            let idle = s
                .tracker
                .last_progress_ns()
                .is_none_or(|t| now.saturating_sub(t) >= 2 * d.progress_ns);
            if idle && !s.tracker.is_empty() {
                s.tracker.progress(now);
            }
            while let Some(ev) = s.tracker.poll_event() {
                active = true;
                match ev {
                    UsageEvent::Promoted { key, score } => {
                        s.requesting.on_promoted(now, NodeId(key), score);
                    }
                    UsageEvent::Demoted { key } => s.requesting.on_demoted(now, NodeId(key)),
                }
            }
            if s.tracker.last_progress_ns() != s.scored_at {
                s.scored_at = s.tracker.last_progress_ns();
                let promoted: Vec<u64> = s.tracker.promoted().collect();
                for key in promoted {
                    if let Some(score) = s.tracker.score(key) {
                        s.requesting.on_score(now, NodeId(key), score);
                    }
                }
            }
            for (id, m) in back {
                let denied = s.requesting.stats().denials_received;
                s.requesting.on_message(now, NodeId(id), m);
                if s.requesting.stats().denials_received > denied {
                    s.outgoing.entry(id).or_default().denials += 1;
                }
            }
            if s.requesting.poll_timeout().is_some_and(|t| t <= now) {
                s.requesting.on_timeout(now);
            }
            while let Some(t) = s.requesting.poll_transmit() {
                transmits.push(t);
            }
            while let Some(sw) = s.requesting.poll_switch() {
                s.outgoing.entry(sw.peer.0).or_default().switched(sw.to);
                switches.push(sw);
            }
            active |= s.requesting.poll_timeout().is_some();
            let idle_due = (!s.tracker.is_empty())
                .then(|| s.tracker.last_progress_ns().unwrap_or(now) + 2 * d.progress_ns);
            due = match (idle_due, s.requesting.poll_timeout()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        active |= !transmits.is_empty()
            || !switches.is_empty()
            || self.retiring_any.load(Ordering::Acquire);
        let mut failed = Vec::new();
        for (peer, m) in transmits {
            if let Err(e) = self.send(engine, SegmentId(peer.0), MsgKind::Lane, &m.encode()) {
                tracing::debug!(error = %e, "lane message not sent");
                failed.push(peer.0);
            }
        }
        for sw in switches {
            if failed.contains(&sw.peer.0) {
                continue;
            }
            if let Err(e) = self.switch_lane(engine, SegmentId(sw.peer.0), sw.to) {
                tracing::debug!(error = %e, "lane switch failed");
                failed.push(sw.peer.0);
            }
        }
        for id in failed {
            self.reset_lane(id);
            d.outgoing_gone(id);
        }
        active |= self.pair_duplex(engine);
        (
            active,
            due.map(|t| Duration::from_nanos(t.saturating_sub(now))),
        )
    }

    /// Two engines that promoted each other at the same moment each opened a dedicated tcp
    /// lane, so their lanes take two sockets. The end with the greater name moves its lane
    /// onto the other's socket (a switch to the same lane: a fence, then a reverse lane
    /// there), so that one socket carries both (see `duplex`). Returns whether it moved one.
    fn pair_duplex(&self, engine: &dyn Peers) -> bool {
        let me = engine.local_name();
        let pending: Vec<Arc<str>> = {
            let rx = self.rx.lock().expect("rx poisoned");
            rx.conns
                .iter()
                .filter(|c| {
                    *c.from < *me
                        && c.lane == Lane::Dedicated
                        && !(c.dead || c.fenced)
                        && c.io.duplex().is_some_and(|d| !d.attached() && !d.closed())
                })
                .map(|c| c.from.clone())
                .collect()
        };
        if pending.is_empty() {
            return false;
        }
        let ours: Vec<u64> = self
            .out
            .lock()
            .expect("out poisoned")
            .iter()
            .filter(|(_, c)| {
                c.try_lock().is_ok_and(|c| {
                    !c.retired
                        && c.lane == Lane::Dedicated
                        && pending.iter().any(|p| **p == *c.link.peer)
                        && c.io.duplex().is_some_and(|d| !d.both_ways())
                })
            })
            .map(|(id, _)| *id)
            .collect();
        for &id in &ours {
            if let Err(e) = self.move_lane(engine, SegmentId(id), Lane::Dedicated, true) {
                tracing::debug!(error = %e, "moving a lane onto a duplex connection failed");
            }
        }
        !ours.is_empty()
    }

    /// How long the lanes driver sleeps between passes.
    pub(crate) fn lanes_tick(&self) -> Duration {
        self.dynamic.tick()
    }

    /// A sender read `answers` on its connection to peer `id`: they wait for the driver.
    pub(super) fn park_answers(&self, id: u64, answers: &mut Vec<LaneMsg>) {
        let mut p = self.parked.lock().expect("parked poisoned");
        p.extend(answers.drain(..).map(|m| (id, m)));
    }

    /// After a connection to peer `id` broke: under dynamic lanes its next one starts shared,
    /// as negotiation starts over.
    pub(super) fn reset_lane(&self, id: u64) {
        if self.dynamic.enabled() {
            if let Some(l) = self.lanes.lock().expect("lanes poisoned").get_mut(&id) {
                l.lane = Lane::Shared;
            }
        }
    }

    /// Lane messages receivers wrote back, per peer in the order written: first everything
    /// from fenced connections, oldest first, then (once those are closed) from the current
    /// one. `all`: read every connection, else only those of peers negotiating or dedicated.
    /// Peers whose connection broke go to `gone`.
    fn read_answers(&self, all: bool, back: &mut Vec<(u64, LaneMsg)>, gone: &mut Vec<u64>) {
        // Parked answers were read while no fenced lane was being read: they come before
        // anything such a lane (fenced since) or a later connection carries.
        back.append(&mut self.parked.lock().expect("parked poisoned"));
        self.drain_retiring();
        let mut blocked = HashSet::new();
        {
            let mut r = self.retiring.lock().expect("retiring poisoned");
            for e in r.iter_mut() {
                if blocked.contains(&e.peer) {
                    continue;
                }
                back.extend(e.lanes.drain(..).map(|m| (e.peer, m)));
                if e.open {
                    blocked.insert(e.peer);
                }
            }
            r.retain(|e| e.open || !e.lanes.is_empty());
            self.retiring_any.store(!r.is_empty(), Ordering::Release);
        }
        let watched: HashSet<u64> = if all {
            HashSet::new()
        } else {
            let s = self.dynamic.state.lock().expect("lanes poisoned");
            let lanes = self.lanes.lock().expect("lanes poisoned");
            lanes
                .iter()
                .filter(|(id, l)| {
                    l.lane == Lane::Dedicated || s.requesting.is_pending(NodeId(**id))
                })
                .map(|(id, _)| *id)
                .collect()
        };
        let conns: Vec<(u64, Arc<Mutex<OutConn>>)> = self
            .out
            .lock()
            .expect("out poisoned")
            .iter()
            .map(|(id, c)| (*id, c.clone()))
            .collect();
        // Every pass, whatever the sweep: connections whose receiver closed its end (its
        // process exited, the connection was reset) are read to that end below, which drops
        // them. Otherwise an shm sender would go on writing into the ring of a process that is
        // gone, its messages lost without an error, until its credits ran out.
        let ended = if all {
            HashSet::new()
        } else {
            ended_streams(&conns)
        };
        let mut poked = false;
        for (id, conn) in conns
            .into_iter()
            .filter(|(id, _)| all || watched.contains(id) || ended.contains(id))
        {
            let Ok(mut c) = conn.try_lock() else {
                // A sender holds it and reads what came back itself (tcp) or soon lets go.
                continue;
            };
            if c.retired {
                continue;
            }
            if !poked && c.io.duplex().is_some() {
                // A duplex lane's answers come in through the receive poll.
                self.poke_if_idle();
                poked = true;
            }
            match c.read_back() {
                Ok(()) if !blocked.contains(&id) => {
                    back.extend(c.link.lanes_in.drain(..).map(|m| (id, m)));
                }
                Ok(()) => {}
                Err(e) => {
                    tracing::debug!(peer = %c.link.peer, error = %e, "message connection ended");
                    drop(c);
                    let mut out = self.out.lock().expect("out poisoned");
                    if out.get(&id).is_some_and(|x| Arc::ptr_eq(x, &conn)) {
                        out.remove(&id);
                    }
                    drop(out);
                    self.reset_lane(id);
                    gone.push(id);
                }
            }
        }
    }

    /// Receive side, under the receive lock: the lane messages the last poll took in go to
    /// the granting machine, and its answers go back on each sender's current connection.
    pub(super) fn answer_lanes(&self, rx: &mut Rx) {
        let d = &self.dynamic;
        let now = d.now_ns();
        let mut replies: Vec<(Arc<str>, LaneMsg)> = Vec::new();
        {
            let mut guard = d.state.lock().expect("lanes poisoned");
            let s = &mut *guard;
            for (from, m) in rx.delivered.lanes.drain(..) {
                let node = node_of(&from);
                s.senders.entry(node).or_insert_with(|| from.clone());
                s.granting.on_message(now, node, m);
            }
            while let Some((node, m)) = s.granting.poll_transmit() {
                let Some(name) = s.senders.get(&node).cloned() else {
                    continue;
                };
                if matches!(m, LaneMsg::Deny { .. }) {
                    s.incoming.entry(name.clone()).or_default().denials += 1;
                }
                replies.push((name, m));
            }
            while let Some(sw) = s.granting.poll_switch() {
                if let Some(name) = s.senders.get(&sw.peer).cloned() {
                    s.incoming.entry(name).or_default().switched(sw.to);
                }
            }
        }
        for (name, m) in replies {
            // The sender's current connection: the one delivered now (later ones wait for
            // its fence); the sender reads it before any later one.
            let Some(c) = rx
                .conns
                .iter_mut()
                .filter(|c| c.from == name && !c.dead && !c.held_back)
                .min_by_key(|c| c.epoch)
            else {
                continue;
            };
            let frame = lane_frame(&m);
            let written = c.io.answer(&c.stream, &frame);
            if let Err(e) = written {
                tracing::warn!(peer = %c.from, error = %e, "cannot answer a lane request");
                c.dead = true;
            }
        }
    }

    /// Receive side: the senders named in `ended` lost a connection without its fence; those
    /// with no connection left are gone, and their dedicated lanes freed.
    pub(super) fn senders_gone(&self, rx: &Rx, ended: &[Arc<str>]) {
        let now = self.dynamic.now_ns();
        let mut s = self.dynamic.state.lock().expect("lanes poisoned");
        for name in ended {
            if rx.conns.iter().any(|c| c.from == *name && !c.dead) {
                continue;
            }
            let node = node_of(name);
            s.granting.on_peer_gone(now, node);
            s.senders.remove(&node);
            // Counters go with the sender, so they do not pile up over senders ever seen.
            s.incoming.remove(name);
        }
    }

    /// What [`crate::Engine::lanes`] reports; `names` gives each outgoing peer's name.
    pub(crate) fn lanes_report(&self, names: &dyn Fn(u64) -> Option<String>) -> LanesReport {
        let incoming_lanes = self.incoming_lanes();
        let receive_bytes = {
            // Buffers, the rings of senders with a ring of their own, and the shared ring.
            let rx = self.rx.lock().expect("rx poisoned");
            let buffers: u64 = rx
                .pools
                .values()
                .flat_map(|p| p.chunks.iter())
                .map(|c| c.len() as u64)
                .sum();
            let rings: u64 = rx.conns.iter().map(|c| c.io.ring_bytes()).sum();
            buffers + rings + rx.shared_shm.as_ref().map_or(0, SharedShm::bytes)
        };
        let lanes: Vec<(u64, Lane)> = self
            .lanes
            .lock()
            .expect("lanes poisoned")
            .iter()
            .map(|(id, l)| (*id, l.lane))
            .collect();
        let both_ways: HashSet<u64> = {
            let out = self.out.lock().expect("out poisoned");
            lanes
                .iter()
                .filter(|(id, _)| {
                    out.get(id).is_some_and(|c| {
                        // A sender holding it is sending: the lane is as it was.
                        c.try_lock()
                            .is_ok_and(|c| c.io.duplex().is_some_and(|d| d.both_ways()))
                    })
                })
                .map(|(id, _)| *id)
                .collect()
        };
        let s = self.dynamic.state.lock().expect("lanes poisoned");
        let mut outgoing: Vec<PeerLane> = lanes
            .into_iter()
            .filter_map(|(id, lane)| {
                let c = s.outgoing.get(&id).copied().unwrap_or_default();
                Some(PeerLane {
                    peer: names(id)?,
                    lane,
                    score: s.tracker.score(id),
                    promotions: c.promotions,
                    demotions: c.demotions,
                    denials: c.denials,
                    duplex: both_ways.contains(&id),
                })
            })
            .collect();
        outgoing.sort_by(|a, b| a.peer.cmp(&b.peer));
        let incoming = incoming_lanes
            .into_iter()
            .map(|(peer, lane, duplex)| {
                let c = s.incoming.get(peer.as_str()).copied().unwrap_or_default();
                PeerLane {
                    peer,
                    lane,
                    score: None,
                    promotions: c.promotions,
                    demotions: c.demotions,
                    denials: c.denials,
                    duplex,
                }
            })
            .collect();
        LanesReport {
            dynamic: self.dynamic.enabled,
            max_dedicated: self.dynamic.max_dedicated,
            outgoing,
            incoming,
            requesting: *s.requesting.stats(),
            granting: *s.granting.stats(),
            receive_bytes,
        }
    }
}

/// The peers among `conns` whose stream says the receiver closed its end or the connection
/// broke (`POLLRDHUP`, `POLLHUP`, `POLLERR`), found by one `poll` without reading anything.
/// A connection a sender holds is skipped: that sender reads the stream itself.
fn ended_streams(conns: &[(u64, Arc<Mutex<OutConn>>)]) -> HashSet<u64> {
    use std::os::fd::AsRawFd;
    let mut ids = Vec::with_capacity(conns.len());
    let mut fds = Vec::with_capacity(conns.len());
    for (id, conn) in conns {
        let Ok(c) = conn.try_lock() else { continue };
        if c.retired {
            continue;
        }
        ids.push(*id);
        fds.push(libc::pollfd {
            fd: c.link.stream.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        });
    }
    if fds.is_empty() {
        return HashSet::new();
    }
    // SAFETY: `fds` is a live vector of `fds.len()` pollfds, and each descriptor stays open
    // for the call: `conns` holds every connection, so none is dropped meanwhile. Zero
    // timeout; poll only writes `revents`.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
    if rc <= 0 {
        return HashSet::new();
    }
    let ended = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
    ids.into_iter()
        .zip(&fds)
        .filter(|(_, f)| f.revents & ended != 0)
        .map(|(id, _)| id)
        .collect()
}
