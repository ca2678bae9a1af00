//! `multirail pingpong`: the ping-pong latency method (perftest's, as RAMCloud's InfRc study
//! used it) as a tool. A client sends a message of
//! `--size` bytes, the server answers with one of the same size, `--iterations` times, both
//! single-threaded and busy polling. Reports perftest's columns (one-way = round trip / 2),
//! the raw trace, periodic patterns in words and a plot.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use multirail::config::{ReturnOrder, ReturnPolicy, MAX_SPIN_US};
use multirail::{Config, Engine, TransportChoice};
use multirail_policy::latency::{self, PatternReport, Summary};
use multirail_policy::receive::{MAX_BUFFER_SIZE, MAX_QUEUE_DEPTH, MAX_SGE};

use crate::child::{Guarded, Stop};
use crate::limits;
use crate::out::outln;
use crate::ticks::Ticks;
use crate::Failure;

/// How long the client waits for one answer before giving up.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// Most round trips measured, and most before measuring: every measured one is kept (8 bytes
/// each, sorted for the report), and ten million take minutes over tcp.
const MAX_ITERATIONS: u64 = 10_000_000;
/// Longest spin between an answer and the next message, µs (a second).
const MAX_THINK_US: u64 = 1_000_000;
/// Warm-up round trips whose median is the busy round trip `--gap-ms` subtracts: the last ones.
const WARM_KEPT: usize = 1000;
/// Longest silence before a round trip, ms (a minute).
const MAX_GAP_MS: u64 = 60_000;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Transport {
    Shm,
    Tcp,
    Rdma,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PolicyArg {
    Individual,
    Bulk,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OrderArg {
    BeforeReply,
    AfterReply,
}

/// Flags of `multirail pingpong`.
#[derive(Args)]
pub struct PingpongArgs {
    /// Serve: answer every message with one of the same size until interrupted. Prints the
    /// segment name first.
    #[arg(long, conflicts_with_all = ["connect", "local"])]
    server: bool,
    /// Segment (`host:port`) of a `multirail pingpong --server` to ping.
    #[arg(long, required_unless_present_any = ["server", "local"], conflicts_with = "local")]
    connect: Option<String>,
    /// Start the server as a child process on loopback and ping it.
    #[arg(long)]
    local: bool,
    /// Address the server listens on. Default: 127.0.0.1:0.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Message size in bytes, each way, 1 to 67108864 (64 MiB, the largest receive buffer).
    /// Default: 128.
    #[arg(long, default_value_t = 128,
          value_parser = limits::count::<usize>(1, MAX_BUFFER_SIZE as u64))]
    size: usize,
    /// Round trips measured, 1 to 10000000. Default: 10000.
    #[arg(long, default_value_t = 10_000,
          value_parser = limits::count::<usize>(1, MAX_ITERATIONS))]
    iterations: usize,
    /// Round trips before measuring, 0 to 10000000. Default: 1000.
    #[arg(long, default_value_t = 1_000,
          value_parser = limits::count::<usize>(0, MAX_ITERATIONS))]
    warmup: usize,
    /// Transport carrying the messages: shm, tcp, or rdma (SEND/RECV over verbs). Default: shm.
    #[arg(long, value_enum, default_value_t = Transport::Shm)]
    transport: Transport,
    /// Receive buffers per connection or in the shared pool (N), 1 to 1048576. Default: the
    /// configuration's `transports.<transport>.receive.queue_depth` (64; 63 for rdma,
    /// RAMCloud's).
    #[arg(long, value_parser = limits::count_setting::<usize>(
        1, MAX_QUEUE_DEPTH as u64, "transports.<transport>.receive.queue_depth"))]
    queue_depth: Option<usize>,
    /// One receive pool shared by all connections (SRQ). Default: the configuration's (false;
    /// true for rdma).
    #[arg(long)]
    shared_receive_queue: Option<bool>,
    /// Registration chunks M, 1 to 1048576 (must divide N). Default: the configuration's (1).
    #[arg(long, value_parser = limits::count_setting::<usize>(
        1, MAX_QUEUE_DEPTH as u64, "transports.<transport>.receive.registration_chunks"))]
    registration_chunks: Option<usize>,
    /// Most scatter/gather entries per receive, 1 to 32. Default: the configuration's (1).
    #[arg(long, value_parser = limits::count_setting::<usize>(
        1, MAX_SGE as u64, "transports.<transport>.receive.max_sge"))]
    max_sge: Option<usize>,
    /// When consumed buffers go back. Default: the configuration's (individual).
    #[arg(long, value_enum)]
    return_policy: Option<PolicyArg>,
    /// Return a request's buffer before or after the reply. Default: the configuration's
    /// (before-reply).
    #[arg(long, value_enum)]
    return_order: Option<OrderArg>,
    /// Microseconds a waiting receive polls before it sleeps on the doorbell, on both sides,
    /// 0 to 1000000. Default: the configuration's `transports.<transport>.receive.spin_us`
    /// (200).
    #[arg(long, value_parser = limits::count_setting::<u64>(
        0, MAX_SPIN_US, "transports.<transport>.receive.spin_us"))]
    spin_us: Option<u64>,
    /// Milliseconds of silence before each measured round trip, 0 to 60000: the client sleeps
    /// that long, so the server's receive has gone to sleep on its doorbell when the message
    /// comes; the report then adds the first message's delivery (the round trip less the
    /// busy one-way latency: half the median round trip of the last 1000 warm-up round trips
    /// or of 1000 busy ones after the gapped ones, whichever is smaller; the answer comes back
    /// to a client that is still spinning). Give it a warm-up of a few thousand.
    /// Default: 0.
    #[arg(long, default_value_t = 0, value_parser = limits::count::<u64>(0, MAX_GAP_MS))]
    gap_ms: u64,
    /// Milliseconds added to each silence of `--gap-ms`, drawn uniformly from 0 to this, 0 to
    /// 60000: messages at times a receiver cannot foresee (with 0, every silence is the same
    /// and a receiver may learn the cadence; see `transports.<t>.receive.cadence_lead_us`).
    /// Default: 0.
    #[arg(long, default_value_t = 0, requires = "gap_ms",
          value_parser = limits::count::<u64>(0, MAX_GAP_MS))]
    gap_spread_ms: u64,
    /// Microseconds the client spins between an answer and its next message, 0 to 1000000.
    /// Default: 0.
    #[arg(long, default_value_t = 0, value_parser = limits::count::<u64>(0, MAX_THINK_US))]
    think_us: u64,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Write every round trip as CSV (`iteration,rtt_ns`). Default: none.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Draw round trip against iteration (a window) and a histogram into this PNG. Default: none.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Iterations in the plot's window, from the first measured one, 1 to 10000000.
    /// Default: 128.
    #[arg(long, default_value_t = 128,
          value_parser = limits::count::<usize>(1, MAX_ITERATIONS))]
    plot_window: usize,
    /// Exit after one client said goodbye (used by --local).
    #[arg(long, hide = true)]
    once: bool,
}

