//! Inline copies with process_vm_readv/writev, gathered so that many share one system call.
//!
//! Each call pays for finding and permission-checking the other process and for pinning its
//! pages, whatever it copies: at 4 KiB a request spent two thirds of its time there, one call
//! each (`perf` of a vLLM-shaped post of 4,096 scattered blocks). The calls take up to
//! [`MAX_IOVECS`] ranges on each side, so the small requests of one post to one process in one
//! direction are copied together, however scattered their addresses.

use super::*;

/// Most ranges one call takes on each side (the kernel's `UIO_MAXIOV`).
pub(super) const MAX_IOVECS: usize = 1024;
/// Most bytes one call copies: the requests it carries complete together once it returns, so
/// a call is kept short enough that the first of them does not wait long for the last.
pub(super) const MAX_GATHER_BYTES: usize = 4 << 20;

/// Small requests to one process in one direction, copied by one call when
/// [`flush`](VmGather::flush)ed (or when the next one would not fit).
pub(super) struct VmGather {
    pid: i32,
    op: Opcode,
    bytes: usize,
    /// The requests' jobs, each whole, and their priorities (for the tally).
    jobs: Vec<(CopyJob, Priority)>,
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
}

impl VmGather {
    pub(super) fn new() -> VmGather {
        VmGather {
            pid: 0,
            op: Opcode::Write,
            bytes: 0,
            jobs: Vec::new(),
            local: Vec::new(),
            remote: Vec::new(),
        }
    }

    /// Adds `job`, a whole request reached in process `pid`, copying what was gathered first
    /// when the job goes to another process or the other way, or would not fit in the call.
    /// The job's task counts one more part from now; it is done, with the copy's outcome, when
    /// the call that carries it returns. Bytes copied go into `tally`, failures into `rail`.
    pub(super) fn push(
        &mut self,
        pid: i32,
        job: CopyJob,
        priority: Priority,
        tally: &mut Tally,
        rail: &RailCounters,
    ) {
        if !self.jobs.is_empty()
            && (pid != self.pid
                || job.op != self.op
                || self.jobs.len() == MAX_IOVECS
                || self.bytes + job.len > MAX_GATHER_BYTES)
        {
            self.flush(tally, rail);
        }
        self.pid = pid;
        self.op = job.op;
        self.bytes += job.len;
        job.task.add_parts(1);
        self.jobs.push((job, priority));
    }

