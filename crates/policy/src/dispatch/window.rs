//! How much a path may hold in flight: a window controller fed by an RTT estimator.
//!
//! The shape follows quinn-proto's `congestion::Controller` and `RttEstimator`: the estimator
//! learns from each answered slice, the controller turns the estimate and the rail's bandwidth
//! into a window. The dispatcher keeps one of each per path and asks the controller for the
//! window whenever it deals; which controller runs is a setting (`ControllerKind`).

use std::fmt;

/// Window used before a path has measured a round trip: enough for a few slices, small enough
/// that an unmeasured slow rail does not take a second's worth.
pub const DEFAULT_INITIAL_WINDOW: u64 = 1 << 20;
/// Bandwidth-delay products a window holds before the time cap. On a CPU-bound link such as
/// loopback the smallest round trip understates what keeps the pipe full (4 MiB writes:
/// 2.9 GB/s with 4, 3.7 with 8; 16 let a bulk process on the same host double another's HIGH
/// p99).
pub const DEFAULT_WINDOW_BDPS: f64 = 8.0;
/// Bandwidth-delay products bulk may keep in flight on a rail while HIGH work is active: what
/// keeps the rail busy, so a HIGH slice finds almost nothing queued ahead of it. Every window
/// also holds at least one *pipe* (a product plus the slice being put on the wire; see
/// [`BdpController`]), so one product means one pipe.
pub const DEFAULT_LEAN_BDPS: f64 = 1.0;
/// Most time's worth of a rail's bandwidth a window holds: a slow rail's queue (a shaped
/// link's, a switch's) then never holds more than a millisecond's worth, which is what a HIGH
/// slice could find ahead of it.
pub const DEFAULT_MAX_QUEUE_NS: u64 = 1_000_000;

/// What one path may hold in flight, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// For full speed.
    pub full: u64,
    /// For bulk beside HIGH work: about what keeps the rail busy.
    pub lean: u64,
    /// What keeps the rail busy: one bandwidth-delay product plus the slice on the wire (0 when
    /// the controller does not know). A path holding less idles between answers, so the
    /// dispatcher refills it without waiting for more to drain.
    pub pipe: u64,
}

/// Round-trip estimate of one path, from answered slices.
///
/// Keeps the smallest *fixed* part seen (round trip less the time to put the slice on the wire
/// at the rail's bandwidth: what the path adds whatever the slice's length, so the
/// bandwidth-delay product does not grow with the slices that happened to be measured) and a
/// smoothed round trip with its variation as RFC 6298 computes them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RttEstimator {
    min_fixed_ns: Option<u64>,
    smoothed_ns: Option<u64>,
    var_ns: u64,
    latest_ns: u64,
    /// Bytes of every slice answered so far: how far the window has grown from its initial
    /// size (see [`BdpController::window`]).
    answered_bytes: u64,
}

impl RttEstimator {
    /// An estimator with no sample yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Learns from a slice of `bytes` answered `rtt_ns` after it was posted on a rail whose
    /// bandwidth is estimated at `bytes_per_sec` (0 = unknown: the whole round trip counts as
    /// fixed). A zero round trip carries no information and is ignored.
    pub fn on_sample(&mut self, rtt_ns: u64, bytes: u64, bytes_per_sec: f64) {
        self.answered_bytes = self.answered_bytes.saturating_add(bytes);
        if rtt_ns == 0 {
            return;
        }
        self.latest_ns = rtt_ns;
        let serialization_ns = if bytes_per_sec > 0.0 {
            (bytes as f64 * 1e9 / bytes_per_sec) as u64
        } else {
            0
        };
        // At most half a round trip is put down to the wire: the time on the wire comes from
        // the bandwidth *estimate*, and one that fell below the link's (a stall on a CPU-bound
        // link, a burst of scheduling delay) would put all of it there. The smallest fixed part
        // would then be zero for good, and every window computed from it one slice.
        let fixed = rtt_ns.saturating_sub(serialization_ns).max(rtt_ns / 2);
        self.min_fixed_ns = Some(self.min_fixed_ns.map_or(fixed, |m| m.min(fixed)));
        match self.smoothed_ns {
            None => {
                self.smoothed_ns = Some(rtt_ns);
                self.var_ns = rtt_ns / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(rtt_ns);
                self.var_ns = (3 * self.var_ns + diff) / 4;
                self.smoothed_ns = Some((7 * s + rtt_ns) / 8);
            }
        }
    }

