//! The `rdma` transport, for real: these tests need RDMA ports (soft-RoCE in the VM that
//! `scripts/test-rdma` boots, with `rxe_a` on `va` and `rxe_b` on `vc`), and say that they skip
//! where there are none. Where there are none, the tests at the end check what a user sees
//! instead: `topo` says why RDMA is off, and `--transport rdma` fails with a clear error.
//!
//! Everything is emulated in the VM: the tests move tens of MiB and check every byte; speed
//! means nothing here.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::TargetProcess;
use multirail::{Buffer, Config, Engine, Error, Location, Request, SegmentId, PRIO_LOW};

const MIB: usize = 1 << 20;

fn rdma_here() -> bool {
    let probe = multirail::rdma_probe(&Config::default());
    if let Some(why) = &probe.off {
        eprintln!(
            "skipped: RDMA is off on this host ({why}); scripts/test-rdma runs these in a VM"
        );
        return false;
    }
    true
}

/// The soft-RoCE VM's two rails, by their netdevs; `None` elsewhere.
fn vm_rails() -> Option<(String, String)> {
    let a = std::env::var("RDMA_VM_DEV_A").ok()?;
    let b = std::env::var("RDMA_VM_DEV_B").ok()?;
    Some((a, b))
}

fn initiator(conf: &str) -> Engine {
    Engine::new(
        Config::from_json_str(conf, "test").expect("valid config"),
        "127.0.0.1:0",
    )
    .expect("engine")
}

