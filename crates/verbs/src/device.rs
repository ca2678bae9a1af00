//! What the machine has: devices, their ports, link rates and GID tables,
//! decoded into plain data for topology discovery (never on a data path).

use crate::ffi;
use std::ffi::c_int;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// One RDMA device as `ibv_get_device_list` and its queries describe it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    /// Kernel device name, e.g. `mlx5_0` or `rxe_a`.
    pub name: String,
    /// Node GUID in host order (print with [`DeviceInfo::guid_string`]).
    pub node_guid: u64,
    /// NUMA node of the device's PCI function; `None` when the kernel does
    /// not say (virtual devices such as rxe, or `-1`).
    pub numa_node: Option<u32>,
    /// Device limits from `ibv_query_device`.
    pub attr: DeviceAttr,
    /// Ports `1..=phys_port_cnt`.
    pub ports: Vec<PortInfo>,
}

impl DeviceInfo {
    /// The node GUID as verbs tools print it: `0002:c903:0042:4b30`.
    pub fn guid_string(&self) -> String {
        let g = self.node_guid;
        format!(
            "{:04x}:{:04x}:{:04x}:{:04x}",
            (g >> 48) & 0xffff,
            (g >> 32) & 0xffff,
            (g >> 16) & 0xffff,
            g & 0xffff
        )
    }
}

/// Device limits (`struct ibv_device_attr`), the ones a transport sizes
/// its queues by.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID, host order.
    pub node_guid: u64,
    /// Largest memory region, bytes.
    pub max_mr_size: u64,
    /// IEEE vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Queue pairs the device supports.
    pub max_qp: u32,
    /// Work requests per queue.
    pub max_qp_wr: u32,
    /// Scatter/gather entries per work request.
    pub max_sge: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Entries per completion queue.
    pub max_cqe: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Protection domains.
    pub max_pd: u32,
    /// RDMA READs a QP can have incoming at once (responder side).
    pub max_qp_rd_atom: u32,
    /// RDMA READs a QP can have outstanding at once (initiator side).
    pub max_qp_init_rd_atom: u32,
    /// Shared receive queues.
    pub max_srq: u32,
    /// Work requests per shared receive queue.
    pub max_srq_wr: u32,
    /// Scatter/gather entries per shared receive request.
    pub max_srq_sge: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

impl DeviceAttr {
    pub(crate) fn from_raw(a: &ffi::ibv_device_attr) -> Self {
        let fw: Vec<u8> = a
            .fw_ver
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        let n = |v: c_int| u32::try_from(v).unwrap_or(0);
        Self {
            fw_ver: String::from_utf8_lossy(&fw).into_owned(),
            node_guid: u64::from_be(a.node_guid),
            max_mr_size: a.max_mr_size,
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            max_qp: n(a.max_qp),
            max_qp_wr: n(a.max_qp_wr),
            max_sge: n(a.max_sge),
            max_cq: n(a.max_cq),
            max_cqe: n(a.max_cqe),
            max_mr: n(a.max_mr),
            max_pd: n(a.max_pd),
            max_qp_rd_atom: n(a.max_qp_rd_atom),
            max_qp_init_rd_atom: n(a.max_qp_init_rd_atom),
            max_srq: n(a.max_srq),
            max_srq_wr: n(a.max_srq_wr),
            max_srq_sge: n(a.max_srq_sge),
            phys_port_cnt: a.phys_port_cnt,
        }
    }
}

/// Logical port state (`enum ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// No state change.
    Nop,
    /// Link down.
    Down,
    /// Link up, not yet configured by a subnet manager.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready for traffic.
    Active,
    /// Active, deferring to recover from an error.
    ActiveDefer,
    /// A value this crate does not know.
    Unknown(u32),
}

impl PortState {
    /// Decodes `ibv_port_attr.state`.
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => Self::Nop,
            1 => Self::Down,
            2 => Self::Init,
            3 => Self::Armed,
            4 => Self::Active,
            5 => Self::ActiveDefer,
            other => Self::Unknown(other),
        }
    }
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID, GIDs optional.
    InfiniBand,
    /// Ethernet (RoCE, iWARP): addressed by GID only.
    Ethernet,
    /// The driver did not say; old drivers mean InfiniBand by this.
    Unspecified,
}

