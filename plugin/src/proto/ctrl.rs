//! The control channel every protocol shares: registered buffers kept
//! posted for control messages, the peers they go to (guarding peers in this
//! process), a comm's view of its peer, and injecting a message.
//!
//! Control messages are untagged messages (`fi_inject`/`fi_recv`): the
//! first [`CTRL_HEAD`] bytes name the comm the message is for, on an
//! endpoint shared by many comms (4 bytes, LE), and carry the sending
//! comm's token (4 bytes, LE: a random number each comm draws when it is
//! made and sends its peer in the handshake; 4 bytes, not 8, because an
//! eager message must fit the provider's inject size, 64 bytes on
//! tcp;ofi_rxm); the rest is a [`Ctrl`]. A comm
//! takes a message only with its peer's token, and (where the provider
//! reports sources) only from its peer's endpoint, so neither a third party
//! nor another comm of the same peer, nor a comm closed before, can speak
//! for its peer. Data messages are
//! tagged, so the two never share a receive queue: a provider matching an
//! arriving data message walks only the tagged receives (shm walks its
//! posted list one by one; with the 256 control buffers in the same list a
//! small message cost ~0.6 us more, measured).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use libfabric_sys as fi;

use super::pool::SLOT_ALIGN;
use super::wire::{Ctrl, CTRL_MAX};
use super::DeviceState;
use crate::error::{Error, Kind, Result};
use crate::fabric::local::{self, LocalEp, Locality};
use crate::fabric::{Endpoint, FiAddr, FiError};
use crate::freelist::{Elem, Freelist, HostPages, Params};
use crate::mr::DomainRegistrar;

/// Bytes before a control message: the id of the comm it is for, and the
/// sending comm's token.
pub const CTRL_HEAD: usize = 8;
/// Context bit of a posted control buffer (the low bits are its index);
/// comms' operation contexts never set it (their ids are 24 bits).
pub(crate) const CTRL_CTX: u64 = 1 << 63;
/// Context bit (with [`CTRL_CTX`]) of a sink buffer: see [`Posts::Sink`].
const SINK_CTX: u64 = 1 << 62;
/// Context bit (with [`CTRL_CTX`]) of a send from a bounce buffer
/// ([`Bounce`]): the sending comm's id in bits 32..56, the buffer's index in
/// the low 32.
const BOUNCE_CTX: u64 = 1 << 61;

/// What a set of hub buffers is kept posted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Posts {
    /// Control messages (untagged receives).
    Control,
    /// Tagged messages from anyone with any tag, to be dropped: where a
    /// protocol takes nothing tagged (rdma), whatever a peer sends tagged
    /// lands here and is thrown away at once, instead of waiting in the
    /// provider's unexpected queue (rxm buffers every unexpected message,
    /// without bound).
    Sink,
}

/// A control message to comm `id` from a comm with `token`, as it travels
/// (Weft itself frames in place; this is for tests and forged peers).
#[cfg(feature = "testing")]
pub fn frame(id: u32, token: u32, msg: &Ctrl) -> Vec<u8> {
    let mut b = [0u8; CTRL_HEAD + CTRL_MAX];
    let n = frame_into(&mut b, id, token, msg);
    b[..n].to_vec()
}

/// Writes the header of a message to comm `id` from a comm with `token`
/// into `out` (at least [`CTRL_HEAD`] bytes).
pub fn frame_head(out: &mut [u8], id: u32, token: u32) {
    out[..4].copy_from_slice(&id.to_le_bytes());
    out[4..CTRL_HEAD].copy_from_slice(&token.to_le_bytes());
}

fn frame_into(b: &mut [u8; CTRL_HEAD + CTRL_MAX], id: u32, token: u32, msg: &Ctrl) -> usize {
    frame_head(b, id, token);
    let body: &mut [u8; CTRL_MAX] = (&mut b[CTRL_HEAD..]).try_into().expect("CTRL_MAX bytes");
    CTRL_HEAD + msg.encode(body)
}

