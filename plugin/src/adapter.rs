//! What the generated adapters call: the C boundary (panics, result codes,
//! NULL checks), argument conversions, and one function per table member in
//! the newest API's terms. Argument structs are named after NCCL's C argument
//! names; a version that lacks an argument gets the default (NULL, 0).

use std::ffi::{c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub use crate::core::Properties;
use crate::core::{self, Error, Result};

/// The table name (NCCL 2.12 matches `NCCL_NET` case-sensitively).
pub const NAME: &CStr = c"Weft";

/// NCCL's logger type.
pub type Logger = crate::log::NcclDebugLogger;

/// The `ncclResult_t` values one API version's NCCL knows.
#[derive(Debug, Clone, Copy)]
pub struct Results {
    /// `ncclSystemError`.
    pub system: c_int,
    /// `ncclInternalError`.
    pub internal: c_int,
    /// `ncclInvalidUsage`.
    pub invalid_usage: c_int,
    /// `ncclRemoteError`, or `ncclSystemError` where the release lacks it.
    pub remote: c_int,
}

/// Runs one adapter body: catches panics, logs failures with what failed,
/// and maps the error class to this version's code.
pub fn boundary(codes: &Results, what: &str, f: impl FnOnce() -> Result<()>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            tracing::warn!("{what} failed: {e}");
            match e.code {
                core::Code::System => codes.system,
                core::Code::Internal => codes.internal,
                core::Code::InvalidUsage => codes.invalid_usage,
                core::Code::Remote => codes.remote,
            }
        }
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            tracing::warn!(
                "{what}: internal error (a bug in Weft, please report it): panic: {msg}"
            );
            codes.internal
        }
    }
}

/// A NULL check for a pointer NCCL passes to be written through.
///
/// # Safety
/// `p` is NULL or points to a live, writable `T` that nothing else accesses
/// while the reference lives (NCCL's output arguments).
pub unsafe fn out_ref<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: non-NULL pointers NCCL passes for output point to a live T it owns.
    unsafe { p.as_mut() }.ok_or_else(|| Error::internal(format!("NULL `{what}` argument")))
}

/// Writes through an output pointer (see [`out_ref`]).
///
/// # Safety
/// As for [`out_ref`].
unsafe fn write<T>(p: *mut T, v: T, what: &str) -> Result<()> {
    // SAFETY: upheld by the caller.
    *unsafe { out_ref(p, what) }? = v;
    Ok(())
}

/// A size NCCL passes as `int` (older versions) or `size_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CSize {
    /// Absent.
    #[default]
    None,
    /// `int`.
    Int(c_int),
    /// `size_t`.
    Size(usize),
}

impl CSize {
    /// The value, refusing negative `int`s (NCCL misuse).
    pub fn get(self, what: &str) -> Result<usize> {
        match self {
            CSize::None => Ok(0),
            CSize::Size(s) => Ok(s),
            CSize::Int(i) => {
                usize::try_from(i).map_err(|_| Error::internal(format!("negative {what} {i}")))
            }
        }
    }
}

/// A sizes array NCCL passes as `int*` or `size_t*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SizeArray {
    /// Absent or NULL.
    #[default]
    None,
    /// `int*`.
    Int(*mut c_int),
    /// `size_t*`.
    Size(*mut usize),
}

impl SizeArray {
    /// Reads entry `i`.
    ///
    /// # Safety
    /// The array has more than `i` entries.
    unsafe fn get(self, i: usize, what: &str) -> Result<usize> {
        // SAFETY: the caller bounds `i` by NCCL's `n`.
        match self {
            // SAFETY: non-NULL, and the caller bounds `i`.
            SizeArray::Int(p) if !p.is_null() => CSize::Int(unsafe { *p.add(i) }).get(what),
            // SAFETY: non-NULL, and the caller bounds `i`.
            SizeArray::Size(p) if !p.is_null() => Ok(unsafe { *p.add(i) }),
            _ => Err(Error::internal(format!("NULL `{what}` array"))),
        }
    }

