//! What Weft makes of the CUDA driver it finds, for `tests/tests/gpu.rs`:
//! the tests run this with the fake driver (`tests/c/fake_cuda.c`) on
//! `LD_LIBRARY_PATH`, or with none, so that it is loaded the way the
//! plugin loads a real one.
//!
//! ```text
//! weft-gpu-probe status      driver, devices, each device's ptrSupport
//! weft-gpu-probe classify    pointers of host and device memory, and a
//!                            device ordinal the driver does not list
//! weft-gpu-probe freelist    a GPU-backed freelist growing, then failing
//! weft-gpu-probe transfer    regMr(CUDA) (and regMrDmaBuf where claimed),
//!                            send/recv between device buffers, a registered
//!                            GPU freelist, iflush; needs a device that
//!                            claims CUDA
//! ```
//!
//! Each prints `key value` lines; errors print `error ...` and exit 1.

use std::ffi::{c_int, c_void, CString};

use weft::core::{self, props};
use weft::freelist::CudaMemory;
use weft::freelist::{Freelist, Params};
use weft::gpu;
use weft_tests::host;

/// A function of the fake driver (found through the library already
/// loaded under its soname).
fn fake<T: Copy>(name: &str) -> T {
    let lib = CString::new("libcuda.so.1").unwrap();
    let sym = CString::new(name).unwrap();
    // SAFETY: RTLD_NOLOAD only finds an already loaded library; dlsym looks a
    // name up. T is the symbol's function pointer type (caller's promise).
    unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "libcuda.so.1 is not loaded");
        let p = libc::dlsym(h, sym.as_ptr());
        assert!(!p.is_null(), "the fake driver has no {name}");
        std::mem::transmute_copy(&p)
    }
}

fn run(mode: &str) -> Result<(), String> {
    match mode {
        "status" => {
            match gpu::driver() {
                Ok(d) => println!("driver ok, {} device(s)", d.devices()),
                Err(e) => println!("driver unavailable: {e}"),
            }
            let ctx = host::init_logged(&std::env::var("WEFT_PROVIDER").unwrap_or("shm".into()));
            for dev in 0..core::devices().map_err(|e| e.to_string())? as i32 {
                let p = core::properties(dev).map_err(|e| e.to_string())?;
                let s = core::device_stats(dev).map_err(|e| e.to_string())?;
                println!(
                    "device {dev} ptrSupport {:#x} eager {}",
                    p.ptr_support, s.eager_size
                );
            }
            print_gpu_log();
            core::finalize(ctx).map_err(|e| e.to_string())
        }
        "classify" => {
            let d = gpu::driver().map_err(|e| e.to_string())?;
            let host_buf = [0u8; 64];
            println!("host {:?}", d.classify(host_buf.as_ptr().cast())?);
            let a = d.alloc(0, 4096)?;
            let b = d.alloc(d.devices() - 1, 4096)?;
            println!("device0 {:?}", d.classify(a.as_ptr().cast())?);
            // 100 bytes inside the 4096 just allocated (only the address is used).
            let inside = a.as_ptr().wrapping_add(100);
            println!("inside {:?}", d.classify(inside.cast())?);
            println!("last {:?}", d.classify(b.as_ptr().cast())?);
            let set: extern "C" fn(*mut c_void, c_int) -> c_int = fake("fake_cuda_set_ordinal");
            set(b.as_ptr().cast(), 7);
            match d.classify(b.as_ptr().cast()) {
                Ok(k) => println!("rogue {k:?}"),
                Err(e) => println!("rogue error {e}"),
            }
            // SAFETY: both came from alloc and are not used again.
            unsafe {
                d.free(0, a);
                d.free(d.devices() - 1, b);
            }
            let live: extern "C" fn() -> c_int = fake("fake_cuda_live");
            println!("live {}", live());
            Ok(())
        }
        "freelist" => {
            let p = Params {
                elem_size: 4096,
                align: 256,
                elems_per_block: 16,
                max_elems: 64,
            };
            let mut fl = Freelist::new(CudaMemory { dev: 0 }, weft::freelist::NoRegistration, p)
                .map_err(|e| e.to_string())?;
            let mut held = Vec::new();
            for i in 0..64 {
                match fl.alloc() {
                    Ok(e) => {
                        let kind = gpu::driver()
                            .map_err(|e| e.to_string())?
                            .classify(e.ptr.as_ptr().cast())?;
                        if i % 16 == 0 {
                            println!("elem {i} {kind:?}");
                        }
                        held.push(e);
                    }
                    Err(e) => {
                        println!("alloc {i} failed: {e}");
                        println!("capacity {} in_use {}", fl.capacity(), fl.in_use());
                        break;
                    }
                }
            }
            for e in held {
                fl.free(e);
            }
            drop(fl);
            let live: extern "C" fn() -> c_int = fake("fake_cuda_live");
            println!("live after drop {}", live());
            Ok(())
        }
        "transfer" => transfer(),
        other => Err(format!("unknown mode {other:?}")),
    }
}

