//! GPU memory: whether a device can take it (a probe registration of real device memory, DMA-BUF), and GPU-backed freelists.

use super::*;

/// Whether device `dev` can take GPU memory: a usable driver, a domain
/// opened with `FI_HMEM`, and a registration of real device memory that
/// succeeded on it (NCCL cannot be told "no" after `getProperties`, so
/// nothing is claimed that was not tried). `Ok(gpu)`: the GPU probed;
/// `Err`: what was missing, for the INFO line.
pub(super) fn gpu_claim(
    dev: &crate::device::Device,
    domain: &Arc<Domain>,
) -> std::result::Result<i32, String> {
    use crate::fabric::{Mr, ACCESS_ALL};
    let drv = crate::gpu::driver().map_err(|e| e.to_string())?;
    dev.hmem.clone()?;
    let gpu = 0;
    with_probe(drv, gpu, |mem| {
        // SAFETY: `mem` is PROBE bytes of device memory, freed only after
        // the registration is dropped (at the end of this closure).
        unsafe {
            Mr::register_kind(
                domain,
                mem.as_ptr(),
                PROBE,
                ACCESS_ALL,
                crate::gpu::MemKind::Cuda(gpu),
            )
        }
        .map(|_| gpu)
        .map_err(|e| {
            format!(
                "registering device memory with FI_HMEM_CUDA failed ({e}): is this libfabric built with CUDA support?"
            )
        })
    })
}

/// Bytes of device memory a claim registers to see that it works.
pub(super) const PROBE: usize = 64 << 10;

/// Runs `probe` on `PROBE` bytes of GPU `gpu`'s memory, freed after it.
pub(super) fn with_probe<T>(
    drv: &crate::gpu::Driver,
    gpu: i32,
    probe: impl FnOnce(std::ptr::NonNull<u8>) -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    let mem = drv
        .alloc(gpu, PROBE)
        .map_err(|e| format!("no device memory to probe with: {e}"))?;
    let r = probe(mem);
    // SAFETY: `probe` has returned and dropped what it registered; nothing
    // else holds `mem`.
    unsafe { drv.free(gpu, mem) };
    r
}

/// Whether `domain` takes GPU `gpu`'s memory through DMA-BUF: the headers
/// Weft was built with and the running libfabric know `FI_MR_DMABUF`
/// (1.20+), the driver exports DMA-BUFs of that GPU, and a registration of
/// one succeeds. Otherwise, why not.
pub(super) fn dmabuf_claim(domain: &Arc<Domain>, gpu: i32) -> std::result::Result<(), String> {
    use crate::fabric::{Mr, ACCESS_ALL};
    use std::os::fd::AsRawFd;
    let v = libfabric_sys::version_text;
    if !libfabric_sys::HAS_MR_DMABUF {
        return Err(format!(
            "Weft was built with the headers of libfabric {}, which has no FI_MR_DMABUF (1.20+); \
             rebuild Weft against a newer libfabric to use it",
            v(libfabric_sys::HEADERS_FI_VERSION)
        ));
    }
    let running = libfabric_sys::running_version();
    if running < libfabric_sys::DMABUF_FI_VERSION {
        return Err(format!(
            "the running libfabric {} is older than 1.20 (FI_MR_DMABUF)",
            v(running)
        ));
    }
    if domain.info().mr_mode() & libfabric_sys::FI_MR_VIRT_ADDR == 0 {
        // libfabric's own registration map (tcp, udp, sockets: providers
        // without NIC registration) takes a DMA-BUF registration's base from
        // the wrong arm of fi_mr_attr's union when registrations are
        // addressed by offset (2.1: util_mr_map.c, ofi_mr_map_insert), so a
        // peer's write misses it. NICs that register for real (verbs, EFA)
        // address by virtual address.
        return Err(format!(
            "{} addresses registrations by offset (no FI_MR_VIRT_ADDR), where libfabric's registration map \
             mislocates DMA-BUF registrations",
            domain.info().provider()
        ));
    }
    let drv = crate::gpu::driver().map_err(|e| e.to_string())?;
    drv.dmabuf_supported(gpu)?;
    with_probe(drv, gpu, |mem| {
        let fd = drv.dmabuf_fd(mem, PROBE)?;
        // SAFETY: `mem` is PROBE bytes of device memory, freed only after
        // the registration is dropped; `fd` is open for the call.
        unsafe {
            Mr::register_dmabuf(
                domain,
                mem.as_ptr(),
                PROBE,
                ACCESS_ALL,
                gpu,
                fd.as_raw_fd(),
                0,
            )
        }
        .map(drop)
        .map_err(|e| format!("registering a DMA-BUF of GPU {gpu}'s memory failed ({e})"))
    })
}

/// A freelist of GPU `gpu`'s memory registered on device `dev` (as
/// `FI_HMEM_CUDA`): elements carry the block's descriptor like host ones.
/// Needs a device that claims CUDA.
#[cfg(feature = "testing")]
pub fn gpu_freelist(
    dev: i32,
    gpu: i32,
    p: crate::freelist::Params,
) -> Result<crate::freelist::Freelist<crate::freelist::CudaMemory, crate::mr::KindRegistrar>> {
    let d = physical(&*plugin()?, dev)?;
    if !d.cuda {
        return Err(Error::usage(format!(
            "device {dev} ({}) does not take GPU memory (its INFO line at init says why)",
            d.dev.domain
        )));
    }
    let reg = crate::mr::KindRegistrar {
        domain: DomainRegistrar(Arc::clone(&d.domain)),
        kind: MemKind::Cuda(gpu),
    };
    crate::freelist::Freelist::new(crate::freelist::CudaMemory { dev: gpu }, reg, p)
        .map_err(|e| Error::system(e.to_string()))
}
