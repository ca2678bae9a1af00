//! The host's rails (network interfaces) and how near each is to each memory location.
//!
//! Rails come from config or from the interfaces that are up with an IPv4 address (loopback only
//! when nothing else is). An engine listening on one address publishes only the rail holding it.
//! Tiers rank rails for a memory location: tier 0 shares its NUMA node (or its node is unknown),
//! tier 1 sits on the nearest other nodes by `/sys/devices/system/node/node*/distance`, tier 2
//! farther; config `tiers` overrides per location and rail name.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::segment::Location;
use crate::segment::RailDescriptor;

/// One rail of this host.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Rail {
    /// Interface name (or the name config gives it).
    pub name: String,
    /// Address sockets on this rail bind to.
    pub address: IpAddr,
    /// Prefix length of the rail's subnet; 32 when unknown.
    pub prefix_len: u8,
    /// NUMA node of the NIC, -1 when unknown.
    pub numa_node: i32,
    /// Link speed the OS or config reports, Gbps.
    pub reported_gbps: Option<f64>,
    /// Speed scheduling assumes: the reported one when within
    /// [`min_bandwidth_gbps`, `max_bandwidth_gbps`], else `default_bandwidth_gbps`.
    pub bandwidth_gbps: f64,
    /// True for an interface that exists on the host (socket binding to its name works).
    pub is_interface: bool,
}

impl Rail {
    /// True when `addr` lies in this rail's subnet.
    pub fn same_subnet(&self, addr: IpAddr) -> bool {
        match (self.address, addr) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let bits = u32::from(self.prefix_len.min(32));
                let mask = if bits == 0 {
                    0
                } else {
                    u32::MAX << (32 - bits)
                };
                u32::from(a) & mask == u32::from(b) & mask
            }
            (a, b) => a == b,
        }
    }
}

/// An interface as the OS shows it.
#[derive(Debug, Clone)]
struct Interface {
    name: String,
    address: Ipv4Addr,
    prefix_len: u8,
    loopback: bool,
}

fn interfaces() -> Vec<Interface> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for ifa in addrs {
        use nix::net::if_::InterfaceFlags as F;
        if !ifa.flags.contains(F::IFF_UP) {
            continue;
        }
        let Some(v4) = ifa
            .address
            .as_ref()
            .and_then(|a| a.as_sockaddr_in())
            .map(|a| a.ip())
        else {
            continue;
        };
        let prefix_len = ifa
            .netmask
            .as_ref()
            .and_then(|m| m.as_sockaddr_in())
            .map(|m| u32::from(m.ip()).count_ones() as u8)
            .unwrap_or(32);
        out.push(Interface {
            loopback: ifa.flags.contains(F::IFF_LOOPBACK),
            name: ifa.interface_name,
            address: v4,
            prefix_len,
        });
    }
    out
}

/// Prefix length of the subnet of the interface that holds IPv4 address `addr`, if one does.
pub fn prefix_len_of(addr: Ipv4Addr) -> Option<u8> {
    interfaces()
        .into_iter()
        .find(|f| f.address == addr)
        .map(|f| f.prefix_len)
}

/// Name of the interface that holds `addr`, if any (loopback included).
pub fn interface_for_address(addr: IpAddr) -> Option<String> {
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    for ifa in addrs {
        let Some(sa) = ifa.address else { continue };
        let ip = if let Some(v4) = sa.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = sa.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        if ip == addr {
            return Some(ifa.interface_name);
        }
    }
    None
}

fn read_sys(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

/// The link speed interface `name` reports in sysfs, Gbit/s; `None` when it reports none
/// (a virtual interface down, loopback) or nonsense (`-1`).
fn sysfs_speed_gbps(name: &str) -> Option<f64> {
    read_sys(&format!("/sys/class/net/{name}/speed"))
        .and_then(|s| s.parse::<i64>().ok())
        .filter(|s| *s > 0)
        .map(|s| s as f64 / 1000.0)
}

/// The NUMA node of interface `name`'s device, -1 when sysfs does not say.
fn sysfs_numa_node(name: &str) -> i32 {
    read_sys(&format!("/sys/class/net/{name}/device/numa_node"))
        .and_then(|s| s.parse().ok())
        .unwrap_or(-1)
}

/// Speed the scheduler assumes for a rail: the reported one when it lies in `[min, max]`, else
/// the default (so a NIC that reports nothing or nonsense gets a sane figure).
pub fn theoretical_bandwidth(reported: Option<f64>, default: f64, min: f64, max: f64) -> f64 {
    match reported {
        Some(s) if s >= min && s <= max => s,
        _ => default,
    }
}

/// The NUMA distance table: `distance[a][b]`, by node id. Empty when sysfs has no nodes.
fn numa_distances() -> BTreeMap<u32, BTreeMap<u32, u32>> {
    let mut table = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/node") else {
        return table;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(line) = read_sys(&format!("/sys/devices/system/node/{name}/distance")) else {
            continue;
        };
        // The k-th number is the distance to the k-th online node, which for sysfs's contiguous
        // numbering is node k.
        let row = line
            .split_whitespace()
            .filter_map(|d| d.parse::<u32>().ok())
            .enumerate()
            .map(|(k, d)| (k as u32, d))
            .collect();
        table.insert(id, row);
    }
    table
}

