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
/// Most time's worth of a rail's bandwidth a window holds beyond what the path itself holds
/// (its propagation delay's worth): a slow rail's queue (a shaped link's, a switch's) then
/// never holds more than a millisecond's worth, which is what a HIGH slice could find ahead of
/// it, while a path with a long round trip (another building, another zone) still keeps its
/// whole product in flight.
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
    /// The smallest round trip seen, whole, with its slice's length: the path's propagation
    /// delay is what is left of it at the rail's bandwidth as estimated *now* (see
    /// [`propagation_ns`](RttEstimator::propagation_ns)).
    min_rtt: Option<(u64, u64)>,
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
        if self.min_rtt.is_none_or(|(min, _)| rtt_ns < min) {
            self.min_rtt = Some((rtt_ns, bytes));
        }
        let serialization_ns = on_wire_ns(bytes, bytes_per_sec) as u64;
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

    /// Whether a slice of `bytes` answered after `rtt_ns`, the last of `flight` bytes the path
    /// held in flight when it was posted (itself included), on a rail estimated at
    /// `bytes_per_sec`, shows the rail's rate: it [waited behind other bytes on the
    /// rail](Self::saw_queue), and not only behind its own batch on a path longer than the
    /// batch ([`kept_up`](Self::kept_up)). A slice that does not is app-limited (BBR's rule):
    /// its sample may raise the estimate but not lower it.
    pub fn rail_limited(&self, rtt_ns: u64, bytes: u64, flight: u64, bytes_per_sec: f64) -> bool {
        self.saw_queue(rtt_ns, bytes, bytes_per_sec) && !self.kept_up(rtt_ns, flight, bytes_per_sec)
    }

    /// Whether a slice answered after `rtt_ns`, the last of `flight` bytes the path held in
    /// flight when it was posted (itself included), on a rail estimated at `bytes_per_sec`,
    /// says nothing against the estimate: the flight was below the path's bandwidth-delay
    /// product, so the rail idled for part of the round trip whatever its rate, and the slice
    /// came back within the path's [propagation delay](Self::propagation_ns) plus
    /// [`KEPT_UP_FACTOR`] times the flight's time on the wire at the estimate. Such a slice
    /// waited behind the others of its batch and still shows no rail slower than estimated;
    /// its delivery rate is the batch's size over the path's length. False when the
    /// estimate or the propagation delay is unknown.
    pub fn kept_up(&self, rtt_ns: u64, flight: u64, bytes_per_sec: f64) -> bool {
        if bytes_per_sec <= 0.0 {
            return false;
        }
        let propagation = self.propagation_ns(bytes_per_sec) as f64;
        let product = bytes_per_sec * propagation / 1e9;
        propagation > 0.0
            && (flight as f64) < product
            && rtt_ns as f64 <= propagation + KEPT_UP_FACTOR * on_wire_ns(flight, bytes_per_sec)
    }

    /// How long the path holds a byte whatever is queued on it (its propagation delay and the
    /// ends' fixed costs), ns, at a rail of `bytes_per_sec`: the smallest round trip less its
    /// slice's time on the wire at that bandwidth, at most the smallest fixed part, 0 before
    /// the first sample. Unlike the fixed part, it is worked out with today's estimate: the
    /// first answers of a rail policed far below its assumed speed put the whole time of a
    /// slice on the wire down to the path (a 64 KiB slice at 150 Mbit/s, 3.5 ms), and a
    /// window sized on that would keep a slice more queued on it for good.
    pub fn propagation_ns(&self, bytes_per_sec: f64) -> u64 {
        let Some((rtt_ns, bytes)) = self.min_rtt else {
            return 0;
        };
        rtt_ns
            .saturating_sub(on_wire_ns(bytes, bytes_per_sec) as u64)
            .min(self.min_fixed_ns.unwrap_or(0))
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
        rtt_ns as f64 > fixed as f64 + 1.5 * on_wire_ns(bytes, bytes_per_sec)
    }
}

/// Time `bytes` take on the wire at `bytes_per_sec`, ns; 0 when the bandwidth is unknown (0).
fn on_wire_ns(bytes: u64, bytes_per_sec: f64) -> f64 {
    if bytes_per_sec > 0.0 {
        (bytes as f64 * 1e9 / bytes_per_sec).min(u64::MAX as f64)
    } else {
        0.0
    }
}

