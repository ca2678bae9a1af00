//! The simulation of one run: modelled NICs, submitters, and the real policy structs
//! (slicing, DeviceSelector, the per-peer dispatcher with its QoS queues, windows and rail
//! health) driven in virtual time by a binary-heap event queue.
//!
//! A NIC serializes slices one after another at its line rate (or its message rate, whichever
//! is slower) and the answer returns after twice its one-way latency; it holds what is posted
//! to it in its own FIFO, as a socket buffer and a switch would. A failed link loses what it
//! holds: the engine notices at its next link check and hands those slices back, so that is
//! when the dispatcher hears of them. Time is nanoseconds from the start of the run.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use slab::Slab;

use multirail_policy::dispatch::{
    Cause, Connection, Dispatcher, Event, Payload, Post, Rails, SliceId,
};
use multirail_policy::qos::{Priority, LEVELS};
use multirail_policy::selector::{DeviceSelector, RailId, SliceShape};
use multirail_policy::slicing::SlicePlan;

use crate::report::{Adaptation, ClassReport, RailReport, Report, Sample};
use crate::scenario::{Arrival, Run, ScenarioError};

/// How long after its last posted slice a priority still counts as active (the engine's
/// `slots::ACTIVE_NS`): a stream of requests that never queues is still traffic.
const ACTIVE_NS: u64 = 10_000_000;

/// A piece of request `req`, or a probe of a rail (which belongs to no request), as the
/// engine's tcp transport sends them.
#[derive(Debug)]
struct Piece {
    req: usize,
    len: u64,
    numa_node: i32,
}

/// The request a probe stands for: none.
const PROBE_REQ: usize = usize::MAX;

impl Payload for Piece {
    fn len(&self) -> u64 {
        self.len
    }

    fn split_off(&mut self, at: u64) -> Piece {
        let rest = Piece {
            req: self.req,
            len: self.len - at,
            numa_node: self.numa_node,
        };
        self.len = at;
        rest
    }

    fn has_probes(&self) -> bool {
        true
    }

    fn probe(&self, len: u64) -> Option<Piece> {
        Some(Piece {
            req: PROBE_REQ,
            len,
            numa_node: self.numa_node,
        })
    }

    fn is_probe(&self) -> bool {
        self.req == PROBE_REQ
    }
}

/// A modelled NIC. It has two send queues, as a path has two kinds of connection: the one
/// reserved for HIGH slices and the shared ones. Each is a FIFO; while both hold work the wire
/// alternates between them packet by packet, so each gets half the line rate (a HIGH slice is
/// slowed by bulk beside it, not queued behind all of it, as with separate queue pairs or TCP
/// connections).
struct Nic {
    bytes_per_ns: f64,
    latency_ns: u64,
    op_ns: u64,
    /// When each queue (reserved, shared) has sent what it holds.
    busy_until: [u64; 2],
    up: bool,
    /// Bumped when the link fails: completions of older generations were lost.
    generation: u64,
    /// When the engine notices the current failure (its next link check).
    detected_at: u64,
    /// The connections were closed for answering nothing in time (their slices come back as
    /// timed out) rather than lost with the link.
    lost_by_timeout: bool,
    numa_node: i32,
}

/// What happens at an instant.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A slice's answer arrives (if its NIC's generation is still `generation`).
    Answer {
        rail: usize,
        generation: u64,
        id: SliceId,
        token: usize,
    },
    /// A lost slice is handed back.
    Lost {
        id: SliceId,
        token: usize,
        timeout: bool,
    },
    /// An open-loop workload's next request.
    Arrival { workload: usize },
    /// Link event `index` of the scenario.
    Link { index: usize },
    /// The dispatcher's deadline.
    Timer { at: u64 },
    /// The engine's link check.
    LinkCheck,
}

/// The engine-wide view the dispatcher consults: the selector, the NUMA tiers, and which
/// priorities are active.
struct Host {
    selector: DeviceSelector,
    tiers: Vec<(i32, Vec<u8>)>,
    queued: [usize; LEVELS],
    last_posted: [Option<u64>; LEVELS],
    now: u64,
    smart: bool,
}

