//! Device properties: the superset of every `ncclNetProperties_vN_t` field.

#![forbid(unsafe_code)]

use std::ffi::CString;
use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::device::Device;

/// `NCCL_PTR_HOST`.
pub const PTR_HOST: i32 = 0x1;
/// `NCCL_PTR_CUDA`.
pub const PTR_CUDA: i32 = 0x2;
/// `NCCL_PTR_DMABUF`.
pub const PTR_DMABUF: i32 = 0x4;
pub use crate::proto::MAX_RECVS;
/// NCCL's own fallback speed when a NIC reports none (Mbit/s).
pub const DEFAULT_SPEED_MBPS: i32 = 10_000;
/// `NCCL_MAX_NET_SIZE_BYTES`: NCCL refuses `maxP2pBytes` above 1 TiB.
pub const MAX_NET_SIZE_BYTES: usize = 1 << 40;

/// Everything any API version reports for a device.
#[derive(Debug, Clone, PartialEq)]
pub struct Properties {
    /// Unique per device (NCCL keys its topology on it).
    pub name: CString,
    /// The NIC's PCI path in sysfs, when it has one.
    pub pci_path: Option<CString>,
    /// Same value = same NIC chip.
    pub guid: u64,
    /// `NCCL_PTR_*` bits.
    pub ptr_support: i32,
    /// 1: an mhandle is valid on every comm of the device.
    pub reg_is_global: i32,
    /// 1 would force `iflush` on every GPU receive.
    pub force_flush: i32,
    /// Mbit/s.
    pub speed: i32,
    /// Port number.
    pub port: i32,
    /// Microseconds.
    pub latency: f32,
    /// Comms (endpoints) the device can hold.
    pub max_comms: i32,
    /// Largest grouped-receive `n`.
    pub max_recvs: i32,
    /// `ncclNetDeviceType` (0 = host).
    pub net_device_type: i32,
    /// Device-offload version (0 = none).
    pub net_device_version: i32,
    /// Physical children: `{1, [dev]}` for a physical device.
    pub vdevs: Vec<i32>,
    /// Largest p2p message.
    pub max_p2p_bytes: usize,
    /// Largest CollNet operation.
    pub max_coll_bytes: usize,
    /// Largest multi-request (adapters use 1).
    pub max_multi_request_size: i32,
    /// Rail id (-1: undefined).
    pub rail_id: i16,
    /// Plane id (-1: undefined).
    pub plane_id: i16,
}

