//! What the generated adapters call: the C boundary (panics, result codes,
//! NULL checks), argument conversions, and one function per table member in
//! the newest API's terms. Argument structs are named after NCCL's C argument
//! names; a version that lacks an argument gets the default (NULL, 0).

use std::ffi::{c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub use crate::core::Properties;
use crate::core::{self, Error, Result};

/// The table name (NCCL 2.12 matches `NCCL_NET` case-sensitively).
pub const NAME: &CStr = c"Weft";

/// NCCL's logger type.
pub type Logger = crate::log::NcclDebugLogger;

/// The `ncclResult_t` values one API version's NCCL knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Results {
    /// `ncclSystemError`.
    pub system: c_int,
    /// `ncclInternalError`.
    pub internal: c_int,
    /// `ncclInvalidUsage`.
    pub invalid_usage: c_int,
    /// `ncclRemoteError`, or `ncclSystemError` where the release lacks it.
    pub remote: c_int,
}

impl Results {
    /// The codes Weft returns, looked up by name in a descriptor's
    /// `results` (every code that version's NCCL knows). Evaluated at
    /// compile time by the generated tables: a descriptor lacking one of
    /// the codes Weft needs fails the build, naming it.
    pub const fn from_codes(codes: &[(&str, i64)]) -> Results {
        let Some(system) = code(codes, "ncclSystemError") else {
            panic!("the descriptor lacks ncclSystemError")
        };
        let Some(internal) = code(codes, "ncclInternalError") else {
            panic!("the descriptor lacks ncclInternalError")
        };
        let Some(invalid_usage) = code(codes, "ncclInvalidUsage") else {
            panic!("the descriptor lacks ncclInvalidUsage")
        };
        let remote = match code(codes, "ncclRemoteError") {
            Some(c) => c,
            None => system,
        };
        Results {
            system,
            internal,
            invalid_usage,
            remote,
        }
    }
}

/// The value of code `name` in `codes` (a const fn: no `==` on `str`).
const fn code(codes: &[(&str, i64)], name: &str) -> Option<c_int> {
    let mut i = 0;
    while i < codes.len() {
        let (n, v) = codes[i];
        if n.len() == name.len() {
            let (a, b) = (n.as_bytes(), name.as_bytes());
            let mut j = 0;
            while j < a.len() && a[j] == b[j] {
                j += 1;
            }
            if j == a.len() {
                return Some(v as c_int);
            }
        }
        i += 1;
    }
    None
}

/// Runs one adapter body: catches panics, logs failures with what failed,
/// and maps the error class to this version's code.
pub fn boundary(codes: &Results, what: &str, f: impl FnOnce() -> Result<()>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            tracing::warn!("{what} failed: {e}");
            match e.code {
                core::Code::System => codes.system,
                core::Code::Internal => codes.internal,
                core::Code::InvalidUsage => codes.invalid_usage,
                core::Code::Remote => codes.remote,
            }
        }
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            tracing::warn!(
                "{what}: internal error (a bug in Weft, please report it): panic: {msg}"
            );
            codes.internal
        }
    }
}

/// A NULL check for a pointer NCCL passes to be written through.
///
/// # Safety
/// `p` is NULL or points to a live, writable `T` that nothing else accesses
/// while the reference lives (NCCL's output arguments).
pub unsafe fn out_ref<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: non-NULL pointers NCCL passes for output point to a live T it owns.
    unsafe { p.as_mut() }.ok_or_else(|| Error::internal(format!("NULL `{what}` argument")))
}

/// Writes through an output pointer (see [`out_ref`]).
///
/// # Safety
/// As for [`out_ref`].
unsafe fn write<T>(p: *mut T, v: T, what: &str) -> Result<()> {
    // SAFETY: upheld by the caller.
    *unsafe { out_ref(p, what) }? = v;
    Ok(())
}

/// Declares argument structs whose fields default to NULL / 0.
macro_rules! args {
    ($($member:ident { $($field:ident: $ty:ty = $default:expr),* $(,)? })*) => {
        $(
            #[allow(non_camel_case_types, non_snake_case, missing_docs)]
            #[derive(Debug, Clone, Copy)]
            pub struct $member { $(pub $field: $ty),* }
            impl Default for $member {
                fn default() -> Self { Self { $($field: $default),* } }
            }
        )*
    };
}

mod conv;
pub use conv::*;
pub mod ctypes;
/// The value of each field of NCCL's props structs (see the module).
pub use crate::core::props::fields as props;

/// NCCL's connection handle buffer.
///
/// # Safety
/// `p` is NULL or NCCL's handle buffer of `NCCL_NET_HANDLE_MAXSIZE` bytes.
unsafe fn handle<'a>(p: *mut c_void) -> Result<&'a mut [u8; crate::nccl::HANDLE_SIZE]> {
    // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE (128) bytes.
    unsafe { p.cast::<[u8; crate::nccl::HANDLE_SIZE]>().as_mut() }
        .ok_or_else(|| Error::internal("NULL connection handle"))
}

fn ctx_or_process(ctx: *mut c_void) -> Result<*mut c_void> {
    if ctx.is_null() {
        core::process_ctx()
    } else {
        Ok(ctx)
    }
}

pub mod collnet;
pub mod net;
pub mod rma;
