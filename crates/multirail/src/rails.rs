//! The engine's rail scheduler: the DeviceSelector (from `multirail-policy`) driven with real
//! time, the per-rail traffic counters, and the tiers of every rail for each memory location.
//! Shared by every peer of every rail-carrying transport, since rails are a host resource.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use multirail_policy::selector::{self, DeviceSelector, RailId, SliceShape};

use crate::config::RdmaConfig;
use crate::memory::Location;
use crate::stats::{RailCounters, TrafficStats};
use crate::topology::Topology;

/// Selector, counters and tiers for the host's rails.
pub(crate) struct RailScheduler {
    topology: Topology,
    selector: Mutex<DeviceSelector>,
    counters: Vec<Arc<RailCounters>>,
    tiers: Mutex<HashMap<Location, Arc<Vec<u8>>>>,
    epoch: Instant,
    smart: bool,
    /// Latest in-flight bound computed for each rail (bytes).
    windows: Vec<std::sync::atomic::AtomicU64>,
    /// Each rail's theoretical bandwidth, bytes per second (fixed once the selector has it).
    link_bytes_per_sec: Vec<f64>,
}

impl RailScheduler {
    pub(crate) fn new(topology: Topology, rdma: &RdmaConfig, stats: &TrafficStats) -> Self {
        let reported: Vec<Option<f64>> = topology.rails.iter().map(|r| r.reported_gbps).collect();
        let counters = topology.rails.iter().map(|r| stats.rail(&r.name)).collect();
        let selector = DeviceSelector::new(rdma.selector_config(), &reported, rand::random());
        let link_bytes_per_sec = selector
            .stats()
            .map(|s| s.theoretical_gbps * 1e9 / 8.0)
            .collect();
        RailScheduler {
            selector: Mutex::new(selector),
            link_bytes_per_sec,
            counters,
            topology,
            tiers: Mutex::default(),
            epoch: Instant::now(),
            smart: rdma.enable_smart_scheduling,
            windows: (0..reported.len()).map(|_| Default::default()).collect(),
        }
    }

    /// True in smart (EWMA) mode, false in baseline round-robin mode.
    pub(crate) fn smart(&self) -> bool {
        self.smart
    }

    pub(crate) fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Clock origin of the nanosecond times the selector and rail health work in.
    pub(crate) fn epoch(&self) -> Instant {
        self.epoch
    }

    pub(crate) fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    pub(crate) fn now_ns(&self) -> u64 {
        self.ns(Instant::now())
    }

    /// Counters of rail `rail` (by scheduler index).
    pub(crate) fn counters(&self, rail: RailId) -> Arc<RailCounters> {
        self.counters[rail.min(self.counters.len().saturating_sub(1))].clone()
    }

    /// Tier of every rail for memory at `location`, computed once per location.
    pub(crate) fn tiers(&self, location: Location) -> Arc<Vec<u8>> {
        let mut cache = self.tiers.lock().expect("scheduler poisoned");
        cache
            .entry(location)
            .or_insert_with(|| Arc::new(self.topology.tiers(location)))
            .clone()
    }

    /// Chooses a rail per slice among `candidates` (rails per tier); `out[i]` carries slice
    /// `i`. Leaves `out` empty when every tier is empty.
    pub(crate) fn select(
        &self,
        candidates: &[Vec<RailId>; 3],
        shape: SliceShape,
        out: &mut Vec<RailId>,
    ) {
        let tiers: [&[RailId]; 3] = [&candidates[0], &candidates[1], &candidates[2]];
        let mut sel = self.selector.lock().expect("scheduler poisoned");
        if let Err(e) = sel.select(&tiers, shape, out) {
            tracing::debug!(error = %e, "no rail selected");
            out.clear();
        }
    }