/// FNV-1a 64 over a device's identity: the same NIC gives the same guid.
fn guid(provider: &str, domain: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in provider.bytes().chain([0]).chain(domain.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The sysfs directory of the device behind a libfabric domain, if any.
fn sysfs_device(provider: &str, domain: &str) -> Option<PathBuf> {
    let dev = if provider.starts_with("tcp") || provider.starts_with("sockets") {
        Path::new("/sys/class/net").join(domain).join("device")
    } else if provider.starts_with("verbs") || provider.starts_with("efa") {
        // verbs domains are the RDMA device name; efa appends -rdm/-dgrm.
        let name = domain.trim_end_matches("-rdm").trim_end_matches("-dgrm");
        Path::new("/sys/class/infiniband").join(name).join("device")
    } else {
        return None;
    };
    let mut p = std::fs::canonicalize(dev).ok()?;
    // Walk up from a virtual child (virtio0, ...) to the PCI function.
    while !p
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(is_pci_address)
    {
        if !p.pop() || p == Path::new("/sys/devices") {
            return None;
        }
    }
    Some(p)
}

/// `dddd:bb:dd.f`.
fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// The link speed in Mbit/s from sysfs (`None` where unknown: lo, virtio).
fn sysfs_speed(provider: &str, domain: &str) -> Option<i32> {
    if !(provider.starts_with("tcp") || provider.starts_with("sockets")) {
        return None;
    }
    let s = std::fs::read_to_string(Path::new("/sys/class/net").join(domain).join("speed")).ok()?;
    s.trim().parse::<i32>().ok().filter(|&v| v > 0)
}

/// The value of each field of NCCL's `ncclNetProperties_vN_t`, one function
/// per field under NCCL's name for it. The generated `getProperties` of every
/// API version fills field `f` with `fields::f(p)` and a field `g` of a
/// nested struct `s` with `fields::s::g(p)`, so serving a field a new NCCL
/// version adds is one function here (rustc names a missing one: "cannot
/// find function `f` in module `props`", at the field in the descriptor).
#[allow(non_snake_case)]
pub mod fields {
    use std::ffi::{c_char, c_int};

    use super::Properties;

    /// `name`.
    pub fn name(p: &Properties) -> *mut c_char {
        p.name.as_ptr().cast_mut()
    }
    /// `pciPath` (NULL when the device has none).
    pub fn pciPath(p: &Properties) -> *mut c_char {
        p.pci_path
            .as_ref()
            .map_or(std::ptr::null_mut(), |c| c.as_ptr().cast_mut())
    }
    /// `guid`.
    pub fn guid(p: &Properties) -> u64 {
        p.guid
    }
    /// `ptrSupport`.
    pub fn ptrSupport(p: &Properties) -> c_int {
        p.ptr_support
    }
    /// `regIsGlobal`.
    pub fn regIsGlobal(p: &Properties) -> c_int {
        p.reg_is_global
    }
    /// `forceFlush`.
    pub fn forceFlush(p: &Properties) -> c_int {
        p.force_flush
    }
    /// `speed`.
    pub fn speed(p: &Properties) -> c_int {
        p.speed
    }
    /// `port`.
    pub fn port(p: &Properties) -> c_int {
        p.port
    }
    /// `latency`.
    pub fn latency(p: &Properties) -> f32 {
        p.latency
    }
    /// `maxComms`.
    pub fn maxComms(p: &Properties) -> c_int {
        p.max_comms
    }
    /// `maxRecvs`.
    pub fn maxRecvs(p: &Properties) -> c_int {
        p.max_recvs
    }
    /// `netDeviceType`.
    pub fn netDeviceType(p: &Properties) -> c_int {
        p.net_device_type
    }
    /// `netDeviceVersion`.
    pub fn netDeviceVersion(p: &Properties) -> c_int {
        p.net_device_version
    }
    /// `maxP2pBytes`.
    pub fn maxP2pBytes(p: &Properties) -> usize {
        p.max_p2p_bytes
    }
    /// `maxCollBytes`.
    pub fn maxCollBytes(p: &Properties) -> usize {
        p.max_coll_bytes
    }
    /// `maxMultiRequestSize`.
    pub fn maxMultiRequestSize(p: &Properties) -> c_int {
        p.max_multi_request_size
    }
    /// `railId`.
    pub fn railId(p: &Properties) -> i16 {
        p.rail_id
    }
    /// `planeId`.
    pub fn planeId(p: &Properties) -> i16 {
        p.plane_id
    }

    /// `vProps` (v9+): the physical devices a device is made of.
    pub mod vProps {
        use super::*;

        /// `vProps.devs`, as many as the version's array holds.
        pub fn devs<const N: usize>(p: &Properties) -> [c_int; N] {
            let mut d = [0; N];
            for (slot, v) in d.iter_mut().zip(&p.vdevs) {
                *slot = *v;
            }
            d
        }
        /// `vProps.ndevs`. A device has at most as many children as the
        /// `devs` array of the API version that made it holds (a physical
        /// device 1; `makeVDevice` refuses more than its version's array
        /// holds), so this never exceeds what `devs` filled.
        pub fn ndevs(p: &Properties) -> c_int {
            c_int::try_from(p.vdevs.len()).unwrap_or(c_int::MAX)
        }
    }
}

/// Computes the properties of device `index`.
pub fn properties(index: usize, dev: &Device, config: &Config) -> Properties {
    let speed = match config.link_speed_mbps {
        Some(s) => i32::try_from(s).unwrap_or(i32::MAX),
        None => sysfs_speed(&dev.provider, &dev.domain).unwrap_or_else(|| {
            tracing::info!(
                target: "weft::init",
                "device {index} ({}): link speed unknown to sysfs, reporting {DEFAULT_SPEED_MBPS} Mbps (set WEFT_LINK_SPEED_MBPS to override)",
                dev.domain
            );
            DEFAULT_SPEED_MBPS
        }),
    };
    let pci = sysfs_device(&dev.provider, &dev.domain)
        .and_then(|p| CString::new(p.to_string_lossy().into_owned()).ok());
    let max_bytes = dev.max_msg_size.clamp(1, MAX_NET_SIZE_BYTES);
    Properties {
        name: CString::new(dev.domain.replace('\0', "")).unwrap_or_default(),
        pci_path: pci,
        guid: guid(&dev.provider, &dev.domain),
        ptr_support: PTR_HOST,
        reg_is_global: 1,
        force_flush: 0,
        speed,
        port: 1,
        latency: 0.0,
        max_comms: i32::try_from(dev.max_endpoints).unwrap_or(i32::MAX).max(1),
        max_recvs: MAX_RECVS as i32,
        net_device_type: 0,
        net_device_version: 0,
        vdevs: vec![i32::try_from(index).unwrap_or(i32::MAX)],
        max_p2p_bytes: max_bytes,
        max_coll_bytes: max_bytes,
        max_multi_request_size: 1,
        rail_id: -1,
        plane_id: -1,
    }
}

/// `NCCL_NET_DEVICE_GIN_PROXY`: the device type an RMA plugin reports (the
/// v13 loader refuses any other; NCCL's GIN proxy runs over it).
pub const NET_DEVICE_GIN_PROXY: i32 = 2;

/// What the RMA tables report for a physical device with net properties
/// `net`: the same NIC (name, guid, PCI path: NCCL matches RMA devices to
/// net devices by them, and builds no virtual ones), as a GIN-proxy device
/// with one request per `test` (an RMA request is one operation).
pub fn for_rma(net: &Properties) -> Properties {
    Properties {
        net_device_type: NET_DEVICE_GIN_PROXY,
        max_recvs: 1,
        ..net.clone()
    }
}

/// The properties of a virtual device fused from `members` (the physical
/// devices `devs`, in NCCL's order), as NCCL expects them: its own name
/// (the members' joined with `+`, as NCCL's IB transport names fused NICs)
/// and guid, the sum of the speeds, the members in `vProps`, what every
/// member supports, and no grouped receives where messages are striped
/// (`striped`, see `proto::stripe`; else, on one rail, the rail's own).
pub fn fused(members: &[&Properties], devs: &[i32], striped: bool) -> Properties {
    let first = members[0];
    let names: Vec<String> = members
        .iter()
        .map(|m| m.name.to_string_lossy().into_owned())
        .collect();
    let mut g: u64 = 0xcbf2_9ce4_8422_2325;
    for b in members.iter().flat_map(|m| m.guid.to_le_bytes()) {
        g ^= u64::from(b);
        g = g.wrapping_mul(0x0100_0000_01b3);
    }
    Properties {
        name: CString::new(names.join("+")).unwrap_or_default(),
        pci_path: first.pci_path.clone(),
        guid: g,
        ptr_support: members.iter().fold(!0, |a, m| a & m.ptr_support),
        reg_is_global: 1,
        force_flush: members.iter().map(|m| m.force_flush).max().unwrap_or(0),
        speed: members.iter().fold(0i32, |a, m| a.saturating_add(m.speed)),
        port: first.port,
        latency: members.iter().map(|m| m.latency).fold(0.0, f32::max),
        max_comms: members.iter().map(|m| m.max_comms).min().unwrap_or(1),
        max_recvs: if striped { 1 } else { first.max_recvs },
        net_device_type: first.net_device_type,
        net_device_version: first.net_device_version,
        vdevs: devs.to_vec(),
        max_p2p_bytes: members.iter().map(|m| m.max_p2p_bytes).min().unwrap_or(1),
        max_coll_bytes: members.iter().map(|m| m.max_coll_bytes).min().unwrap_or(1),
        max_multi_request_size: 1,
        rail_id: -1,
        plane_id: -1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fused_device_sums_speeds_and_lists_its_members() {
        let member = |i: i32, name: &str, speed: i32| Properties {
            name: CString::new(name).unwrap(),
            pci_path: None,
            guid: guid("tcp", name),
            ptr_support: PTR_HOST,
            reg_is_global: 1,
            force_flush: 0,
            speed,
            port: 1,
            latency: 0.0,
            max_comms: 100,
            max_recvs: MAX_RECVS as i32,
            net_device_type: 0,
            net_device_version: 0,
            vdevs: vec![i],
            max_p2p_bytes: 1 << 30,
            max_coll_bytes: 1 << 30,
            max_multi_request_size: 1,
            rail_id: -1,
            plane_id: -1,
        };
        let a = member(0, "r0", 25_000);
        let mut b = member(1, "r1", 100_000);
        b.ptr_support = PTR_HOST | PTR_CUDA;
        b.max_comms = 7;
        let v = fused(&[&a, &b], &[0, 1], true);
        assert_eq!(v.name.to_str().unwrap(), "r0+r1");
        assert_eq!(v.speed, 125_000);
        assert_eq!(v.vdevs, [0, 1]);
        assert_eq!(v.ptr_support, PTR_HOST, "only what every rail takes");
        assert_eq!(v.max_comms, 7);
        assert_eq!(v.max_recvs, 1);
        assert_ne!(v.guid, a.guid);
        assert_ne!(v.guid, b.guid);
        assert_ne!(v.guid, fused(&[&b, &a], &[1, 0], true).guid);
        let one = fused(&[&a], &[0], false);
        assert_eq!(one.max_recvs, a.max_recvs, "one rail: its own comms");
    }

    #[test]
    fn pci_addresses() {
        assert!(is_pci_address("0000:00:03.0"));
        assert!(is_pci_address("0000:af:00.1"));
        assert!(!is_pci_address("virtio0"));
        assert!(!is_pci_address("pci0000:00"));
    }

    #[test]
    fn guid_is_stable_and_distinct() {
        assert_eq!(guid("tcp;ofi_rxm", "lo"), guid("tcp;ofi_rxm", "lo"));
        assert_ne!(guid("tcp;ofi_rxm", "lo"), guid("tcp;ofi_rxm", "eth0"));
        assert_ne!(guid("a", "bc"), guid("ab", "c"));
    }

    #[test]
    fn loopback_has_no_pci_path_or_speed() {
        assert_eq!(sysfs_device("tcp;ofi_rxm", "lo"), None);
        assert_eq!(sysfs_speed("tcp;ofi_rxm", "lo"), None);
        assert_eq!(sysfs_device("shm", "shm"), None);
    }
}
