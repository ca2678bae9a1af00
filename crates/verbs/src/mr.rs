//! Registered memory (`ibv_mr`): the keys that let the device, and peers,
//! reach a range of this process's memory.

use crate::context::ProtectionDomain;
use crate::ffi::ibv_mr;
use crate::post::Sge;
use crate::VerbsError;
use std::ffi::c_int;
use std::ptr::NonNull;

bitflags::bitflags! {
    /// Access rights of a memory region or a queue pair (`ibv_access_flags`).
    /// Without any flag a region can only be read locally by the device.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct Access: u32 {
        /// The local device may write (receive buffers, RDMA_READ targets).
        const LOCAL_WRITE = 1;
        /// Peers may RDMA_WRITE into it (needs LOCAL_WRITE).
        const REMOTE_WRITE = 1 << 1;
        /// Peers may RDMA_READ from it.
        const REMOTE_READ = 1 << 2;
        /// Peers may run atomics on it (needs LOCAL_WRITE).
        const REMOTE_ATOMIC = 1 << 3;
    }
}

/// A registered memory range, deregistered on drop.
pub struct MemoryRegion {
    mr: NonNull<ibv_mr>,
    addr: *mut u8,
    len: usize,
    lkey: u32,
    rkey: u32,
    pd: ProtectionDomain,
}

// SAFETY: the ibv_mr is immutable after registration (we read only the keys
// copied out at creation) and deregistered once, by Drop.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above; nothing is mutated through `&MemoryRegion`.
unsafe impl Sync for MemoryRegion {}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // A failure here is not actionable (the device may be gone), and
        // a destructor must not panic: the result is ignored.
        // SAFETY: registered by ibv_reg_mr, deregistered once. Requests still
        // in flight on it fail with a protection error instead of touching
        // the memory, which is the device's documented behaviour.
        let _ = unsafe { (self.pd.verbs().sym.ibv_dereg_mr)(self.mr.as_ptr()) };
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .finish()
    }
}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` with `access` rights (`ibv_reg_mr`,
    /// the IBVERBS_1.1 symbol every rdma-core exports).
    ///
    /// Fails with `InvalidArgument` for a null or empty range and with
    /// `ibv_reg_mr` and its errno otherwise (ENOMEM often means the locked
    /// memory limit, `ulimit -l`, is too low; EINVAL a bad flag combination
    /// such as REMOTE_WRITE without LOCAL_WRITE).
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay mapped, and not be remapped, until the
    /// region is dropped. With LOCAL_WRITE, REMOTE_WRITE or REMOTE_ATOMIC the
    /// device may write those bytes whenever a request (ours, or with remote
    /// rights a peer's that knows the rkey) targets them, outside Rust's
    /// view: the caller must not hold references to bytes that may be
    /// written that way, and must read them only after learning (through a
    /// completion or a message) that the write is over.
    pub unsafe fn register(
        pd: &ProtectionDomain,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self, VerbsError> {
        if addr.is_null() || len == 0 {
            return Err(VerbsError::InvalidArgument(format!(
                "cannot register {len} bytes at {addr:p}"
            )));
        }
        let bits = c_int::try_from(access.bits())
            .map_err(|_| VerbsError::InvalidArgument(format!("access {access:?}")))?;
        // SAFETY: live PD; the range is valid for the region's life by the
        // caller's contract; the kernel pins its pages.
        let raw = unsafe { (pd.verbs().sym.ibv_reg_mr)(pd.raw(), addr.cast(), len, bits) };
        let mr = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_reg_mr"))?;
        // SAFETY: a successfully registered ibv_mr is fully initialised.
        let (lkey, rkey) = unsafe { ((*raw).lkey, (*raw).rkey) };
        Ok(Self {
            mr,
            addr,
            len,
            lkey,
            rkey,
            pd: pd.clone(),
        })
    }

    /// Local key: goes in scatter/gather entries of our requests.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Remote key: what a peer needs to RDMA_WRITE/READ this region.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// First byte of the region.
    pub fn addr(&self) -> *mut u8 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty regions cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The protection domain the region was registered in.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// A scatter/gather entry for `len` bytes at `offset` into the region.
    ///
    /// Fails with `InvalidArgument` when the range leaves the region or
    /// `len` exceeds the 4 GiB - 1 a single entry can carry.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge, VerbsError> {
        let end = offset.checked_add(len);
        let length = u32::try_from(len).ok();
        match (end, length) {
            (Some(end), Some(length)) if end <= self.len => Ok(Sge {
                addr: self.addr as u64 + offset as u64,
                length,
                lkey: self.lkey,
            }),
            _ => Err(VerbsError::InvalidArgument(format!(
                "{len} bytes at offset {offset} do not fit a {}-byte region or one sge",
                self.len
            ))),
        }
    }
}