impl LinkLayer {
    /// Decodes `ibv_port_attr.link_layer`.
    pub fn from_code(code: u8) -> Self {
        match code {
            ffi::IBV_LINK_LAYER_INFINIBAND => Self::InfiniBand,
            ffi::IBV_LINK_LAYER_ETHERNET => Self::Ethernet,
            _ => Self::Unspecified,
        }
    }
}

/// A 16-byte global identifier, as carried in GRH headers and RoCE packets.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// True for the all-zero GID (an empty table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`), the form
    /// RoCE v2 uses for IPv4 interfaces.
    pub fn ipv4_mapped(&self) -> Option<Ipv4Addr> {
        let b = &self.0;
        if b[..10] == [0; 10] && b[10] == 0xff && b[11] == 0xff {
            Some(Ipv4Addr::new(b[12], b[13], b[14], b[15]))
        } else {
            None
        }
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ipv4_mapped() {
            Some(v4) => write!(f, "::ffff:{v4}"),
            None => write!(f, "{}", Ipv6Addr::from(self.0)),
        }
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// What a GID table entry addresses, from sysfs `gid_attrs/types`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand GID ("IB/RoCE v1" on an InfiniBand port).
    Ib,
    /// RoCE v1: raw Ethernet frames, not routable ("IB/RoCE v1" on Ethernet).
    RoceV1,
    /// RoCE v2: UDP/IP, routable ("RoCE v2").
    RoceV2,
    /// Any other text, or unreadable on an Ethernet port.
    Unknown(String),
}

impl GidType {
    /// Decodes the sysfs text: its meaning for "IB/RoCE v1" depends on the
    /// port's link layer.
    pub fn from_sysfs(text: &str, link_layer: LinkLayer) -> Self {
        match text.trim() {
            "RoCE v2" => Self::RoceV2,
            "IB/RoCE v1" if link_layer == LinkLayer::Ethernet => Self::RoceV1,
            "IB/RoCE v1" => Self::Ib,
            other => Self::Unknown(other.to_owned()),
        }
    }
}

/// One non-empty slot of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table: the `sgid_index` to pass when connecting.
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
    /// The network interface it belongs to (RoCE), from `gid_attrs/ndevs`.
    pub netdev: Option<String>,
}

/// One port of a device, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct PortInfo {
    /// Port number (1-based).
    pub port: u8,
    /// Logical state.
    pub state: PortState,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Active MTU in bytes (0 if the code is unknown).
    pub active_mtu: u32,
    /// Largest MTU the port supports, bytes (0 if unknown).
    pub max_mtu: u32,
    /// Raw `active_speed` code (see [`ib_speed_gbps`]).
    pub active_speed: u8,
    /// Raw `active_width` code (see [`ib_width_lanes`]).
    pub active_width: u8,
    /// Local identifier (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// Largest message the port carries, bytes.
    pub max_msg_sz: u32,
    /// Size of the GID table (slots, including empty ones).
    pub gid_tbl_len: u32,
    /// The non-empty GID table entries.
    pub gids: Vec<GidEntry>,
}

impl PortInfo {
    /// True when the port can carry traffic.
    pub fn is_active(&self) -> bool {
        self.state == PortState::Active
    }

    /// Per-lane signalling rate in Gbit/s, if the speed code is known.
    pub fn lane_gbps(&self) -> Option<f64> {
        ib_speed_gbps(u32::from(self.active_speed))
    }

    /// Number of lanes, if the width code is known.
    pub fn lanes(&self) -> Option<u8> {
        ib_width_lanes(self.active_width)
    }

    /// Link rate in Gbit/s (lanes × lane rate), if both codes are known.
    pub fn rate_gbps(&self) -> Option<f64> {
        Some(self.lane_gbps()? * f64::from(self.lanes()?))
    }

