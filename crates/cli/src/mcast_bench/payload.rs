//! What an `mcast-bench` message carries, and how a receiver checks it.
//!
//! A message's first 8 bytes hold its send stamp (nanoseconds of `CLOCK_MONOTONIC`, one clock
//! for every process of the host), so every member measures send-to-delivery latency. The rest
//! is a slice of a fixed pseudo-random pool at an offset chosen by (sender rank, sequence
//! number), so a message delivered twice, out of order, or from the wrong place in a ring reads
//! as wrong bytes. A message's length is chosen the same way (fixed, or log-uniform over a
//! range), so a receiver knows what every message must look like without being told.
//!
//! The sender's last message is its *end marker*: stamp `u64::MAX`, then how many messages it
//! sent before it. A receiver that holds every marker has seen the whole run, and checks that it
//! delivered exactly that many from each sender.

use std::fmt;

use xxhash_rust::xxh3::xxh3_64;

/// Bytes of the stamp that starts every message.
pub const STAMP_BYTES: usize = 8;
/// Bytes of an end marker: the marker stamp and the count.
pub const MARKER_BYTES: usize = 16;
/// The stamp of an end marker.
const MARKER_STAMP: u64 = u64::MAX;
/// Offsets into the pool a message's content may start at.
const POOL_OFFSETS: usize = 4096;

/// Message lengths: one size, or log-uniform between two (so small messages dominate, as in
/// real notification traffic, while every size in the range occurs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// Smallest length, at least [`STAMP_BYTES`].
    pub min: usize,
    /// Largest length.
    pub max: usize,
}

impl Sizes {
    /// Parses `BYTES` or `MIN-MAX` (each a size like `64`, `10KiB`). Fails on a size under
    /// 8 bytes (the stamp) or over 16 MiB (the largest multicast payload), a range that runs
    /// backwards, or bad units.
    pub fn parse(s: &str) -> Result<Sizes, String> {
        let (min, max) = match s.split_once('-') {
            Some((a, b)) => (
                crate::units::parse_size(a)? as usize,
                crate::units::parse_size(b)? as usize,
            ),
            None => {
                let v = crate::units::parse_size(s)? as usize;
                (v, v)
            }
        };
        if min < STAMP_BYTES {
            return Err(format!(
                "--size {s:?}: messages need at least {STAMP_BYTES} bytes (the send stamp)"
            ));
        }
        if max < min {
            return Err(format!("--size {s:?}: the range runs backwards"));
        }
        let largest = multirail::config::MAX_MULTICAST_PAYLOAD;
        if max as u64 > largest {
            return Err(format!(
                "--size {s:?}: messages of at most {} (the group's largest max_payload)",
                crate::units::format_size(largest)
            ));
        }
        Ok(Sizes { min, max })
    }

    /// The length of sender `rank`'s message `seq`.
    pub fn len_of(&self, rank: usize, seq: u64) -> usize {
        if self.min == self.max {
            return self.min;
        }
        let h = key(rank, seq) >> 11;
        let u = h as f64 / (1u64 << 53) as f64;
        let (lo, hi) = ((self.min as f64).ln(), (self.max as f64 + 1.0).ln());
        ((lo + u * (hi - lo)).exp() as usize).clamp(self.min, self.max)
    }
}

impl fmt::Display for Sizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}-{}", self.min, self.max)
        }
    }
}

fn key(rank: usize, seq: u64) -> u64 {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&(rank as u64).to_le_bytes());
    b[8..].copy_from_slice(&seq.to_le_bytes());
    xxh3_64(&b)
}

/// The content every message's bytes after the stamp are taken from.
pub struct Pool {
    bytes: Vec<u8>,
}

impl Pool {
    /// A pool covering messages of up to `max_len` bytes.
    pub fn new(max_len: usize) -> Pool {
        let len = max_len + POOL_OFFSETS;
        let mut bytes = Vec::with_capacity(len + 8);
        let mut i = 0u64;
        while bytes.len() < len {
            bytes.extend_from_slice(&xxh3_64(&i.to_le_bytes()).to_le_bytes());
            i += 1;
        }
        bytes.truncate(len);
        Pool { bytes }
    }

    /// The content of sender `rank`'s message `seq` of `len` bytes (stamp excluded).
    fn content(&self, rank: usize, seq: u64, len: usize) -> &[u8] {
        let at = (key(rank, seq) % POOL_OFFSETS as u64) as usize;
        &self.bytes[at..at + (len - STAMP_BYTES)]
    }

