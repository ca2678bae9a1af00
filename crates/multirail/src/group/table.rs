//! A group's table: the engine memory every member holds, laid out the same at every member,
//! that the members replicate to each other with one-sided writes (Derecho's SST row per
//! member). Member `m`'s row is written only by `m`: it writes the row in its own table and
//! copies parts of it to the same offsets in every other member's table.
//!
//! A row holds, in order:
//! - a heartbeat word (`m` writes it to members it has not written to for a while, so a dead
//!   member is found by the write failing even when nothing else is sent);
//! - the *committed count*: how many records of `m`'s ring are pushed (senders only), with an
//!   urgent bit asking receivers to acknowledge at once (`flush()`);
//! - one *received count* per sender: how many of that sender's messages `m` has consumed,
//!   counted in messages including null messages (the ordered mode's round robin counts them);
//! - for senders, the ring: records packed one after another, each a 24-byte header (record
//!   number, first message index, message count, payload length) and the payload, 8-aligned.
//!   A record starts at 0 instead when a largest record would not fit before the end, a rule
//!   both sides apply, so no padding marker is needed. The ring holds `window_size + 1`
//!   largest records: `window_size` unacknowledged records and the waste at the wrap always
//!   fit, so a record is never written over one a member has not consumed.
//!
//! Counts are written as a pair (value, bitwise complement) and read only when the pair
//! agrees: a tcp receive may land a count in more than one piece, and a torn count must read
//! as "not yet" rather than as a large number. Records carry their record number, which the
//! reader checks, for the same reason.

use std::sync::atomic::{fence, AtomicU64, Ordering};

/// Bytes of a record header: record number, first message index, count and length.
pub(crate) const RECORD_HEADER: u64 = 24;

/// The urgent bit of a committed count.
const URGENT: u64 = 1 << 63;

/// Offsets of one member's row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row {
    /// Start of the row; its heartbeat word.
    pub start: u64,
    /// The committed count pair.
    pub committed: u64,
    /// The first received count pair (one per sender follows).
    pub received: u64,
    /// The ring, for senders.
    pub ring: Option<u64>,
}

/// Where everything lies in a group's table.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// One row per member, in member order.
    pub rows: Vec<Row>,
    /// Largest record in bytes (header and `max_payload`, 8-aligned).
    pub stride: u64,
    /// Bytes of a ring.
    pub ring_bytes: u64,
    /// Bytes of the whole table.
    pub table_len: u64,
}

fn align(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

impl Layout {
    /// The layout of a group of `members` where `is_sender(m)` says which send, with rings of
    /// `window` records of up to `max_payload` bytes.
    pub fn new(
        members: usize,
        senders: usize,
        is_sender: impl Fn(usize) -> bool,
        window: u64,
        max_payload: u64,
    ) -> Layout {
        let stride = align(RECORD_HEADER + max_payload, 8);
        let ring_bytes = (window + 1) * stride;
        let mut rows = Vec::with_capacity(members);
        let mut at = 0u64;
        for m in 0..members {
            let start = at;
            let received = start + 32;
            let mut end = align(received + 16 * senders as u64, 64);
            let ring = is_sender(m).then(|| {
                let r = end;
                end += ring_bytes;
                r
            });
            rows.push(Row {
                start,
                committed: start + 16,
                received,
                ring,
            });
            at = end;
        }
        Layout {
            rows,
            stride,
            ring_bytes,
            table_len: at.max(64),
        }
    }

    /// Where the record after one that starts at `pos` with `len` payload bytes begins.
    pub fn next_record(&self, pos: u64, len: u64) -> u64 {
        self.place(pos + align(RECORD_HEADER + len, 8))
    }

    /// Where a record meant for `pos` actually starts: at 0 when a largest one would not fit.
    pub fn place(&self, pos: u64) -> u64 {
        if pos + self.stride > self.ring_bytes {
            0
        } else {
            pos
        }
    }

    /// Bytes a record with `len` payload bytes takes.
    pub fn record_bytes(len: u64) -> u64 {
        align(RECORD_HEADER + len, 8)
    }
}

/// A record's header as read from a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    /// The record's number in its sender's ring (0, 1, ...).
    pub record: u64,
    /// Index of its first message among the sender's messages.
    pub first: u64,
    /// Messages it stands for: 1 for a message, the run's length for null messages.
    pub count: u32,
    /// Whether it is a run of null messages (ordered delivery's placeholders).
    pub null: bool,
    /// Payload bytes (0 for nulls).
    pub len: u32,
}

