//! The operations whose cost the micro-benchmarks measure, shared by the
//! criterion bench (`tests/benches/micro.rs`, time) and `weft-micro` (run
//! under callgrind by `weft-bench --micro`, instructions). Each function
//! repeats one operation `n` times and returns a value that depends on every
//! result, so nothing is optimised away; none is inlined, so callgrind can
//! attribute instructions to it by name.

use std::ffi::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use weft::freelist::{Freelist, HostPages, MrDesc, NoRegistration, Params, Registrar};
use weft::mr::{MrCache, Region};

extern "C" {
    fn cfl_new(elem_size: usize, n: usize) -> *mut c_void;
    fn cfl_delete(l: *mut c_void);
    fn cfl_bench_pair(l: *mut c_void, n: u64) -> u64;
    fn cfl_bench_burst(l: *mut c_void, rounds: u64) -> u64;
}

/// Elements per list and per burst.
pub const BURST: usize = 256;
/// Bytes per element.
pub const ELEM: usize = 64;

/// The C intrusive freelist of `tests/c/freelist.c`.
#[derive(Debug)]
pub struct CFreelist(NonNull<c_void>);

impl CFreelist {
    /// [`BURST`] elements of [`ELEM`] bytes.
    pub fn new() -> Self {
        // SAFETY: plain C allocation; NULL only when out of memory.
        let p = unsafe { cfl_new(ELEM, BURST) };
        Self(NonNull::new(p).expect("cfl_new: out of memory"))
    }

    /// `n` x (alloc, free).
    #[inline(never)]
    pub fn pair(&mut self, n: u64) -> u64 {
        // SAFETY: the list is live; its loop only touches its own memory.
        unsafe { cfl_bench_pair(self.0.as_ptr(), n) }
    }

    /// `rounds` x (256 allocs, 256 frees).
    #[inline(never)]
    pub fn burst(&mut self, rounds: u64) -> u64 {
        // SAFETY: as above; the list holds exactly 256 elements.
        unsafe { cfl_bench_burst(self.0.as_ptr(), rounds) }
    }
}

impl Default for CFreelist {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for CFreelist {
    fn drop(&mut self) {
        // SAFETY: created by cfl_new, deleted once.
        unsafe { cfl_delete(self.0.as_ptr()) }
    }
}

/// Weft's freelist as the protocol uses it (host pages, no registration),
/// grown to [`BURST`] elements of [`ELEM`] bytes up front.
pub fn weft_freelist() -> Freelist<HostPages, NoRegistration> {
    let mut l = Freelist::new(
        HostPages,
        NoRegistration,
        Params {
            elem_size: ELEM,
            align: ELEM,
            elems_per_block: BURST,
            max_elems: BURST,
        },
    )
    .expect("freelist");
    l.grow().expect("grow");
    l
}

/// `n` x (alloc, free) on Weft's freelist.
#[inline(never)]
pub fn freelist_pair(l: &mut Freelist<HostPages, NoRegistration>, n: u64) -> u64 {
    let mut sum = 0u64;
    for _ in 0..n {
        let e = l.alloc().expect("alloc");
        sum = sum.wrapping_add(e.ptr.as_ptr() as u64);
        l.free(e);
    }
    sum
}

/// `rounds` x (256 allocs, then 256 frees) on Weft's freelist.
#[inline(never)]
pub fn freelist_burst(
    l: &mut Freelist<HostPages, NoRegistration>,
    held: &mut Vec<weft::freelist::Elem>,
    rounds: u64,
) -> u64 {
    let mut sum = 0u64;
    for _ in 0..rounds {
        for _ in 0..BURST {
            let e = l.alloc().expect("alloc");
            sum = sum.wrapping_add(e.ptr.as_ptr() as u64);
            held.push(e);
        }
        for e in held.drain(..) {
            l.free(e);
        }
    }
    sum
}

/// A registrar that registers nothing real (the cache's own cost only).
#[derive(Debug, Clone, Copy)]
pub struct CountingRegistrar;

impl Registrar for CountingRegistrar {
    type Registration = ();
    unsafe fn register(
        &self,
        _ptr: NonNull<u8>,
        _len: usize,
    ) -> Result<Option<((), MrDesc)>, String> {
        Ok(Some((
            (),
            MrDesc {
                desc: std::ptr::null_mut(),
                key: 0,
            },
        )))
    }
}

/// An MR cache holding one 1 MiB registration (kept alive by the returned
/// region) with 63 others around it, as a running job has.
pub fn mr_cache(buf: &[u8]) -> (MrCache<CountingRegistrar>, Vec<Arc<Region<()>>>) {
    let cache = MrCache::new(CountingRegistrar);
    let chunk = buf.len() / 64;
    let held = (0..64)
        .map(|i| {
            // SAFETY: `buf` outlives the cache in every caller.
            unsafe { cache.register(buf.as_ptr() as usize + i * chunk, chunk / 2) }
                .expect("register")
        })
        .collect();
    (cache, held)
}

/// `n` x a cache hit (lookup of a registered page range, then release).
#[inline(never)]
pub fn mr_hit(cache: &MrCache<CountingRegistrar>, addr: usize, len: usize, n: u64) -> u64 {
    let mut sum = 0u64;
    for _ in 0..n {
        // SAFETY: the range lies in a registration the caller keeps alive.
        let r = unsafe { cache.register(addr, len) }.expect("hit");
        sum = sum.wrapping_add(r.range().start as u64);
        cache.release(r);
    }
    sum
}

/// `n` x `devices()` on the core directly.
#[inline(never)]
pub fn core_devices(n: u64) -> u64 {
    let mut sum = 0u64;
    for _ in 0..n {
        sum = sum.wrapping_add(weft::core::devices().expect("devices") as u64);
    }
    sum
}

/// `n` x `devices()` through an exported table's adapter: `f` is
/// `ncclNetPlugin_vN.devices`.
#[inline(never)]
pub fn table_devices(f: unsafe extern "C" fn(*mut c_int) -> c_int, n: u64) -> u64 {
    let mut sum = 0u64;
    for _ in 0..n {
        let mut d: c_int = 0;
        // SAFETY: NCCL's contract for devices(): a valid out pointer.
        let rc = unsafe { f(&mut d) };
        sum = sum.wrapping_add((d + rc) as u64);
    }
    sum
}
