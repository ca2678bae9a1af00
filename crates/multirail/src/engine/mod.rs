//! The public API: an `Engine` owns registered memory, serves it to peers, opens peers' segments
//! and moves bytes between them in batches of requests.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::thread;
use std::time::{Duration, Instant};

mod merge;
mod messages;
mod prepared;
mod publish;
mod route;
mod routed;
mod stats;

use route::{annotate, LivePeers, Route, RouteMemo};
use routed::RoutedBatch;

pub use prepared::{PreparedEntry, PreparedListId};

use multirail_policy::qos::Priority;
use multirail_policy::slicing::SlicePlan;

use crate::batch::{Batch, Status};
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};
use crate::listener::{Server, ServerSettings};
use crate::memory::{Buffer, Location, MemoryRegistry};
use crate::metadata::{self, MetadataStore};
use crate::peer::Peer;
use crate::qos::Qos;
use crate::rails::RailScheduler;
use crate::segment::{self, RailDescriptor, SegmentDescriptor, PROTOCOL_VERSION};
pub use crate::stats::RailHealth;
use crate::stats::TrafficStats;
use crate::topology;
use crate::transport::cpu_priority::NiceTable;
use crate::transport::handshake::Membership;
use crate::transport::rdma::{RdmaSettings, RdmaTransport};
use crate::transport::shm::ShmTransport;
use crate::transport::tcp::{TcpSettings, TcpTransport};
use crate::transport::{Opcode, Prepared};
use crate::upkeep::{TimerKey, Timers, LINK_CHECK};

/// Highest priority, the default: metadata, control, latency-sensitive transfers (TENT's 0).
pub const PRIO_HIGH: Priority = Priority::High;
/// Interactive and serving traffic (TENT's 1).
pub const PRIO_MEDIUM: Priority = Priority::Medium;
/// Bulk and background transfers (TENT's 2).
pub const PRIO_LOW: Priority = Priority::Low;

pub use crate::segment::SegmentId;

/// Handle of a batch, returned by [`Engine::allocate_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchId(pub u64);

/// One transfer: `length` bytes between local address `source` and address `target_offset`
/// inside segment `target`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// Read (target to source) or write (source to target).
    pub opcode: Opcode,
    /// Local address, inside memory this engine allocated or registered.
    pub source: u64,
    /// The segment to read from or write to.
    pub target: SegmentId,
    /// Address in the target segment (a buffer's `addr` plus an offset).
    pub target_offset: u64,
    /// Bytes to move; at least 1.
    pub length: u64,
    /// `PRIO_HIGH` (default), `PRIO_MEDIUM` or `PRIO_LOW`.
    pub priority: Priority,
    /// Forces a transport for this request; `None` follows the engine's `transport` setting.
    pub transport: Option<TransportChoice>,
}

impl Request {
    /// A write of `length` bytes from `source` to `target_offset` in `target`, at high priority.
    pub fn write(source: u64, target: SegmentId, target_offset: u64, length: u64) -> Self {
        Request {
            opcode: Opcode::Write,
            source,
            target,
            target_offset,
            length,
            priority: PRIO_HIGH,
            transport: None,
        }
    }

    /// A read of `length` bytes from `target_offset` in `target` into `source`, at high priority.
    pub fn read(source: u64, target: SegmentId, target_offset: u64, length: u64) -> Self {
        Request {
            opcode: Opcode::Read,
            ..Request::write(source, target, target_offset, length)
        }
    }
}

struct Peers {
    by_id: HashMap<u64, Arc<Peer>>,
    by_name: HashMap<String, u64>,
    next_id: u64,
}

/// What the control port publishes; shared with the server thread.
struct LocalSegment {
    name: OnceLock<String>,
    /// `metadata.segment_name`: the name published in the store, when not `name`.
    segment_name: Option<String>,
    host_id: String,
    rails: Vec<RailDescriptor>,
    rdma: Vec<segment::RdmaRailDescriptor>,
    registry: Arc<MemoryRegistry>,
    /// Multicast groups joined, published so the other members find their tables.
    groups: Mutex<Vec<segment::GroupDescriptor>>,
    /// A membership token is required (`auth.token`): published so that peers finding this
    /// descriptor in a store prove membership before reaching the memory over shm.
    members_only: bool,
}

impl LocalSegment {
    fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            name: self.name.get().cloned().unwrap_or_default(),
            host_id: self.host_id.clone(),
            pid: std::process::id(),
            protocol_version: PROTOCOL_VERSION,
            rails: self.rails.clone(),
            rdma: self.rdma.clone(),
            buffers: self.registry.descriptors(),
            segment_name: self.segment_name.clone(),
            groups: self.groups.lock().expect("groups poisoned").clone(),
            members_only: self.members_only,
        }
    }

    /// The name peers open this engine by: `metadata.segment_name`, else `host:port`.
    fn published_name(&self) -> String {
        self.segment_name
            .clone()
            .or_else(|| self.name.get().cloned())
            .unwrap_or_default()
    }
}

