//! The key/value map, with its optional on-disk copy.

use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::io;
use std::sync::{Arc, PoisonError, RwLock};

use axum::body::Bytes;
use tokio::sync::Mutex;

use crate::persist::Persistence;

/// Writers of one key are serialized by one of these locks, held across the
/// disk write and the map update, so disk and memory always end in the same
/// state; writers of different keys mostly take different locks and fsync
/// in parallel.
const STRIPES: usize = 64;

/// Keys containing this are registrations of an engine's RPC endpoint in
/// Mooncake; see [`Store::put`].
const RPC_META_MARK: &str = "rpc_meta";

#[derive(Debug, Default)]
struct Map {
    entries: BTreeMap<String, Bytes>,
    value_bytes: u64,
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
}

impl Store {
    /// A store holding `entries`, writing through to `persistence` if given.
    pub(crate) fn new(entries: BTreeMap<String, Bytes>, persistence: Option<Persistence>) -> Store {
        let value_bytes = entries.values().map(|v| v.len() as u64).sum();
        Store {
            map: RwLock::new(Map {
                entries,
                value_bytes,
            }),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            persistence: persistence.map(Arc::new),
        }
    }

    /// The value stored under `key`, if any.
    pub(crate) fn get(&self, key: &str) -> Option<Bytes> {
        self.read(|map| map.entries.get(key).cloned())
    }

    /// Every key starting with `prefix`, in sorted order.
    pub(crate) fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.read(|map| {
            map.entries
                .range::<str, _>((
                    std::ops::Bound::Included(prefix),
                    std::ops::Bound::Unbounded,
                ))
                .map(|(k, _)| k)
                .take_while(|k| k.starts_with(prefix))
                .cloned()
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
    pub(crate) async fn put(&self, key: String, value: Bytes) -> io::Result<PutOutcome> {
        let _writer = self.stripe(&key).lock().await;
        if key.contains(RPC_META_MARK) {
            if let Some(old) = self.get(&key) {
                return Ok(if old == value {
                    PutOutcome::Unchanged
                } else {
                    PutOutcome::RpcMetaConflict
                });
            }
        }
        if let Some(persistence) = &self.persistence {
            let persistence = Arc::clone(persistence);
            let (k, v) = (key.clone(), value.clone());
            run_blocking(move || persistence.write(&k, &v)).await?;
        }
        self.write(|map| {
            let new_len = value.len() as u64;
            if let Some(old) = map.entries.insert(key, value) {
                map.value_bytes -= old.len() as u64;
            }
            map.value_bytes += new_len;
        });
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
                map.value_bytes -= old.len() as u64;
            }
        });
        Ok(true)
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
