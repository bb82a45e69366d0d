//! The README's first command: shows what Weft runs on here, then moves data
//! between two processes through every exported `ncclNetPlugin_vN` table,
//! loaded with dlopen and called with that version's signatures, and prints
//! per version: the NCCL releases that pick it, messages and bytes moved,
//! whether every byte was verified, and the bandwidth.
//!
//! Usage: weft-demo [--provider NAME]   (default tcp, pinned to lo; or shm)
//!
//! Also: `--reload V [--cycles N] [--messages M]` loads table V, runs init ->
//! transfer -> finalize -> dlclose N times (NCCL >= 2.28 unloads plugins), and
//! checks after each dlclose that no Weft thread is left; `--serve` and
//! `--cell` are the other process of the demo and of the test matrix, and
//! `--collnet-cell V` is one CollNet cell of the matrix.

use std::ffi::{c_int, c_void};
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use weft_tests::emu::{self, Net};
use weft_tests::host::pattern;
use weft_tests::peer::{hex, Server};
use weft_tests::poll_until;

const MESSAGES_DEFAULT: usize = 64;
const SIZE: usize = 1 << 20;
const WINDOW: usize = 8;
const TAG: c_int = 3;

use weft_tests::emu::check;
use weft_tests::host::pin_to_loopback as configure;

/// The receiving process: listen, print the handle, accept, receive and verify.
fn serve(version: u32, provider: &str, messages: usize) -> Result<(), String> {
    configure(provider);
    let lib = emu::open();
    let n = emu::net(&lib, version);
    let mut ctx = std::ptr::null_mut();
    let mut h = [0u8; 128];
    let (mut l, mut r) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut buf = vec![0u8; SIZE * WINDOW];
    let mut mh = std::ptr::null_mut();
    // SAFETY: NCCL's calling convention; buffers outlive their requests.
    unsafe {
        check("init", n.init(&mut ctx))?;
        check("listen", n.listen(ctx, 0, h.as_mut_ptr().cast(), &mut l))?;
        println!("handle {}", hex(&h));
        std::io::stdout().flush().map_err(|e| e.to_string())?;
        poll_until("accept", || {
            check("accept", n.accept(l, &mut r, false))
                .map(|()| (!r.is_null()).then_some(()))
                .transpose()
        })?;
        check("closeListen", n.close_listen(l))?;
        check(
            "regMr",
            n.reg_mr(r, buf.as_mut_ptr().cast(), buf.len(), &mut mh),
        )?;
        let mut inflight = std::collections::VecDeque::new();
        let mut next = 0;
        for seq in 0..messages {
            while next < messages && inflight.len() < WINDOW {
                let slot = next % WINDOW;
                let mut data = [buf.as_mut_ptr().wrapping_add(slot * SIZE).cast::<c_void>()];
                let mut req = std::ptr::null_mut();
                poll_until("irecv", || {
                    check(
                        "irecv",
                        n.irecv(r, &mut data, &[SIZE], &mut [TAG], &mut [mh], &mut req),
                    )
                    .map(|()| (!req.is_null()).then_some(()))
                    .transpose()
                })?;
                inflight.push_back((slot, req));
                next += 1;
            }
            let (slot, req) = inflight.pop_front().expect("posted");
            let mut sizes = [0 as c_int; 64];
            poll_until("receive", || {
                let mut done = 0;
                check("test", n.test(req, &mut done, sizes.as_mut_ptr()))
                    .map(|()| (done == 1).then_some(()))
                    .transpose()
            })?;
            if sizes[0] as usize != SIZE
                || buf[slot * SIZE..(slot + 1) * SIZE] != pattern(seq as u64, TAG, SIZE)[..]
            {
                return Err(format!("message {seq}: wrong size {} or content", sizes[0]));
            }
        }
        check("deregMr", n.dereg_mr(r, mh))?;
        check("closeRecv", n.close_recv(r))?;
        if version >= 11 {
            check("finalize", n.finalize(ctx))?;
        }
    }
    println!("ok {messages} {}", messages * SIZE);
    Ok(())
}

