//! One member of an `mcast-bench` run, the same code in the parent and in every child: joins
//! the group, sends (if it is a sender) from its own thread while the calling thread receives,
//! checks every delivered message, and reports.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use hdrhistogram::serialization::{Serializer, V2Serializer};
use hdrhistogram::Histogram;
use multirail::{Engine, Group, GroupConfig, GroupStats};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use super::payload::{self, Parsed, Pool, Sizes};
use super::{mono_ns, sleep_until_ns};

/// When and how much one member sends, fixed by the parent once every member joined.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Sending starts (monotonic ns).
    pub t_start: u64,
    /// Messages stamped from here on are measured (monotonic ns).
    pub t_warm: u64,
    /// Sending stops (monotonic ns); `None` when a message count bounds the run.
    pub t_end: Option<u64>,
    /// Messages this member sends when a count bounds the run.
    pub quota: Option<u64>,
    /// Messages per second this member sends; `None`: as fast as the window allows.
    pub rate: Option<f64>,
    /// This member sends no data, only its end marker once the run ends.
    pub idle: bool,
    /// How long nothing may arrive before the run is given up (the group's own failure
    /// detection normally answers first).
    pub stall_limit: Duration,
}

/// The group counters of a member, as reported.
#[derive(Serialize, Deserialize, Debug, Clone, Default)]
pub struct StatsReport {
    pub sent: u64,
    pub delivered: u64,
    pub pushes: u64,
    pub data_writes: u64,
    pub counter_writes: u64,
    pub ack_writes: u64,
    pub heartbeat_writes: u64,
    pub window_stalls: u64,
    pub null_records: u64,
}

impl From<GroupStats> for StatsReport {
    fn from(s: GroupStats) -> Self {
        StatsReport {
            sent: s.sent,
            delivered: s.delivered,
            pushes: s.pushes,
            data_writes: s.data_writes,
            counter_writes: s.counter_writes,
            ack_writes: s.ack_writes,
            heartbeat_writes: s.heartbeat_writes,
            window_stalls: s.window_stalls,
            null_records: s.null_records,
        }
    }
}

/// What a member reports at the end of a run.
#[derive(Serialize, Deserialize, Debug, Clone, Default)]
pub struct MemberReport {
    /// Member index.
    pub member: usize,
    /// Its segment name.
    pub name: String,
    /// Data messages it sent (its end marker not counted).
    pub sent: u64,
    /// Data messages delivered to it, per sender rank.
    pub delivered: Vec<u64>,
    /// Delivered messages stamped inside the measured window.
    pub measured: u64,
    /// The measured window's length: the sending time after warm-up, or with a message count,
    /// from the start to the last delivery.
    pub window_ns: u64,
    /// Send-to-delivery latency of the measured messages, as an hdrhistogram V2 blob in hex.
    pub latency: String,
    pub p50_ns: u64,
    pub p99_ns: u64,
    /// Delivered messages that were not what had to come next from their sender.
    pub verify_errors: u64,
    pub first_verify_error: Option<String>,
    /// xxh3 of the delivery sequence (sender rank, sequence number, length of each message).
    pub order_hash: String,
    /// The group's counters at the end (after `leave`, or when it failed).
    pub stats: StatsReport,
    /// The first error the member met (a failed member, a stall), and when (monotonic ns).
    pub failure: Option<String>,
    pub failure_at_ns: Option<u64>,
}

/// Fixed facts of the run every member shares.
pub struct Run<'a> {
    pub sizes: Sizes,
    /// Members that send (the first `senders` members).
    pub senders: usize,
    pub names: &'a [String],
    pub me: usize,
}

/// Joins the group; returns it or the error text.
pub fn join(engine: &Engine, config: GroupConfig) -> Result<Group, String> {
    engine.join_group(config).map_err(|e| e.to_string())
}

/// The first failure of a member, with the time it was seen.
#[derive(Default)]
struct FirstFailure(Mutex<Option<(String, u64)>>);

impl FirstFailure {
    fn set(&self, what: String) {
        let mut f = self.0.lock().expect("failure poisoned");
        if f.is_none() {
            *f = Some((what, mono_ns()));
        }
    }

