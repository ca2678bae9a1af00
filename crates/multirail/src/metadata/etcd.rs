//! Descriptors kept in etcd (v3 API, through the `etcd-client` crate). Each engine's keys hang
//! on one lease the engine keeps alive, so an engine that dies without withdrawing them
//! disappears within the lease's time to live; a watch on the key prefix tells the engine when
//! a segment it has opened is published again (restarted, moved to another port) or withdrawn.
//!
//! The engine is synchronous and etcd's client is not: the store owns a small tokio runtime
//! (one worker thread, `mr-etcd`) that runs every request, the lease keeper and the watch.
//! Callers wait on a channel, never inside the runtime, so an engine method called from an
//! application's own async code blocks for at most `metadata.timeout_ms` instead of
//! panicking.
//!
//! Values are the same JSON a segment answers over its control port in P2P mode.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};

use super::keeper::{self, Schedule};
use super::{ChangeListener, HealthCell, StoreHealth};
use crate::config::{parse_etcd_endpoints, ConfigError, MetadataConfig};
use crate::error::{Error, Result};
use crate::protocol::wire;
use crate::segment::SegmentDescriptor;

/// The lease to ask etcd for so that keys of a dead engine are gone within `lease_ttl_s`:
/// etcd revokes expired leases in a pass every 500 ms, so a lease of exactly `lease_ttl_s`
/// outlives it by up to half a second; one second shorter leaves that pass room. etcd raises
/// leases below its own minimum (about 2 s with its default election timeout).
fn granted_ttl(lease_ttl_s: u64) -> i64 {
    lease_ttl_s.saturating_sub(1).max(1) as i64
}

/// How long the watch waits before trying etcd again after a failure.
const RETRY_AFTER: Duration = Duration::from_millis(500);

/// A [`MetadataStore`](super::MetadataStore) backed by etcd. Each segment's descriptor lives
/// under `prefix + [cluster_id + "/"] + name`, attached to this store's lease.
///
/// Every request gives up after the configured timeout, so a store that does not answer fails
/// the lookup (naming the store) instead of hanging it. What this engine published is kept
/// here too: when the lease is lost (etcd was unreachable for longer than its time to live),
/// the keeper takes a new one and publishes everything again.
pub struct EtcdMetadata {
    shared: Arc<Shared>,
    /// `None` only while dropping.
    runtime: Option<tokio::runtime::Runtime>,
}

struct Shared {
    endpoints: Vec<String>,
    /// The store as errors name it: `etcd://HOST:PORT,...`.
    shown: String,
    key_prefix: String,
    timeout: Duration,
    /// The TTL asked of etcd for the lease ([`granted_ttl`]).
    lease_ttl_s: i64,
    client: tokio::sync::Mutex<Option<Client>>,
    /// Key to value of everything this engine published and has not withdrawn.
    published: Mutex<HashMap<String, Vec<u8>>>,
    /// The lease the published keys hang on; 0 before the first publish, and after one that
    /// could not get a lease.
    lease: tokio::sync::Mutex<i64>,
    /// Some published key may be missing from etcd (its put failed): the keeper's next pass
    /// puts everything again.
    unsynced: AtomicBool,
    /// How often the keeper renews the lease: a third of `metadata.lease_ttl_s`.
    refresh_every: Duration,
    health: HealthCell,
    keeper_started: AtomicBool,
    watch_started: AtomicBool,
}

