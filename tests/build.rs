fn main() {
    println!("cargo:rerun-if-changed=c/capture_logger.c");
    println!("cargo:rerun-if-changed=c/freelist.c");
    println!("cargo:rerun-if-changed=c/fake_cuda.c");
    cc::Build::new()
        .file("c/capture_logger.c")
        .compile("weft_capture_logger");
    // The micro-benchmarks' baseline, optimised like the Rust side it is
    // compared with.
    cc::Build::new()
        .file("c/freelist.c")
        .opt_level(2)
        .compile("weft_c_freelist");
    fake_cuda();
}

/// The stand-in CUDA driver, built as `libcuda.so.1` twice: complete in
/// `$OUT_DIR/fake-cuda`, and without `cuMemAlloc_v2` in
/// `$OUT_DIR/fake-cuda-no-alloc`. Tests run programs with one of them on
/// `LD_LIBRARY_PATH` (`WEFT_FAKE_CUDA_DIR`, `WEFT_FAKE_CUDA_NO_ALLOC_DIR`).
fn fake_cuda() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let compiler = cc::Build::new().get_compiler();
    for (dir, env, defines) in [
        ("fake-cuda", "WEFT_FAKE_CUDA_DIR", &[][..]),
        (
            "fake-cuda-no-alloc",
            "WEFT_FAKE_CUDA_NO_ALLOC_DIR",
            &["-DFAKE_CUDA_NO_ALLOC"][..],
        ),
    ] {
        let dir = out.join(dir);
        std::fs::create_dir_all(&dir).expect("create the fake driver's directory");
        let status = compiler
            .to_command()
            .args(["-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o"])
            .arg(dir.join("libcuda.so.1"))
            .args(defines)
            .arg("c/fake_cuda.c")
            .arg("-lpthread")
            .status()
            .expect("run the C compiler");
        assert!(status.success(), "building the fake libcuda.so.1 failed");
        println!("cargo:rustc-env={env}={}", dir.display());
    }
}
