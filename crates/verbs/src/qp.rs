//! Reliable-connected queue pairs (`ibv_qp`, IBV_QPT_RC): creation, the
//! RESET → INIT → RTR → RTS state walk, and posting.

use crate::context::ProtectionDomain;
use crate::cq::CompletionQueue;
use crate::device::mtu_code;
use crate::ffi::{self, ibv_qp, ibv_recv_wr, ibv_send_wr};
use crate::mr::Access;
use crate::post::{RecvBatch, SendBatch};
use crate::srq::SharedReceiveQueue;
use crate::{PostError, VerbsError};
use std::ffi::c_int;
use std::ptr::NonNull;

/// Queue sizes of a QP: asked for by [`QueuePair::new_rc`], and as granted
/// by the provider (often rounded up) from [`QueuePair::caps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCaps {
    /// Outstanding send-queue requests.
    pub max_send_wr: u32,
    /// Outstanding receive-queue requests (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request (ignored with an SRQ).
    pub max_recv_sge: u32,
    /// Largest payload a SendFlags::INLINE request may carry.
    pub max_inline_data: u32,
}

/// What the peer tells us about its QP, exchanged out of band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteQp {
    /// The peer QP's number.
    pub qp_num: u32,
    /// The first packet sequence number the peer sends with (24 bits).
    pub psn: u32,
    /// The peer port's GID (RoCE; on InfiniBand all zero means route by LID).
    pub gid: [u8; 16],
    /// The peer port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
}

/// Path settings for [`QueuePair::to_rtr_with`] beyond the essentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathOptions {
    /// RDMA READs the peer may have outstanding against us (clamped to the
    /// device's `max_qp_rd_atom`).
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code (12 = 0.64 ms) the peer waits before retrying a
    /// SEND that found no receive posted.
    pub min_rnr_timer: u8,
    /// IP TTL / hop limit of routed (RoCE v2, GRH) packets.
    pub hop_limit: u8,
    /// Traffic class (DSCP << 2 on RoCE v2): selects the switch priority.
    pub traffic_class: u8,
    /// Service level (InfiniBand virtual lane / RoCE PCP).
    pub service_level: u8,
    /// IPv6 flow label of routed packets.
    pub flow_label: u32,
}

impl Default for PathOptions {
    fn default() -> Self {
        Self {
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            hop_limit: 64,
            traffic_class: 0,
            service_level: 0,
            flow_label: 0,
        }
    }
}

/// A QP's state (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Just created, or reset.
    Reset,
    /// Receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error (UD/UC only).
    Sqe,
    /// Error: outstanding requests are flushed with WR_FLUSH_ERR.
    Error,
    /// A value this crate does not know.
    Unknown(u32),
}

impl QpState {
    fn from_code(code: u32) -> Self {
        match code {
            ffi::IBV_QPS_RESET => Self::Reset,
            ffi::IBV_QPS_INIT => Self::Init,
            ffi::IBV_QPS_RTR => Self::Rtr,
            ffi::IBV_QPS_RTS => Self::Rts,
            ffi::IBV_QPS_SQD => Self::Sqd,
            ffi::IBV_QPS_SQE => Self::Sqe,
            ffi::IBV_QPS_ERR => Self::Error,
            other => Self::Unknown(other),
        }
    }
}

/// Largest packet sequence number: PSNs are 24 bits.
pub const MAX_PSN: u32 = 0xff_ffff;

/// A reliable-connected queue pair, destroyed on drop (before the CQs, SRQ
/// and PD it holds clones of).
pub struct QueuePair {
    qp: NonNull<ibv_qp>,
    qp_num: u32,
    caps: QpCaps,
    has_srq: bool,
    pd: ProtectionDomain,
    _send_cq: CompletionQueue,
    _recv_cq: CompletionQueue,
    _srq: Option<SharedReceiveQueue>,
}

// SAFETY: rdma-core providers serialise posting to a QP with a per-queue
// lock (the send and receive queues each have their own), unless the QP
// was created in a thread domain (ibv_create_qp_ex with a parent domain),
// which this crate never does. So `post_send`/`post_recv` may run from
// several threads at once; modify/query go through the kernel. Drop runs
// once, when the owner lets go.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // A failure here is not actionable (the device may be gone), and
        // a destructor must not panic: the result is ignored.
        // SAFETY: created by ibv_create_qp, destroyed once; the CQs, SRQ and
        // PD it uses are still alive (our fields drop after this).
        let _ = unsafe { (self.pd.verbs().sym.ibv_destroy_qp)(self.qp.as_ptr()) };
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num)
            .field("caps", &self.caps)
            .field("srq", &self.has_srq)
            .finish_non_exhaustive()
    }
}