impl Rails<Piece> for Host {
    fn smart(&self) -> bool {
        self.smart
    }
    fn slot_admits(&self, _priority: Priority) -> bool {
        true
    }
    fn rail_admits(&self, _rail: RailId, _priority: Priority) -> bool {
        true
    }
    fn has_work(&self, priority: Priority) -> bool {
        let p = priority.index();
        self.queued[p] > 0
            || self.last_posted[p].is_some_and(|t| self.now.saturating_sub(t) < ACTIVE_NS)
    }
    fn tiers(&mut self, item: &Piece, out: &mut Vec<u8>) {
        out.clear();
        if let Some((_, t)) = self.tiers.iter().find(|(n, _)| *n == item.numa_node) {
            out.extend_from_slice(t);
        }
    }
    fn bandwidths(&mut self, out: &mut [f64]) {
        for (o, s) in out.iter_mut().zip(self.selector.stats()) {
            *o = s.ewma_gbps * 1e9 / 8.0;
        }
    }
    fn link_bandwidth(&mut self, rail: RailId) -> f64 {
        self.selector
            .rail_stats(rail)
            .map_or(0.0, |s| s.theoretical_gbps * 1e9 / 8.0)
    }
    fn select(&mut self, candidates: &[Vec<RailId>; 3], shape: SliceShape, out: &mut Vec<RailId>) {
        let tiers: [&[RailId]; 3] = [&candidates[0], &candidates[1], &candidates[2]];
        if self.selector.select(&tiers, shape, out).is_err() {
            out.clear();
        }
    }
    fn delivered(
        &mut self,
        rail: RailId,
        bytes: u64,
        posted_ns: u64,
        now_ns: u64,
        app_limited: bool,
    ) {
        let _ = self
            .selector
            .on_delivered(rail, bytes, posted_ns, now_ns, app_limited);
    }
    fn failed(&mut self, rail: RailId, bytes: u64) {
        let _ = self.selector.on_failed(rail, bytes);
    }
    fn recovered(&mut self, rail: RailId, now_ns: u64) {
        let _ = self.selector.on_recovered(rail, now_ns);
    }
    fn stalled(&mut self, rail: RailId, bytes: u64, posted_ns: u64, now_ns: u64) {
        let _ = self.selector.on_stalled(rail, bytes, posted_ns, now_ns);
    }
    fn unassigned(&mut self, rail: RailId, bytes: u64) {
        let _ = self.selector.on_unassigned(rail, bytes);
    }
}

/// A request in flight.
struct Request {
    workload: usize,
    /// The closed-loop submitter it belongs to.
    submitter: Option<usize>,
    len: u64,
    done: u64,
    failed: u64,
    submitted: u64,
}

/// A closed-loop submitter: one batch outstanding at a time.
struct Submitter {
    workload: usize,
    outstanding: usize,
    batch_started: u64,
}

struct Class {
    latency: Histogram<u64>,
    requests: u64,
    bytes: u64,
    failed: u64,
}

/// Runs one scenario run to its end and reports what happened. Fails only on a scenario the
/// parser should have refused. A lanes scenario runs in [`crate::lanes`].
pub fn simulate(run: &Run) -> Result<Report, ScenarioError> {
    if let Some(lanes) = &run.lanes {
        return crate::lanes::simulate(run, lanes);
    }
    if let Some(mc) = &run.multicast {
        return crate::multicast::simulate(run, mc);
    }
    Sim::new(run)?.run()
}

