//! Dynamic lanes between engines: the busiest senders negotiate dedicated lanes with the
//! receiver within its `lanes.max_dedicated`, the rest are denied explicitly and lose nothing,
//! and a sender that dies while dedicated frees its lane for another.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use multirail::{Config, Engine, Lane, LanesReport};

/// Every send is sampled, so a sender counts as hot at one message per millisecond, and the
/// test's senders can sleep between messages instead of taking the two cores.
fn config(transport: &str, max_dedicated: usize) -> Config {
    let json = format!(
        r#"{{"transport": "{transport}",
            "lanes": {{"max_dedicated": {max_dedicated}, "sample_period": 1}}}}"#
    );
    Config::from_json_str(&json, "test").expect("valid config")
}

/// A sender sending numbered messages to `to` every 200 µs until told to stop; returns how
/// many it sent.
fn hot_sender(
    engine: Engine,
    to: &str,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<(Engine, u64)> {
    let seg = engine.open_segment(to).expect("open the receiver");
    thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            engine.send(seg, &n.to_le_bytes()).expect("send");
            n += 1;
            thread::sleep(Duration::from_micros(200));
        }
        (engine, n)
    })
}

/// Receives until `stop`, checking every sender's messages arrive in order, each once;
/// returns how many came from each sender.
fn receiver(engine: Engine, stop: Arc<AtomicBool>) -> thread::JoinHandle<HashMap<String, u64>> {
    thread::spawn(move || {
        let mut next: HashMap<String, u64> = HashMap::new();
        loop {
            match engine.recv(Some(Duration::from_millis(20))).expect("recv") {
                Some(m) => {
                    let n = u64::from_le_bytes(m.data[..8].try_into().unwrap());
                    let expected = next.entry(m.from.to_string()).or_insert(0);
                    assert_eq!(n, *expected, "message from {} out of order", m.from);
                    *expected += 1;
                }
                None if stop.load(Ordering::Relaxed) => return next,
                None => {}
            }
        }
    })
}

fn dedicated_incoming(r: &LanesReport) -> usize {
    r.incoming
        .iter()
        .filter(|p| p.lane == Lane::Dedicated)
        .count()
}

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

