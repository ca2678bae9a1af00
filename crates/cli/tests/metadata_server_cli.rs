//! `multirail metadata-server` as a user runs it: the URL on the first line, Mooncake's
//! protocol on it, and with `--data-dir` the keys served again after a restart.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A server child and the URL it printed.
struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .arg("metadata-server")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start multirail metadata-server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let url = line.trim().to_owned();
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with("/metadata"),
        "first line: {line:?}"
    );
    Server { child, url }
}

/// One HTTP/1.1 request by hand; returns the status code and the body.
fn request(url: &str, method: &str, query: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let rest = url.strip_prefix("http://").expect("http url");
    let (host, path) = rest.split_once('/').expect("path");
    let mut s = TcpStream::connect(host).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!(
        "{method} /{path}?{query} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).expect("answer");
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let status_line = String::from_utf8_lossy(&answer[..split]).into_owned();
    let code = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    (code, answer[split + 4..].to_vec())
}

#[test]
fn keys_survive_a_restart_with_a_data_dir() {
    let dir = std::env::temp_dir().join(format!("mr-meta-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_arg = dir.to_str().unwrap().to_owned();
    let value = b"{\"segment\": \"127.0.0.1:12345\"}";
    {
        let server = start(&["--data-dir", &dir_arg]);
        assert_eq!(
            request(&server.url, "GET", "key=mooncake%2Fram%2Fa", b"").0,
            404
        );
        assert_eq!(
            request(&server.url, "PUT", "key=mooncake%2Fram%2Fa", value).0,
            200
        );
        let (code, body) = request(&server.url, "GET", "key=mooncake%2Fram%2Fa", b"");
        assert_eq!((code, body.as_slice()), (200, &value[..]));
        assert_eq!(request(&server.url, "PUT", "key=gone", b"x").0, 200);
        assert_eq!(request(&server.url, "DELETE", "key=gone", b"").0, 200);
    }
    let server = start(&["--data-dir", &dir_arg]);
    let (code, body) = request(&server.url, "GET", "key=mooncake%2Fram%2Fa", b"");
    assert_eq!((code, body.as_slice()), (200, &value[..]), "after restart");
    assert_eq!(request(&server.url, "GET", "key=gone", b"").0, 404);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_value_over_the_limit_is_refused_with_413() {
    let server = start(&["--max-value-size", "1KiB"]);
    assert_eq!(request(&server.url, "PUT", "key=big", &[7u8; 2048]).0, 413);
    assert_eq!(request(&server.url, "GET", "key=big", b"").0, 404);
}

#[test]
fn a_port_in_use_is_a_clear_error() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["metadata-server", "--listen", &addr])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot listen on {addr}")), "{err}");
}

/// A child process killed at the end of a test.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn engines_started_with_metadata_find_each_other_through_the_server() {
    let server = start(&[]);
    let mut target = Killed(
        Command::new(env!("CARGO_BIN_EXE_multirail"))
            .args(["target", "--size", "16MiB", "--listen", "127.0.0.1:0"])
            .args(["--metadata", &server.url])
            .env_remove("MULTIRAIL_CONF")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start target"),
    );
    let mut line = String::new();
    BufReader::new(target.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("segment name");
    let name = line.trim().to_owned();
    let key = format!("key=multirail%2F{}", name.replace(':', "%3A"));
    let (code, body) = request(&server.url, "GET", &key, b"");
    assert_eq!(code, 200, "the target published its descriptor");
    assert!(String::from_utf8_lossy(&body).contains(&name));
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["bench", "--target", &name, "--op", "write"])
        .args([
            "--block-size",
            "1MiB",
            "--duration",
            "1",
            "--transport",
            "tcp",
        ])
        .args(["--json", "--metadata", &server.url])
        .env_remove("MULTIRAIL_CONF")
        .output()
        .expect("run bench");
    assert!(out.status.success(), "{out:?}");
    // A name the store does not know is an error naming the store.
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["bench", "--target", "127.0.0.1:1", "--op", "write"])
        .args([
            "--block-size",
            "1MiB",
            "--duration",
            "1",
            "--transport",
            "tcp",
        ])
        .args(["--metadata", &server.url])
        .env_remove("MULTIRAIL_CONF")
        .output()
        .expect("run bench");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&server.url), "{err}");
}

