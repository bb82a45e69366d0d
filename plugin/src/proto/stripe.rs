//! Virtual devices: one comm over several rails (NCCL's NIC fusion,
//! `makeVDevice`), for either protocol.
//!
//! A comm on a virtual device is one member comm per rail, each an ordinary
//! comm of the protocol on that rail's device, connected rail to rail (rail
//! `i` of the sender to rail `i` of the listener; the listen handle lists
//! every rail's listener, see [`super::wire::encode_rails`]). Liveness,
//! credits and truncation are the members' own.
//!
//! **Messages.** The sender alone knows a message's size and the receiver
//! alone its buffer's, so every message starts with a [`HEADER_LEN`]-byte
//! header on rail 0, under the message's own tag: `{magic, number, size,
//! first rail}`. Both sides cut the message alike from it ([`layout`]): one
//! part on the `first` rail when it is smaller than `WEFT_STRIPE_SIZE`
//! (the sender turns `first` round-robin, so small messages spread over the
//! rails), else one part per rail, in 4 KiB-aligned slices of equal size.
//! The sender posts the header and every part at once; the receiver posts a
//! message's parts when its header arrived, and the next header of the same
//! tag after them, so each rail sees each tag's parts in the same order on
//! both sides (the members match per tag, in order). A receive is done when
//! all its parts are; `test` reports the bytes the parts brought, which
//! must add up to the header's size.
//!
//! A message of at most [`INLINE_MAX`] bytes between devices that take host
//! memory only travels inside its header (a header slot is [`SLOT`] bytes)
//! and has no parts: one message, as on a physical device. Devices that take
//! GPU memory never inline (no CPU copy touches GPU data).
//!
//! What this costs: the header, and, on the receiving side, the wait for it
//! before a message's parts are offered (RDMA) or matched (tagged): about
//! one extra one-way latency per message with parts (docs/perf/vdev.txt).
//!
//! **Errors.** A header that is short, not Weft's, out of order or names a
//! rail that does not exist breaks the comm with a message saying so. A
//! message larger than the receive buffer is cut to the buffer's size per
//! part, so the members report the truncation on both sides and nothing is
//! written past the buffer; the receive fails saying both sizes. When one
//! rail fails (its peer went silent, its link went down) the comm fails as a
//! whole: that request and every later one (the parts on the other rails
//! keep NCCL's buffers until the comm is closed, as any comm closed with
//! receives in flight). A comm does not carry on over the remaining rails.
//!
//! Grouped receives are not striped: a virtual device reports `maxRecvs = 1`.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
#[cfg(feature = "testing")]
use std::sync::mpsc::{Receiver as Rx, Sender as Tx};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::pool::Pool;
use super::sync::try_lock;
use super::wire::MAX_RAILS;
use super::{
    Comm, DeviceState, Done, Hold, Listener, Mem, Receiver, RecvBuf, ReqId, Sender, MAX_RECVS,
    MAX_REQUESTS,
};
use crate::error::{Error, Kind, Result};
use crate::fabric::Mr;
use crate::mr::Region;

/// Bytes of a message header.
pub const HEADER_LEN: usize = 24;
/// A header slot: a header and, for a message of at most [`INLINE_MAX`]
/// bytes between host-memory devices, the message itself.
pub const SLOT: usize = 4096;
/// The largest message that travels inside its header.
pub const INLINE_MAX: usize = SLOT - HEADER_LEN;
const HEADER_MAGIC: u32 = 0x5746_5348; // "WFSH"
/// Stripes are multiples of this (whole pages on either side).
pub const STRIPE_ALIGN: usize = 4096;

/// One part of a message: `len` bytes at `off`, over rail `rail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Part {
    /// The rail.
    pub rail: usize,
    /// Offset in the message.
    pub off: usize,
    /// Length.
    pub len: usize,
}

/// A message's parts, at most one per rail, in message order (a fixed
/// array: cutting a message allocates nothing).
#[derive(Debug, Clone, Copy, Default)]
pub struct Parts {
    n: usize,
    p: [Part; MAX_RAILS],
}

impl std::ops::Deref for Parts {
    type Target = [Part];
    fn deref(&self) -> &[Part] {
        &self.p[..self.n]
    }
}

/// How a message of `size` bytes goes over `rails` rails (at most
/// [`MAX_RAILS`]): one part on rail `first` below `stripe` bytes (or on one
/// rail), else one part per rail in [`STRIPE_ALIGN`]-aligned slices of
/// equal size (the last may be shorter; a rail whose slice would start past
/// the end gets none), starting with rail `first`. Parts are in message
/// order and cover it exactly.
pub fn layout(size: usize, rails: usize, first: usize, stripe: usize) -> Parts {
    let rails = rails.clamp(1, MAX_RAILS);
    let first = first % rails;
    let mut parts = Parts::default();
    if rails == 1 || size < stripe.max(1) {
        parts.p[0] = Part {
            rail: first,
            off: 0,
            len: size,
        };
        parts.n = 1;
        return parts;
    }
    let slice = size.div_ceil(rails).next_multiple_of(STRIPE_ALIGN);
    for i in 0..rails {
        let off = i * slice;
        if off >= size {
            break;
        }
        parts.p[i] = Part {
            rail: (first + i) % rails,
            off,
            len: slice.min(size - off),
        };
        parts.n = i + 1;
    }
    parts
}

