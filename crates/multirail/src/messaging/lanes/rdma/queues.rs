//! The work requests of the rdma lane: the sender's SENDs, the receiver's credit writes, and
//! the receive buffers posted to a receive queue.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use multirail_policy::receive::{BufferId, ReceiveSettings};
use multirail_verbs::{
    CompletionQueue, MemoryRegion, QueuePair, RecvBatch, SendBatch, SendFlags, SendOp, Sge,
    SharedReceiveQueue, WorkCompletion,
};

use crate::transport::rdma::messages::{
    MessageEndpoint, MessageVerbs, SendQueuePair, CREDIT_DEPTH,
};

/// One credit write in this many is signalled (the others complete with it).
const CREDIT_SIGNAL_INTERVAL: u64 = 16;

/// The sending side of an rdma lane's queue pair: every message one `SEND_WITH_IMM`, inline
/// or from a registered staging slot, every send signalled and reaped lazily.
pub(in crate::messaging) struct QueueSender {
    /// Registered staging slots for messages above the inline size, made on first use.
    /// Declared first: the region is deregistered before the queue pair goes.
    staging: Option<(MemoryRegion, Box<[u8]>, usize)>,
    qp: SendQueuePair,
    batch: SendBatch,
    /// Sends posted, and reaped (every send is signalled; completions arrive in order).
    posted: u64,
    completed: u64,
    wcs: Vec<WorkCompletion>,
    /// The receiver is known gone: closing does not wait for sends to land.
    abandoned: bool,
}

impl QueueSender {
    /// Sends on `qp`, connected (or about to be) to the receiver.
    pub(in crate::messaging) fn new(qp: SendQueuePair) -> QueueSender {
        QueueSender {
            staging: None,
            qp,
            batch: SendBatch::new(1),
            posted: 0,
            completed: 0,
            wcs: vec![WorkCompletion::default(); 16],
            abandoned: false,
        }
    }

    /// Credits the receiver granted so far, in all.
    pub(in crate::messaging) fn granted(&self) -> u64 {
        self.qp.granted()
    }

    /// Sends `data` with `kind` in the immediate, waiting up to `timeout` for room in the
    /// send queue. Fails when the queue pair broke (the receiver is gone or unreachable) or
    /// stays full.
    pub(in crate::messaging) fn send(
        &mut self,
        kind: u8,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), String> {
        if self.posted - self.completed >= self.qp.depth() {
            self.wait_for_room(timeout)?;
        }
        let seq = self.posted;
        let mut flags = SendFlags::SIGNALED;
        let inline = data.len() as u64 <= u64::from(self.qp.inline_max());
        let sge = if inline {
            flags |= SendFlags::INLINE;
            Sge {
                addr: data.as_ptr() as u64,
                length: data.len() as u32,
                lkey: 0,
            }
        } else {
            let slot = (seq % self.qp.depth()) as usize;
            let (mr, slots, slot_len) = self.staging(data.len())?;
            let offset = slot * *slot_len;
            slots[offset..offset + data.len()].copy_from_slice(data);
            mr.sge(offset, data.len()).map_err(|e| e.to_string())?
        };
        self.batch.clear();
        self.batch
            .push(seq, SendOp::SendImm { imm: kind.into() }, flags, &[sge])
            .map_err(|e| e.to_string())?;
        // SAFETY: an inline payload is read by the CPU during the call; a staged one sits in
        // slot `seq % depth` of the registered staging area, which no later send overwrites
        // before this one's completion is reaped (at most `depth` sends are outstanding).
        unsafe { self.qp.qp().post_send(&mut self.batch) }.map_err(|e| e.to_string())?;
        self.posted += 1;
        self.qp.counters().sent.fetch_add(1, Ordering::Relaxed);
        if inline {
            self.qp.counters().inline.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The staging area, made for slots of at least `len` bytes.
    fn staging(&mut self, len: usize) -> Result<&mut (MemoryRegion, Box<[u8]>, usize), String> {
        let fits = self.staging.as_ref().is_some_and(|s| s.2 >= len);
        if !fits {
            if self.posted > self.completed {
                // Slots in use must not move: let them finish first.
                self.drain(Duration::from_secs(10))?;
            }
            self.staging = None;
            let slot_len = len.next_power_of_two().max(4096);
            let mut slots = vec![0u8; slot_len * self.qp.depth() as usize].into_boxed_slice();
            // SAFETY: the slots are heap memory owned beside the region in `staging`, which
            // drops the region first (tuple order) and never reallocates them; the device only
            // reads them, for sends this queue pair posts.
            let mr = unsafe { self.qp.register(slots.as_mut_ptr(), slots.len()) }
                .map_err(|e| format!("registering message staging: {e}"))?;
            self.staging = Some((mr, slots, slot_len));
        }
        Ok(self.staging.as_mut().expect("just made"))
    }

    /// Reaps what completed. Fails on an error completion: the queue pair is broken.
    pub(in crate::messaging) fn reap(&mut self) -> Result<(), String> {
        loop {
            let n = self
                .qp
                .cq()
                .poll(&mut self.wcs)
                .map_err(|e| e.to_string())?;
            for wc in &self.wcs[..n] {
                if !wc.is_success() {
                    return Err(format!(
                        "message send failed on {}: {}",
                        self.qp.rail(),
                        self.qp.cq().status_str(wc)
                    ));
                }
                self.completed = self.completed.max(wc.wr_id() + 1);
            }
            if n < self.wcs.len() {
                return Ok(());
            }
        }
    }

    fn wait_for_room(&mut self, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        loop {
            self.reap()?;
            if self.posted - self.completed < self.qp.depth() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "no send completed on {} within {} ms",
                    self.qp.rail(),
                    timeout.as_millis()
                ));
            }
            std::hint::spin_loop();
        }
    }

    /// The receiver is gone (its connection closed or broke): closing need not wait for the
    /// sends in flight, which cannot land.
    pub(in crate::messaging) fn abandon(&mut self) {
        self.abandoned = true;
    }

    /// Waits until every message sent has reached the receiver, up to `timeout`.
    pub(in crate::messaging) fn drain(&mut self, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        while self.completed < self.posted {
            self.reap()?;
            if start.elapsed() > timeout {
                return Err(format!(
                    "{} messages unconfirmed after {} ms",
                    self.posted - self.completed,
                    timeout.as_millis()
                ));
            }
            std::thread::yield_now();
        }
        Ok(())
    }
}

