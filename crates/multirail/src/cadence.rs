//! When the next message is due, for a receiver whose messages come at a steady cadence (a
//! decode node told of every step, a heartbeat), so that its wait can sleep through most of
//! the silence and be awake again, polling, shortly before the message comes: it then takes
//! the message at a poll's cost instead of a wake-up's. On a virtual machine waking a halted
//! vCPU costs tens of µs, far more than a message over shm; the anticipating receiver pays
//! that wake-up on a timer before the message instead of after it. This is the hybrid polling
//! of Linux's block layer (sleep for part of the expected completion time, then poll), keyed
//! to the gaps between arrivals rather than a device's completion time.
//!
//! The policy is pure: it is told when messages arrived (ns on one clock) and answers when to
//! wake and how long to poll. It anticipates only while the recent gaps are steady enough that
//! the poll stays a small share of the gap ([`MAX_POLL_SHARE`]): messages at random times get
//! no anticipation and cost nothing more than before.

/// Gaps remembered: the last this many.
pub(crate) const GAPS: usize = 8;
/// Gaps needed before any anticipation: a cadence seen once is not yet a cadence.
pub(crate) const MIN_GAPS: usize = 4;
/// The poll window (the spread of the remembered gaps plus the lead on both sides) may be at
/// most this share of the shortest gap: at a 10 ms cadence, at most 1.25 ms of polling.
pub(crate) const MAX_POLL_SHARE: u64 = 8;

/// When to wake before a message due at the cadence, and until when to poll for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Anticipation {
    /// Wake (ns, the clock of [`Cadence::arrived`]) and start polling.
    pub(crate) wake_at: u64,
    /// Poll until then at the latest; a message not come by then is waited for as usual.
    pub(crate) poll_until: u64,
}

/// The recent gaps between arrivals, and the last arrival.
#[derive(Debug, Clone)]
pub(crate) struct Cadence {
    /// How long before the earliest expected arrival the receiver wakes, and how long after
    /// the latest it keeps polling, ns; zero never anticipates.
    lead: u64,
    gaps: [u64; GAPS],
    /// Gaps recorded, up to [`GAPS`].
    len: usize,
    /// Where the next gap goes in `gaps`.
    next: usize,
    last: Option<u64>,
}

impl Cadence {
    /// A cadence that wakes `lead_ns` ahead of a due message (zero: never).
    pub(crate) fn new(lead_ns: u64) -> Cadence {
        Cadence {
            lead: lead_ns,
            gaps: [0; GAPS],
            len: 0,
            next: 0,
            last: None,
        }
    }

    /// A message arrived at `at` (ns): the gap since the last one is recorded. An arrival
    /// earlier than the last one (threads reading the clock out of order) starts over.
    pub(crate) fn arrived(&mut self, at: u64) {
        if let Some(last) = self.last {
            if at < last {
                self.len = 0;
            } else {
                self.gaps[self.next] = at - last;
                self.next = (self.next + 1) % GAPS;
                self.len = (self.len + 1).min(GAPS);
            }
        }
        self.last = Some(at);
    }

    /// When a wait at `now` (ns) should wake and poll for the next message, if the cadence is
    /// steady and the message not yet overdue; `None` otherwise (sleep as usual).
    pub(crate) fn anticipate(&self, now: u64) -> Option<Anticipation> {
        if self.lead == 0 || self.len < MIN_GAPS {
            return None;
        }
        let last = self.last?;
        let gaps = &self.gaps[..self.len];
        let shortest = *gaps.iter().min().expect("len >= MIN_GAPS");
        let longest = *gaps.iter().max().expect("len >= MIN_GAPS");
        let window = (longest - shortest).saturating_add(self.lead.saturating_mul(2));
        if shortest == 0 || window > shortest / MAX_POLL_SHARE {
            return None;
        }
        let wake_at = (last + shortest).saturating_sub(self.lead);
        let poll_until = last.saturating_add(longest).saturating_add(self.lead);
        (now < poll_until).then_some(Anticipation {
            wake_at,
            poll_until,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;

    fn steady(lead: u64, gaps: &[u64]) -> (Cadence, u64) {
        let mut c = Cadence::new(lead);
        let mut t = 5 * MS;
        c.arrived(t);
        for g in gaps {
            t += g;
            c.arrived(t);
        }
        (c, t)
    }

    #[test]
    fn a_steady_cadence_wakes_the_lead_before_the_shortest_gap_and_polls_past_the_longest() {
        let (c, last) = steady(
            100 * US,
            &[
                10 * MS,
                10 * MS + 60 * US,
                10 * MS + 20 * US,
                10 * MS + 40 * US,
            ],
        );
        let a = c
            .anticipate(last + 10 * US)
            .expect("steady gaps anticipate");
        assert_eq!(a.wake_at, last + 10 * MS - 100 * US);
        assert_eq!(a.poll_until, last + 10 * MS + 60 * US + 100 * US);
        // Still anticipated until the window closes; overdue after it.
        assert!(c.anticipate(a.poll_until - 1).is_some());
        assert_eq!(c.anticipate(a.poll_until), None);
    }

    #[test]
    fn too_few_gaps_irregular_gaps_or_no_lead_never_anticipate() {
        // Three gaps: not yet a cadence.
        let (c, last) = steady(100 * US, &[10 * MS; 3]);
        assert_eq!(c.anticipate(last), None);
        // Gaps from 5 to 15 ms: the window would be a whole 10 ms of polling.
        let (c, last) = steady(100 * US, &[5 * MS, 15 * MS, 9 * MS, 12 * MS, 7 * MS]);
        assert_eq!(c.anticipate(last), None);
        // A cadence so short that the leads alone exceed an eighth of it.
        let (c, last) = steady(100 * US, &[MS; 8]);
        assert_eq!(c.anticipate(last), None);
        // Lead zero: off.
        let (c, last) = steady(0, &[10 * MS; 8]);
        assert_eq!(c.anticipate(last), None);
        // The same cadence with a lead anticipates.
        let (c, last) = steady(100 * US, &[10 * MS; 8]);
        assert!(c.anticipate(last).is_some());
    }

    #[test]
    fn one_long_gap_stops_anticipation_until_it_leaves_the_remembered_gaps() {
        let (mut c, mut t) = steady(100 * US, &[10 * MS; 8]);
        // A skipped step: one 20 ms gap.
        t += 20 * MS;
        c.arrived(t);
        assert_eq!(c.anticipate(t), None);
        for _ in 0..GAPS - 1 {
            t += 10 * MS;
            c.arrived(t);
            assert_eq!(c.anticipate(t), None);
        }
        t += 10 * MS;
        c.arrived(t);
        assert!(c.anticipate(t).is_some(), "the long gap has been forgotten");
    }

    #[test]
    fn an_arrival_out_of_order_forgets_the_gaps_and_anchors_anew() {
        let (mut c, t) = steady(100 * US, &[10 * MS; 8]);
        c.arrived(t - 3 * MS);
        assert_eq!(c.anticipate(t), None);
        for i in 1..=MIN_GAPS as u64 {
            assert_eq!(c.anticipate(t - 3 * MS + i * 10 * MS), None);
            c.arrived(t - 3 * MS + i * 10 * MS);
        }
        assert!(c.anticipate(t + 37 * MS).is_some());
    }
}
