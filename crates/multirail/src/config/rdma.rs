//! The `transports.rdma` section: TENT's scheduling and QoS keys, which apply to every
//! transport that carries rails.

use multirail_policy::qos::PromotionConfig;
use multirail_policy::selector::{BandwidthEstimator, SelectorConfig};

use super::*;

/// TENT's keys; they apply to every transport that carries rails (TCP too) so a TENT file works unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RdmaConfig {
    /// EWMA-based rail selection (true) or round-robin within the best NUMA tier (false).
    pub enable_smart_scheduling: bool,
    /// Score multiplier per NUMA tier (tier 0 = local); each finite and >= 0, at least one.
    pub numa_penalties: Vec<f64>,
    /// EWMA weight of the old estimate, within [0, 1]: 0 = take each observation, 1 = never learn.
    pub bandwidth_learning_rate: f64,
    /// Lower clamp of the estimate as a fraction of theoretical bandwidth, applied only by
    /// `bandwidth_estimator` `"tent"`; > 0.
    pub ewma_min_bandwidth_multiplier: f64,
    /// Upper clamp of the estimate as a multiple of theoretical bandwidth (both estimators);
    /// >= the min multiplier.
    pub ewma_max_bandwidth_multiplier: f64,
    /// Random jitter added to scores so ties do not always pick the same rail; >= 0.
    pub score_jitter_range: f64,
    /// Guards score divisions against zero; > 0.
    pub score_epsilon: f64,
    /// Bandwidth assumed when the NIC's is unknown or out of [min, max]; > 0.
    pub default_bandwidth_gbps: f64,
    /// Smallest plausible NIC bandwidth; > 0.
    pub min_bandwidth_gbps: f64,
    /// Largest plausible NIC bandwidth; >= `min_bandwidth_gbps`.
    pub max_bandwidth_gbps: f64,
    /// Filter rails by request priority.
    pub enable_priority_filtering: bool,
    /// Local device priority rotation interval in microseconds; >= 1.
    pub local_rotation_interval_us: u64,
    /// Wait after which a queued request is promoted one priority level, in microseconds; >= 1.
    pub priority_promotion_timeout_us: u64,
    /// How often promotion is checked, in microseconds; >= 1.
    pub priority_promotion_check_us: u64,
    /// Global QoS slot length in milliseconds; >= 1.
    pub slot_rotation_interval_ms: u64,
    /// Shared-memory name for cross-process slot coordination; "" = single-process mode.
    pub shared_quota_shm_path: String,
    /// Let lower priorities use a slot that the allowed priorities leave idle.
    pub qos_work_conserving: bool,
    /// multirail's own: promote a waiting request only when its priority level has not been
    /// served for `priority_promotion_timeout_us` (it is starved), not merely because it waits
    /// behind its own level's backlog (default true; false = TENT's plain timeout).
    pub qos_promote_only_when_starved: bool,
    /// multirail's own: busy time, in microseconds, a rail's bandwidth sample must span before
    /// the EWMA learns from it (default 1000; 0 = every slice is a sample, as TENT does).
    pub bandwidth_sample_min_us: u64,
    /// multirail's own: bytes a rail's bandwidth sample must also hold (default 1048576, eight
    /// default slices; 0..=1 GiB; only with `bandwidth_sample_min_us` > 0), so that the burst
    /// a token-bucket policer lets through after a pause is diluted instead of measured.
    pub bandwidth_sample_min_bytes: u64,
    /// multirail's own: how a rail's bandwidth estimate learns. `"delivery"` (default): the
    /// largest delivery rate measured within `bandwidth_window_us`, with no floor tied to the
    /// NIC's reported speed, so a rail policed far below it is learned as it is; `"tent"`:
    /// TENT's EWMA clamped to `ewma_min_bandwidth_multiplier`..`ewma_max_bandwidth_multiplier`
    /// of the reported speed. In both, samples taken while a rail was idle, had nothing
    /// queued or was held back by its window may raise the estimate, never lower it.
    pub bandwidth_estimator: String,
    /// multirail's own: window of the delivery estimator's max filter, microseconds (default
    /// 20000; 0..=10,000,000; 0 = the latest sample). A rail whose rate falls is followed
    /// about this long after.
    pub bandwidth_window_us: u64,
    /// multirail's RDMA transport: use RDMA devices when there are any (default true).
    pub enable: bool,
    /// RDMA devices to use, as `device` or `device/port` (e.g. `["mlx5_0", "mlx5_1/1"]`);
    /// empty = every active port (default).
    pub devices: Vec<String>,
    /// Connections (endpoints: a peer's queue pairs on one local/remote device pair) this
    /// engine keeps; past it the least recently used is closed (default 256, Mooncake's
    /// `max_ep_per_ctx`; 1..=65536).
    pub max_endpoints: usize,
    /// Send-queue depth of a queue pair: work requests it may have outstanding (default 256,
    /// Mooncake's `max_wr`; 16..=32768).
    pub max_wr: u32,
    /// Largest message sent inline (copied into the work request, no registration or DMA
    /// read; default 400 bytes, RAMCloud's; 0..=4096).
    pub max_inline_data: u32,
    /// Slice work requests between two signalled ones on a queue pair: the rest complete
    /// silently with the next signalled one (default 16; 1 = signal every slice; 1..=max_wr/2).
    pub signal_interval: u32,
    /// Largest path MTU to use, bytes: 256, 512, 1024, 2048 or 4096 (default 4096). A path
    /// takes the smallest of this and both ports' active MTUs.
    pub mtu: u32,
    /// GID index to use on every port; -1 = choose (RoCE v2 with an IPv4 address first;
    /// default -1).
    pub gid_index: i32,
    /// Local ACK timeout code: 4.096 µs × 2^N before a packet is retransmitted (default 14,
    /// 67 ms; 1..=31).
    pub qp_timeout: u8,
    /// Retransmissions before a queue pair gives up and errors (default 7, the most; 0..=7).
    pub retry_cnt: u8,
    /// Bandwidth-delay products bulk keeps in flight on an RDMA rail beside HIGH work (default
    /// 2; 0.1..=64, at most `workers.window.bdps`); `workers.window.lean_bdps` (1) is the TCP
    /// rails'. HIGH has a queue pair of its own on the NIC, so bulk's margin does not sit in
    /// front of it as bulk bytes in a TCP connection's buffers do; and with 1 the simulated
    /// 8 x 400 Gbps host kept a quarter of the line rate beside HIGH (0.99 with 2, HIGH p99
    /// 1.45 x alone; `sim/scenarios/qos-8x400.json`): a window of one product leaves the rail
    /// idle between answers, the bandwidth measured over its busy time falls, and the product
    /// computed from it with it.
    pub lean_bdps: f64,
    /// The receive path of messages over RDMA (SEND/RECV): RAMCloud's InfRc defaults, a
    /// shared receive queue per device of 63 buffers (`MAX_SHARED_RX_QUEUE_DEPTH`), one
    /// registration chunk, one scatter/gather entry per receive.
    pub receive: ReceiveConfig,
    /// Group multicast defaults for groups whose writes go over RDMA.
    pub multicast: MulticastConfig,
}

