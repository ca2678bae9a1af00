//! The one error type of the engine.

use std::sync::Arc;

/// A configuration problem: which key is wrong and what is wrong with it.
///
/// `key` is the full dotted path of the offending key (`transports.tcp.timeout_ms`,
/// `rails[1].address`). It is empty for whole-document problems (unreadable file, JSON
/// syntax error, a document that is not an object); then `message` starts with the
/// origin (a file path or `MULTIRAIL_CONF`) and the display is `config: <message>`.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[error("{}", display_config_error(.key, .message))]
pub struct ConfigError {
    /// Full dotted path of the offending key; empty for whole-document errors.
    pub key: String,
    /// What is wrong, e.g. `must be within [0, 1], got 1.5` or `unknown key`.
    pub message: String,
}

impl ConfigError {
    /// Build an error about one key.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// How a [`ConfigError`] displays: `config key KEY: MESSAGE`, or `config: MESSAGE` without a key.
fn display_config_error(key: &str, message: &str) -> String {
    if key.is_empty() {
        format!("config: {message}")
    } else {
        format!("config key {key}: {message}")
    }
}

/// Everything that can go wrong in the engine. It is `Clone` because a failed request keeps its
/// error for every later `status` query.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The configuration document is malformed; the inner error names the key.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An API argument is out of range or malformed.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The argument's name as the API spells it.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A request's source range is not inside memory this engine registered or allocated.
    #[error("source range {addr:#x}+{len} is not inside registered memory")]
    SourceNotRegistered {
        /// Start of the range.
        addr: u64,
        /// Length of the range.
        len: u64,
    },
    /// A request's target range is not inside any buffer the target segment published.
    #[error("target range {addr:#x}+{len} lies outside every buffer of segment {segment}")]
    TargetOutOfRange {
        /// Segment name.
        segment: String,
        /// Start of the range (remote address).
        addr: u64,
        /// Length of the range.
        len: u64,
    },
    /// A segment id that `open_segment` never returned (or that was closed).
    #[error("unknown segment id {0}")]
    UnknownSegment(u64),
    /// The segment could not be reached or did not answer with a descriptor.
    #[error("segment {name} is unreachable: {reason}")]
    SegmentUnreachable {
        /// Segment name (`host:port`).
        name: String,
        /// Why.
        reason: String,
    },
    /// A batch id that was never allocated or was already freed.
    #[error("unknown batch {0} (never allocated or already freed)")]
    UnknownBatch(u64),
    /// Submitting these requests would exceed the batch's capacity.
    #[error("batch {batch} holds {capacity} requests, {used} used; {requested} more do not fit")]
    BatchFull {
        /// Batch id.
        batch: u64,
        /// Capacity given to `allocate_batch`.
        capacity: usize,
        /// Requests already submitted.
        used: usize,
        /// Requests in the refused submit.
        requested: usize,
    },
    /// `free_batch` on a batch whose requests are still in flight.
    #[error("batch {0} still has requests in flight")]
    BatchBusy(u64),
    /// The peer closed the connection or died while requests were in flight.
    #[error("peer {peer} disconnected: {reason}")]
    PeerDisconnected {
        /// Segment name of the peer.
        peer: String,
        /// What was observed.
        reason: String,
    },
    /// A slice got no answer from the peer within `transports.tcp.timeout_ms`, or a message
    /// found no room at the receiver in that time (it took none of the sender's messages in
    /// meanwhile; `detail` says so).
    #[error("no answer from peer {peer} within {timeout_ms} ms{detail}")]
    Timeout {
        /// Segment name of the peer.
        peer: String,
        /// The configured timeout.
        timeout_ms: u64,
        /// What the wait was for, when it was not a transfer's answer ("" for those).
        detail: &'static str,
    },
    /// The peer checked the slice and refused it (unknown buffer, wrong key, out of bounds).
    #[error("peer {peer} refused the slice: {reason}")]
    RemoteRejected {
        /// Segment name of the peer.
        peer: String,
        /// The peer's reason.
        reason: String,
    },
    /// This engine and the peer do not share the cluster's membership token (`auth.token` or
    /// `MULTIRAIL_TOKEN`), so the connection was refused before anything was served.
    #[error(
        "peer {peer} is not a member of this engine's cluster, or this engine not of its: {reason}"
    )]
    NotAMember {
        /// Segment name or address of the peer.
        peer: String,
        /// Which side could not prove membership.
        reason: String,
    },
    /// The peer sent something that is not valid protocol.
    #[error("protocol error with {peer}: {reason}")]
    Protocol {
        /// Segment name or address of the peer.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// Allocating, mapping or registering memory failed.
    #[error("memory: {0}")]
    Memory(String),
    /// A transport was demanded that cannot serve this request.
    #[error("transport {transport} cannot serve this request: {reason}")]
    TransportUnavailable {
        /// Transport name.
        transport: &'static str,
        /// Why.
        reason: String,
    },
    /// `wait` gave up before every request of the batch finished.
    #[error("wait timed out with {pending} of {total} requests still in flight")]
    WaitTimeout {
        /// Requests not finished.
        pending: usize,
        /// Requests in the batch.
        total: usize,
    },
    /// Joining a multicast group failed: a member did not join in time, or joined with
    /// different settings.
    #[error("group {group}: {reason}")]
    GroupJoin {
        /// The group's name.
        group: String,
        /// What went wrong, naming the member and the setting.
        reason: String,
    },
    /// A member of a multicast group failed (died, left, or stopped answering): the group
    /// cannot go on. Membership changes are not supported, so every later call fails too.
    #[error("group {}: member {} failed: {}", .0.group, .0.member, .0.reason)]
    GroupMemberFailed(Box<MemberFailure>),
    /// A multicast group operation was refused (payload too large, group left).
    #[error("group {group}: {reason}")]
    Group {
        /// The group's name.
        group: String,
        /// Why.
        reason: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What the engine was doing.
        context: String,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
}

/// Which member of which group failed, and how (see [`Error::GroupMemberFailed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberFailure {
    /// The group's name.
    pub group: String,
    /// The member's segment name.
    pub member: String,
    /// What this engine saw.
    pub reason: String,
}

impl Error {
    /// Wraps an OS error with what the engine was doing when it happened.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    pub(crate) fn invalid(arg: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            arg,
            reason: reason.into(),
        }
    }
}

/// Result with the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
