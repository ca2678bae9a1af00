//! Per-rail traffic counters, updated on the data path with relaxed atomics, and the engine's
//! traffic report (per rail and per priority); and what the engine served to its peers (per
//! rail, operation, priority and peer, and how long serving took), counted by each data
//! connection in plain integers and folded into shared atomics once per batch of answers.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use multirail_policy::qos::{Priority, LEVELS};

use crate::qos::QosTraffic;

/// The paths to peers on one rail, by health (see
/// [`Engine::rail_health`](crate::Engine::rail_health)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RailHealth {
    /// The rail's name.
    pub rail: String,
    /// Paths carrying slices.
    pub up: usize,
    /// Paths paused after repeated errors.
    pub paused: usize,
    /// Paths whose pause ended, waiting for a probe to succeed.
    pub probing: usize,
}

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

/// What the engine has carried: per rail (bytes, EWMA bandwidth, in-flight bytes and bound),
/// per priority (queue depth, wait time, promotions), and what it served to peers.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Traffic {
    /// Every rail the engine counts traffic on: its network rails, `shm`, and the interface of
    /// a routed path if one is used. Only transfers this engine initiates count here.
    pub rails: Vec<RailTraffic>,
    /// The priority queues: depth, wait p50/p99 and dequeued slices per priority, promotions,
    /// and the shared global slot in force.
    pub qos: QosTraffic,
    /// What this engine served to peers that read and wrote its memory over tcp: per rail,
    /// operation and priority, per peer (capped), and the serving latency. `rails` above counts
    /// only what this engine initiates; see [`ServedTraffic`] for what cannot be counted here
    /// (shm and RDMA).
    pub served: ServedTraffic,
}

/// Most peers whose served traffic is counted apart; traffic of any further peer is counted
/// in one `other` entry, so a crowd of peers grows neither memory nor metric series past it.
pub const MAX_SERVED_PEERS: usize = 64;

/// The name of the entry that counts the traffic of peers past [`MAX_SERVED_PEERS`].
pub const OTHER_PEERS: &str = "other";

/// Upper bounds of the serving-latency buckets, nanoseconds: 1, 2 and 5 of each decade from
/// 1 µs to 10 s (then +Inf).
const LATENCY_BOUNDS_NS: [u64; 22] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    50_000_000,
    100_000_000,
    200_000_000,
    500_000_000,
    1_000_000_000,
    2_000_000_000,
    5_000_000_000,
    10_000_000_000,
];
/// The buckets above and +Inf.
const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_NS.len() + 1;

/// An operation a target serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServedOp {
    /// A peer reads our memory: bytes go out of it.
    Read = 0,
    /// A peer writes our memory: bytes come into it.
    Write = 1,
}

const OPS: usize = 2;

#[derive(Debug, Default)]
struct LatencyCounters {
    buckets: [AtomicU64; LATENCY_BUCKETS],
    sum_ns: AtomicU64,
}

/// Live served counters of one rail (the interface a peer's connection arrived on).
#[derive(Debug)]
pub(crate) struct ServedRailCounters {
    name: String,
    bytes: [[AtomicU64; LEVELS]; OPS],
    requests: [[AtomicU64; LEVELS]; OPS],
    refused: [AtomicU64; OPS],
}

/// Live served counters of one peer (or of every peer past the cap).
#[derive(Debug)]
pub(crate) struct ServedPeerCounters {
    name: String,
    bytes: [AtomicU64; OPS],
    requests: [AtomicU64; OPS],
}

impl ServedPeerCounters {
    fn new(name: String) -> Self {
        ServedPeerCounters {
            name,
            bytes: Default::default(),
            requests: Default::default(),
        }
    }
}

#[derive(Debug, Default)]
struct ServedPeers {
    /// Peers counted apart, in the order they were first served; at most [`MAX_SERVED_PEERS`].
    known: Vec<(IpAddr, Arc<ServedPeerCounters>)>,
    /// Every other peer; created when the first one comes.
    other: Option<Arc<ServedPeerCounters>>,
}

/// What this engine's listening port served to peers, shared by its serving threads. The
/// tables are touched when a data connection starts, never per slice: a connection counts in
/// its own [`ServedTally`] and folds it in here.
#[derive(Debug, Default)]
pub(crate) struct ServedStats {
    /// Rails by the local address a connection arrived on.
    rails: Mutex<Vec<(IpAddr, Arc<ServedRailCounters>)>>,
    peers: Mutex<ServedPeers>,
    latency: [[LatencyCounters; LEVELS]; OPS],
}

