//! Finding NCCL's headers (net, CollNet and, in a source tree, RMA) in a directory, supplying what they include but
//! the directory lacks, and running bindgen over them.

use std::path::{Path, PathBuf};

/// The header layouts found in the wild.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// An installed `nccl_net.h` next to `nccl.h` (NCCL <= 2.23, the PyPI wheels).
    Installed,
    /// NCCL's source tree: `src/include/plugin/nccl_net.h` + `net/net_v*.h`.
    SourceTree,
    /// The example plugin's headers: `plugins/net/example/nccl/net.h` (net only).
    Example,
}

/// A header set ready for bindgen.
#[derive(Debug)]
pub struct Headers {
    /// Which layout.
    pub layout: Layout,
    /// The directory given.
    pub root: PathBuf,
    /// The header to include.
    pub main: PathBuf,
    /// Include directories, in order (the stub directory last, so real headers win).
    pub include: Vec<PathBuf>,
    /// What codegen supplied itself (reported in its output).
    pub supplied: Vec<String>,
}

impl Headers {
    /// Where a family's tables came from, for the `Source:` line of its
    /// descriptor files: the header NCCL declares them in, relative to the
    /// directory given.
    pub fn source_of(&self, family: &str) -> String {
        let file = match (self.layout, family) {
            (Layout::SourceTree, "rma") => {
                "src/include/plugin/nccl_rma.h and rma/rma_v*.h".to_owned()
            }
            (Layout::SourceTree, _) => "src/include/plugin/nccl_net.h".to_owned(),
            _ => self
                .main
                .strip_prefix(&self.root)
                .unwrap_or(&self.main)
                .display()
                .to_string(),
        };
        format!("{file} ({:?} layout)", self.layout)
    }
}

// Declarations codegen supplies when a header set includes files it does not
// ship. Written from the ABI reference, never copied from NCCL; each is only
// used when the real file is absent.
const CUDA_RUNTIME: &str = "/* supplied by weft-codegen: the CUDA types nccl.h names */\n\
#include <stddef.h>\n\
typedef struct CUstream_st* cudaStream_t;\n";
const EMPTY: &str = "/* supplied by weft-codegen: nothing Weft needs */\n";
const NCCL_COMMON: &str = "/* supplied by weft-codegen: logger types */\n\
typedef enum {NCCL_LOG_NONE=0, NCCL_LOG_VERSION=1, NCCL_LOG_WARN=2, NCCL_LOG_INFO=3, NCCL_LOG_ABORT=4, NCCL_LOG_TRACE=5} ncclDebugLogLevel;\n\
typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...);\n";
const NET_DEVICE: &str = "/* supplied by weft-codegen: the device-offload handle */\n\
typedef enum {NCCL_NET_DEVICE_HOST=0, NCCL_NET_DEVICE_UNPACK=1} ncclNetDeviceType;\n\
typedef struct { ncclNetDeviceType netDeviceType; int netDeviceVersion; void* handle; size_t size; int needsProxyProgress; } ncclNetDeviceHandle_v7_t;\n\
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v8_t;\n\
typedef ncclNetDeviceHandle_v8_t ncclNetDeviceHandle_t;\n";

/// Supplies the CUDA headers NCCL's headers include (only their types matter).
fn put_cuda(
    put: &mut impl FnMut(&str, &str, &str) -> Result<(), String>,
    why: &str,
) -> Result<(), String> {
    for h in ["cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"] {
        put(
            h,
            if h == "cuda_runtime.h" {
                CUDA_RUNTIME
            } else {
                EMPTY
            },
            why,
        )?;
    }
    Ok(())
}

