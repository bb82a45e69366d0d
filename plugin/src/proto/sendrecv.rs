//! The SENDRECV protocol: NCCL messages as libfabric tagged messages.
//!
//! **Endpoints.** Every comm has an endpoint, CQ and AV of its own, on the
//! device's shared domain (so registrations are valid on every comm of a
//! device). A listener's endpoint only receives handshake messages.
//!
//! **Handshake** (never blocks; `connect`/`accept` are polled):
//! 1. `connect` opens its endpoint S, posts control receives, and injects
//!    `Conn{listener nonce, conn nonce, S}` to the listener L.
//! 2. `accept` reads the Conn, opens the receive endpoint R and injects
//!    `Ack{conn nonce, credits, R}` from R to S.
//! 3. `connect` reads the Ack and injects `Alive` from S to R; data then
//!    flows S -> R. `accept` hands R to NCCL once something from S arrived,
//!    so a connecting peer that dies mid-handshake is an error, not a comm
//!    that never receives.
//!
//! Each pair of endpoints is connected by one side only (S->L, then R->S; S
//! only sends to R after R's Ack arrived over that connection), so the
//! simultaneous-connect livelock of tcp;ofi_rxm (libfabric #9052) cannot occur.
//!
//! **Tags.** Data uses NCCL's tag (32 bits) as the libfabric tag, so grouped
//! receives match by tag and, per tag, in posting order (FIFO per comm).
//! Control messages set bit 63, which data tags never do.
//!
//! **Credits.** A sender may have at most `credits` messages that the receiver
//! has not yet matched (320: 32 requests x 8 receives, plus one return batch);
//! the receiver returns them in batches of 64 as its receives complete. So however fast a sender runs,
//! the receiver's provider buffers at most `credits` unexpected messages per
//! comm (rxm buffers each unexpected eager message, up to 16 KiB). An `isend`
//! without credit returns a NULL request, as NCCL allows.
//!
//! **Liveness.** Both ends of a connected pair inject `Alive` every
//! heartbeat period (`WEFT_PEER_TIMEOUT` / 8), from the plugin's keeper
//! thread, so a peer that is alive but busy elsewhere (not calling into the
//! plugin) still answers. Anything received from the peer counts as a sign of
//! life. A peer silent for `WEFT_PEER_TIMEOUT` minus one period is declared
//! dead: every request in flight on the comm fails (`test` returns a remote
//! error naming the peer), posted operations are cancelled, and the comm
//! refuses new ones. A hard error from the provider when sending the
//! heartbeat (connection refused or reset) declares it dead at once. Request
//! age plays no part: a receive may wait for hours on a live peer.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::mpsc::{Receiver as Rx, Sender as Tx};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use libfabric_sys as fi;

use super::pool::{Pool, SLOT_ALIGN};
use super::wire::{Ctrl, ListenHandle, CTRL_MAX};
use super::{
    heartbeat_period, Comm, DeviceState, Done, Listener, Protocol, Receiver, RecvBuf, ReqId,
    Sender, MAX_RECVS, MAX_REQUESTS,
};
use crate::error::{Error, Result};
use crate::fabric::local::{self, LocalEp, Locality};
use crate::fabric::DomainRegistrar;
use crate::fabric::{Completion, CompletionError, Cq, CqError, Endpoint, FiAddr, FiError};
use crate::freelist::{Elem, Freelist, HostPages, Params};

/// Tag bit reserved for control messages.
pub const CTRL_TAG: u64 = 1 << 63;
/// Credits are returned once this many are owed.
pub const CREDIT_BATCH: u32 = 64;
/// Messages a sender may have unmatched at the receiver: NCCL's most in
/// flight on a send comm (32 requests x 8 receives), plus one batch, since up
/// to a batch less one may be owed but not yet returned.
pub const CREDITS: u32 = (MAX_REQUESTS * MAX_RECVS) as u32 + CREDIT_BATCH;
/// Control receives kept posted per endpoint.
const CTRL_POSTED: usize = 4;
/// Completions read per `fi_cq_read`.
const CQ_BATCH: usize = 16;
/// `ReqErr::fi_err` of requests failed because their peer died.
const PEER_DEAD: u32 = 0;
/// Handshakes a listener keeps pending at once. NCCL connects one peer to
/// each listener; more are tolerated, and beyond this a new `Conn` evicts the
/// oldest pending handshake (with a warning), so forged ones cannot grow a
/// listener. A real peer confirms within a round trip of its Ack, and its
/// connect repeats `Conn` every heartbeat period until answered, so a flood
/// delays it rather than locking it out.
pub const MAX_PENDING: usize = 4;
/// Connection nonces a listener remembers as accepted (a late repeat of their
/// `Conn` is ignored).
const ACCEPTED_MEMORY: usize = 16;
/// How often a comm's lock is tried before the keeper skips it for a tick.
const KEEPER_TRIES: u32 = 64;

/// The SENDRECV protocol.
#[derive(Debug, Clone, Copy)]
pub struct SendRecv;

impl Protocol for SendRecv {
    fn name(&self) -> &'static str {
        "sendrecv"
    }
    fn listen(&self, dev: Arc<DeviceState>) -> Result<(Arc<dyn Listener>, ListenHandle)> {
        let (l, h) = ListenComm::open(dev)?;
        Ok((Arc::new(l), h))
    }
    fn connect(
        &self,
        dev: Arc<DeviceState>,
        handle: &ListenHandle,
        traffic_class: i32,
    ) -> Result<Arc<dyn Sender>> {
        Ok(Arc::new(SendComm::start(dev, handle, traffic_class)?))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A comm's state for a data-path call (`isend`, `irecv`, `test`), or `None`
/// while another thread holds it: the call then answers "not yet" (a NULL
/// request, not done) instead of waiting, so NCCL's progress thread never
/// blocks behind the keeper, even one stuck inside the provider.
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// The keeper's way in: a few tries, then the comm is skipped for this tick
/// (NCCL's thread is using it, and what it does keeps the peer informed).
fn keeper_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    for _ in 0..KEEPER_TRIES {
        if let Some(g) = try_lock(m) {
            return Some(g);
        }
        std::thread::yield_now();
    }
    None
}

/// A random 64-bit nonce from the kernel.
pub fn nonce() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        // Fall back on time and address entropy; nonces only need to differ.
        let t = Instant::now().elapsed().as_nanos() as u64 ^ (std::process::id() as u64) << 32;
        return t ^ (&b as *const _ as u64);
    }
    u64::from_le_bytes(b)
}

