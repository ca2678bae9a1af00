//! Two engines in separate processes: 1 GiB each way over each transport with every byte
//! checked, and a peer that dies or stops answering mid-transfer.

mod common;

use std::time::{Duration, Instant};

use common::TargetProcess;
use multirail::{Config, Engine, Error, Location, Opcode, Request, SegmentId, TransportChoice};
use multirail_cli::pattern;

const GIB: u64 = 1 << 30;
const PIECE: u64 = 64 << 20;

fn requests(
    op: Opcode,
    local: u64,
    seg: SegmentId,
    remote: u64,
    len: u64,
    t: TransportChoice,
) -> Vec<Request> {
    (0..len / PIECE)
        .map(|i| Request {
            opcode: op,
            source: local + i * PIECE,
            target: seg,
            target_offset: remote + i * PIECE,
            length: PIECE,
            priority: multirail::PRIO_HIGH,
            transport: Some(t),
        })
        .collect()
}

fn run(engine: &Engine, reqs: &[Request]) -> multirail::Result<()> {
    let batch = engine.allocate_batch(reqs.len())?;
    engine.submit(batch, reqs)?;
    let out = engine.wait(batch, Some(Duration::from_secs(120)));
    if out.is_ok() {
        engine.free_batch(batch)?;
    }
    out
}

fn one_gib_each_way(transport: TransportChoice) {
    let target = TargetProcess::start("1GiB", None);
    let engine = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
    let seg = engine.open_segment(&target.name).unwrap();
    let desc = engine.segment_descriptor(seg).unwrap();
    assert_eq!(desc.pid as i32, target.pid());
    let remote = desc
        .buffers
        .iter()
        .find(|b| b.len == GIB)
        .expect("1 GiB buffer")
        .addr;

    // Read: the target filled its buffer with its pattern before printing its name.
    let local = engine.allocate(GIB as usize, Location::Any).unwrap();
    run(
        &engine,
        &requests(Opcode::Read, local.addr(), seg, remote, GIB, transport),
    )
    .unwrap();
    // SAFETY: the batch completed; nothing is in flight on `local`.
    let bytes = unsafe { local.as_slice() };
    assert_eq!(
        pattern::first_mismatch(bytes, 0, pattern::TARGET_SEED),
        None,
        "read 1 GiB"
    );

    // Write our own pattern over the whole buffer, then read it back into fresh memory.
    // SAFETY: nothing is in flight on `local`.
    pattern::fill(unsafe { local.as_mut_slice() }, 0, pattern::INITIATOR_SEED);
    run(
        &engine,
        &requests(Opcode::Write, local.addr(), seg, remote, GIB, transport),
    )
    .unwrap();
    let back = engine.allocate(GIB as usize, Location::Any).unwrap();
    run(
        &engine,
        &requests(Opcode::Read, back.addr(), seg, remote, GIB, transport),
    )
    .unwrap();
    // SAFETY: as above.
    let bytes = unsafe { back.as_slice() };
    assert_eq!(
        pattern::first_mismatch(bytes, 0, pattern::INITIATOR_SEED),
        None,
        "wrote 1 GiB"
    );

    let moved: u64 = engine
        .traffic_stats()
        .rails
        .iter()
        .filter(|r| (r.name == "shm") == (transport == TransportChoice::Shm))
        .map(|r| r.bytes)
        .sum();
    assert_eq!(moved, 3 * GIB, "every byte went over {transport}");
}

#[test]
fn one_gib_each_way_over_shm() {
    one_gib_each_way(TransportChoice::Shm);
}

#[test]
fn one_gib_each_way_over_tcp() {
    one_gib_each_way(TransportChoice::Tcp);
}