impl PingpongArgs {
    fn apply(&self, config: &mut Config) {
        config.transport = match self.transport {
            Transport::Shm => TransportChoice::Shm,
            Transport::Tcp => TransportChoice::Tcp,
            Transport::Rdma => TransportChoice::Rdma,
        };
        for r in [
            &mut config.transports.tcp.receive,
            &mut config.transports.shm.receive,
            &mut config.transports.rdma.receive,
        ] {
            if let Some(v) = self.queue_depth {
                r.queue_depth = v;
            }
            if let Some(v) = self.shared_receive_queue {
                r.shared_receive_queue = v;
            }
            if let Some(v) = self.registration_chunks {
                r.registration_chunks = v;
            }
            if let Some(v) = self.max_sge {
                r.max_sge = v;
            }
            if let Some(v) = self.return_policy {
                r.return_policy = match v {
                    PolicyArg::Individual => ReturnPolicy::Individual,
                    PolicyArg::Bulk => ReturnPolicy::Bulk,
                };
            }
            if let Some(v) = self.return_order {
                r.return_order = match v {
                    OrderArg::BeforeReply => ReturnOrder::BeforeReply,
                    OrderArg::AfterReply => ReturnOrder::AfterReply,
                };
            }
            if let Some(v) = self.spin_us {
                r.spin_us = v;
            }
            r.buffer_size = r.buffer_size.max(self.size);
        }
    }

