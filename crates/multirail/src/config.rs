//! Engine configuration: one JSON document, TENT's keys plus multirail's own.
//!
//! `transports.rdma.*` carries TENT's scheduling and QoS keys unchanged so a TENT
//! configuration file works as is; they apply to every transport that carries rails
//! (TCP too). multirail's own keys sit beside them: `rails`, `metadata`, `workers`,
//! `transports.tcp`, `transports.shm`, `transport`, `local_hostname`.
//!
//! Every problem is reported as a [`ConfigError`] naming the offending key by its full
//! dotted path (`transports.rdma.numa_penalties[1]`, `rails[0].address`), because a
//! message that only says "invalid value" sends the operator hunting through the file.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::Path;

use multirail_policy::dispatch;
use serde::{Deserialize, Serialize};

/// Environment variable holding either a path to a configuration file or inline JSON.
pub const CONF_ENV_VAR: &str = "MULTIRAIL_CONF";

/// Largest accepted `workers.block_size`: bigger slices defeat spraying across rails
/// and make a single slice hold a connection for too long.
pub const MAX_BLOCK_SIZE: u64 = 64 * 1024 * 1024;

/// Upper bound for thread and connection counts; beyond this the 2-core test hosts and
/// most real hosts only thrash.
const MAX_THREADS_OR_CONNECTIONS: usize = 64;

/// Upper bound for `workers.wait_spin_us`: polling longer than this burns a core for requests
/// that sleeping would serve as well.
const MAX_WAIT_SPIN_US: u32 = 10_000;

/// A configuration problem: which key is wrong and what is wrong with it.
///
/// `key` is the full dotted path of the offending key (`transports.tcp.timeout_ms`,
/// `rails[1].address`). It is empty for whole-document problems (unreadable file, JSON
/// syntax error, a document that is not an object); then `message` starts with the
/// origin (a file path or `MULTIRAIL_CONF`) and the display is `config: <message>`.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[error("{}", display_config_error(.key, .message))]
pub struct ConfigError {
    /// Full dotted path of the offending key; empty for whole-document errors.
    pub key: String,
    /// What is wrong, e.g. `must be within [0, 1], got 1.5` or `unknown key`.
    pub message: String,
}

impl ConfigError {
    /// Build an error about one key.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

fn display_config_error(key: &str, message: &str) -> String {
    if key.is_empty() {
        format!("config: {message}")
    } else {
        format!("config key {key}: {message}")
    }
}

/// Which transport carries every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportChoice {
    /// Shared memory when the peer is on the same host, else TCP.
    #[default]
    Auto,
    /// Always TCP, even to a peer on the same host.
    Tcp,
    /// Always shared memory; only same-host peers are reachable.
    Shm,
}

impl TransportChoice {
    /// The JSON spelling of this choice (`"auto"`, `"tcp"`, `"shm"`).
    pub fn as_str(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Shm => "shm",
        }
    }
}

impl fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The whole engine configuration. `{}` yields [`Config::default`]; any key may be left out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Host name or address this engine puts in its segment name `host:port`; None = first
    /// non-loopback IPv4 address of the host, else 127.0.0.1.
    pub local_hostname: Option<String>,
    /// Force a transport for every request: "auto" (shm on the same host, else tcp), "tcp", "shm".
    pub transport: TransportChoice,
    /// Slicing and worker-thread settings.
    pub workers: WorkersConfig,
    /// Rails (NICs) to spray over; empty = discover them from sysfs.
    pub rails: Vec<RailConfig>,
    /// Tier overrides: memory location (`"cpu:N"` or `"*"`) → rail name → tier (0, 1 or 2).
    /// Rails a location does not list keep the tier NUMA distance gives them.
    pub tiers: BTreeMap<String, BTreeMap<String, u8>>,
    /// Where segment descriptors are published.
    pub metadata: MetadataConfig,
    /// Per-transport settings; `rdma` holds TENT's scheduling keys.
    pub transports: TransportsConfig,
    /// Who may connect: the cluster's membership token.
    pub auth: AuthConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            local_hostname: None,
            transport: TransportChoice::Auto,
            workers: WorkersConfig::default(),
            rails: Vec::new(),
            tiers: BTreeMap::new(),
            metadata: MetadataConfig::default(),
            transports: TransportsConfig::default(),
            auth: AuthConfig::default(),
        }
    }
}

/// Environment variable holding the membership token when `auth.token` is not set.
pub const TOKEN_ENV_VAR: &str = "MULTIRAIL_TOKEN";

/// What `multirail config show` prints instead of a token.
pub const REDACTED: &str = "<redacted>";

/// A secret string: shown as [`REDACTED`] by `Debug` and when serialized, so it never reaches
/// a log, `config show` or a descriptor.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }

    /// The secret itself, for the code that must use it (the handshake).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

/// Membership: when a token is set (here or in `MULTIRAIL_TOKEN`), every connection opens with
/// a challenge-response over it (HMAC-SHA256 over nonces), and only engines holding the same
/// token are served descriptors, keys, slices or messages. Off by default.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The shared token (at least 16 bytes); null = `MULTIRAIL_TOKEN`, else no membership check.
    pub token: Option<Secret>,
}

/// Shortest accepted token: a short one can be guessed offline from one recorded handshake.
pub const MIN_TOKEN_LEN: usize = 16;

impl AuthConfig {
    /// The token in force: `auth.token`, else `MULTIRAIL_TOKEN` (empty counts as unset). Fails
    /// naming the key when the token is too short or is the placeholder `config show` prints.
    pub fn effective_token(&self) -> Result<Option<Secret>, ConfigError> {
        let (token, key) = match &self.token {
            Some(t) => (t.clone(), "auth.token"),
            None => match std::env::var(TOKEN_ENV_VAR) {
                Ok(t) if !t.is_empty() => (Secret(t), TOKEN_ENV_VAR),
                _ => return Ok(None),
            },
        };
        check_token(key, token.expose())?;
        Ok(Some(token))
    }
}

fn check_token(key: &str, token: &str) -> Result<(), ConfigError> {
    if token == REDACTED {
        return Err(ConfigError::new(
            key,
            "is the placeholder `config show` prints; give the real token",
        ));
    }
    if token.len() < MIN_TOKEN_LEN {
        return Err(ConfigError::new(
            key,
            format!(
                "must be at least {MIN_TOKEN_LEN} bytes, got {} (the token itself is not shown)",
                token.len()
            ),
        ));
    }
    Ok(())
}

/// How requests are cut into slices and how many threads copy them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkersConfig {
    /// Slice size in bytes (default 65536); must be > 0 and <= 64 MiB.
    pub block_size: u64,
    /// Most slices one request is cut into (default 64); must be >= 1.
    pub max_slices_per_request: u32,
    /// Most slices one WRITE request is cut into (default 32); must be >= 1.
    pub max_slices_per_write: u32,
    /// Threads copying for the shared-memory transport (default 2); 1..=64.
    pub shm_copy_threads: usize,
    /// Microseconds `wait` polls for completion before it sleeps, while the engine moves no
    /// MEDIUM or LOW bytes (default 100; 0 = always sleep at once; at most 10000). Waking a
    /// sleeping thread, on an idle core of a virtual machine above all, can take longer than a
    /// 64 KiB transfer; with bulk moving the cores are busy and a poller would slow it.
    pub wait_spin_us: u32,
    /// How much each path to a peer keeps in flight, on every transport that carries rails.
    pub window: WindowConfig,
    /// Most microseconds of a rail's bandwidth one bulk slice carries while HIGH work is
    /// active (default 250; 1..=1000000): a bulk slice on the wire cannot be passed, so this
    /// bounds what a HIGH slice waits behind on a slow rail. Fast rails carry whole slices.
    pub bulk_chunk_wait_us: u64,
    /// Bulk slices are not cut below this many bytes beside HIGH work (default 16384;
    /// 4096..=64 MiB): smaller ones cost more per byte than the wait they save.
    pub min_bulk_chunk: u64,
}

impl Default for WorkersConfig {
    fn default() -> Self {
        WorkersConfig {
            block_size: 65536,
            max_slices_per_request: 64,
            max_slices_per_write: 32,
            shm_copy_threads: 2,
            wait_spin_us: 100,
            window: WindowConfig::default(),
            bulk_chunk_wait_us: dispatch::DEFAULT_HIGH_WAIT_NS / 1000,
            min_bulk_chunk: dispatch::DEFAULT_MIN_BULK_CHUNK,
        }
    }
}

impl WorkersConfig {
    /// The dispatcher settings these keys give (window controller, bulk chunking beside HIGH);
    /// the transport fills in its timeout, retries and promotion.
    pub fn dispatch_config(&self) -> dispatch::DispatchConfig {
        dispatch::DispatchConfig {
            controller: self.window.controller(),
            high_wait_ns: self.bulk_chunk_wait_us.saturating_mul(1000),
            min_bulk_chunk: self.min_bulk_chunk,
            ..dispatch::DispatchConfig::default()
        }
    }
}

/// Which window controller sizes what a path keeps in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WindowControllerKind {
    /// A few bandwidth-delay products (the rail's EWMA bandwidth times the path's smallest
    /// round trip), capped at `max_queue_us` of the bandwidth.
    #[default]
    Bdp,
    /// `fixed_bytes` whatever the path measures.
    Fixed,
}

