//! Reusable chains of work requests, so that the hot path allocates nothing
//! and one post (one doorbell) carries a whole batch.
//!
//! A batch owns two heap arrays, work requests and scatter/gather entries,
//! allocated once. `push` fills the next request and links the previous
//! one's `next` to it; posting hands the provider the head of the chain.
//! Pointers only ever point into the batch's own arrays, which never move
//! (moving the batch moves the boxes, not their contents).

use crate::ffi::{self, ibv_recv_wr, ibv_send_wr, ibv_sge};
use crate::VerbsError;

/// A scatter/gather entry: `length` bytes at `addr`, inside a memory region
/// registered with local key `lkey` (see [`crate::MemoryRegion::sge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Start address (a virtual address of this process).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region holding the range.
    pub lkey: u32,
}

/// The operation of a send-queue work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Write the local sges to `remote_addr` in the peer's region `rkey`.
    RdmaWrite {
        /// Peer virtual address.
        remote_addr: u64,
        /// Peer region's remote key.
        rkey: u32,
    },
    /// As `RdmaWrite`, then consume a receive at the peer carrying `imm`.
    RdmaWriteImm {
        /// Peer virtual address.
        remote_addr: u64,
        /// Peer region's remote key.
        rkey: u32,
        /// Immediate data, host order (sent big-endian).
        imm: u32,
    },
    /// Read from `remote_addr` in the peer's region `rkey` into the sges.
    RdmaRead {
        /// Peer virtual address.
        remote_addr: u64,
        /// Peer region's remote key.
        rkey: u32,
    },
    /// Send the sges into the peer's next receive.
    Send,
    /// As `Send`, with immediate data (host order) in the completion.
    SendImm {
        /// Immediate data.
        imm: u32,
    },
}

bitflags::bitflags! {
    /// Flags of a send work request (`ibv_send_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Wait for earlier RDMA_READs on this QP before starting.
        const FENCE = 1;
        /// Produce a completion (unsignalled requests complete silently once
        /// a later signalled one does; signal at least every send-queue depth).
        const SIGNALED = 1 << 1;
        /// Make the peer's receive completion solicited.
        const SOLICITED = 1 << 2;
        /// Copy the payload into the request at post time (up to the QP's
        /// max_inline_data); the buffer needs no registration.
        const INLINE = 1 << 3;
    }
}

/// Checks capacity and copies `sges` into `store` from `used`, returning the
/// start of the copied entries (or null for none).
fn stage_sges(
    store: &mut [ibv_sge],
    used: &mut usize,
    sges: &[Sge],
    full: impl FnOnce() -> VerbsError,
) -> Result<*mut ibv_sge, VerbsError> {
    if sges.len() > store.len() - *used {
        return Err(full());
    }
    if sges.is_empty() {
        return Ok(std::ptr::null_mut());
    }
    let dst = &mut store[*used..*used + sges.len()];
    for (d, s) in dst.iter_mut().zip(sges) {
        *d = ibv_sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        };
    }
    *used += sges.len();
    Ok(dst.as_mut_ptr())
}

/// A work request of either queue, as the chain below needs it.
trait WorkRequest {
    fn zeroed() -> Self;
    fn wr_id(&self) -> u64;
    fn set_next(&mut self, next: *mut Self);
}

impl WorkRequest for ibv_send_wr {
    fn zeroed() -> Self {
        ibv_send_wr::zeroed()
    }
    fn wr_id(&self) -> u64 {
        self.wr_id
    }
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
}

impl WorkRequest for ibv_recv_wr {
    fn zeroed() -> Self {
        ibv_recv_wr::zeroed()
    }
    fn wr_id(&self) -> u64 {
        self.wr_id
    }
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
}

/// The part [`SendBatch`] and [`RecvBatch`] share: requests linked in push order and the
/// scatter/gather entries they point at, in two arrays allocated once.
struct Chain<W> {
    wrs: Box<[W]>,
    sges: Box<[ibv_sge]>,
    len: usize,
    used_sges: usize,
}

// SAFETY: the raw pointers inside point only into the chain's own boxes, so
// sending the chain to another thread moves them together; `&Chain` allows
// no mutation.
unsafe impl<W> Send for Chain<W> {}
// SAFETY: as above.
unsafe impl<W> Sync for Chain<W> {}

impl<W: WorkRequest> Chain<W> {
    fn with_sges(max_wrs: usize, max_sges: usize) -> Self {
        Self {
            wrs: (0..max_wrs).map(|_| W::zeroed()).collect(),
            sges: vec![ibv_sge::default(); max_sges].into_boxed_slice(),
            len: 0,
            used_sges: 0,
        }
    }

