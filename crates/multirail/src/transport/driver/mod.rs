//! The peer driver: everything a peer reached over paths does around its dispatcher
//! (`multirail_policy::dispatch`), written once for every such transport.
//!
//! The dispatcher decides (windows, HIGH/bulk allowances, retries, the silence deadline, the
//! stalled-path rule, rail health); the driver does what it decides: it posts requests (cut
//! into slices) with one retry on a fresh peer when the verdict came in between, settles
//! completions and failures into the requests' tasks, arms the engine's timer table on one
//! clock and runs what falls due, pumps dealt slices to their paths, reconnects paths on
//! threads of their own, and closes. A transport supplies only its [`Link`]: how a request
//! becomes slices, how dealt slices reach a path, and how a path is dropped, probed, remade,
//! checked and closed. tcp (connections) and rdma (queue pairs) are two links; another
//! transport is a third, not a copy of this file.
//!
//! [`Peers`] (in `peers`) is the transport-wide half: one driver per peer, made on first use by one
//! connecting thread while other submitters wait for its outcome, and remade once given up on.

mod peers;

pub(crate) use peers::Peers;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use multirail_policy::dispatch::{
    Cause, DispatchConfig, Dispatcher, Event, Failed, PathId, Payload, Post, SliceId, Verdict,
};
use multirail_policy::health::RailState;
use multirail_policy::qos::Priority;
use multirail_policy::slicing::SlicePlan;

use crate::batch::Task;
use crate::error::{Error, Result};
use crate::memory::Location;
use crate::peer::Peer;
use crate::qos::Qos;
use crate::rails::RailScheduler;
use crate::transport::rails_view::{EngineRails, Located};
use crate::transport::{Opcode, Plans, Prepared};
use crate::upkeep::{TimerKey, Timers};

/// One slice of a request on its way to a peer. `K` is what the transport presents to reach
/// the target memory: the buffer's key over tcp, the local registration and the remote keys
/// over RDMA.
pub(crate) struct OutSlice<K> {
    pub op: Opcode,
    /// Local address (source of a write, destination of a read).
    pub local: usize,
    /// Address in the target's memory.
    pub remote: u64,
    pub len: u32,
    pub key: K,
    pub task: Arc<Task>,
    /// What the dispatcher calls it while it is posted (set when it is dealt).
    pub id: SliceId,
    /// Where the local memory lives, which ranks the rails for it.
    pub location: Location,
    /// The level it travels at: its request's, or the one it was promoted to.
    pub priority: Priority,
    /// Why its last path failed, if one did: what it fails with when it cannot be retried.
    pub last_error: Option<Error>,
    /// A probe of its rail ([`Payload::probe`]): a payload of zeros the target drops, for no
    /// request (its task is detached).
    pub probe: bool,
}

/// What a transport presents for a probe ([`Payload::probe`]), if it has probes.
pub(crate) trait ProbeKey: Clone {
    /// The key a probe carries, or `None` when the transport has no probes (its paths on
    /// probation are then tried with a page of a request).
    fn for_probe(&self) -> Option<Self>;
}

/// A probe's payload: what a probe carries is never looked at.
static PROBE_PAYLOAD: [u8; multirail_policy::dispatch::PROBE_LEN as usize] =
    [0; multirail_policy::dispatch::PROBE_LEN as usize];

impl<K: Clone> OutSlice<K> {
    /// The `len` bytes of `req` from `offset`, presenting `key`.
    pub(crate) fn of(req: &Prepared, offset: u64, len: u64, key: K) -> OutSlice<K> {
        OutSlice {
            op: req.op,
            local: req.local + offset as usize,
            remote: req.remote + offset,
            len: len as u32,
            key,
            task: req.task.clone(),
            id: SliceId { path: 0, seq: 0 },
            location: req.location,
            priority: req.priority,
            last_error: None,
            probe: false,
        }
    }
}

impl<K: ProbeKey> Payload for OutSlice<K> {
    fn len(&self) -> u64 {
        u64::from(self.len)
    }

