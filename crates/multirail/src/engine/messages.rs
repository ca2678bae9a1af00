//! The engine API of two-sided messages and notifications (the machinery is `crate::messaging`).

use super::*;
use crate::messaging::{Lane, LanesReport, Message, Notification, Peers};
use crate::transport::wire::MsgKind;
use std::sync::mpsc;

/// Two-sided messages and notifications.
impl Engine {
    /// Sends `bytes` to segment `segment` (opened with `open_segment`); the peer gets them
    /// from [`Engine::recv`], after every message this engine sent it before. Waits while the
    /// peer has no receive buffer posted for us, up to `transports.tcp.timeout_ms`. Fails when
    /// `bytes` exceeds the peer's receive buffers, on a timeout or a broken connection.
    pub fn send(&self, segment: SegmentId, bytes: &[u8]) -> Result<()> {
        self.messaging()
            .send(self, segment, MsgKind::Message, bytes)
    }

    /// The next message from any peer, waiting up to `timeout` (`None`: no limit); `Ok(None)`
    /// when none came in time. The wait polls for `transports.<t>.receive.spin_us` (adapted to
    /// how soon messages have been arriving), then sleeps on a doorbell that senders ring, so
    /// a receiver waiting for a message that does not come costs no core.
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Option<Message>> {
        self.messaging().recv(timeout)
    }

    /// Sends a notification to `segment`; it arrives in order with this engine's messages.
    pub fn send_notification(&self, segment: SegmentId, msg: &str) -> Result<()> {
        self.messaging()
            .send(self, segment, MsgKind::Notification, msg.as_bytes())
    }

    /// Notifications received since the last call, in arrival order (per peer: send order).
    pub fn receive_notifications(&self) -> Vec<Notification> {
        self.messaging().notifications()
    }

    /// [`Engine::receive_notifications`], but when none has arrived, waits up to `timeout`
    /// (`None`: no limit) for the first, as [`Engine::recv`] waits (a short spin, then asleep
    /// on the doorbell). Empty when none came in time. Messages meanwhile stay for `recv`.
    pub fn wait_notifications(&self, timeout: Option<Duration>) -> Vec<Notification> {
        self.messaging().wait_notifications(timeout)
    }

    /// Moves the messages this engine sends to `segment` onto `lane`. A dedicated lane has
    /// receive buffers of its own at the peer (on rdma, a queue pair with its own receive
    /// queue); the shared lane takes the peer's configured receive path (on rdma, the shared
    /// receive queue). A fence closes the old lane: the peer delivers everything sent before
    /// the switch first, so order holds and nothing is lost or repeated. With `lanes.dynamic`
    /// (the default) the lanes driver may move the lane again later as the traffic says; set it
    /// false to change lanes only by hand. Fails when `segment` is not open or the new lane
    /// cannot be connected (the next send then tries again).
    pub fn switch_lane(&self, segment: SegmentId, lane: Lane) -> Result<()> {
        self.messaging().switch_lane(self, segment, lane)
    }

    /// The lane messages to `segment` take (shared until switched). Fails when `segment` is
    /// not open.
    pub fn lane(&self, segment: SegmentId) -> Result<Lane> {
        let peer = Engine::peer(self, segment)?;
        Ok(self.messaging().lane(peer.id))
    }

    /// This engine's lanes: for each peer it sends to and each peer sending to it, the lane,
    /// the usage score (outgoing), and how often the lane was promoted, demoted and denied;
    /// and the counters of both negotiations (`lanes.*` configures them). Never fails.
    pub fn lanes(&self) -> LanesReport {
        let names = |id: u64| {
            Engine::peer(self, SegmentId(id))
                .ok()
                .map(|p| p.name.clone())
        };
        self.messaging().lanes_report(&names)
    }

    /// For each peer sending messages to this engine, by segment name, the lane it uses.
    pub fn incoming_lanes(&self) -> Vec<(String, Lane)> {
        self.messaging()
            .incoming_lanes()
            .into_iter()
            .map(|(peer, lane, _)| (peer, lane))
            .collect()
    }

