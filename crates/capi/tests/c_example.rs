//! examples/c/transfer.c, compiled with `cc` against the built libmultirail, run as two
//! processes (a target and an initiator) over shm and over tcp, every byte checked on both
//! sides and every error path of the example checked for its code and message; then the same
//! under valgrind's memcheck, which must find no invalid access or use of undefined memory.
//!
//! The test builds the library first (`cargo build -p multirail-capi`, same target directory
//! and profile as the test), since cargo does not build a cdylib for integration tests.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a run may take before it is killed and the test fails; valgrind's is generous
/// because a loaded 2-core machine slows it down a lot.
const PLAIN_LIMIT: Duration = Duration::from_secs(60);
const VALGRIND_LIMIT: Duration = Duration::from_secs(240);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds libmultirail.so and libmultirail.a with cargo, in the target directory and profile
/// this test was built in, and returns the directory holding them. cargo does not build a
/// cdylib or staticlib for a package's own integration tests (they cannot link it), so without
/// this the test would run against whatever library an earlier build left, or none. Run once.
fn lib_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // This executable is <target>[/<triple>]/<profile>/deps/c_example-<hash>.
        let exe = std::env::current_exe().expect("the test executable's path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("the test executable is in <target>/<profile>/deps");
        let profile = profile_dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let above = profile_dir.parent().expect("a target directory");
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .args([
                "build",
                "-p",
                "multirail-capi",
                "--message-format=json-render-diagnostics",
            ])
            .current_dir(repo());
        match profile.as_str() {
            "debug" => {}
            "release" => {
                cargo.arg("--release");
            }
            other => {
                cargo.args(["--profile", other]);
            }
        }
        if above.join("CACHEDIR.TAG").exists() {
            cargo.arg("--target-dir").arg(above);
        } else if let Some(root) = above.parent().filter(|r| r.join("CACHEDIR.TAG").exists()) {
            cargo.arg("--target-dir").arg(root);
            cargo.arg("--target").arg(above.file_name().unwrap());
        }
        let out = cargo.output().expect("running cargo");
        assert!(
            out.status.success(),
            "`cargo build -p multirail-capi` failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The artifact message of the library names both files.
        let stdout = String::from_utf8_lossy(&out.stdout);
        let files: Vec<PathBuf> = stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "multirail")
            .filter(|m| m["package_id"].as_str().unwrap_or("").contains("capi"))
            .flat_map(|m| {
                m["filenames"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|f| f.as_str().map(PathBuf::from))
                    .collect::<Vec<_>>()
            })
            .collect();
        let so = files
            .iter()
            .find(|f| f.file_name().is_some_and(|n| n == "libmultirail.so"))
            .unwrap_or_else(|| panic!("cargo named no libmultirail.so among {files:?}"));
        let dir = so.parent().expect("a directory").to_path_buf();
        assert!(
            dir.join("libmultirail.a").is_file(),
            "no libmultirail.a beside {}",
            so.display()
        );
        dir
    })
    .clone()
}

/// Compiles examples/c/transfer.c once per test run, linked against libmultirail.so (with an
/// rpath to it) or, with `static_lib`, against libmultirail.a.
fn compile(static_lib: bool) -> PathBuf {
    static SHARED: OnceLock<PathBuf> = OnceLock::new();
    static STATIC: OnceLock<PathBuf> = OnceLock::new();
    let cell = if static_lib { &STATIC } else { &SHARED };
    cell.get_or_init(|| {
        let lib = lib_dir();
        let out_dir = std::env::temp_dir().join(format!("multirail-capi-{}", std::process::id()));
        std::fs::create_dir_all(&out_dir).expect("creating the build directory");
        let exe = out_dir.join(if static_lib {
            "transfer-static"
        } else {
            "transfer"
        });
        let mut cc = Command::new("cc");
        cc.args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-g",
            "-O1",
        ])
        .arg("-I")
        .arg(repo().join("include"))
        .arg(repo().join("examples/c/transfer.c"))
        .arg("-o")
        .arg(&exe);
        if static_lib {
            // What a Rust static library needs from the system on Linux
            // (`rustc --print native-static-libs`).
            cc.arg(lib.join("libmultirail.a")).args([
                "-lgcc_s",
                "-lutil",
                "-lrt",
                "-lpthread",
                "-lm",
                "-ldl",
                "-lc",
            ]);
        } else {
            cc.arg("-L")
                .arg(&lib)
                .arg("-lmultirail")
                .arg(format!("-Wl,-rpath,{}", lib.display()));
        }
        let out = cc
            .output()
            .expect("running cc (install a C compiler: scripts/setup)");
        assert!(
            out.status.success(),
            "cc failed to build examples/c/transfer.c:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        exe
    })
    .clone()
}

