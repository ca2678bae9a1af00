//! The C API called as C would, from Rust: threads sharing an engine, handles freed under
//! them, and the buffer-too-small paths that must lose nothing.

use std::ffi::{c_char, CStr, CString};
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use crate::error::multirail_error_t as Code;
use crate::*;

fn last_error() -> String {
    // SAFETY: never NULL; valid until this thread's next call, which comes after the copy.
    unsafe { CStr::from_ptr(multirail_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn ok(rc: i32) {
    assert_eq!(rc, 0, "failed with {rc}: {}", last_error());
}

fn engine(transport: &str) -> multirail_engine_t {
    let config = CString::new(format!(r#"{{"transport":"{transport}"}}"#)).unwrap();
    let mut e = 0;
    // SAFETY: valid strings and output pointer.
    ok(unsafe { multirail_engine_new(config.as_ptr(), c"127.0.0.1:0".as_ptr(), &mut e) });
    assert_ne!(e, 0);
    e
}

fn name(e: multirail_engine_t) -> String {
    let mut buf = [0 as c_char; 128];
    let mut needed = 0;
    // SAFETY: `buf` holds 128 bytes.
    ok(unsafe { multirail_engine_name(e, buf.as_mut_ptr(), buf.len(), &mut needed) });
    // SAFETY: the call wrote a NUL-terminated string into `buf`.
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(needed, s.len() + 1);
    s
}

fn open(e: multirail_engine_t, segment: &str) -> u64 {
    let name = CString::new(segment).unwrap();
    let mut seg = 0;
    // SAFETY: valid string and output pointer.
    ok(unsafe { multirail_open_segment(e, name.as_ptr(), &mut seg) });
    seg
}

fn allocate(e: multirail_engine_t, len: usize) -> u64 {
    let mut addr = 0;
    // SAFETY: NULL location, valid output pointer.
    ok(unsafe { multirail_allocate(e, len, null(), &mut addr) });
    addr
}

fn transfer(e: multirail_engine_t, requests: &[multirail_request_t]) {
    let mut batch = 0;
    // SAFETY: valid output pointer; `requests` is a live slice.
    unsafe {
        ok(multirail_batch_allocate(e, requests.len(), &mut batch));
        ok(multirail_batch_submit(
            e,
            batch,
            requests.as_ptr(),
            requests.len(),
            null(),
        ));
    }
    ok(multirail_batch_wait(e, batch, 30_000));
    // A completed request has no failure to report.
    let mut code = 1;
    // SAFETY: valid output pointer.
    unsafe { ok(multirail_batch_request_error(e, batch, 0, &mut code)) };
    assert_eq!(code, 0);
    ok(multirail_batch_free(e, batch));
}

#[test]
fn threads_share_an_engine() {
    const THREADS: usize = 4;
    const SLICE: usize = 256 << 10;
    let target = engine("tcp");
    let base = allocate(target, THREADS * SLICE);
    let initiator = engine("tcp");
    let seg = open(initiator, &name(target));
    std::thread::scope(|s| {
        for t in 0..THREADS {
            s.spawn(move || {
                let src = allocate(initiator, 2 * SLICE);
                // SAFETY: the engine allocated 2 * SLICE bytes at `src` and keeps them until
                // unregistered; only this thread touches them.
                let mem = unsafe { std::slice::from_raw_parts_mut(src as *mut u8, 2 * SLICE) };
                for (i, b) in mem[..SLICE].iter_mut().enumerate() {
                    *b = (i * 7 + t * 13) as u8;
                }
                let at = base + (t * SLICE) as u64;
                let (len, back) = (SLICE as u64, src + SLICE as u64);
                let write = multirail_request_t {
                    opcode: MULTIRAIL_OP_WRITE,
                    source: src,
                    segment: seg,
                    target_offset: at,
                    length: len,
                    priority: (t % 3) as i32,
                };
                transfer(initiator, &[write]);
                let read = multirail_request_t {
                    opcode: MULTIRAIL_OP_READ,
                    source: back,
                    ..write
                };
                transfer(initiator, &[read]);
                assert!(mem[..SLICE] == mem[SLICE..], "thread {t}: bytes differ");
                ok(multirail_unregister(initiator, src));
            });
        }
    });
    ok(multirail_engine_free(initiator));
    ok(multirail_engine_free(target));
}

#[test]
fn a_handle_freed_under_other_threads_gives_unknown_handle() {
    let e = engine("tcp");
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let callers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut unknown = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let mut batch = 0;
                        // SAFETY: valid output pointer.
                        let rc = unsafe { multirail_batch_allocate(e, 4, &mut batch) };
                        if rc == 0 {
                            // The batch may have gone with the engine: either is fine.
                            let rc = multirail_batch_free(e, batch);
                            assert!(rc == 0 || rc == Code::MULTIRAIL_ERR_UNKNOWN_HANDLE as i32);
                        } else {
                            assert_eq!(rc, Code::MULTIRAIL_ERR_UNKNOWN_HANDLE as i32);
                            assert!(last_error().contains("freed"), "{}", last_error());
                            unknown += 1;
                        }
                    }
                    unknown
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        ok(multirail_engine_free(e));
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for c in callers {
            assert!(c.join().unwrap() > 0, "no call saw the freed handle");
        }
    });
    assert_eq!(
        multirail_engine_free(e),
        Code::MULTIRAIL_ERR_UNKNOWN_HANDLE as i32
    );
}

/// A `multirail_recv` blocked without a timeout returns once another thread frees the engine
/// (it used to wait on for good).
#[test]
fn freeing_an_engine_ends_a_receive_blocked_on_it() {
    let e = engine("tcp");
    std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            let mut len = 0usize;
            // SAFETY: no buffer (cap 0) and a valid length pointer; -1: no timeout.
            unsafe { multirail_recv(e, -1, null_mut(), 0, &mut len, null_mut(), 0) }
        });
        std::thread::sleep(Duration::from_millis(300));
        let freed = std::time::Instant::now();
        ok(multirail_engine_free(e));
        let rc = receiver.join().unwrap();
        assert_eq!(
            rc,
            Code::MULTIRAIL_ERR_WAIT_TIMEOUT as i32,
            "{}",
            last_error()
        );
        assert!(
            freed.elapsed() < Duration::from_secs(2),
            "returned {:?} after the free",
            freed.elapsed()
        );
    });
}