    /// Bytes of every slice answered on the path so far.
    pub fn answered_bytes(&self) -> u64 {
        self.answered_bytes
    }

    /// Smallest fixed part of a round trip seen, ns; `None` before the first sample.
    pub fn min_fixed_ns(&self) -> Option<u64> {
        self.min_fixed_ns
    }

    /// Smoothed round trip, ns; `None` before the first sample.
    pub fn smoothed_ns(&self) -> Option<u64> {
        self.smoothed_ns
    }

    /// Mean deviation of the round trip, ns.
    pub fn var_ns(&self) -> u64 {
        self.var_ns
    }

    /// The last round trip measured, ns (0 before any).
    pub fn latest_ns(&self) -> u64 {
        self.latest_ns
    }

    /// Whether a slice of `bytes` answered after `rtt_ns`, on a rail estimated at
    /// `bytes_per_sec` (0 = unknown), waited behind other bytes: its round trip exceeds the
    /// smallest fixed part seen plus one and a half times its own time on the wire, so it found
    /// at least half a slice's worth queued ahead of it. A slice that found no queue says the
    /// rail was not full while it was in flight (idle, or held below the link by its window):
    /// its delivery rate measures the sender, not the rail. False before the first sample
    /// (nothing to compare with). Call it before [`on_sample`](Self::on_sample) with the same
    /// slice, so the slice is not compared with itself.
    pub fn saw_queue(&self, rtt_ns: u64, bytes: u64, bytes_per_sec: f64) -> bool {
        let Some(fixed) = self.min_fixed_ns else {
            return false;
        };
        let serialization_ns = if bytes_per_sec > 0.0 {
            bytes as f64 * 1e9 / bytes_per_sec
        } else {
            0.0
        };
        rtt_ns as f64 > fixed as f64 + 1.5 * serialization_ns
    }
}

/// Turns a path's round-trip estimate and its rail's bandwidth into a window. One per path;
/// `Send` so a dispatcher can live behind a lock shared by threads.
pub trait WindowController: Send + fmt::Debug {
    /// The controller's name, as the configuration spells it.
    fn name(&self) -> &'static str;

    /// The window for slices of `slice` bytes on a rail of `bytes_per_sec` (the selector's
    /// estimate; 0 when unknown), given the path's round trips. Each bound is at least one
    /// slice, so any slice can go on an idle path.
    fn window(&self, rtt: &RttEstimator, bytes_per_sec: f64, slice: u64) -> Window;

    /// A slice of `bytes` was answered after `rtt_ns`. Controllers that adapt to loss or
    /// delay learn here; the default learns nothing beyond what the estimator keeps.
    fn on_completed(&mut self, _now_ns: u64, _bytes: u64, _rtt_ns: u64) {}

    /// A slice in flight on the path was lost (its connection died).
    fn on_lost(&mut self, _now_ns: u64) {}
}

/// Window sizing in bandwidth-delay products, capped in time: the default.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BdpController {
    /// Window before the first round trip is measured, bytes.
    pub initial_window: u64,
    /// Bandwidth-delay products of a full window.
    pub window_bdps: f64,
    /// Bandwidth-delay products of the lean window bulk keeps beside HIGH work.
    pub lean_bdps: f64,
    /// Most time's worth of the rail's bandwidth either window holds, ns.
    pub max_queue_ns: u64,
    /// Smallest slice the full window's pipes are computed with, bytes (the engine's
    /// `workers.block_size`). A path carrying requests smaller than a slice (4 KiB KV blocks
    /// that nothing merges) keeps as many bytes in flight as one carrying full slices. Sized
    /// by its own 4 KiB slices, the pipe floor was about 10 KB on loopback: two or three
    /// slices in flight, each round trip paying the threads' wake-ups, and tcp moved 85,000
    /// requests per second whatever their size.
    pub pipe_slice: u64,
}

impl Default for BdpController {
    fn default() -> Self {
        BdpController {
            initial_window: DEFAULT_INITIAL_WINDOW,
            window_bdps: DEFAULT_WINDOW_BDPS,
            lean_bdps: DEFAULT_LEAN_BDPS,
            max_queue_ns: DEFAULT_MAX_QUEUE_NS,
            pipe_slice: crate::slicing::DEFAULT_BLOCK_SIZE,
        }
    }
}