/// A message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The message's number among its tag's.
    pub number: u32,
    /// Its size.
    pub size: u64,
    /// The rail its first part goes over.
    pub first: u8,
    /// The message follows the header in the same message (no parts).
    pub inline: bool,
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.number.to_le_bytes());
        b[8..16].copy_from_slice(&self.size.to_le_bytes());
        b[16] = self.first;
        b[17] = u8::from(self.inline);
        b
    }

    /// Reads and checks the header of message `number` on a comm of `rails`
    /// rails from the bytes that arrived (the header, and an inline
    /// message's bytes after it); `Err` says what is wrong with it.
    pub fn decode(b: &[u8], number: u32, rails: usize) -> std::result::Result<Self, String> {
        if b.len() < HEADER_LEN {
            return Err(format!(
                "a message header of {} bytes (at least {HEADER_LEN})",
                b.len()
            ));
        }
        let magic = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != HEADER_MAGIC {
            return Err(format!(
                "a message header that is not Weft's (magic {magic:#010x})"
            ));
        }
        let h = Header {
            number: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            size: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            first: b[16],
            inline: b[17] == 1,
        };
        if h.number != number {
            return Err(format!(
                "the header of message {} of its tag where message {number} was due",
                h.number
            ));
        }
        if usize::from(h.first) >= rails || b[17] > 1 || b[18..HEADER_LEN].iter().any(|&x| x != 0) {
            return Err(format!(
                "a message header naming rail {} of {rails}, or with stray bytes",
                h.first
            ));
        }
        let body = if h.inline { h.size } else { 0 };
        if (b.len() - HEADER_LEN) as u64 != body {
            return Err(format!(
                "a message header of a {}{}-byte message followed by {} bytes",
                if h.inline { "inline " } else { "" },
                h.size,
                b.len() - HEADER_LEN
            ));
        }
        Ok(h)
    }
}

/// A comm's headers: one slot per request, in host memory registered on
/// rail 0's device (only Weft reads and writes them).
struct Headers {
    buf: Box<[u8]>,
    dev: Arc<DeviceState>,
    region: Option<Arc<Region<Mr>>>,
    mem: Mem,
}

impl Headers {
    fn new(dev: &Arc<DeviceState>) -> Result<Self> {
        let buf = vec![0u8; MAX_REQUESTS * SLOT].into_boxed_slice();
        // SAFETY: `buf` is this struct's; the registration is released in
        // Drop, before the buffer is freed.
        let region = unsafe { dev.mr.register(buf.as_ptr() as usize, buf.len()) }
            .map_err(|e| Error::system(format!("registering a virtual device's headers: {e}")))?;
        let d = region.desc();
        let mem = Mem {
            desc: d.desc,
            key: d.key,
            base: region.range().start,
        };
        Ok(Self {
            buf,
            dev: Arc::clone(dev),
            region: Some(region),
            mem,
        })
    }

    fn slot(&mut self, slot: u32) -> *mut u8 {
        let at = slot as usize * SLOT;
        self.buf[at..at + SLOT].as_mut_ptr()
    }

    fn read(&self, slot: u32) -> &[u8] {
        let at = slot as usize * SLOT;
        &self.buf[at..at + SLOT]
    }
}

impl Drop for Headers {
    fn drop(&mut self) {
        if let Some(r) = self.region.take() {
            self.dev.mr.release(r);
        }
    }
}

/// What a rail still has to post, in order: a header (always on rail 0) or
/// a part of request `slot`.
#[derive(Debug, Clone, Copy)]
struct Post {
    slot: u32,
    part: Option<Part>,
}

/// The member requests of one request.
#[derive(Debug, Clone, Copy)]
struct Members {
    n: u8,
    ids: [(u8, ReqId); MAX_RAILS + 1],
    /// Which of them finished, and the bytes each moved.
    done: u16,
    bytes: usize,
    /// Posts not yet taken by their rail.
    unposted: u8,
}

impl Members {
    const NONE: Members = Members {
        n: 0,
        ids: [(0, ReqId { slot: 0, gen: 0 }); MAX_RAILS + 1],
        done: 0,
        bytes: 0,
        unposted: 0,
    };

    fn push(&mut self, rail: usize, id: ReqId) {
        self.ids[usize::from(self.n)] = (rail as u8, id);
        self.n += 1;
        self.unposted -= 1;
    }

