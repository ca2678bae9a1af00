//! A peer that stops answering fails every request to it within `transports.tcp.timeout_ms`
//! of going silent (plus one upkeep interval), whatever the retry settings: no retry, no
//! reconnect to the stopped process and no slice re-queued behind another stretches the wait.
//! The targets are child processes stopped with SIGSTOP: the kernel still accepts connections
//! for them and acknowledges what fits in their socket buffers, so only the engine's own
//! clock can tell that they went silent.

mod common;
mod netns;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use common::TargetProcess;
use multirail::{Config, Engine, Error, Location, Opcode, Request, SegmentId, Status};
use netns::Rails;

const TIMEOUT_MS: u64 = 1500;
/// What the promise allows beyond the timeout: one upkeep interval, with room for a loaded
/// test machine.
const SLACK: Duration = Duration::from_secs(1);
const MIB: u64 = 1 << 20;
/// The region the load moves: 256 MiB in 1 MiB requests.
const REGION: u64 = 256 * MIB;
const PIECE: u64 = MIB;
/// Requests per batch: four batches cover the region.
const BATCH: u64 = 64;

/// These tests measure time; run side by side on a small machine they would measure each other.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn engine(max_retries: Option<u32>, connect_timeout_ms: u64) -> Arc<Engine> {
    let retries = max_retries.map_or(String::new(), |r| format!(r#", "max_retries": {r}"#));
    let conf = format!(
        r#"{{"transports": {{"tcp": {{"timeout_ms": {TIMEOUT_MS}, "connect_timeout_ms": {connect_timeout_ms}{retries}}}}}}}"#
    );
    Arc::new(Engine::new(Config::from_json_str(&conf, "test").unwrap(), "127.0.0.1:0").unwrap())
}

/// `count` requests of `PIECE` bytes over TCP, the first at byte `first * PIECE` of both sides.
fn requests(
    op: Opcode,
    local: u64,
    seg: SegmentId,
    remote: u64,
    first: u64,
    count: u64,
) -> Vec<Request> {
    (first..first + count)
        .map(|i| {
            let (l, r) = (local + i * PIECE, remote + i * PIECE);
            let req = match op {
                Opcode::Write => Request::write(l, seg, r, PIECE),
                Opcode::Read => Request::read(l, seg, r, PIECE),
            };
            Request {
                transport: Some(multirail::TransportChoice::Tcp),
                ..req
            }
        })
        .collect()
}

/// One `wait` that failed: when it returned, what it returned and each request's status.
struct Failed {
    at: Instant,
    error: Error,
    statuses: Vec<Status>,
}

/// Submits every batch of `round`, then waits for each in turn; again and again until a
/// batch fails (then the rest of that round is still waited for) or `stop`. Returns the
/// failed waits.
fn submit_until_failure(
    engine: Arc<Engine>,
    round: Vec<Vec<Request>>,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<Vec<Failed>> {
    thread::spawn(move || {
        let mut failed = Vec::new();
        while failed.is_empty() && !stop.load(Ordering::Acquire) {
            let mut batches = Vec::new();
            for reqs in &round {
                let b = engine.allocate_batch(reqs.len()).unwrap();
                engine.submit(b, reqs).unwrap();
                batches.push((b, reqs.len()));
            }
            for (b, n) in batches {
                let r = engine.wait(b, Some(Duration::from_secs(30)));
                let at = Instant::now();
                if let Err(error) = r {
                    let statuses = (0..n).map(|i| engine.status(b, i).unwrap()).collect();
                    failed.push(Failed {
                        at,
                        error,
                        statuses,
                    });
                }
                // Refused while a batch is still pending (a wait that timed out): left as is.
                let _ = engine.free_batch(b);
            }
        }
        failed
    })
}

/// Every failed wait returned within the timeout (+ slack) of `stopped_at`, with the timeout
/// error, and so did every request of it that had not completed before. Prints the times.
fn check_failures(what: &str, failed: &[Failed], stopped_at: Instant) {
    let times: Vec<String> = failed
        .iter()
        .map(|f| {
            format!(
                "{:?} ({})",
                f.at.saturating_duration_since(stopped_at),
                f.error
            )
        })
        .collect();
    eprintln!("{what}: waits failed after the stop at {times:?}");
    assert!(!failed.is_empty(), "{what}: no batch failed after the stop");
    let promise = Duration::from_millis(TIMEOUT_MS) + SLACK;
    for f in failed {
        assert!(
            f.at > stopped_at,
            "{what}: a batch failed before the stop: {}",
            f.error
        );
        let after = f.at - stopped_at;
        assert!(
            after <= promise,
            "{what}: a wait returned {after:?} after the stop ({}); the promise is {TIMEOUT_MS} ms + {SLACK:?}",
            f.error
        );
        let is_timeout = |e: &Error| {
            matches!(
                e,
                Error::Timeout {
                    timeout_ms: TIMEOUT_MS,
                    ..
                }
            )
        };
        assert!(is_timeout(&f.error), "{what}: {}", f.error);
        for (i, s) in f.statuses.iter().enumerate() {
            match s {
                Status::Completed => {}
                Status::Failed(e) if is_timeout(e) => {}
                other => panic!("{what}: request {i} ended {other:?}, not with the timeout"),
            }
        }
    }
}

/// After SIGCONT the same target takes a fresh write and read-back of a region the stopped
/// load never touched (the target may still apply writes that were in its socket buffers).
fn fresh_request_succeeds(engine: &Engine, seg: SegmentId, remote: u64) {
    let src = engine.allocate(PIECE as usize, Location::Any).unwrap();
    let back = engine.allocate(PIECE as usize, Location::Any).unwrap();
    // SAFETY: nothing is in flight on `src`: it was just allocated.
    for (i, b) in unsafe { src.as_mut_slice() }.iter_mut().enumerate() {
        *b = (i % 251) as u8 ^ 0x5a;
    }
    for op in [Opcode::Write, Opcode::Read] {
        let local = if op == Opcode::Write { &src } else { &back };
        let reqs = requests(op, local.addr(), seg, remote, 0, 1);
        let b = engine.allocate_batch(1).unwrap();
        engine.submit(b, &reqs).unwrap();
        engine.wait(b, Some(Duration::from_secs(30))).unwrap();
        engine.free_batch(b).unwrap();
    }
    // SAFETY: both transfers finished.
    unsafe {
        assert!(
            back.as_slice() == src.as_slice(),
            "bytes differ after the resume"
        );
    }
}

/// One submitter keeps 256 MiB in 1 MiB requests going in four batches (many slices queued
/// behind the windows, many in flight), a second keeps submitting 16 MiB batches; the target
/// is stopped; every batch not done by then fails with the timeout error within `TIMEOUT_MS`
/// + 1 s of the stop; once the target resumes, a fresh request to it succeeds.
fn stopped_peer_fails_in_time(max_retries: Option<u32>, op: Opcode) {
    let _serial = serial();
    let what = format!("{op:?}, max_retries {max_retries:?}");
    // One spare piece past the region, for the check after the resume.
    let target = TargetProcess::start("257MiB", None);
    let engine = engine(max_retries, 1000);
    let local = engine.allocate(REGION as usize, Location::Any).unwrap();
    let seg = engine.open_segment(&target.name).unwrap();
    let remote = engine.segment_descriptor(seg).unwrap().buffers[0].addr;
    let round: Vec<Vec<Request>> = (0..REGION / PIECE / BATCH)
        .map(|k| requests(op, local.addr(), seg, remote, k * BATCH, BATCH))
        .collect();
    // Warm-up: the data connections exist before the stop, as in a running job.
    for reqs in &round {
        let b = engine.allocate_batch(reqs.len()).unwrap();
        engine.submit(b, reqs).unwrap();
        engine.wait(b, Some(Duration::from_secs(30))).unwrap();
        engine.free_batch(b).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let bulk = submit_until_failure(engine.clone(), round, stop.clone());
    let more = submit_until_failure(
        engine.clone(),
        vec![requests(op, local.addr(), seg, remote, 0, 16)],
        stop.clone(),
    );
    thread::sleep(Duration::from_millis(300));
    let stopped_at = Instant::now();
    target.signal(libc::SIGSTOP);
    // The submitters end at their first failure; `stop` only bounds a test that is failing.
    let watchdog = {
        let stop = stop.clone();
        thread::spawn(move || {
            thread::sleep(Duration::from_secs(8));
            stop.store(true, Ordering::Release);
        })
    };
    let mut failed = bulk.join().unwrap();
    failed.extend(more.join().unwrap());
    target.signal(libc::SIGCONT);
    check_failures(&what, &failed, stopped_at);
    fresh_request_succeeds(&engine, seg, remote + REGION);
    drop(watchdog);
}

#[test]
fn stopped_peer_fails_within_the_timeout_with_no_retries() {
    stopped_peer_fails_in_time(Some(0), Opcode::Write);
}

#[test]
fn stopped_peer_fails_within_the_timeout_with_two_retries() {
    stopped_peer_fails_in_time(Some(2), Opcode::Write);
}

#[test]
fn stopped_peer_fails_within_the_timeout_with_the_default_retries() {
    stopped_peer_fails_in_time(None, Opcode::Write);
}

/// READ requests put only headers on the wire: the stopped target's kernel acknowledges them
/// all, so no kernel timeout helps and the engine's own clock must do it.
#[test]
fn stopped_peer_fails_reads_within_the_timeout() {
    stopped_peer_fails_in_time(None, Opcode::Read);
}

/// Reconnecting to a stopped peer waits `connect_timeout_ms` (here 10 s) for its handshake;
/// meanwhile the timeouts of another peer that stops still fire on time, so the upkeep thread
/// that checks them is not held up by that reconnect.
#[test]
fn a_reconnect_to_a_stopped_peer_does_not_delay_another_peers_timeout() {
    let _serial = serial();
    let a = TargetProcess::start("16MiB", None);
    let b = TargetProcess::start("64MiB", None);
    let engine = engine(None, 10_000);
    let local = engine.allocate(64 * MIB as usize, Location::Any).unwrap();
    let open = |name: &str| {
        let seg = engine.open_segment(name).unwrap();
        (seg, engine.segment_descriptor(seg).unwrap().buffers[0].addr)
    };
    let (seg_a, remote_a) = open(&a.name);
    let (seg_b, remote_b) = open(&b.name);
    let to_a = requests(Opcode::Write, local.addr(), seg_a, remote_a, 0, 1);
    let to_b = requests(Opcode::Read, local.addr(), seg_b, remote_b, 0, 16);
    for reqs in [&to_a, &to_b] {
        let bt = engine.allocate_batch(reqs.len()).unwrap();
        engine.submit(bt, reqs).unwrap();
        engine.wait(bt, Some(Duration::from_secs(30))).unwrap();
        engine.free_batch(bt).unwrap();
    }
    // A stops; a submitter keeps sending to it: its first request fails by the timeout, each
    // later one first reconnects, which waits for a handshake that does not come.
    a.signal(libc::SIGSTOP);
    let stop = Arc::new(AtomicBool::new(false));
    let a_load = {
        let (engine, stop) = (engine.clone(), stop.clone());
        thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                let bt = engine.allocate_batch(1).unwrap();
                let _ = engine.submit(bt, &to_a);
                let _ = engine.wait(bt, Some(Duration::from_secs(30)));
                let _ = engine.free_batch(bt);
            }
        })
    };
    let b_stop = Arc::new(AtomicBool::new(false));
    let b_load = submit_until_failure(engine.clone(), vec![to_b.clone(), to_b], b_stop.clone());
    // A's first request has failed and a reconnect to it is under way.
    thread::sleep(Duration::from_millis(TIMEOUT_MS + 500));
    let stopped_at = Instant::now();
    b.signal(libc::SIGSTOP);
    let watchdog = thread::spawn(move || {
        thread::sleep(Duration::from_secs(15));
        b_stop.store(true, Ordering::Release);
    });
    let failed = b_load.join().unwrap();
    b.signal(libc::SIGCONT);
    stop.store(true, Ordering::Release);
    // Resumed, A answers the pending handshake and its submitter sees the flag.
    a.signal(libc::SIGCONT);
    a_load.join().unwrap();
    check_failures("peer B beside a reconnect to A", &failed, stopped_at);
    drop(watchdog);
}

