//! Rail health: a rail that fails repeatedly is paused, then probed, then rejoins.
//!
//! Rules: `error_threshold` errors within `error_window` pause the rail for the current pause
//! length (initially `initial_pause`). When the pause ends the rail wants a probe; a successful
//! probe brings it back, a failed one pauses it again for twice as long, up to `max_pause`. The
//! pause length only falls back to `initial_pause` once the rail has stayed up for `max_pause`,
//! so a flapping rail does not get a short pause every time it returns.
//!
//! Time is nanoseconds on any monotonic clock the caller chooses.

use std::collections::VecDeque;

const SECOND: u64 = 1_000_000_000;

/// Thresholds and pause lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Errors within `error_window_ns` that pause a rail (3).
    pub error_threshold: u32,
    /// Window in which errors count together (10 s).
    pub error_window_ns: u64,
    /// First pause (30 s).
    pub initial_pause_ns: u64,
    /// Longest pause (300 s).
    pub max_pause_ns: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            error_threshold: 3,
            error_window_ns: 10 * SECOND,
            initial_pause_ns: 30 * SECOND,
            max_pause_ns: 300 * SECOND,
        }
    }
}

/// Where a rail stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RailState {
    /// Carries slices.
    Up,
    /// Carries nothing until `until_ns`, then wants a probe.
    Paused {
        /// End of the pause.
        until_ns: u64,
    },
    /// The pause is over and a probe is out; carries nothing until it reports.
    Probing,
}

/// Health of one rail.
#[derive(Debug, Clone)]
pub struct RailHealth {
    config: HealthConfig,
    recent_errors: VecDeque<u64>,
    state: RailState,
    pause_ns: u64,
    up_since_ns: u64,
}

impl RailHealth {
    /// A healthy rail.
    pub fn new(config: HealthConfig) -> Self {
        RailHealth {
            config,
            recent_errors: VecDeque::with_capacity(config.error_threshold as usize),
            state: RailState::Up,
            pause_ns: config.initial_pause_ns,
            up_since_ns: 0,
        }
    }

    /// Current state.
    pub fn state(&self) -> RailState {
        self.state
    }

    /// True when the rail may carry slices.
    pub fn is_up(&self) -> bool {
        self.state == RailState::Up
    }

    /// Records a failed slice or connection. Returns true when this error paused the rail.
    pub fn on_error(&mut self, now_ns: u64) -> bool {
        if self.state != RailState::Up {
            return false;
        }
        let horizon = now_ns.saturating_sub(self.config.error_window_ns);
        while self.recent_errors.front().is_some_and(|&t| t < horizon) {
            self.recent_errors.pop_front();
        }
        self.recent_errors.push_back(now_ns);
        if self.recent_errors.len() < self.config.error_threshold.max(1) as usize {
            return false;
        }
        if now_ns.saturating_sub(self.up_since_ns) >= self.config.max_pause_ns {
            self.pause_ns = self.config.initial_pause_ns;
        }
        self.pause(now_ns);
        true
    }

    fn pause(&mut self, now_ns: u64) {
        self.recent_errors.clear();
        self.state = RailState::Paused {
            until_ns: now_ns.saturating_add(self.pause_ns),
        };
        self.pause_ns = (self.pause_ns.saturating_mul(2)).min(self.config.max_pause_ns);
    }

