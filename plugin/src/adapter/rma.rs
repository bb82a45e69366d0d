//! The `ncclRma` members (v13 … v16): conversions to and from
//! [`crate::rma`]. v13 is GIN v13's table (its context argument is named
//! `ginCtx`, its `createContext` and `regMrSym*` have one more output, its
//! progress member is `ginProgress`, and every signal is strong); v15 adds
//! `optFlags`, a hint that changes no semantics; v16 adds
//! `getRmaProperties`. Every output slot is cleared first, so a refused
//! call leaves no stale value behind.

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
    out.flushes_all_puts_on_any_signal = rma::flushes_all_puts_on_any_signal(a.collComm)?;
    Ok(())
}
/// `listen`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn listen(a: args::listen) -> Result<()> {
    // SAFETY: NCCL's output slot and handle buffer (NULL is refused).
    let (out, h) = unsafe { (out_ref(a.listenComm, "listenComm")?, handle(a.handle)?) };
    *out = std::ptr::null_mut();
    *out = rma::listen(a.ctx, a.dev, h)?;
    Ok(())
}
/// `connect` (NCCL's RMA proxy passes its *net* context here: `ctx` is
/// not used).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract
/// says: `handles` holds `nranks` pointers to handle buffers.
pub unsafe fn connect(a: args::connect) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.collComm, "collComm")? };
    *out = std::ptr::null_mut();
    let _ = a.ctx;
    let n = usize::try_from(a.nranks)
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| Error::internal(format!("RMA connect: nranks = {}", a.nranks)))?;
    if a.handles.is_null() {
        return Err(Error::internal("RMA connect: NULL `handles` argument"));
    }
    // SAFETY: NCCL passes `nranks` handle pointers (checked non-NULL above).
    let ptrs = unsafe { std::slice::from_raw_parts(a.handles, n) };
    let hs = ptrs
        .iter()
        // SAFETY: each is NULL or a handle buffer of NCCL's (NULL is refused).
        .map(|&p| unsafe { handle(p) }.map(|h| &*h))
        .collect::<Result<Vec<_>>>()?;
    *out = rma::connect(&hs, a.rank, a.listenComm)?;
    Ok(())
}
/// `createContext`. v13's config is GIN v13's (`nContexts` its third
/// field) and v13 alone passes `ginCtx`; v14+'s starts with `nContexts`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn createContext(a: args::createContext) -> Result<()> {
    // SAFETY: NCCL's output slots (v13 has `ginCtx` and `devHandle`).
    unsafe { clear(&[a.rmaCtx, a.ginCtx, a.devHandle]) };
    if a.config.is_null() {
        return Err(Error::internal("RMA createContext: NULL `config` argument"));
    }
    let v13 = !a.ginCtx.is_null();
    let at = if v13 { 2 } else { 0 };
    // SAFETY: NCCL's config struct: v13's has five ints, v14+'s three.
    let contexts = unsafe { a.config.cast::<c_int>().add(at).read_unaligned() };
    let ctx = rma::create_context(a.collComm, contexts)?;
    let slot = if v13 { a.ginCtx } else { a.rmaCtx };
    // SAFETY: NCCL's output slot (NULL is refused).
    *unsafe { out_ref(slot, "rmaCtx")? } = ctx;
    Ok(())
}
/// `regMrSym`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn regMrSym(a: args::regMrSym) -> Result<()> {
    // SAFETY: NCCL's output slots (v13 has `ginHandle`, left NULL: Weft is
    // a proxy, no GPU reads it).
    unsafe { clear(&[a.mhandle, a.ginHandle]) };
    let _ = a.mrFlags;
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.mhandle, "mhandle")? };
    *out = rma::reg_mr_sym(a.collComm, a.data, a.size, a.type_, None)?;
    Ok(())
}
/// `regMrSymDmaBuf`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn regMrSymDmaBuf(a: args::regMrSymDmaBuf) -> Result<()> {
    // SAFETY: NCCL's output slots (v13 has `ginHandle`).
    unsafe { clear(&[a.mhandle, a.ginHandle]) };
    let _ = a.mrFlags;
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.mhandle, "mhandle")? };
    *out = rma::reg_mr_sym(a.collComm, a.data, a.size, a.type_, Some((a.offset, a.fd)))?;
    Ok(())
}
/// `deregMrSym`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn deregMrSym(a: args::deregMrSym) -> Result<()> {
    rma::dereg_mr_sym(a.collComm, a.mhandle)
}
/// `destroyContext`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn destroyContext(a: args::destroyContext) -> Result<()> {
    rma::destroy_context(rma_ctx(a.rmaCtx, a.ginCtx))
}
/// `closeColl`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeColl(a: args::closeColl) -> Result<()> {
    rma::close_coll(a.collComm)
}
/// `closeListen`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeListen(a: args::closeListen) -> Result<()> {
    rma::close_listen(a.listenComm)
}
/// Writes a new request to NCCL's slot (cleared first).
///
/// # Safety
/// `slot` is NULL or NCCL's output slot.
unsafe fn requested(slot: *mut *mut c_void, f: impl FnOnce() -> Result<*mut c_void>) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { clear(&[slot]) };
    // SAFETY: the caller's contract (NULL is refused).
    let out = unsafe { out_ref(slot, "request")? };
    *out = f()?;
    Ok(())
}
/// `iput` (`optFlags`, v15+, is a hint).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iput(a: args::iput) -> Result<()> {
    let _ = a.optFlags;
    let p = rma::Put {
        context: a.context,
        src: (a.srcOff, a.srcMhandle),
        size: a.size,
        dst: (a.dstOff, a.dstMhandle),
        rank: a.rank,
    };
    // SAFETY: NCCL's output slot.
    unsafe { requested(a.request, || rma::iput(rma_ctx(a.rmaCtx, a.ginCtx), p, None)) }
}
/// `iputSignal` (every signal is applied as a strong one: v13's are all
/// strong, and a weak one may be stronger).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iputSignal(a: args::iputSignal) -> Result<()> {
    let _ = (a.isStrongSignal, a.optFlags);
    let p = rma::Put {
        context: a.context,
        src: (a.srcOff, a.srcMhandle),
        size: a.size,
        dst: (a.dstOff, a.dstMhandle),
        rank: a.rank,
    };
    let s = rma::Signal {
        at: (a.signalOff, a.signalMhandle),
        value: a.signalValue,
        op: a.signalOp,
    };
    // SAFETY: NCCL's output slot.
    unsafe { requested(a.request, || rma::iput(rma_ctx(a.rmaCtx, a.ginCtx), p, Some(s))) }
}
/// `iget`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iget(a: args::iget) -> Result<()> {
    let _ = a.optFlags;
    let g = rma::Put {
        context: a.context,
        src: (a.remoteOff, a.remoteMhandle),
        size: a.size,
        dst: (a.localOff, a.localMhandle),
        rank: a.rank,
    };
    // SAFETY: NCCL's output slot.
    unsafe { requested(a.request, || rma::iget(rma_ctx(a.rmaCtx, a.ginCtx), g)) }
}
/// `iflush`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iflush(a: args::iflush) -> Result<()> {
    let c = rma_ctx(a.rmaCtx, a.ginCtx);
    // SAFETY: NCCL's output slot.
    unsafe { requested(a.request, || rma::iflush(c, a.context, a.mhandle, a.rank)) }
}
/// `test` (takes the collComm).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn test(a: args::test) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let done = unsafe { out_ref(a.done, "done")? };
    *done = 0;
    *done = c_int::from(rma::test(a.collComm, a.request)?);
    Ok(())
}
/// `rmaProgress` (v14+).
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn rmaProgress(a: args::rmaProgress) -> Result<()> {
    rma::progress(a.rmaCtx)
}
/// `ginProgress` (v13's `rmaProgress`).
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn ginProgress(a: args::ginProgress) -> Result<()> {
    rma::progress(a.ginCtx)
}
/// `queryLastError`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn queryLastError(a: args::queryLastError) -> Result<()> {
    // SAFETY: NCCL's bool (NULL is refused).
    let out = unsafe { out_ref(a.hasError, "hasError")? };
    *out = false;
    *out = rma::query_last_error(rma_ctx(a.rmaCtx, a.ginCtx))?;
    Ok(())
}
/// `finalize`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn finalize(a: args::finalize) -> Result<()> {
    core::finalize(a.ctx)
}