    /// The GID to connect with: a RoCE v2 GID holding an IPv4-mapped address
    /// first (what peers resolve most reliably), then any RoCE v2 GID, then
    /// index 0 on an InfiniBand port. `None` when the port has none of
    /// these (e.g. an Ethernet port with RoCE v1 GIDs only).
    pub fn roce_v2_gid(&self) -> Option<&GidEntry> {
        let v2 = || self.gids.iter().filter(|e| e.gid_type == GidType::RoceV2);
        v2().find(|e| e.gid.ipv4_mapped().is_some())
            .or_else(|| v2().next())
            .or_else(|| match self.link_layer {
                LinkLayer::InfiniBand | LinkLayer::Unspecified => {
                    self.gids.iter().find(|e| e.index == 0)
                }
                LinkLayer::Ethernet => None,
            })
    }
}

/// Per-lane rate in Gbit/s of an InfiniBand speed code (`active_speed`, or
/// `active_speed_ex` in newer rdma-core): SDR 2.5, DDR 5, QDR 10, FDR10
/// 10.3125, FDR 14.0625, EDR 25.78125, HDR 50, NDR 100, XDR 200. RoCE
/// drivers (rxe included) report the IB code nearest their Ethernet speed.
pub fn ib_speed_gbps(code: u32) -> Option<f64> {
    Some(match code {
        1 => 2.5,
        2 => 5.0,
        4 => 10.0,
        8 => 10.3125,
        16 => 14.0625,
        32 => 25.78125,
        64 => 50.0,
        128 => 100.0,
        256 => 200.0,
        _ => return None,
    })
}

/// Lane count of an InfiniBand width code (`active_width`): 1 → 1x, 2 → 4x,
/// 4 → 8x, 8 → 12x, 16 → 2x.
pub fn ib_width_lanes(code: u8) -> Option<u8> {
    Some(match code {
        1 => 1,
        2 => 4,
        4 => 8,
        8 => 12,
        16 => 2,
        _ => return None,
    })
}

/// Bytes of an `enum ibv_mtu` code (1 → 256 ... 5 → 4096).
pub fn mtu_bytes(code: u32) -> Option<u32> {
    match code {
        1..=5 => Some(128 << code),
        _ => None,
    }
}

