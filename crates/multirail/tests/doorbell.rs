//! A waiting `recv` stops spinning and sleeps on the doorbell: it still gets every message, on
//! every lane kind (tcp, shm with a ring per sender, the shared shm ring), with no wakeup lost
//! while senders and the receiver keep alternating between sleep and work; timeouts hold.
//! Behaviour only: how fast a sleeping receiver wakes is `multirail pingpong --gap-ms`'s to
//! measure.

use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use multirail::{Config, Engine};

/// Held by each test for its whole run: these tests time sleeps and wake-ups, and the one that
/// checks a receiver anticipates a steady cadence saw its gaps made uneven, and anticipated
/// nothing, while the file's stress test ran beside it on a 2-core host.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    // A test that failed holding it leaves it poisoned; the others still run, one at a time.
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The lane kinds: transport and whether dynamic lanes are on (shm's shared lane is then the
/// shared ring; without them each sender has a ring of its own).
const LANES: [(&str, &str, bool); 3] = [
    ("tcp", "tcp", true),
    ("shm ring per sender", "shm", false),
    ("shm shared ring", "shm", true),
];

fn engine(transport: &str, dynamic: bool, spin_us: u64) -> Engine {
    engine_with_lead(transport, dynamic, spin_us, 200)
}

/// [`engine`] with `cadence_lead_us` set on every transport.
fn engine_with_lead(transport: &str, dynamic: bool, spin_us: u64, lead_us: u64) -> Engine {
    let receive = format!(r#"{{"spin_us": {spin_us}, "cadence_lead_us": {lead_us}}}"#);
    let json = format!(
        r#"{{"transport": "{transport}", "lanes": {{"dynamic": {dynamic}}},
            "transports": {{"tcp": {{"receive": {receive}}}, "shm": {{"receive": {receive}}},
                            "rdma": {{"receive": {receive}}}}}}}"#
    );
    let config = Config::from_json_str(&json, "test").expect("valid config");
    Engine::new(config, "127.0.0.1:0").expect("engine")
}

/// The bytes of message `i` of sender `s`: its numbers, then a pattern; 8 to ~1 KiB long, so
/// some travel inside a shm completion slot and some in a buffer.
fn message(s: u64, i: u64) -> Vec<u8> {
    let len = 16 + ((i * 37 + s * 11) % 1000) as usize;
    let mut m: Vec<u8> = (0..len).map(|k| (k as u64 ^ i ^ (s << 3)) as u8).collect();
    m[..8].copy_from_slice(&s.to_le_bytes());
    m[8..16].copy_from_slice(&i.to_le_bytes());
    m
}

/// Receives messages 0..`n` of sender `s` on `rx`, each within 20 s and with its bytes, in
/// order; panics naming the lane kind `name` otherwise.
fn receive_in_order(rx: &Engine, name: &str, s: u64, n: u64) {
    for i in 0..n {
        let m = rx
            .recv(Some(Duration::from_secs(20)))
            .unwrap()
            .unwrap_or_else(|| panic!("{name}: message {i} of sender {s} never came"));
        assert_eq!(m.data, message(s, i), "{name}: message {i} of sender {s}");
    }
}

#[test]
fn a_receiver_asleep_on_the_doorbell_wakes_and_gets_the_message() {
    let _alone = one_at_a_time();
    for (name, transport, dynamic) in LANES {
        // No spin: every wait sleeps at once.
        let rx = engine(transport, dynamic, 0);
        let tx = engine(transport, dynamic, 0);
        let rx_name = rx.name();
        let sender = thread::spawn(move || {
            // The receiver is asleep before the connection exists, then again between messages.
            thread::sleep(Duration::from_millis(100));
            let seg = tx.open_segment(&rx_name).unwrap();
            for i in 0..3 {
                tx.send(seg, &message(0, i)).unwrap();
                thread::sleep(Duration::from_millis(50));
            }
            tx
        });
        receive_in_order(&rx, name, 0, 3);
        let tx = sender.join().unwrap();
        assert!(rx.recv(Some(Duration::ZERO)).unwrap().is_none(), "{name}");
        let slept = rx.message_stats().recv_sleeps;
        assert!(slept >= 3, "{name}: the receiver slept {slept} times");
        drop(tx);
    }
}

