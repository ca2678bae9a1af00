//! Reaping completions: one thread polls the completion queue of every RDMA rail and hands each
//! completion to the peer whose queue pair it belongs to.
//!
//! While requests are in flight it polls without sleeping for up to [`SPIN`] after the last
//! completion (a completion then costs no wake-up), then in short naps; with nothing in flight
//! it sleeps until a post wakes it. Completions never wait on a peer's lock held across I/O:
//! the peer updates its dispatcher and posts what that frees, on this thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use multirail_verbs::WorkCompletion;

use super::devices::{Port, POLL_BATCH};
use super::peer::RdmaPeer;
use super::rc::{PostCounters, RcQp, Reaped};
use multirail_policy::dispatch::PathId;

/// How long the poller keeps polling without a nap after the last completion.
const SPIN: Duration = Duration::from_micros(200);
/// Nap between polls while requests are in flight but none completes.
const NAP: Duration = Duration::from_micros(50);
/// Longest sleep with nothing in flight before looking at the stop flag again.
const IDLE: Duration = Duration::from_millis(100);

/// Where a queue pair's completions go.
struct Route {
    qp: Arc<RcQp>,
    owner: Weak<RdmaPeer>,
    path: PathId,
}

/// The completion side of the RDMA transport.
pub(crate) struct Poller {
    ports: Vec<Arc<Port>>,
    /// Per port: queue pair number → its route.
    routes: Vec<RwLock<HashMap<u32, Route>>>,
    /// Requests posted and not yet completed or given up, engine-wide.
    in_flight: AtomicI64,
    sleeping: Mutex<bool>,
    wake: Condvar,
    stop: AtomicBool,
    pub(super) counters: Arc<PostCounters>,
}

impl Poller {
    pub(super) fn new(ports: Vec<Arc<Port>>, counters: Arc<PostCounters>) -> Arc<Poller> {
        let routes = ports.iter().map(|_| RwLock::default()).collect();
        Arc::new(Poller {
            ports,
            routes,
            in_flight: AtomicI64::new(0),
            sleeping: Mutex::new(false),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            counters,
        })
    }

    /// Starts the polling thread; it ends when the poller is dropped or stopped.
    pub(super) fn start(self: &Arc<Self>) -> std::io::Result<()> {
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("mr-rdma-poll".into())
            .spawn(move || run(me))
            .map(|_| ())
    }

    /// Sends the completions of `qp` (on port `port`) to `owner`'s path `path`.
    pub(super) fn route(&self, port: usize, qp: &Arc<RcQp>, owner: Weak<RdmaPeer>, path: PathId) {
        self.routes[port].write().expect("routes poisoned").insert(
            qp.qp.qp_num(),
            Route {
                qp: qp.clone(),
                owner,
                path,
            },
        );
    }

    /// Forgets a queue pair (replaced or closed); its late completions are dropped.
    pub(super) fn unroute(&self, port: usize, qp_num: u32) {
        self.routes[port]
            .write()
            .expect("routes poisoned")
            .remove(&qp_num);
    }

    /// `n` requests were posted (negative: `-n` finished or were given up).
    pub(super) fn posted(&self, n: i64) {
        let before = self.in_flight.fetch_add(n, Ordering::AcqRel);
        if n > 0 && before <= 0 {
            let sleeping = self.sleeping.lock().expect("poller poisoned");
            if *sleeping {
                self.wake.notify_one();
            }
        }
    }

    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.notify_all();
    }

    /// Polls every completion queue once; returns how many completions it handled.
    fn poll_once(&self, wcs: &mut [WorkCompletion]) -> usize {
        let mut handled = 0;
        for (i, port) in self.ports.iter().enumerate() {
            let n = match port.cq.poll(wcs) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(rail = %port.descriptor.name(), error = %e, "polling the completion queue failed");
                    0
                }
            };
            for wc in &wcs[..n] {
                self.dispatch(i, wc);
            }
            handled += n;
        }
        handled
    }

    fn dispatch(&self, port: usize, wc: &WorkCompletion) {
        let route = {
            let routes = self.routes[port].read().expect("routes poisoned");
            routes
                .get(&wc.qp_num())
                .map(|r| (r.qp.clone(), r.owner.clone(), r.path))
        };
        let Some((qp, owner, path)) = route else {
            return;
        };
        let reaped = qp.reap(wc, &self.counters);
        let finished = match &reaped {
            Reaped::Done(v) => v.len(),
            Reaped::Lost(v, _) => v.len(),
            Reaped::Nothing => 0,
        };
        if finished > 0 {
            self.posted(-(finished as i64));
        }
        if let Some(peer) = owner.upgrade() {
            peer.on_reaped(path, &qp, reaped);
        }
    }
}

fn run(poller: Weak<Poller>) {
    let mut wcs = vec![WorkCompletion::default(); POLL_BATCH];
    let mut last = Instant::now();
    loop {
        let Some(p) = poller.upgrade() else { return };
        if p.stop.load(Ordering::Acquire) {
            return;
        }
        if p.poll_once(&mut wcs) > 0 {
            last = Instant::now();
            continue;
        }
        if p.in_flight.load(Ordering::Acquire) > 0 {
            if last.elapsed() > SPIN {
                drop(p);
                std::thread::sleep(NAP);
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let mut sleeping = p.sleeping.lock().expect("poller poisoned");
        *sleeping = true;
        // A post between the load above and here notifies under this lock: check again.
        if p.in_flight.load(Ordering::Acquire) <= 0 {
            sleeping = p
                .wake
                .wait_timeout(sleeping, IDLE)
                .expect("poller poisoned")
                .0;
        }
        *sleeping = false;
        last = Instant::now();
    }
}
