//! Endpoints that belong to a device, not to a comm: the hub.
//!
//! A device's hub has two endpoints, each with its CQ and AV:
//! - the **passive** one, where listeners and receive comms live: peers
//!   connect to it and write into its comms' buffers;
//! - the **active** one, where send comms live: it only ever contacts
//!   passive endpoints.
//!
//! So every pair of endpoints is connected by one side only, whatever the
//! comms between two processes, and the simultaneous-connect livelock of
//! tcp;ofi_rxm (libfabric #9052) cannot occur. A comm is an id on its
//! endpoint (24 bits) and an [`Inbox`]: control messages (untagged) carry
//! the id in their first bytes, tagged data messages in bits 32..56 of their
//! tag ([`data_tag`]), operations carry it in their context's high 32 bits, and
//! remote writes in their immediate's high 24 bits.
//!
//! **Who sent it.** An id only says which comm a message is for; anyone
//! who reaches the endpoint can name any id. So the hub hands each comm,
//! with every control message and write it delivers, where it came from:
//! the source address the provider reports (`FI_SOURCE`, read with
//! `fi_cq_readfrom`) and the sending comm's token (see [`super::ctrl`]).
//! The comm drops whatever is not from its peer. A write names its buffer
//! in its immediate, and libfabric 1.17's rxm reports no source for a
//! write (measured: the first address of the AV, whoever wrote); so the
//! receiver checks the immediate against the offer instead: its size is
//! XORed with a random ticket the offer carried ([`immediate`]), and the
//! data itself can only land with the buffer's key, which only the peer it
//! was offered to has.
//! The hub itself recognises its own posted control buffers before anything
//! else, so a message with remote CQ data (which Weft never sends) cannot
//! pass for a write, and a buffer it took is always posted again. Where the
//! protocol takes nothing tagged (rdma) it also keeps sink receives posted
//! that drop any tagged message ([`SINK_POSTED`]).
//!
//! **Progress.** Whichever thread calls [`Hub::progress`] first reads the
//! CQ for everyone: it takes the port's poll lock with `try_lock` (a thread
//! that finds it taken goes on: the holder is delivering its completions
//! too), reads whole batches, and appends each completion to its comm's
//! inbox. A comm applies its inbox under its own lock. No lock is held while
//! another is waited for, so NCCL's proxy threads, each driving its own
//! comms, and the keeper never block one another.

#![forbid(unsafe_code)]

use std::collections::HashMap;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use libfabric_sys as fi;

use super::cq::{drain, Event};
use super::ctrl::{unframe, Bounce, CtrlBufs, Peer, Posts, CTRL_HEAD};
use super::grave::{is_grave, Closed, Graves, Returned};
use super::wire::{CTRL_MAX, EAGER_HEAD, MAX_ID};
use super::DeviceState;
use crate::error::{Error, Result};
use crate::fabric::{Completion, CompletionError, Endpoint, FiAddr};

/// Control receives kept posted per endpoint of a hub.
///
/// shm on libfabric 1.17 lost tagged messages that arrived while all 64
/// posted receives were taken (measured: 128 of 256 small messages never
/// completed); control traffic is kept small (sizes ride in the immediate
/// where the provider gives 8 bytes) and well inside this.
const CTRL_POSTED: usize = 256;
/// CQ entries per hub endpoint: a shared CQ must hold what all its comms
/// have in flight until some thread reads it.
const CQ_SIZE: usize = 16384;
/// Sink receives kept posted per endpoint where the protocol takes nothing
/// tagged, and their size: rxm's eager messages (16 KiB buffers) fit whole,
/// so none is truncated (a truncated eager receive wedges rxm's connection,
/// ofiwg/libfabric #8274); larger ones arrive by rendezvous and are
/// truncated into it. Not on shm: libfabric 1.17's shm never completes a
/// truncated tagged receive above 4 KiB (its `fi_cq_read` spins), and shm
/// keeps a large unexpected message at its sender, not here.
const SINK_POSTED: usize = 8;
const SINK_SIZE: usize = 16 << 10;
/// Bounce buffers an active endpoint sends eager messages from where they
/// are too large to inject (at most [`super::comms::EAGER_CREDITS`] per send
/// comm are unconsumed at their receivers; these are only those whose send
/// the provider has not completed yet), grown in blocks of
/// [`BOUNCE_BLOCK`].
const BOUNCE_MAX: usize = 256;
const BOUNCE_BLOCK: usize = 32;
/// What rxm's header takes of its eager buffer
/// (`FI_OFI_RXM_BUFFER_SIZE`), with room to spare: an eager message stays
/// this far under rxm's eager limit, so rxm never sends it as a rendezvous.
const RXM_HEADROOM: usize = 256;

