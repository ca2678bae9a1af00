//! The `shm` transport: same-host transfers by plain copies. A target inside a buffer the peer
//! allocated is reached through this process's mapping of the peer's memfd, so the peer does no
//! work. Other registered memory of the peer is reached with process_vm_readv/writev.
//!
//! Copies run on a pool of worker threads that share one set of priority queues
//! (multirail-policy's [`PriorityQueues`], with the engine's promotion settings): a worker
//! always takes the oldest HIGH job, MEDIUM only when no HIGH waits and LOW only when neither
//! does; a MEDIUM or LOW job starved longer than `priority_promotion_timeout_us` moves up a
//! level (checked every `priority_promotion_check_us`, whenever a worker takes a job).
//!
//! A request is cut into contiguous runs of whole slices (see [`job_spans`]): at least one per
//! worker, since a copy gains nothing from finer pieces and each piece costs a hand-off, and
//! none longer than [`MAX_JOB_BYTES`] unless a single slice is; a run longer than that (one
//! large slice: a 1 GiB write is 32 slices of 32 MiB) is copied in equal pieces of at most
//! [`MAX_JOB_BYTES`] ("jobs", see [`job_pieces`]). Slices matter to rails, not to a copy, so a
//! HIGH job waits for at most one 1 MiB job per worker rather than for whole bulk requests.
//!
//! Queue depths, waits and promotions are reported to the engine's QoS state, so its
//! statistics and its "is bulk moving" test see shm work; the queues count jobs, not slices.
//! They are kept apart from network traffic's: shm work reserves no rail and holds back no
//! network bulk. No lock is held during a copy. A worker that finds the queue empty watches it briefly
//! before sleeping on a condvar, and a poster wakes only as many sleeping workers as it queued
//! jobs.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use multirail_policy::qos::{PriorityQueues, HIGH, LEVELS};
use multirail_policy::slicing::{SlicePlan, Slices};

use crate::batch::Task;
use crate::error::{Error, Result};
use crate::memory::PeerMapping;
use crate::peer::Peer;
use crate::qos::Qos;
use crate::segment::BufferDescriptor;
use crate::stats::{RailCounters, TrafficStats};
use crate::transport::{Opcode, Prepared, Transport};

/// Largest job a request is cut into unless one slice is larger, bytes.
///
/// A worker copies a job whole, so a HIGH job that arrives while every worker is busy waits for
/// at most one job per worker to finish. A 1 MiB copy takes about 100-200 µs (5-10 GB/s per
/// core), which bounds that wait; the hand-off a job costs (a lock, maybe a wake-up) is a few
/// µs, so 1 MiB jobs keep it to a few percent of the copy. Larger jobs would let a HIGH request
/// wait milliseconds behind bulk, as whole requests did; much smaller ones would spend a
/// noticeable share of a bulk copy on hand-offs.
pub(crate) const MAX_JOB_BYTES: u64 = 1 << 20;

/// A worker copies a MEDIUM or LOW job in steps of this many bytes and, between steps, gives
/// the rest of the job back to the head of its level when work of a higher level waits: a
/// HIGH job then waits for at most one step (about 15-25 µs) instead of a whole 1 MiB job. A
/// step costs one relaxed load, and nothing else while no higher work waits.
pub(crate) const PREEMPT_STEP: usize = 128 << 10;

/// How a worker reaches the peer's bytes.
#[derive(Clone)]
enum Reach {
    /// Same process: the remote address is ours.
    Direct,
    /// Through our mapping of the peer's memfd; `base` corresponds to the buffer's start.
    Mapped {
        mapping: Arc<PeerMapping>,
        buffer_addr: u64,
    },
    /// With process_vm_readv/writev into process `pid`.
    ProcessVm { pid: i32 },
}

/// One contiguous run of whole slices of a request, copied by one worker in one go.
struct CopyJob {
    op: Opcode,
    local: usize,
    remote: u64,
    len: usize,
    slices: u64,
    reach: Reach,
    task: Arc<Task>,
}

/// Where one job lies in its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct JobSpan {
    /// Offset of the job's first byte from the start of the request.
    offset: u64,
    /// Bytes in the job; never 0.
    len: u64,
    /// Slices that start in the job, for the rail's slice count: at least 1 for a run of
    /// whole slices; 0 for every piece but the first of a run cut by [`job_pieces`].
    slices: u64,
}

