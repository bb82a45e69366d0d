//! `weft bench`: Weft against raw libfabric on the same provider, one run.
//!
//! ```text
//! weft bench [HOST[:PORT]] [--providers LIST] [--reps N] [--quick]
//!            [--sizes 8,64,...] [--impls raw,rma,weft,put] [--raw-split]
//!            [--post-size BYTES] [--vdev] [--out DIR] [--json] [--no-plot]
//!            [--plugin PATH]
//! weft bench --listen [ADDR:]PORT [--plugin PATH]
//! ```
//!
//! Without HOST both sides run on this machine, over loopback, for each of
//! `--providers` (default `shm,tcp`). With HOST the other side is a
//! `weft bench --listen` there, and `--providers` defaults to `auto`: the
//! provider Weft itself picks from its configuration (`WEFT_PROVIDER`,
//! `WEFT_IFACE`, ...), which each host reads from its own environment.
//!
//! Each provider is measured by a client process here and a server process
//! on the other side (a provider is fixed per process, as in NCCL). They
//! bootstrap over one TCP connection (`session`): the client's first line
//! says what to open, then both open (a) a raw libfabric RDM endpoint on the
//! device Weft would use and (b) Weft through its exported table
//! `ncclNetPlugin_v12`, loaded with `dlopen` as NCCL does, and exchange
//! addresses and Weft's handle over that connection. Then, for every size,
//! raw and Weft rounds alternate (the order flips every repetition), each
//! repeated `--reps` times:
//!
//! * **bandwidth** with windows of 8 and 32: the receiver posts a window of
//!   receives and sends "go"; the sender then sends the window. Message counts
//!   are bounded, and the receiver paces every window, so no message is ever
//!   unexpected and neither side's memory grows with the run.
//! * **message rate** at 8 B: the bandwidth test's messages per second.
//! * **latency**: ping-pong, half the round-trip time.
//!
//! **Every byte is checked.** The sending buffers carry a pattern that
//! differs per size and slot; the receiving side clears its buffer before a
//! round and compares every slot the round wrote once it is done (untimed).
//! A mismatch ends the run with the first wrong byte.
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
//! signal-only op. Weft claims RMA devices only where CUDA memory registers
//! (a GPU, or the test suite's fake driver).
//!
//! Output: a table per provider and size (medians, spread = (max-min)/median,
//! Weft/raw) on stdout, or with `--json` the JSON document; `bench.csv`,
//! `bench.json` and `bench.png` (bandwidth vs size) in `--out` (default
//! `weft-bench`). A progress line on stderr says what runs. Any failure on
//! either side (the other side's error is sent back over the bootstrap
//! connection) ends the run at once with that error and a non-zero status.
//!
//! Files: `transport` (raw libfabric and Weft behind one `Transport`,
//! connecting and closing), `rounds` (one measured round and its check),
//! `session` (the bootstrap connection, the server and client processes and
//! their plan), `report` (medians, table, plot); this one parses the command
//! line and runs the providers.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_net_weft::tools::fabric::{Completion, Domain, Endpoint, FiAddr, FiError, Mr, ACCESS_ALL};
use nccl_net_weft::tools::{self, hex, load_average, status_kb};

use crate::plugin::{open_plugin, Lib};

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
/// The port `--listen` and HOST mean when they name none.
const DEFAULT_PORT: u16 = 18_600;
/// How long a wait on the other side may take before the run fails: a
/// round, a connection, an answer.
const PATIENCE: Duration = Duration::from_secs(120);

type Res<T> = Result<T, String>;

/// What `--impls` may name, in the order a repetition runs them.
const IMPLS: [&str; 4] = ["raw", "rma", "weft", "put"];

/// `Ok` for ncclSuccess, else an error naming the call and the code.
fn rc(what: &str, r: c_int) -> Res<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(format!(
            "{what} returned ncclResult_t {r} (the plugin's WARN line says why; run with NCCL_DEBUG=WARN or INFO)"
        ))
    }
}

/// A member of one of the plugin's tables, or an error naming it.
macro_rules! member {
    ($t:expr, $m:ident) => {
        $t.$m
            .ok_or(concat!("the plugin's table has no ", stringify!($m)))?
    };
}

