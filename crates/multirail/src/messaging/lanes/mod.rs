//! The lane kinds, one file each, all behind [`super::lane::SendLane`] and
//! [`super::lane::RecvLane`]:
//!
//! * `tcp`: frames on a socket, credits back in frames on it;
//! * `duplex`: a dedicated tcp lane each way on one socket, credits riding in frame headers;
//! * `shm`: a sender's own grant and completion ring in the receiver's memory;
//! * `shared_shm`: one multi-producer ring per receiver for every sender on the shared lane;
//! * `rdma`: SENDs on a reliable-connected queue pair, credits as RDMA writes.
//!
//! `ring` and `shared_ring` are the shm lanes' ring layouts.

pub(super) mod duplex;
pub(super) mod rdma;
pub(super) mod ring;
pub(super) mod shared_ring;
pub(super) mod shared_shm;
pub(super) mod shm;
pub(super) mod tcp;
