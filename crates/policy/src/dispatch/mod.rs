//! The per-peer dispatcher: which slice goes to which rail and connection when.
//!
//! One [`Dispatcher`] per peer holds the peer's queued slices (strict HIGH → MEDIUM → LOW with
//! promotion), what each path (a local rail paired with one of the peer's) has in flight, each
//! path's window controller and round-trip estimate, and the peer's clocks. It follows
//! quinn-proto's shape: events go in (`on_submit`, `on_completed`, `on_failed`, `on_path`,
//! `on_timeout`, ...), decisions come out (`poll_post`, `poll_event`, `poll_failed`,
//! `poll_timeout`), time is always an argument. The engine posts what it says on sockets (or
//! queue pairs); the simulator on modelled NICs; tests in virtual time.
//!
//! What the engine shares between its peers (the rail selector, the QoS slot schedule, rail
//! filtering, which priorities are active host-wide) the dispatcher consults through [`Rails`].
//!
//! Rules it keeps:
//! - Slices are dealt only while a path's window has room (see [`window`]): backlog waits here,
//!   where the selector can still choose, not in socket buffers.
//! - In smart mode a path with room takes a slice only if it finishes it by the finish horizon
//!   (module `finish`), so the tail of a batch waits for a fast rail instead of a slow one; a
//!   slow rail past it takes the piece it finishes in time.
//! - Beside HIGH work, bulk keeps to the lean window and travels in pieces a HIGH slice can pass
//!   soon ([`DispatchConfig::high_wait_ns`]); HIGH takes the path's reserved connection.
//! - Timeouts are the peer's, not each slice's: a peer with work outstanding that answers
//!   nothing on any path for `timeout_ns`, counted from the later of its last answer and the
//!   moment that work began, is silent; everything of it fails with [`Verdict::Timeout`] and
//!   no retry restarts that clock. Within it, a path that answers nothing for
//!   `OVERDUE_FACTOR` × its oldest slice's time at the rail's estimate (at least
//!   `OVERDUE_MIN_NS`) while another path answers, or whose oldest slice waits half the
//!   timeout while another path answers or stands idle, is dropped ([`Event::DropPath`]), its
//!   rail's estimate lowered to what the stall shows, and its slices retried elsewhere, which
//!   tells a stalled rail from a silent peer. Back, a stalled path is on probation while
//!   other paths can take the work: one probe of a page at a time ([`Payload::probe`]; a page
//!   of a request, after an idle probe's wait, where the transport has none), until it
//!   answers one far faster than its lowered estimate (which then returns to what it was) and
//!   at least a second passed (doubled for each stall in a row, up to 64 s); its answers are
//!   learned as the rail's rate even below the estimate.
//! - A slice that comes back from a failed connection goes to the head of its level for
//!   another rail, at most `max_retries` times; a path that keeps failing is paused and probed
//!   back ([`crate::health`]).

mod finish;
mod window;

#[cfg(test)]
mod tests;

use std::collections::VecDeque;

pub use window::{
    BdpController, ControllerKind, FixedController, RttEstimator, Window, WindowController,
    DEFAULT_INITIAL_WINDOW, DEFAULT_LEAN_BDPS, DEFAULT_MAX_QUEUE_NS, DEFAULT_WINDOW_BDPS,
};

use crate::health::{HealthConfig, RailHealth};
use crate::qos::{Priority, PriorityQueues, PromotionConfig, LEVELS};
use crate::selector::{RailId, SliceShape};
use finish::PathLoad;

/// Bulk chunks beside HIGH and tail pieces are cut in whole pages of this many bytes.
const PAGE: u64 = 4096;
/// Bytes of a probe a path on probation is tried with ([`Payload::probe`]): a page.
pub const PROBE_LEN: u64 = PAGE;

/// A HIGH transfer spreads over a path's connections (see [`Connection::Spread`]) only on a rail
/// estimated at least this fast, or whose link is (its theoretical bandwidth), bytes/s
/// (16 Gbit/s): one stream fills a slower link, and on rails policed far below 10 Gbit/s two
/// flows per rail only made the bandwidth estimate read high (one rail 18 % above what it
/// carried) and a batch's slices finish later. A fast link estimated below it is held back by
/// what each slice costs one connection's threads, which a second connection shares: HIGH
/// batches of 1000 scattered 4 KiB slices moved 1.20–1.32 GB/s over one loopback connection and
/// 1.33–1.36 GB/s over two, an estimate that kept the first rule from ever spreading them.
const SPREAD_MIN_BYTES_PER_SEC: f64 = 2e9;

/// A path with slices in flight is overdue once it has answered nothing for this many times
/// what its oldest slice takes alone (its bytes at the rail's bandwidth estimate, plus the
/// path's fixed round trip), and at least [`OVERDUE_MIN_NS`]; it is then given up on if
/// another path answered meanwhile (see [`Dispatcher::on_timeout`]). One slice's time, not
/// the whole window's: a rail that moves answers a slice about every slice time however many
/// it holds, and one that stopped answers none.
const OVERDUE_FACTOR: f64 = 8.0;
/// The least wait that makes a slice overdue, ns: longer than a TCP retransmission timeout
/// (200 ms at least on Linux) and the round trip after it, so one lost segment is not taken
/// for a stall. Never more than half the timeout, the rule that catches a rail with no estimate.
const OVERDUE_MIN_NS: u64 = 500_000_000;

/// The shortest probation of a path given up on as stalled, ns: its first page answers within a
/// second on any rail worth using again.
const PROBATION_BASE_NS: u64 = 1_000_000_000;

/// Most times a probation doubles for stalls in a row: a rail that keeps stalling does so about
/// once a minute at most, and one that came back is dealt whole slices again within a minute.
const PROBATION_MAX_DOUBLINGS: u32 = 6;

/// Bytes a path answers after a stall before its stalls in a row are forgiven: a rail that
/// came back carries a megabyte within milliseconds; one still at a trickle never does between
/// two probations.
const STALL_FORGIVEN_BYTES: u64 = 1 << 20;

/// How many times faster than its estimate a path on probation must answer a probe to count
/// as possibly back: a page through a rail at its lowered estimate takes that long; one back at
/// its old speed answers hundreds of times sooner.
const RECOVERED_FACTOR: f64 = 4.0;

/// Index of a path among the dispatcher's (the order given to [`Dispatcher::new`]).
pub type PathId = usize;

/// Names one posted slice until it is answered or handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SliceId {
    /// The path it was posted on.
    pub path: PathId,
    /// Posting order within the dispatcher.
    pub seq: u64,
}

/// What the dispatcher needs of the work it moves: its length, and how to cut it.
pub trait Payload {
    /// Bytes the slice moves.
    fn len(&self) -> u64;

    /// True for a slice that moves nothing (never made by the slicing rules).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cuts the slice after `at` bytes (0 < `at` < `len`) and returns the rest, a slice of the
    /// same request.
    fn split_off(&mut self, at: u64) -> Self;

    /// Whether [`probe`](Self::probe) makes probes: the slice's transport has them.
    fn has_probes(&self) -> bool {
        false
    }

    /// A probe of `len` bytes in place of this slice: it travels as the slice would (same
    /// level, same memory's rail ranking) but carries nobody's bytes, and nothing waits for
    /// it. A path on probation after a stall is tried with probes, so no request waits on a
    /// rail that may still be collapsed. `None` (the default) when the transport has no
    /// probes: the path is then tried with a page cut off the slice.
    fn probe(&self, _len: u64) -> Option<Self>
    where
        Self: Sized,
    {
        None
    }

    /// True for a probe made by [`probe`](Self::probe): when its connection fails it is
    /// dropped, not retried elsewhere.
    fn is_probe(&self) -> bool {
        false
    }
}

