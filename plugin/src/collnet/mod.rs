//! CollNet in software: NCCL's `ncclCollNet` over the core's point-to-point
//! comms, on any provider.
//!
//! **Group.** NCCL calls `listen` on every head rank, then `connect` once
//! with every rank's handle; the group must be ready when `connect`
//! returns. Each rank connects a send comm to every other rank's listener
//! and accepts a receive comm from each (a full mesh, `n - 1` of each), then
//! says its rank on each send comm so that the receiver knows whose receive
//! comm is whose. `connect` gives up when no comm makes progress for
//! `WEFT_PEER_TIMEOUT`, naming the ranks missing.
//!
//! **All-reduce** (`iallreduce`, direct algorithm). The elements are cut
//! into `n` shards, shard `j` owned by rank `j`. Phase 1: each rank sends
//! shard `j` of its input to rank `j` and receives the other ranks' copies
//! of its own shard. The owner reduces them **in rank order** (0, 1, …,
//! n-1), so every element is reduced exactly once, by one rank, always in
//! the same order: results are bit-identical on every rank and from run to
//! run. Phase 2: the owner sends its reduced shard to every rank. Each rank
//! sends and receives `(n-1)/n` of the buffer per phase, as a ring does.
//! Shards travel in chunks of [`CHUNK`] bytes and are pipelined: a chunk is
//! reduced as soon as its contributions are in and sent on at once; a
//! chunk of the receive buffer is overwritten by phase 2 only after this
//! rank's phase-1 send of the same bytes completed (NCCL reduces in place).
//! Tags name the operation (its sequence number, the same on every rank:
//! NCCL issues collectives in the same order everywhere) and the phase.
//!
//! **Through reducers** (`WEFT_COLLNET_REDUCERS`): the group also holds a
//! send and a receive comm per reduction server ([`reducer`]); an
//! all-reduce's shards are the reducers', each rank sends every reducer a
//! [`wire::Header`] and its copy of the reducer's shard, and receives the
//! reduced shard back: each rank moves the buffer once each way.
//!
//! Memory is host memory (`ptrSupport = HOST`); registrations go to the
//! device's registration cache through the group's comms. The reduction
//! itself is [`reduce`].
//!
//! Files: this one holds the entry points NCCL's CollNet table reaches
//! (through the adapter) and the registries; `group` builds and closes
//! groups, `stream` moves chunks over one net comm, `engine` runs one
//! collective request, [`reduce`] the element-wise reductions, [`reducer`]
//! the reduction server, [`wire`] what ranks and reducers say besides data.

mod engine;
mod group;
pub mod reduce;
pub mod reducer;
mod stream;
pub mod wire;
pub use engine::*;
pub use group::*;
pub(crate) use stream::*;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::config::ReducerRef;
use crate::core::handles::Registry;
use crate::core::{self, props, Context, ListenComm, MemHandle, RecvComm, Request, SendComm};
use crate::error::{Error, Result};
use crate::nccl::HANDLE_SIZE;
use reduce::{DataType, RedOp};
use wire::{Header, Join, GREETING_LEN, HEADER_TAG, HELLO_TAG};

/// Bytes per message of a shard (a multiple of the element size is used).
pub const CHUNK: usize = 1 << 20;
/// Messages in flight per peer, phase and direction.
const WINDOW: usize = 4;
/// Operations whose tags differ: an operation's tags are its number modulo
/// this (so a comm's per-tag counters stay bounded however long the job),
/// and a group refuses to have more in flight.
pub const TAG_OPS: u32 = 4096;

/// The tags of operation `seq`'s two phases (to and from the reducing side).
fn op_tags(seq: u32) -> [i32; 2] {
    let base = ((seq % TAG_OPS) as i32) << 2;
    [base, base | 1]
}

/// A listening CollNet comm: the core listener of one device.
#[derive(Debug)]
pub struct CollListen {
    ctx: Context,
    dev: i32,
    listen: ListenComm,
}

