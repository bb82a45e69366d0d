//! Shared pieces of Weft's integration tests and demo: the capturing NCCL
//! logger, loopback configuration, and event-driven poll loops with generous
//! timeouts (this machine is small and shared; tests never sleep to sync).

pub mod collnet_cell;
pub mod emu;
pub mod forge;
pub mod host;
pub mod matrix;
pub mod micro;
pub mod netns;
pub mod peer;
pub mod rma_group;

use std::time::{Duration, Instant};

use weft::config::{Config, Param};

/// Switches read only by Weft's tests and demo (never by the plugin).
pub const TEST_PARAMS: &[Param] = &[
    Param {
        name: "WEFT_TEST_TIMEOUT",
        default: "300",
        accepted: "seconds, decimals allowed, 0.1 ..= 3600",
        meaning: "how long a test's poll loop waits for an event before failing (it prints the load average)",
    },
    Param {
        name: "WEFT_TEST_PLUGIN",
        default: "set by ./weft test; else target/<profile>/libnccl_net_weft.so",
        accepted: "path to the built plugin",
        meaning: "the library the dlopen tests load",
    },
    Param {
        name: "WEFT_TEST_NCCL_HEADERS",
        default: "set by ./weft test; else target/nccl-headers",
        accepted: "directory with 2.18.3/ and 2.23.4/ (include files; 2.23.4's libnccl.so.2) and cuobjdump/",
        meaning: "NCCL's real headers for the codegen check of v5..v8; NCCL's library and cuobjdump for the GPU-check pruning test",
    },
    Param {
        name: "WEFT_TEST_OFFLINE",
        default: "unset",
        accepted: "`1`",
        meaning: "without PyPI access: the codegen check against NCCL's wheels and the GPU-check pruning test say they did not run instead of failing",
    },
    Param {
        name: "WEFT_TEST_MATRIX_PROVIDERS",
        default: "`tcp;ofi_rxm,shm`",
        accepted: "comma-separated libfabric provider names",
        meaning: "the providers the version matrix runs on (`verbs;ofi_rxm` inside a verbs guest: docs/verbs.md says where that stands)",
    },
    Param {
        name: "WEFT_TEST_MATRIX_RMA_PROVIDERS",
        default: "those of `WEFT_TEST_MATRIX_PROVIDERS`",
        accepted: "comma-separated libfabric provider names, or empty",
        meaning: "the providers the matrix's RMA rows run on (empty: none)",
    },
    Param {
        name: "WEFT_TEST_REMOTE_PEER",
        default: "unset; set by tools/vm/verbs-check",
        accepted: "`host:port`",
        meaning: "where `tools/vm/remote-peer` serves `weft-peer`s in the other verbs guest, for the tests between the two guests' kernels (`cluster::across_guests_*`, docs/verbs.md)",
    },
    Param {
        name: "WEFT_TEST_ISOLATED",
        default: "unset; set by the tests themselves",
        accepted: "`1`",
        meaning: "marks a test rerun in a process of its own under plain `cargo test` (`weft_tests::isolated!`); nextest needs none",
    },
];

/// The poll-loop timeout (`WEFT_TEST_TIMEOUT`, default 300 s).
pub fn timeout() -> Duration {
    match std::env::var("WEFT_TEST_TIMEOUT") {
        Ok(v) => weft::config::seconds("WEFT_TEST_TIMEOUT", &v, 0.1, 3600.0)
            .unwrap_or_else(|e| panic!("{e}")),
        Err(_) => Duration::from_secs(300),
    }
}

/// The address of `len` bytes that are not mapped (a fresh anonymous
/// mapping, unmapped at once): memory a registration must refuse under
/// `FI_MR_ALLOCATED`. Nothing may read or write it.
pub fn unmapped_range(len: usize) -> *mut u8 {
    // SAFETY: maps fresh anonymous memory and unmaps it at once; only the
    // address is returned, and no one dereferences it.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "mmap of {len} bytes");
        libc::munmap(p, len);
        p.cast()
    }
}

