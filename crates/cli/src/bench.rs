//! `multirail bench`: an initiator that keeps batches of requests going against a target for a
//! fixed time and reports throughput, batch latency and what each rail carried.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use multirail::{Buffer, Config, Engine, Location, Opcode, Request, SegmentId, TransportChoice};

use crate::pattern;
use crate::units;
use crate::Failure;

#[derive(Clone, Copy, ValueEnum)]
enum Op {
    Read,
    Write,
}

#[derive(Args)]
pub struct BenchArgs {
    /// Segment to benchmark against (`host:port`, as `multirail target` prints it).
    #[arg(long, required_unless_present = "local", conflicts_with = "local")]
    target: Option<String>,
    /// Start a target on this host as a child process and benchmark against it.
    #[arg(long)]
    local: bool,
    /// Operation. Default: write.
    #[arg(long, value_enum, default_value = "write")]
    op: Op,
    /// Bytes per request. Default: 1MiB.
    #[arg(long, default_value = "1MiB", value_parser = units::parse_size)]
    block_size: u64,
    /// Requests per batch. Default: 16.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Submitting threads, each with its own region of the buffers. Default: 1.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// How long to run (seconds, or e.g. 500ms). Default: 5.
    #[arg(long, default_value = "5", value_parser = units::parse_duration)]
    duration: Duration,
    /// Transport: auto, shm or tcp. Default: auto (shm on the same host).
    #[arg(long, default_value = "auto", value_parser = parse_transport)]
    transport: TransportChoice,
    /// Buffer size on each side (and of the `--local` target). Default: 1GiB.
    #[arg(long, default_value = "1GiB", value_parser = units::parse_size)]
    size: u64,
    /// Stop after moving this many bytes (e.g. 256MiB) instead of after --duration. Default: off.
    #[arg(long, value_parser = units::parse_size)]
    total: Option<u64>,
    /// Also report throughput per interval of this length (e.g. 250ms), counted per slice as
    /// the rails deliver them. Default: off.
    #[arg(long, value_parser = units::parse_duration)]
    interval: Option<Duration>,
    /// After the run, check every byte that landed. Default: off.
    #[arg(long)]
    verify: bool,
    /// Priority of every request: high, medium or low. Default: high.
    #[arg(long, default_value = "high", value_parser = parse_priority)]
    priority: u8,
    /// Mixed workload instead of --block-size/--threads/--priority: comma-separated
    /// priority:block:submitters, e.g. high:64KiB:1,low:4MiB:8. Default: off.
    #[arg(long, value_parser = parse_mix)]
    mix: Option<Mix>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

fn parse_transport(s: &str) -> Result<TransportChoice, String> {
    match s {
        "auto" => Ok(TransportChoice::Auto),
        "shm" => Ok(TransportChoice::Shm),
        "tcp" => Ok(TransportChoice::Tcp),
        _ => Err(format!(
            "unknown transport {s:?}; expected auto, shm or tcp"
        )),
    }
}

/// A `multirail target` child, stopped when dropped.
struct LocalTarget {
    child: Child,
    name: String,
}

impl LocalTarget {
    fn start(config_path: Option<&Path>, size: u64) -> anyhow::Result<LocalTarget> {
        let exe = std::env::current_exe().context("locating the multirail binary")?;
        let mut cmd = Command::new(exe);
        if let Some(p) = config_path {
            cmd.arg("--config").arg(p);
        }
        cmd.args([
            "target",
            "--listen",
            "127.0.0.1:0",
            "--exit-with-parent",
            "--size",
        ])
        .arg(size.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        let mut child = cmd.spawn().context("starting the local target")?;
        let stdout = child.stdout.take().expect("piped");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("reading the local target's segment name")?;
        let name = line.trim().to_owned();
        if name.is_empty() {
            let status = child.wait()?;
            bail!("the local target exited ({status}) before printing its segment name");
        }
        Ok(LocalTarget { child, name })
    }
}

impl Drop for LocalTarget {
    fn drop(&mut self) {
        // SAFETY: kill only sends a signal to our own child process.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

struct Plan {
    op: Opcode,
    local_base: u64,
    remote_base: u64,
    seg: SegmentId,
    transport: TransportChoice,
    submitters: Vec<Submitter>,
}

/// One submitting thread: its class of work and its own region of the buffers.
#[derive(Clone)]
struct Submitter {
    class: usize,
    priority: u8,
    block: u64,
    batch: usize,
    base: u64,
    region: u64,
}

/// A class of a mixed workload: `priority:block:submitters`.
#[derive(Clone, Debug, PartialEq)]
struct Class {
    priority: u8,
    block: u64,
    submitters: usize,
}

fn parse_priority(s: &str) -> Result<u8, String> {
    match s.to_ascii_lowercase().as_str() {
        "high" | "0" => Ok(multirail::PRIO_HIGH),
        "medium" | "1" => Ok(multirail::PRIO_MEDIUM),
        "low" | "2" => Ok(multirail::PRIO_LOW),
        _ => Err(format!(
            "unknown priority {s:?}; expected high, medium or low"
        )),
    }
}

fn priority_name(p: u8) -> &'static str {
    ["high", "medium", "low"][(p as usize).min(2)]
}

/// A parsed `--mix` (a newtype so clap takes the whole list as one value).
#[derive(Clone, Debug, PartialEq)]
struct Mix(Vec<Class>);

fn parse_mix(s: &str) -> Result<Mix, String> {
    s.split(',')
        .map(|part| {
            let f: Vec<&str> = part.trim().split(':').collect();
            if f.len() != 3 {
                return Err(format!(
                    "mix entry {part:?} is not priority:block:submitters"
                ));
            }
            let submitters: usize = f[2]
                .parse()
                .map_err(|_| format!("bad submitter count {:?} in {part:?}", f[2]))?;
            let block = units::parse_size(f[1])?;
            if submitters == 0 || block == 0 {
                return Err(format!(
                    "mix entry {part:?} needs a block size and submitters of at least 1"
                ));
            }
            Ok(Class {
                priority: parse_priority(f[0])?,
                block,
                submitters,
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Mix)
}

struct ThreadResult {
    histogram: Histogram<u64>,
    requests: u64,
    touched: u64,
    error: Option<String>,
}

/// Takes one batch's bytes from the shared budget; false once it is spent.
fn take_budget(budget: &AtomicU64, bytes: u64) -> bool {
    budget
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
            left.checked_sub(bytes)
        })
        .is_ok()
}

/// Counters shared by the benchmark threads.
struct Shared {
    stop: AtomicBool,
    bytes: AtomicU64,
    budget: AtomicU64,
}

fn worker(engine: &Engine, plan: &Plan, index: usize, shared: &Shared) -> ThreadResult {
    let (stop, bytes, budget) = (&shared.stop, &shared.bytes, &shared.budget);
    let me = &plan.submitters[index];
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    let mut requests = 0u64;
    let per_batch = me.block * me.batch as u64;
    let steps = me.region / per_batch;
    let base = me.base;
    let mut step = 0u64;
    let mut reqs = Vec::with_capacity(me.batch);
    let mut touched = 0u64;
    let fail = |histogram, requests, touched, e: String| ThreadResult {
        histogram,
        requests,
        touched,
        error: Some(e),
    };
    while !stop.load(Ordering::Relaxed) && take_budget(budget, per_batch) {
        let off = base + (step % steps) * per_batch;
        reqs.clear();
        for k in 0..me.batch as u64 {
            let o = off + k * me.block;
            reqs.push(Request {
                opcode: plan.op,
                source: plan.local_base + o,
                target: plan.seg,
                target_offset: plan.remote_base + o,
                length: me.block,
                priority: me.priority,
                transport: Some(plan.transport),
            });
        }
        let t0 = Instant::now();
        let batch = match engine.allocate_batch(me.batch) {
            Ok(b) => b,
            Err(e) => return fail(histogram, requests, touched, e.to_string()),
        };
        if let Err(e) = engine.submit(batch, &reqs) {
            return fail(histogram, requests, touched, e.to_string());
        }
        if let Err(e) = engine.wait(batch, Some(Duration::from_secs(60))) {
            return fail(histogram, requests, touched, e.to_string());
        }
        let _ = engine.free_batch(batch);
        histogram.saturating_record(t0.elapsed().as_micros().max(1) as u64);
        requests += me.batch as u64;
        bytes.fetch_add(per_batch, Ordering::Relaxed);
        step += 1;
        touched = touched.max(step.min(steps) * per_batch);
    }
    ThreadResult {
        histogram,
        requests,
        touched,
        error: None,
    }
}

pub fn run(config: Config, config_path: Option<&Path>, args: BenchArgs) -> Result<(), Failure> {
    if args.block_size == 0 || args.batch_size == 0 || args.threads == 0 {
        return Err(Failure::Usage(
            "--block-size, --batch-size and --threads must be at least 1".into(),
        ));
    }
    let classes = args.mix.clone().map(|m| m.0).unwrap_or_else(|| {
        vec![Class {
            priority: args.priority,
            block: args.block_size,
            submitters: args.threads,
        }]
    });
    let threads: usize = classes.iter().map(|c| c.submitters).sum();
    // Every submitter gets an equal share of the buffers, whole batches of its class.
    let share = args.size / threads as u64;
    let mut submitters = Vec::with_capacity(threads);
    for (class, c) in classes.iter().enumerate() {
        let per_batch = c.block * args.batch_size as u64;
        let region = share / per_batch * per_batch;
        if region == 0 {
            return Err(Failure::Usage(format!(
                "--size {} cannot hold {threads} submitter(s) × one batch of {} × {}",
                units::format_size(args.size),
                args.batch_size,
                units::format_size(c.block)
            )));
        }
        for _ in 0..c.submitters {
            submitters.push(Submitter {
                class,
                priority: c.priority,
                block: c.block,
                batch: args.batch_size,
                base: submitters.len() as u64 * share,
                region,
            });
        }
    }
    let local_target = if args.local {
        Some(LocalTarget::start(config_path, args.size)?)
    } else {
        None
    };
    let target_name = match &local_target {
        Some(t) => t.name.clone(),
        None => args
            .target
            .clone()
            .expect("clap requires --target without --local"),
    };
    let listen = if args.local {
        "127.0.0.1:0"
    } else {
        "0.0.0.0:0"
    };
    let engine = Engine::new(config, listen)?;
    let local = engine.allocate(args.size as usize, Location::Any)?;
    // SAFETY: nothing is in flight yet.
    pattern::fill(unsafe { local.as_mut_slice() }, 0, pattern::INITIATOR_SEED);
    let seg = engine.open_segment(&target_name)?;
    let descriptor = engine.segment_descriptor(seg)?;
    let remote = descriptor
        .buffers
        .iter()
        .find(|b| b.len >= share * threads as u64)
        .ok_or_else(|| {
            anyhow!(
                "segment {target_name} has no buffer of at least {} bytes",
                share * threads as u64
            )
        })?;
    let op = match args.op {
        Op::Read => Opcode::Read,
        Op::Write => Opcode::Write,
    };
    let plan = Arc::new(Plan {
        op,
        local_base: local.addr(),
        remote_base: remote.addr,
        seg,
        transport: args.transport,
        submitters,
    });

    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        bytes: AtomicU64::new(0),
        budget: AtomicU64::new(args.total.unwrap_or(u64::MAX)),
    });
    let progress = if args.json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::hidden()
    } else {
        let pb = ProgressBar::new(args.duration.as_millis() as u64);
        pb.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {msg}")
                .expect("valid template"),
        );
        pb
    };
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (engine, plan, shared) = (engine.clone(), plan.clone(), shared.clone());
            thread::spawn(move || worker(&engine, &plan, i, &shared))
        })
        .collect();
    let deadline = if args.total.is_some() {
        Duration::MAX
    } else {
        args.duration
    };
    let tick = args
        .interval
        .unwrap_or(Duration::from_millis(100))
        .min(Duration::from_millis(100));
    let rail_bytes = |e: &Engine| e.traffic_stats().rails.iter().map(|r| r.bytes).sum::<u64>();
    let mut timeline = Vec::new();
    let (mut mark, mut mark_bytes) = (start, rail_bytes(&engine));
    while start.elapsed() < deadline && !handles.iter().all(|h| h.is_finished()) {
        thread::sleep(tick);
        if let Some(interval) = args.interval {
            if mark.elapsed() >= interval {
                let (now, bytes) = (Instant::now(), rail_bytes(&engine));
                let gbps =
                    (bytes - mark_bytes) as f64 / now.duration_since(mark).as_secs_f64() / 1e9;
                let t = now.duration_since(start).as_secs_f64();
                timeline.push(serde_json::json!({"t": t, "gb_per_s": gbps}));
                if args.json {
                    // Live, one JSON object per line, for scripts that act during the run.
                    eprintln!("{}", serde_json::json!({"t": t, "gb_per_s": gbps}));
                } else {
                    progress.suspend(|| {
                        println!("t={t:7.2}s {:8.3} GB/s {:9.1} Mbit/s", gbps, gbps * 8000.0)
                    });
                }
                (mark, mark_bytes) = (now, bytes);
            }
        }
        let secs = start.elapsed().as_secs_f64();
        progress.set_position(start.elapsed().as_millis() as u64);
        progress.set_message(format!(
            "{:.2} GB/s",
            shared.bytes.load(Ordering::Relaxed) as f64 / secs / 1e9
        ));
    }
    shared.stop.store(true, Ordering::Relaxed);
    let results: Vec<ThreadResult> = handles
        .into_iter()
        .map(|h| h.join().expect("bench thread"))
        .collect();
    let secs = start.elapsed().as_secs_f64();
    progress.finish_and_clear();
    if let Some(e) = results.iter().find_map(|r| r.error.clone()) {
        return Err(Failure::Runtime(anyhow!("transfer failed: {e}")));
    }
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    for r in &results {
        histogram.add(&r.histogram).expect("same bounds");
    }
    let total_bytes = shared.bytes.load(Ordering::Relaxed);
    let requests: u64 = results.iter().map(|r| r.requests).sum();
    // Rails as the timed run left them, before verification adds its own traffic.
    let traffic = engine.traffic_stats();
    let rails = &traffic.rails;
    let stats_report = engine.traffic_stats_report();
    let verified = if args.verify {
        Some(verify(&engine, &plan, &local, &results)?)
    } else {
        None
    };
    let gbps = total_bytes as f64 / secs / 1e9;
    let class_reports: Vec<serde_json::Value> = classes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
            let mut reqs = 0;
            for (sub, r) in plan.submitters.iter().zip(&results) {
                if sub.class == i {
                    h.add(&r.histogram).expect("same bounds");
                    reqs += r.requests;
                }
            }
            let bytes = reqs * c.block;
            serde_json::json!({
                "priority": priority_name(c.priority),
                "block_size": c.block,
                "submitters": c.submitters,
                "bytes": bytes,
                "gb_per_s": bytes as f64 / secs / 1e9,
                "requests_per_s": reqs as f64 / secs,
                "batch_latency_us": {"p50": h.value_at_quantile(0.5), "p99": h.value_at_quantile(0.99), "max": h.max()},
            })
        })
        .collect();
    let report = serde_json::json!({
        "op": match op { Opcode::Read => "read", Opcode::Write => "write" },
        "transport": args.transport.as_str(),
        "target": target_name,
        "block_size": args.block_size,
        "batch_size": args.batch_size,
        "threads": threads,
        "priority": priority_name(args.priority),
        "duration_s": secs,
        "bytes": total_bytes,
        "gb_per_s": gbps,
        "requests_per_s": requests as f64 / secs,
        "batch_latency_us": {
            "p50": histogram.value_at_quantile(0.5),
            "p99": histogram.value_at_quantile(0.99),
            "max": histogram.max(),
        },
        "rails": rails.iter().map(|r| serde_json::json!({
            "name": r.name, "bytes": r.bytes, "slices": r.slices, "errors": r.errors,
            "ewma_gbps": r.ewma_gbps, "inflight_bytes": r.inflight_bytes, "window_bytes": r.window_bytes,
            "priority_bytes": {"high": r.priority_bytes[0], "medium": r.priority_bytes[1], "low": r.priority_bytes[2]},
        })).collect::<Vec<_>>(),
        "verified_bytes": verified,
        "timeline": timeline,
        "classes": class_reports,
        "qos": traffic.qos,
    });
    if args.json {
        println!("{report}");
    } else {
        print_human(&report, rails);
        print!("{stats_report}");
    }
    drop(engine);
    drop(local_target);
    Ok(())
}

