//! What a group is: the configuration a caller passes to `join_group`, checked and completed
//! with the `transports.<t>.multicast` defaults, and the canonical form members compare.

use std::collections::BTreeMap;
use std::time::Duration;

use multirail_policy::coalesce::Batching;

use crate::config::{parse_batching, Config, MulticastConfig, TransportChoice};
use crate::error::{Error, Result};

/// How a group delivers messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Delivery {
    /// Each sender's messages in the order it sent them; no order across senders.
    #[default]
    Unordered,
    /// One total order, the same at every member (Derecho's round robin with null messages),
    /// each message delivered once every member has received it.
    Ordered,
}

impl Delivery {
    fn as_str(self) -> &'static str {
        match self {
            Delivery::Unordered => "unordered",
            Delivery::Ordered => "ordered",
        }
    }
}

/// A multicast group as `Engine::join_group` takes it. Every member passes the same settings;
/// those left `None` come from `transports.<t>.multicast` of the transport the group uses
/// (`transport`, else the engine's `transport` setting; under `auto`, `transports.tcp`).
#[derive(Debug, Clone, Default)]
pub struct GroupConfig {
    /// The group's name, unique among the groups an engine joins.
    pub name: String,
    /// Segment names of every member (as `Engine::segment_name` gives them), in one order all
    /// members agree on; this engine must be one of them.
    pub members: Vec<String>,
    /// The members that send, a subset of `members`; empty means every member sends.
    pub senders: Vec<String>,
    /// Messages a sender may have unacknowledged (Derecho's `window_size`).
    pub window_size: Option<u64>,
    /// Largest message in bytes (Derecho's `max_smc_payload_size`).
    pub max_payload: Option<u64>,
    /// Per-sender FIFO, or one total order.
    pub delivery: Delivery,
    /// `"off"`, `"opportunistic"` or `"k:N"`.
    pub batching: Option<String>,
    /// Longest a held-back push or acknowledgement waits under `k:N`, microseconds.
    pub flush_us: Option<u64>,
    /// The transport the group's writes take; `None` follows the engine's `transport`.
    pub transport: Option<TransportChoice>,
    /// How long `join_group` waits for every member to join, milliseconds (default 30000).
    pub join_timeout_ms: Option<u64>,
}

impl GroupConfig {
    /// A group `name` of `members`, every one a sender, with every other setting defaulted.
    pub fn new(name: impl Into<String>, members: Vec<String>) -> GroupConfig {
        GroupConfig {
            name: name.into(),
            members,
            ..GroupConfig::default()
        }
    }

    /// Checks these settings against an engine configuration without joining (`join_group`
    /// does the same first). Fails with `Error::InvalidArgument` naming the setting at fault.
    pub fn check(&self, engine: &Config) -> Result<()> {
        Settings::resolve(self, engine).map(|_| ())
    }
}

/// A group's settings, checked and completed.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub name: String,
    pub members: Vec<String>,
    /// Member index of each sender, in sender-rank order.
    pub senders: Vec<usize>,
    pub window: u64,
    pub max_payload: u64,
    pub delivery: Delivery,
    pub batching: Batching,
    /// The batching as configured, canonical (`off`, `opportunistic`, `k:N`).
    pub batching_text: String,
    pub flush_us: u64,
    pub transport: Option<TransportChoice>,
    pub join_timeout: Duration,
    /// `transports.tcp.timeout_ms`: how long a member may fail to answer.
    pub timeout: Duration,
}

fn invalid(key: &'static str, reason: impl Into<String>) -> Error {
    Error::invalid(key, reason)
}

impl Settings {
    /// Checks `config` against the engine's `engine` configuration; every error names the
    /// setting at fault.
    pub fn resolve(config: &GroupConfig, engine: &Config) -> Result<Settings> {
        if config.name.is_empty() || config.name.len() > 128 {
            return Err(invalid("name", "must be 1 to 128 bytes"));
        }
        if config.members.len() < 2 {
            return Err(invalid(
                "members",
                format!(
                    "a group needs at least 2 members, got {}",
                    config.members.len()
                ),
            ));
        }
        for (i, m) in config.members.iter().enumerate() {
            if m.is_empty() {
                return Err(invalid("members", format!("member {i} is an empty name")));
            }
            if config.members[..i].contains(m) {
                return Err(invalid("members", format!("{m} is listed twice")));
            }
        }
        let senders: Vec<usize> = if config.senders.is_empty() {
            (0..config.members.len()).collect()
        } else {
            let mut out = Vec::new();
            for s in &config.senders {
                let m = config.members.iter().position(|m| m == s).ok_or_else(|| {
                    invalid("senders", format!("{s} is not among the group's members"))
                })?;
                if out.contains(&m) {
                    return Err(invalid("senders", format!("{s} is listed twice")));
                }
                out.push(m);
            }
            out.sort_unstable();
            out
        };
        let choice = config.transport.unwrap_or(engine.transport);
        let defaults: &MulticastConfig = match choice {
            TransportChoice::Shm => &engine.transports.shm.multicast,
            TransportChoice::Rdma => &engine.transports.rdma.multicast,
            TransportChoice::Tcp | TransportChoice::Auto => &engine.transports.tcp.multicast,
        };
        let window = config.window_size.unwrap_or(defaults.window_size);
        if !(1..=crate::config::MAX_MULTICAST_WINDOW).contains(&window) {
            return Err(invalid(
                "window_size",
                format!(
                    "must be within [1, {}], got {window}",
                    crate::config::MAX_MULTICAST_WINDOW
                ),
            ));
        }
        let max_payload = config.max_payload.unwrap_or(defaults.max_payload);
        if !(1..=crate::config::MAX_MULTICAST_PAYLOAD).contains(&max_payload) {
            return Err(invalid(
                "max_payload",
                format!(
                    "must be within [1, {}], got {max_payload}",
                    crate::config::MAX_MULTICAST_PAYLOAD
                ),
            ));
        }
        let flush_us = config.flush_us.unwrap_or(defaults.flush_us);
        let text = config.batching.as_deref().unwrap_or(&defaults.batching);
        let batching = parse_batching(text, flush_us, window).map_err(|(key, message)| {
            invalid(
                if key == "flush_us" {
                    "flush_us"
                } else {
                    "batching"
                },
                message,
            )
        })?;
        let batching_text = match batching {
            Batching::Off => "off".to_owned(),
            Batching::Opportunistic => "opportunistic".to_owned(),
            Batching::Every { k, .. } => format!("k:{k}"),
        };
        let join_timeout_ms = config.join_timeout_ms.unwrap_or(30_000);
        if join_timeout_ms == 0 {
            return Err(invalid("join_timeout_ms", "must be at least 1"));
        }
        Ok(Settings {
            name: config.name.clone(),
            members: config.members.clone(),
            senders,
            window,
            max_payload,
            delivery: config.delivery,
            batching,
            batching_text,
            flush_us,
            transport: config.transport,
            join_timeout: Duration::from_millis(join_timeout_ms),
            timeout: Duration::from_millis(engine.transports.tcp.timeout_ms),
        })
    }