/// The window controller and its settings (`workers.window`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WindowConfig {
    /// `bdp` (default) or `fixed`.
    pub controller: WindowControllerKind,
    /// Bandwidth-delay products of a full window (default 8; 0.5..=64). On a CPU-bound link
    /// such as loopback the smallest round trip understates what keeps the pipe full.
    pub bdps: f64,
    /// Bandwidth-delay products bulk keeps in flight beside HIGH work (default 1; 0.1..=bdps).
    pub lean_bdps: f64,
    /// Most microseconds of the rail's bandwidth a window holds (default 1000; 1..=1000000),
    /// so a slow rail's queue never holds more than that for a HIGH slice to wait behind.
    pub max_queue_us: u64,
    /// Window before a path has measured a round trip, bytes (default 1 MiB; 4096..=1 GiB).
    pub initial_bytes: u64,
    /// The window of the `fixed` controller, bytes (default 4 MiB; 4096..=1 GiB).
    pub fixed_bytes: u64,
}

impl Default for WindowConfig {
    fn default() -> Self {
        let bdp = dispatch::BdpController::default();
        WindowConfig {
            controller: WindowControllerKind::Bdp,
            bdps: bdp.window_bdps,
            lean_bdps: bdp.lean_bdps,
            max_queue_us: bdp.max_queue_ns / 1000,
            initial_bytes: bdp.initial_window,
            fixed_bytes: 4 << 20,
        }
    }
}

impl WindowConfig {
    /// The controller these settings describe.
    pub fn controller(&self) -> dispatch::ControllerKind {
        match self.controller {
            WindowControllerKind::Bdp => dispatch::ControllerKind::Bdp(dispatch::BdpController {
                initial_window: self.initial_bytes,
                window_bdps: self.bdps,
                lean_bdps: self.lean_bdps,
                max_queue_ns: self.max_queue_us.saturating_mul(1000),
            }),
            WindowControllerKind::Fixed => {
                dispatch::ControllerKind::Fixed(dispatch::FixedController {
                    bytes: self.fixed_bytes,
                })
            }
        }
    }

    fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        let bad = |key: &str, msg: String| Err(ConfigError::new(format!("{prefix}.{key}"), msg));
        if !(0.5..=64.0).contains(&self.bdps) {
            return bad(
                "bdps",
                format!("must be within 0.5..=64, got {}", self.bdps),
            );
        }
        if !(0.1..=self.bdps).contains(&self.lean_bdps) {
            return bad(
                "lean_bdps",
                format!(
                    "must be within 0.1..=bdps ({}), got {}",
                    self.bdps, self.lean_bdps
                ),
            );
        }
        if !(1..=1_000_000).contains(&self.max_queue_us) {
            return bad(
                "max_queue_us",
                format!("must be within 1..=1000000, got {}", self.max_queue_us),
            );
        }
        for (key, v) in [
            ("initial_bytes", self.initial_bytes),
            ("fixed_bytes", self.fixed_bytes),
        ] {
            if !(4096..=1 << 30).contains(&v) {
                return bad(key, format!("must be within 4096..=1073741824, got {v}"));
            }
        }
        Ok(())
    }
}

/// One rail given by hand instead of discovered from sysfs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RailConfig {
    /// Rail name as shown in statistics (e.g. the interface name); must be non-empty and unique.
    pub name: String,
    /// Local IP address the rail's sockets bind to; must parse as an IPv4 or IPv6 address.
    pub address: String,
    /// NUMA node of the NIC; -1 = unknown (default).
    pub numa_node: i32,
    /// Theoretical bandwidth in Gbit/s; None = from sysfs or `default_bandwidth_gbps`. > 0 if given.
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

/// Kind of metadata service used to find peers' segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetadataKind {
    /// Peers exchange descriptors directly; a segment name `host:port` is enough to connect.
    #[default]
    P2p,
}

/// Metadata service settings.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetadataConfig {
    /// JSON key `type`; only `"p2p"` for now.
    #[serde(rename = "type")]
    pub kind: MetadataKind,
}

/// Per-transport settings.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportsConfig {
    /// TENT's scheduling and QoS keys; they apply to every rail-carrying transport.
    pub rdma: RdmaConfig,
    /// TCP transport settings.
    pub tcp: TcpConfig,
    /// Shared-memory transport settings.
    pub shm: ShmConfig,
}

/// TENT's keys; they apply to every transport that carries rails (TCP too) so a TENT file works unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RdmaConfig {
    /// EWMA-based rail selection (true) or round-robin within the best NUMA tier (false).
    pub enable_smart_scheduling: bool,
    /// Score multiplier per NUMA tier (tier 0 = local); each finite and >= 0, at least one.
    pub numa_penalties: Vec<f64>,
    /// EWMA weight of the old estimate, within [0, 1]: 0 = take each observation, 1 = never learn.
    pub bandwidth_learning_rate: f64,
    /// Lower clamp of the EWMA estimate as a fraction of theoretical bandwidth; > 0.
    pub ewma_min_bandwidth_multiplier: f64,
    /// Upper clamp of the EWMA estimate as a multiple of theoretical bandwidth; >= the min multiplier.
    pub ewma_max_bandwidth_multiplier: f64,
    /// Random jitter added to scores so ties do not always pick the same rail; >= 0.
    pub score_jitter_range: f64,
    /// Guards score divisions against zero; > 0.
    pub score_epsilon: f64,
    /// Bandwidth assumed when the NIC's is unknown or out of [min, max]; > 0.
    pub default_bandwidth_gbps: f64,
    /// Smallest plausible NIC bandwidth; > 0.
    pub min_bandwidth_gbps: f64,
    /// Largest plausible NIC bandwidth; >= `min_bandwidth_gbps`.
    pub max_bandwidth_gbps: f64,
    /// Filter rails by request priority.
    pub enable_priority_filtering: bool,
    /// Local device priority rotation interval in microseconds; >= 1.
    pub local_rotation_interval_us: u64,
    /// Wait after which a queued request is promoted one priority level, in microseconds; >= 1.
    pub priority_promotion_timeout_us: u64,
    /// How often promotion is checked, in microseconds; >= 1.
    pub priority_promotion_check_us: u64,
    /// Global QoS slot length in milliseconds; >= 1.
    pub slot_rotation_interval_ms: u64,
    /// Shared-memory name for cross-process slot coordination; "" = single-process mode.
    pub shared_quota_shm_path: String,
    /// Let lower priorities use a slot that the allowed priorities leave idle.
    pub qos_work_conserving: bool,
    /// multirail's own: promote a waiting request only when its priority level has not been
    /// served for `priority_promotion_timeout_us` (it is starved), not merely because it waits
    /// behind its own level's backlog (default true; false = TENT's plain timeout).
    pub qos_promote_only_when_starved: bool,
    /// multirail's own: busy time, in microseconds, a rail's bandwidth sample must span before
    /// the EWMA learns from it (default 1000; 0 = every slice is a sample, as TENT does).
    pub bandwidth_sample_min_us: u64,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            enable_smart_scheduling: true,
            numa_penalties: vec![1.0, 5.0, 10.0],
            bandwidth_learning_rate: 0.01,
            ewma_min_bandwidth_multiplier: 0.1,
            ewma_max_bandwidth_multiplier: 10.0,
            score_jitter_range: 1e-9,
            score_epsilon: 1e-12,
            default_bandwidth_gbps: 400.0,
            min_bandwidth_gbps: 10.0,
            max_bandwidth_gbps: 800.0,
            enable_priority_filtering: true,
            local_rotation_interval_us: 200,
            priority_promotion_timeout_us: 10000,
            priority_promotion_check_us: 1000,
            slot_rotation_interval_ms: 2,
            shared_quota_shm_path: String::new(),
            qos_work_conserving: true,
            qos_promote_only_when_starved: true,
            bandwidth_sample_min_us: 1000,
        }
    }
}

/// Keys of [`RdmaConfig`]; used to point a misplaced TENT fragment at `transports.rdma`.
const RDMA_KEYS: &[&str] = &[
    "enable_smart_scheduling",
    "numa_penalties",
    "bandwidth_learning_rate",
    "ewma_min_bandwidth_multiplier",
    "ewma_max_bandwidth_multiplier",
    "score_jitter_range",
    "score_epsilon",
    "default_bandwidth_gbps",
    "min_bandwidth_gbps",
    "max_bandwidth_gbps",
    "enable_priority_filtering",
    "local_rotation_interval_us",
    "priority_promotion_timeout_us",
    "priority_promotion_check_us",
    "slot_rotation_interval_ms",
    "shared_quota_shm_path",
    "qos_work_conserving",
    "qos_promote_only_when_starved",
    "bandwidth_sample_min_us",
];

