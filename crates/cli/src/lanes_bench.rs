//! `multirail lanes-bench`: dynamic lanes (UCX's usage tracker and dynamic transport
//! selection) under many peers, one receiver.
//!
//! With `--local` the receiver is a child process of this binary (`--serve-receiver`, hidden),
//! one engine; the `--peers` senders run in this process, each an engine of its own that opens
//! the receiver's segment. Every message is 128 bytes: the sender's send time (nanoseconds of
//! `CLOCK_MONOTONIC`, one clock for every process of the host) in its first 8 bytes and the
//! sender's index in the next 4.
//!
//! Patterns:
//! - `mbw_mr` (an improved osu_mbw_mr): each of the `--hot` hot peers sends continuously from a
//!   thread of its own (closed loop: the next send as soon as `send` returns); one more thread
//!   sends one message for each other (cold) peer every 100 ms.
//! - `alltoall`: every peer sends continuously and equally: the peers are spread over `--hot`
//!   sending threads, each of which sends one message to each of its peers in turn. Every peer
//!   counts as hot in the figures.
//!
//! The receiver busy polls `recv`; for messages sent after the warm-up (by their stamp) and
//! before the end it counts messages per sender and records `receive time - stamp` of hot
//! senders (one-way latency, including any wait of the sender for receive credits) in a
//! histogram. A monitor thread reads the receiver's `Engine::lanes()` every 10 ms: when all hot
//! peers were first dedicated, whether a cold peer was dedicated after the first second, and at
//! the end of warm-up and at the end the granting switches; at the end also which peers are
//! dedicated and the receive-buffer bytes. This process reads its senders' requesting switches
//! at the same two instants.
//!
//! The parent talks to the receiver over its stdin, one command a line: `peer INDEX NAME` for
//! every sender, then `start T_START T_WARM T_END` (monotonic ns), then `report` (EOF counts as
//! `report`), after which the receiver drains what is still arriving, prints one JSON line on
//! stdout and exits. Nothing else is printed on its stdout.
//!
//! A send that fails (a timeout waiting for the receiver's credits, a broken connection) is
//! logged and counted, and its sender goes on with the next message; the figures (which count
//! only messages that arrived) are printed with the failures, and the command exits 1.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use multirail::{Config, Engine, Lane, SegmentId, TransportChoice};
use multirail_policy::lanes::MAX_DEDICATED_LIMIT;
use serde::{Deserialize, Serialize};

use crate::child::{Guarded, Stop};
use crate::clock::{mono_ns, sleep_until_ns};
use crate::limits::{self, MAX_DURATION, MIN_DURATION};
use crate::out::outln;
use crate::units;
use crate::Failure;

/// Most sending peers: each is an engine of this process with threads and sockets of its own
/// (a thousand start in a few seconds; a few thousand exhaust a host's thread stacks).
const MAX_PEERS: u64 = 1024;

/// Bytes of every message.
const MESSAGE_BYTES: usize = 128;
/// How often a cold peer sends one message in `mbw_mr`.
const COLD_INTERVAL: Duration = Duration::from_millis(100);
/// How often the receiver reads its lanes.
const MONITOR_INTERVAL: Duration = Duration::from_millis(10);
/// From when on a dedicated cold peer counts as one.
const COLD_GRACE_NS: u64 = 1_000_000_000;
/// How long the receiver keeps draining once asked for its report (it stops earlier once
/// nothing arrived for `DRAIN_QUIET`).
const DRAIN_LIMIT: Duration = Duration::from_secs(3);
const DRAIN_QUIET: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Pattern {
    /// Hot peers send continuously, cold peers one message every 100 ms.
    #[value(name = "mbw_mr")]
    MbwMr,
    /// Every peer sends continuously, all equally.
    #[value(name = "alltoall")]
    Alltoall,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Mode {
    /// `lanes.dynamic` on: the engines negotiate dedicated lanes from the traffic.
    Dynamic,
    /// `lanes.dynamic` off; every sender switches its lane to dedicated before sending.
    Dedicated,
    /// `lanes.dynamic` off; every peer stays on the shared lane.
    Shared,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Transport {
    Shm,
    Tcp,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::MbwMr => "mbw_mr",
            Pattern::Alltoall => "alltoall",
        }
    }
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Dynamic => "dynamic",
            Mode::Dedicated => "dedicated",
            Mode::Shared => "shared",
        }
    }
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
        }
    }
}

