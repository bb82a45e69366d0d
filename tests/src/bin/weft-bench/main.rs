//! Weft against raw libfabric on the same provider, two processes, one run.
//!
//! ```text
//! weft-bench [--providers shm,tcp] [--version 12] [--reps 5] [--quick]
//!            [--sizes 8,64,...] [--impls raw,rma,weft,put] [--raw-split] [--out DIR]
//!            [--post-size BYTES] (receives of at least BYTES, as NCCL posts)
//!            [--micro | --micro-only] [--no-plot] [--vdev]
//! ```
//!
//! `--vdev`: Weft's comms run on a virtual device of device 0 alone
//! (`makeVDevice`, v9+), so the figures show what the striping layer
//! (headers, one more one-way latency) costs on one rail.
//!
//! For each provider a client process and a server process are started (the
//! provider is fixed per process). Both open (a) a raw libfabric RDM endpoint
//! with our `libfabric-sys` wrappers and (b) Weft through its exported table
//! `ncclNetPlugin_v<version>`, loaded with `dlopen` as NCCL does. Then, for
//! every size, raw and Weft rounds alternate (the order flips every
//! repetition), each repeated `--reps` times:
//!
//! * **bandwidth** with windows of 8 and 32: the receiver posts a window of
//!   receives and sends "go"; the sender then sends the window. Message counts
//!   are bounded, and the receiver paces every window, so no message is ever
//!   unexpected and neither side's memory grows with the run.
//! * **message rate** at 8 B: the bandwidth test's messages per second.
//! * **latency**: ping-pong, half the round-trip time.
//!
//! Raw uses `fi_tsend`/`fi_trecv` with the same tags, window and buffers as
//! Weft's `isend`/`irecv`. Raw RMA (`rma`, the RDMA protocol's baseline)
//! moves the same data with `fi_writedata` straight into the peer's buffer
//! at the same offset (addresses and keys swapped once per size, no control
//! message per write); a receive completes when a write's immediate arrives.
//! Its "go" messages stay tagged, as in the other two. `put` (not in the
//! default set) is Weft's one-sided RMA through `ncclRmaPlugin_v16`: each
//! message an `iputSignal` (strong INC) into the peer's buffer at the same
//! offset, a receive done once its tag's signal counts it, "go" a
//! signal-only op; compare it with `rma`. Its processes run with the fake
//! CUDA driver and `WEFT_TEST_HMEM=system` (RMA claims devices only where
//! CUDA memory registers), which also changes what `weft` measures in the
//! same run, so run `--impls rma,put` on its own. Output: a table (medians, spread = (max-min)/median,
//! Weft/raw), `bench.csv`, `bench.json` and `bench.png` (bandwidth vs size) in
//! `--out` (default `target/bench`). `--micro` adds instruction counts of the
//! micro-benchmark cases under callgrind (see `weft-micro`); `--micro-only`
//! runs just those.
//!
//! Files: `transport` (raw libfabric and Weft behind one `Transport`,
//! connecting and closing), `rounds` (one measured round), `procs` (the
//! server and client processes and their plan), `report` (medians, table,
//! plot), `micro` (the callgrind counts); this one parses the command line.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::fabric::{Completion, Domain, Endpoint, FiAddr, Mr, ACCESS_ALL};
use weft_tests::emu::check as rc;
use weft_tests::emu::{self, Net};
use weft_tests::peer::{hex, unhex_bytes as unhex};

/// Tags: data and pings go client -> server, "go" and pongs server -> client.
#[derive(Debug, Clone, Copy)]
enum Tag {
    Data = 1,
    Go = 2,
    Ping = 3,
    Pong = 4,
}

/// Bytes of data memory per buffer set: larger windows reuse slots.
const SLOT_BYTES: usize = 256 << 20;
/// Bytes a bandwidth round aims to move.
const ROUND_BYTES: usize = 256 << 20;
/// Most messages in a bandwidth round.
const ROUND_MSGS: usize = 20_000;
/// Untimed ping-pongs before each latency round.
const WARMUP: usize = 20;

type Res<T> = Result<T, String>;

mod micro;
mod procs;
mod report;
mod rounds;
mod transport;