struct Sim<'a> {
    run: &'a Run,
    plans: (SlicePlan, SlicePlan),
    nics: Vec<Nic>,
    host: Host,
    dispatch: Dispatcher<Piece>,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    now: u64,
    end: u64,
    timer_at: Option<u64>,
    requests: Slab<Request>,
    /// Slices on the wire, by token: what a NIC holds.
    wire: Slab<Piece>,
    submitters: Vec<Submitter>,
    classes: Vec<Class>,
    rng: SmallRng,
    /// Bytes answered per rail per sample.
    samples: Vec<Vec<u64>>,
    rail_bytes: Vec<u64>,
    slices: u64,
    retried: u64,
    probes: u64,
    /// A request was submitted since this was last cleared: the dispatcher must be asked to
    /// deal, as the engine's submitting thread does after every post.
    submitted: bool,
    paused: u64,
    live: Vec<usize>,
}

impl<'a> Sim<'a> {
    fn new(run: &'a Run) -> Result<Sim<'a>, ScenarioError> {
        let policy = &run.policy;
        let reported: Vec<Option<f64>> = run
            .rails
            .iter()
            .map(|r| Some(r.reported_gbps.unwrap_or(r.gbps)))
            .collect();
        let mut nodes: Vec<i32> = run.workloads.iter().map(|w| w.numa_node).collect();
        nodes.sort_unstable();
        nodes.dedup();
        let tiers = nodes
            .iter()
            .map(|&n| {
                let t = run
                    .rails
                    .iter()
                    .map(|r| u8::from(!(r.numa_node == n || r.numa_node < 0 || n < 0)))
                    .collect();
                (n, t)
            })
            .collect();
        let rails: Vec<RailId> = (0..run.rails.len()).collect();
        let mut dispatch = Dispatcher::new(policy.dispatch(), &rails);
        let conns = policy.connections_per_rail + 1;
        for p in 0..rails.len() {
            dispatch.on_path(0, p, conns);
        }
        let nics = run
            .rails
            .iter()
            .map(|r| Nic {
                bytes_per_ns: r.gbps * r.efficiency / 8.0,
                latency_ns: (r.latency_us * 1000.0) as u64,
                op_ns: if r.ops_per_sec > 0.0 {
                    (1e9 / r.ops_per_sec) as u64
                } else {
                    0
                },
                busy_until: [0; 2],
                up: true,
                generation: 0,
                detected_at: 0,
                lost_by_timeout: false,
                numa_node: r.numa_node,
            })
            .collect();
        let end = run.duration_ms * 1_000_000;
        let nsamples = run.duration_ms.div_ceil(run.sample_ms) as usize;
        let histogram =
            || Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds");
        Ok(Sim {
            plans: policy.plans()?,
            nics,
            host: Host {
                selector: DeviceSelector::new(policy.selector(), &reported, run.seed),
                tiers,
                queued: [0; LEVELS],
                last_posted: [None; LEVELS],
                now: 0,
                smart: policy.enable_smart_scheduling,
            },
            dispatch,
            events: BinaryHeap::new(),
            seq: 0,
            now: 0,
            end,
            timer_at: None,
            requests: Slab::new(),
            wire: Slab::new(),
            submitters: Vec::new(),
            classes: run
                .workloads
                .iter()
                .map(|_| Class {
                    latency: histogram(),
                    requests: 0,
                    bytes: 0,
                    failed: 0,
                })
                .collect(),
            rng: SmallRng::seed_from_u64(run.seed),
            samples: vec![vec![0; run.rails.len()]; nsamples.max(1)],
            rail_bytes: vec![0; run.rails.len()],
            slices: 0,
            retried: 0,
            probes: 0,
            submitted: false,
            paused: 0,
            live: vec![conns; run.rails.len()],
            run,
        })
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((t, self.seq, ev)));
    }

