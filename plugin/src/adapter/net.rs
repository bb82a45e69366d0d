//! The `ncclNet` members (functions named after them, as NCCL spells them).

#![allow(non_snake_case)]

use super::*;

/// The table's data members, by NCCL's names.
#[allow(non_upper_case_globals)]
pub mod data {
    use std::ffi::c_char;

    /// `name`: the table name NCCL matches `NCCL_NET` against.
    pub const name: *const c_char = super::NAME.as_ptr();
}

/// Argument structs, one per member, fields named as in NCCL's headers.
#[allow(non_snake_case)]
pub mod args {
    use super::*;
    args! {
        init { ctx: *mut *mut c_void = NULL2, commId: u64 = 0, config: *mut CommConfig = std::ptr::null_mut(),
               logFunction: Option<Logger> = None, profFunction: *mut c_void = NULL }
        devices { ndev: *mut c_int = std::ptr::null_mut() }
        listen { ctx: *mut c_void = NULL, dev: c_int = 0, handle: *mut c_void = NULL, listenComm: *mut *mut c_void = NULL2 }
        connect { ctx: *mut c_void = NULL, dev: c_int = 0, config: *mut CommConfig = std::ptr::null_mut(),
                  handle: *mut c_void = NULL, sendComm: *mut *mut c_void = NULL2, sendDevComm: *mut *mut c_void = NULL2 }
        accept { listenComm: *mut c_void = NULL, recvComm: *mut *mut c_void = NULL2, recvDevComm: *mut *mut c_void = NULL2 }
        regMr { comm: *mut c_void = NULL, data: *mut c_void = NULL, size: CSize = CSize::None, type_: c_int = 0,
                mhandle: *mut *mut c_void = NULL2 }
        deregMr { comm: *mut c_void = NULL, mhandle: *mut c_void = NULL }
        regMrDmaBuf { comm: *mut c_void = NULL, data: *mut c_void = NULL, size: CSize = CSize::None, type_: c_int = 0,
                      offset: u64 = 0, fd: c_int = -1, mhandle: *mut *mut c_void = NULL2 }
        isend { sendComm: *mut c_void = NULL, data: *mut c_void = NULL, size: CSize = CSize::None, tag: c_int = 0,
                mhandle: *mut c_void = NULL, phandle: *mut c_void = NULL, request: *mut *mut c_void = NULL2 }
        irecv { recvComm: *mut c_void = NULL, n: c_int = 0, data: *mut *mut c_void = NULL2, sizes: SizeArray = SizeArray::None,
                tags: *mut c_int = std::ptr::null_mut(), mhandles: *mut *mut c_void = NULL2,
                phandles: *mut *mut c_void = NULL2, request: *mut *mut c_void = NULL2 }
        iflush { recvComm: *mut c_void = NULL, n: c_int = 0, data: *mut *mut c_void = NULL2, sizes: SizeArray = SizeArray::None,
                 mhandles: *mut *mut c_void = NULL2, request: *mut *mut c_void = NULL2 }
        test { request: *mut c_void = NULL, done: *mut c_int = std::ptr::null_mut(), sizes: *mut c_int = std::ptr::null_mut() }
        closeSend { sendComm: *mut c_void = NULL }
        closeRecv { recvComm: *mut c_void = NULL }
        closeListen { listenComm: *mut c_void = NULL }
        finalize { ctx: *mut c_void = NULL }
        setNetAttr { ctx: *mut c_void = NULL, netAttr: *mut c_void = NULL }
        makeVDevice { d: *mut c_int = std::ptr::null_mut(), props: VProps = VProps::default() }
    }
}

/// `makeVDevice`: fuses physical devices into a virtual one (see
/// `proto::stripe`). The output pointer is checked first, so a NULL
/// one makes nothing.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn makeVDevice(a: args::makeVDevice) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.d, "d")? };
    // SAFETY: NCCL's props struct of this version.
    let devs = unsafe { a.props.devs() }?;
    *out = core::make_vdevice(&devs, a.props.cap)?;
    Ok(())
}

