//! Validation of the pointers NCCL hands back.
//!
//! Every context, comm, memory handle and request given to NCCL is an opaque
//! token, never an address: NCCL only stores these values and passes them
//! back. Tokens come from one process-wide counter and are never reused, so a
//! stale pointer (a closed comm, a deregistered handle, a request already
//! completed) can never name a live object, and a foreign pointer is refused:
//! it is looked up before anything is done with it.
//!
//! Requests are tokens too: their comm (its kind and the serial of its own
//! token), the slot in the comm's pool, and the slot's generation, which
//! grows every time the slot is freed. A stale request token names an old
//! generation, or a closed comm, and is refused instead of consuming a newer
//! request's completion.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Hashes the tokens used as keys: Fibonacci hashing of one word. Tokens are
/// chosen by Weft, not by a peer, so SipHash's resistance to chosen keys buys
/// nothing here and costs ~100 instructions on every call NCCL makes.
#[derive(Debug, Default, Clone, Copy)]
pub struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
    fn write_u64(&mut self, n: u64) {
        self.write_usize(n as usize);
    }
}

type TokenMap<T> = HashMap<u64, Arc<T>, BuildHasherDefault<AddrHasher>>;

/// Marks a token (bits 60..64): no real pointer NCCL might confuse it with
/// has these bits set on the platforms NCCL runs on.
const TOKEN_TAG: u64 = 0x5 << 60;
/// Marks a request of a send comm.
const REQ_SEND_TAG: u64 = 0x6 << 60;
/// Marks a request of a receive comm.
const REQ_RECV_TAG: u64 = 0x7 << 60;
const TAG_MASK: u64 = 0xF << 60;

/// A new, never-used serial number (1, 2, ...).
pub fn serial() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The token NCCL gets for the object recorded under `serial`.
pub(crate) fn token_of(serial: u64) -> *mut c_void {
    std::ptr::without_provenance_mut(((serial << 4) | TOKEN_TAG) as usize)
}

/// The serial number behind a token, if `p` is one.
fn serial_of(p: *const c_void) -> Option<u64> {
    let v = p as usize as u64;
    (v & TAG_MASK == TOKEN_TAG && v & 0xF == 0).then_some((v & !TAG_MASK) >> 4)
}

/// Slot index bits of a request token.
const REQ_SLOT_BITS: u32 = 10;
/// Generation bits of a request token (the pool compares generations
/// this wide).
const REQ_GEN_BITS: u32 = crate::proto::pool::GEN_BITS;

/// Which kind of comm a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReqKind {
    /// A send comm's.
    Send,
    /// A receive comm's.
    Recv,
}

/// The token NCCL gets for slot `slot` (generation `gen`) of the comm of
/// kind `kind` recorded under `comm` (its serial).
pub fn req_token(kind: ReqKind, comm: u64, slot: u32, gen: u32) -> *mut c_void {
    debug_assert!(slot < 1 << REQ_SLOT_BITS);
    let tag = match kind {
        ReqKind::Send => REQ_SEND_TAG,
        ReqKind::Recv => REQ_RECV_TAG,
    };
    let v = tag
        | (comm << (REQ_SLOT_BITS + REQ_GEN_BITS))
        | (u64::from(gen & ((1 << REQ_GEN_BITS) - 1)) << REQ_SLOT_BITS)
        | u64::from(slot);
    std::ptr::without_provenance_mut(v as usize)
}

/// A request token's (kind, comm serial, slot, generation); `None` if it
/// is none.
pub fn req_parts(p: *const c_void) -> Option<(ReqKind, u64, u32, u32)> {
    let v = p as usize as u64;
    let kind = match v & TAG_MASK {
        REQ_SEND_TAG => ReqKind::Send,
        REQ_RECV_TAG => ReqKind::Recv,
        _ => return None,
    };
    let v = v & !TAG_MASK;
    Some((
        kind,
        v >> (REQ_SLOT_BITS + REQ_GEN_BITS),
        (v & ((1 << REQ_SLOT_BITS) - 1)) as u32,
        ((v >> REQ_SLOT_BITS) & ((1 << REQ_GEN_BITS) - 1)) as u32,
    ))
}