    fn run(mut self) -> Result<Report, ScenarioError> {
        let wall = std::time::Instant::now();
        for (w, wl) in self.run.workloads.iter().enumerate() {
            let start = wl.start_ms * 1_000_000;
            match wl.arrival {
                Arrival::Closed => {
                    for _ in 0..wl.threads {
                        self.submitters.push(Submitter {
                            workload: w,
                            outstanding: 0,
                            batch_started: 0,
                        });
                    }
                }
                _ => self.at(start, Ev::Arrival { workload: w }),
            }
        }
        for (i, e) in self.run.events.iter().enumerate() {
            self.at(e.at_ms * 1_000_000, Ev::Link { index: i });
        }
        let link_check = self.run.policy.link_check_ms * 1_000_000;
        self.at(link_check, Ev::LinkCheck);
        // Closed-loop submitters start at their workload's start.
        for s in 0..self.submitters.len() {
            let w = self.submitters[s].workload;
            let start = self.run.workloads[w].start_ms * 1_000_000;
            if start == 0 {
                self.submit_batch(s);
            } else {
                self.at(
                    start,
                    Ev::Arrival {
                        workload: usize::MAX - s,
                    },
                );
            }
        }
        self.pump();
        while let Some(Reverse((t, _, ev))) = self.events.pop() {
            if t > self.end {
                break;
            }
            self.now = t;
            self.host.now = t;
            match ev {
                Ev::Answer {
                    rail,
                    generation,
                    id,
                    token,
                } => {
                    if self.nics[rail].generation != generation {
                        // Lost with its link: handed back when the engine notices.
                        let when = self.nics[rail].detected_at.max(t);
                        let timeout = self.nics[rail].lost_by_timeout;
                        self.at(when, Ev::Lost { id, token, timeout });
                        continue;
                    }
                    let piece = self.wire.remove(token);
                    self.slices += 1;
                    let refill = self.dispatch.on_completed(t, id, None, &mut self.host);
                    self.submitted = false;
                    // The answer may finish a closed-loop batch, whose submitter posts the next
                    // one at once.
                    self.credit(rail, &piece);
                    if refill || self.submitted {
                        self.pump();
                    }
                }
                Ev::Lost { id, token, timeout } => {
                    let piece = self.wire.remove(token);
                    self.retried += 1;
                    let cause = if timeout { Cause::Timeout } else { Cause::Lost };
                    self.dispatch.on_failed(t, id, piece, cause, &mut self.host);
                    self.settle();
                    self.pump();
                }
                Ev::Arrival { workload } if workload > usize::MAX / 2 => {
                    self.submit_batch(usize::MAX - workload);
                    self.pump();
                }
                Ev::Arrival { workload } => {
                    let wl = &self.run.workloads[workload];
                    let stop = wl.stop_ms.map_or(self.end, |s| s * 1_000_000);
                    if t < stop {
                        self.submit(workload, None);
                        let gap = match wl.arrival {
                            Arrival::Poisson => {
                                let u: f64 = self.rng.gen_range(f64::EPSILON..1.0);
                                -u.ln() / wl.rate_per_sec * 1e9
                            }
                            _ => wl.interval_us * 1000.0,
                        };
                        self.at(t + (gap as u64).max(1), Ev::Arrival { workload });
                        self.pump();
                    }
                }
                Ev::Link { index } => self.link_event(index),
                Ev::Timer { at } => {
                    if self.timer_at != Some(at) {
                        continue;
                    }
                    self.timer_at = None;
                    self.dispatch.on_timeout(t, &mut self.host);
                    self.handle_events();
                    self.settle();
                    self.pump();
                }
                Ev::LinkCheck => {
                    self.link_check();
                    self.at(t + link_check, Ev::LinkCheck);
                }
            }
            self.arm();
        }
        Ok(self.report(wall.elapsed()))
    }

    /// Submits one batch for closed-loop submitter `s`.
    fn submit_batch(&mut self, s: usize) {
        let w = self.submitters[s].workload;
        let wl = &self.run.workloads[w];
        if wl.stop_ms.is_some_and(|stop| self.now >= stop * 1_000_000) {
            return;
        }
        self.submitters[s].outstanding = wl.batch;
        self.submitters[s].batch_started = self.now;
        for _ in 0..wl.batch {
            self.submit(w, Some(s));
        }
    }

