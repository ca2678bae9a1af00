//! Batches of requests, and prepared lists posted into them.

use std::ffi::c_char;

use engine::{
    BatchId, Error, Opcode, PreparedEntry, PreparedListId, Priority, Request, SegmentId, Status,
    TransportChoice,
};

use crate::error::{guard, multirail_error_t as Code, note_last_error, Failure};
use crate::handles;
use crate::types::{
    multirail_engine_t, multirail_prepared_entry_t, multirail_request_t, MULTIRAIL_OP_READ,
    MULTIRAIL_OP_WRITE, MULTIRAIL_STATUS_COMPLETED, MULTIRAIL_STATUS_FAILED,
    MULTIRAIL_STATUS_PENDING, MULTIRAIL_TRANSPORT_AUTO, MULTIRAIL_TRANSPORT_RDMA,
    MULTIRAIL_TRANSPORT_SHM, MULTIRAIL_TRANSPORT_TCP,
};
use crate::util::{check_out, in_slice, opt_str, timeout, write_out};

fn opcode(op: i32, arg: &str) -> Result<Opcode, Failure> {
    match op {
        MULTIRAIL_OP_READ => Ok(Opcode::Read),
        MULTIRAIL_OP_WRITE => Ok(Opcode::Write),
        _ => Err(Failure::invalid(
            arg,
            format!("{op} is neither MULTIRAIL_OP_READ (0) nor MULTIRAIL_OP_WRITE (1)"),
        )),
    }
}

fn priority(p: i32, arg: &str) -> Result<Priority, Failure> {
    u8::try_from(p)
        .ok()
        .and_then(Priority::from_u8)
        .ok_or_else(|| {
            Failure::invalid(
                arg,
                format!("{p} is not a priority (0 HIGH, 1 MEDIUM, 2 LOW)"),
            )
        })
}

fn transport(t: i32) -> Result<Option<TransportChoice>, Failure> {
    match t {
        MULTIRAIL_TRANSPORT_AUTO => Ok(None),
        MULTIRAIL_TRANSPORT_TCP => Ok(Some(TransportChoice::Tcp)),
        MULTIRAIL_TRANSPORT_SHM => Ok(Some(TransportChoice::Shm)),
        MULTIRAIL_TRANSPORT_RDMA => Ok(Some(TransportChoice::Rdma)),
        _ => Err(Failure::invalid(
            "transport",
            format!("{t} is not a transport (0 AUTO, 1 TCP, 2 SHM, 3 RDMA)"),
        )),
    }
}

/// The status code of `status`; a failure's reason becomes the thread's last error (prefixed
/// by `func`) although the call succeeds.
fn status_code(func: &str, what: &str, status: Status) -> i32 {
    match status {
        Status::Pending => MULTIRAIL_STATUS_PENDING,
        Status::Completed => MULTIRAIL_STATUS_COMPLETED,
        Status::Failed(e) => {
            note_last_error(&format!("{func}: {what} failed: {e}"));
            MULTIRAIL_STATUS_FAILED
        }
    }
}

/// Creates a batch of engine `e` that holds up to `capacity` requests, and stores its id in
/// `*batch_out`.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `batch_out` is NULL;
/// MULTIRAIL_ERR_INVALID_ARGUMENT for `capacity` 0; MULTIRAIL_ERR_UNKNOWN_HANDLE for an
/// unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `batch_out` is NULL or valid for writing one `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_batch_allocate(
    e: multirail_engine_t,
    capacity: usize,
    batch_out: *mut u64,
) -> i32 {
    guard("multirail_batch_allocate", || {
        check_out(batch_out, "batch_out")?;
        let id = handles::get(e)?.engine.allocate_batch(capacity)?;
        // SAFETY: `batch_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(batch_out, id.0) };
        Ok(())
    })
}