/// What a received control message's header says: the comm it is for, the
/// sending comm's token, and the message's bytes.
pub fn unframe(bytes: &[u8]) -> Option<(u32, u32, &[u8])> {
    let id = bytes.get(..4)?;
    let token = bytes.get(4..CTRL_HEAD)?;
    Some((
        u32::from_le_bytes(id.try_into().expect("4 bytes")),
        u32::from_le_bytes(token.try_into().expect("4 bytes")),
        &bytes[CTRL_HEAD..],
    ))
}

/// Registered buffers kept posted for control messages (or as a sink).
pub(crate) struct CtrlBufs {
    pub(crate) list: Freelist<HostPages, DomainRegistrar>,
    pub(crate) posted: Vec<Elem>,
    /// Buffers the provider refused to take back for now (FI_EAGAIN),
    /// reposted at the next progress.
    pub(crate) unposted: Vec<usize>,
    /// Bytes per buffer.
    size: usize,
    /// What they are posted for.
    posts: Posts,
    /// Messages taken (sinks count what they dropped).
    pub(crate) taken: u64,
}

impl CtrlBufs {
    /// Posts `count` buffers of `size` bytes on `ep`: for control messages
    /// (at least [`CTRL_HEAD`] + [`CTRL_MAX`]; more for eager data), or as a
    /// sink ([`Posts::Sink`]).
    pub(crate) fn new(
        dev: &DeviceState,
        ep: &Endpoint,
        posts: Posts,
        count: usize,
        size: usize,
    ) -> Result<Self> {
        let mut list = Freelist::new(
            HostPages,
            DomainRegistrar(Arc::clone(&dev.domain)),
            Params {
                elem_size: size,
                align: SLOT_ALIGN,
                elems_per_block: count,
                max_elems: count,
            },
        )
        .map_err(|e| Error::system(e.to_string()))?;
        let mut posted = Vec::with_capacity(count);
        for _ in 0..count {
            posted.push(list.alloc().map_err(|e| Error::system(e.to_string()))?);
        }
        let mut me = Self {
            list,
            posted,
            unposted: Vec::new(),
            size,
            posts,
            taken: 0,
        };
        for i in 0..count {
            me.repost(ep, i)?;
        }
        Ok(me)
    }

    /// Posts buffer `i` again; when the provider says "not now" it is kept
    /// for [`CtrlBufs::repost_waiting`] (a retryable condition is no error).
    pub(crate) fn repost(&mut self, ep: &Endpoint, i: usize) -> Result<()> {
        match self.post(ep, i) {
            Err(e) if e.is_again() => {
                self.unposted.push(i);
                Ok(())
            }
            r => r.map_err(Error::from),
        }
    }

    /// Retries the buffers that could not be posted yet.
    pub(crate) fn repost_waiting(&mut self, ep: &Endpoint) -> Result<()> {
        for i in std::mem::take(&mut self.unposted) {
            self.repost(ep, i)?;
        }
        Ok(())
    }

    pub(crate) fn post(&self, ep: &Endpoint, i: usize) -> std::result::Result<(), FiError> {
        let e = &self.posted[i];
        let desc = e.mr.map_or(std::ptr::null_mut(), |m| m.desc);
        let ctx = (self.ctx_bits() | i as u64) as usize as *mut c_void;
        // SAFETY: the buffer is `size` bytes of registered memory owned by
        // this list, which outlives the endpoint (fields drop ep first); the
        // context names the buffer (its bits and its index).
        unsafe {
            match self.posts {
                Posts::Control => ep.recv(e.ptr.as_ptr(), self.size, desc, fi::FI_ADDR_UNSPEC, ctx),
                Posts::Sink => ep.trecv(
                    e.ptr.as_ptr(),
                    self.size,
                    desc,
                    fi::FI_ADDR_UNSPEC,
                    0,
                    u64::MAX,
                    ctx,
                ),
            }
        }
    }

