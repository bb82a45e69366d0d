//! Registration cache: one per domain, so an mhandle is valid on every comm of
//! its device (`regIsGlobal` = 1).
//!
//! A registration covers exactly the bytes NCCL registered, never the whole
//! pages around them: its remote key then opens only those bytes, and the
//! provider itself refuses a peer's write or read outside them (a key of a
//! page-rounded registration let a peer change up to a page of NCCL's
//! memory on either side of an offered buffer). A registration is shared
//! only by requests for exactly the same range (NCCL's net_ib does the same): NCCL
//! registers each buffer once and frees it after `deregMr`, and a registration
//! that merged several buffers, or that a sub-range kept alive, would outlive
//! the memory that made it. New memory mapped at the same address would then
//! hit the stale registration (on verbs or EFA: pinned old pages, silent
//! corruption). With exact ranges, a registration lives exactly as long as a
//! handle NCCL holds for that range; the last release deregisters it and
//! drops it from the map. Buffers NCCL passes are checked against the handle's
//! `(addr, len)` ([`crate::core`]), which is the registration's own range.

use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::fabric::{Domain, FiError, Mr};
use crate::freelist::{MrDesc, Registrar};
use crate::memkind::MemKind;

/// One registered range.
pub struct Region<G> {
    kind: MemKind,
    start: usize,
    end: usize,
    desc: MrDesc,
    _reg: G,
}

impl<G> Region<G> {
    /// What memory this is.
    pub fn kind(&self) -> MemKind {
        self.kind
    }
    /// The descriptor passed with data transfers from this range.
    pub fn desc(&self) -> MrDesc {
        self.desc
    }
    /// Whether `addr..addr+len` lies inside this registration.
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.start && addr.checked_add(len).is_some_and(|e| e <= self.end)
    }
    /// The registered range.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.start..self.end
    }
}

impl<G> fmt::Debug for Region<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Region({:#x}..{:#x})", self.start, self.end)
    }
}

/// A registration failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("memory registration of {len} bytes at {addr:#x} failed: {why}")]
pub struct RegError {
    /// Start of the requested range.
    pub addr: usize,
    /// Its length.
    pub len: usize,
    /// The registrar's reason.
    pub why: String,
}

/// What a registration is keyed on: the memory's kind (and device), and
/// the registered range.
type Key = (MemKind, usize, usize);

/// The per-domain registration cache.
pub struct MrCache<R: Registrar> {
    registrar: R,
    map: Mutex<HashMap<Key, Weak<Region<R::Registration>>>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl<R: Registrar> fmt::Debug for MrCache<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrCache")
            .field("entries", &self.len())
            .field("hits", &self.hits.load(Ordering::Relaxed))
            .field("misses", &self.misses.load(Ordering::Relaxed))
            .finish()
    }
}

/// The range registered for `addr..addr+len` of `kind`: exactly those bytes
/// (a zero-length registration still names one byte, so that it has a key
/// and its address stays valid to pass).
fn exact_range(addr: usize, len: usize, kind: MemKind) -> Option<Key> {
    Some((kind, addr, addr.checked_add(len.max(1))?))
}

