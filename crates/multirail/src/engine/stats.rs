//! What an engine reports about itself: traffic per rail and priority, rail health, served
//! traffic, connections, messages, the metadata store, RDMA counters, and the Prometheus endpoint
//! that serves them.

use std::sync::Arc;

use super::Engine;
use crate::error::Result;
use crate::listener::Server;
use crate::metadata;
use crate::metrics_http::{MetricsServer, Snapshot};
use crate::qos::QosTraffic;
use crate::server::ConnectionStats;
use crate::stats::{RailHealth, Traffic};
use crate::topology;
use crate::transport::rdma::RdmaStats;

impl Engine {
    /// Counts of this engine's use of its metadata store: lookups, publishes, watch updates
    /// (and their failures). Never fails.
    pub fn metadata_stats(&self) -> metadata::MetadataStats {
        self.inner
            .metadata_counters
            .snapshot(self.inner.metadata.health())
    }

    /// How the tcp paths to connected peers stand on each rail this engine sends on: how
    /// many are up, paused after repeated errors, or probing before they rejoin. A rail whose
    /// every path is paused is a dead NIC or link as this engine sees it. Never fails.
    pub fn rail_health(&self) -> Vec<RailHealth> {
        use multirail_policy::health::RailState;
        let rails = self.inner.scheduler.topology().rails.clone();
        let mut out: Vec<RailHealth> = rails
            .iter()
            .map(|r| RailHealth {
                rail: r.name.clone(),
                ..RailHealth::default()
            })
            .collect();
        for (rail, state) in self.inner.tcp.path_health() {
            let Some(h) = out.get_mut(rail) else { continue };
            match state {
                RailState::Up => h.up += 1,
                RailState::Paused { .. } => h.paused += 1,
                RailState::Probing => h.probing += 1,
            }
        }
        out
    }

    /// Requests this engine's batches finished: (completed, failed). Never fails.
    pub fn transfer_stats(&self) -> (u64, u64) {
        self.inner.transfers.snapshot()
    }

    /// Counts of the messages this engine sent and received. Never fails.
    pub fn message_stats(&self) -> crate::messaging::MessageStats {
        self.inner.messaging.message_stats()
    }

    /// What the engine has carried since it started. Per rail: bytes, slices and errors, bytes
    /// per priority, and for network rails the scheduler's EWMA bandwidth, the bytes in flight
    /// and the bound on them (`window_bytes`); these count only transfers this engine
    /// initiates. Per priority: queue depth, wait time (p50/p99), slices dequeued, and
    /// promotions. In `served`: what peers read and wrote of this engine's memory over tcp, per
    /// rail, operation, priority and peer, and the serving latency (shm and RDMA transfers
    /// never reach this engine's CPU and are not in it: see [`crate::stats::ServedTraffic`]).
    /// Never fails; `served` is all zero once the engine has shut down.
    pub fn traffic_stats(&self) -> Traffic {
        let mut rails = self.inner.stats.snapshot();
        let schedulers = std::iter::once(&self.inner.scheduler).chain(self.inner.rdma.scheduler());
        for scheduler in schedulers {
            for (i, (name, s)) in scheduler.stats().into_iter().enumerate() {
                if let Some(r) = rails.iter_mut().find(|r| r.name == name) {
                    r.ewma_gbps = Some(s.ewma_gbps);
                    r.inflight_bytes = s.inflight_bytes;
                    r.window_bytes = scheduler.window(i);
                }
            }
        }
        Traffic {
            rails,
            qos: self.inner.qos.snapshot(),
            served: self.served_stats(),
        }
    }

    /// The served part of [`Engine::traffic_stats`]: what the listening port served to peers.
    fn served_stats(&self) -> crate::stats::ServedTraffic {
        self.inner
            .server
            .lock()
            .expect("engine poisoned")
            .as_ref()
            .map(Server::served)
            .unwrap_or_default()
    }

