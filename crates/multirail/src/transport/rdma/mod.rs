//! The `rdma` transport: slices as one-sided RDMA_WRITE and RDMA_READ work requests on
//! reliable-connected queue pairs, over every active port of every RDMA device (each port a
//! rail), with the dispatcher and rail policy the tcp transport uses.
//!
//! libibverbs is loaded at run time (`multirail-verbs`): on a host without it, or without an
//! active port, the engine starts and works as before, and [`probe`] says why RDMA is off.
//! Every buffer the engine allocates or registers is registered with every port (local and
//! remote read and write); the segment descriptor publishes the ports and, per buffer, one
//! remote key per port. Queue pairs are agreed over a control connection of the engine's own
//! listener (see `cm`), made on first use of a peer, and kept while the peer is; past
//! `transports.rdma.max_endpoints` paths, the least recently used idle peer is closed.

mod cm;
mod devices;
pub(crate) mod messages;
mod peer;
mod poller;
mod rc;

use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use multirail_policy::dispatch::DispatchConfig;
use serde::Serialize;

use crate::config::{Config, RdmaConfig};
use crate::error::{Error, Result};
use crate::memory::MemoryRegistry;
use crate::peer::Peer;
use crate::qos::Qos;
use crate::rails::RailScheduler;
use crate::segment::{BufferDescriptor, RdmaRailDescriptor};
use crate::server::ConnPermit;
use crate::stats::TrafficStats;
use crate::topology::{Rail, Topology};
use crate::transport::driver::{DriverEnv, Peers};
use crate::transport::handshake::Membership;
use crate::transport::{Plans, Prepared, Transport};
use crate::upkeep::Timers;

use devices::{Port, Registrations};
use peer::{RdmaLink, RdmaPeer};
use poller::Poller;
use rc::PostCounters;

/// What the transport needs from the engine.
pub(crate) struct RdmaSettings {
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub membership: Membership,
    pub dispatch: DispatchConfig,
}

/// Everything the transport shares between its peers, once RDMA is on.
pub(crate) struct Runtime {
    ports: Vec<Arc<Port>>,
    registrations: Arc<Registrations>,
    registry: Arc<MemoryRegistry>,
    scheduler: Arc<RailScheduler>,
    qos: Arc<Qos>,
    timers: Arc<Timers>,
    poller: Arc<Poller>,
    counters: Arc<PostCounters>,
    config: RdmaConfig,
    timeout: Duration,
    connect_timeout: Duration,
    membership: Membership,
    dispatch: DispatchConfig,
    /// Largest message every port carries (slices are cut to it).
    max_message: u32,
    /// What messaging uses of the ports (SEND/RECV).
    messages: Arc<messages::MessageVerbs>,
    /// This engine's segment name, for the target's logs.
    name: OnceLock<String>,
}

impl Runtime {
    fn dispatch_config(&self) -> DispatchConfig {
        DispatchConfig {
            timeout_ns: self.timeout.as_nanos() as u64,
            promotion: self.qos.promotion,
            ..self.dispatch.clone()
        }
    }

    fn own_name(&self) -> String {
        self.name.get().cloned().unwrap_or_default()
    }

    /// What every peer's driver shares.
    fn driver_env(&self) -> DriverEnv {
        DriverEnv {
            scheduler: self.scheduler.clone(),
            qos: self.qos.clone(),
            timers: self.timers.clone(),
            timeout: self.timeout,
        }
    }
}

/// Counts of the RDMA data path, from [`crate::Engine::rdma_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RdmaStats {
    /// `ibv_post_send` calls that carried slices.
    pub post_calls: u64,
    /// Slice work requests posted.
    pub work_requests: u64,
    /// Signalled completions reaped.
    pub signalled_completions: u64,
    /// Slices completed.
    pub slices: u64,
    /// Queue pairs lost to error completions.
    pub qp_errors: u64,
    /// Messages (and notifications) sent with SEND.
    pub messages_sent: u64,
    /// Of those, sent inline (at most `transports.rdma.max_inline_data` bytes).
    pub messages_inline: u64,
    /// Messages received from the receive queues.
    pub messages_received: u64,
}

