//! Engine configuration: one JSON document, TENT's keys plus multirail's own.
//!
//! `transports.rdma.*` carries TENT's scheduling and QoS keys unchanged so a TENT
//! configuration file works as is; they apply to every transport that carries rails
//! (TCP too). TENT's flat `metadata_type` and `metadata_servers` are accepted as spellings of
//! `metadata.type` and `metadata.servers`. multirail's own keys sit beside them: `rails`,
//! `metadata`, `workers`, `transports.tcp`, `transports.shm`, `transport`, `local_hostname`.
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

pub use crate::error::ConfigError;

mod auth;
mod lanes;
mod metadata_servers;
mod multicast;
mod rail;
mod rdma;
mod receive;
mod shm;
mod tcp;
#[cfg(test)]
mod tests;
mod workers;

pub use auth::*;
pub use lanes::*;
pub use metadata_servers::DEFAULT_LEASE_TTL_S;
pub(crate) use metadata_servers::{check_server_url, parse_etcd_endpoints};
pub use multicast::*;
pub use rail::*;
pub use rdma::*;
pub use receive::*;
pub use shm::*;
pub use tcp::*;
pub use workers::*;

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
    /// Always RDMA (verbs); fails when this engine or the peer has no RDMA device.
    Rdma,
}

impl TransportChoice {
    /// The JSON spelling of this choice (`"auto"`, `"tcp"`, `"shm"`).
    pub fn as_str(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Shm => "shm",
            TransportChoice::Rdma => "rdma",
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
    /// TENT's flat `metadata_type` (`"p2p"`, `"http"`, `"etcd"`): the same as `metadata.type`, which it
    /// overrides when that is left at `"p2p"`. See [`Config::effective_metadata`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata_type: Option<MetadataKind>,
    /// TENT's flat `metadata_servers`: the same as `metadata.servers`. An empty string counts as
    /// unset, and with `p2p` it is ignored, as TENT does (its files often carry one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata_servers: Option<String>,
    /// Per-transport settings; `rdma` holds TENT's scheduling keys.
    pub transports: TransportsConfig,
    /// Who may connect: the cluster's membership token.
    pub auth: AuthConfig,
    /// Dynamic lanes for small messages: dedicated lanes for the busiest peers.
    pub lanes: DynamicLanesConfig,
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
            metadata_type: None,
            metadata_servers: None,
            transports: TransportsConfig::default(),
            auth: AuthConfig::default(),
            lanes: DynamicLanesConfig::default(),
        }
    }
}

/// Kind of metadata service used to find peers' segments.
///
/// Parsed from `"p2p"` (also TENT's and Mooncake's `"P2PHANDSHAKE"`) or `"http"`; `"etcd"` is
/// refused with a message saying it is not supported yet. Printed in lowercase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum MetadataKind {
    /// Peers exchange descriptors directly; a segment name `host:port` is enough to connect.
    #[default]
    P2p,
    /// A Mooncake-compatible HTTP metadata server (`metadata.servers`) holds every descriptor.
    Http,
    /// An etcd cluster (`metadata.servers`) holds every descriptor, each engine's on a lease it
    /// keeps alive; a watch tells engines of segments published again.
    Etcd,
}

impl MetadataKind {
    /// The JSON spelling of this kind (`"p2p"`, `"http"`).
    pub fn as_str(self) -> &'static str {
        match self {
            MetadataKind::P2p => "p2p",
            MetadataKind::Http => "http",
            MetadataKind::Etcd => "etcd",
        }
    }
}

impl fmt::Display for MetadataKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl TryFrom<String> for MetadataKind {
    type Error = String;

    /// Fails with a message the configuration error carries under the key being parsed.
    fn try_from(value: String) -> Result<Self, String> {
        match value.as_str() {
            // TENT spells peer-to-peer `p2p`; Mooncake's engines pass `P2PHANDSHAKE`.
            "p2p" | "P2PHANDSHAKE" => Ok(MetadataKind::P2p),
            "http" => Ok(MetadataKind::Http),
            "etcd" => Ok(MetadataKind::Etcd),
            other => Err(format!(
                "unknown metadata type {other:?}; expected \"p2p\", \"http\" or \"etcd\""
            )),
        }
    }
}

/// Default of `metadata.prefix`: keys never collide with Mooncake's own `mooncake/` keys in a
/// shared store.
pub const DEFAULT_METADATA_PREFIX: &str = "multirail/";

