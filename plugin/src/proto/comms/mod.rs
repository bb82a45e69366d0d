//! Comms on the device's shared endpoints, for both protocols.
//!
//! **Endpoints.** Comms have no endpoint of their own: each is an id and an
//! inbox on its device's [`Hub`] (listeners and receive comms on the passive
//! endpoint, send comms on the active one). A comm costs a few KiB, not a
//! provider endpoint, whichever protocol it speaks.
//!
//! **Handshake** (never blocks; `connect`/`accept` are polled): `connect`
//! sends `Conn{listener nonce, conn nonce, its id, active address}` to the
//! listener's id; the listener makes a receive comm and answers
//! `Ack{conn nonce, its id, passive address, credits}`; the sender's first
//! `Alive` confirms, and `accept` hands the comm to NCCL, so a connecting peer
//! that dies mid-handshake is an error, not a comm that never receives. The
//! keeper thread answers `Conn`s and steps handshakes too
//! ([`super::Listener::tend`]), so a rank that does not call `accept` for a
//! while is still a live listener; what it confirmed waits for `accept`.
//!
//! **Data** takes one of two paths, [`Path`]:
//!
//! *RDMA* (`WEFT_PROTOCOL=rdma`), receiver-driven. For each `irecv`
//! (grouped, n <= 8) the receiver offers the sender the buffers an eager
//! message cannot fill (larger than its eager limit, which its `Ack` said):
//! `Rtr{seq, slot, credits, mask, [tag, number, size, address, key] per
//! offered buffer}`, where the mask names the buffers offered and a buffer's
//! number counts the receives of its tag (a buffer an eager message that
//! came first fills is not offered), and `credits` returns the eager
//! credits owed. A buffer an eager message can fill is offered only when the
//! sender asks (`Want{tag, number, large}`: it cannot send that message
//! eagerly); so is a larger one once eager messages filled [`LAZY_AFTER`]
//! large receives in a row (NCCL posts whole steps), until a `Want` says its
//! message is large.
//! The sender gives the k-th `isend` of a tag the buffer numbered k (NCCL's
//! per-tag order); until it is offered (and the message is not eager) it
//! returns a NULL request, as NCCL allows. It checks the size against the offer: a larger message is an
//! error on both sides (`Trunc` tells the receiver) and nothing is written.
//! Otherwise it writes the data with `fi_writedata`, whose low 32 bits of
//! immediate name the receive comm (24 bits), the request slot (5) and the
//! buffer (3). A receive buffer is done when the immediate arrived (the
//! bytes landed: on tcp a write that completed at the sender may not have)
//! and its size is known: from the immediate's upper 32 bits where the
//! provider gives 8 bytes of CQ data, else from a `Wrote{slot, buffer, size}`
//! message; never from the completion's length (0 for a remote write on
//! tcp;ofi_rxm). No order between the two is assumed, nor between messages
//! beyond what `seq` restores. Where the receiver's provider never raises
//! a write's remote CQ data (verbs;ofi_rxm with a shared receive context:
//! `device::lost_cq_data`), its `Ack` says `announce`: the sender then
//! writes with `fi_write` and follows every write with a `Wrote`, which the
//! provider delivers after the write's data (`FI_ORDER_SAW`, required of
//! such a provider), so that `Wrote` alone completes the buffer.
//!
//! Eager: a message of at most the hub's eager limit (`WEFT_EAGER_SIZE`,
//! capped to what the provider takes as one message: its inject size, or on
//! rxm below its eager limit from a bounce buffer, see [`super::hub`]) goes
//! at once as an `Eager{tag, number, data}` control message, offered or not; the receiver copies it into the receive of the
//! same number (or keeps it until that receive is posted) and returns a
//! credit, on its next `Rtr` or, once `EAGER_CREDIT_BATCH` (4) are owed, in a
//! `Credit`. A sender has at most [`EAGER_CREDITS`] unconsumed (then it asks
//! for the buffer with a `Want`). Data arrives
//! only into buffers the receiver offered, so it never buffers an unexpected
//! data message.
//!
//! *Tagged* (`WEFT_PROTOCOL=sendrecv`): NCCL messages as libfabric tagged
//! messages. The tag is the receive comm's id (bits 32..56) and NCCL's tag
//! (low 32 bits), so grouped receives match by tag and, per tag, in posting
//! order (FIFO per comm); control messages are untagged, so they never sit
//! in the tagged receive queue data messages are matched against.
//! Receives are posted to the provider in NCCL's order (what the provider
//! refuses for now waits, in order). A sender may have at most [`CREDITS`]
//! messages the receiver has not matched; the receiver returns them in
//! batches of [`CREDIT_BATCH`] as its receives complete, so however fast a
//! sender runs, the receiver's provider buffers at most [`CREDITS`]
//! unexpected messages per comm (rxm buffers each, up to 16 KiB). An `isend`
//! without credit returns a NULL request. A message larger than the
//! receiver's unannounced limit ([`unannounced_max`], stated in its `Ack`)
//! goes only into a receive the receiver announced: it counts the receives
//! it posted per tag and, on posting a large one, sends
//! `Posted{(tag, count)...}`; the sender's k-th message of a tag waits (NULL
//! request) until that count passed k. rxm keeps a large message that came
//! before its receive as a rendezvous request pointing at the connection, and
//! reads through it when a receive matches, even after it freed the
//! connection of a sender that died: the receiving process crashed.
//!
//! **Liveness.** Both ends of a connected pair send `Alive` every heartbeat
//! period (`WEFT_PEER_TIMEOUT` / 8), from the plugin's keeper thread, so a
//! peer that is alive but busy elsewhere still answers; anything received
//! from the peer counts as a sign of life. A peer silent for
//! `WEFT_PEER_TIMEOUT` minus one period is dead: every request in flight
//! fails, new ones are refused. Request age plays no part: a receive may
//! wait for hours on a live peer.
//!
//! **Bye** means "I send you nothing more", and everything its sender sent
//! arrives before it. A sender's `Bye` fails only what can never come (rdma:
//! receives its eager messages cannot fill; tagged: receives left once every
//! message it counted in its `Bye` was matched). A receiver's `Bye` stops new
//! sends; sends with the provider end with their own completion, and once
//! none is in flight the sender answers with its own `Bye`. A closing rdma
//! receive comm with buffers offered waits for that answer (or the peer's
//! death, or `WEFT_PEER_TIMEOUT`), so nothing lands in a buffer NCCL frees
//! after the close. After a `Bye` the peer's silence counts only while
//! requests are in flight.
//!
//! **Who is the peer.** Every control message carries the sending comm's
//! token after the destination id ([`super::ctrl`]); a comm takes one only
//! with its peer's token, from its peer's address where the provider reports
//! sources. A write's immediate is checked against its offer's ticket
//! ([`super::wire::immediate`]).
//!
//! A failed request leaves nothing of NCCL's with the provider that it could
//! write: receive buffers on the RDMA path are offered to the peer, never
//! posted; tagged receives posted to the shared endpoint are cancelled, and
//! a receive fails only once the provider has returned every one of its
//! buffers (a closed receive comm waits for that too, up to
//! `WEFT_PEER_TIMEOUT`). A closing send comm likewise waits for its writes
//! and tagged sends in flight to complete (or fail, or the peer to be
//! declared dead, or `WEFT_PEER_TIMEOUT`): until then the provider reads
//! their source, and NCCL may free or reuse it once the close returns, so
//! the receiver would be given whatever the memory then holds (and an
//! unmapped source would crash the provider). A tagged send completes in
//! network time: a large one goes only into a receive the peer announced,
//! a small one leaves at once. A send to a peer that died may still read
//! its source until the provider gives up on the connection (reads only;
//! the peer is gone).