    /// Copies what was gathered, in one call when it all goes through, and completes each
    /// request with its own outcome: after a call that stopped short (a range the other
    /// process does not map, or an interruption), the requests it did not finish are copied
    /// one by one from where it stopped, so only those that fail on their own fail.
    pub(super) fn flush(&mut self, tally: &mut Tally, rail: &RailCounters) {
        if self.jobs.is_empty() {
            return;
        }
        // Each job holds its buffer's access entry across the call (and its own call after a
        // short one); a job whose buffer the peer unregistered fails here and is not copied.
        self.jobs
            .retain(|(job, _)| match job.access.as_ref().map(Access::enter) {
                None | Some(Ok(())) => true,
                Some(Err(e)) => {
                    rail.record_error();
                    job.task.part_done(Err(e));
                    false
                }
            });
        if self.jobs.is_empty() {
            self.bytes = 0;
            return;
        }
        self.local.clear();
        self.remote.clear();
        for (e, _) in &self.jobs {
            self.local.push(libc::iovec {
                iov_base: e.local as *mut libc::c_void,
                iov_len: e.len,
            });
            self.remote.push(libc::iovec {
                iov_base: e.remote as usize as *mut libc::c_void,
                iov_len: e.len,
            });
        }
        let n = self.jobs.len() as libc::c_ulong;
        // SAFETY: every local range lies in locally registered memory the engine checked and
        // its request keeps registered until it completes (below); the iovec arrays hold `n`
        // entries each and outlive the call. The kernel validates the remote ranges against
        // the other process's mappings.
        let rc = unsafe {
            match self.op {
                Opcode::Write => libc::process_vm_writev(
                    self.pid,
                    self.local.as_ptr(),
                    n,
                    self.remote.as_ptr(),
                    n,
                    0,
                ),
                Opcode::Read => libc::process_vm_readv(
                    self.pid,
                    self.local.as_ptr(),
                    n,
                    self.remote.as_ptr(),
                    n,
                    0,
                ),
            }
        };
        // Only a vanished process fails everything at once; any other failure is left to the
        // requests' own calls, which name the one at fault.
        let (copied, gone) = if rc >= 0 {
            (rc as usize, None)
        } else {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ESRCH) => (0, Some(process_vm_error(self.pid, err))),
                _ => (0, None),
            }
        };
        let mut start = 0usize;
        let mut finished = Finished::default();
        for (job, priority) in self.jobs.drain(..) {
            let outcome = if start + job.len <= copied {
                Ok(())
            } else if let Some(err) = &gone {
                Err(err.clone())
            } else {
                let from = copied.saturating_sub(start);
                process_vm(
                    job.op,
                    job.local + from,
                    job.remote + from as u64,
                    self.pid,
                    job.len - from,
                )
            };
            start += job.len;
            if let Some(access) = &job.access {
                access.leave();
            }
            match &outcome {
                Ok(()) => tally.add(priority, job.len as u64, job.slices),
                Err(_) => rail.record_error(),
            }
            finished.part_done(&job.task, outcome);
        }
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{Batch, Status};
    use multirail_policy::qos::HIGH;

    fn self_pid() -> i32 {
        std::process::id() as i32
    }

    /// Gathers one request per `(local, remote, len)` of `ranges` into this very process,
    /// flushes, and returns each request's status once its posting part is released, with
    /// the counters.
    fn copy_all(
        op: Opcode,
        pid: i32,
        ranges: &[(usize, u64, usize)],
    ) -> (Vec<Status>, Tally, Arc<RailCounters>) {
        let stats = TrafficStats::default();
        let rail = stats.rail("shm");
        let batch = Batch::new(1, ranges.len());
        let tasks = batch.add_tasks(ranges.len()).unwrap();
        let (mut gather, mut tally) = (VmGather::new(), Tally::default());
        for (&(local, remote, len), task) in ranges.iter().zip(&tasks) {
            let job = CopyJob {
                op,
                local,
                remote,
                len,
                slices: 1,
                reach: Reach::ProcessVm { pid },
                access: None,
                batch: 1,
                task: task.clone(),
                then: Vec::new(),
            };
            gather.push(pid, job, HIGH, &mut tally, &rail);
        }
        gather.flush(&mut tally, &rail);
        for task in &tasks {
            task.part_done(Ok(()));
        }
        let statuses = (0..ranges.len())
            .map(|i| batch.status(i).unwrap())
            .collect();
        (statuses, tally, rail)
    }

    #[test]
    fn scattered_requests_to_one_process_land_whole_over_several_calls() {
        // More requests than one call takes, of uneven sizes, written to scattered places.
        let count = MAX_IOVECS * 2 + 77;
        let sizes: Vec<usize> = (0..count).map(|i| 1 + (i * 37) % 5000).collect();
        let total: usize = sizes.iter().sum();
        let src: Vec<u8> = (0..total).map(|i| (i * 31 + i / 7) as u8).collect();
        let mut dst = vec![0u8; total];
        // Request i lands where request count-1-i's bytes would have gone in order.
        let mut offsets = Vec::with_capacity(count);
        let mut at = 0;
        for &len in &sizes {
            offsets.push(at);
            at += len;
        }
        let mut ranges = Vec::with_capacity(count);
        let mut place = total;
        for (i, &len) in sizes.iter().enumerate() {
            place -= len;
            ranges.push((
                src.as_ptr() as usize + offsets[i],
                dst.as_mut_ptr() as u64 + place as u64,
                len,
            ));
        }
        let (statuses, tally, _) = copy_all(Opcode::Write, self_pid(), &ranges);
        assert!(statuses.iter().all(Status::is_completed), "{statuses:?}");
        assert_eq!(tally.bytes[HIGH.index()], total as u64);
        assert_eq!(tally.slices, count as u64);
        let mut place = total;
        for (i, &len) in sizes.iter().enumerate() {
            place -= len;
            assert_eq!(
                &dst[place..place + len],
                &src[offsets[i]..offsets[i] + len],
                "request {i}"
            );
        }
        // And back: read every piece into a fresh buffer from where it landed.
        let mut back = vec![0u8; total];
        let reads: Vec<_> = ranges
            .iter()
            .zip(&offsets)
            .map(|(&(_, remote, len), &off)| (back.as_mut_ptr() as usize + off, remote, len))
            .collect();
        let (statuses, _, _) = copy_all(Opcode::Read, self_pid(), &reads);
        assert!(statuses.iter().all(Status::is_completed));
        assert!(back == src);
    }

    #[test]
    fn only_the_request_whose_range_is_not_mapped_fails() {
        // A page reserved with no access: the kernel refuses to copy into it. It stays mapped
        // until the end, so no other test's allocation can land at that address meanwhile
        // (a page merely unmapped could be reused by one running at the same time).
        // SAFETY: a fresh anonymous private mapping of one page that nothing else uses; it is
        // unmapped once, at the end of the test.
        let hole = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            p as u64
        };
        let src = vec![5u8; 4 * 1024];
        let mut dst = vec![0u8; 4 * 1024];
        let base = dst.as_mut_ptr() as u64;
        let s = src.as_ptr() as usize;
        let ranges = [
            (s, base, 1024),
            (s + 1024, hole, 1024),
            (s + 2048, base + 2048, 1024),
            (s + 3072, base + 3072, 1024),
        ];
        let (statuses, tally, rail) = copy_all(Opcode::Write, self_pid(), &ranges);
        assert!(statuses[0].is_completed());
        assert!(
            matches!(&statuses[1], Status::Failed(Error::Io { .. })),
            "{:?}",
            statuses[1]
        );
        assert!(statuses[2].is_completed() && statuses[3].is_completed());
        assert_eq!(&dst[..1024], &src[..1024]);
        assert_eq!(
            &dst[1024..2048],
            &[0u8; 1024][..],
            "nothing landed for the refused one"
        );
        assert_eq!(&dst[2048..], &src[2048..]);
        assert_eq!(tally.bytes[HIGH.index()], 3 * 1024);
        drop(rail);
        // SAFETY: the page mapped above, unmapped once; nothing refers to it any more.
        assert_eq!(unsafe { libc::munmap(hole as *mut libc::c_void, 4096) }, 0);
    }

    #[test]
    fn a_process_that_exited_fails_every_request_as_disconnected() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        child.wait().unwrap();
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            // The pid went to another process already: nothing to test with it.
            return;
        }
        let src = [1u8; 64];
        let ranges = [(src.as_ptr() as usize, 0x1000_0000, 64); 3];
        let (statuses, tally, _) = copy_all(Opcode::Write, pid, &ranges);
        for s in &statuses {
            assert!(
                matches!(s, Status::Failed(Error::PeerDisconnected { .. })),
                "{s:?}"
            );
        }
        assert_eq!(tally.slices, 0);
    }
}
