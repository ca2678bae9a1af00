//! `multirail topo`: the rails this host would send on and each rail's tier per memory location.

use std::net::IpAddr;

use clap::Args;
use comfy_table::{presets::UTF8_FULL, Table};
use multirail::topology::Topology;
use multirail::{Config, Location};

use crate::out::outln;
use crate::Failure;

/// Flags of `multirail topo`.
#[derive(Args)]
pub struct TopoArgs {
    /// Address the engine would listen on; a specific address publishes only its rail.
    /// Default: 0.0.0.0 (every rail).
    #[arg(long, default_value = "0.0.0.0")]
    listen: IpAddr,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

/// Runs `multirail topo`.
pub fn run(config: Config, args: TopoArgs) -> Result<(), Failure> {
    let topo = Topology::discover(&config, args.listen)?;
    let rdma = multirail::rdma_probe(&config);
    let mut locations = vec![Location::Any];
    locations.extend(topo.numa_nodes().into_iter().map(Location::Cpu));
    if args.json {
        let tiers: serde_json::Map<String, serde_json::Value> = locations
            .iter()
            .map(|l| (l.to_string(), serde_json::json!(topo.tiers(*l))))
            .collect();
        return outln!(
            "{}",
            serde_json::json!({"rails": topo.rails, "tiers": tiers, "rdma": rdma})
        );
    }
    let mut rails = Table::new();
    rails.load_preset(UTF8_FULL);
    rails.set_header(vec![
        "dev",
        "rail",
        "address",
        "NUMA node",
        "link speed",
        "scheduled as",
    ]);
    for (i, r) in topo.rails.iter().enumerate() {
        rails.add_row(vec![
            i.to_string(),
            r.name.clone(),
            format!("{}/{}", r.address, r.prefix_len),
            if r.numa_node < 0 {
                "unknown".into()
            } else {
                r.numa_node.to_string()
            },
            r.reported_gbps
                .map_or("unknown".into(), |g| format!("{g} Gbps")),
            format!("{} Gbps", r.bandwidth_gbps),
        ]);
    }
    outln!("{rails}")?;
    let mut tiers = Table::new();
    tiers.load_preset(UTF8_FULL);
    let mut header = vec!["memory location".to_owned()];
    header.extend(topo.rails.iter().map(|r| format!("tier of {}", r.name)));
    tiers.set_header(header);
    for l in &locations {
        let mut row = vec![l.to_string()];
        row.extend(topo.tiers(*l).iter().map(u8::to_string));
        tiers.add_row(row);
    }
    outln!("{tiers}")?;
    print_rdma(&rdma)
}

/// The RDMA rails, or why RDMA is off.
fn print_rdma(rdma: &multirail::RdmaProbe) -> Result<(), Failure> {
    if let Some(why) = &rdma.off {
        outln!("RDMA: off: {why}")?;
    } else {
        let mut t = Table::new();
        t.load_preset(UTF8_FULL);
        t.set_header(vec![
            "RDMA rail",
            "GID (index)",
            "LID",
            "MTU",
            "NUMA node",
            "scheduled as",
        ]);
        for r in &rdma.rails {
            let gid = match r.ipv4() {
                Some(ip) => format!("::ffff:{ip} ({})", r.gid_index),
                None => format!(
                    "{} ({})",
                    r.gid.iter().map(|b| format!("{b:02x}")).collect::<String>(),
                    r.gid_index
                ),
            };
            t.add_row(vec![
                r.name(),
                gid,
                r.lid.to_string(),
                r.mtu.to_string(),
                if r.numa_node < 0 {
                    "unknown".into()
                } else {
                    r.numa_node.to_string()
                },
                format!("{} Gbps", r.bandwidth_gbps),
            ]);
        }
        outln!("{t}")?;
    }
    for s in &rdma.skipped {
        outln!("RDMA port not used: {s}")?;
    }
    Ok(())
}
