//! libibverbs loaded at run time, for multirail's RDMA transport.
//!
//! A binary using this crate starts on machines without rdma-core: nothing
//! links against libibverbs, [`Verbs::load`] opens it with `dlopen` and
//! resolves every entry point up front, and its error says what to install.
//!
//! The data-path verbs (`ibv_post_send`, `ibv_post_recv`,
//! `ibv_post_srq_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) are static
//! inline functions in verbs.h that call the provider through
//! `context->ops`; this crate does the same through `#[repr(C)]` mirrors of
//! rdma-core's structs, whose layout is checked at compile time (see
//! `ffi/layout.rs` and `layout/verbs_layout.c`). Posting goes through
//! reusable [`SendBatch`] / [`RecvBatch`] chains: no allocation per request
//! and one doorbell per batch.
//!
//! Objects are reference-counted handles: every child keeps its parent
//! alive (QP → CQs, SRQ, PD → context → library), so drop order never
//! matters, and each is destroyed exactly once when its last user goes.
//!
//! ```no_run
//! use multirail_verbs::*;
//! # fn main() -> Result<(), VerbsError> {
//! let verbs = Verbs::load()?;
//! for dev in verbs.devices()? {
//!     for port in dev.ports.iter().filter(|p| p.is_active()) {
//!         println!("{} port {}: {:?} Gbit/s", dev.name, port.port, port.rate_gbps());
//!     }
//! }
//! # Ok(()) }
//! ```

#![warn(
    missing_docs,
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks
)]

mod context;
mod cq;
mod device;
mod discover;
mod error;
mod ffi;
mod library;
mod mr;
mod post;
mod qp;
mod srq;
mod sysfs;

pub use context::{Context, ProtectionDomain};
pub use cq::{CompletionChannel, CompletionQueue, WcOpcode, WcStatus, WorkCompletion};
pub use device::{
    ib_speed_gbps, ib_width_lanes, mtu_bytes, mtu_code, DeviceAttr, DeviceInfo, Gid, GidEntry,
    GidType, LinkLayer, PortInfo, PortState,
};
pub use error::{PostError, VerbsError};
pub use library::{Verbs, LIBRARY_NAMES};
pub use mr::{Access, MemoryRegion};
pub use post::{RecvBatch, SendBatch, SendFlags, SendOp, Sge};
pub use qp::{PathOptions, QpCaps, QpState, QueuePair, RemoteQp, MAX_PSN};
pub use srq::SharedReceiveQueue;
pub use sysfs::{read_gid_attrs, read_numa_node, SYSFS_INFINIBAND};

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        send_sync::<Verbs>();
        send_sync::<Context>();
        send_sync::<ProtectionDomain>();
        send_sync::<MemoryRegion>();
        send_sync::<CompletionQueue>();
        send_sync::<CompletionChannel>();
        send_sync::<SharedReceiveQueue>();
        send_sync::<QueuePair>();
        send_sync::<SendBatch>();
        send_sync::<RecvBatch>();
        send_sync::<VerbsError>();
    }
}
