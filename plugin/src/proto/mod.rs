//! Protocols over libfabric, behind one interface.
//!
//! The core holds listen, send and receive comms as [`Listener`], [`Sender`]
//! and [`Receiver`] trait objects made by a [`Protocol`], and names no
//! protocol's types. What every protocol shares lives here, below them all:
//! the device state, the limits NCCL is told, request pools ([`pool`]), the
//! control-message encoding ([`wire`]), the liveness period, and the types a
//! request's completion is reported in. A protocol never imports the core.
//!
//! Both protocols, `rdma` (receiver-driven writes) and `sendrecv` (tagged
//! messages), are comms on endpoints shared per device ([`hub`]); they share
//! the handshake and liveness and differ in their data path ([`comms`]).

use std::ffi::c_void;
#[cfg(feature = "testing")]
use std::sync::mpsc::{Receiver as Rx, Sender as Tx};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::Device;
use crate::error::Result;
use crate::fabric::Domain;
use crate::mr::{DomainRegistrar, MrCache};

pub mod comms;
pub(crate) mod cq;
pub mod ctrl;
pub mod grave;
pub(crate) mod handshake;
pub mod hub;
pub mod pool;
pub mod stripe;
pub(crate) mod sync;
pub mod wire;

#[cfg(feature = "testing")]
pub use handshake::MAX_PENDING;
use wire::ListenHandle;

/// Largest `n` of a grouped receive (`maxRecvs`; NCCL's IB transport uses 8 too).
pub const MAX_RECVS: usize = 8;
/// `NCCL_NET_MAX_REQUESTS` since NCCL 2.19: requests NCCL keeps in flight per comm.
pub const MAX_REQUESTS: usize = 32;

/// One device with everything its comms share, whatever their protocol.
#[derive(Debug)]
pub struct DeviceState {
    /// NCCL's index.
    pub index: usize,
    /// What discovery found.
    pub dev: Device,
    /// The domain every comm of the device uses.
    pub domain: Arc<Domain>,
    /// Registrations, shared by all comms of the device.
    pub mr: MrCache<DomainRegistrar>,
    /// Whether the device takes GPU memory (`NCCL_PTR_CUDA` claimed).
    pub cuda: bool,
    /// Whether it registers GPU memory through DMA-BUF (`NCCL_PTR_DMABUF`
    /// claimed: only where `cuda` is).
    pub dmabuf: bool,
    /// `WEFT_EAGER_SIZE` (0 where the device takes GPU memory).
    pub eager_size: usize,
    /// `WEFT_PEER_TIMEOUT`.
    pub peer_timeout: Duration,
    /// The protocol takes no tagged messages (rdma): the hub drops any
    /// that arrive (see [`ctrl::Posts::Sink`]).
    pub sinks_tagged: bool,
    /// The device's shared endpoints, opened by its first comm.
    pub hub: std::sync::Mutex<Option<Arc<hub::Hub>>>,
}

impl DeviceState {
    /// The device's hub, opened on first use.
    pub fn hub(&self) -> Result<Arc<hub::Hub>> {
        let mut h = self.hub.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = &*h {
            return Ok(Arc::clone(h));
        }
        let new = Arc::new(hub::Hub::open(self)?);
        *h = Some(Arc::clone(&new));
        hub::opened(&new);
        Ok(new)
    }

    /// Whether peers address this device's registrations by virtual address
    /// (`FI_MR_VIRT_ADDR`), not by offset into them.
    pub fn virt_addr(&self) -> bool {
        self.domain.info().mr_mode() & libfabric_sys::FI_MR_VIRT_ADDR != 0
    }
}

/// How often each end of a comm says it is alive: an eighth of the peer
/// timeout, so a live peer gets seven chances within one timeout.
pub fn heartbeat_period(peer_timeout: Duration) -> Duration {
    (peer_timeout / 8).max(Duration::from_millis(1))
}

/// Where a buffer is registered on one device: what the provider needs to
/// send from it, receive into it, or let a peer write into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mem {
    /// Registration descriptor (NULL when the provider needs none).
    pub desc: *mut c_void,
    /// The registration's remote key (RDMA).
    pub key: u64,
    /// Where the registration starts (RDMA offsets are from here).
    pub base: usize,
}

impl Mem {
    /// No registration.
    pub const NONE: Mem = Mem {
        desc: std::ptr::null_mut(),
        key: 0,
        base: 0,
    };

    /// The registration on the first device of `mems` (a comm on one
    /// device gets exactly one).
    pub fn first(mems: &[Mem]) -> Mem {
        mems.first().copied().unwrap_or(Mem::NONE)
    }
}

// SAFETY: the descriptor is libfabric's, only handed back to libfabric,
// never dereferenced by Weft; it is valid from any thread.
unsafe impl Send for Mem {}
// SAFETY: as for Send; nothing is written through it.
unsafe impl Sync for Mem {}