    /// Appends a request made by `make` from its staged sg_list and entry count. Fails with
    /// [`VerbsError::BatchFull`] when no request or not enough entries are left, leaving the
    /// chain unchanged.
    fn push(
        &mut self,
        sges: &[Sge],
        make: impl FnOnce(*mut ibv_sge, i32) -> W,
    ) -> Result<(), VerbsError> {
        let full = VerbsError::BatchFull {
            wrs: self.wrs.len(),
            sges: self.sges.len(),
        };
        if self.len == self.wrs.len() {
            return Err(full);
        }
        let sg_list = stage_sges(&mut self.sges, &mut self.used_sges, sges, || full)?;
        // Fits: bounded by the sge array, which the caller sized.
        let num_sge = i32::try_from(sges.len()).unwrap_or(i32::MAX);
        let wr = &mut self.wrs[self.len];
        *wr = make(sg_list, num_sge);
        let this: *mut W = wr;
        if self.len > 0 {
            self.wrs[self.len - 1].set_next(this);
        }
        self.len += 1;
        Ok(())
    }

    fn clear(&mut self) {
        self.len = 0;
        self.used_sges = 0;
    }

    fn wr_id(&self, index: usize) -> Option<u64> {
        self.wrs[..self.len].get(index).map(|w| w.wr_id())
    }

    /// Head of the chain, with the last request's `next` cut (it may still
    /// point at a request from before a `clear`). Null when empty.
    fn head(&mut self) -> *mut W {
        match self.len.checked_sub(1) {
            None => std::ptr::null_mut(),
            Some(last) => {
                self.wrs[last].set_next(std::ptr::null_mut());
                self.wrs.as_mut_ptr()
            }
        }
    }

    fn index_of(&self, bad: *const W) -> usize {
        index_in(&self.wrs[..self.len], bad)
    }

    fn debug(&self, name: &str, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(name)
            .field("len", &self.len)
            .field("capacity", &self.wrs.len())
            .field("sges", &self.used_sges)
            .finish()
    }
}

/// A reusable chain of send work requests for
/// [`crate::QueuePair::post_send`].
pub struct SendBatch {
    chain: Chain<ibv_send_wr>,
}

impl std::fmt::Debug for SendBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.chain.debug("SendBatch", f)
    }
}

impl SendBatch {
    /// A batch of up to `max_wrs` requests with one scatter/gather entry
    /// each on average.
    pub fn new(max_wrs: usize) -> Self {
        Self::with_sges(max_wrs, max_wrs)
    }

    /// A batch of up to `max_wrs` requests sharing `max_sges` entries.
    pub fn with_sges(max_wrs: usize, max_sges: usize) -> Self {
        Self {
            chain: Chain::with_sges(max_wrs, max_sges),
        }
    }

    /// Appends a request. Allocates nothing.
    ///
    /// Fails with [`VerbsError::BatchFull`] when no request or not enough
    /// scatter/gather entries are left; the batch is then unchanged.
    pub fn push(
        &mut self,
        wr_id: u64,
        op: SendOp,
        flags: SendFlags,
        sges: &[Sge],
    ) -> Result<(), VerbsError> {
        let (opcode, imm, remote) = match op {
            SendOp::RdmaWrite { remote_addr, rkey } => {
                (ffi::IBV_WR_RDMA_WRITE, 0, Some((remote_addr, rkey)))
            }
            SendOp::RdmaWriteImm {
                remote_addr,
                rkey,
                imm,
            } => (
                ffi::IBV_WR_RDMA_WRITE_WITH_IMM,
                imm,
                Some((remote_addr, rkey)),
            ),
            SendOp::RdmaRead { remote_addr, rkey } => {
                (ffi::IBV_WR_RDMA_READ, 0, Some((remote_addr, rkey)))
            }
            SendOp::Send => (ffi::IBV_WR_SEND, 0, None),
            SendOp::SendImm { imm } => (ffi::IBV_WR_SEND_WITH_IMM, imm, None),
        };
        let (remote_addr, rkey) = remote.unwrap_or((0, 0));
        self.chain.push(sges, |sg_list, num_sge| {
            let mut wr = ibv_send_wr::zeroed();
            wr.wr_id = wr_id;
            wr.sg_list = sg_list;
            wr.num_sge = num_sge;
            wr.opcode = opcode;
            wr.send_flags = flags.bits();
            wr.imm_data = imm.to_be();
            wr.wr.rdma = ffi::ibv_send_wr_rdma { remote_addr, rkey };
            wr
        })
    }

