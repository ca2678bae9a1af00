//! Group multicast over one-sided writes: Derecho's small-message multicast (SMC), with
//! Nagle-like batching (`off`, Spindle's `opportunistic`, and `k:N` with a flush deadline and an
//! explicit `flush()`).
//!
//! Every member allocates a table (engine memory, see `table`) and publishes where it lies in
//! its segment descriptor; `join_group` returns once it found every member's table with the
//! same settings. A sender commits a message into its ring (in its own table) and its group
//! thread pushes it with the engine's WRITE requests to the same place in every other member's
//! table, then writes its committed count there; receivers' group threads poll their own table
//! for counts, consume what arrived and write how much they consumed back to every member.
//! The decisions of when to push and when to acknowledge are
//! [`multirail_policy::coalesce`]'s.
//!
//! **A count never becomes visible before the data it covers.** Writes may take different
//! connections and rails (tcp sprays slices; shm copies on worker threads), so the group
//! thread completes the data writes of a push before it issues the count: each round it
//! submits one batch holding the data of the new push and the count of the push whose data
//! the previous batch completed, and waits for it. Pushes still overlap with counts, so this
//! costs one write's round trip of latency, not throughput; and it works unchanged on every
//! transport (ordered lanes would have to be built per transport). One batch at a time also
//! means two writes of the same count are never in flight together, so a count never goes
//! back at a receiver.
//!
//! **Failure.** Every member writes to every other at least every quarter of
//! `transports.tcp.timeout_ms` (a heartbeat when nothing else is due), and every write waits at
//! most that long: a member that died or stopped answering fails the group at the others within
//! the timeout, naming it. `leave()` is a barrier: members leave together, so nobody reads
//! another's departure as a failure.

mod order;
mod progress;
mod settings;
mod table;

pub use settings::{Delivery, GroupConfig};

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use multirail_policy::coalesce::PushPlanner;

use crate::engine::{Engine, SegmentId};
use crate::error::{Error, MemberFailure, Result};
use crate::memory::{Buffer, Location};
use crate::segment::GroupDescriptor;
use settings::Settings;
use table::{Layout, RecordHeader, Table};

/// One delivered multicast message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupMessage {
    /// The sending member's segment name.
    pub sender: Arc<str>,
    /// The message's index among its sender's messages (0, 1, ...; null messages of the
    /// ordered mode take indices too, so indices of one sender may skip).
    pub index: u64,
    /// The payload.
    pub bytes: Vec<u8>,
}

/// What a group has done at this member.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Messages this member sent.
    pub sent: u64,
    /// Payload bytes this member sent.
    pub sent_bytes: u64,
    /// Messages delivered to this member (its own included).
    pub delivered: u64,
    /// Pushes this member made (each one write of data and one of its count per member).
    pub pushes: u64,
    /// One-sided writes of ring data.
    pub data_writes: u64,
    /// One-sided writes of committed counts.
    pub counter_writes: u64,
    /// One-sided writes of received counts (acknowledgements).
    pub ack_writes: u64,
    /// Heartbeat writes (sent only when nothing else went to a member for a while).
    pub heartbeat_writes: u64,
    /// Sends that found the window full and waited.
    pub window_stalls: u64,
    /// Records of null messages this member sent (ordered delivery).
    pub null_records: u64,
}

/// Counters the group thread and callers bump.
#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    sent_bytes: AtomicU64,
    delivered: AtomicU64,
    pushes: AtomicU64,
    data_writes: AtomicU64,
    counter_writes: AtomicU64,
    ack_writes: AtomicU64,
    heartbeat_writes: AtomicU64,
    window_stalls: AtomicU64,
    null_records: AtomicU64,
}

/// Where each committed record of this member's ring lies and what it carries.
#[derive(Debug, Clone, Copy, Default)]
struct RecordMeta {
    /// Offset in the ring.
    pos: u64,
    /// Payload bytes.
    len: u64,
    /// Index of its first message.
    first: u64,
    /// Messages it stands for.
    count: u64,
}

/// The sending side, shared by callers (commit) and the group thread (push).
struct SendState {
    planner: PushPlanner,
    /// Ring offset of the next record.
    next_pos: u64,
    /// Metadata of record `r` at `r % window`.
    meta: Vec<RecordMeta>,
    /// Messages committed (nulls included).
    messages: u64,
    /// Records whose count has been written to every member.
    visible: u64,
    /// Records every other member has acknowledged.
    acknowledged: u64,
}

