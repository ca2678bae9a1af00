//! A data directory keeps every key across restarts.

mod common;

use std::fs;

use common::Client;
use multirail_metadata_server::{Limits, MetadataServer, ServerConfig, ServerError};

fn files_in(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("data dir lists")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn restart_serves_every_value_again() {
    let dir = tempfile::tempdir().expect("temp dir");
    let long_key = "k".repeat(4000); // far past the 255-byte file-name limit
    let binary: Vec<u8> = (0..=255u8).rev().collect();
    {
        let server = common::start(Some(dir.path().to_path_buf()), Limits::default());
        let client = Client::new(&server);
        assert_eq!(client.put("mooncake/ram/a b", b"alpha").status, 200);
        assert_eq!(client.put("binary", &binary).status, 200);
        assert_eq!(client.put(&long_key, b"long").status, 200);
        assert_eq!(client.put("replaced", b"old").status, 200);
        assert_eq!(client.put("replaced", b"new").status, 200);
        server.shutdown();
    }
    assert_eq!(
        files_in(dir.path()).len(),
        4,
        "one file per key, no leftovers"
    );

    let server = common::start(Some(dir.path().to_path_buf()), Limits::default());
    let client = Client::new(&server);
    assert_eq!(client.get("mooncake/ram/a b").body, b"alpha");
    assert_eq!(client.get("binary").body, binary);
    assert_eq!(client.get(&long_key).body, b"long");
    assert_eq!(client.get("replaced").body, b"new");
    assert_eq!(client.list("").len(), 4);
}

#[test]
fn delete_persists() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let server = common::start(Some(dir.path().to_path_buf()), Limits::default());
        let client = Client::new(&server);
        assert_eq!(client.put("kept", b"1").status, 200);
        assert_eq!(client.put("gone", b"2").status, 200);
        assert_eq!(client.delete("gone").status, 200);
        server.shutdown();
    }
    assert_eq!(files_in(dir.path()).len(), 1);
    let server = common::start(Some(dir.path().to_path_buf()), Limits::default());
    let client = Client::new(&server);
    assert_eq!(client.get("kept").body, b"1");
    assert_eq!(client.get("gone").status, 404);
}

#[test]
fn corrupt_and_foreign_files_are_skipped() {
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let server = common::start(Some(dir.path().to_path_buf()), Limits::default());
        let client = Client::new(&server);
        assert_eq!(client.put("good", b"fine").status, 200);
        assert_eq!(client.put("damaged", b"will be flipped").status, 200);
        server.shutdown();
    }
    // Damage one stored file (flip its last value byte), and add garbage
    // files, an empty file, a directory and a crashed write's temp file.
    let before = files_in(dir.path());
    let mut damaged_one = false;
    for name in &before {
        let path = dir.path().join(name);
        let mut data = fs::read(&path).expect("read stored file");
        if data.windows(7).any(|w| w == b"damaged") {
            let at = data.len() - 9;
            data[at] ^= 0x55;
            fs::write(&path, data).expect("damage file");
            damaged_one = true;
        }
    }
    assert!(damaged_one);
    fs::write(dir.path().join("garbage"), b"\x00\x01not a metadata file").expect("write");
    fs::write(dir.path().join("empty"), b"").expect("write");
    fs::create_dir(dir.path().join("subdir")).expect("mkdir");
    fs::write(dir.path().join(".tmp-leftover-1-0"), b"half").expect("write");
    // A valid file renamed so it no longer matches its key.
    let good = before
        .iter()
        .find(|n| {
            fs::read(dir.path().join(n))
                .map(|d| d.windows(4).any(|w| w == b"good"))
                .unwrap_or(false)
        })
        .expect("good file");
    fs::copy(dir.path().join(good), dir.path().join("0000")).expect("copy");

    let server = common::start(Some(dir.path().to_path_buf()), Limits::default());
    let client = Client::new(&server);
    assert_eq!(client.get("good").body, b"fine");
    assert_eq!(client.get("damaged").status, 404);
    assert_eq!(client.list(""), vec!["good"]);
    assert!(
        !dir.path().join(".tmp-leftover-1-0").exists(),
        "leftover temp files are removed"
    );
    // The server still writes next to the files it skipped.
    assert_eq!(client.put("damaged", b"repaired").status, 200);
    assert_eq!(client.get("damaged").body, b"repaired");
}

#[test]
fn a_data_dir_that_is_a_file_fails_start_clearly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("not-a-dir");
    fs::write(&file, b"x").expect("write");
    let err = MetadataServer::start(ServerConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: Some(file.clone()),
        limits: Limits::default(),
    })
    .expect_err("a file is not a data dir");
    assert!(matches!(err, ServerError::DataDir { ref path, .. } if *path == file));
    assert!(err.to_string().contains("not-a-dir"), "{err}");
}

#[test]
fn a_missing_data_dir_is_created() {
    let dir = tempfile::tempdir().expect("temp dir");
    let nested = dir.path().join("a/b/c");
    let server = common::start(Some(nested.clone()), Limits::default());
    let client = Client::new(&server);
    assert_eq!(client.put("k", b"v").status, 200);
    assert_eq!(files_in(&nested).len(), 1);
}

#[test]
fn bind_failure_is_reported() {
    let first = common::start_default();
    let err = MetadataServer::start(ServerConfig {
        listen: first.local_addr(),
        data_dir: None,
        limits: Limits::default(),
    })
    .expect_err("port in use");
    assert!(matches!(err, ServerError::Bind { .. }), "{err}");
}
