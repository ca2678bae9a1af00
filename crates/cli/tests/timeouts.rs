//! A peer that stops answering fails every request to it within `transports.tcp.timeout_ms`
//! of going silent (plus one upkeep interval), whatever the retry settings: no retry, no
//! reconnect to the stopped process and no slice re-queued behind another stretches the wait.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::TargetProcess;
use multirail::{Config, Engine, Error, Location, Request, TransportChoice};

const TIMEOUT_MS: u64 = 1500;
const SLACK: Duration = Duration::from_secs(1);
const REGION: u64 = 128 << 20;
const PIECE: u64 = 4 << 20;

fn engine(max_retries: Option<u32>) -> Engine {
    let retries = max_retries.map_or(String::new(), |r| format!(r#", "max_retries": {r}"#));
    let conf = format!(
        r#"{{"transports": {{"tcp": {{"timeout_ms": {TIMEOUT_MS}, "connect_timeout_ms": 1000{retries}}}}}}}"#
    );
    Engine::new(Config::from_json_str(&conf, "test").unwrap(), "127.0.0.1:0").unwrap()
}

fn batch_of_writes(local: u64, seg: multirail::SegmentId, remote: u64) -> Vec<Request> {
    (0..REGION / PIECE)
        .map(|i| Request {
            transport: Some(TransportChoice::Tcp),
            ..Request::write(local + i * PIECE, seg, remote + i * PIECE, PIECE)
        })
        .collect()
}

/// Two submitters keep batches of 4 MiB writes going (many slices queued behind the windows,
/// many in flight); the target is stopped; every batch that was not done by then must fail
/// with the timeout error within `TIMEOUT_MS` + 1 s of the stop.
fn stopped_peer_fails_in_time(max_retries: Option<u32>) {
    let target = TargetProcess::start("128MiB", None);
    let engine = Arc::new(engine(max_retries));
    let local = engine.allocate(REGION as usize, Location::Any).unwrap();
    let seg = engine.open_segment(&target.name).unwrap();
    let remote = engine.segment_descriptor(seg).unwrap().buffers[0].addr;
    let reqs = batch_of_writes(local.addr(), seg, remote);
    // Warm-up: the data connections exist before the stop, as in a running job.
    let b = engine.allocate_batch(reqs.len()).unwrap();
    engine.submit(b, &reqs).unwrap();
    engine.wait(b, Some(Duration::from_secs(30))).unwrap();
    engine.free_batch(b).unwrap();

    let stopped_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let submitters: Vec<_> = (0..2)
        .map(|_| {
            let (engine, reqs, stopped_at, stop) = (
                engine.clone(),
                reqs.clone(),
                stopped_at.clone(),
                stop.clone(),
            );
            thread::spawn(move || -> Vec<(Duration, String)> {
                let mut late = Vec::new();
                while !stop.load(Ordering::Acquire) {
                    let b = engine.allocate_batch(reqs.len()).unwrap();
                    if engine.submit(b, &reqs).is_err() {
                        break;
                    }
                    let r = engine.wait(b, Some(Duration::from_secs(30)));
                    let done = Instant::now();
                    let _ = engine.free_batch(b);
                    if let Err(e) = r {
                        let since_stop = stopped_at
                            .lock()
                            .unwrap()
                            .map(|t| done.saturating_duration_since(t))
                            .expect("a failure only after the stop");
                        late.push((since_stop, e.to_string()));
                        assert!(
                            matches!(
                                e,
                                Error::Timeout {
                                    timeout_ms: TIMEOUT_MS,
                                    ..
                                }
                            ),
                            "{e}"
                        );
                        break;
                    }
                }
                late
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    *stopped_at.lock().unwrap() = Some(Instant::now());
    target.signal(libc::SIGSTOP);
    thread::sleep(Duration::from_millis(TIMEOUT_MS) + SLACK + Duration::from_millis(500));
    stop.store(true, Ordering::Release);
    let mut failures = Vec::new();
    for s in submitters {
        failures.extend(s.join().unwrap());
    }
    target.signal(libc::SIGCONT);
    eprintln!("max_retries {max_retries:?}: failures after the stop {failures:?}");
    assert!(!failures.is_empty(), "no batch failed after the stop");
    for (after, err) in &failures {
        assert!(
            *after <= Duration::from_millis(TIMEOUT_MS) + SLACK,
            "failed {after:?} after the stop ({err}); the promise is {TIMEOUT_MS} ms + 1 s"
        );
    }
    // The target is back: a fresh request moves and its bytes are verified.
    let back = engine.allocate(PIECE as usize, Location::Any).unwrap();
    // SAFETY: nothing is in flight on `local` any more: every batch finished or failed.
    let src = unsafe { &mut local.as_mut_slice()[..PIECE as usize] };
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let tcp = |r: Request| Request {
        transport: Some(TransportChoice::Tcp),
        ..r
    };
    for r in [
        tcp(Request::write(local.addr(), seg, remote, PIECE)),
        tcp(Request::read(back.addr(), seg, remote, PIECE)),
    ] {
        let b = engine.allocate_batch(1).unwrap();
        engine.submit(b, &[r]).unwrap();
        engine.wait(b, Some(Duration::from_secs(30))).unwrap();
        engine.free_batch(b).unwrap();
    }
    // SAFETY: both transfers finished.
    unsafe {
        assert!(back.as_slice() == &local.as_slice()[..PIECE as usize]);
    }
}

#[test]
fn stopped_peer_fails_within_the_timeout_with_no_retries() {
    stopped_peer_fails_in_time(Some(0));
}

#[test]
fn stopped_peer_fails_within_the_timeout_with_two_retries() {
    stopped_peer_fails_in_time(Some(2));
}

#[test]
fn stopped_peer_fails_within_the_timeout_with_the_default_retries() {
    stopped_peer_fails_in_time(None);
}

/// `multirail bench --target` against a target stopped mid-run exits 1 within the timeout
/// (+ 1 s) of the stop, naming the timeout.
#[test]
fn bench_against_a_stopped_target_exits_in_time() {
    let target = TargetProcess::start("64MiB", None);
    let conf = format!(
        r#"{{"transports": {{"tcp": {{"timeout_ms": {TIMEOUT_MS}, "connect_timeout_ms": 1000}}}}}}"#
    );
    let mut bench = std::process::Command::new(env!("CARGO_BIN_EXE_multirail"))
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
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
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
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no answer"), "{stderr}");
    assert!(
        took <= Duration::from_millis(TIMEOUT_MS) + SLACK,
        "bench exited {took:?} after the stop"
    );
    eprintln!("bench exited {took:?} after the stop");
}
