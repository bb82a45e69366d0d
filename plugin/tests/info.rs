//! `weft info` on this host: through the plugin's own v12 table, with the
//! configuration's sources, the providers tried, and every exported table.

use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_weft");

/// Runs `weft info` with exactly `env` (plus PATH, and the loader's path so
/// that it runs on the libfabric this test runs on), finding the library
/// beside the program as an installed one would.
fn info(env: &[(&str, &str)], json: bool) -> Output {
    let mut c = Command::new(BIN);
    c.arg("info").env_clear();
    for keep in ["PATH", "LD_LIBRARY_PATH"] {
        if let Some(v) = std::env::var_os(keep) {
            c.env(keep, v);
        }
    }
    if json {
        c.arg("--json");
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run weft info")
}

fn json(env: &[(&str, &str)]) -> Value {
    let out = info(env, true);
    assert!(
        out.status.success(),
        "weft info failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("weft info --json prints JSON")
}

const TCP_LO: &[(&str, &str)] = &[
    ("WEFT_PROVIDER", "tcp"),
    ("WEFT_IFACE", "lo"),
    ("FI_TCP_IFACE", "lo"),
];

#[test]
fn text_report_names_devices_tables_and_sources() {
    let out = info(TCP_LO, false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let libfabric = format!(
        "libfabric: {} (Weft needs >= 1.17; built with the headers of {}; asks for API {})",
        libfabric_sys::version_text(libfabric_sys::running_version()),
        libfabric_sys::version_text(libfabric_sys::HEADERS_FI_VERSION),
        libfabric_sys::version_text(libfabric_sys::api_version()),
    );
    assert!(
        text.contains(&libfabric),
        "the report lacks {libfabric:?}:\n{text}"
    );
    for want in [
        "WEFT_PROVIDER",
        "environment (WEFT_PROVIDER)",
        "WEFT_PEER_TIMEOUT",
        "[default]",
        "tcp;ofi_rxm",
        "used",
        "device 0:",
        "regIsGlobal",
        "ncclNetPlugin_v12",
        "NCCL 2.30-",
        "ncclCollNetPlugin_v5",
        "rdma (auto:",
        "GPU memory",
        "CUDA driver: no CUDA driver library",
        "FI_HMEM on lo: not asked (no usable CUDA driver)",
    ] {
        assert!(text.contains(want), "the report lacks {want:?}:\n{text}");
    }
}

#[test]
fn json_report_is_what_the_tables_say() {
    let r = json(TCP_LO);
    let devs = r["devices"].as_array().expect("devices");
    assert_eq!(devs.len(), 1, "{r:#}");
    assert_eq!(devs[0]["name"], "lo");
    assert_eq!(devs[0]["ptrSupport"], "HOST");
    assert_eq!(devs[0]["maxRecvs"], 8);
    assert_eq!(devs[0]["regIsGlobal"], 1);
    let tables = r["tables"].as_array().expect("tables");
    // Net and CollNet v5..v12, RMA v13..v16, with the releases that pick them.
    assert_eq!(tables.len(), 20);
    assert!(tables.iter().all(|t| t["exported"] == true), "{tables:?}");
    let rma: Vec<_> = tables.iter().filter(|t| t["family"] == "rma").collect();
    assert_eq!(rma.len(), 4, "{tables:?}");
    assert_eq!(rma[0]["table"], "ncclRmaPlugin_v16");
    assert_eq!(rma[0]["nccl"], "2.32-");
    let provs = r["providers"].as_array().expect("providers");
    assert_eq!((provs.len(), &provs[0]["state"]), (1, &Value::from("used")));
    let cfg = r["configuration"].as_array().expect("configuration");
    let provider = cfg
        .iter()
        .find(|c| c["name"] == "WEFT_PROVIDER")
        .expect("WEFT_PROVIDER");
    assert_eq!(provider["value"], "tcp;ofi_rxm");
    assert_eq!(provider["source"], "environment (WEFT_PROVIDER)");
    // No GPU here: the driver is missing, so FI_HMEM was not asked for.
    let driver = r["gpu"]["driver"].as_str().expect("gpu.driver");
    assert!(driver.contains("libcuda.so.1"), "{driver}");
    // What auto chose, and why: tcp;ofi_rxm offers what rdma needs.
    let proto = r["protocol"].as_str().expect("protocol");
    assert!(
        proto.starts_with("rdma (auto:") && proto.contains("FI_RMA"),
        "{proto}"
    );
}

/// libfabric's convention: FI_PROVIDER alone picks the provider; an empty
/// WEFT_IFACE is unset; the default order reports what it skipped.
#[test]
fn fi_provider_and_empty_variables() {
    let r = json(&[
        ("FI_PROVIDER", "shm"),
        ("WEFT_IFACE", ""),
        ("WEFT_PROVIDER", ""),
    ]);
    let provs = r["providers"].as_array().expect("providers");
    assert_eq!(provs.len(), 1, "{provs:?}");
    assert_eq!(
        (&provs[0]["provider"], &provs[0]["state"]),
        (&Value::from("shm"), &Value::from("used"))
    );
    let cfg = r["configuration"].as_array().expect("configuration");
    assert_eq!(cfg[0]["source"], "environment (FI_PROVIDER)");
    assert_eq!(
        cfg[1]["source"], "default",
        "an empty WEFT_IFACE counts as unset"
    );
    // The default order on this host: efa and verbs skipped, each with a reason.
    let r = json(&[("WEFT_IFACE", "lo"), ("FI_TCP_IFACE", "lo")]);
    let provs = r["providers"].as_array().expect("providers");
    let states: Vec<(&str, &str)> = provs
        .iter()
        .map(|p| {
            (
                p["provider"].as_str().unwrap_or(""),
                p["state"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            ("efa", "skipped"),
            ("verbs;ofi_rxm", "skipped"),
            ("tcp;ofi_rxm", "used")
        ],
        "{provs:?}"
    );
    assert!(provs[0]["detail"].as_str().is_some_and(|d| !d.is_empty()));
}

#[test]
fn conflicting_providers_fail_naming_both() {
    let out = info(&[("FI_PROVIDER", "shm"), ("WEFT_PROVIDER", "tcp")], false);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("WEFT_PROVIDER") && err.contains("FI_PROVIDER"),
        "{err}"
    );
}

/// WEFT_IFACE in NCCL_SOCKET_IFNAME's forms picks the devices.
#[test]
fn iface_filter_in_nccl_forms() {
    let names = |iface: &str| -> Vec<String> {
        let r = json(&[
            ("WEFT_PROVIDER", "tcp"),
            ("WEFT_IFACE", iface),
            ("FI_TCP_IFACE", "lo"),
        ]);
        r["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .map(|d| d["name"].as_str().unwrap_or("").to_owned())
            .collect()
    };
    assert_eq!(names("=lo"), ["lo"]);
    assert_eq!(names("l"), ["lo"], "a prefix");
    // Excluding lo: whatever else the host has (no traffic is sent), or,
    // on a host with lo alone, no device and an error naming the filter.
    let out = info(&[("WEFT_PROVIDER", "tcp"), ("WEFT_IFACE", "^lo")], true);
    if out.status.success() {
        let r: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let devs = r["devices"].as_array().expect("devices");
        assert!(devs.iter().all(|d| d["name"] != "lo"), "{devs:?}");
    } else {
        assert!(String::from_utf8_lossy(&out.stderr).contains("WEFT_IFACE=^lo"));
    }
    let out = info(
        &[("WEFT_PROVIDER", "tcp"), ("WEFT_IFACE", "=no-such-if")],
        false,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("WEFT_IFACE==no-such-if"),
        "{err}"
    );
}
