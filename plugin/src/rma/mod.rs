//! NCCL's one-sided RMA plugin (`ncclRmaPlugin_v13` … `_v16`), beside
//! CollNet on the same core.
//!
//! The tables are generated from NCCL's RMA headers like the net ones;
//! this module is what their members call, in the newest API's terms, with
//! every object NCCL gets (listen comm, collComm, context, symmetric memory
//! handle, request) a token recorded in a registry here and validated on
//! the way back in. The data path is [`coll`], the target's ordering rule
//! [`order`]; what ranks say to one another is [`wire`].
//!
//! **Devices.** NCCL registers its signals, flush buffer and windows as
//! CUDA memory, so an RMA device is a physical device that claims
//! `NCCL_PTR_CUDA` and was opened with `FI_RMA` ([`core::rma_memory`]);
//! `devices` counts the physical devices up to the first that does not
//! qualify (RMA devices are numbered as the net ones, and NCCL matches them
//! by name), and when none does it says why once per plugin start, so
//! NCCL falls back to its own RMA backends. Host-typed registrations (the
//! GIN proxy's inline buffer, CPU-access signals) are taken too.
//!
//! **Contexts.** `init` is a core context per call (NCCL 2.30.7 calls it
//! twice per communicator); `connect` does not use its context argument
//! (NCCL's RMA proxy passes its *net* context there). `createContext`
//! makes an RMA context on a collComm with `nContexts` ordering contexts;
//! Weft's ordering is per (sender, target) pair, which every context gets.

pub mod coll;
pub mod order;
pub mod wire;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use crate::core::handles::{self, Registry};
use crate::core::{self, Error, MemHandle, Properties, Result};
use crate::nccl::HANDLE_SIZE;
use coll::{Coll, Listener, Req, Sym};

/// `NCCL_PTR_HOST`, `NCCL_PTR_CUDA`.
const PTR_HOST: i32 = 1;
const PTR_CUDA: i32 = 2;
/// `NCCL_NET_SIGNAL_OP_INC`, `NCCL_NET_SIGNAL_OP_ADD`.
pub const SIGNAL_INC: u32 = 1;
/// See [`SIGNAL_INC`].
pub const SIGNAL_ADD: u32 = 2;

/// An RMA context: a collComm and its number of ordering contexts.
#[derive(Debug)]
pub struct Ctx {
    coll: Arc<Coll>,
    contexts: u32,
}

/// A request and the collComm it belongs to.
#[derive(Debug)]
struct ReqEntry {
    coll: u64,
    req: Arc<Req>,
}

struct Regs {
    listen: Registry<Listener>,
    coll: Registry<Coll>,
    ctx: Registry<Ctx>,
    sym: Registry<Sym>,
    req: Registry<ReqEntry>,
}

static REG: LazyLock<Regs> = LazyLock::new(|| {
    core::at_teardown(close_all);
    Regs {
        listen: Registry::default(),
        coll: Registry::default(),
        ctx: Registry::default(),
        sym: Registry::default(),
        req: Registry::default(),
    }
});

/// The last finalize: whatever NCCL left open goes before the devices do.
fn close_all() -> usize {
    let r = &*REG;
    r.req.clear() + r.ctx.clear() + r.sym.clear() + r.coll.clear() + r.listen.clear()
}

/// The RMA devices: the physical devices up to the first that cannot hold
/// NCCL's RMA memory. When none can, one INFO line per plugin start says
/// why, device by device.
pub fn devices() -> Result<usize> {
    LazyLock::force(&REG);
    let n = core::physical_devices()?;
    let mut why = Vec::new();
    let mut count = 0;
    for d in 0..n {
        match core::rma_memory(d)? {
            Ok(()) if why.is_empty() => count += 1,
            Ok(()) => {}
            Err(e) => why.push(format!("device {d}: {e}")),
        }
    }
    static SAID: AtomicU64 = AtomicU64::new(0);
    let start = core::start_serial()?;
    if SAID.swap(start, Ordering::Relaxed) != start {
        if count == 0 {
            tracing::info!(
                target: "weft::init",
                "RMA: 0 devices (of {n}), so NCCL uses its own RMA backends: {}",
                if why.is_empty() { "no devices".to_owned() } else { why.join("; ") }
            );
        } else {
            tracing::info!(
                target: "weft::init",
                "RMA: {count} device(s) of {n} (puts as fi_writedata, or fi_write to a target whose provider loses CQ data; signals applied in order at the target; gets as fi_read){}",
                if why.is_empty() { String::new() } else { format!("; not: {}", why.join("; ")) }
            );
        }
    }
    Ok(count)
}

