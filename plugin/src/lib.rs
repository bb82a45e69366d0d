//! Weft: an NCCL network plugin over libfabric.
//!
//! This crate builds `libnccl_net_weft.so`. The NCCL plugin tables it exports
//! are generated from version descriptors (see docs/versions.md); the
//! crate itself is the version-free core, in layers that
//! `docs/architecture.md` draws and `tests/tests/layers.rs` checks.
//!
//! Exports: rustc links a cdylib with its own version script that makes every
//! symbol local except `#[no_mangle]` public items, and the only such items in
//! Weft are the `ncclNetPlugin_vN` / `ncclCollNetPlugin_vN` /
//! `ncclRmaPlugin_vN` tables. (A second
//! version script of ours cannot narrow rustc's: ld lets its explicit `global`
//! names win.) `tests/tests/symbols.rs` runs `nm -D --defined-only` on the
//! built library and fails on any other exported symbol.

/// Declares the crate's layers: public to Weft's own tests (cargo feature
/// `testing`, which only `weft-tests` turns on), crate-private in the shipped
/// library, so that what NCCL loads exposes nothing but its tables and what no
/// table reaches is dead code the compiler reports. The two binaries reach
/// what they need through [`tools`].
macro_rules! layers {
    ($($(#[$attr:meta])* $name:ident),* $(,)?) => {$(
        $(#[$attr])*
        #[cfg(feature = "testing")]
        pub mod $name;
        $(#[$attr])*
        #[cfg(not(feature = "testing"))]
        pub(crate) mod $name;
    )*};
}

layers!(
    adapter, collnet, config, core, device, error, fabric, freelist, gpu, log, memkind, mr, nccl,
    proto, rma
);

#[cfg(feature = "testing")]
pub mod testing;
pub mod tools;

/// The NCCL releases that pick each net API version (from each release's
/// plugin loader): NCCL looks up the newest table it knows.
pub const NCCL_RELEASES: &[(u32, &str)] = &[
    (5, "2.12"),
    (6, "2.13-2.18"),
    (7, "2.19"),
    (8, "2.20-2.23"),
    (9, "2.24-2.25"),
    (10, "2.26-2.27"),
    (11, "2.28-2.29"),
    (12, "2.30-"),
];

/// The NCCL releases that pick each RMA API version (NCCL looks up the
/// newest RMA table it knows, first in `libnccl-rma.so`, then in the net
/// plugin's library).
pub const NCCL_RMA_RELEASES: &[(u32, &str)] = &[
    (13, "2.30.3-2.30.6"),
    (14, "2.30.7-2.30.x"),
    (15, "2.31"),
    (16, "2.32-"),
];

// The exported tables: one line per API version and family, generated from
// the descriptors in `weft-api` by `weft-macros`. Every member is served but
// the optional ones named `null`: device offload (`getDeviceMr`,
// `irecvConsumed`: no device-side networking), and for CollNet, which runs on
// host memory and physical devices, DMA-BUF and NIC fusion (`regMrDmaBuf`,
// `makeVDevice`; the net tables serve both).
weft_api::net_v5!(weft_macros::export);
weft_api::net_v6!(weft_macros::export);
weft_api::net_v7!(weft_macros::export { null = [getDeviceMr, irecvConsumed] });
weft_api::net_v8!(weft_macros::export { null = [getDeviceMr, irecvConsumed] });
weft_api::net_v9!(weft_macros::export { null = [getDeviceMr, irecvConsumed] });
weft_api::net_v10!(weft_macros::export { null = [getDeviceMr, irecvConsumed] });
weft_api::net_v11!(weft_macros::export { null = [getDeviceMr, irecvConsumed] });
weft_api::net_v12!(weft_macros::export { null = [getDeviceMr, irecvConsumed] });
weft_api::collnet_v5!(weft_macros::export);
weft_api::collnet_v6!(weft_macros::export { null = [regMrDmaBuf] });
weft_api::collnet_v7!(weft_macros::export { null = [regMrDmaBuf] });
weft_api::collnet_v8!(weft_macros::export { null = [regMrDmaBuf] });
weft_api::collnet_v9!(weft_macros::export { null = [regMrDmaBuf, makeVDevice] });
weft_api::collnet_v10!(weft_macros::export { null = [regMrDmaBuf, makeVDevice] });
weft_api::collnet_v11!(weft_macros::export { null = [regMrDmaBuf, makeVDevice] });
weft_api::collnet_v12!(weft_macros::export { null = [regMrDmaBuf, makeVDevice] });
// RMA (NCCL 2.30.3+): every member served, as a GIN-proxy device (the v13
// loader requires it; see `rma` for what this build claims).
weft_api::rma_v13!(weft_macros::export);
weft_api::rma_v14!(weft_macros::export);
weft_api::rma_v15!(weft_macros::export);
weft_api::rma_v16!(weft_macros::export);
