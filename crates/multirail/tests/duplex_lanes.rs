//! Duplex dedicated tcp lanes: when two engines each give the other a dedicated tcp lane, one
//! socket carries both. Messages keep their order and arrive once through every switch of
//! either side's lane, the lanes report that they share a socket, and a peer that goes away
//! fails the other's sends and receives in time instead of hanging them.

use std::thread;
use std::time::{Duration, Instant};

use multirail::{Config, Engine, Lane, SegmentId};

/// Lanes by hand (no lanes driver moving them), over tcp.
fn engine() -> Engine {
    let json = r#"{"transport": "tcp", "lanes": {"dynamic": false},
                   "transports": {"tcp": {"timeout_ms": 2000}}}"#;
    Engine::new(Config::from_json_str(json, "test").unwrap(), "127.0.0.1:0").unwrap()
}

fn message(i: u64) -> Vec<u8> {
    let len = 8 + (i % 120) as usize;
    let mut m = vec![(i % 251) as u8; len];
    m[..8].copy_from_slice(&i.to_le_bytes());
    m
}

/// Receives `n` messages from `from`, checking each is the next one whole.
fn expect_in_order(e: &Engine, from: &str, n: u64, first: u64) {
    for i in first..first + n {
        let m = e
            .recv(Some(Duration::from_secs(10)))
            .unwrap()
            .unwrap_or_else(|| panic!("message {i} did not come"));
        assert_eq!(&*m.from, from);
        assert_eq!(m.data, message(i), "message {i}");
    }
}

/// `from` sends message `i` while `to` receives in another thread (a receiver polls, and the
/// lane a peer starts on a duplex socket is taken in by that poll): messages `first..=i`.
fn send_while_polled(from: &Engine, to: &Engine, seg: SegmentId, first: u64, i: u64) {
    let receiving = {
        let to = to.clone();
        let name = from.name();
        thread::spawn(move || expect_in_order(&to, &name, i + 1 - first, first))
    };
    thread::sleep(Duration::from_millis(5));
    from.send(seg, &message(i)).unwrap();
    receiving.join().unwrap();
}

/// `rounds` round trips: `first` sends its next message (numbered by its counter) to the
/// other, which receives it in order and answers likewise.
fn ping_pong(
    rounds: u64,
    first: (&Engine, SegmentId, &mut u64),
    second: (&Engine, SegmentId, &mut u64),
) {
    let (x, to_y, sent_x) = first;
    let (y, to_x, sent_y) = second;
    for _ in 0..rounds {
        x.send(to_y, &message(*sent_x)).unwrap();
        expect_in_order(y, &x.name(), 1, *sent_x);
        *sent_x += 1;
        y.send(to_x, &message(*sent_y)).unwrap();
        expect_in_order(x, &y.name(), 1, *sent_y);
        *sent_y += 1;
    }
}

/// Whether `e`'s lanes to and from `peer` are both dedicated and share one socket.
fn duplex_both_ways(e: &Engine, peer: &str) -> bool {
    let r = e.lanes();
    let out = r.outgoing.iter().find(|p| p.peer == peer);
    let inc = r.incoming.iter().find(|p| p.peer == peer);
    matches!((out, inc), (Some(o), Some(i)) if o.duplex && i.duplex
        && o.lane == Lane::Dedicated && i.lane == Lane::Dedicated)
}

#[test]
fn a_dedicated_lane_each_way_shares_one_socket_and_either_side_can_leave_it() {
    let (a, b) = (engine(), engine());
    let (to_b, to_a) = (
        a.open_segment(&b.name()).unwrap(),
        b.open_segment(&a.name()).unwrap(),
    );
    // A's dedicated lane opens a socket; B's dedicated lane starts on it.
    a.switch_lane(to_b, Lane::Dedicated).unwrap();
    a.send(to_b, &message(0)).unwrap();
    expect_in_order(&b, &a.name(), 1, 0);
    b.switch_lane(to_a, Lane::Dedicated).unwrap();
    send_while_polled(&b, &a, to_a, 0, 0);
    let mut sent_b = 1;
    let mut sent_a = 1;
    ping_pong(10_000, (&b, to_a, &mut sent_b), (&a, to_b, &mut sent_a));
    assert!(duplex_both_ways(&a, &b.name()), "{:?}", a.lanes());
    assert!(duplex_both_ways(&b, &a.name()), "{:?}", b.lanes());

    // A leaves for the shared lane: B's lane on the socket ends with it, and B's next
    // messages take a connection of their own, after everything before. (At most 30 unread
    // at a time: what the receive buffers' credits allow without the receiver polling.)
    for i in 0..30 {
        b.send(to_a, &message(sent_b + i)).unwrap();
    }
    a.switch_lane(to_b, Lane::Shared).unwrap();
    for i in 0..30 {
        a.send(to_b, &message(sent_a + i)).unwrap();
    }
    expect_in_order(&b, &a.name(), 30, sent_a);
    sent_a += 30;
    // B's lane on the socket was fenced when B's receive poll read A's fence above.
    send_while_polled(&b, &a, to_a, sent_b, sent_b + 30);
    sent_b += 31;
    assert_eq!(b.lane(to_a).unwrap(), Lane::Dedicated);
    assert!(!duplex_both_ways(&a, &b.name()));
    assert!(!duplex_both_ways(&b, &a.name()));

    // A comes back dedicated on B's socket this time (B opened one when it left A's); then B
    // leaves: A's lane on the socket ends too, and nothing is lost either way.
    a.switch_lane(to_b, Lane::Dedicated).unwrap();
    send_while_polled(&a, &b, to_b, sent_a, sent_a);
    sent_a += 1;
    ping_pong(1_000, (&a, to_b, &mut sent_a), (&b, to_a, &mut sent_b));
    assert!(duplex_both_ways(&a, &b.name()), "{:?}", a.lanes());
    b.switch_lane(to_a, Lane::Shared).unwrap();
    for i in 0..30 {
        a.send(to_b, &message(sent_a + i)).unwrap();
        b.send(to_a, &message(sent_b + i)).unwrap();
    }
    expect_in_order(&b, &a.name(), 30, sent_a);
    expect_in_order(&a, &b.name(), 30, sent_b);
    assert!(a.recv(Some(Duration::from_millis(100))).unwrap().is_none());
    assert!(b.recv(Some(Duration::from_millis(100))).unwrap().is_none());
}