impl ServedStats {
    /// A tally for a data connection that arrived on local address `local` from `peer`;
    /// `rail_name` names the rail of `local` the first time that address is seen. Control
    /// path: takes the tables' locks.
    pub(crate) fn tally(
        self: &Arc<Self>,
        local: IpAddr,
        peer: IpAddr,
        rail_name: impl FnOnce() -> String,
    ) -> ServedTally {
        let rail = {
            let mut rails = self.rails.lock().expect("stats poisoned");
            match rails.iter().find(|(a, _)| *a == local) {
                Some((_, r)) => r.clone(),
                None => {
                    let name = rail_name();
                    // Two addresses of one rail count as one rail.
                    let r = rails
                        .iter()
                        .find(|(_, r)| r.name == name)
                        .map(|(_, r)| r.clone())
                        .unwrap_or_else(|| {
                            Arc::new(ServedRailCounters {
                                name,
                                bytes: Default::default(),
                                requests: Default::default(),
                                refused: Default::default(),
                            })
                        });
                    rails.push((local, r.clone()));
                    r
                }
            }
        };
        let peer = {
            let mut peers = self.peers.lock().expect("stats poisoned");
            match peers.known.iter().find(|(a, _)| *a == peer) {
                Some((_, p)) => p.clone(),
                None if peers.known.len() < MAX_SERVED_PEERS => {
                    let p = Arc::new(ServedPeerCounters::new(peer.to_string()));
                    peers.known.push((peer, p.clone()));
                    p
                }
                None => peers
                    .other
                    .get_or_insert_with(|| {
                        Arc::new(ServedPeerCounters::new(OTHER_PEERS.to_owned()))
                    })
                    .clone(),
            }
        };
        ServedTally {
            stats: self.clone(),
            rail,
            peer,
            bytes: [[0; LEVELS]; OPS],
            requests: [[0; LEVELS]; OPS],
            refused: [0; OPS],
            latency: [[[0; LATENCY_BUCKETS]; LEVELS]; OPS],
            latency_sum_ns: [[0; LEVELS]; OPS],
            pending: false,
        }
    }

    /// What has been folded in so far.
    pub(crate) fn snapshot(&self) -> ServedTraffic {
        let op = |r: &ServedRailCounters, op: usize| {
            let priority_bytes: [u64; LEVELS] =
                std::array::from_fn(|p| r.bytes[op][p].load(Ordering::Relaxed));
            let priority_requests: [u64; LEVELS] =
                std::array::from_fn(|p| r.requests[op][p].load(Ordering::Relaxed));
            ServedOpTraffic {
                bytes: priority_bytes.iter().sum(),
                requests: priority_requests.iter().sum(),
                refused: r.refused[op].load(Ordering::Relaxed),
                priority_bytes,
                priority_requests,
            }
        };
        let mut rails: Vec<ServedRailTraffic> = Vec::new();
        for (_, r) in self.rails.lock().expect("stats poisoned").iter() {
            if rails.iter().any(|x| x.name == r.name) {
                continue;
            }
            rails.push(ServedRailTraffic {
                name: r.name.clone(),
                read: op(r, ServedOp::Read as usize),
                write: op(r, ServedOp::Write as usize),
            });
        }
        let peer = |p: &ServedPeerCounters| {
            let count = |op: ServedOp| ServedCount {
                bytes: p.bytes[op as usize].load(Ordering::Relaxed),
                requests: p.requests[op as usize].load(Ordering::Relaxed),
            };
            ServedPeerTraffic {
                peer: p.name.clone(),
                read: count(ServedOp::Read),
                write: count(ServedOp::Write),
            }
        };
        let peers = {
            let peers = self.peers.lock().expect("stats poisoned");
            peers
                .known
                .iter()
                .map(|(_, p)| p)
                .chain(&peers.other)
                .map(|p| peer(p))
                .collect()
        };
        let latency = |op: ServedOp| -> [ServedLatency; LEVELS] {
            std::array::from_fn(|p| {
                let l = &self.latency[op as usize][p];
                let counts: [u64; LATENCY_BUCKETS] =
                    std::array::from_fn(|b| l.buckets[b].load(Ordering::Relaxed));
                ServedLatency::from_buckets(&counts, l.sum_ns.load(Ordering::Relaxed))
            })
        };
        ServedTraffic {
            rails,
            peers,
            read_latency: latency(ServedOp::Read),
            write_latency: latency(ServedOp::Write),
            max_peers: MAX_SERVED_PEERS,
        }
    }
}

