//! The shared lane of shared-memory messaging: one multi-producer, single-consumer ring per
//! receiving process, in a memfd region that the receiver and every sender map. Every sender
//! on the shared lane places variable-length records in it; the receiver drains them in the
//! order they were reserved.
//!
//! ```text
//! 0     tail: AtomicU64, reservation counter in units (senders compare-and-swap it)
//! 8     sleeping flag: AtomicU32, set by the receiver while it sleeps (see `doorbell`): on
//!       the tail's line, which a sender holds anyway right after its reservation
//! 64    head: AtomicU64, consumed counter in units (receiver stores, senders load)
//! 128   one intent word (AtomicU64) per sender tag, then padding to a multiple of 64
//! data  `units` units of UNIT = 64 bytes; position p (only grows) lives in unit p mod units
//! ```
//!
//! A record at position p covers `k = ceil((16 + len) / 64)` consecutive units: word 0 of its
//! first unit is its sequence word, `p + 1`, stored last with Release (the publication);
//! word 1 is `tag | len << 32 | kind << 60`; the payload follows from byte 16.
//!
//! Why it is built this way:
//!
//! * **Atomic reservation.** A sender claims `k` units with one compare-and-swap on the tail
//!   and then fills them without coordinating with anybody. Senders finish in any order, so
//!   each record carries its own sequence word instead of there being a shared "published"
//!   counter; the receiver takes records in reservation order and waits at the first one not
//!   yet published. A sender's records therefore arrive in the order it sent them.
//! * **Intent words.** A sender that dies between reserving and publishing would leave the
//!   head waiting forever. Before its compare-and-swap, a sender writes the reservation it is
//!   about to make into its intent word, and clears it after publishing; once the receiver
//!   knows a sender is dead it can skip the units the intent names
//!   ([`SharedRing::skip_abandoned`]).
//! * **Pads.** Records never wrap past the ring's end, so the receiver hands out every payload
//!   as one contiguous slice the caller can copy out at once. A record that would not fit
//!   before the end is reserved together with a pad record covering the rest of the ring, in
//!   the same reservation, so no other sender can land between the two.
//! * **Zeroing sequence words.** Word 0 of any unit may hold payload bytes of an earlier lap,
//!   which could equal a later `p + 1` by chance. The receiver zeroes word 0 of every unit it
//!   consumed before handing the units back (storing the head), so only a real publication
//!   can match. Zeroed memory is therefore also a valid empty ring (0 never equals `p + 1`).
//!
//! The region is shared with other processes, so nothing read from it is trusted: the
//! receiver validates every record before using it for addressing and reports a corrupt ring
//! as an error instead of panicking or reading outside the region.

use std::fmt;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Bytes of one unit, the ring's allocation granule: one cache line.
pub(in crate::messaging) const UNIT: usize = 64;
/// Kind of a pad record, which covers the units up to the ring's end and carries no message.
pub(in crate::messaging) const PAD: u8 = 15;

/// Offset of the tail, on a cache line of its own: senders hammer it with compare-and-swaps.
const TAIL: usize = 0;
/// Offset of the receiver's sleeping flag, beside the tail.
const SLEEPING: usize = 8;
/// Offset of the head, on another line, so the receiver's stores do not contend with them.
const HEAD: usize = 64;
/// Offset of the intent words, one per sender tag.
const INTENTS: usize = 128;
/// Bytes of a record's header (sequence word and meta word) before its payload.
const HEADER: usize = 16;
/// The meta word's length field is 28 bits wide.
const LEN_MASK: u64 = 0x0fff_ffff;
/// Intent words keep a reservation's position modulo 2^40 and its size in 23 bits: the
/// receiver compares positions near its head only, so 40 bits cannot alias in practice.
const POS_BITS: u32 = 40;
/// Mask of the position bits kept in an intent word.
const POS_MASK: u64 = (1 << POS_BITS) - 1;
/// Width of an intent word's size field (the low bits).
const K_BITS: u32 = 23;
/// Mask of an intent word's size field.
const K_MASK: u64 = (1 << K_BITS) - 1;
/// Top bit of an intent word: set while it names a reservation, so 0 names none.
const RESERVED: u64 = 1 << 63;
/// Largest ring, in units: a reservation (at most `units` units) then always fits an intent
/// word, and a record's length (at most half the ring) the meta word's length field.
pub(in crate::messaging) const MAX_UNITS: usize = 1 << 22;

