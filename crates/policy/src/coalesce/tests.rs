use super::*;
use proptest::prelude::*;

const US: u64 = 1_000;

fn every(k: u64, flush_us: u64) -> Batching {
    Batching::Every {
        k,
        flush_ns: flush_us * US,
    }
}

/// One-sided writes of `multicasts` messages from one sender in a group of `members`, all
/// committed at once and drained: each push writes its slots and then the counter to every
/// other member, and every member (the sender too, as Derecho's receive loop counts its own
/// messages) pushes its count to every other member. Returns (pushes, acks, writes).
fn writes(batching: Batching, members: u64, multicasts: u64, burst: u64) -> (u64, u64, u64) {
    let window = 16;
    let mut sender = PushPlanner::new(batching, window).unwrap();
    let mut receivers: Vec<AckPlanner> = (0..members)
        .map(|_| AckPlanner::new(batching, window).unwrap())
        .collect();
    let (mut pushes, mut acks, mut now) = (0, 0, 0);
    while sender.committed() < multicasts {
        for _ in 0..burst {
            if sender.committed() < multicasts && sender.commit(now).is_none() {
                break;
            }
        }
        if sender.committed() == multicasts {
            sender.flush();
        }
        while let Some(p) = sender.poll_push(now) {
            pushes += 1;
            for r in &mut receivers {
                r.on_consumed(p.messages.end - p.messages.start, p.urgent, now);
            }
        }
        let mut least = u64::MAX;
        for r in &mut receivers {
            let mut last = None;
            while let Some(v) = r.poll_ack(now) {
                acks += 1;
                last = Some(v);
            }
            least = least.min(last.unwrap_or(u64::MAX));
        }
        if least != u64::MAX {
            sender.on_acknowledged(least);
        }
        now += 10 * US;
    }
    (
        pushes,
        acks,
        pushes * 2 * (members - 1) + acks * (members - 1),
    )
}

#[test]
fn off_makes_the_seeds_ten_writes_per_multicast_in_a_group_of_three() {
    let (pushes, acks, w) = writes(Batching::Off, 3, 1000, 1);
    assert_eq!((pushes, acks), (1000, 3000));
    assert_eq!(w, 10 * 1000);
    // Bursts change nothing without batching.
    let (_, _, w) = writes(Batching::Off, 3, 1000, 8);
    assert_eq!(w, 10 * 1000);
}

#[test]
fn batching_takes_a_burst_in_one_push_and_one_acknowledgement() {
    let (pushes, acks, w) = writes(Batching::Opportunistic, 3, 1600, 16);
    assert_eq!((pushes, acks), (100, 300));
    assert_eq!(w, 1000, "16 messages a push: 10 writes carry 16 multicasts");
    let (pushes, _, _) = writes(every(8, 150), 3, 1600, 16);
    assert_eq!(pushes, 100);
}

#[test]
fn a_single_message_under_k_waits_for_the_flush_deadline_then_goes() {
    let mut p = PushPlanner::new(every(25, 150), 100).unwrap();
    assert_eq!(p.commit(1_000), Some(0));
    assert_eq!(p.poll_push(1_000), None, "held back: fewer than k pending");
    assert_eq!(p.deadline(), Some(1_000 + 150 * US));
    assert_eq!(p.poll_push(1_000 + 150 * US - 1), None);
    let push = p
        .poll_push(1_000 + 150 * US)
        .expect("forced push at the deadline");
    assert_eq!(push.messages, 0..1);
    assert!(!push.urgent);
    assert_eq!(p.deadline(), None);

    let mut a = AckPlanner::new(every(25, 150), 100).unwrap();
    a.on_consumed(1, false, 5_000);
    assert_eq!(a.poll_ack(5_000), None);
    assert_eq!(a.deadline(), Some(5_000 + 150 * US));
    assert_eq!(a.poll_ack(5_000 + 150 * US), Some(1));
}

#[test]
fn k_pending_messages_push_at_once_and_acks_go_at_multiples_of_k() {
    let mut p = PushPlanner::new(every(4, 150), 16).unwrap();
    for i in 0..3 {
        p.commit(i);
        assert_eq!(p.poll_push(i), None);
    }
    p.commit(3);
    assert_eq!(p.poll_push(3).unwrap().messages, 0..4);
    let mut a = AckPlanner::new(every(4, 150), 16).unwrap();
    a.on_consumed(3, false, 0);
    assert_eq!(a.poll_ack(0), None);
    a.on_consumed(2, false, 1);
    assert_eq!(
        a.poll_ack(1),
        Some(5),
        "crossed 4: everything consumed is acknowledged"
    );
    assert_eq!(a.poll_ack(1), None);
}

#[test]
fn flush_pushes_the_tail_now_and_receivers_acknowledge_it_now() {
    let mut p = PushPlanner::new(every(25, 150), 100).unwrap();
    for i in 0..7 {
        p.commit(i);
    }
    assert_eq!(p.poll_push(7), None);
    p.flush();
    let push = p.poll_push(8).expect("flush pushes at once");
    assert_eq!(push.messages, 0..7);
    assert!(push.urgent);
    assert_eq!(p.poll_push(8), None);
    let mut a = AckPlanner::new(every(25, 150), 100).unwrap();
    a.on_consumed(7, push.urgent, 9);
    assert_eq!(
        a.poll_ack(9),
        Some(7),
        "an urgent push is acknowledged at once"
    );
    // A flush with nothing pending marks nothing.
    p.flush();
    p.commit(10);
    assert_eq!(p.poll_push(10), None);
}

