//! Per-rail traffic counters, updated on the data path with relaxed atomics, and the engine's
//! traffic report (per rail and per priority).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use multirail_policy::qos::{Priority, LEVELS};

use crate::qos::QosTraffic;

/// Live counters of one rail.
#[derive(Debug)]
pub(crate) struct RailCounters {
    name: String,
    bytes: AtomicU64,
    slices: AtomicU64,
    errors: AtomicU64,
    /// Bytes moved per priority (HIGH, MEDIUM, LOW): shows which rails priority filtering
    /// kept bulk away from.
    priority_bytes: [AtomicU64; LEVELS],
}

impl RailCounters {
    /// Counts `slices` slices of `bytes` in all, moved at `priority` (values above LOW count
    /// as LOW).
    pub(crate) fn record_at(&self, priority: Priority, bytes: u64, slices: u64) {
        self.record(bytes, slices);
        self.priority_bytes[priority.index()].fetch_add(bytes, Ordering::Relaxed);
    }
    pub(crate) fn record(&self, bytes: u64, slices: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.slices.fetch_add(slices, Ordering::Relaxed);
    }
    pub(crate) fn record_error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// What one rail carried since the engine started.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RailTraffic {
    /// Rail name: a network interface, or `shm` for same-host copies.
    pub name: String,
    /// Payload bytes moved.
    pub bytes: u64,
    /// Slices moved.
    pub slices: u64,
    /// Slices that failed.
    pub errors: u64,
    /// Payload bytes moved at each priority: HIGH, MEDIUM, LOW. A slice counts at the level it
    /// left the queues at, so a promoted LOW slice counts as MEDIUM or HIGH.
    pub priority_bytes: [u64; LEVELS],
    /// The scheduler's EWMA bandwidth estimate, Gbps (network rails only).
    pub ewma_gbps: Option<f64>,
    /// Bytes assigned to the rail and not yet answered (network rails only).
    pub inflight_bytes: u64,
    /// Bound on bytes in flight per path on this rail (about its bandwidth-delay product), as
    /// last computed; 0 before any traffic (network rails only).
    pub window_bytes: u64,
}

/// The set of rails that have carried traffic, created on first use.
#[derive(Default)]
pub(crate) struct TrafficStats {
    rails: Mutex<Vec<Arc<RailCounters>>>,
}

impl TrafficStats {
    /// Counters for rail `name`, created if new. Called when a connection or worker is set up,
    /// never per slice.
    pub(crate) fn rail(&self, name: &str) -> Arc<RailCounters> {
        let mut rails = self.rails.lock().expect("stats poisoned");
        if let Some(r) = rails.iter().find(|r| r.name == name) {
            return r.clone();
        }
        let r = Arc::new(RailCounters {
            name: name.to_owned(),
            bytes: AtomicU64::new(0),
            slices: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            priority_bytes: Default::default(),
        });
        rails.push(r.clone());
        r
    }

    pub(crate) fn snapshot(&self) -> Vec<RailTraffic> {
        let rails = self.rails.lock().expect("stats poisoned");
        rails
            .iter()
            .map(|r| RailTraffic {
                name: r.name.clone(),
                bytes: r.bytes.load(Ordering::Relaxed),
                slices: r.slices.load(Ordering::Relaxed),
                errors: r.errors.load(Ordering::Relaxed),
                priority_bytes: std::array::from_fn(|p| {
                    r.priority_bytes[p].load(Ordering::Relaxed)
                }),
                ewma_gbps: None,
                inflight_bytes: 0,
                window_bytes: 0,
            })
            .collect()
    }
}

/// What the engine has carried: per rail (bytes, EWMA bandwidth, in-flight bytes and bound) and
/// per priority (queue depth, wait time, promotions).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Traffic {
    /// Every rail the engine counts traffic on: its network rails, `shm`, and the interface of
    /// a routed path if one is used.
    pub rails: Vec<RailTraffic>,
    /// The priority queues: depth, wait p50/p99 and dequeued slices per priority, promotions,
    /// and the shared global slot in force.
    pub qos: QosTraffic,
}