use std::collections::VecDeque;
#[cfg(feature = "testing")]
use std::sync::mpsc::{Receiver as Rx, Sender as Tx};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::ctrl::{send_ctrl_to, silent_peer, warn_dead, Link};
use super::hub::{Ev, Hub, Inbox, Mail, Port};
use super::pool::Pool;
#[cfg(feature = "testing")]
use super::sync::hold;
use super::sync::{keeper_lock, lock, try_lock};
use super::wire::{Ctrl, ListenHandle, PROTO_RDMA, PROTO_SENDRECV};
use super::{heartbeat_period, DeviceState, Listener, Protocol, ReqId, Sender};
use crate::error::{Error, Kind, Result};
use crate::fabric::Endpoint;

mod listen;
mod recv;
mod send;

pub use listen::ListenComm;
pub use recv::RecvComm;
pub use send::SendComm;

/// Tagged path: credits are returned once this many are owed.
pub const CREDIT_BATCH: u32 = 64;
/// Tagged path: messages a sender may have unmatched at the receiver:
/// NCCL's most in flight on a send comm (32 requests x 8 receives), plus one
/// batch, since up to a batch less one may be owed but not yet returned.
pub const CREDITS: u32 = (super::MAX_REQUESTS * super::MAX_RECVS) as u32 + CREDIT_BATCH;

