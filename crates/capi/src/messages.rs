//! Notifications, two-sided messages, and the traffic statistics.

use std::ffi::{c_char, c_void};

use engine::SegmentId;

use crate::error::{guard, multirail_error_t as Code, Failure};
use crate::handles::{self, lock};
use crate::types::multirail_engine_t;
use crate::util::{
    check_out, copy_string_out, fill, in_slice, out_slice, req_str, timeout, write_out,
};

/// Sends text `msg` as a notification from engine `e` to open segment `segment`; it arrives
/// in order with this engine's messages, and the peer reads it with
/// `multirail_notifications`.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `msg` is NULL;
/// MULTIRAIL_ERR_INVALID_ARGUMENT when `msg` is not UTF-8 or larger than the peer's receive
/// buffers; MULTIRAIL_ERR_TIMEOUT when the peer posted no receive buffer for it within
/// `transports.tcp.timeout_ms`; MULTIRAIL_ERR_PEER when the connection broke;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or segment.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `msg` is NULL or a NUL-terminated string, read only during the call.
#[no_mangle]
pub unsafe extern "C" fn multirail_notify(
    e: multirail_engine_t,
    segment: u64,
    msg: *const c_char,
) -> i32 {
    guard("multirail_notify", || {
        // SAFETY: `msg` is NULL or NUL-terminated by this function's contract.
        let msg = unsafe { req_str(msg, "msg") }?;
        handles::get(e)?
            .engine
            .send_notification(SegmentId(segment), msg)?;
        Ok(())
    })
}

/// Copies the notifications engine `e` received since the last successful call, in arrival
/// order (per sender, in send order), as a NUL-terminated JSON array
/// `[{"from": SEGMENT_NAME, "msg": TEXT}, ...]` (`[]` when none) into `buf` of `cap` bytes,
/// and sets `*needed` to the bytes it takes (the NUL included). `buf` may be NULL when `cap`
/// is 0. None is lost when the buffer is too small: they stay queued for the next call
/// (which may then return more, if more arrived).
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_BUFFER_TOO_SMALL when `cap < *needed`;
/// MULTIRAIL_ERR_NULL_POINTER when `needed` is NULL, or `buf` is NULL with `cap > 0`;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine; each
/// notification is returned to one caller only.
///
/// # Safety
/// `buf` is NULL or valid for writing `cap` bytes; `needed` is NULL or valid for writing one
/// `size_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_notifications(
    e: multirail_engine_t,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("multirail_notifications", || {
        check_out(needed, "needed")?;
        let handle = handles::get(e)?;
        // Held while taking from the engine too, so two callers never reorder them.
        let mut queued = lock(&handle.notifications);
        queued.extend(handle.engine.receive_notifications());
        let json = serde_json::Value::Array(
            queued
                .iter()
                .map(|n| serde_json::json!({"from": n.from, "msg": n.msg}))
                .collect(),
        )
        .to_string();
        // SAFETY: `buf` and `needed` are as this function's contract states.
        unsafe { copy_string_out(&json, buf, cap, needed) }?;
        queued.clear();
        Ok(())
    })
}

/// Sends the `len` bytes at `data` as a message from engine `e` to open segment `segment`;
/// the peer gets them from `multirail_recv`, after every message this engine sent it before.
/// Waits while the peer has no receive buffer posted for it, up to
/// `transports.tcp.timeout_ms`. `data` may be NULL when `len` is 0.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `data` is NULL with `len > 0`;
/// MULTIRAIL_ERR_INVALID_ARGUMENT when the message is larger than the peer's receive
/// buffers; MULTIRAIL_ERR_TIMEOUT when no buffer came in time; MULTIRAIL_ERR_PEER when the
/// connection broke; MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or segment.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `data` is NULL or points to `len` readable bytes, read only during the call.
#[no_mangle]
pub unsafe extern "C" fn multirail_send(
    e: multirail_engine_t,
    segment: u64,
    data: *const c_void,
    len: usize,
) -> i32 {
    guard("multirail_send", || {
        // SAFETY: `data` is NULL or points to `len` bytes by this function's contract, read
        // only during this call.
        let bytes = unsafe { in_slice(data.cast::<u8>(), len, "data") }?;
        handles::get(e)?.engine.send(SegmentId(segment), bytes)?;
        Ok(())
    })
}