    /// Tests the members not yet finished; `Ok(true)` once every post was
    /// taken and every member finished.
    fn test<C: Comm + ?Sized>(&mut self, rails: &[Arc<C>]) -> Result<bool> {
        for i in 0..usize::from(self.n) {
            if self.done & (1 << i) != 0 {
                continue;
            }
            let (rail, id) = self.ids[i];
            if let Some(d) = rails[usize::from(rail)]
                .test(id)
                .map_err(on_rail(usize::from(rail)))?
            {
                self.done |= 1 << i;
                self.bytes += d.sizes[..d.n].iter().sum::<usize>();
            }
        }
        Ok(self.unposted == 0 && self.done.count_ones() == u32::from(self.n))
    }
}

fn done(size: usize) -> Done {
    let mut sizes = [0; MAX_RECVS];
    sizes[0] = size;
    Done { n: 1, sizes }
}

/// The first failure breaks the comm: it is kept and every request after
/// it gets it.
fn broken(failed: &mut Option<Error>, e: Error) -> Error {
    if failed.is_none() {
        tracing::warn!("virtual device comm failed: {e}");
    }
    failed.get_or_insert(e).clone()
}

/// An error naming the first rail whose peer was declared dead: a comm on
/// a virtual device fails as a whole when one rail does, whether or not
/// that rail had anything in flight.
fn rails_alive<C: Comm + ?Sized>(rails: &[Arc<C>]) -> Result<()> {
    for (r, rail) in rails.iter().enumerate() {
        rail.alive().map_err(on_rail(r))?;
    }
    Ok(())
}

/// Names the rail in an error of one of its member comms: every error a
/// member returns goes through it, so whichever call sees a rail fail first,
/// the operator learns which rail.
fn on_rail(r: usize) -> impl FnOnce(Error) -> Error {
    move |e| e.context(format!("virtual device, rail {r}"))
}

fn peer_names<C: Comm + ?Sized>(rails: &[Arc<C>]) -> String {
    rails
        .iter()
        .map(|r| r.peer_name())
        .collect::<Vec<_>>()
        .join(" + ")
}

/// Forwards what [`Comm`] asks of a striped comm to its rails.
macro_rules! comm_over_rails {
    ($t:ty) => {
        impl Comm for $t {
            fn rails(&self) -> &[Arc<DeviceState>] {
                &self.devs
            }
            fn test(&self, id: ReqId) -> Result<Option<Done>> {
                self.test_req(id)
            }
            /// Also moves the comm on where NCCL has not tested it for a
            /// while (a receive's parts are posted when its header is read).
            fn keepalive(&self, now: Instant) {
                for r in &self.rails {
                    r.keepalive(now);
                }
                if let Some(mut st) = try_lock(&self.st) {
                    if st.failed.is_none() {
                        if let Err(e) = self.progress(&mut st) {
                            broken(&mut st.failed, e);
                        }
                    }
                }
            }
            fn peer_name(&self) -> String {
                peer_names(&self.rails)
            }
            fn alive(&self) -> Result<()> {
                rails_alive(&self.rails)
            }
            #[cfg(feature = "testing")]
            fn hold(&self, held: &Tx<()>, release: &Rx<()>) {
                self.rails[0].hold(held, release);
            }
            #[cfg(feature = "testing")]
            fn endpoint_open(&self) -> bool {
                self.rails.iter().any(|r| r.endpoint_open())
            }
        }
    };
}

/// One side of a comm on a virtual device: its requests (`R`), their
/// header slots, what each rail has still to post, messages per tag (sent,
/// or receives posted), the first failure, and the side's own state `X`.
struct Side<R: Copy, X> {
    reqs: Pool<R>,
    headers: Headers,
    queues: Vec<VecDeque<Post>>,
    counts: HashMap<i32, u32>,
    failed: Option<Error>,
    /// Per request slot: what keeps NCCL's buffer registered on every rail
    /// until the request is reported done (receives; see [`Hold`]).
    holds: Vec<Option<Hold>>,
    x: X,
}

impl<R: Copy, X> Side<R, X> {
    /// Request `slot` no longer holds its buffer's registration.
    fn let_go(&mut self, slot: u32) {
        if let Some(h) = self.holds.get_mut(slot as usize) {
            *h = None;
        }
    }
}

/// A comm on a virtual device: one member comm (`C`) per rail and the
/// state of its side.
pub struct Striped<C: ?Sized, R: Copy, X> {
    rails: Vec<Arc<C>>,
    devs: Vec<Arc<DeviceState>>,
    stripe: usize,
    st: Mutex<Side<R, X>>,
}

/// A sending comm on a virtual device (also while it connects).
pub type StripedSend = Striped<dyn Sender, SReq, usize>;
/// A receiving comm on a virtual device.
pub type StripedRecv = Striped<dyn Receiver, RReq, HashMap<i32, VecDeque<u32>>>;

