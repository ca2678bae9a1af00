//! When a group multicast's sender pushes its ring and when a receiver pushes its count: the
//! batching decisions of Derecho's small-message multicast (SMC), free of I/O.
//!
//! A sender commits messages into a ring of `window` slots (message `i` sits in slot
//! `i % window`) and makes them visible to the other members with *pushes*: one-sided writes of
//! a contiguous run of slots, then of its committed count. A receiver consumes what arrived and
//! *acknowledges* by pushing how many messages of that sender it has consumed; the sender may
//! reuse a slot once every receiver has acknowledged it. Three modes decide how often:
//!
//! - [`Batching::Off`]: every message is pushed on its own and acknowledged on its own (Derecho's
//!   SMC arithmetic: 10 one-sided writes per multicast in a 3-member group, one sender).
//! - [`Batching::Opportunistic`] (Derecho's later "opportunistic batching", Spindle): a push
//!   carries everything committed since the last one, split only where the ring wraps; a
//!   receiver acknowledges once per pass over what arrived. Nothing waits: an idle sender's
//!   single message is pushed at once.
//! - [`Batching::Every`] (Derecho's proposal for SMC batching): a push only when `k` messages
//!   are pending, and a receiver acknowledges only when its count crosses a multiple of `k`;
//!   whatever is held back is pushed anyway `flush_ns` after it was first held (the proposal's
//!   forced push, ~150 µs). [`PushPlanner::flush`] pushes at once and marks the push urgent, so
//!   receivers acknowledge at once too (the proposal's `SMC::flush()`).
//!
//! Time is nanoseconds on any monotonic clock the caller chooses.

use std::ops::Range;

/// How pushes and acknowledgements are batched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batching {
    /// One push per message, one acknowledgement per message.
    Off,
    /// Push everything pending at once; acknowledge once per pass.
    Opportunistic,
    /// Push when `k` messages are pending, acknowledge at multiples of `k`; anything held back
    /// goes `flush_ns` after it was first held.
    Every {
        /// Messages per push (1 to the window size).
        k: u64,
        /// Longest a held-back push or acknowledgement waits, nanoseconds.
        flush_ns: u64,
    },
}

/// A setting the planners refuse, naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoalesceError(pub String);

impl std::fmt::Display for CoalesceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CoalesceError {}

/// One push: the messages `messages` (contiguous slots of the ring: it never wraps), then the
/// committed count `messages.end`. `urgent` asks receivers to acknowledge at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Push {
    /// Message indices carried, in slot order.
    pub messages: Range<u64>,
    /// From [`PushPlanner::flush`]: receivers acknowledge what it brings without waiting.
    pub urgent: bool,
}

/// Checks `batching` against a ring of `window` slots.
fn check(batching: Batching, window: u64) -> Result<(), CoalesceError> {
    if window == 0 {
        return Err(CoalesceError("window_size must be at least 1".into()));
    }
    if let Batching::Every { k, flush_ns } = batching {
        if k == 0 || k > window {
            return Err(CoalesceError(format!(
                "batch size k must be within [1, window_size {window}], got {k}"
            )));
        }
        if flush_ns == 0 {
            return Err(CoalesceError("flush_us must be at least 1".into()));
        }
    }
    Ok(())
}

/// The sender's side: which committed messages to push, and when.
#[derive(Debug, Clone)]
pub struct PushPlanner {
    batching: Batching,
    window: u64,
    /// Messages committed (the sender's `index`).
    committed: u64,
    /// Messages pushed: always a prefix of the committed ones.
    pushed: u64,
    /// The least any receiver has acknowledged: slots below it may be reused.
    acknowledged: u64,
    /// When the oldest message not yet pushed was committed and held back.
    held_since: Option<u64>,
    /// A flush asked for: the next drain takes everything, marked urgent.
    urgent: bool,
    /// The push under way covers messages up to here (exclusive).
    drain_to: u64,
    /// Whether the push under way is urgent.
    drain_urgent: bool,
    /// When the push under way was decided.
    drain_started: u64,
}

impl PushPlanner {
    /// A planner for a ring of `window` slots. Fails on a window of 0, or `k` outside
    /// `[1, window]` or a `flush_ns` of 0 for [`Batching::Every`].
    pub fn new(batching: Batching, window: u64) -> Result<PushPlanner, CoalesceError> {
        check(batching, window)?;
        Ok(PushPlanner {
            batching,
            window,
            committed: 0,
            pushed: 0,
            acknowledged: 0,
            held_since: None,
            urgent: false,
            drain_to: 0,
            drain_urgent: false,
            drain_started: 0,
        })
    }

    /// Messages committed so far.
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Messages pushed so far.
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// True when a slot is free for the next message: fewer than `window` messages are
    /// committed and not yet acknowledged by every receiver.
    pub fn has_room(&self) -> bool {
        self.committed - self.acknowledged < self.window
    }

