//! Scenario files: the modelled host (rails), the policy settings, the workloads, the link
//! events, and the runs to compare; or, for a lanes scenario ([`LanesScenario`], key `lanes`),
//! the processes, their traffic and the usage-tracker and lane-negotiation settings.
//!
//! A file is one JSON document. `runs` lists variants of it: each run is a partial scenario
//! deep-merged into the base (so `{"name": "round-robin", "policy": {"enable_smart_scheduling":
//! false}}` changes one key). Policy keys carry the engine's configuration names, and their
//! defaults are the policy crate's, mapped to the policy structs in [`Policy`] only.
//!
//! Every count, size and duration key has a range, stated in its documentation and checked by
//! [`parse_runs`], which names the key of a value outside it. The ranges leave room far past
//! any real host or group, and keep a run's memory bounded: past them the simulator would
//! allocate more than a host has (a timeline of millions of samples per rail, a million
//! requests in flight) or spend hours on one run (200,000 rails, a million-member group).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use multirail_policy::dispatch::{
    BdpController, ControllerKind, DispatchConfig, FixedController, DEFAULT_HIGH_WAIT_NS,
    DEFAULT_MIN_BULK_CHUNK,
};
use multirail_policy::health::HealthConfig;
use multirail_policy::lanes::{LanesConfig, LanesError};
use multirail_policy::qos::{Priority, PromotionConfig};
use multirail_policy::selector::{BandwidthEstimator, SelectorConfig};
use multirail_policy::slicing::{
    SlicePlan, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SLICES, DEFAULT_MAX_SLICES_WRITE,
};
use multirail_policy::usage::UsageConfig;

/// A scenario error: the key (dotted path) and what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioError {
    /// Dotted path of the offending key ("" for the document as a whole).
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "scenario key {}: {}", self.key, self.message)
        }
    }
}

impl std::error::Error for ScenarioError {}

fn bad(key: impl Into<String>, message: impl Into<String>) -> ScenarioError {
    ScenarioError {
        key: key.into(),
        message: message.into(),
    }
}

/// One run of a scenario: everything the simulator needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Run {
    /// Name of the scenario (and, after merging, of the run).
    pub name: String,
    /// What the scenario shows.
    #[serde(default)]
    pub description: String,
    /// Simulated time, milliseconds: 1 to 3,600,000 (an hour; [`MAX_DURATION_MS`]).
    pub duration_ms: u64,
    /// Width of a throughput sample (timeline and plot), milliseconds (default 10): 1 to
    /// `duration_ms`'s maximum, and at most [`MAX_SAMPLES`] samples in a run (at most
    /// [`MAX_TIMELINE_CELLS`] samples × rails in a rails scenario).
    #[serde(default = "default_sample_ms")]
    pub sample_ms: u64,
    /// Seed of the selector's jitter and of Poisson arrivals.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// The initiator's NICs; the target reaches each (one path per rail): 1 to 256
    /// ([`MAX_RAILS`]). Required unless the scenario is a lanes or multicast scenario, which
    /// has none.
    #[serde(default)]
    pub rails: Vec<Rail>,
    /// Policy settings.
    #[serde(default)]
    pub policy: Policy,
    /// Who submits what: 1 to 256 workloads ([`MAX_WORKLOADS`]). Required unless the scenario
    /// is a lanes or multicast scenario, which has none.
    #[serde(default)]
    pub workloads: Vec<Workload>,
    /// Link changes during the run: at most 100,000 ([`MAX_EVENTS`]).
    #[serde(default)]
    pub events: Vec<LinkEvent>,
    /// A lanes scenario instead of rails and workloads: processes negotiating dedicated
    /// lanes ([`LanesScenario`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lanes: Option<LanesScenario>,
    /// A group multicast scenario instead of rails and workloads ([`MulticastScenario`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multicast: Option<MulticastScenario>,
    /// Variants to run (only in the file's base document): at most 256 ([`MAX_RUNS`]).
    #[serde(default, skip_serializing)]
    pub runs: Vec<Value>,
}

fn default_sample_ms() -> u64 {
    10
}

fn default_seed() -> u64 {
    1
}

/// A modelled NIC.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rail {
    /// Name shown in reports.
    pub name: String,
    /// Line rate, Gbit/s: 0.001 to 1,000,000.
    pub gbps: f64,
    /// What the NIC reports to the selector, Gbit/s (default: `gbps`): 0.001 to 1,000,000. A
    /// veth shaped by tc reports 10 whatever its shaping.
    #[serde(default)]
    pub reported_gbps: Option<f64>,
    /// One-way latency, microseconds (default 2): 0 to 1,000,000 (a second).
    #[serde(default = "default_latency_us")]
    pub latency_us: f64,
    /// Message-rate limit, operations per second (0 = none, else 1 to 10^12).
    #[serde(default)]
    pub ops_per_sec: f64,
    /// NUMA node of the NIC (default 0).
    #[serde(default)]
    pub numa_node: i32,
    /// Payload bytes per byte on the wire (default 1; TCP over 1500-byte Ethernet frames
    /// carries 1448 of every 1514): 0.01 to 1.
    #[serde(default = "one")]
    pub efficiency: f64,
}

fn default_latency_us() -> f64 {
    2.0
}

fn one() -> f64 {
    1.0
}

/// Settings of the policy structs, by the engine's configuration names.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// Selector (`transports.rdma.*`, TENT's keys).
    pub enable_smart_scheduling: bool,
    /// See `SelectorConfig::numa_penalties`.
    pub numa_penalties: Vec<f64>,
    /// See `SelectorConfig::bandwidth_learning_rate`.
    pub bandwidth_learning_rate: f64,
    /// See `SelectorConfig::ewma_min_bandwidth_multiplier`.
    pub ewma_min_bandwidth_multiplier: f64,
    /// See `SelectorConfig::ewma_max_bandwidth_multiplier`.
    pub ewma_max_bandwidth_multiplier: f64,
    /// See `SelectorConfig::score_jitter_range`.
    pub score_jitter_range: f64,
    /// See `SelectorConfig::default_bandwidth_gbps`.
    pub default_bandwidth_gbps: f64,
    /// See `SelectorConfig::min_bandwidth_gbps`.
    pub min_bandwidth_gbps: f64,
    /// See `SelectorConfig::max_bandwidth_gbps`.
    pub max_bandwidth_gbps: f64,
    /// The engine's `transports.rdma.bandwidth_sample_min_us`: 0 to 1,000,000.
    pub bandwidth_sample_min_us: u64,
    /// The engine's `transports.rdma.bandwidth_sample_min_bytes`: 0 to 1 GiB.
    pub bandwidth_sample_min_bytes: u64,
    /// The engine's `transports.rdma.bandwidth_estimator`: `delivery` or `tent`.
    pub bandwidth_estimator: String,
    /// The engine's `transports.rdma.bandwidth_window_us`: 0 to 10,000,000.
    pub bandwidth_window_us: u64,
    /// Promotion (`priority_promotion_timeout_us`, `priority_promotion_check_us`): each 1 to
    /// 3,600,000,000 (an hour).
    pub priority_promotion_timeout_us: u64,
    /// See above.
    pub priority_promotion_check_us: u64,
    /// `qos_promote_only_when_starved`.
    pub qos_promote_only_when_starved: bool,
    /// Slicing (`workers.*`): 1 to 67,108,864 (64 MiB, the engine's largest).
    pub block_size: u64,
    /// `workers.max_slices_per_request` (READ): 1 to 65,536.
    pub max_slices_per_request: u32,
    /// `workers.max_slices_per_write`: 1 to 65,536.
    pub max_slices_per_write: u32,
    /// Window controller (`workers.window.*`): `bdp` or `fixed`.
    pub window_controller: String,
    /// `workers.window.bdps`.
    pub window_bdps: f64,
    /// `workers.window.lean_bdps`.
    pub window_lean_bdps: f64,
    /// `workers.window.max_queue_us`: 1 to 1,000,000, as the engine takes it.
    pub window_max_queue_us: u64,
    /// `workers.window.initial_bytes`: 4096 to 1,073,741,824 (1 GiB), as the engine takes it.
    pub window_initial_bytes: u64,
    /// `workers.window.fixed_bytes`: 4096 to 1,073,741,824 (1 GiB), as the engine takes it.
    pub window_fixed_bytes: u64,
    /// `workers.bulk_chunk_wait_us`: 1 to 1,000,000, as the engine takes it.
    pub bulk_chunk_wait_us: u64,
    /// `workers.min_bulk_chunk`: 4096 to 67,108,864 (64 MiB), as the engine takes it.
    pub min_bulk_chunk: u64,
    /// `transports.tcp.timeout_ms`: 1 to 3,600,000.
    pub timeout_ms: u64,
    /// `transports.tcp.max_retries`: 0 to 1000.
    pub max_retries: u32,
    /// `transports.tcp.connections_per_rail` (a path has one more, for HIGH): 1 to 64, as the
    /// engine takes it.
    pub connections_per_rail: usize,
    /// Rail health: errors that pause a rail, 1 to 1,000,000.
    pub health_error_threshold: u32,
    /// Rail health: first pause, ms, 1 to 3,600,000.
    pub health_initial_pause_ms: u64,
    /// Rail health: longest pause, ms, 1 to 3,600,000.
    pub health_max_pause_ms: u64,
    /// The engine's link check interval (link state, reconnects), ms (50): 1 to 3,600,000.
    pub link_check_ms: u64,
}

