//! Where segment descriptors come from. Peer-to-peer first: ask the segment's own control port.
//! Behind the `MetadataStore` trait so other stores plug in without touching the engine: a
//! Mooncake-compatible HTTP metadata server ([`HttpMetadata`]) and etcd ([`EtcdMetadata`],
//! with leases and a watch) are the others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use crate::config::{MetadataConfig, MetadataKind};
use crate::error::{Error, Result};
use crate::protocol::handshake::{self, Membership};
use crate::protocol::wire::{self, ConnKind};
use crate::segment::SegmentDescriptor;

mod etcd;
mod http;
mod keeper;

pub use crate::config::DEFAULT_LEASE_TTL_S;
pub use etcd::EtcdMetadata;
pub use http::HttpMetadata;

/// Counts of an engine's use of its metadata store (see [`crate::Engine::metadata_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetadataStats {
    /// Descriptor lookups: opening a segment, and refetching one whose cached descriptor
    /// lacks an address.
    pub lookups: u64,
    /// Of those, the ones that failed (not registered, store unreachable or late, bad value).
    pub lookup_failures: u64,
    /// Publishes of this engine's descriptor (stores that keep descriptors only).
    pub publishes: u64,
    /// Of those, the ones that failed.
    pub publish_failures: u64,
    /// Open segments updated from the store's watch (etcd): new buffers, or a new process.
    pub watch_updates: u64,
    /// Whether the store answered its last request (lookup, publish or keep-alive).
    pub store: StoreState,
    /// Requests to the store that failed since it last answered (0 while it answers).
    pub store_failures_in_a_row: u64,
    /// Keep-alives of what this engine published: etcd lease renewals, or the HTTP store's
    /// periodic PUTs, that the store took.
    pub refreshes: u64,
    /// Times this engine found its published keys lost or never stored (the store was
    /// unreachable at start, restarted without its data, or let the lease expire) and
    /// published everything again once the store answered.
    pub republishes: u64,
}

/// Whether an engine's metadata store answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StoreState {
    /// The engine keeps no descriptors in a store (peer-to-peer lookups).
    #[default]
    NotUsed,
    /// No request has been made yet.
    Unknown,
    /// The last request was answered.
    Up,
    /// The last request failed (unreachable, too late, or refused); the engine keeps
    /// retrying with capped exponential back-off and publishes again once it answers.
    Down,
}

impl StoreState {
    /// The state as metrics and reports name it: `not_used`, `unknown`, `up` or `down`.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreState::NotUsed => "not_used",
            StoreState::Unknown => "unknown",
            StoreState::Up => "up",
            StoreState::Down => "down",
        }
    }
}

/// What a store saw of itself: its state and the keeper's counts (see [`MetadataStats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreHealth {
    /// As [`MetadataStats::store`].
    pub state: StoreState,
    /// As [`MetadataStats::store_failures_in_a_row`].
    pub failures_in_a_row: u64,
    /// As [`MetadataStats::refreshes`].
    pub refreshes: u64,
    /// As [`MetadataStats::republishes`].
    pub republishes: u64,
}

/// The counters behind [`StoreHealth`], shared by a store's callers and its keeper.
#[derive(Default)]
pub(crate) struct HealthCell {
    /// 0 unknown, 1 up, 2 down.
    state: AtomicU8,
    failures_in_a_row: AtomicU64,
    refreshes: AtomicU64,
    republishes: AtomicU64,
}

impl HealthCell {
    /// Records an answer from the store.
    pub(crate) fn answered(&self) {
        self.state.store(1, Ordering::Relaxed);
        self.failures_in_a_row.store(0, Ordering::Relaxed);
    }

    /// Records a request the store did not answer (or refused).
    pub(crate) fn failed(&self) {
        self.state.store(2, Ordering::Relaxed);
        self.failures_in_a_row.fetch_add(1, Ordering::Relaxed);
    }

