//! The version-free core every adapter calls.
//!
//! It speaks the newest semantics (per-communicator contexts, `size_t` sizes,
//! grouped receives, profiler handles, traffic classes); older API versions are
//! projections of it done by the adapters. What NCCL gets for contexts, comms,
//! memory handles and requests are tokens recorded in [`handles`] registries,
//! never reused, and validated on the way back in. No registry lock is held
//! while libfabric runs. No version number appears here.

pub mod handles;
#[cfg(feature = "testing")]
pub(crate) mod hooks;
pub mod keeper;
pub mod profiler;
pub mod props;

use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

pub use crate::error::{Code, Error, Kind, Result};
pub use crate::proto::{DeviceState, Done};
pub use props::Properties;

use crate::config::{self, Config};
use crate::device;
use crate::fabric::{Domain, Mr};
use crate::gpu::MemKind;
use crate::log::NcclDebugLogger;
use crate::mr::{DomainRegistrar, MrCache, Region};
use crate::proto::wire::{self, HANDLE_SIZE};
use crate::proto::{self, heartbeat_period, Protocol, RecvBuf, ReqId};
use handles::{Registry, ReqKind};
use profiler::{Events, Profiler};

/// The process-wide state behind every context.
#[derive(Debug)]
pub struct Plugin {
    /// The validated configuration.
    pub config: Config,
    /// Devices, by NCCL index.
    pub devices: Vec<Arc<DeviceState>>,
    /// What `getProperties` reports for each device.
    pub props: Vec<Properties>,
    /// The protocol every comm uses.
    pub protocol: Arc<dyn Protocol>,
    /// Virtual devices `makeVDevice` made; NCCL numbers them after the
    /// physical ones.
    pub vdevs: Mutex<Vec<VDev>>,
}

/// A virtual device: rails that NCCL fused into one NIC.
#[derive(Debug, Clone)]
pub struct VDev {
    /// Its rails, in NCCL's order.
    pub rails: Vec<Arc<DeviceState>>,
    /// What `getProperties` reports for it.
    pub props: Properties,
}

/// A device as NCCL numbers it: a physical one (one rail) or a virtual one.
#[derive(Debug, Clone)]
struct Dev {
    index: usize,
    rails: Vec<Arc<DeviceState>>,
    virtual_: bool,
}

/// A context: per communicator (v11+) or the one process context (older).
#[derive(Debug)]
pub struct Ctx {
    /// `commId` (0 for the process context).
    pub comm_id: u64,
    /// The communicator's traffic class (-1: undefined).
    pub traffic_class: i32,
    /// NCCL's profiler callback (v10+), for net events.
    pub profiler: Option<Profiler>,
    plugin: Arc<Plugin>,
}

/// A memory handle: one reference to a cached registration on each rail
/// of the device (one, except on a virtual device), and the range NCCL
/// registered, which every buffer passed with the handle must lie in.
#[derive(Debug)]
pub struct MrHandle {
    dev: usize,
    addr: usize,
    len: usize,
    regions: Vec<(Arc<DeviceState>, Arc<Region<Mr>>)>,
    /// The registrations as the comms take them, in rail order.
    mems: Vec<proto::Mem>,
}

impl MrHandle {
    fn kind(&self) -> MemKind {
        self.regions[0].1.kind()
    }
}

/// A listen comm, its device's index, and the profiler of the context it
/// was opened in (its receive comms report to it).
#[derive(Debug)]
struct Listener {
    comm: Arc<dyn proto::Listener>,
    dev: usize,
    profiler: Option<Profiler>,
}

/// A connected comm handed to NCCL: the protocol's comm and its requests'
/// profiler events. Its request tokens name it by its own token's serial.
#[derive(Debug)]
struct Connected<C: ?Sized> {
    comm: Arc<C>,
    /// NCCL's index of its device.
    dev: usize,
    events: Events,
}

type Sender = Connected<dyn proto::Sender>;
type Receiver = Connected<dyn proto::Receiver>;

impl<C: proto::Comm + ?Sized> Connected<C> {
    fn new(comm: Arc<C>, dev: usize, profiler: Option<Profiler>) -> Self {
        Self {
            events: Events::new(profiler, dev, &comm.peer_name()),
            dev,
            comm,
        }
    }

    /// Tests request `id`, stopping its profiler events once it is done or
    /// failed.
    fn test(&self, id: ReqId) -> Result<Option<Done>> {
        let r = self.comm.test(id);
        if self.events.enabled() {
            match &r {
                Ok(Some(d)) => self.events.stop(id.slot, Some(&d.sizes[..d.n])),
                Err(_) => self.events.stop(id.slot, None),
                Ok(None) => {}
            }
        }
        r
    }
}

#[derive(Default)]
struct Registries {
    ctx: Registry<Ctx>,
    listen: Registry<Listener>,
    /// Send comms whose connect is in progress (not yet handed to NCCL).
    connecting: Registry<dyn proto::Sender>,
    send: Registry<Sender>,
    recv: Registry<Receiver>,
    mr: Registry<MrHandle>,
}

/// The plugin while at least one context is live.
#[derive(Debug)]
struct Running {
    plugin: Arc<Plugin>,
    keeper: keeper::Keeper,
}

static REG: LazyLock<Registries> = LazyLock::new(Registries::default);
static RUNNING: Mutex<Option<Running>> = Mutex::new(None);
static PROCESS_CTX: Mutex<usize> = Mutex::new(0);

fn running() -> std::sync::MutexGuard<'static, Option<Running>> {
    RUNNING.lock().unwrap_or_else(|e| e.into_inner())
}

