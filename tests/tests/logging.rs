//! tracing -> NCCL logger bridge, through a C-variadic capturing logger.

use std::process::Command;

use weft::log::{level, subsys, PREFIX};
use weft_tests::capture::{lines, weft_test_capture_logger};

#[test]
fn events_reach_the_nccl_logger_with_a_constant_format() {
    weft_tests::isolated!();
    // One test process per test (nextest), so setting NCCL_DEBUG here is safe.
    std::env::set_var("NCCL_DEBUG", "TRACE");
    weft::log::set_logger(Some(weft_test_capture_logger));

    let hostile = "peer said %n%s%x %%";
    let warn_line = line!() + 1;
    tracing::warn!("dead peer 10.0.0.1: {hostile}");
    tracing::info!(target: "weft::init", "init line");
    tracing::trace!(bytes = 42u64, "trace with a field");

    let got = lines();
    assert_eq!(got.len(), 3, "{got:#?}");
    for l in &got {
        assert_eq!(
            l.fmt, "%s",
            "the text must be an argument, never the format"
        );
        assert!(l.text.starts_with(PREFIX), "{l:?}");
        assert!(l.file.ends_with("logging.rs"), "{l:?}");
    }
    assert_eq!(got[0].level, level::WARN);
    assert_eq!(got[0].flags, subsys::NET);
    assert_eq!(got[0].line, warn_line as i32);
    assert_eq!(
        got[0].text,
        format!("{PREFIX}dead peer 10.0.0.1: {hostile}")
    );
    assert_eq!(got[1].level, level::INFO);
    assert_eq!(got[1].flags, subsys::INIT | subsys::NET);
    assert_eq!(got[2].level, level::TRACE);
    assert!(
        got[2].text.ends_with("trace with a field bytes=42"),
        "{:?}",
        got[2]
    );
}

#[test]
fn a_callsite_seen_before_the_logger_still_reaches_it_later() {
    weft_tests::isolated!();
    std::env::set_var("NCCL_DEBUG", "WARN");
    weft::log::install_subscriber();
    let emit = |n: u32| tracing::warn!("same callsite, call {n}");
    emit(1); // no logger yet: dropped, and must not be cached as "never"
    weft::log::set_logger(Some(weft_test_capture_logger));
    emit(2);
    let got = lines();
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        got[0].text.ends_with("same callsite, call 2"),
        "{:?}",
        got[0]
    );
}

#[test]
fn nccl_debug_warn_filters_info() {
    weft_tests::isolated!();
    std::env::set_var("NCCL_DEBUG", "WARN");
    weft::log::set_logger(Some(weft_test_capture_logger));
    tracing::info!("not forwarded at NCCL_DEBUG=WARN");
    tracing::warn!("forwarded");
    let got = lines();
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(got[0].text.ends_with("forwarded"));
}

#[test]
fn nothing_is_printed_before_nccl_hands_a_logger() {
    weft_tests::isolated!();
    let probe = env!("CARGO_BIN_EXE_weft-log-probe");
    let out = Command::new(probe).output().expect("run weft-log-probe");
    assert!(out.status.success(), "{out:?}");
    assert!(
        out.stdout.is_empty(),
        "stdout: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        out.stderr.is_empty(),
        "stderr: {:?}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The same probe with a logger does reach it (so the test above can fail).
    let out = Command::new(probe)
        .arg("--with-logger")
        .env("NCCL_DEBUG", "WARN")
        .output()
        .expect("run weft-log-probe --with-logger");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "captured 1");
}