/// Finds the layout of `dir` and prepares `stub` with what is missing.
pub fn locate(dir: &Path, stub: &Path) -> Result<Headers, String> {
    std::fs::create_dir_all(stub).map_err(|e| format!("{}: {e}", stub.display()))?;
    let mut supplied = Vec::new();
    let mut put = |name: &str, text: &str, why: &str| -> Result<(), String> {
        let p = stub.join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
        }
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        supplied.push(format!("{name} ({why})"));
        Ok(())
    };
    let (layout, main, include) = if dir.join("src/include/plugin/nccl_net.h").exists() {
        // nccl.h is generated from nccl.h.in at build time: make a stand-in
        // by filling its version placeholders.
        let tmpl = dir.join("src/nccl.h.in");
        let text =
            std::fs::read_to_string(&tmpl).map_err(|e| format!("{}: {e}", tmpl.display()))?;
        let text = ["Major", "Minor", "Patch", "Version"]
            .iter()
            .fold(text, |t, k| t.replace(&format!("${{nccl:{k}}}"), "0"))
            .replace("${nccl:Suffix}", "");
        put(
            "nccl.h",
            &text,
            "stand-in for the nccl.h that NCCL's build generates from src/nccl.h.in",
        )?;
        put_cuda(&mut put, "CUDA header")?;
        // The net headers and, where the tree has them, the RMA headers:
        // nccl_rma.h and every rma/rma_vN.h (a release's nccl_rma.h
        // includes only the versions it knows; each has an include guard).
        let plugin = dir.join("src/include/plugin");
        let mut wrapper = String::from(
            "/* supplied by weft-codegen: every plugin header of the tree */\n#include \"nccl_net.h\"\n",
        );
        if plugin.join("nccl_rma.h").exists() {
            wrapper.push_str("#include \"nccl_rma.h\"\n");
        }
        let mut rma: Vec<String> = std::fs::read_dir(plugin.join("rma"))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|n| n.starts_with("rma_v") && n.ends_with(".h"))
                    .collect()
            })
            .unwrap_or_default();
        rma.sort();
        for h in &rma {
            wrapper.push_str(&format!("#include \"rma/{h}\"\n"));
        }
        put(
            "weft_plugin_headers.h",
            &wrapper,
            "the header bindgen reads: nccl_net.h and the RMA headers",
        )?;
        (
            Layout::SourceTree,
            stub.join("weft_plugin_headers.h"),
            vec![plugin, dir.join("src/include")],
        )
    } else if dir.join("nccl_net.h").exists() && dir.join("nccl.h").exists() {
        put_cuda(&mut put, "CUDA header the wheel omits")?;
        let net = std::fs::read_to_string(dir.join("nccl_net.h")).map_err(|e| e.to_string())?;
        if net.contains("\"nccl_common.h\"") && !dir.join("nccl_common.h").exists() {
            put(
                "nccl_common.h",
                NCCL_COMMON,
                "omitted by the wheel: the logger type",
            )?;
        }
        if net.contains("\"net_device.h\"") && !dir.join("net_device.h").exists() {
            put(
                "net_device.h",
                NET_DEVICE,
                "omitted by the wheel: the device handle",
            )?;
        }
        (
            Layout::Installed,
            dir.join("nccl_net.h"),
            vec![dir.to_path_buf()],
        )
    } else {
        let ex = [dir.join("plugins/net/example/nccl"), dir.to_path_buf()]
            .into_iter()
            .find(|d| d.join("net.h").exists() && d.join("net_v5.h").exists())
            .ok_or_else(|| {
                format!(
                    "{}: no NCCL headers found (expected nccl_net.h + nccl.h, src/include/plugin/nccl_net.h, or plugins/net/example/nccl/net.h)",
                    dir.display()
                )
            })?;
        (Layout::Example, ex.join("net.h"), vec![ex])
    };
    let mut include = include;
    include.push(stub.to_path_buf());
    Ok(Headers {
        layout,
        root: dir.to_path_buf(),
        main,
        include,
        supplied,
    })
}

/// Runs bindgen over the headers and returns its Rust output.
pub fn bindgen(h: &Headers) -> Result<String, String> {
    let mut b = bindgen::Builder::default()
        .header(h.main.to_string_lossy())
        .allowlist_type("ncclNet_v[0-9]+_t|ncclCollNet_v[0-9]+_t|ncclRma_v[0-9]+_t|ncclResult_t")
        .allowlist_var("nccl[A-Z][A-Za-z]*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(false)
        .derive_debug(false)
        .derive_copy(false)
        .generate_comments(false)
        // NCCL's own tree is C++ (nccl_common.h includes <cstdint>).
        .clang_arg(if h.layout == Layout::SourceTree {
            "-xc++"
        } else {
            "-xc"
        });
    if h.layout == Layout::SourceTree {
        b = b.clang_arg("-std=c++17");
    }
    for i in &h.include {
        b = b.clang_arg(format!("-I{}", i.display()));
    }
    b.generate()
        .map(|g| g.to_string())
        .map_err(|e| format!("bindgen over {}: {e}", h.main.display()))
}