impl Default for RdmaConfig {
    /// TENT's defaults, from the policy crate's own (written once there).
    fn default() -> Self {
        let sel = SelectorConfig::default();
        let promotion = PromotionConfig::default();
        RdmaConfig {
            enable_smart_scheduling: sel.enable_smart_scheduling,
            numa_penalties: sel.numa_penalties,
            bandwidth_learning_rate: sel.bandwidth_learning_rate,
            ewma_min_bandwidth_multiplier: sel.ewma_min_bandwidth_multiplier,
            ewma_max_bandwidth_multiplier: sel.ewma_max_bandwidth_multiplier,
            score_jitter_range: sel.score_jitter_range,
            score_epsilon: sel.score_epsilon,
            default_bandwidth_gbps: sel.default_bandwidth_gbps,
            min_bandwidth_gbps: sel.min_bandwidth_gbps,
            max_bandwidth_gbps: sel.max_bandwidth_gbps,
            enable_priority_filtering: true,
            local_rotation_interval_us: 200,
            priority_promotion_timeout_us: promotion.timeout_ns / 1000,
            priority_promotion_check_us: promotion.check_ns / 1000,
            slot_rotation_interval_ms: 2,
            shared_quota_shm_path: String::new(),
            qos_work_conserving: true,
            qos_promote_only_when_starved: promotion.only_when_starved,
            bandwidth_sample_min_us: sel.min_sample_ns / 1000,
            bandwidth_sample_min_bytes: sel.min_sample_bytes,
            bandwidth_estimator: sel.estimator.name().to_string(),
            bandwidth_window_us: sel.bandwidth_window_ns / 1000,
            enable: true,
            devices: Vec::new(),
            max_endpoints: 256,
            max_wr: 256,
            max_inline_data: 400,
            signal_interval: 16,
            mtu: 4096,
            gid_index: -1,
            qp_timeout: 14,
            retry_cnt: 7,
            lean_bdps: 2.0,
            receive: ReceiveConfig {
                queue_depth: 63,
                shared_receive_queue: true,
                ..ReceiveConfig::default()
            },
            multicast: MulticastConfig::default(),
        }
    }
}