fn print_human(report: &serde_json::Value, rails: &[multirail::RailTraffic]) {
    use comfy_table::{presets::UTF8_FULL, Table};
    let mut t = Table::new();
    t.load_preset(UTF8_FULL);
    t.set_header(vec![
        "op",
        "transport",
        "block",
        "batch",
        "threads",
        "GB/s",
        "requests/s",
        "p50 batch µs",
        "p99 batch µs",
    ]);
    t.add_row(vec![
        report["op"].as_str().unwrap_or("").to_owned(),
        report["transport"].as_str().unwrap_or("").to_owned(),
        units::format_size(report["block_size"].as_u64().unwrap_or(0)),
        report["batch_size"].to_string(),
        report["threads"].to_string(),
        format!("{:.3}", report["gb_per_s"].as_f64().unwrap_or(0.0)),
        format!("{:.0}", report["requests_per_s"].as_f64().unwrap_or(0.0)),
        report["batch_latency_us"]["p50"].to_string(),
        report["batch_latency_us"]["p99"].to_string(),
    ]);
    println!("{t}");
    let mut r = Table::new();
    r.load_preset(UTF8_FULL);
    r.set_header(vec![
        "rail",
        "bytes",
        "high bytes",
        "medium bytes",
        "low bytes",
        "slices",
        "errors",
        "window bytes",
    ]);
    for rail in rails {
        r.add_row(vec![
            rail.name.clone(),
            rail.bytes.to_string(),
            rail.priority_bytes[0].to_string(),
            rail.priority_bytes[1].to_string(),
            rail.priority_bytes[2].to_string(),
            rail.slices.to_string(),
            rail.errors.to_string(),
            rail.window_bytes.to_string(),
        ]);
    }
    println!("{r}");
    if let Some(classes) = report["classes"].as_array().filter(|c| c.len() > 1) {
        let mut c = Table::new();
        c.load_preset(UTF8_FULL);
        c.set_header(vec![
            "priority",
            "block",
            "submitters",
            "GB/s",
            "requests/s",
            "p50 batch µs",
            "p99 batch µs",
        ]);
        for k in classes {
            c.add_row(vec![
                k["priority"].as_str().unwrap_or("").to_owned(),
                units::format_size(k["block_size"].as_u64().unwrap_or(0)),
                k["submitters"].to_string(),
                format!("{:.3}", k["gb_per_s"].as_f64().unwrap_or(0.0)),
                format!("{:.0}", k["requests_per_s"].as_f64().unwrap_or(0.0)),
                k["batch_latency_us"]["p50"].to_string(),
                k["batch_latency_us"]["p99"].to_string(),
            ]);
        }
        println!("{c}");
    }
    let mut q = Table::new();
    q.load_preset(UTF8_FULL);
    q.set_header(vec![
        "queue",
        "queued",
        "dequeued",
        "wait p50 µs",
        "wait p99 µs",
    ]);
    for (name, p) in ["high", "medium", "low"]
        .iter()
        .zip(report["qos"]["priorities"].as_array().into_iter().flatten())
    {
        q.add_row(vec![
            name.to_string(),
            p["queued"].to_string(),
            p["dequeued"].to_string(),
            p["wait_p50_us"].to_string(),
            p["wait_p99_us"].to_string(),
        ]);
    }
    println!("{q}");
    println!("promotions: {}", report["qos"]["promotions"]);
    if let Some(v) = report["verified_bytes"].as_u64() {
        println!("verified: {v} bytes match");
    }
}