    /// The priority part of [`Engine::traffic_stats`]: per-priority queue depth, wait time
    /// (p50/p99) and promotions.
    pub fn qos_stats(&self) -> QosTraffic {
        self.inner.qos.snapshot()
    }

    /// What the listening port holds and has refused: open and pending connections, and
    /// counts of strangers refused (no membership), connections shed and failed accepts.
    /// All zero once the engine has shut down.
    pub fn connection_stats(&self) -> ConnectionStats {
        self.inner
            .server
            .lock()
            .expect("engine poisoned")
            .as_ref()
            .map(Server::stats)
            .unwrap_or_default()
    }

    /// The scheduler's view of the rails in TENT's format: `=== Device Traffic Statistics ===`,
    /// then `Dev N: Total=… GB, EWMA BW=… Gbps, Inflight=… bytes` per rail, in rail order;
    /// then the priority queues: `=== Priority Queue Statistics ===` and one line per priority;
    /// then what this engine served to peers over tcp: `=== Served Traffic Statistics ===`,
    /// one line per rail and per peer served, and the serving latency per operation and
    /// priority (see [`crate::stats::ServedTraffic::report`]).
    pub fn traffic_stats_report(&self) -> String {
        let stats: Vec<_> = self
            .inner
            .scheduler
            .stats()
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        let mut out = multirail_policy::selector::format_traffic_stats(&stats);
        out.push_str(&self.inner.qos.snapshot().report());
        out.push_str(&self.served_stats().report());
        out
    }

    /// Prints [`Engine::traffic_stats_report`] to standard output.
    pub fn print_traffic_stats(&self) {
        print!("{}", self.traffic_stats_report());
    }

    /// The rails this engine sends on, in scheduler order (`Dev N` in the report).
    pub fn rails(&self) -> Vec<topology::Rail> {
        self.inner.scheduler.topology().rails.clone()
    }

    /// Counts of the RDMA data path: `ibv_post_send` calls, work requests, signalled
    /// completions, slices and queue pairs lost. All zero without RDMA.
    pub fn rdma_stats(&self) -> RdmaStats {
        self.inner.rdma.stats()
    }

    /// Why the RDMA transport is off (no libibverbs, no active port, disabled), or `None`
    /// when it is on.
    pub fn rdma_off_reason(&self) -> Option<String> {
        self.inner.rdma.off_reason().map(str::to_owned)
    }

    /// Serves this engine's statistics as Prometheus metrics at `http://ADDR:PORT/metrics`
    /// (OpenMetrics text; [`crate::metrics_http`] lists the metrics) from a background thread,
    /// until the returned server is dropped or shut down. The server holds no strong handle on
    /// the engine: once the engine is dropped it answers 503. `addr` is `ADDR:PORT`; port 0
    /// picks a free port ([`crate::MetricsServer::local_addr`] tells which). Fails with
    /// `InvalidArgument` when `addr` is not an address, and with `Io` naming `addr` when it
    /// cannot be bound.
    pub fn serve_metrics(&self, addr: &str) -> Result<MetricsServer> {
        let inner = Arc::downgrade(&self.inner);
        MetricsServer::start(addr, move || {
            // The handle lives only while the figures are read, not while they are encoded.
            let engine = Engine::momentary(inner.upgrade()?);
            Some(engine.metrics_snapshot())
        })
    }

    /// What one scrape of [`Engine::serve_metrics`]'s endpoint reports.
    fn metrics_snapshot(&self) -> Snapshot {
        Snapshot {
            segment: self.name(),
            traffic: self.traffic_stats(),
            rails: self.rails(),
            connections: self.connection_stats(),
            rdma: self.rdma_stats(),
            lanes: self.lanes(),
            health: self.rail_health(),
            messages: self.message_stats(),
            metadata: self.metadata_stats(),
            transfers: self.transfer_stats(),
        }
    }
}
