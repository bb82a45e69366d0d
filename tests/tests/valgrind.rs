//! Memory checking in CI: the unload/reload cycle (two processes, init ->
//! transfer -> finalize -> dlclose, twice) under valgrind memcheck, both
//! processes traced. Any invalid read or write, use of uninitialised memory,
//! bad free, or definite/indirect leak fails the test. `./weft setup` installs
//! valgrind; without it this test fails and says so (it is never skipped).

use std::process::Command;

const DEMO: &str = env!("CARGO_BIN_EXE_weft-demo");

fn memcheck(provider: &str) {
    let out = Command::new("valgrind")
        .args([
            "--trace-children=yes",
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite,indirect",
            "--show-leak-kinds=definite,indirect",
        ])
        .arg(DEMO)
        .args(["--reload", "12", "--cycles", "2", "--messages", "4"])
        .args(["--provider", provider])
        .output()
        .unwrap_or_else(|e| panic!("cannot run valgrind ({e}): install it with `./weft setup`"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("ERROR SUMMARY") || l.contains("definitely lost"))
        .collect();
    println!("{provider} under valgrind:\n{stdout}{}", summary.join("\n"));
    assert!(
        out.status.success() && stdout.contains("reloaded 2 times"),
        "{provider}: valgrind reported errors or the run failed (exit {:?}):\n{stdout}\n{stderr}",
        out.status.code()
    );
    assert!(
        summary
            .iter()
            .any(|l| l.contains("ERROR SUMMARY: 0 errors")),
        "{provider}: no clean valgrind summary:\n{stderr}"
    );
}

#[test]
fn tcp_reload_cycle_is_clean_under_memcheck() {
    weft_tests::isolated!();
    memcheck("tcp");
}

#[test]
fn shm_reload_cycle_is_clean_under_memcheck() {
    weft_tests::isolated!();
    memcheck("shm");
}
