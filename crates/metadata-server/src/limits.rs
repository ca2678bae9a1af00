//! Bounds on what one client can make the server hold or wait for.

use std::time::Duration;

/// Bounds the server enforces on every request and connection.
///
/// The defaults suit Mooncake-style metadata (segment descriptors of a few
/// kilobytes); raise `max_value_bytes` for engines that publish large
/// segment tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest value a `PUT` may store, in bytes. A larger body is answered
    /// with `413 Payload Too Large` and nothing is stored. Default: 1 MiB.
    pub max_value_bytes: usize,
    /// Longest key (or listing prefix) accepted, in bytes after URL decoding.
    /// A longer one is answered with `400 Bad Request`. Default: 4096.
    pub max_key_bytes: usize,
    /// Most connections served at once. Further connections are not
    /// accepted until one closes: they wait in the kernel's listen backlog
    /// (and are refused by the kernel once that is full). Default: 1024.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers, and again
    /// its body; an idle keep-alive connection is closed after this long
    /// too. A body that does not arrive in time is answered with
    /// `408 Request Timeout`. Default: 30 seconds.
    pub request_timeout: Duration,
    /// How long a key lives after its last `PUT`: a key not stored again
    /// within this time is dropped (from memory and from the data
    /// directory) and reads answer 404, as etcd drops the keys of a lease
    /// that was not kept alive. Each `PUT` of the key, even one that
    /// republishes an `rpc_meta` key unchanged, restarts its time; keys
    /// loaded from the data directory at start get the full time. `None`
    /// keeps keys until they are deleted, as Mooncake's servers do.
    /// At most [`Limits::MAX_KEY_TTL`]. Default: `None`.
    pub key_ttl: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_value_bytes: 1 << 20,
            max_key_bytes: 4096,
            max_connections: 1024,
            request_timeout: Duration::from_secs(30),
            key_ttl: None,
        }
    }
}

impl Limits {
    /// The longest [`Limits::key_ttl`]: one day.
    pub const MAX_KEY_TTL: Duration = Duration::from_secs(86_400);

    /// Checks the limits can serve anything at all; the error names the field.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("max_connections must be at least 1".into());
        }
        if self.max_key_bytes == 0 {
            return Err("max_key_bytes must be at least 1".into());
        }
        if self.request_timeout.is_zero() {
            return Err("request_timeout must be longer than zero".into());
        }
        if let Some(ttl) = self.key_ttl {
            if ttl.is_zero() || ttl > Self::MAX_KEY_TTL {
                return Err(format!(
                    "key_ttl must be longer than zero and at most {} s (None: keys never expire), got {ttl:?}",
                    Self::MAX_KEY_TTL.as_secs()
                ));
            }
        }
        Ok(())
    }
}
