//! The C API of multirail: `libmultirail.so` and `libmultirail.a`, declared by
//! `include/multirail.h`, which cbindgen generates from this crate (a test keeps the
//! checked-in header equal to what it generates now). See `docs/c-api.md`.
//!
//! The rules every function keeps:
//! - it returns an `int32_t` status, 0 (`MULTIRAIL_OK`) or a negative `multirail_error_t`, and
//!   writes its results through output pointers, only on success unless its doc says otherwise;
//! - after a failure, `multirail_last_error()` gives the calling thread's message, naming the
//!   argument, key or peer; it is "" after a success;
//! - engines are `uint64_t` handles looked up in a table, never pointers, so a freed or
//!   never-issued handle (engine, segment, batch, prepared list) is `MULTIRAIL_ERR_UNKNOWN_HANDLE`;
//! - a NULL required pointer is `MULTIRAIL_ERR_NULL_POINTER` naming the argument;
//! - no panic unwinds into the caller: one is caught and returned as `MULTIRAIL_ERR_INTERNAL`;
//! - every function may be called from any thread, concurrently on the same engine.

// The C names (`multirail_request_t`, ...) are the API.
#![allow(non_camel_case_types)]
// Every public item is documented (its comment goes into the header), and every unsafe block
// says why it holds.
#![warn(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

// Internal helpers.
mod handles;
mod util;

// The header follows this order: status codes and types, then the functions by group.
mod error;
mod types;

mod lifecycle;

mod memory;

mod batches;

mod messages;

pub use batches::*;
pub use error::{multirail_error_t, multirail_last_error};
pub use lifecycle::*;
pub use memory::*;
pub use messages::*;
pub use types::*;

#[cfg(test)]
mod tests;
