//! The `workers` section: slicing, copy threads, waiting, and the dispatcher's window
//! controller and bulk cutting (mapped to `multirail_policy::dispatch` in one place).

use super::*;

/// How requests are cut into slices and how many threads copy them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkersConfig {
    /// Slice size in bytes (default 65536); must be > 0 and <= 64 MiB.
    pub block_size: u64,
    /// Most slices one request is cut into (default 64); must be >= 1.
    pub max_slices_per_request: u32,
    /// Most slices one WRITE request is cut into (default 32); must be >= 1.
    pub max_slices_per_write: u32,
    /// Threads copying for the shared-memory transport (default 2); 1..=64.
    pub shm_copy_threads: usize,
    /// Most microseconds `wait` polls for completion before it sleeps, while the engine moves
    /// no MEDIUM or LOW bytes (default 1000; 0 = always sleep at once; at most 10000). Waking
    /// a sleeping thread, on an idle core of a virtual machine above all, can take longer than
    /// a 64 KiB transfer; with bulk moving the cores are busy and a poller would slow it.
    pub wait_spin_us: u32,
    /// The spin of `wait` follows how long recent waits lasted (default true): the full
    /// `wait_spin_us` while they end within it, down to none the more of the recent waits
    /// (about eight) outlasted it, so waits for long transfers sleep at once. False: every
    /// wait spins the full `wait_spin_us`.
    pub adaptive_wait_spin: bool,
    /// How much each path to a peer keeps in flight, on every transport that carries rails.
    pub window: WindowConfig,
    /// Most microseconds of a rail's bandwidth one bulk slice carries while HIGH work is
    /// active (default 250; 1..=1000000): a bulk slice on the wire cannot be passed, so this
    /// bounds what a HIGH slice waits behind on a slow rail. Fast rails carry whole slices.
    pub bulk_chunk_wait_us: u64,
    /// Bulk slices are not cut below this many bytes beside HIGH work (default 16384;
    /// 4096..=64 MiB): smaller ones cost more per byte than the wait they save.
    pub min_bulk_chunk: u64,
    /// Requests of one submit call that follow one another in memory on both sides (same
    /// target buffer, operation and priority; each starts where the one before it ended, here
    /// and at the target) are moved as one, up to this many bytes (default 1 MiB; 0 = never;
    /// at most 64 MiB). Each request still reports its own status; a failure of the whole
    /// fails each request in it.
    pub merge_adjacent_max_bytes: u64,
}

/// Default of `workers.merge_adjacent_max_bytes`: a run long enough that per-request costs
/// vanish beside its bytes, short enough that the first request of a run completes soon.
pub const DEFAULT_MERGE_ADJACENT_MAX_BYTES: u64 = 1 << 20;

impl Default for WorkersConfig {
    fn default() -> Self {
        WorkersConfig {
            block_size: 65536,
            max_slices_per_request: 64,
            max_slices_per_write: 32,
            shm_copy_threads: 2,
            wait_spin_us: 1000,
            adaptive_wait_spin: true,
            window: WindowConfig::default(),
            bulk_chunk_wait_us: dispatch::DEFAULT_HIGH_WAIT_NS / 1000,
            min_bulk_chunk: dispatch::DEFAULT_MIN_BULK_CHUNK,
            merge_adjacent_max_bytes: DEFAULT_MERGE_ADJACENT_MAX_BYTES,
        }
    }
}

impl WorkersConfig {
    /// The dispatcher settings these keys give (window controller, bulk chunking beside HIGH);
    /// the transport fills in its timeout, retries and promotion.
    pub fn dispatch_config(&self) -> dispatch::DispatchConfig {
        dispatch::DispatchConfig {
            controller: self.window.controller(self.block_size),
            high_wait_ns: self.bulk_chunk_wait_us.saturating_mul(1000),
            min_bulk_chunk: self.min_bulk_chunk,
            ..dispatch::DispatchConfig::default()
        }
    }
}

/// Which window controller sizes what a path keeps in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WindowControllerKind {
    /// A few bandwidth-delay products (the rail's EWMA bandwidth times the path's smallest
    /// round trip), capped at what the path holds (its propagation delay's worth) plus
    /// `max_queue_us` of the bandwidth.
    #[default]
    Bdp,
    /// `fixed_bytes` whatever the path measures.
    Fixed,
}

/// The window controller and its settings (`workers.window`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WindowConfig {
    /// `bdp` (default) or `fixed`.
    pub controller: WindowControllerKind,
    /// Bandwidth-delay products of a full window (default 8; 0.5..=64). On a CPU-bound link
    /// such as loopback the smallest round trip understates what keeps the pipe full.
    pub bdps: f64,
    /// Bandwidth-delay products bulk keeps in flight beside HIGH work (default 1; 0.1..=bdps).
    pub lean_bdps: f64,
    /// Most microseconds of the rail's bandwidth a window holds beyond what the path itself
    /// holds, its propagation delay's worth (default 1000; 1..=1000000): a slow rail's queue
    /// never holds more than that (or one slice) for a HIGH slice to wait behind, and a long
    /// path still keeps its whole bandwidth-delay product in flight.
    pub max_queue_us: u64,
    /// Window before a path has measured a round trip, bytes (default 1 MiB; 4096..=1 GiB).
    /// The `bdp` window then grows from it by the bytes the path answered (slow start).
    pub initial_bytes: u64,
    /// The window of the `fixed` controller, bytes (default 4 MiB; 4096..=1 GiB).
    pub fixed_bytes: u64,
}

