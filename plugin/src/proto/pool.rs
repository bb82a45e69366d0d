//! A typed pool on top of a [`Freelist`]: fixed slots, allocated once, whose
//! addresses are the handles given to NCCL (requests).

use std::marker::PhantomData;
use std::ptr::NonNull;

use crate::freelist::{Freelist, FreelistError, HostPages, NoRegistration, Params};

/// Generation bits a request token carries: a slot's generation is compared
/// modulo `2^GEN_BITS` (a stale handle aliases only after that many reuses
/// of its slot).
pub const GEN_BITS: u32 = 16;

/// Slots are aligned to this, leaving the low bits of a slot address free to
/// carry a sub-operation index in libfabric contexts.
pub const SLOT_ALIGN: usize = 64;

/// `max` slots of `T` in one block of host pages. Each slot has a
/// generation that grows when it is freed, so a handle that names a slot and
/// its generation goes stale when the slot is reused.
pub struct Pool<T: Copy> {
    list: Freelist<HostPages, NoRegistration>,
    live: Vec<bool>,
    gens: Vec<u32>,
    range: std::ops::Range<usize>,
    _t: PhantomData<T>,
}

impl<T: Copy> std::fmt::Debug for Pool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("range", &self.range)
            .field("in_use", &self.list.in_use())
            .finish()
    }
}

impl<T: Copy> Pool<T> {
    /// Allocates all `max` slots up front (one block), so the pool's address
    /// range is fixed for its lifetime.
    pub fn new(max: usize) -> Result<Self, FreelistError> {
        const { assert!(std::mem::align_of::<T>() <= SLOT_ALIGN) };
        let mut list = Freelist::new(
            HostPages,
            NoRegistration,
            Params {
                elem_size: std::mem::size_of::<T>().max(1),
                align: SLOT_ALIGN,
                elems_per_block: max,
                max_elems: max,
            },
        )?;
        list.grow()?;
        let first = list
            .elem_at(0)
            .expect("one block was allocated")
            .ptr
            .as_ptr() as usize;
        let range = first..first + max * list.elem_size();
        Ok(Self {
            list,
            live: vec![false; max],
            gens: vec![0; max],
            range,
            _t: PhantomData,
        })
    }

    /// The address range of all slots.
    #[cfg(test)]
    pub fn range(&self) -> std::ops::Range<usize> {
        self.range.clone()
    }

    /// Stores `v` in a free slot; `None` when all are in use.
    pub fn insert(&mut self, v: T) -> Option<(NonNull<T>, u32)> {
        let e = self.list.try_alloc()?;
        let p = e.ptr.cast::<T>();
        // SAFETY: the slot is ours, aligned for T and at least size_of::<T>() long.
        unsafe { p.as_ptr().write(v) };
        self.live[e.index() as usize] = true;
        Some((p, e.index()))
    }

    /// The slot whose address is `p`, whether live or not.
    #[cfg(test)]
    pub fn index_of(&self, p: *const u8) -> Option<u32> {
        // One block: slots are contiguous, `elem_size` apart.
        if !self.range.contains(&(p as usize)) {
            return None;
        }
        let off = p as usize - self.range.start;
        let stride = self.list.elem_size();
        let i = off / stride;
        (i * stride == off).then_some(i as u32)
    }

    /// The address of slot `i`.
    pub fn ptr(&self, i: u32) -> Option<NonNull<T>> {
        self.list.elem_at(i).map(|e| e.ptr.cast())
    }

    /// Slot `i`'s generation (counts the times it was freed).
    pub fn gen(&self, i: u32) -> u32 {
        self.gens.get(i as usize).copied().unwrap_or(0)
    }

    /// Whether `gen` (as a handle carries it, [`GEN_BITS`] wide) is slot
    /// `i`'s current generation.
    pub fn is_current(&self, i: u32, gen: u32) -> bool {
        let mask = (1u32 << GEN_BITS) - 1;
        self.gen(i) & mask == gen & mask
    }

    /// A live slot's value, to read.
    pub fn get(&self, i: u32) -> Option<&T> {
        if !*self.live.get(i as usize)? {
            return None;
        }
        let p = self.ptr(i)?;
        // SAFETY: live slots hold an initialised T written by `insert`; the
        // pool is borrowed, so nothing writes it meanwhile.
        Some(unsafe { &*p.as_ptr() })
    }

    /// A live slot's value.
    pub fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        if !*self.live.get(i as usize)? {
            return None;
        }
        let p = self.ptr(i)?;
        // SAFETY: live slots hold an initialised T written by `insert`; the
        // pool is borrowed mutably, so this is the only reference.
        Some(unsafe { &mut *p.as_ptr() })
    }

    /// Frees a live slot (its value is not copied out); false if not live.
    pub fn release(&mut self, i: u32) -> bool {
        if !self.live.get(i as usize).copied().unwrap_or(false) {
            return false;
        }
        let Some(e) = self.list.elem_at(i) else {
            return false;
        };
        self.live[i as usize] = false;
        self.gens[i as usize] = self.gens[i as usize].wrapping_add(1);
        self.list.free(e);
        true
    }

    /// Indices of live slots.
    pub fn live(&self) -> impl Iterator<Item = u32> + '_ {
        self.live
            .iter()
            .enumerate()
            .filter(|(_, &l)| l)
            .map(|(i, _)| i as u32)
    }

    /// Applies `fail` to every live slot; returns for how many it said true
    /// (a request that was still in flight and is now failed).
    pub fn fail_live(&mut self, mut fail: impl FnMut(&mut T) -> bool) -> usize {
        let live: Vec<u32> = self.live().collect();
        live.into_iter()
            .filter(|&i| self.get_mut(i).is_some_and(&mut fail))
            .count()
    }

    /// Slots in all.
    pub fn capacity(&self) -> usize {
        self.live.len()
    }

    /// Slots in use.
    pub fn in_use(&self) -> usize {
        self.list.in_use()
    }

    /// Frees every live slot (comm teardown with requests in flight).
    pub fn clear(&mut self) {
        let live: Vec<u32> = self.live().collect();
        for i in live {
            self.release(i);
        }
    }
}

impl<T: Copy> Drop for Pool<T> {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_bounded_and_validated() {
        let mut p: Pool<[u64; 3]> = Pool::new(4).unwrap();
        let (a, ia) = p.insert([1, 2, 3]).unwrap();
        assert_eq!(a.as_ptr() as usize % SLOT_ALIGN, 0);
        assert!(p.range().contains(&(a.as_ptr() as usize)));
        assert_eq!(p.index_of(a.as_ptr().cast()), Some(ia));
        assert_eq!(p.index_of((a.as_ptr() as usize + 8) as *const u8), None);
        let rest: Vec<_> = (0..3).map(|i| p.insert([i; 3]).unwrap()).collect();
        assert!(p.insert([0; 3]).is_none(), "bounded");
        assert_eq!(p.get_mut(ia).copied(), Some([1, 2, 3]));
        let g = p.gen(ia);
        assert!(p.release(ia));
        assert_eq!(
            p.gen(ia),
            g + 1,
            "freeing a slot makes its old handles stale"
        );
        assert!(p.get_mut(ia).is_none(), "freed slot is not live");
        assert!(!p.release(ia), "no double free");
        assert_eq!(p.in_use(), 3);
        drop(rest);
        p.clear();
        assert_eq!(p.in_use(), 0);
    }
}
