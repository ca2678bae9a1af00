//! Lane negotiation: which peers get a dedicated lane, agreed by both ends of each pair.
//!
//! Every peer starts on the *shared* lane (a resource all peers use, e.g. a shared receive
//! queue). A *dedicated* lane is a resource of the pair's own (its own connection, queue pair
//! or ring), at most [`LanesConfig::max_dedicated`] per process. A lane belongs to a pair of
//! processes, like a UCX endpoint, so both ends must agree to open it and both must have room;
//! either end may close it alone. [`Lanes`] is one process's side of that agreement.
//!
//! # Protocol
//!
//! Five [`LaneMsg`]s, sent over the shared lane (or any channel of the pair that keeps them in
//! order):
//!
//! - `Promote { seq, score }`: the local usage tracker promoted the peer
//!   ([`Lanes::on_promoted`]) and its score has reached [`LanesConfig::min_score`], the *floor*
//!   (a promoted peer below it is only recorded as wanted, and asked for as soon as
//!   [`Lanes::on_score`] brings it to the floor); the requester reserves one of its own slots
//!   for it first, so it can always take the lane if the answer is yes. With no slot free it
//!   demotes its own weakest dedicated peer if `score` beats that one's by more than
//!   `remove_thresh`, and otherwise waits (for a back-off, or until a slot frees) without
//!   asking.
//! - `Accept { seq }`: the receiver had room (dedicated lanes plus its own reservations below
//!   `max_dedicated`), or the request's score beat its weakest dedicated peer's score by more
//!   than `remove_thresh`, in which case that weakest peer was demoted first. The receiver is
//!   dedicated from the moment it sends this; the requester from the moment it reads it.
//! - `Deny { seq }`: no room. An explicit answer, unlike UCX, where a refused side stays marked
//!   promoted with nothing wired. The requester stays shared and does not ask again until its
//!   score has risen by `remove_thresh` above the denied score or `deny_backoff_ns` (plus up to
//!   half of it again, so peers refused together do not all come back together) has passed;
//!   then it asks by itself, for as long as its tracker wants the peer (until
//!   [`Lanes::on_demoted`]) and its score is at the floor. Equal scores are denied again each
//!   time, so nothing switches.
//! - `Score { score }`: the requester's fresh score for a pair it asked for and holds. A
//!   requester's tracker keeps scoring the pair after the `Accept`; it sends `Score` whenever its
//!   score has moved by `remove_thresh / 2` or more from the last one it told the peer (in its
//!   `Promote` or an earlier `Score`), so the receiver's view is never more than half a margin
//!   off. The receiver keeps it as its remote view of the pair. Without it the receiver would
//!   compare a newcomer's fresh score with the score of a request accepted long ago (a hot peer
//!   asks as soon as it reaches the floor, well before its score reaches 1), and evict busy
//!   peers for newcomers that are not busier. A `Score` for a pair not dedicated at the
//!   receiver is stale and ignored.
//! - `Demote`: the sender is shared for this pair now. Never refused; needs no answer, because
//!   closing needs no room.
//!
//! Wherever an end compares scores (its weakest dedicated peer, a request's score against it),
//! a peer's score is the larger of the local tracker's (fed by [`Lanes::on_promoted`] and
//! [`Lanes::on_score`], if it tracks the peer) and the remote view (the peer's `Promote` or
//! latest `Score`): each end's tracker sees only the traffic it sends, and the pair deserves a
//! lane as much as its busier direction does.
//!
//! *Cooling.* A dedicated peer the local tracker still wants but whose local score has stayed
//! below `min_score - remove_thresh` (the *cooling line*) for [`COOL_AFTER`] scores in a row is
//! demoted from this end (`Demote`, counted in [`LanesStats::cooled`]). It stays wanted and
//! asks again, with no back-off, once its score is back at the floor. The gap of
//! `remove_thresh` below the floor is hysteresis: a score wandering around the floor does not
//! open and close the lane at every progress. The run of scores is hysteresis in time: a usage
//! tracker samples its peers, one touch per round, so the score of a peer that is still busy
//! is noisy and dips below the line now and then (10 equally busy peers, each touched in a
//! progress round with probability 0.65, score 0.65 ± 0.16 under UCX's decay: a dip in about
//! one progress round in a hundred per peer, so with progress every 10 ms each lane would be
//! cooled and asked for again about once a second); a peer gone quiet falls at every progress
//! and stays below. A score at or above the line starts the run again.
//!
//! Simultaneous requests (each end has a `Promote` outstanding when the other's arrives): the
//! request of the higher [`NodeId`] stands. The higher end ignores the lower end's `Promote`;
//! the lower end withdraws its own request and answers the higher one's as a receiver. The slot
//! it had reserved for its own request is free again, so that answer is always `Accept`, and
//! both ends end dedicated.
//!
//! A request unanswered after `request_timeout_ns` is dropped: the requester stays shared and
//! backs off as if denied. An answer that arrives later is *stale* (its `seq` is not the
//! outstanding one), as is one for a request withdrawn or cancelled. A stale `Accept` means the
//! peer went dedicated: when this end is dedicated too, nothing is to be done; when it has a
//! newer request outstanding, that request's answer will say where the peer ends; otherwise
//! this end answers `Demote`, which undoes it. Stale `Deny`s are ignored (the peer stayed
//! shared).
//!
//! The protocol needs the engine to deliver lane messages between two live processes reliably
//! and in the order sent. A connection that breaks must be reported to both ends with
//! [`Lanes::on_peer_gone`], each before it delivers anything from a new connection with the
//! same peer. Under that, and any delays (longer than the timeouts too), both
//! ends of every pair agree on the lane whenever no lane message is in flight and neither has
//! a request outstanding, and no process ever holds more than `max_dedicated` dedicated lanes;
//! the property tests check both over random interleavings.
//!
//! # Switching
//!
//! Each change of a pair's lane at this end is reported once by [`Lanes::poll_switch`]. The
//! engine performs it: it fences the old lane (waits until what was sent on it has completed)
//! and then sends on the new one, so the pair's messages stay in order. A peer reported gone
//! is not switched: its lanes are torn down with it.
//!
//! # Memory
//!
//! State is kept per peer only while the peer is dedicated, has a request outstanding, or is
//! wanted by the local tracker (below the floor, or refused, timed out or without local room
//! and waiting for its back-off): at most the tracker's promoted set, since
//! [`Lanes::on_demoted`] forgets them. Scores fed for other peers are ignored and their entries
//! dropped, so memory does not grow with the number of peers ever seen.
//!
//! Time is nanoseconds on any monotonic clock the caller chooses. Scores are the usage
//! tracker's, compared as plain differences (`remove_thresh` is in score units).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

