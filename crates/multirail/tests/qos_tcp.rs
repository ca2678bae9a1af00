//! QoS on the tcp data path: bulk beside HIGH work on a slow rail goes out in pieces that a
//! HIGH slice can pass, and every byte of both still lands where it should.

use std::time::Duration;

use multirail::{Config, Engine, Location, Opcode, Request, TransportChoice, PRIO_HIGH, PRIO_LOW};

/// One loopback rail the scheduler believes carries 10 Mbit/s at most, so bulk slices beside
/// HIGH work are cut to the smallest piece (16 KiB).
fn slow_rail_engine() -> Engine {
    let config = Config::from_json_str(
        r#"{"rails": [{"name": "lo", "address": "127.0.0.1", "bandwidth_gbps": 0.01}],
            "transports": {"rdma": {"min_bandwidth_gbps": 0.001, "default_bandwidth_gbps": 0.01,
                                    "ewma_max_bandwidth_multiplier": 1.0}}}"#,
        "test",
    )
    .expect("valid config");
    Engine::new(config, "127.0.0.1:0").expect("engine starts")
}

fn fill(seed: u8, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8;
    }
}

#[test]
fn bulk_beside_high_goes_out_in_pieces_and_every_byte_lands() {
    const BULK: usize = 4 << 20;
    const HIGH: usize = 64 << 10;
    const HIGH_REQUESTS: usize = 64;
    let target = slow_rail_engine();
    let dst = target
        .allocate(BULK + HIGH * HIGH_REQUESTS, Location::Any)
        .unwrap();
    let init = slow_rail_engine();
    let src = init
        .allocate(BULK + HIGH * HIGH_REQUESTS, Location::Any)
        .unwrap();
    // SAFETY: no transfer is in flight on this buffer yet.
    unsafe { fill(3, src.as_mut_slice()) };
    let seg = init.open_segment(&target.name()).unwrap();

    // Bulk starts once the HIGH stream has completed a request, so it is posted beside HIGH
    // work however the threads are scheduled.
    let started = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let init = &init;
        let src = &src;
        let dst = &dst;
        let started = &started;
        // HIGH requests one after another, as a latency-bound stream does, all the while the
        // bulk request below is moving.
        let high = s.spawn(move || {
            for i in 0..HIGH_REQUESTS {
                let off = (BULK + i * HIGH) as u64;
                let mut r = Request::write(src.addr() + off, seg, dst.addr() + off, HIGH as u64);
                r.priority = PRIO_HIGH;
                r.transport = Some(TransportChoice::Tcp);
                let b = init.allocate_batch(1).unwrap();
                init.submit(b, &[r]).unwrap();
                init.wait(b, Some(Duration::from_secs(60))).unwrap();
                init.free_batch(b).unwrap();
                if i == 0 {
                    started.wait();
                }
            }
        });
        started.wait();
        let mut bulk = Request::write(src.addr(), seg, dst.addr(), BULK as u64);
        bulk.priority = PRIO_LOW;
        bulk.transport = Some(TransportChoice::Tcp);
        let b = init.allocate_batch(1).unwrap();
        init.submit(b, &[bulk]).unwrap();
        init.wait(b, Some(Duration::from_secs(60))).unwrap();
        assert!(init.status(b, 0).unwrap().is_completed());
        init.free_batch(b).unwrap();
        high.join().unwrap();
    });
    // SAFETY: every batch completed; nothing writes these buffers now.
    unsafe { assert!(src.as_slice() == dst.as_slice(), "every byte landed") };

    let rails = init.traffic_stats().rails;
    let bytes: u64 = rails.iter().map(|r| r.bytes).sum();
    let slices: u64 = rails.iter().map(|r| r.slices).sum();
    assert_eq!(bytes, (BULK + HIGH * HIGH_REQUESTS) as u64, "{rails:?}");
    // Whole, the requests make 64 HIGH slices and 32 bulk slices of 128 KiB (a write is cut
    // into at most `max_slices_per_write` = 32); bulk cut to 16 KiB while HIGH was active makes
    // more.
    let whole = (HIGH_REQUESTS + 32) as u64;
    assert!(
        slices > whole,
        "no bulk slice was cut: {slices} slices, {rails:?}"
    );

    // The same bulk read back, alone: nothing to make room for, and the bytes still match.
    let back = init.allocate(BULK, Location::Any).unwrap();
    let read = Request {
        opcode: Opcode::Read,
        source: back.addr(),
        priority: PRIO_LOW,
        transport: Some(TransportChoice::Tcp),
        ..Request::write(0, seg, dst.addr(), BULK as u64)
    };
    let b = init.allocate_batch(1).unwrap();
    init.submit(b, &[read]).unwrap();
    init.wait(b, Some(Duration::from_secs(60))).unwrap();
    // SAFETY: the read completed.
    unsafe {
        assert!(
            back.as_slice() == &src.as_slice()[..BULK],
            "read returned the bytes"
        )
    };
}