/// What keeps a buffer's registration open while a receive holds it: the
/// caller's handle for it (the core's memory handle), opaque here. NCCL
/// deregisters a receive buffer before it closes the comm, with the peer's
/// write possibly still on its way; a write that finds its key gone is
/// dropped by libfabric 1.17's tcp provider without consuming it, and that
/// connection carries nothing more (every comm between those endpoints in
/// that direction falls silent). So a receive holds its buffers'
/// registrations until it is reported done, or its comm is closed (which
/// waits for the sender's answering `Bye`).
pub type Hold = Arc<dyn std::any::Any + Send + Sync>;

/// One receive buffer of a grouped receive.
#[derive(Debug, Clone, Copy)]
pub struct RecvBuf<'a> {
    /// Where the message goes.
    pub data: *mut u8,
    /// Its capacity.
    pub size: usize,
    /// The sender's tag it accepts.
    pub tag: i32,
    /// Its registration on each device of the comm, in the comm's order
    /// (one entry, except on a virtual device: one per rail).
    pub mem: &'a [Mem],
    /// NCCL profiler handle (kept, v10+).
    pub phandle: *mut c_void,
    /// Keeps the registration open while the receive holds the buffer
    /// (see [`Hold`]); `None` for memory the comm owns.
    pub hold: Option<&'a Hold>,
}

impl RecvBuf<'_> {
    /// No buffer (fills the unused entries of a grouped receive).
    pub const EMPTY: RecvBuf<'static> = RecvBuf {
        data: std::ptr::null_mut(),
        size: 0,
        tag: 0,
        mem: &[],
        phandle: std::ptr::null_mut(),
        hold: None,
    };
}

// SAFETY: the pointers are addresses of NCCL's buffers and profiler
// handles, only handed to libfabric or back to NCCL, never dereferenced by
// Weft; they are valid from any thread.
unsafe impl Send for RecvBuf<'_> {}

/// The result of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    /// Buffers (1 for a send).
    pub n: usize,
    /// Bytes moved per buffer.
    pub sizes: [usize; MAX_RECVS],
}

/// A request of a comm, as its protocol names it: a slot of the comm's
/// request pool and that slot's generation (see [`pool::Pool::gen`]). The
/// core turns it into the token NCCL holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqId {
    /// The slot.
    pub slot: u32,
    /// The slot's generation when the request was made.
    pub gen: u32,
}

/// Checks `n` of a grouped receive: 1 ..= [`MAX_RECVS`] (NCCL's `maxRecvs`).
pub fn check_recv_count(n: usize) -> Result<()> {
    if n == 0 || n > MAX_RECVS {
        return Err(crate::error::Error::internal(format!(
            "irecv with n = {n}: must be 1 ..= {MAX_RECVS} (maxRecvs)"
        )));
    }
    Ok(())
}

/// A protocol: makes the comms of a device.
pub trait Protocol: Send + Sync + std::fmt::Debug {
    /// Its name (`sendrecv`, `rdma`).
    fn name(&self) -> &'static str;
    /// Its byte in listen handles ([`wire::PROTO_SENDRECV`], ...).
    fn wire_id(&self) -> u8;
    /// Opens a listener on `dev` whose handle (what NCCL sends to the
    /// peer) carries `nonce`.
    fn listen(
        &self,
        dev: Arc<DeviceState>,
        nonce: u64,
    ) -> Result<(Arc<dyn Listener>, ListenHandle)>;
    /// Starts connecting to the listener named by `handle`.
    fn connect(
        &self,
        dev: Arc<DeviceState>,
        handle: &ListenHandle,
    ) -> Result<Arc<dyn Sender>>;
}

/// A listening comm.
pub trait Listener: Send + Sync + std::fmt::Debug {
    /// One accept step: a receive comm once a peer connected. Never blocks.
    fn accept(&self) -> Result<Option<Arc<dyn Receiver>>>;
    /// One keeper tick: answers connection requests and moves handshakes on
    /// while NCCL is not calling `accept` (a rank busy elsewhere), so a live
    /// listener's peer is never told "no answer"; what it confirms waits
    /// for `accept`. Never waits for a busy listener.
    fn tend(&self, now: Instant);
}