fn plugin() -> Result<Arc<Plugin>> {
    running()
        .as_ref()
        .map(|r| Arc::clone(&r.plugin))
        .ok_or_else(|| Error::internal("called before init (or after the last finalize)"))
}

/// One heartbeat tick over every connected comm (the keeper's work). It
/// holds one comm at a time, so a close waits for at most one tick of one
/// comm ([`last_ref`]).
fn keep_alive(now: Instant, pulse: &keeper::Pulse) {
    for serial in REG.send.serials() {
        if let Some(s) = REG.send.get_at(serial) {
            s.comm.keepalive(now);
        }
        pulse.beat();
    }
    for serial in REG.recv.serials() {
        if let Some(r) = REG.recv.get_at(serial) {
            r.comm.keepalive(now);
        }
        pulse.beat();
    }
    for l in REG.listen.values() {
        l.comm.tend(now);
        pulse.beat();
    }
    // Transfers of comms already closed, and graves, move only when their
    // hub's CQs are read.
    crate::proto::hub::tend_all();
    pulse.beat();
}

/// Opens the devices and starts the keeper, with `config` (else the
/// environment's).
fn start(config: Option<Config>) -> Result<Running> {
    let config = match config {
        Some(c) => {
            c.log();
            c
        }
        None => config::load()?,
    };
    let found = device::discover(&config)?;
    let (protocol, why) = proto::choose(config.protocol, &found).map_err(Error::internal)?;
    let rma = protocol.wire_id() == wire::PROTO_RDMA;
    tracing::info!(target: "weft::init", "protocol: {} ({why})", protocol.name());
    let mut devices = Vec::with_capacity(found.len());
    let mut all_props = Vec::with_capacity(found.len());
    for (index, dev) in found.into_iter().enumerate() {
        let mut p = props::properties(index, &dev, &config);
        let domain = Domain::open_with(dev.info_for(rma), dev.domain_options()).map_err(|e| {
            Error::from(e).context(format!("opening device {index} ({})", dev.domain))
        })?;
        let cuda = match gpu_claim(&dev, &domain) {
            Ok(gpu) => {
                tracing::info!(
                    target: "weft::init",
                    "device {index} ({}): GPU memory supported (NCCL_PTR_CUDA): {} CUDA device(s), FI_HMEM, \
                     device memory of GPU {gpu} registered; every message is written straight from and to \
                     its buffer (no eager copy: WEFT_EAGER_SIZE is ignored on this device)",
                    dev.domain,
                    crate::gpu::driver().map_or(0, |d| d.devices()),
                );
                p.ptr_support |= props::PTR_CUDA;
                domain.set_gpu_memory();
                Some(gpu)
            }
            Err(why) => {
                tracing::info!(
                    target: "weft::init",
                    "device {index} ({}): host memory only (ptrSupport = NCCL_PTR_HOST): {why}",
                    dev.domain
                );
                None
            }
        };
        let dmabuf = match cuda.map(|gpu| dmabuf_claim(&domain, gpu)) {
            None => false,
            Some(Ok(())) => {
                tracing::info!(
                    target: "weft::init",
                    "device {index} ({}): DMA-BUF registration supported (NCCL_PTR_DMABUF): a DMA-BUF of \
                     device memory registered with FI_MR_DMABUF",
                    dev.domain
                );
                p.ptr_support |= props::PTR_DMABUF;
                true
            }
            Some(Err(why)) => {
                tracing::info!(
                    target: "weft::init",
                    "device {index} ({}): no DMA-BUF registration (NCCL_PTR_DMABUF not claimed; NCCL \
                     registers GPU memory by address): {why}",
                    dev.domain
                );
                false
            }
        };
        let cuda = cuda.is_some();
        all_props.push(p);
        devices.push(Arc::new(DeviceState {
            index,
            mr: MrCache::new(DomainRegistrar(Arc::clone(&domain))),
            domain,
            cuda,
            dmabuf,
            // No CPU touches GPU data: on a device that takes GPU memory no
            // message is copied eagerly (nor injected).
            eager_size: if cuda { 0 } else { config.eager_size },
            peer_timeout: config.peer_timeout,
            sinks_tagged: rma,
            hub: std::sync::Mutex::new(None),
            dev,
        }));
    }
    let keeper = keeper::Keeper::start(heartbeat_period(config.peer_timeout), keep_alive)?;
    Ok(Running {
        plugin: Arc::new(Plugin {
            config,
            devices,
            props: all_props,
            protocol,
            vdevs: Mutex::new(Vec::new()),
        }),
        keeper,
    })
}

/// The last context is gone: joins the keeper, closes whatever NCCL left
/// open, and drops the devices (endpoints, registrations, domains, fabrics),
/// so the library can be unloaded and loaded again.
fn teardown(r: Running) {
    drop(r.keeper);
    let left = REG.listen.clear() + REG.send.clear() + REG.recv.clear() + REG.mr.clear();
    REG.connecting.clear();
    if left > 0 {
        tracing::warn!(
            "finalize: {left} comm(s) or memory handle(s) were still open at the last finalize; closed them"
        );
    }
    drop(r.plugin);
    tracing::info!(
        target: "weft::init",
        "last context finalized: keeper thread joined, endpoints, registrations and domains closed"
    );
}

