fn main() {
    let map = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("exports.map");
    println!("cargo:rerun-if-changed={}", map.display());
    // Only the cdylib gets the version script; the rlib and test binaries are untouched.
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={}", map.display());
}