impl Default for WindowConfig {
    fn default() -> Self {
        let bdp = dispatch::BdpController::default();
        WindowConfig {
            controller: WindowControllerKind::Bdp,
            bdps: bdp.window_bdps,
            lean_bdps: bdp.lean_bdps,
            max_queue_us: bdp.max_queue_ns / 1000,
            initial_bytes: bdp.initial_window,
            fixed_bytes: 4 << 20,
        }
    }
}

impl WindowConfig {
    /// The controller these settings describe, for slices of `block_size` bytes
    /// (`workers.block_size`: the least slice a full window's pipes are counted in).
    pub fn controller(&self, block_size: u64) -> dispatch::ControllerKind {
        match self.controller {
            WindowControllerKind::Bdp => dispatch::ControllerKind::Bdp(dispatch::BdpController {
                initial_window: self.initial_bytes,
                window_bdps: self.bdps,
                lean_bdps: self.lean_bdps,
                max_queue_ns: self.max_queue_us.saturating_mul(1000),
                pipe_slice: block_size,
            }),
            WindowControllerKind::Fixed => {
                dispatch::ControllerKind::Fixed(dispatch::FixedController {
                    bytes: self.fixed_bytes,
                })
            }
        }
    }

    pub(crate) fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        let bad = |key: &str, msg: String| Err(ConfigError::new(format!("{prefix}.{key}"), msg));
        if !(0.5..=64.0).contains(&self.bdps) {
            return bad(
                "bdps",
                format!("must be within 0.5..=64, got {}", self.bdps),
            );
        }
        if !(0.1..=self.bdps).contains(&self.lean_bdps) {
            return bad(
                "lean_bdps",
                format!(
                    "must be within 0.1..=bdps ({}), got {}",
                    self.bdps, self.lean_bdps
                ),
            );
        }
        if !(1..=1_000_000).contains(&self.max_queue_us) {
            return bad(
                "max_queue_us",
                format!("must be within 1..=1000000, got {}", self.max_queue_us),
            );
        }
        for (key, v) in [
            ("initial_bytes", self.initial_bytes),
            ("fixed_bytes", self.fixed_bytes),
        ] {
            if !(4096..=1 << 30).contains(&v) {
                return bad(key, format!("must be within 4096..=1073741824, got {v}"));
            }
        }
        Ok(())
    }
}

impl WorkersConfig {
    pub(crate) fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(ConfigError::new(
                format!("{prefix}.block_size"),
                format!(
                    "must be greater than 0 and at most {MAX_BLOCK_SIZE} (64 MiB), got {}",
                    self.block_size
                ),
            ));
        }
        at_least_one(
            prefix,
            "max_slices_per_request",
            self.max_slices_per_request.into(),
        )?;
        at_least_one(
            prefix,
            "max_slices_per_write",
            self.max_slices_per_write.into(),
        )?;
        within_count(prefix, "shm_copy_threads", self.shm_copy_threads)?;
        if self.wait_spin_us > MAX_WAIT_SPIN_US {
            return Err(ConfigError::new(
                format!("{prefix}.wait_spin_us"),
                format!(
                    "must be at most {MAX_WAIT_SPIN_US} (10 ms), got {}",
                    self.wait_spin_us
                ),
            ));
        }
        self.window.validate(&format!("{prefix}.window"))?;
        if !(1..=1_000_000).contains(&self.bulk_chunk_wait_us) {
            return Err(ConfigError::new(
                format!("{prefix}.bulk_chunk_wait_us"),
                format!(
                    "must be within 1..=1000000, got {}",
                    self.bulk_chunk_wait_us
                ),
            ));
        }
        if !(4096..=64 << 20).contains(&self.min_bulk_chunk) {
            return Err(ConfigError::new(
                format!("{prefix}.min_bulk_chunk"),
                format!(
                    "must be within 4096..=67108864, got {}",
                    self.min_bulk_chunk
                ),
            ));
        }
        if self.merge_adjacent_max_bytes > MAX_BLOCK_SIZE {
            return Err(ConfigError::new(
                format!("{prefix}.merge_adjacent_max_bytes"),
                format!(
                    "must be at most {MAX_BLOCK_SIZE} (64 MiB; 0 = never merge), got {}",
                    self.merge_adjacent_max_bytes
                ),
            ));
        }
        Ok(())
    }
}