#[test]
fn no_wakeup_is_lost_while_senders_and_receiver_keep_sleeping_and_waking() {
    let _alone = one_at_a_time();
    const SENDERS: u64 = 2;
    const PER_SENDER: u64 = 1500;
    for (name, transport, dynamic) in LANES {
        // A spin of a few µs: the receiver goes to sleep between most messages, and a message
        // often lands just as it does.
        let rx = engine(transport, dynamic, 3);
        let start = Arc::new(Barrier::new(SENDERS as usize + 1));
        let senders: Vec<_> = (0..SENDERS)
            .map(|s| {
                let tx = engine(transport, dynamic, 3);
                let rx_name = rx.name();
                let start = start.clone();
                thread::spawn(move || {
                    let seg = tx.open_segment(&rx_name).unwrap();
                    start.wait();
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ s;
                    for i in 0..PER_SENDER {
                        tx.send(seg, &message(s, i)).unwrap();
                        // Pauses of 0 to ~200 µs, sleeping or spinning: around the receiver's
                        // spin, and around the time it takes to fall asleep.
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        match x % 4 {
                            0 => {}
                            1 => thread::yield_now(),
                            2 => thread::sleep(Duration::from_micros(x % 200)),
                            _ => {
                                let t = Instant::now();
                                while t.elapsed() < Duration::from_micros(x % 50) {
                                    std::hint::spin_loop();
                                }
                            }
                        }
                    }
                    tx
                })
            })
            .collect();
        start.wait();
        let mut next = [0u64; SENDERS as usize];
        for n in 0..SENDERS * PER_SENDER {
            let m = rx
                .recv(Some(Duration::from_secs(20)))
                .unwrap()
                .unwrap_or_else(|| panic!("{name}: message {n} lost, a wakeup missed"));
            let s = u64::from_le_bytes(m.data[..8].try_into().unwrap());
            let i = u64::from_le_bytes(m.data[8..16].try_into().unwrap());
            assert!(s < SENDERS, "{name}: sender {s}");
            assert_eq!(
                i, next[s as usize],
                "{name}: sender {s}'s messages in order"
            );
            assert_eq!(m.data, message(s, i), "{name}: bytes of message {i} of {s}");
            next[s as usize] += 1;
        }
        let engines: Vec<Engine> = senders.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(next, [PER_SENDER; SENDERS as usize], "{name}");
        assert!(rx.recv(Some(Duration::from_millis(20))).unwrap().is_none());
        let stats = rx.message_stats();
        assert_eq!(stats.received, SENDERS * PER_SENDER, "{name}");
        assert!(
            stats.recv_sleeps >= PER_SENDER / 10,
            "{name}: only {} sleeps: the stress did not make the receiver sleep",
            stats.recv_sleeps
        );
        drop(engines);
    }
}

#[test]
fn a_sleeping_receive_keeps_its_timeout() {
    let _alone = one_at_a_time();
    for (name, transport, dynamic) in LANES {
        for spin_us in [0, 200] {
            let rx = engine(transport, dynamic, spin_us);
            let tx = engine(transport, dynamic, spin_us);
            // A connection to sleep on, and nothing on it.
            let seg = tx.open_segment(&rx.name()).unwrap();
            tx.send(seg, b"first").unwrap();
            assert_eq!(
                rx.recv(Some(Duration::from_secs(20)))
                    .unwrap()
                    .unwrap()
                    .data,
                b"first"
            );
            for timeout in [
                Duration::ZERO,
                Duration::from_millis(1),
                Duration::from_millis(80),
            ] {
                let t = Instant::now();
                assert!(rx.recv(Some(timeout)).unwrap().is_none(), "{name}");
                let took = t.elapsed();
                assert!(
                    took >= timeout,
                    "{name}: {timeout:?} wait ended after {took:?}"
                );
                assert!(
                    took < timeout + Duration::from_secs(5),
                    "{name}: {timeout:?} wait ended only after {took:?}"
                );
            }
            assert!(rx.message_stats().recv_sleeps >= 1, "{name}");
            // Still awake to what comes after the timeouts.
            tx.send(seg, b"after").unwrap();
            assert_eq!(
                rx.recv(Some(Duration::from_secs(20)))
                    .unwrap()
                    .unwrap()
                    .data,
                b"after"
            );
        }
    }
}

#[test]
fn two_threads_waiting_on_one_engine_both_get_messages() {
    let _alone = one_at_a_time();
    for (name, transport, dynamic) in LANES {
        let rx = engine(transport, dynamic, 0);
        let tx = engine(transport, dynamic, 0);
        let seg = tx.open_segment(&rx.name()).unwrap();
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let rx = rx.clone();
                thread::spawn(move || rx.recv(Some(Duration::from_secs(20))).unwrap())
            })
            .collect();
        // Both asleep (one on the doorbell, one behind it), then two messages.
        thread::sleep(Duration::from_millis(100));
        tx.send(seg, b"one").unwrap();
        thread::sleep(Duration::from_millis(20));
        tx.send(seg, b"two").unwrap();
        let mut got: Vec<Vec<u8>> = waiters
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap()
                    .unwrap_or_else(|| panic!("{name}: a waiter starved"))
                    .data
            })
            .collect();
        got.sort();
        assert_eq!(got, [b"one".to_vec(), b"two".to_vec()], "{name}");
    }
}