/// The jobs of one request, in order of offset; see [`job_spans`].
#[derive(Debug, Clone)]
struct JobSpans {
    /// Slices in the request.
    count: u64,
    /// Size of every slice but the last.
    slice_size: u64,
    /// Bytes in the request.
    length: u64,
    /// Jobs in all.
    jobs: u64,
    /// Index of the next job to yield.
    next: u64,
}

/// Cuts the request sliced as `slices` into jobs: contiguous runs of whole slices, as evenly
/// sized as whole slices allow, at least `min(slices, workers)` of them (so every worker can
/// help with one request) and no more than needed to keep each job at most `max_job` bytes,
/// which only a job of a single slice larger than that exceeds. Together the jobs cover every
/// byte of the request exactly once and none is empty. Pure arithmetic: allocates nothing.
fn job_spans(slices: &Slices, workers: usize, max_job: u64) -> JobSpans {
    let count = slices.len() as u64;
    let slice_size = slices.slice_size().max(1);
    // Every slice but the last is `slice_size` long (the slicing module's contract); the last
    // may be up to 1.25 times that, or shorter.
    let last = slices.clone().nth(slices.len().saturating_sub(1));
    let (last_offset, last_len) = last.map_or((0, 0), |s| (s.offset, s.length));
    let length = last_offset + last_len;
    let jobs = if count == 0 {
        0
    } else {
        // Whole slices of full size that fit in one job, and slices that fit in the job that
        // ends with the last slice.
        let per_job = (max_job / slice_size).max(1);
        let per_last_job = if last_len > max_job {
            1
        } else {
            1 + (max_job - last_len) / slice_size
        };
        // Job `j` holds slices `j * count / jobs ..(j + 1) * count / jobs`: none holds more than
        // ceil(count / jobs), and the last holds exactly that many.
        (count.min(workers.max(1) as u64))
            .max(count.div_ceil(per_job))
            .max(count.div_ceil(per_last_job))
    };
    JobSpans {
        count,
        slice_size,
        length,
        jobs,
        next: 0,
    }
}

impl Iterator for JobSpans {
    type Item = JobSpan;