/// What this host offers RDMA: the ports an engine would use, and why others are left out, or
/// why RDMA is off altogether.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RdmaProbe {
    /// The RDMA rails (ports) in use.
    pub rails: Vec<RdmaRailDescriptor>,
    /// Ports seen and not used, each with why.
    pub skipped: Vec<String>,
    /// Why RDMA is off (no library, no device, disabled); `None` when there are rails.
    pub off: Option<String>,
}

/// Looks for RDMA ports as an engine with `config` would, without starting one.
pub fn probe(config: &Config) -> RdmaProbe {
    match discover(&config.transports.rdma) {
        Ok(d) => RdmaProbe {
            rails: d.ports.iter().map(|p| p.descriptor.clone()).collect(),
            skipped: d.skipped,
            off: None,
        },
        Err((why, skipped)) => RdmaProbe {
            rails: Vec::new(),
            skipped,
            off: Some(why),
        },
    }
}

/// The usable ports, or why there are none (with the ports skipped).
fn discover(config: &RdmaConfig) -> std::result::Result<devices::Discovery, (String, Vec<String>)> {
    if !config.enable {
        return Err((
            "RDMA is disabled (transports.rdma.enable is false)".into(),
            Vec::new(),
        ));
    }
    let verbs = multirail_verbs::Verbs::get().map_err(|e| (e.to_string(), Vec::new()))?;
    let found = devices::discover(&verbs, config).map_err(|e| (e.to_string(), Vec::new()))?;
    if found.ports.is_empty() {
        let why = if found.skipped.is_empty() {
            "no RDMA device found (libibverbs lists none)".to_owned()
        } else {
            format!("no usable RDMA port ({})", found.skipped.join("; "))
        };
        return Err((why, found.skipped));
    }
    Ok(found)
}

/// The rdma transport.
pub(crate) struct RdmaTransport {
    runtime: std::result::Result<Arc<Runtime>, String>,
    peers: Peers<RdmaLink>,
}

impl RdmaTransport {
    /// Opens the RDMA ports `config` allows and registers every region of `registry` with them
    /// from now on. Never fails: without RDMA the transport is off and says why.
    pub(crate) fn start(
        config: &Config,
        registry: &Arc<MemoryRegistry>,
        stats: &Arc<TrafficStats>,
        qos: &Arc<Qos>,
        timers: &Arc<Timers>,
        settings: RdmaSettings,
    ) -> RdmaTransport {
        let runtime = Self::runtime(config, registry, stats, qos, timers, settings);
        if let Err(why) = &runtime {
            tracing::debug!(%why, "RDMA transport off");
        }
        RdmaTransport {
            runtime,
            peers: Peers::default(),
        }
    }