#[test]
fn a_notification_wait_sleeps_wakes_on_each_notification_and_leaves_messages_to_recv() {
    let _alone = one_at_a_time();
    for (name, transport, dynamic) in LANES {
        let rx = engine(transport, dynamic, 0);
        let tx = engine(transport, dynamic, 0);
        // Nothing sent: the wait ends empty at its timeout, having slept.
        let t0 = Instant::now();
        assert!(
            rx.wait_notifications(Some(Duration::from_millis(100)))
                .is_empty(),
            "{name}"
        );
        assert!(
            t0.elapsed() >= Duration::from_millis(100),
            "{name}: woke early"
        );
        let rx_name = rx.name();
        let sender = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            let seg = tx.open_segment(&rx_name).unwrap();
            for i in 0..3u64 {
                // A message before each notification: the notification wait must not return
                // for it, and must not take it.
                tx.send(seg, &message(1, i)).unwrap();
                tx.send_notification(seg, &format!("n{i}")).unwrap();
                thread::sleep(Duration::from_millis(50));
            }
            tx
        });
        let mut got = Vec::new();
        while got.len() < 3 {
            let batch = rx.wait_notifications(Some(Duration::from_secs(20)));
            assert!(
                !batch.is_empty(),
                "{name}: notification {} never woke the wait",
                got.len()
            );
            got.extend(batch.into_iter().map(|n| n.msg));
        }
        assert_eq!(got, ["n0", "n1", "n2"], "{name}");
        for i in 0..3 {
            let m = rx.recv(Some(Duration::from_secs(5))).unwrap();
            assert_eq!(
                m.map(|m| m.data),
                Some(message(1, i)),
                "{name}: message {i}"
            );
        }
        let tx = sender.join().unwrap();
        assert!(rx.message_stats().recv_sleeps >= 3, "{name}");
        drop(tx);
    }
}

/// Messages sent every 50 ms from `tx` to `rx`, on a schedule; the receiver's statistics once
/// all arrived, in order.
fn receive_at_a_cadence(
    name: &str,
    transport: &str,
    dynamic: bool,
    lead_us: u64,
    messages: u64,
) -> multirail::MessageStats {
    let rx = engine_with_lead(transport, dynamic, 50, lead_us);
    let tx = engine_with_lead(transport, dynamic, 50, lead_us);
    let rx_name = rx.name();
    let sender = thread::spawn(move || {
        let seg = tx.open_segment(&rx_name).unwrap();
        let start = Instant::now();
        for i in 0..messages {
            // On a schedule, not after a sleep each: the gaps stay even.
            let due = start + Duration::from_millis(50 * (i + 1));
            thread::sleep(due.saturating_duration_since(Instant::now()));
            tx.send(seg, &message(1, i)).unwrap();
        }
        tx
    });
    receive_in_order(&rx, name, 1, messages);
    let tx = sender.join().unwrap();
    let stats = rx.message_stats();
    assert_eq!(stats.received, messages, "{name}");
    drop(tx);
    stats
}

#[test]
fn a_receiver_of_messages_at_a_steady_cadence_is_polling_when_the_next_one_comes() {
    let _alone = one_at_a_time();
    // One message every 50 ms: after a few gaps the receiver wakes shortly before each is due
    // and polls for it; with the lead at 0 it sleeps until each message wakes it. Every
    // message arrives, in order, either way. A loaded host (CI builds the Python package and
    // boots a VM beside these tests) can make the gaps too uneven to anticipate for a while,
    // so the anticipating receiver is asked for at least one message polled for ahead in up
    // to three rounds.
    const MESSAGES: u64 = 16;
    const ROUNDS: usize = 3;
    for (name, transport, dynamic) in LANES {
        let stats = receive_at_a_cadence(name, transport, dynamic, 0, MESSAGES);
        assert_eq!(
            stats.recv_anticipated, 0,
            "{name}: no lead, no anticipation"
        );
        let mut anticipated = Vec::new();
        for _ in 0..ROUNDS {
            let stats = receive_at_a_cadence(name, transport, dynamic, 500, MESSAGES);
            assert!(
                stats.recv_anticipated < MESSAGES - 3,
                "{name}: the first gaps teach"
            );
            anticipated.push(stats.recv_anticipated);
            if stats.recv_anticipated >= 1 {
                break;
            }
        }
        assert!(
            anticipated.iter().any(|&a| a >= 1),
            "{name}: none of {MESSAGES} messages 50 ms apart was polled for ahead, in {ROUNDS} rounds: {anticipated:?}"
        );
    }
}
