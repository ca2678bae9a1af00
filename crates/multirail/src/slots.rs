//! Global QoS time slots shared by the processes of a host through a POSIX shared-memory object
//! (`shared_quota_shm_path`), laid out like TENT's `SharedHeader`: magic number, format version,
//! current slot and a process-shared robust mutex, followed by one entry per attached process
//! publishing how many HIGH and MEDIUM slices it has queued and when it last posted one (for
//! work-conserving slots, and so a process's bulk makes room for another's HIGH stream).
//!
//! All processes agree on the current slot because each computes it from the host's monotonic
//! clock, the epoch the creating process wrote and the slot length in the header: nobody has
//! to wake up every slot to rotate it (each wake-up on a busy host can delay a HIGH slice). The
//! mutex serializes registration and repair; each attached process's slot thread, every
//! 5 ms, writes the slot in force into `current_slot` (for tools that read it), sums what
//! the processes published and clears the entries of dead ones. A stale object (wrong magic or
//! version, a mutex whose owner died, entries of dead processes) is repaired, not fatal.

use std::cell::UnsafeCell;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use multirail_policy::qos::{self, Priority};

use crate::error::{Error, Result};

/// "MRSLOTS1".
const MAGIC: u64 = 0x4d52_534c_4f54_5331;
const VERSION: i32 = 3;
/// How long after its last posted slice a process's stream of a priority still counts as work:
/// a stream whose requests never queue is still traffic to make room for (HIGH, MEDIUM) or
/// busy cores to leave alone (MEDIUM, LOW).
pub const ACTIVE_NS: u64 = 10_000_000;
/// A process republishes when it last posted only once this much later, so a busy stream
/// does not write the shared line for every slice.
const POSTED_RESOLUTION_NS: u64 = 1_000_000;
/// How often the slot thread sums what the attached processes published: the lag with which
/// one process sees another's work appear. Each wake-up can delay a HIGH slice in flight on a
/// busy host, so this is well above the slot length.
const REFRESH: Duration = Duration::from_millis(5);
/// Processes that can attach to one object at once.
pub const MAX_PROCESSES: usize = 64;

#[repr(C)]
struct ProcEntry {
    pid: AtomicU32,
    _pad: u32,
    queued_high: AtomicU64,
    queued_medium: AtomicU64,
    /// CLOCK_MONOTONIC nanoseconds at which the process last posted a HIGH, a MEDIUM, a LOW
    /// slice.
    posted_ns: [AtomicU64; 3],
}

#[repr(C)]
struct SharedHeader {
    magic: AtomicU64,
    version: AtomicI32,
    current_slot: AtomicI32,
    mutex: UnsafeCell<libc::pthread_mutex_t>,
    /// CLOCK_MONOTONIC (host-wide) nanoseconds at which slot 0 first began: slot `k` of the
    /// rotation covers `epoch_ns + k * interval_ns` onwards, so every process computes the slot
    /// in force from the clock, and none has to wake up to rotate it.
    epoch_ns: AtomicU64,
    /// Slot length, set by the process that created the object; later ones follow it, so all
    /// agree even when their configurations differ.
    interval_ns: AtomicU64,
    procs: [ProcEntry; MAX_PROCESSES],
}

/// CLOCK_MONOTONIC now, nanoseconds: one clock for every process on the host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn process_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// This process's attachment to the shared slot object.
pub struct GlobalSlots {
    header: *mut SharedHeader,
    entry: usize,
    interval_ns: u64,
    work_conserving: bool,
    /// HIGH and MEDIUM slices queued by every attached process, summed by the rotation thread.
    totals: [AtomicU64; 2],
    /// Whether some attached process posted a HIGH, a MEDIUM, a LOW slice within
    /// [`ACTIVE_NS`], as of the rotation thread's last look.
    active: [AtomicBool; 3],
    stop: AtomicBool,
}

