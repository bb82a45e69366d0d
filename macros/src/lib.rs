//! Proc macros that read a version descriptor (`weft-api`) and emit the
//! `#[repr(C)]` types, the `extern "C"` adapters and the exported
//! `ncclNetPlugin_vN` / `ncclCollNetPlugin_vN` tables.
//!
//! The macros land with the version machinery; this crate exists so the
//! workspace has its final shape. It exports nothing yet.