impl WindowController for BdpController {
    fn name(&self) -> &'static str {
        "bdp"
    }

    /// `full` is `window_bdps` bandwidth-delay products (bandwidth × the smallest fixed round
    /// trip) and at least [`FULL_PIPES`] pipes of a slice of at least
    /// [`pipe_slice`](Self::pipe_slice), `lean` is `lean_bdps` of them and at least one
    /// *pipe* (one product plus the slice: what keeps the rail busy, since a slice is answered
    /// only after its whole length went on the wire), then at most `max_queue_ns` of the
    /// bandwidth, and at least one slice.
    /// The margin of `full` covers what the estimate misses on a CPU-bound link such as
    /// loopback; the time cap keeps a slow rail's queue short.
    ///
    /// Why the pipe: a window below it leaves the rail idle between answers, the delivery rate
    /// measured then is below the link's, and a window computed from that lower estimate is
    /// smaller again. With at least a pipe in flight an underestimated rail delivers more than
    /// its estimate, so the estimate (and the window with it) climbs back to the link's rate,
    /// as BBR's congestion-window gain above one product does.
    ///
    /// Whatever the product says, no window exceeds `initial_window` plus the bytes answered
    /// on the path so far (TCP's slow start: it can double once per round trip). Until samples
    /// teach it otherwise the estimate is the rail's *assumed* speed, and a rail policed at a
    /// hundredth of it (or given by hand with the 400 Gbit/s default) would otherwise be dealt
    /// a millisecond of that speed at its first answer: 50 MB on a 100 Mbit/s rail, four
    /// seconds of queue, and its oldest slice past the peer's timeout.
    fn window(&self, rtt: &RttEstimator, bytes_per_sec: f64, slice: u64) -> Window {
        let Some(fixed) = rtt.min_fixed_ns() else {
            let w = self.initial_window.max(slice);
            return Window {
                full: w,
                lean: w,
                pipe: 0,
            };
        };
        let bdp = bytes_per_sec * fixed as f64 / 1e9;
        let pipe = bdp + slice as f64;
        // The full window's pipes are of a full slice at least; the lean window keeps the
        // slice's own, so bulk cut into short pieces beside HIGH keeps little queued ahead of
        // it on a slow rail.
        let full_pipe = bdp + slice.max(self.pipe_slice) as f64;
        let grown = self.initial_window.saturating_add(rtt.answered_bytes()) as f64;
        let cap = (bytes_per_sec * self.max_queue_ns as f64 / 1e9).min(grown);
        let bound = |bdps: f64, pipes: f64| ((bdps * bdp).max(pipes).min(cap) as u64).max(slice);
        Window {
            full: bound(self.window_bdps, FULL_PIPES * full_pipe),
            lean: bound(self.lean_bdps, pipe),
            pipe: bound(0.0, pipe),
        }
    }
}

/// Pipes the full window holds at least, BBR's congestion-window gain. The fixed part of a
/// round trip is what is left after the slice's time on the wire at the *estimated* bandwidth;
/// an estimate that fell to one slice per round trip (a stall, a burst of scheduling delay on
/// a CPU-bound link) makes that time the whole round trip, the product zero and a one-pipe
/// window one slice, which then measures one slice per round trip again: a trap the engine
/// fell into on loopback (1 slice in flight, 0.6 instead of 2.8 GB/s, for the rest of the
/// run). With two pipes the rail delivers about twice the estimate and climbs out.
pub const FULL_PIPES: f64 = 2.0;

/// A fixed window in bytes whatever the path measures: what engines without flow control do
/// (Mooncake keeps one TCP slice in flight, a window of one slice). For comparison and for
/// links whose round trip says nothing about their capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedController {
    /// Bytes a path may hold in flight, for bulk and HIGH alike.
    pub bytes: u64,
}

impl WindowController for FixedController {
    fn name(&self) -> &'static str {
        "fixed"
    }

    fn window(&self, _rtt: &RttEstimator, _bytes_per_sec: f64, slice: u64) -> Window {
        let w = self.bytes.max(slice);
        Window {
            full: w,
            lean: w,
            pipe: 0,
        }
    }
}

