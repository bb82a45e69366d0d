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

/// What went wrong, for a program to match on; the [`Code`] says which
/// `ncclResult_t` NCCL gets, the message says the rest to a person.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// The peer was declared dead: silent for `WEFT_PEER_TIMEOUT`, or the
    /// provider failed its connection.
    PeerDead,
    /// The peer closed its comm, and what was asked of it can never come.
    PeerClosed,
    /// A message larger than the receive buffer it was meant for.
    Truncated,
    /// A pointer NCCL passed names no live Weft object (context, comm,
    /// memory handle, request): stale, foreign or garbage.
    BadHandle,
    /// A buffer outside its memory handle's registered range, or a size or
    /// count Weft cannot take.
    BadBuffer,
    /// A listen handle that is corrupted, foreign, or of another format,
    /// protocol or device shape.
    BadListenHandle,
    /// The peer sent what the protocol does not allow (forged, malformed or
    /// out of order).
    Protocol,
    /// A libfabric call failed: its error number (`FI_ETRUNC`, …; the call
    /// returned it negated).
    Provider(u32),
    /// The configuration (a `WEFT_*` value, or the provider it asks for).
    Config,
    /// Anything else.
    Other,
}

/// A core failure: its class, its kind, a message that says what, why and
/// what to do, and the error it came from.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{msg}")]
pub struct Error {
    /// The class.
    pub code: Code,
    /// The kind.
    pub kind: Kind,
    /// The message.
    pub msg: String,
    /// The lower layer's error this one came from.
    #[source]
    pub source: Option<std::sync::Arc<dyn std::error::Error + Send + Sync>>,
}

impl Error {
    fn new(code: Code, kind: Kind, msg: impl Into<String>) -> Self {
        Self {
            code,
            kind,
            msg: msg.into(),
            source: None,
        }
    }
    /// A system failure.
    pub fn system(msg: impl Into<String>) -> Self {
        Self::new(Code::System, Kind::Other, msg)
    }
    /// NCCL misuse.
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::new(Code::Internal, Kind::Other, msg)
    }
    /// A configuration or usage error.
    pub fn usage(msg: impl Into<String>) -> Self {
        Self::new(Code::InvalidUsage, Kind::Other, msg)
    }
    /// A peer failure.
    pub fn remote(msg: impl Into<String>) -> Self {
        Self::new(Code::Remote, Kind::Other, msg)
    }
    /// A pointer NCCL passed that names no live Weft object.
    pub fn bad_handle(msg: impl Into<String>) -> Self {
        Self::new(Code::Internal, Kind::BadHandle, msg)
    }
    /// A buffer, size or count Weft cannot take.
    pub fn bad_buffer(msg: impl Into<String>) -> Self {
        Self::new(Code::Internal, Kind::BadBuffer, msg)
    }
    /// A listen handle Weft cannot connect with.
    pub fn bad_listen_handle(msg: impl Into<String>) -> Self {
        Self::new(Code::Internal, Kind::BadListenHandle, msg)
    }
    /// The peer was declared dead.
    pub fn peer_dead(msg: impl Into<String>) -> Self {
        Self::new(Code::Remote, Kind::PeerDead, msg)
    }
    /// The peer closed its comm.
    pub fn peer_closed(msg: impl Into<String>) -> Self {
        Self::new(Code::Remote, Kind::PeerClosed, msg)
    }
    /// The peer broke the protocol.
    pub fn protocol(msg: impl Into<String>) -> Self {
        Self::new(Code::Remote, Kind::Protocol, msg)
    }
    /// A message larger than its receive buffer (`ncclInternalError`: NCCL
    /// never sends more than the receiver posted).
    pub fn truncated(msg: impl Into<String>) -> Self {
        Self::new(Code::Internal, Kind::Truncated, msg)
    }
    /// The same error, caused by `e` (kept as its source).
    fn caused_by(mut self, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(std::sync::Arc::new(e));
        self
    }
    /// The same error, of kind `kind`.
    pub fn of_kind(mut self, kind: Kind) -> Self {
        self.kind = kind;
        self
    }
    /// Prefixes the message with what was being done.
    pub fn context(mut self, what: impl std::fmt::Display) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }
}

impl PartialEq for Error {
    /// Code, kind and message (the source is not compared).
    fn eq(&self, other: &Self) -> bool {
        (self.code, self.kind, &self.msg) == (other.code, other.kind, &other.msg)
    }
}

impl From<FiError> for Error {
    fn from(e: FiError) -> Self {
        Self::new(Code::System, Kind::Provider(e.code), e.to_string()).caused_by(e)
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Self::new(Code::InvalidUsage, Kind::Config, e.to_string()).caused_by(e)
    }
}

impl From<DiscoveryError> for Error {
    fn from(e: DiscoveryError) -> Self {
        Self::system(e.to_string()).caused_by(e)
    }
}

/// The core's result type.
pub type Result<T> = std::result::Result<T, Error>;
