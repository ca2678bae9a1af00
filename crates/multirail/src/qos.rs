//! The engine's QoS state: promotion settings, engine-wide queue depths, per-priority wait
//! statistics, priority-aware rail filtering, and (when `shared_quota_shm_path` is set) the
//! global time slots shared with other processes on this host.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use multirail_policy::qos::{self as policy, Priority, PromotionConfig, LEVELS};

use crate::config::RdmaConfig;
use crate::error::Result;
use crate::slots::GlobalSlots;

/// How long after its last posted slice a priority still counts as having work: a stream of
/// requests that never queues (each posted at once) is still traffic to make room for.
const ACTIVE_NS: u64 = crate::slots::ACTIVE_NS;

/// Queue statistics of one priority level. Entries are slices on network rails and copy jobs
/// (at most 1 MiB each) on `shm`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PriorityTraffic {
    /// Entries waiting now.
    pub queued: u64,
    /// Entries that left the queue.
    pub dequeued: u64,
    /// Median wait from queueing to posting, microseconds.
    pub wait_p50_us: u64,
    /// 99th-percentile wait, microseconds.
    pub wait_p99_us: u64,
    /// Every recorded wait by bucket: (upper bound in seconds, waits in that bucket and not a
    /// lower one), the last bound infinite. From the same histogram as the percentiles, whose
    /// two significant digits blur a wait near a bound into its neighbour.
    #[serde(skip)]
    pub wait_buckets: Vec<(f64, u64)>,
    /// Sum of every recorded wait, seconds (from the histogram, so within its precision).
    #[serde(skip)]
    pub wait_sum_seconds: f64,
}

/// Upper bounds of the wait buckets, microseconds (then +Inf).
const WAIT_BUCKETS_US: [u64; 12] = [
    10, 50, 100, 500, 1_000, 5_000, 10_000, 50_000, 100_000, 500_000, 1_000_000, 5_000_000,
];

/// Per-bucket counts of `h` at [`WAIT_BUCKETS_US`] and +Inf, bounds in seconds.
fn wait_buckets(h: &hdrhistogram::Histogram<u64>) -> Vec<(f64, u64)> {
    let mut out = Vec::with_capacity(WAIT_BUCKETS_US.len() + 1);
    let mut below = 0;
    for &bound in &WAIT_BUCKETS_US {
        let upto = h.count_between(0, bound);
        out.push((bound as f64 / 1e6, upto.saturating_sub(below)));
        below = upto.max(below);
    }
    out.push((f64::INFINITY, h.len().saturating_sub(below)));
    out
}

/// Queue statistics of every priority level.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct QosTraffic {
    /// HIGH, MEDIUM, LOW.
    pub priorities: [PriorityTraffic; LEVELS],
    /// Entries promoted one level after waiting too long.
    pub promotions: u64,
    /// The global slot now in force (0, 1 or 2), when slots are shared with other processes.
    pub global_slot: Option<u8>,
}

impl QosTraffic {
    /// The priority queues in the style of TENT's traffic report:
    /// `=== Priority Queue Statistics ===`, then per priority
    /// `HIGH: Queued=…, Dequeued=…, Wait p50=… us, p99=… us`, then the promotions and, with
    /// shared slots, the global slot in force.
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let mut out = String::from("=== Priority Queue Statistics ===\n");
        for (name, p) in ["HIGH", "MEDIUM", "LOW"].iter().zip(&self.priorities) {
            let _ = writeln!(
                out,
                "{name}: Queued={}, Dequeued={}, Wait p50={} us, p99={} us",
                p.queued, p.dequeued, p.wait_p50_us, p.wait_p99_us
            );
        }
        let _ = write!(out, "Promotions={}", self.promotions);
        if let Some(slot) = self.global_slot {
            let _ = write!(out, ", Global slot={slot}");
        }
        out.push('\n');
        out
    }
}

