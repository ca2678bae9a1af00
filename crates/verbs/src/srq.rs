//! Shared receive queues (`ibv_srq`): one pool of receive buffers that many
//! queue pairs consume from, so receive memory scales with traffic rather
//! than with the number of connections.

use crate::context::ProtectionDomain;
use crate::ffi::{self, ibv_recv_wr, ibv_srq};
use crate::post::RecvBatch;
use crate::{PostError, VerbsError};
use std::ptr::NonNull;
use std::sync::Arc;

/// A shared receive queue. Clone to share; destroyed after the last clone
/// and the last QP attached to it are gone.
#[derive(Clone)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

pub(crate) struct SrqInner {
    srq: NonNull<ibv_srq>,
    max_wr: u32,
    max_sge: u32,
    pd: ProtectionDomain,
}

// SAFETY: providers lock the SRQ in post_srq_recv (rdma-core's providers
// take a spinlock per SRQ), so several threads may post; Drop runs once,
// after every attached QP (each holds a clone).
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // A failure here is not actionable (the device may be gone), and
        // a destructor must not panic: the result is ignored.
        // SAFETY: created by ibv_create_srq, destroyed once, no QP left on it.
        let _ = unsafe { (self.pd.verbs().sym.ibv_destroy_srq)(self.srq.as_ptr()) };
    }
}

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("max_wr", &self.inner.max_wr)
            .field("max_sge", &self.inner.max_sge)
            .finish_non_exhaustive()
    }
}

impl SharedReceiveQueue {
    /// Creates a shared receive queue holding up to `max_wr` receives of up
    /// to `max_sge` entries each; the provider may grant more (see
    /// [`SharedReceiveQueue::max_wr`]).
    ///
    /// Fails with `InvalidArgument` above the device's `max_srq_wr` /
    /// `max_srq_sge`, and with `ibv_create_srq` and its errno otherwise.
    pub fn new(pd: &ProtectionDomain, max_wr: u32, max_sge: u32) -> Result<Self, VerbsError> {
        let attr = pd.context().attr();
        if max_wr == 0 || max_wr > attr.max_srq_wr || max_sge == 0 || max_sge > attr.max_srq_sge {
            return Err(VerbsError::InvalidArgument(format!(
                "SRQ of {max_wr} receives x {max_sge} sges outside the device's {} x {}",
                attr.max_srq_wr, attr.max_srq_sge
            )));
        }
        let mut init = ffi::ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ffi::ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit: 0,
            },
        };
        // SAFETY: live PD; `init` is a complete ibv_srq_init_attr, updated
        // in place with the granted sizes.
        let raw = unsafe { (pd.verbs().sym.ibv_create_srq)(pd.raw(), &mut init) };
        let srq = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_create_srq"))?;
        Ok(Self {
            inner: Arc::new(SrqInner {
                srq,
                max_wr: init.attr.max_wr,
                max_sge: init.attr.max_sge,
                pd: pd.clone(),
            }),
        })
    }

    /// Receives the queue holds, as granted.
    pub fn max_wr(&self) -> u32 {
        self.inner.max_wr
    }

    /// Scatter/gather entries per receive, as granted.
    pub fn max_sge(&self) -> u32 {
        self.inner.max_sge
    }

    /// The protection domain the queue belongs to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// Posts every receive in `batch` with one `ibv_post_srq_recv` call.
    /// The batch is left as it is, to be cleared or posted again.
    ///
    /// On failure the receives before [`PostError::index_of_bad_wr`] were
    /// posted and the rest were not (ENOMEM: the queue is full).
    ///
    /// # Safety
    /// Every entry must lie in memory registered under its lkey with
    /// LOCAL_WRITE, and those bytes must not be accessed through Rust
    /// references until the receive's completion has been polled: the device
    /// writes them at any time before that.
    pub unsafe fn post_recv(&self, batch: &mut RecvBatch) -> Result<(), PostError> {
        let head = batch.head();
        if head.is_null() {
            return Ok(());
        }
        let srq = self.inner.srq.as_ptr();
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: `srq` is live for `self`'s lifetime and its context pointer
        // outlives it; this is verbs.h's inline ibv_post_srq_recv
        // (srq->context->ops.post_srq_recv). The chain is well-formed (built
        // by RecvBatch) and the buffers are the caller's contract.
        let ret = unsafe {
            match (*(*srq).context).ops.post_srq_recv {
                Some(post) => post(srq, head, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if ret == 0 {
            return Ok(());
        }
        Err(PostError {
            verb: "ibv_post_srq_recv",
            index_of_bad_wr: batch.index_of(bad),
            errno: ret.checked_abs().unwrap_or(libc::EIO),
        })
    }

    pub(crate) fn raw(&self) -> *mut ibv_srq {
        self.inner.srq.as_ptr()
    }
}
