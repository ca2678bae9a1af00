//! A target counts what it serves: the bytes and requests peers read from and write into its
//! memory over tcp, per rail, operation, priority and peer (at most `MAX_SERVED_PEERS` peers
//! apart, the rest as `other`), and how long serving took; `traffic_stats().served`, the
//! traffic report and `/metrics` all show it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use multirail::transport::handshake::{self, Membership};
use multirail::transport::wire::{self, ConnKind, RequestHeader, RequestOp};
use multirail::{
    Config, Engine, Location, Opcode, Priority, Request, ServedTraffic, TransportChoice,
    MAX_SERVED_PEERS, PRIO_HIGH, PRIO_LOW, PRIO_MEDIUM,
};
use multirail_policy::slicing::SlicePlan;

mod common;

fn engine() -> Engine {
    Engine::new(Config::default(), "127.0.0.1:0").expect("engine starts")
}

/// Runs `reqs` over tcp in one batch and waits for all of them.
fn run(init: &Engine, reqs: &[Request]) {
    let reqs: Vec<Request> = reqs
        .iter()
        .map(|r| Request {
            transport: Some(TransportChoice::Tcp),
            ..*r
        })
        .collect();
    common::run_batch(init, &reqs);
}

/// Slices the initiator cuts `r` into, as its configuration plans them.
fn slices(config: &Config, r: &Request) -> u64 {
    let w = &config.workers;
    let cap = match r.opcode {
        Opcode::Read => w.max_slices_per_request,
        Opcode::Write => w.max_slices_per_write,
    };
    u64::from(
        SlicePlan::new(w.block_size, cap)
            .unwrap()
            .count(r.length)
            .unwrap(),
    )
}

/// The target's served figures once `done` holds of them; READs are counted once their answer
/// is handed to the socket, which may be just after the initiator has the bytes.
fn served_when(target: &Engine, done: impl Fn(&ServedTraffic) -> bool) -> ServedTraffic {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = target.traffic_stats().served;
        if done(&s) || Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `GET /metrics` in the Prometheus text format (what curl and promtool read), over HTTP/1.0
/// so that a large answer is not chunked.
fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(
        head.lines().next().is_some_and(|l| l.contains(" 200 ")),
        "{head}"
    );
    body.to_owned()
}

/// Samples of a text exposition: (name, labels, value).
fn samples(text: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("a value");
            let value = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("value of {l:?}")),
            };
            let (name, labels) = match series.split_once('{') {
                None => (series.to_owned(), BTreeMap::new()),
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').expect("labels end with }");
                    let labels = body
                        .split(',')
                        .filter(|kv| !kv.is_empty())
                        .map(|kv| {
                            let (k, v) = kv.split_once('=').expect("label=value");
                            (k.to_owned(), v.trim_matches('"').to_owned())
                        })
                        .collect();
                    (name.to_owned(), labels)
                }
            };
            (name, labels, value)
        })
        .collect()
}