    /// The flags a `--local` server needs to match this client.
    fn server_flags(&self) -> Vec<String> {
        let mut f = vec![
            "--transport".to_string(),
            match self.transport {
                Transport::Shm => "shm",
                Transport::Tcp => "tcp",
                Transport::Rdma => "rdma",
            }
            .into(),
            "--size".into(),
            self.size.to_string(),
        ];
        let mut opt = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                f.push(format!("--{name}"));
                f.push(v);
            }
        };
        opt("queue-depth", self.queue_depth.map(|v| v.to_string()));
        opt(
            "shared-receive-queue",
            self.shared_receive_queue.map(|v| v.to_string()),
        );
        opt(
            "registration-chunks",
            self.registration_chunks.map(|v| v.to_string()),
        );
        opt("max-sge", self.max_sge.map(|v| v.to_string()));
        opt("spin-us", self.spin_us.map(|v| v.to_string()));
        opt(
            "return-policy",
            self.return_policy.map(|v| {
                match v {
                    PolicyArg::Individual => "individual",
                    PolicyArg::Bulk => "bulk",
                }
                .into()
            }),
        );
        opt(
            "return-order",
            self.return_order.map(|v| {
                match v {
                    OrderArg::BeforeReply => "before-reply",
                    OrderArg::AfterReply => "after-reply",
                }
                .into()
            }),
        );
        f
    }
}

/// Runs `multirail pingpong`: the server, or a client of one (started here with --local).
pub fn run(
    mut config: Config,
    config_path: Option<&Path>,
    args: PingpongArgs,
) -> Result<(), Failure> {
    args.apply(&mut config);
    config
        .validate()
        .map_err(|e| Failure::Usage(e.to_string()))?;
    if args.server {
        return serve(config, &args);
    }
    // Stopped when dropped, on every way out of here: it exits by itself after the client's
    // goodbye, and is killed if it has not.
    let mut server = None;
    let target = match &args.connect {
        Some(name) => name.clone(),
        None => {
            let s = LocalServer::start(config_path, &args)?;
            let name = s.name.clone();
            server = Some(s);
            name
        }
    };
    let outcome = client(config, &args, &target, server.as_mut());
    drop(server);
    outcome
}

fn serve(config: Config, args: &PingpongArgs) -> Result<(), Failure> {
    let engine = Engine::new(config, &args.listen)?;
    outln!("{}", engine.name())?;
    let mut peers: HashMap<Arc<str>, multirail::SegmentId> = HashMap::new();
    // Every message of a connection shares one name: answering the same client again costs a
    // pointer comparison, not a hash of its name, inside the measured round trip.
    let mut last: Option<(Arc<str>, multirail::SegmentId)> = None;
    loop {
        let Some(m) = engine.recv(None)? else {
            continue;
        };
        if m.data.is_empty() {
            peers.remove(&m.from);
            last = None;
            if args.once {
                // The `--local` client reads this line after its goodbye: how this server's
                // waits went (asleep, or polling ahead of a message due at the cadence).
                let stats = engine.message_stats();
                outln!(
                    "{}",
                    serde_json::json!({
                        "recv_sleeps": stats.recv_sleeps,
                        "recv_anticipated": stats.recv_anticipated,
                        "recv_cpu_moves": stats.recv_cpu_moves,
                        "received": stats.received,
                    })
                )?;
                return Ok(());
            }
            continue;
        }
        let seg = match &last {
            Some((name, seg)) if Arc::ptr_eq(name, &m.from) => *seg,
            _ => {
                let seg = match peers.get(&m.from) {
                    Some(s) => *s,
                    None => {
                        let s = engine.open_segment(&m.from)?;
                        peers.insert(m.from.clone(), s);
                        s
                    }
                };
                last = Some((m.from.clone(), seg));
                seg
            }
        };
        engine.send(seg, &m.data)?;
    }
}

