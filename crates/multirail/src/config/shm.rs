//! The `transports.shm` section.

use super::*;

/// Shared-memory transport settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShmConfig {
    /// Use shared memory for same-host peers under `transport: "auto"`.
    pub enable: bool,
    /// Use process_vm_readv/writev for registered memory of same-host peers.
    pub process_vm: bool,
    /// Requests of at most this many bytes are copied by the thread that submits them instead
    /// of a copy worker (0: never). A hand-off to a worker costs a few µs of locking and
    /// wake-ups on both sides, more than copying 16 KiB; small writes (notifications,
    /// multicast rings and counters, KV-cache block headers) gain that back. When one submit
    /// holds 1 MiB or more of such requests (a thousand scattered KV-cache blocks), they go to
    /// the workers in groups of about 256 KiB instead, so every core copies.
    pub inline_bytes: u64,
    /// Copies of at least 4 KiB write their destination with non-temporal (streaming) stores,
    /// which skip reading each destination line before overwriting it and leave the caches to
    /// the application: a third faster for large or scattered copies into memory that is not
    /// cached, at a cost to a consumer that reads the bytes at once (they come from memory).
    /// x86-64 only; elsewhere ordinary copies.
    pub nontemporal_copies: bool,
    /// Receive path of two-sided messages over shared memory.
    pub receive: ReceiveConfig,
    /// Group multicast defaults for groups whose writes go over shared memory.
    pub multicast: MulticastConfig,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            enable: true,
            process_vm: true,
            inline_bytes: 16 << 10,
            nontemporal_copies: true,
            receive: ReceiveConfig::default(),
            multicast: MulticastConfig::default(),
        }
    }
}
