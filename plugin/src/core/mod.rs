//! The version-free core every adapter calls.
//!
//! It speaks the newest semantics (per-communicator contexts, `size_t` sizes,
//! grouped receives, profiler handles, traffic classes); older API versions are
//! projections of it done by the adapters. What NCCL gets for contexts, comms,
//! memory handles and requests are tokens recorded in [`handles`] registries,
//! never reused, and validated on the way back in. No registry lock is held
//! while libfabric runs. No version number appears here.
//!
//! Split the way NCCL splits its IB transport: this file is the lifecycle
//! (contexts, the registries, start and teardown, the keeper's tick);
//! `devices` the device numbering and virtual devices; `gdr` whether a
//! device takes GPU memory; `connect` listen/connect/accept; `reg`
//! registrations; `p2p` the data path; `close` the closes; `owned` the
//! typed API Weft's own modules use instead of tokens; [`handles`] the
//! token registries, [`keeper`] the heartbeat thread, [`props`] NCCL's
//! properties, [`profiler`] the profiler events.

mod close;
mod connect;
mod devices;
mod gdr;
pub mod handles;
#[cfg(feature = "testing")]
pub(crate) mod hooks;
pub mod keeper;
mod owned;
mod p2p;
pub mod profiler;
pub mod props;
mod reg;

use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

pub use crate::error::{Code, Error, Result};
#[cfg(feature = "testing")]
pub use crate::error::Kind;
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
pub use close::*;
pub use connect::*;
pub use devices::*;
#[cfg(feature = "testing")]
pub use gdr::gpu_freelist;
use gdr::{dmabuf_claim, gpu_claim};
use handles::{Registry, ReqKind};
use owned::Owned;
pub use owned::{Context, ListenComm, MemHandle, RecvComm, Request, SendComm};
pub use p2p::*;
use profiler::{Events, Profiler};
pub use reg::*;

/// The process-wide state behind every context.
#[derive(Debug)]
pub struct Plugin {
    /// The validated configuration.
    pub config: Config,
    /// Devices, by NCCL index.
    pub devices: Vec<Arc<DeviceState>>,
    /// What `getProperties` reports for each device.
    pub props: Vec<Properties>,
    /// What the RMA tables' `getProperties` reports for each device.
    pub rma_props: Vec<Properties>,
    /// Which start of the plugin in this process this is (1, 2, ...).
    pub serial: u64,
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
    /// Its comms speak the striping protocol (decided once, at
    /// `makeVDevice`: see `devices::stripes`).
    pub striped: bool,
}

/// A device as NCCL numbers it: a physical one (one rail) or a virtual one.
#[derive(Debug, Clone)]
struct Dev {
    index: usize,
    rails: Vec<Arc<DeviceState>>,
    virtual_: bool,
    /// A virtual device whose comms stripe (false: the rail's own comms).
    striped: bool,
}

/// A context: per communicator (v11+) or the one process context (older).
#[derive(Debug)]
pub struct Ctx {
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
            rma_props: all_props.iter().map(props::for_rma).collect(),
            serial: {
                static STARTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
            },
            props: all_props,
            protocol,
            vdevs: Mutex::new(Vec::new()),
        }),
        keeper,
    })
}

/// What a module above the core closes at the last finalize
/// ([`at_teardown`]).
static AT_TEARDOWN: Mutex<Vec<fn() -> usize>> = Mutex::new(Vec::new());

/// Has `close` run at every last finalize, before the devices close: a
/// module above the core (RMA) that holds device state closes its objects
/// there and returns how many were left open. Registering twice is once.
pub fn at_teardown(close: fn() -> usize) {
    let mut v = AT_TEARDOWN.lock().unwrap_or_else(|e| e.into_inner());
    if !v.iter().any(|f| std::ptr::fn_addr_eq(*f, close)) {
        v.push(close);
    }
}

/// The last context is gone: joins the keeper, closes whatever NCCL left
/// open, and drops the devices (endpoints, registrations, domains, fabrics),
/// so the library can be unloaded and loaded again.
fn teardown(r: Running) {
    drop(r.keeper);
    let above: Vec<fn() -> usize> = AT_TEARDOWN.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let left = above.iter().map(|f| f()).sum::<usize>()
        + REG.listen.clear()
        + REG.send.clear()
        + REG.recv.clear()
        + REG.mr.clear();
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
    tracing::debug!(target: "weft::init", "context for communicator {:#x} (0: the process context), traffic class {}", args.comm_id, args.traffic_class);
    Ok(REG.ctx.insert(Arc::new(Ctx {
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

/// Which start of the plugin in this process is running (1, 2, ...: each
/// first `init` after a last `finalize` is a new one).
pub fn start_serial() -> Result<u64> {
    Ok(plugin()?.serial)
}

/// `WEFT_PEER_TIMEOUT` of the running plugin.
pub fn peer_timeout() -> Result<std::time::Duration> {
    Ok(plugin()?.config.peer_timeout)
}

/// `WEFT_COLLNET_REDUCERS` of the running plugin.
pub fn collnet_reducers() -> Result<Vec<crate::config::ReducerRef>> {
    Ok(plugin()?.config.collnet_reducers.clone())
}

/// The protocol the running plugin chose (`sendrecv`, `rdma`).
pub fn protocol_name() -> Result<&'static str> {
    Ok(plugin()?.protocol.name())
}

/// Checks that `ctx` is a live context.
pub fn check_ctx(p: *mut c_void) -> Result<()> {
    ctx(p).map(drop)
}