/// Checks the bytes that landed: after reads, the local regions hold the target's pattern;
/// after writes, reading the target's regions back gives the initiator's pattern.
fn verify(
    engine: &Engine,
    plan: &Plan,
    local: &Buffer,
    results: &[ThreadResult],
) -> Result<u64, Failure> {
    let mut checked = 0u64;
    for (sub, r) in plan.submitters.iter().zip(results) {
        let start = sub.base;
        let len = r.touched;
        if len == 0 {
            continue;
        }
        match plan.op {
            Opcode::Read => {
                // SAFETY: every batch completed; nothing is in flight on the local buffer.
                let bytes = unsafe { &local.as_slice()[start as usize..(start + len) as usize] };
                if let Some(at) = pattern::first_mismatch(bytes, start, pattern::TARGET_SEED) {
                    return Err(Failure::Runtime(anyhow!(
                        "verify: byte {} read from the target is wrong",
                        start + at as u64
                    )));
                }
            }
            Opcode::Write => {
                let scratch = engine.allocate(len as usize, Location::Any)?;
                let batch = engine.allocate_batch(1)?;
                let req = Request {
                    opcode: Opcode::Read,
                    source: scratch.addr(),
                    target: plan.seg,
                    target_offset: plan.remote_base + start,
                    length: len,
                    priority: multirail::PRIO_HIGH,
                    transport: Some(plan.transport),
                };
                engine.submit(batch, &[req])?;
                engine.wait(batch, Some(Duration::from_secs(120)))?;
                engine.free_batch(batch)?;
                // SAFETY: the read completed; nothing else touches `scratch`.
                let bytes = unsafe { scratch.as_slice() };
                if let Some(at) = pattern::first_mismatch(bytes, start, pattern::INITIATOR_SEED) {
                    return Err(Failure::Runtime(anyhow!(
                        "verify: byte {} written to the target is wrong",
                        start + at as u64
                    )));
                }
                engine.free(&scratch)?;
            }
        }
        checked += len;
    }
    Ok(checked)
}