impl Default for Policy {
    fn default() -> Self {
        let sel = SelectorConfig::default();
        let promo = PromotionConfig::default();
        let bdp = BdpController::default();
        let health = HealthConfig::default();
        Policy {
            enable_smart_scheduling: sel.enable_smart_scheduling,
            numa_penalties: sel.numa_penalties,
            bandwidth_learning_rate: sel.bandwidth_learning_rate,
            ewma_min_bandwidth_multiplier: sel.ewma_min_bandwidth_multiplier,
            ewma_max_bandwidth_multiplier: sel.ewma_max_bandwidth_multiplier,
            score_jitter_range: sel.score_jitter_range,
            default_bandwidth_gbps: sel.default_bandwidth_gbps,
            min_bandwidth_gbps: sel.min_bandwidth_gbps,
            max_bandwidth_gbps: sel.max_bandwidth_gbps,
            bandwidth_sample_min_us: sel.min_sample_ns / 1000,
            bandwidth_sample_min_bytes: sel.min_sample_bytes,
            bandwidth_estimator: sel.estimator.name().into(),
            bandwidth_window_us: sel.bandwidth_window_ns / 1000,
            priority_promotion_timeout_us: promo.timeout_ns / 1000,
            priority_promotion_check_us: promo.check_ns / 1000,
            qos_promote_only_when_starved: promo.only_when_starved,
            block_size: DEFAULT_BLOCK_SIZE,
            max_slices_per_request: DEFAULT_MAX_SLICES,
            max_slices_per_write: DEFAULT_MAX_SLICES_WRITE,
            window_controller: "bdp".into(),
            window_bdps: bdp.window_bdps,
            window_lean_bdps: bdp.lean_bdps,
            window_max_queue_us: bdp.max_queue_ns / 1000,
            window_initial_bytes: bdp.initial_window,
            window_fixed_bytes: 4 << 20,
            bulk_chunk_wait_us: DEFAULT_HIGH_WAIT_NS / 1000,
            min_bulk_chunk: DEFAULT_MIN_BULK_CHUNK,
            timeout_ms: 5000,
            max_retries: 8,
            connections_per_rail: 2,
            health_error_threshold: health.error_threshold,
            health_initial_pause_ms: health.initial_pause_ns / 1_000_000,
            health_max_pause_ms: health.max_pause_ns / 1_000_000,
            link_check_ms: 50,
        }
    }
}

impl Policy {
    /// The selector settings.
    pub fn selector(&self) -> SelectorConfig {
        SelectorConfig {
            enable_smart_scheduling: self.enable_smart_scheduling,
            numa_penalties: self.numa_penalties.clone(),
            bandwidth_learning_rate: self.bandwidth_learning_rate,
            ewma_min_bandwidth_multiplier: self.ewma_min_bandwidth_multiplier,
            ewma_max_bandwidth_multiplier: self.ewma_max_bandwidth_multiplier,
            score_jitter_range: self.score_jitter_range,
            default_bandwidth_gbps: self.default_bandwidth_gbps,
            min_bandwidth_gbps: self.min_bandwidth_gbps,
            max_bandwidth_gbps: self.max_bandwidth_gbps,
            min_sample_ns: self.bandwidth_sample_min_us.saturating_mul(1000),
            min_sample_bytes: self.bandwidth_sample_min_bytes,
            // Validation refuses any other name.
            estimator: BandwidthEstimator::from_name(&self.bandwidth_estimator).unwrap_or_default(),
            bandwidth_window_ns: self.bandwidth_window_us.saturating_mul(1000),
            ..SelectorConfig::default()
        }
    }

    /// The dispatcher settings.
    pub fn dispatch(&self) -> DispatchConfig {
        let controller = if self.window_controller == "fixed" {
            ControllerKind::Fixed(FixedController {
                bytes: self.window_fixed_bytes,
            })
        } else {
            ControllerKind::Bdp(BdpController {
                initial_window: self.window_initial_bytes,
                window_bdps: self.window_bdps,
                lean_bdps: self.window_lean_bdps,
                max_queue_ns: self.window_max_queue_us.saturating_mul(1000),
                pipe_slice: self.block_size,
            })
        };
        DispatchConfig {
            timeout_ns: self.timeout_ms.saturating_mul(1_000_000),
            max_retries: self.max_retries,
            controller,
            high_wait_ns: self.bulk_chunk_wait_us.saturating_mul(1000),
            min_bulk_chunk: self.min_bulk_chunk,
            promotion: PromotionConfig {
                timeout_ns: self.priority_promotion_timeout_us.saturating_mul(1000),
                check_ns: self.priority_promotion_check_us.saturating_mul(1000),
                only_when_starved: self.qos_promote_only_when_starved,
            },
            health: HealthConfig {
                error_threshold: self.health_error_threshold,
                error_window_ns: HealthConfig::default().error_window_ns,
                initial_pause_ns: self.health_initial_pause_ms.saturating_mul(1_000_000),
                max_pause_ns: self.health_max_pause_ms.saturating_mul(1_000_000),
            },
        }
    }

    /// Checks the keys against their ranges; the error names the key under `policy`.
    fn validate(&self) -> Result<(), ScenarioError> {
        let key = |k: &str| format!("policy.{k}");
        let hour_ms = MAX_DURATION_MS;
        for (k, v, min, max) in [
            (
                "bandwidth_sample_min_us",
                self.bandwidth_sample_min_us,
                0,
                1_000_000,
            ),
            (
                "bandwidth_sample_min_bytes",
                self.bandwidth_sample_min_bytes,
                0,
                1 << 30,
            ),
            (
                "bandwidth_window_us",
                self.bandwidth_window_us,
                0,
                10_000_000,
            ),
            (
                "priority_promotion_timeout_us",
                self.priority_promotion_timeout_us,
                1,
                hour_ms * 1000,
            ),
            (
                "priority_promotion_check_us",
                self.priority_promotion_check_us,
                1,
                hour_ms * 1000,
            ),
            ("block_size", self.block_size, 1, 64 << 20),
            (
                "max_slices_per_request",
                self.max_slices_per_request.into(),
                1,
                1 << 16,
            ),
            (
                "max_slices_per_write",
                self.max_slices_per_write.into(),
                1,
                1 << 16,
            ),
            (
                "window_max_queue_us",
                self.window_max_queue_us,
                1,
                1_000_000,
            ),
            (
                "window_initial_bytes",
                self.window_initial_bytes,
                4096,
                1 << 30,
            ),
            ("window_fixed_bytes", self.window_fixed_bytes, 4096, 1 << 30),
            ("bulk_chunk_wait_us", self.bulk_chunk_wait_us, 1, 1_000_000),
            ("min_bulk_chunk", self.min_bulk_chunk, 4096, 64 << 20),
            ("timeout_ms", self.timeout_ms, 1, hour_ms),
            ("max_retries", self.max_retries.into(), 0, 1000),
            (
                "connections_per_rail",
                self.connections_per_rail as u64,
                1,
                64,
            ),
            (
                "health_error_threshold",
                self.health_error_threshold.into(),
                1,
                1_000_000,
            ),
            (
                "health_initial_pause_ms",
                self.health_initial_pause_ms,
                1,
                hour_ms,
            ),
            ("health_max_pause_ms", self.health_max_pause_ms, 1, hour_ms),
            ("link_check_ms", self.link_check_ms, 1, hour_ms),
        ] {
            within(key(k), v, min, max)?;
        }
        if BandwidthEstimator::from_name(&self.bandwidth_estimator).is_none() {
            return Err(bad(
                key("bandwidth_estimator"),
                format!(
                    "must be delivery or tent, got {:?}",
                    self.bandwidth_estimator
                ),
            ));
        }
        if !["bdp", "fixed"].contains(&self.window_controller.as_str()) {
            return Err(bad(
                key("window_controller"),
                format!("must be bdp or fixed, got {:?}", self.window_controller),
            ));
        }
        self.plans().map(|_| ())
    }

