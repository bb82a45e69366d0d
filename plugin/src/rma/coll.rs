//! One RMA collComm: every rank of the group, on the device's hub.
//!
//! **Channels.** For each rank `p` of the group (itself included) a
//! collComm registers one comm id on its device's hub: whatever `p` sends
//! it (control messages, writes with immediate) names that id, and its own
//! operations towards `p` carry it in their context, so one inbox holds
//! everything between this rank and `p`, and a write's immediate says which
//! rank wrote even where immediates are 4 bytes (verbs, EFA). `connect`
//! tells each rank its id in a `Hello` sent to that rank's listener (whose
//! handle NCCL all-gathered), with the listener's secret and this comm's
//! token; every later message must carry the token of its rank.
//!
//! **Puts** are `fi_writedata` from the hub's active endpoint into the
//! target's registration (cut into [`CHUNK`]-byte writes); the target
//! counts the writes that landed from each rank ([`super::order`]). **Signals** are control
//! messages carrying how many writes their sender had issued to the target
//! when it sent them (the bundled put included); the target applies a
//! signal (an add to a 64-bit value) only once that many writes from that
//! sender have landed, and applies one sender's signals in the order they
//! came. So a signal is never seen before the puts issued before it,
//! whatever order the fabric delivers writes and messages in (tcp and shm
//! give no write-before-message ordering). Where the target's provider
//! loses a write's remote CQ data (verbs;ofi_rxm with a shared receive
//! context) it says so in its `Hello`: puts to it are plain `fi_write`s,
//! nothing is counted there, and its signals wait for no count, because
//! such a device claims RMA only where the provider delivers a message
//! after the writes issued before it on the same connection
//! (`FI_ORDER_SAW`), and signals and puts share the hub's active endpoint.
//! This is NCCL's *strong* signal; weak signals get the same guarantee. **Gets** are `fi_read`. A put, get
//! or signal the provider cannot take now (`FI_EAGAIN`) waits in its peer's
//! queue and is posted at the next progress, in order: back-pressure is
//! never an error.
//!
//! **Registrations** are symmetric: `regMrSym` registers locally, sends
//! every rank a `Key` (its registration number in the collComm, address,
//! size, key) and waits for theirs. Every put, get and signal is checked
//! against the target's registered range before it is posted, and the
//! target checks a signal's offset again against its own.
//!
//! **A dead rank**: an operation towards a rank that has not completed
//! within `WEFT_PEER_TIMEOUT`, or that failed other than by the target
//! refusing that access ([`refused`]), declares that rank dead; its
//! requests fail, new ones to it fail at once, the other ranks go on.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::order::{Arrivals, Signal};
use super::wire::{Handle, Msg, MSG_MAX};
use crate::core::{DeviceState, Error, MemHandle, Result};
use crate::gpu::MemKind;
use crate::nccl::HANDLE_SIZE;
use crate::proto::ctrl::{frame_head, Peer, CTRL_HEAD};
use crate::proto::hub::{Ev, Hub, Inbox, Mail, Port};
use crate::proto::Mem;

/// The largest single write or read; larger puts and gets are cut.
pub const CHUNK: usize = 8 << 20;
/// The low 8 bits of an RMA write's immediate (the high 24 name the comm).
const IMM_TAG: u64 = 0x52;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A listener: a comm id on the device's hub that takes `Hello`s.
pub struct Listener {
    pub(super) dev: Arc<DeviceState>,
    hub: Arc<Hub>,
    id: u32,
    inbox: Arc<Inbox>,
    secret: u64,
}