/// Device buffers end to end through the core, as NCCL drives it.
fn transfer() -> Result<(), String> {
    let e = |e: weft::error::Error| e.to_string();
    let ctx = host::init_logged(&std::env::var("WEFT_PROVIDER").unwrap_or("shm".into()));
    let p = core::properties(0).map_err(e)?;
    println!("ptrSupport {:#x}", p.ptr_support);
    println!("protocol {}", core::protocol_name().map_err(e)?);
    let d = gpu::driver().map_err(|e| e.to_string())?;
    let dmabuf = p.ptr_support & props::PTR_DMABUF != 0;
    let (s, r) = host::pair(ctx);
    const LEN: usize = 256 << 10;
    // The receive buffer starts OFF bytes into its allocation, so that a
    // DMA-BUF of the allocation names it by a non-zero offset, as NCCL's do.
    const OFF: usize = 4096;
    let src = d.alloc(0, LEN)?;
    let alloc = d.alloc(0, OFF + LEN)?;
    // SAFETY: inside the allocation.
    let dst = unsafe { alloc.add(OFF) };
    // The fake driver's device memory is host memory: the test may fill and
    // read it (what only the test does; Weft never touches it).
    // SAFETY: LEN bytes each, allocated above.
    let (src_b, dst_b) = unsafe {
        (
            std::slice::from_raw_parts_mut(src.as_ptr(), LEN),
            std::slice::from_raw_parts_mut(dst.as_ptr(), LEN),
        )
    };
    for (i, b) in src_b.iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    dst_b.fill(0);
    let smh = core::reg_mr(s, src.as_ptr().cast(), LEN, props::PTR_CUDA).map_err(e)?;
    // The receive buffer through regMrDmaBuf where the device claims it (a
    // wrong base address would make the peer's writes miss the registration).
    let rmh = if dmabuf {
        use std::os::fd::AsRawFd;
        let fd = d.dmabuf_fd(alloc, OFF + LEN)?;
        for (what, ty, fd) in [
            ("host type", props::PTR_HOST, fd.as_raw_fd()),
            ("bad fd", props::PTR_CUDA, -1),
        ] {
            match core::reg_mr_dma_buf(r, dst.as_ptr().cast(), LEN, ty, OFF as u64, fd) {
                Ok(_) => println!("dmabuf {what} registered"),
                Err(err) => println!("dmabuf {what} refused: {err}"),
            }
        }
        let mh = core::reg_mr_dma_buf(
            r,
            dst.as_ptr().cast(),
            LEN,
            props::PTR_CUDA,
            OFF as u64,
            fd.as_raw_fd(),
        )
        .map_err(e)?;
        println!("receive buffer registered through a DMA-BUF at offset {OFF}");
        mh
    } else {
        if let Err(err) =
            core::reg_mr_dma_buf(r, dst.as_ptr().cast(), LEN, props::PTR_CUDA, OFF as u64, 0)
        {
            println!("dmabuf refused: {err}");
        }
        core::reg_mr(r, dst.as_ptr().cast(), LEN, props::PTR_CUDA).map_err(e)?
    };
    let host_buf = vec![0u8; 4096];
    match core::reg_mr(s, host_buf.as_ptr() as *mut c_void, 4096, props::PTR_CUDA) {
        Ok(_) => println!("host-as-cuda registered"),
        Err(err) => println!("host-as-cuda refused: {err}"),
    }
    for size in [1usize, 100, 8192, LEN] {
        dst_b[..size].fill(0);
        let arg = core::RecvArg {
            data: dst.as_ptr().cast(),
            size: LEN,
            tag: 5,
            mhandle: rmh,
            phandle: std::ptr::null_mut(),
        };
        // As NCCL's proxy does: keep trying both (with rdma and no eager
        // copy, the send waits for the receive's offer).
        let (mut q, mut rq) = (None, None);
        let (q, rq) = weft_tests::poll_until("isend + irecv", || {
            if rq.is_none() {
                rq = host::irecv_raw(r, &[arg]).expect("irecv");
            }
            if q.is_none() {
                q = host::isend_raw(s, src.as_ptr().cast(), size, 5, smh, std::ptr::null_mut())
                    .expect("isend");
            }
            Some((q?, rq?))
        });
        let (_, got) = host::wait2(q, rq);
        let ok = dst_b[..size] == src_b[..size];
        println!("size {size} received {} match {ok}", got.sizes[0]);
    }
    // A registered GPU-backed freelist on the same device.
    let p = Params {
        elem_size: 8192,
        align: 256,
        elems_per_block: 8,
        max_elems: 16,
    };
    let mut fl = core::gpu_freelist(0, 0, p).map_err(e)?;
    let el = fl.alloc().map_err(|e| e.to_string())?;
    println!(
        "gpu freelist elem {:?} registered {}",
        d.classify(el.ptr.as_ptr().cast())?,
        el.mr.is_some()
    );
    fl.free(el);
    drop(fl);
    let flushes: extern "C" fn() -> c_int = fake("fake_cuda_flushes");
    let before = flushes();
    let f = core::iflush(r, 1, &[rmh]).map_err(e)?;
    println!("iflush request {:?} flushes {}", f, flushes() - before);
    let stats = core::device_stats(0).map_err(e)?;
    println!("eager {} mr_entries {}", stats.eager_size, stats.mr_entries);
    core::dereg_mr(s, smh).map_err(e)?;
    core::dereg_mr(r, rmh).map_err(e)?;
    host::close_pair(s, r);
    // SAFETY: deregistered; not used again.
    unsafe {
        d.free(0, src);
        d.free(0, alloc);
    }
    print_gpu_log();
    core::finalize(ctx).map_err(e)?;
    Ok(())
}

/// The log lines in which Weft says what it claims of GPU memory and why.
fn print_gpu_log() {
    for l in weft_tests::capture::lines() {
        let t = &l.text;
        if [
            "ptrSupport",
            "GPU memory",
            "DMA-BUF",
            "FI_OPT_CUDA_API_PERMITTED",
        ]
        .iter()
        .any(|k| t.contains(k))
        {
            println!("log {t}");
        }
    }
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    if let Err(e) = run(&mode) {
        println!("error {e}");
        std::process::exit(1);
    }
}
