//! Transports move the slices of a request. `shm` copies through shared memory on the same host;
//! `tcp` carries slices over persistent connections. The engine picks one per request.

pub(crate) mod cpu_priority;
pub(crate) mod driver;
pub mod nontemporal;
pub(crate) mod rails_view;
pub(crate) mod rdma;
pub(crate) mod shm;
pub(crate) mod sockio;
pub(crate) mod staging;
pub(crate) mod tcp;

pub use crate::protocol::{handshake, wire};

use std::sync::Arc;

use multirail_policy::slicing::SlicePlan;

use crate::batch::Task;
use crate::error::Result;
use crate::peer::Peer;
use crate::segment::BufferDescriptor;

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Opcode {
    /// Copy from the target segment into local memory.
    Read,
    /// Copy from local memory into the target segment.
    Write,
}

/// One request after validation: every address has been checked.
pub(crate) struct Prepared {
    pub op: Opcode,
    /// Local address (source of a write, destination of a read).
    pub local: usize,
    /// Address in the target's memory.
    pub remote: u64,
    pub len: u64,
    /// Where the local memory lives; picks the rails' tiers.
    pub location: crate::memory::Location,
    pub priority: multirail_policy::qos::Priority,
    /// The target buffer that holds `remote..remote+len`, shared by every request of a batch
    /// to it (a request is moved and queued several times on its way to the wire).
    pub buffer: Arc<BufferDescriptor>,
    /// The batch the request belongs to (its id), so a thread waiting for that batch can
    /// find the request's queued work and do it itself.
    pub batch: u64,
    pub task: Arc<Task>,
}

/// How requests are cut into slices, per direction (reads and writes have their own cap on
/// slices per request).
pub(crate) struct Plans {
    pub read: SlicePlan,
    pub write: SlicePlan,
}

impl Plans {
    /// The plan of requests in direction `op`.
    pub(crate) fn of(&self, op: Opcode) -> &SlicePlan {
        match op {
            Opcode::Read => &self.read,
            Opcode::Write => &self.write,
        }
    }
}

impl Prepared {
    /// Fails the whole request with `err` (one part that reports at once).
    pub(crate) fn fail(&self, err: crate::error::Error) {
        self.task.add_parts(1);
        self.task.part_done(Err(err));
    }

    /// The request's slices per `plan`, or `None` after failing the request when it cannot be
    /// sliced (the engine validated the length, so only a corrupt plan gets here).
    pub(crate) fn slices(&self, plan: &SlicePlan) -> Option<multirail_policy::slicing::Slices> {
        match plan.slices(self.len) {
            Ok(s) => Some(s),
            Err(e) => {
                self.fail(crate::error::Error::invalid("length", e.to_string()));
                None
            }
        }
    }
}

/// A way of moving slices to and from a peer.
pub(crate) trait Transport: Send + Sync {
    /// Name used in logs, statistics and the `transport` setting.
    fn name(&self) -> &'static str;

    /// Gets ready to carry `buffer` of `peer` (connects, maps, probes); an error means this
    /// transport cannot serve it and another should be tried or the submit refused.
    fn prepare(&self, peer: &Arc<Peer>, buffer: &BufferDescriptor) -> Result<()>;

    /// Posts the slices of each request per its direction's plan, in order. Every part it
    /// adds to a task reports exactly once, with success or the error that stopped it. A
    /// transport may resolve what the requests share once and hand their work over together.
    fn post(&self, reqs: Vec<(Arc<Peer>, Prepared)>, plans: &Plans);
}