/// Whether device `dev` can take GPU memory: a usable driver, a domain
/// opened with `FI_HMEM`, and a registration of real device memory that
/// succeeded on it (NCCL cannot be told "no" after `getProperties`, so
/// nothing is claimed that was not tried). `Ok(gpu)`: the GPU probed;
/// `Err`: what was missing, for the INFO line.
fn gpu_claim(
    dev: &crate::device::Device,
    domain: &Arc<Domain>,
) -> std::result::Result<i32, String> {
    use crate::fabric::{Mr, ACCESS_ALL};
    let drv = crate::gpu::driver().map_err(|e| e.to_string())?;
    dev.hmem.clone()?;
    let gpu = 0;
    with_probe(drv, gpu, |mem| {
        // SAFETY: `mem` is PROBE bytes of device memory, freed only after
        // the registration is dropped (at the end of this closure).
        unsafe {
            Mr::register_kind(
                domain,
                mem.as_ptr(),
                PROBE,
                ACCESS_ALL,
                crate::gpu::MemKind::Cuda(gpu),
            )
        }
        .map(|_| gpu)
        .map_err(|e| {
            format!(
                "registering device memory with FI_HMEM_CUDA failed ({e}): is this libfabric built with CUDA support?"
            )
        })
    })
}

/// Bytes of device memory a claim registers to see that it works.
const PROBE: usize = 64 << 10;

/// Runs `probe` on `PROBE` bytes of GPU `gpu`'s memory, freed after it.
fn with_probe<T>(
    drv: &crate::gpu::Driver,
    gpu: i32,
    probe: impl FnOnce(std::ptr::NonNull<u8>) -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    let mem = drv
        .alloc(gpu, PROBE)
        .map_err(|e| format!("no device memory to probe with: {e}"))?;
    let r = probe(mem);
    // SAFETY: `probe` has returned and dropped what it registered; nothing
    // else holds `mem`.
    unsafe { drv.free(gpu, mem) };
    r
}

/// Whether `domain` takes GPU `gpu`'s memory through DMA-BUF: the headers
/// Weft was built with and the running libfabric know `FI_MR_DMABUF`
/// (1.20+), the driver exports DMA-BUFs of that GPU, and a registration of
/// one succeeds. Otherwise, why not.
fn dmabuf_claim(domain: &Arc<Domain>, gpu: i32) -> std::result::Result<(), String> {
    use crate::fabric::{Mr, ACCESS_ALL};
    use std::os::fd::AsRawFd;
    let v = libfabric_sys::version_text;
    if !libfabric_sys::HAS_MR_DMABUF {
        return Err(format!(
            "Weft was built with the headers of libfabric {}, which has no FI_MR_DMABUF (1.20+); \
             rebuild Weft against a newer libfabric to use it",
            v(libfabric_sys::HEADERS_FI_VERSION)
        ));
    }
    let running = libfabric_sys::running_version();
    if running < libfabric_sys::DMABUF_FI_VERSION {
        return Err(format!(
            "the running libfabric {} is older than 1.20 (FI_MR_DMABUF)",
            v(running)
        ));
    }
    if domain.info().mr_mode() & libfabric_sys::FI_MR_VIRT_ADDR == 0 {
        // libfabric's own registration map (tcp, udp, sockets: providers
        // without NIC registration) takes a DMA-BUF registration's base from
        // the wrong arm of fi_mr_attr's union when registrations are
        // addressed by offset (2.1: util_mr_map.c, ofi_mr_map_insert), so a
        // peer's write misses it. NICs that register for real (verbs, EFA)
        // address by virtual address.
        return Err(format!(
            "{} addresses registrations by offset (no FI_MR_VIRT_ADDR), where libfabric's registration map \
             mislocates DMA-BUF registrations",
            domain.info().provider()
        ));
    }
    let drv = crate::gpu::driver().map_err(|e| e.to_string())?;
    drv.dmabuf_supported(gpu)?;
    with_probe(drv, gpu, |mem| {
        let fd = drv.dmabuf_fd(mem, PROBE)?;
        // SAFETY: `mem` is PROBE bytes of device memory, freed only after
        // the registration is dropped; `fd` is open for the call.
        unsafe {
            Mr::register_dmabuf(
                domain,
                mem.as_ptr(),
                PROBE,
                ACCESS_ALL,
                gpu,
                fd.as_raw_fd(),
                0,
            )
        }
        .map(drop)
        .map_err(|e| format!("registering a DMA-BUF of GPU {gpu}'s memory failed ({e})"))
    })
}

/// What `init` receives, in the newest API's terms.
#[derive(Debug, Clone, Copy, Default)]
pub struct InitArgs {
    /// NCCL's logger.
    pub logger: Option<NcclDebugLogger>,
    /// NCCL's profiler callback (v10+), as an address.
    pub profiler: Option<usize>,
    /// The communicator id (v11+).
    pub comm_id: u64,
    /// The communicator's traffic class (v11+), -1 if undefined.
    pub traffic_class: i32,
}

/// `init` (v11+): a new context. The first one reads the configuration from
/// the environment, opens the devices and starts the keeper.
pub fn init(args: InitArgs) -> Result<*mut c_void> {
    init_with(args, None)
}

/// [`init`] with the configuration given instead of read from the
/// environment (when this `init` is the one that starts the plugin; a
/// running plugin keeps the configuration it started with).
pub fn init_with(args: InitArgs, config: Option<Config>) -> Result<*mut c_void> {
    crate::log::set_logger(args.logger);
    // Held until the context is recorded, so a concurrent last finalize
    // cannot tear down what this context uses.
    let mut g = running();
    let r = match &mut *g {
        Some(r) => r,
        None => g.insert(start(config)?),
    };
    Ok(REG.ctx.insert(Arc::new(Ctx {
        comm_id: args.comm_id,
        traffic_class: args.traffic_class,
        // SAFETY: NCCL passes its ncclProfilerCallback (or nothing).
        profiler: unsafe { Profiler::from_addr(args.profiler.unwrap_or(0)) },
        plugin: Arc::clone(&r.plugin),
    })))
}