    fn next(&mut self) -> Option<JobSpan> {
        if self.next >= self.jobs {
            return None;
        }
        let j = self.next;
        self.next += 1;
        let first = j * self.count / self.jobs;
        let end = (j + 1) * self.count / self.jobs;
        let offset = first * self.slice_size;
        let end_offset = if end == self.count {
            self.length
        } else {
            end * self.slice_size
        };
        Some(JobSpan {
            offset,
            len: end_offset - offset,
            slices: end - first,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = (self.jobs - self.next) as usize;
        (n, Some(n))
    }
}

impl ExactSizeIterator for JobSpans {}

/// Cuts every run of `runs` longer than `max_job` into equal contiguous pieces of at most
/// `max_job` bytes (the first carries the run's slice count), leaving shorter runs whole.
/// Returns the number of jobs and the jobs, which cover the same bytes as the runs, in order.
/// Pure arithmetic: allocates nothing.
fn job_pieces(runs: JobSpans, max_job: u64) -> (usize, impl Iterator<Item = JobSpan>) {
    let max_job = max_job.max(1);
    let count = runs.clone().map(|r| r.len.div_ceil(max_job)).sum::<u64>() as usize;
    let jobs = runs.flat_map(move |run| {
        let n = run.len.div_ceil(max_job);
        (0..n).map(move |k| {
            let start = run.len * k / n;
            let end = run.len * (k + 1) / n;
            JobSpan {
                offset: run.offset + start,
                len: end - start,
                slices: if k == 0 { run.slices } else { 0 },
            }
        })
    });
    (count, jobs)
}

/// What the copy workers share, under [`Shared::state`].
struct QueueState {
    /// Jobs waiting, drained HIGH → MEDIUM → LOW with promotion.
    jobs: PriorityQueues<CopyJob>,
    /// Depths last reported to the engine-wide QoS counters.
    reported: [usize; LEVELS],
    /// Workers waiting on [`Shared::ready`] that no poster has woken yet: a poster notifies
    /// only as many as it has jobs for, and takes them off this count, since a notify is a
    /// system call even when nobody sleeps.
    idle: usize,
    /// Workers a poster took off `idle` and notified that have not yet returned from waiting.
    /// A worker returning from its wait takes one off here if any, else off `idle` (it woke by
    /// itself); `idle + woken` is always the number of workers inside the wait.
    woken: usize,
    /// Workers running; when the last one exits (only by panicking before `stopped`), nothing
    /// would serve the queue, so jobs are refused.
    alive: usize,
    /// Set when the transport drops: workers finish the queued jobs, then exit.
    stopped: bool,
}

/// The queue and what workers need beside it.
struct Shared {
    state: Mutex<QueueState>,
    /// Signalled when jobs are queued or the transport stops.
    ready: Condvar,
    /// Jobs queued per level, as of the last change: lets a worker copying bulk see, between
    /// steps and without the lock, that higher work waits, and one that found the queue empty
    /// watch for new jobs a little while before it sleeps.
    depths: [AtomicUsize; LEVELS],
    /// Origin of the nanosecond clock the queues run on.
    epoch: Instant,
    qos: Arc<Qos>,
    rail: Arc<RailCounters>,
}

impl CopyJob {
    /// Drops the first `n` bytes (already copied) from the job.
    fn advance(&mut self, n: usize) {
        self.local += n;
        self.remote += n as u64;
        self.len -= n;
    }
}

impl Shared {
    /// Jobs queued in all (lock-free; as of the last queue change).
    fn queued(&self) -> usize {
        self.depths.iter().map(|d| d.load(Ordering::Relaxed)).sum()
    }

    /// Whether a job of a level above `level` waits (lock-free; as of the last queue change).
    fn higher_waiting(&self, level: u8) -> bool {
        self.depths[..level as usize]
            .iter()
            .any(|d| d.load(Ordering::Relaxed) > 0)
    }

    /// The queue state; panics if a worker panicked while holding it.
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().expect("shm queue poisoned")
    }

    /// `now` as nanoseconds on the queues' clock.
    fn ns(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Brings [`Shared::depths`] and the engine-wide queue depths up to date with these queues;
    /// called after every change to them.
    fn report_depths(&self, st: &mut QueueState) {
        let now = st.jobs.depths();
        for (d, n) in self.depths.iter().zip(now) {
            d.store(n, Ordering::Relaxed);
        }
        if now != st.reported {
            self.qos.host_depths_changed(st.reported, now);
            st.reported = now;
        }
    }

    /// Tells the workers to finish what is queued and exit.
    fn stop(&self) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.stopped = true;
        drop(st);
        self.ready.notify_all();
    }
}

/// The error of a job no worker will run.
fn stopped_error() -> Error {
    Error::TransportUnavailable {
        transport: "shm",
        reason: "copy workers have stopped".into(),
    }
}

/// The shared-memory transport and its copy workers.
pub(crate) struct ShmTransport {
    shared: Arc<Shared>,
    workers: usize,
    /// `transports.shm.process_vm`: reach registered memory of same-host peers with
    /// process_vm_readv/writev.
    process_vm: bool,
}

impl ShmTransport {
    /// Starts `workers` copy threads that share one set of priority queues, promoting with
    /// `qos.promotion` and reporting depths, waits and promotions to `qos`. Fails when a thread
    /// cannot be spawned (the threads already started then exit).
    pub(crate) fn new(
        workers: usize,
        process_vm: bool,
        stats: &TrafficStats,
        qos: Arc<Qos>,
    ) -> Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(QueueState {
                jobs: PriorityQueues::new(qos.promotion),
                reported: [0; LEVELS],
                idle: 0,
                woken: 0,
                alive: workers,
                stopped: false,
            }),
            ready: Condvar::new(),
            depths: Default::default(),
            epoch: Instant::now(),
            qos,
            rail: stats.rail("shm"),
        });
        for i in 0..workers {
            let worker = shared.clone();
            let spawned = thread::Builder::new()
                .name(format!("mr-shm-{i}"))
                .spawn(move || copy_worker(&worker));
            if let Err(e) = spawned {
                shared.lock().alive -= workers - i;
                shared.stop();
                return Err(Error::io("spawning shm worker", e));
            }
        }
        Ok(ShmTransport {
            shared,
            workers,
            process_vm,
        })
    }

    fn reach(&self, peer: &Peer, buffer: &BufferDescriptor) -> Result<Reach> {
        if !peer.same_host {
            return Err(Error::TransportUnavailable {
                transport: "shm",
                reason: format!("segment {} is on another host", peer.name),
            });
        }
        if peer.same_process {
            return Ok(Reach::Direct);
        }
        if let Some(handle) = &buffer.shm {
            let mut maps = peer.mappings.lock().expect("peer poisoned");
            if let Some(m) = maps.get(&(buffer.addr, buffer.key)) {
                return Ok(Reach::Mapped {
                    mapping: m.clone(),
                    buffer_addr: buffer.addr,
                });
            }
            let m = Arc::new(PeerMapping::open(handle, buffer.len as usize)?);
            maps.insert((buffer.addr, buffer.key), m.clone());
            return Ok(Reach::Mapped {
                mapping: m,
                buffer_addr: buffer.addr,
            });
        }
        if !self.process_vm {
            return Err(Error::TransportUnavailable {
                transport: "shm",
                reason: "the buffer is registered memory and transports.shm.process_vm is off"
                    .into(),
            });
        }
        let pid = peer.descriptor().pid as i32;
        let allowed = *peer
            .process_vm_allowed
            .get_or_init(|| probe_process_vm(pid, buffer.addr));
        if allowed {
            Ok(Reach::ProcessVm { pid })
        } else {
            Err(Error::TransportUnavailable {
                transport: "shm",
                reason: format!("the kernel refuses process_vm_readv on process {pid}"),
            })
        }
    }
}

