//! A position-determined byte pattern, so either side can check bytes without the other's help:
//! the word at byte offset `8*i` of a buffer is a function of `i` and a seed only.

/// Seed `multirail target` fills its buffer with.
pub const TARGET_SEED: u64 = 0x7a3d_51c2_e08f_9b64;
/// Seed `multirail bench` fills its local buffer with.
pub const INITIATOR_SEED: u64 = 0x1f0e_2d3c_4b5a_6978;

#[inline]
fn word(index: u64, seed: u64) -> u64 {
    let mut x = index ^ seed;
    x = (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// Fills `buf`, which starts at byte offset `offset` (a multiple of 8) of the patterned region.
pub fn fill(buf: &mut [u8], offset: u64, seed: u64) {
    debug_assert_eq!(offset % 8, 0);
    let first = offset / 8;
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = word(first + i as u64, seed).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Offset (relative to `buf`) of the first byte that differs from the pattern, if any.
pub fn first_mismatch(buf: &[u8], offset: u64, seed: u64) -> Option<usize> {
    debug_assert_eq!(offset % 8, 0);
    let first = offset / 8;
    for (i, chunk) in buf.chunks(8).enumerate() {
        let w = word(first + i as u64, seed).to_le_bytes();
        if chunk != &w[..chunk.len()] {
            let j = chunk
                .iter()
                .zip(w.iter())
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Some(i * 8 + j);
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
}
