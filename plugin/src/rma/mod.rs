//! NCCL's one-sided RMA plugin (`ncclRmaPlugin_v13` … `_v16`), beside
//! CollNet on the same core.
//!
//! What this build serves: the tables, generated from NCCL's RMA headers
//! like the net ones, with contexts (`init` per communicator, twice per
//! communicator in NCCL 2.30.7: every call is a context of its own),
//! `finalize`, and the devices' properties as GIN-proxy devices (the v13
//! loader checks `getProperties(0)` right after `init`). It claims **no
//! RMA device**: the data path (symmetric registrations, puts, signals,
//! gets, flushes) is not built yet, so [`devices`] reports 0 and says why
//! once per plugin start, and NCCL falls back to its own RMA backends
//! (NCCL disables an RMA plugin whose `devices` is 0). Every member that
//! needs an RMA device or an RMA object refuses its argument with an error
//! that says so: no listen comm, collComm, context, memory handle or
//! request of this module can exist, so any pointer NCCL passes for one is
//! not Weft's.
//!
//! Where a device would qualify once the data path exists is decided by
//! [`core::rma_memory`]: NCCL registers its signals, flush buffer and
//! windows as CUDA memory, so an RMA device must claim `NCCL_PTR_CUDA`
//! and have been opened with `FI_RMA`.

#![forbid(unsafe_code)]

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::core::{self, Error, Properties, Result};

/// The RMA devices this build claims: none (see the module). The reasons,
/// per physical device, go to NCCL's log once per plugin start.
pub fn devices() -> Result<usize> {
    let n = core::physical_devices()?;
    // One INFO line per start of the plugin (its devices are opened anew).
    static SAID: AtomicU64 = AtomicU64::new(0);
    let start = core::start_serial()?;
    if SAID.swap(start, Ordering::Relaxed) != start {
        let mut why = Vec::with_capacity(n);
        for d in 0..n {
            let memory = match core::rma_memory(d)? {
                Ok(()) => "takes NCCL's GPU memory".to_owned(),
                Err(e) => e,
            };
            why.push(format!("device {d}: {memory}"));
        }
        tracing::info!(
            target: "weft::init",
            "RMA: 0 devices (of {n}): this build serves the RMA tables without their data path \
             (symmetric registrations, puts, signals, gets), so NCCL uses its own RMA backends; {}",
            if why.is_empty() { "no devices".to_owned() } else { why.join("; ") }
        );
    }
    Ok(0)
}

/// `getProperties(dev)`: the physical device's properties as a GIN-proxy
/// device ([`core::props::for_rma`]).
pub fn get_properties<T>(dev: i32, fill: impl FnOnce(&Properties) -> Result<T>) -> Result<T> {
    core::with_rma_properties(dev, fill)
}

/// `listen(ctx, dev)`: refused, `dev` is no RMA device.
pub fn listen(ctx: *mut c_void, dev: i32) -> Result<()> {
    core::check_ctx(ctx)?;
    Err(Error::usage(format!(
        "RMA listen on device {dev}: Weft reported 0 RMA devices (its INFO line at init says why)"
    )))
}

/// The error for any pointer NCCL passes as an RMA object (`what`: a
/// listen comm, collComm, context, memory handle or request) to `call`:
/// none exists in this build, so it is not Weft's.
pub fn not_ours(call: &str, what: &str, p: *mut c_void) -> Error {
    Error::bad_handle(format!(
        "RMA {call}: {p:p} is not a live Weft RMA {what} (this build makes none: it claims no RMA device)"
    ))
}