    /// Adds SIGNALED to the last request, so that a chain of unsignalled
    /// requests ends in one completion. No-op on an empty batch.
    pub fn signal_last(&mut self) {
        if let Some(last) = self.chain.len.checked_sub(1) {
            self.chain.wrs[last].send_flags |= SendFlags::SIGNALED.bits();
        }
    }

    /// Empties the batch for reuse, keeping its arrays.
    pub fn clear(&mut self) {
        self.chain.clear();
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.chain.len
    }

    /// True when no request has been pushed since the last clear.
    pub fn is_empty(&self) -> bool {
        self.chain.len == 0
    }

    /// Most requests the batch holds.
    pub fn capacity(&self) -> usize {
        self.chain.wrs.len()
    }

    /// The `wr_id` of request `index`, if present.
    pub fn wr_id(&self, index: usize) -> Option<u64> {
        self.chain.wr_id(index)
    }

    /// Head of the chain, with the last request's `next` cut (it may still
    /// point at a request from before a `clear`). Null when empty.
    pub(crate) fn head(&mut self) -> *mut ibv_send_wr {
        self.chain.head()
    }

    /// Index of `bad` in the batch (0 if the provider did not say).
    pub(crate) fn index_of(&self, bad: *const ibv_send_wr) -> usize {
        self.chain.index_of(bad)
    }
}

/// A reusable chain of receive work requests for
/// [`crate::QueuePair::post_recv`] and
/// [`crate::SharedReceiveQueue::post_recv`].
pub struct RecvBatch {
    chain: Chain<ibv_recv_wr>,
}

impl std::fmt::Debug for RecvBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.chain.debug("RecvBatch", f)
    }
}

impl RecvBatch {
    /// A batch of up to `max_wrs` receives with one entry each on average.
    pub fn new(max_wrs: usize) -> Self {
        Self::with_sges(max_wrs, max_wrs)
    }

    /// A batch of up to `max_wrs` receives sharing `max_sges` entries.
    pub fn with_sges(max_wrs: usize, max_sges: usize) -> Self {
        Self {
            chain: Chain::with_sges(max_wrs, max_sges),
        }
    }

    /// Appends a receive of up to the sges' total length. Allocates nothing.
    ///
    /// Fails with [`VerbsError::BatchFull`]; the batch is then unchanged.
    pub fn push(&mut self, wr_id: u64, sges: &[Sge]) -> Result<(), VerbsError> {
        self.chain.push(sges, |sg_list, num_sge| ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list,
            num_sge,
        })
    }

    /// Empties the batch for reuse, keeping its arrays.
    pub fn clear(&mut self) {
        self.chain.clear();
    }

    /// Receives in the batch.
    pub fn len(&self) -> usize {
        self.chain.len
    }

    /// True when no receive has been pushed since the last clear.
    pub fn is_empty(&self) -> bool {
        self.chain.len == 0
    }

    /// Most receives the batch holds.
    pub fn capacity(&self) -> usize {
        self.chain.wrs.len()
    }

    /// Head of the chain with its tail cut; null when empty.
    pub(crate) fn head(&mut self) -> *mut ibv_recv_wr {
        self.chain.head()
    }

    /// Index of `bad` in the batch (0 if the provider did not say).
    pub(crate) fn index_of(&self, bad: *const ibv_recv_wr) -> usize {
        self.chain.index_of(bad)
    }
}