    fn take(&self) -> Option<(String, u64)> {
        self.0.lock().expect("failure poisoned").take()
    }
}

/// Runs this member's part of the run on a joined group and reports. `delivered` counts
/// delivered messages as they arrive (for a progress bar). Returns the group too when it
/// failed (a group that did not fail is left): a member whose group failed keeps it until
/// the run ends, or the others, not all of which have seen the failure yet, would see this
/// one drop its table and name it instead of the member that failed.
pub fn run(
    group: Group,
    run: &Run<'_>,
    plan: Plan,
    delivered: &AtomicU64,
) -> (MemberReport, Option<Group>) {
    let pool = Pool::new(run.sizes.max.max(payload::MARKER_BYTES));
    let failure = FirstFailure::default();
    let sent = AtomicU64::new(0);
    let rank = (run.me < run.senders).then_some(run.me);
    let mut tally = Tally::new(run.senders);
    thread::scope(|scope| {
        if let Some(rank) = rank {
            let (group, pool, failure, sent) = (&group, &pool, &failure, &sent);
            scope.spawn(
                move || match send_all(group, pool, &run.sizes, rank, &plan) {
                    Ok(n) => sent.store(n, Ordering::Relaxed),
                    Err(e) => failure.set(e),
                },
            );
        }
        if let Err(e) = tally.receive(&group, &pool, run, &plan, delivered) {
            failure.set(e);
        }
    });
    let mut report = tally.report(run, &plan);
    report.sent = sent.load(Ordering::Relaxed);
    let failed = failure.take();
    let mut kept = None;
    report.stats = match failed {
        None => match group.leave() {
            Ok(s) => s.into(),
            Err(e) => {
                report.failure = Some(e.to_string());
                report.failure_at_ns = Some(mono_ns());
                StatsReport::default()
            }
        },
        Some((what, at)) => {
            report.failure = Some(what);
            report.failure_at_ns = Some(at);
            let stats = group.stats().into();
            kept = Some(group);
            stats
        }
    };
    (report, kept)
}

/// Sends this member's messages, then its end marker, then flushes. Returns how many data
/// messages it sent, or the first error.
fn send_all(
    group: &Group,
    pool: &Pool,
    sizes: &Sizes,
    rank: usize,
    plan: &Plan,
) -> Result<u64, String> {
    sleep_until_ns(plan.t_start);
    if plan.idle {
        sleep_until_ns(plan.t_end.unwrap_or(0));
    }
    let interval = plan.rate.map(|r| 1e9 / r);
    let mut seq = 0u64;
    loop {
        if plan.idle || plan.quota.is_some_and(|q| seq >= q) {
            break;
        }
        let now = mono_ns();
        if plan.t_end.is_some_and(|e| now >= e) {
            break;
        }
        if let Some(iv) = interval {
            let due = plan.t_start + (seq as f64 * iv) as u64;
            if due > now {
                sleep_until_ns(plan.t_end.map_or(due, |e| due.min(e)));
                continue;
            }
        }
        let len = sizes.len_of(rank, seq);
        group
            .send_with(len, |slot| pool.fill(slot, rank, seq, mono_ns()))
            .map_err(|e| e.to_string())?;
        seq += 1;
    }
    group
        .send_with(payload::MARKER_BYTES, |slot| {
            payload::fill_marker(slot, seq)
        })
        .and_then(|_| group.flush())
        .map_err(|e| e.to_string())?;
    Ok(seq)
}

/// What the receiving side counted.
struct Tally {
    delivered: Vec<u64>,
    markers: Vec<Option<u64>>,
    measured: u64,
    hist: Histogram<u64>,
    verify_errors: u64,
    first_verify_error: Option<String>,
    order: Xxh3,
    last_delivery_ns: u64,
}

impl Tally {
    fn new(senders: usize) -> Tally {
        Tally {
            delivered: vec![0; senders],
            markers: vec![None; senders],
            measured: 0,
            hist: Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds"),
            verify_errors: 0,
            first_verify_error: None,
            order: Xxh3::new(),
            last_delivery_ns: 0,
        }
    }

    fn verify_error(&mut self, e: String) {
        self.verify_errors += 1;
        if self.first_verify_error.is_none() {
            self.first_verify_error = Some(e);
        }
    }

