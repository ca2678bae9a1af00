//! `multirail bench`: an initiator that keeps batches of requests going against a target for a
//! fixed time and reports throughput, batch latency and what each rail carried.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Context};
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use multirail::{
    Buffer, Config, Engine, Location, Opcode, Priority, RailTraffic, Request, SegmentId,
    TransportChoice,
};

use crate::child::{Guarded, Stop};
use crate::limits::{self, MAX_BYTES, MAX_DURATION, MIN_DURATION};
use crate::out::outln;
use crate::pattern;
use crate::units;
use crate::Failure;

#[derive(Clone, Copy, ValueEnum)]
enum Op {
    Read,
    Write,
}

/// Most submitting threads one bench starts (`--threads`, or the sum of `--mix` submitters).
/// Each is an OS thread with its own share of the buffers; far beyond the core count the run
/// measures the host's scheduler, and an unchecked count would size allocations.
const MAX_THREADS: usize = 1024;
/// Most requests per batch (`--batch-size`): the engine sizes a batch's task list by it.
const MAX_BATCH: usize = 65_536;
/// `--size` of a `--local` run when none is given, and the most a `--target` run takes from the
/// target's largest buffer when none is given.
const DEFAULT_SIZE: u64 = 1 << 30;
/// Most bytes `--total` asks for: 64 TiB take hours at the speed of any one host.
const MAX_TOTAL: u64 = 64 << 40;
/// Largest request of the traffic around the timed run (seeding the target before a verified
/// read, reading it back after a verified write), and the size of the read-back scratch buffer.
const PIECE: u64 = 64 << 20;

/// Flags of `multirail bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Segment to benchmark against (`host:port`, as `multirail target` prints it).
    #[arg(long, required_unless_present = "local", conflicts_with = "local")]
    target: Option<String>,
    /// Start a target on this host as a child process and benchmark against it. Default: off.
    #[arg(long)]
    local: bool,
    /// Operation. Default: write.
    #[arg(long, value_enum, default_value = "write")]
    op: Op,
    /// Bytes per request, 1 B to 1 TiB and at most each thread's share of --size. Default:
    /// 1MiB.
    #[arg(long, default_value = "1MiB", value_parser = limits::size(1, MAX_BYTES))]
    block_size: u64,
    /// Requests per batch, 1 to 65536. Default: 16.
    #[arg(long, default_value_t = 16,
          value_parser = limits::count::<usize>(1, MAX_BATCH as u64))]
    batch_size: usize,
    /// Submitting threads, 1 to 1024, each with its own region of the buffers. Default: 1.
    #[arg(long, default_value_t = 1,
          value_parser = limits::count::<usize>(1, MAX_THREADS as u64))]
    threads: usize,
    /// How long to run (seconds, or e.g. 500ms, 2h), 1ms to 24h. Default: 5.
    #[arg(long, default_value = "5", value_parser = limits::duration(MIN_DURATION, MAX_DURATION))]
    duration: Duration,
    /// Transport: auto, shm, tcp or rdma. Default: auto (shm on the same host, else rdma when
    /// both ends have RDMA devices, else tcp).
    #[arg(long, default_value = "auto", value_parser = parse_transport)]
    transport: TransportChoice,
    /// Buffer size on each side (and of the `--local` target), 1 B to 1 TiB and within this
    /// host's memory. Default: 1GiB with --local; with --target, the target's largest buffer,
    /// at most 1GiB (said on stderr).
    #[arg(long, value_parser = limits::size(1, MAX_BYTES))]
    size: Option<u64>,
    /// Where in the target's buffer this run's regions begin (e.g. 512MiB; 0 to 1 TiB), so
    /// several benches against one long-lived target, each given its own offset, move and
    /// --verify their own bytes at the same time. The run takes --size bytes from there (by
    /// default what is left of the target's buffer, at most 1GiB); a `--local` target is made
    /// this much larger. Default: 0.
    #[arg(long, default_value = "0", value_parser = limits::size(0, MAX_BYTES))]
    target_offset: u64,
    /// Stop after moving this many bytes (e.g. 256MiB; at least one batch, at most 64 TiB)
    /// instead of after --duration. Default: off.
    #[arg(long, value_parser = limits::size(1, MAX_TOTAL))]
    total: Option<u64>,
    /// Also report throughput per interval of this length (e.g. 250ms; 1ms to 24h and, without
    /// --total, at most --duration), counted per slice as the rails deliver them, in all and
    /// (with --json) per rail. Default: off.
    #[arg(long, value_parser = limits::duration(MIN_DURATION, MAX_DURATION))]
    interval: Option<Duration>,
    /// After the run, check every byte that landed. With --op read, the target's regions are
    /// first written with a fresh pattern (whatever earlier benches left there). Default: off.
    #[arg(long)]
    verify: bool,
    /// Priority of every request: high, medium or low. Default: high.
    #[arg(long, default_value = "high", value_parser = parse_priority)]
    priority: Priority,
    /// Mixed workload instead of --block-size/--threads/--priority: comma-separated
    /// priority:block:submitters (blocks 1 B to 1 TiB), at most 1024 submitters in all, e.g.
    /// high:64KiB:1,low:4MiB:8. Default: off.
    #[arg(long, value_parser = parse_mix)]
    mix: Option<Mix>,
    /// Serve Prometheus metrics of the initiator engine (the one this command runs, with
    /// --local too) at http://ADDR:PORT/metrics while it runs (port 0 picks a free port); the
    /// URL is printed on stderr as `metrics: URL`. Default: off.
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// Print one JSON object instead of tables. Default: off.
    #[arg(long)]
    json: bool,
    /// Submit each batch's blocks in a scattered order (the odd ones, then the even ones), so
    /// no request starts where the one before it ended and the engine merges none of them
    /// (`workers.merge_adjacent_max_bytes`): what blocks spread over a KV cache cost.
    /// Default: off (blocks in address order).
    #[arg(long)]
    scatter: bool,
    /// Also print the engine's traffic report in TENT's text format (per-rail totals and EWMA
    /// bandwidth, then the priority queues), after the tables, or on stderr with --json.
    /// Default: off.
    #[arg(long)]
    tent_stats: bool,
}