#[test]
fn metadata_flag_takes_etcd_and_refuses_other_schemes_with_a_reason() {
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["--metadata", "etcd://127.0.0.1:2379", "config", "show"])
        .env_remove("MULTIRAIL_CONF")
        .output()
        .expect("run");
    assert!(out.status.success(), "{out:?}");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains(r#""type": "etcd""#), "{shown}");
    assert!(shown.contains("etcd://127.0.0.1:2379"), "{shown}");
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["--metadata", "zk://127.0.0.1:2181", "config", "show"])
        .env_remove("MULTIRAIL_CONF")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("etcd://HOST:PORT"), "{err}");
}

/// Runs `multirail metadata-server ARGS` expecting it to exit at once; returns the exit code and
/// standard error.
fn run_failing(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .arg("metadata-server")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::null())
        .output()
        .expect("run");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The only line of `stderr`, checked to say `words` and to carry no OS error twice.
fn one_clear_line(stderr: &str, words: &[&str]) {
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    for w in words {
        assert!(lines[0].contains(w), "{w:?} not in {stderr}");
    }
    if let Some(at) = lines[0].find("(os error") {
        assert!(
            !lines[0][at + 1..].contains("(os error"),
            "the OS error is repeated: {stderr}"
        );
    }
}

#[test]
fn a_data_dir_that_cannot_be_used_is_a_usage_error_naming_the_flag() {
    let dir = std::env::temp_dir().join(format!("mr-meta-cli-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let file_arg = file.to_str().unwrap();

    let (code, err) = run_failing(&["--data-dir", file_arg]);
    assert_eq!(code, Some(2), "{err}");
    one_clear_line(&err, &["--data-dir", file_arg, "not a directory"]);

    let under = file.join("sub");
    let (code, err) = run_failing(&["--data-dir", under.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    one_clear_line(
        &err,
        &[
            "--data-dir",
            "cannot be created",
            &format!("{file_arg} is not a directory"),
        ],
    );

    // Root writes anywhere: a read-only directory only stops other users.
    if unsafe { libc::geteuid() } == 0 {
        eprintln!("skipping the unwritable --data-dir case: running as root");
    } else {
        use std::os::unix::fs::PermissionsExt;
        let locked = dir.join("locked");
        std::fs::create_dir(&locked).unwrap();
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o500)).unwrap();
        let (code, err) = run_failing(&["--data-dir", locked.to_str().unwrap()]);
        assert_eq!(code, Some(2), "{err}");
        one_clear_line(&err, &["--data-dir", "is not writable"]);
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn other_flag_errors_are_one_line() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["metadata-server", "--listen", &addr])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    one_clear_line(
        &String::from_utf8_lossy(&out.stderr),
        &["cannot listen on", &addr, "os error"],
    );
    let (code, err) = run_failing(&["--max-connections", "0"]);
    assert_eq!(code, Some(2), "{err}");
    one_clear_line(&err, &["--max-connections"]);
}

#[test]
fn key_ttl_out_of_its_range_is_a_usage_error_naming_the_flag() {
    for bad in ["86401", "-1", "1.5", "soon"] {
        let (code, err) = run_failing(&["--key-ttl-s", bad]);
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("--key-ttl-s"), "{bad}: {err}");
    }
    let help = Command::new(env!("CARGO_BIN_EXE_multirail"))
        .args(["metadata-server", "--help"])
        .output()
        .expect("run");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--key-ttl-s"), "{help}");
    assert!(help.contains("1 to 86400"), "{help}");
}

#[test]
fn with_key_ttl_a_key_not_put_again_is_gone() {
    let server = start(&["--key-ttl-s", "1"]);
    assert_eq!(request(&server.url, "PUT", "key=engine", b"v").0, 200);
    let put_at = std::time::Instant::now();
    assert_eq!(request(&server.url, "GET", "key=engine", b"").0, 200);
    loop {
        let code = request(&server.url, "GET", "key=engine", b"").0;
        if code == 404 {
            break;
        }
        assert_eq!(code, 200);
        assert!(
            put_at.elapsed() < Duration::from_secs(2),
            "still there 2 s after its last PUT with --key-ttl-s 1"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(put_at.elapsed() >= Duration::from_millis(900));
    let metrics_url = server.url.replace("/metadata", "/metrics");
    let (code, body) = request(&metrics_url, "GET", "", b"");
    assert_eq!(code, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("multirail_metadata_keys_expired_total 1"),
        "{text}"
    );
}
