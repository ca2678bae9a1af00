//! Usage tracker: which peers are busy enough to deserve a scarce resource (a dedicated lane,
//! an RC-style connection), decided from a sample of the send path in constant memory.
//!
//! This is UCX's usage tracker (`src/ucs/datastruct/usage_tracker.{h,c}`, driven by
//! `ucp_worker_track_ep_usage*` in `src/ucp/core/ucp_worker.{c,inl}`), the monitoring and
//! selection stage of UCX's dynamic transport selection. It works in three stages:
//!
//! 1. **Sampling.** The send path calls [`UsageTracker::should_sample`] (a [`Sampler`]: one send
//!    in [`DEFAULT_SAMPLE_PERIOD`] = 32, a decrement and a branch) and only for a sampled send
//!    reads the clock and calls [`UsageTracker::on_sample`]. A sample starts a *round* when
//!    `switch_interval_ns` has passed since the last one; a round touches the peer's key, and
//!    every `progress_factor`-th round runs [`UsageTracker::progress`]. A caller with its own
//!    cadence may call [`UsageTracker::touch`] and [`UsageTracker::progress`] directly.
//! 2. **LRU.** [`UsageTracker::touch`] records the key in an LRU of `promote_capacity` keys:
//!    statistically the busiest keys sit in it when it is looked at.
//! 3. **Score table.** [`UsageTracker::progress`] decays every tracked score with UCX's
//!    exponential decay, `score = m * score + c` if the key is in the LRU and `m * score` if
//!    not (`m = 0.8`, `c = 0.2`, so a key present every round converges to `c / (1 - m) = 1`
//!    and an idle one loses half its score in about three rounds, `0.8^3 = 0.512`); adds the
//!    LRU's keys that are not yet tracked with score `c`; empties the LRU; and ranks the table.
//!    The first `promote_thresh` keys of the ranking are promoted, the keys ranked at
//!    `promote_capacity` or later are dropped from the table. A promoted key keeps its place
//!    against a challenger unless the challenger's score is at least `remove_thresh` higher,
//!    so scores closer than `remove_thresh` keep the current holder and nothing flaps.
//!
//! Decisions come out as [`UsageEvent`]s drained with [`UsageTracker::poll_event`] (UCX calls
//! `promote_cb` / `demote_cb`). [`UsageTracker::set_min_score`] floors a key's score with the
//! remote side's view of the same connection, so both ends agree to promote it.
//!
//! # Memory
//!
//! Everything is allocated by [`UsageTracker::new`] and sized by `promote_capacity` alone: the
//! LRU is a slab of `promote_capacity` nodes on an intrusive doubly linked list with an
//! open-addressing index (linear probing, backward-shift deletion, so no tombstones pile up);
//! the score table holds at most `2 * promote_capacity` entries (the table plus one LRU's worth
//! of newcomers during [`UsageTracker::progress`]) and is trimmed back to `promote_capacity` at
//! every public call; the ranking sorts a preallocated index buffer in place. So
//! [`UsageTracker::touch`] is O(1) and never allocates, and memory does not grow with the
//! number of distinct keys ever seen. The one growable part is the event queue, which holds
//! what the caller has not drained yet.
//!
//! # Where this differs from UCX, and why
//!
//! UCX master (`usage_tracker.c` last changed in aa3bfee85c) is the reference.
//!
//! - **The promoted set is the top `promote_thresh` of the ranking, no more.** In UCX
//!   (`ucs_usage_tracker_promote`) the first `promote_thresh` entries are promoted but only
//!   entries ranked past `promote_capacity` are demoted, so a displaced holder stays promoted,
//!   even idle with its score decaying to zero, until `promote_capacity` busier keys push it
//!   out of the table; the promoted set can reach `promote_capacity`. Here a holder ranked
//!   past `promote_thresh` is demoted at once (and stays in the table while it ranks within
//!   `promote_capacity`): the caller sizes its scarce resource by `promote_thresh` and holds
//!   exactly the current top set. With `promote_capacity == promote_thresh`, as in two of
//!   UCX's three gtests, the two behave the same.
//! - **Ranking is a total order.** UCX's `ucs_usage_tracker_compare` orders two entries by
//!   score when they differ by at least `remove_thresh`, and otherwise promoted first, then by
//!   key. That is not transitive (scores 0.0, 0.06 and 0.12 with `remove_thresh = 0.1` form a
//!   cycle); `qsort_r` tolerates it, but Rust's sort may panic on such an order and the result
//!   would depend on the algorithm anyway. Here a promoted entry ranks with its score plus
//!   `remove_thresh`, then at an exact tie the promoted entry first, then by key. For a
//!   promoted holder against a challenger this is UCX's rule except at the exact boundary: UCX
//!   switches at a margin `>= remove_thresh`, we at a margin strictly above it ("scores closer
//!   than remove_thresh, or equal to it, keep the holder"), because with `remove_thresh = 0`
//!   the `>=` rule would hand the place to an equal-score challenger at every progress. Two
//!   entries that are both promoted or both not are ordered by score (UCX: by key when their
//!   scores are within `remove_thresh`).
//! - **Events, demotions first.** UCX calls back promotions before demotions; a ranking here
//!   queues its demotions first, so a consumer applying events in order never holds more than
//!   `promote_thresh` promoted keys.
//! - **[`UsageTracker::remove`] queues [`UsageEvent::Demoted`] for a promoted key and forgets the
//!   key in the LRU too.** UCX's `ucs_usage_tracker_remove` deletes the entry silently (no
//!   `demote_cb`) and leaves the key in the LRU, so the next progress would track a peer that
//!   is gone. Here the event stream stays balanced and a gone peer is not brought back.
//! - **[`UsageTracker::set_min_score`] also ranks when the insertion overflows the table**, to
//!   keep the memory bound; UCX ranks only when the floor exceeds the score. A floor that is
//!   not finite is rejected.
//! - **Memory is fixed** (see above); UCX's LRU allocates a node per new key and frees them all
//!   at every progress, its hash table grows, and each ranking allocates an array.
//! - **Rounds** (UCX's `last_round`) start from the first sampled send; UCX starts counting
//!   from worker creation, and this struct is created without a clock.

use std::cmp::Ordering;
use std::collections::VecDeque;
use std::fmt;
use std::hash::{Hash, Hasher};

/// Largest `promote_capacity` accepted; slab indices are `u32` and the table stays small.
pub const MAX_PROMOTE_CAPACITY: usize = 1 << 16;

/// UCX samples one send in this many (`UCP_WORKER_PROGRESS_TIMER_SKIP_COUNT`).
pub const DEFAULT_SAMPLE_PERIOD: u32 = 32;