/// The engine-wide view the dispatcher consults: the rail selector shared by every peer, the
/// QoS schedule and filtering, the NUMA tiers of the rails. The engine implements it over its
/// shared state; the simulator over its model.
pub trait Rails<T> {
    /// True in smart (EWMA) mode; false in baseline round-robin mode, where a slice's rail is
    /// chosen without looking at load and the slice waits for room there.
    fn smart(&self) -> bool;
    /// Whether the global time slot in force lets `priority` post.
    fn slot_admits(&self, priority: Priority) -> bool;
    /// Whether priority filtering lets `priority` use `rail` now.
    fn rail_admits(&self, rail: RailId, priority: Priority) -> bool;
    /// Whether work of `priority` is queued or moving anywhere in the engine (rails are a host
    /// resource: HIGH to one peer shares them with bulk to another).
    fn has_work(&self, priority: Priority) -> bool;
    /// Fills `out[rail]` with the tier (0 best, 2 worst) of every rail for the memory `item`
    /// lives in.
    fn tiers(&mut self, item: &T, out: &mut Vec<u8>);
    /// Fills `out[rail]` with the selector's bandwidth estimate of each rail, bytes per second
    /// (0 when unknown).
    fn bandwidths(&mut self, out: &mut [f64]);
    /// The theoretical bandwidth of `rail`'s link (its reported speed, or the selector's
    /// default), bytes per second; 0 when unknown.
    fn link_bandwidth(&mut self, rail: RailId) -> f64;
    /// Chooses a rail per slice among `candidates` (rails per tier); `out[i]` carries slice
    /// `i`. Leaves `out` shorter than the shape's count when it cannot choose.
    fn select(&mut self, candidates: &[Vec<RailId>; 3], shape: SliceShape, out: &mut Vec<RailId>);
    /// A slice of `bytes` on `rail`, posted at `posted_ns`, was answered at `now_ns`;
    /// `app_limited` when the path could not show the rail's speed meanwhile (the slice found
    /// no queue ahead of it on the rail: the rail was idle or held below its link by the
    /// window). Pass it to `DeviceSelector::on_delivered`, which then never lowers the estimate
    /// from that sample (data-path rule 8: dropping the flag would let a held-back rail's
    /// estimate shrink its own window).
    fn delivered(
        &mut self,
        rail: RailId,
        bytes: u64,
        posted_ns: u64,
        now_ns: u64,
        app_limited: bool,
    );
    /// A slice of `bytes` on `rail` failed or was refused by the target.
    fn failed(&mut self, rail: RailId, bytes: u64);
    /// `rail` was given up on as stalled at `now_ns`: a slice of `bytes` posted at
    /// `posted_ns` was still not delivered (its estimate should fall to at most that rate).
    fn stalled(&mut self, rail: RailId, bytes: u64, posted_ns: u64, now_ns: u64);
    /// `rail`, on probation after a stall, answered a probe far faster than its estimate at
    /// `now_ns`: the estimate should return to what it was before the stall.
    fn recovered(&mut self, rail: RailId, now_ns: u64);
    /// A slice of `bytes` charged to `rail` by `select` never went there.
    fn unassigned(&mut self, rail: RailId, bytes: u64);
    /// A slice of `priority` left the queue after `waited_ns` (statistics).
    fn dequeued(&mut self, _priority: Priority, _waited_ns: u64) {}
    /// `n` slices were promoted one level (statistics).
    fn promoted(&mut self, _n: u64) {}
    /// The full window last computed for `rail`, bytes (statistics).
    fn note_window(&mut self, _rail: RailId, _bytes: u64) {}
    /// Slices wait that the global slot in force does not admit: the engine should deal again
    /// when the next slot begins.
    fn slot_holds_work(&mut self) {}
}

/// Which of a path's connections a slice should take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// The path's connection kept for HIGH slices, so they never queue behind bulk bytes in a
    /// byte stream or behind a bulk payload at the target.
    Reserved,
    /// Any of the others, in turn.
    Shared,
    /// A HIGH slice posted on the peer's only usable path, over a fast rail (estimated at
    /// 2 GB/s or more, or on a link that fast), while no bulk (MEDIUM or LOW) work is queued
    /// or moving, and the path already carries a HIGH slice or more are dealt behind it: with
    /// nothing to keep it apart from, it may take any connection. Over tcp it takes turns on
    /// the others, as bulk does, so a large HIGH transfer is carried by more than one byte
    /// stream and serving thread (one stream carried about 3.3 GB/s on loopback, two about
    /// 3.9). Over several paths it already is: spreading there too cost two 20 Gbit/s rails
    /// 14 % of their throughput. A transport whose connections cost it nothing to keep apart
    /// may treat it as `Reserved`.
    Spread,
}

/// A slice to post now.
#[derive(Debug)]
pub struct Post<T> {
    /// Report its outcome under this id.
    pub id: SliceId,
    /// The slice.
    pub item: T,
    /// Path to post it on.
    pub path: PathId,
    /// That path's local rail.
    pub rail: RailId,
    /// Level it was dealt at (after any promotion): it travels and is counted at this level.
    pub priority: Priority,
    /// Which connection of the path.
    pub connection: Connection,
}

/// Why a posted slice came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Its connection was given up on for answering nothing in time.
    Timeout,
    /// Its connection was lost (reset, closed, a send error).
    Lost,
}

/// Why the dispatcher gave up on a slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The peer answered nothing for the timeout (or its deadline passed while the slice
    /// waited for a rail).
    Timeout,
    /// Its connection failed with `Cause` and no retry is allowed: retries are used up, or a
    /// timed-out slice has no other path answering to go to.
    Failed(Cause),
    /// Every path is paused, or the dispatcher was closed.
    RailsDown,
}

/// A slice given up on.
#[derive(Debug)]
pub struct Failed<T> {
    /// The slice.
    pub item: T,
    /// Its level.
    pub priority: Priority,
    /// Why.
    pub verdict: Verdict,
}

/// Something the engine must do on the dispatcher's word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The peer answered nothing for the timeout: close all its connections (no late byte may
    /// land for a request that already failed). Its slices in flight come back through
    /// [`Dispatcher::on_failed`] and fail with the timeout.
    Silent,
    /// Close every connection of `path`: its oldest slice waited too long. `stalled` when other
    /// paths still answer (its slices will be retried there), false when it passed the whole
    /// timeout.
    DropPath {
        /// The path.
        path: PathId,
        /// Whether other paths answer meanwhile.
        stalled: bool,
    },
    /// The pause of `path` is over: try to connect it and report with
    /// [`Dispatcher::on_probe`].
    Probe(PathId),
}

/// Most time's worth of a rail's bandwidth one bulk slice carries while HIGH work is active: a
/// bulk slice already on the wire cannot be passed, so this bounds what a HIGH slice waits
/// behind on a slow rail. Fast rails carry whole slices (their bound exceeds any slice).
pub const DEFAULT_HIGH_WAIT_NS: u64 = 250_000;
/// Bulk slices are not cut below this while HIGH work is active: smaller ones cost more per
/// byte than the wait they save.
pub const DEFAULT_MIN_BULK_CHUNK: u64 = 16 << 10;
/// Slices dealt to the selector in one call at most (one decision for a run of equal slices
/// is cheaper than one each, and the selector spreads a run over rails by predicted finish).
pub const MAX_RUN: usize = 64;

/// Settings of a dispatcher.
#[derive(Debug, Clone)]
pub struct DispatchConfig {
    /// Silence that fails a peer's work, ns (`transports.tcp.timeout_ms`).
    pub timeout_ns: u64,
    /// Times a slice is retried after its connection failed (`transports.tcp.max_retries`).
    pub max_retries: u32,
    /// Window sizing.
    pub controller: ControllerKind,
    /// See [`DEFAULT_HIGH_WAIT_NS`].
    pub high_wait_ns: u64,
    /// See [`DEFAULT_MIN_BULK_CHUNK`].
    pub min_bulk_chunk: u64,
    /// Promotion of starved levels.
    pub promotion: PromotionConfig,
    /// When a path is paused and probed back.
    pub health: HealthConfig,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        DispatchConfig {
            timeout_ns: 30_000_000_000,
            max_retries: 8,
            controller: ControllerKind::default(),
            high_wait_ns: DEFAULT_HIGH_WAIT_NS,
            min_bulk_chunk: DEFAULT_MIN_BULK_CHUNK,
            promotion: PromotionConfig::default(),
            health: HealthConfig::default(),
        }
    }
}

/// A slice waiting for a rail.
struct Queued<T> {
    item: T,
    /// Baseline mode charges a slice to a rail before it has room there; it then waits at
    /// the head for that rail.
    rail: Option<RailId>,
    /// Times it came back from a failed connection.
    attempts: u32,
    /// When it was first queued (wait statistics survive a retry or a refusal).
    since_ns: u64,
}

impl<T: Payload> Queued<T> {
    /// Cuts the slice after `at` bytes and returns the rest, queued as this one was (same
    /// retries, same wait clock) and not charged to any rail.
    fn rest_after(&mut self, at: u64) -> Queued<T> {
        Queued {
            item: self.item.split_off(at),
            rail: None,
            attempts: self.attempts,
            since_ns: self.since_ns,
        }
    }
}

/// A slice posted and not yet answered.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    seq: u64,
    len: u64,
    /// Bytes the path held in flight when this slice was posted, ahead of it.
    ahead: u64,
    posted_ns: u64,
    /// The rail's bandwidth estimate when this slice was posted, bytes/s (0 when unknown):
    /// what the slice was dealt on, and so how soon it is overdue (see `overdue_after`).
    posted_bps: f64,
    since_ns: u64,
    priority: Priority,
    attempts: u32,
    /// Answered or handed back; dropped once it reaches the front.
    done: bool,
}