impl Drop for ShmTransport {
    /// Workers finish the jobs already queued (their tasks then complete), then exit.
    fn drop(&mut self) {
        self.shared.stop();
    }
}

/// Tries a one-byte process_vm_readv; EPERM (ptrace restrictions, other users) means no.
fn probe_process_vm(pid: i32, addr: u64) -> bool {
    let mut byte = 0u8;
    let local = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: `local` describes one writable byte on our stack; `remote` is only read, in the
    // other process, by the kernel, which checks it.
    let rc = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if rc == 1 {
        return true;
    }
    tracing::warn!(
        pid,
        error = %io::Error::last_os_error(),
        "process_vm_readv refused; registered memory of this same-host peer goes over tcp"
    );
    false
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn prepare(&self, peer: &Peer, buffer: &BufferDescriptor) -> Result<()> {
        self.reach(peer, buffer).map(|_| ())
    }

    /// Queues the request's jobs at its priority and wakes idle workers; the jobs fail with
    /// `TransportUnavailable` when no worker is left to run them.
    fn post(&self, peer: &Peer, req: Prepared, plan: &SlicePlan) {
        let reach = match self.reach(peer, &req.buffer) {
            Ok(r) => r,
            Err(e) => {
                req.fail(e);
                return;
            }
        };
        let Some(slices) = req.slices(plan) else {
            return;
        };
        let (jobs, spans) = job_pieces(
            job_spans(&slices, self.workers, MAX_JOB_BYTES),
            MAX_JOB_BYTES,
        );
        req.task.add_parts(jobs as u32);
        let job = |span: JobSpan| CopyJob {
            op: req.op,
            local: req.local + span.offset as usize,
            remote: req.remote + span.offset,
            len: span.len as usize,
            slices: span.slices,
            reach: reach.clone(),
            task: req.task.clone(),
        };
        let shared = &*self.shared;
        let now_ns = shared.ns(Instant::now());
        let mut st = shared.lock();
        if st.stopped || st.alive == 0 {
            drop(st);
            for _ in 0..jobs {
                shared.rail.record_error();
                req.task.part_done(Err(stopped_error()));
            }
            return;
        }
        for span in spans {
            st.jobs.push_back(job(span), req.priority, now_ns);
        }
        shared.report_depths(&mut st);
        let wake = jobs.min(st.idle);
        st.idle -= wake;
        st.woken += wake;
        drop(st);
        // Outside the lock, so a woken worker does not block on it at once. A worker counted
        // in `idle` was blocked in its wait before we took the lock, so each notify wakes one
        // or finds it already awake (timed out); either way it looks at the queue, and any
        // worker awake takes jobs until the queue is empty before it waits again.
        for _ in 0..wake {
            shared.ready.notify_one();
        }
    }
}