// SAFETY: the header lives in a shared mapping that stays mapped for the life of this value;
// every field is accessed through atomics or the process-shared mutex.
unsafe impl Send for GlobalSlots {}
// SAFETY: as above; no `&mut` to the mapping is ever handed out.
unsafe impl Sync for GlobalSlots {}

/// Holds the shared mutex; unlocks on drop.
struct Locked<'a>(&'a SharedHeader);

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: we hold the lock (taken in `lock`).
        unsafe { libc::pthread_mutex_unlock(self.0.mutex.get()) };
    }
}

fn init_mutex(h: &SharedHeader) -> std::io::Result<()> {
    // SAFETY: the attribute object lives on our stack and is destroyed after use; the mutex
    // memory belongs to the mapping and nobody can be using it, since the object is being
    // (re)initialized under the file lock.
    unsafe {
        let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
        libc::pthread_mutexattr_init(&mut attr);
        libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
        libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
        let rc = libc::pthread_mutex_init(h.mutex.get(), &attr);
        libc::pthread_mutexattr_destroy(&mut attr);
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
    }
    Ok(())
}

fn initialize(h: &SharedHeader, interval_ns: u64) -> std::io::Result<()> {
    h.magic.store(0, Ordering::Release);
    for p in &h.procs {
        p.pid.store(0, Ordering::Relaxed);
        p.queued_high.store(0, Ordering::Relaxed);
        p.queued_medium.store(0, Ordering::Relaxed);
        p.posted_ns
            .iter()
            .for_each(|t| t.store(0, Ordering::Relaxed));
    }
    init_mutex(h)?;
    h.current_slot.store(0, Ordering::Relaxed);
    h.epoch_ns.store(monotonic_ns(), Ordering::Relaxed);
    h.interval_ns.store(interval_ns, Ordering::Relaxed);
    h.version.store(VERSION, Ordering::Relaxed);
    h.magic.store(MAGIC, Ordering::Release);
    Ok(())
}

/// Takes the shared mutex, repairing it if its previous owner died holding it.
fn lock(h: &SharedHeader) -> std::io::Result<Locked<'_>> {
    // SAFETY: the mutex was initialized (magic checked at attach) and lives in the mapping.
    let rc = unsafe { libc::pthread_mutex_lock(h.mutex.get()) };
    match rc {
        0 => Ok(Locked(h)),
        libc::EOWNERDEAD => {
            tracing::warn!("a process died holding the QoS slot mutex; repairing it");
            // SAFETY: we now own the inconsistent mutex; marking it consistent is exactly what
            // EOWNERDEAD asks of the new owner. The state it guards is atomics that stay valid.
            unsafe { libc::pthread_mutex_consistent(h.mutex.get()) };
            Ok(Locked(h))
        }
        rc => Err(std::io::Error::from_raw_os_error(rc)),
    }
}

