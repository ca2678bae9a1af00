//! `multirail mcast-bench`: group multicast (Derecho's SMC with Nagle-like batching)
//! between members in separate processes on this host.
//!
//! With `--local` this process is member 0 and starts members 1.. as child processes of this
//! binary (`--serve-member`, hidden), one engine each. The first `--senders` members send;
//! every member receives everything (a sender its own messages too) and checks each message
//! (`payload`: the right length and bytes for the next message of its sender, so loss,
//! duplication and reordering are caught), measures send-to-delivery latency from the stamp
//! every message carries, and counts. Each reports its group counters, from which the parent
//! derives one-sided writes per multicast (data, committed counts, acknowledgements).
//!
//! Parent and child talk over the child's stdin and stdout, one line each way at a time:
//! the child prints its segment name; the parent sends `join NAME,NAME,...` (every member, in
//! member order); the child joins and prints `joined` (or `error TEXT`); the parent sends
//! `start T_START T_WARM T_END` (monotonic ns; `T_END` 0 when `--messages` bounds the run);
//! the child runs and prints its report as one JSON line, then exits. Nothing else goes to a
//! child's stdout. End of stdin before `start` makes a child exit.
//!
//! `--kill-member I --kill-after T` kills member I (a child) with SIGKILL (or freezes it with
//! SIGSTOP, `--kill-signal stop`) T into the run: the report then says when each other member
//! saw the failure and what it named.

mod local;
mod member;
mod payload;
mod report;
mod serve;

use std::path::Path;
use std::time::Duration;

use clap::{Args, ValueEnum};
use multirail::{Config, Delivery, GroupConfig, TransportChoice};

use crate::clock::{mono_ns, sleep_until_ns};
use crate::limits::{self, MAX_DURATION, MIN_DURATION};
use crate::Failure;
use payload::Sizes;

