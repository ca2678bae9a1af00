//! Capped exponential back-off with jitter, for retrying a service that stopped answering
//! (a metadata store, a peer's control port).
//!
//! The nominal delay doubles with every failure in a row, from `base` up to `cap`; the delay
//! actually taken is drawn uniformly from the upper half of the nominal one ("equal jitter",
//! as AWS's architecture note on back-off calls it), so a crowd of engines that lost the same
//! store at the same moment spreads its retries instead of arriving together, while no delay
//! ever exceeds `cap`. A success resets the sequence. The caller supplies the randomness, so
//! tests and the simulator replay it.

use std::time::Duration;

use rand::Rng;

/// Retry delays for one service: feed it failures and successes, ask it how long to wait.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    /// Failures since the last success.
    failures: u32,
}

impl Backoff {
    /// A back-off whose first delay is about `base` and whose delays never exceed `cap`.
    /// `base` is raised to at least 1 ms and `cap` to at least `base`, so every delay is
    /// positive and the sequence is never empty.
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        let base = base.max(Duration::from_millis(1));
        Backoff {
            base,
            cap: cap.max(base),
            failures: 0,
        }
    }

    /// Records a failure and returns how long to wait before the next attempt: a delay in
    /// `[nominal / 2, nominal]`, where the nominal delay is `base · 2^(failures − 1)`, capped.
    pub fn on_failure(&mut self, rng: &mut impl Rng) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let nominal = self.nominal();
        let half = nominal / 2;
        let spread = (nominal - half).as_nanos() as u64;
        half + Duration::from_nanos(rng.gen_range(0..=spread))
    }

    /// Records a success: the next failure starts again from `base`.
    pub fn on_success(&mut self) {
        self.failures = 0;
    }

    /// Failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The longest delay this back-off ever returns.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// The nominal delay after the failures so far (before jitter).
    fn nominal(&self) -> Duration {
        let doublings = self.failures.saturating_sub(1).min(32);
        self.base
            .checked_mul(1u32 << doublings.min(31))
            .map_or(self.cap, |d| d.min(self.cap))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn doubles_up_to_the_cap_and_restarts_after_a_success() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut rng = SmallRng::seed_from_u64(1);
        let nominal = [100, 200, 400, 800, 1000, 1000];
        for n in nominal {
            let d = b.on_failure(&mut rng);
            let n = Duration::from_millis(n);
            assert!(
                d >= n / 2 && d <= n,
                "{d:?} not within [{:?}, {n:?}]",
                n / 2
            );
        }
        assert_eq!(b.failures(), 6);
        b.on_success();
        assert_eq!(b.failures(), 0);
        assert!(b.on_failure(&mut rng) <= Duration::from_millis(100));
    }

    #[test]
    fn jitter_spreads_a_crowd() {
        // Engines that lost the store together do not all come back at the same instant.
        let mut delays: Vec<Duration> = (0..64)
            .map(|seed| {
                let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
                let mut rng = SmallRng::seed_from_u64(seed);
                (0..4).map(|_| b.on_failure(&mut rng)).last().unwrap()
            })
            .collect();
        delays.sort();
        delays.dedup();
        assert!(delays.len() > 32, "only {} distinct delays", delays.len());
    }

    proptest! {
        #[test]
        fn never_above_the_cap_nor_zero(
            base_ms in 0u64..10_000,
            cap_ms in 0u64..100_000,
            failures in 1usize..200,
            seed in any::<u64>(),
        ) {
            let mut b = Backoff::new(Duration::from_millis(base_ms), Duration::from_millis(cap_ms));
            let mut rng = SmallRng::seed_from_u64(seed);
            for _ in 0..failures {
                let d = b.on_failure(&mut rng);
                prop_assert!(d <= b.cap());
                prop_assert!(d > Duration::ZERO);
            }
        }
    }
}
