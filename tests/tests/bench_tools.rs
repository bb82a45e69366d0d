//! The benchmark tools work and write what they promise. Nothing here checks
//! a speed (the figures are read from `./weft bench`, never asserted): a tiny
//! `weft-bench` run over shm must print the side-by-side table and write the
//! CSV, JSON and PNG, and `--impls rma,put` measure Weft's RMA puts beside raw
//! writes on shm and tcp; `weft-bench --micro-only` must count instructions of
//! every micro case under callgrind.

use std::process::Command;

const BENCH: &str = env!("CARGO_BIN_EXE_weft-bench");

fn out_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("weft-bench-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs `weft-bench` with `args` writing into `dir`; its stdout (printed).
fn bench(args: &[&str], dir: &std::path::Path) -> String {
    let o = Command::new(BENCH)
        .args(args)
        .arg("--out")
        .arg(dir)
        .output()
        .expect("run weft-bench");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "weft-bench failed:\n{stdout}\n{}",
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
    let stdout = bench(&[QUICK_BOTH, &["--impls", "rma,put"]].concat(), &dir);
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
    let o = Command::new(BENCH)
        .args(["--quick", "--micro-only"])
        .arg("--out")
        .arg(&dir)
        .output()
        .expect("run weft-bench --micro-only");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "weft-bench --micro-only failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{stdout}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("bench.json")).expect("bench.json"))
            .expect("bench.json parses");
    let m = &json["micro_instructions_per_op"];
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
