//! Request handlers: `/metadata` (Mooncake's protocol), `/metrics`, `/health`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Body as _;

use crate::metrics::Metrics;
use crate::query::{self, BadQuery, Target};
use crate::store::{PutOutcome, Store};
use crate::Limits;

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
/// prometheus-client writes the OpenMetrics flavour of the text format.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct App {
    pub(crate) store: Arc<Store>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) limits: Limits,
}

/// The server's routes; unknown paths get 404, wrong methods 405.
pub(crate) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/metadata", any(metadata))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .fallback(not_found)
        .with_state(app)
}

async fn metadata(State(app): State<Arc<App>>, req: Request) -> Response {
    let method = req.method().clone();
    let response = handle_metadata(&app, req).await;
    app.metrics.request(&method, response.status().as_u16());
    response
}

async fn handle_metadata(app: &Arc<App>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let method = parts.method;
    let is_read = method == Method::GET || method == Method::HEAD;
    if !(is_read || method == Method::PUT || method == Method::DELETE) {
        let mut response = metadata_response(StatusCode::METHOD_NOT_ALLOWED, METHOD_NOT_ALLOWED);
        response.headers_mut().insert(
            header::ALLOW,
            HeaderValue::from_static("GET, HEAD, PUT, DELETE"),
        );
        return response;
    }
    let target = match query::parse(parts.uri.query(), app.limits.max_key_bytes) {
        Ok(target) => target,
        Err(BadQuery(reason)) => return metadata_response(StatusCode::BAD_REQUEST, reason),
    };
    match target {
        Target::Key(key) if is_read => match app.store.get(&key) {
            Some(value) => metadata_response(StatusCode::OK, value),
            None => metadata_response(StatusCode::NOT_FOUND, NOT_FOUND),
        },
        Target::Prefix(prefix) if is_read => {
            let keys = app.store.keys_with_prefix(&prefix);
            match serde_json::to_vec(&keys) {
                Ok(json) => metadata_response(StatusCode::OK, json),
                Err(err) => metadata_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot encode the key list: {err}"),
                ),
            }
        }
        Target::Prefix(_) => metadata_response(
            StatusCode::BAD_REQUEST,
            "prefix is only valid with GET; PUT and DELETE take a key",
        ),
        Target::Key(key) if method == Method::PUT => put(app, key, body).await,
        Target::Key(key) => delete(app, key).await,
    }
}

async fn put(app: &Arc<App>, key: String, body: Body) -> Response {
    let value = match read_body(body, app.limits.max_value_bytes, app.limits.request_timeout).await
    {
        Ok(value) => value,
        Err(response) => return response,
    };
    // The write runs as its own task so that a client hanging up mid-request
    // cannot cancel it between the disk write and the map update.
    let store = Arc::clone(&app.store);
    let key_for_log = key.clone();
    match tokio::spawn(async move { store.put(key, value).await }).await {
        Ok(Ok(PutOutcome::Updated)) => metadata_response(StatusCode::OK, UPDATED),
        Ok(Ok(PutOutcome::Unchanged)) => metadata_response(StatusCode::OK, UNCHANGED),
        Ok(Ok(PutOutcome::RpcMetaConflict)) => {
            tracing::warn!(key = %key_for_log, "PUT refused: rpc_meta key already holds another value");
            metadata_response(StatusCode::BAD_REQUEST, RPC_META_CONFLICT)
        }
        Ok(Err(err)) => {
            tracing::error!(key = %key_for_log, %err, "cannot persist metadata");
            metadata_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot persist metadata: {err}"),
            )
        }
        Err(err) => internal_task_error(err),
    }
}

async fn delete(app: &Arc<App>, key: String) -> Response {
    let store = Arc::clone(&app.store);
    let key_for_log = key.clone();
    match tokio::spawn(async move { store.delete(key).await }).await {
        Ok(Ok(true)) => metadata_response(StatusCode::OK, DELETED),
        Ok(Ok(false)) => metadata_response(StatusCode::NOT_FOUND, NOT_FOUND),
        Ok(Err(err)) => {
            tracing::error!(key = %key_for_log, %err, "cannot remove persisted metadata");
            metadata_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot remove persisted metadata: {err}"),
            )
        }
        Err(err) => internal_task_error(err),
    }
}

fn internal_task_error(err: tokio::task::JoinError) -> Response {
    tracing::error!(%err, "metadata store task failed");
    metadata_response(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
}

/// Reads a request body of at most `max` bytes within `timeout`. On failure
/// returns the response to send: 413 when too large, 408 when too slow, 400
/// when the body is malformed or cut short.
async fn read_body(mut body: Body, max: usize, timeout: Duration) -> Result<Bytes, Response> {
    let too_large = || {
        closing(metadata_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("value is larger than the limit of {max} bytes"),
        ))
    };
    // A Content-Length over the limit is refused before reading any of it.
    let announced = body.size_hint().lower();
    if announced > max as u64 {
        return Err(too_large());
    }
    let collect = async {
        let mut buf = Vec::with_capacity(announced as usize);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| {
                closing(metadata_response(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the request body: {err}"),
                ))
            })?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > max {
                    return Err(too_large());
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok(Bytes::from(buf))
    };
    match tokio::time::timeout(timeout, collect).await {
        Ok(result) => result,
        Err(_) => Err(closing(metadata_response(
            StatusCode::REQUEST_TIMEOUT,
            format!("request body not received within {timeout:?}"),
        ))),
    }
}

/// Asks hyper to close the connection after this response: used when the
/// request body was not read to its end, so the stream is no longer at a
/// request boundary.
fn closing(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

fn metadata_response(status: StatusCode, body: impl Into<Body>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, METADATA_CONTENT_TYPE)],
        body.into(),
    )
        .into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    match app.metrics.render(app.store.len(), app.store.value_bytes()) {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
            text,
        )
            .into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics").into_response(),
    }
}

/// Mooncake's C++ metadata server answers `GET /health` with 200 "OK".
async fn health() -> &'static str {
    "OK"
}

async fn not_found() -> (StatusCode, &'static str) {
    (StatusCode::NOT_FOUND, "not found")
}