impl Listener {
    /// Opens one on `dev` and writes its handle.
    pub fn open(dev: Arc<DeviceState>, out: &mut [u8; HANDLE_SIZE]) -> Result<Self> {
        let hub = dev.hub()?;
        let (id, inbox) = hub.register()?;
        let l = Self {
            secret: crate::proto::handshake::nonce(),
            hub,
            id,
            inbox,
            dev,
        };
        Handle {
            secret: l.secret,
            id,
            name: l.hub.name(Port::Passive).to_vec(),
        }
        .encode(out)
        .map_err(|e| Error::system(format!("RMA listen: {e}")))?;
        Ok(l)
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RMA Listener(device {}, id {:#x})", self.dev.index, self.id)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.hub.unregister(self.id);
    }
}

/// A request: parts still to complete (writes and reads in flight,
/// messages not yet sent) and its failure, if any.
#[derive(Debug, Default)]
pub struct Req {
    st: Mutex<ReqSt>,
}

#[derive(Debug, Default)]
struct ReqSt {
    pending: u32,
    err: Option<Error>,
}

impl Req {
    /// `Some(Ok)` once done, `Some(Err)` once failed, `None` while pending.
    pub fn state(&self) -> Option<Result<()>> {
        let s = lock(&self.st);
        match &s.err {
            Some(e) => Some(Err(e.clone())),
            None if s.pending == 0 => Some(Ok(())),
            None => None,
        }
    }
    fn add(&self) {
        lock(&self.st).pending += 1;
    }
    fn part_done(&self) {
        let mut s = lock(&self.st);
        s.pending = s.pending.saturating_sub(1);
    }
    fn fail(&self, e: Error) {
        let mut s = lock(&self.st);
        s.pending = s.pending.saturating_sub(1);
        s.err.get_or_insert(e);
    }
}

/// Where a rank's registration is, as it told the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote {
    addr: u64,
    len: u64,
    key: u64,
    base: u64,
}

/// A symmetric registration: the local handle and every rank's.
#[derive(Debug)]
pub struct Sym {
    /// The collComm's serial.
    pub coll: u64,
    seq: u32,
    mem: Mem,
    kind: MemKind,
    addr: usize,
    len: usize,
    remote: Vec<Remote>,
    /// Last: deregistered when the others are gone.
    _mh: MemHandle,
}

impl Sym {
    /// Checks `off..off+size` lies in rank `rank`'s range; the address
    /// and key to give the provider.
    fn target(&self, rank: usize, off: u64, size: usize, virt: bool, what: &str) -> Result<(u64, u64)> {
        let r = &self.remote[rank];
        let end = off.checked_add(size as u64);
        if end.is_none_or(|e| e > r.len) {
            return Err(Error::bad_buffer(format!(
                "RMA {what}: offset {off} + {size} bytes lies outside rank {rank}'s registration of {} bytes",
                r.len
            )));
        }
        let at = if virt { r.addr } else { r.addr - r.base };
        Ok((at + off, r.key))
    }
    /// Checks `off..off+size` lies in the local range; the address.
    fn local(&self, off: u64, size: usize, what: &str) -> Result<*mut u8> {
        let end = off.checked_add(size as u64);
        if end.is_none_or(|e| e > self.len as u64) {
            return Err(Error::bad_buffer(format!(
                "RMA {what}: local offset {off} + {size} bytes lies outside its registration of {} bytes",
                self.len
            )));
        }
        Ok((self.addr + off as usize) as *mut u8)
    }
}

/// Something waiting to be posted (the provider said `FI_EAGAIN`).
enum Work {
    Write { src: *const u8, len: usize, desc: *mut std::ffi::c_void, raddr: u64, key: u64 },
    Read { dst: *mut u8, len: usize, desc: *mut std::ffi::c_void, raddr: u64, key: u64 },
    Send { msg: [u8; CTRL_HEAD + MSG_MAX], len: usize },
}

/// A posted operation.
struct Op {
    req: Arc<Req>,
    since: Instant,
}

/// One rank of the group, as this rank sees it.
struct Rank {
    peer: Peer,
    name: String,
    /// This comm's id for what the rank sends here (and for its own
    /// operations towards the rank).
    id: u32,
    inbox: Arc<Inbox>,
    /// The rank's id for what this rank sends it, and its token.
    their_id: u32,
    their_token: u32,
    /// The rank's provider loses a write's remote CQ data (its `Hello`
    /// said so): writes to it carry none.
    announced: bool,
    /// Writes issued to the rank (posted or queued).
    issued: u64,
    /// The rank's writes landed here and its signals not yet applied.
    arrivals: Arrivals,
    queue: VecDeque<(Work, Arc<Req>)>,
    /// Since when the provider has refused every operation towards the
    /// rank for now (`FI_EAGAIN`; None once one is taken): a connection that
    /// never comes up (its process died before rxm connected to it) leaves
    /// work queued that no completion will ever time out.
    refused_since: Option<Instant>,
    inflight: HashMap<u32, Op>,
    next_op: u32,
    strangers: u64,
    dead: Option<String>,
}

struct State {
    ranks: Vec<Rank>,
    regs: HashMap<u32, Arc<Sym>>,
    next_seq: u32,
    /// Keys of registrations this rank has not made yet: seq -> per rank.
    keys: HashMap<u32, Vec<Option<Remote>>>,
    mail: Mail,
    last_error: Option<String>,
    /// When operations in flight were last checked against the timeout
    /// (every `WEFT_PEER_TIMEOUT / 8`, not on every call: the check walks
    /// all of them).
    scanned: Instant,
}

/// A connected collComm.
pub struct Coll {
    /// Its serial (NCCL's token names it).
    pub serial: u64,
    /// Its device.
    pub dev: Arc<DeviceState>,
    hub: Arc<Hub>,
    /// This rank and the group's size.
    pub rank: u32,
    nranks: u32,
    token: u32,
    virt: bool,
    st: Mutex<State>,
    /// Operations posted (for the log at close).
    posted: AtomicU64,
}

// SAFETY: the raw pointers in queued work are NCCL's registered buffers,
// only handed to libfabric under the state's lock; the descriptors are
// libfabric's, valid from any thread.
unsafe impl Send for Coll {}
// SAFETY: as for Send: all mutable state is behind the mutex.
unsafe impl Sync for Coll {}

impl Coll {
    /// `connect`: every rank's handle (`handles[r]`), this rank `rank`, its
    /// listener. Returns once every rank said `Hello`, or fails after
    /// `WEFT_PEER_TIMEOUT` without one, naming the ranks missing.
    pub fn connect(serial: u64, handles: &[Handle], rank: u32, l: &Listener) -> Result<Self> {
        let nranks = handles.len() as u32;
        if rank >= nranks {
            return Err(Error::internal(format!(
                "RMA connect: rank {rank} of {nranks}"
            )));
        }
        let hub = Arc::clone(&l.hub);
        let token = (crate::proto::handshake::nonce() as u32) | 1;
        let ep = hub.ep(Port::Active);
        let mut ranks = Vec::with_capacity(handles.len());
        for h in handles {
            let (id, inbox) = hub.register()?;
            let peer = Peer::insert(ep, &h.name).map_err(|e| {
                Error::from(e).context("RMA connect: a rank's address from its handle")
            });
            let peer = match peer {
                Ok(p) => p,
                Err(e) => {
                    hub.unregister(id);
                    for r in &ranks {
                        let r: &Rank = r;
                        hub.unregister(r.id);
                    }
                    return Err(e);
                }
            };
            ranks.push(Rank {
                peer,
                name: ep.av().straddr(&h.name),
                id,
                inbox,
                their_id: 0,
                their_token: 0,
                announced: false,
                issued: 0,
                arrivals: Arrivals::default(),
                queue: VecDeque::new(),
                refused_since: None,
                inflight: HashMap::new(),
                next_op: 0,
                strangers: 0,
                dead: None,
            });
        }
        let c = Self {
            serial,
            dev: Arc::clone(&l.dev),
            virt: l.dev.virt_addr(),
            hub,
            rank,
            nranks,
            token,
            st: Mutex::new(State {
                ranks,
                regs: HashMap::new(),
                next_seq: 0,
                keys: HashMap::new(),
                mail: Mail::default(),
                last_error: None,
                scanned: Instant::now(),
            }),
            posted: AtomicU64::new(0),
        };
        c.hello(handles, l)?;
        Ok(c)
    }

