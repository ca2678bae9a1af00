//! The configuration's parsing, defaults and validation errors.

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
    assert_eq!(c.workers.wait_spin_us, 1000);
    assert!(c.workers.adaptive_wait_spin);
    assert!(c.rails.is_empty());
    assert_eq!(c.metadata.kind, MetadataKind::P2p);
    assert_eq!(c.metadata.servers, None);
    assert_eq!(c.metadata.prefix, "multirail/");
    assert_eq!(c.metadata.cluster_id, None);
    assert_eq!(c.metadata.timeout_ms, 2000);
    assert_eq!(c.metadata_type, None);
    assert_eq!(c.metadata_servers, None);
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
    assert!(c.transports.shm.nontemporal_copies);
    assert!(c.transports.tcp.nontemporal_copies);
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

// ---- TENT's example documents (its Slice Spraying and QoS docs). ----

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
    // TENT's troubleshooting snippets are fragments of the rdma section.
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
    let e = parse_err(r#"{"metadata": {"type": "redis"}}"#);
    assert_eq!(e.key, "metadata.type");
    assert!(e.message.contains("\"redis\""), "{e}");
    assert!(e.message.contains("http"), "{e}");
    assert!(e.message.contains("etcd"), "{e}");
}

// ---- Metadata store. ----

#[test]
fn etcd_metadata_section() {
    let c = parse(
        r#"{"metadata": {"type": "etcd", "servers": "etcd://10.0.0.1:2379,10.0.0.2:2379",
             "lease_ttl_s": 5, "segment_name": "prefill-0"}}"#,
    )
    .unwrap();
    let m = c.effective_metadata();
    assert_eq!(m.kind, MetadataKind::Etcd);
    assert_eq!(m.lease_ttl_s, 5);
    assert_eq!(m.segment_name.as_deref(), Some("prefill-0"));
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c, "round trip");
    assert_eq!(MetadataConfig::default().lease_ttl_s, 10);
    let e = parse_err(r#"{"metadata": {"type": "etcd"}}"#);
    assert_eq!(e.key, "metadata.servers");
    assert!(e.message.contains("required"), "{e}");
    for (bad, says) in [
        ("http://h:2379", "etcd://HOST:PORT"),
        ("etcd://h", "port"),
        ("etcd://h:2379,", "etcd://HOST:PORT"),
        ("h:0", "bad port"),
    ] {
        let e = parse_err(&format!(
            r#"{{"metadata": {{"type": "etcd", "servers": "{bad}"}}}}"#
        ));
        assert_eq!(e.key, "metadata.servers", "{bad}");
        assert!(e.message.contains(says), "{bad}: {e}");
    }
    for (key, value) in [("lease_ttl_s", 0), ("lease_ttl_s", 3601), ("timeout_ms", 0)] {
        let e = parse_err(&format!(
            r#"{{"metadata": {{"type": "etcd", "servers": "h:1", "{key}": {value}}}}}"#
        ));
        assert_eq!(e.key, format!("metadata.{key}"));
        assert!(e.message.contains("must be within"), "{e}");
    }
    let e = parse_err(r#"{"metadata": {"timeout_ms": 18446744073709551615}}"#);
    assert_eq!(e.key, "metadata.timeout_ms");
    // The last is a tab, escaped in the JSON.
    for bad in ["", "a b", "x\\ty"] {
        let e = parse_err(&format!(
            r#"{{"metadata": {{"type": "etcd", "servers": "h:1", "segment_name": "{bad}"}}}}"#
        ));
        assert_eq!(e.key, "metadata.segment_name", "{bad:?}");
    }
    // Without a store, peers open an engine by host:port: a segment name would be ignored.
    let e = parse_err(r#"{"metadata": {"segment_name": "a"}}"#);
    assert_eq!(e.key, "metadata.segment_name");
    assert!(e.message.contains("needs a metadata store"), "{e}");
}

const META_URL: &str = "http://127.0.0.1:8080/metadata";

#[test]
fn http_metadata_section() {
    let c = parse(&format!(
        r#"{{"metadata": {{"type": "http", "servers": "{META_URL}", "prefix": "x/",
             "cluster_id": "c1", "timeout_ms": 50}}}}"#
    ))
    .unwrap();
    let m = c.effective_metadata();
    assert_eq!(m.kind, MetadataKind::Http);
    assert_eq!(m.servers.as_deref(), Some(META_URL));
    assert_eq!(m.prefix, "x/");
    assert_eq!(m.cluster_id.as_deref(), Some("c1"));
    assert_eq!(m.timeout_ms, 50);
    assert_eq!(m, c.metadata);
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c, "round trip");
    // Mooncake's spelling of peer-to-peer.
    let c = parse(r#"{"metadata": {"type": "P2PHANDSHAKE"}}"#).unwrap();
    assert_eq!(c.metadata.kind, MetadataKind::P2p);
}