/// Receives the next message sent to engine `e` by any peer, waiting up to `timeout_ms`
/// milliseconds (negative: no limit; 0: check once). Copies its bytes into `buf` of `cap`
/// bytes and sets `*len_out` to its size; when `from` is not NULL, copies the sender's
/// segment name there as a NUL-terminated string of at most `from_cap` bytes. `buf` may be
/// NULL when `cap` is 0.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_WAIT_TIMEOUT when nothing arrived in time;
/// MULTIRAIL_ERR_BUFFER_TOO_SMALL when the message does not fit in `cap` (`*len_out` is its
/// size) or its sender's name not in `from_cap` (the message says how many bytes `from`
/// needs): nothing is copied and the message is kept for the next call;
/// MULTIRAIL_ERR_NULL_POINTER when `len_out` is NULL, or `buf` is NULL with `cap > 0`;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine; each
/// message goes to one caller only, and concurrent callers may take them in any order.
///
/// # Safety
/// `buf` is NULL or valid for writing `cap` bytes; `len_out` is NULL or valid for writing one
/// `size_t`; `from` is NULL or valid for writing `from_cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn multirail_recv(
    e: multirail_engine_t,
    timeout_ms: i64,
    buf: *mut c_void,
    cap: usize,
    len_out: *mut usize,
    from: *mut c_char,
    from_cap: usize,
) -> i32 {
    guard("multirail_recv", || {
        check_out(len_out, "len_out")?;
        // SAFETY: `buf` is NULL or valid for `cap` bytes, and `from` NULL or valid for
        // `from_cap` bytes, by this function's contract; the two are the caller's distinct
        // buffers.
        let (dst, from_dst) = unsafe {
            (
                out_slice(buf.cast::<u8>(), cap, "buf")?,
                if from.is_null() {
                    None
                } else {
                    Some(out_slice(from.cast::<u8>(), from_cap, "from")?)
                },
            )
        };
        let handle = handles::get(e)?;
        let held = lock(&handle.held).pop_front();
        let msg = match held {
            Some(msg) => msg,
            // Not under the `held` lock: other callers need not wait for this one's timeout.
            None => match handle.engine.recv(timeout(timeout_ms))? {
                Some(msg) => msg,
                None => {
                    return Err(Failure::new(
                        Code::MULTIRAIL_ERR_WAIT_TIMEOUT,
                        format!("no message arrived within {timeout_ms} ms"),
                    ))
                }
            },
        };
        // SAFETY: `len_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(len_out, msg.data.len()) };
        let name_len = msg.from.len() + 1;
        let too_small = if msg.data.len() > cap {
            Some(Failure::too_small("buf", msg.data.len(), cap))
        } else if from_dst.as_ref().is_some_and(|f| f.len() < name_len) {
            Some(Failure::too_small("from", name_len, from_cap))
        } else {
            None
        };
        if let Some(failure) = too_small {
            lock(&handle.held).push_front(msg);
            return Err(failure);
        }
        fill(dst, &msg.data);
        if let Some(f) = from_dst {
            fill(f, msg.from.as_bytes());
            f[msg.from.len()].write(0);
        }
        Ok(())
    })
}

/// Copies engine `e`'s traffic statistics as a NUL-terminated JSON object into `buf` of `cap`
/// bytes and sets `*needed` to the bytes it takes (the NUL included): per rail (bytes,
/// slices, errors, EWMA bandwidth, bytes in flight and window), per priority (queue depth,
/// wait percentiles, promotions), and what peers read and wrote of this engine over tcp
/// (`served`). The same document as the Rust `Engine::traffic_stats`. `buf` may be NULL when
/// `cap` is 0; ask the size first and allow some room: the document may grow between calls.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_BUFFER_TOO_SMALL when `cap < *needed`;
/// MULTIRAIL_ERR_NULL_POINTER when `needed` is NULL, or `buf` is NULL with `cap > 0`;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `buf` is NULL or valid for writing `cap` bytes; `needed` is NULL or valid for writing one
/// `size_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_traffic_stats_json(
    e: multirail_engine_t,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("multirail_traffic_stats_json", || {
        check_out(needed, "needed")?;
        let stats = handles::get(e)?.engine.traffic_stats();
        let json = serde_json::to_string(&stats).map_err(|e| {
            Failure::new(
                Code::MULTIRAIL_ERR_INTERNAL,
                format!("traffic statistics do not serialize: {e}"),
            )
        })?;
        // SAFETY: `buf` and `needed` are as this function's contract states.
        unsafe { copy_string_out(&json, buf, cap, needed) }
    })
}
