//! No code. This crate exists for its `Cargo.toml`: it makes single-package builds (the C API
//! library, the Python extension, the RDMA test binary) resolve dependency features as the
//! workspace build does, so they reuse its compiled crates. See that file for why.
