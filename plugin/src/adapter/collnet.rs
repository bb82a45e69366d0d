//! The `ncclCollNet` members: conversions to and from [`crate::collnet`].

#![allow(non_snake_case)]

use super::*;
use crate::collnet as cn;

/// Argument structs, one per member.
#[allow(non_snake_case)]
pub mod args {
    use super::*;
    args! {
        init { ctx: *mut *mut c_void = NULL2, commId: u64 = 0, logFunction: Option<Logger> = None }
        devices { ndev: *mut c_int = std::ptr::null_mut() }
        listen { ctx: *mut c_void = NULL, dev: c_int = 0, handle: *mut c_void = NULL, listenComm: *mut *mut c_void = NULL2 }
        connect { handles: *mut *mut c_void = NULL2, nranks: c_int = 0, rank: c_int = 0, listenComm: *mut c_void = NULL,
                  collComm: *mut *mut c_void = NULL2 }
        reduceSupport { dataType: c_int = 0, redOp: c_int = 0, supported: *mut c_int = std::ptr::null_mut() }
        regMr { collComm: *mut c_void = NULL, data: *mut c_void = NULL, size: CSize = CSize::None, type_: c_int = 0,
                mhandle: *mut *mut c_void = NULL2 }
        deregMr { collComm: *mut c_void = NULL, mhandle: *mut c_void = NULL }
        iallreduce { collComm: *mut c_void = NULL, sendData: *mut c_void = NULL, recvData: *mut c_void = NULL,
                     count: CSize = CSize::None, dataType: c_int = 0, redOp: c_int = 0, sendMhandle: *mut c_void = NULL,
                     recvMhandle: *mut c_void = NULL, request: *mut *mut c_void = NULL2 }
        iallgather { collComm: *mut c_void = NULL, sendData: *mut c_void = NULL, nRecvParts: c_int = 0,
                     recvParts: SgePtr = SgePtr::None, bytesPerRank: usize = 0, windowOffset: usize = 0,
                     windowBytes: usize = 0, sendMhandle: *mut c_void = NULL, request: *mut *mut c_void = NULL2 }
        ireducescatter { collComm: *mut c_void = NULL, nSendParts: c_int = 0, sendParts: SgePtr = SgePtr::None,
                         recvData: *mut c_void = NULL, bytesPerRank: usize = 0, windowOffset: usize = 0,
                         windowBytes: usize = 0, dataType: c_int = 0, redOp: c_int = 0,
                         recvMhandle: *mut c_void = NULL, request: *mut *mut c_void = NULL2 }
        iflush { collComm: *mut c_void = NULL, data: *mut c_void = NULL, size: CSize = CSize::None, mhandle: *mut c_void = NULL,
                 request: *mut *mut c_void = NULL2 }
        test { request: *mut c_void = NULL, done: *mut c_int = std::ptr::null_mut(), size: *mut c_int = std::ptr::null_mut() }
        closeColl { collComm: *mut c_void = NULL }
        closeListen { listenComm: *mut c_void = NULL }
        finalize { ctx: *mut c_void = NULL }
    }
}

