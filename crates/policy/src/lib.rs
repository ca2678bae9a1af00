//! Every decision the multirail transfer engine makes, free of I/O.
//!
//! Each module is one mechanism, a plain struct fed events and the current time as arguments;
//! it owns no thread, socket, clock or global, so the engine, the simulator and the tests drive
//! the same code.

pub mod backoff;
pub mod coalesce;
pub mod delivery;
pub mod dispatch;
pub mod health;
pub mod lanes;
pub mod latency;
pub mod pairing;
pub mod qos;
pub mod receive;
pub mod selector;
pub mod slicing;
pub mod timer;
pub mod usage;