/// One data connection's served counts since it last folded them into [`ServedStats`]: plain
/// integers, so counting a slice costs no atomic operation and no lock. The connection folds
/// them in before it sends acknowledgements (so an initiator that saw its write complete finds
/// it counted) and after it sent READ answers; dropping the tally folds what is left.
pub(crate) struct ServedTally {
    stats: Arc<ServedStats>,
    rail: Arc<ServedRailCounters>,
    peer: Arc<ServedPeerCounters>,
    bytes: [[u64; LEVELS]; OPS],
    requests: [[u64; LEVELS]; OPS],
    refused: [u64; OPS],
    latency: [[[u64; LATENCY_BUCKETS]; LEVELS]; OPS],
    latency_sum_ns: [[u64; LEVELS]; OPS],
    /// Something is counted and not folded in yet.
    pending: bool,
}

impl ServedTally {
    /// Counts one request served: `bytes` moved at `priority`, `latency` from its frame being
    /// read to its bytes in place (WRITE) or its answer sent (READ).
    #[inline]
    pub(crate) fn served(
        &mut self,
        op: ServedOp,
        priority: Priority,
        bytes: u64,
        latency: std::time::Duration,
    ) {
        let (o, p) = (op as usize, priority.index());
        self.bytes[o][p] += bytes;
        self.requests[o][p] += 1;
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        let bucket = LATENCY_BOUNDS_NS.partition_point(|&b| b < ns);
        self.latency[o][p][bucket] += 1;
        self.latency_sum_ns[o][p] = self.latency_sum_ns[o][p].saturating_add(ns);
        self.pending = true;
    }

    /// Counts one request refused (no such buffer, wrong key, range out of bounds).
    #[inline]
    pub(crate) fn refused(&mut self, op: ServedOp) {
        self.refused[op as usize] += 1;
        self.pending = true;
    }

    /// Adds what was counted to the shared counters and starts again from zero.
    pub(crate) fn fold(&mut self) {
        if !std::mem::take(&mut self.pending) {
            return;
        }
        let add = |c: &AtomicU64, v: &mut u64| {
            if *v != 0 {
                c.fetch_add(std::mem::take(v), Ordering::Relaxed);
            }
        };
        for o in 0..OPS {
            add(&self.rail.refused[o], &mut self.refused[o]);
            let (bytes, requests): (u64, u64) =
                (self.bytes[o].iter().sum(), self.requests[o].iter().sum());
            if requests == 0 {
                continue;
            }
            self.peer.bytes[o].fetch_add(bytes, Ordering::Relaxed);
            self.peer.requests[o].fetch_add(requests, Ordering::Relaxed);
            for p in 0..LEVELS {
                if self.requests[o][p] == 0 {
                    continue;
                }
                add(&self.rail.bytes[o][p], &mut self.bytes[o][p]);
                add(&self.rail.requests[o][p], &mut self.requests[o][p]);
                let shared = &self.stats.latency[o][p];
                add(&shared.sum_ns, &mut self.latency_sum_ns[o][p]);
                for (c, v) in shared.buckets.iter().zip(&mut self.latency[o][p]) {
                    add(c, v);
                }
            }
        }
    }
}

impl Drop for ServedTally {
    fn drop(&mut self) {
        self.fold();
    }
}

/// Bytes and requests of one operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServedCount {
    /// Payload bytes served.
    pub bytes: u64,
    /// Requests (slices) served.
    pub requests: u64,
}

/// What a rail served of one operation (READ or WRITE).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServedOpTraffic {
    /// Payload bytes served: for READ sent out of this engine's memory, for WRITE written into
    /// it.
    pub bytes: u64,
    /// Requests (slices) served: each one frame a peer sent and this engine answered.
    pub requests: u64,
    /// Requests refused: no buffer at that address, the wrong key, or a range past the end of
    /// the buffer. Their bytes are in no other figure.
    pub refused: u64,
    /// `bytes` at each priority the peer gave its slices: HIGH, MEDIUM, LOW.
    pub priority_bytes: [u64; LEVELS],
    /// `requests` at each priority: HIGH, MEDIUM, LOW.
    pub priority_requests: [u64; LEVELS],
}

