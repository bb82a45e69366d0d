//! The core's typed API, for Weft's own modules (CollNet and the reduction
//! server): contexts, comms, memory handles and requests as Rust values.
//!
//! Tokens are for NCCL. A module of Weft's own holds an [`Owned`] object
//! instead: recorded in the same registry as NCCL's (so the keeper tends
//! it and the last finalize closes it), reached without a lookup, and
//! closed or deregistered when dropped, by the same code as NCCL's
//! `closeSend`, `closeRecv`, `closeListen` and `deregMr`. NCCL's entry
//! points are these functions with a token on each end
//! ([`Owned::into_token`]).

use std::sync::Weak;

use super::*;

/// What a registry holds and how one of its objects is closed.
pub(super) trait Closing: Sized + 'static {
    /// NCCL's name for the close, for what it logs.
    const CALL: &'static str;
    /// The registry the object is recorded in.
    fn registry() -> &'static Registry<Self>;
    /// Closes an object already taken out of its registry (by default,
    /// by dropping it).
    fn close(v: Arc<Self>) {
        drop(v);
    }
}

impl Closing for Sender {
    const CALL: &'static str = "closeSend";
    fn registry() -> &'static Registry<Self> {
        &REG.send
    }
    fn close(v: Arc<Self>) {
        close::closed(v, Self::CALL);
    }
}

impl Closing for Receiver {
    const CALL: &'static str = "closeRecv";
    fn registry() -> &'static Registry<Self> {
        &REG.recv
    }
    fn close(v: Arc<Self>) {
        close::closed(v, Self::CALL);
    }
}

impl Closing for Listener {
    const CALL: &'static str = "closeListen";
    fn registry() -> &'static Registry<Self> {
        &REG.listen
    }
}

impl Closing for MrHandle {
    const CALL: &'static str = "deregMr";
    fn registry() -> &'static Registry<Self> {
        &REG.mr
    }
    fn close(v: Arc<Self>) {
        // Normally the registry held the last reference; if a receive in
        // flight (or a data-path call) still holds one, the registrations
        // live until it lets go (see `proto::Hold`).
        if let Some(h) = Arc::into_inner(v) {
            reg::release(h);
        }
    }
}

/// A live object of the core owned by a Weft module; dropping it closes it.
/// The registry holds the object; this holds its serial number and a weak
/// reference, so that the last finalize, which empties the registries,
/// closes it as it closes what NCCL left open (its use then fails).
#[derive(Debug)]
pub struct Owned<T: Closing> {
    serial: u64,
    v: Weak<T>,
    /// Closed on drop (not once handed to NCCL).
    owns: bool,
}

impl<T: Closing> Owned<T> {
    /// Records `v` in its registry.
    pub(super) fn record(v: T) -> Self {
        let v = Arc::new(v);
        let serial = handles::serial();
        T::registry().insert_at(serial, Arc::clone(&v));
        Self {
            serial,
            v: Arc::downgrade(&v),
            owns: true,
        }
    }
    /// Hands the object to NCCL: it stays recorded, and its token is what
    /// NCCL passes back (and closes it with).
    pub fn into_token(mut self) -> *mut c_void {
        self.owns = false;
        handles::token_of(self.serial)
    }
    fn get(&self) -> Result<Arc<T>> {
        self.v.upgrade().ok_or_else(|| {
            Error::bad_handle(
                "a comm or memory handle of Weft's own was used after the last finalize closed it",
            )
        })
    }
}

impl<T: Closing> Drop for Owned<T> {
    fn drop(&mut self) {
        if self.owns {
            if let Some(v) = T::registry().remove_at(self.serial) {
                T::close(v);
            }
        }
    }
}

/// Closes the object behind NCCL's token `p`; `None` if it is none.
pub(super) fn close_token<T: Closing>(p: *mut c_void) -> Option<()> {
    T::registry().remove(p).map(T::close)
}

/// A context, as `init` gave it to NCCL. It does not keep the context
/// alive: after its finalize, what it opens fails.
#[derive(Debug, Clone)]
pub struct Context(Weak<Ctx>);

impl Context {
    /// The context behind NCCL's token `p`.
    pub fn of(p: *mut c_void) -> Result<Self> {
        Ok(Self(Arc::downgrade(&ctx(p)?)))
    }
    pub(super) fn live(&self) -> Result<Arc<Ctx>> {
        self.0
            .upgrade()
            .ok_or_else(|| Error::bad_handle("the Weft context was finalized"))
    }
    /// `listen` on device `dev` (see [`listen`]).
    pub fn listen(&self, dev: i32, handle: &mut [u8; HANDLE_SIZE]) -> Result<ListenComm> {
        let c = self.live()?;
        connect::listen_on(&c, dev, handle).map(ListenComm)
    }
    /// One step of `connect` (see [`connect`]).
    pub fn connect(
        &self,
        dev: i32,
        traffic_class: Option<i32>,
        handle: &mut [u8; HANDLE_SIZE],
    ) -> Result<Option<SendComm>> {
        let c = self.live()?;
        connect::connect_on(&c, dev, traffic_class, handle).map(|s| s.map(SendComm))
    }
}

/// A listen comm.
#[derive(Debug)]
pub struct ListenComm(pub(super) Owned<Listener>);

