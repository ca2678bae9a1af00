//! Helpers shared by the integration tests.

/// Fills `buf` with a xorshift sequence seeded by `seed`: every 8 bytes differ, so a misplaced
/// or missing piece of a transfer shows as a mismatch.
#[allow(dead_code)] // not every test binary that includes these helpers fills buffers
pub fn pattern(seed: u64, buf: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// Submits `requests` as one batch of `engine`, waits for it (60 s at most), checks that every
/// request completed, and frees the batch.
#[allow(dead_code)] // not every test binary that includes these helpers submits batches
pub fn run_batch(engine: &multirail::Engine, requests: &[multirail::Request]) {
    let batch = engine.allocate_batch(requests.len()).unwrap();
    engine.submit(batch, requests).unwrap();
    engine
        .wait(batch, Some(std::time::Duration::from_secs(60)))
        .unwrap();
    for i in 0..requests.len() {
        assert!(
            engine.status(batch, i).unwrap().is_completed(),
            "request {i} of {}",
            requests.len()
        );
    }
    engine.free_batch(batch).unwrap();
}

/// A metadata server on `listen` (port 0: a free one) keeping its keys in memory only.
#[allow(dead_code)] // only the tests that use a metadata store call it
pub fn metadata_server_on(listen: &str) -> multirail_metadata_server::MetadataServer {
    use multirail_metadata_server::{Limits, MetadataServer, ServerConfig};
    MetadataServer::start(ServerConfig {
        listen: listen.parse().unwrap(),
        data_dir: None,
        limits: Limits::default(),
    })
    .expect("metadata server starts")
}