impl<C: Comm + ?Sized, R: Copy, X> std::fmt::Debug for Striped<C, R, X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Striped({} rails: {})",
            self.rails.len(),
            peer_names(&self.rails)
        )
    }
}

impl<C: Comm + ?Sized, R: Copy, X> Striped<C, R, X> {
    /// A comm over `rails` (one member per rail), striping messages of
    /// `stripe` bytes and more; `x` starts the side's own state.
    fn open(rails: Vec<Arc<C>>, stripe: usize, x: X) -> Result<Self> {
        let devs = rail_devices(&rails)?;
        let st = Side {
            reqs: Pool::new(MAX_REQUESTS).map_err(|e| Error::system(e.to_string()))?,
            headers: Headers::new(&devs[0])?,
            queues: vec![VecDeque::new(); rails.len()],
            counts: HashMap::new(),
            failed: None,
            holds: vec![None; MAX_REQUESTS],
            x,
        };
        Ok(Self {
            rails,
            devs,
            stripe,
            st: Mutex::new(st),
        })
    }

    /// Tests request `id` with `step` (which moves the comm on and says
    /// whether the request is done); a finished or failed request is
    /// freed, and a failure breaks the comm. Never waits for the keeper.
    fn test_with(
        &self,
        id: ReqId,
        step: impl FnOnce(&mut Side<R, X>) -> Result<Option<Done>>,
    ) -> Result<Option<Done>> {
        let Some(mut st) = try_lock(&self.st) else {
            return Ok(None);
        };
        if let Some(e) = st.failed.clone() {
            st.reqs.release(id.slot);
            st.let_go(id.slot);
            return Err(e);
        }
        if !st.reqs.is_current(id.slot, id.gen) {
            return Err(Error::internal(format!(
                "test: request {} of a virtual device's comm is not live",
                id.slot
            )));
        }
        let r = step(&mut st);
        if !matches!(r, Ok(None)) {
            st.reqs.release(id.slot);
            st.let_go(id.slot);
        }
        r.map_err(|e| broken(&mut st.failed, e))
    }
}

impl<C: Comm + ?Sized, R: Copy, X> Striped<C, R, X> {
    /// Posts a request (`call`: isend, irecv) of `tag` with its
    /// registrations `mem`, one per rail: `place` makes and queues it from
    /// its number among its tag's messages and the registrations, and
    /// returns its slot; then the comm moves on (`progress`). `Ok(None)`
    /// while every request is in use or the keeper holds the comm.
    fn post_with(
        &self,
        call: &str,
        mem: &[Mem],
        hold: Option<&Hold>,
        tag: i32,
        progress: impl Fn(&mut Side<R, X>) -> Result<()>,
        place: impl FnOnce(&mut Side<R, X>, u32, [Mem; MAX_RAILS]) -> Option<u32>,
    ) -> Result<Option<ReqId>> {
        let n = self.rails.len();
        if mem.len() != n {
            return Err(Error::internal(format!(
                "{call}: {} registrations for a comm of {n} rails",
                mem.len()
            )));
        }
        let Some(mut st) = try_lock(&self.st) else {
            return Ok(None);
        };
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        if st.reqs.in_use() >= MAX_REQUESTS {
            progress(&mut st).map_err(|e| broken(&mut st.failed, e))?;
            return Ok(None);
        }
        let number = *st.counts.get(&tag).unwrap_or(&0);
        let mut mems = [Mem::NONE; MAX_RAILS];
        mems[..n].copy_from_slice(mem);
        let Some(slot) = place(&mut st, number, mems) else {
            return Ok(None);
        };
        if let Some(h) = st.holds.get_mut(slot as usize) {
            *h = hold.cloned();
        }
        st.counts.insert(tag, number.wrapping_add(1));
        progress(&mut st).map_err(|e| broken(&mut st.failed, e))?;
        Ok(Some(ReqId {
            slot,
            gen: st.reqs.gen(slot),
        }))
    }
}

// ---------------------------------------------------------------- sending

/// A send.
#[derive(Debug, Clone, Copy)]
pub struct SReq {
    data: usize,
    size: usize,
    /// The header message's length (with an inline message).
    head: usize,
    tag: i32,
    mems: [Mem; MAX_RAILS],
    members: Members,
}

/// The sender's state; `x` is the rail the next message starts on.
type SendState = Side<SReq, usize>;

impl StripedSend {
    /// A sender over `rails` (one member per rail, connecting), striping
    /// messages of `stripe` bytes and more.
    pub fn new(rails: Vec<Arc<dyn Sender>>, stripe: usize) -> Result<Self> {
        Self::open(rails, stripe, 0)
    }