const MILLISECOND: u64 = 1_000_000;

/// How many scores in a row ([`Lanes::on_score`], or [`Lanes::on_promoted`] for a dedicated
/// peer) must be below the cooling line, `min_score - remove_thresh`, before a wanted dedicated
/// peer is cooled (demoted from this end). A busy peer's sampled score dips below the line for
/// a few progress rounds at a time, hardly ever for 16 in a row (10 equally busy peers, each
/// untouched in a round with probability 0.35, the three or four untouched rounds that take a
/// score of 0.65 below 0.3 and then 16 more); a peer gone quiet, from a score of 1, falls
/// below the line at its 6th progress round under UCX's decay (`0.8^6 = 0.26`) and is cooled
/// at its 21st instead: about 0.15 s later with its tracker progressing every 10 ms, 0.3 s
/// with a lanes driver's idle progress every 20 ms.
pub const COOL_AFTER: u32 = 16;

/// Most dedicated lanes a configuration may ask for; far beyond what any NIC keeps cheaply.
pub const MAX_DEDICATED_LIMIT: usize = 1 << 16;

/// A process taking part in lane negotiation; peers are named by theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u64);

/// Which lane a pair of processes uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Lane {
    /// The resource every peer shares.
    #[default]
    Shared,
    /// A resource of this pair's own.
    Dedicated,
}

/// A change of one pair's lane at this end, for the engine to perform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switch {
    /// The peer whose lane changed.
    pub peer: NodeId,
    /// The lane to use from now on.
    pub to: Lane,
}

/// A lane negotiation message: plain data, put on the wire with [`LaneMsg::encode`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LaneMsg {
    /// Asks for a dedicated lane; `score` is the requester's usage score for the pair.
    Promote {
        /// Names the request; its answer carries it back.
        seq: u64,
        /// The requester's score for the pair (finite).
        score: f64,
    },
    /// The receiver is dedicated for this pair now.
    Accept {
        /// The request answered.
        seq: u64,
    },
    /// The receiver has no room and stays shared.
    Deny {
        /// The request answered.
        seq: u64,
    },
    /// The sender is shared for this pair now; never refused.
    Demote,
    /// The requester's current score for a dedicated pair it asked for, sent when it has moved
    /// by `remove_thresh / 2` or more from the last score it told the peer.
    Score {
        /// The requester's score for the pair (finite).
        score: f64,
    },
}

const WIRE_VERSION: u8 = 1;
const TAG_PROMOTE: u8 = 1;
const TAG_ACCEPT: u8 = 2;
const TAG_DENY: u8 = 3;
const TAG_DEMOTE: u8 = 4;
const TAG_SCORE: u8 = 5;

impl LaneMsg {
    /// Bytes of an encoded message: version, tag, `seq` (u64 LE), `score` (f64 LE). Tags:
    /// `Promote` 1, `Accept` 2, `Deny` 3, `Demote` 4, `Score` 5.
    pub const ENCODED_LEN: usize = 18;

    /// The message as a fixed-size frame. Fields a message does not have are zero.
    pub fn encode(&self) -> [u8; LaneMsg::ENCODED_LEN] {
        let (tag, seq, score) = match *self {
            LaneMsg::Promote { seq, score } => (TAG_PROMOTE, seq, score),
            LaneMsg::Accept { seq } => (TAG_ACCEPT, seq, 0.0),
            LaneMsg::Deny { seq } => (TAG_DENY, seq, 0.0),
            LaneMsg::Demote => (TAG_DEMOTE, 0, 0.0),
            LaneMsg::Score { score } => (TAG_SCORE, 0, score),
        };
        let mut out = [0u8; LaneMsg::ENCODED_LEN];
        out[0] = WIRE_VERSION;
        out[1] = tag;
        out[2..10].copy_from_slice(&seq.to_le_bytes());
        out[10..18].copy_from_slice(&score.to_bits().to_le_bytes());
        out
    }

