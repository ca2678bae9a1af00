//! Device selection for slice spraying: which rail carries each slice of a request.
//!
//! [`DeviceSelector`] follows TENT's DeviceSelector:
//!
//! - **Baseline** (`enable_smart_scheduling = false`): round-robin within the first non-empty
//!   NUMA tier; farther tiers are ignored. Deterministic, no learning.
//! - **Smart** (the default): each candidate rail gets a score, its predicted completion time
//!   `(inflight_bytes + slice_bytes) / ewma_bandwidth` in seconds, times the NUMA penalty of its
//!   tier, plus a tiny random jitter so that equal rails do not always resolve the same way. One
//!   slice goes to the lowest score; several slices are shared out in proportion to
//!   `1 / (score + score_epsilon)`, the rounding remainder going to the best rail. Every
//!   [`PROBE_INTERVAL`]th multi-slice call deals its slices round-robin over every candidate
//!   instead, so that rails the scores avoid still get bandwidth samples.
//!
//! Each rail's bandwidth estimate starts at its theoretical bandwidth and learns from
//! completions ([`DeviceSelector::on_completed`], [`DeviceSelector::on_delivered`]). How it
//! learns is [`BandwidthEstimator`]: by default ([`BandwidthEstimator::Delivery`]) the estimate
//! is the largest delivery rate measured within a short window, with no floor tied to the
//! rail's nominal speed, so a rail policed far below what its NIC reports is learned as such;
//! [`BandwidthEstimator::Tent`] is TENT's EWMA clamped to a band around the nominal speed. In
//! both, a sample the caller marks *app-limited* (the rail was idle, had nothing queued, or was
//! held below its link rate by its window) may raise the estimate but never lower it, as BBR's
//! delivery-rate estimator does: such a sample measures the sender, not the rail.
//!
//! Assigned slices count as in flight on their rail until the caller reports them completed,
//! failed or unassigned, so the next decision sees the load.
//!
//! The selector is sans-IO: time is an argument (nanoseconds on any monotonic clock the caller
//! chooses), randomness comes from a generator seeded by the caller, and the decision path
//! allocates nothing once its buffers have grown to the number of candidates.

use std::fmt::{self, Write as _};

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use crate::delivery::DeliveryLog;
use crate::slicing::Slices;

/// Index of a rail in the list given to [`DeviceSelector::new`].
pub type RailId = usize;

/// In smart mode, every `PROBE_INTERVAL`th multi-slice call is a probe (the 100th, 200th, ...
/// counting from 1; single-slice calls and baseline calls do not count).
pub const PROBE_INTERVAL: u64 = 100;

const NS_PER_S: f64 = 1e9;
/// "No rail yet" in the branch-free minimum search.
const NONE: RailId = RailId::MAX;
/// Default of [`SelectorConfig::min_sample_ns`]: a millisecond of busy time per sample.
pub const DEFAULT_MIN_SAMPLE_NS: u64 = 1_000_000;

/// Default of [`SelectorConfig::min_sample_bytes`]: eight slices of the default 128 KiB block.
pub const DEFAULT_MIN_SAMPLE_BYTES: u64 = 1 << 20;

/// Busy time, in `min_sample_ns`, after which a rail's first sample is taken whatever bytes it
/// holds (see [`DeviceSelector::on_delivered`]).
const FIRST_SAMPLE_BUSY_FACTOR: u64 = 10;

/// A pooled sample that spans FIRST_SAMPLE_BUSY_FACTOR × `min_sample_ns` of busy time and shows
/// less than the estimate divided by this is taken whatever bytes it holds (see
/// [`DeviceSelector::on_delivered`]).
const SLOW_SAMPLE_DIVISOR: f64 = 4.0;

/// Bytes per second in one Gbps.
const BYTES_PER_S_PER_GBPS: f64 = 1e9 / 8.0;

/// Default of [`SelectorConfig::bandwidth_window_ns`]: the delivery estimator keeps the largest
/// rate of the last 20 ms. Long enough to hold the rate through the gaps of a jittery
/// transport (20 pooled samples of 1 ms), short enough that a rail whose rate falls is
/// followed within a few tens of milliseconds.
pub const DEFAULT_BANDWIDTH_WINDOW_NS: u64 = 20_000_000;

/// Lowest estimate the delivery estimator reports, bytes/s (10 kbit/s): a positive floor keeps
/// scores and windows finite. Low, so a rail that collapsed (a grey failure: link up, a trickle
/// through) reads as slow as it is. At a floor of 1 Mbit/s, a rail fallen to 0.1 Mbit/s was
/// probed as if ten times faster: every 0.66 s, each probe holding a batch 0.33 s.
pub const MIN_DELIVERY_BYTES_PER_SEC: f64 = 1_250.0;

/// How a rail's bandwidth estimate learns from delivery-rate samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum BandwidthEstimator {
    /// The default (`"delivery"`): the largest delivery rate measured within
    /// [`SelectorConfig::bandwidth_window_ns`] (a windowed max filter, as BBR keeps its
    /// bottleneck bandwidth), smoothed by `bandwidth_learning_rate`. Bounded above by
    /// `ewma_max_bandwidth_multiplier` × theoretical and below only by
    /// [`MIN_DELIVERY_BYTES_PER_SEC`]: a rail that carries 3 % of its nominal speed is estimated
    /// at 3 %. A jitter dip does not lower the estimate while a higher sample is in the window;
    /// a real fall is followed once the window has passed.
    #[default]
    Delivery,
    /// TENT's (`"tent"`): an EWMA of every sample, clamped to
    /// [`ewma_min_bandwidth_multiplier`, `ewma_max_bandwidth_multiplier`] × theoretical. A rail
    /// slower than the lower clamp is estimated at the clamp, whatever it carries.
    Tent,
}

impl BandwidthEstimator {
    /// The name the configuration uses: `"delivery"` or `"tent"`.
    pub fn name(self) -> &'static str {
        match self {
            BandwidthEstimator::Delivery => "delivery",
            BandwidthEstimator::Tent => "tent",
        }
    }

    /// The estimator called `name` in the configuration; `None` for any other string.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "delivery" => Some(BandwidthEstimator::Delivery),
            "tent" => Some(BandwidthEstimator::Tent),
            _ => None,
        }
    }
}

/// Parameters of slice spraying, with TENT's names and defaults.
///
/// The engine's config module validates these; the selector assumes sane values but never
/// panics on odd ones (a NaN penalty, a negative jitter range, min above max, ...): it then
/// makes some decision that is still one of the candidates.
#[derive(Debug, Clone, PartialEq)]
pub struct SelectorConfig {
    /// EWMA-based selection (true) or round-robin within the best tier (false). Default true.
    pub enable_smart_scheduling: bool,
    /// Score multiplier per NUMA tier, tier 0 first; a tier beyond the list uses the last entry,
    /// and an empty list means 1.0 everywhere. Default `[1.0, 5.0, 10.0]`.
    pub numa_penalties: Vec<f64>,
    /// α, the EWMA weight of the old estimate: 0 = take each sample, 1 = never learn. Default 0.01.
    pub bandwidth_learning_rate: f64,
    /// Lower clamp of the EWMA as a fraction of theoretical bandwidth, applied by the TENT
    /// estimator only ([`BandwidthEstimator::Tent`]). Default 0.1.
    pub ewma_min_bandwidth_multiplier: f64,
    /// Upper clamp of the estimate as a multiple of theoretical bandwidth (both estimators).
    /// Default 10.0.
    pub ewma_max_bandwidth_multiplier: f64,
    /// Jitter added to each score, uniform in `[0, score_jitter_range)` seconds. Default 1e-9.
    pub score_jitter_range: f64,
    /// Added to scores before taking their inverse as weights. Default 1e-12.
    pub score_epsilon: f64,
    /// Bandwidth assumed for a rail whose speed is unknown or implausible. Default 400 Gbps.
    pub default_bandwidth_gbps: f64,
    /// Smallest plausible reported bandwidth. Default 10 Gbps.
    pub min_bandwidth_gbps: f64,
    /// Largest plausible reported bandwidth. Default 800 Gbps.
    pub max_bandwidth_gbps: f64,
    /// Busy time a bandwidth sample must span before the EWMA learns from it (multirail's own
    /// setting `bandwidth_sample_min_us`, not TENT's; default 1 ms). 0 = one sample per slice,
    /// as TENT does. Over TCP, completions arrive
    /// with scheduling and acknowledgement jitter of tens of microseconds, so per-slice samples
    /// of small slices swing by orders of magnitude; pooling the bytes and busy time of
    /// consecutive completions for a millisecond measures the rail instead of the jitter.
    pub min_sample_ns: u64,
    /// Bytes a pooled bandwidth sample must also hold (multirail's own setting
    /// `bandwidth_sample_min_bytes`; default [`DEFAULT_MIN_SAMPLE_BYTES`]; only with
    /// `min_sample_ns` > 0). A rail policed by a token bucket lets a burst of the bucket's
    /// size through at link speed after every pause; a millisecond of a rail policed to
    /// 200 Mbit/s holds 25 KB, so a 32 KB burst doubled such a sample and the max filter kept
    /// it. A megabyte dilutes bursts of tens of KB to a few percent (half of one left a rail
    /// policed to 400 Mbit/s reading 22 % high), and on a rail fast enough to move it within
    /// `min_sample_ns` changes nothing.
    pub min_sample_bytes: u64,
    /// How the estimate learns (multirail's own setting `bandwidth_estimator`). Default
    /// [`BandwidthEstimator::Delivery`].
    pub estimator: BandwidthEstimator,
    /// Window of the delivery estimator's max filter, ns (multirail's own setting
    /// `bandwidth_window_us`; default [`DEFAULT_BANDWIDTH_WINDOW_NS`]). 0 keeps no history: the
    /// latest sample that is not app-limited is the estimate.
    pub bandwidth_window_ns: u64,
}

impl Default for SelectorConfig {
    /// TENT's defaults for TENT's keys; multirail's own keys (`min_sample_ns`,
    /// `min_sample_bytes`, `estimator`, `bandwidth_window_ns`) at theirs.
    fn default() -> Self {
        SelectorConfig {
            enable_smart_scheduling: true,
            numa_penalties: vec![1.0, 5.0, 10.0],
            bandwidth_learning_rate: 0.01,
            ewma_min_bandwidth_multiplier: 0.1,
            ewma_max_bandwidth_multiplier: 10.0,
            score_jitter_range: 1e-9,
            score_epsilon: 1e-12,
            default_bandwidth_gbps: 400.0,
            min_bandwidth_gbps: 10.0,
            max_bandwidth_gbps: 800.0,
            min_sample_ns: DEFAULT_MIN_SAMPLE_NS,
            min_sample_bytes: DEFAULT_MIN_SAMPLE_BYTES,
            estimator: BandwidthEstimator::Delivery,
            bandwidth_window_ns: DEFAULT_BANDWIDTH_WINDOW_NS,
        }
    }
}

impl SelectorConfig {
    /// Penalty of NUMA tier `tier`: its entry, else the last entry, else 1.0. Never fails.
    pub fn numa_penalty(&self, tier: usize) -> f64 {
        self.numa_penalties
            .get(tier)
            .or(self.numa_penalties.last())
            .copied()
            .unwrap_or(1.0)
    }
}

/// Theoretical bandwidth of a rail in Gbps: `reported_gbps` when it lies within
/// `[min_bandwidth_gbps, max_bandwidth_gbps]`, else `default_bandwidth_gbps`.
///
/// An unknown (`None`), NaN or out-of-range report yields the default, because a NIC that
/// reports 0 or 100 000 Gbps is misreporting, and trusting it would starve or flood that rail
/// until the EWMA caught up. Never fails.
pub fn theoretical_bandwidth(cfg: &SelectorConfig, reported_gbps: Option<f64>) -> f64 {
    match reported_gbps {
        Some(g) if g >= cfg.min_bandwidth_gbps && g <= cfg.max_bandwidth_gbps => g,
        _ => cfg.default_bandwidth_gbps,
    }
}

/// Why a selector call was refused. No state changed when one of these is returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SelectError {
    /// Every candidate tier was empty (all rails paused, or none reach the target).
    NoCandidates,
    /// A rail id is not below the number of rails the selector was built with.
    UnknownRail(RailId),
}

impl fmt::Display for SelectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SelectError::NoCandidates => f.write_str("no candidate rail in any tier"),
            SelectError::UnknownRail(r) => write!(f, "rail {r} does not exist"),
        }
    }
}

impl std::error::Error for SelectError {}

/// The slices of one request as the selector needs them: how many, and their sizes.
///
/// Every slice has `slice_bytes` bytes except the last, which has `last_bytes` (the slicing
/// module merges a small tail into the last slice, so it may be larger or smaller). A single
/// slice (`count == 1`) has `last_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceShape {
    /// Number of slices.
    pub count: usize,
    /// Size of every slice but the last.
    pub slice_bytes: u64,
    /// Size of the last slice.
    pub last_bytes: u64,
}

impl SliceShape {
    /// `count` slices of `bytes` bytes each.
    pub fn uniform(count: usize, bytes: u64) -> Self {
        SliceShape {
            count,
            slice_bytes: bytes,
            last_bytes: bytes,
        }
    }

    /// The shape of the slices a [`Slices`] iterator has yet to yield (does not consume it).
    pub fn of(slices: &Slices) -> Self {
        let count = slices.len();
        let last_bytes = match count {
            0 => 0,
            // `nth` on `Slices` is arithmetic, not a walk.
            n => slices.clone().nth(n - 1).map_or(0, |s| s.length),
        };
        SliceShape {
            count,
            slice_bytes: slices.slice_size(),
            last_bytes,
        }
    }