mod report;
mod rounds;
mod session;
mod transport;

use report::*;
use rounds::*;
use session::*;
use transport::*;

const USAGE: &str = "usage: weft bench [HOST[:PORT]] [--providers LIST] [--reps N] [--quick] [--sizes 8,64,...] [--impls raw,rma,weft,put] [--raw-split] [--post-size BYTES] [--vdev] [--out DIR] [--json] [--no-plot] [--plugin PATH]
       weft bench --listen [ADDR:]PORT [--plugin PATH]";

/// `weft bench ARGS`.
pub fn main(args: &[String]) -> ExitCode {
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `HOST`, `HOST:PORT` or `PORT` as a socket address.
fn address(s: &str, default_host: &str) -> Res<String> {
    let a = if s.parse::<u16>().is_ok() {
        format!("{default_host}:{s}")
    } else if s
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !s.ends_with(']')
    {
        s.to_owned()
    } else {
        format!("{s}:{DEFAULT_PORT}")
    };
    a.to_socket_addrs()
        .map_err(|e| format!("{s}: {e}"))?
        .next()
        .ok_or_else(|| format!("{s}: no address"))?;
    Ok(a)
}

fn run(args: &[String]) -> Res<()> {
    let mut providers: Option<Vec<String>> = None;
    let mut reps = 5usize;
    let mut quick = false;
    let mut sizes: Option<Vec<usize>> = None;
    let mut impls = vec!["raw".to_owned(), "rma".to_owned(), "weft".to_owned()];
    let mut opts = Options::default();
    let mut out = PathBuf::from("weft-bench");
    let (mut plot_too, mut json_out) = (true, false);
    let (mut host, mut listen, mut client_p, mut to, mut serve) = (None, None, None, None, false);
    let mut plugin: Option<String> = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--providers" => providers = Some(val()?.split(',').map(str::to_owned).collect()),
            "--reps" => reps = val()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--sizes" => {
                sizes = Some(
                    val()?
                        .split(',')
                        .map(|s| s.parse().map_err(|e| format!("--sizes {s}: {e}")))
                        .collect::<Res<_>>()?,
                )
            }
            "--impls" => impls = val()?.split(',').map(str::to_owned).collect(),
            "--out" => out = PathBuf::from(val()?),
            "--plugin" => plugin = Some(val()?),
            "--listen" => listen = Some(val()?),
            "--quick" => quick = true,
            "--raw-split" => opts.raw_split = true,
            "--vdev" => opts.vdev = true,
            "--post-size" => {
                let v = val()?;
                opts.post_size = v.parse().map_err(|e| format!("--post-size {v}: {e}"))?;
            }
            "--no-plot" => plot_too = false,
            "--json" => json_out = true,
            // The processes a run starts (`session`).
            "--client" => client_p = Some(val()?),
            "--to" => to = Some(val()?),
            "--serve" => serve = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            a if !a.starts_with('-') && host.is_none() => host = Some(a.to_owned()),
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    for i in &impls {
        if !IMPLS.contains(&i.as_str()) {
            return Err(format!("--impls: unknown {i:?} (one of {IMPLS:?})"));
        }
    }
    if serve {
        return serve_session(plugin);
    }
    if let Some(l) = listen {
        let addr = address(&l, "0.0.0.0")?;
        let listener = TcpListener::bind(&addr).map_err(|e| format!("--listen {addr}: {e}"))?;
        eprintln!(
            "weft bench: listening on {}; run `weft bench {}` on the other host",
            listener.local_addr().map_err(|e| e.to_string())?,
            hostname()
        );
        return serve_connections(&listener, None, plugin.as_deref()).map(drop);
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
    if sizes.contains(&0) {
        return Err("--sizes: a message of 0 bytes measures nothing".into());
    }
    let plan = Plan {
        sizes,
        impls,
        opts,
        windows: vec![8, 32],
        reps,
        quick,
        lat_max: 1 << 20,
    };
    if let Some(p) = client_p {
        let to = to.ok_or("--client needs --to")?;
        return client(&p, &to, &plan, plugin);
    }

    // The run: one client process per provider; without HOST, its server
    // processes are this process's children too, over loopback.
    let providers = providers.unwrap_or_else(|| {
        let v: &[&str] = if host.is_some() {
            &["auto"]
        } else {
            &["shm", "tcp"]
        };
        v.iter().map(|s| (*s).to_owned()).collect()
    });
    let started = Instant::now();
    let load_before = load_average();
    let lib = open_plugin(plugin.clone())?;
    let plugin_path = lib.path.clone();
    let (to, local) = match &host {
        Some(h) => (address(h, "")?, None),
        None => {
            // Both sides here: loopback, unless the environment says otherwise.
            for (k, v) in [("WEFT_IFACE", "lo"), ("FI_TCP_IFACE", "lo")] {
                if std::env::var_os(k).is_none() {
                    std::env::set_var(k, v);
                }
            }
            let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
            let to = l.local_addr().map_err(|e| e.to_string())?.to_string();
            let n = providers.len();
            let p = plugin_path.clone();
            let t = std::thread::spawn(move || serve_connections(&l, Some(n), Some(&p)));
            (to, Some(t))
        }
    };
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut records = Vec::new();
    for p in &providers {
        eprintln!("weft bench: {p} (plugin {plugin_path}, table v12, peer {to})");
        let o = Command::new(&exe)
            .args([
                "bench",
                "--client",
                p,
                "--to",
                &to,
                "--plugin",
                &plugin_path,
            ])
            .args(plan.args())
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&o.stdout);
        if !o.status.success() {
            return Err(format!("{p}: the run failed (its error is above)"));
        }
        for l in text.lines() {
            records.push(
                serde_json::from_str::<serde_json::Value>(l)
                    .map_err(|e| format!("{p}: {e}: {l}"))?,
            );
        }
    }
    if let Some(t) = local {
        for server in t.join().map_err(|_| "the serving thread panicked")?? {
            reap(server);
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
    let where_ = match &host {
        Some(h) => format!("{} to {h}", hostname()),
        None => format!("two processes on {}", hostname()),
    };
    let header = format!(
        "weft bench {} UTC; {where_}; {cpus} CPUs ({model}); libfabric {}; table v12; {} rep(s) per point, raw and Weft alternating; load average {load_before} (start), {} (end); {:.0} s",
        sh("date", &["-u", "+%Y-%m-%d %H:%M"]),
        libfabric_sys::version_text(libfabric_sys::running_version()),
        reps,
        load_average(),
        started.elapsed().as_secs_f64()
    );
    let memory: Vec<_> = records.iter().filter(|r| r["test"] == "memory").collect();
    let json = serde_json::json!({
        "header": header,
        "plugin": plugin_path,
        "records": records.iter().filter(|r| r["test"] != "memory").collect::<Vec<_>>(),
        "memory": memory,
    });
    let json_text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    if json_out {
        println!("{json_text}");
    } else {
        println!("{header}");
        print!("{tab}");
        for r in &memory {
            println!(
                "\n{}: peak resident memory: client {} MB, server {} MB",
                r["provider"].as_str().unwrap_or("?"),
                r["client_hwm_kb"].as_u64().unwrap_or(0) / 1024,
                r["server_hwm_kb"].as_u64().unwrap_or(0) / 1024
            );
        }
    }
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let csv_path = out.join("bench.csv");
    std::fs::write(&csv_path, csv).map_err(|e| format!("{}: {e}", csv_path.display()))?;
    let json_path = out.join("bench.json");
    std::fs::write(&json_path, json_text).map_err(|e| format!("{}: {e}", json_path.display()))?;
    let mut wrote = vec![csv_path, json_path];
    if plot_too {
        let png = out.join("bench.png");
        plot(
            &m,
            &png,
            &format!("Weft (v12 table) vs raw libfabric, {where_}"),
        )?;
        wrote.push(png);
    }
    eprintln!(
        "weft bench: wrote {}",
        wrote
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// The first line of a command's output, or "" where it cannot run.
fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "this host".to_owned())
}

/// The bytes of a hex string from the bootstrap line.
fn unhex(s: &str) -> Res<Vec<u8>> {
    tools::unhex(s).ok_or_else(|| format!("{s:?} is not hex bytes"))
}
