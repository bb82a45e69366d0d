//! What a buffer is: host memory or a CUDA device's. A leaf, so that the
//! freelists, the registration cache and the CUDA driver binding can all
//! speak of it without using one another.

#![forbid(unsafe_code)]

/// What a buffer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Host memory (pageable or pinned).
    Host,
    /// CUDA device memory of this device ordinal.
    Cuda(i32),
}
