//! CPU priority of the threads that move slices. A thread carrying bulk (MEDIUM or LOW) slices
//! runs at a higher nice value than one carrying HIGH slices, and a thread carrying HIGH slices
//! asks for a short scheduler slice (Linux 6.12+ lets a fair-class thread set one, and a
//! shorter slice wins wake-up preemption). So on a host whose cores are busy moving bulk
//! bytes, the threads of a HIGH slice get a core soon after they wake instead of waiting out a
//! bulk thread's turn. The engine's queues keep HIGH ahead of bulk; this keeps the operating
//! system's run queue from undoing that.
//!
//! Each thread follows the priority of what it carries, with one `sched_setattr` call per
//! change. Raising the nice value is always allowed; lowering it back needs `CAP_SYS_NICE` or a
//! raised `RLIMIT_NICE`. Without either, a thread that once carried bulk stays at the bulk nice
//! value: the HIGH connection's threads carry only HIGH slices, so they are not affected.
//! Kernels before 6.12 ignore the slice request; the nice values still apply.

use multirail_policy::qos::Priority;

/// Scheduler slice a thread asks for while it carries HIGH slices: the kernel's floor.
const HIGH_SLICE_NS: u64 = 100_000;
/// `sched_setattr` flag: leave the thread's scheduling policy as it is.
const SCHED_FLAG_KEEP_POLICY: u64 = 0x08;

/// `struct sched_attr` of `sched_setattr(2)`, first version (48 bytes).
#[repr(C)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// Nice offsets (added to the nice value a thread starts with) for HIGH, MEDIUM and LOW.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NiceTable([i32; 3]);

impl NiceTable {
    /// HIGH at the thread's own nice value, LOW `bulk` above it, MEDIUM halfway. `bulk` 0 turns
    /// the mechanism off.
    pub(crate) fn new(bulk: i32) -> NiceTable {
        NiceTable([0, bulk / 2, bulk])
    }

    /// The offset for `priority` (levels past LOW count as LOW).
    pub(crate) fn offset(&self, priority: Priority) -> i32 {
        self.0[priority.index()]
    }

    fn is_off(&self) -> bool {
        self.0 == [0; 3]
    }
}

/// Nice value of the calling thread, following the priority of the slices it carries.
pub(crate) struct ThreadNice {
    table: NiceTable,
    /// The calling thread's nice value when this was made.
    base: i32,
    applied: i32,
    /// Whether the short slice for HIGH is in force.
    short_slice: bool,
    /// Cleared when `sched_setattr` is refused where `setpriority` works.
    slices_supported: bool,
    /// Set once lowering the nice value was refused, so later calls do not retry a syscall
    /// that cannot succeed.
    cannot_lower: bool,
    tid: libc::pid_t,
    /// Ties the value to the thread it governs.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ThreadNice {
    /// Records the calling thread's nice value. Call on the thread whose nice value it governs.
    pub(crate) fn for_this_thread(table: NiceTable) -> ThreadNice {
        // SAFETY: gettid has no preconditions and cannot fail.
        let tid = unsafe { libc::gettid() };
        // SAFETY: getpriority only reads the scheduling attribute of thread `tid` (ourselves).
        // It may return -1 as a valid value; a failed call also yields -1, which is then only
        // the base our offsets start from, still a valid nice value.
        let base = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
        ThreadNice {
            table,
            base,
            applied: base,
            short_slice: false,
            slices_supported: true,
            cannot_lower: false,
            tid,
            _not_send: std::marker::PhantomData,
        }
    }

    /// Sets the thread's nice value and scheduler slice for carrying slices of `priority`, if
    /// they differ from those in force. Failures are ignored: CPU priority is an optimisation,
    /// never a condition for moving bytes.
    pub(crate) fn follow(&mut self, priority: Priority) {
        if self.table.is_off() {
            return;
        }
        let short = priority == Priority::High && self.slices_supported;
        let mut nice = (self.base + self.table.offset(priority)).min(19);
        if nice < self.applied && self.cannot_lower {
            nice = self.applied;
        }
        if (nice, short) == (self.applied, self.short_slice) {
            return;
        }
        if self.slices_supported {
            let attr = SchedAttr {
                size: std::mem::size_of::<SchedAttr>() as u32,
                policy: 0,
                flags: SCHED_FLAG_KEEP_POLICY,
                nice,
                priority: 0,
                runtime: if short { HIGH_SLICE_NS } else { 0 },
                deadline: 0,
                period: 0,
            };
            // SAFETY: sched_setattr reads `attr`, a live, fully initialised sched_attr whose
            // `size` field gives its length, and changes only the scheduling attributes of
            // thread `tid`, the thread that made this value (it is not Send).
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_sched_setattr,
                    self.tid,
                    &attr as *const SchedAttr,
                    0u32,
                )
            };
            if rc == 0 {
                self.applied = nice;
                self.short_slice = short;
                return;
            }
            // Refused: lowering the nice value without the right (then setpriority below is
            // refused too), or a kernel or sandbox without sched_setattr.
        }
        // SAFETY: setpriority changes only the nice value of thread `tid`, the thread that made
        // this value, and touches no memory of ours.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, self.tid as libc::id_t, nice) };
        if rc == 0 {
            self.applied = nice;
            self.slices_supported = false;
            self.short_slice = false;
        } else if nice < self.applied {
            self.cannot_lower = true;
        }
    }

    /// The nice value in force.
    #[cfg(test)]
    fn applied(&self) -> i32 {
        self.applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's requested scheduler slice (`sched_runtime`).
    fn slice_ns() -> u64 {
        let mut attr = SchedAttr {
            size: 0,
            policy: 0,
            flags: 0,
            nice: 0,
            priority: 0,
            runtime: 0,
            deadline: 0,
            period: 0,
        };
        // SAFETY: sched_getattr writes at most `size` (48) bytes into `attr`, which is that big.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                0,
                &mut attr as *mut SchedAttr,
                std::mem::size_of::<SchedAttr>() as u32,
                0u32,
            )
        };
        assert_eq!(rc, 0);
        attr.runtime
    }

    fn current() -> i32 {
        // SAFETY: reads this thread's own nice value.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    #[test]
    fn bulk_raises_the_threads_nice_value_and_high_keeps_it_where_it_started() {
        std::thread::spawn(|| {
            let base = current();
            let mut n = ThreadNice::for_this_thread(NiceTable::new(10));
            n.follow(Priority::High);
            assert_eq!(current(), base);
            if n.short_slice {
                assert_eq!(slice_ns(), HIGH_SLICE_NS);
            }
            n.follow(Priority::Low);
            assert_eq!(current(), (base + 10).min(19));
            assert_eq!(n.applied(), (base + 10).min(19));
            n.follow(Priority::Medium);
            // MEDIUM sits halfway, where lowering is allowed (root, or a raised RLIMIT_NICE);
            // otherwise the thread stays at the bulk value and stops asking.
            assert!(current() == (base + 5).min(19) || current() == (base + 10).min(19));
            assert_eq!(n.applied(), current());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn an_offset_of_zero_leaves_the_thread_alone() {
        std::thread::spawn(|| {
            let base = current();
            let mut n = ThreadNice::for_this_thread(NiceTable::new(0));
            n.follow(Priority::Low);
            assert_eq!(current(), base);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn levels_past_low_count_as_low() {
        let t = NiceTable::new(10);
        assert_eq!(t.offset(Priority::High), 0);
        assert_eq!(t.offset(Priority::Medium), 5);
        assert_eq!(t.offset(Priority::Low), 10);
    }
}
