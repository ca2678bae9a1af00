//! Completion queues (`ibv_cq`), the completions polled from them, and
//! completion channels for sleeping until a completion arrives.

use crate::context::Context;
use crate::ffi::{self, ibv_comp_channel, ibv_cq, ibv_wc};
use crate::VerbsError;
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;

/// A work completion status (`enum ibv_wc_status`). Text comes from
/// [`crate::Verbs::wc_status_str`] or [`CompletionQueue::status_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcStatus(pub u32);

impl WcStatus {
    /// The request completed.
    pub const SUCCESS: Self = Self(0);
    /// A receive buffer was too small, or a send too long.
    pub const LOC_LEN_ERR: Self = Self(1);
    /// Local protection error: an sge outside its lkey's region.
    pub const LOC_PROT_ERR: Self = Self(4);
    /// Flushed: the QP went to the error state before this request ran.
    pub const WR_FLUSH_ERR: Self = Self(5);
    /// The peer refused access: bad rkey or range or rights.
    pub const REM_ACCESS_ERR: Self = Self(10);
    /// The peer did not answer within timeout × retry_cnt.
    pub const RETRY_EXC_ERR: Self = Self(12);
    /// The peer had no receive posted within rnr_retry attempts.
    pub const RNR_RETRY_EXC_ERR: Self = Self(13);

    /// True for [`WcStatus::SUCCESS`].
    pub fn is_success(self) -> bool {
        self == Self::SUCCESS
    }
}

/// What a completion completed (`enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcOpcode(pub u32);

impl WcOpcode {
    /// A SEND (with or without immediate data) we posted.
    pub const SEND: Self = Self(0);
    /// An RDMA_WRITE (with or without immediate data) we posted.
    pub const RDMA_WRITE: Self = Self(1);
    /// An RDMA_READ we posted.
    pub const RDMA_READ: Self = Self(2);
    /// A receive consumed by a peer's SEND.
    pub const RECV: Self = Self(1 << 7);
    /// A receive consumed by a peer's RDMA_WRITE with immediate data.
    pub const RECV_RDMA_WITH_IMM: Self = Self((1 << 7) + 1);

    /// True for completions of receive requests.
    pub fn is_recv(self) -> bool {
        self.0 & Self::RECV.0 != 0
    }
}

/// One work completion, laid out as `struct ibv_wc` so that polling writes
/// straight into the caller's array.
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkCompletion(ibv_wc);

impl WorkCompletion {
    /// The `wr_id` given when the request was posted.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// Completion status; only `wr_id`, `status`, `qp_num` and `vendor_err`
    /// are meaningful when it is not success.
    pub fn status(&self) -> WcStatus {
        WcStatus(self.0.status)
    }

    /// True when the request succeeded.
    pub fn is_success(&self) -> bool {
        self.status().is_success()
    }

    /// What completed.
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode(self.0.opcode)
    }

    /// Bytes received (receive completions) or transferred (RDMA_READ).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// Immediate data, host order, on a receive completion whose sender
    /// attached some. `None` on send-side completions: rxe sets the
    /// WITH_IMM flag there too (with imm 0), which means nothing.
    pub fn imm_data(&self) -> Option<u32> {
        let with_imm = self.0.wc_flags & ffi::IBV_WC_WITH_IMM != 0;
        (with_imm && self.opcode().is_recv()).then(|| u32::from_be(self.0.imm_data))
    }

    /// Number of the local QP the request belonged to.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// Number of the remote QP (receive completions).
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }

    /// The provider's error code for failed completions.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
}

impl std::fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("imm_data", &self.imm_data())
            .field("qp_num", &self.qp_num())
            .field("src_qp", &self.src_qp())
            .finish()
    }
}

/// A completion queue. Clone to share; destroyed after the last clone and
/// the last QP using it are gone.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    cq: NonNull<ibv_cq>,
    depth: u32,
    context: Context,
    _channel: Option<CompletionChannel>,
}

// SAFETY: rdma-core providers lock a CQ in poll_cq/req_notify_cq unless it
// was created with IBV_CREATE_CQ_ATTR_SINGLE_THREADED (ibv_create_cq_ex),
// which this crate never uses; so polling from several threads is safe,
// though one poller per CQ is what performs.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        let sym = &self.context.inner.verbs.sym;
        // A failure here is not actionable (the device may be gone), and
        // a destructor must not panic: the result is ignored.
        // SAFETY: created by ibv_create_cq, destroyed once; QPs using it hold
        // a clone, so none remains. ibv_destroy_cq waits for unacknowledged
        // channel events, and CompletionChannel::wait acknowledges each.
        let _ = unsafe { (sym.ibv_destroy_cq)(self.cq.as_ptr()) };
    }
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("depth", &self.inner.depth)
            .finish_non_exhaustive()
    }
}