    /// The settings every member must agree on, key to canonical value.
    pub fn canonical(&self) -> BTreeMap<String, String> {
        let senders: Vec<&str> = self
            .senders
            .iter()
            .map(|&m| self.members[m].as_str())
            .collect();
        let mut out = BTreeMap::new();
        out.insert("members".into(), self.members.join(","));
        out.insert("senders".into(), senders.join(","));
        out.insert("window_size".into(), self.window.to_string());
        out.insert("max_payload".into(), self.max_payload.to_string());
        out.insert("delivery".into(), self.delivery.as_str().into());
        out.insert("batching".into(), self.batching_text.clone());
        out.insert("flush_us".into(), self.flush_us.to_string());
        out
    }

    /// The first setting where `theirs` (member `member`'s published settings) differs from
    /// ours, as an error naming the key and both values.
    pub fn compare(&self, member: &str, theirs: &BTreeMap<String, String>) -> Result<()> {
        let ours = self.canonical();
        for (key, value) in &ours {
            let other = theirs.get(key).map(String::as_str).unwrap_or("(unset)");
            if other != value {
                return Err(Error::GroupJoin {
                    group: self.name.clone(),
                    reason: format!(
                        "member {member} joined with a different {key}: {other} there, {value} here"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Sender rank of member `m`, if it sends.
    pub fn sender_rank(&self, m: usize) -> Option<usize> {
        self.senders.iter().position(|&s| s == m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("127.0.0.1:{}", 1000 + i)).collect()
    }

    fn refused(config: GroupConfig, key: &str) {
        let err = Settings::resolve(&config, &Config::default()).unwrap_err();
        assert!(
            err.to_string().contains(&format!("`{key}`")),
            "expected {key} named: {err}"
        );
    }

    #[test]
    fn defaults_come_from_the_transport_section() {
        let mut engine = Config::default();
        engine.transports.shm.multicast.window_size = 64;
        let mut c = GroupConfig::new("g", members(3));
        c.transport = Some(TransportChoice::Shm);
        let s = Settings::resolve(&c, &engine).unwrap();
        assert_eq!(s.window, 64);
        assert_eq!(s.max_payload, 10240);
        assert_eq!(s.batching, Batching::Opportunistic);
        assert_eq!(s.senders, vec![0, 1, 2]);
        c.transport = Some(TransportChoice::Tcp);
        assert_eq!(Settings::resolve(&c, &engine).unwrap().window, 16);
    }

    #[test]
    fn bad_settings_are_refused_naming_the_key() {
        let base = GroupConfig::new("g", members(3));
        refused(
            GroupConfig {
                members: members(1),
                ..base.clone()
            },
            "members",
        );
        let mut twice = members(2);
        twice.push(twice[0].clone());
        refused(
            GroupConfig {
                members: twice,
                ..base.clone()
            },
            "members",
        );
        refused(
            GroupConfig {
                senders: vec!["nobody:1".into()],
                ..base.clone()
            },
            "senders",
        );
        refused(
            GroupConfig {
                window_size: Some(0),
                ..base.clone()
            },
            "window_size",
        );
        refused(
            GroupConfig {
                max_payload: Some(0),
                ..base.clone()
            },
            "max_payload",
        );
        refused(
            GroupConfig {
                batching: Some("k:17".into()),
                ..base.clone()
            },
            "batching",
        );
        refused(
            GroupConfig {
                batching: Some("sometimes".into()),
                ..base.clone()
            },
            "batching",
        );
        refused(
            GroupConfig {
                batching: Some("k:4".into()),
                flush_us: Some(0),
                ..base.clone()
            },
            "flush_us",
        );
        refused(
            GroupConfig {
                name: String::new(),
                ..base
            },
            "name",
        );
    }

    #[test]
    fn a_differing_setting_is_named_with_both_values() {
        let a = Settings::resolve(&GroupConfig::new("g", members(3)), &Config::default()).unwrap();
        let mut c = GroupConfig::new("g", members(3));
        c.window_size = Some(32);
        let b = Settings::resolve(&c, &Config::default()).unwrap();
        let err = a.compare("m2", &b.canonical()).unwrap_err().to_string();
        assert!(err.contains("window_size: 32 there, 16 here"), "{err}");
        assert!(a.compare("m2", &a.canonical()).is_ok());
    }
}