/// Flags of `multirail lanes-bench`.
#[derive(Args, Clone)]
pub struct LanesBenchArgs {
    /// Run the receiver as a child process on this host (one process, one engine) and the
    /// senders, one engine each, in this process. The only mode so far, so required.
    #[arg(long, required_unless_present = "serve_receiver")]
    local: bool,
    /// Sending peers, 1 to 1024 (each an engine of this process). Default: 32.
    #[arg(long, default_value_t = 32, value_parser = limits::count::<usize>(1, MAX_PEERS))]
    peers: usize,
    /// Hot peers (mbw_mr: peers 0..hot send continuously, the others every 100 ms), 1 to
    /// --peers. In alltoall every peer is hot and this is the number of sending threads the
    /// peers are spread over. Default: 4.
    #[arg(long, default_value_t = 4, value_parser = limits::count::<usize>(1, MAX_PEERS))]
    hot: usize,
    /// `lanes.max_dedicated` of every engine: the most dedicated lanes the receiver grants
    /// (and each sender holds), 0 to 65536. Default: 8.
    #[arg(long, default_value_t = 8,
          value_parser = limits::count::<usize>(0, MAX_DEDICATED_LIMIT as u64))]
    max_dedicated: usize,
    /// Traffic: mbw_mr (hot peers continuously, the others one 128-byte message every
    /// 100 ms) or alltoall (every peer continuously, equally). Default: mbw_mr.
    #[arg(long, value_enum, default_value_t = Pattern::MbwMr)]
    pattern: Pattern,
    /// Lanes: dynamic (negotiated from the traffic), dedicated (every sender switches to a
    /// dedicated lane first, `lanes.dynamic` off) or shared (everything on the shared lane,
    /// one receive pool for all, `lanes.dynamic` off). Default: dynamic.
    #[arg(long, value_enum, default_value_t = Mode::Dynamic)]
    mode: Mode,
    /// Transport of every engine: shm or tcp. Default: shm.
    #[arg(long, value_enum, default_value_t = Transport::Shm)]
    transport: Transport,
    /// How long the senders send in all, warm-up included (seconds, or e.g. 500ms, 2h), 1ms to
    /// 24h and more than --warmup. Default: 10.
    #[arg(long, default_value = "10", value_parser = limits::duration(MIN_DURATION, MAX_DURATION))]
    duration: Duration,
    /// The first part of --duration not measured (seconds, or e.g. 500ms; 0 for none), 0 to
    /// 24h: rates, latencies and switches count from its end. Default: 2.
    #[arg(long, default_value = "2", value_parser = limits::duration(Duration::ZERO, MAX_DURATION))]
    warmup: Duration,
    /// Print one JSON object instead of a table. Default: off.
    #[arg(long)]
    json: bool,
    /// Run as the receiver of a --local run (commands on stdin, report on stdout).
    #[arg(long, hide = true, conflicts_with = "local")]
    serve_receiver: bool,
}

impl LanesBenchArgs {
    fn validate(&self) -> Result<(), Failure> {
        let usage = |m: String| Err(Failure::Usage(m));
        if self.hot > self.peers {
            return usage(format!(
                "--hot ({}) must not exceed --peers ({})",
                self.hot, self.peers
            ));
        }
        if self.duration <= self.warmup {
            return usage(format!(
                "--duration ({} s) must exceed --warmup ({} s)",
                self.duration.as_secs_f64(),
                self.warmup.as_secs_f64()
            ));
        }
        Ok(())
    }

    fn apply(&self, config: &mut Config) {
        config.transport = match self.transport {
            Transport::Shm => TransportChoice::Shm,
            Transport::Tcp => TransportChoice::Tcp,
        };
        config.lanes.dynamic = self.mode == Mode::Dynamic;
        config.lanes.max_dedicated = self.max_dedicated;
        if self.mode == Mode::Shared {
            // The shared lane as dynamic mode has it: one pool for every sender (without
            // dynamic lanes it is the configured path, a pool per connection by default).
            config.transports.tcp.receive.shared_receive_queue = true;
            config.transports.shm.receive.shared_receive_queue = true;
        }
    }

    /// True for the peers whose rate and latency are reported.
    fn is_hot(&self, index: usize) -> bool {
        self.pattern == Pattern::Alltoall || index < self.hot
    }

    /// How many peers count as hot.
    fn hot_peers(&self) -> usize {
        match self.pattern {
            Pattern::MbwMr => self.hot,
            Pattern::Alltoall => self.peers,
        }
    }

    /// The flags the receiver needs to match this run.
    fn receiver_flags(&self) -> Vec<String> {
        vec![
            "--peers".into(),
            self.peers.to_string(),
            "--hot".into(),
            self.hot.to_string(),
            "--max-dedicated".into(),
            self.max_dedicated.to_string(),
            "--pattern".into(),
            self.pattern.name().into(),
            "--mode".into(),
            self.mode.name().into(),
            "--transport".into(),
            self.transport.name().into(),
        ]
    }
}

