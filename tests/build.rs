fn main() {
    println!("cargo:rerun-if-changed=c/capture_logger.c");
    println!("cargo:rerun-if-changed=c/freelist.c");
    cc::Build::new()
        .file("c/capture_logger.c")
        .compile("weft_capture_logger");
    // The micro-benchmarks' baseline, optimised like the Rust side it is
    // compared with.
    cc::Build::new()
        .file("c/freelist.c")
        .opt_level(2)
        .compile("weft_c_freelist");
}
