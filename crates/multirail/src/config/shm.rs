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
            receive: ReceiveConfig::default(),
            multicast: MulticastConfig::default(),
        }
    }
}