fn fill(buf: &Buffer, seed: u64) {
    // SAFETY: nothing is in flight on this buffer.
    let bytes = unsafe { buf.as_mut_slice() };
    let mut x = seed | 1;
    for chunk in bytes.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

fn same(a: &Buffer, b: &Buffer) -> bool {
    // SAFETY: nothing is in flight on either buffer.
    unsafe { a.as_slice() == b.as_slice() }
}

/// Moves `len` bytes between `local` and the target at `remote` in `block`-byte requests.
fn transfer(
    engine: &Engine,
    seg: SegmentId,
    write: bool,
    local: &Buffer,
    remote: u64,
    len: usize,
    block: usize,
) -> multirail::Result<()> {
    let reqs: Vec<Request> = (0..len / block)
        .map(|i| {
            let off = (i * block) as u64;
            let mut r = if write {
                Request::write(local.addr() + off, seg, remote + off, block as u64)
            } else {
                Request::read(local.addr() + off, seg, remote + off, block as u64)
            };
            r.priority = PRIO_LOW;
            r
        })
        .collect();
    let batch = engine.allocate_batch(reqs.len())?;
    engine.submit(batch, &reqs)?;
    let result = engine.wait(batch, Some(Duration::from_secs(120)));
    let _ = engine.free_batch(batch);
    result
}

fn rail_bytes(engine: &Engine, name: &str) -> u64 {
    engine
        .traffic_stats()
        .rails
        .iter()
        .find(|r| r.name == name)
        .map_or(0, |r| r.bytes)
}

fn remote_base(engine: &Engine, seg: SegmentId) -> u64 {
    engine.segment_descriptor(seg).unwrap().buffers[0].addr
}

const RDMA: &str = r#"{"transport": "rdma", "transports": {"tcp": {"timeout_ms": 20000}}}"#;
/// RDMA with lanes switched only by hand, for tests that count every message and fence.
const RDMA_FIXED_LANES: &str = r#"{"transport": "rdma", "lanes": {"dynamic": false}, "transports": {"tcp": {"timeout_ms": 20000}}}"#;

#[test]
fn sixty_four_mib_each_way_over_both_rails_every_byte_checked() {
    if !rdma_here() {
        return;
    }
    let target = TargetProcess::start("128MiB", None);
    let engine = initiator(RDMA);
    let seg = engine.open_segment(&target.name).unwrap();
    let remote = remote_base(&engine, seg);
    let len = 64 * MIB;
    let src = engine.allocate(len, Location::Any).unwrap();
    let back = engine.allocate(len, Location::Any).unwrap();
    fill(&src, 0x5eed);
    let t = Instant::now();
    transfer(&engine, seg, true, &src, remote, len, MIB).unwrap();
    let write_s = t.elapsed().as_secs_f64();
    let after_write = engine.rdma_stats();
    let t = Instant::now();
    transfer(&engine, seg, false, &back, remote, len, MIB).unwrap();
    let read_s = t.elapsed().as_secs_f64();
    assert!(
        same(&src, &back),
        "64 MiB read back differ from what was written"
    );
    let s = engine.rdma_stats();
    let desc = engine.local_descriptor();
    let rails: Vec<(String, u64)> = desc
        .rdma
        .iter()
        .map(|r| (r.name(), rail_bytes(&engine, &r.name())))
        .collect();
    println!(
        "RDMA (emulated) write {:.1} MB/s, read {:.1} MB/s; per rail {rails:?}",
        len as f64 / write_s / 1e6,
        len as f64 / read_s / 1e6
    );
    println!(
        "write: {} work requests in {} ibv_post_send calls ({:.2} per call), {} signalled completions for {} slices ({:.2} per slice)",
        after_write.work_requests,
        after_write.post_calls,
        after_write.work_requests as f64 / after_write.post_calls.max(1) as f64,
        after_write.signalled_completions,
        after_write.slices,
        after_write.signalled_completions as f64 / after_write.slices.max(1) as f64,
    );
    println!(
        "write+read: {} work requests in {} ibv_post_send calls ({:.2} per call), {} signalled completions for {} slices ({:.2} per slice)",
        s.work_requests,
        s.post_calls,
        s.work_requests as f64 / s.post_calls.max(1) as f64,
        s.signalled_completions,
        s.slices,
        s.signalled_completions as f64 / s.slices.max(1) as f64,
    );
    assert!(s.work_requests >= 2 * (len / (64 << 10)) as u64, "{s:?}");
    if vm_rails().is_some() {
        assert!(
            rails.len() >= 2 && rails.iter().all(|(_, b)| *b > 0),
            "both rails carry slices: {rails:?}"
        );
    }
}

#[test]
fn a_rail_pair_that_cannot_connect_is_left_unused() {
    if !rdma_here() {
        return;
    }
    let Some((dev_a, dev_b)) = vm_rails() else {
        eprintln!("skipped: needs the VM's two rails");
        return;
    };
    // The target offers only rxe_b: this engine's rxe_a pairs with it through a router that a
    // single host does not have (its queue pairs fail at RTR), and rxe_b pairs with rxe_b.
    let conf = format!(r#"{{"transports": {{"rdma": {{"devices": ["{dev_b}"]}}}}}}"#);
    let target = TargetProcess::start("64MiB", Some(&conf));
    let engine = initiator(RDMA);
    let seg = engine.open_segment(&target.name).unwrap();
    let remote = remote_base(&engine, seg);
    let len = 16 * MIB;
    let src = engine.allocate(len, Location::Any).unwrap();
    let back = engine.allocate(len, Location::Any).unwrap();
    fill(&src, 7);
    transfer(&engine, seg, true, &src, remote, len, MIB).unwrap();
    transfer(&engine, seg, false, &back, remote, len, MIB).unwrap();
    assert!(same(&src, &back));
    let a = rail_bytes(&engine, &format!("{dev_a}/1"));
    let b = rail_bytes(&engine, &format!("{dev_b}/1"));
    println!("{dev_a}/1 carried {a} bytes, {dev_b}/1 carried {b}");
    assert_eq!(a, 0, "the pair that cannot connect carried nothing");
    assert_eq!(b, 2 * len as u64);
}

fn ip_link(dev: &str, state: &str) {
    let ok = Command::new("ip")
        .args(["link", "set", dev, state])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "ip link set {dev} {state}");
}

#[test]
fn a_rail_going_down_mid_transfer_is_retried_on_the_other() {
    if !rdma_here() {
        return;
    }
    if vm_rails().is_none() {
        eprintln!("skipped: needs the VM's two rails");
        return;
    }
    let target = TargetProcess::start("128MiB", None);
    let engine = initiator(RDMA);
    let seg = engine.open_segment(&target.name).unwrap();
    let remote = remote_base(&engine, seg);
    let len = 64 * MIB;
    let src = engine.allocate(len, Location::Any).unwrap();
    let back = engine.allocate(len, Location::Any).unwrap();
    fill(&src, 99);
    // Warm both rails up, then take rail a's link down while the write runs.
    transfer(&engine, seg, true, &src, remote, 4 * MIB, MIB).unwrap();
    let downer = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(700));
        ip_link("va", "down");
        Instant::now()
    });
    let t = Instant::now();
    let result = transfer(&engine, seg, true, &src, remote, len, MIB);
    let down_at = downer.join().unwrap();
    let done = Instant::now();
    ip_link("va", "up");
    result.unwrap();
    assert!(
        down_at < done,
        "the link went down before the write finished ({:?} in)",
        down_at - t
    );
    let stats = engine.traffic_stats();
    let errors: u64 = stats.rails.iter().map(|r| r.errors).sum();
    println!(
        "write finished {:?} after the link went down; rail errors {errors}; {:?}",
        done - down_at,
        engine.rdma_stats()
    );
    transfer(&engine, seg, false, &back, remote, len, MIB).unwrap();
    assert!(same(&src, &back), "the write completed whole and verified");
}