/// `init` of API versions without contexts: sets up the process context once.
pub fn init_process(logger: Option<NcclDebugLogger>, profiler: Option<usize>) -> Result<()> {
    let mut g = PROCESS_CTX.lock().unwrap_or_else(|e| e.into_inner());
    if *g != 0 {
        crate::log::set_logger(logger);
        return Ok(());
    }
    *g = init(InitArgs {
        logger,
        profiler,
        comm_id: 0,
        traffic_class: -1,
    })? as usize;
    Ok(())
}

/// The process context (`init_process` must have run).
pub fn process_ctx() -> Result<*mut c_void> {
    match *PROCESS_CTX.lock().unwrap_or_else(|e| e.into_inner()) {
        0 => Err(Error::internal("called before init")),
        p => Ok(p as *mut c_void),
    }
}

/// `finalize(ctx)`. The last one tears everything down (see [`teardown`]).
pub fn finalize(ctx: *mut c_void) -> Result<()> {
    let mut g = running();
    REG.ctx.remove(ctx).ok_or_else(|| {
        Error::bad_handle(format!("finalize: {ctx:p} is not a live Weft context"))
    })?;
    if REG.ctx.is_empty() {
        if let Some(r) = g.take() {
            teardown(r);
        }
    }
    Ok(())
}

fn ctx(p: *mut c_void) -> Result<Arc<Ctx>> {
    REG.ctx.get(p).ok_or_else(|| {
        Error::bad_handle(format!(
            "{p:p} is not a live Weft context (finalized, or not from this plugin)"
        ))
    })
}

/// `devices()`: the physical devices, then the virtual ones.
pub fn devices() -> Result<usize> {
    let p = plugin()?;
    let v = p.vdevs.lock().unwrap_or_else(|e| e.into_inner()).len();
    Ok(p.devices.len() + v)
}

fn device(plugin: &Plugin, dev: i32) -> Result<Dev> {
    let vdevs = plugin.vdevs.lock().unwrap_or_else(|e| e.into_inner());
    let nphys = plugin.devices.len();
    let d = usize::try_from(dev).ok();
    if let Some(p) = d.and_then(|d| plugin.devices.get(d)) {
        return Ok(Dev {
            index: p.index,
            rails: vec![Arc::clone(p)],
            virtual_: false,
        });
    }
    if let Some(v) = d.and_then(|d| vdevs.get(d.wrapping_sub(nphys))) {
        return Ok(Dev {
            index: d.unwrap_or_default(),
            rails: v.rails.clone(),
            virtual_: true,
        });
    }
    Err(Error::bad_handle(format!(
        "device {dev} does not exist: Weft has {nphys} device(s) and {} virtual one(s)",
        vdevs.len()
    )))
}

/// Physical device `dev` (test hooks and counters are per physical device).
fn physical(plugin: &Plugin, dev: i32) -> Result<Arc<DeviceState>> {
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
    let props = props::fused(&members, devs);
    let mut vdevs = p.vdevs.lock().unwrap_or_else(|e| e.into_inner());
    let index = nphys + vdevs.len();
    tracing::info!(
        target: "weft::init",
        "virtual device {index} ({}): rails {devs:?}, {} Mbps; messages of {} bytes and more are striped over the rails (WEFT_STRIPE_SIZE)",
        props.name.to_string_lossy(),
        props.speed,
        p.config.stripe_size
    );
    vdevs.push(VDev { rails, props });
    i32::try_from(index).map_err(|_| Error::internal("makeVDevice: too many devices"))
}

/// `WEFT_PEER_TIMEOUT` of the running plugin.
pub fn peer_timeout() -> Result<std::time::Duration> {
    Ok(plugin()?.config.peer_timeout)
}

/// `WEFT_COLLNET_REDUCERS` of the running plugin.
pub fn collnet_reducers() -> Result<Vec<crate::config::ReducerRef>> {
    Ok(plugin()?.config.collnet_reducers.clone())
}

/// `getProperties(dev)`.
pub fn properties(dev: i32) -> Result<Properties> {
    with_properties(dev, |p| Ok(p.clone()))
}

/// `listen(ctx, dev, handle)`: never blocks. On a virtual device, one
/// listener per rail and a handle that lists them all.
pub fn listen(ctx_p: *mut c_void, dev: i32, handle: &mut [u8; HANDLE_SIZE]) -> Result<*mut c_void> {
    let c = ctx(ctx_p)?;
    let d = device(&c.plugin, dev)?;
    let nonce = proto::handshake::nonce();
    let comm = if d.virtual_ {
        let mut rails = Vec::with_capacity(d.rails.len());
        let mut handles = Vec::with_capacity(d.rails.len());
        for (i, r) in d.rails.iter().enumerate() {
            let (l, h) = c
                .plugin
                .protocol
                .listen(Arc::clone(r), nonce.wrapping_add(i as u64))?;
            rails.push(l);
            handles.push(h);
        }
        wire::encode_rails(&handles, handle).map_err(|e| Error::system(e.to_string()))?;
        Arc::new(proto::stripe::StripedListen::new(
            rails,
            c.plugin.config.stripe_size,
        ))
    } else {
        let (l, h) = c.plugin.protocol.listen(Arc::clone(&d.rails[0]), nonce)?;
        h.encode(handle).map_err(|e| Error::system(e.to_string()))?;
        l
    };
    Ok(REG.listen.insert(Arc::new(Listener {
        comm,
        dev: d.index,
        profiler: c.profiler,
    })))
}

