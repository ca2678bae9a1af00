//! Shared mappings of memfds: the engine's own buffers and what it maps of a same-host peer's
//! (its buffers, its access table, its message rings), through `/proc/PID/fd/FD`.

use std::os::fd::{AsRawFd, OwnedFd};

use crate::error::{Error, Result};
use crate::segment::ShmHandle;

/// Maps `len` bytes of the file `fd` shared, read-write. The caller owns the mapping and must
/// unmap it exactly once.
fn map_shared(fd: std::os::fd::RawFd, len: usize) -> std::io::Result<*mut libc::c_void> {
    // SAFETY: a fresh mapping chosen by the kernel, so it aliases nothing Rust references; the
    // file is at least `len` bytes long (sized or checked by both callers), so every mapped
    // page is backed.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ptr)
}

/// A new memfd named `name` (as `/proc/PID/fd` shows it) of `len` zeroed bytes, mapped shared
/// read-write: its descriptor and where the mapping starts, which the caller unmaps once. Fails
/// with `Memory`, saying which step failed and what for (`what`).
pub(crate) fn create_shared(name: &str, len: usize, what: &str) -> Result<(OwnedFd, usize)> {
    let memfd = memfd::MemfdOptions::default()
        .close_on_exec(true)
        .create(name)
        .map_err(|e| Error::Memory(format!("memfd_create for {what}: {e}")))?;
    memfd
        .as_file()
        .set_len(len as u64)
        .map_err(|e| Error::Memory(format!("sizing the memfd of {what} to {len} bytes: {e}")))?;
    let base = map_shared(memfd.as_raw_fd(), len)
        .map_err(|e| Error::Memory(format!("mmap of {what}, {len} bytes: {e}")))?;
    Ok((memfd.into_file().into(), base as usize))
}

/// A mapping of a same-host peer's memfd (a buffer, its access table, a message ring) into this
/// process; unmapped on drop.
pub(crate) struct PeerMapping {
    addr: usize,
    len: usize,
}

impl PeerMapping {
    /// Maps the first `len` bytes of the peer's memfd through `/proc/PID/fd/FD`, which reopens
    /// it. Fails when the descriptor cannot be opened (the peer exited, another user), the
    /// memfd is shorter than `len`, or the mapping fails.
    pub(crate) fn open(handle: &ShmHandle, len: usize) -> Result<Self> {
        let path = format!("/proc/{}/fd/{}", handle.pid, handle.fd);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(format!("opening peer buffer {path}"), e))?;
        let size = file
            .metadata()
            .map_err(|e| Error::io(format!("stat of peer buffer {path}"), e))?
            .len();
        if size < len as u64 {
            return Err(Error::Memory(format!(
                "peer buffer {path} holds {size} bytes, descriptor says {len}"
            )));
        }
        let ptr = map_shared(file.as_raw_fd(), len)
            .map_err(|e| Error::io(format!("mapping peer buffer {path}"), e))?;
        Ok(PeerMapping {
            addr: ptr as usize,
            len,
        })
    }

    /// Where the mapping starts in this process.
    pub(crate) fn base(&self) -> usize {
        self.addr
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        // SAFETY: the range was mapped in `open` and is unmapped once, when the last slice
        // holding this mapping is done.
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len);
        }
    }
}