#[test]
fn a_killed_peer_fails_its_requests_when_its_control_connection_closes_while_another_goes_on() {
    if !rdma_here() {
        return;
    }
    let doomed = TargetProcess::start("64MiB", None);
    let other = TargetProcess::start("64MiB", None);
    // Long enough that the failure cannot come from the peer's timeout: the killed target's
    // control connection closes with it, and that ends its queue pairs and its requests.
    let timeout_ms = 30_000;
    let engine = initiator(&format!(
        r#"{{"transport": "rdma", "transports": {{"tcp": {{"timeout_ms": {timeout_ms}}}}}}}"#
    ));
    let seg_d = engine.open_segment(&doomed.name).unwrap();
    let seg_o = engine.open_segment(&other.name).unwrap();
    let (rd, ro) = (remote_base(&engine, seg_d), remote_base(&engine, seg_o));
    let len = 32 * MIB;
    let src = engine.allocate(len, Location::Any).unwrap();
    let back = engine.allocate(len, Location::Any).unwrap();
    fill(&src, 3);
    // Connected to both before anything fails.
    transfer(&engine, seg_d, true, &src, rd, MIB, MIB).unwrap();
    transfer(&engine, seg_o, true, &src, ro, MIB, MIB).unwrap();
    let reqs = |seg: SegmentId, remote: u64| -> Vec<Request> {
        (0..len / MIB)
            .map(|i| {
                let off = (i * MIB) as u64;
                Request::write(src.addr() + off, seg, remote + off, MIB as u64)
            })
            .collect()
    };
    // The doomed peer gets its buffer written eight times over: seconds of work at emulated
    // speed, so the kill lands in the middle of it.
    let doomed_reqs: Vec<Request> = (0..8).flat_map(|_| reqs(seg_d, rd)).collect();
    let bd = engine.allocate_batch(doomed_reqs.len()).unwrap();
    let bo = engine.allocate_batch(len / MIB).unwrap();
    engine.submit(bd, &doomed_reqs).unwrap();
    engine.submit(bo, &reqs(seg_o, ro)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    doomed.signal(libc::SIGKILL);
    let killed = Instant::now();
    assert!(
        !engine.overall_status(bd).unwrap().is_completed(),
        "the doomed peer's writes were still running at the kill"
    );
    let failed = engine.wait(bd, Some(Duration::from_secs(60)));
    let took = killed.elapsed();
    println!("requests to the killed peer ended {took:?} after the kill: {failed:?}");
    assert!(
        matches!(failed, Err(Error::PeerDisconnected { .. })),
        "requests to a killed peer fail as disconnected: {failed:?}"
    );
    assert!(
        took < Duration::from_millis(timeout_ms / 3),
        "failed on the closed control connection, not at the {timeout_ms} ms timeout ({took:?})"
    );
    engine.wait(bo, Some(Duration::from_secs(120))).unwrap();
    transfer(&engine, seg_o, false, &back, ro, len, MIB).unwrap();
    assert!(same(&src, &back), "the other peer's bytes are all there");
}

#[test]
fn requests_outside_the_buffer_are_refused_before_anything_is_posted() {
    if !rdma_here() {
        return;
    }
    let target = TargetProcess::start("8MiB", None);
    let engine = initiator(RDMA);
    let seg = engine.open_segment(&target.name).unwrap();
    let remote = remote_base(&engine, seg);
    let src = engine.allocate(MIB, Location::Any).unwrap();
    let before = engine.rdma_stats();
    let batch = engine.allocate_batch(1).unwrap();
    let past_end = Request::write(src.addr(), seg, remote + (8 * MIB) as u64 - 16, 32);
    let err = engine.submit(batch, &[past_end]).unwrap_err();
    assert!(matches!(err, Error::TargetOutOfRange { .. }), "{err}");
    let unregistered = Request::write(src.addr() + MIB as u64, seg, remote, 16);
    let err = engine.submit(batch, &[unregistered]).unwrap_err();
    assert!(matches!(err, Error::SourceNotRegistered { .. }), "{err}");
    assert_eq!(engine.rdma_stats().work_requests, before.work_requests);
}

#[test]
fn a_buffer_unregistered_at_the_target_is_refused_before_anything_is_posted() {
    if !rdma_here() {
        return;
    }
    let target = initiator(r#"{}"#);
    let gone = target.allocate(4 * MIB, Location::Any).unwrap();
    let racing = target.allocate(4 * MIB, Location::Any).unwrap();
    let kept = target.allocate(4 * MIB, Location::Any).unwrap();
    let engine = initiator(RDMA);
    let seg = engine.open_segment(&target.name()).unwrap();
    let src = engine.allocate(4 * MIB, Location::Any).unwrap();
    fill(&src, 11);
    transfer(&engine, seg, true, &src, gone.addr(), 4 * MIB, MIB).unwrap();
    // The target stops serving it and tells the peers holding its keys; once told, this engine
    // refuses requests there before posting anything (its cached descriptor had the old keys).
    target.free(&gone).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let before = engine.rdma_stats();
    let err = transfer(&engine, seg, true, &src, gone.addr(), 4 * MIB, MIB).unwrap_err();
    println!("write to the unregistered buffer: {err}");
    assert!(matches!(err, Error::TargetOutOfRange { .. }), "{err}");
    assert_eq!(engine.rdma_stats().work_requests, before.work_requests);
    // A request racing the news fails with a clear error, never a hang.
    target.free(&racing).unwrap();
    let t = Instant::now();
    let err = transfer(&engine, seg, true, &src, racing.addr(), 4 * MIB, MIB).unwrap_err();
    println!("write racing the unregistration: {err} ({:?})", t.elapsed());
    assert!(
        matches!(
            err,
            Error::RemoteRejected { .. } | Error::TargetOutOfRange { .. }
        ),
        "{err}"
    );
    // The peer is still usable.
    let back = engine.allocate(4 * MIB, Location::Any).unwrap();
    transfer(&engine, seg, true, &src, kept.addr(), 4 * MIB, MIB).unwrap();
    transfer(&engine, seg, false, &back, kept.addr(), 4 * MIB, MIB).unwrap();
    assert!(same(&src, &back));
}

/// Payload of message `seq` from sender `from`: its sender and number, then bytes that
/// depend on both; every third one is above the inline size (sent from a staging slot).
fn message(from: u8, seq: u64) -> Vec<u8> {
    let len = if seq.is_multiple_of(3) { 1500 } else { 48 };
    let mut m = vec![0u8; len];
    m[0] = from;
    m[1..9].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in m[9..].iter_mut().enumerate() {
        *b = (seq as usize).wrapping_mul(31).wrapping_add(i) as u8 ^ from;
    }
    m
}

/// `senders` engines each send `per_sender` messages to one receiver configured with
/// `receive` (the `transports.rdma.receive` section); the receiver checks that every sender's
/// messages arrive in order, each once, each byte as sent, and that nothing more comes. Lanes
/// stay where the receive settings put them (`lanes.dynamic` off), so the counts are exact.
fn messages_arrive_fifo_exactly_once(receive: &str, senders: u8, per_sender: u64) {
    let conf = format!(
        r#"{{"transport": "rdma", "lanes": {{"dynamic": false}}, "transports": {{"tcp": {{"timeout_ms": 60000}}, "rdma": {{"receive": {receive}}}}}}}"#
    );
    let receiver = initiator(&conf);
    let name = receiver.name();
    let started = Instant::now();
    let threads: Vec<_> = (0..senders)
        .map(|from| {
            let (conf, name) = (conf.clone(), name.clone());
            std::thread::spawn(move || {
                let engine = initiator(&conf);
                let seg = engine.open_segment(&name).unwrap();
                for seq in 0..per_sender {
                    engine.send(seg, &message(from, seq)).unwrap();
                }
                let stats = engine.rdma_stats();
                assert_eq!(stats.messages_sent, per_sender, "{stats:?}");
                // Every third message is 1500 bytes (staged); the others go inline.
                assert_eq!(stats.messages_inline, per_sender - per_sender.div_ceil(3));
                // Dropping the engine closes its queue pair once every message landed.
                (engine.name(), from)
            })
        })
        .collect();
    let mut next = vec![0u64; senders as usize];
    let mut names = vec![String::new(); senders as usize];
    let total = u64::from(senders) * per_sender;
    for n in 0..total {
        let m = receiver
            .recv(Some(Duration::from_secs(60)))
            .unwrap()
            .unwrap_or_else(|| panic!("message {n} of {total} did not come"));
        let from = m.data[0];
        let seq = u64::from_le_bytes(m.data[1..9].try_into().unwrap());
        let expected = next[from as usize];
        assert_eq!(seq, expected, "sender {from}: out of order or repeated");
        assert_eq!(m.data, message(from, seq), "sender {from} message {seq}");
        next[from as usize] += 1;
        names[from as usize] = m.from.to_string();
    }
    for t in threads {
        let (name, from) = t.join().unwrap();
        assert_eq!(names[from as usize], name);
    }
    assert!(
        receiver
            .recv(Some(Duration::from_millis(500)))
            .unwrap()
            .is_none(),
        "a message arrived twice"
    );
    let stats = receiver.rdma_stats();
    assert_eq!(stats.messages_received, total, "{stats:?}");
    eprintln!(
        "{total} messages from {senders} senders, receive {receive}: {:.1} s ({:.0} messages/s, emulated)",
        started.elapsed().as_secs_f64(),
        total as f64 / started.elapsed().as_secs_f64()
    );
}

/// A receiver with nothing to receive sleeps on its rail's completion channel: each message
/// after 200 ms of silence wakes it, with a few sleeps per message where naps of a millisecond
/// took about two hundred, and every message arrives whole and in order.
#[test]
fn a_receiver_asleep_wakes_on_the_completion_channel() {
    if !rdma_here() {
        return;
    }
    const MESSAGES: u64 = 5;
    let conf = r#"{"transport": "rdma", "lanes": {"dynamic": false},
        "transports": {"rdma": {"receive": {"spin_us": 0}}, "tcp": {"receive": {"spin_us": 0}},
                       "shm": {"receive": {"spin_us": 0}}}}"#;
    let receiver = initiator(conf);
    let name = receiver.name();
    let sender = std::thread::spawn(move || {
        let engine = initiator(conf);
        let seg = engine.open_segment(&name).unwrap();
        for seq in 0..MESSAGES {
            std::thread::sleep(Duration::from_millis(200));
            engine.send(seg, &message(7, seq)).unwrap();
        }
        engine
    });
    for seq in 0..MESSAGES {
        let m = receiver
            .recv(Some(Duration::from_secs(20)))
            .unwrap()
            .unwrap_or_else(|| panic!("message {seq} never woke the receiver"));
        assert_eq!(m.data, message(7, seq), "message {seq}");
    }
    let engine = sender.join().unwrap();
    assert_eq!(receiver.rdma_stats().messages_received, MESSAGES);
    let sleeps = receiver.message_stats().recv_sleeps;
    assert!(
        sleeps <= 10 * MESSAGES,
        "{sleeps} sleeps for {MESSAGES} messages 200 ms apart: napping, not waiting on the channel"
    );
    drop(engine);
}

#[test]
fn a_hundred_thousand_messages_arrive_fifo_exactly_once_over_the_srq_at_depth_63_and_1() {
    if !rdma_here() {
        return;
    }
    // The defaults: a shared receive queue of 63 buffers (RAMCloud's).
    messages_arrive_fifo_exactly_once("{}", 2, 50_000);
    // One buffer: every message waits for the one before it to be consumed and granted again.
    messages_arrive_fifo_exactly_once(r#"{"queue_depth": 1}"#, 2, 50_000);
}

#[test]
fn messages_over_receive_queues_of_their_own_with_bulk_return_and_sges() {
    if !rdma_here() {
        return;
    }
    messages_arrive_fifo_exactly_once(
        r#"{"shared_receive_queue": false, "queue_depth": 16, "registration_chunks": 4, "max_sge": 4, "return_policy": "bulk", "return_order": "after_reply"}"#,
        2,
        5_000,
    );
}

#[test]
fn lane_switches_between_the_srq_and_a_queue_of_its_own_keep_order() {
    if !rdma_here() {
        return;
    }
    let receiver = initiator(RDMA_FIXED_LANES);
    let sender = initiator(RDMA_FIXED_LANES);
    let seg = sender.open_segment(&receiver.name()).unwrap();
    const N: u64 = 20_000;
    let r = std::thread::spawn(move || {
        for i in 0..N {
            let m = receiver
                .recv(Some(Duration::from_secs(60)))
                .unwrap()
                .unwrap_or_else(|| panic!("message {i} did not come"));
            assert_eq!(
                m.data,
                message(0, i),
                "message {i}: out of order, lost or repeated"
            );
        }
        assert!(receiver
            .recv(Some(Duration::from_millis(300)))
            .unwrap()
            .is_none());
        receiver.rdma_stats()
    });
    for i in 0..N {
        if i > 0 && i % 1_000 == 0 {
            let to = if (i / 1_000) % 2 == 1 {
                multirail::Lane::Dedicated
            } else {
                multirail::Lane::Shared
            };
            sender.switch_lane(seg, to).unwrap();
            assert_eq!(sender.lane(seg).unwrap(), to);
        }
        sender.send(seg, &message(0, i)).unwrap();
    }
    let stats = r.join().unwrap();
    assert_eq!(
        stats.messages_received,
        N + N / 1_000 - 1,
        "messages and fences: {stats:?}"
    );
}

#[test]
fn notifications_and_batch_notifications_over_rdma_follow_the_data() {
    if !rdma_here() {
        return;
    }
    let a = initiator(RDMA);
    let b = initiator(RDMA);
    let len = 4 * MIB;
    let dst = b.allocate(len, Location::Any).unwrap();
    let src = a.allocate(len, Location::Any).unwrap();
    fill(&src, 11);
    let seg = a.open_segment(&b.name()).unwrap();
    a.send_notification(seg, "hello").unwrap();
    for round in 0..3 {
        let batch = a.allocate_batch(4).unwrap();
        let q = (len / 4) as u64;
        let reqs: Vec<Request> = (0..4)
            .map(|i| Request::write(src.addr() + i * q, seg, dst.addr() + i * q, q))
            .collect();
        a.submit_with_notification(batch, &reqs, &format!("landed {round}"))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut got = Vec::new();
        while got.is_empty() || (round == 0 && got.len() < 2) {
            got.extend(b.receive_notifications());
            assert!(Instant::now() < deadline, "no notification");
            std::thread::sleep(Duration::from_micros(200));
        }
        if round == 0 {
            assert_eq!(got[0].msg, "hello");
            got.remove(0);
        }
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].msg, format!("landed {round}"));
        assert_eq!(got[0].from, a.name());
        assert!(
            same(&src, &dst),
            "data complete when the notification arrives"
        );
        a.wait(batch, Some(Duration::from_secs(10))).unwrap();
        a.free_batch(batch).unwrap();
        // SAFETY: nothing writes here until the next round's submit.
        unsafe { dst.as_mut_slice().fill(0) };
    }
    let stats = b.rdma_stats();
    assert_eq!(stats.messages_received, 4, "{stats:?}");
    assert!(a.rdma_stats().slices > 0, "the data went over RDMA too");
}

