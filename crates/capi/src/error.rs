//! Status codes, the thread-local last error, and the guard every exported function runs its
//! body in: it catches panics and turns failures into a code and a message.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use engine::Error;

/// The status every function returns: 0 on success, a negative code on failure.
/// `multirail_last_error()` then says what failed, naming the argument or key.
#[allow(non_camel_case_types)]
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum multirail_error_t {
    /// Success.
    MULTIRAIL_OK = 0,
    /// A value is out of range or malformed; the message names the argument.
    MULTIRAIL_ERR_INVALID_ARGUMENT = -1,
    /// A required pointer was NULL; the message names the argument.
    MULTIRAIL_ERR_NULL_POINTER = -2,
    /// An engine, segment, batch or prepared-list handle is unknown: never issued, or freed.
    MULTIRAIL_ERR_UNKNOWN_HANDLE = -3,
    /// The configuration is invalid; the message names the key.
    MULTIRAIL_ERR_CONFIG = -4,
    /// An output buffer is too small; the function's `needed` (or `count`, `len_out`)
    /// output says how big it must be.
    MULTIRAIL_ERR_BUFFER_TOO_SMALL = -5,
    /// A peer did not answer within `transports.tcp.timeout_ms`.
    MULTIRAIL_ERR_TIMEOUT = -6,
    /// The wait's own timeout passed (or nothing arrived in time); requests still run.
    MULTIRAIL_ERR_WAIT_TIMEOUT = -7,
    /// The peer is unreachable or disconnected, refused the request, spoke bad protocol, or the
    /// transport demanded cannot reach it.
    MULTIRAIL_ERR_PEER = -8,
    /// The peer and this engine do not share the cluster's membership token.
    MULTIRAIL_ERR_NOT_A_MEMBER = -9,
    /// A request's source is not inside registered memory, or its target lies outside every
    /// buffer of the segment.
    MULTIRAIL_ERR_OUT_OF_RANGE = -10,
    /// The batch is full, or still has requests in flight.
    MULTIRAIL_ERR_BATCH = -11,
    /// An operating-system call failed (memory could not be allocated or mapped, a thread not
    /// started, a port not bound).
    MULTIRAIL_ERR_IO = -12,
    /// A panic was caught, or an unexpected failure; the engine may be unusable after it.
    MULTIRAIL_ERR_INTERNAL = -13,
    /// A request of the batch failed; the message says why.
    MULTIRAIL_ERR_TRANSFER_FAILED = -14,
}

use multirail_error_t as Code;

/// Why a call failed: the code it returns and the message `multirail_last_error` gives.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: Code,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(code: Code, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// A required pointer argument `arg` was NULL.
    pub(crate) fn null(arg: &str) -> Failure {
        Failure::new(
            Code::MULTIRAIL_ERR_NULL_POINTER,
            format!("argument `{arg}` is NULL"),
        )
    }

    /// Argument `arg` has a bad value.
    pub(crate) fn invalid(arg: &str, reason: impl std::fmt::Display) -> Failure {
        Failure::new(
            Code::MULTIRAIL_ERR_INVALID_ARGUMENT,
            format!("invalid argument `{arg}`: {reason}"),
        )
    }

    /// An output buffer `arg` is too small.
    pub(crate) fn too_small(arg: &str, needed: usize, cap: usize) -> Failure {
        Failure::new(
            Code::MULTIRAIL_ERR_BUFFER_TOO_SMALL,
            format!("`{arg}` holds {cap} but {needed} are needed"),
        )
    }
}

/// The code for each engine error. The engine reports an unknown prepared list as an invalid
/// `list` argument; here it is an unknown handle like every other.
impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        let code = match &e {
            Error::Config(_) => Code::MULTIRAIL_ERR_CONFIG,
            Error::InvalidArgument { arg: "list", .. } => Code::MULTIRAIL_ERR_UNKNOWN_HANDLE,
            Error::InvalidArgument { .. } => Code::MULTIRAIL_ERR_INVALID_ARGUMENT,
            Error::SourceNotRegistered { .. } | Error::TargetOutOfRange { .. } => {
                Code::MULTIRAIL_ERR_OUT_OF_RANGE
            }
            Error::UnknownSegment(_) | Error::UnknownBatch(_) => Code::MULTIRAIL_ERR_UNKNOWN_HANDLE,
            Error::SegmentUnreachable { .. }
            | Error::PeerDisconnected { .. }
            | Error::RemoteRejected { .. }
            | Error::Protocol { .. }
            | Error::TransportUnavailable { .. } => Code::MULTIRAIL_ERR_PEER,
            Error::Timeout { .. } => Code::MULTIRAIL_ERR_TIMEOUT,
            Error::WaitTimeout { .. } => Code::MULTIRAIL_ERR_WAIT_TIMEOUT,
            Error::NotAMember { .. } => Code::MULTIRAIL_ERR_NOT_A_MEMBER,
            Error::BatchFull { .. } | Error::BatchBusy(_) => Code::MULTIRAIL_ERR_BATCH,
            Error::Memory(_) | Error::Io { .. } => Code::MULTIRAIL_ERR_IO,
            _ => Code::MULTIRAIL_ERR_INTERNAL,
        };
        Failure::new(code, e.to_string())
    }
}

impl From<engine::ConfigError> for Failure {
    fn from(e: engine::ConfigError) -> Failure {
        Failure::from(Error::Config(e))
    }
}

