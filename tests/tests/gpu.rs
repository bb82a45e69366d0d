//! GPU memory without a GPU: `weft-gpu-probe` runs with the fake CUDA
//! driver (`tests/c/fake_cuda.c`, built as `libcuda.so.1`) on
//! `LD_LIBRARY_PATH`, or with none, so the driver is found and loaded the
//! way the plugin finds a real one (cudarc's names, `libcuda.so.1` among
//! them). What only a real GPU shows (GPUDirect through a CUDA-enabled
//! libfabric, NCCL's own use) is docs/gpu.md.

use std::process::Command;

const PROBE: &str = env!("CARGO_BIN_EXE_weft-gpu-probe");
const FAKE: &str = env!("WEFT_FAKE_CUDA_DIR");
const FAKE_NO_ALLOC: &str = env!("WEFT_FAKE_CUDA_NO_ALLOC_DIR");

/// Runs the probe in `mode` with the driver directory `lib` (None: no
/// driver at all) and extra environment; its stdout.
fn probe(mode: &str, lib: Option<&str>, env: &[(&str, &str)]) -> String {
    let mut c = Command::new(PROBE);
    c.arg(mode)
        .env("WEFT_IFACE", "lo")
        .env("FI_TCP_IFACE", "lo")
        .env("NCCL_DEBUG", "INFO")
        .env("WEFT_TEST_TIMEOUT", "60")
        .env_remove("WEFT_TEST_HMEM");
    // The driver directory goes first; the rest of the path stays (it may
    // name the libfabric under test, as in `./weft test-libfabric2`).
    if let Some(dir) = lib {
        let rest = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        c.env("LD_LIBRARY_PATH", format!("{dir}:{rest}"));
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run weft-gpu-probe");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("--- {mode} {env:?}\n{text}");
    assert!(
        out.status.success(),
        "weft-gpu-probe {mode}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn without_a_driver_weft_is_host_only_and_says_why() {
    weft_tests::isolated!();
    let out = probe("status", None, &[]);
    assert!(out.contains("driver unavailable: no CUDA driver library (looked for libcuda.so"));
    assert!(
        out.contains("libcuda.so.1"),
        "the versioned name is looked for"
    );
    assert!(out.contains("device 0 ptrSupport 0x1 eager 8192"));
    assert!(out.contains("host memory only (ptrSupport = NCCL_PTR_HOST): no CUDA driver library"));
}

/// The fake driver works, but Debian's libfabric has no CUDA: its providers
/// offer no FI_HMEM, so nothing is claimed and the log says so.
#[test]
fn with_a_driver_but_this_libfabric_weft_is_host_only_and_says_why() {
    weft_tests::isolated!();
    for provider in ["shm", "tcp"] {
        let out = probe("status", Some(FAKE), &[("WEFT_PROVIDER", provider)]);
        assert!(out.contains("driver ok, 1 device(s)"), "{provider}");
        assert!(out.contains("ptrSupport 0x1 eager 8192"), "{provider}");
        assert!(
            out.contains(
                "does not offer FI_HMEM (a libfabric built without CUDA support offers it nowhere)"
            ),
            "{provider}"
        );
    }
}

#[test]
fn a_driver_without_a_symbol_weft_calls_is_not_used() {
    weft_tests::isolated!();
    let out = probe("status", Some(FAKE_NO_ALLOC), &[]);
    assert!(out.contains("driver unavailable: the CUDA driver library lacks cuMemAlloc_v2"));
    assert!(out.contains("ptrSupport 0x1"));
}

#[test]
fn a_driver_whose_init_fails_is_not_used() {
    weft_tests::isolated!();
    let out = probe("status", Some(FAKE), &[("FAKE_CUDA_INIT_FAIL", "1")]);
    assert!(out.contains("cuInit failed: cuInit: CUDA_ERROR_NO_DEVICE (100)"));
    assert!(out.contains("ptrSupport 0x1"));
}

#[test]
fn pointers_are_classified_by_the_driver() {
    weft_tests::isolated!();
    let out = probe("classify", Some(FAKE), &[("FAKE_CUDA_DEVICES", "2")]);
    for line in [
        "host Host",
        "device0 Cuda(0)",
        "inside Cuda(0)",
        "last Cuda(1)",
        "live 0",
    ] {
        assert!(out.lines().any(|l| l == line), "missing {line:?}");
    }
    assert!(out.contains("is device memory of device 7, but the driver lists 2 device(s)"));
}

/// A freelist of device memory: elements are device pointers; growth stops
/// cleanly when the driver runs out, and dropping the list frees it all.
#[test]
fn a_gpu_freelist_grows_then_fails_cleanly() {
    weft_tests::isolated!();
    let out = probe("freelist", Some(FAKE), &[("FAKE_CUDA_ALLOC_LIMIT", "2")]);
    assert!(out.contains("elem 0 Cuda(0)") && out.contains("elem 16 Cuda(0)"));
    assert!(out.contains(
        "alloc 32 failed: freelist growth failed: could not allocate 65536 bytes: cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2)"
    ));
    assert!(out.contains("capacity 32 in_use 32"));
    assert!(out.contains("live after drop 0"));
}

/// With device memory registered as host memory (`WEFT_TEST_HMEM=system`:
/// the fake driver's device memory is host memory), the whole CUDA path
/// runs: the claim, regMr of device memory (and a host pointer refused as
/// CUDA), transfers of 1 B to 256 KiB between device buffers with eager
/// copies off, a registered GPU freelist, and iflush calling the driver.
#[test]
fn cuda_buffers_end_to_end_with_emulated_hmem() {
    weft_tests::isolated!();
    for (provider, protocol) in [("shm", "rdma"), ("tcp", "rdma"), ("tcp", "sendrecv")] {
        let out = probe(
            "transfer",
            Some(FAKE),
            &[
                ("WEFT_TEST_HMEM", "system"),
                ("WEFT_PROVIDER", provider),
                ("WEFT_PROTOCOL", protocol),
            ],
        );
        let what = format!("{provider}/{protocol}");
        let dmabuf = dmabuf_expected(provider);
        let ptr_support = if dmabuf {
            "ptrSupport 0x7"
        } else {
            "ptrSupport 0x3"
        };
        assert!(out.contains(ptr_support), "{what}: {ptr_support}");
        if dmabuf {
            for line in [
                "DMA-BUF registration supported (NCCL_PTR_DMABUF)",
                "dmabuf host type refused: regMrDmaBuf: memory type 0x1: DMA-BUF registration takes CUDA memory",
                "dmabuf bad fd refused: regMrDmaBuf: -1 is not a file descriptor",
                "receive buffer registered through a DMA-BUF at offset 4096",
            ] {
                assert!(out.contains(line), "{what}: {line:?}");
            }
        } else {
            assert!(
                out.contains("dmabuf refused: regMrDmaBuf: device 0 (")
                    && out.contains("did not claim NCCL_PTR_DMABUF"),
                "{what}"
            );
            assert!(
                says_dmabuf_missing(&out),
                "{what}: why DMA-BUF is not claimed"
            );
        }
        let cuda_api = if libfabric_sys::HAS_OPT_CUDA_API_PERMITTED {
            "FI_OPT_CUDA_API_PERMITTED not set: this libfabric has no CUDA support, so there is nothing to forbid".to_owned()
        } else {
            format!(
                "FI_OPT_CUDA_API_PERMITTED not set: not known to the headers of libfabric {}",
                headers()
            )
        };
        assert!(out.contains(&cuda_api), "{what}: {cuda_api:?}");
        assert!(out.contains(&format!("protocol {protocol}")), "{what}");
        assert!(
            out.contains("host-as-cuda refused: regMr: NCCL says"),
            "{what}"
        );
        for size in [1, 100, 8192, 262144] {
            assert!(
                out.contains(&format!("size {size} received {size} match true")),
                "{what}: size {size}"
            );
        }
        assert!(
            out.contains("gpu freelist elem Cuda(0) registered true"),
            "{what}"
        );
        assert!(out.contains("iflush request None flushes 1"), "{what}");
        assert!(out.contains("eager 0 mr_entries 2"), "{what}");
    }
}

/// The version of the libfabric headers Weft was built with, as its log
/// lines name it.
fn headers() -> String {
    libfabric_sys::version_text(libfabric_sys::HEADERS_FI_VERSION)
}

/// Whether DMA-BUF registration should be claimed on `provider`: where
/// libfabric knows it, and the provider addresses registrations by virtual
/// address (shm; tcp uses offsets, where libfabric's map mislocates them).
fn dmabuf_expected(provider: &str) -> bool {
    libfabric_sys::dmabuf_known() && provider == "shm"
}

/// Whether the init line says DMA-BUF is not claimed for want of libfabric
/// support: the headers, the running library, or (with both) the provider's
/// offset addressing.
fn says_dmabuf_missing(out: &str) -> bool {
    let why = if !libfabric_sys::HAS_MR_DMABUF {
        format!(
            "Weft was built with the headers of libfabric {}, which has no FI_MR_DMABUF (1.20+)",
            headers()
        )
    } else if !libfabric_sys::dmabuf_known() {
        "the running libfabric".to_owned()
    } else {
        "addresses registrations by offset (no FI_MR_VIRT_ADDR)".to_owned()
    };
    out.lines().any(|l| {
        l.contains("no DMA-BUF registration (NCCL_PTR_DMABUF not claimed; NCCL registers GPU memory by address): ")
            && l.contains(&why)
    })
}

/// A GPU that cannot export DMA-BUFs (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`
/// = 0, as without the open kernel modules): CUDA is claimed, DMA-BUF not,
/// and the log says why (or, where libfabric lacks DMA-BUF, that reason
/// comes first).
#[test]
fn a_gpu_that_cannot_export_dmabufs_is_registered_by_address() {
    weft_tests::isolated!();
    let out = probe(
        "transfer",
        Some(FAKE),
        &[
            ("WEFT_TEST_HMEM", "system"),
            ("WEFT_PROVIDER", "shm"),
            ("WEFT_PROTOCOL", "sendrecv"),
            ("FAKE_CUDA_NO_DMABUF", "1"),
        ],
    );
    assert!(out.contains("ptrSupport 0x3"));
    if dmabuf_expected("shm") {
        assert!(out.contains(
            "no DMA-BUF registration (NCCL_PTR_DMABUF not claimed; NCCL registers GPU memory by address): \
             GPU 0 does not export DMA-BUFs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0"
        ));
    } else {
        assert!(says_dmabuf_missing(&out));
    }
    assert!(out.contains("did not claim NCCL_PTR_DMABUF"));
    assert!(out.contains("size 262144 received 262144 match true"));
}
