//! Links the plugin `-z nodelete`: NCCL >= 2.28 `dlclose`s a plugin after its
//! last `finalize` and may load it again. Weft tears everything down at the
//! last `finalize` (keeper thread joined, endpoints, registrations and domains
//! closed) and stays resident, so a later `dlopen` + `init` finds the same
//! code and starts afresh. Unmapping a Rust library is not something to
//! rely on: glibc keeps it mapped anyway while any thread that called into it
//! holds a thread-local destructor, so nodelete makes the behaviour one.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