/// Checks the `n` requests at `requests`, then starts them all in batch `batch`; they take
/// the next `n` indices of the batch, in order. Nothing is started when any request is bad.
/// With a `notification` (not NULL), once every one of these requests completed, the text
/// is sent as a notification to each segment they target, so it arrives after the data; a
/// failed request means no notification.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `requests` is NULL;
/// MULTIRAIL_ERR_INVALID_ARGUMENT for `n` 0, a bad opcode, priority or length 0 (the message
/// names `requests[i]`), or a notification that is not UTF-8; MULTIRAIL_ERR_OUT_OF_RANGE when
/// a source is not inside registered memory or a target lies outside every buffer of its
/// segment; MULTIRAIL_ERR_BATCH when the batch has no room for `n` more;
/// MULTIRAIL_ERR_PEER when a target segment cannot be reached by the transport chosen;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine, batch or segment.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine, also
/// into the same batch (each call's requests take consecutive indices).
///
/// # Safety
/// `requests` is NULL or points to `n` readable `multirail_request_t`; `notification` is NULL
/// or a NUL-terminated string. Both are read only during the call. The memory the requests
/// name must stay registered until they finished.
#[no_mangle]
pub unsafe extern "C" fn multirail_batch_submit(
    e: multirail_engine_t,
    batch: u64,
    requests: *const multirail_request_t,
    n: usize,
    notification: *const c_char,
) -> i32 {
    guard("multirail_batch_submit", || {
        // SAFETY: `requests` is NULL or points to `n` requests and `notification` is NULL or
        // NUL-terminated, by this function's contract; both are used only during this call.
        let (requests, notification) = unsafe {
            (
                in_slice(requests, n, "requests")?,
                opt_str(notification, "notification")?,
            )
        };
        if n == 0 {
            return Err(Failure::invalid("n", "must be at least 1"));
        }
        let requests = requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                if r.length == 0 {
                    return Err(Failure::invalid(
                        &format!("requests[{i}].length"),
                        "must be at least 1 byte",
                    ));
                }
                Ok(Request {
                    opcode: opcode(r.opcode, &format!("requests[{i}].opcode"))?,
                    priority: priority(r.priority, &format!("requests[{i}].priority"))?,
                    ..Request::write(r.source, SegmentId(r.segment), r.target_offset, r.length)
                })
            })
            .collect::<Result<Vec<_>, Failure>>()?;
        let handle = handles::get(e)?;
        match notification {
            None => handle.engine.submit(BatchId(batch), &requests)?,
            Some(msg) => handle
                .engine
                .submit_with_notification(BatchId(batch), &requests, msg)?,
        }
        Ok(())
    })
}

/// Stores the status of request `index` of batch `batch` (in submission order) in
/// `*status_out`: MULTIRAIL_STATUS_PENDING, _COMPLETED or _FAILED. When it is FAILED,
/// `multirail_last_error()` says why although the call returns MULTIRAIL_OK. While it is
/// pending and the next same-host copy the copy workers would take is one of the batch's, the
/// calling thread does it first (at most 1 MiB), as `multirail_batch_overall_status` does.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `status_out` is NULL;
/// MULTIRAIL_ERR_INVALID_ARGUMENT when `index` is not below the number of requests
/// submitted; MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or batch.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `status_out` is NULL or valid for writing one `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_batch_status(
    e: multirail_engine_t,
    batch: u64,
    index: usize,
    status_out: *mut i32,
) -> i32 {
    const FUNC: &str = "multirail_batch_status";
    guard(FUNC, || {
        check_out(status_out, "status_out")?;
        let status = handles::get(e)?.engine.status(BatchId(batch), index)?;
        let code = status_code(FUNC, &format!("request {index} of batch {batch}"), status);
        // SAFETY: `status_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(status_out, code) };
        Ok(())
    })
}

/// Stores why request `index` of batch `batch` (in submission order) failed, as the code a
/// call failing that way returns, in `*code_out`: MULTIRAIL_ERR_TIMEOUT when its peer answered
/// nothing within `transports.tcp.timeout_ms`, MULTIRAIL_ERR_PEER when the peer refused it or
/// went away, and so on; MULTIRAIL_OK while the request is pending or once it completed. When
/// it failed, `multirail_last_error()` gives the message although the call returns
/// MULTIRAIL_OK. Adjacent requests moved as one run share their run's failure. Like
/// `multirail_batch_status`, a call on a pending request may first do one of the batch's
/// same-host copies.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `code_out` is NULL;
/// MULTIRAIL_ERR_INVALID_ARGUMENT when `index` is not below the number of requests
/// submitted; MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or batch.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `code_out` is NULL or valid for writing one `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_batch_request_error(
    e: multirail_engine_t,
    batch: u64,
    index: usize,
    code_out: *mut i32,
) -> i32 {
    const FUNC: &str = "multirail_batch_request_error";
    guard(FUNC, || {
        check_out(code_out, "code_out")?;
        let code = match handles::get(e)?.engine.status(BatchId(batch), index)? {
            Status::Failed(err) => {
                let failure = Failure::from(err);
                note_last_error(&format!(
                    "{FUNC}: request {index} of batch {batch} failed: {}",
                    failure.message
                ));
                failure.code as i32
            }
            Status::Pending | Status::Completed => Code::MULTIRAIL_OK as i32,
        };
        // SAFETY: `code_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(code_out, code) };
        Ok(())
    })
}