impl EtcdMetadata {
    /// A store on the etcd cluster `servers` (see `config::parse_etcd_endpoints`) with keys under
    /// `prefix` (then `cluster_id/` when given), each request bounded by `timeout`, published
    /// keys on a lease that makes them disappear within `lease_ttl_s` seconds of the engine's
    /// death (`granted_ttl`). Connects lazily: nothing is sent until the
    /// first request. Fails with a configuration error naming `metadata.servers` when
    /// `servers` is malformed, or `metadata.lease_ttl_s` when it is 0, and with `Io` when the
    /// runtime thread cannot be started.
    pub fn new(
        servers: &str,
        prefix: &str,
        cluster_id: Option<&str>,
        timeout: Duration,
        lease_ttl_s: u64,
    ) -> Result<EtcdMetadata> {
        let endpoints =
            parse_etcd_endpoints(servers).map_err(|m| ConfigError::new("metadata.servers", m))?;
        if lease_ttl_s == 0 || lease_ttl_s > i64::MAX as u64 {
            return Err(ConfigError::new("metadata.lease_ttl_s", "must be at least 1").into());
        }
        let mut key_prefix = prefix.to_owned();
        if let Some(id) = cluster_id {
            key_prefix.push_str(id);
            key_prefix.push('/');
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mr-etcd")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the etcd client's thread", e))?;
        let shown = format!(
            "etcd://{}",
            endpoints
                .iter()
                .map(|e| e.trim_start_matches("http://"))
                .collect::<Vec<_>>()
                .join(",")
        );
        Ok(EtcdMetadata {
            shared: Arc::new(Shared {
                endpoints,
                shown,
                key_prefix,
                timeout,
                lease_ttl_s: granted_ttl(lease_ttl_s),
                client: tokio::sync::Mutex::new(None),
                published: Mutex::new(HashMap::new()),
                lease: tokio::sync::Mutex::new(0),
                unsynced: AtomicBool::new(false),
                refresh_every: keeper::refresh_period(lease_ttl_s),
                health: HealthCell::default(),
                keeper_started: AtomicBool::new(false),
                watch_started: AtomicBool::new(false),
            }),
            runtime: Some(runtime),
        })
    }

    /// The store `config` describes (`servers`, `prefix`, `cluster_id`, `timeout_ms`,
    /// `lease_ttl_s`). Fails as [`EtcdMetadata::new`] does, and with a configuration error
    /// naming `metadata.servers` when no server is given.
    pub fn from_config(config: &MetadataConfig) -> Result<EtcdMetadata> {
        let servers = config.servers.as_deref().ok_or_else(|| {
            ConfigError::new(
                "metadata.servers",
                "is required when metadata.type is \"etcd\"",
            )
        })?;
        EtcdMetadata::new(
            servers,
            &config.prefix,
            config.cluster_id.as_deref(),
            Duration::from_millis(config.timeout_ms),
            config.lease_ttl_s,
        )
    }

    /// The store as errors name it: `etcd://HOST:PORT[,HOST:PORT...]`.
    pub fn url(&self) -> &str {
        &self.shared.shown
    }

    /// The key segment `name` is stored under.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.shared.key_prefix)
    }

    /// Runs `op` on the runtime and waits for it, for at most the store's timeout. The error
    /// names the store.
    fn run<T, F, Fut>(&self, op: F) -> std::result::Result<T, String>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Shared>) -> Fut,
        Fut: Future<Output = std::result::Result<T, String>> + Send + 'static,
    {
        let timeout = self.shared.timeout;
        let Some(runtime) = &self.runtime else {
            return Err(self.shared.late());
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let shared = self.shared.clone();
        let fut = op(shared.clone());
        // The error text is made only when the request is late, not for every request.
        runtime.spawn(async move {
            let answer = tokio::time::timeout(timeout, fut)
                .await
                .unwrap_or_else(|_| Err(shared.late()));
            let _ = tx.send(answer);
        });
        // The task answers by the timeout; the margin only covers a runtime slow to schedule.
        let answer = rx
            .recv_timeout(timeout + Duration::from_millis(500))
            .unwrap_or_else(|_| Err(self.shared.late()));
        self.shared.health.record(answer)
    }
}

impl Shared {
    fn late(&self) -> String {
        format!(
            "the metadata store {} did not answer within {} ms",
            self.shown,
            self.timeout.as_millis()
        )
    }

    fn failed(&self, e: etcd_client::Error) -> String {
        format!("the metadata store {} failed: {e}", self.shown)
    }

    /// The client, connected on first use.
    async fn client(&self) -> std::result::Result<Client, String> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let options = ConnectOptions::new()
            .with_connect_timeout(self.timeout)
            .with_timeout(self.timeout)
            // Notices a dead etcd member on an idle connection: the watch must move on.
            .with_keep_alive(Duration::from_secs(2), self.timeout);
        let c = Client::connect(&self.endpoints, Some(options))
            .await
            .map_err(|e| format!("cannot reach the metadata store {}: {e}", self.shown))?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// The lease to publish on, granted on first use.
    async fn lease(&self, client: &mut Client) -> std::result::Result<i64, String> {
        let mut lease = self.lease.lock().await;
        if *lease == 0 {
            let granted = client
                .lease_grant(self.lease_ttl_s, None)
                .await
                .map_err(|e| self.failed(e))?;
            *lease = granted.id();
        }
        Ok(*lease)
    }

    /// Forgets `expired` (when it is still the current lease) and grants a new one.
    async fn renew_lease(
        &self,
        client: &mut Client,
        expired: i64,
    ) -> std::result::Result<i64, String> {
        {
            let mut lease = self.lease.lock().await;
            if *lease == expired {
                *lease = 0;
            }
        }
        self.lease(client).await
    }

