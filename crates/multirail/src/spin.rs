//! How long a waiting thread polls before it sleeps, learned from how long its recent waits
//! lasted. Polling costs a core while it lasts; sleeping costs a wake-up when the wait ends,
//! which on a virtual machine with an idle vCPU is tens of microseconds (the kernel places the
//! woken thread on the idle vCPU and must interrupt it out of its halt). A wait that usually
//! ends within the spin should keep spinning; one that usually outlasts it should sleep soon.
//!
//! Two users, with different floors: a message receive (`messaging`) never spins less than a
//! quarter of its cap, since a receiver whose peer was descheduled now and then must not fall
//! into sleeping between the messages of a ping-pong; a batch `wait` (`engine`) may learn to
//! sleep at once, since a transfer that outlasts the cap (a 16 MiB batch takes milliseconds)
//! pays its one wake-up in well under a percent of its time.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

/// A waiting poll (a message receive, a batch `wait`) that has spun this long yields its core
/// now and then, so that a thread sharing the core (more pollers than cores; or a receiver
/// that a wake-up placed on its sender's core, where it stays while other work keeps the other
/// cores busy) answers within tens of µs rather than a time slice. Far longer than a busy wait
/// (under 1 µs over shm, ~8 µs over tcp here): a yield lets whatever else is runnable have the
/// core, and yielding after 4 µs (shm) and 12 µs (tcp) made a quiet ping-pong's p99 ten times
/// worse (0.9 -> 10 µs over shm) while its median stayed put.
pub(crate) const YIELD_AFTER: Duration = Duration::from_micros(50);

/// On a host of at most [`FEW_CPUS`] CPUs, a batch `wait` whose transfers are expected to take
/// longer than this (their bytes over their peers' estimated rates), cut into more slices than
/// a tcp path has connections (so that each connection's threads run for the whole batch),
/// sleeps at once instead of polling. Its one wake-up then costs a small share of the wait,
/// while a poll would hold a core that the engine's own threads need to move the bytes: over
/// loopback tcp on two cores, HIGH batches of 16 × 64 KiB (about 250 µs each, four slices
/// carried by two connections' sending and serving threads) moved 3.45 GB/s with the waiter
/// polling and 4.2 GB/s with it asleep (medians of 4 runs of 8 s). Requests of one or two
/// slices keep polling: asleep, a 64 KiB request's p50 went from 57 µs to 80–92 µs.
pub(crate) const SLEEP_WHEN_EXPECTED_OVER: Duration = Duration::from_micros(100);

/// Hosts with at most this many CPUs have none to spare for a polling waiter while a batch's
/// bytes move over tcp: two connections' sending threads on this side and, over loopback,
/// their serving threads on the other. With more, a poll finds an idle core and saves the
/// wake-up (when a HIGH transfer kept to one connection, polling up to 1000 µs rather than
/// 100 µs moved 16 × 64 KiB reads at 2.98 instead of 2.56 GB/s on two cores).
pub(crate) const FEW_CPUS: usize = 4;

/// How many threads may poll at once in a batch `wait`, so that waiters never outnumber the
/// cores the engine's own threads need: half the host's CPUs, at least one. A waiter beyond
/// that sleeps at once. Eight threads each waiting for one 64 KiB HIGH request over loopback
/// tcp on two cores moved 1.25–1.49 GB/s while all eight polled and 2.66–2.74 GB/s with none
/// polling (p50 329–412 µs against 169–175 µs): the pollers held both cores that the sending,
/// serving and reading threads needed. (Go's scheduler bounds its spinning threads the same
/// way, at half its processors.)
#[derive(Debug)]
pub(crate) struct PollBudget {
    polling: AtomicUsize,
    /// Threads in a wait that counts against the budget, polling or not.
    waiting: AtomicUsize,
    max: usize,
}

impl PollBudget {
    /// A budget of `max` pollers at once (zero: none ever polls).
    pub(crate) fn new(max: usize) -> PollBudget {
        PollBudget {
            polling: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            max,
        }
    }

    /// The budget for a host of `cpus` CPUs: half of them, at least one.
    pub(crate) fn for_cpus(cpus: usize) -> PollBudget {
        PollBudget::new((cpus / 2).max(1))
    }

    /// Counts the calling thread as waiting until the returned guard drops, and says whether
    /// it may poll: only while no more threads wait than the budget allows to poll, and a
    /// turn is free. With more waiters than that, none starts polling: one poller among
    /// eight waiters on two cores still cost a tenth of their throughput.
    pub(crate) fn enter(&self) -> Waiting<'_> {
        let waiters = self.waiting.fetch_add(1, Ordering::AcqRel) + 1;
        let polls = waiters <= self.max
            && self
                .polling
                .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
                    (n < self.max).then_some(n + 1)
                })
                .is_ok();
        Waiting {
            budget: self,
            polls,
        }
    }
}

/// One waiting thread (see [`PollBudget::enter`]); counted until dropped.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    budget: &'a PollBudget,
    polls: bool,
}

impl Waiting<'_> {
    /// Whether this waiter may poll.
    pub(crate) fn polls(&self) -> bool {
        self.polls
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.polls {
            self.budget.polling.fetch_sub(1, Ordering::Release);
        }
        self.budget.waiting.fetch_sub(1, Ordering::Release);
    }
}

