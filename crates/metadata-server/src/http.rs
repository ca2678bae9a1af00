//! Request handlers: `/metadata` (Mooncake's protocol), `/metrics`, `/health`.

use std::borrow::Cow;
use std::sync::Arc;

use crate::metrics::Metrics;
use crate::query::{self, BadQuery, Target};
use crate::request::{Head, Method};
use crate::store::{PutOutcome, Store, Value};
use crate::Limits;

/// The path of Mooncake's protocol.
pub(crate) const METADATA_PATH: &str = "/metadata";

/// Mooncake's bodies, matched byte for byte: its engines only look at the
/// status code, but scripts around them grep these texts.
const NOT_FOUND: &str = "metadata not found";
const UPDATED: &str = "metadata updated";
const UNCHANGED: &str = "metadata unchanged";
const DELETED: &str = "metadata deleted";
const RPC_META_CONFLICT: &str = "Duplicate rpc_meta key not allowed";
const METHOD_NOT_ALLOWED: &str = "Method not allowed";

/// Mooncake's servers label every `/metadata` answer as JSON, even the
/// plain-text ones and binary values; clients may depend on it, so we do too.
const METADATA_CONTENT_TYPE: &str = "application/json";
/// Refusals, `/health` and unknown paths.
const TEXT_CONTENT_TYPE: &str = "text/plain; charset=utf-8";
/// prometheus-client writes the OpenMetrics flavour of the text format.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct App {
    pub(crate) store: Arc<Store>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) limits: Limits,
}

/// A response body: a text, or a stored value shared with the store.
#[derive(Debug)]
pub(crate) enum Body {
    Text(Cow<'static, str>),
    Value(Value),
    Bytes(Vec<u8>),
}

/// A response before it is written.
#[derive(Debug)]
pub(crate) struct Response {
    pub(crate) status: u16,
    content_type: &'static str,
    body: Body,
    allow: Option<&'static str>,
    /// Close the connection after this answer.
    pub(crate) close: bool,
}

impl Response {
    fn new(status: u16, content_type: &'static str, body: Body) -> Response {
        Response {
            status,
            content_type,
            body,
            allow: None,
            close: false,
        }
    }

    /// A plain-text answer, as refusals and the other paths give.
    pub(crate) fn text(status: u16, text: impl Into<Cow<'static, str>>) -> Response {
        Response::new(status, TEXT_CONTENT_TYPE, Body::Text(text.into()))
    }

    /// A `/metadata` answer: labelled JSON whatever it holds, as Mooncake's.
    fn metadata(status: u16, body: Body) -> Response {
        Response::new(status, METADATA_CONTENT_TYPE, body)
    }

    pub(crate) fn metadata_text(status: u16, text: impl Into<Cow<'static, str>>) -> Response {
        Response::metadata(status, Body::Text(text.into()))
    }

    fn method_not_allowed(allow: &'static str, content_type: &'static str) -> Response {
        let mut response = Response::new(
            405,
            content_type,
            Body::Text(Cow::Borrowed(METHOD_NOT_ALLOWED)),
        );
        response.allow = Some(allow);
        response
    }

    /// The body's bytes.
    pub(crate) fn body(&self) -> &[u8] {
        match &self.body {
            Body::Text(text) => text.as_bytes(),
            Body::Value(value) => value,
            Body::Bytes(bytes) => bytes,
        }
    }

    /// The status line and header fields, through the blank line.
    pub(crate) fn head_bytes(&self, keep_alive: bool, http11: bool) -> Vec<u8> {
        use std::fmt::Write as _;
        let mut head = String::with_capacity(160);
        let _ = write!(
            head,
            "HTTP/1.1 {} {}\r\ncontent-type: {}\r\ncontent-length: {}\r\n",
            self.status,
            reason_phrase(self.status),
            self.content_type,
            self.body().len()
        );
        if let Some(allow) = self.allow {
            let _ = write!(head, "allow: {allow}\r\n");
        }
        if !keep_alive {
            head.push_str("connection: close\r\n");
        } else if !http11 {
            // HTTP/1.0 closes unless told otherwise.
            head.push_str("connection: keep-alive\r\n");
        }
        head.push_str("\r\n");
        head.into_bytes()
    }
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        _ => "",
    }
}

