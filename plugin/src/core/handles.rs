//! Validation of the pointers NCCL hands back.
//!
//! Every comm, context and memory handle given to NCCL is an `Arc` whose
//! address is recorded here; a pointer NCCL passes in is looked up before
//! anything is read through it, so a stale or foreign pointer is an error, not
//! undefined behaviour. Requests live in per-comm pools; their address ranges
//! map to the owning comm.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, RwLock};

/// Hashes the addresses used as keys: Fibonacci hashing of one word. The
/// keys are addresses chosen by the allocator, not by a peer, so SipHash's
/// resistance to chosen keys buys nothing here and costs ~100 instructions
/// on every call NCCL makes.
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
}

type AddrMap<T> = HashMap<usize, Arc<T>, BuildHasherDefault<AddrHasher>>;

/// Live objects of one kind, keyed by the address handed to NCCL.
#[derive(Debug)]
pub struct Registry<T> {
    map: RwLock<AddrMap<T>>,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Self {
            map: RwLock::new(AddrMap::default()),
        }
    }
}

impl<T> Registry<T> {
    /// Records `v` and returns the pointer to give NCCL.
    pub fn insert(&self, v: Arc<T>) -> *mut c_void {
        let p = Arc::as_ptr(&v) as *mut c_void;
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(p as usize, v);
        p
    }
    /// The live object at `p`, if `p` is one.
    pub fn get(&self, p: *const c_void) -> Option<Arc<T>> {
        self.map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(p as usize))
            .cloned()
    }
    /// Runs `f` on the live object at `p` under the registry's read lock,
    /// without taking a reference (the data path's way: no reference-count
    /// traffic per call). `f` must not write to this registry.
    pub fn with<R>(&self, p: *const c_void, f: impl FnOnce(&T) -> R) -> Option<R> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        map.get(&(p as usize)).map(|v| f(v))
    }
    /// Forgets and returns the object at `p`.
    pub fn remove(&self, p: *const c_void) -> Option<Arc<T>> {
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(p as usize))
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
    /// Forgets every object and returns how many there were.
    pub fn clear(&self) -> usize {
        let old = std::mem::take(&mut *self.map.write().unwrap_or_else(|e| e.into_inner()));
        old.len()
    }
}

/// Address ranges owned by an object (request pools -> their comm).
#[derive(Debug)]
pub struct RangeRegistry<T> {
    map: RwLock<BTreeMap<usize, (usize, Arc<T>)>>,
}

impl<T> Default for RangeRegistry<T> {
    fn default() -> Self {
        Self {
            map: RwLock::new(BTreeMap::new()),
        }
    }
}

impl<T> RangeRegistry<T> {
    /// Records that `start..end` belongs to `owner`.
    pub fn insert(&self, range: std::ops::Range<usize>, owner: Arc<T>) {
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(range.start, (range.end, owner));
    }
    /// The owner of the range containing `p`.
    pub fn find(&self, p: *const c_void) -> Option<Arc<T>> {
        let a = p as usize;
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        let (_, (end, owner)) = map.range(..=a).next_back()?;
        (a < *end).then(|| Arc::clone(owner))
    }
    /// Runs `f` on the owner of the range containing `p`, under the read
    /// lock (see [`Registry::with`]).
    pub fn with<R>(&self, p: *const c_void, f: impl FnOnce(&T) -> R) -> Option<R> {
        let a = p as usize;
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        let (_, (end, owner)) = map.range(..=a).next_back()?;
        (a < *end).then(|| f(owner))
    }
    /// Forgets the range starting at `start`.
    pub fn remove(&self, start: usize) {
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&start);
    }
    /// Forgets every range.
    pub fn clear(&self) {
        self.map.write().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_validates_pointers() {
        let r = Registry::default();
        let p = r.insert(Arc::new(5u32));
        assert_eq!(*r.get(p).unwrap(), 5);
        assert!(r.get(std::ptr::null()).is_none());
        assert!(r.get((p as usize + 4) as *const c_void).is_none());
        assert!(r.remove(p).is_some());
        assert!(r.get(p).is_none(), "stale after removal");
        let q = r.insert(Arc::new(6u32));
        assert_eq!(r.values().len(), 1);
        assert_eq!(r.clear(), 1);
        assert!(r.get(q).is_none() && r.is_empty());
    }

    #[test]
    fn ranges_map_to_owners() {
        let r = RangeRegistry::default();
        r.insert(100..200, Arc::new('a'));
        r.insert(300..310, Arc::new('b'));
        assert_eq!(*r.find(150 as *const c_void).unwrap(), 'a');
        assert_eq!(*r.find(300 as *const c_void).unwrap(), 'b');
        assert!(r.find(200 as *const c_void).is_none());
        assert!(r.find(99 as *const c_void).is_none());
        r.remove(100);
        assert!(r.find(150 as *const c_void).is_none());
    }
}