struct Inner {
    config: Config,
    local: Arc<LocalSegment>,
    metadata: Box<dyn MetadataStore>,
    /// Asks a segment for its descriptor over its own control port: with a store, the
    /// authority when the store's copy is behind (a publish that has not landed yet).
    direct: metadata::P2pMetadata,
    metadata_counters: metadata::MetadataCounters,
    /// Requests finished by this engine's batches.
    transfers: Arc<crate::batch::TransferCounters>,
    /// Whether `metadata` keeps descriptors that this engine must publish (HTTP store); P2P
    /// answers from `local` on demand.
    publishes: bool,
    /// Serializes publishing, so the store ends with the newest descriptor; true once this
    /// engine has withdrawn its descriptor for good (shut down or dropped). Only control-path
    /// calls take it, for as long as one request to the store lasts.
    withdrawn: Mutex<bool>,
    peers: RwLock<Peers>,
    batches: Mutex<HashMap<u64, Arc<Batch>>>,
    next_batch: AtomicU64,
    /// Prepared request lists ([`Engine::prepare`]), by id.
    prepared: Mutex<HashMap<u64, Arc<prepared::PreparedList>>>,
    next_prepared: AtomicU64,
    stats: Arc<TrafficStats>,
    /// How long `wait` polls before sleeping while no bulk moves: at most
    /// `workers.wait_spin_us`, learned from how long such waits have lasted.
    wait_spin: crate::spin::Spin,
    /// The fewest slices of a batch for which a long `wait` sleeps at once: one more than a
    /// tcp path's connections, so that each carries more than one and its threads run for the
    /// whole batch; `u64::MAX` on a host with more than [`crate::spin::FEW_CPUS`] CPUs, where a
    /// poller finds an idle core.
    sleep_from_slices: u64,
    /// How many threads waiting for network transfers may poll in `wait` at once.
    pollers: crate::spin::PollBudget,
    shm: ShmTransport,
    tcp: TcpTransport,
    rdma: Arc<RdmaTransport>,
    timers: Arc<Timers>,
    scheduler: Arc<RailScheduler>,
    qos: Arc<Qos>,
    /// How requests are cut into slices, per direction.
    plans: crate::transport::Plans,
    fallback_logged: OnceLock<()>,
    server: Mutex<Option<Server>>,
    messaging: Arc<crate::messaging::Messaging>,
    /// The notifier thread's queue ([`Engine::notify_when_done`]), once started. The thread
    /// ends when this sender is dropped with the engine.
    notifier: Mutex<Option<std::sync::mpsc::Sender<messages::DoneBatch>>>,
}

/// A transfer engine: one segment, named `host:port` after its control port.
///
/// Cloning gives another handle to the same engine; it stops when the last handle drops, and
/// from then on no peer writes its buffers: the memory registered with it may be freed.
#[derive(Clone)]
pub struct Engine {
    /// Held by the handles the caller has (not by those the engine's own threads make for a
    /// moment): the last one to go closes the engine's memory at once. `None` on those
    /// momentary handles.
    _caller: Option<Arc<CallerHold>>,
    inner: Arc<Inner>,
}

/// The caller's hold on an engine. The engine's threads hold it weakly and take a strong
/// handle for the moment they work, so the engine itself (`Inner`) may outlive the caller's
/// last handle by that moment; its buffers must not: once the caller's last handle is
/// dropped, the caller may free the memory it registered.
struct CallerHold(Weak<Inner>);

impl Drop for CallerHold {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            // Lookups stop finding the engine, and no peer (over shm, tcp or RDMA) writes its
            // buffers from now on.
            inner.withdraw_descriptor();
            inner.local.registry.close();
        }
    }
}

fn advertised_host(config: &Config, listen: &SocketAddr, rails: &[RailDescriptor]) -> String {
    if let Some(h) = &config.local_hostname {
        return h.clone();
    }
    if !listen.ip().is_unspecified() {
        return listen.ip().to_string();
    }
    rails
        .iter()
        .filter_map(|r| r.address.parse::<IpAddr>().ok())
        .find(|ip| ip.is_ipv4() && !ip.is_loopback())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
        .to_string()
}