/// The null bit in a header's packed count word.
const NULL_RUN: u64 = 1 << 31;

/// The leaving bit of a heartbeat word: the member called `leave`.
pub(crate) const LEAVING: u64 = 1 << 63;

/// A member's table: the memory of the group's `Buffer`, read and written in place.
///
/// Remote members write into it at any time through the transports, so every word that
/// signals progress is read with atomic loads, and payloads are copied only after the count
/// that covers them was read (acquire), by which time the writer's transfer of them completed.
pub(crate) struct Table {
    base: *mut u8,
    len: u64,
}

// SAFETY: `Table` is a view of engine memory kept alive by the group's `Buffer`; all access
// goes through bounds-checked methods with atomic or byte-copy semantics, never references
// that alias writes from other threads.
unsafe impl Send for Table {}
// SAFETY: as above: shared use only performs atomic loads/stores and raw copies.
unsafe impl Sync for Table {}

impl Table {
    /// A view of `len` bytes at `base`.
    ///
    /// # Safety
    /// `base..base+len` must stay mapped and writable for the life of the view, and be
    /// 8-aligned.
    pub unsafe fn new(base: *mut u8, len: u64) -> Table {
        debug_assert_eq!(base as usize % 8, 0);
        Table { base, len }
    }

    /// The address of byte `off`, as the engine addresses it in requests.
    pub fn addr(&self, off: u64) -> u64 {
        self.base as u64 + off
    }

