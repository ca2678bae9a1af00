//! The group thread: one per joined group. Each round it reads its own table (what other
//! senders committed, what every member acknowledged, who is leaving), consumes and delivers
//! what arrived, asks the coalesce planners what to push and acknowledge, and submits the
//! round's writes as one engine batch, waiting for it (see the module doc of `group` for why
//! data and counts go in successive batches). With nothing to do it yields, then parks for
//! short spells: receivers are polled, since one-sided writes raise no event at the target.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use multirail_policy::coalesce::{AckPlanner, Batching};

use super::order::RoundRobin;
use super::table::{Layout, RecordHeader, LEAVING};
use super::{Delivery, GroupMessage, RecordMeta, Shared};
use crate::batch::Status;
use crate::engine::Request;

/// Nanoseconds on the process's monotonic clock, for the planners.
pub(super) fn now_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Rounds with nothing to do spent yielding before the thread parks.
const YIELD_ROUNDS: u32 = 200;

/// Longest park while idle: bounds how late an arrival is noticed once idle.
const IDLE_PARK: Duration = Duration::from_micros(50);

/// What a write of the round carries, for the counters.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Data,
    Count,
    Ack,
    Heartbeat,
}

/// One write of a round: to which member, carrying what.
struct Write {
    member: usize,
    kind: Kind,
    request: Request,
}

/// What a failed write says about its member. A refused write means the member's table is
/// gone: its group was dropped without `leave()` (or its engine freed the memory), which the
/// transport's words (an unknown buffer or key) would not make plain.
fn failure_reason(err: &crate::error::Error) -> String {
    match err {
        crate::error::Error::RemoteRejected { reason, .. } => format!(
            "its group table is gone (it dropped the group without leave(), or its memory was \
             freed): the write was refused, {reason}"
        ),
        e => e.to_string(),
    }
}

/// Runs the group thread until the group stops or fails.
pub(super) fn run(s: Arc<Shared>) {
    // The thread parks for tens of µs at a time (one-sided writes raise no event, so arrivals
    // are polled, and the k:N flush deadline is a timer). Linux lets a timed sleep overrun by
    // the thread's timer slack, 50 µs by default: as much again as the park, on every
    // delivery and every forced push. 1 µs of slack keeps the wake-ups where they are asked.
    // SAFETY: PR_SET_TIMERSLACK changes only this thread's timer slack; it takes no pointer.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000u64) };
    let mut p = Progress::new(&s);
    p.run();
}

struct Progress<'a> {
    s: &'a Shared,
    /// Per sender rank: records consumed, messages consumed, where the next record starts.
    consumed: Vec<u64>,
    consumed_msgs: Vec<u64>,
    read_pos: Vec<u64>,
    /// Per sender rank: messages consumed after record `r`, at `r % window`.
    ends: Vec<Vec<u64>>,
    acks: Vec<AckPlanner>,
    /// Per member, per sender rank: messages that member has acknowledged.
    received: Vec<Vec<u64>>,
    /// Members that announced they are leaving.
    left: Vec<bool>,
    /// Members that left and no longer answer: nothing more is written to them.
    gone: Vec<bool>,
    last_write: Vec<Instant>,
    /// Per member: the words of its row in this table as last read, and when they last
    /// changed. A live member changes them at least every heartbeat interval.
    row_seen: Vec<Vec<u64>>,
    last_heard: Vec<Instant>,
    order: Option<RoundRobin>,
    /// Records whose data the last batch completed; their count goes in the next.
    pending_count: Option<(u64, bool)>,
    /// The leaving bit was in a completed write to every member.
    announce_sent: bool,
    /// The round under way carries the leaving bit to every member.
    announcing: bool,
    heartbeat_every: Duration,
    inbox_limit: usize,
    /// The sender rank the next consuming pass starts at.
    first_rank: usize,
    staged: Vec<GroupMessage>,
    scratch: Vec<u8>,
}

