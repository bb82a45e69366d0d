//! The receiving side. RDMA: offers buffers with `Rtr`, completes them when
//! the write's immediate and its size both arrived. Tagged: posts them to
//! the shared endpoint in NCCL's order, and takes back (cancels) what is
//! still posted when the peer dies or the comm closes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use libfabric_sys as fi;

use crate::fabric::CompletionError;

use super::super::grave::{Closed, GRAVE_TAGS};
use super::super::pool::Pool;
use super::super::wire::{Entries, RtrBuf};
use super::super::wire::{context, data_tag};
use super::super::{Comm, Done, Hold, Mem, Receiver, RecvBuf, ReqId, MAX_RECVS, MAX_REQUESTS};
use super::*;

mod rdma;
mod tagged;

/// Most receives not yet posted a sender can have asked for: it asks for
/// one message per tag at a time, and NCCL uses a handful of tags per comm.
const WANTED: usize = 64;

/// A receiving comm.
pub struct RecvComm {
    dev: Arc<DeviceState>,
    seat: Seat,
    inner: Mutex<RecvState>,
}

/// A grouped receive.
#[derive(Debug, Clone, Copy)]
struct RReq {
    n: u8,
    caps: [u64; MAX_RECVS],
    tags: [i32; MAX_RECVS],
    /// Which receive of its tag each buffer is.
    idxs: [u32; MAX_RECVS],
    /// Each buffer's offer ticket (see [`RtrBuf::ticket`]).
    tickets: [u32; MAX_RECVS],
    /// RDMA: where a write into each buffer goes (an address or an offset,
    /// as [`RtrBuf::addr`]) and its registration's remote key.
    addrs: [u64; MAX_RECVS],
    keys: [u64; MAX_RECVS],
    /// RDMA: buffers offered (bit per buffer), and those the sender asked
    /// for ([`Ctrl::Want`]) and not yet offered.
    offered: u8,
    wanted: u8,
    /// NCCL's buffers (eager data is copied there) and their descriptors.
    data: [usize; MAX_RECVS],
    descs: [usize; MAX_RECVS],
    sizes: [usize; MAX_RECVS],
    /// Buffers whose write landed (bit per buffer).
    landed: u8,
    /// Buffers whose size is known.
    sized: u8,
    /// A buffer's message was too large: (buffer, bytes where known, whether
    /// the peer wrote them anyway).
    trunc: Option<(u8, Option<u64>, bool)>,
    /// A buffer's receive failed in the provider: (buffer, fi errno).
    failed: Option<(u8, u32)>,
    /// The peer was declared dead.
    dead: bool,
    /// Tagged: buffers posted to the provider and not yet returned by it,
    /// and those of them whose cancel was asked.
    posted: u8,
    cancelled: u8,
}

impl RReq {
    fn all(&self) -> u8 {
        ((1u16 << self.n) - 1) as u8
    }
    /// Done, one way or another, with nothing left with the provider.
    fn finished(&self) -> bool {
        (self.dead || (self.landed & self.sized) == self.all()) && self.posted == 0
    }
    /// Buffer `sub` gets `size` bytes, `written` by the peer (else copied
    /// here, only if they fit). The sender checks the size against the
    /// offer; a peer that did not gets a truncation error here.
    fn size(&mut self, sub: u8, size: u64, written: bool) {
        let s = usize::from(sub);
        if size > self.caps[s] {
            self.trunc.get_or_insert((sub, Some(size), written));
            self.landed |= 1 << sub;
        }
        self.sizes[s] = size as usize;
        self.sized |= 1 << sub;
    }
}

