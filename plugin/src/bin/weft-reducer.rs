//! `weft-reducer`: a CollNet reduction server (see docs/collnet.md
//! and `collnet::reducer`).
//!
//! ```text
//! weft-reducer [--dev N] [--handle-file PATH] [--groups N]
//! ```
//!
//! It reads Weft's configuration from the environment as the plugin does
//! (`WEFT_PROVIDER`, `WEFT_IFACE`, `WEFT_PROTOCOL`, `WEFT_PEER_TIMEOUT`:
//! the same protocol as the ranks), listens on device N (default 0),
//! prints `handle <hex>` on stdout and, with `--handle-file`, writes the
//! hex to PATH (atomically, removed at exit): the ranks find it through
//! `WEFT_COLLNET_REDUCERS`. It serves until SIGINT or SIGTERM, or, with
//! `--groups N`, until N groups have ended. Logs go to stderr (`NCCL_DEBUG=WARN`
//! for warnings only; INFO by default).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use nccl_net_weft::tools::{self, Reducer};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

struct Args {
    dev: i32,
    handle_file: Option<PathBuf>,
    groups: Option<u64>,
}

const USAGE: &str = "usage: weft-reducer [--dev N] [--handle-file PATH] [--groups N]";

/// The arguments; `None` for `--help`.
fn args() -> Result<Option<Args>, String> {
    let mut a = Args {
        dev: 0,
        handle_file: None,
        groups: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--dev" => a.dev = value()?.parse().map_err(|e| format!("--dev: {e}"))?,
            "--handle-file" => a.handle_file = Some(value()?.into()),
            "--groups" => a.groups = Some(value()?.parse().map_err(|e| format!("--groups: {e}"))?),
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    Ok(Some(a))
}

fn main() -> ExitCode {
    let a = match args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("weft-reducer: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let level = match std::env::var("NCCL_DEBUG")
        .unwrap_or_default()
        .to_ascii_uppercase()
        .as_str()
    {
        "WARN" => tracing::Level::WARN,
        "TRACE" => tracing::Level::TRACE,
        _ => tracing::Level::INFO,
    };
    tools::log_to_stderr(level);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
    }
    let ctx = match tools::init(tools::InitArgs {
        traffic_class: -1,
        ..Default::default()
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("weft-reducer: init failed: {e}");
            return ExitCode::from(1);
        }
    };
    let mut r = match Reducer::new(ctx, a.dev) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("weft-reducer: cannot listen on device {}: {e}", a.dev);
            return ExitCode::from(1);
        }
    };
    let hex = tools::hex(&r.handle());
    if let Some(path) = &a.handle_file {
        let tmp = path.with_extension("tmp");
        if let Err(e) =
            std::fs::write(&tmp, format!("{hex}\n")).and_then(|_| std::fs::rename(&tmp, path))
        {
            eprintln!("weft-reducer: cannot write {}: {e}", path.display());
            return ExitCode::from(1);
        }
    }
    let name = tools::properties(a.dev)
        .map(|p| p.name.to_string_lossy().into_owned())
        .unwrap_or_default();
    tracing::info!(
        "weft-reducer: serving on device {} ({name}), protocol {}",
        a.dev,
        tools::protocol_name().unwrap_or("?")
    );
    let mut out = std::io::stdout();
    let _ = writeln!(out, "handle {hex}").and_then(|_| out.flush());
    r.run(|r| STOP.load(Ordering::Relaxed) || a.groups.is_some_and(|n| r.stats().ended >= n));
    let s = r.stats();
    tracing::info!(
        "weft-reducer: {} groups served ({} failed), {} all-reduces, {} bytes in, {} bytes out",
        s.groups,
        s.failed,
        s.ops,
        s.bytes_in,
        s.bytes_out
    );
    drop(r);
    if let Some(path) = &a.handle_file {
        let _ = std::fs::remove_file(path);
    }
    let _ = tools::finalize(ctx);
    ExitCode::SUCCESS
}
