//! The resource curve: what connected comm pairs cost a process.
//!
//! ```text
//! weft-resources [--providers tcp,shm] [--protocols rdma,sendrecv] [--pairs 1,64,512,1024] [--max-rss-mb 4096]
//! ```
//!
//! For each provider and protocol (each in a process of its own, since the
//! plugin's configuration is per process), opens connected send/receive comm pairs
//! on device 0 through the core, as NCCL does (listen, connect, accept,
//! closeListen), growing to each count in `--pairs`, and prints the open
//! endpoints, file descriptors and resident memory, in total and per pair.
//! It stops growing once resident memory passes `--max-rss-mb` (under
//! sendrecv every comm has an endpoint of its own, and a tcp;ofi_rxm endpoint
//! holds tens of MB at rxm's default queue sizes; rdma's comms share their
//! device's two endpoints) and says so. No speed is measured.

use std::process::{Command, ExitCode};

use weft_tests::host;
use weft_tests::status_kb;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Runs one provider's curve in this process.
fn curve(provider: &str, protocol: &str, counts: &[usize], max_rss_mb: u64) -> Result<(), String> {
    std::env::set_var("WEFT_PROTOCOL", protocol);
    let ctx = host::init(provider);
    let (fds0, rss0) = (open_fds(), status_kb("VmRSS"));
    let eps0 = weft::fabric::local::open_endpoints();
    println!(
        "{provider} {protocol}: baseline after init: {eps0} endpoints, {fds0} fds, {} MB resident",
        rss0 / 1024
    );
    println!(
        "{:<10} {:<9} {:>6} {:>10} {:>8} {:>10} {:>14} {:>14}",
        "provider",
        "protocol",
        "pairs",
        "endpoints",
        "fds",
        "RSS MB",
        "MB per pair",
        "fds per pair"
    );
    let mut pairs = Vec::new();
    for &target in counts {
        while pairs.len() < target {
            if status_kb("VmRSS") / 1024 > max_rss_mb {
                println!(
                    "{provider}: stopped at {} pairs: resident memory passed --max-rss-mb {max_rss_mb}",
                    pairs.len()
                );
                return Ok(());
            }
            pairs.push(host::pair(ctx));
        }
        let n = pairs.len();
        let (fds, rss) = (open_fds(), status_kb("VmRSS"));
        let eps = weft::fabric::local::open_endpoints();
        println!(
            "{provider:<10} {protocol:<9} {n:>6} {:>10} {fds:>8} {:>10} {:>14.2} {:>14.2}",
            eps - eps0,
            rss / 1024,
            (rss.saturating_sub(rss0)) as f64 / 1024.0 / n as f64,
            (fds.saturating_sub(fds0)) as f64 / n as f64,
        );
    }
    for (s, r) in pairs {
        host::close_pair(s, r);
    }
    Ok(())
}

fn list(v: &str) -> Vec<String> {
    v.split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut providers, mut protocols, mut counts, mut max_rss_mb, mut one) = (
        list("tcp,shm"),
        list("rdma,sendrecv"),
        vec![1, 64, 512, 1024],
        4096u64,
        None,
    );
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_default();
        match a.as_str() {
            "--providers" => providers = list(&val()),
            "--protocols" => protocols = list(&val()),
            "--pairs" => counts = list(&val()).iter().filter_map(|c| c.parse().ok()).collect(),
            "--max-rss-mb" => max_rss_mb = val().parse().unwrap_or(max_rss_mb),
            "--one" => one = Some(val()),
            _ => {
                eprintln!("usage: weft-resources [--providers tcp,shm] [--protocols rdma,sendrecv] [--pairs 1,64,512,1024] [--max-rss-mb 4096]");
                return ExitCode::from(2);
            }
        }
    }
    counts.sort_unstable();
    if let Some(p) = one {
        let (p, proto) = p.split_once(':').unwrap_or((&p, "auto"));
        return match curve(p, proto, &counts, max_rss_mb) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("weft-resources: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let counts_arg = counts
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let exe = std::env::current_exe().expect("current_exe");
    let mut ok = true;
    for (p, proto) in providers
        .iter()
        .flat_map(|p| protocols.iter().map(move |q| (p, q)))
    {
        let status = Command::new(&exe)
            .args([
                "--one",
                &format!("{p}:{proto}"),
                "--pairs",
                &counts_arg,
                "--max-rss-mb",
                &max_rss_mb.to_string(),
            ])
            .status();
        ok &= status.is_ok_and(|s| s.success());
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
