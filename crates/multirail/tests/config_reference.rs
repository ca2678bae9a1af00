//! The configuration reference, `docs/configuration.md`, names every key the engine accepts.
//!
//! The keys are taken from the configuration itself: `Config::default()` printed as
//! `multirail config show` prints it, plus one document that fills in what the default leaves
//! out (a `rails` entry, `metadata.segment_name`, TENT's flat `metadata_type` and
//! `metadata_servers`). Every key path must appear in the reference in backticks, written as
//! a dotted path (`transports.tcp.timeout_ms`); the members of an array of objects are written
//! once, with `[]` (`rails[].name`); sections count as keys (`transports.tcp`). The other way
//! round, a dotted path the reference names in backticks must be a real key, so a key that is
//! renamed or removed does not live on in the document.
//!
//! The reference is read when the test runs, so editing it needs no rebuild.

use std::collections::BTreeSet;
use std::path::PathBuf;

use multirail::Config;
use serde_json::Value;

/// The reference, relative to the repository's root.
const REFERENCE: &str = "docs/configuration.md";

fn reference_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(REFERENCE)
}

/// Every span between backticks in the reference.
fn backticked(doc: &str) -> BTreeSet<String> {
    doc.split('`')
        .skip(1)
        .step_by(2)
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Every key path of `value` under `prefix`: objects' members as `prefix.key`, the members of
/// an array's objects as `prefix[].key`; each section is a key too. `tiers` is a map whose
/// keys are the user's (memory locations and rail names), so its own members are not keys.
fn key_paths(prefix: &str, value: &Value, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) if prefix != "tiers" => {
            for (key, member) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                out.insert(path.clone());
                key_paths(&path, member, out);
            }
        }
        Value::Array(items) => {
            for item in items.iter().filter(|i| i.is_object()) {
                key_paths(&format!("{prefix}[]"), item, out);
            }
        }
        _ => {}
    }
}

/// The key paths of a configuration as `multirail config show` prints it.
fn keys_of(config: &Config) -> BTreeSet<String> {
    let json: Value =
        serde_json::from_str(&config.to_json_pretty()).expect("config show prints JSON");
    let mut out = BTreeSet::new();
    key_paths("", &json, &mut out);
    out
}

/// Every key the engine accepts: the default document's, and those it leaves out.
fn every_key() -> BTreeSet<String> {
    let mut keys = keys_of(&Config::default());
    let filled = Config::from_json_str(
        r#"{
            "rails": [{"name": "eth0", "address": "10.0.0.1", "numa_node": 0, "bandwidth_gbps": 100}],
            "metadata_type": "http",
            "metadata_servers": "http://127.0.0.1:8080/metadata",
            "metadata": {"segment_name": "node-a"}
        }"#,
        "config_reference test",
    )
    .expect("the filled-in document is valid");
    keys.extend(keys_of(&filled));
    keys
}

/// `path` with element indices dropped (`numa_penalties[1]` names `numa_penalties`); the `[]`
/// of an array of objects stays.
fn without_indices(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(open) = rest.find('[') {
        let close = rest[open..].find(']').map_or(rest.len(), |c| open + c);
        out.push_str(&rest[..open]);
        if close == open + 1 {
            out.push_str("[]");
        }
        rest = &rest[(close + 1).min(rest.len())..];
    }
    out.push_str(rest);
    out
}

#[test]
fn every_key_config_show_prints_is_in_the_reference() {
    let path = reference_path();
    let doc = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let named = backticked(&doc);
    let keys = every_key();
    // The walk itself works: a few keys every version has.
    for sure in [
        "transports.tcp.timeout_ms",
        "workers.window.bdps",
        "rails[].address",
        "tiers",
    ] {
        assert!(keys.contains(sure), "key walk lost {sure}: {keys:?}");
    }
    let missing: Vec<&String> = keys.iter().filter(|k| !named.contains(*k)).collect();
    assert!(
        missing.is_empty(),
        "{REFERENCE} does not mention these configuration keys (write each as `key.path` in \
         backticks, with its default, range and meaning):\n  {}",
        missing
            .iter()
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

#[test]
fn every_key_path_the_reference_names_exists() {
    let path = reference_path();
    let doc = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let keys = every_key();
    let sections = [
        "workers.",
        "transports.",
        "metadata.",
        "lanes.",
        "auth.",
        "rails[].",
    ];
    // A span that is nothing but a dotted path under a section (no placeholders such as
    // `<tcp|shm>`, no values) claims to be a key; an index (`numa_penalties[1]`) names an
    // element of one.
    let looks_like_key = |s: &str| {
        sections.iter().any(|p| s.starts_with(p))
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.[]".contains(c))
    };
    let stale: Vec<String> = backticked(&doc)
        .into_iter()
        .filter(|s| looks_like_key(s) && !keys.contains(&without_indices(s)))
        .collect();
    assert!(
        stale.is_empty(),
        "{REFERENCE} names keys the configuration does not have:\n  {}",
        stale.join("\n  ")
    );
}