impl<'a> Progress<'a> {
    fn new(s: &'a Shared) -> Progress<'a> {
        let senders = s.settings.senders.len();
        let members = s.settings.members.len();
        let window = s.settings.window;
        let heartbeat_every = (s.settings.timeout / 4).max(Duration::from_millis(1));
        Progress {
            s,
            consumed: vec![0; senders],
            consumed_msgs: vec![0; senders],
            read_pos: vec![0; senders],
            ends: vec![vec![0; window as usize]; senders],
            acks: (0..senders)
                .map(|_| AckPlanner::new(s.settings.batching, window).expect("validated"))
                .collect(),
            received: vec![vec![0; senders]; members],
            left: vec![false; members],
            gone: vec![false; members],
            // Due at once: the first round writes to every member, so connections are made
            // while every member just proved alive by joining. A connection made later to a
            // member that froze would wait `connect_timeout_ms` inside the submit, past the
            // timeout this thread promises to detect it in.
            last_write: vec![
                Instant::now()
                    .checked_sub(heartbeat_every)
                    .unwrap_or_else(Instant::now);
                members
            ],
            row_seen: vec![Vec::new(); members],
            last_heard: vec![Instant::now(); members],
            order: (s.settings.delivery == Delivery::Ordered).then(|| RoundRobin::new(senders)),
            pending_count: None,
            announce_sent: false,
            announcing: false,
            heartbeat_every,
            inbox_limit: (window as usize * senders * 4).max(4096),
            first_rank: 0,
            staged: Vec::new(),
            scratch: Vec::new(),
        }
    }

    fn layout(&self) -> &Layout {
        &self.s.layout
    }

    fn run(&mut self) {
        let mut idle = 0u32;
        loop {
            if self.s.stop.load(Ordering::Acquire) || self.s.failure.get().is_some() {
                return;
            }
            let now_ns = now_ns();
            let consumed = match self.consume(now_ns) {
                Ok(n) => n,
                Err((member, reason)) => {
                    self.s.fail(&member, reason);
                    return;
                }
            };
            self.read_received();
            if let Err((member, reason)) = self.check_heard() {
                self.s.fail(&member, reason);
                return;
            }
            self.update_window();
            if self.order.is_some() {
                self.fill_nulls(now_ns);
                self.deliver_ordered();
            }
            self.flush_staged();
            self.check_all_left();
            let (mut writes, data_end) = self.plan_writes(now_ns);
            if writes.is_empty() {
                if consumed > 0 {
                    idle = 0;
                    continue;
                }
                idle = idle.saturating_add(1);
                if idle < YIELD_ROUNDS {
                    std::thread::yield_now();
                } else {
                    std::thread::park_timeout(self.idle_wait(now_ns));
                }
                continue;
            }
            idle = 0;
            if !self.execute(&mut writes) {
                return;
            }
            self.after_batch(&writes, data_end);
        }
    }

    /// How long to park: until the next planner deadline or heartbeat, at most [`IDLE_PARK`].
    fn idle_wait(&self, now_ns: u64) -> Duration {
        let mut deadline: Option<u64> = self.acks.iter().filter_map(|a| a.deadline()).min();
        if self.s.my_rank.is_some() {
            let push = self
                .s
                .send
                .lock()
                .expect("group send state poisoned")
                .planner
                .deadline();
            deadline = match (deadline, push) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        match deadline {
            Some(d) => Duration::from_nanos(d.saturating_sub(now_ns)).min(IDLE_PARK),
            None => IDLE_PARK,
        }
    }

    /// Consumes what other senders committed into this table. Returns the records consumed,
    /// or the member whose ring holds something malformed.
    fn consume(&mut self, now_ns: u64) -> Result<u64, (String, String)> {
        let s = self.s;
        let window = s.settings.window;
        // Only what waits for the application counts against the limit (a caller that stops
        // calling `recv` stops consumption, so acknowledgements, so the senders). Messages the
        // total order holds do not: the order may be waiting for the very sender (its next
        // message or its nulls) that the limit would stop reading, and the group would hang
        // with every window full. The order holds at most about a window per sender anyway:
        // senders run at most a window past the slowest member, and nulls fill every gap.
        let held = s.inbox.lock().expect("group inbox poisoned").len();
        let mut room = self.inbox_limit.saturating_sub(held + self.staged.len());
        let mut total = 0;
        let senders = s.settings.senders.len();
        // Each pass starts at the next sender, so a limited room is shared, not taken by the
        // first sender every time.
        let first = self.first_rank;
        self.first_rank = (first + 1) % senders;
        for rank in (first..senders).chain(0..first) {
            let m = s.settings.senders[rank];
            if m == s.me {
                continue;
            }
            let row = self.layout().rows[m];
            let Some((count, urgent)) = s.table.read_committed(row.committed) else {
                continue;
            };
            let ring = row.ring.expect("senders have rings");
            if count > self.consumed[rank] + window {
                return Err((
                    s.settings.members[m].clone(),
                    format!(
                        "its committed count {count} is more than a window past the {} records \
                         consumed",
                        self.consumed[rank]
                    ),
                ));
            }
            let before = self.consumed[rank];
            while self.consumed[rank] < count && room > 0 {
                let record = self.consumed[rank];
                let pos = self.read_pos[rank];
                let h = s.table.read_header(ring + pos);
                let expected_first = self.consumed_msgs[rank];
                if h.record != record
                    || h.first != expected_first
                    || h.count == 0
                    || u64::from(h.len) > s.settings.max_payload
                    || (h.null && h.len != 0)
                    || (!h.null && h.count != 1)
                {
                    return Err((
                        s.settings.members[m].clone(),
                        format!(
                            "record {record} at ring offset {pos} is malformed: {h:?}, expected \
                             record {record} starting at message {expected_first}"
                        ),
                    ));
                }
                self.take_record(rank, m, ring + pos, h);
                self.ends[rank][(record % window) as usize] = self.consumed_msgs[rank];
                self.consumed[rank] += 1;
                self.read_pos[rank] = self.layout().next_record(pos, u64::from(h.len));
                room -= 1;
            }
            let n = self.consumed[rank] - before;
            if n > 0 {
                self.acks[rank].on_consumed(n, urgent, now_ns);
                total += n;
            }
        }
        Ok(total)
    }

    /// Takes one record of sender `rank` (member `m`) at table offset `at`: delivers it, or
    /// holds it for the total order.
    fn take_record(&mut self, rank: usize, m: usize, at: u64, h: RecordHeader) {
        let count = u64::from(h.count);
        self.consumed_msgs[rank] += count;
        let bytes = (!h.null).then(|| {
            self.s.table.copy_out(
                at + super::table::RECORD_HEADER,
                u64::from(h.len),
                &mut self.scratch,
            );
            std::mem::take(&mut self.scratch)
        });
        match &mut self.order {
            Some(order) => order.push(rank, h.first, count, bytes),
            None => {
                if let Some(bytes) = bytes {
                    self.staged.push(GroupMessage {
                        sender: self.s.names[m].clone(),
                        index: h.first,
                        bytes,
                    });
                }
            }
        }
    }

    /// Reads every other member's acknowledgements and leaving bit from this table.
    fn read_received(&mut self) {
        let s = self.s;
        for m in 0..s.settings.members.len() {
            if m == s.me {
                continue;
            }
            let row = self.layout().rows[m];
            for rank in 0..s.settings.senders.len() {
                if let Some(v) = s.table.read_count(row.received + 16 * rank as u64) {
                    let r = &mut self.received[m][rank];
                    *r = (*r).max(v);
                }
            }
            if s.table.read_word(row.start) & LEAVING != 0 {
                self.left[m] = true;
            }
        }
    }

    /// Fails a member (not one that announced leaving) whose row in this table has not changed
    /// for the timeout: it writes a heartbeat at least every quarter of that when it has
    /// nothing else to write, so it died, hangs, or cannot reach this member. This is what
    /// finds a frozen member over shm, where writes into its memory still succeed. When several
    /// are silent, the one silent longest is named: a member whose writes wait on a frozen one
    /// (over tcp a write completes only once the target applied it) falls silent after it.
    fn check_heard(&mut self) -> Result<(), (String, String)> {
        let s = self.s;
        let now = Instant::now();
        let senders = s.settings.senders.len() as u64;
        let mut silent: Option<usize> = None;
        for m in 0..s.settings.members.len() {
            if m == s.me || self.left[m] || self.gone[m] {
                continue;
            }
            let row = self.layout().rows[m];
            let words = (row.start..row.received + 16 * senders)
                .step_by(8)
                .map(|off| s.table.read_word(off));
            let seen = &mut self.row_seen[m];
            if seen.is_empty() || !seen.iter().copied().eq(words.clone()) {
                seen.clear();
                seen.extend(words);
                self.last_heard[m] = now;
            } else if now.duration_since(self.last_heard[m]) >= s.settings.timeout
                && silent.is_none_or(|o| self.last_heard[m] < self.last_heard[o])
            {
                silent = Some(m);
            }
        }
        match silent {
            None => Ok(()),
            Some(m) => Err((
                s.settings.members[m].clone(),
                format!(
                    "nothing heard from it for {} ms (no message, acknowledgement or heartbeat)",
                    now.duration_since(self.last_heard[m]).as_millis()
                ),
            )),
        }
    }

    /// Frees ring records every other member acknowledged.
    fn update_window(&mut self) {
        let s = self.s;
        let Some(rank) = s.my_rank else { return };
        let least = (0..s.settings.members.len())
            .filter(|&m| m != s.me && !self.gone[m])
            .map(|m| self.received[m][rank])
            .min()
            .unwrap_or(u64::MAX);
        let mut state = s.send.lock().expect("group send state poisoned");
        let before = state.acknowledged;
        while state.acknowledged < state.visible {
            let meta = state.meta[(state.acknowledged % s.settings.window) as usize];
            if meta.first + meta.count > least {
                break;
            }
            state.acknowledged += 1;
        }
        if state.acknowledged > before {
            let acknowledged = state.acknowledged;
            state.planner.on_acknowledged(acknowledged);
            drop(state);
            s.send_cv.notify_all();
        }
    }

    /// Ordered delivery: when another sender is ahead, commits one record of nulls up to it,
    /// so the round robin never waits for this member.
    fn fill_nulls(&mut self, now_ns: u64) {
        let s = self.s;
        let Some(me) = s.my_rank else { return };
        let ahead = (0..s.settings.senders.len())
            .filter(|&r| r != me)
            .map(|r| self.consumed_msgs[r])
            .max()
            .unwrap_or(0);
        let Some(ring) = s.layout.rows[s.me].ring else {
            return;
        };
        let mut state = s.send.lock().expect("group send state poisoned");
        if ahead <= state.messages || !state.planner.has_room() {
            return;
        }
        let count = (ahead - state.messages).min(u64::from(u32::MAX >> 1));
        let record = state.planner.commit(now_ns).expect("room was checked");
        let pos = state.next_pos;
        let first = state.messages;
        s.table.write_header(
            ring + pos,
            RecordHeader {
                record,
                first,
                count: count as u32,
                null: true,
                len: 0,
            },
        );
        let slot = (record % s.settings.window) as usize;
        state.meta[slot] = RecordMeta {
            pos,
            len: 0,
            first,
            count,
        };
        state.messages += count;
        state.next_pos = s.layout.next_record(pos, 0);
        s.counters.null_records.fetch_add(1, Ordering::Relaxed);
    }

    /// Ordered delivery: delivers every message stable at every member.
    fn deliver_ordered(&mut self) {
        let s = self.s;
        let senders = s.settings.senders.len();
        let stable: Vec<u64> = (0..senders)
            .map(|rank| {
                (0..s.settings.members.len())
                    .filter(|&m| m != s.me && !self.gone[m])
                    .map(|m| self.received[m][rank])
                    .fold(self.consumed_msgs[rank], u64::min)
            })
            .collect();
        let Some(order) = self.order.as_mut() else {
            return;
        };
        let names = &s.names;
        let staged = &mut self.staged;
        order.poll(&stable, |rank, index, bytes| {
            staged.push(GroupMessage {
                sender: names[s.settings.senders[rank]].clone(),
                index,
                bytes,
            })
        });
    }

    /// Hands staged deliveries to `recv`.
    fn flush_staged(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let n = self.staged.len() as u64;
        self.s
            .inbox
            .lock()
            .expect("group inbox poisoned")
            .extend(self.staged.drain(..));
        self.s.counters.delivered.fetch_add(n, Ordering::Relaxed);
        self.s.inbox_cv.notify_all();
    }

    /// Once this member's leaving is known everywhere, every member announced leaving, and
    /// everything this member committed is visible, the barrier of `leave` is passed.
    fn check_all_left(&mut self) {
        let s = self.s;
        if !self.announce_sent || s.all_left.load(Ordering::Relaxed) {
            return;
        }
        let everyone = (0..s.settings.members.len()).all(|m| m == s.me || self.left[m]);
        let drained = {
            let state = s.send.lock().expect("group send state poisoned");
            state.visible == state.planner.committed()
        };
        if everyone && drained && self.pending_count.is_none() {
            s.all_left.store(true, Ordering::Release);
        }
    }

    /// The writes of this round: the count of the data the last batch completed, the data of
    /// new pushes, acknowledgements, and heartbeats (or the leaving announcement). Returns the
    /// requests, what each carries, which member each goes to, and the end of the new push.
    fn plan_writes(&mut self, now_ns: u64) -> (Vec<Write>, Option<(u64, bool)>) {
        let s = self.s;
        let mut writes: Vec<Write> = Vec::new();
        let others: Vec<usize> = (0..s.settings.members.len())
            .filter(|&m| m != s.me && !self.gone[m])
            .collect();
        let me_row = self.layout().rows[s.me];
        let write = |m: usize, kind: Kind, off: u64, len: u64| {
            let peer = s.peers[m].expect("other members have segments");
            let mut request = Request::write(s.table.addr(off), peer, s.remote[m] + off, len);
            request.transport = s.settings.transport;
            Write {
                member: m,
                kind,
                request,
            }
        };
        let add = |kind: Kind, off: u64, len: u64, writes: &mut Vec<Write>| {
            writes.extend(others.iter().map(|&m| write(m, kind, off, len)));
        };
        if let Some((records, urgent)) = self.pending_count {
            s.table.write_committed(me_row.committed, records, urgent);
            add(Kind::Count, me_row.committed, 16, &mut writes);
        }
        let mut data_end = None;
        if let (Some(_), Some(ring)) = (s.my_rank, me_row.ring) {
            let mut state = s.send.lock().expect("group send state poisoned");
            while let Some(push) = state.planner.poll_push(now_ns) {
                let (first, last) = (push.messages.start, push.messages.end - 1);
                let window = s.settings.window;
                let meta = |r: u64| state.meta[(r % window) as usize];
                let start = meta(first).pos;
                let end_of = |r: u64| meta(r).pos + Layout::record_bytes(meta(r).len);
                if meta(last).pos >= start {
                    add(Kind::Data, ring + start, end_of(last) - start, &mut writes);
                } else {
                    // The records wrapped to the ring's start: two writes.
                    let wrap = (first + 1..=last)
                        .find(|&r| meta(r).pos < meta(r - 1).pos)
                        .expect("positions go back only at the wrap");
                    add(
                        Kind::Data,
                        ring + start,
                        end_of(wrap - 1) - start,
                        &mut writes,
                    );
                    add(Kind::Data, ring, end_of(last), &mut writes);
                }
                let urgent = push.urgent || data_end.is_some_and(|(_, u)| u);
                data_end = Some((push.messages.end, urgent));
                s.counters.pushes.fetch_add(1, Ordering::Relaxed);
                if s.settings.batching == Batching::Off {
                    break;
                }
            }
        }
        // One acknowledgement per sender per round: with batching off that is one write per
        // message, the count of Derecho's unbatched SMC.
        let mut acked = false;
        for rank in 0..s.settings.senders.len() {
            if let Some(v) = self.acks[rank].poll_ack(now_ns) {
                let value = self.ends[rank][((v - 1) % s.settings.window) as usize];
                s.table
                    .write_count(me_row.received + 16 * rank as u64, value);
                acked = true;
            }
        }
        if acked {
            add(
                Kind::Ack,
                me_row.received,
                16 * s.settings.senders.len() as u64,
                &mut writes,
            );
        }
        let leaving = s.leaving.load(Ordering::Acquire);
        let announce = leaving && !self.announce_sent;
        self.announcing = announce;
        let now = Instant::now();
        let due: Vec<usize> = others
            .iter()
            .copied()
            .filter(|&m| {
                announce
                    || (!writes.iter().any(|w| w.member == m)
                        && now.duration_since(self.last_write[m]) >= self.heartbeat_every)
            })
            .collect();
        if !due.is_empty() {
            s.table.beat(me_row.start, leaving);
            writes.extend(
                due.into_iter()
                    .map(|m| write(m, Kind::Heartbeat, me_row.start, 8)),
            );
        }
        (writes, data_end)
    }

    /// Submits the round's writes as one batch and waits for them. A member whose writes
    /// fail fails the group (unless it already left); returns false when the group failed.
    fn execute(&mut self, writes: &mut [Write]) -> bool {
        let s = self.s;
        let engine = &s.engine;
        let batch = match engine.allocate_batch(writes.len()) {
            Ok(b) => b,
            Err(e) => {
                s.fail(
                    &s.settings.members[s.me],
                    format!("cannot allocate a batch: {e}"),
                );
                return false;
            }
        };
        // One submit per member, so a refusal names the member it concerns; the batch's
        // request order is then this sorted order.
        writes.sort_by_key(|w| w.member);
        let mut failed: Vec<(usize, String)> = Vec::new();
        let mut submitted: Vec<usize> = Vec::new();
        for chunk in writes.chunk_by(|a, b| a.member == b.member) {
            let requests: Vec<Request> = chunk.iter().map(|w| w.request).collect();
            match engine.submit(batch, &requests) {
                Ok(()) => submitted.extend(chunk.iter().map(|w| w.member)),
                Err(e) => failed.push((chunk[0].member, e.to_string())),
            }
        }
        if let Err(e) = engine.wait(batch, Some(s.settings.timeout)) {
            for (j, &m) in submitted.iter().enumerate() {
                match engine.status(batch, j) {
                    Ok(Status::Failed(err)) => failed.push((m, failure_reason(&err))),
                    Ok(Status::Pending) => failed.push((
                        m,
                        format!("no answer within {} ms", s.settings.timeout.as_millis()),
                    )),
                    _ => {}
                }
            }
            if failed.is_empty() {
                failed.push((s.me, e.to_string()));
            }
        }
        if engine.free_batch(batch).is_err() {
            tracing::debug!(group = %s.settings.name, "a timed-out batch stays allocated");
        }
        let now = Instant::now();
        for w in writes.iter() {
            self.last_write[w.member] = now;
        }
        let mut ok = true;
        for (m, reason) in failed {
            if m != s.me && self.left[m] {
                // A member that announced leaving may be gone already: stop writing to it.
                self.gone[m] = true;
                continue;
            }
            s.fail(&s.settings.members[m], reason);
            ok = false;
        }
        ok
    }

    /// Bookkeeping once a batch completed: counters, visibility of the pushed count, the count
    /// of the new push for the next batch, and this member's own records.
    fn after_batch(&mut self, writes: &[Write], data_end: Option<(u64, bool)>) {
        let s = self.s;
        let c = &s.counters;
        for w in writes {
            let counter = match w.kind {
                Kind::Data => &c.data_writes,
                Kind::Count => &c.counter_writes,
                Kind::Ack => &c.ack_writes,
                Kind::Heartbeat => &c.heartbeat_writes,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if self.announcing {
            self.announce_sent = true;
        }
        if let Some((records, urgent)) = self.pending_count.take() {
            self.own_records_visible(records, urgent);
        }
        self.pending_count = data_end;
    }

    /// This member's records up to `records` are visible everywhere: it consumes them too
    /// (delivering its own messages, acknowledging them like any member).
    fn own_records_visible(&mut self, records: u64, urgent: bool) {
        let s = self.s;
        let Some(rank) = s.my_rank else { return };
        let ring = s.layout.rows[s.me].ring.expect("senders have rings");
        let window = s.settings.window;
        let metas: Vec<RecordMeta> = {
            let state = s.send.lock().expect("group send state poisoned");
            (state.visible..records)
                .map(|r| state.meta[(r % window) as usize])
                .collect()
        };
        let from = self.consumed[rank];
        for (i, meta) in metas.iter().enumerate() {
            let record = from + i as u64;
            let h = s.table.read_header(ring + meta.pos);
            self.take_record(rank, s.me, ring + meta.pos, h);
            self.ends[rank][(record % window) as usize] = self.consumed_msgs[rank];
        }
        self.consumed[rank] = records;
        let n = records - from;
        self.acks[rank].on_consumed(n, urgent, now_ns());
        self.flush_staged();
        {
            let mut state = s.send.lock().expect("group send state poisoned");
            state.visible = records;
        }
        s.send_cv.notify_all();
    }
}