/// What the group thread shares with the `Group` handle.
pub(crate) struct Shared {
    engine: Engine,
    settings: Settings,
    /// This engine's member index.
    me: usize,
    /// This engine's sender rank, if it sends.
    my_rank: Option<usize>,
    layout: Layout,
    table: Table,
    /// Keeps the table's memory alive.
    buffer: Buffer,
    /// Each member's segment (`None` for this engine).
    peers: Vec<Option<SegmentId>>,
    /// Each member's table address.
    remote: Vec<u64>,
    /// Member names as senders of messages.
    names: Vec<Arc<str>>,
    send: Mutex<SendState>,
    send_cv: Condvar,
    inbox: Mutex<VecDeque<GroupMessage>>,
    inbox_cv: Condvar,
    /// The first member failure seen; the group is over once set.
    failure: OnceLock<(String, String)>,
    /// Set by `leave`: this member announces it is leaving.
    leaving: AtomicBool,
    /// Set by the group thread once every member announced it is leaving.
    all_left: AtomicBool,
    /// Tells the group thread to stop.
    stop: AtomicBool,
    counters: Counters,
    thread: OnceLock<thread::Thread>,
}

impl Shared {
    fn failure_error(&self) -> Option<Error> {
        self.failure.get().map(|(member, reason)| {
            Error::GroupMemberFailed(Box::new(MemberFailure {
                group: self.settings.name.clone(),
                member: member.clone(),
                reason: reason.clone(),
            }))
        })
    }

    /// Records that `member` failed, once, and wakes every waiter.
    fn fail(&self, member: &str, reason: String) {
        if self
            .failure
            .set((member.to_owned(), reason.clone()))
            .is_ok()
        {
            tracing::warn!(group = %self.settings.name, member, reason, "group member failed");
        }
        self.send_cv.notify_all();
        self.inbox_cv.notify_all();
    }

    /// The window stayed full for the whole timeout: fails the group, naming the members that
    /// have not acknowledged message `needed - 1` of this member (they hang, or are too slow
    /// to stay in the group), and returns the error.
    fn window_stuck(&self, needed: u64) -> Error {
        let rank = self.my_rank.expect("only senders have a window");
        let lagging: Vec<&str> = (0..self.settings.members.len())
            .filter(|&m| m != self.me)
            .filter(|&m| {
                let at = self.layout.rows[m].received + 16 * rank as u64;
                self.table.read_count(at).unwrap_or(0) < needed
            })
            .map(|m| self.settings.members[m].as_str())
            .collect();
        let member = match lagging.as_slice() {
            [] => self.settings.members[self.me].clone(),
            l => l.join(", "),
        };
        self.fail(
            &member,
            format!(
                "did not acknowledge message {} within {} ms; the window of {} messages stayed \
                 full",
                needed.saturating_sub(1),
                self.settings.timeout.as_millis(),
                self.settings.window
            ),
        );
        self.failure_error().expect("just failed")
    }

    fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    fn group_error(&self, reason: impl Into<String>) -> Error {
        Error::Group {
            group: self.settings.name.clone(),
            reason: reason.into(),
        }
    }
}

/// A joined multicast group (see the module doc). Dropping it without [`Group::leave`] stops
/// this member at once; the others then see it fail.
pub struct Group {
    shared: Arc<Shared>,
    worker: Option<thread::JoinHandle<()>>,
    /// The table was released (by `leave` or a drop).
    stopped: bool,
}

impl Engine {
    /// Joins multicast group `config.name` (every member calls this with the same settings).
    /// Returns once every member has joined. Fails on bad settings (naming the setting),
    /// when this engine is not among `members`, when a member joined with different settings
    /// (naming it and the setting), or when members have not joined within
    /// `join_timeout_ms` (naming them).
    pub fn join_group(&self, config: GroupConfig) -> Result<Group> {
        let settings = Settings::resolve(&config, self.config())?;
        let my_name = self.segment_name();
        let me = settings
            .members
            .iter()
            .position(|m| *m == my_name)
            .ok_or_else(|| Error::GroupJoin {
                group: settings.name.clone(),
                reason: format!(
                    "this engine ({my_name}) is not among the members {}",
                    settings.members.join(", ")
                ),
            })?;
        let layout = Layout::new(
            settings.members.len(),
            settings.senders.len(),
            |m| settings.senders.contains(&m),
            settings.window,
            settings.max_payload,
        );
        let buffer = self.allocate(layout.table_len as usize, Location::Any)?;
        let published = GroupDescriptor {
            name: settings.name.clone(),
            table_addr: buffer.addr(),
            table_len: layout.table_len,
            settings: settings.canonical(),
        };
        if let Err(e) = self.add_local_group(published) {
            let _ = self.free(&buffer);
            return Err(e);
        }
        match self.find_members(&settings, me) {
            Ok((peers, remote)) => Ok(Group::start(
                self.clone(),
                settings,
                me,
                layout,
                buffer,
                peers,
                remote,
            )),
            Err(e) => {
                self.remove_local_group(&settings.name);
                let _ = self.free(&buffer);
                Err(e)
            }
        }
    }

