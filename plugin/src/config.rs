//! `WEFT_*` configuration: typed, validated at init, logged at INFO.
//!
//! [`PARAMS`] is the one list of parameters; the README's configuration table
//! is checked against it by a test, and every entry is read by [`Config::from_lookup`]
//! (a test gives each one a bad value and expects init to fail naming it).
//!
//! Conventions users bring from NCCL and libfabric: a variable set to the
//! empty string (or blanks) counts as unset, and libfabric's `FI_PROVIDER`
//! chooses the providers when `WEFT_PROVIDER` is unset (a `WEFT_PROVIDER` that
//! asks for a provider `FI_PROVIDER` hides from libfabric is an error naming
//! both).

#![forbid(unsafe_code)]

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
        meaning: "which libfabric provider carries NCCL's traffic. When unset, libfabric's `FI_PROVIDER` (a list, or `^` and a list to exclude) chooses among the defaults; both set and disagreeing is an init error",
    },
    Param {
        name: "WEFT_IFACE",
        default: "unset (every device)",
        accepted: "NCCL_SOCKET_IFNAME's forms: name prefixes, comma-separated (`eth` keeps eth0, eth1); `=` first for exact names (`=eth0`); `^` first to exclude (`^docker,lo`), `^=` to exclude exact names",
        meaning: "which devices (libfabric domains) to keep; for tcp and verbs a device is named after its interface or NIC. Ignored by shm, whose one domain is the host",
    },
    Param {
        name: "WEFT_PROTOCOL",
        default: "auto",
        accepted: "`auto`, `sendrecv` (tagged messages), `rdma` (receiver-driven writes)",
        meaning: "data-path protocol. `auto` picks rdma where the provider offers FI_RMA with at least 4 bytes of remote CQ data on every device that really arrive, or where it orders a send after a write (FI_ORDER_SAW) and each write is announced by a message instead (verbs;ofi_rxm with FI_OFI_RXM_USE_SRX=1, docs/verbs.md), else sendrecv, and says at INFO which and why. Forcing `rdma` where the provider cannot is an init error naming what is missing. Every rank must use the same protocol (connect says so if not)",
    },
    Param {
        name: "WEFT_EAGER_SIZE",
        default: "8192",
        accepted: "bytes, 0 ..= 65536",
        meaning: "messages up to this size go without waiting for the receiver, copied at once so the send request is done immediately: sendrecv injects them (fi_tinject) within the provider's inject size; rdma sends them as one control message, injected within the inject size (shm) or from a registered bounce buffer below rxm's eager limit (tcp;ofi_rxm, verbs;ofi_rxm)",
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
    Param {
        name: "WEFT_STRIPE_SIZE",
        default: "131072",
        accepted: "bytes, 4096 ..= 1073741824",
        meaning: "on a virtual device (NCCL's NIC fusion, `makeVDevice`), messages of this size and more are cut into one 4 KiB-aligned slice per rail; smaller ones go whole, over the rails in turn",
    },
    Param {
        name: "WEFT_COLLNET_REDUCERS",
        default: "unset (CollNet reduces among the ranks)",
        accepted: "comma-separated list; each item a file `weft-reducer --handle-file` wrote, or the handle's 256 hex digits that `weft-reducer` printed",
        meaning: "the reduction servers CollNet all-reduces go through (see \"CollNet\"); every rank of a group must list the same reducers in the same order. Files are read at CollNet `connect`, so reducers may start after the ranks' init",
    },
    Param {
        name: "WEFT_RMA",
        default: "auto",
        accepted: "`auto`, `off`",
        meaning: "whether the RMA tables (`ncclRmaPlugin_v13` … `_v16`, NCCL 2.30 and later) claim devices: `auto` claims every device that registers GPU memory with FI_RMA (see docs/rma.md); `off` claims none, so NCCL uses its own RMA backends while Weft still carries the net and CollNet traffic",
    },
];

