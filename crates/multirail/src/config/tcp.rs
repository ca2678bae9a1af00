//! The `transports.tcp` section.

use super::*;

/// TCP transport settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TcpConfig {
    /// Connections per (local rail, remote rail) pair to each peer that take turns carrying
    /// bulk slices (default 2); 1..=64. Each pair opens one more, kept for HIGH slices.
    pub connections_per_rail: usize,
    /// How long a peer may answer nothing, on any rail, while requests to it are outstanding
    /// (queued or in flight), in milliseconds (default 5000); >= 1. Counted from the later of
    /// its last answer and the moment the outstanding work began; once past, every one of
    /// those requests fails with `Error::Timeout` (the engine's timer fires at the deadline), whatever
    /// `max_retries` says, and the peer's connections are closed. A single rail whose oldest
    /// slice waits half of this while another rail answers or stands idle is dropped and its
    /// slices retried on the others (at most `max_retries` times, and only until the peer's own
    /// deadline). Also the kernel's `TCP_USER_TIMEOUT` on data connections.
    pub timeout_ms: u64,
    /// Connection attempt timeout in milliseconds (default 3000); >= 1.
    pub connect_timeout_ms: u64,
    /// Retries of a failed slice, possibly on another rail, before the request fails (default 8).
    pub max_retries: u32,
    /// Bytes in flight on one connection before the sender waits (default 64 MiB); > 0.
    pub max_inflight_bytes_per_connection: u64,
    /// Nice value, above their own, at which the threads carrying LOW slices run, on both ends
    /// (MEDIUM: half of it; HIGH: their own, with a short scheduler slice), so HIGH slices'
    /// threads win cores that bulk keeps busy; 0..=19, default 0 (off: with bulk already held
    /// to one bandwidth-delay product beside HIGH, it did not lower HIGH's p99 on a 2-core host
    /// and cost bulk a quarter of its throughput).
    pub bulk_thread_nice: i32,
    /// Most connections the listening port holds at once, of every kind, handshaken or not
    /// (default 4096); 1..=1048576. A connection past it is closed at once: every connection
    /// costs an fd and a little memory, and a peer that opens them without end must not take
    /// the engine's last fd.
    pub max_connections: usize,
    /// Most connections that have not finished the handshake (default 256, and never more
    /// than max_connections); 1..=1048576.
    /// Past it the oldest such connection is closed to make room: a member finishes its
    /// handshake within one round trip, so what lingers unproven is a stranger.
    pub max_pending_connections: usize,
    /// Threads that serve every accepted connection, however many there are (default 4);
    /// 1..=64. Idle connections cost no thread.
    pub serve_threads: usize,
    /// A connection idle this long is probed by TCP keepalive, on both ends (default 15000;
    /// at least 1). A peer that does not answer within `timeout_ms` is dropped: without it, a peer
    /// that vanished while its link was down (its FIN lost) would hold an fd here forever.
    /// Live idle connections answer the probes and stay open.
    pub keepalive_ms: u64,
    /// How long one slice may keep the peer's fastest rail busy, in microseconds (default 80;
    /// 0..=10000): on a rail whose estimate carries more than `workers.block_size` in that
    /// time, slices double (at most 4 times the block size) while it still holds them. Every
    /// tcp slice costs a frame, an answer and a serving thread's turn on each end: on loopback
    /// 16 × 64 KiB batches moved 2.7 GB/s in 64 KiB slices and 3.2–4.0 in 128 KiB ones. Slow
    /// rails keep `workers.block_size`; 0 always does.
    pub slice_time_us: u64,
    /// Payloads of 4 KiB to 16 KiB that arrive behind other frames, read ahead into a
    /// connection's staging buffer, are copied from there to their destination with streaming
    /// (non-temporal) stores, as `transports.shm.nontemporal_copies` does for same-host copies
    /// (default true; x86-64 only). Larger payloads go from the socket to their destination in
    /// the kernel's own copy.
    pub nontemporal_copies: bool,
    /// Receive path of two-sided messages over TCP.
    pub receive: ReceiveConfig,
    /// When the last few polls of `recv` all took in messages from tcp connections (a stream,
    /// not a ping-pong), `recv` waits this long, spinning, before it reads the sockets again
    /// (default 6; 0: never), so one read takes in several messages instead of one a system
    /// call: with 4 streaming senders on this 2-core host, 0.83 of the rate of a receiver with
    /// 32 connections to scan (which batches by being slow) became 0.98. A ping-pong never
    /// waits (a poll that finds its message is followed by empty ones); at most 1000.
    pub stream_pause_us: u64,
    /// Group multicast defaults for groups whose writes go over tcp.
    pub multicast: MulticastConfig,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections_per_rail: 2,
            timeout_ms: 5000,
            connect_timeout_ms: 3000,
            max_retries: 8,
            max_inflight_bytes_per_connection: 64 * 1024 * 1024,
            bulk_thread_nice: 0,
            max_connections: 4096,
            max_pending_connections: 256,
            serve_threads: 4,
            keepalive_ms: 15000,
            stream_pause_us: 6,
            slice_time_us: 80,
            nontemporal_copies: true,
            receive: ReceiveConfig::default(),
            multicast: MulticastConfig::default(),
        }
    }
}

impl TcpConfig {
    pub(crate) fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        within_count(prefix, "connections_per_rail", self.connections_per_rail)?;
        at_least_one(prefix, "timeout_ms", self.timeout_ms)?;
        at_least_one(prefix, "connect_timeout_ms", self.connect_timeout_ms)?;
        if self.max_inflight_bytes_per_connection == 0 {
            return Err(ConfigError::new(
                format!("{prefix}.max_inflight_bytes_per_connection"),
                "must be greater than 0, got 0",
            ));
        }
        if !(0..=19).contains(&self.bulk_thread_nice) {
            return Err(ConfigError::new(
                format!("{prefix}.bulk_thread_nice"),
                format!("must be within [0, 19], got {}", self.bulk_thread_nice),
            ));
        }
        if !(1..=1 << 20).contains(&self.max_connections) {
            return Err(ConfigError::new(
                format!("{prefix}.max_connections"),
                format!("must be within [1, 1048576], got {}", self.max_connections),
            ));
        }
        if !(1..=1 << 20).contains(&self.max_pending_connections) {
            return Err(ConfigError::new(
                format!("{prefix}.max_pending_connections"),
                format!(
                    "must be within [1, 1048576], got {}",
                    self.max_pending_connections
                ),
            ));
        }
        within_count(prefix, "serve_threads", self.serve_threads)?;
        at_least_one(prefix, "keepalive_ms", self.keepalive_ms)?;
        if self.stream_pause_us > 1000 {
            return Err(ConfigError::new(
                format!("{prefix}.stream_pause_us"),
                format!("must be within [0, 1000], got {}", self.stream_pause_us),
            ));
        }
        if self.slice_time_us > 10_000 {
            return Err(ConfigError::new(
                format!("{prefix}.slice_time_us"),
                format!("must be within [0, 10000], got {}", self.slice_time_us),
            ));
        }
        self.receive.validate(&format!("{prefix}.receive"))?;
        self.multicast.validate(&format!("{prefix}.multicast"))?;
        Ok(())
    }
}
