//! The core's test hooks (cargo feature `testing`, re-exported by
//! `crate::testing`): what the tests ask of a comm or a device that NCCL
//! never asks.

#![forbid(unsafe_code)]

use super::*;

/// Whether device `dev` addresses remote registrations by virtual address
/// (`FI_MR_VIRT_ADDR`) rather than by offset.
pub fn virt_addr(dev: i32) -> Result<bool> {
    Ok(physical(&*plugin()?, dev)?.virt_addr())
}

/// Evaluates `$call` with `$c` bound to send or receive comm `$comm`,
/// whichever it is (the test hooks ask both kinds the same thing).
macro_rules! on_comm {
    ($comm:expr, |$c:ident| $call:expr) => {
        if let Some(s) = REG.send.get($comm) {
            let $c = &s.comm;
            Ok($call)
        } else if let Some(r) = REG.recv.get($comm) {
            let $c = &r.comm;
            Ok($call)
        } else {
            Err(Error::bad_handle(format!("{:p} is not a live comm", $comm)))
        }
    };
}

/// holds the state lock of send or receive comm `comm`, as a
/// keeper stuck inside the provider would, until `release` fires; `held` is
/// signalled once it is held. NCCL's calls on that comm must not wait.
pub fn hold_comm(
    comm: *mut c_void,
    held: &std::sync::mpsc::Sender<()>,
    release: &std::sync::mpsc::Receiver<()>,
) -> Result<()> {
    on_comm!(comm, |c| c.hold(held, release))
}

/// whether send or receive comm `comm`'s endpoint is still open,
/// i.e. whether the provider may still own buffers posted on it.
pub fn endpoint_open(comm: *mut c_void) -> Result<bool> {
    on_comm!(comm, |c| c.endpoint_open())
}

/// send or receive comm `comm`'s id and token on its device's
/// shared endpoint (what a third party would have to learn to speak for it).
pub fn wire_id(comm: *mut c_void) -> Result<Option<(u32, u32)>> {
    on_comm!(comm, |c| c.wire_id())
}
