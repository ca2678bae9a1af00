//! The simulation of a lanes scenario: `peers` processes, each driving its own real
//! [`UsageTracker`] and two real [`Lanes`] machines in virtual time, as the engine's glue does.
//!
//! Lanes are *directed*, as in the engine: the lane from `a` to `b` carries what `a` sends to
//! `b`. Each process runs a *requesting* machine, which asks for lanes for the peers its
//! send-side tracker promotes (and sends `Promote`, `Demote`, `Score`), and a *granting*
//! machine, which answers the requests of the peers sending to it (`Accept`, `Deny`, and
//! `Demote` when it evicts). Each holds at most `max_dedicated` lanes. A lane `a -> b` is
//! dedicated at `a`'s requesting machine and at `b`'s granting machine; the two directions of
//! a pair are negotiated independently.
//!
//! - **Send path.** Every process sends application messages at its workload's rate, simulated
//!   in batches: once per tick (`tick_us`) a process sends the messages due in that tick. As
//!   the engine's `Dynamic::on_send` does, one send in `sample_period` of each process (its
//!   tracker's [`UsageTracker::should_sample`], a counter over all its sends) is sampled: it
//!   picks its destination (by the workload's traffic shares) and calls
//!   [`UsageTracker::on_sample`], which starts a round at most once per `switch_interval` and
//!   runs `progress` every `progress_factor`-th round. Nothing else happens on the send path:
//!   the lane machines hear of it at the driver's next pass. Each process starts at a random
//!   phase of its rate, so cold senders do not all send in the same tick.
//! - **Driver.** As the engine's lanes thread (`Messaging::drive_lanes`), each process runs a
//!   driver pass every `switch_interval × progress_factor / 2`, clamped to [1 ms, 20 ms] (5 ms
//!   at 1 ms × 10), at a phase of its own; after a pass with nothing to do (no answer, event,
//!   message, switch or request waiting) it sleeps twice as long, up to 8 periods, but never
//!   past work due by the clock (idle progress, a timeout), as the engine's driver does. A pass, in the engine's order: takes the answers
//!   (`Accept`, `Deny`, `Demote`) that arrived for the requesting machine since the last pass;
//!   *idle progress*: when the tracker tracks a key and has not progressed for
//!   `2 × switch_interval × progress_factor`, runs [`UsageTracker::progress`] itself, so a
//!   process that sends seldom (or stopped) still decays its scores at least every ~20–25 ms
//!   (off with the scenario's `idle_progress: false`, to compare); drains the tracker's events
//!   into the requesting machine (`Promoted` to [`Lanes::on_promoted`], `Demoted` to
//!   [`Lanes::on_demoted`]); if the tracker progressed since the last pass, feeds the score of
//!   every promoted key to [`Lanes::on_score`] (and, as the scenario's [`ReceiverView`] says,
//!   its own score of the peers its granting machine granted to that machine; the engine does
//!   not: its view is `request`); gives the answers to the requesting machine; runs
//!   [`Lanes::on_timeout`] if a deadline has passed; then sends what was queued.
//! - **Granting.** A lane message for a granting machine is handled when it arrives, as the
//!   engine's receive poll does (`answer_lanes`), and its answers leave at once. The engine
//!   never runs a granting machine's timers (it has none: it never wants a peer).
//! - **Network.** Lane messages go through [`LaneMsg::encode`] / [`LaneMsg::decode`] and arrive
//!   after `latency_us ± jitter_us`, in the order sent between each pair of machines (the
//!   protocol needs that), reliably.
//!
//! Counters come from [`Lanes::stats`], summed over every machine per `sample_ms` window.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use multirail_policy::lanes::{Lane, LaneMsg, Lanes, LanesStats, NodeId};
use multirail_policy::usage::{UsageEvent, UsageTracker};

use crate::report::{DedicatedSpread, LanesReport, LanesSample, ReceiverReport, Report};
use crate::scenario::{LanesScenario, LanesWorkload, ReceiverView, Run, ScenarioError, SendOrder};

/// Whom a process's messages go to.
enum Dests {
    /// One peer.
    One(u64),
    /// Every other process in turn; the next send goes to peer `i + 1 + next`.
    RoundRobin { next: usize },
    /// Every other process, each send to one drawn at random.
    Random,
    /// Peers by share: (cumulative share, peer), ascending.
    Weighted(Vec<(f64, u64)>),
}

/// Which of a process's two lane machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Role {
    /// Asks for lanes for what the process sends.
    Request = 0,
    /// Grants lanes for what the process receives.
    Grant = 1,
}

impl Role {
    /// The machine at the other end of a lane this one negotiates.
    fn other(self) -> Role {
        match self {
            Role::Request => Role::Grant,
            Role::Grant => Role::Request,
        }
    }
}

