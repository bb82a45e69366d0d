//! Registration cache: one per domain, so an mhandle is valid on every comm of
//! its device (`regIsGlobal` = 1).
//!
//! Registrations cover whole pages. The cache is an interval map of disjoint
//! page ranges (`BTreeMap` keyed by start): a lookup is one predecessor search,
//! O(log n). A request inside a cached range is a hit and shares its
//! registration; a request overlapping cached ranges registers their union,
//! which replaces them in the map (their holders keep the old registrations
//! until they release them). A registration lives as long as any handle to it
//! (the reference count is the `Arc`'s); the last release deregisters it and
//! drops it from the map.

use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::freelist::{page_size, MrDesc, Registrar};

/// One registered page range.
pub struct Region<G> {
    start: usize,
    end: usize,
    desc: MrDesc,
    _reg: G,
}

impl<G> Region<G> {
    /// The descriptor passed with data transfers from this range.
    pub fn desc(&self) -> MrDesc {
        self.desc
    }
    /// Whether `addr..addr+len` lies inside this registration.
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.start && addr.checked_add(len).is_some_and(|e| e <= self.end)
    }
    /// The registered page range.
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

struct Entry<G> {
    end: usize,
    region: Weak<Region<G>>,
}

/// The per-domain registration cache.
pub struct MrCache<R: Registrar> {
    registrar: R,
    map: Mutex<BTreeMap<usize, Entry<R::Registration>>>,
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

fn page_range(addr: usize, len: usize) -> Option<(usize, usize)> {
    let page = page_size();
    let start = addr & !(page - 1);
    // A zero-length registration still pins the page it names.
    let end = addr
        .checked_add(len.max(1))?
        .checked_next_multiple_of(page)?;
    Some((start, end))
}

impl<R: Registrar> MrCache<R> {
    /// An empty cache registering through `registrar`.
    pub fn new(registrar: R) -> Self {
        Self {
            registrar,
            map: Mutex::new(BTreeMap::new()),
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

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Entry<R::Registration>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns a registration covering `addr..addr+len`, registering if needed.
    ///
    /// # Safety
    /// The pages of the range stay mapped while the returned handle (and any
    /// registration built over it) lives.
    pub unsafe fn register(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<Arc<Region<R::Registration>>, RegError> {
        let fail = |why: String| RegError { addr, len, why };
        let (start, end) = page_range(addr, len).ok_or_else(|| fail("range overflows".into()))?;
        let mut map = self.lock();
        if let Some((_, e)) = map.range(..=start).next_back() {
            if e.end >= end {
                if let Some(r) = e.region.upgrade() {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(r);
                }
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        // Entries are disjoint and sorted: those overlapping [start, end) are
        // the last ones starting before `end` whose end is past `start`.
        let mut overlapped = Vec::new();
        let (mut lo, mut hi) = (start, end);
        for (&s, e) in map.range(..end).rev() {
            if e.end <= start {
                break;
            }
            overlapped.push(s);
            if e.region.strong_count() > 0 {
                lo = lo.min(s);
                hi = hi.max(e.end);
            }
        }
        let base = NonNull::new(lo as *mut u8).ok_or_else(|| fail("NULL address".into()))?;
        // SAFETY: the caller keeps [start, end) mapped; the live overlapped
        // ranges in the union are mapped because their holders keep them so.
        let (reg, desc) = match unsafe { self.registrar.register(base, hi - lo) } {
            Ok(Some(r)) => r,
            Ok(None) => return Err(fail("the registrar does not register memory".into())),
            Err(why) => return Err(fail(why)),
        };
        for s in overlapped {
            map.remove(&s);
        }
        let region = Arc::new(Region {
            start: lo,
            end: hi,
            desc,
            _reg: reg,
        });
        map.insert(
            lo,
            Entry {
                end: hi,
                region: Arc::downgrade(&region),
            },
        );
        Ok(region)
    }

    /// Drops one reference; the last one deregisters and leaves the map.
    pub fn release(&self, region: Arc<Region<R::Registration>>) {
        let start = region.start;
        let mut map = self.lock();
        drop(region);
        if map
            .get(&start)
            .is_some_and(|e| e.region.strong_count() == 0)
        {
            map.remove(&start);
        }
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
    fn sub_range_is_a_hit_and_refcounted() {
        let rec = Rec::default();
        let c = MrCache::new(rec.clone());
        let a = reg(&c, BASE + 10, 3 * P);
        assert_eq!(a.range(), BASE..BASE + 4 * P, "page aligned");
        let b = reg(&c, BASE + P, 100);
        assert!(Arc::ptr_eq(&a, &b), "sub-range hits");
        assert_eq!(c.stats(), (1, 1));
        assert_eq!(rec.0.borrow().len(), 1);
        c.release(a);
        assert_eq!(rec.0.borrow().len(), 1, "still referenced");
        c.release(b);
        assert!(rec.0.borrow().is_empty(), "last release deregisters");
        assert!(c.is_empty());
    }

    #[test]
    fn overlap_registers_the_union_and_old_holders_keep_theirs() {
        let rec = Rec::default();
        let c = MrCache::new(rec.clone());
        let a = reg(&c, BASE, P);
        let b = reg(&c, BASE + 4 * P, P);
        let u = reg(&c, BASE + P / 2, 5 * P);
        assert_eq!(u.range(), BASE..BASE + 6 * P);
        assert_eq!(c.len(), 1, "the union replaced both entries");
        assert_eq!(rec.0.borrow().len(), 3);
        let hit = reg(&c, BASE + 2 * P, 10);
        assert!(Arc::ptr_eq(&hit, &u));
        c.release(a);
        c.release(b);
        assert_eq!(rec.0.borrow().len(), 1);
        assert_eq!(c.len(), 1, "releasing replaced regions keeps the union");
        c.release(hit);
        c.release(u);
        assert!(rec.0.borrow().is_empty() && c.is_empty());
    }

    #[test]
    fn disjoint_ranges_do_not_hit() {
        let c = MrCache::new(Rec::default());
        let a = reg(&c, BASE, P);
        let b = reg(&c, BASE + 2 * P, P);
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(c.len(), 2);
        assert!(a.contains(BASE + 5, P - 5) && !a.contains(BASE + 5, P));
        c.release(a);
        c.release(b);
    }

    proptest::proptest! {
        /// Random registrations and releases: every handle covers what it asked
        /// for, entries stay disjoint, and releasing everything empties the cache.
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
                let map = c.lock();
                let mut prev_end = 0;
                for (&s, e) in map.iter() {
                    proptest::prop_assert!(s >= prev_end && e.end > s, "entries overlap");
                    prev_end = e.end;
                }
            }
            for r in held.drain(..) { c.release(r); }
            proptest::prop_assert!(c.is_empty());
            proptest::prop_assert!(rec.0.borrow().is_empty());
        }
    }
}
