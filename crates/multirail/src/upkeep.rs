//! The engine's one timer table and the thread that keeps it.
//!
//! Every timed duty of the engine is a key here: each peer's dispatcher deadline (its silence,
//! stalled rails, probes of paused rails, queue expiry, promotion while idle), the link check
//! (sysfs link state and reconnects, every [`LINK_CHECK`]), and, while a global QoS slot holds
//! queued slices back, the start of the next slot that admits them. The thread sleeps until the
//! earliest; arming an earlier deadline wakes it. Nothing runs on a fixed tick when nothing is
//! due, since every wake-up on a busy host can delay a HIGH slice.

use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use multirail_policy::timer::TimerTable;

/// How often rail links are checked (sysfs `operstate`) and lost connections of healthy rails
/// are reopened. Reading link state is polling by nature; a link down goes unnoticed at most
/// this long (its connections then fail on their own, or by the stalled-rail rule).
pub(crate) const LINK_CHECK: Duration = Duration::from_millis(50);

/// A timed duty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum TimerKey {
    /// The dispatcher of the peer with this engine id.
    Peer(u64),
    /// The RDMA dispatcher of the peer with this engine id.
    RdmaPeer(u64),
    /// The link check of every peer.
    Links,
}

/// The engine's timer table: deadlines in ns since `epoch` (the rail scheduler's clock).
pub(crate) struct Timers {
    table: Mutex<TimerTable<TimerKey>>,
    thread: OnceLock<Thread>,
    epoch: Instant,
}

impl Timers {
    /// An empty table on the clock that starts at `epoch`.
    pub(crate) fn new(epoch: Instant) -> Timers {
        Timers {
            table: Mutex::new(TimerTable::new()),
            thread: OnceLock::new(),
            epoch,
        }
    }

    /// Registers the thread that keeps the table.
    pub(crate) fn set_thread(&self, thread: Thread) {
        let _ = self.thread.set(thread);
    }

    /// Sets `key` to fire at `at_ns`, waking the thread when that is earlier than what it
    /// sleeps toward.
    pub(crate) fn arm(&self, key: TimerKey, at_ns: u64) {
        let wake = {
            let mut t = self.table.lock().expect("timers poisoned");
            let before = t.next_deadline();
            t.set(key, Some(at_ns));
            before.is_none_or(|b| at_ns < b)
        };
        if wake {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    /// Clears `key`.
    pub(crate) fn disarm(&self, key: TimerKey) {
        self.table.lock().expect("timers poisoned").set(key, None);
    }

    /// Time until the earliest deadline, if any (zero when one has passed).
    pub(crate) fn until_next(&self, now: Instant) -> Option<Duration> {
        let next = self
            .table
            .lock()
            .expect("timers poisoned")
            .next_deadline()?;
        let now_ns = self.ns(now);
        Some(Duration::from_nanos(next.saturating_sub(now_ns)))
    }

    /// Takes every key due at `now` into `out`.
    pub(crate) fn expire(&self, now: Instant, out: &mut Vec<TimerKey>) {
        let now_ns = self.ns(now);
        self.table
            .lock()
            .expect("timers poisoned")
            .expire(now_ns, out);
    }

    /// `t` in ns since the epoch.
    pub(crate) fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }
}