    /// The slicing plans for READ and WRITE requests.
    pub fn plans(&self) -> Result<(SlicePlan, SlicePlan), ScenarioError> {
        let read = SlicePlan::new(self.block_size, self.max_slices_per_request)
            .map_err(|e| bad("policy.max_slices_per_request", e.to_string()))?;
        let write = SlicePlan::new(self.block_size, self.max_slices_per_write)
            .map_err(|e| bad("policy.max_slices_per_write", e.to_string()))?;
        Ok((read, write))
    }
}

/// How a workload's requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrival {
    /// Each submitter keeps one batch outstanding and submits the next when it completes, as
    /// `multirail bench --threads T --batch-size B` does.
    Closed,
    /// One request every `interval_us`.
    Interval,
    /// Requests at exponentially distributed gaps, `rate_per_sec` on average.
    Poisson,
}

/// Who submits what.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Name shown in reports.
    pub name: String,
    /// `high`, `medium` or `low`.
    pub priority: String,
    /// `read` or `write` (decides the slicing cap).
    #[serde(default = "default_op")]
    pub op: String,
    /// Request size, bytes: 1 to 1,099,511,627,776 (1 TiB).
    pub size: u64,
    /// Submitters (closed loop): 1 to 1024.
    #[serde(default = "one_usize")]
    pub threads: usize,
    /// Requests per batch (closed loop): 1 to 65,536. Every closed-loop workload's threads ×
    /// batch, summed, is at most [`MAX_IN_FLIGHT`]: each request in flight is held in memory.
    #[serde(default = "one_usize")]
    pub batch: usize,
    /// NUMA node of the buffers.
    #[serde(default)]
    pub numa_node: i32,
    /// How requests arrive (default closed).
    #[serde(default = "default_arrival")]
    pub arrival: Arrival,
    /// For `interval`: the gap, microseconds, 0.001 to 3,600,000,000 (an hour).
    #[serde(default)]
    pub interval_us: f64,
    /// For `poisson`: requests per second, above 0 and at most 1,000,000,000. The arrivals
    /// of every `interval` and `poisson` workload of a run add up to at most
    /// [`MAX_ARRIVALS`]: a request that arrives faster than the rails drain them waits in
    /// memory.
    #[serde(default)]
    pub rate_per_sec: f64,
    /// Starts at, ms (default 0): 0 to 3,600,000.
    #[serde(default)]
    pub start_ms: u64,
    /// Stops submitting at, ms (default: the end): 0 to 3,600,000.
    #[serde(default)]
    pub stop_ms: Option<u64>,
}

fn default_op() -> String {
    "write".into()
}

fn one_usize() -> usize {
    1
}

fn default_arrival() -> Arrival {
    Arrival::Closed
}

impl Workload {
    /// The priority named.
    pub fn priority(&self) -> Priority {
        match self.priority.as_str() {
            "high" => Priority::High,
            "medium" => Priority::Medium,
            _ => Priority::Low,
        }
    }

    /// True for a READ workload.
    pub fn is_read(&self) -> bool {
        self.op == "read"
    }
}

/// A change to one link at one time.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkEvent {
    /// When, ms: 0 to 3,600,000 (an event at or after the end does not happen).
    pub at_ms: u64,
    /// Which rail (index).
    pub rail: usize,
    /// `fail`, `recover` or `rate`.
    pub action: String,
    /// For `rate`: the new line rate, Gbit/s, 0.001 to 1,000,000.
    #[serde(default)]
    pub gbps: f64,
}

/// What the processes of a lanes scenario send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LanesWorkload {
    /// UCX's improved osu_mbw_mr: `hot` processes send continuously to a receiver (at
    /// `hot_rate_per_sec`), every other sender one message every `cold_interval_ms`; the
    /// receiver answers every `reply_every`-th message of each sender, as osu_mbw_mr answers
    /// each window. Processes `0..receivers` receive, the next `hot` are the hot senders, the
    /// rest the cold ones; sender `i` (counted from the first hot one) sends to receiver
    /// `i % receivers`.
    MbwMr,
    /// osu_alltoall: every process sends `rate_per_sec` messages a second, spread evenly over
    /// every other process.
    Alltoall,
}

/// In what order an alltoall process sends to its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SendOrder {
    /// One message to each peer in turn, `i + 1`, `i + 2`, ... (osu_alltoall's pairwise
    /// exchange), every process starting at the same step.
    RoundRobin,
    /// Each message to a peer drawn at random: the same shares with sampling noise on top.
    Random,
}

/// What a process's *granting* lane machine (the one that answers requests for lanes into the
/// process) knows of a pair's score besides the requester's own (its `Promote`, then its
/// `Score`s), the view that decides whom it evicts when a stronger request comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReceiverView {
    /// Nothing else: only the requester's scores.
    Request,
    /// Also its own send-side tracker's score for the peer (the traffic it sends back), fed
    /// with `on_score` at every progress for every peer it granted a lane that the tracker
    /// tracks; `Lanes` compares the larger of the two.
    Own,
    /// UCX's way: a request's (and a `Score`'s) score floors the receiver's tracker score for
    /// the requester (`set_min_score`), so the receiver's tracker may promote it too, and its
    /// requesting machine ask for the lane back; the floored score is fed to the granting
    /// machine as in `own`.
    MinScore,
}

/// A group multicast in the manner of Derecho's SMC ([`crate::multicast`]): `members`
/// processes, `senders` of them sending `message_bytes` messages as fast as their ring of
/// `window` slots allows, pushes and acknowledgements decided by the real
/// `multirail_policy::coalesce` planners, every one-sided write charged to the NIC.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MulticastScenario {
    /// Group members: 2 to 256 ([`MAX_MULTICAST_MEMBERS`]; the model steps every member's
    /// planner for every sender each 20 ns of simulated time).
    #[serde(default = "default_members")]
    pub members: u64,
    /// Members that send (1 to `members`).
    #[serde(default = "default_senders")]
    pub senders: u64,
    /// Payload of each message, bytes: 1 to 16,777,216 (16 MiB, the engine's largest).
    #[serde(default = "default_message_bytes")]
    pub message_bytes: u64,
    /// Slots of each sender's ring: 1 to 65,536, as the engine takes it.
    #[serde(default = "default_mcast_window")]
    pub window: u64,
    /// `off`, `opportunistic` or `k:N`.
    #[serde(default = "default_batching")]
    pub batching: String,
    /// With `k:N`: longest a held-back push or acknowledgement waits, µs: 1 to 1,000,000.
    #[serde(default = "default_flush_us")]
    pub flush_us: u64,
    /// The NIC's line rate, Gbps (each sender's payload to every other member counts).
    #[serde(default = "default_nic_gbps")]
    pub nic_gbps: f64,
    /// The NIC's one-sided write rate, millions a second. As in Derecho's SMC arithmetic, every
    /// write of the group counts against it.
    #[serde(default = "default_nic_mops")]
    pub nic_mops: f64,
}

fn default_members() -> u64 {
    3
}
fn default_senders() -> u64 {
    1
}
fn default_message_bytes() -> u64 {
    64
}
fn default_mcast_window() -> u64 {
    100
}
fn default_batching() -> String {
    "opportunistic".into()
}
fn default_flush_us() -> u64 {
    150
}
fn default_nic_gbps() -> f64 {
    100.0
}
fn default_nic_mops() -> f64 {
    75.0
}

