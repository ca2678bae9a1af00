//! The configuration loader, `Config::from_json_str` (parse, shape checks, validation), on
//! arbitrary text (run it with `-dict=fuzz/config.dict`, the real key names) and, when the
//! first byte is 0xFF, on structure-aware documents built from the real keys (`json_gen`, the
//! schema taken from `Config::default()` so new keys join on their own).
//!
//! Properties: Ok or a `ConfigError`, never a panic; an accepted configuration passes
//! `validate`, and what `config show` prints (`to_json_pretty`) loads back to an equal
//! configuration, except a token, which prints redacted and is then refused naming `auth.token`.
#![no_main]

mod json_gen;

use std::sync::OnceLock;

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use multirail::config::RailConfig;
use multirail::Config;

use json_gen::Schema;

fn schema() -> Schema {
    let rail = serde_json::to_value(RailConfig {
        name: "eth0".into(),
        address: "10.0.0.1".into(),
        numa_node: 0,
        bandwidth_gbps: Some(100.0),
    })
    .expect("a rail serializes");
    let rail = json_gen::schema_of(&rail, "", &|path| match path {
        "name" => Some(json_gen::strs(&["eth0", "eth1", "lo", "", " "])),
        "address" => Some(json_gen::ip()),
        "bandwidth_gbps" => Some(Schema::Opt(Box::new(Schema::Float(100.0)))),
        _ => None,
    });
    let doc = serde_json::to_value(Config::default()).expect("the default config serializes");
    json_gen::schema_of(&doc, "", &|path| match path {
        "local_hostname" => Some(Schema::Opt(Box::new(json_gen::strs(&[
            "localhost",
            "10.0.0.1",
            "::1",
            "",
            "a b",
            "host\tname",
        ])))),
        "transport" => Some(json_gen::strs(&["auto", "tcp", "shm", "rdma", "AUTO", ""])),
        "rails" => Some(Schema::Arr(Box::new(rail.clone()))),
        "tiers" => Some(Schema::Map(
            Box::new(json_gen::location()),
            Box::new(Schema::Map(
                Box::new(json_gen::strs(&["eth0", "eth1", ""])),
                Box::new(Schema::Int(1)),
            )),
        )),
        "metadata.type" => Some(json_gen::strs(&["p2p", "etcd", "http", "P2P", ""])),
        "auth.token" => Some(Schema::Opt(Box::new(json_gen::strs(&[
            "0123456789abcdef",
            "0123456789abcde",
            "<redacted>",
            "",
        ])))),
        p if p.ends_with("return_policy") => {
            Some(json_gen::strs(&["individual", "bulk", "Bulk", "batch"]))
        }
        p if p.ends_with("return_order") => Some(json_gen::strs(&[
            "before_reply",
            "after_reply",
            "before-reply",
            "beforeReply",
        ])),
        _ => None,
    })
}

fuzz_target!(|data: &[u8]| {
    let text = match data.split_first() {
        Some((0xFF, rest)) => {
            static SCHEMA: OnceLock<Schema> = OnceLock::new();
            let mut u = Unstructured::new(rest);
            match json_gen::document(&mut u, SCHEMA.get_or_init(schema)) {
                Ok(doc) => doc,
                Err(_) => return,
            }
        }
        _ => String::from_utf8_lossy(data).into_owned(),
    };
    match Config::from_json_str(&text, "fuzz") {
        Ok(config) => {
            config.validate().expect("an accepted config validates");
            let shown = config.to_json_pretty();
            match Config::from_json_str(&shown, "config show") {
                Ok(again) => {
                    assert!(config.auth.token.is_none(), "a redacted token was accepted");
                    assert_eq!(again, config, "config show does not load back:\n{shown}");
                }
                Err(e) => {
                    assert!(
                        config.auth.token.is_some(),
                        "config show does not load: {e}\n{shown}"
                    );
                    assert_eq!(e.key, "auth.token", "{e}");
                }
            }
        }
        Err(e) => {
            assert!(!e.to_string().is_empty());
        }
    }
});
