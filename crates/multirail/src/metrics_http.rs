//! Prometheus metrics of an engine over HTTP.
//!
//! [`crate::Engine::serve_metrics`] starts a [`MetricsServer`]: a small synchronous HTTP server
//! (`tiny_http`) whose thread answers `GET /metrics` with the engine's statistics in the
//! OpenMetrics text format that `prometheus-client`'s text encoder writes (content type
//! [`CONTENT_TYPE`]) when the request's `Accept` names OpenMetrics, as Prometheus's does, and
//! in the older Prometheus text format ([`PROMETHEUS_TEXT`]) otherwise, which is what curl and
//! `promtool check metrics` read. Every figure is read at scrape time from what
//! the engine already counts ([`crate::Engine::traffic_stats`], `connection_stats`,
//! `rdma_stats`, `lanes`, `rails`, `rail_health`, `message_stats`, `metadata_stats`): the
//! data path only bumps relaxed counters. A scrape takes the same
//! short locks `traffic_stats` and `lanes` take.
//!
//! The server holds no strong handle on the engine: once the engine is dropped, `/metrics`
//! answers 503. Any other path answers 404, and another method than `GET` or `HEAD` on
//! `/metrics` 405.
//!
//! The metrics (OpenMetrics appends `_total` to counter samples and `_info` to info samples):
//!
//! | metric | type | labels | from |
//! | --- | --- | --- | --- |
//! | `multirail_engine_info` | info | `segment` | the engine's segment name |
//! | `multirail_rail_bytes_total` | counter | `rail`, `priority` | payload bytes per rail and priority |
//! | `multirail_rail_slices_total` | counter | `rail` | slices completed per rail (the engine does not split them by priority) |
//! | `multirail_rail_slice_errors_total` | counter | `rail` | slices failed per rail |
//! | `multirail_rail_inflight_bytes` | gauge | `rail` | bytes assigned and not answered (network rails) |
//! | `multirail_rail_window_bytes` | gauge | `rail` | bound on bytes in flight per path (network rails) |
//! | `multirail_rail_bandwidth_estimate_bytes_per_second` | gauge | `rail` | the scheduler's EWMA (network rails) |
//! | `multirail_rail_assumed_bandwidth_bytes_per_second` | gauge | `rail` | the speed scheduling assumes |
//! | `multirail_qos_queued_entries` | gauge | `priority` | queue depth |
//! | `multirail_qos_dequeued_entries_total` | counter | `priority` | entries that left the queue |
//! | `multirail_qos_wait_p50_seconds`, `multirail_qos_wait_p99_seconds` | gauge | `priority` | wait p50 and p99 since the engine started |
//! | `multirail_qos_wait_seconds` | histogram | `priority`, `le` | every wait since the engine started, 10 µs to 5 s buckets |
//! | `multirail_qos_promotions_total` | counter | | entries promoted one level |
//! | `multirail_qos_global_slot` | gauge | | shared slot in force (only with shared slots) |
//! | `multirail_connections_open` | gauge | | connections held |
//! | `multirail_connections_pending` | gauge | | connections not past the handshake |
//! | `multirail_connections_accepted_total` | counter | | connections accepted |
//! | `multirail_connections_refused_total` | counter | `reason` (`not_member`, `full`) | connections refused |
//! | `multirail_connections_shed_total` | counter | `kind` (`pending`, `idle`) | connections closed to make room |
//! | `multirail_connections_accept_errors_total` | counter | | failed accepts |
//! | `multirail_server_threads` | gauge | | threads serving connections |
//! | `multirail_rdma_*_total` | counter | | RDMA post calls, work requests, signalled completions, slices, queue pairs lost, messages sent, sent inline and received (0 without RDMA) |
//! | `multirail_lanes_peers` | gauge | `direction` | peers with a message lane |
//! | `multirail_lanes_dedicated` | gauge | `direction` | of those, on a dedicated lane |
//! | `multirail_lanes_max_dedicated` | gauge | | `lanes.max_dedicated` |
//! | `multirail_lane_promotions_total` | counter | `direction` | lane changes to dedicated |
//! | `multirail_lane_demotions_total` | counter | `direction` | lane changes to shared |
//! | `multirail_lane_denials_total` | counter | `direction` | dedicated lanes denied (received outgoing, sent incoming) |
//! | `multirail_lane_evictions_total` | counter | `direction` | dedicated lanes demoted for a stronger peer |
//! | `multirail_message_receive_buffer_bytes` | gauge | | receive buffers held for messages |
//! | `multirail_transfers_total` | counter | `outcome` | requests finished, `completed` or `failed` |
//! | `multirail_rail_paths` | gauge | `rail`, `state` | tcp paths to connected peers by health: `up`, `paused`, `probing` |
//! | `multirail_messages_total` | counter | `direction` | messages sent (successfully) and received |
//! | `multirail_message_bytes_total` | counter | `direction` | their payload bytes |
//! | `multirail_message_send_failures_total` | counter | | sends that failed |
//! | `multirail_message_credit_waits_total` | counter | | sends that waited for a credit (or shared-ring space) |
//! | `multirail_metadata_lookups_total` | counter | `outcome` | descriptor lookups in the metadata store, `ok` or `failed` |
//! | `multirail_metadata_publishes_total` | counter | `outcome` | publishes of this engine's descriptor |
//! | `multirail_metadata_watch_updates_total` | counter | | open segments updated from the store's watch |
//! | `multirail_metadata_store_state` | gauge | `state` | 1 for the store's state, `up`, `down`, `unknown` (nothing asked yet) or `not_used` (peer-to-peer lookups), 0 for the others |
//! | `multirail_metadata_store_failures_in_a_row` | gauge | | requests to the store that failed since it last answered |
//! | `multirail_metadata_refreshes_total` | counter | | renewals of what this engine published (etcd lease keep-alives, HTTP re-PUTs) the store took |
//! | `multirail_metadata_republishes_total` | counter | | times this engine's keys were lost or never stored and were published again once the store answered |
//! | `multirail_served_bytes_total` | counter | `rail`, `op`, `priority` | payload bytes peers read from (`op="read"`) and wrote into (`op="write"`) this engine's memory over tcp |
//! | `multirail_served_requests_total` | counter | `rail`, `op`, `priority` | requests (slices) served |
//! | `multirail_served_refused_total` | counter | `rail`, `op` | requests refused (no buffer, wrong key, out of bounds) |
//! | `multirail_served_peer_bytes_total` | counter | `peer`, `op` | payload bytes served per peer address (at most 64, then `peer="other"`) |
//! | `multirail_served_peer_requests_total` | counter | `peer`, `op` | requests served per peer address |
//! | `multirail_served_latency_seconds` | histogram | `op`, `priority`, `le` | from a request's frame being read to its bytes in place (write) or its answer sent (read), 1 µs to 10 s buckets |
//! | `multirail_served_latency_p50_seconds`, `multirail_served_latency_p99_seconds` | gauge | `op`, `priority` | that latency's median and 99th percentile, estimated within its bucket |
//!
//! `priority` is `high`, `medium` or `low`; `op` is `read` or `write`; `direction` is
//! `outgoing` (what this engine sends) or `incoming` (what it receives) for lanes, `sent` or
//! `received` for messages. `rail` is the name the engine counts under: bytes, slices and
//! errors count on the interface that carried them (a routed path's, e.g. `lo` for a peer on
//! loopback, or `shm`), the scheduler's gauges on the rail it scheduled (as
//! [`crate::Engine::traffic_stats`] reports them).
//!
//! Rail counters (`multirail_rail_*`) are kept by the engine that initiates a transfer; what
//! an engine serves to peers that read and write its memory counts in `multirail_served_*`
//! instead, so a target whose memory peers read at GB/s shows it there. Served traffic is what
//! reaches the target's CPU: tcp slices. Same-host shm copies and one-sided RDMA reads and
//! writes are done by the initiator (its CPU, or the NICs) without the target seeing them, so
//! only the initiator counts them. A served `rail` is the rail this engine publishes for the
//! local address a peer's connection reached (else the interface holding that address);
//! `peer` is the address the connection came from, so a peer with several rails shows once per
//! address. After the engine shuts down the served figures read 0.

