//! `Engine::serve_metrics`: an engine moves bytes over tcp to another, and its `/metrics`
//! endpoint, scraped with a plain HTTP request, shows them; other paths are 404; a port in use
//! is refused naming the address; a dropped engine answers 503 without hanging.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use multirail::{Config, Engine, Error, Location, Request, TransportChoice, PRIO_LOW};

mod common;

/// An HTTP answer: status code, headers (names lowercased) and body.
struct Answer {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

/// Sends `METHOD path` to `addr` with `Connection: close` and reads the whole answer. Every
/// read and write gives up after 10 s, so a server that hangs fails the test instead.
fn http(addr: SocketAddr, method: &str, path: &str) -> std::io::Result<Answer> {
    http_with(addr, method, path, "")
}

/// As [`http`], with `headers` (each ending in `\r\n`) added to the request.
fn http_with(addr: SocketAddr, method: &str, path: &str, headers: &str) -> std::io::Result<Answer> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{headers}\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8(raw).expect("the answer is UTF-8");
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of headers in {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {head:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(Answer {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// One sample of the exposition.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A parsed exposition: the samples, and the HELP and TYPE of each family.
struct Exposition {
    samples: Vec<Sample>,
    help: HashMap<String, String>,
    types: HashMap<String, String>,
}

impl Exposition {
    /// Parses the OpenMetrics text format as prometheus-client writes it (label values with
    /// `\"`, `\\` and `\n` escapes). Panics on anything else, which fails the test.
    fn parse(text: &str) -> Exposition {
        let mut e = Exposition {
            samples: Vec::new(),
            help: HashMap::new(),
            types: HashMap::new(),
        };
        assert!(text.ends_with("# EOF\n"), "exposition ends with # EOF");
        for line in text.lines() {
            if line == "# EOF" {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').expect("HELP name text");
                e.help.insert(name.to_owned(), help.to_owned());
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE name type");
                e.types.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if line.starts_with("# UNIT ") {
                continue;
            }
            assert!(!line.starts_with('#'), "unknown comment line {line:?}");
            let (series, value) = line.rsplit_once(' ').expect("sample has a value");
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("value of {line:?}"));
            let (name, labels) = match series.split_once('{') {
                None => (series.to_owned(), BTreeMap::new()),
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').expect("labels end with }");
                    (name.to_owned(), parse_labels(body))
                }
            };
            e.samples.push(Sample {
                name,
                labels,
                value,
            });
        }
        e
    }

    /// The family a sample belongs to: its name without the `_total` of a counter or the
    /// `_info` of an info metric.
    fn family_of(&self, sample: &str) -> String {
        for (suffix, kind) in [
            ("_total", "counter"),
            ("_info", "info"),
            ("_bucket", "histogram"),
            ("_sum", "histogram"),
            ("_count", "histogram"),
        ] {
            if let Some(base) = sample.strip_suffix(suffix) {
                if self.types.get(base).map(String::as_str) == Some(kind) {
                    return base.to_owned();
                }
            }
        }
        sample.to_owned()
    }

    fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    fn sum(&self, name: &str) -> f64 {
        self.named(name).map(|s| s.value).sum()
    }

    fn sum_where(&self, name: &str, key: &str, value: &str) -> f64 {
        self.named(name)
            .filter(|s| s.labels.get(key).map(String::as_str) == Some(value))
            .map(|s| s.value)
            .sum()
    }
}

fn parse_labels(body: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut chars = body.chars().peekable();
    while chars.peek().is_some() {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        assert_eq!(chars.next(), Some('"'), "label value is quoted in {body:?}");
        let mut value = String::new();
        loop {
            match chars.next().expect("label value ends") {
                '"' => break,
                '\\' => match chars.next().expect("escape") {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                c => value.push(c),
            }
        }
        labels.insert(key, value);
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    labels
}

/// Scrapes `/metrics` at `addr`, checks the answer is a well-formed exposition in which every
/// sample's family has a HELP text and a TYPE, and parses it.
/// What Prometheus sends: it gets OpenMetrics.
const ACCEPT_OPENMETRICS: &str =
    "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n";

fn scrape(addr: SocketAddr) -> Exposition {
    let a = http_with(addr, "GET", "/metrics", ACCEPT_OPENMETRICS).expect("scrape");
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        a.headers.get("content-type").map(String::as_str),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let e = Exposition::parse(&a.body);
    assert!(!e.samples.is_empty());
    for s in &e.samples {
        let family = e.family_of(&s.name);
        assert!(
            e.help.get(&family).is_some_and(|h| !h.is_empty()),
            "{} has a HELP text",
            s.name
        );
        assert!(e.types.contains_key(&family), "{} has a TYPE", s.name);
        assert!(
            s.name.starts_with("multirail_"),
            "{} is in the multirail namespace",
            s.name
        );
    }
    e
}

/// Writes `len` bytes of `src` at `off` to the same offset of `dst`, over tcp, and waits.
fn write(
    init: &Engine,
    seg: multirail::SegmentId,
    src: &multirail::Buffer,
    dst: &multirail::Buffer,
    off: u64,
    len: u64,
    priority: multirail::Priority,
) {
    let mut r = Request::write(src.addr() + off, seg, dst.addr() + off, len);
    r.transport = Some(TransportChoice::Tcp);
    r.priority = priority;
    let b = init.allocate_batch(1).unwrap();
    init.submit(b, &[r]).unwrap();
    init.wait(b, Some(Duration::from_secs(60))).unwrap();
    assert!(init.status(b, 0).unwrap().is_completed());
    init.free_batch(b).unwrap();
}

#[test]
fn rail_byte_counters_cover_the_bytes_moved_and_grow_with_the_next_transfer() {
    const FIRST: u64 = 8 << 20;
    const SECOND: u64 = 4 << 20;
    let target = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let dst = target
        .allocate((FIRST + SECOND) as usize, Location::Any)
        .unwrap();
    let init = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let src = init
        .allocate((FIRST + SECOND) as usize, Location::Any)
        .unwrap();
    // SAFETY: nothing is in flight on `src` yet.
    common::pattern(19, unsafe { src.as_mut_slice() });
    let metrics = init.serve_metrics("127.0.0.1:0").expect("metrics endpoint");
    assert_ne!(
        metrics.local_addr().port(),
        0,
        "the port picked is reported"
    );
    assert_eq!(
        metrics.url(),
        format!("http://{}/metrics", metrics.local_addr())
    );

    // Before any transfer: the engine and its rails are there, at 0.
    let e = scrape(metrics.local_addr());
    let info: Vec<_> = e.named("multirail_engine_info").collect();
    assert_eq!(info.len(), 1);
    assert_eq!(info[0].labels["segment"], init.name());
    assert_eq!(e.sum("multirail_rail_bytes_total"), 0.0);

    let seg = init.open_segment(&target.name()).unwrap();
    write(&init, seg, &src, &dst, 0, FIRST, multirail::PRIO_HIGH);
    let e = scrape(metrics.local_addr());
    let moved = e.sum("multirail_rail_bytes_total");
    assert!(
        moved >= FIRST as f64,
        "rail bytes {moved} cover the {FIRST} bytes written"
    );
    // Nothing else moved: the counters are the engine's own figures.
    let engine_bytes: u64 = init.traffic_stats().rails.iter().map(|r| r.bytes).sum();
    assert_eq!(moved, engine_bytes as f64);
    assert!(e.sum_where("multirail_rail_bytes_total", "priority", "high") >= FIRST as f64);
    assert!(e.sum("multirail_rail_slices_total") >= 1.0);
    assert_eq!(e.sum("multirail_rail_slice_errors_total"), 0.0);
    for s in e.named("multirail_rail_bytes_total") {
        assert!(s.labels.contains_key("rail") && s.labels.contains_key("priority"));
    }
    // Every priority has its queue figures, the wait at two percentiles.
    for p in ["high", "medium", "low"] {
        assert_eq!(
            e.named("multirail_qos_queued_entries")
                .filter(|s| s.labels["priority"] == p)
                .count(),
            1
        );
        // The wait histogram: buckets that only grow, ending at +Inf with the count.
        let buckets: Vec<&Sample> = e
            .named("multirail_qos_wait_seconds_bucket")
            .filter(|s| s.labels["priority"] == p)
            .collect();
        assert_eq!(buckets.last().unwrap().labels["le"], "+Inf");
        assert!(buckets.windows(2).all(|w| w[0].value <= w[1].value));
        assert_eq!(
            buckets.last().unwrap().value,
            e.sum_where("multirail_qos_wait_seconds_count", "priority", p)
        );
        if p == "high" {
            assert!(
                buckets.last().unwrap().value >= 1.0,
                "the high write's slices waited"
            );
        }
        for q in ["p50", "p99"] {
            let family = format!("multirail_qos_wait_{q}_seconds");
            assert_eq!(
                e.named(&family)
                    .filter(|s| s.labels["priority"] == p)
                    .count(),
                1
            );
            assert_eq!(e.types.get(&family).map(String::as_str), Some("gauge"));
        }
    }
    for name in [
        "multirail_connections_open",
        "multirail_connections_accepted_total",
        "multirail_rdma_slices_total",
        "multirail_lane_promotions_total",
        "multirail_lanes_dedicated",
    ] {
        assert!(e.named(name).count() >= 1, "{name} is exposed");
    }

    // A second transfer, at low priority: the counters grow by at least its bytes.
    write(&init, seg, &src, &dst, FIRST, SECOND, PRIO_LOW);
    let after = scrape(metrics.local_addr());
    let grown = after.sum("multirail_rail_bytes_total") - moved;
    assert!(
        grown >= SECOND as f64,
        "rail bytes grew by {grown}, at least the {SECOND} written"
    );
    assert!(after.sum_where("multirail_rail_bytes_total", "priority", "low") >= SECOND as f64);

    // Every byte landed.
    // SAFETY: both transfers completed; nothing writes these buffers now.
    unsafe { assert!(src.as_slice() == dst.as_slice(), "every byte landed") };

    // The target serves the transfers: it counts the connections, no rail traffic of its own
    // (rail counters belong to the engine that initiates a transfer), and every byte written
    // into its memory as served, at the priority each write was given.
    let target_metrics = target.serve_metrics("127.0.0.1:0").unwrap();
    let t = scrape(target_metrics.local_addr());
    assert!(t.sum("multirail_connections_accepted_total") >= 1.0);
    assert_eq!(t.sum("multirail_rail_bytes_total"), 0.0);
    assert_eq!(
        t.sum_where("multirail_served_bytes_total", "op", "write"),
        (FIRST + SECOND) as f64
    );
    assert_eq!(
        t.sum_where("multirail_served_bytes_total", "priority", "low"),
        SECOND as f64
    );
    assert_eq!(
        t.sum_where("multirail_served_bytes_total", "op", "read"),
        0.0
    );
    let served_writes = t.sum_where("multirail_served_requests_total", "op", "write");
    assert!(served_writes >= 2.0, "{served_writes} write slices served");
    assert_eq!(
        t.sum_where("multirail_served_peer_requests_total", "op", "write"),
        served_writes
    );
    assert_eq!(
        t.types
            .get("multirail_served_latency_seconds")
            .map(String::as_str),
        Some("histogram")
    );
    assert_eq!(
        t.sum_where("multirail_served_latency_seconds_count", "op", "write"),
        served_writes
    );
    // The initiator served nothing.
    assert_eq!(after.sum("multirail_served_bytes_total"), 0.0);
}

#[test]
fn other_paths_are_404_and_other_methods_405() {
    let engine = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let metrics = engine.serve_metrics("127.0.0.1:0").unwrap();
    let addr = metrics.local_addr();
    for path in ["/", "/metric", "/metrics/", "/metrics/x", "/favicon.ico"] {
        let a = http(addr, "GET", path).unwrap();
        assert_eq!(a.status, 404, "GET {path}");
    }
    let a = http(addr, "POST", "/metrics").unwrap();
    assert_eq!(a.status, 405);
    assert_eq!(
        a.headers.get("allow").map(String::as_str),
        Some("GET, HEAD")
    );
    let a = http(addr, "HEAD", "/metrics").unwrap();
    assert_eq!(a.status, 200);
    assert!(a.body.is_empty(), "HEAD has no body");
    // A query string does not change the path.
    assert_eq!(http(addr, "GET", "/metrics?x=1").unwrap().status, 200);
}

#[test]
fn a_port_in_use_is_refused_naming_the_address() {
    let engine = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let err = engine.serve_metrics(&addr).expect_err("the port is taken");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains(&addr), "{err} names {addr}");

    // Not an address at all: an argument error that quotes it.
    let err = engine
        .serve_metrics("no-such-address")
        .expect_err("not ADDR:PORT");
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains("no-such-address"), "{err}");
}

#[test]
fn a_dropped_engine_answers_503_and_shutdown_closes_the_port() {
    let engine = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let segment: SocketAddr = engine.name().parse().unwrap();
    let metrics = engine.serve_metrics("127.0.0.1:0").unwrap();
    let addr = metrics.local_addr();
    assert_eq!(http(addr, "GET", "/metrics").unwrap().status, 200);

    // The endpoint holds no strong handle: dropping the engine stops it (its control port
    // closes) and scrapes get 503, promptly.
    drop(engine);
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect_timeout(&segment, Duration::from_secs(1)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the engine's port still open: something keeps it alive"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let a = http(addr, "GET", "/metrics").expect("an answer, not a hang");
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(http(addr, "GET", "/elsewhere").unwrap().status, 404);

    // Shutting the server down returns and closes its port.
    let (done, waited) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        metrics.shutdown();
        let _ = done.send(());
    });
    waited
        .recv_timeout(Duration::from_secs(10))
        .expect("shutdown returns");
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok() {
        assert!(Instant::now() < deadline, "the metrics port still open");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The Prometheus text format, served without an OpenMetrics `Accept` (curl), passes
/// `promtool check metrics` (Debian's `prometheus` package; `scripts/setup --tests` installs
/// it), with the rail health, message and metadata figures counting what happened.
#[test]
fn health_message_and_metadata_metrics_count_and_promtool_accepts_the_text_format() {
    let target = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let dst = target.allocate(1 << 20, Location::Any).unwrap();
    let init = Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts");
    let src = init.allocate(1 << 20, Location::Any).unwrap();
    let metrics = init.serve_metrics("127.0.0.1:0").unwrap();
    let target_metrics = target.serve_metrics("127.0.0.1:0").unwrap();

    let seg = init.open_segment(&target.name()).unwrap();
    assert!(
        init.open_segment("127.0.0.1:1").is_err(),
        "nothing listens there"
    );
    write(&init, seg, &src, &dst, 0, 1 << 20, multirail::PRIO_HIGH);
    for i in 0..3u8 {
        init.send(seg, &[i; 100]).unwrap();
    }
    for _ in 0..3 {
        let m = target
            .recv(Some(Duration::from_secs(10)))
            .unwrap()
            .expect("message arrives");
        assert_eq!(m.data.len(), 100);
    }

    let e = scrape(metrics.local_addr());
    assert_eq!(
        e.sum_where("multirail_metadata_lookups_total", "outcome", "ok"),
        1.0
    );
    assert_eq!(
        e.sum_where("multirail_metadata_lookups_total", "outcome", "failed"),
        1.0
    );
    // Peer-to-peer lookups keep nothing in a store: its state says so, one-hot.
    assert_eq!(
        e.sum_where("multirail_metadata_store_state", "state", "not_used"),
        1.0
    );
    assert_eq!(
        e.sum_where("multirail_metadata_store_state", "state", "up"),
        0.0
    );
    assert_eq!(
        e.sum_where("multirail_messages_total", "direction", "sent"),
        3.0
    );
    assert_eq!(
        e.sum_where("multirail_message_bytes_total", "direction", "sent"),
        300.0
    );
    assert_eq!(e.sum("multirail_message_send_failures_total"), 0.0);
    assert!(
        e.sum_where("multirail_rail_paths", "state", "up") >= 1.0,
        "the path used is up"
    );
    assert_eq!(e.sum_where("multirail_rail_paths", "state", "paused"), 0.0);
    let t = scrape(target_metrics.local_addr());
    assert_eq!(
        t.sum_where("multirail_messages_total", "direction", "received"),
        3.0
    );
    assert_eq!(
        t.sum_where("multirail_message_bytes_total", "direction", "received"),
        300.0
    );
    assert_eq!(
        e.sum_where("multirail_transfers_total", "outcome", "completed"),
        1.0
    );
    assert_eq!(
        e.sum_where("multirail_transfers_total", "outcome", "failed"),
        0.0
    );
    assert_eq!(init.metadata_stats().lookups, 2);
    assert_eq!(init.message_stats().sent, 3);

    let plain = http(metrics.local_addr(), "GET", "/metrics").unwrap();
    assert_eq!(plain.status, 200);
    assert_eq!(
        plain.headers.get("content-type").map(String::as_str),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    assert!(!plain.body.contains("# EOF"));
    assert!(plain
        .body
        .contains("# TYPE multirail_rail_bytes_total counter"));
    assert!(plain.body.contains("# TYPE multirail_engine_info gauge"));
    let promtool = std::env::var("MULTIRAIL_PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let mut child = std::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run {promtool:?} ({e}): apt-get install prometheus (scripts/test does)")
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(plain.body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
