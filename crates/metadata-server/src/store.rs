//! The key/value map, with its optional on-disk copy and key expiry.

use std::cmp::Reverse;
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BinaryHeap, HashSet};
use std::hash::{Hash, Hasher};
use std::io;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Mutex, Notify};

use crate::metrics::Metrics;
use crate::persist::Persistence;

/// A stored value; cloning it for a reader shares the bytes.
pub(crate) type Value = Arc<[u8]>;

/// When the file of an expired key could not be removed, the next try
/// comes this much later (the key is already invisible to readers).
const EXPIRY_RETRY: Duration = Duration::from_secs(1);

/// Writers of one key are serialized by one of these locks, held across the
/// disk write and the map update, so disk and memory always end in the same
/// state; writers of different keys mostly take different locks and fsync
/// in parallel.
const STRIPES: usize = 64;

/// Keys containing this are registrations of an engine's RPC endpoint in
/// Mooncake; see [`Store::put`].
const RPC_META_MARK: &str = "rpc_meta";

#[derive(Debug)]
struct Entry {
    value: Value,
    /// When the key expires; `None` without a TTL.
    expires: Option<Instant>,
}

impl Entry {
    fn live(&self, now: Instant) -> bool {
        !matches!(self.expires, Some(at) if at <= now)
    }
}

#[derive(Debug, Default)]
struct Map {
    entries: BTreeMap<String, Entry>,
    value_bytes: u64,
    /// Expiry checks due, earliest first. Each key has at most one (see
    /// `queued`): a key stored again is not queued again, its check finds
    /// the later deadline and requeues it then, so rewriting a key
    /// thousands of times within its TTL does not grow this.
    expiry: BinaryHeap<Reverse<(Instant, String)>>,
    /// The keys that have a check in `expiry`.
    queued: HashSet<String>,
}

impl Map {
    /// Queues an expiry check of `key` at `at` unless it has one; returns
    /// whether it queued one.
    fn schedule(&mut self, key: &str, at: Instant) -> bool {
        if self.queued.contains(key) {
            return false;
        }
        self.queued.insert(key.to_owned());
        self.expiry.push(Reverse((at, key.to_owned())));
        true
    }
}

/// What a PUT did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PutOutcome {
    /// The value was stored (new key or replaced value).
    Updated,
    /// An `rpc_meta` key was published again with the value it already had.
    Unchanged,
    /// An `rpc_meta` key already holds a different value; nothing changed.
    RpcMetaConflict,
}

/// The metadata map. Reads take a short read lock; writes are serialized per
/// key (see [`STRIPES`]) and persisted before they become visible.
#[derive(Debug)]
pub(crate) struct Store {
    map: RwLock<Map>,
    stripes: Vec<Mutex<()>>,
    persistence: Option<Arc<Persistence>>,
    ttl: Option<Duration>,
    /// Wakes the expiry task when a check is queued while it has none.
    queued: Notify,
    metrics: Arc<Metrics>,
}

impl Store {
    /// A store holding `entries`, writing through to `persistence` if given;
    /// with a `ttl`, every key expires `ttl` after its last PUT, and the
    /// loaded ones `ttl` from now.
    pub(crate) fn new(
        entries: BTreeMap<String, Value>,
        persistence: Option<Persistence>,
        ttl: Option<Duration>,
        metrics: Arc<Metrics>,
    ) -> Store {
        let mut map = Map::default();
        let expires = ttl.map(|ttl| Instant::now() + ttl);
        for (key, value) in entries {
            map.value_bytes += value.len() as u64;
            if let Some(at) = expires {
                map.schedule(&key, at);
            }
            map.entries.insert(key, Entry { value, expires });
        }
        Store {
            map: RwLock::new(map),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            persistence: persistence.map(Arc::new),
            ttl,
            queued: Notify::new(),
            metrics,
        }
    }

    /// The value stored under `key`, if any. A key past its expiry is gone
    /// here at once, whenever the expiry task gets to removing it.
    pub(crate) fn get(&self, key: &str) -> Option<Value> {
        let now = Instant::now();
        self.read(|map| {
            map.entries
                .get(key)
                .filter(|entry| entry.live(now))
                .map(|entry| Arc::clone(&entry.value))
        })
    }

    /// Every key starting with `prefix`, in sorted order.
    pub(crate) fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        let now = Instant::now();
        self.read(|map| {
            map.entries
                .range::<str, _>((
                    std::ops::Bound::Included(prefix),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(k, _)| k.starts_with(prefix))
                .filter(|(_, entry)| entry.live(now))
                .map(|(k, _)| k.clone())
                .collect()
        })
    }