/// Units a record with a `len`-byte payload takes (header included).
pub(in crate::messaging) fn units_of(len: usize) -> usize {
    len.saturating_add(HEADER).div_ceil(UNIT)
}

/// Units of a ring that holds about `depth` messages of up to `max_len` bytes: a power of two
/// of at least `depth * max_len / UNIT` and at least twice [`units_of`]`(max_len)` (a message
/// may take at most half the ring), and at least 64. Capped at 2^22 units (256 MiB): a larger
/// request gets the cap, and messages that do not fit it are refused by
/// [`SharedRing::try_send`].
pub(in crate::messaging) fn units_for(depth: usize, max_len: usize) -> usize {
    let by_depth = depth.saturating_mul(max_len) / UNIT;
    let by_len = units_of(max_len).saturating_mul(2);
    by_depth
        .max(by_len)
        .clamp(64, MAX_UNITS)
        .next_power_of_two()
}

/// Offset of unit 0: after the counters and the intent words, rounded up to a cache line.
fn data_at(senders: usize) -> usize {
    (INTENTS + 8 * senders).next_multiple_of(UNIT)
}

/// The meta word of a record: the sender's tag, the length (units, for a pad), the kind.
fn meta_word(tag: u32, len: u64, kind: u8) -> u64 {
    tag as u64 | (len & LEN_MASK) << 32 | (kind as u64) << 60
}

/// The intent word naming a reservation of `k` units (pad included) at position `t`.
fn encode_intent(t: u64, k: usize) -> u64 {
    debug_assert!(k > 0 && k as u64 <= K_MASK);
    RESERVED | (t & POS_MASK) << K_BITS | k as u64
}

/// The reservation an intent word names, `(position mod 2^40, units)`, or None when it names
/// none (or holds nonsense: a reservation of zero units).
fn decode_intent(w: u64) -> Option<(u64, u64)> {
    let k = w & K_MASK;
    (w & RESERVED != 0 && k != 0).then_some(((w >> K_BITS) & POS_MASK, k))
}

/// Why [`SharedRing::poll`] stopped with an error.
#[derive(Debug)]
pub(in crate::messaging) enum PollError<E> {
    /// A published record failed validation: the ring is corrupt and stays stuck at that
    /// record (every later poll reports it again). Records before it were consumed.
    Corrupt(String),
    /// The consumer's own error; the record it was given counts as consumed.
    Consumer(E),
}

impl<E: fmt::Display> fmt::Display for PollError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PollError::Corrupt(what) => f.write_str(what),
            PollError::Consumer(e) => e.fmt(f),
        }
    }
}

/// A view of one shared ring region, for a sender ([`SharedRing::try_send`]) or for the
/// receiver (everything else).
pub(in crate::messaging) struct SharedRing {
    /// Start of the mapped region.
    base: *mut u8,
    /// Units in the ring, a power of two of at most 2^22.
    units: usize,
    /// Intent words, hence the number of sender tags.
    senders: usize,
    /// Offset of unit 0 in the region.
    data: usize,
    /// Receiver: position of the next record to take. Kept locally (the shared head is
    /// written once per poll) and trusted, unlike anything in the region.
    head: u64,
}

// SAFETY: the region is shared memory touched only through atomics and through the units a
// reservation or a publication hands over; the owner keeps the mapping alive as long as the
// SharedRing, whichever thread holds it.
unsafe impl Send for SharedRing {}

impl SharedRing {
    /// Bytes of the whole region of a ring of `units` units with `senders` intent words.
    pub(in crate::messaging) fn bytes(units: usize, senders: usize) -> usize {
        data_at(senders) + units * UNIT
    }

