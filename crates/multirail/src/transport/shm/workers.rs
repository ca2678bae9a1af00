//! The copy workers: the shared priority queue of copy jobs, and the threads that take jobs
//! from it (HIGH first, bulk in steps that yield to waiting HIGH work).

use super::*;

/// One contiguous run of whole slices of a request, copied by one worker in one go.
pub(super) struct CopyJob {
    pub(super) op: Opcode,
    pub(super) local: usize,
    pub(super) remote: u64,
    pub(super) len: usize,
    pub(super) slices: u64,
    pub(super) reach: Reach,
    /// The buffer's access entry, held for each copy into it; `None` for a buffer published without
    /// one.
    pub(super) access: Option<Access>,
    /// Id of the request's batch, which a thread waiting for it may copy itself.
    pub(super) batch: u64,
    pub(super) task: Arc<Task>,
    /// Small requests of the same post and priority, into the same buffer, copied after this
    /// one, each whole, by the same thread (see [`SMALL_GROUP_BYTES`]): one hand-off for the
    /// group instead of one per request. Empty for every other job.
    pub(super) then: Vec<Member>,
}

/// A small request grouped behind a [`CopyJob`]: copied through the head's reach and under
/// the head's access entry, which it shares, so that a worker running a group touches one
/// entry and one set of reference counts for all of it, not a set each request the poster
/// cloned and the worker drops on another core.
pub(super) struct Member {
    pub(super) op: Opcode,
    pub(super) local: usize,
    pub(super) remote: u64,
    pub(super) len: usize,
    pub(super) slices: u64,
    pub(super) task: Arc<Task>,
}

impl From<CopyJob> for Member {
    /// The member `job` (whole, heading no group) becomes behind a head it shares its buffer
    /// with ([`CopyJob::shares_buffer_with`]): its own reach and access go, the head's serve.
    fn from(job: CopyJob) -> Member {
        debug_assert!(job.then.is_empty(), "a group's head is no member");
        Member {
            op: job.op,
            local: job.local,
            remote: job.remote,
            len: job.len,
            slices: job.slices,
            task: job.task,
        }
    }
}

/// What the copy workers share, under [`Shared::state`].
pub(super) struct QueueState {
    /// Jobs waiting, drained HIGH → MEDIUM → LOW with promotion.
    pub(super) jobs: PriorityQueues<CopyJob>,
    /// Depths last reported to the engine-wide QoS counters.
    pub(super) reported: [usize; LEVELS],
    /// Workers waiting on [`Shared::ready`] that no poster has woken yet: a poster notifies
    /// only as many as it has jobs for, and takes them off this count, since a notify is a
    /// system call even when nobody sleeps.
    pub(super) idle: usize,
    /// Workers a poster took off `idle` and notified that have not yet returned from waiting.
    /// A worker returning from its wait takes one off here if any, else off `idle` (it woke by
    /// itself); `idle + woken` is always the number of workers inside the wait.
    pub(super) woken: usize,
    /// Workers running; when the last one exits (only by panicking before `stopped`), nothing
    /// would serve the queue, so jobs are refused.
    pub(super) alive: usize,
    /// Set when the transport drops: workers finish the queued jobs, then exit.
    pub(super) stopped: bool,
}

/// The queue and what workers need beside it.
pub(super) struct Shared {
    pub(super) state: Mutex<QueueState>,
    /// Signalled when jobs are queued or the transport stops.
    pub(super) ready: Condvar,
    /// Jobs queued per level, as of the last change: lets a worker copying bulk see, between
    /// steps and without the lock, that higher work waits, and one that found the queue empty
    /// watch for new jobs a little while before it sleeps.
    pub(super) depths: [AtomicUsize; LEVELS],
    /// Origin of the nanosecond clock the queues run on.
    pub(super) epoch: Instant,
    pub(super) qos: Arc<Qos>,
    pub(super) rail: Arc<RailCounters>,
    /// `transports.shm.nontemporal_copies`: copies stream past the caches.
    pub(super) nontemporal: bool,
}

impl CopyJob {
    /// Whether `self` reaches the same buffer the same way as `head` (the same mapping of it,
    /// or the same process) under the same access entry, or neither has one: it may then be
    /// copied as a [`Member`] of `head`'s group.
    pub(super) fn shares_buffer_with(&self, head: &CopyJob) -> bool {
        let same_access = match (&self.access, &head.access) {
            (None, None) => true,
            (Some(a), Some(b)) => a.same_entry(b),
            _ => false,
        };
        same_access && self.reach.same_as(&head.reach)
    }