use std::fmt;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use crate::metadata::{MetadataStats, StoreState};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::error::{Error, Result};
use crate::messaging::{Lane, LanesReport, MessageStats};
use crate::server::ConnectionStats;
use crate::stats::{RailHealth, Traffic};
use crate::topology::Rail;
use crate::transport::rdma::RdmaStats;

/// Content type of a `/metrics` answer: the OpenMetrics 1.0 text format, which
/// `prometheus_client::encoding::text::encode` writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Content type of the Prometheus text format (0.0.4), served to clients that do not ask for
/// OpenMetrics (curl, `promtool check metrics`).
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The Prometheus text format (0.0.4) of an OpenMetrics exposition as prometheus-client
/// writes it: the same samples, with counter families named by their `_total` samples and
/// info families as gauges named by their `_info` samples (the older format knows neither
/// suffix nor the info type), and no `# UNIT` or `# EOF` lines.
fn prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut help: Option<(&str, &str)> = None;
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            // Held until the TYPE line says what the family's samples are called.
            help = rest.split_once(' ');
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                other => (name.to_owned(), other),
            };
            if let Some((help_of, text)) = help.take() {
                if help_of == rest.split(' ').next().unwrap_or_default() {
                    out.push_str(&format!("# HELP {name} {text}\n"));
                }
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

const PRIORITIES: [&str; 3] = ["high", "medium", "low"];

/// Gathers the figures of one scrape; `None` once their source (the engine) is gone.
type StatsSource = Box<dyn Fn() -> Option<Snapshot> + Send>;

/// A running metrics endpoint, from [`crate::Engine::serve_metrics`]. Its thread answers until
/// this is dropped or [`MetricsServer::shutdown`] is called.
pub struct MetricsServer {
    addr: SocketAddr,
    http: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MetricsServer {
    /// Binds `addr` (`ADDR:PORT`, a host name allowed; port 0 picks a free port) and starts the
    /// thread answering scrapes with what `stats` gathers (`None`: the engine is gone, answer
    /// 503). Fails with `InvalidArgument` when
    /// `addr` does not resolve to a socket address, and with `Io` naming `addr` when it cannot
    /// be bound or the thread cannot be spawned.
    pub(crate) fn start(
        addr: &str,
        stats: impl Fn() -> Option<Snapshot> + Send + 'static,
    ) -> Result<MetricsServer> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::invalid("addr", format!("{addr:?} is not ADDR:PORT: {e}")))?
            .collect();
        if addrs.is_empty() {
            return Err(Error::invalid(
                "addr",
                format!("{addr:?} resolves to no address"),
            ));
        }
        let listener = TcpListener::bind(&addrs[..])
            .map_err(|e| Error::io(format!("cannot serve metrics on {addr}"), e))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io(format!("cannot serve metrics on {addr}"), e))?;
        let http = tiny_http::Server::from_listener(listener, None).map_err(|e| {
            Error::io(
                format!("cannot serve metrics on {addr}"),
                std::io::Error::other(e.to_string()),
            )
        })?;
        let http = Arc::new(http);
        let served = http.clone();
        let stats: StatsSource = Box::new(stats);
        let thread = thread::Builder::new()
            .name("mr-metrics".into())
            .spawn(move || serve(&served, &*stats))
            .map_err(|e| Error::io("spawning the metrics thread", e))?;
        Ok(MetricsServer {
            addr: bound,
            http,
            thread: Some(thread),
        })
    }

    /// The address the endpoint listens on (with the port picked when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL to scrape: `http://ADDR:PORT/metrics`.
    pub fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }

    /// Stops answering and closes the port; same as dropping the server. Returns once the
    /// serving thread has ended.
    pub fn shutdown(self) {}
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.http.unblock();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the metrics thread panicked");
            }
        }
        // Dropping the last handle on the tiny_http server closes the port.
    }
}