/// Eager messages a sender may have unconsumed at its receiver (each takes
/// one of the receiver's posted bounce buffers, then at most one stashed
/// copy until NCCL posts its receive).
pub const EAGER_CREDITS: u32 = 16;
/// RDMA: large receives (above the eager limit) filled by eager messages in
/// a row, with no write landing between, before a receive comm offers its
/// large receives only when asked for (NCCL posts whole steps, whatever it
/// sends). NCCL's window, 8 steps: a stream that alternates small and large
/// messages faster keeps offering at once, since each large message after
/// small ones costs a `Want` (a half round trip, and a keeper tick where the
/// host does not progress the receive comm meanwhile); 2 made a stress test
/// of sizes cycling every 5 messages 1.7x slower.
pub const LAZY_AFTER: u8 = 8;
/// Eager credits are returned once this many are owed.
const EAGER_CREDIT_BATCH: u32 = 4;

/// Tagged path: the largest message a sender sends before its receive is
/// announced ([`Ctrl::Posted`](super::wire::Ctrl)): on libfabric's rxm its
/// eager limit (anything larger travels as a rendezvous), elsewhere the
/// provider's inject size. The receive comm says it in its `Ack`, so both
/// ends use the receiver's figure.
fn unannounced_max(dev: &DeviceState) -> usize {
    if dev.dev.provider.contains("ofi_rxm") {
        crate::fabric::rxm_eager_limit()
    } else {
        dev.dev.inject_size
    }
}

/// How a comm's data travels (see the module's "Data").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Receiver-driven `fi_writedata` (`WEFT_PROTOCOL=rdma`).
    Rdma,
    /// Tagged messages (`WEFT_PROTOCOL=sendrecv`).
    Tagged,
}

impl Path {
    /// The credits a receive comm grants its sender, and how many it
    /// returns at once.
    fn credits(self) -> (u32, u32) {
        match self {
            Path::Rdma => (EAGER_CREDITS, EAGER_CREDIT_BATCH),
            Path::Tagged => (CREDITS, CREDIT_BATCH),
        }
    }
}

/// A protocol over the hub: its comms speak one [`Path`].
#[derive(Debug, Clone, Copy)]
pub struct OnHub(pub Path);

impl Protocol for OnHub {
    fn name(&self) -> &'static str {
        match self.0 {
            Path::Rdma => "rdma",
            Path::Tagged => "sendrecv",
        }
    }
    fn wire_id(&self) -> u8 {
        match self.0 {
            Path::Rdma => PROTO_RDMA,
            Path::Tagged => PROTO_SENDRECV,
        }
    }
    fn listen(
        &self,
        dev: Arc<DeviceState>,
        nonce: u64,
    ) -> Result<(Arc<dyn Listener>, ListenHandle)> {
        let (l, h) = ListenComm::open(dev, self.0, self.wire_id(), nonce)?;
        Ok((Arc::new(l), h))
    }
    fn connect(
        &self,
        dev: Arc<DeviceState>,
        handle: &ListenHandle,
    ) -> Result<Arc<dyn Sender>> {
        Ok(Arc::new(SendComm::start(dev, self.0, handle)?))
    }
}