impl ListenComm {
    /// One step of `accept` (see [`accept`]).
    pub fn accept(&self) -> Result<Option<RecvComm>> {
        let l = self.0.get()?;
        connect::accept_on(&l).map(|r| r.map(RecvComm))
    }
}

/// A send comm; dropping it is `closeSend`.
#[derive(Debug)]
pub struct SendComm(pub(super) Owned<Sender>);

impl SendComm {
    /// `isend` of `size` bytes at `data`, registered with `mh`; `None` =
    /// retry later.
    ///
    /// # Safety
    /// As for [`isend`]: the buffer stays unchanged until the request is done.
    pub unsafe fn isend(
        &self,
        data: *mut c_void,
        size: usize,
        tag: i32,
        mh: &MemHandle,
    ) -> Result<Option<Request>> {
        let (s, h) = (self.0.get()?, mh.0.get()?);
        reg::check_range(&h, s.dev, data.cast(), size, "isend")?;
        // SAFETY: the caller's contract; the range lies in `mh` (just checked).
        unsafe { p2p::send_on(self.0.serial, &s, data, size, tag, &h, std::ptr::null_mut()) }
    }
    /// `regMr` through this comm (see [`reg_mr`]).
    pub fn reg_mr(&self, data: *mut c_void, size: usize, ptr_type: i32) -> Result<MemHandle> {
        let s = self.0.get()?;
        reg::reg_mr_on(s.dev, s.comm.rails(), data, size, ptr_type).map(MemHandle)
    }
}

/// A receive comm; dropping it is `closeRecv`.
#[derive(Debug)]
pub struct RecvComm(pub(super) Owned<Receiver>);

impl RecvComm {
    /// `irecv` of one buffer of `size` bytes at `data`, registered with
    /// `mh`; `None` = retry later.
    ///
    /// # Safety
    /// As for [`irecv`]: the buffer stays writable until the request is done.
    pub unsafe fn irecv(
        &self,
        data: *mut c_void,
        size: usize,
        tag: i32,
        mh: &MemHandle,
    ) -> Result<Option<Request>> {
        let (r, h) = (self.0.get()?, mh.0.get()?);
        reg::check_range(&h, r.dev, data.cast(), size, "irecv")?;
        let arg = RecvArg {
            data,
            size,
            tag,
            mhandle: std::ptr::null_mut(),
            phandle: std::ptr::null_mut(),
        };
        let mut handles: [Option<Arc<MrHandle>>; props::MAX_RECVS] = Default::default();
        handles[0] = Some(h);
        // SAFETY: the caller's contract; the range lies in `mh` (just checked).
        unsafe { p2p::recv_on(self.0.serial, &r, &[arg], &handles) }
    }
    /// `regMr` through this comm (see [`reg_mr`]).
    pub fn reg_mr(&self, data: *mut c_void, size: usize, ptr_type: i32) -> Result<MemHandle> {
        let r = self.0.get()?;
        reg::reg_mr_on(r.dev, r.comm.rails(), data, size, ptr_type).map(MemHandle)
    }
}

/// A memory handle; dropping it is `deregMr`.
#[derive(Debug)]
pub struct MemHandle(pub(super) Owned<MrHandle>);

impl MemHandle {
    /// `regMr` of `size` bytes at `data` (`ptr_type`: `NCCL_PTR_HOST` or,
    /// where the device claims it, `NCCL_PTR_CUDA`) on physical device
    /// `dev`, without a comm (RMA registers on its collComm's device).
    pub fn register(dev: &Arc<DeviceState>, data: *mut c_void, size: usize, ptr_type: i32) -> Result<Self> {
        let rails = [Arc::clone(dev)];
        reg::reg_mr_on(dev.index, &rails, data, size, ptr_type).map(MemHandle)
    }
    /// `regMrDmaBuf` on physical device `dev` (see [`MemHandle::register`]).
    pub fn register_dmabuf(
        dev: &Arc<DeviceState>,
        data: *mut c_void,
        size: usize,
        ptr_type: i32,
        offset: u64,
        fd: i32,
    ) -> Result<Self> {
        let rails = [Arc::clone(dev)];
        reg::reg_mr_dma_buf_on(dev.index, &rails, data, size, ptr_type, offset, fd).map(MemHandle)
    }
    /// Its registration (on its one device), and what memory it is.
    pub fn mem(&self) -> Result<(proto::Mem, MemKind)> {
        let h = self.0.get()?;
        Ok((proto::Mem::first(&h.mems), h.kind()))
    }
}


/// A request in flight: its comm (by serial number, as NCCL's token names
/// it) and its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub(super) kind: ReqKind,
    pub(super) comm: u64,
    pub(super) id: ReqId,
}

impl Request {
    /// `test`: `Some` once done (the request is then freed).
    pub fn test(&self) -> Result<Option<Done>> {
        p2p::test_request(*self)
            .unwrap_or_else(|| Err(Error::bad_handle("test: the request's comm is closed")))
    }
    /// NCCL's token for it.
    pub fn into_token(self) -> *mut c_void {
        handles::req_token(self.kind, self.comm, self.id.slot, self.id.gen)
    }
}
