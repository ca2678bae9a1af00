//! Receive-buffer accounting for two-sided messages: how many receive buffers are posted, to
//! which connection, when a consumed buffer goes back, and how many credits each sender holds.
//!
//! The model is InfiniBand's, so an RDMA transport maps it one to one:
//!
//! | here | verbs |
//! | --- | --- |
//! | a [`ReceiveQueue`] with `shared_receive_queue: false`, one per connection | the QP's receive queue |
//! | a [`ReceiveQueue`] with `shared_receive_queue: true`, one per engine | an SRQ (`ibv_create_srq`, `max_wr = queue_depth`, `max_sge`) |
//! | `queue_depth` buffers in `registration_chunks` chunks ([`ReceiveQueue::location`]) | `ibv_reg_mr` per chunk, one SGE per receive |
//! | a buffer in the free list, or granted to a connection | a posted receive WR (`ibv_post_recv` / `ibv_post_srq_recv`) |
//! | [`ReceiveQueue::on_arrival`] | a receive completion (`IBV_WC_RECV`) |
//! | [`ReceiveQueue::on_consumed`] under `individual` / `bulk` | re-posting one WR at once / all of them when none is left |
//! | [`Grant`] / [`Credits`] | the credit messages of RAMCloud- or eRPC-style flow control, so a send never meets an empty queue (no RNR) |
//!
//! A sender sends only against a credit, and a credit stands for one buffer posted for its
//! connection, so the receiver is never overrun. Over a socket the receiver picks the buffer of
//! each arrival in posting order; over shared memory the sender names the buffer it wrote
//! into, and [`ReceiveQueue::on_arrival`] checks the name.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

/// Most receive buffers a queue may hold.
pub const MAX_QUEUE_DEPTH: usize = 1 << 20;
/// Most scatter/gather entries a receive may name (a common HCA limit).
pub const MAX_SGE: usize = 32;
/// Largest receive buffer.
pub const MAX_BUFFER_SIZE: usize = 64 << 20;

/// When a consumed buffer is posted again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReturnPolicy {
    /// As soon as its message is consumed.
    #[default]
    Individual,
    /// All consumed buffers together, once no posted buffer is left.
    Bulk,
}

/// Whether a responder returns a request's buffer before or after sending its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReturnOrder {
    /// Return the buffer, then send the answer.
    #[default]
    BeforeReply,
    /// Send the answer, then return the buffer.
    AfterReply,
}

/// The receive-path knobs of RAMCloud's InfRc ping-pong study.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiveSettings {
    /// Receive buffers per connection, or in the shared pool (N).
    pub queue_depth: usize,
    /// One pool for every connection (an SRQ) instead of one per connection.
    pub shared_receive_queue: bool,
    /// The pool is registered as M contiguous chunks of N/M buffers each; M divides N.
    pub registration_chunks: usize,
    /// Most scatter/gather entries a receive may use.
    pub max_sge: usize,
    /// Bytes per receive buffer: the largest message.
    pub buffer_size: usize,
    /// When consumed buffers are posted again.
    pub return_policy: ReturnPolicy,
    /// Buffer return before or after a reply.
    pub return_order: ReturnOrder,
}

impl Default for ReceiveSettings {
    fn default() -> Self {
        ReceiveSettings {
            queue_depth: 64,
            shared_receive_queue: false,
            registration_chunks: 1,
            max_sge: 1,
            buffer_size: 8192,
            return_policy: ReturnPolicy::Individual,
            return_order: ReturnOrder::BeforeReply,
        }
    }
}

/// A bad setting or a broken protocol, naming the key or the event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiveError {
    /// The setting (`queue_depth`, `registration_chunks`, ...) or `arrival` / `consume`.
    pub key: &'static str,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ReceiveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

impl std::error::Error for ReceiveError {}

fn err(key: &'static str, message: impl Into<String>) -> ReceiveError {
    ReceiveError {
        key,
        message: message.into(),
    }
}