/// Default of `metadata.timeout_ms`.
pub const DEFAULT_METADATA_TIMEOUT_MS: u64 = 2000;
/// Largest `metadata.timeout_ms`: ten minutes, beyond which a lookup is a hang.
pub const MAX_METADATA_TIMEOUT_MS: u64 = 600_000;
/// Largest `metadata.lease_ttl_s`: an hour, beyond which a dead engine lingers in the store
/// for longer than any operator would wait.
pub const MAX_LEASE_TTL_S: u64 = 3600;

/// Metadata service settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetadataConfig {
    /// JSON key `type`: `"p2p"` (default), `"http"` or `"etcd"`.
    #[serde(rename = "type")]
    pub kind: MetadataKind,
    /// The store: with `type: "http"` the server, `http://HOST:PORT/PATH` (Mooncake's is
    /// `http://HOST:8080/metadata`); with `"etcd"` the cluster, `etcd://HOST:PORT[,HOST:PORT]`
    /// (or without `etcd://`). Required with either, refused with `"p2p"`.
    pub servers: Option<String>,
    /// Prefix of every key this engine writes and reads; default `multirail/`.
    pub prefix: String,
    /// Optional cluster id: keys then live under `prefix + cluster_id + "/"`, as with
    /// Mooncake's `MC_METADATA_CLUSTER_ID`, so clusters sharing a store do not see each other.
    pub cluster_id: Option<String>,
    /// How long one request to the metadata store may take, connecting included, before
    /// the lookup (or publish) fails; default 2000, at most 600000 (10 minutes). P2P lookups
    /// keep `transports.tcp`'s `connect_timeout_ms` and `timeout_ms`.
    pub timeout_ms: u64,
    /// With etcd, how soon the keys of an engine that dies without withdrawing them are gone,
    /// in seconds: they hang on a lease the engine keeps alive, granted a second shorter so
    /// etcd's half-second expiry pass fits within it. With either store, the engine renews
    /// what it published every third of this (etcd: the lease; HTTP: a PUT of its
    /// descriptor, which a server restarted without its data, or one that expires keys,
    /// needs), and retries with capped exponential back-off while the store does not
    /// answer. Default 10, range 1 to 3600.
    pub lease_ttl_s: u64,
    /// The name this engine is published under in a store (`http`, `etcd`), which peers pass
    /// to `open_segment`, as Mooncake's `local_hostname`; default: its `host:port`. A name
    /// that outlives the port lets a restarted engine be found again on its new one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub segment_name: Option<String>,
}

impl Default for MetadataConfig {
    fn default() -> Self {
        MetadataConfig {
            kind: MetadataKind::P2p,
            servers: None,
            prefix: DEFAULT_METADATA_PREFIX.to_owned(),
            cluster_id: None,
            timeout_ms: DEFAULT_METADATA_TIMEOUT_MS,
            lease_ttl_s: DEFAULT_LEASE_TTL_S,
            segment_name: None,
        }
    }
}

