//! The sending side: the connecting half of the handshake, credits, and
//! both data paths (the receiver's offers and writes; tagged sends).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use libfabric_sys as fi;

use super::super::ctrl::{frame_head, Peer, CTRL_HEAD};
use super::super::handshake::{self, nonce, Connecting, Phase};
use super::super::pool::Pool;
use super::super::hub::EAGER_LOCAL;
use super::super::wire::{Entries, RtrBuf, EAGER_HEAD};
use super::super::wire::{context, data_tag, immediate, NO_SIZE};
use super::super::{Comm, Done, Mem, ReqId, MAX_RECVS, MAX_REQUESTS};
use super::*;
use crate::fabric::FiAddr;

mod rdma;
mod tagged;

/// An Rtr that came ahead of its turn: the request slot, the buffers
/// offered (a mask) and their entries.
type Early = (u8, u8, Entries<RtrBuf>);

/// A sending comm (also the state of a `connect` in progress).
pub struct SendComm {
    dev: Arc<DeviceState>,
    listener_nonce: u64,
    seat: Seat,
    inner: Mutex<SendState>,
}

/// One buffer the receiver offered.
#[derive(Debug, Clone, Copy)]
struct Offer {
    slot: u8,
    sub: u8,
    buf: RtrBuf,
}

/// A send.
#[derive(Debug, Clone, Copy)]
struct SReq {
    size: usize,
    done: bool,
    /// The write failed (fi errno), or the peer died (0).
    err: Option<u32>,
    /// rdma: the offered buffer (slot, buffer) it writes, told of a failure.
    dst: Option<(u8, u8)>,
    /// Heartbeat ticks it has been in flight (rdma writes).
    ticks: u32,
}

struct SendState {
    path: Path,
    connect: Connecting,
    listener: Peer,
    listener_id: u32,
    peer: PeerLink,
    reqs: Pool<SReq>,
    /// Offered buffers, oldest first.
    offers: VecDeque<Offer>,
    /// The Rtr expected next, and those that arrived ahead of it (at
    /// most [`MAX_REQUESTS`] ahead: Rtr `seq` waits at `seq % MAX_REQUESTS`).
    next_seq: u32,
    early: Box<[Option<Early>]>,
    /// Messages sent so far per tag (the next message's number).
    sent: HashMap<i32, u32>,
    /// Messages the receiver still has room for (rdma: eager ones; tagged:
    /// any), and the most it granted.
    credits: u32,
    max_credits: u32,
    /// The largest eager message the receiver takes (rdma).
    eager_max: usize,
    /// RDMA: the receiver never sees a write's remote CQ data (its Ack
    /// said so): writes carry none and each is followed by a `Wrote`.
    writes_announced: bool,
    /// RDMA: the message last asked for with a [`Ctrl::Want`], `(tag,
    /// number)` (asked once, however often NCCL tries it).
    asked: Option<(i32, u32)>,
    /// The largest message injected (tagged).
    inject_max: usize,
    /// Tagged: the largest message sent before its receive is announced
    /// (the receiver's, from its Ack), and the receives announced so far
    /// per tag ([`Ctrl::Posted`]; at most [`ANNOUNCED_TAGS`] tags).
    unannounced_max: usize,
    announced: HashMap<i32, u32>,
    /// Scratch for encoding an eager message.
    scratch: Vec<u8>,
    /// Tagged data messages sent (wrapping; the receiver learns it from
    /// this comm's `Bye`).
    sent_tagged: u32,
}

impl std::fmt::Debug for SendComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SendComm(dev {}, id {})", self.dev.index, self.seat.id)
    }
}

