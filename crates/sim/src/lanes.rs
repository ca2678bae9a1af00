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
//!   in batches: once per tick (`tick_us`) a process sends the messages due in that tick, and
//!   each one goes through [`UsageTracker::should_sample`]; a sampled send picks its destination
//!   (by the workload's traffic shares) and calls [`UsageTracker::on_sample`], which starts a
//!   round at most once per `switch_interval` and runs `progress` every `progress_factor`-th
//!   round. Each process starts at a random phase of its rate, so cold senders do not all send
//!   in the same tick.
//! - **Glue.** After a progress, the tracker's events feed the requesting machine (`Promoted`
//!   to [`Lanes::on_promoted`], `Demoted` to [`Lanes::on_demoted`]), then the tracker's score of
//!   every peer the machine keeps (promoted or dedicated) is fed with [`Lanes::on_score`]. The
//!   granting machine hears the requesters' scores (`Promote`, `Score`) and, as the scenario's
//!   [`ReceiverView`] says, its own tracker's score for the peers it granted a lane.
//! - **Network.** Lane messages go through [`LaneMsg::encode`] / [`LaneMsg::decode`] and arrive
//!   after `latency_us ± jitter_us`, in the order sent between each pair of machines (the
//!   protocol needs that), reliably. Timers ([`Lanes::poll_timeout`]) run at their deadlines.
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
    timer_at: Option<u64>,
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
    /// A machine's lane timer (if still the armed one).
    Timer { node: u32, role: Role, at: u64 },
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
}

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
                timer_at: None,
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
            });
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
                Ev::Timer { node, role, at } => {
                    let i = node as usize;
                    let m = self.procs[i].machine(role);
                    if m.timer_at != Some(at) {
                        continue;
                    }
                    m.timer_at = None;
                    m.lanes.on_timeout(t);
                    self.flush(i, role);
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
            let mut progressed = false;
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
                progressed |= p.tracker.on_sample(now, dest);
            }
            if let Dests::RoundRobin { next } = &mut p.dests {
                *next = (*next + (k % (n as u64 - 1)) as usize) % (n - 1);
            }
            if progressed {
                self.c.progress_runs += 1;
                self.after_progress(i);
            }
        }
    }

    /// Feeds the tracker's decisions to the requesting machine.
    fn drain_tracker(&mut self, i: usize) {
        let now = self.now;
        let p = &mut self.procs[i];
        let lanes = &mut p.machines[Role::Request as usize].lanes;
        while let Some(e) = p.tracker.poll_event() {
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
    }

    /// After a progress: events, then the current scores of the peers the requesting machine
    /// keeps (promoted or dedicated), and, as the receiver view says, of the peers the
    /// granting machine granted.
    fn after_progress(&mut self, i: usize) {
        let now = self.now;
        self.drain_tracker(i);
        let p = &mut self.procs[i];
        self.scratch.clear();
        self.scratch.extend(p.tracker.promoted());
        let [req, grant] = &mut p.machines;
        for &d in &req.dedicated {
            if !p.tracker.is_promoted(d) {
                self.scratch.push(d);
            }
        }
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
        self.flush(i, Role::Request);
        self.flush(i, Role::Grant);
    }

    fn deliver(&mut self, from: usize, to: usize, role: Role, msg: LaneMsg) {
        let now = self.now;
        self.c.lane_messages += 1;
        self.procs[to]
            .machine(role)
            .lanes
            .on_message(now, NodeId(from as u64), msg);
        if let (ReceiverView::MinScore, LaneMsg::Promote { score, .. } | LaneMsg::Score { score }) =
            (self.sc.receiver_view, msg)
        {
            // UCX: the remote side's view floors the local score of the pair; the receiver's
            // tracker may promote the sender, and its requesting machine ask for the way back.
            let _ = self.procs[to].tracker.set_min_score(from as u64, score);
            self.drain_tracker(to);
            self.flush(to, Role::Request);
        }
        self.flush(to, role);
    }

    /// Sends what machine `role` of `i` queued, records its switches, arms its timer.
    fn flush(&mut self, i: usize, role: Role) {
        let now = self.now;
        let half = self.end / 2;
        while let Some((to, msg)) = self.procs[i].machine(role).lanes.poll_transmit() {
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
        let arm = match m.lanes.poll_timeout() {
            Some(at) if m.timer_at.is_none_or(|t| at < t) => {
                m.timer_at = Some(at);
                Some(at)
            }
            _ => None,
        };
        if let Some(at) = arm {
            let node = i as u32;
            self.at(at.max(now), Ev::Timer { node, role, at });
        }
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
                }
            })
            .collect();
        let in_flight = self
            .events
            .iter()
            .filter(|Reverse((_, _, e))| matches!(e, Ev::Deliver { .. }))
            .count() as u64;
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
            name: self.run.name.clone(),
            description: self.run.description.clone(),
            simulated_ms: self.run.duration_ms,
            wall_ms: wall.as_secs_f64() * 1e3,
            smart: false,
            line_rate_gb_per_s: 0.0,
            gb_per_s: (self.c.messages * self.sc.message_size) as f64 / secs / 1e9,
            slices: 0,
            retried: 0,
            probes: 0,
            rails_paused: 0,
            unfinished_requests: 0,
            rails: Vec::new(),
            classes: Vec::new(),
            adaptation: Vec::new(),
            timeline: Vec::new(),
            nic_numa: Vec::new(),
            lanes: Some(lanes),
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
