//! `WEFT_*` configuration: typed, validated once at init, logged once at INFO.
//!
//! [`PARAMS`] is the one list of parameters; the README's configuration table
//! is checked against it by a test, and every entry is read by [`Config::from_lookup`]
//! (a test gives each one a bad value and expects init to fail naming it).

use std::sync::OnceLock;
use std::time::Duration;

/// One documented parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    /// Environment variable.
    pub name: &'static str,
    /// Default, as the README shows it.
    pub default: &'static str,
    /// What values are accepted.
    pub accepted: &'static str,
    /// What it does.
    pub meaning: &'static str,
}

/// Every `WEFT_*` parameter of the plugin, in README order.
pub const PARAMS: &[Param] = &[
    Param {
        name: "WEFT_PROVIDER",
        default: "efa, verbs;ofi_rxm, tcp;ofi_rxm (first with a device)",
        accepted: "libfabric provider names, comma-separated, in order of preference; `tcp` = `tcp;ofi_rxm`",
        meaning: "which libfabric provider carries NCCL's traffic",
    },
    Param {
        name: "WEFT_IFACE",
        default: "unset (every device)",
        accepted: "device (libfabric domain) names, comma-separated, e.g. `lo` or `eth0,eth1`",
        meaning: "keep only these devices; for tcp and verbs a device is named after its interface or NIC. Ignored by shm, whose one domain is the host",
    },
    Param {
        name: "WEFT_PROTOCOL",
        default: "sendrecv",
        accepted: "`sendrecv` (tagged messages)",
        meaning: "data-path protocol; the RDMA-write protocol is not in this build and is refused",
    },
    Param {
        name: "WEFT_EAGER_SIZE",
        default: "8192",
        accepted: "bytes, 0 ..= 65536",
        meaning: "messages up to this size (and the provider's inject size) go out with fi_tinject: copied at once, so the send request is done immediately",
    },
    Param {
        name: "WEFT_LINK_SPEED_MBPS",
        default: "unset: /sys/class/net/<if>/speed, else 10000",
        accepted: "Mbit/s, 1 ..= 10000000",
        meaning: "link speed reported to NCCL (`speed` in the properties) when sysfs does not know it or is wrong",
    },
    Param {
        name: "WEFT_PEER_TIMEOUT",
        default: "30",
        accepted: "seconds, decimals allowed, 0.1 ..= 3600",
        meaning: "how long a peer may stay silent before it is declared dead: connect and accept give up, and every request in flight on a comm to it fails (remote error). Both ends say Alive every timeout/8 from a background thread, so an idle live peer never times out",
    },
];

/// Data-path protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Tagged messages (`fi_tsend`/`fi_trecv`).
    SendRecv,
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Providers to try, in order.
    pub providers: Vec<String>,
    /// Device names to keep; empty = all.
    pub ifaces: Vec<String>,
    /// Data-path protocol.
    pub protocol: Protocol,
    /// Eager threshold in bytes.
    pub eager_size: usize,
    /// Reported link speed override.
    pub link_speed_mbps: Option<u32>,
    /// Peer liveness timeout.
    pub peer_timeout: Duration,
}

/// The default provider order when `WEFT_PROVIDER` is unset.
pub const DEFAULT_PROVIDERS: &[&str] = &["efa", "verbs;ofi_rxm", "tcp;ofi_rxm"];

/// A parameter with a value Weft does not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is not valid: {why}. Accepted: {accepted}. Fix or unset {name}.")]
pub struct ConfigError {
    /// The variable.
    pub name: &'static str,
    /// The value found.
    pub value: String,
    /// Why it was refused.
    pub why: String,
    /// What is accepted.
    pub accepted: &'static str,
}

fn param(name: &str) -> &'static Param {
    PARAMS
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("{name} is missing from config::PARAMS"))
}

fn err(name: &'static str, value: &str, why: impl Into<String>) -> ConfigError {
    ConfigError {
        name,
        value: value.to_owned(),
        why: why.into(),
        accepted: param(name).accepted,
    }
}

