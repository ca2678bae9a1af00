//! Copies whose stores bypass the caches (non-temporal stores).
//!
//! An ordinary store to a line that is not cached first reads the line from memory, then
//! writes it back when it is evicted: a copy into cold memory moves each destination byte
//! twice and evicts whatever the caches held. A transfer's destination is mostly cold (a KV
//! cache or a weight buffer far larger than the caches, written at scattered blocks) and is
//! read later, if at all, by another process or device. Streaming stores write whole lines
//! through write-combining buffers without reading them: on the development machine shm
//! copies of 1 MiB went from 11.6 to 15.8 GB/s and 16 KiB blocks from 10.0 to 12.9, with the
//! working set in cache no slower (see docs/benchmarks.md, "Copies that bypass the cache").

/// Copies `src` over `dst` as the shm transport copies with `transports.shm.nontemporal_copies`
/// (streaming stores from 4 KiB up, on x86-64), so a benchmark can hold the engine to the same
/// copy. Fails with [`crate::Error::InvalidArgument`] when the lengths differ.
pub fn copy_slice(dst: &mut [u8], src: &[u8]) -> crate::Result<()> {
    if dst.len() != src.len() {
        return Err(crate::Error::invalid(
            "dst",
            format!("{} bytes, the source has {}", dst.len(), src.len()),
        ));
    }
    // SAFETY: both slices are `len` bytes long, and a `&mut` slice never overlaps a `&` one.
    unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), src.len(), true) };
    Ok(())
}

/// Copies shorter than this use ordinary stores: the fence that ends a streaming copy, and the
/// partial lines at its ends, cost more than they save on a few lines.
pub(crate) const MIN_BYTES: usize = 4096;

/// Copies `len` bytes from `src` to `dst`. With `nontemporal`, on x86-64, for `len` of at
/// least [`MIN_BYTES`] and ranges that do not overlap, the stores stream past the caches and
/// the copy ends with a store fence, so the bytes are globally visible before any later store
/// (such as the one that marks the copy complete). Otherwise it is [`std::ptr::copy`].
///
/// # Safety
/// As for [`std::ptr::copy`]: `src` valid for reads and `dst` valid for writes of `len` bytes.
#[inline]
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize, nontemporal: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let (d, s) = (dst as usize, src as usize);
        let apart = d.saturating_add(len) <= s || s.saturating_add(len) <= d;
        if nontemporal && len >= MIN_BYTES && apart {
            // SAFETY: the caller's contract, and the ranges do not overlap.
            unsafe { stream(dst, src, len) };
            return;
        }
    }
    let _ = nontemporal;
    // SAFETY: the caller's contract; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src, dst, len) };
}

/// Streams `len` bytes from `src` to `dst` (which do not overlap) in 64-byte steps, with
/// ordinary copies for the unaligned head and the tail, then fences the stores.
///
/// # Safety
/// `src` valid for reads and `dst` valid for writes of `len` bytes; the ranges do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn stream(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    // SAFETY (whole block): every offset below stays under `len`, which the caller vouches
    // for on both ranges; streaming stores go to `dst + i` with `i - head` a multiple of 16,
    // hence 16-byte aligned as `_mm_stream_si128` requires, while loads are unaligned. SSE2 is
    // part of the x86-64 baseline.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        // Streaming stores are weakly ordered: without the fence a completion published by a
        // later store could be seen before the bytes.
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn every_length_and_misalignment_lands_exactly() {
        let src = pattern(70_000);
        for &len in &[0, 1, 63, 4095, 4096, 4097, 4160, 65_536, 65_537] {
            for src_off in [0, 1, 15, 16, 33] {
                for dst_off in [0, 1, 8, 17, 48] {
                    let mut dst = vec![0xAAu8; len + 128];
                    // SAFETY: both ranges lie inside their vectors (70,000 >= 65,537 + 33,
                    // and `dst` has 128 bytes of room past `len`).
                    unsafe {
                        copy(
                            dst.as_mut_ptr().add(dst_off),
                            src.as_ptr().add(src_off),
                            len,
                            true,
                        )
                    };
                    assert_eq!(
                        &dst[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                        "len {len}, src +{src_off}, dst +{dst_off}"
                    );
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xAA), "wrote before");
                    assert!(
                        dst[dst_off + len..].iter().all(|&b| b == 0xAA),
                        "wrote past the end"
                    );
                }
            }
        }
    }

    #[test]
    fn the_public_copy_checks_lengths() {
        let src = pattern(10_000);
        let mut dst = vec![0u8; 10_000];
        copy_slice(&mut dst, &src).unwrap();
        assert_eq!(dst, src);
        let err = copy_slice(&mut dst[..9_999], &src).unwrap_err().to_string();
        assert!(err.contains("9999 bytes, the source has 10000"), "{err}");
    }

    #[test]
    fn overlapping_ranges_copy_as_memmove_does() {
        for (from, to) in [(0usize, 100usize), (100, 0), (0, 4096), (4096, 1)] {
            let len = 8192;
            let mut buf = pattern(len + 8192);
            let expect = buf[from..from + len].to_vec();
            let p = buf.as_mut_ptr();
            // SAFETY: both ranges lie inside `buf` (len + 8192 bytes, offsets at most 4096).
            unsafe { copy(p.add(to), p.add(from), len, true) };
            assert_eq!(&buf[to..to + len], &expect[..], "{from} -> {to}");
        }
    }
}
