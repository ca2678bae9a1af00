//! Two-sided messages and notifications over tcp and shm: order, exactly-once delivery across
//! processes, credits, batch notifications after the data, and the receive settings.

use std::process::Command;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use multirail::{Config, Engine, Location, Request};

const CHILD_ENV: &str = "MULTIRAIL_MSG_CHILD";

fn config(transport: &str, receive: &str) -> Config {
    let json = format!(
        r#"{{"transport": "{transport}",
            "transports": {{"tcp": {{"receive": {receive}}}, "shm": {{"receive": {receive}}}}}}}"#
    );
    Config::from_json_str(&json, "test").expect("valid config")
}

fn pair(transport: &str, receive: &str) -> (Engine, Engine) {
    let a = Engine::new(config(transport, receive), "127.0.0.1:0").unwrap();
    let b = Engine::new(config(transport, receive), "127.0.0.1:0").unwrap();
    (a, b)
}

fn in_order(transport: &str, receive: &str) {
    let (a, b) = pair(transport, receive);
    let seg = a.open_segment(&b.name()).unwrap();
    let n = 20_000u64;
    let sender = {
        let a = a.clone();
        thread::spawn(move || {
            for i in 0..n {
                // 8 to 255 bytes: below and above the 240 that shared memory carries inside a
                // completion slot, and within the 256-byte buffers of one case.
                let len = 8 + (i % 248) as usize;
                let mut m = vec![(i % 251) as u8; len];
                m[..8].copy_from_slice(&i.to_le_bytes());
                a.send(seg, &m).unwrap();
            }
        })
    };
    for i in 0..n {
        let m = b
            .recv(Some(Duration::from_secs(10)))
            .unwrap()
            .expect("message in time");
        assert_eq!(&*m.from, a.name());
        assert_eq!(u64::from_le_bytes(m.data[..8].try_into().unwrap()), i);
        assert_eq!(m.data.len(), 8 + (i % 248) as usize);
        assert!(m.data[8..].iter().all(|&x| x == (i % 251) as u8));
    }
    sender.join().unwrap();
    assert!(b.recv(Some(Duration::from_millis(50))).unwrap().is_none());
}

#[test]
fn messages_arrive_in_order_tcp() {
    in_order("tcp", "{}");
}

#[test]
fn messages_arrive_in_order_shm() {
    in_order("shm", "{}");
}

#[test]
fn messages_arrive_in_order_with_every_knob_turned() {
    let knobs = r#"{"queue_depth": 16, "shared_receive_queue": true, "registration_chunks": 4,
                   "max_sge": 2, "buffer_size": 256, "return_policy": "bulk",
                   "return_order": "after_reply"}"#;
    in_order("tcp", knobs);
    in_order("shm", knobs);
    in_order("tcp", r#"{"queue_depth": 1}"#);
    in_order("shm", r#"{"queue_depth": 1, "return_policy": "bulk"}"#);
}

#[test]
fn oversized_message_is_refused() {
    let (a, b) = pair("tcp", r#"{"buffer_size": 64}"#);
    let seg = a.open_segment(&b.name()).unwrap();
    let e = a.send(seg, &[0u8; 65]).unwrap_err();
    assert!(e.to_string().contains("bytes"), "{e}");
    a.send(seg, &[1u8; 64]).unwrap();
    assert_eq!(
        b.recv(Some(Duration::from_secs(5))).unwrap().unwrap().data,
        vec![1u8; 64]
    );
}

/// A sender on a receive queue of its own (lanes fixed: the shared lane's pool hands out
/// credits as a sender uses them, see `lanes_start_small_on_the_shared_pool`).
fn credits_block_then_resume(transport: &str) {
    let fixed = |t: &str| {
        let json = format!(
            r#"{{"transport": "{t}", "lanes": {{"dynamic": false}},
                "transports": {{"tcp": {{"receive": {{"queue_depth": 4}}}}, "shm": {{"receive": {{"queue_depth": 4}}}}}}}}"#
        );
        Engine::new(Config::from_json_str(&json, "test").unwrap(), "127.0.0.1:0").unwrap()
    };
    let (a, b) = (fixed(transport), fixed(transport));
    let seg = a.open_segment(&b.name()).unwrap();
    let (tx, rx) = mpsc::channel();
    let sender = {
        let a = a.clone();
        thread::spawn(move || {
            for i in 0u8..6 {
                a.send(seg, &[i]).unwrap();
                tx.send(i).unwrap();
            }
        })
    };
    for i in 0u8..4 {
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), i);
    }
    // Four buffers, four messages: the fifth waits for a credit.
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "sent without a credit"
    );
    let m = b.recv(Some(Duration::from_secs(5))).unwrap().unwrap();
    assert_eq!(m.data, [0]);
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 4);
    for i in 1u8..6 {
        assert_eq!(
            b.recv(Some(Duration::from_secs(5))).unwrap().unwrap().data,
            [i]
        );
    }
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 5);
    sender.join().unwrap();
}