    /// This rank's provider loses a write's remote CQ data
    /// (`Rma::writes_announced`), so no write is counted here: a signal
    /// waits for no count, since it arrives after the writes its sender
    /// issued before it (the provider orders a message after a write,
    /// FI_ORDER_SAW, or the device would claim no RMA).
    fn announce(&self) -> bool {
        self.dev.dev.rma.writes_announced()
    }

    fn hello(&self, handles: &[Handle], l: &Listener) -> Result<()> {
        let mut unsent: Vec<usize> = (0..handles.len()).collect();
        let mut heard: Vec<Option<(u32, u32, bool)>> = vec![None; handles.len()];
        let mut mail = Mail::default();
        let deadline = Instant::now() + self.dev.peer_timeout;
        loop {
            {
                let st = lock(&self.st);
                let ep = self.hub.ep(Port::Active);
                let mut e = None;
                unsent.retain(|&p| {
                    let msg = Msg::Hello {
                        secret: handles[p].secret,
                        rank: self.rank,
                        nranks: self.nranks,
                        id: st.ranks[p].id,
                        token: self.token,
                        announce: self.announce(),
                    };
                    let (b, n) = framed(handles[p].id, self.token, &msg);
                    match st.ranks[p].peer.send("fi_inject", |a| ep.inject(&b[..n], a)) {
                        Ok(()) => false,
                        Err(x) if x.is_again() => true,
                        Err(x) => {
                            e.get_or_insert(x);
                            true
                        }
                    }
                });
                if let Some(x) = e {
                    return Err(Error::from(x).context("RMA connect: saying Hello"));
                }
            }
            self.hub.progress(Port::Active)?;
            self.hub.progress(Port::Passive)?;
            l.inbox.take(&mut mail);
            let _ = mail.drain(|ev, bytes| -> Result<()> {
                if let Ev::Ctrl { .. } = ev {
                    match Msg::decode(bytes) {
                        Ok(Msg::Hello { secret, rank, nranks, id, token, announce })
                            if secret == l.secret && nranks == self.nranks && rank < nranks && token != 0 =>
                        {
                            heard[rank as usize].get_or_insert((id, token, announce));
                        }
                        other => tracing::warn!(
                            "RMA connect: dropped a message to the listener that is no Hello of this group: {other:?}"
                        ),
                    }
                }
                Ok(())
            });
            if unsent.is_empty() && heard.iter().all(Option::is_some) {
                break;
            }
            if Instant::now() > deadline {
                let missing: Vec<String> = heard
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| h.is_none())
                    .map(|(r, _)| r.to_string())
                    .collect();
                return Err(Error::remote(format!(
                    "RMA connect (rank {} of {}): no Hello from rank(s) {} within WEFT_PEER_TIMEOUT = {:.1} s{}: \
                     those processes died, did not call connect, or cannot reach this one",
                    self.rank,
                    self.nranks,
                    missing.join(", "),
                    self.dev.peer_timeout.as_secs_f64(),
                    if unsent.is_empty() { "" } else { " (and not every Hello could be sent)" }
                )));
            }
            std::thread::yield_now();
        }
        let mut st = lock(&self.st);
        for (r, h) in st.ranks.iter_mut().zip(heard) {
            let (id, token, announced) = h.expect("all heard");
            r.their_id = id;
            r.their_token = token;
            r.announced = announced;
            r.inbox.expect(token);
        }
        let plain = st.ranks.iter().filter(|r| r.announced).count();
        if plain > 0 || self.announce() {
            tracing::info!(
                "RMA connect (rank {} of {}): puts to {plain} rank(s) as fi_write without CQ data (their provider loses it; each signal follows its puts on the same connection, FI_ORDER_SAW){}",
                self.rank,
                self.nranks,
                if self.announce() { "; signals here wait for no count of writes" } else { "" }
            );
        }
        Ok(())
    }

