//! Which paths with room may take the next slice in smart mode: the *finish horizon*.
//!
//! A window with room says a path can take more; it does not say the path is the right one. At
//! the end of a batch, when the fast rails' windows are full and a slow rail's is empty, a
//! slice dealt to the slow rail finishes after the fast rails would have finished it *and*
//! everything still queued: the batch waits for its slowest slice. On four policed rails of
//! 150 to 600 Mbit/s, batches of 16 × 64 KiB moved 0.69 of the rails' sum that way, the
//! 150 Mbit/s rail carrying 14 % of the bytes against its 10 % share.
//!
//! The rule, from the earliest-finish scheduling of heterogeneous links: a path with room takes
//! a slice only if it would finish it (its bytes in flight plus the slice, at its estimated
//! bandwidth) no later than the *horizon*, the time every path together would need to drain
//! what they hold and what is queued here. The path that would finish soonest always
//! qualifies, so work never waits for nothing. With a long queue (several batches in flight, a
//! stream) the horizon is far and every path takes work, as before; only the tail is kept off
//! the slow rails.

/// What one path holds and how fast it drains, as the dispatcher sees it when it deals.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PathLoad {
    /// The rail's estimated bandwidth, bytes/s; 0 when unknown (the path is then not judged).
    pub bytes_per_sec: f64,
    /// Bytes posted on the path and not yet answered.
    pub posted: u64,
    /// Bytes of the slice it would take.
    pub slice: u64,
    /// Bytes its window lets the priority being dealt hold there.
    pub allowed: u64,
    /// Bytes the path may hold whatever its finish, as a probe; 0 when it is not probing. A
    /// path probes when it was idle long (see `Dispatcher::probe_after`) and for
    /// [`PROBE_SPAN_NS`] after the slice that ended that idle time, so an estimate that fell
    /// while it was kept off (a stall, a rail that failed and came back) is measured again
    /// instead of keeping it off for good. A span, not one slice: the estimator pools
    /// completions until they hold a millisecond of busy time, and a fast rail answers many
    /// slices within the span. But at most a span's worth of its estimate at once (and at
    /// least one slice): on a rail as slow as estimated, one slice is already a sample.
    pub probe_bytes: u64,
}

impl PathLoad {
    /// Whether its window has room for another slice.
    pub fn has_room(&self) -> bool {
        self.posted < self.allowed
    }

    /// Seconds until the path would finish one more slice on top of `posted` bytes, `None`
    /// when its bandwidth is unknown.
    pub fn finish_s(&self, posted: u64) -> Option<f64> {
        (self.bytes_per_sec > 0.0).then(|| (posted + self.slice) as f64 / self.bytes_per_sec)
    }

    /// Whether the path should take one more slice on top of `posted` bytes by `horizon`: it
    /// would finish it by then, or its bandwidth is unknown, or it is a probe.
    pub fn on_time(&self, posted: u64, horizon: f64) -> bool {
        posted < self.probe_bytes || self.finish_s(posted).is_none_or(|f| f <= horizon)
    }

    /// Whether the path takes one more slice on top of `posted` bytes only as a probe: it
    /// would not finish it by `horizon`.
    pub fn probe_only(&self, posted: u64, horizon: f64) -> bool {
        posted < self.probe_bytes && self.finish_s(posted).is_some_and(|f| f > horizon)
    }
}

/// Idle time after which a path kept off by the horizon takes a slice anyway, ns: often enough
/// that a recovered rail is seen within a fraction of a second, rarely enough that the slices
/// it costs at the tail of batches are few.
pub(crate) const PROBE_AFTER_NS: u64 = 50_000_000;

/// Slice times a path must have been idle before a probe, where that is longer than
/// [`PROBE_AFTER_NS`]: a probe holds back what waits for it by about one slice's time on the
/// path, so it then costs at most a twentieth of the time.
pub(crate) const PROBE_COST: f64 = 20.0;

/// How long a probe lasts once it took its first slice, ns: a few of the estimator's pooled
/// samples (a millisecond of busy time each), so the estimate can climb back in one probe.
pub(crate) const PROBE_SPAN_NS: u64 = 5_000_000;

/// Queued slices the horizon reads at most: past that much the queue is long enough for every
/// path (the horizon is then unbounded), and a deal must stay cheap.
pub(crate) const MAX_SCAN: usize = 4096;