    /// A slice of `bytes` on `rail`, posted at `p` and answered at `n` (ns on this
    /// scheduler's clock), for the rail's bandwidth estimate; `app_limited` when the rail could
    /// not show its speed meanwhile (idle, or held back by its window): such a sample may
    /// raise the estimate but never lowers it.
    pub(crate) fn delivered_ns(&self, rail: RailId, bytes: u64, p: u64, n: u64, app_limited: bool) {
        tracing::trace!(
            rail,
            bytes,
            posted_ns = p,
            now_ns = n,
            app_limited,
            "slice completed"
        );
        let _ = self
            .selector
            .lock()
            .expect("scheduler poisoned")
            .on_delivered(rail, bytes, p, n, app_limited);
    }

    /// `rail`, on probation after a stall, answered a probe far faster than its estimate at `n`
    /// (see [`DeviceSelector::on_recovered`]).
    pub(crate) fn recovered_ns(&self, rail: RailId, n: u64) {
        let mut selector = self.selector.lock().expect("scheduler poisoned");
        let _ = selector.on_recovered(rail, n);
        tracing::debug!(
            rail,
            now_ns = n,
            estimate_gbps = selector.rail_stats(rail).map(|s| s.ewma_gbps),
            "rail answered a probe at speed after a stall"
        );
    }

    /// `rail` was given up on as stalled: a slice of `bytes` posted at `p` was still not
    /// delivered at `n` (see [`DeviceSelector::on_stalled`]).
    pub(crate) fn stalled_ns(&self, rail: RailId, bytes: u64, p: u64, n: u64) {
        let mut selector = self.selector.lock().expect("scheduler poisoned");
        let _ = selector.on_stalled(rail, bytes, p, n);
        tracing::debug!(
            rail,
            bytes,
            posted_ns = p,
            now_ns = n,
            estimate_gbps = selector.rail_stats(rail).map(|s| s.ewma_gbps),
            "rail stalled"
        );
    }

    /// A slice on `rail` failed.
    pub(crate) fn failed(&self, rail: RailId, bytes: u64) {
        let _ = self
            .selector
            .lock()
            .expect("scheduler poisoned")
            .on_failed(rail, bytes);
    }

    /// A slice assigned to `rail` was never posted there.
    pub(crate) fn unassigned(&self, rail: RailId, bytes: u64) {
        let _ = self
            .selector
            .lock()
            .expect("scheduler poisoned")
            .on_unassigned(rail, bytes);
    }

    /// Records the in-flight bound last computed for `rail`.
    pub(crate) fn note_window(&self, rail: RailId, bytes: u64) {
        if let Some(w) = self.windows.get(rail) {
            w.store(bytes, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The in-flight bound last computed for `rail`, bytes (0 before any traffic).
    pub(crate) fn window(&self, rail: RailId) -> u64 {
        self.windows
            .get(rail)
            .map_or(0, |w| w.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Fills `out[rail]` with each rail's EWMA bandwidth in bytes per second (as many rails as
    /// both have).
    pub(crate) fn fill_ewma_bytes_per_sec(&self, out: &mut [f64]) {
        let sel = self.selector.lock().expect("scheduler poisoned");
        for (o, s) in out.iter_mut().zip(sel.stats()) {
            *o = s.ewma_gbps * 1e9 / 8.0;
        }
    }

    /// The theoretical bandwidth of `rail`'s link, bytes per second (the selector's, from the
    /// speed the interface reports or its default); 0 for a rail it does not know.
    pub(crate) fn link_bytes_per_sec(&self, rail: usize) -> f64 {
        self.link_bytes_per_sec.get(rail).copied().unwrap_or(0.0)
    }

    /// Selector statistics per rail, in rail order, with the rail names.
    pub(crate) fn stats(&self) -> Vec<(String, selector::RailStats)> {
        let sel = self.selector.lock().expect("scheduler poisoned");
        self.topology
            .rails
            .iter()
            .map(|r| r.name.clone())
            .zip(sel.stats())
            .collect()
    }
}
