//! Requests of one submit call that follow one another in memory on both sides are moved as
//! one run (`workers.merge_adjacent_max_bytes`): every byte lands in its place, each request
//! reports its own status, a failed run fails each request in it, and a run never crosses
//! what may not be merged (another priority, a gap, the end of a registered region).

mod common;
use common::pattern;
use std::time::Duration;

use multirail::{
    Buffer, Config, Engine, Location, Opcode, Priority, Request, Status, TransportChoice,
};

const WAIT: Option<Duration> = Some(Duration::from_secs(60));

fn engine(config: &Config) -> Engine {
    Engine::new(config.clone(), "127.0.0.1:0").expect("engine starts")
}

fn merging(max: u64) -> Config {
    let mut c = Config::default();
    c.workers.merge_adjacent_max_bytes = max;
    c
}

fn slices_sent(e: &Engine) -> u64 {
    e.traffic_stats().rails.iter().map(|r| r.slices).sum()
}

/// `n` requests of `len` bytes, request `k` at offset `k * len` on both sides.
fn adjacent(
    op: Opcode,
    local: &Buffer,
    seg: multirail::SegmentId,
    remote: &Buffer,
    n: usize,
    len: u64,
    transport: TransportChoice,
) -> Vec<Request> {
    (0..n as u64)
        .map(|k| {
            let mut r = Request::write(local.addr() + k * len, seg, remote.addr() + k * len, len);
            r.opcode = op;
            r.transport = Some(transport);
            r
        })
        .collect()
}

fn run(e: &Engine, reqs: &[Request]) -> multirail::BatchId {
    let batch = e.allocate_batch(reqs.len()).unwrap();
    e.submit(batch, reqs).unwrap();
    e.wait(batch, WAIT).unwrap();
    for i in 0..reqs.len() {
        assert!(
            e.status(batch, i).unwrap().is_completed(),
            "request {i} reports completed"
        );
    }
    batch
}

/// Writes 512 adjacent 4 KiB requests, then reads them back the same way, and checks every
/// byte both ways. Returns the slices the tcp rails sent for the writes.
fn write_then_read_adjacent(config: &Config, transport: TransportChoice) -> u64 {
    const N: usize = 512;
    const LEN: u64 = 4096;
    let target = engine(config);
    let init = engine(config);
    let size = N * LEN as usize;
    let remote = target.allocate(size, Location::Any).unwrap();
    let src = init.allocate(size, Location::Any).unwrap();
    let back = init.allocate(size, Location::Any).unwrap();
    // SAFETY: no transfer is in flight on these buffers.
    unsafe { pattern(21, src.as_mut_slice()) };
    let seg = init.open_segment(&target.name()).unwrap();

    let before = slices_sent(&init);
    let writes = adjacent(Opcode::Write, &src, seg, &remote, N, LEN, transport);
    run(&init, &writes);
    let write_slices = slices_sent(&init) - before;
    // SAFETY: the batch completed; nothing writes these buffers now.
    unsafe {
        for k in 0..N {
            let r = k * LEN as usize..(k + 1) * LEN as usize;
            assert!(
                remote.as_slice()[r.clone()] == src.as_slice()[r],
                "write {k} landed in its place"
            );
        }
    }
    let reads = adjacent(Opcode::Read, &back, seg, &remote, N, LEN, transport);
    run(&init, &reads);
    // SAFETY: as above.
    unsafe {
        assert!(
            back.as_slice() == src.as_slice(),
            "every read brought its own bytes back"
        );
    }
    write_slices
}

#[test]
fn adjacent_tcp_requests_move_as_runs_and_each_lands_in_its_place() {
    let merged = write_then_read_adjacent(&Config::default(), TransportChoice::Tcp);
    let unmerged = write_then_read_adjacent(&merging(0), TransportChoice::Tcp);
    // 2 MiB in runs of at most 1 MiB, cut into 64 KiB slices: 32; one slice per request
    // without merging.
    assert!(
        unmerged >= 512,
        "unmerged: a slice per request, got {unmerged}"
    );
    assert!(
        merged <= 64,
        "merged runs cut into few slices, got {merged} for 512 requests"
    );
}

#[test]
fn adjacent_shm_requests_move_as_runs_and_each_lands_in_its_place() {
    write_then_read_adjacent(&Config::default(), TransportChoice::Shm);
    write_then_read_adjacent(&merging(0), TransportChoice::Shm);
}