impl QueuePair {
    /// Creates an RC queue pair in RESET state. With `srq`, receives come
    /// from it and the receive sizes in `caps` are ignored. Every request
    /// is signalled only if its flags say so.
    ///
    /// Fails with `InvalidArgument` when a CQ or the SRQ belongs to another
    /// device, or `max_send_wr` exceeds the device's `max_qp_wr`; with
    /// `ibv_create_qp` and its errno otherwise (EINVAL: sizes the provider
    /// cannot grant, e.g. too much inline data).
    pub fn new_rc(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<Self, VerbsError> {
        let ctx = pd.context().raw();
        let foreign = send_cq.context().raw() != ctx
            || recv_cq.context().raw() != ctx
            || srq.is_some_and(|s| s.pd().context().raw() != ctx);
        if foreign {
            return Err(VerbsError::InvalidArgument(
                "completion queues and SRQ must be on the QP's device".into(),
            ));
        }
        let max_wr = pd.context().attr().max_qp_wr;
        if caps.max_send_wr > max_wr || caps.max_recv_wr > max_wr {
            return Err(VerbsError::InvalidArgument(format!(
                "QP depth {}/{} above the device's max_qp_wr {max_wr}",
                caps.max_send_wr, caps.max_recv_wr
            )));
        }
        let (max_recv_wr, max_recv_sge) = match srq {
            Some(_) => (0, 0),
            None => (caps.max_recv_wr, caps.max_recv_sge),
        };
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: send_cq.raw(),
            recv_cq: recv_cq.raw(),
            srq: srq.map_or(std::ptr::null_mut(), |s| s.raw()),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ffi::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: live PD, CQs and SRQ of one context (checked above);
        // `init` is a complete ibv_qp_init_attr, updated in place with the
        // granted capabilities.
        let raw = unsafe { (pd.verbs().sym.ibv_create_qp)(pd.raw(), &mut init) };
        let qp = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_create_qp"))?;
        // SAFETY: a created QP is initialised; qp_num never changes.
        let qp_num = unsafe { (*raw).qp_num };
        let c = init.cap;
        Ok(Self {
            qp,
            qp_num,
            caps: QpCaps {
                max_send_wr: c.max_send_wr,
                max_recv_wr: c.max_recv_wr,
                max_send_sge: c.max_send_sge,
                max_recv_sge: c.max_recv_sge,
                max_inline_data: c.max_inline_data,
            },
            has_srq: srq.is_some(),
            pd: pd.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            _srq: srq.cloned(),
        })
    }

    /// The QP number, to tell the peer.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The capabilities the provider granted (at least those asked for).
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The protection domain of the QP.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    fn modify(
        &self,
        step: &str,
        attr: &mut ffi::ibv_qp_attr,
        mask: c_int,
    ) -> Result<(), VerbsError> {
        // SAFETY: live QP; `attr` is a complete ibv_qp_attr whose fields
        // named in `mask` are set.
        let ret = unsafe { (self.pd.verbs().sym.ibv_modify_qp)(self.qp.as_ptr(), attr, mask) };
        VerbsError::check(&format!("ibv_modify_qp({step})"), ret)
    }

    /// RESET → INIT on `port` (1-based), letting peers do what `access`
    /// allows (REMOTE_WRITE, REMOTE_READ, ...).
    ///
    /// Fails with `ibv_modify_qp(INIT)` and its errno.
    pub fn to_init(&self, port: u8, access: Access) -> Result<(), VerbsError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: access.bits(),
            ..Default::default()
        };
        let mask = ffi::IBV_QP_STATE
            | ffi::IBV_QP_PKEY_INDEX
            | ffi::IBV_QP_PORT
            | ffi::IBV_QP_ACCESS_FLAGS;
        self.modify("INIT", &mut attr, mask)
    }

    /// INIT → RTR: connects to `remote` over `port`, with packets of
    /// `path_mtu_bytes` (256..4096, at most both ports' active MTU) sent
    /// from our GID at `sgid_index`. Default [`PathOptions`].
    ///
    /// Fails as [`QueuePair::to_rtr_with`] does.
    pub fn to_rtr(
        &self,
        remote: &RemoteQp,
        path_mtu_bytes: u32,
        sgid_index: u8,
        port: u8,
    ) -> Result<(), VerbsError> {
        self.to_rtr_with(
            remote,
            path_mtu_bytes,
            sgid_index,
            port,
            &PathOptions::default(),
        )
    }

    /// INIT → RTR with explicit path options. A non-zero `remote.gid` makes
    /// the path global (GRH), which RoCE requires; a zero GID routes by LID.
    ///
    /// Fails with `InvalidArgument` for an MTU that is not a power of two in
    /// 256..=4096 or a PSN above 24 bits, and with `ibv_modify_qp(RTR)` and
    /// its errno (e.g. ENETUNREACH / EINVAL for a GID the port cannot reach).
    pub fn to_rtr_with(
        &self,
        remote: &RemoteQp,
        path_mtu_bytes: u32,
        sgid_index: u8,
        port: u8,
        opts: &PathOptions,
    ) -> Result<(), VerbsError> {
        let path_mtu = mtu_code(path_mtu_bytes).ok_or_else(|| {
            VerbsError::InvalidArgument(format!(
                "path MTU {path_mtu_bytes} is not 256, 512, 1024, 2048 or 4096"
            ))
        })?;
        check_psn(remote.psn)?;
        let dev_rd = self.pd.context().attr().max_qp_rd_atom;
        let is_global = remote.gid != [0; 16];
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RTR,
            path_mtu,
            dest_qp_num: remote.qp_num,
            rq_psn: remote.psn,
            max_dest_rd_atomic: clamp_rd_atomic(opts.max_dest_rd_atomic, dev_rd),
            min_rnr_timer: opts.min_rnr_timer,
            ah_attr: ffi::ibv_ah_attr {
                grh: ffi::ibv_global_route {
                    dgid: ffi::ibv_gid::new(remote.gid),
                    flow_label: opts.flow_label,
                    sgid_index,
                    hop_limit: opts.hop_limit,
                    traffic_class: opts.traffic_class,
                },
                dlid: remote.lid,
                sl: opts.service_level,
                src_path_bits: 0,
                static_rate: 0,
                is_global: u8::from(is_global),
                port_num: port,
            },
            ..Default::default()
        };
        let mask = ffi::IBV_QP_STATE
            | ffi::IBV_QP_AV
            | ffi::IBV_QP_PATH_MTU
            | ffi::IBV_QP_DEST_QPN
            | ffi::IBV_QP_RQ_PSN
            | ffi::IBV_QP_MAX_DEST_RD_ATOMIC
            | ffi::IBV_QP_MIN_RNR_TIMER;
        self.modify("RTR", &mut attr, mask)
    }

    /// RTR → RTS: starts sending at `psn` (24 bits; the peer's `rq_psn`).
    /// `timeout` is the ACK timeout code (4.096 µs × 2^timeout, 1..=31; 14
    /// ≈ 67 ms), `retry_cnt` and `rnr_retry` (0..=7; 7 = retry forever on
    /// RNR) bound retransmissions, `max_rd_atomic` our outstanding RDMA
    /// READs (clamped to the device's `max_qp_init_rd_atom`).
    ///
    /// Fails with `InvalidArgument` for out-of-range fields and with
    /// `ibv_modify_qp(RTS)` and its errno.
    pub fn to_rts(
        &self,
        psn: u32,
        timeout: u8,
        retry_cnt: u8,
        rnr_retry: u8,
        max_rd_atomic: u8,
    ) -> Result<(), VerbsError> {
        check_psn(psn)?;
        if timeout > 31 || retry_cnt > 7 || rnr_retry > 7 {
            return Err(VerbsError::InvalidArgument(format!(
                "timeout {timeout} (max 31), retry_cnt {retry_cnt} / rnr_retry {rnr_retry} (max 7)"
            )));
        }
        let dev_rd = self.pd.context().attr().max_qp_init_rd_atom;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RTS,
            sq_psn: psn,
            timeout,
            retry_cnt,
            rnr_retry,
            max_rd_atomic: clamp_rd_atomic(max_rd_atomic, dev_rd),
            ..Default::default()
        };
        let mask = ffi::IBV_QP_STATE
            | ffi::IBV_QP_SQ_PSN
            | ffi::IBV_QP_TIMEOUT
            | ffi::IBV_QP_RETRY_CNT
            | ffi::IBV_QP_RNR_RETRY
            | ffi::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify("RTS", &mut attr, mask)
    }

    /// Any state → ERROR: outstanding and later requests complete with
    /// WR_FLUSH_ERR, which is how a connection is drained before teardown.
    ///
    /// Fails with `ibv_modify_qp(ERR)` and its errno.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify("ERR", &mut attr, ffi::IBV_QP_STATE)
    }

    /// Any state → RESET, to reconnect the QP from scratch (its queues are
    /// emptied without completions).
    ///
    /// Fails with `ibv_modify_qp(RESET)` and its errno.
    pub fn to_reset(&self) -> Result<(), VerbsError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RESET,
            ..Default::default()
        };
        self.modify("RESET", &mut attr, ffi::IBV_QP_STATE)
    }

    /// The QP's current state, asked of the provider (`ibv_query_qp`).
    ///
    /// Fails with `ibv_query_qp` and its errno.
    pub fn state(&self) -> Result<QpState, VerbsError> {
        let mut attr = ffi::ibv_qp_attr::default();
        // SAFETY: zero is a valid bit pattern for this plain-data struct.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP; both out-structs are complete.
        let ret = unsafe {
            (self.pd.verbs().sym.ibv_query_qp)(
                self.qp.as_ptr(),
                &mut attr,
                ffi::IBV_QP_STATE,
                &mut init,
            )
        };
        VerbsError::check("ibv_query_qp", ret)?;
        Ok(QpState::from_code(attr.qp_state))
    }

    /// Posts the whole chain in `batch` with one `ibv_post_send` call (one
    /// doorbell). The batch is left as it is, to be cleared or posted again.
    ///
    /// On failure the requests before [`PostError::index_of_bad_wr`] were
    /// posted and will complete; that one and the rest were not (ENOMEM:
    /// send queue full; EINVAL: a malformed request, too much inline data,
    /// or a QP not in RTS).
    ///
    /// # Safety
    /// Every scatter/gather entry must lie in memory registered under its
    /// lkey, readable for the whole request's life (INLINE payloads are read
    /// by the CPU during this call instead). Bytes an RDMA_READ writes must
    /// not be accessed through Rust references until its completion, or a
    /// later signalled one on this QP, has been polled.
    pub unsafe fn post_send(&self, batch: &mut SendBatch) -> Result<(), PostError> {
        let head = batch.head();
        if head.is_null() {
            return Ok(());
        }
        let qp = self.qp.as_ptr();
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `qp` is live for `self`'s lifetime and its context
        // pointer outlives it; this is verbs.h's inline ibv_post_send
        // (qp->context->ops.post_send). The chain is well-formed (built by
        // SendBatch) and the memory it names is the caller's contract.
        let ret = unsafe {
            match (*(*qp).context).ops.post_send {
                Some(post) => post(qp, head, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if ret == 0 {
            return Ok(());
        }
        Err(PostError {
            verb: "ibv_post_send",
            index_of_bad_wr: batch.index_of(bad),
            errno: ret.checked_abs().unwrap_or(libc::EIO),
        })
    }

    /// Posts every receive in `batch` to this QP's own receive queue with
    /// one `ibv_post_recv` call. A QP attached to an SRQ has none: post to
    /// the SRQ instead (this fails with EINVAL at index 0).
    ///
    /// On failure the receives before `index_of_bad_wr` were posted.
    ///
    /// # Safety
    /// As [`SharedReceiveQueue::post_recv`]: entries in memory registered
    /// with LOCAL_WRITE under their lkey, untouched through Rust references
    /// until each receive's completion has been polled.
    pub unsafe fn post_recv(&self, batch: &mut RecvBatch) -> Result<(), PostError> {
        if self.has_srq && !batch.is_empty() {
            return Err(PostError {
                verb: "ibv_post_recv",
                index_of_bad_wr: 0,
                errno: libc::EINVAL,
            });
        }
        let head = batch.head();
        if head.is_null() {
            return Ok(());
        }
        let qp = self.qp.as_ptr();
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: as in `post_send`; verbs.h's inline ibv_post_recv.
        let ret = unsafe {
            match (*(*qp).context).ops.post_recv {
                Some(post) => post(qp, head, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if ret == 0 {
            return Ok(());
        }
        Err(PostError {
            verb: "ibv_post_recv",
            index_of_bad_wr: batch.index_of(bad),
            errno: ret.checked_abs().unwrap_or(libc::EIO),
        })
    }
}

fn check_psn(psn: u32) -> Result<(), VerbsError> {
    if psn > MAX_PSN {
        return Err(VerbsError::InvalidArgument(format!(
            "PSN {psn:#x} exceeds 24 bits"
        )));
    }
    Ok(())
}

/// `want` limited to the device's limit, and at least 1 so READs can flow.
fn clamp_rd_atomic(want: u8, device_max: u32) -> u8 {
    let max = u8::try_from(device_max).unwrap_or(u8::MAX);
    want.min(max).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rd_atomic_is_clamped() {
        assert_eq!(clamp_rd_atomic(16, 128), 16);
        assert_eq!(clamp_rd_atomic(16, 4), 4);
        assert_eq!(clamp_rd_atomic(0, 4), 1);
        assert_eq!(clamp_rd_atomic(200, 1000), 200);
    }

    #[test]
    fn psn_is_24_bits() {
        assert!(check_psn(MAX_PSN).is_ok());
        assert!(check_psn(MAX_PSN + 1).is_err());
    }

    #[test]
    fn qp_states_decode() {
        assert_eq!(QpState::from_code(3), QpState::Rts);
        assert_eq!(QpState::from_code(6), QpState::Error);
        assert_eq!(QpState::from_code(9), QpState::Unknown(9));
    }
}