    /// Hands each rail what it can take now, in order.
    fn progress(&self, st: &mut SendState) -> Result<()> {
        rails_alive(&self.rails)?;
        for (r, rail) in self.rails.iter().enumerate() {
            while let Some(&post) = st.queues[r].front() {
                let Some(&req) = st.reqs.get(post.slot) else {
                    st.queues[r].pop_front();
                    continue;
                };
                let (ptr, len, mem) = match post.part {
                    None => (
                        st.headers.slot(post.slot).cast_const(),
                        req.head,
                        st.headers.mem,
                    ),
                    Some(p) => ((req.data + p.off) as *const u8, p.len, req.mems[r]),
                };
                // SAFETY: a header slot lives as long as the comm; a part
                // lies in NCCL's buffer, which NCCL keeps until the request
                // is done (the core checked it against its registration).
                let id = unsafe { rail.isend(ptr, len, req.tag, &[mem], std::ptr::null_mut()) }
                    .map_err(on_rail(r))?;
                let Some(id) = id else { break };
                st.queues[r].pop_front();
                if let Some(q) = st.reqs.get_mut(post.slot) {
                    q.members.push(r, id);
                }
            }
        }
        Ok(())
    }

    fn test_req(&self, id: ReqId) -> Result<Option<Done>> {
        self.test_with(id, |st| {
            self.progress(st)?;
            let req = *st.reqs.get(id.slot).expect("live");
            let mut m = req.members;
            let finished = m.test(&self.rails)?;
            st.reqs.get_mut(id.slot).expect("live").members = m;
            Ok(finished.then(|| done(req.size)))
        })
    }
}

impl Sender for StripedSend {
    fn listener_nonce(&self) -> u64 {
        self.rails[0].listener_nonce()
    }

    fn step_connect(&self) -> Result<bool> {
        let mut all = true;
        for (r, rail) in self.rails.iter().enumerate() {
            all &= rail.step_connect().map_err(on_rail(r))?;
        }
        Ok(all)
    }

    unsafe fn isend(
        &self,
        data: *const u8,
        size: usize,
        tag: i32,
        mem: &[Mem],
        _phandle: *mut c_void,
    ) -> Result<Option<ReqId>> {
        let n = self.rails.len();
        let progress = |st: &mut SendState| self.progress(st);
        // No CPU touches GPU data: only host-memory devices inline.
        let inline = size <= INLINE_MAX && !self.devs.iter().any(|d| d.cuda);
        self.post_with("isend", mem, None, tag, progress, |st, number, mems| {
            let first = st.x;
            let parts = if inline {
                Parts::default()
            } else {
                layout(size, n, first, self.stripe)
            };
            let req = SReq {
                data: data as usize,
                size,
                head: HEADER_LEN + if inline { size } else { 0 },
                tag,
                mems,
                members: Members {
                    unposted: 1 + parts.len() as u8,
                    ..Members::NONE
                },
            };
            let (_, slot) = st.reqs.insert(req)?;
            if !inline {
                st.x = (first + 1) % n;
            }
            let header = Header {
                number,
                size: size as u64,
                first: first as u8,
                inline,
            }
            .encode();
            let at = st.headers.slot(slot);
            // SAFETY: the slot is SLOT bytes of this comm's headers; an
            // inline message (at most INLINE_MAX bytes, host memory) is
            // readable by the caller's contract.
            unsafe {
                std::ptr::copy_nonoverlapping(header.as_ptr(), at, HEADER_LEN);
                if inline {
                    std::ptr::copy_nonoverlapping(data, at.add(HEADER_LEN), size);
                }
            };
            st.queues[0].push_back(Post { slot, part: None });
            for &p in parts.iter() {
                st.queues[p.rail].push_back(Post {
                    slot,
                    part: Some(p),
                });
            }
            Some(slot)
        })
    }
}

comm_over_rails!(StripedSend);

fn rail_devices<C: Comm + ?Sized>(rails: &[Arc<C>]) -> Result<Vec<Arc<DeviceState>>> {
    if rails.is_empty() || rails.len() > MAX_RAILS {
        return Err(Error::internal(format!(
            "a virtual device of {} rails (1 ..= {MAX_RAILS})",
            rails.len()
        )));
    }
    Ok(rails.iter().map(|r| Arc::clone(&r.rails()[0])).collect())
}

// -------------------------------------------------------------- receiving

/// Where a receive stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Behind an earlier receive of its tag: its header is not posted yet.
    Queued,
    /// Its header is posted (or waits for rail 0 to take it).
    Header,
    /// Its parts are posted (or wait for their rails).
    Parts,
}

/// A receive.
#[derive(Debug, Clone, Copy)]
pub struct RReq {
    data: usize,
    cap: usize,
    tag: i32,
    number: u32,
    mems: [Mem; MAX_RAILS],
    stage: Stage,
    header: Option<ReqId>,
    /// The size the header announced.
    size: usize,
    members: Members,
}

