//! The host's rails (network interfaces), discovered from sysfs or declared in config.

use std::net::IpAddr;

use crate::config::RailConfig;
use crate::segment::RailDescriptor;

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

/// Rails of this host: the configured ones, else every interface that is up and has an IPv4
/// address, loopback only when nothing else is. Bandwidth is the link speed when sysfs knows it
/// and it lies in `[min_gbps, max_gbps]`, else `default_gbps`.
pub fn discover_rails(
    configured: &[RailConfig],
    default_gbps: f64,
    min_gbps: f64,
    max_gbps: f64,
) -> Vec<RailDescriptor> {
    let pick = |speed: Option<f64>| match speed {
        Some(s) if s >= min_gbps && s <= max_gbps => s,
        _ => default_gbps,
    };
    if !configured.is_empty() {
        return configured
            .iter()
            .map(|r| RailDescriptor {
                name: r.name.clone(),
                address: r.address.clone(),
                numa_node: r.numa_node,
                bandwidth_gbps: pick(r.bandwidth_gbps),
            })
            .collect();
    }
    let mut rails = Vec::new();
    let mut loopback = Vec::new();
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return rails;
    };
    for ifa in addrs {
        let Some(v4) = ifa
            .address
            .as_ref()
            .and_then(|a| a.as_sockaddr_in())
            .map(|a| a.ip())
        else {
            continue;
        };
        let name = ifa.interface_name;
        let base = format!("/sys/class/net/{name}");
        let up = ifa.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP);
        if !up {
            continue;
        }
        let speed_mbps = read_sys(&format!("{base}/speed")).and_then(|s| s.parse::<i64>().ok());
        let numa_node = read_sys(&format!("{base}/device/numa_node"))
            .and_then(|s| s.parse::<i32>().ok())
            .unwrap_or(-1);
        let rail = RailDescriptor {
            name: name.clone(),
            address: v4.to_string(),
            numa_node,
            bandwidth_gbps: pick(speed_mbps.filter(|s| *s > 0).map(|s| s as f64 / 1000.0)),
        };
        if v4.is_loopback() {
            loopback.push(rail);
        } else {
            rails.push(rail);
        }
    }
    if rails.is_empty() {
        loopback
    } else {
        rails
    }
}
