//! NCCL's device numbering: physical devices, virtual devices (`makeVDevice`), their properties and counters.

#![forbid(unsafe_code)]

use super::*;

/// `devices()`: the physical devices, then the virtual ones.
pub fn devices() -> Result<usize> {
    let p = plugin()?;
    let v = p.vdevs.lock().unwrap_or_else(|e| e.into_inner()).len();
    Ok(p.devices.len() + v)
}

pub(super) fn device(plugin: &Plugin, dev: i32) -> Result<Dev> {
    let vdevs = plugin.vdevs.lock().unwrap_or_else(|e| e.into_inner());
    let nphys = plugin.devices.len();
    let d = usize::try_from(dev).ok();
    if let Some(p) = d.and_then(|d| plugin.devices.get(d)) {
        return Ok(Dev {
            index: p.index,
            rails: vec![Arc::clone(p)],
            virtual_: false,
            striped: false,
        });
    }
    if let Some(v) = d.and_then(|d| vdevs.get(d.wrapping_sub(nphys))) {
        return Ok(Dev {
            index: d.unwrap_or_default(),
            rails: v.rails.clone(),
            virtual_: true,
            striped: v.striped,
        });
    }
    Err(Error::bad_handle(format!(
        "device {dev} does not exist: Weft has {nphys} device(s) and {} virtual one(s)",
        vdevs.len()
    )))
}

/// Physical device `dev` (test hooks and counters are per physical device).
#[cfg(feature = "testing")]
pub(super) fn physical(plugin: &Plugin, dev: i32) -> Result<Arc<DeviceState>> {
    let d = device(plugin, dev)?;
    if d.virtual_ {
        return Err(Error::internal(format!(
            "device {dev} is a virtual device; this needs a physical one"
        )));
    }
    Ok(Arc::clone(&d.rails[0]))
}

/// `makeVDevice(d, props)`: fuses the physical devices `devs` (1 ..= `max`,
/// distinct) into a virtual device; returns its index, which comes after
/// every physical device and every earlier virtual one.
pub fn make_vdevice(devs: &[i32], max: usize) -> Result<i32> {
    let p = plugin()?;
    let nphys = p.devices.len();
    if devs.is_empty() || devs.len() > max.min(wire::MAX_RAILS) {
        return Err(Error::internal(format!(
            "makeVDevice: {} devices (1 ..= {})",
            devs.len(),
            max.min(wire::MAX_RAILS)
        )));
    }
    let mut rails: Vec<Arc<DeviceState>> = Vec::with_capacity(devs.len());
    for &d in devs {
        let dev = usize::try_from(d)
            .ok()
            .and_then(|i| p.devices.get(i))
            .ok_or_else(|| {
                Error::internal(format!(
                    "makeVDevice: device {d} is not a physical device (0 ..= {})",
                    nphys.saturating_sub(1)
                ))
            })?;
        if rails.iter().any(|r| r.index == dev.index) {
            return Err(Error::internal(format!(
                "makeVDevice: device {d} is listed twice"
            )));
        }
        rails.push(Arc::clone(dev));
    }
    let members: Vec<&Properties> = rails.iter().map(|r| &p.props[r.index]).collect();
    let striped = stripes(&p.config, rails.len());
    let props = props::fused(&members, devs, striped);
    let mut vdevs = p.vdevs.lock().unwrap_or_else(|e| e.into_inner());
    let index = nphys + vdevs.len();
    tracing::info!(
        target: "weft::init",
        "virtual device {index} ({}): rails {devs:?}, {} Mbps; messages of {} bytes and more are striped over the rails (WEFT_STRIPE_SIZE)",
        props.name.to_string_lossy(),
        props.speed,
        p.config.stripe_size
    );
    vdevs.push(VDev {
        rails,
        props,
        striped,
    });
    i32::try_from(index).map_err(|_| Error::internal("makeVDevice: too many devices"))
}

/// Whether comms on a virtual device of `rails` rails speak the striping
/// protocol: over several rails, not over one (its comms are then the
/// rail's own, header-free: one message per message and grouped receives,
/// as on the physical device), unless the test switch
/// `WEFT_TEST_STRIPE_ONE_RAIL` asks for it. Both ends decide alike: their
/// devices have the same rail count (checked at connect).
fn stripes(config: &crate::config::Config, rails: usize) -> bool {
    rails > 1 || config.test.stripe_one_rail
}

