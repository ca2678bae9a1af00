//! Memory an engine serves, and the segments of peers it opens.

use std::ffi::{c_char, c_void};

use engine::{Location, SegmentId};

use crate::error::{guard, Failure};
use crate::handles;
use crate::types::{multirail_buffer_info_t, multirail_engine_t};
use crate::util::{check_out, fill, opt_str, out_slice, req_str, write_out};

/// The location named by `location` (NULL: anywhere).
///
/// # Safety
/// `location` is NULL or a NUL-terminated string.
unsafe fn location(location: *const c_char) -> Result<Location, Failure> {
    // SAFETY: forwarded contract.
    match unsafe { opt_str(location, "location") }? {
        None => Ok(Location::Any),
        Some(s) => Ok(s.parse::<Location>()?),
    }
}

/// Allocates `len` bytes of shared memory that engine `e` owns and serves to peers (same-host
/// peers map it directly), and stores its address in `*addr_out`. The memory is zeroed. It is
/// released by `multirail_unregister(e, *addr_out)` or when the engine is freed, after which
/// it must not be touched.
///
/// `location` is `"*"` (anywhere; also what NULL means) or `"cpu:N"` to place the memory on
/// NUMA node N.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `addr_out` is NULL;
/// MULTIRAIL_ERR_INVALID_ARGUMENT for `len` 0, a malformed `location` or a NUMA node that
/// does not exist; MULTIRAIL_ERR_IO when the system refuses the memory;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `location` is NULL or a NUL-terminated string; `addr_out` is NULL or valid for writing one
/// `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_allocate(
    e: multirail_engine_t,
    len: usize,
    location: *const c_char,
    addr_out: *mut u64,
) -> i32 {
    guard("multirail_allocate", || {
        check_out(addr_out, "addr_out")?;
        // SAFETY: `location` is NULL or NUL-terminated by this function's contract.
        let location = unsafe { self::location(location) }?;
        let buffer = handles::get(e)?.engine.allocate(len, location)?;
        // SAFETY: `addr_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(addr_out, buffer.addr()) };
        // The engine keeps the memory until it is unregistered; this handle is not needed.
        drop(buffer);
        Ok(())
    })
}

/// Registers `len` bytes of the caller's memory at `ptr` with engine `e`, so requests may
/// use it as their source and peers may read and write it. `location` is as for
/// `multirail_allocate` (NULL: `"*"`).
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `ptr` is NULL;
/// MULTIRAIL_ERR_INVALID_ARGUMENT for `len` 0, a range that wraps around, a range that
/// overlaps memory already registered, or a bad `location`; MULTIRAIL_ERR_UNKNOWN_HANDLE for
/// an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `[ptr, ptr + len)` must stay valid, readable and writable memory until it is unregistered
/// (`multirail_unregister(e, (uint64_t)ptr)`) or the engine is freed, and no request in flight
/// uses it then: the engine and peers read and write it at any time in between. `location` is
/// NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn multirail_register(
    e: multirail_engine_t,
    ptr: *mut c_void,
    len: usize,
    location: *const c_char,
) -> i32 {
    guard("multirail_register", || {
        if ptr.is_null() {
            return Err(Failure::null("ptr"));
        }
        // SAFETY: `location` is NULL or NUL-terminated by this function's contract.
        let location = unsafe { self::location(location) }?;
        // The engine never dereferences `ptr` here; the caller keeps the memory valid while
        // registered, by this function's contract.
        handles::get(e)?
            .engine
            .register(ptr.cast(), len, location)?;
        Ok(())
    })
}

/// Stops engine `e` serving the buffer that starts at `addr` (from `multirail_allocate` or
/// `multirail_register`). Memory from `multirail_allocate` is unmapped once no request in
/// flight uses it; registered memory is the caller's again once requests using it finished.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_INVALID_ARGUMENT when no buffer starts at `addr`;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
#[no_mangle]
pub extern "C" fn multirail_unregister(e: multirail_engine_t, addr: u64) -> i32 {
    guard("multirail_unregister", || {
        handles::get(e)?.engine.unregister(addr)?;
        Ok(())
    })
}

/// Opens segment `name` (what the peer's `multirail_segment_name` gives; `host:port` with the
/// default peer-to-peer metadata) and stores its id in `*segment_out`. Opening an open segment
/// again gives the same id.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `name` or `segment_out` is NULL;
/// MULTIRAIL_ERR_PEER when the name is not `host:port` or does not resolve, nothing answers
/// there, or the metadata store does not know it; MULTIRAIL_ERR_NOT_A_MEMBER when the peer
/// refuses this engine's membership token; MULTIRAIL_ERR_INVALID_ARGUMENT for a name that is
/// not UTF-8;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine. It
/// blocks up to the configured connect and metadata timeouts.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `segment_out` is NULL or valid for writing one
/// `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_open_segment(
    e: multirail_engine_t,
    name: *const c_char,
    segment_out: *mut u64,
) -> i32 {
    guard("multirail_open_segment", || {
        check_out(segment_out, "segment_out")?;
        // SAFETY: `name` is NULL or NUL-terminated by this function's contract.
        let name = unsafe { req_str(name, "name") }?;
        let id = handles::get(e)?.engine.open_segment(name)?;
        // SAFETY: `segment_out` passed check_out and is writable by this function's contract.
        unsafe { write_out(segment_out, id.0) };
        Ok(())
    })
}

/// Closes segment `segment` of engine `e`: forgets it and closes its connections.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or segment.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine;
/// requests already submitted to the segment run on.
#[no_mangle]
pub extern "C" fn multirail_close_segment(e: multirail_engine_t, segment: u64) -> i32 {
    guard("multirail_close_segment", || {
        handles::get(e)?.engine.close_segment(SegmentId(segment))?;
        Ok(())
    })
}

/// Lists the buffers open segment `segment` serves, as this engine last learned them: sets
/// `*count` to their number and fills `out[0 .. min(cap, *count))`. `out` may be NULL when
/// `cap` is 0, to ask the count.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_BUFFER_TOO_SMALL when `cap < *count` (the first `cap`
/// are filled); MULTIRAIL_ERR_NULL_POINTER when `count` is NULL, or `out` is NULL with
/// `cap > 0`; MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine or segment.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `out` is NULL or valid for writing `cap` `multirail_buffer_info_t`; `count` is NULL or
/// valid for writing one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_segment_buffers(
    e: multirail_engine_t,
    segment: u64,
    out: *mut multirail_buffer_info_t,
    cap: usize,
    count: *mut usize,
) -> i32 {
    guard("multirail_segment_buffers", || {
        check_out(count, "count")?;
        // SAFETY: `out` is NULL or valid for `cap` elements by this function's contract.
        let dst = unsafe { out_slice(out, cap, "out") }?;
        let descriptor = handles::get(e)?
            .engine
            .segment_descriptor(SegmentId(segment))?;
        let buffers: Vec<multirail_buffer_info_t> = descriptor
            .buffers
            .iter()
            .map(|b| multirail_buffer_info_t {
                addr: b.addr,
                len: b.len,
            })
            .collect();
        // SAFETY: `count` passed check_out and is writable by this function's contract.
        unsafe { write_out(count, buffers.len()) };
        fill(dst, &buffers);
        if cap < buffers.len() {
            return Err(Failure::too_small("out", buffers.len(), cap));
        }
        Ok(())
    })
}
