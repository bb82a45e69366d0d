//! The README's first command. Today it shows what Weft would carry NCCL's
//! traffic over on this host: the libfabric version, every provider offering
//! reliable tagged endpoints, and the devices Weft picks (honouring `WEFT_*`).
//!
//! Usage: weft-demo [--provider NAME]

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use weft::config::{canonical_provider, Config};
use weft::fabric::{Hints, InfoList};

fn main() -> ExitCode {
    let start = Instant::now();
    let mut args = std::env::args().skip(1);
    let mut provider = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--provider" => provider = args.next(),
            "-h" | "--help" => {
                println!("usage: weft-demo [--provider NAME]   (NAME: e.g. tcp, shm, efa)");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("weft-demo: unknown argument {other:?}; try --help");
                return ExitCode::from(2);
            }
        }
    }

    let mut config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("weft-demo: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(p) = &provider {
        config.providers = vec![canonical_provider(p)];
    }

    // SAFETY: fi_version takes no arguments.
    let v = unsafe { libfabric_sys::fi_version() };
    println!("libfabric {}.{}", v >> 16, v & 0xffff);

    match InfoList::get(&Hints::rdm_tagged(None)) {
        Ok(list) => {
            let mut by_provider: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for i in list.iter() {
                let domains = by_provider.entry(i.provider().to_owned()).or_default();
                if !domains.iter().any(|d| d == i.domain_name()) {
                    domains.push(i.domain_name().to_owned());
                }
            }
            println!("\nproviders with reliable tagged endpoints (FI_EP_RDM, FI_TAGGED):");
            println!("  {:<16} domains", "provider");
            for (p, d) in &by_provider {
                println!("  {:<16} {}", p, d.join(", "));
            }
        }
        Err(e) => {
            eprintln!("weft-demo: {e}");
            return ExitCode::FAILURE;
        }
    }

    println!(
        "\nWeft's devices (providers tried: {}; WEFT_IFACE: {}):",
        config.providers.join(", "),
        if config.ifaces.is_empty() {
            "(all)".to_owned()
        } else {
            config.ifaces.join(",")
        }
    );
    let code = match weft::device::discover(&config) {
        Ok(devs) => {
            println!(
                "  {:<4} {:<16} {:<10} {:<18} max message",
                "dev", "provider", "domain", "fabric"
            );
            for d in devs {
                println!(
                    "  {:<4} {:<16} {:<10} {:<18} {}",
                    d.index, d.provider, d.domain, d.fabric, d.max_msg_size
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("  none: {e}");
            ExitCode::FAILURE
        }
    };
    println!("\ndone in {:.2} s", start.elapsed().as_secs_f64());
    code
}
