//! `weft info`: what Weft sees on this host, the first thing to run on a new
//! one. It loads the plugin the way NCCL does (`dlopen`, then the newest
//! `ncclNetPlugin_vN` table) and asks it through that table for its devices
//! and their properties exactly as NCCL would get them; beside that it shows
//! the libfabric version, the providers Weft tried and why it passed over the
//! others, the protocol, the exported tables with the NCCL releases that pick
//! each, and the effective configuration with where each value came from.
//!
//! ```text
//! weft info [--json] [--plugin PATH]
//! ```

use std::ffi::{c_char, c_int, CStr};
use std::process::ExitCode;

use nccl_net_weft::net_v12::{ncclNetCommConfig_v12_t, ncclNetProperties_v12_t, ncclNet_v12_t};
use nccl_net_weft::tools::{self, Config, Outcome, Source};
use nccl_net_weft::{NCCL_RELEASES, NCCL_RMA_RELEASES};
use serde_json::{json, Value};

use crate::plugin::{open_plugin, Lib};

fn cstr(p: *const c_char) -> Value {
    if p.is_null() {
        return Value::Null;
    }
    // SAFETY: the plugin's properties hold NUL-terminated strings that live
    // as long as the plugin.
    Value::from(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The properties of one device as NCCL reads them (every field of v12).
fn props_json(p: &ncclNetProperties_v12_t) -> Value {
    let ptr = match p.ptrSupport {
        1 => "HOST".to_owned(),
        3 => "HOST|CUDA".to_owned(),
        7 => "HOST|CUDA|DMABUF".to_owned(),
        n => format!("{n:#x}"),
    };
    let n = usize::try_from(p.vProps.ndevs)
        .unwrap_or(0)
        .min(p.vProps.devs.len());
    json!({
        "name": cstr(p.name),
        "pciPath": cstr(p.pciPath),
        "guid": format!("{:#x}", p.guid),
        "ptrSupport": ptr,
        "regIsGlobal": p.regIsGlobal,
        "forceFlush": p.forceFlush,
        "speed": p.speed,
        "port": p.port,
        "latency": p.latency,
        "maxComms": p.maxComms,
        "maxRecvs": p.maxRecvs,
        "netDeviceType": p.netDeviceType,
        "netDeviceVersion": p.netDeviceVersion,
        "vProps": &p.vProps.devs[..n],
        "maxP2pBytes": p.maxP2pBytes,
        "maxCollBytes": p.maxCollBytes,
        "maxMultiRequestSize": p.maxMultiRequestSize,
        "railId": p.railId,
        "planeId": p.planeId,
    })
}

/// Asks the plugin, through its v12 table, for its devices' properties.
fn devices_through_table(lib: &Lib) -> Result<Vec<Value>, String> {
    // SAFETY: the plugin exports its v12 table under this name.
    let t: &ncclNet_v12_t = unsafe { lib.table("ncclNetPlugin_v12")? };
    let call = |what: &str, r: c_int| {
        if r == 0 {
            Ok(())
        } else {
            Err(format!(
                "ncclNetPlugin_v12.{what} returned ncclResult_t {r}"
            ))
        }
    };
    let mut ctx = std::ptr::null_mut();
    let mut cfg = ncclNetCommConfig_v12_t { trafficClass: -1 };
    let (init, devices, props, finalize) = (
        t.init.ok_or("no init")?,
        t.devices.ok_or("no devices")?,
        t.getProperties.ok_or("no getProperties")?,
        t.finalize.ok_or("no finalize")?,
    );
    // SAFETY: NCCL's calling conventions for v12: a context out-pointer and
    // a config (no logger: the configuration and provider checks that could
    // fail init ran above, in this process, and said why); the properties
    // struct is NCCL's to fill.
    unsafe {
        call(
            "init",
            init(&mut ctx, 0, &mut cfg, None, std::ptr::null_mut()),
        )?;
        let mut n = 0;
        call("devices", devices(&mut n))?;
        let mut out = Vec::new();
        for d in 0..n {
            let mut p: ncclNetProperties_v12_t = std::mem::zeroed();
            call("getProperties", props(d, &mut p))?;
            out.push(props_json(&p));
        }
        call("finalize", finalize(ctx))?;
        Ok(out)
    }
}

fn tables(lib: &Lib) -> Vec<Value> {
    let mut out = Vec::new();
    for &(v, releases) in NCCL_RELEASES.iter().rev() {
        for (family, name) in [("net", "ncclNetPlugin"), ("collnet", "ncclCollNetPlugin")] {
            let sym = format!("{name}_v{v}");
            out.push(json!({
                "table": sym,
                "family": family,
                "exported": lib.sym(&sym).is_some(),
                "nccl": releases,
            }));
        }
    }
    for &(v, releases) in NCCL_RMA_RELEASES.iter().rev() {
        let sym = format!("ncclRmaPlugin_v{v}");
        out.push(json!({
            "table": sym,
            "family": "rma",
            "exported": lib.sym(&sym).is_some(),
            "nccl": releases,
        }));
    }
    out
}

fn report(lib: &Lib) -> Result<Value, String> {
    let config = Config::from_env().map_err(|e| e.to_string())?;
    let (providers, found) = tools::survey(&config).map_err(|e| e.to_string())?;
    let (protocol, why) = tools::choose_protocol(config.protocol, &found)?;
    // GPU memory: the driver, and per device whether the provider offers
    // FI_HMEM (the rest of the claim, a registration of device memory, is
    // the plugin's INFO line at init and ptrSupport below).
    let gpu = json!({
        "driver": match tools::gpu_driver() {
            Ok(d) => format!("usable, {} CUDA device(s)", d.devices()),
            Err(e) => e.to_string(),
        },
        "fi_hmem": found
            .iter()
            .map(|d| match (&d.hmem, tools::gpu_driver()) {
                (_, Err(_)) => format!("{}: not asked (no usable CUDA driver)", d.domain),
                (Ok(()), _) => format!("{}: offered", d.domain),
                (Err(why), _) => format!("{}: {why}", d.domain),
            })
            .collect::<Vec<_>>(),
    });
    let v = libfabric_sys::running_version();
    let providers: Vec<Value> = providers
        .into_iter()
        .map(|r| {
            let (state, detail) = match r.outcome {
                Outcome::Used(d) => ("used", d.join(", ")),
                Outcome::Skipped(why) => ("skipped", why),
                Outcome::NotTried => ("not tried", "an earlier provider has devices".to_owned()),
            };
            json!({"provider": r.provider, "state": state, "detail": detail})
        })
        .collect();
    let config: Vec<Value> = config
        .effective()
        .into_iter()
        .map(|(name, value, source)| {
            let source = match source {
                Source::Default => "default".to_owned(),
                Source::Env(v) => format!("environment ({v})"),
            };
            json!({"name": name, "value": value, "source": source})
        })
        .collect();
    Ok(json!({
        "weft": env!("CARGO_PKG_VERSION"),
        "library": lib.path,
        "libfabric": libfabric_sys::version_text(v),
        "libfabric_needed": libfabric_sys::version_text(libfabric_sys::WEFT_FI_VERSION),
        "libfabric_headers": libfabric_sys::version_text(libfabric_sys::HEADERS_FI_VERSION),
        "libfabric_api": libfabric_sys::version_text(libfabric_sys::api_version()),
        "configuration": config,
        "providers": providers,
        "protocol": format!("{} ({why})", protocol.name()),
        "gpu": gpu,
        "devices": devices_through_table(lib)?,
        "tables": tables(lib),
    }))
}

fn print_text(r: &Value) {
    let s = |v: &Value| v.as_str().map_or_else(|| v.to_string(), str::to_owned);
    println!("Weft {} (NCCL net plugin over libfabric)", s(&r["weft"]));
    println!(
        "library:   {} (loaded with dlopen, as NCCL does)",
        s(&r["library"])
    );
    println!(
        "libfabric: {} (Weft needs >= {}; built with the headers of {}; asks for API {})",
        s(&r["libfabric"]),
        s(&r["libfabric_needed"]),
        s(&r["libfabric_headers"]),
        s(&r["libfabric_api"])
    );
    println!("\nconfiguration:");
    for c in r["configuration"].as_array().into_iter().flatten() {
        println!(
            "  {:<21} = {}  [{}]",
            s(&c["name"]),
            s(&c["value"]),
            s(&c["source"])
        );
    }
    println!("\nproviders, in the order tried:");
    for p in r["providers"].as_array().into_iter().flatten() {
        println!(
            "  {:<14} {:<9} {}",
            s(&p["provider"]),
            s(&p["state"]),
            s(&p["detail"])
        );
    }
    println!("\nprotocol:  {}", s(&r["protocol"]));
    println!("\nGPU memory (ptrSupport CUDA needs all three: driver, FI_HMEM, a device-memory registration at init):");
    println!("  CUDA driver: {}", s(&r["gpu"]["driver"]));
    for d in r["gpu"]["fi_hmem"].as_array().into_iter().flatten() {
        println!("  FI_HMEM on {}", s(d));
    }
    println!("\ndevices, as NCCL sees them (ncclNetPlugin_v12 getProperties):");
    for (i, d) in r["devices"].as_array().into_iter().flatten().enumerate() {
        println!("  device {i}:");
        for (k, v) in d.as_object().into_iter().flatten() {
            println!("    {k:<20} {}", s(v));
        }
    }
    println!("\ntables (NCCL uses the newest it knows):");
    for t in r["tables"].as_array().into_iter().flatten() {
        println!(
            "  {:<22} {:<12} NCCL {}",
            s(&t["table"]),
            if t["exported"].as_bool() == Some(true) {
                "exported"
            } else {
                "MISSING"
            },
            s(&t["nccl"])
        );
    }
}

/// `weft info ARGS`.
pub fn main(args: &[String]) -> ExitCode {
    let mut args = args.iter().cloned();
    let (mut json_out, mut plugin) = (false, None);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => json_out = true,
            "--plugin" => plugin = args.next(),
            _ => {
                eprintln!("usage: weft info [--json] [--plugin PATH]");
                return ExitCode::from(2);
            }
        }
    }
    let result = open_plugin(plugin).and_then(|lib| report(&lib));
    match result {
        Ok(r) if json_out => {
            println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Ok(r) => {
            print_text(&r);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weft info: {e}");
            ExitCode::FAILURE
        }
    }
}