#[test]
fn http_metadata_needs_a_good_server() {
    let e = parse_err(r#"{"metadata": {"type": "http"}}"#);
    assert_eq!(e.key, "metadata.servers");
    assert!(e.message.contains("required"), "{e}");
    for (bad, says) in [
        ("127.0.0.1:8080", "http://HOST:PORT/PATH"),
        ("http://127.0.0.1:8080", "path is missing"),
        ("http://127.0.0.1/metadata", "port is missing"),
        ("https://127.0.0.1:8080/metadata", "https is not supported"),
        ("etcd://127.0.0.1:2379", "set metadata.type to \"etcd\""),
        ("http://127.0.0.1:8080/metadata?key=x", "no query"),
    ] {
        let e = parse_err(&format!(
            r#"{{"metadata": {{"type": "http", "servers": "{bad}"}}}}"#
        ));
        assert_eq!(e.key, "metadata.servers", "{bad}");
        assert!(e.message.contains(says), "{bad}: {e}");
        assert!(
            e.to_string().starts_with("config key metadata.servers: "),
            "{e}"
        );
    }
    let e = parse_err(r#"{"metadata": {"type": "http", "servers": 8080}}"#);
    assert_eq!(e.key, "metadata.servers");
    assert!(e.message.contains("invalid type"), "{e}");
}

#[test]
fn metadata_values_checked() {
    let e = parse_err(&format!(
        r#"{{"metadata": {{"type": "http", "servers": "{META_URL}", "timeout_ms": 0}}}}"#
    ));
    assert_eq!(e.key, "metadata.timeout_ms");
    assert!(e.message.contains("must be within [1, 600000]"), "{e}");
    for id in ["", "a/b", "a b"] {
        let e = parse_err(&format!(
            r#"{{"metadata": {{"type": "http", "servers": "{META_URL}", "cluster_id": "{id}"}}}}"#
        ));
        assert_eq!(e.key, "metadata.cluster_id", "{id:?}");
    }
    // A server the engine would ignore is a forgotten type.
    let e = parse_err(&format!(r#"{{"metadata": {{"servers": "{META_URL}"}}}}"#));
    assert_eq!(e.key, "metadata.servers");
    assert!(
        e.message.contains("\"type\" to \"http\" or \"etcd\""),
        "{e}"
    );
    let e = parse_err(r#"{"metadata": {"server": "x"}}"#);
    assert_eq!(e.key, "metadata.server");
    assert!(e.message.starts_with("unknown key"), "{e}");
    assert!(e.message.contains("servers"), "{e}");
}

#[test]
fn tent_flat_metadata_keys() {
    let c = parse(&format!(
        r#"{{"metadata_type": "http", "metadata_servers": "{META_URL}"}}"#
    ))
    .unwrap();
    let m = c.effective_metadata();
    assert_eq!(m.kind, MetadataKind::Http);
    assert_eq!(m.servers.as_deref(), Some(META_URL));
    assert_eq!(m.prefix, "multirail/");
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c, "round trip");
    // Flat keys mix with the section's own.
    let c = parse(&format!(
        r#"{{"metadata_type": "http", "metadata": {{"servers": "{META_URL}", "cluster_id": "a"}}}}"#
    ))
    .unwrap();
    assert_eq!(c.effective_metadata().cluster_id.as_deref(), Some("a"));
    assert_eq!(c.effective_metadata().kind, MetadataKind::Http);
    // TENT files name a server even for p2p, and TENT ignores it there; so do we.
    for servers in ["127.0.0.1:2379", ""] {
        let c = parse(&format!(
            r#"{{"metadata_type": "p2p", "metadata_servers": "{servers}"}}"#
        ))
        .unwrap();
        assert_eq!(c.effective_metadata(), MetadataConfig::default());
    }
    let c = parse(r#"{"metadata_type": "P2PHANDSHAKE"}"#).unwrap();
    assert_eq!(c.effective_metadata().kind, MetadataKind::P2p);
    // Errors name the flat key the value came from.
    let e = parse_err(r#"{"metadata_type": "http", "metadata_servers": "h:8080"}"#);
    assert_eq!(e.key, "metadata_servers");
    assert!(e.message.contains("http://HOST:PORT/PATH"), "{e}");
    let e = parse_err(r#"{"metadata_type": "http", "metadata_servers": ""}"#);
    assert_eq!(e.key, "metadata.servers");
    let c = parse(r#"{"metadata_type": "etcd", "metadata_servers": "h:2379,g:2379"}"#).unwrap();
    assert_eq!(c.effective_metadata().kind, MetadataKind::Etcd);
    assert_eq!(
        c.effective_metadata().servers.as_deref(),
        Some("h:2379,g:2379")
    );
    let e = parse_err(r#"{"metadata_type": "etcd", "metadata_servers": "http://h:2379"}"#);
    assert_eq!(e.key, "metadata_servers");
    assert!(e.message.contains("etcd://HOST:PORT"), "{e}");
    // The two spellings must agree.
    let e = parse_err(&format!(
        r#"{{"metadata_type": "p2p", "metadata": {{"type": "http", "servers": "{META_URL}"}}}}"#
    ));
    assert_eq!(e.key, "metadata_type");
    assert!(e.message.contains("give one of them"), "{e}");
    let e = parse_err(&format!(
        r#"{{"metadata_servers": "http://a:1/m", "metadata": {{"type": "http", "servers": "{META_URL}"}}}}"#
    ));
    assert_eq!(e.key, "metadata_servers");
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
fn bandwidth_estimator_keys() {
    let d = RdmaConfig::default();
    assert_eq!(d.bandwidth_estimator, "delivery");
    assert_eq!(d.bandwidth_window_us, 20_000);
    let sel = d.selector_config();
    assert_eq!(
        sel.estimator,
        multirail_policy::selector::BandwidthEstimator::Delivery
    );
    assert_eq!(sel.bandwidth_window_ns, 20_000_000);
    let c = parse(&rdma(
        r#""bandwidth_estimator": "tent", "bandwidth_window_us": 0"#,
    ))
    .unwrap();
    let sel = c.transports.rdma.selector_config();
    assert_eq!(
        sel.estimator,
        multirail_policy::selector::BandwidthEstimator::Tent
    );
    assert_eq!(sel.bandwidth_window_ns, 0);
    let e = parse_err(&rdma(r#""bandwidth_estimator": "bbr""#));
    assert_eq!(e.key, "transports.rdma.bandwidth_estimator");
    assert!(e.message.contains("\"delivery\" or \"tent\""), "{e}");
    let e = parse_err(&rdma(r#""bandwidth_window_us": 10000001"#));
    assert_eq!(e.key, "transports.rdma.bandwidth_window_us");
    assert_eq!(d.bandwidth_sample_min_bytes, 1 << 20);
    assert_eq!(d.selector_config().min_sample_bytes, 1 << 20);
    let c = parse(&rdma(r#""bandwidth_sample_min_bytes": 0"#)).unwrap();
    assert_eq!(c.transports.rdma.selector_config().min_sample_bytes, 0);
    let e = parse_err(&rdma(r#""bandwidth_sample_min_bytes": 1073741825"#));
    assert_eq!(e.key, "transports.rdma.bandwidth_sample_min_bytes");
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
    let e = parse_err(r#"{"rails": [{"name": "a", "address": "10.0.0.1", "bandwidth_gbps": 0}]}"#);
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
    let e = Config::from_json_str("{\n  \"transport\": \"tcp\",\n}", "MULTIRAIL_CONF").unwrap_err();
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
    let e = parse_err(r#"{"rails": [{"name": "a", "address": "10.0.0.1"}, ["b", "10.0.0.2"]]}"#);
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
    let c =
        Config::from_json_str(r#"{"workers": {"window": {"controller": "fixed"}}}"#, "t").unwrap();
    assert_eq!(
        c.workers.dispatch_config().controller,
        dispatch::ControllerKind::Fixed(dispatch::FixedController { bytes: 4 << 20 })
    );
    // The defaults are the policy crate's, written once.
    assert_eq!(
        Config::default().workers.dispatch_config().controller,
        dispatch::ControllerKind::default()
    );
    // The full window's pipes are of at least a slice of `workers.block_size`.
    let c = Config::from_json_str(r#"{"workers": {"block_size": 16384}}"#, "t").unwrap();
    match c.workers.dispatch_config().controller {
        dispatch::ControllerKind::Bdp(b) => assert_eq!(b.pipe_slice, 16384),
        other => panic!("{other:?}"),
    }
}

#[test]
fn merging_adjacent_requests_is_bounded_and_can_be_turned_off() {
    let parse = |doc: &str| Config::from_json_str(doc, "test");
    assert_eq!(
        Config::default().workers.merge_adjacent_max_bytes,
        1 << 20,
        "merged runs of up to 1 MiB by default"
    );
    let off = parse(r#"{"workers": {"merge_adjacent_max_bytes": 0}}"#).unwrap();
    assert_eq!(off.workers.merge_adjacent_max_bytes, 0);
    let most = parse(r#"{"workers": {"merge_adjacent_max_bytes": 67108864}}"#).unwrap();
    assert_eq!(most.workers.merge_adjacent_max_bytes, 64 << 20);
    let e = parse(r#"{"workers": {"merge_adjacent_max_bytes": 67108865}}"#).unwrap_err();
    assert_eq!(e.key, "workers.merge_adjacent_max_bytes");
    assert!(e.to_string().contains("at most"), "{e}");
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

#[test]
fn rdma_transport_settings_are_checked_and_name_their_key() {
    let key = |body: &str| parse_err(&rdma(body)).key;
    assert_eq!(
        key(r#""devices": ["mlx5_0/0"]"#),
        "transports.rdma.devices[0]"
    );
    assert_eq!(key(r#""devices": ["", "x"]"#), "transports.rdma.devices[0]");
    assert_eq!(
        key(r#""max_endpoints": 0"#),
        "transports.rdma.max_endpoints"
    );
    assert_eq!(key(r#""max_wr": 8"#), "transports.rdma.max_wr");
    assert_eq!(
        key(r#""receive": {"max_sge": 0}"#),
        "transports.rdma.receive.max_sge"
    );
    assert_eq!(
        key(r#""receive": {"queue_depth": 63, "registration_chunks": 2}"#),
        "transports.rdma.receive.registration_chunks"
    );
    assert_eq!(
        key(r#""receive": {"spin_us": 1000001}"#),
        "transports.rdma.receive.spin_us"
    );
    assert_eq!(
        key(r#""max_inline_data": 5000"#),
        "transports.rdma.max_inline_data"
    );
    assert_eq!(
        key(r#""signal_interval": 200"#),
        "transports.rdma.signal_interval"
    );
    assert_eq!(key(r#""mtu": 1500"#), "transports.rdma.mtu");
    assert_eq!(key(r#""gid_index": -2"#), "transports.rdma.gid_index");
    assert_eq!(key(r#""qp_timeout": 0"#), "transports.rdma.qp_timeout");
    assert_eq!(key(r#""retry_cnt": 8"#), "transports.rdma.retry_cnt");
    assert_eq!(key(r#""lean_bdps": 0"#), "transports.rdma.lean_bdps");
    let c = parse(&rdma(r#""devices": ["rxe_a", "mlx5_1/2"], "lean_bdps": 3"#)).unwrap();
    assert_eq!(c.transports.rdma.devices, ["rxe_a", "mlx5_1/2"]);
    // RAMCloud's receive path: an SRQ of 63 buffers per device.
    let r = &c.transports.rdma.receive;
    assert_eq!((r.queue_depth, r.shared_receive_queue), (63, true));
    assert_eq!((r.registration_chunks, r.max_sge), (1, 1));
    // RDMA rails take their own lean window; everything else comes from `workers`.
    let d = c.rdma_dispatch_config(5);
    assert_eq!(d.max_retries, 5);
    match d.controller {
        dispatch::ControllerKind::Bdp(b) => assert_eq!(b.lean_bdps, 3.0),
        other => panic!("{other:?}"),
    }
    let tcp = c.workers.dispatch_config();
    match tcp.controller {
        dispatch::ControllerKind::Bdp(b) => assert_eq!(b.lean_bdps, 1.0),
        other => panic!("{other:?}"),
    }
}

#[test]
fn lanes_keys_are_checked_and_named() {
    let c =
        Config::from_json_str(r#"{"lanes": {"max_dedicated": 4, "dynamic": false}}"#, "t").unwrap();
    assert_eq!(c.lanes.max_dedicated, 4);
    assert!(!c.lanes.dynamic);
    assert_eq!(c.lanes.negotiation().max_dedicated, 4);
    assert_eq!(c.lanes.usage().switch_interval_ns, Some(1_000_000));
    for (json, key) in [
        (
            r#"{"lanes": {"max_dedicated": 100000}}"#,
            "lanes.max_dedicated",
        ),
        (r#"{"lanes": {"min_score": 1.5}}"#, "lanes.min_score"),
        (r#"{"lanes": {"remove_thresh": -1}}"#, "lanes.remove_thresh"),
        (
            r#"{"lanes": {"switch_interval_us": 0}}"#,
            "lanes.switch_interval_us",
        ),
        (
            r#"{"lanes": {"progress_factor": 0}}"#,
            "lanes.progress_factor",
        ),
        (r#"{"lanes": {"sample_period": 0}}"#, "lanes.sample_period"),
        (
            r#"{"lanes": {"promote_thresh": 30}}"#,
            "lanes.promote_thresh",
        ),
        (
            r#"{"lanes": {"decay_multiplier": 2}}"#,
            "lanes.decay_multiplier",
        ),
        (
            r#"{"lanes": {"deny_backoff_ms": 0}}"#,
            "lanes.deny_backoff_ms",
        ),
        (
            r#"{"lanes": {"request_timeout_ms": 0}}"#,
            "lanes.request_timeout_ms",
        ),
        (r#"{"lanes": {"bogus": 1}}"#, "lanes.bogus"),
        (r#"{"lanes": [1]}"#, "lanes"),
    ] {
        let e = Config::from_json_str(json, "t").unwrap_err();
        assert_eq!(e.key, key, "{json}: {e}");
    }
}

#[test]
fn a_metadata_server_argument_replaces_the_configured_store() {
    let mut c = Config::from_json_str(
        r#"{"metadata_type": "p2p", "metadata": {"type": "p2p"}}"#,
        "t",
    )
    .unwrap();
    c.use_metadata_server("http://127.0.0.1:8080/metadata")
        .unwrap();
    assert_eq!(c.metadata.kind, MetadataKind::Http);
    assert_eq!(
        c.effective_metadata().servers.as_deref(),
        Some("http://127.0.0.1:8080/metadata")
    );
    c.use_metadata_server("P2PHANDSHAKE").unwrap();
    assert_eq!(c.effective_metadata().kind, MetadataKind::P2p);
    assert_eq!(c.metadata.servers, None);
    // As Mooncake reads it: etcd:// or a bare host:port is etcd.
    for etcd in ["etcd://127.0.0.1:2379", "127.0.0.1:2379", "a:1,b:2"] {
        c.use_metadata_server(etcd).unwrap();
        assert_eq!(c.effective_metadata().kind, MetadataKind::Etcd);
        assert_eq!(c.effective_metadata().servers.as_deref(), Some(etcd));
        c.validate().unwrap();
    }
    for bad in ["https://x:1/m", "zk://h:1", ""] {
        let e = c.use_metadata_server(bad).unwrap_err();
        assert!(e.contains("P2PHANDSHAKE") && e.contains("etcd://"), "{e}");
    }
}

#[test]
fn stream_pause_and_shm_inline_bytes_have_defaults_and_bounds() {
    let c = Config::default();
    assert_eq!(c.transports.tcp.stream_pause_us, 6);
    assert_eq!(c.transports.shm.inline_bytes, 16 << 10);
    let c = Config::from_json_str(
        r#"{"transports": {"tcp": {"stream_pause_us": 0, "nontemporal_copies": false},
                           "shm": {"inline_bytes": 0, "nontemporal_copies": false}}}"#,
        "t",
    )
    .unwrap();
    assert_eq!(c.transports.tcp.stream_pause_us, 0);
    assert_eq!(c.transports.shm.inline_bytes, 0);
    assert!(!c.transports.shm.nontemporal_copies);
    assert!(!c.transports.tcp.nontemporal_copies);
    let err = Config::from_json_str(r#"{"transports": {"shm": {"nontemporal_copies": 1}}}"#, "t")
        .unwrap_err()
        .to_string();
    assert!(err.contains("nontemporal_copies"), "{err}");
    let err = Config::from_json_str(r#"{"transports": {"tcp": {"stream_pause_us": 1001}}}"#, "t")
        .unwrap_err()
        .to_string();
    assert!(err.contains("transports.tcp.stream_pause_us"), "{err}");
}

#[test]
fn receive_spin_defaults_and_is_checked_naming_its_key() {
    let c = parse("{}").unwrap();
    for r in [
        &c.transports.tcp.receive,
        &c.transports.shm.receive,
        &c.transports.rdma.receive,
    ] {
        assert_eq!((r.spin_us, r.adaptive_spin), (200, true));
        assert_eq!(r.cadence_lead_us, 200);
        assert!(r.leave_shared_cpu);
    }
    let c = parse(
        r#"{"transports": {"shm": {"receive": {"spin_us": 0, "adaptive_spin": false}},
                           "tcp": {"receive": {"spin_us": 1000000}}}}"#,
    )
    .unwrap();
    assert_eq!(c.transports.shm.receive.spin_us, 0);
    assert!(!c.transports.shm.receive.adaptive_spin);
    assert_eq!(c.transports.tcp.receive.spin_us, 1_000_000);
    for t in ["tcp", "shm"] {
        let e = parse_err(&format!(
            r#"{{"transports": {{"{t}": {{"receive": {{"spin_us": 2000000}}}}}}}}"#
        ));
        assert_eq!(e.key, format!("transports.{t}.receive.spin_us"));
        let e = parse_err(&format!(
            r#"{{"transports": {{"{t}": {{"receive": {{"cadence_lead_us": 100001}}}}}}}}"#
        ));
        assert_eq!(e.key, format!("transports.{t}.receive.cadence_lead_us"));
        assert!(e.message.contains("100001"), "{}", e.message);
    }
    let c = parse(r#"{"transports": {"rdma": {"receive": {"cadence_lead_us": 0}}}}"#).unwrap();
    assert_eq!(c.transports.rdma.receive.cadence_lead_us, 0);
    let c = parse(r#"{"transports": {"shm": {"receive": {"leave_shared_cpu": false}}}}"#).unwrap();
    assert!(!c.transports.shm.receive.leave_shared_cpu);
    assert!(c.transports.tcp.receive.leave_shared_cpu);
    let e = parse_err(r#"{"transports": {"shm": {"receive": {"leave_shared_cpu": 1}}}}"#);
    assert!(e.key.contains("leave_shared_cpu"), "{}", e.key);
}