/// Sum of the samples named `name` whose labels include every pair of `with`.
fn sum(text: &str, name: &str, with: &[(&str, &str)]) -> f64 {
    samples(text)
        .into_iter()
        .filter(|(n, labels, _)| {
            n == name
                && with
                    .iter()
                    .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// `promtool check metrics` accepts `text` (Debian's `prometheus` package).
fn promtool_accepts(text: &str) {
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
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

const PRIORITIES: [(Priority, &str); 3] = [
    (PRIO_HIGH, "high"),
    (PRIO_MEDIUM, "medium"),
    (PRIO_LOW, "low"),
];

#[test]
fn a_target_counts_the_reads_and_writes_it_serves_in_stats_report_and_metrics() {
    const LEN: usize = 12 << 20;
    let target = engine();
    let dst = target.allocate(LEN, Location::Any).unwrap();
    let mut config = Config::default();
    // Slices of the planned size, whatever the rail's estimate (over a fast rail tcp slices
    // grow with it: `slice_time_us`), so the counts below are exact.
    config.transports.tcp.slice_time_us = 0;
    // Nor are bulk slices cut to what the rail moves in the HIGH wait while HIGH counts as
    // active (10 ms after its last slice): how small that is depends on the estimate, which
    // the first requests' timing sets.
    config.workers.bulk_chunk_wait_us = 1_000_000;
    let init = Engine::new(config.clone(), "127.0.0.1:0").expect("engine starts");
    let src = init.allocate(LEN, Location::Any).unwrap();
    let back = init.allocate(LEN, Location::Any).unwrap();
    // SAFETY: nothing is in flight on these buffers yet.
    unsafe {
        common::pattern(5, src.as_mut_slice());
        common::pattern(6, dst.as_mut_slice());
    }
    let metrics = target.serve_metrics("127.0.0.1:0").unwrap();

    // Nothing served yet: no rail or peer counted, the latency empty; the target's own rail
    // is in /metrics at 0.
    let before = target.traffic_stats().served;
    assert_eq!(before.read().bytes + before.write().bytes, 0);
    assert!(before.peers.is_empty(), "{:?}", before.peers);
    assert_eq!(before.max_peers, MAX_SERVED_PEERS);
    let text = scrape(metrics.local_addr());
    assert_eq!(sum(&text, "multirail_served_bytes_total", &[]), 0.0);
    assert!(
        text.contains("multirail_served_bytes_total{"),
        "the target's rails are exposed before they serve"
    );

    let seg = init.open_segment(&target.name()).unwrap();
    // Writes at each priority, some of one slice and some of several (a merged tail too),
    // into the first half of the target's buffer; reads from its second half.
    let writes = [
        (PRIO_HIGH, 0u64, 1000u64),
        (PRIO_HIGH, 4096, 64 << 10),
        (PRIO_MEDIUM, 1 << 20, (200 << 10) + 7),
        (PRIO_LOW, 2 << 20, (1 << 20) + 5),
    ];
    let reads = [
        (PRIO_HIGH, 4u64 << 20, 4096u64),
        (PRIO_MEDIUM, 5 << 20, 300 << 10),
        (PRIO_LOW, 6 << 20, (2 << 20) + 3),
    ];
    let write_reqs: Vec<Request> = writes
        .iter()
        .map(|&(p, off, len)| Request {
            priority: p,
            ..Request::write(src.addr() + off, seg, dst.addr() + off, len)
        })
        .collect();
    let read_reqs: Vec<Request> = reads
        .iter()
        .map(|&(p, off, len)| Request {
            priority: p,
            ..Request::read(back.addr() + off, seg, dst.addr() + off, len)
        })
        .collect();
    let expect = |reqs: &[Request], p: Priority| -> (u64, u64) {
        reqs.iter()
            .filter(|r| r.priority == p)
            .fold((0, 0), |(b, n), r| (b + r.length, n + slices(&config, r)))
    };
    let total = |reqs: &[Request]| -> (u64, u64) {
        PRIORITIES.iter().fold((0, 0), |(b, n), (p, _)| {
            let (pb, pn) = expect(reqs, *p);
            (b + pb, n + pn)
        })
    };
    let (write_bytes, write_slices) = total(&write_reqs);
    let (read_bytes, read_slices) = total(&read_reqs);
    assert!(
        write_slices > write_reqs.len() as u64,
        "some writes span slices"
    );

    let sent_slices = |e: &Engine| {
        e.traffic_stats()
            .rails
            .iter()
            .map(|r| r.slices)
            .sum::<u64>()
    };
    // One request at a time: while HIGH work is active the dispatcher cuts bulk slices
    // smaller (to the rail's `high_wait_ns` worth, from its bandwidth estimate), so a batch
    // mixing priorities moves as many slices as the timing makes, not a planned number.
    for r in &write_reqs {
        run(&init, std::slice::from_ref(r));
    }
    let after_writes = sent_slices(&init);
    for r in &read_reqs {
        run(&init, std::slice::from_ref(r));
    }
    assert_eq!(
        sent_slices(&init) - after_writes,
        read_slices,
        "the initiator moved the slices planned"
    );
    assert_eq!(after_writes, write_slices);
    // Every byte landed both ways.
    // SAFETY: both batches completed; nothing writes these buffers now.
    unsafe {
        for &(_, off, len) in &writes {
            let r = off as usize..(off + len) as usize;
            assert!(
                src.as_slice()[r.clone()] == dst.as_slice()[r],
                "write at {off}"
            );
        }
        for &(_, off, len) in &reads {
            let r = off as usize..(off + len) as usize;
            assert!(
                back.as_slice()[r.clone()] == dst.as_slice()[r],
                "read at {off}"
            );
        }
    }

    // The writes are counted before they are acknowledged, the reads once answered.
    let served = served_when(&target, |s| s.read().requests >= read_slices);
    let (read, write) = (served.read(), served.write());
    assert_eq!(
        (write.bytes, write.requests, write.refused),
        (write_bytes, write_slices, 0)
    );
    assert_eq!(
        (read.bytes, read.requests, read.refused),
        (read_bytes, read_slices, 0)
    );
    for (i, (p, _)) in PRIORITIES.iter().enumerate() {
        assert_eq!(
            (write.priority_bytes[i], write.priority_requests[i]),
            expect(&write_reqs, *p),
            "writes at {p:?}"
        );
        assert_eq!(
            (read.priority_bytes[i], read.priority_requests[i]),
            expect(&read_reqs, *p),
            "reads at {p:?}"
        );
        // Every request served was timed.
        assert_eq!(served.write_latency[i].count, write.priority_requests[i]);
        assert_eq!(served.read_latency[i].count, read.priority_requests[i]);
        for l in [&served.write_latency[i], &served.read_latency[i]] {
            assert!(l.p50_us > 0.0 && l.p99_us >= l.p50_us, "{l:?}");
        }
    }
    // One rail, the target's own; one peer, the initiator's address.
    assert_eq!(served.rails.len(), 1, "{:?}", served.rails);
    let rail = &served.rails[0];
    assert!(
        target.rails().iter().any(|r| r.name == rail.name),
        "served rail {} is one of the target's rails",
        rail.name
    );
    assert_eq!(served.peers.len(), 1, "{:?}", served.peers);
    let peer = &served.peers[0];
    assert_eq!(peer.peer, "127.0.0.1");
    assert_eq!(
        (peer.write.bytes, peer.write.requests),
        (write_bytes, write_slices)
    );
    assert_eq!(
        (peer.read.bytes, peer.read.requests),
        (read_bytes, read_slices)
    );
    // The initiator served nothing: its figures are its rails'.
    let own = init.traffic_stats().served;
    assert_eq!(own.read().requests + own.write().requests, 0);

    // The report has a section of its own with the same figures.
    let report = target.traffic_stats_report();
    assert!(
        report.contains("=== Served Traffic Statistics ===\n"),
        "{report}"
    );
    let line = format!(
        "Rail {}: READ Bytes={read_bytes}, Requests={read_slices}, Refused=0; \
         WRITE Bytes={write_bytes}, Requests={write_slices}, Refused=0\n",
        rail.name
    );
    assert!(report.contains(&line), "{line:?} in\n{report}");
    let line = format!(
        "Peer 127.0.0.1: READ Bytes={read_bytes}, Requests={read_slices}; \
         WRITE Bytes={write_bytes}, Requests={write_slices}\n"
    );
    assert!(report.contains(&line), "{line:?} in\n{report}");
    let (hb, hn) = expect(&write_reqs, PRIO_HIGH);
    assert!(hb > 0);
    assert!(
        report.contains(&format!("WRITE HIGH: Requests={hn}, Latency p50=")),
        "{report}"
    );

    // /metrics: the same counts by rail, operation, priority and peer, the latency histogram
    // counting every request, and promtool accepts the text.
    let text = scrape(metrics.local_addr());
    for (op, bytes, requests, reqs) in [
        ("write", write_bytes, write_slices, &write_reqs),
        ("read", read_bytes, read_slices, &read_reqs),
    ] {
        let with = [("op", op)];
        assert_eq!(
            sum(&text, "multirail_served_bytes_total", &with),
            bytes as f64,
            "{op} bytes"
        );
        assert_eq!(
            sum(&text, "multirail_served_requests_total", &with),
            requests as f64
        );
        assert_eq!(sum(&text, "multirail_served_refused_total", &with), 0.0);
        assert_eq!(
            sum(
                &text,
                "multirail_served_peer_bytes_total",
                &[("op", op), ("peer", "127.0.0.1")]
            ),
            bytes as f64
        );
        assert_eq!(
            sum(&text, "multirail_served_peer_requests_total", &with),
            requests as f64
        );
        assert_eq!(
            sum(&text, "multirail_served_latency_seconds_count", &with),
            requests as f64
        );
        for (p, name) in PRIORITIES {
            let (pb, pn) = expect(reqs, p);
            let with = [("op", op), ("priority", name), ("rail", rail.name.as_str())];
            assert_eq!(
                sum(&text, "multirail_served_bytes_total", &with),
                pb as f64,
                "{op} {name}"
            );
            assert_eq!(
                sum(&text, "multirail_served_requests_total", &with),
                pn as f64
            );
            let inf = [("op", op), ("priority", name), ("le", "+Inf")];
            assert_eq!(
                sum(&text, "multirail_served_latency_seconds_bucket", &inf),
                pn as f64
            );
            for q in ["p50", "p99"] {
                let family = format!("multirail_served_latency_{q}_seconds");
                let v = sum(&text, &family, &[("op", op), ("priority", name)]);
                assert!(v > 0.0 && v < 10.0, "{family} {op} {name}: {v}");
            }
        }
    }
    assert!(text.contains("# TYPE multirail_served_latency_seconds histogram"));
    // Served traffic is not the target's rail traffic: that stays the initiator's.
    assert_eq!(sum(&text, "multirail_rail_bytes_total", &[]), 0.0);
    promtool_accepts(&text);
}

/// A data connection to `target` past the handshake, from local address `from`.
fn member_from(target: &Engine, from: &str) -> TcpStream {
    let to: SocketAddr = target.name().parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let from: SocketAddr = format!("{from}:0").parse().unwrap();
    socket.bind(&from.into()).unwrap();
    socket.connect(&to.into()).unwrap();
    let s: TcpStream = socket.into();
    handshake::client(
        &s,
        ConnKind::Data,
        &Membership::open(),
        &target.name(),
        Duration::from_secs(5),
    )
    .unwrap();
    s
}

/// Sends one request frame (and a WRITE's payload) and reads its answer: the status and, for
/// a READ, the payload.
fn request(
    s: &mut TcpStream,
    op: RequestOp,
    addr: u64,
    key: u64,
    len: u32,
    priority: Priority,
) -> wire::Status {
    let mut frame = [0u8; wire::REQUEST_LEN];
    RequestHeader {
        op,
        len,
        id: 7,
        addr,
        key,
        priority,
    }
    .encode(&mut frame);
    s.write_all(&frame).unwrap();
    if op == RequestOp::Write {
        s.write_all(&vec![0x5A; len as usize]).unwrap();
    }
    let mut resp = [0u8; wire::RESPONSE_LEN];
    s.read_exact(&mut resp).unwrap();
    let r = wire::ResponseHeader::decode(&resp).unwrap();
    let mut payload = vec![0u8; r.len as usize];
    s.read_exact(&mut payload).unwrap();
    r.status
}

/// Refused requests count apart from the bytes served, per operation, and their bytes nowhere.
#[test]
fn refused_requests_count_apart_and_move_no_served_bytes() {
    let target = engine();
    let buf = target.allocate(4096, Location::Any).unwrap();
    let mut s = member_from(&target, "127.0.0.1");
    let (addr, key) = (buf.addr(), buf.key());
    use wire::Status::{BadKey, Ok as Done, OutOfBounds};
    let cases = [
        (RequestOp::Write, addr, key ^ 1, 16, BadKey),
        (RequestOp::Write, addr + 4090, key, 16, OutOfBounds),
        (RequestOp::Read, addr, key ^ 1, 16, BadKey),
        (RequestOp::Write, addr, key, 100, Done),
        (RequestOp::Read, addr, key, 300, Done),
        (RequestOp::Read, addr + 100, key, 50, Done),
    ];
    for (op, a, k, len, want) in cases {
        assert_eq!(request(&mut s, op, a, k, len, PRIO_MEDIUM), want);
    }
    let served = served_when(&target, |s| s.read().requests >= 2);
    let (read, write) = (served.read(), served.write());
    assert_eq!((write.bytes, write.requests, write.refused), (100, 1, 2));
    assert_eq!((read.bytes, read.requests, read.refused), (350, 2, 1));
    assert_eq!(write.priority_bytes, [0, 100, 0]);
    assert_eq!(read.priority_requests, [0, 2, 0]);
    assert_eq!(served.write_latency[1].count, 1);
    assert_eq!(served.read_latency[1].count, 2);
    assert_eq!(
        served.read_latency[0].count + served.read_latency[2].count,
        0
    );
}

/// Past `MAX_SERVED_PEERS` peer addresses, every further peer counts in one `other` entry:
/// neither the stats nor the metric series grow with the crowd.
#[test]
fn peers_past_the_cap_fold_into_other() {
    let target = engine();
    let buf = target.allocate(4096, Location::Any).unwrap();
    let metrics = target.serve_metrics("127.0.0.1:0").unwrap();
    let extra = 6;
    let peers = MAX_SERVED_PEERS + extra;
    for i in 0..peers {
        // Every address of 127.0.0.0/8 is loopback on Linux: a distinct peer each.
        let from = format!("127.0.{}.{}", 1 + i / 250, 2 + i % 250);
        let mut s = member_from(&target, &from);
        let status = request(&mut s, RequestOp::Read, buf.addr(), buf.key(), 10, PRIO_LOW);
        assert_eq!(status, wire::Status::Ok);
    }
    let served = served_when(&target, |s| s.read().requests >= peers as u64);
    assert_eq!(served.read().requests, peers as u64);
    assert_eq!(served.peers.len(), MAX_SERVED_PEERS + 1);
    let other = served.peers.last().unwrap();
    assert_eq!(other.peer, "other");
    assert_eq!(
        (other.read.requests, other.read.bytes),
        (extra as u64, 10 * extra as u64)
    );
    assert!(served.peers[..MAX_SERVED_PEERS]
        .iter()
        .all(|p| p.read.requests == 1 && p.peer.starts_with("127.0.")));

    let text = scrape(metrics.local_addr());
    let series = samples(&text)
        .into_iter()
        .filter(|(n, _, _)| n == "multirail_served_peer_bytes_total")
        .count();
    assert_eq!(
        series,
        (MAX_SERVED_PEERS + 1) * 2,
        "a series per peer and op"
    );
    assert_eq!(
        sum(
            &text,
            "multirail_served_peer_requests_total",
            &[("peer", "other"), ("op", "read")]
        ),
        extra as f64
    );
    promtool_accepts(&text);
}
