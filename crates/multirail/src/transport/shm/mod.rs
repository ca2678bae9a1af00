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
//! A request of at most `transports.shm.inline_bytes` is copied by the thread that posts it,
//! before the post returns: a hand-off costs more than such a copy, and a copy that short
//! delays nothing queued behind it by more than the hand-off would have. A post holding
//! [`SMALL_GROUPS_FROM`] bytes or more of them (a thousand blocks scattered over a KV cache)
//! hands them to the workers in groups of about [`SMALL_GROUP_BYTES`] instead, each group one
//! job, so the copies use every core (the waiting thread's too) for one hand-off per group.
//! Those of one post that reach the same process with process_vm_readv/writev share system
//! calls, up to 1,024 requests each ([`gather`]).
//!
//! Queue depths, waits and promotions are reported to the engine's QoS state, so its
//! statistics and its "is bulk moving" test see shm work; the queues count jobs, not slices.
//! They are kept apart from network traffic's: shm work reserves no rail and holds back no
//! network bulk. No lock is held during a copy. A worker that finds the queue empty watches it briefly
//! before sleeping on a condvar, and a poster wakes only as many sleeping workers as it queued
//! jobs.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use multirail_policy::qos::{Priority, PriorityQueues, HIGH, LEVELS};
use multirail_policy::slicing::{job_pieces, job_spans, JobSpan, SlicePlan};

use crate::access::Access;
use crate::batch::{Finished, Task};
use crate::error::{Error, Result};
use crate::mapping::PeerMapping;
use crate::peer::Peer;
use crate::qos::Qos;
use crate::segment::{BufferDescriptor, ShmHandle};
use crate::stats::{RailCounters, TrafficStats};
use crate::transport::{Opcode, Plans, Prepared, Transport};

mod copy;
mod gather;
mod workers;

use copy::*;
use gather::VmGather;
use workers::*;

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

/// The small requests of one post (each at most `transports.shm.inline_bytes`) are copied by
/// the poster while they come to less than this many bytes; from here on they go to the workers
/// in groups of about [`SMALL_GROUP_BYTES`]. Below it, a copy (under 80 µs at 13 GB/s) costs
/// less than waking a worker; above it, one core copying a thousand scattered blocks leaves the
/// others idle: 16 KiB blocks in a scattered order went at 8 GB/s on one core where memcpy of
/// them reaches 14.6.
pub(crate) const SMALL_GROUPS_FROM: u64 = 1 << 20;

/// How many bytes of small requests a worker takes at once from a post of many
/// ([`SMALL_GROUPS_FROM`]): a copy of 20-30 µs, against a hand-off of a few µs, and short
/// enough that the waiting thread and every worker get a share of a batch of a few MiB.
pub(crate) const SMALL_GROUP_BYTES: u64 = 256 << 10;

/// Groups of small requests a post fills at once: requests into different buffers (a KV cache
/// registered as one buffer per layer, keys and values apart) go to groups of their own, each
/// copied under its buffer's access entry, and a post alternating between a few buffers still
/// fills whole groups. Past this many, the oldest open group takes no more.
const OPEN_GROUPS: usize = 8;

/// Where [`ShmTransport::take`] puts what it takes of a request.
struct Taken<'a> {
    queued: &'a mut Vec<(CopyJob, Priority)>,
    small: &'a mut Vec<(CopyJob, Priority)>,
    tally: &'a mut Tally,
    gathered: &'a mut VmGather,
}

/// What the shm transport keeps about one peer.
#[derive(Default)]
struct ShmPeer {
    /// Mappings of the peer's memfd buffers, by (address, key).
    mappings: Mutex<HashMap<(u64, u64), Arc<PeerMapping>>>,
    /// Whether the kernel lets us use process_vm_readv/writev on this peer.
    process_vm_allowed: OnceLock<bool>,
    /// Our mapping of the peer's access table.
    access_table: Mutex<Option<MappedTable>>,
}

/// A peer's access table as we mapped it: by which handle, and which table that was.
struct MappedTable {
    handle: ShmHandle,
    id: u64,
    mapping: Arc<PeerMapping>,
    /// Whose table it is, as each access entry names its owner: made once here rather than
    /// for every request.
    owner: (Arc<str>, Arc<AtomicBool>),
}