/// Answers one request whose head and body have been read.
pub(crate) async fn handle(app: &Arc<App>, head: &Head, body: Vec<u8>) -> Response {
    let is_read = matches!(head.method, Method::Get | Method::Head);
    match head.path.as_str() {
        METADATA_PATH => {
            let response = metadata(app, head, body).await;
            app.metrics.request(head.method, response.status);
            response
        }
        "/metrics" if is_read => metrics(app),
        // Mooncake's C++ metadata server answers `GET /health` with 200 "OK".
        "/health" if is_read => Response::text(200, "OK"),
        "/metrics" | "/health" => Response::method_not_allowed("GET, HEAD", TEXT_CONTENT_TYPE),
        _ => Response::text(404, "not found"),
    }
}

async fn metadata(app: &Arc<App>, head: &Head, body: Vec<u8>) -> Response {
    let method = head.method;
    let is_read = matches!(method, Method::Get | Method::Head);
    if !(is_read || matches!(method, Method::Put | Method::Delete)) {
        return Response::method_not_allowed("GET, HEAD, PUT, DELETE", METADATA_CONTENT_TYPE);
    }
    let target = match query::parse(head.query.as_deref(), app.limits.max_key_bytes) {
        Ok(target) => target,
        Err(BadQuery(reason)) => return Response::metadata_text(400, reason),
    };
    match target {
        Target::Key(key) if is_read => match app.store.get(&key) {
            Some(value) => Response::metadata(200, Body::Value(value)),
            None => Response::metadata_text(404, NOT_FOUND),
        },
        Target::Prefix(prefix) if is_read => {
            let keys = app.store.keys_with_prefix(&prefix);
            match serde_json::to_vec(&keys) {
                Ok(json) => Response::metadata(200, Body::Bytes(json)),
                Err(err) => {
                    Response::metadata_text(500, format!("cannot encode the key list: {err}"))
                }
            }
        }
        Target::Prefix(_) => Response::metadata_text(
            400,
            "prefix is only valid with GET; PUT and DELETE take a key",
        ),
        Target::Key(key) if method == Method::Put => put(app, key, body).await,
        Target::Key(key) => delete(app, key).await,
    }
}

async fn put(app: &Arc<App>, key: String, body: Vec<u8>) -> Response {
    let value: Value = Arc::from(body);
    // The write runs as its own task so that nothing cancelling this one
    // (a runtime shutting down) can stop it between the disk write and the
    // map update.
    let store = Arc::clone(&app.store);
    let key_for_log = key.clone();
    match tokio::spawn(async move { store.put(key, value).await }).await {
        Ok(Ok(PutOutcome::Updated)) => Response::metadata_text(200, UPDATED),
        Ok(Ok(PutOutcome::Unchanged)) => Response::metadata_text(200, UNCHANGED),
        Ok(Ok(PutOutcome::RpcMetaConflict)) => {
            tracing::warn!(key = %key_for_log, "PUT refused: rpc_meta key already holds another value");
            Response::metadata_text(400, RPC_META_CONFLICT)
        }
        Ok(Err(err)) => {
            tracing::error!(key = %key_for_log, %err, "cannot persist metadata");
            Response::metadata_text(500, format!("cannot persist metadata: {err}"))
        }
        Err(err) => internal_task_error(err),
    }
}

async fn delete(app: &Arc<App>, key: String) -> Response {
    let store = Arc::clone(&app.store);
    let key_for_log = key.clone();
    match tokio::spawn(async move { store.delete(key).await }).await {
        Ok(Ok(true)) => Response::metadata_text(200, DELETED),
        Ok(Ok(false)) => Response::metadata_text(404, NOT_FOUND),
        Ok(Err(err)) => {
            tracing::error!(key = %key_for_log, %err, "cannot remove persisted metadata");
            Response::metadata_text(500, format!("cannot remove persisted metadata: {err}"))
        }
        Err(err) => internal_task_error(err),
    }
}

fn internal_task_error(err: tokio::task::JoinError) -> Response {
    tracing::error!(%err, "metadata store task failed");
    Response::metadata_text(500, "internal error")
}

fn metrics(app: &Arc<App>) -> Response {
    match app.metrics.render(app.store.len(), app.store.value_bytes()) {
        Ok(text) => Response::new(200, METRICS_CONTENT_TYPE, Body::Text(text.into())),
        Err(_) => Response::text(500, "cannot encode metrics"),
    }
}
