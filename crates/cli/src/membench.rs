//! `multirail membench`: the memcpy baseline shared-memory transfers are held to.

use std::time::{Duration, Instant};

use clap::Args;

use crate::limits::{self, MAX_BYTES, MAX_DURATION, MIN_DURATION};
use crate::out::outln;
use crate::units;
use crate::Failure;

/// Flags of `multirail membench`.
#[derive(Args)]
pub struct MembenchArgs {
    /// Bytes per memcpy call, 1 B to --buffer-size. Default: 1MiB.
    #[arg(long, default_value = "1MiB", value_parser = limits::size(1, MAX_BYTES))]
    block_size: u64,
    /// Size of each of the two buffers walked, 1 B to 1 TiB and both within this host's
    /// memory. Default: 1GiB.
    #[arg(long, default_value = "1GiB", value_parser = limits::size(1, MAX_BYTES))]
    buffer_size: u64,
    /// How long to run (seconds, or e.g. 500ms, 2h), 1ms to 24h. Default: 3.
    #[arg(long, default_value = "3", value_parser = limits::duration(MIN_DURATION, MAX_DURATION))]
    duration: Duration,
    /// Copy with streaming (non-temporal) stores from 4 KiB up, as the shm transport does by
    /// default (`transports.shm.nontemporal_copies`), instead of the C library's memcpy.
    /// Default: off.
    #[arg(long)]
    nontemporal: bool,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
}

/// Runs `multirail membench`.
pub fn run(args: MembenchArgs) -> Result<(), Failure> {
    if args.block_size > args.buffer_size {
        return Err(Failure::Usage(format!(
            "--block-size {} is larger than --buffer-size {}",
            units::format_size(args.block_size),
            units::format_size(args.buffer_size)
        )));
    }
    limits::fits_in_memory("--buffer-size", args.buffer_size, 2).map_err(Failure::Usage)?;
    let (block, size) = (args.block_size as usize, args.buffer_size as usize);
    // Write every page of both buffers first (a zeroed Vec would map the shared zero page and
    // fault on first write) and copy once, so neither page faults nor first-touch costs are
    // measured.
    let src = vec![1u8; size];
    let mut dst = vec![2u8; size];
    dst.copy_from_slice(&src);
    let blocks = size / block;
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut i = 0usize;
    while start.elapsed() < args.duration {
        for _ in 0..16 {
            let off = (i % blocks) * block;
            let (to, from) = (&mut dst[off..off + block], &src[off..off + block]);
            if args.nontemporal {
                multirail::transport::nontemporal::copy_slice(to, from).expect("equal lengths");
            } else {
                to.copy_from_slice(from);
            }
            i += 1;
        }
        bytes += 16 * block as u64;
    }
    std::hint::black_box(&dst);
    let secs = start.elapsed().as_secs_f64();
    let gbps = bytes as f64 / secs / 1e9;
    if args.json {
        outln!(
            "{}",
            serde_json::json!({"block_size": block, "buffer_size": size, "nontemporal": args.nontemporal, "duration_s": secs, "bytes": bytes, "gb_per_s": gbps})
        )
    } else {
        outln!(
            "{} {} blocks over {} buffers: {gbps:.2} GB/s (single thread)",
            if args.nontemporal {
                "streaming copy of"
            } else {
                "memcpy"
            },
            units::format_size(block as u64),
            units::format_size(size as u64)
        )
    }
}