impl Drop for QueueSender {
    fn drop(&mut self) {
        if self.abandoned {
            return;
        }
        // Destroying the queue pair drops what it has not sent yet: let it finish first.
        if let Err(e) = self.drain(Duration::from_secs(2)) {
            tracing::warn!(rail = %self.qp.rail(), error = %e, "closing a message queue pair");
        }
    }
}

/// The receiver's side of credits on one message queue pair: RDMA writes of the total granted
/// into the sender's credit word.
pub(in crate::messaging) struct CreditWriter {
    qp: Arc<QueuePair>,
    cq: CompletionQueue,
    addr: u64,
    rkey: u32,
    total: u64,
    posted: u64,
    completed: u64,
    batch: SendBatch,
    wcs: Vec<WorkCompletion>,
}

impl CreditWriter {
    /// Credits for the sender of `remote`, written through `qp` (whose send completions go to
    /// `cq`). Fails when the sender named no credit word.
    pub(in crate::messaging) fn new(
        qp: Arc<QueuePair>,
        cq: CompletionQueue,
        remote: &MessageEndpoint,
    ) -> Result<CreditWriter, String> {
        if remote.credit_addr == 0 || !remote.credit_addr.is_multiple_of(8) {
            return Err(format!(
                "the sender's credit word at {:#x} is not an aligned address",
                remote.credit_addr
            ));
        }
        Ok(CreditWriter {
            qp,
            cq,
            addr: remote.credit_addr,
            rkey: remote.credit_rkey,
            total: 0,
            posted: 0,
            completed: 0,
            batch: SendBatch::new(1),
            wcs: vec![WorkCompletion::default(); 8],
        })
    }

    /// The queue pair the credits go through.
    pub(in crate::messaging) fn qp(&self) -> &Arc<QueuePair> {
        &self.qp
    }