    /// Number of keys stored.
    pub(crate) fn len(&self) -> usize {
        self.read(|map| map.entries.len())
    }

    /// Sum of the stored values' sizes, in bytes.
    pub(crate) fn value_bytes(&self) -> u64 {
        self.read(|map| map.value_bytes)
    }

    /// Stores `value` under `key`, on disk first when persistent.
    ///
    /// Keys containing `rpc_meta` follow Mooncake's servers: once stored they
    /// can only be republished with the same value (so two engines cannot
    /// claim one RPC endpoint) until they are deleted.
    ///
    /// Returns the I/O error if the value could not be persisted; the old
    /// value then stays in place, on disk and in memory.
    ///
    /// With a TTL, an `Updated` or `Unchanged` PUT restarts the key's time.
    pub(crate) async fn put(&self, key: String, value: Value) -> io::Result<PutOutcome> {
        let _writer = self.stripe(&key).lock().await;
        if key.contains(RPC_META_MARK) {
            if let Some(old) = self.get(&key) {
                if old != value {
                    return Ok(PutOutcome::RpcMetaConflict);
                }
                // The owner republishing its endpoint is what keeps it.
                let woke = self.write(|map| {
                    let expires = self.ttl.map(|ttl| Instant::now() + ttl);
                    let queued = expires.is_some_and(|at| map.schedule(&key, at));
                    if let Some(entry) = map.entries.get_mut(&key) {
                        entry.expires = expires;
                    }
                    queued
                });
                if woke {
                    self.queued.notify_one();
                }
                return Ok(PutOutcome::Unchanged);
            }
        }
        if let Some(persistence) = &self.persistence {
            let persistence = Arc::clone(persistence);
            let (k, v) = (key.clone(), Arc::clone(&value));
            run_blocking(move || persistence.write(&k, &v)).await?;
        }
        let (woke, replaced_expired) = self.write(|map| {
            // The time starts when the value is in place, not when the
            // request arrived: a slow disk must not shorten it.
            let now = Instant::now();
            let expires = self.ttl.map(|ttl| now + ttl);
            let queued = expires.is_some_and(|at| map.schedule(&key, at));
            let new_len = value.len() as u64;
            let mut replaced_expired = false;
            if let Some(old) = map.entries.insert(key, Entry { value, expires }) {
                map.value_bytes -= old.value.len() as u64;
                replaced_expired = !old.live(now);
            }
            map.value_bytes += new_len;
            (queued, replaced_expired)
        });
        if woke {
            self.queued.notify_one();
        }
        // A key stored again after its deadline but before the expiry task
        // removed it did expire (readers got 404 for it); the task will find
        // the new deadline and not count it, so it is counted here.
        if replaced_expired {
            self.metrics.key_expired();
        }
        Ok(PutOutcome::Updated)
    }

    /// Removes `key`, from disk first when persistent. Returns whether it was
    /// present, or the I/O error if its file could not be removed (the key
    /// then stays).
    pub(crate) async fn delete(&self, key: String) -> io::Result<bool> {
        let _writer = self.stripe(&key).lock().await;
        if self.get(&key).is_none() {
            return Ok(false);
        }
        if let Some(persistence) = &self.persistence {
            let persistence = Arc::clone(persistence);
            let k = key.clone();
            run_blocking(move || persistence.remove(&k)).await?;
        }
        self.write(|map| {
            if let Some(old) = map.entries.remove(&key) {
                map.value_bytes -= old.value.len() as u64;
            }
        });
        Ok(true)
    }

