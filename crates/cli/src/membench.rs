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
    /// Copy the blocks in the scattered order of `multirail bench --scatter` (in each run of
    /// 1000 blocks, the odd ones, then the even ones), the floor for that run's copies.
    /// Default: address order.
    #[arg(long)]
    scatter: bool,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
}

/// Blocks per run of the scattered order: the batch of 1000 that `bench/small` gives
/// `multirail bench --scatter`.
const SCATTER_RUN: usize = 1000;

/// Where the `i`-th copy starts among `blocks` blocks of `block` bytes: in address order, or
/// in the scattered order (whole runs of [`SCATTER_RUN`] blocks, or one run of them all, each
/// walked odd blocks first; blocks past the last whole run are left out).
fn block_offset(i: usize, blocks: usize, block: usize, scatter: bool) -> usize {
    if !scatter {
        return (i % blocks) * block;
    }
    let run = blocks.min(SCATTER_RUN);
    let k = crate::bench::block_order((i % run) as u64, run as u64, true) as usize;
    ((i / run) % (blocks / run) * run + k) * block
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
            let off = block_offset(i, blocks, block, args.scatter);
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
            serde_json::json!({"block_size": block, "buffer_size": size, "nontemporal": args.nontemporal, "scatter": args.scatter, "duration_s": secs, "bytes": bytes, "gb_per_s": gbps})
        )
    } else {
        outln!(
            "{} {} blocks{} over {} buffers: {gbps:.2} GB/s (single thread)",
            if args.nontemporal {
                "streaming copy of"
            } else {
                "memcpy"
            },
            units::format_size(block as u64),
            if args.scatter {
                " in scattered order"
            } else {
                ""
            },
            units::format_size(size as u64)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scattered_order_copies_every_block_of_whole_runs_once_per_pass() {
        for blocks in [1, 7, 1000, 2500] {
            let run = blocks.min(SCATTER_RUN);
            let pass = blocks / run * run;
            let mut seen: Vec<usize> = (0..pass)
                .map(|i| block_offset(i, blocks, 16, true))
                .collect();
            assert!(seen.windows(2).all(|w| w[1] != w[0] + 16) || blocks == 1);
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..pass).map(|b| b * 16).collect::<Vec<_>>(),
                "{blocks}"
            );
            // The next pass starts over.
            assert_eq!(
                block_offset(pass, blocks, 16, true),
                block_offset(0, blocks, 16, true)
            );
        }
        assert_eq!(block_offset(5, 4, 16, false), 16);
    }
}
