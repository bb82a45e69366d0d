//! Protocols over libfabric. `wire` is the pure encoding; `sendrecv` is the
//! tagged-message protocol (the only one in this build).

pub mod sendrecv;
pub mod wire;