impl ReceiveSettings {
    /// Checks every knob; the error names the first bad key.
    pub fn validate(&self) -> Result<(), ReceiveError> {
        if !(1..=MAX_QUEUE_DEPTH).contains(&self.queue_depth) {
            return Err(err(
                "queue_depth",
                format!(
                    "must be within [1, {MAX_QUEUE_DEPTH}], got {}",
                    self.queue_depth
                ),
            ));
        }
        if self.registration_chunks == 0 {
            return Err(err("registration_chunks", "must be at least 1, got 0"));
        }
        if !self.queue_depth.is_multiple_of(self.registration_chunks) {
            return Err(err(
                "registration_chunks",
                format!(
                    "must divide queue_depth ({}), got {}",
                    self.queue_depth, self.registration_chunks
                ),
            ));
        }
        if !(1..=MAX_SGE).contains(&self.max_sge) {
            return Err(err(
                "max_sge",
                format!("must be within [1, {MAX_SGE}], got {}", self.max_sge),
            ));
        }
        if !(1..=MAX_BUFFER_SIZE).contains(&self.buffer_size) {
            return Err(err(
                "buffer_size",
                format!(
                    "must be within [1, {MAX_BUFFER_SIZE}], got {}",
                    self.buffer_size
                ),
            ));
        }
        Ok(())
    }

    /// Buffers per registration chunk (N/M).
    pub fn buffers_per_chunk(&self) -> usize {
        self.queue_depth / self.registration_chunks
    }

    /// Bytes of one registration chunk.
    pub fn chunk_bytes(&self) -> usize {
        self.buffers_per_chunk() * self.buffer_size
    }
}

/// Index of a receive buffer in its queue, `0..queue_depth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufferId(pub u32);

/// A connection feeding a queue; the engine picks the numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u64);

/// Buffers newly posted for one connection: tell its sender (one credit each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Whose sender gets the credits.
    pub conn: ConnId,
    /// The buffers, in posting order.
    pub buffers: Vec<BufferId>,
}

#[derive(Debug, Default)]
struct ConnState {
    /// Posted for this connection and told to its sender, oldest first.
    granted: VecDeque<BufferId>,
    /// When it was last granted to, in grants of this queue: among connections holding
    /// equally few credits, the one granted longest ago goes first, so a busy sender that
    /// drains its credits at once cannot win every tie and starve the others.
    last_grant: u64,
    /// On a shared pool, the most credits this connection is granted at once (besides its
    /// fair share): 1 at first, doubled each time its sender spends its last credit. A
    /// sender that sends now and then holds one or two buffers, not a share it leaves
    /// unused while busy senders wait; a busy one reaches its share in a few round trips.
    window: usize,
    /// The queue's arrival count at this connection's latest arrival.
    last_arrival: u64,
}

/// One receive queue: a connection's own, or the shared pool.
#[derive(Debug)]
pub struct ReceiveQueue {
    settings: ReceiveSettings,
    /// Posted buffers not yet granted to a connection, in posting order.
    free: VecDeque<BufferId>,
    /// Consumed buffers waiting for a bulk return.
    held: Vec<BufferId>,
    /// Buffers holding a message not yet consumed, and the connection it came from.
    filled: Vec<Option<ConnId>>,
    /// How many entries of `filled` are `Some`.
    filled_count: usize,
    conns: BTreeMap<ConnId, ConnState>,
    /// Grants made so far (the clock of `ConnState::last_grant`).
    grants: u64,
    /// Arrivals so far (the clock of `ConnState::last_arrival`).
    arrivals: u64,
}

impl ReceiveQueue {
    /// A queue with every buffer posted. Fails on bad settings, naming the key.
    pub fn new(settings: ReceiveSettings) -> Result<Self, ReceiveError> {
        settings.validate()?;
        Ok(ReceiveQueue {
            free: (0..settings.queue_depth as u32).map(BufferId).collect(),
            held: Vec::new(),
            filled: vec![None; settings.queue_depth],
            filled_count: 0,
            conns: BTreeMap::new(),
            grants: 0,
            arrivals: 0,
            settings,
        })
    }

    /// The settings.
    pub fn settings(&self) -> &ReceiveSettings {
        &self.settings
    }

    /// Where buffer `id` lives: (chunk index, byte offset inside the chunk).
    pub fn location(&self, id: BufferId) -> (usize, usize) {
        let per = self.settings.buffers_per_chunk();
        let i = id.0 as usize;
        (i / per, (i % per) * self.settings.buffer_size)
    }

    /// Buffers posted (free or granted).
    pub fn posted(&self) -> usize {
        self.free.len() + self.conns.values().map(|c| c.granted.len()).sum::<usize>()
    }

    /// Buffers holding unconsumed messages.
    pub fn filled(&self) -> usize {
        self.filled_count
    }

    /// Credits the sender of `conn` holds as far as the receiver has told it.
    pub fn credits_of(&self, conn: ConnId) -> usize {
        self.conns.get(&conn).map_or(0, |c| c.granted.len())
    }