/// Every counter of one negotiation, for the JSON report.
fn stats_json(s: &multirail::LanesStats) -> serde_json::Value {
    serde_json::json!({
        "requests_sent": s.requests_sent,
        "accepts_sent": s.accepts_sent,
        "accepts_received": s.accepts_received,
        "denials_sent": s.denials_sent,
        "denials_received": s.denials_received,
        "demotes_sent": s.demotes_sent,
        "demotes_received": s.demotes_received,
        "evictions": s.evictions,
        "cooled": s.cooled,
        "scores_sent": s.scores_sent,
        "scores_received": s.scores_received,
        "timeouts": s.timeouts,
        "collisions": s.collisions,
        "undone": s.undone,
        "promotions": s.promotions,
        "demotions": s.demotions,
        "switches": s.switches,
        "peers_gone": s.peers_gone,
    })
}

/// Runs `multirail lanes-bench`: the senders of a `--local` run, or its receiver.
pub fn run(
    mut config: Config,
    config_path: Option<&Path>,
    args: LanesBenchArgs,
) -> Result<(), Failure> {
    args.validate()?;
    args.apply(&mut config);
    config
        .validate()
        .map_err(|e| Failure::Usage(e.to_string()))?;
    if args.serve_receiver {
        return receiver::serve(config, &args);
    }
    senders::run(config, config_path, &args)
}

/// What the receiver reports once asked.
#[derive(Serialize, Deserialize, Debug)]
struct ReceiverReport {
    /// Messages per sender sent between the end of warm-up and the end (by their stamps).
    counts: Vec<u64>,
    /// One-way latency of hot senders' messages of that window.
    latency_samples: u64,
    p50_ns: u64,
    p99_ns: u64,
    max_ns: u64,
    /// Since the start, when every hot peer was first dedicated at the receiver.
    all_hot_dedicated_after_ns: Option<u64>,
    /// A cold peer was dedicated at the receiver in a sample after the first second.
    cold_dedicated_after_1s: bool,
    /// `granting.switches` at the end of warm-up.
    warm_switches: u64,
    /// At the end.
    end: EndSnapshot,
    /// Messages that carried no valid stamp and index.
    malformed: u64,
}

#[derive(Serialize, Deserialize, Debug, Clone, Default)]
struct EndSnapshot {
    /// Indices of the senders dedicated at the receiver.
    dedicated: Vec<u32>,
    /// Dedicated incoming lanes of segments that are none of the senders.
    unknown_dedicated: Vec<String>,
    receive_bytes: u64,
    granting_switches: u64,
    /// The receiver's granting counters (`LanesStats`).
    granting: serde_json::Value,
}

mod receiver {
    use super::*;

    #[derive(Default)]
    struct Monitor {
        all_hot_at: Option<u64>,
        cold_after_1s: bool,
        warm_switches: Option<u64>,
        end: Option<EndSnapshot>,
    }

    struct Shared {
        /// Monotonic ns; 0 until the parent said `start`.
        t_start: AtomicU64,
        t_warm: AtomicU64,
        t_end: AtomicU64,
        report: AtomicBool,
        names: Mutex<HashMap<String, u32>>,
        monitor: Mutex<Monitor>,
    }

    /// Which senders are dedicated at this receiver now.
    fn snapshot(engine: &Engine, shared: &Shared) -> EndSnapshot {
        let r = engine.lanes();
        let names = shared.names.lock().expect("names poisoned");
        let mut snap = EndSnapshot {
            receive_bytes: r.receive_bytes,
            granting_switches: r.granting.switches,
            granting: stats_json(&r.granting),
            ..EndSnapshot::default()
        };
        for e in r.incoming.iter().filter(|e| e.lane == Lane::Dedicated) {
            match names.get(&e.peer) {
                Some(&i) => snap.dedicated.push(i),
                None => snap.unknown_dedicated.push(e.peer.clone()),
            }
        }
        snap.dedicated.sort_unstable();
        snap
    }

