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
/// receiver's answers are a tenth as many, still a sample in most rounds. What the simulator
/// spends its time on (10 million sends a second through the samplers) is what this cuts, so
/// the whole 200 s stays within seconds in a debug build.
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

/// The engine's model (the receiver compares the larger of its own tracker's score and the
/// requester's): the hot set is dedicated within a few of the hot senders' progress rounds
/// and keeps every lane for 200 s. The cold senders' trackers progress every 32 s (320 sends
/// at 10 a second; the first at 28.8 s, the first sample starting the first round); with a
/// single destination each, their score for it climbs 0.2, 0.36, 0.49, 0.59, so they reach
/// the floor at their fourth progress (124.8 s, instead of asking at their first, 28.8 s), and
/// then take the 5 lanes the hot set leaves free, no more: the
/// requesters' `Score`s keep the receiver's view of the hot senders at 1, which no cold score
/// beats by the margin.
#[test]
fn hot10_the_hot_set_is_dedicated_at_once_and_keeps_its_lanes_for_200_s() {
    let r = hot10("200s");
    let l = lanes(&r);
    assert_eq!(r.simulated_ms, 200_000);
    let rx = &l.receivers[0];
    assert_eq!(rx.hot, (1..=10).collect::<Vec<u64>>());
    let all_hot = rx.all_hot_at_ms.expect("the hot set is dedicated");
    assert!(all_hot <= 100.0, "hot set dedicated at {all_hot} ms");
    assert_eq!(rx.hot_dedicated, 10, "{}", r.table());
    assert_eq!(rx.hot_lost, 0, "{}", r.table());
    assert_eq!(l.totals.evictions, 0, "{}", r.table());
    let cold_at = rx.cold_first_at_ms.unwrap_or(f64::INFINITY);
    assert!(
        cold_at >= 120_000.0,
        "a cold sender got a lane at {cold_at} ms"
    );
    assert!(rx.cold_granted <= (l.max_dedicated - 10) as u64);
    assert_eq!(
        rx.cold_dedicated as u64, rx.cold_granted,
        "no cold lane moved"
    );
    // Nothing at the receiver's granting end switches after the cold senders took the spare.
    assert!(rx.last_switch_ms.unwrap() <= cold_at + 1.0, "{}", r.table());
    assert!(l.totals.scores_sent > 0 && l.totals.scores_received > 0);
    within_the_bound(&r);
}

/// The same without the floor (every promotion asks): the cold senders ask at their first
/// progress (28.8 s), with the 0.2 every first touch scores. (Cut to 40 s: that is all it
/// shows.)
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

/// With the requesters' scores alone, and with UCX's score floors, the hot set keeps its
/// lanes too: what protects it is the requesters' `Score`s.
#[test]
fn hot10_with_requesters_scores_or_ucx_floors_keeps_the_hot_set() {
    for run in ["200s-request", "200s-min_score"] {
        let r = hot10(run);
        let l = lanes(&r);
        let rx = &l.receivers[0];
        assert_eq!(rx.hot_dedicated, 10, "{run}: {}", r.table());
        assert_eq!(rx.hot_lost, 0, "{run}: {}", r.table());
        assert!(rx.all_hot_at_ms.unwrap() <= 100.0);
        assert!(rx.cold_granted <= (l.max_dedicated - 10) as u64);
        within_the_bound(&r);
    }
}

/// osu_alltoall's order: each process sends to each of its 999 peers once in 999 sends, so a
/// peer is sampled about once every 8 s and touched in one progress round in a hundred; no
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

/// Random destinations: now and then a process samples the same peer in four progress rounds
/// running by chance, asks, gets the lane, and cools off it a few rounds later. Switching is
/// bounded (a few a second over 1,000 processes, each lane short-lived) but, being chance, it
/// does not end. Without the floor (every first touch asks) the same 20 s switch thousands of
/// times more, for as long as the run lasts.
#[test]
fn alltoall_in_random_order_switches_rarely_with_the_floor() {
    let r = alltoall("random", 20_000);
    let l = lanes(&r);
    within_the_bound(&r);
    assert!(l.totals.switches <= 200, "{}", r.table());
    assert_eq!(
        l.totals.promotions,
        2 * l.totals.accepts_sent,
        "every lane formed was asked for"
    );
    assert!(l.dedicated_pairs <= 5, "{}", r.table());
    let r = alltoall("random-slow-decay", 20_000);
    within_the_bound(&r);
    assert!(lanes(&r).totals.switches <= 200, "{}", r.table());
}