/// TCP transport settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TcpConfig {
    /// Connections opened per (local rail, remote rail) pair to each peer (default 2); 1..=64.
    pub connections_per_rail: usize,
    /// How long a peer may answer nothing, on any rail, while requests to it are outstanding
    /// (queued or in flight), in milliseconds (default 5000); >= 1. Counted from the later of
    /// its last answer and the moment the outstanding work began; once past, every one of
    /// those requests fails with `Error::Timeout` (the engine's timer fires at the deadline), whatever
    /// `max_retries` says, and the peer's connections are closed. A single rail whose oldest
    /// slice waits half of this while another rail answers or stands idle is dropped and its
    /// slices retried on the others (at most `max_retries` times, and only until the peer's own
    /// deadline). Also the kernel's `TCP_USER_TIMEOUT` on data connections.
    pub timeout_ms: u64,
    /// Connection attempt timeout in milliseconds (default 3000); >= 1.
    pub connect_timeout_ms: u64,
    /// Retries of a failed slice, possibly on another rail, before the request fails (default 8).
    pub max_retries: u32,
    /// Bytes in flight on one connection before the sender waits (default 64 MiB); > 0.
    pub max_inflight_bytes_per_connection: u64,
    /// Nice value, above their own, at which the threads carrying LOW slices run, on both ends
    /// (MEDIUM: half of it; HIGH: their own, with a short scheduler slice), so HIGH slices'
    /// threads win cores that bulk keeps busy; 0..=19, default 0 (off: with bulk already held
    /// to one bandwidth-delay product beside HIGH, it did not lower HIGH's p99 on a 2-core host
    /// and cost bulk a quarter of its throughput).
    pub bulk_thread_nice: i32,
    /// Most connections the listening port holds at once, of every kind, handshaken or not
    /// (default 4096); 1..=1048576. A connection past it is closed at once: every connection
    /// costs an fd and a little memory, and a peer that opens them without end must not take
    /// the engine's last fd.
    pub max_connections: usize,
    /// Most connections that have not finished the handshake (default 256, and never more
    /// than max_connections); 1..=1048576.
    /// Past it the oldest such connection is closed to make room: a member finishes its
    /// handshake within one round trip, so what lingers unproven is a stranger.
    pub max_pending_connections: usize,
    /// Threads that serve every accepted connection, however many there are (default 4);
    /// 1..=64. Idle connections cost no thread.
    pub serve_threads: usize,
    /// A connection idle this long is probed by TCP keepalive, on both ends (default 15000;
    /// at least 1). A peer that does not answer within `timeout_ms` is dropped: without it, a peer
    /// that vanished while its link was down (its FIN lost) would hold an fd here forever.
    /// Live idle connections answer the probes and stay open.
    pub keepalive_ms: u64,
    /// Receive path of two-sided messages over TCP.
    pub receive: ReceiveConfig,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections_per_rail: 2,
            timeout_ms: 5000,
            connect_timeout_ms: 3000,
            max_retries: 8,
            max_inflight_bytes_per_connection: 64 * 1024 * 1024,
            bulk_thread_nice: 0,
            max_connections: 4096,
            max_pending_connections: 256,
            serve_threads: 4,
            keepalive_ms: 15000,
            receive: ReceiveConfig::default(),
        }
    }
}

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
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            enable: true,
            process_vm: true,
            receive: ReceiveConfig::default(),
        }
    }
}

/// When a consumed receive buffer is posted again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReturnPolicy {
    /// As soon as its message is consumed (default).
    #[default]
    Individual,
    /// All together, once no posted buffer is left.
    Bulk,
}

/// Whether a responder returns a request's buffer before or after sending its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReturnOrder {
    /// Return, then answer (default).
    #[default]
    BeforeReply,
    /// Answer, then return.
    AfterReply,
}

/// Receive path of two-sided messages (`transports.<tcp|shm>.receive`), the knobs of seed 003.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReceiveConfig {
    /// Receive buffers posted per connection, or in the shared pool (default 64); 1..=1048576.
    pub queue_depth: usize,
    /// One pool shared by every connection of the engine (an SRQ) instead of one per connection.
    pub shared_receive_queue: bool,
    /// The pool is allocated and registered as this many chunks of queue_depth / chunks buffers
    /// (default 1); must divide queue_depth.
    pub registration_chunks: usize,
    /// Most scatter/gather entries a receive may use (default 1); 1..=32.
    pub max_sge: usize,
    /// Bytes per receive buffer, the largest message (default 8192); 1..=64 MiB.
    pub buffer_size: usize,
    /// `individual` (default) or `bulk`.
    pub return_policy: ReturnPolicy,
    /// `before_reply` (default) or `after_reply`.
    pub return_order: ReturnOrder,
}

impl Default for ReceiveConfig {
    fn default() -> Self {
        let d = multirail_policy::receive::ReceiveSettings::default();
        ReceiveConfig {
            queue_depth: d.queue_depth,
            shared_receive_queue: d.shared_receive_queue,
            registration_chunks: d.registration_chunks,
            max_sge: d.max_sge,
            buffer_size: d.buffer_size,
            return_policy: ReturnPolicy::Individual,
            return_order: ReturnOrder::BeforeReply,
        }
    }
}

impl ReceiveConfig {
    /// The settings the receive accounting takes.
    pub fn settings(&self) -> multirail_policy::receive::ReceiveSettings {
        use multirail_policy::receive as r;
        r::ReceiveSettings {
            queue_depth: self.queue_depth,
            shared_receive_queue: self.shared_receive_queue,
            registration_chunks: self.registration_chunks,
            max_sge: self.max_sge,
            buffer_size: self.buffer_size,
            return_policy: match self.return_policy {
                ReturnPolicy::Individual => r::ReturnPolicy::Individual,
                ReturnPolicy::Bulk => r::ReturnPolicy::Bulk,
            },
            return_order: match self.return_order {
                ReturnOrder::BeforeReply => r::ReturnOrder::BeforeReply,
                ReturnOrder::AfterReply => r::ReturnOrder::AfterReply,
            },
        }
    }

    fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        self.settings()
            .validate()
            .map_err(|e| ConfigError::new(format!("{prefix}.{}", e.key), e.message))
    }
}

impl Config {
    /// Parse and validate a JSON document; `origin` names where it came from for messages ("MULTIRAIL_CONF", a path).
    ///
    /// Fails on a syntax error (key "", message with origin, line and column), an unknown
    /// key, a wrong type or a negative number for an unsigned key (key = dotted path), and
    /// on any value [`Config::validate`] rejects.
    pub fn from_json_str(json: &str, origin: &str) -> Result<Config, ConfigError> {
        // Parsed untyped first only to check the document's shape; see `require_objects`.
        let doc: serde_json::Value =
            serde_json::from_str(json).map_err(|e| serde_error(String::new(), e, origin))?;
        require_objects(&doc, origin)?;
        // The typed parse reads the text again rather than `doc` because `Value` silently
        // keeps the last of duplicate keys, which must be an error.
        let mut de = serde_json::Deserializer::from_str(json);
        let config: Config = serde_path_to_error::deserialize(&mut de)
            .map_err(|e| serde_error(e.path().to_string(), e.into_inner(), origin))?;
        // Without this, `{} garbage` would be accepted.
        de.end()
            .map_err(|e| serde_error(String::new(), e, origin))?;
        config.validate()?;
        Ok(config)
    }

    /// Read, parse and validate the file at `path`.
    ///
    /// Fails with key "" and a message naming the path if the file cannot be read or is
    /// not valid JSON, otherwise as [`Config::from_json_str`].
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        Self::from_file_with_origin(path, &path.display().to_string())
    }

    fn from_file_with_origin(path: &Path, origin: &str) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new("", format!("{origin}: cannot read: {e}")))?;
        Self::from_json_str(&text, origin)
    }

    /// `--config FILE` wins; else MULTIRAIL_CONF (path or inline JSON); else defaults. Always validated.
    ///
    /// `MULTIRAIL_CONF` is inline JSON when its first non-space character is `{`, else a
    /// path; an empty or all-space value counts as unset so `MULTIRAIL_CONF= cmd` works.
    /// Errors are those of [`Config::from_file`] / [`Config::from_json_str`]; for a path
    /// taken from the variable the origin reads `PATH (from MULTIRAIL_CONF)`.
    pub fn load(explicit_path: Option<&Path>) -> Result<Config, ConfigError> {
        if let Some(path) = explicit_path {
            tracing::debug!(path = %path.display(), "loading configuration from --config");
            return Self::from_file(path);
        }
        match std::env::var_os(CONF_ENV_VAR) {
            Some(value) if !value.to_string_lossy().trim().is_empty() => {
                let is_inline = value
                    .to_str()
                    .is_some_and(|s| s.trim_start().starts_with('{'));
                if is_inline {
                    tracing::debug!("loading inline configuration from {CONF_ENV_VAR}");
                    // is_inline implies valid UTF-8.
                    Self::from_json_str(&value.to_string_lossy(), CONF_ENV_VAR)
                } else {
                    let path = Path::new(&value);
                    tracing::debug!(path = %path.display(), "loading configuration from {CONF_ENV_VAR}");
                    let origin = format!("{} (from {CONF_ENV_VAR})", path.display());
                    Self::from_file_with_origin(path, &origin)
                }
            }
            _ => {
                tracing::debug!("no --config and no {CONF_ENV_VAR}: using defaults");
                let config = Config::default();
                config.validate()?;
                Ok(config)
            }
        }
    }

    /// Check every value's range and the relations between keys.
    ///
    /// Returns the first problem found as a [`ConfigError`] whose key is the full dotted
    /// path (`transports.rdma.numa_penalties[2]`, `rails[0].address`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(host) = &self.local_hostname {
            if host.is_empty() {
                return Err(ConfigError::new(
                    "local_hostname",
                    "must not be empty (use null or leave it out to detect the address)",
                ));
            }
            if host.chars().any(char::is_whitespace) {
                return Err(ConfigError::new(
                    "local_hostname",
                    format!("must not contain whitespace, got {host:?}"),
                ));
            }
        }
        if self.transport == TransportChoice::Shm && !self.transports.shm.enable {
            return Err(ConfigError::new(
                "transport",
                "is \"shm\" but transports.shm.enable is false",
            ));
        }
        self.workers.validate("workers")?;
        let mut seen_names = std::collections::HashSet::new();
        for (i, rail) in self.rails.iter().enumerate() {
            let prefix = format!("rails[{i}]");
            rail.validate(&prefix)?;
            // Statistics and scheduling identify rails by name.
            if !seen_names.insert(rail.name.as_str()) {
                return Err(ConfigError::new(
                    format!("{prefix}.name"),
                    format!("duplicate rail name {:?}", rail.name),
                ));
            }
        }
        for (location, rails) in &self.tiers {
            let key = format!("tiers.{location}");
            location
                .parse::<crate::memory::Location>()
                .map_err(|_| ConfigError::new(key.clone(), "is not a location (`*` or `cpu:N`)"))?;
            for (rail, tier) in rails {
                if rail.is_empty() {
                    return Err(ConfigError::new(
                        key.clone(),
                        "rail names must not be empty",
                    ));
                }
                if *tier > 2 {
                    return Err(ConfigError::new(
                        format!("{key}.{rail}"),
                        format!("tier must be 0, 1 or 2, got {tier}"),
                    ));
                }
            }
        }
        self.transports.rdma.validate("transports.rdma")?;
        self.transports.tcp.validate("transports.tcp")?;
        if let Some(token) = &self.auth.token {
            check_token("auth.token", token.expose())?;
        }
        self.transports
            .shm
            .receive
            .validate("transports.shm.receive")?;
        Ok(())
    }

    /// The effective configuration as pretty JSON (what `multirail config show` prints); it must parse back to an equal Config,
    /// except `auth.token`, which prints as `"<redacted>"` (and is refused as a token).
    ///
    /// Never fails. Non-finite floats (only possible in a Config built in code and not
    /// validated) print as `null`, which does not parse back. Floats round-trip exactly
    /// when written with at most 15 significant digits and a decimal exponent within
    /// ±22 (every value a person writes); beyond that serde_json's default float parser
    /// may land one ulp off unless its `float_roundtrip` feature is enabled.
    pub fn to_json_pretty(&self) -> String {
        // Serializing plain structs with string keys into a String cannot fail.
        serde_json::to_string_pretty(self).expect("Config serializes to JSON")
    }
}