/// The spin policy of one kind of wait: at most `cap`, and when adaptive, less the more of
/// the recent waits outlasted it (down to `floor`). Shared by the threads that wait; each
/// reads and updates it with relaxed atomics (a lost update only blurs the average).
#[derive(Debug)]
pub(crate) struct Spin {
    /// The most a wait spins, ns.
    cap: u64,
    /// The least an adaptive spin shrinks to, ns.
    floor: u64,
    adaptive: bool,
    /// The share of recent waits that outlasted the cap, in 1/1024 (a moving average over
    /// about eight waits).
    long: AtomicU32,
}

/// One in [`Spin::long`].
const SHARE: u32 = 1024;

impl Spin {
    /// A spin of at most `cap`, adapting down to `floor` (at most `cap`) when `adaptive`.
    pub(crate) fn new(cap: Duration, floor: Duration, adaptive: bool) -> Spin {
        let cap = cap.as_nanos().min(u64::MAX as u128) as u64;
        let floor = (floor.as_nanos().min(u64::MAX as u128) as u64).min(cap);
        Spin {
            cap,
            floor,
            adaptive,
            long: AtomicU32::new(0),
        }
    }

    /// The spin the next wait takes.
    pub(crate) fn current(&self) -> Duration {
        if !self.adaptive {
            return Duration::from_nanos(self.cap);
        }
        let long = self.long.load(Ordering::Relaxed).min(SHARE) as u64;
        let ns = self.floor + (self.cap - self.floor) * (SHARE as u64 - long) / SHARE as u64;
        Duration::from_nanos(ns)
    }

    /// A wait ended after `waited`, with what it waited for (`came`) or at its timeout. An end
    /// within the cap counts as a short wait, anything that outlasted the cap as a long one; a
    /// timeout shorter than the cap says nothing about when waits end.
    pub(crate) fn learn(&self, waited: Duration, came: bool) {
        if !self.adaptive {
            return;
        }
        let long = waited.as_nanos() >= self.cap as u128;
        if !(came || long) {
            return;
        }
        let share = self.long.load(Ordering::Relaxed);
        // Steps of an eighth, rounded up so that the average reaches both ends.
        let next = if long {
            share + (SHARE - share.min(SHARE)).div_ceil(8)
        } else {
            share - share.div_ceil(8)
        };
        if next != share {
            self.long.store(next, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spin_shrinks_while_waits_outlast_it_and_comes_back_when_they_end_soon() {
        let cap = Duration::from_micros(160);
        let s = Spin::new(cap, cap / 4, true);
        assert_eq!(s.current(), cap);
        // A wait now and then that outlasts the cap barely moves it.
        s.learn(Duration::from_millis(5), true);
        for _ in 0..20 {
            s.learn(Duration::from_micros(3), true);
        }
        assert!(s.current() > cap * 9 / 10, "{:?}", s.current());
        // Waits that end late: down to the floor, a quarter here.
        for _ in 0..60 {
            s.learn(Duration::from_millis(10), true);
        }
        assert!(s.current() < cap * 26 / 100, "{:?}", s.current());
        assert!(s.current() >= cap / 4);
        // Short timeouts say nothing; long ones count as long waits.
        let before = s.current();
        s.learn(Duration::from_micros(10), false);
        assert_eq!(s.current(), before);
        // Waits ending soon again: back up to (nearly) the cap.
        for _ in 0..60 {
            s.learn(Duration::from_micros(20), true);
        }
        assert!(s.current() > cap * 9 / 10, "{:?}", s.current());
        // Not adaptive: always the cap.
        let fixed = Spin::new(cap, Duration::ZERO, false);
        fixed.learn(Duration::from_secs(1), true);
        assert_eq!(fixed.current(), cap);
        assert_eq!(
            Spin::new(Duration::ZERO, Duration::ZERO, true).current(),
            Duration::ZERO
        );
    }

    #[test]
    fn a_zero_floor_learns_to_sleep_at_once_and_a_floor_above_the_cap_is_the_cap() {
        let cap = Duration::from_micros(1000);
        let s = Spin::new(cap, Duration::ZERO, true);
        for _ in 0..80 {
            s.learn(Duration::from_millis(4), true);
        }
        assert_eq!(s.current(), Duration::ZERO);
        for _ in 0..80 {
            s.learn(Duration::from_micros(300), true);
        }
        assert_eq!(s.current(), cap);
        let over = Spin::new(cap, cap * 2, true);
        for _ in 0..80 {
            over.learn(Duration::from_millis(4), true);
        }
        assert_eq!(over.current(), cap);
    }

    #[test]
    fn a_poll_budget_lets_waiters_poll_only_while_they_are_no_more_than_its_turns() {
        let b = PollBudget::for_cpus(4);
        let first = b.enter();
        let second = b.enter();
        assert!(first.polls() && second.polls(), "two waiters, two turns");
        // A third waiter on four CPUs sleeps; so does any that comes while three wait.
        let third = b.enter();
        assert!(!third.polls());
        drop(first);
        let fourth = b.enter();
        assert!(!fourth.polls(), "three waiting: more than the budget");
        drop(third);
        drop(fourth);
        let fifth = b.enter();
        assert!(
            fifth.polls(),
            "two waiting again: a turn given back is taken"
        );
        drop(second);
        drop(fifth);
        assert_eq!(b.polling.load(Ordering::Relaxed), 0);
        assert_eq!(b.waiting.load(Ordering::Relaxed), 0);
        // One CPU (or two) lets a lone waiter poll, and no second one; a zero budget none.
        assert!(PollBudget::for_cpus(1).enter().polls());
        let two = PollBudget::for_cpus(2);
        let lone = two.enter();
        assert!(lone.polls());
        assert!(!two.enter().polls());
        drop(lone);
        assert!(two.enter().polls());
        assert!(!PollBudget::new(0).enter().polls());
    }
}
