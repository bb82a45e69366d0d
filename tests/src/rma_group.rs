//! Groups of `weft-rma-rank` processes (one per rank, each driving one
//! `ncclRmaPlugin_vN` table), with NCCL's CUDA registrations made of the
//! fake driver's device memory (`tests/c/fake_cuda.c` on `LD_LIBRARY_PATH`,
//! `WEFT_TEST_HMEM=system`). Shared by `tests/tests/rma_group.rs` and the
//! version matrix's RMA rows. The rank program's path is the caller's
//! (`CARGO_BIN_EXE_weft-rma-rank` exists only for integration tests).

use std::process::{Child, Command, Output, Stdio};

/// The directory holding the fake `libcuda.so.1`.
pub const FAKE_CUDA: &str = env!("WEFT_FAKE_CUDA_DIR");

/// One rank's result.
#[derive(Debug)]
pub struct RankOut {
    /// Whether it exited 0.
    pub ok: bool,
    /// Its `ok ...` / `error ...` lines.
    pub stdout: String,
    /// libfabric's and the plugin's log.
    pub stderr: String,
}

/// Starts rank `rank` of `n` of `version`'s table on `provider`, handles
/// exchanged through `dir`, with `env` on top of the defaults.
#[allow(clippy::too_many_arguments)]
pub fn spawn(
    bin: &str,
    version: u32,
    rank: u32,
    n: u32,
    dir: &std::path::Path,
    provider: &str,
    env: &[(&str, &str)],
    scenario: &str,
) -> Child {
    let rest = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let mut c = Command::new(bin);
    c.args([version.to_string(), rank.to_string(), n.to_string()])
        .arg(dir)
        .arg(scenario)
        .env("LD_LIBRARY_PATH", format!("{FAKE_CUDA}:{rest}"))
        .env("WEFT_TEST_HMEM", "system")
        .env("WEFT_PROVIDER", provider)
        .env("WEFT_PROTOCOL", "rdma")
        .env("WEFT_IFACE", crate::test_iface(provider))
        .env("FI_TCP_IFACE", "lo")
        .env("NCCL_DEBUG", "INFO")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for &(k, v) in crate::host::verbs_defaults(provider) {
        if std::env::var_os(k).is_none() {
            c.env(k, v);
        }
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawn weft-rma-rank")
}

/// Runs a group of `n` ranks to the end; each rank's result, in rank order.
pub fn run(
    bin: &str,
    version: u32,
    n: u32,
    provider: &str,
    env: &[(&str, &str)],
    scenario: &str,
) -> Vec<RankOut> {
    let dir = tempdir();
    let kids: Vec<Child> = (0..n)
        .map(|r| spawn(bin, version, r, n, &dir, provider, env, scenario))
        .collect();
    let outs: Vec<Output> = kids
        .into_iter()
        .map(|k| k.wait_with_output().expect("wait"))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    outs.into_iter()
        .map(|o| RankOut {
            ok: o.status.success(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        })
        .collect()
}

/// What a rank logs at `connect` when its puts go as plain writes (its
/// targets' providers lose a write's CQ data: announced writes).
pub const PLAIN_WRITES: &str = "as fi_write without CQ data";

/// A fresh directory for a group's handles.
pub fn tempdir() -> std::path::PathBuf {
    use std::hash::{BuildHasher, RandomState};
    let nonce = RandomState::new().hash_one(std::time::SystemTime::now());
    let d = std::env::temp_dir().join(format!("weft-rma-{}-{nonce:x}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// What a rank's output of the `full` scenario lacks (empty: all there),
/// for puts up to `max_put` bytes; `v16`: the table has `getRmaProperties`.
pub fn full_lacks(out: &str, max_put: usize, v16: bool) -> Vec<String> {
    let mut want: Vec<String> = [0usize, 1, 4096, 65536, 1 << 20]
        .into_iter()
        .filter(|&s| s <= max_put)
        .chain([max_put])
        .map(|s| format!("ok put {s} B to every rank, seen with its signal"))
        .collect();
    want.extend(
        [
            "ok devices 1 netDeviceType 2",
            "ok 32 puts in flight per peer, then a signal-only ADD seen after them",
            "ok weak signals into host memory",
            "ok gets from every rank, flushed",
            "ok refused: past the window, forged handle",
            "ok done",
        ]
        .map(String::from),
    );
    let mut lacks: Vec<String> = want
        .into_iter()
        .filter(|l| !out.contains(l.as_str()))
        .collect();
    if out.contains("ok flushesAllPutsOnAnySignal false") != v16 {
        lacks.push(format!(
            "flushesAllPutsOnAnySignal false reported: {}",
            !v16
        ));
    }
    lacks
}
