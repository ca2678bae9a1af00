//! Splitting one transfer request into slices.
//!
//! A request of `length` bytes is cut into slices of `block_size` bytes so that its slices can be
//! sprayed over several rails and kept in flight together. Two rules bound the result:
//!
//! - At most `max_slices` slices per request. Each slice costs a work request, a completion and a
//!   selector decision, so a huge request must not turn into millions of them; when
//!   `ceil(length / block_size)` would exceed the cap, the slice size grows to
//!   `ceil(length / max_slices)` instead.
//! - A tail shorter than 25% of the slice size is merged into the slice before it, so the last
//!   slice may be up to 1.25 × the slice size. A tiny tail would cost a full per-slice overhead
//!   for almost no bytes.
//!
//! Unlike Mooncake, which rounds per slice and can emit zero-length trailing slices, the count is
//! decided first and the last slice takes whatever remains, so no slice is ever empty.
//!
//! The engine calls [`SlicePlan::slices`] once per request: it allocates nothing and the
//! returned [`Slices`] iterator is a few integers.

use std::fmt;
use std::iter::FusedIterator;

/// Default slice size in bytes (config key `workers.block_size`): 64 KiB.
pub const DEFAULT_BLOCK_SIZE: u64 = 64 * 1024;

/// Default cap on the number of slices of one read request.
pub const DEFAULT_MAX_SLICES: u32 = 64;

/// Default cap on the number of slices of one write request.
pub const DEFAULT_MAX_SLICES_WRITE: u32 = 32;

/// Why a slicing call was refused. Each variant names the argument that was zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SliceError {
    /// `length` was 0: an empty request has no slices, and the engine must not post it.
    ZeroLength,
    /// `block_size` was 0.
    ZeroBlockSize,
    /// `max_slices` was 0.
    ZeroMaxSlices,
}

impl fmt::Display for SliceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SliceError::ZeroLength => "length must be at least 1 byte, got 0",
            SliceError::ZeroBlockSize => "block_size must be at least 1 byte, got 0",
            SliceError::ZeroMaxSlices => "max_slices must be at least 1, got 0",
        })
    }
}

impl std::error::Error for SliceError {}

/// Most times a plan's block size grows for a fast rail (see [`SlicePlan::grown_for`]).
pub const MAX_SLICE_GROWTH: u64 = 4;

/// Parameters of slicing, built once from config.
///
/// The fields are public so the plan can be written as a literal; [`SlicePlan::slices`] and
/// [`SlicePlan::count`] check them again, so a plan with a zero field yields an error, never a
/// panic or an endless iterator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlicePlan {
    /// Preferred slice size in bytes; grows for requests that would exceed `max_slices`.
    pub block_size: u64,
    /// Upper bound on the number of slices of one request.
    pub max_slices: u32,
}

/// One slice: `offset` is relative to the request start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slice {
    /// Byte offset of the slice from the start of the request.
    pub offset: u64,
    /// Length of the slice in bytes; never 0.
    pub length: u64,
}

impl Default for SlicePlan {
    /// The read plan with TENT's defaults: [`DEFAULT_BLOCK_SIZE`], [`DEFAULT_MAX_SLICES`].
    fn default() -> Self {
        SlicePlan {
            block_size: DEFAULT_BLOCK_SIZE,
            max_slices: DEFAULT_MAX_SLICES,
        }
    }
}

impl SlicePlan {
    /// Builds a plan of slices of `block_size` bytes, at most `max_slices` per request.
    ///
    /// Fails with [`SliceError::ZeroBlockSize`] if `block_size` is 0 and with
    /// [`SliceError::ZeroMaxSlices`] if `max_slices` is 0.
    pub fn new(block_size: u64, max_slices: u32) -> Result<Self, SliceError> {
        let plan = SlicePlan {
            block_size,
            max_slices,
        };
        plan.validate()?;
        Ok(plan)
    }