/// Moves engine-wide depth counters by one queue's change from `old` to `new`; each queue
/// reports only its own change, so the counters sum every queue without a lock.
fn apply_depth_change(counters: &[AtomicU64; LEVELS], old: [usize; LEVELS], new: [usize; LEVELS]) {
    for ((c, o), n) in counters.iter().zip(old).zip(new) {
        if n > o {
            c.fetch_add((n - o) as u64, Ordering::Relaxed);
        } else if o > n {
            c.fetch_sub((o - n) as u64, Ordering::Relaxed);
        }
    }
}

struct Waits {
    histograms: [hdrhistogram::Histogram<u64>; LEVELS],
    dequeued: [u64; LEVELS],
}

/// QoS state shared by every peer of the engine.
pub(crate) struct Qos {
    pub promotion: PromotionConfig,
    filtering: bool,
    rotation_ns: u64,
    work_conserving: bool,
    /// Slices waiting for network rails.
    queued: [AtomicU64; LEVELS],
    /// When a slice of each priority was last posted to a network rail (ns since `epoch`;
    /// 0 = never).
    last_posted_ns: [AtomicU64; LEVELS],
    /// Copy jobs waiting for the shm workers. Kept apart from the network figures: same-host
    /// copies share no rail with network traffic, so shm HIGH work neither reserves rails nor
    /// holds back bulk on them (here or, through shared slots, in other processes).
    host_queued: [AtomicU64; LEVELS],
    /// When an shm worker last took a MEDIUM or LOW job (ns since `epoch`; 0 = never).
    host_bulk_ns: AtomicU64,
    promotions: AtomicU64,
    waits: Mutex<Waits>,
    global: Option<Arc<GlobalSlots>>,
    /// Set while a slot holds back queued slices: the engine's upkeep thread then pumps when a
    /// slot admitting them begins; otherwise it sleeps, since every wake-up on a busy host can
    /// delay a HIGH slice.
    slot_held: AtomicBool,
    /// The upkeep thread, woken when a slot first holds something back.
    upkeep: std::sync::OnceLock<std::thread::Thread>,
    epoch: Instant,
    /// CLOCK_MONOTONIC at `epoch`, ns: converts our instants to the host-wide clock the shared
    /// slot object uses.
    epoch_monotonic_ns: u64,
}

impl Qos {
    /// Builds the QoS state; attaches to the shared slot object when configured. Fails when that
    /// object cannot be created or mapped.
    pub(crate) fn new(rdma: &RdmaConfig, epoch: Instant) -> Result<Qos> {
        let histogram =
            || hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds");
        let global = if rdma.shared_quota_shm_path.is_empty() {
            None
        } else {
            Some(GlobalSlots::attach(
                &rdma.shared_quota_shm_path,
                rdma.slot_rotation_interval_ms.saturating_mul(1_000_000),
                rdma.qos_work_conserving,
            )?)
        };
        Ok(Qos {
            promotion: rdma.promotion(),
            filtering: rdma.enable_priority_filtering,
            rotation_ns: rdma.local_rotation_interval_us.saturating_mul(1000).max(1),
            work_conserving: rdma.qos_work_conserving,
            queued: Default::default(),
            last_posted_ns: Default::default(),
            host_queued: Default::default(),
            host_bulk_ns: AtomicU64::new(0),
            promotions: AtomicU64::new(0),
            waits: Mutex::new(Waits {
                histograms: [histogram(), histogram(), histogram()],
                dequeued: [0; LEVELS],
            }),
            global,
            slot_held: AtomicBool::new(false),
            upkeep: std::sync::OnceLock::new(),
            epoch,
            epoch_monotonic_ns: crate::slots::monotonic_ns(),
        })
    }

    /// Whether any peer of this engine has slices waiting in its queues.
    pub(crate) fn anything_queued(&self) -> bool {
        self.queued.iter().any(|q| q.load(Ordering::Relaxed) > 0)
    }

    /// Registers the thread to wake when a slot starts holding slices back.
    pub(crate) fn set_upkeep_thread(&self, thread: std::thread::Thread) {
        let _ = self.upkeep.set(thread);
    }

