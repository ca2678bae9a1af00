//! Segment descriptors: what an engine publishes about itself so peers can reach its memory,
//! and [`Location`], where a buffer's memory lives. Only `error` lies below it (a location that
//! does not parse is an [`Error`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where memory lives: a NUMA node (`cpu:N`) or anywhere (`*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Location {
    /// No placement preference.
    #[default]
    Any,
    /// Host memory on NUMA node N.
    Cpu(u32),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Any => f.write_str("*"),
            Location::Cpu(n) => write!(f, "cpu:{n}"),
        }
    }
}

impl FromStr for Location {
    type Err = Error;

    /// Parses `*` or `cpu:N`; anything else is an `InvalidArgument` naming `location`.
    fn from_str(s: &str) -> Result<Self> {
        if s == "*" {
            return Ok(Location::Any);
        }
        s.strip_prefix("cpu:")
            .and_then(|n| n.parse::<u32>().ok())
            .map(Location::Cpu)
            .ok_or_else(|| {
                Error::invalid("location", format!("expected `*` or `cpu:N`, got {s:?}"))
            })
    }
}

impl Serialize for Location {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Location {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Version of the descriptor format and of the wire protocol it advertises.
/// 2: connections open with the membership handshake.
/// 3: data connections carry probes (`RequestOp::Probe`).
pub const PROTOCOL_VERSION: u16 = 3;

/// Handle a same-host peer uses to map an engine-allocated buffer (`/proc/PID/fd/FD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmHandle {
    /// Process that owns the memfd.
    pub pid: u32,
    /// The memfd's descriptor number in that process.
    pub fd: i32,
}

/// Where a buffer's entry in its owner's access table lies: the entry of the owner's access table that same-host peers
/// check before every copy into the buffer, so that unregistering it stops them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessDescriptor {
    /// The owner's access table, a memfd peers map as they map its buffers.
    pub table: ShmHandle,
    /// The table's identity, which its first entry holds: a descriptor number names a
    /// different table once its engine is gone.
    pub table_id: u64,
    /// The buffer's entry in it.
    pub entry: u32,
}

/// One buffer a segment serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BufferDescriptor {
    /// Start address in the owner's address space (what requests use as `target_offset`).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Access key every slice must present.
    pub key: u64,
    /// Memory placement.
    pub location: Location,
    /// Present for engine-allocated buffers, which same-host peers can map.
    pub shm: Option<ShmHandle>,
    /// The buffer's remote key on each RDMA rail of the segment, in the order of
    /// [`SegmentDescriptor::rdma`]; empty when the engine has no RDMA rail.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rkeys: Vec<u32>,
    /// The buffer's entry in the owner's access table, which same-host peers hold for every
    /// copy into it so that an unregistration stops them; absent from engines of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<AccessDescriptor>,
}

impl BufferDescriptor {
    /// True when `addr..addr+len` lies inside this buffer.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && len <= self.len && addr - self.addr <= self.len - len
    }
}

/// One rail (network interface) of a segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RailDescriptor {
    /// Interface name, e.g. `eth0`.
    pub name: String,
    /// IP address bound on that interface.
    pub address: String,
    /// NUMA node of the device, -1 when unknown.
    pub numa_node: i32,
    /// Link speed used for scheduling, Gbps.
    pub bandwidth_gbps: f64,
}

/// One RDMA rail (a device port) of a segment: what a peer needs to connect queue pairs to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RdmaRailDescriptor {
    /// Device name, e.g. `mlx5_0`.
    pub device: String,
    /// Port number on the device (from 1).
    pub port: u8,
    /// The GID queue pairs address this port by (RoCE v2 where the port has one), 16 bytes.
    pub gid: [u8; 16],
    /// Index of that GID in the port's table.
    pub gid_index: u8,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's active MTU in bytes: a path takes the smaller of both ends'.
    pub mtu: u32,
    /// NUMA node of the device, -1 when unknown.
    pub numa_node: i32,
    /// Link speed used for scheduling, Gbps.
    pub bandwidth_gbps: f64,
}