fn parse_transport(s: &str) -> Result<TransportChoice, String> {
    match s {
        "auto" => Ok(TransportChoice::Auto),
        "shm" => Ok(TransportChoice::Shm),
        "tcp" => Ok(TransportChoice::Tcp),
        "rdma" => Ok(TransportChoice::Rdma),
        _ => Err(format!(
            "unknown transport {s:?}; expected auto, shm, tcp or rdma"
        )),
    }
}

/// A `multirail target` child: asked to stop with SIGTERM (killed if it lingers) when dropped.
struct LocalTarget {
    child: Guarded,
    /// Kept open while the target runs, so its banner after the name finds a reader.
    stdout: BufReader<ChildStdout>,
    name: String,
}

impl LocalTarget {
    /// Stops the target and returns what it printed after its banner: its served report, when
    /// it was started with `served_report`. `None` when it could not be read.
    fn stop_and_read(mut self) -> Option<String> {
        self.child.signal(libc::SIGTERM);
        let mut text = String::new();
        // The banner line, then whatever the target printed as it stopped.
        let mut banner = String::new();
        self.stdout.read_line(&mut banner).ok()?;
        std::io::Read::read_to_string(&mut self.stdout, &mut text).ok()?;
        let _ = self.child.wait();
        Some(text)
    }