/// What one rail served.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServedRailTraffic {
    /// The rail a peer's connections arrived on: the name this engine publishes for the local
    /// address they reached, else the interface holding that address, else `tcp`.
    pub name: String,
    /// Peers reading this engine's memory.
    pub read: ServedOpTraffic,
    /// Peers writing this engine's memory.
    pub write: ServedOpTraffic,
}

/// What one peer was served.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServedPeerTraffic {
    /// The peer's IP address as its connections came from (a peer with several rails shows
    /// once per address), or [`OTHER_PEERS`] for every peer past [`MAX_SERVED_PEERS`].
    pub peer: String,
    /// What it read of this engine's memory.
    pub read: ServedCount,
    /// What it wrote into this engine's memory.
    pub write: ServedCount,
}

/// Serving latency of one operation at one priority: from the request's frame being read off
/// the socket to its bytes being in place (WRITE) or its answer, payload included, handed to
/// the socket (READ).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ServedLatency {
    /// Requests timed.
    pub count: u64,
    /// Median, microseconds; estimated within its bucket (the buckets are 1, 2 and 5 of each
    /// decade from 1 µs to 10 s), 0 when nothing was timed.
    pub p50_us: f64,
    /// 99th percentile, microseconds, estimated the same way.
    pub p99_us: f64,
    /// Every timed request by bucket: (upper bound in seconds, requests in that bucket and not
    /// a lower one), the last bound infinite.
    #[serde(skip)]
    pub buckets: Vec<(f64, u64)>,
    /// Sum of every latency timed, seconds.
    #[serde(skip)]
    pub sum_seconds: f64,
}

impl ServedLatency {
    fn from_buckets(counts: &[u64; LATENCY_BUCKETS], sum_ns: u64) -> ServedLatency {
        let count: u64 = counts.iter().sum();
        let buckets = LATENCY_BOUNDS_NS
            .iter()
            .map(|&b| b as f64 / 1e9)
            .chain(std::iter::once(f64::INFINITY))
            .zip(counts.iter().copied())
            .collect();
        ServedLatency {
            count,
            p50_us: quantile_us(counts, 0.5),
            p99_us: quantile_us(counts, 0.99),
            buckets,
            sum_seconds: sum_ns as f64 / 1e9,
        }
    }
}

/// The `q` quantile of bucketed counts, microseconds, interpolated linearly inside its bucket
/// as Prometheus's `histogram_quantile` does; the last finite bound when it lies past them.
fn quantile_us(counts: &[u64; LATENCY_BUCKETS], q: f64) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let rank = q * total as f64;
    let mut below = 0u64;
    for (i, &n) in counts.iter().enumerate() {
        if n > 0 && (below + n) as f64 >= rank {
            let Some(&upper) = LATENCY_BOUNDS_NS.get(i) else {
                break;
            };
            let lower = if i == 0 { 0 } else { LATENCY_BOUNDS_NS[i - 1] };
            let within = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
            return (lower as f64 + (upper - lower) as f64 * within) / 1e3;
        }
        below += n;
    }
    LATENCY_BOUNDS_NS[LATENCY_BOUNDS_NS.len() - 1] as f64 / 1e3
}

/// What this engine served to its peers over tcp: the requests their engines sent to its
/// listening port, as [`Engine::traffic_stats`](crate::Engine::traffic_stats) reports them
/// in `served`.
///
/// Counted: every READ and WRITE slice a peer sends over a tcp data connection, when its bytes
/// are in place (WRITE) or its answer was handed to the socket (READ); refused slices apart.
/// Not counted, because this engine's CPU never sees them: same-host `shm` transfers (the
/// initiator copies straight into or out of this engine's shared mapping) and RDMA slices
/// (one-sided RDMA_READ and RDMA_WRITE work requests that the NIC serves from registered
/// memory); those are counted only by the engine that initiates them, in its rails. Messages
/// and notifications are not slices: [`Engine::message_stats`](crate::Engine::message_stats)
/// counts them. All zero once the engine has shut down (the listening port and its counts are
/// gone).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ServedTraffic {
    /// Per rail a peer's connections arrived on, in the order first served.
    pub rails: Vec<ServedRailTraffic>,
    /// Per peer address, in the order first served: at most [`MAX_SERVED_PEERS`], then one
    /// [`OTHER_PEERS`] entry for every peer past them.
    pub peers: Vec<ServedPeerTraffic>,
    /// Latency of READs served, per priority: HIGH, MEDIUM, LOW.
    pub read_latency: [ServedLatency; LEVELS],
    /// Latency of WRITEs served, per priority: HIGH, MEDIUM, LOW.
    pub write_latency: [ServedLatency; LEVELS],
    /// [`MAX_SERVED_PEERS`]: most peers counted apart.
    pub max_peers: usize,
}