/// Waits for `child` up to `limit`, killing it when it takes longer.
fn wait_for(mut child: Child, limit: Duration, what: &str) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait().expect("waiting for a child") {
            Some(_) => return child.wait_with_output().expect("collecting output"),
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let out = child.wait_with_output().expect("collecting output");
                panic!(
                    "{what} did not finish within {limit:?}; stdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Kills the target if the test fails before it is waited for.
struct Reap(Option<Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Builds a command running `exe`, under `wrapper` (e.g. valgrind) when it is not empty.
fn command(wrapper: &[String], exe: &Path) -> Command {
    match wrapper.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(exe);
            c
        }
        None => Command::new(exe),
    }
}

/// Runs the target and the initiator of `exe` with configuration `config`, each under
/// `wrapper`; checks both exit 0 having verified every byte. Returns both stderr outputs.
fn run_pair(
    exe: &Path,
    config: &str,
    len: u64,
    rounds: u32,
    wrapper: &[String],
    limit: Duration,
) -> (String, String) {
    let started = Instant::now();
    let mut target = command(wrapper, exe)
        .args(["target", config, &len.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the target");
    // The target prints SEGMENT, ADDR and LEN lines; read them on a thread so a target that
    // hangs cannot hang the test.
    let stdout = target.stdout.take().expect("target stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut reap = Reap(Some(target));
    let (mut segment, mut addr) = (String::new(), String::new());
    let mut target_lines = Vec::new();
    loop {
        let line = match rx.recv_timeout(limit.saturating_sub(started.elapsed())) {
            Ok(line) => line,
            Err(_) => {
                let target = reap.0.take().expect("target");
                let out = wait_for(target, Duration::from_secs(5), "the target");
                panic!(
                    "the target never printed its buffer; stderr:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        };
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("SEGMENT"), Some(s)) => segment = s.to_owned(),
            (Some("ADDR"), Some(a)) => addr = a.to_owned(),
            (Some("LEN"), Some(l)) => {
                assert_eq!(l, len.to_string());
                break;
            }
            _ => target_lines.push(line),
        }
    }
    let initiator = command(wrapper, exe)
        .args([
            "initiator",
            &segment,
            &addr,
            &len.to_string(),
            config,
            &rounds.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the initiator");
    let initiator = wait_for(initiator, limit, "the initiator");
    // The initiator is done with the target's memory: closing its stdin stops it.
    let mut target = reap.0.take().expect("target");
    drop(target.stdin.take());
    let target = wait_for(target, limit, "the target");
    // Its stdout has ended, but the reader thread may not have handed over the last lines yet
    // (the target's verdict among them): take them until it finishes.
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        target_lines.push(line);
    }
    let (i_out, i_err) = (
        String::from_utf8_lossy(&initiator.stdout).into_owned(),
        String::from_utf8_lossy(&initiator.stderr).into_owned(),
    );
    let t_err = String::from_utf8_lossy(&target.stderr).into_owned();
    let t_out = target_lines.join("\n");
    assert!(
        initiator.status.success() && target.status.success(),
        "initiator {} / target {} ({config}, {wrapper:?})\ninitiator stdout:\n{i_out}\n\
         initiator stderr:\n{i_err}\ntarget stdout:\n{t_out}\ntarget stderr:\n{t_err}",
        initiator.status,
        target.status,
    );
    // Every round wrote and read back the whole buffer, plus the first transfer and the last
    // write the target checked itself.
    let verified = len * (u64::from(rounds) + 2);
    assert!(
        i_out.contains(&format!("INITIATOR OK verified {verified} bytes")),
        "initiator stdout: {i_out}"
    );
    assert!(
        t_out.contains(&format!("TARGET OK verified {len} bytes")),
        "target stdout: {t_out}"
    );
    eprintln!(
        "{config} {wrapper:?}: {} in {:.1?}",
        i_out.trim(),
        started.elapsed()
    );
    (i_err, t_err)
}

const SHM: &str = r#"{"transport":"shm"}"#;
const TCP: &str = r#"{"transport":"tcp"}"#;

#[test]
fn c_example_moves_verified_bytes_over_shm() {
    run_pair(&compile(false), SHM, 1 << 20, 3, &[], PLAIN_LIMIT);
}

#[test]
fn c_example_moves_verified_bytes_over_tcp() {
    run_pair(&compile(false), TCP, 1 << 20, 3, &[], PLAIN_LIMIT);
}

#[test]
fn c_example_links_against_the_static_library() {
    run_pair(&compile(true), TCP, 256 << 10, 1, &[], PLAIN_LIMIT);
}

#[test]
fn header_compiles_as_cpp20() {
    let out = Command::new("c++")
        .args([
            "-std=c++20",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-fsyntax-only",
        ])
        .args(["-x", "c++"])
        .arg(repo().join("include/multirail.h"))
        .output()
        .expect("running c++ (install g++: scripts/setup)");
    assert!(
        out.status.success(),
        "include/multirail.h does not compile as C++20:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// valgrind's command line, or a failure saying how to install it.
fn valgrind() -> Vec<String> {
    let found = Command::new("valgrind")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "valgrind is not installed; install it with `apt-get install valgrind` \
         (scripts/setup --tests does)"
    );
    let supp = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/valgrind.supp");
    vec![
        "valgrind".into(),
        "--tool=memcheck".into(),
        "--error-exitcode=99".into(),
        format!("--suppressions={}", supp.display()),
        "--quiet".into(),
    ]
}

/// Under valgrind a peer answers far more slowly: a longer tcp timeout keeps slow answers
/// from counting as a dead peer.
fn under_valgrind(transport: &str) -> String {
    format!(r#"{{"transport":"{transport}","transports":{{"tcp":{{"timeout_ms":60000}}}}}}"#)
}

#[test]
fn c_example_is_clean_under_valgrind() {
    let valgrind = valgrind();
    let exe = compile(false);
    for transport in ["shm", "tcp"] {
        let (i_err, t_err) = run_pair(
            &exe,
            &under_valgrind(transport),
            64 << 10,
            1,
            &valgrind,
            VALGRIND_LIMIT,
        );
        // --error-exitcode makes any error fail the run above; an error report on stderr
        // without it would mean the option was lost.
        for err in [i_err, t_err] {
            assert!(
                !err.contains("Invalid read")
                    && !err.contains("Invalid write")
                    && !err.contains("uninitialised"),
                "valgrind reported errors:\n{err}"
            );
        }
    }
}
