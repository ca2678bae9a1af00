//! A batch is handed to each transport in one call (requests to the same buffer resolved once,
//! a transport's share queued together): requests to several peers and buffers, interleaved,
//! of sizes on both sides of the inline-copy and slice limits, reads beside writes, all land
//! whole, each in its own place, and the batch's statistics count every byte once.

mod common;
use common::{pattern, run_batch};
use std::time::Duration;

use multirail::{Buffer, Config, Engine, Location, Opcode, Request, TransportChoice};

fn engine() -> Engine {
    Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts")
}

/// Sizes that cross shm's inline limit (16 KiB) and the 64 KiB block size, odd ones included.
const SIZES: [usize; 6] = [4096, 16 << 10, (16 << 10) + 1, 64 << 10, 300_001, 1 << 20];

fn interleaved_batch(transport: TransportChoice) {
    let targets = [engine(), engine()];
    let init = engine();
    let total: usize = SIZES.iter().sum::<usize>() * 4;
    // Two buffers per target, so consecutive requests change peer, then buffer.
    let remote: Vec<Vec<Buffer>> = targets
        .iter()
        .map(|t| {
            (0..2)
                .map(|_| t.allocate(total, Location::Any).unwrap())
                .collect()
        })
        .collect();
    let src = init.allocate(total, Location::Any).unwrap();
    let back = init.allocate(total, Location::Any).unwrap();
    // SAFETY: no transfer is in flight on these buffers.
    unsafe { pattern(11, src.as_mut_slice()) };
    let segs: Vec<_> = targets
        .iter()
        .map(|t| init.open_segment(&t.name()).unwrap())
        .collect();
    // (target, buffer, offset in both source and target buffer, length)
    let mut places = Vec::new();
    let mut off = 0usize;
    for round in 0..4 {
        for (i, &len) in SIZES.iter().enumerate() {
            let t = (i + round) % 2;
            let b = (i / 2 + round) % 2;
            places.push((t, b, off, len));
            off += len;
        }
    }
    let request = |op: Opcode, (t, b, off, len): (usize, usize, usize, usize), local: &Buffer| {
        let mut r = Request::write(
            local.addr() + off as u64,
            segs[t],
            remote[t][b].addr() + off as u64,
            len as u64,
        );
        r.opcode = op;
        r.transport = Some(transport);
        r
    };
    let writes: Vec<Request> = places
        .iter()
        .map(|&p| request(Opcode::Write, p, &src))
        .collect();
    let batch = init.allocate_batch(writes.len()).unwrap();
    init.submit(batch, &writes).unwrap();
    init.wait(batch, Some(Duration::from_secs(60))).unwrap();
    for (i, &(t, b, off, len)) in places.iter().enumerate() {
        assert!(init.status(batch, i).unwrap().is_completed());
        // SAFETY: the batch completed; nothing writes these buffers now.
        let (landed, sent) = unsafe {
            (
                &remote[t][b].as_slice()[off..off + len],
                &src.as_slice()[off..off + len],
            )
        };
        assert!(
            landed == sent,
            "write {i} ({len} B to target {t} buffer {b}) landed whole"
        );
    }
    // Reads of the even places beside writes of the odd ones into the other buffer, in one
    // batch: directions are chosen per request.
    let mixed: Vec<Request> = places
        .iter()
        .enumerate()
        .map(|(i, &(t, b, off, len))| {
            if i % 2 == 0 {
                request(Opcode::Read, (t, b, off, len), &back)
            } else {
                request(Opcode::Write, (t, 1 - b, off, len), &src)
            }
        })
        .collect();
    let batch2 = init.allocate_batch(mixed.len()).unwrap();
    init.submit(batch2, &mixed).unwrap();
    init.wait(batch2, Some(Duration::from_secs(60))).unwrap();
    for (i, &(t, b, off, len)) in places.iter().enumerate() {
        // SAFETY: as above.
        let (got, want) = unsafe {
            if i % 2 == 0 {
                (
                    &back.as_slice()[off..off + len],
                    &src.as_slice()[off..off + len],
                )
            } else {
                (
                    &remote[t][1 - b].as_slice()[off..off + len],
                    &src.as_slice()[off..off + len],
                )
            }
        };
        assert!(
            got == want,
            "request {i} of the mixed batch moved its own bytes"
        );
    }
    let moved: u64 = init.traffic_stats().rails.iter().map(|r| r.bytes).sum();
    assert_eq!(moved, 2 * (total / 4 * 4) as u64, "every byte counted once");
}

#[test]
fn an_interleaved_batch_over_shm_lands_every_request_in_its_place() {
    interleaved_batch(TransportChoice::Shm);
}

#[test]
fn an_interleaved_batch_over_tcp_lands_every_request_in_its_place() {
    interleaved_batch(TransportChoice::Tcp);
}

/// Thousands of small requests in scattered order (nothing adjacent, so nothing merged) over
/// tcp: the target reads small WRITE payloads, and the initiator small READ answers, through
/// staging several at a time, with a larger request now and then that goes straight to memory.
/// Each lands in its own place, written and read back.
#[test]
fn scattered_small_requests_over_tcp_each_land_in_their_place() {
    let target = engine();
    let init = engine();
    // 1,500 blocks of 4 KiB, every fifth one 16 KiB + 4 KiB (past the small-payload limit),
    // visited every other block from the last: writes, then reads into another buffer.
    let lens: Vec<usize> = (0..1500)
        .map(|i| if i % 5 == 4 { (16 << 10) + 4096 } else { 4096 })
        .collect();
    let mut offsets = Vec::with_capacity(lens.len());
    let mut off = 0usize;
    for &len in &lens {
        offsets.push(off);
        // A gap after each block: no two requests adjacent.
        off += len + 4096;
    }
    let total = off;
    let remote = target.allocate(total, Location::Any).unwrap();
    let src = init.allocate(total, Location::Any).unwrap();
    let back = init.allocate(total, Location::Any).unwrap();
    // SAFETY: no transfer is in flight on these buffers.
    unsafe { pattern(23, src.as_mut_slice()) };
    let seg = init.open_segment(&target.name()).unwrap();
    let order: Vec<usize> = (0..lens.len())
        .rev()
        .step_by(2)
        .chain((0..lens.len()).rev().skip(1).step_by(2))
        .collect();
    for (op, local) in [(Opcode::Write, &src), (Opcode::Read, &back)] {
        let requests: Vec<Request> = order
            .iter()
            .map(|&i| {
                let mut r = Request::write(
                    local.addr() + offsets[i] as u64,
                    seg,
                    remote.addr() + offsets[i] as u64,
                    lens[i] as u64,
                );
                r.opcode = op;
                r.transport = Some(TransportChoice::Tcp);
                r
            })
            .collect();
        run_batch(&init, &requests);
    }
    // SAFETY: both batches completed; nothing writes these buffers now.
    let (sent, landed, read) = unsafe { (src.as_slice(), remote.as_slice(), back.as_slice()) };
    for (i, (&off, &len)) in offsets.iter().zip(&lens).enumerate() {
        assert!(
            landed[off..off + len] == sent[off..off + len],
            "write {i} landed whole"
        );
        assert!(
            read[off..off + len] == sent[off..off + len],
            "read {i} came back whole"
        );
        let gap = off + len..off + len + 4096;
        assert!(
            landed[gap.clone()].iter().all(|&b| b == 0),
            "nothing beside write {i}"
        );
        assert!(read[gap].iter().all(|&b| b == 0), "nothing beside read {i}");
    }
}