#[test]
fn exhausted_credits_block_the_sender_until_buffers_return_tcp() {
    credits_block_then_resume("tcp");
}

#[test]
fn exhausted_credits_block_the_sender_until_buffers_return_shm() {
    credits_block_then_resume("shm");
}

/// On the shared lane a new sender starts with one credit and is granted more as it spends
/// them. While the application does not poll, the lanes thread takes the lane's messages in
/// (granting as they land) until the shared pool is full: a burst to a receiver that is not
/// polling stops at the pool's depth, not at the first message, and every message arrives in
/// order once it polls.
#[test]
fn a_burst_to_a_receiver_not_polling_stops_at_the_shared_pools_depth() {
    let (a, b) = pair("tcp", r#"{"queue_depth": 8}"#);
    let seg = a.open_segment(&b.name()).unwrap();
    let (tx, rx) = mpsc::channel();
    let sender = {
        let a = a.clone();
        thread::spawn(move || {
            for i in 0u8..20 {
                a.send(seg, &[i]).unwrap();
                tx.send(i).unwrap();
            }
        })
    };
    for i in 0u8..8 {
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), i);
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "a ninth message with the eight buffers full"
    );
    for i in 0u8..20 {
        assert_eq!(
            b.recv(Some(Duration::from_secs(5))).unwrap().unwrap().data,
            [i]
        );
    }
    sender.join().unwrap();
}

/// A receiver that takes nothing in: the sender's send times out once the room the receiver
/// gives it is used up, with an error that says why, and every message sent before it is
/// still delivered, in order, once the receiver calls `recv`.
fn a_sender_without_room_times_out(transport: &str) {
    let json = format!(
        r#"{{"transport": "{transport}", "lanes": {{"dynamic": false}},
            "transports": {{"tcp": {{"timeout_ms": 200, "receive": {{"queue_depth": 2}}}},
                            "shm": {{"receive": {{"queue_depth": 2}}}}}}}}"#
    );
    let a = Engine::new(Config::from_json_str(&json, "t").unwrap(), "127.0.0.1:0").unwrap();
    let b = Engine::new(Config::from_json_str(&json, "t").unwrap(), "127.0.0.1:0").unwrap();
    let seg = a.open_segment(&b.name()).unwrap();
    let mut sent = 0u32;
    let e = loop {
        match a.send(seg, &sent.to_le_bytes()) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(
            sent < 100_000,
            "a receiver taking nothing in never held the sender back"
        );
    };
    assert!(matches!(e, multirail::Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("not calling recv"), "{e}");
    // At least the receive queue's depth (2) went out before the sender was held back.
    assert!(sent >= 2, "{sent} sent before the timeout");
    for i in 0..sent {
        let m = b.recv(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(
            m.expect("a message sent before the timeout").data,
            i.to_le_bytes()
        );
    }
}

#[test]
fn a_sender_without_credits_times_out() {
    a_sender_without_room_times_out("tcp");
}

#[test]
fn a_sender_without_ring_space_times_out_shm() {
    a_sender_without_room_times_out("shm");
}

fn notification_after_data(transport: &str) {
    let (a, b) = pair(transport, "{}");
    let len = 16 << 20;
    let dst = b.allocate(len, Location::Any).unwrap();
    let src = a.allocate(len, Location::Any).unwrap();
    // SAFETY: nothing transfers into these buffers yet.
    unsafe {
        for (i, x) in src.as_mut_slice().iter_mut().enumerate() {
            *x = (i * 7 % 253) as u8;
        }
    }
    let seg = a.open_segment(&b.name()).unwrap();
    for round in 0..3 {
        let batch = a.allocate_batch(4).unwrap();
        let q = (len / 4) as u64;
        let reqs: Vec<Request> = (0..4)
            .map(|i| Request::write(src.addr() + i * q, seg, dst.addr() + i * q, q))
            .collect();
        a.submit_with_notification(batch, &reqs, &format!("landed {round}"))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let got = loop {
            let n = b.receive_notifications();
            if !n.is_empty() {
                break n;
            }
            assert!(Instant::now() < deadline, "no notification");
            thread::sleep(Duration::from_micros(100));
        };
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].msg, format!("landed {round}"));
        assert_eq!(got[0].from, a.name());
        // SAFETY: the notification says no transfer writes here any more.
        let bytes = unsafe { dst.as_slice() };
        assert_eq!(
            xxhash_rust::xxh3::xxh3_64(bytes),
            xxhash_rust::xxh3::xxh3_64(unsafe { src.as_slice() }),
            "data complete when the notification arrives"
        );
        a.wait(batch, Some(Duration::from_secs(5))).unwrap();
        a.free_batch(batch).unwrap();
        // SAFETY: as above.
        unsafe { dst.as_mut_slice().fill(0) };
    }
}