/// A reducer as `WEFT_COLLNET_REDUCERS` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReducerRef {
    /// The handle itself.
    Handle([u8; crate::nccl::HANDLE_SIZE]),
    /// A file holding it in hex.
    File(std::path::PathBuf),
}

impl std::fmt::Display for ReducerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReducerRef::Handle(h) => {
                write!(f, "handle {}…", &crate::nccl::hex(h)[..16])
            }
            ReducerRef::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// Data-path protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// The best the provider and this build allow.
    Auto,
    /// Tagged messages (`fi_tsend`/`fi_trecv`).
    SendRecv,
    /// Receiver-driven writes (`fi_writedata`).
    Rdma,
}

/// Where a setting's value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Weft's default.
    Default,
    /// An environment variable.
    Env(&'static str),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::Env(v) => write!(f, "environment ({v})"),
        }
    }
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Providers to try, in order.
    pub providers: Vec<String>,
    /// Which device names to keep (`WEFT_IFACE`).
    pub ifaces: IfaceFilter,
    /// Data-path protocol.
    pub protocol: Protocol,
    /// Eager threshold in bytes.
    pub eager_size: usize,
    /// Reported link speed override.
    pub link_speed_mbps: Option<u32>,
    /// Peer liveness timeout.
    pub peer_timeout: Duration,
    /// Virtual devices stripe messages of this size and more.
    pub stripe_size: usize,
    /// CollNet reduction servers.
    pub collnet_reducers: Vec<ReducerRef>,
    /// Whether the RMA tables claim devices (`WEFT_RMA`).
    pub rma: bool,
    /// Where each parameter of [`PARAMS`] came from, in that order.
    pub sources: Vec<Source>,
    /// The test-only switches ([`TEST_SWITCHES`]).
    pub test: TestSwitches,
}

/// The switches only Weft's tests set: they make the plugin behave as a
/// provider this machine lacks would make it (narrow immediates, offset
/// addressing, strict MR modes, device memory registered as host memory).
/// Read and validated with the rest of the configuration; nothing else in
/// the plugin reads a `WEFT_TEST_*` variable.
pub const TEST_SWITCHES: &[Param] = &[
    Param {
        name: "WEFT_TEST_MR_OFFSET",
        default: "unset",
        accepted: "`1`, `0`",
        meaning: "the plugin asks libfabric for RMA without `FI_MR_VIRT_ADDR`, so peers address registrations by offset (shm offers either)",
    },
    Param {
        name: "WEFT_TEST_NARROW_IMM",
        default: "unset",
        accepted: "`1`, `0`",
        meaning: "the plugin behaves as if writes carried 4 bytes of immediate data (EFA, verbs), so rdma sends every size in a `Wrote` control message",
    },
    Param {
        name: "WEFT_TEST_STRIPE_ONE_RAIL",
        default: "unset",
        accepted: "`1`, `0`",
        meaning: "comms on a virtual device of one rail speak the striping protocol (headers, parts) as comms on several rails do; without it they are the rail's own comms, so the striping protocol can be tested on a machine with one device",
    },
    Param {
        name: "WEFT_TEST_ANNOUNCE_WRITES",
        default: "unset",
        accepted: "`1`, `0`",
        meaning: "the plugin behaves as if its provider lost a write's remote CQ data (verbs;ofi_rxm with FI_OFI_RXM_USE_SRX=1), so rdma writes carry none and each is announced by a `Wrote` control message (where the provider orders a send after a write: tcp;ofi_rxm here)",
    },
    Param {
        name: "WEFT_TEST_MR_MODE",
        default: "unset",
        accepted: "comma-separated `local`, `prov_key`, `allocated`, `endpoint`",
        meaning: "the plugin honours and checks these MR modes as if the provider required them (neither here does): every posted buffer carries its descriptor, keys are arbitrary 64-bit values read back with `fi_mr_key`, unmapped memory is never registered, registrations are bound to the device's passive endpoint and enabled before use",
    },
    Param {
        name: "WEFT_TEST_HMEM",
        default: "unset",
        accepted: "`system`",
        meaning: "device memory (what the CUDA driver says is device memory) is registered as host memory, and discovery does not ask the provider for FI_HMEM: with the fake driver of `tests/c/fake_cuda.c`, whose device memory is host memory, this runs Weft's whole CUDA path on a libfabric without CUDA",
    },
];

