//! One table of deadlines for everything an engine must do at a time: each peer dispatcher's
//! `poll_timeout`, the next QoS slot boundary, the link-state check. The engine's upkeep thread
//! sleeps until the earliest and runs what expired (quinn-proto's `TimerTable` is the model; this
//! one holds any number of keys, one deadline each).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;

/// Deadlines by key, one per key. Setting a key again replaces its deadline; superseded heap
/// entries are dropped lazily when they surface.
#[derive(Debug)]
pub struct TimerTable<K> {
    heap: BinaryHeap<Reverse<(u64, u64, K)>>,
    /// Key → (deadline, generation) in force.
    current: HashMap<K, (u64, u64)>,
    generation: u64,
}

impl<K> Default for TimerTable<K> {
    fn default() -> Self {
        TimerTable {
            heap: BinaryHeap::new(),
            current: HashMap::new(),
            generation: 0,
        }
    }
}

impl<K: Copy + Eq + Hash + Ord> TimerTable<K> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to fire at `deadline` (ns), or clears it with `None`.
    pub fn set(&mut self, key: K, deadline: Option<u64>) {
        match deadline {
            None => {
                self.current.remove(&key);
            }
            Some(at) => {
                if self.current.get(&key).is_some_and(|&(d, _)| d == at) {
                    return;
                }
                self.generation += 1;
                self.current.insert(key, (at, self.generation));
                self.heap.push(Reverse((at, self.generation, key)));
            }
        }
        // Superseded entries pile up when one key is re-armed often: rebuild past twice the
        // live count so the heap stays proportional to the keys.
        if self.heap.len() > 64 && self.heap.len() > 2 * self.current.len() {
            self.heap = self
                .current
                .iter()
                .map(|(&k, &(d, g))| Reverse((d, g, k)))
                .collect();
        }
    }

    /// The deadline of `key`, if set.
    pub fn get(&self, key: K) -> Option<u64> {
        self.current.get(&key).map(|&(d, _)| d)
    }

    /// The earliest deadline, if any.
    pub fn next_deadline(&mut self) -> Option<u64> {
        self.drop_superseded();
        self.heap.peek().map(|Reverse((d, _, _))| *d)
    }

    /// Removes every key whose deadline is at or before `now` and appends it to `out`,
    /// earliest first.
    pub fn expire(&mut self, now: u64, out: &mut Vec<K>) {
        loop {
            self.drop_superseded();
            match self.heap.peek() {
                Some(Reverse((d, _, _))) if *d <= now => {
                    let Reverse((_, _, key)) = self.heap.pop().expect("peeked");
                    self.current.remove(&key);
                    out.push(key);
                }
                _ => return,
            }
        }
    }

    /// Keys set.
    pub fn len(&self) -> usize {
        self.current.len()
    }

    /// True when no key is set.
    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }

    fn drop_superseded(&mut self) {
        while let Some(Reverse((d, g, k))) = self.heap.peek() {
            if self.current.get(k) == Some(&(*d, *g)) {
                return;
            }
            self.heap.pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fires_in_deadline_order_and_replaces_on_reset() {
        let mut t = TimerTable::new();
        t.set(1u32, Some(30));
        t.set(2, Some(10));
        t.set(3, Some(20));
        t.set(2, Some(40));
        t.set(3, None);
        assert_eq!(t.next_deadline(), Some(30));
        let mut out = Vec::new();
        t.expire(35, &mut out);
        assert_eq!(out, vec![1]);
        t.expire(100, &mut out);
        assert_eq!(out, vec![1, 2]);
        assert!(t.is_empty());
        assert_eq!(t.next_deadline(), None);
    }

    proptest! {
        /// The table agrees with a plain map of key → deadline, however often keys are re-armed.
        #[test]
        fn agrees_with_a_map(ops in proptest::collection::vec((0u8..8, proptest::option::of(0u64..1000), 0u64..1000), 1..300)) {
            let mut t = TimerTable::new();
            let mut model: HashMap<u8, u64> = HashMap::new();
            for (key, deadline, now) in ops {
                t.set(key, deadline);
                match deadline {
                    Some(d) => { model.insert(key, d); }
                    None => { model.remove(&key); }
                }
                prop_assert_eq!(t.next_deadline(), model.values().min().copied());
                let mut fired = Vec::new();
                t.expire(now, &mut fired);
                let mut due: Vec<u8> = model.iter().filter(|(_, &d)| d <= now).map(|(&k, _)| k).collect();
                model.retain(|_, d| *d > now);
                fired.sort();
                due.sort();
                prop_assert_eq!(fired, due);
                prop_assert_eq!(t.len(), model.len());
            }
        }
    }
}
