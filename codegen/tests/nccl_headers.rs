//! The committed descriptors against NCCL's real headers.
//!
//! v5..v8: the nvidia-nccl-cu12 wheels 2.18.3 (v5, v6) and 2.23.4 (v5..v8),
//! which `./weft test` downloads (pinned sha256) into
//! `WEFT_TEST_NCCL_HEADERS`. v9..v12 exist only in NCCL's source tree, which
//! CI cannot fetch: `cargo run -p weft-codegen -- --check <nccl checkout>`
//! re-checks them by hand, and the ABI guard (tests/tests/abi.rs) covers
//! them in CI.

use std::path::PathBuf;

use weft_codegen::{check, from_dir};

fn headers_dir() -> PathBuf {
    std::env::var_os("WEFT_TEST_NCCL_HEADERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/nccl-headers"
            ))
        })
}

fn generated() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../api-versions/src/generated"
    ))
}

fn check_release(release: &str, versions: std::ops::RangeInclusive<u32>) {
    let dir = headers_dir().join(release);
    if !dir.join("nccl_net.h").exists() {
        if std::env::var("WEFT_TEST_OFFLINE").as_deref() == Ok("1") {
            eprintln!("WEFT_TEST_OFFLINE=1: NCCL {release} headers absent; descriptors v{versions:?} NOT checked against them");
            return;
        }
        panic!(
            "NCCL {release} headers not found in {}: run the README's test command (it downloads the nvidia-nccl-cu12 wheels), \
             or set WEFT_TEST_OFFLINE=1 on a machine without PyPI access",
            dir.display()
        );
    }
    let (mut descs, _) = from_dir(&dir).unwrap_or_else(|e| panic!("NCCL {release}: {e}"));
    descs.retain(|d| versions.contains(&d.version));
    let want = 2 * versions.clone().count();
    assert_eq!(
        descs.len(),
        want,
        "NCCL {release}: expected net and CollNet for v{versions:?}"
    );
    let n = check(&descs, &generated()).unwrap_or_else(|e| panic!("NCCL {release}: {e}"));
    assert_eq!(n, want);
}

#[test]
fn nccl_2_18_3_wheel_matches_v5_v6() {
    check_release("2.18.3", 5..=6);
}

#[test]
fn nccl_2_23_4_wheel_matches_v5_to_v8() {
    check_release("2.23.4", 5..=8);
}