#[test]
fn runs_split_at_a_change_of_priority_or_a_gap_and_stay_within_the_limit() {
    // One slice per run at most 1 MiB: the slices sent count the runs.
    let mut config = merging(64 << 10);
    config.workers.block_size = 1 << 20;
    let target = engine(&config);
    let init = engine(&config);
    let remote = target.allocate(1 << 20, Location::Any).unwrap();
    let src = init.allocate(1 << 20, Location::Any).unwrap();
    // SAFETY: no transfer is in flight on these buffers.
    unsafe { pattern(5, src.as_mut_slice()) };
    let seg = init.open_segment(&target.name()).unwrap();
    let req = |off: u64, len: u64, priority: Priority| {
        let mut r = Request::write(src.addr() + off, seg, remote.addr() + off, len);
        r.priority = priority;
        r.transport = Some(TransportChoice::Tcp);
        r
    };
    let mut reqs = Vec::new();
    // Run 1: 8 × 4 KiB HIGH. Run 2: 4 × 4 KiB LOW right behind them.
    for k in 0..8 {
        reqs.push(req(k * 4096, 4096, Priority::High));
    }
    for k in 8..12 {
        reqs.push(req(k * 4096, 4096, Priority::Low));
    }
    // Run 3: after a gap of one byte. Runs 4 and 5: 20 × 4 KiB = 80 KiB over the 64 KiB limit.
    reqs.push(req(12 * 4096 + 1, 100, Priority::Low));
    for k in 0..20 {
        reqs.push(req(65536 + k * 4096, 4096, Priority::Low));
    }
    let before = slices_sent(&init);
    run(&init, &reqs);
    assert_eq!(slices_sent(&init) - before, 5, "five runs, one slice each");
    for r in &reqs {
        let off = (r.source - src.addr()) as usize;
        let len = r.length as usize;
        // SAFETY: the batch completed; nothing writes these buffers now.
        unsafe {
            assert!(remote.as_slice()[off..off + len] == src.as_slice()[off..off + len]);
        }
    }
}

#[test]
fn a_run_never_crosses_the_end_of_a_registered_region() {
    let mut config = Config::default();
    config.workers.block_size = 1 << 20;
    let target = engine(&config);
    let init = engine(&config);
    let remote = target.allocate(256 << 10, Location::Any).unwrap();
    // Two regions registered side by side in one allocation.
    let mut memory = vec![0u8; 256 << 10];
    pattern(8, &mut memory);
    let base = memory.as_mut_ptr();
    let first = init.register(base, 128 << 10, Location::Any).unwrap();
    // SAFETY: `base + 128 KiB` is inside `memory`, which outlives both registrations.
    let second = init
        .register(unsafe { base.add(128 << 10) }, 128 << 10, Location::Any)
        .unwrap();
    assert_eq!(first.addr() + (128 << 10), second.addr());
    let seg = init.open_segment(&target.name()).unwrap();
    let reqs: Vec<Request> = (0..64u64)
        .map(|k| {
            let mut r =
                Request::write(first.addr() + k * 4096, seg, remote.addr() + k * 4096, 4096);
            r.transport = Some(TransportChoice::Tcp);
            r
        })
        .collect();
    let before = slices_sent(&init);
    run(&init, &reqs);
    assert_eq!(
        slices_sent(&init) - before,
        2,
        "one run per registered region"
    );
    // SAFETY: the batch completed; nothing writes the target buffer now.
    unsafe { assert!(remote.as_slice() == &memory[..]) };
    init.unregister(second.addr()).unwrap();
    init.unregister(first.addr()).unwrap();
}

#[test]
fn a_failed_run_fails_every_request_in_it_with_the_reason() {
    let target = engine(&Config::default());
    let init = engine(&Config::default());
    let remote = target.allocate(1 << 20, Location::Any).unwrap();
    let src = init.allocate(1 << 20, Location::Any).unwrap();
    let seg = init.open_segment(&target.name()).unwrap();
    let reqs = adjacent(
        Opcode::Write,
        &src,
        seg,
        &remote,
        64,
        4096,
        TransportChoice::Tcp,
    );
    // The target stops serving the buffer; the initiator still has it in its descriptor.
    target.free(&remote).unwrap();
    let before = slices_sent(&init);
    let batch = init.allocate_batch(reqs.len()).unwrap();
    init.submit(batch, &reqs).unwrap();
    assert!(
        init.wait(batch, WAIT).is_err(),
        "the batch reports a failure"
    );
    // 256 KiB in one run: 4 slices of 64 KiB, not one per request.
    let sent = slices_sent(&init) - before;
    assert!(sent < 64, "the 64 requests went as a run, {sent} slices");
    for i in 0..reqs.len() {
        match init.status(batch, i).unwrap() {
            Status::Failed(e) => {
                let msg = e.to_string();
                assert!(msg.contains("refused"), "request {i} says why: {msg}");
            }
            other => panic!("request {i} of the failed run: {other:?}"),
        }
    }
}