/// Which endpoint of the hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    /// Listeners and receive comms.
    Passive = 0,
    /// Send comms.
    Active = 1,
}

/// What the hub delivers to a comm.
#[derive(Debug)]
pub enum Ev {
    /// A control message: the sending comm's token, the source address,
    /// and where its bytes are in the [`Mail`] it came in.
    Ctrl {
        /// The token in its header.
        token: u32,
        /// Where it came from (`FI_ADDR_NOTAVAIL`: a source not in the AV).
        src: FiAddr,
        /// The message's bytes: `Mail::bytes[at.0 .. at.0 + at.1]`.
        at: (u32, u32),
    },
    /// An operation the comm posted finished: the low 32 bits of its
    /// context, and the length (of a received message).
    Done(u32, usize),
    /// An operation the comm posted failed.
    Failed(u32, CompletionError),
    /// A peer's write with immediate landed: the immediate's low 8 bits,
    /// and its upper 32 bits where the hub has wide immediates (the size
    /// XOR the offer's ticket: [`immediate_size`]). Writes carry no source
    /// a comm could check: rxm reports none for them.
    Landed(u8, Option<u32>),
}

/// The local context [`Ev::Failed`] names when an eager message sent from
/// a bounce buffer failed (a comm's own contexts are request slots).
pub const EAGER_LOCAL: u32 = u32::MAX;

/// Events an inbox holds unread before it takes no more control messages
/// (its comm's peer, or a listener's callers, sent far more than the
/// protocol has in flight: credits bound data and offers, one `Alive` waits
/// at most). What is dropped beyond it is counted for the comm.
pub const INBOX_MAX: usize = 4096;

/// What an inbox delivered: its events in arrival order and, in one buffer,
/// the bytes of their control messages. A comm keeps one and swaps it with
/// its inbox's on every read ([`Inbox::take`]), so after the first messages
/// neither side allocates: the two buffers keep their capacity.
#[derive(Debug, Default)]
pub struct Mail {
    events: Vec<Ev>,
    bytes: Vec<u8>,
}