/// One endpoint with its CQ and AV on a device's domain.
fn open_endpoint(dev: &DeviceState) -> Result<Endpoint> {
    Ok(Endpoint::open_own(&dev.domain)?)
}

/// Registered buffers kept posted for control messages.
struct CtrlBufs {
    list: Freelist<HostPages, DomainRegistrar>,
    posted: Vec<Elem>,
    /// Buffers the provider refused to take back for now (FI_EAGAIN),
    /// reposted at the next progress.
    unposted: Vec<usize>,
}

impl CtrlBufs {
    fn new(dev: &DeviceState, ep: &Endpoint) -> Result<Self> {
        let mut list = Freelist::new(
            HostPages,
            DomainRegistrar(Arc::clone(&dev.domain)),
            Params {
                elem_size: CTRL_MAX,
                align: SLOT_ALIGN,
                elems_per_block: CTRL_POSTED,
                max_elems: CTRL_POSTED,
            },
        )
        .map_err(|e| Error::system(e.to_string()))?;
        let mut posted = Vec::with_capacity(CTRL_POSTED);
        for _ in 0..CTRL_POSTED {
            posted.push(list.alloc().map_err(|e| Error::system(e.to_string()))?);
        }
        let mut me = Self {
            list,
            posted,
            unposted: Vec::new(),
        };
        for i in 0..CTRL_POSTED {
            me.repost(ep, i)?;
        }
        Ok(me)
    }

    /// Posts buffer `i` again; when the provider says "not now" it is kept
    /// for [`CtrlBufs::repost_waiting`] (a retryable condition is no error).
    fn repost(&mut self, ep: &Endpoint, i: usize) -> Result<()> {
        match self.post(ep, i) {
            Err(e) if e.is_again() => {
                self.unposted.push(i);
                Ok(())
            }
            r => r.map_err(Error::from),
        }
    }

    /// Retries the buffers that could not be posted yet.
    fn repost_waiting(&mut self, ep: &Endpoint) -> Result<()> {
        for i in std::mem::take(&mut self.unposted) {
            self.repost(ep, i)?;
        }
        Ok(())
    }

    fn post(&self, ep: &Endpoint, i: usize) -> std::result::Result<(), FiError> {
        let e = &self.posted[i];
        let desc = e.mr.map_or(std::ptr::null_mut(), |m| m.desc);
        // SAFETY: the buffer is CTRL_MAX bytes of registered memory owned by
        // this list, which outlives the endpoint (fields drop ep first); the
        // context is the buffer's own address.
        unsafe {
            ep.trecv(
                e.ptr.as_ptr(),
                CTRL_MAX,
                desc,
                fi::FI_ADDR_UNSPEC,
                CTRL_TAG,
                0,
                e.ptr.as_ptr().cast(),
            )
        }
    }

    /// Which posted buffer a completion context names.
    fn find(&self, ctx: *mut c_void) -> Option<usize> {
        self.posted
            .iter()
            .position(|e| e.ptr.as_ptr().cast() == ctx)
    }

    fn bytes(&self, i: usize, len: usize) -> &[u8] {
        // SAFETY: the buffer is CTRL_MAX bytes; the provider finished writing
        // `len` of them when it reported the completion.
        unsafe { std::slice::from_raw_parts(self.posted[i].ptr.as_ptr(), len.min(CTRL_MAX)) }
    }
}

impl Drop for CtrlBufs {
    fn drop(&mut self) {
        for e in self.posted.drain(..) {
            self.list.free(e);
        }
    }
}

/// A peer endpoint: its address in a comm's AV and, when it lives in this
/// process, its record there (see [`crate::fabric::local`]).
struct Peer {
    addr: FiAddr,
    local: Option<Arc<LocalEp>>,
}

impl Peer {
    const NONE: Peer = Peer {
        addr: fi::FI_ADDR_NOTAVAIL,
        local: None,
    };

    /// Inserts a peer's endpoint name into `ep`'s AV. The name was checked
    /// against the domain's address format by the AV; an endpoint of this
    /// process that is already closed is refused.
    fn insert(ep: &Endpoint, name: &[u8]) -> std::result::Result<Self, FiError> {
        let local = match local::locate(name) {
            Locality::Closed => return Err(closed_peer("fi_av_insert")),
            Locality::Local(l) => Some(l),
            Locality::Remote => None,
        };
        Ok(Self {
            addr: ep.av().insert(name)?,
            local,
        })
    }

    /// Runs a send to this peer. A peer in this process is kept open while
    /// it runs; a closed one is an error, never a send (shm crashes on those).
    fn send(
        &self,
        call: &'static str,
        f: impl FnOnce(FiAddr) -> std::result::Result<(), FiError>,
    ) -> std::result::Result<(), FiError> {
        match &self.local {
            None => f(self.addr),
            Some(l) => {
                let _open = l.open_guard().ok_or_else(|| closed_peer(call))?;
                f(self.addr)
            }
        }
    }
}

fn closed_peer(call: &'static str) -> FiError {
    FiError {
        call,
        code: fi::FI_ENOTCONN,
        text: "the peer endpoint, in this same process, was closed".to_owned(),
    }
}

/// Injects a control message.
fn send_ctrl(ep: &Endpoint, to: &Peer, msg: &Ctrl) -> std::result::Result<(), FiError> {
    let mut b = [0u8; CTRL_MAX];
    let n = msg.encode(&mut b);
    to.send("fi_tinject", |a| ep.tinject(&b[..n], a, CTRL_TAG))
}

/// A comm's view of its peer: where it is and whether it still answers.
struct Link {
    /// The peer.
    peer: Peer,
    /// The peer's address in words, for log lines and errors.
    name: String,
    /// Something arrived from the peer since the keeper last looked (set on
    /// the data path, where reading the clock would cost).
    heard: bool,
    /// When the keeper last saw `heard` (or the link was made).
    last_heard: Instant,
    /// When this end last sent `Alive` (None: due now).
    last_said: Option<Instant>,
    /// Why the peer was declared dead.
    dead: Option<String>,
}

impl Link {
    fn new() -> Self {
        Self {
            peer: Peer::NONE,
            name: "(not connected)".to_owned(),
            heard: false,
            last_heard: Instant::now(),
            last_said: None,
            dead: None,
        }
    }

