//! The data path: `isend`, `irecv`, `iflush`, `test`.

use super::*;

/// `isend(sendComm, data, size, tag, mhandle, phandle)`: `None` = retry later.
/// `phandle` (v10+, else NULL) is kept with the request.
///
/// # Safety
/// `data..data+size` must be memory NCCL registered with `mh` and keeps
/// unchanged until the request is reported done (the range is checked
/// against the handle; that it is readable is NCCL's promise).
pub unsafe fn isend(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: i32,
    mh: *mut c_void,
    phandle: *mut c_void,
) -> Result<Option<*mut c_void>> {
    let (serial, s) = REG.send.get_with_serial(comm).ok_or_else(|| {
        Error::bad_handle(format!("isend: {comm:p} is not a live Weft send comm"))
    })?;
    let h = desc_for(mh, s.dev, data.cast(), size, "isend")?;
    // SAFETY: the buffer lies inside a live registration of NCCL's memory
    // (checked just above), which NCCL keeps until the request completes.
    let q = unsafe { send_on(serial, &s, data, size, tag, &h, phandle) }?;
    Ok(q.map(Request::into_token))
}

/// [`isend`] on send comm `s` (recorded under `serial`), the buffer checked
/// against its handle `h`.
///
/// # Safety
/// As for [`isend`].
pub(super) unsafe fn send_on(
    serial: u64,
    s: &Sender,
    data: *mut c_void,
    size: usize,
    tag: i32,
    h: &MrHandle,
    phandle: *mut c_void,
) -> Result<Option<Request>> {
    // SAFETY: the caller's contract.
    let Some(id) = unsafe { s.comm.isend(data.cast(), size, tag, &h.mems, phandle) }? else {
        return Ok(None);
    };
    s.events.start(
        id.slot,
        std::iter::once((phandle, profiler::OP_SEND, tag, size)),
    );
    Ok(Some(Request {
        kind: ReqKind::Send,
        comm: serial,
        id,
    }))
}

/// One buffer of a grouped receive, as NCCL describes it.
#[derive(Debug, Clone, Copy)]
pub struct RecvArg {
    /// Buffer.
    pub data: *mut c_void,
    /// Capacity.
    pub size: usize,
    /// Tag it accepts.
    pub tag: i32,
    /// Memory handle.
    pub mhandle: *mut c_void,
    /// Profiler handle (v10+).
    pub phandle: *mut c_void,
}

/// `irecv(recvComm, n, ...)`: `None` = retry later.
///
/// # Safety
/// Every buffer must be memory NCCL registered with its handle and keeps
/// writable until the request is reported done (each range is checked
/// against its handle; that it is writable is NCCL's promise).
pub unsafe fn irecv(comm: *mut c_void, args: &[RecvArg]) -> Result<Option<*mut c_void>> {
    proto::check_recv_count(args.len())?;
    let (serial, r) = REG.recv.get_with_serial(comm).ok_or_else(|| {
        Error::bad_handle(format!("irecv: {comm:p} is not a live Weft receive comm"))
    })?;
    // No allocation on the data path: the handles live in a fixed array
    // while the buffers borrow their registrations.
    let mut handles: [Option<Arc<MrHandle>>; props::MAX_RECVS] = Default::default();
    for (h, a) in handles.iter_mut().zip(args) {
        *h = Some(desc_for(a.mhandle, r.dev, a.data.cast(), a.size, "irecv")?);
    }
    // SAFETY: every buffer lies inside a live registration (checked above).
    let q = unsafe { recv_on(serial, &r, args, &handles) }?;
    Ok(q.map(Request::into_token))
}

