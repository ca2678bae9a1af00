//! `multirail target`: serve one patterned buffer until SIGINT or SIGTERM.

use std::io::Write;

use clap::Args;
use multirail::{Config, Engine, Location, MetricsServer};
use nix::sys::signal::{SigSet, Signal};

use crate::limits::{self, MAX_BYTES};
use crate::out::outln;
use crate::pattern;
use crate::units;
use crate::Failure;

/// Flags of `multirail target`.
#[derive(Args)]
pub struct TargetArgs {
    /// Size of the buffer to serve (e.g. 64MiB, 1GiB), 1 B to 1 TiB and within this host's
    /// memory. Default: 1GiB.
    #[arg(long, default_value = "1GiB", value_parser = limits::size(1, MAX_BYTES))]
    size: u64,
    /// Address and port to listen on. Default: every interface, a free port (0.0.0.0:0).
    #[arg(long, default_value = "0.0.0.0:0")]
    listen: String,
    /// NUMA placement of the buffer: `*` or `cpu:N`. Default: `*`.
    #[arg(long, default_value = "*")]
    location: String,
    /// Memory to serve: `allocated` (engine-owned shared mapping, which same-host peers map) or
    /// `registered` (ordinary heap memory registered with the engine, which same-host peers reach
    /// with process_vm_readv/writev). Default: allocated.
    #[arg(long, value_enum, default_value = "allocated")]
    memory: MemoryKind,
    /// Serve Prometheus metrics of this engine at http://ADDR:PORT/metrics (port 0 picks a free
    /// port); the URL is printed on stderr as `metrics: URL`. Default: off.
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// When stopped, print what this engine served to peers (bytes and requests per rail,
    /// operation, priority and peer, and the serving latency) to stdout before exiting.
    /// Default: off.
    #[arg(long)]
    served_report: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum MemoryKind {
    Allocated,
    Registered,
}

/// Starts `engine`'s metrics endpoint on `addr` (`--metrics`) and prints `metrics: URL` on
/// stderr; `None` without the flag. Fails as a usage error when `addr` is not an address, and
/// at run time when it cannot be bound (the message names the address).
pub(crate) fn serve_metrics(
    engine: &Engine,
    addr: Option<&str>,
) -> Result<Option<MetricsServer>, Failure> {
    let Some(addr) = addr else { return Ok(None) };
    let server = engine.serve_metrics(addr).map_err(|e| match e {
        multirail::Error::InvalidArgument { reason, .. } => {
            Failure::Usage(format!("--metrics: {reason}"))
        }
        e => Failure::Runtime(anyhow::anyhow!("--metrics: {e}")),
    })?;
    eprintln!("metrics: {}", server.url());
    Ok(Some(server))
}

/// Runs `multirail target`: serves until SIGINT or SIGTERM.
pub fn run(config: Config, args: TargetArgs) -> Result<(), Failure> {
    // Both sides of a transfer write every byte of their buffers: past the host's memory the
    // fill below would meet the OOM killer.
    limits::fits_in_memory("--size", args.size, 1).map_err(Failure::Usage)?;
    // Block the stop signals before any engine thread starts so they reach only sigwait below.
    let mut stop = SigSet::empty();
    stop.add(Signal::SIGINT);
    stop.add(Signal::SIGTERM);
    stop.thread_block()
        .map_err(|e| Failure::Runtime(e.into()))?;

    let location: Location = args.location.parse()?;
    let len = usize::try_from(args.size).map_err(|_| Failure::Usage("--size too large".into()))?;
    let engine = Engine::new(config, &args.listen)?;
    let metrics = serve_metrics(&engine, args.metrics.as_deref())?;
    // Registered memory must outlive its registration: `heap` lives until this function returns,
    // after the engine has stopped serving.
    let mut heap: Vec<u8> = Vec::new();
    let buffer = match args.memory {
        MemoryKind::Allocated => engine.allocate(len, location)?,
        MemoryKind::Registered => {
            heap.resize(len, 0);
            engine.register(heap.as_mut_ptr(), len, location)?
        }
    };
    // SAFETY: the buffer is not published to anyone until `name()` is printed below.
    pattern::fill(unsafe { buffer.as_mut_slice() }, 0, pattern::TARGET_SEED);
    // The segment name is what a reader of stdout is after: without one, stop as any command
    // whose stdout went away. Readers commonly take that line and close the pipe, so the
    // banner after it may find no reader, and the target goes on serving.
    outln!("{}", engine.name())?;
    let banner = format!(
        "serving buffer addr={:#x} len={} ({}) location={}; Ctrl-C to stop\n",
        buffer.addr(),
        buffer.len(),
        units::format_size(buffer.len() as u64),
        buffer.location()
    );
    // One write of whole lines: one that fails leaves nothing behind in stdout's buffer for
    // the flush at exit to fail on.
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(banner.as_bytes()).and_then(|()| out.flush());
    drop(out);
    let sig = stop.wait().map_err(|e| Failure::Runtime(e.into()))?;
    tracing::info!(signal = ?sig, "stopping");
    if args.served_report {
        // Whoever reads it may have gone; stopping matters more than the report.
        let _ = crate::out::print(format_args!("{}", engine.traffic_stats().served.report()));
        let _ = crate::out::flush();
    }
    drop(metrics);
    engine.shutdown();
    drop(engine);
    drop(heap);
    Ok(())
}
