//! An HTTP metadata server that speaks Mooncake Transfer Engine's HTTP
//! metadata protocol, so Mooncake's engines (with
//! `metadata_server = "http://HOST:PORT/metadata"`) and multirail's can use
//! it unchanged.
//!
//! # Protocol (Mooncake's)
//!
//! Keys travel URL-encoded in the query string (`+` and `%20` are spaces,
//! `%2F` a slash; the decoded key must be UTF-8). Every `/metadata` answer
//! carries `Content-Type: application/json`, as Mooncake's servers send it.
//!
//! | request | answer |
//! | --- | --- |
//! | `GET /metadata?key=K` | 200 with the stored bytes; 404 `metadata not found` |
//! | `PUT /metadata?key=K`, value as body | 200 `metadata updated`, replacing any old value |
//! | `DELETE /metadata?key=K` | 200 `metadata deleted`; 404 `metadata not found` |
//! | missing or empty `key` | 400 `Missing key parameter` |
//! | other methods on `/metadata` | 405 `Method not allowed` |
//! | `GET /health` | 200 `OK` |
//!
//! Like Mooncake's servers, a key containing `rpc_meta` (an engine's RPC
//! endpoint) is write-once until deleted: republishing the same value
//! answers 200 `metadata unchanged`, a different value 400
//! `Duplicate rpc_meta key not allowed` and keeps the old one. This stops a
//! second engine from silently taking over a live engine's segment name.
//!
//! # Extensions (not in Mooncake)
//!
//! - `GET /metadata?prefix=P`: 200 with a JSON array of the keys starting
//!   with `P`, sorted (`prefix=` lists every key). Giving both `key` and
//!   `prefix` is a 400.
//! - `GET /metrics`: Prometheus metrics (OpenMetrics text):
//!   `multirail_metadata_keys`, `multirail_metadata_value_bytes`,
//!   `multirail_metadata_connections` (gauges),
//!   `multirail_metadata_requests_total{method,code}` (requests to
//!   `/metadata` by their answer, whoever gave it),
//!   `multirail_metadata_rejected_total{code,reason}` (requests to any path
//!   that the server refused before a handler saw them, with `reason` one
//!   of `malformed_head`, `content_length`, `transfer_encoding`,
//!   `head_too_large`, `head_incomplete`, `head_timeout`, `body_too_large`,
//!   `body_malformed`, `body_incomplete`, `body_timeout`) and
//!   `multirail_metadata_keys_expired_total`.
//! - Bounds ([`Limits`]): a value over `max_value_bytes` gets 413, a key or
//!   prefix over `max_key_bytes` 400, a head or body slower than
//!   `request_timeout` 408; connections beyond `max_connections` wait to be
//!   accepted.
//! - Every refusal carries a one-line reason as its body: a request that is
//!   not valid HTTP/1.1 (request line, header fields, `Content-Length`,
//!   chunked framing) gets 400 (431 for an oversized head, 501 for a
//!   transfer coding other than chunked) saying what is wrong, and the
//!   connection is closed.
//! - Key expiry ([`Limits::key_ttl`], off by default): a key not stored
//!   again within the TTL is gone, as etcd drops the keys of an expired
//!   lease, so the keys of an engine that died without withdrawing them do
//!   not stay forever. Reads answer 404 from the deadline on; a background
//!   task removes the key's file and counts it within milliseconds.
//! - Persistence: with [`ServerConfig::data_dir`], every PUT and DELETE
//!   reaches the disk (written, fsynced, renamed into place) before it is
//!   answered, and a restart serves every key again. Files there that
//!   cannot be read are skipped with a warning. Note that `rpc_meta` keys
//!   then outlive a server restart too (Mooncake's in-memory servers forget
//!   them): an engine that died without deleting its key must have it
//!   deleted before it can register a different endpoint under that name.
//!
//! # Example
//!
//! ```
//! use multirail_metadata_server::{Limits, MetadataServer, ServerConfig};
//!
//! let server = MetadataServer::start(ServerConfig {
//!     listen: "127.0.0.1:0".parse().unwrap(), // port 0: any free port
//!     data_dir: None,                         // in memory only
//!     limits: Limits::default(),
//! })
//! .expect("metadata server starts");
//! // Give engines this as their metadata server address.
//! println!("metadata server at {}", server.url());
//! server.shutdown();
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod conn;
mod http;
mod limits;
mod metrics;
mod persist;
pub mod query;
pub mod request;
mod server;
mod store;

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::watch;

pub use limits::Limits;

/// Where and how a [`MetadataServer`] serves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on; port 0 picks a free port (see
    /// [`MetadataServer::local_addr`]).
    pub listen: SocketAddr,
    /// Directory holding one file per key. `None` keeps everything in memory
    /// and loses it when the server stops. Created if missing.
    pub data_dir: Option<PathBuf>,
    /// Bounds on requests and connections.
    pub limits: Limits,
}