    /// Drops expired keys as they fall due, until `stop`: readers already
    /// stopped seeing them at their deadline; this removes their files (so a
    /// restart does not bring them back), frees their memory and counts
    /// them. Does nothing without a TTL.
    pub(crate) async fn expire_keys(&self, mut stop: watch::Receiver<bool>) {
        if self.ttl.is_none() {
            return;
        }
        loop {
            self.expire_due(Instant::now()).await;
            let next = self.read(|map| map.expiry.peek().map(|Reverse((at, _))| *at));
            let wait = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => self.queued.notified().await,
                }
            };
            tokio::select! {
                _ = wait => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
        }
    }

    /// Removes every key whose deadline is at or before `now`.
    async fn expire_due(&self, now: Instant) {
        let due = self.write(|map| {
            let mut due = Vec::new();
            while map.expiry.peek().is_some_and(|Reverse((at, _))| *at <= now) {
                let Some(Reverse((_, key))) = map.expiry.pop() else {
                    break;
                };
                map.queued.remove(&key);
                match map.entries.get(&key).and_then(|entry| entry.expires) {
                    Some(at) if at <= now => due.push(key),
                    // Stored again since it was queued: check at the new
                    // deadline.
                    Some(at) => {
                        map.schedule(&key, at);
                    }
                    // Deleted meanwhile.
                    None => {}
                }
            }
            due
        });
        for key in due {
            self.expire(key).await;
        }
    }

    async fn expire(&self, key: String) {
        let _writer = self.stripe(&key).lock().await;
        let now = Instant::now();
        // A PUT between the check and the lock kept the key: it needs a
        // check at its new deadline (scheduling one already queued is a
        // no-op).
        let expired =
            self.write(
                |map| match map.entries.get(&key).and_then(|entry| entry.expires) {
                    Some(at) if at <= now => true,
                    Some(at) => {
                        map.schedule(&key, at);
                        false
                    }
                    None => false,
                },
            );
        if !expired {
            return;
        }
        if let Some(persistence) = &self.persistence {
            let persistence = Arc::clone(persistence);
            let k = key.clone();
            if let Err(err) = run_blocking(move || persistence.remove(&k)).await {
                tracing::warn!(%key, %err, "cannot remove the file of an expired key; retrying");
                self.write(|map| map.schedule(&key, now + EXPIRY_RETRY));
                return;
            }
        }
        self.write(|map| {
            if let Some(old) = map.entries.remove(&key) {
                map.value_bytes -= old.value.len() as u64;
            }
        });
        self.metrics.key_expired();
        tracing::info!(%key, "key expired: not stored again within the key TTL");
    }

    fn stripe(&self, key: &str) -> &Mutex<()> {
        let mut hasher = DefaultHasher::new();
        key.hash(&mut hasher);
        &self.stripes[(hasher.finish() as usize) % self.stripes.len()]
    }

    // Nothing panics while holding the lock, but if something ever did, the
    // map itself is still consistent (every update is a single insert or
    // remove), so serving on is better than failing every request.
    fn read<T>(&self, f: impl FnOnce(&Map) -> T) -> T {
        f(&self.map.read().unwrap_or_else(PoisonError::into_inner))
    }

    fn write<T>(&self, f: impl FnOnce(&mut Map) -> T) -> T {
        f(&mut self.map.write().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Runs file I/O off the async workers (fsync can take milliseconds).
async fn run_blocking(f: impl FnOnce() -> io::Result<()> + Send + 'static) -> io::Result<()> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|join| Err(io::Error::other(format!("persistence task failed: {join}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expired_total(metrics: &Metrics, store: &Store) -> String {
        let text = metrics
            .render(store.len(), store.value_bytes())
            .expect("render metrics");
        text.lines()
            .find_map(|line| line.strip_prefix("multirail_metadata_keys_expired_total "))
            .expect("expired series")
            .to_owned()
    }

    #[tokio::test]
    async fn a_key_stored_again_after_its_deadline_counts_as_expired_once() {
        let metrics = Arc::new(Metrics::new());
        let ttl = Duration::from_millis(20);
        let store = Store::new(BTreeMap::new(), None, Some(ttl), Arc::clone(&metrics));
        let value: Value = Arc::from(&b"v"[..]);
        assert_eq!(
            store.put("k".into(), Arc::clone(&value)).await.unwrap(),
            PutOutcome::Updated
        );
        tokio::time::sleep(ttl * 2).await;
        assert_eq!(store.get("k"), None, "gone at its deadline");
        // Stored again before the expiry task ran: that put counts it.
        store.put("k".into(), Arc::clone(&value)).await.unwrap();
        assert_eq!(expired_total(&metrics, &store), "1");
        // The task, running late, finds the new deadline and counts nothing.
        store.expire_due(Instant::now()).await;
        assert_eq!(expired_total(&metrics, &store), "1");
        assert_eq!(store.get("k"), Some(Arc::clone(&value)));
        // Not stored again: the task counts it when it falls due.
        tokio::time::sleep(ttl * 2).await;
        store.expire_due(Instant::now()).await;
        assert_eq!(expired_total(&metrics, &store), "2");
        assert_eq!(store.len(), 0);
    }
}