impl<R: Registrar> MrCache<R> {
    /// An empty cache registering through `registrar`.
    pub fn new(registrar: R) -> Self {
        Self {
            registrar,
            map: Mutex::new(HashMap::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Registered ranges currently cached.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (hits, misses) so far.
    pub fn stats(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Weak<Region<R::Registration>>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns a registration of `addr..addr+len` (host memory): the cached
    /// one for exactly that range, or a new one.
    ///
    /// # Safety
    /// The range stays mapped while the returned handle lives.
    pub unsafe fn register(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<Arc<Region<R::Registration>>, RegError> {
        // SAFETY: forwarded contract.
        unsafe { self.register_kind(addr, len, MemKind::Host) }
    }

    /// [`MrCache::register`] for memory of `kind`.
    ///
    /// # Safety
    /// The range stays allocated while the returned handle lives.
    pub unsafe fn register_kind(
        &self,
        addr: usize,
        len: usize,
        kind: MemKind,
    ) -> Result<Arc<Region<R::Registration>>, RegError> {
        self.cached(addr, len, kind, |base, len| {
            // SAFETY: the caller keeps the range allocated while the handle lives.
            unsafe { self.registrar.register_kind(base, len, kind) }
        })
    }

    /// [`MrCache::register_kind`] of device `dev`'s memory through the
    /// DMA-BUF `fd` that holds it, from `offset` on. Keyed as the same
    /// memory registered by address: either registration serves both.
    ///
    /// # Safety
    /// The range stays allocated while the returned handle lives; `fd` is
    /// open for the call.
    pub unsafe fn register_dmabuf(
        &self,
        addr: usize,
        len: usize,
        dev: i32,
        fd: i32,
        offset: u64,
    ) -> Result<Arc<Region<R::Registration>>, RegError> {
        self.cached(addr, len, MemKind::Cuda(dev), |base, len| {
            // SAFETY: the caller keeps the range allocated and `fd` open.
            unsafe { self.registrar.register_dmabuf(base, len, dev, fd, offset) }
        })
    }

    /// The cached registration of `addr..addr+len` of `kind`, or a new one
    /// made by `make(start, len)` for the range the key names.
    fn cached(
        &self,
        addr: usize,
        len: usize,
        kind: MemKind,
        make: impl FnOnce(NonNull<u8>, usize) -> Result<Option<(R::Registration, MrDesc)>, String>,
    ) -> Result<Arc<Region<R::Registration>>, RegError> {
        let fail = |why: String| RegError { addr, len, why };
        let key = exact_range(addr, len, kind).ok_or_else(|| fail("range overflows".into()))?;
        let mut map = self.lock();
        if let Some(r) = map.get(&key).and_then(Weak::upgrade) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(r);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let base = NonNull::new(key.1 as *mut u8).ok_or_else(|| fail("NULL address".into()))?;
        let (reg, desc) = match make(base, key.2 - key.1) {
            Ok(Some(r)) => r,
            Ok(None) => return Err(fail("the registrar does not register memory".into())),
            Err(why) => return Err(fail(why)),
        };
        let region = Arc::new(Region {
            kind,
            start: key.1,
            end: key.2,
            desc,
            _reg: reg,
        });
        map.insert(key, Arc::downgrade(&region));
        Ok(region)
    }

    /// Drops one reference; the last one deregisters and leaves the map.
    pub fn release(&self, region: Arc<Region<R::Registration>>) {
        let key = (region.kind, region.start, region.end);
        let mut map = self.lock();
        drop(region);
        if map.get(&key).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&key);
        }
    }
}

/// Registers freelist blocks and cached ranges with a domain: host memory,
/// or with [`Registrar::register_kind`], device memory.
#[derive(Debug, Clone)]
pub struct DomainRegistrar(pub Arc<Domain>);

impl Registrar for DomainRegistrar {
    type Registration = Mr;
    unsafe fn register(
        &self,
        ptr: std::ptr::NonNull<u8>,
        len: usize,
    ) -> Result<Option<(Mr, MrDesc)>, String> {
        // SAFETY: forwarded contract.
        unsafe { self.register_kind(ptr, len, MemKind::Host) }
    }
    unsafe fn register_kind(
        &self,
        ptr: std::ptr::NonNull<u8>,
        len: usize,
        kind: MemKind,
    ) -> Result<Option<(Mr, MrDesc)>, String> {
        // SAFETY: forwarded contract: the range stays allocated while the Mr lives.
        let mr = unsafe {
            Mr::register_kind(&self.0, ptr.as_ptr(), len, crate::fabric::ACCESS_ALL, kind)
        };
        described(mr)
    }
    unsafe fn register_dmabuf(
        &self,
        ptr: std::ptr::NonNull<u8>,
        len: usize,
        dev: i32,
        fd: i32,
        offset: u64,
    ) -> Result<Option<(Mr, MrDesc)>, String> {
        // SAFETY: forwarded contract.
        let mr = unsafe {
            Mr::register_dmabuf(
                &self.0,
                ptr.as_ptr(),
                len,
                crate::fabric::ACCESS_ALL,
                dev,
                fd,
                offset,
            )
        };
        described(mr)
    }
}

/// A registration with the descriptor a freelist or cache keeps of it.
fn described(mr: Result<Mr, FiError>) -> Result<Option<(Mr, MrDesc)>, String> {
    let mr = mr.map_err(|e| e.to_string())?;
    let d = MrDesc {
        desc: mr.desc(),
        key: mr.key(),
    };
    Ok(Some((mr, d)))
}

/// Registers a freelist's blocks as memory of one kind (a GPU-backed
/// freelist's: `MemKind::Cuda(dev)`).
#[derive(Debug, Clone)]
#[cfg(feature = "testing")]
pub struct KindRegistrar {
    pub domain: DomainRegistrar,
    pub kind: MemKind,
}

#[cfg(feature = "testing")]
impl Registrar for KindRegistrar {
    type Registration = Mr;
    unsafe fn register(
        &self,
        ptr: std::ptr::NonNull<u8>,
        len: usize,
    ) -> Result<Option<(Mr, MrDesc)>, String> {
        // SAFETY: forwarded contract.
        unsafe { self.domain.register_kind(ptr, len, self.kind) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// Records registrations; each registration's token un-records on drop.
    #[derive(Default, Clone)]
    struct Rec(Rc<RefCell<Vec<(usize, usize)>>>);
    struct Token(Rc<RefCell<Vec<(usize, usize)>>>, (usize, usize));
    impl Drop for Token {
        fn drop(&mut self) {
            let mut v = self.0.borrow_mut();
            let i = v.iter().position(|r| *r == self.1).expect("registered");
            v.remove(i);
        }
    }
    impl Registrar for Rec {
        type Registration = Token;
        unsafe fn register(
            &self,
            p: NonNull<u8>,
            len: usize,
        ) -> Result<Option<(Token, MrDesc)>, String> {
            let r = (p.as_ptr() as usize, len);
            self.0.borrow_mut().push(r);
            Ok(Some((
                Token(self.0.clone(), r),
                MrDesc {
                    desc: std::ptr::null_mut(),
                    key: r.0 as u64,
                },
            )))
        }
    }

    const P: usize = 4096;
    const BASE: usize = 0x7000_0000_0000;

    fn reg(c: &MrCache<Rec>, a: usize, l: usize) -> Arc<Region<Token>> {
        // SAFETY: the test registrar never touches memory.
        unsafe { c.register(a, l) }.unwrap()
    }

    #[test]
    fn the_same_range_hits_and_is_refcounted() {
        let rec = Rec::default();
        let c = MrCache::new(rec.clone());
        let a = reg(&c, BASE + 10, 3 * P);
        assert_eq!(
            a.range(),
            BASE + 10..BASE + 10 + 3 * P,
            "exactly the bytes asked for"
        );
        let b = reg(&c, BASE + 10, 3 * P);
        assert!(Arc::ptr_eq(&a, &b), "the same range hits");
        assert_eq!(c.stats(), (1, 1));
        assert_eq!(rec.0.borrow().len(), 1);
        c.release(a);
        assert_eq!(rec.0.borrow().len(), 1, "still referenced");
        c.release(b);
        assert!(rec.0.borrow().is_empty(), "last release deregisters");
        assert!(c.is_empty());
    }

    /// 1 KiB in the middle of a page is registered as exactly that KiB (the
    /// key of a page-rounded registration opened 3 KiB around it), and a
    /// range on the same pages that differs by a byte registers on its own.
    #[test]
    fn a_registration_covers_exactly_what_was_asked() {
        let rec = Rec::default();
        let c = MrCache::new(rec.clone());
        let a = reg(&c, BASE + 1024, 1024);
        assert_eq!(a.range(), BASE + 1024..BASE + 2048);
        assert!(!a.contains(BASE + 512, 512) && !a.contains(BASE + 2048, 1));
        assert_eq!(rec.0.borrow().as_slice(), &[(BASE + 1024, 1024)]);
        let b = reg(&c, BASE + 1024, 1025);
        assert!(!Arc::ptr_eq(&a, &b));
        let zero = reg(&c, BASE + 7, 0);
        assert_eq!(
            zero.range(),
            BASE + 7..BASE + 8,
            "an empty range names one byte"
        );
        c.release(a);
        c.release(b);
        c.release(zero);
        assert!(rec.0.borrow().is_empty() && c.is_empty());
    }

    /// A sub-range or an overlapping range gets a registration of its own,
    /// so no registration outlives the handles NCCL holds for its range.
    #[test]
    fn sub_ranges_and_overlaps_register_their_own_pages() {
        let rec = Rec::default();
        let c = MrCache::new(rec.clone());
        let parent = reg(&c, BASE, 256 * P);
        let sub = reg(&c, BASE + P, P);
        assert!(!Arc::ptr_eq(&parent, &sub));
        assert_eq!(sub.range(), BASE + P..BASE + 2 * P);
        let over = reg(&c, BASE + 200 * P, 100 * P);
        assert_eq!(over.range(), BASE + 200 * P..BASE + 300 * P);
        assert_eq!(c.stats(), (0, 3));
        c.release(parent);
        assert_eq!(rec.0.borrow().len(), 2, "the parent's registration is gone");
        assert!(
            !sub.contains(BASE + 128 * P, 4096),
            "the sub-range covers only its page"
        );
        c.release(sub);
        c.release(over);
        assert!(rec.0.borrow().is_empty() && c.is_empty());
    }

    /// register -> free -> (new memory at the same address) -> register:
    /// a fresh registration, never the old one.
    #[test]
    fn reregistering_freed_memory_registers_again() {
        let rec = Rec::default();
        let c = MrCache::new(rec.clone());
        let a = reg(&c, BASE, 4 * P);
        let key_a = a.desc().key;
        c.release(a);
        assert!(rec.0.borrow().is_empty());
        let b = reg(&c, BASE, 4 * P);
        assert_eq!(c.stats(), (0, 2), "the second registration is a miss");
        assert_eq!(b.desc().key, key_a, "same address");
        assert_eq!(rec.0.borrow().len(), 1);
        c.release(b);
    }

    proptest::proptest! {
        /// Random registrations and releases: every handle covers what it asked
        /// for, exactly one registration exists per range held, and
        /// releasing everything empties the cache.
        #[test]
        fn model(ops in proptest::collection::vec((0usize..64, 1usize..(8 * P), proptest::bool::ANY), 1..120)) {
            let rec = Rec::default();
            let c = MrCache::new(rec.clone());
            let mut held = Vec::new();
            for (page, len, release) in ops {
                if release && !held.is_empty() {
                    let r = held.swap_remove(page % held.len());
                    c.release(r);
                } else {
                    let addr = BASE + page * P + page;
                    let r = reg(&c, addr, len);
                    proptest::prop_assert!(r.contains(addr, len));
                    held.push(r);
                }
                // One live registration per distinct range held.
                let mut ranges: Vec<_> = held.iter().map(|r| (r.start, r.end)).collect();
                ranges.sort_unstable();
                ranges.dedup();
                proptest::prop_assert_eq!(rec.0.borrow().len(), ranges.len());
            }
            for r in held.drain(..) { c.release(r); }
            proptest::prop_assert!(c.is_empty());
            proptest::prop_assert!(rec.0.borrow().is_empty());
        }
    }
}
