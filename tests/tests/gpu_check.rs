//! The real-NCCL GPU check's staging (tools/gpu-check/): NCCL's library cut
//! to one GPU architecture by `fatbin.py`, read back with NVIDIA's own
//! cuobjdump. Uses NCCL 2.23.4's libnccl.so.2 and cuobjdump 13.5, which
//! `./weft test` downloads (pinned sha256) into `WEFT_TEST_NCCL_HEADERS`.
//! What this cannot show is a GPU loading the result: that is the check
//! itself, on a device machine (docs/gpu.md).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FATBIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tools/gpu-check/fatbin.py");

/// NCCL 2.23.4's library and cuobjdump, or None (with a line saying what
/// did not run) when they are absent and WEFT_TEST_OFFLINE=1.
fn inputs() -> Option<(PathBuf, PathBuf)> {
    let cache = std::env::var_os("WEFT_TEST_NCCL_HEADERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/nccl-headers"
            ))
        });
    let lib = cache.join("2.23.4/libnccl.so.2");
    let tool = cache.join("cuobjdump/cuobjdump");
    if lib.exists() && tool.exists() {
        return Some((lib, tool));
    }
    if std::env::var("WEFT_TEST_OFFLINE").as_deref() == Ok("1") {
        eprintln!(
            "WEFT_TEST_OFFLINE=1: {} or {} absent; the pruning of NCCL NOT checked",
            lib.display(),
            tool.display()
        );
        return None;
    }
    panic!(
        "{} or {} not found: run the README's test command (it downloads the wheels), \
         or set WEFT_TEST_OFFLINE=1 on a machine without PyPI access",
        lib.display(),
        tool.display()
    );
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("weft-gpu-check-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    println!(
        "--- {cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .take(5)
            .collect::<Vec<_>>()
            .join("\n"),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn prune(lib: &Path, out: &Path, arch: u32) -> Output {
    run(Command::new("python3")
        .arg(FATBIN)
        .arg("prune")
        .arg(lib)
        .arg(out)
        .arg(arch.to_string()))
}

/// cuobjdump's list of every cubin and PTX file in `lib` (both fat binary
/// sections), as (architecture, "cubin" | "ptx"), sorted.
fn listing(tool: &Path, lib: &Path) -> Vec<(String, String)> {
    let out = run(Command::new(tool).args(["-all", "-lelf", "-lptx"]).arg(lib));
    assert!(
        out.status.success(),
        "cuobjdump could not read {}",
        lib.display()
    );
    let mut files: Vec<(String, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("ELF file") || l.starts_with("PTX file"))
        .map(|l| {
            // "ELF file    6: libnccl.so.6.sm_90.cubin"
            let mut parts = l.rsplit('.');
            let kind = parts.next().unwrap_or_default().to_owned();
            let arch = parts.next().unwrap_or_default().to_owned();
            (arch, kind)
        })
        .collect();
    files.sort();
    files
}

/// The contents of the sm_90 cubins cuobjdump extracts from `lib`, as
/// sorted hashes (the file names number them, which pruning changes).
fn sm90_cubins(tool: &Path, lib: &Path, dir: &Path) -> Vec<(u64, usize)> {
    std::fs::create_dir_all(dir).expect("extraction directory");
    let out = run(Command::new(tool)
        .args(["-all", "-xelf", "sm_90"])
        .arg(lib)
        .current_dir(dir));
    assert!(
        out.status.success(),
        "cuobjdump could not extract from {}",
        lib.display()
    );
    let mut hashes: Vec<(u64, usize)> = std::fs::read_dir(dir)
        .expect("read extraction directory")
        .map(|e| {
            let bytes = std::fs::read(e.expect("entry").path()).expect("read cubin");
            let mut h = DefaultHasher::new();
            bytes.hash(&mut h);
            (h.finish(), bytes.len())
        })
        .collect();
    hashes.sort();
    hashes
}

#[test]
fn nccl_cut_to_sm90_keeps_exactly_its_cubins_and_still_loads() {
    weft_tests::isolated!();
    let Some((lib, tool)) = inputs() else { return };
    let dir = scratch("sm90");
    let pruned = dir.join("libnccl.so.2");
    let out = prune(&lib, &pruned, 90);
    assert!(out.status.success(), "fatbin.py prune failed");

    let before = listing(&tool, &lib);
    let after = listing(&tool, &pruned);
    let sm90: Vec<_> = before
        .iter()
        .filter(|f| *f == &("sm_90".to_owned(), "cubin".to_owned()))
        .cloned()
        .collect();
    assert!(
        sm90.len() > 100,
        "NCCL 2.23.4 should hold 100+ sm_90 cubins, cuobjdump found {}",
        sm90.len()
    );
    assert!(
        before.len() > 5 * sm90.len(),
        "the original holds every generation: {} files",
        before.len()
    );
    assert_eq!(
        after, sm90,
        "after pruning, exactly the original's sm_90 cubins"
    );

    // The kept cubins are byte for byte the original's (compressed entries
    // moved whole, headers intact: cuobjdump decompresses them).
    let a = sm90_cubins(&tool, &lib, &dir.join("before"));
    let b = sm90_cubins(&tool, &pruned, &dir.join("after"));
    assert_eq!(a.len(), sm90.len());
    assert_eq!(a, b, "the sm_90 cubins differ after pruning");

    // The host side is untouched: the library loads and answers.
    // SAFETY: loading NCCL runs its constructors (static cudart registering
    // its fat binaries, no GPU needed); ncclGetVersion has this signature in
    // every NCCL release and writes one int.
    unsafe {
        let l = libloading::Library::new(&pruned).expect("dlopen the pruned NCCL");
        let get: libloading::Symbol<unsafe extern "C" fn(*mut i32) -> i32> =
            l.get(b"ncclGetVersion\0").expect("ncclGetVersion");
        let mut v = 0;
        assert_eq!(get(&mut v), 0);
        assert_eq!(v, 22304);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_gpu_without_its_cubins_keeps_the_newest_ptx_it_can_compile() {
    weft_tests::isolated!();
    let Some((lib, tool)) = inputs() else { return };
    let dir = scratch("ptx");
    // Blackwell (sm_100) against NCCL 2.23.4: no cubin of major 10, so what
    // such a GPU would load is the compute_90 PTX, JIT-compiled. Ada (sm_89):
    // sm_80 cubins run there; PTX is not needed.
    for (arch, want_arch, want_kind) in [(100, "sm_90", "ptx"), (89, "sm_80", "cubin")] {
        let pruned = dir.join(format!("sm{arch}.so"));
        assert!(prune(&lib, &pruned, arch).status.success());
        let files = listing(&tool, &pruned);
        assert!(!files.is_empty(), "sm_{arch}: nothing kept");
        assert!(
            files.iter().all(|(a, k)| a == want_arch && k == want_kind),
            "sm_{arch}: {files:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_it_cannot_cut_is_an_error_and_writes_nothing() {
    weft_tests::isolated!();
    let Some((lib, _)) = inputs() else { return };
    let dir = scratch("bad");
    let out = dir.join("out.so");
    let readme = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"));
    for (input, arch, why) in [
        (readme, 90, "not a little-endian 64-bit ELF file"),
        (lib.as_path(), 35, "nothing in it loads on sm_35"),
    ] {
        let r = prune(input, &out, arch);
        assert_eq!(r.status.code(), Some(1));
        assert!(
            String::from_utf8_lossy(&r.stderr).contains(why),
            "expected {why:?}"
        );
        assert!(!out.exists(), "nothing is written");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
