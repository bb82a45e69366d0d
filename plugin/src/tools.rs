//! What the two programs shipped beside the plugin use of it: `weft` (the
//! operator's `weft info`) and `weft-reducer` (a CollNet reduction server).
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
pub use crate::nccl::hex;
pub use crate::proto::choose as choose_protocol;