    fn submit(&mut self, w: usize, submitter: Option<usize>) {
        let wl = &self.run.workloads[w];
        let req = self.requests.insert(Request {
            workload: w,
            submitter,
            len: wl.size,
            done: 0,
            failed: 0,
            submitted: self.now,
        });
        let plan = if wl.is_read() {
            &self.plans.0
        } else {
            &self.plans.1
        };
        let numa_node = wl.numa_node;
        self.submitted = true;
        let slices = plan.slices(wl.size).expect("validated size");
        let priority = wl.priority();
        self.dispatch.on_submit(
            self.now,
            priority,
            slices.map(|s| Piece {
                req,
                len: s.length,
                numa_node,
            }),
        );
    }

    /// Posts what the dispatcher deals.
    fn pump(&mut self) {
        while let Some(post) = self.dispatch.poll_post(self.now, &mut self.host) {
            self.post(post);
        }
        self.host.queued = self.dispatch.depths();
        self.settle();
    }

    fn post(&mut self, post: Post<Piece>) {
        let Post {
            id,
            item,
            rail,
            priority,
            connection,
            ..
        } = post;
        // HIGH spread over the connections (`Spread`) is modelled on the reserved lane: a
        // modelled NIC's lanes share its rate, and the spread buys CPU at the ends, which the
        // model does not count.
        let lane = usize::from(connection == Connection::Shared);
        self.host.last_posted[priority.index()] = Some(self.now);
        let nic = &mut self.nics[rail];
        let len = item.len;
        let token = self.wire.insert(item);
        if !nic.up {
            // Posted into a dead link before the engine noticed: lost.
            let when = nic.detected_at.max(self.now);
            self.at(
                when,
                Ev::Lost {
                    id,
                    token,
                    timeout: false,
                },
            );
            return;
        }
        let start = nic.busy_until[lane].max(self.now);
        let wire_ns = ((len as f64 / nic.bytes_per_ns) as u64).max(nic.op_ns);
        // The other queue's backlog past `start` shares the wire: both run at half rate until
        // the shorter of the two is sent, which delays each by the shorter one's length (the
        // wire still carries exactly both in the time of both).
        let other = nic.busy_until[1 - lane];
        let shared = other.saturating_sub(start).min(wire_ns);
        let done = start + wire_ns + shared;
        nic.busy_until[lane] = done;
        nic.busy_until[1 - lane] = other + shared;
        let answer = done + 2 * nic.latency_ns;
        let generation = nic.generation;
        self.at(
            answer,
            Ev::Answer {
                rail,
                generation,
                id,
                token,
            },
        );
    }

    /// Credits an answered piece to its rail, its sample and its request.
    fn credit(&mut self, rail: usize, piece: &Piece) {
        self.rail_bytes[rail] += piece.len;
        let sample = ((self.now / 1_000_000) / self.run.sample_ms) as usize;
        if let Some(s) = self.samples.get_mut(sample) {
            s[rail] += piece.len;
        }
        if !piece.is_probe() {
            self.finish(piece.req, piece.len, false);
        }
    }

    fn finish(&mut self, req: usize, bytes: u64, failed: bool) {
        let r = self
            .requests
            .get_mut(req)
            .expect("a piece of a finished request came back: a slice was duplicated");
        if failed {
            r.failed += bytes;
        } else {
            r.done += bytes;
        }
        assert!(
            r.done + r.failed <= r.len,
            "request {req} got more bytes than it has: a slice was duplicated"
        );
        if r.done + r.failed < r.len {
            return;
        }
        let r = self.requests.remove(req);
        let class = &mut self.classes[r.workload];
        class.requests += 1;
        class.bytes += r.done;
        if r.failed > 0 {
            class.failed += 1;
        }
        match r.submitter {
            None => {
                let _ = class
                    .latency
                    .record(self.now.saturating_sub(r.submitted).max(1));
            }
            Some(s) => {
                let sub = &mut self.submitters[s];
                sub.outstanding -= 1;
                if sub.outstanding == 0 {
                    let lat = self.now.saturating_sub(sub.batch_started).max(1);
                    let _ = class.latency.record(lat);
                    self.submit_batch(s);
                }
            }
        }
    }

