//! A waiting receiver that polls ahead of a message due at its cadence expects its CPU to
//! itself. On a small host the kernel often puts the message's sender on that very CPU: the
//! sender's timer fires where it last ran, and a doorbell wake places the woken thread beside
//! its waker, after which both keep waking where they last ran while another CPU idles. The
//! two then take turns on one CPU, and each first message after a silence pays two or three
//! context switches: over shm on a 2-vCPU VM, 26–30 µs p50 where the same pair on separate
//! CPUs took 12–19 µs (see docs/benchmarks.md, "Waiting receivers").
//!
//! So a thread's involuntary context switches are read (`getrusage(RUSAGE_THREAD)`) when its
//! wait wakes on the cadence's timer and again before it next sleeps: if another task took its
//! CPU in between, in [`MOVE_AFTER_WINDOWS`] such windows in a row, the thread moves off that
//! CPU before sleeping, so that its next timer fires, and it wakes, elsewhere. Moving narrows
//! its affinity to every allowed CPU but this one (the kernel migrates it at once) and restores
//! the affinity exactly; a thread allowed one CPU stays. Both reads and the move happen off the
//! message's path, while the thread has nothing to receive.

use std::cell::Cell;
use std::io;
use std::time::{Duration, Instant};

/// A thread moves at most once in this long. A move costs two system calls and a migration,
/// and its thread waits for the migration (0.25–1.2 ms on a 2-vCPU VM, whose other vCPU is
/// halted), so this bounds it to a fraction of a percent of the thread's time.
const MOVE_INTERVAL: Duration = Duration::from_millis(10);

/// On a host with more busy threads than CPUs every window finds the CPU taken wherever the
/// thread goes, and moving cannot help: each move doubles the interval before the next, up to
/// this, until a window finds the CPU to itself (which sets it back to [`MOVE_INTERVAL`]).
const MAX_MOVE_INTERVAL: Duration = Duration::from_secs(1);

/// A thread moves after this many windows in a row found its CPU taken. The thread's own
/// process has other threads (an engine's serving and timer threads) that wake now and then
/// and take the CPU for a few µs: 13–20 % of the windows of a `pingpong --server` whose client
/// ran elsewhere saw such a switch, and on two CPUs moving off one means moving onto the
/// sender's. A sender that shares the CPU takes it in every window.
const MOVE_AFTER_WINDOWS: u32 = 2;

#[derive(Clone, Copy)]
struct Watch {
    /// The thread's involuntary switches when its window began; `None` when not watching.
    since: Option<u64>,
    /// Windows in a row that found the CPU taken.
    taken: u32,
    /// When it last moved.
    last_move: Option<Instant>,
    /// The least time from that move to the next.
    interval: Duration,
}

thread_local! {
    static WATCH: Cell<Watch> = const {
        Cell::new(Watch {
            since: None,
            taken: 0,
            last_move: None,
            interval: MOVE_INTERVAL,
        })
    };
}

/// Starts watching the calling thread's CPU: its wait has just woken to poll ahead of a
/// message. Without a switch count from the kernel, nothing is watched.
pub(crate) fn watch() {
    let mut w = WATCH.get();
    w.since = involuntary_switches();
    WATCH.set(w);
}

/// Before the calling thread's wait sleeps: if [`watch`] began a window and another task has
/// taken this thread's CPU since, as in the windows before ([`MOVE_AFTER_WINDOWS`] in all),
/// moves the thread off that CPU (see the module), unless it moved less than its interval ago
/// (see [`MAX_MOVE_INTERVAL`]). Ends the window. True when it moved; false when it had no
/// reason or no other CPU, or the kernel refused (logged: the thread keeps its CPU, and its
/// affinity as it was unless restoring it failed, which is logged as a warning).
pub(crate) fn leave_if_shared() -> bool {
    let mut w = WATCH.get();
    let Some(since) = w.since.take() else {
        return false;
    };
    let preempted = involuntary_switches().is_some_and(|n| n > since);
    if preempted {
        w.taken += 1;
    } else {
        w.taken = 0;
        w.interval = MOVE_INTERVAL;
    }
    let now = Instant::now();
    let due = should_move(w.taken, w.last_move, w.interval, now);
    if due {
        w.last_move = Some(now);
        w.taken = 0;
        w.interval = (w.interval * 2).min(MAX_MOVE_INTERVAL);
    }
    WATCH.set(w);
    if !due {
        return false;
    }
    match move_off_current_cpu() {
        Ok(moved) => moved.is_some(),
        Err(e) => {
            tracing::debug!(error = %e, "moving a waiting thread off a shared CPU");
            false
        }
    }
}

