//! One reliable-connected queue pair of an initiator, and the slices it carries.
//!
//! Slices go out as RDMA_WRITE or RDMA_READ work requests, staged and then chained into one
//! `ibv_post_send` per queue pair per round of dealing (one doorbell). Only every
//! `signal_interval`-th request, and the last of each chain, asks for a completion: a
//! queue pair completes its requests in order, so a signalled completion also completes every
//! request posted before it. The last of a chain is always signalled because a request after
//! it may never come, and an unsignalled request completes only with a later signalled one.
//!
//! The queue pair keeps what it carries, in posting order, until its completion: a slice is
//! done (its bytes in place at the target) only when a completion at or after it was reaped.
//! A completion with an error status means the queue pair entered the error state: every
//! request on it is lost (they complete later with flush errors, which are ignored), so every
//! slice it holds is handed back at once for the dispatcher to retry elsewhere, and the queue
//! pair is replaced.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use multirail_verbs::{QueuePair, SendBatch, SendFlags, SendOp, Sge, WorkCompletion};

use super::devices::{Port, Registration};
use crate::error::Error;
use crate::transport::driver::OutSlice;
use crate::transport::Opcode;

/// The keys a slice bound for RDMA presents: its local memory's registration (its lkey on
/// every port, alive while the slice is) and the target buffer's remote key on each of its
/// RDMA rails.
#[derive(Clone)]
pub(crate) struct RdmaKeys {
    pub registration: Arc<Registration>,
    pub rkeys: Arc<[u32]>,
}

/// One slice bound for RDMA: where its bytes are on both sides and the keys that open them.
pub(crate) type RdmaSlice = OutSlice<RdmaKeys>;

/// A slice posted on a queue pair.
struct InFlight {
    seq: u64,
    slice: RdmaSlice,
    posted: Instant,
}

/// Counts the transport reports: how well posting batches and how many completions it takes.
#[derive(Default)]
pub(crate) struct PostCounters {
    /// `ibv_post_send` calls that carried slices.
    pub post_calls: AtomicU64,
    /// Slice work requests posted.
    pub work_requests: AtomicU64,
    /// Signalled completions reaped (successful ones).
    pub signalled: AtomicU64,
    /// Slices completed.
    pub slices: AtomicU64,
    /// Queue pairs lost to an error completion.
    pub qp_errors: AtomicU64,
}

struct State {
    batch: SendBatch,
    staged: Vec<InFlight>,
    outstanding: VecDeque<InFlight>,
    next_seq: u64,
    /// Requests posted since the last signalled one.
    since_signal: u32,
}

/// What became of the slices of a completion.
pub(super) enum Reaped {
    /// Completed: each with when it was posted.
    Done(Vec<(RdmaSlice, Instant)>),
    /// The queue pair failed: every slice it held, and why.
    Lost(Vec<RdmaSlice>, Error),
    /// Nothing of ours (a flush after a failure, or a stale queue pair's).
    Nothing,
}

/// A queue pair of one path of one peer.
pub(crate) struct RcQp {
    pub qp: QueuePair,
    pub port: Arc<Port>,
    /// The target's queue pair number, to abandon it when this one is replaced.
    pub remote_qp_num: u32,
    max_outstanding: usize,
    signal_interval: u32,
    dead: AtomicBool,
    state: Mutex<State>,
}

impl RcQp {
    pub(super) fn new(
        qp: QueuePair,
        port: Arc<Port>,
        remote_qp_num: u32,
        signal_interval: u32,
    ) -> RcQp {
        let max_outstanding = qp.caps().max_send_wr as usize;
        RcQp {
            qp,
            port,
            remote_qp_num,
            max_outstanding,
            signal_interval: signal_interval.max(1),
            dead: AtomicBool::new(false),
            state: Mutex::new(State {
                batch: SendBatch::new(max_outstanding),
                staged: Vec::new(),
                outstanding: VecDeque::with_capacity(max_outstanding),
                next_seq: 1,
                since_signal: 0,
            }),
        }
    }

