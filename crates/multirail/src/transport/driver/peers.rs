//! A transport's drivers, one per peer: made on first use by one connecting thread while
//! other submitters wait for its outcome, remade once given up on, and closed with the peer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use multirail_policy::health::RailState;

use super::{Driver, Link};
use crate::error::{Error, Result};
use crate::peer::Peer;
use crate::transport::{Plans, Prepared};

/// A transport's drivers, one per peer by the engine's peer id.
pub(crate) struct Peers<L: Link> {
    slots: RwLock<HashMap<u64, Arc<Slot<L>>>>,
}

/// One peer's driver, and the lock that makes it.
struct Slot<L: Link> {
    /// Made on first use and remade when given up on.
    live: Mutex<Option<Arc<Driver<L>>>>,
    /// Held while (re)making `live`, so one thread connects and others wait for its result;
    /// holds when the last attempt failed and why. Apart from `live` because connecting to a
    /// stopped peer waits `connect_timeout_ms` for its handshake, and the timer thread, which
    /// takes `live` for every peer's deadlines, must not wait that long.
    connect: Mutex<Option<(Instant, Error)>>,
}

impl<L: Link> Default for Peers<L> {
    fn default() -> Self {
        Peers {
            slots: RwLock::default(),
        }
    }
}

impl<L: Link> Peers<L> {
    /// The peer's live driver, made afresh with `connect` when there is none, it was given up
    /// on, or the segment moved to another address or process. One thread connects at a time; those
    /// waiting meanwhile share its outcome, so submitters lining up behind a stopped peer do
    /// not wait one connect timeout each. The flag says whether the driver is fresh.
    pub(crate) fn connected(
        &self,
        peer: &Peer,
        connect: impl FnOnce() -> Result<Arc<Driver<L>>>,
    ) -> Result<(Arc<Driver<L>>, bool)> {
        let slot = self.slot(peer.id);
        let live = || -> Result<Option<Arc<Driver<L>>>> {
            let moved = {
                let mut current = slot.live.lock().expect("peer poisoned");
                match current.as_ref() {
                    Some(p) if p.incarnation > peer.incarnation => {
                        // Routed before the segment was followed to a later process: its keys
                        // are the earlier one's, and the later one's paths stay.
                        return Err(Error::PeerDisconnected {
                            peer: peer.name.clone(),
                            reason: "another process serves the segment now; submit again".into(),
                        });
                    }
                    Some(p) if p.incarnation < peer.incarnation => current.take(),
                    _ => None,
                }
            };
            // The segment is now served by another process (perhaps at another address): the
            // old paths lead to a process that no longer answers for it. Closed outside the
            // lock, since closing hands slices back.
            if let Some(moved) = moved {
                moved.close("another process serves the segment now");
            }
            Ok(slot
                .live
                .lock()
                .expect("peer poisoned")
                .clone()
                .filter(|p| !p.is_dead()))
        };
        if let Some(p) = live()? {
            return Ok((p, false));
        }
        let asked = Instant::now();
        let mut last_failure = slot.connect.lock().expect("peer poisoned");
        // Another thread may have connected while this one waited, or failed to: an attempt
        // that ended since this thread asked answers for it too.
        if let Some(p) = live()? {
            return Ok((p, false));
        }
        if let Some((ended, err)) = last_failure.as_ref() {
            if *ended >= asked {
                return Err(err.clone());
            }
        }
        match connect() {
            Ok(fresh) => {
                *last_failure = None;
                let old = slot
                    .live
                    .lock()
                    .expect("peer poisoned")
                    .replace(fresh.clone());
                drop(last_failure);
                if let Some(old) = old {
                    old.close("replaced by a fresh connection");
                }
                Ok((fresh, true))
            }
            Err(e) => {
                *last_failure = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Posts requests, each run of requests to one peer to its driver in one go
    /// ([`Driver::post_many`]); `connected` gives a peer's driver, connecting first if needed.
    /// What a driver hands back (it was found dead or silent meanwhile) is posted once more on
    /// a fresh driver, so a request submitted after the verdict gets its own timeout, then
    /// failed with `PeerDisconnected`.
    pub(crate) fn post(
        &self,
        reqs: Vec<(Arc<Peer>, Prepared)>,
        plans: &Plans,
        connected: impl Fn(&Arc<Peer>) -> Result<Arc<Driver<L>>>,
    ) {
        let mut left = reqs.len();
        let mut reqs = reqs.into_iter().peekable();
        while let Some((peer, first)) = reqs.next() {
            // Room for every request left: a batch mostly goes to one peer, and growing the run
            // by doubling would copy it again and again.
            let mut run = Vec::with_capacity(left);
            run.push(first);
            // The same peer, not only the same segment: a batch routed while the segment was
            // followed to a new process holds requests for both.
            while let Some((_, req)) = reqs.next_if(|(next, _)| Arc::ptr_eq(next, &peer)) {
                run.push(req);
            }
            left -= run.len();
            for _ in 0..2 {
                match connected(&peer) {
                    Ok(d) => run = d.post_many(run, plans),
                    Err(e) => {
                        for req in run.drain(..) {
                            req.fail(e.clone());
                        }
                    }
                }
                if run.is_empty() {
                    break;
                }
            }
            for req in run {
                req.fail(Error::PeerDisconnected {
                    peer: peer.name.clone(),
                    reason: format!("every {} to it is down", L::PATH),
                });
            }
        }
    }

    /// The slot of peer `id`, made on first use.
    fn slot(&self, id: u64) -> Arc<Slot<L>> {
        if let Some(s) = self.existing(id) {
            return s;
        }
        self.slots
            .write()
            .expect("peers poisoned")
            .entry(id)
            .or_insert_with(|| {
                Arc::new(Slot {
                    live: Mutex::new(None),
                    connect: Mutex::new(None),
                })
            })
            .clone()
    }

    /// The slot of peer `id`, if it has one.
    fn existing(&self, id: u64) -> Option<Arc<Slot<L>>> {
        self.slots.read().expect("peers poisoned").get(&id).cloned()
    }

    /// Every slot, by id, taken out of the map so no slot lock is held under the map's.
    fn every_slot(&self) -> Vec<(u64, Arc<Slot<L>>)> {
        let slots = self.slots.read().expect("peers poisoned");
        slots.iter().map(|(id, s)| (*id, s.clone())).collect()
    }

    /// The driver of peer `id`, if it has one.
    pub(crate) fn get(&self, id: u64) -> Option<Arc<Driver<L>>> {
        let slot = self.existing(id)?;
        let live = slot.live.lock().expect("peer poisoned").clone();
        live
    }

    /// Every peer with a driver, by id.
    pub(crate) fn all(&self) -> Vec<(u64, Arc<Driver<L>>)> {
        self.every_slot()
            .into_iter()
            .filter_map(|(id, s)| {
                let live = s.live.lock().expect("peer poisoned").clone();
                live.map(|d| (id, d))
            })
            .collect()
    }

    /// Takes peer `id`'s driver out, keeping its slot (the next use makes a fresh one).
    pub(crate) fn take(&self, id: u64) -> Option<Arc<Driver<L>>> {
        let slot = self.existing(id)?;
        let taken = slot.live.lock().expect("peer poisoned").take();
        taken
    }

    /// Runs the dispatcher deadline of peer `id`.
    pub(crate) fn on_timer(&self, id: u64, now: Instant) {
        if let Some(d) = self.get(id) {
            d.on_timer(now);
        }
    }

    /// Deals every peer's queued slices that rails and slots now allow.
    pub(crate) fn pump_all(&self) {
        for (_, d) in self.all() {
            d.pump();
        }
    }

    /// The link check of every peer's paths.
    pub(crate) fn check_links(&self) {
        for (_, d) in self.all() {
            d.check_links();
        }
    }

    /// Closes peer `id`'s driver and forgets the peer (its segment was closed); its slices in
    /// flight fail with `reason`. A peer never connected is no error.
    pub(crate) fn close_peer(&self, id: u64, reason: &str) {
        let slot = self.slots.write().expect("peers poisoned").remove(&id);
        let live = slot.and_then(|s| s.live.lock().expect("peer poisoned").take());
        if let Some(d) = live {
            d.close(reason);
        }
    }

    /// Closes every peer's driver; their slices in flight fail with `reason`.
    pub(crate) fn shutdown(&self, reason: &str) {
        for (_, s) in self.every_slot() {
            let live = s.live.lock().expect("peer poisoned").take();
            if let Some(d) = live {
                d.close(reason);
            }
        }
    }

    /// The health of every path to every peer with a driver: its local rail and state.
    pub(crate) fn path_health(&self) -> Vec<(usize, RailState)> {
        self.all().iter().flat_map(|(_, d)| d.health()).collect()
    }
}
