//! The child processes a `--local` run starts (bench's target, pingpong's server, lanes-bench's
//! receiver, mcast-bench's members), which never outlive the command.
//!
//! Two mechanisms cover every way the command can end:
//! - [`Guarded::spawn`] has the kernel send the child SIGKILL when the thread that started it
//!   ends (`PR_SET_PDEATHSIG`), which covers the ends that run no code of ours: SIGKILL, an
//!   abort, the OOM killer.
//! - A [`Guarded`] child is stopped and reaped when dropped, which covers returns, errors and
//!   panics: a child that lingered would hold the terminal or a caller's `$(...)` capture open
//!   (it inherits stderr) and keep its buffers.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus};
use std::thread;
use std::time::{Duration, Instant};

/// How long a child gets to exit by itself once asked to, before it is killed.
const GRACE: Duration = Duration::from_secs(3);

/// How a child is asked to finish before [`GRACE`] runs out and it is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Close its stdin: a benchmark child reads commands there and ends at its end.
    CloseStdin,
    /// Send SIGTERM: a target serves until it gets one, then shuts its engine down.
    Terminate,
    /// Nothing: it exits by itself once the run is over (pingpong's `--once` server).
    Wait,
}

/// A child process that is stopped and reaped when dropped.
#[derive(Debug)]
pub struct Guarded {
    child: Child,
    stdin: Option<ChildStdin>,
    stop: Stop,
    /// Set once the child has been waited for: its pid may name another process after that,
    /// so no signal goes to it any more.
    status: Option<ExitStatus>,
}

impl Guarded {
    /// Starts `cmd` as a child that dies with this thread and is stopped the `stop` way when
    /// dropped.
    ///
    /// The death signal is tied to the *thread* that forks, not to the process: call this from
    /// a thread that lives as long as the child should (the commands call it from the main
    /// thread).
    pub fn spawn(cmd: &mut Command, stop: Stop) -> io::Result<Guarded> {
        // Taken before the fork: a child whose parent is already someone else lost its parent
        // between fork and prctl, when no death signal could be delivered any more.
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec, where only
        // async-signal-safe calls are sound (another thread may have held a lock at the fork).
        // It calls prctl and getppid, both plain system calls on the calling process, neither
        // allocates nor takes a lock, and its errors are built from an errno value without
        // allocating. It touches no memory but its own copy of `parent`.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        Ok(Guarded {
            child,
            stdin,
            stop,
            status: None,
        })
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The child's stdout, if it was piped and not taken yet.
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    /// The child's stdin, if it was piped; closed ([`Stop::CloseStdin`]) only when stopping.
    pub fn stdin(&mut self) -> Option<&mut ChildStdin> {
        self.stdin.as_mut()
    }

    /// The child's exit status if it has exited (and is now reaped), else `None`.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Waits for the child to exit by itself (e.g. after it closed its stdout) and reaps it.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        let status = self.child.wait()?;
        self.status = Some(status);
        Ok(status)
    }

    fn reaped(&self) -> bool {
        self.status.is_some()
    }

    /// Sends `signal` to the child unless it was already reaped.
    pub fn signal(&self, signal: libc::c_int) {
        if !self.reaped() {
            // SAFETY: kill(2) takes no pointers; the pid is our child's, which has not been
            // waited for, so it still names that process (a zombie at worst).
            unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        }
    }

    /// Kills the child at once with SIGKILL, without reaping it.
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
    }

    /// Asks the child to finish (its [`Stop`]), waits up to 3 s for it to exit, kills it if it
    /// has not, and reaps it. Does nothing once it is reaped.
    pub fn stop(&mut self) {
        stop_all(std::slice::from_mut(self));
    }

    fn ask(&mut self) {
        match self.stop {
            Stop::CloseStdin => drop(self.stdin.take()),
            Stop::Terminate => self.signal(libc::SIGTERM),
            Stop::Wait => {}
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if self.reaped() {
            return;
        }
        if thread::panicking() {
            // The run's state is suspect: no grace, and no waiting on a child that might
            // wait on us.
            self.kill();
            let _ = self.wait();
        } else {
            self.stop();
        }
    }
}

/// Stops every child of `children` as [`Guarded::stop`] does, all asked at once and waited
/// for within one grace period, so many children take 3 s at most rather than 3 s each.
pub fn stop_all(children: &mut [Guarded]) {
    for c in children.iter_mut().filter(|c| !c.reaped()) {
        c.ask();
    }
    let deadline = Instant::now() + GRACE;
    loop {
        let mut running = false;
        for c in children.iter_mut().filter(|c| !c.reaped()) {
            running |= c.try_wait().is_none();
        }
        if !running || Instant::now() >= deadline {
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut().filter(|c| !c.reaped()) {
        c.kill();
        let _ = c.wait();
    }
}