/// Most members on one host: each is a process with an engine and a connection to every
/// other member.
const MAX_MEMBERS: u64 = 64;
/// Most messages of a `--messages` run: a billion take a quarter of an hour at a million a
/// second.
const MAX_MESSAGES: u64 = 1_000_000_000;
/// Longest `--flush-us`, µs (a second; a push held back longer defeats small messages).
const MAX_FLUSH_US: u64 = 1_000_000;

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Transport {
    Shm,
    Tcp,
    /// RDMA WRITEs (needs RDMA ports: soft-RoCE in scripts/test-rdma's VM).
    Rdma,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum DeliveryArg {
    /// Each sender's messages in order, no order across senders.
    Unordered,
    /// One total order at every member (round robin with null messages, delivered when
    /// stable).
    Ordered,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum KillSignal {
    /// SIGKILL.
    Kill,
    /// SIGSTOP.
    Stop,
}

/// Flags of `multirail mcast-bench`.
#[derive(Args, Clone, Debug)]
pub struct McastBenchArgs {
    /// Run every member on this host: this process is member 0, the others child processes.
    /// The only mode so far, so required.
    #[arg(long, required_unless_present = "serve_member")]
    local: bool,
    /// Members of the group, 2 to 64 (processes on this host). Default: 3.
    #[arg(long, default_value_t = 3, value_parser = limits::count::<usize>(2, MAX_MEMBERS))]
    members: usize,
    /// Members that send (the first S), 1 to --members. Default: 1.
    #[arg(long, default_value_t = 1, value_parser = limits::count::<usize>(1, MAX_MEMBERS))]
    senders: usize,
    /// Of the senders, how many (the last ones) send nothing but their end marker at the end
    /// of the run, 0 to --senders - 1: with --delivery ordered, the others' messages must
    /// still be delivered while they idle (null messages). Default: 0.
    #[arg(long, default_value_t = 0, value_parser = limits::count::<usize>(0, MAX_MEMBERS - 1))]
    idle_senders: usize,
    /// Message size in bytes (e.g. 64, 4KiB), or a range MIN-MAX whose sizes are drawn
    /// log-uniformly; 8 B (the send stamp) to 16 MiB (the largest multicast payload).
    /// Default: 64.
    #[arg(long, default_value = "64", value_parser = Sizes::parse)]
    size: Sizes,
    /// Batching: off (a push and acknowledgements per message), opportunistic (everything
    /// committed since the last push in one) or k:N (push at N pending or after --flush-us).
    /// Default: the configuration's transports.<t>.multicast.batching (opportunistic).
    #[arg(long)]
    batching: Option<String>,
    /// Longest a held-back push or acknowledgement waits under k:N, microseconds, 1 to
    /// 1000000. Default: the configuration's transports.<t>.multicast.flush_us (150).
    #[arg(long, value_parser = limits::count_setting::<u64>(
        1, MAX_FLUSH_US, "transports.<t>.multicast.flush_us"))]
    flush_us: Option<u64>,
    /// Messages a sender may have unacknowledged, 1 to 65536. Default: the configuration's
    /// transports.<t>.multicast.window_size (16).
    #[arg(long, value_parser = limits::count_setting::<u64>(
        1, multirail::config::MAX_MULTICAST_WINDOW, "transports.<t>.multicast.window_size"))]
    window: Option<u64>,
    /// unordered (per-sender FIFO) or ordered (one total order). Default: unordered.
    #[arg(long, value_enum, default_value_t = DeliveryArg::Unordered)]
    delivery: DeliveryArg,
    /// Transport of every engine: shm, tcp or rdma. Default: shm.
    #[arg(long, value_enum, default_value_t = Transport::Shm)]
    transport: Transport,
    /// Messages per second each sender sends, above 0 (with --messages, slow enough to send
    /// them within 24h). Default: as fast as its window allows.
    #[arg(long)]
    rate: Option<f64>,
    /// How long the senders send (seconds, or e.g. 500ms, 2h), 1ms to 24h. Default: 5.
    #[arg(long, default_value = "5", value_parser = limits::duration(MIN_DURATION, MAX_DURATION))]
    duration: Duration,
    /// The first part of --duration not measured (rates and latency count after it; 0 for
    /// none), 0 to 24h. Default: 0.5.
    #[arg(long, default_value = "0.5", value_parser = limits::duration(Duration::ZERO, MAX_DURATION))]
    warmup: Duration,
    /// Send this many messages in all (spread over the senders), 1 to 1000000000, instead of
    /// sending for --duration; everything is measured. Default: off.
    #[arg(long, conflicts_with = "duration", value_parser = limits::count::<u64>(1, MAX_MESSAGES))]
    messages: Option<u64>,
    /// Kill member I (1 to --members - 1: a child) with SIGKILL --kill-after into the run, to
    /// see the others fail with an error naming it. Default: off.
    #[arg(long, requires = "kill_after",
          value_parser = limits::count::<usize>(1, MAX_MEMBERS - 1))]
    kill_member: Option<usize>,
    /// When to kill --kill-member, after the start (seconds, or e.g. 500ms), 1ms to 24h.
    #[arg(long, requires = "kill_member",
          value_parser = limits::duration(MIN_DURATION, MAX_DURATION))]
    kill_after: Option<Duration>,
    /// How --kill-member is killed: kill (SIGKILL: its connections close at once) or stop
    /// (SIGSTOP: it hangs with its connections open, so only the timeout finds it; killed at
    /// the end). Default: kill.
    #[arg(long, value_enum, default_value_t = KillSignal::Kill)]
    kill_signal: KillSignal,
    /// Print one JSON object instead of tables. Default: off.
    #[arg(long)]
    json: bool,
    /// Run as a member of a --local run (commands on stdin, report on stdout).
    #[arg(long, hide = true, conflicts_with = "local")]
    serve_member: bool,
}

impl McastBenchArgs {
    fn validate(&self) -> Result<(), Failure> {
        let usage = |m: String| Err(Failure::Usage(m));
        if self.senders > self.members {
            return usage(format!(
                "--senders must be within [1, --members ({})], got {}",
                self.members, self.senders
            ));
        }
        if self.idle_senders >= self.senders {
            return usage(format!(
                "--idle-senders ({}) must leave at least one of the {} senders sending",
                self.idle_senders, self.senders
            ));
        }
        if let Some(r) = self.rate {
            if !(r.is_finite() && r > 0.0) {
                return usage(format!("--rate must be a positive number, got {r}"));
            }
            // Paced, a --messages run lasts as long as its busiest sender's share takes.
            if let Some(n) = self.messages {
                let secs = n.div_ceil(self.active_senders() as u64) as f64 / r;
                if secs > MAX_DURATION.as_secs_f64() {
                    return usage(format!(
                        "--messages {n} at --rate {r} a sender would take {secs:.0} s, more \
                         than {}",
                        limits::format_duration(MAX_DURATION)
                    ));
                }
            }
        }
        if self.messages.is_none() && self.duration <= self.warmup {
            return usage(format!(
                "--duration ({} s) must exceed --warmup ({} s)",
                self.duration.as_secs_f64(),
                self.warmup.as_secs_f64()
            ));
        }
        if let Some(k) = self.kill_member {
            if k >= self.members {
                return usage(format!(
                    "--kill-member must name a child member, 1 to {}, got {k}",
                    self.members - 1
                ));
            }
        }
        Ok(())
    }