/// A `multirail pingpong --server --transport rdma` child (it answers every message), and its
/// segment name.
fn message_server() -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = Command::new(common::multirail_bin())
        .args([
            "pingpong",
            "--server",
            "--transport",
            "rdma",
            "--listen",
            "127.0.0.1:0",
        ])
        .env_remove("MULTIRAIL_CONF")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line.trim().to_owned())
}

#[test]
fn a_killed_message_receiver_fails_its_sender_within_the_timeout_and_another_goes_on() {
    if !rdma_here() {
        return;
    }
    let conf = r#"{"transport": "rdma", "transports": {"tcp": {"timeout_ms": 3000}}}"#;
    let (mut doomed, doomed_name) = message_server();
    let (mut other, other_name) = message_server();
    let engine = initiator(conf);
    let to_doomed = engine.open_segment(&doomed_name).unwrap();
    let to_other = engine.open_segment(&other_name).unwrap();
    let ping = vec![0x5au8; 128];
    for seg in [to_doomed, to_other] {
        engine.send(seg, &ping).unwrap();
        let answer = engine.recv(Some(Duration::from_secs(20))).unwrap().unwrap();
        assert_eq!(answer.data, ping);
    }
    doomed.kill().unwrap();
    doomed.wait().unwrap();
    let killed = Instant::now();
    let err = loop {
        match engine.send(to_doomed, &ping) {
            Ok(()) => assert!(
                killed.elapsed() < Duration::from_secs(3),
                "sends to a dead receiver still succeed after {:?}",
                killed.elapsed()
            ),
            Err(e) => break e,
        }
    };
    let took = killed.elapsed();
    eprintln!("send to a killed receiver failed after {took:?}: {err}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(
        matches!(
            err,
            Error::PeerDisconnected { .. }
                | Error::SegmentUnreachable { .. }
                | Error::Timeout { .. }
        ),
        "{err}"
    );
    // Answers the doomed server sent before it died may still be queued: drop them.
    while engine
        .recv(Some(Duration::from_millis(200)))
        .unwrap()
        .is_some()
    {}
    for i in 0..200u32 {
        let mut m = ping.clone();
        m[..4].copy_from_slice(&i.to_le_bytes());
        engine.send(to_other, &m).unwrap();
        let answer = engine.recv(Some(Duration::from_secs(20))).unwrap().unwrap();
        assert_eq!(answer.data, m, "round trip {i} with the live server");
        assert_eq!(&*answer.from, other_name);
    }
    let _ = other.kill();
    let _ = other.wait();
}

