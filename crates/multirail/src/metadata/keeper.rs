//! Keeping what an engine published alive in its store, whatever the store went through.
//!
//! A store that keeps descriptors can be unreachable when the engine starts, restart without
//! its data, or (etcd) let the engine's lease expire while it was away. Each such store runs a
//! keeper beside its callers: a pass every third of the lease (`metadata.lease_ttl_s`) renews
//! what was published, and a pass that fails is retried with capped exponential back-off and
//! jitter ([`multirail_policy::backoff`]) until the store answers, when everything is
//! published again. So a store that comes back is healed within one lease plus one back-off
//! step, for every engine, without anyone calling the engine.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use multirail_policy::backoff::Backoff;
use rand::rngs::SmallRng;
use rand::SeedableRng;

/// The first retry after a failed pass comes this soon (jittered down to half of it).
const RETRY_BASE: Duration = Duration::from_millis(100);
/// No retry waits longer than this, nor longer than the refresh period.
const RETRY_CAP: Duration = Duration::from_secs(5);

/// How often a keeper renews what was published when `metadata.lease_ttl_s` is `lease_ttl_s`:
/// a third of it (at least 100 ms), so two renewals can fail before the lease runs out.
pub(crate) fn refresh_period(lease_ttl_s: u64) -> Duration {
    Duration::from_millis(lease_ttl_s.saturating_mul(1000) / 3).max(Duration::from_millis(100))
}

/// When a keeper's next pass is due: the refresh period after a pass that worked, a back-off
/// delay (never above the period) after one that failed.
pub(crate) struct Schedule {
    every: Duration,
    backoff: Backoff,
    rng: SmallRng,
}

impl Schedule {
    /// A schedule renewing every `every`.
    pub(crate) fn new(every: Duration) -> Schedule {
        Schedule {
            every,
            backoff: Backoff::new(RETRY_BASE, every.min(RETRY_CAP)),
            rng: SmallRng::from_entropy(),
        }
    }

    /// Records a pass's outcome; returns how long to wait before the next one.
    pub(crate) fn after(&mut self, worked: bool) -> Duration {
        if worked {
            self.backoff.on_success();
            self.every
        } else {
            self.backoff.on_failure(&mut self.rng)
        }
    }
}

/// A thread that runs a keeper's passes until it is dropped.
pub(crate) struct KeeperThread {
    stop: Arc<(Mutex<bool>, Condvar)>,
    handle: Option<JoinHandle<()>>,
}

impl KeeperThread {
    /// Starts thread `name` running `pass` (which returns whether it worked) on `schedule`,
    /// the first pass after `first_delay`. Fails only when the thread cannot be started.
    pub(crate) fn spawn(
        name: &str,
        mut schedule: Schedule,
        first_delay: Duration,
        mut pass: impl FnMut() -> bool + Send + 'static,
    ) -> std::io::Result<KeeperThread> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let mut delay = first_delay;
                loop {
                    let (lock, wake) = &*flag;
                    let stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let (stopped, _) = wake
                        .wait_timeout_while(stopped, delay, |s| !*s)
                        .unwrap_or_else(|e| e.into_inner());
                    if *stopped {
                        return;
                    }
                    drop(stopped);
                    delay = schedule.after(pass());
                }
            })?;
        Ok(KeeperThread {
            stop,
            handle: Some(handle),
        })
    }
}

impl Drop for KeeperThread {
    /// Stops the thread and waits for it: at most the pass in progress, which each store
    /// bounds by its request timeout.
    fn drop(&mut self) {
        let (lock, wake) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        wake.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    #[test]
    fn refresh_period_is_a_third_of_the_lease() {
        assert_eq!(refresh_period(3), Duration::from_secs(1));
        assert_eq!(refresh_period(10), Duration::from_millis(3333));
        assert_eq!(refresh_period(0), Duration::from_millis(100));
        assert_eq!(
            refresh_period(u64::MAX),
            Duration::from_millis(u64::MAX / 3)
        );
    }

    #[test]
    fn failed_passes_back_off_below_the_period_and_a_success_restores_it() {
        let every = Duration::from_millis(800);
        let mut s = Schedule::new(every);
        let delays: Vec<Duration> = (0..10).map(|_| s.after(false)).collect();
        assert!(delays.iter().all(|d| *d <= every), "{delays:?}");
        assert!(delays[0] <= RETRY_BASE);
        assert_eq!(s.after(true), every);
    }

    #[test]
    fn the_thread_retries_until_a_pass_works_and_stops_when_dropped() {
        let passes = Arc::new(AtomicUsize::new(0));
        let counted = passes.clone();
        let t0 = Instant::now();
        let keeper = KeeperThread::spawn(
            "test-keeper",
            Schedule::new(Duration::from_secs(60)),
            Duration::ZERO,
            move || counted.fetch_add(1, Ordering::SeqCst) >= 3,
        )
        .unwrap();
        while passes.load(Ordering::SeqCst) < 4 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the keeper stopped retrying"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // The fourth pass worked: the next is a minute away, and dropping does not wait for it.
        let t1 = Instant::now();
        drop(keeper);
        assert!(t1.elapsed() < Duration::from_secs(1));
        assert_eq!(passes.load(Ordering::SeqCst), 4);
    }
}