    /// `regMrSym`: registers `data..data+size` (a memory handle already
    /// made by the caller) and exchanges keys with every rank.
    pub fn register(&self, mh: MemHandle, data: *mut std::ffi::c_void, size: usize) -> Result<Arc<Sym>> {
        let (mem, kind) = mh.mem()?;
        let me = Remote {
            addr: data as u64,
            len: size as u64,
            key: mem.key,
            base: mem.base as u64,
        };
        let seq = {
            let mut st = lock(&self.st);
            let seq = st.next_seq;
            st.next_seq += 1;
            let msg = Msg::Key { seq, addr: me.addr, len: me.len, key: me.key, base: me.base };
            let nranks = self.nranks as usize;
            let keys = st.keys.entry(seq).or_insert_with(|| vec![None; nranks]);
            keys[self.rank as usize] = Some(me);
            for p in 0..nranks {
                if p != self.rank as usize {
                    let (b, n) = framed(st.ranks[p].their_id, self.token, &msg);
                    self.queue(&mut st, p, Work::Send { msg: b, len: n }, &Arc::new(Req::default()))?;
                }
            }
            seq
        };
        let deadline = Instant::now() + self.dev.peer_timeout;
        loop {
            {
                let mut st = lock(&self.st);
                self.progress_locked(&mut st)?;
                let done = st.keys.get(&seq).is_some_and(|k| k.iter().all(Option::is_some));
                if done {
                    let remote = st.keys.remove(&seq).expect("present").into_iter().flatten().collect();
                    let sym = Arc::new(Sym {
                        coll: self.serial,
                        seq,
                        mem,
                        kind,
                        addr: data as usize,
                        len: size,
                        remote,
                        _mh: mh,
                    });
                    st.regs.insert(seq, Arc::clone(&sym));
                    return Ok(sym);
                }
                if Instant::now() > deadline {
                    let missing: Vec<String> = st.keys[&seq]
                        .iter()
                        .enumerate()
                        .filter(|(_, k)| k.is_none())
                        .map(|(r, _)| r.to_string())
                        .collect();
                    st.keys.remove(&seq);
                    return Err(Error::remote(format!(
                        "RMA regMrSym (registration {seq}): no key from rank(s) {} within WEFT_PEER_TIMEOUT = {:.1} s: \
                         regMrSym is symmetric, every rank must call it in the same order",
                        missing.join(", "),
                        self.dev.peer_timeout.as_secs_f64()
                    )));
                }
            }
            std::thread::yield_now();
        }
    }

