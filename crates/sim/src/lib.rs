//! multirail-sim: a discrete-event simulator that drives the real `multirail-policy` structs
//! (slicing, the DeviceSelector, the per-peer dispatcher with its QoS queues, windows and rail
//! health) in virtual time over modelled NICs, links that fail, recover or change rate, and
//! workloads, from scenario files. It depends on the policy crate, never on the engine: what it
//! shows at cluster scale is what the engine's own decisions do.
//!
//! A lanes scenario ([`scenario::LanesScenario`], simulated in [`lanes`]) models processes
//! instead of rails: each drives its own `UsageTracker` and two `Lanes` machines (one asking
//! for lanes for what it sends, one granting lanes for what it receives), and they negotiate
//! dedicated lanes over a modelled network. A multicast scenario
//! ([`scenario::MulticastScenario`], simulated in [`multicast`]) models a group sending over
//! one-sided writes with the real `coalesce` planners deciding pushes and acknowledgements.

pub mod lanes;
pub mod model;
pub mod multicast;
pub mod report;
pub mod scenario;

pub use model::simulate;
pub use report::{plot, Report};
pub use scenario::{parse_runs, Run, ScenarioError};
