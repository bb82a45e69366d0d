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

pub mod reduce;
pub mod reducer;
pub mod wire;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::config::ReducerRef;
use crate::core::handles::Registry;
use crate::core::{self, props, RecvArg};
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
    ctx: usize,
    dev: i32,
    listen: usize,
}

/// A connected group.
#[derive(Debug)]
pub struct CollComm {
    rank: usize,
    nranks: usize,
    dev: i32,
    /// Core send and receive comm per rank (0 at this rank's own index).
    send: Vec<usize>,
    recv: Vec<usize>,
    /// Send and receive comm per reducer (none: the ranks reduce).
    reducers: Vec<(usize, usize)>,
    /// Operations issued so far (the next one's sequence number).
    seq: Mutex<u32>,
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

/// A registered scratch buffer: the peers' contributions to this rank's
/// shard, then room for one chunk of reduction.
#[derive(Debug, Default)]
struct Scratch {
    buf: Vec<u8>,
    mh: usize,
}

/// Scratch buffers a group keeps between operations.
const POOL: usize = 4;

/// A CollNet memory handle: the core's registration, where the group has
/// comms to register through (a group of one has none, and needs none),
/// and the range NCCL registered, which every buffer passed with it must
/// lie in.
#[derive(Debug)]
pub struct CollMr {
    core: Option<usize>,
    addr: usize,
    len: usize,
}

static LISTENS: LazyLock<Registry<CollListen>> = LazyLock::new(Registry::default);
static COMMS: LazyLock<Registry<CollComm>> = LazyLock::new(Registry::default);
static MRS: LazyLock<Registry<CollMr>> = LazyLock::new(Registry::default);
static REQS: LazyLock<Registry<Mutex<Coll>>> = LazyLock::new(Registry::default);

fn p(v: usize) -> *mut c_void {
    v as *mut c_void
}

/// `listen(dev)` on context `ctx`: the core listener, whose handle is the
/// CollNet handle.
pub fn listen(ctx: *mut c_void, dev: i32, handle: &mut [u8; HANDLE_SIZE]) -> Result<*mut c_void> {
    let l = core::listen(ctx, dev, handle)?;
    Ok(LISTENS.insert(Arc::new(CollListen {
        ctx: ctx as usize,
        dev,
        listen: l as usize,
    })))
}

/// `closeListen`.
pub fn close_listen(l: *mut c_void) -> Result<()> {
    let l = LISTENS.remove(l).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet closeListen: {l:p} is not a live listen comm"
        ))
    })?;
    core::close_listen(p(l.listen))
}

/// `connect(handles, rank, listenComm)`: builds the group; returns once
/// every rank, and every reducer `WEFT_COLLNET_REDUCERS` names, is
/// connected both ways.
pub fn connect(
    handles: &[[u8; HANDLE_SIZE]],
    rank: usize,
    listen: *mut c_void,
) -> Result<*mut c_void> {
    let reducers = reducer_handles()?;
    connect_with(handles, rank, listen, &reducers)
}

/// The reducers' handles, as `WEFT_COLLNET_REDUCERS` names them.
fn reducer_handles() -> Result<Vec<[u8; HANDLE_SIZE]>> {
    core::collnet_reducers()?
        .iter()
        .map(|r| match r {
            ReducerRef::Handle(h) => Ok(*h),
            ReducerRef::File(path) => {
                let f = path.display();
                let text = std::fs::read_to_string(path).map_err(|e| {
                    Error::usage(format!(
                        "WEFT_COLLNET_REDUCERS: cannot read {f}: {e}; start `weft-reducer --handle-file {f}` first, or fix the list"
                    ))
                })?;
                crate::nccl::handle_from_hex(&text).ok_or_else(|| {
                    Error::usage(format!(
                        "WEFT_COLLNET_REDUCERS: {f} holds no reducer handle ({} hex digits, as `weft-reducer --handle-file` writes)",
                        2 * HANDLE_SIZE
                    ))
                })
            }
        })
        .collect()
}

/// A group being built: the comms so far and the greetings' buffer. What
/// is still here when it is dropped (a failed `connect`) is closed.
#[derive(Debug)]
struct Building {
    /// Send comm per rank (0: not yet, or this rank) and per reducer.
    send: Vec<usize>,
    rsend: Vec<usize>,
    accepted: Vec<usize>,
    /// My greeting (8 bytes), the joins (one per reducer), then room for
    /// one greeting per accepted comm; registered once a comm exists.
    arena: Vec<u8>,
    mh: usize,
}

impl Drop for Building {
    fn drop(&mut self) {
        for &s in self.send.iter().chain(&self.rsend).filter(|&&s| s != 0) {
            let _ = core::close_send(p(s));
        }
        for &r in &self.accepted {
            let _ = core::close_recv(p(r));
        }
        if self.mh != 0 {
            let _ = core::dereg_mr(std::ptr::null_mut(), p(self.mh));
        }
    }
}