    /// `deregMrSym`: the registration goes (its handle deregisters once the
    /// last reference does).
    pub fn deregister(&self, sym: &Sym) {
        lock(&self.st).regs.remove(&sym.seq);
    }

    /// `iput` / `iputSignal`: `size` bytes at `src_off` of `src` to
    /// `dst_off` of rank `rank`'s `dst`, then (with `signal`) add `value`
    /// to the 64-bit value at `sig_off` of rank `rank`'s `sig`.
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &self,
        rank: u32,
        put: Option<(&Sym, u64, &Sym, u64, usize)>,
        signal: Option<(&Sym, u64, u64)>,
        req: &Arc<Req>,
    ) -> Result<()> {
        let p = self.rank_index(rank)?;
        // Every check before anything is posted: a refused call loses nothing.
        let data = match put {
            Some((src, src_off, dst, dst_off, size)) => {
                let from = src.local(src_off, size, "iput source")?;
                let (raddr, key) = dst.target(p, dst_off, size, self.virt, "iput destination")?;
                Some((from, src.mem.desc, raddr, key, size))
            }
            None => None,
        };
        let sig = match signal {
            Some((s, off, value)) => {
                s.target(p, off, 8, self.virt, "signal")?;
                Some((s.seq, off, value))
            }
            None => None,
        };
        let mut st = lock(&self.st);
        if let Some(why) = &st.ranks[p].dead {
            return Err(Error::remote(format!("RMA put to rank {rank}: {why}")));
        }
        if let Some((from, desc, raddr, key, size)) = data {
            for (at, len) in chunks(size) {
                // SAFETY: inside the source registration (checked above).
                let src = unsafe { from.add(at) };
                self.queue(&mut st, p, Work::Write { src, len, desc, raddr: raddr + at as u64, key }, req)?;
                // Counted once posted or queued: a signal waits only for writes that went.
                st.ranks[p].issued += 1;
            }
        }
        if let Some((seq, off, value)) = sig {
            let msg = Msg::Signal { puts: st.ranks[p].issued, seq, off, value };
            let (b, n) = framed(st.ranks[p].their_id, self.token, &msg);
            self.queue(&mut st, p, Work::Send { msg: b, len: n }, req)?;
        }
        Ok(())
    }

    /// `iget`: `size` bytes at `remote_off` of rank `rank`'s `remote` into
    /// `local_off` of `local`.
    pub fn get(
        &self,
        rank: u32,
        (remote, remote_off): (&Sym, u64),
        (local, local_off): (&Sym, u64),
        size: usize,
        req: &Arc<Req>,
    ) -> Result<()> {
        let p = self.rank_index(rank)?;
        let to = local.local(local_off, size, "iget destination")?;
        let (raddr, key) = remote.target(p, remote_off, size, self.virt, "iget source")?;
        let mut st = lock(&self.st);
        if let Some(why) = &st.ranks[p].dead {
            return Err(Error::remote(format!("RMA get from rank {rank}: {why}")));
        }
        for (at, len) in chunks(size) {
            // SAFETY: inside the local registration (checked above).
            let dst = unsafe { to.add(at) };
            self.queue(&mut st, p, Work::Read { dst, len, desc: local.mem.desc, raddr: raddr + at as u64, key }, req)?;
        }
        Ok(())
    }

    /// `iflush` of `sym`: gets already completed into it become visible
    /// (the driver's flush for GPU memory; host memory is visible already).
    pub fn flush(&self, sym: &Sym) -> Result<()> {
        if let MemKind::Cuda(dev) = sym.kind {
            let drv = crate::gpu::driver().map_err(|e| Error::system(e.to_string()))?;
            drv.flush(dev).map_err(|e| Error::system(format!("RMA iflush: {e}")))?;
        }
        Ok(())
    }

    /// `rmaProgress` / `test`: reads the hub, applies what arrived, posts
    /// what waits.
    pub fn progress(&self) -> Result<()> {
        let mut st = lock(&self.st);
        self.progress_locked(&mut st)
    }

    /// The group's size.
    pub fn nranks(&self) -> u32 {
        self.nranks
    }

    /// `queryLastError`: whether an operation failed or a rank died.
    pub fn last_error(&self) -> Option<String> {
        lock(&self.st).last_error.clone()
    }

    fn rank_index(&self, rank: u32) -> Result<usize> {
        if rank >= self.nranks {
            return Err(Error::usage(format!(
                "RMA: rank {rank} is not in the group of {} ranks",
                self.nranks
            )));
        }
        Ok(rank as usize)
    }

    /// Posts `w` for `req` towards rank `p`, or queues it behind what waits.
    fn queue(&self, st: &mut State, p: usize, w: Work, req: &Arc<Req>) -> Result<()> {
        req.add();
        let r = &mut st.ranks[p];
        if r.queue.is_empty() {
            match self.post(r, &w, req) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    req.part_done();
                    return Err(e);
                }
            }
        }
        r.queue.push_back((w, Arc::clone(req)));
        Ok(())
    }

    /// Posts one piece of work: `Ok(false)` if the provider wants it later.
    fn post(&self, r: &mut Rank, w: &Work, req: &Arc<Req>) -> Result<bool> {
        let ep = self.hub.ep(Port::Active);
        let local = r.next_op;
        let ctx = ((u64::from(r.id) << 32) | u64::from(local)) as usize as *mut std::ffi::c_void;
        let res = match *w {
            Work::Write { src, len, desc, raddr, key } => {
                let imm = (!r.announced).then_some((u64::from(r.their_id) << 8) | IMM_TAG);
                // SAFETY: NCCL's registered source, unchanged until the request
                // completes (iput's contract); the target range was checked.
                r.peer.send("fi_writedata", |a| unsafe { ep.writedata(src, len, desc, imm, a, raddr, key, ctx) })
            }
            Work::Read { dst, len, desc, raddr, key } => {
                // SAFETY: NCCL's registered destination, untouched until the
                // request completes (iget's contract); the source range was checked.
                r.peer.send("fi_read", |a| unsafe { ep.read(dst, len, desc, a, raddr, key, ctx) })
            }
            Work::Send { ref msg, len } => {
                return match r.peer.send("fi_inject", |a| ep.inject(&msg[..len], a)) {
                    Ok(()) => {
                        r.refused_since = None;
                        req.part_done();
                        Ok(true)
                    }
                    Err(e) if e.is_again() => {
                        r.refused_since.get_or_insert_with(Instant::now);
                        Ok(false)
                    }
                    Err(e) => Err(Error::from(e).context(format!("RMA: a message to {}", r.name))),
                };
            }
        };
        match res {
            Ok(()) => {
                r.refused_since = None;
                r.next_op = r.next_op.wrapping_add(1);
                r.inflight.insert(local, Op { req: Arc::clone(req), since: Instant::now() });
                self.posted.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) if e.is_again() => {
                r.refused_since.get_or_insert_with(Instant::now);
                Ok(false)
            }
            Err(e) => Err(Error::from(e).context(format!("RMA: an operation towards {}", r.name))),
        }
    }

    fn progress_locked(&self, st: &mut State) -> Result<()> {
        self.hub.progress(Port::Active)?;
        self.hub.progress(Port::Passive)?;
        let now = Instant::now();
        let timeout = self.dev.peer_timeout;
        let scan = now.saturating_duration_since(st.scanned) >= timeout / 8;
        if scan {
            st.scanned = now;
        }
        let State { ranks, regs, keys, mail, last_error, .. } = st;
        let announce = self.announce();
        for (p, r) in ranks.iter_mut().enumerate() {
            // What waits, in order, until the provider says "later".
            while let Some((w, req)) = r.queue.pop_front() {
                match self.post(r, &w, &req) {
                    Ok(true) => {}
                    Ok(false) => {
                        r.queue.push_front((w, req));
                        break;
                    }
                    Err(e) => {
                        last_error.get_or_insert(e.msg.clone());
                        req.fail(e);
                    }
                }
            }
            r.inbox.take(mail);
            let (their_token, nranks) = (r.their_token, self.nranks as usize);
            let mut gone = None;
            let _ = mail.drain(|ev, bytes| -> Result<()> {
                match ev {
                    Ev::Done(local, _) => {
                        if let Some(op) = r.inflight.remove(&local) {
                            op.req.part_done();
                        }
                    }
                    Ev::Failed(local, e) => {
                        if let Some(op) = r.inflight.remove(&local) {
                            let err = Error::remote(format!("RMA: an operation towards {} failed: {e}", r.name));
                            last_error.get_or_insert(err.msg.clone());
                            op.req.fail(err);
                            if !refused(e.err) {
                                gone.get_or_insert(format!(
                                    "rank {p} ({}) declared dead: an operation towards it failed: {e}",
                                    r.name
                                ));
                            }
                        }
                    }
                    Ev::Landed(tag, _) if u64::from(tag) == IMM_TAG => r.arrivals.landed(),
                    Ev::Landed(..) => r.strangers += 1,
                    Ev::Ctrl { token, .. } if token != their_token => r.strangers += 1,
                    Ev::Ctrl { .. } => match Msg::decode(bytes) {
                        // A rank declared dead applies nothing more here.
                        Ok(Msg::Signal { .. }) if r.dead.is_some() => r.strangers += 1,
                        Ok(Msg::Signal { puts, seq, off, value }) => {
                            let after = if announce { 0 } else { puts };
                            r.arrivals.signal(Signal { after, seq, off, value }, now)
                        }
                        Ok(Msg::Key { seq, addr, len, key, base }) => {
                            let k = keys.entry(seq).or_insert_with(|| vec![None; nranks]);
                            k[p] = Some(Remote { addr, len, key, base });
                        }
                        other => {
                            r.strangers += 1;
                            tracing::debug!("RMA: dropped {other:?} from rank {p}");
                        }
                    },
                }
                Ok(())
            });
            while let Some(Signal { seq, off, value, .. }) = r.arrivals.ready() {
                if let Err(e) = apply(regs.get(&seq), off, value) {
                    tracing::warn!("RMA: a signal from rank {p} ({}) was not applied: {e}", r.name);
                    last_error.get_or_insert(e.msg);
                }
            }
            if let (None, Some(why)) = (&r.dead, gone) {
                self.kill(r, why, last_error);
            }
            if let (None, Some((waited, lacking))) = (&r.dead, r.arrivals.stalled(now)) {
                if waited > timeout {
                    let why = format!(
                        "rank {p} ({}) declared dead: its signal waited {:.1} s (WEFT_PEER_TIMEOUT = {:.1} s) for {lacking} write(s) \
                         it issued before it that never landed here: this side's provider refused them (a key this rank \
                         deregistered or never gave: check that deregMrSym ran on every rank only after their last puts) \
                         or the rank's connection broke",
                        r.name,
                        waited.as_secs_f64(),
                        timeout.as_secs_f64()
                    );
                    self.kill(r, why, last_error);
                }
            }
            let stalled = scan && r.dead.is_none() && !r.queue.is_empty();
            if let Some(t) = r.refused_since.filter(|_| stalled) {
                let refused = now.saturating_duration_since(t);
                if refused > timeout {
                    let why = format!(
                        "rank {p} ({}) declared dead: the provider refused every operation towards it for {:.1} s                          (WEFT_PEER_TIMEOUT = {:.1} s): the connection to it does not come up (its process died,                          or the network is down)",
                        r.name,
                        refused.as_secs_f64(),
                        timeout.as_secs_f64()
                    );
                    self.kill(r, why, last_error);
                }
            }
            if scan && r.dead.is_none() {
                if let Some(op) = r.inflight.values().find(|o| now.saturating_duration_since(o.since) > timeout) {
                    let why = format!(
                        "rank {p} ({}) declared dead: an operation towards it did not complete within WEFT_PEER_TIMEOUT = {:.1} s (after {:.1} s)",
                        r.name,
                        timeout.as_secs_f64(),
                        now.saturating_duration_since(op.since).as_secs_f64()
                    );
                    self.kill(r, why, last_error);
                }
            }
        }
        Ok(())
    }

    /// Declares a rank dead: its requests fail, new ones fail at once.
    fn kill(&self, r: &mut Rank, why: String, last_error: &mut Option<String>) {
        let n = r.inflight.len() + r.queue.len();
        crate::proto::ctrl::warn_dead("RMA collComm: rank", &r.name, &why, n);
        for (_, op) in r.inflight.drain() {
            op.req.fail(Error::remote(why.clone()));
        }
        for (_, req) in r.queue.drain(..) {
            req.fail(Error::remote(why.clone()));
        }
        let held = r.arrivals.forget();
        if held > 0 {
            tracing::warn!("RMA collComm: {held} signal(s) from {} will not be applied: {why}", r.name);
        }
        last_error.get_or_insert(why.clone());
        r.dead = Some(why);
    }
}