    /// Writes entry `i`, refusing values an `int` cannot hold.
    ///
    /// # Safety
    /// The array has more than `i` entries.
    unsafe fn set(self, i: usize, v: usize, what: &str) -> Result<()> {
        // SAFETY: the caller bounds `i` by NCCL's `n`.
        match self {
            SizeArray::Int(p) if !p.is_null() => {
                let v = c_int::try_from(v).map_err(|_| {
                    Error::internal(format!("{what} {v} does not fit the int NCCL passes"))
                })?;
                // SAFETY: non-NULL, and the caller bounds `i`.
                unsafe { *p.add(i) = v };
                Ok(())
            }
            SizeArray::Size(p) if !p.is_null() => {
                // SAFETY: non-NULL, and the caller bounds `i`.
                unsafe { *p.add(i) = v };
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// Conversion of a C argument to the core's argument type.
pub trait Conv<T> {
    /// Converts.
    fn conv(self) -> T;
}

impl<T, U> Conv<*mut U> for *mut T {
    fn conv(self) -> *mut U {
        self.cast()
    }
}
impl<T, U> Conv<*const U> for *const T {
    fn conv(self) -> *const U {
        self.cast()
    }
}
macro_rules! same {
    ($($t:ty),*) => { $(impl Conv<$t> for $t { fn conv(self) -> $t { self } })* };
}
same!(c_int, u64, usize, Option<Logger>);
impl Conv<CSize> for c_int {
    fn conv(self) -> CSize {
        CSize::Int(self)
    }
}
impl Conv<CSize> for usize {
    fn conv(self) -> CSize {
        CSize::Size(self)
    }
}
impl Conv<SizeArray> for *mut c_int {
    fn conv(self) -> SizeArray {
        SizeArray::Int(self)
    }
}
impl Conv<SizeArray> for *mut usize {
    fn conv(self) -> SizeArray {
        SizeArray::Size(self)
    }
}

/// Declares argument structs whose fields default to NULL / 0.
macro_rules! args {
    ($($member:ident { $($field:ident: $ty:ty = $default:expr),* $(,)? })*) => {
        $(
            #[allow(non_camel_case_types, non_snake_case, missing_docs)]
            #[derive(Debug, Clone, Copy)]
            pub struct $member { $(pub $field: $ty),* }
            impl Default for $member {
                fn default() -> Self { Self { $($field: $default),* } }
            }
        )*
    };
}

const NULL: *mut c_void = std::ptr::null_mut();
const NULL2: *mut *mut c_void = std::ptr::null_mut();

/// `ncclNetSGE_vN_t*` of any version (v8+): its `size` is 32 bits in v8
/// and `size_t` from v9 on; the rest is the same.
#[derive(Debug, Clone, Copy, Default)]
pub enum SgePtr {
    /// Not given.
    #[default]
    None,
    /// v8: 32-bit size.
    Narrow(*const c_void),
    /// v9+: `size_t` size.
    Wide(*const c_void),
}

#[repr(C)]
struct Sge<S> {
    mhandle: *mut c_void,
    address: *mut c_void,
    size: S,
}

impl SgePtr {
    /// (mhandle, address, size) of the one element of a list of `n` (NCCL
    /// always passes one).
    ///
    /// # Safety
    /// The pointer is NULL or NCCL's SGE array of the version it came from.
    unsafe fn only(self, n: c_int, what: &str) -> Result<(*mut c_void, *mut c_void, usize)> {
        if n != 1 {
            return Err(Error::internal(format!(
                "{what}: {n} scatter-gather parts (NCCL passes 1)"
            )));
        }
        let null = || Error::internal(format!("{what}: NULL scatter-gather list"));
        // SAFETY: NCCL's array of this version's layout (caller's contract).
        unsafe {
            match self {
                SgePtr::None => Err(null()),
                SgePtr::Narrow(p) => p
                    .cast::<Sge<u32>>()
                    .as_ref()
                    .map(|s| (s.mhandle, s.address, s.size as usize))
                    .ok_or_else(null),
                SgePtr::Wide(p) => p
                    .cast::<Sge<usize>>()
                    .as_ref()
                    .map(|s| (s.mhandle, s.address, s.size))
                    .ok_or_else(null),
            }
        }
    }
}

macro_rules! sge {
    ($($m:ident :: $t:ident => $v:ident),*) => {$(
        impl Conv<SgePtr> for *mut crate::$m::$t {
            fn conv(self) -> SgePtr {
                SgePtr::$v(self.cast_const().cast())
            }
        }
    )*};
}
sge!(collnet_v8::ncclNetSGE_v8_t => Narrow, collnet_v9::ncclNetSGE_v9_t => Wide,
     collnet_v10::ncclNetSGE_v10_t => Wide, collnet_v11::ncclNetSGE_v11_t => Wide,
     collnet_v12::ncclNetSGE_v12_t => Wide);

/// `ncclNetVDeviceProps_vN_t*` of any version (v9+): `{int ndevs; int
/// devs[cap]}`, where `cap` is 4 up to v11 and 8 from v12.
#[derive(Debug, Clone, Copy)]
pub struct VProps {
    ptr: *const c_int,
    cap: usize,
}

impl Default for VProps {
    fn default() -> Self {
        Self {
            ptr: std::ptr::null(),
            cap: 0,
        }
    }
}

impl VProps {
    /// The devices listed.
    ///
    /// # Safety
    /// The pointer is NULL or NCCL's struct of the version it came from.
    unsafe fn devs(self) -> Result<Vec<i32>> {
        if self.ptr.is_null() {
            return Err(Error::internal("makeVDevice: NULL props"));
        }
        // SAFETY: NCCL's struct: ndevs, then `cap` ints.
        let n = unsafe { *self.ptr };
        let n = usize::try_from(n)
            .ok()
            .filter(|n| (1..=self.cap).contains(n))
            .ok_or_else(|| {
                Error::internal(format!(
                    "makeVDevice: ndevs = {n} (1 ..= {} in this API version)",
                    self.cap
                ))
            })?;
        // SAFETY: n <= cap entries follow ndevs.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.add(1), n) }.to_vec())
    }
}

/// Any version's `ncclNetVDeviceProps_vN_t*`: the capacity of `devs`
/// follows from the struct's size (`{int ndevs; int devs[cap]}` in every
/// version so far), so a new version's struct converts without code here.
impl<T> Conv<VProps> for *mut T {
    fn conv(self) -> VProps {
        VProps {
            ptr: self.cast_const().cast(),
            cap: std::mem::size_of::<T>().saturating_sub(4) / 4,
        }
    }
}

/// `ncclNetCommConfig_vN_t` (v10+), the same in every version.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CommConfig {
    /// -1: undefined.
    pub traffic_class: c_int,
}

/// NCCL's connection handle buffer.
///
/// # Safety
/// `p` is NULL or NCCL's handle buffer of `NCCL_NET_HANDLE_MAXSIZE` bytes.
unsafe fn handle<'a>(p: *mut c_void) -> Result<&'a mut [u8; crate::nccl::HANDLE_SIZE]> {
    // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE (128) bytes.
    unsafe { p.cast::<[u8; crate::nccl::HANDLE_SIZE]>().as_mut() }
        .ok_or_else(|| Error::internal("NULL connection handle"))
}

fn ctx_or_process(ctx: *mut c_void) -> Result<*mut c_void> {
    if ctx.is_null() {
        core::process_ctx()
    } else {
        Ok(ctx)
    }
}

/// The `ncclNet` members (functions named after them, as NCCL spells them).
#[allow(non_snake_case)]
pub mod net {
    use super::*;

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
        // SAFETY: NCCL's output slot (NULL is refused).
        let out = unsafe { out_ref(a.recvComm, "recvComm")? };
        *out = std::ptr::null_mut();
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
    pub fn deregMr(a: args::deregMr) -> Result<()> {
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
    pub fn closeSend(a: args::closeSend) -> Result<()> {
        core::close_send(a.sendComm)
    }

    /// `closeRecv`.
    pub fn closeRecv(a: args::closeRecv) -> Result<()> {
        core::close_recv(a.recvComm)
    }

    /// `closeListen`.
    pub fn closeListen(a: args::closeListen) -> Result<()> {
        core::close_listen(a.listenComm)
    }

    /// `finalize(ctx)`.
    pub fn finalize(a: args::finalize) -> Result<()> {
        core::finalize(a.ctx)
    }

    /// `setNetAttr`: a tuning hint; accepted, and nothing in SENDRECV uses it.
    pub fn setNetAttr(a: args::setNetAttr) -> Result<()> {
        core::check_ctx(a.ctx)
    }
}

/// The `ncclCollNet` members: conversions to and from [`crate::collnet`].
#[allow(non_snake_case)]
pub mod collnet {
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
    /// `getProperties`: the net device's.
    pub use super::net::get_properties;
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
    pub fn deregMr(a: args::deregMr) -> Result<()> {
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
    pub fn closeColl(a: args::closeColl) -> Result<()> {
        cn::close_coll(a.collComm)
    }
    /// `closeListen`.
    pub fn closeListen(a: args::closeListen) -> Result<()> {
        cn::close_listen(a.listenComm)
    }
    /// `finalize`.
    pub fn finalize(a: args::finalize) -> Result<()> {
        core::finalize(a.ctx)
    }
}
