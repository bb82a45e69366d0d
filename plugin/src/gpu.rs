//! CUDA through the driver API, loaded at run time.
//!
//! The driver comes from cudarc's bindings with dynamic loading: nothing of
//! CUDA is needed to build Weft, and a host without a driver runs Weft
//! exactly as before. cudarc panics when the library or a symbol is
//! missing, so [`driver`] probes first: the library (cudarc's candidate
//! names, `libcuda.so.1` among them: containers often lack the unversioned
//! name), every symbol Weft calls, `cuInit` and the device count. Only a
//! driver that passed is ever called, and every call is behind the C
//! boundary's guard anyway.
//!
//! What Weft asks of the driver: what memory a pointer is and on which
//! device ([`Driver::classify`]); device memory for GPU-backed freelists
//! ([`Driver::alloc`], outside any graph capture, in the device's primary
//! context); and the flush NCCL needs after GPUDirect writes
//! ([`Driver::flush`]).

use std::ffi::{c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;

use cudarc::driver::sys;

pub use crate::memkind::MemKind;

/// Why CUDA is not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("no CUDA driver library (looked for {0}; is the NVIDIA driver mounted into this container?)")]
    NoLibrary(String),
    #[error("the CUDA driver library lacks {0} (driver too old?)")]
    MissingSymbol(&'static str),
    #[error("cuInit failed: {0}")]
    InitFailed(String),
    #[error("the CUDA driver sees no device")]
    NoDevice,
}

/// Every driver function Weft calls: all must be there before any is.
pub const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuGetErrorName",
    "cuPointerGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuThreadExchangeStreamCaptureMode",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuFlushGPUDirectRDMAWrites",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
];

/// A driver that passed the probe.
#[derive(Debug)]
pub struct Driver {
    devices: i32,
    /// Each device's primary context, retained the first time it is needed
    /// and kept for the process (as NCCL keeps it); 0 until then.
    contexts: std::sync::Mutex<Vec<usize>>,
}

static DRIVER: OnceLock<Result<Driver, Unavailable>> = OnceLock::new();

/// The driver, probed once per process.
pub fn driver() -> Result<&'static Driver, &'static Unavailable> {
    DRIVER.get_or_init(probe).as_ref()
}

fn probe() -> Result<Driver, Unavailable> {
    // SAFETY: only tries to dlopen cudarc's candidate names.
    if !unsafe { sys::is_culib_present() } {
        let names = cudarc::get_lib_name_candidates("cuda");
        let mut linux: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| n.starts_with("libcuda.so"))
            .collect();
        linux.dedup();
        return Err(Unavailable::NoLibrary(linux.join(", ")));
    }
    if let Some(&name) = SYMBOLS.iter().find(|n| !has_symbol(n)) {
        return Err(Unavailable::MissingSymbol(name));
    }
    // SAFETY: every symbol is there (checked above), so cudarc's loader
    // does not panic; cuInit(0) has no other precondition.
    check("cuInit", unsafe { sys::cuInit(0) }).map_err(Unavailable::InitFailed)?;
    let mut devices = 0;
    // SAFETY: as above; writes one int.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut devices)
    })
    .map_err(Unavailable::InitFailed)?;
    if devices <= 0 {
        return Err(Unavailable::NoDevice);
    }
    Ok(Driver {
        devices,
        contexts: std::sync::Mutex::new(vec![0; devices as usize]),
    })
}

/// Whether the driver library (present: the probe's first check) has
/// `name`. cudarc panics on calling a missing symbol, so optional calls are
/// looked up first.
fn has_symbol(name: &str) -> bool {
    // SAFETY: called only once the library is known to be present, so
    // culib() loads it instead of panicking; a lookup only, nothing is called.
    unsafe { sys::culib().get::<*const c_void>(name.as_bytes()) }.is_ok()
}