impl RdmaRailDescriptor {
    /// The rail's name as statistics show it: `device/port`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.device, self.port)
    }

    /// The IPv4 address an IPv4-mapped GID (RoCE v2 over IPv4) carries.
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        let g = &self.gid;
        (g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff)
            .then(|| std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15]))
    }
}

/// Everything a peer needs to move bytes to and from a segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// `host:port` of the engine's control port.
    pub name: String,
    /// Identifies the host (and PID namespace), so peers know when shared memory can be used.
    pub host_id: String,
    /// Process id of the engine, meaningful to peers with the same `host_id`.
    pub pid: u32,
    /// Wire protocol version the engine speaks.
    pub protocol_version: u16,
    /// The engine's rails.
    pub rails: Vec<RailDescriptor>,
    /// The engine's RDMA rails; empty without RDMA.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rdma: Vec<RdmaRailDescriptor>,
    /// Buffers the engine serves, in address order.
    pub buffers: Vec<BufferDescriptor>,
    /// The name the engine is published under in a metadata store when that is not `name`
    /// (`metadata.segment_name`): peers open it by this name and connect to `name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment_name: Option<String>,
    /// Multicast groups the engine has joined: where each group's table lies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupDescriptor>,
    /// The engine requires a membership token (never the token itself): a peer that found this
    /// descriptor in a metadata store proves membership over the control port before reaching
    /// the engine's memory through shared memory, which opens no connection of its own.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub members_only: bool,
}

/// A multicast group as one member publishes it: its table (engine memory the other members
/// write into) and the settings every member must agree on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupDescriptor {
    /// The group's name.
    pub name: String,
    /// Address of the member's table, inside one of its buffers.
    pub table_addr: u64,
    /// Length of the table in bytes.
    pub table_len: u64,
    /// The group's settings, key to canonical value; joining compares them key by key.
    pub settings: std::collections::BTreeMap<String, String>,
}

impl SegmentDescriptor {
    /// The name peers open this segment by: `segment_name` when set, else `name`.
    pub fn published_name(&self) -> &str {
        self.segment_name.as_deref().unwrap_or(&self.name)
    }

    /// The buffer holding all of `addr..addr+len`, if any.
    pub fn find_buffer(&self, addr: u64, len: u64) -> Option<&BufferDescriptor> {
        let idx = self.buffers.partition_point(|b| b.addr <= addr);
        let buffer = self.buffers.get(idx.checked_sub(1)?)?;
        buffer.contains(addr, len).then_some(buffer)
    }
}

/// Identity of this host as peers compare it: the kernel's boot id plus the PID namespace, since
/// shared-memory handles (`/proc/PID/fd/FD`) only resolve inside the same one.
pub fn local_host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown-boot".to_owned());
    let pidns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown-pidns".to_owned());
    format!("{boot}/{pidns}")
}

/// Handle of an opened segment, returned by `Engine::open_segment`: the engine's id of the
/// peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentId(pub u64);

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(addr: u64, len: u64) -> BufferDescriptor {
        BufferDescriptor {
            addr,
            len,
            key: 1,
            location: Location::Any,
            shm: None,
            rkeys: Vec::new(),
            access: None,
        }
    }

    #[test]
    fn find_buffer_checks_bounds() {
        let d = SegmentDescriptor {
            name: "h:1".into(),
            host_id: local_host_id(),
            pid: 1,
            protocol_version: PROTOCOL_VERSION,
            rails: vec![],
            rdma: vec![],
            buffers: vec![buf(1000, 100), buf(5000, 10)],
            segment_name: None,
            members_only: false,
            groups: Vec::new(),
        };
        assert_eq!(d.find_buffer(1000, 100).unwrap().addr, 1000);
        assert_eq!(d.find_buffer(1050, 50).unwrap().addr, 1000);
        assert!(d.find_buffer(1050, 51).is_none());
        assert!(d.find_buffer(999, 1).is_none());
        assert_eq!(d.find_buffer(5009, 1).unwrap().addr, 5000);
        assert!(d.find_buffer(5010, 1).is_none());
        assert!(d.find_buffer(u64::MAX, 2).is_none());
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(serde_json::from_str::<SegmentDescriptor>(&json).unwrap(), d);
    }
}