thread_local! {
    /// The calling thread's last failure message; empty after a call that succeeded.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// Whether the running call already set the message (see [`note_last_error`]).
    static NOTED: Cell<bool> = const { Cell::new(false) };
}

/// Sets the calling thread's last error message. Interior NULs become spaces. Does nothing
/// while the thread is being torn down (its thread-locals are gone).
fn set_last_error(message: &str) {
    let _ = LAST_ERROR.try_with(|e| {
        let mut e = e.borrow_mut();
        if message.is_empty() && e.is_empty() {
            return; // already "": keep the allocation-free path of successful calls
        }
        *e = CString::new(message.replace('\0', " ")).unwrap_or_default();
    });
}

/// Sets the last error message although the running call succeeds (a request's failure, read
/// by a status call).
pub(crate) fn note_last_error(message: &str) {
    set_last_error(message);
    let _ = NOTED.try_with(|n| n.set(true));
}

/// Runs the body of exported function `func`: returns 0 when it succeeds, else its failure's
/// code with the message (prefixed by `func`) as the thread's last error. A panic is caught
/// and returned as `MULTIRAIL_ERR_INTERNAL`: it never unwinds into the caller.
///
/// The previous message is replaced only once the body has returned, so a caller may pass
/// the string `multirail_last_error()` gave it as an argument of its next call.
pub(crate) fn guard(func: &str, body: impl FnOnce() -> Result<(), Failure>) -> i32 {
    let _ = NOTED.try_with(|n| n.set(false));
    // Unwind safety: a panic can leave the engine's state half-changed; the engine then fails
    // its later calls (poisoned locks), which this guard turns into codes too.
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            if !NOTED.try_with(Cell::get).unwrap_or(false) {
                set_last_error("");
            }
            return Code::MULTIRAIL_OK as i32;
        }
        Ok(Err(f)) => f,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            // Dropping a payload can itself panic; forget it instead.
            std::mem::forget(payload);
            Failure::new(
                Code::MULTIRAIL_ERR_INTERNAL,
                format!("internal error (a panic was caught): {what}"),
            )
        }
    };
    // Building the message cannot panic but is kept out of the caller's way all the same.
    let _ = catch_unwind(|| set_last_error(&format!("{func}: {}", failure.message)));
    failure.code as i32
}

/// Returns the message of the last multirail call made on the calling thread when it failed,
/// naming the argument, configuration key or peer; "" when that call succeeded (or none was
/// made yet). The one exception: `multirail_batch_status` and
/// `multirail_batch_overall_status` succeed with MULTIRAIL_STATUS_FAILED and set it to the
/// request's failure. Never NULL.
///
/// The string belongs to the library. It stays valid until this thread's next multirail call
/// (other than this one) returns, so it may be passed to that call; copy it to keep it longer.
///
/// Thread safety: safe from any thread; each thread has its own message.
#[no_mangle]
pub extern "C" fn multirail_last_error() -> *const c_char {
    static EMPTY: &CStr = c"";
    catch_unwind(|| {
        LAST_ERROR
            .try_with(|e| e.borrow().as_ptr())
            .unwrap_or(EMPTY.as_ptr())
    })
    .unwrap_or(EMPTY.as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: multirail_last_error never returns NULL, and the string stays valid until
        // this thread's next multirail call, which comes after the copy.
        unsafe { CStr::from_ptr(multirail_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_is_caught_and_named() {
        let rc = guard("multirail_test", || panic!("boom {}", 7));
        assert_eq!(rc, Code::MULTIRAIL_ERR_INTERNAL as i32);
        let msg = last();
        assert!(msg.starts_with("multirail_test: internal error"), "{msg}");
        assert!(msg.contains("boom 7"), "{msg}");
        assert_eq!(guard("multirail_test", || Ok(())), 0);
        assert_eq!(last(), "");
    }

    #[test]
    fn failures_set_the_message_and_code() {
        let rc = guard("multirail_test", || Err(Failure::null("out")));
        assert_eq!(rc, -2);
        assert_eq!(last(), "multirail_test: argument `out` is NULL");
        let rc = guard("multirail_test", || {
            Err(Error::InvalidArgument {
                arg: "list",
                reason: "gone".into(),
            }
            .into())
        });
        assert_eq!(rc, Code::MULTIRAIL_ERR_UNKNOWN_HANDLE as i32);
        let rc = guard("multirail_test", || Err(Failure::invalid("a\0b", "x")));
        assert_eq!(rc, -1);
        assert!(last().contains("a b"));
    }

    #[test]
    fn the_last_message_stays_valid_during_the_next_call() {
        guard("multirail_test", || Err(Failure::invalid("first", "x")));
        let p = multirail_last_error();
        let rc = guard("multirail_test", || {
            // SAFETY: the message stays valid until this call returns.
            let seen = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned();
            Err(Failure::invalid("second", seen))
        });
        assert_eq!(rc, -1);
        assert!(last().contains("`first`"), "{}", last());
        guard("multirail_test", || {
            note_last_error("noted");
            Ok(())
        });
        assert_eq!(last(), "noted");
        guard("multirail_test", || Ok(()));
        assert_eq!(last(), "");
    }

    #[test]
    fn each_thread_has_its_own_message() {
        guard("multirail_test", || Err(Failure::invalid("here", "x")));
        std::thread::spawn(|| assert_eq!(last(), ""))
            .join()
            .unwrap();
        assert!(last().contains("`here`"));
    }
}