/// Where a comm sits on its device's hub: an id and an inbox on one port,
/// and the token its control messages carry (random, never 0).
/// Leaving the seat (drop) unregisters the id.
struct Seat {
    hub: Arc<Hub>,
    port: Port,
    id: u32,
    token: u32,
    inbox: Arc<Inbox>,
    /// What the last read took from the inbox (its buffers are reused).
    mail: Mutex<Mail>,
}

impl Seat {
    fn new(dev: &DeviceState, port: Port) -> Result<Self> {
        let hub = dev.hub()?;
        let (id, inbox) = hub.register()?;
        let token = std::iter::repeat_with(|| super::handshake::nonce() as u32)
            .find(|&t| t != 0)
            .expect("an endless iterator");
        Ok(Self {
            hub,
            port,
            id,
            token,
            inbox,
            mail: Mutex::new(Mail::default()),
        })
    }

    /// Whether control message `ev` is from `link`'s peer (its token and
    /// address); a write's immediate is checked against its offer instead
    /// (see [`super::hub`]), and a comm's own operations are its own.
    fn is_from_peer(&self, link: &mut Link, ev: &Ev) -> bool {
        match ev {
            Ev::Ctrl { token, src, .. } => link.is_from_peer(*token, *src, self.hub.sources()),
            Ev::Landed(..) | Ev::Done(..) | Ev::Failed(..) => true,
        }
    }

    fn ep(&self) -> &Endpoint {
        self.hub.ep(self.port)
    }

    /// Progresses the port and hands what arrived for this comm to `f`,
    /// in arrival order, with each control message's bytes (see
    /// [`Mail::drain`]). Allocates nothing once the mail's buffers grew.
    fn poll(&self, f: impl FnMut(Ev, &[u8]) -> Result<()>) -> Result<()> {
        self.hub.progress(self.port)?;
        let mut mail = lock(&self.mail);
        self.inbox.take(&mut mail);
        mail.drain(f)
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.hub.unregister(self.id);
    }
}

/// A comm's link to its peer comm: the peer endpoint, the peer comm's id
/// there, liveness, this comm's own token (sent with every message), and
/// control messages the provider could not take yet (sent first, in order,
/// before any new one).
struct PeerLink {
    link: Link,
    id: u32,
    me: u32,
    owed: VecDeque<Ctrl>,
    /// The peer said `Bye`: it sends nothing more.
    bye_heard: bool,
    /// This comm said `Bye`.
    bye_said: bool,
    /// When in-flight requests were last aged ([`Side::stalled`]).
    aged: Option<Instant>,
}

impl PeerLink {
    fn new(seat: &Seat) -> Self {
        Self {
            link: Link::new(),
            id: 0,
            me: seat.token,
            owed: VecDeque::new(),
            bye_heard: false,
            bye_said: false,
            aged: None,
        }
    }

    /// Says `Bye` (once; `sent`: tagged data messages sent). Best effort: a
    /// peer that misses it finds out by its silence.
    fn say_bye(&mut self, ep: &Endpoint, sent: u32) {
        if self.id != 0 && self.link.dead.is_none() && !self.bye_said {
            self.bye_said = true;
            let _ = self.send(ep, Ctrl::Bye { sent });
        }
    }

    /// Sends `msg` after whatever is owed; what the provider refuses for now
    /// is kept. A hard error means the connection is broken.
    fn send(&mut self, ep: &Endpoint, msg: Ctrl) -> Result<()> {
        self.owed.push_back(msg);
        self.flush(ep)
    }