/// `getProperties(dev)`: the physical device's properties as a GIN-proxy
/// device ([`core::props::for_rma`]).
pub fn get_properties<T>(dev: i32, fill: impl FnOnce(&Properties) -> Result<T>) -> Result<T> {
    core::with_rma_properties(dev, fill)
}

/// `listen(ctx, dev)`: a listener on RMA device `dev`; its handle goes to
/// `out`.
pub fn listen(ctx: *mut c_void, dev: i32, out: &mut [u8; HANDLE_SIZE]) -> Result<*mut c_void> {
    core::check_ctx(ctx)?;
    let d = core::rma_device(dev).map_err(|e| e.context("RMA listen"))?;
    let l = Listener::open(d, out)?;
    Ok(REG.listen.insert(Arc::new(l)))
}

/// `connect(handles, nranks, rank, listenComm)`: the collComm over every
/// rank (a collective call; `ctx` is not used).
pub fn connect(handles: &[&[u8; HANDLE_SIZE]], rank: i32, listen: *mut c_void) -> Result<*mut c_void> {
    let l = REG.listen.get(listen).ok_or_else(|| not_ours("connect", "listen comm", listen))?;
    let rank = u32::try_from(rank)
        .ok()
        .filter(|&r| (r as usize) < handles.len())
        .ok_or_else(|| Error::internal(format!("RMA connect: rank {rank} of {} ranks", handles.len())))?;
    let hs = handles
        .iter()
        .enumerate()
        .map(|(r, h)| {
            wire::Handle::decode(h).map_err(|e| {
                Error::internal(format!(
                    "RMA connect: rank {r}'s handle: {e} (is every rank running Weft's RMA tables?)"
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let serial = handles::serial();
    let c = Coll::connect(serial, &hs, rank, &l)?;
    REG.coll.insert_at(serial, Arc::new(c));
    Ok(handles::token_of(serial))
}

fn coll_of(call: &str, p: *mut c_void) -> Result<Arc<Coll>> {
    REG.coll.get(p).ok_or_else(|| not_ours(call, "collComm", p))
}

fn ctx_of(call: &str, p: *mut c_void) -> Result<Arc<Ctx>> {
    REG.ctx.get(p).ok_or_else(|| not_ours(call, "context", p))
}

/// `createContext(collComm, nContexts)`.
pub fn create_context(coll: *mut c_void, contexts: i32) -> Result<*mut c_void> {
    let c = coll_of("createContext", coll)?;
    let contexts = u32::try_from(contexts)
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| Error::usage(format!("RMA createContext: nContexts = {contexts}")))?;
    Ok(REG.ctx.insert(Arc::new(Ctx { coll: c, contexts })))
}

/// `destroyContext`.
pub fn destroy_context(ctx: *mut c_void) -> Result<()> {
    REG.ctx.remove(ctx).map(drop).ok_or_else(|| not_ours("destroyContext", "context", ctx))
}

/// `regMrSym` (with `dmabuf`: `regMrSymDmaBuf`'s offset and fd).
pub fn reg_mr_sym(
    coll: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
    dmabuf: Option<(u64, i32)>,
) -> Result<*mut c_void> {
    let call = if dmabuf.is_some() { "regMrSymDmaBuf" } else { "regMrSym" };
    let c = coll_of(call, coll)?;
    if ptr_type != PTR_HOST && ptr_type != PTR_CUDA {
        return Err(Error::usage(format!(
            "RMA {call}: memory type {ptr_type:#x} (NCCL_PTR_HOST or NCCL_PTR_CUDA)"
        )));
    }
    let mh = match dmabuf {
        None => MemHandle::register(&c.dev, data, size, ptr_type),
        Some((offset, fd)) => MemHandle::register_dmabuf(&c.dev, data, size, ptr_type, offset, fd),
    }
    .map_err(|e| e.context(format!("RMA {call}")))?;
    let sym = c.register(mh, data, size)?;
    Ok(REG.sym.insert(sym))
}

/// `deregMrSym`.
pub fn dereg_mr_sym(coll: *mut c_void, mh: *mut c_void) -> Result<()> {
    let sym = REG.sym.remove(mh).ok_or_else(|| not_ours("deregMrSym", "memory handle", mh))?;
    if let Some(c) = REG.coll.get(coll) {
        c.deregister(&sym);
    }
    Ok(())
}

/// `closeColl`.
pub fn close_coll(coll: *mut c_void) -> Result<()> {
    REG.coll.remove(coll).map(drop).ok_or_else(|| not_ours("closeColl", "collComm", coll))
}

/// `closeListen`.
pub fn close_listen(l: *mut c_void) -> Result<()> {
    REG.listen.remove(l).map(drop).ok_or_else(|| not_ours("closeListen", "listen comm", l))
}

/// The memory handle `mh` of `c`'s collComm.
fn sym_of(call: &str, c: &Ctx, mh: *mut c_void) -> Result<Arc<Sym>> {
    let s = REG.sym.get(mh).ok_or_else(|| not_ours(call, "memory handle", mh))?;
    if s.coll != c.coll.serial {
        return Err(Error::bad_handle(format!(
            "RMA {call}: memory handle {mh:p} was registered on another collComm"
        )));
    }
    Ok(s)
}

fn check_context(call: &str, c: &Ctx, context: i32) -> Result<()> {
    if u32::try_from(context).is_ok_and(|n| n < c.contexts) {
        Ok(())
    } else {
        Err(Error::usage(format!(
            "RMA {call}: context {context}, but the RMA context has {} (createContext's nContexts)",
            c.contexts
        )))
    }
}

/// A new request of `c`'s collComm, run through `f`; its token.
fn request(c: &Ctx, f: impl FnOnce(&Arc<Req>) -> Result<()>) -> Result<*mut c_void> {
    let req = Arc::new(Req::default());
    f(&req)?;
    Ok(REG.req.insert(Arc::new(ReqEntry { coll: c.coll.serial, req })))
}

/// A put: `size` bytes from `src_off` of `src` to `dst_off` of rank
/// `rank`'s `dst`.
#[derive(Debug, Clone, Copy)]
pub struct Put {
    /// NCCL's `context`.
    pub context: i32,
    /// Source offset and handle.
    pub src: (u64, *mut c_void),
    /// Bytes.
    pub size: usize,
    /// Destination offset and handle.
    pub dst: (u64, *mut c_void),
    /// Target rank.
    pub rank: u32,
}

/// A signal: `op` at `off` of `mh` (at the put's rank).
#[derive(Debug, Clone, Copy)]
pub struct Signal {
    /// Offset and handle.
    pub at: (u64, *mut c_void),
    /// `signalValue`.
    pub value: u64,
    /// `signalOp`.
    pub op: u32,
}

/// `iput` / `iputSignal` (`signal` = None, or op 0: a plain put). A
/// signal-only op has size 0 and NULL data handles.
pub fn iput(ctx: *mut c_void, p: Put, signal: Option<Signal>) -> Result<*mut c_void> {
    let call = if signal.is_some() { "iputSignal" } else { "iput" };
    let c = ctx_of(call, ctx)?;
    check_context(call, &c, p.context)?;
    let signal = signal.filter(|s| s.op != 0);
    let put = if p.size == 0 && p.src.1.is_null() && p.dst.1.is_null() {
        None
    } else {
        Some((sym_of(call, &c, p.src.1)?, sym_of(call, &c, p.dst.1)?))
    };
    let sig = match signal {
        None => None,
        Some(s) => {
            let value = match s.op {
                SIGNAL_INC => 1,
                SIGNAL_ADD => s.value,
                op => {
                    return Err(Error::usage(format!(
                        "RMA {call}: signal op {op} (1: NCCL_NET_SIGNAL_OP_INC, 2: NCCL_NET_SIGNAL_OP_ADD)"
                    )))
                }
            };
            Some((sym_of(call, &c, s.at.1)?, s.at.0, value))
        }
    };
    request(&c, |req| {
        c.coll.put(
            p.rank,
            put.as_ref().map(|(s, d)| (&**s, p.src.0, &**d, p.dst.0, p.size)),
            sig.as_ref().map(|(s, off, v)| (&**s, *off, *v)),
            req,
        )
    })
}

/// `iget`: `size` bytes from `remote_off` of rank `rank`'s `remote` into
/// `local_off` of `local` (the [`Put`]'s `src` is the remote side).
pub fn iget(ctx: *mut c_void, g: Put) -> Result<*mut c_void> {
    let c = ctx_of("iget", ctx)?;
    check_context("iget", &c, g.context)?;
    let (remote, local) = (sym_of("iget", &c, g.src.1)?, sym_of("iget", &c, g.dst.1)?);
    request(&c, |req| c.coll.get(g.rank, (&remote, g.src.0), (&local, g.dst.0), g.size, req))
}

/// `iflush(context, mhandle, rank)`: a request already done once the
/// flush ran ([`Coll::flush`]).
pub fn iflush(ctx: *mut c_void, context: i32, mh: *mut c_void, rank: u32) -> Result<*mut c_void> {
    let c = ctx_of("iflush", ctx)?;
    check_context("iflush", &c, context)?;
    let s = sym_of("iflush", &c, mh)?;
    if rank >= c.coll.nranks() {
        return Err(Error::usage(format!("RMA iflush: rank {rank} of {}", c.coll.nranks())));
    }
    request(&c, |_| c.coll.flush(&s))
}

/// `test(collComm, request)`: `true` once done (the request is then gone).
pub fn test(coll: *mut c_void, req: *mut c_void) -> Result<bool> {
    let c = coll_of("test", coll)?;
    let r = REG.req.get(req).ok_or_else(|| not_ours("test", "request", req))?;
    if r.coll != c.serial {
        return Err(Error::bad_handle(format!(
            "RMA test: request {req:p} belongs to another collComm"
        )));
    }
    c.progress()?;
    match r.req.state() {
        None => Ok(false),
        Some(done) => {
            REG.req.remove(req);
            done.map(|()| true)
        }
    }
}

/// `rmaProgress` (`ginProgress`).
pub fn progress(ctx: *mut c_void) -> Result<()> {
    ctx_of("rmaProgress", ctx)?.coll.progress()
}

/// `queryLastError`: whether an operation of the context's collComm failed
/// or one of its ranks died.
pub fn query_last_error(ctx: *mut c_void) -> Result<bool> {
    Ok(ctx_of("queryLastError", ctx)?.coll.last_error().is_some())
}

/// `getRmaProperties(collComm)`: `flushesAllPutsOnAnySignal`. False: a
/// signal from one rank says nothing of another rank's puts.
pub fn flushes_all_puts_on_any_signal(coll: *mut c_void) -> Result<bool> {
    coll_of("getRmaProperties", coll).map(|_| false)
}

/// The error for a pointer NCCL passes as an RMA object (`what`: a listen
/// comm, collComm, context, memory handle or request) to `call` that is
/// none of Weft's live ones.
pub fn not_ours(call: &str, what: &str, p: *mut c_void) -> Error {
    Error::bad_handle(format!(
        "RMA {call}: {p:p} is not a live Weft RMA {what} (closed, or not from this plugin)"
    ))
}
