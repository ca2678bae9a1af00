//! A receiver that polls ahead of messages due at a steady cadence, and keeps finding its CPU
//! taken by another task while it does, moves its thread to another CPU it may run on
//! (`transports.<t>.receive.leave_shared_cpu`): it still gets every message, in order, its
//! thread's affinity is as it was afterwards, and `MessageStats::recv_cpu_moves` counts the
//! moves. In a file of its own: it keeps two CPUs busy for a few seconds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use multirail::{Config, Engine};

/// One message every GAP; the receiver wakes LEAD before each is due and polls for it, long
/// enough (several scheduler ticks) that a task spinning on the same CPU takes it meanwhile.
const GAP: Duration = Duration::from_millis(100);
const LEAD_US: u64 = 5_000;
const MESSAGES: u64 = 40;

fn engine(leave_shared_cpu: bool) -> Engine {
    let receive = format!(
        r#"{{"spin_us": 200, "cadence_lead_us": {LEAD_US}, "leave_shared_cpu": {leave_shared_cpu}}}"#
    );
    let json = format!(
        r#"{{"transport": "shm",
            "transports": {{"tcp": {{"receive": {receive}}}, "shm": {{"receive": {receive}}},
                            "rdma": {{"receive": {receive}}}}}}}"#
    );
    Engine::new(
        Config::from_json_str(&json, "test").expect("valid config"),
        "127.0.0.1:0",
    )
    .expect("engine")
}

fn message(i: u64) -> Vec<u8> {
    let mut m: Vec<u8> = (0..64u64).map(|k| (k ^ i) as u8).collect();
    m[..8].copy_from_slice(&i.to_le_bytes());
    m
}

/// The CPUs the calling thread may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is a plain bit set; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a writable cpu_set_t of the size passed; pid 0 is this thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET only reads the set, at an index below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Lets the calling thread run only on `cpus`.
fn run_on(cpus: &[usize]) {
    // SAFETY: cpu_set_t is a plain bit set; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: CPU_SET writes one bit of `set`, and checks its index.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is this thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
}

/// Receives MESSAGES messages sent one every GAP on a schedule, on a receiver thread allowed
/// `pair` whose CPUs each have a thread spinning on them; returns the receiver's stats.
fn receive_beside_spinners(pair: [usize; 2], leave_shared_cpu: bool) -> multirail::MessageStats {
    let stop = Arc::new(AtomicBool::new(false));
    let spinners: Vec<_> = pair
        .iter()
        .map(|&cpu| {
            let stop = stop.clone();
            thread::spawn(move || {
                run_on(&[cpu]);
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let rx = engine(leave_shared_cpu);
    let tx = engine(leave_shared_cpu);
    let rx_name = rx.name();
    let sender = thread::spawn(move || {
        let seg = tx.open_segment(&rx_name).unwrap();
        let start = Instant::now();
        for i in 0..MESSAGES {
            // On a schedule, not after a sleep each: the gaps stay even.
            let due = start + GAP * (i as u32 + 1);
            thread::sleep(due.saturating_duration_since(Instant::now()));
            tx.send(seg, &message(i)).unwrap();
        }
        tx
    });
    let stats = thread::spawn(move || {
        run_on(&pair);
        for i in 0..MESSAGES {
            let m = rx
                .recv(Some(Duration::from_secs(20)))
                .unwrap()
                .unwrap_or_else(|| panic!("message {i} never came"));
            assert_eq!(m.data, message(i), "message {i}");
        }
        assert_eq!(
            allowed_cpus(),
            pair.to_vec(),
            "the receiver's affinity changed"
        );
        rx.message_stats()
    })
    .join()
    .unwrap();
    let tx = sender.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    for s in spinners {
        s.join().unwrap();
    }
    drop(tx);
    stats
}

#[test]
fn a_receiver_polling_ahead_on_a_cpu_another_task_takes_moves_and_gets_every_message() {
    let cpus = allowed_cpus();
    if cpus.len() < 2 {
        eprintln!("one CPU allowed: nothing to move to");
        return;
    }
    let pair = [cpus[0], cpus[1]];
    let stats = receive_beside_spinners(pair, true);
    eprintln!("moving: {stats:?}");
    assert_eq!(stats.received, MESSAGES);
    // Both CPUs are taken, so every window finds its CPU taken wherever the receiver goes: it
    // moves (less often each time), as long as it polled ahead of a few messages.
    if stats.recv_anticipated >= 4 {
        assert!(
            stats.recv_cpu_moves >= 1,
            "{} messages polled for ahead beside a spinning thread, no move: {stats:?}",
            stats.recv_anticipated
        );
    }
    // Turned off, it never moves.
    let stats = receive_beside_spinners(pair, false);
    eprintln!("staying: {stats:?}");
    assert_eq!(stats.received, MESSAGES);
    assert_eq!(stats.recv_cpu_moves, 0, "{stats:?}");
}