struct RecvState {
    path: Path,
    peer: PeerLink,
    reqs: Pool<RReq>,
    /// The next Rtr's sequence number.
    seq: u32,
    /// RDMA: the largest eager message this side takes (the Ack said it):
    /// a receive no larger is not offered; the sender sends into it eagerly
    /// or asks for it ([`Ctrl::Want`]).
    eager_max: usize,
    /// RDMA: receives the sender asked for before they were posted,
    /// `(tag, number)` (it asks for one message at a time per tag).
    wanted: arrayvec::ArrayVec<(i32, u32), WANTED>,
    /// RDMA: a request has `wanted` buffers to offer.
    want_due: bool,
    /// RDMA: receives larger than the eager limit are offered only when
    /// asked for, as the small ones are: the last ones were filled by eager
    /// messages, so their offers were messages on the wire for nothing
    /// (NCCL posts whole steps, whatever it sends). A `Want` for a message
    /// too large to go eagerly ends it. See [`RecvState::offer`].
    lazy: bool,
    /// RDMA: large receives filled eagerly since the last write landed.
    wasted: u8,
    /// RDMA: writes here raise no remote CQ data (the hub's `announce`),
    /// so a buffer's `Wrote`, which the provider delivers after the write's
    /// data, says it landed.
    writes_announced: bool,
    /// Draws offer tickets: SipHash under a random key, of a counter.
    tickets: (std::hash::RandomState, u64),
    /// Address buffers by offset into their registration (the provider's MR
    /// mode lacks FI_MR_VIRT_ADDR).
    offsets: bool,
    /// Receives posted so far per tag (the next buffer's number).
    next_idx: HashMap<i32, u32>,
    /// Eager messages that arrived before their receive was posted
    /// (at most EAGER_CREDITS).
    stash: HashMap<(i32, u32), Vec<u8>>,
    /// Buffers of stashed messages since taken, for the next ones.
    spare: Vec<Vec<u8>>,
    /// Credits to return (rdma: eager messages consumed; tagged: messages
    /// matched).
    credits_owed: u32,
    /// Tagged: buffers (slot, buffer) the provider refused for now
    /// (FI_EAGAIN), posted in order before any later one.
    to_post: VecDeque<(u32, u8)>,
    /// Tagged: data messages matched so far (wrapping), and how many the
    /// sender sent in all, from its `Bye`.
    matched: u32,
    peer_sent: Option<u32>,
    /// Tagged: receives posted with the provider so far per tag (wrapping),
    /// those to announce to the sender ([`Ctrl::Posted`]), and the size
    /// above which a receive is announced (see the module's "Tagged").
    posted_count: HashMap<i32, u32>,
    announce: Vec<(i32, u32)>,
    announce_above: usize,
    /// Tagged: the largest receive posted and the first tags posted (a
    /// grave drains with both: [`super::super::grave`]).
    max_cap: usize,
    tags: Vec<i32>,
    /// What keeps each request's buffers registered until NCCL is told it
    /// is done (slot * MAX_RECVS + buffer; see [`Hold`]). Dropped with the
    /// state, after the close waited for the sender's answering `Bye`.
    holds: Vec<Option<Hold>>,
}

impl std::fmt::Debug for RecvComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecvComm(dev {}, id {})", self.dev.index, self.seat.id)
    }
}

impl RecvComm {
    pub(super) fn open(dev: Arc<DeviceState>, path: Path) -> Result<Self> {
        let seat = Seat::new(&dev, Port::Passive)?;
        let reqs = Pool::new(MAX_REQUESTS).map_err(|e| Error::system(e.to_string()))?;
        let offsets = !dev.virt_addr();
        let peer = PeerLink::new(&seat);
        let announce_above = super::unannounced_max(&dev);
        let dev_eager_max = seat.hub.eager_max();
        let writes_announced = path == Path::Rdma && seat.hub.announce();
        Ok(Self {
            dev,
            seat,
            inner: Mutex::new(RecvState {
                path,
                peer,
                reqs,
                seq: 0,
                eager_max: dev_eager_max,
                wanted: arrayvec::ArrayVec::new(),
                want_due: false,
                lazy: false,
                wasted: 0,
                writes_announced,
                tickets: (std::hash::RandomState::new(), 0),
                offsets,
                next_idx: HashMap::new(),
                stash: HashMap::new(),
                spare: Vec::new(),
                credits_owed: 0,
                to_post: VecDeque::new(),
                matched: 0,
                peer_sent: None,
                posted_count: HashMap::new(),
                announce: Vec::new(),
                announce_above,
                max_cap: 0,
                tags: Vec::new(),
                holds: vec![None; MAX_REQUESTS * MAX_RECVS],
            }),
        })
    }

    /// Records the connecting comm (`id` at `addr`, with `token`); returns
    /// this comm's id.
    pub(super) fn link_to(&self, addr: &[u8], id: u32, token: u32) -> Result<u32> {
        let mut st = lock(&self.inner);
        st.peer.link.connect(self.seat.ep(), addr)?;
        st.peer.id = id;
        st.peer.link.token = token;
        self.seat.inbox.expect(token);
        Ok(self.seat.id)
    }

    /// Sends a handshake message to the peer.
    pub(super) fn say(&self, msg: Ctrl) -> Result<()> {
        lock(&self.inner).peer.send(self.seat.ep(), msg)
    }

