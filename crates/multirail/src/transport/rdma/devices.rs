//! The RDMA rails of this engine: every active port of every device the configuration allows,
//! opened once, with the protection domain and completion queue its queue pairs share, and the
//! memory registrations that let peers reach this engine's buffers through it.

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::{Arc, Mutex, Weak};

use multirail_verbs::{
    Access, CompletionQueue, Context, MemoryRegion, PortInfo, ProtectionDomain, Verbs,
};

use crate::config::RdmaConfig;
use crate::error::{Error, Result};
use crate::memory::RegionHook;
use crate::segment::RdmaRailDescriptor;

/// Completions one poll of a device's queue takes at most; also the queue's share of the
/// poller's scratch space.
pub(super) const POLL_BATCH: usize = 64;

/// Rights every registration grants: local writes (READ results land in it) and remote
/// reads and writes (peers' one-sided operations).
fn access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
}

/// One port in use: an RDMA rail.
pub(crate) struct Port {
    /// Index among this engine's RDMA rails (the rail id the scheduler knows it by).
    pub index: usize,
    pub context: Context,
    pub pd: ProtectionDomain,
    /// Every queue pair of this port completes here: one queue to poll per rail.
    pub cq: CompletionQueue,
    pub port: u8,
    pub gid_index: u8,
    pub descriptor: RdmaRailDescriptor,
}

/// What discovery found: the ports in use, or why there are none.
pub(crate) struct Discovery {
    pub ports: Vec<Arc<Port>>,
    /// Ports seen and left out, with why (down, filtered, no usable GID).
    pub skipped: Vec<String>,
}

/// True when `config.devices` lets port `port` of `device` be used.
fn allowed(config: &RdmaConfig, device: &str, port: u8) -> bool {
    config.devices.is_empty()
        || config.devices.iter().any(|d| match d.split_once('/') {
            Some((dev, p)) => dev == device && p.parse::<u8>() == Ok(port),
            None => d == device,
        })
}

/// The GID entry port `info` connects with: `gid_index` when set, else the port's RoCE v2
/// choice.
fn choose_gid(info: &PortInfo, gid_index: i32) -> std::result::Result<(u8, [u8; 16]), String> {
    if gid_index >= 0 {
        let e = info
            .gids
            .iter()
            .find(|e| e.index as i32 == gid_index)
            .ok_or_else(|| format!("gid_index {gid_index} is empty on this port"))?;
        return Ok((e.index as u8, e.gid.0));
    }
    info.roce_v2_gid()
        .map(|e| (e.index as u8, e.gid.0))
        .ok_or_else(|| "no RoCE v2 or InfiniBand GID".to_owned())
}

/// Opens every usable port. Fails only when the library cannot be used at all; a device that
/// cannot be opened is skipped with its reason.
pub(crate) fn discover(verbs: &Arc<Verbs>, config: &RdmaConfig) -> Result<Discovery> {
    let devices = verbs.devices().map_err(|e| Error::TransportUnavailable {
        transport: "rdma",
        reason: format!("listing RDMA devices: {e}"),
    })?;
    let mut ports = Vec::new();
    let mut skipped = Vec::new();
    for dev in devices {
        for info in &dev.ports {
            let name = format!("{}/{}", dev.name, info.port);
            if !allowed(config, &dev.name, info.port) {
                skipped.push(format!("{name}: not in transports.rdma.devices"));
                continue;
            }
            if !info.is_active() {
                skipped.push(format!("{name}: port state {:?}", info.state));
                continue;
            }
            let (gid_index, gid) = match choose_gid(info, config.gid_index) {
                Ok(g) => g,
                Err(why) => {
                    skipped.push(format!("{name}: {why}"));
                    continue;
                }
            };
            let opened = Context::open(verbs, &dev.name).and_then(|context| {
                let pd = ProtectionDomain::new(&context)?;
                let depth = context.attr().max_cqe.min(16384);
                let cq = CompletionQueue::new(&context, depth)?;
                Ok((context, pd, cq))
            });
            let (context, pd, cq) = match opened {
                Ok(o) => o,
                Err(e) => {
                    skipped.push(format!("{name}: {e}"));
                    continue;
                }
            };
            let bandwidth_gbps = crate::topology::theoretical_bandwidth(
                info.rate_gbps(),
                config.default_bandwidth_gbps,
                config.min_bandwidth_gbps,
                config.max_bandwidth_gbps,
            );
            let descriptor = RdmaRailDescriptor {
                device: dev.name.clone(),
                port: info.port,
                gid,
                gid_index,
                lid: info.lid,
                mtu: info.active_mtu.clamp(256, 4096),
                numa_node: dev.numa_node.map_or(-1, |n| n as i32),
                bandwidth_gbps,
            };
            ports.push(Arc::new(Port {
                index: ports.len(),
                context,
                pd,
                cq,
                port: info.port,
                gid_index,
                descriptor,
            }));
        }
    }
    Ok(Discovery { ports, skipped })
}