    /// Commits the next message (its slot is `committed % window`) and returns its index.
    /// Returns `None` when the window is full: the caller waits for acknowledgements.
    pub fn commit(&mut self, now_ns: u64) -> Option<u64> {
        if !self.has_room() {
            return None;
        }
        let index = self.committed;
        self.committed += 1;
        if self.held_since.is_none() {
            self.held_since = Some(now_ns);
        }
        Some(index)
    }

    /// Every receiver has now acknowledged at least `least` messages (the minimum over them).
    /// Counts that go back or exceed what was pushed are ignored: a receiver cannot have
    /// consumed a message it was never shown.
    pub fn on_acknowledged(&mut self, least: u64) {
        if least > self.acknowledged && least <= self.pushed {
            self.acknowledged = least;
        }
    }

    /// Pushes everything committed at once, marked urgent (the proposal's `SMC::flush()`).
    pub fn flush(&mut self) {
        if self.pushed < self.committed {
            self.urgent = true;
        }
    }

    /// The next push to make now, if any; call again until `None`. A push never crosses the
    /// ring's wrap, so a pending run that wraps comes out as two pushes.
    pub fn poll_push(&mut self, now_ns: u64) -> Option<Push> {
        if self.pushed == self.committed {
            return None;
        }
        if self.pushed >= self.drain_to {
            let pending = self.committed - self.pushed;
            let due = self.urgent
                || match self.batching {
                    Batching::Off | Batching::Opportunistic => true,
                    Batching::Every { k, flush_ns } => {
                        pending >= k
                            || self
                                .held_since
                                .is_some_and(|t| now_ns.saturating_sub(t) >= flush_ns)
                    }
                };
            if !due {
                return None;
            }
            // Without batching a flush has nothing to gather: every message goes on its own.
            self.drain_to = match self.batching {
                Batching::Off => self.pushed + 1,
                _ => self.committed,
            };
            self.drain_urgent = std::mem::take(&mut self.urgent);
            self.drain_started = now_ns;
        }
        let start = self.pushed;
        let to_wrap = self.window - start % self.window;
        self.pushed += (self.drain_to - start).min(to_wrap);
        if self.pushed == self.committed {
            self.held_since = None;
        } else if self.pushed == self.drain_to {
            // What is left was committed after this drain was decided.
            self.held_since = Some(self.drain_started);
        }
        Some(Push {
            messages: start..self.pushed,
            urgent: self.drain_urgent,
        })
    }

    /// When a held-back push must go (only with [`Batching::Every`]), nanoseconds.
    pub fn deadline(&self) -> Option<u64> {
        match self.batching {
            Batching::Every { flush_ns, .. } if self.pushed < self.committed => {
                self.held_since.map(|t| t + flush_ns)
            }
            _ => None,
        }
    }
}

/// A receiver's side for one sender: when to push its consumed count.
#[derive(Debug, Clone)]
pub struct AckPlanner {
    batching: Batching,
    /// Messages of the sender consumed.
    consumed: u64,
    /// The count last pushed.
    acknowledged: u64,
    /// When the oldest consumed message not yet acknowledged was consumed.
    held_since: Option<u64>,
    /// An urgent push arrived: acknowledge everything now.
    urgent: bool,
}

impl AckPlanner {
    /// A planner acknowledging as `batching` says. Fails as [`PushPlanner::new`] does for a
    /// ring of `window` slots.
    pub fn new(batching: Batching, window: u64) -> Result<AckPlanner, CoalesceError> {
        check(batching, window)?;
        Ok(AckPlanner {
            batching,
            consumed: 0,
            acknowledged: 0,
            held_since: None,
            urgent: false,
        })
    }

    /// Messages consumed so far.
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// `n` more messages were consumed; `urgent` when they came with an urgent push.
    pub fn on_consumed(&mut self, n: u64, urgent: bool, now_ns: u64) {
        if n == 0 {
            return;
        }
        self.consumed += n;
        self.urgent |= urgent;
        if self.held_since.is_none() {
            self.held_since = Some(now_ns);
        }
    }

    /// The count to push now, if any; call again until `None` ([`Batching::Off`] gives one
    /// acknowledgement per message).
    pub fn poll_ack(&mut self, now_ns: u64) -> Option<u64> {
        if self.consumed == self.acknowledged {
            return None;
        }
        let value = match self.batching {
            Batching::Off => self.acknowledged + 1,
            Batching::Opportunistic => self.consumed,
            Batching::Every { k, flush_ns } => {
                let crossed = self.consumed / k > self.acknowledged / k;
                let late = self
                    .held_since
                    .is_some_and(|t| now_ns.saturating_sub(t) >= flush_ns);
                if !(self.urgent || crossed || late) {
                    return None;
                }
                self.consumed
            }
        };
        self.acknowledged = value;
        if self.acknowledged == self.consumed {
            self.held_since = None;
            self.urgent = false;
        }
        Some(value)
    }

    /// When a held-back acknowledgement must go (only with [`Batching::Every`]), nanoseconds.
    pub fn deadline(&self) -> Option<u64> {
        match self.batching {
            Batching::Every { flush_ns, .. } if self.acknowledged < self.consumed => {
                self.held_since.map(|t| t + flush_ns)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;
