//! What idle and hostile clients cost a long-lived `multirail target`: no thread per
//! connection, members served when fds run out, and the membership token kept out of its logs.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use common::TargetProcess;
use std::time::{Duration, Instant};

use multirail::transport::handshake::{self, Membership};
use multirail::transport::wire::{self, ConnKind};
use multirail::{Config, Engine, Location, Request, TransportChoice};

/// A `multirail target` child (64 MiB) with the environment and fd limit a test gives it.
struct Target(TargetProcess);

impl std::ops::Deref for Target {
    type Target = TargetProcess;
    fn deref(&self) -> &TargetProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Target {
    fn deref_mut(&mut self) -> &mut TargetProcess {
        &mut self.0
    }
}

impl Target {
    fn start(envs: &[(&str, &str)], fd_limit: Option<u64>, capture_stderr: bool) -> Target {
        Target(TargetProcess::start_configured("64MiB", None, &[], |cmd| {
            cmd.env_remove("MULTIRAIL_TOKEN").envs(envs.iter().copied());
            if capture_stderr {
                cmd.stderr(Stdio::piped());
            }
            if let Some(limit) = fd_limit {
                // SAFETY: setrlimit is async-signal-safe; it only lowers this child's own
                // limits.
                unsafe {
                    cmd.pre_exec(move || {
                        let rl = libc::rlimit {
                            rlim_cur: limit,
                            rlim_max: limit,
                        };
                        if libc::setrlimit(libc::RLIMIT_NOFILE, &rl) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    })
                };
            }
        }))
    }

    fn status_field(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{field} in /proc/PID/status"))
    }

    fn threads(&self) -> u64 {
        self.status_field("Threads:")
    }

    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }
}

/// Lets this test process hold thousands of sockets.
fn raise_own_fd_limit() {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads and sets this process's own limit through valid pointers.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl);
        rl.rlim_cur = rl.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
    }
}

fn fill(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(13).wrapping_add(seed);
    }
}

/// A member engine writes 8 MiB to the target over tcp and reads them back, verified.
fn member_round_trip(engine: &Engine, target: &str) {
    let len = 8usize << 20;
    let src = engine.allocate(len, Location::Any).unwrap();
    let back = engine.allocate(len, Location::Any).unwrap();
    // SAFETY: nothing is in flight on `src` yet.
    fill(unsafe { src.as_mut_slice() }, 3);
    let seg = engine.open_segment(target).unwrap();
    let remote = engine.segment_descriptor(seg).unwrap().buffers[0].addr;
    let tcp = |r: Request| Request {
        transport: Some(TransportChoice::Tcp),
        ..r
    };
    for r in [
        Request::write(src.addr(), seg, remote, len as u64),
        Request::read(back.addr(), seg, remote, len as u64),
    ] {
        let batch = engine.allocate_batch(1).unwrap();
        engine.submit(batch, &[tcp(r)]).unwrap();
        engine.wait(batch, Some(Duration::from_secs(30))).unwrap();
        engine.free_batch(batch).unwrap();
    }
    // SAFETY: both transfers finished.
    unsafe { assert!(src.as_slice() == back.as_slice(), "bytes differ") };
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_thousand_idle_member_connections_cost_no_thread() {
    raise_own_fd_limit();
    let target = Target::start(&[], None, false);
    let engine = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
    // A first transfer starts every thread the target ever needs for it.
    member_round_trip(&engine, &target.name);
    let threads_before = target.threads();
    let fds_before = target.fds();
    let open = Membership::open();
    let idle: Vec<TcpStream> = (0..1000)
        .map(|_| {
            let s = TcpStream::connect(&target.name).unwrap();
            handshake::client(&s, ConnKind::Data, &open, "t", Duration::from_secs(5)).unwrap();
            s
        })
        .collect();
    wait_until("the target to hold 1000 more fds", || {
        target.fds() >= fds_before + 1000
    });
    let threads = target.threads();
    assert!(
        threads <= threads_before,
        "threads {threads_before} -> {threads} with 1000 idle connections"
    );
    member_round_trip(&engine, &target.name);
    let fds = target.fds();
    // One fd per connection, not two.
    assert!(fds < fds_before + 1100, "fds {fds_before} -> {fds}");
    eprintln!(
        "target: threads {threads_before} -> {threads}, fds {fds_before} -> {fds} with 1000 idle members"
    );
    drop(idle);
}

#[test]
fn a_thousand_hello_only_connections_are_shed_to_the_pending_cap() {
    raise_own_fd_limit();
    let target = Target::start(&[], None, false);
    let threads_before = target.threads();
    let fds_before = target.fds();
    let idle: Vec<TcpStream> = (0..1000)
        .map(|_| {
            let mut s = TcpStream::connect(&target.name).unwrap();
            std::io::Write::write_all(&mut s, &wire::encode_hello(ConnKind::Data)).unwrap();
            s
        })
        .collect();
    // Every one of them was accepted, and the oldest were shed down to the default cap.
    std::thread::sleep(Duration::from_millis(500));
    let fds = target.fds();
    assert!(fds <= fds_before + 256 + 8, "fds {fds_before} -> {fds}");
    assert!(target.threads() <= threads_before + 1);
    let engine = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
    member_round_trip(&engine, &target.name);
    drop(idle);
}

#[test]
fn a_member_gets_in_with_the_fd_limit_at_256_and_300_idle_connections_held() {
    raise_own_fd_limit();
    let target = Target::start(&[], Some(256), false);
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&target.name).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let engine = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
    let t0 = Instant::now();
    member_round_trip(&engine, &target.name);
    eprintln!(
        "member round trip took {:?} beside 300 idle connections, target holding {} fds",
        t0.elapsed(),
        target.fds()
    );
    // A second member after the first, as a user would.
    let other = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
    member_round_trip(&other, &target.name);
    drop(idle);
}