impl std::fmt::Debug for Coll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RMA collComm(rank {} of {}, device {})", self.rank, self.nranks, self.dev.index)
    }
}

impl Drop for Coll {
    fn drop(&mut self) {
        let st = lock(&self.st);
        for r in &st.ranks {
            self.hub.unregister(r.id);
        }
        let strangers: u64 = st.ranks.iter().map(|r| r.strangers).sum();
        tracing::debug!(
            "RMA collComm rank {} of {} closed: {} operations posted, {strangers} message(s) dropped as not from their rank",
            self.rank,
            self.nranks,
            self.posted.load(Ordering::Relaxed)
        );
    }
}

/// The pieces `(offset, length)` a transfer of `size` bytes is cut into
/// (none for 0 bytes).
fn chunks(size: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..size).step_by(CHUNK).map(move |at| (at, (size - at).min(CHUNK)))
}

/// Whether a failed operation's error is the target refusing that one
/// access (a stale or forged key, a range it does not hold), after which
/// the rank is still there; any other error (a connection reset, an I/O
/// error) declares the rank dead.
fn refused(err: u32) -> bool {
    use libfabric_sys as fi;
    [fi::FI_EACCES, fi::FI_EINVAL, fi::FI_EFAULT, fi::FI_EKEYREJECTED, fi::FI_ETRUNC].contains(&err)
}