impl ShmPeer {
    /// The access entry of `buffer` of `peer`, mapping the peer's access table on first use;
    /// `None` for a buffer published without one (an engine of an older version).
    fn access(&self, peer: &Peer, buffer: &BufferDescriptor) -> Result<Option<Access>> {
        let Some(access) = &buffer.access else {
            return Ok(None);
        };
        let mut table = self
            .access_table
            .lock()
            .expect("shm peer access table poisoned");
        let (mapping, owner) = match &*table {
            Some(t) if t.handle == access.table && t.id == access.table_id => {
                (t.mapping.clone(), t.owner.clone())
            }
            _ => {
                // A stale descriptor: the next request fetches it again.
                let mapping = Access::map_table(access, &peer.name)
                    .inspect_err(|_| peer.mark_keys_refused())?;
                let owner = (Arc::from(peer.name.as_str()), peer.keys_refused());
                *table = Some(MappedTable {
                    handle: access.table,
                    id: access.table_id,
                    mapping: mapping.clone(),
                    owner: owner.clone(),
                });
                (mapping, owner)
            }
        };
        Access::new(mapping, access, buffer.key, owner).map(Some)
    }
}

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

impl Reach {
    /// Whether `self` and `other` reach the same buffer the same way (the same mapping of it,
    /// or the same process), so one may copy for the other.
    fn same_as(&self, other: &Reach) -> bool {
        match (self, other) {
            (Reach::Direct, Reach::Direct) => true,
            (
                Reach::Mapped {
                    mapping: a,
                    buffer_addr: x,
                },
                Reach::Mapped {
                    mapping: b,
                    buffer_addr: y,
                },
            ) => Arc::ptr_eq(a, b) && x == y,
            (Reach::ProcessVm { pid: a }, Reach::ProcessVm { pid: b }) => a == b,
            _ => false,
        }
    }
}

/// How to reach a buffer, and its access entry, which every copy into it holds.
type Reached = (Reach, Option<Access>);

/// The shared-memory transport and its copy workers.
pub(crate) struct ShmTransport {
    shared: Arc<Shared>,
    workers: usize,
    /// `transports.shm.inline_bytes`: requests this small are copied by the poster.
    inline_bytes: u64,
    /// `transports.shm.process_vm`: reach registered memory of same-host peers with
    /// process_vm_readv/writev.
    process_vm: bool,
    /// Per peer (by engine id): mappings of its memfd buffers, and whether process_vm works.
    peers: Mutex<HashMap<u64, Arc<ShmPeer>>>,
}

impl ShmTransport {
    /// Forgets peer `id` (its segment was closed): its mappings go once no copy in flight
    /// holds them.
    pub(crate) fn forget_peer(&self, id: u64) {
        self.peers.lock().expect("shm peers poisoned").remove(&id);
    }