    /// Records the peer's endpoint name; its life is counted from now.
    fn connect(&mut self, ep: &Endpoint, name: &[u8]) -> std::result::Result<(), FiError> {
        self.peer = Peer::insert(ep, name)?;
        self.name = ep.av().straddr(name);
        self.last_heard = Instant::now();
        Ok(())
    }

    /// An error if the peer was declared dead.
    fn check(&self) -> Result<()> {
        match &self.dead {
            Some(why) => Err(Error::remote(why.clone())),
            None => Ok(()),
        }
    }
}

/// The parts of a connected comm's state the liveness logic needs.
trait Side {
    /// "send comm to" or "receive comm from", for log lines.
    const WHAT: &'static str;
    /// "send" or "receive", for errors about requests.
    const KIND: &'static str;
    /// True once the link has a peer.
    fn linked(&self) -> bool;
    /// The endpoint, requests and link, borrowed together.
    fn parts(&mut self) -> (&mut Endpoint, &mut Pool<Request>, &mut Link);
    /// Reads the CQ and applies what it holds.
    fn progress(&mut self) -> Result<()>;
}

/// Declares the peer dead: closes the comm's endpoint, then fails every
/// request in flight, and logs one WARN naming the peer.
///
/// The endpoint is closed first so that a request is reported failed only
/// when the provider owns none of its buffers any more: NCCL may free or
/// reuse them as soon as `test` says so. (Cancelling would not do: rxm cannot
/// cancel a send, and a send to a hung peer may never complete.)
fn die<S: Side>(st: &mut S, why: String) {
    let (ep, reqs, link) = st.parts();
    if link.dead.is_some() {
        return;
    }
    ep.shutdown();
    let mut failed = 0;
    let live: Vec<u32> = reqs.live().collect();
    for i in live {
        let Some(r) = reqs.get_mut(i) else { continue };
        if r.remaining == 0 {
            continue;
        }
        if r.err.is_none() {
            r.err = Some(ReqErr {
                fi_err: PEER_DEAD,
                len: 0,
                olen: 0,
                tag: 0,
                sub: 0,
            });
        }
        r.remaining = 0;
        failed += 1;
    }
    tracing::warn!(
        "{} {}: {why}; {failed} request(s) in flight failed, and the comm takes no new ones. \
         Check that process (its log, the OOM killer, the node); raise WEFT_PEER_TIMEOUT if it was only slow",
        S::WHAT,
        link.name
    );
    link.dead = Some(why);
}

/// One heartbeat tick of a comm (from the keeper thread): says `Alive`
/// when due, makes progress, and declares the peer dead after
/// `timeout - period` of silence.
fn keepalive<S: Side>(st: &mut S, timeout: Duration, now: Instant) {
    if !st.linked() {
        return;
    }
    let period = heartbeat_period(timeout);
    let (ep, _, link) = st.parts();
    if link.dead.is_some() {
        return;
    }
    if link
        .last_said
        .is_none_or(|t| now.saturating_duration_since(t) >= period)
    {
        match send_ctrl(ep, &link.peer, &Ctrl::Alive) {
            Ok(()) => link.last_said = Some(now),
            Err(e) if e.is_again() => {}
            Err(e) => {
                return die(
                    st,
                    format!("the provider reports the connection to the peer broken ({e})"),
                )
            }
        }
    }
    if let Err(e) = st.progress() {
        return die(st, format!("progress failed: {e}"));
    }
    let (_, _, link) = st.parts();
    if std::mem::take(&mut link.heard) {
        link.last_heard = now;
    }
    let silent = now.saturating_duration_since(link.last_heard);
    if silent + period >= timeout {
        die(
            st,
            format!(
                "peer silent for {:.1} s (WEFT_PEER_TIMEOUT = {:.1} s): its process died, hangs, or the network is down",
                silent.as_secs_f64(),
                timeout.as_secs_f64()
            ),
        );
    }
}

/// What happened to one sub-operation that failed.
#[derive(Debug, Clone, Copy)]
struct ReqErr {
    fi_err: u32,
    len: usize,
    olen: usize,
    tag: u64,
    sub: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Recv,
}

/// A request in a comm's pool; its address is the handle NCCL tests.
#[derive(Debug, Clone, Copy)]
struct Request {
    kind: Kind,
    n: u8,
    remaining: u8,
    sizes: [usize; MAX_RECVS],
    bufs: [RecvBuf; MAX_RECVS],
    err: Option<ReqErr>,
}

const NO_BUF: RecvBuf = RecvBuf {
    data: std::ptr::null_mut(),
    size: 0,
    tag: 0,
    desc: std::ptr::null_mut(),
    phandle: std::ptr::null_mut(),
};

fn decode_ctx(ctx: *mut c_void) -> (*const u8, u8) {
    let a = ctx as usize;
    (
        (a & !(SLOT_ALIGN - 1)) as *const u8,
        (a & (SLOT_ALIGN - 1)) as u8,
    )
}

/// Turns a failed sub-operation into the error `test` reports.
fn req_error(kind: Kind, e: ReqErr, capacity: usize, link: &Link) -> Error {
    let peer = &link.name;
    if e.fi_err == PEER_DEAD {
        return Error::remote(format!(
            "peer {peer} declared dead: {}",
            link.dead.as_deref().unwrap_or("no reason recorded")
        ));
    }
    let what = if kind == Kind::Send {
        "send"
    } else {
        "receive"
    };
    if e.fi_err == fi::FI_ETRUNC {
        let tag = e.tag as u32 as i32;
        // Providers differ in what they report (shm gives no lengths).
        let sent = if e.olen > 0 {
            format!("{} bytes", e.len + e.olen)
        } else {
            "more bytes than fit".to_owned()
        };
        let msg = format!(
            "message truncated: the {peer} sent {sent} with tag {tag} into receive buffer {} of {capacity} bytes; \
             NCCL never sends more than the receiver posted, so both ranks must run the same NCCL",
            e.sub
        );
        tracing::warn!("{msg}");
        return Error::internal(msg);
    }
    let msg = format!(
        "{what} to/from peer {peer} failed: {} (fi errno {})",
        crate::fabric::strerror(e.fi_err),
        e.fi_err
    );
    tracing::warn!("{msg}");
    Error::remote(msg)
}

fn completion_err(e: &CompletionError) -> ReqErr {
    ReqErr {
        fi_err: e.err,
        len: e.len,
        olen: e.olen,
        tag: e.tag,
        sub: 0,
    }
}