/// The `enum ibv_mtu` code for a byte count, which must be one of 256, 512,
/// 1024, 2048 or 4096.
pub fn mtu_code(bytes: u32) -> Option<u32> {
    (1..=5).find(|&c| 128 << c == bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u32, gid: [u8; 16], gid_type: GidType) -> GidEntry {
        GidEntry {
            index,
            gid: Gid(gid),
            gid_type,
            netdev: Some("eth0".into()),
        }
    }

    fn port(link_layer: LinkLayer, gids: Vec<GidEntry>) -> PortInfo {
        PortInfo {
            port: 1,
            state: PortState::Active,
            link_layer,
            active_mtu: 1024,
            max_mtu: 4096,
            active_speed: 1,
            active_width: 1,
            lid: 0,
            max_msg_sz: 1 << 31,
            gid_tbl_len: 16,
            gids,
        }
    }

    const LINK_LOCAL: [u8; 16] = [
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x50, 0x54, 0, 0xff, 0xfe, 0x12, 0x34, 0x56,
    ];
    const V4_MAPPED: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];

    #[test]
    fn speed_codes_decode_per_lane() {
        let expect = [
            (1, 2.5),
            (2, 5.0),
            (4, 10.0),
            (8, 10.3125),
            (16, 14.0625),
            (32, 25.78125),
            (64, 50.0),
            (128, 100.0),
            (256, 200.0),
        ];
        for (code, gbps) in expect {
            assert_eq!(ib_speed_gbps(code), Some(gbps), "code {code}");
        }
        assert_eq!(ib_speed_gbps(0), None);
        assert_eq!(ib_speed_gbps(3), None);
    }

    #[test]
    fn width_codes_decode_to_lanes() {
        let expect = [(1, 1), (2, 4), (4, 8), (8, 12), (16, 2)];
        for (code, lanes) in expect {
            assert_eq!(ib_width_lanes(code), Some(lanes));
        }
        assert_eq!(ib_width_lanes(0), None);
        assert_eq!(ib_width_lanes(3), None);
    }

    #[test]
    fn rate_is_lanes_times_lane_rate() {
        let mut p = port(LinkLayer::InfiniBand, vec![]);
        p.active_speed = 64; // HDR
        p.active_width = 2; // 4x
        assert_eq!(p.rate_gbps(), Some(200.0));
        p.active_speed = 128; // NDR
        assert_eq!(p.rate_gbps(), Some(400.0));
        p.active_speed = 1; // SDR
        p.active_width = 1; // 1x, what rxe reports over a 1 GbE-or-unknown link
        assert_eq!(p.rate_gbps(), Some(2.5));
        p.active_width = 0;
        assert_eq!(p.rate_gbps(), None);
    }

    #[test]
    fn mtu_codes_round_trip() {
        for (code, bytes) in [(1, 256), (2, 512), (3, 1024), (4, 2048), (5, 4096)] {
            assert_eq!(mtu_bytes(code), Some(bytes));
            assert_eq!(mtu_code(bytes), Some(code));
        }
        assert_eq!(mtu_bytes(0), None);
        assert_eq!(mtu_bytes(6), None);
        assert_eq!(mtu_code(1500), None);
        assert_eq!(mtu_code(9000), None);
    }

    #[test]
    fn gid_choice_prefers_ipv4_mapped_roce_v2() {
        let p = port(
            LinkLayer::Ethernet,
            vec![
                entry(0, LINK_LOCAL, GidType::RoceV1),
                entry(1, LINK_LOCAL, GidType::RoceV2),
                entry(2, V4_MAPPED, GidType::RoceV1),
                entry(3, V4_MAPPED, GidType::RoceV2),
            ],
        );
        assert_eq!(p.roce_v2_gid().map(|e| e.index), Some(3));
    }

    #[test]
    fn gid_choice_falls_back_to_any_roce_v2() {
        let p = port(
            LinkLayer::Ethernet,
            vec![
                entry(0, LINK_LOCAL, GidType::RoceV1),
                entry(1, LINK_LOCAL, GidType::RoceV2),
            ],
        );
        assert_eq!(p.roce_v2_gid().map(|e| e.index), Some(1));
    }

    #[test]
    fn gid_choice_on_infiniband_is_index_zero() {
        let p = port(
            LinkLayer::InfiniBand,
            vec![
                entry(0, LINK_LOCAL, GidType::Ib),
                entry(1, V4_MAPPED, GidType::Ib),
            ],
        );
        assert_eq!(p.roce_v2_gid().map(|e| e.index), Some(0));
    }

    #[test]
    fn gid_choice_none_for_roce_v1_only_ethernet() {
        let p = port(
            LinkLayer::Ethernet,
            vec![entry(0, V4_MAPPED, GidType::RoceV1)],
        );
        assert_eq!(p.roce_v2_gid(), None);
        assert_eq!(port(LinkLayer::Ethernet, vec![]).roce_v2_gid(), None);
    }

    #[test]
    fn gid_display() {
        assert_eq!(Gid(V4_MAPPED).to_string(), "::ffff:10.0.0.1");
        assert_eq!(Gid(LINK_LOCAL).to_string(), "fe80::5054:ff:fe12:3456");
        assert!(Gid::default().is_zero());
        assert_eq!(
            Gid(V4_MAPPED).ipv4_mapped(),
            Some(Ipv4Addr::new(10, 0, 0, 1))
        );
        assert_eq!(Gid(LINK_LOCAL).ipv4_mapped(), None);
    }

    #[test]
    fn gid_types_depend_on_link_layer() {
        assert_eq!(
            GidType::from_sysfs("RoCE v2\n", LinkLayer::Ethernet),
            GidType::RoceV2
        );
        assert_eq!(
            GidType::from_sysfs("IB/RoCE v1\n", LinkLayer::Ethernet),
            GidType::RoceV1
        );
        assert_eq!(
            GidType::from_sysfs("IB/RoCE v1", LinkLayer::InfiniBand),
            GidType::Ib
        );
        assert_eq!(
            GidType::from_sysfs("iWARP", LinkLayer::Ethernet),
            GidType::Unknown("iWARP".into())
        );
    }

    #[test]
    fn guid_prints_in_groups() {
        let d = DeviceInfo {
            name: "x".into(),
            node_guid: 0x0002_c903_0042_4b30,
            numa_node: None,
            attr: DeviceAttr::default(),
            ports: vec![],
        };
        assert_eq!(d.guid_string(), "0002:c903:0042:4b30");
    }
}