    /// Reads a frame written by [`LaneMsg::encode`]. Fails with [`LanesError::Length`] unless
    /// it is exactly [`LaneMsg::ENCODED_LEN`] bytes, [`LanesError::Version`] for another
    /// version, [`LanesError::Tag`] for an unknown message, and [`LanesError::Field`] for a
    /// score that is not finite or a field the message does not have that is not zero, so
    /// every frame that decodes encodes back to the same bytes.
    pub fn decode(bytes: &[u8]) -> Result<LaneMsg, LanesError> {
        let bytes: &[u8; LaneMsg::ENCODED_LEN] =
            bytes.try_into().map_err(|_| LanesError::Length {
                expected: LaneMsg::ENCODED_LEN,
                got: bytes.len(),
            })?;
        if bytes[0] != WIRE_VERSION {
            return Err(LanesError::Version { got: bytes[0] });
        }
        let seq = u64::from_le_bytes(bytes[2..10].try_into().expect("8 bytes"));
        let score_bits = u64::from_le_bytes(bytes[10..18].try_into().expect("8 bytes"));
        let field = |field: &'static str, message: &str| LanesError::Field {
            field,
            message: message.to_string(),
        };
        let tag = bytes[1];
        if !(TAG_PROMOTE..=TAG_SCORE).contains(&tag) {
            return Err(LanesError::Tag { got: tag });
        }
        let has_score = tag == TAG_PROMOTE || tag == TAG_SCORE;
        if !has_score && score_bits != 0 {
            return Err(field("score", "must be zero in a message without a score"));
        }
        let score = f64::from_bits(score_bits);
        if has_score && !score.is_finite() {
            return Err(field("score", "must be finite"));
        }
        match tag {
            TAG_PROMOTE => Ok(LaneMsg::Promote { seq, score }),
            TAG_ACCEPT => Ok(LaneMsg::Accept { seq }),
            TAG_DENY => Ok(LaneMsg::Deny { seq }),
            TAG_DEMOTE if seq != 0 => Err(field("seq", "must be zero in a demote")),
            TAG_DEMOTE => Ok(LaneMsg::Demote),
            TAG_SCORE if seq != 0 => Err(field("seq", "must be zero in a score")),
            TAG_SCORE => Ok(LaneMsg::Score { score }),
            got => Err(LanesError::Tag { got }),
        }
    }
}

/// A bad configuration or a frame that is not a lane message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LanesError {
    /// A configuration value is out of range.
    Config {
        /// The field (`max_dedicated`, `remove_thresh`, ...).
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A frame of the wrong size.
    Length {
        /// [`LaneMsg::ENCODED_LEN`].
        expected: usize,
        /// The frame's size.
        got: usize,
    },
    /// A frame of another protocol version.
    Version {
        /// The version byte read.
        got: u8,
    },
    /// A frame naming no known message.
    Tag {
        /// The tag byte read.
        got: u8,
    },
    /// A frame with a bad field.
    Field {
        /// The field (`seq`, `score`).
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

impl fmt::Display for LanesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LanesError::Config { field, message } => write!(f, "{field}: {message}"),
            LanesError::Length { expected, got } => {
                write!(f, "lane message of {got} bytes, expected {expected}")
            }
            LanesError::Version { got } => {
                write!(f, "lane message version {got}, expected {WIRE_VERSION}")
            }
            LanesError::Tag { got } => write!(f, "unknown lane message tag {got}"),
            LanesError::Field { field, message } => {
                write!(f, "lane message field {field}: {message}")
            }
        }
    }
}

impl std::error::Error for LanesError {}

/// Limits and timings of lane negotiation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LanesConfig {
    /// Most dedicated lanes this process holds, counting requests it has outstanding (16).
    ///
    /// Each dedicated lane costs a connection of its own and, under the receive module's
    /// defaults, its own receive queue of 64 buffers of 8 KiB: 512 KiB of registered memory,
    /// 8 MiB at 16. NICs keep connection contexts in an on-chip cache and slow down once the
    /// connections in use outgrow it, so the bound stays small: UCX's `UCX_MAX_PRIORITY_EPS`
    /// defaults to 20, the lanes-1000 simulator scenarios use 15 and `bench/lanes` 8; 16 sits in
    /// that range. 0 disables dedicated lanes (every request is denied).
    pub max_dedicated: usize,
    /// How far a score must beat the weakest dedicated peer's to take its lane, and how far a
    /// denied score must rise to ask again before the back-off ends (0.2). The margin is what
    /// keeps peers of about equal scores from taking each other's lanes in turn.
    pub remove_thresh: f64,
    /// The floor: the least local score, in `[0, 1]`, at which a wanted peer is asked for a
    /// dedicated lane (0.5). A usage tracker promotes a key the first time it sees it, with
    /// score `c`, and a sender with a single destination keeps that destination ranked first
    /// however seldom it sends, so a promotion alone says little. Under UCX's decay
    /// (`m = 0.8`, `c = 0.2`) a key touched in `k` progress rounds in a row scores
    /// `1 - 0.8^k`: 0.2, 0.36, 0.49, 0.59, ... so 0.5 is reached after about three rounds in a
    /// row, while a key touched now and then never gets there: touched in every third round
    /// its score peaks at 0.41 at most (`0.2 / (1 - 0.8^3)`); every other round, at 0.56, only
    /// after many rounds of it. Half of the converged score of a key touched every round (1)
    /// is also the middle of the range, leaving `remove_thresh` (0.2) of hysteresis below it
    /// and a margin's worth of room above it for the eviction rule. A dedicated peer that the
    /// tracker wants but whose score stays below `min_score - remove_thresh` for
    /// [`COOL_AFTER`] scores in a row is demoted again (cooling). 0 asks at every promotion, as before this floor existed.
    pub min_score: f64,
    /// How long a denied, timed-out or evicted peer waits before asking again (1 s): several
    /// periods of a usage tracker progressing every 100 to 250 ms, the time its decayed scores
    /// need to move, so an earlier request would most likely be refused again. Each wait is
    /// stretched by up to half of this, different per peer, so peers refused together do not
    /// all come back together.
    pub deny_backoff_ns: u64,
    /// How long a request waits for its answer (100 ms). A live peer answers within one round
    /// trip plus one pass of its progress loop, microseconds to a few milliseconds; only a
    /// stalled or dying peer takes 100 ms, and then giving up frees the reserved slot.
    pub request_timeout_ns: u64,
}