/// `connect(ctx, dev, handle)`: one non-blocking step; `Some` once connected.
/// `traffic_class` is the v10 per-connect config (None: the context's).
///
/// While it is in progress, the comm lives in the `connecting` registry and
/// its token in the handle's stage area (NCCL passes the same buffer on every
/// call). A stage naming anything but a connect in progress to this handle's
/// listener (a handle reused, corrupted or forged) is refused, so `connect`
/// never hands out a comm twice.
pub fn connect(
    ctx_p: *mut c_void,
    dev: i32,
    traffic_class: Option<i32>,
    handle: &mut [u8; HANDLE_SIZE],
) -> Result<Option<*mut c_void>> {
    let c = ctx(ctx_p)?;
    let stage = wire::read_stage(handle).map_err(|e| Error::bad_listen_handle(e.to_string()))?;
    let (rails, striped) =
        wire::decode_any(handle).map_err(|e| Error::bad_listen_handle(e.to_string()))?;
    let h = &rails[0];
    let ours = c.plugin.protocol.wire_id();
    if h.proto != ours {
        let name = |p: u8| match p {
            wire::PROTO_SENDRECV => "sendrecv".to_owned(),
            wire::PROTO_RDMA => "rdma".to_owned(),
            p => format!("unknown ({p})"),
        };
        return Err(Error::bad_listen_handle(format!(
            "connect: the listener uses protocol {}, this rank {}; set the same WEFT_PROTOCOL on every rank \
             (with auto, the same provider and libfabric)",
            name(h.proto),
            name(ours)
        )));
    }
    let d = device(&c.plugin, dev)?;
    if striped != d.virtual_ || rails.len() != d.rails.len() {
        let what = |v: bool, n: usize| {
            if v {
                format!("a virtual device of {n} rail(s)")
            } else {
                "a physical device".to_owned()
            }
        };
        return Err(Error::bad_listen_handle(format!(
            "connect: the listener is on {}, this connect on device {dev}, {}; NCCL fused NICs differently on the two hosts (give them the same NICs, or set NCCL_NET_MERGE_LEVEL=LOC to fuse none)",
            what(striped, rails.len()),
            what(d.virtual_, d.rails.len())
        )));
    }
    let (comm, p) = match stage {
        None => {
            let tc = traffic_class.unwrap_or(c.traffic_class);
            let comm: Arc<dyn proto::Sender> = if d.virtual_ {
                let members = d
                    .rails
                    .iter()
                    .zip(&rails)
                    .map(|(r, h)| c.plugin.protocol.connect(Arc::clone(r), h, tc))
                    .collect::<Result<Vec<_>>>()?;
                Arc::new(proto::stripe::StripedSend::new(
                    members,
                    c.plugin.config.stripe_size,
                )?)
            } else {
                c.plugin.protocol.connect(Arc::clone(&d.rails[0]), h, tc)?
            };
            let p = REG.connecting.insert(Arc::clone(&comm));
            wire::write_stage(handle, Some(p as usize));
            (comm, p)
        }
        Some(p) => {
            let p = p as *mut c_void;
            let comm = REG
                .connecting
                .get(p)
                .filter(|comm| comm.listener_nonce() == h.nonce)
                .ok_or_else(|| {
                    Error::bad_listen_handle(
                        "connect: the handle's connect stage names no connect in progress to this listener (handle reused or corrupted)",
                    )
                })?;
            (comm, p)
        }
    };
    match comm.step_connect() {
        Ok(true) => {
            wire::write_stage(handle, None);
            REG.connecting.remove(p);
            Ok(Some(
                REG.send
                    .insert(Arc::new(Sender::new(comm, d.index, c.profiler))),
            ))
        }
        Ok(false) => Ok(None),
        Err(e) => {
            REG.connecting.remove(p);
            wire::write_stage(handle, None);
            Err(e)
        }
    }
}

/// `accept(listenComm)`: one non-blocking step; `Some` once a peer connected.
pub fn accept(listen: *mut c_void) -> Result<Option<*mut c_void>> {
    let l = REG.listen.get(listen).ok_or_else(|| {
        Error::bad_handle(format!("accept: {listen:p} is not a live Weft listen comm"))
    })?;
    Ok(l.comm.accept()?.map(|comm| {
        REG.recv
            .insert(Arc::new(Receiver::new(comm, l.dev, l.profiler)))
    }))
}

/// The device index and rails of a send or receive comm.
fn comm_device(comm: *mut c_void) -> Option<(usize, Vec<Arc<DeviceState>>)> {
    REG.send
        .get(comm)
        .map(|s| (s.dev, s.comm.rails().to_vec()))
        .or_else(|| REG.recv.get(comm).map(|r| (r.dev, r.comm.rails().to_vec())))
}

