//! The `rails` entries: rails given by hand instead of discovered from sysfs.

use super::*;

/// One rail given by hand instead of discovered from sysfs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RailConfig {
    /// Rail name as shown in statistics (e.g. the interface name); must be non-empty and unique.
    pub name: String,
    /// Local IP address the rail's sockets bind to; must parse as an IPv4 or IPv6 address.
    pub address: String,
    /// NUMA node of the NIC; -1 (default) = from sysfs for the interface holding `address`,
    /// else unknown.
    pub numa_node: i32,
    /// Theoretical bandwidth in Gbit/s; None = what the interface holding `address` reports
    /// in sysfs, else `default_bandwidth_gbps`. > 0 if given.
    pub bandwidth_gbps: Option<f64>,
}

impl Default for RailConfig {
    fn default() -> Self {
        RailConfig {
            name: String::new(),
            address: String::new(),
            numa_node: -1,
            bandwidth_gbps: None,
        }
    }
}

impl RailConfig {
    pub(crate) fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        if self.name.is_empty() {
            return Err(ConfigError::new(
                format!("{prefix}.name"),
                "must not be empty",
            ));
        }
        if self.address.parse::<IpAddr>().is_err() {
            return Err(ConfigError::new(
                format!("{prefix}.address"),
                format!("must be an IPv4 or IPv6 address, got {:?}", self.address),
            ));
        }
        if self.numa_node < -1 {
            return Err(ConfigError::new(
                format!("{prefix}.numa_node"),
                format!(
                    "must be -1 (unknown) or a NUMA node number >= 0, got {}",
                    self.numa_node
                ),
            ));
        }
        if let Some(bw) = self.bandwidth_gbps {
            positive(prefix, "bandwidth_gbps", bw)?;
        }
        Ok(())
    }
}
