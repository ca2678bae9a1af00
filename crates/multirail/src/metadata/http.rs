//! Descriptors kept in a Mooncake-compatible HTTP metadata server: `GET`, `PUT` and `DELETE`
//! on `SERVER?key=K` with the key URL-encoded, 200 with the raw value, 404 when absent. The
//! server can be `multirail metadata-server` or Mooncake's own.
//!
//! Values are the same JSON a segment answers over its control port in P2P mode, so a
//! descriptor means the same whichever store carried it.

use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use super::keeper::{self, KeeperThread, Schedule};
use super::{HealthCell, StoreHealth};
use crate::config::{check_server_url, ConfigError, MetadataConfig, DEFAULT_LEASE_TTL_S};
use crate::error::{Error, Result};
use crate::protocol::wire;
use crate::segment::SegmentDescriptor;

/// Everything but RFC 3986's unreserved characters is escaped, `/` and `:` included, so a key
/// travels as one query value whatever it holds.
const KEY_ESCAPES: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// How much of an unexpected answer's body an error message quotes.
const QUOTED_BODY: usize = 200;

/// A [`MetadataStore`](super::MetadataStore) backed by an HTTP metadata server speaking
/// Mooncake's protocol. Each segment's descriptor lives under
/// `prefix + [cluster_id + "/"] + name` (`multirail/10.0.0.1:4000` by default).
///
/// Every request gives up after the configured timeout, connecting included, so a store that
/// does not answer fails the lookup instead of hanging it. Requests are blocking: they run on
/// the caller's thread (opening a segment, registering memory), never on a data-path thread.
///
/// The store holds descriptors as they are, access keys included, so whoever can read the store
/// can learn them; the membership token (`auth.token`) still guards every connection.
///
/// What this engine published is kept here too, and a keeper thread (started by the first
/// publish) PUTs it again every refresh period (a third of `metadata.lease_ttl_s`), or sooner
/// with back-off while the server does not answer: a server that was down when the engine
/// started, or restarted without its data, has every engine's descriptor back within one
/// period plus one back-off step, and a server that expires keys not PUT again
/// (`multirail metadata-server --key-ttl-s`) keeps those of live engines.
pub struct HttpMetadata {
    shared: Arc<Shared>,
    refresh_every: Duration,
    /// Started by the first publish; dropped (stopped) before the store.
    keeper: Mutex<Option<KeeperThread>>,
}

struct Shared {
    url: String,
    key_prefix: String,
    timeout: Duration,
    agent: ureq::Agent,
    /// Segment name to descriptor JSON of everything published and not withdrawn.
    published: Mutex<HashMap<String, Vec<u8>>>,
    /// Held across every PUT and DELETE, so the keeper never puts back a descriptor that
    /// `unpublish` has just deleted, nor an older one over a newer.
    writes: Mutex<()>,
    health: HealthCell,
}

impl HttpMetadata {
    /// A store at `url` (`http://HOST:PORT/PATH`) with keys under `prefix` (then `cluster_id/`
    /// when given), each request bounded by `timeout`. Connects lazily: nothing is sent until
    /// the first request. Fails with a configuration error naming `metadata.servers` when `url`
    /// is malformed.
    pub fn new(
        url: &str,
        prefix: &str,
        cluster_id: Option<&str>,
        timeout: Duration,
    ) -> Result<HttpMetadata> {
        check_server_url(url).map_err(|m| ConfigError::new("metadata.servers", m))?;
        let mut key_prefix = prefix.to_owned();
        if let Some(id) = cluster_id {
            key_prefix.push_str(id);
            key_prefix.push('/');
        }
        let agent = ureq::Agent::config_builder()
            // 404 is an answer ("not registered"), not a transport failure.
            .http_status_as_error(false)
            // The store is inside the cluster; an HTTP_PROXY meant for the outside world would
            // only add a hop that can fail.
            .proxy(None)
            .timeout_global(Some(timeout))
            .timeout_connect(Some(timeout))
            .build()
            .into();
        Ok(HttpMetadata {
            shared: Arc::new(Shared {
                url: url.to_owned(),
                key_prefix,
                timeout,
                agent,
                published: Mutex::new(HashMap::new()),
                writes: Mutex::new(()),
                health: HealthCell::default(),
            }),
            refresh_every: keeper::refresh_period(DEFAULT_LEASE_TTL_S),
            keeper: Mutex::new(None),
        })
    }

    /// The same store, PUTting what it published again every `every` instead of every third
    /// of the default lease (`keeper::refresh_period`).
    pub fn with_refresh_every(mut self, every: Duration) -> HttpMetadata {
        self.refresh_every = every;
        self
    }