    /// Iterator over the slices of a request of `length` bytes, in order of offset.
    ///
    /// The slices are contiguous, cover `0..length` exactly once, none is empty and there are
    /// at most `max_slices` of them. Fails with [`SliceError::ZeroLength`] if `length` is 0, and
    /// with [`SliceError::ZeroBlockSize`] or [`SliceError::ZeroMaxSlices`] if the plan has a
    /// zero field.
    pub fn slices(&self, length: u64) -> Result<Slices, SliceError> {
        let (slice_size, count) = self.layout(length)?;
        Ok(Slices {
            next_offset: 0,
            remaining: count,
            slice_size,
            length,
        })
    }

    /// This plan with its block size doubled while what a rail moving `bytes_per_sec` carries
    /// in `slice_ns` holds the doubled size, at most [`MAX_SLICE_GROWTH`] times the plan's. A
    /// stream transport pays per slice what an RDMA work request does not (a frame and an
    /// answer, a serving thread's turn on each end): on a fast rail bigger slices move the same
    /// bytes for fewer of those, while a slow rail, which a slice already keeps busy for long,
    /// keeps the plan's. `slice_ns` 0 or an unknown bandwidth (0) leave the plan as it is.
    pub fn grown_for(&self, bytes_per_sec: f64, slice_ns: u64) -> SlicePlan {
        let room = bytes_per_sec * slice_ns as f64 / 1e9;
        let most = self.block_size.saturating_mul(MAX_SLICE_GROWTH);
        let mut block_size = self.block_size;
        while block_size < most && (block_size.saturating_mul(2) as f64) <= room {
            block_size = block_size.saturating_mul(2).min(most);
        }
        SlicePlan {
            block_size,
            ..*self
        }
    }

    /// Number of slices [`SlicePlan::slices`] yields for a request of `length` bytes.
    ///
    /// Fails exactly when [`SlicePlan::slices`] fails, with the same error.
    pub fn count(&self, length: u64) -> Result<u32, SliceError> {
        self.layout(length).map(|(_, count)| count)
    }

    fn validate(&self) -> Result<(), SliceError> {
        if self.block_size == 0 {
            return Err(SliceError::ZeroBlockSize);
        }
        if self.max_slices == 0 {
            return Err(SliceError::ZeroMaxSlices);
        }
        Ok(())
    }

    /// Slice size and slice count for `length`; every slice but the last is `slice_size` long.
    fn layout(&self, length: u64) -> Result<(u64, u32), SliceError> {
        self.validate()?;
        if length == 0 {
            return Err(SliceError::ZeroLength);
        }
        let cap = u64::from(self.max_slices);
        let slice_size = if length.div_ceil(self.block_size) > cap {
            // ceil(length / cap) slices of this size can never need more than `cap` slices.
            length.div_ceil(cap)
        } else {
            self.block_size
        };
        let full = length / slice_size;
        let tail = length % slice_size;
        // In u128 because 4 × tail overflows u64 when the slice size is near u64::MAX.
        let tail_is_small = u128::from(tail) * 4 < u128::from(slice_size);
        let count = if tail == 0 || (full > 0 && tail_is_small) {
            // Either no tail, or a small one that rides on the last full slice.
            full
        } else {
            // A tail worth its own slice, or a request shorter than one slice.
            full + 1
        };
        // count <= ceil(length / slice_size) <= cap, which is a u32.
        let count = u32::try_from(count).expect("slice count is bounded by max_slices");
        Ok((slice_size, count))
    }
}

/// Iterator over the slices of one request, returned by [`SlicePlan::slices`].
///
/// Every slice but the last is [`Slices::slice_size`] bytes long; the last takes whatever
/// remains, which is between 1 byte and 1.25 × the slice size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slices {
    next_offset: u64,
    remaining: u32,
    slice_size: u64,
    length: u64,
}

impl Slices {
    /// Size of every slice but the last; at least the plan's `block_size` unless the request is
    /// shorter than a block, larger when the slice cap forced slices to grow.
    pub fn slice_size(&self) -> u64 {
        self.slice_size
    }
}

impl Iterator for Slices {
    type Item = Slice;