impl WorkersConfig {
    fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(ConfigError::new(
                format!("{prefix}.block_size"),
                format!(
                    "must be greater than 0 and at most {MAX_BLOCK_SIZE} (64 MiB), got {}",
                    self.block_size
                ),
            ));
        }
        at_least_one(
            prefix,
            "max_slices_per_request",
            self.max_slices_per_request.into(),
        )?;
        at_least_one(
            prefix,
            "max_slices_per_write",
            self.max_slices_per_write.into(),
        )?;
        within_count(prefix, "shm_copy_threads", self.shm_copy_threads)?;
        if self.wait_spin_us > MAX_WAIT_SPIN_US {
            return Err(ConfigError::new(
                format!("{prefix}.wait_spin_us"),
                format!(
                    "must be at most {MAX_WAIT_SPIN_US} (10 ms), got {}",
                    self.wait_spin_us
                ),
            ));
        }
        self.window.validate(&format!("{prefix}.window"))?;
        if !(1..=1_000_000).contains(&self.bulk_chunk_wait_us) {
            return Err(ConfigError::new(
                format!("{prefix}.bulk_chunk_wait_us"),
                format!(
                    "must be within 1..=1000000, got {}",
                    self.bulk_chunk_wait_us
                ),
            ));
        }
        if !(4096..=64 << 20).contains(&self.min_bulk_chunk) {
            return Err(ConfigError::new(
                format!("{prefix}.min_bulk_chunk"),
                format!(
                    "must be within 4096..=67108864, got {}",
                    self.min_bulk_chunk
                ),
            ));
        }
        Ok(())
    }
}

impl RailConfig {
    fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
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

impl RdmaConfig {
    fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        if self.numa_penalties.is_empty() {
            return Err(ConfigError::new(
                format!("{prefix}.numa_penalties"),
                "must list at least one penalty (tier 0 = local NUMA)",
            ));
        }
        for (i, &p) in self.numa_penalties.iter().enumerate() {
            if !(p.is_finite() && p >= 0.0) {
                return Err(ConfigError::new(
                    format!("{prefix}.numa_penalties[{i}]"),
                    format!("must be a finite number >= 0, got {p}"),
                ));
            }
        }
        let rate = self.bandwidth_learning_rate;
        // The negated form also rejects NaN.
        if !((0.0..=1.0).contains(&rate)) {
            return Err(ConfigError::new(
                format!("{prefix}.bandwidth_learning_rate"),
                format!("must be within [0, 1], got {rate}"),
            ));
        }
        positive(
            prefix,
            "ewma_min_bandwidth_multiplier",
            self.ewma_min_bandwidth_multiplier,
        )?;
        finite(
            prefix,
            "ewma_max_bandwidth_multiplier",
            self.ewma_max_bandwidth_multiplier,
        )?;
        if self.ewma_max_bandwidth_multiplier < self.ewma_min_bandwidth_multiplier {
            return Err(ConfigError::new(
                format!("{prefix}.ewma_max_bandwidth_multiplier"),
                format!(
                    "must be at least ewma_min_bandwidth_multiplier ({}), got {}",
                    self.ewma_min_bandwidth_multiplier, self.ewma_max_bandwidth_multiplier
                ),
            ));
        }
        finite(prefix, "score_jitter_range", self.score_jitter_range)?;
        if self.score_jitter_range < 0.0 {
            return Err(ConfigError::new(
                format!("{prefix}.score_jitter_range"),
                format!("must be >= 0, got {}", self.score_jitter_range),
            ));
        }
        positive(prefix, "score_epsilon", self.score_epsilon)?;
        positive(
            prefix,
            "default_bandwidth_gbps",
            self.default_bandwidth_gbps,
        )?;
        positive(prefix, "min_bandwidth_gbps", self.min_bandwidth_gbps)?;
        finite(prefix, "max_bandwidth_gbps", self.max_bandwidth_gbps)?;
        if self.min_bandwidth_gbps > self.max_bandwidth_gbps {
            return Err(ConfigError::new(
                format!("{prefix}.min_bandwidth_gbps"),
                format!(
                    "must not exceed max_bandwidth_gbps ({}), got {}",
                    self.max_bandwidth_gbps, self.min_bandwidth_gbps
                ),
            ));
        }
        at_least_one(
            prefix,
            "local_rotation_interval_us",
            self.local_rotation_interval_us,
        )?;
        at_least_one(
            prefix,
            "priority_promotion_timeout_us",
            self.priority_promotion_timeout_us,
        )?;
        at_least_one(
            prefix,
            "priority_promotion_check_us",
            self.priority_promotion_check_us,
        )?;
        at_least_one(
            prefix,
            "slot_rotation_interval_ms",
            self.slot_rotation_interval_ms,
        )?;
        Ok(())
    }
}

impl TcpConfig {
    fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        within_count(prefix, "connections_per_rail", self.connections_per_rail)?;
        at_least_one(prefix, "timeout_ms", self.timeout_ms)?;
        at_least_one(prefix, "connect_timeout_ms", self.connect_timeout_ms)?;
        if self.max_inflight_bytes_per_connection == 0 {
            return Err(ConfigError::new(
                format!("{prefix}.max_inflight_bytes_per_connection"),
                "must be greater than 0, got 0",
            ));
        }
        if !(0..=19).contains(&self.bulk_thread_nice) {
            return Err(ConfigError::new(
                format!("{prefix}.bulk_thread_nice"),
                format!("must be within [0, 19], got {}", self.bulk_thread_nice),
            ));
        }
        if !(1..=1 << 20).contains(&self.max_connections) {
            return Err(ConfigError::new(
                format!("{prefix}.max_connections"),
                format!("must be within [1, 1048576], got {}", self.max_connections),
            ));
        }
        if !(1..=1 << 20).contains(&self.max_pending_connections) {
            return Err(ConfigError::new(
                format!("{prefix}.max_pending_connections"),
                format!(
                    "must be within [1, 1048576], got {}",
                    self.max_pending_connections
                ),
            ));
        }
        within_count(prefix, "serve_threads", self.serve_threads)?;
        at_least_one(prefix, "keepalive_ms", self.keepalive_ms)?;
        self.receive.validate(&format!("{prefix}.receive"))?;
        Ok(())
    }
}

fn finite(prefix: &str, name: &str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{prefix}.{name}"),
            format!("must be a finite number, got {value}"),
        ))
    }
}

fn positive(prefix: &str, name: &str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{prefix}.{name}"),
            format!("must be a finite number greater than 0, got {value}"),
        ))
    }
}

fn at_least_one(prefix: &str, name: &str, value: u64) -> Result<(), ConfigError> {
    if value >= 1 {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{prefix}.{name}"),
            format!("must be at least 1, got {value}"),
        ))
    }
}

fn within_count(prefix: &str, name: &str, value: usize) -> Result<(), ConfigError> {
    if (1..=MAX_THREADS_OR_CONNECTIONS).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{prefix}.{name}"),
            format!("must be within [1, {MAX_THREADS_OR_CONNECTIONS}], got {value}"),
        ))
    }
}

