//! What the built plugin exports and the file names NCCL and RCCL look for.

use std::path::PathBuf;
use std::process::Command;

/// The `.so` under test: `WEFT_TEST_PLUGIN`, else `libnccl_net_weft.so` in
/// the target directory this test binary was built into.
fn plugin() -> PathBuf {
    if let Ok(p) = std::env::var("WEFT_TEST_PLUGIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/symbols-<hash>
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .join("libnccl_net_weft.so")
}

#[test]
fn exports_only_plugin_tables() {
    weft_tests::isolated!();
    let so = plugin();
    assert!(
        so.exists(),
        "{} not built; run the README's test command",
        so.display()
    );
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&so)
        .output()
        .expect("run nm (binutils)");
    assert!(out.status.success(), "nm failed: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    // Exactly the net and CollNet tables v5..v12 and the RMA tables
    // v13..v16: nothing else (no `ncclGinPlugin_*`, which NCCL's GIN
    // loaders would take for a GIN plugin), and none missing.
    let mut want: Vec<String> = weft::NCCL_RELEASES
        .iter()
        .flat_map(|(v, _)| {
            [
                format!("ncclNetPlugin_v{v}"),
                format!("ncclCollNetPlugin_v{v}"),
            ]
        })
        .chain(
            weft::NCCL_RMA_RELEASES
                .iter()
                .map(|(v, _)| format!("ncclRmaPlugin_v{v}")),
        )
        .collect();
    want.sort();
    let mut got: Vec<String> = exported.iter().map(|s| (*s).to_owned()).collect();
    got.sort();
    assert_eq!(
        got,
        want,
        "{} must export exactly the plugin tables",
        so.display()
    );
}

#[test]
fn nccl_and_rccl_names_are_laid_out_beside_the_cdylib() {
    weft_tests::isolated!();
    let so = plugin();
    let dir = so.parent().expect("plugin dir");
    let real = std::fs::canonicalize(&so).expect("plugin exists");
    for name in ["libnccl-net-weft.so", "libnccl-net.so", "librccl-net.so"] {
        let p = dir.join(name);
        let target = std::fs::canonicalize(&p).unwrap_or_else(|e| {
            panic!(
                "{} missing ({e}); the README's commands lay it out",
                p.display()
            )
        });
        assert_eq!(target, real, "{name} must be the Weft plugin");
    }
}

/// NCCL >= 2.28 dlcloses the plugin after the last finalize; Weft is linked
/// `-z nodelete` so it stays resident and starts afresh on the next init
/// (plugin/build.rs says why; tests/tests/reload.rs runs the cycle).
#[test]
fn plugin_is_linked_nodelete() {
    weft_tests::isolated!();
    let so = plugin();
    let out = Command::new("readelf")
        .arg("-d")
        .arg(&so)
        .output()
        .expect("run readelf (binutils)");
    assert!(out.status.success(), "readelf failed: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("FLAGS_1") && l.contains("NODELETE")),
        "{} lacks DF_1_NODELETE:\n{text}",
        so.display()
    );
}