/// The registrations of one memory region, one per port.
pub(crate) struct Registration {
    mrs: Vec<MemoryRegion>,
    addr: usize,
    len: usize,
}

impl Registration {
    /// The local key on rail `port`.
    pub(crate) fn lkey(&self, port: usize) -> u32 {
        self.mrs[port].lkey()
    }
}

/// Told when a buffer stops being served: the write side of a peer's RDMA control connection,
/// which passes it on in the connection manager's frame (`cm` implements this for the
/// connection's writer, so these registrations need not know the frame).
pub(crate) trait UnregisterWatcher: Send + Sync {
    /// The buffer `addr..addr+len` is no longer served: its keys are gone. Best effort: a
    /// peer that cannot take the notice finds out from its next failed request.
    fn unregistered(&self, addr: u64, len: u64);
}

/// Registers every region of the engine with every port ([`RegionHook`]), and finds the
/// registration of local memory for a request.
pub(crate) struct Registrations {
    ports: Vec<Arc<Port>>,
    by_id: Mutex<HashMap<u64, Arc<Registration>>>,
    /// The write side of every open RDMA control connection a peer made to this engine: told
    /// when a buffer stops being served, so peers drop its keys before they use them.
    watchers: Mutex<Vec<Weak<dyn UnregisterWatcher>>>,
}

impl Registrations {
    pub(crate) fn new(ports: Vec<Arc<Port>>) -> Self {
        Registrations {
            ports,
            by_id: Mutex::default(),
            watchers: Mutex::default(),
        }
    }

    /// Tells the peer on `writer` of every buffer unregistered from now on.
    pub(crate) fn watch(&self, writer: &Arc<Mutex<TcpStream>>) {
        let mut w = self.watchers.lock().expect("registrations poisoned");
        w.retain(|x| x.strong_count() > 0);
        let writer: Weak<Mutex<TcpStream>> = Arc::downgrade(writer);
        let writer: Weak<dyn UnregisterWatcher> = writer;
        w.push(writer);
    }

    /// The registration of region `id`; `None` once it was unregistered.
    pub(crate) fn get(&self, id: u64) -> Option<Arc<Registration>> {
        self.by_id
            .lock()
            .expect("registrations poisoned")
            .get(&id)
            .cloned()
    }
}

impl RegionHook for Registrations {
    fn registered(&self, id: u64, addr: usize, len: usize) -> Result<Vec<u32>> {
        let mut mrs = Vec::with_capacity(self.ports.len());
        for p in &self.ports {
            // SAFETY: the memory registry calls this for a range it serves: engine-allocated
            // memory it keeps mapped until the region (and so this registration, which the
            // region outlives through `unregistered`) is gone, or caller memory the caller
            // promised to keep valid until it unregisters it. The engine reads those bytes only
            // through requests whose completion it waits for.
            let mr = unsafe { MemoryRegion::register(&p.pd, addr as *mut u8, len, access()) }
                .map_err(|e| {
                    Error::Memory(format!(
                        "registering {len} bytes at {addr:#x} with RDMA device {}: {e}{}",
                        p.descriptor.name(),
                        if matches!(e, multirail_verbs::VerbsError::Verb { errno: 12, .. }) {
                            " (raise the locked-memory limit, ulimit -l, or set \
                             transports.rdma.enable false)"
                        } else {
                            ""
                        }
                    ))
                })?;
            mrs.push(mr);
        }
        let rkeys = mrs.iter().map(MemoryRegion::rkey).collect();
        self.by_id
            .lock()
            .expect("registrations poisoned")
            .insert(id, Arc::new(Registration { mrs, addr, len }));
        Ok(rkeys)
    }

    fn unregistered(&self, id: u64) {
        // Slices in flight hold their own `Arc`: the memory regions go when they finish.
        let Some(gone) = self
            .by_id
            .lock()
            .expect("registrations poisoned")
            .remove(&id)
        else {
            return;
        };
        let watchers: Vec<Arc<dyn UnregisterWatcher>> = self
            .watchers
            .lock()
            .expect("registrations poisoned")
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for w in watchers {
            w.unregistered(gone.addr as u64, gone.len as u64);
        }
    }
}