/// `regMr(comm, data, size, type)`.
pub fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
) -> Result<*mut c_void> {
    let (index, rails) = registering(comm, data, "regMr")?;
    // A virtual device takes GPU memory only if every rail does: the rail
    // that decides (and that an error names) is the first that does not.
    let d = rails.iter().find(|r| !r.cuda).unwrap_or(&rails[0]);
    let kind = match ptr_type {
        props::PTR_HOST => MemKind::Host,
        props::PTR_CUDA if d.cuda => MemKind::Cuda(cuda_device(data, "regMr")?),
        props::PTR_CUDA => {
            return Err(Error::usage(format!(
                "regMr: CUDA memory on device {} ({}), which reported ptrSupport = NCCL_PTR_HOST (its INFO line at init says why)",
                d.index, d.dev.domain
            )))
        }
        other => {
            return Err(Error::usage(format!(
                "regMr: memory type {other:#x} is not supported (NCCL_PTR_HOST or, where claimed, NCCL_PTR_CUDA)"
            )))
        }
    };
    // SAFETY: NCCL registers memory it owns and keeps allocated until deregMr.
    register_on(index, &rails, data, size, |r| unsafe {
        r.mr.register_kind(data as usize, size, kind)
    })
}

/// `regMrDmaBuf(comm, data, size, type, offset, fd)` (v6+): GPU memory at
/// `data`, which is `offset` bytes into the DMA-BUF `fd`, registered through
/// that DMA-BUF. Only on devices that claimed `NCCL_PTR_DMABUF`; the fd is
/// NCCL's (it closes it once this returns).
pub fn reg_mr_dma_buf(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
    offset: u64,
    fd: i32,
) -> Result<*mut c_void> {
    let (index, rails) = registering(comm, data, "regMrDmaBuf")?;
    let d = rails.iter().find(|r| !r.dmabuf).unwrap_or(&rails[0]);
    if !d.dmabuf {
        return Err(Error::usage(format!(
            "regMrDmaBuf: device {} ({}) did not claim NCCL_PTR_DMABUF (its INFO line at init says why); \
             NCCL should register with regMr",
            d.index, d.dev.domain
        )));
    }
    if ptr_type != props::PTR_CUDA {
        return Err(Error::usage(format!(
            "regMrDmaBuf: memory type {ptr_type:#x}: DMA-BUF registration takes CUDA memory (NCCL_PTR_CUDA) only"
        )));
    }
    if fd < 0 {
        return Err(Error::internal(format!(
            "regMrDmaBuf: {fd} is not a file descriptor"
        )));
    }
    let dev = cuda_device(data, "regMrDmaBuf")?;
    // SAFETY: NCCL registers memory it owns and keeps allocated until
    // deregMr, and keeps `fd` open for this call.
    register_on(index, &rails, data, size, |r| unsafe {
        r.mr.register_dmabuf(data as usize, size, dev, fd, offset)
    })
}

/// The device and rails of the comm a registration is for, and a check of
/// its address.
fn registering(
    comm: *mut c_void,
    data: *mut c_void,
    call: &str,
) -> Result<(usize, Vec<Arc<DeviceState>>)> {
    let found = comm_device(comm).ok_or_else(|| {
        Error::bad_handle(format!(
            "{call}: {comm:p} is not a live Weft send or receive comm"
        ))
    })?;
    if data.is_null() {
        return Err(Error::internal(format!("{call}: NULL address")));
    }
    Ok(found)
}

/// The CUDA device whose memory NCCL says `data` is.
fn cuda_device(data: *mut c_void, call: &str) -> Result<i32> {
    let drv = crate::gpu::driver().map_err(|e| Error::system(e.to_string()))?;
    match drv
        .classify(data)
        .map_err(|e| Error::internal(format!("{call}: {e}")))?
    {
        MemKind::Cuda(dev) => Ok(dev),
        MemKind::Host => Err(Error::internal(format!(
            "{call}: NCCL says {data:p} is CUDA memory, but the driver does not know it as device memory"
        ))),
    }
}

/// Registers on every rail with `reg` and returns the memory handle; a
/// failure on any rail releases what the others registered.
fn register_on(
    index: usize,
    rails: &[Arc<DeviceState>],
    data: *mut c_void,
    size: usize,
    reg: impl Fn(
        &DeviceState,
    )
        -> std::result::Result<Arc<crate::mr::Region<crate::fabric::Mr>>, crate::mr::RegError>,
) -> Result<*mut c_void> {
    let mut h = MrHandle {
        dev: index,
        addr: data as usize,
        len: size,
        regions: Vec::with_capacity(rails.len()),
        mems: Vec::with_capacity(rails.len()),
    };
    for r in rails {
        match reg(r) {
            Ok(region) => {
                let desc = region.desc();
                h.mems.push(proto::Mem {
                    desc: desc.desc,
                    key: desc.key,
                    base: region.range().start,
                });
                h.regions.push((Arc::clone(r), region));
            }
            Err(e) => {
                release(h);
                return Err(Error::system(e.to_string()));
            }
        }
    }
    Ok(REG.mr.insert(Arc::new(h)))
}

/// Gives a handle's registrations back to their devices' caches.
fn release(h: MrHandle) {
    for (d, region) in h.regions {
        d.mr.release(region);
    }
}

/// `deregMr(comm, mhandle)`. Registrations belong to the device, so the comm
/// argument is not needed (it may already be closed).
pub fn dereg_mr(_comm: *mut c_void, mh: *mut c_void) -> Result<()> {
    let h = REG.mr.remove(mh).ok_or_else(|| {
        Error::bad_handle(format!("deregMr: {mh:p} is not a live Weft memory handle"))
    })?;
    // Normally the registry held the last reference; if a receive in
    // flight (or a data-path call) still holds one, the registrations live
    // until it lets go (see `proto::Hold`).
    if let Ok(h) = Arc::try_unwrap(h) {
        release(h);
    }
    Ok(())
}

