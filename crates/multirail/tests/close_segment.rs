//! Closing a segment closes this engine's connections to it, and shutting an engine down closes
//! its message connections too: a serving stack that drops a remote agent must not leave
//! sockets behind at the peer.

use std::time::{Duration, Instant};

use multirail::{Config, Engine, Location, Request};

fn engine() -> Engine {
    let config = Config::from_json_str(r#"{"transport": "tcp"}"#, "test").unwrap();
    Engine::new(config, "127.0.0.1:0").unwrap()
}

/// Waits until `target` holds `want` connections; returns how many it held last.
fn settle_open(target: &Engine, want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let open = target.connection_stats().open;
        if open == want || Instant::now() > deadline {
            return open;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Opens `target`, moves bytes and sends a message and a notification: data and message
/// connections are then open at the target.
fn use_it(init: &Engine, target: &Engine) -> multirail::SegmentId {
    let remote = target.allocate(1 << 20, Location::Any).unwrap();
    let src = init.allocate(1 << 20, Location::Any).unwrap();
    let seg = init.open_segment(&target.name()).unwrap();
    let batch = init.allocate_batch(1).unwrap();
    init.submit(
        batch,
        &[Request::write(src.addr(), seg, remote.addr(), 1 << 20)],
    )
    .unwrap();
    init.wait(batch, Some(Duration::from_secs(10))).unwrap();
    init.free_batch(batch).unwrap();
    init.send(seg, b"hello").unwrap();
    init.send_notification(seg, "done").unwrap();
    seg
}

#[test]
fn closing_a_segment_closes_every_connection_to_it() {
    let (init, target) = (engine(), engine());
    let seg = use_it(&init, &target);
    assert!(target.connection_stats().open > 0);
    init.close_segment(seg).unwrap();
    assert_eq!(settle_open(&target, 0), 0, "connections left at the target");
    // Opened again, it works again.
    let seg = init.open_segment(&target.name()).unwrap();
    init.send(seg, b"again").unwrap();
    let got = target.recv(Some(Duration::from_secs(5))).unwrap();
    assert!(got.is_some());
}

#[test]
fn shutting_down_closes_message_connections_while_handles_live() {
    let (init, target) = (engine(), engine());
    use_it(&init, &target);
    // A clone held elsewhere (a batch, a prepared list in a binding) keeps the engine alive.
    let clone = init.clone();
    init.shutdown();
    assert_eq!(
        settle_open(&target, 0),
        0,
        "connections left after shutdown"
    );
    drop(clone);
}

/// A transfer in flight when its engine shuts down fails with that reason, not with its rails
/// "down" (they were closed on purpose).
#[test]
fn a_transfer_cut_short_by_shutdown_says_so() {
    let (init, target) = (engine(), engine());
    let remote = target.allocate(256 << 20, Location::Any).unwrap();
    let src = init.allocate(256 << 20, Location::Any).unwrap();
    let seg = init.open_segment(&target.name()).unwrap();
    let reqs: Vec<Request> = (0..16u64)
        .map(|i| {
            Request::write(
                src.addr() + i * (16 << 20),
                seg,
                remote.addr() + i * (16 << 20),
                16 << 20,
            )
        })
        .collect();
    let batch = init.allocate_batch(reqs.len()).unwrap();
    init.submit(batch, &reqs).unwrap();
    init.shutdown();
    // 256 MiB over loopback takes tens of ms; the shutdown comes microseconds after the submit.
    let text = init
        .wait(batch, Some(Duration::from_secs(10)))
        .expect_err("the transfer was cut short")
        .to_string();
    assert!(text.contains("engine shut down"), "{text}");
    assert!(!text.contains("is down"), "{text}");
}

/// Shutting an engine down ends the waits of its receivers, with nothing: no message can
/// arrive any more, and a thread blocked in `recv` without a timeout must not block forever.
#[test]
fn shutting_down_ends_a_receive_waiting_without_a_timeout() {
    for transport in ["tcp", "shm"] {
        let config =
            Config::from_json_str(&format!(r#"{{"transport": "{transport}"}}"#), "t").unwrap();
        let (rx, tx) = (
            Engine::new(config.clone(), "127.0.0.1:0").unwrap(),
            Engine::new(config, "127.0.0.1:0").unwrap(),
        );
        let seg = tx.open_segment(&rx.name()).unwrap();
        tx.send(seg, b"first").unwrap();
        let first = rx.recv(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(first.expect("the first message").data, b"first");
        let waiters: Vec<_> = (0..3)
            .map(|i| {
                let rx = rx.clone();
                std::thread::spawn(move || {
                    if i == 0 {
                        rx.wait_notifications(None).len()
                    } else {
                        usize::from(rx.recv(None).unwrap().is_some())
                    }
                })
            })
            .collect();
        // Asleep on the doorbell, and the others waiting for the sleeper.
        std::thread::sleep(Duration::from_millis(300));
        let shut = Instant::now();
        rx.shutdown();
        for w in waiters {
            assert_eq!(w.join().unwrap(), 0, "{transport}: nothing arrived");
        }
        let took = shut.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "{transport}: the waits ended {took:?} after the shutdown"
        );
    }
}