    /// Cuts the slice after `at` bytes and returns the rest, a slice of the same request that
    /// counts as one more part of it, not yet charged to any rail. `at` must lie inside the
    /// slice and the slice must not be posted yet, so its task cannot have finished.
    fn split_off(&mut self, at: u64) -> OutSlice<K> {
        debug_assert!(
            at > 0 && at < u64::from(self.len),
            "split {at} outside a {}-byte slice",
            self.len
        );
        let at = at as u32;
        self.task.add_parts(1);
        let rest = OutSlice {
            op: self.op,
            local: self.local + at as usize,
            remote: self.remote + u64::from(at),
            len: self.len - at,
            key: self.key.clone(),
            task: self.task.clone(),
            id: self.id,
            location: self.location,
            priority: self.priority,
            last_error: None,
            probe: self.probe,
        };
        self.len = at;
        rest
    }

    fn has_probes(&self) -> bool {
        self.key.for_probe().is_some()
    }

    fn probe(&self, len: u64) -> Option<OutSlice<K>> {
        let key = self.key.for_probe()?;
        let len = len.min(PROBE_PAYLOAD.len() as u64) as u32;
        Some(OutSlice {
            op: Opcode::Write,
            local: PROBE_PAYLOAD.as_ptr() as usize,
            remote: 0,
            len,
            key,
            task: Task::detached(),
            id: self.id,
            location: self.location,
            priority: self.priority,
            last_error: None,
            probe: true,
        })
    }

    fn is_probe(&self) -> bool {
        self.probe
    }
}

impl<K> Located for OutSlice<K> {
    fn location(&self) -> Location {
        self.location
    }
}

/// What handing dealt slices to their paths left to the driver.
pub(crate) struct Handed<K> {
    /// Slices a path could not take: dealt again, elsewhere if their path is gone.
    pub refused: Vec<Post<OutSlice<K>>>,
    /// Paths found with fewer live connections than the dispatcher believes: reported to it
    /// before the refused slices are dealt again.
    pub changed: Vec<PathId>,
    /// Paths that failed while posting, with the slices they took down and why.
    pub lost: Vec<(PathId, Vec<OutSlice<K>>, Error)>,
}

impl<K> Default for Handed<K> {
    fn default() -> Self {
        Handed {
            refused: Vec::new(),
            changed: Vec::new(),
            lost: Vec::new(),
        }
    }
}

/// Offers a dealt slice to `send`, which takes it or hands it back; a slice handed back comes
/// back as the same post, for the driver to deal again.
// The post travels back by value, as the slice does: boxing it would allocate per refusal on
// the data path.
#[allow(clippy::result_large_err)]
pub(crate) fn offer<K>(
    post: Post<OutSlice<K>>,
    send: impl FnOnce(OutSlice<K>) -> std::result::Result<(), OutSlice<K>>,
) -> std::result::Result<(), Post<OutSlice<K>>> {
    let Post {
        id,
        item,
        path,
        rail,
        priority,
        connection,
    } = post;
    send(item).map_err(|item| Post {
        id,
        item,
        path,
        rail,
        priority,
        connection,
    })
}

/// What a due probe of a paused path finds.
pub(crate) enum ProbeNeed {
    /// The path's connections survived the pause: it rejoins as it is.
    Whole,
    /// It must be remade (on a reconnect thread), which is the probe.
    Remake,
    /// Its link is down: the probe fails without trying.
    Unreachable,
}