/// `init`: as the net's (CollNet shares its devices and contexts).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn init(a: args::init) -> Result<()> {
    if a.ctx.is_null() {
        return core::init_process(a.logFunction, None);
    }
    let ctx = core::init(core::InitArgs {
        logger: a.logFunction,
        profiler: None,
        comm_id: a.commId,
        traffic_class: -1,
    })?;
    // SAFETY: `ctx` is non-NULL (checked above) and NCCL's output slot.
    unsafe { write(a.ctx, ctx, "ctx") }
}
/// `devices`: the net devices (NCCL matches CollNet devices to them by name).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn devices(a: args::devices) -> Result<()> {
    // SAFETY: forwarded contract; the same single output slot.
    unsafe { super::net::devices(super::net::args::devices { ndev: a.ndev }) }
}
/// `getProperties` and the data members: the net table's.
pub use super::net::{data, get_properties};
/// `listen`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn listen(a: args::listen) -> Result<()> {
    // SAFETY: NCCL's output slot and handle buffer (NULL is refused).
    let (out, h) = unsafe { (out_ref(a.listenComm, "listenComm")?, handle(a.handle)?) };
    *out = cn::listen(ctx_or_process(a.ctx)?, a.dev, h)?;
    Ok(())
}
/// `connect`: returns with the group ready.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn connect(a: args::connect) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.collComm, "collComm")? };
    *out = std::ptr::null_mut();
    let n = usize::try_from(a.nranks)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| Error::internal(format!("CollNet connect: nranks = {}", a.nranks)))?;
    let rank = usize::try_from(a.rank)
        .map_err(|_| Error::internal(format!("CollNet connect: rank = {}", a.rank)))?;
    if a.handles.is_null() {
        return Err(Error::internal("CollNet connect: NULL handles"));
    }
    let mut hs = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: NCCL passes `nranks` handle pointers.
        let h = unsafe { *a.handles.add(i) };
        // SAFETY: each is a 128-byte handle buffer (NULL is refused).
        hs.push(*unsafe { handle(h)? });
    }
    *out = cn::connect(&hs, rank, a.listenComm)?;
    Ok(())
}
/// `reduceSupport`: every type and op this build reduces.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn reduceSupport(a: args::reduceSupport) -> Result<()> {
    let yes = cn::reduce_support(a.dataType, a.redOp);
    // SAFETY: NCCL's output slot (NULL is refused).
    unsafe { write(a.supported, c_int::from(yes), "supported") }
}
/// `regMr`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn regMr(a: args::regMr) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.mhandle, "mhandle")? };
    *out = cn::reg_mr(a.collComm, a.data, a.size.get("size")?, a.type_)?;
    Ok(())
}
/// `deregMr`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn deregMr(a: args::deregMr) -> Result<()> {
    // The handle records its comm: `collComm` is not needed to find it.
    let _ = a.collComm;
    cn::dereg_mr(a.mhandle)
}
/// Writes NULL to NCCL's request slot first (so an error leaves no
/// stale value), then the request `start` makes.
///
/// # Safety
/// `slot` is NULL (refused) or NCCL's output slot.
unsafe fn request(
    slot: *mut *mut c_void,
    start: impl FnOnce() -> Result<*mut c_void>,
) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(slot, "request")? };
    *out = std::ptr::null_mut();
    *out = start()?;
    Ok(())
}
/// `iallreduce`: `count` in elements.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iallreduce(a: args::iallreduce) -> Result<()> {
    // SAFETY: NCCL's slot; its registered buffers of `count` elements,
    // kept until the request is done.
    unsafe {
        request(a.request, || {
            cn::iallreduce(
                a.collComm,
                a.sendData,
                a.recvData,
                a.count.get("count")?,
                a.dataType,
                a.redOp,
                a.sendMhandle,
                a.recvMhandle,
            )
        })
    }
}
/// `iallgather` (v8+; NCCL passes one part).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iallgather(a: args::iallgather) -> Result<()> {
    // SAFETY: NCCL's slot, its one-element list of this version's
    // layout, and its registered buffers, kept until the request is done.
    unsafe {
        request(a.request, || {
            let (mh, addr, size) = a.recvParts.only(a.nRecvParts, "CollNet iallgather")?;
            cn::iallgather(
                a.collComm,
                a.sendData,
                addr,
                size,
                mh,
                a.bytesPerRank,
                a.windowOffset,
                a.windowBytes,
                a.sendMhandle,
            )
        })
    }
}
/// `ireducescatter` (v8+; NCCL passes one part).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn ireducescatter(a: args::ireducescatter) -> Result<()> {
    // SAFETY: as for `iallgather`.
    unsafe {
        request(a.request, || {
            let (mh, addr, size) = a.sendParts.only(a.nSendParts, "CollNet ireducescatter")?;
            cn::ireducescatter(
                a.collComm,
                addr,
                size,
                mh,
                a.recvData,
                a.bytesPerRank,
                a.windowOffset,
                a.windowBytes,
                a.dataType,
                a.redOp,
                a.recvMhandle,
            )
        })
    }
}
/// `iflush`: host memory needs none (a NULL request is done).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iflush(a: args::iflush) -> Result<()> {
    // Host memory: the buffer (`data`, `size`, `mhandle`) needs no flush.
    let _ = (a.data, a.size, a.mhandle);
    cn::device_of(a.collComm)?;
    // SAFETY: NCCL's output slot (NULL is refused).
    unsafe { write(a.request, std::ptr::null_mut(), "request") }
}
/// `test`: `size` (NULL for a flush) gets the bytes reduced.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn test(a: args::test) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let done = unsafe { out_ref(a.done, "done")? };
    *done = 0;
    if let Some(bytes) = cn::test(a.request)? {
        // SAFETY: NULL or NCCL's int.
        if let Some(sz) = unsafe { a.size.as_mut() } {
            *sz = c_int::try_from(bytes).unwrap_or(c_int::MAX);
        }
        *done = 1;
    }
    Ok(())
}
/// `closeColl`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeColl(a: args::closeColl) -> Result<()> {
    cn::close_coll(a.collComm)
}
/// `closeListen`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeListen(a: args::closeListen) -> Result<()> {
    cn::close_listen(a.listenComm)
}
/// `finalize`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn finalize(a: args::finalize) -> Result<()> {
    core::finalize(a.ctx)
}