impl MulticastScenario {
    /// The batching mode. Fails naming `batching` or `flush_us` when they are not valid for
    /// the window.
    pub fn batching(&self) -> Result<multirail_policy::coalesce::Batching, ScenarioError> {
        use multirail_policy::coalesce::Batching;
        let batching = match self.batching.as_str() {
            "off" => Batching::Off,
            "opportunistic" => Batching::Opportunistic,
            other => {
                let k = other
                    .strip_prefix("k:")
                    .and_then(|k| k.parse::<u64>().ok())
                    .ok_or_else(|| {
                        bad(
                            "batching",
                            format!("must be off, opportunistic or k:N, got {other:?}"),
                        )
                    })?;
                Batching::Every {
                    k,
                    flush_ns: self.flush_us.saturating_mul(1000),
                }
            }
        };
        multirail_policy::coalesce::PushPlanner::new(batching, self.window).map_err(|e| {
            let key = if e.0.contains("window") && !e.0.contains("batch size") {
                "window"
            } else if e.0.contains("flush") {
                "flush_us"
            } else {
                "batching"
            };
            bad(key, e.0)
        })?;
        Ok(batching)
    }

    fn validate(&self) -> Result<(), ScenarioError> {
        within("members", self.members, 2, MAX_MULTICAST_MEMBERS)?;
        if self.senders == 0 || self.senders > self.members {
            return Err(bad(
                "senders",
                format!("must be within [1, members {}]", self.members),
            ));
        }
        within("message_bytes", self.message_bytes, 1, 16 << 20)?;
        within("window", self.window, 1, 1 << 16)?;
        within("flush_us", self.flush_us, 1, 1_000_000)?;
        if !positive(self.nic_gbps) {
            return Err(bad("nic_gbps", "must be > 0"));
        }
        if !positive(self.nic_mops) {
            return Err(bad("nic_mops", "must be > 0"));
        }
        self.batching().map(|_| ())
    }
}

/// A lanes scenario: `peers` processes, each driving its own `UsageTracker` (sampled on its
/// send path: `should_sample`, then `on_sample`, which runs `progress` as the tracker's
/// settings say) and two `Lanes` machines, one asking for lanes for what it sends and one
/// granting lanes for what it receives, exchanging lane messages with a modelled one-way
/// latency. Defaults are the policy crate's, except `usage.switch_interval_us` (the policy's
/// default is off).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LanesScenario {
    /// Processes: 2 to 100,000 ([`MAX_LANES_PEERS`]).
    pub peers: usize,
    /// `mbw_mr` or `alltoall`.
    pub workload: LanesWorkload,
    /// mbw_mr: hot senders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot: Option<usize>,
    /// mbw_mr: receivers (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receivers: Option<usize>,
    /// mbw_mr: messages a second of each hot sender (default 1,000,000), above 0 and at most
    /// 100,000,000 ([`MAX_LANES_RATE`]; every message is simulated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_rate_per_sec: Option<f64>,
    /// mbw_mr: gap between two messages of a cold sender, ms (default 100): 0.001 to
    /// 3,600,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_interval_ms: Option<f64>,
    /// mbw_mr: the receiver answers every this-many-th message of a sender (default 64,
    /// osu_mbw_mr's window); 0: it sends nothing. At most 1,048,576.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_every: Option<u64>,
    /// alltoall: messages a second of each process, over all its peers: above 0 and at most
    /// 100,000,000 ([`MAX_LANES_RATE`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_sec: Option<f64>,
    /// alltoall: `round_robin` (default) or `random`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<SendOrder>,
    /// Bytes of an application message (default 128); counts the payload rate only. 1 to
    /// 67,108,864 (64 MiB, the engine's largest receive buffer).
    #[serde(default = "default_message_size")]
    pub message_size: u64,
    /// One-way latency of a lane message, microseconds (default 2): 0 to 1,000,000.
    #[serde(default = "default_latency_us")]
    pub latency_us: f64,
    /// Each lane message's latency is `latency_us` plus or minus up to this, uniformly,
    /// microseconds (default 0.5); messages of a pair still arrive in the order sent.
    #[serde(default = "default_jitter_us")]
    pub jitter_us: f64,
    /// Sends are simulated in batches, one per process per tick of this many microseconds
    /// (default 1000; 1 to 1,000,000); each send of a batch still goes through
    /// `should_sample`.
    #[serde(default = "default_tick_us")]
    pub tick_us: u64,
    /// Whose score a process keeps for peers it accepted (default `request`).
    #[serde(default = "default_receiver_view")]
    pub receiver_view: ReceiverView,
    /// The lanes driver runs the tracker's progress itself when it has not progressed for two
    /// scoring rounds, as the engine's does (default true); false only to compare.
    #[serde(default = "default_idle_progress")]
    pub idle_progress: bool,
    /// `LanesConfig::max_dedicated`: 0 to 65,536.
    #[serde(default = "default_max_dedicated")]
    pub max_dedicated: usize,
    /// `LanesConfig::remove_thresh`.
    #[serde(default = "default_lanes_remove_thresh")]
    pub remove_thresh: f64,
    /// `LanesConfig::min_score`: the least score at which a process asks for a lane.
    #[serde(default = "default_lanes_min_score")]
    pub min_score: f64,
    /// `LanesConfig::deny_backoff_ns`, in ms: 1 to 3,600,000.
    #[serde(default = "default_deny_backoff_ms")]
    pub deny_backoff_ms: u64,
    /// `LanesConfig::request_timeout_ns`, in ms: 1 to 3,600,000.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// The usage tracker's settings.
    #[serde(default)]
    pub usage: UsageKeys,
}

fn default_message_size() -> u64 {
    128
}

fn default_jitter_us() -> f64 {
    0.5
}

fn default_tick_us() -> u64 {
    1000
}

fn default_idle_progress() -> bool {
    true
}

fn default_receiver_view() -> ReceiverView {
    ReceiverView::Request
}

fn default_max_dedicated() -> usize {
    LanesConfig::default().max_dedicated
}

fn default_lanes_remove_thresh() -> f64 {
    LanesConfig::default().remove_thresh
}

fn default_lanes_min_score() -> f64 {
    LanesConfig::default().min_score
}

fn default_deny_backoff_ms() -> u64 {
    LanesConfig::default().deny_backoff_ns / 1_000_000
}

fn default_request_timeout_ms() -> u64 {
    LanesConfig::default().request_timeout_ns / 1_000_000
}

/// The usage tracker's settings (`UsageConfig`), by its field names.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UsageKeys {
    /// `UsageConfig::promote_capacity`: 1 to 65,536.
    pub promote_capacity: usize,
    /// `UsageConfig::promote_thresh`: 0 to `promote_capacity`.
    pub promote_thresh: usize,
    /// `UsageConfig::remove_thresh`.
    pub remove_thresh: f64,
    /// `UsageConfig::decay_multiplier`.
    pub decay_multiplier: f64,
    /// `UsageConfig::decay_adder`.
    pub decay_adder: f64,
    /// `UsageConfig::switch_interval_ns`, in µs (default 10,000: with the default
    /// `progress_factor` a busy process progresses every 100 ms; the policy's default is off):
    /// 1 to 3,600,000,000.
    pub switch_interval_us: u64,
    /// `UsageConfig::progress_factor`: 1 to 1,000,000.
    pub progress_factor: u32,
    /// `UsageConfig::sample_period`: 1 to 1,000,000.
    pub sample_period: u32,
}

impl Default for UsageKeys {
    fn default() -> Self {
        let c = UsageConfig::default();
        UsageKeys {
            promote_capacity: c.promote_capacity,
            promote_thresh: c.promote_thresh,
            remove_thresh: c.remove_thresh,
            decay_multiplier: c.decay_multiplier,
            decay_adder: c.decay_adder,
            switch_interval_us: 10_000,
            progress_factor: c.progress_factor,
            sample_period: c.sample_period,
        }
    }
}

/// Most processes a lanes scenario may model.
pub const MAX_LANES_PEERS: usize = 100_000;

/// Most messages a second of one process in a lanes scenario (`hot_rate_per_sec`,
/// `rate_per_sec`): every message goes through its tracker's `should_sample`, one by one.
pub const MAX_LANES_RATE: f64 = 1e8;

/// Longest simulated time of a run, ms (an hour).
pub const MAX_DURATION_MS: u64 = 3_600_000;

/// Most throughput samples (`duration_ms` / `sample_ms`) in a run's timeline.
pub const MAX_SAMPLES: u64 = 1_000_000;

/// Most samples × rails in a rails scenario's timeline (one counter per rail per sample).
pub const MAX_TIMELINE_CELLS: u64 = 1 << 24;

/// Most rails of a rails scenario: more NICs than any host has, and each slice's rail choice
/// looks at every rail (1,024 rails take half a minute per simulated 100 ms).
pub const MAX_RAILS: usize = 256;

/// Most workloads of a rails scenario.
pub const MAX_WORKLOADS: usize = 256;