    fn apply(&self, config: &mut Config) {
        config.transport = match self.transport {
            Transport::Shm => TransportChoice::Shm,
            Transport::Tcp => TransportChoice::Tcp,
            Transport::Rdma => TransportChoice::Rdma,
        };
    }

    /// The group every member joins.
    fn group_config(&self, names: &[String]) -> GroupConfig {
        let mut g = GroupConfig::new("mcast-bench", names.to_vec());
        g.senders = names[..self.senders].to_vec();
        g.window_size = self.window;
        // The default 10240 unless the messages (or the 16-byte end marker) need more.
        let need = self.size.max.max(payload::MARKER_BYTES) as u64;
        g.max_payload = (need > 10240).then_some(need);
        g.delivery = match self.delivery {
            DeliveryArg::Unordered => Delivery::Unordered,
            DeliveryArg::Ordered => Delivery::Ordered,
        };
        g.batching = self.batching.clone();
        g.flush_us = self.flush_us;
        g
    }

    /// Senders that send data.
    fn active_senders(&self) -> usize {
        self.senders - self.idle_senders
    }

    /// True when sender `rank` sends nothing but its end marker.
    fn is_idle(&self, rank: usize) -> bool {
        (self.active_senders()..self.senders).contains(&rank)
    }

    /// Messages sender `rank` sends when `--messages` bounds the run (idle senders: 0).
    fn quota(&self, rank: usize) -> Option<u64> {
        let total = self.messages?;
        let s = self.active_senders() as u64;
        Some(if rank < self.active_senders() {
            total / s + u64::from((rank as u64) < total % s)
        } else {
            0
        })
    }

    /// The flags a child member needs to match this run.
    fn member_flags(&self) -> Vec<String> {
        let mut f = vec![
            "--members".into(),
            self.members.to_string(),
            "--senders".into(),
            self.senders.to_string(),
            "--idle-senders".into(),
            self.idle_senders.to_string(),
            "--size".into(),
            self.size.to_string(),
            "--delivery".into(),
            match self.delivery {
                DeliveryArg::Unordered => "unordered".into(),
                DeliveryArg::Ordered => "ordered".into(),
            },
            "--transport".into(),
            self.transport.name().into(),
        ];
        let mut opt = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                f.push(k.into());
                f.push(v);
            }
        };
        opt("--batching", self.batching.clone());
        opt("--flush-us", self.flush_us.map(|v| v.to_string()));
        opt("--window", self.window.map(|v| v.to_string()));
        opt("--rate", self.rate.map(|v| v.to_string()));
        opt("--messages", self.messages.map(|v| v.to_string()));
        f
    }
}

/// Runs `multirail mcast-bench`: a `--local` run from member 0, or one of its child members.
pub fn run(
    mut config: Config,
    config_path: Option<&Path>,
    args: McastBenchArgs,
) -> Result<(), Failure> {
    args.validate()?;
    args.apply(&mut config);
    config
        .validate()
        .map_err(|e| Failure::Usage(e.to_string()))?;
    if args.serve_member {
        return serve::serve(config, &args);
    }
    // Bad group settings are a usage error, found before any member starts.
    let placeholder: Vec<String> = (0..args.members).map(|i| format!("member-{i}")).collect();
    args.group_config(&placeholder)
        .check(&config)
        .map_err(|e| {
            Failure::Usage(format!(
                "{e} (from --batching, --flush-us, --window or --size)"
            ))
        })?;
    local::run(config, config_path, &args)
}

/// How long a member waits with nothing arriving before it gives up on the run: past the
/// group's own failure detection (`transports.tcp.timeout_ms`), so that answers first.
fn stall_limit(config: &Config) -> Duration {
    Duration::from_millis(config.transports.tcp.timeout_ms.saturating_mul(2))
        + Duration::from_secs(5)
}