    fn monitor(engine: Engine, shared: Arc<Shared>, args: Arc<LanesBenchArgs>) {
        let hot_peers = args.hot_peers();
        loop {
            thread::sleep(MONITOR_INTERVAL);
            if shared.report.load(Ordering::Relaxed) {
                return;
            }
            let t_start = shared.t_start.load(Ordering::Acquire);
            if t_start == 0 {
                continue;
            }
            let (t_warm, t_end) = (
                shared.t_warm.load(Ordering::Relaxed),
                shared.t_end.load(Ordering::Relaxed),
            );
            let snap = snapshot(&engine, &shared);
            let now = mono_ns();
            let hot = snap
                .dedicated
                .iter()
                .filter(|&&i| args.is_hot(i as usize))
                .count();
            let cold = snap.dedicated.len() - hot;
            let mut m = shared.monitor.lock().expect("monitor poisoned");
            if m.all_hot_at.is_none() && hot == hot_peers && now < t_end {
                m.all_hot_at = Some(now.saturating_sub(t_start));
            }
            if cold > 0 && now >= t_start + COLD_GRACE_NS && now < t_end {
                m.cold_after_1s = true;
            }
            if now >= t_warm && m.warm_switches.is_none() {
                m.warm_switches = Some(snap.granting_switches);
            }
            if now >= t_end {
                m.end = Some(snap);
                return;
            }
        }
    }

    /// Reads the parent's commands until `report` or the end of stdin.
    fn commands(shared: Arc<Shared>) {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let Ok(line) = line else { break };
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["peer", index, name] => {
                    if let Ok(i) = index.parse::<u32>() {
                        shared
                            .names
                            .lock()
                            .expect("names poisoned")
                            .insert((*name).to_owned(), i);
                    }
                }
                ["start", s, w, e] => {
                    let p = |v: &str| v.parse::<u64>().unwrap_or(u64::MAX);
                    shared.t_warm.store(p(w), Ordering::Relaxed);
                    shared.t_end.store(p(e), Ordering::Relaxed);
                    shared.t_start.store(p(s).max(1), Ordering::Release);
                }
                ["report"] => break,
                _ => tracing::warn!(%line, "lanes-bench receiver: unknown command"),
            }
        }
        shared.report.store(true, Ordering::Release);
    }

    struct Tally {
        counts: Vec<u64>,
        hist: Histogram<u64>,
        malformed: u64,
    }

    impl Tally {
        #[inline]
        fn take(&mut self, data: &[u8], shared: &Shared, args: &LanesBenchArgs) {
            let now = mono_ns();
            if data.len() < 12 {
                self.malformed += 1;
                return;
            }
            let stamp = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
            let index = u32::from_le_bytes(data[8..12].try_into().expect("4 bytes")) as usize;
            if index >= self.counts.len() {
                self.malformed += 1;
                return;
            }
            if stamp < shared.t_warm.load(Ordering::Relaxed)
                || stamp >= shared.t_end.load(Ordering::Relaxed)
            {
                return;
            }
            self.counts[index] += 1;
            if args.is_hot(index) {
                self.hist
                    .saturating_record(now.saturating_sub(stamp).max(1));
            }
        }
    }

    pub(super) fn serve(config: Config, args: &LanesBenchArgs) -> Result<(), Failure> {
        // The parent started this process to die with it (`child::Guarded`).
        let engine = Engine::new(config, "127.0.0.1:0")?;
        outln!("{}", engine.name())?;
        let args = Arc::new(args.clone());
        let shared = Arc::new(Shared {
            t_start: AtomicU64::new(0),
            t_warm: AtomicU64::new(u64::MAX),
            t_end: AtomicU64::new(u64::MAX),
            report: AtomicBool::new(false),
            names: Mutex::default(),
            monitor: Mutex::default(),
        });
        {
            let shared = shared.clone();
            thread::Builder::new()
                .name("lb-commands".into())
                .spawn(move || commands(shared))
                .context("spawning the command reader")?;
        }
        let monitor_thread = {
            let (engine, shared, args) = (engine.clone(), shared.clone(), args.clone());
            thread::Builder::new()
                .name("lb-monitor".into())
                .spawn(move || monitor(engine, shared, args))
                .context("spawning the lanes monitor")?
        };
        let mut tally = Tally {
            counts: vec![0; args.peers],
            hist: Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds"),
            malformed: 0,
        };
        while !shared.report.load(Ordering::Relaxed) {
            if let Some(m) = engine.recv(Some(Duration::from_millis(10)))? {
                tally.take(&m.data, &shared, &args);
            }
        }
        // What senders sent before they stopped may still be arriving.
        let drain_until = Instant::now() + DRAIN_LIMIT;
        while Instant::now() < drain_until {
            match engine.recv(Some(DRAIN_QUIET))? {
                Some(m) => tally.take(&m.data, &shared, &args),
                None => break,
            }
        }
        let _ = monitor_thread.join();
        let m = std::mem::take(&mut *shared.monitor.lock().expect("monitor poisoned"));
        // A report asked for before the end (the parent gave up) takes the lanes as they are.
        let end = m.end.unwrap_or_else(|| snapshot(&engine, &shared));
        let h = &tally.hist;
        let report = ReceiverReport {
            counts: tally.counts.clone(),
            latency_samples: h.len(),
            p50_ns: if h.is_empty() {
                0
            } else {
                h.value_at_quantile(0.5)
            },
            p99_ns: if h.is_empty() {
                0
            } else {
                h.value_at_quantile(0.99)
            },
            max_ns: h.max(),
            all_hot_dedicated_after_ns: m.all_hot_at,
            cold_dedicated_after_1s: m.cold_after_1s,
            warm_switches: m.warm_switches.unwrap_or(end.granting_switches),
            end,
            malformed: tally.malformed,
        };
        let line = serde_json::to_string(&report).expect("report serializes");
        let mut out = std::io::stdout().lock();
        // The parent may be gone (EOF on stdin without `report`): nothing to tell then.
        let _ = writeln!(out, "{line}").and_then(|()| out.flush());
        Ok(())
    }
}

