//! Scenario files: the modelled host (rails), the policy settings, the workloads, the link
//! events, and the runs to compare; or, for a lanes scenario ([`LanesScenario`], key `lanes`),
//! the processes, their traffic and the usage-tracker and lane-negotiation settings.
//!
//! A file is one JSON document. `runs` lists variants of it: each run is a partial scenario
//! deep-merged into the base (so `{"name": "round-robin", "policy": {"enable_smart_scheduling":
//! false}}` changes one key). Policy keys carry the engine's configuration names, and their
//! defaults are the policy crate's, mapped to the policy structs in [`Policy`] only.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use multirail_policy::dispatch::{
    BdpController, ControllerKind, DispatchConfig, FixedController, DEFAULT_HIGH_WAIT_NS,
    DEFAULT_MIN_BULK_CHUNK,
};
use multirail_policy::health::HealthConfig;
use multirail_policy::lanes::{LanesConfig, LanesError};
use multirail_policy::qos::{Priority, PromotionConfig};
use multirail_policy::selector::SelectorConfig;
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
    /// Simulated time, milliseconds.
    pub duration_ms: u64,
    /// Width of a throughput sample (timeline and plot), milliseconds (default 10).
    #[serde(default = "default_sample_ms")]
    pub sample_ms: u64,
    /// Seed of the selector's jitter and of Poisson arrivals.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// The initiator's NICs; the target reaches each (one path per rail). Required unless the
    /// scenario is a lanes scenario, which has none.
    #[serde(default)]
    pub rails: Vec<Rail>,
    /// Policy settings.
    #[serde(default)]
    pub policy: Policy,
    /// Who submits what. Required unless the scenario is a lanes scenario, which has none.
    #[serde(default)]
    pub workloads: Vec<Workload>,
    /// Link changes during the run.
    #[serde(default)]
    pub events: Vec<LinkEvent>,
    /// A lanes scenario instead of rails and workloads: processes negotiating dedicated
    /// lanes ([`LanesScenario`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lanes: Option<LanesScenario>,
    /// A group multicast scenario instead of rails and workloads ([`MulticastScenario`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multicast: Option<MulticastScenario>,
    /// Variants to run (only in the file's base document).
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
    /// Line rate, Gbit/s.
    pub gbps: f64,
    /// What the NIC reports to the selector, Gbit/s (default: `gbps`). A veth shaped by tc
    /// reports 10 whatever its shaping.
    #[serde(default)]
    pub reported_gbps: Option<f64>,
    /// One-way latency, microseconds (default 2).
    #[serde(default = "default_latency_us")]
    pub latency_us: f64,
    /// Message-rate limit, operations per second (0 = none).
    #[serde(default)]
    pub ops_per_sec: f64,
    /// NUMA node of the NIC (default 0).
    #[serde(default)]
    pub numa_node: i32,
    /// Payload bytes per byte on the wire (default 1; TCP over 1500-byte Ethernet frames
    /// carries 1448 of every 1514).
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
    /// The engine's `transports.rdma.bandwidth_sample_min_us`.
    pub bandwidth_sample_min_us: u64,
    /// Promotion (`priority_promotion_timeout_us`, `priority_promotion_check_us`).
    pub priority_promotion_timeout_us: u64,
    /// See above.
    pub priority_promotion_check_us: u64,
    /// `qos_promote_only_when_starved`.
    pub qos_promote_only_when_starved: bool,
    /// Slicing (`workers.*`).
    pub block_size: u64,
    /// `workers.max_slices_per_request` (READ).
    pub max_slices_per_request: u32,
    /// `workers.max_slices_per_write`.
    pub max_slices_per_write: u32,
    /// Window controller (`workers.window.*`): `bdp` or `fixed`.
    pub window_controller: String,
    /// `workers.window.bdps`.
    pub window_bdps: f64,
    /// `workers.window.lean_bdps`.
    pub window_lean_bdps: f64,
    /// `workers.window.max_queue_us`.
    pub window_max_queue_us: u64,
    /// `workers.window.initial_bytes`.
    pub window_initial_bytes: u64,
    /// `workers.window.fixed_bytes`.
    pub window_fixed_bytes: u64,
    /// `workers.bulk_chunk_wait_us`.
    pub bulk_chunk_wait_us: u64,
    /// `workers.min_bulk_chunk`.
    pub min_bulk_chunk: u64,
    /// `transports.tcp.timeout_ms`.
    pub timeout_ms: u64,
    /// `transports.tcp.max_retries`.
    pub max_retries: u32,
    /// `transports.tcp.connections_per_rail` (a path has one more, for HIGH).
    pub connections_per_rail: usize,
    /// Rail health: errors that pause a rail.
    pub health_error_threshold: u32,
    /// Rail health: first pause, ms.
    pub health_initial_pause_ms: u64,
    /// Rail health: longest pause, ms.
    pub health_max_pause_ms: u64,
    /// The engine's link check interval (link state, reconnects), ms (50).
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
    /// Request size, bytes.
    pub size: u64,
    /// Submitters (closed loop).
    #[serde(default = "one_usize")]
    pub threads: usize,
    /// Requests per batch (closed loop).
    #[serde(default = "one_usize")]
    pub batch: usize,
    /// NUMA node of the buffers.
    #[serde(default)]
    pub numa_node: i32,
    /// How requests arrive (default closed).
    #[serde(default = "default_arrival")]
    pub arrival: Arrival,
    /// For `interval`: the gap, microseconds.
    #[serde(default)]
    pub interval_us: f64,
    /// For `poisson`: requests per second.
    #[serde(default)]
    pub rate_per_sec: f64,
    /// Starts at, ms (default 0).
    #[serde(default)]
    pub start_ms: u64,
    /// Stops submitting at, ms (default: the end).
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
    /// When, ms.
    pub at_ms: u64,
    /// Which rail (index).
    pub rail: usize,
    /// `fail`, `recover` or `rate`.
    pub action: String,
    /// For `rate`: the new line rate, Gbit/s.
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

