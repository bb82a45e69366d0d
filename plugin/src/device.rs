//! Device discovery: one device per libfabric domain of the chosen provider.
//!
//! Providers are tried in the configured order (default: efa, verbs;ofi_rxm,
//! tcp;ofi_rxm); the first that offers a reliable tagged endpoint on at least
//! one kept domain wins. `WEFT_IFACE` keeps only the named domains (not applied
//! to shm, whose one domain is the host).

#![forbid(unsafe_code)]

use crate::config::{Config, TestSwitches};
use crate::fabric::{FiError, Hints, InfoList, OwnedInfo};

/// One NIC as NCCL sees it.
#[derive(Debug)]
pub struct Device {
    /// Index NCCL uses (`dev`).
    pub index: usize,
    /// libfabric provider, e.g. `tcp;ofi_rxm`.
    pub provider: String,
    /// Domain name (interface or NIC).
    pub domain: String,
    /// Fabric name.
    pub fabric: String,
    /// Largest message one send carries.
    pub max_msg_size: usize,
    /// Largest message `fi_tinject` accepts.
    pub inject_size: usize,
    /// Endpoints the domain supports (each comm uses one).
    pub max_endpoints: usize,
    /// What the provider offers this domain for an RDMA-write protocol.
    pub rma: Rma,
    /// The `fi_info` to open it with.
    pub info: OwnedInfo,
    /// The `fi_info` to open it with for RMA (when offered).
    pub rma_info: Option<OwnedInfo>,
    /// Whether both infos ask for `FI_HMEM` (asked only where a CUDA
    /// driver is usable), or why not.
    pub hmem: Result<(), String>,
    /// The test switches of the configuration it was found with.
    pub test: TestSwitches,
}

impl Device {
    /// The `fi_info` to open the domain with: with `FI_RMA` for a protocol
    /// that writes (`rma`), else for tagged messages only.
    pub fn info_for(&self, rma: bool) -> crate::fabric::InfoRef<'_> {
        match (&self.rma_info, rma) {
            (Some(i), true) => i.as_ref(),
            _ => self.info.as_ref(),
        }
    }

    /// How its domain behaves beyond what the provider asks (the test
    /// switches of its configuration).
    pub fn domain_options(&self) -> crate::fabric::DomainOptions {
        let m = self.test.strict_mr;
        let bit = |on: bool, b: u32| if on { b } else { 0 };
        crate::fabric::DomainOptions {
            strict: bit(m.local, libfabric_sys::FI_MR_LOCAL)
                | bit(m.prov_key, libfabric_sys::FI_MR_PROV_KEY)
                | bit(m.allocated, libfabric_sys::FI_MR_ALLOCATED)
                | bit(m.endpoint, libfabric_sys::FI_MR_ENDPOINT),
            hmem_as_system: self.test.hmem_as_system,
        }
    }
}

/// What a domain offers an RDMA-write protocol (asked of libfabric with
/// `FI_RMA` added to the hints).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rma {
    /// The provider offers `FI_RMA` on this domain.
    pub offered: bool,
    /// Bytes of remote CQ data a write carries (0 if none).
    pub cq_data_size: usize,
    /// Why the remote CQ data the provider advertises does not reach the
    /// target here, where Weft knows it ([`lost_cq_data`]; or the test
    /// switch `WEFT_TEST_ANNOUNCE_WRITES`): then the rdma protocol announces
    /// every write to this device with a message instead.
    pub cq_data_lost: Option<&'static str>,
    /// The provider delivers a send after the writes posted before it on the
    /// same endpoint to the same peer (`FI_ORDER_SAW`), so a message can
    /// announce a write: when it arrives, the data is there.
    pub send_after_write: bool,
}

impl Rma {
    /// Whether an RDMA-write protocol could run here: `FI_RMA` with at
    /// least 4 bytes of remote CQ data (what EFA and verbs give) that
    /// really arrive, or, where they are lost, sends ordered after writes
    /// (each write is then announced by a message).
    pub fn qualifies(&self) -> bool {
        self.offered
            && self.cq_data_size >= 4
            && (self.cq_data_lost.is_none() || self.send_after_write)
    }

    /// Whether writes to this device are announced: they carry no remote
    /// CQ data (it would be lost), and the target learns of each from a
    /// message the provider delivers after it.
    pub fn writes_announced(&self) -> bool {
        self.cq_data_lost.is_some()
    }
}