/// What a transport supplies for one peer: its paths and how slices travel on them. Every
/// method may call back into the driver (handing slices back, reporting paths), and none is
/// called with the dispatcher's lock held.
pub(crate) trait Link: Send + Sync + Sized + 'static {
    /// What a slice presents to reach the target memory.
    type Key: ProbeKey + Send + Sync + 'static;

    /// How errors and logs name this transport's paths ("rail", "RDMA path").
    const PATH: &'static str;

    /// Appends the slices of `req` per `plan` to `out` (one vector for a whole batch: a vector
    /// per request cost an allocation each), or leaves `out` as it was and says why this
    /// transport cannot carry it (the request fails with that).
    fn slices(
        &self,
        req: &Prepared,
        plan: &SlicePlan,
        out: &mut Vec<OutSlice<Self::Key>>,
    ) -> Result<()>;

    /// How long a slice may keep the peer's fastest usable rail busy: the plan's slices grow
    /// toward it (see [`SlicePlan::grown_for`]). 0, the default, keeps the plan's slices.
    fn slice_time_ns(&self) -> u64 {
        0
    }

    /// Gives each dealt slice to its path; says what could not be given.
    fn hand_over(
        &self,
        driver: &Driver<Self>,
        out: &mut Vec<Post<OutSlice<Self::Key>>>,
    ) -> Handed<Self::Key>;

    /// Live connections of path `p` (electing a new reserved one if its was lost).
    fn live(&self, p: PathId) -> usize;

    /// A name for path `p` in logs.
    fn path_name(&self, p: PathId) -> String;

    /// Whether the local end of path `p` says its link is down.
    fn link_down(&self, p: PathId) -> bool;

    /// Closes path `p` with `err`: its slices are handed back to the driver
    /// ([`Driver::give_back`]) or come back through the transport's own callbacks.
    fn drop_path(&self, driver: &Driver<Self>, p: PathId, err: &Error);

    /// Path `p` failed while carrying slices (`err`): closes what remains of it, so it is remade
    /// whole. The slices it still held are handed back.
    fn fail_path(&self, driver: &Driver<Self>, p: PathId, err: &Error) {
        self.drop_path(driver, p, err);
    }

    /// What a due probe of path `p` finds.
    fn probe(&self, p: PathId) -> ProbeNeed;

    /// Whether path `p` lost connections the link check should remake.
    fn needs_remake(&self, p: PathId) -> bool;

    /// Remakes path `p` (called on a reconnect thread; may wait `connect_timeout_ms`). Returns
    /// whether it is whole again.
    fn remake(&self, driver: &Driver<Self>, p: PathId) -> bool;

    /// Runs before each link check (e.g. reads what the target said unprompted).
    fn before_link_check(&self, _driver: &Driver<Self>) {}

    /// Slices handed back to the dispatcher, or failed, after being counted in flight.
    fn returned(&self, _slices: usize) {}

    /// Closes every path, failing what they hold with `err`.
    fn close(&self, driver: &Driver<Self>, err: &Error);
}

/// What every driver of a transport shares: the engine's rail scheduler (for this
/// transport's rails), QoS and timer table, and the peer's timeout.
#[derive(Clone)]
pub(crate) struct DriverEnv {
    pub scheduler: Arc<RailScheduler>,
    pub qos: Arc<Qos>,
    pub timers: Arc<Timers>,
    pub timeout: Duration,
}

/// One peer reached over `L`'s paths, driven by its dispatcher.
pub(crate) struct Driver<L: Link> {
    pub(crate) name: String,
    /// The `Peer::incarnation` this driver was made for: a segment followed to a new process
    /// (even on the same address) is a later one.
    pub(crate) incarnation: u64,
    timer: TimerKey,
    /// Local rail (scheduler index) of each path.
    path_rails: Vec<usize>,
    dispatch: Mutex<Dispatcher<OutSlice<L::Key>>>,
    pub(crate) env: DriverEnv,
    pub(crate) link: L,
    me: Weak<Driver<L>>,
    /// Closed by the engine: nothing more is posted, and queued slices fail.
    closed: AtomicBool,
    /// Found silent: the dispatcher's verdict, mirrored for lock-free checks.
    silent: AtomicBool,
    /// The deadline last given to the timer table (scheduler ns; 0 = none), so an earlier one
    /// is registered and a later one is left for the timer to find.
    armed_ns: AtomicU64,
    /// Why the last path or connection was lost: what queued slices fail with once every path
    /// is down (a timeout stays a timeout).
    last_loss: Mutex<Option<Error>>,
    /// The peer's flag for a refused key (`Peer::keys_refused`): set here when the peer
    /// refuses a slice, so the engine fetches its descriptor again before the next request.
    keys_refused: Arc<AtomicBool>,
    /// A remake of the path is under way on its own thread.
    remaking: Vec<AtomicBool>,
    /// The link check found the path's link down and has not seen it up since.
    link_was_down: Vec<AtomicBool>,
    /// Reused by `pump` so dealing allocates nothing; a pump running meanwhile on another
    /// thread (or nested in this one: a connection dying during a handoff) finds it taken and
    /// uses a fresh one.
    scratch: Mutex<Vec<Post<OutSlice<L::Key>>>>,
}