/// One entry of a completion queue.
enum Event<'a> {
    /// An operation finished.
    Done(&'a Completion),
    /// An operation failed.
    Failed(CompletionError),
}

/// What [`drain`] reads: a CQ (or, in tests, a scripted queue).
trait CqSource {
    fn read(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError>;
}

impl CqSource for Cq {
    fn read(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
        Cq::read(self, out)
    }
}

/// Reads `cq` until it is empty, handing every entry to `on`. Reading is
/// also what drives progress for rxm and shm, and on tcp every read is a
/// `poll` system call: a read that returns fewer entries than asked for
/// emptied the queue, so it is the last. Every completion read is applied
/// even when one of them fails (a completion read is gone from the queue);
/// the first error is returned after the batch.
fn drain(cq: &(impl CqSource + ?Sized), mut on: impl FnMut(Event<'_>) -> Result<()>) -> Result<()> {
    let mut c = [Completion::default(); CQ_BATCH];
    let mut first_err = None;
    let mut keep = |r: Result<()>| {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    };
    loop {
        match cq.read(&mut c) {
            Ok(0) => break,
            Ok(n) => {
                for comp in &c[..n] {
                    keep(on(Event::Done(comp)));
                }
                if n < c.len() {
                    break;
                }
            }
            Err(CqError::Completion(e)) => keep(on(Event::Failed(e))),
            Err(CqError::Fi(e)) => {
                keep(Err(e.into()));
                break;
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Applies one completion, or failure, to the request its context names.
/// `len` is recorded for receives (a send's size is known when it is posted).
fn complete(
    reqs: &mut Pool<Request>,
    ctx: *mut c_void,
    outcome: std::result::Result<Option<usize>, ReqErr>,
    who: &str,
) -> Result<()> {
    let (slot, sub) = decode_ctx(ctx);
    let r = reqs
        .index_of(slot)
        .and_then(|i| reqs.get_mut(i))
        .filter(|r| sub < r.n)
        .ok_or_else(|| Error::system(format!("{who}: completion for an unknown request")))?;
    match outcome {
        Ok(Some(len)) => r.sizes[usize::from(sub)] = len,
        Ok(None) => {}
        Err(e) => {
            if r.err.is_none() {
                r.err = Some(ReqErr { sub, ..e });
            }
        }
    }
    r.remaining = r.remaining.saturating_sub(1);
    Ok(())
}

// ---------------------------------------------------------------- listen

/// A listening comm.
pub struct ListenComm {
    pub(crate) dev: Arc<DeviceState>,
    nonce: u64,
    inner: Mutex<ListenState>,
}

/// A connection being accepted.
struct Pending {
    comm: Arc<RecvComm>,
    /// The connecting side's nonce (a repeated `Conn` is ignored).
    conn: u64,
    /// The Ack, until it is sent; then the connecting side's first word is awaited.
    ack: Option<Ctrl>,
    deadline: Instant,
}

struct ListenState {
    // Field order is drop order: the endpoint closes before its buffers go.
    ep: Endpoint,
    ctrl: CtrlBufs,
    /// Oldest first.
    pending: Vec<Pending>,
    /// Recently accepted connection nonces, oldest first.
    accepted: VecDeque<u64>,
    /// Why the last handshake failed, reported by `accept` once nothing
    /// else is pending.
    failed: Option<String>,
}

impl std::fmt::Debug for ListenComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ListenComm(dev {})", self.dev.index)
    }
}

impl ListenComm {
    /// Opens a listener on `dev` and returns it with its handle.
    pub fn open(dev: Arc<DeviceState>) -> Result<(Self, ListenHandle)> {
        let ep = open_endpoint(&dev)?;
        let ctrl = CtrlBufs::new(&dev, &ep)?;
        let handle = ListenHandle {
            nonce: nonce(),
            addr: ep.name()?,
        };
        Ok((
            Self {
                dev,
                nonce: handle.nonce,
                inner: Mutex::new(ListenState {
                    ep,
                    ctrl,
                    pending: Vec::new(),
                    accepted: VecDeque::new(),
                    failed: None,
                }),
            },
            handle,
        ))
    }

    /// Handles one handshake message: a valid Conn opens a receive comm
    /// whose Ack is sent by `accept`; anything else is logged and dropped.
    fn on_conn(&self, st: &mut ListenState, comp: &Completion) -> Result<()> {
        let Some(i) = st.ctrl.find(comp.op_context) else {
            return Err(Error::internal(
                "listener: completion for an unknown buffer",
            ));
        };
        let msg = Ctrl::decode(st.ctrl.bytes(i, comp.len));
        st.ctrl.repost(&st.ep, i)?;
        let dev = self.dev.index;
        match msg {
            Ok(Ctrl::Conn { listener, conn, addr }) if listener == self.nonce => {
                if st.pending.iter().any(|p| p.conn == conn) || st.accepted.contains(&conn) {
                    tracing::debug!("listener on device {dev}: ignored a repeated Conn");
                    return Ok(());
                }
                if let Some(check) = self.dev.domain.check_addr(&addr).err() {
                    tracing::warn!(
                        "listener on device {dev}: dropped a connection request with an unusable address: {check}"
                    );
                    return Ok(());
                }
                if st.pending.len() >= MAX_PENDING {
                    st.pending.remove(0);
                    tracing::warn!(
                        "listener on device {dev}: {MAX_PENDING} handshakes pending; dropped the oldest for a new one \
                         (NCCL connects one peer per listener: is something sending forged connection requests?)"
                    );
                }
                let comm = Arc::new(RecvComm::open(Arc::clone(&self.dev))?);
                let name = {
                    let rs = &mut *lock(&comm.inner);
                    if let Err(e) = rs.link.connect(&rs.ep, &addr) {
                        tracing::warn!(
                            "listener on device {dev}: dropped a connection request with an unusable address: {e}"
                        );
                        return Ok(());
                    }
                    rs.ep.name()?
                };
                st.pending.push(Pending {
                    comm,
                    conn,
                    ack: Some(Ctrl::Ack { conn, credits: CREDITS, addr: name }),
                    deadline: Instant::now() + self.dev.peer_timeout,
                });
            }
            Ok(Ctrl::Conn { listener, .. }) => tracing::warn!(
                "listener on device {dev}: ignored a connection meant for listener {listener:#x} (stale handle?)"
            ),
            Ok(other) => tracing::warn!("listener: ignored unexpected control message {other:?}"),
            Err(e) => tracing::warn!(
                "listener on device {dev}: ignored a bad handshake message: {e}"
            ),
        }
        Ok(())
    }

    /// One step of pending handshake `p`: `Ok(true)` once its peer
    /// confirmed, `Err` (with the reason) when it failed or expired.
    fn step_pending(&self, p: &mut Pending, now: Instant) -> std::result::Result<bool, String> {
        let rs = &mut *lock(&p.comm.inner);
        if let Some(ack) = &p.ack {
            match send_ctrl(&rs.ep, &rs.link.peer, ack) {
                Ok(()) => p.ack = None,
                Err(e) if e.is_again() => {}
                Err(e) => {
                    return Err(format!(
                        "accept: cannot answer the connecting peer {}: {e}",
                        rs.link.name
                    ))
                }
            }
        }
        // Let the new endpoint make progress on its connection.
        rs.progress()
            .map_err(|e| format!("accept: handshake with {} failed: {e}", rs.link.name))?;
        let answered = p.ack.is_none();
        if answered && rs.link.heard {
            return Ok(true);
        }
        if now > p.deadline {
            let stage = if answered {
                "never confirmed the connection"
            } else {
                "could not be answered"
            };
            return Err(format!(
                "accept: the connecting peer {} {stage} within {:.1} s (WEFT_PEER_TIMEOUT): its process died or hangs",
                rs.link.name,
                self.dev.peer_timeout.as_secs_f64()
            ));
        }
        Ok(false)
    }

    /// One accept step: a receive comm when a connection is complete. A
    /// handshake that fails or expires is dropped with a warning, and the
    /// others carry on; `accept` reports the failure only when nothing else
    /// is pending (NCCL connects one peer per listener, so that peer died).
    fn accept_comm(&self) -> Result<Option<Arc<RecvComm>>> {
        let mut st = lock(&self.inner);
        let st = &mut *st;
        st.ctrl.repost_waiting(&st.ep)?;
        let cq = Arc::clone(st.ep.cq());
        drain(&*cq, |ev| match ev {
            Event::Done(comp) => self.on_conn(st, comp),
            Event::Failed(e) => {
                // A control receive failed (e.g. an oversized message):
                // nothing of ours is lost; repost and carry on.
                tracing::warn!(
                    "listener on device {}: dropped a bad handshake message: {e}",
                    self.dev.index
                );
                match st.ctrl.find(e.context) {
                    Some(i) => st.ctrl.repost(&st.ep, i),
                    None => Ok(()),
                }
            }
        })?;
        let now = Instant::now();
        let mut i = 0;
        while i < st.pending.len() {
            match self.step_pending(&mut st.pending[i], now) {
                Ok(true) => {
                    let p = st.pending.remove(i);
                    st.accepted.push_back(p.conn);
                    if st.accepted.len() > ACCEPTED_MEMORY {
                        st.accepted.pop_front();
                    }
                    return Ok(Some(p.comm));
                }
                Ok(false) => i += 1,
                Err(why) => {
                    tracing::warn!("{why}");
                    st.pending.remove(i);
                    st.failed = Some(why);
                }
            }
        }
        match st.failed.take() {
            Some(why) if st.pending.is_empty() => Err(Error::remote(why)),
            _ => Ok(None),
        }
    }
}

impl Listener for ListenComm {
    fn accept(&self) -> Result<Option<Arc<dyn Receiver>>> {
        Ok(self.accept_comm()?.map(|c| -> Arc<dyn Receiver> { c }))
    }
}

// ---------------------------------------------------------------- send

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    SendConn,
    AwaitAck,
    Ready,
}

/// A sending comm (also the state of a `connect` in progress).
pub struct SendComm {
    pub(crate) dev: Arc<DeviceState>,
    /// NCCL's traffic class for this connection (-1: undefined). Kept; no
    /// provider in use here applies one.
    pub traffic_class: i32,
    /// The nonce of the listener it connects to (from NCCL's handle).
    listener_nonce: u64,
    inner: Mutex<SendState>,
}

struct SendState {
    ep: Endpoint,
    ctrl: CtrlBufs,
    reqs: Pool<Request>,
    phase: Phase,
    listener: Peer,
    listener_nonce: u64,
    conn: u64,
    link: Link,
    credits: u32,
    max_credits: u32,
    deadline: Instant,
    /// When `Conn` was last sent (it is repeated every heartbeat period
    /// until the Ack comes).
    conn_sent: Option<Instant>,
    eager: usize,
}

impl std::fmt::Debug for SendComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SendComm(dev {})", self.dev.index)
    }
}

impl SendComm {
    /// Starts connecting to the listener named by `handle`.
    pub fn start(dev: Arc<DeviceState>, handle: &ListenHandle, traffic_class: i32) -> Result<Self> {
        let ep = open_endpoint(&dev)?;
        let ctrl = CtrlBufs::new(&dev, &ep)?;
        let listener = Peer::insert(&ep, &handle.addr).map_err(|e| {
            if e.code == fi::FI_ENOTCONN {
                Error::remote(format!("connect: the listener is gone: {e}"))
            } else {
                Error::internal(format!("the handle's listener address is unusable: {e}"))
            }
        })?;
        let reqs = Pool::new(MAX_REQUESTS * MAX_RECVS).map_err(|e| Error::system(e.to_string()))?;
        let eager = dev.eager_size.min(dev.dev.inject_size);
        let deadline = Instant::now() + dev.peer_timeout;
        Ok(Self {
            dev,
            traffic_class,
            listener_nonce: handle.nonce,
            inner: Mutex::new(SendState {
                ep,
                ctrl,
                reqs,
                phase: Phase::SendConn,
                listener,
                listener_nonce: handle.nonce,
                conn: nonce(),
                link: Link::new(),
                credits: 0,
                max_credits: 0,
                deadline,
                conn_sent: None,
                eager,
            }),
        })
    }
}

impl Sender for SendComm {
    fn listener_nonce(&self) -> u64 {
        self.listener_nonce
    }