impl Default for LanesConfig {
    fn default() -> Self {
        LanesConfig {
            max_dedicated: 16,
            remove_thresh: 0.2,
            min_score: 0.5,
            deny_backoff_ns: 1_000 * MILLISECOND,
            request_timeout_ns: 100 * MILLISECOND,
        }
    }
}

impl LanesConfig {
    /// Checks every field; the error ([`LanesError::Config`]) names the first bad one.
    pub fn validate(&self) -> Result<(), LanesError> {
        let bad = |field: &'static str, message: String| Err(LanesError::Config { field, message });
        if self.max_dedicated > MAX_DEDICATED_LIMIT {
            return bad(
                "max_dedicated",
                format!(
                    "must be at most {MAX_DEDICATED_LIMIT}, got {}",
                    self.max_dedicated
                ),
            );
        }
        if !self.remove_thresh.is_finite() || self.remove_thresh < 0.0 {
            return bad(
                "remove_thresh",
                format!(
                    "must be finite and not negative, got {}",
                    self.remove_thresh
                ),
            );
        }
        if !(0.0..=1.0).contains(&self.min_score) {
            return bad(
                "min_score",
                format!("must be finite and within [0, 1], got {}", self.min_score),
            );
        }
        if self.deny_backoff_ns == 0 {
            return bad("deny_backoff_ns", "must be at least 1, got 0".to_string());
        }
        if self.request_timeout_ns == 0 {
            return bad(
                "request_timeout_ns",
                "must be at least 1, got 0".to_string(),
            );
        }
        Ok(())
    }
}

/// What [`Lanes::on_promoted`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promotion {
    /// A `Promote` is queued for the peer.
    Requested,
    /// The pair is dedicated already.
    Dedicated,
    /// A request to the peer is outstanding already.
    Pending,
    /// The peer was refused (denied, timed out, or no room here) and its back-off runs; the
    /// machine asks again by itself when the back-off ends, or at once if the score rises by
    /// `remove_thresh` above the refused one or (for lack of local room) a slot frees.
    Waiting,
    /// The score is below [`LanesConfig::min_score`]: the peer is recorded as wanted but not
    /// asked for (no request, no back-off); [`Lanes::on_score`] asks as soon as the score
    /// reaches the floor. Also returned for a dedicated peer that cooled (its score stayed below
    /// `min_score - remove_thresh`) and was demoted here.
    BelowFloor,
    /// The peer is this process itself; nothing to negotiate.
    Ignored,
}

/// Counters for statistics; they only grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct LanesStats {
    /// `Promote`s sent.
    pub requests_sent: u64,
    /// `Accept`s sent.
    pub accepts_sent: u64,
    /// `Accept`s received for the outstanding request.
    pub accepts_received: u64,
    /// `Deny`s sent.
    pub denials_sent: u64,
    /// `Deny`s received for the outstanding request.
    pub denials_received: u64,
    /// `Demote`s sent (local demotions, evictions and undoing stale accepts).
    pub demotes_sent: u64,
    /// `Demote`s received while dedicated.
    pub demotes_received: u64,
    /// Dedicated peers demoted here to make room for a stronger one.
    pub evictions: u64,
    /// Dedicated peers demoted here because the local tracker's score for them fell below
    /// `min_score - remove_thresh` (also counted in `demotions`).
    pub cooled: u64,
    /// `Score`s sent.
    pub scores_sent: u64,
    /// `Score`s received for a pair dedicated here (stale ones are not counted).
    pub scores_received: u64,
    /// Requests dropped unanswered.
    pub timeouts: u64,
    /// Simultaneous requests settled by the node-id tie-break (counted at both ends).
    pub collisions: u64,
    /// Stale `Accept`s answered with `Demote`.
    pub undone: u64,
    /// Lane changes to dedicated.
    pub promotions: u64,
    /// Lane changes to shared (not counting peers gone).
    pub demotions: u64,
    /// Switch events emitted: `promotions + demotions`.
    pub switches: u64,
    /// Dedicated lanes freed because their peer went away.
    pub peers_gone: u64,
}

impl LanesStats {
    /// Adds `other`'s counters to these (totals over several processes).
    pub fn add(&mut self, other: &LanesStats) {
        self.requests_sent += other.requests_sent;
        self.accepts_sent += other.accepts_sent;
        self.accepts_received += other.accepts_received;
        self.denials_sent += other.denials_sent;
        self.denials_received += other.denials_received;
        self.demotes_sent += other.demotes_sent;
        self.demotes_received += other.demotes_received;
        self.evictions += other.evictions;
        self.cooled += other.cooled;
        self.scores_sent += other.scores_sent;
        self.scores_received += other.scores_received;
        self.timeouts += other.timeouts;
        self.collisions += other.collisions;
        self.undone += other.undone;
        self.promotions += other.promotions;
        self.demotions += other.demotions;
        self.switches += other.switches;
        self.peers_gone += other.peers_gone;
    }
}

#[derive(Debug, Clone, Copy)]
struct Request {
    seq: u64,
    score: f64,
    deadline: u64,
}

#[derive(Debug, Clone, Copy)]
struct Backoff {
    /// The score refused; a rise of `remove_thresh` above it ends the wait early.
    score: f64,
    until: u64,
    /// The peer refused (or did not answer); false when only local room was missing.
    remote: bool,
}