    fn start(
        config_path: Option<&Path>,
        size: u64,
        served_report: bool,
    ) -> anyhow::Result<LocalTarget> {
        let exe = std::env::current_exe().context("locating the multirail binary")?;
        let mut cmd = Command::new(exe);
        if let Some(p) = config_path {
            cmd.arg("--config").arg(p);
        }
        cmd.args(["target", "--listen", "127.0.0.1:0", "--size"])
            .arg(size.to_string())
            .args(served_report.then_some("--served-report"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child =
            Guarded::spawn(&mut cmd, Stop::Terminate).context("starting the local target")?;
        let mut stdout = BufReader::new(child.take_stdout().expect("piped"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .context("reading the local target's segment name")?;
        let name = line.trim().to_owned();
        if name.is_empty() {
            let status = child.wait()?;
            bail!("the local target exited ({status}) before printing its segment name");
        }
        Ok(LocalTarget {
            child,
            stdout,
            name,
        })
    }
}

struct Plan {
    op: Opcode,
    /// Seed of the pattern this run checks: what a write puts on the target, or what a verified
    /// read's seeding put there. Fresh per run, so bytes an earlier bench left cannot pass.
    seed: u64,
    local_base: u64,
    remote_base: u64,
    seg: SegmentId,
    transport: TransportChoice,
    submitters: Vec<Submitter>,
    /// Blocks of a batch in scattered order (`--scatter`).
    scatter: bool,
}

/// Which block of a batch of `batch` goes `k`-th: in address order, or scattered (the odd
/// blocks, then the even ones: no block comes right after the block before it in memory).
pub(crate) fn block_order(k: u64, batch: u64, scatter: bool) -> u64 {
    if !scatter {
        return k;
    }
    let odds = batch / 2;
    if k < odds {
        2 * k + 1
    } else {
        2 * (k - odds)
    }
}

/// One submitting thread: its class of work and its own region of the buffers.
#[derive(Clone)]
struct Submitter {
    class: usize,
    priority: Priority,
    block: u64,
    batch: usize,
    base: u64,
    region: u64,
}

/// A class of a mixed workload: `priority:block:submitters`.
#[derive(Clone, Debug, PartialEq)]
struct Class {
    priority: Priority,
    block: u64,
    submitters: usize,
}

fn parse_priority(s: &str) -> Result<Priority, String> {
    match s.to_ascii_lowercase().as_str() {
        "high" | "0" => Ok(multirail::PRIO_HIGH),
        "medium" | "1" => Ok(multirail::PRIO_MEDIUM),
        "low" | "2" => Ok(multirail::PRIO_LOW),
        _ => Err(format!(
            "unknown priority {s:?}; expected high, medium or low"
        )),
    }
}

fn priority_name(p: Priority) -> &'static str {
    ["high", "medium", "low"][p.index()]
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
                .ok()
                .filter(|n| (1..=MAX_THREADS).contains(n))
                .ok_or_else(|| {
                    format!(
                        "submitter count {:?} in {part:?} is not a number from 1 to {MAX_THREADS}",
                        f[2]
                    )
                })?;
            let block = limits::size(1, MAX_BYTES)(f[1])
                .map_err(|e| format!("block size {:?} in {part:?}: {e}", f[1]))?;
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
    /// When the thread's last batch completed (or failed).
    ended: Instant,
}

/// Takes one batch's bytes from the shared budget; false once it is spent.
fn take_budget(budget: &AtomicU64, bytes: u64) -> bool {
    budget
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
            left.checked_sub(bytes)
        })
        .is_ok()
}

/// Bytes from the start of `sub`'s region that a run can touch: the batches its walk covers
/// before wrapping, and with a byte budget (`--total`) no more batches than the budget pays
/// for, since the threads draw whole batches from it.
fn reachable(sub: &Submitter, total: Option<u64>) -> u64 {
    let per_batch = sub.block * sub.batch as u64;
    let walk = sub.region / per_batch * per_batch;
    total.map_or(walk, |t| walk.min(t / per_batch * per_batch))
}

/// Counters shared by the benchmark threads.
struct Shared {
    stop: AtomicBool,
    bytes: AtomicU64,
    budget: AtomicU64,
    /// Threads whose work is over.
    finished: AtomicUsize,
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
        ended: Instant::now(),
    };
    while !stop.load(Ordering::Relaxed) && take_budget(budget, per_batch) {
        let off = base + (step % steps) * per_batch;
        reqs.clear();
        for k in 0..me.batch as u64 {
            let o = off + block_order(k, me.batch as u64, plan.scatter) * me.block;
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
        ended: Instant::now(),
    }
}

/// The classes of work: the `--mix` list, or one class from --block-size, --threads and
/// --priority. Fails when the submitters add up to more than [`MAX_THREADS`].
fn classes(args: &BenchArgs) -> Result<(Vec<Class>, usize), Failure> {
    let classes = args.mix.clone().map(|m| m.0).unwrap_or_else(|| {
        vec![Class {
            priority: args.priority,
            block: args.block_size,
            submitters: args.threads,
        }]
    });
    let threads = classes
        .iter()
        .try_fold(0usize, |n, c| n.checked_add(c.submitters))
        .filter(|&n| n <= MAX_THREADS)
        .ok_or_else(|| {
            Failure::Usage(format!(
                "--mix asks for more than {MAX_THREADS} submitters in all"
            ))
        })?;
    Ok((classes, threads))
}

/// Bytes of one batch of class `c`: --batch-size × its block, or a usage error when that does
/// not fit in 64 bits.
fn batch_bytes(c: &Class, batch: usize) -> Result<u64, Failure> {
    c.block.checked_mul(batch as u64).ok_or_else(|| {
        Failure::Usage(format!(
            "--batch-size {batch} × --block-size {} is more bytes than a batch can hold",
            units::format_size(c.block)
        ))
    })
}

/// Checks the flags that do not depend on the buffer size, so a usage error is reported before
/// any target starts or any memory is allocated.
fn check_flags(args: &BenchArgs, classes: &[Class]) -> Result<(), Failure> {
    let usage = |m: String| Err(Failure::Usage(m));
    if let Some(interval) = args.interval {
        if args.total.is_none() && interval > args.duration {
            return usage(format!(
                "--interval {interval:?} is longer than --duration {:?}; no interval would end",
                args.duration
            ));
        }
    }
    let mut largest_batch = 0;
    for c in classes {
        largest_batch = largest_batch.max(batch_bytes(c, args.batch_size)?);
    }
    if let Some(total) = args.total {
        // A submitter takes its budget a whole batch at a time: with less than one batch of
        // the largest class, that class would never run.
        if total < largest_batch {
            return usage(format!(
                "--total {} is less than one batch ({} bytes: --batch-size × block); \
                 nothing would move",
                units::format_size(total),
                largest_batch
            ));
        }
    }
    Ok(())
}

/// Checks that buffers of `size` bytes (two of them with a `--local` target on this host: the
/// initiator's and the target's) fit in this host's memory ([`limits::fits_in_memory`]).
fn check_memory(size: u64, local: bool) -> Result<(), Failure> {
    limits::fits_in_memory("--size", size, if local { 2 } else { 1 }).map_err(Failure::Usage)
}

/// Gives every submitter an equal share of `size` bytes and, within it, a region of whole
/// batches of its class. Fails with a usage error naming the flags to change when a share cannot
/// hold one batch, so no region is ever empty.
fn plan_regions(
    size: u64,
    classes: &[Class],
    batch: usize,
    threads: usize,
) -> Result<Vec<Submitter>, Failure> {
    let raw = size / threads as u64;
    // Shares start on cache lines when they can, so threads do not share lines and copies run
    // aligned. Correctness does not depend on it: the pattern is defined for any byte offset,
    // and blocks of odd sizes put requests at odd offsets anyway.
    let share = if raw >= 64 { raw / 64 * 64 } else { raw };
    let mut submitters = Vec::with_capacity(threads);
    for (class, c) in classes.iter().enumerate() {
        let per_batch = batch_bytes(c, batch)?;
        let why = if c.block > share {
            Some(format!(
                "less than one --block-size {}",
                units::format_size(c.block)
            ))
        } else if per_batch > share {
            Some(format!(
                "less than one batch (--batch-size {batch} × --block-size {} = {})",
                units::format_size(c.block),
                units::format_size(per_batch)
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Failure::Usage(format!(
                "--size {} gives each of {threads} submitter(s) (--threads or --mix) {} bytes, \
                 {why}; lower --threads or --batch-size, or raise --size",
                units::format_size(size),
                share
            )));
        }
        let region = share / per_batch * per_batch;
        for _ in 0..c.submitters {
            submitters.push(Submitter {
                class,
                priority: c.priority,
                block: c.block,
                batch,
                base: submitters.len() as u64 * share,
                region,
            });
        }
    }
    Ok(submitters)
}

/// A pattern seed no earlier bench used: `RandomState` draws its keys from the OS, and the
/// clock and process id vary it further.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.finish()
}

/// Moves `len` bytes between local address `local` and byte `remote_off` of the target's buffer
/// in requests of at most [`PIECE`] bytes, in one batch, and waits for them.
fn transfer(
    engine: &Engine,
    plan: &Plan,
    opcode: Opcode,
    local: u64,
    remote_off: u64,
    len: u64,
) -> anyhow::Result<()> {
    if len == 0 {
        // The engine refuses an empty batch; nothing to move is nothing to wait for.
        return Ok(());
    }
    let reqs: Vec<Request> = (0..len.div_ceil(PIECE))
        .map(|i| {
            let o = i * PIECE;
            Request {
                opcode,
                source: local + o,
                target: plan.seg,
                target_offset: plan.remote_base + remote_off + o,
                length: PIECE.min(len - o),
                priority: multirail::PRIO_HIGH,
                transport: Some(plan.transport),
            }
        })
        .collect();
    let batch = engine.allocate_batch(reqs.len())?;
    engine.submit(batch, &reqs)?;
    engine.wait(batch, Some(Duration::from_secs(120)))?;
    engine.free_batch(batch)?;
    Ok(())
}

/// Runs `multirail bench`.
pub fn run(config: Config, config_path: Option<&Path>, args: BenchArgs) -> Result<(), Failure> {
    let (classes, threads) = classes(&args)?;
    check_flags(&args, &classes)?;
    // What can be checked without the target is checked before a target starts.
    let local_size = args.size.unwrap_or(DEFAULT_SIZE);
    let offset = args.target_offset;
    if args.local || args.size.is_some() {
        check_memory(local_size, args.local)?;
        plan_regions(local_size, &classes, args.batch_size, threads)?;
    }
    let mut local_target = if args.local {
        let target_size = local_size.checked_add(offset).filter(|&s| s <= MAX_BYTES);
        let target_size = target_size.ok_or_else(|| {
            Failure::Usage(format!(
                "--target-offset {} plus --size {} is more than a target serves ({})",
                units::format_size(offset),
                units::format_size(local_size),
                units::format_size(MAX_BYTES)
            ))
        })?;
        if offset > 0 {
            // This host holds our buffer and the target's, which is `offset` larger.
            let both = local_size.saturating_add(target_size);
            limits::fits_in_memory("--size", both, 1).map_err(|_| {
                Failure::Usage(format!(
                    "--size {} on both sides plus --target-offset {} needs {}, more than this \
                     host's memory",
                    units::format_size(local_size),
                    units::format_size(offset),
                    units::format_size(both)
                ))
            })?;
        }
        Some(LocalTarget::start(
            config_path,
            target_size,
            args.tent_stats,
        )?)
    } else {
        None
    };
    let target_name = match (&local_target, &args.target) {
        (Some(t), _) => t.name.clone(),
        (None, Some(t)) => t.clone(),
        (None, None) => return Err(Failure::Usage("--target or --local is required".into())),
    };
    let listen = if args.local || reached_over_loopback(&target_name) {
        // Nothing beyond this host needs to reach us: listening everywhere would offer this
        // run's memory to the network (and warn so on every run).
        "127.0.0.1:0"
    } else {
        "0.0.0.0:0"
    };
    let engine = Engine::new(config, listen)?;
    let metrics = crate::target::serve_metrics(&engine, args.metrics.as_deref())?;
    let seg = engine.open_segment(&target_name)?;
    let descriptor = engine.segment_descriptor(seg)?;
    let largest = descriptor.buffers.iter().map(|b| b.len).max().unwrap_or(0);
    if largest > 0 && offset >= largest {
        return Err(Failure::Usage(format!(
            "--target-offset {} is past the end of what segment {target_name} serves (its \
             largest buffer is {})",
            units::format_size(offset),
            units::format_size(largest)
        )));
    }
    // What the run can take from its offset to the end of the largest buffer.
    let room = largest.saturating_sub(offset);
    let from_offset = if offset > 0 {
        format!(" from --target-offset {}", units::format_size(offset))
    } else {
        String::new()
    };
    let size = match args.size {
        Some(size) if size > room => {
            return Err(Failure::Usage(format!(
                "--size {} is larger than what segment {target_name} serves{from_offset} (its \
                 largest buffer is {}); give --size {} or less, or leave it out",
                units::format_size(size),
                units::format_size(largest),
                units::format_size(room)
            )))
        }
        Some(size) => size,
        None if largest == 0 => {
            return Err(Failure::Runtime(anyhow!(
                "segment {target_name} serves no buffer"
            )))
        }
        None => {
            // A target started with a smaller --size is still worth benchmarking against: take
            // what it offers rather than fail on the 1 GiB default.
            let size = room.min(DEFAULT_SIZE);
            if !args.local {
                eprintln!(
                    "bench: using --size {} ({})",
                    units::format_size(size),
                    if size < room {
                        format!(
                            "the target serves {}{from_offset}; capped at {}",
                            units::format_size(room),
                            units::format_size(DEFAULT_SIZE)
                        )
                    } else if offset > 0 {
                        format!("the rest of the target's largest buffer{from_offset}")
                    } else {
                        "the target's largest buffer".to_owned()
                    }
                );
            }
            check_memory(size, false)?;
            size
        }
    };
    let submitters = plan_regions(size, &classes, args.batch_size, threads)?;
    let remote = descriptor
        .buffers
        .iter()
        .find(|b| b.len >= offset + size)
        .ok_or_else(|| {
            anyhow!(
                "segment {target_name} has no buffer of at least {} bytes",
                offset + size
            )
        })?;
    let len = usize::try_from(size).map_err(|_| Failure::Usage("--size too large".into()))?;
    let local = engine.allocate(len, Location::Any)?;
    let op = match args.op {
        Op::Read => Opcode::Read,
        Op::Write => Opcode::Write,
    };
    let plan = Arc::new(Plan {
        op,
        seed: fresh_seed(),
        local_base: local.addr(),
        remote_base: remote.addr + offset,
        seg,
        transport: args.transport,
        submitters,
        scatter: args.scatter,
    });
    // Writing every local byte also faults its pages in before the clock starts.
    // SAFETY: nothing is in flight yet.
    pattern::fill(unsafe { local.as_mut_slice() }, 0, plan.seed);
    if args.verify && op == Opcode::Read {
        // A verified read needs known bytes on the target, and a long-lived target holds
        // whatever the previous bench wrote there (or its own fill, if none did). So the bytes
        // are made known first: every region this run will read is written with the run's
        // fresh pattern, and the local buffer is then refilled with a different one, so a read
        // that delivered nothing, or stale bytes, cannot pass. This costs one write of the
        // regions before the timed run, which the report's rail figures leave out (its slices
        // do count in the priority queue figures). (The other
        // way, one pattern for both sides as a function of the target offset, would let a
        // lost write pass a verified write, since the target would already hold its bytes.)
        // Benches verifying against the same target at the same time would overwrite each
        // other's patterns unless each has its own --target-offset. With --total only what
        // the budget reaches is written: on slow rails the whole region could take longer
        // than the run.
        for sub in &plan.submitters {
            transfer(
                &engine,
                &plan,
                Opcode::Write,
                plan.local_base + sub.base,
                sub.base,
                reachable(sub, args.total),
            )
            .context("verify: writing the reference pattern to the target before reading")?;
        }
        // SAFETY: the seeding batches completed; nothing is in flight on `local`.
        pattern::fill(unsafe { local.as_mut_slice() }, 0, !plan.seed);
    }
    // Rail counters before the timed run, so the report shows only what the run moved.
    let before = engine.traffic_stats();

    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        bytes: AtomicU64::new(0),
        budget: AtomicU64::new(args.total.unwrap_or(u64::MAX)),
        finished: AtomicUsize::new(0),
    });
    let progress = crate::timed_progress(args.json, args.duration);
    let start = Instant::now();
    let main_thread = thread::current();
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (engine, plan, shared) = (engine.clone(), plan.clone(), shared.clone());
            let main_thread = main_thread.clone();
            thread::spawn(move || {
                let result = worker(&engine, &plan, i, &shared);
                // A run ended by --total (or a failure) is reported at once, not at the tick.
                shared.finished.fetch_add(1, Ordering::Release);
                main_thread.unpark();
                result
            })
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
    // What each rail has carried so far: an interval's figure is the whole and each rail's.
    let rail_bytes = |e: &Engine| {
        e.traffic_stats()
            .rails
            .iter()
            .map(|r| r.bytes)
            .collect::<Vec<u64>>()
    };
    let mut timeline = Vec::new();
    let (mut mark, mut mark_bytes) = (start, rail_bytes(&engine));
    // A line that could not be printed ends the run, after the threads have stopped.
    let mut printed = Ok(());
    while printed.is_ok()
        && start.elapsed() < deadline
        && shared.finished.load(Ordering::Acquire) < handles.len()
    {
        thread::park_timeout(tick);
        if let Some(interval) = args.interval {
            if mark.elapsed() >= interval {
                let (now, bytes) = (Instant::now(), rail_bytes(&engine));
                let secs = now.duration_since(mark).as_secs_f64();
                let per_rail: Vec<f64> = bytes
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| {
                        b.saturating_sub(mark_bytes.get(i).copied().unwrap_or(0)) as f64
                            / secs
                            / 1e9
                    })
                    .collect();
                let gbps = per_rail.iter().sum::<f64>();
                let t = now.duration_since(start).as_secs_f64();
                let point =
                    serde_json::json!({"t": t, "gb_per_s": gbps, "rails_gb_per_s": per_rail});
                if args.json {
                    // Live, one JSON object per line, for scripts that act during the run.
                    eprintln!("{point}");
                }
                timeline.push(point);
                if !args.json {
                    printed = progress.suspend(|| {
                        outln!("t={t:7.2}s {:8.3} GB/s {:9.1} Mbit/s", gbps, gbps * 8000.0)
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
    // Timed to the last batch's completion, not to the tick that saw the threads done: a run
    // ended by --total would otherwise count up to a tick (100 ms) of nothing.
    let secs = results
        .iter()
        .map(|r| r.ended)
        .max()
        .map_or_else(|| start.elapsed(), |ended| ended.duration_since(start))
        .as_secs_f64();
    progress.finish_and_clear();
    printed?;
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
    let assumed: Vec<(String, f64)> = engine
        .rails()
        .into_iter()
        .map(|r| (r.name, r.bandwidth_gbps))
        .collect();
    let rails = run_rails(&before.rails, &traffic.rails, &assumed);
    let mut tent_text = args
        .tent_stats
        .then(|| tent_report(&engine.traffic_stats_report(), &assumed, &traffic.rails));
    let verified = if args.verify {
        Some(verify(&engine, &plan, &local, &results)?)
    } else {
        None
    };
    // What the local target served (this engine served nothing): its report as it stopped.
    // Over shm the target's CPU sees no request, so its counts stay 0 there.
    // (The target is taken only when its report is wanted: taken and dropped, it would stop.)
    if let Some(text) = tent_text.as_mut() {
        if let Some(target) = local_target.take() {
            // Our connections go first, so the target's stop is not taken for a failing rail.
            engine.shutdown();
            match target.stop_and_read() {
                Some(served) if !served.trim().is_empty() => {
                    text.push_str("=== Target ===\n");
                    text.push_str(&served);
                }
                _ => text.push_str("=== Target ===\n(the local target printed no served report)\n"),
            }
        }
    }
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
        "size": size,
        "block_size": args.block_size,
        "batch_size": args.batch_size,
        "scatter": args.scatter,
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
            "ewma_gbps": r.ewma_gbps, "assumed_gbps": assumed_for(&assumed, &r.name),
            "inflight_bytes": r.inflight_bytes, "window_bytes": r.window_bytes,
            "priority_bytes": {"high": r.priority_bytes[0], "medium": r.priority_bytes[1], "low": r.priority_bytes[2]},
        })).collect::<Vec<_>>(),
        "verified_bytes": verified,
        "timeline": timeline,
        "classes": class_reports,
        "qos": traffic.qos,
        "rdma": engine.rdma_stats(),
    });
    if args.json {
        outln!("{report}")?;
        if let Some(text) = tent_text {
            // stdout holds exactly one JSON object for scripts.
            eprint!("{text}");
        }
    } else {
        print_human(&report, &rails)?;
        if let Some(text) = tent_text {
            crate::out::print(format_args!("{text}"))?;
        }
    }
    drop(metrics);
    // Threads of ours may hold the engine past this drop: shut it down first, so a local
    // target stopping after it closes no connection still in use (which would be reported as a
    // failing rail).
    engine.shutdown();
    drop(engine);
    drop(local_target);
    Ok(())
}