#[test]
fn the_token_stays_out_of_the_targets_logs_and_strangers_are_refused() {
    let token = "s3cret-membership-token-0123456789";
    let mut target = Target::start(
        &[("MULTIRAIL_TOKEN", token), ("RUST_LOG", "trace")],
        None,
        true,
    );
    let member_conf = format!(r#"{{"auth": {{"token": "{token}"}}}}"#);
    let member = Engine::new(
        Config::from_json_str(&member_conf, "test").unwrap(),
        "127.0.0.1:0",
    )
    .unwrap();
    member_round_trip(&member, &target.name);
    let stranger = Engine::new(Config::default(), "127.0.0.1:0").unwrap();
    let err = stranger.open_segment(&target.name).unwrap_err();
    assert!(err.to_string().contains("membership"), "{err}");
    drop(member);
    std::thread::sleep(Duration::from_millis(200));
    let _ = target.child.kill();
    let mut log = String::new();
    target
        .child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(!log.contains(token), "the token leaked into the log");
    assert!(
        log.contains("did not prove membership"),
        "the refusal is logged"
    );
}

#[test]
fn config_show_redacts_the_token() {
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["config", "show"])
        .env(
            "MULTIRAIL_CONF",
            r#"{"auth": {"token": "another-secret-token-here"}}"#,
        )
        .output()
        .unwrap();
    assert!(out.status.success());
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(!shown.contains("another-secret-token-here"), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
}

/// `multirail ARGS` with `MULTIRAIL_TOKEN` set to `token` (and no other configuration).
fn with_env_token(args: &[&str], token: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(args)
        .env_remove("MULTIRAIL_CONF")
        .env("MULTIRAIL_TOKEN", token)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn an_empty_or_blank_token_from_any_source_fails_closed_naming_it() {
    // Exported but empty: before, membership was silently off and any stranger was served.
    for token in ["", "   ", "\t\n"] {
        for args in [&["target", "--size", "1MiB"][..], &["config", "show"][..]] {
            let out = with_env_token(args, token);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?} {token:?}: {err}");
            assert!(
                err.contains("MULTIRAIL_TOKEN") && err.contains("empty"),
                "{args:?} {token:?}: {err}"
            );
        }
    }
    for token in ["", "                     "] {
        let conf = format!(r#"{{"auth": {{"token": "{token}"}}}}"#);
        let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
            .args(["config", "show"])
            .env("MULTIRAIL_CONF", &conf)
            .env_remove("MULTIRAIL_TOKEN")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{conf}: {err}");
        assert!(err.contains("auth.token"), "{conf}: {err}");
    }
}

#[test]
fn config_show_says_the_token_came_from_the_environment_without_printing_it() {
    let token = "environment-token-0123456789";
    let out = with_env_token(&["config", "show"], token);
    assert!(out.status.success(), "{out:?}");
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        shown["auth"]["token"], "<redacted, from MULTIRAIL_TOKEN>",
        "{shown}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains(token));
    // A token in the configuration wins over the environment and says so.
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["config", "show"])
        .env(
            "MULTIRAIL_CONF",
            r#"{"auth": {"token": "configured-token-0123456789"}}"#,
        )
        .env("MULTIRAIL_TOKEN", token)
        .output()
        .unwrap();
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["auth"]["token"], "<redacted>", "{shown}");
    // What config show printed is refused as a token, whichever form it took.
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["config", "show"])
        .env(
            "MULTIRAIL_CONF",
            r#"{"auth": {"token": "<redacted, from MULTIRAIL_TOKEN>"}}"#,
        )
        .env_remove("MULTIRAIL_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("placeholder"));
}