    /// Progresses; true once something arrived from the peer.
    pub(super) fn confirmed(&self) -> Result<bool> {
        let mut st = lock(&self.inner);
        st.progress(&self.seat)?;
        Ok(st.peer.link.heard)
    }
}

impl Receiver for RecvComm {
    /// `Ok(None)` when all requests are in use, or while another thread
    /// holds the comm.
    unsafe fn irecv(&self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        super::super::check_recv_count(bufs.len())?;
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        st.peer.link.check()?;
        st.check_after_bye(bufs)?;
        let mut req = RReq {
            n: bufs.len() as u8,
            caps: [0; MAX_RECVS],
            tags: [0; MAX_RECVS],
            idxs: [0; MAX_RECVS],
            tickets: [0; MAX_RECVS],
            addrs: [0; MAX_RECVS],
            keys: [0; MAX_RECVS],
            offered: 0,
            wanted: 0,
            data: [0; MAX_RECVS],
            descs: [0; MAX_RECVS],
            sizes: [0; MAX_RECVS],
            landed: 0,
            sized: 0,
            trunc: None,
            failed: None,
            dead: false,
            posted: 0,
            cancelled: 0,
        };
        for (i, b) in bufs.iter().enumerate() {
            req.caps[i] = b.size as u64;
            req.tags[i] = b.tag;
            req.data[i] = b.data as usize;
            let mem = Mem::first(b.mem);
            req.descs[i] = mem.desc as usize;
            req.keys[i] = mem.key;
            req.addrs[i] = if st.offsets {
                (b.data as usize - mem.base) as u64
            } else {
                b.data as u64
            };
        }
        if st.reqs.in_use() >= MAX_REQUESTS {
            st.progress(&self.seat)?;
            return Ok(None);
        }
        let Some((_, slot)) = st.reqs.insert(req) else {
            return Err(Error::system(
                "irecv: the request pool is full though it had room",
            ));
        };
        st.hold(slot, bufs);
        let offered = match st.path {
            Path::Rdma => st.offer(&self.seat, slot),
            Path::Tagged => st.post_all(&self.seat, slot),
        };
        if let Err(e) = offered {
            // A hard provider error, possibly part way through a grouped
            // receive: the comm cannot go on. What was posted is cancelled
            // (the request, which NCCL never sees, stays until it is back).
            die(&mut *st, format!("posting a receive failed: {e}"));
            if st.reqs.get(slot).is_some_and(|r| r.posted == 0) {
                st.reqs.release(slot);
                st.hold(slot, &[]);
            }
            return Err(e);
        }
        Ok(Some(ReqId {
            slot,
            gen: st.reqs.gen(slot),
        }))
    }
}