/// What this end knows about one peer. An entry exists only while `lane` is dedicated,
/// `request` is outstanding, or the tracker wants the peer (`wanted`).
#[derive(Debug, Clone)]
struct Peer {
    lane: Lane,
    /// The local usage tracker has the peer promoted.
    wanted: bool,
    /// The local tracker's latest score for the peer, if it was fed one.
    local: Option<f64>,
    /// The peer's score for the pair, from its `Promote` or latest `Score`.
    remote: Option<f64>,
    /// This end asked for the dedicated lane it holds (its request was accepted), so it keeps
    /// the peer told of its score.
    asked: bool,
    /// The last score this end told the peer (in its `Promote` or a `Score`).
    told: f64,
    /// Local scores in a row below the cooling line while dedicated and wanted.
    below: u32,
    request: Option<Request>,
    backoff: Option<Backoff>,
}

impl Peer {
    fn new() -> Self {
        Peer {
            lane: Lane::Shared,
            wanted: false,
            local: None,
            remote: None,
            asked: false,
            told: 0.0,
            below: 0,
            request: None,
            backoff: None,
        }
    }

    /// The pair's score wherever scores are compared: the larger of the two ends' views.
    fn score(&self) -> f64 {
        match (self.local, self.remote) {
            (Some(l), Some(r)) => l.max(r),
            (l, r) => l.or(r).unwrap_or(0.0),
        }
    }

    /// The local tracker's score, what this end asks with.
    fn local_score(&self) -> f64 {
        self.local.unwrap_or(0.0)
    }

    fn next_deadline(&self) -> Option<u64> {
        let r = self.request.map(|r| r.deadline);
        let b = self.backoff.map(|b| b.until);
        match (r, b) {
            (Some(r), Some(b)) => Some(r.min(b)),
            (r, b) => r.or(b),
        }
    }
}

/// Scores from outside may be anything; keep them finite so they survive the wire and every
/// comparison means something.
fn finite(score: f64) -> f64 {
    if score.is_nan() {
        0.0
    } else {
        score.clamp(-f64::MAX, f64::MAX)
    }
}

/// SplitMix64: spreads back-offs without a random generator, the same for the same inputs.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// One process's side of lane negotiation with all its peers.
#[derive(Debug, Clone)]
pub struct Lanes {
    node: NodeId,
    config: LanesConfig,
    peers: BTreeMap<NodeId, Peer>,
    /// Peers whose lane is dedicated.
    dedicated: usize,
    /// Requests outstanding: slots promised to peers that may accept.
    reserved: usize,
    /// Request numbers; also salts the back-off spread.
    next_seq: u64,
    transmits: VecDeque<(NodeId, LaneMsg)>,
    switches: VecDeque<Switch>,
    stats: LanesStats,
}

impl Lanes {
    /// A process with every peer on the shared lane. Fails on a bad configuration, naming the
    /// field ([`LanesError::Config`]).
    pub fn new(node: NodeId, config: LanesConfig) -> Result<Self, LanesError> {
        config.validate()?;
        Ok(Lanes {
            node,
            config,
            peers: BTreeMap::new(),
            dedicated: 0,
            reserved: 0,
            next_seq: 1,
            transmits: VecDeque::new(),
            switches: VecDeque::new(),
            stats: LanesStats::default(),
        })
    }

    /// This process's id.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The configuration.
    pub fn config(&self) -> &LanesConfig {
        &self.config
    }

    /// The lane this end uses for `peer` (shared for any peer it keeps no state for).
    pub fn lane(&self, peer: NodeId) -> Lane {
        self.peers.get(&peer).map_or(Lane::Shared, |p| p.lane)
    }

    /// How many peers are on a dedicated lane; never above `max_dedicated`.
    pub fn dedicated(&self) -> usize {
        self.dedicated
    }

    /// How many requests are outstanding.
    pub fn pending_requests(&self) -> usize {
        self.reserved
    }

    /// True when a request to `peer` is outstanding.
    pub fn is_pending(&self, peer: NodeId) -> bool {
        self.peers.get(&peer).is_some_and(|p| p.request.is_some())
    }

    /// How many peers this end keeps state for (dedicated, requested, or waiting to ask again).
    pub fn tracked_peers(&self) -> usize {
        self.peers.len()
    }

    /// The counters.
    pub fn stats(&self) -> &LanesStats {
        &self.stats
    }

    /// The local usage tracker promoted `peer` with `score` (or, called again every progress
    /// period, still ranks it promoted). Records the peer as wanted; below
    /// [`LanesConfig::min_score`] that is all ([`Promotion::BelowFloor`]: [`Lanes::on_score`]
    /// asks once the score reaches the floor). At or above it, asks the peer for a dedicated
    /// lane when it is shared, nothing is outstanding and no back-off holds it, and when this
    /// end has room or `score` beats its weakest dedicated peer's by more than `remove_thresh`
    /// (that peer is demoted first). For a dedicated peer the score is handled as
    /// [`Lanes::on_score`] does (it may be told to the peer, or cool the pair). Returns what it
    /// did; it never fails.
    pub fn on_promoted(&mut self, now: u64, peer: NodeId, score: f64) -> Promotion {
        if peer == self.node {
            return Promotion::Ignored;
        }
        let score = finite(score);
        let thresh = self.config.remove_thresh;
        let p = self.peers.entry(peer).or_insert_with(Peer::new);
        p.wanted = true;
        p.local = Some(score);
        if p.lane == Lane::Dedicated {
            if self.dedicated_score(now, peer, score) {
                self.use_room(now);
                return Promotion::BelowFloor;
            }
            return Promotion::Dedicated;
        }
        if p.request.is_some() {
            return Promotion::Pending;
        }
        if score < self.config.min_score {
            // Not busy enough yet; a back-off that runs keeps running (its end asks only if the
            // score is at the floor by then).
            return Promotion::BelowFloor;
        }
        if let Some(b) = p.backoff {
            if score < b.score + thresh {
                return Promotion::Waiting;
            }
            p.backoff = None;
        }
        self.try_request(now, peer)
    }