mod senders {
    use super::*;

    /// The receiver child process; asked to stop (stdin closed) and killed if it lingers, when
    /// dropped.
    struct LocalReceiver {
        child: Guarded,
        stdout: BufReader<ChildStdout>,
        name: String,
    }

    impl LocalReceiver {
        fn start(config_path: Option<&Path>, args: &LanesBenchArgs) -> anyhow::Result<Self> {
            let exe = std::env::current_exe().context("locating the multirail binary")?;
            let mut cmd = Command::new(exe);
            if let Some(p) = config_path {
                cmd.arg("--config").arg(p);
            }
            cmd.args(["lanes-bench", "--serve-receiver"])
                .args(args.receiver_flags())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            let mut child =
                Guarded::spawn(&mut cmd, Stop::CloseStdin).context("starting the receiver")?;
            let mut stdout = BufReader::new(child.take_stdout().expect("piped"));
            let mut line = String::new();
            stdout
                .read_line(&mut line)
                .context("reading the receiver's segment name")?;
            let name = line.trim().to_owned();
            let mut r = LocalReceiver {
                child,
                stdout,
                name,
            };
            if r.name.is_empty() {
                let status = r.child.wait()?;
                bail!("the receiver exited ({status}) before printing its segment name");
            }
            Ok(r)
        }

        fn command(&mut self, line: &str) -> anyhow::Result<()> {
            let stdin = self.child.stdin().expect("stdin open until dropped");
            writeln!(stdin, "{line}")
                .and_then(|()| stdin.flush())
                .context("writing to the receiver (did it exit?)")
        }

        fn report(&mut self) -> anyhow::Result<ReceiverReport> {
            self.command("report")?;
            let mut line = String::new();
            self.stdout
                .read_line(&mut line)
                .context("reading the receiver's report")?;
            if line.trim().is_empty() {
                let status = self.child.wait()?;
                bail!("the receiver exited ({status}) without a report");
            }
            serde_json::from_str(&line).context("parsing the receiver's report")
        }

        fn exited(&mut self) -> Option<std::process::ExitStatus> {
            self.child.try_wait()
        }
    }

    /// One sender: its engine, the receiver's segment there, its index.
    #[derive(Clone)]
    struct Peer {
        engine: Engine,
        seg: SegmentId,
        index: u32,
    }

    fn stamp(buf: &mut [u8; MESSAGE_BYTES], index: u32) -> u64 {
        let now = mono_ns();
        buf[..8].copy_from_slice(&now.to_le_bytes());
        buf[8..12].copy_from_slice(&index.to_le_bytes());
        now
    }

    /// Sends that failed (a timeout waiting for the receiver's credits, a broken
    /// connection): the sender goes on with its next message, and the run fails at the end.
    #[derive(Default)]
    struct Failures {
        count: u64,
        first: Option<String>,
    }

    impl Failures {
        fn send(&mut self, p: &Peer, buf: &[u8]) {
            if let Err(e) = p.engine.send(p.seg, buf) {
                tracing::warn!(peer = p.index, error = %e, "send failed");
                self.count += 1;
                self.first
                    .get_or_insert_with(|| format!("peer {} sending: {e}", p.index));
            }
        }

        fn add(&mut self, other: Failures) {
            self.count += other.count;
            if self.first.is_none() {
                self.first = other.first;
            }
        }
    }

    /// Sends to `peers` in turn, as fast as `send` returns, until `t_end`.
    fn continuous(peers: &[Peer], t_end: u64, abort: &AtomicBool) -> Failures {
        let mut buf = [0u8; MESSAGE_BYTES];
        let mut failures = Failures::default();
        loop {
            for p in peers {
                if stamp(&mut buf, p.index) >= t_end || abort.load(Ordering::Relaxed) {
                    return failures;
                }
                failures.send(p, &buf);
            }
        }
    }