/// The MR modes Weft honours as if the provider required them
/// (`WEFT_TEST_MR_MODE`; see `fabric::domain`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StrictMr {
    /// `FI_MR_LOCAL`.
    pub local: bool,
    /// `FI_MR_PROV_KEY`.
    pub prov_key: bool,
    /// `FI_MR_ALLOCATED`.
    pub allocated: bool,
    /// `FI_MR_ENDPOINT`.
    pub endpoint: bool,
}

/// The values of [`TEST_SWITCHES`]; all off unless a test sets them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TestSwitches {
    /// `WEFT_TEST_MR_OFFSET=1`.
    pub mr_offset: bool,
    /// `WEFT_TEST_NARROW_IMM=1`.
    pub narrow_imm: bool,
    /// `WEFT_TEST_STRIPE_ONE_RAIL=1`.
    pub stripe_one_rail: bool,
    /// `WEFT_TEST_ANNOUNCE_WRITES=1`.
    pub announce_writes: bool,
    /// `WEFT_TEST_MR_MODE`.
    pub strict_mr: StrictMr,
    /// `WEFT_TEST_HMEM=system`.
    pub hmem_as_system: bool,
}

impl TestSwitches {
    fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let flag = |name: &'static str| match get(name).as_deref().map(str::trim) {
            None | Some("0") => Ok(false),
            Some("1") => Ok(true),
            Some(v) => Err(err(name, v, "not a switch value")),
        };
        let mut t = Self {
            mr_offset: flag("WEFT_TEST_MR_OFFSET")?,
            narrow_imm: flag("WEFT_TEST_NARROW_IMM")?,
            stripe_one_rail: flag("WEFT_TEST_STRIPE_ONE_RAIL")?,
            announce_writes: flag("WEFT_TEST_ANNOUNCE_WRITES")?,
            ..Self::default()
        };
        if let Some(v) = get("WEFT_TEST_MR_MODE") {
            for m in list("WEFT_TEST_MR_MODE", &v)? {
                match m.as_str() {
                    "local" => t.strict_mr.local = true,
                    "prov_key" => t.strict_mr.prov_key = true,
                    "allocated" => t.strict_mr.allocated = true,
                    "endpoint" => t.strict_mr.endpoint = true,
                    other => {
                        return Err(err(
                            "WEFT_TEST_MR_MODE",
                            &v,
                            format!("unknown MR mode {other:?}"),
                        ))
                    }
                }
            }
        }
        if let Some(v) = get("WEFT_TEST_HMEM") {
            if v.trim() != "system" {
                return Err(err("WEFT_TEST_HMEM", &v, "unknown memory kind"));
            }
            t.hmem_as_system = true;
        }
        Ok(t)
    }

    /// Whether any switch is on.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
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
        .chain(TEST_SWITCHES)
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

/// `WEFT_IFACE`, in the forms NCCL users know from `NCCL_SOCKET_IFNAME`: a
/// comma-separated list of name prefixes; `=` first makes them exact names;
/// `^` first (before any `=`) excludes them instead. Empty keeps everything.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IfaceFilter {
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl IfaceFilter {
    /// Parses `WEFT_IFACE`'s value.
    pub fn parse(value: &str) -> Result<Self, ConfigError> {
        let v = value.trim();
        let (exclude, v) = v.strip_prefix('^').map_or((false, v), |r| (true, r));
        let (exact, v) = v.strip_prefix('=').map_or((false, v), |r| (true, r));
        let names = list("WEFT_IFACE", v).map_err(|e| ConfigError {
            value: value.to_owned(),
            ..e
        })?;
        Ok(Self {
            exclude,
            exact,
            names,
        })
    }

    /// Keeps everything.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Whether device `name` is kept.
    pub fn keeps(&self, name: &str) -> bool {
        if self.names.is_empty() {
            return true;
        }
        let listed = self.names.iter().any(|n| {
            if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            }
        });
        listed != self.exclude
    }
}

