//! The benchmark tools work and write what they promise. Nothing here checks
//! a speed (the figures are read from `./weft bench`, never asserted): a tiny
//! `weft bench` run over shm must print the side-by-side table and write the
//! CSV, JSON and PNG, and `--impls rma,put` measure Weft's RMA puts beside raw
//! writes on shm and tcp; `weft bench` between two hosts of the namespace
//! cluster measures every point, and a failure on the other side ends the
//! run at once with its reason; `weft-micro --callgrind` must count
//! instructions of every micro case.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use weft_tests::emu;
use weft_tests::netns::Cluster;

const MICRO: &str = env!("CARGO_BIN_EXE_weft-micro");

/// `weft bench` (the shipped command) with the plugin under test.
fn weft_bench(cmd: Command) -> Command {
    weft_bench_with(cmd, &emu::plugin_path())
}

/// `weft bench` through `cmd` (`weft`, or a program that runs it) with
/// the plugin at `plugin`.
fn weft_bench_with(mut cmd: Command, plugin: &std::path::Path) -> Command {
    cmd.arg("bench").arg("--plugin").arg(plugin);
    cmd
}

fn out_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("weft-bench-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs `weft bench` with `args` writing into `dir`; its stdout (printed).
fn bench(args: &[&str], dir: &std::path::Path) -> String {
    run_bench(Command::new(emu::weft_bin("weft")), args, dir)
}

/// [`bench`] through `cmd` (a program that runs `weft`, or `weft` itself).
fn run_bench(cmd: Command, args: &[&str], dir: &std::path::Path) -> String {
    let o = weft_bench(cmd)
        .args(args)
        .arg("--out")
        .arg(dir)
        .output()
        .expect("run weft bench");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "weft bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{stdout}");
    stdout
}

/// Every point of the quick runs (8 B and 64 KiB) has a finite, positive median for each of
/// `imps` in `dir`'s bench.csv, on provider `p`.
fn csv_has(dir: &std::path::Path, p: &str, imps: &[&str]) {
    let csv = std::fs::read_to_string(dir.join("bench.csv")).expect("bench.csv");
    for (test, size) in [
        ("bw", 8),
        ("bw", 65536),
        ("rate", 8),
        ("lat", 8),
        ("lat", 65536),
    ] {
        for imp in imps {
            let prefix = format!("{p},{test},{size},");
            let row = csv
                .lines()
                .find(|r| r.starts_with(&prefix) && r.split(',').nth(4) == Some(*imp))
                .unwrap_or_else(|| panic!("no CSV row for {p} {test} {size} {imp}:\n{csv}"));
            let median: f64 = row.split(',').nth(6).unwrap().parse().unwrap();
            assert!(median > 0.0 && median.is_finite(), "{row}");
        }
    }
}

/// One quick repetition of 8 B and 64 KiB on both providers (what
/// [`csv_has`] checks).
const QUICK_BOTH: &[&str] = &[
    "--quick",
    "--reps",
    "1",
    "--providers",
    "shm,tcp",
    "--sizes",
    "8,65536",
    "--no-plot",
];

/// `--impls rma,put`: Weft's RMA puts with signals beside raw
/// `fi_writedata`, every point measured for both.
#[test]
fn rma_puts_are_measured_beside_raw_writes() {
    weft_tests::isolated!();
    let dir = out_dir("put");
    // Weft's RMA claims a device only where NCCL's CUDA memory registers:
    // here, the fake driver's, as in the RMA tests.
    let mut cmd = Command::new(emu::weft_bin("weft"));
    let rest = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    cmd.env(
        "LD_LIBRARY_PATH",
        format!("{}:{rest}", weft_tests::rma_group::FAKE_CUDA),
    )
    .env("WEFT_TEST_HMEM", "system")
    .env("WEFT_PROTOCOL", "rdma");
    let args = [QUICK_BOTH, &["--impls", "rma,put"]].concat();
    let stdout = run_bench(cmd, &args, &dir);
    assert!(stdout.contains("put/write"), "the table lacks put/write");
    for p in ["shm", "tcp"] {
        csv_has(&dir, p, &["rma", "put"]);
    }
}

