//! `multirail membench`: the memcpy baseline shared-memory transfers are held to.

use std::time::{Duration, Instant};

use clap::Args;

use crate::units;
use crate::Failure;

#[derive(Args)]
pub struct MembenchArgs {
    /// Bytes per memcpy call. Default: 1MiB.
    #[arg(long, default_value = "1MiB", value_parser = units::parse_size)]
    block_size: u64,
    /// Size of each of the two buffers walked. Default: 1GiB.
    #[arg(long, default_value = "1GiB", value_parser = units::parse_size)]
    buffer_size: u64,
    /// How long to run (seconds, or e.g. 500ms). Default: 3.
    #[arg(long, default_value = "3", value_parser = units::parse_duration)]
    duration: Duration,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
}

pub fn run(args: MembenchArgs) -> Result<(), Failure> {
    if args.block_size == 0 || args.block_size > args.buffer_size {
        return Err(Failure::Usage(
            "--block-size must be in 1..=--buffer-size".into(),
        ));
    }
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
            dst[off..off + block].copy_from_slice(&src[off..off + block]);
            i += 1;
        }
        bytes += 16 * block as u64;
    }
    std::hint::black_box(&dst);
    let secs = start.elapsed().as_secs_f64();
    let gbps = bytes as f64 / secs / 1e9;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"block_size": block, "buffer_size": size, "duration_s": secs, "bytes": bytes, "gb_per_s": gbps})
        );
    } else {
        println!(
            "memcpy {} blocks over {} buffers: {gbps:.2} GB/s (single thread)",
            units::format_size(block as u64),
            units::format_size(size as u64)
        );
    }
    Ok(())
}
