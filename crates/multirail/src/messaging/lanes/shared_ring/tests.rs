//! Tests of the shared ring: wrap-around, concurrency, abandoned reservations, corruption.

use super::*;
use std::sync::atomic::AtomicBool;

/// One cache line; a vector of them is a 64-byte aligned region.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// A zeroed, 64-byte aligned heap region standing in for the memfd mapping.
struct Region {
    _lines: Vec<Line>,
    base: *mut u8,
    units: usize,
    senders: usize,
}

impl Region {
    fn new(units: usize, senders: usize) -> Region {
        let mut lines = vec![Line([0; 64]); SharedRing::bytes(units, senders) / 64];
        let base = lines.as_mut_ptr().cast::<u8>();
        Region {
            _lines: lines,
            base,
            units,
            senders,
        }
    }

    fn ring(&self) -> SharedRing {
        // SAFETY: base is 64-aligned and the region, zeroed and of
        // SharedRing::bytes(units, senders) bytes, outlives every ring of a test.
        unsafe { SharedRing::new(self.base, self.units, self.senders) }
    }
}

/// Recognizable bytes for record `n` of sender `tag`.
fn payload(tag: u32, n: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (n as usize * 31 + i * 7 + tag as usize) as u8)
        .collect()
}

/// A record as the receiver saw it: tag, kind, payload.
type Got = (u32, u8, Vec<u8>);

/// Everything published at the head, copied out.
fn drain(rx: &mut SharedRing) -> Vec<Got> {
    let mut got = Vec::new();
    rx.poll(usize::MAX, |tag, kind, data| {
        got.push((tag, kind, data.to_vec()));
        Ok::<(), ()>(())
    })
    .unwrap();
    got
}

#[test]
fn sizes_wrap_and_pad_over_many_laps() {
    let region = Region::new(64, 3);
    let tx = region.ring();
    let mut rx = region.ring();
    assert_eq!(rx.units(), 64);
    let max = 64 / 2 * UNIT - HEADER;
    let sizes = [0, 1, 47, 48, 49, 100, 128, 500, max];
    let mut sent = std::collections::VecDeque::new();
    let mut record_units = 0u64;
    let mut received = 0;
    let mut n = 0u64;
    while received < 2000 {
        let len = sizes[n as usize % sizes.len()];
        let tag = (n % 3) as u32;
        let kind = (n % 14) as u8 + 1;
        let data = payload(tag, n, len);
        if tx.try_send(tag, kind, &data).unwrap() {
            sent.push_back((tag, kind, data));
            record_units += units_of(len) as u64;
            n += 1;
            continue;
        }
        let got = drain(&mut rx);
        assert!(!got.is_empty(), "full ring but nothing to poll");
        for g in got {
            assert_eq!(Some(g), sent.pop_front());
            received += 1;
        }
    }
    for g in drain(&mut rx) {
        assert_eq!(Some(g), sent.pop_front());
    }
    assert!(sent.is_empty());
    assert!(
        tx.reserved() > record_units,
        "no pads were needed: the test does not cover them"
    );
    assert!(tx.reserved() > 30 * 64, "too few laps");
    assert_eq!(rx.consumed(), tx.reserved());
    assert!(!rx.published_at_head() && !rx.stalled());
}

#[test]
fn full_ring_refuses_then_accepts_after_poll() {
    let region = Region::new(64, 1);
    let tx = region.ring();
    let mut rx = region.ring();
    let mut n = 0u64;
    // 100 bytes take 2 units: 32 records fill the 64-unit ring exactly.
    while tx.try_send(0, 1, &payload(0, n, 100)).unwrap() {
        n += 1;
    }
    assert_eq!(n, 32);
    assert_eq!(tx.intent(0).load(Ordering::Relaxed), 0);
    assert!(!tx.try_send(0, 1, &payload(0, n, 0)).unwrap());
    let mut first = Vec::new();
    let taken = rx
        .poll(1, |_, _, d| {
            first.push(d.to_vec());
            Ok::<(), ()>(())
        })
        .unwrap();
    assert_eq!(taken, 1);
    assert_eq!(first, vec![payload(0, 0, 100)]);
    assert!(tx.try_send(0, 1, &payload(0, n, 100)).unwrap());
    n += 1;
    assert!(!tx.try_send(0, 1, &payload(0, n, 100)).unwrap());
    let got = drain(&mut rx);
    assert_eq!(got.len(), 32);
    for (i, (tag, kind, data)) in got.into_iter().enumerate() {
        assert_eq!((tag, kind), (0, 1));
        assert_eq!(data, payload(0, i as u64 + 1, 100));
    }
    assert!(tx.try_send(0, 1, &payload(0, n, 100)).unwrap());
}