    /// A view of the ring at `base`, for either end. The receiver's local head starts at the
    /// shared head's current value, so a receiver may be re-created over a ring in use.
    ///
    /// Panics when `units` is not a power of two, exceeds 2^22, or `base` is not 64-byte
    /// aligned (caller errors, never the region's content).
    ///
    /// # Safety
    /// `base` is 64-byte aligned and points at [`SharedRing::bytes`]`(units, senders)` bytes
    /// of zeroed or ring-initialized shared memory (laid out by a ring of the same `units` and
    /// `senders`) that stay mapped while the SharedRing lives.
    pub(in crate::messaging) unsafe fn new(
        base: *mut u8,
        units: usize,
        senders: usize,
    ) -> SharedRing {
        assert!(
            units.is_power_of_two() && units <= MAX_UNITS,
            "shared ring of {units} units: must be a power of two of at most {MAX_UNITS}"
        );
        assert!(
            (base as usize).is_multiple_of(UNIT),
            "shared ring region is not 64-byte aligned"
        );
        let mut ring = SharedRing {
            base,
            units,
            senders,
            data: data_at(senders),
            head: 0,
        };
        ring.head = ring.word(HEAD).load(Ordering::Acquire);
        ring
    }

    fn sleeping(&self) -> &AtomicU32 {
        // SAFETY: SLEEPING is a 4-byte aligned offset inside the region's header (new's
        // contract), shared memory only ever accessed atomically.
        unsafe { &*(self.base.add(SLEEPING) as *const AtomicU32) }
    }

    /// Receiver: marks itself asleep (`true`) or awake; see `doorbell` for the ordering.
    pub(in crate::messaging) fn set_asleep(&self, asleep: bool) {
        super::super::doorbell::set_flag(self.sleeping(), asleep);
    }

    /// Sender, after publishing a record: rings the receiver's doorbell (its eventfd
    /// `bell`, else a byte on `stream`) when it is asleep.
    pub(in crate::messaging) fn wake_receiver(
        &self,
        stream: &TcpStream,
        bell: Option<&std::os::fd::OwnedFd>,
    ) {
        super::super::doorbell::wake_if_asleep(self.sleeping(), stream, bell);
    }

