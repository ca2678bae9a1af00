//! Bad input and hostile surroundings: every count, size and duration flag refuses a value
//! outside its stated range (exit 2, naming the flag) before anything starts; a stdout closed
//! under a command ends it quietly with 141; and no child process of a `--local` run outlives
//! the command, however the command ends.
//!
//! Every command here runs with `--config` naming a file of its own: the children of `--local`
//! runs get the same flag, so a process whose command line holds that path is one of ours.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

mod common;

/// A configuration file (the defaults) whose path marks one test's processes.
struct Marker(PathBuf);

impl Marker {
    fn new() -> Marker {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "mr-robust-{}-{}.json",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, "{}").unwrap();
        Marker(path)
    }

    /// `multirail --config MARKER ARGS`, without `MULTIRAIL_CONF`.
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(common::multirail_bin());
        cmd.arg("--config")
            .arg(&self.0)
            .args(args)
            .env_remove("MULTIRAIL_CONF")
            .env_remove("MULTIRAIL_METADATA")
            .stdin(Stdio::null());
        cmd
    }

    /// The live (not zombie) processes whose command line holds this marker: pid and parent.
    fn processes(&self) -> Vec<(i32, i32)> {
        let needle = self.0.to_string_lossy().into_owned().into_bytes();
        let mut found = Vec::new();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return found;
        };
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            if !cmdline
                .windows(needle.len())
                .any(|w| w == needle.as_slice())
            {
                continue;
            }
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // State and parent follow the command name in parentheses.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let mut fields = rest.split_whitespace();
            let state = fields.next().unwrap_or("");
            let ppid = fields.next().and_then(|p| p.parse().ok()).unwrap_or(0);
            if state != "Z" && state != "X" {
                found.push((pid, ppid));
            }
        }
        found
    }

    /// Waits up to `within` for every marked process to be gone; SIGKILLs what is left (so a
    /// failing test leaves nothing behind) and returns it.
    fn survivors_after(&self, within: Duration) -> Vec<(i32, i32)> {
        let deadline = Instant::now() + within;
        loop {
            let left = self.processes();
            if left.is_empty() {
                return left;
            }
            if Instant::now() >= deadline {
                for &(pid, _) in &left {
                    // SAFETY: kill(2) takes no pointers; the pid is one of this test's
                    // processes, found by its command line a moment ago.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                return left;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Marker {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What a command did, read the way `$(...)` reads it: both pipes to their end.
struct Outcome {
    /// None when the command had not exited in time (it was killed).
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
    /// Whether stdout and stderr both reached their end in time: a child process that
    /// outlives the command holds its inherited stderr open.
    eof: bool,
}

/// Runs `cmd` with stdout and stderr piped, reading both to their end; gives up (killing the
/// command) after `limit`.
fn run(cmd: Command, limit: Duration) -> Outcome {
    run_with(cmd, limit, false)
}

/// As [`run`]; with `closed_stdout`, stdout is a pipe whose reading end is closed before the
/// command starts, so every write to it fails with EPIPE (the `Outcome`'s stdout is empty).
fn run_with(mut cmd: Command, limit: Duration, closed_stdout: bool) -> Outcome {
    if closed_stdout {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        cmd.stdout(writer);
    } else {
        cmd.stdout(Stdio::piped());
    }
    cmd.stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start multirail");
    // This process's copy of the closed pipe's writing end goes with `cmd`.
    drop(cmd);
    let mut pipes: Vec<(u8, Box<dyn Read + Send>)> =
        vec![(1, Box::new(child.stderr.take().unwrap()))];
    if let Some(stdout) = child.stdout.take() {
        pipes.push((0, Box::new(stdout)));
    }
    let expected = pipes.len();
    let (tx, rx) = mpsc::channel();
    for (which, mut pipe) in pipes {
        let tx = tx.clone();
        thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            let _ = tx.send((which, String::from_utf8_lossy(&text).into_owned()));
        });
    }
    let deadline = Instant::now() + limit;
    let (mut stdout, mut stderr, mut ends) = (String::new(), String::new(), 0);
    while ends < expected {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((0, text)) => (stdout, ends) = (text, ends + 1),
            Ok((_, text)) => (stderr, ends) = (text, ends + 1),
            Err(_) => break,
        }
    }
    let status = wait_until(&mut child, deadline);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    Outcome {
        status,
        stdout,
        stderr,
        eof: ends == expected,
    }
}

fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// A scenario file of this repository.
fn scenario(name: &str) -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../sim/scenarios/{name}"));
    path.to_string_lossy().into_owned()
}