    fn ctx_bits(&self) -> u64 {
        match self.posts {
            Posts::Control => CTRL_CTX,
            Posts::Sink => CTRL_CTX | SINK_CTX,
        }
    }

    /// Which of these posted buffers a completion context names (`None`:
    /// none of them).
    pub(crate) fn find(&self, ctx: *mut c_void) -> Option<usize> {
        let c = ctx as usize as u64;
        let bits = CTRL_CTX | SINK_CTX;
        let i = (c & !bits) as usize;
        (c & bits == self.ctx_bits() && i < self.posted.len()).then_some(i)
    }

    pub(crate) fn bytes(&self, i: usize, len: usize) -> &[u8] {
        // SAFETY: the buffer is `size` bytes; the provider finished writing
        // `len` of them when it reported the completion.
        unsafe { std::slice::from_raw_parts(self.posted[i].ptr.as_ptr(), len.min(self.size)) }
    }
}

impl Drop for CtrlBufs {
    fn drop(&mut self) {
        for e in self.posted.drain(..) {
            self.list.free(e);
        }
    }
}

/// Registered buffers that eager messages too large to inject are sent
/// from (`fi_send`), one message each: the message is copied in, so the
/// send is done for NCCL once it is posted, and the buffer goes back to the
/// list when the provider reports the send complete ([`Bounce::returned`]).
/// The list grows in blocks up to its bound; a sender that finds none free
/// waits (a NULL request) as it does for credits.
pub(crate) struct Bounce {
    inner: std::sync::Mutex<BounceBufs>,
}

struct BounceBufs {
    list: Freelist<HostPages, DomainRegistrar>,
    /// Buffers with the provider, by index.
    out: Vec<Option<Elem>>,
}