impl Engine {
    /// Starts an engine serving its segment on `listen` (`ADDR:PORT`; port 0 picks a free one).
    /// Fails on an invalid configuration, an unparsable address or a port that cannot be bound.
    pub fn new(config: Config, listen: &str) -> Result<Engine> {
        config.validate()?;
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| Error::invalid("listen", format!("{listen:?} is not ADDR:PORT: {e}")))?;
        let tcp_cfg = &config.transports.tcp;
        let membership = match config.auth.effective_token()? {
            Some(token) => Membership::with_token(token.expose().as_bytes()),
            None => Membership::open(),
        };
        let metadata_cfg = config.effective_metadata();
        // Before anything is started: a bad store address is a configuration error.
        let metadata = metadata::from_config(
            &metadata_cfg,
            Duration::from_millis(tcp_cfg.connect_timeout_ms),
            Duration::from_millis(tcp_cfg.timeout_ms),
            membership.clone(),
        )?;
        let direct = metadata::P2pMetadata::new(
            Duration::from_millis(tcp_cfg.connect_timeout_ms),
            Duration::from_millis(tcp_cfg.timeout_ms),
            membership.clone(),
        );
        let topology = topology::Topology::discover(&config, listen.ip())?;
        let rails = topology.descriptors();
        let registry = Arc::new(MemoryRegistry::default());
        let stats = Arc::new(TrafficStats::default());
        let settings = TcpSettings {
            connections_per_rail: tcp_cfg.connections_per_rail,
            timeout: Duration::from_millis(tcp_cfg.timeout_ms),
            connect_timeout: Duration::from_millis(tcp_cfg.connect_timeout_ms),
            max_inflight_bytes: tcp_cfg.max_inflight_bytes_per_connection,
            max_retries: tcp_cfg.max_retries,
            nice: NiceTable::new(tcp_cfg.bulk_thread_nice),
            membership: membership.clone(),
            keepalive: Duration::from_millis(tcp_cfg.keepalive_ms),
            slice_time: Duration::from_micros(tcp_cfg.slice_time_us),
            dispatch: config.workers.dispatch_config(),
            nontemporal_copies: tcp_cfg.nontemporal_copies,
        };
        let scheduler = Arc::new(RailScheduler::new(
            topology,
            &config.transports.rdma,
            &stats,
        ));
        let qos = Arc::new(Qos::new(&config.transports.rdma, scheduler.epoch())?);
        let timers = Arc::new(Timers::new(scheduler.epoch()));
        // Before any memory is registered: every region is registered with its devices.
        let rdma = Arc::new(RdmaTransport::start(
            &config,
            &registry,
            &stats,
            &qos,
            &timers,
            RdmaSettings {
                timeout: settings.timeout,
                connect_timeout: settings.connect_timeout,
                membership: membership.clone(),
                dispatch: config.rdma_dispatch_config(settings.max_retries),
            },
        ));
        let messaging = Arc::new(crate::messaging::Messaging::new(
            &config,
            registry.clone(),
            membership.clone(),
            rdma.message_verbs(),
        )?);
        let local = Arc::new(LocalSegment {
            name: OnceLock::new(),
            segment_name: metadata_cfg.segment_name.clone(),
            host_id: segment::local_host_id(),
            rails: rails.clone(),
            rdma: rdma.descriptors(),
            registry: registry.clone(),
            groups: Mutex::new(Vec::new()),
            members_only: membership.is_required(),
        });
        let served = local.clone();
        let server = Server::start(
            listen,
            registry,
            Arc::new(move || {
                serde_json::to_vec(&served.descriptor()).expect("descriptor serializes")
            }),
            messaging.clone(),
            rdma.clone(),
            ServerSettings {
                max_connections: tcp_cfg.max_connections,
                max_pending: tcp_cfg.max_pending_connections.min(tcp_cfg.max_connections),
                serve_threads: tcp_cfg.serve_threads,
                handshake_timeout: Duration::from_millis(tcp_cfg.connect_timeout_ms),
                keepalive: Duration::from_millis(tcp_cfg.keepalive_ms),
                timeout: Duration::from_millis(tcp_cfg.timeout_ms),
                membership: membership.clone(),
                nice: NiceTable::new(tcp_cfg.bulk_thread_nice),
                nontemporal_copies: tcp_cfg.nontemporal_copies,
            },
        )?;
        let name = format!(
            "{}:{}",
            advertised_host(&config, &listen, &rails),
            server.local_addr().port()
        );
        rdma.set_name(&name);
        let _ = local.name.set(name);