#[test]
fn a_push_never_crosses_the_rings_wrap() {
    let mut p = PushPlanner::new(Batching::Opportunistic, 8).unwrap();
    for i in 0..6 {
        p.commit(i);
    }
    assert_eq!(p.poll_push(0).unwrap().messages, 0..6);
    p.on_acknowledged(6);
    for i in 0..5 {
        p.commit(i);
    }
    assert_eq!(p.poll_push(1).unwrap().messages, 6..8, "up to the wrap");
    assert_eq!(p.poll_push(1).unwrap().messages, 8..11, "then from slot 0");
    assert_eq!(p.poll_push(1), None);
}

#[test]
fn a_full_window_refuses_commits_until_every_receiver_acknowledges() {
    let mut p = PushPlanner::new(Batching::Opportunistic, 4).unwrap();
    for i in 0..4 {
        assert_eq!(p.commit(0), Some(i));
    }
    assert!(!p.has_room());
    assert_eq!(p.commit(0), None);
    p.on_acknowledged(2);
    assert_eq!(
        p.commit(0),
        None,
        "acknowledged past what was pushed is ignored"
    );
    assert_eq!(p.poll_push(0).unwrap().messages, 0..4);
    p.on_acknowledged(2);
    assert_eq!(p.commit(0), Some(4));
    assert_eq!(p.commit(0), Some(5));
    assert_eq!(p.commit(0), None);
    p.on_acknowledged(1);
    assert_eq!(
        p.commit(0),
        None,
        "an acknowledgement going back is ignored"
    );
}

#[test]
fn bad_settings_are_refused_naming_them() {
    for (batching, window, says) in [
        (Batching::Off, 0, "window_size"),
        (every(0, 150), 16, "batch size k"),
        (every(17, 150), 16, "batch size k"),
        (Batching::Every { k: 4, flush_ns: 0 }, 16, "flush_us"),
    ] {
        let e = PushPlanner::new(batching, window).unwrap_err();
        assert!(e.0.contains(says), "{batching:?}/{window}: {e}");
        let e = AckPlanner::new(batching, window).unwrap_err();
        assert!(e.0.contains(says), "{e}");
    }
    assert!(PushPlanner::new(every(16, 1), 16).is_ok());
}

#[derive(Debug, Clone)]
enum Op {
    Commit(u8),
    Acknowledge,
    Flush,
    Wait(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u8..20).prop_map(Op::Commit),
        2 => Just(Op::Acknowledge),
        1 => Just(Op::Flush),
        2 => (0u16..400).prop_map(Op::Wait),
    ]
}

fn batching() -> impl Strategy<Value = (Batching, u64)> {
    (1u64..40).prop_flat_map(|window| {
        prop_oneof![
            Just((Batching::Off, window)),
            Just((Batching::Opportunistic, window)),
            (1..=window, 1u64..300).prop_map(move |(k, f)| (every(k, f), window)),
        ]
    })
}

proptest! {
    /// Whatever the sender and its receivers do: pushes cover every committed message exactly
    /// once, in order, never across the wrap; the window never overflows; nothing committed
    /// (or consumed) stays unpushed (unacknowledged) past its deadline, and without `Every`
    /// nothing waits at all.
    #[test]
    fn pushes_and_acknowledgements_keep_their_promises(
        (batching, window) in batching(),
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let flush = match batching { Batching::Every { flush_ns, .. } => Some(flush_ns), _ => None };
        let mut p = PushPlanner::new(batching, window).unwrap();
        let mut a = AckPlanner::new(batching, window).unwrap();
        let mut committed_at: Vec<u64> = Vec::new();
        let mut consumed_at: Vec<u64> = Vec::new();
        let (mut next, mut acked, mut least) = (0u64, 0u64, 0u64);
        let mut now = 0u64;
        for op in ops {
            match op {
                Op::Commit(n) => {
                    for _ in 0..n {
                        match p.commit(now) {
                            Some(i) => {
                                prop_assert_eq!(i, committed_at.len() as u64);
                                committed_at.push(now);
                            }
                            None => {
                                prop_assert_eq!(p.committed() - least, window);
                                break;
                            }
                        }
                    }
                }
                Op::Acknowledge => {
                    least = acked;
                    p.on_acknowledged(acked);
                }
                Op::Flush => p.flush(),
                Op::Wait(us) => now += us as u64 * US,
            }
            prop_assert!(p.committed() - least <= window);
            while let Some(push) = p.poll_push(now) {
                let m = push.messages.clone();
                prop_assert_eq!(m.start, next, "pushes are contiguous and in order");
                prop_assert!(m.end > m.start);
                prop_assert_eq!(m.start / window, (m.end - 1) / window, "no push crosses the wrap");
                next = m.end;
                for _ in m.clone() { consumed_at.push(now); }
                a.on_consumed(m.end - m.start, push.urgent, now);
            }
            while let Some(v) = a.poll_ack(now) {
                prop_assert!(v > acked && v <= a.consumed());
                acked = v;
            }
            prop_assert_eq!(p.pushed(), next);
            match flush {
                None => {
                    prop_assert_eq!(p.pushed(), p.committed(), "nothing waits without Every");
                    prop_assert_eq!(acked, a.consumed());
                }
                Some(f) => {
                    if let Some(&t) = committed_at.get(p.pushed() as usize) {
                        prop_assert!(now < t + f, "message {} committed at {} still unpushed at {}", p.pushed(), t, now);
                        prop_assert!(p.deadline().is_some_and(|d| d <= t + f));
                    }
                    if let Some(&t) = consumed_at.get(acked as usize) {
                        prop_assert!(now < t + f, "consumed at {} still unacknowledged at {}", t, now);
                        prop_assert!(a.deadline().is_some_and(|d| d <= t + f));
                    }
                }
            }
        }
    }
}
