//! Links the plugin `-z nodelete`: NCCL >= 2.28 `dlclose`s a plugin after its
//! last `finalize` and may load it again. Weft tears everything down at the
//! last `finalize` (keeper thread joined, endpoints, registrations and domains
//! closed) and stays resident, so a later `dlopen` + `init` finds the same
//! code and starts afresh. Unmapping a Rust library is not something to
//! rely on: glibc keeps it mapped anyway while any thread that called into it
//! holds a thread-local destructor, so nodelete makes the behaviour one.
//!
//! Also lays out, beside the library every build writes
//! (`target/<profile>/libnccl_net_weft.so`), the names NCCL and RCCL look
//! for, as links to it: any `cargo build` or `cargo test` leaves a directory
//! that `LD_LIBRARY_PATH` can point at.
use std::path::Path;

/// The names NCCL and RCCL look for.
const NAMES: [&str; 3] = ["libnccl-net-weft.so", "libnccl-net.so", "librccl-net.so"];
const LIB: &str = "libnccl_net_weft.so";

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    println!("cargo:rerun-if-changed=build.rs");
    // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out.
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let Some(dir) = Path::new(&out).ancestors().nth(3) else {
        return;
    };
    for name in NAMES {
        let link = dir.join(name);
        if std::fs::read_link(&link).is_ok_and(|t| t == Path::new(LIB)) {
            continue;
        }
        let _ = std::fs::remove_file(&link);
        if let Err(e) = std::os::unix::fs::symlink(LIB, &link) {
            println!("cargo:warning=could not lay out {}: {e}", link.display());
        }
    }
}
