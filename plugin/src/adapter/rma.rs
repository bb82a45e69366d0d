//! The `ncclRma` members (v13 … v16): conversions to and from
//! [`crate::rma`]. v13 is GIN v13's table (its context argument is named
//! `ginCtx`, its `createContext` and `regMrSym*` have one more output, its
//! progress member is `ginProgress`, and every signal is strong); v15 adds
//! `optFlags`, a hint that changes no semantics; v16 adds
//! `getRmaProperties`.

#![allow(non_snake_case)]

use super::*;
use crate::rma;

/// Argument structs, one per member, fields named as in NCCL's headers.
#[allow(non_snake_case)]
pub mod args {
    use super::*;
    args! {
        init { ctx: *mut *mut c_void = NULL2, commId: u64 = 0, logFunction: Option<Logger> = None }
        devices { ndev: *mut c_int = std::ptr::null_mut() }
        getRmaProperties { collComm: *mut c_void = NULL, rmaProps: *mut RmaProperties = std::ptr::null_mut() }
        listen { ctx: *mut c_void = NULL, dev: c_int = 0, handle: *mut c_void = NULL, listenComm: *mut *mut c_void = NULL2 }
        connect { ctx: *mut c_void = NULL, handles: *mut *mut c_void = NULL2, nranks: c_int = 0, rank: c_int = 0,
                  listenComm: *mut c_void = NULL, collComm: *mut *mut c_void = NULL2 }
        createContext { collComm: *mut c_void = NULL, config: *mut c_void = NULL, rmaCtx: *mut *mut c_void = NULL2,
                        ginCtx: *mut *mut c_void = NULL2, devHandle: *mut *mut c_void = NULL2 }
        regMrSym { collComm: *mut c_void = NULL, data: *mut c_void = NULL, size: usize = 0, type_: c_int = 0,
                   mrFlags: u64 = 0, mhandle: *mut *mut c_void = NULL2, ginHandle: *mut *mut c_void = NULL2 }
        regMrSymDmaBuf { collComm: *mut c_void = NULL, data: *mut c_void = NULL, size: usize = 0, type_: c_int = 0,
                         offset: u64 = 0, fd: c_int = -1, mrFlags: u64 = 0, mhandle: *mut *mut c_void = NULL2,
                         ginHandle: *mut *mut c_void = NULL2 }
        deregMrSym { collComm: *mut c_void = NULL, mhandle: *mut c_void = NULL }
        destroyContext { rmaCtx: *mut c_void = NULL, ginCtx: *mut c_void = NULL }
        closeColl { collComm: *mut c_void = NULL }
        closeListen { listenComm: *mut c_void = NULL }
        iput { rmaCtx: *mut c_void = NULL, ginCtx: *mut c_void = NULL, context: c_int = 0, srcOff: u64 = 0,
               srcMhandle: *mut c_void = NULL, size: usize = 0, dstOff: u64 = 0, dstMhandle: *mut c_void = NULL,
               rank: u32 = 0, optFlags: u32 = 0, request: *mut *mut c_void = NULL2 }
        iputSignal { rmaCtx: *mut c_void = NULL, ginCtx: *mut c_void = NULL, context: c_int = 0, srcOff: u64 = 0,
                     srcMhandle: *mut c_void = NULL, size: usize = 0, dstOff: u64 = 0, dstMhandle: *mut c_void = NULL,
                     rank: u32 = 0, signalOff: u64 = 0, signalMhandle: *mut c_void = NULL, signalValue: u64 = 0,
                     signalOp: u32 = 0, isStrongSignal: bool = true, optFlags: u32 = 0,
                     request: *mut *mut c_void = NULL2 }
        iget { rmaCtx: *mut c_void = NULL, ginCtx: *mut c_void = NULL, context: c_int = 0, remoteOff: u64 = 0,
               remoteMhandle: *mut c_void = NULL, size: usize = 0, localOff: u64 = 0, localMhandle: *mut c_void = NULL,
               rank: u32 = 0, optFlags: u32 = 0, request: *mut *mut c_void = NULL2 }
        iflush { rmaCtx: *mut c_void = NULL, ginCtx: *mut c_void = NULL, context: c_int = 0, mhandle: *mut c_void = NULL,
                 rank: u32 = 0, request: *mut *mut c_void = NULL2 }
        test { collComm: *mut c_void = NULL, request: *mut c_void = NULL, done: *mut c_int = std::ptr::null_mut() }
        rmaProgress { rmaCtx: *mut c_void = NULL }
        ginProgress { ginCtx: *mut c_void = NULL }
        queryLastError { rmaCtx: *mut c_void = NULL, ginCtx: *mut c_void = NULL, hasError: *mut bool = std::ptr::null_mut() }
        finalize { ctx: *mut c_void = NULL }
    }
}