/// Requests submitted to a stopped peer after its timeout go to fresh connections, whose
/// handshake the stopped process cannot answer: each fails within `connect_timeout_ms` (+ 1 s)
/// of its submission, also when several submitters ask at once (one connects, the others take
/// its answer instead of waiting a connect timeout each in turn).
#[test]
fn requests_after_the_timeout_fail_within_one_connect_timeout() {
    let _serial = serial();
    const CONNECT_TIMEOUT_MS: u64 = 1000;
    let target = TargetProcess::start("16MiB", None);
    let engine = engine(None, CONNECT_TIMEOUT_MS);
    let local = engine.allocate(PIECE as usize, Location::Any).unwrap();
    let seg = engine.open_segment(&target.name).unwrap();
    let remote = engine.segment_descriptor(seg).unwrap().buffers[0].addr;
    let reqs = requests(Opcode::Write, local.addr(), seg, remote, 0, 1);
    let run = |reqs: &[Request]| {
        let b = engine.allocate_batch(1).unwrap();
        let t0 = Instant::now();
        let r = engine
            .submit(b, reqs)
            .and_then(|()| engine.wait(b, Some(Duration::from_secs(30))));
        let took = t0.elapsed();
        let _ = engine.free_batch(b);
        (r, took)
    };
    run(&reqs).0.unwrap();
    target.signal(libc::SIGSTOP);
    // The first request meets the peer's timeout.
    let (r, took) = run(&reqs);
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(
        took <= Duration::from_millis(TIMEOUT_MS) + SLACK,
        "{took:?}"
    );
    let after: Vec<(multirail::Result<()>, Duration)> = thread::scope(|s| {
        let running: Vec<_> = (0..4).map(|_| s.spawn(|| run(&reqs))).collect();
        running.into_iter().map(|h| h.join().unwrap()).collect()
    });
    target.signal(libc::SIGCONT);
    let times: Vec<Duration> = after.iter().map(|(_, t)| *t).collect();
    eprintln!("four requests after the timeout failed after {times:?}");
    for (r, took) in &after {
        assert!(r.is_err(), "a stopped peer took a request");
        assert!(
            *took <= Duration::from_millis(CONNECT_TIMEOUT_MS) + SLACK,
            "failed {took:?} after its submission ({r:?})"
        );
    }
    // Resumed, the peer takes requests again.
    run(&reqs).0.unwrap();
}