    fn step_connect(&self) -> Result<bool> {
        let mut st = lock(&self.inner);
        let now = Instant::now();
        let resend = st.phase == Phase::AwaitAck
            && st.conn_sent.is_some_and(|t| {
                now.saturating_duration_since(t) >= heartbeat_period(self.dev.peer_timeout)
            });
        if st.phase == Phase::SendConn || resend {
            let msg = Ctrl::Conn {
                listener: st.listener_nonce,
                conn: st.conn,
                addr: st.ep.name()?,
            };
            match send_ctrl(&st.ep, &st.listener, &msg) {
                Ok(()) => {
                    st.phase = Phase::AwaitAck;
                    st.conn_sent = Some(now);
                }
                Err(e) if e.is_again() => {}
                Err(e) => {
                    return Err(Error::remote(format!(
                        "connect: cannot reach the listener: {e}"
                    )))
                }
            }
        }
        st.progress()?;
        if st.phase == Phase::Ready {
            return Ok(true);
        }
        if Instant::now() > st.deadline {
            return Err(Error::remote(format!(
                "connect: no answer from the listener within {:.1} s (WEFT_PEER_TIMEOUT): is the peer process alive and using the same Weft?",
                self.dev.peer_timeout.as_secs_f64()
            )));
        }
        Ok(false)
    }

