//! Runs one micro-benchmark case `n` times, for callgrind: `weft-bench
//! --micro` runs `valgrind --tool=callgrind --toggle-collect=<function>
//! weft-micro <case> <n>` and divides the instructions counted inside the
//! case's function by `n`. Setup happens outside that function.
//!
//! Cases: c-pair, weft-pair, c-burst, weft-burst (per round of 256 allocs and
//! 256 frees), mr-hit, core-devices, v5-devices, v12-devices.

use std::process::ExitCode;

use weft_tests::micro;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(case), Some(n)) = (
        args.first(),
        args.get(1).and_then(|n| n.parse::<u64>().ok()),
    ) else {
        eprintln!("usage: weft-micro <case> <n>");
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
