fn main() {
    println!("cargo:rerun-if-changed=c/capture_logger.c");
    cc::Build::new()
        .file("c/capture_logger.c")
        .compile("weft_capture_logger");
}