/// Counts a worker out when it exits, even by panicking; the last one out fails what is still
/// queued, since no thread would ever run it.
struct Exit<'a>(&'a Shared);

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
            shared.rail.record_error();
            job.task.part_done(Err(stopped_error()));
        }
    }
}

/// One copy worker: takes the head of the highest non-empty level (after promoting what has
/// starved), copies it with no lock held and reports it; sleeps while nothing is queued.
/// Returns once the transport has stopped and the queue is empty.
fn copy_worker(shared: &Shared) {
    let _exit = Exit(shared);
    let mut st = shared.lock();
    // Whether the worker has watched for new jobs since it last found the queue empty.
    let mut watched = false;
    loop {
        let now = Instant::now();
        let now_ns = shared.ns(now);
        let promoted = st.jobs.on_timeout(now_ns);
        if promoted > 0 {
            shared.qos.promoted(promoted);
        }
        if let Some((_, prio)) = st.jobs.front(|_| true) {
            let taken = st.jobs.pop(prio, now_ns).expect("the head exists");
            shared.report_depths(&mut st);
            drop(st);
            shared.qos.host_dequeued(prio, taken.waited_ns, now);
            let mut job = taken.item;
            // HIGH copies whole; bulk in steps, yielding to higher work between them.
            let step = if prio == HIGH { job.len } else { PREEMPT_STEP };
            let mut copied = 0;
            let outcome = loop {
                let n = step.min(job.len - copied);
                if let Err(e) = run(&job, copied, n) {
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
                    // Drop the job (its task and mapping references) before taking the lock.
                    drop(job);
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

/// Copies `len` bytes of `job` starting `skip` bytes into it.
fn run(job: &CopyJob, skip: usize, len: usize) -> Result<()> {
    let remote_ptr = match &job.reach {
        Reach::Direct => job.remote as usize,
        Reach::Mapped {
            mapping,
            buffer_addr,
        } => mapping.base() + (job.remote - buffer_addr) as usize,
        Reach::ProcessVm { pid } => return process_vm(job, *pid, skip, len),
    };
    debug_assert!(skip + len <= job.len);
    let (src, dst) = match job.op {
        Opcode::Write => (job.local + skip, remote_ptr + skip),
        Opcode::Read => (remote_ptr + skip, job.local + skip),
    };
    // SAFETY: the engine checked that `local..local+job.len` lies in locally registered memory
    // and `remote..remote+job.len` in a buffer the peer published, and `skip + len <= job.len`
    // (callers copy a job in consecutive parts); `remote_ptr` maps that range (our own address
    // space, or our mapping of the peer's memfd held alive by `job.reach`). The ranges belong
    // to different buffers or the caller asked for overlapping ones, which a transfer engine,
    // like RDMA, leaves to the caller; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
    Ok(())
}

/// Copies `len` bytes of `job` starting `skip` bytes into it, with process_vm_readv/writev
/// into process `pid`.
fn process_vm(job: &CopyJob, pid: i32, skip: usize, len: usize) -> Result<()> {
    let mut done = skip;
    let end = skip + len;
    while done < end {
        let local = libc::iovec {
            iov_base: (job.local + done) as *mut libc::c_void,
            iov_len: end - done,
        };
        let remote = libc::iovec {
            iov_base: (job.remote as usize + done) as *mut libc::c_void,
            iov_len: end - done,
        };
        // SAFETY: `local` lies in locally registered memory checked by the engine; the kernel
        // validates `remote` against the other process's mappings and fails with EFAULT.
        let rc = unsafe {
            match job.op {
                Opcode::Write => libc::process_vm_writev(pid, &local, 1, &remote, 1, 0),
                Opcode::Read => libc::process_vm_readv(pid, &local, 1, &remote, 1, 0),
            }
        };
        if rc <= 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(match err.raw_os_error() {
                Some(libc::ESRCH) => Error::PeerDisconnected {
                    peer: format!("process {pid}"),
                    reason: "process exited".into(),
                },
                _ => Error::io(format!("process_vm copy with process {pid}"), err),
            });
        }
        done += rc as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Batch;
    use crate::config::RdmaConfig;
    use multirail_policy::qos::{LOW, MEDIUM};
    use proptest::prelude::*;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;

    fn spans(block: u64, max_slices: u32, length: u64, workers: usize) -> Vec<JobSpan> {
        let plan = SlicePlan::new(block, max_slices).unwrap();
        job_spans(&plan.slices(length).unwrap(), workers, MAX_JOB_BYTES).collect()
    }

    fn lens(spans: &[JobSpan]) -> Vec<u64> {
        spans.iter().map(|s| s.len).collect()
    }

    #[test]
    fn bulk_requests_become_one_mib_jobs() {
        // The default write plan: 64 KiB blocks, at most 32 slices.
        let s = spans(64 * KIB, 32, 16 * MIB, 2);
        assert_eq!(lens(&s), vec![MIB; 16], "32 slices of 512 KiB, two per job");
        assert!(s.iter().all(|s| s.slices == 2));
        assert_eq!(lens(&spans(64 * KIB, 32, 4 * MIB, 2)), vec![MIB; 4]);
        // The default read plan: 64 slices of 64 KiB.
        assert_eq!(lens(&spans(64 * KIB, 64, 4 * MIB, 2)), vec![MIB; 4]);
    }

    #[test]
    fn small_requests_are_split_only_between_workers() {
        assert_eq!(lens(&spans(64 * KIB, 32, 64 * KIB, 2)), vec![64 * KIB]);
        assert_eq!(lens(&spans(64 * KIB, 32, 3, 8)), vec![3]);
        assert_eq!(lens(&spans(64 * KIB, 32, 256 * KIB, 2)), vec![128 * KIB; 2]);
        assert_eq!(lens(&spans(64 * KIB, 32, 256 * KIB, 8)), vec![64 * KIB; 4]);
    }

    #[test]
    fn a_slice_larger_than_a_job_is_copied_in_job_sized_pieces() {
        // 1 GiB in at most 32 slices: 32 MiB each, one per run...
        let plan = SlicePlan::new(64 * KIB, 32).unwrap();
        let slices = plan.slices(1 << 30).unwrap();
        let runs = job_spans(&slices, 2, MAX_JOB_BYTES);
        assert_eq!(lens(&runs.clone().collect::<Vec<_>>()), vec![32 * MIB; 32]);
        // ...each copied in 32 jobs of 1 MiB, the first of which counts the slice.
        let (n, jobs) = job_pieces(runs, MAX_JOB_BYTES);
        let jobs: Vec<JobSpan> = jobs.collect();
        assert_eq!((n, lens(&jobs)), (1024, vec![MIB; 1024]));
        assert_eq!(jobs.iter().map(|j| j.slices).sum::<u64>(), 32);
        assert_eq!((jobs[0].slices, jobs[1].slices, jobs[32].slices), (1, 0, 1));
        // Runs within the bound are left whole.
        let (n, jobs) = job_pieces(job_spans(&slices, 2, 64 * MIB), 64 * MIB);
        assert_eq!((n, jobs.count()), (16, 16));
    }

    #[test]
    fn the_long_last_slice_gets_a_job_of_its_own_when_needed() {
        // Two slices, the last carrying a merged tail: 512 KiB + 612 KiB exceed 1 MiB together.
        let s = spans(512 * KIB, 64, MIB + 100 * KIB, 1);
        assert_eq!(lens(&s), vec![512 * KIB, 612 * KIB]);
        // 4 × 256 KiB + a 60 KiB tail merged into the last: 512 KiB + 572 KiB.
        let s = spans(256 * KIB, 64, MIB + 60 * KIB, 1);
        assert_eq!(lens(&s), vec![512 * KIB, 572 * KIB]);
    }

    proptest! {
        #[test]
        fn jobs_cover_every_byte_once_in_whole_slices(
            length in 1u64..(64 * MIB),
            block in 1u64..(4 * MIB),
            max_slices in 1u32..128,
            workers in 1usize..9,
            max_job in 1u64..(4 * MIB),
        ) {
            let plan = SlicePlan::new(block, max_slices).unwrap();
            let slices = plan.slices(length).unwrap();
            let bounds: Vec<u64> = slices.clone().map(|s| s.offset).collect();
            let count = bounds.len() as u64;
            let slice_len: Vec<u64> = slices.clone().map(|s| s.length).collect();
            let jobs: Vec<JobSpan> = job_spans(&slices, workers, max_job).collect();
            prop_assert_eq!(jobs.len(), job_spans(&slices, workers, max_job).len());
            prop_assert!(jobs.len() as u64 >= count.min(workers as u64));
            let mut offset = 0;
            let mut first = 0usize;
            for job in &jobs {
                prop_assert_eq!(job.offset, offset, "contiguous");
                prop_assert!(job.len > 0 && job.slices > 0, "never empty");
                // The job starts at a slice boundary and holds exactly its slices.
                prop_assert_eq!(bounds[first], job.offset);
                let n = job.slices as usize;
                prop_assert_eq!(slice_len[first..first + n].iter().sum::<u64>(), job.len);
                prop_assert!(job.len <= max_job || job.slices == 1, "{:?} over {}", job, max_job);
                offset += job.len;
                first += n;
            }
            prop_assert_eq!(offset, length, "every byte once");
            prop_assert_eq!(first as u64, count, "every slice once");
        }

        #[test]
        fn pieces_cover_every_byte_once_within_the_bound(
            length in 1u64..(256 * MIB),
            block in 1u64..(64 * MIB),
            max_slices in 1u32..128,
            workers in 1usize..9,
            max_job in 1u64..(4 * MIB),
        ) {
            let plan = SlicePlan::new(block, max_slices).unwrap();
            let slices = plan.slices(length).unwrap();
            let count = slices.len() as u64;
            let (n, jobs) = job_pieces(job_spans(&slices, workers, max_job), max_job);
            let jobs: Vec<JobSpan> = jobs.collect();
            prop_assert_eq!(n, jobs.len());
            prop_assert!(n as u64 >= count.min(workers as u64));
            let mut offset = 0;
            for job in &jobs {
                prop_assert_eq!(job.offset, offset, "contiguous");
                prop_assert!(job.len > 0 && job.len <= max_job, "{:?} over {}", job, max_job);
                offset += job.len;
            }
            prop_assert_eq!(offset, length, "every byte once");
            prop_assert_eq!(jobs.iter().map(|j| j.slices).sum::<u64>(), count, "every slice counted once");
        }
    }

    fn qos() -> Arc<Qos> {
        Arc::new(Qos::new(&RdmaConfig::default(), Instant::now()).unwrap())
    }

    /// A job that copies `src` over the start of `dst` within this process.
    fn direct_job(src: &[u8], dst: &mut [u8], task: Arc<Task>) -> CopyJob {
        CopyJob {
            op: Opcode::Write,
            local: src.as_ptr() as usize,
            remote: dst.as_mut_ptr() as u64,
            len: src.len(),
            slices: 1,
            reach: Reach::Direct,
            task,
        }
    }

    #[test]
    fn a_worker_takes_high_then_medium_then_low() {
        let stats = TrafficStats::default();
        let qos = qos();
        let shm = ShmTransport::new(1, false, &stats, qos.clone()).unwrap();
        let batch = Batch::new(1, 3);
        let tasks = batch.add_tasks(3).unwrap();
        // Each job overwrites the start of `dst`: the one run last leaves the first byte, the
        // one before it the second. Only HIGH, then MEDIUM, then LOW leaves "LMH".
        let (high, medium, low) = (*b"HHH", *b"MM", *b"L");
        let mut dst = [0u8; 3];
        {
            // All three are queued before the worker can look: LOW first, then HIGH, MEDIUM.
            let mut st = shm.shared.lock();
            let now = shm.shared.ns(Instant::now());
            for (src, prio, task) in [
                (&low[..], LOW, &tasks[0]),
                (&high[..], HIGH, &tasks[1]),
                (&medium[..], MEDIUM, &tasks[2]),
            ] {
                let job = direct_job(src, &mut dst, task.clone());
                st.jobs.push_back(job, prio, now);
            }
            shm.shared.report_depths(&mut st);
            assert_eq!(qos.snapshot().priorities[LOW as usize].queued, 1);
        }
        shm.shared.ready.notify_all();
        batch
            .wait(Some(Duration::from_secs(30)), Duration::ZERO)
            .unwrap();
        assert_eq!(&dst, b"LMH");
        let s = qos.snapshot();
        assert!(s
            .priorities
            .iter()
            .all(|p| p.dequeued == 1 && p.queued == 0));
        let rail = stats
            .snapshot()
            .into_iter()
            .find(|r| r.name == "shm")
            .unwrap();
        assert_eq!((rail.bytes, rail.slices), (6, 3));
        assert_eq!(rail.priority_bytes, [3, 2, 1]);
    }

    #[test]
    fn a_bulk_copy_yields_to_high_work_between_steps_and_still_lands_whole() {
        let stats = TrafficStats::default();
        let qos = qos();
        let shm = ShmTransport::new(1, false, &stats, qos.clone()).unwrap();
        let (bulk_batch, high_batch) = (Batch::new(1, 1), Batch::new(2, 1));
        let bulk_task = bulk_batch.add_tasks(1).unwrap().pop().unwrap();
        let high_task = high_batch.add_tasks(1).unwrap().pop().unwrap();
        // One LOW job far larger than a step: hundreds of milliseconds of copying into pages
        // touched for the first time.
        let len = 512 << 20;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let mut dst = vec![0u8; len];
        let (high_src, mut high_dst) = ([9u8; 4096], [0u8; 4096]);
        let push = |job: CopyJob, prio: u8| {
            let mut st = shm.shared.lock();
            let now = shm.shared.ns(Instant::now());
            st.jobs.push_back(job, prio, now);
            shm.shared.report_depths(&mut st);
            drop(st);
            shm.shared.ready.notify_all();
        };
        push(direct_job(&src, &mut dst, bulk_task), LOW);
        // Once the worker has taken the bulk job, HIGH arrives.
        while shm.shared.queued() > 0 {
            thread::yield_now();
        }
        push(direct_job(&high_src, &mut high_dst, high_task), HIGH);
        high_batch
            .wait(Some(Duration::from_secs(60)), Duration::ZERO)
            .unwrap();
        assert_eq!(high_dst, high_src);
        assert!(
            !bulk_batch.overall_status().is_completed(),
            "HIGH waited for the whole bulk copy"
        );
        bulk_batch
            .wait(Some(Duration::from_secs(60)), Duration::ZERO)
            .unwrap();
        assert!(dst == src, "the bulk copy resumed where it stopped");
        let rail = stats
            .snapshot()
            .into_iter()
            .find(|r| r.name == "shm")
            .unwrap();
        // Resumed work is not counted twice: every byte once, the bulk job's slice once.
        assert_eq!(rail.bytes, (len + 4096) as u64);
        assert_eq!(rail.slices, 2);
        assert_eq!(rail.priority_bytes, [4096, 0, len as u64]);
        let low = &qos.snapshot().priorities[LOW as usize];
        assert!(low.dequeued >= 2 && low.queued == 0, "{low:?}");
    }

    #[test]
    fn workers_exit_when_the_transport_drops_and_finish_what_was_queued() {
        let stats = TrafficStats::default();
        let shm = ShmTransport::new(2, false, &stats, qos()).unwrap();
        let shared = Arc::downgrade(&shm.shared);
        let batch = Batch::new(1, 1);
        let task = batch.add_tasks(1).unwrap().pop().unwrap();
        let src = vec![7u8; 1 << 16];
        let mut dst = vec![0u8; 1 << 16];
        {
            let mut st = shm.shared.lock();
            let now = shm.shared.ns(Instant::now());
            let job = direct_job(&src, &mut dst, task);
            st.jobs.push_back(job, LOW, now);
        }
        drop(shm);
        batch
            .wait(Some(Duration::from_secs(30)), Duration::ZERO)
            .unwrap();
        assert_eq!(dst, src);
        // Each worker holds the shared state until it returns.
        let deadline = Instant::now() + Duration::from_secs(30);
        while shared.strong_count() > 0 {
            assert!(Instant::now() < deadline, "workers still running");
            thread::sleep(Duration::from_millis(1));
        }
    }
}