        let workers = &config.workers;
        let plan = |cap| {
            SlicePlan::new(workers.block_size, cap).map_err(|e| {
                Error::Config(crate::config::ConfigError::new("workers", e.to_string()))
            })
        };
        // Asked once: it reads the affinity mask and the cgroup's CPU quota.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let inner = Arc::new(Inner {
            metadata,
            direct,
            metadata_counters: metadata::MetadataCounters::default(),
            transfers: Arc::default(),
            publishes: metadata_cfg.kind != crate::config::MetadataKind::P2p,
            withdrawn: Mutex::new(false),
            shm: ShmTransport::new(
                workers.shm_copy_threads,
                config.transports.shm.process_vm,
                config.transports.shm.inline_bytes,
                config.transports.shm.nontemporal_copies,
                &stats,
                qos.clone(),
            )?,
            tcp: TcpTransport::new(
                settings,
                scheduler.clone(),
                qos.clone(),
                timers.clone(),
                stats.clone(),
            ),
            rdma,
            timers,
            qos,
            scheduler,
            plans: crate::transport::Plans {
                read: plan(workers.max_slices_per_request)?,
                write: plan(workers.max_slices_per_write)?,
            },
            local,
            peers: RwLock::new(Peers {
                by_id: HashMap::new(),
                by_name: HashMap::new(),
                next_id: 1,
            }),
            batches: Mutex::default(),
            next_batch: AtomicU64::new(1),
            prepared: Mutex::default(),
            next_prepared: AtomicU64::new(1),
            stats,
            // No floor: a wait for a transfer that outlasts the spin pays one wake-up in a
            // small share of its time, and may sleep at once.
            wait_spin: crate::spin::Spin::new(
                Duration::from_micros(workers.wait_spin_us.into()),
                Duration::ZERO,
                workers.adaptive_wait_spin,
            ),
            sleep_from_slices: if cpus <= crate::spin::FEW_CPUS {
                config.transports.tcp.connections_per_rail as u64 + 1
            } else {
                u64::MAX
            },
            pollers: crate::spin::PollBudget::for_cpus(cpus),
            fallback_logged: OnceLock::new(),
            server: Mutex::new(Some(server)),
            messaging,
            notifier: Mutex::new(None),
            config,
        });
        if let Some(t) = spawn_upkeep(Arc::downgrade(&inner)) {
            inner.qos.set_upkeep_thread(t.clone());
            inner.timers.set_thread(t);
        }
        if inner.config.lanes.dynamic {
            messages::spawn_lanes_driver(Arc::downgrade(&inner));
        }
        // Before publishing, so a segment this engine opens is followed from its first change.
        let weak = Arc::downgrade(&inner);
        inner
            .metadata
            .watch(Box::new(move |name: &str, descriptor| {
                if let Some(inner) = weak.upgrade() {
                    inner.on_segment_change(name, descriptor);
                }
            }));
        // Now that the engine has its name and serves its port, peers may look it up.
        inner.publish_descriptor();
        Ok(Engine {
            _caller: Some(Arc::new(CallerHold(Arc::downgrade(&inner)))),
            inner,
        })
    }

    /// A handle the engine's own threads take for the moment they work on it: it does not
    /// count as the caller's.
    fn momentary(inner: Arc<Inner>) -> Engine {
        Engine {
            _caller: None,
            inner,
        }
    }

    /// This engine's segment name, `host:port`.
    pub fn name(&self) -> String {
        self.inner.local.name.get().cloned().unwrap_or_default()
    }

    /// The name peers pass to [`Engine::open_segment`] to reach this engine: its
    /// `metadata.segment_name` when it has one, else [`Engine::name`].
    pub fn segment_name(&self) -> String {
        self.inner.local.published_name()
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// This engine's own descriptor, as peers receive it.
    pub fn local_descriptor(&self) -> SegmentDescriptor {
        self.inner.local.descriptor()
    }

    /// Allocates `len` bytes the engine owns, in a shared mapping same-host peers can map.
    /// Fails on `len` 0, a NUMA node that does not exist, or when the OS refuses memory.
    ///
    /// With a metadata store that keeps descriptors (`metadata.type: "http"`), the new
    /// descriptor is published before this returns; a failed publish is only logged.
    pub fn allocate(&self, len: usize, location: Location) -> Result<Buffer> {
        let buffer = self.inner.local.registry.allocate(len, location)?;
        self.inner.publish_descriptor();
        Ok(buffer)
    }

    /// Registers `len` bytes of the caller's memory at `ptr` for transfers. The memory must stay
    /// valid until `unregister`. Fails on a null pointer, `len` 0 or overlap with registered
    /// memory. Publishes the new descriptor as [`Engine::allocate`] does.
    pub fn register(&self, ptr: *mut u8, len: usize, location: Location) -> Result<Buffer> {
        let buffer = self.inner.local.registry.register(ptr, len, location)?;
        self.inner.publish_descriptor();
        Ok(buffer)
    }

    /// Stops serving the buffer that starts at `addr` (allocated or registered). Allocated
    /// memory is released once no `Buffer` handle or in-flight slice holds it. Fails when no
    /// buffer starts at `addr`. Publishes the new descriptor as [`Engine::allocate`] does.
    pub fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.local.registry.unregister(addr)?;
        self.inner.publish_descriptor();
        Ok(())
    }

    /// Same as `unregister(buffer.addr())`.
    pub fn free(&self, buffer: &Buffer) -> Result<()> {
        self.unregister(buffer.addr())
    }

    /// Opens segment `name`, fetching its descriptor from the metadata store: the segment itself
    /// by default (`name` is then `host:port`), the HTTP metadata server or etcd with
    /// `metadata.type` `"http"` or `"etcd"` (`name` is then what the segment published under:
    /// its `metadata.segment_name` or `host:port`; the descriptor says where to connect).
    /// Opening an already open segment returns the same id. Fails with `SegmentUnreachable`
    /// when nothing answers there, or the store does not know the segment or does not answer
    /// within `metadata.timeout_ms` (the reason names the store), and with `InvalidArgument`
    /// when `name` is empty or blank.
    pub fn open_segment(&self, name: &str) -> Result<SegmentId> {
        if name.trim().is_empty() {
            // Said here: a resolver's "segment  is unreachable" hides that nothing was named
            // (a target that failed to start printed no name for its caller to read).
            return Err(Error::invalid(
                "name",
                format!("the segment name is empty ({name:?}); want host:port or a published name"),
            ));
        }
        let existing = {
            let peers = self.inner.peers.read().expect("peers poisoned");
            peers
                .by_name
                .get(name)
                .and_then(|id| peers.by_id.get(id))
                .cloned()
        };
        if let Some(p) = existing {
            if !p.process_exited() {
                return Ok(SegmentId(p.id));
            }
        }
        let (addr, descriptor) = if self.inner.publishes {
            // A store says where the segment listens; its name need not be an address.
            let descriptor = self.lookup(name)?;
            (metadata::resolve(&descriptor.name)?, descriptor)
        } else {
            let addr = metadata::resolve(name)?;
            (addr, self.lookup(name)?)
        };
        let mut peers = self.inner.peers.write().expect("peers poisoned");
        let id = match peers.by_name.get(name) {
            Some(id) => *id,
            None => {
                let id = peers.next_id;
                peers.next_id += 1;
                id
            }
        };
        let peer = Arc::new(Peer::new(
            id,
            name.to_owned(),
            addr,
            descriptor,
            &self.inner.local.host_id,
        ));
        if !self.inner.publishes {
            // The descriptor came from the segment itself, after the handshake.
            peer.mark_membership_proven();
        }
        peers.by_id.insert(id, peer);
        peers.by_name.insert(name.to_owned(), id);
        Ok(SegmentId(id))
    }

    /// Fetches segment `name`'s descriptor from the store, counted.
    fn lookup(&self, name: &str) -> Result<SegmentDescriptor> {
        self.inner
            .metadata_counters
            .lookup(self.inner.metadata.fetch(name))
    }

    /// Fetches segment `name`'s current descriptor from the metadata store (control path).
    pub(crate) fn fetch_descriptor(&self, name: &str) -> Result<SegmentDescriptor> {
        self.lookup(name)
    }

    /// Publishes group `group` in this engine's descriptor. Fails when a group of that name
    /// is already joined.
    pub(crate) fn add_local_group(&self, group: segment::GroupDescriptor) -> Result<()> {
        {
            let mut groups = self.inner.local.groups.lock().expect("groups poisoned");
            if groups.iter().any(|g| g.name == group.name) {
                return Err(Error::GroupJoin {
                    group: group.name,
                    reason: "this engine has already joined a group of that name".into(),
                });
            }
            groups.push(group);
        }
        self.inner.publish_descriptor();
        Ok(())
    }

    /// Withdraws group `name` from this engine's descriptor.
    pub(crate) fn remove_local_group(&self, name: &str) {
        self.inner
            .local
            .groups
            .lock()
            .expect("groups poisoned")
            .retain(|g| g.name != name);
        self.inner.publish_descriptor();
    }

    /// Forgets an opened segment and closes this engine's connections to it (data, RDMA
    /// queue pairs, messages) and its shm mappings; requests still in flight to it fail.
    /// Fails for an unknown id.
    pub fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let peer = {
            let mut peers = self.inner.peers.write().expect("peers poisoned");
            let peer = peers
                .by_id
                .remove(&segment.0)
                .ok_or(Error::UnknownSegment(segment.0))?;
            peers.by_name.remove(&peer.name);
            peer
        };
        // Closing calls back into the peer (slices handed back): no engine lock held.
        let reason = "the segment was closed";
        self.inner.tcp.close_peer(peer.id, reason);
        self.inner.rdma.close_peer(peer.id, reason);
        self.inner.shm.forget_peer(peer.id);
        self.inner.messaging.forget_peer(peer.id);
        Ok(())
    }

    /// The cached descriptor of an opened segment.
    pub fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDescriptor> {
        Ok((*self.peer(segment)?.descriptor()).clone())
    }

    /// The messaging state (two-sided messages and notifications; see `crate::messaging`).
    pub(crate) fn messaging(&self) -> &Arc<crate::messaging::Messaging> {
        &self.inner.messaging
    }

    pub(crate) fn peer(&self, segment: SegmentId) -> Result<Arc<Peer>> {
        self.inner
            .peers
            .read()
            .expect("peers poisoned")
            .by_id
            .get(&segment.0)
            .cloned()
            .ok_or(Error::UnknownSegment(segment.0))
    }

    /// Creates a batch that holds up to `capacity` requests. Fails on capacity 0.
    pub fn allocate_batch(&self, capacity: usize) -> Result<BatchId> {
        if capacity == 0 {
            return Err(Error::invalid("capacity", "must be at least 1"));
        }
        let id = self.inner.next_batch.fetch_add(1, Ordering::Relaxed);
        self.inner.batches.lock().expect("batches poisoned").insert(
            id,
            Arc::new(Batch::with_counters(
                id,
                capacity,
                self.inner.transfers.clone(),
            )),
        );
        Ok(BatchId(id))
    }

    /// Frees a batch. Fails with `BatchBusy` while requests are in flight, `UnknownBatch` for a
    /// batch never allocated or already freed.
    pub fn free_batch(&self, batch: BatchId) -> Result<()> {
        let mut batches = self.inner.batches.lock().expect("batches poisoned");
        let b = batches.get(&batch.0).ok_or(Error::UnknownBatch(batch.0))?;
        if b.unfinished() > 0 {
            return Err(Error::BatchBusy(batch.0));
        }
        batches.remove(&batch.0);
        Ok(())
    }

    pub(crate) fn batch(&self, batch: BatchId) -> Result<Arc<Batch>> {
        self.inner
            .batches
            .lock()
            .expect("batches poisoned")
            .get(&batch.0)
            .cloned()
            .ok_or(Error::UnknownBatch(batch.0))
    }

    /// Checks every request, then starts them all. Nothing is started if any request is bad:
    /// the error names the first problem (length 0, source not registered,
    /// unknown segment, target outside the segment's buffers, a full batch, an unreachable
    /// peer).
    pub fn submit(&self, batch: BatchId, requests: &[Request]) -> Result<()> {
        let b = self.batch(batch)?;
        let mut routed = RoutedBatch::with_capacity(requests.len());
        let mut memo = RouteMemo::default();
        for (i, r) in requests.iter().enumerate() {
            self.route(r, &mut memo, &mut routed)
                .map_err(|e| annotate(e, i, requests.len()))?;
        }
        self.post_all(&b, &routed)
    }

    /// Hands validated requests to their transports, every transport's share in one call (so
    /// shm resolves a peer's buffer once and queues a batch's copies under one lock, with one
    /// wake-up). Runs of requests that follow one another in memory on both sides go as one
    /// (`workers.merge_adjacent_max_bytes`; see [`merge`]), under one task that every request
    /// of the run reports. Fails with `BatchFull`, posting nothing, when the requests do not
    /// fit in the batch.
    fn post_all(&self, b: &Batch, routed: &RoutedBatch) -> Result<()> {
        let requests = &routed.requests;
        let spans: Vec<merge::Span> = requests
            .iter()
            .map(|r| merge::Span {
                local: r.request.source,
                remote: r.request.target_offset,
                len: r.request.length,
            })
            .collect();
        let registry = &self.inner.local.registry;
        let mut region: Option<Arc<crate::memory::Region>> = None;
        let runs = merge::runs(
            &spans,
            self.inner.config.workers.merge_adjacent_max_bytes,
            |i| {
                let (a, b) = (&requests[i - 1], &requests[i]);
                routed.same_target(a, b)
                    && a.route == b.route
                    && a.location == b.location
                    && a.request.opcode == b.request.opcode
                    && a.request.priority == b.request.priority
            },
            // An rdma rail registers each region on its own: a run's local bytes stay in one.
            |start, len| {
                if !region.as_ref().is_some_and(|r| r.contains(start, 1)) {
                    region = registry.find(start, 1);
                }
                region.as_ref().is_some_and(|r| r.contains(start, len))
            },
        );
        let sizes: Vec<u32> = runs.iter().map(|run| run.len() as u32).collect();
        let tasks = b.add_runs(&sizes)?;
        let mut shares: [Vec<(Arc<Peer>, Prepared)>; 3] = Default::default();
        for (run, task) in runs.into_iter().zip(&tasks) {
            let first = &requests[run.start];
            let len = spans[run].iter().map(|s| s.len).sum();
            let r = &first.request;
            shares[first.route as usize].push((
                routed.peer_of(first).clone(),
                Prepared {
                    op: r.opcode,
                    local: r.source as usize,
                    remote: r.target_offset,
                    len,
                    location: first.location,
                    priority: r.priority,
                    buffer: routed.buffer_of(first).clone(),
                    batch: b.id,
                    task: task.clone(),
                },
            ));
        }
        for (route, share) in Route::ALL.into_iter().zip(shares) {
            if !share.is_empty() {
                self.transport(route).post(share, &self.inner.plans);
            }
        }
        // Drop the part each task was created with, now that every slice holds its own.
        for task in tasks {
            task.part_done(Ok(()));
        }
        Ok(())
    }

    /// Status of request `index` of `batch`, in submission order; fails with `UnknownBatch`
    /// for a batch this engine does not hold and `InvalidArgument` for an index past its
    /// requests. While the request is pending, the calling thread first does the batch's next
    /// same-host copy when it is the one the copy workers would take next, as
    /// [`Engine::overall_status`] does: a thread polling each request of its batch in turn (as
    /// Mooncake's `getTransferStatus` loop does) moves the batch on instead of spinning.
    pub fn status(&self, batch: BatchId, index: usize) -> Result<Status> {
        let b = self.batch(batch)?;
        let status = b.status(index)?;
        if matches!(status, Status::Pending) && self.inner.shm.help_once(batch.0) {
            return b.status(index);
        }
        Ok(status)
    }

    /// `Failed` if any request of the batch failed, else `Pending` while any runs, else
    /// `Completed`; fails with `UnknownBatch` for a batch this engine does not hold. When
    /// the next same-host copy the copy workers would take is one of the batch's, the calling
    /// thread does it first (at most 1 MiB, or one group of small requests): a thread that
    /// polls its batch, as NIXL's `check_xfer_state` does, moves it on instead of spinning on
    /// a core the workers need.
    pub fn overall_status(&self, batch: BatchId) -> Result<Status> {
        let b = self.batch(batch)?;
        if b.unfinished() > 0 {
            self.inner.shm.help_once(batch.0);
        }
        Ok(b.overall_status())
    }

    /// Blocks until every request of the batch finished or `timeout` passed (`None`: no
    /// limit). Returns the first failure, or `WaitTimeout`. Same-host copies of the batch that
    /// no copy worker has started yet are done by the calling thread. While no bulk (MEDIUM or
    /// LOW) bytes move, in this engine or another sharing its slots, and (on a host of at most
    /// four CPUs) the batch has at most as many slices as a tcp path has connections or is
    /// expected to end within 100 µs (its bytes over its peers' estimated rates), polls before
    /// sleeping: up to `workers.wait_spin_us`, less the more of the recent waits outlasted that
    /// (`workers.adaptive_wait_spin`). Of the threads waiting for network transfers, at most
    /// half the host's CPUs (at least one) poll at once, and none starts polling while more
    /// than that many wait; the others sleep at once.
    pub fn wait(&self, id: BatchId, timeout: Option<Duration>) -> Result<()> {
        let batch = self.batch(id)?;
        // Copies of this batch still queued for the shm workers are done here rather than
        // waited for: on a host with few cores a waiting thread would take a core from them.
        let until = timeout.and_then(|t| Instant::now().checked_add(t));
        self.inner.shm.help(id.0, until, || batch.unfinished() == 0);
        let timeout = until.map(|until| until.saturating_duration_since(Instant::now()));
        if self.inner.qos.bulk_moving(Instant::now()) {
            // Beside bulk every wake-up waits for a core: a lone small HIGH request's waiter
            // reads its answer itself rather than be woken by the thread that would read it.
            if let Some((task, source)) = batch.direct_answer() {
                source.read_until_finished(&task, until, false);
            }
            let timeout = until.map(|until| until.saturating_duration_since(Instant::now()));
            return batch.wait(timeout, Duration::ZERO);
        }
        if self.sleeps_at_once(&batch) {
            return batch.wait(timeout, Duration::ZERO);
        }
        // A wait for network transfers polls only within the poll budget: their slices
        // finish on the engine's threads, which need the cores. Same-host copies finish
        // mostly on this thread (above) and keep polling.
        let waiting = (batch.expected().1 > 0).then(|| self.inner.pollers.enter());
        if waiting.as_ref().is_some_and(|w| !w.polls()) {
            return batch.wait(timeout, Duration::ZERO);
        }
        let started = Instant::now();
        let mut spin = self.inner.wait_spin.current();
        if let Some((task, source)) = batch.direct_answer().filter(|_| !spin.is_zero()) {
            // Polling the socket itself, the waiter sees its answer as it lands, without
            // waiting for the reader thread to wake (on an idle core, tens of µs on a VM).
            let spin_until = started + spin;
            let stop = until.map_or(spin_until, |u| u.min(spin_until));
            source.read_until_finished(&task, Some(stop), true);
            spin = spin.saturating_sub(started.elapsed());
        }
        let timeout = until.map(|until| until.saturating_duration_since(Instant::now()));
        let outcome = batch.wait(timeout, spin);
        let ended = !matches!(outcome, Err(Error::WaitTimeout { .. }));
        self.inner.wait_spin.learn(started.elapsed(), ended);
        outcome
    }

    /// Whether a wait for `batch` should sleep at once rather than poll: on a host of few
    /// CPUs, a batch of more slices than a tcp path has connections (whose threads then run
    /// for the whole batch) that is expected to outlast
    /// [`crate::spin::SLEEP_WHEN_EXPECTED_OVER`].
    fn sleeps_at_once(&self, batch: &Batch) -> bool {
        let (time, slices) = batch.expected();
        slices >= self.inner.sleep_from_slices && time > crate::spin::SLEEP_WHEN_EXPECTED_OVER
    }

    /// Stops serving: withdraws the descriptor from the metadata store (if it keeps them),
    /// closes the control port and every connection. Later calls still work on local state but
    /// peers can no longer reach or look up this engine. Threads waiting in [`Engine::recv`] or
    /// [`Engine::wait_notifications`] return at once, with what had arrived or with nothing
    /// (`Ok(None)`, no notifications), whatever their timeout.
    pub fn shutdown(&self) {
        self.inner.withdraw_descriptor();
        self.inner.server.lock().expect("server poisoned").take();
        self.inner.tcp.shutdown("engine shut down");
        self.inner.rdma.shutdown("engine shut down");
        self.inner.messaging.close_all();
    }

    /// Whether [`Engine::shutdown`] was called (on this handle or a clone): nothing can arrive
    /// any more, so a binding that waits in slices stops waiting.
    pub fn is_shut_down(&self) -> bool {
        self.inner.messaging.is_closed()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle is gone: lookups must stop finding this engine.
        self.withdraw_descriptor();
    }
}

