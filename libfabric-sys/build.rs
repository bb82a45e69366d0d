//! Generates bindings to whatever libfabric pkg-config finds, and compiles the
//! `static inline` fi_* calls into real symbols (bindgen's `wrap_static_fns`).

use std::env;
use std::path::PathBuf;

const PACKAGES: &str = "apt-get install libfabric-dev libfabric-bin libclang-dev clang pkg-config";

fn fail(what: &str) -> ! {
    // One line, naming what is missing and the Debian packages that bring it.
    eprintln!("error: libfabric-sys: {what}; on Debian 12 run: {PACKAGES}");
    std::process::exit(1);
}

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let lib = match pkg_config::Config::new()
        .atleast_version("1.17")
        .probe("libfabric")
    {
        Ok(lib) => lib,
        Err(e) => {
            let text = e.to_string();
            let first = text
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or("no detail")
                .to_owned();
            fail(&format!(
                "libfabric >= 1.17 not found by pkg-config ({first})"
            ))
        }
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let header =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("wrapper.h");
    let static_fns = out.join("static_fns");

    let mut builder = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_args(
            lib.include_paths
                .iter()
                .map(|p| format!("-I{}", p.display())),
        )
        .allowlist_function("fi_.*")
        .allowlist_type("fi_.*|fid_.*|fid")
        .allowlist_var("FI_.*")
        // Deprecated in 1.x and removed in 2.x: never bind them.
        .blocklist_function("fi_rx_size_left|fi_tx_size_left")
        .derive_default(true)
        .layout_tests(false)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&static_fns)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for (k, v) in &lib.defines {
        builder = builder.clang_arg(match v {
            Some(v) => format!("-D{k}={v}"),
            None => format!("-D{k}"),
        });
    }

    // bindgen loads libclang at run time and panics when it is absent: turn that
    // into the same one-line message (and keep the panic text off the screen).
    std::panic::set_hook(Box::new(|_| {}));
    let generated =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || builder.generate()));
    let bindings = match generated {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => fail(&format!(
            "bindgen could not parse the libfabric headers ({e})"
        )),
        Err(_) => fail("libclang not found (bindgen needs it)"),
    };
    drop(std::panic::take_hook());
    // What these headers know beyond 1.17, as cfgs (src/lib.rs turns them
    // into constants and version-independent helpers):
    // - fi_mr_dmabuf: DMA-BUF registration (`FI_MR_DMABUF`, 1.20+);
    // - fi_opt_cuda_api_permitted: `FI_OPT_CUDA_API_PERMITTED` (1.18+).
    println!("cargo::rustc-check-cfg=cfg(fi_mr_dmabuf)");
    println!("cargo::rustc-check-cfg=cfg(fi_opt_cuda_api_permitted)");
    let text = bindings.to_string();
    if text.contains("pub struct fi_mr_dmabuf") && text.contains("pub const FI_MR_DMABUF") {
        println!("cargo::rustc-cfg=fi_mr_dmabuf");
    }
    if text.contains("FI_OPT_CUDA_API_PERMITTED") {
        println!("cargo::rustc-cfg=fi_opt_cuda_api_permitted");
    }
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs to OUT_DIR");

    let mut cc = cc::Build::new();
    cc.file(static_fns.with_extension("c"))
        .include(header.parent().expect("wrapper.h has a parent"))
        .warnings(false)
        .flag_if_supported("-Wno-deprecated-declarations");
    for p in &lib.include_paths {
        cc.include(p);
    }
    cc.compile("weft_fi_static_fns");
}