/// The handle `mh` for `data..data+size` on device `dev` (its registrations
/// are what the comm takes). Every data buffer must come with the handle it
/// was registered under, and lie inside the range NCCL registered with it
/// (not merely inside the pages the registration covers).
fn desc_for(
    mh: *mut c_void,
    dev: usize,
    data: *const u8,
    size: usize,
    call: &str,
) -> Result<Arc<MrHandle>> {
    if mh.is_null() {
        return Err(Error::bad_handle(format!(
            "{call}: buffer {data:p} comes without a memory handle (NCCL registers every buffer it passes)"
        )));
    }
    let h = REG.mr.get(mh).ok_or_else(|| {
        Error::bad_handle(format!(
            "{call}: {mh:p} is not a live Weft memory handle (deregistered, or not from this plugin)"
        ))
    })?;
    if h.dev != dev {
        return Err(Error::internal(format!(
            "{call}: memory handle registered on device {} used on device {dev}",
            h.dev
        )));
    }
    let (a, end) = (data as usize, (data as usize).checked_add(size));
    if a < h.addr || end.is_none_or(|e| e > h.addr + h.len) {
        return Err(Error::bad_buffer(format!(
            "{call}: buffer {data:p} + {size} bytes lies outside its memory handle's registered range {:#x} + {} bytes",
            h.addr, h.len
        )));
    }
    Ok(h)
}

/// `isend(sendComm, data, size, tag, mhandle, phandle)`: `None` = retry later.
/// `phandle` (v10+, else NULL) is kept with the request.
///
/// # Safety
/// `data..data+size` must be memory NCCL registered with `mh` and keeps
/// unchanged until the request is reported done (the range is checked
/// against the handle; that it is readable is NCCL's promise).
pub unsafe fn isend(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: i32,
    mh: *mut c_void,
    phandle: *mut c_void,
) -> Result<Option<*mut c_void>> {
    let (serial, s) = REG.send.get_with_serial(comm).ok_or_else(|| {
        Error::bad_handle(format!("isend: {comm:p} is not a live Weft send comm"))
    })?;
    let h = desc_for(mh, s.dev, data.cast(), size, "isend")?;
    // SAFETY: the buffer lies inside a live registration of NCCL's memory
    // (checked just above), which NCCL keeps until the request completes.
    let Some(id) = unsafe { s.comm.isend(data.cast(), size, tag, &h.mems, phandle) }? else {
        return Ok(None);
    };
    s.events.start(
        id.slot,
        std::iter::once((phandle, profiler::OP_SEND, tag, size)),
    );
    Ok(Some(handles::req_token(
        ReqKind::Send,
        serial,
        id.slot,
        id.gen,
    )))
}

/// One buffer of a grouped receive, as NCCL describes it.
#[derive(Debug, Clone, Copy)]
pub struct RecvArg {
    /// Buffer.
    pub data: *mut c_void,
    /// Capacity.
    pub size: usize,
    /// Tag it accepts.
    pub tag: i32,
    /// Memory handle.
    pub mhandle: *mut c_void,
    /// Profiler handle (v10+).
    pub phandle: *mut c_void,
}

/// `irecv(recvComm, n, ...)`: `None` = retry later.
///
/// # Safety
/// Every buffer must be memory NCCL registered with its handle and keeps
/// writable until the request is reported done (each range is checked
/// against its handle; that it is writable is NCCL's promise).
pub unsafe fn irecv(comm: *mut c_void, args: &[RecvArg]) -> Result<Option<*mut c_void>> {
    proto::check_recv_count(args.len())?;
    let (serial, r) = REG.recv.get_with_serial(comm).ok_or_else(|| {
        Error::bad_handle(format!("irecv: {comm:p} is not a live Weft receive comm"))
    })?;
    // No allocation on the data path: the handles live in a fixed array
    // while the buffers borrow their registrations.
    let mut handles: [Option<Arc<MrHandle>>; props::MAX_RECVS] = Default::default();
    for (h, a) in handles.iter_mut().zip(args) {
        *h = Some(desc_for(a.mhandle, r.dev, a.data.cast(), a.size, "irecv")?);
    }
    // The receive keeps each handle (its registrations) until it is done,
    // even past NCCL's deregMr (see `proto::Hold`).
    let holds: [Option<proto::Hold>; props::MAX_RECVS] =
        std::array::from_fn(|i| handles[i].clone().map(|h| h as proto::Hold));
    let mut bufs = [RecvBuf::EMPTY; props::MAX_RECVS];
    for (((b, a), h), hold) in bufs
        .iter_mut()
        .zip(args)
        .zip(handles.iter().flatten())
        .zip(&holds)
    {
        *b = RecvBuf {
            data: a.data.cast(),
            size: a.size,
            tag: a.tag,
            mem: &h.mems,
            phandle: a.phandle,
            hold: hold.as_ref(),
        };
    }
    // SAFETY: every buffer lies inside a live registration (checked above).
    let Some(id) = unsafe { r.comm.irecv(&bufs[..args.len()]) }? else {
        return Ok(None);
    };
    r.events.start(
        id.slot,
        args.iter()
            .map(|a| (a.phandle, profiler::OP_RECV, a.tag, a.size)),
    );
    Ok(Some(handles::req_token(
        ReqKind::Recv,
        serial,
        id.slot,
        id.gen,
    )))
}