/// `init`: a context per communicator (v11+) or the process context.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn init(a: args::init) -> Result<()> {
    let profiler = (!a.profFunction.is_null()).then_some(a.profFunction as usize);
    if a.ctx.is_null() {
        return core::init_process(a.logFunction, profiler);
    }
    // SAFETY: non-NULL config points to NCCL's ncclNetCommConfig.
    let tc = unsafe { a.config.as_ref() }.map_or(-1, |c| c.traffic_class);
    let ctx = core::init(core::InitArgs {
        logger: a.logFunction,
        profiler,
        comm_id: a.commId,
        traffic_class: tc,
    })?;
    // SAFETY: `ctx` is non-NULL (checked above) and NCCL's output slot.
    unsafe { write(a.ctx, ctx, "ctx") }
}

/// `devices`.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn devices(a: args::devices) -> Result<()> {
    let n = core::devices()?;
    // SAFETY: NCCL's output slot (NULL is refused).
    unsafe { write(a.ndev, c_int::try_from(n).unwrap_or(c_int::MAX), "ndev") }
}

/// `getProperties`: `fill` writes the version's struct.
pub fn get_properties(dev: c_int, fill: impl FnOnce(&Properties) -> Result<()>) -> Result<()> {
    core::with_properties(dev, fill)
}

/// `listen`. The output pointer is checked first, so a NULL one
/// creates nothing.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn listen(a: args::listen) -> Result<()> {
    // SAFETY: NCCL's output slot and handle buffer (NULL is refused).
    let (out, h) = unsafe { (out_ref(a.listenComm, "listenComm")?, handle(a.handle)?) };
    *out = core::listen(ctx_or_process(a.ctx)?, a.dev, h)?;
    Ok(())
}

/// `connect`: `*sendComm` stays NULL until connected.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn connect(a: args::connect) -> Result<()> {
    // SAFETY: NCCL's output slots, config and handle buffer (NULL is
    // refused, or means "absent" for the device handle and config).
    let (out, dc, tc, h) = unsafe {
        (
            out_ref(a.sendComm, "sendComm")?,
            out_ref(a.sendDevComm, "sendDevComm").ok(),
            a.config.as_ref().map(|c| c.traffic_class),
            handle(a.handle)?,
        )
    };
    *out = std::ptr::null_mut();
    // No device offload: a device-handle slot, if any, stays NULL.
    if let Some(dc) = dc {
        *dc = std::ptr::null_mut();
    }
    if let Some(c) = core::connect(ctx_or_process(a.ctx)?, a.dev, tc, h)? {
        *out = c;
    }
    Ok(())
}

/// `accept`: `*recvComm` stays NULL until a peer connected.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn accept(a: args::accept) -> Result<()> {
    // SAFETY: NCCL's output slots (NULL is refused, or means "absent"
    // for the device handle).
    let (out, dc) = unsafe {
        (
            out_ref(a.recvComm, "recvComm")?,
            out_ref(a.recvDevComm, "recvDevComm").ok(),
        )
    };
    *out = std::ptr::null_mut();
    // No device offload: a device-handle slot, if any, stays NULL.
    if let Some(dc) = dc {
        *dc = std::ptr::null_mut();
    }
    if let Some(c) = core::accept(a.listenComm)? {
        *out = c;
    }
    Ok(())
}

/// `regMr`. The output pointer is checked first, so a NULL one
/// registers nothing.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn regMr(a: args::regMr) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.mhandle, "mhandle")? };
    *out = core::reg_mr(a.comm, a.data, a.size.get("size")?, a.type_)?;
    Ok(())
}

/// `deregMr`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn deregMr(a: args::deregMr) -> Result<()> {
    core::dereg_mr(a.comm, a.mhandle)
}

/// `regMrDmaBuf` (v6+). The output pointer is checked first, so a NULL
/// one registers nothing.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn regMrDmaBuf(a: args::regMrDmaBuf) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.mhandle, "mhandle")? };
    *out = core::reg_mr_dma_buf(a.comm, a.data, a.size.get("size")?, a.type_, a.offset, a.fd)?;
    Ok(())
}

/// `isend`: `*request` is always written (NULL = retry later).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn isend(a: args::isend) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.request, "request")? };
    *out = std::ptr::null_mut();
    let size = a.size.get("size")?;
    // SAFETY: NCCL's buffer, kept until the request is done; the core
    // checks it against its memory handle.
    let r = unsafe { core::isend(a.sendComm, a.data, size, a.tag, a.mhandle, a.phandle)? };
    if let Some(r) = r {
        *out = r;
    }
    Ok(())
}