    async fn put_on_lease(
        &self,
        client: &mut Client,
        key: &str,
        value: Vec<u8>,
    ) -> std::result::Result<(), String> {
        let lease = self.lease(client).await?;
        let put = client
            .put(
                key,
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await;
        match put {
            Ok(_) => Ok(()),
            // The lease ran out while etcd was away (or etcd lost it): take a new one.
            Err(e) if e.to_string().contains("lease not found") => {
                let lease = self.renew_lease(client, lease).await?;
                client
                    .put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await
                    .map(|_| ())
                    .map_err(|e| self.failed(e))
            }
            Err(e) => Err(self.failed(e)),
        }
    }

    /// Keeps what this engine published in etcd, every third of the lease's time to live
    /// ([`Shared::maintain`]); a pass that fails is retried with capped exponential back-off
    /// and jitter, so a store that was unreachable (at start or later), restarted without its
    /// data, or let the lease expire has everything back within a back-off step of answering.
    /// `landed`: whether the publish that started the keeper reached etcd.
    async fn keep_lease(self: Arc<Self>, landed: bool) {
        let mut schedule = Schedule::new(self.refresh_every);
        let mut delay = if landed {
            self.refresh_every
        } else {
            schedule.after(false)
        };
        let mut last_warning: Option<Instant> = None;
        loop {
            tokio::time::sleep(delay).await;
            let outcome = tokio::time::timeout(self.timeout, self.maintain())
                .await
                .unwrap_or_else(|_| Err(self.late()));
            let outcome = self.health.record(outcome);
            delay = schedule.after(outcome.is_ok());
            match outcome {
                Ok(republished) => {
                    self.health.refreshed();
                    if republished {
                        self.health.republished();
                    }
                }
                Err(failure) => {
                    if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                        last_warning = Some(Instant::now());
                        tracing::warn!(error = %failure, retry_in = ?delay, "cannot keep this engine's metadata in etcd; retrying with back-off (logged at most every 10 s)");
                    }
                }
            }
        }
    }

    /// One keeper pass: with no lease yet (the store was unreachable when the engine first
    /// published), takes one and puts everything; otherwise renews the lease, putting
    /// everything again on a new one when etcd no longer knows it, or on the same one when a
    /// put had failed. Returns whether everything was put again.
    async fn maintain(&self) -> std::result::Result<bool, String> {
        let lease = *self.lease.lock().await;
        if lease == 0 {
            if self
                .published
                .lock()
                .expect("published poisoned")
                .is_empty()
            {
                return Ok(false);
            }
            let mut client = self.client().await?;
            let fresh = self.lease(&mut client).await?;
            self.put_all(&mut client, fresh).await?;
            tracing::info!("the metadata store answers; published this engine's descriptors");
            return Ok(true);
        }
        let renewed = self.refresh(lease).await?;
        if !renewed && self.unsynced.load(Ordering::Acquire) {
            let mut client = self.client().await?;
            self.put_all(&mut client, lease).await?;
            return Ok(true);
        }
        Ok(renewed)
    }

