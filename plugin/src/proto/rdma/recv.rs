//! The receiving side: offers buffers with `Rtr`, completes them when the
//! write's immediate and its `Wrote` both arrived.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::super::pool::Pool;
use super::super::wire::RtrBuf;
use super::super::{Comm, Done, Receiver, RecvBuf, ReqId, MAX_RECVS, MAX_REQUESTS};
use super::*;

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
    /// NCCL's buffers (eager data is copied there).
    data: [usize; MAX_RECVS],
    sizes: [usize; MAX_RECVS],
    /// Buffers whose write landed (bit per buffer).
    landed: u8,
    /// Buffers whose size is known.
    sized: u8,
    /// A buffer's message was too large: (buffer, bytes).
    trunc: Option<(u8, u64)>,
    /// The peer was declared dead.
    dead: bool,
}

impl RReq {
    fn all(&self) -> u8 {
        ((1u16 << self.n) - 1) as u8
    }
    fn finished(&self) -> bool {
        self.dead || (self.landed & self.sized) == self.all()
    }
    /// Buffer `sub` gets `size` bytes. The sender checks the size against
    /// the offer; a peer that did not gets a truncation error here.
    fn size(&mut self, sub: u8, size: u64) {
        let s = usize::from(sub);
        if size > self.caps[s] {
            self.trunc.get_or_insert((sub, size));
            self.landed |= 1 << sub;
        }
        self.sizes[s] = size as usize;
        self.sized |= 1 << sub;
    }
}

struct RecvState {
    peer: PeerLink,
    reqs: Pool<RReq>,
    /// The next Rtr's sequence number.
    seq: u32,
    /// Address buffers by offset into their registration (the provider's MR
    /// mode lacks FI_MR_VIRT_ADDR).
    offsets: bool,
    /// Receives posted so far per tag (the next buffer's number).
    next_idx: HashMap<i32, u32>,
    /// Eager messages that arrived before their receive was posted
    /// (at most EAGER_CREDITS).
    stash: HashMap<(i32, u32), Vec<u8>>,
    /// Eager credits to return.
    credits_owed: u32,
}

impl std::fmt::Debug for RecvComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rdma RecvComm(dev {}, id {})",
            self.dev.index, self.seat.id
        )
    }
}

impl RecvComm {
    pub(super) fn open(dev: Arc<DeviceState>) -> Result<Self> {
        let seat = Seat::new(&dev, Port::Passive)?;
        let reqs = Pool::new(MAX_REQUESTS).map_err(|e| Error::system(e.to_string()))?;
        let offsets = !dev.virt_addr();
        Ok(Self {
            dev,
            seat,
            inner: Mutex::new(RecvState {
                peer: PeerLink::new(),
                reqs,
                seq: 0,
                offsets,
                next_idx: HashMap::new(),
                stash: HashMap::new(),
                credits_owed: 0,
            }),
        })
    }