    /// Size of slice `index` (0-based).
    fn bytes_of(&self, index: usize) -> u64 {
        if index + 1 == self.count {
            self.last_bytes
        } else {
            self.slice_bytes
        }
    }
}

/// A snapshot of one rail's traffic, from [`DeviceSelector::stats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RailStats {
    /// Bytes of completed slices.
    pub total_bytes: u64,
    /// Current EWMA bandwidth estimate in Gbps.
    pub ewma_gbps: f64,
    /// Bytes assigned and not yet reported completed, failed or unassigned.
    pub inflight_bytes: u64,
    /// Completed slices.
    pub slices: u64,
    /// Failed slices.
    pub errors: u64,
    /// Theoretical bandwidth in Gbps (see [`theoretical_bandwidth`]).
    pub theoretical_gbps: f64,
}

/// Formats statistics the way TENT's `printTrafficStats` does: a header line, then one line per
/// rail, e.g. `Dev 0: Total=10.5 GB, EWMA BW=45.23 Gbps, Inflight=0 bytes` (GB = 10^9 bytes).
/// Every line ends with a newline. Pure; never fails.
pub fn format_traffic_stats(stats: &[RailStats]) -> String {
    let mut out = String::with_capacity(40 + 64 * stats.len());
    out.push_str("=== Device Traffic Statistics ===\n");
    for (i, s) in stats.iter().enumerate() {
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "Dev {i}: Total={:.1} GB, EWMA BW={:.2} Gbps, Inflight={} bytes",
            s.total_bytes as f64 / 1e9,
            s.ewma_gbps,
            s.inflight_bytes
        );
    }
    out
}

/// Per-rail learning state.
#[derive(Debug, Clone)]
struct Rail {
    theoretical_bps: f64,
    min_bps: f64,
    max_bps: f64,
    ewma_bps: f64,
    /// `1 / ewma_bps`, kept so that scoring multiplies instead of dividing.
    secs_per_byte: f64,
    inflight: u64,
    total_bytes: u64,
    slices: u64,
    errors: u64,
    /// End of the latest completion on this rail, the start of the next busy interval.
    last_completion_ns: Option<u64>,
    /// The latest EWMA sample, kept so that completions reaped in the same instant can be
    /// folded into it (see `on_completed`).
    last_sample: Option<Sample>,
    /// Bytes and closed busy time pooled towards the next sample when `min_sample_ns` > 0.
    pooled_bytes: u64,
    pooled_busy_ns: u64,
    /// Of `pooled_bytes`, those reported app-limited.
    pooled_limited_bytes: u64,
    /// The delivery estimator's recent best samples.
    filter: MaxFilter,
    /// Start of the open busy period (something in flight since then), and the latest
    /// completion in it.
    segment_start_ns: Option<u64>,
    segment_end_ns: u64,
    /// Start of the first busy period pooled towards the next sample.
    pool_start_ns: Option<u64>,
    /// The highest estimate the stalls since the last [`DeviceSelector::on_recovered`]
    /// lowered, which that restores; 0 when none did.
    before_stall_bps: f64,
    /// Recent deliveries, which bound a pooled sample by what the rail delivered since its
    /// closing slice was posted (see [`crate::delivery`]).
    log: DeliveryLog,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    start_ns: u64,
    end_ns: u64,
    bytes: u64,
    /// Of `bytes`, those reported app-limited.
    limited_bytes: u64,
    ewma_before: f64,
    filter_before: MaxFilter,
}

/// A running maximum over a time window, kept in three samples: Kathleen Nichols' algorithm as
/// Linux's `lib/win_minmax.c` writes it (BBR's bottleneck-bandwidth filter). `s[0]` is the best
/// in the window, `s[1]` and `s[2]` the best of its later quarter-windows, so when the best
/// expires the next best is at hand without keeping every sample. Samples expire only when a
/// new one arrives: a rail that gives no sample keeps its estimate.
#[derive(Debug, Clone, Copy, Default)]
struct MaxFilter {
    s: [(u64, f64); 3],
}

impl MaxFilter {
    /// Whether no sample was ever added.
    fn is_empty(&self) -> bool {
        self.s[0] == (0, 0.0)
    }

    /// Adds `v` measured at `t` and returns the largest value within `win` of `t`.
    fn update(&mut self, win: u64, t: u64, v: f64) -> f64 {
        let val = (t, v);
        // A new best, or nothing left in the window (or the first sample): start over.
        if v >= self.s[0].1 || t.saturating_sub(self.s[2].0) > win {
            self.s = [val; 3];
            return v;
        }
        if v >= self.s[1].1 {
            self.s[1] = val;
            self.s[2] = val;
        } else if v >= self.s[2].1 {
            self.s[2] = val;
        }
        let dt = t.saturating_sub(self.s[0].0);
        if dt > win {
            // The best expired: the quarter-window bests move up, and the new value becomes the
            // latest; once more if the second best expired too.
            self.s = [self.s[1], self.s[2], val];
            if t.saturating_sub(self.s[0].0) > win {
                self.s = [self.s[1], self.s[2], val];
            }
        } else if self.s[1].0 == self.s[0].0 && dt > win / 4 {
            // A quarter of the window passed with no new best: take a second choice from it.
            self.s[1] = val;
            self.s[2] = val;
        } else if self.s[2].0 == self.s[1].0 && dt > win / 2 {
            // Half the window passed: take a third choice from its later half.
            self.s[2] = val;
        }
        self.s[0].1
    }
}

impl Rail {
    /// Sets the estimate to `bps` as of `now_ns`, the delivery estimator's recent bests with
    /// it: a bound a stall showed, or the estimate a stall lowered, is a fact, not a sample to
    /// smooth in or to be held up by older bests.
    fn reset_estimate(&mut self, bps: f64, now_ns: u64) {
        self.filter = MaxFilter {
            s: [(now_ns, bps); 3],
        };
        self.set_ewma(bps);
    }

    /// Drops what was pooled towards the next sample (its busy period stays open).
    fn drop_pool(&mut self) {
        self.pooled_bytes = 0;
        self.pooled_busy_ns = 0;
        self.pooled_limited_bytes = 0;
        self.pool_start_ns = self.segment_start_ns;
        self.last_sample = None;
    }

    fn set_ewma(&mut self, bps: f64) {
        // Not f64::clamp: it panics when min > max, which an odd config may produce.
        self.ewma_bps = bps.min(self.max_bps).max(self.min_bps);
        self.secs_per_byte = 1.0 / self.ewma_bps;
    }

    /// Learns from a delivery-rate sample of `observed` bytes/s ending at `now_ns`.
    fn learn(&mut self, cfg: &SelectorConfig, observed: f64, app_limited: bool, now_ns: u64) {
        let before = self.ewma_bps;
        // BBR's rule: a rail that was idle, had nothing queued or was held back by its window
        // delivered what it was given, not what it can carry. Such a sample may show that the
        // rail is faster than estimated, never that it is slower; taking it would shrink the
        // window computed from the estimate, and the next sample with it (a spiral).
        if app_limited && observed <= before {
            return;
        }
        let alpha = cfg.bandwidth_learning_rate;
        match cfg.estimator {
            BandwidthEstimator::Tent => self.set_ewma(alpha * before + (1.0 - alpha) * observed),
            BandwidthEstimator::Delivery => {
                // Before its first sample the estimate is what the rail was assumed to carry
                // (its interface's speed, or the default), not a measurement: the first sample
                // replaces it. Smoothed into it instead, a rail policed at 10 Mbit/s on an
                // interface that says 10 Gbit/s kept a hundredth of the assumption, 110 Mbit/s,
                // until a megabyte more of it made the next pooled sample (nearly a second),
                // and was dealt slices it needed ten times longer for than estimated.
                let assumed = self.filter.is_empty();
                let best = self
                    .filter
                    .update(cfg.bandwidth_window_ns, now_ns, observed);
                if assumed {
                    self.set_ewma(best);
                } else {
                    self.set_ewma(alpha * before + (1.0 - alpha) * best);
                }
            }
        }
    }

    fn stats(&self) -> RailStats {
        RailStats {
            total_bytes: self.total_bytes,
            ewma_gbps: self.ewma_bps / BYTES_PER_S_PER_GBPS,
            inflight_bytes: self.inflight,
            slices: self.slices,
            errors: self.errors,
            theoretical_gbps: self.theoretical_bps / BYTES_PER_S_PER_GBPS,
        }
    }
}

/// Chooses rails for slices and learns each rail's bandwidth from completions.
///
/// Candidates come as NUMA tiers, `tiers[0]` being the rails on the memory's own NUMA node and
/// later entries farther ones; paused rails are left out by the caller. One selector serves one
/// worker: it is `Send` but takes `&mut self` for every decision, so there is no locking.
#[derive(Debug, Clone)]
pub struct DeviceSelector {
    cfg: SelectorConfig,
    rails: Vec<Rail>,
    rng: SmallRng,
    /// `score_jitter_range / 2^32`: a jitter is a random `u32` times this (0 disables jitter).
    jitter_scale: f64,
    /// The largest float below `score_jitter_range`, an upper clamp on every jitter.
    jitter_max: f64,
    /// Baseline round-robin position.
    rr_cursor: usize,
    /// Smart-mode multi-slice calls so far.
    multi_calls: u64,
    /// Multi-slice calls since the last probe; a countdown is cheaper than `multi_calls % 100`.
    since_probe: u64,
    /// Where the next probe starts in the flattened candidate list, so that probes with fewer
    /// slices than candidates still reach every rail in turn.
    probe_cursor: usize,
    /// Per-candidate rail and weight of a multi-slice decision; kept to avoid allocating.
    scratch: Vec<(RailId, f64)>,
}

impl DeviceSelector {
    /// A selector over `reported_gbps.len()` rails; rail `i` has the theoretical bandwidth
    /// `theoretical_bandwidth(&cfg, reported_gbps[i])` and starts its EWMA there. `seed` seeds
    /// the jitter generator, so the same seed and inputs give the same decisions. Never fails.
    pub fn new(cfg: SelectorConfig, reported_gbps: &[Option<f64>], seed: u64) -> Self {
        let rails = reported_gbps
            .iter()
            .map(|&g| {
                let theoretical_bps = theoretical_bandwidth(&cfg, g) * BYTES_PER_S_PER_GBPS;
                let min_bps = match cfg.estimator {
                    BandwidthEstimator::Tent => theoretical_bps * cfg.ewma_min_bandwidth_multiplier,
                    BandwidthEstimator::Delivery => MIN_DELIVERY_BYTES_PER_SEC,
                };
                let mut rail = Rail {
                    theoretical_bps,
                    min_bps,
                    max_bps: theoretical_bps * cfg.ewma_max_bandwidth_multiplier,
                    ewma_bps: theoretical_bps,
                    secs_per_byte: 0.0,
                    inflight: 0,
                    total_bytes: 0,
                    slices: 0,
                    errors: 0,
                    last_completion_ns: None,
                    last_sample: None,
                    pooled_bytes: 0,
                    pooled_busy_ns: 0,
                    pooled_limited_bytes: 0,
                    filter: MaxFilter::default(),
                    segment_start_ns: None,
                    segment_end_ns: 0,
                    pool_start_ns: None,
                    before_stall_bps: 0.0,
                    log: DeliveryLog::new(),
                };
                rail.secs_per_byte = 1.0 / theoretical_bps;
                rail
            })
            .collect::<Vec<_>>();
        let range = cfg.score_jitter_range;
        let (jitter_scale, jitter_max) = if range > 0.0 && range.is_finite() {
            // (2^32 − 1) × range / 2^32 is below `range` for every normal `range`; the clamp to
            // the float just below it covers rounding at subnormal ranges.
            (range / 4_294_967_296.0, f64::from_bits(range.to_bits() - 1))
        } else {
            (0.0, 0.0)
        };
        DeviceSelector {
            scratch: Vec::with_capacity(rails.len()),
            rails,
            rng: SmallRng::seed_from_u64(seed),
            jitter_scale,
            jitter_max,
            rr_cursor: 0,
            multi_calls: 0,
            since_probe: 0,
            probe_cursor: 0,
            cfg,
        }
    }

    /// The configuration the selector was built with.
    pub fn config(&self) -> &SelectorConfig {
        &self.cfg
    }

    /// Number of rails.
    pub fn num_rails(&self) -> usize {
        self.rails.len()
    }

    /// Smart-mode multi-slice calls made so far (the probe counter).
    pub fn multi_slice_calls(&self) -> u64 {
        self.multi_calls
    }

    /// Chooses the rail for a single slice of `bytes` bytes and counts the bytes as in flight
    /// there. Equivalent to [`DeviceSelector::select`] with one slice, without the buffer.
    ///
    /// Fails with [`SelectError::UnknownRail`] if a candidate in any tier is not a rail, and
    /// with [`SelectError::NoCandidates`] if every tier is empty.
    pub fn select_one(&mut self, tiers: &[&[RailId]], bytes: u64) -> Result<RailId, SelectError> {
        self.check(tiers)?;
        let rail = if self.cfg.enable_smart_scheduling {
            self.best(tiers, bytes)
        } else {
            self.round_robin(tiers)
        };
        let rail = rail.ok_or(SelectError::NoCandidates)?;
        self.rails[rail].inflight = self.rails[rail].inflight.saturating_add(bytes);
        Ok(rail)
    }