/// Answers requests one at a time until the server is unblocked (dropped) or its accept thread
/// fails.
fn serve(http: &tiny_http::Server, stats: &dyn Fn() -> Option<Snapshot>) {
    loop {
        let request = match http.recv() {
            Ok(r) => r,
            Err(e) => {
                // Unblocked by `MetricsServer::drop`, or the listener failed for good.
                tracing::debug!(error = %e, "metrics endpoint stops");
                return;
            }
        };
        let accept = request
            .headers()
            .iter()
            .find(|h| h.field.equiv("Accept"))
            .map(|h| h.value.as_str().to_owned());
        let (status, content_type, body) =
            answer(request.method(), request.url(), accept.as_deref(), stats);
        let mut response = tiny_http::Response::from_string(body).with_status_code(status);
        if let Ok(h) = tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes())
        {
            response = response.with_header(h);
        }
        if status == 405 {
            if let Ok(h) = tiny_http::Header::from_bytes(&b"Allow"[..], &b"GET, HEAD"[..]) {
                response = response.with_header(h);
            }
        }
        if let Err(e) = request.respond(response) {
            tracing::debug!(error = %e, "metrics answer not delivered");
        }
    }
}

/// Status, content type and body of the answer to `method url`: OpenMetrics when `accept`
/// names it (Prometheus does), else the Prometheus text format.
fn answer(
    method: &tiny_http::Method,
    url: &str,
    accept: Option<&str>,
    stats: &dyn Fn() -> Option<Snapshot>,
) -> (u16, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    let path = url.split(['?', '#']).next().unwrap_or_default();
    if path != "/metrics" {
        return (404, TEXT, "not found; metrics are at /metrics\n".into());
    }
    if !matches!(method, tiny_http::Method::Get | tiny_http::Method::Head) {
        return (405, TEXT, "only GET and HEAD are allowed\n".into());
    }
    // A panic reading the engine (a poisoned lock) must not end this thread: scrapes queued
    // behind it would then wait forever. The source keeps no handle on the engine across the
    // encoding: the engine may be dropped meanwhile.
    let snapshot = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(stats)) {
        Ok(None) => return (503, TEXT, "the engine has been dropped\n".into()),
        Ok(Some(s)) => Ok(s),
        Err(e) => Err(e),
    };
    match snapshot.map(encode) {
        Ok(Ok(text)) if accept.is_some_and(|a| a.contains("application/openmetrics-text")) => {
            (200, CONTENT_TYPE, text)
        }
        Ok(Ok(text)) => (200, PROMETHEUS_TEXT, prometheus_text(&text)),
        Ok(Err(_)) => (500, TEXT, "encoding the metrics failed\n".into()),
        Err(_) => (500, TEXT, "reading the engine's statistics failed\n".into()),
    }
}

