//! The lanes scenarios under `sim/scenarios/`: each run of each file, checked for what
//! it is there to show. Where a run would take more than a few seconds in a debug build, the
//! test says what it shortens and why that does not change what is checked.

use std::path::Path;

use multirail_sim::report::LanesReport;
use multirail_sim::{parse_runs, simulate, Report, Run};

/// Runs the run of `file` named `run` (the scenario name, `/`, the run's name), after `tweak`.
fn run_with(file: &str, run: &str, tweak: impl FnOnce(&mut Run)) -> Report {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../sim/scenarios")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("scenario file exists");
    let runs = parse_runs(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut wanted = runs
        .into_iter()
        .find(|r| r.name.ends_with(&format!("/{run}")))
        .unwrap_or_else(|| panic!("{file} has no run {run}"));
    tweak(&mut wanted);
    simulate(&wanted).expect("runs")
}

/// A hot10 run at a tenth of the hot senders' rate: 100,000 messages a second still sample
/// more than one send per 1 ms round (3,125 a second), so every hot sender's tracker still
/// progresses every 10 ms with its receiver touched in every round, as at 1,000,000; the
/// receiver's answers are a tenth as many, still a sample in most rounds (its tracker
/// progresses every 20 ms or so, on its own or by the driver's idle progress, with about 10
/// touches each time, as at 1,000,000). What the simulator spends its time on (10 million
/// sends a second through the samplers) is what this cuts, so the whole 200 s stays within
/// seconds in a debug build.
fn hot10(run: &str) -> Report {
    run_with("lanes-1000-hot10.json", run, |r| {
        let lanes = r.lanes.as_mut().expect("a lanes run");
        assert_eq!(lanes.hot_rate_per_sec, Some(1_000_000.0));
        lanes.hot_rate_per_sec = Some(100_000.0);
    })
}

/// An alltoall run cut to its first `ms` (each simulated second is 4 million sends).
fn alltoall(run: &str, ms: u64) -> Report {
    run_with("lanes-1000-alltoall.json", run, |r| r.duration_ms = ms)
}

fn lanes(r: &Report) -> &LanesReport {
    r.lanes.as_ref().expect("a lanes report")
}

fn within_the_bound(r: &Report) {
    let l = lanes(r);
    assert!(
        l.max_dedicated_seen <= l.max_dedicated,
        "{}: a lane machine held {} dedicated lanes",
        r.name,
        l.max_dedicated_seen
    );
    assert!(l
        .timeline
        .iter()
        .all(|s| s.max_dedicated as usize <= l.max_dedicated));
    if l.lane_messages_in_flight == 0 {
        assert_eq!(l.one_sided, 0, "{}: both ends of every lane agree", r.name);
    }
}

/// The engine's model: each process's lanes driver runs its tracker's progress itself when
/// it has not progressed for 20 ms. The hot set is dedicated within a few of the hot senders'
/// progress rounds and keeps every lane for 200 s; so do the receiver's own lanes to the hot
/// senders (its answers, whose sampled scores dip below the cooling line now and then but
/// never for `COOL_AFTER` progress rounds in a row). The cold senders, sampled once every
/// 3.2 s, decay at every idle progress in between: their score never rises above the 0.2 of
/// a touch, they never ask, and no cold sender ever holds a lane.
#[test]
fn hot10_the_hot_set_is_dedicated_at_once_and_no_cold_sender_ever_gets_a_lane() {
    let r = hot10("200s");
    let l = lanes(&r);
    assert_eq!(r.simulated_ms, 200_000);
    assert!(l.idle_progress && l.idle_progress_runs > 0);
    assert_eq!(l.drive_every_ms, 5.0);
    let rx = &l.receivers[0];
    let hot: Vec<u64> = (1..=10).collect();
    assert_eq!(rx.hot, hot);
    let all_hot = rx.all_hot_at_ms.expect("the hot set is dedicated");
    assert!(all_hot <= 100.0, "hot set dedicated at {all_hot} ms");
    assert_eq!(rx.dedicated, hot, "{}", r.table());
    assert_eq!(rx.hot_set_since_ms, Some(all_hot), "{}", r.table());
    assert_eq!(rx.hot_lost, 0, "{}", r.table());
    assert_eq!((rx.cold_granted, rx.cold_first_at_ms), (0, None));
    // The receiver's answers: a lane to each hot sender, held from the start.
    assert_eq!(rx.replies_dedicated, hot, "{}", r.table());
    assert_eq!((rx.replies_switches, rx.replies_cooled), (10, 0));
    // Ten lanes each way were asked for, and nothing else happened.
    let t = &l.totals;
    assert_eq!((t.requests_sent, t.accepts_sent), (20, 20), "{}", r.table());
    assert_eq!((t.denials_sent, t.evictions, t.cooled), (0, 0, 0));
    assert_eq!(t.switches, 40);
    assert!(l.last_switch_ms.unwrap() < 1_000.0, "{}", r.table());
    assert_eq!(l.switches_second_half, 0);
    assert_eq!(l.dedicated_pairs, 20);
    assert!(t.scores_sent > 0 && t.scores_received > 0);
    within_the_bound(&r);
}

/// Without idle progress (the trackers progress only on their send path) the cold senders'
/// trackers progress every 32 s (320 sends at 10 a second; the first at 28.8 s, the first
/// sample starting the first round) with their one destination touched in every round: their
/// score climbs 0.2, 0.36, 0.49, 0.59, so they reach the floor at their fourth progress
/// (124.8 s), take the 5 lanes the hot set leaves free, and the others are denied from then
/// on. (Cut to 130 s: that is all it shows.)
#[test]
fn hot10_without_idle_progress_cold_senders_take_the_spare_lanes_at_124_8_s() {
    let r = run_with("lanes-1000-hot10.json", "200s-no-idle-progress", |r| {
        r.duration_ms = 130_000;
        r.lanes.as_mut().unwrap().hot_rate_per_sec = Some(100_000.0);
    });
    let l = lanes(&r);
    assert!(!l.idle_progress);
    assert_eq!(l.idle_progress_runs, 0);
    let rx = &l.receivers[0];
    assert_eq!(rx.hot_dedicated, 10, "{}", r.table());
    assert_eq!(rx.hot_lost, 0, "{}", r.table());
    let cold_at = rx.cold_first_at_ms.expect("cold senders got lanes");
    assert!((124_000.0..126_000.0).contains(&cold_at), "{cold_at} ms");
    assert_eq!(rx.cold_granted, (l.max_dedicated - 10) as u64);
    assert!(l.totals.denials_sent > 1_000, "{}", r.table());
    assert_eq!(l.totals.evictions, 0);
    within_the_bound(&r);
}

/// Without the floor (every promotion asks) the cold senders ask at their first progress
/// (28.8 s), with the 0.2 every first touch scores, idle progress or not. (Cut to 40 s: that
/// is all it shows.)
#[test]
fn hot10_without_the_floor_cold_senders_ask_at_their_first_progress() {
    let r = run_with("lanes-1000-hot10.json", "200s-no-floor", |r| {
        r.duration_ms = 40_000;
        r.lanes.as_mut().unwrap().hot_rate_per_sec = Some(100_000.0);
    });
    let l = lanes(&r);
    let rx = &l.receivers[0];
    assert_eq!(rx.hot_dedicated, 10, "{}", r.table());
    let cold_at = rx.cold_first_at_ms.expect("cold senders got lanes");
    assert!((28_000.0..30_000.0).contains(&cold_at), "{cold_at} ms");
    assert_eq!(rx.cold_granted, 5);
    within_the_bound(&r);
}

/// With the receiver's own tracker score compared too, and with UCX's score floors, the hot
/// set keeps its lanes and no cold sender gets one either. (Cut to 60 s: past the cold
/// senders' first progress, 28.8 s, and its next, 60.8 s, nearly.)
#[test]
fn hot10_with_the_receivers_own_scores_or_ucx_floors_keeps_the_hot_set() {
    for run in ["200s-own", "200s-min_score"] {
        let r = run_with("lanes-1000-hot10.json", run, |r| {
            r.duration_ms = 60_000;
            r.lanes.as_mut().unwrap().hot_rate_per_sec = Some(100_000.0);
        });
        let l = lanes(&r);
        let rx = &l.receivers[0];
        assert_eq!(rx.hot_dedicated, 10, "{run}: {}", r.table());
        assert_eq!(rx.hot_lost, 0, "{run}: {}", r.table());
        assert!(rx.all_hot_at_ms.unwrap() <= 100.0);
        assert_eq!(rx.cold_granted, 0, "{run}: {}", r.table());
        assert_eq!(l.totals.cooled, 0, "{run}: {}", r.table());
        assert_eq!(l.switches_second_half, 0, "{run}: {}", r.table());
        within_the_bound(&r);
    }
}

/// osu_alltoall's order: each process sends to each of its 999 peers once in 999 sends, so a
/// peer is sampled about once every 8 s and touched in one progress round in several hundred; no
/// score nears the floor, nobody asks, nothing switches. (Cut to 20 s: nothing happens in
/// the 60 s of the file either.)
#[test]
fn alltoall_in_osu_order_never_asks_and_never_switches() {
    let r = alltoall("round-robin", 20_000);
    let l = lanes(&r);
    assert_eq!(l.totals.requests_sent, 0, "{}", r.table());
    assert_eq!(l.totals.switches, 0, "{}", r.table());
    assert_eq!(l.switches_second_half, 0);
    within_the_bound(&r);
}

/// Random destinations: a peer reaches the floor only by chance, with the driver's idle
/// progress (every 20–25 ms, 2 or 3 touches each) about once a minute over the 1,000
/// processes, and cools off a few hundred ms later. Rare, but being chance it does not end:
/// bounded, not zero. Without idle progress (a progress every 80 ms with 10 touches) chance
/// lanes come about 30 times as often. (Cut to 20 s, and the comparisons to 10 s.)
#[test]
fn alltoall_in_random_order_switches_rarely_with_the_floor() {
    let r = alltoall("random", 20_000);
    let l = lanes(&r);
    within_the_bound(&r);
    assert!(l.idle_progress_runs > 0);
    assert!(l.totals.switches <= 20, "{}", r.table());
    assert_eq!(
        l.totals.promotions,
        2 * l.totals.accepts_sent,
        "every lane formed was asked for"
    );
    assert!(l.dedicated_pairs <= 2, "{}", r.table());
    let slow = alltoall("random-no-idle-progress", 10_000);
    within_the_bound(&slow);
    let switches = lanes(&slow).totals.switches;
    assert!(
        switches > l.totals.switches && switches <= 100,
        "{} switches in 20 s with idle progress; without:\n{}",
        l.totals.switches,
        slow.table()
    );
    let r = alltoall("random-slow-decay", 10_000);
    within_the_bound(&r);
    assert_eq!(lanes(&r).totals.switches, 0, "{}", r.table());
}
