//! Reading arguments from C and writing results back, with the checks every function makes:
//! NULL where a pointer is required, misaligned pointers, sizes past what a slice can hold,
//! strings that are not UTF-8, and output buffers too small.

use std::ffi::{c_char, CStr};
use std::time::Duration;

use crate::error::Failure;

/// The string at `p`, or `None` when `p` is NULL. Fails when it is not UTF-8.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and unchanged while the
/// returned reference is used (the caller's contract, stated in each function's doc).
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, arg: &str) -> Result<Option<&'a str>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: `p` is not NULL, and by this function's contract points to a NUL-terminated
    // string valid for the returned lifetime.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|e| Failure::invalid(arg, format!("is not UTF-8: {e}")))
}

/// The string at `p`; fails with NULL_POINTER naming `arg` when `p` is NULL.
///
/// # Safety
/// As [`opt_str`].
pub(crate) unsafe fn req_str<'a>(p: *const c_char, arg: &str) -> Result<&'a str, Failure> {
    // SAFETY: forwarded contract.
    unsafe { opt_str(p, arg) }?.ok_or_else(|| Failure::null(arg))
}

/// Checks that output pointer `p` is usable: not NULL and aligned for `T`. Called before any
/// work is done, so a call with a bad output pointer changes nothing.
pub(crate) fn check_out<T>(p: *mut T, arg: &str) -> Result<(), Failure> {
    if p.is_null() {
        return Err(Failure::null(arg));
    }
    if !p.is_aligned() {
        return Err(Failure::invalid(
            arg,
            format!("is not aligned to {} bytes", std::mem::align_of::<T>()),
        ));
    }
    Ok(())
}

/// Writes `value` through output pointer `p`, which [`check_out`] accepted.
///
/// # Safety
/// `p` is valid for a write of one `T` (the caller's contract); [`check_out`] checked it is
/// neither NULL nor misaligned.
pub(crate) unsafe fn write_out<T>(p: *mut T, value: T) {
    // SAFETY: by this function's contract `p` is valid, aligned and writable; `T` here is
    // always a plain integer or repr(C) struct of integers, so nothing is dropped in place.
    unsafe { p.write(value) }
}

/// Checks a buffer argument: `p` may be NULL only when `n` is 0; it must be aligned for `T`,
/// and `n` elements must fit in a slice.
fn check_buffer<T>(p: *const T, n: usize, arg: &str) -> Result<bool, Failure> {
    if n == 0 {
        return Ok(false);
    }
    if p.is_null() {
        return Err(Failure::null(arg));
    }
    if !p.is_aligned() {
        return Err(Failure::invalid(
            arg,
            format!("is not aligned to {} bytes", std::mem::align_of::<T>()),
        ));
    }
    match n.checked_mul(std::mem::size_of::<T>().max(1)) {
        Some(bytes) if bytes <= isize::MAX as usize => Ok(true),
        _ => Err(Failure::invalid(
            arg,
            format!("{n} elements do not fit in memory"),
        )),
    }
}

/// The `n` elements at `p` (an empty slice when `n` is 0, whatever `p` is).
///
/// # Safety
/// When `n > 0`, `p` points to `n` initialized elements that stay valid and unchanged while
/// the slice is used (the caller's contract).
pub(crate) unsafe fn in_slice<'a, T>(p: *const T, n: usize, arg: &str) -> Result<&'a [T], Failure> {
    if !check_buffer(p, n, arg)? {
        return Ok(&[]);
    }
    // SAFETY: `p` is non-null and aligned, `n * size_of::<T>()` fits in isize (checked above),
    // and by this function's contract the elements are initialized and valid for the lifetime.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// The writable buffer of `cap` elements at `p` (empty when `cap` is 0).
///
/// # Safety
/// When `cap > 0`, `p` points to `cap` writable elements no one else accesses while the slice
/// is used (the caller's contract). Their previous contents are never read.
pub(crate) unsafe fn out_slice<'a, T: Copy>(
    p: *mut T,
    cap: usize,
    arg: &str,
) -> Result<&'a mut [std::mem::MaybeUninit<T>], Failure> {
    if !check_buffer(p, cap, arg)? {
        return Ok(&mut []);
    }
    // SAFETY: `p` is non-null and aligned, the size fits (checked above), by this function's
    // contract the memory is writable and not aliased; viewing it as MaybeUninit never reads
    // what the caller left there.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast(), cap) })
}

/// Copies `src` into the front of `dst` (which holds at least `src.len()` elements).
pub(crate) fn fill<T: Copy>(dst: &mut [std::mem::MaybeUninit<T>], src: &[T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        d.write(*s);
    }
}

/// Copies `s` as a NUL-terminated string into `buf` of `cap` bytes when it fits, and sets
/// `*needed` to `s.len() + 1` either way; fails with BUFFER_TOO_SMALL when `cap` is short.
/// `buf` may be NULL when `cap` is 0 (to ask the size).
///
/// # Safety
/// `needed` passed [`check_out`]; `buf` is as for [`out_slice`] with `cap` bytes.
pub(crate) unsafe fn copy_string_out(
    s: &str,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> Result<(), Failure> {
    // SAFETY: forwarded contract.
    let dst = unsafe { out_slice(buf.cast::<u8>(), cap, "buf") }?;
    let n = s.len() + 1;
    // SAFETY: `needed` passed check_out and is valid for a write by the caller's contract.
    unsafe { write_out(needed, n) };
    if cap < n {
        return Err(Failure::too_small("buf", n, cap));
    }
    fill(dst, s.as_bytes());
    dst[s.len()].write(0);
    Ok(())
}

/// Milliseconds as a wait: negative means no limit.
pub(crate) fn timeout(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}