impl CompletionQueue {
    /// Creates a completion queue of at least `depth` entries, polled only.
    ///
    /// Fails with `InvalidArgument` for 0 or a depth above the device's
    /// `max_cqe`, and with `ibv_create_cq` and its errno otherwise.
    pub fn new(context: &Context, depth: u32) -> Result<Self, VerbsError> {
        Self::create(context, depth, None, 0, 0)
    }

    /// Creates a completion queue that reports to `channel` after
    /// [`CompletionQueue::req_notify`]; `token` is what
    /// [`CompletionChannel::wait`] returns for it, `comp_vector` picks the
    /// interrupt vector (below the context's `num_comp_vectors`).
    ///
    /// Fails as [`CompletionQueue::new`] does.
    pub fn with_channel(
        context: &Context,
        depth: u32,
        channel: &CompletionChannel,
        token: usize,
        comp_vector: u32,
    ) -> Result<Self, VerbsError> {
        Self::create(context, depth, Some(channel.clone()), token, comp_vector)
    }

    fn create(
        context: &Context,
        depth: u32,
        channel: Option<CompletionChannel>,
        token: usize,
        comp_vector: u32,
    ) -> Result<Self, VerbsError> {
        let max = context.attr().max_cqe;
        if depth == 0 || depth > max {
            return Err(VerbsError::InvalidArgument(format!(
                "completion queue depth {depth} outside 1..={max}"
            )));
        }
        let comp_vector = i32::try_from(comp_vector)
            .map_err(|_| VerbsError::InvalidArgument(format!("comp_vector {comp_vector}")))?;
        let chan = channel
            .as_ref()
            .map_or(std::ptr::null_mut(), |c| c.inner.ch.as_ptr());
        // SAFETY: live context; `chan` is null or a live channel of it that
        // this CQ keeps alive; depth fits c_int because max_cqe came from one.
        let raw = unsafe {
            (context.inner.verbs.sym.ibv_create_cq)(
                context.raw(),
                depth as i32,
                token as *mut c_void,
                chan,
                comp_vector,
            )
        };
        let cq = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_create_cq"))?;
        // SAFETY: a created CQ is initialised; `cqe` is the granted depth.
        let granted = unsafe { (*raw).cqe };
        Ok(Self {
            inner: Arc::new(CqInner {
                cq,
                depth: u32::try_from(granted).unwrap_or(depth),
                context: context.clone(),
                _channel: channel,
            }),
        })
    }

    /// The depth the provider granted (at least the one asked for).
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// The context the queue belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.context
    }

    /// Polls up to `out.len()` completions into `out` and returns how many
    /// were written (0 when none is ready). Never blocks, never allocates.
    ///
    /// Fails with `ibv_poll_cq` when the provider reports an error (a CQ
    /// overrun or a dead device).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        if out.is_empty() {
            return Ok(0);
        }
        let n = i32::try_from(out.len()).unwrap_or(i32::MAX);
        let cq = self.inner.cq.as_ptr();
        // SAFETY: `cq` is live for `self`'s lifetime; its context pointer is
        // set by the library and outlives it. poll_cq is the static inline
        // ibv_poll_cq of verbs.h: cq->context->ops.poll_cq. WorkCompletion
        // is repr(transparent) over ibv_wc and `out` has room for `n`.
        let ret = unsafe {
            match (*(*cq).context).ops.poll_cq {
                Some(poll) => poll(cq, n, out.as_mut_ptr().cast::<ibv_wc>()),
                None => -libc::ENOSYS,
            }
        };
        // A negative return is an error; a positive one never exceeds `n`.
        usize::try_from(ret).map_err(|_| VerbsError::verb("ibv_poll_cq", ret.saturating_neg()))
    }

    /// Arms the queue to signal its channel on the next completion (or the
    /// next solicited one). Re-arm after each [`CompletionChannel::wait`],
    /// then poll again to catch completions that raced the arming.
    ///
    /// Fails with `ibv_req_notify_cq` and its errno.
    pub fn req_notify(&self, solicited_only: bool) -> Result<(), VerbsError> {
        let cq = self.inner.cq.as_ptr();
        // SAFETY: as in `poll`; this is verbs.h's inline ibv_req_notify_cq.
        let ret = unsafe {
            match (*(*cq).context).ops.req_notify_cq {
                Some(notify) => notify(cq, i32::from(solicited_only)),
                None => libc::ENOSYS,
            }
        };
        VerbsError::check("ibv_req_notify_cq", ret)
    }

    /// libibverbs' text for a completion's status.
    pub fn status_str(&self, wc: &WorkCompletion) -> &'static str {
        self.inner.context.verbs().wc_status_str(wc.status())
    }

    /// `Ok` for a successful completion, else a [`VerbsError::Completion`]
    /// carrying its wr_id, status and the library's text for it.
    pub fn check(&self, wc: &WorkCompletion) -> Result<(), VerbsError> {
        if wc.is_success() {
            return Ok(());
        }
        Err(VerbsError::Completion {
            wr_id: wc.wr_id(),
            status: wc.status().0,
            status_str: self.status_str(wc),
            vendor_err: wc.vendor_err(),
        })
    }

    pub(crate) fn raw(&self) -> *mut ibv_cq {
        self.inner.cq.as_ptr()
    }
}