/// Why a [`MetadataServer`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The listen address could not be bound (in use, not local, no
    /// permission).
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address from [`ServerConfig::listen`].
        addr: SocketAddr,
        /// The operating system's error.
        source: io::Error,
    },
    /// The data directory is not a directory, or could not be created,
    /// listed or written to.
    #[error("metadata data directory {} {problem}", path.display())]
    DataDir {
        /// The directory from [`ServerConfig::data_dir`].
        path: PathBuf,
        /// What is wrong with it, e.g. `is not writable`.
        problem: String,
        /// The operating system's error, when there was one.
        source: Option<io::Error>,
    },
    /// A [`Limits`] field has a value the server cannot work with.
    #[error("invalid metadata server limits: {0}")]
    InvalidLimits(String),
    /// The server's runtime or thread could not be created.
    #[error("cannot start the metadata server's runtime: {0}")]
    Runtime(io::Error),
}

/// A running metadata server: a background thread with its own tokio
/// runtime. Dropping it shuts it down as [`MetadataServer::shutdown`] does.
#[derive(Debug)]
pub struct MetadataServer {
    local_addr: SocketAddr,
    stop: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl MetadataServer {
    /// Loads `config.data_dir` (if any), binds `config.listen` and starts
    /// serving on a background thread with a tokio runtime of its own.
    ///
    /// Returns [`ServerError::Bind`] if the address cannot be bound,
    /// [`ServerError::DataDir`] if the data directory cannot be created,
    /// listed or written, [`ServerError::InvalidLimits`] for unusable limits
    /// and [`ServerError::Runtime`] if the thread or runtime cannot start.
    pub fn start(config: ServerConfig) -> Result<MetadataServer, ServerError> {
        let ServerConfig {
            listen,
            data_dir,
            limits,
        } = config;
        limits.validate().map_err(ServerError::InvalidLimits)?;

        let (persistence, entries) = match &data_dir {
            Some(dir) => {
                let (persistence, entries) =
                    persist::Persistence::open(dir).map_err(|err| ServerError::DataDir {
                        path: dir.clone(),
                        problem: err.problem,
                        source: err.source,
                    })?;
                (Some(persistence), entries)
            }
            None => (None, BTreeMap::new()),
        };

        let bind_error = |source| ServerError::Bind {
            addr: listen,
            source,
        };
        let std_listener = std::net::TcpListener::bind(listen).map_err(bind_error)?;
        std_listener.set_nonblocking(true).map_err(bind_error)?;
        let local_addr = std_listener.local_addr().map_err(bind_error)?;

        let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 4));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("multirail-metadata")
            .enable_io()
            .enable_time()
            .build()
            .map_err(ServerError::Runtime)?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(std_listener).map_err(bind_error)?
        };

        let metrics = Arc::new(metrics::Metrics::new());
        let store = Arc::new(store::Store::new(
            entries,
            persistence,
            limits.key_ttl,
            Arc::clone(&metrics),
        ));
        let app = Arc::new(http::App {
            store: Arc::clone(&store),
            metrics,
            limits: limits.clone(),
        });
        let (stop, stop_rx) = watch::channel(false);
        let runtime_grace = limits.request_timeout;
        let thread = std::thread::Builder::new()
            .name("multirail-metadata-server".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let expiry = tokio::spawn({
                        let stop = stop_rx.clone();
                        async move { store.expire_keys(stop).await }
                    });
                    server::serve(listener, app, stop_rx).await;
                    let _ = expiry.await;
                });
                // Blocking tasks are fsyncs already under way; give them the
                // time to land, but do not hang on a dead disk.
                runtime.shutdown_timeout(runtime_grace);
            })
            .map_err(ServerError::Runtime)?;
        tracing::info!(%local_addr, data_dir = ?data_dir, key_ttl = ?limits.key_ttl, "metadata server listening");
        Ok(MetadataServer {
            local_addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address the server listens on (with the real port when the
    /// configured one was 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The URL engines use as their metadata server:
    /// `http://HOST:PORT/metadata`.
    pub fn url(&self) -> String {
        format!("http://{}/metadata", self.local_addr)
    }

    /// Stops accepting connections, lets the requests in flight finish
    /// (bounded by the request timeout), and joins the server thread.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    /// Blocks until the server thread ends, which only happens if it fails:
    /// for a command that serves until it is killed.
    pub fn wait(mut self) {
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("metadata server thread panicked");
            }
        }
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("metadata server thread panicked");
            }
        }
    }
}

impl Drop for MetadataServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}