/// What send and receive comms have in common.
pub trait Comm: Send + Sync + std::fmt::Debug {
    /// The devices it runs on: one, or the rails of a virtual device. A
    /// buffer NCCL passes comes with its registration on each, in this order.
    fn rails(&self) -> &[Arc<DeviceState>];
    /// Tests request `id`: `Some` once done (it is then freed). Never blocks.
    fn test(&self, id: ReqId) -> Result<Option<Done>>;
    /// One heartbeat tick (the keeper thread). Never waits for a busy comm.
    fn keepalive(&self, now: Instant);
    /// The peer's address as text (log lines, profiler events).
    fn peer_name(&self) -> String;
    /// An error once the peer was declared dead (silent, or said `Bye`).
    /// Never waits: `Ok` while another thread holds the comm.
    fn alive(&self) -> Result<()>;
    /// Test hook: holds the comm's state as a keeper stuck in the provider
    /// would, until `release` fires; `held` is signalled once held.
    #[cfg(feature = "testing")]
    fn hold(&self, held: &Tx<()>, release: &Rx<()>);
    /// Test hook: whether the provider may still own buffers posted on the
    /// comm (its endpoint is open).
    #[cfg(feature = "testing")]
    fn endpoint_open(&self) -> bool;
    /// Test hook: the comm's id and token on its hub, where it has one (a
    /// hostile-input test plays a third party that learned them).
    #[cfg(feature = "testing")]
    fn wire_id(&self) -> Option<(u32, u32)> {
        None
    }
}

/// A sending comm (also the state of a `connect` in progress).
pub trait Sender: Comm {
    /// The nonce of the listener it connects to (from NCCL's handle).
    fn listener_nonce(&self) -> u64;
    /// One connect step: `Ok(true)` once connected. Never blocks.
    fn step_connect(&self) -> Result<bool>;
    /// Posts a send; `Ok(None)` when it cannot now (retry later).
    ///
    /// # Safety
    /// `data..data+size` must be readable and stay valid until the request is
    /// reported done; `mem` must be its registration on each device of the
    /// comm ([`Comm::rails`]), in order.
    unsafe fn isend(
        &self,
        data: *const u8,
        size: usize,
        tag: i32,
        mem: &[Mem],
        phandle: *mut c_void,
    ) -> Result<Option<ReqId>>;
}

/// A receiving comm.
pub trait Receiver: Comm {
    /// Posts a grouped receive; `Ok(None)` when it cannot now (retry later).
    ///
    /// # Safety
    /// Every buffer must be writable for its size and stay valid until the
    /// request is reported done (or the comm is closed).
    unsafe fn irecv(&self, bufs: &[RecvBuf]) -> Result<Option<ReqId>>;
}

/// The protocol `WEFT_PROTOCOL` chooses for `devices`, and why, in words
/// for the INFO line and `weft info`; forcing `rdma` where the provider
/// cannot is an error naming what is missing.
pub fn choose(
    setting: crate::config::Protocol,
    devices: &[Device],
) -> std::result::Result<(Arc<dyn Protocol>, String), String> {
    use crate::config::Protocol as P;
    let provider = devices.first().map_or("", |d| d.provider.as_str());
    let rma = if devices.is_empty() {
        Err("no device".to_owned())
    } else if devices
        .iter()
        .all(|d| d.rma.qualifies() && d.rma_info.is_some())
    {
        let announced = devices.iter().find_map(|d| d.rma.cq_data_lost).map_or_else(String::new, |why| {
            format!("; {why}, so every write is announced by a message, which {provider} delivers after the write (FI_ORDER_SAW)")
        });
        Ok(format!(
            "{provider} offers FI_RMA with {} bytes of remote CQ data on every device{announced}",
            devices[0].rma.cq_data_size
        ))
    } else if let Some(why) = devices.iter().find_map(|d| d.rma.cq_data_lost) {
        Err(format!(
            "{provider} offers FI_RMA, but {why}, and it does not order a send after a write (FI_ORDER_SAW), which announcing writes by a message needs"
        ))
    } else if devices.iter().any(|d| d.rma.offered) {
        Err(format!(
            "{provider} offers FI_RMA, but not with 4 bytes of remote CQ data on every device"
        ))
    } else {
        Err(format!("{provider} does not offer FI_RMA here"))
    };
    let sendrecv: Arc<dyn Protocol> = Arc::new(comms::OnHub(comms::Path::Tagged));
    let rdma: Arc<dyn Protocol> = Arc::new(comms::OnHub(comms::Path::Rdma));
    match (setting, rma) {
        (P::SendRecv, _) => Ok((sendrecv, "WEFT_PROTOCOL=sendrecv".to_owned())),
        (P::Rdma, Ok(why)) => Ok((rdma, format!("WEFT_PROTOCOL=rdma; {why}"))),
        (P::Rdma, Err(why)) => Err(format!(
            "WEFT_PROTOCOL=rdma, but the RDMA protocol (FI_RMA with at least 4 bytes of remote CQ data) cannot run here: {why}. \
             Use WEFT_PROTOCOL=auto (or sendrecv) with this provider"
        )),
        (P::Auto, Ok(why)) => Ok((rdma, format!("auto: {why}"))),
        (P::Auto, Err(why)) => Ok((sendrecv, format!("auto: {why}, so sendrecv"))),
    }
}
