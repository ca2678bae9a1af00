//! Prepared request lists: entries checked once, posted by index many times over shm and tcp,
//! every byte verified; bad lists, indices and stale sources refused before anything moves; a
//! notification posted with a list arrives after its data.

mod common;

use std::time::{Duration, Instant};

use multirail::transport::Opcode;
use multirail::{
    BatchId, Config, Engine, Error, Location, PreparedEntry, PreparedListId, Status,
    TransportChoice, PRIO_HIGH, PRIO_LOW,
};

/// Blocks of the vLLM shape: many small pieces.
const BLOCKS: usize = 256;
const BLOCK: usize = 4096;

fn pair(transport: TransportChoice) -> (Engine, Engine) {
    let json = match transport {
        TransportChoice::Shm => r#"{"transport": "shm"}"#,
        _ => r#"{"transport": "tcp"}"#,
    };
    let config = || Config::from_json_str(json, "test").unwrap();
    (
        Engine::new(config(), "127.0.0.1:0").unwrap(),
        Engine::new(config(), "127.0.0.1:0").unwrap(),
    )
}

/// Posts `list` (all entries, or `indices`) as one batch and waits for it; returns the batch's
/// per-request statuses.
fn post(
    engine: &Engine,
    list: PreparedListId,
    op: Opcode,
    indices: Option<&[usize]>,
) -> Vec<Status> {
    let n = indices.map_or_else(|| engine.prepared_len(list).unwrap(), <[usize]>::len);
    let batch = engine.allocate_batch(n).unwrap();
    engine
        .submit_prepared(batch, list, op, PRIO_HIGH, indices)
        .unwrap();
    engine.wait(batch, Some(Duration::from_secs(30))).unwrap();
    let statuses = (0..n).map(|i| engine.status(batch, i).unwrap()).collect();
    engine.free_batch(batch).unwrap();
    statuses
}

/// Writes every block from `src` to the target's buffer (block i to slot BLOCKS-1-i, so the
/// mapping is not the identity), reads them back into `back`, and reposts both lists
/// `reposts` times with a new pattern each time, checking every byte each time.
fn round_trips(transport: TransportChoice, reposts: usize) {
    let (init, target) = pair(transport);
    let remote = target.allocate(BLOCKS * BLOCK, Location::Any).unwrap();
    let src = init.allocate(BLOCKS * BLOCK, Location::Any).unwrap();
    let back = init.allocate(BLOCKS * BLOCK, Location::Any).unwrap();
    let seg = init.open_segment(&target.name()).unwrap();
    let slot = |i: usize| remote.addr() + ((BLOCKS - 1 - i) * BLOCK) as u64;
    let entries = |local: u64| -> Vec<PreparedEntry> {
        (0..BLOCKS)
            .map(|i| PreparedEntry {
                source: local + (i * BLOCK) as u64,
                target: seg,
                target_offset: slot(i),
                length: BLOCK as u64,
            })
            .collect()
    };
    let writes = init.prepare(&entries(src.addr()), None).unwrap();
    let reads = init.prepare(&entries(back.addr()), None).unwrap();
    assert_eq!(init.prepared_len(writes).unwrap(), BLOCKS);
    for round in 0..reposts as u64 {
        // SAFETY: no transfer is in flight on these buffers between rounds.
        unsafe {
            common::pattern(round, src.as_mut_slice());
            back.as_mut_slice().fill(0);
        }
        let statuses = post(&init, writes, Opcode::Write, None);
        assert!(statuses.iter().all(|s| matches!(s, Status::Completed)));
        // SAFETY: the writes completed; nothing writes either buffer now.
        let (sent, landed) = unsafe { (src.as_slice(), remote.as_slice()) };
        for i in 0..BLOCKS {
            let at = (BLOCKS - 1 - i) * BLOCK;
            assert!(
                sent[i * BLOCK..(i + 1) * BLOCK] == landed[at..at + BLOCK],
                "round {round}: block {i} did not land in slot {}",
                BLOCKS - 1 - i
            );
        }
        post(&init, reads, Opcode::Read, None);
        // SAFETY: the reads completed.
        assert!(
            unsafe { back.as_slice() == src.as_slice() },
            "round {round}"
        );
    }
    init.free_prepared(writes).unwrap();
    init.free_prepared(reads).unwrap();
}

#[test]
fn a_list_of_small_blocks_reposted_100_times_over_shm_moves_every_byte() {
    round_trips(TransportChoice::Shm, 100);
}

#[test]
fn a_list_of_small_blocks_reposted_over_tcp_moves_every_byte() {
    round_trips(TransportChoice::Tcp, 20);
}