#[test]
fn batch_notification_arrives_after_the_data_tcp() {
    notification_after_data("tcp");
}

#[test]
fn batch_notification_arrives_after_the_data_shm() {
    notification_after_data("shm");
}

#[test]
fn notifications_and_messages_keep_their_order() {
    for t in ["tcp", "shm"] {
        let (a, b) = pair(t, "{}");
        let seg = a.open_segment(&b.name()).unwrap();
        // 200 sends against 64 buffers: the receiver must consume for the sender to go on.
        let sender = {
            let a = a.clone();
            thread::spawn(move || {
                for i in 0..100 {
                    a.send_notification(seg, &format!("n{i}")).unwrap();
                    a.send(seg, format!("m{i}").as_bytes()).unwrap();
                }
            })
        };
        let mut notes = Vec::new();
        for i in 0..100 {
            let m = b.recv(Some(Duration::from_secs(5))).unwrap().unwrap();
            assert_eq!(m.data, format!("m{i}").as_bytes());
            notes.extend(b.receive_notifications());
        }
        sender.join().unwrap();
        notes.extend(b.receive_notifications());
        let texts: Vec<String> = notes.into_iter().map(|n| n.msg).collect();
        assert_eq!(
            texts,
            (0..100).map(|i| format!("n{i}")).collect::<Vec<_>>(),
            "{t}"
        );
    }
}