    /// Fills `slot` (the whole message) as sender `rank`'s message `seq`, stamped `stamp`.
    pub fn fill(&self, slot: &mut [u8], rank: usize, seq: u64, stamp: u64) {
        slot[..STAMP_BYTES].copy_from_slice(&stamp.to_le_bytes());
        let len = slot.len();
        slot[STAMP_BYTES..].copy_from_slice(self.content(rank, seq, len));
    }
}

/// Fills `slot` (of [`MARKER_BYTES`]) as an end marker after `sent` messages.
pub fn fill_marker(slot: &mut [u8], sent: u64) {
    slot[..8].copy_from_slice(&MARKER_STAMP.to_le_bytes());
    slot[8..16].copy_from_slice(&sent.to_le_bytes());
}

/// What a delivered message turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A data message and its send stamp.
    Data { stamp: u64 },
    /// The sender's end marker: how many messages it sent before it.
    Marker { sent: u64 },
}

/// Checks a message delivered as sender `rank`'s message `seq` (the count delivered from it
/// so far). Returns what it is, or why it is not the message that must come next.
pub fn check(
    pool: &Pool,
    sizes: &Sizes,
    rank: usize,
    seq: u64,
    bytes: &[u8],
) -> Result<Parsed, String> {
    if bytes.len() < STAMP_BYTES {
        return Err(format!(
            "sender {rank}: message {seq} has {} bytes, less than a stamp",
            bytes.len()
        ));
    }
    let stamp = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if stamp == MARKER_STAMP && bytes.len() == MARKER_BYTES {
        let sent = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        return Ok(Parsed::Marker { sent });
    }
    let want = sizes.len_of(rank, seq);
    if bytes.len() != want {
        return Err(format!(
            "sender {rank}: message {seq} has {} bytes, expected {want} (lost, duplicated or \
             reordered?)",
            bytes.len()
        ));
    }
    if bytes[STAMP_BYTES..] != *pool.content(rank, seq, want) {
        return Err(format!(
            "sender {rank}: message {seq} ({want} bytes) has wrong content (lost, duplicated, \
             reordered or torn?)"
        ));
    }
    Ok(Parsed::Data { stamp })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_stay_in_range_covering_it() {
        assert_eq!(Sizes::parse("64").unwrap(), Sizes { min: 64, max: 64 });
        let s = Sizes::parse("8-10KiB").unwrap();
        assert_eq!((s.min, s.max), (8, 10240));
        assert!(Sizes::parse("4").unwrap_err().contains("at least 8"));
        assert!(Sizes::parse("100-10").unwrap_err().contains("backwards"));
        assert!(Sizes::parse("x").is_err());
        assert!(Sizes::parse("8-17MiB")
            .unwrap_err()
            .contains("at most 16 MiB"));
        let lens: Vec<usize> = (0..100_000).map(|i| s.len_of(1, i)).collect();
        assert!(lens.iter().all(|&l| (8..=10240).contains(&l)));
        assert!(lens.contains(&8) && lens.iter().any(|&l| l > 10000));
        let small = lens.iter().filter(|&&l| l < 300).count();
        assert!(
            small > 40_000,
            "log-uniform: half below ~290 B, got {small}"
        );
    }

    #[test]
    fn a_filled_message_checks_and_a_neighbour_does_not() {
        let sizes = Sizes::parse("8-10240").unwrap();
        let pool = Pool::new(sizes.max);
        for seq in 0..200 {
            let len = sizes.len_of(2, seq);
            let mut m = vec![0u8; len];
            pool.fill(&mut m, 2, seq, 77);
            assert_eq!(
                check(&pool, &sizes, 2, seq, &m),
                Ok(Parsed::Data { stamp: 77 })
            );
            if len > 8 && sizes.len_of(2, seq + 1) == len {
                assert!(check(&pool, &sizes, 2, seq + 1, &m).is_err());
            }
            if len > 8 {
                assert!(check(&pool, &sizes, 1, seq, &m).is_err());
            }
        }
        let mut marker = [0u8; MARKER_BYTES];
        fill_marker(&mut marker, 12345);
        assert_eq!(
            check(&pool, &sizes, 0, 9, &marker),
            Ok(Parsed::Marker { sent: 12345 })
        );
    }
}