    /// Fails what the dispatcher gave up on.
    fn settle(&mut self) {
        while let Some(f) = self.dispatch.poll_failed() {
            self.finish(f.item.req, f.item.len, true);
        }
    }

    fn handle_events(&mut self) {
        while let Some(e) = self.dispatch.poll_event() {
            match e {
                Event::Silent => {
                    for rail in 0..self.nics.len() {
                        self.drop_rail(rail);
                    }
                }
                Event::DropPath { path, .. } => self.drop_rail(path),
                Event::Probe(p) => {
                    self.probes += 1;
                    let ok = self.nics[p].up;
                    self.dispatch.on_probe(self.now, p, ok);
                    if ok {
                        self.live[p] = self.run.policy.connections_per_rail + 1;
                        self.dispatch.on_path(self.now, p, self.live[p]);
                    }
                }
            }
        }
    }

    /// Closes the connections of `rail` for answering nothing in time: what it holds comes
    /// back as timed out (each slice when its lost answer would have surfaced, the heap not
    /// being searchable; the engine hands them back at once).
    fn drop_rail(&mut self, rail: usize) {
        let nic = &mut self.nics[rail];
        nic.generation += 1;
        nic.detected_at = self.now;
        nic.lost_by_timeout = true;
        nic.busy_until = [self.now; 2];
        self.live[rail] = 0;
        self.dispatch.on_path(self.now, rail, 0);
    }

    fn link_event(&mut self, index: usize) {
        let e = &self.run.events[index];
        let rail = e.rail;
        match e.action.as_str() {
            "fail" => {
                let link_check = self.run.policy.link_check_ms * 1_000_000;
                let nic = &mut self.nics[rail];
                nic.up = false;
                nic.generation += 1;
                nic.busy_until = [self.now; 2];
                nic.lost_by_timeout = false;
                nic.detected_at = self.now.div_ceil(link_check) * link_check;
            }
            "recover" => self.nics[rail].up = true,
            _ => {
                let r = &self.run.rails[rail];
                self.nics[rail].bytes_per_ns = e.gbps * r.efficiency / 8.0;
            }
        }
    }

    /// The engine's link check: a rail whose link is down loses its connections (each a
    /// health error); a healthy rail with its link up gets its connections back.
    fn link_check(&mut self) {
        let conns = self.run.policy.connections_per_rail + 1;
        for rail in 0..self.nics.len() {
            if !self.nics[rail].up {
                if self.live[rail] > 0 {
                    for _ in 0..self.live[rail] {
                        if self.dispatch.on_path_error(self.now, rail) {
                            self.paused += 1;
                        }
                    }
                    self.live[rail] = 0;
                    self.dispatch.on_path(self.now, rail, 0);
                }
            } else if self.live[rail] == 0 && self.dispatch.is_up(rail) {
                self.live[rail] = conns;
                self.dispatch.on_path(self.now, rail, conns);
            }
        }
        self.settle();
        self.pump();
    }

    fn arm(&mut self) {
        if let Some(at) = self.dispatch.poll_timeout() {
            if self.timer_at.is_none_or(|t| at < t) {
                self.timer_at = Some(at);
                self.at(at.max(self.now), Ev::Timer { at });
            }
        }
    }