    fn next(&mut self) -> Option<Slice> {
        if self.remaining == 0 {
            return None;
        }
        let offset = self.next_offset;
        self.remaining -= 1;
        // The last slice absorbs the merged tail (or is the short request itself), so its length
        // comes from the end of the request rather than from the slice size.
        let length = if self.remaining == 0 {
            self.length - offset
        } else {
            self.slice_size
        };
        self.next_offset = offset + length;
        Some(Slice { offset, length })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.remaining as usize;
        (n, Some(n))
    }

    fn nth(&mut self, n: usize) -> Option<Slice> {
        // Every slice but the last has the same size, so skipping is arithmetic, not n steps.
        match u32::try_from(n) {
            Ok(n) if n < self.remaining => {
                self.remaining -= n;
                self.next_offset += u64::from(n) * self.slice_size;
                self.next()
            }
            _ => {
                self.next_offset = self.length;
                self.remaining = 0;
                None
            }
        }
    }
}

impl ExactSizeIterator for Slices {}

impl FusedIterator for Slices {}

/// The slices of `slices` cut further so that none is longer than `max_len` bytes (a
/// transport's largest message), in order of offset. Each slice of the plan becomes
/// `ceil(length / max_len)` pieces of at most `max_len` bytes; together they still cover the
/// request exactly once. A `max_len` of 0 is taken as 1.
pub fn capped(slices: Slices, max_len: u64) -> impl Iterator<Item = Slice> {
    let max_len = max_len.max(1);
    slices.flat_map(move |s| {
        let pieces = s.length.div_ceil(max_len);
        (0..pieces).map(move |i| {
            let offset = i * max_len;
            Slice {
                offset: s.offset + offset,
                length: (s.length - offset).min(max_len),
            }
        })
    })
}

/// Where one copy job lies in its request. A same-host copy gains nothing from slices (they
/// matter to rails), so the shm transport copies contiguous runs of whole slices, cut into
/// jobs that a HIGH job never waits long behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobSpan {
    /// Offset of the job's first byte from the start of the request.
    pub offset: u64,
    /// Bytes in the job; never 0.
    pub len: u64,
    /// Slices that start in the job, for the rail's slice count: at least 1 for a run of
    /// whole slices; 0 for every piece but the first of a run cut by [`job_pieces`].
    pub slices: u64,
}

/// The jobs of one request, in order of offset; see [`job_spans`].
#[derive(Debug, Clone)]
pub struct JobSpans {
    /// Slices in the request.
    count: u64,
    /// Size of every slice but the last.
    slice_size: u64,
    /// Bytes in the request.
    length: u64,
    /// Jobs in all.
    jobs: u64,
    /// Index of the next job to yield.
    next: u64,
}

/// Cuts the request sliced as `slices` into jobs: contiguous runs of whole slices, as evenly
/// sized as whole slices allow, at least `min(slices, workers)` of them (so every worker can
/// help with one request) and no more than needed to keep each job at most `max_job` bytes,
/// which only a job of a single slice larger than that exceeds. Together the jobs cover every
/// byte of the request exactly once and none is empty. Pure arithmetic: allocates nothing.
pub fn job_spans(slices: &Slices, workers: usize, max_job: u64) -> JobSpans {
    let count = slices.len() as u64;
    let slice_size = slices.slice_size().max(1);
    // Every slice but the last is `slice_size` long (the slicing module's contract); the last
    // may be up to 1.25 times that, or shorter.
    let last = slices.clone().nth(slices.len().saturating_sub(1));
    let (last_offset, last_len) = last.map_or((0, 0), |s| (s.offset, s.length));
    let length = last_offset + last_len;
    let jobs = if count == 0 {
        0
    } else {
        // Whole slices of full size that fit in one job, and slices that fit in the job that
        // ends with the last slice.
        let per_job = (max_job / slice_size).max(1);
        let per_last_job = if last_len > max_job {
            1
        } else {
            1 + (max_job - last_len) / slice_size
        };
        // Job `j` holds slices `j * count / jobs ..(j + 1) * count / jobs`: none holds more than
        // ceil(count / jobs), and the last holds exactly that many.
        (count.min(workers.max(1) as u64))
            .max(count.div_ceil(per_job))
            .max(count.div_ceil(per_last_job))
    };
    JobSpans {
        count,
        slice_size,
        length,
        jobs,
        next: 0,
    }
}

