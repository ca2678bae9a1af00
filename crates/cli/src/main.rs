//! `multirail`: serve a segment, benchmark transfers against one, show the configuration.

mod bench;
mod lanes_bench;
mod mcast_bench;
mod membench;
mod metadata_server;
mod out;
mod pingpong;
mod sim;
mod target;
mod ticks;
mod topo;

use multirail_cli::{child, clock, limits, pattern, units};

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use multirail::Config;

/// Exit code for a usage or configuration error.
const EXIT_USAGE: u8 = 2;
/// Exit code for a failure at run time.
const EXIT_RUNTIME: u8 = 1;

#[derive(Parser)]
#[command(name = "multirail", version, about = "multirail transfer engine")]
struct Cli {
    /// Configuration file (JSON). Default: $MULTIRAIL_CONF (a path or inline JSON), else built-in defaults.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Where engines look segments up: P2PHANDSHAKE (ask each segment itself, the default), an
    /// HTTP metadata server, http://HOST:PORT/metadata (Mooncake's protocol; see
    /// `multirail metadata-server`), or etcd, etcd://HOST:PORT[,HOST:PORT] (or a bare
    /// HOST:PORT). Overrides the configuration's metadata type and servers; engines started as
    /// child processes get it too.
    #[arg(long, global = true, env = "MULTIRAIL_METADATA")]
    metadata: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a segment with one buffer until interrupted; prints the segment name first.
    Target(target::TargetArgs),
    /// Run as initiator against a target and report throughput and latency.
    Bench(bench::BenchArgs),
    /// Show the rails, their speeds and NUMA nodes, and each rail's tier per memory location.
    Topo(topo::TopoArgs),
    /// Small-message round-trip latency (perftest's ping-pong), with periodic-pattern report.
    Pingpong(pingpong::PingpongArgs),
    /// Dynamic lanes under many peers and one receiver: hot peers' message rate and one-way
    /// latency, which peers end dedicated, receive memory and lane switches (--local: the
    /// receiver is a child process, the senders engines of this process).
    LanesBench(lanes_bench::LanesBenchArgs),
    /// Group multicast (Derecho's small-message multicast with batching off, opportunistic or
    /// k:N) between members in separate processes: multicasts per second at each member,
    /// one-sided writes per multicast, delivery latency, window stalls; every message checked
    /// (--local: the other members are child processes).
    McastBench(mcast_bench::McastBenchArgs),
    /// Measure single-thread memcpy bandwidth walking two buffers block by block.
    Membench(membench::MembenchArgs),
    /// Serve segment metadata over HTTP with Mooncake's protocol (GET/PUT/DELETE
    /// /metadata?key=K); prints its URL first and serves until interrupted.
    MetadataServer(metadata_server::MetadataServerArgs),
    /// Simulate a scenario (modelled NICs, links, workloads) with the engine's own policy in
    /// virtual time; prints the same figures as bench.
    Sim(sim::SimArgs),
    /// Configuration commands.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print the effective configuration as JSON.
    Show,
}

/// A failure with the exit code it deserves.
pub enum Failure {
    /// Bad flags or configuration: exit 2.
    Usage(String),
    /// Something went wrong while running: exit 1.
    Runtime(anyhow::Error),
    /// Stdout was closed under the command (`| head -1`): exit 141 without a word, as a
    /// process killed by SIGPIPE would (see [`out`]).
    StdoutClosed,
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Runtime(e)
    }
}

impl From<multirail::Error> for Failure {
    fn from(e: multirail::Error) -> Self {
        match e {
            multirail::Error::Config(_) | multirail::Error::InvalidArgument { .. } => {
                Failure::Usage(e.to_string())
            }
            e => Failure::Runtime(e.into()),
        }
    }
}

fn main() -> ExitCode {
    out::install_panic_hook();
    // Unwinding drops what the command holds (child processes, engines) before this
    // returns; a panic on a closed pipe (a `println!` outside `out`) then ends as a closed
    // stdout does, any other keeps its report and its exit status.
    match std::panic::catch_unwind(run) {
        Ok(code) => code,
        Err(_) if out::closed_pipe_panicked() => ExitCode::from(out::EXIT_BROKEN_PIPE),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn run() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let mut config = match Config::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if let Some(m) = &cli.metadata {
        if let Err(e) = config.use_metadata_server(m) {
            eprintln!("error: --metadata: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
        // Child engines (bench --local's target, lanes-bench's receiver, pingpong's peer)
        // read it back from the environment. Set before any thread starts.
        std::env::set_var("MULTIRAIL_METADATA", m);
    }
    let outcome = match cli.command {
        Command::Target(args) => target::run(config, args),
        Command::Bench(args) => bench::run(config, cli.config.as_deref(), args),
        Command::Membench(args) => membench::run(args),
        Command::MetadataServer(args) => metadata_server::run(args),
        Command::Sim(args) => sim::run(args),
        Command::Pingpong(args) => pingpong::run(config, cli.config.as_deref(), args),
        Command::LanesBench(args) => lanes_bench::run(config, cli.config.as_deref(), args),
        Command::McastBench(args) => mcast_bench::run(config, cli.config.as_deref(), args),
        Command::Topo(args) => topo::run(config, args),
        Command::Config {
            command: ConfigCommand::Show,
        } => out::outln!("{}", config.to_json_pretty()),
    };
    match outcome.and_then(|()| out::flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::StdoutClosed) => ExitCode::from(out::EXIT_BROKEN_PIPE),
        Err(Failure::Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(Failure::Runtime(e)) => {
            eprintln!("error: {}", chain_message(&e));
            ExitCode::from(EXIT_RUNTIME)
        }
    }
}

/// `e` and its causes, joined by ": ", each cause left out when the text before it already
/// ends with it: the engine's errors print their OS error themselves, and also give it as
/// their source ("Address already in use" once, not twice).
fn chain_message(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.is_empty() {
            text = part;
        } else if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
    }
    text
}

/// The progress bar of a run lasting `duration`: hidden under `--json` or when stderr is not
/// a terminal, so scripts and logs get no control characters.
fn timed_progress(json: bool, duration: std::time::Duration) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressStyle};
    if json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(duration.as_millis() as u64);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {msg}")
            .expect("valid template"),
    );
    pb
}
