//! The per-connection ring region of shared-memory messaging, in the receiver's memfd memory
//! and mapped by the sender:
//!
//! ```text
//! 0    grant tail (receiver writes)      64   grant head (sender writes)
//! 128  sleeping flag, u32 (receiver writes; see `doorbell`)
//! 256  grant ring: depth × u32 buffer id
//! ...  completion ring: depth × 256-byte slots, 64-byte aligned: sequence number, then
//!      buffer id | length << 32 | kind << 60, then up to 240 bytes of message inline
//! ```
//!
//! Counters only grow; slot = counter mod depth. At most `depth` grants or completions are
//! outstanding (each stands for a buffer), so neither ring overflows. A completion carries its
//! own sequence number (index + 1), published last: the receiver polls the next slot alone
//! instead of a shared tail counter and then the slot.
//!
//! A message of up to [`INLINE_MAX`] bytes travels inside its completion slot rather than in
//! the granted buffer (the buffer is still spent, so credits and receive accounting are the
//! same either way). The receiver touches every line of the next slot while it polls, so the
//! lines the sender wrote come over together with the sequence number instead of one cache
//! miss after another: one cross-core transfer per message instead of two.
//!
//! The sleeping flag has a cache line of its own that only the receiver writes, and only when
//! it goes to sleep or wakes: a sender reads it after every completion from its own cache, and
//! rings the receiver's doorbell only when it is set (see `messaging::doorbell`).

use std::net::TcpStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use multirail_policy::receive::BufferId;

const GRANT_TAIL: usize = 0;
const GRANT_HEAD: usize = 64;
/// The receiver's sleeping flag (`doorbell::ASLEEP` while it sleeps).
const SLEEPING: usize = 128;
const GRANTS: usize = 256;
/// Bytes of one completion slot: four cache lines.
const SLOT: usize = 256;
/// Bytes of a message carried inside its completion slot.
pub(in crate::messaging) const INLINE_MAX: usize = SLOT - 16;
/// Flag in the kind nibble of an entry: the message bytes follow the entry in the slot.
const INLINE: u8 = 8;

/// A view of one ring region.
pub(in crate::messaging) struct Ring {
    base: *mut u8,
    depth: usize,
    /// Where the completion ring starts.
    comps: usize,
    /// Receiver: next completion to take.
    head: u64,
    /// Receiver: `head mod depth`, kept rather than divided out on every poll.
    head_slot: usize,
}

// SAFETY: the region is shared memory touched only through atomics and the slots those
// atomics hand over; the owner keeps the mapping alive as long as the Ring.
unsafe impl Send for Ring {}

impl Ring {
    /// Bytes of a region for `depth` buffers.
    pub(in crate::messaging) fn bytes(depth: usize) -> usize {
        Self::comps_at(depth) + SLOT * depth
    }

    fn comps_at(depth: usize) -> usize {
        (GRANTS + 4 * depth).next_multiple_of(64)
    }

    /// # Safety
    /// `base` points at `Ring::bytes(depth)` bytes of zeroed or ring-initialized shared memory,
    /// 8-byte aligned, that stay mapped while the Ring lives.
    pub(in crate::messaging) unsafe fn new(base: *mut u8, depth: usize) -> Ring {
        Ring {
            base,
            depth,
            comps: Self::comps_at(depth),
            head: 0,
            head_slot: 0,
        }
    }