impl Bounce {
    /// Up to `count` buffers of `size` bytes, registered with `dev`'s domain
    /// as they are first needed (blocks of `block`).
    pub(crate) fn new(dev: &DeviceState, count: usize, block: usize, size: usize) -> Result<Self> {
        let list = Freelist::new(
            HostPages,
            DomainRegistrar(Arc::clone(&dev.domain)),
            Params {
                elem_size: size,
                align: SLOT_ALIGN,
                elems_per_block: block.min(count),
                max_elems: count,
            },
        )
        .map_err(|e| Error::system(e.to_string()))?;
        Ok(Self {
            inner: std::sync::Mutex::new(BounceBufs {
                list,
                out: std::iter::repeat_with(|| None).take(count).collect(),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BounceBufs> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `head` followed by `data` to `to` as one message from a bounce
    /// buffer, for comm `id`. `Ok(false)`: no buffer is free now; nothing was
    /// sent. A message larger than a buffer (the hub's eager limit bounds
    /// what comes here) is an error, never a retry.
    pub(crate) fn send(
        &self,
        ep: &Endpoint,
        to: &Peer,
        id: u32,
        head: &[u8],
        data: &[u8],
    ) -> std::result::Result<bool, FiError> {
        let len = head.len() + data.len();
        let mut b = self.lock();
        if len > b.list.elem_size() {
            return Err(FiError {
                call: "fi_send",
                code: fi::FI_EMSGSIZE,
                text: format!(
                    "an eager message of {len} bytes does not fit a bounce buffer of {}",
                    b.list.elem_size()
                ),
            });
        }
        let Ok(e) = b.list.alloc() else {
            return Ok(false);
        };
        // SAFETY: the element is `elem_size` bytes of this list's memory,
        // ours alone until it is freed; `len` fits it (checked above).
        let buf = unsafe { std::slice::from_raw_parts_mut(e.ptr.as_ptr(), len) };
        buf[..head.len()].copy_from_slice(head);
        buf[head.len()..].copy_from_slice(data);
        let desc = e.mr.map_or(std::ptr::null_mut(), |m| m.desc);
        let i = e.index();
        let ctx = CTRL_CTX | BOUNCE_CTX | (u64::from(id) << 32) | u64::from(i);
        // SAFETY: the buffer stays allocated and untouched until the
        // provider reports this send complete (its context names the
        // buffer) or the endpoint is closed (the hub closes endpoints before
        // their bounce buffers go); `desc` is its registration's.
        let sent = to.send("fi_send", |a| unsafe {
            ep.send(e.ptr.as_ptr(), len, desc, a, ctx as usize as *mut c_void)
        });
        match sent {
            Ok(()) => {
                b.out[i as usize] = Some(e);
                Ok(true)
            }
            Err(err) => {
                b.list.free(e);
                Err(err)
            }
        }
    }

    /// If `ctx` names a send from one of these buffers: the buffer is free
    /// again, and the sending comm's id is returned.
    pub(crate) fn returned(&self, ctx: *mut c_void) -> Option<u32> {
        let c = ctx as usize as u64;
        if c & (CTRL_CTX | SINK_CTX | BOUNCE_CTX) != CTRL_CTX | BOUNCE_CTX {
            return None;
        }
        let mut b = self.lock();
        let e = b.out.get_mut(c as u32 as usize)?.take()?;
        b.list.free(e);
        Some(((c >> 32) as u32) & (super::wire::MAX_ID - 1))
    }

}

impl Drop for Bounce {
    fn drop(&mut self) {
        // The endpoint is closed: what it still held is free.
        let b = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        let BounceBufs { list, out } = b;
        for e in out.iter_mut().filter_map(Option::take) {
            list.free(e);
        }
    }
}

/// A peer endpoint: its address in a comm's AV and, when it lives in this
/// process, its record there (see [`crate::fabric::local`]).
pub(crate) struct Peer {
    pub(crate) addr: FiAddr,
    pub(crate) local: Option<Arc<LocalEp>>,
}

impl Peer {
    pub(crate) const NONE: Peer = Peer {
        addr: fi::FI_ADDR_NOTAVAIL,
        local: None,
    };

    /// Inserts a peer's endpoint name into `ep`'s AV. The name was checked
    /// against the domain's address format by the AV; an endpoint of this
    /// process that is already closed is refused.
    pub(crate) fn insert(ep: &Endpoint, name: &[u8]) -> std::result::Result<Self, FiError> {
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
    pub(crate) fn send(
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

pub(crate) fn closed_peer(call: &'static str) -> FiError {
    FiError {
        call,
        code: fi::FI_ENOTCONN,
        text: "the peer endpoint, in this same process, was closed".to_owned(),
    }
}

/// Injects a control message to comm `id` at peer `to`, from the comm with
/// `token`.
pub(crate) fn send_ctrl_to(
    ep: &Endpoint,
    to: &Peer,
    id: u32,
    token: u32,
    msg: &Ctrl,
) -> std::result::Result<(), FiError> {
    let mut b = [0u8; CTRL_HEAD + CTRL_MAX];
    let n = frame_into(&mut b, id, token, msg);
    to.send("fi_inject", |a| ep.inject(&b[..n], a))
}

/// A comm's view of its peer: where it is and whether it still answers.
pub(crate) struct Link {
    /// The peer.
    pub(crate) peer: Peer,
    /// The peer's address in words, for log lines and errors.
    pub(crate) name: String,
    /// The peer comm's token (learned in the handshake; 0 until then).
    pub(crate) token: u32,
    /// Messages and writes dropped because they were not from the peer.
    pub(crate) strangers: u64,
    /// Something arrived from the peer since the keeper last looked (set on
    /// the data path, where reading the clock would cost).
    pub(crate) heard: bool,
    /// When the keeper last saw `heard` (or the link was made).
    pub(crate) last_heard: Instant,
    /// When this end last sent `Alive` (None: due now).
    pub(crate) last_said: Option<Instant>,
    /// Once the peer was declared dead: what its death was
    /// ([`Kind::PeerDead`], or [`Kind::PeerClosed`] when it said `Bye` and
    /// nothing more can come), and why.
    pub(crate) dead: Option<(Kind, String)>,
}

impl Link {
    pub(crate) fn new() -> Self {
        Self {
            peer: Peer::NONE,
            name: "(not connected)".to_owned(),
            token: 0,
            strangers: 0,
            heard: false,
            last_heard: Instant::now(),
            last_said: None,
            dead: None,
        }
    }

    /// Records the peer's endpoint name; its life is counted from now.
    pub(crate) fn connect(
        &mut self,
        ep: &Endpoint,
        name: &[u8],
    ) -> std::result::Result<(), FiError> {
        self.peer = Peer::insert(ep, name)?;
        self.name = ep.av().straddr(name);
        self.last_heard = Instant::now();
        Ok(())
    }

    /// Whether a control message with `token` from source address `src` is
    /// the peer's: the token must be the peer's, and where the provider
    /// reports sources (`sources`) the address too. What is not is counted
    /// (and dropped by the caller).
    pub(crate) fn is_from_peer(&mut self, token: u32, src: FiAddr, sources: bool) -> bool {
        let ours = token == self.token && token != 0 && (!sources || src == self.peer.addr);
        if !ours {
            self.stranger(&format!(
                "a control message (source {src:#x}, expected {:#x})",
                self.peer.addr
            ));
        }
        ours
    }

    /// Counts something dropped because it was not from the peer; the
    /// first of a comm is a WARN.
    pub(crate) fn stranger(&mut self, what: &str) {
        if self.strangers == 0 {
            tracing::warn!(
                "comm with {}: dropped {what} that is not from its peer; further ones are counted, not logged. Another host may be sending to this device's endpoint",
                self.name
            );
        }
        self.strangers += 1;
    }

    /// An error if the peer was declared dead.
    pub(crate) fn check(&self) -> Result<()> {
        match &self.dead {
            Some((kind, why)) => Err(Error::remote(why.clone()).of_kind(*kind)),
            None => Ok(()),
        }
    }

    /// The error a request reports once the peer was declared dead.
    pub(crate) fn dead_error(&self) -> Error {
        let (kind, why) = self
            .dead
            .as_ref()
            .map_or((Kind::PeerDead, "no reason recorded"), |(k, w)| {
                (*k, w.as_str())
            });
        Error::remote(format!("peer {} declared dead: {why}", self.name)).of_kind(kind)
    }

    /// Whether `Alive` is due at `now`, one heartbeat `period` after the last.
    pub(crate) fn alive_due(&self, now: Instant, period: std::time::Duration) -> bool {
        self.last_said
            .is_none_or(|t| now.saturating_duration_since(t) >= period)
    }

    /// The keeper's look at the link: how long the peer has been silent.
    pub(crate) fn silence(&mut self, now: Instant) -> std::time::Duration {
        if std::mem::take(&mut self.heard) {
            self.last_heard = now;
        }
        now.saturating_duration_since(self.last_heard)
    }
}

/// Why a peer silent for `silent` is declared dead.
pub(crate) fn silent_peer(silent: std::time::Duration, timeout: std::time::Duration) -> String {
    format!(
        "peer silent for {:.1} s (WEFT_PEER_TIMEOUT = {:.1} s): its process died, hangs, or the network is down",
        silent.as_secs_f64(),
        timeout.as_secs_f64()
    )
}

/// The WARN a comm logs when it declares its peer dead.
pub(crate) fn warn_dead(what: &str, peer: &str, why: &str, failed: usize) {
    tracing::warn!(
        "{what} {peer}: {why}; {failed} request(s) in flight failed, and the comm takes no new ones. \
         Check that process (its log, the OOM killer, the node); raise WEFT_PEER_TIMEOUT if it was only slow"
    );
}