/// One (local rail, remote rail) pair.
struct Path {
    rail: RailId,
    /// Connections alive, as the engine last reported.
    live: usize,
    health: RailHealth,
    /// Health is up and a connection is alive.
    usable: bool,
    /// Bytes posted and not yet answered.
    posted: u64,
    /// When the path last held work: given a slice, or answered or handed back its last one
    /// (0 = never). Its idle time counts from here, not from the last post: a slice that takes
    /// longer than [`finish::PROBE_AFTER_NS`] (a 64 KiB slice on a 10 Mbit/s rail takes 52 ms)
    /// would otherwise leave the path "idle long" the moment it is answered.
    last_busy_ns: u64,
    /// When the path last answered a slice (0 = never): an answer after another path's oldest
    /// slice went out shows the peer alive while that path is stuck.
    last_answer_ns: u64,
    /// Until when the path is probed whatever the finish horizon says (see
    /// [`finish::PathLoad::probe`]).
    probe_until_ns: u64,
    /// Posting order: answers may come back out of order across connections, so finished
    /// entries stay until they reach the front; the front is the oldest slice in flight.
    inflight: VecDeque<InFlight>,
    rtt: RttEstimator,
    controller: Box<dyn WindowController>,
    /// A drop was asked for and the path's slices have not all come back yet.
    dropping: bool,
    /// The dispatcher gave the path up itself (a stall): the connections that drop closes are
    /// not further errors of the rail. Counted once, at the drop; cleared once the path goes
    /// from no live connection to some (remade).
    dropped_by_us: bool,
    /// Given up on as stalled, and since then not answered a slice far faster than its
    /// estimate (see `RECOVERED_FACTOR`; the estimate returns to before the stall) and then,
    /// past `probation_until_ns`, one not far slower: in smart mode, while another path can take the work, it holds one
    /// page at a time, dealt only when it was idle as long as a probe waits for. A rail that
    /// fell to a trickle beside rails that are slow themselves still looked worth a whole
    /// slice after its stall, and each slice dealt to it stalled its batch again.
    probation: bool,
    /// The earliest a probation ends: [`PROBATION_BASE_NS`] after the stall, doubled for each
    /// stall before it that the path did not make up for (see `stalls`).
    probation_until_ns: u64,
    /// Stalls in a row: counted at each drop as stalled, cleared once the path has answered
    /// [`STALL_FORGIVEN_BYTES`] since the last. A page through a policer's burst answers at
    /// once whatever the rate behind it, so a rail that collapsed ends each probation looking
    /// fast and stalls again: the probations lengthen, and such a rail stalls a batch about
    /// once a minute instead of every few seconds.
    stalls: u32,
    /// Bytes answered since the last stall.
    answered_since_stall: u64,
    /// On probation, its latest answer that was not at its estimate's pace was far faster
    /// (the estimate was restored then), not far slower.
    answered_fast: bool,
    /// When to look again at a path whose oldest slice waited past half the timeout while no
    /// other path could take its slices: its half-timeout deadline has passed and means
    /// nothing until another path answers, so it must not be reported again at once (the
    /// caller's timer would fire in a loop until the whole timeout).
    stall_recheck_ns: u64,
}

impl Path {
    /// Nothing in flight, and idle for `probe_after_ns` (see [`Dispatcher::probe_after`]): a
    /// slice given now starts a probe.
    fn idle_long(&self, now: u64, probe_after_ns: u64) -> bool {
        self.posted == 0 && now.saturating_sub(self.last_busy_ns) >= probe_after_ns
    }

    /// A slice of `len` bytes answered after `rtt` ns on this path on probation, its rail
    /// estimated at `bw` bytes/s, at `now`: judged against what it should take at the estimate,
    /// the round trip included (a page on a fast rail is all round trip). Ends the probation
    /// past its time once it answered fast and this answer was not slow; returns whether it
    /// was fast (the rail may be back).
    fn probation_answer(&mut self, len: u64, rtt: u64, bw: f64, now: u64) -> bool {
        let (fast, slow) = if bw > 0.0 {
            let fixed = self.rtt.min_fixed_ns().unwrap_or(0) as f64;
            let expected = len as f64 / bw * 1e9 + fixed;
            let took = rtt as f64;
            (
                took * RECOVERED_FACTOR <= expected,
                took >= expected * RECOVERED_FACTOR,
            )
        } else {
            (true, false)
        };
        if fast {
            self.answered_fast = true;
        } else if slow {
            self.answered_fast = false;
        }
        if self.answered_fast && !slow && now >= self.probation_until_ns {
            self.probation = false;
        }
        fast
    }

    fn refresh_usable(&mut self) {
        self.usable = self.live > 0 && self.health.is_up();
    }

    fn oldest_posted_ns(&self) -> Option<u64> {
        self.oldest().map(|f| f.posted_ns)
    }

    /// The oldest slice in flight.
    fn oldest(&self) -> Option<&InFlight> {
        self.inflight.iter().find(|f| !f.done)
    }

    /// Since when the path, holding slices, has answered none: the later of its last answer
    /// and the posting of its oldest slice. `None` with nothing in flight.
    fn silent_since_ns(&self) -> Option<u64> {
        self.oldest_posted_ns().map(|o| o.max(self.last_answer_ns))
    }

    /// Takes the record of `seq`, if it is in flight here, at `now`.
    fn finish(&mut self, seq: u64, now: u64) -> Option<InFlight> {
        let i = self.inflight.binary_search_by_key(&seq, |f| f.seq).ok()?;
        let f = &mut self.inflight[i];
        if f.done {
            return None;
        }
        f.done = true;
        let rec = *f;
        self.posted = self.posted.saturating_sub(rec.len);
        self.last_busy_ns = self.last_busy_ns.max(now);
        while self.inflight.front().is_some_and(|f| f.done) {
            self.inflight.pop_front();
        }
        Some(rec)
    }
}

/// The per-peer dispatcher. See the module doc.
pub struct Dispatcher<T> {
    config: DispatchConfig,
    queue: PriorityQueues<Queued<T>>,
    paths: Vec<Path>,
    /// Rail → its path.
    rail_path: Vec<Option<PathId>>,
    /// Bandwidth estimate per rail, bytes/s, refreshed at every deal.
    bandwidth: Vec<f64>,
    next_seq: u64,
    /// Dealt and charged, not yet taken by `poll_post`.
    ready: VecDeque<Post<T>>,
    failed: VecDeque<Failed<T>>,
    events: VecDeque<Event>,
    /// Since when the peer has had work outstanding without a break; `None` while it has none.
    outstanding_since: Option<u64>,
    /// Last answer on any path; 0 = none yet.
    last_heard_ns: u64,
    silent: bool,
    closed: bool,
    /// Queue depths at the last `take_depth_change`.
    reported: [usize; LEVELS],
    /// At the start of the current deal, HIGH slices may spread over a path's connections:
    /// no bulk (MEDIUM or LOW) work was queued or moving anywhere in the engine, and one path
    /// alone was usable, on a fast rail (see [`Connection::Spread`]).
    may_spread: bool,
    /// Scratch space reused by every deal, so dealing allocates nothing once warm.
    scratch: Scratch,
}

/// Buffers every deal reuses.
#[derive(Default)]
struct Scratch {
    candidates: [Vec<RailId>; 3],
    selected: Vec<RailId>,
    tiers: Vec<u8>,
    /// Per path: what the priority being dealt may hold there.
    allowed: Vec<u64>,
    /// Usable paths that admit the priority being dealt, with what they hold.
    loads: Vec<(PathId, PathLoad)>,
}

impl<T: Payload> Dispatcher<T> {
    /// A dispatcher for a peer reached over one path per entry of `path_rails` (the local rail
    /// of each). Every path starts healthy with no connection: report them with
    /// [`on_path`](Self::on_path). A rail should appear once; later paths on the same rail are
    /// reachable by id only.
    pub fn new(config: DispatchConfig, path_rails: &[RailId]) -> Self {
        let nrails = path_rails.iter().map(|r| r + 1).max().unwrap_or(0);
        let mut rail_path = vec![None; nrails];
        for (p, &r) in path_rails.iter().enumerate() {
            if rail_path[r].is_none() {
                rail_path[r] = Some(p);
            }
        }
        let paths = path_rails
            .iter()
            .map(|&rail| Path {
                rail,
                live: 0,
                health: RailHealth::new(config.health),
                usable: false,
                posted: 0,
                last_busy_ns: 0,
                last_answer_ns: 0,
                probe_until_ns: 0,
                inflight: VecDeque::new(),
                rtt: RttEstimator::new(),
                controller: config.controller.build(),
                dropping: false,
                dropped_by_us: false,
                probation: false,
                probation_until_ns: 0,
                stalls: 0,
                answered_since_stall: 0,
                answered_fast: false,
                stall_recheck_ns: 0,
            })
            .collect();
        Dispatcher {
            queue: PriorityQueues::new(config.promotion),
            paths,
            rail_path,
            bandwidth: vec![0.0; nrails],
            next_seq: 0,
            ready: VecDeque::new(),
            failed: VecDeque::new(),
            events: VecDeque::new(),
            outstanding_since: None,
            last_heard_ns: 0,
            silent: false,
            closed: false,
            reported: [0; LEVELS],
            may_spread: false,
            scratch: Scratch::default(),
            config,
        }
    }