impl std::fmt::Display for IfaceFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.exclude {
            f.write_str("^")?;
        }
        if self.exact {
            f.write_str("=")?;
        }
        f.write_str(&self.names.join(","))
    }
}

/// libfabric's name of the provider under a layered one (`tcp;ofi_rxm` -> `tcp`).
fn core_provider(p: &str) -> &str {
    p.split(';').next().unwrap_or(p)
}

/// What `FI_PROVIDER` lets libfabric offer: a list, or `^` and a list of
/// providers to exclude.
#[derive(Debug)]
struct FiProvider {
    exclude: bool,
    names: Vec<String>,
}

impl FiProvider {
    fn parse(value: &str) -> Self {
        let (exclude, rest) = match value.trim().strip_prefix('^') {
            Some(r) => (true, r),
            None => (false, value),
        };
        Self {
            exclude,
            names: rest
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
        }
    }
    /// Whether libfabric offers `provider` (Weft's spelling) under this filter.
    fn allows(&self, provider: &str) -> bool {
        let core = core_provider(provider);
        let named = self
            .names
            .iter()
            .any(|n| n == provider || core_provider(&canonical_provider(n)) == core);
        named != self.exclude
    }
}

impl Config {
    /// Reads and validates the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads and validates parameters through `get` (tests pass a map). A
    /// variable that is empty or blank counts as unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let mut c = Self::default();
        let mut set = |name: &'static str, source: Source| {
            if let Some(i) = PARAMS.iter().position(|p| p.name == name) {
                c.sources[i] = source;
            }
        };
        c.test = TestSwitches::from_lookup(get)?;
        let fi = get("FI_PROVIDER").map(|v| (FiProvider::parse(&v), v));
        if let Some(v) = get("WEFT_PROVIDER") {
            let providers: Vec<String> = list("WEFT_PROVIDER", &v)?
                .iter()
                .map(|p| canonical_provider(p))
                .collect();
            if let Some((f, fv)) = &fi {
                let hidden: Vec<&str> = providers
                    .iter()
                    .filter(|p| !f.allows(p))
                    .map(String::as_str)
                    .collect();
                if !hidden.is_empty() {
                    return Err(err(
                        "WEFT_PROVIDER",
                        &v,
                        format!(
                            "FI_PROVIDER={fv:?} hides {} from libfabric, so Weft could not use it; \
                             set only one of WEFT_PROVIDER and FI_PROVIDER, or make them agree",
                            hidden.join(", ")
                        ),
                    ));
                }
            }
            set("WEFT_PROVIDER", Source::Env("WEFT_PROVIDER"));
            c.providers = providers;
        } else if let Some((f, fv)) = &fi {
            c.providers = if f.exclude {
                c.providers.into_iter().filter(|p| f.allows(p)).collect()
            } else {
                f.names.iter().map(|p| canonical_provider(p)).collect()
            };
            if c.providers.is_empty() {
                return Err(err(
                    "WEFT_PROVIDER",
                    fv,
                    "unset, and FI_PROVIDER excludes every provider Weft tries by default; \
                     set WEFT_PROVIDER or FI_PROVIDER to the provider to use",
                ));
            }
            set("WEFT_PROVIDER", Source::Env("FI_PROVIDER"));
        }
        if let Some(v) = get("WEFT_IFACE") {
            c.ifaces = IfaceFilter::parse(&v)?;
            set("WEFT_IFACE", Source::Env("WEFT_IFACE"));
        }
        if let Some(v) = get("WEFT_PROTOCOL") {
            set("WEFT_PROTOCOL", Source::Env("WEFT_PROTOCOL"));
            c.protocol = match v.trim() {
                "auto" => Protocol::Auto,
                "sendrecv" => Protocol::SendRecv,
                "rdma" => Protocol::Rdma,
                _ => return Err(err("WEFT_PROTOCOL", &v, "unknown protocol")),
            };
        }
        if let Some(v) = get("WEFT_EAGER_SIZE") {
            c.eager_size = int("WEFT_EAGER_SIZE", &v, 0usize, 65536)?;
            set("WEFT_EAGER_SIZE", Source::Env("WEFT_EAGER_SIZE"));
        }
        if let Some(v) = get("WEFT_LINK_SPEED_MBPS") {
            c.link_speed_mbps = Some(int("WEFT_LINK_SPEED_MBPS", &v, 1u32, 10_000_000)?);
            set("WEFT_LINK_SPEED_MBPS", Source::Env("WEFT_LINK_SPEED_MBPS"));
        }
        if let Some(v) = get("WEFT_PEER_TIMEOUT") {
            c.peer_timeout = seconds("WEFT_PEER_TIMEOUT", &v, 0.1, 3600.0)?;
            set("WEFT_PEER_TIMEOUT", Source::Env("WEFT_PEER_TIMEOUT"));
        }
        if let Some(v) = get("WEFT_STRIPE_SIZE") {
            c.stripe_size = int("WEFT_STRIPE_SIZE", &v, 4096usize, 1 << 30)?;
            set("WEFT_STRIPE_SIZE", Source::Env("WEFT_STRIPE_SIZE"));
        }
        if let Some(v) = get("WEFT_COLLNET_REDUCERS") {
            c.collnet_reducers = list("WEFT_COLLNET_REDUCERS", &v)?
                .into_iter()
                .map(|item| {
                    if item.len() == 2 * crate::nccl::HANDLE_SIZE
                        && item.bytes().all(|b| b.is_ascii_hexdigit())
                    {
                        ReducerRef::Handle(crate::nccl::handle_from_hex(&item).expect("hex"))
                    } else {
                        ReducerRef::File(item.into())
                    }
                })
                .collect();
            set(
                "WEFT_COLLNET_REDUCERS",
                Source::Env("WEFT_COLLNET_REDUCERS"),
            );
        }
        if let Some(v) = get("WEFT_RMA") {
            set("WEFT_RMA", Source::Env("WEFT_RMA"));
            c.rma = match v.trim() {
                "auto" => true,
                "off" => false,
                _ => return Err(err("WEFT_RMA", &v, "neither auto nor off")),
            };
        }
        Ok(c)
    }

    /// Every parameter's effective value, in [`PARAMS`] order, with where
    /// it came from.
    pub fn effective(&self) -> Vec<(&'static str, String, Source)> {
        let values = [
            self.providers.join(", "),
            if self.ifaces.is_empty() {
                "(all)".to_owned()
            } else {
                self.ifaces.to_string()
            },
            match self.protocol {
                Protocol::Auto => "auto".to_owned(),
                Protocol::SendRecv => "sendrecv".to_owned(),
                Protocol::Rdma => "rdma".to_owned(),
            },
            format!("{} bytes", self.eager_size),
            self.link_speed_mbps
                .map_or_else(|| "(sysfs, else 10000)".to_owned(), |s| s.to_string()),
            format!("{:.3} s", self.peer_timeout.as_secs_f64()),
            format!("{} bytes", self.stripe_size),
            if self.collnet_reducers.is_empty() {
                "(none)".to_owned()
            } else {
                self.collnet_reducers
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            if self.rma { "auto" } else { "off" }.to_owned(),
        ];
        PARAMS
            .iter()
            .zip(values)
            .zip(&self.sources)
            .map(|((p, v), s)| (p.name, v, *s))
            .collect()
    }

    /// Logs every parameter at INFO (NCCL_INIT), with where it came from.
    pub fn log(&self) {
        for (name, value, source) in self.effective() {
            tracing::info!(target: "weft::init", "{name} = {value} ({source})");
        }
        if self.test.any() {
            tracing::warn!(target: "weft::init", "test-only switches are on: {:?}", self.test);
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            providers: DEFAULT_PROVIDERS.iter().map(|s| (*s).to_owned()).collect(),
            ifaces: IfaceFilter::default(),
            protocol: Protocol::Auto,
            eager_size: 8192,
            link_speed_mbps: None,
            peer_timeout: Duration::from_secs(30),
            stripe_size: 128 << 10,
            collnet_reducers: Vec::new(),
            rma: true,
            sources: vec![Source::Default; PARAMS.len()],
            test: TestSwitches::default(),
        }
    }
}