/// A connected group.
#[derive(Debug)]
pub struct CollComm {
    rank: usize,
    nranks: usize,
    dev: i32,
    /// Reducers of the group (none: the ranks reduce).
    nreducers: usize,
    /// The group's comms, until `closeColl` takes them (a step holds them
    /// while it runs; they close when the last holder lets go).
    links: Mutex<Option<Arc<Links>>>,
    /// Operations issued so far (the next one's sequence number).
    seq: Mutex<u32>,
    /// Through reducers: the operation whose headers go next. A reducer
    /// pairs the ranks' headers in the order they arrive, and NCCL may test
    /// a later operation first, so each operation sends its headers only in
    /// its turn, and passes the turn on once all of them are posted.
    header_turn: AtomicU32,
    /// An operation failed before all its headers were posted: the turn
    /// never passes it, and the later ones fail instead of waiting.
    header_lost: AtomicBool,
    /// Operations in flight.
    live: AtomicUsize,
    /// Payload bytes this rank sent and received in collectives.
    sent: AtomicU64,
    received: AtomicU64,
    /// Registered scratch buffers of finished collectives, for the next
    /// ones (allocating, zeroing and registering megabytes per operation
    /// cost more than the transfer).
    pool: Mutex<Vec<Scratch>>,
}

/// The core comms of a group.
#[derive(Debug)]
struct Links {
    /// Send and receive comm per rank (none at this rank's own index).
    send: Vec<Option<SendComm>>,
    recv: Vec<Option<RecvComm>>,
    /// Send and receive comm per reducer.
    reducers: Vec<(SendComm, RecvComm)>,
}

/// A registered scratch buffer: the peers' contributions to this rank's
/// shard, then room for one chunk of reduction. The registration goes
/// before the memory (fields drop in order).
#[derive(Debug, Default)]
struct Scratch {
    mh: Option<MemHandle>,
    buf: Vec<u8>,
}

/// Scratch buffers a group keeps between operations.
const POOL: usize = 4;

/// A CollNet memory handle: the core's registration, where the group has
/// comms to register through (a group of one has none, and needs none),
/// and the range NCCL registered, which every buffer passed with it must
/// lie in.
#[derive(Debug)]
pub struct CollMr {
    core: Option<Arc<MemHandle>>,
    addr: usize,
    len: usize,
}

static LISTENS: LazyLock<Registry<CollListen>> = LazyLock::new(Registry::default);
static COMMS: LazyLock<Registry<CollComm>> = LazyLock::new(Registry::default);
static MRS: LazyLock<Registry<CollMr>> = LazyLock::new(Registry::default);
static REQS: LazyLock<Registry<Mutex<Coll>>> = LazyLock::new(Registry::default);

/// `reduceSupport(type, op)`: every type and op this build reduces.
pub fn reduce_support(ty: i32, op: i32) -> bool {
    DataType::from_nccl(ty).is_some() && RedOp::from_nccl(op).is_some()
}

/// `regMr(collComm, data, size, type)`.
pub fn reg_mr(
    c: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
) -> Result<*mut c_void> {
    let g = comm(c, "regMr")?;
    if ptr_type != props::PTR_HOST {
        return Err(Error::usage(format!(
            "CollNet regMr: memory type {ptr_type:#x} is not supported: host memory only (ptrSupport = NCCL_PTR_HOST)"
        )));
    }
    let core = g.reg_mr(data, size)?.map(Arc::new);
    Ok(MRS.insert(Arc::new(CollMr {
        core,
        addr: data as usize,
        len: size,
    })))
}

/// `deregMr(collComm, mhandle)`.
pub fn dereg_mr(mh: *mut c_void) -> Result<()> {
    // The core's registration goes with the last request that holds it.
    MRS.remove(mh).map(drop).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet deregMr: {mh:p} is not a live memory handle"
        ))
    })
}

/// The core handle of CollNet handle `mh`, once `buf..buf+len` (the
/// `what` buffer of `call`) is checked to lie inside the range NCCL
/// registered with it: before anything is allocated or posted.
fn core_mh(
    mh: *mut c_void,
    buf: usize,
    len: usize,
    what: &str,
    call: &str,
) -> Result<Option<Arc<MemHandle>>> {
    let m = MRS.get(mh).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet {call}: {mh:p} is not a live memory handle"
        ))
    })?;
    let inside = buf >= m.addr && buf.checked_add(len).is_some_and(|e| e <= m.addr + m.len);
    if len > 0 && !inside {
        return Err(Error::bad_buffer(format!(
            "CollNet {call}: the {what} buffer {buf:#x} + {len} bytes lies outside its memory handle's registered range {:#x} + {} bytes",
            m.addr, m.len
        )));
    }
    Ok(m.core.clone())
}