impl Comm for RecvComm {
    fn rails(&self) -> &[Arc<DeviceState>] {
        std::slice::from_ref(&self.dev)
    }
    fn test(&self, id: ReqId) -> Result<Option<Done>> {
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        let Some(r) = take_done(
            &mut *st,
            &self.seat,
            id,
            "receive",
            |st| &mut st.reqs,
            |_, r| r.finished(),
        )?
        else {
            return Ok(None);
        };
        st.hold(id.slot, &[]);
        if r.dead {
            return Err(match st.peer.link.dead {
                Some(_) => st.peer.link.dead_error(),
                None => Error::peer_closed(format!(
                    "receive from {}: {PEER_CLOSED}; this message never came",
                    st.peer.link.name
                )),
            });
        }
        if let Some((sub, e)) = r.failed {
            let msg = format!(
                "receive into buffer {sub} from peer {} failed: {} (fi errno {e}); if NCCL deregistered the buffer while the receive was in flight, that is the cause",
                st.peer.link.name,
                crate::fabric::strerror(e)
            );
            tracing::warn!("{msg}");
            return Err(Error::remote(msg));
        }
        if let Some((sub, size, written)) = r.trunc {
            let s = usize::from(sub);
            return Err(truncation(
                "receive",
                &st.peer.link.name,
                size,
                r.tags[s],
                r.caps[s],
                written,
            ));
        }
        Ok(Some(Done {
            n: usize::from(r.n),
            sizes: r.sizes,
        }))
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
    /// Whether the provider still holds a posted buffer (tagged receives
    /// only: RDMA buffers are offered to the peer, never posted).
    #[cfg(feature = "testing")]
    fn endpoint_open(&self) -> bool {
        lock(&self.inner).holds_posted()
    }
}

impl Drop for RecvComm {
    /// Says `Bye`. RDMA: while buffers are offered, waits for the sender's
    /// answering `Bye` (it writes nothing after it), its death, or
    /// `WEFT_PEER_TIMEOUT`: NCCL may free its buffers once close returns.
    /// Tagged: takes back what is still posted, waiting for the provider up
    /// to `WEFT_PEER_TIMEOUT`.
    fn drop(&mut self) {
        let st = &mut *lock(&self.inner);
        // The peer may still send: it is linked and alive (the grave
        // checks what its Bye said).
        let may_send = st.path == Path::Tagged && st.peer.id != 0 && st.peer.link.dead.is_none();
        st.peer.say_bye(self.seat.ep(), 0);
        let timeout = self.dev.peer_timeout;
        if st.path == Path::Rdma && st.busy() && st.peer.bye_said {
            // The sender answers when it is next progressed: by NCCL, or by
            // its keeper (hurried here for a sender in this process; another
            // process's ticks once a heartbeat period).
            close_wait(
                st,
                &self.seat,
                timeout,
                |st| !st.peer.bye_heard && st.peer.link.dead.is_none(),
                Some("with buffers offered, the sender did not answer its Bye: it may still write into them"),
            );
        }
        if st.peer.link.dead.is_none() {
            st.peer.link.dead = Some((Kind::PeerDead, "the comm was closed".to_owned()));
        }
        close_wait(
            st,
            &self.seat,
            timeout,
            RecvState::holds_posted,
            Some("the provider did not return posted receives: it may still write into them"),
        );
        if may_send {
            // What it still sends is drained into the hub's own memory.
            self.seat.hub.dig(Closed {
                id: self.seat.id,
                src: st.peer.link.peer.addr,
                token: st.peer.link.token,
                taken: st.matched,
                sent: st.peer_sent,
                cap: st.max_cap,
                tags: std::mem::take(&mut st.tags),
            });
        }
    }
}

impl Side for RecvState {
    const WHAT: &'static str = "receive comm from";
    fn peer(&mut self) -> &mut PeerLink {
        &mut self.peer
    }
    fn linked(&self) -> bool {
        self.peer.id != 0
    }
    fn fail_all(&mut self) -> usize {
        self.reqs.fail_live(|r| {
            let was = !r.finished();
            r.dead |= was;
            was
        })
    }
    fn busy(&self) -> bool {
        self.reqs
            .live()
            .any(|i| self.reqs.get(i).is_some_and(|r| !r.finished()))
    }
    fn progress(&mut self, seat: &Seat) -> Result<()> {
        if self.peer.link.dead.is_some() {
            // Only take back what the provider still holds.
            self.to_post.clear();
            self.cancel_posted(seat);
            return seat.poll(|ev, bytes| {
                if seat.is_from_peer(&mut self.peer.link, &ev) {
                    self.on_event(ev, bytes);
                }
                Ok(())
            });
        }
        self.peer.flush(seat.ep())?;
        if self.credits_owed >= self.path.credits().1 {
            let count = std::mem::take(&mut self.credits_owed);
            self.peer.send(seat.ep(), Ctrl::Credit { count })?;
        }
        seat.poll(|ev, bytes| {
            if seat.is_from_peer(&mut self.peer.link, &ev) {
                self.peer.link.heard = true;
                self.on_event(ev, bytes);
            }
            Ok(())
        })?;
        if self.want_due {
            self.offer_wanted(seat)?;
        }
        self.post_pending(seat)
    }
}

impl RecvState {
    /// Request `slot` holds the registrations of `bufs` (none: lets go).
    fn hold(&mut self, slot: u32, bufs: &[RecvBuf]) {
        let at = slot as usize * MAX_RECVS;
        for (i, h) in self.holds[at..at + MAX_RECVS].iter_mut().enumerate() {
            *h = bufs.get(i).and_then(|b| b.hold.cloned());
        }
    }

    /// After the sender's `Bye`, what can never come fails: RDMA, every
    /// request not finished (all it sent arrived before its Bye; eager
    /// messages wait in the stash for receives posted later); tagged, once
    /// every message it sent was matched, every request left (the others
    /// may still match messages on their way).
    fn settle_after_bye(&mut self) {
        if !self.peer.bye_heard || self.peer.link.dead.is_some() {
            return;
        }
        match self.path {
            Path::Rdma => {
                let failed = self.fail_all();
                if failed > 0 {
                    tracing::warn!(
                        "receive comm from {}: {PEER_CLOSED}; {failed} receive(s) its messages can no longer fill failed",
                        self.peer.link.name
                    );
                }
            }
            Path::Tagged => {
                if self.peer_sent == Some(self.matched) {
                    die_as(self, Kind::PeerClosed, PEER_CLOSED.to_owned());
                }
            }
        }
    }