    /// Sends what is owed, in order, until the provider says "not now".
    fn flush(&mut self, ep: &Endpoint) -> Result<()> {
        while let Some(m) = self.owed.front() {
            match send_ctrl_to(ep, &self.link.peer, self.id, self.me, m) {
                Ok(()) => {
                    self.owed.pop_front();
                }
                Err(e) if e.is_again() => {
                    // The comm may not be called again soon: the keeper
                    // sends it (see `core::keeper`).
                    super::sync::hurry();
                    return Ok(());
                }
                Err(e) => {
                    return Err(Error::remote(format!(
                        "control message to {} failed: {e}",
                        self.link.name
                    ))
                    .of_kind(Kind::Provider(e.code)))
                }
            }
        }
        Ok(())
    }
}

/// What liveness needs of a send or receive comm's state.
trait Side {
    /// "send comm to" or "receive comm from", for log lines.
    const WHAT: &'static str;
    fn peer(&mut self) -> &mut PeerLink;
    /// Whether the handshake finished (heartbeats start then).
    fn linked(&self) -> bool;
    /// Fails every request in flight; returns how many.
    fn fail_all(&mut self) -> usize;
    /// Whether a request is in flight (not yet finished).
    fn busy(&self) -> bool;
    /// One heartbeat tick of the data path's own liveness: ages what must
    /// complete in network time, and says why the link is wedged once
    /// something has been in flight for `ticks` heartbeat periods.
    fn stalled(&mut self, _seat: &Seat, _ticks: u32) -> Option<String> {
        None
    }
    /// Progresses and applies what arrived.
    fn progress(&mut self, seat: &Seat) -> Result<()>;
}

/// Why requests fail once the peer said `Bye`.
const PEER_CLOSED: &str =
    "the peer closed its comm (NCCL closed it there, or that rank is shutting down)";

/// Declares the peer dead: every request in flight fails, new ones are
/// refused, one WARN names the peer.
/// A closing comm's last wait: progresses (hurrying the keeper) while
/// `waiting` holds, until `deadline`; then WARNs `why`.
fn close_wait<S: Side>(
    st: &mut S,
    seat: &Seat,
    timeout: std::time::Duration,
    waiting: impl Fn(&S) -> bool,
    why: Option<&str>,
) {
    let deadline = Instant::now() + timeout;
    while waiting(st) {
        super::sync::hurry();
        if st.linked() && st.peer().link.dead.is_none() {
            // The keeper cannot tend a comm whose lock the close holds:
            // liveness goes on here (a peer that dies meanwhile ends the
            // wait as soon as it is declared dead, not at the deadline).
            keepalive(st, seat, timeout, Instant::now());
        } else if let Err(e) = st.progress(seat) {
            tracing::warn!("closing a {} {}: {e}", S::WHAT, st.peer().link.name);
        }
        if Instant::now() > deadline {
            match why {
                Some(why) => tracing::warn!(
                    "closing the {} {}: {why} (WEFT_PEER_TIMEOUT passed; raise it for peers that stall longer)",
                    S::WHAT,
                    st.peer().link.name,
                ),
                None => tracing::debug!(
                    "closing the {} {}: gave up waiting after {timeout:?}",
                    S::WHAT,
                    st.peer().link.name,
                ),
            }
            break;
        }
        std::thread::yield_now();
    }
}

fn die<S: Side>(st: &mut S, why: String) {
    die_as(st, Kind::PeerDead, why);
}

/// Why a comm whose provider says the connection is gone dies (`what`
/// the provider failed).
fn connection_broken(what: impl std::fmt::Display) -> String {
    format!("the provider reports the connection to the peer broken ({what})")
}

/// [`die`], recording what the death was (`Kind::PeerClosed`: a `Bye`
/// after which nothing more can come).
fn die_as<S: Side>(st: &mut S, kind: Kind, why: String) {
    if st.peer().link.dead.is_some() {
        return;
    }
    let failed = st.fail_all();
    let p = st.peer();
    warn_dead(S::WHAT, &p.link.name, &why, failed);
    p.link.dead = Some((kind, why));
}

