//! What goes over an engine's connections before any transport takes them: the frame codec
//! (`wire`: versioned, length-checked headers) and the membership handshake every connection
//! opens with (`handshake`). A layer of its own, under the metadata stores (which query
//! segments over it in peer-to-peer mode), the transports and the listener; it uses only
//! `error` and `segment`. `transport` re-exports both modules, so `transport::wire` and
//! `transport::handshake` name them too.

pub mod handshake;
pub mod wire;