/// How many times its time on the wire at the estimate a flight below the bandwidth-delay
/// product may take, beyond the path's propagation delay, and still count as kept up with the
/// estimate (see [`RttEstimator::kept_up`]). Two: a sample must show the rail at under half its
/// estimate before it can lower it.
pub const KEPT_UP_FACTOR: f64 = 2.0;

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
    /// [`pipe_slice`](Self::pipe_slice) and the `initial_window`, `lean` is `lean_bdps` of
    /// them and at least one *pipe* (one product plus the slice: what keeps the rail busy,
    /// since a slice is answered only after its whole length went on the wire), then at most
    /// what the path holds (the bandwidth times its
    /// [propagation delay](RttEstimator::propagation_ns)) plus a queue of `max_queue_ns` of the
    /// bandwidth or one slice, whichever is more, and at least one slice.
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
        // The time cap bounds the queue, not what the path holds: on a round trip of 5 ms a
        // cap of 1 ms of the bandwidth kept a fifth of the product in flight, the rail
        // delivered that, and the estimate and the window fell together (10 Gbit/s rails at
        // 0.05 of their rate in the simulator). A queue of one slice at least: less leaves
        // the rail idle between answers.
        let held = bytes_per_sec * rtt.propagation_ns(bytes_per_sec) as f64 / 1e9;
        let queue = (bytes_per_sec * self.max_queue_ns as f64 / 1e9).max(slice as f64);
        let cap = (held + queue).min(grown);
        let bound = |bdps: f64, pipes: f64| ((bdps * bdp).max(pipes).min(cap) as u64).max(slice);
        // The full window keeps the initial window in flight however small the product (the
        // time cap still bounds it). A path of small slices that nothing merges (scattered
        // KV blocks) is bound by what each slice costs the threads, a wake-up and an answer,
        // not by the link: with two pipes in flight (160 kB on loopback, 10 slices of 16 KiB)
        // every write carried a few slices and every round trip paid the wake-ups, and
        // scattered 16 KiB requests moved 1.9 GB/s where 1 MiB in flight moved 2.8.
        let floor = self.initial_window as f64;
        Window {
            full: bound(self.window_bdps, (FULL_PIPES * full_pipe).max(floor)),
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
        // full window holds two pipes (of at least a full slice, `pipe_slice`), and here the
        // initial window as far as the time cap allows it (1 ms of 0.5 GB/s).
        let zero = RttEstimator {
            min_fixed_ns: Some(0),
            ..RttEstimator::new()
        };
        let full = c.window(&zero, 0.5e9, slice).full;
        assert!(full >= 2 * c.pipe_slice);
        assert_eq!(full, 500_000);
        assert_eq!(c.window(&zero, 0.5e9, slice).lean, slice);
    }

    #[test]
    fn bdp_window_starts_at_the_initial_window_then_follows_the_product() {
        let c = BdpController::default();
        let mut rtt = RttEstimator::new();
        assert_eq!(c.window(&rtt, 1e9, 65536).full, DEFAULT_INITIAL_WINDOW);
        // 100 µs fixed at 1 GB/s: BDP 100 kB, 8 × = 800 kB; the full window keeps the initial
        // window, which the time cap (the path's 100 kB and 1 ms of queue) allows.
        rtt.on_sample(100_000, 0, 1e9);
        let w = c.window(&rtt, 1e9, 65536);
        assert_eq!(w.full, DEFAULT_INITIAL_WINDOW);
        // One product is below a pipe (the product plus the slice on the wire): a pipe.
        assert_eq!(w.lean, 100_000 + 65536);
        let two = BdpController {
            lean_bdps: 2.0,
            ..c
        };
        assert_eq!(two.window(&rtt, 1e9, 65536).lean, 200_000);
        // 1 ms fixed: 8 BDPs would be 8 MB; the cap holds it to the product (1 MB) and 1 ms of
        // queue (1 MB), once slow start has let it grow that far.
        let mut slow = RttEstimator::new();
        slow.on_sample(1_000_000, 0, 1e9);
        assert_eq!(c.window(&slow, 1e9, 65536).full, DEFAULT_INITIAL_WINDOW);
        slow.answered_bytes = 64 << 20;
        assert_eq!(c.window(&slow, 1e9, 65536).full, 2_000_000);
        // 50 µs fixed at 10 GB/s: BDP 500 kB, 8 × = 4 MB, above the initial window and under
        // the cap (the path's 500 kB and 10 MB of queue).
        let mut fast = RttEstimator::new();
        fast.on_sample(50_000, 0, 10e9);
        fast.answered_bytes = 64 << 20;
        assert_eq!(c.window(&fast, 10e9, 65536).full, 4_000_000);
    }

    #[test]
    fn small_slices_keep_the_window_of_full_slices() {
        let c = BdpController::default();
        let mut rtt = RttEstimator::new();
        // 4 µs fixed at 3 GB/s: a product of 12 kB, below a 64 KiB slice.
        rtt.on_sample(4_000, 0, 3e9);
        let small = c.window(&rtt, 3e9, 4096);
        let full = c.window(&rtt, 3e9, c.pipe_slice);
        // 4 KiB slices hold what 64 KiB ones do: more than two pipes of a product plus 64 KiB,
        // the initial window, which a millisecond of the rail holds.
        assert_eq!(small.full, full.full);
        assert_eq!(small.full, DEFAULT_INITIAL_WINDOW);
        // The lean window and the pipe keep the slice's own size: bulk cut short beside HIGH
        // keeps little in flight.
        assert_eq!(small.lean, 12_000 + 4096);
        assert_eq!(small.pipe, small.lean);
        // A slice larger than pipe_slice counts in full, on a path past slow start (see the
        // next test) that answered a few megabytes.
        rtt.answered_bytes = 8 << 20;
        let big = c.window(&rtt, 3e9, 1 << 20);
        assert_eq!(big.full, 2 * (12_000 + (1 << 20)));
        // The time cap still wins on a slow rail: 4 µs of 10 MB/s held by the path and 1 ms of
        // queue, 10 kB (one slice at least).
        assert_eq!(c.window(&rtt, 10e6, 4096).full, 10_040);
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
    fn a_path_with_a_long_round_trip_keeps_its_product_in_flight() {
        // 10 Gbit/s (1.25 GB/s) to another zone, 10 ms there and back: 12.5 MB on the way.
        let c = BdpController::default();
        let bw = 1.25e9;
        let mut rtt = RttEstimator::new();
        rtt.on_sample(10_052_428, 65536, bw);
        rtt.answered_bytes = 1 << 30;
        assert_eq!(rtt.propagation_ns(bw), 10_000_000);
        let w = c.window(&rtt, bw, 65536);
        // A pipe at least (the product and a slice), and no more than a millisecond queued
        // beyond the product. Capped at a millisecond of the bandwidth in all, the window held
        // a tenth of the product and the rail carried a tenth of its rate.
        assert!(w.pipe >= 12_500_000 + 65536, "{w:?}");
        assert!(w.full >= w.pipe, "{w:?}");
        assert_eq!(w.full, 12_500_000 + 1_250_000);
        // Bulk alone gets two windows: the rail stays busy.
        let bulk_alone = crate::dispatch::allowance(crate::qos::Priority::Low, w, false, true);
        assert!(bulk_alone >= w.pipe);
    }

    #[test]
    fn propagation_is_worked_out_at_the_estimate_of_now() {
        // A rail assumed at 10 Gbit/s and policed at 150 Mbit/s (18.75 MB/s): its first slice
        // of 64 KiB spent 3.5 ms on the wire and 50 µs on the path. At the assumed speed all
        // of the 3.5 ms looks like path; at the rate learned since, 50 µs does.
        let mut rtt = RttEstimator::new();
        let on_wire = (65536.0 * 1e9 / 18.75e6) as u64;
        rtt.on_sample(on_wire + 50_000, 65536, 1.25e9);
        assert!(rtt.propagation_ns(1.25e9) > 3_000_000);
        let now = rtt.propagation_ns(18.75e6);
        assert!((49_000..=51_000).contains(&now), "{now}");
        // A window sized on the first would keep a slice more queued on the rail for good.
        rtt.answered_bytes = 64 << 20;
        let w = BdpController::default().window(&rtt, 18.75e6, 65536);
        assert!(w.full < 65536 + 2_000, "{w:?}");
        // Never more than the smallest fixed part, nor anything before a sample.
        assert_eq!(RttEstimator::new().propagation_ns(1e9), 0);
        assert!(rtt.propagation_ns(0.0) <= rtt.min_fixed_ns().unwrap());
    }

    #[test]
    fn a_flight_below_the_product_that_kept_up_with_the_estimate_is_told_apart() {
        // 8 x 64 KiB dealt at once on a 10 ms path at 10 Gbit/s: the last waits behind seven
        // others (it saw a queue), yet it came back when the estimate says it should have.
        let bw = 1.25e9;
        let mut rtt = RttEstimator::new();
        rtt.on_sample(10_052_428, 65536, bw);
        let flight = 8 * 65536;
        let last = 10_000_000 + 8 * 52_429;
        assert!(rtt.saw_queue(last, 65536, bw));
        assert!(rtt.kept_up(last, flight, bw));
        assert!(!rtt.rail_limited(last, 65536, flight, bw));
        // The same slice on a rail policed at 150 Mbit/s behind that estimate: 28 ms on the
        // wire, far beyond twice the estimate's 0.4 ms. It shows the rail slower.
        assert!(!rtt.kept_up(10_000_000 + 28_000_000, flight, bw));
        assert!(rtt.rail_limited(10_000_000 + 28_000_000, 65536, flight, bw));
        // A flight above the product keeps the rail busy: its samples are the rail's rate.
        assert!(!rtt.kept_up(last, 13_000_000, bw));
        // Nothing to go by.
        assert!(!rtt.kept_up(last, flight, 0.0));
        assert!(!RttEstimator::new().kept_up(last, flight, bw));
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
        /// Whatever was measured, a window never exceeds what the path holds plus its time
        /// cap (or one slice, if more) and always admits one slice.
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
            let propagation = rtt.propagation_ns(bytes_per_sec);
            prop_assert!(propagation <= rtt.min_fixed_ns().unwrap_or(0));
            let held = bytes_per_sec * propagation as f64 / 1e9;
            let queue = (bytes_per_sec * c.max_queue_ns as f64 / 1e9).max(slice as f64);
            prop_assert!(w.full as f64 <= held + queue + 1.0);
            prop_assert!(w.lean <= w.full);
            prop_assert!(w.full >= slice && w.lean >= slice);
        }
    }
}
