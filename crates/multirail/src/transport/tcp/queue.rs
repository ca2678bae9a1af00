//! What waits for a connection's sending thread: a queue with one consumer that sleeps by
//! parking, and never by yielding.
//!
//! A channel's receive (crossbeam's, and std's alike) spins and then calls `sched_yield` a few
//! times before it blocks, in case a message is about to come. On a host of two cores whose
//! other threads all have work (the reader, the serving threads over loopback), every yield is
//! a switch to one of them and back: reading 64 KiB slices over loopback tcp, the sending
//! threads made 40,000 such switches in 3 s, against 20,000 real sleeps. Here the consumer
//! sleeps at once when the queue is empty, and a producer wakes it only when it sleeps.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::{self, Thread};

/// A queue of `T` with many producers and one consumer thread.
pub(crate) struct SendQueue<T> {
    state: Mutex<QueueState<T>>,
    /// Items queued: read without the lock by [`SendQueue::is_empty`].
    len: AtomicUsize,
    /// The consumer is asleep, or about to be: a producer must wake it.
    sleeping: AtomicBool,
    consumer: OnceLock<Thread>,
}

struct QueueState<T> {
    items: VecDeque<T>,
    closed: bool,
}

impl<T> SendQueue<T> {
    /// An empty, open queue with room for `capacity` items before it grows.
    pub(crate) fn with_capacity(capacity: usize) -> SendQueue<T> {
        SendQueue {
            state: Mutex::new(QueueState {
                items: VecDeque::with_capacity(capacity),
                closed: false,
            }),
            len: AtomicUsize::new(0),
            sleeping: AtomicBool::new(false),
            consumer: OnceLock::new(),
        }
    }

    /// Queues `item` at the back and wakes the consumer if it sleeps. Hands `item` back when
    /// the queue is closed.
    pub(crate) fn push(&self, item: T) -> Result<(), T> {
        {
            let mut st = self.lock();
            if st.closed {
                return Err(item);
            }
            st.items.push_back(item);
            self.len.fetch_add(1, Ordering::Release);
        }
        // SeqCst pairs with the consumer's store of `sleeping` before its last look under the
        // lock: either it saw this item, or this load sees it asleep.
        if self.sleeping.load(Ordering::SeqCst) {
            if let Some(t) = self.consumer.get() {
                t.unpark();
            }
        }
        Ok(())
    }

    /// Whether nothing is queued (a snapshot: a producer may push at once).
    pub(crate) fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }

    /// Takes the front item, if any, without waiting.
    pub(crate) fn try_pop(&self) -> Option<T> {
        if self.is_empty() {
            return None;
        }
        let mut st = self.lock();
        let item = st.items.pop_front();
        if item.is_some() {
            self.len.fetch_sub(1, Ordering::Release);
        }
        item
    }

    /// Takes the front item, sleeping until there is one. Only the consumer thread calls it;
    /// its first call names it as the thread producers wake (a push before then needs no
    /// wake-up: this call finds the item).
    pub(crate) fn pop(&self) -> T {
        self.consumer.get_or_init(thread::current);
        loop {
            if let Some(item) = self.try_pop() {
                return item;
            }
            self.sleeping.store(true, Ordering::SeqCst);
            let item = self.lock().items.pop_front();
            if let Some(item) = item {
                self.sleeping.store(false, Ordering::Relaxed);
                self.len.fetch_sub(1, Ordering::Release);
                return item;
            }
            // A wake-up meant for another wait of this thread (it parks for its window too)
            // or a spurious one only costs another look.
            thread::park();
            self.sleeping.store(false, Ordering::Relaxed);
        }
    }

    /// Closes the queue and returns what is still in it: later pushes are handed back.
    pub(crate) fn close(&self) -> Vec<T> {
        let mut st = self.lock();
        st.closed = true;
        self.len.store(0, Ordering::Release);
        st.items.drain(..).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState<T>> {
        // Nothing the lock guards can be left half-changed by a panic: a push or a pop is one
        // `VecDeque` call.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn items_come_out_in_order_and_a_closed_queue_hands_pushes_back() {
        let q = SendQueue::with_capacity(4);
        assert!(q.is_empty());
        for i in 0..10 {
            q.push(i).unwrap();
        }
        assert!(!q.is_empty());
        assert_eq!(q.pop(), 0);
        assert_eq!(q.try_pop(), Some(1));
        let rest = q.close();
        assert_eq!(rest, (2..10).collect::<Vec<_>>());
        assert!(q.is_empty());
        assert_eq!(q.try_pop(), None);
        assert_eq!(q.push(11), Err(11));
    }

    #[test]
    fn a_sleeping_consumer_is_woken_by_every_push_and_loses_none() {
        let q = Arc::new(SendQueue::with_capacity(1));
        let consumer = {
            let q = q.clone();
            thread::spawn(move || (0..20_000).map(|_| q.pop()).collect::<Vec<u32>>())
        };
        let producers: Vec<_> = (0..2u32)
            .map(|p| {
                let q = q.clone();
                thread::spawn(move || {
                    for i in 0..10_000u32 {
                        q.push(p * 10_000 + i).unwrap();
                        if i % 1000 == 0 {
                            // Let the consumer fall asleep now and then.
                            thread::sleep(Duration::from_millis(1));
                        }
                    }
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        let got = consumer.join().unwrap();
        // Each producer's items arrive in its own order, and all of them arrive.
        for p in 0..2u32 {
            let mine: Vec<u32> = got.iter().copied().filter(|v| v / 10_000 == p).collect();
            assert_eq!(mine, (p * 10_000..(p + 1) * 10_000).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_push_before_the_consumer_first_looks_is_found() {
        let q = Arc::new(SendQueue::with_capacity(1));
        q.push(7u8).unwrap();
        let consumer = {
            let q = q.clone();
            thread::spawn(move || (q.pop(), q.pop()))
        };
        thread::sleep(Duration::from_millis(20));
        q.push(8).unwrap();
        assert_eq!(consumer.join().unwrap(), (7, 8));
    }
}