fn eight_hot_senders_share_four_lanes(transport: &str) {
    let rx = Engine::new(config(transport, 4), "127.0.0.1:0").unwrap();
    let stop_rx = Arc::new(AtomicBool::new(false));
    let receiving = receiver(rx.clone(), stop_rx.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let senders: Vec<_> = (0..8)
        .map(|_| {
            let e = Engine::new(config(transport, 16), "127.0.0.1:0").unwrap();
            (e.clone(), hot_sender(e, &rx.name(), stop.clone()))
        })
        .collect();
    // Every sender is either dedicated or was denied explicitly.
    wait_for(
        "every sender dedicated or denied",
        Duration::from_secs(20),
        || {
            senders.iter().all(|(e, _)| {
                let r = e.lanes();
                r.outgoing.iter().any(|p| p.lane == Lane::Dedicated)
                    || r.requesting.denials_received > 0
            })
        },
    );
    wait_for("four dedicated lanes", Duration::from_secs(20), || {
        dedicated_incoming(&rx.lanes()) == 4
    });
    // Scores have settled (all equally hot): the lanes stay where they are, and the denied
    // senders ask again at most once per back-off (1 s, stretched by up to half).
    let asked: Vec<u64> = senders
        .iter()
        .map(|(e, _)| e.lanes().requesting.requests_sent)
        .collect();
    let settled = rx.lanes().granting;
    thread::sleep(Duration::from_millis(2500));
    let report = rx.lanes();
    assert_eq!(dedicated_incoming(&report), 4, "{report:#?}");
    assert_eq!(
        report.granting.accepts_sent, settled.accepts_sent,
        "{report:#?}"
    );
    assert_eq!(report.granting.evictions, settled.evictions, "{report:#?}");
    let mut dedicated = 0;
    for ((e, _), before) in senders.iter().zip(&asked) {
        let r = e.lanes();
        assert_eq!(r.requesting.timeouts, 0, "{r:#?}");
        if r.outgoing[0].lane == Lane::Dedicated {
            dedicated += 1;
        } else {
            assert!(r.requesting.denials_received > 0, "{r:#?}");
            assert!(r.outgoing[0].denials > 0, "{r:#?}");
            let again = r.requesting.requests_sent - before;
            assert!(again <= 3, "asked {again} times in 2.5 s: {r:#?}");
        }
    }
    assert_eq!(dedicated, 4);
    assert!(report.granting.denials_sent >= 4, "{report:#?}");
    // Nothing lost: every message sent arrived, in order (checked by the receiver).
    stop.store(true, Ordering::Relaxed);
    let sent: Vec<(String, u64)> = senders
        .into_iter()
        .map(|(_, h)| {
            let (e, n) = h.join().unwrap();
            (e.name(), n)
        })
        .collect();
    thread::sleep(Duration::from_millis(200));
    stop_rx.store(true, Ordering::Relaxed);
    let got = receiving.join().unwrap();
    for (name, n) in sent {
        assert_eq!(got.get(&name).copied().unwrap_or(0), n, "from {name}");
    }
}

#[test]
fn eight_hot_senders_share_four_lanes_shm() {
    eight_hot_senders_share_four_lanes("shm");
}

#[test]
fn eight_hot_senders_share_four_lanes_tcp() {
    eight_hot_senders_share_four_lanes("tcp");
}

/// A receiver with room for one dedicated lane: the first hot sender takes it, the second is
/// denied; the first dies (its engine goes without fencing its lane), and the second gets the
/// lane once its back-off ends.
fn a_sender_dying_while_dedicated_frees_its_lane(transport: &str) {
    let rx = Engine::new(config(transport, 1), "127.0.0.1:0").unwrap();
    let stop_rx = Arc::new(AtomicBool::new(false));
    let receiving = receiver(rx.clone(), stop_rx.clone());
    let stop_first = Arc::new(AtomicBool::new(false));
    let first = Engine::new(config(transport, 16), "127.0.0.1:0").unwrap();
    let first_name = first.name();
    let first_sending = hot_sender(first.clone(), &rx.name(), stop_first.clone());
    wait_for(
        "the first sender dedicated",
        Duration::from_secs(20),
        || {
            first
                .lanes()
                .outgoing
                .iter()
                .any(|p| p.lane == Lane::Dedicated)
        },
    );
    let stop = Arc::new(AtomicBool::new(false));
    let second = Engine::new(config(transport, 16), "127.0.0.1:0").unwrap();
    let second_sending = hot_sender(second.clone(), &rx.name(), stop.clone());
    wait_for("the second sender denied", Duration::from_secs(20), || {
        second.lanes().requesting.denials_received > 0
    });
    assert_eq!(second.lanes().outgoing[0].lane, Lane::Shared);
    stop_first.store(true, Ordering::Relaxed);
    let (engine, _) = first_sending.join().unwrap();
    drop(engine);
    drop(first);
    // The sender counts itself dedicated from the switch on; the receiver once the new
    // connection is in.
    wait_for(
        "the second sender dedicated at both ends",
        Duration::from_secs(20),
        || {
            second.lanes().outgoing[0].lane == Lane::Dedicated
                && dedicated_incoming(&rx.lanes()) == 1
        },
    );
    let report = rx.lanes();
    assert_eq!(report.granting.peers_gone, 1, "{report:#?}");
    assert!(
        report.incoming.iter().all(|p| p.peer != first_name),
        "{report:#?}"
    );
    assert_eq!(dedicated_incoming(&report), 1, "{report:#?}");
    stop.store(true, Ordering::Relaxed);
    second_sending.join().unwrap();
    stop_rx.store(true, Ordering::Relaxed);
    receiving.join().unwrap();
}

#[test]
fn a_sender_dying_while_dedicated_frees_its_lane_shm() {
    a_sender_dying_while_dedicated_frees_its_lane("shm");
}

#[test]
fn a_sender_dying_while_dedicated_frees_its_lane_tcp() {
    a_sender_dying_while_dedicated_frees_its_lane("tcp");
}

/// A receiver that is not polling (busy elsewhere) still takes the shared lane's messages in
/// as they come: its lanes thread waits on the shared lane's connections and reads them into
/// the shared pool, granting credits, so a sender on the shared lane is not held to the one
/// credit a new connection starts with until the application polls. Every message arrives
/// once and in order when it does.
#[test]
fn a_receiver_that_is_not_polling_still_takes_in_the_shared_tcp_lane() {
    burst_to_a_receiver_not_polling(false);
}

/// The same when the receiver polled until just before (its lanes thread leaves the shared lane
/// to a receiver that polls) and then stopped: the lanes thread takes the lane over within a
/// pass, in time for a new sender, who starts with one credit.
#[test]
fn a_receiver_that_stops_polling_still_takes_in_the_shared_tcp_lane() {
    burst_to_a_receiver_not_polling(true);
}

/// A new sender sends a burst on the shared tcp lane to a receiver that does not poll meanwhile
/// (after taking an earlier sender's 200 messages in a receive loop when `polled_before`); then
/// the receiver takes every message, in order.
fn burst_to_a_receiver_not_polling(polled_before: bool) {
    let json = r#"{"transport": "tcp", "transports": {"tcp": {"timeout_ms": 2000}}}"#;
    let engine = || Engine::new(Config::from_json_str(json, "t").unwrap(), "127.0.0.1:0").unwrap();
    let rx = engine();
    let take = |n: u64| {
        let m = rx
            .recv(Some(Duration::from_secs(5)))
            .unwrap()
            .expect("a message");
        assert_eq!(u64::from_le_bytes(m.data[..8].try_into().unwrap()), n);
    };
    if polled_before {
        let earlier = engine();
        let seg = earlier.open_segment(&rx.name()).unwrap();
        for n in 0..200u64 {
            earlier.send(seg, &n.to_le_bytes()).unwrap();
            take(n);
        }
    }
    let tx = engine();
    let seg = tx.open_segment(&rx.name()).unwrap();
    // Fewer than the shared pool's buffers (64): they all fit before the application takes one.
    let count = 48u64;
    for n in 0..count {
        tx.send(seg, &n.to_le_bytes())
            .unwrap_or_else(|e| panic!("send {n} to a receiver that is not polling: {e}"));
    }
    assert_eq!(tx.lanes().outgoing[0].lane, Lane::Shared);
    for n in 0..count {
        take(n);
    }
    assert!(rx.recv(Some(Duration::from_millis(50))).unwrap().is_none());
}

/// The system call number each of this process's lanes threads is in now (`None`: running).
fn lanes_thread_syscalls() -> Vec<Option<i64>> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != "mr-lanes" {
            continue;
        }
        let now = std::fs::read_to_string(task.path().join("syscall")).unwrap_or_default();
        out.push(now.split_whitespace().next().and_then(|n| n.parse().ok()));
    }
    out
}