/// The horizon in seconds for the paths in `loads` (usable ones that admit the priority being
/// dealt), given the lengths of the slices queued at that priority, head first: a path takes
/// the next slice when [`PathLoad::on_time`] holds with what it has posted by then.
/// `f64::INFINITY` when every path qualifies whatever it takes within its window (no bandwidth
/// known, no path could finish later than the soonest, or the queue holds enough to keep every
/// path busy past the latest finish its window allows).
pub(crate) fn horizon<'a>(
    loads: impl IntoIterator<Item = &'a PathLoad>,
    queued: impl IntoIterator<Item = u64>,
) -> f64 {
    let mut soonest = f64::INFINITY;
    let mut latest = 0.0f64;
    let mut rate = 0.0;
    let mut posted = 0.0;
    let mut judged = 0;
    for load in loads {
        let Some(finish) = load.finish_s(load.posted) else {
            continue;
        };
        soonest = soonest.min(finish);
        if load.has_room() {
            // The last slice its window lets it take in this deal starts below `allowed`.
            let fullest = (load.allowed + load.slice) as f64 / load.bytes_per_sec;
            latest = latest.max(fullest);
        }
        rate += load.bytes_per_sec;
        posted += load.posted as f64;
        judged += 1;
    }
    // One path has no other to leave the tail to (and a deal on loopback stays cheap).
    if judged < 2 || latest <= soonest {
        return f64::INFINITY;
    }
    // Queued bytes past which even the latest finish comes before the rest drains.
    let enough = latest * rate - posted;
    let mut queued_bytes = 0.0;
    for (i, bytes) in queued.into_iter().enumerate() {
        queued_bytes += bytes as f64;
        if queued_bytes >= enough || i + 1 >= MAX_SCAN {
            return f64::INFINITY;
        }
    }
    soonest.max((queued_bytes + posted) / rate)
}

/// Slices are cut into pieces only on paths where a whole slice takes at least this long on
/// the wire, s: there a piece's answer comes hundreds of microseconds sooner. On a fast or
/// CPU-bound link (several rails over loopback: 64 KiB in about 20 µs) pieces would only be
/// more slices to copy and answer.
pub(crate) const PIECE_MIN_SLICE_S: f64 = 500e-6;