/// `multirail bench --target` against a target stopped mid-run exits 1 within the timeout
/// (+ 1 s) of the stop, naming the timeout.
#[test]
fn bench_against_a_stopped_target_exits_in_time() {
    let _serial = serial();
    let target = TargetProcess::start("64MiB", None);
    let conf = format!(
        r#"{{"transports": {{"tcp": {{"timeout_ms": {TIMEOUT_MS}, "connect_timeout_ms": 1000}}}}}}"#
    );
    let mut bench = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args([
            "bench",
            "--target",
            &target.name,
            "--transport",
            "tcp",
            "--block-size",
            "4MiB",
            "--duration",
            "30",
            "--json",
        ])
        .env("MULTIRAIL_CONF", conf)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    thread::sleep(Duration::from_millis(1500));
    let t0 = Instant::now();
    target.signal(libc::SIGSTOP);
    let status = loop {
        if let Some(s) = bench.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = bench.kill();
            panic!("bench still running 20 s after the stop");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    target.signal(libc::SIGCONT);
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut bench.stderr.take().unwrap(), &mut stderr).unwrap();
    eprintln!("bench exited {took:?} after the stop");
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("within {TIMEOUT_MS} ms")),
        "not the timeout: {stderr}"
    );
    assert!(
        took <= Duration::from_millis(TIMEOUT_MS) + SLACK,
        "bench exited {took:?} after the stop"
    );
}