impl Mail {
    /// Hands each event, with its control message's bytes (empty for the
    /// others), to `f` in arrival order, and empties the mail. An error
    /// from `f` stops there: the rest is dropped.
    pub fn drain<E>(
        &mut self,
        mut f: impl FnMut(Ev, &[u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let Self { events, bytes } = self;
        let r = events.drain(..).try_for_each(|ev| {
            let b = match ev {
                Ev::Ctrl { at: (at, len), .. } => &bytes[at as usize..(at + len) as usize],
                _ => &[][..],
            };
            f(ev, b)
        });
        bytes.clear();
        r
    }
    fn push(&mut self, ev: Ev, bytes: &[u8]) {
        let ev = match ev {
            Ev::Ctrl { token, src, .. } => {
                let at = (self.bytes.len() as u32, bytes.len() as u32);
                self.bytes.extend_from_slice(bytes);
                Ev::Ctrl { token, src, at }
            }
            other => other,
        };
        self.events.push(ev);
    }
    fn clear(&mut self) {
        self.events.clear();
        self.bytes.clear();
    }
}

/// A comm's mailbox at the hub. Once the comm knows its peer's token
/// ([`Inbox::expect`]), the hub queues only control messages that carry it,
/// and at most one `Alive` at a time: what anyone else sends, or a peer's
/// flood while the host is busy elsewhere, costs no memory.
#[derive(Debug, Default)]
pub struct Inbox {
    mail: Mutex<Mail>,
    /// The peer's token (0: any, while connecting or listening).
    token: std::sync::atomic::AtomicU32,
    /// An `Alive` is queued.
    alive: std::sync::atomic::AtomicBool,
    /// Control messages dropped: another token, or over [`INBOX_MAX`].
    dropped: AtomicU64,
    /// Control messages dropped over [`INBOX_MAX`] (a subset of `dropped`).
    overflowed: AtomicU64,
}

impl Inbox {
    /// Everything delivered since the last call, in arrival order, into
    /// `mail` (emptied first): the inbox keeps `mail`'s buffers for what
    /// comes next.
    pub fn take(&self, mail: &mut Mail) {
        mail.clear();
        self.alive.store(false, Ordering::Relaxed);
        std::mem::swap(&mut *lock(&self.mail), mail);
    }
    /// From now on only control messages with `token` are queued.
    pub fn expect(&self, token: u32) {
        self.token.store(token, Ordering::Relaxed);
    }
    /// (dropped, of which over the limit) so far.
    pub fn dropped(&self) -> (u64, u64) {
        (
            self.dropped.load(Ordering::Relaxed),
            self.overflowed.load(Ordering::Relaxed),
        )
    }
    /// Queues `ev` (`bytes`: a control message's, else empty).
    fn push(&self, ev: Ev, bytes: &[u8]) {
        if let Ev::Ctrl { token, .. } = &ev {
            let want = self.token.load(Ordering::Relaxed);
            let stranger = want != 0 && *token != want;
            if stranger
                || (super::wire::is_alive(bytes) && self.alive.swap(true, Ordering::Relaxed))
            {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let want = matches!(ev, Ev::Ctrl { .. }) && super::wire::is_want(bytes);
        {
            let mut q = lock(&self.mail);
            if q.events.len() >= INBOX_MAX && matches!(ev, Ev::Ctrl { .. }) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                self.overflowed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            q.push(ev, bytes);
        }
        if want {
            // A sender waits for an offer only its comm's own progress
            // sends, and the host may not call that comm while it retries
            // its send (a thread that drives both ends): the keeper ticks
            // soon, and its tick progresses the comm.
            super::sync::hurry();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct PortState {
    // Field order is drop order: the endpoint closes before its buffers go.
    ep: Endpoint,
    /// The port's posted buffers: one lock, taken once per CQ read.
    bufs: Mutex<PortBufs>,
    /// Where eager messages too large to inject are sent from (the active
    /// port, where the provider takes them: see [`Hub::open`]).
    bounce: Option<Bounce>,
    poll: Mutex<()>,
    name: Vec<u8>,
    /// When this port's CQ was last read (ns since the hub opened).
    polled: AtomicU64,
}

/// Buffers a port keeps posted.
struct PortBufs {
    ctrl: CtrlBufs,
    /// Tagged messages dropped on arrival ([`Posts::Sink`]).
    sink: Option<CtrlBufs>,
}

/// A port nobody read for this long is read by whoever progresses the
/// other one.
const STALE_NS: u64 = 20_000;

/// A device's shared endpoints and the comms on them.
pub struct Hub {
    opened: Instant,
    ports: [PortState; 2],
    /// Tagged data on its way to closed receive comms ([`super::grave`]);
    /// after `ports`, so that the endpoints close before its buffers go.
    graves: Mutex<Graves>,
    /// `WEFT_PEER_TIMEOUT`: a grave that took nothing for this long goes.
    peer_timeout: std::time::Duration,
    /// Writes carry 8 bytes of immediate, so sizes ride in them.
    wide: bool,
    /// Writes into this device never raise their remote CQ data here
    /// (`Rma::cq_data_lost`): its receive comms ask their senders to announce
    /// each write with a `Wrote` instead.
    announce: bool,
    /// The largest eager message (data bytes) this hub's buffers take.
    eager_max: usize,
    /// The largest message the provider injects (header and data).
    inject_max: usize,
    /// The provider reports each completion's source (`FI_SOURCE`).
    sources: bool,
    boxes: RwLock<HashMap<u32, Arc<Inbox>>>,
    /// Draws comm ids: SipHash under a random key, of a counter, so that
    /// ids say nothing of one another (a third party that knows one cannot
    /// sweep its neighbours).
    ids: Mutex<(std::hash::RandomState, u64)>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hub({} comms)", self.comms())
    }
}

impl Hub {
    /// Opens the device's two endpoints and posts their control receives.
    pub fn open(dev: &DeviceState) -> Result<Self> {
        // Eager messages are one message each, header and data: injected
        // where they fit the provider's inject size (shm: 4 KiB), else sent
        // from a bounce buffer where the provider still takes them in one
        // message (rxm below its eager limit: tcp;ofi_rxm injects only 64
        // bytes, so a write and its offer would cost two messages and a
        // round trip for every message above 40 bytes). Tried on shm and
        // dropped: a bounce send above its inject size (its CMA path) made
        // 4 KiB messages slower than writes.
        let head = CTRL_HEAD + EAGER_HEAD;
        let injected = dev.dev.inject_size.saturating_sub(head);
        let bounced = if dev.dev.provider.contains("ofi_rxm") {
            crate::fabric::rxm_eager_limit().saturating_sub(head + RXM_HEADROOM)
        } else {
            0
        };
        let eager_max = dev.eager_size.min(injected.max(bounced));
        let port = |passive: bool| -> Result<PortState> {
            let ep = Endpoint::open_sized(&dev.domain, CQ_SIZE)
                .map_err(|e| Error::from(e).context("opening the device's shared endpoint"))?;
            if passive && dev.domain.mr_mode() & fi::FI_MR_ENDPOINT != 0 {
                // Peers reach this device's memory through the passive
                // endpoint: every registration is bound to it (from its own
                // control buffers on).
                dev.domain.set_mr_endpoint(ep.raw());
            }
            // Eager messages go to receive comms (passive): only there do
            // control buffers take them.
            let size = match passive {
                true => CTRL_HEAD + CTRL_MAX.max(EAGER_HEAD + eager_max),
                false => CTRL_HEAD + CTRL_MAX,
            };
            let ctrl = CtrlBufs::new(dev, &ep, Posts::Control, CTRL_POSTED, size)?;
            let bounce = match !passive && head + eager_max > dev.dev.inject_size {
                true => Some(Bounce::new(dev, BOUNCE_MAX, BOUNCE_BLOCK, head + eager_max)?),
                false => None,
            };
            let sink = if dev.sinks_tagged
                && dev.domain.info().provider() != crate::fabric::provider::SHM
            {
                Some(CtrlBufs::new(
                    dev,
                    &ep,
                    Posts::Sink,
                    SINK_POSTED,
                    SINK_SIZE,
                )?)
            } else {
                None
            };
            let name = ep.name()?;
            Ok(PortState {
                ep,
                bufs: Mutex::new(PortBufs { ctrl, sink }),
                bounce,
                poll: Mutex::new(()),
                name,
                polled: AtomicU64::new(0),
            })
        };
        Ok(Self {
            opened: Instant::now(),
            ports: [port(true)?, port(false)?],
            graves: Mutex::new(Graves::default()),
            peer_timeout: dev.peer_timeout,
            boxes: RwLock::new(HashMap::new()),
            ids: Mutex::new((std::hash::RandomState::new(), 0)),
            // The test switch WEFT_TEST_NARROW_IMM: behave as if writes
            // carried only 4 bytes of immediate (EFA, verbs), so every size
            // travels in a `Wrote`.
            wide: dev.dev.rma.cq_data_size >= 8 && !dev.dev.test.narrow_imm,
            announce: dev.dev.rma.writes_announced(),
            eager_max,
            inject_max: dev.dev.inject_size,
            sources: dev.domain.info().caps() & fi::FI_SOURCE != 0,
        })
    }

    /// A new comm: its id (random, never 0) and its inbox.
    pub fn register(&self) -> Result<(u32, Arc<Inbox>)> {
        let mut boxes = self.boxes.write().unwrap_or_else(|e| e.into_inner());
        if boxes.len() >= (MAX_ID - 1) as usize {
            return Err(Error::system(format!(
                "{} comms open on one device: no comm id left",
                boxes.len()
            )));
        }
        let mut ids = lock(&self.ids);
        let id = loop {
            ids.1 += 1;
            let id = std::hash::BuildHasher::hash_one(&ids.0, ids.1) as u32 & (MAX_ID - 1);
            if id != 0 && !boxes.contains_key(&id) {
                break id;
            }
        };
        let inbox = Arc::new(Inbox::default());
        boxes.insert(id, Arc::clone(&inbox));
        Ok((id, inbox))
    }

    /// The comm is gone: what still arrives for it is dropped.
    pub fn unregister(&self, id: u32) {
        self.boxes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    /// Leaves a grave for a closed tagged receive comm whose peer may still
    /// send (see [`super::grave`]).
    pub fn dig(&self, closed: Closed) {
        let ep = self.ep(Port::Passive);
        let registrar = crate::mr::DomainRegistrar(Arc::clone(ep.domain()));
        lock(&self.graves).dig(ep, registrar, closed);
    }

    /// The keeper's visit: reads both CQs (the provider moves transfers of
    /// comms already closed only when they are read, and a peer may be
    /// waiting on one) and retires idle graves.
    pub fn tend(&self) -> Result<()> {
        self.progress(Port::Passive)?;
        self.progress(Port::Active)?;
        lock(&self.graves).sweep(self.ep(Port::Passive), self.peer_timeout);
        Ok(())
    }

    /// Whether sizes ride in immediates (8 bytes of remote CQ data).
    pub fn wide(&self) -> bool {
        self.wide
    }

    /// Whether writes into this device must be announced by a message
    /// (their remote CQ data never arrives here).
    pub fn announce(&self) -> bool {
        self.announce
    }

    /// Whether completions say where they came from (`FI_SOURCE`): then a
    /// comm takes messages and writes only from its peer's address.
    pub fn sources(&self) -> bool {
        self.sources
    }

    /// The largest eager message this hub takes and sends (data bytes).
    pub fn eager_max(&self) -> usize {
        self.eager_max
    }

    /// Sends eager message `head` + `data` for comm `id` on `port` to `to`:
    /// injected where it fits the provider's inject size, else from a
    /// bounce buffer. Either way the data is copied before this returns.
    /// `Ok(false)`: no bounce buffer is free now (progress, then retry).
    pub(crate) fn send_eager(
        &self,
        port: Port,
        to: &Peer,
        id: u32,
        head: &[u8],
        data: &[u8],
        scratch: &mut Vec<u8>,
    ) -> std::result::Result<bool, crate::fabric::FiError> {
        let ep = self.ep(port);
        match &self.ports[port as usize].bounce {
            Some(b) if head.len() + data.len() > self.inject_max => {
                b.send(ep, to, id, head, data)
            }
            _ => {
                scratch.clear();
                scratch.extend_from_slice(head);
                scratch.extend_from_slice(data);
                to.send("fi_inject", |a| ep.inject(scratch, a)).map(|()| true)
            }
        }
    }

    /// Comms registered.
    pub fn comms(&self) -> usize {
        self.boxes.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// One of the endpoints.
    pub fn ep(&self, port: Port) -> &Endpoint {
        &self.ports[port as usize].ep
    }

    /// Its address.
    pub fn name(&self, port: Port) -> &[u8] {
        &self.ports[port as usize].name
    }

    /// Reads `port`'s CQ and delivers what it holds, unless another thread is
    /// doing so right now; and the other port's too when nobody read it for
    /// [`STALE_NS`]. The provider moves a port's queued sends (rxm's
    /// deferred ones, while a connection comes up) only when that port's CQ
    /// is read: a rank that for a while only sends, say, would otherwise hold
    /// its receive comms' control messages back until the keeper's tick.
    pub fn progress(&self, port: Port) -> Result<()> {
        // One clock read per call: this runs on every test and post.
        let now = self.opened.elapsed().as_nanos() as u64;
        self.progress_port(port, now)?;
        let other = match port {
            Port::Passive => Port::Active,
            Port::Active => Port::Passive,
        };
        if now.saturating_sub(self.ports[other as usize].polled.load(Ordering::Relaxed)) > STALE_NS
        {
            self.progress_port(other, now)?;
        }
        Ok(())
    }

    /// Reads one port's CQ (`now`: ns since the hub opened, recorded as its
    /// last read).
    fn progress_port(&self, port: Port, now: u64) -> Result<()> {
        let p = &self.ports[port as usize];
        p.polled.store(now, Ordering::Relaxed);
        let Ok(_poller) = p.poll.try_lock() else {
            return Ok(());
        };
        let mut bufs = lock(&p.bufs);
        let PortBufs { ctrl, sink } = &mut *bufs;
        ctrl.repost_waiting(&p.ep)?;
        if let Some(s) = sink {
            s.repost_waiting(&p.ep)?;
        }
        let boxes = self.boxes.read().unwrap_or_else(|e| e.into_inner());
        let graves = port == Port::Passive;
        let deliver = |id: u32, ev: Ev, bytes: &[u8]| {
            match &ev {
                Ev::Done(local, _) | Ev::Failed(local, _) if graves && is_grave(*local) => {
                    let how = match &ev {
                        Ev::Failed(_, e) if e.err == fi::FI_ECANCELED => Returned::Cancelled,
                        Ev::Failed(_, e) if e.err != fi::FI_ETRUNC => Returned::Failed,
                        _ => Returned::Took,
                    };
                    lock(&self.graves).on_return(&p.ep, id, *local, how);
                    return;
                }
                _ => {}
            }
            match boxes.get(&id) {
                Some(b) => b.push(ev, bytes),
                None => {
                    if let Ev::Ctrl { token, .. } = &ev {
                        if graves && lock(&self.graves).on_ctrl(&p.ep, id, *token, bytes) {
                            return;
                        }
                    }
                    tracing::trace!("hub: dropped {ev:?} for comm {id}, which is closed");
                }
            }
        };
        let wide = self.wide;
        drain(&**p.ep.cq(), |ev| {
            let ctx = match &ev {
                Event::Done(c, _) => c.op_context,
                Event::Failed(e) => e.context,
            };
            if let Some(id) = p.bounce.as_ref().and_then(|b| b.returned(ctx)) {
                // An eager message left its bounce buffer; one that failed
                // never reaches its receive, so its comm hears of it.
                if let Event::Failed(e) = ev {
                    deliver(id, Ev::Failed(EAGER_LOCAL, e), &[]);
                }
                return Ok(());
            }
            if let Some((s, i)) = sink.as_mut().and_then(|s| s.find(ctx).map(|i| (s, i))) {
                s.taken += 1;
                tracing::debug!(
                    "hub: dropped tagged message {} from a peer (this protocol takes none)",
                    s.taken
                );
                return s.repost(&p.ep, i);
            }
            match ev {
                Event::Done(c, src) => on_done(c, src, wide, ctrl, &p.ep, deliver),
                Event::Failed(e) => {
                    if let Some(i) = ctrl.find(e.context) {
                        tracing::warn!("hub: dropped a bad control message: {e}");
                        return ctrl.repost(&p.ep, i);
                    }
                    if e.context.is_null() {
                        // A peer's operation on our memory failed (e.g. a
                        // write with a stale key): the peer reports it.
                        tracing::warn!("hub: a peer's operation failed here: {e}");
                        return Ok(());
                    }
                    let ctx = e.context as usize as u64;
                    deliver((ctx >> 32) as u32, Ev::Failed(ctx as u32, e), &[]);
                    Ok(())
                }
            }
        })
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        let ep = &self.ports[Port::Passive as usize].ep;
        ep.domain().clear_mr_endpoint(ep.raw());
    }
}

fn on_done(
    c: &Completion,
    src: FiAddr,
    wide: bool,
    ctrl: &mut CtrlBufs,
    ep: &Endpoint,
    deliver: impl Fn(u32, Ev, &[u8]),
) -> Result<()> {
    if let Some(i) = ctrl.find(c.op_context) {
        // One of the hub's control buffers, whatever the message claims to
        // be: Weft sends no message with remote CQ data, so one that has it
        // is dropped, and the buffer is always posted again once its bytes
        // are in the comm's inbox.
        let foreign = c.flags & fi::FI_REMOTE_CQ_DATA as u64 != 0;
        match unframe(ctrl.bytes(i, c.len)).filter(|_| !foreign) {
            Some((id, token, bytes)) => {
                let at = (0, 0);
                deliver(id, Ev::Ctrl { token, src, at }, bytes)
            }
            None => tracing::debug!(
                "hub: dropped a message of {} bytes that is no Weft control message",
                c.len
            ),
        }
        return ctrl.repost(ep, i);
    }
    if c.flags & u64::from(fi::FI_RECV) == 0 && crate::fabric::is_remote_write(c) {
        // The size comes from the immediate or a control message, never
        // from `len` (0 for a remote write on tcp;ofi_rxm 1.17).
        let imm = c.data as u32;
        let hi = wide.then_some((c.data >> 32) as u32);
        deliver(imm >> 8, Ev::Landed(imm as u8, hi), &[]);
        return Ok(());
    }
    // A comm's own operation (a send, a write, a tagged receive).
    let ctx = c.op_context as usize as u64;
    deliver((ctx >> 32) as u32, Ev::Done(ctx as u32, c.len), &[]);
    Ok(())
}

/// Every hub open in the process, for the keeper ([`tend_all`]).
static HUBS: Mutex<Vec<std::sync::Weak<Hub>>> = Mutex::new(Vec::new());

/// Records a newly opened hub.
pub(crate) fn opened(hub: &Arc<Hub>) {
    let mut hubs = lock(&HUBS);
    hubs.retain(|h| h.strong_count() > 0);
    hubs.push(Arc::downgrade(hub));
}

/// The keeper's tick over every open hub ([`Hub::tend`]).
pub fn tend_all() {
    let hubs: Vec<Arc<Hub>> = lock(&HUBS)
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .collect();
    for h in hubs {
        if let Err(e) = h.tend() {
            tracing::debug!("hub: keeper's visit: {e}");
        }
    }
}
