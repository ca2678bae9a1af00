//! Helpers for tests that run `multirail target` as a separate process.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// The `multirail` binary: `MULTIRAIL_BIN` when set (the test binary runs somewhere its build
/// tree is not, as in scripts/test-rdma's VM), else the one cargo built with the tests.
pub fn multirail_bin() -> String {
    std::env::var("MULTIRAIL_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_multirail").to_owned())
}

/// Runs `multirail ARGS` without `MULTIRAIL_CONF` and waits for it.
pub fn multirail(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(args)
        .env_remove("MULTIRAIL_CONF")
        .output()
        .expect("run multirail")
}

/// A `multirail target` child process, killed when dropped.
pub struct TargetProcess {
    pub child: Child,
    pub name: String,
}

impl TargetProcess {
    /// Starts a target serving `size` bytes on a free loopback port (unless `extra` says
    /// `--listen`) with config `conf` (inline JSON) and waits for its segment name.
    pub fn start(size: &str, conf: Option<&str>) -> TargetProcess {
        Self::start_with(size, conf, &[])
    }

    /// As `start`, with extra `multirail target` flags.
    pub fn start_with(size: &str, conf: Option<&str>, extra: &[&str]) -> TargetProcess {
        Self::start_configured(size, conf, extra, |_| {})
    }

    /// As `start_with`, after `configure` has adjusted the command (environment, limits,
    /// where stderr goes).
    pub fn start_configured(
        size: &str,
        conf: Option<&str>,
        extra: &[&str],
        configure: impl FnOnce(&mut Command),
    ) -> TargetProcess {
        let mut cmd = Command::new(multirail_bin());
        cmd.arg("target");
        if !extra.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        cmd.args(["--size", size])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .stdin(Stdio::null());
        match conf {
            Some(c) => cmd.env("MULTIRAIL_CONF", c),
            None => cmd.env_remove("MULTIRAIL_CONF"),
        };
        configure(&mut cmd);
        let mut child = cmd.spawn().expect("start multirail target");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read segment name");
        let name = line.trim().to_owned();
        assert!(
            name.starts_with("127.0.0.1:"),
            "segment name on the first line, got {name:?}"
        );
        TargetProcess { child, name }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `sig`. For SIGSTOP, returns once every thread of the target is stopped: `kill`
    /// returns before that, and a request posted meanwhile could still be served.
    pub fn signal(&self, sig: i32) {
        // SAFETY: sends a signal to our own child process.
        unsafe { libc::kill(self.pid(), sig) };
        if sig == libc::SIGSTOP {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while !self.all_threads_stopped() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    fn all_threads_stopped(&self) -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid())) else {
            return false;
        };
        tasks.flatten().all(|t| {
            // The state follows the command name in parentheses, which may hold spaces.
            std::fs::read_to_string(t.path().join("stat"))
                .ok()
                .and_then(|st| {
                    st.rsplit_once(')')
                        .map(|(_, rest)| rest.trim_start().starts_with(['T', 't']))
                })
                .unwrap_or(false)
        })
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