    /// True once the queue pair failed.
    pub(super) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Queues `slice` for the next `flush`, addressed to the target rail whose remote key is
    /// `rkey`. Hands it back when the queue pair is dead or its send queue is full.
    // The refused slice comes back by value, as the tcp transport's connections hand theirs
    // back: boxing it would allocate on every refusal.
    #[allow(clippy::result_large_err)]
    pub(super) fn stage(&self, slice: RdmaSlice, rkey: u32) -> Result<(), RdmaSlice> {
        if self.is_dead() {
            return Err(slice);
        }
        let mut st = self.state.lock().expect("queue pair poisoned");
        if st.outstanding.len() + st.staged.len() >= self.max_outstanding {
            return Err(slice);
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        st.since_signal += 1;
        let flags = if st.since_signal >= self.signal_interval {
            st.since_signal = 0;
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        };
        let sge = Sge {
            addr: slice.local as u64,
            length: slice.len,
            lkey: slice.key.registration.lkey(self.port.index),
        };
        let op = match slice.op {
            Opcode::Write => SendOp::RdmaWrite {
                remote_addr: slice.remote,
                rkey,
            },
            Opcode::Read => SendOp::RdmaRead {
                remote_addr: slice.remote,
                rkey,
            },
        };
        if st.batch.push(seq, op, flags, &[sge]).is_err() {
            // The batch holds `max_outstanding` requests and the check above keeps it below.
            st.next_seq -= 1;
            return Err(slice);
        }
        st.staged.push(InFlight {
            seq,
            slice,
            posted: Instant::now(),
        });
        Ok(())
    }

    /// Posts what `stage` queued in one `ibv_post_send`. Returns the slices the queue pair
    /// refused (all of them when it is not in a state to send), with why.
    pub(super) fn flush(&self, counters: &PostCounters) -> Option<(Vec<RdmaSlice>, Error)> {
        let mut st = self.state.lock().expect("queue pair poisoned");
        if st.staged.is_empty() {
            return None;
        }
        st.batch.signal_last();
        st.since_signal = 0;
        let n = st.staged.len();
        let State {
            batch,
            staged,
            outstanding,
            ..
        } = &mut *st;
        // SAFETY: every entry names a range of one registered region (the engine checked the
        // request lies inside it) under that region's lkey on this port, and the slice holding
        // the registration's `Arc` stays in `outstanding` until a completion at or after its
        // request is reaped or the queue pair is dead (then no request of it runs any more):
        // the memory stays registered for the request's life. READ targets are local buffers
        // the engine never reads through references; the caller learns of the bytes only from
        // the completion.
        let posted = unsafe { self.qp.post_send(batch) };
        batch.clear();
        let now = Instant::now();
        let (ok, refused) = match posted {
            Ok(()) => (n, None),
            Err(e) => (e.index_of_bad_wr.min(n), Some(e)),
        };
        let mut rest = staged.split_off(ok);
        for mut f in staged.drain(..) {
            f.posted = now;
            outstanding.push_back(f);
        }
        if ok > 0 {
            counters.post_calls.fetch_add(1, Ordering::Relaxed);
            counters
                .work_requests
                .fetch_add(ok as u64, Ordering::Relaxed);
        }
        let e = refused?;
        // A queue pair that refuses a well-formed request is no longer in RTS.
        self.dead.store(true, Ordering::Release);
        Some((
            rest.drain(..).map(|f| f.slice).collect(),
            Error::PeerDisconnected {
                peer: String::new(),
                reason: format!("{e}"),
            },
        ))
    }

    /// Takes what completion `wc` finishes.
    pub(super) fn reap(&self, wc: &WorkCompletion, counters: &PostCounters) -> Reaped {
        let mut st = self.state.lock().expect("queue pair poisoned");
        if !wc.is_success() {
            if self.dead.swap(true, Ordering::AcqRel) && st.outstanding.is_empty() {
                return Reaped::Nothing;
            }
            counters.qp_errors.fetch_add(1, Ordering::Relaxed);
            let status = self.port.context.verbs().wc_status_str(wc.status());
            let lost: Vec<RdmaSlice> = st.outstanding.drain(..).map(|f| f.slice).collect();
            let reason = format!(
                "queue pair {} on {} failed: {status} (status {}, vendor error {:#x})",
                self.qp.qp_num(),
                self.port.descriptor.name(),
                wc.status().0,
                wc.vendor_err()
            );
            let err = if wc.status() == multirail_verbs::WcStatus::REM_ACCESS_ERR {
                Error::RemoteRejected {
                    peer: String::new(),
                    reason: format!(
                        "{reason}: the target buffer was unregistered or its key is stale"
                    ),
                }
            } else {
                Error::PeerDisconnected {
                    peer: String::new(),
                    reason,
                }
            };
            return Reaped::Lost(lost, err);
        }
        let upto = wc.wr_id();
        if st.outstanding.front().is_none_or(|f| f.seq > upto) {
            return Reaped::Nothing;
        }
        counters.signalled.fetch_add(1, Ordering::Relaxed);
        let mut done = Vec::new();
        while st.outstanding.front().is_some_and(|f| f.seq <= upto) {
            let f = st.outstanding.pop_front().expect("front exists");
            done.push((f.slice, f.posted));
        }
        counters
            .slices
            .fetch_add(done.len() as u64, Ordering::Relaxed);
        Reaped::Done(done)
    }

    /// Marks the queue pair dead and takes every slice it holds (the path is being dropped).
    /// The queue pair is moved to the error state so nothing of it runs any more.
    pub(super) fn kill(&self) -> Vec<RdmaSlice> {
        self.dead.store(true, Ordering::Release);
        let _ = self.qp.to_error();
        let mut st = self.state.lock().expect("queue pair poisoned");
        let mut out: Vec<RdmaSlice> = st.outstanding.drain(..).map(|f| f.slice).collect();
        out.extend(st.staged.drain(..).map(|f| f.slice));
        st.batch.clear();
        out
    }

    /// Slices posted and not yet completed.
    pub(super) fn outstanding(&self) -> usize {
        self.state
            .lock()
            .expect("queue pair poisoned")
            .outstanding
            .len()
    }
}