/// Whether segment `name` is `host:port` with an IPv4 loopback host (a published name that is not
/// an address is not).
fn reached_over_loopback(name: &str) -> bool {
    multirail::metadata::resolve(name).is_ok_and(|a| a.is_ipv4() && a.ip().is_loopback())
}

/// A rail's EWMA bandwidth if it is a measurement: the scheduler starts every rail's EWMA at the
/// speed it assumes for it (`assumed_gbps`, e.g. 400 Gbps for a NIC that reports none) and only
/// completed slices move it away (learning from several samples with min/max clamps never lands
/// back on exactly the start). An EWMA still at its start has no samples behind it and is not
/// shown.
fn measured_ewma(ewma_gbps: Option<f64>, assumed_gbps: Option<f64>) -> Option<f64> {
    match (ewma_gbps, assumed_gbps) {
        (Some(g), Some(a)) if (g - a).abs() <= a.abs() * 1e-9 => None,
        (g, _) => g,
    }
}

/// The speed the scheduler assumes for rail `name`, from `assumed` (rail name, Gbps).
fn assumed_for(assumed: &[(String, f64)], name: &str) -> Option<f64> {
    assumed.iter().find(|(n, _)| n == name).map(|&(_, g)| g)
}

/// The rails as the timed run used them: the counters minus what they held before it (a
/// verified read seeds the target first), and an EWMA bandwidth only where it is a measurement
/// (see [`measured_ewma`]). `assumed` holds the scheduler's rails: name and assumed speed.
fn run_rails(
    before: &[RailTraffic],
    after: &[RailTraffic],
    assumed: &[(String, f64)],
) -> Vec<RailTraffic> {
    after
        .iter()
        .map(|a| {
            let b = before.iter().find(|b| b.name == a.name);
            let minus = |now: u64, f: fn(&RailTraffic) -> u64| now.saturating_sub(b.map_or(0, f));
            RailTraffic {
                bytes: minus(a.bytes, |r| r.bytes),
                slices: minus(a.slices, |r| r.slices),
                errors: minus(a.errors, |r| r.errors),
                priority_bytes: std::array::from_fn(|p| {
                    a.priority_bytes[p].saturating_sub(b.map_or(0, |r| r.priority_bytes[p]))
                }),
                ewma_gbps: measured_ewma(a.ewma_gbps, assumed_for(assumed, &a.name)),
                ..a.clone()
            }
        })
        .collect()
}