/// What one scrape reads from the engine: the figures it already counts, gathered by
/// [`crate::Engine::serve_metrics`]'s source from `traffic_stats`, `rails`, `connection_stats`,
/// `rdma_stats`, `lanes`, `rail_health`, `message_stats`, `metadata_stats` and
/// `transfer_stats`.
#[derive(Debug)]
pub(crate) struct Snapshot {
    /// The engine's segment name.
    pub(crate) segment: String,
    /// Traffic per rail and priority, and what the engine served.
    pub(crate) traffic: Traffic,
    /// The rails the engine sends on.
    pub(crate) rails: Vec<Rail>,
    /// What the listening port holds and has refused.
    pub(crate) connections: ConnectionStats,
    /// RDMA counters (zero without RDMA).
    pub(crate) rdma: RdmaStats,
    /// Message lanes per peer.
    pub(crate) lanes: LanesReport,
    /// Paths per rail by health.
    pub(crate) health: Vec<RailHealth>,
    /// Messages sent and received.
    pub(crate) messages: MessageStats,
    /// Use of the metadata store.
    pub(crate) metadata: MetadataStats,
    /// Requests finished: (completed, failed).
    pub(crate) transfers: (u64, u64),
}

/// The OpenMetrics text of `snapshot`, `# EOF` included.
fn encode(snapshot: Snapshot) -> std::result::Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(snapshot));
    let mut out = String::with_capacity(8 << 10);
    prometheus_client::encoding::text::encode(&mut out, &registry)?;
    Ok(out)
}

type Labels<'a> = Vec<(&'static str, &'a str)>;

/// Writes metric families into one descriptor encoder.
struct Families<'e> {
    encoder: DescriptorEncoder<'e>,
}

