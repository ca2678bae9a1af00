//! multirail: a transfer engine that moves bytes between the registered memory of processes,
//! over shared memory on one host, TCP over every rail across hosts, and RDMA verbs where the
//! hosts have it. The user guide and references are in the repository's `docs/`.
//!
//! ```no_run
//! use multirail::{Config, Engine, Location, Request};
//! let target = Engine::new(Config::default(), "127.0.0.1:0")?;
//! let dst = target.allocate(1 << 20, Location::Any)?;
//!
//! let engine = Engine::new(Config::default(), "127.0.0.1:0")?;
//! let src = engine.allocate(1 << 20, Location::Any)?;
//! let seg = engine.open_segment(&target.name())?;
//! let batch = engine.allocate_batch(1)?;
//! engine.submit(batch, &[Request::write(src.addr(), seg, dst.addr(), 1 << 20)])?;
//! engine.wait(batch, None)?;
//! engine.free_batch(batch)?;
//! # Ok::<(), multirail::Error>(())
//! ```

pub(crate) mod access;
pub mod batch;
pub(crate) mod cadence;
pub mod config;
pub(crate) mod core_share;
pub mod engine;
pub mod error;
pub mod group;
pub(crate) mod listener;
pub(crate) mod mapping;
pub mod memory;
pub mod messaging;
pub mod metadata;
pub mod metrics_http;
pub(crate) mod peer;
pub(crate) mod protocol;
pub mod qos;
pub(crate) mod rails;
pub mod segment;
pub mod server;
pub mod slots;
pub(crate) mod spin;
pub mod stats;
pub mod topology;
pub mod transport;
pub(crate) mod upkeep;

pub use batch::Status;
pub use config::{Config, ConfigError, TransportChoice};
pub use engine::{
    BatchId, Engine, PreparedEntry, PreparedListId, RailHealth, Request, SegmentId, PRIO_HIGH,
    PRIO_LOW, PRIO_MEDIUM,
};
pub use error::{Error, Result};
pub use group::{Delivery, Group, GroupConfig, GroupMessage, GroupStats};
pub use memory::{Buffer, Location};
pub use messaging::{Lane, LanesReport, Message, MessageStats, Notification, PeerLaneReport};
pub use metadata::{MetadataStats, StoreState};
pub use metrics_http::MetricsServer;
pub use multirail_policy::lanes::LanesStats;
pub use multirail_policy::qos::Priority;
pub use qos::{PriorityTraffic, QosTraffic};
pub use server::ConnectionStats;
pub use stats::{
    RailTraffic, ServedCount, ServedLatency, ServedOpTraffic, ServedPeerTraffic, ServedRailTraffic,
    ServedTraffic, Traffic, MAX_SERVED_PEERS,
};
pub use transport::rdma::{probe as rdma_probe, RdmaProbe, RdmaStats};
pub use transport::Opcode;

/// The Rust examples of the README and the user guide, compiled and run by `cargo test --doc`
/// so that a change to the API or its behaviour cannot leave the documentation behind.
#[cfg(doctest)]
mod documentation_examples {
    #[doc = include_str!("../../../README.md")]
    struct Readme;
    #[doc = include_str!("../../../docs/guide/index.md")]
    struct GuideIndex;
    #[doc = include_str!("../../../docs/guide/segments-and-buffers.md")]
    struct GuideSegmentsAndBuffers;
    #[doc = include_str!("../../../docs/guide/batches.md")]
    struct GuideBatches;
    #[doc = include_str!("../../../docs/guide/prepared-lists.md")]
    struct GuidePreparedLists;
    #[doc = include_str!("../../../docs/guide/rails.md")]
    struct GuideRails;
    #[doc = include_str!("../../../docs/guide/priorities.md")]
    struct GuidePriorities;
    #[doc = include_str!("../../../docs/guide/messages.md")]
    struct GuideMessages;
    #[doc = include_str!("../../../docs/guide/lanes.md")]
    struct GuideLanes;
    #[doc = include_str!("../../../docs/guide/groups.md")]
    struct GuideGroups;
    #[doc = include_str!("../../../docs/guide/metadata.md")]
    struct GuideMetadata;
    #[doc = include_str!("../../../docs/guide/membership.md")]
    struct GuideMembership;
}
