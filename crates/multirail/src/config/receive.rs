//! The receive path of two-sided messages (`transports.tcp.receive`, `transports.shm.receive`).

use super::*;

/// When a consumed receive buffer is posted again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReturnPolicy {
    /// As soon as its message is consumed (default).
    #[default]
    Individual,
    /// All together, once no posted buffer is left.
    Bulk,
}

/// Whether a responder returns a request's buffer before or after sending its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReturnOrder {
    /// Return, then answer (default).
    #[default]
    BeforeReply,
    /// Answer, then return.
    AfterReply,
}

/// Receive path of two-sided messages (`transports.<tcp|shm>.receive`), the knobs whose
/// effect on latency RAMCloud's InfRc transport and perftest's ping-pong method show.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReceiveConfig {
    /// Receive buffers posted per connection, or in the shared pool (default 64); 1..=1048576.
    pub queue_depth: usize,
    /// One pool shared by every connection of the engine (an SRQ) instead of one per connection.
    pub shared_receive_queue: bool,
    /// The pool is allocated and registered as this many chunks of queue_depth / chunks buffers
    /// (default 1); must divide queue_depth.
    pub registration_chunks: usize,
    /// Most scatter/gather entries a receive may use (default 1); 1..=32.
    pub max_sge: usize,
    /// Bytes per receive buffer, the largest message (default 8192); 1..=64 MiB.
    pub buffer_size: usize,
    /// `individual` (default) or `bulk`.
    pub return_policy: ReturnPolicy,
    /// `before_reply` (default) or `after_reply`.
    pub return_order: ReturnOrder,
    /// Microseconds a waiting `recv` polls before it sleeps on the doorbell (default 200);
    /// 0..=1000000. One wait covers every transport: it takes the largest of the three.
    pub spin_us: u64,
    /// The spin follows how soon messages have been arriving: the full `spin_us` while they
    /// come within it, down to a quarter of it the more recent waits outlasted it (default
    /// true). False on any transport makes every wait spin the full `spin_us`.
    pub adaptive_spin: bool,
    /// Microseconds before a message due at a steady cadence that a sleeping `recv` (or
    /// notification wait) wakes to poll for it, so the message costs a poll instead of a
    /// wake-up (default 200; 0 never). It wakes earlier still by how late its recent timer
    /// wakes came (learned per engine). It anticipates only while the last gaps between
    /// arrivals were steady enough that the poll stays under an eighth of the gap. One wait
    /// covers every transport: 0 on any transport turns it off, otherwise the longest lead.
    pub cadence_lead_us: u64,
    /// A wait that woke to poll ahead of a message due at the cadence, and found that another
    /// task took its CPU meanwhile, as in the window before (on a small host, often the
    /// message's sender, which the kernel keeps waking there), moves its thread to another CPU
    /// its affinity allows before it next sleeps, at most once in 10 ms (less often while moves
    /// do not help, up to once a second); the affinity is restored as it was (default true).
    /// False on any transport turns it off.
    pub leave_shared_cpu: bool,
}

/// Default of `spin_us`: a busy tcp ping-pong's round trip here is 20-30 µs, so its waits end
/// within the spin and never pay a wake-up.
pub const DEFAULT_SPIN_US: u64 = 200;
/// Default of `cadence_lead_us`: the margin for a message's jitter around its cadence. How
/// late the timer wakes the sleeping thread (the timer slack of 50 µs and the wake-up of a
/// halted vCPU: 80-300 µs on a virtual machine) is learned and added by the wait.
pub const DEFAULT_CADENCE_LEAD_US: u64 = 200;
/// Largest `cadence_lead_us`: a tenth of a second.
pub const MAX_CADENCE_LEAD_US: u64 = 100_000;
/// Largest `spin_us`: a second.
pub const MAX_SPIN_US: u64 = 1_000_000;

impl Default for ReceiveConfig {
    fn default() -> Self {
        let d = multirail_policy::receive::ReceiveSettings::default();
        ReceiveConfig {
            queue_depth: d.queue_depth,
            shared_receive_queue: d.shared_receive_queue,
            registration_chunks: d.registration_chunks,
            max_sge: d.max_sge,
            buffer_size: d.buffer_size,
            return_policy: ReturnPolicy::Individual,
            return_order: ReturnOrder::BeforeReply,
            spin_us: DEFAULT_SPIN_US,
            adaptive_spin: true,
            cadence_lead_us: DEFAULT_CADENCE_LEAD_US,
            leave_shared_cpu: true,
        }
    }
}

impl ReceiveConfig {
    /// The settings the receive accounting takes.
    pub fn settings(&self) -> multirail_policy::receive::ReceiveSettings {
        use multirail_policy::receive as r;
        r::ReceiveSettings {
            queue_depth: self.queue_depth,
            shared_receive_queue: self.shared_receive_queue,
            registration_chunks: self.registration_chunks,
            max_sge: self.max_sge,
            buffer_size: self.buffer_size,
            return_policy: match self.return_policy {
                ReturnPolicy::Individual => r::ReturnPolicy::Individual,
                ReturnPolicy::Bulk => r::ReturnPolicy::Bulk,
            },
            return_order: match self.return_order {
                ReturnOrder::BeforeReply => r::ReturnOrder::BeforeReply,
                ReturnOrder::AfterReply => r::ReturnOrder::AfterReply,
            },
        }
    }

    pub(crate) fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        let at_most = |key: &str, value: u64, max: u64, what: &str| {
            if value > max {
                return Err(ConfigError::new(
                    format!("{prefix}.{key}"),
                    format!("must be at most {max} ({what}), got {value}"),
                ));
            }
            Ok(())
        };
        at_most("spin_us", self.spin_us, MAX_SPIN_US, "a second")?;
        at_most(
            "cadence_lead_us",
            self.cadence_lead_us,
            MAX_CADENCE_LEAD_US,
            "a tenth of a second",
        )?;
        self.settings()
            .validate()
            .map_err(|e| ConfigError::new(format!("{prefix}.{}", e.key), e.message))
    }
}
