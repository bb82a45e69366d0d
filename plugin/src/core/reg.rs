//! Memory registration: `regMr`, `regMrDmaBuf`, `deregMr`, and the checks of every buffer against its memory handle.

use super::*;

/// The device index and rails of a send or receive comm.
pub(super) fn comm_device(comm: *mut c_void) -> Option<(usize, Vec<Arc<DeviceState>>)> {
    REG.send
        .get(comm)
        .map(|s| (s.dev, s.comm.rails().to_vec()))
        .or_else(|| REG.recv.get(comm).map(|r| (r.dev, r.comm.rails().to_vec())))
}

/// `regMr(comm, data, size, type)`.
pub fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
) -> Result<*mut c_void> {
    let (index, rails) = registering(comm, data, "regMr")?;
    Ok(reg_mr_on(index, &rails, data, size, ptr_type)?.into_token())
}

/// [`reg_mr`] on device `index`, whose rails are `rails`.
pub(super) fn reg_mr_on(
    index: usize,
    rails: &[Arc<DeviceState>],
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
) -> Result<Owned<MrHandle>> {
    if data.is_null() {
        return Err(Error::internal("regMr: NULL address"));
    }
    // A virtual device takes GPU memory only if every rail does: the rail
    // that decides (and that an error names) is the first that does not.
    let d = rails.iter().find(|r| !r.cuda).unwrap_or(&rails[0]);
    let kind = match ptr_type {
        props::PTR_HOST => MemKind::Host,
        props::PTR_CUDA if d.cuda => MemKind::Cuda(cuda_device(data, "regMr")?),
        props::PTR_CUDA => {
            return Err(Error::usage(format!(
                "regMr: CUDA memory on device {} ({}), which reported ptrSupport = NCCL_PTR_HOST (its INFO line at init says why)",
                d.index, d.dev.domain
            )))
        }
        other => {
            return Err(Error::usage(format!(
                "regMr: memory type {other:#x} is not supported (NCCL_PTR_HOST or, where claimed, NCCL_PTR_CUDA)"
            )))
        }
    };
    // SAFETY: NCCL registers memory it owns and keeps allocated until deregMr.
    register_on(index, rails, data, size, |r| unsafe {
        r.mr.register_kind(data as usize, size, kind)
    })
}

/// `regMrDmaBuf(comm, data, size, type, offset, fd)` (v6+): GPU memory at
/// `data`, which is `offset` bytes into the DMA-BUF `fd`, registered through
/// that DMA-BUF. Only on devices that claimed `NCCL_PTR_DMABUF`; the fd is
/// NCCL's (it closes it once this returns).
pub fn reg_mr_dma_buf(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
    offset: u64,
    fd: i32,
) -> Result<*mut c_void> {
    let (index, rails) = registering(comm, data, "regMrDmaBuf")?;
    Ok(reg_mr_dma_buf_on(index, &rails, data, size, ptr_type, offset, fd)?.into_token())
}

/// [`reg_mr_dma_buf`] on device `index`, whose rails are `rails`.
pub(super) fn reg_mr_dma_buf_on(
    index: usize,
    rails: &[Arc<DeviceState>],
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
    offset: u64,
    fd: i32,
) -> Result<Owned<MrHandle>> {
    if data.is_null() {
        return Err(Error::internal("regMrDmaBuf: NULL address"));
    }
    let d = rails.iter().find(|r| !r.dmabuf).unwrap_or(&rails[0]);
    if !d.dmabuf {
        return Err(Error::usage(format!(
            "regMrDmaBuf: device {} ({}) did not claim NCCL_PTR_DMABUF (its INFO line at init says why); \
             NCCL should register with regMr",
            d.index, d.dev.domain
        )));
    }
    if ptr_type != props::PTR_CUDA {
        return Err(Error::usage(format!(
            "regMrDmaBuf: memory type {ptr_type:#x}: DMA-BUF registration takes CUDA memory (NCCL_PTR_CUDA) only"
        )));
    }
    if fd < 0 {
        return Err(Error::internal(format!(
            "regMrDmaBuf: {fd} is not a file descriptor"
        )));
    }
    let dev = cuda_device(data, "regMrDmaBuf")?;
    // SAFETY: NCCL registers memory it owns and keeps allocated until
    // deregMr, and keeps `fd` open for this call.
    register_on(index, rails, data, size, |r| unsafe {
        r.mr.register_dmabuf(data as usize, size, dev, fd, offset)
    })
}