/// Live objects of one kind, keyed by serial number. Lookups clone the
/// `Arc` and let go of the lock at once: no lock is held while the caller
/// works (the data path calls libfabric), so a connect or close that writes
/// here never waits for, or stalls, a data-path call.
#[derive(Debug)]
pub struct Registry<T: ?Sized> {
    map: RwLock<TokenMap<T>>,
}

impl<T: ?Sized> Default for Registry<T> {
    fn default() -> Self {
        Self {
            map: RwLock::new(TokenMap::default()),
        }
    }
}

impl<T: ?Sized> Registry<T> {
    /// Records `v` under a new token and returns the token for NCCL.
    pub fn insert(&self, v: Arc<T>) -> *mut c_void {
        let s = serial();
        self.insert_at(s, v);
        token_of(s)
    }
    /// Records `v` under `serial` (from [`serial`]).
    pub fn insert_at(&self, serial: u64, v: Arc<T>) {
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(serial, v);
    }
    /// The live object for the token `p`, if it is one.
    pub fn get(&self, p: *const c_void) -> Option<Arc<T>> {
        self.get_at(serial_of(p)?)
    }
    /// [`Registry::get`], with the serial number `p` carries.
    pub fn get_with_serial(&self, p: *const c_void) -> Option<(u64, Arc<T>)> {
        let s = serial_of(p)?;
        Some((s, self.get_at(s)?))
    }
    /// The live object recorded under `serial`.
    pub fn get_at(&self, serial: u64) -> Option<Arc<T>> {
        self.map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&serial)
            .cloned()
    }
    /// Forgets and returns the object for the token `p`.
    pub fn remove(&self, p: *const c_void) -> Option<Arc<T>> {
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&serial_of(p)?)
    }
    /// Forgets and returns the object recorded under `serial`.
    pub fn remove_at(&self, serial: u64) -> Option<Arc<T>> {
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&serial)
    }
    /// Live objects.
    pub fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|e| e.into_inner()).len()
    }
    /// True when none are live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The live objects, at this moment.
    pub fn values(&self) -> Vec<Arc<T>> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        map.values().cloned().collect()
    }
    /// The serial numbers of the live objects (to visit them one at a time
    /// with [`Registry::get_at`], holding none of them meanwhile).
    pub fn serials(&self) -> Vec<u64> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        map.keys().copied().collect()
    }
    /// Forgets every object and returns how many there were.
    pub fn clear(&self) -> usize {
        let old = std::mem::take(&mut *self.map.write().unwrap_or_else(|e| e.into_inner()));
        old.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_validates_tokens_and_never_reuses_them() {
        let r = Registry::default();
        let p = r.insert(Arc::new(5u32));
        assert_eq!(*r.get(p).unwrap(), 5);
        assert!(r.get(std::ptr::null()).is_none());
        assert!(r.get((p as usize + 16) as *const c_void).is_none());
        assert!(r.get((p as usize + 4) as *const c_void).is_none());
        assert!(r.remove(p).is_some());
        assert!(r.get(p).is_none(), "stale after removal");
        let q = r.insert(Arc::new(6u32));
        assert_ne!(p, q, "a new object never gets a closed one's token");
        assert!(r.get(p).is_none());
        assert_eq!(r.values().len(), 1);
        assert_eq!(r.clear(), 1);
        assert!(r.get(q).is_none() && r.is_empty());
    }

    #[test]
    fn request_tokens_carry_space_slot_and_generation() {
        let s = serial();
        let t = req_token(ReqKind::Recv, s, 255, 70_000);
        let (kind, comm, slot, gen) = req_parts(t).unwrap();
        assert_eq!((kind, comm, slot), (ReqKind::Recv, s, 255));
        let t = req_token(ReqKind::Send, s, 3, 1);
        assert_eq!(req_parts(t).unwrap().0, ReqKind::Send);
        assert_eq!(
            gen,
            70_000 & ((1 << REQ_GEN_BITS) - 1),
            "the generation, modulo its width"
        );
        assert!(
            req_parts(token_of(s)).is_none(),
            "a comm token is no request"
        );
        assert!(serial_of(t).is_none(), "a request token is no comm");
        assert!(req_parts(std::ptr::null()).is_none());
        assert!(req_parts(std::ptr::without_provenance::<c_void>(0x1)).is_none());
    }
}