fn engine_with_timeout(ms: u64) -> Engine {
    let conf = format!(r#"{{"transports": {{"tcp": {{"timeout_ms": {ms}}}}}}}"#);
    Engine::new(Config::from_json_str(&conf, "test").unwrap(), "127.0.0.1:0").unwrap()
}

fn first_buffer(engine: &Engine, seg: SegmentId) -> u64 {
    engine.segment_descriptor(seg).unwrap().buffers[0].addr
}

/// Submits a long tcp write to `seg`, returns its batch.
fn long_write(engine: &Engine, local: u64, seg: SegmentId) -> multirail::BatchId {
    let remote = first_buffer(engine, seg);
    let reqs = requests(
        Opcode::Write,
        local,
        seg,
        remote,
        512 << 20,
        TransportChoice::Tcp,
    );
    let reqs: Vec<Request> = reqs.iter().cycle().take(64).copied().collect();
    let batch = engine.allocate_batch(reqs.len()).unwrap();
    engine.submit(batch, &reqs).unwrap();
    batch
}

#[test]
fn killed_peer_fails_in_flight_requests_and_others_go_on() {
    let doomed = TargetProcess::start("512MiB", None);
    let healthy = TargetProcess::start("64MiB", None);
    let engine = engine_with_timeout(2000);
    let local = engine.allocate(512 << 20, Location::Any).unwrap();
    let doomed_seg = engine.open_segment(&doomed.name).unwrap();
    let healthy_seg = engine.open_segment(&healthy.name).unwrap();

    let batch = long_write(&engine, local.addr(), doomed_seg);
    std::thread::sleep(Duration::from_millis(100));
    doomed.signal(libc::SIGKILL);
    let t0 = Instant::now();
    let err = engine
        .wait(batch, Some(Duration::from_secs(10)))
        .unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "failed within the timeout: {:?}",
        t0.elapsed()
    );
    assert!(
        matches!(err, Error::PeerDisconnected { .. } | Error::Timeout { .. }),
        "{err}"
    );
    assert!(matches!(engine.free_batch(batch), Ok(())));

    // The other peer is unaffected.
    let remote = first_buffer(&engine, healthy_seg);
    run(
        &engine,
        &requests(
            Opcode::Write,
            local.addr(),
            healthy_seg,
            remote,
            64 << 20,
            TransportChoice::Tcp,
        ),
    )
    .unwrap();
    // New work for the dead peer is refused, not hung.
    let b = engine.allocate_batch(1).unwrap();
    let r = Request::write(
        local.addr(),
        doomed_seg,
        first_buffer(&engine, doomed_seg),
        4096,
    );
    let outcome = engine
        .submit(b, &[r])
        .and_then(|_| engine.wait(b, Some(Duration::from_secs(10))));
    assert!(outcome.is_err(), "a dead peer cannot complete a write");
}

