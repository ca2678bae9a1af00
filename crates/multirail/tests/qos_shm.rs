//! QoS on the shm data path: the copy workers take HIGH work before MEDIUM and MEDIUM before
//! LOW, promotion still lets LOW finish beside a HIGH stream that never lets up, and every byte
//! of every priority lands where it should.

mod common;
use common::pattern;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use multirail::{
    BatchId, Buffer, Config, Engine, Location, Request, SegmentId, TransportChoice, PRIO_HIGH,
    PRIO_LOW, PRIO_MEDIUM,
};

/// Long enough for anything here on a loaded machine; reaching it means something starved.
const WAIT: Duration = Duration::from_secs(120);

/// The tests of this file run one at a time: each loads the copy workers, and one test's
/// threads competing with another's for the two cores of a CI machine would only blur what
/// each measures.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// An initiator and a target engine in this process, the target's segment opened.
fn engines() -> (Engine, Engine, SegmentId) {
    let init = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let target = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let seg = init.open_segment(&target.name()).expect("segment opens");
    (init, target, seg)
}

/// A shm write of `len` bytes from `src + src_off` to `dst + dst_off` at `priority`.
fn write(
    src: &Buffer,
    src_off: usize,
    seg: SegmentId,
    dst: &Buffer,
    dst_off: usize,
    len: usize,
    priority: multirail::Priority,
) -> Request {
    let mut r = Request::write(
        src.addr() + src_off as u64,
        seg,
        dst.addr() + dst_off as u64,
        len as u64,
    );
    r.priority = priority;
    r.transport = Some(TransportChoice::Shm);
    r
}

/// Submits `r` in a batch of its own.
fn submit(engine: &Engine, r: Request) -> BatchId {
    let b = engine.allocate_batch(1).unwrap();
    engine.submit(b, &[r]).unwrap();
    b
}

fn wait_ok(engine: &Engine, b: BatchId) {
    engine.wait(b, Some(WAIT)).expect("the batch completes");
    assert!(engine.status(b, 0).unwrap().is_completed());
}

/// Whether `dst[dst_off..dst_off + len]` holds `src[..len]`.
fn landed(src: &Buffer, dst: &Buffer, dst_off: usize, len: usize) -> bool {
    // SAFETY: called once the transfers into this range completed; nothing writes it now.
    unsafe { src.as_slice()[..len] == dst.as_slice()[dst_off..dst_off + len] }
}

/// Sixteen LOW writes of 32 MiB, each in its own batch, then one write of 64 KiB at `small`.
/// The small write must complete while at least half of the LOW batches are still pending.
///
/// Workers copy a request in jobs of at most 1 MiB, so the small write waits for at most one
/// such job per worker. Served first come, first served it would wait for all 512 MiB, and
/// could not finish before the last LOW batch or two.
///
/// Sized so that timing cannot make it fail: between the first LOW submit and the status check
/// the test thread makes 17 submits and wakes once, well under a millisecond of work. For half
/// of the LOW batches to finish first, the workers must copy 256 MiB, into pages touched for
/// the first time (each faulted in and zeroed), which takes tens of milliseconds even on a fast
/// idle machine in a release build; a debug build or a loaded machine slows the copies as much
/// as it delays the test thread, which competes with the two workers for the same cores. The
/// buffers and batches are set up before the first submit so nothing else runs in that window,
/// and the tests of this file run one at a time.
fn small_request_passes_queued_low_bulk(small: multirail::Priority, seed: u64) {
    const LOW_REQUESTS: usize = 16;
    const LOW_LEN: usize = 32 << 20;
    const SMALL_LEN: usize = 64 << 10;
    let _serial = serial();
    let (init, target, seg) = engines();
    // One source for every LOW write (read only); a destination range of its own for each.
    let src = init.allocate(LOW_LEN + SMALL_LEN, Location::Any).unwrap();
    let dst = target
        .allocate(LOW_REQUESTS * LOW_LEN + SMALL_LEN, Location::Any)
        .unwrap();
    // SAFETY: no transfer is in flight on this buffer yet.
    unsafe { pattern(seed, src.as_mut_slice()) };
    let lows: Vec<Request> = (0..LOW_REQUESTS)
        .map(|i| write(&src, 0, seg, &dst, i * LOW_LEN, LOW_LEN, PRIO_LOW))
        .collect();
    let small_off = LOW_REQUESTS * LOW_LEN;
    let small_req = write(&src, LOW_LEN, seg, &dst, small_off, SMALL_LEN, small);
    let batches: Vec<BatchId> = (0..LOW_REQUESTS)
        .map(|_| init.allocate_batch(1).unwrap())
        .collect();
    let small_batch = init.allocate_batch(1).unwrap();

    for (b, r) in batches.iter().zip(&lows) {
        init.submit(*b, std::slice::from_ref(r)).unwrap();
    }
    init.submit(small_batch, &[small_req]).unwrap();
    init.wait(small_batch, Some(WAIT)).unwrap();
    let pending = batches
        .iter()
        .filter(|b| !init.status(**b, 0).unwrap().is_completed())
        .count();
    assert!(init.status(small_batch, 0).unwrap().is_completed());
    assert!(
        pending >= LOW_REQUESTS / 2,
        "the priority-{small} write waited for LOW bulk queued before it: only {pending} of \
         {LOW_REQUESTS} LOW batches were pending when it completed"
    );

    for b in &batches {
        wait_ok(&init, *b);
    }
    for i in 0..LOW_REQUESTS {
        assert!(
            landed(&src, &dst, i * LOW_LEN, LOW_LEN),
            "LOW write {i} landed whole"
        );
    }
    // SAFETY: every write completed; nothing writes these buffers now.
    unsafe {
        assert!(
            src.as_slice()[LOW_LEN..] == dst.as_slice()[small_off..],
            "the small write landed whole"
        );
    }

    let qos = init.qos_stats();
    let used = |p: multirail::Priority| qos.priorities[p.index()].dequeued;
    assert!(used(small) >= 1, "{qos:?}");
    assert!(used(PRIO_LOW) >= 1, "{qos:?}");
    let dequeued: u64 = qos.priorities.iter().map(|p| p.dequeued).sum();
    assert!(
        dequeued > LOW_REQUESTS as u64,
        "every request left the queues at least once: {qos:?}"
    );
    assert!(qos.priorities.iter().all(|p| p.queued == 0), "{qos:?}");
}