/// Polls `multirail_notifications` with a buffer of `cap` bytes until it succeeds.
fn notifications(e: multirail_engine_t, cap: usize) -> (i32, usize, String) {
    let mut buf = vec![0 as c_char; cap.max(1)];
    let mut needed = 0;
    // SAFETY: `buf` holds at least `cap` bytes.
    let rc = unsafe { multirail_notifications(e, buf.as_mut_ptr(), cap, &mut needed) };
    let text = if rc == 0 {
        // SAFETY: on success the buffer holds a NUL-terminated string.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_owned()
    } else {
        String::new()
    };
    (rc, needed, text)
}

#[test]
fn notifications_too_big_for_the_buffer_stay_queued() {
    let target = engine("auto");
    let initiator = engine("auto");
    let seg = open(initiator, &name(target));
    for msg in [c"one", c"two", c"three"] {
        // SAFETY: NUL-terminated literal.
        ok(unsafe { multirail_notify(initiator, seg, msg.as_ptr()) });
    }
    let from = name(initiator);
    let want = format!(
        r#"[{{"from":"{from}","msg":"one"}},{{"from":"{from}","msg":"two"}},{{"from":"{from}","msg":"three"}}]"#
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (rc, needed, _) = notifications(target, 8);
        assert_eq!(rc, Code::MULTIRAIL_ERR_BUFFER_TOO_SMALL as i32);
        if needed == want.len() + 1 {
            break;
        }
        assert!(Instant::now() < deadline, "only {needed} bytes arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (rc, _, text) = notifications(target, want.len() + 1);
    ok(rc);
    assert_eq!(text, want);
    let (rc, needed, text) = notifications(target, 16);
    ok(rc);
    assert_eq!((needed, text.as_str()), (3, "[]"));
    ok(multirail_engine_free(initiator));
    ok(multirail_engine_free(target));
}

#[test]
fn a_message_too_big_for_the_buffer_is_kept() {
    let target = engine("tcp");
    let initiator = engine("tcp");
    let seg = open(initiator, &name(target));
    let data: Vec<u8> = (0..100u8).collect();
    // SAFETY: `data` holds 100 bytes.
    ok(unsafe { multirail_send(initiator, seg, data.as_ptr().cast(), data.len()) });
    let mut buf = vec![0u8; 100];
    let mut from = [0 as c_char; 64];
    let mut len = 0;
    // SAFETY: `buf` holds 10 of its 100 bytes as told, `from` 4 of its 64.
    let rc = unsafe {
        multirail_recv(
            target,
            10_000,
            buf.as_mut_ptr().cast(),
            10,
            &mut len,
            null_mut(),
            0,
        )
    };
    assert_eq!(
        (rc, len),
        (Code::MULTIRAIL_ERR_BUFFER_TOO_SMALL as i32, 100),
        "{}",
        last_error()
    );
    assert!(
        buf.iter().all(|&b| b == 0),
        "a refused receive copied bytes"
    );
    // SAFETY: as above.
    let rc = unsafe {
        multirail_recv(
            target,
            0,
            buf.as_mut_ptr().cast(),
            100,
            &mut len,
            from.as_mut_ptr(),
            4,
        )
    };
    assert_eq!(rc, Code::MULTIRAIL_ERR_BUFFER_TOO_SMALL as i32);
    assert!(last_error().contains("`from`"), "{}", last_error());
    // SAFETY: as above, with the whole of both buffers.
    ok(unsafe {
        multirail_recv(
            target,
            0,
            buf.as_mut_ptr().cast(),
            100,
            &mut len,
            from.as_mut_ptr(),
            from.len(),
        )
    });
    assert_eq!(&buf[..len], &data[..]);
    // SAFETY: the call wrote a NUL-terminated name into `from`.
    let sender = unsafe { CStr::from_ptr(from.as_ptr()) }.to_str().unwrap();
    assert_eq!(sender, name(initiator));
    // SAFETY: as above.
    let rc = unsafe { multirail_recv(target, 0, null_mut(), 0, &mut len, null_mut(), 0) };
    assert_eq!(rc, Code::MULTIRAIL_ERR_WAIT_TIMEOUT as i32);
    ok(multirail_engine_free(initiator));
    ok(multirail_engine_free(target));
}

#[test]
fn a_failed_request_reports_failed_with_its_reason() {
    let target = engine("tcp");
    let dst = allocate(target, 4096);
    let initiator = engine("tcp");
    let seg = open(initiator, &name(target));
    let src = allocate(initiator, 4096);
    // The initiator's copy of the descriptor still lists the buffer: the request is accepted
    // and then refused by the target, so it fails in flight.
    ok(multirail_unregister(target, dst));
    let mut batch = 0;
    let r = multirail_request_t {
        opcode: MULTIRAIL_OP_WRITE,
        source: src,
        segment: seg,
        target_offset: dst,
        length: 4096,
        priority: MULTIRAIL_PRIO_HIGH,
    };
    // SAFETY: valid pointers.
    unsafe {
        ok(multirail_batch_allocate(initiator, 1, &mut batch));
        ok(multirail_batch_submit(initiator, batch, &r, 1, null()));
    }
    let rc = multirail_batch_wait(initiator, batch, 30_000);
    assert_eq!(
        rc,
        Code::MULTIRAIL_ERR_TRANSFER_FAILED as i32,
        "{}",
        last_error()
    );
    assert!(last_error().contains("refused"), "{}", last_error());
    let mut status = -1;
    // SAFETY: valid output pointers.
    unsafe {
        ok(multirail_batch_overall_status(
            initiator,
            batch,
            &mut status,
        ));
        assert_eq!(status, MULTIRAIL_STATUS_FAILED);
        assert!(last_error().contains("failed"), "{}", last_error());
        ok(multirail_batch_status(initiator, batch, 0, &mut status));
    }
    assert_eq!(status, MULTIRAIL_STATUS_FAILED);
    assert!(last_error().contains("request 0"), "{}", last_error());
    // Why, as a code: the target refused the request.
    let mut code = 1;
    // SAFETY: valid output pointer.
    unsafe {
        ok(multirail_batch_request_error(
            initiator, batch, 0, &mut code,
        ))
    };
    assert_eq!(code, Code::MULTIRAIL_ERR_PEER as i32, "{}", last_error());
    assert!(last_error().contains("refused"), "{}", last_error());
    // SAFETY: as above; a NULL output and an index past the batch are argument errors.
    unsafe {
        assert_eq!(
            multirail_batch_request_error(initiator, batch, 0, std::ptr::null_mut()),
            Code::MULTIRAIL_ERR_NULL_POINTER as i32
        );
        assert_eq!(
            multirail_batch_request_error(initiator, batch, 1, &mut code),
            Code::MULTIRAIL_ERR_INVALID_ARGUMENT as i32
        );
    }
    ok(multirail_batch_free(initiator, batch));
    ok(multirail_engine_free(initiator));
    ok(multirail_engine_free(target));
}

#[test]
fn an_empty_or_blank_token_is_a_configuration_error_naming_it() {
    // Membership fails closed from C too: a token that is set must be real.
    for token in ["", "      "] {
        let config = CString::new(format!(r#"{{"auth":{{"token":"{token}"}}}}"#)).unwrap();
        let mut e = 0;
        // SAFETY: valid strings and output pointer.
        let rc = unsafe { multirail_engine_new(config.as_ptr(), c"127.0.0.1:0".as_ptr(), &mut e) };
        assert_eq!(rc, Code::MULTIRAIL_ERR_CONFIG as i32, "{token:?}");
        assert_eq!(e, 0, "no engine for {token:?}");
        let why = last_error();
        assert!(why.contains("auth.token") && why.contains("empty"), "{why}");
    }
}