/// One side of [`switches_on_both_sides_keep_every_message_in_order_once`]: sends `n`
/// messages to `to`, switching the lane every `every` (dedicated first), while a thread
/// receives the other side's `n`, each the next one. Returns how many of its switches to
/// dedicated found the lane sharing a socket with the other side's.
fn busy_side(
    e: Engine,
    to: SegmentId,
    peer: String,
    n: u64,
    every: u64,
) -> thread::JoinHandle<u64> {
    thread::spawn(move || {
        let receiving = {
            let e = e.clone();
            let peer = peer.clone();
            thread::spawn(move || expect_in_order(&e, &peer, n, 0))
        };
        let mut shared_socket = 0;
        for i in 0..n {
            if i.is_multiple_of(every) {
                let to_lane = if (i / every).is_multiple_of(2) {
                    Lane::Dedicated
                } else {
                    Lane::Shared
                };
                e.switch_lane(to, to_lane).unwrap();
            }
            e.send(to, &message(i)).unwrap();
            if i % every == every / 2 && duplex_both_ways(&e, &peer) {
                shared_socket += 1;
            }
        }
        receiving.join().unwrap();
        shared_socket
    })
}

#[test]
fn switches_on_both_sides_keep_every_message_in_order_once() {
    const N: u64 = 500_000;
    const EVERY: u64 = 1_000;
    let (a, b) = (engine(), engine());
    let to_b = a.open_segment(&b.name()).unwrap();
    let to_a = b.open_segment(&a.name()).unwrap();
    let started = Instant::now();
    let side_a = busy_side(a.clone(), to_b, b.name(), N, EVERY);
    let side_b = busy_side(b.clone(), to_a, a.name(), N, EVERY + 37);
    let (shared_a, shared_b) = (side_a.join().unwrap(), side_b.join().unwrap());
    eprintln!(
        "{} messages each way through {} and {} switches: {:.1} s; lanes sharing a socket at \
         {shared_a} and {shared_b} of the checks",
        N,
        N / EVERY,
        N / (EVERY + 37),
        started.elapsed().as_secs_f64()
    );
    assert!(a.recv(Some(Duration::from_millis(200))).unwrap().is_none());
    assert!(b.recv(Some(Duration::from_millis(200))).unwrap().is_none());
    assert!(
        shared_a + shared_b > 0,
        "no dedicated lane ever shared a socket with the other way"
    );
}

#[test]
fn a_peer_gone_from_a_duplex_lane_fails_sends_in_time() {
    let (a, b) = (engine(), engine());
    let to_b = a.open_segment(&b.name()).unwrap();
    let to_a = b.open_segment(&a.name()).unwrap();
    a.switch_lane(to_b, Lane::Dedicated).unwrap();
    a.send(to_b, &message(0)).unwrap();
    expect_in_order(&b, &a.name(), 1, 0);
    b.switch_lane(to_a, Lane::Dedicated).unwrap();
    send_while_polled(&b, &a, to_a, 0, 0);
    assert!(duplex_both_ways(&a, &b.name()));
    let b_name = b.name();
    b.shutdown();
    drop(b);
    // A's sends run out of credits or hit the closed socket: an error naming B, in time.
    let started = Instant::now();
    let mut i = 1;
    let err = loop {
        match a.send(to_b, &message(i)) {
            Ok(()) => i += 1,
            Err(e) => break e,
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "sends kept succeeding"
        );
    };
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "took {:?}",
        started.elapsed()
    );
    assert!(err.to_string().contains(&b_name), "{err}");
    // And A's receive returns (nothing), it does not hang.
    assert!(a.recv(Some(Duration::from_millis(200))).unwrap().is_none());
}
