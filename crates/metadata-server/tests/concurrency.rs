//! Many clients at once, each checking every answer about its own keys.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::Client;
use multirail_metadata_server::Limits;

const THREADS: usize = 32;
const REQUESTS: usize = 200;
const KEYS_PER_THREAD: usize = 5;

fn run(data_dir: Option<std::path::PathBuf>) {
    let server = Arc::new(common::start(data_dir, Limits::default()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let server = Arc::clone(&server);
            std::thread::spawn(move || {
                let client = Client::new(&server);
                // What this thread believes each of its keys holds.
                let mut model: HashMap<String, Vec<u8>> = HashMap::new();
                let mut state = (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                for i in 0..REQUESTS {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let key = format!("thread/{t}/key {}", state % KEYS_PER_THREAD as u64);
                    match (state >> 8) % 3 {
                        0 => {
                            // Values of varying size, with the thread and
                            // step in them so a mix-up shows.
                            let value: Vec<u8> = format!("{t}:{i}:")
                                .into_bytes()
                                .into_iter()
                                .chain((0..(state >> 16) % 3000).map(|b| b as u8))
                                .collect();
                            let put = client.put(&key, &value);
                            assert_eq!(put.status, 200, "PUT {key}: {}", put.text());
                            assert_eq!(put.text(), "metadata updated");
                            model.insert(key, value);
                        }
                        1 => {
                            let get = client.get(&key);
                            match model.get(&key) {
                                Some(value) => {
                                    assert_eq!(get.status, 200, "GET {key}");
                                    assert!(get.body == *value, "GET {key}: wrong value");
                                }
                                None => {
                                    assert_eq!(get.status, 404, "GET {key}");
                                    assert_eq!(get.text(), "metadata not found");
                                }
                            }
                        }
                        _ => {
                            let delete = client.delete(&key);
                            if model.remove(&key).is_some() {
                                assert_eq!(delete.status, 200, "DELETE {key}");
                                assert_eq!(delete.text(), "metadata deleted");
                            } else {
                                assert_eq!(delete.status, 404, "DELETE {key}");
                            }
                        }
                    }
                }
                // Every surviving key is listed, and nothing else of ours.
                let mut listed = client.list(&format!("thread/{t}/"));
                listed.sort();
                let mut expected: Vec<String> = model.keys().cloned().collect();
                expected.sort();
                assert_eq!(listed, expected);
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("client thread passed its checks");
    }
}

#[test]
fn thirty_two_clients_in_memory() {
    run(None);
}

#[test]
fn thirty_two_clients_persistent() {
    let dir = tempfile::tempdir().expect("temp dir");
    run(Some(dir.path().to_path_buf()));
}