/// No node / empty link in the LRU slab.
const NIL: u32 = u32::MAX;

/// The tracker's knobs. The defaults are UCX's (`ucp_worker.c`, `ucp_context.c`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UsageConfig {
    /// Keys the LRU and the score table hold (20: `UCX_MAX_PRIORITY_EPS`, which UCX passes as
    /// `promote_capacity`). Keys ranked at this position or later are dropped from the table.
    pub promote_capacity: usize,
    /// Most keys promoted at once (10: `UCP_WORKER_USAGE_TRACKER_PROMOTE_THRESHOLD`); at most
    /// `promote_capacity`.
    pub promote_thresh: usize,
    /// Score margin, in `[0, 1]`, by which a challenger must beat a promoted key to take its
    /// place (0.2: `UCP_WORKER_USAGE_TRACKER_REMOVE_THRESHOLD`).
    pub remove_thresh: f64,
    /// Decay multiplier `m` in `[0, 1]` applied to every score at each progress (0.8:
    /// `UCP_WORKER_USAGE_TRACKER_EXP_DECAY_MULTIPLIER`).
    pub decay_multiplier: f64,
    /// Increment `c` in `[0, 1]` added to the score of a key found in the LRU, and the score of
    /// a newly tracked key (0.2: `UCP_WORKER_USAGE_TRACKER_EXP_DECAY_ADDER`).
    pub decay_adder: f64,
    /// Least time between two rounds of [`UsageTracker::on_sample`]. `None` is UCX's default
    /// `UCX_DYNAMIC_TL_SWITCH_INTERVAL=inf`: no round ever starts, dynamic selection is off
    /// until the caller sets an interval. `Some(0)` is invalid, as in UCX.
    pub switch_interval_ns: Option<u64>,
    /// Rounds per [`UsageTracker::progress`] (10: `UCX_DYNAMIC_TL_PROGRESS_FACTOR`), at least 1.
    pub progress_factor: u32,
    /// One send in this many is sampled by [`UsageTracker::should_sample`]
    /// ([`DEFAULT_SAMPLE_PERIOD`]), at least 1.
    pub sample_period: u32,
}

impl Default for UsageConfig {
    fn default() -> Self {
        UsageConfig {
            promote_capacity: 20,
            promote_thresh: 10,
            remove_thresh: 0.2,
            decay_multiplier: 0.8,
            decay_adder: 0.2,
            switch_interval_ns: None,
            progress_factor: 10,
            sample_period: DEFAULT_SAMPLE_PERIOD,
        }
    }
}

/// A bad setting or argument, naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError {
    /// The setting (`promote_capacity`, `remove_thresh`, ...) or argument (`min_score`).
    pub key: &'static str,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

impl std::error::Error for UsageError {}

fn err(key: &'static str, message: impl Into<String>) -> UsageError {
    UsageError {
        key,
        message: message.into(),
    }
}

fn check_unit(key: &'static str, value: f64) -> Result<(), UsageError> {
    // `contains` is false for NaN, which UCX's `> 1 || < 0` check would let through.
    if (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(err(key, format!("must be within [0, 1], got {value}")))
    }
}

impl UsageConfig {
    /// Checks every knob; the error names the first bad one.
    pub fn validate(&self) -> Result<(), UsageError> {
        if !(1..=MAX_PROMOTE_CAPACITY).contains(&self.promote_capacity) {
            return Err(err(
                "promote_capacity",
                format!(
                    "must be within [1, {MAX_PROMOTE_CAPACITY}], got {}",
                    self.promote_capacity
                ),
            ));
        }
        if self.promote_thresh > self.promote_capacity {
            return Err(err(
                "promote_thresh",
                format!(
                    "must be at most promote_capacity ({}), got {}",
                    self.promote_capacity, self.promote_thresh
                ),
            ));
        }
        check_unit("remove_thresh", self.remove_thresh)?;
        check_unit("decay_multiplier", self.decay_multiplier)?;
        check_unit("decay_adder", self.decay_adder)?;
        if self.switch_interval_ns == Some(0) {
            return Err(err(
                "switch_interval_ns",
                "must be positive (None turns rounds off)",
            ));
        }
        if self.progress_factor == 0 {
            return Err(err("progress_factor", "must be at least 1, got 0"));
        }
        if self.sample_period == 0 {
            return Err(err("sample_period", "must be at least 1, got 0"));
        }
        Ok(())
    }
}

/// A decision of the tracker, drained with [`UsageTracker::poll_event`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UsageEvent<K> {
    /// `key` is now among the busiest: give it the scarce resource.
    Promoted {
        /// The key.
        key: K,
        /// Its score when promoted (the floored score, see [`UsageTracker::score`]).
        score: f64,
    },
    /// `key`, promoted before, no longer is (displaced, dropped or removed).
    Demoted {
        /// The key.
        key: K,
    },
}

/// Picks one call in `period`: the first call, then every `period`-th, as UCX's
/// `iter_count++ % UCP_WORKER_PROGRESS_TIMER_SKIP_COUNT == 0`. The common path is a decrement
/// and a branch, so it fits on the send path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampler {
    period: u32,
    left: u32,
}

impl Sampler {
    /// A sampler picking one call in `period`; a period of 0 is taken as 1 (every call).
    pub fn new(period: u32) -> Self {
        Sampler {
            period: period.max(1),
            left: 0,
        }
    }

    /// The period.
    pub fn period(&self) -> u32 {
        self.period
    }

    /// True for the call to sample.
    #[inline]
    pub fn sample(&mut self) -> bool {
        if self.left == 0 {
            self.left = self.period - 1;
            true
        } else {
            self.left -= 1;
            false
        }
    }
}

impl Default for Sampler {
    /// One call in [`DEFAULT_SAMPLE_PERIOD`] (32), UCX's rate.
    fn default() -> Self {
        Sampler::new(DEFAULT_SAMPLE_PERIOD)
    }
}

/// FxHash (rustc's hasher): one multiply per word, no allocation, the same on every run. The
/// index takes the *top* bits of the product, so keys that differ only in high bits (ids that
/// are multiples of a large power of two) still spread over the slots. Keys are the engine's
/// own peer ids, not attacker-chosen, and the index is tiny, so flooding is no concern.
#[derive(Default)]
struct FxHasher(u64);