/// Raises its flag when its thread panics, so the other threads of a test stop waiting
/// for it and the panic comes out instead of a hang.
struct Bail<'a>(&'a AtomicBool);

impl Drop for Bail<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

#[test]
fn producers_each_fifo_exactly_once() {
    const PER: u32 = 50_000;
    const SENDERS: u32 = 4;
    let region = Region::new(256, SENDERS as usize);
    let failed = AtomicBool::new(false);
    let len_of = |n: u32| 4 + (n as usize * 7) % 293;
    std::thread::scope(|s| {
        for tag in 0..SENDERS {
            let tx = region.ring();
            let failed = &failed;
            s.spawn(move || {
                let _bail = Bail(failed);
                let mut buf = [0u8; 4 + 293];
                for n in 0..PER {
                    let len = len_of(n);
                    buf[..4].copy_from_slice(&n.to_le_bytes());
                    for (i, b) in buf[4..len].iter_mut().enumerate() {
                        *b = (n as usize + i + tag as usize) as u8;
                    }
                    let mut spins = 0u32;
                    while !tx.try_send(tag, 1 + (n % 14) as u8, &buf[..len]).unwrap() {
                        if failed.load(Ordering::Relaxed) {
                            return;
                        }
                        spins += 1;
                        if spins.is_multiple_of(16) {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                }
            });
        }
        let mut rx = region.ring();
        let failed = &failed;
        s.spawn(move || {
            let _bail = Bail(failed);
            let mut next = [0u32; SENDERS as usize];
            let mut total = 0;
            while total < PER * SENDERS {
                let got = rx
                    .poll(64, |tag, kind, data| {
                        let n = next[tag as usize];
                        assert_eq!(data.len(), len_of(n), "tag {tag} record {n}");
                        assert_eq!(data[..4], n.to_le_bytes(), "tag {tag}");
                        assert_eq!(kind, 1 + (n % 14) as u8);
                        for (i, b) in data[4..].iter().enumerate() {
                            assert_eq!(*b, (n as usize + i + tag as usize) as u8);
                        }
                        next[tag as usize] += 1;
                        Ok::<(), ()>(())
                    })
                    .unwrap();
                total += got as u32;
                if got == 0 {
                    assert!(!failed.load(Ordering::Relaxed), "a producer failed");
                    std::thread::yield_now();
                }
            }
            assert_eq!(next, [PER; SENDERS as usize]);
            assert!(!rx.published_at_head());
            assert_eq!(rx.consumed(), rx.reserved());
        });
    });
    assert!(!failed.load(Ordering::Relaxed));
}

/// Reserves like a sender that dies before publishing: intent written, tail moved,
/// nothing published (or only the pad, when `publish_pad`). Returns the reservation.
fn abandon(tx: &SharedRing, tag: u32, len: usize, publish_pad: bool) -> (u64, usize) {
    let (t, pad) = tx.reserve(tag, units_of(len)).unwrap().unwrap();
    if publish_pad && pad > 0 {
        tx.write_pad(t, tag, pad);
    }
    (t, pad)
}

#[test]
fn abandoned_reservation_is_skipped_for_its_tag_only() {
    let region = Region::new(64, 3);
    let tx = region.ring();
    let mut rx = region.ring();
    assert!(tx.try_send(0, 1, b"before").unwrap());
    let (t, pad) = abandon(&tx, 1, 200, false);
    assert_eq!((t, pad), (1, 0));
    assert!(tx.try_send(0, 2, b"after 0").unwrap());
    assert!(tx.try_send(2, 3, b"after 2").unwrap());
    assert_eq!(drain(&mut rx), vec![(0, 1, b"before".to_vec())]);
    assert!(drain(&mut rx).is_empty());
    assert!(rx.stalled());
    assert!(!rx.published_at_head());
    assert!(!rx.skip_abandoned(0));
    assert!(!rx.skip_abandoned(2));
    assert!(!rx.skip_abandoned(7));
    assert!(rx.skip_abandoned(1));
    assert_eq!(rx.consumed(), 1 + units_of(200) as u64);
    assert_eq!(rx.intent(1).load(Ordering::Relaxed), 0);
    assert!(!rx.skip_abandoned(1));
    assert_eq!(
        drain(&mut rx),
        vec![(0, 2, b"after 0".to_vec()), (2, 3, b"after 2".to_vec())]
    );
    assert!(!rx.stalled());
    // The skipped units carry later laps normally.
    for n in 0..200 {
        assert!(tx.try_send(2, 4, &payload(2, n, 150)).unwrap());
        assert_eq!(drain(&mut rx), vec![(2, 4, payload(2, n, 150))]);
    }
}

#[test]
fn abandoned_reservation_with_published_pad_is_skipped() {
    let region = Region::new(64, 3);
    let tx = region.ring();
    let mut rx = region.ring();
    // 60 one-unit records bring the tail to unit 60.
    for n in 0..60 {
        assert!(tx.try_send(0, 1, &payload(0, n, 40)).unwrap());
    }
    assert_eq!(drain(&mut rx).len(), 60);
    let (t, pad) = abandon(&tx, 1, 400, true);
    assert_eq!((t, pad), (60, 4));
    assert!(tx.try_send(2, 5, b"behind").unwrap());
    assert!(drain(&mut rx).is_empty());
    // The pad was consumed: the head sits inside the reservation, at its record.
    assert_eq!(rx.consumed(), 64);
    assert!(rx.stalled());
    assert!(!rx.skip_abandoned(0));
    assert!(!rx.skip_abandoned(2));
    assert!(rx.skip_abandoned(1));
    assert_eq!(rx.consumed(), 64 + units_of(400) as u64);
    assert_eq!(drain(&mut rx), vec![(2, 5, b"behind".to_vec())]);
    assert!(!rx.stalled());
}

#[test]
fn published_record_of_a_dead_sender_is_not_skipped() {
    let region = Region::new(64, 2);
    let tx = region.ring();
    let mut rx = region.ring();
    // Published, but died before clearing its intent.
    let (t, _) = tx.reserve(1, 1).unwrap().unwrap();
    tx.write_record(t, 1, 6, b"last words");
    assert!(tx.intent(1).load(Ordering::Relaxed) != 0);
    assert!(!rx.skip_abandoned(1));
    assert_eq!(drain(&mut rx), vec![(1, 6, b"last words".to_vec())]);
    assert!(!rx.skip_abandoned(1));
    rx.clear_intent(1);
    assert_eq!(rx.intent(1).load(Ordering::Relaxed), 0);
}

#[test]
fn intent_naming_unreserved_units_is_not_skipped() {
    let region = Region::new(64, 2);
    let mut rx = region.ring();
    // Announced but died before its compare-and-swap: the tail never moved.
    rx.intent(1).store(encode_intent(0, 3), Ordering::Relaxed);
    assert!(!rx.skip_abandoned(1));
    assert_eq!(rx.consumed(), 0);
}

#[test]
fn stale_payload_never_reads_as_published() {
    let region = Region::new(64, 2);
    let tx = region.ring();
    let mut rx = region.ring();
    // Position 0 covers units 0 and 1; word 0 of unit 1 (payload bytes 48..56) holds 66,
    // which is what a publication at position 65 (unit 1, next lap) stores.
    let mut data = vec![0xAB; 100];
    data[48..56].copy_from_slice(&66u64.to_le_bytes());
    assert!(tx.try_send(0, 1, &data).unwrap());
    assert_eq!(drain(&mut rx), vec![(0, 1, data)]);
    for n in 2..65 {
        assert!(tx.try_send(0, 1, &payload(0, n, 0)).unwrap());
        assert_eq!(drain(&mut rx).len(), 1);
    }
    assert_eq!(rx.consumed(), 65);
    // Reserved at 65, not published yet.
    abandon(&tx, 1, 0, false);
    assert!(drain(&mut rx).is_empty());
    assert!(rx.stalled());
}

/// A receiver at unit `at` with a hand-made record there (published, with `meta`).
fn corrupt_at(region: &Region, at: u64, meta: u64) -> SharedRing {
    let setup = region.ring();
    setup.word(HEAD).store(at, Ordering::Relaxed);
    setup.word(TAIL).store(at + 1, Ordering::Relaxed);
    let off = (at & setup.mask()) as usize;
    setup.meta(off).store(meta, Ordering::Relaxed);
    setup.seq(off).store(at + 1, Ordering::Release);
    region.ring()
}

/// The corruption a poll reports; fails if the handler was called or there was none.
fn poll_error(rx: &mut SharedRing) -> String {
    let mut called = false;
    let r = rx.poll(usize::MAX, |_, _, _| {
        called = true;
        Ok::<(), ()>(())
    });
    assert!(!called, "handler given a corrupt record");
    match r {
        Err(PollError::Corrupt(what)) => what,
        other => panic!("expected a corrupt ring, got {other:?}"),
    }
}

#[test]
fn corrupt_records_are_errors() {
    let cases = [
        (60, meta_word(0, 500, 1), "runs past the ring's end"),
        (0, meta_word(0, 64 * 64, 1), "runs past the ring's end"),
        (0, meta_word(0, LEN_MASK, 3), "runs past the ring's end"),
        (60, meta_word(0, 2, PAD), "does not end at the ring's end"),
        (60, meta_word(0, 5, PAD), "does not end at the ring's end"),
        (60, meta_word(0, 0, PAD), "a pad of 0 units"),
        (63, meta_word(0, 0, PAD), "a pad of 0 units"),
        (5, meta_word(0, 10, 0), "kind 0"),
        (5, meta_word(9, 10, 2), "sender tag 9"),
    ];
    for (at, meta, expect) in cases {
        let region = Region::new(64, 2);
        let mut rx = corrupt_at(&region, at, meta);
        let what = poll_error(&mut rx);
        assert!(what.contains(expect), "{what:?} lacks {expect:?}");
        assert_eq!(rx.consumed(), at, "corrupt record consumed");
        // Stays stuck and keeps saying so.
        assert!(poll_error(&mut rx).contains(expect));
    }
}

#[test]
fn records_before_a_corrupt_one_are_consumed() {
    let region = Region::new(64, 2);
    let tx = region.ring();
    let mut rx = region.ring();
    assert!(tx.try_send(1, 2, b"fine").unwrap());
    rx.meta(1).store(meta_word(0, 5000, 1), Ordering::Relaxed);
    rx.seq(1).store(2, Ordering::Release);
    let mut got = Vec::new();
    let r = rx.poll(usize::MAX, |tag, kind, d| {
        got.push((tag, kind, d.to_vec()));
        Ok::<(), ()>(())
    });
    assert!(matches!(r, Err(PollError::Corrupt(_))));
    assert_eq!(got, vec![(1, 2, b"fine".to_vec())]);
    assert_eq!(rx.consumed(), 1);
    assert_eq!(tx.word(HEAD).load(Ordering::Acquire), 1);
}

#[test]
fn corrupt_counters_are_send_errors() {
    let region = Region::new(64, 1);
    let tx = region.ring();
    tx.word(HEAD).store(100, Ordering::Relaxed);
    tx.word(TAIL).store(10, Ordering::Relaxed);
    let e = tx.try_send(0, 1, b"x").unwrap_err();
    assert!(e.contains("corrupt"), "{e}");
    assert_eq!(tx.intent(0).load(Ordering::Relaxed), 0);
}

#[test]
fn unsendable_messages_are_errors() {
    let region = Region::new(64, 2);
    let tx = region.ring();
    let max = 32 * UNIT - HEADER;
    let e = tx.try_send(0, 1, &vec![0; max + 1]).unwrap_err();
    assert!(
        e.contains(&format!("a {}-byte message does not fit", max + 1)),
        "{e}"
    );
    assert!(tx.try_send(0, 1, &vec![0; max]).unwrap());
    let e = tx.try_send(2, 1, b"x").unwrap_err();
    assert!(e.contains("tag 2"), "{e}");
    let e = tx.try_send(u32::MAX, 1, b"x").unwrap_err();
    assert!(e.contains("tag"), "{e}");
    for kind in [0, PAD, 16, 255] {
        let e = tx.try_send(0, kind, b"x").unwrap_err();
        assert!(e.contains(&format!("kind {kind}")), "{e}");
    }
    // Refused messages reserved nothing.
    assert_eq!(tx.reserved(), 32);
}

#[test]
fn poll_hands_out_at_most_max() {
    let region = Region::new(64, 1);
    let tx = region.ring();
    let mut rx = region.ring();
    for n in 0..10 {
        assert!(tx.try_send(0, 1, &payload(0, n, 10)).unwrap());
    }
    let mut seen = Vec::new();
    let mut poll = |rx: &mut SharedRing, max| {
        let mut calls = 0;
        let r = rx
            .poll(max, |_, _, d| {
                calls += 1;
                seen.push(d.to_vec());
                Ok::<(), ()>(())
            })
            .unwrap();
        assert_eq!(r, calls);
        r
    };
    assert_eq!(poll(&mut rx, 0), 0);
    assert_eq!(poll(&mut rx, 3), 3);
    assert_eq!(poll(&mut rx, 3), 3);
    assert_eq!(poll(&mut rx, 3), 3);
    assert_eq!(poll(&mut rx, 3), 1);
    assert_eq!(poll(&mut rx, 3), 0);
    assert_eq!(seen, (0..10).map(|n| payload(0, n, 10)).collect::<Vec<_>>());
}

#[test]
fn consumer_error_consumes_the_record() {
    let region = Region::new(64, 1);
    let tx = region.ring();
    let mut rx = region.ring();
    for n in 0..3 {
        assert!(tx.try_send(0, 1, &payload(0, n, 10)).unwrap());
    }
    let mut calls = 0;
    let r = rx.poll(usize::MAX, |_, _, _| {
        calls += 1;
        if calls == 2 {
            Err("refused")
        } else {
            Ok(())
        }
    });
    assert!(matches!(r, Err(PollError::Consumer("refused"))));
    assert_eq!(rx.consumed(), 2);
    assert_eq!(tx.word(HEAD).load(Ordering::Acquire), 2);
    assert_eq!(drain(&mut rx), vec![(0, 1, payload(0, 2, 10))]);
}

#[test]
fn receiver_resumes_at_the_shared_head() {
    let region = Region::new(64, 1);
    let tx = region.ring();
    let mut rx = region.ring();
    for n in 0..3 {
        assert!(tx.try_send(0, 1, &payload(0, n, 10)).unwrap());
    }
    assert_eq!(rx.poll(2, |_, _, _| Ok::<(), ()>(())).unwrap(), 2);
    let mut again = region.ring();
    assert_eq!(again.consumed(), 2);
    assert_eq!(drain(&mut again), vec![(0, 1, payload(0, 2, 10))]);
}

#[test]
fn sizes() {
    assert_eq!(units_of(0), 1);
    assert_eq!(units_of(48), 1);
    assert_eq!(units_of(49), 2);
    assert_eq!(units_for(1, 0), 64);
    assert_eq!(units_for(64, 4096), 4096);
    assert_eq!(units_for(1, 10_000), 512);
    assert_eq!(units_for(usize::MAX, usize::MAX), MAX_UNITS);
    assert_eq!(SharedRing::bytes(64, 1), 192 + 64 * 64);
    assert_eq!(SharedRing::bytes(64, 8), 192 + 64 * 64);
    assert_eq!(SharedRing::bytes(64, 9), 256 + 64 * 64);
    assert_eq!(decode_intent(encode_intent(1 << 41 | 5, 7)), Some((5, 7)));
    assert_eq!(decode_intent(0), None);
}