    fn report(&self, wall: std::time::Duration) -> Report {
        let secs = self.run.duration_ms as f64 / 1000.0;
        let total: u64 = self.rail_bytes.iter().sum();
        let rails = self
            .run
            .rails
            .iter()
            .zip(&self.rail_bytes)
            .zip(self.host.selector.stats())
            .map(|((r, &b), est)| RailReport {
                name: r.name.clone(),
                bytes: b,
                gb_per_s: b as f64 / secs / 1e9,
                estimate_gb_per_s: est.ewma_gbps / 8.0,
            })
            .collect();
        let classes = self
            .run
            .workloads
            .iter()
            .zip(&self.classes)
            .map(|(w, c)| ClassReport {
                workload: w.name.clone(),
                priority: w.priority.clone(),
                requests: c.requests,
                failed: c.failed,
                gb_per_s: c.bytes as f64 / secs / 1e9,
                latency_us: crate::report::Percentiles::of(&c.latency),
            })
            .collect();
        let sample_s = self.run.sample_ms as f64 / 1000.0;
        let timeline: Vec<Sample> = self
            .samples
            .iter()
            .enumerate()
            .map(|(i, s)| Sample {
                t_ms: (i as u64 + 1) * self.run.sample_ms,
                rails_gb_per_s: s.iter().map(|&b| b as f64 / sample_s / 1e9).collect(),
                gb_per_s: s.iter().sum::<u64>() as f64 / sample_s / 1e9,
            })
            .collect();
        let adaptation = self
            .run
            .events
            .iter()
            .filter(|e| e.action == "rate" || e.action == "fail")
            .map(|e| Adaptation::measure(self.run, e, &timeline))
            .collect();
        let unfinished = self.requests.len() as u64;
        Report {
            name: self.run.name.clone(),
            description: self.run.description.clone(),
            simulated_ms: self.run.duration_ms,
            wall_ms: wall.as_secs_f64() * 1e3,
            smart: self.run.policy.enable_smart_scheduling,
            line_rate_gb_per_s: self
                .run
                .rails
                .iter()
                .map(|r| r.gbps * r.efficiency / 8.0)
                .sum(),
            gb_per_s: total as f64 / secs / 1e9,
            slices: self.slices,
            retried: self.retried,
            probes: self.probes,
            rails_paused: self.paused,
            unfinished_requests: unfinished,
            rails,
            classes,
            adaptation,
            timeline,
            nic_numa: self.nics.iter().map(|n| n.numa_node).collect(),
            lanes: None,
            multicast: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::parse_runs;

    fn run(doc: &str) -> Report {
        let runs = parse_runs(doc).expect("scenario parses");
        simulate(&runs[0]).expect("runs")
    }

    #[test]
    fn one_rail_carries_its_line_rate() {
        let r = run(r#"{"name": "one", "duration_ms": 200,
            "rails": [{"name": "r0", "gbps": 100, "latency_us": 5}],
            "workloads": [{"name": "w", "priority": "low", "size": 4194304, "threads": 4, "batch": 4}]}"#);
        let line = 100.0 / 8.0;
        assert!(
            (r.gb_per_s / line - 1.0).abs() < 0.01,
            "{} GB/s of {line}",
            r.gb_per_s
        );
        assert_eq!(r.classes[0].failed, 0);
        // The timeline accounts for every byte.
        let from_timeline: f64 = r.timeline.iter().map(|s| s.gb_per_s).sum::<f64>() * 0.01;
        let total: u64 = r.rails.iter().map(|x| x.bytes).sum();
        assert!((from_timeline - total as f64 / 1e9).abs() < 1e-6);
    }

    #[test]
    fn a_closed_loop_submitter_posts_its_next_batch_when_the_last_finishes() {
        // One submitter of HIGH batches of 16 × 64 KiB on one 2 Gbit/s rail: each batch
        // follows the last at once, as the engine's submitting thread posts it. The model only
        // asked the dispatcher to deal when an answer refilled a window, and the last answer of
        // a batch leaves nothing queued: every next batch waited for a timer, 50 ms, and the
        // rail carried a tenth of its rate.
        for priority in ["high", "low"] {
            let r = run(&format!(
                r#"{{"name": "batches", "duration_ms": 1000,
                "rails": [{{"name": "r0", "gbps": 2, "latency_us": 40}}],
                "workloads": [{{"name": "w", "priority": "{priority}", "size": 65536,
                                "threads": 1, "batch": 16}}]}}"#
            ));
            let line = 2.0 / 8.0;
            assert!(
                r.gb_per_s > 0.9 * line,
                "{priority}: {} GB/s of {line}",
                r.gb_per_s
            );
        }
    }