/// While the application takes the shared tcp lane's messages itself (it polls in `recv`, or
/// sleeps on its doorbell, which the lane's connections ring), its lanes thread does not wait
/// on the lane's connections: a thread waiting there is woken by every message that comes,
/// in the sender's system call, for nothing. It waits there again once the application stops
/// receiving.
///
/// It runs in a child process of its own (this test binary again, with only this test), so
/// that the only lanes threads in sight are its engine's.
#[test]
fn the_lanes_thread_leaves_the_shared_lane_to_a_receiving_application() {
    const ALONE: &str = "MULTIRAIL_TEST_LANES_THREAD_ALONE";
    const NAME: &str = "the_lanes_thread_leaves_the_shared_lane_to_a_receiving_application";
    if std::env::var_os(ALONE).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env(ALONE, "1")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let ppoll = libc::SYS_ppoll;
    for spin_us in [0u64, 1_000_000] {
        // The previous engine's lanes thread ends at its next pass (within 160 ms).
        let gone = Instant::now() + Duration::from_secs(5);
        while !lanes_thread_syscalls().is_empty() {
            assert!(
                Instant::now() < gone,
                "a dropped engine's lanes thread is still running"
            );
            thread::sleep(Duration::from_millis(10));
        }
        let json = format!(
            r#"{{"transport": "tcp", "transports": {{"tcp": {{"receive": {{"spin_us": {spin_us}, "adaptive_spin": false}}}}}}}}"#
        );
        let rx = Arc::new(
            Engine::new(Config::from_json_str(&json, "t").unwrap(), "127.0.0.1:0").unwrap(),
        );
        let how = if spin_us == 0 {
            "asleep on the doorbell"
        } else {
            "polling"
        };
        // Nothing receiving: the lanes thread waits on the shared lane.
        let mut waited_there = false;
        for _ in 0..100 {
            thread::sleep(Duration::from_millis(10));
            let now = lanes_thread_syscalls();
            assert_eq!(now.len(), 1, "one engine, one lanes thread");
            waited_there |= now[0] == Some(ppoll);
        }
        assert!(
            waited_there,
            "with nothing receiving the lanes thread never waited on the shared lane"
        );
        let receiver = {
            let rx = rx.clone();
            thread::spawn(move || rx.recv(Some(Duration::from_millis(1500))).unwrap())
        };
        // Every pass of the lanes thread ends within 8 ticks (at most 160 ms).
        thread::sleep(Duration::from_millis(400));
        for _ in 0..50 {
            let now = lanes_thread_syscalls();
            assert_ne!(
                now[0],
                Some(ppoll),
                "the lanes thread waits on the shared lane while the application receives ({how})"
            );
            thread::sleep(Duration::from_millis(10));
        }
        assert!(receiver.join().unwrap().is_none());
    }
}