    /// Starts `workers` copy threads that share one set of priority queues, promoting with
    /// `qos.promotion` and reporting depths, waits and promotions to `qos`; requests of at most
    /// `inline_bytes` are copied by their poster; with `nontemporal`, copies stream past the
    /// caches. Fails when a thread cannot be spawned (the threads already started then exit).
    pub(crate) fn new(
        workers: usize,
        process_vm: bool,
        inline_bytes: u64,
        nontemporal: bool,
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
            nontemporal,
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
            inline_bytes,
            process_vm,
            peers: Mutex::default(),
        })
    }

    /// What this transport keeps about peer `id`, made on first use.
    fn peer_state(&self, id: u64) -> Arc<ShmPeer> {
        self.peers
            .lock()
            .expect("shm peers poisoned")
            .entry(id)
            .or_default()
            .clone()
    }

    /// How to reach `buffer` of `peer`, and the access entry a copy into it holds.
    fn reach(&self, peer: &Peer, buffer: &BufferDescriptor) -> Result<Reached> {
        if !peer.same_host {
            return Err(Error::TransportUnavailable {
                transport: "shm",
                reason: format!("segment {} is on another host", peer.name),
            });
        }
        let state = self.peer_state(peer.id);
        let access = state.access(peer, buffer)?;
        Ok((self.way(peer, &state, buffer)?, access))
    }

    fn way(&self, peer: &Peer, state: &ShmPeer, buffer: &BufferDescriptor) -> Result<Reach> {
        if peer.same_process {
            return Ok(Reach::Direct);
        }
        if let Some(handle) = &buffer.shm {
            let mut maps = state.mappings.lock().expect("peer poisoned");
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
        let allowed = *state
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

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn prepare(&self, peer: &Arc<Peer>, buffer: &BufferDescriptor) -> Result<()> {
        self.reach(peer, buffer).map(|_| ())
    }

    /// Copies requests of at most `inline_bytes` at once and queues the jobs of the others at
    /// their priority, waking idle workers (the jobs fail with `TransportUnavailable` when no
    /// worker is left to run them). How to reach a buffer is resolved once for the requests
    /// in a row that target it, and the jobs of the whole call are queued under one lock with
    /// one wake-up per worker needed, not a lock and a wake-up per request.
    fn post(&self, reqs: Vec<(Arc<Peer>, Prepared)>, plans: &Plans) {
        let mut reached: Option<((u64, u64, u64), Reached)> = None;
        let (mut queued, mut tally) = (Vec::new(), Tally::default());
        let (mut small, mut gathered) = (Vec::new(), VmGather::new());
        for (peer, req) in reqs {
            let key = (peer.id, req.buffer.addr, req.buffer.key);
            let reach = match &reached {
                Some((k, reach)) if *k == key => reach.clone(),
                _ => match self.reach(&peer, &req.buffer) {
                    Ok(reach) => {
                        reached = Some((key, reach.clone()));
                        reach
                    }
                    Err(e) => {
                        req.fail(e);
                        continue;
                    }
                },
            };
            let plan = plans.of(req.op);
            let to = Taken {
                queued: &mut queued,
                small: &mut small,
                tally: &mut tally,
                gathered: &mut gathered,
            };
            self.take(reach, req, plan, to);
        }
        // The larger requests' jobs go to the workers first, so they are not held back
        // behind the small copies.
        self.queue(queued);
        self.copy_small(small, &mut tally);
        gathered.flush(&mut tally, &self.shared.rail);
        tally.record(&self.shared.rail);
    }
}

/// Bytes and slices copied inline by one post, counted into the rail's shared counters once
/// rather than with three atomic additions per request.
#[derive(Default)]
struct Tally {
    bytes: [u64; LEVELS],
    slices: u64,
}

impl Tally {
    fn add(&mut self, priority: Priority, bytes: u64, slices: u64) {
        self.bytes[priority.index()] += bytes;
        self.slices += slices;
    }

    fn record(&self, rail: &RailCounters) {
        for (level, &bytes) in Priority::ALL.into_iter().zip(&self.bytes) {
            if bytes > 0 {
                rail.record_at(level, bytes, 0);
            }
        }
        if self.slices > 0 {
            rail.record(0, self.slices);
        }
    }
}

impl ShmTransport {
    /// Takes `req` into `to`: when it is at most `inline_bytes`, as a copy for the end of the
    /// post ([`ShmTransport::copy_small`]), or with the others of the post to the same process
    /// through `gathered` when it is reached with process_vm_readv/writev. Else cuts it into
    /// jobs and adds them to `queued` for [`ShmTransport::queue`].
    fn take(&self, (reach, access): Reached, req: Prepared, plan: &SlicePlan, to: Taken<'_>) {
        let Taken {
            queued,
            small,
            tally,
            gathered,
        } = to;
        let Some(slices) = req.slices(plan) else {
            return;
        };
        if req.len <= self.inline_bytes {
            let job = CopyJob {
                op: req.op,
                local: req.local,
                remote: req.remote,
                len: req.len as usize,
                slices: slices.len() as u64,
                reach,
                access,
                batch: req.batch,
                task: req.task.clone(),
                then: Vec::new(),
            };
            if let Reach::ProcessVm { pid } = job.reach {
                gathered.push(pid, job, req.priority, tally, &self.shared.rail);
                return;
            }
            req.task.add_parts(1);
            small.push((job, req.priority));
            return;
        }
        let (jobs, spans) = job_pieces(
            job_spans(&slices, self.workers, MAX_JOB_BYTES),
            MAX_JOB_BYTES,
        );
        req.task.add_parts(jobs as u32);
        queued.extend(spans.map(|span: JobSpan| {
            let job = CopyJob {
                op: req.op,
                local: req.local + span.offset as usize,
                remote: req.remote + span.offset,
                len: span.len as usize,
                slices: span.slices,
                reach: reach.clone(),
                access: access.clone(),
                batch: req.batch,
                task: req.task.clone(),
                then: Vec::new(),
            };
            (job, req.priority)
        }));
    }

    /// Copies the post's small requests (each at most `inline_bytes`, its task part already
    /// added). On this thread, one after the other, while they come to less than
    /// [`SMALL_GROUPS_FROM`] bytes: a hand-off costs more than such a copy. Else as groups of
    /// about [`SMALL_GROUP_BYTES`] of one priority and one buffer each (see [`Member`]), queued for the workers (and the
    /// thread that waits for the batch): a thousand 16 KiB blocks scattered over a KV cache
    /// then take every core the copies can use, not only the poster's.
    fn copy_small(&self, small: Vec<(CopyJob, Priority)>, tally: &mut Tally) {
        let bytes: usize = small.iter().map(|(job, _)| job.len).sum();
        if self.workers == 0 || (bytes as u64) < SMALL_GROUPS_FROM {
            let mut finished = Finished::default();
            for (job, priority) in small {
                let outcome = run(&job, 0, job.len, self.shared.nontemporal);
                match &outcome {
                    Ok(()) => tally.add(priority, job.len as u64, job.slices),
                    Err(_) => self.shared.rail.record_error(),
                }
                finished.part_done(&job.task, outcome);
            }
            return;
        }
        let mut groups: Vec<(CopyJob, Priority)> = Vec::new();
        // The groups still taking members, most recent last: (index in `groups`, bytes).
        let mut open: Vec<(usize, usize)> = Vec::with_capacity(OPEN_GROUPS);
        for (job, priority) in small {
            let fits = open.iter().rposition(|&(g, _)| {
                let (head, p) = &groups[g];
                *p == priority && job.shares_buffer_with(head)
            });
            match fits {
                Some(o) => {
                    let (g, bytes) = &mut open[o];
                    *bytes += job.len;
                    let full = *bytes as u64 >= SMALL_GROUP_BYTES;
                    groups[*g].0.then.push(Member::from(job));
                    if full {
                        open.remove(o);
                    }
                }
                None => {
                    if open.len() == OPEN_GROUPS {
                        open.remove(0);
                    }
                    open.push((groups.len(), job.len));
                    groups.push((job, priority));
                }
            }
        }
        self.queue(groups);
    }

    /// Queues `jobs` under one lock and wakes as many idle workers as there are jobs; fails
    /// them with `TransportUnavailable` when no worker is left to run them.
    fn queue(&self, jobs: Vec<(CopyJob, Priority)>) {
        if jobs.is_empty() {
            return;
        }
        let shared = &*self.shared;
        let now_ns = shared.ns(Instant::now());
        let mut st = shared.lock();
        if st.stopped || st.alive == 0 {
            drop(st);
            for (job, _) in jobs {
                job.fail(&shared.rail, stopped_error);
            }
            return;
        }
        let count = jobs.len();
        for (job, priority) in jobs {
            st.jobs.push_back(job, priority, now_ns);
        }
        shared.report_depths(&mut st);
        let wake = count.min(st.idle);
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

    /// Runs queued jobs of batch `batch` on the calling thread while `finished` says the
    /// batch is not done and the job a worker would take next (the head of the highest
    /// non-empty level, after promotion) is one of them: a thread that would otherwise wait
    /// for the batch copies too, instead of spinning on a core the workers need. It never
    /// takes a job ahead of another batch's, so priorities and queue order hold as they do
    /// for the workers. Returns when the next job is not the batch's, or once `until` has
    /// passed.
    pub(crate) fn help(&self, batch: u64, until: Option<Instant>, finished: impl Fn() -> bool) {
        while self.shared.queued() > 0 && !finished() {
            let now = Instant::now();
            if until.is_some_and(|until| now >= until) || !self.copy_next_of(batch, now) {
                return;
            }
        }
    }

    /// Copies one queued job of batch `batch` (a piece of at most [`MAX_JOB_BYTES`], or a group
    /// of small requests) on the calling thread when it is the job a worker would take next,
    /// as [`help`](Self::help) does: for a thread that polls its batch's status rather than
    /// waiting, which otherwise spins on a core the workers need. Returns whether it copied.
    pub(crate) fn help_once(&self, batch: u64) -> bool {
        self.shared.queued() > 0 && self.copy_next_of(batch, Instant::now())
    }

    /// Takes the head of the queue if it is a job of `batch` and copies it (its group too);
    /// returns whether it did.
    fn copy_next_of(&self, batch: u64, now: Instant) -> bool {
        let shared = &*self.shared;
        let mut st = shared.lock();
        let Some((taken, priority)) =
            shared.take_head(&mut st, shared.ns(now), |job| job.batch == batch)
        else {
            return false;
        };
        drop(st);
        shared.qos.host_dequeued(priority, taken.waited_ns, now);
        let job = taken.item;
        let outcome = run(&job, 0, job.len, shared.nontemporal);
        match &outcome {
            Ok(()) => shared.rail.record_at(priority, job.len as u64, job.slices),
            Err(_) => shared.rail.record_error(),
        }
        job.task.part_done(outcome);
        let queued_ns = shared.ns(now).saturating_sub(taken.waited_ns);
        shared.run_group(job, priority, queued_ns);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{Batch, Status};
    use crate::config::RdmaConfig;
    use multirail_policy::qos::{LOW, MEDIUM};
    fn qos() -> Arc<Qos> {
        Arc::new(Qos::new(&RdmaConfig::default(), Instant::now()).unwrap())
    }

    /// The shm rail's counters.
    fn shm_rail(stats: &TrafficStats) -> crate::stats::RailTraffic {
        stats
            .snapshot()
            .into_iter()
            .find(|r| r.name == "shm")
            .unwrap()
    }

    /// Queues `job` at `prio` as a poster would, and wakes the workers.
    fn push(shm: &ShmTransport, job: CopyJob, prio: Priority) {
        let mut st = shm.shared.lock();
        let now = shm.shared.ns(Instant::now());
        st.jobs.push_back(job, prio, now);
        shm.shared.report_depths(&mut st);
        drop(st);
        shm.shared.ready.notify_all();
    }

    /// Queues `low` at LOW, and once the worker has taken it, `high` at HIGH; returns when
    /// `high_batch` is done. The HIGH job arrives while the LOW work is being copied.
    fn high_arrives_during(shm: &ShmTransport, low: CopyJob, high: CopyJob, high_batch: &Batch) {
        push(shm, low, LOW);
        while shm.shared.queued() > 0 {
            thread::yield_now();
        }
        push(shm, high, HIGH);
        high_batch
            .wait(Some(Duration::from_secs(60)), Duration::ZERO)
            .unwrap();
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
            access: None,
            batch: 0,
            task,
            then: Vec::new(),
        }
    }

    #[test]
    fn a_worker_takes_high_then_medium_then_low() {
        let stats = TrafficStats::default();
        let qos = qos();
        let shm = ShmTransport::new(1, false, 0, true, &stats, qos.clone()).unwrap();
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
            assert_eq!(qos.snapshot().priorities[LOW.index()].queued, 1);
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
        let rail = shm_rail(&stats);
        assert_eq!((rail.bytes, rail.slices), (6, 3));
        assert_eq!(rail.priority_bytes, [3, 2, 1]);
    }

    #[test]
    fn a_bulk_copy_yields_to_high_work_between_steps_and_still_lands_whole() {
        let stats = TrafficStats::default();
        let qos = qos();
        let shm = ShmTransport::new(1, false, 0, true, &stats, qos.clone()).unwrap();
        let (bulk_batch, high_batch) = (Batch::new(1, 1), Batch::new(2, 1));
        let bulk_task = bulk_batch.add_tasks(1).unwrap().pop().unwrap();
        let high_task = high_batch.add_tasks(1).unwrap().pop().unwrap();
        // One LOW job far larger than a step: hundreds of milliseconds of copying into pages
        // touched for the first time.
        let len = 512 << 20;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let mut dst = vec![0u8; len];
        let (high_src, mut high_dst) = ([9u8; 4096], [0u8; 4096]);
        let (bulk, high) = (
            direct_job(&src, &mut dst, bulk_task),
            direct_job(&high_src, &mut high_dst, high_task),
        );
        high_arrives_during(&shm, bulk, high, &high_batch);
        assert_eq!(high_dst, high_src);
        assert!(
            !bulk_batch.overall_status().is_completed(),
            "HIGH waited for the whole bulk copy"
        );
        bulk_batch
            .wait(Some(Duration::from_secs(60)), Duration::ZERO)
            .unwrap();
        assert!(dst == src, "the bulk copy resumed where it stopped");
        let rail = shm_rail(&stats);
        // Resumed work is not counted twice: every byte once, the bulk job's slice once.
        assert_eq!(rail.bytes, (len + 4096) as u64);
        assert_eq!(rail.slices, 2);
        assert_eq!(rail.priority_bytes, [4096, 0, len as u64]);
        let low = &qos.snapshot().priorities[LOW.index()];
        assert!(low.dequeued >= 2 && low.queued == 0, "{low:?}");
    }

    #[test]
    fn a_waiter_copies_its_batchs_jobs_only_when_they_are_next() {
        let stats = TrafficStats::default();
        let qos = qos();
        // No worker: only the waiting thread copies.
        let shm = ShmTransport::new(0, false, 0, true, &stats, qos.clone()).unwrap();
        let (ours, theirs) = (Batch::new(7, 3), Batch::new(8, 1));
        let our_tasks = ours.add_tasks(3).unwrap();
        let their_task = theirs.add_tasks(1).unwrap().pop().unwrap();
        let srcs = [[1u8; 64], [2u8; 64], [3u8; 64]];
        let mut dsts = [[0u8; 64]; 3];
        let (their_src, mut their_dst) = ([9u8; 64], [0u8; 64]);
        {
            let mut st = shm.shared.lock();
            let now = shm.shared.ns(Instant::now());
            let [d0, d1, d2] = &mut dsts;
            let job = |src: &[u8], dst: &mut [u8], task: &Arc<Task>, batch| CopyJob {
                batch,
                ..direct_job(src, dst, task.clone())
            };
            // HIGH: ours. MEDIUM: another batch's. LOW: ours, twice.
            st.jobs
                .push_back(job(&srcs[0], d0, &our_tasks[0], 7), HIGH, now);
            let other = job(&their_src, &mut their_dst, &their_task, 8);
            st.jobs.push_back(other, MEDIUM, now);
            st.jobs
                .push_back(job(&srcs[1], d1, &our_tasks[1], 7), LOW, now);
            st.jobs
                .push_back(job(&srcs[2], d2, &our_tasks[2], 7), LOW, now);
            shm.shared.report_depths(&mut st);
        }
        shm.help(7, None, || ours.unfinished() == 0);
        assert_eq!(dsts[0], srcs[0]);
        assert_eq!(
            dsts[1..],
            [[0u8; 64]; 2],
            "nothing is taken while another batch's job is next"
        );
        assert_eq!(
            their_dst, [0u8; 64],
            "another batch's job is left to the workers"
        );
        assert_eq!(ours.unfinished(), 2);
        assert_eq!(shm.shared.queued(), 3);
        // A deadline already past stops the help before it copies anything.
        shm.help(8, Some(Instant::now()), || false);
        assert_eq!(their_dst, [0u8; 64]);
        // A poll for batch 7 copies nothing while batch 8's job is next.
        assert!(!shm.help_once(7));
        assert_eq!(dsts[1..], [[0u8; 64]; 2]);
        shm.help(8, None, || theirs.unfinished() == 0);
        assert_eq!(their_dst, their_src);
        assert_eq!(
            dsts[1..],
            [[0u8; 64]; 2],
            "batch 8's waiter copies only its own"
        );
        // A poll copies one job of its batch, then the waiter the rest.
        assert!(shm.help_once(7));
        assert_eq!(dsts[1], srcs[1]);
        assert_eq!(dsts[2], [0u8; 64], "one job per poll");
        assert_eq!(ours.unfinished(), 1);
        shm.help(7, None, || ours.unfinished() == 0);
        assert_eq!(dsts, srcs);
        assert!(!shm.help_once(7), "nothing left to copy");
        ours.wait(Some(Duration::from_secs(5)), Duration::ZERO)
            .unwrap();
        let rail = shm_rail(&stats);
        assert_eq!((rail.bytes, rail.slices), (256, 4));
        assert_eq!(rail.priority_bytes, [64, 64, 128]);
    }

    /// `n` small jobs at `priority(i)`, each copying its own pattern from `src` into its own
    /// block of `dst`, one task of `batch` each.
    fn small_jobs(
        src: &[u8],
        dst: &mut [u8],
        block: usize,
        batch: &Batch,
        priority: impl Fn(usize) -> Priority,
    ) -> Vec<(CopyJob, Priority)> {
        let tasks = batch.add_tasks(src.len() / block).unwrap();
        src.chunks(block)
            .zip(dst.chunks_mut(block))
            .zip(tasks)
            .enumerate()
            .map(|(i, ((s, d), task))| (direct_job(s, d, task), priority(i)))
            .collect()
    }

    #[test]
    fn many_small_copies_of_one_post_go_to_the_workers_in_groups_of_one_priority() {
        let stats = TrafficStats::default();
        let qos = qos();
        let shm = ShmTransport::new(1, false, 16 << 10, true, &stats, qos.clone()).unwrap();
        // 200 blocks of 16 KiB (3.2 MiB): the first 100 LOW, the rest HIGH.
        let (block, n) = (16 << 10, 200);
        let src: Vec<u8> = (0..block * n).map(|i| (i / block * 31 + i) as u8).collect();
        let mut dst = vec![0u8; block * n];
        let batch = Batch::new(1, n);
        let jobs = small_jobs(&src, &mut dst, block, &batch, |i| {
            if i < 100 {
                LOW
            } else {
                HIGH
            }
        });
        let mut tally = Tally::default();
        shm.copy_small(jobs, &mut tally);
        batch
            .wait(Some(Duration::from_secs(30)), Duration::ZERO)
            .unwrap();
        assert!(dst == src, "every block landed whole");
        // Groups close once they hold 256 KiB (16 blocks) and never span two priorities:
        // 100 LOW blocks make 7 groups, 100 HIGH ones 7.
        let s = qos.snapshot();
        assert_eq!(s.priorities[LOW.index()].dequeued, 7);
        assert_eq!(s.priorities[HIGH.index()].dequeued, 7);
        let rail = shm_rail(&stats);
        assert_eq!((rail.bytes, rail.slices), ((block * n) as u64, n as u64));
        let half = (block * n / 2) as u64;
        assert_eq!(rail.priority_bytes, [half, 0, half]);
    }

    #[test]
    fn small_copies_into_two_buffers_are_grouped_by_buffer_and_a_revoked_one_fails_alone() {
        let stats = TrafficStats::default();
        let qos = qos();
        let shm = ShmTransport::new(1, false, 16 << 10, true, &stats, qos.clone()).unwrap();
        // Two buffers of a peer, each with its own access entry; the second is unregistered
        // (its entry revoked) before the post.
        let table = crate::access::AccessTable::new().unwrap();
        let (kept, gone) = (table.grant(11).unwrap(), table.grant(12).unwrap());
        let mapping = Access::map_table(&kept, "peer:1").unwrap();
        let access = |d: &crate::segment::AccessDescriptor, key| {
            let owner = (Arc::from("peer:1"), Arc::default());
            Access::new(mapping.clone(), d, key, owner).unwrap()
        };
        assert!(table.revoke(gone.entry));
        // 136 blocks of 16 KiB (2.1 MiB, grouped), alternating between the two buffers.
        let (block, n) = (16 << 10, 136);
        let src: Vec<u8> = (0..block * n).map(|i| (i * 7 + i / block) as u8).collect();
        let mut dst = vec![0u8; block * n];
        let batch = Batch::new(1, n);
        let mut jobs = small_jobs(&src, &mut dst, block, &batch, |_| LOW);
        for (i, (job, _)) in jobs.iter_mut().enumerate() {
            job.access = Some(if i % 2 == 0 {
                access(&kept, 11)
            } else {
                access(&gone, 12)
            });
        }
        let mut tally = Tally::default();
        shm.copy_small(jobs, &mut tally);
        // Fails with the revoked buffer's error once every request finished.
        let waited = batch.wait(Some(Duration::from_secs(30)), Duration::ZERO);
        assert!(
            matches!(waited, Err(Error::RemoteRejected { .. })),
            "{waited:?}"
        );
        assert_eq!(batch.unfinished(), 0, "every request finished");
        // 68 blocks a buffer, 16 to a group: 5 groups each (groups taking blocks of both
        // buffers would be 9; closing a group at each change of buffer, 136).
        assert_eq!(qos.snapshot().priorities[LOW.index()].dequeued, 10);
        for i in 0..n {
            let (s, d) = (&src[i * block..][..block], &dst[i * block..][..block]);
            let status = batch.status(i).unwrap();
            if i % 2 == 0 {
                assert!(matches!(status, Status::Completed), "block {i}: {status:?}");
                assert!(s == d, "block {i} landed whole");
            } else {
                assert!(
                    matches!(&status, Status::Failed(Error::RemoteRejected { .. })),
                    "block {i}: {status:?}"
                );
                assert!(d.iter().all(|&b| b == 0), "block {i} untouched");
            }
        }
        let rail = shm_rail(&stats);
        assert_eq!(rail.errors, (n / 2) as u64, "one error each");
        assert_eq!(rail.bytes, (block * n / 2) as u64);
    }

    #[test]
    fn a_few_small_copies_are_done_by_the_poster_before_it_returns() {
        let stats = TrafficStats::default();
        let qos = qos();
        let shm = ShmTransport::new(1, false, 16 << 10, true, &stats, qos.clone()).unwrap();
        // 60 blocks of 16 KiB: under the 1 MiB from which they are grouped.
        let (block, n) = (16 << 10, 60);
        let src: Vec<u8> = (0..block * n).map(|i| (i * 3 + i / block) as u8).collect();
        let mut dst = vec![0u8; block * n];
        let batch = Batch::new(1, n);
        let jobs = small_jobs(&src, &mut dst, block, &batch, |_| LOW);
        let mut tally = Tally::default();
        shm.copy_small(jobs, &mut tally);
        assert_eq!(batch.unfinished(), 0, "copied before copy_small returned");
        assert!(dst == src);
        assert_eq!(qos.snapshot().priorities[LOW.index()].dequeued, 0);
        assert_eq!(tally.bytes[LOW.index()], (block * n) as u64);
        assert_eq!(tally.slices, n as u64);
    }

    #[test]
    fn grouped_small_copies_fail_each_request_when_no_worker_will_run_them() {
        let stats = TrafficStats::default();
        let shm = ShmTransport::new(1, false, 16 << 10, true, &stats, qos()).unwrap();
        shm.shared.stop();
        let (block, n) = (16 << 10, 100);
        let src = vec![5u8; block * n];
        let mut dst = vec![0u8; block * n];
        let batch = Batch::new(1, n);
        let jobs = small_jobs(&src, &mut dst, block, &batch, |_| LOW);
        shm.copy_small(jobs, &mut Tally::default());
        let err = batch
            .wait(Some(Duration::from_secs(30)), Duration::ZERO)
            .unwrap_err();
        assert!(matches!(err, Error::TransportUnavailable { .. }), "{err:?}");
        assert_eq!(batch.unfinished(), 0, "every request of every group failed");
        let rail = shm_rail(&stats);
        assert_eq!(rail.errors, n as u64);
    }

    #[test]
    fn a_group_of_small_copies_gives_way_to_high_work_between_requests() {
        let stats = TrafficStats::default();
        let qos = qos();
        let shm = ShmTransport::new(1, false, 0, true, &stats, qos.clone()).unwrap();
        let (group_batch, high_batch) = (Batch::new(1, 17), Batch::new(2, 1));
        // A LOW group of 16 members of 8 MiB each behind another: tens of
        // milliseconds of copying into pages touched for the first time.
        let (member, n) = (8 << 20, 17);
        let src: Vec<u8> = (0..member * n).map(|i| (i * 5 + i / 4096) as u8).collect();
        let mut dst = vec![0u8; member * n];
        let mut jobs = small_jobs(&src, &mut dst, member, &group_batch, |_| LOW).into_iter();
        let (mut head, _) = jobs.next().unwrap();
        head.then = jobs.map(|(job, _)| Member::from(job)).collect();
        let (high_src, mut high_dst) = ([9u8; 4096], [0u8; 4096]);
        let high_task = high_batch.add_tasks(1).unwrap().pop().unwrap();
        let high = direct_job(&high_src, &mut high_dst, high_task);
        high_arrives_during(&shm, head, high, &high_batch);
        assert_eq!(high_dst, high_src);
        assert!(
            group_batch.unfinished() > 0,
            "HIGH waited for the whole group"
        );
        group_batch
            .wait(Some(Duration::from_secs(60)), Duration::ZERO)
            .unwrap();
        assert!(dst == src, "the group resumed where it stopped");
        let rail = shm_rail(&stats);
        assert_eq!(rail.bytes, (member * n + 4096) as u64);
        assert_eq!(rail.slices, n as u64 + 1);
    }

    #[test]
    fn workers_exit_when_the_transport_drops_and_finish_what_was_queued() {
        let stats = TrafficStats::default();
        let shm = ShmTransport::new(2, false, 0, true, &stats, qos()).unwrap();
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