    /// The settings.
    pub fn config(&self) -> &DispatchConfig {
        &self.config
    }

    /// Number of paths.
    pub fn paths(&self) -> usize {
        self.paths.len()
    }

    /// The local rail of `path`.
    pub fn rail_of(&self, path: PathId) -> RailId {
        self.paths[path].rail
    }

    /// The path on local rail `rail`, if any.
    pub fn path_of(&self, rail: RailId) -> Option<PathId> {
        self.rail_path.get(rail).copied().flatten()
    }

    /// True when `path` may carry slices (healthy, with a live connection).
    pub fn is_usable(&self, path: PathId) -> bool {
        self.paths[path].usable
    }

    /// The largest bandwidth estimate, bytes per second, among the rails of the usable paths
    /// (as of the last deal; 0 before any, or with no usable path).
    pub fn fastest_usable_bandwidth(&self) -> f64 {
        self.paths
            .iter()
            .filter(|p| p.usable)
            .filter_map(|p| self.bandwidth.get(p.rail).copied())
            .fold(0.0, f64::max)
    }

    /// The sum of the bandwidth estimates, bytes per second, of the distinct rails of the
    /// usable paths (as of the last deal; 0 before any, or with no usable path): what a
    /// transfer spread over all of them may move.
    pub fn usable_bandwidth(&self) -> f64 {
        let usable = || self.paths.iter().filter(|p| p.usable);
        usable()
            .enumerate()
            // A rail counted once, at its first usable path.
            .filter(|&(i, p)| usable().position(|q| q.rail == p.rail) == Some(i))
            .filter_map(|(_, p)| self.bandwidth.get(p.rail).copied())
            .sum()
    }

    /// True when `path`'s health lets it carry slices (whatever its connections).
    pub fn is_up(&self, path: PathId) -> bool {
        self.paths[path].health.is_up()
    }

    /// Where `path`'s health stands: up, paused after errors, or probing.
    pub fn health_state(&self, path: PathId) -> crate::health::RailState {
        self.paths[path].health.state()
    }

    /// Bytes `path` has in flight.
    pub fn in_flight(&self, path: PathId) -> u64 {
        self.paths[path].posted
    }

    /// The round-trip estimate of `path`.
    pub fn rtt(&self, path: PathId) -> &RttEstimator {
        &self.paths[path].rtt
    }

    /// Slices waiting at each level.
    pub fn depths(&self) -> [usize; LEVELS] {
        self.queue.depths()
    }

    /// The depths now and at the previous call, when they changed since: for engine-wide
    /// counters that sum every peer's queues without a lock.
    pub fn take_depth_change(&mut self) -> Option<([usize; LEVELS], [usize; LEVELS])> {
        let now = self.queue.depths();
        (now != self.reported).then(|| (std::mem::replace(&mut self.reported, now), now))
    }

    /// True when slices are queued or in flight.
    pub fn has_outstanding(&self) -> bool {
        !self.queue.is_empty() || self.paths.iter().any(|p| p.posted > 0)
    }

    /// True once the peer was found silent: everything of it fails, and new work should go to
    /// a fresh dispatcher (with fresh connections and its own full timeout).
    pub fn is_silent(&self) -> bool {
        self.silent
    }

    /// True after [`close`](Self::close).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// True when no path can carry slices and none is coming back soon: closed, silent, or
    /// every path paused.
    pub fn is_dead(&self) -> bool {
        self.closed || self.silent || self.paths.iter().all(|p| !p.health.is_up())
    }

    /// Queues the slices of one request at `priority`, behind their level.
    pub fn on_submit(&mut self, now: u64, priority: Priority, items: impl IntoIterator<Item = T>) {
        // Work outstanding from now on, unless some already is: then the peer's silence is
        // still counted from the older work (or its last answer).
        if self.outstanding_since.is_none() || !self.has_outstanding() {
            self.outstanding_since = Some(now);
        }
        for item in items {
            let q = Queued {
                item,
                rail: None,
                attempts: 0,
                since_ns: now,
            };
            if self.closed || self.silent {
                self.failed.push_back(Failed {
                    item: q.item,
                    priority,
                    verdict: if self.silent {
                        Verdict::Timeout
                    } else {
                        Verdict::RailsDown
                    },
                });
                continue;
            }
            self.queue.push_back(q, priority, now);
        }
    }

    /// The next slice to post, dealing queued slices to paths while windows, slots and
    /// filtering allow. The slice is charged to its path from here on: report its outcome
    /// with `on_completed`, `on_rejected`, `on_failed` or (never posted) `on_refused`.
    pub fn poll_post(&mut self, now: u64, rails: &mut impl Rails<T>) -> Option<Post<T>> {
        if self.ready.is_empty() {
            self.deal(now, rails);
        }
        self.ready.pop_front()
    }

    /// A slice from `poll_post` could not be posted (its connection was found dead): it goes
    /// back to the head of its level, for any rail.
    pub fn on_refused(&mut self, now: u64, post: Post<T>, rails: &mut impl Rails<T>) {
        let Some(rec) = self.paths[post.id.path].finish(post.id.seq, now) else {
            return;
        };
        rails.unassigned(post.rail, rec.len);
        self.requeue_front(
            Queued {
                item: post.item,
                rail: None,
                attempts: rec.attempts,
                since_ns: rec.since_ns,
            },
            post.priority,
            now,
        );
    }

    /// Slice `id` is in place at the target. `sent` is when it went on the wire, if the
    /// transport knows (a sender thread may write it a little after `poll_post` gave it out);
    /// the round trip and the selector's bandwidth sample count from there. Returns whether
    /// the caller should `poll_post` now: HIGH work waits, or half of what the waiting level
    /// may hold on the path has drained (so the sender gets several slices per wake-up
    /// instead of one).
    pub fn on_completed(
        &mut self,
        now: u64,
        id: SliceId,
        sent: Option<u64>,
        rails: &mut impl Rails<T>,
    ) -> bool {
        self.answered(now, id, sent, true, rails)
    }

    /// The target refused slice `id` (no retry can fix that; the caller fails it). Returns
    /// whether to `poll_post` now, as `on_completed`.
    pub fn on_rejected(&mut self, now: u64, id: SliceId, rails: &mut impl Rails<T>) -> bool {
        self.answered(now, id, None, false, rails)
    }

    fn answered(
        &mut self,
        now: u64,
        id: SliceId,
        sent: Option<u64>,
        ok: bool,
        rails: &mut impl Rails<T>,
    ) -> bool {
        let Some(path) = self.paths.get_mut(id.path) else {
            return false;
        };
        let Some(rec) = path.finish(id.seq, now) else {
            return false;
        };
        let rail = path.rail;
        path.last_answer_ns = now.max(1);
        if ok {
            let sent = sent.unwrap_or(rec.posted_ns);
            let rtt = now.saturating_sub(sent);
            let bw = self.bandwidth.get(rail).copied().unwrap_or(0.0);
            // The rail showed its speed only if this slice waited behind other bytes on it:
            // the rail was busy all the while. Otherwise (idle, or held below its link by the
            // window) the sample may raise the estimate but not lower it (DESIGN data-path
            // rule 8, BBR's app-limited samples). Whether more waits in the dispatcher's
            // queue does not matter: a batch dealt whole at once still keeps the rail busy
            // until its last slice, and those samples are the rail's speed.
            // An answer of a path on probation is what the stalled rail carries now, learned
            // even below the estimate: held to the estimate, the rail was dealt whole slices
            // again and stalled again.
            // On a long path a batch smaller than the rail's bandwidth-delay product also
            // queues behind itself at the sender, but the rail then idles for most of the round
            // trip: if the slice came back as soon as the estimate says it should have, it
            // shows the path's length, not the rail's rate (a 10 ms path read a 10 Gbit/s rail
            // at 0.4 Gbit/s from one writer's 1 MiB batches).
            let flight = rec.ahead.saturating_add(rec.len);
            let app_limited = !path.probation && !path.rtt.rail_limited(rtt, rec.len, flight, bw);
            // A probation answer far faster than the estimate: the rail may be back (or a
            // policer's burst let the page through; then it stalls again, and the next
            // probation is longer). A slow one keeps the path on probation, whose pages are
            // the only way its estimate, lowered by the stall, can come back up.
            let recovered = path.probation && path.probation_answer(rec.len, rtt, bw, now);
            if path.stalls > 0 {
                path.answered_since_stall = path.answered_since_stall.saturating_add(rec.len);
                if path.answered_since_stall >= STALL_FORGIVEN_BYTES {
                    path.stalls = 0;
                }
            }
            rails.delivered(rail, rec.len, sent, now, app_limited);
            if recovered {
                rails.recovered(rail, now);
            }
            path.rtt.on_sample(rtt, rec.len, bw);
            path.controller.on_completed(now, rec.len, rtt);
        } else {
            rails.failed(rail, rec.len);
        }
        self.last_heard_ns = now.max(1);
        if !self.has_outstanding() {
            self.outstanding_since = None;
        }
        self.wants_refill(id.path, rec.len, rails)
    }