/// [`connect`] with the reducers given (tests run reducers in-process).
///
/// Every comm opens with a greeting that says whose it is: each rank sends
/// its rank on its send comm to every other rank, and a [`wire::Join`] to
/// every reducer; a reducer connects back once all the group's ranks
/// joined and greets with [`wire::REDUCER_BIT`] and its index. `connect`
/// gives up when nothing progresses for `WEFT_PEER_TIMEOUT`.
pub fn connect_with(
    handles: &[[u8; HANDLE_SIZE]],
    rank: usize,
    listen: *mut c_void,
    reducers: &[[u8; HANDLE_SIZE]],
) -> Result<*mut c_void> {
    let l = LISTENS.get(listen).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet connect: {listen:p} is not a live listen comm"
        ))
    })?;
    let (n, m) = (handles.len(), reducers.len());
    if rank >= n || n > wire::MAX_RANKS as usize {
        return Err(Error::internal(format!(
            "CollNet connect: rank {rank} of a group of {n}"
        )));
    }
    if m > wire::MAX_REDUCERS as usize {
        return Err(Error::usage(format!(
            "WEFT_COLLNET_REDUCERS names {m} reducers; at most {}",
            wire::MAX_REDUCERS
        )));
    }
    let timeout = core::peer_timeout()?;
    let key = wire::group_key(handles);
    let peers = n - 1 + m;
    let join_at = GREETING_LEN;
    let theirs_at = join_at + m * Join::LEN;
    let mut b = Building {
        send: vec![0; n],
        rsend: vec![0; m],
        accepted: Vec::new(),
        arena: vec![0; theirs_at + peers * GREETING_LEN],
        mh: 0,
    };
    b.arena[..GREETING_LEN].copy_from_slice(&(rank as u64).to_le_bytes());
    for k in 0..m {
        let j = Join {
            key,
            rank: rank as u32,
            nranks: n as u32,
            index: k as u32,
            nreducers: m as u32,
            handle: handles[rank],
        };
        b.arena[join_at + k * Join::LEN..][..Join::LEN].copy_from_slice(&j.encode());
    }
    let base = b.arena.as_mut_ptr() as usize;
    let mut hs: Vec<[u8; HANDLE_SIZE]> = handles.to_vec();
    let mut rh: Vec<[u8; HANDLE_SIZE]> = reducers.to_vec();
    // Greetings out (per rank, then per reducer) and in (per accepted comm).
    let mut out = vec![false; n + m];
    out[rank] = true;
    let mut inn = vec![false; peers];
    let mut reqs: Vec<usize> = Vec::new();
    let mut last_progress = Instant::now();
    loop {
        let mut progressed = false;
        for (j, h) in hs.iter_mut().enumerate() {
            if j != rank && b.send[j] == 0 {
                if let Some(s) = core::connect(p(l.ctx), l.dev, None, h)? {
                    b.send[j] = s as usize;
                    progressed = true;
                }
            }
        }
        for (k, h) in rh.iter_mut().enumerate() {
            if b.rsend[k] == 0 {
                let s = core::connect(p(l.ctx), l.dev, None, h)
                    .map_err(|e| e.context(format!("CollNet connect: reducer {k} of {m}")))?;
                if let Some(s) = s {
                    b.rsend[k] = s as usize;
                    progressed = true;
                }
            }
        }
        while b.accepted.len() < peers {
            match core::accept(p(l.listen))? {
                Some(r) => {
                    b.accepted.push(r as usize);
                    progressed = true;
                }
                None => break,
            }
        }
        if b.mh == 0 {
            let any = b.send.iter().chain(&b.rsend).chain(&b.accepted);
            if let Some(&c) = any.into_iter().find(|&&c| c != 0) {
                b.mh = core::reg_mr(p(c), p(base), b.arena.len(), props::PTR_HOST)? as usize;
            }
        }
        if b.mh != 0 {
            for (j, posted) in out.iter_mut().enumerate() {
                let (comm, at, len) = if j < n {
                    (b.send[j], 0, GREETING_LEN)
                } else {
                    (b.rsend[j - n], join_at + (j - n) * Join::LEN, Join::LEN)
                };
                if *posted || comm == 0 {
                    continue;
                }
                // SAFETY: `len` bytes of the registered arena, kept until
                // the requests are done (or their comms closed).
                if let Some(q) = unsafe { send(comm, base + at, len, HELLO_TAG, b.mh) }? {
                    *posted = true;
                    reqs.push(q as usize);
                }
            }
            for (i, &r) in b.accepted.iter().enumerate() {
                if inn[i] {
                    continue;
                }
                let at = theirs_at + i * GREETING_LEN;
                // SAFETY: as above, this comm's own greeting slot.
                if let Some(q) = unsafe { recv(r, base + at, GREETING_LEN, HELLO_TAG, b.mh) }? {
                    inn[i] = true;
                    reqs.push(q as usize);
                }
            }
        }
        let before = reqs.len();
        let mut i = 0;
        while i < reqs.len() {
            if core::test(p(reqs[i]))?.is_some() {
                reqs.swap_remove(i);
            } else {
                i += 1;
            }
        }
        progressed |= reqs.len() != before;
        if reqs.is_empty()
            && b.accepted.len() == peers
            && out.iter().all(|&o| o)
            && inn.iter().all(|&i| i)
        {
            break;
        }
        if progressed {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > timeout {
            let missing: Vec<usize> = (0..n).filter(|&j| j != rank && b.send[j] == 0).collect();
            let reducers: Vec<usize> = (0..m).filter(|&k| b.rsend[k] == 0).collect();
            return Err(Error::remote(format!(
                "CollNet connect: rank {rank} of {n}: no progress for {:.1} s (WEFT_PEER_TIMEOUT); \
                 not connected to ranks {missing:?} or reducers {reducers:?}; {} of {peers} comms accepted \
                 (a reducer connects back once every rank of the group has joined it), {} greetings in flight",
                timeout.as_secs_f64(),
                b.accepted.len(),
                reqs.len()
            )));
        }
        std::thread::yield_now();
    }
    // Whose is each accepted comm?
    let mut recv = vec![0usize; n];
    let mut rrecv = vec![0usize; m];
    for (i, &c) in b.accepted.iter().enumerate() {
        let at = theirs_at + i * GREETING_LEN;
        let v = u64::from_le_bytes(b.arena[at..at + 8].try_into().expect("8 bytes"));
        let slot = if v & wire::REDUCER_BIT != 0 {
            usize::try_from(v & !wire::REDUCER_BIT)
                .ok()
                .and_then(|k| rrecv.get_mut(k))
        } else {
            usize::try_from(v)
                .ok()
                .filter(|&j| j != rank)
                .and_then(|j| recv.get_mut(j))
        };
        match slot {
            Some(s) if *s == 0 => *s = c,
            _ => {
                return Err(Error::remote(format!(
                    "CollNet connect: rank {rank} of {n}: a peer greeted as {v:#x}: not a rank or reducer of this group, or twice"
                )))
            }
        }
    }
    b.accepted.clear();
    let send = std::mem::take(&mut b.send);
    let reducers = std::mem::take(&mut b.rsend)
        .into_iter()
        .zip(rrecv)
        .collect();
    drop(b);
    Ok(COMMS.insert(Arc::new(CollComm {
        rank,
        nranks: n,
        dev: l.dev,
        send,
        recv,
        reducers,
        seq: Mutex::new(0),
        live: AtomicUsize::new(0),
        sent: AtomicU64::new(0),
        received: AtomicU64::new(0),
        pool: Mutex::new(Vec::new()),
    })))
}