    /// One message per peer every `COLD_INTERVAL` from `t_start` until `t_end`.
    fn periodic(peers: &[Peer], t_start: u64, t_end: u64, abort: &AtomicBool) -> Failures {
        let mut buf = [0u8; MESSAGE_BYTES];
        let mut failures = Failures::default();
        let mut next = t_start;
        while next < t_end && !abort.load(Ordering::Relaxed) {
            sleep_until_ns(next);
            for p in peers {
                if stamp(&mut buf, p.index) >= t_end {
                    return failures;
                }
                failures.send(p, &buf);
            }
            next += COLD_INTERVAL.as_nanos() as u64;
        }
        failures
    }

    /// The senders' requesting negotiations, summed.
    fn requesting(peers: &[Peer]) -> multirail::LanesStats {
        let mut total = multirail::LanesStats::default();
        for p in peers {
            total.add(&p.engine.lanes().requesting);
        }
        total
    }

    /// What the senders' side adds to the report.
    struct SentSide {
        requesting: multirail::LanesStats,
        /// Hot senders' sends that found no credit in hand and waited, over the whole run.
        hot_credit_waits: u64,
        /// Hot senders' messages sent, over the whole run.
        hot_sent: u64,
        switches_after_warmup: u64,
        failures: u64,
        first_failure: Option<String>,
    }

    pub(super) fn run(
        config: Config,
        config_path: Option<&Path>,
        args: &LanesBenchArgs,
    ) -> Result<(), Failure> {
        let progress = crate::timed_progress(args.json, args.duration);
        progress.set_message("starting the receiver");
        let mut receiver = LocalReceiver::start(config_path, args)?;
        tracing::info!(receiver = %receiver.name, "receiver started");
        progress.set_message(format!("starting {} sender engines", args.peers));
        let mut peers = Vec::with_capacity(args.peers);
        for i in 0..args.peers {
            let engine = Engine::new(config.clone(), "127.0.0.1:0")?;
            let seg = engine
                .open_segment(&receiver.name)
                .with_context(|| format!("peer {i} opening the receiver's segment"))?;
            if args.mode == Mode::Dedicated {
                engine
                    .switch_lane(seg, Lane::Dedicated)
                    .with_context(|| format!("peer {i} switching to a dedicated lane"))?;
            }
            receiver.command(&format!("peer {i} {}", engine.name()))?;
            peers.push(Peer {
                engine,
                seg,
                index: i as u32,
            });
        }

        let t_start = mono_ns();
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let t_warm = t_start.saturating_add(ns(args.warmup));
        let t_end = t_start.saturating_add(ns(args.duration));
        receiver.command(&format!("start {t_start} {t_warm} {t_end}"))?;
        tracing::info!(peers = args.peers, "sending");
        let abort = Arc::new(AtomicBool::new(false));
        let mut threads: Vec<thread::JoinHandle<Failures>> = Vec::new();
        let mut spawn = |name: String,
                         f: Box<dyn FnOnce(&AtomicBool) -> Failures + Send>|
         -> anyhow::Result<()> {
            let abort = abort.clone();
            let h = thread::Builder::new()
                .name(name)
                .spawn(move || f(&abort))
                .context("spawning a sender thread")?;
            threads.push(h);
            Ok(())
        };
        match args.pattern {
            Pattern::MbwMr => {
                for p in &peers[..args.hot] {
                    let p = p.clone();
                    spawn(
                        format!("lb-hot-{}", p.index),
                        Box::new(move |abort| continuous(&[p], t_end, abort)),
                    )?;
                }
                let cold: Vec<Peer> = peers[args.hot..].to_vec();
                if !cold.is_empty() {
                    spawn(
                        "lb-cold".into(),
                        Box::new(move |abort| periodic(&cold, t_start, t_end, abort)),
                    )?;
                }
            }
            Pattern::Alltoall => {
                for t in 0..args.hot {
                    let mine: Vec<Peer> = peers.iter().skip(t).step_by(args.hot).cloned().collect();
                    spawn(
                        format!("lb-all-{t}"),
                        Box::new(move |abort| continuous(&mine, t_end, abort)),
                    )?;
                }
            }
        }

        progress.set_message("warm-up");
        let mut warm = None;
        loop {
            let now = mono_ns();
            if warm.is_none() && now >= t_warm {
                warm = Some(requesting(&peers));
                progress.set_message("measuring");
            }
            if now >= t_end {
                break;
            }
            if let Some(status) = receiver.exited() {
                abort.store(true, Ordering::Relaxed);
                return Err(anyhow!("the receiver exited ({status}) during the run").into());
            }
            progress.set_position(now.saturating_sub(t_start) / 1_000_000);
            let next = if warm.is_none() { t_warm } else { t_end };
            thread::sleep(Duration::from_nanos(
                next.saturating_sub(now).clamp(1, 100_000_000),
            ));
        }
        let end = requesting(&peers);
        let hot_stats: Vec<multirail::MessageStats> = peers
            .iter()
            .filter(|p| args.is_hot(p.index as usize))
            .map(|p| p.engine.message_stats())
            .collect();
        progress.set_message("collecting");
        let mut failures = Failures::default();
        for h in threads {
            match h.join() {
                Ok(f) => failures.add(f),
                Err(_) => return Err(anyhow!("a sender thread panicked").into()),
            }
        }
        let report = receiver.report()?;
        progress.finish_and_clear();
        drop(receiver);
        drop(peers);

        let sent = SentSide {
            requesting: end,
            hot_credit_waits: hot_stats.iter().map(|s| s.credit_waits).sum(),
            hot_sent: hot_stats.iter().map(|s| s.sent).sum(),
            switches_after_warmup: end.switches - warm.unwrap_or(end).switches.min(end.switches),
            failures: failures.count,
            first_failure: failures.first.clone(),
        };
        let out = figures(args, &report, &sent);
        if args.json {
            outln!("{}", serde_json::to_string_pretty(&out).expect("json"))?;
        } else {
            print_table(&out)?;
        }
        if report.malformed > 0 {
            tracing::warn!(
                malformed = report.malformed,
                "the receiver got messages without a valid stamp"
            );
        }
        if let Some(first) = failures.first {
            return Err(anyhow!(
                "{} sends failed (the figures above count only messages that arrived); first: {first}",
                failures.count
            )
            .into());
        }
        Ok(())
    }