    /// Drops the first `n` bytes (already copied) from the job.
    pub(super) fn advance(&mut self, n: usize) {
        self.local += n;
        self.remote += n as u64;
        self.len -= n;
    }

    /// Fails the job and every request grouped behind it with `err()`, as one that no thread
    /// will run.
    pub(super) fn fail(self, rail: &RailCounters, err: impl Fn() -> Error) {
        let tasks = std::iter::once(self.task).chain(self.then.into_iter().map(|m| m.task));
        for task in tasks {
            rail.record_error();
            task.part_done(Err(err()));
        }
    }
}

impl Shared {
    /// Jobs queued in all (lock-free; as of the last queue change).
    pub(super) fn queued(&self) -> usize {
        self.depths.iter().map(|d| d.load(Ordering::Relaxed)).sum()
    }

    /// Whether a job of a level above `level` waits (lock-free; as of the last queue change).
    pub(super) fn higher_waiting(&self, level: Priority) -> bool {
        self.depths[..level.index()]
            .iter()
            .any(|d| d.load(Ordering::Relaxed) > 0)
    }

    /// The queue state; panics if a worker panicked while holding it.
    pub(super) fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().expect("shm queue poisoned")
    }

    /// Promotes the jobs that have starved, then takes the head of the highest non-empty level
    /// when `wanted` accepts it, with its level, and reports the new depths. The caller counts
    /// it dequeued (`qos.host_dequeued`) once it has let go of the lock.
    pub(super) fn take_head(
        &self,
        st: &mut QueueState,
        now_ns: u64,
        wanted: impl Fn(&CopyJob) -> bool,
    ) -> Option<(multirail_policy::qos::Dequeued<CopyJob>, Priority)> {
        let promoted = st.jobs.on_timeout(now_ns);
        if promoted > 0 {
            self.qos.promoted(promoted);
        }
        let priority = match st.jobs.front(|_| true) {
            Some((job, priority)) if wanted(job) => priority,
            _ => return None,
        };
        let taken = st.jobs.pop(priority, now_ns).expect("the head exists");
        self.report_depths(st);
        Some((taken, priority))
    }

    /// `now` as nanoseconds on the queues' clock.
    pub(super) fn ns(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Brings [`Shared::depths`] and the engine-wide queue depths up to date with these queues;
    /// called after every change to them.
    pub(super) fn report_depths(&self, st: &mut QueueState) {
        let now = st.jobs.depths();
        for (d, n) in self.depths.iter().zip(now) {
            d.store(n, Ordering::Relaxed);
        }
        if now != st.reported {
            self.qos.host_depths_changed(st.reported, now);
            st.reported = now;
        }
    }

    /// Copies the small requests grouped behind `head` (its `then`, each whole, in order;
    /// `head` itself is done), through its reach and under one hold of its access entry,
    /// completing each member's part and counting their bytes on the rail once. Between
    /// members it gives the rest back to the head of level `prio`, keeping `queued_ns` as its
    /// queueing time, when work of a higher level waits, as a bulk copy yields between steps.
    /// When the buffer's entry is revoked every member fails with that error.
    pub(super) fn run_group(&self, mut head: CopyJob, prio: Priority, queued_ns: u64) {
        let rest = std::mem::take(&mut head.then);
        if rest.is_empty() {
            return;
        }
        let mut finished = Finished::default();
        let held = match head.access.as_ref().map(Access::hold).transpose() {
            Ok(held) => held,
            Err(e) => {
                for m in rest {
                    self.rail.record_error();
                    finished.part_done(&m.task, Err(e.clone()));
                }
                return;
            }
        };
        let (mut bytes, mut slices) = (0u64, 0u64);
        let mut rest = rest.into_iter();
        while let Some(m) = rest.next() {
            if self.higher_waiting(prio) {
                drop(held);
                self.rail.record_at(prio, bytes, slices);
                finished.flush();
                // The next member heads the rest, through the same reach and access.
                let next = CopyJob {
                    op: m.op,
                    local: m.local,
                    remote: m.remote,
                    len: m.len,
                    slices: m.slices,
                    task: m.task,
                    then: rest.collect(),
                    ..head
                };
                let now_ns = self.ns(Instant::now());
                let mut st = self.lock();
                st.jobs.push_front(next, prio, queued_ns, now_ns);
                self.report_depths(&mut st);
                return;
            }
            let outcome = copy_held(
                &head.reach,
                m.op,
                m.local,
                m.remote,
                m.len,
                self.nontemporal,
            );
            match &outcome {
                Ok(()) => {
                    bytes += m.len as u64;
                    slices += m.slices;
                }
                Err(_) => self.rail.record_error(),
            }
            finished.part_done(&m.task, outcome);
        }
        drop(held);
        self.rail.record_at(prio, bytes, slices);
    }

    /// Tells the workers to finish what is queued and exit.
    pub(super) fn stop(&self) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.stopped = true;
        drop(st);
        self.ready.notify_all();
    }
}