/// Rails and NUMA layout of this host.
#[derive(Debug, Clone)]
pub struct Topology {
    /// The rails this engine sends on and publishes.
    pub rails: Vec<Rail>,
    distances: BTreeMap<u32, BTreeMap<u32, u32>>,
    overrides: BTreeMap<String, BTreeMap<String, u8>>,
}

impl Topology {
    /// Finds the rails for an engine listening on `listen`. Fails when config names a tier
    /// override for a rail that does not exist, or a configured rail address does not parse.
    pub fn discover(config: &Config, listen: IpAddr) -> Result<Topology> {
        let rdma = &config.transports.rdma;
        let theoretical = |r: Option<f64>| {
            theoretical_bandwidth(
                r,
                rdma.default_bandwidth_gbps,
                rdma.min_bandwidth_gbps,
                rdma.max_bandwidth_gbps,
            )
        };
        let ifaces = interfaces();
        let rails: Vec<Rail> = if !config.rails.is_empty() {
            let mut rails = Vec::new();
            for (i, r) in config.rails.iter().enumerate() {
                let address: IpAddr = r.address.parse().map_err(|_| {
                    Error::Config(crate::config::ConfigError::new(
                        format!("rails[{i}].address"),
                        "not an IP address",
                    ))
                })?;
                let iface = ifaces.iter().find(|f| IpAddr::V4(f.address) == address);
                // What the config leaves out comes from the interface that holds the address,
                // as for discovered rails: a rail given by hand without a speed would otherwise
                // be assumed at `default_bandwidth_gbps` (400), and a fresh engine would deal a
                // 10 Gbit/s NIC 40 times what it can carry in its first round trips.
                let reported = r
                    .bandwidth_gbps
                    .or_else(|| iface.and_then(|f| sysfs_speed_gbps(&f.name)));
                let numa_node = match (r.numa_node, iface) {
                    (-1, Some(f)) => sysfs_numa_node(&f.name),
                    (n, _) => n,
                };
                rails.push(Rail {
                    name: r.name.clone(),
                    address,
                    prefix_len: iface.map_or(32, |f| f.prefix_len),
                    numa_node,
                    reported_gbps: reported,
                    bandwidth_gbps: theoretical(reported),
                    is_interface: iface.is_some_and(|f| f.name == r.name),
                });
            }
            rails
        } else {
            let pick: Vec<&Interface> = if !listen.is_unspecified() {
                ifaces
                    .iter()
                    .filter(|f| IpAddr::V4(f.address) == listen)
                    .collect()
            } else {
                let real: Vec<&Interface> = ifaces.iter().filter(|f| !f.loopback).collect();
                if real.is_empty() {
                    ifaces.iter().filter(|f| f.loopback).collect()
                } else {
                    real
                }
            };
            pick.into_iter()
                .map(|f| {
                    let reported = sysfs_speed_gbps(&f.name);
                    Rail {
                        name: f.name.clone(),
                        address: IpAddr::V4(f.address),
                        prefix_len: f.prefix_len,
                        numa_node: sysfs_numa_node(&f.name),
                        reported_gbps: reported,
                        bandwidth_gbps: theoretical(reported),
                        is_interface: true,
                    }
                })
                .collect()
        };
        for (location, names) in &config.tiers {
            for name in names.keys() {
                // `device/port` names an RDMA rail, which the RDMA transport finds later.
                if name.contains('/') {
                    continue;
                }
                if !rails.iter().any(|r| &r.name == name) {
                    return Err(Error::Config(crate::config::ConfigError::new(
                        format!("tiers.{location}.{name}"),
                        format!(
                            "no rail named {name:?} on this host (rails: {})",
                            rails
                                .iter()
                                .map(|r| r.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    )));
                }
            }
        }
        Ok(Topology {
            rails,
            distances: numa_distances(),
            overrides: config.tiers.clone(),
        })
    }

    /// A topology of RDMA rails (device ports): tiers from this host's NUMA distances and
    /// the configured tier overrides (`tiers`), which may name RDMA rails as `device/port`.
    pub fn for_rdma(rails: Vec<Rail>, config: &Config) -> Topology {
        Topology {
            rails,
            distances: numa_distances(),
            overrides: config.tiers.clone(),
        }
    }

    /// A topology with the given rails and distance table, for tests and tools.
    pub fn with_rails(rails: Vec<Rail>, distances: BTreeMap<u32, BTreeMap<u32, u32>>) -> Topology {
        Topology {
            rails,
            distances,
            overrides: BTreeMap::new(),
        }
    }

    /// NUMA node ids of this host.
    pub fn numa_nodes(&self) -> Vec<u32> {
        self.distances.keys().copied().collect()
    }

    /// Tier (0, 1 or 2) of every rail for memory at `location`, in rail order.
    pub fn tiers(&self, location: Location) -> Vec<u8> {
        let override_for = self.overrides.get(&location.to_string());
        self.rails
            .iter()
            .map(|rail| {
                if let Some(t) = override_for.and_then(|o| o.get(&rail.name)) {
                    return *t;
                }
                let Location::Cpu(node) = location else {
                    return 0;
                };
                if rail.numa_node < 0 || rail.numa_node as u32 == node {
                    return 0;
                }
                let Some(row) = self.distances.get(&node) else {
                    return 1;
                };
                let nearest_remote = row
                    .iter()
                    .filter(|(n, _)| **n != node)
                    .map(|(_, d)| *d)
                    .min();
                match (row.get(&(rail.numa_node as u32)), nearest_remote) {
                    (Some(d), Some(near)) if *d <= near => 1,
                    (Some(_), Some(_)) => 2,
                    _ => 1,
                }
            })
            .collect()
    }

    /// The rails as a segment descriptor publishes them.
    pub fn descriptors(&self) -> Vec<RailDescriptor> {
        self.rails
            .iter()
            .map(|r| RailDescriptor {
                name: r.name.clone(),
                address: r.address.to_string(),
                numa_node: r.numa_node,
                bandwidth_gbps: r.bandwidth_gbps,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rail(name: &str, addr: &str, prefix: u8, numa: i32) -> Rail {
        Rail {
            name: name.into(),
            address: addr.parse().unwrap(),
            prefix_len: prefix,
            numa_node: numa,
            reported_gbps: None,
            bandwidth_gbps: 100.0,
            is_interface: false,
        }
    }

    fn four_nodes() -> BTreeMap<u32, BTreeMap<u32, u32>> {
        // Nodes 0,1 are close (21); 2,3 are far from them (31).
        let d = [
            [10, 21, 31, 31],
            [21, 10, 31, 31],
            [31, 31, 10, 21],
            [31, 31, 21, 10],
        ];
        (0..4u32)
            .map(|a| {
                (
                    a,
                    (0..4u32).map(|b| (b, d[a as usize][b as usize])).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn tiers_follow_numa_distance() {
        let t = Topology::with_rails(
            vec![
                rail("a", "10.0.0.1", 24, 0),
                rail("b", "10.0.1.1", 24, 1),
                rail("c", "10.0.2.1", 24, 2),
                rail("d", "10.0.3.1", 24, -1),
            ],
            four_nodes(),
        );
        assert_eq!(t.tiers(Location::Cpu(0)), vec![0, 1, 2, 0]);
        assert_eq!(t.tiers(Location::Cpu(2)), vec![2, 2, 0, 0]);
        assert_eq!(t.tiers(Location::Cpu(3)), vec![2, 2, 1, 0]);
        assert_eq!(t.tiers(Location::Any), vec![0, 0, 0, 0]);
        assert_eq!(t.numa_nodes(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn overrides_win() {
        let mut t = Topology::with_rails(
            vec![rail("a", "10.0.0.1", 24, 0), rail("b", "10.0.1.1", 24, 1)],
            four_nodes(),
        );
        t.overrides.insert(
            "cpu:0".into(),
            [("a".to_string(), 2u8)].into_iter().collect(),
        );
        assert_eq!(t.tiers(Location::Cpu(0)), vec![2, 1]);
        assert_eq!(t.tiers(Location::Cpu(1)), vec![1, 0]);
    }

    #[test]
    fn subnets_and_bandwidth_rule() {
        let r = rail("a", "10.77.1.1", 24, 0);
        assert!(r.same_subnet("10.77.1.2".parse().unwrap()));
        assert!(!r.same_subnet("10.77.2.2".parse().unwrap()));
        assert_eq!(
            theoretical_bandwidth(Some(100.0), 400.0, 10.0, 800.0),
            100.0
        );
        assert_eq!(theoretical_bandwidth(Some(1.0), 400.0, 10.0, 800.0), 400.0);
        assert_eq!(
            theoretical_bandwidth(Some(1000.0), 400.0, 10.0, 800.0),
            400.0
        );
        assert_eq!(theoretical_bandwidth(None, 400.0, 10.0, 800.0), 400.0);
    }

    #[test]
    fn listening_on_loopback_publishes_only_loopback() {
        let t = Topology::discover(&Config::default(), "127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(t.rails.len(), 1);
        assert_eq!(t.rails[0].address, "127.0.0.1".parse::<IpAddr>().unwrap());
        let all = Topology::discover(&Config::default(), "0.0.0.0".parse().unwrap()).unwrap();
        assert!(!all.rails.is_empty());
    }

    #[test]
    fn unknown_rail_in_tier_override_is_an_error() {
        let c = Config::from_json_str(r#"{"tiers": {"*": {"nosuchrail": 1}}}"#, "t").unwrap();
        let e = Topology::discover(&c, "127.0.0.1".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("tiers.*.nosuchrail"), "{e}");
    }
}
