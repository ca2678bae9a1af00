//! The plain data the C API passes: handles, constants and request structs.

/// Handle of an engine, from `multirail_engine_new`. An id looked up in a table, never a
/// pointer: a freed or never-issued handle gives MULTIRAIL_ERR_UNKNOWN_HANDLE. 0 is never a
/// valid handle, so it can mark "none".
#[allow(non_camel_case_types)]
pub type multirail_engine_t = u64;

/// Opcode: copy from the target segment into local memory.
pub const MULTIRAIL_OP_READ: i32 = 0;
/// Opcode: copy from local memory into the target segment.
pub const MULTIRAIL_OP_WRITE: i32 = 1;

/// Priority: metadata, control and latency-sensitive transfers (the default in Rust).
pub const MULTIRAIL_PRIO_HIGH: i32 = 0;
/// Priority: interactive and serving traffic.
pub const MULTIRAIL_PRIO_MEDIUM: i32 = 1;
/// Priority: bulk and background transfers.
pub const MULTIRAIL_PRIO_LOW: i32 = 2;

/// Transport: follow the engine's `transport` setting (shared memory to a same-host peer,
/// RDMA across hosts when both ends have it, else TCP, with the setting `"auto"`).
pub const MULTIRAIL_TRANSPORT_AUTO: i32 = 0;
/// Transport: always TCP.
pub const MULTIRAIL_TRANSPORT_TCP: i32 = 1;
/// Transport: always shared memory (same-host peers only).
pub const MULTIRAIL_TRANSPORT_SHM: i32 = 2;
/// Transport: always RDMA (both ends need an RDMA device).
pub const MULTIRAIL_TRANSPORT_RDMA: i32 = 3;

/// Status: some bytes are still on their way.
pub const MULTIRAIL_STATUS_PENDING: i32 = 0;
/// Status: every byte is in place at its destination.
pub const MULTIRAIL_STATUS_COMPLETED: i32 = 1;
/// Status: failed; `multirail_last_error()` says why right after the status call.
pub const MULTIRAIL_STATUS_FAILED: i32 = 2;

/// One transfer: `length` bytes between local address `source` and address `target_offset`
/// in segment `segment`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct multirail_request_t {
    /// MULTIRAIL_OP_READ (target to source) or MULTIRAIL_OP_WRITE (source to target).
    pub opcode: i32,
    /// Local address, inside memory this engine allocated or registered.
    pub source: u64,
    /// The segment id from `multirail_open_segment`.
    pub segment: u64,
    /// Address in the target segment: a buffer's `addr` (see `multirail_segment_buffers`)
    /// plus an offset.
    pub target_offset: u64,
    /// Bytes to move; at least 1.
    pub length: u64,
    /// MULTIRAIL_PRIO_HIGH, MULTIRAIL_PRIO_MEDIUM or MULTIRAIL_PRIO_LOW.
    pub priority: i32,
}

/// One entry of a prepared list: like `multirail_request_t` without the direction and
/// priority, which are chosen at each post.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct multirail_prepared_entry_t {
    /// Local address, inside memory this engine allocated or registered.
    pub source: u64,
    /// The segment id from `multirail_open_segment`.
    pub segment: u64,
    /// Address in the target segment (a buffer's `addr` plus an offset).
    pub target_offset: u64,
    /// Bytes to move; at least 1.
    pub length: u64,
}

/// A buffer a segment serves: requests may target `[addr, addr + len)`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct multirail_buffer_info_t {
    /// Start address in the segment owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}