    /// Waits until every other member publishes the group; returns their segments and table
    /// addresses.
    fn find_members(
        &self,
        settings: &Settings,
        me: usize,
    ) -> Result<(Vec<Option<SegmentId>>, Vec<u64>)> {
        let n = settings.members.len();
        let mut peers: Vec<Option<SegmentId>> = vec![None; n];
        let mut remote = vec![0u64; n];
        let mut found = vec![false; n];
        found[me] = true;
        let deadline = Instant::now() + settings.join_timeout;
        let mut last_error: Vec<Option<String>> = vec![None; n];
        loop {
            for m in 0..n {
                if found[m] {
                    continue;
                }
                let name = &settings.members[m];
                match self.fetch_descriptor(name) {
                    Ok(d) => match d.groups.iter().find(|g| g.name == settings.name) {
                        Some(g) => {
                            settings.compare(name, &g.settings)?;
                            let id = self.open_segment(name)?;
                            peers[m] = Some(id);
                            remote[m] = g.table_addr;
                            found[m] = true;
                        }
                        None => last_error[m] = Some("has not joined the group".into()),
                    },
                    Err(e) => last_error[m] = Some(e.to_string()),
                }
            }
            if found.iter().all(|f| *f) {
                return Ok((peers, remote));
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> = (0..n)
                    .filter(|m| !found[*m])
                    .map(|m| {
                        format!(
                            "{} ({})",
                            settings.members[m],
                            last_error[m].as_deref().unwrap_or("not found")
                        )
                    })
                    .collect();
                return Err(Error::GroupJoin {
                    group: settings.name.clone(),
                    reason: format!(
                        "members missing after {} ms: {}",
                        settings.join_timeout.as_millis(),
                        missing.join(", ")
                    ),
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Group {
    fn start(
        engine: Engine,
        settings: Settings,
        me: usize,
        layout: Layout,
        buffer: Buffer,
        peers: Vec<Option<SegmentId>>,
        mut remote: Vec<u64>,
    ) -> Group {
        remote[me] = buffer.addr();
        let my_rank = settings.sender_rank(me);
        let window = settings.window;
        let planner =
            PushPlanner::new(settings.batching, window).expect("settings validated the batching");
        // SAFETY: the buffer is engine memory of `table_len` bytes, page-aligned, and `Shared`
        // keeps the `Buffer` (and so the mapping) alive as long as the table view.
        let table = unsafe { Table::new(buffer.as_ptr(), layout.table_len) };
        let names = settings
            .members
            .iter()
            .map(|m| Arc::<str>::from(m.as_str()))
            .collect();
        let shared = Arc::new(Shared {
            engine,
            me,
            my_rank,
            table,
            buffer,
            peers,
            remote,
            names,
            send: Mutex::new(SendState {
                planner,
                next_pos: 0,
                meta: vec![RecordMeta::default(); window as usize],
                messages: 0,
                visible: 0,
                acknowledged: 0,
            }),
            send_cv: Condvar::new(),
            inbox: Mutex::new(VecDeque::new()),
            inbox_cv: Condvar::new(),
            failure: OnceLock::new(),
            leaving: AtomicBool::new(false),
            all_left: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            counters: Counters::default(),
            thread: OnceLock::new(),
            layout,
            settings,
        });
        let runner = shared.clone();
        let worker = thread::Builder::new()
            .name(format!("mr-group-{}", shared.settings.name))
            .spawn(move || progress::run(runner))
            .ok();
        match &worker {
            Some(w) => {
                let _ = shared.thread.set(w.thread().clone());
            }
            None => shared.fail(
                &shared.settings.members[me],
                "cannot start the group thread".into(),
            ),
        }
        Group {
            shared,
            worker,
            stopped: false,
        }
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.shared.settings.name
    }

    /// The members' segment names, in member order.
    pub fn members(&self) -> &[String] {
        &self.shared.settings.members
    }

    /// Largest message this group carries, bytes.
    pub fn max_payload(&self) -> u64 {
        self.shared.settings.max_payload
    }

    /// Sends `bytes` to every member (this one included). Returns the message's index. Waits
    /// while the window is full. Fails when the payload exceeds `max_payload`, this member is
    /// not a sender, a member failed (died or hung: named within `transports.tcp.timeout_ms`),
    /// or the window stayed full for 1.5 × that timeout while every member was alive (the group
    /// then fails, naming the members that did not acknowledge).
    pub fn send(&self, bytes: &[u8]) -> Result<u64> {
        self.send_with(bytes.len(), |slot| slot.copy_from_slice(bytes))
    }

    /// Sends a message of `len` bytes that `fill` writes in place, straight into this
    /// member's ring (Derecho's `get_sendbuffer_ptr`): no copy before the push. Fails as
    /// [`Group::send`] does; on failure `fill` is not called.
    pub fn send_with(&self, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<u64> {
        match self.try_send_with(len, |slot| {
            fill(slot);
            Ok::<(), std::convert::Infallible>(())
        })? {
            Ok(index) => Ok(index),
            Err(never) => match never {},
        }
    }

    /// As [`Group::send_with`], with a `fill` that may fail: the message is committed only
    /// once `fill` returned `Ok`, so on `Err(e)` nothing is sent and the outcome is
    /// `Ok(Err(e))` (a binding whose callback raised, a source that ran dry). The slot is free
    /// for the next message. The group's own failures are the outer `Err`.
    pub fn try_send_with<E>(
        &self,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), E>,
    ) -> Result<std::result::Result<u64, E>> {
        let s = &self.shared;
        if len as u64 > s.settings.max_payload {
            return Err(s.group_error(format!(
                "a message of {len} bytes exceeds max_payload ({} bytes)",
                s.settings.max_payload
            )));
        }
        let Some(ring) = s.my_rank.and_then(|_| s.layout.rows[s.me].ring) else {
            return Err(s.group_error(format!(
                "this member ({}) is not among the group's senders",
                s.settings.members[s.me]
            )));
        };
        let mut state = s.send.lock().expect("group send state poisoned");
        if !state.planner.has_room() {
            s.counters.window_stalls.fetch_add(1, Ordering::Relaxed);
            // Past the timeout by half: a member that died or hangs is found and named by the
            // group thread within the timeout; a member that waits on it acknowledges nothing
            // meanwhile, and must not be blamed instead.
            let deadline = Instant::now() + s.settings.timeout * 3 / 2;
            while !state.planner.has_room() {
                if let Some(e) = s.failure_error() {
                    return Err(e);
                }
                let now = Instant::now();
                if now >= deadline {
                    let oldest = state.meta[(state.acknowledged % s.settings.window) as usize];
                    return Err(s.window_stuck(oldest.first + oldest.count));
                }
                state = s
                    .send_cv
                    .wait_timeout(state, deadline - now)
                    .expect("group send state poisoned")
                    .0;
            }
        }
        if let Some(e) = s.failure_error() {
            return Err(e);
        }
        // Records are numbered in commit order, and the lock is held until the commit.
        let record = state.planner.committed();
        let pos = state.next_pos;
        let index = state.messages;
        let header = ring + pos;
        // SAFETY: the record at `pos` is not committed yet, and the window keeps every
        // unacknowledged record clear of it (see `table`), so nothing reads or writes these
        // bytes while `fill` runs: the group thread pushes only committed records, and this
        // thread holds the send lock, which every commit takes.
        if let Err(e) =
            fill(unsafe { s.table.bytes_mut(header + table::RECORD_HEADER, len as u64) })
        {
            return Ok(Err(e));
        }
        let committed = state
            .planner
            .commit(progress::now_ns())
            .expect("room was checked");
        debug_assert_eq!(committed, record);
        s.table.write_header(
            header,
            RecordHeader {
                record,
                first: index,
                count: 1,
                null: false,
                len: len as u32,
            },
        );
        let slot = (record % s.settings.window) as usize;
        state.meta[slot] = RecordMeta {
            pos,
            len: len as u64,
            first: index,
            count: 1,
        };
        state.messages += 1;
        state.next_pos = s.layout.next_record(pos, len as u64);
        drop(state);
        s.counters.sent.fetch_add(1, Ordering::Relaxed);
        s.counters
            .sent_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        s.wake();
        Ok(Ok(index))
    }

    /// Pushes everything sent so far at once and asks receivers to acknowledge at once (the
    /// `flush()` of Derecho's proposal for SMC batching); returns once every member can see
    /// it. Fails when a member failed or the push did not finish within
    /// `transports.tcp.timeout_ms`.
    pub fn flush(&self) -> Result<()> {
        let s = &self.shared;
        let mut state = s.send.lock().expect("group send state poisoned");
        let target = state.planner.committed();
        state.planner.flush();
        s.wake();
        let deadline = Instant::now() + s.settings.timeout;
        while state.visible < target {
            if let Some(e) = s.failure_error() {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(s.group_error(format!(
                    "flush did not finish within {} ms",
                    s.settings.timeout.as_millis()
                )));
            }
            state = s
                .send_cv
                .wait_timeout(state, (deadline - now).min(Duration::from_millis(10)))
                .expect("group send state poisoned")
                .0;
        }
        match s.failure_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The next delivered message, waiting up to `timeout` (`None`: no limit). Returns
    /// `Ok(None)` when the time passed. Messages that arrived before a member failed are
    /// still returned; after them every call fails, naming the member.
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Option<GroupMessage>> {
        let s = &self.shared;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut inbox = s.inbox.lock().expect("group inbox poisoned");
        loop {
            if let Some(m) = inbox.pop_front() {
                return Ok(Some(m));
            }
            if let Some(e) = s.failure_error() {
                return Err(e);
            }
            let wait = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(None);
                    }
                    d - now
                }
                None => Duration::from_secs(3600),
            };
            inbox = s
                .inbox_cv
                .wait_timeout(inbox, wait)
                .expect("group inbox poisoned")
                .0;
        }
    }

    /// What the group has done at this member so far. Never fails.
    pub fn stats(&self) -> GroupStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        GroupStats {
            sent: get(&c.sent),
            sent_bytes: get(&c.sent_bytes),
            delivered: get(&c.delivered),
            pushes: get(&c.pushes),
            data_writes: get(&c.data_writes),
            counter_writes: get(&c.counter_writes),
            ack_writes: get(&c.ack_writes),
            heartbeat_writes: get(&c.heartbeat_writes),
            window_stalls: get(&c.window_stalls),
            null_records: get(&c.null_records),
        }
    }

    /// Leaves the group with the others: pushes what this member sent, waits until every
    /// member acknowledged it, tells the others it is leaving and waits until every member
    /// said the same (each wait up to `transports.tcp.timeout_ms` from the last progress), then
    /// releases the table. Returns the final stats. Fails when a member failed before everyone
    /// left or the barrier did not complete in time; the group is released either way.
    pub fn leave(mut self) -> Result<GroupStats> {
        let outcome = self.drain_and_announce();
        self.stop();
        outcome.map(|()| self.stats())
    }

    fn drain_and_announce(&self) -> Result<()> {
        let s = &self.shared;
        if s.my_rank.is_some() {
            self.flush()?;
            let mut state = s.send.lock().expect("group send state poisoned");
            let deadline = Instant::now() + s.settings.timeout;
            while state.acknowledged < state.planner.committed() {
                if let Some(e) = s.failure_error() {
                    return Err(e);
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(s.group_error(format!(
                        "members did not acknowledge every message within {} ms",
                        s.settings.timeout.as_millis()
                    )));
                }
                state = s
                    .send_cv
                    .wait_timeout(state, (deadline - now).min(Duration::from_millis(10)))
                    .expect("group send state poisoned")
                    .0;
            }
        }
        s.leaving.store(true, Ordering::Release);
        s.wake();
        let deadline = Instant::now() + s.settings.timeout;
        while !s.all_left.load(Ordering::Acquire) {
            if let Some(e) = s.failure_error() {
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Err(s.group_error(format!(
                    "not every member left within {} ms",
                    s.settings.timeout.as_millis()
                )));
            }
            thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let s = &self.shared;
        s.stop.store(true, Ordering::Release);
        s.wake();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        s.engine.remove_local_group(&s.settings.name);
        if let Err(e) = s.engine.free(&s.buffer) {
            tracing::debug!(group = %s.settings.name, error = %e, "group table already released");
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.stop();
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("name", &self.shared.settings.name)
            .field("members", &self.shared.settings.members)
            .finish()
    }
}
