//! Starting and freeing engines, and their names.

use std::ffi::c_char;

use engine::{Config, Engine};

use crate::error::guard;
use crate::handles;
use crate::types::multirail_engine_t;
use crate::util::{check_out, copy_string_out, opt_str, write_out};

/// Where the engine listens when `listen` is NULL.
const DEFAULT_LISTEN: &str = "0.0.0.0:0";

/// Sends the engine's tracing output to stderr, filtered by RUST_LOG, when RUST_LOG is set
/// (nothing is printed otherwise). Only the first call in a process installs it.
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}

/// Starts an engine serving its segment on `listen` and stores its handle in `*out`.
///
/// `config_json` is the configuration as a JSON document (the keys of the configuration
/// reference; `{}` gives the defaults); NULL loads it from the `MULTIRAIL_CONF` environment
/// variable (a path or inline JSON), else takes the defaults. `listen` is `ADDR:PORT` (port 0
/// picks a free port); NULL means "0.0.0.0:0". When `RUST_LOG` is set, the engine's log goes
/// to stderr, filtered by it.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_NULL_POINTER when `out` is NULL;
/// MULTIRAIL_ERR_CONFIG for an invalid configuration (the message names the key);
/// MULTIRAIL_ERR_INVALID_ARGUMENT for a `listen` that is not `ADDR:PORT` or a string that is
/// not UTF-8; MULTIRAIL_ERR_IO when the port cannot be bound or a thread not started.
/// `*out` is written only on success.
///
/// Thread safety: safe from any thread, concurrently with any other call.
///
/// # Safety
/// `config_json` and `listen` are NULL or NUL-terminated strings; `out` is NULL or valid for
/// writing one `multirail_engine_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_engine_new(
    config_json: *const c_char,
    listen: *const c_char,
    out: *mut multirail_engine_t,
) -> i32 {
    guard("multirail_engine_new", || {
        check_out(out, "out")?;
        // SAFETY: both are NULL or NUL-terminated strings by this function's contract, read
        // only during this call.
        let (json, listen) = unsafe {
            (
                opt_str(config_json, "config_json")?,
                opt_str(listen, "listen")?,
            )
        };
        init_logging();
        let config = match json {
            Some(json) => Config::from_json_str(json, "config_json")?,
            None => Config::load(None)?,
        };
        let engine = Engine::new(config, listen.unwrap_or(DEFAULT_LISTEN))?;
        let id = handles::insert(engine);
        // SAFETY: `out` passed check_out and is writable by this function's contract.
        unsafe { write_out(out, id) };
        Ok(())
    })
}

/// Shuts engine `e` down and frees its handle: its descriptor is withdrawn, its port and
/// connections closed, and the memory it allocated (`multirail_allocate`) is unmapped once
/// nothing uses it any more. Memory registered with `multirail_register` stays the caller's.
/// Every batch, prepared list and segment id of the engine goes with it. The handle is
/// unknown from then on.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_UNKNOWN_HANDLE when `e` is not a live engine (freeing
/// twice is reported, not undefined).
///
/// Thread safety: safe from any thread, but `e` must not be in use by another thread while it
/// is freed: a call that raced the free completes on the engine being freed (which is then
/// released when that call returns) or returns MULTIRAIL_ERR_UNKNOWN_HANDLE. A
/// `multirail_recv` blocked on it returns at once (MULTIRAIL_ERR_WAIT_TIMEOUT, unless a
/// message had arrived), and a `multirail_batch_wait` as soon as its transfers fail with the
/// shutdown.
#[no_mangle]
pub extern "C" fn multirail_engine_free(e: multirail_engine_t) -> i32 {
    guard("multirail_engine_free", || {
        let handle = handles::remove(e)?;
        handle.engine.shutdown();
        drop(handle);
        Ok(())
    })
}

/// Copies engine `e`'s name, `host:port` of its listening port, as a NUL-terminated string
/// into `buf` of `cap` bytes, and sets `*needed` to the bytes it takes (the NUL included).
/// `buf` may be NULL when `cap` is 0, to ask the size.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_BUFFER_TOO_SMALL when `cap < *needed` (nothing is
/// copied); MULTIRAIL_ERR_NULL_POINTER when `needed` is NULL, or `buf` is NULL with `cap > 0`;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `buf` is NULL or valid for writing `cap` bytes; `needed` is NULL or valid for writing one
/// `size_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_engine_name(
    e: multirail_engine_t,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("multirail_engine_name", || {
        check_out(needed, "needed")?;
        let name = handles::get(e)?.engine.name();
        // SAFETY: `buf` and `needed` are as this function's contract states.
        unsafe { copy_string_out(&name, buf, cap, needed) }
    })
}

/// Copies the name peers pass to `multirail_open_segment` to reach engine `e`: its
/// `metadata.segment_name` when configured, else its name `host:port`. Same buffer rules as
/// `multirail_engine_name`.
///
/// Returns MULTIRAIL_OK; MULTIRAIL_ERR_BUFFER_TOO_SMALL when `cap < *needed` (nothing is
/// copied); MULTIRAIL_ERR_NULL_POINTER when `needed` is NULL, or `buf` is NULL with `cap > 0`;
/// MULTIRAIL_ERR_UNKNOWN_HANDLE for an unknown engine.
///
/// Thread safety: safe from any thread, concurrently with any call on the same engine.
///
/// # Safety
/// `buf` is NULL or valid for writing `cap` bytes; `needed` is NULL or valid for writing one
/// `size_t`.
#[no_mangle]
pub unsafe extern "C" fn multirail_segment_name(
    e: multirail_engine_t,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("multirail_segment_name", || {
        check_out(needed, "needed")?;
        let name = handles::get(e)?.engine.segment_name();
        // SAFETY: `buf` and `needed` are as this function's contract states.
        unsafe { copy_string_out(&name, buf, cap, needed) }
    })
}
