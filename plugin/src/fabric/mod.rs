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

pub use av::FiAddr;
pub use cq::{is_remote_write, Completion, CompletionError, Cq, CqError};
pub use domain::{Domain, DomainOptions};
pub use ep::Endpoint;
pub use error::{breaks_connection, strerror, FiError};
pub use info::{Hints, InfoList, InfoRef, OwnedInfo};
pub use mr::{Mr, ACCESS_ALL};

/// Provider settings Weft chooses where the operator set none: (variable,
/// value, why). libfabric reads them once per process, at its first
/// `fi_getinfo`, so [`provider_defaults`] runs before Weft's first.
pub const PROVIDER_DEFAULTS: &[(&str, &str, &str)] = &[(
    "FI_OFI_RXM_MSG_RX_SIZE",
    "256",
    "rxm posts this many 16 KiB bounce buffers per endpoint (4096 by default on tcp: ~70 MB per endpoint); \
     Weft keeps 256 control receives posted per endpoint and bounds what peers send ahead by credits",
)];

/// Sets each of [`PROVIDER_DEFAULTS`] the environment leaves unset (once
/// per process, at the first `init`, before Weft's first `fi_getinfo`; an
/// INFO line names each). If libfabric was already initialised in this
/// process by someone else, they have no effect.
///
/// libfabric takes these settings from the environment alone (rxm reads
/// `msg_rx_size` once, when the provider loads, and no hint or `fi_setopt`
/// reaches it), so this is the one place Weft changes the process's
/// environment. Why that is a hazard, and when it is not: glibc's `setenv`
/// takes a lock that `getenv` does not; adding a variable copies the
/// environment array into a new one, and the old array is freed only when
/// an earlier `setenv`/`putenv` in the process had already replaced the
/// original. So a thread reading the environment at that instant reads
/// freed memory only if the process had already grown its environment
/// (Python's `os.environ` assignments do) and another thread calls `getenv`
/// in that instant. It happens before any thread of Weft's exists. An
/// operator who wants no such window exports the variable in the job's
/// environment (any value, e.g. Weft's `256`): then nothing is set.
pub fn provider_defaults() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (var, value, why) in PROVIDER_DEFAULTS {
            if std::env::var_os(var).is_none() {
                // The one write to the environment (see above).
                std::env::set_var(var, value);
                tracing::info!(
                    target: "weft::init",
                    "{var}={value} (Weft's default: {why}); export it in the job's environment to override, \
                     or to keep Weft from setting it"
                );
            }
        }
    });
}

/// The largest message libfabric's rxm sends eagerly (its `buffer_size`,
/// `FI_OFI_RXM_BUFFER_SIZE`, 16 KiB by default in 1.17 and 2.x); anything
/// larger goes as a rendezvous: a request first, the data read by the
/// receiver once a receive matches it.
pub fn rxm_eager_limit() -> usize {
    std::env::var("FI_OFI_RXM_BUFFER_SIZE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(16 << 10)
}

/// `FI_MR_ENDPOINT`: binds `domain`'s registrations to `ep` from now on
/// (Weft binds them to each device's passive hub endpoint; exported for
/// tests of the fabric layer). `ep` must outlive them.
#[cfg(feature = "testing")]
pub fn bind_registrations_to(domain: &Domain, ep: &Endpoint) {
    domain.set_mr_endpoint(ep.raw());
}

/// Provider names as libfabric spells them.
pub mod provider {
    /// Shared memory (single host).
    pub const SHM: &str = "shm";
}