/// A lanes scenario: `peers` processes, each driving its own `UsageTracker` (sampled on its
/// send path: `should_sample`, then `on_sample`, which runs `progress` as the tracker's
/// settings say) and two `Lanes` machines, one asking for lanes for what it sends and one
/// granting lanes for what it receives, exchanging lane messages with a modelled one-way
/// latency. Defaults are the policy crate's, except `usage.switch_interval_us` (the policy's
/// default is off).
/// A group multicast in the manner of Derecho's SMC ([`crate::multicast`]): `members`
/// processes, `senders` of them sending `message_bytes` messages as fast as their ring of
/// `window` slots allows, pushes and acknowledgements decided by the real
/// `multirail_policy::coalesce` planners, every one-sided write charged to the NIC.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MulticastScenario {
    /// Group members (at least 2).
    #[serde(default = "default_members")]
    pub members: u64,
    /// Members that send (1 to `members`).
    #[serde(default = "default_senders")]
    pub senders: u64,
    /// Payload of each message, bytes.
    #[serde(default = "default_message_bytes")]
    pub message_bytes: u64,
    /// Slots of each sender's ring.
    #[serde(default = "default_mcast_window")]
    pub window: u64,
    /// `off`, `opportunistic` or `k:N`.
    #[serde(default = "default_batching")]
    pub batching: String,
    /// With `k:N`: longest a held-back push or acknowledgement waits, µs.
    #[serde(default = "default_flush_us")]
    pub flush_us: u64,
    /// The NIC's line rate, Gbps (each sender's payload to every other member counts).
    #[serde(default = "default_nic_gbps")]
    pub nic_gbps: f64,
    /// The NIC's one-sided write rate, millions a second. As in the seed's arithmetic, every
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
        if self.members < 2 {
            return Err(bad("members", "must be at least 2"));
        }
        if self.senders == 0 || self.senders > self.members {
            return Err(bad(
                "senders",
                format!("must be within [1, members {}]", self.members),
            ));
        }
        if self.message_bytes == 0 {
            return Err(bad("message_bytes", "must be at least 1"));
        }
        if !positive(self.nic_gbps) {
            return Err(bad("nic_gbps", "must be > 0"));
        }
        if !positive(self.nic_mops) {
            return Err(bad("nic_mops", "must be > 0"));
        }
        self.batching().map(|_| ())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LanesScenario {
    /// Processes (at least 2).
    pub peers: usize,
    /// `mbw_mr` or `alltoall`.
    pub workload: LanesWorkload,
    /// mbw_mr: hot senders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot: Option<usize>,
    /// mbw_mr: receivers (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receivers: Option<usize>,
    /// mbw_mr: messages a second of each hot sender (default 1,000,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_rate_per_sec: Option<f64>,
    /// mbw_mr: gap between two messages of a cold sender, ms (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_interval_ms: Option<f64>,
    /// mbw_mr: the receiver answers every this-many-th message of a sender (default 64,
    /// osu_mbw_mr's window); 0: it sends nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_every: Option<u64>,
    /// alltoall: messages a second of each process, over all its peers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_sec: Option<f64>,
    /// alltoall: `round_robin` (default) or `random`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<SendOrder>,
    /// Bytes of an application message (default 128); counts the payload rate only.
    #[serde(default = "default_message_size")]
    pub message_size: u64,
    /// One-way latency of a lane message, microseconds (default 2).
    #[serde(default = "default_latency_us")]
    pub latency_us: f64,
    /// Each lane message's latency is `latency_us` plus or minus up to this, uniformly,
    /// microseconds (default 0.5); messages of a pair still arrive in the order sent.
    #[serde(default = "default_jitter_us")]
    pub jitter_us: f64,
    /// Sends are simulated in batches, one per process per tick of this many microseconds
    /// (default 1000); each send of a batch still goes through `should_sample`.
    #[serde(default = "default_tick_us")]
    pub tick_us: u64,
    /// Whose score a process keeps for peers it accepted (default `request`).
    #[serde(default = "default_receiver_view")]
    pub receiver_view: ReceiverView,
    /// The lanes driver runs the tracker's progress itself when it has not progressed for two
    /// scoring rounds, as the engine's does (default true); false only to compare.
    #[serde(default = "default_idle_progress")]
    pub idle_progress: bool,
    /// `LanesConfig::max_dedicated`.
    #[serde(default = "default_max_dedicated")]
    pub max_dedicated: usize,
    /// `LanesConfig::remove_thresh`.
    #[serde(default = "default_lanes_remove_thresh")]
    pub remove_thresh: f64,
    /// `LanesConfig::min_score`: the least score at which a process asks for a lane.
    #[serde(default = "default_lanes_min_score")]
    pub min_score: f64,
    /// `LanesConfig::deny_backoff_ns`, in ms.
    #[serde(default = "default_deny_backoff_ms")]
    pub deny_backoff_ms: u64,
    /// `LanesConfig::request_timeout_ns`, in ms.
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
    /// `UsageConfig::promote_capacity`.
    pub promote_capacity: usize,
    /// `UsageConfig::promote_thresh`.
    pub promote_thresh: usize,
    /// `UsageConfig::remove_thresh`.
    pub remove_thresh: f64,
    /// `UsageConfig::decay_multiplier`.
    pub decay_multiplier: f64,
    /// `UsageConfig::decay_adder`.
    pub decay_adder: f64,
    /// `UsageConfig::switch_interval_ns`, in µs (default 10,000: with the default
    /// `progress_factor` a busy process progresses every 100 ms; the policy's default is off).
    pub switch_interval_us: u64,
    /// `UsageConfig::progress_factor`.
    pub progress_factor: u32,
    /// `UsageConfig::sample_period`.
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
                only("order", self.order.is_some(), "alltoall")?;
                let Some(hot) = self.hot else {
                    return Err(bad("hot", "the mbw_mr workload needs it"));
                };
                let receivers = self.receivers();
                if receivers == 0 {
                    return Err(bad("receivers", "must be at least 1"));
                }
                if receivers + hot > self.peers {
                    return Err(bad(
                        "hot",
                        format!(
                            "{hot} hot senders and {receivers} receivers do not fit in {} peers",
                            self.peers
                        ),
                    ));
                }
                if receivers == self.peers {
                    return Err(bad("receivers", "leaves no sender"));
                }
                if !positive(self.hot_rate()) {
                    return Err(bad("hot_rate_per_sec", "must be > 0"));
                }
                if !self.cold_interval_ms.is_none_or(positive) {
                    return Err(bad("cold_interval_ms", "must be > 0"));
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
                    Some(_) => {}
                }
            }
        }
        if self.message_size == 0 {
            return Err(bad("message_size", "must be at least 1"));
        }
        if !(self.latency_us >= 0.0 && self.latency_us.is_finite()) {
            return Err(bad("latency_us", "must be >= 0"));
        }
        if !(self.jitter_us >= 0.0 && self.jitter_us <= self.latency_us) {
            return Err(bad(
                "jitter_us",
                format!(
                    "must be within [0, latency_us = {}], got {}",
                    self.latency_us, self.jitter_us
                ),
            ));
        }
        if self.tick_us == 0 {
            return Err(bad("tick_us", "must be at least 1"));
        }
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
        if self.usage.switch_interval_us == 0 {
            return Err(bad("usage.switch_interval_us", "must be at least 1"));
        }
        self.usage_config()
            .validate()
            .map_err(|e| bad(format!("usage.{}", e.key), e.message))?;
        Ok(())
    }
}

