//! Cost of one DeviceSelector decision, including the completion update that follows it.
//!
//! Eight rails, four per NUMA tier, the way a two-socket host with eight NICs presents them.
//! Budget: 8 rails × 400 Gbps at 64 KiB slices is 6.1 M slices/s, so one decision plus its
//! completion must stay well under 160 ns on one core.
//!
//! `single` makes one-slice calls; `batch_64` makes 64-slice calls and counts 64 items per
//! call, so divan's item throughput gives the per-slice cost (ns per slice = 1e9 / items/s,
//! or the per-call time divided by 64). Every assigned slice is completed right away with a
//! synthetic clock, so in-flight bytes stay bounded and the EWMA keeps learning.

use divan::counter::ItemsCount;
use divan::{black_box, Bencher};
use multirail_policy::selector::{DeviceSelector, RailId, SelectorConfig, SliceShape};

const SLICE: u64 = 64 * 1024;
const TIERS: &[&[RailId]] = &[&[0, 1, 2, 3], &[4, 5, 6, 7]];
/// 64 KiB at 400 Gbps takes about 1.3 µs; completions arrive that far apart.
const SLICE_NS: u64 = 1_310;

const MODES: [&str; 3] = ["baseline", "smart", "smart_no_jitter"];

fn main() {
    divan::main();
}

/// `mode`: "baseline", "smart", or "smart_no_jitter" (shows what the random jitter costs).
fn selector(mode: &str) -> DeviceSelector {
    let cfg = SelectorConfig {
        enable_smart_scheduling: mode != "baseline",
        score_jitter_range: if mode == "smart_no_jitter" { 0.0 } else { 1e-9 },
        ..SelectorConfig::default()
    };
    let speeds = [
        Some(400.0),
        Some(400.0),
        Some(200.0),
        None,
        Some(400.0),
        Some(100.0),
        None,
        Some(400.0),
    ];
    DeviceSelector::new(cfg, &speeds, 0x5eed)
}

#[divan::bench(args = MODES)]
fn single(bencher: Bencher, mode: &str) {
    let mut sel = selector(mode);
    let mut now = 0u64;
    bencher.counter(ItemsCount::new(1usize)).bench_local(|| {
        let rail = sel.select_one(black_box(TIERS), black_box(SLICE)).unwrap();
        now += SLICE_NS;
        sel.on_completed(rail, SLICE, now - SLICE_NS, now).unwrap();
        rail
    });
}

#[divan::bench(args = MODES)]
fn batch_64(bencher: Bencher, mode: &str) {
    let mut sel = selector(mode);
    let mut out: Vec<RailId> = Vec::with_capacity(64);
    let mut now = 0u64;
    let shape = SliceShape::uniform(64, SLICE);
    bencher.counter(ItemsCount::new(64usize)).bench_local(|| {
        sel.select(black_box(TIERS), black_box(shape), &mut out)
            .unwrap();
        let posted = now;
        for &rail in &out {
            now += SLICE_NS / 8;
            sel.on_completed(rail, SLICE, posted, now).unwrap();
        }
        out.len()
    });
}

/// The decision alone, without the completion update, for comparison.
#[divan::bench(args = MODES)]
fn single_decision_only(bencher: Bencher, mode: &str) {
    let mut sel = selector(mode);
    bencher.counter(ItemsCount::new(1usize)).bench_local(|| {
        let rail = sel.select_one(black_box(TIERS), black_box(SLICE)).unwrap();
        sel.on_unassigned(rail, SLICE).unwrap();
        rail
    });
}
