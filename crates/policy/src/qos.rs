//! Quality of service: per-worker priority queues with promotion, the global slot schedule, and
//! priority-aware rail filtering.
//!
//! Priorities are [`Priority`] values, TENT's `0` (HIGH), `1` (MEDIUM) and `2` (LOW). Time is
//! nanoseconds on any monotonic clock the caller chooses.

use std::collections::VecDeque;

/// HIGH priority.
pub const HIGH: Priority = Priority::High;
/// MEDIUM priority.
pub const MEDIUM: Priority = Priority::Medium;
/// LOW priority.
pub const LOW: Priority = Priority::Low;
/// Number of priority levels.
pub const LEVELS: usize = 3;

/// A request's priority, TENT's three levels. HIGH is served first; MEDIUM and LOW are bulk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    /// Latency-critical work (TENT's 0).
    High,
    /// Bulk that should pass background traffic (TENT's 1).
    Medium,
    /// Background bulk (TENT's 2), the default.
    #[default]
    Low,
}

impl Priority {
    /// Every level, highest first.
    pub const ALL: [Priority; LEVELS] = [Priority::High, Priority::Medium, Priority::Low];

    /// TENT's number for the level: 0 HIGH, 1 MEDIUM, 2 LOW; also the level's index in arrays
    /// of `LEVELS`.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// TENT's number for the level as a byte (the wire and the C API carry it so).
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The level of TENT's number `n`; `None` above 2.
    pub const fn from_u8(n: u8) -> Option<Priority> {
        match n {
            0 => Some(Priority::High),
            1 => Some(Priority::Medium),
            2 => Some(Priority::Low),
            _ => None,
        }
    }

    /// True for MEDIUM and LOW, which share rails as bulk.
    pub const fn is_bulk(self) -> bool {
        !matches!(self, Priority::High)
    }

    /// The name TENT's reports use: `HIGH`, `MEDIUM`, `LOW`.
    pub const fn name(self) -> &'static str {
        match self {
            Priority::High => "HIGH",
            Priority::Medium => "MEDIUM",
            Priority::Low => "LOW",
        }
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Promotion settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromotionConfig {
    /// An entry waiting longer than this moves up one level (`priority_promotion_timeout_us`,
    /// default 10 ms).
    pub timeout_ns: u64,
    /// How often waiting entries are checked (`priority_promotion_check_us`, default 1 ms).
    pub check_ns: u64,
    /// Count an entry's wait only from the last time its level was served
    /// (`qos_promote_only_when_starved`, default true). Promotion is there for work starved by
    /// higher priorities; an entry behind its own level's backlog, which is being served, is
    /// not starved, and promoting such bulk would put it ahead of the HIGH work that arrives
    /// next. A promotion, and the service of an entry promoted from a level, count as service
    /// of that level, so a starved level moves up one entry per check rather than its whole
    /// backlog at once. False counts from when the entry reached its level, as TENT does.
    pub only_when_starved: bool,
}

impl Default for PromotionConfig {
    fn default() -> Self {
        PromotionConfig {
            timeout_ns: 10_000_000,
            check_ns: 1_000_000,
            only_when_starved: true,
        }
    }
}

struct Entry<T> {
    item: T,
    /// Level it was queued at, before any promotion.
    origin: usize,
    /// Start of the wait at the current level; restarts on promotion.
    level_since_ns: u64,
    /// When the entry was first queued, for wait-time statistics.
    queued_ns: u64,
}

/// An item leaving the queues.
#[derive(Debug, PartialEq, Eq)]
pub struct Dequeued<T> {
    /// The item.
    pub item: T,
    /// Level it left from (after any promotion).
    pub priority: Priority,
    /// Time since it was first queued.
    pub waited_ns: u64,
}

/// Three FIFO queues drained strictly HIGH → MEDIUM → LOW, with timeout-based promotion so
/// that LOW work is never starved forever.
pub struct PriorityQueues<T> {
    levels: [VecDeque<Entry<T>>; LEVELS],
    /// When each level last had an entry taken.
    served_ns: [u64; LEVELS],
    config: PromotionConfig,
    next_check_ns: u64,
    promotions: u64,
}

impl<T> PriorityQueues<T> {
    /// Empty queues.
    pub fn new(config: PromotionConfig) -> Self {
        PriorityQueues {
            levels: Default::default(),
            served_ns: [0; LEVELS],
            config,
            next_check_ns: 0,
            promotions: 0,
        }
    }

