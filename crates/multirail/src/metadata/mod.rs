//! Where segment descriptors come from. Peer-to-peer first: ask the segment's own control port.
//! Behind the `MetadataStore` trait so other stores plug in without touching the engine: a
//! Mooncake-compatible HTTP metadata server ([`HttpMetadata`]) is the second.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::config::{MetadataConfig, MetadataKind};
use crate::error::{Error, Result};
use crate::segment::SegmentDescriptor;
use crate::transport::handshake::{self, Membership};
use crate::transport::wire::{self, ConnKind};

mod http;

pub(crate) use http::check_server_url;
pub use http::HttpMetadata;

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
}

/// The store `config` asks for: [`P2pMetadata`] with the given timeouts and `membership`, or
/// [`HttpMetadata`] for `type: "http"`. Fails with a configuration error when the HTTP server
/// address is missing or malformed (which [`crate::Config::validate`] already refuses).
pub fn from_config(
    config: &MetadataConfig,
    connect_timeout: Duration,
    io_timeout: Duration,
    membership: Membership,
) -> Result<Box<dyn MetadataStore>> {
    Ok(match config.kind {
        MetadataKind::P2p => Box::new(P2pMetadata::new(connect_timeout, io_timeout, membership)),
        MetadataKind::Http => Box::new(HttpMetadata::from_config(config)?),
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