/// Keys of [`RdmaConfig`]; used to point a misplaced TENT fragment at `transports.rdma`.
pub(crate) const RDMA_KEYS: &[&str] = &[
    "enable_smart_scheduling",
    "numa_penalties",
    "bandwidth_learning_rate",
    "ewma_min_bandwidth_multiplier",
    "ewma_max_bandwidth_multiplier",
    "score_jitter_range",
    "score_epsilon",
    "default_bandwidth_gbps",
    "min_bandwidth_gbps",
    "max_bandwidth_gbps",
    "enable_priority_filtering",
    "local_rotation_interval_us",
    "priority_promotion_timeout_us",
    "priority_promotion_check_us",
    "slot_rotation_interval_ms",
    "shared_quota_shm_path",
    "qos_work_conserving",
    "qos_promote_only_when_starved",
    "bandwidth_sample_min_us",
    "bandwidth_sample_min_bytes",
    "bandwidth_estimator",
    "bandwidth_window_us",
    "enable",
    "devices",
    "max_endpoints",
    "max_wr",
    "max_inline_data",
    "signal_interval",
    "mtu",
    "gid_index",
    "qp_timeout",
    "retry_cnt",
    "lean_bdps",
    "receive",
    "multicast",
];

impl RdmaConfig {
    /// The selector settings these keys give (`multirail_policy::selector`).
    pub fn selector_config(&self) -> SelectorConfig {
        SelectorConfig {
            enable_smart_scheduling: self.enable_smart_scheduling,
            numa_penalties: self.numa_penalties.clone(),
            bandwidth_learning_rate: self.bandwidth_learning_rate,
            ewma_min_bandwidth_multiplier: self.ewma_min_bandwidth_multiplier,
            ewma_max_bandwidth_multiplier: self.ewma_max_bandwidth_multiplier,
            score_jitter_range: self.score_jitter_range,
            score_epsilon: self.score_epsilon,
            default_bandwidth_gbps: self.default_bandwidth_gbps,
            min_bandwidth_gbps: self.min_bandwidth_gbps,
            max_bandwidth_gbps: self.max_bandwidth_gbps,
            min_sample_ns: self.bandwidth_sample_min_us.saturating_mul(1000),
            min_sample_bytes: self.bandwidth_sample_min_bytes,
            // Validation refuses any other name; unvalidated, the default applies.
            estimator: BandwidthEstimator::from_name(&self.bandwidth_estimator).unwrap_or_default(),
            bandwidth_window_ns: self.bandwidth_window_us.saturating_mul(1000),
        }
    }

    /// The promotion settings these keys give (`multirail_policy::qos`).
    pub fn promotion(&self) -> PromotionConfig {
        PromotionConfig {
            timeout_ns: self.priority_promotion_timeout_us.saturating_mul(1000),
            check_ns: self.priority_promotion_check_us.saturating_mul(1000),
            only_when_starved: self.qos_promote_only_when_starved,
        }
    }