    /// `Ok(None)` when out of credits or requests, or while another
    /// thread holds the comm.
    unsafe fn isend(
        &self,
        data: *const u8,
        size: usize,
        tag: i32,
        desc: *mut c_void,
        phandle: *mut c_void,
    ) -> Result<Option<ReqId>> {
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        if st.phase != Phase::Ready {
            return Err(Error::internal(
                "isend on a comm whose connect has not finished",
            ));
        }
        st.link.check()?;
        if st.credits == 0 {
            st.progress()?;
            if st.credits == 0 {
                return Ok(None);
            }
        }
        let mut req = Request {
            kind: Kind::Send,
            n: 1,
            remaining: 1,
            sizes: [0; MAX_RECVS],
            bufs: [NO_BUF; MAX_RECVS],
            err: None,
        };
        req.sizes[0] = size;
        req.bufs[0] = RecvBuf {
            data: data.cast_mut(),
            size,
            tag,
            desc,
            phandle,
        };
        let inject = size <= st.eager;
        if inject {
            req.remaining = 0;
        }
        let Some((ptr, idx)) = st.reqs.insert(req) else {
            st.progress()?;
            return Ok(None);
        };
        let tag = u64::from(tag as u32);
        let SendState { ep, link, .. } = &*st;
        let posted = if inject {
            // SAFETY: NCCL guarantees `data..data+size` is readable (checked
            // against its registration by the caller); fi_tinject copies it now.
            let bytes = unsafe { std::slice::from_raw_parts(data, size) };
            link.peer.send("fi_tinject", |a| ep.tinject(bytes, a, tag))
        } else {
            link.peer.send("fi_tsend", |a| {
                // SAFETY: the buffer stays valid until NCCL sees the request
                // done, which is after its completion; ptr is this request's slot.
                unsafe { ep.tsend(data, size, desc, a, tag, ptr.as_ptr().cast()) }
            })
        };
        match posted {
            Ok(()) => {
                st.credits -= 1;
                Ok(Some(ReqId {
                    slot: idx,
                    gen: st.reqs.gen(idx),
                }))
            }
            Err(e) => {
                st.reqs.release(idx);
                if e.is_again() {
                    st.progress()?;
                    Ok(None)
                } else {
                    Err(Error::remote(format!("isend of {size} bytes failed: {e}")))
                }
            }
        }
    }
}

impl Comm for SendComm {
    fn dev(&self) -> &Arc<DeviceState> {
        &self.dev
    }
    fn test(&self, id: ReqId) -> Result<Option<Done>> {
        test_locked(&self.inner, id)
    }
    fn keepalive(&self, now: Instant) {
        keepalive_locked(&self.inner, self.dev.peer_timeout, now);
    }
    fn peer_name(&self) -> String {
        lock(&self.inner).link.name.clone()
    }
    fn hold(&self, held: &Tx<()>, release: &Rx<()>) {
        hold(&self.inner, held, release);
    }
    fn endpoint_open(&self) -> bool {
        !lock(&self.inner).ep.is_shut_down()
    }
}

impl Side for SendState {
    const WHAT: &'static str = "send comm to";
    const KIND: &'static str = "send";
    fn linked(&self) -> bool {
        self.phase == Phase::Ready
    }
    fn parts(&mut self) -> (&mut Endpoint, &mut Pool<Request>, &mut Link) {
        (&mut self.ep, &mut self.reqs, &mut self.link)
    }
    fn progress(&mut self) -> Result<()> {
        SendState::progress(self)
    }
}

impl SendState {
    fn progress(&mut self) -> Result<()> {
        self.ctrl.repost_waiting(&self.ep)?;
        let cq = Arc::clone(self.ep.cq());
        drain(&*cq, |ev| match ev {
            Event::Done(c) if c.flags & u64::from(fi::FI_RECV) != 0 => {
                self.link.heard = true;
                self.on_ctrl(c)
            }
            Event::Done(c) => complete(&mut self.reqs, c.op_context, Ok(None), "send comm"),
            Event::Failed(e) => match self.ctrl.find(e.context) {
                Some(i) => {
                    tracing::warn!("send comm: dropped a bad control message: {e}");
                    self.ctrl.repost(&self.ep, i)
                }
                None => complete(
                    &mut self.reqs,
                    e.context,
                    Err(completion_err(&e)),
                    "send comm",
                ),
            },
        })
    }

