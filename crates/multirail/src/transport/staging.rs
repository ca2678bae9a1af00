//! Bytes read from a socket ahead of where they are needed: request headers at the target,
//! response headers at the initiator, and whatever payload bytes arrived with them. One type
//! for both ends, so the rules (read into the tail, compact only when the head is consumed,
//! hand payload bytes straight to their destination) live in one place.

use std::os::fd::RawFd;

use crate::transport::sockio;

/// A fixed buffer with a consumed head (`start`) and a filled tail (`end`).
pub(crate) struct Staging {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Staged payloads go to their destination with streaming stores (see
    /// [`crate::transport::nontemporal`]).
    nontemporal: bool,
}

impl Staging {
    /// A buffer of `capacity` bytes (at least `early.len()`) already holding `early`.
    pub(crate) fn new(capacity: usize, early: &[u8]) -> Staging {
        let mut buf = vec![0u8; capacity.max(early.len())].into_boxed_slice();
        buf[..early.len()].copy_from_slice(early);
        Staging {
            buf,
            start: 0,
            end: early.len(),
            nontemporal: false,
        }
    }

    /// The same buffer, copying staged payloads out with streaming stores when `on`.
    pub(crate) fn streaming(mut self, on: bool) -> Staging {
        self.nontemporal = on;
        self
    }

    /// Bytes a read can bring once what is staged is moved to the front.
    pub(crate) fn room(&self) -> usize {
        self.buf.len() - self.available()
    }

    /// Bytes staged and not consumed.
    pub(crate) fn available(&self) -> usize {
        self.end - self.start
    }

    /// The next `n` staged bytes (`n <= available()`).
    pub(crate) fn peek(&self, n: usize) -> &[u8] {
        &self.buf[self.start..self.start + n]
    }

    /// Marks `n` staged bytes consumed (`n <= available()`).
    pub(crate) fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.available());
        self.start += n;
    }

    /// Moves what is staged to the front, so the tail has room.
    pub(crate) fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Forgets what is staged (the caller consumed it all) and makes the whole buffer free.
    pub(crate) fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// The free tail, for a read that fills it; report what arrived with [`filled`].
    ///
    /// [`filled`]: Self::filled
    pub(crate) fn tail(&mut self) -> &mut [u8] {
        &mut self.buf[self.end..]
    }

    /// `n` bytes were written into the tail.
    pub(crate) fn filled(&mut self, n: usize) {
        debug_assert!(self.end + n <= self.buf.len());
        self.end += n;
    }

    /// Reads at most `want` bytes (bounded by the free tail, after compacting) from `fd` into
    /// the tail, retrying on EINTR. Returns the bytes read; 0 means the peer closed. Fails
    /// with the socket's error.
    pub(crate) fn read_from(&mut self, fd: RawFd, want: usize) -> std::io::Result<usize> {
        self.compact();
        let tail = self.tail();
        let want = want.min(tail.len());
        let n = sockio::read_raw(fd, tail.as_mut_ptr(), want)?;
        self.filled(n);
        Ok(n)
    }

    /// As [`read_from`](Self::read_from) without blocking: `Ok(None)` when the socket holds
    /// nothing now, `Ok(Some(0))` when the peer closed.
    pub(crate) fn read_nonblocking(
        &mut self,
        fd: RawFd,
        want: usize,
    ) -> std::io::Result<Option<usize>> {
        self.compact();
        let tail = self.tail();
        let want = want.min(tail.len());
        let got = sockio::recv_nonblocking(fd, &mut tail[..want])?;
        if let Some(n) = got {
            self.filled(n);
        }
        Ok(got)
    }

    /// Reads from `fd` (blocking) until at least `n` bytes are staged (`n` at most the
    /// capacity): only the missing bytes when `exact`, else whatever each read brings, which
    /// may be more. Fails with `UnexpectedEof` when the peer closes first (`what` says inside
    /// what), or with the socket's error.
    pub(crate) fn fill_to(
        &mut self,
        fd: RawFd,
        n: usize,
        exact: bool,
        what: &str,
    ) -> std::io::Result<()> {
        while self.available() < n {
            let want = if exact {
                n - self.available()
            } else {
                usize::MAX
            };
            if self.read_from(fd, want)? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("connection closed by peer {what}"),
                ));
            }
        }
        Ok(())
    }

    /// Moves up to `len` staged bytes to `dst` and consumes them; returns how many.
    ///
    /// # Safety
    /// `dst..dst+len` must be valid for writes and not overlap this buffer.
    pub(crate) unsafe fn take_into(&mut self, dst: *mut u8, len: usize) -> usize {
        let n = self.available().min(len);
        // SAFETY: the caller guarantees `dst..dst+len` is writable and `n <= len`; the source
        // is `n` staged bytes inside `buf`, which `dst` does not overlap.
        unsafe {
            crate::transport::nontemporal::copy(
                dst,
                self.buf[self.start..].as_ptr(),
                n,
                self.nontemporal,
            )
        };
        self.start += n;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_bytes_are_peeked_consumed_and_handed_on_in_order() {
        let mut s = Staging::new(8, b"abcdef");
        assert_eq!(s.available(), 6);
        assert_eq!(s.peek(2), b"ab");
        s.consume(2);
        let mut out = [0u8; 3];
        // SAFETY: `out` is a local array of 3 bytes.
        let n = unsafe { s.take_into(out.as_mut_ptr(), 3) };
        assert_eq!((n, &out), (3, b"cde"));
        s.compact();
        assert_eq!(s.peek(1), b"f");
        assert_eq!(s.tail().len(), 7);
        s.tail()[..2].copy_from_slice(b"gh");
        s.filled(2);
        assert_eq!(s.peek(3), b"fgh");
        s.consume(3);
        s.clear();
        assert_eq!((s.available(), s.tail().len()), (0, 8));
    }
}