impl GlobalSlots {
    /// Attaches to (creating or repairing as needed) the shared object at `path` (a POSIX
    /// shared-memory name such as `/mooncake_rdma_slots`), registers this process and starts the
    /// rotation thread. Fails when the object cannot be opened or mapped, or when
    /// [`MAX_PROCESSES`] live processes are already attached.
    pub fn attach(path: &str, interval_ns: u64, work_conserving: bool) -> Result<Arc<GlobalSlots>> {
        let key = "transports.rdma.shared_quota_shm_path";
        let bad = |m: String| Error::Config(crate::config::ConfigError::new(key, m));
        let name = if path.starts_with('/') {
            path.to_owned()
        } else {
            format!("/{path}")
        };
        if name[1..].contains('/') || name.len() < 2 {
            return Err(bad(format!(
                "{path:?} is not a shared-memory name like /mooncake_rdma_slots"
            )));
        }
        let cname =
            CString::new(name.clone()).map_err(|_| bad(format!("{path:?} contains a NUL byte")))?;
        // SAFETY: plain FFI with a valid C string.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o600) };
        if fd < 0 {
            return Err(Error::io(
                format!("shm_open {name}"),
                std::io::Error::last_os_error(),
            ));
        }
        let size = std::mem::size_of::<SharedHeader>();
        // SAFETY: `fd` is ours; flock serializes initialization between processes attaching at
        // the same moment; ftruncate only grows a too-small (new or stale) object.
        let ptr = unsafe {
            libc::flock(fd, libc::LOCK_EX);
            let mut st: libc::stat = std::mem::zeroed();
            libc::fstat(fd, &mut st);
            if (st.st_size as usize) < size && libc::ftruncate(fd, size as libc::off_t) != 0 {
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                return Err(Error::io(format!("sizing {name}"), e));
            }
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(fd) };
            return Err(Error::io(format!("mapping {name}"), e));
        }
        let mut slots = GlobalSlots {
            header: ptr as *mut SharedHeader,
            entry: usize::MAX,
            interval_ns: interval_ns.max(1),
            work_conserving,
            totals: Default::default(),
            active: Default::default(),
            stop: AtomicBool::new(false),
        };
        let result = slots.validate_and_register(&name);
        // SAFETY: unlocking and closing our own descriptor; the mapping stays valid without it.
        unsafe {
            libc::flock(fd, libc::LOCK_UN);
            libc::close(fd);
        }
        slots.entry = result?;
        let shared = slots.header().interval_ns.load(Ordering::Acquire);
        if shared != slots.interval_ns {
            if shared > 0 {
                tracing::warn!(
                    name,
                    ours_ms = slots.interval_ns as f64 / 1e6,
                    shared_ms = shared as f64 / 1e6,
                    "slot_rotation_interval_ms differs from the one of the process that created \
                     the QoS slot object; following the object's, so all processes agree"
                );
            }
            slots.interval_ns = shared.max(1);
        }
        let slots = Arc::new(slots);
        let rotor = Arc::downgrade(&slots);
        thread::Builder::new()
            .name("mr-qos-slots".into())
            .spawn(move || loop {
                let Some(s) = rotor.upgrade() else { return };
                if s.stop.load(Ordering::Acquire) {
                    return;
                }
                s.tick();
                drop(s);
                thread::sleep(REFRESH);
            })
            .map_err(|e| Error::io("spawning the QoS slot thread", e))?;
        Ok(slots)
    }

    fn header(&self) -> &SharedHeader {
        // SAFETY: mapped in `attach`, unmapped only in Drop.
        unsafe { &*self.header }
    }

    fn validate_and_register(&self, name: &str) -> Result<usize> {
        let h = self.header();
        let io = |e| Error::io(format!("QoS slot object {name}"), e);
        if h.magic.load(Ordering::Acquire) != MAGIC || h.version.load(Ordering::Acquire) != VERSION
        {
            if h.magic.load(Ordering::Acquire) != 0 {
                tracing::warn!(
                    name,
                    "QoS slot object has a foreign magic number or version; reinitializing it"
                );
            }
            initialize(h, self.interval_ns).map_err(io)?;
        }
        let _g = match lock(h) {
            Ok(g) => g,
            Err(e) if e.raw_os_error() == Some(libc::ENOTRECOVERABLE) => {
                tracing::warn!(
                    name,
                    "QoS slot mutex is unrecoverable; reinitializing the object"
                );
                initialize(h, self.interval_ns).map_err(io)?;
                lock(h).map_err(io)?
            }
            Err(e) => return Err(io(e)),
        };
        let me = std::process::id();
        for (i, p) in h.procs.iter().enumerate() {
            let pid = p.pid.load(Ordering::Acquire);
            if pid == 0 || pid == me || !process_alive(pid) {
                p.queued_high.store(0, Ordering::Relaxed);
                p.queued_medium.store(0, Ordering::Relaxed);
                p.posted_ns
                    .iter()
                    .for_each(|t| t.store(0, Ordering::Relaxed));
                p.pid.store(me, Ordering::Release);
                return Ok(i);
            }
        }
        Err(Error::TransportUnavailable {
            transport: "qos",
            reason: format!("{MAX_PROCESSES} live processes already share {name}"),
        })
    }

    /// Publishes the slot in force in the header (for tools that read it), refreshes the
    /// totals and clears entries of dead processes.
    fn tick(&self) {
        let h = self.header();
        let now = monotonic_ns();
        h.current_slot
            .store(i32::from(self.current_slot()), Ordering::Relaxed);
        let (mut high, mut medium) = (0, 0);
        let mut active = [false; 3];
        for p in &h.procs {
            let pid = p.pid.load(Ordering::Acquire);
            if pid == 0 {
                continue;
            }
            if !process_alive(pid) {
                // A crashed process's counts would hold back everyone forever.
                if p.pid
                    .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    p.queued_high.store(0, Ordering::Relaxed);
                    p.queued_medium.store(0, Ordering::Relaxed);
                    p.posted_ns
                        .iter()
                        .for_each(|t| t.store(0, Ordering::Relaxed));
                }
                continue;
            }
            high += p.queued_high.load(Ordering::Relaxed);
            medium += p.queued_medium.load(Ordering::Relaxed);
            for (a, t) in active.iter_mut().zip(&p.posted_ns) {
                let t = t.load(Ordering::Relaxed);
                *a |= t > 0 && now.saturating_sub(t) < ACTIVE_NS;
            }
        }
        self.totals[0].store(high, Ordering::Relaxed);
        self.totals[1].store(medium, Ordering::Relaxed);
        for (a, now_active) in self.active.iter().zip(active) {
            a.store(now_active, Ordering::Relaxed);
        }
    }

    /// The slot in force: 0 admits HIGH, 1 HIGH and MEDIUM, 2 everything. Computed from the
    /// host's monotonic clock, the object's epoch and its slot length, so every attached
    /// process gets the same answer at the same moment.
    pub fn current_slot(&self) -> u8 {
        let epoch = self.header().epoch_ns.load(Ordering::Acquire);
        let elapsed = monotonic_ns().saturating_sub(epoch);
        ((elapsed / self.interval_ns) % 3) as u8
    }

    /// Time until slot `slot` next begins (a whole rotation away when it is in force now).
    pub fn until_slot(&self, slot: u8) -> Duration {
        let epoch = self.header().epoch_ns.load(Ordering::Acquire);
        let now = monotonic_ns();
        let index = now.saturating_sub(epoch) / self.interval_ns;
        let ahead = (u64::from(slot) + 3 - index % 3) % 3;
        let next = index + if ahead == 0 { 3 } else { ahead };
        Duration::from_nanos((epoch + next * self.interval_ns).saturating_sub(now))
    }

    /// Publishes how many HIGH and MEDIUM slices this process has queued.
    pub fn publish_queued(&self, high: u64, medium: u64) {
        let e = &self.header().procs[self.entry];
        e.queued_high.store(high, Ordering::Relaxed);
        e.queued_medium.store(medium, Ordering::Relaxed);
    }

    /// HIGH and MEDIUM slices queued by every attached process, as of the last tick.
    pub fn queued_totals(&self) -> [u64; 2] {
        [
            self.totals[0].load(Ordering::Relaxed),
            self.totals[1].load(Ordering::Relaxed),
        ]
    }

    /// Records that this process posted a slice of `priority` at `now_ns` (CLOCK_MONOTONIC),
    /// so other processes see its HIGH or MEDIUM stream as work, and its MEDIUM or LOW stream
    /// as bulk keeping the host's cores busy.
    pub fn note_posted(&self, priority: Priority, now_ns: u64) {
        let Some(t) = self.header().procs[self.entry]
            .posted_ns
            .get(priority.index())
        else {
            return;
        };
        if now_ns.saturating_sub(t.load(Ordering::Relaxed)) >= POSTED_RESOLUTION_NS {
            t.store(now_ns, Ordering::Relaxed);
        }
    }

    /// Whether some attached process (this one included) has `priority` work: slices queued,
    /// or one posted within [`ACTIVE_NS`], as of the rotation thread's last look. Always false
    /// for LOW, which nothing makes room for.
    pub fn has_work(&self, priority: Priority) -> bool {
        let p = priority.index();
        p < 2
            && (self.totals[p].load(Ordering::Relaxed) > 0
                || self.active[p].load(Ordering::Relaxed))
    }

    /// Whether some attached process (this one included) posted a MEDIUM or LOW slice within
    /// [`ACTIVE_NS`], as of the rotation thread's last look.
    pub fn bulk_active(&self) -> bool {
        self.active[1].load(Ordering::Relaxed) || self.active[2].load(Ordering::Relaxed)
    }

    /// Whether `priority` may post now. Work-conserving slots admit an excluded priority when
    /// no process has work of the priorities above it (see [`GlobalSlots::has_work`]).
    pub fn admits(&self, priority: Priority) -> bool {
        let work = [
            self.has_work(Priority::High) as u64,
            self.has_work(Priority::Medium) as u64,
        ];
        qos::admits(self.current_slot(), priority, work, self.work_conserving)
    }

    /// Processes attached now.
    pub fn attached(&self) -> Vec<u32> {
        self.header()
            .procs
            .iter()
            .map(|p| p.pid.load(Ordering::Acquire))
            .filter(|&p| p != 0)
            .collect()
    }
}