/// The engine's TENT-format report with the EWMA bandwidth of every rail that has no samples
/// (see [`measured_ewma`]) replaced by `- (no samples)`. `assumed` lists the engine's rails in
/// report order (`Dev N` is `assumed[N]`) with their assumed speeds; `rails` are the engine's
/// traffic figures, which carry each scheduler rail's EWMA under its name.
fn tent_report(text: &str, assumed: &[(String, f64)], rails: &[RailTraffic]) -> String {
    let sampled = |dev: usize| {
        assumed.get(dev).is_some_and(|(name, speed)| {
            let ewma = rails
                .iter()
                .find(|r| &r.name == name)
                .and_then(|r| r.ewma_gbps);
            measured_ewma(ewma, Some(*speed)).is_some()
        })
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let dev = line
            .strip_prefix("Dev ")
            .and_then(|rest| rest.split_once(':'))
            .and_then(|(n, _)| n.parse::<usize>().ok());
        let field = line.find("EWMA BW=").and_then(|at| {
            line[at..]
                .find(" Gbps")
                .map(|end| (at, at + end + " Gbps".len()))
        });
        match (dev, field) {
            (Some(dev), Some((at, end))) if !sampled(dev) => {
                out.push_str(&line[..at]);
                out.push_str("EWMA BW=- (no samples)");
                out.push_str(&line[end..]);
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn print_human(report: &serde_json::Value, rails: &[RailTraffic]) -> Result<(), Failure> {
    use comfy_table::{presets::UTF8_FULL, Table};
    let mut t = Table::new();
    t.load_preset(UTF8_FULL);
    t.set_header(vec![
        "op",
        "transport",
        "size",
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
        units::format_size(report["size"].as_u64().unwrap_or(0)),
        units::format_size(report["block_size"].as_u64().unwrap_or(0)),
        report["batch_size"].to_string(),
        report["threads"].to_string(),
        format!("{:.3}", report["gb_per_s"].as_f64().unwrap_or(0.0)),
        format!("{:.0}", report["requests_per_s"].as_f64().unwrap_or(0.0)),
        report["batch_latency_us"]["p50"].to_string(),
        report["batch_latency_us"]["p99"].to_string(),
    ]);
    outln!("{t}")?;
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
        "EWMA Gbps",
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
            // `-`: no estimate (shm, a routed path's interface) or one no sample has moved
            // from the assumed speed yet (see `measured_ewma`).
            rail.ewma_gbps
                .map_or_else(|| "-".to_owned(), |g| format!("{g:.2}")),
            rail.window_bytes.to_string(),
        ]);
    }
    outln!("{r}")?;
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
        outln!("{c}")?;
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
    outln!("{q}")?;
    outln!("promotions: {}", report["qos"]["promotions"])?;
    if let Some(v) = report["verified_bytes"].as_u64() {
        outln!("verified: {v} bytes match")?;
    }
    Ok(())
}

/// Said after a verify mismatch: against a long-lived target, the commonest cause is another
/// client moving the same range of its buffer at the same time.
const SHARED_RANGE_HINT: &str = " (if another client moved the same range of the target's \
     buffer during this run, its bytes are what this run found: give each bench a range of \
     its own with --target-offset and --size)";

/// Checks the bytes that landed, against the run's pattern (`plan.seed`): after reads, the
/// local regions hold what seeding put on the target; after writes, reading the target's
/// regions back gives what the initiator wrote. Both sides use the same offsets within their
/// buffers, so one offset names the pattern byte on either side.
fn verify(
    engine: &Engine,
    plan: &Plan,
    local: &Buffer,
    results: &[ThreadResult],
) -> Result<u64, Failure> {
    let mut checked = 0u64;
    let longest = results.iter().map(|r| r.touched).max().unwrap_or(0);
    // One scratch buffer of at most PIECE bytes, reused for every read-back.
    let scratch = match plan.op {
        Opcode::Write if longest > 0 => {
            Some(engine.allocate(PIECE.min(longest) as usize, Location::Any)?)
        }
        _ => None,
    };
    for (sub, r) in plan.submitters.iter().zip(results) {
        let start = sub.base;
        let len = r.touched;
        match (&scratch, plan.op) {
            (_, Opcode::Read) => {
                // SAFETY: every batch completed; nothing is in flight on the local buffer.
                let bytes = unsafe { &local.as_slice()[start as usize..(start + len) as usize] };
                if let Some(at) = pattern::first_mismatch(bytes, start, plan.seed) {
                    return Err(Failure::Runtime(anyhow!(
                        "verify: byte {} read from the target is wrong{}",
                        start + at as u64,
                        SHARED_RANGE_HINT
                    )));
                }
            }
            (Some(scratch), Opcode::Write) => {
                let mut done = 0;
                while done < len {
                    let n = PIECE.min(len - done);
                    let off = start + done;
                    transfer(engine, plan, Opcode::Read, scratch.addr(), off, n)
                        .context("verify: reading the target back")?;
                    // SAFETY: the read completed; nothing else touches `scratch`.
                    let bytes = unsafe { &scratch.as_slice()[..n as usize] };
                    if let Some(at) = pattern::first_mismatch(bytes, off, plan.seed) {
                        return Err(Failure::Runtime(anyhow!(
                            "verify: byte {} written to the target is wrong{}",
                            off + at as u64,
                            SHARED_RANGE_HINT
                        )));
                    }
                    done += n;
                }
            }
            (None, _) => {}
        }
        checked += len;
    }
    if let Some(scratch) = scratch {
        engine.free(&scratch)?;
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_ipv4_loopback_target_keeps_the_client_on_loopback() {
        assert!(reached_over_loopback("127.0.0.1:4000"));
        assert!(reached_over_loopback("127.0.0.5:4000"));
        assert!(!reached_over_loopback("10.1.2.3:4000"));
        assert!(!reached_over_loopback("[::1]:4000"));
        assert!(!reached_over_loopback("prefill-0"));
        assert!(!reached_over_loopback(""));
    }

    #[test]
    fn a_scattered_batch_covers_every_block_once_and_none_follows_its_neighbour() {
        for batch in [1u64, 2, 3, 7, 1000] {
            let order: Vec<u64> = (0..batch).map(|k| block_order(k, batch, true)).collect();
            let mut seen = order.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..batch).collect::<Vec<_>>(), "batch {batch}");
            assert!(
                order.windows(2).all(|w| w[1] != w[0] + 1),
                "batch {batch}: {order:?}"
            );
            let plain: Vec<u64> = (0..batch).map(|k| block_order(k, batch, false)).collect();
            assert_eq!(plain, (0..batch).collect::<Vec<_>>());
        }
    }

    fn rail(name: &str, slices: u64, ewma: Option<f64>) -> RailTraffic {
        RailTraffic {
            name: name.into(),
            bytes: slices * 100,
            slices,
            errors: 0,
            priority_bytes: [slices * 100, 0, 0],
            ewma_gbps: ewma,
            inflight_bytes: 0,
            window_bytes: 0,
        }
    }

    #[test]
    fn a_rail_without_samples_shows_no_ewma() {
        let text = "=== Device Traffic Statistics ===\n\
                    Dev 0: Total=0.0 GB, EWMA BW=400.00 Gbps, Inflight=0 bytes\n\
                    Dev 1: Total=1.5 GB, EWMA BW=38.20 Gbps, Inflight=0 bytes\n\
                    === Priority Queue Statistics ===\n";
        let assumed = [("eth0".to_owned(), 400.0), ("eth1".to_owned(), 400.0)];
        let rails = [rail("eth0", 0, Some(400.0)), rail("eth1", 9, Some(38.2))];
        let out = tent_report(text, &assumed, &rails);
        assert!(out.contains("Dev 0: Total=0.0 GB, EWMA BW=- (no samples), Inflight=0 bytes\n"));
        assert!(out.contains("Dev 1: Total=1.5 GB, EWMA BW=38.20 Gbps, Inflight=0 bytes\n"));
        assert!(out.ends_with("=== Priority Queue Statistics ===\n"));
        let run = run_rails(&[rail("eth1", 4, Some(30.0))], &rails, &assumed);
        assert_eq!(run[0].ewma_gbps, None);
        assert_eq!((run[1].slices, run[1].bytes), (5, 500));
        assert_eq!(run[1].ewma_gbps, Some(38.2));
        // Clamped to the floor (a tenth of the assumed speed) is a measurement; without an
        // estimate there is nothing to show, and a rail the scheduler does not know keeps its.
        assert_eq!(measured_ewma(Some(40.0), Some(400.0)), Some(40.0));
        assert_eq!(measured_ewma(None, Some(400.0)), None);
        assert_eq!(measured_ewma(Some(7.5), None), Some(7.5));
    }

    #[test]
    fn a_byte_budget_reaches_only_the_batches_it_pays_for() {
        let sub = Submitter {
            class: 0,
            priority: multirail::PRIO_HIGH,
            block: 4096,
            batch: 16,
            base: 0,
            region: 1 << 20,
        };
        // 64 KiB per batch, 16 batches before the walk wraps.
        assert_eq!(reachable(&sub, None), 1 << 20);
        assert_eq!(reachable(&sub, Some(200 << 10)), 192 << 10);
        assert_eq!(reachable(&sub, Some(64 << 20)), 1 << 20);
        // A region that is not a whole number of batches: the walk stops before its end.
        let odd = Submitter {
            region: (1 << 20) + 4096,
            ..sub
        };
        assert_eq!(reachable(&odd, None), 1 << 20);
    }

    #[test]
    fn regions_are_never_empty() {
        let one = |block, submitters| {
            vec![Class {
                priority: Priority::High,
                block,
                submitters,
            }]
        };
        // 3 threads over 40 MiB: shares start on cache lines and hold whole batches.
        let subs = plan_regions(40 << 20, &one(256 << 10, 3), 4, 3).unwrap_or_else(|_| panic!());
        assert_eq!(subs.len(), 3);
        for s in &subs {
            assert_eq!(s.base % 64, 0);
            assert!(s.region >= 1 << 20 && s.region % (1 << 20) == 0);
            assert!(s.base + s.region <= 40 << 20);
        }
        // More threads than blocks, or than batches: a usage error, not an empty region.
        assert!(plan_regions(4 << 20, &one(1 << 20, 8), 1, 8).is_err());
        assert!(plan_regions(8 << 20, &one(1 << 20, 2), 16, 2).is_err());
        assert!(plan_regions(3, &one(1, 8), 1, 8).is_err());
    }
}