impl<L: Link> Driver<L> {
    /// A driver for `peer` over `link`'s paths, whose local rails are `path_rails`; no path
    /// is usable until the link reports it ([`Driver::refresh_path`]).
    pub(crate) fn new(
        peer: &Peer,
        timer: TimerKey,
        config: DispatchConfig,
        path_rails: Vec<usize>,
        env: &DriverEnv,
        link: L,
    ) -> Arc<Driver<L>> {
        Arc::new_cyclic(|me| Driver {
            name: peer.name.clone(),
            incarnation: peer.incarnation,
            timer,
            dispatch: Mutex::new(Dispatcher::new(config, &path_rails)),
            remaking: path_rails.iter().map(|_| AtomicBool::new(false)).collect(),
            link_was_down: path_rails.iter().map(|_| AtomicBool::new(false)).collect(),
            path_rails,
            env: env.clone(),
            link,
            me: me.clone(),
            closed: AtomicBool::new(false),
            silent: AtomicBool::new(false),
            armed_ns: AtomicU64::new(0),
            last_loss: Mutex::new(None),
            keys_refused: peer.keys_refused(),
            scratch: Mutex::new(Vec::new()),
        })
    }

    /// Has the engine fetch the peer's descriptor again before its next request: the peer
    /// closed a connection, and the process answering on its address next may be another one,
    /// whose keys the cached descriptor does not have. Not for connections this end dropped:
    /// the lookup goes to the segment's control address, which may sit on the very rail whose
    /// link went down.
    pub(crate) fn recheck_descriptor(&self) {
        self.keys_refused.store(true, Ordering::Relaxed);
    }

    /// This driver, weakly: what connections and completion pollers report to.
    pub(crate) fn weak(&self) -> Weak<Driver<L>> {
        self.me.clone()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Dispatcher<OutSlice<L::Key>>> {
        self.dispatch.lock().expect("peer poisoned")
    }

    fn rails(&self, now: Instant) -> EngineRails<'_> {
        EngineRails::new(&self.env.scheduler, &self.env.qos, now)
    }

    /// `now` on the scheduler's clock, which the dispatcher runs on.
    pub(crate) fn ns(&self, now: Instant) -> u64 {
        self.env.scheduler.ns(now)
    }

    pub(crate) fn now_ns(&self) -> u64 {
        self.env.scheduler.now_ns()
    }

    /// The number of paths.
    pub(crate) fn paths(&self) -> usize {
        self.path_rails.len()
    }

    /// Closed, or found silent: nothing new goes here.
    pub(crate) fn given_up(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.silent.load(Ordering::Acquire)
    }

    /// True when no path can carry slices and none is coming back soon, or the peer was
    /// closed or went silent (a fresh driver then gives new requests their own full timeout).
    pub(crate) fn is_dead(&self) -> bool {
        self.given_up() || self.lock().is_dead()
    }

    /// Slices in flight or queued.
    pub(crate) fn is_busy(&self) -> bool {
        self.lock().has_outstanding()
    }

    /// The health of each path: its local rail and state.
    pub(crate) fn health(&self) -> Vec<(usize, RailState)> {
        let d = self.lock();
        (0..self.paths())
            .map(|p| (self.path_rails[p], d.health_state(p)))
            .collect()
    }

    pub(crate) fn timeout_error(&self) -> Error {
        Error::Timeout {
            peer: self.name.clone(),
            timeout_ms: self.env.timeout.as_millis() as u64,
            detail: "",
        }
    }

    pub(crate) fn down_error(&self) -> Error {
        Error::PeerDisconnected {
            peer: self.name.clone(),
            reason: format!("every {} to it is down", L::PATH),
        }
    }

    /// Records why a path or connection was lost.
    pub(crate) fn set_last_loss(&self, err: &Error) {
        *self.last_loss.lock().expect("peer poisoned") = Some(err.clone());
    }

