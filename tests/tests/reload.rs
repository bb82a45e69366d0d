//! Unload and reload, as NCCL >= 2.28 does (`NCCL_NET_PLUGIN_REF_COUNT=0`):
//! dlopen -> init -> transfer to another process -> finalize -> dlclose,
//! several times, through the v11 and v12 tables, on tcp and shm. After each
//! last finalize no Weft thread may be left (`weft-demo --reload` checks it).

use std::process::Command;

const DEMO: &str = env!("CARGO_BIN_EXE_weft-demo");

fn reload(version: u32, provider: &str) {
    reload_with(version, provider, "rdma");
}

fn reload_with(version: u32, provider: &str, protocol: &str) {
    let out = Command::new(DEMO)
        .args(["--reload", &version.to_string(), "--cycles", "3"])
        .args(["--messages", "8", "--provider", provider])
        .env("WEFT_PROTOCOL", protocol)
        .output()
        .expect("run weft-demo --reload");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("v{version} over {provider}:\n{text}");
    assert!(
        out.status.success() && text.contains("reloaded 3 times"),
        "v{version} over {provider}: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.matches("0 keeper thread(s)").count(),
        3,
        "every cycle ends without a keeper thread: {text}"
    );
}

#[test]
fn v11_reloads_over_tcp() {
    weft_tests::isolated!();
    reload(11, "tcp");
}

#[test]
fn v12_reloads_over_tcp() {
    weft_tests::isolated!();
    reload(12, "tcp");
}

#[test]
fn v11_reloads_over_shm() {
    weft_tests::isolated!();
    reload(11, "shm");
}

#[test]
fn v12_reloads_over_shm() {
    weft_tests::isolated!();
    reload(12, "shm");
}

#[test]
fn v12_reloads_over_tcp_sendrecv() {
    weft_tests::isolated!();
    reload_with(12, "tcp", "sendrecv");
}

#[test]
fn v12_reloads_over_shm_sendrecv() {
    weft_tests::isolated!();
    reload_with(12, "shm", "sendrecv");
}