/// A control message to comm `id` from the comm with `token`, framed.
fn framed(id: u32, token: u32, msg: &Msg) -> ([u8; CTRL_HEAD + MSG_MAX], usize) {
    let mut b = [0u8; CTRL_HEAD + MSG_MAX];
    frame_head(&mut b, id, token);
    let body: &mut [u8; MSG_MAX] = (&mut b[CTRL_HEAD..]).try_into().expect("MSG_MAX bytes");
    let n = msg.encode(body);
    (b, CTRL_HEAD + n)
}

/// Applies a signal to this rank's registration `sym`: adds `value` to the
/// 64-bit value at `off`, checked against the range NCCL registered.
fn apply(sym: Option<&Arc<Sym>>, off: u64, value: u64) -> Result<()> {
    let sym = sym.ok_or_else(|| Error::remote("its registration is not (or no longer) registered here"))?;
    let at = sym.local(off, 8, "signal")?;
    if at as usize % 8 != 0 {
        return Err(Error::remote(format!("signal offset {off} is not 8-byte aligned")));
    }
    match sym.kind {
        MemKind::Host => {
            // SAFETY: 8 aligned bytes inside NCCL's live registration
            // (checked above); NCCL reads signals atomically, and every
            // write to them is an atomic add, here.
            let a = unsafe { AtomicU64::from_ptr(at.cast()) };
            a.fetch_add(value, Ordering::SeqCst);
        }
        MemKind::Cuda(dev) => {
            let drv = crate::gpu::driver().map_err(|e| Error::system(e.to_string()))?;
            // SAFETY: 8 bytes inside NCCL's live device registration.
            unsafe { drv.add_u64(dev, at.cast(), value) }.map_err(Error::system)?;
        }
    }
    Ok(())
}
