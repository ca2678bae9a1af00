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