/// `iallreduce`: a request `test` drives to completion.
///
/// # Safety
/// `send` and `recv` must be `count` elements of `ty`, registered with
/// `smh`/`rmh`, and stay valid until the request is reported done.
#[allow(clippy::too_many_arguments)]
pub unsafe fn iallreduce(
    c: *mut c_void,
    send: *mut c_void,
    recv: *mut c_void,
    count: usize,
    ty: i32,
    op: i32,
    smh: *mut c_void,
    rmh: *mut c_void,
) -> Result<*mut c_void> {
    let g = comm(c, "iallreduce")?;
    let (dt, rop) = type_op(ty, op, "iallreduce")?;
    let bytes = count
        .checked_mul(dt.size())
        .ok_or_else(|| Error::internal("CollNet iallreduce: count overflows"))?;
    if bytes > 0 && (send.is_null() || recv.is_null()) {
        return Err(Error::internal("CollNet iallreduce: NULL buffer"));
    }
    let (smh, rmh) = (
        core_mh(smh, send as usize, bytes, "send", "iallreduce")?,
        core_mh(rmh, recv as usize, bytes, "receive", "iallreduce")?,
    );
    // Shards are the ranks' or, through reducers, the reducers'.
    let served = g.nreducers > 0;
    let owners = if served { g.nreducers } else { g.nranks };
    let shards = even_shards(count, dt.size(), owners);
    let (send, recv) = (send as usize, recv as usize);
    let mine = if served { 0 } else { recv + shards[g.rank].0 };
    let spec = Spec {
        ty: dt,
        op: rop,
        bytes,
        p1_src: shards.iter().map(|s| send + s.0).collect(),
        p1_out: mine,
        smh,
        p2_src: mine,
        p2_dst: shards.iter().map(|s| recv + s.0).collect(),
        p2_src_mh: rmh.clone(),
        p2_dst_mh: rmh,
        // Through reducers a chunk's result exists only once the reducer
        // has every rank's copy of it, mine included: it cannot overwrite
        // bytes I still send, in place or not.
        hazard: !served,
        shards,
    };
    Coll::start(g, Kind::AllReduce, spec)
}

/// `iallgather` (v8+): the window `[window_off, window_off + window_bytes)`
/// of the global buffer (`bytes_per_rank` from each rank, in rank order),
/// gathered into `recv` (which holds the window). `send` holds this rank's
/// bytes from the later of the window's start and its part's start.
///
/// # Safety
/// The buffers hold what the arguments say, registered with their handles,
/// and stay valid until the request is reported done.
#[allow(clippy::too_many_arguments)]
pub unsafe fn iallgather(
    c: *mut c_void,
    send: *mut c_void,
    recv: *mut c_void,
    recv_size: usize,
    recv_mh: *mut c_void,
    bytes_per_rank: usize,
    window_off: usize,
    window_bytes: usize,
    send_mh: *mut c_void,
) -> Result<*mut c_void> {
    let g = comm(c, "iallgather")?;
    let shards = window(
        "iallgather",
        &g,
        bytes_per_rank,
        window_off,
        window_bytes,
        recv_size,
    )?;
    let mine = shards[g.rank].1 - shards[g.rank].0;
    let (smh, rmh) = (
        core_mh(send_mh, send as usize, mine, "send", "iallgather")?,
        core_mh(
            recv_mh,
            recv as usize,
            window_bytes,
            "receive",
            "iallgather",
        )?,
    );
    let (send, recv) = (send as usize, recv as usize);
    let spec = Spec {
        ty: DataType::U8,
        op: RedOp::Sum,
        bytes: window_bytes,
        p1_src: vec![0; g.nranks],
        p1_out: 0,
        smh: smh.clone(),
        p2_src: send,
        p2_dst: shards.iter().map(|s| recv + (s.0 - window_off)).collect(),
        p2_src_mh: smh,
        p2_dst_mh: rmh,
        hazard: false,
        shards,
    };
    Coll::start(g, Kind::AllGather, spec)
}