/// Whether a thread whose last `taken` windows in a row found its CPU taken moves now, having
/// last moved at `last_move`: after [`MOVE_AFTER_WINDOWS`] such windows, and `interval` or
/// more after its last move.
fn should_move(taken: u32, last_move: Option<Instant>, interval: Duration, now: Instant) -> bool {
    taken >= MOVE_AFTER_WINDOWS
        && last_move.is_none_or(|t| now.saturating_duration_since(t) >= interval)
}

/// The calling thread's involuntary context switches so far (a task of the same or higher
/// priority took its CPU); `None` if the kernel would not say.
fn involuntary_switches() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a writable rusage the kernel fills; RUSAGE_THREAD asks for this
    // thread's counts only.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: getrusage succeeded, so it filled `usage` (and it was zeroed before anyway).
    let usage = unsafe { usage.assume_init() };
    u64::try_from(usage.ru_nivcsw).ok()
}

/// The CPUs the calling thread may run on.
fn affinity() -> io::Result<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is a plain bit set; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a writable cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(set)
}

/// Lets the calling thread run only on `set`; the kernel migrates it at once if its CPU is
/// not in `set`.
fn set_affinity(set: &libc::cpu_set_t) -> io::Result<()> {
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(set), set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The CPU the calling thread runs on.
fn current_cpu() -> io::Result<usize> {
    // SAFETY: sched_getcpu takes no arguments and only reads this thread's CPU.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).map_err(|_| io::Error::last_os_error())
}

/// Moves the calling thread off the CPU it runs on to another its affinity allows, then
/// restores its affinity as it was. `Ok(Some(cpu))`: the CPU it moved to; `Ok(None)`: its
/// affinity allows no other CPU (or it was not on one its affinity names), so it stayed.
/// Fails when the kernel refuses to read or narrow the affinity (the thread then stays, its
/// affinity untouched), or to restore it (the error says so: the thread is then kept off
/// the CPU it left).
fn move_off_current_cpu() -> io::Result<Option<usize>> {
    let allowed = affinity()?;
    let from = current_cpu()?;
    // SAFETY: CPU_ISSET and CPU_COUNT only read the set; CPU_ISSET checks its index.
    if !unsafe { libc::CPU_ISSET(from, &allowed) } || unsafe { libc::CPU_COUNT(&allowed) } < 2 {
        return Ok(None);
    }
    let mut elsewhere = allowed;
    // SAFETY: `from` < CPU_SETSIZE, since CPU_ISSET found it in the set above.
    unsafe { libc::CPU_CLR(from, &mut elsewhere) };
    set_affinity(&elsewhere)?;
    let to = current_cpu();
    if let Err(e) = set_affinity(&allowed) {
        // Rare (the allowed CPUs changed meanwhile, e.g. the cgroup's), and it matters: the
        // thread stays off a CPU it was allowed.
        tracing::warn!(error = %e, cpu = from,
            "could not restore a waiting thread's CPU affinity after moving it off a CPU");
        return Err(e);
    }
    Ok(to.ok().filter(|&cpu| cpu != from))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_preempted_in_windows_in_a_row_moves_at_most_once_an_interval() {
        let t0 = Instant::now();
        let i = MOVE_INTERVAL;
        assert!(should_move(MOVE_AFTER_WINDOWS, None, i, t0));
        assert!(!should_move(0, None, i, t0), "not preempted: no reason");
        assert!(
            !should_move(MOVE_AFTER_WINDOWS - 1, None, i, t0),
            "too few windows"
        );
        assert!(!should_move(MOVE_AFTER_WINDOWS, Some(t0), i, t0 + i / 2));
        assert!(should_move(MOVE_AFTER_WINDOWS, Some(t0), i, t0 + i));
        assert!(!should_move(MOVE_AFTER_WINDOWS, Some(t0), 2 * i, t0 + i));
    }

    /// The set of exactly `cpus`.
    fn set_of(cpus: &[usize]) -> libc::cpu_set_t {
        // SAFETY: cpu_set_t is a plain bit set; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in cpus {
            // SAFETY: CPU_SET writes one bit of `set`, and checks its index.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
        set
    }

    fn cpus_of(set: &libc::cpu_set_t) -> Vec<usize> {
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: CPU_ISSET only reads the set, and the index is below CPU_SETSIZE.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, set) })
            .collect()
    }

    #[test]
    fn moving_takes_the_thread_to_another_allowed_cpu_and_restores_its_affinity() {
        // In a thread of its own: the test harness's threads keep their affinity.
        std::thread::spawn(|| {
            let allowed = cpus_of(&affinity().unwrap());
            if allowed.len() < 2 {
                // One CPU: the thread must stay, its affinity as it was.
                assert_eq!(move_off_current_cpu().unwrap(), None);
                assert_eq!(cpus_of(&affinity().unwrap()), allowed);
                return;
            }
            let pair = [allowed[0], allowed[1]];
            set_affinity(&set_of(&pair)).unwrap();
            for _ in 0..4 {
                let from = current_cpu().unwrap();
                let to = move_off_current_cpu()
                    .unwrap()
                    .expect("a second CPU is allowed");
                assert_ne!(to, from);
                assert!(pair.contains(&to), "moved to CPU {to}, outside {pair:?}");
                assert_eq!(cpus_of(&affinity().unwrap()), pair.to_vec());
            }
            // Allowed one CPU: it stays there, affinity untouched.
            set_affinity(&set_of(&pair[..1])).unwrap();
            assert_eq!(move_off_current_cpu().unwrap(), None);
            assert_eq!(cpus_of(&affinity().unwrap()), vec![pair[0]]);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_that_found_its_cpu_taken_in_windows_in_a_row_leaves_it_and_others_stay() {
        std::thread::spawn(|| {
            let allowed = cpus_of(&affinity().unwrap());
            if allowed.len() < 2 {
                return;
            }
            let (home, other) = (allowed[0], allowed[1]);
            // Not watched: nothing to leave.
            assert!(!leave_if_shared());
            // Start on `home`, then share it with a thread pinned there that spins.
            set_affinity(&set_of(&[home])).unwrap();
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let hog = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    set_affinity(&set_of(&[home])).unwrap();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            };
            for window in 1..=MOVE_AFTER_WINDOWS {
                watch();
                let start = involuntary_switches().unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                while involuntary_switches().unwrap() == start {
                    assert!(
                        Instant::now() < deadline,
                        "never preempted by a spinning thread"
                    );
                    std::hint::spin_loop();
                }
                if window < MOVE_AFTER_WINDOWS {
                    assert!(!leave_if_shared(), "moved after {window} window(s)");
                    assert_eq!(WATCH.get().taken, window);
                }
            }
            // Now allowed both: the last windows all saw the CPU taken, so the thread leaves
            // the CPU it is on (`home`, unless the kernel has just moved it itself).
            set_affinity(&set_of(&[home, other])).unwrap();
            assert!(leave_if_shared(), "preempted and did not move");
            assert_eq!(cpus_of(&affinity().unwrap()), vec![home, other]);
            assert_eq!(WATCH.get().taken, 0);
            // Until a window finds the CPU to itself, the next move waits twice as long.
            assert_eq!(WATCH.get().interval, 2 * MOVE_INTERVAL);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            hog.join().unwrap();
            // A window in which nothing took the CPU (a switch count that did not move) ends
            // the run of taken windows.
            WATCH.set(Watch {
                since: Some(u64::MAX),
                taken: MOVE_AFTER_WINDOWS - 1,
                ..WATCH.get()
            });
            assert!(!leave_if_shared());
            assert_eq!(WATCH.get().taken, 0);
            assert_eq!(WATCH.get().interval, MOVE_INTERVAL);
            // Within the interval, windows that saw the CPU taken do not move it.
            WATCH.set(Watch {
                since: Some(0),
                taken: MOVE_AFTER_WINDOWS - 1,
                last_move: Some(Instant::now()),
                interval: MOVE_INTERVAL,
            });
            assert!(!leave_if_shared());
        })
        .join()
        .unwrap();
    }
}
