//! Group multicast between engines of one process (threads): delivery, order, batching,
//! flush, failure and bad settings. The multi-process runs (a million messages, killed
//! members) are in the CLI's `mcast` tests.

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use multirail::{
    Config, Delivery, Engine, Error, Group, GroupConfig, GroupMessage, GroupStats, TransportChoice,
};

fn engines(n: usize, timeout_ms: u64) -> Vec<Engine> {
    (0..n)
        .map(|_| {
            let mut c = Config::default();
            c.transports.tcp.timeout_ms = timeout_ms;
            Engine::new(c, "127.0.0.1:0").unwrap()
        })
        .collect()
}

fn names(es: &[Engine]) -> Vec<String> {
    es.iter().map(|e| e.segment_name()).collect()
}

/// Every engine joins `config` (from its own thread, as separate processes would).
fn join_all(es: &[Engine], config: &GroupConfig) -> Vec<Group> {
    let handles: Vec<_> = es
        .iter()
        .map(|e| {
            let (e, c) = (e.clone(), config.clone());
            thread::spawn(move || e.join_group(c))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect()
}

/// Every member leaves, concurrently: `leave` is a barrier.
fn leave_all(groups: Vec<Group>) -> Vec<GroupStats> {
    let handles: Vec<_> = groups
        .into_iter()
        .map(|g| thread::spawn(move || g.leave()))
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect()
}

fn payload(sender: usize, i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|b| (sender as u64 * 31 + i * 7 + b as u64) as u8)
        .collect()
}

/// Receives until `expected` messages arrived; checks per-sender FIFO and payloads.
fn receive_all(
    g: &Group,
    expected: usize,
    senders: &[String],
    size: impl Fn(u64) -> usize,
) -> Vec<GroupMessage> {
    let mut next: HashMap<String, u64> = HashMap::new();
    let mut out = Vec::with_capacity(expected);
    let deadline = Instant::now() + Duration::from_secs(60);
    while out.len() < expected {
        assert!(
            Instant::now() < deadline,
            "only {} of {expected} arrived",
            out.len()
        );
        let Some(m) = g.recv(Some(Duration::from_secs(5))).unwrap() else {
            continue;
        };
        let s = senders.iter().position(|s| **s == *m.sender).unwrap();
        let n = next.entry(m.sender.to_string()).or_insert(0);
        assert!(
            m.index >= *n,
            "sender {} went back: {} after {}",
            m.sender,
            m.index,
            n
        );
        *n = m.index + 1;
        assert_eq!(
            m.bytes,
            payload(s, m.index, size(m.index)),
            "payload of {}#{}",
            m.sender,
            m.index
        );
        out.push(m);
    }
    out
}

fn unordered_run(transport: TransportChoice, batching: &str) {
    let es = engines(3, 5000);
    let members = names(&es);
    let mut config = GroupConfig::new("g", members.clone());
    config.batching = Some(batching.into());
    config.window_size = Some(32);
    config.transport = Some(transport);
    let groups = join_all(&es, &config);
    const PER_SENDER: u64 = 3000;
    let size = |i: u64| (8 + (i * 997) % 2000) as usize;
    thread::scope(|scope| {
        for (s, g) in groups.iter().enumerate() {
            scope.spawn(move || {
                for i in 0..PER_SENDER {
                    assert_eq!(g.send(&payload(s, i, size(i))).unwrap(), i);
                }
                g.flush().unwrap();
            });
        }
        for g in &groups {
            let members = &members;
            scope.spawn(move || {
                let got = receive_all(g, 3 * PER_SENDER as usize, members, size);
                let mut per: HashMap<&str, u64> = HashMap::new();
                for m in &got {
                    *per.entry(&*m.sender).or_default() += 1;
                }
                assert!(per.values().all(|&n| n == PER_SENDER), "{per:?}");
            });
        }
    });
    let stats: Vec<_> = leave_all(groups);
    for s in &stats {
        assert_eq!(s.delivered, 3 * PER_SENDER);
        assert_eq!(s.sent, PER_SENDER);
    }
}

#[test]
fn three_senders_deliver_everything_in_fifo_order_over_tcp() {
    unordered_run(TransportChoice::Tcp, "opportunistic");
}

#[test]
fn three_senders_deliver_everything_in_fifo_order_over_shm() {
    unordered_run(TransportChoice::Shm, "opportunistic");
}

#[test]
fn batching_off_and_k_deliver_everything() {
    unordered_run(TransportChoice::Shm, "off");
    unordered_run(TransportChoice::Tcp, "k:8");
}

#[test]
fn batching_off_costs_the_seeds_ten_writes_per_multicast() {
    let es = engines(3, 5000);
    let members = names(&es);
    let mut config = GroupConfig::new("g", members.clone());
    config.senders = vec![members[0].clone()];
    config.batching = Some("off".into());
    config.transport = Some(TransportChoice::Shm);
    let groups = join_all(&es, &config);
    const N: u64 = 500;
    thread::scope(|scope| {
        scope.spawn(|| {
            for i in 0..N {
                groups[0].send(&payload(0, i, 64)).unwrap();
            }
        });
        for g in &groups {
            let members = &members;
            scope.spawn(move || receive_all(g, N as usize, members, |_| 64));
        }
    });
    // Let the last acknowledgements go out before counting.
    let stats: Vec<_> = leave_all(groups);
    let total: u64 = stats
        .iter()
        .map(|s| s.data_writes + s.counter_writes + s.ack_writes)
        .sum();
    assert_eq!(stats[0].data_writes, 2 * N, "{stats:?}");
    assert_eq!(stats[0].counter_writes, 2 * N, "{stats:?}");
    assert_eq!(total, 10 * N, "{stats:?}");
}

#[test]
fn ordered_delivery_is_identical_everywhere_with_an_idle_sender() {
    let es = engines(3, 5000);
    let members = names(&es);
    let mut config = GroupConfig::new("ordered", members.clone());
    config.delivery = Delivery::Ordered;
    config.transport = Some(TransportChoice::Tcp);
    let groups = join_all(&es, &config);
    const PER_SENDER: u64 = 2000;
    let sequences: Vec<Vec<(String, u64)>> = thread::scope(|scope| {
        // Members 0 and 1 send; member 2 is a sender that never sends.
        for (s, g) in groups.iter().enumerate().take(2) {
            scope.spawn(move || {
                for i in 0..PER_SENDER {
                    g.send(&payload(s, i, 64)).unwrap();
                }
            });
        }
        let receivers: Vec<_> = groups
            .iter()
            .map(|g| {
                scope.spawn(move || {
                    let mut seq = Vec::new();
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while seq.len() < 2 * PER_SENDER as usize {
                        assert!(Instant::now() < deadline, "stalled at {}", seq.len());
                        if let Some(m) = g.recv(Some(Duration::from_secs(5))).unwrap() {
                            seq.push((m.sender.to_string(), m.index));
                        }
                    }
                    seq
                })
            })
            .collect();
        receivers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(sequences[0], sequences[1]);
    assert_eq!(sequences[0], sequences[2]);
    let stats: Vec<_> = leave_all(groups);
    assert!(
        stats[2].null_records > 0,
        "the idle sender sent nulls: {stats:?}"
    );
}

#[test]
fn k_batching_delivers_a_lone_message_after_the_flush_deadline_and_flush_is_immediate() {
    let es = engines(3, 5000);
    let members = names(&es);
    let mut config = GroupConfig::new("k", members.clone());
    config.batching = Some("k:25".into());
    config.window_size = Some(64);
    config.flush_us = Some(20_000);
    config.transport = Some(TransportChoice::Tcp);
    let groups = join_all(&es, &config);
    let start = Instant::now();
    groups[0].send(b"lone").unwrap();
    let m = groups[1]
        .recv(Some(Duration::from_secs(5)))
        .unwrap()
        .expect("delivered");
    let waited = start.elapsed();
    assert_eq!(m.bytes, b"lone");
    assert!(
        waited >= Duration::from_millis(20),
        "held for the 20 ms deadline, got {waited:?}"
    );
    // A burst of 10 (under k) then flush: delivered at once, not after 20 ms.
    for i in 0..10u64 {
        groups[0].send(&payload(0, i, 32)).unwrap();
    }
    let start = Instant::now();
    groups[0].flush().unwrap();
    let mut got = 0;
    while got < 10 {
        if groups[2]
            .recv(Some(Duration::from_secs(5)))
            .unwrap()
            .is_some_and(|m| m.bytes.len() == 32)
        {
            got += 1;
        }
    }
    let waited = start.elapsed();
    assert!(
        waited < Duration::from_millis(15),
        "flush delivered the tail in {waited:?}"
    );
    leave_all(groups);
}

#[test]
fn a_member_that_dies_fails_send_recv_and_flush_at_the_others_in_time() {
    let es = engines(3, 1000);
    let members = names(&es);
    let mut config = GroupConfig::new("dies", members.clone());
    config.transport = Some(TransportChoice::Tcp);
    let mut groups = join_all(&es, &config);
    groups[0].send(b"before").unwrap();
    for g in &groups[1..] {
        assert_eq!(
            g.recv(Some(Duration::from_secs(5))).unwrap().unwrap().bytes,
            b"before"
        );
    }
    let dead = groups.pop().unwrap();
    let dead_engine = es[2].clone();
    drop(dead);
    dead_engine.shutdown();
    drop(dead_engine);
    let start = Instant::now();
    let err = loop {
        match groups[0].recv(Some(Duration::from_millis(100))) {
            Err(e) => break e,
            Ok(_) => assert!(start.elapsed() < Duration::from_secs(3), "no failure seen"),
        }
    };
    assert!(
        start.elapsed() <= Duration::from_millis(1500),
        "seen after {:?}",
        start.elapsed()
    );
    assert!(
        matches!(&err, Error::GroupMemberFailed(f) if f.member == members[2]),
        "{err}"
    );
    assert!(matches!(
        groups[0].send(b"x"),
        Err(Error::GroupMemberFailed(_))
    ));
    // The other survivor sees it too, whether its send or its flush comes first.
    let seen = groups[1]
        .send(b"y")
        .and_then(|_| groups[1].flush())
        .unwrap_err();
    assert!(matches!(seen, Error::GroupMemberFailed(_)), "{seen}");
}

#[test]
fn bad_sends_and_mismatched_joins_are_refused() {
    let es = engines(2, 5000);
    let members = names(&es);
    let mut config = GroupConfig::new("m", members.clone());
    config.join_timeout_ms = Some(1500);
    let mut other = config.clone();
    other.max_payload = Some(4096);
    let (a, b) = (es[0].clone(), es[1].clone());
    let ha = thread::spawn(move || a.join_group(config));
    let hb = thread::spawn(move || b.join_group(other));
    let (ra, rb) = (ha.join().unwrap(), hb.join().unwrap());
    let errs: Vec<String> = [ra.err(), rb.err()]
        .into_iter()
        .flatten()
        .map(|e| e.to_string())
        .collect();
    assert!(
        errs.iter().any(|e| e.contains("different max_payload")),
        "{errs:?}"
    );

    // A member that never joins is named when the join times out.
    let mut lonely = GroupConfig::new("lonely", members.clone());
    lonely.join_timeout_ms = Some(300);
    let err = es[0].join_group(lonely).unwrap_err().to_string();
    assert!(
        err.contains(&members[1]) && err.contains("missing"),
        "{err}"
    );

    // Not a member.
    let err = es[0]
        .join_group(GroupConfig::new("x", vec!["a:1".into(), "b:2".into()]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not among the members"), "{err}");

    let mut config = GroupConfig::new("sz", members.clone());
    config.max_payload = Some(100);
    config.senders = vec![members[0].clone()];
    let groups = join_all(&es, &config);
    let err = groups[0].send(&[0u8; 101]).unwrap_err().to_string();
    assert!(err.contains("max_payload (100 bytes)"), "{err}");
    let err = groups[1].send(b"hi").unwrap_err().to_string();
    assert!(err.contains("not among the group's senders"), "{err}");
    leave_all(groups);
}

#[test]
fn a_fill_that_fails_sends_nothing_and_the_next_message_takes_its_place() {
    let es = engines(2, 5000);
    let members = names(&es);
    let mut config = GroupConfig::new("fallible", members.clone());
    config.transport = Some(TransportChoice::Shm);
    let groups = join_all(&es, &config);
    let refused: Result<Result<u64, &str>, Error> = groups[0].try_send_with(16, |slot| {
        slot.fill(0xEE);
        Err("the source ran dry")
    });
    assert_eq!(refused.unwrap(), Err("the source ran dry"));
    assert_eq!(groups[0].send(b"first").unwrap(), 0);
    assert_eq!(
        groups[0]
            .try_send_with(6, |slot| {
                slot.copy_from_slice(b"second");
                Ok::<(), ()>(())
            })
            .unwrap(),
        Ok(1)
    );
    for g in &groups {
        let got: Vec<(u64, Vec<u8>)> = (0..2)
            .map(|_| {
                let m = g.recv(Some(Duration::from_secs(5))).unwrap().unwrap();
                (m.index, m.bytes)
            })
            .collect();
        assert_eq!(got, vec![(0, b"first".to_vec()), (1, b"second".to_vec())]);
        assert_eq!(g.recv(Some(Duration::from_millis(50))).unwrap(), None);
    }
    let stats = leave_all(groups);
    assert_eq!(stats[0].sent, 2);
}

#[test]
fn a_member_that_drops_its_group_without_leaving_is_named_with_why() {
    let es = engines(3, 1000);
    let members = names(&es);
    let mut config = GroupConfig::new("dropped", members.clone());
    config.transport = Some(TransportChoice::Tcp);
    let mut groups = join_all(&es, &config);
    // Member 2 drops its group (its engine lives on): its table is freed.
    drop(groups.pop().unwrap());
    let start = Instant::now();
    let err = loop {
        match groups[0].send(b"to a gone table") {
            Err(e) => break e,
            Ok(_) => {
                assert!(start.elapsed() < Duration::from_secs(5), "no failure seen");
                thread::sleep(Duration::from_millis(10));
            }
        }
    };
    match &err {
        Error::GroupMemberFailed(f) => {
            assert_eq!(f.member, members[2], "{err}");
            assert!(f.reason.contains("without leave()"), "{err}");
        }
        other => panic!("expected the member named, got {other}"),
    }
}