/// Sends through table `version` to a child process; returns seconds taken.
/// The plugin is opened here and closed (dlclose) on return.
fn run(version: u32, provider: &str, messages: usize) -> Result<f64, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let server = Server::spawn(&exe, version, provider, messages)?;
    let mut h = server.handle;
    configure(provider);
    let lib = emu::open();
    let n = emu::net(&lib, version);
    let msgs: Vec<u8> = (0..messages as u64)
        .flat_map(|i| pattern(i, TAG, SIZE))
        .collect();
    let mut ctx = std::ptr::null_mut();
    let mut s = std::ptr::null_mut();
    let mut mh = std::ptr::null_mut();
    let start;
    // SAFETY: NCCL's calling convention; `msgs` outlives every request.
    unsafe {
        check("init", n.init(&mut ctx))?;
        let connected = poll_until("connect", || {
            check(
                "connect",
                n.connect(ctx, 0, h.as_mut_ptr().cast(), &mut s, true),
            )
            .map(|()| (!s.is_null()).then_some(()))
            .transpose()
        });
        if let Err(e) = connected {
            return Err(format!(
                "{e}; the receiving process said: {}",
                server.abort()
            ));
        }
        check(
            "regMr",
            n.reg_mr(s, msgs.as_ptr() as *mut c_void, msgs.len(), &mut mh),
        )?;
        start = Instant::now();
        let mut inflight = std::collections::VecDeque::new();
        for i in 0..messages {
            if inflight.len() == WINDOW {
                wait_send(&*n, inflight.pop_front().expect("window"))?;
            }
            let mut req = std::ptr::null_mut();
            let p = msgs.as_ptr().wrapping_add(i * SIZE) as *mut c_void;
            poll_until("isend", || {
                check("isend", n.isend(s, p, SIZE, TAG, mh, &mut req))
                    .map(|()| (!req.is_null()).then_some(()))
                    .transpose()
            })?;
            inflight.push_back(req);
        }
        for q in inflight {
            wait_send(&*n, q)?;
        }
    }
    let verdict = server.finish();
    let secs = start.elapsed().as_secs_f64();
    // SAFETY: as above.
    unsafe {
        check("deregMr", n.dereg_mr(s, mh))?;
        check("closeSend", n.close_send(s))?;
        if version >= 11 {
            check("finalize", n.finalize(ctx))?;
        }
    }
    let verdict = verdict?;
    if verdict != format!("ok {messages} {}", messages * SIZE) {
        return Err(format!("receiver: {verdict}"));
    }
    Ok(secs)
}

/// # Safety
/// `req` is a live send request of `n`.
unsafe fn wait_send(n: &dyn Net, req: *mut c_void) -> Result<(), String> {
    poll_until("send completion", || {
        let mut done = 0;
        let mut size = [0 as c_int];
        // SAFETY: forwarded contract.
        check("test", unsafe { n.test(req, &mut done, size.as_mut_ptr()) })
            .map(|()| (done == 1).then_some(()))
            .transpose()
    })
}

/// Threads of this process with `name` (from /proc/self/task/*/comm).
/// Threads of this process whose name is one of `names`.
fn threads_named(names: &[&str]) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|c| names.contains(&c.trim()))
                .count()
        })
        .unwrap_or(0)
}

/// `--reload`: load, transfer, finalize and unload `cycles` times.
fn reload(version: u32, provider: &str, cycles: usize, messages: usize) -> Result<(), String> {
    let lib_name = emu::plugin_path()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    for cycle in 1..=cycles {
        let secs = run(version, provider, messages)?;
        // The keeper is joined inside finalize, but a joined thread can stay
        // listed in /proc for a moment after pthread_join returns (the kernel
        // wakes the joiner before it reaps the task): wait for it to go.
        let gone = Instant::now() + Duration::from_secs(10);
        let mut keepers = threads_named(&[
            weft::core::keeper::THREAD_NAME,
            weft::core::keeper::WATCHDOG_NAME,
        ]);
        while keepers > 0 && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(1));
            keepers = threads_named(&[
                weft::core::keeper::THREAD_NAME,
                weft::core::keeper::WATCHDOG_NAME,
            ]);
        }
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let resident = maps.contains(&lib_name);
        println!(
            "cycle {cycle}: v{version} {messages} x {} KiB verified in {secs:.2} s; after finalize + dlclose: {keepers} keeper thread(s), library {}",
            SIZE / 1024,
            if resident { "still mapped" } else { "unmapped" }
        );
        if keepers != 0 {
            return Err(format!(
                "cycle {cycle}: a keeper or watchdog thread outlived the last finalize"
            ));
        }
    }
    println!("reloaded {cycles} times");
    Ok(())
}

