//! Safe RAII wrappers over libfabric.
//!
//! Ownership mirrors libfabric's close order: every object holds an `Arc` to
//! what it was opened on (endpoint -> CQ, AV -> domain -> fabric), so dropping
//! them in any order closes children before parents. Every negative return
//! becomes a [`FiError`] naming the call and carrying `fi_strerror` text.
//!
//! All domains are opened `FI_THREAD_SAFE`, which is what makes these types
//! `Send + Sync`.

mod av;
mod cq;
mod domain;
mod ep;
mod error;
mod info;
pub mod local;
mod mr;

pub use av::{Av, FiAddr};
pub use cq::{Completion, CompletionError, Cq, CqError};
pub use domain::{Domain, Fabric};
pub use ep::Endpoint;
pub use error::{strerror, FiError};
pub use info::{Hints, InfoList, InfoRef, OwnedInfo};
pub use mr::{DomainRegistrar, Mr, ACCESS_ALL};

/// Provider names as libfabric spells them.
pub mod provider {
    /// TCP through the RxM utility provider (reliable datagrams over TCP).
    pub const TCP_RXM: &str = "tcp;ofi_rxm";
    /// Shared memory (single host).
    pub const SHM: &str = "shm";
}
