//! Per-rail traffic counters, updated on the data path with relaxed atomics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Live counters of one rail.
#[derive(Debug)]
pub(crate) struct RailCounters {
    name: String,
    bytes: AtomicU64,
    slices: AtomicU64,
    errors: AtomicU64,
}

impl RailCounters {
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
                ewma_gbps: None,
                inflight_bytes: 0,
                window_bytes: 0,
            })
            .collect()
    }
}