fn comm(c: *mut c_void, call: &str) -> Result<Arc<CollComm>> {
    COMMS.get(c).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet {call}: {c:p} is not a live collective comm"
        ))
    })
}

impl CollComm {
    /// A comm to register memory through (any of the group's).
    fn any(&self) -> Option<usize> {
        let reducers = self.reducers.iter().map(|r| r.0);
        self.send.iter().copied().chain(reducers).find(|&s| s != 0)
    }

    /// A registered scratch buffer of at least `len` bytes: the smallest
    /// kept one that is large enough, or a new one.
    fn take_scratch(&self, len: usize) -> Result<Scratch> {
        if len == 0 {
            return Ok(Scratch::default());
        }
        {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            let fits = (0..pool.len()).filter(|&i| pool[i].buf.len() >= len);
            if let Some(i) = fits.min_by_key(|&i| pool[i].buf.len()) {
                return Ok(pool.swap_remove(i));
            }
        }
        let mut buf = vec![0u8; len];
        let mh = match self.any() {
            Some(any) => {
                core::reg_mr(p(any), buf.as_mut_ptr().cast(), len, props::PTR_HOST)? as usize
            }
            None => 0,
        };
        Ok(Scratch { buf, mh })
    }

    /// Tells every reducer this rank closes the group (a header with `bye`),
    /// so that the reducer ends it between operations rather than finding
    /// its comms closed; waits up to the peer timeout for the sends. Best
    /// effort: a reducer that is gone is only logged.
    fn bye(&self) {
        let m = self.reducers.len();
        if m == 0 {
            return;
        }
        let mut s = match self.take_scratch(m * Header::LEN) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(target: "weft::collnet", "CollNet closeColl: no goodbye to the reducers: {e}");
                return;
            }
        };
        let bye = Header {
            bye: true,
            seq: 0,
            ty: DataType::U8,
            op: RedOp::Sum,
            total: 0,
            off: 0,
            len: 0,
            chunk: 1,
        };
        for k in 0..m {
            s.buf[k * Header::LEN..][..Header::LEN].copy_from_slice(&bye.encode());
        }
        let deadline = Instant::now() + core::peer_timeout().unwrap_or(Duration::from_secs(30));
        let mut q: Vec<Option<usize>> = vec![None; m];
        let mut left: Vec<usize> = (0..m).collect();
        let at = s.buf.as_ptr() as usize;
        while !left.is_empty() && Instant::now() < deadline {
            left.retain(|&k| {
                let mut step = || -> Result<bool> {
                    if q[k].is_none() {
                        let c = self.reducers[k].0;
                        // SAFETY: header k of the registered scratch, kept
                        // until the request ends (or the deadline leaks it).
                        q[k] = unsafe {
                            send(c, at + k * Header::LEN, Header::LEN, HEADER_TAG, s.mh)
                        }?
                        .map(|q| q as usize);
                    }
                    Ok(match q[k] {
                        Some(r) => core::test(p(r))?.is_some(),
                        None => false,
                    })
                };
                match step() {
                    Ok(done) => !done,
                    Err(e) => {
                        tracing::info!(target: "weft::collnet",
                            "CollNet closeColl: no goodbye to reducer {k} of {m}: {e}");
                        false
                    }
                }
            });
            std::thread::yield_now();
        }
        if left.is_empty() {
            self.give_back(s);
        } else {
            std::mem::forget(s);
            tracing::warn!(target: "weft::collnet",
                "CollNet closeColl: reducers {left:?} did not take this rank's goodbye within WEFT_PEER_TIMEOUT; closing anyway");
        }
    }

    /// Keeps `s` for a later operation (the smallest goes when too many are kept).
    fn give_back(&self, s: Scratch) {
        if s.buf.is_empty() {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(s);
        if pool.len() > POOL {
            let i = (0..pool.len())
                .min_by_key(|&i| pool[i].buf.len())
                .expect("not empty");
            let old = pool.swap_remove(i);
            drop(pool);
            if old.mh != 0 {
                let _ = core::dereg_mr(std::ptr::null_mut(), p(old.mh));
            }
        }
    }
}