/// Most link events of a run.
pub const MAX_EVENTS: usize = 100_000;

/// Most runs of a scenario file.
pub const MAX_RUNS: usize = 256;

/// Most closed-loop requests in flight at once (every closed-loop workload's threads × batch):
/// each takes about a kilobyte and a half of the simulator's memory.
pub const MAX_IN_FLIGHT: u64 = 1 << 20;

/// Most requests the `interval` and `poisson` workloads of a run submit in all (rate × the
/// time they submit): arrivals the rails cannot keep up with wait in memory, about a kilobyte
/// and a half each.
pub const MAX_ARRIVALS: f64 = 5e6;

/// Most members of a multicast scenario: the model steps every member's acknowledgement
/// planner for every sender each 20 ns of simulated time (256 members all sending take about
/// 40 s of wall time per simulated 5 ms).
pub const MAX_MULTICAST_MEMBERS: u64 = 256;

impl LanesScenario {
    /// The usage tracker's settings.
    pub fn usage_config(&self) -> UsageConfig {
        let u = &self.usage;
        UsageConfig {
            promote_capacity: u.promote_capacity,
            promote_thresh: u.promote_thresh,
            remove_thresh: u.remove_thresh,
            decay_multiplier: u.decay_multiplier,
            decay_adder: u.decay_adder,
            switch_interval_ns: Some(u.switch_interval_us.saturating_mul(1000)),
            progress_factor: u.progress_factor,
            sample_period: u.sample_period,
        }
    }

    /// The lane negotiation settings.
    pub fn lanes_config(&self) -> LanesConfig {
        LanesConfig {
            max_dedicated: self.max_dedicated,
            remove_thresh: self.remove_thresh,
            min_score: self.min_score,
            deny_backoff_ns: self.deny_backoff_ms.saturating_mul(1_000_000),
            request_timeout_ns: self.request_timeout_ms.saturating_mul(1_000_000),
        }
    }

    /// mbw_mr: receivers.
    pub fn receivers(&self) -> usize {
        self.receivers.unwrap_or(1)
    }

    /// mbw_mr: hot senders.
    pub fn hot(&self) -> usize {
        self.hot.unwrap_or(0)
    }

    /// mbw_mr: messages a second of a hot sender.
    pub fn hot_rate(&self) -> f64 {
        self.hot_rate_per_sec.unwrap_or(1e6)
    }

    /// mbw_mr: messages a second of a cold sender.
    pub fn cold_rate(&self) -> f64 {
        1000.0 / self.cold_interval_ms.unwrap_or(100.0)
    }

    /// mbw_mr: the receiver answers every this-many-th message.
    pub fn reply_every(&self) -> u64 {
        self.reply_every.unwrap_or(64)
    }

    /// Checks the keys; the error names the key relative to `lanes`.
    fn validate(&self) -> Result<(), ScenarioError> {
        if !(2..=MAX_LANES_PEERS).contains(&self.peers) {
            return Err(bad(
                "peers",
                format!("must be within [2, {MAX_LANES_PEERS}], got {}", self.peers),
            ));
        }
        let only = |key: &str, set: bool, workload: &str| {
            if set {
                Err(bad(
                    key,
                    format!("only for the {workload} workload: leave it out"),
                ))
            } else {
                Ok(())
            }
        };
        match self.workload {
            LanesWorkload::MbwMr => {
                only("rate_per_sec", self.rate_per_sec.is_some(), "alltoall")?;
                if let Some(every) = self.reply_every {
                    within("reply_every", every, 0, 1 << 20)?;
                }
                only("order", self.order.is_some(), "alltoall")?;
                let Some(hot) = self.hot else {
                    return Err(bad("hot", "the mbw_mr workload needs it"));
                };
                let receivers = self.receivers();
                if receivers == 0 {
                    return Err(bad("receivers", "must be at least 1"));
                }
                if receivers >= self.peers {
                    return Err(bad("receivers", "leaves no sender"));
                }
                if receivers.saturating_add(hot) > self.peers {
                    return Err(bad(
                        "hot",
                        format!(
                            "{hot} hot senders and {receivers} receivers do not fit in {} peers",
                            self.peers
                        ),
                    ));
                }
                if !positive(self.hot_rate()) {
                    return Err(bad("hot_rate_per_sec", "must be > 0"));
                }
                within_f64("hot_rate_per_sec", self.hot_rate(), 0.0, MAX_LANES_RATE)?;
                if !self.cold_interval_ms.is_none_or(positive) {
                    return Err(bad("cold_interval_ms", "must be > 0"));
                }
                if let Some(ms) = self.cold_interval_ms {
                    within_f64("cold_interval_ms", ms, 0.001, MAX_DURATION_MS as f64)?;
                }
            }
            LanesWorkload::Alltoall => {
                only("hot", self.hot.is_some(), "mbw_mr")?;
                only("receivers", self.receivers.is_some(), "mbw_mr")?;
                only(
                    "hot_rate_per_sec",
                    self.hot_rate_per_sec.is_some(),
                    "mbw_mr",
                )?;
                only(
                    "cold_interval_ms",
                    self.cold_interval_ms.is_some(),
                    "mbw_mr",
                )?;
                only("reply_every", self.reply_every.is_some(), "mbw_mr")?;
                match self.rate_per_sec {
                    None => return Err(bad("rate_per_sec", "the alltoall workload needs it")),
                    Some(r) if !positive(r) => {
                        return Err(bad("rate_per_sec", format!("must be > 0, got {r}")))
                    }
                    Some(r) => within_f64("rate_per_sec", r, 0.0, MAX_LANES_RATE)?,
                }
            }
        }
        within("message_size", self.message_size, 1, 64 << 20)?;
        within_f64("latency_us", self.latency_us, 0.0, MAX_LATENCY_US)?;
        if !(self.jitter_us >= 0.0 && self.jitter_us <= self.latency_us) {
            return Err(bad(
                "jitter_us",
                format!(
                    "must be within [0, latency_us = {}], got {}",
                    self.latency_us, self.jitter_us
                ),
            ));
        }
        within("tick_us", self.tick_us, 1, 1_000_000)?;
        within("deny_backoff_ms", self.deny_backoff_ms, 1, MAX_DURATION_MS)?;
        within(
            "request_timeout_ms",
            self.request_timeout_ms,
            1,
            MAX_DURATION_MS,
        )?;
        let u = &self.usage;
        within(
            "usage.switch_interval_us",
            u.switch_interval_us,
            1,
            MAX_DURATION_MS * 1000,
        )?;
        within("usage.progress_factor", u.progress_factor, 1, 1_000_000)?;
        within("usage.sample_period", u.sample_period, 1, 1_000_000)?;
        self.lanes_config().validate().map_err(|e| match e {
            LanesError::Config { field, message } => {
                let key = match field {
                    "deny_backoff_ns" => "deny_backoff_ms",
                    "request_timeout_ns" => "request_timeout_ms",
                    f => f,
                };
                bad(key, message)
            }
            other => bad("", other.to_string()),
        })?;
        self.usage_config()
            .validate()
            .map_err(|e| bad(format!("usage.{}", e.key), e.message))?;
        Ok(())
    }
}