/// The thread that keeps the engine's timer table ([`crate::upkeep`]): runs each peer's
/// dispatcher when its deadline comes, the link check every [`LINK_CHECK`], and, while a global
/// QoS slot holds queued slices back, a pump when the next slot that admits them begins (nothing
/// else may happen then). Sleeps until the earliest; arming an earlier deadline wakes it. Runs
/// until the engine is dropped. Returns the thread, or `None` (logged) when it cannot be spawned.
fn spawn_upkeep(inner: Weak<Inner>) -> Option<thread::Thread> {
    let spawned = thread::Builder::new()
        .name("mr-timers".into())
        .spawn(move || {
            let mut due = Vec::new();
            if let Some(i) = inner.upgrade() {
                i.timers
                    .arm(TimerKey::Links, i.timers.ns(Instant::now() + LINK_CHECK));
            }
            loop {
                let wait = {
                    let Some(inner) = inner.upgrade() else { return };
                    let now = Instant::now();
                    let timer = inner.timers.until_next(now).unwrap_or(LINK_CHECK);
                    inner.qos.slot_wait().map_or(timer, |w| w.min(timer))
                };
                // Parked rather than asleep: an earlier deadline, or a slot starting to hold
                // work back, wakes us at once.
                thread::park_timeout(wait);
                let Some(inner) = inner.upgrade() else { return };
                let now = Instant::now();
                due.clear();
                inner.timers.expire(now, &mut due);
                for key in &due {
                    match *key {
                        TimerKey::Peer(id) => inner.tcp.on_timer(id, now),
                        TimerKey::RdmaPeer(id) => inner.rdma.on_timer(id, now),
                        TimerKey::Links => {
                            inner.tcp.check_links();
                            inner.rdma.check_links();
                            inner
                                .timers
                                .arm(TimerKey::Links, inner.timers.ns(now + LINK_CHECK));
                        }
                    }
                }
                // A slot that admits held-back slices may have begun: deal them. A pump takes
                // each peer's lock, which a HIGH submitter may be waiting for, so only when
                // something waits.
                if inner.qos.anything_queued() {
                    inner.tcp.pump_all();
                    inner.rdma.pump_all();
                }
            }
        });
    match spawned {
        Ok(h) => Some(h.thread().clone()),
        Err(e) => {
            tracing::error!(error = %e, "cannot spawn the upkeep thread: no timeouts or probes");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Location, TransportChoice};

    const LEN: usize = 64 << 10;

    fn write(
        peer: &Engine,
        transport: TransportChoice,
        seg: SegmentId,
        source: u64,
        target: u64,
    ) -> Result<()> {
        let batch = peer.allocate_batch(1)?;
        let request = Request {
            transport: Some(transport),
            ..Request::write(source, seg, target, 4096)
        };
        peer.submit(batch, &[request])?;
        let out = peer.wait(batch, Some(Duration::from_secs(30)));
        peer.free_batch(batch)?;
        out
    }

    /// The engine's own threads hold it for a moment now and then (a timer, a notification, a
    /// metrics scrape); the caller dropping its last handle in such a moment must still stop
    /// peers writing its buffers at once, as it may free the memory it registered next.
    #[test]
    fn the_callers_last_handle_closes_the_buffers_while_an_engine_thread_holds_the_engine() {
        let owner = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
        let peer = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
        let mut memory = vec![0u8; LEN];
        let registered = owner
            .register(memory.as_mut_ptr(), LEN, Location::Any)
            .unwrap();
        let allocated = owner.allocate(LEN, Location::Any).unwrap();
        let src = peer.allocate(LEN, Location::Any).unwrap();
        let seg = peer.open_segment(&owner.name()).unwrap();
        for transport in [TransportChoice::Shm, TransportChoice::Tcp] {
            for target in [registered.addr(), allocated.addr()] {
                write(&peer, transport, seg, src.addr(), target).unwrap();
            }
        }
        let engine_thread = Engine::momentary(owner.inner.clone());
        drop(owner);
        for transport in [TransportChoice::Shm, TransportChoice::Tcp] {
            for target in [registered.addr(), allocated.addr()] {
                match write(&peer, transport, seg, src.addr(), target) {
                    Err(Error::RemoteRejected { reason, .. })
                        if reason.contains("no buffer at that address") => {}
                    Err(Error::TargetOutOfRange { .. } | Error::SegmentUnreachable { .. }) => {}
                    other => panic!(
                        "{transport:?} write at {target:#x} after the caller let go: {other:?}"
                    ),
                }
            }
        }
        drop(engine_thread);
        drop(registered);
    }
}