/// `closeColl`: says goodbye to the reducers, closes the group's comms.
pub fn close_coll(c: *mut c_void) -> Result<()> {
    let g = COMMS.remove(c).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet closeColl: {c:p} is not a live collective comm"
        ))
    })?;
    g.bye();
    let mut first = Ok(());
    for s in std::mem::take(&mut *g.pool.lock().unwrap_or_else(|e| e.into_inner())) {
        if s.mh != 0 {
            first = first.and(core::dereg_mr(std::ptr::null_mut(), p(s.mh)));
        }
    }
    let reducers = g.reducers.iter();
    for &s in g
        .send
        .iter()
        .chain(reducers.clone().map(|r| &r.0))
        .filter(|&&s| s != 0)
    {
        first = first.and(core::close_send(p(s)));
    }
    for &r in g
        .recv
        .iter()
        .chain(reducers.map(|r| &r.1))
        .filter(|&&r| r != 0)
    {
        first = first.and(core::close_recv(p(r)));
    }
    first
}

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
    let core = match g.any() {
        Some(any) => Some(core::reg_mr(p(any), data, size, ptr_type)? as usize),
        None => None,
    };
    Ok(MRS.insert(Arc::new(CollMr {
        core,
        addr: data as usize,
        len: size,
    })))
}

/// `deregMr(collComm, mhandle)`.
pub fn dereg_mr(mh: *mut c_void) -> Result<()> {
    let m = MRS.remove(mh).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet deregMr: {mh:p} is not a live memory handle"
        ))
    })?;
    match m.core {
        Some(h) => core::dereg_mr(std::ptr::null_mut(), p(h)),
        None => Ok(()),
    }
}

/// The core handle of CollNet handle `mh`, once `buf..buf+len` (the
/// `what` buffer of `call`) is checked to lie inside the range NCCL
/// registered with it: before anything is allocated or posted.
fn core_mh(mh: *mut c_void, buf: usize, len: usize, what: &str, call: &str) -> Result<usize> {
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
    Ok(m.core.unwrap_or(0))
}

/// One chunk of a transfer: where, how long, and its request while posted.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    off: usize,
    len: usize,
}

/// A transfer stream to or from one peer in one phase: its chunks, the next
/// to post, and the requests in flight (chunk index, request).
#[derive(Debug, Default)]
struct Stream {
    next: usize,
    done: Vec<bool>,
    inflight: Vec<(usize, usize)>,
}

