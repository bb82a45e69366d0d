//! Weft's error type and the result classes adapters map to `ncclResult_t`,
//! shared by the core and every protocol.

#![forbid(unsafe_code)]

use crate::config::ConfigError;
use crate::device::DiscoveryError;
use crate::fabric::FiError;

/// The class of a failure, which decides the `ncclResult_t` an adapter returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// OS, libfabric or hardware failure -> `ncclSystemError`.
    System,
    /// NCCL misused the API (bad pointer, size, state) -> `ncclInternalError`.
    Internal,
    /// User or configuration error -> `ncclInvalidUsage`.
    InvalidUsage,
    /// The peer failed or sent garbage -> `ncclRemoteError` (`ncclSystemError`
    /// for NCCL releases without it).
    Remote,
}

/// A core failure: its class and a message that says what, why and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct Error {
    /// The class.
    pub code: Code,
    /// The message.
    pub msg: String,
}

impl Error {
    /// A system failure.
    pub fn system(msg: impl Into<String>) -> Self {
        Self {
            code: Code::System,
            msg: msg.into(),
        }
    }
    /// NCCL misuse.
    pub fn internal(msg: impl Into<String>) -> Self {
        Self {
            code: Code::Internal,
            msg: msg.into(),
        }
    }
    /// A configuration or usage error.
    pub fn usage(msg: impl Into<String>) -> Self {
        Self {
            code: Code::InvalidUsage,
            msg: msg.into(),
        }
    }
    /// A peer failure.
    pub fn remote(msg: impl Into<String>) -> Self {
        Self {
            code: Code::Remote,
            msg: msg.into(),
        }
    }
    /// Prefixes the message with what was being done.
    pub fn context(mut self, what: impl std::fmt::Display) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }
}

impl From<FiError> for Error {
    fn from(e: FiError) -> Self {
        Self::system(e.to_string())
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Self::usage(e.to_string())
    }
}

impl From<DiscoveryError> for Error {
    fn from(e: DiscoveryError) -> Self {
        Self::system(e.to_string())
    }
}

/// The core's result type.
pub type Result<T> = std::result::Result<T, Error>;
