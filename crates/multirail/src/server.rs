//! What the engine's listening port (`listener`) hands out and reports, kept apart from the
//! listener itself so that those it hands connections to can name it without depending on
//! the listener: the `ConnPermit` a taken-over connection holds, the traits of the
//! transports and messaging that take connections over (`MessageListener`,
//! `RdmaListener`), and [`ConnectionStats`]. It uses no other module of the crate, so
//! every layer may use it; the listener, above the transports, implements the port.

use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// What the listening port holds and has refused, from
/// [`Engine::connection_stats`](crate::Engine::connection_stats).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConnectionStats {
    /// Connections held now, of every kind (messaging connections included).
    pub open: usize,
    /// Connections held now that have not finished the handshake.
    pub pending: usize,
    /// Connections accepted since the engine started.
    pub accepted: u64,
    /// Connections refused because they did not prove membership (missing or wrong token).
    pub not_members: u64,
    /// Unproven connections closed to make room (pending cap, fd exhaustion) or at their
    /// handshake deadline.
    pub shed_pending: u64,
    /// Members' idle connections closed because the process ran out of fds.
    pub shed_idle: u64,
    /// Connections closed at once because `max_connections` were held.
    pub refused_full: u64,
    /// Failed accepts (out of fds, mostly).
    pub accept_errors: u64,
    /// Threads serving connections: the pool (`transports.tcp.serve_threads`) and as many
    /// serving connections that carry HIGH slices.
    pub serve_threads: usize,
}

/// Where the listener routes message connections (the engine's messaging). A trait, so the
/// listener does not depend on messaging, which sits above it.
pub(crate) trait MessageListener: Send + Sync {
    /// Length of a complete message-connection opening, given its first bytes; `None` while
    /// more are needed. Fails on an opening that cannot be valid.
    fn opening_len(&self, prefix: &[u8]) -> std::result::Result<Option<usize>, String>;
    /// Takes over a message connection whose `opening` was read. Fails with the reason it
    /// refused it (then the connection is closed).
    fn accept(
        &self,
        stream: TcpStream,
        opening: &[u8],
        permit: ConnPermit,
    ) -> std::result::Result<(), String>;
}

/// Where the listener routes RDMA control connections (the rdma transport, which agrees queue
/// pairs over them and keeps them while the initiator uses those).
pub(crate) trait RdmaListener: Send + Sync {
    /// Takes over an RDMA control connection past the handshake. Fails with the reason it
    /// refused it (then the connection is closed).
    fn accept(&self, stream: TcpStream, permit: ConnPermit) -> std::result::Result<(), String>;
}

/// Keeps a connection handed to messaging or the rdma transport counted against
/// `max_connections` until it closes.
pub(crate) struct ConnPermit {
    open: Arc<AtomicUsize>,
}

impl ConnPermit {
    /// A permit for a connection already counted in `open`; dropping it uncounts it.
    pub(crate) fn new(open: Arc<AtomicUsize>) -> ConnPermit {
        ConnPermit { open }
    }
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}
