//! The segment descriptor a peer sends (`SegmentDescriptor` as JSON, parsed with
//! `serde_json::from_slice` exactly as `P2pMetadata::fetch` does), then what the engine does
//! with a fetched descriptor through public API: `find_buffer` / `BufferDescriptor::contains`,
//! which decide whether a request's target range lies inside a buffer of the peer.
//!
//! Input: raw bytes, or, when the first byte is 0xFF (never in UTF-8 JSON), bytes that choose a
//! structure-aware document shaped like a descriptor (`json_gen`), followed by range queries.
//!
//! Properties: parsing gives Ok or an error, never a panic; a parsed descriptor serializes and
//! parses back equal; `contains` agrees with exact (128-bit) arithmetic; `find_buffer` only
//! returns a buffer that holds the range, and for buffers in address order without overlap
//! (what an engine publishes) it finds every range some buffer holds.
#![no_main]

mod json_gen;

use std::sync::OnceLock;

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use multirail::segment::{
    BufferDescriptor, GroupDescriptor, RailDescriptor, SegmentDescriptor, ShmHandle,
    PROTOCOL_VERSION,
};
use multirail::Location;

use json_gen::Schema;

/// The descriptor's shape, from a real descriptor (a new field shows up here on its own) with
/// hand-picked candidates where a string has a grammar.
fn schema() -> Schema {
    let sample = SegmentDescriptor {
        name: "127.0.0.1:7000".into(),
        host_id: "boot/pid:[4026531836]".into(),
        pid: 4242,
        protocol_version: PROTOCOL_VERSION,
        rails: vec![RailDescriptor {
            name: "eth0".into(),
            address: "10.0.0.1".into(),
            numa_node: 0,
            bandwidth_gbps: 100.0,
        }],
        rdma: vec![],
        buffers: vec![BufferDescriptor {
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
            key: 0x1234_5678_9abc_def0,
            location: Location::Cpu(0),
            shm: Some(ShmHandle { pid: 4242, fd: 7 }),
            rkeys: vec![1, 2],
        }],
        segment_name: None,
        groups: vec![GroupDescriptor {
            name: "kv-group".into(),
            table_addr: 0x7f00_0000_1000,
            table_len: 4096,
            settings: [("window_size".to_owned(), "16".to_owned())].into(),
        }],
    };
    let v = serde_json::to_value(&sample).expect("descriptor serializes");
    json_gen::schema_of(&v, "", &|path| match path {
        "name" => Some(json_gen::strs(&[
            "127.0.0.1:7000",
            "[::1]:7000",
            "h:0",
            ":",
            "",
        ])),
        "rails.[].address" => Some(json_gen::ip()),
        "buffers.[].location" => Some(json_gen::location()),
        "buffers.[].shm" => Some(Schema::Opt(Box::new(json_gen::schema_of(
            &serde_json::json!({ "pid": 4242, "fd": 7 }),
            "",
            &|_| None,
        )))),
        _ => None,
    })
}

/// `addr..addr+len` inside `b`, in arithmetic that cannot overflow.
fn holds(b: &BufferDescriptor, addr: u64, len: u64) -> bool {
    let (start, end) = (u128::from(b.addr), u128::from(b.addr) + u128::from(b.len));
    u128::from(addr) >= start && u128::from(addr) + u128::from(len) <= end
}

/// Buffers in strictly increasing address order, none overlapping the next.
fn well_ordered(buffers: &[BufferDescriptor]) -> bool {
    buffers.windows(2).all(|w| {
        w[0].addr < w[1].addr
            && u128::from(w[0].addr) + u128::from(w[0].len) <= u128::from(w[1].addr)
    })
}

fn check_query(d: &SegmentDescriptor, ordered: bool, addr: u64, len: u64) {
    for b in &d.buffers {
        assert_eq!(
            b.contains(addr, len),
            holds(b, addr, len),
            "{b:?} {addr:#x}+{len:#x}"
        );
    }
    match d.find_buffer(addr, len) {
        Some(b) => assert!(
            holds(b, addr, len),
            "{b:?} does not hold {addr:#x}+{len:#x}"
        ),
        None if ordered => assert!(
            !d.buffers.iter().any(|b| holds(b, addr, len)),
            "find_buffer missed {addr:#x}+{len:#x} in {:?}",
            d.buffers
        ),
        None => {}
    }
}

fn check(d: &SegmentDescriptor, queries: &[(u64, u64)]) {
    let json = serde_json::to_vec(d).expect("a parsed descriptor serializes");
    let back: SegmentDescriptor =
        serde_json::from_slice(&json).expect("a serialized descriptor parses");
    assert_eq!(&back, d);

    let ordered = well_ordered(&d.buffers);
    for b in &d.buffers {
        // The ranges around each buffer's edges.
        for (addr, len) in [
            (b.addr, b.len),
            (b.addr, 0),
            (b.addr, 1),
            (b.addr.wrapping_sub(1), 1),
            (b.addr.wrapping_add(b.len), 1),
            (b.addr.wrapping_add(b.len), 0),
            (b.addr.wrapping_add(b.len).wrapping_sub(1), 1),
            (b.addr, b.len.wrapping_add(1)),
            (b.addr.wrapping_add(1), b.len),
            (b.addr, u64::MAX),
            (u64::MAX, b.len),
        ] {
            check_query(d, ordered, addr, len);
        }
        if ordered {
            assert_eq!(d.find_buffer(b.addr, b.len), Some(b));
        }
    }
    for &(addr, len) in queries {
        check_query(d, ordered, addr, len);
    }
}

fuzz_target!(|data: &[u8]| {
    let (json, queries): (Vec<u8>, Vec<(u64, u64)>) = match data.split_first() {
        Some((0xFF, rest)) => {
            let mut u = Unstructured::new(rest);
            static SCHEMA: OnceLock<Schema> = OnceLock::new();
            let Ok(doc) = json_gen::document(&mut u, SCHEMA.get_or_init(schema)) else {
                return;
            };
            let queries = u.arbitrary().unwrap_or_default();
            (doc.into_bytes(), queries)
        }
        _ => (data.to_vec(), Vec::new()),
    };
    if let Ok(d) = serde_json::from_slice::<SegmentDescriptor>(&json) {
        check(&d, &queries);
    }
});