impl Run {
    fn validate(&self) -> Result<(), ScenarioError> {
        if self.duration_ms == 0 {
            return Err(bad("duration_ms", "must be at least 1"));
        }
        if self.sample_ms == 0 {
            return Err(bad("sample_ms", "must be at least 1"));
        }
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
        for (i, r) in self.rails.iter().enumerate() {
            if !(r.gbps > 0.0 && r.gbps.is_finite()) {
                return Err(bad(
                    format!("rails[{i}].gbps"),
                    format!("must be > 0, got {}", r.gbps),
                ));
            }
            if !(r.latency_us >= 0.0 && r.latency_us.is_finite()) {
                return Err(bad(format!("rails[{i}].latency_us"), "must be >= 0"));
            }
            if !(r.ops_per_sec >= 0.0 && r.ops_per_sec.is_finite()) {
                return Err(bad(format!("rails[{i}].ops_per_sec"), "must be >= 0"));
            }
            if !(r.efficiency > 0.0 && r.efficiency <= 1.0) {
                return Err(bad(
                    format!("rails[{i}].efficiency"),
                    "must be within (0, 1]",
                ));
            }
        }
        let p = &self.policy;
        if !["bdp", "fixed"].contains(&p.window_controller.as_str()) {
            return Err(bad(
                "policy.window_controller",
                format!("must be bdp or fixed, got {:?}", p.window_controller),
            ));
        }
        if p.connections_per_rail == 0 {
            return Err(bad("policy.connections_per_rail", "must be at least 1"));
        }
        if p.link_check_ms == 0 {
            return Err(bad("policy.link_check_ms", "must be at least 1"));
        }
        p.plans()?;
        if self.workloads.is_empty() {
            return Err(bad("workloads", "needs at least one workload"));
        }
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
            if w.size == 0 {
                return Err(bad(key("size"), "must be at least 1"));
            }
            if w.threads == 0 || w.batch == 0 {
                return Err(bad(key("threads"), "threads and batch must be at least 1"));
            }
            match w.arrival {
                Arrival::Interval if !positive(w.interval_us) => {
                    return Err(bad(key("interval_us"), "must be > 0 for interval arrivals"))
                }
                Arrival::Poisson if !positive(w.rate_per_sec) => {
                    return Err(bad(key("rate_per_sec"), "must be > 0 for poisson arrivals"))
                }
                _ => {}
            }
        }
        for (i, e) in self.events.iter().enumerate() {
            let key = |k: &str| format!("events[{i}].{k}");
            if e.rail >= self.rails.len() {
                return Err(bad(
                    key("rail"),
                    format!("no rail {} (there are {})", e.rail, self.rails.len()),
                ));
            }
            match e.action.as_str() {
                "fail" | "recover" => {}
                "rate" if e.gbps > 0.0 && e.gbps.is_finite() => {}
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
        assert_eq!(parse_runs("{").unwrap_err().key, "");
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