/// Position of `ptr` in `items`, by address; 0 when outside (a provider
/// that leaves `bad_wr` unset failed at the first request it looked at).
fn index_in<T>(items: &[T], ptr: *const T) -> usize {
    let size = std::mem::size_of::<T>();
    let base = items.as_ptr() as usize;
    let at = ptr as usize;
    if size == 0 || at < base {
        return 0;
    }
    let index = (at - base) / size;
    if index < items.len() {
        index
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sge(n: u64) -> Sge {
        Sge {
            addr: 0x1000 * n,
            length: 64,
            lkey: 7,
        }
    }

    /// Walks the chain from the head as the provider would.
    fn walk_send(batch: &mut SendBatch) -> Vec<ibv_send_wr> {
        let mut out = Vec::new();
        let mut p = batch.head();
        while !p.is_null() {
            // SAFETY: the chain points into the batch's live array.
            let wr = unsafe { *p };
            out.push(wr);
            p = wr.next;
        }
        out
    }

    #[test]
    fn send_chain_links_every_request_once() {
        let mut b = SendBatch::with_sges(4, 6);
        b.push(
            1,
            SendOp::RdmaWrite {
                remote_addr: 0xa000,
                rkey: 9,
            },
            SendFlags::empty(),
            &[sge(1)],
        )
        .unwrap();
        b.push(
            2,
            SendOp::SendImm { imm: 0x0102_0304 },
            SendFlags::INLINE,
            &[sge(2), sge(3)],
        )
        .unwrap();
        b.push(
            3,
            SendOp::RdmaRead {
                remote_addr: 0xb000,
                rkey: 10,
            },
            SendFlags::empty(),
            &[],
        )
        .unwrap();
        b.signal_last();
        let chain = walk_send(&mut b);
        assert_eq!(chain.len(), 3);
        assert_eq!(chain.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(chain[0].opcode, ffi::IBV_WR_RDMA_WRITE);
        // SAFETY: `rdma` is the member push wrote.
        let rdma = unsafe { chain[0].wr.rdma };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0xa000, 9));
        assert_eq!(chain[1].opcode, ffi::IBV_WR_SEND_WITH_IMM);
        assert_eq!(chain[1].imm_data, 0x0102_0304u32.to_be());
        assert_eq!(chain[1].num_sge, 2);
        assert_eq!(chain[1].send_flags, SendFlags::INLINE.bits());
        // SAFETY: sg_list points at two staged entries.
        let sg = unsafe { std::slice::from_raw_parts(chain[1].sg_list, 2) };
        assert_eq!((sg[0].addr, sg[1].addr), (0x2000, 0x3000));
        assert_eq!(chain[2].num_sge, 0);
        assert!(chain[2].sg_list.is_null());
        assert_eq!(chain[2].send_flags, SendFlags::SIGNALED.bits());
        assert_eq!(b.index_of(&b.chain.wrs[2]), 2);
        assert_eq!(b.index_of(std::ptr::null()), 0);
    }

    #[test]
    fn send_batch_full_leaves_batch_unchanged() {
        let mut b = SendBatch::with_sges(2, 1);
        b.push(1, SendOp::Send, SendFlags::empty(), &[sge(1)])
            .unwrap();
        let e = b
            .push(2, SendOp::Send, SendFlags::empty(), &[sge(2)])
            .unwrap_err();
        assert_eq!(e, VerbsError::BatchFull { wrs: 2, sges: 1 });
        assert_eq!(b.len(), 1);
        b.push(2, SendOp::Send, SendFlags::empty(), &[]).unwrap();
        assert!(b.push(3, SendOp::Send, SendFlags::empty(), &[]).is_err());
        assert_eq!(walk_send(&mut b).len(), 2);
    }

    #[test]
    fn clear_reuses_and_cuts_stale_links() {
        let mut b = SendBatch::new(3);
        for i in 0..3 {
            b.push(i, SendOp::Send, SendFlags::empty(), &[sge(i)])
                .unwrap();
        }
        b.clear();
        assert!(b.is_empty());
        assert!(b.head().is_null());
        b.push(9, SendOp::Send, SendFlags::empty(), &[sge(9)])
            .unwrap();
        let chain = walk_send(&mut b);
        assert_eq!(chain.len(), 1);
        assert_eq!(chain[0].wr_id, 9);
        assert_eq!(b.wr_id(0), Some(9));
        assert_eq!(b.wr_id(1), None);
    }

    #[test]
    fn chain_survives_moving_the_batch() {
        let mut b = SendBatch::new(2);
        b.push(1, SendOp::Send, SendFlags::empty(), &[sge(1)])
            .unwrap();
        b.push(2, SendOp::Send, SendFlags::empty(), &[sge(2)])
            .unwrap();
        let mut moved = Box::new(b);
        let chain = walk_send(&mut moved);
        assert_eq!(chain.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn recv_chain() {
        let mut b = RecvBatch::new(2);
        b.push(5, &[sge(5)]).unwrap();
        b.push(6, &[sge(6)]).unwrap();
        assert!(b.push(7, &[sge(7)]).is_err());
        let mut p = b.head();
        let mut ids = Vec::new();
        while !p.is_null() {
            // SAFETY: the chain points into the batch's live array.
            let wr = unsafe { *p };
            // SAFETY: one staged entry each.
            ids.push((wr.wr_id, unsafe { (*wr.sg_list).addr }));
            p = wr.next;
        }
        assert_eq!(ids, [(5, 0x5000), (6, 0x6000)]);
        assert_eq!(b.index_of(&b.chain.wrs[1]), 1);
    }
}