pub use weft::tools::status_kb;

/// Every `.rs` file of the plugin crate, sorted: its path relative to
/// `plugin/src` and its text (what the source checks, `layers.rs` and
/// `unsafe_code.rs`, read).
pub fn plugin_sources() -> Vec<(std::path::PathBuf, String)> {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).expect("plugin/src") {
            let p = e.expect("a directory entry").path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugin/src");
    let mut all = Vec::new();
    walk(&root, &mut all);
    all.sort();
    all.into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("a source file");
            (
                p.strip_prefix(&root).expect("under plugin/src").to_owned(),
                text,
            )
        })
        .collect()
}

pub use weft::tools::load_average;

/// Calls `step` until it returns `Some`, yielding between calls; panics with
/// `what` and the load average after [`timeout`].
pub fn poll_until<T>(what: &str, mut step: impl FnMut() -> Option<T>) -> T {
    let limit = timeout();
    let start = Instant::now();
    loop {
        if let Some(v) = step() {
            return v;
        }
        if start.elapsed() > limit {
            panic!(
                "timed out after {:?} waiting for {what}; load average: {}",
                limit,
                load_average()
            );
        }
        std::thread::yield_now();
    }
}

/// The domain of the first loopback device of `provider` (for tests and
/// tools that use the fabric layer directly).
pub fn loopback_domain(provider: &str) -> Result<std::sync::Arc<weft::fabric::Domain>, String> {
    loopback_domain_for(provider, false)
}

/// [`loopback_domain`], opened for RMA (`rma`) as the RDMA protocol opens it.
pub fn loopback_domain_for(
    provider: &str,
    rma: bool,
) -> Result<std::sync::Arc<weft::fabric::Domain>, String> {
    let devs = weft::device::discover(&loopback(provider)).map_err(|e| e.to_string())?;
    let dev = devs
        .first()
        .ok_or_else(|| format!("{provider}: no loopback device"))?;
    weft::fabric::Domain::open(dev.info_for(rma)).map_err(|e| e.to_string())
}

/// The one device a test of `provider` uses (its `WEFT_IFACE`): `lo` for
/// the sockets-based providers; for verbs, `rxe0`, the Soft-RoCE device the
/// verbs stage's guest makes (tools/vm/init), whose domain is named after it.
pub fn test_iface(provider: &str) -> &'static str {
    if provider.starts_with("verbs") {
        "rxe0"
    } else {
        "lo"
    }
}

/// A configuration that uses exactly `provider` on its test device
/// ([`test_iface`]: loopback but for verbs) only.
pub fn loopback(provider: &str) -> Config {
    Config {
        providers: vec![weft::config::canonical_provider(provider)],
        ifaces: weft::config::IfaceFilter::parse(&format!("={}", test_iface(provider)))
            .expect("a valid filter"),
        ..Config::default()
    }
}

/// The capturing logger (C, `c/capture_logger.c`) standing in for NCCL's.
pub mod capture {
    use std::ffi::{c_char, c_int, c_ulong, CStr};

    extern "C" {
        /// Records one line; a `weft::log::NcclDebugLogger`.
        pub fn weft_test_capture_logger(
            level: c_int,
            flags: c_ulong,
            file: *const c_char,
            line: c_int,
            fmt: *const c_char,
            ...
        );
        /// Writes each line to stderr at once, with the time and the pid
        /// (for processes whose log a test keeps in a file); a
        /// `weft::log::NcclDebugLogger`.
        pub fn weft_test_stderr_logger(
            level: c_int,
            flags: c_ulong,
            file: *const c_char,
            line: c_int,
            fmt: *const c_char,
            ...
        );
        fn weft_test_capture_count() -> c_int;
        fn weft_test_capture_get(
            i: c_int,
            level: *mut c_int,
            flags: *mut c_ulong,
            line: *mut c_int,
            file: *mut c_char,
            fmt: *mut c_char,
            text: *mut c_char,
        ) -> c_int;
    }