/// The configuration for a plugin that starts now: read from the
/// environment and logged. The core calls it at the first `init` (and again
/// at the first `init` after the last `finalize`), so what it read holds for
/// as long as the plugin runs.
pub fn load() -> Result<Config, ConfigError> {
    let c = Config::from_env();
    match &c {
        Ok(c) => c.log(),
        Err(e) => tracing::warn!(target: "weft::init", "configuration refused: {e}"),
    }
    c
}

/// Renders a parameter table in the README's Markdown form.
#[cfg(any(test, feature = "testing"))]
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
        assert!(c.ifaces.keeps("lo") && !c.ifaces.keeps("eth0"));
        assert_eq!(c.eager_size, 0);
        assert_eq!(c.link_speed_mbps, Some(100_000));
        assert_eq!(c.peer_timeout, Duration::from_millis(2500));
    }

    #[test]
    fn reducers_are_handles_or_files() {
        let hex = "0a".repeat(crate::nccl::HANDLE_SIZE);
        let c = with(&[(
            "WEFT_COLLNET_REDUCERS",
            &format!("/run/r0.handle, {hex},{}", &hex[2..]),
        )])
        .unwrap();
        assert_eq!(
            c.collnet_reducers,
            [
                ReducerRef::File("/run/r0.handle".into()),
                ReducerRef::Handle([0x0a; crate::nccl::HANDLE_SIZE]),
                // One digit short: not a handle, so a file name (reading it fails at connect).
                ReducerRef::File(hex[2..].into()),
            ]
        );
        assert!(with(&[]).unwrap().collnet_reducers.is_empty());
    }

    /// Every parameter is read and validated: a bad value fails naming the
    /// variable, the value and what is accepted.
    #[test]
    fn every_param_rejects_a_bad_value_by_name() {
        let bad = |name: &str| match name {
            "WEFT_PROVIDER" | "WEFT_IFACE" | "WEFT_COLLNET_REDUCERS" => "a,,b",
            "WEFT_PROTOCOL" => "udp",
            "WEFT_RMA" => "on",
            "WEFT_PEER_TIMEOUT" => "0",
            _ => "-3",
        };
        for p in PARAMS.iter().chain(TEST_SWITCHES) {
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

    /// The test switches are typed and read with the rest: a list of MR
    /// modes becomes the modes, a switch is `1` or `0`, and unset is off.
    #[test]
    fn test_switches_are_read_with_the_configuration() {
        assert!(!with(&[]).unwrap().test.any(), "off unless set");
        let c = with(&[
            ("WEFT_TEST_MR_MODE", "local, endpoint"),
            ("WEFT_TEST_NARROW_IMM", "1"),
            ("WEFT_TEST_MR_OFFSET", "0"),
            ("WEFT_TEST_HMEM", "system"),
            ("WEFT_TEST_STRIPE_ONE_RAIL", "1"),
            ("WEFT_TEST_ANNOUNCE_WRITES", "1"),
        ])
        .unwrap();
        let want = TestSwitches {
            mr_offset: false,
            narrow_imm: true,
            stripe_one_rail: true,
            announce_writes: true,
            strict_mr: StrictMr {
                local: true,
                endpoint: true,
                ..StrictMr::default()
            },
            hmem_as_system: true,
        };
        assert_eq!(c.test, want);
        let e = with(&[("WEFT_TEST_MR_MODE", "local,virt")]).unwrap_err();
        assert!(e.to_string().contains("\"virt\""), "{e}");
    }

    /// NCCL's and libfabric's conventions: an empty variable is unset, and
    /// FI_PROVIDER chooses when WEFT_PROVIDER does not.
    #[test]
    fn empty_means_unset_and_fi_provider_is_honoured() {
        for p in PARAMS {
            assert_eq!(
                with(&[(p.name, "")]).unwrap(),
                Config::default(),
                "{}",
                p.name
            );
            assert_eq!(
                with(&[(p.name, "  ")]).unwrap(),
                Config::default(),
                "{}",
                p.name
            );
        }
        let c = with(&[("FI_PROVIDER", "shm")]).unwrap();
        assert_eq!(c.providers, ["shm"]);
        assert_eq!(c.sources[0], Source::Env("FI_PROVIDER"));
        assert_eq!(
            with(&[("FI_PROVIDER", "tcp")]).unwrap().providers,
            ["tcp;ofi_rxm"]
        );
        assert_eq!(
            with(&[("FI_PROVIDER", "^efa,verbs")]).unwrap().providers,
            ["tcp;ofi_rxm"]
        );
        assert_eq!(with(&[("FI_PROVIDER", "")]).unwrap(), Config::default());
        // Both, agreeing: fine; WEFT_PROVIDER is the source.
        let c = with(&[("FI_PROVIDER", "tcp,shm"), ("WEFT_PROVIDER", "shm")]).unwrap();
        assert_eq!(
            (c.providers.as_slice(), c.sources[0]),
            (&["shm".to_owned()][..], Source::Env("WEFT_PROVIDER"))
        );
        assert!(with(&[("FI_PROVIDER", "^shm"), ("WEFT_PROVIDER", "tcp")]).is_ok());
        // Disagreeing: an error naming both.
        for (fi, weft) in [("shm", "tcp"), ("^tcp", "tcp;ofi_rxm"), ("tcp", "shm,tcp")] {
            let e = with(&[("FI_PROVIDER", fi), ("WEFT_PROVIDER", weft)]).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("WEFT_PROVIDER") && msg.contains("FI_PROVIDER"),
                "{msg}"
            );
        }
        assert!(with(&[("FI_PROVIDER", "^efa,verbs,tcp")]).is_err());
    }

    /// NCCL_SOCKET_IFNAME's forms.
    #[test]
    fn iface_filter_speaks_nccl_socket_ifname() {
        let keeps = |v: &str, name: &str| IfaceFilter::parse(v).unwrap().keeps(name);
        assert!(keeps("eth", "eth0") && keeps("eth", "eth10") && !keeps("eth", "lo"));
        assert!(keeps("=eth0", "eth0") && !keeps("=eth0", "eth01"));
        assert!(!keeps("^docker", "docker0") && keeps("^docker", "eth0"));
        assert!(!keeps("^=lo", "lo") && keeps("^=lo", "lo1"));
        assert!(keeps("ib,eth", "ib0") && keeps("ib,eth", "eth3") && !keeps("ib,eth", "lo"));
        assert!(!keeps("^docker,lo", "lo") && !keeps("^docker,lo", "docker1"));
        assert!(keeps(" =lo ", "lo"));
        assert!(IfaceFilter::default().keeps("anything"));
        assert_eq!(
            IfaceFilter::parse("^=eth0,eth1").unwrap().to_string(),
            "^=eth0,eth1"
        );
        for bad in ["^", "=", "^=", "eth,,lo"] {
            let e = IfaceFilter::parse(bad).unwrap_err();
            assert_eq!((e.name, e.value.as_str()), ("WEFT_IFACE", bad));
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
        assert_eq!(
            with(&[("WEFT_PROTOCOL", "auto")]).unwrap().protocol,
            Protocol::Auto
        );
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