impl MetadataConfig {
    /// Checks the section; `prefix` is its dotted path (`metadata`) and `servers_key` the key
    /// the server address came from (`metadata.servers`, or TENT's `metadata_servers`).
    ///
    /// Fails on `type: "http"` or `"etcd"` without a server, a server address of the wrong
    /// form, a server or `segment_name` given with `type: "p2p"`, an empty or `/`-holding
    /// `cluster_id`, a `segment_name` empty or holding whitespace, and `timeout_ms` or
    /// `lease_ttl_s` 0.
    fn validate(&self, prefix: &str, servers_key: &str) -> Result<(), ConfigError> {
        match (self.kind, &self.servers) {
            (MetadataKind::Http, None) => {
                return Err(ConfigError::new(
                    servers_key,
                    "is required when metadata.type is \"http\" (e.g. \"http://HOST:8080/metadata\")",
                ))
            }
            (MetadataKind::Http, Some(url)) => check_server_url(url)
                .map_err(|message| ConfigError::new(servers_key, message))?,
            (MetadataKind::Etcd, None) => {
                return Err(ConfigError::new(
                    servers_key,
                    "is required when metadata.type is \"etcd\" (e.g. \"etcd://HOST:2379\")",
                ))
            }
            (MetadataKind::Etcd, Some(list)) => {
                parse_etcd_endpoints(list)
                    .map_err(|message| ConfigError::new(servers_key, message))?;
            }
            // A server the engine would silently ignore is a forgotten `type`.
            (MetadataKind::P2p, Some(_)) => {
                return Err(ConfigError::new(
                    servers_key,
                    "is set but metadata.type is \"p2p\", which asks peers directly; set \"type\" to \"http\" or \"etcd\" to use the server",
                ))
            }
            (MetadataKind::P2p, None) => {}
        }
        if let Some(name) = &self.segment_name {
            if self.kind == MetadataKind::P2p {
                return Err(ConfigError::new(
                    format!("{prefix}.segment_name"),
                    "needs a metadata store (type \"http\" or \"etcd\"): with \"p2p\" peers open an engine by its host:port",
                ));
            }
            if name.is_empty()
                || name.len() > 256
                || name.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return Err(ConfigError::new(
                    format!("{prefix}.segment_name"),
                    format!(
                        "must be a name of 1 to 256 characters without whitespace, got {name:?}"
                    ),
                ));
            }
        }
        within(prefix, "lease_ttl_s", self.lease_ttl_s, 1..=MAX_LEASE_TTL_S)?;
        if let Some(id) = &self.cluster_id {
            if id.is_empty() || id.contains('/') || id.chars().any(char::is_whitespace) {
                return Err(ConfigError::new(
                    format!("{prefix}.cluster_id"),
                    format!("must be a non-empty name without `/` or whitespace, got {id:?}"),
                ));
            }
        }
        within(
            prefix,
            "timeout_ms",
            self.timeout_ms,
            1..=MAX_METADATA_TIMEOUT_MS,
        )
    }
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
    /// taken from the variable the origin reads `PATH (from MULTIRAIL_CONF)`. Also fails when
    /// the membership token in force is unusable ([`AuthConfig::effective_token`]), so an
    /// empty `MULTIRAIL_TOKEN` stops a command before it starts an open engine.
    pub fn load(explicit_path: Option<&Path>) -> Result<Config, ConfigError> {
        let config = Self::load_unchecked_token(explicit_path)?;
        config.auth.effective_token()?;
        Ok(config)
    }

    fn load_unchecked_token(explicit_path: Option<&Path>) -> Result<Config, ConfigError> {
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
    /// The dispatcher settings of RDMA rails: the workers' (`workers.*`), with the lean window
    /// of `transports.rdma.lean_bdps` and `max_retries` retries.
    pub fn rdma_dispatch_config(&self, max_retries: u32) -> dispatch::DispatchConfig {
        let mut d = self.workers.dispatch_config();
        d.max_retries = max_retries;
        if let dispatch::ControllerKind::Bdp(bdp) = &mut d.controller {
            bdp.lean_bdps = self.transports.rdma.lean_bdps.min(bdp.window_bdps);
        }
        d
    }

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
                .parse::<crate::segment::Location>()
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
        self.validate_metadata()?;
        self.transports.rdma.validate("transports.rdma")?;
        self.transports.tcp.validate("transports.tcp")?;
        if let Some(token) = &self.auth.token {
            check_token("auth.token", token.expose())?;
        }
        self.transports
            .shm
            .receive
            .validate("transports.shm.receive")?;
        self.transports
            .shm
            .multicast
            .validate("transports.shm.multicast")?;
        self.lanes.validate("lanes")?;
        Ok(())
    }

    /// Points the configuration at the metadata store `server` names, as Mooncake's
    /// `metadata_server` argument does: `"P2PHANDSHAKE"` (or `"p2p"`) asks each segment itself,
    /// `"http://HOST:PORT/PATH"` a metadata server, `"etcd://HOST:PORT[,HOST:PORT]"` or a bare
    /// `"HOST:PORT[,...]"` an etcd cluster. Replaces whatever the configuration said, TENT's
    /// flat keys included; the address itself is checked when the engine starts. Fails on
    /// anything else, saying what is expected.
    pub fn use_metadata_server(&mut self, server: &str) -> Result<(), String> {
        let (kind, servers) = if server == "P2PHANDSHAKE" || server == "p2p" {
            (MetadataKind::P2p, None)
        } else if server.starts_with("http://") {
            (MetadataKind::Http, Some(server.to_owned()))
        } else if server.starts_with("etcd://") || (!server.is_empty() && !server.contains("://")) {
            (MetadataKind::Etcd, Some(server.to_owned()))
        } else {
            return Err(format!(
                "expected \"P2PHANDSHAKE\", \"http://HOST:PORT/PATH\" or \"etcd://HOST:PORT\", got {server:?}"
            ));
        };
        self.metadata.kind = kind;
        self.metadata.servers = servers;
        self.metadata_type = None;
        self.metadata_servers = None;
        Ok(())
    }

    /// The metadata settings the engine uses: the `metadata` section with TENT's flat keys
    /// folded in (`metadata_type` replaces a `metadata.type` left at `"p2p"`; a non-empty
    /// `metadata_servers` fills `metadata.servers` when the type is `"http"` or `"etcd"`).
    /// Never fails; [`Config::validate`] refuses the combinations that conflict.
    pub fn effective_metadata(&self) -> MetadataConfig {
        let mut m = self.metadata.clone();
        if let Some(kind) = self.metadata_type {
            if m.kind == MetadataKind::P2p {
                m.kind = kind;
            }
        }
        if m.kind != MetadataKind::P2p && m.servers.is_none() {
            m.servers = self.tent_servers().map(str::to_owned);
        }
        m
    }

    /// TENT's `metadata_servers`, unless empty.
    fn tent_servers(&self) -> Option<&str> {
        self.metadata_servers.as_deref().filter(|s| !s.is_empty())
    }

    /// The `metadata` section and TENT's flat keys agree, and what they give together is
    /// valid; errors name the key the offending value came from.
    fn validate_metadata(&self) -> Result<(), ConfigError> {
        if let Some(kind) = self.metadata_type {
            if self.metadata.kind != MetadataKind::P2p && self.metadata.kind != kind {
                return Err(ConfigError::new(
                    "metadata_type",
                    format!(
                        "is {:?} but metadata.type is {:?}; give one of them",
                        kind.as_str(),
                        self.metadata.kind.as_str()
                    ),
                ));
            }
        }
        if let (Some(flat), Some(section)) = (self.tent_servers(), &self.metadata.servers) {
            if flat != section {
                return Err(ConfigError::new(
                    "metadata_servers",
                    format!("is {flat:?} but metadata.servers is {section:?}; give one of them"),
                ));
            }
        }
        let effective = self.effective_metadata();
        // Name the key the server address was written under.
        let servers_key = if self.metadata.servers.is_none() && self.tent_servers().is_some() {
            "metadata_servers"
        } else {
            "metadata.servers"
        };
        if effective.kind == MetadataKind::P2p && self.metadata.servers.is_none() {
            // TENT files carry `metadata_servers` even with p2p; TENT ignores it there.
            return MetadataConfig {
                servers: None,
                ..effective
            }
            .validate("metadata", servers_key);
        }
        effective.validate("metadata", servers_key)
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

pub(crate) fn finite(prefix: &str, name: &str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{prefix}.{name}"),
            format!("must be a finite number, got {value}"),
        ))
    }
}