impl Iterator for JobSpans {
    type Item = JobSpan;

    fn next(&mut self) -> Option<JobSpan> {
        if self.next >= self.jobs {
            return None;
        }
        let j = self.next;
        self.next += 1;
        let first = j * self.count / self.jobs;
        let end = (j + 1) * self.count / self.jobs;
        let offset = first * self.slice_size;
        let end_offset = if end == self.count {
            self.length
        } else {
            end * self.slice_size
        };
        Some(JobSpan {
            offset,
            len: end_offset - offset,
            slices: end - first,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = (self.jobs - self.next) as usize;
        (n, Some(n))
    }
}

impl ExactSizeIterator for JobSpans {}

/// Cuts every run of `runs` longer than `max_job` into equal contiguous pieces of at most
/// `max_job` bytes (the first carries the run's slice count), leaving shorter runs whole.
/// Returns the number of jobs and the jobs, which cover the same bytes as the runs, in order.
/// Pure arithmetic: allocates nothing.
pub fn job_pieces(runs: JobSpans, max_job: u64) -> (usize, impl Iterator<Item = JobSpan>) {
    let max_job = max_job.max(1);
    let count = runs.clone().map(|r| r.len.div_ceil(max_job)).sum::<u64>() as usize;
    let jobs = runs.flat_map(move |run| {
        let n = run.len.div_ceil(max_job);
        (0..n).map(move |k| {
            let start = run.len * k / n;
            let end = run.len * (k + 1) / n;
            JobSpan {
                offset: run.offset + start,
                len: end - start,
                slices: if k == 0 { run.slices } else { 0 },
            }
        })
    });
    (count, jobs)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_plan_grows_in_doublings_to_what_a_fast_rail_moves_in_the_slice_time() {
        let plan = SlicePlan::new(64 << 10, 32).unwrap();
        // 80 µs: 10 Gbit/s (1.25 GB/s) moves 100 KB, under a doubling: the plan's slices.
        assert_eq!(plan.grown_for(1.25e9, 80_000), plan);
        // 3 GB/s moves 240 KB: 128 KiB fits, 256 KiB does not; 4 GB/s (320 KB) takes 256 KiB.
        assert_eq!(plan.grown_for(3e9, 80_000).block_size, 128 << 10);
        assert_eq!(plan.grown_for(3e9, 80_000).max_slices, 32);
        assert_eq!(plan.grown_for(4e9, 80_000).block_size, 256 << 10);
        // 400 Gbit/s: at most four times the plan's.
        assert_eq!(plan.grown_for(50e9, 80_000).block_size, 256 << 10);
        // Off, unknown bandwidth, or a block size that is no power of two (capped, not past).
        assert_eq!(plan.grown_for(50e9, 0), plan);
        assert_eq!(plan.grown_for(0.0, 80_000), plan);
        let odd = SlicePlan::new(100_000, 8).unwrap();
        assert_eq!(odd.grown_for(50e9, 1_000_000).block_size, 400_000);
        let huge = SlicePlan::new(u64::MAX / 2, 8).unwrap();
        assert_eq!(huge.grown_for(f64::MAX, u64::MAX).block_size, u64::MAX);
    }

    fn spans(block: u64, max_slices: u32, length: u64, workers: usize) -> Vec<JobSpan> {
        let plan = SlicePlan::new(block, max_slices).unwrap();
        job_spans(&plan.slices(length).unwrap(), workers, MIB).collect()
    }

    fn lens(spans: &[JobSpan]) -> Vec<u64> {
        spans.iter().map(|s| s.len).collect()
    }

    #[test]
    fn bulk_requests_become_one_mib_jobs() {
        // The default write plan: 64 KiB blocks, at most 32 slices.
        let s = spans(64 * KIB, 32, 16 * MIB, 2);
        assert_eq!(lens(&s), vec![MIB; 16], "32 slices of 512 KiB, two per job");
        assert!(s.iter().all(|s| s.slices == 2));
        assert_eq!(lens(&spans(64 * KIB, 32, 4 * MIB, 2)), vec![MIB; 4]);
        // The default read plan: 64 slices of 64 KiB.
        assert_eq!(lens(&spans(64 * KIB, 64, 4 * MIB, 2)), vec![MIB; 4]);
    }

    #[test]
    fn small_requests_are_split_only_between_workers() {
        assert_eq!(lens(&spans(64 * KIB, 32, 64 * KIB, 2)), vec![64 * KIB]);
        assert_eq!(lens(&spans(64 * KIB, 32, 3, 8)), vec![3]);
        assert_eq!(lens(&spans(64 * KIB, 32, 256 * KIB, 2)), vec![128 * KIB; 2]);
        assert_eq!(lens(&spans(64 * KIB, 32, 256 * KIB, 8)), vec![64 * KIB; 4]);
    }

    #[test]
    fn a_slice_larger_than_a_job_is_copied_in_job_sized_pieces() {
        // 1 GiB in at most 32 slices: 32 MiB each, one per run...
        let plan = SlicePlan::new(64 * KIB, 32).unwrap();
        let slices = plan.slices(1 << 30).unwrap();
        let runs = job_spans(&slices, 2, MIB);
        assert_eq!(lens(&runs.clone().collect::<Vec<_>>()), vec![32 * MIB; 32]);
        // ...each copied in 32 jobs of 1 MiB, the first of which counts the slice.
        let (n, jobs) = job_pieces(runs, MIB);
        let jobs: Vec<JobSpan> = jobs.collect();
        assert_eq!((n, lens(&jobs)), (1024, vec![MIB; 1024]));
        assert_eq!(jobs.iter().map(|j| j.slices).sum::<u64>(), 32);
        assert_eq!((jobs[0].slices, jobs[1].slices, jobs[32].slices), (1, 0, 1));
        // Runs within the bound are left whole.
        let (n, jobs) = job_pieces(job_spans(&slices, 2, 64 * MIB), 64 * MIB);
        assert_eq!((n, jobs.count()), (16, 16));
    }

    #[test]
    fn the_long_last_slice_gets_a_job_of_its_own_when_needed() {
        // Two slices, the last carrying a merged tail: 512 KiB + 612 KiB exceed 1 MiB together.
        let s = spans(512 * KIB, 64, MIB + 100 * KIB, 1);
        assert_eq!(lens(&s), vec![512 * KIB, 612 * KIB]);
        // 4 × 256 KiB + a 60 KiB tail merged into the last: 512 KiB + 572 KiB.
        let s = spans(256 * KIB, 64, MIB + 60 * KIB, 1);
        assert_eq!(lens(&s), vec![512 * KIB, 572 * KIB]);
    }

    proptest! {
        #[test]
        fn capped_slices_cover_every_byte_once_within_the_cap(
            length in 1u64..(64 * MIB),
            block in 1u64..(4 * MIB),
            max_slices in 1u32..128,
            max_len in 0u64..(2 * MIB),
        ) {
            let plan = SlicePlan::new(block, max_slices).unwrap();
            let cap = max_len.max(1);
            let mut offset = 0;
            let mut n = 0u64;
            for s in capped(plan.slices(length).unwrap(), max_len) {
                prop_assert_eq!(s.offset, offset, "contiguous");
                prop_assert!(s.length > 0 && s.length <= cap, "{:?} over {}", s, cap);
                offset += s.length;
                n += 1;
            }
            prop_assert_eq!(offset, length, "every byte once");
            // A cap at or above every slice changes nothing.
            let plain = plan.slices(length).unwrap();
            let largest = plain.clone().map(|s| s.length).max().unwrap();
            let same: Vec<Slice> = capped(plain.clone(), largest).collect();
            prop_assert_eq!(same, plain.collect::<Vec<_>>());
            prop_assert!(n >= u64::from(plan.count(length).unwrap()));
        }
    }

    proptest! {
        #[test]
        fn jobs_cover_every_byte_once_in_whole_slices(
            length in 1u64..(64 * MIB),
            block in 1u64..(4 * MIB),
            max_slices in 1u32..128,
            workers in 1usize..9,
            max_job in 1u64..(4 * MIB),
        ) {
            let plan = SlicePlan::new(block, max_slices).unwrap();
            let slices = plan.slices(length).unwrap();
            let bounds: Vec<u64> = slices.clone().map(|s| s.offset).collect();
            let count = bounds.len() as u64;
            let slice_len: Vec<u64> = slices.clone().map(|s| s.length).collect();
            let jobs: Vec<JobSpan> = job_spans(&slices, workers, max_job).collect();
            prop_assert_eq!(jobs.len(), job_spans(&slices, workers, max_job).len());
            prop_assert!(jobs.len() as u64 >= count.min(workers as u64));
            let mut offset = 0;
            let mut first = 0usize;
            for job in &jobs {
                prop_assert_eq!(job.offset, offset, "contiguous");
                prop_assert!(job.len > 0 && job.slices > 0, "never empty");
                // The job starts at a slice boundary and holds exactly its slices.
                prop_assert_eq!(bounds[first], job.offset);
                let n = job.slices as usize;
                prop_assert_eq!(slice_len[first..first + n].iter().sum::<u64>(), job.len);
                prop_assert!(job.len <= max_job || job.slices == 1, "{:?} over {}", job, max_job);
                offset += job.len;
                first += n;
            }
            prop_assert_eq!(offset, length, "every byte once");
            prop_assert_eq!(first as u64, count, "every slice once");
        }

        #[test]
        fn pieces_cover_every_byte_once_within_the_bound(
            length in 1u64..(256 * MIB),
            block in 1u64..(64 * MIB),
            max_slices in 1u32..128,
            workers in 1usize..9,
            max_job in 1u64..(4 * MIB),
        ) {
            let plan = SlicePlan::new(block, max_slices).unwrap();
            let slices = plan.slices(length).unwrap();
            let count = slices.len() as u64;
            let (n, jobs) = job_pieces(job_spans(&slices, workers, max_job), max_job);
            let jobs: Vec<JobSpan> = jobs.collect();
            prop_assert_eq!(n, jobs.len());
            prop_assert!(n as u64 >= count.min(workers as u64));
            let mut offset = 0;
            for job in &jobs {
                prop_assert_eq!(job.offset, offset, "contiguous");
                prop_assert!(job.len > 0 && job.len <= max_job, "{:?} over {}", job, max_job);
                offset += job.len;
            }
            prop_assert_eq!(offset, length, "every byte once");
            prop_assert_eq!(jobs.iter().map(|j| j.slices).sum::<u64>(), count, "every slice counted once");
        }
    }

    use super::*;
    use proptest::prelude::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    const GIB: u64 = 1024 * MIB;

    fn lengths(plan: SlicePlan, length: u64) -> Vec<u64> {
        plan.slices(length).unwrap().map(|s| s.length).collect()
    }

    #[test]
    fn block_128k_request_200k_gives_128k_then_72k_without_empty_tail() {
        let plan = SlicePlan::new(128 * KIB, DEFAULT_MAX_SLICES).unwrap();
        assert_eq!(lengths(plan, 200 * KIB), [128 * KIB, 72 * KIB]);
        assert_eq!(plan.count(200 * KIB), Ok(2));
    }

    #[test]
    fn block_64k_request_200k_merges_8k_tail() {
        let plan = SlicePlan::new(64 * KIB, DEFAULT_MAX_SLICES).unwrap();
        assert_eq!(lengths(plan, 200 * KIB), [64 * KIB, 64 * KIB, 72 * KIB]);
        let offsets: Vec<u64> = plan.slices(200 * KIB).unwrap().map(|s| s.offset).collect();
        assert_eq!(offsets, [0, 64 * KIB, 128 * KIB]);
    }

    #[test]
    fn request_of_exactly_one_block_is_one_slice() {
        let plan = SlicePlan::default();
        assert_eq!(lengths(plan, 64 * KIB), [64 * KIB]);
    }

    #[test]
    fn one_byte_request_is_one_slice_of_one_byte() {
        let plan = SlicePlan::default();
        let slices: Vec<Slice> = plan.slices(1).unwrap().collect();
        assert_eq!(
            slices,
            [Slice {
                offset: 0,
                length: 1
            }]
        );
    }

    #[test]
    fn request_smaller_than_a_block_is_one_slice() {
        let plan = SlicePlan::default();
        assert_eq!(lengths(plan, 10 * KIB), [10 * KIB]);
    }

    #[test]
    fn exact_multiple_of_block_gives_equal_slices() {
        let plan = SlicePlan::default();
        for n in 1..=DEFAULT_MAX_SLICES {
            let got = lengths(plan, u64::from(n) * DEFAULT_BLOCK_SIZE);
            assert_eq!(got, vec![DEFAULT_BLOCK_SIZE; n as usize], "n = {n}");
        }
    }

    #[test]
    fn one_gib_with_cap_64_gives_64_slices_of_16_mib() {
        let plan = SlicePlan::new(DEFAULT_BLOCK_SIZE, 64).unwrap();
        let slices = plan.slices(GIB).unwrap();
        assert_eq!(slices.len(), 64);
        assert_eq!(slices.slice_size(), 16 * MIB);
        assert!(slices.clone().all(|s| s.length == 16 * MIB));
        assert_eq!(slices.last().unwrap().offset, 63 * 16 * MIB);
    }

    #[test]
    fn write_cap_32_grows_slices_of_1_gib_to_32_mib() {
        let plan = SlicePlan::new(DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SLICES_WRITE).unwrap();
        assert_eq!(lengths(plan, GIB), vec![32 * MIB; 32]);
    }

    #[test]
    fn tail_of_exactly_a_quarter_gets_its_own_slice() {
        let plan = SlicePlan::default();
        assert_eq!(lengths(plan, 144 * KIB), [64 * KIB, 64 * KIB, 16 * KIB]);
    }

    #[test]
    fn tail_just_under_a_quarter_is_merged() {
        let plan = SlicePlan::default();
        let length = 144 * KIB - 1;
        assert_eq!(lengths(plan, length), [64 * KIB, 80 * KIB - 1]);
    }

    #[test]
    fn tail_merges_into_a_single_full_slice() {
        let plan = SlicePlan::default();
        assert_eq!(lengths(plan, 70 * KIB), [70 * KIB]);
    }

    #[test]
    fn cap_of_one_gives_the_whole_request_as_one_slice() {
        let plan = SlicePlan::new(DEFAULT_BLOCK_SIZE, 1).unwrap();
        assert_eq!(lengths(plan, 5 * GIB + 3), [5 * GIB + 3]);
    }

    #[test]
    fn maximal_length_does_not_overflow() {
        for plan in [
            SlicePlan::new(1, 1).unwrap(),
            SlicePlan::new(1, 1 << 16).unwrap(),
            SlicePlan::new(u64::MAX, 1).unwrap(),
            SlicePlan::default(),
        ] {
            let slices = plan.slices(u64::MAX).unwrap();
            assert!(slices.len() <= plan.max_slices as usize);
            let total: u128 = slices.map(|s| u128::from(s.length)).sum();
            assert_eq!(total, u128::from(u64::MAX), "{plan:?}");
        }
        // Too many slices to walk in a test; check the count and the last slice by jumping.
        let plan = SlicePlan::new(1, u32::MAX).unwrap();
        assert_eq!(plan.count(u64::MAX), Ok(u32::MAX));
        let mut slices = plan.slices(u64::MAX).unwrap();
        let last = slices.nth(u32::MAX as usize - 1).unwrap();
        assert_eq!(last.offset + last.length, u64::MAX);
        assert!(last.length > 0 && last.length <= slices.slice_size());
    }

    #[test]
    fn zero_length_is_an_error() {
        assert_eq!(SlicePlan::default().slices(0), Err(SliceError::ZeroLength));
        assert_eq!(SlicePlan::default().count(0), Err(SliceError::ZeroLength));
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert_eq!(SlicePlan::new(0, 64), Err(SliceError::ZeroBlockSize));
        let literal = SlicePlan {
            block_size: 0,
            max_slices: 64,
        };
        assert_eq!(literal.slices(100), Err(SliceError::ZeroBlockSize));
        assert_eq!(literal.count(100), Err(SliceError::ZeroBlockSize));
    }

    #[test]
    fn zero_max_slices_is_an_error() {
        assert_eq!(SlicePlan::new(4096, 0), Err(SliceError::ZeroMaxSlices));
        let literal = SlicePlan {
            block_size: 4096,
            max_slices: 0,
        };
        assert_eq!(literal.slices(100), Err(SliceError::ZeroMaxSlices));
        assert_eq!(literal.count(100), Err(SliceError::ZeroMaxSlices));
    }

    #[test]
    fn errors_name_the_argument() {
        assert!(SliceError::ZeroLength.to_string().contains("length"));
        assert!(SliceError::ZeroBlockSize.to_string().contains("block_size"));
        assert!(SliceError::ZeroMaxSlices.to_string().contains("max_slices"));
        let boxed: Box<dyn std::error::Error> = Box::new(SliceError::ZeroLength);
        assert!(boxed.source().is_none());
    }

    #[test]
    fn iterator_is_exact_size_and_fused() {
        let mut slices = SlicePlan::default().slices(200 * KIB).unwrap();
        for left in (0..3).rev() {
            assert!(slices.next().is_some());
            assert_eq!(slices.len(), left);
        }
        assert_eq!(slices.next(), None);
        assert_eq!(slices.next(), None);
        assert_eq!(slices.len(), 0);
    }

    #[test]
    fn nth_skips_like_repeated_next() {
        let plan = SlicePlan::default();
        let all: Vec<Slice> = plan.slices(200 * KIB).unwrap().collect();
        for n in 0..5 {
            let mut it = plan.slices(200 * KIB).unwrap();
            assert_eq!(it.nth(n), all.get(n).copied(), "n = {n}");
            assert_eq!(it.len(), all.len().saturating_sub(n + 1));
            assert_eq!(it.collect::<Vec<_>>(), all[(n + 1).min(all.len())..]);
        }
    }

    proptest! {
        #[test]
        fn slices_cover_the_request_exactly_once(
            length in 1u64..=1 << 34,
            block_size in 1u64..=16 * MIB,
            cap in 1u32..=128,
        ) {
            let plan = SlicePlan::new(block_size, cap).unwrap();
            let slices = plan.slices(length).unwrap();
            let slice_size = slices.slice_size();
            // Independent oracle for the slice size the spec asks for.
            let expected_size = if length.div_ceil(block_size) > u64::from(cap) {
                length.div_ceil(u64::from(cap))
            } else {
                block_size
            };
            prop_assert_eq!(slice_size, expected_size);

            let count = plan.count(length).unwrap();
            prop_assert_eq!(count as usize, slices.len());
            prop_assert!(count >= 1 && count <= cap);

            let all: Vec<Slice> = slices.collect();
            prop_assert_eq!(all.len(), count as usize);
            let mut next = 0u64;
            for (i, s) in all.iter().enumerate() {
                prop_assert_eq!(s.offset, next, "slice {} not contiguous", i);
                prop_assert!(s.length > 0, "slice {} empty", i);
                if i + 1 < all.len() {
                    prop_assert!(s.length <= slice_size, "slice {} too long", i);
                } else {
                    // last < 1.25 × slice_size + 1, in integers.
                    prop_assert!(
                        u128::from(s.length) * 4 < u128::from(slice_size) * 5 + 4,
                        "last slice {} too long for slice size {}", s.length, slice_size
                    );
                }
                next = s.offset + s.length;
            }
            prop_assert_eq!(next, length);
        }

        #[test]
        fn clone_and_nth_agree_with_next(
            length in 1u64..=1 << 34,
            block_size in 1u64..=16 * MIB,
            cap in 1u32..=128,
            skip in 0usize..=130,
        ) {
            let plan = SlicePlan::new(block_size, cap).unwrap();
            let slices = plan.slices(length).unwrap();
            let all: Vec<Slice> = slices.clone().collect();
            let mut jumped = slices;
            prop_assert_eq!(jumped.nth(skip), all.get(skip).copied());
            let rest: Vec<Slice> = jumped.collect();
            prop_assert_eq!(&rest[..], &all[(skip + 1).min(all.len())..]);
        }
    }
}