#[test]
fn silent_peer_times_out() {
    let frozen = TargetProcess::start("512MiB", None);
    let engine = engine_with_timeout(1000);
    let local = engine.allocate(512 << 20, Location::Any).unwrap();
    let seg = engine.open_segment(&frozen.name).unwrap();
    // A first transfer opens the data connections, which then outlive the stop.
    let remote = first_buffer(&engine, seg);
    let warm = requests(
        Opcode::Write,
        local.addr(),
        seg,
        remote,
        PIECE,
        TransportChoice::Tcp,
    );
    run(&engine, &warm).unwrap();
    // Stop the process: its sockets stay open, so only our timeout can notice.
    frozen.signal(libc::SIGSTOP);
    let batch = long_write(&engine, local.addr(), seg);
    let t0 = Instant::now();
    let err = engine
        .wait(batch, Some(Duration::from_secs(10)))
        .unwrap_err();
    let waited = t0.elapsed();
    assert!(
        matches!(
            err,
            Error::Timeout {
                timeout_ms: 1000,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    frozen.signal(libc::SIGCONT);
}

/// Connections opened to a stopped process used to "succeed" (the kernel completes the TCP
/// handshake from its backlog); the membership handshake waits for the engine itself, so a
/// stopped peer is unreachable within connect_timeout_ms instead of taking slices.
#[test]
fn opening_connections_to_a_stopped_peer_fails_within_the_connect_timeout() {
    let frozen = TargetProcess::start("64MiB", None);
    let conf = r#"{"transports": {"tcp": {"connect_timeout_ms": 500, "timeout_ms": 1000}}}"#;
    let engine = Engine::new(Config::from_json_str(conf, "test").unwrap(), "127.0.0.1:0").unwrap();
    let local = engine.allocate(PIECE as usize, Location::Any).unwrap();
    let seg = engine.open_segment(&frozen.name).unwrap();
    frozen.signal(libc::SIGSTOP);
    let remote = first_buffer(&engine, seg);
    let reqs = requests(
        Opcode::Write,
        local.addr(),
        seg,
        remote,
        PIECE,
        TransportChoice::Tcp,
    );
    let t0 = Instant::now();
    let err = run(&engine, &reqs).unwrap_err();
    let waited = t0.elapsed();
    frozen.signal(libc::SIGCONT);
    assert!(
        matches!(
            err,
            Error::SegmentUnreachable { .. } | Error::Timeout { .. }
        ),
        "{err}"
    );
    assert!(waited < Duration::from_millis(2500), "{waited:?}");
}

/// Posts prepared `list`, which was prepared for a process that no longer serves its segment,
/// and checks that it is refused with the advice to prepare it again.
fn assert_list_must_be_prepared_again(engine: &Engine, list: multirail::PreparedListId) {
    let batch = engine.allocate_batch(1).unwrap();
    let posted = engine
        .submit_prepared(batch, list, Opcode::Write, multirail::PRIO_HIGH, None)
        .unwrap_err();
    assert!(
        posted.to_string().contains("prepare the list again"),
        "{posted}"
    );
}

/// A handle keeps the process it was opened on: once that process exits, requests through it
/// are refused with an error that says to open the segment again, and a segment opened again
/// reaches the process restarted at the same address, both ways, every byte checked.
#[test]
fn a_restarted_peer_is_reached_through_the_segment_opened_again() {
    let first = TargetProcess::start("16MiB", None);
    let name = first.name.clone();
    let engine = engine_with_timeout(2000);
    let local = engine.allocate(4 << 20, Location::Any).unwrap();
    let write = |seg: SegmentId| {
        run(
            &engine,
            &[Request {
                transport: Some(TransportChoice::Tcp),
                ..Request::write(local.addr(), seg, first_buffer(&engine, seg), 4 << 20)
            }],
        )
    };
    let old = engine.open_segment(&name).unwrap();
    write(old).unwrap();
    let list = engine
        .prepare(
            &[multirail::PreparedEntry {
                source: local.addr(),
                target: old,
                target_offset: first_buffer(&engine, old),
                length: 4096,
            }],
            Some(TransportChoice::Tcp),
        )
        .unwrap();
    first.signal(libc::SIGKILL);
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    let refused = loop {
        match write(old) {
            Err(e @ Error::PeerDisconnected { .. }) => break e,
            Err(e) if Instant::now() < deadline => eprintln!("meanwhile: {e}"),
            other => assert!(Instant::now() < deadline, "death never noticed: {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        refused.to_string().contains("open the segment again"),
        "{refused}"
    );
    assert_list_must_be_prepared_again(&engine, list);

    let second = TargetProcess::start_with("16MiB", None, &["--listen", &name]);
    assert_eq!(second.name, name, "restarted at the same address");
    let seg = engine.open_segment(&name).unwrap();
    // SAFETY: no transfer touches `local` while these slices live.
    pattern::fill(unsafe { local.as_mut_slice() }, 0, 42);
    write(seg).unwrap();
    // SAFETY: as above; the write has completed.
    unsafe { local.as_mut_slice() }.fill(0);
    run(
        &engine,
        &[Request {
            transport: Some(TransportChoice::Tcp),
            ..Request::read(local.addr(), seg, first_buffer(&engine, seg), 4 << 20)
        }],
    )
    .unwrap();
    // SAFETY: the read has completed and nothing else moves into `local`.
    let back = unsafe { local.as_slice() };
    assert!(
        pattern::first_mismatch(back, 0, 42).is_none(),
        "the bytes read back from the restarted peer are the ones written"
    );
}

/// `multirail target` serving `size` on `listen` in a PID namespace of its own, so that to this
/// test's engine it is on another host (a peer with no pidfd, reached over tcp), as a remote
/// peer is. `None` when this host cannot make the namespace (not root, no `unshare`). A port
/// left by a target just killed may take a moment to be free: tries for 5 s.
fn remote_target(size: &str, listen: &str) -> Option<TargetProcess> {
    let namespaces = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "--mount-proc", "true"])
        .stderr(std::process::Stdio::null())
        .status();
    if !namespaces.is_ok_and(|s| s.success()) {
        eprintln!("skipped: cannot make a PID namespace here (needs root and unshare)");
        return None;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut child = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc"])
            .arg(common::multirail_bin())
            .args(["target", "--listen", listen, "--size", size])
            .env_remove("MULTIRAIL_CONF")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start unshare");
        let mut line = String::new();
        use std::io::BufRead;
        let _ = std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
        if line.trim() == listen {
            return Some(TargetProcess {
                child,
                name: listen.to_owned(),
            });
        }
        let status = child.wait();
        assert!(
            Instant::now() < deadline,
            "no target on {listen} within 5 s (last: {status:?}, {line:?})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A remote peer restarted on its address is followed by an initiator that lives on: the
/// handle it holds (opening the segment again gives the same one) reaches the new process at
/// its first request, and a request for a range only the old process had fails at submit
/// naming the range, instead of being refused by the new process for the old key. Every byte
/// written is read back.
#[test]
fn a_remote_peer_restarted_on_its_address_is_followed_by_a_long_lived_initiator() {
    let listen = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    let Some(first) = remote_target("4MiB", &listen) else {
        return;
    };
    let engine = engine_with_timeout(2000);
    let local = engine.allocate(1 << 20, Location::Any).unwrap();
    let seg = engine.open_segment(&listen).unwrap();
    let desc = engine.segment_descriptor(seg).unwrap();
    assert_ne!(
        desc.host_id,
        multirail::segment::local_host_id(),
        "the target looks like another host"
    );
    let round_trip = |remote: u64, seed: u64| -> multirail::Result<()> {
        // SAFETY: no transfer touches `local` between these calls.
        pattern::fill(unsafe { local.as_mut_slice() }, 0, seed);
        run(
            &engine,
            &[Request::write(local.addr(), seg, remote, 1 << 20)],
        )?;
        // SAFETY: as above; the write has completed.
        unsafe { local.as_mut_slice() }.fill(0);
        run(
            &engine,
            &[Request::read(local.addr(), seg, remote, 1 << 20)],
        )?;
        // SAFETY: the read has completed and nothing else moves into `local`.
        let back = unsafe { local.as_slice() };
        assert!(
            pattern::first_mismatch(back, 0, seed).is_none(),
            "the bytes read back are the ones written"
        );
        Ok(())
    };
    round_trip(desc.buffers[0].addr, 1).unwrap();
    let list = engine
        .prepare(
            &[multirail::PreparedEntry {
                source: local.addr(),
                target: seg,
                target_offset: desc.buffers[0].addr,
                length: 4096,
            }],
            None,
        )
        .unwrap();

    // Restarted: the new process's buffer, as a fresh engine sees it.
    drop(first);
    let Some(second) = remote_target("4MiB", &listen) else {
        return;
    };
    let fresh = engine_with_timeout(2000);
    let fresh_seg = fresh.open_segment(&listen).unwrap();
    let second_buffer = first_buffer(&fresh, fresh_seg);
    assert_eq!(
        engine.open_segment(&listen).unwrap(),
        seg,
        "the same handle"
    );
    round_trip(second_buffer, 2)
        .unwrap_or_else(|e| panic!("the first request after the restart: {e}"));
    assert_eq!(
        first_buffer(&engine, seg),
        second_buffer,
        "the handle follows"
    );
    // A list prepared for the old process holds its keys.
    assert_list_must_be_prepared_again(&engine, list);

    // Restarted again; the old range asked for first.
    drop(second);
    let Some(_third) = remote_target("4MiB", &listen) else {
        return;
    };
    // A handle reaches the process it was opened on until a request finds another: ask a
    // new engine.
    let fresh = engine_with_timeout(2000);
    let third_buffer = first_buffer(&fresh, fresh.open_segment(&listen).unwrap());
    if third_buffer != second_buffer {
        // A connection found closed had the descriptor fetched again: the old range is
        // named, not refused by the new process for the old key.
        let err = run(
            &engine,
            &[Request::write(local.addr(), seg, second_buffer, 1 << 20)],
        )
        .unwrap_err();
        assert!(
            matches!(err, Error::TargetOutOfRange { .. }),
            "the old range after the restart: {err}"
        );
    }
    round_trip(third_buffer, 3).unwrap_or_else(|e| panic!("after the second restart: {e}"));
}

#[test]
fn dead_same_host_peer_is_refused_over_shm() {
    let doomed = TargetProcess::start("16MiB", None);
    let engine = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
    let local = engine.allocate(16 << 20, Location::Any).unwrap();
    let seg = engine.open_segment(&doomed.name).unwrap();
    let remote = first_buffer(&engine, seg);
    let r = Request {
        transport: Some(TransportChoice::Shm),
        ..Request::write(local.addr(), seg, remote, 1 << 20)
    };
    run(&engine, &[r]).unwrap();
    doomed.signal(libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let b = engine.allocate_batch(1).unwrap();
        match engine.submit(b, &[r]) {
            Err(Error::PeerDisconnected { .. }) => break,
            Err(e) => panic!("unexpected error {e}"),
            Ok(()) => {
                engine.wait(b, Some(Duration::from_secs(5))).unwrap();
                assert!(Instant::now() < deadline, "death never noticed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

#[test]
fn registered_memory_of_a_same_host_peer_moves_with_process_vm() {
    let target = TargetProcess::start_with("64MiB", None, &["--memory", "registered"]);
    let engine = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
    let seg = engine.open_segment(&target.name).unwrap();
    let desc = engine.segment_descriptor(seg).unwrap();
    assert!(
        desc.buffers[0].shm.is_none(),
        "registered memory has no shared-memory handle"
    );
    let remote = desc.buffers[0].addr;
    let len = 64u64 << 20;
    let local = engine.allocate(len as usize, Location::Any).unwrap();
    let read = Request {
        transport: Some(TransportChoice::Shm),
        ..Request::read(local.addr(), seg, remote, len)
    };
    run(&engine, &[read]).unwrap();
    // SAFETY: the batch completed; nothing is in flight on `local`.
    assert_eq!(
        pattern::first_mismatch(unsafe { local.as_slice() }, 0, pattern::TARGET_SEED),
        None
    );
    // SAFETY: as above.
    pattern::fill(unsafe { local.as_mut_slice() }, 0, pattern::INITIATOR_SEED);
    run(
        &engine,
        &[Request {
            opcode: Opcode::Write,
            ..read
        }],
    )
    .unwrap();
    let back = engine.allocate(len as usize, Location::Any).unwrap();
    let tcp_read = Request {
        transport: Some(TransportChoice::Tcp),
        ..Request::read(back.addr(), seg, remote, len)
    };
    run(&engine, &[tcp_read]).unwrap();
    // SAFETY: as above.
    assert_eq!(
        pattern::first_mismatch(unsafe { back.as_slice() }, 0, pattern::INITIATOR_SEED),
        None
    );
    let shm_bytes: u64 = engine
        .traffic_stats()
        .rails
        .iter()
        .filter(|r| r.name == "shm")
        .map(|r| r.bytes)
        .sum();
    assert_eq!(shm_bytes, 2 * len);
}