    pub(crate) fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        if self.numa_penalties.is_empty() {
            return Err(ConfigError::new(
                format!("{prefix}.numa_penalties"),
                "must list at least one penalty (tier 0 = local NUMA)",
            ));
        }
        for (i, &p) in self.numa_penalties.iter().enumerate() {
            if !(p.is_finite() && p >= 0.0) {
                return Err(ConfigError::new(
                    format!("{prefix}.numa_penalties[{i}]"),
                    format!("must be a finite number >= 0, got {p}"),
                ));
            }
        }
        let rate = self.bandwidth_learning_rate;
        // The negated form also rejects NaN.
        if !((0.0..=1.0).contains(&rate)) {
            return Err(ConfigError::new(
                format!("{prefix}.bandwidth_learning_rate"),
                format!("must be within [0, 1], got {rate}"),
            ));
        }
        positive(
            prefix,
            "ewma_min_bandwidth_multiplier",
            self.ewma_min_bandwidth_multiplier,
        )?;
        finite(
            prefix,
            "ewma_max_bandwidth_multiplier",
            self.ewma_max_bandwidth_multiplier,
        )?;
        if self.ewma_max_bandwidth_multiplier < self.ewma_min_bandwidth_multiplier {
            return Err(ConfigError::new(
                format!("{prefix}.ewma_max_bandwidth_multiplier"),
                format!(
                    "must be at least ewma_min_bandwidth_multiplier ({}), got {}",
                    self.ewma_min_bandwidth_multiplier, self.ewma_max_bandwidth_multiplier
                ),
            ));
        }
        finite(prefix, "score_jitter_range", self.score_jitter_range)?;
        if self.score_jitter_range < 0.0 {
            return Err(ConfigError::new(
                format!("{prefix}.score_jitter_range"),
                format!("must be >= 0, got {}", self.score_jitter_range),
            ));
        }
        positive(prefix, "score_epsilon", self.score_epsilon)?;
        positive(
            prefix,
            "default_bandwidth_gbps",
            self.default_bandwidth_gbps,
        )?;
        positive(prefix, "min_bandwidth_gbps", self.min_bandwidth_gbps)?;
        finite(prefix, "max_bandwidth_gbps", self.max_bandwidth_gbps)?;
        if self.min_bandwidth_gbps > self.max_bandwidth_gbps {
            return Err(ConfigError::new(
                format!("{prefix}.min_bandwidth_gbps"),
                format!(
                    "must not exceed max_bandwidth_gbps ({}), got {}",
                    self.max_bandwidth_gbps, self.min_bandwidth_gbps
                ),
            ));
        }
        at_least_one(
            prefix,
            "local_rotation_interval_us",
            self.local_rotation_interval_us,
        )?;
        at_least_one(
            prefix,
            "priority_promotion_timeout_us",
            self.priority_promotion_timeout_us,
        )?;
        at_least_one(
            prefix,
            "priority_promotion_check_us",
            self.priority_promotion_check_us,
        )?;
        at_least_one(
            prefix,
            "slot_rotation_interval_ms",
            self.slot_rotation_interval_ms,
        )?;
        let within = |key: &str, v: u64, lo: u64, hi: u64| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(ConfigError::new(
                    format!("{prefix}.{key}"),
                    format!("must be within {lo}..={hi}, got {v}"),
                ))
            }
        };
        for (i, d) in self.devices.iter().enumerate() {
            let ok = match d.split_once('/') {
                Some((dev, port)) => !dev.is_empty() && port.parse::<u8>().is_ok_and(|p| p >= 1),
                None => !d.is_empty(),
            };
            if !ok {
                return Err(ConfigError::new(
                    format!("{prefix}.devices[{i}]"),
                    format!("must be DEVICE or DEVICE/PORT (port from 1), got {d:?}"),
                ));
            }
        }
        if BandwidthEstimator::from_name(&self.bandwidth_estimator).is_none() {
            return Err(ConfigError::new(
                format!("{prefix}.bandwidth_estimator"),
                format!(
                    "must be \"delivery\" or \"tent\", got {:?}",
                    self.bandwidth_estimator
                ),
            ));
        }
        within(
            "bandwidth_window_us",
            self.bandwidth_window_us,
            0,
            10_000_000,
        )?;
        within(
            "bandwidth_sample_min_bytes",
            self.bandwidth_sample_min_bytes,
            0,
            1 << 30,
        )?;
        within("max_endpoints", self.max_endpoints as u64, 1, 65536)?;
        within("max_wr", self.max_wr.into(), 16, 32768)?;
        within("max_inline_data", self.max_inline_data.into(), 0, 4096)?;
        within(
            "signal_interval",
            self.signal_interval.into(),
            1,
            u64::from(self.max_wr / 2),
        )?;
        if ![256, 512, 1024, 2048, 4096].contains(&self.mtu) {
            return Err(ConfigError::new(
                format!("{prefix}.mtu"),
                format!("must be 256, 512, 1024, 2048 or 4096, got {}", self.mtu),
            ));
        }
        if !(-1..=255).contains(&self.gid_index) {
            return Err(ConfigError::new(
                format!("{prefix}.gid_index"),
                format!("must be -1 (choose) or 0..=255, got {}", self.gid_index),
            ));
        }
        within("qp_timeout", self.qp_timeout.into(), 1, 31)?;
        within("retry_cnt", self.retry_cnt.into(), 0, 7)?;
        if !(0.1..=64.0).contains(&self.lean_bdps) {
            return Err(ConfigError::new(
                format!("{prefix}.lean_bdps"),
                format!("must be within 0.1..=64, got {}", self.lean_bdps),
            ));
        }
        self.receive.validate(&format!("{prefix}.receive"))?;
        self.multicast.validate(&format!("{prefix}.multicast"))
    }
}
