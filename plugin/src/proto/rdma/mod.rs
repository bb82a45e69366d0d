//! The RDMA protocol: receiver-driven writes, on endpoints shared per device.
//!
//! **Endpoints.** Comms have no endpoint of their own: each is an id and an
//! inbox on its device's [`Hub`] (listeners and receive comms on the passive
//! endpoint, send comms on the active one). A comm costs a few KiB, not a
//! provider endpoint.
//!
//! **Handshake**, as SENDRECV's but between hub endpoints: `connect` sends
//! `Conn{listener nonce, conn nonce, its id, active address}` to the
//! listener's id; the listener makes a receive comm and answers
//! `Ack{conn nonce, its id, passive address}`; the sender's first `Alive`
//! confirms, and `accept` hands the comm to NCCL.
//!
//! **Data.** For each `irecv` (grouped, n <= 8) the receiver sends the
//! sender `Rtr{seq, slot, [tag, number, size, address, key] per buffer}`,
//! where a buffer's number counts the receives of its tag. The sender gives
//! the k-th `isend` of a tag the buffer numbered k (NCCL's per-tag order);
//! until it is offered (and the message is not eager) it returns a NULL
//! request, as NCCL allows. It checks the size against the offer: a larger message is
//! an error on both sides (`Trunc` tells the receiver) and nothing is
//! written. Otherwise it writes the data with `fi_writedata`, whose low
//! 32 bits of immediate name the receive comm (24 bits), the request slot
//! (5) and the buffer (3). A receive buffer is done when the immediate
//! arrived (the bytes landed: on tcp a write that completed at the sender
//! may not have) and its size is known: from the immediate's upper 32 bits
//! where the provider gives 8 bytes of CQ data, else from a
//! `Wrote{slot, buffer, size}` message; never from the completion's length
//! (0 for a remote write on tcp;ofi_rxm). No order between the two is
//! assumed, nor between messages beyond what `seq` restores.
//!
//! **Eager.** Sends and receives are numbered per tag; each offered buffer
//! carries its number. A message that fits the provider's inject size (and
//! `WEFT_EAGER_SIZE`) goes at once as an `Eager{tag, number, data}` control
//! message, offered or not; the receiver copies it into the receive of the
//! same number (or keeps it until that receive is posted) and returns a
//! credit. A sender has at most [`EAGER_CREDITS`] unconsumed.
//!
//! **What the receiver holds.** Data arrives only into buffers it offered,
//! so it never buffers an unexpected data message; control messages are
//! bounded by NCCL's requests (32 per comm). `Rtr` travels only when NCCL
//! posts a receive, so no credits are needed.
//!
//! **Liveness** as SENDRECV's: `Alive` every heartbeat period from the
//! keeper, a peer silent for `WEFT_PEER_TIMEOUT` is dead, and every request
//! in flight fails. Receive buffers are never posted to the provider, so a
//! failed receive leaves nothing of NCCL's with it; a write to a peer that
//! died may still read its source buffer until the provider gives up on the
//! connection (reads only: NCCL's registered memory is never written).

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver as Rx, Sender as Tx};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::ctrl::{send_ctrl_to, silent_peer, warn_dead, Link};
use super::hub::{Ev, Hub, Inbox, Port};
use super::pool::Pool;
use super::sync::{hold, keeper_lock, lock, try_lock};
use super::wire::{Ctrl, ListenHandle, PROTO_RDMA};
use super::{heartbeat_period, DeviceState, Listener, Protocol, ReqId, Sender};
use crate::error::{Error, Result};
use crate::fabric::Endpoint;

mod listen;
mod recv;
mod send;

pub use listen::ListenComm;
pub use recv::RecvComm;
pub use send::SendComm;

/// Eager messages a sender may have unconsumed at its receiver (each takes
/// one of the receiver's posted bounce buffers, then at most one stashed
/// copy until NCCL posts its receive).
pub const EAGER_CREDITS: u32 = 16;
/// Eager credits are returned once this many are owed.
const EAGER_CREDIT_BATCH: u32 = 4;

/// The RDMA protocol.
#[derive(Debug, Clone, Copy)]
pub struct Rdma;