/// `iflush(recvComm, n, ..., mhandles)`: makes data the NIC wrote into
/// GPU memory visible to the GPU's kernels. Host memory needs nothing; for
/// CUDA buffers the driver's flush (`cuFlushGPUDirectRDMAWrites`) runs,
/// once per GPU named, and completes before the call returns. The request
/// is therefore always NULL, which NCCL treats as complete.
pub fn iflush(
    comm: *mut c_void,
    n: usize,
    mhandles: &[*mut c_void],
) -> Result<Option<*mut c_void>> {
    if REG.recv.get(comm).is_none() {
        return Err(Error::bad_handle(format!(
            "iflush: {comm:p} is not a live Weft receive comm"
        )));
    }
    if n == 0 || n > props::MAX_RECVS {
        return Err(Error::internal(format!(
            "iflush with n = {n}: must be 1 ..= {}",
            props::MAX_RECVS
        )));
    }
    let mut flushed: Vec<i32> = Vec::new();
    for &mh in mhandles.iter().filter(|m| !m.is_null()) {
        let h = REG.mr.get(mh).ok_or_else(|| {
            Error::bad_handle(format!("iflush: {mh:p} is not a live Weft memory handle"))
        })?;
        if let MemKind::Cuda(gpu) = h.kind() {
            if !flushed.contains(&gpu) {
                let drv = crate::gpu::driver().map_err(|e| Error::system(e.to_string()))?;
                drv.flush(gpu)
                    .map_err(|e| Error::system(format!("iflush: GPU {gpu}: {e}")))?;
                flushed.push(gpu);
            }
        }
    }
    Ok(None)
}

/// `test(request)`: `Some` once done (the request is then freed).
pub fn test(req: *mut c_void) -> Result<Option<Done>> {
    let not_ours = || {
        Error::bad_handle(format!(
            "test: {req:p} is not a Weft request (stale or foreign pointer)"
        ))
    };
    let (kind, comm, slot, gen) = handles::req_parts(req).ok_or_else(not_ours)?;
    let id = ReqId { slot, gen };
    match kind {
        ReqKind::Send => REG.send.get_at(comm).ok_or_else(not_ours)?.test(id),
        ReqKind::Recv => REG.recv.get_at(comm).ok_or_else(not_ours)?.test(id),
    }
    .map_err(|e| e.context(format!("test({req:p})")))
}

/// `closeSend`.
pub fn close_send(comm: *mut c_void) -> Result<()> {
    let s = REG.send.remove(comm).ok_or_else(|| {
        Error::bad_handle(format!("closeSend: {comm:p} is not a live Weft send comm"))
    })?;
    s.events.stop_all();
    last_ref(s, "closeSend");
    Ok(())
}

/// Drops a closed comm here, once nobody else holds it: its drop is the
/// close (it waits until the provider is done with NCCL's buffers), and
/// NCCL frees or reuses them as soon as the close returns. The keeper holds
/// a comm for the length of one heartbeat tick; if it let go of the last
/// reference after the close returned, the comm's waits ran in the keeper
/// while the provider still wrote into (or read from) memory NCCL had
/// freed (the soak: rxm crashed copying into a closed receive comm's
/// buffer). Bounded by `WEFT_PEER_TIMEOUT` (a keeper stuck inside the
/// provider), with a WARN.
fn last_ref<C: proto::Comm + ?Sized>(c: Arc<Connected<C>>, what: &str) {
    let timeout = peer_timeout().unwrap_or(std::time::Duration::from_secs(30));
    let deadline = Instant::now() + timeout;
    while Arc::strong_count(&c) > 1 || Arc::strong_count(&c.comm) > 1 {
        if Instant::now() > deadline {
            tracing::warn!(
                "{what}: another thread still holds the comm after {timeout:?} (a keeper stuck in the provider?); it finishes closing there"
            );
            break;
        }
        std::thread::yield_now();
    }
    drop(c);
}

/// `closeRecv`.
pub fn close_recv(comm: *mut c_void) -> Result<()> {
    let c = REG.recv.remove(comm).ok_or_else(|| {
        Error::bad_handle(format!(
            "closeRecv: {comm:p} is not a live Weft receive comm"
        ))
    })?;
    c.events.stop_all();
    last_ref(c, "closeRecv");
    Ok(())
}

/// `closeListen`.
pub fn close_listen(comm: *mut c_void) -> Result<()> {
    REG.listen.remove(comm).map(drop).ok_or_else(|| {
        Error::bad_handle(format!(
            "closeListen: {comm:p} is not a live Weft listen comm"
        ))
    })
}

/// Counters of a device, for tests and benchmarks.
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

/// The protocol the running plugin chose (`sendrecv`, `rdma`).
pub fn protocol_name() -> Result<&'static str> {
    Ok(plugin()?.protocol.name())
}

/// A freelist of GPU `gpu`'s memory registered on device `dev` (as
/// `FI_HMEM_CUDA`): elements carry the block's descriptor like host ones.
/// Needs a device that claims CUDA.
pub fn gpu_freelist(
    dev: i32,
    gpu: i32,
    p: crate::freelist::Params,
) -> Result<crate::freelist::Freelist<crate::freelist::CudaMemory, crate::mr::KindRegistrar>> {
    let d = physical(&*plugin()?, dev)?;
    if !d.cuda {
        return Err(Error::usage(format!(
            "device {dev} ({}) does not take GPU memory (its INFO line at init says why)",
            d.dev.domain
        )));
    }
    let reg = crate::mr::KindRegistrar {
        domain: DomainRegistrar(Arc::clone(&d.domain)),
        kind: MemKind::Cuda(gpu),
    };
    crate::freelist::Freelist::new(crate::freelist::CudaMemory { dev: gpu }, reg, p)
        .map_err(|e| Error::system(e.to_string()))
}

/// Counters of device `dev`.
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

/// Checks that `ctx` is a live context.
pub fn check_ctx(p: *mut c_void) -> Result<()> {
    ctx(p).map(drop)
}
