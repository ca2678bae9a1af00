//! The shared lane over shm under dynamic lanes: one multi-producer ring per receiver that
//! every sender on the lane writes into. Many senders' messages of every size arrive in order
//! and exactly once, the receiver's memory stays the same whatever the number of senders, a
//! full ring holds senders back until the receiver takes messages in (and times them out), and
//! a sender that leaves has everything it sent delivered.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use multirail::{Config, Engine, Lane};

/// Lanes stay shared: the receiver grants no dedicated lane (`max_dedicated` 0).
fn engine(extra_shm: &str, timeout_ms: u64) -> Engine {
    let json = format!(
        r#"{{"transport": "shm", "lanes": {{"max_dedicated": 0}},
            "transports": {{"tcp": {{"timeout_ms": {timeout_ms}}}, "shm": {{"receive": {{{extra_shm}}}}}}}}}"#
    );
    Engine::new(
        Config::from_json_str(&json, "test").expect("valid config"),
        "127.0.0.1:0",
    )
    .expect("engine")
}

/// Message `n` of sender `s`: its length cycles through sizes that take one unit of the ring,
/// several, and the largest message, and its bytes name both.
fn message(s: u8, n: u32) -> Vec<u8> {
    const SIZES: [usize; 9] = [4, 0, 47, 48, 49, 128, 500, 3000, 8192];
    let len = SIZES[n as usize % SIZES.len()];
    let mut m: Vec<u8> = (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(n) as u8 ^ s)
        .collect();
    if len >= 4 {
        m[..4].copy_from_slice(&n.to_le_bytes());
    }
    m
}

#[test]
fn every_shm_sender_on_the_shared_lane_writes_into_one_ring() {
    const SENDERS: u8 = 6;
    const EACH: u32 = 3000;
    let rx = engine("", 5000);
    let first = engine("", 5000);
    let seg = first.open_segment(&rx.name()).unwrap();
    first.send(seg, b"hello").unwrap();
    let m = rx.recv(Some(Duration::from_secs(5))).unwrap().unwrap();
    assert_eq!(m.data, b"hello");
    let memory_one_sender = rx.lanes().receive_bytes;
    assert!(memory_one_sender > 0);

    let mut who_is = std::collections::HashMap::new();
    let senders: Vec<_> = (0..SENDERS)
        .map(|s| {
            let e = engine("", 5000);
            who_is.insert(e.name(), s);
            let seg = e.open_segment(&rx.name()).unwrap();
            thread::spawn(move || {
                for n in 0..EACH {
                    e.send(seg, &message(s, n)).expect("send");
                }
                e
            })
        })
        .collect();
    let mut next = std::collections::HashMap::<String, (u8, u32)>::new();
    let mut got = 0u32;
    while got < SENDERS as u32 * EACH {
        let m = rx
            .recv(Some(Duration::from_secs(10)))
            .unwrap()
            .expect("a message within 10 s");
        let who = m.from.to_string();
        let s = *who_is.get(&who).expect("a known sender");
        let entry = next.entry(who.clone()).or_insert((s, 0));
        let n = entry.1;
        assert_eq!(
            m.data,
            message(entry.0, n),
            "message {n} from {who} wrong or out of order"
        );
        entry.1 += 1;
        got += 1;
    }
    let engines: Vec<Engine> = senders.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(next.values().all(|&(_, n)| n == EACH), "{next:?}");
    assert!(
        rx.recv(Some(Duration::from_millis(100))).unwrap().is_none(),
        "a message twice"
    );
    let report = rx.lanes();
    assert!(
        report.incoming.iter().all(|p| p.lane == Lane::Shared),
        "{report:?}"
    );
    assert_eq!(
        report.receive_bytes, memory_one_sender,
        "receive memory grew with the senders"
    );
    drop(engines);
}

#[test]
fn a_full_shared_ring_holds_senders_until_the_receiver_takes_messages() {
    // Two 8 KiB buffers: the ring holds a few of the largest messages.
    let rx = engine(r#""queue_depth": 2"#, 5000);
    let tx = engine(r#""queue_depth": 2"#, 5000);
    let seg = tx.open_segment(&rx.name()).unwrap();
    let (sent, sent_rx) = mpsc::channel();
    let sender = thread::spawn(move || {
        for n in 0..40u32 {
            let mut m = vec![n as u8; 8192];
            m[..4].copy_from_slice(&n.to_le_bytes());
            tx.send(seg, &m).expect("send");
            sent.send(n).unwrap();
        }
        tx
    });
    let mut placed = 0;
    while sent_rx.recv_timeout(Duration::from_millis(500)).is_ok() {
        placed += 1;
    }
    assert!(
        (2..40).contains(&placed),
        "{placed} of 40 largest messages placed in a ring of two buffers' bytes"
    );
    for n in 0..40u32 {
        let m = rx
            .recv(Some(Duration::from_secs(5)))
            .unwrap()
            .expect("message");
        assert_eq!(&m.data[..4], &n.to_le_bytes());
        assert!(m.data[4..].iter().all(|&b| b == n as u8));
    }
    sender.join().unwrap();
}

#[test]
fn a_sender_facing_a_full_shared_ring_times_out() {
    let rx = engine(r#""queue_depth": 2"#, 200);
    let tx = engine(r#""queue_depth": 2"#, 200);
    let seg = tx.open_segment(&rx.name()).unwrap();
    let m = vec![7u8; 8192];
    let mut result = Ok(());
    for _ in 0..40 {
        result = tx.send(seg, &m);
        if result.is_err() {
            break;
        }
    }
    let e = result.expect_err("a full ring times the sender out");
    assert!(matches!(e, multirail::Error::Timeout { .. }), "{e}");
    drop(rx);
}

#[test]
fn senders_that_leave_the_shared_lane_have_everything_delivered() {
    let rx = engine("", 5000);
    for round in 0..3u32 {
        let tx = engine("", 5000);
        let seg = tx.open_segment(&rx.name()).unwrap();
        for n in 0..300u32 {
            tx.send(seg, &message(round as u8, n)).unwrap();
        }
        let name = tx.name();
        drop(tx);
        for n in 0..300u32 {
            let m = rx
                .recv(Some(Duration::from_secs(5)))
                .unwrap()
                .expect("message");
            assert_eq!(m.from.as_ref(), name);
            assert_eq!(m.data, message(round as u8, n), "round {round} message {n}");
        }
        // Its connection ends once everything is taken in.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while rx.lanes().incoming.iter().any(|p| p.peer == name) {
            assert!(std::time::Instant::now() < deadline, "{name} still listed");
            let _ = rx.recv(Some(Duration::from_millis(10)));
        }
    }
}
