//! Weft: an NCCL network plugin over libfabric.
//!
//! This crate builds `libnccl_net_weft.so`. The NCCL plugin tables it exports
//! are generated from version descriptors (see `ARCHITECTURE.md`); the crate
//! itself is the version-free core: fabric wrappers, logging, configuration.

pub mod config;
pub mod device;
pub mod fabric;
pub mod log;
