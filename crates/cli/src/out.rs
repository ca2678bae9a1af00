//! Everything the command prints on stdout goes through [`print`], so a reader that goes away
//! (`multirail sim x.json | head -1`) ends the command quietly with status 141, the status of
//! a process killed by SIGPIPE, after the usual cleanup (children stopped, engines shut down)
//! as the failure returns through the callers.
//!
//! The process keeps SIGPIPE ignored (Rust's default) rather than restoring its default
//! action: the engine writes to sockets, and a peer that goes away must be an `EPIPE` error
//! there, not the death of the process.

use std::fmt;
use std::io::{ErrorKind, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::Failure;

/// Exit status of a command whose stdout was closed under it (128 + SIGPIPE).
pub const EXIT_BROKEN_PIPE: u8 = 128 + libc::SIGPIPE as u8;

/// Writes `args` to stdout. A closed stdout (`EPIPE`) is [`Failure::StdoutClosed`]; any other
/// write error is a runtime failure.
pub fn print(args: fmt::Arguments) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args).map_err(failure)
}

/// Flushes stdout (what [`print`] left in its line buffer), with [`print`]'s errors.
pub fn flush() -> Result<(), Failure> {
    std::io::stdout().lock().flush().map_err(failure)
}

fn failure(e: std::io::Error) -> Failure {
    if e.kind() == ErrorKind::BrokenPipe {
        Failure::StdoutClosed
    } else {
        Failure::Runtime(anyhow::Error::new(e).context("writing to stdout"))
    }
}

/// Prints like `println!` through [`print`]; evaluates to its `Result`.
macro_rules! outln {
    () => {
        $crate::out::print(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::print(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// Set by the panic hook when a `println!` that does not go through [`print`] (such as
/// `metadata-server`'s) panicked on a closed stdout or stderr.
static CLOSED_PIPE_PANIC: AtomicBool = AtomicBool::new(false);

/// Installs a panic hook that keeps quiet about a panic of `println!` or `eprintln!` on a
/// closed pipe and notes it for [`closed_pipe_panicked`]; every other panic is reported as
/// before.
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        let printing = msg.starts_with("failed printing to stdout")
            || msg.starts_with("failed printing to stderr");
        if printing && msg.contains("Broken pipe") {
            CLOSED_PIPE_PANIC.store(true, Ordering::SeqCst);
        } else {
            default(info);
        }
    }));
}

/// True once a panic on a closed pipe was seen (see [`install_panic_hook`]).
pub fn closed_pipe_panicked() -> bool {
    CLOSED_PIPE_PANIC.load(Ordering::SeqCst)
}