/// One heartbeat tick (the keeper): `Alive` when due, progress, and death
/// after `timeout - period` of silence.
fn keepalive<S: Side>(st: &mut S, seat: &Seat, timeout: std::time::Duration, now: Instant) {
    if !st.linked() || st.peer().link.dead.is_some() {
        return;
    }
    let period = heartbeat_period(timeout);
    let bye = st.peer().bye_heard;
    if !bye && st.peer().link.alive_due(now, period) {
        let p = st.peer();
        let r = p.send(seat.ep(), Ctrl::Alive);
        if let Err(e) = r {
            return die(st, connection_broken(e));
        }
        st.peer().link.last_said = Some(now);
    }
    if let Err(e) = st.progress(seat) {
        return die(st, format!("progress failed: {e}"));
    }
    // The data path's own liveness ages once per period, however often
    // the keeper runs (it is hurried at times).
    let p = st.peer();
    if p.aged
        .is_none_or(|t| now.saturating_duration_since(t) >= period)
    {
        p.aged = Some(now);
        let ticks = (timeout.as_secs_f64() / period.as_secs_f64()).ceil() as u32;
        if let Some(why) = st.stalled(seat, ticks) {
            return die(st, why);
        }
    }
    let (_, flooded) = seat.inbox.dropped();
    if flooded > 0 {
        return die(
            st,
            format!(
                "it sent more control messages than the protocol has in flight ({flooded} beyond {} unread were dropped): a peer that breaks the protocol",
                super::hub::INBOX_MAX
            ),
        );
    }
    let silent = st.peer().link.silence(now);
    // After its Bye the peer is silent by design: only requests still in
    // flight (whose completion may never come) make its silence count.
    if silent + period >= timeout && (!bye || st.busy()) {
        die(st, silent_peer(silent, timeout));
    }
}

/// `test`'s common part: request `id` of `reqs` (a live one of the slot's
/// current generation, else an error), progressing once if it is not yet
/// `done`; `Some(copy)` once done, and then its slot is freed.
fn take_done<S: Side, R: Copy>(
    st: &mut S,
    seat: &Seat,
    id: ReqId,
    what: &str,
    reqs: fn(&mut S) -> &mut Pool<R>,
    done: fn(&S, &R) -> bool,
) -> Result<Option<R>> {
    let current = reqs(st).is_current(id.slot, id.gen);
    let r = reqs(st)
        .get_mut(id.slot)
        .filter(|_| current)
        .copied()
        .ok_or_else(|| {
            Error::bad_handle(format!(
                "test: not a live {what} request (already completed and reported, or a stale pointer)"
            ))
        })?;
    if !done(st, &r) {
        st.progress(seat)?;
    }
    let r = *reqs(st).get_mut(id.slot).expect("checked live above");
    if !done(st, &r) {
        return Ok(None);
    }
    reqs(st).release(id.slot);
    Ok(Some(r))
}

/// A heartbeat tick through a comm's lock; skipped while the comm is busy.
fn keepalive_locked<S: Side>(
    m: &Mutex<S>,
    seat: &Seat,
    timeout: std::time::Duration,
    now: Instant,
) {
    if let Some(mut st) = keeper_lock(m) {
        keepalive(&mut *st, seat, timeout, now);
    }
}

/// The truncation error, worded for the side that reports it; `size` where
/// known (a provider reporting a truncated tagged receive may not say).
/// `written`: the peer wrote the message anyway (it ignored the size it was
/// offered); the provider bounded that write by the buffer's registration.
fn truncation(
    side: &str,
    peer: &str,
    size: Option<u64>,
    tag: i32,
    cap: u64,
    written: bool,
) -> Error {
    let sent = size.map_or("more bytes than fit".to_owned(), |s| format!("{s} bytes"));
    let what = if written {
        "the peer wrote them anyway: bytes past the buffer, up to the end of the memory NCCL registered for it, may have changed (the provider refuses writes outside a registration)"
    } else {
        "nothing was written past the buffer"
    };
    let msg = format!(
        "message truncated ({side}): {sent} with tag {tag} for a receive buffer of {cap} bytes at {peer}; \
         {what}. NCCL never sends more than the receiver posted, so both ranks must run the same NCCL"
    );
    tracing::warn!("{msg}");
    Error::truncated(msg)
}