    fn figures(args: &LanesBenchArgs, r: &ReceiverReport, sent: &SentSide) -> serde_json::Value {
        let window = (args.duration - args.warmup).as_secs_f64();
        let hot: Vec<usize> = (0..args.peers).filter(|&i| args.is_hot(i)).collect();
        let hot_rates: Vec<f64> = hot.iter().map(|&i| r.counts[i] as f64 / window).collect();
        // Folded from +0.0: an empty f64 sum is -0.0.
        let hot_total = hot_rates.iter().fold(0.0, |a, b| a + b);
        let cold_total = (0..args.peers)
            .filter(|&i| !args.is_hot(i))
            .map(|i| r.counts[i] as f64 / window)
            .fold(0.0, |a, b| a + b);
        let dedicated_hot = r
            .end
            .dedicated
            .iter()
            .filter(|&&i| args.is_hot(i as usize))
            .count();
        let receiver_switches =
            r.end.granting_switches - r.warm_switches.min(r.end.granting_switches);
        let note = (args.mode == Mode::Dedicated).then(|| {
            format!(
                "mode dedicated: every sender switched to a dedicated lane itself; \
                 max_dedicated ({}) bounds only negotiated lanes: all peers dedicated",
                args.max_dedicated
            )
        });
        // No latency without a message.
        let us = |ns: u64| (r.latency_samples > 0).then_some(ns as f64 / 1000.0);
        serde_json::json!({
            "mode": args.mode.name(),
            "pattern": args.pattern.name(),
            "transport": args.transport.name(),
            "peers": args.peers,
            "hot": hot.len(),
            "sender_threads": match args.pattern {
                Pattern::MbwMr => args.hot + usize::from(args.peers > args.hot),
                Pattern::Alltoall => args.hot,
            },
            "max_dedicated": args.max_dedicated,
            "duration_s": args.duration.as_secs_f64(),
            "warmup_s": args.warmup.as_secs_f64(),
            "message_bytes": MESSAGE_BYTES,
            "hot_rate_msgs_per_s": hot_total,
            "hot_rate_per_peer_msgs_per_s": hot_total / hot.len().max(1) as f64,
            "hot_rates_msgs_per_s": hot_rates,
            "cold_rate_msgs_per_s": cold_total,
            "hot_latency_samples": r.latency_samples,
            "hot_p50_us": us(r.p50_ns),
            "hot_p99_us": us(r.p99_ns),
            "hot_max_us": us(r.max_ns),
            "dedicated_peers": r.end.dedicated,
            "dedicated_hot": dedicated_hot,
            "dedicated_cold": r.end.dedicated.len() - dedicated_hot,
            "dedicated_unknown": r.end.unknown_dedicated,
            "cold_dedicated_after_1s": r.cold_dedicated_after_1s,
            "all_hot_dedicated_after_s": r.all_hot_dedicated_after_ns.map(|ns| ns as f64 / 1e9),
            "receive_bytes": r.end.receive_bytes,
            "switches_after_warmup": receiver_switches + sent.switches_after_warmup,
            "hot_credit_waits": sent.hot_credit_waits,
            "hot_credit_waits_per_message": sent.hot_credit_waits as f64 / sent.hot_sent.max(1) as f64,
            "receiver_switches_after_warmup": receiver_switches,
            "sender_switches_after_warmup": sent.switches_after_warmup,
            "receiver_granting": r.end.granting,
            "senders_requesting": stats_json(&sent.requesting),
            "send_failures": sent.failures,
            "first_send_failure": sent.first_failure,
            "note": note,
        })
    }