    /// Queues the slices of several requests under one lock and deals out what the paths'
    /// windows allow, pumping once, so a batch of many small requests pays for dealing once
    /// rather than once per request. Hands back the requests untouched, in order, when this
    /// peer is dead or was found silent, for the caller to post on a fresh driver.
    pub(crate) fn post_many(&self, reqs: Vec<Prepared>, plans: &Plans) -> Vec<Prepared> {
        if self.is_dead() {
            return reqs;
        }
        let slice_ns = self.link.slice_time_ns();
        let fastest = if slice_ns > 0 {
            self.lock().fastest_usable_bandwidth()
        } else {
            0.0
        };
        // Every request's slices in one vector, in order; each request knows how many are its.
        let mut slices = Vec::with_capacity(reqs.len());
        let mut sliced = Vec::with_capacity(reqs.len());
        for req in reqs {
            let plan = plans.of(req.op).grown_for(fastest, slice_ns);
            let before = slices.len();
            match self.link.slices(&req, &plan, &mut slices) {
                Ok(()) => {
                    let count = slices.len() - before;
                    sliced.push((req, count));
                }
                Err(e) => req.fail(e),
            }
        }
        let now_ns = self.now_ns();
        {
            let mut d = self.lock();
            if d.is_silent() || d.is_closed() {
                return sliced.into_iter().map(|(req, _)| req).collect();
            }
            // How long the batch will take tells its waiter whether to poll or sleep.
            let rate = d.usable_bandwidth();
            let mut slices = slices.into_iter();
            for (req, count) in sliced {
                req.task.add_parts(count as u32);
                req.task.expect(req.len, count as u64, rate);
                d.on_submit(now_ns, req.priority, slices.by_ref().take(count));
            }
            self.report_depths(&mut d);
            self.arm(&mut d);
        }
        self.pump();
        Vec::new()
    }

    /// Brings the engine-wide queue depths up to date with this peer's queues.
    fn report_depths(&self, d: &mut Dispatcher<OutSlice<L::Key>>) {
        if let Some((old, new)) = d.take_depth_change() {
            self.env.qos.depths_changed(old, new);
        }
    }

    /// Registers the dispatcher's next deadline with the engine's timer table when it is
    /// earlier than the one registered. A later one is left alone: the timer fires early,
    /// finds nothing due, and registers the real one then. The dispatcher runs on the rail
    /// scheduler's clock and the table on its own: the deadline is converted through the
    /// instant it stands for.
    pub(crate) fn arm(&self, d: &mut Dispatcher<OutSlice<L::Key>>) {
        let Some(at) = d.poll_timeout() else {
            return;
        };
        let armed = self.armed_ns.load(Ordering::Acquire);
        if armed == 0 || at < armed {
            self.armed_ns.store(at.max(1), Ordering::Release);
            let when = self.env.scheduler.epoch() + Duration::from_nanos(at);
            self.env.timers.arm(self.timer, self.env.timers.ns(when));
        }
    }

    /// Fails what the dispatcher gave up on, with the error each verdict means.
    pub(crate) fn settle(&self, d: &mut Dispatcher<OutSlice<L::Key>>) {
        while let Some(Failed { item, verdict, .. }) = d.poll_failed() {
            let err = match verdict {
                Verdict::Timeout => self.timeout_error(),
                Verdict::Failed(_) => item.last_error.clone().unwrap_or_else(|| self.down_error()),
                Verdict::RailsDown if self.closed.load(Ordering::Acquire) => {
                    // Closed on purpose (the engine shut down, the segment moved): that is
                    // the reason, not the paths it took down with it.
                    self.last_loss
                        .lock()
                        .expect("peer poisoned")
                        .clone()
                        .unwrap_or_else(|| self.down_error())
                }
                Verdict::RailsDown => {
                    // Say why, from the slice's own failure or the peer's last lost path.
                    // Paths lost to timeouts mean the peer went silent.
                    let last = item
                        .last_error
                        .clone()
                        .or_else(|| self.last_loss.lock().expect("peer poisoned").clone());
                    match last {
                        Some(e @ Error::Timeout { .. }) => e,
                        Some(e) => Error::PeerDisconnected {
                            peer: self.name.clone(),
                            reason: format!("every {} to it is down (last error: {e})", L::PATH),
                        },
                        None => self.down_error(),
                    }
                }
            };
            item.task.part_done(Err(err));
        }
        self.report_depths(d);
    }