/// One rail stops delivering anything (the target's answers on it go to a blackhole route)
/// while the three others work: the stalled rail's slices are retried on the others and the
/// transfer completes with every byte verified. The peer must not be judged silent although
/// the other rails go idle while the batch waits for the stalled rail's last slices. Needs
/// root (network namespaces); without it, says why and passes.
#[test]
fn a_stalled_rail_is_retried_on_the_others() {
    let _serial = serial();
    let Some(rails) = Rails::up_or_skip("mrst") else {
        return;
    };
    let (mut target, name) = rails.target_with("128MiB", None);
    // As in tests/rails.rs: the EWMA may learn rates far below veth's nominal 10 Gbps.
    let conf = format!(
        r#"{{"transports": {{"rdma": {{"ewma_min_bandwidth_multiplier": 0.01}}, "tcp": {{"timeout_ms": {TIMEOUT_MS}}}}}}}"#
    );
    let args = [
        "--target",
        &name,
        "--op",
        "write",
        "--block-size",
        "4MiB",
        "--batch-size",
        "4",
        "--size",
        "128MiB",
        "--total",
        "512MiB",
        "--verify",
        "--interval",
        "100ms",
    ];
    let mut bench = rails.bench(&conf, &args);
    // Stall once bytes flow (the bench reports each interval on stderr); keep draining stderr.
    let stderr = BufReader::new(bench.stderr.take().unwrap());
    let (flowing_tx, flowing_rx) = std::sync::mpsc::channel();
    let drain = thread::spawn(move || {
        let mut log = String::new();
        for line in stderr.lines().map_while(Result::ok) {
            if line.contains("\"gb_per_s\"") {
                let _ = flowing_tx.send(());
            }
            log.push_str(&line);
            log.push('\n');
        }
        log
    });
    assert!(
        flowing_rx.recv_timeout(Duration::from_secs(30)).is_ok(),
        "the bench never started moving bytes"
    );
    thread::sleep(Duration::from_millis(300));
    let b0 = rails.ip(&[
        "-n",
        &rails.ns('b'),
        "-o",
        "-4",
        "addr",
        "show",
        "dev",
        &format!("{}0", rails.ns('b')),
    ]);
    let b0 = b0
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|a| a.split('/').next())
        .expect("rail 0 address")
        .to_owned();
    let t0 = Instant::now();
    rails.ip(&[
        "-n",
        &rails.ns('a'),
        "route",
        "add",
        "blackhole",
        &format!("{b0}/32"),
    ]);
    let out = bench.wait_with_output().unwrap();
    let took = t0.elapsed();
    let log = drain.join().unwrap();
    let _ = target.kill();
    let _ = target.wait();
    assert!(
        out.status.success(),
        "bench failed {took:?} after the stall: {log}"
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["bytes"].as_u64().unwrap(), 512 << 20);
    assert_eq!(report["verified_bytes"].as_u64().unwrap(), 128 << 20);
    let errors: Vec<u64> = report["rails"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["errors"].as_u64().unwrap())
        .collect();
    eprintln!("finished {took:?} after rail 0 stalled; errors per rail {errors:?}");
    assert!(
        errors.iter().sum::<u64>() > 0,
        "the stall caught no slice in flight"
    );
}