/// Require JSON objects wherever a section is expected.
///
/// serde's derive also accepts a struct written as an array of its field values in
/// declaration order (`"workers": [131072]`); in a config file that is never meant and
/// would silently bind values to whichever keys happen to come first.
fn require_objects(doc: &serde_json::Value, origin: &str) -> Result<(), ConfigError> {
    const SECTIONS: &[&str] = &[
        "workers",
        "metadata",
        "auth",
        "transports",
        "transports.rdma",
        "transports.tcp",
        "transports.shm",
    ];
    if !doc.is_object() {
        return Err(ConfigError::new(
            "",
            format!(
                "{origin}: the document must be a JSON object ({{...}}), found {}",
                json_kind(doc)
            ),
        ));
    }
    let not_object = |key: String, v: &serde_json::Value| {
        ConfigError::new(
            key,
            format!("must be a JSON object, found {}", json_kind(v)),
        )
    };
    for section in SECTIONS {
        let pointer = format!("/{}", section.replace('.', "/"));
        if let Some(v) = doc.pointer(&pointer).filter(|v| v.is_array()) {
            return Err(not_object(section.to_string(), v));
        }
    }
    if let Some(rails) = doc.get("rails").and_then(serde_json::Value::as_array) {
        if let Some((i, v)) = rails.iter().enumerate().find(|(_, v)| v.is_array()) {
            return Err(not_object(format!("rails[{i}]"), v));
        }
    }
    Ok(())
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Turn a serde_json error found at `path` (serde_path_to_error's rendering) into a
/// [`ConfigError`] that names the key and says what is wrong in the file's own terms.
fn serde_error(path: String, err: serde_json::Error, origin: &str) -> ConfigError {
    use serde_json::error::Category;

    let full = err.to_string();
    // serde_json appends the position; the key path already locates data errors.
    let bare = if err.line() == 0 {
        full.as_str()
    } else {
        full.strip_suffix(&format!(" at line {} column {}", err.line(), err.column()))
            .unwrap_or(&full)
    };
    match err.classify() {
        Category::Syntax | Category::Eof | Category::Io => ConfigError::new(
            "",
            format!(
                "{origin}: invalid JSON at line {}, column {}: {bare}",
                err.line(),
                err.column()
            ),
        ),
        Category::Data => {
            let path = if path == "." { String::new() } else { path };
            describe_data_error(path, bare, origin)
        }
    }
}

fn describe_data_error(path: String, msg: &str, origin: &str) -> ConfigError {
    if let Some(rest) = msg.strip_prefix("unknown field `") {
        // serde_path_to_error already appended the unknown key itself to `path`.
        let (name, expected) = rest.split_once('`').unwrap_or((rest, ""));
        let mut message = String::from("unknown key");
        let expected = expected.trim_start_matches(", ");
        let known = expected
            .strip_prefix("expected one of ")
            .or_else(|| expected.strip_prefix("expected "));
        if let Some(known) = known {
            message.push_str("; known keys here: ");
            message.push_str(&known.replace('`', ""));
        }
        // TENT's docs show bare fragments of the rdma section; say where they belong.
        if path == name && RDMA_KEYS.contains(&name) {
            message.push_str(&format!(
                "; TENT's scheduling keys belong under transports.rdma (transports.rdma.{name})"
            ));
        }
        return ConfigError::new(path, message);
    }
    if let Some(rest) = msg.strip_prefix("duplicate field `") {
        // serde reports duplicates against the enclosing object; name the key itself.
        let name = rest.split('`').next().unwrap_or(rest);
        let key = if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        };
        return ConfigError::new(key, "duplicate key");
    }
    // serde names our Rust types; the file's author thinks in JSON objects.
    let msg = match msg.rfind("expected struct ") {
        Some(at) => format!("{}expected a JSON object", &msg[..at]),
        None => msg.to_string(),
    };
    if path.is_empty() {
        // Whole-document problems: say where the document came from.
        return ConfigError::new("", format!("{origin}: {msg}"));
    }
    ConfigError::new(path, msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::Mutex;

    /// Tests run in parallel threads of one process and share its environment.
    static ENV_LOCK: Mutex<()> = Mutex::new(());

    /// Holds the env lock and restores MULTIRAIL_CONF on drop, even when a test panics.
    struct EnvGuard {
        saved: Option<std::ffi::OsString>,
        _lock: std::sync::MutexGuard<'static, ()>,
    }

    impl EnvGuard {
        fn set(value: Option<&str>) -> EnvGuard {
            let lock = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            let saved = std::env::var_os(CONF_ENV_VAR);
            match value {
                Some(v) => std::env::set_var(CONF_ENV_VAR, v),
                None => std::env::remove_var(CONF_ENV_VAR),
            }
            EnvGuard { saved, _lock: lock }
        }
    }

    impl Drop for EnvGuard {
        fn drop(&mut self) {
            match &self.saved {
                Some(v) => std::env::set_var(CONF_ENV_VAR, v),
                None => std::env::remove_var(CONF_ENV_VAR),
            }
        }
    }

    /// A file under the temp dir removed on drop; the name is unique per process and test.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(tag: &str, contents: &str) -> TempFile {
            let path = std::env::temp_dir().join(format!(
                "multirail-config-test-{}-{tag}.json",
                std::process::id()
            ));
            std::fs::write(&path, contents).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn parse(json: &str) -> Result<Config, ConfigError> {
        Config::from_json_str(json, "test.json")
    }

    fn parse_err(json: &str) -> ConfigError {
        match parse(json) {
            Ok(c) => panic!("expected an error for {json}, got {c:?}"),
            Err(e) => e,
        }
    }

    fn rdma(json_body: &str) -> String {
        format!(r#"{{"transports": {{"rdma": {{{json_body}}}}}}}"#)
    }

    #[test]
    fn empty_document_gives_all_defaults() {
        let c = parse("{}").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.local_hostname, None);
        assert_eq!(c.transport, TransportChoice::Auto);
        assert_eq!(c.workers.block_size, 65536);
        assert_eq!(c.workers.max_slices_per_request, 64);
        assert_eq!(c.workers.max_slices_per_write, 32);
        assert_eq!(c.workers.shm_copy_threads, 2);
        assert_eq!(c.workers.wait_spin_us, 100);
        assert!(c.rails.is_empty());
        assert_eq!(c.metadata.kind, MetadataKind::P2p);
        let r = &c.transports.rdma;
        assert!(r.enable_smart_scheduling);
        assert_eq!(r.numa_penalties, vec![1.0, 5.0, 10.0]);
        assert_eq!(r.bandwidth_learning_rate, 0.01);
        assert_eq!(r.ewma_min_bandwidth_multiplier, 0.1);
        assert_eq!(r.ewma_max_bandwidth_multiplier, 10.0);
        assert_eq!(r.score_jitter_range, 1e-9);
        assert_eq!(r.score_epsilon, 1e-12);
        assert_eq!(r.default_bandwidth_gbps, 400.0);
        assert_eq!(r.min_bandwidth_gbps, 10.0);
        assert_eq!(r.max_bandwidth_gbps, 800.0);
        assert!(r.enable_priority_filtering);
        assert_eq!(r.local_rotation_interval_us, 200);
        assert_eq!(r.priority_promotion_timeout_us, 10000);
        assert_eq!(r.priority_promotion_check_us, 1000);
        assert_eq!(r.slot_rotation_interval_ms, 2);
        assert_eq!(r.shared_quota_shm_path, "");
        assert!(r.qos_work_conserving);
        let t = &c.transports.tcp;
        assert_eq!(t.connections_per_rail, 2);
        assert_eq!(t.timeout_ms, 5000);
        assert_eq!(t.connect_timeout_ms, 3000);
        assert_eq!(t.max_retries, 8);
        assert_eq!(t.max_inflight_bytes_per_connection, 64 * 1024 * 1024);
        assert_eq!(t.bulk_thread_nice, 0);
        assert!(c.transports.shm.enable);
        assert!(c.transports.shm.process_vm);
        assert!(Config::default().validate().is_ok());
    }

    #[test]
    fn partial_sections_keep_sibling_defaults() {
        let c = parse(r#"{"transports": {"tcp": {"timeout_ms": 10}}, "workers": {}}"#).unwrap();
        assert_eq!(c.transports.tcp.timeout_ms, 10);
        assert_eq!(c.transports.tcp.connections_per_rail, 2);
        assert_eq!(c.transports.rdma, RdmaConfig::default());
        assert_eq!(c.workers, WorkersConfig::default());
    }

    #[test]
    fn full_multirail_document_loads() {
        let c = parse(
            r#"{
              "local_hostname": "node7",
              "transport": "tcp",
              "workers": {"block_size": 131072, "max_slices_per_request": 16,
                          "max_slices_per_write": 4, "shm_copy_threads": 8},
              "rails": [
                {"name": "eth0", "address": "10.0.0.1", "numa_node": 0, "bandwidth_gbps": 100},
                {"name": "eth1", "address": "fe80::1"}
              ],
              "metadata": {"type": "p2p"},
              "transports": {
                "tcp": {"connections_per_rail": 4, "timeout_ms": 100, "connect_timeout_ms": 50,
                        "max_retries": 0, "max_inflight_bytes_per_connection": 1048576},
                "shm": {"enable": false, "process_vm": false}
              }
            }"#,
        )
        .unwrap();
        assert_eq!(c.local_hostname.as_deref(), Some("node7"));
        assert_eq!(c.transport, TransportChoice::Tcp);
        assert_eq!(c.workers.block_size, 131072);
        assert_eq!(c.workers.shm_copy_threads, 8);
        assert_eq!(c.rails.len(), 2);
        assert_eq!(c.rails[0].bandwidth_gbps, Some(100.0));
        assert_eq!(c.rails[0].numa_node, 0);
        assert_eq!(c.rails[1].numa_node, -1);
        assert_eq!(c.rails[1].bandwidth_gbps, None);
        assert_eq!(c.transports.tcp.connections_per_rail, 4);
        assert_eq!(c.transports.tcp.max_retries, 0);
        assert!(!c.transports.shm.enable);
        assert!(!c.transports.shm.process_vm);
    }

    // ---- The seeds' example documents (TENT Slice Spraying and QoS docs). ----

    #[test]
    fn slice_spraying_example_1_latency_sensitive() {
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "enable_smart_scheduling": true,
      "numa_penalties": [1.0, 100.0, 1000.0],
      "bandwidth_learning_rate": 0.001
    }
  }
}"#,
        )
        .unwrap();
        let r = &c.transports.rdma;
        assert!(r.enable_smart_scheduling);
        assert_eq!(r.numa_penalties, vec![1.0, 100.0, 1000.0]);
        assert_eq!(r.bandwidth_learning_rate, 0.001);
        assert_eq!(r.max_bandwidth_gbps, 800.0);
    }

    #[test]
    fn slice_spraying_example_2_bulk_transfer() {
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "enable_smart_scheduling": true,
      "numa_penalties": [1.0, 2.0, 3.0],
      "bandwidth_learning_rate": 0.1
    }
  }
}"#,
        )
        .unwrap();
        assert_eq!(c.transports.rdma.numa_penalties, vec![1.0, 2.0, 3.0]);
        assert_eq!(c.transports.rdma.bandwidth_learning_rate, 0.1);
    }

    #[test]
    fn slice_spraying_example_3_baseline_mode() {
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "enable_smart_scheduling": false
    }
  }
}"#,
        )
        .unwrap();
        assert!(!c.transports.rdma.enable_smart_scheduling);
        assert_eq!(c.transports.rdma.numa_penalties, vec![1.0, 5.0, 10.0]);
    }

    #[test]
    fn slice_spraying_configuration_snippets_load() {
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "bandwidth_learning_rate": 0.01,
      "ewma_min_bandwidth_multiplier": 0.1,
      "ewma_max_bandwidth_multiplier": 10.0
    }
  }
}"#,
        )
        .unwrap();
        assert_eq!(c, Config::default());
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "score_jitter_range": 1e-9,
      "score_epsilon": 1e-12
    }
  }
}"#,
        )
        .unwrap();
        assert_eq!(c, Config::default());
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "default_bandwidth_gbps": 400.0,
      "min_bandwidth_gbps": 10.0,
      "max_bandwidth_gbps": 800.0
    }
  }
}"#,
        )
        .unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn qos_example_1_latency_critical() {
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "enable_priority_filtering": true,
      "slot_rotation_interval_ms": 1,
      "shared_quota_shm_path": "/mooncake_rdma_slots"
    }
  }
}"#,
        )
        .unwrap();
        let r = &c.transports.rdma;
        assert!(r.enable_priority_filtering);
        assert_eq!(r.slot_rotation_interval_ms, 1);
        assert_eq!(r.shared_quota_shm_path, "/mooncake_rdma_slots");
    }

    #[test]
    fn qos_example_2_single_process() {
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "enable_priority_filtering": true,
      "shared_quota_shm_path": ""
    }
  }
}"#,
        )
        .unwrap();
        assert_eq!(c.transports.rdma.shared_quota_shm_path, "");
        assert_eq!(c.transports.rdma.slot_rotation_interval_ms, 2);
    }

    #[test]
    fn qos_example_3_bulk_friendly() {
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "slot_rotation_interval_ms": 10,
      "shared_quota_shm_path": "/mooncake_rdma_slots"
    }
  }
}"#,
        )
        .unwrap();
        assert_eq!(c.transports.rdma.slot_rotation_interval_ms, 10);
        assert_eq!(
            c.transports.rdma.shared_quota_shm_path,
            "/mooncake_rdma_slots"
        );
    }

    #[test]
    fn qos_priority_filtering_snippet_loads() {
        let c = parse(
            r#"{
  "transports": {
    "rdma": {
      "enable_priority_filtering": true,
      "local_rotation_interval_us": 200,
      "priority_promotion_timeout_us": 10000
    }
  }
}"#,
        )
        .unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn bare_tent_fragment_points_at_transports_rdma() {
        // The seeds' troubleshooting snippets are fragments of the rdma section.
        let e = parse_err(
            r#"{
  "bandwidth_learning_rate": 0.001,
  "numa_penalties": [1.0, 10.0, 100.0],
  "score_jitter_range": 1e-12
}"#,
        );
        assert_eq!(e.key, "bandwidth_learning_rate");
        assert!(e.message.starts_with("unknown key"), "{e}");
        assert!(
            e.message
                .contains("transports.rdma.bandwidth_learning_rate"),
            "{e}"
        );
    }

    // ---- Errors name the key. ----

    #[test]
    fn unknown_top_level_key() {
        let e = parse_err(r#"{"bogus": 1}"#);
        assert_eq!(e.key, "bogus");
        assert!(e.message.starts_with("unknown key"), "{e}");
        assert!(e.message.contains("transports"), "lists known keys: {e}");
        assert!(!e.message.contains("transports.rdma."), "no TENT hint: {e}");
        assert!(e.to_string().starts_with("config key bogus: unknown key"));
    }

    #[test]
    fn unknown_nested_key() {
        let e = parse_err(&rdma(r#""bogus": true"#));
        assert_eq!(e.key, "transports.rdma.bogus");
        assert!(e.message.starts_with("unknown key"), "{e}");
        assert!(e.message.contains("numa_penalties"), "{e}");

        let e = parse_err(r#"{"transports": {"tcp": {"bogus": 1}}}"#);
        assert_eq!(e.key, "transports.tcp.bogus");
        assert!(e.message.starts_with("unknown key"), "{e}");

        let e = parse_err(r#"{"metadata": {"kind": "p2p"}}"#);
        assert_eq!(e.key, "metadata.kind");
        assert!(e.message.contains("known keys here: type"), "{e}");
    }

    #[test]
    fn wrong_type_names_key() {
        let e = parse_err(&rdma(r#""enable_smart_scheduling": "yes""#));
        assert_eq!(e.key, "transports.rdma.enable_smart_scheduling");
        assert!(e.message.contains("invalid type"), "{e}");
        assert!(e.message.contains("boolean"), "{e}");
        assert!(!e.message.contains(" at line "), "position stripped: {e}");
    }

    #[test]
    fn wrong_type_inside_rail_names_index() {
        let e = parse_err(
            r#"{"rails": [{"name": "a", "address": "10.0.0.1"},
                          {"name": "b", "address": "10.0.0.2", "numa_node": "zero"}]}"#,
        );
        assert_eq!(e.key, "rails[1].numa_node");
        assert!(e.message.contains("invalid type"), "{e}");
    }

    #[test]
    fn negative_number_for_unsigned_key() {
        let e = parse_err(r#"{"transports": {"tcp": {"timeout_ms": -5}}}"#);
        assert_eq!(e.key, "transports.tcp.timeout_ms");
        assert!(e.message.contains("-5"), "{e}");
        let e = parse_err(r#"{"workers": {"block_size": -1}}"#);
        assert_eq!(e.key, "workers.block_size");
    }

    #[test]
    fn unknown_transport_and_metadata_values() {
        let e = parse_err(r#"{"transport": "udp"}"#);
        assert_eq!(e.key, "transport");
        assert!(e.message.contains("udp"), "{e}");
        assert!(e.message.contains("auto"), "{e}");
        let e = parse_err(r#"{"metadata": {"type": "etcd"}}"#);
        assert_eq!(e.key, "metadata.type");
        assert!(e.message.contains("p2p"), "{e}");
    }

    #[test]
    fn duplicate_key_is_named() {
        let e = parse_err(&rdma(r#""score_epsilon": 1e-12, "score_epsilon": 1e-9"#));
        assert_eq!(e.key, "transports.rdma.score_epsilon");
        assert_eq!(e.message, "duplicate key");
    }

    #[test]
    fn negative_penalty_names_index() {
        let e = parse_err(&rdma(r#""numa_penalties": [1.0, -5.0, 10.0]"#));
        assert_eq!(e.key, "transports.rdma.numa_penalties[1]");
        assert!(e.message.contains(">= 0"), "{e}");
        assert!(e.message.contains("-5"), "{e}");
    }

    #[test]
    fn empty_penalties_rejected() {
        let e = parse_err(&rdma(r#""numa_penalties": []"#));
        assert_eq!(e.key, "transports.rdma.numa_penalties");
        assert!(e.message.contains("at least one"), "{e}");
    }

    #[test]
    fn learning_rate_above_one() {
        let e = parse_err(&rdma(r#""bandwidth_learning_rate": 1.5"#));
        assert_eq!(e.key, "transports.rdma.bandwidth_learning_rate");
        assert_eq!(e.message, "must be within [0, 1], got 1.5");
        assert_eq!(
            e.to_string(),
            "config key transports.rdma.bandwidth_learning_rate: must be within [0, 1], got 1.5"
        );
    }

    #[test]
    fn learning_rate_negative() {
        let e = parse_err(&rdma(r#""bandwidth_learning_rate": -0.1"#));
        assert_eq!(e.key, "transports.rdma.bandwidth_learning_rate");
        assert_eq!(e.message, "must be within [0, 1], got -0.1");
    }

    #[test]
    fn learning_rate_bounds_inclusive() {
        parse(&rdma(r#""bandwidth_learning_rate": 0"#)).unwrap();
        parse(&rdma(r#""bandwidth_learning_rate": 1"#)).unwrap();
    }

    #[test]
    fn min_bandwidth_above_max() {
        let e = parse_err(&rdma(
            r#""min_bandwidth_gbps": 900, "max_bandwidth_gbps": 800"#,
        ));
        assert_eq!(e.key, "transports.rdma.min_bandwidth_gbps");
        assert!(e.message.contains("max_bandwidth_gbps"), "{e}");
        assert!(e.message.contains("900"), "{e}");
        // Equal bounds are a fixed bandwidth, which is fine.
        parse(&rdma(
            r#""min_bandwidth_gbps": 100, "max_bandwidth_gbps": 100"#,
        ))
        .unwrap();
    }

    #[test]
    fn ewma_multiplier_relations() {
        let e = parse_err(&rdma(r#""ewma_min_bandwidth_multiplier": 0"#));
        assert_eq!(e.key, "transports.rdma.ewma_min_bandwidth_multiplier");
        assert!(e.message.contains("greater than 0"), "{e}");
        let e = parse_err(&rdma(
            r#""ewma_min_bandwidth_multiplier": 2, "ewma_max_bandwidth_multiplier": 1"#,
        ));
        assert_eq!(e.key, "transports.rdma.ewma_max_bandwidth_multiplier");
        assert!(
            e.message.contains("at least ewma_min_bandwidth_multiplier"),
            "{e}"
        );
    }

    #[test]
    fn other_rdma_ranges() {
        for (body, key) in [
            (r#""score_jitter_range": -1e-9"#, "score_jitter_range"),
            (r#""score_epsilon": 0"#, "score_epsilon"),
            (r#""default_bandwidth_gbps": 0"#, "default_bandwidth_gbps"),
            (r#""min_bandwidth_gbps": -1"#, "min_bandwidth_gbps"),
            (
                r#""local_rotation_interval_us": 0"#,
                "local_rotation_interval_us",
            ),
            (
                r#""priority_promotion_timeout_us": 0"#,
                "priority_promotion_timeout_us",
            ),
            (
                r#""priority_promotion_check_us": 0"#,
                "priority_promotion_check_us",
            ),
            (
                r#""slot_rotation_interval_ms": 0"#,
                "slot_rotation_interval_ms",
            ),
        ] {
            let e = parse_err(&rdma(body));
            assert_eq!(e.key, format!("transports.rdma.{key}"), "for {body}");
        }
        parse(&rdma(r#""score_jitter_range": 0"#)).unwrap();
    }

    #[test]
    fn tier_overrides_load_and_are_checked() {
        let c = Config::from_json_str(
            r#"{"tiers": {"cpu:0": {"eth0": 0, "eth1": 2}, "*": {"eth1": 1}}}"#,
            "t",
        )
        .unwrap();
        assert_eq!(c.tiers["cpu:0"]["eth1"], 2);
        let e = parse_err(r#"{"tiers": {"gpu:0": {"eth0": 0}}}"#);
        assert_eq!(e.key, "tiers.gpu:0");
        let e = parse_err(r#"{"tiers": {"cpu:0": {"eth0": 3}}}"#);
        assert_eq!(e.key, "tiers.cpu:0.eth0");
        assert!(e.message.contains("0, 1 or 2"), "{e}");
    }

    #[test]
    fn block_size_zero() {
        let e = parse_err(r#"{"workers": {"block_size": 0}}"#);
        assert_eq!(e.key, "workers.block_size");
        assert!(e.message.contains("greater than 0"), "{e}");
        assert!(e.message.contains("got 0"), "{e}");
    }

    #[test]
    fn block_size_above_64_mib() {
        parse(r#"{"workers": {"block_size": 67108864}}"#).unwrap();
        let e = parse_err(r#"{"workers": {"block_size": 67108865}}"#);
        assert_eq!(e.key, "workers.block_size");
        assert!(e.message.contains("64 MiB"), "{e}");
    }

    #[test]
    fn worker_counts() {
        let e = parse_err(r#"{"workers": {"max_slices_per_request": 0}}"#);
        assert_eq!(e.key, "workers.max_slices_per_request");
        let e = parse_err(r#"{"workers": {"max_slices_per_write": 0}}"#);
        assert_eq!(e.key, "workers.max_slices_per_write");
        let e = parse_err(r#"{"workers": {"shm_copy_threads": 65}}"#);
        assert_eq!(e.key, "workers.shm_copy_threads");
        assert!(e.message.contains("[1, 64]"), "{e}");
    }

    #[test]
    fn wait_spin_bounds() {
        parse(r#"{"workers": {"wait_spin_us": 0}}"#).unwrap();
        parse(r#"{"workers": {"wait_spin_us": 10000}}"#).unwrap();
        let e = parse_err(r#"{"workers": {"wait_spin_us": 10001}}"#);
        assert_eq!(e.key, "workers.wait_spin_us");
        assert!(e.message.contains("got 10001"), "{e}");
    }

    #[test]
    fn connections_per_rail_zero() {
        let e = parse_err(r#"{"transports": {"tcp": {"connections_per_rail": 0}}}"#);
        assert_eq!(e.key, "transports.tcp.connections_per_rail");
        assert_eq!(e.message, "must be within [1, 64], got 0");
    }

    #[test]
    fn tcp_ranges() {
        let e = parse_err(r#"{"transports": {"tcp": {"timeout_ms": 0}}}"#);
        assert_eq!(e.key, "transports.tcp.timeout_ms");
        let e = parse_err(r#"{"transports": {"tcp": {"connect_timeout_ms": 0}}}"#);
        assert_eq!(e.key, "transports.tcp.connect_timeout_ms");
        let e = parse_err(r#"{"transports": {"tcp": {"max_inflight_bytes_per_connection": 0}}}"#);
        assert_eq!(e.key, "transports.tcp.max_inflight_bytes_per_connection");
        for bad in ["-1", "20"] {
            let e = parse_err(&format!(
                r#"{{"transports": {{"tcp": {{"bulk_thread_nice": {bad}}}}}}}"#
            ));
            assert_eq!(e.key, "transports.tcp.bulk_thread_nice");
            assert_eq!(e.message, format!("must be within [0, 19], got {bad}"));
        }
    }

    #[test]
    fn bad_rail_address() {
        let e = parse_err(
            r#"{"rails": [{"name": "eth0", "address": "10.0.0.1"},
                          {"name": "eth1", "address": "10.0.0.300"}]}"#,
        );
        assert_eq!(e.key, "rails[1].address");
        assert!(e.message.contains("IPv4 or IPv6 address"), "{e}");
        assert!(e.message.contains("10.0.0.300"), "{e}");
    }

    #[test]
    fn rail_name_and_bandwidth_and_numa() {
        let e = parse_err(r#"{"rails": [{"address": "10.0.0.1"}]}"#);
        assert_eq!(e.key, "rails[0].name");
        let e =
            parse_err(r#"{"rails": [{"name": "a", "address": "10.0.0.1", "bandwidth_gbps": 0}]}"#);
        assert_eq!(e.key, "rails[0].bandwidth_gbps");
        let e = parse_err(r#"{"rails": [{"name": "a", "address": "10.0.0.1", "numa_node": -2}]}"#);
        assert_eq!(e.key, "rails[0].numa_node");
        let e = parse_err(
            r#"{"rails": [{"name": "a", "address": "10.0.0.1"},
                          {"name": "a", "address": "10.0.0.2"}]}"#,
        );
        assert_eq!(e.key, "rails[1].name");
        assert!(e.message.contains("duplicate"), "{e}");
    }

    #[test]
    fn local_hostname_and_forced_shm() {
        let e = parse_err(r#"{"local_hostname": ""}"#);
        assert_eq!(e.key, "local_hostname");
        let e = parse_err(r#"{"local_hostname": "a b"}"#);
        assert_eq!(e.key, "local_hostname");
        assert_eq!(
            parse(r#"{"local_hostname": null}"#).unwrap().local_hostname,
            None
        );
        let e = parse_err(r#"{"transport": "shm", "transports": {"shm": {"enable": false}}}"#);
        assert_eq!(e.key, "transport");
        assert!(e.message.contains("transports.shm.enable"), "{e}");
    }

    #[test]
    fn syntax_error_names_origin_line_and_column() {
        let e =
            Config::from_json_str("{\n  \"transport\": \"tcp\",\n}", "MULTIRAIL_CONF").unwrap_err();
        assert_eq!(e.key, "");
        assert!(e.message.starts_with("MULTIRAIL_CONF: invalid JSON"), "{e}");
        assert!(e.message.contains("line 3, column 1"), "{e}");
        assert!(e.to_string().starts_with("config: MULTIRAIL_CONF: "), "{e}");

        let e = parse_err("{\"transport\": ");
        assert_eq!(e.key, "");
        assert!(
            e.message.starts_with("test.json: invalid JSON at line 1"),
            "{e}"
        );

        let e = parse_err("");
        assert_eq!(e.key, "");
        assert!(e.message.contains("invalid JSON"), "{e}");
    }

    #[test]
    fn trailing_characters_rejected() {
        let e = parse_err("{} {}");
        assert_eq!(e.key, "");
        assert!(e.message.contains("trailing characters"), "{e}");
    }

    #[test]
    fn non_object_document_rejected() {
        let e = parse_err("[1, 2]");
        assert_eq!(e.key, "");
        assert!(
            e.message
                .starts_with("test.json: the document must be a JSON object"),
            "{e}"
        );
        let e = parse_err("\"tcp\"");
        assert_eq!(e.key, "");
        assert!(e.message.contains("found a string"), "{e}");
    }

    #[test]
    fn sections_written_as_arrays_rejected() {
        // serde would otherwise bind [131072] to the first field, block_size.
        let e = parse_err(r#"{"workers": [131072]}"#);
        assert_eq!(e.key, "workers");
        assert_eq!(e.message, "must be a JSON object, found an array");
        let e = parse_err(r#"{"transports": {"rdma": []}}"#);
        assert_eq!(e.key, "transports.rdma");
        let e =
            parse_err(r#"{"rails": [{"name": "a", "address": "10.0.0.1"}, ["b", "10.0.0.2"]]}"#);
        assert_eq!(e.key, "rails[1]");
    }

    #[test]
    fn null_section_says_object_expected() {
        let e = parse_err(r#"{"transports": {"tcp": null}}"#);
        assert_eq!(e.key, "transports.tcp");
        assert_eq!(e.message, "invalid type: null, expected a JSON object");
    }

    #[test]
    fn validate_catches_non_finite_values_built_in_code() {
        let mut c = Config::default();
        c.transports.rdma.bandwidth_learning_rate = f64::NAN;
        assert_eq!(
            c.validate().unwrap_err().key,
            "transports.rdma.bandwidth_learning_rate"
        );
        let mut c = Config::default();
        c.transports.rdma.numa_penalties[2] = f64::INFINITY;
        assert_eq!(
            c.validate().unwrap_err().key,
            "transports.rdma.numa_penalties[2]"
        );
        let mut c = Config::default();
        c.transports.rdma.max_bandwidth_gbps = f64::NAN;
        assert_eq!(
            c.validate().unwrap_err().key,
            "transports.rdma.max_bandwidth_gbps"
        );
    }

    #[test]
    fn rdma_keys_list_matches_struct() {
        let value = serde_json::to_value(RdmaConfig::default()).unwrap();
        let mut from_struct: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut listed = RDMA_KEYS.to_vec();
        from_struct.sort_unstable();
        listed.sort_unstable();
        assert_eq!(from_struct, listed);
    }

    // ---- Round trip. ----

    #[test]
    fn to_json_pretty_round_trips_defaults() {
        let c = Config::default();
        let text = c.to_json_pretty();
        assert!(text.contains("\"bandwidth_learning_rate\""));
        assert!(text.contains("\"type\": \"p2p\""));
        assert!(text.contains("\"transport\": \"auto\""));
        assert!(text.contains('\n'), "pretty, multi-line");
        assert_eq!(parse(&text).unwrap(), c);
    }

    #[test]
    fn to_json_pretty_round_trips_non_defaults() {
        let mut c = Config {
            local_hostname: Some("10.1.2.3".into()),
            transport: TransportChoice::Shm,
            ..Config::default()
        };
        c.workers.block_size = 1 << 20;
        c.rails = vec![
            RailConfig {
                name: "eth0".into(),
                address: "192.168.0.2".into(),
                numa_node: 1,
                bandwidth_gbps: Some(25.5),
            },
            RailConfig {
                name: "ib0".into(),
                address: "::1".into(),
                ..RailConfig::default()
            },
        ];
        c.transports.rdma.numa_penalties = vec![1.0, 1.0 / 3.0, 0.0];
        c.transports.rdma.bandwidth_learning_rate = 0.123456789012345;
        c.transports.rdma.score_jitter_range = 3e-20;
        c.transports.rdma.shared_quota_shm_path = "/slots \"quoted\"".into();
        c.transports.tcp.max_retries = u32::MAX;
        c.transports.tcp.max_inflight_bytes_per_connection = u64::MAX;
        c.transports.shm.process_vm = false;
        c.validate().unwrap();
        assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
    }

    /// Floats as a person or tool writes them: up to 15 significant digits times 10^-k.
    fn decimal(
        mantissa: std::ops::RangeInclusive<u64>,
        neg_exponent: std::ops::RangeInclusive<u32>,
    ) -> impl proptest::strategy::Strategy<Value = f64> {
        use proptest::strategy::Strategy;
        (mantissa, neg_exponent).prop_map(|(m, k)| format!("{m}e-{k}").parse::<f64>().unwrap())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn to_json_pretty_round_trips_written_floats(
            rate in decimal(0..=1_000_000_000_000_000, 15..=22),
            penalties in proptest::collection::vec(decimal(0..=999_999_999_999_999, 0..=22), 1..6),
            min_mult in decimal(1..=999_999_999_999_999, 0..=22),
            max_mult in decimal(0..=999_999_999_999_999, 0..=22),
            jitter in decimal(0..=999_999_999_999_999, 0..=22),
            eps in decimal(1..=999_999_999_999_999, 0..=22),
        ) {
            let mut c = Config::default();
            let r = &mut c.transports.rdma;
            r.bandwidth_learning_rate = rate;
            r.numa_penalties = penalties;
            r.ewma_min_bandwidth_multiplier = min_mult;
            r.ewma_max_bandwidth_multiplier = min_mult.max(max_mult);
            r.score_jitter_range = jitter;
            r.score_epsilon = eps;
            proptest::prop_assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
        }
    }

    // ---- Sources: --config, MULTIRAIL_CONF, defaults. ----

    #[test]
    fn load_without_sources_gives_defaults() {
        let _env = EnvGuard::set(None);
        assert_eq!(Config::load(None).unwrap(), Config::default());
        drop(_env);
        let _env = EnvGuard::set(Some("   "));
        assert_eq!(Config::load(None).unwrap(), Config::default());
    }

    #[test]
    fn load_env_inline_json() {
        let _env = EnvGuard::set(Some(r#"  {"transports": {"tcp": {"timeout_ms": 77}}}"#));
        let c = Config::load(None).unwrap();
        assert_eq!(c.transports.tcp.timeout_ms, 77);
    }

    #[test]
    fn load_env_inline_json_errors_name_key() {
        let _env = EnvGuard::set(Some(r#"{"workers": {"block_size": 0}}"#));
        assert_eq!(Config::load(None).unwrap_err().key, "workers.block_size");
        drop(_env);
        let _env = EnvGuard::set(Some("{\"workers\": "));
        let e = Config::load(None).unwrap_err();
        assert_eq!(e.key, "");
        assert!(e.message.starts_with("MULTIRAIL_CONF: invalid JSON"), "{e}");
    }

    #[test]
    fn window_settings_are_checked_and_name_their_key() {
        let err = |doc: &str| Config::from_json_str(doc, "test").unwrap_err().key;
        assert_eq!(
            err(r#"{"workers": {"window": {"controller": "cubic"}}}"#),
            "workers.window.controller"
        );
        assert_eq!(
            err(r#"{"workers": {"window": {"bdps": 2, "lean_bdps": 3}}}"#),
            "workers.window.lean_bdps"
        );
        assert_eq!(
            err(r#"{"workers": {"window": {"fixed_bytes": 1}}}"#),
            "workers.window.fixed_bytes"
        );
        assert_eq!(
            err(r#"{"workers": {"bulk_chunk_wait_us": 0}}"#),
            "workers.bulk_chunk_wait_us"
        );
        let c = Config::from_json_str(r#"{"workers": {"window": {"controller": "fixed"}}}"#, "t")
            .unwrap();
        assert_eq!(
            c.workers.dispatch_config().controller,
            dispatch::ControllerKind::Fixed(dispatch::FixedController { bytes: 4 << 20 })
        );
        // The defaults are the policy crate's, written once.
        assert_eq!(
            Config::default().workers.dispatch_config().controller,
            dispatch::ControllerKind::default()
        );
    }

    #[test]
    fn load_env_path() {
        let file = TempFile::new("env-path", &rdma(r#""slot_rotation_interval_ms": 9"#));
        let _env = EnvGuard::set(Some(file.0.to_str().unwrap()));
        let c = Config::load(None).unwrap();
        assert_eq!(c.transports.rdma.slot_rotation_interval_ms, 9);
    }

    #[test]
    fn load_env_path_syntax_error_names_file() {
        let file = TempFile::new("env-path-bad", "{\n\"transport\" \"tcp\"}");
        let path = file.0.to_str().unwrap().to_string();
        let _env = EnvGuard::set(Some(&path));
        let e = Config::load(None).unwrap_err();
        assert_eq!(e.key, "");
        assert!(e.message.starts_with(&path), "{e}");
        assert!(e.message.contains("MULTIRAIL_CONF"), "{e}");
        assert!(e.message.contains("line 2"), "{e}");
    }

    #[test]
    fn load_explicit_path_wins_over_env() {
        let file = TempFile::new("explicit", r#"{"transport": "tcp"}"#);
        let _env = EnvGuard::set(Some(r#"{"transport": "shm"}"#));
        let c = Config::load(Some(&file.0)).unwrap();
        assert_eq!(c.transport, TransportChoice::Tcp);
        // The env var alone would have given shm.
        assert_eq!(Config::load(None).unwrap().transport, TransportChoice::Shm);
    }

    #[test]
    fn missing_file_names_path() {
        let path = std::env::temp_dir().join(format!(
            "multirail-config-test-{}-does-not-exist.json",
            std::process::id()
        ));
        let e = Config::from_file(&path).unwrap_err();
        assert_eq!(e.key, "");
        assert!(e.message.contains(&*path.to_string_lossy()), "{e}");
        assert!(e.message.contains("cannot read"), "{e}");
        let _env = EnvGuard::set(None);
        assert_eq!(Config::load(Some(&path)).unwrap_err(), e);
    }

    #[test]
    fn from_file_validates() {
        let file = TempFile::new("validates", &rdma(r#""numa_penalties": [-1]"#));
        let e = Config::from_file(&file.0).unwrap_err();
        assert_eq!(e.key, "transports.rdma.numa_penalties[0]");
    }

    #[test]
    fn error_display_forms() {
        assert_eq!(
            ConfigError::new("transports.tcp.bogus", "unknown key").to_string(),
            "config key transports.tcp.bogus: unknown key"
        );
        assert_eq!(
            ConfigError::new("", "f.json: cannot read: gone").to_string(),
            "config: f.json: cannot read: gone"
        );
    }
}