/// Stores the status of the whole batch `batch` in `*status_out`: MULTIRAIL_STATUS_FAILED
/// when any request failed (`multirail_last_error()` then says why although the call returns
/// MULTIRAIL_OK), else PENDING while any runs, else COMPLETED. When the next same-host copy
/// the copy workers would take is one of the batch's, the calling thread does it first (at
/// most 1 MiB, tens to hundreds of µs), so a thread polling its batch moves it on.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `status_out` is NULL;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or batch.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `status_out` is NULL or valid for writing one `int32_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_batch_overall_status(
    e: multirail_engine_t,
    batch: u64,
    status_out: *mut i32,
) -> i32 {
    const FUNC: &str = "multirail_batch_overall_status";
    guard(FUNC, || {
        check_out(status_out, "status_out")?;
        let status = handles::get(e)?.engine.overall_status(BatchId(batch))?;
        let code = status_code(FUNC, &format!("a request of batch {batch}"), status);
        // SAFETY: `status_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(status_out, code) };
        Ok(())
    })
}

/// Blocks until every request of batch `batch` finished, or `timeout_ms` milliseconds passed
/// (negative: no limit; 0: check once).
///
/// Returns MULTIRAIL_OK when every request completed; MULTIRAIL_ERR_TRANSFER_FAILED when one
/// failed (the message says which error; the others still ran to their end);
/// MULTIRAIL_ERR_WAIT_TIMEOUT when the time passed first (the requests run on);
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or batch.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine; several
/// threads may wait on the same batch.
#[no_mangle]
pub extern "C" fn multirail_batch_wait(e: multirail_engine_t, batch: u64, timeout_ms: i64) -> i32 {
    guard("multirail_batch_wait", || {
        match handles::get(e)?
            .engine
            .wait(BatchId(batch), timeout(timeout_ms))
        {
            Ok(()) => Ok(()),
            Err(e @ (Error::WaitTimeout { .. } | Error::UnknownBatch(_))) => Err(e.into()),
            Err(e) => Err(Failure::new(
                Code::MULTIRAIL_ERR_TRANSFER_FAILED,
                format!("a request of batch {batch} failed: {e}"),
            )),
        }
    })
}

/// Frees batch `batch` of engine `e`; its id is unknown from then on.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_BATCH while requests of the batch are in flight (wait
/// first); MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or batch (freeing twice is
/// reported).
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine; a
/// call on the same batch racing the free sees either the batch or UNKNOWN_HANDLE.
#[no_mangle]
pub extern "C" fn multirail_batch_free(e: multirail_engine_t, batch: u64) -> i32 {
    guard("multirail_batch_free", || {
        handles::get(e)?.engine.free_batch(BatchId(batch))?;
        Ok(())
    })
}

/// Checks and resolves the `n` entries at `entries` once (each source registered, each
/// target inside a buffer of its open segment, the transport chosen and readied) and keeps
/// them as a list of engine `e` to post by index with `multirail_prepared_submit`, many
/// times; stores its id in `*list_out`. `transport` is MULTIRAIL_TRANSPORT_AUTO (follow the
/// engine's `transport` setting) or forces TCP, SHM or RDMA for every entry.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `entries` or `list_out` is NULL;
/// MULTIRAIL_ERR_INVALID_ARGUMENT for `n` 0, an unknown transport or an entry of length 0;
/// MULTIRAIL_ERR_OUT_OF_RANGE when a source is not registered or a target lies outside its
/// segment's buffers; MULTIRAIL_ERR_PEER when the transport cannot reach a segment;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or segment. Nothing is kept on failure.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `entries` is NULL or points to `n` readable `multirail_prepared_entry_t`, read only
/// during the call; `list_out` is NULL or valid for writing one `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_prepare(
    e: multirail_engine_t,
    entries: *const multirail_prepared_entry_t,
    n: usize,
    transport: i32,
    list_out: *mut u64,
) -> i32 {
    guard("multirail_prepare", || {
        check_out(list_out, "list_out")?;
        // SAFETY: `entries` is NULL or points to `n` entries by this function's contract,
        // used only during this call.
        let entries = unsafe { in_slice(entries, n, "entries") }?;
        if n == 0 {
            return Err(Failure::invalid("n", "must be at least 1"));
        }
        let transport = self::transport(transport)?;
        let entries = entries
            .iter()
            .enumerate()
            .map(|(i, en)| {
                if en.length == 0 {
                    return Err(Failure::invalid(
                        &format!("entries[{i}].length"),
                        "must be at least 1 byte",
                    ));
                }
                Ok(PreparedEntry {
                    source: en.source,
                    target: SegmentId(en.segment),
                    target_offset: en.target_offset,
                    length: en.length,
                })
            })
            .collect::<Result<Vec<_>, Failure>>()?;
        let id = handles::get(e)?.engine.prepare(&entries, transport)?;
        // SAFETY: `list_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(list_out, id.0) };
        Ok(())
    })
}