    /// The store `config` describes (`servers`, `prefix`, `cluster_id`, `timeout_ms`). Fails
    /// with a configuration error naming `metadata.servers` when the address is missing or
    /// malformed.
    pub fn from_config(config: &MetadataConfig) -> Result<HttpMetadata> {
        let url = config.servers.as_deref().ok_or_else(|| {
            ConfigError::new(
                "metadata.servers",
                "is required when metadata.type is \"http\"",
            )
        })?;
        Ok(HttpMetadata::new(
            url,
            &config.prefix,
            config.cluster_id.as_deref(),
            Duration::from_millis(config.timeout_ms),
        )?
        .with_refresh_every(keeper::refresh_period(config.lease_ttl_s)))
    }

    /// The server's address, as configured.
    pub fn url(&self) -> &str {
        &self.shared.url
    }

    /// The key segment `name` is stored under.
    pub fn key(&self, name: &str) -> String {
        self.shared.key(name)
    }

    #[cfg(test)]
    fn request_url(&self, name: &str) -> String {
        self.shared.request_url(name)
    }

    /// Starts the keeper unless it runs; `landed` says whether the publish that starts it
    /// reached the server (if not, the keeper retries at once, with back-off).
    fn start_keeper(&self, landed: bool) {
        let mut keeper = self.keeper.lock().unwrap_or_else(|e| e.into_inner());
        if keeper.is_some() {
            return;
        }
        let shared = self.shared.clone();
        let mut lost = !landed;
        let pass = move || {
            let worked = shared.put_all().is_ok();
            if worked {
                shared.health.refreshed();
                if std::mem::take(&mut lost) {
                    shared.health.republished();
                    tracing::info!(store = %shared.url, "the metadata server answers again; published this engine's descriptors again");
                }
            } else {
                lost = true;
            }
            worked
        };
        let mut schedule = Schedule::new(self.refresh_every);
        let first = if landed {
            self.refresh_every
        } else {
            schedule.after(false)
        };
        match KeeperThread::spawn("mr-meta-keeper", schedule, first, pass) {
            Ok(k) => *keeper = Some(k),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the metadata keeper thread; descriptors are published only when they change")
            }
        }
    }
}

impl Drop for HttpMetadata {
    fn drop(&mut self) {
        // The keeper first, so nothing is put back after the engine withdrew it.
        drop(self.keeper.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Shared {
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.key_prefix)
    }

    fn request_url(&self, name: &str) -> String {
        format!(
            "{}?key={}",
            self.url,
            utf8_percent_encode(&self.key(name), KEY_ESCAPES)
        )
    }

    /// Says why a request got no answer, naming the store.
    fn transport_failure(&self, e: &ureq::Error) -> String {
        match e {
            ureq::Error::Timeout(_) => format!(
                "the metadata server {} did not answer within {} ms",
                self.url,
                self.timeout.as_millis()
            ),
            e => format!("cannot reach the metadata server {}: {e}", self.url),
        }
    }

    /// A short quote of an unexpected answer, for error messages.
    fn quote(body: &mut ureq::Body) -> String {
        let mut text = Vec::new();
        let _ = body
            .as_reader()
            .take(QUOTED_BODY as u64)
            .read_to_end(&mut text);
        String::from_utf8_lossy(&text).trim().to_owned()
    }

    /// PUTs `json` under segment `name`'s key. Fails with the reason, naming the server.
    fn put(&self, name: &str, json: &[u8]) -> std::result::Result<(), String> {
        let mut answer = self
            .agent
            .put(self.request_url(name))
            .send(json)
            .map_err(|e| self.transport_failure(&e))?;
        match answer.status().as_u16() {
            200 => Ok(()),
            status => Err(format!(
                "the metadata server {} answered {status}: {}",
                self.url,
                Self::quote(answer.body_mut())
            )),
        }
    }

    /// One keeper pass: PUTs again every descriptor still published, each under the write
    /// lock and only if it is still the one published. Fails at the first PUT that fails.
    fn put_all(&self) -> std::result::Result<(), String> {
        let names: Vec<String> = self
            .published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        for name in names {
            let _writing = self.writes.lock().unwrap_or_else(|e| e.into_inner());
            let Some(json) = self
                .published
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&name)
                .cloned()
            else {
                continue;
            };
            self.health.record(self.put(&name, &json))?;
        }
        Ok(())
    }
}

impl Shared {
    /// One GET of segment `name`: its descriptor JSON, `None` when the server has no such
    /// key, or why the request failed (naming the server).
    fn get(&self, name: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        let mut answer = self
            .agent
            .get(self.request_url(name))
            .call()
            .map_err(|e| self.transport_failure(&e))?;
        match answer.status().as_u16() {
            200 => {}
            404 => return Ok(None),
            status => {
                return Err(format!(
                    "the metadata server {} answered {status}: {}",
                    self.url,
                    Self::quote(answer.body_mut())
                ))
            }
        }
        answer
            .body_mut()
            .with_config()
            .limit(wire::MAX_CONTROL_LEN.into())
            .read_to_vec()
            .map(Some)
            .map_err(|e| self.transport_failure(&e))
    }