    /// Deals queued slices while the dispatcher allows, then hands them to their paths outside
    /// the lock. Slices a path refuses go back to the dispatcher and are dealt again.
    pub(crate) fn pump(&self) {
        let mut out = self
            .scratch
            .try_lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default();
        loop {
            {
                let now = Instant::now();
                let mut rails = self.rails(now);
                let now_ns = self.ns(now);
                let mut d = self.lock();
                while let Some(post) = d.poll_post(now_ns, &mut rails) {
                    out.push(post);
                }
                if !out.is_empty() {
                    // Slices just posted on an idle path bring its stall deadline (see
                    // `Dispatcher::on_timeout`) closer than what is armed: a request submitted
                    // with nothing in flight armed only the peer's silence, and a rail that
                    // stalled under a stream of such requests went unnoticed until that fired.
                    self.arm(&mut d);
                }
                self.settle(&mut d);
            }
            if out.is_empty() || !self.hand_over(&mut out) {
                break;
            }
        }
        if let Ok(mut kept) = self.scratch.try_lock() {
            if kept.capacity() < out.capacity() {
                out.clear();
                *kept = out;
            }
        }
    }

    /// Gives dealt slices to the link; returns whether any came back, so the caller deals
    /// again.
    fn hand_over(&self, out: &mut Vec<Post<OutSlice<L::Key>>>) -> bool {
        for post in out.iter_mut() {
            post.item.id = post.id;
            // A promoted slice travels, and is counted, at the level it was dealt at.
            post.item.priority = post.priority;
        }
        let Handed {
            refused,
            mut changed,
            lost,
        } = self.link.hand_over(self, out);
        out.clear();
        if refused.is_empty() && lost.is_empty() && changed.is_empty() {
            return false;
        }
        changed.sort_unstable();
        changed.dedup();
        for &p in &changed {
            self.refresh_path(p);
        }
        if !refused.is_empty() {
            let now = Instant::now();
            let mut rails = self.rails(now);
            let now_ns = self.ns(now);
            let mut d = self.lock();
            // Back to the head in dealing order: hand back the last first.
            for post in refused.into_iter().rev() {
                d.on_refused(now_ns, post, &mut rails);
            }
        }
        for (p, slices, e) in lost {
            tracing::warn!(peer = %self.name, path = %self.link.path_name(p), error = %e, "posting failed; the slices go to the other paths");
            self.path_failed(p, slices, e);
        }
        true
    }

    /// Tells the dispatcher how many connections of path `p` are alive.
    pub(crate) fn refresh_path(&self, p: PathId) {
        let live = self.link.live(p);
        let now_ns = self.now_ns();
        self.lock().on_path(now_ns, p, live);
    }

    /// Counts an error of path `p` toward pausing it; returns whether it paused it.
    pub(crate) fn path_error(&self, p: PathId) -> bool {
        let now_ns = self.now_ns();
        let mut d = self.lock();
        let paused = d.on_path_error(now_ns, p);
        self.arm(&mut d);
        paused
    }

    /// Answers for slices in flight: `(id, when posted, ok)`, where not ok means the target
    /// refused the slice, which no retry can fix. Returns whether a window opened, so the
    /// caller deals again once it has finished the answered slices' tasks.
    pub(crate) fn on_answers(
        &self,
        now: Instant,
        answers: impl IntoIterator<Item = (SliceId, Instant, bool)>,
    ) -> bool {
        let mut rails = self.rails(now);
        let now_ns = self.ns(now);
        let mut d = self.lock();
        let mut refill = false;
        for (id, posted, ok) in answers {
            refill |= if ok {
                d.on_completed(now_ns, id, Some(self.ns(posted)), &mut rails)
            } else {
                self.keys_refused.store(true, Ordering::Relaxed);
                d.on_rejected(now_ns, id, &mut rails)
            };
        }
        refill
    }