use micro::*;
use procs::*;
use report::*;
use rounds::*;
use transport::*;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut providers = vec!["shm".to_owned(), "tcp".to_owned()];
    let mut version = 12u32;
    let mut reps = 5usize;
    let mut quick = false;
    let mut sizes: Option<Vec<usize>> = None;
    let mut impls = vec!["raw".to_owned(), "rma".to_owned(), "weft".to_owned()];
    let mut raw_split = false;
    let mut out = PathBuf::from("target/bench");
    let (mut micro_too, mut plot_too) = (false, true);
    let (mut serve_p, mut client_p) = (None, None);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--providers" => providers = val()?.split(',').map(str::to_owned).collect(),
            "--version" => version = val()?.parse().map_err(|e| format!("--version: {e}"))?,
            "--reps" => reps = val()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--sizes" => {
                sizes = Some(
                    val()?
                        .split(',')
                        .map(|s| s.parse().map_err(|e| format!("--sizes: {e}")))
                        .collect::<Res<_>>()?,
                )
            }
            "--impls" => impls = val()?.split(',').map(str::to_owned).collect(),
            "--out" => out = PathBuf::from(val()?),
            "--serve" => serve_p = Some(val()?),
            "--client" => client_p = Some(val()?),
            "--quick" => quick = true,
            "--micro" => micro_too = true,
            "--raw-split" => raw_split = true,
            "--micro-only" => {
                micro_too = true;
                providers.clear();
                plot_too = false;
            }
            "--no-plot" => plot_too = false,
            // Read by both processes (the server inherits it).
            "--vdev" => std::env::set_var("WEFT_BENCH_VDEV", "1"),
            // Read by both processes too: receives of at least this many
            // bytes, however small the message (NCCL posts whole steps).
            "--post-size" => {
                let v = val()?;
                v.parse::<usize>()
                    .map_err(|e| format!("--post-size {v}: {e}"))?;
                std::env::set_var("WEFT_BENCH_POST_SIZE", v);
            }
            "-h" | "--help" => {
                println!("usage: weft-bench [--providers shm,tcp] [--version 12] [--reps 5] [--quick] [--sizes 8,64,...] [--impls raw,rma,weft,put] [--raw-split] [--out DIR] [--micro | --micro-only] [--no-plot] [--vdev] [--post-size BYTES]");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    let sizes = sizes.unwrap_or_else(|| {
        if quick {
            vec![8, 4096, 65536, 1 << 20]
        } else {
            vec![
                8,
                64,
                512,
                4096,
                16384,
                65536,
                262144,
                1 << 20,
                4 << 20,
                16 << 20,
                64 << 20,
            ]
        }
    });
    let plan = Plan {
        sizes,
        impls: impls.clone(),
        raw_split,
        windows: vec![8, 32],
        reps,
        quick,
        lat_max: 1 << 20,
    };
    if let Some(p) = serve_p {
        return serve(&p, version, raw_split);
    }
    if let Some(p) = client_p {
        return client(&p, version, &plan);
    }

    // The orchestrator: one client (and server) per provider.
    let started = Instant::now();
    let load_before = weft_tests::load_average();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut records = Vec::new();
    for p in &providers {
        eprintln!(
            "weft-bench: {p} (plugin {}, table v{version})",
            emu::plugin_path().display()
        );
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--client",
            p,
            "--version",
            &version.to_string(),
            "--reps",
            &reps.to_string(),
        ])
        .args(["--impls", &impls.join(",")])
        .args(raw_split.then_some("--raw-split"))
        .args([
            "--sizes",
            &plan
                .sizes
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ]);
        if quick {
            cmd.arg("--quick");
        }
        if impls.iter().any(|i| i == "put") {
            // Weft's RMA claims a device only where NCCL's CUDA memory
            // registers: here, the fake driver's, as in the RMA tests.
            let rest = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
            cmd.env(
                "LD_LIBRARY_PATH",
                format!("{}:{rest}", weft_tests::rma_group::FAKE_CUDA),
            )
            .env("WEFT_TEST_HMEM", "system")
            .env("WEFT_PROTOCOL", "rdma");
        }
        let o = cmd
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&o.stdout);
        if !o.status.success() {
            return Err(format!("{p}: the client failed: {text}"));
        }
        for l in text.lines() {
            records.push(
                serde_json::from_str::<serde_json::Value>(l)
                    .map_err(|e| format!("{p}: {e}: {l}"))?,
            );
        }
    }
    let m = collect(&records);
    let (tab, csv) = table(&m);
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let load_after = weft_tests::load_average();
    let header = format!(
        "weft-bench {} UTC; {cpus} CPUs ({model}); libfabric {}; table v{version}; {} rep(s) per point, raw and Weft alternating; load average {load_before} (start), {load_after} (end); {:.0} s",
        sh("date", &["-u", "+%Y-%m-%d %H:%M"]),
        libfabric_sys::version_text(libfabric_sys::running_version()),
        reps,
        started.elapsed().as_secs_f64()
    );
    println!("{header}");
    print!("{tab}");
    for r in records.iter().filter(|r| r["test"] == "memory") {
        println!(
            "\n{}: peak resident memory: client {} MB, server {} MB",
            r["provider"].as_str().unwrap_or("?"),
            r["client_hwm_kb"].as_u64().unwrap_or(0) / 1024,
            r["server_hwm_kb"].as_u64().unwrap_or(0) / 1024
        );
    }
    let micro_json = if micro_too {
        let (t, j) = micro(quick)?;
        print!("{t}");
        j
    } else {
        serde_json::Value::Null
    };
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let csv_path = out.join("bench.csv");
    std::fs::write(&csv_path, csv).map_err(|e| e.to_string())?;
    let json = serde_json::json!({
        "header": header,
        "records": records.iter().filter(|r| r["test"] != "memory").collect::<Vec<_>>(),
        "memory": records.iter().filter(|r| r["test"] == "memory").collect::<Vec<_>>(),
        "micro_instructions_per_op": micro_json,
    });
    let json_path = out.join("bench.json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let mut wrote = vec![csv_path, json_path];
    if plot_too {
        let png = out.join("bench.png");
        plot(
            &m,
            &png,
            &format!("Weft (v{version} table) vs raw libfabric, two processes on one host"),
        )?;
        wrote.push(png);
    }
    println!(
        "\nwrote {}",
        wrote
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