/// The receiver's state; `x` holds, per tag, the receives in NCCL's
/// order: the first one's header is posted, the others wait their turn.
type RecvState = Side<RReq, HashMap<i32, VecDeque<u32>>>;

impl StripedRecv {
    fn new(rails: Vec<Arc<dyn Receiver>>, stripe: usize) -> Result<Self> {
        Self::open(rails, stripe, HashMap::new())
    }

    /// Hands each rail what it can take now, in order.
    fn post(&self, st: &mut RecvState) -> Result<()> {
        for (r, rail) in self.rails.iter().enumerate() {
            while let Some(&post) = st.queues[r].front() {
                let Some(&req) = st.reqs.get(post.slot) else {
                    st.queues[r].pop_front();
                    continue;
                };
                let header_mem = [st.headers.mem];
                let buf = match post.part {
                    None => RecvBuf {
                        data: st.headers.slot(post.slot),
                        size: SLOT,
                        tag: req.tag,
                        mem: &header_mem,
                        phandle: std::ptr::null_mut(),
                        hold: None,
                    },
                    // Cut to the buffer: nothing lands past it.
                    Some(p) => RecvBuf {
                        data: (req.data + p.off.min(req.cap)) as *mut u8,
                        size: p.len.min(req.cap.saturating_sub(p.off)),
                        tag: req.tag,
                        mem: &req.mems[r..=r],
                        phandle: std::ptr::null_mut(),
                        hold: st.holds.get(post.slot as usize).and_then(Option::as_ref),
                    },
                };
                // SAFETY: a header slot lives as long as the comm; a part
                // lies in NCCL's buffer (cut to its capacity), which NCCL
                // keeps until the request is done.
                let id = unsafe { rail.irecv(&[buf]) }.map_err(on_rail(r))?;
                let Some(id) = id else { break };
                st.queues[r].pop_front();
                if let Some(q) = st.reqs.get_mut(post.slot) {
                    match post.part {
                        None => q.header = Some(id),
                        Some(_) => q.members.push(r, id),
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads the headers that arrived, queues their parts and the next
    /// header of their tag; `Ok(true)` if anything moved.
    fn headers(&self, st: &mut RecvState) -> Result<bool> {
        let n = self.rails.len();
        let mut moved = false;
        // A receive waits in Stage::Header exactly while it is the first of
        // its tag: the requests are few (MAX_REQUESTS), so look at each
        // rather than gather the tags' fronts (no allocation per test).
        for slot in 0..MAX_REQUESTS as u32 {
            let Some(&req) = st.reqs.get(slot) else {
                continue;
            };
            let Some(hid) = req.header.filter(|_| req.stage == Stage::Header) else {
                continue;
            };
            let Some(d) = self.rails[0].test(hid).map_err(on_rail(0))? else {
                continue;
            };
            let got = &st.headers.read(slot)[..d.sizes[0].min(SLOT)];
            let bad = |why: String| {
                Error::protocol(format!(
                    "virtual device comm from {}: tag {}: {why}; the peer is not a matching Weft, or the stream is corrupted",
                    peer_names(&self.rails),
                    req.tag
                ))
            };
            let h = Header::decode(got, req.number, n).map_err(bad)?;
            let size = usize::try_from(h.size).unwrap_or(usize::MAX);
            let parts = if h.inline {
                if self.devs.iter().any(|d| d.cuda) {
                    return Err(bad(
                        "an inline message for a device that takes GPU memory (no CPU copies there): the two hosts' devices differ".into(),
                    ));
                }
                if size <= req.cap {
                    // SAFETY: NCCL's buffer holds `cap` >= `size` bytes and
                    // is host memory (no rail takes GPU memory).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            got[HEADER_LEN..].as_ptr(),
                            req.data as *mut u8,
                            size,
                        )
                    };
                }
                Parts::default()
            } else {
                layout(size, n, usize::from(h.first), self.stripe)
            };
            if let Some(q) = st.reqs.get_mut(slot) {
                q.stage = Stage::Parts;
                q.size = size;
                q.members.unposted = parts.len() as u8;
                if h.inline {
                    q.members.bytes = size;
                }
            }
            for &p in parts.iter() {
                st.queues[p.rail].push_back(Post {
                    slot,
                    part: Some(p),
                });
            }
            let q = st.x.get_mut(&req.tag).expect("its tag");
            q.pop_front();
            if let Some(&next) = q.front() {
                if let Some(r) = st.reqs.get_mut(next) {
                    r.stage = Stage::Header;
                }
                st.queues[0].push_back(Post {
                    slot: next,
                    part: None,
                });
            } else {
                st.x.remove(&req.tag);
            }
            moved = true;
        }
        Ok(moved)
    }

    fn progress(&self, st: &mut RecvState) -> Result<()> {
        rails_alive(&self.rails)?;
        loop {
            self.post(st)?;
            if !self.headers(st)? {
                return Ok(());
            }
        }
    }

    fn test_req(&self, id: ReqId) -> Result<Option<Done>> {
        self.test_with(id, |st| {
            self.progress(st)?;
            let req = *st.reqs.get(id.slot).expect("live");
            if req.stage != Stage::Parts {
                return Ok(None);
            }
            let mut m = req.members;
            let finished = m.test(&self.rails)?;
            st.reqs.get_mut(id.slot).expect("live").members = m;
            if !finished {
                return Ok(None);
            }
            if req.size > req.cap {
                return Err(Error::remote(format!(
                    "receive: peer {} sent {} bytes with tag {} into a buffer of {}: message truncated, nothing written past the buffer",
                    peer_names(&self.rails),
                    req.size,
                    req.tag,
                    req.cap
                ))
                .of_kind(Kind::Truncated));
            }
            if m.bytes != req.size {
                return Err(Error::remote(format!(
                    "receive: the rails brought {} bytes of a {}-byte message (tag {})",
                    m.bytes, req.size, req.tag
                )));
            }
            Ok(Some(done(req.size)))
        })
    }
}

impl Receiver for StripedRecv {
    unsafe fn irecv(&self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        let [b] = bufs else {
            return Err(Error::internal(format!(
                "irecv with n = {} on a virtual device, which reported maxRecvs = 1",
                bufs.len()
            )));
        };
        let progress = |st: &mut RecvState| self.progress(st);
        self.post_with(
            "irecv",
            b.mem,
            b.hold,
            b.tag,
            progress,
            |st, number, mems| {
                let req = RReq {
                    data: b.data as usize,
                    cap: b.size,
                    tag: b.tag,
                    number,
                    mems,
                    stage: Stage::Queued,
                    header: None,
                    size: 0,
                    members: Members::NONE,
                };
                let (_, slot) = st.reqs.insert(req)?;
                let q = st.x.entry(b.tag).or_default();
                q.push_back(slot);
                if q.len() == 1 {
                    st.reqs.get_mut(slot).expect("inserted").stage = Stage::Header;
                    st.queues[0].push_back(Post { slot, part: None });
                }
                Some(slot)
            },
        )
    }
}

comm_over_rails!(StripedRecv);

// -------------------------------------------------------------- listening

struct ListenState {
    got: Vec<Option<Arc<dyn Receiver>>>,
    handed: bool,
}

/// A listener on a virtual device: one member listener per rail. It
/// accepts one connection (NCCL listens once per connection); a further
/// one is closed at once with a WARN, so its sender fails instead of
/// pairing rails of two peers.
pub struct StripedListen {
    rails: Vec<Arc<dyn Listener>>,
    stripe: usize,
    st: Mutex<ListenState>,
}

impl std::fmt::Debug for StripedListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StripedListen({} rails)", self.rails.len())
    }
}

impl StripedListen {
    /// A listener over `rails` (rail order = the virtual device's).
    pub fn new(rails: Vec<Arc<dyn Listener>>, stripe: usize) -> Self {
        let got = vec![None; rails.len()];
        Self {
            rails,
            stripe,
            st: Mutex::new(ListenState { got, handed: false }),
        }
    }
}

impl Listener for StripedListen {
    fn accept(&self) -> Result<Option<Arc<dyn Receiver>>> {
        // Never wait for the keeper (it moves the comm on in the background).
        let Some(mut st) = try_lock(&self.st) else {
            return Ok(None);
        };
        for (r, l) in self.rails.iter().enumerate() {
            let Some(c) = l.accept().map_err(on_rail(r))? else {
                continue;
            };
            if st.handed || st.got[r].is_some() {
                tracing::warn!(
                    "listener on a virtual device: closed a second connection on rail {r} from {}: a virtual device's listen comm takes one connection",
                    c.peer_name()
                );
                continue;
            }
            st.got[r] = Some(c);
        }
        if st.handed || st.got.iter().any(Option::is_none) {
            return Ok(None);
        }
        st.handed = true;
        let rails: Vec<_> = st.got.iter_mut().map(|c| c.take().expect("all")).collect();
        Ok(Some(Arc::new(StripedRecv::new(rails, self.stripe)?)))
    }