impl Protocol for Rdma {
    fn name(&self) -> &'static str {
        "rdma"
    }
    fn wire_id(&self) -> u8 {
        PROTO_RDMA
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

/// Where a comm sits on its device's hub: an id and an inbox on one port.
/// Leaving the seat (drop) unregisters the id.
struct Seat {
    hub: Arc<Hub>,
    port: Port,
    id: u32,
    inbox: Arc<Inbox>,
}

impl Seat {
    fn new(dev: &DeviceState, port: Port) -> Result<Self> {
        let hub = dev.hub()?;
        let (id, inbox) = hub.register()?;
        Ok(Self {
            hub,
            port,
            id,
            inbox,
        })
    }

    fn ep(&self) -> &Endpoint {
        self.hub.ep(self.port)
    }

    /// Progresses the port and returns what arrived for this comm.
    fn poll(&self) -> Result<Vec<Ev>> {
        self.hub.progress(self.port)?;
        Ok(self.inbox.take())
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.hub.unregister(self.id);
    }
}

/// A comm's link to its peer comm: the peer endpoint, the peer comm's id
/// there, liveness, and control messages the provider could not take yet
/// (sent first, in order, before any new one).
struct PeerLink {
    link: Link,
    id: u32,
    owed: VecDeque<Ctrl>,
}

impl PeerLink {
    fn new() -> Self {
        Self {
            link: Link::new(),
            id: 0,
            owed: VecDeque::new(),
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
            match send_ctrl_to(ep, &self.link.peer, self.id, m) {
                Ok(()) => {
                    self.owed.pop_front();
                }
                Err(e) if e.is_again() => return Ok(()),
                Err(e) => {
                    return Err(Error::remote(format!(
                        "control message to {} failed: {e}",
                        self.link.name
                    )))
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
    /// Progresses and applies what arrived.
    fn progress(&mut self, seat: &Seat) -> Result<()>;
}

/// The peer closed its comm: requests in flight fail now.
fn on_bye<S: Side>(st: &mut S) {
    die(
        st,
        "the peer closed its comm (NCCL closed it there, or that rank is shutting down)".to_owned(),
    );
}

/// Says `Bye` to the peer comm on close (best effort: a peer that misses it
/// finds out by its silence).
fn say_bye(p: &mut PeerLink, seat: &Seat) {
    if p.id != 0 && p.link.dead.is_none() {
        let _ = p.send(seat.ep(), Ctrl::Bye);
    }
}

/// Declares the peer dead: every request in flight fails, new ones are
/// refused, one WARN names the peer.
fn die<S: Side>(st: &mut S, why: String) {
    if st.peer().link.dead.is_some() {
        return;
    }
    let failed = st.fail_all();
    let p = st.peer();
    warn_dead(S::WHAT, &p.link.name, &why, failed);
    p.link.dead = Some(why);
}

/// One heartbeat tick (the keeper): `Alive` when due, progress, and death
/// after `timeout - period` of silence.
fn keepalive<S: Side>(st: &mut S, seat: &Seat, timeout: std::time::Duration, now: Instant) {
    if !st.linked() || st.peer().link.dead.is_some() {
        return;
    }
    let period = heartbeat_period(timeout);
    if st.peer().link.alive_due(now, period) {
        let p = st.peer();
        let r = p.send(seat.ep(), Ctrl::Alive);
        if let Err(e) = r {
            return die(
                st,
                format!("the provider reports the connection to the peer broken ({e})"),
            );
        }
        st.peer().link.last_said = Some(now);
    }
    if let Err(e) = st.progress(seat) {
        return die(st, format!("progress failed: {e}"));
    }
    let silent = st.peer().link.silence(now);
    if silent + period >= timeout {
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
            Error::internal(format!(
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

/// The truncation error, worded for the side that reports it.
fn truncation(side: &str, peer: &str, size: u64, tag: i32, cap: u64) -> Error {
    let msg = format!(
        "message truncated ({side}): {size} bytes with tag {tag} for a receive buffer of {cap} bytes at {peer}; \
         nothing was written. NCCL never sends more than the receiver posted, so both ranks must run the same NCCL"
    );
    tracing::warn!("{msg}");
    Error::internal(msg)
}