    /// Chooses a rail for each slice of `shape`: on success `out` holds exactly `shape.count`
    /// rails, `out[i]` carrying slice `i`, and each slice's bytes count as in flight on its
    /// rail. The caller must later report every slice with [`DeviceSelector::on_completed`],
    /// [`DeviceSelector::on_failed`] or [`DeviceSelector::on_unassigned`].
    ///
    /// In smart mode, a multi-slice call lists each rail's slices together, in candidate order,
    /// with the rounding remainder last (on the best rail); a probe deals them round-robin.
    /// `out` is cleared first and only grows if its capacity is below `shape.count`.
    ///
    /// Fails with [`SelectError::UnknownRail`] if a candidate in any tier is not a rail, and
    /// with [`SelectError::NoCandidates`] if every tier is empty and `shape.count > 0`; `out` is
    /// then empty and nothing is in flight.
    pub fn select(
        &mut self,
        tiers: &[&[RailId]],
        shape: SliceShape,
        out: &mut Vec<RailId>,
    ) -> Result<(), SelectError> {
        out.clear();
        self.check(tiers)?;
        if shape.count == 0 {
            return Ok(());
        }
        if tiers.iter().all(|t| t.is_empty()) {
            return Err(SelectError::NoCandidates);
        }
        out.reserve(shape.count);
        if !self.cfg.enable_smart_scheduling {
            for i in 0..shape.count {
                // Cannot be None: some tier is non-empty.
                let rail = self.round_robin(tiers).unwrap_or(0);
                self.add_inflight(rail, shape.bytes_of(i));
                out.push(rail);
            }
            return Ok(());
        }
        if shape.count == 1 {
            let rail = self.best(tiers, shape.last_bytes).unwrap_or(0);
            self.add_inflight(rail, shape.last_bytes);
            out.push(rail);
            return Ok(());
        }
        self.multi_calls += 1;
        self.since_probe += 1;
        if self.since_probe >= PROBE_INTERVAL {
            self.since_probe = 0;
            self.probe(tiers, shape, out);
        } else {
            self.proportional(tiers, shape, out);
        }
        Ok(())
    }

    /// Reports that a slice of `bytes` bytes assigned to `rail` completed at `now_ns`, having
    /// been posted on the rail (handed to the wire, not merely queued) at `posted_at_ns`; its
    /// sample counts as not app-limited. Same as [`DeviceSelector::on_delivered`] with
    /// `app_limited = false`, which see.
    ///
    /// Fails with [`SelectError::UnknownRail`] (changing nothing) if `rail` does not exist.
    pub fn on_completed(
        &mut self,
        rail: RailId,
        bytes: u64,
        posted_at_ns: u64,
        now_ns: u64,
    ) -> Result<(), SelectError> {
        self.on_delivered(rail, bytes, posted_at_ns, now_ns, false)
    }

    /// Reports that a slice of `bytes` bytes assigned to `rail` completed at `now_ns`, having
    /// been posted on the rail (handed to the wire, not merely queued) at `posted_at_ns`.
    /// `app_limited` says that the rail could not show its speed while this slice was in
    /// flight: it was idle or had nothing more queued, or a window below what the link carries
    /// held it back. The caller (the dispatcher) knows that; the selector does not.
    ///
    /// The bytes leave the rail's in-flight count and join its totals, and the estimate learns
    /// `observed = bytes / (now − max(posted_at, previous completion on this rail))`: with the
    /// delivery estimator the largest such rate within `bandwidth_window_ns`, with TENT's an
    /// EWMA of every rate clamped to `[ewma_min_bandwidth_multiplier,
    /// ewma_max_bandwidth_multiplier] × theoretical` (see [`BandwidthEstimator`]). A sample
    /// whose bytes were mostly app-limited may raise the estimate, never lower it.
    ///
    /// Why that interval: a pipelined rail has many slices in flight, so `now − posted_at` of
    /// one slice includes waiting behind the others and measures latency under load; the time
    /// since the previous completion (or since posting, if the rail was idle) is the busy time
    /// that this slice alone accounts for, and bytes over it is the rail's delivery rate.
    /// Timing from posting rather than queueing keeps the engine's own queue wait out of the
    /// estimate. With `min_sample_ns` > 0 the bytes and busy time of consecutive completions
    /// are pooled until they span that much busy time and hold `min_sample_bytes`, and the
    /// pool is one sample.
    ///
    /// Completions the caller reaps in a batch carry the same `now_ns`; all but the first have
    /// a zero interval. They are folded into the first one's sample (its update is redone with
    /// their bytes added), because they were delivered within the same busy interval and
    /// dropping them would divide the estimate by the batch size. Any other sample with a
    /// non-positive interval (out-of-order timestamps, posting at `now_ns`) is counted as
    /// completed but not learned from, as is a zero-byte slice.
    ///
    /// Fails with [`SelectError::UnknownRail`] (changing nothing) if `rail` does not exist.
    /// Reporting more bytes than are in flight leaves 0 in flight rather than panicking.
    pub fn on_delivered(
        &mut self,
        rail: RailId,
        bytes: u64,
        posted_at_ns: u64,
        now_ns: u64,
        app_limited: bool,
    ) -> Result<(), SelectError> {
        let cfg = &self.cfg;
        let (min_sample_ns, min_sample_bytes) = (cfg.min_sample_ns, cfg.min_sample_bytes);
        let r = self
            .rails
            .get_mut(rail)
            .ok_or(SelectError::UnknownRail(rail))?;
        r.inflight = r.inflight.saturating_sub(bytes);
        r.total_bytes = r.total_bytes.saturating_add(bytes);
        r.slices += 1;
        let start = r
            .last_completion_ns
            .map_or(posted_at_ns, |l| l.max(posted_at_ns));
        r.last_completion_ns = Some(r.last_completion_ns.map_or(now_ns, |l| l.max(now_ns)));
        if bytes == 0 {
            return Ok(());
        }
        let limited = if app_limited { bytes } else { 0 };
        if min_sample_ns > 0 {
            r.log.record(now_ns, bytes, r.inflight == 0);
            // Delivery rate over the rail's busy periods: a period opens when a slice is
            // posted on an idle rail and closes when nothing is left in flight. Completions
            // reaped by several threads may report their times out of order; taking the
            // latest end and the period's fixed start keeps that from inventing bandwidth.
            let seg_start = *r.segment_start_ns.get_or_insert(posted_at_ns.min(now_ns));
            let pool_start = *r.pool_start_ns.get_or_insert(seg_start);
            r.segment_end_ns = r.segment_end_ns.max(now_ns);
            r.pooled_bytes = r.pooled_bytes.saturating_add(bytes);
            r.pooled_limited_bytes = r.pooled_limited_bytes.saturating_add(limited);
            if r.inflight == 0 {
                r.pooled_busy_ns += r.segment_end_ns.saturating_sub(seg_start);
                r.segment_start_ns = None;
            }
            let open = r
                .segment_start_ns
                .map_or(0, |st| r.segment_end_ns.saturating_sub(st));
            let busy = r.pooled_busy_ns + open;
            // The first sample need not hold `min_sample_bytes` once it spans
            // FIRST_SAMPLE_BUSY_FACTOR × `min_sample_ns`: until it, the estimate is the rail's
            // assumed speed, which a sample inflated by a policer's burst still beats by far (a
            // rail policed at 10 Mbit/s moves a megabyte in 0.8 s, and was dealt at the assumed
            // 10 Gbit/s all that while). Not after one millisecond: a fast rail's first
            // millisecond holds its start (threads waking, pages faulting in) and few bytes, and
            // such a sample read loopback at a tenth of its speed.
            let long = busy >= min_sample_ns.saturating_mul(FIRST_SAMPLE_BUSY_FACTOR);
            let first =
                cfg.estimator == BandwidthEstimator::Delivery && r.filter.is_empty() && long;
            // Nor need a sample that shows the rail far slower than estimated: a policer's
            // burst can only make a short sample read high, so one this far below the estimate
            // is the rail slowing down. Waiting for a megabyte, a rail that fell from 600 to
            // 0.1 Mbit/s (a grey failure, or a policer clamping down) kept its estimate, its
            // window and its share of every batch for 80 s, and each batch waited seconds for
            // the slices dealt to it.
            let slow = long
                && (r.pooled_bytes as f64) * NS_PER_S
                    < r.ewma_bps * busy as f64 / SLOW_SAMPLE_DIVISOR;
            let enough_bytes = r.pooled_bytes >= min_sample_bytes || first || slow;
            if busy >= min_sample_ns && enough_bytes {
                let mostly_limited = r.pooled_limited_bytes > r.pooled_bytes / 2;
                // An app-limited sample may raise the estimate, so it must not read high: it
                // is timed from its first busy period's start to its end, idle gaps included.
                // A rail held to a slice at a time by its window idles between answers, and a
                // policer refills its bucket meanwhile; timed by busy time alone, every slice
                // began with a burst at link speed, and a rail policed to 150 Mbit/s under a
                // 16 KiB bucket read 0.2 Gbit/s and was dealt a third more than it carries.
                // Over the gaps, a token bucket lets through at most its rate plus one bucket.
                let span = if mostly_limited {
                    r.segment_end_ns.saturating_sub(pool_start).max(busy)
                } else {
                    busy
                };
                let pooled = r.pooled_bytes as f64 * NS_PER_S / span as f64;
                // Nor above the estimate by more than the rail delivered since the closing
                // slice was posted: a pool that began inside a burst of answers released
                // together (a stall, answers written in one go) holds their bytes over a
                // fraction of the time the rail took to carry them. The bound only keeps a
                // sample from raising the estimate: its interval holds the gaps a window too
                // small for the host's delays leaves between slices, and lowering the estimate
                // for those would shrink the window further. Before the first sample the
                // estimate is an assumption, and the bound applies whole.
                let floor = if r.filter.is_empty() { 0.0 } else { r.ewma_bps };
                let observed = r
                    .log
                    .rate_since_post(posted_at_ns, now_ns)
                    .map_or(pooled, |since_post| pooled.min(since_post.max(floor)));
                let end = r.segment_end_ns;
                r.learn(cfg, observed, mostly_limited, end);
                r.pooled_bytes = 0;
                r.pooled_busy_ns = 0;
                r.pooled_limited_bytes = 0;
                if r.segment_start_ns.is_some() {
                    r.segment_start_ns = Some(r.segment_end_ns);
                }
                r.pool_start_ns = r.segment_start_ns;
            }
            return Ok(());
        }
        let sample = if now_ns > start {
            Sample {
                start_ns: start,
                end_ns: now_ns,
                bytes,
                limited_bytes: limited,
                ewma_before: r.ewma_bps,
                filter_before: r.filter,
            }
        } else {
            match r.last_sample {
                // Same instant as the previous completion, and posted no later: same batch.
                Some(prev) if prev.end_ns == now_ns && posted_at_ns <= now_ns => Sample {
                    bytes: prev.bytes.saturating_add(bytes),
                    limited_bytes: prev.limited_bytes.saturating_add(limited),
                    ..prev
                },
                _ => return Ok(()),
            }
        };
        let observed = sample.bytes as f64 * NS_PER_S / (now_ns - sample.start_ns) as f64;
        let mostly_limited = sample.limited_bytes > sample.bytes / 2;
        // The batch's update is redone from the state before its first completion.
        r.set_ewma(sample.ewma_before);
        r.filter = sample.filter_before;
        r.learn(cfg, observed, mostly_limited, now_ns);
        r.last_sample = Some(sample);
        Ok(())
    }

    /// Reports that `rail` was given up on as stalled at `now_ns`: a slice of `bytes` bytes
    /// posted there at `posted_at_ns` had still not been delivered. The rail then carries at
    /// most `bytes / (now − posted_at)`: the delivery estimate becomes that bound where it was
    /// higher (a fact, not a sample to smooth in), TENT's EWMA learns it as a sample and stays
    /// within its clamp; and what was pooled towards the next sample is dropped:
    /// the rail's connections are closed with the stall. Without it a rail that fell from
    /// 600 to 0.1 Mbit/s delivered nothing more to learn from, kept its old estimate, and was
    /// dealt slices again as soon as it was reconnected, each stalling the batch it held. The
    /// bytes stay in flight until the slices come back ([`DeviceSelector::on_failed`]).
    ///
    /// Fails with [`SelectError::UnknownRail`] (changing nothing) if `rail` does not exist.
    pub fn on_stalled(
        &mut self,
        rail: RailId,
        bytes: u64,
        posted_at_ns: u64,
        now_ns: u64,
    ) -> Result<(), SelectError> {
        let cfg = &self.cfg;
        let r = self
            .rails
            .get_mut(rail)
            .ok_or(SelectError::UnknownRail(rail))?;
        r.segment_start_ns = None;
        r.drop_pool();
        let waited = now_ns.saturating_sub(posted_at_ns);
        if bytes > 0 && waited > 0 {
            let at_most = bytes as f64 * NS_PER_S / waited as f64;
            if at_most < r.ewma_bps {
                r.before_stall_bps = r.before_stall_bps.max(r.ewma_bps);
                match cfg.estimator {
                    // The bound is a fact, not a noisy sample: smoothed, a hundredth of a
                    // 470 Mbit/s estimate (4.7 Mbit/s) outlived a fall to 0.1 Mbit/s.
                    BandwidthEstimator::Delivery => r.reset_estimate(at_most, now_ns),
                    BandwidthEstimator::Tent => r.learn(cfg, at_most, false, now_ns),
                }
            }
        }
        Ok(())
    }

    /// Reports that `rail`, given up on as stalled before, answered a probe far faster than its
    /// lowered estimate: it may have come back. The estimate returns to the highest a stall
    /// lowered (nothing changes if it is already above that, or the rail never stalled), and
    /// what was pooled towards the next sample is dropped. Lowered, the estimate kept a rail
    /// that had come back off every batch: its probes were a page each, seconds apart, and
    /// never pooled into a sample. A rail behind a policer whose burst let the probe through
    /// stalls again, and is given up on again within half a second.
    ///
    /// Fails with [`SelectError::UnknownRail`] (changing nothing) if `rail` does not exist.
    pub fn on_recovered(&mut self, rail: RailId, now_ns: u64) -> Result<(), SelectError> {
        let r = self
            .rails
            .get_mut(rail)
            .ok_or(SelectError::UnknownRail(rail))?;
        // Taken, so a later stall starts from the estimate of its own time, not this one.
        let restore = std::mem::take(&mut r.before_stall_bps);
        if restore > r.ewma_bps {
            r.reset_estimate(restore, now_ns);
            r.drop_pool();
        }
        Ok(())
    }