#[test]
fn indices_pick_entries_in_their_order_and_may_repeat() {
    let (init, target) = pair(TransportChoice::Tcp);
    let remote = target.allocate(4 * BLOCK, Location::Any).unwrap();
    let src = init.allocate(4 * BLOCK, Location::Any).unwrap();
    let seg = init.open_segment(&target.name()).unwrap();
    let entries: Vec<PreparedEntry> = (0..4)
        .map(|i| PreparedEntry {
            source: src.addr() + (i * BLOCK) as u64,
            target: seg,
            target_offset: remote.addr() + (i * BLOCK) as u64,
            length: BLOCK as u64,
        })
        .collect();
    let list = init.prepare(&entries, Some(TransportChoice::Tcp)).unwrap();
    // SAFETY: nothing is in flight.
    unsafe {
        for (i, b) in src.as_mut_slice().chunks_mut(BLOCK).enumerate() {
            b.fill(i as u8 + 1);
        }
    }
    let statuses = post(&init, list, Opcode::Write, Some(&[3, 1, 1]));
    assert_eq!(statuses.len(), 3);
    assert!(statuses.iter().all(|s| matches!(s, Status::Completed)));
    // SAFETY: the writes completed.
    let landed = unsafe { remote.as_slice() };
    assert!(
        landed[..BLOCK].iter().all(|&b| b == 0),
        "entry 0 was not posted"
    );
    assert!(landed[BLOCK..2 * BLOCK].iter().all(|&b| b == 2));
    assert!(landed[2 * BLOCK..3 * BLOCK].iter().all(|&b| b == 0));
    assert!(landed[3 * BLOCK..].iter().all(|&b| b == 4));
}

#[test]
fn bad_lists_indices_and_stale_sources_are_refused_before_anything_moves() {
    let (init, target) = pair(TransportChoice::Tcp);
    let remote = target.allocate(2 * BLOCK, Location::Any).unwrap();
    let src = init.allocate(2 * BLOCK, Location::Any).unwrap();
    let seg = init.open_segment(&target.name()).unwrap();
    let entry = |source: u64, offset: u64, length: u64| PreparedEntry {
        source,
        target: seg,
        target_offset: remote.addr() + offset,
        length,
    };
    let invalid = |e: Error, what: &str| {
        assert!(
            matches!(&e, Error::InvalidArgument { .. }) && e.to_string().contains(what),
            "{e}"
        )
    };
    invalid(init.prepare(&[], None).unwrap_err(), "at least one entry");
    invalid(
        init.prepare(&[entry(src.addr(), 0, 0)], None).unwrap_err(),
        "length",
    );
    assert!(matches!(
        init.prepare(&[entry(src.addr(), BLOCK as u64, 2 * BLOCK as u64)], None),
        Err(Error::TargetOutOfRange { .. })
    ));
    assert!(matches!(
        init.prepare(&[entry(0x1000, 0, 16)], None),
        Err(Error::SourceNotRegistered { .. })
    ));

    let list = init
        .prepare(&[entry(src.addr(), 0, BLOCK as u64)], None)
        .unwrap();
    let batch = init.allocate_batch(4).unwrap();
    let submit = |indices: Option<&[usize]>| {
        init.submit_prepared(batch, list, Opcode::Write, PRIO_LOW, indices)
    };
    invalid(submit(Some(&[1])).unwrap_err(), "past the end");
    invalid(submit(Some(&[])).unwrap_err(), "at least one");
    invalid(
        init.submit_prepared(batch, PreparedListId(9999), Opcode::Write, PRIO_LOW, None)
            .unwrap_err(),
        "not a prepared list",
    );
    assert!(matches!(
        init.submit_prepared(BatchId(9999), list, Opcode::Write, PRIO_LOW, None),
        Err(Error::UnknownBatch(_))
    ));
    // Nothing was posted by the refused calls: the batch is empty and done.
    assert!(matches!(
        init.overall_status(batch).unwrap(),
        Status::Completed
    ));
    assert!(matches!(
        init.submit_prepared(batch, list, Opcode::Write, PRIO_LOW, Some(&[0; 5])),
        Err(Error::BatchFull { .. })
    ));

    // The source is unregistered after the list was prepared: the next post refuses it.
    init.free(&src).unwrap();
    assert!(matches!(
        submit(None),
        Err(Error::SourceNotRegistered { .. })
    ));
    init.free_prepared(list).unwrap();
    invalid(init.free_prepared(list).unwrap_err(), "not a prepared list");
    invalid(init.prepared_len(list).unwrap_err(), "not a prepared list");
}

#[test]
fn a_notification_posted_with_a_list_arrives_after_its_data() {
    for transport in [TransportChoice::Shm, TransportChoice::Tcp] {
        let (init, target) = pair(transport);
        let remote = target.allocate(BLOCKS * BLOCK, Location::Any).unwrap();
        let src = init.allocate(BLOCKS * BLOCK, Location::Any).unwrap();
        // SAFETY: nothing is in flight.
        unsafe { common::pattern(7, src.as_mut_slice()) };
        let seg = init.open_segment(&target.name()).unwrap();
        let entries: Vec<PreparedEntry> = (0..BLOCKS)
            .map(|i| PreparedEntry {
                source: src.addr() + (i * BLOCK) as u64,
                target: seg,
                target_offset: remote.addr() + (i * BLOCK) as u64,
                length: BLOCK as u64,
            })
            .collect();
        let list = init.prepare(&entries, None).unwrap();
        let batch = init.allocate_batch(BLOCKS).unwrap();
        init.submit_prepared_with_notification(
            batch,
            list,
            Opcode::Write,
            PRIO_HIGH,
            None,
            "kv-ready",
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let note = loop {
            if let Some(n) = target.receive_notifications().into_iter().next() {
                break n;
            }
            assert!(Instant::now() < deadline, "{transport:?}: no notification");
            std::thread::sleep(Duration::from_micros(200));
        };
        assert_eq!(note.msg, "kv-ready");
        // SAFETY: the notification comes after every write completed.
        assert!(
            unsafe { remote.as_slice() == src.as_slice() },
            "{transport:?}: the notification came before the data"
        );
        init.wait(batch, Some(Duration::from_secs(5))).unwrap();
    }
}
