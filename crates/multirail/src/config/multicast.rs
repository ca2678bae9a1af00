//! The `transports.<tcp|shm|rdma>.multicast` sections: defaults for group multicast over
//! that transport (see `crate::group`). A group's own settings override them.

use multirail_policy::coalesce::Batching;

use super::*;

/// Group multicast defaults: Derecho's ring sizes and Nagle-like batching settings (Derecho's
/// proposal for SMC batching).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MulticastConfig {
    /// `"off"` (a push and an acknowledgement per message), `"opportunistic"` (one push for
    /// everything committed since the last, Spindle's batching) or `"k:N"` (push when `N`
    /// messages are pending or `flush_us` passed; `"k"` alone is `k:1`, the proposal's default).
    pub batching: String,
    /// Longest a held-back push or acknowledgement waits under `k:N`, microseconds (the proposal's
    /// ~150 µs forced push).
    pub flush_us: u64,
    /// Messages a sender may have in flight before every member acknowledged them (Derecho's
    /// `window_size`, 16).
    pub window_size: u64,
    /// Largest message, bytes (Derecho's `max_smc_payload_size`, 10240).
    pub max_payload: u64,
}

/// Largest accepted `max_payload`: past this a group's ring (window × payload per sender, in
/// every member) outgrows what small-message multicast is for; bulk goes through transfers.
pub const MAX_MULTICAST_PAYLOAD: u64 = 16 << 20;

/// Largest accepted `window_size`.
pub const MAX_MULTICAST_WINDOW: u64 = 1 << 16;

impl Default for MulticastConfig {
    fn default() -> Self {
        MulticastConfig {
            batching: "opportunistic".into(),
            flush_us: 150,
            window_size: 16,
            max_payload: 10240,
        }
    }
}

impl MulticastConfig {
    /// The batching mode these settings give. Fails, naming `{prefix}.batching` or
    /// `{prefix}.flush_us`, on an unknown mode, a `k` outside `[1, window_size]` or a
    /// `flush_us` of 0.
    pub fn batching_mode(&self, prefix: &str) -> Result<Batching, ConfigError> {
        parse_batching(&self.batching, self.flush_us, self.window_size)
            .map_err(|(key, message)| ConfigError::new(format!("{prefix}.{key}"), message))
    }

    pub(crate) fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        if !(1..=MAX_MULTICAST_WINDOW).contains(&self.window_size) {
            return Err(ConfigError::new(
                format!("{prefix}.window_size"),
                format!(
                    "must be within [1, {MAX_MULTICAST_WINDOW}], got {}",
                    self.window_size
                ),
            ));
        }
        if !(1..=MAX_MULTICAST_PAYLOAD).contains(&self.max_payload) {
            return Err(ConfigError::new(
                format!("{prefix}.max_payload"),
                format!(
                    "must be within [1, {MAX_MULTICAST_PAYLOAD}], got {}",
                    self.max_payload
                ),
            ));
        }
        self.batching_mode(prefix).map(|_| ())
    }
}

/// Reads a batching mode: `off`, `opportunistic`, `k` (k = 1) or `k:N`, with `flush_us` for
/// the last two. Fails with the offending key (`batching` or `flush_us`) and why.
pub fn parse_batching(
    text: &str,
    flush_us: u64,
    window_size: u64,
) -> Result<Batching, (&'static str, String)> {
    let k = match text.trim() {
        "off" => return Ok(Batching::Off),
        "opportunistic" => return Ok(Batching::Opportunistic),
        "k" => 1,
        other => match other.strip_prefix("k:").map(|n| n.trim().parse::<u64>()) {
            Some(Ok(k)) => k,
            _ => {
                return Err((
                    "batching",
                    format!("must be \"off\", \"opportunistic\" or \"k:N\", got {text:?}"),
                ))
            }
        },
    };
    if k == 0 || k > window_size {
        return Err((
            "batching",
            format!("batch size k must be within [1, window_size {window_size}], got {k}"),
        ));
    }
    if flush_us == 0 {
        return Err(("flush_us", "must be at least 1, got 0".into()));
    }
    Ok(Batching::Every {
        k,
        flush_ns: flush_us.saturating_mul(1000),
    })
}