    /// Submits `requests` like [`Engine::submit`] and, once every one of them completed (its
    /// bytes are in place at the target), sends `msg` as a notification to each segment they
    /// target, so the notification arrives after the data. A failed batch sends no
    /// notification (its error is in the batch's status).
    pub fn submit_with_notification(
        &self,
        batch: BatchId,
        requests: &[Request],
        msg: &str,
    ) -> Result<()> {
        // Hold the batch itself, not its id: a caller that waits and frees the batch at once
        // must not make the notification disappear with it.
        let pending = self.batch(batch)?;
        self.submit(batch, requests)?;
        let mut targets: Vec<SegmentId> = requests.iter().map(|r| r.target).collect();
        targets.sort_by_key(|t| t.0);
        targets.dedup();
        self.notify_when_done(pending, targets, msg)
    }

    /// Sends `msg` as a notification to each of `targets` once every request of `pending`
    /// completed; a failed batch sends none (its error is in the batch's status). The batch's
    /// last completion hands the work to the engine's notifier thread (one per engine, started
    /// on first use), so a post with a notification costs no thread of its own. Fails only
    /// when that thread cannot be started.
    pub(super) fn notify_when_done(
        &self,
        pending: Arc<Batch>,
        targets: Vec<SegmentId>,
        msg: &str,
    ) -> Result<()> {
        let queue = self.notifier()?;
        let batch = pending.clone();
        let msg = msg.to_owned();
        pending.when_idle(Box::new(move || {
            // The notifier is gone only when the engine is: nobody is left to notify.
            let _ = queue.send(DoneBatch {
                batch,
                targets,
                msg,
            });
        }));
        Ok(())
    }

    /// The queue of the engine's notifier thread, started on first use. The thread holds the
    /// engine weakly and ends with it.
    fn notifier(&self) -> Result<mpsc::Sender<DoneBatch>> {
        let mut slot = self.inner.notifier.lock().expect("notifier poisoned");
        if let Some(tx) = slot.as_ref() {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::channel::<DoneBatch>();
        let inner = Arc::downgrade(&self.inner);
        thread::Builder::new()
            .name("mr-notify".into())
            .spawn(move || {
                while let Ok(done) = rx.recv() {
                    let Some(inner) = inner.upgrade() else { return };
                    let engine = Engine::momentary(inner);
                    match done.batch.overall_status() {
                        Status::Failed(e) => {
                            tracing::warn!(error = %e, "batch failed; notification not sent")
                        }
                        _ => {
                            for t in done.targets {
                                if let Err(e) = engine.send_notification(t, &done.msg) {
                                    tracing::warn!(error = %e, "batch notification not sent");
                                }
                            }
                        }
                    }
                }
            })
            .map_err(|e| Error::io("spawning the notification thread", e))?;
        *slot = Some(tx.clone());
        Ok(tx)
    }
}

/// A batch whose requests all finished, and the notification to send for it.
pub(super) struct DoneBatch {
    batch: Arc<Batch>,
    targets: Vec<SegmentId>,
    msg: String,
}

impl Peers for Engine {
    fn local_name(&self) -> String {
        self.name()
    }

