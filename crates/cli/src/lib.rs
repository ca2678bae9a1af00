//! Pieces of the `multirail` command that its tests and benchmarks share: flag units and
//! ranges, the child processes of `--local` runs, and the position-determined byte pattern
//! both ends of a benchmark check bytes with.

pub mod child;
pub mod clock;
pub mod limits;
pub mod pattern;
pub mod units;