    /// Called by a peer whose queue keeps slices a slot does not admit (after reporting its
    /// depths): wakes the upkeep thread to pump at the next slot change.
    pub(crate) fn slot_holds_work(&self) {
        if !self.slot_held.swap(true, Ordering::AcqRel) {
            if let Some(t) = self.upkeep.get() {
                t.unpark();
            }
        }
    }

    /// For the upkeep thread: while a slot holds queued slices back, how long until a slot that
    /// admits them begins (when it should pump); `None` otherwise. Clears the mark once nothing
    /// is queued; a peer that queues again after that marks it again.
    pub(crate) fn slot_wait(&self) -> Option<std::time::Duration> {
        let g = self.global.as_ref()?;
        if !self.slot_held.load(Ordering::Acquire) {
            return None;
        }
        if !self.anything_queued() {
            self.slot_held.store(false, Ordering::Release);
            // Queued between the check and the clear: its peer's mark may have been lost.
            if !self.anything_queued() {
                return None;
            }
            self.slot_held.store(true, Ordering::Release);
        }
        // Slot 2 admits everything; MEDIUM also goes in slot 1. A little past the boundary,
        // so the pump finds the new slot in force.
        let medium = self.queued[Priority::Medium.index()].load(Ordering::Relaxed) > 0;
        let mut wait = g.until_slot(2);
        if medium {
            wait = wait.min(g.until_slot(1));
        }
        Some(wait + std::time::Duration::from_micros(20))
    }

    /// Records a change of a peer's queue depths from `old` to `new`.
    pub(crate) fn depths_changed(&self, old: [usize; LEVELS], new: [usize; LEVELS]) {
        apply_depth_change(&self.queued, old, new);
        if let Some(g) = &self.global {
            g.publish_queued(
                self.queued[0].load(Ordering::Relaxed),
                self.queued[1].load(Ordering::Relaxed),
            );
        }
    }

    /// Records a change of the shm copy queue's depths from `old` to `new`.
    pub(crate) fn host_depths_changed(&self, old: [usize; LEVELS], new: [usize; LEVELS]) {
        apply_depth_change(&self.host_queued, old, new);
    }

    /// Records that an shm copy job of `priority` left the queue at `now` after `waited_ns`:
    /// wait statistics, and for MEDIUM and LOW that bulk is moving on this host.
    pub(crate) fn host_dequeued(&self, priority: Priority, waited_ns: u64, now: Instant) {
        let p = priority.index();
        if priority.is_bulk() {
            let now_ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
            self.host_bulk_ns.store(now_ns.max(1), Ordering::Relaxed);
        }
        self.record_wait(p, waited_ns);
    }

    fn record_wait(&self, p: usize, waited_ns: u64) {
        let mut w = self.waits.lock().expect("qos poisoned");
        w.histograms[p].saturating_record((waited_ns / 1000).max(1));
        w.dequeued[p] += 1;
    }

    /// Records promotions of `n` queued entries.
    pub(crate) fn promoted(&self, n: u64) {
        self.promotions.fetch_add(n, Ordering::Relaxed);
    }

    /// Records that a slice of `priority` left the queue at `now` after `waited_ns`.
    pub(crate) fn dequeued(&self, priority: Priority, waited_ns: u64, now: Instant) {
        let p = priority.index();
        let now_ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        self.last_posted_ns[p].store(now_ns.max(1), Ordering::Relaxed);
        if let Some(g) = &self.global {
            g.note_posted(priority, self.epoch_monotonic_ns + now_ns);
        }
        self.record_wait(p, waited_ns);
    }