/// The `--local` server: a `pingpong --server --once` child, stopped when dropped.
struct LocalServer {
    child: Guarded,
    /// Kept open while the server runs; after the goodbye it carries the server's stats.
    stdout: Option<BufReader<ChildStdout>>,
    name: String,
}

/// How long the client waits for the `--local` server's stats line after its goodbye.
const SERVER_STATS_WAIT: Duration = Duration::from_secs(5);

impl LocalServer {
    /// The server's message stats line (JSON), printed as it exits after the client's
    /// goodbye; `None` when it did not come within [`SERVER_STATS_WAIT`] or was not JSON
    /// (the report then goes without it rather than hang on a stuck child).
    fn stats(&mut self) -> Option<serde_json::Value> {
        let mut stdout = self.stdout.take()?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = stdout.read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(SERVER_STATS_WAIT).ok()?;
        serde_json::from_str(line.trim()).ok()
    }

    fn start(config_path: Option<&Path>, args: &PingpongArgs) -> anyhow::Result<LocalServer> {
        let exe = std::env::current_exe().context("locating the multirail binary")?;
        let mut cmd = Command::new(exe);
        if let Some(p) = config_path {
            cmd.arg("--config").arg(p);
        }
        cmd.args(["pingpong", "--server", "--once", "--listen", "127.0.0.1:0"])
            .args(args.server_flags())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child =
            Guarded::spawn(&mut cmd, Stop::Wait).context("starting the local server")?;
        let mut stdout = BufReader::new(child.take_stdout().expect("piped"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .context("reading the local server's segment name")?;
        let name = line.trim().to_owned();
        if name.is_empty() {
            let status = child.wait()?;
            bail!("the local server exited ({status}) before printing its segment name");
        }
        Ok(LocalServer {
            child,
            stdout: Some(stdout),
            name,
        })
    }
}

/// Runs the round trips against `target`; `server`, the `--local` server, has its CPU time
/// over the gapped round trips and its message stats reported.
fn client(
    config: Config,
    args: &PingpongArgs,
    target: &str,
    mut server: Option<&mut LocalServer>,
) -> Result<(), Failure> {
    let server_pid = server.as_ref().map(|s| s.child.id());
    let receive = match args.transport {
        Transport::Shm => config.transports.shm.receive.clone(),
        Transport::Tcp => config.transports.tcp.receive.clone(),
        Transport::Rdma => config.transports.rdma.receive.clone(),
    };
    let engine = Engine::new(config, "127.0.0.1:0")?;
    let seg = engine.open_segment(target)?;
    let msg = vec![0xA5u8; args.size];
    let total = args.warmup + args.iterations;
    let mut rtt = Vec::with_capacity(args.iterations);
    let think = Duration::from_micros(args.think_us);
    let gap = Duration::from_millis(args.gap_ms);
    // The last warm-up round trips (busy), for the busy one-way latency a gap's report
    // subtracts; the first ones after the engines start run slower.
    let mut warm = Vec::with_capacity(args.warmup.min(WARM_KEPT));
    let clock = Ticks::start();
    // The previous answer is dropped after the next message went out, as the server drops a
    // message after answering it: freeing it is not part of a round trip.
    let mut previous = None;
    // One round trip (round trip `i`, for errors), in clock ticks.
    let mut round_trip = |i: usize| -> Result<u64, Failure> {
        let t0 = clock.now();
        engine.send(seg, &msg)?;
        drop(previous.take());
        let answer = engine.recv(Some(ANSWER_TIMEOUT))?.ok_or_else(|| {
            anyhow::anyhow!(
                "no answer to round trip {i} within {} s from {target}: is it a `multirail \
                     pingpong --server`? (a `multirail target` takes messages but answers none)",
                ANSWER_TIMEOUT.as_secs()
            )
        })?;
        let took = clock.now().wrapping_sub(t0);
        if answer.data.len() != args.size {
            return Err(anyhow::anyhow!(
                "answer of {} bytes to a {}-byte message",
                answer.data.len(),
                args.size
            )
            .into());
        }
        previous = Some(answer);
        if !think.is_zero() {
            let t = Instant::now();
            while t.elapsed() < think {
                std::hint::spin_loop();
            }
        }
        Ok(took)
    };
    let mut spread = Spread::new(Duration::from_millis(args.gap_spread_ms));
    let mut server_cpu = None;
    for i in 0..total {
        if i == args.warmup {
            server_cpu = server_pid.and_then(|p| ProcessCpu::start(p).ok());
        }
        if i >= args.warmup && !gap.is_zero() {
            std::thread::sleep(gap + spread.next());
        }
        let took = round_trip(i)?;
        if i >= args.warmup {
            rtt.push(took);
        } else if i + WARM_KEPT >= args.warmup {
            warm.push(took);
        }
    }
    // The server's share of a core over the measured round trips (and their silences).
    let server_cpu_pct = server_cpu.and_then(|c| c.pct_of_core().ok());
    // The lanes the round trips ended on (dynamic lanes promote a busy peer after a while).
    let lanes = engine.lanes();
    // A second busy measure after the gapped round trips: now and then a host keeps both
    // processes on one core for the first thousands of round trips (~100 µs each instead of
    // ~0.2 over shm), and a warm-up's tail taken then would have the report subtract that.
    let mut after = Vec::new();
    if !gap.is_zero() {
        for i in total..total + WARM_KEPT {
            after.push(round_trip(i)?);
        }
    }
    let lane_of = |l: &[multirail::PeerLaneReport]| {
        l.first().map(|p| {
            serde_json::json!({
                "lane": format!("{:?}", p.lane).to_lowercase(),
                "duplex": p.duplex,
            })
        })
    };
    let lanes_json = serde_json::json!({
        "outgoing": lane_of(&lanes.outgoing),
        "incoming": lane_of(&lanes.incoming),
    });
    engine.send(seg, &[])?;
    let engine_sleeps = engine.message_stats().recv_sleeps;
    let server_stats = server.as_mut().and_then(|s| s.stats());
    let ns_per_tick = clock.ns_per_tick();
    for v in rtt.iter_mut() {
        *v = (*v as f64 * ns_per_tick).round() as u64;
    }
    let summary = Summary::from_round_trips(&rtt).expect("at least one iteration");
    let first = (!gap.is_zero()).then(|| first_message(&rtt, &mut warm, &mut after, ns_per_tick));
    let patterns = latency::find_patterns(&rtt);
    if let Some(path) = &args.trace {
        write_trace(path, &rtt).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        plot::draw(path, &rtt, args.plot_window, &summary, &patterns)
            .with_context(|| format!("drawing {}", path.display()))?;
    }
    let transport = match args.transport {
        Transport::Shm => "shm",
        Transport::Tcp => "tcp",
        Transport::Rdma => "rdma",
    };
    if args.json {
        let json = serde_json::json!({
            "transport": transport,
            "bytes": args.size,
            "iterations": summary.iterations,
            "receive": receive,
            "t_min_us": summary.t_min,
            "t_max_us": summary.t_max,
            "t_typical_us": summary.t_typical,
            "t_avg_us": summary.t_avg,
            "t_stdev_us": summary.t_stdev,
            "p99_us": summary.p99,
            "p999_us": summary.p999,
            "pattern": patterns.describe(),
            "patterns": patterns.patterns.iter().map(|p| serde_json::json!({
                "period": p.period,
                "groups": p.groups.iter().map(|g| serde_json::json!({
                    "phases": g.phases,
                    "cycle": g.cycle,
                    "round_trip_us": g.level_ns / 1000.0,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "others_round_trip_us": patterns.others_ns / 1000.0,
            "lanes": lanes_json,
            "spin_us": receive.spin_us,
            "gap_ms": args.gap_ms,
            "gap_spread_ms": args.gap_spread_ms,
            "server_cpu_pct_of_core": server_cpu_pct,
            "first_message": first.as_ref().map(|f| serde_json::json!({
                "busy_one_way_us": f.busy_one_way_us,
                "p50_us": f.p50_us,
                "p90_us": f.p90_us,
                "p99_us": f.p99_us,
                "max_us": f.max_us,
            })),
            "client_recv_sleeps": engine_sleeps,
            "server_messages": server_stats,
        });
        outln!("{}", serde_json::to_string_pretty(&json).expect("json"))
    } else {
        print_table(transport, args.size, &receive, &summary, &patterns)?;
        if let Some(f) = first {
            outln!(
                "first message after {} ms of silence (round trip less the busy one-way {:.2} µs): p50 {:.2} µs, p90 {:.2}, p99 {:.2}, max {:.2}",
                if args.gap_spread_ms > 0 {
                    format!("{} to {}", args.gap_ms, args.gap_ms + args.gap_spread_ms)
                } else {
                    args.gap_ms.to_string()
                },
                f.busy_one_way_us, f.p50_us, f.p90_us, f.p99_us, f.max_us
            )?;
        }
        if let Some(pct) = server_cpu_pct {
            outln!("server CPU over the measured round trips: {pct:.2} % of a core")?;
        }
        if let Some(s) = &server_stats {
            outln!(
                "server's recv: {} messages, {} taken after sleeping on the doorbell, {} polled for ahead of their cadence, {} moves off a CPU another task took meanwhile",
                s["received"], s["recv_sleeps"], s["recv_anticipated"], s["recv_cpu_moves"]
            )?;
        }
        Ok(())
    }
}

/// Uniform random extra silences up to a bound (`--gap-spread-ms`), from a xorshift seeded
/// by the clock: nothing here needs more than unforeseeable.
struct Spread {
    max_us: u64,
    state: u64,
}

impl Spread {
    fn new(max: Duration) -> Spread {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Spread {
            max_us: max.as_micros() as u64,
            state: seed | 1,
        }
    }

    /// The next extra silence: zero when the bound is.
    fn next(&mut self) -> Duration {
        if self.max_us == 0 {
            return Duration::ZERO;
        }
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        Duration::from_micros(self.state % (self.max_us + 1))
    }
}

/// A process's CPU time (every thread's user and system time, from `/proc/PID/stat`) since a
/// start, against the wall clock.
struct ProcessCpu {
    pid: u32,
    ticks: u64,
    at: Instant,
}

impl ProcessCpu {
    /// Starts counting for `pid`; fails when its `/proc` entry cannot be read.
    fn start(pid: u32) -> std::io::Result<ProcessCpu> {
        Ok(ProcessCpu {
            pid,
            ticks: cpu_ticks(pid)?,
            at: Instant::now(),
        })
    }

    /// The share of one core the process used since the start, in percent; fails when its
    /// `/proc` entry cannot be read (it exited).
    fn pct_of_core(&self) -> std::io::Result<f64> {
        let used = cpu_ticks(self.pid)?.saturating_sub(self.ticks);
        // SAFETY: sysconf reads a constant of the system and touches no memory of ours.
        let per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let wall = self.at.elapsed().as_secs_f64().max(1e-9);
        Ok(100.0 * used as f64 / per_s / wall)
    }
}

/// utime + stime of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> std::io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (in parentheses) may hold spaces: count fields after its end.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    match (field(11), field(12)) {
        (Some(u), Some(s)) => Ok(u + s),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("/proc/{pid}/stat has no utime and stime fields"),
        )),
    }
}

/// The delivery of a message after a silence, from `--gap-ms` round trips.
struct FirstMessage {
    busy_one_way_us: f64,
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    max_us: f64,
}

/// The gap round trips `rtt` (ns) less the busy one-way latency (half the median round trip
/// of the warm-up's tail `warm` or of the busy burst `after` the gapped ones, whichever is
/// smaller; in ticks of `ns_per_tick`): how long the first message after a silence took to be
/// received, its answer having come back as fast as when busy.
fn first_message(
    rtt: &[u64],
    warm: &mut [u64],
    after: &mut [u64],
    ns_per_tick: f64,
) -> FirstMessage {
    let median = |v: &mut [u64]| {
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    };
    let busy_ns = match (median(warm), median(after)) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => 0,
    } as f64
        * ns_per_tick
        / 2.0;
    let mut first: Vec<f64> = rtt
        .iter()
        .map(|&r| ((r as f64 - busy_ns) / 1000.0).max(0.0))
        .collect();
    first.sort_by(f64::total_cmp);
    let at = |p: f64| first[((first.len() - 1) as f64 * p).round() as usize];
    FirstMessage {
        busy_one_way_us: busy_ns / 1000.0,
        p50_us: at(0.5),
        p90_us: at(0.9),
        p99_us: at(0.99),
        max_us: at(1.0),
    }
}

fn print_table(
    transport: &str,
    size: usize,
    r: &multirail::config::ReceiveConfig,
    s: &Summary,
    patterns: &PatternReport,
) -> Result<(), Failure> {
    outln!(
        "transport {transport}, queue_depth {}, shared_receive_queue {}, registration_chunks {}, max_sge {}, return {:?} {:?}",
        r.queue_depth, r.shared_receive_queue, r.registration_chunks, r.max_sge, r.return_policy, r.return_order
    )?;
    outln!(
        " {:<7} {:<11} {:>12} {:>12} {:>16} {:>12} {:>14} {:>22} {:>24}",
        "#bytes",
        "#iterations",
        "t_min[usec]",
        "t_max[usec]",
        "t_typical[usec]",
        "t_avg[usec]",
        "t_stdev[usec]",
        "99% percentile[usec]",
        "99.9% percentile[usec]"
    )?;
    outln!(
        " {:<7} {:<11} {:>12.2} {:>12.2} {:>16.2} {:>12.2} {:>14.2} {:>22.2} {:>24.2}",
        size,
        s.iterations,
        s.t_min,
        s.t_max,
        s.t_typical,
        s.t_avg,
        s.t_stdev,
        s.p99,
        s.p999
    )?;
    outln!(
        "pattern: {}",
        patterns.describe().replace('\n', "\n         ")
    )
}

fn write_trace(path: &Path, rtt: &[u64]) -> std::io::Result<()> {
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(w, "iteration,rtt_ns")?;
    for (i, v) in rtt.iter().enumerate() {
        writeln!(w, "{},{}", i + 1, v)?;
    }
    w.flush()
}

/// The ping-pong study's picture: round trip against iteration for a window, and a histogram.
mod plot {
    use std::path::Path;

    use anyhow::{anyhow, Context};
    use multirail_policy::latency::{percentile_sorted, PatternReport, Summary};
    use plotters::prelude::*;

    fn font() -> anyhow::Result<()> {
        multirail_sim::report::register_font().map_err(|e| anyhow!(e))
    }

    pub(super) fn draw(
        path: &Path,
        rtt: &[u64],
        window: usize,
        summary: &Summary,
        patterns: &PatternReport,
    ) -> anyhow::Result<()> {
        font()?;
        let us: Vec<f64> = rtt.iter().map(|&v| v as f64 / 1000.0).collect();
        let mut sorted = rtt.to_vec();
        sorted.sort_unstable();
        let hi = percentile_sorted(&sorted, 99.9) as f64 / 1000.0 * 1.15;
        let lo = sorted[0] as f64 / 1000.0 * 0.9;
        let root = BitMapBackend::new(path, (1200, 900)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let (top, bottom) = root.split_vertically(480);
        let n = window.clamp(2, us.len().max(2)).min(us.len());
        let title = format!(
            "round trip per iteration (first {n}); median one-way {:.2} µs; {}",
            summary.t_typical,
            patterns.describe().lines().next().unwrap_or("")
        );
        let mut chart = ChartBuilder::on(&top)
            .caption(title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(1usize..n.max(2), lo..hi)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc("round trip (µs)")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(LineSeries::new(
                us.iter()
                    .take(n)
                    .enumerate()
                    .map(|(i, &v)| (i + 1, v.min(hi))),
                BLUE.stroke_width(1),
            ))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(
                us.iter()
                    .take(n)
                    .enumerate()
                    .map(|(i, &v)| Circle::new((i + 1, v.min(hi)), 2, BLUE.filled())),
            )
            .map_err(|e| anyhow!("{e}"))?;

        let bins = 120usize;
        let width = (hi - lo) / bins as f64;
        let mut counts = vec![0u32; bins];
        for &v in &us {
            let b = (((v - lo) / width) as isize).clamp(0, bins as isize - 1) as usize;
            counts[b] += 1;
        }
        let top_count = counts.iter().copied().max().unwrap_or(1).max(1);
        let mut hist = ChartBuilder::on(&bottom)
            .caption(
                format!(
                    "histogram of {} round trips (above {hi:.1} µs in the last bin)",
                    us.len()
                ),
                ("sans-serif", 16),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(lo..hi, 0u32..top_count + top_count / 10 + 1)
            .map_err(|e| anyhow!("{e}"))?;
        hist.configure_mesh()
            .x_desc("round trip (µs)")
            .y_desc("iterations")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        hist.draw_series(counts.iter().enumerate().map(|(i, &c)| {
            let x0 = lo + i as f64 * width;
            Rectangle::new([(x0, 0), (x0 + width, c)], RED.mix(0.6).filled())
        }))
        .map_err(|e| anyhow!("{e}"))?;
        root.present().context("writing the PNG")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_one_way_is_the_smaller_of_the_two_busy_measures() {
        // Ticks of 1 ns. A warm-up tail slowed to 110 µs round trips (both processes on one
        // core), then a busy burst at 0.4 µs: the burst's 0.2 µs one-way is subtracted.
        let rtt = [30_000u64, 40_000, 50_000];
        let mut slow_warm = vec![110_000u64; 9];
        let mut fast_after = vec![400u64; 9];
        let f = first_message(&rtt, &mut slow_warm, &mut fast_after, 1.0);
        assert!(
            (f.busy_one_way_us - 0.2).abs() < 1e-9,
            "{}",
            f.busy_one_way_us
        );
        assert!((f.p50_us - 39.8).abs() < 1e-9, "{}", f.p50_us);
        // And the other way round; and either alone.
        let f = first_message(&rtt, &mut fast_after.clone(), &mut slow_warm.clone(), 1.0);
        assert!((f.busy_one_way_us - 0.2).abs() < 1e-9);
        let f = first_message(&rtt, &mut [], &mut [600, 600, 600], 1.0);
        assert!((f.busy_one_way_us - 0.3).abs() < 1e-9);
        let f = first_message(&rtt, &mut [], &mut [], 1.0);
        assert_eq!(f.busy_one_way_us, 0.0);
        assert!((f.max_us - 50.0).abs() < 1e-9);
    }
}