    /// The tail or the head counter, by offset.
    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at == TAIL || at == HEAD);
        // SAFETY: TAIL and HEAD are 8-byte aligned offsets inside the region (new's contract),
        // and the region outlives self.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    /// The intent word of `tag`; callers check `tag < senders`.
    fn intent(&self, tag: u32) -> &AtomicU64 {
        debug_assert!((tag as usize) < self.senders);
        // SAFETY: tag < senders, so the word lies in the intent array inside the region, 8-byte
        // aligned (the array starts at 128 of a 64-aligned base).
        unsafe { &*(self.base.add(INTENTS + 8 * tag as usize) as *const AtomicU64) }
    }

    /// Position to unit index: `units` is a power of two, so a mask instead of a division.
    fn mask(&self) -> u64 {
        self.units as u64 - 1
    }

    /// Start of unit `off < units`.
    fn unit(&self, off: usize) -> *mut u8 {
        debug_assert!(off < self.units);
        // SAFETY: off < units, so the unit lies inside the region's data area.
        unsafe { self.base.add(self.data + UNIT * off) }
    }

    /// Word 0 of unit `off < units`: the sequence word when a record starts there.
    fn seq(&self, off: usize) -> &AtomicU64 {
        // SAFETY: the unit is inside the region and 64-byte aligned.
        unsafe { &*(self.unit(off) as *const AtomicU64) }
    }

    /// Word 1 of unit `off < units`: the meta word when a record starts there.
    fn meta(&self, off: usize) -> &AtomicU64 {
        // SAFETY: the unit is inside the region; byte 8 of it is 8-byte aligned.
        unsafe { &*(self.unit(off).add(8) as *const AtomicU64) }
    }

    /// Zeroes word 0 of units `off..off + k` (which the caller checked lie inside the ring),
    /// so that stale bytes there can never read as a later lap's publication.
    fn clear_units(&self, off: usize, k: usize) {
        debug_assert!(off + k <= self.units);
        for u in off..off + k {
            self.seq(u).store(0, Ordering::Relaxed);
        }
    }

    /// Sender: places a record of `kind` with payload `data` for the receiver, as sender
    /// `tag`. Returns Ok(true) once it is published, Ok(false) when the ring is full (nothing
    /// was written: wait for the receiver and retry), and an error when the message can never
    /// be sent: `tag` is not below the ring's sender count, `kind` is 0 or [`PAD`] (or above),
    /// the record would take more than half the ring, or the shared counters are corrupt.
    ///
    /// Calls with the same tag must not overlap (one intent word per tag). Does not allocate
    /// except for an error.
    pub(in crate::messaging) fn try_send(
        &self,
        tag: u32,
        kind: u8,
        data: &[u8],
    ) -> Result<bool, String> {
        let len = data.len();
        if tag as usize >= self.senders {
            return Err(format!(
                "sender tag {tag} is out of range: the shared ring has {} senders",
                self.senders
            ));
        }
        if kind == 0 || kind >= PAD {
            return Err(format!(
                "message kind {kind} cannot travel on the shared ring (kinds 1 to 14 can)"
            ));
        }
        let k = units_of(len);
        if k > self.units / 2 {
            return Err(format!("a {len}-byte message does not fit the shared ring"));
        }
        let Some((t, pad)) = self.reserve(tag, k)? else {
            return Ok(false);
        };
        if pad > 0 {
            self.write_pad(t, tag, pad);
        }
        self.write_record(t.wrapping_add(pad as u64), tag, kind, data);
        self.intent(tag).store(0, Ordering::Release);
        Ok(true)
    }

    /// Sender: reserves `k` units (plus a pad before them when they would not fit before the
    /// ring's end) and announces the reservation in `tag`'s intent word. Returns the
    /// reservation's start and its pad, None when the ring is full (the intent word then
    /// names nothing), or an error when the shared counters are impossible.
    fn reserve(&self, tag: u32, k: usize) -> Result<Option<(u64, usize)>, String> {
        let units = self.units as u64;
        let tail = self.word(TAIL);
        let intent = self.intent(tag);
        let mut announced = false;
        // The head of an earlier pass that was not within `units` of the tail.
        let mut behind = None;
        loop {
            // Head before tail, and the tail with Acquire: the head we read was stored after
            // its position was reserved, so head <= tail. The head may be stale, though (we
            // may sleep between the loads while the ring moves on): a tail more than `units`
            // ahead is a reason to look again. Whoever reserved up to that tail saw a head
            // within `units` of it, and that head reaches us on the next pass; only a head that
            // stays put while that far behind means the counters are corrupt.
            let h = self.word(HEAD).load(Ordering::Acquire);
            let t = tail.load(Ordering::Acquire);
            let used = t.wrapping_sub(h);
            if used > units {
                if behind == Some(h) {
                    if announced {
                        intent.store(0, Ordering::Release);
                    }
                    return Err(format!(
                        "shared ring corrupt: tail {t} is not within {units} units after head {h}"
                    ));
                }
                behind = Some(h);
                continue;
            }
            let off = (t & self.mask()) as usize;
            let pad = if off + k > self.units {
                self.units - off
            } else {
                0
            };
            if used + (pad + k) as u64 > units {
                if announced {
                    // A stale intent would name someone else's reservation: if we died later,
                    // the receiver could skip a live sender's record.
                    intent.store(0, Ordering::Release);
                }
                return Ok(None);
            }
            // Announce before reserving: if we die right after the compare-and-swap, the
            // receiver can still learn which units were ours.
            intent.store(encode_intent(t, pad + k), Ordering::Release);
            announced = true;
            if tail
                .compare_exchange_weak(
                    t,
                    t.wrapping_add((pad + k) as u64),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                return Ok(Some((t, pad)));
            }
        }
    }

    /// Sender: publishes a pad record at `t` covering `pad` units, up to the ring's end.
    fn write_pad(&self, t: u64, tag: u32, pad: usize) {
        let off = (t & self.mask()) as usize;
        debug_assert!(off + pad == self.units);
        self.meta(off)
            .store(meta_word(tag, pad as u64, PAD), Ordering::Relaxed);
        self.seq(off).store(t.wrapping_add(1), Ordering::Release);
    }

    /// Sender: writes and publishes the record at position `p`, which it reserved.
    fn write_record(&self, p: u64, tag: u32, kind: u8, data: &[u8]) {
        let off = (p & self.mask()) as usize;
        debug_assert!(off + units_of(data.len()) <= self.units);
        // SAFETY: the reservation made units off..off + units_of(len) ours: no other sender
        // reserved them, and the receiver finished with their previous lap (the reservation
        // stayed within `units` of a head loaded with Acquire, which the receiver stored after
        // its last read). They lie inside the ring: a record that would cross the end was
        // moved to unit 0 behind a pad, and it takes at most half the ring. The payload starts
        // at byte 16 of the first unit and len + 16 <= k * 64.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.unit(off).add(HEADER), data.len())
        };
        self.meta(off)
            .store(meta_word(tag, data.len() as u64, kind), Ordering::Relaxed);
        self.seq(off).store(p.wrapping_add(1), Ordering::Release);
    }

    /// Receiver: hands the published records at the head, in reservation order, to `f` (tag,
    /// kind, payload), at most `max` of them, skipping pads; the payload is valid during the
    /// call only. Returns how many records `f` was given. Stops with
    /// [`PollError::Consumer`] when `f` fails (that record counts as consumed) and with
    /// [`PollError::Corrupt`] at a record that fails validation (left unconsumed). The
    /// units of consumed records go back to the senders once per call.
    pub(in crate::messaging) fn poll<E>(
        &mut self,
        max: usize,
        mut f: impl FnMut(u32, u8, &[u8]) -> Result<(), E>,
    ) -> Result<usize, PollError<E>> {
        let start = self.head;
        let mut handed = 0;
        let result = loop {
            if handed >= max {
                break Ok(handed);
            }
            let off = (self.head & self.mask()) as usize;
            if self.seq(off).load(Ordering::Acquire) != self.head.wrapping_add(1) {
                break Ok(handed);
            }
            let meta = self.meta(off).load(Ordering::Relaxed);
            let (tag, kind, len, k) = match self.validate(off, meta) {
                Ok(record) => record,
                Err(what) => break Err(PollError::Corrupt(what)),
            };
            if kind == PAD {
                self.clear_units(off, k);
                self.head = self.head.wrapping_add(k as u64);
                continue;
            }
            // SAFETY: validate checked that the record's k units lie inside the ring and that
            // its len bytes fit them after the header. The sender published it (Release store
            // of the sequence word, read with Acquire) and cannot reuse the units before the
            // head passes them, which happens after f returns.
            let payload =
                unsafe { std::slice::from_raw_parts(self.unit(off).add(HEADER) as *const u8, len) };
            let outcome = f(tag, kind, payload);
            self.clear_units(off, k);
            // Advanced per record, not per call, so that a panicking f cannot leave zeroed
            // (hence unpublished-looking) records behind the head.
            self.head = self.head.wrapping_add(k as u64);
            if let Err(e) = outcome {
                break Err(PollError::Consumer(e));
            }
            handed += 1;
        };
        if self.head != start {
            // After the zeroing, so a sender that sees the new head sees zeroed units.
            self.word(HEAD).store(self.head, Ordering::Release);
        }
        result
    }

    /// Checks the record at unit `off` with meta word `meta`; returns its tag, kind, payload
    /// length and units, or a description of what is wrong.
    fn validate(&self, off: usize, meta: u64) -> Result<(u32, u8, usize, usize), String> {
        let tag = meta as u32;
        let kind = (meta >> 60) as u8;
        let len = ((meta >> 32) & LEN_MASK) as usize;
        let room = self.units - off;
        let at = self.head;
        if kind == PAD {
            if len == 0 || len != room {
                return Err(format!(
                    "shared ring corrupt at position {at} (unit {off}): a pad of {len} units \
                     does not end at the ring's end ({room} units away)"
                ));
            }
            return Ok((tag, kind, 0, len));
        }
        if kind == 0 || tag as usize >= self.senders {
            return Err(format!(
                "shared ring corrupt at position {at} (unit {off}): record of kind {kind} \
                 from sender tag {tag} ({} senders)",
                self.senders
            ));
        }
        let k = units_of(len);
        if k > room {
            return Err(format!(
                "shared ring corrupt at position {at} (unit {off}): a {len}-byte record \
                 ({k} units) runs past the ring's end ({room} units away)"
            ));
        }
        Ok((tag, kind, len, k))
    }

    /// Receiver: when the record at the head is not published and `tag`'s intent word names
    /// a reservation the head lies inside, gives up that reservation: zeroes its remaining
    /// units, moves the head (local and shared) past it and clears the intent. Returns whether
    /// it did; false also for a tag out of range or an intent that names units not reserved.
    ///
    /// Only for senders known to be dead: a live sender is still writing its units. Even then
    /// a sender that died between announcing and reserving leaves an intent for units it never
    /// got; if another sender then reserved those same units and is slow to publish, its
    /// record is skipped too. The caller narrows this by calling only after the head has been
    /// stuck a while.
    pub(in crate::messaging) fn skip_abandoned(&mut self, tag: u32) -> bool {
        if tag as usize >= self.senders || self.published_at_head() {
            return false;
        }
        let Some((t, k)) = decode_intent(self.intent(tag).load(Ordering::Acquire)) else {
            return false;
        };
        let into = self.head.wrapping_sub(t) & POS_MASK;
        if into >= k {
            return false;
        }
        let left = k - into;
        // The tail is read after the head's record was seen unpublished; units past it were
        // never reserved (the sender died before its compare-and-swap went through).
        let tail = self.word(TAIL).load(Ordering::Acquire);
        if left > tail.wrapping_sub(self.head) || left > self.units as u64 {
            return false;
        }
        let mut p = self.head;
        for _ in 0..left {
            self.seq((p & self.mask()) as usize)
                .store(0, Ordering::Relaxed);
            p = p.wrapping_add(1);
        }
        self.head = p;
        self.intent(tag).store(0, Ordering::Release);
        self.word(HEAD).store(p, Ordering::Release);
        true
    }

    /// Receiver: clears `tag`'s intent word (for a sender that left with nothing in flight);
    /// does nothing for a tag out of range.
    pub(in crate::messaging) fn clear_intent(&self, tag: u32) {
        if (tag as usize) < self.senders {
            self.intent(tag).store(0, Ordering::Release);
        }
    }

    /// Units in the ring.
    pub(in crate::messaging) fn units(&self) -> usize {
        self.units
    }

    /// Units reserved so far (the shared tail), as the region says.
    pub(in crate::messaging) fn reserved(&self) -> u64 {
        self.word(TAIL).load(Ordering::Acquire)
    }

    /// Receiver: units consumed so far (the local head).
    pub(in crate::messaging) fn consumed(&self) -> u64 {
        self.head
    }

    /// Receiver: whether the record at the head is published (a poll would take it).
    pub(in crate::messaging) fn published_at_head(&self) -> bool {
        let off = (self.head & self.mask()) as usize;
        self.seq(off).load(Ordering::Acquire) == self.head.wrapping_add(1)
    }

    /// Receiver: whether units are reserved past the head but the record at the head is not
    /// published: some sender is writing it, or died before publishing.
    pub(in crate::messaging) fn stalled(&self) -> bool {
        self.head < self.reserved() && !self.published_at_head()
    }
}

#[cfg(test)]
mod tests;
