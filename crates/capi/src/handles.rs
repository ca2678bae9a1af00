//! The table of live engines: C holds ids, never pointers, so a freed or never-issued handle
//! is an error code instead of undefined behaviour.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use engine::{Engine, Message, Notification};

use crate::error::{multirail_error_t as Code, Failure};

/// What the C API keeps per engine beside the engine itself.
pub(crate) struct EngineHandle {
    pub(crate) engine: Engine,
    /// Notifications taken from the engine but not yet handed out, because the caller's
    /// buffer was too small for them; the next `multirail_notifications` returns them first.
    pub(crate) notifications: Mutex<Vec<Notification>>,
    /// Messages received but not handed out, because the caller's buffer was too small; the
    /// next `multirail_recv` returns them first.
    pub(crate) held: Mutex<VecDeque<Message>>,
}

/// Locks `m`, taking the data of a poisoned lock: every value behind these locks is whole
/// between statements, so a panic elsewhere leaves nothing half-changed.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

static ENGINES: Mutex<BTreeMap<u64, Arc<EngineHandle>>> = Mutex::new(BTreeMap::new());

/// The next id; ids are never reused within a process, and 0 is never issued.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Keeps `engine` and returns its new handle.
pub(crate) fn insert(engine: Engine) -> u64 {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let handle = Arc::new(EngineHandle {
        engine,
        notifications: Mutex::default(),
        held: Mutex::default(),
    });
    lock(&ENGINES).insert(id, handle);
    id
}

fn unknown(id: u64) -> Failure {
    let why = if id == 0 {
        "0 is never a valid engine handle".to_string()
    } else {
        format!("engine handle {id} is unknown (never issued, or freed)")
    };
    Failure::new(Code::MULTIRAIL_ERR_UNKNOWN_HANDLE, why)
}

/// The engine of handle `id`. The caller's reference keeps it alive for the call even if
/// another thread frees the handle meanwhile.
pub(crate) fn get(id: u64) -> Result<Arc<EngineHandle>, Failure> {
    lock(&ENGINES).get(&id).cloned().ok_or_else(|| unknown(id))
}

/// Removes handle `id` from the table; later lookups fail.
pub(crate) fn remove(id: u64) -> Result<Arc<EngineHandle>, Failure> {
    lock(&ENGINES).remove(&id).ok_or_else(|| unknown(id))
}
