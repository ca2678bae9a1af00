//! When the next message is due, for a receiver whose messages come at a steady cadence (a
//! decode node told of every step, a heartbeat), so that its wait can sleep through most of
//! the silence and be awake again, polling, shortly before the message comes: it then takes
//! the message at a poll's cost instead of a wake-up's. On a virtual machine waking a halted
//! vCPU costs tens of µs, far more than a message over shm; the anticipating receiver pays
//! that wake-up on a timer before the message instead of after it. This is the hybrid polling
//! of Linux's block layer (sleep for part of the expected completion time, then poll), keyed
//! to the gaps between arrivals rather than a device's completion time.
//!
//! The policy is pure: it is told when messages arrived (ns on one clock) and how late its
//! timer wakes came, and answers when to wake and how long to poll. It anticipates only while
//! the recent gaps are steady enough that the poll stays a small share of the gap
//! ([`MAX_POLL_SHARE`]): messages at random times get no anticipation and cost nothing more
//! than before.
//!
//! A timer wakes a sleeping thread late, and by how much depends on the host: tens of µs on
//! bare metal, 100-300 µs on a busy virtual machine whose halted vCPU the hypervisor must
//! schedule again. A fixed lead shorter than that wakes after the message (which then pays the
//! wake-up the anticipation was for), so the wait also learns how late its timer wakes have
//! been ([`Cadence::woke_late`]) and wakes that much earlier on top of the lead.

/// Gaps remembered: the last this many.
pub(crate) const GAPS: usize = 8;
/// Gaps needed before any anticipation: a cadence seen once is not yet a cadence.
pub(crate) const MIN_GAPS: usize = 4;
/// The poll window (the spread of the remembered gaps plus the lead on both sides) may be at
/// most this share of the shortest gap: at a 10 ms cadence, at most 1.25 ms of polling.
pub(crate) const MAX_POLL_SHARE: u64 = 8;
/// Timer wakes remembered: how late the last this many came.
pub(crate) const LATE_WAKES: usize = 8;

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
    /// How late (ns) the last timer wakes came after the time asked for.
    late: [u64; LATE_WAKES],
    /// Late wakes recorded, up to [`LATE_WAKES`].
    late_len: usize,
    /// Where the next one goes in `late`.
    late_next: usize,
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
            late: [0; LATE_WAKES],
            late_len: 0,
            late_next: 0,
        }
    }

    /// A sleep asked to wake at an [`Anticipation::wake_at`] ended `late_ns` after it (a sleep
    /// that ended earlier, on a message, says nothing about the timer and is not recorded).
    pub(crate) fn woke_late(&mut self, late_ns: u64) {
        self.late[self.late_next] = late_ns;
        self.late_next = (self.late_next + 1) % LATE_WAKES;
        self.late_len = (self.late_len + 1).min(LATE_WAKES);
    }

    /// How much earlier than the lead a wait asks to wake: the upper quartile of the recent
    /// timer wakes' lateness (a rare very late wake, the hypervisor busy elsewhere, does not
    /// keep every later wait polling that much longer), 0 before any was recorded.
    fn expected_lateness(&self) -> u64 {
        if self.late_len == 0 {
            return 0;
        }
        let mut late = self.late;
        let late = &mut late[..self.late_len];
        late.sort_unstable();
        late[(self.late_len * 3) / 4]
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
        // Earlier by what the timer has been late, but never by more than the poll's share of
        // the gap: a host whose timers come later than that gets a late poll, not a long one.
        let early = self.expected_lateness().min(shortest / MAX_POLL_SHARE);
        let wake_at = (last + shortest).saturating_sub(self.lead + early);
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
    fn late_timer_wakes_move_the_wake_earlier_by_their_upper_quartile() {
        let (mut c, last) = steady(200 * US, &[10 * MS; 8]);
        let on_time = c.anticipate(last).expect("steady").wake_at;
        assert_eq!(on_time, last + 10 * MS - 200 * US);
        // This host's timers come 150 µs late: wake 150 µs earlier still.
        for _ in 0..LATE_WAKES {
            c.woke_late(150 * US);
        }
        let a = c.anticipate(last).expect("steady");
        assert_eq!(a.wake_at, on_time - 150 * US);
        // Polling still ends the lead after the latest gap: only the start moves.
        assert_eq!(a.poll_until, last + 10 * MS + 200 * US);
        // One wake far later than the rest (the hypervisor busy elsewhere) moves nothing.
        c.woke_late(3 * MS);
        assert_eq!(
            c.anticipate(last).expect("steady").wake_at,
            on_time - 150 * US
        );
        // Once most recent wakes come later, the wait follows them.
        for _ in 0..LATE_WAKES / 2 {
            c.woke_late(400 * US);
        }
        assert_eq!(
            c.anticipate(last).expect("steady").wake_at,
            on_time - 400 * US
        );
    }

    #[test]
    fn the_learned_lateness_never_wakes_earlier_than_the_polls_share_of_the_gap() {
        let (mut c, last) = steady(200 * US, &[10 * MS; 8]);
        for _ in 0..LATE_WAKES {
            c.woke_late(5 * MS);
        }
        let a = c.anticipate(last).expect("steady");
        assert_eq!(
            a.wake_at,
            last + 10 * MS - 200 * US - 10 * MS / MAX_POLL_SHARE
        );
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