/// On failure: what Weft told NCCL's logger (WARN and INFO), on stderr.
fn dump_log(who: &str) {
    for l in weft_tests::capture::lines() {
        if l.level <= weft::log::level::INFO {
            eprintln!("{who} log: {}", l.text);
        }
    }
}

/// A matrix cell's last line (what tests/tests/matrix.rs reads) and status.
fn cell_result(r: Result<usize, String>) -> ExitCode {
    match r {
        Ok(n) => {
            println!("checks {n}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("failed {e}");
            // What the plugin warned of says why (the matrix shows stderr).
            for l in weft_tests::capture::lines() {
                if l.level <= weft::log::level::WARN {
                    eprintln!("cell log: {}", l.text);
                }
            }
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut provider = "tcp".to_owned();
    let mut serve_version = None;
    let mut cell_version = None;
    let mut collnet_version = None;
    let mut reload_version = None;
    let mut cycles = 3;
    let mut messages = MESSAGES_DEFAULT;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--provider" if i + 1 < args.len() => {
                provider = weft::config::canonical_provider(&args[i + 1]);
                i += 1;
            }
            "--serve" if i + 1 < args.len() => {
                serve_version = args[i + 1].parse::<u32>().ok();
                i += 1;
            }
            "--messages" if i + 1 < args.len() => {
                messages = args[i + 1].parse().unwrap_or(MESSAGES_DEFAULT);
                i += 1;
            }
            "--reload" if i + 1 < args.len() => {
                reload_version = args[i + 1].parse::<u32>().ok();
                i += 1;
            }
            "--cycles" if i + 1 < args.len() => {
                cycles = args[i + 1].parse().unwrap_or(3);
                i += 1;
            }
            "--cell" if i + 1 < args.len() => {
                cell_version = args[i + 1].parse::<u32>().ok();
                i += 1;
            }
            "--collnet-cell" if i + 1 < args.len() => {
                collnet_version = args[i + 1].parse::<u32>().ok();
                i += 1;
            }
            "-h" | "--help" => {
                println!("usage: weft-demo [--provider tcp|shm|NAME]   (default tcp on lo)");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("weft-demo: unknown argument {other:?}; try --help");
                return ExitCode::from(2);
            }
        }
        i += 1;
    }
    if let Some(v) = collnet_version {
        // One CollNet cell of the test matrix (two ranks, threads of this process).
        weft_tests::host::configure(&provider);
        return cell_result(weft_tests::collnet_cell::cell(v));
    }
    if let Some(v) = cell_version {
        // One cell of the test matrix (tests/tests/matrix.rs runs these).
        let me = std::env::current_exe().expect("current_exe");
        return cell_result(weft_tests::matrix::cell(v, &provider, &me));
    }
    if let Some(v) = reload_version {
        return match reload(v, &provider, cycles, messages) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("failed {e}");
                dump_log("client");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(v) = serve_version {
        return match serve(v, &provider, messages) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("error {e}");
                dump_log("server");
                ExitCode::FAILURE
            }
        };
    }

    let start = Instant::now();
    println!(
        "Weft demo: libfabric {}, provider {provider}{}, plugin {}",
        libfabric_sys::version_text(libfabric_sys::running_version()),
        if provider.starts_with("tcp") {
            " on lo"
        } else {
            ""
        },
        emu::plugin_path().display()
    );
    println!("{MESSAGES_DEFAULT} messages of {} KiB per table, window {WINDOW}, two processes, every byte verified\n", SIZE / 1024);
    println!(
        "{:<8} {:<12} {:>8} {:>12} {:>9} {:>12}",
        "table", "NCCL", "messages", "bytes", "verified", "bandwidth"
    );
    let mut failed = false;
    for version in 5..=12 {
        match run(version, &provider, MESSAGES_DEFAULT) {
            Ok(secs) => println!(
                "{:<8} {:<12} {:>8} {:>12} {:>9} {:>9.0} MB/s",
                format!("v{version}"),
                emu::releases(version),
                MESSAGES_DEFAULT,
                MESSAGES_DEFAULT * SIZE,
                "yes",
                (MESSAGES_DEFAULT * SIZE) as f64 / secs / 1e6
            ),
            Err(e) => {
                failed = true;
                println!(
                    "{:<8} {:<12} failed: {e}",
                    format!("v{version}"),
                    emu::releases(version)
                );
            }
        }
    }
    println!("\ndone in {:.1} s", start.elapsed().as_secs_f64());
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