/// The piece of a slice of `len` bytes that a path with room but past the horizon for the
/// whole slice can still finish by `horizon`: its bytes are done with the rest of the batch
/// instead of waiting for a faster path. Whole pages, at least `min_piece` and less than
/// `len`; `None` when no such piece exists (or the horizon is unbounded, the path full, its
/// bandwidth unknown, or a whole slice takes it less than [`PIECE_MIN_SLICE_S`]).
pub(crate) fn tail_piece(load: &PathLoad, horizon: f64, len: u64, min_piece: u64) -> Option<u64> {
    if !load.has_room()
        || load.bytes_per_sec <= 0.0
        || (len as f64) < PIECE_MIN_SLICE_S * load.bytes_per_sec
        || !horizon.is_finite()
    {
        return None;
    }
    let fits = horizon * load.bytes_per_sec - load.posted as f64;
    if fits < min_piece as f64 {
        return None;
    }
    let piece = (fits.min(len as f64) as u64) & !(super::PAGE - 1);
    (piece >= min_piece && piece < len).then_some(piece)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: f64 = 1e6;
    const SLICE: u64 = 64 << 10;

    /// A path of `mb_per_s` holding `posted` bytes, with room for one more slice or none.
    fn load(mb_per_s: f64, posted: u64, has_room: bool) -> PathLoad {
        // Room for one more slice: the window ends a slice past what is posted.
        PathLoad {
            bytes_per_sec: mb_per_s * MB,
            posted,
            slice: SLICE,
            allowed: if has_room { posted + SLICE } else { posted },
            probe_bytes: 0,
        }
    }

    /// Which of `loads` may take the next slice.
    fn takers(loads: &[PathLoad], queued: &[u64]) -> Vec<usize> {
        let h = horizon(loads, queued.iter().copied());
        loads
            .iter()
            .enumerate()
            .filter(|(_, l)| l.has_room() && l.on_time(l.posted, h))
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn the_tail_of_a_batch_waits_for_a_fast_rail_instead_of_a_slow_one() {
        // Four rails of 18.75 to 75 MB/s (150 to 600 Mbit/s); the fast ones full, the slowest
        // idle, two slices left: the slowest would take 3.5 ms for one, the fastest finishes
        // what it holds and one more in 1.9 ms.
        let loads = [
            load(18.75, 0, true),
            load(37.5, 2 * SLICE, false),
            load(56.25, 2 * SLICE, false),
            load(75.0, SLICE, false),
        ];
        assert!(takers(&loads, &[SLICE, SLICE]).is_empty());
        // The fastest frees room: it takes the slice.
        let mut freed = loads;
        freed[3].allowed += SLICE;
        assert_eq!(takers(&freed, &[SLICE, SLICE]), vec![3]);
    }

    #[test]
    fn a_long_queue_keeps_every_rail_busy() {
        // A batch of 16 × 64 KiB just submitted: the rails together need 5.6 ms for it, the
        // slowest 3.5 ms for one slice, so it takes one.
        let loads = [
            load(18.75, 0, true),
            load(37.5, 0, true),
            load(56.25, 0, true),
            load(75.0, 0, true),
        ];
        assert_eq!(takers(&loads, &[SLICE; 16]), vec![0, 1, 2, 3]);
        // Its window would let it take two, but the second would finish at 7 ms, after the
        // whole batch.
        let h = horizon(&loads, [SLICE; 16]);
        assert!(loads[0].on_time(0, h) && !loads[0].on_time(SLICE, h));
        // A queue longer than what every window could finish is not summed further.
        assert_eq!(horizon(&loads, [SLICE; 40]), f64::INFINITY);
    }

    #[test]
    fn a_slow_rail_takes_a_slice_it_would_finish_within_the_horizon() {
        // Eight slices queued, the fast rails each holding two: draining everything takes
        // (8 + 2 + 2) × 64 KiB / 168.75 MB/s = 4.7 ms, and the slow rail's one slice 3.5 ms.
        let loads = [
            load(18.75, 0, true),
            load(75.0, 2 * SLICE, false),
            load(75.0, 2 * SLICE, false),
        ];
        assert_eq!(takers(&loads, &[SLICE; 8]), vec![0]);
        // With one slice queued everything drains in 1.9 ms, and a fast rail would finish the
        // slice in 2.6: the slow rail's 3.5 ms is past both.
        assert!(takers(&loads, &[SLICE]).is_empty());
    }

    #[test]
    fn the_soonest_path_always_qualifies() {
        // One slice queued: spread over both rails it would drain in 0.7 ms, sooner than any
        // one rail can finish it; the fast rail (0.9 ms) still takes it, the slow (3.5 ms) not.
        let loads = [load(75.0, 0, true), load(18.75, 0, true)];
        assert_eq!(takers(&loads, &[SLICE]), vec![0]);
    }

    #[test]
    fn unknown_bandwidths_are_not_judged() {
        let mut loads = [load(18.75, 0, true), load(75.0, 3 * SLICE, false)];
        loads[0].bytes_per_sec = 0.0;
        assert_eq!(takers(&loads, &[SLICE]), vec![0]);
        // Every bandwidth unknown: no horizon.
        loads[1].bytes_per_sec = 0.0;
        assert_eq!(horizon(&loads, [SLICE]), f64::INFINITY);
    }

    #[test]
    fn a_rail_kept_off_long_is_measured_again() {
        // A rail whose estimate collapsed while it failed: 1 MB/s against 12.5 GB/s.
        let mut loads = [load(1.0, 0, true), load(12_500.0, SLICE, true)];
        loads[0].allowed = 4 * SLICE;
        assert_eq!(takers(&loads, &[SLICE; 4]), vec![1]);
        // Probing: a span's worth of its estimate is less than a slice, so one slice at a
        // time, taken again as each is answered within the span.
        loads[0].probe_bytes = SLICE;
        assert_eq!(takers(&loads, &[SLICE; 4]), vec![0, 1]);
        let h = horizon(&loads, [SLICE; 4]);
        assert!(!loads[0].on_time(SLICE, h));
        // An estimate whose span holds several slices: they go at once.
        loads[0].probe_bytes = 4 * SLICE;
        assert!(loads[0].on_time(3 * SLICE, h));
    }

    #[test]
    fn a_slow_rail_past_the_horizon_takes_the_piece_it_finishes_in_time() {
        // The fast rails full, two slices left: the horizon is 2.45 ms (see above) and the
        // 150 Mbit/s rail moves 45 KB by then: 44 KiB in whole pages.
        let loads = [
            load(18.75, 0, true),
            load(37.5, 2 * SLICE, false),
            load(56.25, 2 * SLICE, false),
            load(75.0, SLICE, false),
        ];
        let h = horizon(&loads, [SLICE, SLICE]);
        assert_eq!(tail_piece(&loads[0], h, SLICE, 16 << 10), Some(44 << 10));
        // Not below the smallest piece, not from a full path, not past an unbounded horizon.
        assert_eq!(tail_piece(&loads[0], h, SLICE, 48 << 10), None);
        assert_eq!(tail_piece(&loads[1], h, SLICE, 4096), None);
        assert_eq!(tail_piece(&loads[0], f64::INFINITY, SLICE, 4096), None);
        // A whole slice that fits is no piece: it goes as it is.
        assert_eq!(tail_piece(&loads[0], 1.0, SLICE, 4096), None);
        // Nor on a path that puts a whole slice on the wire within half a millisecond (here
        // 200 MB/s: 0.33 ms), where a piece saves less than its own answer costs.
        let fast = PathLoad {
            bytes_per_sec: 200.0 * MB,
            ..loads[0]
        };
        assert_eq!(tail_piece(&fast, 0.2e-3, SLICE, 4096), None);
    }

    #[test]
    fn equal_rails_all_qualify() {
        let loads = [load(75.0, SLICE, true), load(75.0, SLICE, true)];
        assert_eq!(takers(&loads, &[SLICE]), vec![0, 1]);
    }

    #[test]
    fn a_queue_longer_than_the_scan_counts_as_long_enough() {
        let loads = [load(0.001, 0, true), load(75.0, 0, true)];
        let queued = vec![1u64; MAX_SCAN + 10];
        assert_eq!(horizon(&loads, queued), f64::INFINITY);
    }
}
