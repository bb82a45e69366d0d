//! The version matrix: every exported net table x {tcp;ofi_rxm on lo, shm}
//! (or the providers `WEFT_TEST_MATRIX_PROVIDERS` names, e.g. verbs in a guest)
//! x {rdma, sendrecv}, each cell in a process of its own (`weft-demo --cell`), driven the way
//! that version's NCCL drives a plugin (tests/src/matrix/); and every
//! CollNet table x {tcp;ofi_rxm, shm} (`weft-demo --collnet-cell`, a group
//! of two ranks: tests/src/collnet_cell.rs); and every RMA table x
//! {tcp;ofi_rxm, shm} (two `weft-rma-rank` processes: tests/src/rma_group.rs).
//! Prints the tables of results with the number of checks; any failing
//! cell fails.

use std::process::Command;
use std::time::Instant;

const DEMO: &str = env!("CARGO_BIN_EXE_weft-demo");

#[test]
fn version_matrix() {
    weft_tests::isolated!();
    let providers = std::env::var("WEFT_TEST_MATRIX_PROVIDERS")
        .unwrap_or_else(|_| "tcp;ofi_rxm,shm".to_owned());
    let providers: Vec<&str> = providers.split(',').filter(|p| !p.is_empty()).collect();
    assert!(
        !providers.is_empty(),
        "WEFT_TEST_MATRIX_PROVIDERS names no provider"
    );
    let protocols = ["rdma", "sendrecv"];
    let columns: Vec<(&str, &str)> = providers
        .iter()
        .flat_map(|&p| protocols.iter().map(move |&q| (p, q)))
        .collect();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for v in 5..=12u32 {
        let mut row = format!("v{v:<3} {:<10}", weft_tests::emu::releases(v));
        let cells = columns
            .iter()
            .map(|&(p, proto)| ("--cell", p, proto))
            .chain(providers.iter().map(|&p| ("--collnet-cell", p, "auto")));
        for (kind, p, proto) in cells {
            let t = Instant::now();
            let out = Command::new(DEMO)
                .args([kind, &v.to_string(), "--provider", p])
                .env("WEFT_PROTOCOL", proto)
                .output()
                .expect("run weft-demo");
            let text = String::from_utf8_lossy(&out.stdout);
            let last = text.lines().last().unwrap_or("").to_owned();
            let cell = match last.strip_prefix("checks ") {
                Some(n) if out.status.success() => {
                    format!("pass ({n}, {:.1} s)", t.elapsed().as_secs_f64())
                }
                _ => {
                    failures.push(format!(
                        "{kind} v{v} over {p} ({proto}): {last}\n{}",
                        String::from_utf8_lossy(&out.stderr)
                            .lines()
                            .take(5)
                            .collect::<Vec<_>>()
                            .join("\n")
                    ));
                    "FAIL".to_owned()
                }
            };
            row.push_str(&format!(" | {cell:<20}"));
        }
        rows.push(row);
    }
    println!("\nversion matrix (NCCL-host emulation, two processes per cell; checks, time):");
    let mut head = format!("{:<14}", "table  NCCL");
    for (p, q) in &columns {
        head.push_str(&format!(" | {:<20}", format!("{p} {q}")));
    }
    for p in &providers {
        head.push_str(&format!(" | {:<20}", format!("CollNet {p}")));
    }
    println!("{head}");
    for r in &rows {
        println!("{r}");
    }
    let rma = std::env::var("WEFT_TEST_MATRIX_RMA_PROVIDERS");
    let rma: Vec<&str> = match &rma {
        Ok(list) => list.split(',').filter(|p| !p.is_empty()).collect(),
        Err(_) => providers.clone(),
    };
    if rma.is_empty() {
        println!("\nRMA rows: none (WEFT_TEST_MATRIX_RMA_PROVIDERS is empty)");
    } else {
        rma_rows(&rma, &mut failures);
    }
    assert!(
        failures.is_empty(),
        "failing cells:\n{}",
        failures.join("\n\n")
    );
}

/// The RMA rows: every `ncclRmaPlugin_vN` table x provider, a group of two
/// `weft-rma-rank` processes running the `full` scenario with puts up to
/// 1 MiB (tests/src/rma_group.rs); checks are both ranks' `ok` lines.
fn rma_rows(providers: &[&str], failures: &mut Vec<String>) {
    const RANK: &str = env!("CARGO_BIN_EXE_weft-rma-rank");
    let max_put = 1usize << 20;
    let mut rows = Vec::new();
    for &(v, releases) in weft::NCCL_RMA_RELEASES {
        let mut row = format!("v{v:<3} {releases:<14}");
        for &p in providers {
            let t = Instant::now();
            let outs = weft_tests::rma_group::run(RANK, v, 2, p, &[("MAX_PUT", "1048576")], "full");
            let lacks: Vec<String> = outs
                .iter()
                .enumerate()
                .flat_map(|(r, o)| {
                    let mut l = weft_tests::rma_group::full_lacks(&o.stdout, max_put, v >= 16);
                    if !o.ok {
                        l.insert(0, o.stdout.lines().last().unwrap_or("no output").to_owned());
                    }
                    // On verbs with a shared receive context (the tests'
                    // default there) the puts must go as announced writes.
                    if p.starts_with("verbs")
                        && !o.stderr.contains(weft_tests::rma_group::PLAIN_WRITES)
                    {
                        l.push("no INFO line saying the puts are plain writes".to_owned());
                    }
                    l.into_iter().map(move |x| format!("rank {r}: {x}"))
                })
                .collect();
            let cell = if lacks.is_empty() {
                let checks: usize = outs
                    .iter()
                    .map(|o| o.stdout.lines().filter(|l| l.starts_with("ok ")).count())
                    .sum();
                format!("pass ({checks}, {:.1} s)", t.elapsed().as_secs_f64())
            } else {
                failures.push(format!("RMA v{v} over {p}: {}", lacks.join("; ")));
                "FAIL".to_owned()
            };
            row.push_str(&format!(" | {cell:<20}"));
        }
        rows.push(row);
    }
    println!(
        "\nRMA tables (two weft-rma-rank processes per cell, fake CUDA driver; checks, time):"
    );
    let mut head = format!("{:<19}", "table  NCCL");
    for p in providers {
        head.push_str(&format!(" | {:<20}", format!("RMA {p}")));
    }
    println!("{head}");
    for r in &rows {
        println!("{r}");
    }
}