/// `multirail sim ARGS`, without `MULTIRAIL_CONF`.
fn sim(args: &[&str]) -> Command {
    let mut cmd = Command::new(common::multirail_bin());
    cmd.arg("sim")
        .args(args)
        .env_remove("MULTIRAIL_CONF")
        .stdin(Stdio::null());
    cmd
}

/// The help of `flag` in `help` (a subcommand's `--help`), on one line: clap gives each flag a
/// paragraph of its own, or a line in a short help, starting with the flag.
fn flag_help(help: &str, flag: &str) -> Option<String> {
    let mut lines = help.lines().skip_while(|l| {
        let l = l.trim_start();
        !(l.starts_with(&format!("{flag} <")) || l.contains(&format!(", {flag} <")))
    });
    let first = lines.next()?;
    // Up to a blank line (long help) or the next flag (short help, one line a flag).
    let rest = lines.take_while(|l| !l.trim().is_empty() && !l.trim_start().starts_with('-'));
    let text: Vec<&str> = std::iter::once(first).chain(rest).collect();
    Some(
        text.join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    )
}

#[test]
fn a_huge_iteration_count_is_refused_and_no_server_is_left_behind() {
    // It used to size a Vec by it, after the server had started: the panic left the server
    // running with the caller's stderr, so reading the output to its end never finished.
    let m = Marker::new();
    let out = run(
        m.command(&[
            "pingpong",
            "--local",
            "--iterations",
            "18446744073709551615",
        ]),
        Duration::from_secs(8),
    );
    let survivors = m.survivors_after(Duration::from_secs(1));
    assert!(out.eof, "the output never ended: {:?}", out.stderr);
    assert!(survivors.is_empty(), "left running: {survivors:?}");
    assert_eq!(out.status.and_then(|s| s.code()), Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("--iterations"), "{}", out.stderr);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

/// Starts `args` (a `--local` run that lasts well past the test), waits for its child, kills
/// the command with SIGKILL and returns the children still alive a while later.
fn children_left_after_sigkill(args: &[&str]) -> Vec<(i32, i32)> {
    let m = Marker::new();
    let mut cmd = m.command(args);
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    let mut parent = cmd.spawn().expect("start multirail");
    let pid = parent.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(8);
    while !m.processes().iter().any(|&(_, ppid)| ppid == pid) {
        assert!(
            Instant::now() < deadline,
            "{args:?} started no child within 8 s"
        );
        assert!(
            parent.try_wait().unwrap().is_none(),
            "{args:?} exited before starting its child"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let _ = parent.kill();
    let _ = parent.wait();
    m.survivors_after(Duration::from_secs(3))
}

#[test]
fn no_child_outlives_its_command_killed_with_sigkill() {
    for args in [
        &[
            "pingpong",
            "--local",
            "--iterations",
            "10000000",
            "--think-us",
            "1000",
        ][..],
        &[
            "bench",
            "--local",
            "--size",
            "4MiB",
            "--block-size",
            "64KiB",
            "--duration",
            "60",
        ],
        &[
            "lanes-bench",
            "--local",
            "--peers",
            "2",
            "--hot",
            "1",
            "--duration",
            "60",
        ],
        &[
            "mcast-bench",
            "--local",
            "--members",
            "2",
            "--duration",
            "60",
        ],
    ] {
        let left = children_left_after_sigkill(args);
        assert!(left.is_empty(), "{args:?} left {left:?} running");
    }
}

#[test]
fn an_error_after_the_child_started_stops_the_child() {
    // The target starts before the metrics address is looked at.
    let m = Marker::new();
    let out = run(
        m.command(&[
            "bench",
            "--local",
            "--size",
            "4MiB",
            "--block-size",
            "64KiB",
            "--duration",
            "1",
            "--metrics",
            "not-an-address",
        ]),
        Duration::from_secs(9),
    );
    let survivors = m.survivors_after(Duration::from_secs(1));
    assert!(out.eof, "the output never ended: {:?}", out.stderr);
    assert!(survivors.is_empty(), "left running: {survivors:?}");
    assert_eq!(out.status.and_then(|s| s.code()), Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("--metrics"), "{}", out.stderr);

    // The plot is drawn after the round trips, with the server still there.
    let m = Marker::new();
    let out = run(
        m.command(&[
            "pingpong",
            "--local",
            "--iterations",
            "50",
            "--warmup",
            "0",
            "--plot",
            "/nonexistent-dir/pingpong.png",
        ]),
        Duration::from_secs(9),
    );
    let survivors = m.survivors_after(Duration::from_secs(1));
    assert!(out.eof, "the output never ended: {:?}", out.stderr);
    assert!(survivors.is_empty(), "left running: {survivors:?}");
    assert_eq!(out.status.and_then(|s| s.code()), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("pingpong.png"), "{}", out.stderr);
}

#[test]
fn a_closed_stdout_ends_every_command_quietly_with_141() {
    let scenario = scenario("tent-8x400.json");
    let cases: Vec<Vec<&str>> = vec![
        vec!["config", "show"],
        // Servers: without a reader for the name they print first, they stop.
        vec!["target", "--size", "1MiB", "--listen", "127.0.0.1:0"],
        vec!["pingpong", "--server"],
        vec!["metadata-server", "--listen", "127.0.0.1:0"],
        vec!["sim", &scenario, "--duration-ms", "20"],
        vec!["sim", &scenario, "--duration-ms", "20", "--json"],
        vec![
            "membench",
            "--buffer-size",
            "1MiB",
            "--block-size",
            "64KiB",
            "--duration",
            "10ms",
        ],
        vec!["topo"],
        vec![
            "bench",
            "--local",
            "--size",
            "4MiB",
            "--block-size",
            "64KiB",
            "--duration",
            "100ms",
        ],
        vec![
            "pingpong",
            "--local",
            "--iterations",
            "100",
            "--warmup",
            "0",
        ],
        vec![
            "lanes-bench",
            "--local",
            "--peers",
            "2",
            "--hot",
            "1",
            "--duration",
            "300ms",
            "--warmup",
            "100ms",
        ],
        vec![
            "mcast-bench",
            "--local",
            "--members",
            "2",
            "--duration",
            "300ms",
            "--warmup",
            "100ms",
        ],
    ];
    for args in cases {
        let m = Marker::new();
        let out = run_with(m.command(&args), Duration::from_secs(9), true);
        let left = m.survivors_after(Duration::from_secs(1));
        assert!(out.eof, "{args:?}: the output never ended: {}", out.stderr);
        assert_eq!(
            out.status.and_then(|s| s.code()),
            Some(141),
            "{args:?}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains("panicked"), "{args:?}: {}", out.stderr);
        assert!(!out.stderr.contains("error"), "{args:?}: {}", out.stderr);
        assert!(left.is_empty(), "{args:?} left {left:?} running");
    }
}

#[test]
fn every_count_size_and_duration_flag_refuses_a_value_outside_its_stated_range() {
    let scenario = scenario("rail-failure.json");
    // Subcommand and flags, the flag whose value is bad, and the range its help states.
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["bench", "--local", "--duration", "1e12"],
            "--duration",
            "1ms to 24h",
        ),
        (
            &["bench", "--local", "--interval", "25h"],
            "--interval",
            "1ms to 24h",
        ),
        (
            &["bench", "--local", "--size", "2TiB"],
            "--size",
            "1 B to 1 TiB",
        ),
        (
            &["bench", "--local", "--block-size", "0"],
            "--block-size",
            "1 B to 1 TiB",
        ),
        (
            &["bench", "--local", "--total", "65TiB"],
            "--total",
            "at most 64 TiB",
        ),
        (
            &["bench", "--local", "--batch-size", "0"],
            "--batch-size",
            "1 to 65536",
        ),
        (
            &["bench", "--local", "--threads", "1025"],
            "--threads",
            "1 to 1024",
        ),
        (
            &[
                "pingpong",
                "--local",
                "--iterations",
                "18446744073709551615",
            ],
            "--iterations",
            "1 to 10000000",
        ),
        (
            &["pingpong", "--local", "--warmup", "10000001"],
            "--warmup",
            "0 to 10000000",
        ),
        (
            &["pingpong", "--local", "--size", "0"],
            "--size",
            "1 to 67108864",
        ),
        (
            &["pingpong", "--local", "--think-us", "1000001"],
            "--think-us",
            "0 to 1000000",
        ),
        (
            &["pingpong", "--local", "--plot-window", "0"],
            "--plot-window",
            "1 to 10000000",
        ),
        (
            &["pingpong", "--local", "--queue-depth", "0"],
            "--queue-depth",
            "1 to 1048576",
        ),
        (
            &["pingpong", "--local", "--max-sge", "33"],
            "--max-sge",
            "1 to 32",
        ),
        (
            &["lanes-bench", "--local", "--peers", "1000000"],
            "--peers",
            "1 to 1024",
        ),
        (
            &["lanes-bench", "--local", "--hot", "0"],
            "--hot",
            "1 to --peers",
        ),
        (
            &["lanes-bench", "--local", "--max-dedicated", "65537"],
            "--max-dedicated",
            "0 to 65536",
        ),
        (
            &["lanes-bench", "--local", "--duration", "1e12"],
            "--duration",
            "1ms to 24h",
        ),
        (
            &["lanes-bench", "--local", "--warmup", "25h"],
            "--warmup",
            "0 to 24h",
        ),
        (
            &["mcast-bench", "--local", "--members", "1000"],
            "--members",
            "2 to 64",
        ),
        (
            &["mcast-bench", "--local", "--senders", "0"],
            "--senders",
            "1 to --members",
        ),
        (
            &[
                "mcast-bench",
                "--local",
                "--messages",
                "18446744073709551615",
            ],
            "--messages",
            "1 to 1000000000",
        ),
        (
            &["mcast-bench", "--local", "--window", "0"],
            "--window",
            "1 to 65536",
        ),
        (
            &[
                "mcast-bench",
                "--local",
                "--flush-us",
                "18446744073709551615",
            ],
            "--flush-us",
            "1 to 1000000",
        ),
        (
            &["mcast-bench", "--local", "--size", "8-1GiB"],
            "--size",
            "to 16 MiB",
        ),
        (
            &["mcast-bench", "--local", "--duration", "1e12"],
            "--duration",
            "1ms to 24h",
        ),
        (
            &[
                "mcast-bench",
                "--local",
                "--kill-member",
                "1",
                "--kill-after",
                "1e12",
            ],
            "--kill-after",
            "1ms to 24h",
        ),
        (
            &["membench", "--buffer-size", "2TiB"],
            "--buffer-size",
            "1 B to 1 TiB",
        ),
        (
            &["membench", "--duration", "1e12"],
            "--duration",
            "1ms to 24h",
        ),
        (&["target", "--size", "2TiB"], "--size", "1 B to 1 TiB"),
        (
            &["sim", &scenario, "--duration-ms", "18446744073709551615"],
            "--duration-ms",
            "1 to 3600000",
        ),
        (
            &["sim", &scenario, "--duration-ms", "0"],
            "--duration-ms",
            "1 to 3600000",
        ),
    ];
    let m = Marker::new();
    for &(args, flag, range) in cases {
        let out = run(m.command(args), Duration::from_secs(5));
        assert_eq!(
            out.status.and_then(|s| s.code()),
            Some(2),
            "{args:?}: {}",
            out.stderr
        );
        assert!(out.stderr.contains(flag), "{args:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{args:?}: {}", out.stderr);
        let help = m
            .command(&[args[0], "--help"])
            .output()
            .expect("run multirail --help");
        let doc = flag_help(&String::from_utf8_lossy(&help.stdout), flag)
            .unwrap_or_else(|| panic!("{} --help has no {flag}", args[0]));
        assert!(
            doc.contains(range),
            "{} {flag}: help {doc:?} lacks {range:?}",
            args[0]
        );
    }
    assert!(m.survivors_after(Duration::from_secs(1)).is_empty());
}

#[test]
fn an_out_of_range_flag_exits_at_once_even_where_the_range_is_checked_against_another() {
    // Bounded by another flag: the command refuses them as usage errors before starting.
    let m = Marker::new();
    for (args, flag) in [
        (
            &["lanes-bench", "--local", "--peers", "2", "--hot", "3"][..],
            "--hot",
        ),
        (
            &["mcast-bench", "--local", "--members", "3", "--senders", "4"],
            "--senders",
        ),
        (
            &[
                "mcast-bench",
                "--local",
                "--members",
                "3",
                "--kill-member",
                "3",
                "--kill-after",
                "1",
            ],
            "--kill-member",
        ),
        (
            &["membench", "--buffer-size", "1MiB", "--block-size", "2MiB"],
            "--block-size",
        ),
        (
            &[
                "mcast-bench",
                "--local",
                "--messages",
                "10",
                "--rate",
                "0.0001",
            ],
            "--rate",
        ),
    ] {
        let out = run(m.command(args), Duration::from_secs(5));
        assert_eq!(
            out.status.and_then(|s| s.code()),
            Some(2),
            "{args:?}: {}",
            out.stderr
        );
        assert!(out.stderr.contains(flag), "{args:?}: {}", out.stderr);
    }
}

#[test]
fn a_sim_scenario_out_of_range_is_refused_naming_the_key() {
    let dir = std::env::temp_dir().join(format!("mr-robust-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, doc: String| {
        let path = dir.join(name);
        std::fs::write(&path, doc).unwrap();
        path.to_string_lossy().into_owned()
    };
    let workload = r#"[{"name": "w", "priority": "low", "size": 1048576}]"#;
    let rails: Vec<String> = (0..200_000)
        .map(|i| format!(r#"{{"name": "r{i}", "gbps": 100}}"#))
        .collect();
    let cases = [
        (
            write(
                "many-rails.json",
                format!(
                    r#"{{"name": "x", "duration_ms": 100, "rails": [{}], "workloads": {workload}}}"#,
                    rails.join(",")
                ),
            ),
            "rails",
        ),
        (
            write(
                "long.json",
                format!(
                    r#"{{"name": "x", "duration_ms": 18446744073709551615,
                         "rails": [{{"name": "r", "gbps": 100}}], "workloads": {workload}}}"#
                ),
            ),
            "duration_ms",
        ),
        (
            write(
                "fine-samples.json",
                format!(
                    r#"{{"name": "x", "duration_ms": 3600000, "sample_ms": 1,
                         "rails": [{{"name": "r", "gbps": 100}}], "workloads": {workload}}}"#
                ),
            ),
            "sample_ms",
        ),
        (
            write(
                "many-threads.json",
                r#"{"name": "x", "duration_ms": 10, "rails": [{"name": "r", "gbps": 100}],
                    "workloads": [{"name": "w", "priority": "low", "size": 4096,
                                   "threads": 1024, "batch": 65536}]}"#
                    .into(),
            ),
            "workloads[0].batch",
        ),
        (
            write(
                "flood.json",
                r#"{"name": "x", "duration_ms": 60000, "rails": [{"name": "r", "gbps": 1}],
                    "workloads": [{"name": "w", "priority": "low", "size": 4096,
                                   "arrival": "poisson", "rate_per_sec": 1000000000}]}"#
                    .into(),
            ),
            "workloads[0].rate_per_sec",
        ),
        (
            write(
                "huge-group.json",
                r#"{"name": "x", "duration_ms": 1, "multicast": {"members": 1000000000000}}"#
                    .into(),
            ),
            "multicast.members",
        ),
        (
            write(
                "hot-flood.json",
                r#"{"name": "x", "duration_ms": 10, "lanes": {"peers": 20,
                    "workload": "mbw_mr", "hot": 3, "hot_rate_per_sec": 1e15}}"#
                    .into(),
            ),
            "lanes.hot_rate_per_sec",
        ),
    ];
    for (path, key) in &cases {
        let out = run(sim(&[path]), Duration::from_secs(8));
        assert_eq!(
            out.status.and_then(|s| s.code()),
            Some(2),
            "{key}: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains(&format!("scenario key {key}:")),
            "{key}: {}",
            out.stderr
        );
        assert!(out.stdout.is_empty(), "{key}: {}", out.stdout);
    }
    // A duration given on the command line meets the same limits as the scenario's own.
    let fine = write(
        "fine-but-short.json",
        format!(
            r#"{{"name": "x", "duration_ms": 10, "sample_ms": 1,
                 "rails": [{{"name": "r", "gbps": 100}}], "workloads": {workload}}}"#
        ),
    );
    let out = run(
        sim(&[&fine, "--duration-ms", "3600000"]),
        Duration::from_secs(8),
    );
    assert_eq!(out.status.and_then(|s| s.code()), Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("--duration-ms 3600000") && out.stderr.contains("sample_ms"),
        "{}",
        out.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A runtime error names its OS error once: the engine's errors print it themselves and also
/// give it as their source, which the error chain printed a second time.
#[test]
fn a_port_in_use_is_named_once() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_multirail"));
    cmd.args(["target", "--size", "1MiB", "--listen", &addr])
        .env_remove("MULTIRAIL_CONF");
    let out = run(cmd, Duration::from_secs(30));
    assert_eq!(out.status.and_then(|s| s.code()), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains(&addr), "{}", out.stderr);
    assert_eq!(
        out.stderr.matches("Address already in use").count(),
        1,
        "{}",
        out.stderr
    );
}