    fn counter(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the 8-byte aligned counter offsets inside the region.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn sleeping(&self) -> &AtomicU32 {
        // SAFETY: SLEEPING is a 4-byte aligned offset inside the region's header (before the
        // grant ring), shared memory that is only ever accessed atomically.
        unsafe { &*(self.base.add(SLEEPING) as *const AtomicU32) }
    }

    /// Receiver: marks itself asleep (`true`) or awake; see `doorbell` for the ordering.
    pub(in crate::messaging) fn set_asleep(&self, asleep: bool) {
        super::super::doorbell::set_flag(self.sleeping(), asleep);
    }

    /// Sender, after publishing a completion: rings the receiver's doorbell (its eventfd
    /// `bell`, else a byte on `stream`) when it is asleep.
    pub(in crate::messaging) fn wake_receiver(
        &self,
        stream: &TcpStream,
        bell: Option<&std::os::fd::OwnedFd>,
    ) {
        super::super::doorbell::wake_if_asleep(self.sleeping(), stream, bell);
    }

    fn slot32(&self, i: u64) -> *mut u32 {
        // SAFETY: slot index below depth; inside the grant ring.
        unsafe { (self.base.add(GRANTS) as *mut u32).add((i % self.depth as u64) as usize) }
    }

    /// The sequence word, the entry word and the inline bytes of completion slot `i mod depth`.
    fn slot(&self, i: u64) -> (&AtomicU64, *mut u64, *mut u8) {
        self.slot_at((i % self.depth as u64) as usize)
    }

    fn slot_at(&self, slot: usize) -> (&AtomicU64, *mut u64, *mut u8) {
        debug_assert!(slot < self.depth);
        let at = self.comps + SLOT * slot;
        // SAFETY: slot index below depth; the slot lies inside the completion ring and both
        // words are 8-aligned (the ring and the slots are 64-byte aligned).
        unsafe {
            (
                &*(self.base.add(at) as *const AtomicU64),
                self.base.add(at + 8) as *mut u64,
                self.base.add(at + 16),
            )
        }
    }

    /// Receiver: posts buffers for the sender.
    pub(in crate::messaging) fn post(&self, ids: &[BufferId]) {
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
    pub(in crate::messaging) fn take_grants(&self, mut f: impl FnMut(BufferId)) {
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

    /// Sender: publishes a message in buffer `id` as completion number `index`; `inline`
    /// bytes (at most [`INLINE_MAX`], `len` of them) travel in the slot itself, and then the
    /// buffer's bytes are not read.
    pub(in crate::messaging) fn complete(
        &self,
        index: u64,
        id: BufferId,
        len: usize,
        kind: u8,
        inline: Option<&[u8]>,
    ) {
        let (seq, word, bytes) = self.slot(index);
        let kind = match inline {
            Some(data) => {
                debug_assert!(data.len() == len && len <= INLINE_MAX);
                // SAFETY: the slot is ours until we publish it (the receiver has taken
                // completion `index - depth`: we held a credit) and holds INLINE_MAX bytes.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), bytes, len) };
                kind | INLINE
            }
            None => kind,
        };
        let entry = id.0 as u64 | ((len as u64) & 0x0fff_ffff) << 32 | (kind as u64) << 60;
        // SAFETY: as above.
        unsafe { word.write_volatile(entry) };
        seq.store(index + 1, Ordering::Release);
    }

    /// Receiver: hands every completion published since the last call to `f` (buffer, length,
    /// kind, and the bytes when they came inline), stopping at the first error.
    pub(in crate::messaging) fn completions<E>(
        &mut self,
        mut f: impl FnMut(BufferId, usize, u8, Option<&[u8]>) -> Result<(), E>,
    ) -> Result<(), E> {
        loop {
            let (seq, word, bytes) = self.slot_at(self.head_slot);
            if seq.load(Ordering::Acquire) != self.head + 1 {
                // Touch the slot's other lines now, so that when the sender fills them they
                // are fetched in the same poll as the sequence number, not one after another.
                for line in 1..SLOT / 64 {
                    // SAFETY: inside the slot; a plain read of shared memory the sender may be
                    // writing, whose value is discarded.
                    std::hint::black_box(unsafe {
                        (bytes.add(line * 64 - 16) as *const u64).read_volatile()
                    });
                }
                return Ok(());
            }
            // SAFETY: published by the sender's Release store of the sequence number.
            let e = unsafe { word.read_volatile() };
            self.head += 1;
            self.head_slot += 1;
            if self.head_slot == self.depth {
                self.head_slot = 0;
            }
            let kind = (e >> 60) as u8;
            let len = ((e >> 32) & 0x0fff_ffff) as usize;
            if kind & INLINE != 0 && len <= INLINE_MAX {
                // SAFETY: the sender wrote `len <= INLINE_MAX` bytes into the slot before
                // publishing it, and cannot reuse the slot before this completion is taken
                // (it needs a buffer back first); `f` is done with the bytes when it returns.
                let inline = unsafe { std::slice::from_raw_parts(bytes as *const u8, len) };
                f(BufferId(e as u32), len, kind & !INLINE, Some(inline))?;
            } else {
                // An inline flag with a length that cannot be inline stays in `kind`, which
                // the caller then refuses as unknown.
                f(BufferId(e as u32), len, kind, None)?;
            }
        }
    }
}
