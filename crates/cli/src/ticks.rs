//! A round-trip clock cheaper than `Instant::now` (a vDSO call of 20-30 ns, half of it inside
//! the interval it measures, which is significant against a 400 ns round trip). On x86_64 with
//! an invariant TSC (the `constant_tsc` and `nonstop_tsc` CPU flags) it reads the time stamp
//! counter, as UCX's perftest does, and converts ticks to nanoseconds with a rate measured
//! against `Instant` over the whole run; elsewhere it falls back to `Instant`.

use std::time::Instant;

/// Reads ticks and converts them to nanoseconds once the run is over.
pub(crate) struct Ticks {
    tsc: bool,
    start: Instant,
    start_ticks: u64,
}

impl Ticks {
    /// Starts the calibration interval.
    pub(crate) fn start() -> Ticks {
        let tsc = invariant_tsc();
        let mut t = Ticks {
            tsc,
            start: Instant::now(),
            start_ticks: 0,
        };
        t.start_ticks = t.now();
        t
    }

    /// The current tick: TSC cycles, or nanoseconds since `start` without a usable TSC.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if self.tsc {
            // SAFETY: RDTSC exists on every x86_64 CPU and only reads the counter.
            return unsafe { core::arch::x86_64::_rdtsc() };
        }
        self.start.elapsed().as_nanos() as u64
    }

    /// Nanoseconds per tick over the run so far; call after the measured loop.
    pub(crate) fn ns_per_tick(&self) -> f64 {
        if !self.tsc {
            return 1.0;
        }
        let ticks = self.now().saturating_sub(self.start_ticks);
        let ns = self.start.elapsed().as_nanos() as f64;
        if ticks == 0 {
            1.0
        } else {
            ns / ticks as f64
        }
    }
}

/// Whether the CPU's time stamp counter ticks at a constant rate through frequency changes and
/// idle states, so ticks measure time.
fn invariant_tsc() -> bool {
    if !cfg!(target_arch = "x86_64") {
        return false;
    }
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return false;
    };
    let flags = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or_default();
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    has("constant_tsc") && has("nonstop_tsc")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn ticks_convert_to_the_time_that_passed() {
        let t = Ticks::start();
        let a = t.now();
        std::thread::sleep(Duration::from_millis(50));
        let b = t.now();
        let ns = (b - a) as f64 * t.ns_per_tick();
        assert!((45e6..500e6).contains(&ns), "{ns} ns for a 50 ms sleep");
    }
}
