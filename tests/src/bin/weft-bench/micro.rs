//! Instruction counts of the micro-benchmark cases under callgrind.

use super::*;

/// Instructions per operation of each micro case, under callgrind.
pub(super) fn micro(quick: bool) -> Res<(String, serde_json::Value)> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let bin = exe.with_file_name("weft-micro");
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
    let dir = std::env::temp_dir().join(format!("weft-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut text = format!("\nmicro-costs: instructions per operation (valgrind --tool=callgrind, {n} repetitions, loop included)\n");
    let mut json = serde_json::Map::new();
    for (case, func, reps, ops, what) in cases {
        let out = dir.join(format!("callgrind.{case}"));
        let st = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--toggle-collect={func}"))
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&bin)
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

pub(super) fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}
