//! What Weft's own tests use and NCCL never does (cargo feature `testing`,
//! which only the `weft-tests` crate turns on): hooks into live comms and
//! devices, and the control-message framing a forged third party needs to
//! speak Weft's wire format. Nothing here is reachable through the exported
//! C tables.

#![forbid(unsafe_code)]

pub use crate::core::hooks::{endpoint_open, hold_comm, virt_addr, wire_id};
pub use crate::proto::ctrl::{frame, unframe, CTRL_HEAD};
