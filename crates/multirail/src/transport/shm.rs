//! The `shm` transport: same-host transfers by plain copies. A target inside a buffer the peer
//! allocated is reached through this process's mapping of the peer's memfd, so the peer does no
//! work. Other registered memory of the peer is reached with process_vm_readv/writev. Copies run
//! on a pool of worker threads; a request is split into at most one contiguous run of slices per
//! worker, since a copy gains nothing from finer pieces and each piece costs a hand-off.

use std::io;
use std::sync::Arc;
use std::thread;

use crossbeam::channel::{self, Receiver, Sender};
use multirail_policy::slicing::SlicePlan;

use crate::batch::Task;
use crate::error::{Error, Result};
use crate::memory::PeerMapping;
use crate::peer::Peer;
use crate::segment::BufferDescriptor;
use crate::stats::{RailCounters, TrafficStats};
use crate::transport::{Opcode, Prepared, Transport};

/// How a worker reaches the peer's bytes.
#[derive(Clone)]
enum Reach {
    /// Same process: the remote address is ours.
    Direct,
    /// Through our mapping of the peer's memfd; `base` corresponds to the buffer's start.
    Mapped {
        mapping: Arc<PeerMapping>,
        buffer_addr: u64,
    },
    /// With process_vm_readv/writev into process `pid`.
    ProcessVm { pid: i32 },
}

struct CopyJob {
    op: Opcode,
    local: usize,
    remote: u64,
    len: usize,
    slices: u64,
    reach: Reach,
    task: Arc<Task>,
}

/// The shared-memory transport and its copy workers.
pub(crate) struct ShmTransport {
    tx: Sender<CopyJob>,
    workers: usize,
    /// `transports.shm.process_vm`: reach registered memory of same-host peers with
    /// process_vm_readv/writev.
    process_vm: bool,
    rail: Arc<RailCounters>,
}

impl ShmTransport {
    /// Starts `workers` copy threads.
    pub(crate) fn new(workers: usize, process_vm: bool, stats: &TrafficStats) -> Result<Self> {
        let (tx, rx) = channel::unbounded::<CopyJob>();
        let rail = stats.rail("shm");
        for i in 0..workers {
            let (rx, rail) = (rx.clone(), rail.clone());
            thread::Builder::new()
                .name(format!("mr-shm-{i}"))
                .spawn(move || copy_worker(rx, rail))
                .map_err(|e| Error::io("spawning shm worker", e))?;
        }
        Ok(ShmTransport {
            tx,
            workers,
            process_vm,
            rail,
        })
    }

    fn reach(&self, peer: &Peer, buffer: &BufferDescriptor) -> Result<Reach> {
        if !peer.same_host {
            return Err(Error::TransportUnavailable {
                transport: "shm",
                reason: format!("segment {} is on another host", peer.name),
            });
        }
        if peer.same_process {
            return Ok(Reach::Direct);
        }
        if let Some(handle) = &buffer.shm {
            let mut maps = peer.mappings.lock().expect("peer poisoned");
            if let Some(m) = maps.get(&(buffer.addr, buffer.key)) {
                return Ok(Reach::Mapped {
                    mapping: m.clone(),
                    buffer_addr: buffer.addr,
                });
            }
            let m = Arc::new(PeerMapping::open(handle, buffer.len as usize)?);
            maps.insert((buffer.addr, buffer.key), m.clone());
            return Ok(Reach::Mapped {
                mapping: m,
                buffer_addr: buffer.addr,
            });
        }
        if !self.process_vm {
            return Err(Error::TransportUnavailable {
                transport: "shm",
                reason: "the buffer is registered memory and transports.shm.process_vm is off"
                    .into(),
            });
        }
        let pid = peer.descriptor().pid as i32;
        let allowed = *peer
            .process_vm_allowed
            .get_or_init(|| probe_process_vm(pid, buffer.addr));
        if allowed {
            Ok(Reach::ProcessVm { pid })
        } else {
            Err(Error::TransportUnavailable {
                transport: "shm",
                reason: format!("the kernel refuses process_vm_readv on process {pid}"),
            })
        }
    }
}

