//! `--metrics ADDR:PORT` on `multirail target` and `multirail bench`: each prints the URL of
//! its engine's Prometheus endpoint on stderr, and scrapes of it show what the engine counts.
//! Rail byte counters belong to the initiator (the bench); the target counts the connections
//! it serves.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{ChildStderr, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{multirail, multirail_bin, TargetProcess};

/// Reads `stderr` until the `metrics: URL` line and returns the address in it; the rest of
/// stderr is drained by a thread (so the process never blocks on a full pipe) and comes back
/// through the returned receiver when the pipe closes.
fn metrics_addr(stderr: ChildStderr) -> (SocketAddr, mpsc::Receiver<String>) {
    let (addr_tx, addr_rx) = mpsc::channel();
    let (rest_tx, rest_rx) = mpsc::channel();
    thread::spawn(move || {
        let mut seen = String::new();
        let mut lines = BufReader::new(stderr).lines();
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(url) = line.strip_prefix("metrics: ") {
                let _ = addr_tx.send(Ok(url.to_owned()));
                break;
            }
            seen.push_str(&line);
            seen.push('\n');
        }
        // Reached only without the line: report what came instead.
        let _ = addr_tx.send(Err(seen.clone()));
        for line in lines.map_while(Result::ok) {
            seen.push_str(&line);
            seen.push('\n');
        }
        let _ = rest_tx.send(seen);
    });
    let url = match addr_rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(url)) => url,
        Ok(Err(seen)) => panic!("no `metrics: URL` line on stderr; it said: {seen}"),
        Err(_) => panic!("no `metrics: URL` line on stderr within 60 s"),
    };
    let addr = url
        .strip_prefix("http://")
        .and_then(|u| u.strip_suffix("/metrics"))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("{url:?} is not http://ADDR:PORT/metrics"));
    (addr, rest_rx)
}

/// `GET /metrics` at `addr`, asking for OpenMetrics as Prometheus does: the body of a complete 200 answer, or `None` when the endpoint
/// does not answer (gone, or going) or answers anything else. Gives up after 10 s.
fn try_scrape(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: application/openmetrics-text\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let complete = head.starts_with("HTTP/1.1 200 ")
        && head
            .to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8")
        && body.ends_with("# EOF\n");
    complete.then(|| body.to_owned())
}

/// Sum of the samples of `name` (exactly that sample name) whose labels include every one of
/// `labels` (`key="value"`).
fn sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            (n == name && labels.iter().all(|want| rest.contains(want)))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// Every family in `text` has a HELP line.
fn assert_every_family_has_help(text: &str) {
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line["# TYPE ".len()..].split(' ').next().unwrap();
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has a HELP text"
        );
    }
}

#[test]
fn target_and_bench_serve_what_their_engines_count() {
    let mut target =
        TargetProcess::start_configured("64MiB", None, &["--metrics", "127.0.0.1:0"], |cmd| {
            cmd.stderr(Stdio::piped());
        });
    let (target_addr, _target_rest) = metrics_addr(target.child.stderr.take().unwrap());
    assert_ne!(target_addr.port(), 0, "the port picked is printed");
    let before = try_scrape(target_addr).expect("the target answers");
    assert_every_family_has_help(&before);
    assert_eq!(
        sum(&before, "multirail_connections_accepted_total", &[]),
        0.0
    );
    let info = format!("segment=\"{}\"", target.name);
    assert_eq!(sum(&before, "multirail_engine_info", &[&info]), 1.0);

    let mut bench = Command::new(multirail_bin())
        .args(["bench", "--target", &target.name])
        .args(["--op", "write", "--block-size", "1MiB", "--duration", "2"])
        .args(["--transport", "tcp", "--json", "--metrics", "127.0.0.1:0"])
        .env_remove("MULTIRAIL_CONF")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start bench");
    let (bench_addr, bench_rest) = metrics_addr(bench.stderr.take().unwrap());
    let mut stdout = bench.stdout.take().unwrap();
    let report = thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    // Scrape the bench while it runs, until its endpoint goes away with it.
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut scrapes, mut most) = (0, 0.0f64);
    let mut last = String::new();
    while Instant::now() < deadline {
        match try_scrape(bench_addr) {
            Some(text) => {
                scrapes += 1;
                let bytes = sum(&text, "multirail_rail_bytes_total", &[]);
                assert!(bytes >= most, "rail byte counters never go down");
                most = bytes;
                last = text;
            }
            None => {
                if bench.try_wait().unwrap().is_some() {
                    break;
                }
            }
        }
        thread::sleep(Duration::from_millis(50));
    }
    let status = bench.wait().unwrap();
    let errors = bench_rest
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_default();
    assert!(status.success(), "bench exited {status}: {errors}");
    let report: serde_json::Value =
        serde_json::from_str(&report.join().unwrap()).expect("one JSON object on stdout");
    let reported = report["bytes"].as_u64().unwrap();
    let rail_bytes: u64 = report["rails"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["bytes"].as_u64().unwrap())
        .sum();
    assert!(reported > 0, "the bench moved bytes");
    assert!(scrapes > 0, "the bench's endpoint answered while it ran");
    assert_every_family_has_help(&last);
    // The bench's engine initiated every write: its rail counters show them, at the bench's
    // priority (high), and a scrape during the run saw no more than the rails carried in all.
    assert!(most > 0.0, "a scrape during the run saw rail bytes");
    assert!(
        most <= rail_bytes as f64,
        "scraped {most} bytes, more than the {rail_bytes} the report's rails carried"
    );
    assert_eq!(
        sum(&last, "multirail_rail_bytes_total", &["priority=\"high\""]),
        most,
        "every byte at high priority"
    );
    // Every batch the report counts completed, so the rails carried at least those bytes.
    assert!(rail_bytes >= reported, "{rail_bytes} < {reported}");

    // The target served the writes: it counts the bench's connections, and no rail bytes of
    // its own (its rails count only transfers it initiates).
    let after = try_scrape(target_addr).expect("the target still answers");
    assert!(sum(&after, "multirail_connections_accepted_total", &[]) >= 1.0);
    assert_eq!(sum(&after, "multirail_rail_bytes_total", &[]), 0.0);
    drop(target);
}

#[test]
fn a_metrics_port_in_use_is_a_runtime_error_naming_it() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = multirail(&[
        "target",
        "--listen",
        "127.0.0.1:0",
        "--size",
        "1MiB",
        "--metrics",
        &addr,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&addr), "the error names {addr}: {stderr}");

    let out = multirail(&[
        "target",
        "--listen",
        "127.0.0.1:0",
        "--size",
        "1MiB",
        "--metrics",
        "not-an-address",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--metrics"), "{stderr}");
}
