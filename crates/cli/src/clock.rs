//! The host-wide clock the benchmarks stamp messages with, so one process can measure the
//! latency of what another sent.

use std::thread;
use std::time::Duration;

/// Nanoseconds of `CLOCK_MONOTONIC`: the same clock in every process of this host.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only into `ts`, a valid timespec on this stack.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps until [`mono_ns`] reaches `t` (returns at once when it has).
pub fn sleep_until_ns(t: u64) {
    let now = mono_ns();
    if t > now {
        thread::sleep(Duration::from_nanos(t - now));
    }
}