impl FxHasher {
    const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(Self::SEED);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u16(&mut self, n: u16) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Fixed-size open-addressing map from key to a `u32` slot number, for at most the number of
/// keys it was built for (load factor at most one half, so probes stay short).
#[derive(Debug, Clone)]
struct KeyIndex<K> {
    slots: Vec<Option<(K, u32)>>,
    /// `64 - log2(slots.len())`: the hash's top bits pick the home slot.
    shift: u32,
    len: usize,
}

impl<K: Copy + Eq + Hash> KeyIndex<K> {
    fn with_capacity(keys: usize) -> Self {
        let size = (2 * keys).next_power_of_two().max(8);
        KeyIndex {
            slots: vec![None; size],
            shift: 64 - size.trailing_zeros(),
            len: 0,
        }
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    fn home(&self, key: &K) -> usize {
        let mut hasher = FxHasher::default();
        key.hash(&mut hasher);
        (hasher.finish() >> self.shift) as usize
    }

    /// The slot holding `key`, if any.
    #[inline]
    fn find(&self, key: K) -> Option<usize> {
        let mut i = self.home(&key);
        loop {
            match self.slots[i] {
                None => return None,
                Some((k, _)) if k == key => return Some(i),
                Some(_) => i = (i + 1) & self.mask(),
            }
        }
    }

    #[inline]
    fn get(&self, key: K) -> Option<u32> {
        self.find(key).and_then(|i| self.slots[i].map(|(_, v)| v))
    }

    /// Adds `key`, which must be absent, with `value`.
    fn insert(&mut self, key: K, value: u32) {
        debug_assert!(self.find(key).is_none());
        // The owner never holds more keys than it built the index for, and the index has
        // twice as many slots, so an empty slot exists and the probe ends.
        debug_assert!(self.len < self.slots.len());
        let mut i = self.home(&key);
        while self.slots[i].is_some() {
            i = (i + 1) & self.mask();
        }
        self.slots[i] = Some((key, value));
        self.len += 1;
    }

    /// Removes `key`; returns its value, or `None` if it was absent.
    fn remove(&mut self, key: K) -> Option<u32> {
        let mut hole = self.find(key)?;
        let value = self.slots[hole].map(|(_, v)| v);
        // Backward-shift deletion: pull later members of the probe run into the hole when
        // their home slot does not lie between the hole and them, so every key stays reachable
        // from its home without tombstones.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let Some((k, _)) = self.slots[j] else { break };
            let home = self.home(&k);
            if (hole.wrapping_sub(home) & mask) < (j.wrapping_sub(home) & mask) {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = None;
        self.len -= 1;
        value
    }

    fn clear(&mut self) {
        if self.len > 0 {
            self.slots.fill(None);
            self.len = 0;
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Node<K> {
    key: K,
    prev: u32,
    next: u32,
}

/// LRU of at most `capacity` keys: a slab of nodes on a doubly linked list, most recent at the
/// head, plus a [`KeyIndex`] from key to node. All memory is allocated by `new`.
#[derive(Debug, Clone)]
struct Lru<K> {
    /// Never longer than `capacity`, so pushing never reallocates.
    nodes: Vec<Node<K>>,
    /// Nodes freed by `remove`, reused before the slab grows.
    free: Vec<u32>,
    index: KeyIndex<K>,
    head: u32,
    tail: u32,
    capacity: usize,
}

impl<K: Copy + Eq + Hash> Lru<K> {
    fn new(capacity: usize) -> Self {
        Lru {
            nodes: Vec::with_capacity(capacity),
            free: Vec::with_capacity(capacity),
            index: KeyIndex::with_capacity(capacity),
            head: NIL,
            tail: NIL,
            capacity,
        }
    }

    fn len(&self) -> usize {
        self.index.len
    }

    #[inline]
    fn contains(&self, key: K) -> bool {
        self.index.find(key).is_some()
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, i: u32) {
        let old = self.head;
        {
            let node = &mut self.nodes[i as usize];
            node.prev = NIL;
            node.next = old;
        }
        if old == NIL {
            self.tail = i;
        } else {
            self.nodes[old as usize].prev = i;
        }
        self.head = i;
    }

    /// Makes `key` the most recent, evicting the least recent key when full.
    #[inline]
    fn touch(&mut self, key: K) {
        if let Some(i) = self.index.get(key) {
            // The common case on a busy peer: already near the head.
            if i != self.head {
                self.unlink(i);
                self.push_front(i);
            }
            return;
        }
        let i = if let Some(i) = self.free.pop() {
            self.nodes[i as usize].key = key;
            i
        } else if self.nodes.len() < self.capacity {
            self.nodes.push(Node {
                key,
                prev: NIL,
                next: NIL,
            });
            (self.nodes.len() - 1) as u32
        } else {
            let i = self.tail;
            let old = self.nodes[i as usize].key;
            self.index.remove(old);
            self.unlink(i);
            self.nodes[i as usize].key = key;
            i
        };
        self.index.insert(key, i);
        self.push_front(i);
    }

    /// Forgets `key`; false if it was absent.
    fn remove(&mut self, key: K) -> bool {
        match self.index.remove(key) {
            Some(i) => {
                self.unlink(i);
                self.free.push(i);
                true
            }
            None => false,
        }
    }

    fn clear(&mut self) {
        self.nodes.clear();
        self.free.clear();
        self.index.clear();
        self.head = NIL;
        self.tail = NIL;
    }

    /// Keys from the most to the least recent.
    fn keys(&self) -> impl Iterator<Item = K> + '_ {
        let mut i = self.head;
        std::iter::from_fn(move || {
            if i == NIL {
                return None;
            }
            let node = &self.nodes[i as usize];
            i = node.next;
            Some(node.key)
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry<K> {
    key: K,
    /// Exponential-decay score.
    score: f64,
    /// Floor set by the remote side's view ([`UsageTracker::set_min_score`]).
    min_score: f64,
    promoted: bool,
    /// Ranked within `promote_capacity` by the current ranking.
    keep: bool,
}

impl<K> Entry<K> {
    /// UCX's `ucs_usage_tracker_score`: the score, floored.
    fn effective(&self) -> f64 {
        self.score.max(self.min_score)
    }
}

/// Orders entries from the most to the least deserving of promotion. A TOTAL order, unlike
/// UCX's comparator (see the module doc): `sort_unstable_by` may panic on an order that is not
/// total, and a non-transitive one would make the outcome depend on the sort algorithm.
///
/// A promoted entry ranks as if its score were `remove_thresh` higher, so a challenger passes
/// it only with a score more than `remove_thresh` above its own; at an exact tie the holder
/// stays first (UCX's comparator would switch at `|diff| >= remove_thresh`, which with a zero
/// threshold swaps equal scores back and forth). Remaining ties go to the smaller key, as in
/// UCX. `-0.0 + 0.0` is `+0.0`, so a floor of
/// `-0.0` does not sort apart from `0.0` under `total_cmp`.
fn rank_cmp<K: Ord>(a: &Entry<K>, b: &Entry<K>, remove_thresh: f64) -> Ordering {
    let rank_score = |e: &Entry<K>| e.effective() + if e.promoted { remove_thresh } else { 0.0 };
    rank_score(b)
        .total_cmp(&rank_score(a))
        .then(b.promoted.cmp(&a.promoted))
        .then_with(|| a.key.cmp(&b.key))
}

/// The score table: entries in a preallocated vector, found through a [`KeyIndex`].
#[derive(Debug, Clone)]
struct Table<K> {
    entries: Vec<Entry<K>>,
    index: KeyIndex<K>,
}

impl<K: Copy + Eq + Hash> Table<K> {
    fn new(slots: usize) -> Self {
        Table {
            entries: Vec::with_capacity(slots),
            index: KeyIndex::with_capacity(slots),
        }
    }

    fn get(&self, key: K) -> Option<&Entry<K>> {
        self.index.get(key).map(|i| &self.entries[i as usize])
    }

    /// The entry of `key`, created with score `initial` if absent (UCX's
    /// `ucs_usage_tracker_put`).
    fn put(&mut self, key: K, initial: f64) -> &mut Entry<K> {
        let i = match self.index.get(key) {
            Some(i) => i as usize,
            None => {
                debug_assert!(self.entries.len() < self.entries.capacity());
                self.entries.push(Entry {
                    key,
                    score: initial,
                    min_score: 0.0,
                    promoted: false,
                    keep: true,
                });
                let i = self.entries.len() - 1;
                self.index.insert(key, i as u32);
                i
            }
        };
        &mut self.entries[i]
    }

    fn remove(&mut self, key: K) -> Option<Entry<K>> {
        let i = self.index.remove(key)? as usize;
        let entry = self.entries.swap_remove(i);
        if let Some(moved) = self.entries.get(i) {
            let slot = self.index.find(moved.key).expect("moved entry is indexed");
            self.index.slots[slot] = Some((moved.key, i as u32));
        }
        Some(entry)
    }

    /// Drops the entries not marked `keep` and reindexes the rest.
    fn retain_kept(&mut self) {
        self.entries.retain(|e| e.keep);
        self.index.clear();
        for (i, e) in self.entries.iter().enumerate() {
            self.index.insert(e.key, i as u32);
        }
    }
}

/// Tracks which keys (peers) are used most and promotes the top ones; see the module doc.
#[derive(Debug, Clone)]
pub struct UsageTracker<K> {
    config: UsageConfig,
    lru: Lru<K>,
    table: Table<K>,
    /// Ranking buffer, reused by every ranking.
    order: Vec<u32>,
    events: VecDeque<UsageEvent<K>>,
    promoted: usize,
    sampler: Sampler,
    rounds: u64,
    last_round_ns: Option<u64>,
    last_progress_ns: Option<u64>,
}

impl<K: Copy + Eq + Hash + Ord> UsageTracker<K> {
    /// A tracker with every buffer allocated. Fails on bad settings, naming the setting.
    pub fn new(config: UsageConfig) -> Result<Self, UsageError> {
        config.validate()?;
        let cap = config.promote_capacity;
        Ok(UsageTracker {
            lru: Lru::new(cap),
            // The table holds at most `cap` entries between calls; progress adds at most one
            // LRU's worth (`cap`) before ranking trims it, set_min_score at most one.
            table: Table::new(2 * cap),
            order: Vec::with_capacity(2 * cap),
            events: VecDeque::with_capacity(2 * cap),
            promoted: 0,
            sampler: Sampler::new(config.sample_period),
            rounds: 0,
            last_round_ns: None,
            last_progress_ns: None,
            config,
        })
    }

    /// The settings.
    pub fn config(&self) -> &UsageConfig {
        &self.config
    }

    /// Send path: true for the one send in `sample_period` that should be reported with
    /// [`UsageTracker::on_sample`]. A decrement and a branch; reads no clock.
    #[inline]
    pub fn should_sample(&mut self) -> bool {
        self.sampler.sample()
    }

    /// A sampled send to `key` at `now_ns` (UCX's `ucp_worker_track_ep_usage_always`): starts
    /// a round, touching `key`, if `switch_interval_ns` has passed since the last round (the
    /// first sample always starts one), and runs [`UsageTracker::progress`] every
    /// `progress_factor`-th round. Does nothing while `switch_interval_ns` is `None`, or when
    /// the clock went backwards. Returns true when it ran progress, so events may be waiting.
    pub fn on_sample(&mut self, now_ns: u64, key: K) -> bool {
        let Some(interval) = self.config.switch_interval_ns else {
            return false;
        };
        if let Some(last) = self.last_round_ns {
            if now_ns.saturating_sub(last) < interval {
                return false;
            }
        }
        self.touch(key);
        self.last_round_ns = Some(now_ns);
        self.rounds += 1;
        if self
            .rounds
            .is_multiple_of(u64::from(self.config.progress_factor))
        {
            self.progress(now_ns);
            true
        } else {
            false
        }
    }

    /// Records a use of `key` in the LRU (UCX's `ucs_usage_tracker_touch_key`). O(1), never
    /// allocates; evicts the least recently touched key when the LRU holds
    /// `promote_capacity` keys.
    #[inline]
    pub fn touch(&mut self, key: K) {
        self.lru.touch(key);
    }

    /// One scoring round (UCX's `ucs_usage_tracker_progress`): decays every tracked score
    /// (`m * score + c` if the key is in the LRU, `m * score` if not), tracks the LRU's new
    /// keys with score `c`, empties the LRU and ranks, queuing events. The decay is per call,
    /// not per nanosecond, as in UCX: the caller's cadence sets the time constant. `now_ns` is
    /// kept for [`UsageTracker::last_progress_ns`]. Allocates nothing, except to grow the
    /// event queue if the caller has left events in it.
    pub fn progress(&mut self, now_ns: u64) {
        self.last_progress_ns = Some(now_ns);
        let (m, c) = (self.config.decay_multiplier, self.config.decay_adder);
        for entry in &mut self.table.entries {
            entry.score *= m;
            if self.lru.contains(entry.key) {
                entry.score += c;
            }
        }
        for key in self.lru.keys() {
            self.table.put(key, c);
        }
        self.lru.clear();
        self.rank();
    }

    /// Ranks the table (UCX's `ucs_usage_tracker_promote`): demotes promoted entries ranked
    /// past `promote_thresh`, drops entries ranked past `promote_capacity`, then promotes the
    /// top `promote_thresh`.
    fn rank(&mut self) {
        let n = self.table.entries.len();
        if n == 0 {
            return;
        }
        let UsageConfig {
            promote_capacity: cap,
            promote_thresh: thresh,
            remove_thresh,
            ..
        } = self.config;
        self.order.clear();
        self.order.extend(0..n as u32);
        let entries = &self.table.entries;
        self.order.sort_unstable_by(|&a, &b| {
            rank_cmp(&entries[a as usize], &entries[b as usize], remove_thresh)
        });
        // Demotions first, so a consumer applying events in order never holds more than
        // `promote_thresh` promoted keys.
        for (rank, &i) in self.order.iter().enumerate() {
            let entry = &mut self.table.entries[i as usize];
            entry.keep = rank < cap;
            if rank >= thresh && entry.promoted {
                entry.promoted = false;
                self.promoted -= 1;
                self.events
                    .push_back(UsageEvent::Demoted { key: entry.key });
            }
        }
        for &i in self.order.iter().take(thresh) {
            let entry = &mut self.table.entries[i as usize];
            if !entry.promoted {
                entry.promoted = true;
                self.promoted += 1;
                self.events.push_back(UsageEvent::Promoted {
                    key: entry.key,
                    score: entry.effective(),
                });
            }
        }
        if n > cap {
            self.table.retain_kept();
        }
    }

    /// The next decision, oldest first; `None` when all are drained.
    pub fn poll_event(&mut self) -> Option<UsageEvent<K>> {
        self.events.pop_front()
    }

    /// Floors `key`'s score at `score`, the remote side's view of the same connection (UCX's
    /// `ucs_usage_tracker_set_min_score`). Tracks `key` with score `c` if it was not tracked;
    /// a later call replaces the floor, it does not raise it. Ranks at once (events may be
    /// queued) when the floor lifts the score or the table overflows. Fails, changing
    /// nothing, when `score` is not finite.
    pub fn set_min_score(&mut self, key: K, score: f64) -> Result<(), UsageError> {
        if !score.is_finite() {
            return Err(err("min_score", format!("must be finite, got {score}")));
        }
        let entry = self.table.put(key, self.config.decay_adder);
        entry.min_score = score;
        let lifted = entry.min_score > entry.score;
        if lifted || self.table.entries.len() > self.config.promote_capacity {
            self.rank();
        }
        Ok(())
    }

    /// Forgets `key`, a peer that is gone: drops it from the table and the LRU, and queues
    /// [`UsageEvent::Demoted`] if it was promoted. Returns false if it was tracked in neither.
    pub fn remove(&mut self, key: K) -> bool {
        let in_lru = self.lru.remove(key);
        match self.table.remove(key) {
            Some(entry) => {
                if entry.promoted {
                    self.promoted -= 1;
                    self.events.push_back(UsageEvent::Demoted { key });
                }
                true
            }
            None => in_lru,
        }
    }

    /// `key`'s score, floored by [`UsageTracker::set_min_score`]; `None` if the table does not
    /// track it (a key touched since the last progress is tracked from that progress on).
    pub fn score(&self, key: K) -> Option<f64> {
        self.table.get(key).map(Entry::effective)
    }

    /// True if `key` is promoted.
    pub fn is_promoted(&self, key: K) -> bool {
        self.table.get(key).is_some_and(|e| e.promoted)
    }

    /// The promoted keys, in no particular order.
    pub fn promoted(&self) -> impl Iterator<Item = K> + '_ {
        self.table
            .entries
            .iter()
            .filter(|e| e.promoted)
            .map(|e| e.key)
    }

    /// How many keys are promoted, at most `promote_thresh`.
    pub fn promoted_count(&self) -> usize {
        self.promoted
    }

    /// How many keys the score table tracks, at most `promote_capacity`.
    pub fn len(&self) -> usize {
        self.table.entries.len()
    }

    /// True when the score table tracks no key.
    pub fn is_empty(&self) -> bool {
        self.table.entries.is_empty()
    }

    /// Keys touched since the last progress that the LRU still holds, at most
    /// `promote_capacity`.
    pub fn lru_len(&self) -> usize {
        self.lru.len()
    }

    /// Time of the last [`UsageTracker::progress`], `None` before the first.
    pub fn last_progress_ns(&self) -> Option<u64> {
        self.last_progress_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashSet, VecDeque};

    /// The parameters of UCX's gtest (`test_usage_tracker.cc`): capacity 30 (10 in the
    /// stability and demote cases), promote 10, remove 0.1, decay {c 0.2, m 0.8}.
    fn gtest_config(capacity: usize) -> UsageConfig {
        UsageConfig {
            promote_capacity: capacity,
            promote_thresh: 10,
            remove_thresh: 0.1,
            decay_multiplier: 0.8,
            decay_adder: 0.2,
            ..UsageConfig::default()
        }
    }

    fn tracker(config: UsageConfig) -> UsageTracker<u64> {
        UsageTracker::new(config).unwrap()
    }

    fn touch_all(t: &mut UsageTracker<u64>, keys: impl IntoIterator<Item = u64>) {
        for k in keys {
            t.touch(k);
        }
    }

    /// Drains the events into the promoted and demoted lists, as the gtest's callbacks do.
    fn drain(t: &mut UsageTracker<u64>, promoted: &mut Vec<u64>, demoted: &mut Vec<u64>) {
        while let Some(e) = t.poll_event() {
            match e {
                UsageEvent::Promoted { key, .. } => promoted.push(key),
                UsageEvent::Demoted { key } => demoted.push(key),
            }
        }
    }

    /// The gtest's `verify`: same sizes, same members, and `is_promoted` agrees.
    fn verify(
        t: &UsageTracker<u64>,
        promoted: &[u64],
        demoted: &[u64],
        exp_promoted: &[u64],
        exp_demoted: &[u64],
    ) {
        let set = |v: &[u64]| v.iter().copied().collect::<BTreeSet<_>>();
        assert_eq!(promoted.len(), exp_promoted.len(), "promotion");
        assert_eq!(set(promoted), set(exp_promoted), "promotion");
        assert_eq!(demoted.len(), exp_demoted.len(), "demotion");
        assert_eq!(set(demoted), set(exp_demoted), "demotion");
        for k in promoted {
            assert_eq!(t.is_promoted(*k), !demoted.contains(k), "entry {k}");
        }
        for k in demoted {
            assert!(!t.is_promoted(*k), "entry {k}");
        }
    }

    #[test]
    fn ucx_gtest_promote() {
        let mut t = tracker(gtest_config(30));
        let (mut promoted, mut demoted) = (vec![], vec![]);
        for _ in 0..10 {
            t.progress(0);
            touch_all(&mut t, 0..30);
            drain(&mut t, &mut promoted, &mut demoted);
        }
        // Equal scores: the smaller keys win, as in UCX's comparator.
        verify(&t, &promoted, &demoted, &(0..10).collect::<Vec<_>>(), &[]);
        assert_eq!(t.len(), 30);
    }

    #[test]
    fn ucx_gtest_stability() {
        let mut t = tracker(gtest_config(10));
        let (mut promoted, mut demoted) = (vec![], vec![]);
        touch_all(&mut t, 0..10);
        t.progress(0);
        // Newcomers score 0.2 against 0.16 for the holders: within remove_thresh, so the
        // holders stay and the newcomers are dropped at once.
        touch_all(&mut t, 10..20);
        t.progress(1);
        drain(&mut t, &mut promoted, &mut demoted);
        verify(&t, &promoted, &demoted, &(0..10).collect::<Vec<_>>(), &[]);
        assert_eq!(t.len(), 10);
        assert_eq!(t.score(10), None, "newcomer dropped");
        assert!((t.score(0).unwrap() - 0.16).abs() < 1e-12);
    }

    #[test]
    fn ucx_gtest_demote() {
        let mut t = tracker(gtest_config(10));
        let (mut promoted, mut demoted) = (vec![], vec![]);
        for _ in 0..5 {
            t.progress(0);
            touch_all(&mut t, 0..10);
        }
        for i in 0..10 {
            t.progress(0);
            touch_all(&mut t, 10..20);
            drain(&mut t, &mut promoted, &mut demoted);
            // The holders decay from 0.672 and the newcomers re-enter at 0.2 every round; the
            // margin first reaches 0.1 at the 15th progress (0.8^9 * 0.672 = 0.0902).
            assert_eq!(demoted.is_empty(), i < 9, "progress {}", i + 6);
        }
        let all: Vec<u64> = (0..20).collect();
        verify(&t, &promoted, &demoted, &all, &(0..10).collect::<Vec<_>>());
    }

    #[test]
    fn busiest_keys_are_promoted_with_default_config() {
        let mut t = tracker(UsageConfig::default());
        // Keys 10..20 are touched every round, keys 0..10 every fourth. In the first round
        // all score alike and the smaller keys win the tie, so the busy keys must displace
        // them by the margin.
        for round in 0..40 {
            touch_all(&mut t, 10..20);
            if round % 4 == 0 {
                touch_all(&mut t, 0..10);
            }
            t.progress(round);
        }
        let promoted: BTreeSet<u64> = t.promoted().collect();
        assert_eq!(promoted, (10..20).collect());
        assert_eq!(t.promoted_count(), 10);
    }

    #[test]
    fn displaced_holder_is_demoted_before_the_newcomer_is_promoted() {
        let config = UsageConfig {
            promote_thresh: 1,
            ..UsageConfig::default()
        };
        let mut t = tracker(config);
        t.touch(7);
        t.progress(0);
        assert_eq!(
            t.poll_event(),
            Some(UsageEvent::Promoted { key: 7, score: 0.2 })
        );
        let mut events = vec![];
        for round in 1..10 {
            t.touch(9);
            t.progress(round);
            events.extend(std::iter::from_fn(|| t.poll_event()));
        }
        assert_eq!(events.len(), 2, "{events:?}");
        assert_eq!(events[0], UsageEvent::Demoted { key: 7 });
        assert!(matches!(events[1], UsageEvent::Promoted { key: 9, .. }));
        // Unlike UCX, the displaced holder is demoted while the table still tracks it.
        assert!(t.score(7).is_some());
        assert!(!t.is_promoted(7));
    }

    #[test]
    fn equal_scores_keep_their_holders_even_without_a_margin() {
        let mut t = tracker(UsageConfig {
            promote_capacity: 30,
            remove_thresh: 0.0,
            ..UsageConfig::default()
        });
        let mut events = 0;
        for round in 0..20 {
            touch_all(&mut t, 0..30);
            t.progress(round);
            events += std::iter::from_fn(|| t.poll_event()).count();
        }
        assert_eq!(events, 10, "the first ten promotions, then nothing");
        assert_eq!(t.promoted().collect::<BTreeSet<_>>(), (0..10).collect());
    }

    #[test]
    fn remove_demotes_and_forgets_the_lru() {
        let mut t = tracker(UsageConfig::default());
        t.touch(1);
        t.progress(0);
        assert!(matches!(
            t.poll_event(),
            Some(UsageEvent::Promoted { key: 1, .. })
        ));
        t.touch(1);
        t.touch(2);
        assert!(t.remove(1));
        assert_eq!(t.poll_event(), Some(UsageEvent::Demoted { key: 1 }));
        assert!(!t.is_promoted(1));
        assert_eq!(t.score(1), None);
        assert!(t.remove(2), "in the LRU only");
        assert!(!t.remove(3));
        t.progress(1);
        assert_eq!(t.score(1), None, "not brought back by the LRU");
        assert_eq!(t.score(2), None);
        assert_eq!(t.poll_event(), None);
    }

    #[test]
    fn min_score_floors_and_promotes_at_once() {
        let config = UsageConfig {
            promote_thresh: 1,
            ..UsageConfig::default()
        };
        let mut t = tracker(config);
        t.touch(1);
        t.progress(0);
        assert!(matches!(
            t.poll_event(),
            Some(UsageEvent::Promoted { key: 1, .. })
        ));
        t.set_min_score(2, 0.9).unwrap();
        assert_eq!(t.poll_event(), Some(UsageEvent::Demoted { key: 1 }));
        assert_eq!(
            t.poll_event(),
            Some(UsageEvent::Promoted { key: 2, score: 0.9 })
        );
        assert_eq!(t.score(2), Some(0.9));
        for round in 1..20 {
            t.progress(round);
        }
        assert_eq!(
            t.score(2),
            Some(0.9),
            "the floor holds while the score decays"
        );
        assert!(t.is_promoted(2));
        // A lower floor lets the decayed score show.
        t.set_min_score(2, 0.0).unwrap();
        assert!(t.score(2).unwrap() < 0.01);
        let e = t.set_min_score(3, f64::NAN).unwrap_err();
        assert_eq!(e.key, "min_score");
        assert_eq!(t.score(3), None, "nothing changed");
    }

    #[test]
    fn min_score_keeps_the_table_bounded() {
        let config = UsageConfig {
            promote_capacity: 2,
            promote_thresh: 1,
            ..UsageConfig::default()
        };
        let mut t = tracker(config);
        for k in 0..100 {
            // A floor below c does not lift the score; only the overflow makes it rank.
            t.set_min_score(k, 0.0).unwrap();
            assert!(t.len() <= 2);
        }
    }

    #[test]
    fn config_errors_name_the_field() {
        let bad = |f: fn(&mut UsageConfig)| {
            let mut c = UsageConfig::default();
            f(&mut c);
            let e = c.validate().unwrap_err();
            assert!(UsageTracker::<u64>::new(c).is_err());
            e.key
        };
        assert_eq!(UsageConfig::default().validate(), Ok(()));
        assert_eq!(bad(|c| c.promote_capacity = 0), "promote_capacity");
        assert_eq!(
            bad(|c| c.promote_capacity = MAX_PROMOTE_CAPACITY + 1),
            "promote_capacity"
        );
        assert_eq!(bad(|c| c.promote_thresh = 21), "promote_thresh");
        assert_eq!(bad(|c| c.remove_thresh = 1.5), "remove_thresh");
        assert_eq!(bad(|c| c.remove_thresh = f64::NAN), "remove_thresh");
        assert_eq!(bad(|c| c.decay_multiplier = -0.1), "decay_multiplier");
        assert_eq!(bad(|c| c.decay_adder = 2.0), "decay_adder");
        assert_eq!(
            bad(|c| c.switch_interval_ns = Some(0)),
            "switch_interval_ns"
        );
        assert_eq!(bad(|c| c.progress_factor = 0), "progress_factor");
        assert_eq!(bad(|c| c.sample_period = 0), "sample_period");
        let e = UsageConfig {
            promote_thresh: 30,
            ..UsageConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "promote_thresh: must be at most promote_capacity (20), got 30"
        );
    }

    #[test]
    fn defaults_are_ucx_defaults() {
        let c = UsageConfig::default();
        assert_eq!((c.promote_capacity, c.promote_thresh), (20, 10));
        assert_eq!(
            (c.remove_thresh, c.decay_multiplier, c.decay_adder),
            (0.2, 0.8, 0.2)
        );
        assert_eq!(
            c.switch_interval_ns, None,
            "UCX_DYNAMIC_TL_SWITCH_INTERVAL=inf"
        );
        assert_eq!((c.progress_factor, c.sample_period), (10, 32));
    }

    #[test]
    fn sampler_picks_the_first_then_one_in_period() {
        let mut s = Sampler::default();
        assert_eq!(s.period(), 32);
        let picked: Vec<usize> = (0..320).filter(|_| s.sample()).collect();
        assert_eq!(picked, (0..320).step_by(32).collect::<Vec<_>>());
        let mut every = Sampler::new(0);
        assert_eq!(every.period(), 1);
        assert!((0..10).all(|_| every.sample()));
        let mut t = tracker(UsageConfig {
            sample_period: 4,
            ..UsageConfig::default()
        });
        assert_eq!((0..16).filter(|_| t.should_sample()).count(), 4);
    }

    #[test]
    fn rounds_follow_the_switch_interval_and_progress_factor() {
        let mut off = tracker(UsageConfig::default());
        for t in 0..100 {
            assert!(!off.on_sample(t * 1_000_000_000, 1));
        }
        assert_eq!(off.lru_len(), 0, "no round while the interval is inf");

        let mut t = tracker(UsageConfig {
            switch_interval_ns: Some(100),
            progress_factor: 3,
            ..UsageConfig::default()
        });
        assert!(!t.on_sample(1_000, 5), "round 1");
        assert!(!t.on_sample(1_050, 6), "too soon");
        assert!(!t.on_sample(1_100, 7), "round 2");
        assert!(!t.on_sample(1_150, 8), "too soon");
        assert!(!t.on_sample(1_000, 8), "clock went backwards");
        assert!(t.on_sample(1_200, 9), "round 3 runs progress");
        assert_eq!(t.last_progress_ns(), Some(1_200));
        let tracked: BTreeSet<u64> = [5, 6, 7, 8, 9]
            .into_iter()
            .filter(|&k| t.score(k).is_some())
            .collect();
        assert_eq!(tracked, [5, 7, 9].into_iter().collect());
        assert_eq!(t.promoted_count(), 3);
    }

    #[test]
    fn lru_evicts_the_least_recent() {
        let mut lru = Lru::new(3);
        for k in [1u64, 2, 3, 1, 4] {
            lru.touch(k);
        }
        assert_eq!(lru.keys().collect::<Vec<_>>(), vec![4, 1, 3]);
        assert!(!lru.contains(2));
    }

    #[test]
    fn a_million_distinct_keys_keep_the_lru_at_capacity() {
        let config = UsageConfig::default();
        let cap = config.promote_capacity;
        let mut t = tracker(config);
        let capacities = |t: &UsageTracker<u64>| {
            (
                t.lru.nodes.capacity(),
                t.lru.free.capacity(),
                t.lru.index.slots.len(),
                t.table.entries.capacity(),
                t.table.index.slots.len(),
                t.order.capacity(),
            )
        };
        let before = capacities(&t);
        for k in 0..1_000_000u64 {
            // Spread the ids over the whole key space, and over the top bits the index uses.
            t.touch(k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            assert!(t.lru_len() <= cap);
            if k % 1000 == 999 {
                assert_eq!(t.lru_len(), cap);
                t.progress(k);
                while t.poll_event().is_some() {}
                assert!(t.len() <= cap);
            }
        }
        assert_eq!(capacities(&t), before, "no buffer grew");
    }

    /// UCX's comparator, for the record: not transitive, which is why we do not use it.
    #[test]
    fn ucx_comparator_is_not_transitive() {
        let ucx = |(s1, k1): (f64, u64), (s2, k2): (f64, u64)| {
            if (s1 - s2).abs() >= 0.1 {
                if s1 < s2 {
                    Ordering::Greater
                } else {
                    Ordering::Less
                }
            } else if k1 > k2 {
                Ordering::Greater
            } else {
                Ordering::Less
            }
        };
        let (a, b, c) = ((0.0, 1), (0.06, 2), (0.12, 3));
        assert_eq!(ucx(a, b), Ordering::Less);
        assert_eq!(ucx(b, c), Ordering::Less);
        assert_eq!(ucx(a, c), Ordering::Greater, "a < b < c < a");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Touch(u64),
        Progress,
        SetMin(u64, f64),
        Remove(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u64..40).prop_map(Op::Touch),
            2 => Just(Op::Progress),
            1 => (0u64..40, 0.0f64..1.5).prop_map(|(k, s)| Op::SetMin(k, s)),
            1 => (0u64..40).prop_map(Op::Remove),
        ]
    }

    fn entry() -> impl Strategy<Value = Entry<u64>> {
        (0u64..8, 0.0f64..1.0, 0.0f64..1.0, any::<bool>()).prop_map(
            |(key, score, min, promoted)| Entry {
                key,
                // Coarse scores make ties and near-ties common.
                score: (score * 10.0).round() / 10.0,
                min_score: if min < 0.5 { 0.0 } else { min },
                promoted,
                keep: true,
            },
        )
    }

    proptest! {
        #[test]
        fn touched_every_round_converges_to_c_over_one_minus_m(
            m in 0.05f64..0.95,
            c in 0.01f64..=1.0,
            keys in 1u64..=20,
        ) {
            let mut t = tracker(UsageConfig {
                decay_multiplier: m,
                decay_adder: c,
                ..UsageConfig::default()
            });
            for round in 0..420 {
                touch_all(&mut t, 0..keys);
                t.progress(round);
            }
            let limit = c / (1.0 - m);
            for k in 0..keys {
                let s = t.score(k).unwrap();
                prop_assert!((s - limit).abs() <= 1e-6 * limit, "{} vs {}", s, limit);
            }
        }

        #[test]
        fn idle_entry_halves_in_about_three_rounds(warm in 1u64..40) {
            let mut t = tracker(UsageConfig::default());
            for round in 0..warm {
                t.touch(1);
                t.progress(round);
            }
            let s0 = t.score(1).unwrap();
            prop_assert!((s0 - (1.0 - 0.8f64.powi(warm as i32))).abs() < 1e-12);
            for round in 0..3 {
                t.progress(warm + round);
            }
            let s3 = t.score(1).unwrap();
            prop_assert!((s3 / s0 - 0.512).abs() < 1e-12, "{}", s3 / s0);
            t.progress(warm + 3);
            prop_assert!(t.score(1).unwrap() < s0 / 2.0);
        }

        #[test]
        fn events_and_bounds_hold_under_any_operations(
            cap in 1usize..12,
            thresh_frac in 0.0f64..=1.0,
            remove_thresh in prop_oneof![Just(0.0), Just(0.05), Just(0.2), 0.0f64..=1.0],
            ops in prop::collection::vec(op(), 1..300),
        ) {
            let thresh = (cap as f64 * thresh_frac).round() as usize;
            let mut t = tracker(UsageConfig {
                promote_capacity: cap,
                promote_thresh: thresh,
                remove_thresh,
                ..UsageConfig::default()
            });
            let mut model: HashSet<u64> = HashSet::new();
            for op in ops {
                match op {
                    Op::Touch(k) => t.touch(k),
                    Op::Progress => t.progress(0),
                    Op::SetMin(k, s) => t.set_min_score(k, s).unwrap(),
                    Op::Remove(k) => {
                        t.remove(k);
                    }
                }
                prop_assert!(t.promoted_count() <= thresh);
                prop_assert!(t.len() <= cap);
                prop_assert!(t.lru_len() <= cap);
                while let Some(e) = t.poll_event() {
                    match e {
                        UsageEvent::Promoted { key, score } => {
                            prop_assert!(model.insert(key), "{} promoted twice", key);
                            prop_assert!(score.is_finite());
                        }
                        UsageEvent::Demoted { key } => {
                            prop_assert!(model.remove(&key), "{} demoted unpromoted", key);
                        }
                    }
                    prop_assert!(model.len() <= thresh, "event order overshoots");
                }
                for k in 0..40 {
                    prop_assert_eq!(t.is_promoted(k), model.contains(&k), "key {}", k);
                }
                prop_assert_eq!(t.promoted_count(), model.len());
                prop_assert_eq!(t.promoted().count(), model.len());
            }
        }

        #[test]
        fn no_flapping_at_constant_rates(
            cap in 1usize..=16,
            thresh_frac in 0.0f64..=1.0,
            keys in 1u64..=16,
            even in prop::collection::vec(0u64..16, 0..48),
            odd in prop::collection::vec(0u64..16, 0..48),
            alternate in any::<bool>(),
        ) {
            // Every key fits in the LRU and the table, so each key's touches per round are
            // constant (or alternate with period two) and its score converges to 1, to the
            // orbit 0.444 / 0.556, or to nothing; those classes are further apart than
            // remove_thresh, and one class's scores are closer than it.
            let keys = keys.min(cap as u64);
            let thresh = (cap as f64 * thresh_frac).round() as usize;
            let even: Vec<u64> = even.into_iter().map(|k| k % keys).collect();
            let odd: Vec<u64> = if alternate {
                odd.into_iter().map(|k| k % keys).collect()
            } else {
                even.clone()
            };
            let mut t = tracker(UsageConfig {
                promote_capacity: cap,
                promote_thresh: thresh,
                ..UsageConfig::default()
            });
            for round in 0..240u64 {
                if round == 120 {
                    while t.poll_event().is_some() {}
                }
                let seq = if round % 2 == 0 { &even } else { &odd };
                touch_all(&mut t, seq.iter().copied());
                t.progress(round);
            }
            let late: Vec<_> = std::iter::from_fn(|| t.poll_event()).collect();
            prop_assert!(late.is_empty(), "{:?}", late);
        }

        #[test]
        fn rank_order_is_total(
            entries in prop::collection::vec(entry(), 1..24),
            remove_thresh in prop_oneof![Just(0.1), Just(0.2), 0.0f64..=1.0],
        ) {
            // Distinct keys, as in the table.
            let mut seen = HashSet::new();
            let mut entries: Vec<Entry<u64>> =
                entries.into_iter().filter(|e| seen.insert(e.key)).collect();
            entries.sort_unstable_by(|a, b| rank_cmp(a, b, remove_thresh));
            for i in 0..entries.len() {
                prop_assert_eq!(rank_cmp(&entries[i], &entries[i], remove_thresh), Ordering::Equal);
                for j in i + 1..entries.len() {
                    prop_assert_eq!(
                        rank_cmp(&entries[i], &entries[j], remove_thresh),
                        Ordering::Less
                    );
                    prop_assert_eq!(
                        rank_cmp(&entries[j], &entries[i], remove_thresh),
                        Ordering::Greater
                    );
                }
            }
        }

        #[test]
        fn lru_matches_a_model(
            cap in 1usize..10,
            ops in prop::collection::vec((0u8..4, 0u64..24), 1..400),
        ) {
            let mut lru = Lru::new(cap);
            let mut model: VecDeque<u64> = VecDeque::new();
            for (kind, k) in ops {
                // Keys that differ only in their high bits stress the probing.
                let key = k << 40;
                match kind {
                    0 | 1 => {
                        lru.touch(key);
                        model.retain(|&x| x != key);
                        model.push_front(key);
                        model.truncate(cap);
                    }
                    2 => {
                        let had = model.contains(&key);
                        model.retain(|&x| x != key);
                        prop_assert_eq!(lru.remove(key), had);
                    }
                    _ => {
                        if k == 0 {
                            lru.clear();
                            model.clear();
                        }
                    }
                }
                prop_assert_eq!(lru.keys().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
                prop_assert_eq!(lru.len(), model.len());
                for x in 0..24u64 {
                    prop_assert_eq!(lru.contains(x << 40), model.contains(&(x << 40)));
                }
            }
        }
    }
}