    fn level(priority: Priority) -> usize {
        priority.index()
    }

    /// Queues `item` at `priority` behind its level.
    pub fn push_back(&mut self, item: T, priority: Priority, now_ns: u64) {
        let level = Self::level(priority);
        self.levels[level].push_back(Entry {
            item,
            origin: level,
            level_since_ns: now_ns,
            queued_ns: now_ns,
        });
    }

    /// Queues `item` ahead of its level, for work handed back after a failure, which already
    /// waited its turn once. `queued_ns` is when it was first queued.
    pub fn push_front(&mut self, item: T, priority: Priority, queued_ns: u64, now_ns: u64) {
        let level = Self::level(priority);
        self.levels[level].push_front(Entry {
            item,
            origin: level,
            level_since_ns: now_ns,
            queued_ns,
        });
    }

    /// Entries waiting at each level.
    pub fn depths(&self) -> [usize; LEVELS] {
        [
            self.levels[0].len(),
            self.levels[1].len(),
            self.levels[2].len(),
        ]
    }

    /// Entries waiting in all.
    pub fn len(&self) -> usize {
        self.levels.iter().map(VecDeque::len).sum()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.levels.iter().all(VecDeque::is_empty)
    }

    /// Promotions performed so far.
    pub fn promotions(&self) -> u64 {
        self.promotions
    }

    /// The highest non-empty level whose priority `admit` allows, and its head.
    pub fn front(&self, admit: impl Fn(Priority) -> bool) -> Option<(&T, Priority)> {
        Priority::ALL
            .into_iter()
            .filter(|p| admit(*p))
            .find_map(|p| self.levels[p.index()].front().map(|e| (&e.item, p)))
    }

    /// Mutable access to the head of level `priority`.
    pub fn front_mut(&mut self, priority: Priority) -> Option<&mut T> {
        self.levels[Self::level(priority)]
            .front_mut()
            .map(|e| &mut e.item)
    }

    /// The `k`-th entry (0 = head) of level `priority`.
    pub fn get(&self, priority: Priority, k: usize) -> Option<&T> {
        self.levels[Self::level(priority)].get(k).map(|e| &e.item)
    }

    /// Entries waiting at level `priority`.
    pub fn level_len(&self, priority: Priority) -> usize {
        self.levels[Self::level(priority)].len()
    }

    /// Takes the head of level `priority`.
    pub fn pop(&mut self, priority: Priority, now_ns: u64) -> Option<Dequeued<T>> {
        let level = Self::level(priority);
        let e = self.levels[level].pop_front()?;
        for l in [level, e.origin] {
            self.served_ns[l] = self.served_ns[l].max(now_ns);
        }
        Some(Dequeued {
            item: e.item,
            priority,
            waited_ns: now_ns.saturating_sub(e.queued_ns),
        })
    }

    /// Takes every entry, highest level first (for failing them all).
    pub fn drain_all(&mut self) -> Vec<(T, Priority)> {
        let mut out = Vec::with_capacity(self.len());
        for (level, p) in self.levels.iter_mut().zip(Priority::ALL) {
            out.extend(level.drain(..).map(|e| (e.item, p)));
        }
        out
    }

    /// Removes and returns entries for which `expired(item, queued_ns)` holds.
    pub fn take_if(&mut self, mut expired: impl FnMut(&T, u64) -> bool) -> Vec<T> {
        let mut out = Vec::new();
        for level in &mut self.levels {
            let mut kept = VecDeque::with_capacity(level.len());
            for e in level.drain(..) {
                if expired(&e.item, e.queued_ns) {
                    out.push(e.item);
                } else {
                    kept.push_back(e);
                }
            }
            *level = kept;
        }
        out
    }