    fn tend(&self, now: Instant) {
        for l in &self.rails {
            l.tend(now);
        }
        // Rails accepted before the others say Alive like the rest.
        if let Some(st) = try_lock(&self.st) {
            for c in st.got.iter().flatten() {
                c.keepalive(now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covers(parts: &[Part], size: usize) {
        let mut at = 0;
        for p in parts {
            assert_eq!(p.off, at, "{parts:?}");
            at += p.len;
        }
        assert_eq!(at, size, "{parts:?}");
    }

    #[test]
    fn small_messages_go_whole_round_robin() {
        for first in 0..4 {
            let p = layout(1000, 2, first, 65536);
            assert_eq!(
                *p,
                [Part {
                    rail: first % 2,
                    off: 0,
                    len: 1000
                }]
            );
        }
        assert_eq!(
            layout(0, 3, 1, 65536).len(),
            1,
            "an empty message is one part"
        );
        assert_eq!(layout(1 << 30, 1, 0, 65536).len(), 1, "one rail");
    }

    #[test]
    fn large_messages_stripe_over_every_rail_aligned() {
        for rails in 2..=MAX_RAILS {
            for size in [65536, 65537, 1 << 20, (1 << 20) + 3, 64 << 20] {
                for first in 0..rails {
                    let p = layout(size, rails, first, 65536);
                    covers(&p, size);
                    let slice = p[0].len;
                    assert_eq!(p.len(), size.div_ceil(slice), "{size} over {rails}");
                    assert!(p.len() <= rails);
                    if size >= rails * rails * STRIPE_ALIGN {
                        assert_eq!(p.len(), rails, "{size} over {rails}: every rail");
                    }
                    for (i, part) in p.iter().enumerate() {
                        assert_eq!(part.rail, (first + i) % rails);
                        assert_eq!(part.off % STRIPE_ALIGN, 0);
                        assert!(part.len > 0);
                    }
                }
            }
        }
        // Fewer slices than rails when the size is just above the threshold.
        let p = layout(4097, 4, 0, 4096);
        covers(&p, 4097);
        assert_eq!(p.len(), 2);
    }

    /// A member comm whose requests fail (its peer died) or stay pending.
    #[derive(Debug)]
    struct Member {
        dead: bool,
    }

    impl Comm for Member {
        fn rails(&self) -> &[Arc<DeviceState>] {
            &[]
        }
        fn test(&self, _: ReqId) -> Result<Option<Done>> {
            if self.dead {
                Err(Error::peer_dead("peer declared dead".to_owned()))
            } else {
                Ok(None)
            }
        }
        fn keepalive(&self, _: Instant) {}
        fn peer_name(&self) -> String {
            "member".into()
        }
        fn alive(&self) -> Result<()> {
            // Still alive as far as the keeper knows: the failure is seen
            // first by a test (the race CI met).
            Ok(())
        }
        #[cfg(feature = "testing")]
        fn hold(&self, _: &Tx<()>, _: &Rx<()>) {}
        #[cfg(feature = "testing")]
        fn endpoint_open(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_member_failing_its_test_names_its_rail() {
        let rails = [
            Arc::new(Member { dead: false }),
            Arc::new(Member { dead: true }),
        ];
        let mut m = Members::NONE;
        m.unposted = 2;
        m.push(0, ReqId { slot: 0, gen: 1 });
        m.push(1, ReqId { slot: 0, gen: 1 });
        let e = m.test(&rails).unwrap_err().to_string();
        assert!(e.contains("virtual device, rail 1: "), "{e}");
        assert!(e.contains("peer declared dead"), "{e}");
    }

    #[test]
    fn headers_round_trip_and_bad_ones_say_why() {
        let h = Header {
            number: 7,
            size: 1 << 33,
            first: 1,
            inline: false,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b, 7, 2), Ok(h));
        assert!(Header::decode(&b[..10], 7, 2)
            .unwrap_err()
            .contains("10 bytes"));
        assert!(Header::decode(&b, 8, 2).unwrap_err().contains("message 7"));
        assert!(Header::decode(&b, 7, 1)
            .unwrap_err()
            .contains("rail 1 of 1"));
        let mut bad = b;
        bad[0] ^= 1;
        assert!(Header::decode(&bad, 7, 2).unwrap_err().contains("not Weft"));
        let mut bad = b;
        bad[20] = 1;
        assert!(Header::decode(&bad, 7, 2).unwrap_err().contains("stray"));
        let mut bad = b;
        bad[17] = 2;
        assert!(Header::decode(&bad, 7, 2).unwrap_err().contains("stray"));
        // A header with bytes after it that it does not announce.
        let mut long = b.to_vec();
        long.extend_from_slice(&[1, 2, 3]);
        assert!(Header::decode(&long, 7, 2)
            .unwrap_err()
            .contains("followed by 3 bytes"));
    }

    #[test]
    fn inline_headers_carry_exactly_their_message() {
        let h = Header {
            number: 0,
            size: 5,
            first: 0,
            inline: true,
        };
        let mut b = h.encode().to_vec();
        b.extend_from_slice(b"hello");
        assert_eq!(Header::decode(&b, 0, 2), Ok(h));
        assert!(Header::decode(&b[..HEADER_LEN + 4], 0, 2)
            .unwrap_err()
            .contains("inline 5-byte message followed by 4 bytes"));
    }
}