/// Driver calls that only DMA-BUF export needs (CUDA 11.7+ drivers): looked
/// up when DMA-BUF is asked for, so an older driver still serves the rest.
pub const DMABUF_SYMBOLS: &[&str] = &["cuDeviceGetAttribute", "cuMemGetHandleForAddressRange"];

/// A driver result as text: `call: CUDA_ERROR_NAME (code)`.
fn check(call: &str, r: sys::CUresult) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the probe found cuGetErrorName; it writes a static string or nothing.
    let named = unsafe { sys::cuGetErrorName(r, &mut name) } == sys::CUresult::CUDA_SUCCESS;
    let name = if named && !name.is_null() {
        // SAFETY: the driver returns a NUL-terminated static string.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        "unknown error".to_owned()
    };
    Err(format!("{call}: {name} ({})", r as i32))
}

impl Driver {
    /// Devices the driver sees.
    pub fn devices(&self) -> i32 {
        self.devices
    }

    /// What `ptr` points to: device memory (and whose) or host memory.
    /// Memory the driver does not know is host memory; a device ordinal the
    /// driver does not list is an error.
    pub fn classify(&self, ptr: *const c_void) -> Result<MemKind, String> {
        let mut ty: u32 = 0;
        // SAFETY: the driver only looks the address up; writes one u32.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut ty).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr as sys::CUdeviceptr,
            )
        };
        if r == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
            return Ok(MemKind::Host);
        }
        check("cuPointerGetAttribute(MEMORY_TYPE)", r)?;
        if ty != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Ok(MemKind::Host);
        }
        let mut dev: i32 = -1;
        // SAFETY: as above; writes one int.
        check("cuPointerGetAttribute(DEVICE_ORDINAL)", unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut dev).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr as sys::CUdeviceptr,
            )
        })?;
        if dev < 0 || dev >= self.devices {
            return Err(format!(
                "{ptr:p} is device memory of device {dev}, but the driver lists {} device(s)",
                self.devices
            ));
        }
        Ok(MemKind::Cuda(dev))
    }

    /// Runs `f` in device `dev`'s primary context, with stream capture
    /// relaxed for this thread (so that an allocation never lands in, or
    /// breaks, a graph some other thread is capturing).
    fn in_context<T>(&self, dev: i32, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
        let ctx = self.primary(dev)?;
        // SAFETY: a probed symbol; `ctx` is a retained primary context.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: swaps this thread's capture mode; restored below.
        let relaxed = check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        });
        let out = relaxed.and_then(|()| f());
        // SAFETY: restores the mode swapped out above and pops the context
        // pushed above (the primary context stays retained: `primary`).
        unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode);
            let mut popped: sys::CUcontext = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut popped);
        }
        out
    }

    /// Device `dev`'s primary context, retained once.
    fn primary(&self, dev: i32) -> Result<sys::CUcontext, String> {
        let mut contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        let slot = usize::try_from(dev)
            .ok()
            .and_then(|d| contexts.get_mut(d))
            .ok_or_else(|| format!("device {dev}: the driver lists {}", self.devices))?;
        if *slot == 0 {
            let mut d: sys::CUdevice = 0;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: probed symbols; each writes one value.
            unsafe {
                check("cuDeviceGet", sys::cuDeviceGet(&mut d, dev))?;
                check(
                    "cuDevicePrimaryCtxRetain",
                    sys::cuDevicePrimaryCtxRetain(&mut ctx, d),
                )?;
            }
            *slot = ctx as usize;
        }
        Ok(*slot as sys::CUcontext)
    }

    /// `bytes` of device memory on device `dev`.
    pub fn alloc(&self, dev: i32, bytes: usize) -> Result<NonNull<u8>, String> {
        self.in_context(dev, || {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: writes one device pointer.
            check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes) })?;
            NonNull::new(p as *mut u8).ok_or_else(|| "cuMemAlloc returned NULL".to_owned())
        })
    }

    /// Frees memory from [`Driver::alloc`].
    ///
    /// # Safety
    /// `p` came from `alloc` on `dev` and is not used afterwards.
    pub unsafe fn free(&self, dev: i32, p: NonNull<u8>) {
        let _ = self.in_context(dev, || {
            // SAFETY: the caller's contract.
            check("cuMemFree", unsafe {
                sys::cuMemFree_v2(p.as_ptr() as sys::CUdeviceptr)
            })
        });
    }

    /// Whether GPU `dev` exports its memory as DMA-BUFs: the driver has the
    /// calls and the device says so (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`,
    /// which needs the open kernel modules on most systems).
    pub fn dmabuf_supported(&self, dev: i32) -> Result<(), String> {
        if let Some(name) = DMABUF_SYMBOLS.iter().find(|n| !has_symbol(n)) {
            return Err(format!(
                "the CUDA driver lacks {name} (DMA-BUF export needs a CUDA 11.7 or newer driver)"
            ));
        }
        let mut d: sys::CUdevice = 0;
        let mut supported = 0;
        // SAFETY: probed symbols (above and at the probe); each writes one int.
        unsafe {
            check("cuDeviceGet", sys::cuDeviceGet(&mut d, dev))?;
            check(
                "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)",
                sys::cuDeviceGetAttribute(
                    &mut supported,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                    d,
                ),
            )?;
        }
        if supported == 0 {
            return Err(format!(
                "GPU {dev} does not export DMA-BUFs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0: \
                 the open GPU kernel modules and Linux 5.12+ are needed)"
            ));
        }
        Ok(())
    }

    /// A DMA-BUF file descriptor for `len` bytes of device memory at `ptr`
    /// (what NCCL hands `regMrDmaBuf`). Only after
    /// [`Driver::dmabuf_supported`] said yes.
    pub fn dmabuf_fd(&self, ptr: NonNull<u8>, len: usize) -> Result<OwnedFd, String> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: a symbol looked up by dmabuf_supported; writes one int.
        check("cuMemGetHandleForAddressRange(DMA_BUF_FD)", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&raw mut fd).cast(),
                ptr.as_ptr() as sys::CUdeviceptr,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(format!("cuMemGetHandleForAddressRange returned fd {fd}"));
        }
        // SAFETY: the driver hands over a new descriptor, owned from here.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Makes GPUDirect RDMA writes already done to device `dev`'s memory
    /// visible to its kernels (what NCCL's `iflush` is for).
    pub fn flush(&self, dev: i32) -> Result<(), String> {
        self.in_context(dev, || {
            // SAFETY: a probed symbol with plain enum arguments.
            check("cuFlushGPUDirectRDMAWrites", unsafe {
                sys::cuFlushGPUDirectRDMAWrites(
                    sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                    sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
                )
            })
        })
    }

    /// Adds `v` to the 64-bit value at `p` in device `dev`'s memory and
    /// returns the new value: a read and a write through the driver
    /// (`cuMemcpyDtoH`, `cuMemcpyHtoD`), so the caller must be the value's
    /// only writer (the RMA signals: Weft applies every signal of a
    /// registration under one lock; NCCL's GPU only waits on them).
    ///
    /// # Safety
    /// `p..p+8` is device memory of `dev` that stays allocated for the call.
    pub unsafe fn add_u64(&self, dev: i32, p: *mut u64, v: u64) -> Result<u64, String> {
        self.in_context(dev, || {
            let mut cur: u64 = 0;
            // SAFETY: the caller's contract for `p`; `cur` is 8 host bytes.
            check("cuMemcpyDtoH", unsafe {
                sys::cuMemcpyDtoH_v2((&raw mut cur).cast(), p as sys::CUdeviceptr, 8)
            })?;
            let new = cur.wrapping_add(v);
            // SAFETY: as above, the other way.
            check("cuMemcpyHtoD", unsafe {
                sys::cuMemcpyHtoD_v2(p as sys::CUdeviceptr, (&raw const new).cast(), 8)
            })?;
            Ok(new)
        })
    }
}