    /// Whether `path`, having just drained a slice of `bytes`, should be refilled now: when
    /// HIGH work waits beside bulk, when it holds less than a pipe (see [`Window::pipe`]), or
    /// when half of what the waiting level may hold there (at most half a full window) has
    /// drained, so the sender gets several slices per wake-up instead of one.
    ///
    /// HIGH alone is refilled in batches too: dealt one slice per answer, a batch of 1000
    /// scattered 4 KiB HIGH reads paid a deal (rail tiers, estimates, selection) and a sending
    /// thread's turn for every slice, and moved 1.15–1.19 GB/s over loopback where the same
    /// batch at LOW, refilled in batches, moved 1.39–1.65.
    fn wants_refill(&self, p: PathId, bytes: u64, rails: &impl Rails<T>) -> bool {
        let depths = self.queue.depths();
        match depths.iter().position(|&n| n > 0) {
            None => false,
            Some(level) => {
                let prio = Priority::ALL[level];
                let bulk_active = rails.has_work(Priority::Medium) || rails.has_work(Priority::Low);
                if prio == Priority::High && bulk_active {
                    return true;
                }
                let window = self.window(p, bytes);
                let high_active = rails.has_work(Priority::High);
                let allowed = allowance(prio, window, high_active, bulk_active);
                let posted = self.paths[p].posted;
                // Below a pipe the rail idles until the next deal: waiting for half of a lean
                // allowance of one pipe to drain would keep bulk beside HIGH at three quarters
                // of it on average, and the rail below its rate.
                posted < window.pipe.min(allowed)
                    || posted + (window.full / 2).min(allowed / 2) <= allowed
            }
        }
    }

    /// Slice `id` came back from a failed connection (`cause`). It goes to the head of its
    /// level for another rail, unless the peer is closed or silent, its retries are used up,
    /// or it timed out with no other path answering (then it appears in `poll_failed`).
    pub fn on_failed(
        &mut self,
        now: u64,
        id: SliceId,
        item: T,
        cause: Cause,
        rails: &mut impl Rails<T>,
    ) {
        let Some(path) = self.paths.get_mut(id.path) else {
            return;
        };
        let Some(rec) = path.finish(id.seq, now) else {
            return;
        };
        let rail = path.rail;
        path.controller.on_lost(now);
        if path.inflight.is_empty() {
            path.dropping = false;
        }
        rails.failed(rail, rec.len);
        if item.is_probe() {
            // It measured the rail, and the rail failed it: nothing to retry.
            if !self.has_outstanding() {
                self.outstanding_since = None;
            }
            return;
        }
        let attempts = rec.attempts + 1;
        let timed_out = cause == Cause::Timeout;
        let verdict = if self.silent {
            Some(Verdict::Timeout)
        } else if self.closed {
            Some(Verdict::Failed(cause))
        } else if (timed_out && !self.progress_elsewhere(id.path, now))
            || attempts > self.config.max_retries
        {
            // A peer that answers on no other path is gone or stuck: retrying would only
            // stretch the wait past the timeout.
            Some(Verdict::Failed(cause))
        } else {
            None
        };
        match verdict {
            Some(verdict) => self.failed.push_back(Failed {
                item,
                priority: rec.priority,
                verdict,
            }),
            None => self.requeue_front(
                Queued {
                    item,
                    rail: None,
                    attempts,
                    since_ns: now,
                },
                rec.priority,
                now,
            ),
        }
        if !self.has_outstanding() {
            self.outstanding_since = None;
        }
    }

    /// `path` now has `live` connections alive (0: it cannot carry slices until reconnected).
    pub fn on_path(&mut self, _now: u64, path: PathId, live: usize) {
        let p = &mut self.paths[path];
        // Remade after a drop: from no live connection to some. (Right after a drop the
        // connections it closes may still count as live for a moment.)
        if live > 0 && p.live == 0 {
            p.dropped_by_us = false;
        }
        p.live = live;
        p.refresh_usable();
    }

    /// A connection of `path` was lost, or connecting it failed: counts toward pausing it.
    /// Returns true when this error paused the path. The connections a stall's drop closes
    /// (see [`Event::DropPath`]) do not count: the stall was counted once, when it was found,
    /// and a rail that merely slowed down (a policer cut to a quarter of its rate, TCP backing
    /// off meanwhile) must not be paused for `initial_pause` because it had four connections.
    pub fn on_path_error(&mut self, now: u64, path: PathId) -> bool {
        let p = &mut self.paths[path];
        if p.dropped_by_us {
            return false;
        }
        let paused = p.health.on_error(now);
        p.refresh_usable();
        paused
    }

    /// The link of `path` came back up after it was seen down: a pause ends now, so the next
    /// [`Dispatcher::on_timeout`] asks for its probe ([`RailHealth::on_link_up`]). Returns
    /// true when a pause ended early (the caller arms its timer for now).
    pub fn on_link_up(&mut self, now: u64, path: PathId) -> bool {
        self.paths[path].health.on_link_up(now)
    }

    /// The probe of `path` asked for by [`Event::Probe`] succeeded (`ok`) or failed.
    pub fn on_probe(&mut self, now: u64, path: PathId, ok: bool) {
        let p = &mut self.paths[path];
        p.health.on_probe(now, ok);
        p.refresh_usable();
    }

    /// Closes the dispatcher: queued slices fail with [`Verdict::RailsDown`]; slices in flight
    /// fail as they come back.
    pub fn close(&mut self, now: u64, rails: &mut impl Rails<T>) {
        self.closed = true;
        for p in &mut self.paths {
            p.live = 0;
            p.refresh_usable();
        }
        self.expire_queue(now, rails);
    }

    /// Runs what is due at `now`: promotion, the peer's silence, stalled paths, probes, and
    /// queued slices whose deadline passed with no rail to take them. Follow with
    /// `poll_event`, `poll_failed` and `poll_post`.
    pub fn on_timeout(&mut self, now: u64, rails: &mut impl Rails<T>) {
        if self.closed || self.silent {
            return;
        }
        let promoted = self.queue.on_timeout(now);
        if promoted > 0 {
            rails.promoted(promoted);
        }
        if !self.has_outstanding() {
            self.outstanding_since = None;
        }
        if self
            .silent_since()
            .is_some_and(|since| now.saturating_sub(since) > self.config.timeout_ns)
        {
            self.silent = true;
            self.events.push_back(Event::Silent);
            self.expire_queue(now, rails);
            return;
        }
        // A path that stalls while others answer is given up on when its slices may retry on
        // another: answered there, they prove the peer alive before its deadline. Stalled
        // means overdue (it answered nothing for many times what its oldest slice takes at the
        // rail's estimate, see `overdue_after`) while another path answered meanwhile: a rail
        // fallen to a trickle under a batch then costs the batch half a second, not half the
        // timeout. Failing that, its oldest slice waited half the timeout while the others
        // answer or stand idle.
        // Waiting the whole timeout would make a stalled rail look like a silent peer whenever
        // the other paths went idle meanwhile (a batch waiting for the stalled path's last
        // slices), and the peer's deadline would fail everything.
        let suspect = self.config.timeout_ns / 2;
        let retries = self.config.max_retries > 0;
        for p in 0..self.paths.len() {
            let path = &self.paths[p];
            if path.dropping {
                continue;
            }
            let Some(oldest) = path.oldest_posted_ns() else {
                continue;
            };
            let waited = now.saturating_sub(oldest);
            let quiet_since = path.silent_since_ns().unwrap_or(oldest);
            let quiet = now.saturating_sub(quiet_since);
            let overdue = self.overdue_after(p);
            let stalled = retries
                && ((quiet > overdue && self.answered_elsewhere_since(p, quiet_since))
                    || (waited > suspect && self.progress_elsewhere(p, now)));
            if stalled || waited > self.config.timeout_ns {
                if stalled {
                    let path = &self.paths[p];
                    let bytes = path.oldest().map_or(0, |f| f.len);
                    rails.stalled(path.rail, bytes, oldest, now);
                }
                let path = &mut self.paths[p];
                path.dropping = true;
                path.dropped_by_us = true;
                if stalled {
                    path.probation = true;
                    let backoff = PROBATION_BASE_NS << path.stalls.min(PROBATION_MAX_DOUBLINGS);
                    path.probation_until_ns = now.saturating_add(backoff);
                    path.stalls = path.stalls.saturating_add(1);
                    path.answered_since_stall = 0;
                    path.answered_fast = false;
                }
                path.health.on_error(now);
                path.refresh_usable();
                self.events.push_back(Event::DropPath { path: p, stalled });
            } else if quiet > overdue {
                // Another path may answer yet: look again a little later (at most a sixteenth
                // of the timeout on, so a timer never fires in a loop until the deadline).
                let again = (self.config.timeout_ns / 16).min(overdue).max(1);
                self.paths[p].stall_recheck_ns = now.saturating_add(again);
            }
        }
        for (p, path) in self.paths.iter_mut().enumerate() {
            if path.health.poll_probe(now) {
                self.events.push_back(Event::Probe(p));
            }
        }
        self.expire_queue(now, rails);
    }