impl Families<'_> {
    /// One family of `kind` (counter or gauge) with a sample per label set.
    fn family<V, M: EncodeMetric>(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        samples: &[(Labels<'_>, V)],
        metric: impl Fn(&V) -> M,
        kind: MetricType,
    ) -> fmt::Result {
        let mut family = self
            .encoder
            .encode_descriptor(name, help, unit.as_ref(), kind)?;
        for (labels, v) in samples {
            metric(v).encode(family.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn counters(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        samples: &[(Labels<'_>, u64)],
    ) -> fmt::Result {
        self.family(
            name,
            help,
            unit,
            samples,
            |v| ConstCounter::new(*v),
            MetricType::Counter,
        )
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) -> fmt::Result {
        let metric = ConstCounter::new(value);
        metric.encode(
            self.encoder
                .encode_descriptor(name, help, None, metric.metric_type())?,
        )
    }

    fn gauges<V: EncodeGaugeValue + Copy>(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        samples: &[(Labels<'_>, V)],
    ) -> fmt::Result {
        self.family(
            name,
            help,
            unit,
            samples,
            |v| ConstGauge::new(*v),
            MetricType::Gauge,
        )
    }

    fn gauge<V: EncodeGaugeValue>(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        value: V,
    ) -> fmt::Result {
        let metric = ConstGauge::new(value);
        metric.encode(self.encoder.encode_descriptor(
            name,
            help,
            unit.as_ref(),
            metric.metric_type(),
        )?)
    }
}

/// The queue-wait histogram of one priority, as the engine keeps it.
struct WaitHistogram<'a>(&'a crate::qos::PriorityTraffic);

impl fmt::Debug for WaitHistogram<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("WaitHistogram").finish()
    }
}

impl EncodeMetric for WaitHistogram<'_> {
    fn encode(&self, mut encoder: prometheus_client::encoding::MetricEncoder) -> fmt::Result {
        let count = self.0.wait_buckets.iter().map(|(_, n)| n).sum();
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            self.0.wait_sum_seconds,
            count,
            &self.0.wait_buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The serving-latency histogram of one operation at one priority, as the engine keeps it.
struct ServedLatencyHistogram<'a>(&'a crate::stats::ServedLatency);

impl fmt::Debug for ServedLatencyHistogram<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ServedLatencyHistogram").finish()
    }
}

impl EncodeMetric for ServedLatencyHistogram<'_> {
    fn encode(&self, mut encoder: prometheus_client::encoding::MetricEncoder) -> fmt::Result {
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            self.0.sum_seconds,
            self.0.count,
            &self.0.buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Bytes per second of `gbps` gigabits per second.
fn bytes_per_second(gbps: f64) -> f64 {
    gbps * 1e9 / 8.0
}

fn per_second() -> Option<Unit> {
    Some(Unit::Other("bytes_per_second".into()))
}

impl Collector for Snapshot {
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        let mut f = Families { encoder };
        {
            let labels = [("segment", self.segment.as_str())];
            let mut info = f.encoder.encode_descriptor(
                "multirail_engine",
                "The engine: its segment name (host:port)",
                None,
                MetricType::Info,
            )?;
            info.encode_info(&labels)?;
        }
        self.encode_rails(&mut f)?;
        self.encode_qos(&mut f)?;
        self.encode_connections(&mut f)?;
        self.encode_rdma(&mut f)?;
        self.encode_lanes(&mut f)?;
        self.encode_health(&mut f)?;
        self.encode_messages(&mut f)?;
        self.encode_metadata(&mut f)?;
        self.encode_served(&mut f)
    }
}

impl Snapshot {
    fn encode_rails(&self, f: &mut Families<'_>) -> fmt::Result {
        // Every rail the engine counts traffic on, then the rails it sends on that have not
        // carried anything yet (their counters are 0: they are created with the first
        // connection).
        let mut names: Vec<&str> = self.traffic.rails.iter().map(|r| r.name.as_str()).collect();
        for r in &self.rails {
            if !names.contains(&r.name.as_str()) {
                names.push(&r.name);
            }
        }
        let traffic = |name: &str| self.traffic.rails.iter().find(|r| r.name == name);
        let per_rail = |value: &dyn Fn(&crate::stats::RailTraffic) -> u64| {
            names
                .iter()
                .map(|n| (vec![("rail", *n)], traffic(n).map_or(0, value)))
                .collect::<Vec<_>>()
        };

        let mut bytes = Vec::with_capacity(names.len() * PRIORITIES.len());
        for n in &names {
            for (p, prio) in PRIORITIES.iter().enumerate() {
                let v = traffic(n).map_or(0, |r| r.priority_bytes[p]);
                bytes.push((vec![("rail", *n), ("priority", *prio)], v));
            }
        }
        f.counters(
            "multirail_rail",
            "Payload bytes this engine moved on each rail (as initiator), by the priority a slice left the queues at (a promoted slice counts at its new level)",
            Some(Unit::Bytes),
            &bytes,
        )?;
        f.counters(
            "multirail_rail_slices",
            "Slices this engine completed on each rail (as initiator); not split by priority",
            None,
            &per_rail(&|r| r.slices),
        )?;
        f.counters(
            "multirail_rail_slice_errors",
            "Slices that failed on each rail",
            None,
            &per_rail(&|r| r.errors),
        )?;

        // The scheduler's figures exist for network rails only.
        let network: Vec<&crate::stats::RailTraffic> = self
            .traffic
            .rails
            .iter()
            .filter(|r| r.ewma_gbps.is_some())
            .collect();
        let gauge = |value: &dyn Fn(&crate::stats::RailTraffic) -> u64| {
            network
                .iter()
                .map(|r| (vec![("rail", r.name.as_str())], value(r)))
                .collect::<Vec<_>>()
        };
        let gauge_f64 = |value: &dyn Fn(&crate::stats::RailTraffic) -> f64| {
            network
                .iter()
                .map(|r| (vec![("rail", r.name.as_str())], value(r)))
                .collect::<Vec<_>>()
        };
        f.gauges(
            "multirail_rail_inflight",
            "Bytes assigned to each network rail and not yet answered",
            Some(Unit::Bytes),
            &gauge(&|r| r.inflight_bytes),
        )?;
        f.gauges(
            "multirail_rail_window",
            "Bound on bytes in flight per path on each network rail (about its bandwidth-delay product) as last computed; 0 before any traffic",
            Some(Unit::Bytes),
            &gauge(&|r| r.window_bytes),
        )?;
        f.gauges(
            "multirail_rail_bandwidth_estimate",
            "The scheduler's EWMA bandwidth estimate of each network rail; it starts at the assumed bandwidth until slices complete",
            per_second(),
            &gauge_f64(&|r| bytes_per_second(r.ewma_gbps.unwrap_or(0.0))),
        )?;
        let assumed: Vec<_> = self
            .rails
            .iter()
            .map(|r| {
                (
                    vec![("rail", r.name.as_str())],
                    bytes_per_second(r.bandwidth_gbps),
                )
            })
            .collect();
        f.gauges(
            "multirail_rail_assumed_bandwidth",
            "The bandwidth scheduling assumes for each rail this engine sends on",
            per_second(),
            &assumed,
        )
    }

    fn encode_qos(&self, f: &mut Families<'_>) -> fmt::Result {
        let qos = &self.traffic.qos;
        let per_priority = |value: &dyn Fn(&crate::qos::PriorityTraffic) -> u64| {
            PRIORITIES
                .iter()
                .zip(&qos.priorities)
                .map(|(name, p)| (vec![("priority", *name)], value(p)))
                .collect::<Vec<_>>()
        };
        f.gauges(
            "multirail_qos_queued_entries",
            "Entries waiting in the priority queues now: slices for network rails and copy jobs (at most 1 MiB each) for shm",
            None,
            &per_priority(&|p| p.queued),
        )?;
        f.counters(
            "multirail_qos_dequeued_entries",
            "Entries that left the priority queues",
            None,
            &per_priority(&|p| p.dequeued),
        )?;
        // The engine keeps these two quantiles, not buckets: a histogram or a summary cannot be
        // built from them, so each is a gauge of its own.
        for (family, help, quantile) in [
            (
                "multirail_qos_wait_p50",
                "Median wait from queueing to posting over every entry since the engine started",
                0usize,
            ),
            (
                "multirail_qos_wait_p99",
                "99th percentile of the wait from queueing to posting over every entry since the engine started",
                1,
            ),
        ] {
            let waits: Vec<_> = PRIORITIES
                .iter()
                .zip(&qos.priorities)
                .map(|(name, p)| {
                    let us = [p.wait_p50_us, p.wait_p99_us][quantile];
                    (vec![("priority", *name)], us as f64 / 1e6)
                })
                .collect();
            f.gauges(family, help, Some(Unit::Seconds), &waits)?;
        }
        let histograms: Vec<_> = PRIORITIES
            .iter()
            .zip(&qos.priorities)
            .map(|(name, p)| (vec![("priority", *name)], p))
            .collect();
        f.family(
            "multirail_qos_wait",
            "Wait from queueing to posting of every entry since the engine started, by priority",
            Some(Unit::Seconds),
            &histograms,
            |p| WaitHistogram(p),
            MetricType::Histogram,
        )?;
        f.counter(
            "multirail_qos_promotions",
            "Queue entries promoted one level after waiting too long",
            qos.promotions,
        )?;
        if let Some(slot) = qos.global_slot {
            f.gauge(
                "multirail_qos_global_slot",
                "The global time slot in force (0, 1 or 2) shared with other processes on this host",
                None,
                u64::from(slot),
            )?;
        }
        Ok(())
    }

    fn encode_connections(&self, f: &mut Families<'_>) -> fmt::Result {
        let c = &self.connections;
        f.gauge(
            "multirail_connections_open",
            "Connections the listening port holds now, of every kind (messaging included); 0 once the engine has shut down",
            None,
            c.open as u64,
        )?;
        f.gauge(
            "multirail_connections_pending",
            "Connections held now that have not finished the handshake",
            None,
            c.pending as u64,
        )?;
        f.counter(
            "multirail_connections_accepted",
            "Connections the listening port accepted",
            c.accepted,
        )?;
        f.counters(
            "multirail_connections_refused",
            "Connections refused: not_member (no or wrong membership token), full (max_connections held)",
            None,
            &[
                (vec![("reason", "not_member")], c.not_members),
                (vec![("reason", "full")], c.refused_full),
            ],
        )?;
        f.counters(
            "multirail_connections_shed",
            "Connections closed to make room: pending (unproven, at the pending cap, out of fds or at the handshake deadline), idle (members' idle connections, out of fds)",
            None,
            &[
                (vec![("kind", "pending")], c.shed_pending),
                (vec![("kind", "idle")], c.shed_idle),
            ],
        )?;
        f.counter(
            "multirail_connections_accept_errors",
            "Failed accepts on the listening port (out of fds, mostly)",
            c.accept_errors,
        )?;
        f.gauge(
            "multirail_server_threads",
            "Threads serving the listening port's connections",
            None,
            c.serve_threads as u64,
        )
    }

    fn encode_rdma(&self, f: &mut Families<'_>) -> fmt::Result {
        let r = &self.rdma;
        let counters: [(&str, &str, u64); 8] = [
            (
                "multirail_rdma_post_calls",
                "ibv_post_send calls that carried slices (0 without RDMA)",
                r.post_calls,
            ),
            (
                "multirail_rdma_work_requests",
                "RDMA slice work requests posted (0 without RDMA)",
                r.work_requests,
            ),
            (
                "multirail_rdma_signalled_completions",
                "Signalled RDMA completions reaped (0 without RDMA)",
                r.signalled_completions,
            ),
            (
                "multirail_rdma_slices",
                "Slices completed over RDMA (0 without RDMA)",
                r.slices,
            ),
            (
                "multirail_rdma_qp_errors",
                "RDMA queue pairs lost to error completions (0 without RDMA)",
                r.qp_errors,
            ),
            (
                "multirail_rdma_messages_sent",
                "Messages and notifications sent with RDMA SEND (0 without RDMA; tcp and shm messages are not counted)",
                r.messages_sent,
            ),
            (
                "multirail_rdma_messages_inline",
                "Of the messages sent with RDMA SEND, those sent inline",
                r.messages_inline,
            ),
            (
                "multirail_rdma_messages_received",
                "Messages taken from RDMA receive queues (0 without RDMA)",
                r.messages_received,
            ),
        ];
        for (name, help, value) in counters {
            f.counter(name, help, value)?;
        }
        Ok(())
    }

    fn encode_health(&self, f: &mut Families<'_>) -> fmt::Result {
        let (completed, failed) = self.transfers;
        f.counters(
            "multirail_transfers",
            "Requests this engine submitted that finished, by outcome (a failed request failed in at least one slice)",
            None,
            &[
                (vec![("outcome", "completed")], completed),
                (vec![("outcome", "failed")], failed),
            ],
        )?;
        let mut paths = Vec::with_capacity(self.health.len() * 3);
        for h in &self.health {
            for (state, n) in [("up", h.up), ("paused", h.paused), ("probing", h.probing)] {
                paths.push((vec![("rail", h.rail.as_str()), ("state", state)], n as u64));
            }
        }
        f.gauges(
            "multirail_rail_paths",
            "TCP paths to connected peers on each rail, by health: up, paused after repeated errors, probing before they rejoin",
            None,
            &paths,
        )
    }

    fn encode_messages(&self, f: &mut Families<'_>) -> fmt::Result {
        let m = &self.messages;
        let directions = |sent: u64, received: u64| {
            vec![
                (vec![("direction", "sent")], sent),
                (vec![("direction", "received")], received),
            ]
        };
        f.counters(
            "multirail_messages",
            "Messages sent (successfully) and handed to the application, notifications and lane negotiation included",
            None,
            &directions(m.sent, m.received),
        )?;
        f.counters(
            "multirail_message",
            "Payload bytes of those messages",
            Some(Unit::Bytes),
            &directions(m.sent_bytes, m.received_bytes),
        )?;
        f.counter(
            "multirail_message_send_failures",
            "Sends that failed (timeout, peer gone, refused)",
            m.send_failures,
        )?;
        f.counter(
            "multirail_message_credit_waits",
            "Sends that found no credit in hand (shm shared ring: no free space) and waited for the receiver",
            m.credit_waits,
        )
    }

    fn encode_metadata(&self, f: &mut Families<'_>) -> fmt::Result {
        let m = &self.metadata;
        let outcomes = |total: u64, failed: u64| {
            vec![
                (vec![("outcome", "ok")], total - failed.min(total)),
                (vec![("outcome", "failed")], failed),
            ]
        };
        f.counters(
            "multirail_metadata_lookups",
            "Descriptor lookups in the metadata store (opening a segment, refetching one), by outcome",
            None,
            &outcomes(m.lookups, m.lookup_failures),
        )?;
        f.counters(
            "multirail_metadata_publishes",
            "Publishes of this engine's descriptor to a store that keeps them, by outcome",
            None,
            &outcomes(m.publishes, m.publish_failures),
        )?;
        f.counter(
            "multirail_metadata_watch_updates",
            "Open segments updated from the store's watch (etcd)",
            m.watch_updates,
        )?;
        let states = [
            StoreState::Up,
            StoreState::Down,
            StoreState::Unknown,
            StoreState::NotUsed,
        ];
        let samples: Vec<(Labels<'_>, i64)> = states
            .iter()
            .map(|s| (vec![("state", s.as_str())], i64::from(*s == m.store)))
            .collect();
        f.gauges(
            "multirail_metadata_store_state",
            "1 for the metadata store's state (up, down, unknown before any request, not_used with peer-to-peer lookups), 0 for the others",
            None,
            &samples,
        )?;
        f.gauge(
            "multirail_metadata_store_failures_in_a_row",
            "Requests to the metadata store that failed since it last answered",
            None,
            m.store_failures_in_a_row as i64,
        )?;
        f.counter(
            "multirail_metadata_refreshes",
            "Renewals of this engine's published keys the store took (etcd lease keep-alives, HTTP re-PUTs)",
            m.refreshes,
        )?;
        f.counter(
            "multirail_metadata_republishes",
            "Times this engine's keys were lost or never stored and were published again once the store answered",
            m.republishes,
        )
    }

    fn encode_lanes(&self, f: &mut Families<'_>) -> fmt::Result {
        let l = &self.lanes;
        let dedicated = |peers: &[crate::messaging::PeerLaneReport]| {
            peers.iter().filter(|p| p.lane == Lane::Dedicated).count() as u64
        };
        let directions = |out: u64, inc: u64| {
            vec![
                (vec![("direction", "outgoing")], out),
                (vec![("direction", "incoming")], inc),
            ]
        };
        f.gauges(
            "multirail_lanes_peers",
            "Peers with a message lane: outgoing (this engine sends to them), incoming (they send to it)",
            None,
            &directions(l.outgoing.len() as u64, l.incoming.len() as u64),
        )?;
        f.gauges(
            "multirail_lanes_dedicated",
            "Of those peers, the ones on a dedicated lane now",
            None,
            &directions(dedicated(&l.outgoing), dedicated(&l.incoming)),
        )?;
        f.gauge(
            "multirail_lanes_max_dedicated",
            "Most dedicated incoming lanes this engine grants (lanes.max_dedicated)",
            None,
            l.max_dedicated as u64,
        )?;
        let (req, grant) = (&l.requesting, &l.granting);
        f.counters(
            "multirail_lane_promotions",
            "Dynamic lane changes to dedicated",
            None,
            &directions(req.promotions, grant.promotions),
        )?;
        f.counters(
            "multirail_lane_demotions",
            "Dynamic lane changes to shared (not counting peers gone)",
            None,
            &directions(req.demotions, grant.demotions),
        )?;
        f.counters(
            "multirail_lane_denials",
            "Requests for a dedicated lane denied: received from peers (outgoing), sent to peers (incoming)",
            None,
            &directions(req.denials_received, grant.denials_sent),
        )?;
        f.counters(
            "multirail_lane_evictions",
            "Dedicated lanes demoted to make room for a stronger peer",
            None,
            &directions(req.evictions, grant.evictions),
        )?;
        f.gauge(
            "multirail_message_receive_buffer",
            "Receive buffers this engine holds for messages now: the shared pools and every dedicated lane's own",
            Some(Unit::Bytes),
            l.receive_bytes,
        )
    }
}

const OPS: [&str; 2] = ["read", "write"];

impl Snapshot {
    fn encode_served(&self, f: &mut Families<'_>) -> fmt::Result {
        let served = &self.traffic.served;
        // The rails served on, then the engine's own rails not served on yet (at 0), so a
        // target's series exist before its first peer comes.
        let mut names: Vec<&str> = served.rails.iter().map(|r| r.name.as_str()).collect();
        for r in &self.rails {
            if !names.contains(&r.name.as_str()) {
                names.push(&r.name);
            }
        }
        let rail = |name: &str| served.rails.iter().find(|r| r.name == name);
        let op_of = |r: &crate::stats::ServedRailTraffic, op: usize| {
            if op == 0 {
                r.read.clone()
            } else {
                r.write.clone()
            }
        };
        let mut bytes = Vec::with_capacity(names.len() * OPS.len() * PRIORITIES.len());
        let mut requests = Vec::with_capacity(bytes.capacity());
        let mut refused = Vec::with_capacity(names.len() * OPS.len());
        for n in &names {
            for (o, op) in OPS.iter().enumerate() {
                let t = rail(n).map(|r| op_of(r, o)).unwrap_or_default();
                for (p, prio) in PRIORITIES.iter().enumerate() {
                    let labels = vec![("rail", *n), ("op", *op), ("priority", *prio)];
                    bytes.push((labels.clone(), t.priority_bytes[p]));
                    requests.push((labels, t.priority_requests[p]));
                }
                refused.push((vec![("rail", *n), ("op", *op)], t.refused));
            }
        }
        f.counters(
            "multirail_served",
            "Payload bytes this engine served to peers over tcp on each rail: read (sent out of its memory) and write (written into it), by the priority the peer gave each slice; shm and RDMA transfers never reach this engine's CPU and count only at the initiator",
            Some(Unit::Bytes),
            &bytes,
        )?;
        f.counters(
            "multirail_served_requests",
            "Requests (slices) this engine served to peers over tcp on each rail, by operation and priority",
            None,
            &requests,
        )?;
        f.counters(
            "multirail_served_refused",
            "Requests from peers this engine refused on each rail (no buffer at that address, wrong key, range out of bounds), by operation",
            None,
            &refused,
        )?;

        let mut peer_bytes = Vec::with_capacity(served.peers.len() * OPS.len());
        let mut peer_requests = Vec::with_capacity(peer_bytes.capacity());
        for p in &served.peers {
            for (op, c) in OPS.iter().zip([p.read, p.write]) {
                peer_bytes.push((vec![("peer", p.peer.as_str()), ("op", *op)], c.bytes));
                peer_requests.push((vec![("peer", p.peer.as_str()), ("op", *op)], c.requests));
            }
        }
        f.counters(
            "multirail_served_peer",
            "Payload bytes this engine served to each peer address over tcp, by operation; past the first 64 peers, every other peer counts as peer=\"other\"",
            Some(Unit::Bytes),
            &peer_bytes,
        )?;
        f.counters(
            "multirail_served_peer_requests",
            "Requests this engine served to each peer address over tcp, by operation; past the first 64 peers, every other peer counts as peer=\"other\"",
            None,
            &peer_requests,
        )?;

        let mut latencies = Vec::with_capacity(OPS.len() * PRIORITIES.len());
        for (op, per_priority) in OPS
            .iter()
            .zip([&served.read_latency, &served.write_latency])
        {
            for (prio, l) in PRIORITIES.iter().zip(per_priority) {
                latencies.push((vec![("op", *op), ("priority", *prio)], l));
            }
        }
        for (family, help, quantile) in [
            (
                "multirail_served_latency_p50",
                "Median serving latency since the engine started (frame read to bytes in place for write, to answer sent for read), estimated within its histogram bucket",
                0usize,
            ),
            (
                "multirail_served_latency_p99",
                "99th percentile of the serving latency since the engine started, estimated within its histogram bucket",
                1,
            ),
        ] {
            let values: Vec<_> = latencies
                .iter()
                .map(|(labels, l)| (labels.clone(), [l.p50_us, l.p99_us][quantile] / 1e6))
                .collect();
            f.gauges(family, help, Some(Unit::Seconds), &values)?;
        }
        f.family(
            "multirail_served_latency",
            "Serving latency of every request served over tcp since the engine started: from its frame being read to its bytes being in place (write) or its answer being sent (read), by operation and priority",
            Some(Unit::Seconds),
            &latencies,
            |l| ServedLatencyHistogram(l),
            MetricType::Histogram,
        )
    }
}
