//! Graves: where tagged data still on its way to a closed receive comm goes.
//!
//! A tagged message that no receive matched stays with the provider, and
//! so does its send: libfabric 1.17's shm completes a sender's sends in
//! order, so one that is never matched holds back every later send
//! completion of that endpoint (measured: after one close with 4 × 1 MiB
//! unmatched, no send on the device completed again); rxm keeps unmatched
//! eager messages in its buffers and rendezvous sends open. NCCL's abort
//! closes receive comms with their peers' messages in flight.
//!
//! So a tagged receive comm that closes while its peer may still have
//! messages on their way leaves a grave at its hub: one tagged receive from
//! the peer's address for any tag of the comm's id, into a buffer of the
//! hub's own (never NCCL's), posted again after every message it takes. A
//! grave goes once the peer's `Bye` says every message it sent was taken
//! (matched by the comm, then drained here), or once nothing came for it
//! for `WEFT_PEER_TIMEOUT`, or at once when the provider fails one of its
//! receives (the peer's connection broke: posting to it again crashed
//! rxm). Its buffer is freed only after the provider returned its receive.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::pool::SLOT_ALIGN;
use super::wire::Ctrl;
use super::wire::{context, data_tag};
use crate::fabric::{Endpoint, FiAddr};
use crate::freelist::{Elem, Freelist, HostPages, Params};
use crate::mr::DomainRegistrar;

/// The context's low 32 bits for a grave's receives are this and above
/// (its receive number in the low byte); no comm's own are: those are
/// request slot and buffer numbers.
pub const GRAVE_LOCAL: u32 = 0xFFFF_FF00;
/// The smallest grave buffer: NCCL's default buffer size (`NCCL_BUFFSIZE`),
/// the most it sends in one message unless told otherwise. A grave's buffer
/// is as large as the largest receive its comm posted, and at least this:
/// shm 1.17 spins on a truncated tagged receive above 4 KiB rather than
/// report it. The pages are mapped lazily: only what lands costs memory.
pub const GRAVE_MIN: usize = 4 << 20;
/// NCCL tags a grave drains by name (NCCL uses a handful per comm).
pub const GRAVE_TAGS: usize = 16;

/// Whether an operation's context (low 32 bits) is a grave's receive.
pub fn is_grave(local: u32) -> bool {
    local >= GRAVE_LOCAL
}

/// One of a grave's receives: for one NCCL tag, or for any (`None`).
/// shm 1.17 matches a message that arrived before its receive against the
/// receive's tag without its ignore mask, so messages already waiting are
/// taken only by a receive for their exact tag; the any-tag receive takes
/// those that come later, on every provider.
struct Drain {
    tag: Option<i32>,
    /// With the provider.
    posted: bool,
}

/// What a closing receive comm leaves its hub to drain for it.
#[derive(Debug)]
pub struct Closed {
    /// The comm's id on the hub.
    pub id: u32,
    /// Its peer's address and token.
    pub src: FiAddr,
    pub token: u32,
    /// The peer's messages the comm took (matched), and how many the peer
    /// sent in all when its `Bye` came.
    pub taken: u32,
    pub sent: Option<u32>,
    /// The largest receive the comm posted, and the NCCL tags it posted.
    pub cap: usize,
    pub tags: Vec<i32>,
}

struct Grave {
    src: FiAddr,
    token: u32,
    list: Freelist<HostPages, DomainRegistrar>,
    buf: Option<Elem>,
    size: usize,
    drains: Vec<Drain>,
    /// The peer's messages taken so far (matched by the comm, then drained
    /// here; wrapping, as the peer counts them).
    taken: u32,
    /// How many the peer sent in all, from its `Bye`.
    sent: Option<u32>,
    /// Its cancels were asked: the grave goes when the provider returned
    /// every receive.
    retiring: bool,
    last: Instant,
}

impl Grave {
    fn done(&self) -> bool {
        self.sent.is_some_and(|s| self.taken == s)
    }

    fn posted(&self) -> bool {
        self.drains.iter().any(|d| d.posted)
    }

    /// Posts every receive not with the provider.
    fn post(&mut self, ep: &Endpoint, id: u32) {
        let Some(e) = &self.buf else {
            return;
        };
        let desc = e.mr.map_or(std::ptr::null_mut(), |m| m.desc);
        for (j, d) in self
            .drains
            .iter_mut()
            .enumerate()
            .filter(|(_, d)| !d.posted)
        {
            let (tag, ignore) = match d.tag {
                Some(t) => (data_tag(id, t), 0),
                None => (data_tag(id, 0), u64::from(u32::MAX)),
            };
            // SAFETY: the buffer is `size` bytes of registered memory this
            // grave owns and frees only once the provider returned all its
            // receives (`bury`, and `Drop for Graves`, which runs after the
            // hub's endpoints closed); what lands there is never read. The
            // context names the grave and the receive.
            let r = unsafe {
                ep.trecv(
                    e.ptr.as_ptr(),
                    self.size,
                    desc,
                    self.src,
                    tag,
                    ignore,
                    context(id, GRAVE_LOCAL | j as u32),
                )
            };
            match r {
                Ok(()) => d.posted = true,
                Err(e) if e.is_again() => {}
                Err(e) => {
                    tracing::warn!("hub: could not post a closed comm's drain receive: {e}");
                }
            }
        }
    }