    /// One line NCCL's logger received.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Line {
        /// `ncclDebugLogLevel`.
        pub level: i32,
        /// Subsystem flags.
        pub flags: u64,
        /// Source file.
        pub file: String,
        /// Source line.
        pub line: i32,
        /// The format string Weft passed.
        pub fmt: String,
        /// The formatted text.
        pub text: String,
    }

    /// Every line recorded so far.
    pub fn lines() -> Vec<Line> {
        // SAFETY: plain C getter guarded by a mutex.
        let n = unsafe { weft_test_capture_count() };
        (0..n)
            .filter_map(|i| {
                let (mut level, mut flags, mut line) = (0, 0, 0);
                let mut file = [0 as c_char; 256];
                let mut fmt = [0 as c_char; 64];
                let mut text = [0 as c_char; 1024];
                // SAFETY: the buffers have the sizes the C side copies.
                let rc = unsafe {
                    weft_test_capture_get(
                        i,
                        &mut level,
                        &mut flags,
                        &mut line,
                        file.as_mut_ptr(),
                        fmt.as_mut_ptr(),
                        text.as_mut_ptr(),
                    )
                };
                let s = |b: &[c_char]| {
                    // SAFETY: the C side NUL-terminates every copied string.
                    unsafe { CStr::from_ptr(b.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                };
                (rc == 0).then(|| Line {
                    level,
                    // c_ulong is u64 on LP64 but not everywhere.
                    #[allow(clippy::useless_conversion)]
                    flags: u64::from(flags),
                    file: s(&file),
                    line,
                    fmt: s(&fmt),
                    text: s(&text),
                })
            })
            .collect()
    }
}

/// The `FI_*` and `WEFT_*` variables a caller may set for the tests (the
/// runner's knobs of [`TEST_PARAMS`] and the soak's length); every other is
/// removed by [`clean_env`].
const KEPT: &[&str] = &[
    "WEFT_TEST_TIMEOUT",
    "WEFT_TEST_PLUGIN",
    "WEFT_TEST_NCCL_HEADERS",
    "WEFT_TEST_OFFLINE",
    "WEFT_TEST_MATRIX_PROVIDERS",
    "WEFT_TEST_MATRIX_RMA_PROVIDERS",
    "WEFT_TEST_REMOTE_PEER",
    ISOLATED,
    "WEFT_SOAK_SECS",
];

/// Makes a test's process independent of the caller's shell: removes every
/// `FI_*` and `WEFT_*` variable but [`KEPT`] (a `FI_PROVIDER` or
/// `WEFT_PROTOCOL` exported by the operator would otherwise reach the
/// plugin and every child a test starts), then keeps libfabric's tcp on
/// loopback (`FI_TCP_IFACE=lo`; tests on other interfaces set their own).
/// Each test sets what it needs itself. Runs once, when the test starts in
/// a process of its own (no other thread reads the environment then).
fn clean_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (k, _) in std::env::vars_os() {
            let Some(name) = k.to_str() else { continue };
            if (name.starts_with("FI_") || name.starts_with("WEFT_")) && !KEPT.contains(&name) {
                std::env::remove_var(&k);
            }
        }
        std::env::set_var("FI_TCP_IFACE", "lo");
    });
}

/// Set in a test's own process by [`rerun_isolated`].
const ISOLATED: &str = "WEFT_TEST_ISOLATED"; // documented in TEST_PARAMS