    fn on_ctrl(&mut self, comp: &Completion) -> Result<()> {
        let Some(i) = self.ctrl.find(comp.op_context) else {
            return Err(Error::system(
                "send comm: completion for an unknown control buffer",
            ));
        };
        let msg = Ctrl::decode(self.ctrl.bytes(i, comp.len));
        self.ctrl.repost(&self.ep, i)?;
        match msg {
            Ok(Ctrl::Credit { count }) if self.phase == Phase::Ready => {
                // A peer can never grant more than it announced.
                self.credits = self.credits.saturating_add(count).min(self.max_credits);
            }
            Ok(Ctrl::Alive) => {}
            Ok(Ctrl::Ack {
                conn,
                credits,
                addr,
            }) if self.phase == Phase::AwaitAck && conn == self.conn => {
                if let Err(e) = self.link.connect(&self.ep, &addr) {
                    tracing::warn!("send comm: ignored an Ack with an unusable address: {e}");
                    return Ok(());
                }
                self.max_credits = credits.clamp(1, CREDITS);
                self.credits = self.max_credits;
                self.phase = Phase::Ready;
                // The first Alive confirms the connection to `accept`; when
                // the provider is busy the keeper sends it on its next tick.
                match send_ctrl(&self.ep, &self.link.peer, &Ctrl::Alive) {
                    Ok(()) => self.link.last_said = Some(Instant::now()),
                    Err(e) if e.is_again() => {}
                    Err(e) => {
                        return Err(Error::remote(format!(
                            "connect: cannot reach the accepting peer {}: {e}",
                            self.link.name
                        )))
                    }
                }
            }
            Ok(other) => tracing::warn!("send comm: ignored unexpected control message {other:?}"),
            Err(e) => tracing::warn!("send comm: ignored a bad control message: {e}"),
        }
        Ok(())
    }
}

/// Holds a comm's state lock until `release` fires (or its sender goes),
/// signalling `held` once it is held: what a keeper stuck inside the
/// provider does. For tests of the data path's independence.
fn hold<S>(m: &Mutex<S>, held: &Tx<()>, release: &Rx<()>) {
    let _st = lock(m);
    let _ = held.send(());
    let _ = release.recv();
}

/// `test` through a comm's state lock: "not done" while another thread
/// holds it.
fn test_locked<S: Side>(m: &Mutex<S>, id: ReqId) -> Result<Option<Done>> {
    match try_lock(m) {
        Some(mut st) => test_side(&mut *st, id),
        None => Ok(None),
    }
}

/// A heartbeat tick through a comm's state lock; skipped while busy.
fn keepalive_locked<S: Side>(m: &Mutex<S>, timeout: Duration, now: Instant) {
    if let Some(mut st) = keeper_lock(m) {
        keepalive(&mut *st, timeout, now);
    }
}

/// `test` on a comm of either side. The CQ is read only while the request
/// is unfinished (an injected send is done when posted; a receive may have
/// been completed by an earlier read), and never once the peer is dead.
fn test_side<S: Side>(st: &mut S, id: ReqId) -> Result<Option<Done>> {
    let (_, reqs, link) = st.parts();
    let unfinished = test_request(reqs, id, S::KIND)?;
    if unfinished && link.dead.is_none() {
        st.progress()?;
    }
    let (_, reqs, link) = st.parts();
    finish(reqs, id.slot, link)
}

/// Checks that request `id` is live in `reqs` and of the slot's current
/// generation (a request NCCL still holds, not an earlier one of the same
/// slot); returns whether it is still unfinished.
fn test_request(reqs: &mut Pool<Request>, id: ReqId, what: &str) -> Result<bool> {
    let current = reqs.is_current(id.slot, id.gen);
    reqs.get_mut(id.slot)
        .filter(|_| current)
        .map(|r| r.remaining > 0)
        .ok_or_else(|| {
            Error::internal(format!(
                "test: not a live {what} request (already completed and reported, or a stale pointer)"
            ))
        })
}

/// Completes request `i` if it is done: frees it and returns its sizes or error.
/// `i` was validated by `test_request`; progress never frees a request.
fn finish(reqs: &mut Pool<Request>, i: u32, link: &Link) -> Result<Option<Done>> {
    let r = reqs
        .get_mut(i)
        .ok_or_else(|| Error::internal("test: the request was freed during progress"))?;
    if r.remaining > 0 {
        return Ok(None);
    }
    // Copy out only what the answer needs: a request is a few hundred bytes.
    let (kind, err, done) = (
        r.kind,
        r.err,
        Done {
            n: usize::from(r.n),
            sizes: r.sizes,
        },
    );
    let cap = err.map_or(0, |e| r.bufs[usize::from(e.sub) % MAX_RECVS].size);
    reqs.release(i);
    match err {
        Some(e) => Err(req_error(kind, e, cap, link)),
        None => Ok(Some(done)),
    }
}

// ---------------------------------------------------------------- recv

/// A receiving comm.
pub struct RecvComm {
    pub(crate) dev: Arc<DeviceState>,
    inner: Mutex<RecvState>,
}

struct RecvState {
    // Field order is drop order: the endpoint closes before its buffers go.
    ep: Endpoint,
    ctrl: CtrlBufs,
    reqs: Pool<Request>,
    link: Link,
    /// Sub-receives not yet posted (FI_EAGAIN), in order.
    to_post: VecDeque<(u32, u8)>,
    owed: u32,
}

impl std::fmt::Debug for RecvComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecvComm(dev {})", self.dev.index)
    }
}

impl RecvComm {
    fn open(dev: Arc<DeviceState>) -> Result<Self> {
        let ep = open_endpoint(&dev)?;
        let ctrl = CtrlBufs::new(&dev, &ep)?;
        let reqs = Pool::new(MAX_REQUESTS).map_err(|e| Error::system(e.to_string()))?;
        Ok(Self {
            dev,
            inner: Mutex::new(RecvState {
                ep,
                ctrl,
                reqs,
                link: Link::new(),
                to_post: VecDeque::with_capacity(MAX_REQUESTS * MAX_RECVS),
                owed: 0,
            }),
        })
    }
}

impl Receiver for RecvComm {
    /// `Ok(None)` when all requests are in use, or while another thread
    /// holds the comm.
    unsafe fn irecv(&self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(Error::internal(format!(
                "irecv with n = {}: must be 1 ..= {MAX_RECVS} (maxRecvs)",
                bufs.len()
            )));
        }
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        st.link.check()?;
        let mut req = Request {
            kind: Kind::Recv,
            n: bufs.len() as u8,
            remaining: bufs.len() as u8,
            sizes: [0; MAX_RECVS],
            bufs: [NO_BUF; MAX_RECVS],
            err: None,
        };
        req.bufs[..bufs.len()].copy_from_slice(bufs);
        let Some((ptr, idx)) = st.reqs.insert(req) else {
            st.progress()?;
            return Ok(None);
        };
        // Post straight away unless earlier receives wait (posting order is
        // matching order); what the provider refuses for now waits in order.
        // No progress here: NCCL tests the request next, and every read of
        // the CQ costs a system call on tcp.
        let mut post_all = || -> Result<()> {
            let mut first_waiting = 0;
            if st.to_post.is_empty() {
                while first_waiting < bufs.len()
                    && st.post(&bufs[first_waiting], ptr.as_ptr(), first_waiting)?
                {
                    first_waiting += 1;
                }
            }
            for sub in first_waiting..bufs.len() {
                st.to_post.push_back((idx, sub as u8));
            }
            st.post_pending()
        };
        if let Err(e) = post_all() {
            // A hard provider error, possibly part way through a grouped
            // receive: the comm cannot go on. Closing its endpoint takes back
            // what was posted; this request, which NCCL never sees, is freed.
            die(&mut *st, format!("posting a receive failed: {e}"));
            st.reqs.release(idx);
            return Err(e);
        }
        Ok(Some(ReqId {
            slot: idx,
            gen: st.reqs.gen(idx),
        }))
    }
}