    /// Whether `priority` has work anywhere in the engine at `now`, or, with shared slots, in
    /// any process attached to them: some of it queued, or some posted within the last
    /// [`ACTIVE_NS`]. So bulk in one process makes room for another process's HIGH stream.
    pub(crate) fn has_work(&self, priority: Priority, now: Instant) -> bool {
        let p = priority.index();
        let now_ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        let last = self.last_posted_ns[p].load(Ordering::Relaxed);
        self.queued[p].load(Ordering::Relaxed) > 0
            || (last > 0 && now_ns.saturating_sub(last) < ACTIVE_NS)
            || self.global.as_ref().is_some_and(|g| g.has_work(priority))
    }

    /// Whether bulk bytes are moving at `now`: MEDIUM or LOW work in this engine, or in a process
    /// sharing its slots, that the current slot lets post, or shm copies of MEDIUM or LOW jobs.
    /// The host's cores are then busy; while a slot holds the bulk back they are idle, however
    /// much of it waits.
    pub(crate) fn bulk_moving(&self, now: Instant) -> bool {
        let now_ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        let host_bulk = self.host_bulk_ns.load(Ordering::Relaxed);
        if self.host_queued[1..]
            .iter()
            .any(|q| q.load(Ordering::Relaxed) > 0)
            || (host_bulk > 0 && now_ns.saturating_sub(host_bulk) < ACTIVE_NS)
        {
            return true;
        }
        let Some(g) = &self.global else {
            return self.has_work(policy::MEDIUM, now) || self.has_work(policy::LOW, now);
        };
        let (medium, low) = (g.admits(policy::MEDIUM), g.admits(policy::LOW));
        (medium && self.has_work(policy::MEDIUM, now))
            || (low && self.has_work(policy::LOW, now))
            || ((medium || low) && g.bulk_active())
    }

    /// True when slots are shared with other processes.
    #[cfg(test)]
    pub(crate) fn shares_slots(&self) -> bool {
        self.global.is_some()
    }

    /// Whether the global slot lets `priority` post now (always, without shared slots).
    pub(crate) fn slot_admits(&self, priority: Priority) -> bool {
        match &self.global {
            Some(g) => g.admits(priority),
            None => true,
        }
    }

    /// Whether rail `rail` of `rails` may carry `priority` at `now`.
    pub(crate) fn rail_admits(
        &self,
        now: Instant,
        rail: usize,
        rails: usize,
        priority: Priority,
    ) -> bool {
        if !self.filtering {
            return true;
        }
        let step = now.saturating_duration_since(self.epoch).as_nanos() as u64 / self.rotation_ns;
        let waiting = [
            self.has_work(Priority::High, now),
            self.has_work(Priority::Medium, now),
        ];
        policy::rail_admits(step, rail, rails, priority, waiting, self.work_conserving)
    }

    /// Current statistics.
    pub(crate) fn snapshot(&self) -> QosTraffic {
        let w = self.waits.lock().expect("qos poisoned");
        let mut out = QosTraffic {
            promotions: self.promotions.load(Ordering::Relaxed),
            global_slot: self.global.as_ref().map(|g| g.current_slot()),
            ..Default::default()
        };
        for p in 0..LEVELS {
            out.priorities[p] = PriorityTraffic {
                queued: self.queued[p].load(Ordering::Relaxed)
                    + self.host_queued[p].load(Ordering::Relaxed),
                dequeued: w.dequeued[p],
                wait_p50_us: w.histograms[p].value_at_quantile(0.5),
                wait_p99_us: w.histograms[p].value_at_quantile(0.99),
                wait_buckets: wait_buckets(&w.histograms[p]),
                wait_sum_seconds: w.histograms[p].mean() * w.histograms[p].len() as f64 / 1e6,
            };
        }
        out
    }
}

#[cfg(test)]
mod tests {
    //! TENT's three QoS example configurations, loaded as written (each with its own
    //! shared-memory name, so tests do not share one object) and run.

    use super::*;
    use crate::config::Config;
    use std::time::Duration;

    fn qos_from(doc: &str, tag: &str) -> (Qos, String) {
        let path = format!("/multirail-qos-example-{tag}-{}", std::process::id());
        let doc = doc.replace("/mooncake_rdma_slots", &path);
        let config = Config::from_json_str(&doc, "TENT example").expect("TENT's example loads");
        let qos = Qos::new(&config.transports.rdma, Instant::now()).expect("qos starts");
        (qos, path)
    }