    fn word(&self, off: u64) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "table word {off} out of range"
        );
        // SAFETY: in bounds and 8-aligned (checked above, base is 8-aligned); the memory lives
        // as long as `self` (constructor contract), and AtomicU64 has u64's layout, so any
        // concurrent writer (a transport's copy) races only with atomic accesses here.
        unsafe { &*(self.base.add(off as usize) as *const AtomicU64) }
    }

    /// Reads the count pair at `off`: `None` while the pair disagrees (a write in progress).
    pub fn read_count(&self, off: u64) -> Option<u64> {
        let value = self.word(off).load(Ordering::Acquire);
        let check = self.word(off + 8).load(Ordering::Acquire);
        fence(Ordering::Acquire);
        (check == !value).then_some(value)
    }

    /// Writes the count pair at `off` (in this member's own row, before copying it out).
    pub fn write_count(&self, off: u64, value: u64) {
        self.word(off).store(value, Ordering::Release);
        self.word(off + 8).store(!value, Ordering::Release);
    }

    /// Reads a committed count and its urgent bit.
    pub fn read_committed(&self, off: u64) -> Option<(u64, bool)> {
        self.read_count(off).map(|v| (v & !URGENT, v & URGENT != 0))
    }

    /// Writes a committed count with its urgent bit.
    pub fn write_committed(&self, off: u64, records: u64, urgent: bool) {
        self.write_count(off, records | if urgent { URGENT } else { 0 });
    }

    /// Bumps the heartbeat word at `off`, setting [`LEAVING`] too when `leaving`.
    pub fn beat(&self, off: u64, leaving: bool) {
        let w = self.word(off);
        w.fetch_add(1, Ordering::Relaxed);
        if leaving {
            w.fetch_or(LEAVING, Ordering::Relaxed);
        }
    }

    /// Reads the heartbeat word at `off`.
    pub fn read_word(&self, off: u64) -> u64 {
        self.word(off).load(Ordering::Acquire)
    }

    /// Reads the record header at `off`.
    pub fn read_header(&self, off: u64) -> RecordHeader {
        let record = self.word(off).load(Ordering::Acquire);
        let first = self.word(off + 8).load(Ordering::Acquire);
        let packed = self.word(off + 16).load(Ordering::Acquire);
        RecordHeader {
            record,
            first,
            count: (packed & (NULL_RUN - 1)) as u32,
            null: packed & NULL_RUN != 0,
            len: (packed >> 32) as u32,
        }
    }

    /// Writes a record header at `off`.
    pub fn write_header(&self, off: u64, h: RecordHeader) {
        self.word(off).store(h.record, Ordering::Relaxed);
        self.word(off + 8).store(h.first, Ordering::Relaxed);
        debug_assert!(u64::from(h.count) < NULL_RUN);
        let null = if h.null { NULL_RUN } else { 0 };
        self.word(off + 16).store(
            u64::from(h.count) | null | u64::from(h.len) << 32,
            Ordering::Release,
        );
    }

    /// The `len` bytes at `off` as a mutable slice, for filling a record in place. The table
    /// is a view of shared memory (like a raw pointer), so handing out a mutable slice from
    /// `&self` is sound under the contract below, not by borrowing.
    ///
    /// # Safety
    /// No other access to these bytes may happen while the slice lives: they must belong to a
    /// record of this member's own ring that is not yet committed.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, off: u64, len: u64) -> &mut [u8] {
        assert!(
            off + len <= self.len,
            "table bytes {off}+{len} out of range"
        );
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(off as usize), len as usize) }
    }

    /// Copies the `len` bytes at `off` out.
    pub fn copy_out(&self, off: u64, len: u64, into: &mut Vec<u8>) {
        assert!(
            off + len <= self.len,
            "table bytes {off}+{len} out of range"
        );
        into.clear();
        into.reserve(len as usize);
        // SAFETY: in bounds (checked) and `into` has room for `len` bytes; the bytes belong to
        // a record whose count was read with acquire ordering, and its sender does not write
        // them again until this member acknowledged the record.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.add(off as usize),
                into.as_mut_ptr(),
                len as usize,
            );
            into.set_len(len as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_do_not_overlap_and_rings_hold_a_window_and_the_wrap() {
        let l = Layout::new(4, 2, |m| m < 2, 16, 10240);
        for pair in l.rows.windows(2) {
            let end = pair[0]
                .ring
                .map_or(pair[0].received + 32, |r| r + l.ring_bytes);
            assert!(end <= pair[1].start, "rows overlap: {pair:?}");
        }
        assert!(l.rows[0].ring.is_some() && l.rows[2].ring.is_none());
        assert_eq!(l.stride, 10264);
        assert_eq!(l.ring_bytes, 17 * 10264);
        assert_eq!(l.table_len, l.rows[3].start + 64);
    }

    #[test]
    fn records_wrap_before_a_largest_one_would_not_fit() {
        let l = Layout::new(2, 1, |m| m == 0, 2, 100);
        // stride 128, ring 384: records at 0, 128, 256 fit; a record at 264 would not.
        assert_eq!(l.stride, 128);
        assert_eq!(l.next_record(0, 100), 128);
        assert_eq!(l.next_record(128, 100), 256);
        assert_eq!(l.next_record(256, 0), 0);
        assert_eq!(l.next_record(0, 0), 24);
    }

    #[test]
    fn a_count_pair_that_disagrees_reads_as_not_yet() {
        let mut mem = vec![0u64; 8];
        // SAFETY: 64 bytes of an aligned Vec<u64>, alive for the test.
        let t = unsafe { Table::new(mem.as_mut_ptr() as *mut u8, 64) };
        assert_eq!(t.read_count(0), None, "all zero is not a valid pair");
        t.write_committed(16, 5, true);
        assert_eq!(t.read_committed(16), Some((5, true)));
        t.write_count(0, 7);
        assert_eq!(t.read_count(0), Some(7));
        t.word(8).store(0, Ordering::Relaxed);
        assert_eq!(t.read_count(0), None);
        let h = RecordHeader {
            record: 3,
            first: 9,
            count: 2,
            null: true,
            len: 0,
        };
        t.write_header(32, h);
        assert_eq!(t.read_header(32), h);
    }
}