#[test]
fn every_bad_receive_setting_names_its_key() {
    let cases = [
        (r#"{"queue_depth": 0}"#, "queue_depth"),
        (r#"{"queue_depth": 2000000}"#, "queue_depth"),
        (r#"{"registration_chunks": 0}"#, "registration_chunks"),
        (
            r#"{"queue_depth": 32, "registration_chunks": 3}"#,
            "registration_chunks",
        ),
        (r#"{"max_sge": 0}"#, "max_sge"),
        (r#"{"max_sge": 33}"#, "max_sge"),
        (r#"{"buffer_size": 0}"#, "buffer_size"),
        (r#"{"return_policy": "sometimes"}"#, "return_policy"),
        (r#"{"return_order": "never"}"#, "return_order"),
        (r#"{"queue_depth": -1}"#, "queue_depth"),
        (r#"{"shared_receive_queue": "yes"}"#, "shared_receive_queue"),
        (r#"{"depth": 4}"#, "depth"),
    ];
    for transport in ["tcp", "shm"] {
        for (receive, key) in cases {
            let json = format!(r#"{{"transports": {{"{transport}": {{"receive": {receive}}}}}}}"#);
            let e = Config::from_json_str(&json, "test").unwrap_err();
            assert_eq!(
                e.key,
                format!("transports.{transport}.receive.{key}"),
                "{json}: {e}"
            );
        }
    }
    let ok = r#"{"transports": {"shm": {"receive": {"queue_depth": 10000, "registration_chunks": 8,
        "shared_receive_queue": true, "return_policy": "bulk", "return_order": "after_reply"}}}}"#;
    Config::from_json_str(ok, "test").unwrap();
}

/// Child side of the cross-process test: sends `MILLION` numbered messages, then waits for the
/// parent's verdict.
#[test]
fn child_process_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (transport, parent) = spec.split_once('|').unwrap();
    let e = Engine::new(config(transport, "{}"), "127.0.0.1:0").unwrap();
    let seg = e.open_segment(parent).unwrap();
    let mut m = [0u8; 16];
    for i in 0..MILLION {
        m[..8].copy_from_slice(&i.to_le_bytes());
        m[8..].copy_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
        e.send(seg, &m).unwrap();
    }
    let verdict = e.recv(Some(Duration::from_secs(120))).unwrap().unwrap();
    assert_eq!(verdict.data, b"ok");
}

const MILLION: u64 = 1_000_000;

fn million_across_processes(transport: &str) {
    let parent = Engine::new(config(transport, "{}"), "127.0.0.1:0").unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_process_entry",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, format!("{transport}|{}", parent.name()))
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut from = None;
    for i in 0..MILLION {
        let m = parent
            .recv(Some(Duration::from_secs(30)))
            .unwrap()
            .unwrap_or_else(|| panic!("message {i} missing"));
        assert_eq!(m.data.len(), 16);
        let seq = u64::from_le_bytes(m.data[..8].try_into().unwrap());
        assert_eq!(seq, i, "FIFO, no loss, no duplicate");
        assert_eq!(
            u64::from_le_bytes(m.data[8..].try_into().unwrap()),
            i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        );
        match &from {
            None => from = Some(m.from),
            Some(f) => assert_eq!(f, &m.from),
        }
    }
    let took = started.elapsed();
    assert!(
        parent
            .recv(Some(Duration::from_millis(200)))
            .unwrap()
            .is_none(),
        "nothing beyond the million"
    );
    let seg = parent.open_segment(&from.unwrap()).unwrap();
    parent.send(seg, b"ok").unwrap();
    assert!(child.wait().unwrap().success());
    eprintln!(
        "{transport}: {MILLION} messages in {:.2} s ({:.2} M msg/s)",
        took.as_secs_f64(),
        MILLION as f64 / took.as_secs_f64() / 1e6
    );
}

#[test]
fn million_messages_fifo_exactly_once_across_processes_tcp() {
    million_across_processes("tcp");
}

#[test]
fn million_messages_fifo_exactly_once_across_processes_shm() {
    million_across_processes("shm");
}

/// Mooncake's `transfer_sync` with a notification waits and frees the batch at once; the
/// notification must still go out after the data.
#[test]
fn batch_notification_survives_an_immediate_free() {
    let (a, b) = pair("tcp", "{}");
    let len = 64 << 10;
    let dst = b.allocate(len, Location::Any).unwrap();
    let src = a.allocate(len, Location::Any).unwrap();
    let seg = a.open_segment(&b.name()).unwrap();
    let rounds = 200;
    for round in 0..rounds {
        let batch = a.allocate_batch(1).unwrap();
        let req = Request::write(src.addr(), seg, dst.addr(), len as u64);
        a.submit_with_notification(batch, &[req], &format!("n{round}"))
            .unwrap();
        a.wait(batch, Some(Duration::from_secs(10))).unwrap();
        a.free_batch(batch).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < rounds && Instant::now() < deadline {
        got.extend(b.receive_notifications().into_iter().map(|n| n.msg));
        thread::sleep(Duration::from_millis(1));
    }
    got.sort();
    let mut want: Vec<String> = (0..rounds).map(|r| format!("n{r}")).collect();
    want.sort();
    assert_eq!(got, want, "every notification arrives once");
}

/// What the receiver sees of a sender's lanes: shared at first, dedicated after a switch (with
/// notifications in order across it), nothing once the sender is gone; a switch to the lane
/// already in use changes nothing, and one for a segment never opened is an error.
fn lanes_seen_by_the_receiver(transport: &str) {
    use multirail::Lane;
    let (a, b) = pair(transport, "{}");
    let seg = a.open_segment(&b.name()).unwrap();
    assert_eq!(a.lane(seg).unwrap(), Lane::Shared);
    a.send(seg, b"on the shared lane").unwrap();
    let m = b.recv(Some(Duration::from_secs(5))).unwrap().unwrap();
    assert_eq!(m.data, b"on the shared lane");
    assert_eq!(b.incoming_lanes(), vec![(a.name(), Lane::Shared)]);
    a.switch_lane(seg, Lane::Shared).unwrap();
    a.send_notification(seg, "before").unwrap();
    a.switch_lane(seg, Lane::Dedicated).unwrap();
    a.send_notification(seg, "after").unwrap();
    a.send(seg, b"on a lane of its own").unwrap();
    let m = b.recv(Some(Duration::from_secs(5))).unwrap().unwrap();
    assert_eq!(m.data, b"on a lane of its own");
    let notes: Vec<String> = b
        .receive_notifications()
        .into_iter()
        .map(|n| n.msg)
        .collect();
    assert_eq!(notes, ["before", "after"]);
    assert_eq!(a.lane(seg).unwrap(), Lane::Dedicated);
    assert_eq!(b.incoming_lanes(), vec![(a.name(), Lane::Dedicated)]);
    let unknown = multirail::SegmentId(u64::MAX);
    assert!(a.switch_lane(unknown, Lane::Dedicated).is_err());
    // The sender goes: its dedicated lane goes with it.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !b.incoming_lanes().is_empty() {
        assert!(Instant::now() < deadline, "{:?}", b.incoming_lanes());
        let _ = b.recv(Some(Duration::from_millis(50)));
    }
}

#[test]
fn lanes_seen_by_the_receiver_tcp() {
    lanes_seen_by_the_receiver("tcp");
}

#[test]
fn lanes_seen_by_the_receiver_shm() {
    lanes_seen_by_the_receiver("shm");
}