impl Drop for GlobalSlots {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if self.entry < MAX_PROCESSES {
            let e = &self.header().procs[self.entry];
            e.queued_high.store(0, Ordering::Relaxed);
            e.queued_medium.store(0, Ordering::Relaxed);
            e.posted_ns
                .iter()
                .for_each(|t| t.store(0, Ordering::Relaxed));
            e.pid.store(0, Ordering::Release);
        }
        // SAFETY: the mapping was created in `attach` with this size and nothing refers to it
        // after this value is gone (the rotation thread holds only a weak reference).
        unsafe {
            libc::munmap(
                self.header as *mut libc::c_void,
                std::mem::size_of::<SharedHeader>(),
            )
        };
    }
}

/// Removes the shared object named `path` (for tests and tools); missing is not an error.
pub fn unlink(path: &str) {
    let name = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/{path}")
    };
    if let Ok(c) = CString::new(name) {
        // SAFETY: plain FFI with a valid C string.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(tag: &str) -> String {
        format!("/multirail-test-{tag}-{}", std::process::id())
    }

    #[test]
    fn slots_rotate_through_all_three() {
        let path = name("rotate");
        let s = GlobalSlots::attach(&path, 2_000_000, true).unwrap();
        let mut seen = [false; 3];
        let deadline = std::time::Instant::now() + Duration::from_millis(200);
        while std::time::Instant::now() < deadline && !seen.iter().all(|x| *x) {
            seen[s.current_slot() as usize] = true;
            thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(seen, [true; 3]);
        for slot in 0..3 {
            let wait = s.until_slot(slot);
            assert!(wait <= Duration::from_millis(6), "slot {slot} in {wait:?}");
            thread::sleep(wait + Duration::from_micros(300));
            // A 2 ms slot: 300 us after it began, it is still in force (a loaded test host
            // may sleep longer, so only check when the wake-up was prompt).
            let late = s.until_slot(slot) < Duration::from_millis(4);
            assert!(
                late || s.current_slot() == slot,
                "woke in slot {}",
                s.current_slot()
            );
        }
        assert_eq!(s.attached(), vec![std::process::id()]);
        drop(s);
        unlink(&path);
    }

    #[test]
    fn foreign_object_is_reinitialized() {
        let path = name("foreign");
        {
            let s = GlobalSlots::attach(&path, 2_000_000, true).unwrap();
            s.header().magic.store(0xdead_beef, Ordering::Release);
            s.header().version.store(99, Ordering::Release);
        }
        let s = GlobalSlots::attach(&path, 2_000_000, true).unwrap();
        assert_eq!(s.header().magic.load(Ordering::Acquire), MAGIC);
        assert_eq!(s.header().version.load(Ordering::Acquire), VERSION);
        drop(s);
        unlink(&path);
    }

    #[test]
    fn mutex_of_a_dead_owner_is_repaired_and_its_entry_reclaimed() {
        let path = name("deadowner");
        let s = GlobalSlots::attach(&path, 1_000_000_000, true).unwrap();
        // A child takes the mutex, publishes queued HIGH work and dies without unlocking.
        // SAFETY: the child only touches the shared mapping with atomics and the mutex, then
        // calls _exit; it runs no Rust runtime code that could need locks held by other threads.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let h = s.header();
            // SAFETY: initialized mutex in the shared mapping.
            unsafe { libc::pthread_mutex_lock(h.mutex.get()) };
            h.procs[5].queued_high.store(7, Ordering::Relaxed);
            h.procs[5].pid.store(std::process::id(), Ordering::Release);
            // SAFETY: terminating the forked child without running destructors.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        // Locking now reports the dead owner and repairs the mutex instead of hanging.
        assert!(lock(s.header()).is_ok());
        // The next tick clears the dead process's entry, so its HIGH work holds nobody back.
        s.tick();
        assert_eq!(s.queued_totals(), [0, 0]);
        assert_eq!(s.attached(), vec![std::process::id()]);
        drop(s);
        unlink(&path);
    }

    #[test]
    fn work_conserving_admission_follows_published_queues() {
        let path = name("wc");
        // Long slots: slot 0 for the whole test.
        let s = GlobalSlots::attach(&path, 60_000_000_000, true).unwrap();
        assert_eq!(s.current_slot(), 0);
        assert!(s.admits(qos::LOW), "nobody has HIGH work");
        s.publish_queued(3, 0);
        s.tick();
        assert!(!s.admits(qos::LOW) && s.admits(qos::HIGH));
        drop(s);
        let strict = GlobalSlots::attach(&path, 60_000_000_000, false).unwrap();
        assert!(!strict.admits(qos::LOW), "TENT's strict slots");
        drop(strict);
        unlink(&path);
    }

    #[test]
    fn a_posting_stream_counts_as_work_until_it_has_been_quiet_for_the_active_span() {
        let path = name("active");
        let s = GlobalSlots::attach(&path, 60_000_000_000, true).unwrap();
        assert_eq!(s.current_slot(), 0);
        s.tick();
        assert!(!s.has_work(qos::HIGH) && s.admits(qos::LOW));
        // A HIGH stream whose requests never queue: nothing published as queued.
        s.note_posted(qos::HIGH, monotonic_ns());
        s.tick();
        assert_eq!(s.queued_totals(), [0, 0]);
        assert!(s.has_work(qos::HIGH), "a stream posting now is work");
        assert!(
            !s.admits(qos::LOW),
            "slot 0 keeps LOW out while HIGH streams"
        );
        assert!(!s.has_work(qos::MEDIUM) && !s.has_work(qos::LOW));
        assert!(!s.bulk_active(), "HIGH is not bulk");
        // A LOW stream is bulk to every process, though nothing makes room for it.
        s.note_posted(qos::LOW, monotonic_ns());
        s.tick();
        assert!(s.bulk_active() && !s.has_work(qos::LOW));
        // Quiet for longer than the active span: LOW is admitted again.
        s.header().procs[s.entry].posted_ns[0]
            .store(monotonic_ns() - 2 * ACTIVE_NS, Ordering::Relaxed);
        s.tick();
        assert!(!s.has_work(qos::HIGH) && s.admits(qos::LOW));
        drop(s);
        unlink(&path);
    }
}