    /// Adds a connection; its first credits come from [`ReceiveQueue::poll_grant`]. A queue
    /// that is not shared takes exactly one connection.
    pub fn add_connection(&mut self, conn: ConnId) -> Result<(), ReceiveError> {
        if !self.settings.shared_receive_queue && !self.conns.is_empty() {
            return Err(err(
                "shared_receive_queue",
                "is false: a per-connection queue takes one connection",
            ));
        }
        self.conns.entry(conn).or_insert_with(|| ConnState {
            window: 1,
            ..ConnState::default()
        });
        Ok(())
    }

    /// Removes a connection; the buffers granted to it are posted again for others.
    pub fn remove_connection(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            self.free.extend(c.granted);
        }
    }

    /// Fair share of a connection: all buffers, or an equal part of the shared pool.
    fn share(&self) -> usize {
        (self.settings.queue_depth / self.conns.len().max(1)).max(1)
    }

    /// Grants free buffers to a connection whose sender runs low. With `eager` (shared memory,
    /// where telling costs nothing) a connection is topped up to its share at once; otherwise
    /// only when it holds at most half its share, so one credit message covers many buffers
    /// (every time, with a queue depth of 1 or 2).
    pub fn poll_grant(&mut self, eager: bool) -> Option<Grant> {
        let mut buffers = Vec::new();
        let conn = self.poll_grant_into(eager, &mut buffers)?;
        Some(Grant { conn, buffers })
    }

    /// [`ReceiveQueue::poll_grant`] into a caller's vector (cleared first), so a receive loop
    /// that grants after every message allocates nothing. Returns the connection granted to.
    pub fn poll_grant_into(&mut self, eager: bool, buffers: &mut Vec<BufferId>) -> Option<ConnId> {
        buffers.clear();
        if self.free.is_empty() {
            return None;
        }
        let share = self.share();
        let shared = self.settings.shared_receive_queue;
        let target = |c: &ConnState| if shared { c.window.min(share) } else { share };
        let conn = self
            .conns
            .iter()
            .filter(|(_, c)| {
                let (held, target) = (c.granted.len(), target(c));
                held < target && (eager || held * 2 <= target)
            })
            .min_by_key(|(_, c)| (c.granted.len(), c.last_grant))
            .map(|(id, _)| *id)?;
        self.grants += 1;
        let state = self.conns.get_mut(&conn).expect("connection just seen");
        state.last_grant = self.grants;
        let n = (target(state) - state.granted.len()).min(self.free.len());
        buffers.extend(self.free.drain(..n));
        state.granted.extend(buffers.iter().copied());
        Some(conn)
    }

    /// A message arrived on `conn`, in buffer `named` (shared memory, where the sender picks)
    /// or in the connection's oldest granted buffer (`None`, sockets). Fails when the sender
    /// had no credit or named a buffer not granted to it: the connection is broken.
    pub fn on_arrival(
        &mut self,
        conn: ConnId,
        named: Option<BufferId>,
    ) -> Result<BufferId, ReceiveError> {
        let state = self
            .conns
            .get_mut(&conn)
            .ok_or_else(|| err("arrival", format!("unknown connection {}", conn.0)))?;
        let id = match named {
            None => state.granted.pop_front(),
            Some(id) if state.granted.front() == Some(&id) => state.granted.pop_front(),
            Some(id) => {
                let pos = state.granted.iter().position(|b| *b == id);
                pos.and_then(|p| state.granted.remove(p))
            }
        }
        .ok_or_else(|| {
            err(
                "arrival",
                format!(
                    "connection {} sent without a credit (buffer {named:?} not posted for it)",
                    conn.0
                ),
            )
        })?;
        self.spent(conn);
        let slot = self
            .filled
            .get_mut(id.0 as usize)
            .ok_or_else(|| err("arrival", format!("buffer {} outside the queue", id.0)))?;
        *slot = Some(conn);
        self.filled_count += 1;
        Ok(id)
    }

    /// A message arrived on `conn` into `landed`, a buffer the hardware took from those posted
    /// (a shared receive queue, or a queue pair's own receive queue, fills its buffers in its
    /// own order, which is not the order of the grants). Spends one of `conn`'s credits: when
    /// `landed` was granted to `conn`, that one; otherwise `conn`'s oldest granted buffer
    /// takes `landed`'s place where it was posted (free, or granted to another connection), so
    /// each posted buffer is still counted once and every sender keeps its credits. Fails
    /// when `conn` had no credit or `landed` was not posted: the connection is broken.
    pub fn on_arrival_posted(
        &mut self,
        conn: ConnId,
        landed: BufferId,
    ) -> Result<BufferId, ReceiveError> {
        let state = self
            .conns
            .get_mut(&conn)
            .ok_or_else(|| err("arrival", format!("unknown connection {}", conn.0)))?;
        let no_credit = || {
            err(
                "arrival",
                format!("connection {} sent without a credit", conn.0),
            )
        };
        if let Some(pos) = state.granted.iter().position(|b| *b == landed) {
            state.granted.remove(pos);
        } else {
            let substitute = state.granted.pop_front().ok_or_else(no_credit)?;
            let slot = match self.free.iter().position(|b| *b == landed) {
                Some(pos) => Some(&mut self.free[pos]),
                None => self
                    .conns
                    .values_mut()
                    .find_map(|c| c.granted.iter_mut().find(|b| **b == landed)),
            };
            match slot {
                Some(slot) => *slot = substitute,
                None => {
                    let state = self.conns.get_mut(&conn).expect("connection just seen");
                    state.granted.push_front(substitute);
                    return Err(err(
                        "arrival",
                        format!("buffer {} filled while not posted", landed.0),
                    ));
                }
            }
        }
        self.spent(conn);
        let slot = self
            .filled
            .get_mut(landed.0 as usize)
            .ok_or_else(|| err("arrival", format!("buffer {} outside the queue", landed.0)))?;
        *slot = Some(conn);
        self.filled_count += 1;
        Ok(landed)
    }

    /// `conn` spent a credit: its window doubles when it spent its last one, or when it is
    /// down to half its window and busy, i.e. it sent at least once in every as many
    /// arrivals as the queue has connections (its fair part of the traffic). A sender that
    /// answers promptly is regranted before it runs dry; without the second rule its window
    /// would stay at 2 and every message would cost a grant.
    fn spent(&mut self, conn: ConnId) {
        self.arrivals += 1;
        let (depth, n) = (self.settings.queue_depth, self.conns.len() as u64);
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        let busy = self.arrivals - state.last_arrival <= n.max(1);
        state.last_arrival = self.arrivals;
        if state.granted.is_empty() || (busy && state.granted.len() * 2 <= state.window) {
            state.window = (state.window * 2).min(depth);
        }
    }

    /// The message in `id` was consumed: post the buffer again now (`individual`) or once no
    /// posted buffer is left (`bulk`). Fails for a buffer holding no message.
    pub fn on_consumed(&mut self, id: BufferId) -> Result<(), ReceiveError> {
        self.consume(id, |_| {})
    }

    /// [`ReceiveQueue::on_consumed`], appending to `reposted` every buffer it posts again (none,
    /// the one consumed, or with `bulk` all of them), for a receiver that must hand them back
    /// to hardware (a receive queue) before granting them.
    pub fn on_consumed_into(
        &mut self,
        id: BufferId,
        reposted: &mut Vec<BufferId>,
    ) -> Result<(), ReceiveError> {
        self.consume(id, |b| reposted.push(b))
    }

    fn consume(
        &mut self,
        id: BufferId,
        mut reposted: impl FnMut(BufferId),
    ) -> Result<(), ReceiveError> {
        if self
            .filled
            .get_mut(id.0 as usize)
            .and_then(Option::take)
            .is_none()
        {
            return Err(err("consume", format!("buffer {} holds no message", id.0)));
        }
        match self.settings.return_policy {
            ReturnPolicy::Individual => {
                self.filled_count -= 1;
                self.free.push_back(id);
                reposted(id);
            }
            ReturnPolicy::Bulk => {
                self.filled_count -= 1;
                self.held.push(id);
                if self.posted() == 0 {
                    self.held.sort_unstable();
                    for b in self.held.drain(..) {
                        self.free.push_back(b);
                        reposted(b);
                    }
                }
            }
        }
        Ok(())
    }
}