    /// Samples the global slot for `span`; returns (mean time a slot lasted, share of samples
    /// in which LOW could post).
    fn watch(qos: &Qos, span: Duration) -> (Duration, f64) {
        let start = Instant::now();
        let (mut samples, mut low, mut changes) = (0u32, 0u32, 0u32);
        let mut last = None;
        while start.elapsed() < span {
            let slot = qos.global.as_ref().expect("shared slots").current_slot();
            changes += u32::from(last.is_some_and(|l| l != slot));
            last = Some(slot);
            samples += 1;
            low += u32::from(qos.slot_admits(policy::LOW));
            std::thread::sleep(Duration::from_micros(100));
        }
        (span / changes.max(1), f64::from(low) / f64::from(samples))
    }

    const EXAMPLE_1: &str = r#"{"transports": {"rdma": {"enable_priority_filtering": true,
        "slot_rotation_interval_ms": 1, "shared_quota_shm_path": "/mooncake_rdma_slots"}}}"#;
    const EXAMPLE_2: &str = r#"{"transports": {"rdma": {"enable_priority_filtering": true,
        "shared_quota_shm_path": ""}}}"#;
    const EXAMPLE_3: &str = r#"{"transports": {"rdma": {"slot_rotation_interval_ms": 10,
        "shared_quota_shm_path": "/mooncake_rdma_slots"}}}"#;

    #[test]
    fn example_1_latency_critical_gives_high_a_window_of_its_own_every_few_ms() {
        let (qos, path) = qos_from(EXAMPLE_1, "latency");
        assert!(qos.shares_slots());
        // A HIGH stream is posting: LOW may post only in slot 2, a third of the time.
        let keep_posting = |q: &Qos| q.dequeued(policy::HIGH, 0, Instant::now());
        keep_posting(&qos);
        std::thread::sleep(Duration::from_millis(3));
        let start = Instant::now();
        let (mut samples, mut low) = (0u32, 0u32);
        while start.elapsed() < Duration::from_millis(60) {
            keep_posting(&qos);
            samples += 1;
            low += u32::from(qos.slot_admits(policy::LOW));
            assert!(qos.slot_admits(policy::HIGH), "HIGH posts in every slot");
            std::thread::sleep(Duration::from_micros(100));
        }
        let share = f64::from(low) / f64::from(samples);
        assert!(
            (0.1..0.6).contains(&share),
            "LOW admitted in {share:.2} of samples"
        );
        let (dwell, _) = watch(&qos, Duration::from_millis(60));
        assert!(
            dwell < Duration::from_millis(4),
            "1 ms slots lasted {dwell:?} on average"
        );
        drop(qos);
        crate::slots::unlink(&path);
    }

    #[test]
    fn example_2_single_process_has_no_cross_process_slots() {
        let (qos, _) = qos_from(EXAMPLE_2, "single");
        assert!(!qos.shares_slots());
        qos.dequeued(policy::HIGH, 0, Instant::now());
        for p in [policy::HIGH, policy::MEDIUM, policy::LOW] {
            assert!(
                qos.slot_admits(p),
                "priority {p} is never held back by a slot"
            );
        }
        assert_eq!(qos.snapshot().global_slot, None);
    }

    #[test]
    fn example_3_bulk_friendly_slots_last_ten_times_longer() {
        let (qos, path) = qos_from(EXAMPLE_3, "bulk");
        assert!(qos.shares_slots());
        let (dwell, low) = watch(&qos, Duration::from_millis(100));
        assert!(
            dwell >= Duration::from_millis(6),
            "10 ms slots lasted {dwell:?} on average"
        );
        // Nobody has HIGH or MEDIUM work: work-conserving slots admit LOW throughout.
        assert_eq!(low, 1.0);
        drop(qos);
        crate::slots::unlink(&path);
    }
}