    /// Puts every published key on `lease`; clears [`Shared::unsynced`] when all landed.
    async fn put_all(&self, client: &mut Client, lease: i64) -> std::result::Result<(), String> {
        self.unsynced.store(false, Ordering::Release);
        let entries: Vec<(String, Vec<u8>)> = self
            .published
            .lock()
            .expect("published poisoned")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, value) in entries {
            let put = client
                .put(key, value, Some(PutOptions::new().with_lease(lease)))
                .await;
            if let Err(e) = put {
                self.unsynced.store(true, Ordering::Release);
                return Err(self.failed(e));
            }
        }
        Ok(())
    }

    /// One keep-alive of `lease`, or a new lease with everything published again.
    /// Returns whether it took a new lease and put everything again.
    async fn refresh(&self, lease: i64) -> std::result::Result<bool, String> {
        let mut client = self.client().await?;
        let answer = async {
            let (mut keeper, mut answers) = client.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            answers.message().await
        }
        .await;
        let ttl = match answer {
            Ok(Some(answer)) => answer.ttl(),
            Ok(None) => {
                return Err(format!(
                    "the metadata store {} closed the keep-alive",
                    self.shown
                ))
            }
            // etcd no longer knows the lease (it expired, or etcd lost its data); the client
            // reports that as an error from whichever call saw it.
            Err(e) if e.to_string().contains("lease not found") => 0,
            Err(e) => return Err(self.failed(e)),
        };
        if ttl > 0 {
            return Ok(false);
        }
        let fresh = self.renew_lease(&mut client, lease).await?;
        self.put_all(&mut client, fresh).await?;
        tracing::info!("the metadata lease had expired; published again on a new lease");
        Ok(true)
    }

    /// Follows every change under the key prefix and tells `listener`, resuming after the
    /// last revision seen when the watch breaks, so no change is missed while etcd keeps its
    /// history.
    async fn follow(self: Arc<Self>, listener: ChangeListener) {
        let mut next_revision = 0i64;
        let mut last_warning: Option<Instant> = None;
        loop {
            if let Err(e) = self.follow_once(&listener, &mut next_revision).await {
                if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    last_warning = Some(Instant::now());
                    tracing::warn!(error = %e, "the metadata watch broke; retrying (logged at most every 10 s)");
                }
            }
            tokio::time::sleep(RETRY_AFTER).await;
        }
    }

    async fn follow_once(
        &self,
        listener: &ChangeListener,
        next_revision: &mut i64,
    ) -> std::result::Result<(), String> {
        let mut client = self.client().await?;
        // Where the store's history stands now. A watch resumes after the last revision seen,
        // unless the store went back (etcd restarted without its data): then it has no such
        // revision yet, and every key it holds now is told again instead.
        let revision = client
            .get(
                self.key_prefix.as_str(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .map_err(|e| self.failed(e))?;
        let mut current = revision.header().map_or(0, |h| h.revision());
        if *next_revision > current + 1 {
            tracing::warn!(
                store = %self.shown,
                expected_at_least = *next_revision - 1,
                current,
                "the metadata store's history went back (etcd restarted without its data?); reading every key again"
            );
            let all = client
                .get(
                    self.key_prefix.as_str(),
                    Some(GetOptions::new().with_prefix()),
                )
                .await
                .map_err(|e| self.failed(e))?;
            current = all.header().map_or(current, |h| h.revision());
            for kv in all.kvs() {
                self.tell(listener, kv, EventType::Put);
            }
            *next_revision = current + 1;
        } else if *next_revision == 0 {
            // The first watch starts where this read ends, so a change made between the two is
            // not lost.
            *next_revision = current + 1;
        }
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(*next_revision);
        let mut stream = client
            .watch(self.key_prefix.as_str(), Some(options))
            .await
            .map_err(|e| self.failed(e))?;
        while let Some(answer) = stream.message().await.map_err(|e| self.failed(e))? {
            if answer.canceled() {
                if answer.compact_revision() > 0 {
                    // History up to there is gone; changes before it were missed, but each
                    // opened segment is checked again at its next refetch.
                    *next_revision = answer.compact_revision();
                }
                return Err(format!(
                    "the metadata store {} cancelled the watch: {}",
                    self.shown,
                    answer.cancel_reason()
                ));
            }
            for event in answer.events() {
                let Some(kv) = event.kv() else { continue };
                *next_revision = (*next_revision).max(kv.mod_revision() + 1);
                self.tell(listener, kv, event.event_type());
            }
        }
        Err(format!("the metadata store {} ended the watch", self.shown))
    }

    /// Tells `listener` of one key put or deleted under the prefix; other keys and values
    /// that are not a descriptor of the segment they are filed under are skipped.
    fn tell(&self, listener: &ChangeListener, kv: &etcd_client::KeyValue, kind: EventType) {
        let Some(name) = kv
            .key_str()
            .ok()
            .and_then(|k| k.strip_prefix(self.key_prefix.as_str()))
        else {
            return;
        };
        match kind {
            EventType::Put => match serde_json::from_slice::<SegmentDescriptor>(kv.value()) {
                Ok(d) if d.published_name() == name => listener(name, Some(d)),
                Ok(d) => {
                    tracing::debug!(key = name, describes = %d.name, "ignored a descriptor published under another segment's name")
                }
                Err(e) => {
                    tracing::debug!(key = name, error = %e, "ignored a value that is not a descriptor")
                }
            },
            EventType::Delete => listener(name, None),
        }
    }
}

impl super::MetadataStore for EtcdMetadata {
    /// Fails with `SegmentUnreachable` when etcd has no such key ("not registered"), does not
    /// answer within the timeout or cannot be reached (the reason names the store), or holds
    /// something that is not this segment's descriptor ("bad descriptor").
    fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        let unreachable = |reason: String| Error::SegmentUnreachable {
            name: name.to_owned(),
            reason,
        };
        let key = self.key(name);
        let value = self
            .run(move |s| async move {
                let mut client = s.client().await?;
                let answer = client.get(key, None).await.map_err(|e| s.failed(e))?;
                Ok(answer.kvs().first().map(|kv| kv.value().to_vec()))
            })
            .map_err(unreachable)?;
        let Some(value) = value else {
            return Err(unreachable(format!(
                "not registered in the metadata store {}",
                self.url()
            )));
        };
        let bad = |what: String| {
            unreachable(format!(
                "bad descriptor under key {:?} in the metadata store {}: {what}",
                self.key(name),
                self.url()
            ))
        };
        if value.len() > wire::MAX_CONTROL_LEN as usize {
            return Err(bad(format!("{} bytes is above the limit", value.len())));
        }
        let descriptor: SegmentDescriptor =
            serde_json::from_slice(&value).map_err(|e| bad(e.to_string()))?;
        // A value left by another engine (or written by hand) must not send requests elsewhere.
        if descriptor.published_name() != name {
            return Err(bad(format!("it describes segment {:?}", descriptor.name)));
        }
        Ok(descriptor)
    }

    /// Puts the descriptor's JSON under `name`'s key, on this engine's lease (granted on the
    /// first publish and kept alive from then on). Fails with an I/O error naming the store
    /// when etcd does not take it within the timeout.
    fn publish(&self, name: &str, descriptor: &SegmentDescriptor) -> Result<()> {
        let key = self.key(name);
        let value = serde_json::to_vec(descriptor).expect("descriptor serializes");
        // Recorded first: if etcd is down now, the keeper publishes it once etcd is back.
        self.shared
            .published
            .lock()
            .expect("published poisoned")
            .insert(key.clone(), value.clone());
        let outcome = self.run(move |s| async move {
            let mut client = s.client().await?;
            s.put_on_lease(&mut client, &key, value).await
        });
        if outcome.is_err() {
            self.shared.unsynced.store(true, Ordering::Release);
        }
        if !self.shared.keeper_started.swap(true, Ordering::AcqRel) {
            if let Some(rt) = &self.runtime {
                rt.spawn(self.shared.clone().keep_lease(outcome.is_ok()));
            }
        }
        outcome.map_err(|e| {
            Error::io(
                format!(
                    "publishing segment {name} to the metadata store {}",
                    self.url()
                ),
                std::io::Error::other(e),
            )
        })
    }

    /// Deletes `name`'s key; a key already gone counts as withdrawn. Fails with an I/O error
    /// naming the store when etcd does not answer within the timeout.
    fn unpublish(&self, name: &str) -> Result<()> {
        let key = self.key(name);
        self.shared
            .published
            .lock()
            .expect("published poisoned")
            .remove(&key);
        self.run(move |s| async move {
            let mut client = s.client().await?;
            client.delete(key, None).await.map_err(|e| s.failed(e))?;
            Ok(())
        })
        .map_err(|e| {
            Error::io(
                format!(
                    "withdrawing segment {name} from the metadata store {}",
                    self.url()
                ),
                std::io::Error::other(e),
            )
        })
    }

    /// Starts the watch of the key prefix (once); `listener` hears of every descriptor
    /// published or withdrawn from then on, on the store's own thread.
    fn watch(&self, listener: ChangeListener) {
        if self.shared.watch_started.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(rt) = &self.runtime {
            rt.spawn(self.shared.clone().follow(listener));
        }
    }

    fn health(&self) -> StoreHealth {
        self.shared.health.snapshot()
    }
}