/// Splits a comma-separated list, trimming blanks; an empty item is an error.
fn list(name: &'static str, value: &str) -> Result<Vec<String>, ConfigError> {
    value
        .split(',')
        .map(str::trim)
        .map(|s| {
            if s.is_empty() {
                Err(err(name, value, "an item of the list is empty"))
            } else {
                Ok(s.to_owned())
            }
        })
        .collect()
}

/// Parses an integer in `lo..=hi`.
fn int<T>(name: &'static str, value: &str, lo: T, hi: T) -> Result<T, ConfigError>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    let v: T = value
        .trim()
        .parse()
        .map_err(|_| err(name, value, "not a whole number"))?;
    if v < lo || v > hi {
        return Err(err(name, value, format!("out of range {lo} ..= {hi}")));
    }
    Ok(v)
}

/// Parses seconds (decimals allowed) in `lo..=hi`.
pub fn seconds(name: &'static str, value: &str, lo: f64, hi: f64) -> Result<Duration, ConfigError> {
    let v: f64 = value
        .trim()
        .parse()
        .map_err(|_| err(name, value, "not a number of seconds"))?;
    if !(lo..=hi).contains(&v) {
        return Err(err(
            name,
            value,
            format!("out of range {lo} ..= {hi} seconds"),
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Normalises a provider name (`tcp` is an alias of `tcp;ofi_rxm`).
pub fn canonical_provider(p: &str) -> String {
    match p {
        "tcp" => "tcp;ofi_rxm".to_owned(),
        "verbs" => "verbs;ofi_rxm".to_owned(),
        other => other.to_owned(),
    }
}

impl Config {
    /// Reads and validates the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads and validates parameters through `get` (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut c = Self::default();
        if let Some(v) = get("WEFT_PROVIDER") {
            c.providers = list("WEFT_PROVIDER", &v)?
                .iter()
                .map(|p| canonical_provider(p))
                .collect();
        }
        if let Some(v) = get("WEFT_IFACE") {
            c.ifaces = list("WEFT_IFACE", &v)?;
        }
        if let Some(v) = get("WEFT_PROTOCOL") {
            c.protocol = match v.trim() {
                "sendrecv" => Protocol::SendRecv,
                "rdma" => {
                    return Err(err(
                        "WEFT_PROTOCOL",
                        &v,
                        "the RDMA protocol is not in this build",
                    ))
                }
                _ => return Err(err("WEFT_PROTOCOL", &v, "unknown protocol")),
            };
        }
        if let Some(v) = get("WEFT_EAGER_SIZE") {
            c.eager_size = int("WEFT_EAGER_SIZE", &v, 0usize, 65536)?;
        }
        if let Some(v) = get("WEFT_LINK_SPEED_MBPS") {
            c.link_speed_mbps = Some(int("WEFT_LINK_SPEED_MBPS", &v, 1u32, 10_000_000)?);
        }
        if let Some(v) = get("WEFT_PEER_TIMEOUT") {
            c.peer_timeout = seconds("WEFT_PEER_TIMEOUT", &v, 0.1, 3600.0)?;
        }
        Ok(c)
    }

    /// Logs every parameter once at INFO (NCCL_INIT).
    pub fn log(&self) {
        let providers = self.providers.join(", ");
        let ifaces = if self.ifaces.is_empty() {
            "(all)".to_owned()
        } else {
            self.ifaces.join(", ")
        };
        tracing::info!(target: "weft::init", "WEFT_PROVIDER = {providers}");
        tracing::info!(target: "weft::init", "WEFT_IFACE = {ifaces}");
        tracing::info!(target: "weft::init", "WEFT_PROTOCOL = {:?}", self.protocol);
        tracing::info!(target: "weft::init", "WEFT_EAGER_SIZE = {} bytes", self.eager_size);
        match self.link_speed_mbps {
            Some(s) => tracing::info!(target: "weft::init", "WEFT_LINK_SPEED_MBPS = {s}"),
            None => {
                tracing::info!(target: "weft::init", "WEFT_LINK_SPEED_MBPS = (sysfs, else 10000)")
            }
        }
        tracing::info!(target: "weft::init", "WEFT_PEER_TIMEOUT = {:.3} s", self.peer_timeout.as_secs_f64());
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            providers: DEFAULT_PROVIDERS.iter().map(|s| (*s).to_owned()).collect(),
            ifaces: Vec::new(),
            protocol: Protocol::SendRecv,
            eager_size: 8192,
            link_speed_mbps: None,
            peer_timeout: Duration::from_secs(30),
        }
    }
}

/// The process configuration: read from the environment and logged the first
/// time it is asked for; every later call returns the same result.
pub fn global() -> Result<&'static Config, ConfigError> {
    static CONFIG: OnceLock<Result<Config, ConfigError>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let c = Config::from_env();
            match &c {
                Ok(c) => c.log(),
                Err(e) => tracing::warn!(target: "weft::init", "configuration refused: {e}"),
            }
            c
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Renders a parameter table in the README's Markdown form.
pub fn markdown_table(params: &[Param]) -> String {
    let mut s = String::from("| Variable | Default | Accepted | Meaning |\n|---|---|---|---|\n");
    for p in params {
        s.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            p.name, p.default, p.accepted, p.meaning
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults() {
        let c = with(&[]).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.providers, ["efa", "verbs;ofi_rxm", "tcp;ofi_rxm"]);
        assert_eq!(c.peer_timeout, Duration::from_secs(30));
    }

    #[test]
    fn values_are_parsed() {
        let c = with(&[
            ("WEFT_PROVIDER", "tcp, shm"),
            ("WEFT_IFACE", "lo"),
            ("WEFT_EAGER_SIZE", "0"),
            ("WEFT_LINK_SPEED_MBPS", "100000"),
            ("WEFT_PEER_TIMEOUT", "2.5"),
        ])
        .unwrap();
        assert_eq!(c.providers, ["tcp;ofi_rxm", "shm"]);
        assert_eq!(c.ifaces, ["lo"]);
        assert_eq!(c.eager_size, 0);
        assert_eq!(c.link_speed_mbps, Some(100_000));
        assert_eq!(c.peer_timeout, Duration::from_millis(2500));
    }

    /// Every parameter is read and validated: a bad value fails naming the
    /// variable, the value and what is accepted.
    #[test]
    fn every_param_rejects_a_bad_value_by_name() {
        let bad = |name: &str| match name {
            "WEFT_PROVIDER" | "WEFT_IFACE" => "a,,b",
            "WEFT_PROTOCOL" => "rdma",
            "WEFT_PEER_TIMEOUT" => "0",
            _ => "-3",
        };
        for p in PARAMS {
            let v = bad(p.name);
            let e = with(&[(p.name, v)]).expect_err(p.name);
            assert_eq!(e.name, p.name);
            let msg = e.to_string();
            assert!(
                msg.contains(p.name) && msg.contains(v) && msg.contains(p.accepted),
                "{msg}"
            );
        }
    }

    #[test]
    fn ranges_are_enforced() {
        assert!(with(&[("WEFT_EAGER_SIZE", "65537")]).is_err());
        assert!(with(&[("WEFT_EAGER_SIZE", "65536")]).is_ok());
        assert!(with(&[("WEFT_PEER_TIMEOUT", "3600.5")]).is_err());
        assert!(with(&[("WEFT_PEER_TIMEOUT", "nan")]).is_err());
        assert!(with(&[("WEFT_LINK_SPEED_MBPS", "0")]).is_err());
        assert!(with(&[("WEFT_PROTOCOL", "sendrecv")]).is_ok());
        assert!(with(&[("WEFT_PROTOCOL", "udp")]).is_err());
    }

    /// The README's configuration table is exactly what the code documents.
    #[test]
    fn readme_tables_match_the_code() {
        let readme = include_str!("../../README.md");
        let table = markdown_table(PARAMS);
        assert!(
            readme.contains(&table),
            "README.md's configuration table differs from config.rs; it must read:\n{table}"
        );
    }
}