#[test]
fn high_passes_queued_low_bulk() {
    small_request_passes_queued_low_bulk(PRIO_HIGH, 11);
}

#[test]
fn medium_is_served_before_low_queued_earlier() {
    small_request_passes_queued_low_bulk(PRIO_MEDIUM, 12);
}

/// A HIGH stream that keeps the workers busy all the while (64 writes of 2 MiB in flight,
/// each replaced as soon as it completes) would starve LOW work forever without promotion.
/// With it, a starved LOW job climbs to MEDIUM and then HIGH after 10 ms at each level, and
/// the LOW write completes while the stream still runs. Every byte of both is checked.
#[test]
fn promotion_lets_low_finish_under_a_continuous_high_stream() {
    const DEPTH: usize = 64;
    const HIGH_LEN: usize = 2 << 20;
    const LOW_LEN: usize = 8 << 20;
    let _serial = serial();
    let (init, target, seg) = engines();
    let src = init.allocate(HIGH_LEN + LOW_LEN, Location::Any).unwrap();
    // DEPTH destination slots for the HIGH stream (a slot is rewritten only once the write
    // before it into that slot completed), then the LOW destination.
    let dst = target
        .allocate(DEPTH * HIGH_LEN + LOW_LEN, Location::Any)
        .unwrap();
    // SAFETY: no transfer is in flight on this buffer yet.
    unsafe { pattern(21, src.as_mut_slice()) };
    let low_off = DEPTH * HIGH_LEN;
    let low_done = AtomicBool::new(false);
    let (running_tx, running_rx) = mpsc::channel();

    let high_writes = std::thread::scope(|s| {
        let (init, src, dst, low_done) = (&init, &src, &dst, &low_done);
        let stream = s.spawn(move || {
            let deadline = Instant::now() + 2 * WAIT;
            let slot = |i: usize| write(src, 0, seg, dst, i * HIGH_LEN, HIGH_LEN, PRIO_HIGH);
            let mut ring: Vec<BatchId> = (0..DEPTH).map(|i| submit(init, slot(i))).collect();
            let mut completed = 0usize;
            let mut i = 0;
            while !low_done.load(Ordering::Acquire) && Instant::now() < deadline {
                wait_ok(init, ring[i]);
                init.free_batch(ring[i]).unwrap();
                completed += 1;
                if completed == 1 {
                    running_tx.send(()).unwrap();
                }
                ring[i] = submit(init, slot(i));
                i = (i + 1) % DEPTH;
            }
            for b in ring {
                wait_ok(init, b);
            }
            completed
        });
        running_rx.recv().expect("the HIGH stream runs");
        let low = submit(
            init,
            write(src, HIGH_LEN, seg, dst, low_off, LOW_LEN, PRIO_LOW),
        );
        let finished = init.wait(low, Some(WAIT));
        low_done.store(true, Ordering::Release);
        let completed = stream.join().unwrap();
        finished.expect("LOW completes beside the HIGH stream");
        assert!(init.status(low, 0).unwrap().is_completed());
        completed
    });

    for i in 0..DEPTH {
        assert!(
            landed(&src, &dst, i * HIGH_LEN, HIGH_LEN),
            "HIGH slot {i} holds its bytes"
        );
    }
    // SAFETY: every write completed; nothing writes these buffers now.
    unsafe {
        assert!(
            src.as_slice()[HIGH_LEN..] == dst.as_slice()[low_off..],
            "the LOW write landed whole"
        );
    }
    let qos = init.qos_stats();
    assert!(
        qos.priorities[PRIO_HIGH.index()].dequeued as usize >= high_writes,
        "{qos:?}"
    );
    // The stream keeps about 128 MiB of HIGH jobs queued (tens of ms of copying): for LOW to get
    // through without a promotion, the stream thread would have to fall that far behind each
    // time a LOW job left, every time within 10 ms of the last one.
    assert!(
        qos.promotions >= 1,
        "LOW finished without a promotion: {qos:?}"
    );
    assert!(qos.priorities.iter().all(|p| p.queued == 0), "{qos:?}");
}
