//! The per-connection ring region of shared-memory messaging, in the receiver's memfd memory
//! and mapped by the sender:
//!
//! ```text
//! 0    grant tail (receiver writes)      64   grant head (sender writes)
//! 128  completion tail (sender writes)   192  completion head (receiver writes)
//! 256  grant ring: depth × u32 buffer id
//! ...  completion ring: depth × u64 (buffer id | length << 32 | kind << 60)
//! ```
//!
//! Counters only grow; slot = counter mod depth. At most `depth` grants or completions are
//! outstanding (each stands for a buffer), so neither ring overflows.

use std::sync::atomic::{AtomicU64, Ordering};

use multirail_policy::receive::BufferId;

const GRANT_TAIL: usize = 0;
const GRANT_HEAD: usize = 64;
const COMP_TAIL: usize = 128;
const COMP_HEAD: usize = 192;
const GRANTS: usize = 256;

/// A view of one ring region.
pub(super) struct Ring {
    base: *mut u8,
    depth: usize,
    /// Where the completion ring starts.
    comps: usize,
}

// SAFETY: the region is shared memory touched only through atomics and the slots those
// atomics hand over; the owner keeps the mapping alive as long as the Ring.
unsafe impl Send for Ring {}

impl Ring {
    /// Bytes of a region for `depth` buffers.
    pub(super) fn bytes(depth: usize) -> usize {
        Self::comps_at(depth) + 8 * depth
    }

    fn comps_at(depth: usize) -> usize {
        (GRANTS + 4 * depth).next_multiple_of(8)
    }

    /// # Safety
    /// `base` points at `Ring::bytes(depth)` bytes of zeroed or ring-initialized shared memory,
    /// 8-byte aligned, that stay mapped while the Ring lives.
    pub(super) unsafe fn new(base: *mut u8, depth: usize) -> Ring {
        Ring {
            base,
            depth,
            comps: Self::comps_at(depth),
        }
    }

    fn counter(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the 8-byte aligned counter offsets inside the region.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn slot32(&self, i: u64) -> *mut u32 {
        // SAFETY: slot index below depth; inside the grant ring.
        unsafe { (self.base.add(GRANTS) as *mut u32).add((i % self.depth as u64) as usize) }
    }

    fn slot64(&self, i: u64) -> *mut u64 {
        // SAFETY: slot index below depth; inside the completion ring.
        unsafe { (self.base.add(self.comps) as *mut u64).add((i % self.depth as u64) as usize) }
    }

    /// Receiver: posts buffers for the sender.
    pub(super) fn post(&self, ids: &[BufferId]) {
        let tail = self.counter(GRANT_TAIL);
        let mut t = tail.load(Ordering::Relaxed);
        for id in ids {
            // SAFETY: the slot is free: the sender consumed it (at most depth outstanding).
            unsafe { self.slot32(t).write_volatile(id.0) };
            t += 1;
        }
        tail.store(t, Ordering::Release);
    }

    /// Sender: takes every posted buffer, oldest first.
    pub(super) fn take_grants(&self, mut f: impl FnMut(BufferId)) {
        let tail = self.counter(GRANT_TAIL).load(Ordering::Acquire);
        let head = self.counter(GRANT_HEAD);
        let h = head.load(Ordering::Relaxed);
        if h == tail {
            return;
        }
        // A corrupt tail must not make us loop forever.
        let n = tail.wrapping_sub(h).min(self.depth as u64);
        for i in h..h + n {
            // SAFETY: slots h..h+n were published by the Release store of the tail.
            f(BufferId(unsafe { self.slot32(i).read_volatile() }));
        }
        head.store(h + n, Ordering::Release);
    }

    /// Sender: publishes a message in buffer `id` as completion number `tail`.
    pub(super) fn complete(&self, tail: u64, id: BufferId, len: usize, kind: u8) {
        let entry = id.0 as u64 | ((len as u64) & 0x0fff_ffff) << 32 | (kind as u64) << 60;
        // SAFETY: the receiver has consumed completion `tail - depth` (we held a credit).
        unsafe { self.slot64(tail).write_volatile(entry) };
        self.counter(COMP_TAIL).store(tail + 1, Ordering::Release);
    }

    /// Receiver: hands every completion published since the last call to `f` (buffer, length,
    /// kind), stopping at the first error.
    pub(super) fn completions<E>(
        &self,
        mut f: impl FnMut(BufferId, usize, u8) -> Result<(), E>,
    ) -> Result<(), E> {
        let tail = self.counter(COMP_TAIL).load(Ordering::Acquire);
        let head = self.counter(COMP_HEAD);
        let h = head.load(Ordering::Relaxed);
        if h == tail {
            return Ok(());
        }
        let n = tail.wrapping_sub(h).min(self.depth as u64);
        for i in h..h + n {
            // SAFETY: published by the sender's Release store of the tail.
            let e = unsafe { self.slot64(i).read_volatile() };
            head.store(i + 1, Ordering::Release);
            f(
                BufferId(e as u32),
                ((e >> 32) & 0x0fff_ffff) as usize,
                (e >> 60) as u8,
            )?;
        }
        Ok(())
    }
}