impl Stream {
    fn new(chunks: usize) -> Self {
        Self {
            next: 0,
            done: vec![false; chunks],
            inflight: Vec::new(),
        }
    }
    fn finished(&self) -> bool {
        self.done.iter().all(|&d| d)
    }
    /// Tests what is in flight; marks what completed and adds its bytes
    /// (`chunks` are the stream's) to `count`.
    fn test(&mut self, chunks: &[Chunk], count: &AtomicU64) -> Result<()> {
        let mut i = 0;
        while i < self.inflight.len() {
            let (c, q) = self.inflight[i];
            if core::test(p(q))?.is_some() {
                self.done[c] = true;
                count.fetch_add(chunks[c].len as u64, Ordering::Relaxed);
                self.inflight.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }
}

/// Posts stream `s`'s next chunks, in order, while its window has room
/// and `may(chunk)` allows; `post` returns the request, or `None` when the
/// comm cannot take it now.
fn pump(
    s: &mut Stream,
    may: impl Fn(usize) -> bool,
    mut post: impl FnMut(usize) -> Result<Option<*mut c_void>>,
) -> Result<()> {
    while s.inflight.len() < WINDOW && s.next < s.done.len() && may(s.next) {
        let Some(q) = post(s.next)? else { break };
        s.inflight.push((s.next, q as usize));
        s.next += 1;
    }
    Ok(())
}

/// Sends `len` bytes at `addr` (registered with `mh`) on core send comm `comm`.
///
/// # Safety
/// The range is registered with `mh` and stays valid until the request is done.
pub(crate) unsafe fn send(
    comm: usize,
    addr: usize,
    len: usize,
    tag: i32,
    mh: usize,
) -> Result<Option<*mut c_void>> {
    // SAFETY: the caller's contract.
    unsafe { core::isend(p(comm), p(addr), len, tag, p(mh), std::ptr::null_mut()) }
}

/// Receives `len` bytes on core receive comm `comm` into `addr` (registered
/// with `mh`).
///
/// # Safety
/// As for [`send`], and the range is writable.
pub(crate) unsafe fn recv(
    comm: usize,
    addr: usize,
    len: usize,
    tag: i32,
    mh: usize,
) -> Result<Option<*mut c_void>> {
    let arg = RecvArg {
        data: p(addr),
        size: len,
        tag,
        mhandle: p(mh),
        phandle: std::ptr::null_mut(),
    };
    // SAFETY: the caller's contract.
    unsafe { core::irecv(p(comm), &[arg]) }
}

/// What a collective does with the two phases (see the module's "All-reduce").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Both: reduce-scatter, then all-gather of the reduced shards.
    AllReduce,
    /// Phase 2 only: each rank's part to every rank.
    AllGather,
    /// Phase 1 only: each shard reduced at its owner.
    ReduceScatter,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all-reduce",
            Kind::AllGather => "all-gather",
            Kind::ReduceScatter => "reduce-scatter",
        }
    }
}

/// A collective in progress: its [`Spec`], the chunks and transfer
/// streams it derives, and its scratch.
#[derive(Debug)]
pub struct Coll {
    g: Arc<CollComm>,
    kind: Kind,
    /// What the caller asked: sizes, shards, buffers, handles.
    s: Spec,
    tag: [i32; 2],
    chunks: Vec<Vec<Chunk>>,
    p1_send: Vec<Stream>,
    p1_recv: Vec<Stream>,
    p2_send: Vec<Stream>,
    p2_recv: Vec<Stream>,
    /// Through reducers: phase 1 is `p1_send[k]` to reducer k, phase 2
    /// `p2_recv[k]` from it, and `hdr[k]` the header that opens the
    /// operation there (its bytes at the start of `scratch`).
    served: bool,
    hdr: Vec<Stream>,
    /// Chunks of my shard ready for phase 2 (reduced, or given).
    ready: usize,
    /// The peers' contributions to my shard, one shard-sized slot per rank.
    scratch: Scratch,
    /// The scratch may be reused: nothing of the provider's is left in it.
    clean: bool,
}

/// What a collective is asked to do. Shards are byte ranges of the
/// operation's global buffer; the addresses say where each lives here.
#[derive(Debug)]
struct Spec {
    ty: DataType,
    op: RedOp,
    /// Bytes `test` reports.
    bytes: usize,
    shards: Vec<(usize, usize)>,
    /// Phase 1: where shard j starts in my input (sent to rank j; mine is
    /// my own contribution), where my reduced shard goes, and the input's
    /// memory handle.
    p1_src: Vec<usize>,
    p1_out: usize,
    smh: usize,
    /// Phase 2: where my shard starts (sent to every rank), where shard j
    /// lands, and the memory handles of both.
    p2_src: usize,
    p2_dst: Vec<usize>,
    p2_src_mh: usize,
    p2_dst_mh: usize,
    /// Phase 2 may overwrite bytes phase 1 still sends (all-reduce in place).
    hazard: bool,
}