/// Where `provider` advertises remote CQ data that a target never sees,
/// why; `use_srx` is `FI_OFI_RXM_USE_SRX` as the environment has it.
///
/// rxm over verbs with a shared receive context: libfabric's verbs provider
/// (2.1, and its main branch in 2025) reports every completion of a shared
/// receive queue as `IBV_WC_RECV`, so a write with immediate data that
/// consumed one of rxm's receive buffers reaches rxm as a message, whose
/// stale buffer rxm then delivers (measured on rxe: a 0-byte message in a
/// posted receive, the immediate gone). rxm uses a shared receive context
/// over verbs only when `FI_OFI_RXM_USE_SRX` is true (over tcp by default,
/// where writes are not receives).
pub fn lost_cq_data(provider: &str, use_srx: Option<&str>) -> Option<&'static str> {
    let core = provider.split(';').next().unwrap_or("");
    let rxm = provider.split(';').any(|p| p == "ofi_rxm");
    // libfabric's boolean parameters: 1/true/yes/on, any case.
    let on = use_srx.is_some_and(|v| {
        ["1", "true", "yes", "on"]
            .iter()
            .any(|t| v.trim().eq_ignore_ascii_case(t))
    });
    (core == "verbs" && rxm && on).then_some(
        "FI_OFI_RXM_USE_SRX=1 puts rxm's verbs receives in a shared receive queue, whose completions libfabric's verbs provider reports as messages: a write's remote CQ data never reaches the target",
    )
}

/// Tagged hints for `provider`, with `FI_HMEM` when asked.
fn hints(provider: &str, hmem: bool) -> Hints {
    let mut h = Hints::rdm_tagged(Some(provider));
    if hmem {
        h.caps |= libfabric_sys::FI_HMEM;
    }
    h
}

/// Asks libfabric what `provider` offers each domain with `FI_RMA`.
fn rma_of(provider: &str, hmem: bool, test: &TestSwitches) -> Vec<(String, Rma, OwnedInfo)> {
    let mut h = hints(provider, hmem);
    if test.mr_offset {
        // Test switch: ask for offset addressing (shm offers either).
        h.mr_mode &= !libfabric_sys::FI_MR_VIRT_ADDR;
    }
    // Reads too: the RMA tables' gets are `fi_read`.
    h.caps |= u64::from(libfabric_sys::FI_RMA)
        | u64::from(libfabric_sys::FI_WRITE)
        | u64::from(libfabric_sys::FI_REMOTE_WRITE)
        | u64::from(libfabric_sys::FI_READ)
        | u64::from(libfabric_sys::FI_REMOTE_READ);
    let Ok(list) = InfoList::get(&h) else {
        return Vec::new();
    };
    list.iter()
        .filter(|i| i.provider() == provider)
        .filter_map(|i| {
            Some((
                i.domain_name().to_owned(),
                Rma {
                    offered: true,
                    cq_data_size: i.cq_data_size(),
                    cq_data_lost: lost_cq_data(
                        provider,
                        std::env::var("FI_OFI_RXM_USE_SRX").ok().as_deref(),
                    )
                    .or(test.announce_writes.then_some(
                        "WEFT_TEST_ANNOUNCE_WRITES=1 (a test switch) treats remote CQ data as lost",
                    )),
                    send_after_write: i.tx_msg_order() & u64::from(libfabric_sys::FI_ORDER_SAW) != 0,
                },
                i.to_owned().ok()?,
            ))
        })
        .collect()
}

/// Why no device could be found.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// `fi_getinfo` itself failed.
    #[error(transparent)]
    Fabric(#[from] FiError),
    /// No provider had a usable device.
    #[error("no libfabric device found: tried providers [{tried}]{ifaces}; check WEFT_PROVIDER and WEFT_IFACE, and `fi_info -l` for what this host offers")]
    NoDevice {
        /// Providers tried, in order.
        tried: String,
        /// The interface filter, if any.
        ifaces: String,
    },
}

/// Whether `WEFT_IFACE` applies to a provider's domains.
fn filters_by_iface(provider: &str) -> bool {
    provider != "shm"
}

/// What discovery made of one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Its devices (domain names) are the ones Weft uses.
    Used(Vec<String>),
    /// Tried and passed over, and why.
    Skipped(String),
    /// Not tried: an earlier provider had devices.
    NotTried,
}

/// One provider of the configured order and what became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderReport {
    /// The provider, as Weft spells it.
    pub provider: String,
    /// What discovery made of it.
    pub outcome: Outcome,
}