/// A completion channel: a file descriptor that becomes readable when an
/// armed completion queue gets a completion, for sleeping instead of
/// spinning. Clone to share.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

struct ChannelInner {
    ch: NonNull<ibv_comp_channel>,
    context: Context,
}

// SAFETY: the channel is a file descriptor wrapper; ibv_get_cq_event is a
// blocking read on it, safe from any thread; Drop runs once, after every CQ
// using it (each holds a clone).
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        let sym = &self.context.inner.verbs.sym;
        // A failure here is not actionable (the device may be gone), and
        // a destructor must not panic: the result is ignored.
        // SAFETY: created by ibv_create_comp_channel, destroyed once, no CQ
        // left on it.
        let _ = unsafe { (sym.ibv_destroy_comp_channel)(self.ch.as_ptr()) };
    }
}

impl CompletionChannel {
    /// Creates a completion channel on `context`.
    ///
    /// Fails with `ibv_create_comp_channel` and its errno.
    pub fn new(context: &Context) -> Result<Self, VerbsError> {
        // SAFETY: live context.
        let raw = unsafe { (context.inner.verbs.sym.ibv_create_comp_channel)(context.raw()) };
        let ch = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_create_comp_channel"))?;
        Ok(Self {
            inner: Arc::new(ChannelInner {
                ch,
                context: context.clone(),
            }),
        })
    }

    /// The file descriptor to poll/epoll for readability. Set it
    /// non-blocking to make [`CompletionChannel::wait`] return EAGAIN
    /// instead of sleeping.
    pub fn fd(&self) -> RawFd {
        // SAFETY: live channel; `fd` is set at creation and never changes.
        unsafe { (*self.inner.ch.as_ptr()).fd }
    }

    /// Sleeps until an armed CQ on this channel signals, acknowledges the
    /// event and returns that CQ's token. The CQ must be re-armed with
    /// [`CompletionQueue::req_notify`] to signal again.
    ///
    /// Fails with `ibv_get_cq_event` and its errno (EAGAIN on a
    /// non-blocking fd with nothing pending).
    pub fn wait(&self) -> Result<usize, VerbsError> {
        let sym = &self.inner.context.inner.verbs.sym;
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut token: *mut c_void = std::ptr::null_mut();
        // SAFETY: live channel; out-pointers are valid.
        let ret = unsafe { (sym.ibv_get_cq_event)(self.inner.ch.as_ptr(), &mut cq, &mut token) };
        if ret != 0 || cq.is_null() {
            return Err(VerbsError::last_os("ibv_get_cq_event"));
        }
        // SAFETY: `cq` was just returned with an event; ibv_destroy_cq waits
        // for this acknowledgement, so the CQ is still alive here.
        unsafe { (sym.ibv_ack_cq_events)(cq, 1) };
        Ok(token as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imm_data_only_on_receives_with_flag_in_host_order() {
        let mut wc = ibv_wc {
            imm_data: 0x1234_5678u32.to_be(),
            ..Default::default()
        };
        wc.opcode = WcOpcode::RECV.0;
        assert_eq!(WorkCompletion(wc).imm_data(), None);
        wc.wc_flags = ffi::IBV_WC_WITH_IMM;
        assert_eq!(WorkCompletion(wc).imm_data(), Some(0x1234_5678));
        wc.opcode = WcOpcode::RDMA_WRITE.0;
        assert_eq!(WorkCompletion(wc).imm_data(), None);
    }

    #[test]
    fn recv_opcodes() {
        assert!(WcOpcode::RECV.is_recv());
        assert!(WcOpcode::RECV_RDMA_WITH_IMM.is_recv());
        assert!(!WcOpcode::RDMA_READ.is_recv());
        assert!(!WcOpcode::SEND.is_recv());
    }

    #[test]
    fn completion_is_an_ibv_wc() {
        assert_eq!(std::mem::size_of::<WorkCompletion>(), 48);
        assert_eq!(std::mem::align_of::<WorkCompletion>(), 8);
    }
}