    /// Records the connecting comm (`id` at `addr`); returns this comm's id.
    pub(super) fn link_to(&self, addr: &[u8], id: u32) -> Result<u32> {
        let mut st = lock(&self.inner);
        st.peer.link.connect(self.seat.ep(), addr)?;
        st.peer.id = id;
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
    unsafe fn irecv(&self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        super::super::check_recv_count(bufs.len())?;
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        st.peer.link.check()?;
        let mut req = RReq {
            n: bufs.len() as u8,
            caps: [0; MAX_RECVS],
            tags: [0; MAX_RECVS],
            idxs: [0; MAX_RECVS],
            data: [0; MAX_RECVS],
            sizes: [0; MAX_RECVS],
            landed: 0,
            sized: 0,
            trunc: None,
            dead: false,
        };
        for (i, b) in bufs.iter().enumerate() {
            req.caps[i] = b.size as u64;
            req.tags[i] = b.tag;
            req.data[i] = b.data as usize;
        }
        if st.reqs.in_use() >= MAX_REQUESTS {
            st.progress(&self.seat)?;
            return Ok(None);
        }
        for (i, b) in bufs.iter().enumerate() {
            let next = st.next_idx.entry(b.tag).or_insert(0);
            req.idxs[i] = *next;
            *next = next.wrapping_add(1);
        }
        let Some((_, slot)) = st.reqs.insert(req) else {
            return Err(Error::system(
                "irecv: the request pool is full though it had room",
            ));
        };
        // Eager messages that came first go straight in.
        for (i, b) in bufs.iter().enumerate() {
            if let Some(data) = st.stash.remove(&(b.tag, req.idxs[i])) {
                st.fill(slot, i as u8, &data);
            }
        }
        let offsets = st.offsets;
        let rtr = Ctrl::Rtr {
            seq: st.seq,
            slot: slot as u8,
            bufs: bufs
                .iter()
                .zip(req.idxs)
                .map(|(b, idx)| RtrBuf {
                    tag: b.tag,
                    idx,
                    size: b.size as u64,
                    addr: if offsets {
                        (b.data as usize - b.base) as u64
                    } else {
                        b.data as u64
                    },
                    key: b.key,
                })
                .collect(),
        };
        st.seq = st.seq.wrapping_add(1);
        if let Err(e) = st.peer.send(self.seat.ep(), rtr) {
            st.reqs.release(slot);
            die(&mut *st, format!("offering a receive failed: {e}"));
            return Err(e);
        }
        Ok(Some(ReqId {
            slot,
            gen: st.reqs.gen(slot),
        }))
    }
}

impl Comm for RecvComm {
    fn dev(&self) -> &Arc<DeviceState> {
        &self.dev
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
        if r.dead {
            return Err(st.peer.link.dead_error());
        }
        if let Some((sub, size)) = r.trunc {
            let s = usize::from(sub);
            return Err(truncation(
                "receive",
                &st.peer.link.name,
                size,
                r.tags[s],
                r.caps[s],
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
    fn hold(&self, held: &Tx<()>, release: &Rx<()>) {
        hold(&self.inner, held, release);
    }
    /// Never: receive buffers are offered to the peer, not posted to the
    /// provider.
    fn endpoint_open(&self) -> bool {
        false
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        say_bye(&mut lock(&self.inner).peer, &self.seat);
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
    fn progress(&mut self, seat: &Seat) -> Result<()> {
        self.peer.flush(seat.ep())?;
        if self.credits_owed >= EAGER_CREDIT_BATCH {
            let count = std::mem::take(&mut self.credits_owed);
            self.peer.send(seat.ep(), Ctrl::Credit { count })?;
        }
        for ev in seat.poll()? {
            self.peer.link.heard = true;
            match ev {
                Ev::Landed(local, size) => self.on_landed(local >> 3, local & 7, size),
                Ev::Ctrl(bytes) => self.on_ctrl(&bytes),
                Ev::Done(_) | Ev::Failed(..) => {
                    // Control messages are injected: nothing of ours completes.
                    tracing::warn!("receive comm: ignored a completion it posted nothing for");
                }
            }
        }
        Ok(())
    }
}

impl RecvState {
    /// The buffer a peer's message names, if it is one in flight.
    fn buffer(&mut self, slot: u8, sub: u8, what: &str) -> Option<&mut RReq> {
        let name = self.peer.link.name.clone();
        let r = self
            .reqs
            .get_mut(u32::from(slot))
            .filter(|r| sub < r.n && !r.finished());
        if r.is_none() {
            tracing::warn!(
                "receive comm from {name}: ignored {what} for buffer {sub} of request slot {slot}, which is not in flight"
            );
        }
        r
    }

    /// Eager message `idx` of `tag`: into its receive if posted, else kept
    /// until it is.
    fn on_eager(&mut self, tag: i32, idx: u32, data: Vec<u8>) {
        let found = self.reqs.live().find_map(|i| {
            let r = self.reqs.get(i)?;
            (0..r.n)
                .find(|&s| {
                    let s = usize::from(s);
                    r.tags[s] == tag && r.idxs[s] == idx && r.sized & (1 << s) == 0
                })
                .map(|s| (i, s))
        });
        match found {
            Some((slot, sub)) => self.fill(slot, sub, &data),
            None if self.stash.len() < EAGER_CREDITS as usize => {
                self.stash.insert((tag, idx), data);
            }
            None => tracing::warn!(
                "receive comm from {}: dropped an eager message beyond its {EAGER_CREDITS} credits (tag {tag})",
                self.peer.link.name
            ),
        }
    }

    /// Copies eager data into buffer `sub` of request `slot` (nothing past
    /// it: a larger message is a truncation error) and owes a credit back.
    fn fill(&mut self, slot: u32, sub: u8, data: &[u8]) {
        self.credits_owed += 1;
        let Some(r) = self.reqs.get_mut(slot) else {
            return;
        };
        let s = usize::from(sub);
        if data.len() as u64 <= r.caps[s] && !data.is_empty() {
            // SAFETY: NCCL keeps the buffer writable for its size until the
            // request is reported done (its irecv contract); the data fits.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), r.data[s] as *mut u8, data.len())
            };
        }
        r.landed |= 1 << sub;
        r.size(sub, data.len() as u64);
    }

    fn on_landed(&mut self, slot: u8, sub: u8, size: Option<u64>) {
        if let Some(r) = self.buffer(slot, sub, "a write") {
            r.landed |= 1 << sub;
            if let Some(size) = size {
                r.size(sub, size);
            }
        }
    }

    fn on_ctrl(&mut self, bytes: &[u8]) {
        match Ctrl::decode(bytes) {
            Ok(Ctrl::Alive) => {}
            Ok(Ctrl::Bye) => on_bye(self),
            Ok(Ctrl::Wrote { slot, sub, size }) => {
                if let Some(r) = self.buffer(slot, sub, "a size") {
                    if size == 0 {
                        // Nothing to write: no immediate comes.
                        r.landed |= 1 << sub;
                    }
                    r.size(sub, size);
                }
            }
            Ok(Ctrl::Eager { tag, idx, data }) => self.on_eager(tag, idx, data),
            Ok(Ctrl::Trunc { slot, sub, size }) => {
                if let Some(r) = self.buffer(slot, sub, "a truncation") {
                    r.trunc.get_or_insert((sub, size));
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