impl Coll {
    fn start(g: Arc<CollComm>, kind: Kind, s: Spec) -> Result<*mut c_void> {
        let seq = {
            let mut q = g.seq.lock().unwrap_or_else(|e| e.into_inner());
            if g.live.load(Ordering::Relaxed) >= TAG_OPS as usize {
                return Err(Error::usage(format!(
                    "CollNet {}: {TAG_OPS} collectives already in flight on this group; test some to completion first",
                    kind.name()
                )));
            }
            let v = *q;
            *q = q.wrapping_add(1);
            v
        };
        let n = g.nranks;
        let me = g.rank;
        let ts = s.ty.size();
        let chunk = (CHUNK / ts).max(1) * ts;
        let chunks: Vec<Vec<Chunk>> = s
            .shards
            .iter()
            .map(|&(a, b)| {
                (a..b)
                    .step_by(chunk)
                    .map(|off| Chunk {
                        off,
                        len: chunk.min(b - off),
                    })
                    .collect()
            })
            .collect();
        if kind == Kind::AllReduce && !g.reducers.is_empty() {
            return Self::start_served(g, s, seq, chunk, chunks);
        }
        let reduce = kind != Kind::AllGather;
        let gather = kind != Kind::ReduceScatter;
        let my_len = s.shards[me].1 - s.shards[me].0;
        let scratch = if reduce && my_len > 0 {
            g.take_scratch(my_len * n + chunk.min(my_len))?
        } else {
            Scratch::default()
        };
        let streams = |on: bool, shard: &dyn Fn(usize) -> usize| -> Vec<Stream> {
            (0..n)
                .map(|j| {
                    Stream::new(if on && j != me {
                        chunks[shard(j)].len()
                    } else {
                        0
                    })
                })
                .collect()
        };
        let c = Coll {
            kind,
            tag: op_tags(seq),
            served: false,
            hdr: Vec::new(),
            p1_send: streams(reduce, &|j| j),
            p1_recv: streams(reduce, &|_| me),
            p2_send: streams(gather, &|_| me),
            p2_recv: streams(gather, &|j| j),
            ready: if reduce { 0 } else { chunks[me].len() },
            chunks,
            s,
            scratch,
            clean: true,
            g,
        };
        if kind == Kind::AllGather && my_len > 0 && c.s.p2_src != c.s.p2_dst[me] {
            // SAFETY: my part, `my_len` bytes in NCCL's send buffer and in
            // its receive window (the caller checked both); they may overlap.
            unsafe { std::ptr::copy(c.s.p2_src as *const u8, c.s.p2_dst[me] as *mut u8, my_len) };
        }
        Ok(c.launch())
    }

    /// The request for `self`, counted in flight until dropped.
    fn launch(self) -> *mut c_void {
        self.g.live.fetch_add(1, Ordering::Relaxed);
        REQS.insert(Arc::new(Mutex::new(self)))
    }

    /// An all-reduce through the group's reducers: `s.shards` are theirs.
    fn start_served(
        g: Arc<CollComm>,
        s: Spec,
        seq: u32,
        chunk: usize,
        chunks: Vec<Vec<Chunk>>,
    ) -> Result<*mut c_void> {
        let m = g.reducers.len();
        let mut scratch = g.take_scratch(m * Header::LEN)?;
        for (k, &(off, end)) in s.shards.iter().enumerate() {
            let h = Header {
                bye: false,
                seq,
                ty: s.ty,
                op: s.op,
                total: s.bytes as u64,
                off: off as u64,
                len: (end - off) as u64,
                chunk: chunk as u32,
            };
            scratch.buf[k * Header::LEN..][..Header::LEN].copy_from_slice(&h.encode());
        }
        let along = |k: usize| Stream::new(chunks[k].len());
        let c = Coll {
            kind: Kind::AllReduce,
            tag: op_tags(seq),
            served: true,
            hdr: (0..m).map(|_| Stream::new(1)).collect(),
            p1_send: (0..m).map(along).collect(),
            p1_recv: Vec::new(),
            p2_send: Vec::new(),
            p2_recv: (0..m).map(along).collect(),
            ready: 0,
            chunks,
            s,
            scratch,
            clean: true,
            g,
        };
        Ok(c.launch())
    }

    /// One step through the reducers: the header, then the shard's chunks
    /// up to reducer k and its reduced chunks back into place (in place
    /// only once the same bytes went up).
    fn step_served(&mut self) -> Result<bool> {
        let m = self.g.reducers.len();
        let (hdr, hmh) = (self.scratch.buf.as_ptr() as usize, self.scratch.mh);
        let hazard = self.s.hazard;
        for k in 0..m {
            let at = |e: Error| {
                e.context(format!(
                    "reducer {k} of {m} (if it ended the group, its log says why)"
                ))
            };
            let (up, down) = self.g.reducers[k];
            let (g, t, ch, s) = (&self.g, self.tag, &self.chunks, &self.s);
            pump(
                &mut self.hdr[k],
                |_| true,
                // SAFETY: header k in the registered scratch, kept until done.
                |_| unsafe { send(up, hdr + k * Header::LEN, Header::LEN, HEADER_TAG, hmh) },
            )
            .map_err(at)?;
            let (sk, src) = (s.shards[k].0, s.p1_src[k]);
            pump(
                &mut self.p1_send[k],
                |_| true,
                |c| {
                    let c = ch[k][c];
                    // SAFETY: chunk c of shard k of NCCL's input, registered with smh.
                    unsafe { send(up, src + (c.off - sk), c.len, t[0], s.smh) }
                },
            )
            .map_err(at)?;
            let (dst, sent) = (s.p2_dst[k], &self.p1_send[k]);
            pump(
                &mut self.p2_recv[k],
                |c| !hazard || sent.done[c],
                |c| {
                    let c = ch[k][c];
                    // SAFETY: chunk c of shard k's place in NCCL's output, registered.
                    unsafe { recv(down, dst + (c.off - sk), c.len, t[1], s.p2_dst_mh) }
                },
            )
            .map_err(at)?;
            let whole = [Chunk {
                off: 0,
                len: Header::LEN,
            }];
            self.hdr[k].test(&whole, &AtomicU64::new(0)).map_err(at)?;
            self.p1_send[k].test(&ch[k], &g.sent).map_err(at)?;
            self.p2_recv[k].test(&ch[k], &g.received).map_err(at)?;
        }
        Ok((0..m).all(|k| {
            self.hdr[k].finished() && self.p1_send[k].finished() && self.p2_recv[k].finished()
        }))
    }