/// [`irecv`] on receive comm `r` (recorded under `serial`): buffer `i` as
/// `args[i]` says, registered with `handles[i]` (checked).
///
/// # Safety
/// As for [`irecv`].
pub(super) unsafe fn recv_on(
    serial: u64,
    r: &Receiver,
    args: &[RecvArg],
    handles: &[Option<Arc<MrHandle>>; props::MAX_RECVS],
) -> Result<Option<Request>> {
    // The receive keeps each handle (its registrations) until it is done,
    // even past NCCL's deregMr (see `proto::Hold`).
    let holds: [Option<proto::Hold>; props::MAX_RECVS] =
        std::array::from_fn(|i| handles[i].clone().map(|h| h as proto::Hold));
    let mut bufs = [RecvBuf::EMPTY; props::MAX_RECVS];
    for (((b, a), h), hold) in bufs
        .iter_mut()
        .zip(args)
        .zip(handles.iter().flatten())
        .zip(&holds)
    {
        *b = RecvBuf {
            data: a.data.cast(),
            size: a.size,
            tag: a.tag,
            mem: &h.mems,
            phandle: a.phandle,
            hold: hold.as_ref(),
        };
    }
    // SAFETY: the caller's contract.
    let Some(id) = unsafe { r.comm.irecv(&bufs[..args.len()]) }? else {
        return Ok(None);
    };
    r.events.start(
        id.slot,
        args.iter()
            .map(|a| (a.phandle, profiler::OP_RECV, a.tag, a.size)),
    );
    Ok(Some(Request {
        kind: ReqKind::Recv,
        comm: serial,
        id,
    }))
}

/// `iflush(recvComm, n, ..., mhandles)`: makes data the NIC wrote into
/// GPU memory visible to the GPU's kernels. Host memory needs nothing; for
/// CUDA buffers the driver's flush (`cuFlushGPUDirectRDMAWrites`) runs,
/// once per GPU named, and completes before the call returns. The request
/// is therefore always NULL, which NCCL treats as complete.
pub fn iflush(
    comm: *mut c_void,
    n: usize,
    mhandles: &[*mut c_void],
) -> Result<Option<*mut c_void>> {
    if REG.recv.get(comm).is_none() {
        return Err(Error::bad_handle(format!(
            "iflush: {comm:p} is not a live Weft receive comm"
        )));
    }
    if n == 0 || n > props::MAX_RECVS {
        return Err(Error::internal(format!(
            "iflush with n = {n}: must be 1 ..= {}",
            props::MAX_RECVS
        )));
    }
    let mut flushed: Vec<i32> = Vec::new();
    for &mh in mhandles.iter().filter(|m| !m.is_null()) {
        let h = REG.mr.get(mh).ok_or_else(|| {
            Error::bad_handle(format!("iflush: {mh:p} is not a live Weft memory handle"))
        })?;
        if let MemKind::Cuda(gpu) = h.kind() {
            if !flushed.contains(&gpu) {
                let drv = crate::gpu::driver().map_err(|e| Error::system(e.to_string()))?;
                drv.flush(gpu)
                    .map_err(|e| Error::system(format!("iflush: GPU {gpu}: {e}")))?;
                flushed.push(gpu);
            }
        }
    }
    Ok(None)
}

/// `test(request)`: `Some` once done (the request is then freed).
pub fn test(req: *mut c_void) -> Result<Option<Done>> {
    let not_ours = || {
        Error::bad_handle(format!(
            "test: {req:p} is not a Weft request (stale or foreign pointer)"
        ))
    };
    let (kind, comm, slot, gen) = handles::req_parts(req).ok_or_else(not_ours)?;
    let id = ReqId { slot, gen };
    test_request(Request { kind, comm, id })
        .ok_or_else(not_ours)?
        .map_err(|e| e.context(format!("test({req:p})")))
}

/// Tests request `q`; `None` if its comm is closed.
pub(super) fn test_request(q: Request) -> Option<Result<Option<Done>>> {
    match q.kind {
        ReqKind::Send => REG.send.get_at(q.comm).map(|s| s.test(q.id)),
        ReqKind::Recv => REG.recv.get_at(q.comm).map(|r| r.test(q.id)),
    }
}