    /// When the caller should next call [`RailHealth::poll_probe`]: the end of the pause.
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.state {
            RailState::Paused { until_ns } => Some(until_ns),
            _ => None,
        }
    }

    /// True once, when the pause is over: the caller should probe the rail and report with
    /// [`RailHealth::on_probe`].
    pub fn poll_probe(&mut self, now_ns: u64) -> bool {
        match self.state {
            RailState::Paused { until_ns } if now_ns >= until_ns => {
                self.state = RailState::Probing;
                true
            }
            _ => false,
        }
    }

    /// The rail's link came back up after it was seen down: what paused the rail may be gone,
    /// so a pause ends now and the rail wants its probe at once (the probe still decides; a
    /// failed one pauses it for longer, as after any pause). Returns true when this ended a
    /// pause early.
    pub fn on_link_up(&mut self, now_ns: u64) -> bool {
        match self.state {
            RailState::Paused { until_ns } if until_ns > now_ns => {
                self.state = RailState::Paused { until_ns: now_ns };
                true
            }
            _ => false,
        }
    }

    /// Result of a probe: success brings the rail back, failure pauses it for longer.
    pub fn on_probe(&mut self, now_ns: u64, ok: bool) {
        if self.state != RailState::Probing {
            return;
        }
        if ok {
            self.state = RailState::Up;
            self.up_since_ns = now_ns;
        } else {
            self.pause(now_ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = SECOND;

    #[test]
    fn three_errors_within_ten_seconds_pause() {
        let mut h = RailHealth::new(HealthConfig::default());
        assert!(!h.on_error(0));
        assert!(!h.on_error(4 * S));
        assert!(h.on_error(9 * S));
        assert_eq!(h.state(), RailState::Paused { until_ns: 39 * S });
        assert!(!h.is_up());
    }

    #[test]
    fn errors_spread_out_do_not_pause() {
        let mut h = RailHealth::new(HealthConfig::default());
        for i in 0..10 {
            assert!(!h.on_error(i * 6 * S), "error {i}");
        }
        assert!(h.is_up());
    }

    #[test]
    fn probe_after_pause_and_doubling_to_the_cap() {
        let mut h = RailHealth::new(HealthConfig::default());
        for t in [0, 1, 2] {
            h.on_error(t * S);
        }
        assert!(!h.poll_probe(31 * S));
        assert_eq!(h.poll_timeout(), Some(32 * S));
        assert!(h.poll_probe(32 * S));
        assert!(!h.poll_probe(33 * S), "one probe at a time");
        let mut now = 32 * S;
        let mut pauses = vec![];
        for _ in 0..6 {
            h.on_probe(now, false);
            let RailState::Paused { until_ns } = h.state() else {
                panic!()
            };
            pauses.push((until_ns - now) / S);
            now = until_ns;
            assert!(h.poll_probe(now));
        }
        assert_eq!(pauses, vec![60, 120, 240, 300, 300, 300]);
        h.on_probe(now, true);
        assert!(h.is_up());
    }

    #[test]
    fn a_link_coming_back_ends_the_pause_and_the_probe_still_decides() {
        let mut h = RailHealth::new(HealthConfig::default());
        assert!(!h.on_link_up(0), "nothing to end on a rail that is up");
        for t in [0, 1, 2] {
            h.on_error(t * S);
        }
        assert!(!h.poll_probe(5 * S));
        assert!(h.on_link_up(5 * S));
        assert_eq!(h.poll_timeout(), Some(5 * S));
        assert!(h.poll_probe(5 * S));
        assert!(!h.on_link_up(6 * S), "a probe is out: nothing to end");
        // The link came up, but the rail still fails: the next pause is twice as long.
        h.on_probe(6 * S, false);
        assert_eq!(h.state(), RailState::Paused { until_ns: 66 * S });
        assert!(h.on_link_up(7 * S));
        assert!(h.poll_probe(7 * S));
        h.on_probe(7 * S, true);
        assert!(h.is_up());
    }

    #[test]
    fn flapping_rail_keeps_its_longer_pause_until_it_stays_up() {
        let mut h = RailHealth::new(HealthConfig::default());
        for t in [0, 1, 2] {
            h.on_error(t * S);
        }
        assert!(h.poll_probe(32 * S));
        h.on_probe(32 * S, true);
        for t in [33, 34, 35] {
            h.on_error(t * S);
        }
        assert_eq!(
            h.state(),
            RailState::Paused { until_ns: 95 * S },
            "second pause is 60 s"
        );
        assert!(h.poll_probe(95 * S));
        h.on_probe(95 * S, true);
        let later = 95 * S + 300 * S;
        for t in 0..3 {
            h.on_error(later + t * S);
        }
        assert_eq!(
            h.state(),
            RailState::Paused {
                until_ns: later + 2 * S + 30 * S
            },
            "reset after 300 s up"
        );
    }
}