/// `getProperties(dev)`.
pub fn properties(dev: i32) -> Result<Properties> {
    with_properties(dev, |p| Ok(p.clone()))
}

/// Counters of a device, for tests and benchmarks.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStats {
    /// Registration-cache hits.
    pub mr_hits: u64,
    /// Registration-cache misses (real registrations).
    pub mr_misses: u64,
    /// Ranges currently registered.
    pub mr_entries: usize,
    /// The eager threshold in effect (0 where the device takes GPU memory).
    pub eager_size: usize,
}

/// Counters of device `dev`.
#[cfg(feature = "testing")]
pub fn device_stats(dev: i32) -> Result<DeviceStats> {
    let d = physical(&*plugin()?, dev)?;
    let (mr_hits, mr_misses) = d.mr.stats();
    Ok(DeviceStats {
        mr_hits,
        mr_misses,
        mr_entries: d.mr.len(),
        eager_size: d.eager_size,
    })
}

/// Runs `f` on device `dev`'s properties (which live as long as the plugin,
/// so pointers into them stay valid for NCCL).
pub fn with_properties<T>(dev: i32, f: impl FnOnce(&Properties) -> Result<T>) -> Result<T> {
    let p = plugin()?;
    let d = device(&p, dev)?;
    if d.virtual_ {
        let vdevs = p.vdevs.lock().unwrap_or_else(|e| e.into_inner());
        f(&vdevs[d.index - p.devices.len()].props)
    } else {
        f(&p.props[d.index])
    }
}

/// The physical devices (RMA devices are physical: NCCL builds no virtual
/// ones for RMA).
pub fn physical_devices() -> Result<usize> {
    Ok(plugin()?.devices.len())
}

/// Runs `f` on what the RMA tables report for physical device `dev`
/// ([`props::for_rma`]; it lives as long as the plugin, as the net
/// properties do).
pub fn with_rma_properties<T>(dev: i32, f: impl FnOnce(&Properties) -> Result<T>) -> Result<T> {
    let p = plugin()?;
    let props = usize::try_from(dev)
        .ok()
        .and_then(|d| p.rma_props.get(d))
        .ok_or_else(|| {
            Error::bad_handle(format!(
                "RMA getProperties: device {dev} does not exist: Weft has {} physical device(s)",
                p.rma_props.len()
            ))
        })?;
    f(props)
}

/// Whether physical device `dev` can hold the memory NCCL's RMA path
/// registers (its signals, flush buffer and windows are CUDA memory): `Err`
/// says why not.
pub fn rma_memory(dev: usize) -> Result<std::result::Result<(), String>> {
    let p = plugin()?;
    let d = p.devices.get(dev).ok_or_else(|| {
        Error::bad_handle(format!("device {dev} is not a physical device"))
    })?;
    Ok(if !p.config.rma {
        Err("WEFT_RMA=off".to_owned())
    } else if !d.cuda {
        Err("no GPU memory registration (NCCL_PTR_CUDA not claimed; the device's INFO line says why)".to_owned())
    } else if d.domain.info().caps() & u64::from(libfabric_sys::FI_RMA) == 0 {
        Err("the device was opened without FI_RMA (the sendrecv protocol)".to_owned())
    } else if !d.dev.rma.qualifies() {
        // The rdma protocol's own rule: a target learns of a put from its
        // CQ data, or from a signal the provider orders after it.
        Err(format!(
            "puts need a write's remote CQ data at the target, or a message ordered after a write (FI_ORDER_SAW): {}",
            d.dev.rma.cq_data_lost.unwrap_or("the provider offers neither")
        ))
    } else {
        Ok(())
    })
}

/// Physical device `dev` as an RMA device: its state, if it can hold NCCL's
/// RMA memory ([`rma_memory`]), else an error saying why not.
pub fn rma_device(dev: i32) -> Result<Arc<DeviceState>> {
    let p = plugin()?;
    let d = usize::try_from(dev)
        .ok()
        .and_then(|d| p.devices.get(d))
        .ok_or_else(|| {
            Error::bad_handle(format!(
                "RMA device {dev} does not exist: Weft has {} physical device(s)",
                p.devices.len()
            ))
        })?;
    match rma_memory(d.index)? {
        Ok(()) => Ok(Arc::clone(d)),
        Err(why) => Err(Error::usage(format!(
            "device {dev} is no RMA device: {why}"
        ))),
    }
}