#[test]
fn pingpong_over_rdma() {
    if !rdma_here() {
        return;
    }
    let out = Command::new(common::multirail_bin())
        .args([
            "pingpong",
            "--local",
            "--transport",
            "rdma",
            "--iterations",
            "2000",
            "--warmup",
            "200",
            "--json",
        ])
        .env_remove("MULTIRAIL_CONF")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["transport"], "rdma");
    assert_eq!(v["iterations"], 2000);
    eprintln!(
        "pingpong over rdma (emulated): {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Group multicast over RDMA WRITEs: 3 member processes, 3 senders, 30,000 messages of 8 to
/// 10240 bytes, every one checked at every member (`mcast-bench` checks length, bytes and
/// exactly-once), then the ordered mode: the same sequence at every member.
#[test]
fn group_multicast_over_rdma_writes_every_message_checked() {
    if !rdma_here() {
        return;
    }
    for delivery in ["unordered", "ordered"] {
        let out = Command::new(common::multirail_bin())
            .args([
                "mcast-bench",
                "--local",
                "--json",
                "--transport",
                "rdma",
                "--members",
                "3",
                "--senders",
                "3",
                "--size",
                "8-10240",
                "--messages",
                "30000",
                "--window",
                "64",
                "--delivery",
                delivery,
            ])
            .env("MULTIRAIL_CONF", RDMA)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("no JSON ({e}): {stderr}"));
        assert_eq!(v["problems"], serde_json::json!([]), "{v}");
        assert!(out.status.success(), "{stderr}");
        assert_eq!(v["transport"], "rdma");
        for m in v["per_member"].as_array().unwrap() {
            assert_eq!(m["delivered"], 30000, "{m}");
        }
        if delivery == "ordered" {
            assert_eq!(v["order_identical"], true, "{v}");
        }
        eprintln!(
            "mcast over rdma (emulated), {delivery}: {:.0} multicasts/s, {:.3} writes each",
            v["multicasts_per_s"].as_f64().unwrap_or(0.0),
            v["writes_per_multicast"]["total"].as_f64().unwrap_or(0.0)
        );
    }
}