/// The device and rails of the comm a registration is for, and a check of
/// its address.
pub(super) fn registering(
    comm: *mut c_void,
    data: *mut c_void,
    call: &str,
) -> Result<(usize, Vec<Arc<DeviceState>>)> {
    let found = comm_device(comm).ok_or_else(|| {
        Error::bad_handle(format!(
            "{call}: {comm:p} is not a live Weft send or receive comm"
        ))
    })?;
    if data.is_null() {
        return Err(Error::internal(format!("{call}: NULL address")));
    }
    Ok(found)
}

/// The CUDA device whose memory NCCL says `data` is.
pub(super) fn cuda_device(data: *mut c_void, call: &str) -> Result<i32> {
    let drv = crate::gpu::driver().map_err(|e| Error::system(e.to_string()))?;
    match drv
        .classify(data)
        .map_err(|e| Error::internal(format!("{call}: {e}")))?
    {
        MemKind::Cuda(dev) => Ok(dev),
        MemKind::Host => Err(Error::internal(format!(
            "{call}: NCCL says {data:p} is CUDA memory, but the driver does not know it as device memory"
        ))),
    }
}

/// Registers on every rail with `reg` and returns the memory handle; a
/// failure on any rail releases what the others registered.
pub(super) fn register_on(
    index: usize,
    rails: &[Arc<DeviceState>],
    data: *mut c_void,
    size: usize,
    reg: impl Fn(
        &DeviceState,
    )
        -> std::result::Result<Arc<crate::mr::Region<crate::fabric::Mr>>, crate::mr::RegError>,
) -> Result<Owned<MrHandle>> {
    let mut h = MrHandle {
        dev: index,
        addr: data as usize,
        len: size,
        regions: Vec::with_capacity(rails.len()),
        mems: Vec::with_capacity(rails.len()),
    };
    for r in rails {
        match reg(r) {
            Ok(region) => {
                let desc = region.desc();
                h.mems.push(proto::Mem {
                    desc: desc.desc,
                    key: desc.key,
                    base: region.range().start,
                });
                h.regions.push((Arc::clone(r), region));
            }
            Err(e) => {
                release(h);
                return Err(Error::system(e.to_string()));
            }
        }
    }
    Ok(Owned::record(h))
}

/// Gives a handle's registrations back to their devices' caches.
pub(super) fn release(h: MrHandle) {
    for (d, region) in h.regions {
        d.mr.release(region);
    }
}

/// `deregMr(comm, mhandle)`. Registrations belong to the device, so the comm
/// argument is not needed (it may already be closed).
pub fn dereg_mr(_comm: *mut c_void, mh: *mut c_void) -> Result<()> {
    owned::close_token::<MrHandle>(mh).ok_or_else(|| {
        Error::bad_handle(format!("deregMr: {mh:p} is not a live Weft memory handle"))
    })
}

/// The handle `mh` for `data..data+size` on device `dev` (its registrations
/// are what the comm takes). Every data buffer must come with the handle it
/// was registered under, and lie inside the range NCCL registered with it
/// (not merely inside the pages the registration covers).
pub(super) fn desc_for(
    mh: *mut c_void,
    dev: usize,
    data: *const u8,
    size: usize,
    call: &str,
) -> Result<Arc<MrHandle>> {
    if mh.is_null() {
        return Err(Error::bad_handle(format!(
            "{call}: buffer {data:p} comes without a memory handle (NCCL registers every buffer it passes)"
        )));
    }
    let h = REG.mr.get(mh).ok_or_else(|| {
        Error::bad_handle(format!(
            "{call}: {mh:p} is not a live Weft memory handle (deregistered, or not from this plugin)"
        ))
    })?;
    check_range(&h, dev, data, size, call)?;
    Ok(h)
}

/// Checks that `data..data+size` on device `dev` lies inside the range NCCL
/// registered with `h` (not merely inside the pages it covers).
pub(super) fn check_range(
    h: &MrHandle,
    dev: usize,
    data: *const u8,
    size: usize,
    call: &str,
) -> Result<()> {
    if h.dev != dev {
        return Err(Error::internal(format!(
            "{call}: memory handle registered on device {} used on device {dev}",
            h.dev
        )));
    }
    let (a, end) = (data as usize, (data as usize).checked_add(size));
    if a < h.addr || end.is_none_or(|e| e > h.addr + h.len) {
        return Err(Error::bad_buffer(format!(
            "{call}: buffer {data:p} + {size} bytes lies outside its memory handle's registered range {:#x} + {} bytes",
            h.addr, h.len
        )));
    }
    Ok(())
}