/// `ireducescatter` (v8+): every rank's `send` holds the window
/// `[window_off, window_off + window_bytes)` of its global input; each rank
/// gets its part of the window reduced, into `recv` (from the later of the
/// window's start and its part's start).
///
/// # Safety
/// The buffers hold what the arguments say, registered with their handles,
/// and stay valid until the request is reported done.
#[allow(clippy::too_many_arguments)]
pub unsafe fn ireducescatter(
    c: *mut c_void,
    send: *mut c_void,
    send_size: usize,
    send_mh: *mut c_void,
    recv: *mut c_void,
    bytes_per_rank: usize,
    window_off: usize,
    window_bytes: usize,
    ty: i32,
    op: i32,
    recv_mh: *mut c_void,
) -> Result<*mut c_void> {
    let g = comm(c, "ireducescatter")?;
    let (dt, rop) = type_op(ty, op, "ireducescatter")?;
    let shards = window(
        "ireducescatter",
        &g,
        bytes_per_rank,
        window_off,
        window_bytes,
        send_size,
    )?;
    if bytes_per_rank % dt.size() != 0
        || window_off % dt.size() != 0
        || window_bytes % dt.size() != 0
    {
        return Err(Error::internal(format!(
            "CollNet ireducescatter: sizes and offsets must be whole {}-byte elements",
            dt.size()
        )));
    }
    let mine = shards[g.rank].1 - shards[g.rank].0;
    let (smh, rmh) = (
        core_mh(
            send_mh,
            send as usize,
            window_bytes,
            "send",
            "ireducescatter",
        )?,
        core_mh(recv_mh, recv as usize, mine, "receive", "ireducescatter")?,
    );
    let (send, recv) = (send as usize, recv as usize);
    let spec = Spec {
        ty: dt,
        op: rop,
        bytes: window_bytes,
        p1_src: shards.iter().map(|s| send + (s.0 - window_off)).collect(),
        p1_out: recv,
        smh,
        p2_src: 0,
        p2_dst: vec![0; g.nranks],
        p2_src_mh: None,
        p2_dst_mh: rmh,
        hazard: false,
        shards,
    };
    Coll::start(g, Kind::ReduceScatter, spec)
}

fn type_op(ty: i32, op: i32, call: &str) -> Result<(DataType, RedOp)> {
    match (DataType::from_nccl(ty), RedOp::from_nccl(op)) {
        (Some(t), Some(o)) => Ok((t, o)),
        _ => Err(Error::internal(format!(
            "CollNet {call}: type {ty} / op {op} is not one reduceSupport claimed"
        ))),
    }
}

/// The ranks' parts cut to the window ([`window_shards`]), once checked: a
/// window must lie inside the global buffer, and the part NCCL describes
/// must hold it.
fn window(
    call: &str,
    g: &CollComm,
    per_rank: usize,
    off: usize,
    len: usize,
    part: usize,
) -> Result<Vec<(usize, usize)>> {
    let total = per_rank.checked_mul(g.nranks);
    if total.is_none_or(|t| off.checked_add(len).is_none_or(|e| e > t)) || part < len {
        return Err(Error::internal(format!(
            "CollNet {call}: window of {len} bytes at {off} outside {} ranks x {per_rank} bytes, or a buffer of {part} bytes",
            g.nranks
        )));
    }
    Ok(window_shards(g.nranks, per_rank, off, len))
}

/// `test(request)`: `Some(bytes)` once done (the request is then freed).
pub fn test(req: *mut c_void) -> Result<Option<usize>> {
    let r = REQS
        .get(req)
        .ok_or_else(|| Error::bad_handle(format!("CollNet test: {req:p} is not a live request")))?;
    let mut op = r.lock().unwrap_or_else(|e| e.into_inner());
    let kind = op.kind;
    match op.step() {
        Ok(false) => Ok(None),
        Ok(true) => {
            let bytes = op.s.bytes;
            drop(op);
            REQS.remove(req);
            Ok(Some(bytes))
        }
        Err(e) => {
            op.abandon();
            drop(op);
            REQS.remove(req);
            Err(e.context(format!("CollNet {}", kind.name())))
        }
    }
}

/// Payload bytes group `c`'s rank sent and received in collectives so far
/// (what a bench prints per worker).
#[cfg(feature = "testing")]
pub fn bytes_moved(c: *mut c_void) -> Result<(u64, u64)> {
    let g = comm(c, "bytes")?;
    Ok((
        g.sent.load(Ordering::Relaxed),
        g.received.load(Ordering::Relaxed),
    ))
}

/// The group's device (its properties are the net device's).
pub fn device_of(c: *mut c_void) -> Result<i32> {
    Ok(comm(c, "device")?.dev)
}