/// Posts entries of prepared list `list` into batch `batch` as `opcode` (MULTIRAIL_OP_READ:
/// target to source; MULTIRAIL_OP_WRITE: source to target) at `priority`: those at the
/// `n_indices` indices at `indices`, in that order (an index may repeat), or every entry when
/// `indices` is NULL and `n_indices` 0. They take the batch's next indices, as submitted
/// requests would. With a `notification` (not NULL), it is sent to each segment the posted
/// entries target once they all completed (see `multirail_batch_submit`). Nothing is posted
/// when anything is wrong.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `indices` is NULL with
/// `n_indices > 0`; MULTIRAIL_ERR_INVALID_ARGUMENT for a bad opcode or priority, `n_indices`
/// 0 with `indices` not NULL, an index past the list's end, or a notification that is not
/// UTF-8; MULTIRAIL_ERR_OUT_OF_RANGE when a source was unregistered since the list was
/// prepared; MULTIRAIL_ERR_BATCH when the batch has no room; MULTIRAIL_ERR_PEER when a
/// target's process exited; MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine, batch or
/// list.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine, the
/// same list included.
///
/// # Safety
/// `indices` is NULL or points to `n_indices` readable `size_t`; `notification` is NULL or
/// a NUL-terminated string. Both are read only during the call.
#[no_mangle]
pub unsafe extern "C" fn multirail_prepared_submit(
    e: multirail_engine_t,
    batch: u64,
    list: u64,
    opcode: i32,
    priority: i32,
    indices: *const usize,
    n_indices: usize,
    notification: *const c_char,
) -> i32 {
    guard("multirail_prepared_submit", || {
        // SAFETY: `indices` is NULL or points to `n_indices` elements and `notification` is
        // NULL or NUL-terminated, by this function's contract; used only during this call.
        let (slice, notification) = unsafe {
            (
                in_slice(indices, n_indices, "indices")?,
                opt_str(notification, "notification")?,
            )
        };
        let indices = if indices.is_null() { None } else { Some(slice) };
        let opcode = self::opcode(opcode, "opcode")?;
        let priority = self::priority(priority, "priority")?;
        let engine = &handles::get(e)?.engine;
        let (batch, list) = (BatchId(batch), PreparedListId(list));
        match notification {
            None => engine.submit_prepared(batch, list, opcode, priority, indices)?,
            Some(msg) => engine
                .submit_prepared_with_notification(batch, list, opcode, priority, indices, msg)?,
        }
        Ok(())
    })
}

/// Stores how many entries prepared list `list` holds in `*len_out`.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `len_out` is NULL;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or list.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `len_out` is NULL or valid for writing one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_prepared_len(
    e: multirail_engine_t,
    list: u64,
    len_out: *mut usize,
) -> i32 {
    guard("multirail_prepared_len", || {
        check_out(len_out, "len_out")?;
        let len = handles::get(e)?.engine.prepared_len(PreparedListId(list))?;
        // SAFETY: `len_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(len_out, len) };
        Ok(())
    })
}

/// Frees prepared list `list` of engine `e`; batches posted from it run on. Its id is unknown
/// from then on.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or list (freeing
/// twice is reported).
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine; a post
/// from the same list racing the free either posts or returns UNKNOWN_HANDLE.
#[no_mangle]
pub extern "C" fn multirail_prepared_free(e: multirail_engine_t, list: u64) -> i32 {
    guard("multirail_prepared_free", || {
        handles::get(e)?
            .engine
            .free_prepared(PreparedListId(list))?;
        Ok(())
    })
}
