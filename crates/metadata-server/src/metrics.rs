//! Prometheus metrics, served at `/metrics` in the text exposition format.

use axum::http::Method;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels of `multirail_metadata_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: &'static str,
    code: u16,
}

/// The server's metrics and the registry that encodes them.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    keys: Gauge,
    value_bytes: Gauge,
    connections: Gauge,
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let keys = Gauge::default();
        let value_bytes = Gauge::default();
        let connections = Gauge::default();
        // The text encoder appends `_total` to counter names.
        registry.register(
            "multirail_metadata_requests",
            "Requests to /metadata, by method and response status code",
            requests.clone(),
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
            keys,
            value_bytes,
            connections,
        }
    }

    /// Counts one `/metadata` request answered with `code`.
    pub(crate) fn request(&self, method: &Method, code: u16) {
        // Only known methods get their own label: a client inventing methods
        // must not be able to grow the metric set without bound.
        let method = match *method {
            Method::GET => "GET",
            Method::HEAD => "HEAD",
            Method::PUT => "PUT",
            Method::DELETE => "DELETE",
            Method::POST => "POST",
            _ => "OTHER",
        };
        self.requests
            .get_or_create(&RequestLabels { method, code })
            .inc();
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