impl SendComm {
    /// Starts connecting to the listener named by `handle`.
    pub fn start(
        dev: Arc<DeviceState>,
        path: Path,
        handle: &ListenHandle,
    ) -> Result<Self> {
        let seat = Seat::new(&dev, Port::Active)?;
        let listener = Peer::insert(seat.ep(), &handle.addr).map_err(|e| {
            if e.code == fi::FI_ENOTCONN {
                Error::peer_dead(format!("connect: the listener is gone: {e}"))
            } else {
                Error::bad_listen_handle(format!("the handle's listener address is unusable: {e}"))
            }
        })?;
        // One send per buffer NCCL may have posted (32 requests x 8).
        let reqs = Pool::new(MAX_REQUESTS * MAX_RECVS).map_err(|e| Error::system(e.to_string()))?;
        let connect = Connecting::new(
            nonce(),
            Instant::now(),
            heartbeat_period(dev.peer_timeout),
            dev.peer_timeout,
        );
        let inject_max = dev.eager_size.min(dev.dev.inject_size);
        let peer = PeerLink::new(&seat);
        Ok(Self {
            dev,
            listener_nonce: handle.nonce,
            seat,
            inner: Mutex::new(SendState {
                path,
                connect,
                listener,
                listener_id: handle.id,
                peer,
                reqs,
                offers: VecDeque::with_capacity(MAX_REQUESTS * MAX_RECVS),
                next_seq: 0,
                early: vec![None; MAX_REQUESTS].into_boxed_slice(),
                sent: HashMap::new(),
                credits: 0,
                max_credits: 0,
                eager_max: 0,
                writes_announced: false,
                asked: None,
                inject_max,
                unannounced_max: 0,
                announced: HashMap::new(),
                scratch: Vec::new(),
                sent_tagged: 0,
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
        let seat = &self.seat;
        handshake::connect_step(
            &mut *st,
            |st| &mut st.connect,
            |st| {
                let msg = Ctrl::Conn {
                    listener: self.listener_nonce,
                    conn: st.connect.conn(),
                    id: seat.id,
                    addr: seat.hub.name(Port::Active).to_vec(),
                };
                send_ctrl_to(seat.ep(), &st.listener, st.listener_id, seat.token, &msg)
            },
            |st| st.progress(seat),
            self.dev.peer_timeout,
        )
    }

    /// `Ok(None)` while the comm cannot take the send now (no credit, no
    /// offer yet on the RDMA path, the provider busy) or another thread
    /// holds it.
    unsafe fn isend(
        &self,
        data: *const u8,
        size: usize,
        tag: i32,
        mem: &[Mem],
        _phandle: *mut c_void,
    ) -> Result<Option<ReqId>> {
        let desc = Mem::first(mem).desc;
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        if st.connect.phase() != Phase::Ready {
            return Err(Error::internal(
                "isend on a comm whose connect has not finished",
            ));
        }
        st.peer.link.check()?;
        if st.peer.bye_heard {
            return Err(Error::peer_closed(format!(
                "isend to {}: {PEER_CLOSED}",
                st.peer.link.name
            )));
        }
        // SAFETY: passed on from the caller's contract.
        unsafe {
            match st.path {
                Path::Rdma => self.isend_rdma(&mut st, data, size, tag, desc),
                Path::Tagged => self.isend_tagged(&mut st, data, size, tag, desc),
            }
        }
    }
}

impl SendComm {
    /// The request id NCCL gets for slot `idx`.
    fn req_id(st: &SendState, idx: u32) -> Option<ReqId> {
        Some(ReqId {
            slot: idx,
            gen: st.reqs.gen(idx),
        })
    }

}

impl Comm for SendComm {
    fn rails(&self) -> &[Arc<DeviceState>] {
        std::slice::from_ref(&self.dev)
    }
    fn test(&self, id: ReqId) -> Result<Option<Done>> {
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        // A send is done once its write completed and its Wrote went out:
        // NCCL may never call into this comm again, and the receiver waits
        // for both; once the receiver said `Bye` it waits for nothing. (What
        // is owed then, the answering `Bye` or an `Alive`, the provider may
        // refuse for good once the receiver's process is gone: sends to
        // ranks that had received everything and exited were never
        // reported done.)
        let Some(r) = take_done(
            &mut *st,
            &self.seat,
            id,
            "send",
            |st| &mut st.reqs,
            |st, r| {
                r.done
                    && (st.peer.owed.is_empty() || st.peer.bye_heard || st.peer.link.dead.is_some())
            },
        )?
        else {
            return Ok(None);
        };
        match r.err {
            None => {
                let mut sizes = [0; MAX_RECVS];
                sizes[0] = r.size;
                Ok(Some(Done { n: 1, sizes }))
            }
            Some(0) => Err(st.peer.link.dead_error()),
            Some(e) => {
                let msg = format!(
                    "send of {} bytes to peer {} failed: {} (fi errno {e})",
                    r.size,
                    st.peer.link.name,
                    crate::fabric::strerror(e)
                );
                tracing::warn!("{msg}");
                Err(Error::remote(msg).of_kind(Kind::Provider(e)))
            }
        }
    }
    fn keepalive(&self, now: Instant) {
        keepalive_locked(&self.inner, &self.seat, self.dev.peer_timeout, now);
    }
    fn peer_name(&self) -> String {
        lock(&self.inner).peer.link.name.clone()
    }
    fn alive(&self) -> Result<()> {
        match try_lock(&self.inner) {
            Some(st) if st.peer.link.dead.is_some() => Err(st.peer.link.dead_error()),
            _ => Ok(()),
        }
    }
    #[cfg(feature = "testing")]
    fn hold(&self, held: &Tx<()>, release: &Rx<()>) {
        hold(&self.inner, held, release);
    }
    #[cfg(feature = "testing")]
    fn wire_id(&self) -> Option<(u32, u32)> {
        Some((self.seat.id, self.seat.token))
    }
    /// Never: nothing of NCCL's is posted to be written, and a closing send
    /// comm waits for its writes (see the module's "Liveness").
    #[cfg(feature = "testing")]
    fn endpoint_open(&self) -> bool {
        false
    }
}

impl Drop for SendComm {
    /// Says `Bye`, and waits, progressing, up to `WEFT_PEER_TIMEOUT` while
    /// the peer lives: for what the provider refused for now (`-FI_EAGAIN`,
    /// e.g. while writes are in flight), since nobody will send it later (a
    /// receive comm that is closing waits for it); and for writes and
    /// tagged sends in flight, whose source NCCL may free or reuse once the
    /// close returns (see the module's "Liveness"). Once the peer said
    /// `Bye` itself, its answer is owed for one heartbeat period more at
    /// most: a receive comm that waits for it is alive and takes it at once,
    /// and one that closed may be gone with its process (then the provider
    /// refuses the message for ever: a reducer closing its comms to ranks
    /// that had exited waited the whole timeout for each).
    fn drop(&mut self) {
        let st = &mut *lock(&self.inner);
        let sent = st.sent_tagged;
        st.peer.say_bye(self.seat.ep(), sent);
        let timeout = self.dev.peer_timeout;
        close_wait(
            st,
            &self.seat,
            timeout,
            |st| {
                (st.reading() || (!st.peer.owed.is_empty() && !st.peer.bye_heard))
                    && st.peer.link.dead.is_none()
            },
            Some("its sends in flight or its last control messages did not complete: the provider may still read NCCL's buffers, and the peer finds out by its silence"),
        );
        close_wait(
            st,
            &self.seat,
            heartbeat_period(timeout),
            |st| !st.peer.owed.is_empty() && st.peer.link.dead.is_none(),
            None,
        );
    }
}

impl Side for SendState {
    const WHAT: &'static str = "send comm to";
    fn peer(&mut self) -> &mut PeerLink {
        &mut self.peer
    }
    fn linked(&self) -> bool {
        self.connect.phase() == Phase::Ready
    }
    fn fail_all(&mut self) -> usize {
        self.reqs.fail_live(|r| {
            let was = !r.done;
            if was {
                r.done = true;
                r.err = Some(0);
            }
            was
        })
    }
    fn busy(&self) -> bool {
        self.reqs
            .live()
            .any(|i| self.reqs.get(i).is_some_and(|r| !r.done))
    }
    /// A write goes into a buffer the receiver offered, so it completes in
    /// network time; one in flight for `ticks` heartbeat periods while the
    /// peer still says Alive means the provider's connection is wedged (a
    /// refused write can leave tcp;ofi_rxm so). Its receiver is told, so its
    /// receive fails now rather than after its own timeout.
    fn stalled(&mut self, seat: &Seat, ticks: u32) -> Option<String> {
        let mut stuck = Vec::new();
        let live: Vec<u32> = self.reqs.live().collect();
        for i in live {
            if let Some(r) = self.reqs.get_mut(i).filter(|r| !r.done && r.dst.is_some()) {
                r.ticks += 1;
                if r.ticks >= ticks {
                    stuck.extend(r.dst);
                }
            }
        }
        if stuck.is_empty() {
            return None;
        }
        for (slot, sub) in stuck.iter().copied() {
            let _ = self.peer.send(
                seat.ep(),
                Ctrl::Failed {
                    slot,
                    sub,
                    err: fi::FI_ETIMEDOUT,
                },
            );
        }
        Some(format!(
            "{} write(s) in flight for over WEFT_PEER_TIMEOUT although the peer answers: the provider's connection to it is wedged",
            stuck.len()
        ))
    }
    fn progress(&mut self, seat: &Seat) -> Result<()> {
        self.peer.flush(seat.ep())?;
        seat.poll(|ev, bytes| {
            match ev {
                Ev::Ctrl { token, src, .. } => {
                    if self.connect.phase() != Phase::Ready {
                        // Only an Ack, from the listener's endpoint, is
                        // taken before the handshake is done.
                        return self.on_ack(seat, token, src, bytes);
                    }
                    if !self.peer.link.is_from_peer(token, src, seat.hub.sources()) {
                        return Ok(());
                    }
                    self.peer.link.heard = true;
                    self.on_ctrl(bytes);
                }
                Ev::Done(local, _) => {
                    if let Some(r) = self.reqs.get_mut(local).filter(|r| !r.done) {
                        r.done = true;
                    }
                }
                Ev::Failed(EAGER_LOCAL, e) => {
                    // Its send was reported done, and its receive waits for
                    // it: the comm cannot go on.
                    let why = if crate::fabric::breaks_connection(e.err) {
                        connection_broken(format_args!("an eager message failed: {e}"))
                    } else {
                        format!("an eager message to the peer failed in the provider: {e}")
                    };
                    die(self, why);
                }
                Ev::Failed(local, e) => {
                    tracing::warn!("send comm to {}: a send failed: {e}", self.peer.link.name);
                    // A provider that says the connection is gone fails
                    // this send and every other as a dead peer (0: the
                    // comm's death is the error).
                    let broken = crate::fabric::breaks_connection(e.err);
                    let mut tell = None;
                    if let Some(r) = self.reqs.get_mut(local).filter(|r| !r.done) {
                        r.done = true;
                        r.err = Some(if broken { 0 } else { e.err.max(1) });
                        tell = r.dst;
                    }
                    if broken {
                        die(self, connection_broken(format_args!("a send failed: {e}")));
                    } else if let Some((slot, sub)) = tell {
                        // The receive it wrote for would wait forever: it
                        // fails too.
                        let msg = Ctrl::Failed {
                            slot,
                            sub,
                            err: e.err.max(1),
                        };
                        self.peer.send(seat.ep(), msg)?;
                    }
                }
                Ev::Landed(..) => {
                    tracing::debug!("send comm: ignored a write into its memory")
                }
            }
            Ok(())
        })?;
        // The receiver said Bye: once none of this comm's writes is in
        // flight, the answering Bye tells it nothing more will land, so its
        // close can return.
        if self.peer.bye_heard && !self.peer.bye_said && !self.busy() {
            let sent = self.sent_tagged;
            self.peer.say_bye(seat.ep(), sent);
        }
        Ok(())
    }
}

/// Tagged: most tags a send comm keeps receive announcements for (NCCL
/// uses a handful per comm; a receiver naming more is not NCCL's).
const ANNOUNCED_TAGS: usize = 1024;

impl SendState {
    /// Tagged: whether the receiver announced its receive number `number`
    /// of `tag` (wrapping counts).
    fn is_announced(&self, tag: i32, number: u32) -> bool {
        self.announced
            .get(&tag)
            .is_some_and(|&count| (count.wrapping_sub(number) as i32) > 0)
    }

    /// Whether the provider may still read a send's source: a write into an
    /// offered buffer (rdma) or a tagged send (each goes into a receive the
    /// peer posted, or is small enough to leave at once: it completes in
    /// network time), not yet complete.
    fn reading(&self) -> bool {
        self.reqs.live().any(|i| {
            self.reqs
                .get(i)
                .is_some_and(|r| !r.done && (r.dst.is_some() || self.path == Path::Tagged))
        })
    }

    /// The receiver returned `count` credits (on a `Credit` or an `Rtr`).
    fn return_credits(&mut self, count: u32) {
        // A peer can never grant more than it announced.
        self.credits = self.credits.saturating_add(count).min(self.max_credits);
    }

    /// Where in `offers` the buffer for message `k` of `tag` is.
    fn offer(&self, tag: i32, k: u32) -> Option<usize> {
        self.offers
            .iter()
            .position(|o| o.buf.tag == tag && o.buf.idx == k)
    }

    /// A control message from the peer, once connected.
    fn on_ctrl(&mut self, bytes: &[u8]) {
        match Ctrl::decode(bytes) {
            Ok(Ctrl::Rtr {
                seq,
                slot,
                credits,
                subs,
                bufs,
            }) if self.path == Path::Rdma && !self.peer.bye_heard => {
                self.return_credits(credits.into());
                let ahead = seq.wrapping_sub(self.next_seq) as usize;
                if usize::from(slot) >= MAX_REQUESTS || ahead >= MAX_REQUESTS {
                    tracing::warn!(
                        "send comm to {}: ignored an offer for request slot {slot}, number {seq} ({ahead} ahead of the next)",
                        self.peer.link.name,
                    );
                    return;
                }
                self.early[seq as usize % MAX_REQUESTS] = Some((slot, subs, bufs));
                while let Some((slot, subs, bufs)) =
                    self.early[self.next_seq as usize % MAX_REQUESTS].take()
                {
                    self.next_seq = self.next_seq.wrapping_add(1);
                    // Entry i is for the i-th buffer the mask names.
                    let named = (0..MAX_RECVS as u8).filter(|s| subs & (1 << s) != 0);
                    for (sub, buf) in named.zip(bufs) {
                        // A buffer whose message already went eagerly.
                        let sent = self.sent.get(&buf.tag).copied().unwrap_or(0);
                        if buf.idx.wrapping_sub(sent) >= u32::MAX / 2 {
                            continue;
                        }
                        self.offers.push_back(Offer {
                            slot,
                            sub,
                            buf,
                        });
                    }
                }
            }
            Ok(Ctrl::Alive) => {}
            Ok(Ctrl::Bye { .. }) => {
                // The receive comm is closing: none of its offers may be
                // written any more (NCCL frees those buffers after the
                // close). Sends already with the provider end with their
                // own completion; new ones are refused.
                self.peer.bye_heard = true;
                self.offers.clear();
                self.early.fill(None);
            }
            Ok(Ctrl::Credit { count }) => self.return_credits(count),
            Ok(Ctrl::Posted { counts }) if self.path == Path::Tagged => {
                for (tag, count) in counts {
                    let known = self.announced.len() < ANNOUNCED_TAGS;
                    match self.announced.get_mut(&tag) {
                        // Cumulative: an older announcement changes nothing.
                        Some(c) if (count.wrapping_sub(*c) as i32) > 0 => *c = count,
                        Some(_) => {}
                        None if known => {
                            self.announced.insert(tag, count);
                        }
                        None => tracing::warn!(
                            "send comm to {}: ignored receives announced for tag {tag}, beyond {ANNOUNCED_TAGS} tags",
                            self.peer.link.name
                        ),
                    }
                }
            }
            Ok(other) => tracing::warn!("send comm: ignored unexpected control message {other:?}"),
            Err(e) => tracing::warn!("send comm: ignored a bad control message: {e}"),
        }
    }

    /// A control message while connecting: the listener's Ack (sent by the
    /// new receive comm, with its token, from the listener's endpoint) makes
    /// the link; anything else is dropped.
    fn on_ack(&mut self, seat: &Seat, token: u32, src: FiAddr, bytes: &[u8]) -> Result<()> {
        if seat.hub.sources() && src != self.listener.addr {
            // Only the listener's endpoint knows a connecting comm's id.
            tracing::warn!(
                "send comm connecting to {}: dropped a message from address {src:#x}, not the listener's ({:#x})",
                self.peer.link.name,
                self.listener.addr
            );
            return Ok(());
        }
        match Ctrl::decode(bytes) {
            Ok(Ctrl::Ack {
                conn,
                id,
                addr,
                credits,
                eager,
                announce,
            }) if self.connect.takes_ack(conn) && token != 0 => {
                if id == 0 || id >= super::super::wire::MAX_ID {
                    tracing::warn!("send comm: ignored an Ack naming comm id {id}");
                    return Ok(());
                }
                if let Err(e) = self.peer.link.connect(seat.ep(), &addr) {
                    tracing::warn!("send comm: ignored an Ack with an unusable address: {e}");
                    return Ok(());
                }
                self.peer.id = id;
                self.peer.link.token = token;
                seat.inbox.expect(token);
                self.peer.link.heard = true;
                self.max_credits = credits.clamp(1, self.path.credits().0);
                self.credits = self.max_credits;
                // rdma: the largest eager message; tagged: the largest sent
                // before its receive is announced.
                self.eager_max = (eager as usize).min(seat.hub.eager_max());
                self.unannounced_max = eager as usize;
                self.writes_announced = announce;
                self.connect.connected();
                // The first Alive confirms the connection to `accept`.
                self.peer.send(seat.ep(), Ctrl::Alive).map_err(|e| {
                    e.context(format!(
                        "connect: cannot reach the accepting peer {}",
                        self.peer.link.name
                    ))
                })?;
                self.peer.link.last_said = Some(Instant::now());
            }
            Ok(other) => tracing::debug!("send comm: ignored {other:?} while connecting"),
            Err(e) => tracing::warn!("send comm: ignored a bad control message: {e}"),
        }
        Ok(())
    }
}
