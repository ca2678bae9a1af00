//! A real etcd server for tests: Debian's `etcd` (package `etcd-server`, which `scripts/test`
//! installs), started on free loopback ports in a directory of its own and killed when
//! dropped. Tests fail, saying how to get it, when the binary is missing.

// Each test crate that includes this file uses part of it.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One running etcd member.
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    /// The client port, on 127.0.0.1.
    pub port: u16,
    peer_port: u16,
}

/// Starts etcd with its data in `dir/data`, serving clients on `port` and peers on `peer`.
fn spawn(dir: &std::path::Path, port: u16, peer: u16) -> Child {
    let client_url = format!("http://127.0.0.1:{port}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    Command::new(etcd_binary())
        .args([
            "--name",
            "test",
            "--data-dir",
            dir.join("data").to_str().unwrap(),
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &format!("test={peer_url}"),
            "--logger",
            "zap",
            "--log-level",
            "error",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("etcd.log"))
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null()),
        )
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {:?} ({e}): install etcd (Debian: apt-get install etcd-server; \
                 scripts/test does) or point MULTIRAIL_ETCD at it",
                etcd_binary()
            )
        })
}

/// A loopback port free now, for a server a test stops and starts again on it: below the
/// kernel's ephemeral range where that range leaves room (32768 and up by default), because
/// while the server is stopped a port from that range can become the source port of any
/// outgoing connection on the host (an engine's), and the restart then finds it in use.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const SPAN: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(0);
    if low >= 2048 + SPAN {
        // Test processes running at once start at different places of the span.
        let start = std::process::id().wrapping_mul(7919) % SPAN;
        for _ in 0..SPAN {
            let k = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN;
            let port = (low - SPAN + k) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

fn etcd_binary() -> String {
    std::env::var("MULTIRAIL_ETCD").unwrap_or_else(|_| "etcd".into())
}

impl Etcd {
    /// Starts etcd and waits until it answers `/health`. Panics (failing the test) when etcd
    /// is not installed or does not come up within 30 s.
    pub fn start() -> Etcd {
        let mut etcd = Etcd::stopped();
        etcd.restart();
        etcd
    }

    /// An etcd with its ports and directory chosen but not started: engines configured with
    /// [`Etcd::url`] find nothing there until [`Etcd::restart`].
    pub fn stopped() -> Etcd {
        let dir = std::env::temp_dir().join(format!(
            "multirail-etcd-{}-{}",
            std::process::id(),
            free_port()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("etcd directory");
        Etcd {
            child: None,
            dir,
            port: free_port(),
            peer_port: free_port(),
        }
    }

    /// Kills etcd if it runs and starts it again on the same ports with the data it had
    /// (none the first time). Waits until it is healthy.
    pub fn restart(&mut self) {
        self.kill();
        self.child = Some(spawn(&self.dir, self.port, self.peer_port));
        self.wait_healthy(Duration::from_secs(30));
    }

    /// Whether etcd was started and not killed since.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    fn wait_healthy(&mut self, limit: Duration) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .proxy(None)
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(1)))
            .build()
            .into();
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(mut answer) = agent.get(format!("{}/health", self.http())).call() {
                if answer
                    .body_mut()
                    .read_to_string()
                    .is_ok_and(|b| b.contains("true"))
                {
                    return;
                }
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
                panic!("etcd exited with {status} before it was healthy:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "etcd not healthy within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `etcd://127.0.0.1:PORT`, as engines are configured with it.
    pub fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.port)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn http(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn signal(&self, sig: libc::c_int) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child's pid; it takes no memory.
            unsafe { libc::kill(c.id() as libc::pid_t, sig) };
        }
    }

    /// Freezes etcd (SIGSTOP): connections stay open and nothing answers. Returns once every
    /// thread of it has stopped: kill(2) returns before a thread running on another core has
    /// taken the stop, and a request sent meanwhile could still be answered.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let Some(c) = &self.child else { return };
        let tasks = format!("/proc/{}/task", c.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let stopped = || {
            std::fs::read_dir(&tasks).is_ok_and(|dir| {
                dir.flatten().all(|t| {
                    // The state follows the command name's closing parenthesis.
                    std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
                        stat.rsplit_once(") ")
                            .is_some_and(|(_, rest)| rest.starts_with(['T', 't']))
                    })
                })
            })
        };
        while !stopped() {
            assert!(
                std::time::Instant::now() < deadline,
                "etcd did not stop within 5 s of SIGSTOP"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Lets a paused etcd run again.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Kills etcd and starts a new, empty one on the same port: as if the store lost its
    /// data. Waits until it is healthy.
    pub fn restart_empty(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(self.dir.join("data"));
        self.child = Some(spawn(&self.dir, self.port, self.peer_port));
        self.wait_healthy(Duration::from_secs(30));
    }

    /// Kills etcd (SIGKILL) and waits for it; its data stays.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.resume();
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