    /// Hands slices that were in flight back to the dispatcher (each knows its path by its
    /// id), marked with `err` when given, to be retried elsewhere or failed.
    pub(crate) fn give_back(
        &self,
        slices: Vec<OutSlice<L::Key>>,
        err: Option<&Error>,
        cause: Cause,
    ) {
        if slices.is_empty() {
            return;
        }
        self.link.returned(slices.len());
        let now = Instant::now();
        let mut rails = self.rails(now);
        let now_ns = self.ns(now);
        let mut d = self.lock();
        for mut s in slices {
            if let Some(e) = err {
                s.last_error = Some(e.clone());
            }
            let id = s.id;
            d.on_failed(now_ns, id, s, cause, &mut rails);
        }
        self.settle(&mut d);
    }

    /// Path `p` failed with `err`, taking `slices` with it: they are retried elsewhere (a
    /// remote access error is final: the target no longer serves that memory), the path
    /// leaves the dispatcher until it is remade, and the remake starts unless the path is
    /// paused or its link is down.
    pub(crate) fn path_failed(&self, p: PathId, slices: Vec<OutSlice<L::Key>>, err: Error) {
        self.set_last_loss(&err);
        self.link.fail_path(self, p, &err);
        if matches!(err, Error::RemoteRejected { .. }) {
            // No retry can fix a refused key: fail those slices with the error.
            self.keys_refused.store(true, Ordering::Relaxed);
            self.link.returned(slices.len());
            let now = Instant::now();
            for s in slices {
                {
                    let mut rails = self.rails(now);
                    self.lock().on_rejected(self.ns(now), s.id, &mut rails);
                }
                s.task.part_done(Err(err.clone()));
            }
        } else {
            self.give_back(slices, Some(&err), Cause::Lost);
        }
        let paused = {
            let now_ns = self.now_ns();
            let mut d = self.lock();
            d.on_path(now_ns, p, 0);
            let paused = d.on_path_error(now_ns, p);
            self.arm(&mut d);
            paused
        };
        if paused {
            tracing::warn!(peer = %self.name, path = %self.link.path_name(p), "{} paused after repeated errors", L::PATH);
        } else if !self.link.link_down(p) {
            self.reconnect_in_background(p, false);
        }
        self.pump();
    }

    /// Runs what the dispatcher has due (silence, stalled paths, probes, expiry), does what
    /// it says, and registers its next deadline.
    pub(crate) fn on_timer(&self, now: Instant) {
        if self.given_up() {
            return;
        }
        self.armed_ns.store(0, Ordering::Release);
        let now_ns = self.ns(now);
        let mut events = Vec::new();
        {
            let mut rails = self.rails(now);
            let mut d = self.lock();
            d.on_timeout(now_ns, &mut rails);
            while let Some(e) = d.poll_event() {
                events.push(e);
            }
            if d.is_silent() {
                // Under the lock: a request posted from here on goes to a fresh driver.
                self.silent.store(true, Ordering::Release);
            }
            self.settle(&mut d);
        }
        for event in events {
            match event {
                Event::Silent => {
                    tracing::warn!(
                        peer = %self.name,
                        timeout_ms = self.env.timeout.as_millis() as u64,
                        "peer answered nothing for the timeout: its requests fail"
                    );
                    let err = self.timeout_error();
                    for p in 0..self.paths() {
                        self.link.drop_path(self, p, &err);
                    }
                }
                Event::DropPath { path, stalled } => {
                    tracing::warn!(
                        peer = %self.name,
                        path = %self.link.path_name(path),
                        stalled,
                        "{} answered nothing in time: its connections are closed",
                        L::PATH
                    );
                    // The whole path goes, idle connections too: they share the stalled link,
                    // and a retry dealt to one of them would stall again while the peer's
                    // deadline runs. Until a remake proves the path again, retries go to the
                    // other paths.
                    self.link.drop_path(self, path, &self.timeout_error());
                    self.refresh_path(path);
                }
                Event::Probe(p) => match self.link.probe(p) {
                    ProbeNeed::Remake => self.reconnect_in_background(p, true),
                    need => {
                        let whole = matches!(need, ProbeNeed::Whole);
                        self.lock().on_probe(now_ns, p, whole);
                        self.refresh_path(p);
                    }
                },
            }
        }
        let mut d = self.lock();
        self.arm(&mut d);
        drop(d);
        self.pump();
    }

