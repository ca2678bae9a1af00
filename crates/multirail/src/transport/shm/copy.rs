//! The copies themselves: through this process's mapping of the peer's memfd, or with
//! process_vm_readv/writev, and the probe that says whether the kernel allows the latter.

use super::*;
use crate::transport::nontemporal;

/// Tries a one-byte process_vm_readv; EPERM (ptrace restrictions, other users) means no.
pub(super) fn probe_process_vm(pid: i32, addr: u64) -> bool {
    let mut byte = 0u8;
    let local = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: `local` describes one writable byte on our stack; `remote` is only read, in the
    // other process, by the kernel, which checks it.
    let rc = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if rc == 1 {
        return true;
    }
    tracing::warn!(
        pid,
        error = %io::Error::last_os_error(),
        "process_vm_readv refused; registered memory of this same-host peer goes over tcp"
    );
    false
}

/// Copies `len` bytes of `job` starting `skip` bytes into it, with streaming stores when
/// `nontemporal` (see [`crate::transport::nontemporal`]). Fails, copying nothing, when the peer
/// has unregistered the buffer (its access entry is revoked); the peer's unregistration waits
/// for the copy while it runs.
pub(super) fn run(job: &CopyJob, skip: usize, len: usize, nontemporal: bool) -> Result<()> {
    let _held = job.access.as_ref().map(Access::hold).transpose()?;
    debug_assert!(skip + len <= job.len);
    let (local, remote) = (job.local + skip, job.remote + skip as u64);
    copy_held(&job.reach, job.op, local, remote, len, nontemporal)
}

/// Copies `len` bytes between `local` and the peer's `remote` through `reach` (`op` says
/// which way), the caller holding the buffer's access entry, if it has one, for the copy.
/// Fails only when process_vm_readv/writev does.
pub(super) fn copy_held(
    reach: &Reach,
    op: Opcode,
    local: usize,
    remote: u64,
    len: usize,
    nontemporal: bool,
) -> Result<()> {
    let remote_ptr = match reach {
        Reach::Direct => remote as usize,
        Reach::Mapped {
            mapping,
            buffer_addr,
        } => mapping.base() + (remote - buffer_addr) as usize,
        Reach::ProcessVm { pid } => return process_vm(op, local, remote, *pid, len),
    };
    let (src, dst) = match op {
        Opcode::Write => (local, remote_ptr),
        Opcode::Read => (remote_ptr, local),
    };
    // SAFETY: the engine checked that `local..local+len` lies in locally registered memory
    // and `remote..remote+len` in a buffer the peer published (callers pass a job's range or
    // consecutive parts of it); `remote_ptr` maps that range (our own address space, or our
    // mapping of the peer's memfd held alive by `reach`, which the caller borrows from its
    // job). The ranges belong to different buffers or the caller asked for overlapping ones,
    // which a transfer engine, like RDMA, leaves to the caller; `copy` tolerates overlap.
    unsafe { nontemporal::copy(dst as *mut u8, src as *const u8, len, nontemporal) };
    Ok(())
}

/// Copies `len` bytes between `local` and `remote` in process `pid` (`op` says which way)
/// with process_vm_readv/writev, resuming after short copies.
pub(super) fn process_vm(
    op: Opcode,
    local: usize,
    remote: u64,
    pid: i32,
    len: usize,
) -> Result<()> {
    let mut done = 0;
    while done < len {
        let local = libc::iovec {
            iov_base: (local + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `local` lies in locally registered memory checked by the engine; the kernel
        // validates `remote` against the other process's mappings and fails with EFAULT.
        let rc = unsafe {
            match op {
                Opcode::Write => libc::process_vm_writev(pid, &local, 1, &remote, 1, 0),
                Opcode::Read => libc::process_vm_readv(pid, &local, 1, &remote, 1, 0),
            }
        };
        if rc <= 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(process_vm_error(pid, err));
        }
        done += rc as usize;
    }
    Ok(())
}

/// What a failed process_vm_readv/writev with process `pid` means for the request.
pub(super) fn process_vm_error(pid: i32, err: io::Error) -> Error {
    match err.raw_os_error() {
        Some(libc::ESRCH) => Error::PeerDisconnected {
            peer: format!("process {pid}"),
            reason: "process exited".into(),
        },
        _ => Error::io(format!("process_vm copy with process {pid}"), err),
    }
}
