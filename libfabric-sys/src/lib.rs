//! Raw libfabric bindings, generated at build time by bindgen against the
//! libfabric that pkg-config finds (>= 1.17). The `static inline` calls of the
//! libfabric headers (`fi_domain`, `fi_tsend`, `fi_cq_read`, ...) are compiled
//! into small C wrappers by the build script, so they are callable from Rust
//! under their usual names.
//!
//! Everything here is `unsafe` and mirrors the C API one to one; the safe
//! wrappers live in the `weft` crate (`plugin/src/fabric/`).

#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case)]
#![allow(
    missing_debug_implementations,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]
#![allow(unsafe_op_in_unsafe_fn)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// `FI_VERSION(major, minor)`: a function-like macro, which bindgen cannot bind.
pub const fn make_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

/// `FI_ADDR_NOTAVAIL`: `((uint64_t) -1)`, a cast bindgen cannot evaluate.
pub const FI_ADDR_NOTAVAIL: fi_addr_t = u64::MAX;
/// `FI_ADDR_UNSPEC`: same value, "any source" for receives.
pub const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;
/// `FI_KEY_NOTAVAIL`: `((uint64_t) -1)`.
pub const FI_KEY_NOTAVAIL: u64 = u64::MAX;

/// The libfabric API version Weft asks for. 1.17 is the oldest supported
/// release (Debian 12); newer libraries accept older requested versions.
pub const WEFT_FI_VERSION: u32 = make_version(1, 17);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_and_reports_a_version() {
        // SAFETY: fi_version takes no arguments and only reads a constant.
        let v = unsafe { fi_version() };
        assert!(
            v >= WEFT_FI_VERSION,
            "libfabric {:#x} is older than 1.17",
            v
        );
    }

    #[test]
    fn strerror_is_text() {
        // SAFETY: fi_strerror returns a pointer to a static, NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(fi_strerror(FI_EAGAIN as i32)) };
        assert!(!s.to_bytes().is_empty());
    }
}
