//! Emits tracing events through the plugin's logging path without an NCCL
//! logger, then with `--with-logger` after installing the capturing one. The
//! logging test checks that the first prints nothing at all.

fn main() {
    weft::log::install_subscriber();
    tracing::warn!("probe: a warning before NCCL gave us a logger");
    tracing::info!(target: "weft::init", "probe: info before a logger");
    if std::env::args().any(|a| a == "--with-logger") {
        weft::log::set_logger(Some(weft_tests::capture::weft_test_capture_logger));
        tracing::warn!("probe: a warning with a logger");
        let n = weft_tests::capture::lines().len();
        // Reported on stdout so the test can see the logger was reached.
        println!("captured {n}");
    }
}