impl ServedTraffic {
    /// READs served on every rail together.
    pub fn read(&self) -> ServedOpTraffic {
        Self::total(self.rails.iter().map(|r| &r.read))
    }

    /// WRITEs served on every rail together.
    pub fn write(&self) -> ServedOpTraffic {
        Self::total(self.rails.iter().map(|r| &r.write))
    }

    fn total<'a>(ops: impl Iterator<Item = &'a ServedOpTraffic>) -> ServedOpTraffic {
        let mut t = ServedOpTraffic::default();
        for o in ops {
            t.bytes += o.bytes;
            t.requests += o.requests;
            t.refused += o.refused;
            for p in 0..LEVELS {
                t.priority_bytes[p] += o.priority_bytes[p];
                t.priority_requests[p] += o.priority_requests[p];
            }
        }
        t
    }

    /// What was served, in the style of the rest of the traffic report:
    /// `=== Served Traffic Statistics ===`, then per rail
    /// `Rail lo: READ Bytes=…, Requests=…, Refused=…; WRITE Bytes=…, Requests=…, Refused=…`,
    /// per peer `Peer 10.0.0.2: READ Bytes=…, Requests=…; WRITE Bytes=…, Requests=…`, and per
    /// operation and priority `READ HIGH: Requests=…, Latency p50=… us, p99=… us`. Rails and
    /// peers appear once served; the latency lines always.
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let mut out = String::from("=== Served Traffic Statistics ===\n");
        for r in &self.rails {
            let _ = writeln!(
                out,
                "Rail {}: READ Bytes={}, Requests={}, Refused={}; WRITE Bytes={}, Requests={}, Refused={}",
                r.name,
                r.read.bytes,
                r.read.requests,
                r.read.refused,
                r.write.bytes,
                r.write.requests,
                r.write.refused
            );
        }
        for p in &self.peers {
            let _ = writeln!(
                out,
                "Peer {}: READ Bytes={}, Requests={}; WRITE Bytes={}, Requests={}",
                p.peer, p.read.bytes, p.read.requests, p.write.bytes, p.write.requests
            );
        }
        for (op, latency) in [("READ", &self.read_latency), ("WRITE", &self.write_latency)] {
            for (name, l) in ["HIGH", "MEDIUM", "LOW"].iter().zip(latency) {
                let _ = writeln!(
                    out,
                    "{op} {name}: Requests={}, Latency p50={:.1} us, p99={:.1} us",
                    l.count, l.p50_us, l.p99_us
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use std::time::Duration;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    #[test]
    fn a_tally_counts_nothing_shared_until_folded_and_everything_after() {
        let stats = Arc::new(ServedStats::default());
        let mut t = stats.tally(ip(1), ip(2), || "eth0".into());
        t.served(
            ServedOp::Write,
            Priority::Low,
            1000,
            Duration::from_micros(3),
        );
        t.served(
            ServedOp::Write,
            Priority::Low,
            24,
            Duration::from_micros(30),
        );
        t.served(ServedOp::Read, Priority::High, 7, Duration::from_millis(3));
        t.refused(ServedOp::Read);
        assert_eq!(stats.snapshot().write().bytes, 0, "not folded yet");
        t.fold();
        let s = stats.snapshot();
        assert_eq!(s.rails.len(), 1);
        assert_eq!(s.rails[0].name, "eth0");
        let (w, r) = (s.write(), s.read());
        assert_eq!((w.bytes, w.requests, w.refused), (1024, 2, 0));
        assert_eq!(w.priority_bytes, [0, 0, 1024]);
        assert_eq!((r.bytes, r.requests, r.refused), (7, 1, 1));
        assert_eq!(s.peers.len(), 1);
        assert_eq!(s.peers[0].peer, "10.0.0.2");
        assert_eq!(
            s.peers[0].write,
            ServedCount {
                bytes: 1024,
                requests: 2
            }
        );
        let l = &s.write_latency[Priority::Low.index()];
        assert_eq!(l.count, 2);
        assert!((l.sum_seconds - 33e-6).abs() < 1e-12);
        // 3 µs lies in (2, 5] µs, 30 µs in (20, 50] µs.
        assert_eq!(l.buckets[2], (5e-6, 1));
        assert_eq!(l.buckets[5], (50e-6, 1));
        assert_eq!(l.buckets.last().unwrap().0, f64::INFINITY);
        // Folding again adds nothing; dropping folds what is left.
        t.fold();
        t.served(ServedOp::Write, Priority::Low, 1, Duration::ZERO);
        drop(t);
        assert_eq!(stats.snapshot().write().bytes, 1025);
    }

    #[test]
    fn connections_on_one_rail_and_from_one_peer_share_their_counters() {
        let stats = Arc::new(ServedStats::default());
        let mut a = stats.tally(ip(1), ip(9), || "eth0".into());
        // Another address of the same rail, and the name asked only once per address.
        let mut b = stats.tally(ip(3), ip(9), || "eth0".into());
        let mut c = stats.tally(ip(1), ip(9), || unreachable!("the address is known"));
        for t in [&mut a, &mut b, &mut c] {
            t.served(ServedOp::Read, Priority::Medium, 10, Duration::ZERO);
            t.fold();
        }
        let s = stats.snapshot();
        assert_eq!(s.rails.len(), 1);
        assert_eq!(s.read().requests, 3);
        assert_eq!(s.peers.len(), 1);
        assert_eq!(s.peers[0].read.bytes, 30);
    }

    #[test]
    fn peers_past_the_cap_share_one_other_entry() {
        let stats = Arc::new(ServedStats::default());
        for i in 0..MAX_SERVED_PEERS + 10 {
            let peer = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i as u32));
            let mut t = stats.tally(ip(1), peer, || "eth0".into());
            t.served(ServedOp::Write, Priority::High, 1, Duration::ZERO);
        }
        let s = stats.snapshot();
        assert_eq!(s.peers.len(), MAX_SERVED_PEERS + 1);
        assert_eq!(s.peers[MAX_SERVED_PEERS].peer, OTHER_PEERS);
        assert_eq!(s.peers[MAX_SERVED_PEERS].write.requests, 10);
        assert_eq!(s.write().requests, MAX_SERVED_PEERS as u64 + 10);
    }

    #[test]
    fn quantiles_interpolate_inside_their_bucket() {
        let mut counts = [0u64; LATENCY_BUCKETS];
        assert_eq!(quantile_us(&counts, 0.5), 0.0);
        // 100 in (10, 20] µs: the median halfway, p99 near the top.
        counts[4] = 100;
        assert!((quantile_us(&counts, 0.5) - 15.0).abs() < 1e-9);
        assert!((quantile_us(&counts, 0.99) - 19.9).abs() < 1e-9);
        // One in the first bucket (0, 1] µs and one past every bound.
        let mut counts = [0u64; LATENCY_BUCKETS];
        counts[0] = 1;
        counts[LATENCY_BUCKETS - 1] = 1;
        assert!((quantile_us(&counts, 0.5) - 1.0).abs() < 1e-9);
        assert_eq!(quantile_us(&counts, 0.99), 10e6);
    }

    #[test]
    fn the_report_has_a_line_per_rail_peer_and_latency() {
        let stats = Arc::new(ServedStats::default());
        let mut t = stats.tally(ip(1), ip(2), || "eth0".into());
        t.served(
            ServedOp::Read,
            Priority::High,
            4096,
            Duration::from_micros(15),
        );
        t.refused(ServedOp::Write);
        drop(t);
        let report = stats.snapshot().report();
        assert!(report.starts_with("=== Served Traffic Statistics ===\n"));
        assert!(report.contains(
            "Rail eth0: READ Bytes=4096, Requests=1, Refused=0; WRITE Bytes=0, Requests=0, Refused=1\n"
        ));
        assert!(report
            .contains("Peer 10.0.0.2: READ Bytes=4096, Requests=1; WRITE Bytes=0, Requests=0\n"));
        assert!(report.contains("READ HIGH: Requests=1, Latency p50=15.0 us, p99=19.9 us\n"));
        assert!(report.contains("WRITE LOW: Requests=0, Latency p50=0.0 us, p99=0.0 us\n"));
        assert_eq!(report.lines().count(), 1 + 1 + 1 + 6);
    }
}
