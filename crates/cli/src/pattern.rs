//! A position-determined byte pattern, so either side can check bytes without the other's help:
//! the byte at offset `o` of a patterned region is byte `o % 8` (little-endian) of a word that
//! depends only on `o / 8` and a seed. `fill` and `first_mismatch` accept any byte offset, so a
//! piece of a region that starts mid-word (a benchmark thread's share of a buffer whose size the
//! thread count does not divide, or a block of odd length) gets exactly the bytes the whole
//! region's fill would have given it.

/// Seed `multirail target` fills its buffer with.
pub const TARGET_SEED: u64 = 0x7a3d_51c2_e08f_9b64;
/// Seed `multirail bench` filled its local buffer with before benches chose a fresh seed per
/// run; kept for tests that pattern their own buffers.
pub const INITIATOR_SEED: u64 = 0x1f0e_2d3c_4b5a_6978;

/// The pattern word at word index `index`. A bijection of `index ^ seed`, so two different
/// seeds never give the same word at the same index.
#[inline]
fn word(index: u64, seed: u64) -> u64 {
    let mut x = index ^ seed;
    x = (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// Bytes of `buf` before its first word boundary, given that it starts at pattern offset
/// `offset`: the part that `fill` and `first_mismatch` take from the middle of a word.
fn head_len(len: usize, offset: u64) -> usize {
    (((8 - offset % 8) % 8) as usize).min(len)
}

/// Fills `buf`, which starts at byte offset `offset` (any offset) of the patterned region.
pub fn fill(buf: &mut [u8], offset: u64, seed: u64) {
    let head = head_len(buf.len(), offset);
    let (lead, rest) = buf.split_at_mut(head);
    if head > 0 {
        let skip = (offset % 8) as usize;
        lead.copy_from_slice(&word(offset / 8, seed).to_le_bytes()[skip..skip + head]);
    }
    // Past the head every chunk starts on a word boundary.
    let first = (offset + head as u64) / 8;
    for (i, chunk) in rest.chunks_mut(8).enumerate() {
        let w = word(first + i as u64, seed).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Offset (relative to `buf`) of the first byte that differs from the pattern, if any. `buf`
/// starts at byte offset `offset` (any offset) of the patterned region.
pub fn first_mismatch(buf: &[u8], offset: u64, seed: u64) -> Option<usize> {
    let differs = |got: &[u8], want: &[u8]| got.iter().zip(want).position(|(a, b)| a != b);
    let head = head_len(buf.len(), offset);
    let (lead, rest) = buf.split_at(head);
    if head > 0 {
        let skip = (offset % 8) as usize;
        let w = word(offset / 8, seed).to_le_bytes();
        if let Some(j) = differs(lead, &w[skip..skip + head]) {
            return Some(j);
        }
    }
    let first = (offset + head as u64) / 8;
    for (i, chunk) in rest.chunks(8).enumerate() {
        let w = word(first + i as u64, seed).to_le_bytes();
        if chunk != &w[..chunk.len()] {
            return Some(head + i * 8 + differs(chunk, &w).unwrap_or(0));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check() {
        let mut b = vec![0u8; 1001];
        fill(&mut b, 64, 5);
        assert_eq!(first_mismatch(&b, 64, 5), None);
        assert!(first_mismatch(&b, 72, 5).is_some());
        b[500] ^= 1;
        assert_eq!(first_mismatch(&b, 64, 5), Some(500));
        let mut whole = vec![0u8; 2048];
        fill(&mut whole, 0, 9);
        assert_eq!(first_mismatch(&whole[1024..], 1024, 9), None);
    }

    /// A piece filled or checked at any byte offset agrees with the whole region's fill: the
    /// case of benchmark threads whose shares start mid-word (e.g. 256 MiB / 3 threads).
    #[test]
    fn any_offset_agrees_with_the_whole_fill() {
        let mut whole = vec![0u8; 300];
        fill(&mut whole, 0, 11);
        for start in 0..40usize {
            for len in [0usize, 1, 2, 7, 8, 9, 15, 16, 17, 63, 100, 260 - start] {
                let offset = start as u64;
                let mut piece = vec![0u8; len];
                fill(&mut piece, offset, 11);
                assert_eq!(piece, whole[start..start + len], "fill at {start}+{len}");
                assert_eq!(
                    first_mismatch(&whole[start..start + len], offset, 11),
                    None,
                    "check at {start}+{len}"
                );
                if len > 0 {
                    // A flipped byte is found exactly where it is.
                    let k = len / 2;
                    piece[k] ^= 0x40;
                    assert_eq!(first_mismatch(&piece, offset, 11), Some(k));
                    // The same bytes checked one byte off do not pass (unless too short to tell).
                    if len >= 16 {
                        assert!(
                            first_mismatch(&whole[start..start + len], offset + 1, 11).is_some()
                        );
                    }
                }
            }
        }
        // Odd offsets far into a region, as a thread share of 256 MiB / 3 gives.
        let share = (256u64 << 20) / 3;
        let mut piece = vec![0u8; 77];
        fill(&mut piece, share, 3);
        let aligned = share / 8 * 8;
        let mut around = vec![0u8; 77 + 8];
        fill(&mut around, aligned, 3);
        let skip = (share - aligned) as usize;
        assert_eq!(piece, around[skip..skip + 77]);
    }

    #[test]
    fn different_seeds_differ_in_every_word() {
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        fill(&mut a, 0, 42);
        fill(&mut b, 0, !42);
        assert!(a.chunks(8).zip(b.chunks(8)).all(|(x, y)| x != y));
    }
}