pub(crate) fn positive(prefix: &str, name: &str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{prefix}.{name}"),
            format!("must be a finite number greater than 0, got {value}"),
        ))
    }
}

pub(crate) fn at_least_one(prefix: &str, name: &str, value: u64) -> Result<(), ConfigError> {
    if value >= 1 {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{prefix}.{name}"),
            format!("must be at least 1, got {value}"),
        ))
    }
}

/// Checks that `value` of key `prefix.name` lies in `range`; the error names the key and range.
pub(crate) fn within(
    prefix: &str,
    name: &str,
    value: u64,
    range: std::ops::RangeInclusive<u64>,
) -> Result<(), ConfigError> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{prefix}.{name}"),
            format!(
                "must be within [{}, {}], got {value}",
                range.start(),
                range.end()
            ),
        ))
    }
}

pub(crate) fn within_count(prefix: &str, name: &str, value: usize) -> Result<(), ConfigError> {
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
pub(crate) fn require_objects(doc: &serde_json::Value, origin: &str) -> Result<(), ConfigError> {
    const SECTIONS: &[&str] = &[
        "workers",
        "metadata",
        "auth",
        "lanes",
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

pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
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
pub(crate) fn serde_error(path: String, err: serde_json::Error, origin: &str) -> ConfigError {
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

pub(crate) fn describe_data_error(path: String, msg: &str, origin: &str) -> ConfigError {
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