impl Comm for RecvComm {
    fn dev(&self) -> &Arc<DeviceState> {
        &self.dev
    }
    fn test(&self, id: ReqId) -> Result<Option<Done>> {
        test_locked(&self.inner, id)
    }
    fn keepalive(&self, now: Instant) {
        keepalive_locked(&self.inner, self.dev.peer_timeout, now);
    }
    fn peer_name(&self) -> String {
        lock(&self.inner).link.name.clone()
    }
    fn hold(&self, held: &Tx<()>, release: &Rx<()>) {
        hold(&self.inner, held, release);
    }
    fn endpoint_open(&self) -> bool {
        !lock(&self.inner).ep.is_shut_down()
    }
}

impl Side for RecvState {
    const WHAT: &'static str = "receive comm from";
    const KIND: &'static str = "receive";
    fn linked(&self) -> bool {
        self.link.peer.addr != fi::FI_ADDR_NOTAVAIL
    }
    fn parts(&mut self) -> (&mut Endpoint, &mut Pool<Request>, &mut Link) {
        (&mut self.ep, &mut self.reqs, &mut self.link)
    }
    fn progress(&mut self) -> Result<()> {
        RecvState::progress(self)
    }
}

impl RecvState {
    /// Posts sub-receive `sub` of the request in `slot`: `Ok(false)` when
    /// the provider says "not now" (FI_EAGAIN).
    fn post(&self, b: &RecvBuf, slot: *mut Request, sub: usize) -> Result<bool> {
        let ctx = (slot as usize + sub) as *mut c_void;
        // SAFETY: NCCL keeps the buffer valid until the request completes;
        // the context names this request's slot and sub-receive.
        let posted = unsafe {
            self.ep.trecv(
                b.data,
                b.size,
                b.desc,
                self.link.peer.addr,
                u64::from(b.tag as u32),
                0,
                ctx,
            )
        };
        match posted {
            Ok(()) => Ok(true),
            Err(e) if e.is_again() => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Posts the sub-receives that had to wait, in order.
    fn post_pending(&mut self) -> Result<()> {
        while let Some(&(idx, sub)) = self.to_post.front() {
            let (Some(slot), Some(b)) = (
                self.reqs.ptr(idx),
                self.reqs.get_mut(idx).map(|r| r.bufs[usize::from(sub)]),
            ) else {
                self.to_post.pop_front();
                continue;
            };
            if !self.post(&b, slot.as_ptr(), usize::from(sub))? {
                return Ok(());
            }
            self.to_post.pop_front();
        }
        Ok(())
    }

    fn progress(&mut self) -> Result<()> {
        self.ctrl.repost_waiting(&self.ep)?;
        let Self {
            ep,
            ctrl,
            reqs,
            link,
            owed,
            ..
        } = self;
        drain(&**ep.cq(), |ev| match ev {
            Event::Done(c) => {
                link.heard = true;
                if let Some(i) = ctrl.find(c.op_context) {
                    return recv_ctrl(ctrl, ep, i, c.len);
                }
                // Every matched message, delivered or failed, frees a credit.
                *owed += 1;
                complete(reqs, c.op_context, Ok(Some(c.len)), "receive comm")
            }
            Event::Failed(e) => {
                if let Some(i) = ctrl.find(e.context) {
                    tracing::warn!("receive comm: dropped a bad control message: {e}");
                    return ctrl.repost(ep, i);
                }
                *owed += 1;
                complete(reqs, e.context, Err(completion_err(&e)), "receive comm")
            }
        })?;
        self.post_pending()?;
        if self.owed >= CREDIT_BATCH {
            match send_ctrl(
                &self.ep,
                &self.link.peer,
                &Ctrl::Credit { count: self.owed },
            ) {
                Ok(()) => self.owed = 0,
                Err(e) if e.is_again() => {}
                Err(e) => {
                    return Err(Error::remote(format!(
                        "returning credits to the sender failed: {e}"
                    )))
                }
            }
        }
        Ok(())
    }
}

/// A control message to a receive comm: only `Alive` is expected.
fn recv_ctrl(ctrl: &mut CtrlBufs, ep: &Endpoint, i: usize, len: usize) -> Result<()> {
    let msg = Ctrl::decode(ctrl.bytes(i, len));
    ctrl.repost(ep, i)?;
    match msg {
        Ok(Ctrl::Alive) => {}
        Ok(other) => tracing::warn!("receive comm: ignored unexpected control message {other:?}"),
        Err(e) => tracing::warn!("receive comm: ignored a bad control message: {e}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Hands out a scripted sequence of reads.
    struct Script(RefCell<VecDeque<std::result::Result<Vec<usize>, CqError>>>);

    impl CqSource for Script {
        fn read(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
            match self.0.borrow_mut().pop_front() {
                None => Ok(0),
                Some(Err(e)) => Err(e),
                Some(Ok(ids)) => {
                    for (o, id) in out.iter_mut().zip(&ids) {
                        o.op_context = *id as *mut c_void;
                    }
                    Ok(ids.len().min(out.len()))
                }
            }
        }
    }

    /// A failure while applying one completion of a batch does not drop
    /// the others already read: all are applied, then the first error is
    /// returned.
    #[test]
    fn drain_applies_the_whole_batch_before_failing() {
        let full: Vec<usize> = (1..=CQ_BATCH).collect();
        let cq = Script(RefCell::new(
            [Ok(full), Ok(vec![100, 101])].into_iter().collect(),
        ));
        let mut seen = Vec::new();
        let r = drain(&cq, |ev| {
            let Event::Done(c) = ev else { unreachable!() };
            let id = c.op_context as usize;
            seen.push(id);
            if id == 2 || id == 100 {
                Err(Error::system(format!("bad {id}")))
            } else {
                Ok(())
            }
        });
        let mut want: Vec<usize> = (1..=CQ_BATCH).collect();
        want.extend([100, 101]);
        assert_eq!(seen, want, "every completion read was applied");
        assert!(
            r.unwrap_err().msg.contains("bad 2"),
            "the first error is returned"
        );
    }
}
