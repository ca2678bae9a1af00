//! The `lanes` section: dynamic lanes for small messages (UCX's dynamic transport
//! selection): which peers get a dedicated lane, negotiated with them, following the traffic.

use super::*;
use multirail_policy::lanes::LanesConfig;
use multirail_policy::usage::UsageConfig;

/// Dynamic lanes. Every peer starts on the shared lane; the send path samples which peers
/// this engine sends to most ([`multirail_policy::usage`]), and the busiest are negotiated
/// onto dedicated lanes with the receiver ([`multirail_policy::lanes`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamicLanesConfig {
    /// Negotiate lanes from the traffic (default true). When false, lanes change only through
    /// `Engine::switch_lane`, and requests from peers are denied.
    pub dynamic: bool,
    /// Most dedicated lanes this engine grants to senders, and, separately, holds to
    /// receivers (default 16; 0 = none; UCX's `UCX_MAX_PRIORITY_EPS` is 20). Each granted
    /// lane costs a receive pool of its own (`transports.<tcp|shm|rdma>.receive`: 64 buffers
    /// of 8 KiB, 512 KiB, by default); NICs slow down once the connections in use outgrow
    /// their context cache, so the bound stays small.
    pub max_dedicated: usize,
    /// Least usage score at which this engine asks a peer for a dedicated lane (default 0.5,
    /// within [0, 1]): a peer touched in about three progress rounds in a row.
    pub min_score: f64,
    /// Score margin that keeps the current holder of a lane or rank (default 0.2, UCX's).
    pub remove_thresh: f64,
    /// Peers the usage tracker keeps (default 20, UCX's).
    pub promote_capacity: usize,
    /// Peers the usage tracker promotes at once (default 10, UCX's).
    pub promote_thresh: usize,
    /// Score decay multiplier per progress round (default 0.8, UCX's).
    pub decay_multiplier: f64,
    /// Score added per progress round to a peer sent to (default 0.2, UCX's).
    pub decay_adder: f64,
    /// Least time between two sampled sends counted by the tracker, in µs (default 1000;
    /// UCX's `UCX_DYNAMIC_TL_SWITCH_INTERVAL`, infinite there, which disables selection).
    pub switch_interval_us: u64,
    /// Sampled rounds per progress (scoring) round (default 10, UCX's
    /// `UCX_DYNAMIC_TL_PROGRESS_FACTOR`).
    pub progress_factor: u32,
    /// One send in this many is sampled (default 32, UCX's).
    pub sample_period: u32,
    /// How long a denied peer waits before asking again, in ms (default 1000).
    pub deny_backoff_ms: u64,
    /// How long a request waits for its answer, in ms (default 100).
    pub request_timeout_ms: u64,
}

impl Default for DynamicLanesConfig {
    fn default() -> Self {
        let usage = UsageConfig::default();
        let lanes = LanesConfig::default();
        DynamicLanesConfig {
            dynamic: true,
            max_dedicated: lanes.max_dedicated,
            min_score: lanes.min_score,
            remove_thresh: usage.remove_thresh,
            promote_capacity: usage.promote_capacity,
            promote_thresh: usage.promote_thresh,
            decay_multiplier: usage.decay_multiplier,
            decay_adder: usage.decay_adder,
            switch_interval_us: 1000,
            progress_factor: usage.progress_factor,
            sample_period: usage.sample_period,
            deny_backoff_ms: lanes.deny_backoff_ns / 1_000_000,
            request_timeout_ms: lanes.request_timeout_ns / 1_000_000,
        }
    }
}

impl DynamicLanesConfig {
    /// The usage tracker's settings.
    pub fn usage(&self) -> UsageConfig {
        UsageConfig {
            promote_capacity: self.promote_capacity,
            promote_thresh: self.promote_thresh,
            remove_thresh: self.remove_thresh,
            decay_multiplier: self.decay_multiplier,
            decay_adder: self.decay_adder,
            switch_interval_ns: Some(self.switch_interval_us.saturating_mul(1000)),
            progress_factor: self.progress_factor,
            sample_period: self.sample_period,
        }
    }

    /// The negotiation's settings.
    pub fn negotiation(&self) -> LanesConfig {
        LanesConfig {
            max_dedicated: self.max_dedicated,
            min_score: self.min_score,
            remove_thresh: self.remove_thresh,
            deny_backoff_ns: self.deny_backoff_ms.saturating_mul(1_000_000),
            request_timeout_ns: self.request_timeout_ms.saturating_mul(1_000_000),
        }
    }

    /// Checks every key; the error names the first bad one under `prefix`.
    pub(crate) fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        at_least_one(prefix, "switch_interval_us", self.switch_interval_us)?;
        at_least_one(prefix, "deny_backoff_ms", self.deny_backoff_ms)?;
        at_least_one(prefix, "request_timeout_ms", self.request_timeout_ms)?;
        self.usage().validate().map_err(|e| {
            // The tracker names its fields as this section does, except the interval.
            let key = match e.key {
                "switch_interval_ns" => "switch_interval_us",
                k => k,
            };
            ConfigError::new(format!("{prefix}.{key}"), e.message)
        })?;
        self.negotiation().validate().map_err(|e| match e {
            multirail_policy::lanes::LanesError::Config { field, message } => {
                let key = match field {
                    "deny_backoff_ns" => "deny_backoff_ms",
                    "request_timeout_ns" => "request_timeout_ms",
                    f => f,
                };
                ConfigError::new(format!("{prefix}.{key}"), message)
            }
            other => ConfigError::new(prefix.to_string(), other.to_string()),
        })
    }
}
