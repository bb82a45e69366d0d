//! Weft: an NCCL network plugin over libfabric.
//!
//! This crate builds `libnccl_net_weft.so`. The NCCL plugin tables it exports
//! are generated from version descriptors (see `ARCHITECTURE.md`); the crate
//! itself is the version-free core: fabric wrappers, logging, configuration.
//!
//! Exports: rustc links a cdylib with its own version script that makes every
//! symbol local except `#[no_mangle]` public items, and the only such items in
//! Weft are the `ncclNetPlugin_vN` / `ncclCollNetPlugin_vN` tables. (A second
//! version script of ours cannot narrow rustc's: ld lets its explicit `global`
//! names win.) `tests/tests/symbols.rs` runs `nm -D --defined-only` on the
//! built library and fails on any other exported symbol.

pub mod config;
pub mod core;
pub mod device;
pub mod fabric;
pub mod freelist;
pub mod log;
pub mod mr;
pub mod proto;