/// HIGH slices are written by the submitting thread when the connection is idle and by the
/// sender thread otherwise; several submitters racing each other and a bulk stream must still
/// put every frame on the wire whole and in sequence, so every byte written reads back.
#[test]
fn racing_high_submitters_beside_bulk_write_and_read_back_every_byte() {
    racing_high_beside_bulk(Config::default());
}

/// With one connection per rail, HIGH and bulk slices take turns on it, so the target moves it
/// between the serving pool and the thread that serves HIGH connections again and again.
#[test]
fn one_connection_carrying_high_and_bulk_by_turns_serves_every_byte() {
    let config = Config::from_json_str(
        r#"{"transports": {"tcp": {"connections_per_rail": 1}}}"#,
        "test",
    )
    .expect("valid config");
    racing_high_beside_bulk(config);
}

/// Four submitters write and read back HIGH requests of varied sizes while an 8 MiB LOW write
/// moves, then the bulk is read back; every byte is checked.
fn racing_high_beside_bulk(config: Config) {
    const BULK: usize = 8 << 20;
    const THREADS: usize = 4;
    const PER_THREAD: usize = 48;
    const HIGH: usize = 24 << 10;
    let region = BULK + THREADS * PER_THREAD * HIGH;
    let target = Engine::new(config.clone(), "127.0.0.1:0").expect("engine starts");
    let dst = target.allocate(region, Location::Any).unwrap();
    let init = Engine::new(config, "127.0.0.1:0").expect("engine starts");
    let src = init.allocate(region, Location::Any).unwrap();
    let back = init.allocate(region, Location::Any).unwrap();
    // SAFETY: no transfer is in flight on these buffers yet.
    unsafe { fill(7, src.as_mut_slice()) };
    let seg = init.open_segment(&target.name()).unwrap();

    let run = |r: Request| {
        let b = init.allocate_batch(1).unwrap();
        init.submit(b, &[r]).unwrap();
        init.wait(b, Some(Duration::from_secs(60))).unwrap();
        assert!(init.status(b, 0).unwrap().is_completed());
        init.free_batch(b).unwrap();
    };
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let run = &run;
            let (src, back, dst) = (&src, &back, &dst);
            s.spawn(move || {
                for i in 0..PER_THREAD {
                    // Sizes vary so frames of different lengths interleave on the socket.
                    let len = (HIGH - (i * 977) % (HIGH / 2)) as u64;
                    let off = (BULK + (t * PER_THREAD + i) * HIGH) as u64;
                    let mut w = Request::write(src.addr() + off, seg, dst.addr() + off, len);
                    w.transport = Some(TransportChoice::Tcp);
                    run(w);
                    let r = Request {
                        opcode: Opcode::Read,
                        source: back.addr() + off,
                        ..w
                    };
                    run(r);
                }
            });
        }
        let mut bulk = Request::write(src.addr(), seg, dst.addr(), BULK as u64);
        bulk.priority = PRIO_LOW;
        bulk.transport = Some(TransportChoice::Tcp);
        run(bulk);
    });
    let bulk_back = Request {
        opcode: Opcode::Read,
        source: back.addr(),
        priority: PRIO_LOW,
        transport: Some(TransportChoice::Tcp),
        ..Request::write(0, seg, dst.addr(), BULK as u64)
    };
    run(bulk_back);
    // SAFETY: every batch completed; nothing writes these buffers now.
    unsafe {
        let (src, back) = (src.as_slice(), back.as_slice());
        assert!(src[..BULK] == back[..BULK], "bulk read back whole");
        for t in 0..THREADS {
            for i in 0..PER_THREAD {
                let len = HIGH - (i * 977) % (HIGH / 2);
                let off = BULK + (t * PER_THREAD + i) * HIGH;
                assert!(
                    src[off..off + len] == back[off..off + len],
                    "HIGH request {i} of submitter {t} read back whole"
                );
            }
        }
    }
}