    /// Records `outcome` as answered or failed and passes it on.
    pub(crate) fn record<T, E>(
        &self,
        outcome: std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        match &outcome {
            Ok(_) => self.answered(),
            Err(_) => self.failed(),
        }
        outcome
    }

    pub(crate) fn refreshed(&self) {
        self.refreshes.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn republished(&self) {
        self.republishes.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> StoreHealth {
        StoreHealth {
            state: match self.state.load(Ordering::Relaxed) {
                0 => StoreState::Unknown,
                1 => StoreState::Up,
                _ => StoreState::Down,
            },
            failures_in_a_row: self.failures_in_a_row.load(Ordering::Relaxed),
            refreshes: self.refreshes.load(Ordering::Relaxed),
            republishes: self.republishes.load(Ordering::Relaxed),
        }
    }
}

/// The counters behind [`MetadataStats`].
#[derive(Default)]
pub(crate) struct MetadataCounters {
    lookups: AtomicU64,
    lookup_failures: AtomicU64,
    publishes: AtomicU64,
    publish_failures: AtomicU64,
    watch_updates: AtomicU64,
}

impl MetadataCounters {
    /// Counts a lookup and passes its outcome on.
    pub(crate) fn lookup<T>(&self, outcome: Result<T>) -> Result<T> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        if outcome.is_err() {
            self.lookup_failures.fetch_add(1, Ordering::Relaxed);
        }
        outcome
    }

    /// Counts a publish and passes its outcome on.
    pub(crate) fn publish(&self, outcome: Result<()>) -> Result<()> {
        self.publishes.fetch_add(1, Ordering::Relaxed);
        if outcome.is_err() {
            self.publish_failures.fetch_add(1, Ordering::Relaxed);
        }
        outcome
    }

    pub(crate) fn watch_update(&self) {
        self.watch_updates.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts, with what the store saw of itself (`health`).
    pub(crate) fn snapshot(&self, health: StoreHealth) -> MetadataStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetadataStats {
            lookups: get(&self.lookups),
            lookup_failures: get(&self.lookup_failures),
            publishes: get(&self.publishes),
            publish_failures: get(&self.publish_failures),
            watch_updates: get(&self.watch_updates),
            store: health.state,
            store_failures_in_a_row: health.failures_in_a_row,
            refreshes: health.refreshes,
            republishes: health.republishes,
        }
    }
}

/// Told of every descriptor published (`Some`) or withdrawn (`None`) under a segment name,
/// by stores that can watch ([`MetadataStore::watch`]). Runs on the store's own thread: it
/// must return quickly and never call back into the store.
pub type ChangeListener = Box<dyn Fn(&str, Option<SegmentDescriptor>) + Send + Sync>;

/// A source of segment descriptors.
pub trait MetadataStore: Send + Sync {
    /// Fetches the current descriptor of segment `name` (`host:port`). Fails with
    /// `SegmentUnreachable` when the segment cannot be reached or answers nonsense.
    fn fetch(&self, name: &str) -> Result<SegmentDescriptor>;

    /// Makes `descriptor` the one `fetch(name)` returns from now on, replacing any older one.
    /// The default does nothing: a store that asks segments themselves has nothing to publish.
    /// Fails when the store cannot be reached or refuses the descriptor.
    fn publish(&self, name: &str, descriptor: &SegmentDescriptor) -> Result<()> {
        let _ = (name, descriptor);
        Ok(())
    }

    /// Withdraws what `publish` put under `name`, so lookups of it fail. The default does
    /// nothing. Withdrawing a name that is not there succeeds; fails only when the store cannot
    /// be reached or refuses.
    fn unpublish(&self, name: &str) -> Result<()> {
        let _ = name;
        Ok(())
    }

    /// Starts telling `listener` of descriptors published and withdrawn from now on. The
    /// default does nothing: only stores that can watch (etcd) call it. Never fails; a store
    /// that cannot watch right now keeps trying.
    fn watch(&self, listener: ChangeListener) {
        let _ = listener;
    }