    /// Grants `n` more credits: writes the new total to the sender. Fails when the queue pair
    /// broke (the sender is gone) or its writes stop completing.
    pub(in crate::messaging) fn grant(&mut self, n: usize) -> Result<(), String> {
        self.total += n as u64;
        if self.posted - self.completed >= u64::from(CREDIT_DEPTH) - 1 {
            let start = Instant::now();
            while self.posted - self.completed >= u64::from(CREDIT_DEPTH) - 1 {
                self.reap()?;
                if start.elapsed() > Duration::from_secs(5) {
                    return Err("credit writes stopped completing".into());
                }
                std::hint::spin_loop();
            }
        }
        let seq = self.posted;
        let mut flags = SendFlags::INLINE;
        if (seq + 1).is_multiple_of(CREDIT_SIGNAL_INTERVAL) {
            flags |= SendFlags::SIGNALED;
        }
        let word = self.total.to_le_bytes();
        let sge = Sge {
            addr: word.as_ptr() as u64,
            length: 8,
            lkey: 0,
        };
        self.batch.clear();
        self.batch
            .push(
                seq,
                SendOp::RdmaWrite {
                    remote_addr: self.addr,
                    rkey: self.rkey,
                },
                flags,
                &[sge],
            )
            .map_err(|e| e.to_string())?;
        // SAFETY: the 8 bytes are inline, read by the CPU during the call.
        unsafe { self.qp.post_send(&mut self.batch) }.map_err(|e| e.to_string())?;
        self.posted += 1;
        Ok(())
    }

    fn reap(&mut self) -> Result<(), String> {
        let n = self.cq.poll(&mut self.wcs).map_err(|e| e.to_string())?;
        for wc in &self.wcs[..n] {
            if !wc.is_success() {
                return Err(format!("credit write failed: {}", self.cq.status_str(wc)));
            }
            self.completed = self.completed.max(wc.wr_id() + 1);
        }
        Ok(())
    }
}

/// Receive buffers handed to a receive queue: a shared one or a queue pair's own.
pub(in crate::messaging) enum ReceiveTarget {
    Shared(SharedReceiveQueue),
    Own(Arc<QueuePair>),
}

/// The hardware side of a receive pool: where its buffers are posted, with the keys that
/// open them on that port.
pub(in crate::messaging) struct PostedReceives {
    pub(in crate::messaging) target: ReceiveTarget,
    /// Rail the queue is on.
    port: usize,
    lkeys: Vec<u32>,
    buffer_size: u32,
    depth: usize,
    batch: RecvBatch,
    /// Counts this queue's buffers against the rail's completion queue while it lives.
    verbs: Arc<MessageVerbs>,
}

impl PostedReceives {
    /// A queue of `settings.queue_depth` buffers on rail `port`, nothing posted yet. Fails
    /// when the rail's completion queue cannot take that many more receives.
    pub(in crate::messaging) fn new(
        verbs: &Arc<MessageVerbs>,
        target: ReceiveTarget,
        port: usize,
        lkeys: Vec<u32>,
        settings: &ReceiveSettings,
    ) -> Result<PostedReceives, String> {
        verbs.reserve(port, settings.queue_depth)?;
        Ok(PostedReceives {
            target,
            port,
            lkeys,
            buffer_size: settings.buffer_size as u32,
            depth: settings.queue_depth,
            batch: RecvBatch::with_sges(settings.queue_depth.min(64), settings.queue_depth.min(64)),
            verbs: verbs.clone(),
        })
    }

    /// Posts `buffers` (each with its address and chunk), in order, with as few calls as the
    /// batch allows.
    ///
    /// # Safety
    /// Each address must be the start of a receive buffer of `buffer_size` bytes inside the
    /// chunk named, which the engine keeps mapped and registered while this queue lives, and
    /// that nothing reads or writes until the receive's completion has been polled.
    pub(in crate::messaging) unsafe fn post(
        &mut self,
        buffers: impl IntoIterator<Item = (BufferId, u64, usize)>,
    ) -> Result<(), String> {
        let mut buffers = buffers.into_iter().peekable();
        while buffers.peek().is_some() {
            self.batch.clear();
            while self.batch.len() < self.batch.capacity() {
                let Some((id, addr, chunk)) = buffers.next() else {
                    break;
                };
                let sge = Sge {
                    addr,
                    length: self.buffer_size,
                    lkey: self.lkeys[chunk],
                };
                self.batch
                    .push(u64::from(id.0), &[sge])
                    .map_err(|e| e.to_string())?;
            }
            // SAFETY: the caller's contract covers every entry pushed above.
            let posted = unsafe {
                match &self.target {
                    ReceiveTarget::Shared(srq) => srq.post_recv(&mut self.batch),
                    ReceiveTarget::Own(qp) => qp.post_recv(&mut self.batch),
                }
            };
            posted.map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

impl Drop for PostedReceives {
    fn drop(&mut self) {
        self.verbs.unreserve(self.port, self.depth);
    }
}