impl Run {
    /// Checks every key as [`parse_runs`] does, naming the first one out of range: for a run
    /// changed after parsing (a duration given on the command line).
    pub fn validate(&self) -> Result<(), ScenarioError> {
        within("duration_ms", self.duration_ms, 1, MAX_DURATION_MS)?;
        within("sample_ms", self.sample_ms, 1, MAX_DURATION_MS)?;
        let samples = self.duration_ms.div_ceil(self.sample_ms);
        if samples > MAX_SAMPLES {
            return Err(bad(
                "sample_ms",
                format!(
                    "{} ms in samples of {} ms is {samples} samples, more than {MAX_SAMPLES}; \
                     raise sample_ms",
                    self.duration_ms, self.sample_ms
                ),
            ));
        }
        within("runs", self.runs.len(), 0, MAX_RUNS)?;
        within("events", self.events.len(), 0, MAX_EVENTS)?;
        if let Some(mc) = &self.multicast {
            for (key, given) in [
                ("rails", !self.rails.is_empty()),
                ("workloads", !self.workloads.is_empty()),
                ("events", !self.events.is_empty()),
                ("lanes", self.lanes.is_some()),
            ] {
                if given {
                    return Err(bad(
                        key,
                        "a multicast scenario models a group, not rails: leave this key out",
                    ));
                }
            }
            return mc.validate().map_err(|e| ScenarioError {
                key: format!("multicast.{}", e.key),
                ..e
            });
        }
        if let Some(lanes) = &self.lanes {
            let not_here = |key: &str| {
                bad(
                    key,
                    "a lanes scenario models processes, not rails: leave this key out",
                )
            };
            if !self.rails.is_empty() {
                return Err(not_here("rails"));
            }
            if !self.workloads.is_empty() {
                return Err(not_here("workloads"));
            }
            if !self.events.is_empty() {
                return Err(not_here("events"));
            }
            return lanes.validate().map_err(|e| ScenarioError {
                key: format!("lanes.{}", e.key),
                ..e
            });
        }
        if self.rails.is_empty() {
            return Err(bad("rails", "needs at least one rail"));
        }
        within("rails", self.rails.len(), 1, MAX_RAILS)?;
        let cells = samples.saturating_mul(self.rails.len() as u64);
        if cells > MAX_TIMELINE_CELLS {
            return Err(bad(
                "sample_ms",
                format!(
                    "{samples} samples × {} rails is more than {MAX_TIMELINE_CELLS} timeline \
                     entries; raise sample_ms",
                    self.rails.len()
                ),
            ));
        }
        for (i, r) in self.rails.iter().enumerate() {
            if !(r.gbps > 0.0 && r.gbps.is_finite()) {
                return Err(bad(
                    format!("rails[{i}].gbps"),
                    format!("must be > 0, got {}", r.gbps),
                ));
            }
            within_f64(
                format!("rails[{i}].latency_us"),
                r.latency_us,
                0.0,
                MAX_LATENCY_US,
            )?;
            if !(r.ops_per_sec >= 0.0 && r.ops_per_sec.is_finite()) {
                return Err(bad(format!("rails[{i}].ops_per_sec"), "must be >= 0"));
            }
            if !(r.efficiency > 0.0 && r.efficiency <= 1.0) {
                return Err(bad(
                    format!("rails[{i}].efficiency"),
                    "must be within (0, 1]",
                ));
            }
            // A slice's time on the wire is its length over the rate: rates near zero make
            // times past the simulator's clock.
            let key = |k: &str| format!("rails[{i}].{k}");
            within_f64(key("gbps"), r.gbps, MIN_GBPS, MAX_GBPS)?;
            if let Some(g) = r.reported_gbps {
                within_f64(key("reported_gbps"), g, MIN_GBPS, MAX_GBPS)?;
            }
            within_f64(key("efficiency"), r.efficiency, 0.01, 1.0)?;
            if r.ops_per_sec != 0.0 {
                within_f64(key("ops_per_sec"), r.ops_per_sec, 1.0, 1e12)?;
            }
        }
        self.policy.validate()?;
        if self.workloads.is_empty() {
            return Err(bad("workloads", "needs at least one workload"));
        }
        within("workloads", self.workloads.len(), 1, MAX_WORKLOADS)?;
        let (mut in_flight, mut arrivals) = (0u64, 0.0f64);
        for (i, w) in self.workloads.iter().enumerate() {
            let key = |k: &str| format!("workloads[{i}].{k}");
            if !["high", "medium", "low"].contains(&w.priority.as_str()) {
                return Err(bad(
                    key("priority"),
                    format!("must be high, medium or low, got {:?}", w.priority),
                ));
            }
            if !["read", "write"].contains(&w.op.as_str()) {
                return Err(bad(
                    key("op"),
                    format!("must be read or write, got {:?}", w.op),
                ));
            }
            within(key("size"), w.size, 1, 1 << 40)?;
            within(key("threads"), w.threads, 1, 1024)?;
            within(key("batch"), w.batch, 1, 1 << 16)?;
            within(key("start_ms"), w.start_ms, 0, MAX_DURATION_MS)?;
            if let Some(stop) = w.stop_ms {
                within(key("stop_ms"), stop, 0, MAX_DURATION_MS)?;
            }
            // The time this workload submits, in seconds.
            let active = (w.stop_ms.unwrap_or(self.duration_ms).min(self.duration_ms))
                .saturating_sub(w.start_ms) as f64
                / 1000.0;
            let (rate, rate_key) = match w.arrival {
                Arrival::Closed => {
                    in_flight += (w.threads * w.batch) as u64;
                    if in_flight > MAX_IN_FLIGHT {
                        return Err(bad(
                            key("batch"),
                            format!(
                                "the closed-loop workloads keep more than {MAX_IN_FLIGHT} \
                                 requests (threads × batch, summed) in flight"
                            ),
                        ));
                    }
                    continue;
                }
                Arrival::Interval => {
                    if !positive(w.interval_us) {
                        return Err(bad(key("interval_us"), "must be > 0 for interval arrivals"));
                    }
                    within_f64(
                        key("interval_us"),
                        w.interval_us,
                        0.001,
                        MAX_DURATION_MS as f64 * 1000.0,
                    )?;
                    (1e6 / w.interval_us, "interval_us")
                }
                Arrival::Poisson => {
                    if !positive(w.rate_per_sec) {
                        return Err(bad(key("rate_per_sec"), "must be > 0 for poisson arrivals"));
                    }
                    within_f64(key("rate_per_sec"), w.rate_per_sec, 0.0, 1e9)?;
                    (w.rate_per_sec, "rate_per_sec")
                }
            };
            arrivals += rate * active;
            if arrivals > MAX_ARRIVALS {
                return Err(bad(
                    key(rate_key),
                    format!(
                        "the interval and poisson workloads would submit about {arrivals:.0} \
                         requests in {} ms, more than {MAX_ARRIVALS}; lower the rate or \
                         duration_ms",
                        self.duration_ms
                    ),
                ));
            }
        }
        for (i, e) in self.events.iter().enumerate() {
            let key = |k: &str| format!("events[{i}].{k}");
            within(key("at_ms"), e.at_ms, 0, MAX_DURATION_MS)?;
            if e.rail >= self.rails.len() {
                return Err(bad(
                    key("rail"),
                    format!("no rail {} (there are {})", e.rail, self.rails.len()),
                ));
            }
            match e.action.as_str() {
                "fail" | "recover" => {}
                "rate" if e.gbps > 0.0 && e.gbps.is_finite() => {
                    within_f64(key("gbps"), e.gbps, MIN_GBPS, MAX_GBPS)?
                }
                "rate" => return Err(bad(key("gbps"), "must be > 0 for a rate change")),
                other => {
                    return Err(bad(
                        key("action"),
                        format!("must be fail, recover or rate, got {other:?}"),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// True for a finite number above zero (false for NaN).
fn positive(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// Slowest line rate of a rail, Gbit/s (1 Mbit/s).
const MIN_GBPS: f64 = 0.001;

/// Fastest line rate of a rail, Gbit/s (1 Pbit/s).
const MAX_GBPS: f64 = 1e6;

/// Longest one-way latency of a rail or a lane message, µs (a second).
const MAX_LATENCY_US: f64 = 1e6;

/// Checks that `value` of `key` lies within `[min, max]`.
fn within<T: PartialOrd + std::fmt::Display>(
    key: impl Into<String>,
    value: T,
    min: T,
    max: T,
) -> Result<(), ScenarioError> {
    if min <= value && value <= max {
        Ok(())
    } else {
        Err(bad(
            key,
            format!("must be within [{min}, {max}], got {value}"),
        ))
    }
}

/// [`within`] for a number that may also be NaN or infinite, which no range holds.
fn within_f64(key: impl Into<String>, value: f64, min: f64, max: f64) -> Result<(), ScenarioError> {
    if value.is_finite() && min <= value && value <= max {
        return Ok(());
    }
    // `1e-300` rather than three hundred zeros.
    let show = |v: f64| {
        if v != 0.0 && !(1e-4..1e15).contains(&v.abs()) {
            format!("{v:e}")
        } else {
            v.to_string()
        }
    };
    Err(bad(
        key,
        format!(
            "must be within [{}, {}], got {}",
            show(min),
            show(max),
            show(value)
        ),
    ))
}

/// Merges `patch` into `base`: objects key by key, anything else replaced.
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, p) => *b = p.clone(),
    }
}

fn parse(doc: Value, prefix: &str) -> Result<Run, ScenarioError> {
    if doc.get("lanes").is_some_and(|l| !l.is_null()) && doc.get("policy").is_some() {
        return Err(bad(
            format!("{prefix}policy"),
            "a lanes scenario takes its settings under lanes: leave this key out",
        ));
    }
    let run: Run = serde_path_to_error::deserialize(doc).map_err(|e| {
        let path = e.path().to_string();
        let key = if path == "." { String::new() } else { path };
        bad(format!("{prefix}{key}"), e.into_inner().to_string())
    })?;
    run.validate().map_err(|e| ScenarioError {
        key: format!("{prefix}{}", e.key),
        ..e
    })?;
    Ok(run)
}

/// Parses a scenario document into its runs: the base alone when it lists no `runs`, else
/// one per entry (the entry deep-merged into the base). Fails naming the first bad key.
pub fn parse_runs(json: &str) -> Result<Vec<Run>, ScenarioError> {
    let doc: Value =
        serde_json::from_str(json).map_err(|e| bad("", format!("invalid JSON: {e}")))?;
    let base = parse(doc.clone(), "")?;
    if base.runs.is_empty() {
        return Ok(vec![base]);
    }
    let mut runs = Vec::new();
    for (i, patch) in base.runs.iter().enumerate() {
        if !patch.is_object() {
            return Err(bad(format!("runs[{i}]"), "must be an object"));
        }
        let mut merged = doc.clone();
        if let Value::Object(m) = &mut merged {
            m.remove("runs");
        }
        merge(&mut merged, patch);
        if let (Value::Object(m), Some(name)) = (&mut merged, patch.get("name")) {
            let full = format!("{}/{}", base.name, name.as_str().unwrap_or("?"));
            m.insert("name".into(), Value::String(full));
        }
        runs.push(parse(merged, &format!("runs[{i}]."))?);
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"{"name": "t", "duration_ms": 10,
        "rails": [{"name": "r0", "gbps": 100}],
        "workloads": [{"name": "w", "priority": "low", "size": 1048576}]}"#;

    #[test]
    fn a_minimal_scenario_parses_with_the_policy_defaults() {
        let runs = parse_runs(MIN).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].policy.block_size, DEFAULT_BLOCK_SIZE);
        assert!(runs[0].policy.enable_smart_scheduling);
    }

    #[test]
    fn runs_override_the_base() {
        let doc = MIN.trim_end_matches('}').to_owned()
            + r#", "runs": [{"name": "rr", "policy": {"enable_smart_scheduling": false}}, {"name": "smart"}]}"#;
        let runs = parse_runs(&doc).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0].name, "t/rr");
        assert!(!runs[0].policy.enable_smart_scheduling);
        assert!(runs[1].policy.enable_smart_scheduling);
        assert_eq!(runs[1].rails.len(), 1);
    }

    #[test]
    fn bad_keys_are_named() {
        let e =
            parse_runs(&MIN.replace("\"gbps\": 100", "\"gbps\": 100, \"speed\": 3")).unwrap_err();
        assert!(e.key.starts_with("rails[0]"), "{e}");
        assert!(e.message.contains("speed"), "{e}");
        let e = parse_runs(&MIN.replace("\"low\"", "\"urgent\"")).unwrap_err();
        assert_eq!(e.key, "workloads[0].priority");
        let e = parse_runs(&MIN.replace("\"gbps\": 100", "\"gbps\": -1")).unwrap_err();
        assert_eq!(e.key, "rails[0].gbps");
        let doc = MIN.trim_end_matches('}').to_owned()
            + r#", "runs": [{"name": "x", "policy": {"window_controller": "cubic"}}]}"#;
        assert_eq!(
            parse_runs(&doc).unwrap_err().key,
            "runs[0].policy.window_controller"
        );
        let doc = MIN.trim_end_matches('}').to_owned()
            + r#", "runs": [{"name": "x", "policy": {"bandwidth_estimator": "bbr"}}]}"#;
        assert_eq!(
            parse_runs(&doc).unwrap_err().key,
            "runs[0].policy.bandwidth_estimator"
        );
        let doc = MIN.trim_end_matches('}').to_owned()
            + r#", "runs": [{"name": "x", "policy": {"bandwidth_window_us": 20000000}}]}"#;
        assert_eq!(
            parse_runs(&doc).unwrap_err().key,
            "runs[0].policy.bandwidth_window_us"
        );
        assert_eq!(parse_runs("{").unwrap_err().key, "");
    }

    #[test]
    fn counts_sizes_and_durations_out_of_range_are_named() {
        let key = |doc: &str| parse_runs(doc).unwrap_err().key;
        let min_with = |from: &str, to: &str| MIN.replacen(from, to, 1);
        assert_eq!(
            key(&min_with(
                "\"duration_ms\": 10",
                "\"duration_ms\": 18446744073709551615"
            )),
            "duration_ms"
        );
        assert_eq!(
            key(&min_with("\"duration_ms\": 10", "\"duration_ms\": 3600001")),
            "duration_ms"
        );
        assert!(parse_runs(&min_with("\"duration_ms\": 10", "\"duration_ms\": 3600000")).is_ok());
        // An hour in 1 ms samples is 3.6 million samples.
        assert_eq!(
            key(&min_with(
                "\"duration_ms\": 10",
                "\"duration_ms\": 3600000, \"sample_ms\": 1"
            )),
            "sample_ms"
        );
        let rails: Vec<String> = (0..=MAX_RAILS)
            .map(|i| format!(r#"{{"name": "r{i}", "gbps": 1}}"#))
            .collect();
        let many = min_with(
            r#"[{"name": "r0", "gbps": 100}]"#,
            &format!("[{}]", rails.join(",")),
        );
        assert_eq!(key(&many), "rails");
        // 256 rails in 1 ms samples over 100 s: 25.6 million timeline entries.
        let wide = many
            .replacen(r#"{"name": "r0", "gbps": 1},"#, "", 1)
            .replacen(
                "\"duration_ms\": 10",
                "\"duration_ms\": 100000, \"sample_ms\": 1",
                1,
            );
        assert_eq!(key(&wide), "sample_ms");
        let workload = |extra: &str| min_with("\"size\": 1048576", extra);
        assert_eq!(key(&workload("\"size\": 0")), "workloads[0].size");
        assert_eq!(
            key(&workload("\"size\": 1048576, \"threads\": 1025")),
            "workloads[0].threads"
        );
        assert_eq!(
            key(&workload(
                "\"size\": 1048576, \"threads\": 1024, \"batch\": 1025"
            )),
            "workloads[0].batch"
        );
        assert_eq!(
            key(&workload(
                "\"size\": 1048576, \"arrival\": \"poisson\", \"rate_per_sec\": 1e12"
            )),
            "workloads[0].rate_per_sec"
        );
        assert_eq!(
            key(&workload(
                "\"size\": 1048576, \"arrival\": \"interval\", \"interval_us\": 0.001"
            )),
            "workloads[0].interval_us"
        );
        assert_eq!(
            key(&workload(
                "\"size\": 1048576, \"start_ms\": 18446744073709551615"
            )),
            "workloads[0].start_ms"
        );
        assert_eq!(
            key(&min_with(
                "\"gbps\": 100",
                "\"gbps\": 100, \"latency_us\": 1e300"
            )),
            "rails[0].latency_us"
        );
        let rail = |extra: &str| key(&min_with("\"gbps\": 100", extra));
        assert_eq!(rail("\"gbps\": 1e-300"), "rails[0].gbps");
        assert_eq!(
            rail("\"gbps\": 100, \"ops_per_sec\": 1e-300"),
            "rails[0].ops_per_sec"
        );
        assert_eq!(
            rail("\"gbps\": 100, \"efficiency\": 1e-300"),
            "rails[0].efficiency"
        );
        let policy = |p: &str| {
            key(&(MIN.trim_end_matches('}').to_owned() + &format!(", \"policy\": {{{p}}}}}")))
        };
        assert_eq!(policy("\"block_size\": 0"), "policy.block_size");
        assert_eq!(
            policy("\"max_slices_per_request\": 4294967295"),
            "policy.max_slices_per_request"
        );
        assert_eq!(
            policy("\"timeout_ms\": 18446744073709551615"),
            "policy.timeout_ms"
        );
        assert_eq!(
            policy("\"connections_per_rail\": 65"),
            "policy.connections_per_rail"
        );
        assert_eq!(policy("\"link_check_ms\": 0"), "policy.link_check_ms");
        let events = MIN.trim_end_matches('}').to_owned()
            + r#", "events": [{"at_ms": 18446744073709551615, "rail": 0, "action": "fail"}]}"#;
        assert_eq!(key(&events), "events[0].at_ms");
        let group = |m: &str| {
            key(&format!(
                r#"{{"name": "m", "duration_ms": 1, "multicast": {{{m}}}}}"#
            ))
        };
        assert_eq!(group("\"members\": 1000000000000"), "multicast.members");
        assert_eq!(
            group("\"message_bytes\": 1073741824"),
            "multicast.message_bytes"
        );
        assert_eq!(group("\"window\": 65537"), "multicast.window");
        assert_eq!(
            group("\"batching\": \"k:4\", \"flush_us\": 18446744073709551615"),
            "multicast.flush_us"
        );
    }

    const LANES: &str = r#"{"name": "l", "duration_ms": 100,
        "lanes": {"peers": 20, "workload": "mbw_mr", "hot": 3, "max_dedicated": 4}}"#;

    const ALLTOALL: &str = r#"{"name": "a", "duration_ms": 100,
        "lanes": {"peers": 20, "workload": "alltoall", "rate_per_sec": 4000}}"#;

    #[test]
    fn a_lanes_scenario_parses_with_the_policy_defaults() {
        let runs = parse_runs(LANES).unwrap();
        let l = runs[0].lanes.as_ref().unwrap();
        assert_eq!(l.workload, LanesWorkload::MbwMr);
        assert!(runs[0].rails.is_empty() && runs[0].workloads.is_empty());
        let lanes = l.lanes_config();
        assert_eq!(lanes.max_dedicated, 4);
        assert_eq!(lanes.remove_thresh, LanesConfig::default().remove_thresh);
        assert_eq!(lanes.min_score, LanesConfig::default().min_score);
        assert_eq!(
            lanes.deny_backoff_ns,
            LanesConfig::default().deny_backoff_ns
        );
        let usage = l.usage_config();
        let ucx = UsageConfig::default();
        assert_eq!(
            (
                usage.promote_capacity,
                usage.promote_thresh,
                usage.sample_period
            ),
            (ucx.promote_capacity, ucx.promote_thresh, ucx.sample_period)
        );
        assert_eq!(usage.switch_interval_ns, Some(10_000_000));
        assert_eq!((l.receivers(), l.hot(), l.reply_every()), (1, 3, 64));
        assert_eq!(l.receiver_view, ReceiverView::Request);
        let a = parse_runs(ALLTOALL).unwrap();
        assert_eq!(
            a[0].lanes.as_ref().unwrap().workload,
            LanesWorkload::Alltoall
        );
    }

    #[test]
    fn bad_lanes_keys_are_named() {
        let key = |doc: &str| parse_runs(doc).unwrap_err().key;
        let with =
            |doc: &str, extra: &str| doc.replacen("\"peers\"", &format!("{extra}, \"peers\""), 1);
        // Unknown keys, at both levels.
        let e = parse_runs(&with(LANES, r#""hott": 3"#)).unwrap_err();
        assert!(
            e.key.starts_with("lanes") && e.message.contains("hott"),
            "{e}"
        );
        assert_eq!(
            key(&with(LANES, r#""usage": {"decay": 0.5}"#)),
            "lanes.usage.decay"
        );
        assert_eq!(key(&LANES.replace("mbw_mr", "mbw")), "lanes.workload");
        assert_eq!(
            key(&with(LANES, r#""receiver_view": "theirs""#)),
            "lanes.receiver_view"
        );
        // Values out of range.
        assert_eq!(
            key(&LANES.replace("\"peers\": 20", "\"peers\": 1")),
            "lanes.peers"
        );
        assert_eq!(
            key(&LANES.replace("\"hot\": 3", "\"hot\": 20")),
            "lanes.hot"
        );
        assert_eq!(key(&LANES.replace(", \"hot\": 3", "")), "lanes.hot");
        assert_eq!(key(&with(LANES, r#""receivers": 0"#)), "lanes.receivers");
        assert_eq!(
            key(&with(LANES, r#""hot_rate_per_sec": 0"#)),
            "lanes.hot_rate_per_sec"
        );
        assert_eq!(
            key(&with(LANES, r#""cold_interval_ms": -1"#)),
            "lanes.cold_interval_ms"
        );
        assert_eq!(key(&with(LANES, r#""jitter_us": 3"#)), "lanes.jitter_us");
        assert_eq!(key(&with(LANES, r#""tick_us": 0"#)), "lanes.tick_us");
        assert_eq!(key(&with(LANES, r#""tick_us": 1000001"#)), "lanes.tick_us");
        assert_eq!(
            key(&with(LANES, r#""hot_rate_per_sec": 1e15"#)),
            "lanes.hot_rate_per_sec"
        );
        assert_eq!(
            key(&with(LANES, r#""cold_interval_ms": 1e-9"#)),
            "lanes.cold_interval_ms"
        );
        assert_eq!(
            key(&with(LANES, r#""reply_every": 18446744073709551615"#)),
            "lanes.reply_every"
        );
        assert_eq!(
            key(&with(LANES, r#""message_size": 18446744073709551615"#)),
            "lanes.message_size"
        );
        assert_eq!(
            key(&with(
                LANES,
                r#""request_timeout_ms": 18446744073709551615"#
            )),
            "lanes.request_timeout_ms"
        );
        assert_eq!(
            key(&with(LANES, r#""receivers": 18446744073709551615"#)),
            "lanes.receivers"
        );
        assert_eq!(
            key(&with(LANES, r#""usage": {"progress_factor": 0}"#)),
            "lanes.usage.progress_factor"
        );
        assert_eq!(key(&ALLTOALL.replace("4000", "1e12")), "lanes.rate_per_sec");
        assert_eq!(
            key(&with(LANES, r#""message_size": 0"#)),
            "lanes.message_size"
        );
        assert_eq!(
            key(&LANES.replace("\"max_dedicated\": 4", "\"max_dedicated\": 100000")),
            "lanes.max_dedicated"
        );
        assert_eq!(
            key(&with(LANES, r#""remove_thresh": -1"#)),
            "lanes.remove_thresh"
        );
        assert_eq!(key(&with(LANES, r#""min_score": 1.5"#)), "lanes.min_score");
        assert_eq!(
            key(&with(LANES, r#""deny_backoff_ms": 0"#)),
            "lanes.deny_backoff_ms"
        );
        assert_eq!(
            key(&with(LANES, r#""request_timeout_ms": 0"#)),
            "lanes.request_timeout_ms"
        );
        assert_eq!(
            key(&with(LANES, r#""usage": {"promote_thresh": 30}"#)),
            "lanes.usage.promote_thresh"
        );
        assert_eq!(
            key(&with(LANES, r#""usage": {"decay_adder": 2}"#)),
            "lanes.usage.decay_adder"
        );
        assert_eq!(
            key(&with(LANES, r#""usage": {"switch_interval_us": 0}"#)),
            "lanes.usage.switch_interval_us"
        );
        // Keys of the other workload.
        assert_eq!(
            key(&with(LANES, r#""rate_per_sec": 5"#)),
            "lanes.rate_per_sec"
        );
        assert_eq!(key(&with(LANES, r#""order": "random""#)), "lanes.order");
        assert_eq!(key(&with(ALLTOALL, r#""hot": 2"#)), "lanes.hot");
        assert_eq!(
            key(&with(ALLTOALL, r#""reply_every": 2"#)),
            "lanes.reply_every"
        );
        assert_eq!(
            key(&ALLTOALL.replace(", \"rate_per_sec\": 4000", "")),
            "lanes.rate_per_sec"
        );
        assert_eq!(key(&ALLTOALL.replace("4000", "0")), "lanes.rate_per_sec");
        // Keys of a rails scenario.
        let rails = LANES.replace(
            "\"lanes\"",
            r#""rails": [{"name": "r0", "gbps": 100}], "lanes""#,
        );
        assert_eq!(key(&rails), "rails");
        let policy = LANES.replace("\"lanes\"", r#""policy": {}, "lanes""#);
        assert_eq!(key(&policy), "policy");
        // In a run.
        let doc = LANES.strip_suffix('}').unwrap().to_owned()
            + r#", "runs": [{"name": "x", "lanes": {"peers": 0}}]}"#;
        assert_eq!(key(&doc), "runs[0].lanes.peers");
        // Without lanes, rails and workloads are required as before.
        let e = parse_runs(r#"{"name": "x", "duration_ms": 10}"#).unwrap_err();
        assert_eq!(e.key, "rails");
    }
}