/// `ncclRmaProperties_v16_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RmaProperties {
    /// Whether any signal received makes every put received before it, from
    /// any peer, visible.
    pub flushes_all_puts_on_any_signal: bool,
}

/// The table's data members: the net table's (`name`).
pub use super::net::data;

/// The context argument: `rmaCtx` (v14+) or `ginCtx` (v13).
fn rma_ctx(rma: *mut c_void, gin: *mut c_void) -> *mut c_void {
    if rma.is_null() {
        gin
    } else {
        rma
    }
}

/// Writes NULL to each of NCCL's output slots that is not NULL itself, so
/// that a refused call leaves no stale value behind.
///
/// # Safety
/// Each slot is NULL or NCCL's output slot.
unsafe fn clear(slots: &[*mut *mut c_void]) {
    for &s in slots {
        // SAFETY: the caller's contract: NULL or NCCL's writable slot.
        if let Some(s) = unsafe { s.as_mut() } {
            *s = std::ptr::null_mut();
        }
    }
}

/// `init`: a context of its own for every call (NCCL 2.30.7 calls it once
/// for RMA and once more as its GIN proxy's backend, per communicator).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn init(a: args::init) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.ctx, "ctx")? };
    *out = std::ptr::null_mut();
    *out = core::init(core::InitArgs {
        logger: a.logFunction,
        profiler: None,
        comm_id: a.commId,
        traffic_class: -1,
    })?;
    Ok(())
}
/// `devices`: the RMA devices ([`rma::devices`]).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn devices(a: args::devices) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.ndev, "ndev")? };
    *out = 0;
    *out = c_int::try_from(rma::devices()?).unwrap_or(c_int::MAX);
    Ok(())
}
/// `getProperties`: `fill` writes the version's struct.
pub fn get_properties(dev: c_int, fill: impl FnOnce(&Properties) -> Result<()>) -> Result<()> {
    rma::get_properties(dev, fill)
}
/// `getRmaProperties` (v16).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn getRmaProperties(a: args::getRmaProperties) -> Result<()> {
    // SAFETY: NCCL's struct (NULL is refused).
    let out = unsafe { out_ref(a.rmaProps, "rmaProps")? };
    out.flushes_all_puts_on_any_signal = false;
    Err(rma::not_ours("getRmaProperties", "collComm", a.collComm))
}
/// `listen`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn listen(a: args::listen) -> Result<()> {
    // SAFETY: NCCL's output slot and handle buffer (NULL is refused).
    let (out, _h) = unsafe { (out_ref(a.listenComm, "listenComm")?, handle(a.handle)?) };
    *out = std::ptr::null_mut();
    rma::listen(a.ctx, a.dev)
}
/// `connect` (NCCL's RMA proxy passes its *net* context here: `ctx` is
/// not used).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn connect(a: args::connect) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.collComm, "collComm")? };
    *out = std::ptr::null_mut();
    let _ = (a.ctx, a.handles, a.nranks, a.rank);
    Err(rma::not_ours("connect", "listen comm", a.listenComm))
}
/// `createContext`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn createContext(a: args::createContext) -> Result<()> {
    // SAFETY: NCCL's output slots (v13 has `ginCtx` and `devHandle`).
    unsafe { clear(&[a.rmaCtx, a.ginCtx, a.devHandle]) };
    let _ = a.config;
    Err(rma::not_ours("createContext", "collComm", a.collComm))
}
/// `regMrSym`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn regMrSym(a: args::regMrSym) -> Result<()> {
    // SAFETY: NCCL's output slots (v13 has `ginHandle`).
    unsafe { clear(&[a.mhandle, a.ginHandle]) };
    let _ = (a.data, a.size, a.type_, a.mrFlags);
    Err(rma::not_ours("regMrSym", "collComm", a.collComm))
}
/// `regMrSymDmaBuf`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn regMrSymDmaBuf(a: args::regMrSymDmaBuf) -> Result<()> {
    // SAFETY: NCCL's output slots (v13 has `ginHandle`).
    unsafe { clear(&[a.mhandle, a.ginHandle]) };
    let _ = (a.data, a.size, a.type_, a.offset, a.fd, a.mrFlags);
    Err(rma::not_ours("regMrSymDmaBuf", "collComm", a.collComm))
}
/// `deregMrSym`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn deregMrSym(a: args::deregMrSym) -> Result<()> {
    let _ = a.collComm;
    Err(rma::not_ours("deregMrSym", "memory handle", a.mhandle))
}
/// `destroyContext`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn destroyContext(a: args::destroyContext) -> Result<()> {
    let c = rma_ctx(a.rmaCtx, a.ginCtx);
    Err(rma::not_ours("destroyContext", "context", c))
}
/// `closeColl`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeColl(a: args::closeColl) -> Result<()> {
    Err(rma::not_ours("closeColl", "collComm", a.collComm))
}
/// `closeListen`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeListen(a: args::closeListen) -> Result<()> {
    Err(rma::not_ours("closeListen", "listen comm", a.listenComm))
}
/// `iput` (`optFlags`, v15+, is a hint).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iput(a: args::iput) -> Result<()> {
    // SAFETY: NCCL's output slot.
    unsafe { clear(&[a.request]) };
    let _ = (a.context, a.srcOff, a.srcMhandle, a.size, a.dstOff, a.dstMhandle, a.rank, a.optFlags);
    Err(rma::not_ours("iput", "context", rma_ctx(a.rmaCtx, a.ginCtx)))
}
/// `iputSignal` (v13: every signal strong).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iputSignal(a: args::iputSignal) -> Result<()> {
    // SAFETY: NCCL's output slot.
    unsafe { clear(&[a.request]) };
    let _ = (a.context, a.srcOff, a.srcMhandle, a.size, a.dstOff, a.dstMhandle, a.rank);
    let _ = (a.signalOff, a.signalMhandle, a.signalValue, a.signalOp, a.isStrongSignal, a.optFlags);
    Err(rma::not_ours("iputSignal", "context", rma_ctx(a.rmaCtx, a.ginCtx)))
}
/// `iget`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iget(a: args::iget) -> Result<()> {
    // SAFETY: NCCL's output slot.
    unsafe { clear(&[a.request]) };
    let _ = (a.context, a.remoteOff, a.remoteMhandle, a.size, a.localOff, a.localMhandle, a.rank, a.optFlags);
    Err(rma::not_ours("iget", "context", rma_ctx(a.rmaCtx, a.ginCtx)))
}
/// `iflush`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iflush(a: args::iflush) -> Result<()> {
    // SAFETY: NCCL's output slot.
    unsafe { clear(&[a.request]) };
    let _ = (a.context, a.mhandle, a.rank);
    Err(rma::not_ours("iflush", "context", rma_ctx(a.rmaCtx, a.ginCtx)))
}
/// `test` (takes the collComm).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn test(a: args::test) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let done = unsafe { out_ref(a.done, "done")? };
    *done = 0;
    let _ = a.collComm;
    Err(rma::not_ours("test", "request", a.request))
}
/// `rmaProgress` (v14+).
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn rmaProgress(a: args::rmaProgress) -> Result<()> {
    Err(rma::not_ours("rmaProgress", "context", a.rmaCtx))
}
/// `ginProgress` (v13's `rmaProgress`).
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn ginProgress(a: args::ginProgress) -> Result<()> {
    Err(rma::not_ours("ginProgress", "context", a.ginCtx))
}
/// `queryLastError`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn queryLastError(a: args::queryLastError) -> Result<()> {
    // SAFETY: NCCL's bool (NULL is refused).
    let out = unsafe { out_ref(a.hasError, "hasError")? };
    *out = false;
    Err(rma::not_ours("queryLastError", "context", rma_ctx(a.rmaCtx, a.ginCtx)))
}
/// `finalize`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn finalize(a: args::finalize) -> Result<()> {
    core::finalize(a.ctx)
}