/// A sender's side: credits received, spent one per message.
#[derive(Debug, Default, Clone)]
pub struct Credits {
    /// Buffers granted and not yet used, oldest first (shared memory names them on send).
    buffers: VecDeque<BufferId>,
}

impl Credits {
    /// Adds granted buffers.
    pub fn on_grant(&mut self, buffers: impl IntoIterator<Item = BufferId>) {
        self.buffers.extend(buffers);
    }

    /// Credits in hand.
    pub fn available(&self) -> usize {
        self.buffers.len()
    }

    /// Spends one credit, returning the buffer it stands for; `None`: wait for a grant.
    pub fn take(&mut self) -> Option<BufferId> {
        self.buffers.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn settings(n: usize) -> ReceiveSettings {
        ReceiveSettings {
            queue_depth: n,
            ..Default::default()
        }
    }

    #[test]
    fn every_bad_value_names_its_key() {
        let cases: Vec<(ReceiveSettings, &str)> = vec![
            (settings(0), "queue_depth"),
            (settings(MAX_QUEUE_DEPTH + 1), "queue_depth"),
            (
                ReceiveSettings {
                    registration_chunks: 0,
                    ..settings(32)
                },
                "registration_chunks",
            ),
            (
                ReceiveSettings {
                    registration_chunks: 3,
                    ..settings(32)
                },
                "registration_chunks",
            ),
            (
                ReceiveSettings {
                    max_sge: 0,
                    ..settings(32)
                },
                "max_sge",
            ),
            (
                ReceiveSettings {
                    max_sge: MAX_SGE + 1,
                    ..settings(32)
                },
                "max_sge",
            ),
            (
                ReceiveSettings {
                    buffer_size: 0,
                    ..settings(32)
                },
                "buffer_size",
            ),
        ];
        for (s, key) in cases {
            let e = s.validate().unwrap_err();
            assert_eq!(e.key, key, "{s:?}: {e}");
            assert!(ReceiveQueue::new(s).is_err());
        }
        assert!(ReceiveSettings {
            registration_chunks: 8,
            ..settings(32)
        }
        .validate()
        .is_ok());
    }

    #[test]
    fn chunks_split_the_pool() {
        let q = ReceiveQueue::new(ReceiveSettings {
            queue_depth: 12,
            registration_chunks: 3,
            buffer_size: 100,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(q.settings().buffers_per_chunk(), 4);
        assert_eq!(q.settings().chunk_bytes(), 400);
        assert_eq!(q.location(BufferId(0)), (0, 0));
        assert_eq!(q.location(BufferId(5)), (1, 100));
        assert_eq!(q.location(BufferId(11)), (2, 300));
    }

    #[test]
    fn buffers_cycle_in_posting_order() {
        let mut q = ReceiveQueue::new(settings(4)).unwrap();
        q.add_connection(ConnId(1)).unwrap();
        let g = q.poll_grant(false).unwrap();
        assert_eq!(g.buffers, [0, 1, 2, 3].map(BufferId));
        let mut seen = Vec::new();
        for _ in 0..12 {
            let id = q.on_arrival(ConnId(1), None).unwrap();
            seen.push(id.0);
            q.on_consumed(id).unwrap();
            while let Some(g) = q.poll_grant(true) {
                assert_eq!(g.conn, ConnId(1));
            }
        }
        assert_eq!(seen, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]);
    }

    #[test]
    fn sender_without_credit_is_refused_then_resumes() {
        let mut q = ReceiveQueue::new(settings(2)).unwrap();
        q.add_connection(ConnId(7)).unwrap();
        let mut credits = Credits::default();
        credits.on_grant(q.poll_grant(false).unwrap().buffers);
        let a = credits.take().unwrap();
        let b = credits.take().unwrap();
        assert!(credits.take().is_none(), "exhausted");
        assert_eq!(q.on_arrival(ConnId(7), Some(a)).unwrap(), a);
        assert_eq!(q.on_arrival(ConnId(7), Some(b)).unwrap(), b);
        assert_eq!(q.on_arrival(ConnId(7), None).unwrap_err().key, "arrival");
        assert!(q.poll_grant(false).is_none(), "nothing consumed yet");
        q.on_consumed(a).unwrap();
        let g = q
            .poll_grant(false)
            .expect("sender holds nothing: grant at once");
        assert_eq!(g.buffers, vec![a]);
        credits.on_grant(g.buffers);
        assert_eq!(credits.take(), Some(a));
        assert_eq!(q.on_consumed(a).unwrap_err().key, "consume");
    }

    #[test]
    fn lazy_grants_wait_for_half_the_share() {
        let mut q = ReceiveQueue::new(settings(32)).unwrap();
        q.add_connection(ConnId(1)).unwrap();
        assert_eq!(q.poll_grant(false).unwrap().buffers.len(), 32);
        for i in 0..16 {
            let id = q.on_arrival(ConnId(1), None).unwrap();
            q.on_consumed(id).unwrap();
            if i < 15 {
                assert!(q.poll_grant(false).is_none(), "after {} messages", i + 1);
            }
        }
        assert_eq!(q.poll_grant(false).unwrap().buffers.len(), 16);
        assert_eq!(q.credits_of(ConnId(1)), 32);
    }

    #[test]
    fn bulk_return_waits_for_an_empty_queue() {
        let mut q = ReceiveQueue::new(ReceiveSettings {
            return_policy: ReturnPolicy::Bulk,
            ..settings(4)
        })
        .unwrap();
        q.add_connection(ConnId(1)).unwrap();
        q.poll_grant(true).unwrap();
        for _ in 0..3 {
            let id = q.on_arrival(ConnId(1), None).unwrap();
            q.on_consumed(id).unwrap();
            assert!(q.poll_grant(true).is_none());
        }
        let last = q.on_arrival(ConnId(1), None).unwrap();
        assert_eq!(q.posted(), 0);
        q.on_consumed(last).unwrap();
        assert_eq!(q.posted(), 4, "all four back at once");
        assert_eq!(q.poll_grant(true).unwrap().buffers.len(), 4);
    }

    #[test]
    fn per_connection_queue_takes_one_connection() {
        let mut q = ReceiveQueue::new(settings(4)).unwrap();
        q.add_connection(ConnId(1)).unwrap();
        assert_eq!(
            q.add_connection(ConnId(2)).unwrap_err().key,
            "shared_receive_queue"
        );
    }

    /// Spends every credit `conn` holds (its messages consumed at once) and grants again,
    /// `rounds` times: a busy sender.
    fn busy(q: &mut ReceiveQueue, conn: ConnId, rounds: usize) {
        for _ in 0..rounds {
            while q.poll_grant(false).is_some() {}
            while q.credits_of(conn) > 0 {
                let id = q.on_arrival(conn, None).unwrap();
                q.on_consumed(id).unwrap();
            }
        }
        while q.poll_grant(false).is_some() {}
    }

    #[test]
    fn shared_pool_splits_between_connections() {
        let mut q = ReceiveQueue::new(ReceiveSettings {
            shared_receive_queue: true,
            ..settings(8)
        })
        .unwrap();
        q.add_connection(ConnId(1)).unwrap();
        q.add_connection(ConnId(2)).unwrap();
        // One credit each at first; a busy sender's grants double up to its share.
        let a = q.poll_grant(false).unwrap();
        let b = q.poll_grant(false).unwrap();
        assert_ne!(a.conn, b.conn);
        assert_eq!((a.buffers.len(), b.buffers.len()), (1, 1));
        assert!(q.poll_grant(false).is_none());
        busy(&mut q, ConnId(1), 1);
        assert_eq!(q.credits_of(ConnId(1)), 2);
        busy(&mut q, ConnId(1), 3);
        assert_eq!(q.credits_of(ConnId(1)), 4, "capped at the fair share");
        busy(&mut q, ConnId(2), 3);
        assert_eq!((q.credits_of(ConnId(1)), q.credits_of(ConnId(2))), (4, 4));
        assert!(q.poll_grant(false).is_none());
        // Alone, connection 2 may grow to the whole pool.
        q.remove_connection(ConnId(1));
        busy(&mut q, ConnId(2), 2);
        assert_eq!(q.credits_of(ConnId(2)), 8);
    }

    /// A sender that sends now and then is not granted a share it would sit on: a first
    /// connection idle after one message holds two buffers, and the rest of the pool goes to
    /// the busy senders that come later.
    #[test]
    fn an_idle_first_connection_does_not_keep_the_pool() {
        let mut q = ReceiveQueue::new(ReceiveSettings {
            shared_receive_queue: true,
            ..settings(64)
        })
        .unwrap();
        q.add_connection(ConnId(1)).unwrap();
        busy(&mut q, ConnId(1), 1);
        assert_eq!(q.credits_of(ConnId(1)), 2);
        for c in 2..=4 {
            q.add_connection(ConnId(c)).unwrap();
        }
        for c in 2..=4 {
            busy(&mut q, ConnId(c), 8);
        }
        for c in 2..=4 {
            assert_eq!(q.credits_of(ConnId(c)), 16, "connection {c}");
        }
        assert_eq!(q.credits_of(ConnId(1)), 2);
    }

    /// A busy sender on a shared pool drains its credits at once after every grant; the
    /// buffers it frees go in turn to every connection waiting with as few credits, not back
    /// to the busy one because its id is lower.
    #[test]
    fn freed_buffers_go_round_to_connections_with_equally_few_credits() {
        let mut q = ReceiveQueue::new(ReceiveSettings {
            shared_receive_queue: true,
            ..settings(2)
        })
        .unwrap();
        for c in 1..=3 {
            q.add_connection(ConnId(c)).unwrap();
        }
        // Two buffers, share 1 each: connections 1 and 2 get one; 3 waits with none while 1
        // sends at once every time it has a credit.
        let mut granted = std::collections::BTreeMap::<u64, usize>::new();
        for _ in 0..30 {
            let Some(g) = q.poll_grant(true) else { break };
            *granted.entry(g.conn.0).or_default() += g.buffers.len();
            if g.conn == ConnId(1) {
                for b in g.buffers {
                    let id = q.on_arrival(ConnId(1), Some(b)).unwrap();
                    q.on_consumed(id).unwrap();
                }
            }
        }
        assert!(granted.get(&3).is_some_and(|&n| n >= 1), "{granted:?}");
    }

    /// A ping-pong sender alone on a shared pool (one message, consumed, regranted, the next)
    /// never runs dry, yet its window grows to the pool, so grants go out in batches again.
    #[test]
    fn a_prompt_sender_alone_grows_its_window_to_the_pool() {
        let mut q = ReceiveQueue::new(ReceiveSettings {
            shared_receive_queue: true,
            ..settings(64)
        })
        .unwrap();
        q.add_connection(ConnId(1)).unwrap();
        let mut grants = 0;
        for _ in 0..200 {
            if q.poll_grant(false).is_some() {
                grants += 1;
            }
            let id = q.on_arrival(ConnId(1), None).unwrap();
            q.on_consumed(id).unwrap();
        }
        assert!(q.credits_of(ConnId(1)) >= 32, "{}", q.credits_of(ConnId(1)));
        assert!(grants < 20, "{grants} grants for 200 messages");
    }

    #[test]
    fn a_buffer_the_hardware_picked_swaps_with_a_credit() {
        let mut q = ReceiveQueue::new(ReceiveSettings {
            shared_receive_queue: true,
            ..settings(4)
        })
        .unwrap();
        q.add_connection(ConnId(1)).unwrap();
        q.add_connection(ConnId(2)).unwrap();
        // Connection 2 is busy first and holds two credits (buffers 2 and 3 after the turn).
        busy(&mut q, ConnId(2), 1);
        let g = q.poll_grant(false);
        assert!(g.is_none(), "{g:?}");
        assert_eq!((q.credits_of(ConnId(1)), q.credits_of(ConnId(2))), (1, 2));
        let theirs = q.conns[&ConnId(2)].granted[0];
        let mine = q.conns[&ConnId(1)].granted[0];
        // Connection 1 sends, and the queue hands it a buffer granted to connection 2: its own
        // credit takes that buffer's place, so connection 2 keeps two.
        assert_eq!(q.on_arrival_posted(ConnId(1), theirs), Ok(theirs));
        assert_eq!((q.credits_of(ConnId(1)), q.credits_of(ConnId(2))), (0, 2));
        assert!(q.conns[&ConnId(2)].granted.contains(&mine));
        assert_eq!(
            q.on_arrival_posted(ConnId(1), mine).unwrap_err().key,
            "arrival",
            "connection 1 has no credit left"
        );
        assert_eq!(
            q.on_arrival_posted(ConnId(2), theirs).unwrap_err().key,
            "arrival",
            "that buffer holds a message"
        );
        assert_eq!(
            q.credits_of(ConnId(2)),
            2,
            "a refused arrival spends nothing"
        );
        let mut reposted = Vec::new();
        q.on_consumed_into(theirs, &mut reposted).unwrap();
        assert_eq!(reposted, [theirs]);
        assert_eq!(q.posted(), 4);
    }

    proptest! {
        /// Hardware fills posted buffers in its own order (a receive queue is FIFO in posting
        /// order): whatever it picks, the accounting's posted buffers are exactly the
        /// hardware's, senders never send past them, and the buffers handed back are posted
        /// once each.
        #[test]
        fn accounting_follows_the_hardware(
            n in 1usize..40,
            bulk in any::<bool>(),
            shuffle in any::<bool>(),
            ops in proptest::collection::vec((0u8..4, 0u64..3, any::<u8>()), 1..400),
        ) {
            let mut q = ReceiveQueue::new(ReceiveSettings {
                queue_depth: n,
                shared_receive_queue: true,
                return_policy: if bulk { ReturnPolicy::Bulk } else { ReturnPolicy::Individual },
                ..Default::default()
            }).unwrap();
            let conns: Vec<ConnId> = (0..3).map(ConnId).collect();
            let mut credits: BTreeMap<ConnId, usize> = BTreeMap::new();
            for c in &conns {
                q.add_connection(*c).unwrap();
                credits.insert(*c, 0);
            }
            let mut hardware: VecDeque<BufferId> = (0..n as u32).map(BufferId).collect();
            let mut inbox: VecDeque<BufferId> = VecDeque::new();
            let mut reposted = Vec::new();
            for (op, who, pick) in ops {
                let c = conns[who as usize];
                match op {
                    0 => if credits[&c] > 0 {
                        *credits.get_mut(&c).unwrap() -= 1;
                        // A credit means a posted buffer is there to take.
                        prop_assert!(!hardware.is_empty());
                        let i = if shuffle { pick as usize % hardware.len() } else { 0 };
                        let landed = hardware.remove(i).unwrap();
                        prop_assert_eq!(q.on_arrival_posted(c, landed), Ok(landed));
                        inbox.push_back(landed);
                    },
                    1 => if let Some(b) = inbox.pop_front() {
                        reposted.clear();
                        q.on_consumed_into(b, &mut reposted).unwrap();
                        for r in &reposted {
                            prop_assert!(!hardware.contains(r), "buffer {} posted twice", r.0);
                            hardware.push_back(*r);
                        }
                    },
                    _ => while let Some(g) = q.poll_grant(op == 2) {
                        *credits.get_mut(&g.conn).unwrap() += g.buffers.len();
                    },
                }
                for c in &conns {
                    prop_assert_eq!(credits[c], q.credits_of(*c));
                }
                prop_assert_eq!(hardware.len(), q.posted());
                let mut posted: Vec<u32> = q.free.iter().chain(q.conns.values().flat_map(|c| c.granted.iter())).map(|b| b.0).collect();
                posted.sort_unstable();
                let mut hw: Vec<u32> = hardware.iter().map(|b| b.0).collect();
                hw.sort_unstable();
                prop_assert_eq!(posted, hw);
            }
        }

        /// Whatever the order of sends, consumes and grants: a sender never holds more credits
        /// than buffers are posted for it, no buffer is in two places, and every buffer is
        /// accounted for (free, granted, filled or held).
        #[test]
        fn never_overrun_and_nothing_lost(
            n in 1usize..40,
            shared in any::<bool>(),
            bulk in any::<bool>(),
            ops in proptest::collection::vec((0u8..4, 0u64..3), 1..400),
        ) {
            let mut q = ReceiveQueue::new(ReceiveSettings {
                queue_depth: n,
                shared_receive_queue: shared,
                return_policy: if bulk { ReturnPolicy::Bulk } else { ReturnPolicy::Individual },
                ..Default::default()
            }).unwrap();
            let conns: Vec<ConnId> = if shared { (0..3).map(ConnId).collect() } else { vec![ConnId(0)] };
            let mut credits: BTreeMap<ConnId, Credits> = BTreeMap::new();
            for c in &conns {
                q.add_connection(*c).unwrap();
                credits.insert(*c, Credits::default());
            }
            let mut inbox: VecDeque<BufferId> = VecDeque::new();
            for (op, who) in ops {
                let c = conns[who as usize % conns.len()];
                match op {
                    0 => if let Some(b) = credits.get_mut(&c).unwrap().take() {
                        let got = q.on_arrival(c, Some(b)).unwrap();
                        prop_assert_eq!(got, b);
                        inbox.push_back(got);
                    } else {
                        prop_assert!(q.on_arrival(c, None).is_err());
                    },
                    1 => if let Some(b) = inbox.pop_front() { q.on_consumed(b).unwrap(); },
                    _ => while let Some(g) = q.poll_grant(op == 2) {
                        credits.get_mut(&g.conn).unwrap().on_grant(g.buffers);
                    },
                }
                for c in &conns {
                    prop_assert_eq!(credits[c].available(), q.credits_of(*c));
                }
                let total = q.posted() + q.filled() + q.held.len();
                prop_assert_eq!(total, n);
            }
        }
    }
}