/// The error of a job no worker will run.
pub(super) fn stopped_error() -> Error {
    Error::TransportUnavailable {
        transport: "shm",
        reason: "copy workers have stopped".into(),
    }
}

/// Counts a worker out when it exits, even by panicking; the last one out fails what is still
/// queued, since no thread would ever run it.
pub(super) struct Exit<'a>(&'a Shared);

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        let shared = self.0;
        let mut st = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.alive -= 1;
        if st.alive > 0 || st.jobs.is_empty() {
            return;
        }
        let left = st.jobs.drain_all();
        shared.report_depths(&mut st);
        drop(st);
        for (job, _) in left {
            job.fail(&shared.rail, stopped_error);
        }
    }
}

/// One copy worker: takes the head of the highest non-empty level (after promoting what has
/// starved), copies it with no lock held and reports it; sleeps while nothing is queued.
/// Returns once the transport has stopped and the queue is empty.
pub(super) fn copy_worker(shared: &Shared) {
    let _exit = Exit(shared);
    let mut st = shared.lock();
    // Whether the worker has watched for new jobs since it last found the queue empty.
    let mut watched = false;
    loop {
        let now = Instant::now();
        let now_ns = shared.ns(now);
        if let Some((taken, prio)) = shared.take_head(&mut st, now_ns, |_| true) {
            drop(st);
            shared.qos.host_dequeued(prio, taken.waited_ns, now);
            let mut job = taken.item;
            // HIGH copies whole; bulk in steps, yielding to higher work between them.
            let step = if prio == HIGH { job.len } else { PREEMPT_STEP };
            let mut copied = 0;
            let outcome = loop {
                let n = step.min(job.len - copied);
                if let Err(e) = run(&job, copied, n, shared.nontemporal) {
                    break Some(Err(e));
                }
                copied += n;
                if copied == job.len {
                    break Some(Ok(()));
                }
                if shared.higher_waiting(prio) {
                    break None;
                }
            };
            match &outcome {
                // At the level it left the queues at, as tcp counts its slices.
                Some(Ok(())) | None => {
                    shared.rail.record_at(prio, copied as u64, job.slices);
                }
                Some(Err(_)) => shared.rail.record_error(),
            }
            st = match outcome {
                Some(outcome) => {
                    job.task.part_done(outcome);
                    let queued_ns = shared.ns(now).saturating_sub(taken.waited_ns);
                    // Copies the members grouped behind it, if any, and drops the job (its
                    // task and mapping references) before the lock is taken again.
                    shared.run_group(job, prio, queued_ns);
                    shared.lock()
                }
                None => {
                    // The rest goes back to the head of its level, keeping its queueing
                    // time, and the loop takes the higher work first.
                    job.advance(copied);
                    job.slices = 0;
                    let now_ns = shared.ns(Instant::now());
                    let queued_ns = shared.ns(now).saturating_sub(taken.waited_ns);
                    let mut st = shared.lock();
                    st.jobs.push_front(job, prio, queued_ns, now_ns);
                    shared.report_depths(&mut st);
                    st
                }
            };
            watched = false;
            continue;
        }
        if st.stopped {
            return;
        }
        if !watched {
            // A submitter that waits for its batch posts the next one a few µs after the
            // last job completes: watching briefly (spinning, then yielding, as the crossbeam
            // channel this queue replaced did) picks it up without the sleep and wake-up a
            // condvar costs, which show at small requests (64 KiB: about 5 % here).
            watched = true;
            drop(st);
            let backoff = crossbeam::utils::Backoff::new();
            while !backoff.is_completed() && shared.queued() == 0 {
                backoff.snooze();
            }
            st = shared.lock();
            continue;
        }
        st.idle += 1;
        // While work below HIGH waits, wake for the promotion check. (Workers serve every
        // level, so today an idle worker finds the queue empty and this is `None`.)
        st = match st.jobs.poll_timeout() {
            Some(due_ns) => {
                let wait = Duration::from_nanos(due_ns.saturating_sub(now_ns).max(1_000));
                shared
                    .ready
                    .wait_timeout(st, wait)
                    .expect("shm queue poisoned")
                    .0
            }
            None => shared.ready.wait(st).expect("shm queue poisoned"),
        };
        if st.woken > 0 {
            st.woken -= 1;
        } else {
            st.idle -= 1;
        }
    }
}