    /// Receives until every sender's end marker arrived. Fails with the group's error, or when
    /// nothing arrived for the stall limit.
    fn receive(
        &mut self,
        group: &Group,
        pool: &Pool,
        run: &Run<'_>,
        plan: &Plan,
        delivered: &AtomicU64,
    ) -> Result<(), String> {
        let mut last_progress = Instant::now();
        while self.markers.iter().any(Option::is_none) {
            let m = match group.recv(Some(Duration::from_millis(100))) {
                Ok(Some(m)) => m,
                Ok(None) => {
                    if last_progress.elapsed() >= plan.stall_limit {
                        let missing: Vec<String> = (0..run.senders)
                            .filter(|&r| self.markers[r].is_none())
                            .map(|r| run.names[r].clone())
                            .collect();
                        return Err(format!(
                            "nothing delivered for {:.1} s; still waiting for the end of {}",
                            plan.stall_limit.as_secs_f64(),
                            missing.join(", ")
                        ));
                    }
                    continue;
                }
                Err(e) => return Err(e.to_string()),
            };
            let now = mono_ns();
            last_progress = Instant::now();
            let Some(rank) = run.names[..run.senders]
                .iter()
                .position(|n| **n == *m.sender)
            else {
                self.verify_error(format!("a message from {}, not a sender", m.sender));
                continue;
            };
            let seq = self.delivered[rank];
            match payload::check(pool, &run.sizes, rank, seq, &m.bytes) {
                Ok(Parsed::Data { stamp }) => {
                    self.delivered[rank] += 1;
                    delivered.fetch_add(1, Ordering::Relaxed);
                    self.last_delivery_ns = now;
                    self.order.update(&(rank as u32).to_le_bytes());
                    self.order.update(&seq.to_le_bytes());
                    self.order.update(&(m.bytes.len() as u32).to_le_bytes());
                    if stamp >= plan.t_warm && plan.t_end.is_none_or(|e| stamp < e) {
                        self.measured += 1;
                        self.hist
                            .saturating_record(now.saturating_sub(stamp).max(1));
                    }
                }
                Ok(Parsed::Marker { sent }) => {
                    if self.markers[rank].is_some() {
                        self.verify_error(format!("sender {rank}: a second end marker"));
                    }
                    self.markers[rank] = Some(sent);
                    if sent != seq {
                        self.verify_error(format!(
                            "sender {rank} sent {sent} messages, {seq} were delivered here"
                        ));
                    }
                }
                Err(e) => {
                    self.delivered[rank] += 1;
                    self.verify_error(e);
                }
            }
        }
        Ok(())
    }

    fn report(&self, run: &Run<'_>, plan: &Plan) -> MemberReport {
        let window_ns = match plan.t_end {
            Some(e) => e.saturating_sub(plan.t_warm),
            None => self.last_delivery_ns.saturating_sub(plan.t_start),
        };
        let mut blob = Vec::new();
        V2Serializer::new()
            .serialize(&self.hist, &mut blob)
            .expect("serializing into memory");
        let q = |q: f64| {
            if self.hist.is_empty() {
                0
            } else {
                self.hist.value_at_quantile(q)
            }
        };
        MemberReport {
            member: run.me,
            name: run.names[run.me].clone(),
            sent: 0,
            delivered: self.delivered.clone(),
            measured: self.measured,
            window_ns,
            latency: hex(&blob),
            p50_ns: q(0.5),
            p99_ns: q(0.99),
            verify_errors: self.verify_errors,
            first_verify_error: self.first_verify_error.clone(),
            order_hash: format!("{:016x}", self.order.digest()),
            stats: StatsReport::default(),
            failure: None,
            failure_at_ns: None,
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads back a histogram [`MemberReport::latency`] holds; `None` when it is malformed.
pub fn histogram(hex_blob: &str) -> Option<Histogram<u64>> {
    use hdrhistogram::serialization::Deserializer;
    if !hex_blob.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex_blob.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex_blob.get(i..i + 2)?, 16).ok())
        .collect();
    Deserializer::new().deserialize(&mut bytes?.as_slice()).ok()
}