    fn print_table(v: &serde_json::Value) -> Result<(), Failure> {
        use comfy_table::{presets::UTF8_FULL, Table};
        let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
        let rates: Vec<f64> = v["hot_rates_msgs_per_s"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        let (lo, hi) = rates.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &r| {
            (lo.min(r), hi.max(r))
        });
        let hot = v["hot"].as_u64().unwrap_or(0);
        let dedicated: Vec<String> = v["dedicated_peers"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|i| {
                        let is_hot = v["pattern"] == "alltoall" || i < hot;
                        format!("{i}{}", if is_hot { "*" } else { "" })
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut t = Table::new();
        t.load_preset(UTF8_FULL);
        t.set_header(vec!["figure", "value"]);
        let mut row = |k: &str, val: String| {
            t.add_row(vec![k.to_owned(), val]);
        };
        row(
            "run",
            format!(
                "{} {} over {}, {} peers ({} hot), max_dedicated {}, {} s after {} s warm-up",
                v["pattern"].as_str().unwrap_or(""),
                v["mode"].as_str().unwrap_or(""),
                v["transport"].as_str().unwrap_or(""),
                v["peers"],
                hot,
                v["max_dedicated"],
                f("duration_s") - f("warmup_s"),
                f("warmup_s"),
            ),
        );
        row(
            "hot rate, total (msgs/s)",
            format!("{:.0}", f("hot_rate_msgs_per_s")),
        );
        row(
            "hot rate per hot peer (msgs/s)",
            if rates.is_empty() {
                "-".into()
            } else {
                format!(
                    "{:.0} (min {lo:.0}, max {hi:.0})",
                    f("hot_rate_per_peer_msgs_per_s")
                )
            },
        );
        row(
            "cold rate, total (msgs/s)",
            format!("{:.1}", f("cold_rate_msgs_per_s")),
        );
        row(
            "hot one-way latency p50 / p99 (µs)",
            if v["hot_p50_us"].is_null() {
                "- (no message)".into()
            } else {
                format!("{:.2} / {:.2}", f("hot_p50_us"), f("hot_p99_us"))
            },
        );
        row(
            "dedicated at the end (* hot)",
            format!(
                "{} hot of {hot}, {} cold: {}",
                v["dedicated_hot"],
                v["dedicated_cold"],
                if dedicated.is_empty() {
                    "none".into()
                } else {
                    dedicated.join(" ")
                }
            ),
        );
        row(
            "all hot peers dedicated after",
            match v["all_hot_dedicated_after_s"].as_f64() {
                Some(s) => format!("{s:.3} s"),
                None => "never".into(),
            },
        );
        row(
            "cold peer dedicated after 1 s",
            if v["cold_dedicated_after_1s"] == true {
                "yes".into()
            } else {
                "no".into()
            },
        );
        row(
            "receive buffers at the receiver",
            format!(
                "{} bytes ({})",
                v["receive_bytes"],
                units::format_size(v["receive_bytes"].as_u64().unwrap_or(0))
            ),
        );
        row(
            "lane switches after warm-up",
            format!(
                "{} (receiver {}, senders {})",
                v["switches_after_warmup"],
                v["receiver_switches_after_warmup"],
                v["sender_switches_after_warmup"]
            ),
        );
        if v["send_failures"].as_u64().unwrap_or(0) > 0 {
            t.add_row(vec![
                "failed sends".to_owned(),
                format!(
                    "{} (first: {})",
                    v["send_failures"],
                    v["first_send_failure"].as_str().unwrap_or("")
                ),
            ]);
        }
        outln!("{t}")?;
        if let Some(note) = v["note"].as_str() {
            outln!("note: {note}")?;
        }
        Ok(())
    }
}
