//! `weft`: the operator's command, installed beside the plugin.
//!
//! ```text
//! weft info  [--json] [--plugin PATH]        what Weft sees on this host
//! weft bench [HOST[:PORT]] [OPTIONS]         Weft against raw libfabric
//! weft bench --listen [ADDR:]PORT [OPTIONS]  the other side of a two-host run
//! ```
//!
//! Both load the plugin the way NCCL does (`plugin`) and speak to it only
//! through its exported C tables.

use std::process::ExitCode;

mod bench;
mod info;
mod plugin;

const USAGE: &str = "usage: weft info [--json] [--plugin PATH]
       weft bench [HOST[:PORT]] [OPTIONS]     (weft bench --help)
       weft bench --listen [ADDR:]PORT [OPTIONS]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("info") => info::main(&args[1..]),
        Some("bench") => bench::main(&args[1..]),
        Some("-h" | "--help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
