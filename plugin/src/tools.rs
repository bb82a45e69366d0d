//! What the two programs shipped beside the plugin use of it: `weft` (the
//! operator's `weft info` and `weft bench`) and `weft-reducer` (a CollNet
//! reduction server).
//! Everything else in the crate is private to the shipped library (see the
//! `layers!` list in lib.rs); this module names the few items the programs
//! need, so that what they depend on is one short list.

#![forbid(unsafe_code)]

pub use crate::collnet::reducer::Reducer;
pub use crate::config::{Config, Source};
pub use crate::core::{finalize, init, properties, protocol_name, InitArgs};
pub use crate::device::{survey, Outcome};
pub use crate::gpu::driver as gpu_driver;
pub use crate::log::to_stderr as log_to_stderr;
pub use crate::nccl::{hex, unhex};
pub use crate::proto::choose as choose_protocol;

/// A `kB` field of this process's /proc/self/status (`VmRSS`, `VmHWM`,
/// ...); 0 if absent: what `weft bench` reports of its processes' memory.
pub fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// `/proc/loadavg` as it reads, or "unknown": how busy the host was while
/// `weft bench` measured.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// What `weft bench` measures Weft against: raw libfabric on the device
/// Weft itself would use (`survey`), through Weft's own thin wrappers.
pub mod fabric {
    pub use crate::device::Device;
    pub use crate::fabric::{
        is_remote_write, Completion, Domain, Endpoint, FiAddr, FiError, Mr, ACCESS_ALL,
    };
}
