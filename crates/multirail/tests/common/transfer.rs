//! A verified round trip through an opened segment, shared by the metadata store tests.

use std::time::Duration;

use multirail::{Engine, Location, Request, TransportChoice};
use xxhash_rust::xxh3::xxh3_64;

/// Writes `len` patterned bytes from a fresh buffer of `init` to `dst_addr` in `seg`, reads
/// them back into another and checks them against the source's checksum, which it returns
/// for the caller to check the target's bytes.
pub fn write_and_read_back(
    init: &Engine,
    seg: multirail::SegmentId,
    dst_addr: u64,
    len: usize,
    seed: u64,
    transport: TransportChoice,
) -> u64 {
    let src = init.allocate(len, Location::Any).unwrap();
    let back = init.allocate(len, Location::Any).unwrap();
    // SAFETY: no transfer is in flight on these buffers.
    unsafe { crate::common::pattern(seed, src.as_mut_slice()) };
    // SAFETY: as above.
    let want = unsafe { xxh3_64(src.as_slice()) };
    let mut write = Request::write(src.addr(), seg, dst_addr, len as u64);
    write.transport = Some(transport);
    let mut read = Request::read(back.addr(), seg, dst_addr, len as u64);
    read.transport = Some(transport);
    for r in [write, read] {
        let batch = init.allocate_batch(1).unwrap();
        init.submit(batch, &[r]).unwrap();
        init.wait(batch, Some(Duration::from_secs(60))).unwrap();
        init.free_batch(batch).unwrap();
    }
    // SAFETY: both batches completed; nothing writes `back` now.
    assert_eq!(
        unsafe { xxh3_64(back.as_slice()) },
        want,
        "bytes came back intact"
    );
    init.free(&src).unwrap();
    init.free(&back).unwrap();
    want
}
