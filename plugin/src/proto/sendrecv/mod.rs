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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libfabric_sys as fi;

use super::ctrl::{send_ctrl, silent_peer, warn_dead, CtrlBufs, Link, Peer};
use super::handshake::{self, nonce, Connecting, Handshakes, Phase, Step};
use super::pool::{Pool, SLOT_ALIGN};
use super::sync::{hold, keeper_lock, lock, try_lock};
use super::wire::{Ctrl, ListenHandle};
use super::{
    heartbeat_period, Comm, DeviceState, Done, Listener, Protocol, Receiver, RecvBuf, ReqId,
    Sender, MAX_RECVS, MAX_REQUESTS,
};
use crate::error::{Error, Result};
use crate::fabric::{Completion, CompletionError, Endpoint};

mod listen;
mod liveness;
mod recv;
mod request;
mod send;

use super::cq::{drain, Event};
use liveness::*;
use request::*;

pub use listen::ListenComm;
pub use recv::RecvComm;
pub use send::SendComm;

pub use super::ctrl::CTRL_TAG;
/// Credits are returned once this many are owed.
pub const CREDIT_BATCH: u32 = 64;
/// Messages a sender may have unmatched at the receiver: NCCL's most in
/// flight on a send comm (32 requests x 8 receives), plus one batch, since up
/// to a batch less one may be owed but not yet returned.
pub const CREDITS: u32 = (MAX_REQUESTS * MAX_RECVS) as u32 + CREDIT_BATCH;
/// Control receives kept posted per endpoint.
const CTRL_POSTED: usize = 4;
/// `ReqErr::fi_err` of requests failed because their peer died.
const PEER_DEAD: u32 = 0;

/// The SENDRECV protocol.
#[derive(Debug, Clone, Copy)]
pub struct SendRecv;

impl Protocol for SendRecv {
    fn name(&self) -> &'static str {
        "sendrecv"
    }
    fn wire_id(&self) -> u8 {
        super::wire::PROTO_SENDRECV
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

/// Send and receive comms: a device and a state behind one lock. What
/// [`Comm`] asks of them is the same for both.
trait Locked: Send + Sync + std::fmt::Debug {
    type State: Side + Send;
    fn device(&self) -> &Arc<DeviceState>;
    fn state(&self) -> &Mutex<Self::State>;
}

impl<T: Locked> Comm for T {
    fn dev(&self) -> &Arc<DeviceState> {
        self.device()
    }
    fn test(&self, id: ReqId) -> Result<Option<Done>> {
        test_locked(self.state(), id)
    }
    fn keepalive(&self, now: Instant) {
        keepalive_locked(self.state(), self.device().peer_timeout, now);
    }
    fn peer_name(&self) -> String {
        lock(self.state()).parts().2.name.clone()
    }
    fn hold(&self, held: &Tx<()>, release: &Rx<()>) {
        hold(self.state(), held, release);
    }
    fn endpoint_open(&self) -> bool {
        !lock(self.state()).parts().0.is_shut_down()
    }
}

/// One endpoint with its CQ and AV on a device's domain.
fn open_endpoint(dev: &DeviceState) -> Result<Endpoint> {
    Ok(Endpoint::open_own(&dev.domain)?)
}