/// Tries a one-byte process_vm_readv; EPERM (ptrace restrictions, other users) means no.
fn probe_process_vm(pid: i32, addr: u64) -> bool {
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

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn prepare(&self, peer: &Peer, buffer: &BufferDescriptor) -> Result<()> {
        self.reach(peer, buffer).map(|_| ())
    }

    fn post(&self, peer: &Peer, req: Prepared, plan: &SlicePlan) {
        let reach = match self.reach(peer, &req.buffer) {
            Ok(r) => r,
            Err(e) => {
                req.fail(e);
                return;
            }
        };
        let Some(slices) = req.slices(plan) else {
            return;
        };
        let count = slices.len();
        let jobs = count.min(self.workers).max(1);
        req.task.add_parts(jobs as u32);
        for j in 0..jobs {
            let (first, last) = (j * count / jobs, (j + 1) * count / jobs - 1);
            let start = slices.clone().nth(first).expect("index below count");
            let end = slices.clone().nth(last).expect("index below count");
            let offset = start.offset;
            let len = end.offset + end.length - offset;
            let job = CopyJob {
                op: req.op,
                local: req.local + offset as usize,
                remote: req.remote + offset,
                len: len as usize,
                slices: (last - first + 1) as u64,
                reach: reach.clone(),
                task: req.task.clone(),
            };
            if let Err(channel::SendError(job)) = self.tx.send(job) {
                self.rail.record_error();
                job.task.part_done(Err(Error::TransportUnavailable {
                    transport: "shm",
                    reason: "copy workers have stopped".into(),
                }));
            }
        }
    }
}

fn copy_worker(rx: Receiver<CopyJob>, rail: Arc<RailCounters>) {
    while let Ok(job) = rx.recv() {
        let outcome = run(&job);
        match &outcome {
            Ok(()) => rail.record(job.len as u64, job.slices),
            Err(_) => rail.record_error(),
        }
        job.task.part_done(outcome);
    }
}

fn run(job: &CopyJob) -> Result<()> {
    let remote_ptr = match &job.reach {
        Reach::Direct => job.remote as usize,
        Reach::Mapped {
            mapping,
            buffer_addr,
        } => mapping.base() + (job.remote - buffer_addr) as usize,
        Reach::ProcessVm { pid } => return process_vm(job, *pid),
    };
    let (src, dst) = match job.op {
        Opcode::Write => (job.local, remote_ptr),
        Opcode::Read => (remote_ptr, job.local),
    };
    // SAFETY: the engine checked that `local..local+len` lies in locally registered memory and
    // `remote..remote+len` in a buffer the peer published; `remote_ptr` maps that range (our
    // own address space, or our mapping of the peer's memfd held alive by `job.reach`). The
    // ranges belong to different buffers or the caller asked for overlapping ones, which a
    // transfer engine, like RDMA, leaves to the caller; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, job.len) };
    Ok(())
}

fn process_vm(job: &CopyJob, pid: i32) -> Result<()> {
    let mut done = 0usize;
    while done < job.len {
        let local = libc::iovec {
            iov_base: (job.local + done) as *mut libc::c_void,
            iov_len: job.len - done,
        };
        let remote = libc::iovec {
            iov_base: (job.remote as usize + done) as *mut libc::c_void,
            iov_len: job.len - done,
        };
        // SAFETY: `local` lies in locally registered memory checked by the engine; the kernel
        // validates `remote` against the other process's mappings and fails with EFAULT.
        let rc = unsafe {
            match job.op {
                Opcode::Write => libc::process_vm_writev(pid, &local, 1, &remote, 1, 0),
                Opcode::Read => libc::process_vm_readv(pid, &local, 1, &remote, 1, 0),
            }
        };
        if rc <= 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(match err.raw_os_error() {
                Some(libc::ESRCH) => Error::PeerDisconnected {
                    peer: format!("process {pid}"),
                    reason: "process exited".into(),
                },
                _ => Error::io(format!("process_vm copy with process {pid}"), err),
            });
        }
        done += rc as usize;
    }
    Ok(())
}