impl Drop for EtcdMetadata {
    fn drop(&mut self) {
        // Revoking the lease withdraws whatever is still published at once, instead of at the
        // end of its time to live. Best effort, bounded by the timeout.
        let published = !self
            .shared
            .published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        if published {
            let _ = self.run(|s| async move {
                let lease = *s.lease.lock().await;
                if lease != 0 {
                    let mut client = s.client().await?;
                    client.lease_revoke(lease).await.map_err(|e| s.failed(e))?;
                }
                Ok(())
            });
        }
        // Dropping a runtime from inside another one panics; shutting it down in the
        // background does not, wherever the engine is dropped.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_bad_settings() {
        let t = Duration::from_millis(10);
        let m = EtcdMetadata::new("h:1", "multirail/", Some("c"), t, 5).unwrap();
        assert_eq!(m.key("n"), "multirail/c/n");
        assert_eq!(m.url(), "etcd://h:1");
        let e = EtcdMetadata::new("h:1", "p/", None, t, 0).err().unwrap();
        assert!(e.to_string().contains("metadata.lease_ttl_s"), "{e}");
        let e = EtcdMetadata::new("http://h:1", "p/", None, t, 5)
            .err()
            .unwrap();
        assert!(e.to_string().contains("metadata.servers"), "{e}");
    }
}