/// One lane machine and what the simulator mirrors of it.
struct Machine {
    lanes: Lanes,
    /// The peers it holds a dedicated lane with (mirrors the switches).
    dedicated: Vec<u64>,
    last_switch: Option<u64>,
}

/// One process.
struct Proc {
    tracker: UsageTracker<u64>,
    /// Indexed by [`Role`].
    machines: [Machine; 2],
    /// Messages sent per tick (fractional; `acc` carries the rest).
    per_tick: f64,
    acc: f64,
    dests: Dests,
    /// Answers for the requesting machine that arrived since the driver's last pass, in order.
    answers: Vec<(u64, LaneMsg)>,
    /// The tracker's progress whose scores the driver last fed (the engine's `scored_at`).
    scored_at: Option<u64>,
}

impl Proc {
    fn machine(&mut self, role: Role) -> &mut Machine {
        &mut self.machines[role as usize]
    }
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A lane message arrives at machine `role` of process `to`.
    Deliver {
        from: u32,
        to: u32,
        role: Role,
        frame: [u8; LaneMsg::ENCODED_LEN],
    },
    /// The driver passes of the processes in one phase slot.
    Drive { slot: u32 },
    /// Every process sends its batch.
    Tick,
    /// End of a report window.
    Window,
}

/// Counters kept outside the policy structs.
#[derive(Default)]
struct Counters {
    tracker_promotions: u64,
    tracker_demotions: u64,
    progress_runs: u64,
    idle_progress_runs: u64,
    samples: u64,
    messages: u64,
    lane_messages: u64,
    switches_second_half: u64,
    last_switch: Option<u64>,
    max_dedicated_seen: usize,
    /// Most dedicated lanes of one machine in the current window.
    window_max: usize,
}

/// What the simulator watches at an mbw_mr receiver's granting machine.
#[derive(Default, Clone)]
struct Watch {
    /// Its hot senders.
    hot: Vec<u64>,
    /// When all of them were first dedicated.
    all_hot_at: Option<u64>,
    /// First time a cold sender held a lane with it.
    cold_first_at: Option<u64>,
    cold_granted: u64,
    /// Lanes of hot senders lost after `all_hot_at`.
    hot_lost: u64,
}

struct Sim<'a> {
    run: &'a Run,
    sc: &'a LanesScenario,
    procs: Vec<Proc>,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    now: u64,
    end: u64,
    rng: SmallRng,
    /// Latest arrival time per (from, to, receiving machine): keeps each pair of machines'
    /// messages in order under jitter.
    last_arrival: HashMap<(u32, u32, Role), u64>,
    c: Counters,
    /// Per receiver (mbw_mr).
    watch: Vec<Watch>,
    timeline: Vec<LanesSample>,
    /// Summed counters at the end of the previous window.
    prev: LanesStats,
    prev_tracker: (u64, u64),
    /// Reused buffer of peer ids.
    scratch: Vec<u64>,
    /// The driver's period, ns.
    drive_every: u64,
    /// The tracker counts as idle after this long without progress, ns.
    idle_after: u64,
    /// Processes by driver phase slot; slot `k` passes at `k × drive_every / slots`.
    slots: Vec<Vec<u32>>,
    /// Per process, the earliest time its driver's next pass has anything to do (an idle
    /// progress due, a progress to score, answers or tracker events waiting, a timeout due);
    /// passes before it would change nothing, so they are skipped.
    wake: Vec<u64>,
    /// Per process, passes in a row with nothing to do (the engine's driver then sleeps
    /// 2^quiet periods, up to [`QUIET_STEPS`] doublings) and the time it sleeps until.
    quiet: Vec<u32>,
    asleep_until: Vec<u64>,
}

/// Doublings of the driver's sleep after passes with nothing to do, as the engine's
/// `spawn_lanes_driver` (up to 8 periods).
const QUIET_STEPS: u32 = 3;

/// Driver phases: the processes are spread over this many evenly spaced phases of the
/// driver's period (one event per phase and pass, not one per process).
const DRIVE_SLOTS: usize = 16;

/// Simulates a lanes scenario run to its end.
pub fn simulate(run: &Run, sc: &LanesScenario) -> Result<Report, ScenarioError> {
    Sim::new(run, sc)?.run()
}

fn config_error(key: &str, message: String) -> ScenarioError {
    ScenarioError {
        key: format!("lanes.{key}"),
        message,
    }
}