    /// When the next promotion check is due, if anything below HIGH waits.
    pub fn poll_timeout(&self) -> Option<u64> {
        (!self.levels[1].is_empty() || !self.levels[2].is_empty()).then_some(self.next_check_ns)
    }

    /// Runs the promotion check if it is due: MEDIUM entries that waited longer than the
    /// timeout move to HIGH, then LOW ones to MEDIUM; a promoted entry's waiting clock restarts,
    /// so a starving LOW entry spends a full timeout at MEDIUM before reaching HIGH. With
    /// `only_when_starved` the wait counts from the later of that restart and the level's last
    /// service. Returns the number promoted.
    pub fn on_timeout(&mut self, now_ns: u64) -> u64 {
        if now_ns < self.next_check_ns {
            return 0;
        }
        self.next_check_ns = now_ns.saturating_add(self.config.check_ns.max(1));
        let mut promoted = 0;
        for from in [MEDIUM.index(), LOW.index()] {
            let served = if self.config.only_when_starved {
                self.served_ns[from]
            } else {
                0
            };
            while let Some(e) = self.levels[from].front() {
                let since = e.level_since_ns.max(served);
                if now_ns.saturating_sub(since) <= self.config.timeout_ns {
                    break;
                }
                let mut e = self.levels[from].pop_front().expect("front exists");
                e.level_since_ns = now_ns;
                self.levels[from - 1].push_back(e);
                promoted += 1;
                if self.config.only_when_starved {
                    self.served_ns[from] = now_ns;
                    break;
                }
            }
        }
        self.promotions += promoted;
        promoted
    }
}

/// Priorities a global slot admits by TENT's schedule: slot 0 HIGH only, slot 1 HIGH and
/// MEDIUM, slot 2 everything.
pub fn slot_admits(slot: u8, priority: Priority) -> bool {
    priority.as_u8() <= slot.min(LOW.as_u8())
}

/// Whether `priority` may post during `slot`, given how much HIGH and MEDIUM work the processes
/// have (`work[p]`: slices queued, or streams posting). With `work_conserving`, a slot that would exclude a priority admits
/// it when no process has work at the levels the slot is reserved for, so bulk traffic is not
/// held back while the reserved capacity would sit idle.
pub fn admits(slot: u8, priority: Priority, work: [u64; 2], work_conserving: bool) -> bool {
    if slot_admits(slot, priority) {
        return true;
    }
    work_conserving && (0..=slot.min(MEDIUM.as_u8())).all(|p| work[p as usize] == 0)
}

/// The slot in force at `now_ns` when slots of `interval_ns` rotate 0, 1, 2, 0, ...
pub fn slot_at(now_ns: u64, interval_ns: u64) -> u8 {
    ((now_ns / interval_ns.max(1)) % 3) as u8
}

/// Priority-aware rail filtering: rails take turns being reserved. In rotation step `step`, rail
/// `step % n` admits HIGH only and, with three or more rails, rail `(step + 1) % n` is closed to
/// LOW. `higher_waiting[p]` says whether work of priority p waits; with `work_conserving` a
/// reserved rail still takes lower priorities when nothing it is reserved for waits. With a
/// single rail nothing is reserved (there would be no rail left for the rest).
pub fn rail_admits(
    step: u64,
    rail: usize,
    rails: usize,
    priority: Priority,
    higher_waiting: [bool; 2],
    work_conserving: bool,
) -> bool {
    if rails < 2 || priority == HIGH {
        return true;
    }
    let high_only = (step % rails as u64) as usize;
    if rail == high_only {
        return work_conserving && !higher_waiting[0];
    }
    if rails >= 3 && priority == LOW && rail == (high_only + 1) % rails {
        return work_conserving && !higher_waiting[0] && !higher_waiting[1];
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn queues() -> PriorityQueues<&'static str> {
        PriorityQueues::new(PromotionConfig::default())
    }

    fn drain(q: &mut PriorityQueues<&'static str>, now: u64) -> Vec<&'static str> {
        let mut out = vec![];
        while let Some((_, p)) = q.front(|_| true) {
            out.push(q.pop(p, now).unwrap().item);
        }
        out
    }

    #[test]
    fn drains_high_then_medium_then_low() {
        let mut q = queues();
        q.push_back("low1", LOW, 0);
        q.push_back("med1", MEDIUM, 1);
        q.push_back("high1", HIGH, 2);
        q.push_back("low2", LOW, 3);
        q.push_back("high2", HIGH, 4);
        q.push_back("med2", MEDIUM, 5);
        assert_eq!(q.depths(), [2, 2, 2]);
        assert_eq!(
            drain(&mut q, 6),
            vec!["high1", "high2", "med1", "med2", "low1", "low2"]
        );
        assert!(q.is_empty());
    }

    #[test]
    fn admit_mask_skips_levels() {
        let mut q = queues();
        q.push_back("low", LOW, 0);
        q.push_back("high", HIGH, 0);
        assert_eq!(q.front(|p| p != HIGH), Some((&"low", LOW)));
        assert_eq!(q.front(|p| p == MEDIUM), None);
    }

    #[test]
    fn promotion_moves_one_level_per_timeout_and_restarts_the_clock() {
        let mut q = queues();
        q.push_back("low", LOW, 0);
        q.push_back("med", MEDIUM, 0);
        assert_eq!(q.on_timeout(0), 0);
        // Checks run every 1 ms; nothing has waited 10 ms yet.
        assert_eq!(q.on_timeout(5 * MS), 0);
        assert_eq!(q.depths(), [0, 1, 1]);
        // At 11 ms both have waited over 10 ms: MEDIUM -> HIGH, LOW -> MEDIUM.
        assert_eq!(q.on_timeout(11 * MS), 2);
        assert_eq!(q.depths(), [1, 1, 0]);
        // The former LOW entry's clock restarted at 11 ms: not promoted again at 15 ms...
        assert_eq!(q.on_timeout(15 * MS), 0);
        assert_eq!(q.depths(), [1, 1, 0]);
        // ...but after a full timeout at MEDIUM it reaches HIGH.
        assert_eq!(q.on_timeout(22 * MS), 1);
        assert_eq!(q.depths(), [2, 0, 0]);
        assert_eq!(q.promotions(), 3);
        assert_eq!(drain(&mut q, 22 * MS), vec!["med", "low"]);
    }

    #[test]
    fn promotion_check_cadence() {
        let mut q = PriorityQueues::new(PromotionConfig {
            timeout_ns: 0,
            check_ns: MS,
            only_when_starved: true,
        });
        q.push_back("a", LOW, 0);
        assert_eq!(q.on_timeout(1), 1, "first check runs at once");
        q.push_back("b", LOW, 1);
        assert_eq!(q.on_timeout(MS / 2), 0, "next check not due before 1 ms");
        assert_eq!(q.poll_timeout(), Some(MS + 1));
        assert_eq!(q.on_timeout(MS + 1), 2);
    }

    #[test]
    fn a_level_being_served_is_not_starved() {
        let mut q = queues();
        for name in ["a", "b", "c", "d"] {
            q.push_back(name, LOW, 0);
        }
        // LOW is served every 5 ms: its backlog waits, but nothing starves it.
        for t in 1..=3u64 {
            assert!(q.pop(LOW, t * 5 * MS).is_some());
            assert_eq!(q.on_timeout(t * 5 * MS + 1), 0, "served at {t} x 5 ms");
        }
        // Then HIGH work takes every turn: 10 ms after LOW's last service, it is promoted.
        assert_eq!(q.on_timeout(25 * MS), 0);
        assert_eq!(
            q.on_timeout(26 * MS),
            1,
            "next check, 11 ms after LOW was served"
        );
        assert_eq!(q.depths(), [0, 1, 0]);
    }

    #[test]
    fn a_starved_level_moves_up_one_entry_per_check() {
        let mut q = queues();
        for name in ["a", "b", "c"] {
            q.push_back(name, LOW, 0);
        }
        assert_eq!(q.on_timeout(11 * MS), 1);
        assert_eq!(q.depths(), [0, 1, 2]);
        // Serving the promoted entry is service of LOW: nothing more moves for a timeout.
        assert_eq!(q.pop(MEDIUM, 11 * MS + 5).unwrap().item, "a");
        assert_eq!(q.on_timeout(12 * MS), 0);
        assert_eq!(q.on_timeout(21 * MS + 6), 1);
        assert_eq!(q.depths(), [0, 1, 1]);
    }

    #[test]
    fn tent_promotion_counts_from_queueing_even_while_served() {
        let mut q = PriorityQueues::new(PromotionConfig {
            only_when_starved: false,
            ..PromotionConfig::default()
        });
        q.push_back("a", LOW, 0);
        q.push_back("b", LOW, 0);
        assert!(q.pop(LOW, 9 * MS).is_some());
        assert_eq!(q.on_timeout(11 * MS), 1);
        assert_eq!(q.depths(), [0, 1, 0]);
    }

    #[test]
    fn wait_time_counts_from_first_queueing() {
        let mut q = queues();
        q.push_back("x", LOW, 100);
        q.on_timeout(20 * MS);
        let d = q.pop(MEDIUM, 25 * MS).unwrap();
        assert_eq!(
            (d.item, d.priority, d.waited_ns),
            ("x", MEDIUM, 25 * MS - 100)
        );
    }

    #[test]
    fn slot_schedule_and_work_conservation() {
        assert!(slot_admits(0, HIGH) && !slot_admits(0, MEDIUM) && !slot_admits(0, LOW));
        assert!(slot_admits(1, MEDIUM) && !slot_admits(1, LOW));
        assert!(slot_admits(2, LOW));
        // Strict: LOW may post only in slot 2.
        assert!(!admits(0, LOW, [0, 0], false));
        // Work-conserving: nobody has HIGH work, so slot 0 lets LOW and MEDIUM through.
        assert!(admits(0, LOW, [0, 5], true));
        assert!(admits(0, MEDIUM, [0, 5], true));
        assert!(!admits(0, LOW, [1, 0], true));
        // Slot 1 is for HIGH and MEDIUM: LOW waits while either has work anywhere.
        assert!(!admits(1, LOW, [0, 1], true));
        assert!(admits(1, LOW, [0, 0], true));
        assert_eq!(
            (
                slot_at(0, 2 * MS),
                slot_at(2 * MS, 2 * MS),
                slot_at(5 * MS, 2 * MS),
                slot_at(6 * MS, 2 * MS)
            ),
            (0, 1, 2, 0)
        );
    }

    #[test]
    fn rail_filter_keeps_a_rail_free_of_low_traffic() {
        for step in 0..8u64 {
            let open_to_low: Vec<usize> = (0..4)
                .filter(|&r| rail_admits(step, r, 4, LOW, [true, true], true))
                .collect();
            let open_to_high: Vec<usize> = (0..4)
                .filter(|&r| rail_admits(step, r, 4, HIGH, [true, true], true))
                .collect();
            assert_eq!(open_to_low.len(), 2, "step {step}: {open_to_low:?}");
            assert_eq!(open_to_high.len(), 4);
            let reserved = (step % 4) as usize;
            assert!(!open_to_low.contains(&reserved));
            assert!(!rail_admits(step, reserved, 4, MEDIUM, [true, false], true));
            assert!(rail_admits(
                step,
                (reserved + 1) % 4,
                4,
                MEDIUM,
                [true, false],
                true
            ));
        }
        // Nothing of higher priority waits: work-conserving opens every rail, strict does not.
        assert!((0..4).all(|r| rail_admits(0, r, 4, LOW, [false, false], true)));
        assert!(!rail_admits(0, 0, 4, LOW, [false, false], false));
        // One rail: never reserved.
        assert!(rail_admits(0, 0, 1, LOW, [true, true], false));
        // Two rails: one reserved for HIGH, the other open to all.
        assert!(
            !rail_admits(0, 0, 2, LOW, [true, true], false)
                && rail_admits(0, 1, 2, LOW, [true, true], false)
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// One step of a random schedule: queue an item at a priority, or take the head.
        #[derive(Debug, Clone)]
        enum Op {
            Push(Priority),
            Pop,
        }

        fn ops() -> impl Strategy<Value = Vec<(Op, u64)>> {
            prop::collection::vec(
                (
                    prop_oneof![
                        (0usize..3).prop_map(|p| Op::Push(Priority::ALL[p])),
                        Just(Op::Pop)
                    ],
                    0u64..4 * MS,
                ),
                1..300,
            )
        }

        proptest! {
            /// Without promotion the queues are three FIFOs drained strictly by level: the same
            /// answers as a plain model, so a HIGH item never leaves after a lower one queued
            /// later.
            #[test]
            fn without_promotion_dequeue_matches_strict_fifo_levels(schedule in ops()) {
                let mut q = PriorityQueues::new(PromotionConfig {
                    timeout_ns: u64::MAX,
                    ..PromotionConfig::default()
                });
                let mut model: [VecDeque<usize>; LEVELS] = Default::default();
                let mut now = 0;
                for (id, (op, dt)) in schedule.into_iter().enumerate() {
                    now += dt;
                    prop_assert_eq!(q.on_timeout(now), 0);
                    match op {
                        Op::Push(p) => {
                            q.push_back(id, p, now);
                            model[p.index()].push_back(id);
                        }
                        Op::Pop => {
                            let expected = model.iter_mut().enumerate().find_map(|(p, l)| {
                                l.pop_front().map(|id| (id, Priority::ALL[p]))
                            });
                            let got = q.front(|_| true).map(|(_, p)| p).and_then(|p| {
                                q.pop(p, now).map(|d| (d.item, d.priority))
                            });
                            prop_assert_eq!(got, expected);
                        }
                    }
                    prop_assert_eq!(q.depths(), [model[0].len(), model[1].len(), model[2].len()]);
                }
            }

            /// With promotion every item leaves exactly once, from the highest waiting level,
            /// and only after a full timeout per level it climbed.
            #[test]
            fn promotion_loses_nothing_and_climbs_one_level_per_timeout(
                schedule in ops(),
                starved in any::<bool>(),
            ) {
                let timeout = 5 * MS;
                let mut q = PriorityQueues::new(PromotionConfig {
                    timeout_ns: timeout,
                    check_ns: MS,
                    only_when_starved: starved,
                });
                let mut queued = std::collections::HashMap::new();
                let mut now = 0;
                // Panics inside count as failures too; prop_assert! cannot leave a closure.
                let take = |q: &mut PriorityQueues<usize>, now: u64| {
                    let depths = q.depths();
                    let (_, p) = q.front(|_| true)?;
                    assert!(depths[..p.index()].iter().all(|&n| n == 0), "{depths:?} {p}");
                    Some(q.pop(p, now).expect("front exists"))
                };
                for (id, (op, dt)) in schedule.into_iter().enumerate() {
                    now += dt;
                    q.on_timeout(now);
                    match op {
                        Op::Push(p) => {
                            q.push_back(id, p, now);
                            queued.insert(id, (p, now));
                        }
                        Op::Pop => {
                            if let Some(d) = take(&mut q, now) {
                                let (origin, at) = queued.remove(&d.item).expect("queued once");
                                prop_assert!(d.priority <= origin);
                                prop_assert_eq!(d.waited_ns, now - at);
                                let climbed = (origin.index() - d.priority.index()) as u64;
                                prop_assert!(d.waited_ns > climbed * timeout || climbed == 0);
                            }
                        }
                    }
                }
                while let Some(d) = take(&mut q, now) {
                    prop_assert!(queued.remove(&d.item).is_some());
                }
                prop_assert!(queued.is_empty(), "left behind: {:?}", queued);
            }
        }
    }
}