/// Tries the providers in configured order and reports on each; the
/// devices are those of the first provider that has any (none is an error).
pub fn survey(config: &Config) -> Result<(Vec<ProviderReport>, Vec<Device>), DiscoveryError> {
    crate::fabric::provider_defaults();
    let mut reports = Vec::new();
    let mut chosen: Vec<Device> = Vec::new();
    for provider in &config.providers {
        if !chosen.is_empty() {
            reports.push(ProviderReport {
                provider: provider.clone(),
                outcome: Outcome::NotTried,
            });
            continue;
        }
        // Where a CUDA driver is usable, ask for FI_HMEM first: a domain
        // must be opened with it for device memory to register.
        let offers = |l: &InfoList| l.iter().any(|i| i.provider() == provider);
        let (list, hmem) = match crate::gpu::driver() {
            Ok(_) if config.test.hmem_as_system => {
                (InfoList::get(&hints(provider, false))?, Ok(()))
            }
            Ok(_) => match InfoList::get(&hints(provider, true)) {
                Ok(l) if offers(&l) => (l, Ok(())),
                _ => (
                    InfoList::get(&hints(provider, false))?,
                    Err(format!(
                        "provider {provider} does not offer FI_HMEM (a libfabric built without CUDA support offers it nowhere)"
                    )),
                ),
            },
            Err(e) => (InfoList::get(&hints(provider, false))?, Err(e.to_string())),
        };
        // The RMA infos ask for what the tagged ones got (not under the
        // test switch, which takes the domains as they are).
        let rmas = rma_of(
            provider,
            hmem.is_ok() && !config.test.hmem_as_system,
            &config.test,
        );
        let mut devices: Vec<Device> = Vec::new();
        let mut filtered = Vec::new();
        for info in list.iter() {
            // libfabric may answer with a layered provider we did not ask for
            // (e.g. `tcp` alone, or `shm` under `ofi_rxm`): keep exact matches.
            if info.provider() != provider {
                continue;
            }
            let domain = info.domain_name();
            if filters_by_iface(provider) && !config.ifaces.keeps(domain) {
                if !filtered.iter().any(|d| d == domain) {
                    filtered.push(domain.to_owned());
                }
                continue;
            }
            // One device per domain; libfabric lists a domain once per address
            // family and its IPv4 entry comes first.
            if devices.iter().any(|d| d.domain == domain) {
                continue;
            }
            let rma = rmas.iter().find(|(d, ..)| d == domain);
            devices.push(Device {
                index: devices.len(),
                provider: provider.clone(),
                domain: domain.to_owned(),
                fabric: info.fabric_name().to_owned(),
                max_msg_size: info.max_msg_size(),
                inject_size: info.inject_size(),
                max_endpoints: info.max_endpoints(),
                rma: rma.map(|(_, r, _)| *r).unwrap_or_default(),
                info: info.to_owned()?,
                rma_info: rma.and_then(|(.., i)| i.as_ref().to_owned().ok()),
                hmem: hmem.clone(),
                test: config.test,
            });
        }
        let outcome = if !devices.is_empty() {
            Outcome::Used(devices.iter().map(|d| d.domain.clone()).collect())
        } else if !filtered.is_empty() {
            Outcome::Skipped(format!(
                "its domains ({}) are not kept by WEFT_IFACE={}",
                filtered.join(", "),
                config.ifaces
            ))
        } else {
            Outcome::Skipped(
                "libfabric offers no reliable tagged endpoint of it on this host (see `fi_info -l`)"
                    .to_owned(),
            )
        };
        match &outcome {
            Outcome::Used(d) => tracing::info!(
                target: "weft::init",
                "provider {provider}: {} device(s): {}",
                d.len(),
                d.join(", ")
            ),
            Outcome::Skipped(why) => {
                tracing::info!(target: "weft::init", "provider {provider}: skipped: {why}")
            }
            Outcome::NotTried => {}
        }
        reports.push(ProviderReport {
            provider: provider.clone(),
            outcome,
        });
        chosen = devices;
    }
    if !chosen.is_empty() {
        return Ok((reports, chosen));
    }
    Err(DiscoveryError::NoDevice {
        tried: config.providers.join(", "),
        ifaces: if config.ifaces.is_empty() {
            String::new()
        } else {
            format!(" with WEFT_IFACE={}", config.ifaces)
        },
    })
}

/// Lists the devices of the first provider (in configured order) that has one.
pub fn discover(config: &Config) -> Result<Vec<Device>, DiscoveryError> {
    survey(config).map(|(_, devices)| devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_cq_data_is_lost_only_on_verbs_rxm_with_a_shared_receive_context() {
        for v in ["1", "true", "YES", " on "] {
            assert!(
                lost_cq_data("verbs;ofi_rxm", Some(v)).is_some(),
                "FI_OFI_RXM_USE_SRX={v:?}"
            );
        }
        for v in [None, Some("0"), Some("false"), Some("off"), Some("")] {
            assert_eq!(lost_cq_data("verbs;ofi_rxm", v), None, "FI_OFI_RXM_USE_SRX={v:?}");
        }
        // tcp under rxm uses a shared receive context by default and reports
        // writes as writes; other providers have no rxm receive queue.
        for p in ["tcp;ofi_rxm", "shm", "efa", "verbs", "tcp"] {
            assert_eq!(lost_cq_data(p, Some("1")), None, "{p}");
        }
        // Lost CQ data: rdma runs only where a message can announce a write.
        let rma = Rma {
            offered: true,
            cq_data_size: 4,
            cq_data_lost: lost_cq_data("verbs;ofi_rxm", Some("1")),
            send_after_write: false,
        };
        assert!(!rma.qualifies());
        assert!(Rma { cq_data_lost: None, ..rma }.qualifies());
        assert!(Rma { send_after_write: true, ..rma }.qualifies());
    }
}