    /// When `on_timeout` next has something to do, if ever. Earlier calls are harmless (nothing
    /// is due yet); answers only move the deadlines later, so callers need not ask again
    /// after each answer.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.closed || self.silent {
            return None;
        }
        let timeout = self.config.timeout_ns;
        // While slices are in flight their answers deal again, and every deal runs the
        // promotion check: a timer for it then would only wake the caller every check interval.
        let idle = self.paths.iter().all(|p| p.posted == 0);
        let mut next = self.queue.poll_timeout().filter(|_| idle);
        let mut earliest = |t: Option<u64>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n: u64| n.min(t)));
            }
        };
        earliest(self.silent_since().map(|s| s.saturating_add(timeout) + 1));
        for (i, p) in self.paths.iter().enumerate() {
            if !p.dropping {
                let overdue = self.overdue_after(i);
                earliest(p.oldest_posted_ns().map(|o| {
                    let quiet_since = p.silent_since_ns().unwrap_or(o);
                    (quiet_since.saturating_add(overdue) + 1)
                        .min(o.saturating_add(timeout / 2) + 1)
                        .max(p.stall_recheck_ns)
                        .min(o.saturating_add(timeout) + 1)
                }));
            }
            earliest(p.health.poll_timeout());
        }
        next
    }

    /// The next thing the engine must do, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The next slice given up on, if any: the caller fails its request.
    pub fn poll_failed(&mut self) -> Option<Failed<T>> {
        self.failed.pop_front()
    }

    /// When the peer's silence began, if it has work outstanding: the later of its last answer
    /// and the moment the outstanding work began.
    fn silent_since(&self) -> Option<u64> {
        Some(self.outstanding_since?.max(self.last_heard_ns))
    }

    /// How long `path`, holding slices, may answer none before it is overdue, ns:
    /// [`OVERDUE_FACTOR`] times what its oldest slice takes at its rail's bandwidth estimate
    /// (the one it was dealt on, or today's if higher) plus the path's fixed round trip, at
    /// least [`OVERDUE_MIN_NS`], at most half the timeout (also when the rail has no estimate).
    ///
    /// Why the estimate it was dealt on: a rail that collapses while holding a slice delivers
    /// the first bytes of a policer's bucket and then a trickle, and a pooled sample of that
    /// trickle can lower its estimate before the slice is overdue. Timed at the lowered
    /// estimate (a 128 KiB slice at 0.1 Mbit/s takes ten seconds), the slice is overdue only at
    /// half the timeout, and the batch holding it waits that long instead of half a second
    /// (one `bench/rails` collapse run held a batch 2.55 s, the half-timeout rule).
    fn overdue_after(&self, path: PathId) -> u64 {
        let suspect = self.config.timeout_ns / 2;
        let p = &self.paths[path];
        let Some(oldest) = p.oldest() else {
            return suspect;
        };
        let bw = self.estimate(p.rail).max(oldest.posted_bps);
        if bw <= 0.0 {
            return suspect;
        }
        let drain_ns = oldest.len as f64 / bw * 1e9;
        let fixed_ns = p.rtt.min_fixed_ns().unwrap_or(0) as f64;
        let expected = OVERDUE_FACTOR * (drain_ns + fixed_ns);
        (expected.min(u64::MAX as f64) as u64)
            .max(OVERDUE_MIN_NS)
            .min(suspect)
    }

    /// True when a usable path other than `path` answered a slice after `since`: the peer
    /// is alive and reachable, so `path`'s slices may be retried there.
    fn answered_elsewhere_since(&self, path: PathId, since: u64) -> bool {
        self.paths.iter().enumerate().any(|(q, other)| {
            q != path && other.usable && !other.dropping && other.last_answer_ns > since
        })
    }

    /// True when a usable path other than `path` can take retries: none of its slices has
    /// waited more than half the timeout (it answers, or has nothing to answer). Whether the
    /// peer as a whole answers is not asked here: its deadline bounds every retry.
    fn progress_elsewhere(&self, path: PathId, now: u64) -> bool {
        let suspect = self.config.timeout_ns / 2;
        self.paths.iter().enumerate().any(|(q, other)| {
            q != path
                && other.usable
                && !other.dropping
                && other
                    .oldest_posted_ns()
                    .is_none_or(|o| now.saturating_sub(o) <= suspect)
        })
    }

    fn window(&self, p: PathId, slice: u64) -> Window {
        let path = &self.paths[p];
        let bw = self.estimate(path.rail);
        path.controller.window(&path.rtt, bw, slice)
    }

    /// The piece of a slice of `len` bytes that path `p` (allowed `allowed` bytes in flight)
    /// can still finish by `horizon`, if it cannot finish the whole slice; `None` when `p` is
    /// not among `loads` or the horizon is unbounded (always, outside smart mode). See
    /// [`finish::tail_piece`].
    fn piece_for(
        &self,
        p: PathId,
        loads: &[(PathId, PathLoad)],
        horizon: f64,
        len: u64,
        allowed: u64,
    ) -> Option<u64> {
        let (_, load) = loads.iter().find(|(lp, _)| *lp == p)?;
        let now_load = PathLoad {
            posted: self.paths[p].posted,
            allowed,
            ..*load
        };
        finish::tail_piece(&now_load, horizon, len, self.config.min_bulk_chunk)
    }

    /// `rail`'s bandwidth estimate as of the current deal, bytes/s; 0 when unknown.
    fn estimate(&self, rail: RailId) -> f64 {
        self.bandwidth.get(rail).copied().unwrap_or(0.0)
    }

    /// How long path `p` must have been idle before a slice of `slice` bytes dealt to it starts
    /// a probe: [`finish::PROBE_AFTER_NS`], or [`finish::PROBE_COST`] times the slice's time
    /// on the rail at its estimate if that is longer. A probe holds back whatever waits for
    /// its slice (a batch, the tail of a transfer) by about that slice's time, so on a rail
    /// far slower than the rest (a 64 KiB slice in 52 ms at 10 Mbit/s) probes come seconds
    /// apart and cost a few percent, where every 50 ms they cost half the time.
    fn probe_after(&self, p: PathId, slice: u64) -> u64 {
        let bw = self.estimate(self.paths[p].rail);
        if bw <= 0.0 {
            return finish::PROBE_AFTER_NS;
        }
        let slice_ns = slice as f64 / bw * 1e9;
        (finish::PROBE_COST * slice_ns)
            .min(u64::MAX as f64)
            .max(finish::PROBE_AFTER_NS as f64) as u64
    }

    /// Most bytes a probe keeps in flight on path `p` (the deal allows one slice more): what
    /// its rail moves in [`finish::PROBE_SPAN_NS`] at its estimate, unbounded when there is
    /// none. A probe measures the rail again; it need not fill a window: a path that never
    /// measured a round trip has the initial 1 MiB one, 0.8 s of a 10 Mbit/s rail.
    fn probe_bytes(&self, p: PathId) -> u64 {
        let bw = self.estimate(self.paths[p].rail);
        if bw <= 0.0 {
            return u64::MAX;
        }
        (bw * finish::PROBE_SPAN_NS as f64 / 1e9).min(u64::MAX as f64) as u64
    }

    /// Largest slice a probe of path `p` takes (see `poll_post`): [`Self::probe_bytes`] in whole
    /// pages, at least one page.
    fn probe_piece(&self, p: PathId) -> u64 {
        (self.probe_bytes(p) & !(PAGE - 1)).max(PAGE)
    }

    /// Largest bulk slice `rail` may carry while HIGH work is active: `high_wait_ns` of its
    /// estimated bandwidth, in whole pages, at least `min_bulk_chunk`.
    fn bulk_chunk(&self, rail: RailId) -> u64 {
        match self.bandwidth.get(rail).copied() {
            Some(bw) if bw > 0.0 => {
                let bytes =
                    (bw * self.config.high_wait_ns as f64 / 1e9).min(u32::MAX as f64) as u64;
                (bytes & !(PAGE - 1)).max(self.config.min_bulk_chunk)
            }
            _ => u64::MAX,
        }
    }

    fn requeue_front(&mut self, q: Queued<T>, priority: Priority, now: u64) {
        let since = q.since_ns;
        self.queue.push_front(q, priority, since, now);
    }

    /// Charges `q` (with its rail chosen) to path `p` and readies it for `poll_post`.
    fn post_on(&mut self, p: PathId, q: Queued<T>, priority: Priority, now: u64) {
        let len = q.item.len();
        let seq = self.next_seq;
        self.next_seq += 1;
        // More HIGH slices dealt behind this one: a transfer of several slices, not the lone
        // latency-bound one.
        let more_high = self.queue.level_len(Priority::High) > 0;
        let probe_after = self.probe_after(p, len);
        let posted_bps = self.estimate(self.paths[p].rail);
        let path = &mut self.paths[p];
        if path.idle_long(now, probe_after) {
            path.probe_until_ns = now.saturating_add(finish::PROBE_SPAN_NS);
        }
        let connection = match priority {
            // A lone HIGH slice on an idle path (a request of one slice, the latency case)
            // keeps to the reserved connection, whose threads have just served HIGH. The first
            // slice of several spreads with the rest: on the reserved connection it would add
            // a third stream, and its serving thread, to the two the others take turns on,
            // which on a host of few cores cost a batch of 16 × 64 KiB a tenth of its rate.
            Priority::High if self.may_spread && (path.posted > 0 || more_high) => {
                Connection::Spread
            }
            Priority::High => Connection::Reserved,
            _ => Connection::Shared,
        };
        let ahead = path.posted;
        path.posted += len;
        path.last_busy_ns = now;
        path.inflight.push_back(InFlight {
            seq,
            len,
            ahead,
            posted_ns: now,
            posted_bps,
            since_ns: q.since_ns,
            priority,
            attempts: q.attempts,
            done: false,
        });
        self.ready.push_back(Post {
            id: SliceId { path: p, seq },
            item: q.item,
            path: p,
            rail: path.rail,
            priority,
            connection,
        });
    }

    /// Whether HIGH slices dealt now may spread over their path's connections (see
    /// [`Connection::Spread`]): no bulk work in the engine, one usable path, and its rail
    /// estimated at least [`SPREAD_MIN_BYTES_PER_SEC`] by the current deal's bandwidths, or
    /// its link that fast.
    fn may_spread(&self, rails: &mut impl Rails<T>) -> bool {
        let mut usable = self.paths.iter().filter(|p| p.usable);
        let (Some(path), None) = (usable.next(), usable.next()) else {
            return false;
        };
        if rails.has_work(Priority::Medium) || rails.has_work(Priority::Low) {
            return false;
        }
        let estimate = self.estimate(path.rail);
        // The link is asked only when the estimate falls short: one lookup per deal then.
        estimate >= SPREAD_MIN_BYTES_PER_SEC
            || rails.link_bandwidth(path.rail) >= SPREAD_MIN_BYTES_PER_SEC
    }

    /// Deals queued slices to paths, highest priority first, while some usable path that the
    /// priority may use has room in its window and the global slot admits the priority.
    fn deal(&mut self, now: u64, rails: &mut impl Rails<T>) {
        if self.closed || self.silent {
            self.expire_queue(now, rails);
            return;
        }
        let promoted = self.queue.on_timeout(now);
        if promoted > 0 {
            rails.promoted(promoted);
        }
        rails.bandwidths(&mut self.bandwidth);
        self.may_spread = self.may_spread(rails);
        let smart = rails.smart();
        let mut candidates = std::mem::take(&mut self.scratch.candidates);
        let mut selected = std::mem::take(&mut self.scratch.selected);
        let mut tiers = std::mem::take(&mut self.scratch.tiers);
        let mut allowed = std::mem::take(&mut self.scratch.allowed);
        allowed.resize(self.paths.len(), 0);
        let mut loads = std::mem::take(&mut self.scratch.loads);
        // Priorities whose turn it is; one that finds no rail is skipped this round so lower
        // ones may still use rails reserved away from it.
        let mut blocked = [false; LEVELS];
        while let Some((head, level)) = self
            .queue
            .front(|p| !blocked[p.index()] && rails.slot_admits(p))
        {
            let prio = level;
            let len = head.item.len();
            // Baseline mode chose this slice's rail without looking at load: it waits for room
            // on that rail, as plain round-robin striping does.
            if let Some(rail) = head.rail {
                let Some(p) = self.path_of(rail) else { break };
                // Charged while the rail admitted its priority; the rotation may have reserved
                // the rail since, and filtering holds on every path that assigns rails.
                if !self.paths[p].usable || !rails.rail_admits(rail, prio) {
                    rails.unassigned(rail, len);
                    self.queue.front_mut(level).expect("head exists").rail = None;
                    continue;
                }
                if self.paths[p].posted >= self.window(p, len).full {
                    blocked[level.index()] = true;
                    continue;
                }
                let q = self.queue.pop(level, now).expect("head exists");
                rails.dequeued(prio, q.waited_ns);
                self.post_on(p, q.item, prio, now);
                continue;
            }
            let high_active = rails.has_work(Priority::High);
            let bulk_active = rails.has_work(Priority::Medium) || rails.has_work(Priority::Low);
            // Bulk beside HIGH goes out in pieces a HIGH slice can pass soon (slow rails only).
            let split = prio != Priority::High && high_active;
            rails.tiers(&head.item, &mut tiers);
            for c in candidates.iter_mut() {
                c.clear();
            }
            let mut room = 0u64;
            loads.clear();
            // Whether some path not on probation can take this priority: else a path on
            // probation is dealt as any other (there is nowhere better for the work).
            // Asked only while some path is on probation: it costs a QoS look per path.
            let proven = self.paths.iter().any(|path| path.probation)
                && self.paths.iter().any(|path| {
                    path.usable && !path.probation && rails.rail_admits(path.rail, prio)
                });
            // A probe holds no request back, so a path on probation is probed as soon as its
            // last probe is answered and it idled the shortest probe wait; a page of a request
            // waits the probe-cost rule's twenty pages' time at the rail's estimate (6.6 s at
            // 0.1 Mbit/s), which a rail that came back also waited before it was seen.
            let probes = proven && head.item.has_probes();
            for (p, path) in self.paths.iter().enumerate() {
                allowed[p] = 0;
                if !path.usable || !rails.rail_admits(path.rail, prio) {
                    continue;
                }
                if smart && path.probation && proven {
                    let wait = if probes {
                        finish::PROBE_AFTER_NS
                    } else {
                        self.probe_after(p, PAGE)
                    };
                    if !path.idle_long(now, wait) {
                        continue;
                    }
                    allowed[p] = PAGE;
                    loads.push((
                        p,
                        PathLoad {
                            bytes_per_sec: self.estimate(path.rail),
                            posted: 0,
                            slice: len.min(PAGE),
                            allowed: PAGE,
                            probe_bytes: PAGE,
                        },
                    ));
                    continue;
                }
                let slice = if split {
                    len.min(self.bulk_chunk(path.rail))
                } else {
                    len
                };
                let window = self.window(p, slice);
                rails.note_window(path.rail, window.full);
                allowed[p] = allowance(prio, window, high_active, bulk_active);
                loads.push((
                    p,
                    PathLoad {
                        bytes_per_sec: self.estimate(path.rail),
                        posted: path.posted,
                        slice,
                        allowed: allowed[p],
                        probe_bytes: if now < path.probe_until_ns
                            || path.idle_long(now, self.probe_after(p, slice))
                        {
                            let piece = if split {
                                slice
                            } else {
                                slice.min(self.probe_piece(p))
                            };
                            self.probe_bytes(p).max(piece)
                        } else {
                            0
                        },
                    },
                ));
            }
            // Smart mode keeps the tail of the queue off paths that would finish it late.
            let horizon = if smart {
                let queued = (0..self.queue.level_len(level))
                    .map_while(|k| self.queue.get(level, k))
                    .map(|q| q.item.len());
                finish::horizon(loads.iter().map(|(_, load)| load), queued)
            } else {
                f64::INFINITY
            };
            for &(p, load) in loads.iter() {
                if !smart || (load.has_room() && load.on_time(load.posted, horizon)) {
                    let rail = self.paths[p].rail;
                    let tier = tiers.get(rail).copied().unwrap_or(0).min(2) as usize;
                    candidates[tier].push(rail);
                    room += allowed[p].saturating_sub(load.posted);
                }
            }
            if candidates.iter().all(Vec::is_empty) {
                // Past the horizon for the whole slice, a slow path with room may still finish
                // a piece of it in time: cut that off the head and post it there.
                let piece = loads
                    .iter()
                    .filter_map(|(p, load)| {
                        finish::tail_piece(load, horizon, len, self.config.min_bulk_chunk)
                            .map(|piece| (*p, piece))
                    })
                    .max_by_key(|&(_, piece)| piece);
                if let (true, Some((p, piece))) = (smart && !split, piece) {
                    let rail = self.paths[p].rail;
                    candidates[0].push(rail);
                    rails.select(&candidates, SliceShape::uniform(1, piece), &mut selected);
                    if selected.first() == Some(&rail) {
                        let mut q = self.queue.pop(level, now).expect("head exists");
                        let requeued = q.item.rest_after(piece);
                        rails.dequeued(prio, q.waited_ns);
                        self.post_on(p, q.item, prio, now);
                        self.queue.push_front(
                            requeued,
                            level,
                            now.saturating_sub(q.waited_ns),
                            now,
                        );
                        continue;
                    }
                    for &rail in &selected {
                        rails.unassigned(rail, piece);
                    }
                }
                blocked[level.index()] = true;
                continue;
            }
            // A run of equal slices at the head of this level, as many as the windows hold.
            // Bulk beside HIGH goes one slice at a time: a run is spread by predicted finish
            // and could heap more than one path's room on the fastest, which a HIGH slice
            // would then find ahead of it.
            let mut k = 1;
            while !split
                && k < self.queue.level_len(level).min(MAX_RUN)
                && self
                    .queue
                    .get(level, k)
                    .is_some_and(|q| q.item.len() == len && q.rail.is_none())
                && (k as u64 + 1) * len <= room
            {
                k += 1;
            }
            rails.select(&candidates, SliceShape::uniform(k, len), &mut selected);
            if selected.len() != k {
                for &rail in &selected {
                    rails.unassigned(rail, len);
                }
                break;
            }
            let mut back: Vec<(Queued<T>, u64)> = Vec::new();
            let mut rests: Vec<(Queued<T>, u64)> = Vec::new();
            for &rail in selected.iter() {
                let mut q = self.queue.pop(level, now).expect("k slices queued");
                let p = self.path_of(rail).expect("candidates have paths");
                let posted = self.paths[p].posted;
                let load = loads.iter().find(|(lp, _)| *lp == p).map(|(_, load)| load);
                let fits = if smart {
                    // The selector spreads a run by predicted finish, which can heap more on
                    // the fastest path than its room, or more on a slow one than it finishes
                    // by the horizon: the excess waits for the next deal.
                    posted < allowed[p] && load.is_none_or(|load| load.on_time(posted, horizon))
                } else {
                    posted < self.window(p, len).full
                };
                // Where the slice is cut before it goes: to a probe's piece, to a bulk chunk
                // beside HIGH, or (past the horizon for the whole slice) to the piece the path
                // still finishes in time. The rest waits at the head.
                let probe_only = smart && load.is_some_and(|load| load.probe_only(posted, horizon));
                let on_probation = smart && proven && fits && self.paths[p].probation;
                if let Some(probe) = on_probation.then(|| q.item.item.probe(PROBE_LEN)).flatten() {
                    // The path is tried with a probe of a page, and the slice waits for a
                    // path that has not stalled: a request held by a page on a collapsed
                    // rail (4 KiB at 0.1 Mbit/s, a third of a second) stalled its batch at
                    // every probation.
                    rails.unassigned(rail, len.saturating_sub(PROBE_LEN));
                    back.push((q.item, q.waited_ns));
                    let probe = Queued {
                        item: probe,
                        rail: None,
                        attempts: 0,
                        since_ns: now,
                    };
                    self.post_on(p, probe, prio, now);
                    continue;
                }
                let cut = if on_probation {
                    (q.item.item.len() > PAGE).then_some(PAGE)
                } else if fits && probe_only && !split {
                    // A probe measures the rail; it need not hold a whole slice. On a rail far
                    // slower than its estimate (one that collapsed, kept at the estimator's
                    // floor) the batch behind a 64 KiB probe waited seconds for it.
                    let piece = self.probe_piece(p);
                    (q.item.item.len() > piece).then_some(piece)
                } else if fits {
                    let chunk = self.bulk_chunk(rail);
                    (split && q.item.item.len() > chunk).then_some(chunk)
                } else if !split {
                    self.piece_for(p, &loads, horizon, len, allowed[p])
                } else {
                    None
                };
                if fits || cut.is_some() {
                    if let Some(at) = cut {
                        let rest = q.item.rest_after(at);
                        rails.unassigned(rail, rest.item.len());
                        rests.push((rest, q.waited_ns));
                    }
                    rails.dequeued(prio, q.waited_ns);
                    self.post_on(p, q.item, prio, now);
                } else if smart {
                    rails.unassigned(rail, len);
                    back.push((q.item, q.waited_ns));
                } else {
                    // Baseline: charged to its rail, it waits at the head for room there.
                    q.item.rail = Some(rail);
                    back.push((q.item, q.waited_ns));
                }
            }
            // What was cut off or could not go waits at the head, in request order.
            for (item, waited_ns) in back.into_iter().chain(rests).rev() {
                self.queue
                    .push_front(item, level, now.saturating_sub(waited_ns), now);
            }
        }
        self.scratch.candidates = candidates;
        self.scratch.selected = selected;
        self.scratch.tiers = tiers;
        self.scratch.allowed = allowed;
        self.scratch.loads = loads;
        self.expire_queue(now, rails);
        if (0..LEVELS).any(|l| {
            self.queue.level_len(Priority::ALL[l]) > 0 && !rails.slot_admits(Priority::ALL[l])
        }) {
            rails.slot_holds_work();
        }
    }

    /// Fails queued slices that can no longer go anywhere in time: all of them once the peer
    /// was found silent (with the timeout); when no path can take them, at once if every path
    /// is paused or the dispatcher is closed, and otherwise (paths reconnecting) once the
    /// peer's deadline has passed, so a retry waiting for a rail never outlives it.
    fn expire_queue(&mut self, now: u64, rails: &mut impl Rails<T>) {
        if self.queue.is_empty() {
            return;
        }
        if !self.silent && !self.closed && self.paths.iter().any(|p| p.usable) {
            return;
        }
        let all_down = self.closed || self.paths.iter().all(|p| !p.health.is_up());
        let expired = self.silent
            || self
                .silent_since()
                .is_some_and(|since| now.saturating_sub(since) > self.config.timeout_ns);
        if !all_down && !expired {
            return;
        }
        let verdict = if self.silent || !all_down {
            Verdict::Timeout
        } else {
            Verdict::RailsDown
        };
        for (q, level) in self.queue.drain_all() {
            if let Some(rail) = q.rail {
                rails.unassigned(rail, q.item.len());
            }
            self.failed.push_back(Failed {
                item: q.item,
                priority: level,
                verdict,
            });
        }
        if !self.has_outstanding() {
            self.outstanding_since = None;
        }
    }
}

/// Bytes a path may have in flight for slices of `priority`. Two full windows keep a rail busy
/// at full speed; bulk gets them while HIGH is quiet (work-conserving: alone, LOW moves as
/// fast as HIGH). While HIGH is active, bulk keeps to the lean window: whatever bulk has in
/// flight is a queue (socket buffers, the kernel's backlog, a switch) that a HIGH slice finds
/// ahead of it on the link, so bulk gives up the margin it uses for throughput. HIGH beside
/// bulk may post one window past the most it could use alone: it has its own connection, so
/// it does not queue behind bulk bytes in a byte stream, and it never waits for whichever rail
/// drains first (a slow one, often).
pub fn allowance(priority: Priority, window: Window, high_active: bool, bulk_active: bool) -> u64 {
    if priority == Priority::High && bulk_active {
        3 * window.full
    } else if priority == Priority::High || !high_active {
        2 * window.full
    } else {
        window.lean
    }
}
