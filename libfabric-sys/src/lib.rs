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

/// The oldest libfabric API version Weft asks for: 1.17, the oldest
/// supported release (Debian 12); newer libraries accept older requested
/// versions. [`api_version`] is what Weft asks for on this host.
pub const WEFT_FI_VERSION: u32 = make_version(1, 17);

/// The API version that brought DMA-BUF registration (`FI_MR_DMABUF`):
/// libfabric reads `fi_mr_attr.dmabuf` only from callers that asked for it.
pub const DMABUF_FI_VERSION: u32 = make_version(1, 20);

/// Whether the headers these bindings come from know DMA-BUF registration
/// (`struct fi_mr_dmabuf`, `FI_MR_DMABUF`: libfabric 1.20+).
pub const HAS_MR_DMABUF: bool = cfg!(fi_mr_dmabuf);

/// Whether those headers know `FI_OPT_CUDA_API_PERMITTED` (1.18+).
pub const HAS_OPT_CUDA_API_PERMITTED: bool = cfg!(fi_opt_cuda_api_permitted);

/// The version of the headers these bindings come from.
pub const HEADERS_FI_VERSION: u32 = make_version(FI_MAJOR_VERSION, FI_MINOR_VERSION);

/// A version number (`FI_VERSION(major, minor)`) as "major.minor".
pub fn version_text(v: u32) -> String {
    format!("{}.{}", v >> 16, v & 0xffff)
}

/// The version of the libfabric running in this process.
pub fn running_version() -> u32 {
    // SAFETY: fi_version takes no arguments and only reads a constant.
    unsafe { fi_version() }
}

/// Whether both these headers and the running library know DMA-BUF
/// registration (`FI_MR_DMABUF`, 1.20+).
pub fn dmabuf_known() -> bool {
    HAS_MR_DMABUF && running_version() >= DMABUF_FI_VERSION
}

/// The API version Weft asks for: 1.20 where both these headers and the
/// running library know DMA-BUF registration (so that libfabric honours
/// it), else 1.17. The `fi_mr_attr` Weft passes is always the headers' own,
/// which is at least as large as what either version reads.
pub fn api_version() -> u32 {
    if dmabuf_known() {
        DMABUF_FI_VERSION
    } else {
        WEFT_FI_VERSION
    }
}

/// Sets `fi_mr_attr`'s iovec array: a plain field up to 1.19, one arm of a
/// union (with `dmabuf`) since 1.20.
pub fn set_mr_iov(attr: &mut fi_mr_attr, iov: *const iovec) {
    #[cfg(fi_mr_dmabuf)]
    {
        attr.__bindgen_anon_1.mr_iov = iov;
    }
    #[cfg(not(fi_mr_dmabuf))]
    {
        attr.mr_iov = iov;
    }
}

/// A DMA-BUF range to register (`struct fi_mr_dmabuf`, whatever the headers).
#[derive(Debug, Clone, Copy)]
pub struct DmabufRange {
    /// The DMA-BUF's file descriptor (the caller keeps it open for the call).
    pub fd: i32,
    /// Where the registration starts within the DMA-BUF.
    pub offset: u64,
    /// Bytes to register from there.
    pub len: usize,
    /// The virtual address of the DMA-BUF's start (offset 0), or NULL.
    pub base_addr: *mut std::ffi::c_void,
}

/// `fi_mr_regattr(domain, attr, flags | FI_MR_DMABUF, mr)` with `attr`'s
/// memory given as `range`; `-FI_ENOSYS` where these headers have no
/// DMA-BUF registration ([`HAS_MR_DMABUF`]).
///
/// # Safety
/// As for `fi_mr_regattr`: `domain` is live and `mr` writable; the range is
/// DMA-BUF memory that stays valid until the region is closed.
pub unsafe fn mr_regattr_dmabuf(
    domain: *mut fid_domain,
    attr: &mut fi_mr_attr,
    range: &DmabufRange,
    flags: u64,
    mr: *mut *mut fid_mr,
) -> std::os::raw::c_int {
    #[cfg(fi_mr_dmabuf)]
    {
        let d = fi_mr_dmabuf {
            fd: range.fd,
            offset: range.offset,
            len: range.len,
            base_addr: range.base_addr,
        };
        attr.__bindgen_anon_1.dmabuf = &d;
        attr.iov_count = 1;
        fi_mr_regattr(domain, attr, flags | FI_MR_DMABUF, mr)
    }
    #[cfg(not(fi_mr_dmabuf))]
    {
        let _ = (domain, attr, range, flags, mr);
        -(FI_ENOSYS as std::os::raw::c_int)
    }
}

/// `FI_OPT_CUDA_API_PERMITTED` where the headers know it.
pub const OPT_CUDA_API_PERMITTED: Option<std::os::raw::c_int> = {
    #[cfg(fi_opt_cuda_api_permitted)]
    {
        Some(FI_OPT_CUDA_API_PERMITTED as std::os::raw::c_int)
    }
    #[cfg(not(fi_opt_cuda_api_permitted))]
    {
        None
    }
};

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