    /// The link duty, on the engine's link timer: closes paths whose link went down, probes at
    /// once a paused path whose link came back (the pause would otherwise outlast the outage by
    /// up to its whole length: 30 s at first, longer for a rail that failed before), and
    /// remakes healthy paths that lost connections (on threads of their own).
    pub(crate) fn check_links(&self) {
        if self.given_up() {
            return;
        }
        self.link.before_link_check(self);
        for p in 0..self.paths() {
            if self.link.link_down(p) {
                self.link_was_down[p].store(true, Ordering::Relaxed);
                let err = Error::PeerDisconnected {
                    peer: self.name.clone(),
                    reason: format!("link of {} {} is down", L::PATH, self.link.path_name(p)),
                };
                self.link.drop_path(self, p, &err);
                self.set_last_loss(&err);
                self.refresh_path(p);
                continue;
            }
            if self.link_was_down[p].swap(false, Ordering::Relaxed) {
                let mut d = self.lock();
                if d.on_link_up(self.now_ns(), p) {
                    tracing::info!(peer = %self.name, path = %self.link.path_name(p), "link of paused {} is up again: probing it now", L::PATH);
                    // Due now: the timer runs the probe, as at the end of any pause.
                    self.arm(&mut d);
                }
            }
            if self.link.needs_remake(p) && self.lock().is_up(p) {
                self.reconnect_in_background(p, false);
            }
        }
        self.pump();
    }

    /// Remakes path `p` (a probe when `probe`) on a thread of its own: a handshake with a peer
    /// that does not answer takes up to `connect_timeout_ms`, and the timer thread must keep
    /// every peer's timeouts on time meanwhile. At most one per path.
    pub(crate) fn reconnect_in_background(&self, p: PathId, probe: bool) {
        if self.remaking[p].swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(me) = self.me.upgrade() else {
            self.remaking[p].store(false, Ordering::Release);
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("mr-reconnect".into())
            .spawn(move || {
                me.remake(p, probe);
                me.remaking[p].store(false, Ordering::Release);
                me.pump();
            });
        if let Err(e) = spawned {
            tracing::warn!(peer = %self.name, error = %e, "cannot spawn a reconnect thread");
            self.remaking[p].store(false, Ordering::Release);
        }
    }

    fn remake(&self, p: PathId, probe: bool) {
        let ok = self.link.remake(self, p);
        if self.given_up() {
            // Closed or given up on while connecting: the link closed what it made.
            return;
        }
        let now_ns = self.now_ns();
        {
            let mut d = self.lock();
            if probe {
                d.on_probe(now_ns, p, ok);
                if ok {
                    tracing::info!(peer = %self.name, path = %self.link.path_name(p), "{} rejoined after a successful probe", L::PATH);
                }
            } else if !ok && d.on_path_error(now_ns, p) {
                tracing::warn!(peer = %self.name, path = %self.link.path_name(p), "{} paused after repeated errors", L::PATH);
            }
            self.arm(&mut d);
        }
        self.refresh_path(p);
    }

    /// Closes every path; slices in flight or queued fail with `reason`. Once.
    pub(crate) fn close(&self, reason: &str) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let err = Error::PeerDisconnected {
            peer: self.name.clone(),
            reason: reason.to_owned(),
        };
        self.set_last_loss(&err);
        self.link.close(self, &err);
        let now = Instant::now();
        let mut rails = self.rails(now);
        let mut d = self.lock();
        d.close(self.ns(now), &mut rails);
        self.settle(&mut d);
        drop(d);
        self.env.timers.disarm(self.timer);
    }
}

impl<L: Link> Drop for Driver<L> {
    fn drop(&mut self) {
        self.close("engine shut down");
    }
}
