//! Completion tracking: a task per request counts its outstanding parts; a batch counts its
//! unfinished tasks and wakes waiters when the count reaches zero.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::spin::YIELD_AFTER;

/// State of one request, or of a whole batch.
#[derive(Debug, Clone)]
pub enum Status {
    /// Some bytes are still on their way.
    Pending,
    /// Every byte is in place at its destination.
    Completed,
    /// The request failed; the error says why.
    Failed(Error),
}

impl Status {
    /// True for `Completed`.
    pub fn is_completed(&self) -> bool {
        matches!(self, Status::Completed)
    }
}

/// Requests finished by every batch of an engine (see [`crate::Engine::transfer_stats`]).
#[derive(Debug, Default)]
pub(crate) struct TransferCounters {
    completed: std::sync::atomic::AtomicU64,
    failed: std::sync::atomic::AtomicU64,
}

impl TransferCounters {
    /// Requests completed and failed so far.
    pub(crate) fn snapshot(&self) -> (u64, u64) {
        (
            self.completed.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// Run once when a batch next has no unfinished request (see [`Batch::when_idle`]).
pub(crate) type IdleHook = Box<dyn FnOnce() + Send>;

/// Where the answer finishing a task will arrive, readable by the thread waiting for it (a tcp
/// connection a small HIGH slice was written on directly). A waiter that reads its own answer
/// runs when the answer arrives, instead of after a transport thread has read it and then woken
/// it: on a host whose cores are busy moving bulk, each of those wake-ups is a wait for a core.
pub(crate) trait AnswerSource: Send + Sync {
    /// Reads answers on the calling thread until `task` has finished or `until` passes:
    /// between answers it sleeps until the socket is readable, or with `poll` looks again at
    /// once (a waiter with a core to spare). Returns false, leaving the rest to the transport's
    /// own thread, when this thread cannot read them (that thread is reading already, the
    /// connection died, or the task's slice is not in flight there) or `until` passed; the
    /// caller then waits as it would have.
    fn read_until_finished(&self, task: &Task, until: Option<Instant>, poll: bool) -> bool;
}

/// The last task of a batch whose answer a waiter can read itself, and where.
type DirectAnswer = (Weak<Task>, Weak<dyn AnswerSource>);

/// Shared by a batch and its tasks so the last finishing task can wake waiters.
pub(crate) struct BatchSignal {
    unfinished: AtomicUsize,
    /// Guards the waiters' check-then-wait, and holds the hooks to run when the batch next
    /// has nothing unfinished.
    lock: Mutex<Vec<IdleHook>>,
    cond: Condvar,
    /// Waiters asleep (or about to sleep) on `cond`, changed and read under `lock`: the last
    /// finishing task wakes them only when there are some (no futex call otherwise).
    sleepers: AtomicUsize,
    /// How long the transfers posted since the batch was last idle are expected to take, ns:
    /// their bytes over the rate their peer's usable rails are estimated at (see
    /// [`Task::expect`]). Cleared when nothing is unfinished.
    expected_ns: AtomicU64,
    /// The slices those transfers were cut into. Cleared with `expected_ns`.
    expected_slices: AtomicU64,
    /// The task whose one slice was last written directly by the submitting thread, and the
    /// connection its answer comes back on (see [`Task::answered_on`]).
    direct: Mutex<Option<DirectAnswer>>,
    counters: Arc<TransferCounters>,
}

impl BatchSignal {
    /// A signal with `unfinished` requests outstanding, counting finished ones in `counters`.
    fn new(unfinished: usize, counters: Arc<TransferCounters>) -> BatchSignal {
        BatchSignal {
            unfinished: AtomicUsize::new(unfinished),
            lock: Mutex::new(Vec::new()),
            cond: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            expected_ns: AtomicU64::new(0),
            expected_slices: AtomicU64::new(0),
            direct: Mutex::new(None),
            counters,
        }
    }

    /// Tasks standing for `completed` requests finished well and for `failed` requests
    /// failed: counted in the engine's counters, and taken off the batch's unfinished.
    fn report(&self, completed: u64, failed: u64) {
        let c = &self.counters;
        if failed > 0 {
            c.failed.fetch_add(failed, Ordering::Relaxed);
        }
        if completed > 0 {
            c.completed.fetch_add(completed, Ordering::Relaxed);
        }
        self.tasks_finished((completed + failed) as usize);
    }

    /// `requests` requests finished (a task's).
    fn tasks_finished(&self, requests: usize) {
        if self.unfinished.fetch_sub(requests, Ordering::AcqRel) == requests {
            self.expected_ns.store(0, Ordering::Relaxed);
            self.expected_slices.store(0, Ordering::Relaxed);
            // Taking the lock orders this notify after a waiter's check-then-wait.
            let hooks = {
                let mut hooks = self.lock.lock().expect("batch lock poisoned");
                if self.sleepers.load(Ordering::Relaxed) > 0 {
                    self.cond.notify_all();
                }
                std::mem::take(&mut *hooks)
            };
            // Run outside the lock: a hook may look at the batch.
            for hook in hooks {
                hook();
            }
        }
    }
}

/// Tasks a thread finished whose batch it has not told yet: a thread completing many small
/// requests of one batch in a row (a group of shm copies) tells the batch and the engine's
/// counters once for them all, instead of moving those shared cache lines between cores for
/// every request. Each task's own status changes at once; the batch's count of unfinished
/// requests (and so its waiters) hears at [`Finished::flush`], or when a task of another
/// batch finishes, or when this drops.
#[derive(Default)]
pub(crate) struct Finished {
    signal: Option<Arc<BatchSignal>>,
    completed: u64,
    failed: u64,
}

impl Finished {
    /// Records one part of `task` as done with `outcome`, as [`Task::part_done`] does, but
    /// holds back what the task's finishing tells its batch.
    pub(crate) fn part_done(&mut self, task: &Task, outcome: Result<()>) {
        let Some(failed) = task.part_finished(outcome) else {
            return;
        };
        if !self
            .signal
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(s, &task.signal))
        {
            self.flush();
            self.signal = Some(task.signal.clone());
        }
        let requests = u64::from(task.requests);
        if failed {
            self.failed += requests;
        } else {
            self.completed += requests;
        }
    }

    /// Tells the batch what was held back.
    pub(crate) fn flush(&mut self) {
        if let Some(signal) = &self.signal {
            if self.completed + self.failed > 0 {
                signal.report(self.completed, self.failed);
            }
        }
        (self.completed, self.failed) = (0, 0);
    }
}

impl Drop for Finished {
    fn drop(&mut self) {
        self.flush();
    }
}

/// One request in flight, or a run of adjacent requests moved as one (see
/// [`Batch::add_runs`]): finished when every part it was split into has reported, and then
/// every request it stands for is finished with its outcome.
pub(crate) struct Task {
    remaining: AtomicU32,
    failed: AtomicBool,
    error: OnceLock<Error>,
    signal: Arc<BatchSignal>,
    /// Requests this task stands for: 1, or the length of the run it moves. They share its
    /// outcome, so they share the task rather than each holding one of their own.
    requests: u32,
}

impl Task {
    /// Records one part as done (`Ok`) or failed; the first failure is the task's error.
    pub(crate) fn part_done(&self, outcome: Result<()>) {
        if let Some(failed) = self.part_finished(outcome) {
            let requests = u64::from(self.requests);
            if failed {
                self.signal.report(0, requests);
            } else {
                self.signal.report(requests, 0);
            }
        }
    }

    /// Records one part's outcome on the task itself (its status shows it at once); when it
    /// was the last part, whether the task failed, for the caller to tell its batch.
    fn part_finished(&self, outcome: Result<()>) -> Option<bool> {
        if let Err(e) = outcome {
            let _ = self.error.set(e);
            self.failed.store(true, Ordering::Release);
        }
        (self.remaining.fetch_sub(1, Ordering::AcqRel) == 1)
            .then(|| self.failed.load(Ordering::Acquire))
    }

    /// A task of no batch, for transfers nobody waits on (a probe of a rail): its one part
    /// finishing wakes no one and counts in no engine counter.
    pub(crate) fn detached() -> Arc<Task> {
        Arc::new(Task {
            remaining: AtomicU32::new(1),
            failed: AtomicBool::new(false),
            error: OnceLock::new(),
            signal: Arc::new(BatchSignal::new(1, Arc::default())),
            requests: 1,
        })
    }

    /// Adds parts while at least one part is still outstanding (so the task cannot have
    /// finished): a request is set up with one part and grows as its slices are dealt out, and
    /// a slice not yet posted may be cut in two.
    pub(crate) fn add_parts(&self, n: u32) {
        self.remaining.fetch_add(n, Ordering::AcqRel);
    }

    /// Counts `bytes` of this task, cut into `slices`, as posted to a peer whose usable rails
    /// are estimated at `bytes_per_sec` in all, toward how long its batch is expected to take
    /// (nothing when there is no estimate yet).
    pub(crate) fn expect(&self, bytes: u64, slices: u64, bytes_per_sec: f64) {
        if bytes_per_sec > 0.0 {
            let ns = (bytes as f64 / bytes_per_sec * 1e9).min(u64::MAX as f64) as u64;
            self.signal.expected_ns.fetch_add(ns, Ordering::Relaxed);
            self.signal
                .expected_slices
                .fetch_add(slices, Ordering::Relaxed);
        }
    }

    /// Notes that this task's one outstanding slice was written on `source`, whose answer a
    /// thread waiting for the batch may read itself ([`Batch::direct_answer`]).
    pub(crate) fn answered_on(self: &Arc<Self>, source: Weak<dyn AnswerSource>) {
        *self.signal.direct.lock().expect("batch lock poisoned") =
            Some((Arc::downgrade(self), source));
    }

    /// Whether every part has reported.
    pub(crate) fn is_finished(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    fn status(&self) -> Status {
        if self.failed.load(Ordering::Acquire) {
            if let Some(e) = self.error.get() {
                return Status::Failed(e.clone());
            }
        }
        if self.remaining.load(Ordering::Acquire) == 0 {
            Status::Completed
        } else {
            Status::Pending
        }
    }
}

/// A batch: up to `capacity` requests whose completion can be polled or awaited together.
pub(crate) struct Batch {
    pub(crate) id: u64,
    capacity: usize,
    tasks: Mutex<Vec<Arc<Task>>>,
    signal: Arc<BatchSignal>,
}

impl Batch {
    /// A batch counting its finished requests on its own (tests).
    #[cfg(test)]
    pub(crate) fn new(id: u64, capacity: usize) -> Self {
        Self::with_counters(id, capacity, Arc::default())
    }

    /// A batch whose finished requests count in `counters` (the engine's).
    pub(crate) fn with_counters(id: u64, capacity: usize, counters: Arc<TransferCounters>) -> Self {
        Batch {
            id,
            capacity,
            tasks: Mutex::new(Vec::with_capacity(capacity)),
            signal: Arc::new(BatchSignal::new(0, counters)),
        }
    }

    /// Creates `n` tasks, one per request, each holding one part, or fails if they do not fit.
    #[cfg(test)]
    pub(crate) fn add_tasks(&self, n: usize) -> Result<Vec<Arc<Task>>> {
        self.add_runs(&vec![1; n])
    }

    /// Creates one task for each run of requests (`runs`: how many requests each run moves,
    /// in submission order), each holding one part; every request of a run reports the run's
    /// status. Fails with `BatchFull`, creating nothing, when the requests do not fit.
    pub(crate) fn add_runs(&self, runs: &[u32]) -> Result<Vec<Arc<Task>>> {
        let n: usize = runs.iter().map(|&k| k as usize).sum();
        let mut tasks = self.tasks.lock().expect("batch poisoned");
        if tasks.len() + n > self.capacity {
            return Err(Error::BatchFull {
                batch: self.id,
                capacity: self.capacity,
                used: tasks.len(),
                requested: n,
            });
        }
        self.signal.unfinished.fetch_add(n, Ordering::AcqRel);
        let mut new = Vec::with_capacity(runs.len());
        for &requests in runs {
            let task = Arc::new(Task {
                remaining: AtomicU32::new(1),
                failed: AtomicBool::new(false),
                error: OnceLock::new(),
                signal: self.signal.clone(),
                requests,
            });
            for _ in 0..requests {
                tasks.push(task.clone());
            }
            new.push(task);
        }
        Ok(new)
    }

    /// Status of request `index` (in submission order).
    pub(crate) fn status(&self, index: usize) -> Result<Status> {
        let tasks = self.tasks.lock().expect("batch poisoned");
        let task = tasks.get(index).ok_or_else(|| {
            Error::invalid(
                "index",
                format!(
                    "batch {} holds {} requests, asked for #{index}",
                    self.id,
                    tasks.len()
                ),
            )
        })?;
        Ok(task.status())
    }

    /// `Failed` with the first failure if any request failed, else `Pending` while any runs.
    pub(crate) fn overall_status(&self) -> Status {
        let tasks = self.tasks.lock().expect("batch poisoned");
        let mut pending = false;
        for task in tasks.iter() {
            match task.status() {
                Status::Failed(e) => return Status::Failed(e),
                Status::Pending => pending = true,
                Status::Completed => {}
            }
        }
        if pending {
            Status::Pending
        } else {
            Status::Completed
        }
    }

    pub(crate) fn unfinished(&self) -> usize {
        self.signal.unfinished.load(Ordering::Acquire)
    }

    /// When the batch's one unfinished request is a task whose one outstanding slice was
    /// written directly on a connection ([`Task::answered_on`]): that task and where its
    /// answer arrives, for the waiting thread to read it itself.
    pub(crate) fn direct_answer(&self) -> Option<(Arc<Task>, Arc<dyn AnswerSource>)> {
        if self.unfinished() != 1 {
            return None;
        }
        let (task, source) = self
            .signal
            .direct
            .lock()
            .expect("batch lock poisoned")
            .clone()?;
        let task = task.upgrade()?;
        (task.remaining.load(Ordering::Acquire) == 1).then_some(())?;
        Some((task, source.upgrade()?))
    }

    /// How long what is posted of the batch is expected to take, and in how many slices (see
    /// [`Task::expect`]); zero when nothing is unfinished or no peer had an estimate.
    pub(crate) fn expected(&self) -> (Duration, u64) {
        (
            Duration::from_nanos(self.signal.expected_ns.load(Ordering::Relaxed)),
            self.signal.expected_slices.load(Ordering::Relaxed),
        )
    }

    /// Runs `hook` once the batch has no unfinished request: at once, on this thread, when it
    /// has none now; else on the thread that finishes its last one (a transport's thread, so
    /// the hook must be quick and must not block).
    pub(crate) fn when_idle(&self, hook: IdleHook) {
        {
            let mut hooks = self.signal.lock.lock().expect("batch lock poisoned");
            // Checked under the lock the last finishing task takes, so the hook is either
            // taken by it or run here, never lost.
            if self.unfinished() > 0 {
                hooks.push(hook);
                return;
            }
        }
        hook();
    }

    /// Blocks until every request finished or `timeout` passes, polling for the first `spin`
    /// of that time (yielding the core now and then after [`YIELD_AFTER`]) before
    /// sleeping.
    pub(crate) fn wait(&self, timeout: Option<Duration>, spin: Duration) -> Result<()> {
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        if !spin.is_zero() {
            let spin_until = deadline.map_or(start + spin, |d| d.min(start + spin));
            // Reading the clock every poll would cost more than the poll.
            let mut polls = 0u32;
            let yield_from = start + YIELD_AFTER;
            while self.unfinished() > 0 {
                std::hint::spin_loop();
                polls = polls.wrapping_add(1);
                if polls.is_multiple_of(64) {
                    let now = Instant::now();
                    if now >= spin_until {
                        break;
                    }
                    if now >= yield_from {
                        // A thread that would finish the batch (a reader woken on this core)
                        // gets to run; on an idle core this returns at once.
                        std::thread::yield_now();
                    }
                }
            }
        }
        let mut guard = self.signal.lock.lock().expect("batch lock poisoned");
        // Counted under the lock the last finishing task takes before it looks: either it sees
        // this waiter and wakes it, or this waiter sees the batch finished.
        let sleepers = &self.signal.sleepers;
        sleepers.fetch_add(1, Ordering::Relaxed);
        while self.unfinished() > 0 {
            match deadline {
                None => guard = self.signal.cond.wait(guard).expect("batch lock poisoned"),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        sleepers.fetch_sub(1, Ordering::Relaxed);
                        let total = self.tasks.lock().expect("batch poisoned").len();
                        return Err(Error::WaitTimeout {
                            pending: self.unfinished(),
                            total,
                        });
                    }
                    guard = self
                        .signal
                        .cond
                        .wait_timeout(guard, d - now)
                        .expect("batch lock poisoned")
                        .0;
                }
            }
        }
        sleepers.fetch_sub(1, Ordering::Relaxed);
        drop(guard);
        match self.overall_status() {
            Status::Failed(e) => Err(e),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_hook_runs_once_when_the_last_request_finishes_or_at_once_when_idle() {
        use std::sync::atomic::AtomicU32;
        let b = Batch::new(1, 2);
        let runs = Arc::new(AtomicU32::new(0));
        let hook = |runs: &Arc<AtomicU32>| -> IdleHook {
            let runs = runs.clone();
            Box::new(move || {
                runs.fetch_add(1, Ordering::SeqCst);
            })
        };
        let t = b.add_tasks(2).unwrap();
        b.when_idle(hook(&runs));
        t[0].part_done(Ok(()));
        assert_eq!(runs.load(Ordering::SeqCst), 0, "one request still runs");
        t[1].part_done(Err(Error::invalid("x", "failed")));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Idle now: a hook runs at once, and the first never again.
        b.when_idle(hook(&runs));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        // Hooks from many threads racing the last completion each run exactly once.
        for _ in 0..200 {
            let b = Arc::new(Batch::new(1, 1));
            let t = b.add_tasks(1).unwrap();
            let runs = Arc::new(AtomicU32::new(0));
            let (b2, r2) = (b.clone(), runs.clone());
            let registrar = std::thread::spawn(move || b2.when_idle(hook(&r2)));
            t[0].part_done(Ok(()));
            registrar.join().unwrap();
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        }
    }

    #[test]
    fn finished_requests_count_once_each_by_outcome() {
        let counters = Arc::new(TransferCounters::default());
        let b = Batch::with_counters(1, 3, counters.clone());
        let t = b.add_tasks(3).unwrap();
        t[0].add_parts(2);
        t[0].part_done(Ok(()));
        t[0].part_done(Err(Error::UnknownSegment(9)));
        assert_eq!(
            counters.snapshot(),
            (0, 0),
            "a task with a part left is not finished"
        );
        t[0].part_done(Ok(()));
        t[1].part_done(Ok(()));
        assert_eq!(counters.snapshot(), (1, 1));
        t[2].part_done(Ok(()));
        assert_eq!(counters.snapshot(), (2, 1));
    }

    #[test]
    fn every_request_of_a_run_reports_the_runs_outcome_and_counts_once() {
        let counters = Arc::new(TransferCounters::default());
        let b = Batch::with_counters(1, 6, counters.clone());
        let t = b.add_runs(&[3, 1, 2]).unwrap();
        assert_eq!(t.len(), 3);
        assert!(matches!(
            b.add_runs(&[1]),
            Err(Error::BatchFull {
                used: 6,
                requested: 1,
                ..
            })
        ));
        assert_eq!(b.unfinished(), 6);
        t[0].part_done(Ok(()));
        assert!((0..3).all(|i| b.status(i).unwrap().is_completed()));
        assert!(matches!(b.status(3).unwrap(), Status::Pending));
        assert_eq!(counters.snapshot(), (3, 0));
        assert_eq!(b.unfinished(), 3);
        t[2].part_done(Err(Error::UnknownSegment(4)));
        assert!((4..6).all(|i| matches!(
            b.status(i).unwrap(),
            Status::Failed(Error::UnknownSegment(4))
        )));
        assert_eq!(counters.snapshot(), (3, 2));
        t[1].part_done(Ok(()));
        assert_eq!(b.unfinished(), 0);
        assert!(matches!(
            b.wait(None, Duration::ZERO),
            Err(Error::UnknownSegment(4))
        ));
    }

    #[test]
    fn tasks_complete_and_fail() {
        let b = Batch::new(7, 3);
        let t = b.add_tasks(2).unwrap();
        assert!(matches!(
            b.add_tasks(2),
            Err(Error::BatchFull { used: 2, .. })
        ));
        t[0].add_parts(1);
        t[0].part_done(Ok(()));
        assert!(matches!(b.status(0).unwrap(), Status::Pending));
        t[0].part_done(Ok(()));
        assert!(b.status(0).unwrap().is_completed());
        assert!(matches!(b.overall_status(), Status::Pending));
        assert!(matches!(
            b.wait(Some(Duration::from_millis(10)), Duration::ZERO),
            Err(Error::WaitTimeout {
                pending: 1,
                total: 2
            })
        ));
        t[1].part_done(Err(Error::UnknownSegment(3)));
        assert!(matches!(
            b.status(1).unwrap(),
            Status::Failed(Error::UnknownSegment(3))
        ));
        assert!(matches!(
            b.wait(None, Duration::ZERO),
            Err(Error::UnknownSegment(3))
        ));
        assert!(b.status(5).is_err());
    }

    #[test]
    fn a_batch_expects_what_its_transfers_take_until_it_is_idle_again() {
        let b = Batch::new(1, 3);
        let t = b.add_tasks(2).unwrap();
        // 1 MiB and 3 MiB at 4 GiB/s: 1/4096 s and 3/4096 s; a peer with no estimate adds nothing.
        t[0].expect(1 << 20, 4, (4u64 << 30) as f64);
        t[1].expect(3 << 20, 12, (4u64 << 30) as f64);
        t[1].expect(1 << 30, 1, 0.0);
        let want = Duration::from_nanos(1_000_000_000 / 1024);
        let (time, slices) = b.expected();
        assert!(time.abs_diff(want) < Duration::from_micros(1), "{time:?}");
        assert_eq!(slices, 16);
        t[0].part_done(Ok(()));
        assert!(b.expected().0 > Duration::ZERO, "one request still runs");
        t[1].part_done(Ok(()));
        assert_eq!(b.expected(), (Duration::ZERO, 0), "idle: nothing expected");
        // The next submission into the same batch starts from nothing.
        let t = b.add_tasks(1).unwrap();
        t[0].expect(4096, 1, (4u64 << 30) as f64);
        assert_eq!(b.expected().1, 1);
        assert!(b.expected().0 < Duration::from_micros(2));
    }

    #[test]
    fn finished_tasks_tell_their_batch_at_flush_or_when_another_batchs_task_finishes() {
        let counters = Arc::new(TransferCounters::default());
        let a = Batch::with_counters(1, 3, counters.clone());
        let b = Batch::with_counters(2, 1, counters.clone());
        let (ta, tb) = (a.add_tasks(3).unwrap(), b.add_tasks(1).unwrap());
        let mut finished = Finished::default();
        finished.part_done(&ta[0], Ok(()));
        let gone = || Error::TransportUnavailable {
            transport: "shm",
            reason: "test".into(),
        };
        finished.part_done(&ta[1], Err(gone()));
        // Each task's status shows at once; the batch has not heard yet.
        assert!(matches!(a.status(0).unwrap(), Status::Completed));
        assert!(matches!(a.status(1).unwrap(), Status::Failed(_)));
        assert_eq!(a.unfinished(), 3);
        assert_eq!(counters.snapshot(), (0, 0));
        finished.flush();
        assert_eq!(a.unfinished(), 1);
        assert_eq!(counters.snapshot(), (1, 1));
        // A task of another batch: what was held back for the first is told first.
        finished.part_done(&ta[2], Ok(()));
        finished.part_done(&tb[0], Ok(()));
        assert_eq!(a.unfinished(), 0);
        assert_eq!(b.unfinished(), 1);
        // Done, with its one failure.
        let waited = a.wait(Some(Duration::from_secs(1)), Duration::ZERO);
        assert!(
            matches!(waited, Err(Error::TransportUnavailable { .. })),
            "{waited:?}"
        );
        drop(finished);
        assert_eq!(b.unfinished(), 0);
        assert_eq!(counters.snapshot(), (3, 1));
    }

    #[test]
    fn wait_wakes_on_completion_from_another_thread() {
        let b = Arc::new(Batch::new(1, 1));
        let t = b.add_tasks(1).unwrap().remove(0);
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            t.part_done(Ok(()));
        });
        b.wait(Some(Duration::from_secs(5)), Duration::ZERO)
            .unwrap();
        h.join().unwrap();
    }

    #[test]
    fn wait_sleeps_after_its_spin_and_every_completion_from_another_thread_wakes_it() {
        // Completions racing the end of the spin and the fall asleep, many times over: a
        // wakeup lost would hang a wait (caught by its deadline, 10 s).
        for round in 0..300u64 {
            let b = Arc::new(Batch::new(round, 2));
            let t = b.add_tasks(2).unwrap();
            let h = std::thread::spawn(move || {
                for (i, t) in t.into_iter().enumerate() {
                    let pause = Duration::from_micros((round * 37 + i as u64 * 101) % 400);
                    std::thread::sleep(pause);
                    t.part_done(Ok(()));
                }
            });
            b.wait(
                Some(Duration::from_secs(10)),
                Duration::from_micros(round % 100),
            )
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
            h.join().unwrap();
            assert_eq!(b.signal.sleepers.load(Ordering::Relaxed), 0);
        }
        // Long after the spin ended: the sleeping half wakes on the completion.
        let b = Arc::new(Batch::new(1, 1));
        let t = b.add_tasks(1).unwrap().remove(0);
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            t.part_done(Ok(()));
        });
        let start = Instant::now();
        b.wait(None, Duration::from_micros(100)).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(50));
        h.join().unwrap();
        // A wait that timed out leaves no sleeper counted.
        let b = Batch::new(2, 1);
        let _t = b.add_tasks(1).unwrap();
        assert!(b
            .wait(Some(Duration::from_millis(5)), Duration::ZERO)
            .is_err());
        assert_eq!(b.signal.sleepers.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn polling_wait_sees_completion_and_keeps_its_deadline() {
        // Completion during the polling phase.
        let b = Arc::new(Batch::new(1, 1));
        let t = b.add_tasks(1).unwrap().remove(0);
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            t.part_done(Ok(()));
        });
        b.wait(Some(Duration::from_secs(5)), Duration::from_secs(1))
            .unwrap();
        h.join().unwrap();
        // Completion after polling gave up: the sleeping half still wakes.
        let b = Arc::new(Batch::new(2, 1));
        let t = b.add_tasks(1).unwrap().remove(0);
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            t.part_done(Ok(()));
        });
        b.wait(None, Duration::from_millis(1)).unwrap();
        h.join().unwrap();
        // A deadline shorter than the polling time ends the wait on time.
        let b = Batch::new(3, 1);
        let _t = b.add_tasks(1).unwrap();
        let start = Instant::now();
        assert!(matches!(
            b.wait(Some(Duration::from_millis(20)), Duration::from_secs(10)),
            Err(Error::WaitTimeout { pending: 1, .. })
        ));
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