    /// A new receive after the sender's `Bye`: RDMA, only one the stash can
    /// fill whole; tagged, only while messages it sent are unmatched.
    fn check_after_bye(&self, bufs: &[RecvBuf]) -> Result<()> {
        if !self.peer.bye_heard {
            return Ok(());
        }
        let servable = match self.path {
            Path::Rdma => {
                let mut next = self.next_idx.clone();
                bufs.iter().all(|b| {
                    let k = next.entry(b.tag).or_insert(0);
                    let hit = self.stash.contains_key(&(b.tag, *k));
                    *k = k.wrapping_add(1);
                    hit
                })
            }
            Path::Tagged => self.peer_sent != Some(self.matched),
        };
        if servable {
            return Ok(());
        }
        Err(Error::peer_closed(format!(
            "irecv from {}: {PEER_CLOSED}, and nothing it sent is left for this receive",
            self.peer.link.name
        )))
    }

    /// Whether the provider holds a buffer of any request.
    fn holds_posted(&self) -> bool {
        self.reqs
            .live()
            .any(|i| self.reqs.get(i).is_some_and(|r| r.posted != 0))
    }

    fn on_event(&mut self, ev: Ev, bytes: &[u8]) {
        match ev {
            Ev::Landed(local, hi) => self.on_landed(local >> 3, local & 7, hi),
            Ev::Ctrl { .. } => self.on_ctrl(bytes),
            Ev::Done(local, len) => self.on_received(local, Ok(len)),
            Ev::Failed(local, e) => self.on_received(local, Err(e)),
        }
    }

    /// The buffer a peer's message names, if it is one in flight.
    fn buffer(&mut self, slot: u8, sub: u8, what: &str) -> Option<&mut RReq> {
        let slot32 = u32::from(slot);
        if !self
            .reqs
            .get(slot32)
            .is_some_and(|r| sub < r.n && !r.finished())
        {
            tracing::warn!(
                "receive comm from {}: ignored {what} for buffer {sub} of request slot {slot}, which is not in flight",
                self.peer.link.name
            );
            return None;
        }
        self.reqs.get_mut(slot32)
    }

    fn on_ctrl(&mut self, bytes: &[u8]) {
        // The message of the data path, read in place (no copy but the one
        // into NCCL's buffer).
        if let Some((tag, idx, data)) = super::super::wire::eager(bytes) {
            return self.on_eager(tag, idx, data);
        }
        match Ctrl::decode(bytes) {
            Ok(Ctrl::Alive) => {}
            Ok(Ctrl::Bye { sent }) => {
                self.peer.bye_heard = true;
                self.peer_sent = Some(sent);
                self.settle_after_bye();
            }
            Ok(Ctrl::Wrote { slot, sub, size }) => {
                if self.writes_announced && size > 0 {
                    // The write's data came before its Wrote.
                    self.on_landed(slot, sub, None);
                }
                if let Some(r) = self.buffer(slot, sub, "a size") {
                    if size == 0 {
                        // Nothing to write: no immediate comes.
                        r.landed |= 1 << sub;
                    }
                    r.size(sub, size, true);
                }
            }
            Ok(Ctrl::Failed { slot, sub, err }) => {
                if let Some(r) = self.buffer(slot, sub, "a failed write") {
                    r.failed.get_or_insert((sub, err));
                    r.landed |= 1 << sub;
                    r.sized |= 1 << sub;
                }
            }
            Ok(Ctrl::Want { tag, idx, large }) if self.path == Path::Rdma => {
                self.on_want(tag, idx, large)
            }
            Ok(Ctrl::Trunc { slot, sub, size }) => {
                if let Some(r) = self.buffer(slot, sub, "a truncation") {
                    r.trunc.get_or_insert((sub, Some(size), false));
                    r.landed |= 1 << sub;
                    r.sized |= 1 << sub;
                }
            }
            Ok(other) => {
                tracing::warn!("receive comm: ignored unexpected control message {other:?}")
            }
            Err(e) => tracing::warn!("receive comm: ignored a bad control message: {e}"),
        }
    }
}