impl<'a> Sim<'a> {
    fn new(run: &'a Run, sc: &'a LanesScenario) -> Result<Sim<'a>, ScenarioError> {
        let n = sc.peers;
        let mut rng = SmallRng::seed_from_u64(run.seed);
        let tick_s = sc.tick_us as f64 / 1e6;
        // Rates (messages a second) and destinations per process.
        let mut plan: Vec<(f64, Dests)> = Vec::with_capacity(n);
        let mut hot_of = Vec::new();
        match sc.workload {
            LanesWorkload::Alltoall => {
                let rate = sc.rate_per_sec.unwrap_or(0.0);
                let random = sc.order == Some(SendOrder::Random);
                plan.extend((0..n).map(|_| {
                    let dests = if random {
                        Dests::Random
                    } else {
                        Dests::RoundRobin { next: 0 }
                    };
                    (rate, dests)
                }));
            }
            LanesWorkload::MbwMr => {
                let receivers = sc.receivers();
                let hot = sc.hot();
                hot_of = vec![Vec::new(); receivers];
                // What each receiver hears from whom, to answer in proportion.
                let mut heard: Vec<Vec<(u64, f64)>> = vec![Vec::new(); receivers];
                for _ in 0..receivers {
                    plan.push((0.0, Dests::Weighted(Vec::new())));
                }
                for i in receivers..n {
                    let s = i - receivers;
                    let r = s % receivers;
                    let rate = if s < hot {
                        hot_of[r].push(i as u64);
                        sc.hot_rate()
                    } else {
                        sc.cold_rate()
                    };
                    heard[r].push((i as u64, rate));
                    plan.push((rate, Dests::One(r as u64)));
                }
                let every = sc.reply_every();
                for (r, senders) in heard.into_iter().enumerate() {
                    if every == 0 {
                        continue;
                    }
                    let total: f64 = senders.iter().map(|s| s.1).sum();
                    let mut cum = 0.0;
                    let shares = senders
                        .into_iter()
                        .map(|(peer, rate)| {
                            cum += rate / total;
                            (cum, peer)
                        })
                        .collect();
                    plan[r] = (total / every as f64, Dests::Weighted(shares));
                }
            }
        }
        let usage = sc.usage_config();
        let lanes = sc.lanes_config();
        let machine = |i: usize| -> Result<Machine, ScenarioError> {
            Ok(Machine {
                lanes: Lanes::new(NodeId(i as u64), lanes)
                    .map_err(|e| config_error("max_dedicated", e.to_string()))?,
                dedicated: Vec::new(),
                last_switch: None,
            })
        };
        let mut procs = Vec::with_capacity(n);
        for (i, (rate, dests)) in plan.into_iter().enumerate() {
            procs.push(Proc {
                tracker: UsageTracker::new(usage)
                    .map_err(|e| config_error(&format!("usage.{}", e.key), e.message))?,
                machines: [machine(i)?, machine(i)?],
                per_tick: rate * tick_s,
                acc: rng.gen::<f64>(),
                dests,
                answers: Vec::new(),
                scored_at: None,
            });
        }
        // The engine's driver: a pass every half scoring round, within [1 ms, 20 ms]; idle
        // after two scoring rounds without progress (`Dynamic::tick`, `drive_lanes`).
        let round_ns = usage
            .switch_interval_ns
            .unwrap_or(u64::MAX)
            .saturating_mul(u64::from(usage.progress_factor));
        let drive_every = (round_ns / 2).clamp(1_000_000, 20_000_000);
        let idle_after = round_ns.saturating_mul(2);
        let mut slots = vec![Vec::new(); DRIVE_SLOTS.min(n)];
        let count = slots.len();
        for i in 0..n {
            slots[rng.gen_range(0..count)].push(i as u32);
        }
        let watch = hot_of
            .into_iter()
            .map(|hot| Watch {
                hot,
                ..Watch::default()
            })
            .collect();
        Ok(Sim {
            run,
            sc,
            procs,
            events: BinaryHeap::new(),
            seq: 0,
            now: 0,
            end: run.duration_ms * 1_000_000,
            rng,
            last_arrival: HashMap::new(),
            c: Counters::default(),
            watch,
            timeline: Vec::new(),
            prev: LanesStats::default(),
            prev_tracker: (0, 0),
            scratch: Vec::new(),
            drive_every,
            idle_after,
            slots,
            wake: vec![0; n],
            quiet: vec![0; n],
            asleep_until: vec![0; n],
        })
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((t, self.seq, ev)));
    }

    fn run(mut self) -> Result<Report, ScenarioError> {
        let wall = std::time::Instant::now();
        let tick = self.sc.tick_us * 1000;
        let window = self.run.sample_ms * 1_000_000;
        self.at(0, Ev::Tick);
        self.at(window.min(self.end), Ev::Window);
        let count = self.slots.len() as u64;
        for slot in 0..count {
            let t = slot * self.drive_every / count;
            if t < self.end {
                self.at(t, Ev::Drive { slot: slot as u32 });
            }
        }
        while let Some(Reverse((t, _, ev))) = self.events.pop() {
            if t > self.end {
                // Put it back: it counts as in flight.
                self.events.push(Reverse((t, 0, ev)));
                break;
            }
            self.now = t;
            match ev {
                Ev::Tick => {
                    self.tick();
                    if t + tick < self.end {
                        self.at(t + tick, Ev::Tick);
                    }
                }
                Ev::Deliver {
                    from,
                    to,
                    role,
                    frame,
                } => {
                    let msg = LaneMsg::decode(&frame).map_err(|e| ScenarioError {
                        key: String::new(),
                        message: format!("lane message {from} -> {to} does not decode: {e}"),
                    })?;
                    self.deliver(from as usize, to as usize, role, msg);
                }
                Ev::Drive { slot } => {
                    for k in 0..self.slots[slot as usize].len() {
                        let i = self.slots[slot as usize][k] as usize;
                        if self.asleep_until[i] > t {
                            // The engine's driver sleeps through this pass.
                            continue;
                        }
                        // A pass with nothing to do (skipped here) still counts as quiet.
                        let active = self.wake[i] <= t && self.drive(i);
                        self.quiet[i] = if active {
                            0
                        } else {
                            (self.quiet[i] + 1).min(QUIET_STEPS)
                        };
                        // Half a period early, so the pass due at the next boundary runs; no
                        // later than work due by the clock (idle progress, a timeout), which
                        // the engine's driver does not sleep past either.
                        self.asleep_until[i] = (t + (self.drive_every << self.quiet[i])
                            - self.drive_every / 2)
                            .min(self.wake[i]);
                    }
                    if t + self.drive_every < self.end {
                        self.at(t + self.drive_every, Ev::Drive { slot });
                    }
                }
                Ev::Window => {
                    self.window();
                    if t < self.end {
                        self.at((t + window).min(self.end), Ev::Window);
                    }
                }
            }
        }
        Ok(self.report(wall.elapsed()))
    }

    /// Every process sends the messages due in this tick.
    fn tick(&mut self) {
        let now = self.now;
        let n = self.procs.len();
        for i in 0..n {
            let p = &mut self.procs[i];
            p.acc += p.per_tick;
            let k = p.acc as u64;
            if k == 0 {
                continue;
            }
            p.acc -= k as f64;
            self.c.messages += k;
            for j in 0..k {
                if !p.tracker.should_sample() {
                    continue;
                }
                self.c.samples += 1;
                let dest = match &p.dests {
                    Dests::One(d) => *d,
                    Dests::RoundRobin { next } => {
                        ((i + 1 + (next + j as usize) % (n - 1)) % n) as u64
                    }
                    Dests::Random => {
                        let j = self.rng.gen_range(0..n - 1);
                        (if j >= i { j + 1 } else { j }) as u64
                    }
                    Dests::Weighted(shares) => {
                        let x: f64 = self.rng.gen();
                        let at = shares.partition_point(|s| s.0 <= x);
                        shares[at.min(shares.len() - 1)].1
                    }
                };
                if p.tracker.on_sample(now, dest) {
                    self.c.progress_runs += 1;
                    self.wake[i] = now;
                }
            }
            if let Dests::RoundRobin { next } = &mut p.dests {
                *next = (*next + (k % (n as u64 - 1)) as usize) % (n - 1);
            }
        }
    }

    /// Feeds the tracker's decisions to the requesting machine.
    /// Feeds the tracker's events to the requesting machine; returns how many there were.
    fn drain_tracker(&mut self, i: usize) -> usize {
        let now = self.now;
        let p = &mut self.procs[i];
        let lanes = &mut p.machines[Role::Request as usize].lanes;
        let mut n = 0;
        while let Some(e) = p.tracker.poll_event() {
            n += 1;
            match e {
                UsageEvent::Promoted { key, score } => {
                    self.c.tracker_promotions += 1;
                    lanes.on_promoted(now, NodeId(key), score);
                }
                UsageEvent::Demoted { key } => {
                    self.c.tracker_demotions += 1;
                    lanes.on_demoted(now, NodeId(key));
                }
            }
        }
        n
    }

    /// One pass of process `i`'s lanes driver, in the order of the engine's `drive_lanes`:
    /// idle progress, the tracker's events, the scores of a new progress, the answers that
    /// came in, the requesting machine's timeout; then what the machines queued goes out.
    /// Returns whether the pass had anything to do or left a request waiting (the engine's
    /// driver backs off after passes that had not).
    fn drive(&mut self, i: usize) -> bool {
        let now = self.now;
        let p = &mut self.procs[i];
        let mut answers = std::mem::take(&mut p.answers);
        let mut active = !answers.is_empty();
        // A sender that stopped sending runs no scoring rounds of its own.
        if self.sc.idle_progress
            && !p.tracker.is_empty()
            && p.tracker
                .last_progress_ns()
                .is_none_or(|t| now.saturating_sub(t) >= self.idle_after)
        {
            p.tracker.progress(now);
            self.c.progress_runs += 1;
            self.c.idle_progress_runs += 1;
        }
        active |= self.drain_tracker(i) > 0;
        let p = &mut self.procs[i];
        if p.tracker.last_progress_ns() != p.scored_at {
            p.scored_at = p.tracker.last_progress_ns();
            self.scratch.clear();
            self.scratch.extend(p.tracker.promoted());
            let [req, grant] = &mut p.machines;
            for &k in &self.scratch {
                if let Some(s) = p.tracker.score(k) {
                    req.lanes.on_score(now, NodeId(k), s);
                }
            }
            if self.sc.receiver_view != ReceiverView::Request {
                for &d in &grant.dedicated {
                    if let Some(s) = p.tracker.score(d) {
                        grant.lanes.on_score(now, NodeId(d), s);
                    }
                }
            }
        }
        let req = &mut p.machines[Role::Request as usize].lanes;
        for (from, msg) in answers.drain(..) {
            req.on_message(now, NodeId(from), msg);
        }
        p.answers = answers;
        if req.poll_timeout().is_some_and(|t| t <= now) {
            req.on_timeout(now);
        }
        active |= self.flush(i, Role::Request) > 0;
        self.flush(i, Role::Grant);
        // The next pass with work: the idle progress or the timeout due first. Anything
        // else that gives the driver work (a progress on the send path, an answer, tracker
        // events) moves this up when it happens.
        let p = &self.procs[i];
        let idle = (self.sc.idle_progress && !p.tracker.is_empty()).then(|| {
            p.tracker
                .last_progress_ns()
                .map_or(now, |t| t.saturating_add(self.idle_after))
        });
        let timeout = p.machines[Role::Request as usize].lanes.poll_timeout();
        self.wake[i] = match (idle, timeout) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(u64::MAX),
        };
        active || timeout.is_some()
    }

    /// A lane message arrives: an answer waits for the requester's next driver pass; a
    /// request, score or demote goes to the granting machine at once.
    fn deliver(&mut self, from: usize, to: usize, role: Role, msg: LaneMsg) {
        let now = self.now;
        self.c.lane_messages += 1;
        if role == Role::Request {
            self.procs[to].answers.push((from as u64, msg));
            self.wake[to] = now;
            return;
        }
        self.procs[to]
            .machine(role)
            .lanes
            .on_message(now, NodeId(from as u64), msg);
        if let (ReceiverView::MinScore, LaneMsg::Promote { score, .. } | LaneMsg::Score { score }) =
            (self.sc.receiver_view, msg)
        {
            // UCX: the remote side's view floors the local score of the pair; the receiver's
            // tracker may promote the sender, and its requesting machine ask for the way back
            // at the driver's next pass.
            let _ = self.procs[to].tracker.set_min_score(from as u64, score);
            self.wake[to] = now;
        }
        self.flush(to, role);
    }

    /// Sends what machine `role` of `i` queued, records its switches, arms its timer.
    /// Sends what machine `role` of process `i` queued and applies its switches; returns how
    /// many messages and switches there were.
    fn flush(&mut self, i: usize, role: Role) -> usize {
        let now = self.now;
        let half = self.end / 2;
        let mut n = 0;
        while let Some((to, msg)) = self.procs[i].machine(role).lanes.poll_transmit() {
            n += 1;
            let jitter = self.sc.jitter_us;
            let delay_us = if jitter > 0.0 {
                self.sc.latency_us + self.rng.gen_range(-jitter..=jitter)
            } else {
                self.sc.latency_us
            };
            let (from, to) = (i as u32, to.0 as u32);
            let dest = role.other();
            let mut t = now + (delay_us.max(0.0) * 1000.0) as u64;
            let last = self.last_arrival.entry((from, to, dest)).or_insert(0);
            t = t.max(*last);
            *last = t;
            self.at(
                t,
                Ev::Deliver {
                    from,
                    to,
                    role: dest,
                    frame: msg.encode(),
                },
            );
        }
        let m = self.procs[i].machine(role);
        let watch = match role {
            Role::Grant => self.watch.get_mut(i),
            Role::Request => None,
        };
        let mut watch = watch;
        while let Some(s) = m.lanes.poll_switch() {
            n += 1;
            let peer = s.peer.0;
            match s.to {
                Lane::Dedicated => m.dedicated.push(peer),
                Lane::Shared => m.dedicated.retain(|&d| d != peer),
            }
            m.last_switch = Some(now);
            self.c.last_switch = Some(now);
            if now > half {
                self.c.switches_second_half += 1;
            }
            if let Some(w) = watch.as_deref_mut() {
                let hot = w.hot.contains(&peer);
                match s.to {
                    Lane::Dedicated if !hot => {
                        w.cold_granted += 1;
                        w.cold_first_at.get_or_insert(now);
                    }
                    Lane::Shared if hot && w.all_hot_at.is_some() => w.hot_lost += 1,
                    _ => {}
                }
                if w.all_hot_at.is_none() && w.hot.iter().all(|h| m.dedicated.contains(h)) {
                    w.all_hot_at = Some(now);
                }
            }
        }
        let held = m.lanes.dedicated();
        debug_assert_eq!(held, m.dedicated.len());
        self.c.window_max = self.c.window_max.max(held);
        self.c.max_dedicated_seen = self.c.max_dedicated_seen.max(held);
        // The driver runs the requesting machine's timeouts; a granting machine never
        // wants a peer, so it never backs off or waits for an answer.
        debug_assert!(role == Role::Request || m.lanes.poll_timeout().is_none());
        n
    }

    fn machines(&self) -> impl Iterator<Item = &Machine> + '_ {
        self.procs.iter().flat_map(|p| p.machines.iter())
    }

    fn totals(&self) -> LanesStats {
        let mut t = LanesStats::default();
        for m in self.machines() {
            t.add(m.lanes.stats());
        }
        t
    }

    /// Closes a report window.
    fn window(&mut self) {
        let t = self.totals();
        let p = self.prev;
        let dedicated: u64 = self.machines().map(|m| m.lanes.dedicated() as u64).sum();
        self.timeline.push(LanesSample {
            t_ms: self.now.div_ceil(1_000_000),
            requests: t.requests_sent - p.requests_sent,
            accepts: t.accepts_sent - p.accepts_sent,
            denials: t.denials_sent - p.denials_sent,
            demotes: t.demotes_sent - p.demotes_sent,
            evictions: t.evictions - p.evictions,
            timeouts: t.timeouts - p.timeouts,
            cooled: t.cooled - p.cooled,
            scores: t.scores_sent - p.scores_sent,
            promotions: t.promotions - p.promotions,
            demotions: t.demotions - p.demotions,
            switches: t.switches - p.switches,
            tracker_promotions: self.c.tracker_promotions - self.prev_tracker.0,
            tracker_demotions: self.c.tracker_demotions - self.prev_tracker.1,
            dedicated,
            max_dedicated: self.c.window_max as u64,
        });
        self.prev = t;
        self.prev_tracker = (self.c.tracker_promotions, self.c.tracker_demotions);
        self.c.window_max = self
            .machines()
            .map(|m| m.lanes.dedicated())
            .max()
            .unwrap_or(0);
    }

    fn report(&self, wall: std::time::Duration) -> Report {
        let ms = |t: u64| t as f64 / 1e6;
        let n = self.procs.len();
        // A lane i -> d is dedicated at i's requesting machine and d's granting machine.
        let mut pairs = 0;
        let mut one_sided = 0;
        for (i, p) in self.procs.iter().enumerate() {
            for role in [Role::Request, Role::Grant] {
                for &d in &p.machines[role as usize].dedicated {
                    let other = &self.procs[d as usize].machines[role.other() as usize];
                    if other.lanes.lane(NodeId(i as u64)) == Lane::Dedicated {
                        if role == Role::Request {
                            pairs += 1;
                        }
                    } else {
                        one_sided += 1;
                    }
                }
            }
        }
        let counts: Vec<usize> = self
            .procs
            .iter()
            .map(|p| p.machines.iter().map(|m| m.dedicated.len()).sum())
            .collect();
        let spread = DedicatedSpread {
            min: counts.iter().copied().min().unwrap_or(0),
            mean: counts.iter().sum::<usize>() as f64 / n as f64,
            max: counts.iter().copied().max().unwrap_or(0),
        };
        let receivers = self
            .watch
            .iter()
            .enumerate()
            .map(|(r, w)| {
                let m = &self.procs[r].machines[Role::Grant as usize];
                let hot = &w.hot;
                let mut dedicated = m.dedicated.clone();
                dedicated.sort_unstable();
                let hot_dedicated = dedicated.iter().filter(|d| hot.contains(d)).count();
                let exactly = hot_dedicated == hot.len() && dedicated.len() == hot.len();
                let req = &self.procs[r].machines[Role::Request as usize];
                let mut replies_dedicated = req.dedicated.clone();
                replies_dedicated.sort_unstable();
                ReceiverReport {
                    node: r as u64,
                    hot: hot.clone(),
                    cold_dedicated: dedicated.len() - hot_dedicated,
                    hot_dedicated,
                    dedicated,
                    all_hot_at_ms: w.all_hot_at.map(ms),
                    last_switch_ms: m.last_switch.map(ms),
                    hot_set_since_ms: exactly.then(|| m.last_switch.map_or(0.0, ms)),
                    cold_first_at_ms: w.cold_first_at.map(ms),
                    cold_granted: w.cold_granted,
                    hot_lost: w.hot_lost,
                    replies_dedicated,
                    replies_switches: req.lanes.stats().switches,
                    replies_cooled: req.lanes.stats().cooled,
                }
            })
            .collect();
        let in_flight = self
            .events
            .iter()
            .filter(|Reverse((_, _, e))| matches!(e, Ev::Deliver { .. }))
            .count() as u64
            + self
                .procs
                .iter()
                .map(|p| p.answers.len() as u64)
                .sum::<u64>();
        let secs = self.run.duration_ms as f64 / 1000.0;
        let lanes = LanesReport {
            workload: match self.sc.workload {
                LanesWorkload::MbwMr => "mbw_mr",
                LanesWorkload::Alltoall => "alltoall",
            }
            .to_owned(),
            peers: n,
            max_dedicated: self.sc.max_dedicated,
            receiver_view: match self.sc.receiver_view {
                ReceiverView::Request => "request",
                ReceiverView::Own => "own",
                ReceiverView::MinScore => "min_score",
            }
            .to_owned(),
            messages: self.c.messages,
            samples: self.c.samples,
            progress_runs: self.c.progress_runs,
            idle_progress_runs: self.c.idle_progress_runs,
            idle_progress: self.sc.idle_progress,
            drive_every_ms: self.drive_every as f64 / 1e6,
            lane_messages: self.c.lane_messages,
            lane_messages_in_flight: in_flight,
            tracker_promotions: self.c.tracker_promotions,
            tracker_demotions: self.c.tracker_demotions,
            totals: self.totals(),
            timeline: self.timeline.clone(),
            switches_second_half: self.c.switches_second_half,
            last_switch_ms: self.c.last_switch.map(ms),
            max_dedicated_seen: self.c.max_dedicated_seen,
            dedicated_pairs: pairs,
            one_sided,
            dedicated_per_process: spread,
            receivers,
        };
        Report {
            lanes: Some(lanes),
            ..Report::without_rails(
                self.run,
                wall,
                (self.c.messages * self.sc.message_size) as f64 / secs / 1e9,
                0.0,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::report::Report;
    use crate::scenario::parse_runs;

    fn run(doc: &str) -> Report {
        let runs = parse_runs(doc).expect("scenario parses");
        crate::simulate(&runs[0]).expect("runs")
    }

    const SMALL_MBW: &str = r#"{"name": "m", "duration_ms": 3000, "sample_ms": 100,
        "lanes": {"peers": 50, "workload": "mbw_mr", "hot": 3, "hot_rate_per_sec": 100000,
                  "max_dedicated": 4}}"#;

    #[test]
    fn hot_senders_get_the_receivers_lanes() {
        let r = run(SMALL_MBW);
        let l = r.lanes.as_ref().unwrap();
        let rx = &l.receivers[0];
        assert_eq!(rx.hot, vec![1, 2, 3]);
        assert_eq!(rx.dedicated, vec![1, 2, 3], "{}", r.table());
        assert!(rx.hot_set_since_ms.unwrap() < 500.0, "{}", r.table());
        // Three lanes into the receiver and, for its answers, three out of it.
        assert_eq!(l.dedicated_pairs, 6);
        assert_eq!(l.one_sided, 0);
        assert_eq!((rx.cold_granted, rx.hot_lost), (0, 0));
        assert!(l.max_dedicated_seen <= 4);
        // The timeline accounts for every switch, and the report names the run.
        let switches: u64 = l.timeline.iter().map(|s| s.switches).sum();
        assert_eq!(switches, l.totals.switches);
        assert_eq!(l.timeline.len(), 30);
        assert!(r.table().contains("receiver 0: dedicated [1, 2, 3]"));
        assert!(r.gb_per_s > 0.0);
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let (a, b) = (run(SMALL_MBW), run(SMALL_MBW));
        let (a, b) = (a.lanes.unwrap(), b.lanes.unwrap());
        assert_eq!(a.lane_messages, b.lane_messages);
        assert_eq!(a.messages, b.messages);
        assert_eq!(a.receivers[0].dedicated, b.receivers[0].dedicated);
    }

    #[test]
    fn batches_send_at_the_rate_and_sample_one_in_the_period() {
        let r = run(r#"{"name": "a", "duration_ms": 1000,
            "lanes": {"peers": 10, "workload": "alltoall", "rate_per_sec": 64000}}"#);
        let l = r.lanes.unwrap();
        // 10 processes x 64,000 a second for 1 s, give or take each one's starting phase.
        assert!(l.messages.abs_diff(640_000) <= 10, "{}", l.messages);
        // One in 32 sampled, the first of each process included.
        assert!(l.samples.abs_diff(l.messages / 32) <= 10, "{}", l.samples);
        // A round per 10 ms, a progress per 10 rounds: about 10 a second per process.
        assert!((90..=100).contains(&l.progress_runs), "{}", l.progress_runs);
        let bytes = l.messages * 128;
        assert!((r.gb_per_s - bytes as f64 / 1e9).abs() < 1e-9);
    }

    #[test]
    fn no_process_ever_holds_more_than_max_dedicated() {
        for order in ["round_robin", "random"] {
            // Without the floor every promoted peer asks, so far more lanes are wanted than fit.
            let doc = format!(
                r#"{{"name": "a", "duration_ms": 5000, "sample_ms": 100,
                "lanes": {{"peers": 30, "workload": "alltoall", "rate_per_sec": 4000,
                          "order": "{order}", "max_dedicated": 2, "min_score": 0}}}}"#
            );
            let r = run(&doc);
            let l = r.lanes.unwrap();
            assert!(
                l.max_dedicated_seen <= 2,
                "{order}: {}",
                l.max_dedicated_seen
            );
            assert!(l.timeline.iter().all(|s| s.max_dedicated <= 2));
            assert!(l.dedicated_pairs >= 10, "{order}: lanes formed");
            assert!(l.totals.denials_sent > 0, "{order}: more wanted than fit");
            if l.lane_messages_in_flight == 0 {
                assert_eq!(
                    l.one_sided, 0,
                    "{order}: both ends agree when nothing is in flight"
                );
            }
        }
    }

    /// The engine's driver: a pass every half scoring round within [1 ms, 20 ms] (up to 8
    /// times that while passes find nothing to do, but never past an idle progress due), and
    /// idle progress after two scoring rounds without one. A cold sender sampling every send
    /// (10 a second, one round each) progresses on its own every 10 rounds (1 s) and, between,
    /// by the driver every 20-25 ms, so its destination, touched every 100 ms, scores at most
    /// about 0.3 and it never asks; without idle progress it is touched in every one of its
    /// own progress rounds and reaches the floor at its fourth (about 4 s).
    #[test]
    fn the_driver_runs_idle_progress_as_the_engine_does() {
        let doc = |idle: bool| {
            format!(
                r#"{{"name": "i", "duration_ms": 6000, "sample_ms": 100,
                "lanes": {{"peers": 3, "workload": "mbw_mr", "hot": 1,
                          "hot_rate_per_sec": 100000, "max_dedicated": 4,
                          "idle_progress": {idle},
                          "usage": {{"switch_interval_us": 1000, "sample_period": 1}}}}}}"#
            )
        };
        let l = run(&doc(true)).lanes.unwrap();
        assert_eq!(l.drive_every_ms, 5.0);
        // The cold sender: ~5 s of idle progress every 20 to 25 ms after its first own one.
        assert!(
            (180..=260).contains(&l.idle_progress_runs),
            "{}",
            l.idle_progress_runs
        );
        let rx = &l.receivers[0];
        assert_eq!(rx.dedicated, vec![1]);
        assert_eq!((rx.cold_granted, rx.cold_first_at_ms), (0, None));
        let l = run(&doc(false)).lanes.unwrap();
        assert_eq!(l.idle_progress_runs, 0);
        let rx = &l.receivers[0];
        assert_eq!(rx.dedicated, vec![1, 2]);
        let cold_at = rx.cold_first_at_ms.unwrap();
        assert!((3_500.0..5_000.0).contains(&cold_at), "{cold_at} ms");
        // The policy's default interval (10 ms x 10) clamps the driver's pass to 20 ms.
        let l = run(SMALL_MBW).lanes.unwrap();
        assert_eq!(l.drive_every_ms, 20.0);
    }

    #[test]
    fn every_receiver_view_runs() {
        for view in ["request", "own", "min_score"] {
            let doc = SMALL_MBW.replace(
                r#""max_dedicated": 4"#,
                &format!(r#""max_dedicated": 4, "receiver_view": "{view}""#),
            );
            let l = run(&doc).lanes.unwrap();
            assert_eq!(l.receiver_view, view);
            assert_eq!(l.receivers[0].hot_dedicated, 3, "{view}");
        }
    }
}