    /// Reports that a slice of `bytes` bytes assigned to `rail` failed: the bytes leave the
    /// in-flight count and the rail's error count grows; the EWMA is untouched (rail health
    /// decides about pausing).
    ///
    /// Fails with [`SelectError::UnknownRail`] (changing nothing) if `rail` does not exist.
    pub fn on_failed(&mut self, rail: RailId, bytes: u64) -> Result<(), SelectError> {
        let r = self
            .rails
            .get_mut(rail)
            .ok_or(SelectError::UnknownRail(rail))?;
        r.inflight = r.inflight.saturating_sub(bytes);
        r.errors += 1;
        Ok(())
    }

    /// Reports that a slice of `bytes` bytes assigned to `rail` was never posted (the engine
    /// re-routed it): the bytes leave the in-flight count and nothing else changes.
    ///
    /// Fails with [`SelectError::UnknownRail`] (changing nothing) if `rail` does not exist.
    pub fn on_unassigned(&mut self, rail: RailId, bytes: u64) -> Result<(), SelectError> {
        let r = self
            .rails
            .get_mut(rail)
            .ok_or(SelectError::UnknownRail(rail))?;
        r.inflight = r.inflight.saturating_sub(bytes);
        Ok(())
    }

    /// Statistics of rail `rail`, or `None` if it does not exist.
    pub fn rail_stats(&self, rail: RailId) -> Option<RailStats> {
        self.rails.get(rail).map(Rail::stats)
    }

    /// Statistics of every rail, in rail order; feed them to [`format_traffic_stats`].
    pub fn stats(&self) -> impl ExactSizeIterator<Item = RailStats> + '_ {
        self.rails.iter().map(Rail::stats)
    }

    fn check(&self, tiers: &[&[RailId]]) -> Result<(), SelectError> {
        let n = self.rails.len();
        for tier in tiers {
            for &r in *tier {
                if r >= n {
                    return Err(SelectError::UnknownRail(r));
                }
            }
        }
        Ok(())
    }

    fn add_inflight(&mut self, rail: RailId, bytes: u64) {
        let r = &mut self.rails[rail];
        r.inflight = r.inflight.saturating_add(bytes);
    }

    fn round_robin(&mut self, tiers: &[&[RailId]]) -> Option<RailId> {
        let tier = tiers.iter().find(|t| !t.is_empty())?;
        let rail = tier[self.rr_cursor % tier.len()];
        self.rr_cursor = self.rr_cursor.wrapping_add(1);
        Some(rail)
    }

    /// Lowest-score candidate for a slice of `bytes` bytes; `None` if there is none.
    fn best(&mut self, tiers: &[&[RailId]], bytes: u64) -> Option<RailId> {
        let mut jitter = Jitter::new(&mut self.rng, self.jitter_scale, self.jitter_max);
        let mut best = NONE;
        let mut best_score = f64::INFINITY;
        for (t, tier) in tiers.iter().enumerate() {
            let penalty = self.cfg.numa_penalty(t);
            for &rail in *tier {
                let s = predicted_time(&self.rails[rail], bytes) * penalty + jitter.next();
                // Written to compile to conditional moves: jitter makes the winner among equal
                // rails random, and a mispredicted branch per candidate cost more than the
                // scoring. `best == NONE` keeps the decision a candidate when scores are NaN.
                let better = (s < best_score) | (best == NONE);
                best_score = if better { s } else { best_score };
                best = if better { rail } else { best };
            }
        }
        (best != NONE).then_some(best)
    }

    /// Normal multi-slice call: shares proportional to `1 / (score + epsilon)`.
    fn proportional(&mut self, tiers: &[&[RailId]], shape: SliceShape, out: &mut Vec<RailId>) {
        let eps = self.cfg.score_epsilon;
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let mut jitter = Jitter::new(&mut self.rng, self.jitter_scale, self.jitter_max);
        let mut total = 0.0;
        let mut best = 0;
        let mut best_score = f64::INFINITY;
        for (t, tier) in tiers.iter().enumerate() {
            let penalty = self.cfg.numa_penalty(t);
            for &rail in *tier {
                let s =
                    predicted_time(&self.rails[rail], shape.slice_bytes) * penalty + jitter.next();
                if s < best_score {
                    best_score = s;
                    best = scratch.len();
                }
                let w = 1.0 / (s + eps);
                total += w;
                scratch.push((rail, w));
            }
        }
        let n = shape.count;
        let per_weight = n as f64 / total;
        for &(rail, w) in &scratch {
            let room = n - out.len();
            // `as` saturates and maps NaN to 0; the `min` keeps rounding from overshooting n.
            let k = ((w * per_weight) as usize).min(room);
            out.resize(out.len() + k, rail);
        }
        out.resize(n, scratch[best].0);
        self.scratch = scratch;
        self.account(shape, out);
    }

    /// Probe call: deals the slices round-robin over every candidate of every tier.
    fn probe(&mut self, tiers: &[&[RailId]], shape: SliceShape, out: &mut Vec<RailId>) {
        let mut flat = std::mem::take(&mut self.scratch);
        flat.clear();
        flat.extend(tiers.iter().flat_map(|t| t.iter().map(|&r| (r, 0.0))));
        let k = flat.len();
        let start = self.probe_cursor % k;
        for i in 0..shape.count {
            out.push(flat[(start + i) % k].0);
        }
        self.probe_cursor = (start + shape.count % k) % k;
        self.scratch = flat;
        self.account(shape, out);
    }

    /// Adds the bytes of the slices in `out` to their rails' in-flight counts.
    fn account(&mut self, shape: SliceShape, out: &[RailId]) {
        if let Some((&last, rest)) = out.split_last() {
            for &rail in rest {
                self.add_inflight(rail, shape.slice_bytes);
            }
            self.add_inflight(last, shape.last_bytes);
        }
    }
}

/// Seconds until a slice of `bytes` bytes would complete on `rail` behind its in-flight bytes.
#[inline]
fn predicted_time(rail: &Rail, bytes: u64) -> f64 {
    (rail.inflight as f64 + bytes as f64) * rail.secs_per_byte
}

/// Jitter for the candidates of one decision: uniform in `[0, score_jitter_range)` on a grid of
/// 2^32 steps, two draws per 64-bit random word. Drawing a fresh `f64` per candidate cost about
/// a third of a smart decision; 32 bits of resolution are plenty for breaking ties.
struct Jitter<'a> {
    rng: &'a mut SmallRng,
    scale: f64,
    max: f64,
    word: u64,
    /// Whether the upper half of `word` is still unused.
    spare: bool,
}

impl<'a> Jitter<'a> {
    fn new(rng: &'a mut SmallRng, scale: f64, max: f64) -> Self {
        Jitter {
            rng,
            scale,
            max,
            word: 0,
            spare: false,
        }
    }