    /// One step: posts what may go, tests what is in flight, reduces what
    /// arrived. `true` once everything is done.
    fn step(&mut self) -> Result<bool> {
        if self.served {
            return self.step_served();
        }
        let n = self.g.nranks;
        let me = self.g.rank;
        let my0 = self.s.shards[me].0;
        if n == 1 {
            if self.kind != Kind::AllGather {
                let len = self.s.shards[0].1 - self.s.shards[0].0;
                if len > 0 && self.s.p1_src[0] != self.s.p1_out {
                    // SAFETY: NCCL's buffers of `len` bytes each (checked by
                    // the caller); `copy` allows them to overlap.
                    unsafe {
                        std::ptr::copy(self.s.p1_src[0] as *const u8, self.s.p1_out as *mut u8, len)
                    };
                }
            }
            return Ok(true);
        }
        let (scratch, scratch_mh) = (self.scratch.buf.as_mut_ptr() as usize, self.scratch.mh);
        for j in (0..n).filter(|&j| j != me) {
            let at = |e: Error| e.context(format!("rank {j} of {n}"));
            let (g, t, ch) = (&self.g, self.tag, &self.chunks);
            // Phase 1: shard j of my input to rank j; rank j's copy of my
            // shard into its scratch slot.
            let (sj, src) = (self.s.shards[j].0, self.s.p1_src[j]);
            pump(
                &mut self.p1_send[j],
                |_| true,
                |k| {
                    let c = ch[j][k];
                    // SAFETY: chunk k of shard j of NCCL's input, registered with smh.
                    unsafe { send(g.send[j], src + (c.off - sj), c.len, t[0], self.s.smh) }
                },
            )
            .map_err(at)?;
            let slot = scratch + j * (self.s.shards[me].1 - my0);
            pump(
                &mut self.p1_recv[j],
                |_| true,
                |k| {
                    let c = ch[me][k];
                    // SAFETY: rank j's slot of this request's registered scratch.
                    unsafe { recv(g.recv[j], slot + (c.off - my0), c.len, t[0], scratch_mh) }
                },
            )
            .map_err(at)?;
            self.p1_send[j].test(&ch[j], &g.sent).map_err(at)?;
            self.p1_recv[j].test(&ch[me], &g.received).map_err(at)?;
        }
        // Reduce, in order, the chunks of my shard whose contributions are all in.
        if self.kind != Kind::AllGather {
            while self.ready < self.chunks[me].len()
                && (0..n).all(|j| j == me || self.p1_recv[j].done[self.ready])
            {
                self.reduce_chunk(self.ready);
                self.ready += 1;
            }
        }
        for j in (0..n).filter(|&j| j != me) {
            let at = |e: Error| e.context(format!("rank {j} of {n}"));
            let (g, t, ch) = (&self.g, self.tag, &self.chunks);
            // Phase 2: my ready chunks to rank j; rank j's chunks into their
            // place, in place only once my phase-1 send of those bytes is done.
            let ready = self.ready;
            pump(
                &mut self.p2_send[j],
                |k| k < ready,
                |k| {
                    let c = ch[me][k];
                    // SAFETY: chunk k of my part of NCCL's buffer, registered.
                    unsafe {
                        send(
                            g.send[j],
                            self.s.p2_src + (c.off - my0),
                            c.len,
                            t[1],
                            self.s.p2_src_mh,
                        )
                    }
                },
            )
            .map_err(at)?;
            let (sj, dst, sent) = (self.s.shards[j].0, self.s.p2_dst[j], &self.p1_send[j]);
            let hazard = self.s.hazard;
            pump(
                &mut self.p2_recv[j],
                |k| !hazard || sent.done[k],
                |k| {
                    let c = ch[j][k];
                    // SAFETY: chunk k of shard j's place in NCCL's output, registered.
                    unsafe { recv(g.recv[j], dst + (c.off - sj), c.len, t[1], self.s.p2_dst_mh) }
                },
            )
            .map_err(at)?;
            self.p2_send[j].test(&ch[me], &g.sent).map_err(at)?;
            self.p2_recv[j].test(&ch[j], &g.received).map_err(at)?;
        }
        Ok(self.ready == self.chunks[me].len()
            && (0..n).all(|j| {
                self.p1_send[j].finished()
                    && self.p2_send[j].finished()
                    && self.p2_recv[j].finished()
            }))
    }