    fn runtime(
        config: &Config,
        registry: &Arc<MemoryRegistry>,
        stats: &Arc<TrafficStats>,
        qos: &Arc<Qos>,
        timers: &Arc<Timers>,
        settings: RdmaSettings,
    ) -> std::result::Result<Arc<Runtime>, String> {
        let rdma = &config.transports.rdma;
        let found = discover(rdma).map_err(|(why, _)| why)?;
        for s in &found.skipped {
            tracing::info!(port = %s, "RDMA port not used");
        }
        let ports = found.ports;
        let rails: Vec<Rail> = ports
            .iter()
            .map(|p| {
                let d = &p.descriptor;
                let address = d
                    .ipv4()
                    .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), IpAddr::V4);
                Rail {
                    name: d.name(),
                    address,
                    prefix_len: d
                        .ipv4()
                        .and_then(crate::topology::prefix_len_of)
                        .unwrap_or(32),
                    numa_node: d.numa_node,
                    reported_gbps: Some(d.bandwidth_gbps),
                    bandwidth_gbps: d.bandwidth_gbps,
                    is_interface: false,
                }
            })
            .collect();
        let scheduler = Arc::new(RailScheduler::new(
            Topology::for_rdma(rails, config),
            rdma,
            stats,
        ));
        let max_message = ports
            .iter()
            .filter_map(|p| p.context.port_info(p.port).ok().map(|i| i.max_msg_sz))
            .min()
            .unwrap_or(1 << 30)
            .max(4096);
        let registrations = Arc::new(Registrations::new(ports.clone()));
        registry.set_hook(registrations.clone());
        let counters = Arc::new(PostCounters::default());
        let poller = Poller::new(ports.clone(), counters.clone());
        poller
            .start()
            .map_err(|e| format!("cannot start the RDMA completion thread: {e}"))?;
        tracing::info!(
            rails = %ports.iter().map(|p| p.descriptor.name()).collect::<Vec<_>>().join(", "),
            "RDMA transport on"
        );
        let messages = Arc::new(messages::MessageVerbs::new(
            ports.clone(),
            registrations.clone(),
            rdma.clone(),
        ));
        Ok(Arc::new(Runtime {
            messages,
            ports,
            registrations,
            registry: registry.clone(),
            scheduler,
            qos: qos.clone(),
            timers: timers.clone(),
            poller,
            counters,
            config: rdma.clone(),
            timeout: settings.timeout,
            connect_timeout: settings.connect_timeout,
            membership: settings.membership,
            dispatch: settings.dispatch,
            max_message,
            name: OnceLock::new(),
        }))
    }

    /// Records this engine's segment name (known once its listener is bound).
    pub(crate) fn set_name(&self, name: &str) {
        if let Ok(rt) = &self.runtime {
            let _ = rt.name.set(name.to_owned());
        }
    }

    /// What messaging uses to send and receive over verbs, or why RDMA is off.
    pub(crate) fn message_verbs(&self) -> std::result::Result<Arc<messages::MessageVerbs>, String> {
        match &self.runtime {
            Ok(rt) => Ok(rt.messages.clone()),
            Err(why) => Err(why.clone()),
        }
    }

    /// Why RDMA is off, or `None` when it is on.
    pub(crate) fn off_reason(&self) -> Option<&str> {
        self.runtime.as_ref().err().map(String::as_str)
    }

    /// The RDMA rails this engine publishes.
    pub(crate) fn descriptors(&self) -> Vec<RdmaRailDescriptor> {
        self.runtime
            .as_ref()
            .map(|rt| rt.ports.iter().map(|p| p.descriptor.clone()).collect())
            .unwrap_or_default()
    }

    /// The rail scheduler of the RDMA rails, for statistics.
    pub(crate) fn scheduler(&self) -> Option<&Arc<RailScheduler>> {
        self.runtime.as_ref().ok().map(|rt| &rt.scheduler)
    }

    /// The data path's counts so far.
    pub(crate) fn stats(&self) -> RdmaStats {
        let Ok(rt) = &self.runtime else {
            return RdmaStats::default();
        };
        let c = &rt.counters;
        RdmaStats {
            post_calls: c.post_calls.load(Ordering::Relaxed),
            work_requests: c.work_requests.load(Ordering::Relaxed),
            signalled_completions: c.signalled.load(Ordering::Relaxed),
            slices: c.slices.load(Ordering::Relaxed),
            qp_errors: c.qp_errors.load(Ordering::Relaxed),
            messages_sent: rt.messages.counters.sent.load(Ordering::Relaxed),
            messages_inline: rt.messages.counters.inline.load(Ordering::Relaxed),
            messages_received: rt.messages.counters.received.load(Ordering::Relaxed),
        }
    }

    /// True when both this engine and `peer` have RDMA rails.
    pub(crate) fn reaches(&self, peer: &Peer) -> bool {
        self.runtime.is_ok() && !peer.descriptor().rdma.is_empty()
    }

    fn runtime_or_err(&self) -> Result<&Arc<Runtime>> {
        self.runtime
            .as_ref()
            .map_err(|why| Error::TransportUnavailable {
                transport: "rdma",
                reason: why.clone(),
            })
    }

    /// The peer's live RDMA state, made afresh when there is none or it was given up on.
    /// One thread connects at a time; others waiting meanwhile share its outcome.
    fn connected(&self, peer: &Arc<Peer>) -> Result<Arc<RdmaPeer>> {
        let rt = self.runtime_or_err()?;
        let (rdma, fresh) = self.peers.connected(peer, || peer::connect(peer, rt))?;
        if fresh {
            self.evict_over_cap(rt, peer.id);
        }
        Ok(rdma)
    }

    /// Closes least recently used idle peers while more paths are open than
    /// `max_endpoints` allows. Busy peers are never closed under their requests; the cap is
    /// then exceeded until they finish, with a warning.
    fn evict_over_cap(&self, rt: &Runtime, keep: u64) {
        let mut peers = self.peers.all();
        let mut open: usize = peers.iter().map(|(_, p)| p.link.endpoints()).sum();
        if open <= rt.config.max_endpoints {
            return;
        }
        peers.sort_by_key(|(_, p)| p.link.last_used_ns.load(Ordering::Relaxed));
        for (id, p) in peers {
            if open <= rt.config.max_endpoints {
                return;
            }
            if id == keep || p.is_busy() {
                continue;
            }
            tracing::debug!(
                peer = id,
                "closing the least recently used RDMA peer (max_endpoints)"
            );
            open -= p.link.endpoints();
            self.peers.take(id);
            p.close("closed to stay within transports.rdma.max_endpoints");
        }
        tracing::warn!(
            open,
            max = rt.config.max_endpoints,
            "more RDMA endpoints open than transports.rdma.max_endpoints: every other peer is busy"
        );
    }

    /// Runs the dispatcher deadline of peer `id`.
    pub(crate) fn on_timer(&self, id: u64, now: Instant) {
        self.peers.on_timer(id, now);
    }

    /// The link check of every peer's paths.
    pub(crate) fn check_links(&self) {
        self.peers.check_links();
    }

    /// Deals every peer's queued slices that rails and slots now allow.
    pub(crate) fn pump_all(&self) {
        self.peers.pump_all();
    }

    /// Closes the queue pairs to peer `id` and forgets it (its segment was closed); its
    /// slices in flight fail with `reason`. A peer never connected is no error.
    pub(crate) fn close_peer(&self, id: u64, reason: &str) {
        self.peers.close_peer(id, reason);
    }

    /// Closes every peer; their slices in flight fail.
    pub(crate) fn shutdown(&self, reason: &str) {
        self.peers.shutdown(reason);
        if let Ok(rt) = &self.runtime {
            rt.poller.stop();
        }
    }

    /// Serves an RDMA control connection the listener handed over (the target's side of
    /// agreeing queue pairs), on a thread of its own. Fails when RDMA is off here.
    pub(crate) fn accept(
        &self,
        stream: TcpStream,
        permit: ConnPermit,
    ) -> std::result::Result<(), String> {
        let rt = self
            .runtime
            .as_ref()
            .map_err(|why| format!("RDMA is off here: {why}"))?
            .clone();
        let writer = Arc::new(Mutex::new(
            stream
                .try_clone()
                .map_err(|e| format!("cannot share the connection: {e}"))?,
        ));
        rt.registrations.watch(&writer);
        std::thread::Builder::new()
            .name("mr-rdma-cm".into())
            .spawn(move || {
                cm::serve(
                    stream,
                    writer,
                    rt.ports.clone(),
                    rt.config.clone(),
                    rt.connect_timeout,
                );
                drop(permit);
            })
            .map(|_| ())
            .map_err(|e| format!("cannot start a thread for it: {e}"))
    }
}

impl crate::server::RdmaListener for RdmaTransport {
    fn accept(&self, stream: TcpStream, permit: ConnPermit) -> std::result::Result<(), String> {
        RdmaTransport::accept(self, stream, permit)
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn prepare(&self, peer: &Arc<Peer>, buffer: &BufferDescriptor) -> Result<()> {
        self.runtime_or_err()?;
        if peer.descriptor().rdma.is_empty() {
            return Err(Error::TransportUnavailable {
                transport: "rdma",
                reason: format!("segment {} has no RDMA device", peer.name),
            });
        }
        if buffer.rkeys.is_empty() {
            return Err(Error::TransportUnavailable {
                transport: "rdma",
                reason: format!(
                    "the buffer at {:#x} of segment {} has no RDMA registration",
                    buffer.addr, peer.name
                ),
            });
        }
        self.connected(peer).map(|_| ())
    }

    fn post(&self, reqs: Vec<(Arc<Peer>, Prepared)>, plans: &Plans) {
        self.peers.post(reqs, plans, |peer| self.connected(peer));
    }
}