#[test]
fn without_rdma_topo_says_why_and_the_rdma_transport_is_a_clear_error() {
    let probe = multirail::rdma_probe(&Config::default());
    let Some(why) = probe.off else {
        eprintln!("skipped: this host has RDMA");
        return;
    };
    let topo = Command::new(common::multirail_bin())
        .arg("topo")
        .output()
        .unwrap();
    assert!(topo.status.success());
    let text = String::from_utf8_lossy(&topo.stdout);
    assert!(text.contains(&format!("RDMA: off: {why}")), "{text}");
    let target = TargetProcess::start("32MiB", None);
    let bench = Command::new(common::multirail_bin())
        .args([
            "bench",
            "--target",
            &target.name,
            "--transport",
            "rdma",
            "--duration",
            "1",
        ])
        .env_remove("MULTIRAIL_CONF")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&bench.stderr);
    assert_eq!(bench.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("transport rdma cannot serve this request"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Messages over rdma: the same clear refusal.
    let ping = Command::new(common::multirail_bin())
        .args([
            "pingpong",
            "--local",
            "--transport",
            "rdma",
            "--iterations",
            "10",
        ])
        .env_remove("MULTIRAIL_CONF")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&ping.stderr);
    assert_eq!(ping.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("rdma"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Dynamic lanes over verbs: a sender sending continuously is promoted by its usage tracker,
/// the receiver grants it a queue pair with receive buffers of its own, and every message
/// arrives once, in order, across the switch from the shared receive queue.
#[test]
fn a_busy_sender_negotiates_a_queue_pair_of_its_own() {
    if !rdma_here() {
        return;
    }
    let conf = r#"{"transport": "rdma", "lanes": {"sample_period": 1}, "transports": {"tcp": {"timeout_ms": 20000}}}"#;
    let receiver = initiator(conf);
    let sender = initiator(conf);
    let seg = sender.open_segment(&receiver.name()).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let receiving = {
        let (receiver, stop) = (receiver.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut next = 0u64;
            loop {
                match receiver.recv(Some(Duration::from_millis(50))).unwrap() {
                    Some(m) => {
                        assert_eq!(m.data, message(0, next), "message {next}");
                        next += 1;
                    }
                    None if stop.load(std::sync::atomic::Ordering::Relaxed) => return next,
                    None => {}
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut sent = 0u64;
    loop {
        sender.send(seg, &message(0, sent)).unwrap();
        sent += 1;
        std::thread::sleep(Duration::from_micros(200));
        let dedicated = sender.lanes().outgoing.first().map(|p| p.lane)
            == Some(multirail::Lane::Dedicated)
            && receiver
                .lanes()
                .incoming
                .iter()
                .any(|p| p.lane == multirail::Lane::Dedicated);
        if dedicated {
            break;
        }
        assert!(Instant::now() < deadline, "{:#?}", sender.lanes());
    }
    for _ in 0..1_000 {
        sender.send(seg, &message(0, sent)).unwrap();
        sent += 1;
    }
    let report = receiver.lanes();
    eprintln!(
        "dedicated after {sent} messages; receiver granting {:?}",
        report.granting
    );
    assert_eq!(report.granting.accepts_sent, 1, "{report:#?}");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(receiving.join().unwrap(), sent);
}