    /// Reduces chunk `c` of my shard over every rank's contribution, in
    /// rank order, into its output.
    fn reduce_chunk(&mut self, c: usize) {
        let me = self.g.rank;
        let ch = self.chunks[me][c];
        let shard_len = self.s.shards[me].1 - self.s.shards[me].0;
        let rel = ch.off - self.s.shards[me].0;
        let own = self.s.p1_src[me] + rel;
        let contribution = |k: usize, scratch: &[u8]| -> *const u8 {
            if k == me {
                own as *const u8
            } else {
                scratch[k * shard_len + rel..].as_ptr()
            }
        };
        let out = self.s.p1_out + rel;
        let len = ch.len;
        // Where to reduce: straight into the output when it holds
        // contribution 0 already (in place at rank 0) or overlaps no input;
        // else aside, in the scratch's last chunk, then copied out.
        let seeded = out == own && me == 0;
        let direct = seeded || out + len <= own || own + len <= out;
        let at = self.g.nranks * shard_len;
        let dst = if direct {
            out as *mut u8
        } else {
            self.scratch.buf[at..at + len].as_mut_ptr()
        };
        if !seeded {
            // SAFETY: `dst` is `len` bytes that overlap no contribution (the
            // output, checked apart, or the scratch's tail, apart from every
            // slot); contribution 0 is `len` bytes of NCCL's input or scratch.
            unsafe { std::ptr::copy_nonoverlapping(contribution(0, &self.scratch.buf), dst, len) };
        }
        for k in 1..self.g.nranks {
            // SAFETY: as above; `dst` and contribution `k` do not overlap.
            let (d, src) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dst, len),
                    std::slice::from_raw_parts(contribution(k, &self.scratch.buf), len),
                )
            };
            reduce::reduce(self.s.ty, self.s.op, d, src);
        }
        if !direct {
            // SAFETY: the output chunk lies inside NCCL's output buffer (which
            // may be the input: the contributions were read above).
            unsafe { std::ptr::copy_nonoverlapping(dst, out as *mut u8, len) };
        }
    }
}

impl Coll {
    /// After a failure: waits (up to `WEFT_PEER_TIMEOUT`) until every
    /// request still in flight is finished or failed, so that no provider
    /// writes into the scratch buffer after it is freed.
    fn abandon(&mut self) {
        let deadline = Instant::now() + core::peer_timeout().unwrap_or(Duration::from_secs(30));
        // A failed collective's scratch is never reused (a peer that broke
        // the protocol may still be writing); it is freed only if nothing
        // of the provider's is left in it.
        let mut clean = true;
        for s in self
            .p1_send
            .iter_mut()
            .chain(&mut self.p1_recv)
            .chain(&mut self.p2_send)
            .chain(&mut self.p2_recv)
            .chain(&mut self.hdr)
        {
            for (_, q) in s.inflight.drain(..) {
                while matches!(core::test(p(q)), Ok(None)) {
                    if Instant::now() > deadline {
                        clean = false;
                        break;
                    }
                    std::thread::yield_now();
                }
            }
        }
        if clean {
            let s = std::mem::take(&mut self.scratch);
            if s.mh != 0 {
                let _ = core::dereg_mr(std::ptr::null_mut(), p(s.mh));
            }
        }
        self.clean = false;
    }
}

impl Drop for Coll {
    fn drop(&mut self) {
        self.g.live.fetch_sub(1, Ordering::Relaxed);
        let s = std::mem::take(&mut self.scratch);
        if self.clean {
            self.g.give_back(s);
        } else {
            // The provider may still hold part of it: never reuse or free it.
            std::mem::forget(s);
        }
    }
}

/// Shards of `count` elements of `size` bytes over `n` ranks (balanced by
/// element), as byte ranges.
fn even_shards(count: usize, size: usize, n: usize) -> Vec<(usize, usize)> {
    (0..n)
        .map(|j| (count * j / n * size, count * (j + 1) / n * size))
        .collect()
}

/// Rank parts of `per_rank` bytes cut to the window `[off, off + len)`.
fn window_shards(n: usize, per_rank: usize, off: usize, len: usize) -> Vec<(usize, usize)> {
    (0..n)
        .map(|j| {
            let a = (j * per_rank).max(off);
            let b = ((j + 1) * per_rank).min(off + len);
            if a < b {
                (a, b)
            } else {
                (a.min(off + len), a.min(off + len))
            }
        })
        .collect()
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
    let served = !g.reducers.is_empty();
    let owners = if served { g.reducers.len() } else { g.nranks };
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
        p2_src_mh: rmh,
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
        smh,
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
        p2_src_mh: 0,
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
