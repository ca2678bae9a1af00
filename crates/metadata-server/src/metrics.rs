//! Prometheus metrics, served at `/metrics` in the text exposition format.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::request::{Method, Reject};

/// Labels of `multirail_metadata_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: &'static str,
    code: u16,
}

/// Labels of `multirail_metadata_rejected_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectLabels {
    code: u16,
    reason: &'static str,
}

/// The server's metrics and the registry that encodes them.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    rejected: Family<RejectLabels, Counter>,
    expired: Counter,
    keys: Gauge,
    value_bytes: Gauge,
    connections: Gauge,
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let rejected = Family::<RejectLabels, Counter>::default();
        let expired = Counter::default();
        let keys = Gauge::default();
        let value_bytes = Gauge::default();
        let connections = Gauge::default();
        // The text encoder appends `_total` to counter names.
        registry.register(
            "multirail_metadata_requests",
            "Requests to /metadata, by method and response status code",
            requests.clone(),
        );
        registry.register(
            "multirail_metadata_rejected",
            "Requests the server refused before a handler saw them (malformed or oversized \
             head, bad Content-Length or Transfer-Encoding, oversized or malformed body, \
             connection ended mid-request, head or body not received within the request \
             timeout), by response status code and reason",
            rejected.clone(),
        );
        registry.register(
            "multirail_metadata_keys_expired",
            "Keys dropped because they were not stored again within the key TTL",
            expired.clone(),
        );
        registry.register("multirail_metadata_keys", "Keys stored", keys.clone());
        registry.register(
            "multirail_metadata_value_bytes",
            "Bytes of the values stored (keys not included)",
            value_bytes.clone(),
        );
        registry.register(
            "multirail_metadata_connections",
            "Client connections open",
            connections.clone(),
        );
        Metrics {
            registry,
            requests,
            rejected,
            expired,
            keys,
            value_bytes,
            connections,
        }
    }

    /// Counts one `/metadata` request answered with `code`.
    pub(crate) fn request(&self, method: Method, code: u16) {
        // Method::label has a fixed set of values: a client inventing
        // methods cannot grow the metric set without bound.
        self.requests
            .get_or_create(&RequestLabels {
                method: method.label(),
                code,
            })
            .inc();
    }

    /// Counts one request refused before a handler saw it.
    pub(crate) fn rejected(&self, reject: &Reject) {
        self.rejected
            .get_or_create(&RejectLabels {
                code: reject.status,
                reason: reject.kind.label(),
            })
            .inc();
    }

    /// Counts one key dropped by its TTL.
    pub(crate) fn key_expired(&self) {
        self.expired.inc();
    }

    pub(crate) fn connection_opened(&self) {
        self.connections.inc();
    }

    pub(crate) fn connection_closed(&self) {
        self.connections.dec();
    }

    /// The metrics in the text format, with the store's gauges as of now.
    /// Returns the encoder's error, which only a failing `fmt::Write` (never
    /// a `String`) could cause.
    pub(crate) fn render(&self, keys: usize, value_bytes: u64) -> Result<String, std::fmt::Error> {
        self.keys.set(i64::try_from(keys).unwrap_or(i64::MAX));
        self.value_bytes
            .set(i64::try_from(value_bytes).unwrap_or(i64::MAX));
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