    /// The local usage tracker demoted `peer`. A dedicated pair is demoted (`Demote` sent,
    /// switch to shared); an outstanding request is cancelled, and should the peer accept it
    /// anyway, its `Accept` is answered with `Demote`. A waiting peer is forgotten.
    pub fn on_demoted(&mut self, now: u64, peer: NodeId) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        p.wanted = false;
        if p.lane == Lane::Dedicated {
            self.demote(now, peer);
        } else if p.request.take().is_some() {
            self.reserved -= 1;
        }
        self.tidy(now, peer);
        self.use_room(now);
    }

    /// The local tracker's current score for `peer`, fed every progress period. Kept only for
    /// peers this end tracks: it counts in deciding which dedicated peer is weakest. A wanted
    /// shared peer with nothing outstanding asks at once when the score reaches
    /// [`LanesConfig::min_score`] with no back-off running, or when it rose by
    /// `remove_thresh` above the refused one while its back-off runs. For a dedicated peer
    /// that this end asked for, a score that moved by `remove_thresh / 2` or more from the last
    /// one told is sent in a `Score`; a wanted dedicated peer whose score stayed below
    /// `min_score - remove_thresh` for [`COOL_AFTER`] scores in a row is demoted (cooled) and
    /// asks again at the floor.
    pub fn on_score(&mut self, now: u64, peer: NodeId, score: f64) {
        let score = finite(score);
        let thresh = self.config.remove_thresh;
        let floor = self.config.min_score;
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        p.local = Some(score);
        if p.lane == Lane::Dedicated {
            if self.dedicated_score(now, peer, score) {
                self.use_room(now);
            }
            return;
        }
        if !p.wanted || p.request.is_some() || score < floor {
            return;
        }
        match p.backoff {
            None => {
                self.try_request(now, peer);
            }
            Some(b) if score >= b.score + thresh => {
                p.backoff = None;
                self.try_request(now, peer);
            }
            Some(_) => {}
        }
    }

    /// A lane message from `from`. Never fails: a message that no longer fits the state is
    /// stale and handled as the module documentation says.
    pub fn on_message(&mut self, now: u64, from: NodeId, msg: LaneMsg) {
        if from == self.node {
            return;
        }
        match msg {
            LaneMsg::Promote { seq, score } => self.on_promote(now, from, seq, finite(score)),
            LaneMsg::Accept { seq } => self.on_accept(from, seq),
            LaneMsg::Deny { seq } => self.on_deny(now, from, seq),
            LaneMsg::Demote => self.on_demote(now, from),
            LaneMsg::Score { score } => self.on_remote_score(from, finite(score)),
        }
        self.use_room(now);
    }

    /// `peer` is gone (dead, or its connection broke; a broken connection must be reported at
    /// both ends). Its dedicated lane and reservation are freed at once, without a switch
    /// event, and anything still queued for it (messages, switches) is dropped. A peer that
    /// comes back starts shared.
    pub fn on_peer_gone(&mut self, now: u64, peer: NodeId) {
        if let Some(p) = self.peers.remove(&peer) {
            if p.lane == Lane::Dedicated {
                self.dedicated -= 1;
                self.stats.peers_gone += 1;
            }
            if p.request.is_some() {
                self.reserved -= 1;
            }
        }
        self.transmits.retain(|(to, _)| *to != peer);
        self.switches.retain(|s| s.peer != peer);
        self.use_room(now);
    }

    /// When [`Lanes::on_timeout`] has work: the earliest request deadline or back-off end.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.peers.values().filter_map(Peer::next_deadline).min()
    }

    /// Drops requests unanswered past their deadline (the peer backs off as if denied) and
    /// asks again for wanted peers whose back-off is over, if their score is at the floor.
    pub fn on_timeout(&mut self, now: u64) {
        let due: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|(_, p)| p.next_deadline().is_some_and(|t| t <= now))
            .map(|(id, _)| *id)
            .collect();
        for peer in due {
            let Some(p) = self.peers.get_mut(&peer) else {
                continue;
            };
            if let Some(r) = p.request.filter(|r| r.deadline <= now) {
                p.request = None;
                self.reserved -= 1;
                self.stats.timeouts += 1;
                self.back_off(now, peer, r.score, true);
            } else if p.backoff.is_some_and(|b| b.until <= now) {
                p.backoff = None;
                if p.wanted
                    && p.lane == Lane::Shared
                    && p.request.is_none()
                    && p.local_score() >= self.config.min_score
                {
                    self.try_request(now, peer);
                }
                self.tidy(now, peer);
            }
        }
        self.use_room(now);
    }

    /// The next lane message to send, and to whom.
    pub fn poll_transmit(&mut self) -> Option<(NodeId, LaneMsg)> {
        self.transmits.pop_front()
    }

    /// The next lane change to perform, in the order they happened; one per change.
    pub fn poll_switch(&mut self) -> Option<Switch> {
        self.switches.pop_front()
    }

    fn send(&mut self, to: NodeId, msg: LaneMsg) {
        match msg {
            LaneMsg::Promote { .. } => self.stats.requests_sent += 1,
            LaneMsg::Accept { .. } => self.stats.accepts_sent += 1,
            LaneMsg::Deny { .. } => self.stats.denials_sent += 1,
            LaneMsg::Demote => self.stats.demotes_sent += 1,
            LaneMsg::Score { .. } => self.stats.scores_sent += 1,
        }
        self.transmits.push_back((to, msg));
    }

    /// Changes the lane of a tracked peer, keeping the count and reporting the switch. A peer
    /// going shared forgets the pair's remote view and who asked: both belong to the lane.
    fn set_lane(&mut self, peer: NodeId, to: Lane) {
        let p = self
            .peers
            .get_mut(&peer)
            .expect("lane set on a tracked peer");
        if p.lane == to {
            return;
        }
        p.lane = to;
        p.below = 0;
        match to {
            Lane::Dedicated => {
                self.dedicated += 1;
                self.stats.promotions += 1;
            }
            Lane::Shared => {
                p.remote = None;
                p.asked = false;
                self.dedicated -= 1;
                self.stats.demotions += 1;
            }
        }
        self.stats.switches += 1;
        self.switches.push_back(Switch { peer, to });
    }

    /// A free slot: dedicated lanes plus outstanding requests below the bound, so every
    /// outstanding request can be taken up if accepted.
    fn has_room(&self) -> bool {
        self.dedicated + self.reserved < self.config.max_dedicated
    }

    /// Frees a slot for a peer with `score` by demoting the weakest dedicated peer (by the
    /// larger of both ends' views of its score), if that one has fallen below `min_score` and
    /// `score` beats it by more than `remove_thresh`. Returns true when it did.
    fn evict_for(&mut self, now: u64, score: f64) -> bool {
        let weakest = self
            .peers
            .iter()
            .filter(|(_, p)| p.lane == Lane::Dedicated)
            .map(|(id, p)| (*id, p.score()))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        match weakest {
            // A holder at or above the floor is busy enough to keep its lane: scores of busy
            // peers swing with what their senders do besides (a thread that waits for another
            // peer's credits sends nothing for this one meanwhile), and evicting on such a
            // swing would hand lanes back and forth among equally busy peers. Without a floor
            // (`min_score` 0) the margin alone decides.
            Some((victim, weakest))
                if (self.config.min_score <= 0.0 || weakest < self.config.min_score)
                    && score > weakest + self.config.remove_thresh =>
            {
                self.stats.evictions += 1;
                self.demote(now, victim);
                self.tidy(now, victim);
                true
            }
            _ => false,
        }
    }

    /// Demotes a dedicated peer from this end: `Demote`, switch to shared. A peer the tracker
    /// still wants (an eviction) waits out a back-off before asking again.
    fn demote(&mut self, now: u64, peer: NodeId) {
        self.send(peer, LaneMsg::Demote);
        self.set_lane(peer, Lane::Shared);
        let p = &self.peers[&peer];
        if p.wanted {
            let score = p.local_score();
            self.back_off(now, peer, score, true);
        }
    }

    /// The local tracker's `score` for a dedicated `peer`: cools a wanted peer whose score
    /// has been below `min_score - remove_thresh` for [`COOL_AFTER`] scores in a row (it stays
    /// wanted, with no back-off, and asks again at the floor); otherwise, when this end asked
    /// for the lane, tells the peer a score that moved by `remove_thresh / 2` or more since
    /// the last one told. Returns true when it cooled the pair.
    fn dedicated_score(&mut self, now: u64, peer: NodeId, score: f64) -> bool {
        let thresh = self.config.remove_thresh;
        let p = self.peers.get_mut(&peer).expect("score of a tracked peer");
        if p.wanted && score < self.config.min_score - thresh {
            p.below += 1;
        } else {
            p.below = 0;
        }
        if p.below >= COOL_AFTER {
            self.stats.cooled += 1;
            self.send(peer, LaneMsg::Demote);
            self.set_lane(peer, Lane::Shared);
            self.tidy(now, peer);
            return true;
        }
        // Half a margin: the peer's view is never off by enough to let a newcomer that is
        // not busier beat it, and a score that settled sends nothing more.
        if p.asked && score != p.told && (score - p.told).abs() >= thresh / 2.0 {
            p.told = score;
            self.send(peer, LaneMsg::Score { score });
        }
        false
    }

    /// Starts a back-off for a wanted shared peer: it asks again at its end, or earlier when
    /// its score rises by `remove_thresh` above `score`.
    fn back_off(&mut self, now: u64, peer: NodeId, score: f64, remote: bool) {
        let base = self.config.deny_backoff_ns;
        let spread = mix(self.node.0 ^ peer.0.rotate_left(32) ^ self.next_seq) % (base / 2 + 1);
        self.next_seq += 1;
        let p = self
            .peers
            .get_mut(&peer)
            .expect("back-off of a tracked peer");
        p.backoff = Some(Backoff {
            score,
            until: now.saturating_add(base).saturating_add(spread),
            remote,
        });
        self.tidy(now, peer);
    }

    /// Asks a wanted shared peer with nothing outstanding for a dedicated lane, if this end
    /// has room or can make it; otherwise waits. Callers check the floor.
    fn try_request(&mut self, now: u64, peer: NodeId) -> Promotion {
        let score = self.peers[&peer].local_score();
        if !self.has_room() && !self.evict_for(now, score) {
            self.back_off(now, peer, score, false);
            return Promotion::Waiting;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let deadline = now.saturating_add(self.config.request_timeout_ns);
        let p = self
            .peers
            .get_mut(&peer)
            .expect("request to a tracked peer");
        p.backoff = None;
        p.request = Some(Request {
            seq,
            score,
            deadline,
        });
        p.told = score;
        self.reserved += 1;
        self.send(peer, LaneMsg::Promote { seq, score });
        Promotion::Requested
    }

    /// Slots freed here go to peers that were waiting only for local room and are still at
    /// the floor, strongest first.
    fn use_room(&mut self, now: u64) {
        let floor = self.config.min_score;
        while self.has_room() {
            let next = self
                .peers
                .iter()
                .filter(|(_, p)| {
                    p.backoff.is_some_and(|b| !b.remote)
                        && p.request.is_none()
                        && p.local_score() >= floor
                })
                .max_by(|a, b| {
                    a.1.local_score()
                        .total_cmp(&b.1.local_score())
                        .then(b.0.cmp(a.0))
                })
                .map(|(id, _)| *id);
            let Some(peer) = next else {
                return;
            };
            self.peers.get_mut(&peer).expect("just seen").backoff = None;
            self.try_request(now, peer);
        }
    }

    /// Drops the entry of a peer nothing is kept for any more. A wanted shared peer with
    /// neither a request nor a back-off is kept: at the floor it gets a back-off (so it asks
    /// again by itself), below it waits for [`Lanes::on_score`] to bring it there.
    fn tidy(&mut self, now: u64, peer: NodeId) {
        let Some(p) = self.peers.get(&peer) else {
            return;
        };
        if p.lane == Lane::Dedicated || p.request.is_some() {
            return;
        }
        if !p.wanted {
            self.peers.remove(&peer);
        } else if p.backoff.is_none() && p.local_score() >= self.config.min_score {
            let score = p.local_score();
            self.back_off(now, peer, score, true);
        }
    }

    fn on_promote(&mut self, now: u64, from: NodeId, seq: u64, score: f64) {
        // The challenger's score: its own, or this end's tracker's if that is higher.
        let mut challenger = score;
        if let Some(p) = self.peers.get_mut(&from) {
            if let Some(local) = p.local {
                challenger = challenger.max(local);
            }
            if p.lane == Lane::Dedicated {
                // The peer thinks the pair shared while this end does not: a stale view that
                // the peer's own messages have not corrected yet. Dedicated needs no new room.
                // The peer asked now, so its score is the fresh remote view.
                p.remote = Some(score);
                p.asked = false;
                self.send(from, LaneMsg::Accept { seq });
                return;
            }
            if p.request.is_some() {
                self.stats.collisions += 1;
                if self.node > from {
                    // Our request stands; the peer withdraws its own when ours arrives.
                    return;
                }
                // Withdraw ours: its reserved slot is the room that accepts theirs.
                p.request = None;
                self.reserved -= 1;
            }
        }
        if !self.has_room() && !self.evict_for(now, challenger) {
            self.send(from, LaneMsg::Deny { seq });
            self.tidy(now, from);
            return;
        }
        let p = self.peers.entry(from).or_insert_with(Peer::new);
        p.backoff = None;
        self.set_lane(from, Lane::Dedicated);
        let p = self.peers.get_mut(&from).expect("just set");
        p.remote = Some(score);
        p.asked = false;
        self.send(from, LaneMsg::Accept { seq });
    }

    fn on_accept(&mut self, from: NodeId, seq: u64) {
        let p = self.peers.get_mut(&from);
        match p {
            Some(p) if p.request.is_some_and(|r| r.seq == seq) => {
                p.request = None;
                p.backoff = None;
                self.reserved -= 1;
                self.stats.accepts_received += 1;
                self.set_lane(from, Lane::Dedicated);
                // This end asked: it keeps the peer told of its score from now on.
                self.peers.get_mut(&from).expect("just set").asked = true;
            }
            // Stale, and both ends are dedicated: nothing to do.
            Some(p) if p.lane == Lane::Dedicated => {}
            // Stale; the newer request's answer will say where the peer ends.
            Some(p) if p.request.is_some() => {}
            // Stale (timed out or cancelled) while shared here: undo the peer's switch.
            _ => {
                self.stats.undone += 1;
                self.send(from, LaneMsg::Demote);
            }
        }
    }

    fn on_deny(&mut self, now: u64, from: NodeId, seq: u64) {
        let Some(p) = self.peers.get_mut(&from) else {
            return;
        };
        let Some(r) = p.request.filter(|r| r.seq == seq) else {
            // Stale: the peer stayed shared, which any newer exchange will also show.
            return;
        };
        p.request = None;
        self.reserved -= 1;
        self.stats.denials_received += 1;
        self.back_off(now, from, r.score, true);
    }

    fn on_demote(&mut self, now: u64, from: NodeId) {
        let Some(p) = self.peers.get(&from) else {
            return;
        };
        if p.lane != Lane::Dedicated {
            // Shared already (a demote crossing ours, or undoing an accept we never took).
            return;
        }
        self.stats.demotes_received += 1;
        self.set_lane(from, Lane::Shared);
        let p = &self.peers[&from];
        if p.wanted {
            // Evicted (or the peer cooled) while this end still wants it: ask again later.
            let score = p.local_score();
            self.back_off(now, from, score, true);
        } else {
            self.tidy(now, from);
        }
    }

    /// A `Score` from the requester of a dedicated pair: the remote view from now on. Stale
    /// (the pair is not dedicated here) it is ignored; the next request carries a fresh one.
    fn on_remote_score(&mut self, from: NodeId, score: f64) {
        if let Some(p) = self.peers.get_mut(&from) {
            if p.lane == Lane::Dedicated {
                p.remote = Some(score);
                self.stats.scores_received += 1;
            }
        }
    }
}

#[cfg(test)]
#[path = "lanes/tests.rs"]
mod tests;