    /// DELETEs segment `name`'s key; a key already gone (404) counts as deleted.
    fn delete(&self, name: &str) -> std::result::Result<(), String> {
        let mut answer = self
            .agent
            .delete(self.request_url(name))
            .call()
            .map_err(|e| self.transport_failure(&e))?;
        match answer.status().as_u16() {
            200 | 404 => Ok(()),
            status => Err(format!(
                "the metadata server {} answered {status}: {}",
                self.url,
                Self::quote(answer.body_mut())
            )),
        }
    }
}

impl super::MetadataStore for HttpMetadata {
    /// Fails with `SegmentUnreachable` when the store has no such key ("not registered"), does
    /// not answer within the timeout or cannot be reached (the reason names the store), or
    /// holds something that is not this segment's descriptor ("bad descriptor").
    fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        let unreachable = |reason: String| Error::SegmentUnreachable {
            name: name.to_owned(),
            reason,
        };
        let s = &self.shared;
        let Some(body) = s.health.record(s.get(name)).map_err(unreachable)? else {
            return Err(unreachable(format!(
                "not registered in the metadata server {}",
                s.url
            )));
        };
        let descriptor: SegmentDescriptor = serde_json::from_slice(&body).map_err(|e| {
            unreachable(format!(
                "bad descriptor under key {:?} in the metadata server {}: {e}",
                self.key(name),
                s.url
            ))
        })?;
        // A value left by another engine (or written by hand) must not send requests elsewhere.
        if descriptor.published_name() != name {
            return Err(unreachable(format!(
                "bad descriptor under key {:?} in the metadata server {}: it describes segment {:?}",
                self.key(name),
                s.url,
                descriptor.name
            )));
        }
        Ok(descriptor)
    }

    /// PUTs the descriptor's JSON under `name`'s key, and keeps it there from then on (see
    /// [`HttpMetadata`]). Fails with an I/O error naming the store when it does not answer
    /// 200; the keeper then retries with back-off until it does.
    fn publish(&self, name: &str, descriptor: &SegmentDescriptor) -> Result<()> {
        let s = &self.shared;
        let json = serde_json::to_vec(descriptor).expect("descriptor serializes");
        let outcome = {
            let _writing = s.writes.lock().unwrap_or_else(|e| e.into_inner());
            s.published
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.to_owned(), json.clone());
            s.health.record(s.put(name, &json))
        };
        self.start_keeper(outcome.is_ok());
        outcome.map_err(|e| {
            Error::io(
                format!("publishing segment {name} to the metadata server {}", s.url),
                std::io::Error::other(e),
            )
        })
    }

    /// DELETEs `name`'s key (the keeper stops putting it back); a key already gone (404)
    /// counts as withdrawn. Fails with an I/O error naming the store otherwise.
    fn unpublish(&self, name: &str) -> Result<()> {
        let s = &self.shared;
        let _writing = s.writes.lock().unwrap_or_else(|e| e.into_inner());
        s.published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        s.health.record(s.delete(name)).map_err(|e| {
            Error::io(
                format!(
                    "withdrawing segment {name} from the metadata server {}",
                    s.url
                ),
                std::io::Error::other(e),
            )
        })
    }

    fn health(&self) -> StoreHealth {
        self.shared.health.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_prefixed_and_escaped() {
        let t = Duration::from_millis(10);
        let m = HttpMetadata::new("http://h:1/metadata", "multirail/", None, t).unwrap();
        assert_eq!(m.key("10.0.0.1:4000"), "multirail/10.0.0.1:4000");
        assert_eq!(
            m.request_url("10.0.0.1:4000"),
            "http://h:1/metadata?key=multirail%2F10.0.0.1%3A4000"
        );
        let m = HttpMetadata::new("http://h:1/metadata", "p/", Some("c 1"), t);
        // The engine validates cluster ids; the store itself only escapes.
        let m = m.unwrap();
        assert_eq!(m.key("[::1]:5"), "p/c 1/[::1]:5");
        assert_eq!(
            m.request_url("[::1]:5"),
            "http://h:1/metadata?key=p%2Fc%201%2F%5B%3A%3A1%5D%3A5"
        );
        let e = HttpMetadata::new("h:1", "p/", None, t).err().unwrap();
        assert!(e.to_string().contains("metadata.servers"), "{e}");
    }
}