fn n_of(n: c_int) -> Result<usize> {
    usize::try_from(n)
        .ok()
        .filter(|&n| (1..=core::props::MAX_RECVS).contains(&n))
        .ok_or_else(|| {
            Error::internal(format!(
                "n = {n}: must be 1 ..= {} (maxRecvs)",
                core::props::MAX_RECVS
            ))
        })
}

/// `irecv`: the value NCCL leaves in `*request` (stale, or 0x1) is ignored.
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn irecv(a: args::irecv) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.request, "request")? };
    *out = std::ptr::null_mut();
    let n = n_of(a.n)?;
    if a.data.is_null() || a.tags.is_null() || a.mhandles.is_null() {
        return Err(Error::internal("irecv: NULL data, tags or mhandles array"));
    }
    let mut bufs = [core::RecvArg {
        data: NULL,
        size: 0,
        tag: 0,
        mhandle: NULL,
        phandle: NULL,
    }; core::props::MAX_RECVS];
    for (i, b) in bufs.iter_mut().enumerate().take(n) {
        // SAFETY: NCCL's arrays have n entries (checked non-NULL above).
        unsafe {
            *b = core::RecvArg {
                data: *a.data.add(i),
                size: a.sizes.get(i, "sizes")?,
                tag: *a.tags.add(i),
                mhandle: *a.mhandles.add(i),
                phandle: if a.phandles.is_null() {
                    NULL
                } else {
                    *a.phandles.add(i)
                },
            };
        }
    }
    // SAFETY: NCCL's buffers, kept until the request is done; the core
    // checks each against its memory handle.
    if let Some(r) = unsafe { core::irecv(a.recvComm, &bufs[..n])? } {
        *out = r;
    }
    Ok(())
}

/// `iflush`: host memory needs none; CUDA buffers get the driver's
/// flush (NULL request = done, either way).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn iflush(a: args::iflush) -> Result<()> {
    // What a flush orders is the device's writes, whichever buffers they
    // went to: the memory handles say which device; `data` and `sizes`
    // are not needed.
    let _ = (a.data, a.sizes);
    // SAFETY: NCCL's output slot (NULL is refused).
    let out = unsafe { out_ref(a.request, "request")? };
    *out = std::ptr::null_mut();
    let n = n_of(a.n)?;
    let mut mhandles = [std::ptr::null_mut(); crate::core::props::MAX_RECVS];
    let named = n.min(mhandles.len());
    if !a.mhandles.is_null() {
        for (i, m) in mhandles.iter_mut().enumerate().take(named) {
            // SAFETY: NCCL passes `n` memory handles; at most MAX_RECVS
            // are read (the core refuses a larger n).
            *m = unsafe { *a.mhandles.add(i) };
        }
    }
    if let Some(r) = core::iflush(a.recvComm, n, &mhandles[..named])? {
        *out = r;
    }
    Ok(())
}

/// `test`: writes `*done` and, when done, the sizes (as `int`).
///
/// # Safety
/// NCCL's pointer arguments are NULL or valid as the member's C contract says.
pub unsafe fn test(a: args::test) -> Result<()> {
    // SAFETY: NCCL's output slot (NULL is refused).
    let done = unsafe { out_ref(a.done, "done")? };
    *done = 0;
    if let Some(d) = core::test(a.request)? {
        let sizes = SizeArray::Int(a.sizes);
        for i in 0..d.n {
            // SAFETY: NCCL passes at least n entries (one for a send).
            unsafe { sizes.set(i, d.sizes[i], "received size")? };
        }
        *done = 1;
    }
    Ok(())
}

/// `closeSend`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeSend(a: args::closeSend) -> Result<()> {
    core::close_send(a.sendComm)
}

/// `closeRecv`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeRecv(a: args::closeRecv) -> Result<()> {
    core::close_recv(a.recvComm)
}

/// `closeListen`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn closeListen(a: args::closeListen) -> Result<()> {
    core::close_listen(a.listenComm)
}

/// `finalize(ctx)`.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn finalize(a: args::finalize) -> Result<()> {
    core::finalize(a.ctx)
}

/// `setNetAttr`: a tuning hint; accepted, and nothing in SENDRECV uses it.
///
/// # Safety
/// As for every member: NCCL's arguments, as its C declaration says.
pub unsafe fn setNetAttr(a: args::setNetAttr) -> Result<()> {
    let _ = a.netAttr; // not read: see above
    core::check_ctx(a.ctx)
}
