//! Network events for NCCL's profiler (net API v10+).
//!
//! NCCL hands `init` its `ncclProfilerCallback` and each `isend` buffer and
//! `irecv` buffer a `phandle` (the proxy step's event). For every such
//! operation Weft starts a net event under that handle when it posts it and
//! stops it when `test` reports it done or failed, or when its comm closes
//! with it in flight, so every event that started is stopped once. The
//! callback does nothing when no profiler plugin is loaded.
//!
//! Events carry NCCL's `pluginId` convention (type in the upper 16 bits,
//! version in the lower 16) with a type of Weft's own, [`PLUGIN_ID`], and
//! a [`NetEvent`] as `extData`, laid out for C:
//!
//! ```c
//! typedef struct {
//!   uint8_t op;          // 1: send, 2: receive
//!   uint8_t sub;         // buffer index within a grouped receive
//!   uint16_t reserved;
//!   int32_t device;      // NCCL's net device index
//!   int32_t tag;         // NCCL's tag
//!   uint32_t reserved2;
//!   uint64_t size;       // send: bytes; receive: capacity at start, bytes received at stop
//!   const char* peer;    // the peer's libfabric address, as text
//! } weftProfilerNetEvent_v1_t;
//! ```

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::Mutex;

/// `ncclProfilerCallback_t`.
pub type ProfilerFn = unsafe extern "C" fn(
    e_handle: *mut *mut c_void,
    kind: c_int,
    p_handle: *mut c_void,
    plugin_id: i64,
    ext_data: *mut c_void,
) -> c_int;

/// `ncclProfilerNetEventStart`.
pub const EVENT_START: c_int = 0;
/// `ncclProfilerNetEventStop`.
pub const EVENT_STOP: c_int = 1;
/// Weft's net event type ("WF") in NCCL's `type << 16 | version` form, version 1.
pub const PLUGIN_ID: i64 = (0x5746 << 16) | 1;
/// [`NetEvent::op`] of a send.
pub const OP_SEND: u8 = 1;
/// [`NetEvent::op`] of a receive.
pub const OP_RECV: u8 = 2;

/// `weftProfilerNetEvent_v1_t` (see the module documentation).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetEvent {
    /// [`OP_SEND`] or [`OP_RECV`].
    pub op: u8,
    /// Buffer index within a grouped receive.
    pub sub: u8,
    /// Zero.
    pub reserved: u16,
    /// NCCL's device index.
    pub device: i32,
    /// NCCL's tag.
    pub tag: i32,
    /// Zero.
    pub reserved2: u32,
    /// Bytes (see the module documentation).
    pub size: u64,
    /// The peer's address as text.
    pub peer: *const c_char,
}

/// NCCL's profiler callback.
#[derive(Debug, Clone, Copy)]
pub struct Profiler(ProfilerFn);

impl Profiler {
    /// The callback at `addr` (0: none).
    ///
    /// # Safety
    /// `addr` is 0 or the address of a function of type [`ProfilerFn`]
    /// that stays callable while the plugin runs (NCCL's).
    pub unsafe fn from_addr(addr: usize) -> Option<Self> {
        // SAFETY: upheld by the caller; 0 is refused first.
        (addr != 0).then(|| Self(unsafe { std::mem::transmute::<usize, ProfilerFn>(addr) }))
    }

    fn call(&self, e: &mut *mut c_void, kind: c_int, parent: *mut c_void, ev: &NetEvent) {
        let mut ev = *ev;
        // SAFETY: NCCL's callback; `e`, `parent` (NCCL's own handle) and the
        // event descriptor are valid for the call.
        let r = unsafe { (self.0)(e, kind, parent, PLUGIN_ID, (&raw mut ev).cast()) };
        if r != 0 {
            tracing::debug!("the profiler callback returned {r}");
        }
    }
}

/// The net events in flight of one comm's requests, by request slot.
#[derive(Debug)]
pub struct Events {
    profiler: Option<Profiler>,
    device: i32,
    peer: CString,
    live: Mutex<HashMap<u32, Vec<(usize, NetEvent)>>>,
}

// SAFETY: the raw pointers are NCCL's event handles (only passed back to
// NCCL's callback) and `peer`, which points into this struct's own CString.
unsafe impl Send for Events {}
// SAFETY: as above; the map is behind a mutex.
unsafe impl Sync for Events {}

impl Events {
    /// Events of a comm on `device` to `peer`; nothing is recorded without
    /// a profiler.
    pub fn new(profiler: Option<Profiler>, device: usize, peer: &str) -> Self {
        Self {
            profiler,
            device: i32::try_from(device).unwrap_or(i32::MAX),
            peer: CString::new(peer.replace('\0', "")).unwrap_or_default(),
            live: Mutex::new(HashMap::new()),
        }
    }

    /// Whether events are recorded at all.
    pub fn enabled(&self) -> bool {
        self.profiler.is_some()
    }

    /// Starts one event per `(phandle, op, tag, size)` of request `slot`.
    pub fn start(&self, slot: u32, ops: impl Iterator<Item = (*mut c_void, u8, i32, usize)>) {
        let Some(p) = self.profiler else { return };
        let mut started = Vec::new();
        for (sub, (phandle, op, tag, size)) in ops.enumerate() {
            if phandle.is_null() {
                continue;
            }
            let ev = NetEvent {
                op,
                sub: u8::try_from(sub).unwrap_or(u8::MAX),
                reserved: 0,
                device: self.device,
                tag,
                reserved2: 0,
                size: size as u64,
                peer: self.peer.as_ptr(),
            };
            let mut e = std::ptr::null_mut();
            p.call(&mut e, EVENT_START, phandle, &ev);
            if !e.is_null() {
                started.push((e as usize, ev));
            }
        }
        if !started.is_empty() {
            self.lock().insert(slot, started);
        }
    }

    /// Stops the events of request `slot`; `sizes` (bytes moved per buffer)
    /// when it completed.
    pub fn stop(&self, slot: u32, sizes: Option<&[usize]>) {
        let Some(p) = self.profiler else { return };
        let Some(evs) = self.lock().remove(&slot) else {
            return;
        };
        for (e, mut ev) in evs {
            if let Some(s) = sizes.and_then(|s| s.get(usize::from(ev.sub))) {
                ev.size = *s as u64;
            }
            let mut e = e as *mut c_void;
            p.call(&mut e, EVENT_STOP, std::ptr::null_mut(), &ev);
        }
    }

    /// Stops every event still in flight (the comm is closing).
    pub fn stop_all(&self) {
        let slots: Vec<u32> = self.lock().keys().copied().collect();
        for s in slots {
            self.stop(s, None);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Vec<(usize, NetEvent)>>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}
