//! The C types of NCCL's declarations, under the names the version
//! descriptors use. The generated tables spell every type that is not a
//! struct of the descriptor as `adapter::ctypes::<name>`, so a type a new
//! NCCL version introduces is one line here (rustc names it otherwise:
//! "cannot find type `x` in module `ctypes`").

#![forbid(unsafe_code)]
#![allow(non_camel_case_types)]

// A namespace for the generated tables: a type no current version uses is
// still here for the next one.
#[allow(unused_imports)]
pub use std::ffi::{c_char, c_int, c_long, c_uint, c_ulong, c_void};
#[allow(unused_imports)]
pub use std::primitive::{bool, f32, f64, i16, i32, i64, i8, isize, u16, u32, u64, u8, usize};

/// `ncclResult_t` (a C enum: `int`).
pub type ncclResult_t = c_int;
/// `ncclDataType_t` (a C enum).
pub type ncclDataType_t = c_int;
/// `ncclRedOp_t` (a C enum).
pub type ncclRedOp_t = c_int;
/// `ncclNetDeviceType` (a C enum).
pub type ncclNetDeviceType = c_int;
/// `ncclDebugLogger_t`: NCCL's logger, a nullable function pointer.
pub type ncclDebugLogger_t = Option<super::Logger>;
/// `ncclProfilerCallback_t` (v10+): a function pointer Weft keeps opaque
/// (it reports no profiler events).
pub type ncclProfilerCallback_t = *mut c_void;