/// Which controller sizes the windows, with its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ControllerKind {
    /// [`BdpController`].
    Bdp(BdpController),
    /// [`FixedController`].
    Fixed(FixedController),
}

impl Default for ControllerKind {
    fn default() -> Self {
        ControllerKind::Bdp(BdpController::default())
    }
}

impl ControllerKind {
    /// A fresh controller of this kind, for one path.
    pub fn build(&self) -> Box<dyn WindowController> {
        match *self {
            ControllerKind::Bdp(c) => Box::new(c),
            ControllerKind::Fixed(c) => Box::new(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn estimator_keeps_the_fixed_part_of_the_smallest_round_trip() {
        let mut rtt = RttEstimator::new();
        // 1 GB/s: a 64 KiB slice takes 65.5 µs on the wire.
        rtt.on_sample(200_000, 1 << 16, 1e9);
        assert_eq!(rtt.min_fixed_ns(), Some(200_000 - 65_536));
        // A later, larger fixed part does not raise the minimum.
        rtt.on_sample(300_000, 4096, 1e9);
        assert_eq!(rtt.min_fixed_ns(), Some(200_000 - 65_536));
        // A 1 MiB slice would take 1.05 ms on the wire at 1 GB/s: at most half its round trip
        // is put down to that.
        rtt.on_sample(1_100_000, 1 << 20, 1e9);
        assert_eq!(rtt.min_fixed_ns(), Some(200_000 - 65_536));
        let mut big = RttEstimator::new();
        big.on_sample(1_100_000, 1 << 20, 1e9);
        assert_eq!(big.min_fixed_ns(), Some(550_000));
        rtt.on_sample(0, 4096, 1e9);
        assert_eq!(rtt.latest_ns(), 1_100_000);
        assert!(rtt.smoothed_ns().unwrap() > 200_000);
    }

    #[test]
    fn an_estimate_fallen_to_one_slice_per_round_trip_still_gets_a_window_that_climbs() {
        // Loopback moves 16 KiB in a 15 µs round trip (about 1 GB/s of one slice at a time,
        // several GB/s with more in flight). After a stall the estimate reads 0.5 GB/s, at
        // which a slice would take 33 µs on the wire: more than the whole round trip.
        let c = BdpController::default();
        let mut rtt = RttEstimator::new();
        let slice = 16 << 10;
        rtt.on_sample(15_000, slice, 0.5e9);
        assert_eq!(rtt.min_fixed_ns(), Some(7_500));
        let w = c.window(&rtt, 0.5e9, slice);
        // Two slices in flight at least: the rail then delivers more than its estimate.
        assert!(w.full >= 2 * slice, "{w:?}");
        // Even with no fixed part at all (a window controller fed by another estimator), the
        // full window holds two pipes (of at least a full slice, `pipe_slice`).
        let zero = RttEstimator {
            min_fixed_ns: Some(0),
            ..RttEstimator::new()
        };
        assert_eq!(c.window(&zero, 0.5e9, slice).full, 2 * c.pipe_slice);
        assert_eq!(c.window(&zero, 0.5e9, slice).lean, slice);
    }

    #[test]
    fn bdp_window_starts_at_the_initial_window_then_follows_the_product() {
        let c = BdpController::default();
        let mut rtt = RttEstimator::new();
        assert_eq!(c.window(&rtt, 1e9, 65536).full, DEFAULT_INITIAL_WINDOW);
        // 100 µs fixed at 1 GB/s: BDP 100 kB, full 8 × = 800 kB under the 1 ms cap (1 MB).
        rtt.on_sample(100_000, 0, 1e9);
        let w = c.window(&rtt, 1e9, 65536);
        assert_eq!(w.full, 800_000);
        // One product is below a pipe (the product plus the slice on the wire): a pipe.
        assert_eq!(w.lean, 100_000 + 65536);
        let two = BdpController {
            lean_bdps: 2.0,
            ..c
        };
        assert_eq!(two.window(&rtt, 1e9, 65536).lean, 200_000);
        // 1 ms fixed: 8 BDPs would be 8 MB; the cap holds it to 1 ms = 1 MB.
        let mut slow = RttEstimator::new();
        slow.on_sample(1_000_000, 0, 1e9);
        assert_eq!(c.window(&slow, 1e9, 65536).full, 1_000_000);
    }

    #[test]
    fn small_slices_keep_the_pipe_of_a_full_slice() {
        let c = BdpController::default();
        let mut rtt = RttEstimator::new();
        // 4 µs fixed at 3 GB/s: a product of 12 kB, below a 64 KiB slice.
        rtt.on_sample(4_000, 0, 3e9);
        let small = c.window(&rtt, 3e9, 4096);
        let full = c.window(&rtt, 3e9, c.pipe_slice);
        // 4 KiB slices hold what 64 KiB ones do: two pipes of a product plus 64 KiB.
        assert_eq!(small.full, full.full);
        assert_eq!(small.full, 2 * (12_000 + 65_536));
        // The lean window and the pipe keep the slice's own size: bulk cut short beside HIGH
        // keeps little in flight.
        assert_eq!(small.lean, 12_000 + 4096);
        assert_eq!(small.pipe, small.lean);
        // A slice larger than pipe_slice counts in full, on a path past slow start (see the
        // next test) that answered a few megabytes.
        rtt.answered_bytes = 8 << 20;
        let big = c.window(&rtt, 3e9, 1 << 20);
        assert_eq!(big.full, 2 * (12_000 + (1 << 20)));
        // The time cap still wins on a slow rail: 1 ms of 10 MB/s is 10 kB (one slice at least).
        assert_eq!(c.window(&rtt, 10e6, 4096).full, 10_000);
    }

    #[test]
    fn a_window_grows_from_the_initial_one_by_what_the_path_answered() {
        // A rail assumed at 400 Gbit/s (50 GB/s) that carries 100 Mbit/s: its first answer
        // comes 10 ms after it was posted, and the product at the assumed speed is huge.
        let c = BdpController::default();
        let mut rtt = RttEstimator::new();
        let slice = 128 << 10;
        rtt.on_sample(10_000_000, slice, 50e9);
        let w = c.window(&rtt, 50e9, slice);
        assert_eq!(w.full, DEFAULT_INITIAL_WINDOW + slice);
        assert_eq!(w.lean, DEFAULT_INITIAL_WINDOW + slice);
        assert_eq!(w.pipe, DEFAULT_INITIAL_WINDOW + slice);
        for _ in 0..7 {
            rtt.on_sample(80_000_000, slice, 50e9);
        }
        assert_eq!(rtt.answered_bytes(), 8 * slice);
        assert_eq!(
            c.window(&rtt, 50e9, slice).full,
            DEFAULT_INITIAL_WINDOW + 8 * slice
        );
        // Once the estimate has come down, the product capped in time (a millisecond of
        // 12.5 MB/s, raised to one slice) is the smaller bound.
        assert_eq!(c.window(&rtt, 12.5e6, slice).full, slice);
        // A zero round trip teaches nothing about the path, but its bytes were answered.
        rtt.on_sample(0, slice, 50e9);
        assert_eq!(rtt.answered_bytes(), 9 * slice);
    }

    #[test]
    fn fixed_window_ignores_the_path() {
        let c = FixedController { bytes: 65536 };
        let mut rtt = RttEstimator::new();
        rtt.on_sample(5_000_000, 0, 1e6);
        assert_eq!(c.window(&rtt, 1e6, 4096).full, 65536);
        assert_eq!(c.window(&rtt, 1e6, 1 << 20).full, 1 << 20);
    }

    proptest! {
        /// Whatever was measured, a window never exceeds its time cap unless one slice does,
        /// and always admits one slice.
        #[test]
        fn a_window_never_exceeds_its_cap(
            samples in proptest::collection::vec((1u64..50_000_000, 0u64..(8 << 20)), 1..20),
            gbps in 0.01f64..800.0,
            slice in 1u64..(16 << 20),
        ) {
            let c = BdpController::default();
            let bytes_per_sec = gbps * 1e9 / 8.0;
            let mut rtt = RttEstimator::new();
            for (r, b) in samples {
                rtt.on_sample(r, b, bytes_per_sec);
            }
            let w = c.window(&rtt, bytes_per_sec, slice);
            let cap = (bytes_per_sec * c.max_queue_ns as f64 / 1e9) as u64;
            prop_assert!(w.full <= cap.max(slice));
            prop_assert!(w.lean <= w.full);
            prop_assert!(w.full >= slice && w.lean >= slice);
        }
    }
}
