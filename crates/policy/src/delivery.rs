//! What a rail delivered and when, so a delivery-rate sample is timed as BBR times it
//! (`tcp_rate.c`): from the last delivery before the sample's slice was posted, over every byte
//! delivered since, and not from the first completion the sample happened to pool.
//!
//! Why: answers do not come back at the rate the rail delivered their bytes. A target that
//! answers a stream of slices in one write, a thread that stalls for tens of milliseconds, a
//! host that runs the reader late: each releases many answers at once. A sample that begins
//! inside such a burst holds megabytes over a millisecond, reads gigabits per second on a rail
//! policed to hundreds of megabits, and a max filter keeps it. Seen on eight policed rails with
//! ten milliseconds of queue allowed: a 400 Mbit/s rail estimated at 11.5 Gbit/s, its window
//! grown to 20 MB, its slices answered 100 ms after they were posted. Timed from the delivery
//! before its slice's post, the same sample spans the stall that held the burst back, and
//! reads what the rail carried over it.

use std::collections::VecDeque;

/// Deliveries a log remembers. A slice posted before the oldest of them (behind this many
/// completions on its rail) gets no bound from the log; at 128 KiB slices that is 128 MiB
/// in flight ahead of it.
pub const DELIVERY_LOG_LEN: usize = 1024;

/// One delivery: when it completed, the rail's delivered total with it, and whether the rail
/// had nothing left in flight after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Delivery {
    at_ns: u64,
    delivered: u64,
    idle_after: bool,
}

/// The recent deliveries of one rail, in completion order.
#[derive(Debug, Clone, Default)]
pub struct DeliveryLog {
    entries: VecDeque<Delivery>,
    delivered: u64,
}

impl DeliveryLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes delivered so far.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    /// Records a delivery of `bytes` completed at `at_ns`; `idle_after` when nothing was left
    /// in flight on the rail after it. Completions reaped by several threads may report their
    /// times out of order: a time before the latest recorded counts as the latest, so the log
    /// stays ordered (and a rate from it can only read lower).
    pub fn record(&mut self, at_ns: u64, bytes: u64, idle_after: bool) {
        let at_ns = self.entries.back().map_or(at_ns, |l| l.at_ns.max(at_ns));
        self.delivered = self.delivered.saturating_add(bytes);
        if self.entries.len() == DELIVERY_LOG_LEN {
            self.entries.pop_front();
        }
        self.entries.push_back(Delivery {
            at_ns,
            delivered: self.delivered,
            idle_after,
        });
    }

    /// Bytes per second the rail delivered from the last delivery at or before `posted_at_ns`
    /// to `now_ns`, counting every delivery recorded since, the latest included: BBR's
    /// delivery-rate sample for a slice posted at `posted_at_ns` and answered at `now_ns`.
    /// `None` when the rail had nothing in flight after that delivery (or the log holds none
    /// that early), or the interval is empty: a slice posted on an idle rail is answered after
    /// a whole round trip with only its own busy period's bytes delivered, which says how much
    /// the sender gave, not how fast the rail carries (BBR calls such samples app-limited).
    pub fn rate_since_post(&self, posted_at_ns: u64, now_ns: u64) -> Option<f64> {
        let i = self.entries.partition_point(|d| d.at_ns <= posted_at_ns);
        let d = self.entries.get(i.checked_sub(1)?)?;
        if d.idle_after {
            return None;
        }
        let span = now_ns.checked_sub(d.at_ns).filter(|&s| s > 0)?;
        Some(self.delivered.saturating_sub(d.delivered) as f64 * 1e9 / span as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_busy_rail_reads_its_rate_from_the_delivery_before_the_post() {
        // 1 MB every millisecond; a slice posted just after the delivery at 5 ms and answered
        // at 9 ms: four deliveries since, over 4 ms.
        let mut log = DeliveryLog::new();
        for k in 1..=9 {
            log.record(k * MS, 1_000_000, false);
        }
        let r = log.rate_since_post(5 * MS + 10, 9 * MS).unwrap();
        assert!((r - 1e9).abs() < 1.0, "{r}");
        assert_eq!(log.delivered(), 9_000_000);
    }

    #[test]
    fn answers_held_back_and_released_at_once_read_the_rate_over_the_stall() {
        // A rail carrying 1 MB/ms whose answers stopped at 10 ms and came back together at
        // 50 ms: forty megabytes answered within 40 µs. The slice posted at 10 ms, answered
        // last, reads 40 MB over the 40 ms of the stall, not over the 40 µs of the burst.
        let mut log = DeliveryLog::new();
        for k in 1..=10 {
            log.record(k * MS, 1_000_000, false);
        }
        for k in 0..40 {
            log.record(50 * MS + k * 1_000, 1_000_000, false);
        }
        let end = 50 * MS + 39_000;
        let r = log.rate_since_post(10 * MS, end).unwrap();
        assert!(r <= 1e9 * 1.01, "read {r} bytes/s");
        assert!(r >= 0.95e9, "read {r} bytes/s");
        // Pooled from the burst's own first answer, the same bytes read a thousand times more:
        // the check has teeth.
        let burst = 39e6 * 1e9 / 39_000.0;
        assert!(burst > 500.0 * r);
    }

    #[test]
    fn a_post_on_an_idle_rail_or_before_the_log_gives_no_rate() {
        // The rail went idle at 1 ms; a slice posted at 8 ms was answered at 9 ms.
        let mut log = DeliveryLog::new();
        log.record(MS, 500_000, true);
        log.record(9 * MS, 1_000_000, true);
        assert_eq!(log.rate_since_post(8 * MS, 9 * MS), None);
        // Posted before any delivery the log holds: the first post of all, or one behind more
        // deliveries than it keeps.
        assert_eq!(log.rate_since_post(MS / 2, 9 * MS), None);
        let mut long = DeliveryLog::new();
        for k in 0..(DELIVERY_LOG_LEN as u64 + 5) {
            long.record(MS + k * 1_000, 4096, false);
        }
        assert_eq!(long.rate_since_post(MS + 2_000, 10 * MS), None);
        assert!(long.rate_since_post(MS + 100 * 1_000, 10 * MS).is_some());
        // An empty interval.
        let mut one = DeliveryLog::new();
        one.record(MS, 4096, false);
        assert_eq!(one.rate_since_post(MS, MS), None);
    }

    #[test]
    fn times_out_of_order_keep_the_log_ordered() {
        let mut log = DeliveryLog::new();
        log.record(5 * MS, 1_000_000, false);
        // Reaped by another thread that read its clock earlier.
        log.record(4 * MS, 1_000_000, false);
        log.record(7 * MS, 1_000_000, false);
        // Posted at 6 ms: behind both deliveries "at 5 ms" (the late report counts as the
        // latest), so only the one at 7 ms came since, over 2 ms.
        let r = log.rate_since_post(6 * MS, 7 * MS).unwrap();
        assert!((r - 0.5e9).abs() < 1.0, "{r}");
        // Posted at 4.5 ms: the late report is not taken as a delivery before it.
        assert_eq!(log.rate_since_post(4 * MS + MS / 2, 7 * MS), None);
    }
}