    fn peer(&self, segment: SegmentId) -> Result<Arc<Peer>> {
        Engine::peer(self, segment)
    }
}

/// Doublings of the lanes driver's sleep after passes with nothing to do (up to 2^3 = 8 ticks).
const QUIET_STEPS: u32 = 3;

/// Least time between two reads of the shared tcp lane by the lanes thread: what arrives
/// while the application does not poll waits at most this long, and a lane whose bytes cannot
/// be taken in (its receive pool full) wakes the thread no more often.
const SHARED_LANE_GAP: Duration = Duration::from_micros(200);

/// The thread that drives dynamic lanes (`crate::messaging` dynamic module): every tick (up
/// to 8 ticks while the lanes are settled) it reads receivers' answers, scores peers and
/// negotiates, and performs lane switches. Between passes, while the application neither
/// polled since the last pass nor sleeps on the doorbell, it waits on the shared tcp lane's
/// connections and reads them into the shared receive pool itself (see
/// [`wait_serving_the_shared_lane`]); otherwise it just sleeps. A thread waiting on those
/// connections is woken by every message that comes, in the sender's system call: with the
/// receiver attending to them itself that was a second wake-up per message for nothing
/// (after a silence, on an idle core: ~1.5 x the first message's delivery over tcp). Runs
/// until the engine is dropped; logs and gives up dynamic lanes when it cannot be spawned.
pub(super) fn spawn_lanes_driver(inner: Weak<Inner>) {
    let spawned = thread::Builder::new()
        .name("mr-lanes".into())
        .spawn(move || {
            // Passes in a row with nothing to do: each doubles the sleep, up to 8 ticks. A
            // process of many engines otherwise wakes a driver per engine every tick, taking the
            // cores from its senders for nothing while the lanes are settled. Work due by the
            // clock (idle progress, which keeps a quiet sender's scores decaying, and request
            // timeouts) still runs on time: the sleep ends when it falls due.
            let mut quiet = 0u32;
            // Receive polls when the last wait ended: any since were the application's.
            let mut seen_polls: Option<u64> = None;
            let shared_lane = match inner.upgrade() {
                Some(inner) => Engine::momentary(inner).messaging().shared_lane_fd(),
                None => return,
            };
            loop {
                let (active, due, tick, polls, attended) = {
                    let Some(inner) = inner.upgrade() else { return };
                    let engine = Engine::momentary(inner);
                    let polled = seen_polls.is_some_and(|s| s != engine.messaging().polls());
                    let (active, due) = engine.messaging().drive_lanes(&engine);
                    let m = engine.messaging();
                    let attended = polled || m.receiver_asleep();
                    (active, due, m.lanes_tick(), m.polls(), attended)
                };
                quiet = if active {
                    0
                } else {
                    (quiet + 1).min(QUIET_STEPS)
                };
                let mut sleep = tick * (1 << quiet);
                if let Some(due) = due {
                    sleep = sleep.min(due.max(Duration::from_millis(1)));
                }
                seen_polls = Some(match &shared_lane {
                    Some(fd) if !attended => wait_serving_the_shared_lane(&inner, fd, sleep, polls),
                    _ => {
                        thread::sleep(sleep);
                        polls
                    }
                });
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot spawn the lanes thread: lanes stay as they are");
    }
}

/// Waits `sleep` on the shared tcp lane's epoll set `fd`. When one of its connections has
/// bytes while the application has not polled since `polls` (it is busy elsewhere, or gone
/// from `recv`), reads them into the shared receive pool (a receive poll, taken only when the
/// application does not hold the receive lock). Otherwise the application's own poll reads
/// them and the wait goes on as a sleep. Without this a receiver that did not poll held every
/// sender on its shared lane to the one credit a new connection starts with: a sender's second
/// message timed out against a receiver busy for longer than `transports.tcp.timeout_ms`.
/// Returns the receive polls counted when it last looked (its own included).
fn wait_serving_the_shared_lane(
    inner: &Weak<Inner>,
    fd: &std::os::fd::OwnedFd,
    sleep: Duration,
    mut polls: u64,
) -> u64 {
    let until = Instant::now() + sleep;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return polls;
        }
        match readable_within(fd, left) {
            Ok(true) => {}
            Ok(false) => return polls,
            Err(e) => {
                tracing::debug!(error = %e, "waiting on the shared tcp lane");
                thread::sleep(left);
                return polls;
            }
        }
        {
            let Some(inner) = inner.upgrade() else {
                return polls;
            };
            let m = Engine::momentary(inner).messaging().clone();
            if m.polls() != polls {
                // The application polls: its polls read the lane.
                drop(m);
                thread::sleep(left);
                return polls;
            }
            m.poke();
            polls = m.polls();
        }
        thread::sleep(SHARED_LANE_GAP.min(left));
    }
}

/// Whether `fd` becomes readable within `timeout`. Fails when the wait does (not on a
/// signal: that reads as not readable yet).
fn readable_within(fd: &std::os::fd::OwnedFd, timeout: Duration) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `pfd` and `ts` are live locals for the call; one pollfd is passed and no
    // signal mask.
    let rc = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(rc > 0 && pfd.revents & libc::POLLIN != 0)
}