#[test]
fn quick_run_writes_table_csv_json_and_png() {
    weft_tests::isolated!();
    let dir = out_dir("run");
    let stdout = bench(
        &[
            "--quick",
            "--reps",
            "2",
            "--providers",
            "shm",
            "--sizes",
            "8,65536",
        ],
        &dir,
    );
    for what in [
        "unidirectional bandwidth",
        "ping-pong latency",
        "message rate at 8 B",
        "weft/raw",
        "weft/write",
        "load average",
    ] {
        assert!(stdout.contains(what), "the table lacks {what:?}");
    }
    csv_has(&dir, "shm", &["raw", "rma", "weft"]);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("bench.json")).expect("bench.json"))
            .expect("bench.json parses");
    let n = json["records"].as_array().expect("records").len();
    assert!(n >= 10, "{n} records");
    assert!(json["memory"][0]["server_hwm_kb"].as_u64().unwrap_or(0) > 0);
    let png = std::fs::read(dir.join("bench.png")).expect("bench.png");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "not a plot"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn micro_costs_are_counted_under_callgrind() {
    weft_tests::isolated!();
    let dir = out_dir("micro");
    std::fs::create_dir_all(&dir).expect("out dir");
    let file = dir.join("micro.json");
    let o = Command::new(MICRO)
        .args(["--callgrind", "--quick", "--json"])
        .arg(&file)
        .output()
        .expect("run weft-micro --callgrind");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "weft-micro --callgrind failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{stdout}");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("micro.json"))
            .expect("micro.json parses");
    for case in [
        "c-pair",
        "weft-pair",
        "c-burst",
        "weft-burst",
        "mr-hit",
        "core-devices",
        "v5-devices",
        "v12-devices",
    ] {
        let v = m[case]
            .as_f64()
            .unwrap_or_else(|| panic!("no count for {case}: {m}"));
        assert!(
            (1.0..100_000.0).contains(&v),
            "{case}: {v} instructions per op"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft-resources` prints the resource curve (endpoints, fds, RSS per pair)
/// for the counts asked, and stops at its memory budget with a line saying
/// so. It asserts no figure: the curve is read, not tested.
#[test]
fn resource_curve_prints_its_table() {
    weft_tests::isolated!();
    let exe = env!("CARGO_BIN_EXE_weft-resources");
    let o = Command::new(exe)
        .args([
            "--providers",
            "shm",
            "--pairs",
            "1,3",
            "--protocols",
            "sendrecv,rdma",
        ])
        .output()
        .expect("run weft-resources");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "weft-resources failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{stdout}");
    for what in ["endpoints", "MB per pair", "fds per pair"] {
        assert!(stdout.contains(what), "the table lacks {what:?}:\n{stdout}");
    }
    let rows = |proto: &str| -> Vec<String> {
        stdout
            .lines()
            .filter(|l| l.starts_with("shm ") && l.split_whitespace().nth(1) == Some(proto))
            .map(str::to_owned)
            .collect()
    };
    let (sr, rdma) = (rows("sendrecv"), rows("rdma"));
    assert_eq!((sr.len(), rdma.len()), (2, 2), "{stdout}");
    let endpoints = |row: &str| row.split_whitespace().nth(3).map(str::to_owned);
    // Both ends in this process: the comms of either protocol share the
    // device's two endpoints, whatever their number.
    for row in sr.iter().chain(&rdma) {
        assert_eq!(endpoints(row).as_deref(), Some("2"), "{stdout}");
    }
    let o = Command::new(exe)
        .args([
            "--providers",
            "shm",
            "--pairs",
            "1,1000",
            "--max-rss-mb",
            "1",
            "--protocols",
            "sendrecv",
        ])
        .output()
        .expect("run weft-resources");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && stdout.contains("stopped at"),
        "{stdout}"
    );
}

/// The CollNet bench runs both algorithms and prints time, bandwidth and
/// the bytes each rank moved; it asserts no figure.
#[test]
fn collnet_bench_prints_its_table() {
    weft_tests::isolated!();
    let o = Command::new(env!("CARGO_BIN_EXE_weft-collbench"))
        .args(["--quick", "--providers", "shm", "--reps", "1"])
        .output()
        .expect("run weft-collbench");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "weft-collbench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{stdout}");
    for what in [
        "algorithm",
        "median us",
        "busbw",
        "vs ring",
        "sent/op",
        "recv/op",
    ] {
        assert!(stdout.contains(what), "the table lacks {what:?}:\n{stdout}");
    }
    // One row per size and algorithm: in-plugin, through the reducer, ring.
    for alg in ["in-plugin", "reducers x1", "ring"] {
        let rows = stdout
            .lines()
            .filter(|l| {
                let t = l.trim_start();
                (t.starts_with("65536 ") || t.starts_with("1048576 ")) && t.contains(alg)
            })
            .count();
        assert_eq!(rows, 2, "{alg}: {stdout}");
    }
}

/// A reducer or a rank of the CollNet bench that fails ends the bench at
/// once with its error (the others used to wait for it for ever: for the
/// reducer's handle on a channel the bench itself still fed, or at a
/// barrier).
#[test]
fn collnet_bench_fails_at_once_when_a_thread_fails() {
    weft_tests::isolated!();
    for who in ["reducer", "rank"] {
        let child = Command::new(env!("CARGO_BIN_EXE_weft-collbench"))
            .args(["--quick", "--providers", "shm", "--reps", "1"])
            .env("WEFT_COLLBENCH_FAIL", who)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run weft-collbench");
        // Killed if the wait times out (the hang this test is about).
        struct Reap(std::process::Child);
        impl Drop for Reap {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut child = Reap(child);
        let status =
            weft_tests::poll_until(&format!("weft-collbench with a failing {who}"), || {
                child.0.try_wait().expect("wait")
            });
        let mut child = child.0.stderr.take();
        let mut err = String::new();
        std::io::Read::read_to_string(child.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "{who}: {status}\n{err}");
        assert!(
            err.contains(&format!("failed on purpose (WEFT_COLLBENCH_FAIL={who})")),
            "{who}: the error is not the failing thread's:\n{err}"
        );
    }
}

/// `--post-size`: receives of 512 KiB for messages of 8 B and 64 KiB (as
/// NCCL posts whole steps), raw and Weft, every point measured.
#[test]
fn receives_larger_than_their_messages_are_measured() {
    weft_tests::isolated!();
    let dir = out_dir("post");
    let args = ["--impls", "raw,weft", "--post-size", "524288"];
    bench(&[QUICK_BOTH, &args].concat(), &dir);
    for p in ["shm", "tcp"] {
        csv_has(&dir, p, &["raw", "weft"]);
    }
}

/// A `weft bench --listen` process, killed when dropped.
struct Listener {
    child: Child,
    /// Where it listens, as it said.
    addr: String,
}

impl Listener {
    /// Starts `weft bench --listen at` (port 0: any) through `cmd` with
    /// the plugin at `plugin`, and reads where it listens from its first
    /// line.
    fn start(cmd: Command, plugin: &std::path::Path, at: &str) -> Self {
        let mut child = weft_bench_with(cmd, plugin)
            .args(["--listen", at])
            .stderr(Stdio::piped())
            .spawn()
            .expect("start weft bench --listen");
        let mut err = BufReader::new(child.stderr.take().expect("stderr"));
        let mut line = String::new();
        err.read_line(&mut line).expect("its first line");
        let addr = line
            .split_whitespace()
            .skip_while(|w| *w != "on")
            .nth(1)
            .map(|a| a.trim_end_matches(';').to_owned())
            .unwrap_or_else(|| panic!("weft bench --listen said {line:?}"));
        // Its further lines (one per run) go to the test's output.
        std::thread::spawn(move || {
            for l in err.lines().map_while(Result::ok) {
                eprintln!("listener: {l}");
            }
        });
        Self { child, addr }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two hosts of the namespace cluster, as an operator runs it: `weft bench
/// --listen` on host 1, `weft bench HOST` on host 0, each with Weft's own
/// choice of provider on its rail (`auto`), every point measured for raw
/// libfabric and Weft, both sides' memory reported.
#[test]
fn bench_between_two_hosts() {
    weft_tests::isolated!();
    let c = Cluster::new(2, 1).expect("the cluster");
    let weft = emu::weft_bin("weft");
    let on = |h: usize| {
        let mut cmd = c.command(h, weft.to_str().expect("a UTF-8 path"));
        cmd.env("WEFT_IFACE", "r0").env("FI_TCP_IFACE", "r0");
        cmd
    };
    let at = format!("{}:0", c.addr(1, 0, false));
    let l = Listener::start(on(1), &emu::plugin_path(), &at);
    assert!(l.addr.starts_with(&c.addr(1, 0, false)), "{}", l.addr);
    let dir = out_dir("hosts");
    let args = [
        &l.addr[..],
        "--quick",
        "--reps",
        "1",
        "--sizes",
        "8,65536",
        "--impls",
        "raw,weft",
        "--no-plot",
        "--json",
    ];
    let stdout = run_bench(on(0), &args, &dir);
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("--json prints JSON");
    assert!(
        json["header"]
            .as_str()
            .is_some_and(|h| h.contains(&format!("to {}", l.addr))),
        "{}",
        json["header"]
    );
    let p = json["records"][0]["provider"]
        .as_str()
        .expect("a provider")
        .to_owned();
    assert!(
        p.starts_with("tcp") || p.starts_with("sockets"),
        "Weft's choice on a veth rail: {p}"
    );
    csv_has(&dir, &p, &["raw", "weft"]);
    let m = &json["memory"][0];
    assert!(m["server_hwm_kb"].as_u64().unwrap_or(0) > 0, "{m}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The other side fails (here: its plugin cannot be loaded): the client
/// ends at once, with a non-zero status and the other side's reason.
#[test]
fn a_failure_on_the_other_side_ends_the_run_with_its_reason() {
    weft_tests::isolated!();
    let mut listen = Command::new(emu::weft_bin("weft"));
    listen.env("FI_TCP_IFACE", "lo").env("WEFT_IFACE", "lo");
    let missing = std::path::Path::new("/nonexistent/libnccl-net-weft.so");
    let l = Listener::start(listen, missing, "127.0.0.1:0");
    let started = std::time::Instant::now();
    let o = weft_bench(Command::new(emu::weft_bin("weft")))
        .args([&l.addr[..], "--providers", "tcp", "--quick", "--reps", "1"])
        .args(["--sizes", "8", "--no-plot", "--out"])
        .arg(out_dir("fails"))
        .env("FI_TCP_IFACE", "lo")
        .env("WEFT_IFACE", "lo")
        .output()
        .expect("run weft bench");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "it succeeded:\n{err}");
    assert!(
        err.contains("the other side failed") && err.contains("/nonexistent/libnccl-net-weft.so"),
        "the error is not the other side's:\n{err}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "it took {:?}",
        started.elapsed()
    );
}