/// Runs the calling test in a process of its own when the harness does not.
///
/// The plugin's state (configuration, devices, registries, the keeper) is per
/// process, and tests choose different providers and timeouts. nextest runs
/// every test in a process of its own; plain `cargo test` runs a binary's
/// tests as threads of one process. A test that touches the plugin starts
/// with [`isolated!`]: under nextest, or in the child, this returns false and
/// the test goes on; otherwise it runs the same test (by its thread's name,
/// which libtest sets to the test's) in a child process, shows its output,
/// fails if it failed, and returns true. In place, it first cleans the
/// environment ([`clean_env`]).
pub fn rerun_isolated() -> bool {
    if std::env::var_os("NEXTEST").is_some() || std::env::var_os(ISOLATED).is_some() {
        clean_env();
        return false;
    }
    let Some(name) = std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .map(str::to_owned)
    else {
        // One test thread (--test-threads=1): tests run one at a time on the
        // main thread, whose name is not the test's; run in place.
        clean_env();
        return false;
    };
    let exe = std::env::current_exe().expect("current_exe");
    let out = std::process::Command::new(exe)
        // --include-ignored: the parent runs it only if it was selected
        // (an ignored test, e.g. the soak, by --ignored).
        .args([
            name.as_str(),
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ISOLATED, "1")
        .output()
        .expect("run the test in a process of its own");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} failed in its own process ({})",
        out.status
    );
    true
}

/// Two tests of `f("verbs;ofi_rxm")`, `$rdma` and `$sendrecv` under each
/// protocol, each in a process of its own. Ignored here (this machine has
/// no RDMA device): `tools/vm/verbs-check` runs every ignored test whose
/// name starts with `verbs_` inside a Soft-RoCE guest (`./weft test-verbs`,
/// docs/verbs.md).
#[macro_export]
macro_rules! on_verbs {
    ($f:ident: $rdma:ident, $sendrecv:ident) => {
        #[test]
        #[ignore = "needs an RDMA device: runs in the Soft-RoCE guests of ./weft test-verbs"]
        fn $rdma() {
            $crate::isolated!();
            std::env::set_var("WEFT_PROTOCOL", "rdma");
            $f("verbs;ofi_rxm");
        }
        #[test]
        #[ignore = "needs an RDMA device: runs in the Soft-RoCE guests of ./weft test-verbs"]
        fn $sendrecv() {
            $crate::isolated!();
            std::env::set_var("WEFT_PROTOCOL", "sendrecv");
            $f("verbs;ofi_rxm");
        }
    };
}

/// Two tests of `f(provider)`, `$tcp` on tcp and `$shm` on shm, each in a
/// process of its own.
#[macro_export]
macro_rules! both {
    ($f:ident: $tcp:ident, $shm:ident) => {
        #[test]
        fn $tcp() {
            $crate::isolated!();
            $f("tcp");
        }
        #[test]
        fn $shm() {
            $crate::isolated!();
            $f("shm");
        }
    };
}

/// Runs `f(provider)` with `WEFT_PROTOCOL=protocol`, in a process of its
/// own, for each `provider_protocol` listed:
/// `weft_tests::each!(f: tcp_rdma, shm_sendrecv)` makes the tests
/// `f::tcp_rdma` and `f::shm_sendrecv`.
#[macro_export]
macro_rules! each {
    ($f:ident: $($variant:ident),+ $(,)?) => {
        mod $f {
            $(
                #[test]
                fn $variant() {
                    $crate::isolated!();
                    let (provider, protocol) = stringify!($variant)
                        .split_once('_')
                        .expect("a variant is provider_protocol");
                    std::env::set_var("WEFT_PROTOCOL", protocol);
                    super::$f(provider);
                }
            )+
        }
    };
}

/// Runs the enclosing test in a process of its own (see [`rerun_isolated`]).
#[macro_export]
macro_rules! isolated {
    () => {
        if $crate::rerun_isolated() {
            return;
        }
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn docs_test_table_matches_the_code() {
        let doc = include_str!("../../docs/testing.md");
        let table = weft::config::markdown_table(super::TEST_PARAMS);
        assert!(
            doc.contains(&table),
            "docs/testing.md's table of the runner's variables differs from tests/src/lib.rs; it must read:\n{table}"
        );
        let table = weft::config::markdown_table(weft::config::TEST_SWITCHES);
        assert!(
            doc.contains(&table),
            "docs/testing.md's table of test switches differs from weft::config::TEST_SWITCHES; it must read:\n{table}"
        );
    }
}
