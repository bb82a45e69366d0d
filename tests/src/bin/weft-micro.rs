//! Weft's micro-costs in instructions per operation, under callgrind.
//!
//! ```text
//! weft-micro --callgrind [--quick] [--json FILE]   every case, a table
//! weft-micro <case> <n>                            one case, n times
//! ```
//!
//! `--callgrind` runs `valgrind --tool=callgrind --toggle-collect=<function>
//! weft-micro <case> <n>` for each case and divides the instructions counted
//! inside the case's function by `n` (setup happens outside that function);
//! `./weft bench` prints this table after `weft bench`'s.
//!
//! Cases: c-pair, weft-pair, c-burst, weft-burst (per round of 256 allocs and
//! 256 frees), mr-hit, core-devices, v5-devices, v12-devices.

use std::process::{Command, ExitCode};

use weft_tests::micro;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--callgrind") {
        let quick = args.iter().any(|a| a == "--quick");
        let json = args
            .iter()
            .position(|a| a == "--json")
            .and_then(|i| args.get(i + 1));
        return match callgrind(quick) {
            Ok((text, j)) => {
                print!("{text}");
                if let Some(f) = json {
                    if let Err(e) = std::fs::write(f, j.to_string()) {
                        eprintln!("weft-micro: {f}: {e}");
                        return ExitCode::FAILURE;
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("weft-micro: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let (Some(case), Some(n)) = (
        args.first(),
        args.get(1).and_then(|n| n.parse::<u64>().ok()),
    ) else {
        eprintln!("usage: weft-micro --callgrind [--quick] [--json FILE] | weft-micro <case> <n>");
        return ExitCode::from(2);
    };
    let sum = match case.as_str() {
        "c-pair" => micro::CFreelist::new().pair(n),
        "c-burst" => micro::CFreelist::new().burst(n),
        "weft-pair" => micro::freelist_pair(&mut micro::weft_freelist(), n),
        "weft-burst" => {
            let mut held = Vec::with_capacity(micro::BURST);
            micro::freelist_burst(&mut micro::weft_freelist(), &mut held, n)
        }
        "mr-hit" => {
            let buf = vec![0u8; 64 << 20];
            let (cache, held) = micro::mr_cache(&buf);
            let r = held[17].range();
            let s = micro::mr_hit(&cache, r.start + 100, r.len() - 200, n);
            drop(held);
            s
        }
        "core-devices" | "v5-devices" | "v12-devices" => {
            weft_tests::host::configure("shm");
            if let Err(e) = weft::core::init_process(None, None) {
                eprintln!("weft-micro: init: {e}");
                return ExitCode::FAILURE;
            }
            match case.as_str() {
                "core-devices" => micro::core_devices(n),
                "v5-devices" => micro::table_devices(
                    weft::net_v5::ncclNetPlugin_v5.devices.expect("devices"),
                    n,
                ),
                _ => micro::table_devices(
                    weft::net_v12::ncclNetPlugin_v12.devices.expect("devices"),
                    n,
                ),
            }
        }
        other => {
            eprintln!("weft-micro: unknown case {other:?}");
            return ExitCode::from(2);
        }
    };
    println!("{case} {n} {sum}");
    ExitCode::SUCCESS
}

/// Instructions per operation of each micro case, under callgrind.
fn callgrind(quick: bool) -> Result<(String, serde_json::Value), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let n: u64 = if quick { 2000 } else { 100_000 };
    let cases = [
        ("c-pair", "cfl_bench_pair", n, 1.0, "C freelist alloc+free"),
        (
            "weft-pair",
            "weft_tests::micro::freelist_pair",
            n,
            1.0,
            "Weft freelist alloc+free",
        ),
        (
            "c-burst",
            "cfl_bench_burst",
            n / 256,
            512.0,
            "C freelist, 256 allocs then 256 frees, per op",
        ),
        (
            "weft-burst",
            "weft_tests::micro::freelist_burst",
            n / 256,
            512.0,
            "Weft freelist, 256 allocs then 256 frees, per op",
        ),
        (
            "mr-hit",
            "weft_tests::micro::mr_hit",
            n,
            1.0,
            "MR cache hit (lookup + release)",
        ),
        (
            "core-devices",
            "weft_tests::micro::core_devices",
            n,
            1.0,
            "devices(), core directly",
        ),
        (
            "v5-devices",
            "weft_tests::micro::table_devices",
            n,
            1.0,
            "devices(), through the v5 adapter",
        ),
        (
            "v12-devices",
            "weft_tests::micro::table_devices",
            n,
            1.0,
            "devices(), through the v12 adapter",
        ),
    ];
    let dir = std::env::temp_dir().join(format!("weft-micro-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut text = format!("\nmicro-costs: instructions per operation (valgrind --tool=callgrind, {n} repetitions, loop included)\n");
    let mut json = serde_json::Map::new();
    for (case, func, reps, ops, what) in cases {
        let out = dir.join(format!("callgrind.{case}"));
        let st = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--toggle-collect={func}"))
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&exe)
            .args([case, &reps.to_string()])
            .env("WEFT_PROVIDER", "shm")
            .output()
            .map_err(|e| format!("cannot run valgrind ({e}): ./weft setup installs it"))?;
        if !st.status.success() {
            return Err(format!(
                "callgrind {case}: {}",
                String::from_utf8_lossy(&st.stderr)
            ));
        }
        let f = std::fs::read_to_string(&out).map_err(|e| e.to_string())?;
        let ir: f64 = f
            .lines()
            .find_map(|l| {
                l.strip_prefix("summary:")
                    .or_else(|| l.strip_prefix("totals:"))
            })
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .ok_or_else(|| format!("callgrind {case}: no totals"))?;
        let per = ir / (reps as f64 * ops);
        text.push_str(&format!("  {what:<52} {per:>8.1}\n"));
        json.insert(case.to_owned(), serde_json::json!(per));
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok((text, serde_json::Value::Object(json)))
}