    fn retire(&mut self, ep: &Endpoint, id: u32) {
        if self.retiring {
            return;
        }
        self.retiring = true;
        for (j, _) in self.drains.iter().enumerate().filter(|(_, d)| d.posted) {
            // SAFETY: the context is this grave's posted receive; cancelling
            // one the provider already finished is harmless (its completion
            // comes as usual).
            let _ = unsafe { ep.cancel(context(id, GRAVE_LOCAL | j as u32)) };
        }
    }
}

/// How the provider returned a grave's receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Returned {
    /// It took a message (whole, or cut to the buffer: `FI_ETRUNC`).
    Took,
    /// It was cancelled.
    Cancelled,
    /// It failed otherwise.
    Failed,
}

/// A hub's graves (passive port), by the closed comm's id.
#[derive(Default)]
pub struct Graves {
    map: HashMap<u32, Grave>,
}

impl std::fmt::Debug for Graves {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graves({} open)", self.map.len())
    }
}

impl Graves {
    /// Digs a grave for closed comm `c.id`, unless its peer's `Bye` said
    /// the comm took all it sent.
    pub fn dig(&mut self, ep: &Endpoint, registrar: DomainRegistrar, c: Closed) {
        if c.sent.is_some_and(|s| s == c.taken) {
            return;
        }
        let size = c.cap.max(GRAVE_MIN);
        let params = Params {
            elem_size: size,
            align: SLOT_ALIGN,
            elems_per_block: 1,
            max_elems: 1,
        };
        let (list, buf) = match Freelist::new(HostPages, registrar, params)
            .and_then(|mut l| l.alloc().map(|b| (l, b)))
        {
            Ok(lb) => lb,
            Err(e) => {
                tracing::warn!("hub: no drain buffer for a closed comm ({e}): what its peer still sends stays with the provider");
                return;
            }
        };
        let Closed {
            id,
            src,
            token,
            taken,
            sent,
            tags,
            ..
        } = c;
        let mut g = Grave {
            src,
            token,
            list,
            buf: Some(buf),
            size,
            drains: tags
                .iter()
                .take(GRAVE_TAGS)
                .map(|&t| Some(t))
                .chain([None])
                .map(|tag| Drain { tag, posted: false })
                .collect(),
            taken,
            sent,
            retiring: false,
            last: Instant::now(),
        };
        g.post(ep, id);
        tracing::debug!(
            "hub: comm {id} closed while its peer may still send ({taken} of its messages taken, {} sent): draining them into {size} bytes of the hub's own ({} receives)",
            sent.map_or("unknown".to_owned(), |s| s.to_string()),
            g.drains.len()
        );
        self.map.insert(id, g);
    }

    /// The provider returned receive `local` of grave `id`: it took a
    /// message (delivered or truncated), gave it back (cancelled), or
    /// failed it (the peer's connection broke: nothing more comes, and
    /// nothing is posted to that peer again — found by the soak, where
    /// reposting after a killed peer's failure crashed inside rxm's
    /// `fi_trecv`).
    pub fn on_return(&mut self, ep: &Endpoint, id: u32, local: u32, how: Returned) {
        let Some(g) = self.map.get_mut(&id) else {
            return;
        };
        let Some(d) = g.drains.get_mut((local & 0xFF) as usize) else {
            return;
        };
        d.posted = false;
        if how == Returned::Took {
            g.taken = g.taken.wrapping_add(1);
            g.last = Instant::now();
        }
        if g.done() || how == Returned::Failed {
            g.retire(ep, id);
        }
        if !g.retiring {
            g.post(ep, id);
        } else if !g.posted() {
            self.bury(id);
        }
    }

    /// A control message for closed comm `id`: its peer's `Bye` says how
    /// many it sent. True when a grave took it.
    pub fn on_ctrl(&mut self, ep: &Endpoint, id: u32, token: u32, bytes: &[u8]) -> bool {
        let Some(g) = self.map.get_mut(&id).filter(|g| g.token == token) else {
            return false;
        };
        if let Ok(Ctrl::Bye { sent }) = Ctrl::decode(bytes) {
            g.sent = Some(sent);
            if g.done() {
                g.retire(ep, id);
                if !g.posted() {
                    self.bury(id);
                }
            }
        }
        true
    }

    /// Retires graves that took nothing for `idle`, and posts again what
    /// the provider refused for now.
    pub fn sweep(&mut self, ep: &Endpoint, idle: Duration) {
        let now = Instant::now();
        let mut gone = Vec::new();
        for (&id, g) in &mut self.map {
            if now.duration_since(g.last) > idle {
                g.retire(ep, id);
            }
            if !g.retiring {
                g.post(ep, id);
            } else if !g.posted() {
                gone.push(id);
            }
        }
        for id in gone {
            self.bury(id);
        }
    }

    /// Frees a grave whose receives the provider does not hold.
    fn bury(&mut self, id: u32) {
        if let Some(mut g) = self.map.remove(&id) {
            debug_assert!(!g.posted());
            if let Some(b) = g.buf.take() {
                g.list.free(b);
            }
        }
    }
}

impl Drop for Graves {
    /// Runs after the hub's endpoints closed (field order): nothing is
    /// posted any more.
    fn drop(&mut self) {
        for g in self.map.values_mut() {
            if let Some(b) = g.buf.take() {
                g.list.free(b);
            }
        }
    }
}