    #[test]
    fn smart_mode_shares_unequal_rails_by_their_speed() {
        let doc = r#"{"name": "two", "duration_ms": 300,
            "rails": [{"name": "fast", "gbps": 300, "reported_gbps": 100}, {"name": "slow", "gbps": 100}],
            "workloads": [{"name": "w", "priority": "low", "size": 4194304, "threads": 8, "batch": 4}]}"#;
        let r = run(doc);
        let share = r.rails[0].bytes as f64 / (r.rails[0].bytes + r.rails[1].bytes) as f64;
        assert!((share - 0.75).abs() < 0.05, "fast rail carried {share:.3}");
        assert!(r.gb_per_s > 0.9 * 50.0, "{} GB/s", r.gb_per_s);
        // Round-robin deals evenly and is held to twice the slow rail.
        let rr = run(&doc.replace(
            r#""duration_ms": 300,"#,
            r#""duration_ms": 300, "policy": {"enable_smart_scheduling": false},"#,
        ));
        assert!(rr.gb_per_s < 0.55 * 50.0, "{} GB/s", rr.gb_per_s);
    }

    #[test]
    fn a_failed_link_loses_nothing_and_its_rail_comes_back() {
        let r = run(r#"{"name": "fail", "duration_ms": 3000, "sample_ms": 50,
            "rails": [{"name": "a", "gbps": 100}, {"name": "b", "gbps": 100}],
            "policy": {"block_size": 1048576, "health_initial_pause_ms": 1000},
            "workloads": [{"name": "w", "priority": "low", "size": 4194304, "threads": 4, "batch": 4, "stop_ms": 2500}],
            "events": [{"at_ms": 300, "rail": 1, "action": "fail"}, {"at_ms": 800, "rail": 1, "action": "recover"}]}"#);
        assert_eq!(r.classes[0].failed, 0, "no request failed");
        assert_eq!(r.unfinished_requests, 0, "every request finished");
        assert!(r.retried > 0, "slices on the failed link were handed back");
        assert_eq!(r.rails_paused, 1);
        assert!(r.probes >= 1);
        // Down from the failure until the probe after the pause (detected at 300 ms, paused
        // 1 s), carrying again after.
        let rail_b = |t: u64| {
            r.timeline
                .iter()
                .find(|s| s.t_ms == t)
                .unwrap()
                .rails_gb_per_s[1]
        };
        assert_eq!(rail_b(1000), 0.0);
        assert!(rail_b(2000) > 10.0);
    }

    #[test]
    fn high_requests_report_their_own_latency() {
        let r = run(r#"{"name": "q", "duration_ms": 50,
            "rails": [{"name": "a", "gbps": 100, "latency_us": 10}],
            "workloads": [{"name": "h", "priority": "high", "size": 65536, "arrival": "interval", "interval_us": 100}]}"#);
        let c = &r.classes[0];
        assert_eq!(c.requests, 500);
        // 64 KiB at 12.5 GB/s plus two 10 us latencies.
        let expected = 65536.0 / 12.5e3 + 20.0;
        assert!(
            (c.latency_us.p50 - expected).abs() < 1.0,
            "{} vs {expected}",
            c.latency_us.p50
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let doc = r#"{"name": "d", "duration_ms": 100, "seed": 9,
            "rails": [{"name": "a", "gbps": 100}, {"name": "b", "gbps": 50}],
            "workloads": [{"name": "w", "priority": "low", "size": 1048576, "threads": 2, "batch": 2},
                          {"name": "p", "priority": "high", "size": 65536, "arrival": "poisson", "rate_per_sec": 10000}]}"#;
        let (a, b) = (run(doc), run(doc));
        assert_eq!(a.slices, b.slices);
        assert_eq!(a.rails[0].bytes, b.rails[0].bytes);
    }
}
