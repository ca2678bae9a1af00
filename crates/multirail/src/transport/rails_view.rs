//! The engine-wide state a peer's dispatcher consults, seen through
//! `multirail_policy::dispatch::Rails`: the shared rail scheduler (selector, tiers, windows) and
//! the QoS state (slots, filtering, which priorities are active), at one instant.

use std::time::Instant;

use multirail_policy::dispatch::{Payload, Rails};
use multirail_policy::qos::Priority;
use multirail_policy::selector::{RailId, SliceShape};

use crate::memory::Location;
use crate::qos::Qos;
use crate::rails::RailScheduler;

/// A slice whose local memory has a place, which ranks the rails for it.
pub(crate) trait Located {
    /// Where the slice's local memory lives.
    fn location(&self) -> Location;
}

/// The engine's rails and QoS at `now`, for one call into a dispatcher.
pub(crate) struct EngineRails<'a> {
    scheduler: &'a RailScheduler,
    qos: &'a Qos,
    now: Instant,
    rails: usize,
}

impl<'a> EngineRails<'a> {
    pub(crate) fn new(scheduler: &'a RailScheduler, qos: &'a Qos, now: Instant) -> Self {
        EngineRails {
            scheduler,
            qos,
            now,
            rails: scheduler.topology().rails.len(),
        }
    }
}

impl<T: Payload + Located> Rails<T> for EngineRails<'_> {
    fn smart(&self) -> bool {
        self.scheduler.smart()
    }

    fn slot_admits(&self, priority: Priority) -> bool {
        self.qos.slot_admits(priority)
    }

    fn rail_admits(&self, rail: RailId, priority: Priority) -> bool {
        self.qos.rail_admits(self.now, rail, self.rails, priority)
    }

    fn has_work(&self, priority: Priority) -> bool {
        self.qos.has_work(priority, self.now)
    }

    fn tiers(&mut self, item: &T, out: &mut Vec<u8>) {
        let tiers = self.scheduler.tiers(item.location());
        out.clear();
        out.extend_from_slice(&tiers);
    }

    fn bandwidths(&mut self, out: &mut [f64]) {
        self.scheduler.fill_ewma_bytes_per_sec(out);
    }

    fn link_bandwidth(&mut self, rail: RailId) -> f64 {
        self.scheduler.link_bytes_per_sec(rail)
    }

    fn select(&mut self, candidates: &[Vec<RailId>; 3], shape: SliceShape, out: &mut Vec<RailId>) {
        self.scheduler.select(candidates, shape, out);
    }

    fn delivered(
        &mut self,
        rail: RailId,
        bytes: u64,
        posted_ns: u64,
        now_ns: u64,
        app_limited: bool,
    ) {
        self.scheduler
            .delivered_ns(rail, bytes, posted_ns, now_ns, app_limited);
    }

    fn failed(&mut self, rail: RailId, bytes: u64) {
        self.scheduler.failed(rail, bytes);
    }

    fn stalled(&mut self, rail: RailId, bytes: u64, posted_ns: u64, now_ns: u64) {
        self.scheduler.stalled_ns(rail, bytes, posted_ns, now_ns);
    }

    fn recovered(&mut self, rail: RailId, now_ns: u64) {
        self.scheduler.recovered_ns(rail, now_ns);
    }

    fn unassigned(&mut self, rail: RailId, bytes: u64) {
        self.scheduler.unassigned(rail, bytes);
    }

    fn dequeued(&mut self, priority: Priority, waited_ns: u64) {
        self.qos.dequeued(priority, waited_ns, self.now);
    }

    fn promoted(&mut self, n: u64) {
        self.qos.promoted(n);
    }

    fn note_window(&mut self, rail: RailId, bytes: u64) {
        self.scheduler.note_window(rail, bytes);
    }

    fn slot_holds_work(&mut self) {
        self.qos.slot_holds_work();
    }
}