    #[inline]
    fn next(&mut self) -> f64 {
        if self.scale == 0.0 {
            return 0.0;
        }
        let bits = if self.spare {
            self.spare = false;
            (self.word >> 32) as u32
        } else {
            self.word = self.rng.next_u64();
            self.spare = true;
            self.word as u32
        };
        (f64::from(bits) * self.scale).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slicing::SlicePlan;
    use proptest::prelude::*;

    const KIB: u64 = 1024;
    const S: u64 = 64 * KIB;
    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;

    /// TENT's selector: its clamped EWMA, one bandwidth sample per slice (pooling and the
    /// delivery estimator are tested on their own).
    fn cfg() -> SelectorConfig {
        SelectorConfig {
            min_sample_ns: 0,
            estimator: BandwidthEstimator::Tent,
            ..SelectorConfig::default()
        }
    }

    fn no_jitter() -> SelectorConfig {
        SelectorConfig {
            score_jitter_range: 0.0,
            ..cfg()
        }
    }

    fn baseline() -> SelectorConfig {
        SelectorConfig {
            enable_smart_scheduling: false,
            ..cfg()
        }
    }

    fn gbps(g: f64) -> Option<f64> {
        Some(g)
    }

    fn ewma_gbps(sel: &DeviceSelector, rail: RailId) -> f64 {
        sel.rail_stats(rail).unwrap().ewma_gbps
    }

    fn inflight(sel: &DeviceSelector, rail: RailId) -> u64 {
        sel.rail_stats(rail).unwrap().inflight_bytes
    }

    fn counts(out: &[RailId], rails: usize) -> Vec<usize> {
        let mut c = vec![0; rails];
        for &r in out {
            c[r] += 1;
        }
        c
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
    }

    // --- theoretical bandwidth -----------------------------------------------------------

    #[test]
    fn theoretical_bandwidth_inside_range_is_the_report() {
        assert_eq!(theoretical_bandwidth(&cfg(), Some(100.0)), 100.0);
        assert_eq!(theoretical_bandwidth(&cfg(), Some(10.0)), 10.0);
        assert_eq!(theoretical_bandwidth(&cfg(), Some(800.0)), 800.0);
    }

    #[test]
    fn theoretical_bandwidth_below_min_above_max_or_unknown_is_the_default() {
        assert_eq!(theoretical_bandwidth(&cfg(), Some(9.99)), 400.0);
        assert_eq!(theoretical_bandwidth(&cfg(), Some(0.0)), 400.0);
        assert_eq!(theoretical_bandwidth(&cfg(), Some(800.01)), 400.0);
        assert_eq!(theoretical_bandwidth(&cfg(), None), 400.0);
        assert_eq!(theoretical_bandwidth(&cfg(), Some(f64::NAN)), 400.0);
        let c = SelectorConfig {
            default_bandwidth_gbps: 25.0,
            ..cfg()
        };
        assert_eq!(theoretical_bandwidth(&c, None), 25.0);
    }

    #[test]
    fn ewma_starts_at_theoretical() {
        let sel = DeviceSelector::new(cfg(), &[gbps(100.0), None, gbps(5.0)], 1);
        let t: Vec<f64> = sel.stats().map(|s| s.ewma_gbps).collect();
        assert!(
            close(t[0], 100.0) && close(t[1], 400.0) && close(t[2], 400.0),
            "{t:?}"
        );
        assert!(sel.stats().zip(&t).all(|(s, &e)| s.theoretical_gbps == e));
    }

    // --- baseline ------------------------------------------------------------------------

    #[test]
    fn baseline_round_robins_within_tier_0_and_ignores_lower_tiers() {
        let mut sel = DeviceSelector::new(baseline(), &[None; 5], 1);
        let tiers: &[&[RailId]] = &[&[0, 1, 2], &[3], &[4]];
        let got: Vec<RailId> = (0..7).map(|_| sel.select_one(tiers, S).unwrap()).collect();
        assert_eq!(got, [0, 1, 2, 0, 1, 2, 0]);
        // Even a heavily loaded tier-0 rail keeps its turn: baseline does not adapt.
        let mut out = vec![];
        sel.select(tiers, SliceShape::uniform(5, S), &mut out)
            .unwrap();
        assert_eq!(out, [1, 2, 0, 1, 2]);
        assert_eq!(inflight(&sel, 3) + inflight(&sel, 4), 0);
    }

    #[test]
    fn baseline_falls_to_tier_1_when_tier_0_is_empty() {
        let mut sel = DeviceSelector::new(baseline(), &[None; 5], 1);
        let tiers: &[&[RailId]] = &[&[], &[3, 4], &[0]];
        let got: Vec<RailId> = (0..4).map(|_| sel.select_one(tiers, S).unwrap()).collect();
        assert_eq!(got, [3, 4, 3, 4]);
    }

    #[test]
    fn baseline_is_deterministic_across_seeds() {
        let tiers: &[&[RailId]] = &[&[0, 1, 2, 3]];
        let run = |seed| {
            let mut sel = DeviceSelector::new(baseline(), &[None; 4], seed);
            let mut out = vec![];
            sel.select(tiers, SliceShape::uniform(9, S), &mut out)
                .unwrap();
            out
        };
        assert_eq!(run(1), run(2));
    }

    #[test]
    fn no_candidates_and_unknown_rails_are_errors_without_side_effects() {
        for c in [cfg(), baseline()] {
            let mut sel = DeviceSelector::new(c, &[None; 2], 1);
            let mut out = vec![7];
            assert_eq!(
                sel.select_one(&[&[], &[]], S),
                Err(SelectError::NoCandidates)
            );
            assert_eq!(sel.select_one(&[], S), Err(SelectError::NoCandidates));
            assert_eq!(
                sel.select(&[&[]], SliceShape::uniform(3, S), &mut out),
                Err(SelectError::NoCandidates)
            );
            assert!(out.is_empty());
            assert_eq!(
                sel.select(&[&[0], &[1, 2]], SliceShape::uniform(3, S), &mut out),
                Err(SelectError::UnknownRail(2))
            );
            assert_eq!(
                sel.select_one(&[&[0], &[9]], S),
                Err(SelectError::UnknownRail(9))
            );
            assert!(out.is_empty());
            assert_eq!(inflight(&sel, 0) + inflight(&sel, 1), 0);
            assert_eq!(
                sel.on_completed(2, S, 0, 1),
                Err(SelectError::UnknownRail(2))
            );
            assert_eq!(sel.on_failed(2, S), Err(SelectError::UnknownRail(2)));
            assert_eq!(sel.on_unassigned(2, S), Err(SelectError::UnknownRail(2)));
            assert_eq!(sel.rail_stats(2), None);
        }
        assert!(SelectError::UnknownRail(4).to_string().contains('4'));
    }

    #[test]
    fn zero_slices_is_an_empty_decision() {
        let mut sel = DeviceSelector::new(cfg(), &[None], 1);
        let mut out = vec![3];
        sel.select(&[&[0]], SliceShape::uniform(0, S), &mut out)
            .unwrap();
        assert!(out.is_empty());
        assert_eq!(sel.multi_slice_calls(), 0);
    }

    // --- smart mode ----------------------------------------------------------------------

    #[test]
    fn smart_single_slice_picks_least_predicted_completion_time() {
        let mut sel = DeviceSelector::new(cfg(), &[gbps(100.0), gbps(400.0), gbps(200.0)], 1);
        let tiers: &[&[RailId]] = &[&[0, 1, 2]];
        assert_eq!(sel.select_one(tiers, S), Ok(1));
        let mut out = vec![];
        sel.select(tiers, SliceShape::uniform(1, S), &mut out)
            .unwrap();
        assert_eq!(out, [1], "select with one slice follows the same rule");
    }

    #[test]
    fn inflight_load_steers_slices_away() {
        let mut sel = DeviceSelector::new(cfg(), &[gbps(100.0), gbps(100.0)], 1);
        // Load rail 0 by offering it alone.
        assert_eq!(sel.select_one(&[&[0]], S), Ok(0));
        assert_eq!(inflight(&sel, 0), S);
        assert_eq!(sel.select_one(&[&[0, 1]], S), Ok(1));
        assert_eq!(inflight(&sel, 1), S);
        // A 4x faster rail takes slices until its predicted time reaches the slow one's.
        let mut sel = DeviceSelector::new(cfg(), &[gbps(100.0), gbps(400.0)], 1);
        let got: Vec<RailId> = (0..5)
            .map(|_| sel.select_one(&[&[0, 1]], S).unwrap())
            .collect();
        // Rail 1 scores S/4, 2S/4, 3S/4, 4S/4+: the 4th slice ties (1.0 vs 1.0, jitter
        // decides), the 5th surely goes to rail 0 if the 4th did not.
        assert_eq!(&got[..3], [1, 1, 1]);
        assert!(got[3..].contains(&0), "{got:?}");
    }

    #[test]
    fn numa_penalty_makes_remote_lose_unless_local_is_loaded_enough() {
        // Equal rails; remote penalty 5: local wins while (L + S) < 5 S, i.e. L < 4 S.
        let mut sel = DeviceSelector::new(cfg(), &[gbps(100.0), gbps(100.0)], 1);
        let tiers: &[&[RailId]] = &[&[0], &[1]];
        for _ in 0..3 {
            assert_eq!(sel.select_one(tiers, S), Ok(0));
        }
        // L = 3 S: local 4 S vs remote 5 S.
        assert_eq!(sel.select_one(tiers, S), Ok(0));
        // L = 4 S: local 5 S ties remote 5 S; one more slice of load settles it.
        sel.select_one(&[&[0]], S).unwrap();
        // L = 5 S: local 6 S vs remote 5 S.
        assert_eq!(sel.select_one(tiers, S), Ok(1));
    }

    #[test]
    fn tier_beyond_penalties_uses_the_last_penalty() {
        let c = SelectorConfig {
            numa_penalties: vec![1.0, 3.0],
            ..no_jitter()
        };
        assert_eq!(c.numa_penalty(7), 3.0);
        assert_eq!(
            SelectorConfig {
                numa_penalties: vec![],
                ..cfg()
            }
            .numa_penalty(0),
            1.0
        );
        // Tier 3 (penalty 3) with 4x the bandwidth beats tier 0: 1/4 × 3 < 1.
        let mut sel = DeviceSelector::new(c, &[gbps(100.0), gbps(400.0)], 1);
        assert_eq!(sel.select_one(&[&[0], &[], &[], &[1]], S), Ok(1));
    }

    #[test]
    fn multi_slice_distribution_is_proportional_with_remainder_to_best() {
        // Bandwidth 1:2:4, no load, no jitter: weights 1:2:4 of 7. For 10 slices the shares
        // 1.43, 2.86, 5.71 floor to 1, 2, 5; the 2 left over go to the best rail (2).
        let c = SelectorConfig {
            score_epsilon: 0.0,
            ..no_jitter()
        };
        let mut sel = DeviceSelector::new(c, &[gbps(100.0), gbps(200.0), gbps(400.0)], 1);
        let mut out = vec![];
        sel.select(&[&[0, 1, 2]], SliceShape::uniform(10, S), &mut out)
            .unwrap();
        assert_eq!(counts(&out, 3), [1, 2, 7]);
        assert_eq!(out, [0, 1, 1, 2, 2, 2, 2, 2, 2, 2]);
        for r in 0..3 {
            assert_eq!(inflight(&sel, r), counts(&out, 3)[r] as u64 * S);
        }
    }

    #[test]
    fn multi_slice_distribution_with_default_jitter_and_epsilon_is_the_same() {
        // Jitter (1 ns) and epsilon are far below the scores (~1 µs), so shares do not move.
        let mut sel = DeviceSelector::new(cfg(), &[gbps(100.0), gbps(200.0), gbps(400.0)], 9);
        let mut out = vec![];
        sel.select(&[&[0, 1, 2]], SliceShape::uniform(10, S), &mut out)
            .unwrap();
        assert_eq!(counts(&out, 3), [1, 2, 7]);
    }

    #[test]
    fn multi_slice_applies_numa_penalties_and_load() {
        // Equal rails, penalties 1 and 5: weights 5:1 of 6. 13 slices: shares 10.8 and 2.2
        // floor to 10 and 2, the remainder goes to rail 0.
        let mut sel = DeviceSelector::new(no_jitter(), &[gbps(100.0), gbps(100.0)], 1);
        let mut out = vec![];
        sel.select(&[&[0], &[1]], SliceShape::uniform(13, S), &mut out)
            .unwrap();
        assert_eq!(counts(&out, 2), [11, 2]);
        // Rail 0 now has 11 S in flight, rail 1 2 S: scores 12 S and 5 × 3 S = 15 S, weights
        // 5:4. 28 slices: shares 15.6 and 12.4 → 15 + 1 remainder and 12.
        sel.select(&[&[0], &[1]], SliceShape::uniform(28, S), &mut out)
            .unwrap();
        assert_eq!(counts(&out, 2), [16, 12]);
    }

    #[test]
    fn last_slice_size_is_accounted() {
        let plan = SlicePlan::new(64 * KIB, 64).unwrap();
        let slices = plan.slices(200 * KIB).unwrap();
        let shape = SliceShape::of(&slices);
        assert_eq!(
            shape,
            SliceShape {
                count: 3,
                slice_bytes: 64 * KIB,
                last_bytes: 72 * KIB
            }
        );
        for c in [cfg(), baseline()] {
            let mut sel = DeviceSelector::new(c, &[None; 3], 1);
            let mut out = vec![];
            sel.select(&[&[0, 1, 2]], shape, &mut out).unwrap();
            let total: u64 = sel.stats().map(|s| s.inflight_bytes).sum();
            assert_eq!(total, 200 * KIB);
            assert_eq!(sel.select_one(&[&[0]], 5), Ok(0));
            let total: u64 = sel.stats().map(|s| s.inflight_bytes).sum();
            assert_eq!(total, 200 * KIB + 5);
        }
        let one = SliceShape::of(&plan.slices(1).unwrap());
        assert_eq!((one.count, one.last_bytes), (1, 1));
    }

    #[test]
    fn every_100th_multi_slice_call_is_a_round_robin_probe() {
        // Rail 0 is so much better that normal calls give it everything.
        let mut sel = DeviceSelector::new(cfg(), &[gbps(800.0), gbps(10.0), gbps(10.0)], 3);
        let tiers: &[&[RailId]] = &[&[0], &[1], &[2]];
        let mut out = vec![];
        let mut probes = vec![];
        for call in 1..=250u64 {
            // Single-slice calls in between do not count.
            let one = sel.select_one(tiers, S).unwrap();
            assert_eq!(one, 0);
            sel.on_unassigned(one, S).unwrap();
            sel.select(tiers, SliceShape::uniform(1, S), &mut out)
                .unwrap();
            assert_eq!(out, [0]);
            sel.on_unassigned(0, S).unwrap();
            sel.select(tiers, SliceShape::uniform(4, S), &mut out)
                .unwrap();
            for &r in &out {
                sel.on_unassigned(r, S).unwrap();
            }
            if out != [0, 0, 0, 0] {
                probes.push((call, out.clone()));
            }
        }
        assert_eq!(sel.multi_slice_calls(), 250);
        // The second probe starts where the first one stopped.
        assert_eq!(probes, [(100, vec![0, 1, 2, 0]), (200, vec![1, 2, 0, 1])]);
    }

    #[test]
    fn probe_covers_every_tier_and_baseline_never_probes() {
        let mut sel = DeviceSelector::new(cfg(), &[None; 4], 3);
        let tiers: &[&[RailId]] = &[&[2], &[], &[0, 3], &[1]];
        let mut out = vec![];
        for _ in 0..99 {
            sel.select(tiers, SliceShape::uniform(2, S), &mut out)
                .unwrap();
        }
        sel.select(tiers, SliceShape::uniform(6, S), &mut out)
            .unwrap();
        assert_eq!(out, [2, 0, 3, 1, 2, 0]);

        let mut sel = DeviceSelector::new(baseline(), &[None; 4], 3);
        for _ in 0..200 {
            sel.select(tiers, SliceShape::uniform(2, S), &mut out)
                .unwrap();
            assert_eq!(out, [2, 2]);
        }
        assert_eq!(sel.multi_slice_calls(), 0);
    }

    // --- jitter --------------------------------------------------------------------------

    #[test]
    fn jitter_stays_in_range() {
        let mut sel = DeviceSelector::new(cfg(), &[], 5);
        let range: f64 = 1e-9;
        let mut jitter = Jitter::new(&mut sel.rng, sel.jitter_scale, sel.jitter_max);
        let mut lo = f64::INFINITY;
        let mut hi: f64 = 0.0;
        for _ in 0..100_000 {
            let j = jitter.next();
            assert!((0.0..range).contains(&j), "{j}");
            lo = lo.min(j);
            hi = hi.max(j);
        }
        assert!(
            lo < 0.01 * range && hi > 0.99 * range,
            "spread over the range: {lo} {hi}"
        );
        // The largest draw stays below the range, however large or small the range.
        // (2^31 + 1) × 2^-1074: range / 2^32 rounds up to 2^-1074, and only the clamp keeps
        // (2^32 − 1) × 2^-1074 from exceeding the range.
        let odd_subnormal = f64::from_bits((1 << 31) + 1);
        for range in [1e-9, 1.0, 3.0, 1e300, f64::MIN_POSITIVE, odd_subnormal] {
            let c = SelectorConfig {
                score_jitter_range: range,
                ..cfg()
            };
            let mut sel = DeviceSelector::new(c, &[], 5);
            let mut jitter = Jitter::new(&mut sel.rng, sel.jitter_scale, sel.jitter_max);
            jitter.word = u64::MAX;
            jitter.spare = true;
            let j = jitter.next();
            assert!((0.0..range).contains(&j), "{range}: {j}");
        }
        let mut sel = DeviceSelector::new(no_jitter(), &[], 5);
        assert_eq!(Jitter::new(&mut sel.rng, 0.0, 0.0).next(), 0.0);
    }

    #[test]
    fn odd_jitter_ranges_disable_jitter_without_panicking() {
        for range in [-1.0, f64::NAN, f64::INFINITY, 0.0] {
            let c = SelectorConfig {
                score_jitter_range: range,
                ..cfg()
            };
            let mut sel = DeviceSelector::new(c, &[None; 2], 1);
            // No jitter: an exact tie always resolves to the first candidate.
            for _ in 0..20 {
                let r = sel.select_one(&[&[0, 1]], S).unwrap();
                assert_eq!(r, 0);
                sel.on_unassigned(r, S).unwrap();
            }
        }
    }

    #[test]
    fn jitter_breaks_ties_and_a_fixed_seed_reproduces_decisions() {
        let run = |seed| {
            let mut sel = DeviceSelector::new(cfg(), &[None; 4], seed);
            let tiers: &[&[RailId]] = &[&[0, 1, 2, 3]];
            let mut out = vec![];
            let mut log = vec![];
            for i in 0..300u64 {
                let r = sel.select_one(tiers, S).unwrap();
                sel.on_completed(r, S, i * US, i * US + 500).unwrap();
                log.push(r);
                sel.select(tiers, SliceShape::uniform(3, S), &mut out)
                    .unwrap();
                for &r in &out {
                    sel.on_completed(r, S, i * US, i * US + 700).unwrap();
                }
                log.extend_from_slice(&out);
            }
            (log, sel.stats().collect::<Vec<_>>())
        };
        let (a, sa) = run(42);
        let (b, sb) = run(42);
        assert_eq!(a, b);
        assert_eq!(sa, sb);
        let (c, _) = run(43);
        assert_ne!(a, c, "another seed breaks ties differently");
        // Equal idle rails: jitter alone decides, and spreads the choices.
        let mut sel = DeviceSelector::new(cfg(), &[None; 4], 7);
        let mut picks = vec![];
        for _ in 0..400 {
            let r = sel.select_one(&[&[0, 1, 2, 3]], S).unwrap();
            sel.on_unassigned(r, S).unwrap();
            picks.push(r);
        }
        let c = counts(&picks, 4);
        assert!(
            c.iter().all(|&k| k > 50),
            "ties spread over all rails: {c:?}"
        );
    }

    // --- EWMA ----------------------------------------------------------------------------

    fn learning(alpha: f64) -> SelectorConfig {
        SelectorConfig {
            bandwidth_learning_rate: alpha,
            ..cfg()
        }
    }

    /// Bytes that take `ns` at `gbps`.
    fn bytes_at(gbps: f64, ns: u64) -> u64 {
        (gbps * BYTES_PER_S_PER_GBPS * ns as f64 / NS_PER_S).round() as u64
    }

    #[test]
    fn alpha_0_takes_the_newest_sample() {
        let mut sel = DeviceSelector::new(learning(0.0), &[gbps(100.0)], 1);
        sel.on_completed(0, bytes_at(37.0, MS), 0, MS).unwrap();
        assert!(close(ewma_gbps(&sel, 0), 37.0), "{}", ewma_gbps(&sel, 0));
        sel.on_completed(0, bytes_at(250.0, MS), 5 * MS, 6 * MS)
            .unwrap();
        assert!(close(ewma_gbps(&sel, 0), 250.0), "{}", ewma_gbps(&sel, 0));
    }

    #[test]
    fn alpha_1_never_changes() {
        let mut sel = DeviceSelector::new(learning(1.0), &[gbps(100.0)], 1);
        sel.on_completed(0, bytes_at(37.0, MS), 0, MS).unwrap();
        sel.on_completed(0, bytes_at(900.0, MS), 5 * MS, 6 * MS)
            .unwrap();
        assert_eq!(ewma_gbps(&sel, 0), 100.0);
    }

    #[test]
    fn alpha_0_01_keeps_1_percent_of_the_old_estimate() {
        // TENT's formula: ewma = α × old + (1 − α) × observed.
        let mut sel = DeviceSelector::new(learning(0.01), &[gbps(100.0)], 1);
        sel.on_completed(0, bytes_at(50.0, MS), 0, MS).unwrap();
        let want = 0.01 * 100.0 + 0.99 * 50.0;
        assert!(close(ewma_gbps(&sel, 0), want), "{}", ewma_gbps(&sel, 0));
    }

    #[test]
    fn ewma_is_clamped_at_both_multipliers() {
        let mut sel = DeviceSelector::new(learning(0.0), &[gbps(100.0)], 1);
        // 1 byte in 1 s: far below 0.1 × 100 Gbps.
        sel.on_completed(0, 1, 0, 1_000_000_000).unwrap();
        assert!(close(ewma_gbps(&sel, 0), 10.0), "{}", ewma_gbps(&sel, 0));
        // 1 MB in 1 ns: far above 10 × 100 Gbps.
        sel.on_completed(0, 1_000_000, 2_000_000_000, 2_000_000_001)
            .unwrap();
        assert!(close(ewma_gbps(&sel, 0), 1000.0), "{}", ewma_gbps(&sel, 0));
        let c = SelectorConfig {
            ewma_min_bandwidth_multiplier: 0.5,
            ewma_max_bandwidth_multiplier: 2.0,
            ..learning(0.0)
        };
        let mut sel = DeviceSelector::new(c, &[gbps(100.0)], 1);
        sel.on_completed(0, 1, 0, 1_000_000_000).unwrap();
        assert!(close(ewma_gbps(&sel, 0), 50.0));
        sel.on_completed(0, 1_000_000, 2_000_000_000, 2_000_000_001)
            .unwrap();
        assert!(close(ewma_gbps(&sel, 0), 200.0));
    }

    #[test]
    fn min_multiplier_above_max_does_not_panic() {
        let c = SelectorConfig {
            ewma_min_bandwidth_multiplier: 3.0,
            ewma_max_bandwidth_multiplier: 2.0,
            ..learning(0.0)
        };
        let mut sel = DeviceSelector::new(c, &[gbps(100.0)], 1);
        sel.on_completed(0, 1, 0, 1_000).unwrap();
        assert!(ewma_gbps(&sel, 0).is_finite());
    }

    #[test]
    fn observed_bandwidth_is_timed_from_posting_not_queueing() {
        // Queued at 0, posted at 9 ms, done at 10 ms: 1 ms on the wire.
        let mut sel = DeviceSelector::new(learning(0.0), &[gbps(100.0)], 1);
        let r = sel.select_one(&[&[0]], bytes_at(80.0, MS)).unwrap();
        sel.on_completed(r, bytes_at(80.0, MS), 9 * MS, 10 * MS)
            .unwrap();
        assert!(close(ewma_gbps(&sel, 0), 80.0), "{}", ewma_gbps(&sel, 0));
        assert_eq!(inflight(&sel, 0), 0);
    }

    #[test]
    fn pipelined_slices_are_timed_over_their_busy_interval() {
        // Four slices posted together at 0 on a 100 Gbps rail complete 1 ms apart. Timed from
        // posting, the 4th would seem to take 4 ms (25 Gbps); its busy interval is 1 ms.
        let b = bytes_at(100.0, MS);
        let mut sel = DeviceSelector::new(learning(0.0), &[gbps(100.0)], 1);
        for i in 1..=4 {
            sel.on_completed(0, b, 0, i * MS).unwrap();
            assert!(
                close(ewma_gbps(&sel, 0), 100.0),
                "slice {i}: {}",
                ewma_gbps(&sel, 0)
            );
        }
        // After an idle gap, the next slice is timed from its own posting.
        sel.on_completed(0, b / 2, 20 * MS, 21 * MS).unwrap();
        assert!(close(ewma_gbps(&sel, 0), 50.0), "{}", ewma_gbps(&sel, 0));
    }

    #[test]
    fn completions_reaped_together_form_one_sample() {
        // Three slices delivered within the same 1 ms, reaped with one timestamp: 3 × b / 1 ms.
        let b = bytes_at(30.0, MS);
        let mut sel = DeviceSelector::new(learning(0.0), &[gbps(100.0)], 1);
        for _ in 0..3 {
            sel.on_completed(0, b, 0, MS).unwrap();
        }
        assert!(close(ewma_gbps(&sel, 0), 90.0), "{}", ewma_gbps(&sel, 0));
        assert_eq!(sel.rail_stats(0).unwrap().slices, 3);
        // With α > 0 the batch is still one update from the estimate before it.
        let mut sel = DeviceSelector::new(learning(0.5), &[gbps(100.0)], 1);
        for _ in 0..3 {
            sel.on_completed(0, b, 0, MS).unwrap();
        }
        assert!(close(ewma_gbps(&sel, 0), 95.0), "{}", ewma_gbps(&sel, 0));
    }

    #[test]
    fn pooled_samples_learn_from_the_busy_time_of_many_completions() {
        // Completions 0.1 ms apart, with one arriving in a burst 1 µs after another: per slice
        // that burst reads as 100x the rail's speed; pooled over 1 ms it does not.
        let b = bytes_at(10.0, MS / 10);
        let mut cfg = learning(0.0);
        cfg.min_sample_ns = MS;
        let mut sel = DeviceSelector::new(cfg, &[gbps(100.0)], 1);
        let mut out = Vec::new();
        sel.select(&[&[0]], SliceShape::uniform(20, b), &mut out)
            .unwrap();
        let mut t = 0;
        for i in 0..9 {
            t += if i == 4 { 1_000 } else { MS / 10 };
            sel.on_completed(0, b, 0, t).unwrap();
            assert_eq!(
                ewma_gbps(&sel, 0),
                100.0,
                "no sample before 1 ms of busy time"
            );
        }
        // A completion reaped late by another thread reports an earlier time: no bandwidth
        // appears out of nowhere.
        sel.on_completed(0, b, 0, t - MS / 20).unwrap();
        assert_eq!(ewma_gbps(&sel, 0), 100.0);
        t += MS / 10 + MS / 10;
        sel.on_completed(0, b, 0, t).unwrap();
        let pooled = ewma_gbps(&sel, 0);
        // 11 slices worth 0.1 ms each at 10 Gbps over ~1.0 ms of busy time.
        assert!((10.0..=11.5).contains(&pooled), "{pooled}");
        assert_eq!(sel.rail_stats(0).unwrap().slices, 11);
    }

    #[test]
    fn non_positive_intervals_count_but_do_not_learn() {
        let mut sel = DeviceSelector::new(learning(0.0), &[gbps(100.0)], 1);
        sel.select_one(&[&[0]], 3 * S).unwrap();
        // Posted at the completion instant, no earlier sample: nothing to learn.
        sel.on_completed(0, S, 5 * MS, 5 * MS).unwrap();
        // Completion timestamp before the previous one (out of order).
        sel.on_completed(0, S, 0, 4 * MS).unwrap();
        // Posted after it completed (clock confusion).
        sel.on_completed(0, S, 9 * MS, 8 * MS).unwrap();
        let s = sel.rail_stats(0).unwrap();
        assert_eq!(s.ewma_gbps, 100.0);
        assert_eq!((s.slices, s.total_bytes, s.inflight_bytes), (3, 3 * S, 0));
    }

    #[test]
    fn learned_bandwidth_steers_decisions() {
        let mut sel = DeviceSelector::new(learning(0.0), &[gbps(100.0), gbps(100.0)], 1);
        assert_eq!(sel.select_one(&[&[0]], S), Ok(0));
        // Rail 0 turns out to deliver 50 Gbps; rail 1 keeps its 100 Gbps estimate.
        sel.on_completed(
            0,
            S,
            0,
            (S as f64 / (50.0 * BYTES_PER_S_PER_GBPS) * 1e9) as u64,
        )
        .unwrap();
        assert_eq!(sel.select_one(&[&[0, 1]], S), Ok(1));
    }

    // --- the delivery estimator and app-limited samples --------------------------------

    /// The default estimator (delivery, 1 ms pooled samples, 20 ms max filter).
    fn delivery() -> SelectorConfig {
        SelectorConfig::default()
    }

    /// A rail that serializes slices back to back at `gbps`, kept busy by a sender that posts a
    /// new slice whenever one completes and always has `depth` in flight; the rate changes to
    /// `after_gbps` at `change_ns`. Feeds `sel` (rail 0) from `from_ns` to `until_ns` of virtual
    /// time and returns when it stopped; `at` is called after every completion with the time.
    #[allow(clippy::too_many_arguments)]
    fn saturate(
        sel: &mut DeviceSelector,
        slice: u64,
        depth: usize,
        gbps: f64,
        change: (u64, f64),
        from_ns: u64,
        until_ns: u64,
        mut at: impl FnMut(&DeviceSelector, u64),
    ) -> u64 {
        let mut posted: std::collections::VecDeque<u64> = (0..depth).map(|_| from_ns).collect();
        for _ in 0..depth {
            sel.select_one(&[&[0]], slice).unwrap();
        }
        // When the link has put out everything posted so far.
        let mut wire_free = from_ns;
        let mut now = from_ns;
        while now < until_ns {
            let p = posted.pop_front().unwrap();
            let g = if wire_free >= change.0 {
                change.1
            } else {
                gbps
            };
            let ser = (slice as f64 / (g * BYTES_PER_S_PER_GBPS) * NS_PER_S) as u64;
            wire_free = wire_free.max(p) + ser.max(1);
            now = wire_free + 2 * US;
            sel.on_delivered(0, slice, p, now, false).unwrap();
            at(sel, now);
            sel.select_one(&[&[0]], slice).unwrap();
            posted.push_back(now);
        }
        now
    }

    #[test]
    fn a_stall_lowers_the_estimate_to_what_the_undelivered_slice_shows_at_most() {
        // Rail 0 carries 5 Gbit/s for 50 ms of virtual time, then nothing: a stalled slice of
        // 64 KiB posted then is given up on half a second later.
        let mut sel = DeviceSelector::new(delivery(), &[gbps(10.0), gbps(10.0)], 1);
        let end = saturate(
            &mut sel,
            64 << 10,
            4,
            5.0,
            (u64::MAX, 5.0),
            0,
            50 * MS,
            |_, _| {},
        );
        let before = ewma_gbps(&sel, 0);
        assert!(before > 4.0, "{before}");
        sel.select_one(&[&[0]], 64 << 10).unwrap();
        sel.on_stalled(0, 64 << 10, end, end + 500 * MS).unwrap();
        // 64 KiB in 0.5 s is about 1 Mbit/s, taken as it is (not smoothed with the old 5 Gbit/s).
        let after = ewma_gbps(&sel, 0);
        let bound = (64 << 10) as f64 * 8.0 / 0.5 / 1e9;
        assert!(
            (after - bound).abs() < 1e-9,
            "estimate {after} Gbit/s after the stall"
        );
        assert_eq!(ewma_gbps(&sel, 1), 10.0, "another rail moved");
        // The slice comes back failed; the next delivery is learned from afresh, and one far
        // above the bound raises the estimate again.
        let held = inflight(&sel, 0);
        sel.on_failed(0, 64 << 10).unwrap();
        assert_eq!(inflight(&sel, 0), held - (64 << 10));
        let t = end + 600 * MS;
        saturate(
            &mut sel,
            64 << 10,
            4,
            5.0,
            (u64::MAX, 5.0),
            t,
            t + 50 * MS,
            |_, _| {},
        );
        assert!(ewma_gbps(&sel, 0) > 4.0, "{}", ewma_gbps(&sel, 0));
        // A bound above the estimate says nothing new.
        let est = ewma_gbps(&sel, 0);
        sel.on_stalled(0, 1 << 30, t, t + 1).unwrap();
        assert_eq!(ewma_gbps(&sel, 0), est);
        assert_eq!(sel.on_stalled(7, 1, 0, 1), Err(SelectError::UnknownRail(7)));
    }

    #[test]
    fn a_rail_back_after_a_stall_gets_its_estimate_from_before_the_stall() {
        let mut sel = DeviceSelector::new(delivery(), &[gbps(10.0), gbps(10.0)], 1);
        // Never stalled: nothing to restore.
        sel.on_recovered(0, MS).unwrap();
        assert_eq!(ewma_gbps(&sel, 0), 10.0);
        sel.on_stalled(0, 64 << 10, MS, 501 * MS).unwrap();
        assert!(ewma_gbps(&sel, 0) < 0.01);
        // A second stall in a row lowers it further; the restore goes to the first one's.
        sel.on_stalled(0, 4096, 600 * MS, 1_100 * MS).unwrap();
        sel.on_recovered(0, 1_200 * MS).unwrap();
        assert_eq!(ewma_gbps(&sel, 0), 10.0);
        assert_eq!(ewma_gbps(&sel, 1), 10.0);
        assert_eq!(
            sel.on_recovered(7, 0),
            Err(SelectError::UnknownRail(7)),
            "an unknown rail"
        );
    }

    #[test]
    fn tent_estimate_after_a_stall_keeps_to_its_clamp() {
        let mut sel = DeviceSelector::new(cfg(), &[gbps(10.0)], 1);
        sel.on_stalled(0, 4096, 0, 500 * MS).unwrap();
        let after = ewma_gbps(&sel, 0);
        assert!((1.0 - 1e-9..10.0).contains(&after), "{after}");
    }

    #[test]
    fn app_limited_samples_raise_but_never_lower_the_estimate() {
        for estimator in [BandwidthEstimator::Delivery, BandwidthEstimator::Tent] {
            let c = SelectorConfig {
                estimator,
                min_sample_ns: 0,
                ..SelectorConfig::default()
            };
            let mut sel = DeviceSelector::new(c, &[gbps(100.0)], 1);
            // A trickle at a tenth of the rail's rate, app-limited: ignored.
            for i in 0..50 {
                let t = i * MS;
                sel.on_delivered(0, bytes_at(10.0, MS), t, t + MS, true)
                    .unwrap();
                assert_eq!(ewma_gbps(&sel, 0), 100.0, "{estimator:?}");
            }
            // An app-limited sample above the estimate still raises it.
            sel.on_delivered(0, bytes_at(150.0, MS), 60 * MS, 61 * MS, true)
                .unwrap();
            assert!(ewma_gbps(&sel, 0) > 140.0, "{estimator:?}");
        }
    }

    #[test]
    fn pooled_samples_that_are_mostly_app_limited_do_not_lower_the_estimate() {
        let mut sel = DeviceSelector::new(delivery(), &[gbps(100.0)], 1);
        let b = bytes_at(20.0, MS / 4);
        for i in 0..40 {
            let t = i * MS / 4;
            sel.select_one(&[&[0]], b).unwrap();
            // Three of every four slices app-limited.
            sel.on_delivered(0, b, t, t + MS / 4, i % 4 != 0).unwrap();
        }
        assert_eq!(ewma_gbps(&sel, 0), 100.0);
    }

    /// A 10 Gbps NIC policed to 200 Mbit/s by a token bucket of 32 KB: every 3 ms pause lets
    /// the next 32 KB through at link speed. The sender moves runs of eight 64 KiB slices, one
    /// in flight, the first of a run posted on an idle rail (app-limited). Returns the highest
    /// estimate (Gbps) over the second half of a second, read after every completion.
    fn estimate_of_a_policed_rail(cfg: SelectorConfig) -> f64 {
        const BUCKET: u64 = 32_000;
        let (line, rate) = (10.0, 0.2);
        let ns_for = |bytes: u64, gbps: f64| (bytes as f64 * 8.0 / gbps) as u64;
        let mut sel = DeviceSelector::new(cfg, &[gbps(line)], 1);
        let (mut t, mut highest) = (0, 0.0f64);
        while t < 1_000 * MS {
            t += 3 * MS;
            let mut tokens = BUCKET;
            for i in 0..8 {
                sel.select_one(&[&[0]], S).unwrap();
                let burst = tokens.min(S);
                tokens -= burst;
                let done = t + ns_for(burst, line) + ns_for(S - burst, rate);
                sel.on_delivered(0, S, t, done, i == 0).unwrap();
                t = done;
                if t > 500 * MS {
                    highest = highest.max(ewma_gbps(&sel, 0));
                }
            }
        }
        highest
    }

    #[test]
    fn a_token_bucket_burst_after_each_pause_does_not_inflate_the_estimate() {
        let got = estimate_of_a_policed_rail(delivery());
        assert!(
            (got - 0.2).abs() <= 0.2 * 0.15,
            "estimate up to {got} Gbps of a 0.2 Gbps rail"
        );
        // Samples of a millisecond alone catch the burst: the check has teeth.
        let ms_only = SelectorConfig {
            min_sample_bytes: 0,
            ..delivery()
        };
        let inflated = estimate_of_a_policed_rail(ms_only);
        assert!(
            inflated > 0.2 * 1.15,
            "millisecond samples read {inflated} Gbps"
        );
    }

    /// A 10 Gbps NIC policed to `carries` Gbps, saturated with 8 slices of 64 KiB in flight for
    /// `run_ns`: from when on the delivery estimate stayed within 15 % of `carries` (`None`
    /// when it was not within at the end).
    fn learned_and_kept_from(carries: f64, run_ns: u64) -> Option<u64> {
        let mut sel = DeviceSelector::new(delivery(), &[gbps(10.0)], 1);
        let mut learned_at = None;
        saturate(
            &mut sel,
            64 * KIB,
            8,
            carries,
            (u64::MAX, carries),
            0,
            run_ns,
            |s, t| {
                let e = s.rail_stats(0).unwrap().ewma_gbps;
                if (e - carries).abs() <= 0.15 * carries {
                    learned_at.get_or_insert(t);
                } else {
                    learned_at = None;
                }
            },
        );
        learned_at
    }

    #[test]
    fn delivery_learns_a_rail_at_3_percent_of_nominal_within_80_ms() {
        // A 10 Gbps NIC policed to 300 Mbit/s: TENT's clamp would hold it at 1 Gbps. A sample
        // holds a megabyte, 28 ms of this rail.
        let t = learned_and_kept_from(0.3, 200 * MS).expect("learned and kept");
        assert!(t <= 80 * MS, "learned after {} ms", t / MS);
        let tent = SelectorConfig {
            estimator: BandwidthEstimator::Tent,
            ..delivery()
        };
        let mut sel = DeviceSelector::new(tent, &[gbps(10.0)], 1);
        saturate(
            &mut sel,
            64 * KIB,
            8,
            0.3,
            (u64::MAX, 0.3),
            0,
            200 * MS,
            |_, _| {},
        );
        assert!(close(ewma_gbps(&sel, 0), 1.0), "TENT's floor");
    }

    #[test]
    fn delivery_learns_a_rail_at_a_thousandth_of_nominal_from_its_first_slice() {
        // A 10 Gbps NIC policed to 10 Mbit/s: a 64 KiB slice takes 52 ms, and a megabyte, what
        // later samples must hold, 0.84 s. The first sample replaces the assumed 10 Gbps as
        // soon as it spans `min_sample_ns`, with whatever bytes it has.
        let t = learned_and_kept_from(0.01, 2_000 * MS).expect("learned and kept");
        assert!(t <= 60 * MS, "learned after {} ms", t / MS);
    }

    /// A rail saturated with `depth` slices of `slice` bytes that carries `before` Gbps and
    /// `after` from `drop_at` on, fed until `until`: how long after the drop the delivery
    /// estimate came within 15 % of `after` and stayed there. Before the drop the estimate must
    /// be within 15 % of `before` from `settled` on.
    fn followed_after_drop(
        slice: u64,
        depth: usize,
        (before, after): (f64, f64),
        settled: u64,
        drop_at: u64,
        until: u64,
    ) -> u64 {
        let mut sel = DeviceSelector::new(delivery(), &[gbps(before)], 1);
        let mut followed_at = None;
        saturate(
            &mut sel,
            slice,
            depth,
            before,
            (drop_at, after),
            0,
            until,
            |s, t| {
                let e = s.rail_stats(0).unwrap().ewma_gbps;
                if t < drop_at {
                    assert!(
                        t < settled || (e - before).abs() <= 0.15 * before,
                        "{e} at {t}"
                    );
                } else if (e - after).abs() <= 0.15 * after {
                    followed_at.get_or_insert(t);
                } else {
                    followed_at = None;
                }
            },
        );
        followed_at.expect("followed and kept") - drop_at
    }

    #[test]
    fn delivery_follows_a_drop_to_a_quarter_within_a_second() {
        // Jitter-free: the rail's own rate from the start (the latency is pipelined away).
        let after = followed_after_drop(256 * KIB, 16, (100.0, 25.0), 0, 2_000 * MS, 4_000 * MS);
        assert!(after <= 1_000 * MS, "after {} ms", after / MS);
        assert!(after <= DEFAULT_BANDWIDTH_WINDOW_NS + 5 * MS);
    }

    #[test]
    fn delivery_follows_a_collapse_to_a_hundredth_within_tens_of_milliseconds() {
        // 4 KiB slices on a 600 Mbit/s rail that falls to 6 Mbit/s: a megabyte, what a sample
        // otherwise holds, would take 1.4 s of the fallen rail. Learned from the first sample
        // on (10 ms of busy time).
        let after = followed_after_drop(4 * KIB, 17, (0.6, 0.006), 50 * MS, 500 * MS, 1_000 * MS);
        // The 17 slices in flight at the drop drain at the new rate (93 ms), and the sample
        // that spans them is taken with the first completion after 10 ms of the slow rail.
        assert!(after <= 150 * MS, "after {} ms", after / MS);
    }

    #[test]
    fn bursts_a_policer_refills_between_window_limited_slices_do_not_raise_the_estimate() {
        // A 10 Gbps NIC policed to 150 Mbit/s by a 16 KiB token bucket. Kept busy at first (four
        // 64 KiB slices in flight), then held to one slice by its window: each slice is posted
        // 1 ms after the previous one's answer (app-limited), and in that millisecond the
        // bucket refills, so a quarter of every slice leaves at link speed.
        const BUCKET: u64 = 16 * KIB;
        let (line, rate) = (10.0, 0.15);
        let ns_for = |bytes: u64, gbps: f64| (bytes as f64 * 8.0 / gbps) as u64;
        let mut sel = DeviceSelector::new(delivery(), &[gbps(line)], 1);
        let mut t = 0;
        while t < 300 * MS {
            let posted = t;
            for _ in 0..4 {
                sel.select_one(&[&[0]], S).unwrap();
            }
            for _ in 0..4 {
                let done = t + ns_for(S, rate);
                sel.on_delivered(0, S, posted, done, false).unwrap();
                t = done;
            }
        }
        let learned = ewma_gbps(&sel, 0);
        assert!(
            (learned - rate).abs() <= 0.15 * rate,
            "learned {learned} Gbps"
        );
        let mut highest = 0.0f64;
        let mut tokens = BUCKET;
        while t < 2_300 * MS {
            sel.select_one(&[&[0]], S).unwrap();
            let burst = tokens.min(S);
            let done = t + ns_for(burst, line) + ns_for(S - burst, rate);
            sel.on_delivered(0, S, t, done, true).unwrap();
            let gap = MS;
            tokens = (BUCKET as f64).min(gap as f64 * rate / 8.0) as u64;
            t = done + gap;
            highest = highest.max(ewma_gbps(&sel, 0));
        }
        assert!(
            highest <= rate * 1.15,
            "estimate up to {highest} Gbps of a {rate} Gbps rail"
        );
    }

    /// The highest delivery estimate, after its first 300 ms, of a rail carrying `rate`
    /// Gbit/s with `depth` slices of 128 KiB in flight (refilled at each answer), whose answers
    /// stop for 30 ms in every 100 ms and then come back together, a microsecond apart, as a
    /// stalled reader or a target answering many slices in one write returns them. With
    /// `bounded` false the rail's delivery log is wiped after every answer, so pools are timed
    /// by busy time alone.
    fn highest_estimate_with_answers_held_back(rate: f64, depth: usize, bounded: bool) -> f64 {
        const SLICE: u64 = 128 * KIB;
        let ser = (SLICE as f64 * 8.0 / rate) as u64;
        let (period, held) = (100 * MS, 30 * MS);
        let mut sel = DeviceSelector::new(delivery(), &[gbps(10.0)], 1);
        let mut posted: std::collections::VecDeque<u64> = (0..depth).map(|_| 0).collect();
        for _ in 0..depth {
            sel.select_one(&[&[0]], SLICE).unwrap();
        }
        let (mut wire_free, mut last_answer, mut highest) = (0u64, 0u64, 0.0f64);
        while last_answer < 2_000 * MS {
            let p = posted.pop_front().unwrap();
            wire_free = wire_free.max(p) + ser;
            let mut answer = wire_free + 2 * US;
            let in_period = answer % period;
            if in_period < held {
                // Held back until the stall ends, then released right behind the others.
                answer = answer - in_period + held;
            }
            answer = answer.max(last_answer + US);
            last_answer = answer;
            sel.on_delivered(0, SLICE, p, answer, false).unwrap();
            if !bounded {
                sel.rails[0].log = DeliveryLog::new();
            }
            if answer > 300 * MS {
                highest = highest.max(ewma_gbps(&sel, 0));
            }
            sel.select_one(&[&[0]], SLICE).unwrap();
            posted.push_back(answer);
        }
        highest
    }

    #[test]
    fn answers_released_together_after_a_stall_do_not_inflate_the_estimate() {
        // A 400 Mbit/s rail with 2 MiB in flight (42 ms of queue).
        let highest = highest_estimate_with_answers_held_back(0.4, 16, true);
        assert!(
            highest <= 0.4 * 1.15,
            "estimate up to {highest} Gbit/s of a 0.4 Gbit/s rail"
        );
        // Timed by busy time alone, pools begun inside a burst read far above the rate: the
        // check has teeth.
        let ungated = highest_estimate_with_answers_held_back(0.4, 16, false);
        assert!(ungated > 0.4 * 1.5, "busy time alone read {ungated} Gbit/s");
    }

    #[test]
    fn the_max_filter_holds_through_a_dip_and_lets_it_go_after_the_window() {
        let c = SelectorConfig {
            min_sample_ns: 0,
            bandwidth_learning_rate: 0.0,
            ..delivery()
        };
        let mut sel = DeviceSelector::new(c, &[gbps(100.0)], 1);
        sel.on_completed(0, bytes_at(80.0, MS), 0, MS).unwrap();
        assert!(close(ewma_gbps(&sel, 0), 80.0));
        // Jitter: a slow millisecond inside the window does not lower it.
        sel.on_completed(0, bytes_at(50.0, MS), MS, 2 * MS).unwrap();
        assert!(close(ewma_gbps(&sel, 0), 80.0));
        // Past the window the best sample expired: the later ones rule.
        sel.on_completed(0, bytes_at(60.0, MS), 30 * MS, 31 * MS)
            .unwrap();
        assert!(close(ewma_gbps(&sel, 0), 60.0), "{}", ewma_gbps(&sel, 0));
        // With no window the latest sample is the estimate.
        let c = SelectorConfig {
            bandwidth_window_ns: 0,
            min_sample_ns: 0,
            bandwidth_learning_rate: 0.0,
            ..delivery()
        };
        let mut sel = DeviceSelector::new(c, &[gbps(100.0)], 1);
        sel.on_completed(0, bytes_at(80.0, MS), 0, MS).unwrap();
        sel.on_completed(0, bytes_at(50.0, MS), MS, 2 * MS).unwrap();
        assert!(close(ewma_gbps(&sel, 0), 50.0));
    }

    #[test]
    fn delivery_has_no_floor_tied_to_the_nominal_speed_but_keeps_the_ceiling() {
        let c = SelectorConfig {
            min_sample_ns: 0,
            bandwidth_learning_rate: 0.0,
            ..delivery()
        };
        let mut sel = DeviceSelector::new(c, &[gbps(100.0)], 1);
        // 1 byte in 1 s: at the absolute floor, far below 0.1 × 100 Gbps.
        sel.on_completed(0, 1, 0, 1_000_000_000).unwrap();
        assert!(close(
            ewma_gbps(&sel, 0),
            MIN_DELIVERY_BYTES_PER_SEC / BYTES_PER_S_PER_GBPS
        ));
        sel.on_completed(0, 1_000_000, 2_000_000_000, 2_000_000_001)
            .unwrap();
        assert!(close(ewma_gbps(&sel, 0), 1000.0), "{}", ewma_gbps(&sel, 0));
    }

    #[test]
    fn estimator_names_round_trip() {
        for e in [BandwidthEstimator::Delivery, BandwidthEstimator::Tent] {
            assert_eq!(BandwidthEstimator::from_name(e.name()), Some(e));
        }
        assert_eq!(BandwidthEstimator::from_name("bbr"), None);
        assert_eq!(BandwidthEstimator::default(), BandwidthEstimator::Delivery);
    }

    proptest! {
        /// Whatever the order and timing of samples, one marked app-limited never lowers the
        /// estimate, in either estimator, pooled or not.
        #[test]
        fn app_limited_samples_never_lower_the_estimate(
            tent in any::<bool>(),
            pooled in any::<bool>(),
            samples in prop::collection::vec(
                (1u64..(4 << 20), 0u64..3_000_000, 1u64..3_000_000, any::<bool>()),
                1..200,
            ),
        ) {
            let c = SelectorConfig {
                estimator: if tent { BandwidthEstimator::Tent } else { BandwidthEstimator::Delivery },
                min_sample_ns: if pooled { MS } else { 0 },
                ..SelectorConfig::default()
            };
            let mut sel = DeviceSelector::new(c, &[gbps(100.0)], 1);
            let mut now = 0u64;
            for (bytes, gap, dur, limited) in samples {
                now += gap;
                let before = ewma_gbps(&sel, 0);
                sel.select_one(&[&[0]], bytes).unwrap();
                sel.on_delivered(0, bytes, now, now + dur, limited).unwrap();
                let after = ewma_gbps(&sel, 0);
                if limited && !pooled {
                    prop_assert!(after >= before, "{} -> {}", before, after);
                }
                prop_assert!(after.is_finite() && after > 0.0);
                prop_assert!(after <= 1000.0 * (1.0 + 1e-12));
                now += dur;
            }
        }

        /// A saturated rail at any fraction of its nominal speed is reported within 15 % of
        /// what it carries, once a few windows have passed.
        #[test]
        fn a_saturated_rail_is_reported_within_15_percent_of_its_rate(
            nominal in 10.0f64..400.0,
            fraction in 0.01f64..1.0,
            slice_kib in 16u64..512,
        ) {
            let real = nominal * fraction;
            let mut sel = DeviceSelector::new(delivery(), &[gbps(nominal)], 1);
            let slice = slice_kib * KIB;
            // Long enough for a few dozen slices at the slowest rate.
            let ser_ns = slice as f64 / (real * BYTES_PER_S_PER_GBPS) * NS_PER_S;
            let until = (ser_ns as u64 * 64).max(100 * MS);
            saturate(&mut sel, slice, 8, real, (u64::MAX, real), 0, until, |_, _| {});
            let e = ewma_gbps(&sel, 0);
            prop_assert!((e - real).abs() <= 0.15 * real, "{} vs {}", e, real);
        }
    }

    // --- failure and statistics ----------------------------------------------------------

    #[test]
    fn failure_accounting() {
        let mut sel = DeviceSelector::new(cfg(), &[gbps(100.0), gbps(100.0)], 1);
        let mut out = vec![];
        sel.select(&[&[0]], SliceShape::uniform(3, S), &mut out)
            .unwrap();
        assert_eq!(inflight(&sel, 0), 3 * S);
        sel.on_failed(0, S).unwrap();
        sel.on_failed(0, S).unwrap();
        let s = sel.rail_stats(0).unwrap();
        assert_eq!(
            (
                s.inflight_bytes,
                s.errors,
                s.slices,
                s.total_bytes,
                s.ewma_gbps
            ),
            (S, 2, 0, 0, 100.0)
        );
        sel.on_unassigned(0, S).unwrap();
        let s = sel.rail_stats(0).unwrap();
        assert_eq!((s.inflight_bytes, s.errors, s.slices), (0, 2, 0));
        // Over-reporting saturates at zero.
        sel.on_failed(0, S).unwrap();
        assert_eq!(inflight(&sel, 0), 0);
        assert_eq!(sel.rail_stats(1).unwrap().errors, 0);
    }

    #[test]
    fn formatter_matches_the_seed() {
        let s = RailStats {
            total_bytes: 10_500_000_000,
            ewma_gbps: 45.23,
            inflight_bytes: 0,
            slices: 160_000,
            errors: 0,
            theoretical_gbps: 400.0,
        };
        let t = RailStats {
            total_bytes: 0,
            ewma_gbps: 400.0,
            inflight_bytes: 65536,
            ..s
        };
        assert_eq!(
            format_traffic_stats(&[s, t]),
            "=== Device Traffic Statistics ===\n\
             Dev 0: Total=10.5 GB, EWMA BW=45.23 Gbps, Inflight=0 bytes\n\
             Dev 1: Total=0.0 GB, EWMA BW=400.00 Gbps, Inflight=65536 bytes\n"
        );
        assert_eq!(
            format_traffic_stats(&[]),
            "=== Device Traffic Statistics ===\n"
        );
    }

    #[test]
    fn formatter_over_live_selector_stats() {
        let mut sel = DeviceSelector::new(learning(0.0), &[None, None], 1);
        // 45.23 Gbps = 5.65375 GB/s: 5 653 750 bytes in 1 ms.
        sel.on_completed(0, 5_653_750, 0, MS).unwrap();
        sel.select_one(&[&[1]], 4096).unwrap();
        let stats: Vec<RailStats> = sel.stats().collect();
        assert_eq!(
            format_traffic_stats(&stats),
            "=== Device Traffic Statistics ===\n\
             Dev 0: Total=0.0 GB, EWMA BW=45.23 Gbps, Inflight=0 bytes\n\
             Dev 1: Total=0.0 GB, EWMA BW=400.00 Gbps, Inflight=4096 bytes\n"
        );
    }

    #[test]
    fn odd_penalties_still_pick_a_candidate() {
        for p in [f64::NAN, f64::INFINITY, -1.0, 0.0] {
            let c = SelectorConfig {
                numa_penalties: vec![p],
                score_epsilon: 0.0,
                ..cfg()
            };
            let mut sel = DeviceSelector::new(c, &[None; 3], 1);
            let mut out = vec![];
            sel.select(&[&[0, 2]], SliceShape::uniform(7, S), &mut out)
                .unwrap();
            assert_eq!(out.len(), 7);
            assert!(out.iter().all(|r| [0, 2].contains(r)), "{p}: {out:?}");
            let r = sel.select_one(&[&[0, 2]], S).unwrap();
            assert!([0, 2].contains(&r));
        }
    }

    // --- properties ----------------------------------------------------------------------

    #[derive(Debug, Clone)]
    enum Op {
        Select {
            tiers: Vec<Vec<RailId>>,
            count: usize,
            bytes: u64,
            last: u64,
        },
        Finish {
            pick: usize,
            how: u8,
            dt: u64,
        },
    }

    fn op(rails: usize) -> impl Strategy<Value = Op> {
        prop_oneof![
            (
                prop::collection::vec(prop::collection::vec(0..rails, 0..4), 0..4),
                0usize..70,
                1u64..1 << 20,
                1u64..1 << 20,
            )
                .prop_map(|(tiers, count, bytes, last)| Op::Select {
                    tiers,
                    count,
                    bytes,
                    last
                }),
            (any::<usize>(), 0u8..3, 0u64..10_000).prop_map(|(pick, how, dt)| Op::Finish {
                pick,
                how,
                dt
            }),
        ]
    }

    proptest! {
        #[test]
        fn assignments_stay_within_candidates_and_inflight_balances(
            smart in any::<bool>(),
            seed in any::<u64>(),
            speeds in prop::collection::vec(prop::option::of(1.0f64..1000.0), 1..9),
            ops in prop::collection::vec(op(8), 1..300),
        ) {
            let rails = speeds.len();
            let c = SelectorConfig { enable_smart_scheduling: smart, ..cfg() };
            let mut sel = DeviceSelector::new(c, &speeds, seed);
            // Slices assigned and not yet reported: (rail, bytes, posted_at).
            let mut open: Vec<(RailId, u64, u64)> = vec![];
            let mut out = vec![];
            let mut now = 0u64;
            for op in ops {
                match op {
                    Op::Select { tiers, count, bytes, last } => {
                        let tiers: Vec<Vec<RailId>> = tiers
                            .into_iter()
                            .map(|t| t.into_iter().map(|r| r % rails).collect())
                            .collect();
                        let refs: Vec<&[RailId]> = tiers.iter().map(Vec::as_slice).collect();
                        let shape = SliceShape { count, slice_bytes: bytes, last_bytes: last };
                        let any = tiers.iter().any(|t| !t.is_empty());
                        let res = sel.select(&refs, shape, &mut out);
                        if !any && count > 0 {
                            prop_assert_eq!(res, Err(SelectError::NoCandidates));
                            prop_assert!(out.is_empty());
                            continue;
                        }
                        prop_assert_eq!(res, Ok(()));
                        prop_assert_eq!(out.len(), count);
                        for (i, &r) in out.iter().enumerate() {
                            prop_assert!(tiers.iter().flatten().any(|&c| c == r));
                            if !smart {
                                let first = tiers.iter().find(|t| !t.is_empty()).unwrap();
                                prop_assert!(first.contains(&r));
                            }
                            open.push((r, shape.bytes_of(i), now));
                        }
                    }
                    Op::Finish { pick, how, dt } => {
                        now += dt;
                        if open.is_empty() {
                            continue;
                        }
                        let (r, b, posted) = open.swap_remove(pick % open.len());
                        match how {
                            0 => sel.on_completed(r, b, posted, now).unwrap(),
                            1 => sel.on_failed(r, b).unwrap(),
                            _ => sel.on_unassigned(r, b).unwrap(),
                        }
                    }
                }
                for r in 0..rails {
                    let want: u64 = open.iter().filter(|o| o.0 == r).map(|o| o.1).sum();
                    prop_assert_eq!(inflight(&sel, r), want);
                    let s = sel.rail_stats(r).unwrap();
                    let theo = s.theoretical_gbps;
                    prop_assert!(s.ewma_gbps >= 0.1 * theo * (1.0 - 1e-12));
                    prop_assert!(s.ewma_gbps <= 10.0 * theo * (1.0 + 1e-12));
                }
            }
        }

        #[test]
        fn proportional_counts_sum_to_n_and_follow_weights(
            seed in any::<u64>(),
            speeds in prop::collection::vec(prop::option::of(10.0f64..800.0), 1..9),
            n in 2usize..200,
        ) {
            let rails = speeds.len();
            let mut sel = DeviceSelector::new(cfg(), &speeds, seed);
            let all: Vec<RailId> = (0..rails).collect();
            let mut out = vec![];
            sel.select(&[&all], SliceShape::uniform(n, S), &mut out).unwrap();
            prop_assert_eq!(out.len(), n);
            // With no load, each rail gets at least floor(n × its bandwidth share) slices,
            // give or take one for jitter and rounding.
            let total: f64 = sel.stats().map(|s| s.theoretical_gbps).sum();
            let c = counts(&out, rails);
            for (r, s) in sel.stats().enumerate() {
                let share = (n as f64 * s.theoretical_gbps / total).floor() as usize;
                prop_assert!(c[r] + 1 >= share, "rail {} got {} of share {}", r, c[r], share);
            }
        }
    }
}