    /// Whether the store answers, and its keeper's counts. The default, for stores that keep
    /// nothing (peer-to-peer), is [`StoreState::NotUsed`].
    fn health(&self) -> StoreHealth {
        StoreHealth::default()
    }
}

/// The store `config` asks for: [`P2pMetadata`] with the given timeouts and `membership`,
/// [`HttpMetadata`] for `type: "http"` or [`EtcdMetadata`] for `type: "etcd"`. Fails with a
/// configuration error when the server address is missing or malformed (which
/// [`crate::Config::validate`] already refuses).
pub fn from_config(
    config: &MetadataConfig,
    connect_timeout: Duration,
    io_timeout: Duration,
    membership: Membership,
) -> Result<Box<dyn MetadataStore>> {
    Ok(match config.kind {
        MetadataKind::P2p => Box::new(P2pMetadata::new(connect_timeout, io_timeout, membership)),
        MetadataKind::Http => Box::new(HttpMetadata::from_config(config)?),
        MetadataKind::Etcd => Box::new(EtcdMetadata::from_config(config)?),
    })
}

/// Asks the segment itself over its control port: no metadata server needed.
pub struct P2pMetadata {
    connect_timeout: Duration,
    io_timeout: Duration,
    membership: Membership,
}

impl P2pMetadata {
    /// A store that gives up connecting (handshake included) after `connect_timeout` and
    /// waiting for an answer after `io_timeout`, proving `membership` to every segment.
    pub fn new(connect_timeout: Duration, io_timeout: Duration, membership: Membership) -> Self {
        P2pMetadata {
            connect_timeout,
            io_timeout,
            membership,
        }
    }
}

/// Resolves `host:port`; the error says which part is wrong.
pub fn resolve(name: &str) -> Result<SocketAddr> {
    let unreachable = |reason: String| Error::SegmentUnreachable {
        name: name.to_owned(),
        reason,
    };
    let (host, port) = name
        .rsplit_once(':')
        .ok_or_else(|| unreachable("segment names are host:port".into()))?;
    port.parse::<u16>()
        .map_err(|_| unreachable(format!("bad port {port:?}")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port.parse().expect("checked");
    (host, port)
        .to_socket_addrs()
        .map_err(|e| unreachable(format!("cannot resolve {host:?}: {e}")))?
        .next()
        .ok_or_else(|| unreachable(format!("{host:?} resolves to no address")))
}

impl MetadataStore for P2pMetadata {
    fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        let addr = resolve(name)?;
        let unreachable = |reason: String| Error::SegmentUnreachable {
            name: name.to_owned(),
            reason,
        };
        let mut stream = TcpStream::connect_timeout(&addr, self.connect_timeout)
            .map_err(|e| unreachable(format!("connecting to {addr}: {e}")))?;
        handshake::client(
            &stream,
            ConnKind::Control,
            &self.membership,
            name,
            self.connect_timeout,
        )?;
        stream
            .set_read_timeout(Some(self.io_timeout))
            .and_then(|_| stream.set_write_timeout(Some(self.io_timeout)))
            .map_err(|e| unreachable(e.to_string()))?;
        stream
            .write_all(&[wire::CONTROL_GET_DESCRIPTOR])
            .map_err(|e| unreachable(format!("sending descriptor query: {e}")))?;
        let mut len = [0u8; 4];
        stream
            .read_exact(&mut len)
            .map_err(|e| unreachable(format!("reading descriptor: {e}")))?;
        let len = u32::from_le_bytes(len);
        if len > wire::MAX_CONTROL_LEN {
            return Err(unreachable(format!(
                "descriptor of {len} bytes is above the limit"
            )));
        }
        let mut json = vec![0u8; len as usize];
        stream
            .read_exact(&mut json)
            .map_err(|e| unreachable(format!("reading descriptor: {e}")))?;
        serde_json::from_slice(&json).map_err(|e| unreachable(format!("malformed descriptor: {e}")))
    }
}
