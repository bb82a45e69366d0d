//! Freelists of fixed-size buffers whose metadata lives apart from the data.
//!
//! An [`Elem`] is a buffer pointer plus, when the list is registered, the
//! memory-registration descriptor of the block it lives in. The list never
//! reads or writes the buffers themselves, so the backing memory may be GPU
//! memory. Memory comes from a pluggable [`MemorySource`] and is registered by a
//! pluggable [`Registrar`]; the registered and unregistered lists are the same
//! type.
//!
//! * Growth is in blocks; each block is registered once and every element of it
//!   carries that block's descriptor. Growth is bounded by `max_elems`, and a
//!   failed growth (allocation or registration) leaves the list exactly as it was.
//! * `alloc`/`free` are O(1), LIFO, take no lock and never allocate: a stack of
//!   free indices with its capacity reserved at growth time. The caller owns the
//!   list (one per comm, under the comm's lock).
//! * Debug builds keep a state per entry: a double free or a foreign element
//!   panics with a message, and dropping a list with elements still out is
//!   reported. Freed buffers are poisoned through the memory source's hook (a
//!   no-op for device memory).

use std::fmt;
use std::ptr::NonNull;

/// A registration descriptor carried by every element of a registered block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrDesc {
    /// The local descriptor passed to data-transfer calls (`fi_mr_desc`).
    pub desc: *mut libc::c_void,
    /// The remote key (`fi_mr_key`).
    pub key: u64,
}

// SAFETY: an MrDesc is a pair of plain values; the descriptor pointer is an
// opaque token owned by the registration, never dereferenced by Weft.
unsafe impl Send for MrDesc {}
// SAFETY: as above.
unsafe impl Sync for MrDesc {}

/// A buffer handed out by a freelist.
#[derive(Debug, PartialEq, Eq)]
pub struct Elem {
    /// Start of the buffer (`elem_size` bytes, aligned to the list's alignment).
    pub ptr: NonNull<u8>,
    /// The block's registration, when the list registers its memory.
    pub mr: Option<MrDesc>,
    index: u32,
}

// SAFETY: an Elem is the exclusive claim on one slot of its list; whoever
// holds it may use the buffer from any thread. The descriptor is a plain token.
unsafe impl Send for Elem {}

impl Elem {
    /// The element's index in its list (stable for the list's lifetime).
    pub fn index(&self) -> u32 {
        self.index
    }
}

/// Why a freelist could not hand out an element.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FreelistError {
    /// `max_elems` are all in use.
    #[error("freelist exhausted: all {max} elements of {size} bytes are in use")]
    Exhausted {
        /// The bound.
        max: usize,
        /// Element size.
        size: usize,
    },
    /// The memory source failed.
    #[error("freelist growth failed: could not allocate {bytes} bytes: {why}")]
    Alloc {
        /// Bytes asked for.
        bytes: usize,
        /// The source's reason.
        why: String,
    },
    /// The registrar failed.
    #[error("freelist growth failed: could not register {bytes} bytes: {why}")]
    Register {
        /// Bytes of the block.
        bytes: usize,
        /// The registrar's reason.
        why: String,
    },
    /// The parameters make no sense.
    #[error("invalid freelist parameters: {0}")]
    Invalid(&'static str),
}

/// Where a freelist's blocks come from.
pub trait MemorySource {
    /// Allocates `bytes` (a multiple of [`MemorySource::granularity`]).
    fn alloc(&self, bytes: usize) -> Result<NonNull<u8>, String>;
    /// Releases memory from `alloc`.
    ///
    /// # Safety
    /// `ptr` and `bytes` must be exactly those of one earlier `alloc`, and the
    /// memory must not be used afterwards.
    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize);
    /// Allocation granularity (host: the page size).
    fn granularity(&self) -> usize;
    /// Fills a freed element with a pattern (debug builds). Device memory
    /// sources keep the default no-op: the list never touches user buffers.
    ///
    /// # Safety
    /// `ptr..ptr+len` is memory this source allocated and nobody uses now.
    unsafe fn poison(&self, _ptr: NonNull<u8>, _len: usize) {}
}

/// Registers a block with a NIC (or does nothing).
pub trait Registrar {
    /// What keeps a registration alive; dropped to deregister.
    type Registration;
    /// Registers `len` bytes at `ptr`. `None` = the list is unregistered.
    ///
    /// # Safety
    /// The memory stays allocated until the registration is dropped.
    unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
    ) -> Result<Option<(Self::Registration, MrDesc)>, String>;

    /// Registers memory of `kind`; a registrar that knows only host memory
    /// refuses device memory.
    ///
    /// # Safety
    /// As for [`Registrar::register`].
    unsafe fn register_kind(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        kind: crate::memkind::MemKind,
    ) -> Result<Option<(Self::Registration, MrDesc)>, String> {
        match kind {
            // SAFETY: forwarded contract.
            crate::memkind::MemKind::Host => unsafe { self.register(ptr, len) },
            other => Err(format!(
                "this registrar registers host memory only, not {other:?}"
            )),
        }
    }

    /// Registers `len` bytes of device `dev`'s memory at `ptr` through the
    /// DMA-BUF `fd` that holds them, from `offset` on; a registrar without
    /// DMA-BUF refuses.
    ///
    /// # Safety
    /// As for [`Registrar::register`]; `fd` is open for the call.
    unsafe fn register_dmabuf(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        dev: i32,
        fd: i32,
        offset: u64,
    ) -> Result<Option<(Self::Registration, MrDesc)>, String> {
        let _ = (ptr, len, fd, offset);
        Err(format!(
            "this registrar does not register DMA-BUF memory (device {dev})"
        ))
    }
}

/// The registrar of unregistered lists.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRegistration;

impl Registrar for NoRegistration {
    type Registration = ();
    unsafe fn register(&self, _: NonNull<u8>, _: usize) -> Result<Option<((), MrDesc)>, String> {
        Ok(None)
    }
}

/// Page-aligned anonymous host pages from `mmap`. Each block has pages of its
/// own (no page is shared with other data) and is marked `MADV_DONTFORK`, so a
/// registered block is never copy-on-write in a forked child: fork-safe.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostPages;

/// Device memory as a freelist's [`MemorySource`]: GPU
/// buffers whose metadata (the `Elem`s) lives on the host, as the freelist
/// was designed for.
#[derive(Debug, Clone, Copy)]
#[cfg(feature = "testing")]
pub struct CudaMemory {
    pub dev: i32,
}

#[cfg(feature = "testing")]
impl MemorySource for CudaMemory {
    fn alloc(&self, bytes: usize) -> Result<NonNull<u8>, String> {
        crate::gpu::driver()
            .map_err(|e| e.to_string())?
            .alloc(self.dev, bytes)
    }
    unsafe fn free(&self, ptr: NonNull<u8>, _bytes: usize) {
        if let Ok(d) = crate::gpu::driver() {
            // SAFETY: forwarded contract.
            unsafe { d.free(self.dev, ptr) };
        }
    }
    fn granularity(&self) -> usize {
        // cuMemAlloc aligns to at least 256 bytes; a GPU page is 64 KiB.
        64 << 10
    }
}

impl MemorySource for HostPages {
    fn alloc(&self, bytes: usize) -> Result<NonNull<u8>, String> {
        // SAFETY: anonymous private mapping; no file, no fixed address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().to_string());
        }
        // SAFETY: `p..p+bytes` is the mapping just made. Failure of the advice
        // only loses fork protection, so it is not an error.
        unsafe { libc::madvise(p, bytes, libc::MADV_DONTFORK) };
        NonNull::new(p.cast()).ok_or_else(|| "mmap returned NULL".to_owned())
    }

    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        // SAFETY: the caller passes a mapping made by `alloc` with its length.
        unsafe { libc::munmap(ptr.as_ptr().cast(), bytes) };
    }

    fn granularity(&self) -> usize {
        page_size()
    }

    unsafe fn poison(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: host memory owned by the list and unused (caller's contract).
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0xDB, len) };
    }
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

struct Block<R> {
    base: NonNull<u8>,
    bytes: usize,
    _reg: Option<R>,
}

/// What an element is, precomputed at growth so `alloc` is one lookup.
#[derive(Debug, Clone, Copy)]
struct Slot {
    ptr: NonNull<u8>,
    mr: Option<MrDesc>,
}

#[cfg(debug_assertions)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    InUse,
}

/// Sizes of a freelist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Bytes per element (rounded up to `align`).
    pub elem_size: usize,
    /// Alignment of every element (a power of two, at most the granularity).
    pub align: usize,
    /// Elements added per growth.
    pub elems_per_block: usize,
    /// Upper bound on elements (growth stops there).
    pub max_elems: usize,
}

/// A freelist of fixed-size buffers; see the module documentation.
pub struct Freelist<S: MemorySource, R: Registrar = NoRegistration> {
    source: S,
    registrar: R,
    stride: usize,
    elem_size: usize,
    per_block: usize,
    max_elems: usize,
    capacity: usize,
    blocks: Vec<Block<R::Registration>>,
    /// Every element's buffer and registration, by index (metadata kept
    /// apart from the buffers, which may be device memory).
    slots: Vec<Slot>,
    free: Vec<u32>,
    #[cfg(debug_assertions)]
    state: Vec<State>,
}

// SAFETY: the list owns its blocks and registrations exclusively; raw pointers
// in it point into memory it owns. Moving it to another thread is fine when its
// source, registrar and registrations may move.
unsafe impl<S: MemorySource + Send, R: Registrar + Send> Send for Freelist<S, R> where
    R::Registration: Send
{
}

impl<S: MemorySource, R: Registrar> fmt::Debug for Freelist<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Freelist")
            .field("elem_size", &self.elem_size)
            .field("capacity", &self.capacity())
            .field("free", &self.free.len())
            .field("max_elems", &self.max_elems)
            .finish()
    }
}

impl<S: MemorySource, R: Registrar> Freelist<S, R> {
    /// An empty list; memory is allocated on the first `alloc` (or `grow`).
    pub fn new(source: S, registrar: R, p: Params) -> Result<Self, FreelistError> {
        if p.elem_size == 0 || p.elems_per_block == 0 || p.max_elems == 0 {
            return Err(FreelistError::Invalid("sizes and counts must be > 0"));
        }
        if !p.align.is_power_of_two() || p.align > source.granularity() {
            return Err(FreelistError::Invalid(
                "alignment must be a power of two no larger than the source's granularity",
            ));
        }
        if u32::try_from(p.max_elems).is_err() {
            return Err(FreelistError::Invalid("max_elems must fit in u32"));
        }
        let stride = p.elem_size.next_multiple_of(p.align);
        Ok(Self {
            source,
            registrar,
            stride,
            elem_size: stride,
            per_block: p.elems_per_block.min(p.max_elems),
            max_elems: p.max_elems,
            capacity: 0,
            blocks: Vec::new(),
            slots: Vec::new(),
            free: Vec::new(),
            #[cfg(debug_assertions)]
            state: Vec::new(),
        })
    }

    /// Bytes per element (after alignment).
    pub fn elem_size(&self) -> usize {
        self.elem_size
    }

    /// Elements allocated from the source so far.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Elements currently handed out.
    pub fn in_use(&self) -> usize {
        self.capacity() - self.free.len()
    }

    /// Adds one block. On any failure the list is unchanged.
    pub fn grow(&mut self) -> Result<(), FreelistError> {
        let cap = self.capacity();
        if cap >= self.max_elems {
            return Err(FreelistError::Exhausted {
                max: self.max_elems,
                size: self.elem_size,
            });
        }
        let n = self.per_block.min(self.max_elems - cap);
        let bytes = (n * self.stride).next_multiple_of(self.source.granularity());
        // Reserve every vector first: nothing below may fail half-way.
        let reserve = |e: std::collections::TryReserveError| FreelistError::Alloc {
            bytes,
            why: e.to_string(),
        };
        self.blocks.try_reserve(1).map_err(reserve)?;
        self.slots.try_reserve(n).map_err(reserve)?;
        self.free
            .try_reserve(cap + n - self.free.len())
            .map_err(reserve)?;
        #[cfg(debug_assertions)]
        self.state.try_reserve(self.per_block).map_err(reserve)?;

        let base = self
            .source
            .alloc(bytes)
            .map_err(|why| FreelistError::Alloc { bytes, why })?;
        // SAFETY: the block stays allocated until the registration is dropped
        // (Drop drops registrations before freeing blocks).
        let reg = match unsafe { self.registrar.register(base, bytes) } {
            Ok(r) => r,
            Err(why) => {
                // SAFETY: `base`/`bytes` come from the alloc just above.
                unsafe { self.source.free(base, bytes) };
                return Err(FreelistError::Register { bytes, why });
            }
        };
        let (reg, mr) = match reg {
            Some((r, d)) => (Some(r), Some(d)),
            None => (None, None),
        };
        // Blocks are full-sized in the index space, so element i lives in
        // block i / per_block; only the last block can be short.
        self.blocks.push(Block {
            base,
            bytes,
            _reg: reg,
        });
        // LIFO: push in reverse so the lowest address is handed out first.
        let first = u32::try_from(self.blocks.len() - 1)
            .ok()
            .and_then(|b| b.checked_mul(u32::try_from(self.per_block).ok()?))
            .expect("max_elems fits u32");
        let count = u32::try_from(n).expect("max_elems fits u32");
        self.slots.extend((0..n).map(|k| Slot {
            // SAFETY: k < n elements of `stride` bytes fit in the block.
            ptr: unsafe { base.add(k * self.stride) },
            mr,
        }));
        self.free.extend((first..first + count).rev());
        self.capacity += n;
        #[cfg(debug_assertions)]
        self.state
            .extend(std::iter::repeat_n(State::Free, self.per_block));
        Ok(())
    }

    /// Hands out a free element, growing by one block if none is free.
    #[inline]
    pub fn alloc(&mut self) -> Result<Elem, FreelistError> {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.grow()?;
                self.free.pop().expect("grow added free entries")
            }
        };
        #[cfg(debug_assertions)]
        {
            debug_assert_eq!(
                self.state[index as usize],
                State::Free,
                "freelist corrupted"
            );
            self.state[index as usize] = State::InUse;
        }
        Ok(self.elem(index))
    }

    /// Hands out a free element only if one is free now (never grows).
    #[inline]
    pub fn try_alloc(&mut self) -> Option<Elem> {
        let index = self.free.pop()?;
        #[cfg(debug_assertions)]
        {
            self.state[index as usize] = State::InUse;
        }
        Some(self.elem(index))
    }

    #[inline]
    fn elem(&self, index: u32) -> Elem {
        let s = self.slots[index as usize];
        Elem {
            ptr: s.ptr,
            mr: s.mr,
            index,
        }
    }

    /// The element at `index` as it was handed out (for callers that keep
    /// only indices). `None` if the index is not in the list.
    pub fn elem_at(&self, index: u32) -> Option<Elem> {
        // Only the last block may be short, so indices are 0..capacity.
        ((index as usize) < self.slots.len()).then(|| self.elem(index))
    }

    /// Elements in block `b` (all but the last are full).
    #[cfg(test)]
    fn block_len(&self, b: usize) -> usize {
        if b + 1 < self.blocks.len() {
            self.per_block
        } else {
            self.capacity - b * self.per_block
        }
    }

    /// The index of the element whose buffer starts at `ptr`, if it is one.
    #[cfg(test)]
    pub fn index_of(&self, ptr: *const u8) -> Option<u32> {
        let a = ptr as usize;
        self.blocks.iter().enumerate().find_map(|(bi, b)| {
            let start = b.base.as_ptr() as usize;
            let off = a.checked_sub(start)?;
            if off >= self.per_block * self.stride || off % self.stride != 0 {
                return None;
            }
            if off / self.stride >= self.block_len(bi) {
                return None;
            }
            u32::try_from(bi * self.per_block + off / self.stride).ok()
        })
    }

    /// Gives an element back. In debug builds a double free or an element of
    /// another list panics.
    #[inline]
    pub fn free(&mut self, e: Elem) {
        #[cfg(debug_assertions)]
        {
            let i = e.index as usize;
            assert!(
                i < self.state.len() && self.elem(e.index).ptr == e.ptr,
                "freelist: element {:p} does not belong to this list",
                e.ptr
            );
            assert_eq!(
                self.state[i],
                State::InUse,
                "freelist: double free of element {:p}",
                e.ptr
            );
            self.state[i] = State::Free;
            // SAFETY: the element is ours and now unused.
            unsafe { self.source.poison(e.ptr, self.elem_size) };
        }
        // Capacity was reserved at growth: this push never allocates.
        self.free.push(e.index);
    }
}

impl<S: MemorySource, R: Registrar> Drop for Freelist<S, R> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        {
            let leaked = self.in_use();
            if leaked > 0 {
                tracing::error!("freelist dropped with {leaked} element(s) still in use (leak)");
                if !std::thread::panicking() {
                    panic!("freelist dropped with {leaked} element(s) still in use (leak)");
                }
            }
        }
        for b in self.blocks.drain(..) {
            let Block {
                base, bytes, _reg, ..
            } = b;
            drop(_reg); // deregister before the memory goes
                        // SAFETY: each block was allocated by this source with this size.
            unsafe { self.source.free(base, bytes) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::Cell;
    use std::collections::HashSet;

    fn params(elem: usize, per: usize, max: usize) -> Params {
        Params {
            elem_size: elem,
            align: 64,
            elems_per_block: per,
            max_elems: max,
        }
    }

    fn host(elem: usize, per: usize, max: usize) -> Freelist<HostPages> {
        Freelist::new(HostPages, NoRegistration, params(elem, per, max)).unwrap()
    }

    #[test]
    fn lifo_aligned_distinct_and_bounded() {
        let mut l = host(100, 4, 6);
        assert_eq!(l.elem_size(), 128);
        let es: Vec<Elem> = (0..6).map(|_| l.alloc().unwrap()).collect();
        let addrs: HashSet<usize> = es.iter().map(|e| e.ptr.as_ptr() as usize).collect();
        assert_eq!(addrs.len(), 6);
        assert!(addrs.iter().all(|a| a % 64 == 0));
        assert_eq!(l.capacity(), 6, "second block is short: the bound is exact");
        assert!(matches!(
            l.alloc(),
            Err(FreelistError::Exhausted { max: 6, .. })
        ));
        assert!(l.try_alloc().is_none());
        let last = es[5].ptr;
        let mut es = es;
        let e5 = es.pop().unwrap();
        l.free(e5);
        assert_eq!(l.alloc().unwrap().ptr, last, "LIFO");
        for e in es {
            l.free(e);
        }
        let again = l.index_of(last.as_ptr()).unwrap();
        l.free(l.elem_at(again).unwrap());
        assert_eq!(l.in_use(), 0);
    }

    #[test]
    fn index_of_finds_only_element_starts() {
        let mut l = host(64, 8, 16);
        let e = l.alloc().unwrap();
        assert_eq!(l.index_of(e.ptr.as_ptr()), Some(e.index()));
        // SAFETY: pointer arithmetic only, never dereferenced.
        let inside = unsafe { e.ptr.as_ptr().add(1) };
        assert_eq!(l.index_of(inside), None);
        assert_eq!(l.index_of(std::ptr::null()), None);
        l.free(e);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "double free")]
    fn double_free_is_detected() {
        let mut l = host(64, 4, 4);
        let e = l.alloc().unwrap();
        let dup = Elem {
            ptr: e.ptr,
            mr: e.mr,
            index: e.index,
        };
        l.free(e);
        l.free(dup);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "still in use (leak)")]
    fn leak_is_detected_on_drop() {
        let mut l = host(64, 4, 4);
        let _kept = l.alloc().unwrap();
        drop(l);
    }

    #[test]
    #[cfg(debug_assertions)]
    fn freed_host_buffers_are_poisoned() {
        let mut l = host(64, 4, 4);
        let e = l.alloc().unwrap();
        let p = e.ptr;
        // SAFETY: the element is ours and 64 bytes long.
        unsafe { std::ptr::write_bytes(p.as_ptr(), 0, 64) };
        l.free(e);
        // SAFETY: the block is still mapped (the list is alive).
        assert!(unsafe { std::slice::from_raw_parts(p.as_ptr(), 64) }
            .iter()
            .all(|&b| b == 0xDB));
    }

    /// A source that fails on demand and counts what it handed out, and a
    /// registrar that fails on demand: growth failures must leave the list as it was.
    #[derive(Default)]
    struct Flaky {
        fail: Cell<bool>,
        live: Cell<usize>,
    }
    impl MemorySource for &Flaky {
        fn alloc(&self, bytes: usize) -> Result<NonNull<u8>, String> {
            if self.fail.get() {
                return Err("injected allocation failure".into());
            }
            self.live.set(self.live.get() + 1);
            HostPages.alloc(bytes)
        }
        unsafe fn free(&self, p: NonNull<u8>, bytes: usize) {
            self.live.set(self.live.get() - 1);
            // SAFETY: forwarded contract.
            unsafe { HostPages.free(p, bytes) }
        }
        fn granularity(&self) -> usize {
            page_size()
        }
        // Device-like: no poisoning.
    }
    struct FlakyReg<'a>(&'a Cell<bool>, &'a Cell<usize>);
    struct Token<'a>(&'a Cell<usize>);
    impl Drop for Token<'_> {
        fn drop(&mut self) {
            self.0.set(self.0.get() - 1);
        }
    }
    impl<'a> Registrar for FlakyReg<'a> {
        type Registration = Token<'a>;
        unsafe fn register(
            &self,
            p: NonNull<u8>,
            _: usize,
        ) -> Result<Option<(Token<'a>, MrDesc)>, String> {
            if self.0.get() {
                return Err("injected registration failure".into());
            }
            self.1.set(self.1.get() + 1);
            Ok(Some((
                Token(self.1),
                MrDesc {
                    desc: p.as_ptr().cast(),
                    key: 7,
                },
            )))
        }
    }

    #[test]
    fn failed_growth_leaves_the_list_unchanged() {
        let src = Flaky::default();
        let (reg_fail, regs) = (Cell::new(false), Cell::new(0));
        let mut l = Freelist::new(&src, FlakyReg(&reg_fail, &regs), params(64, 4, 12)).unwrap();
        let a = l.alloc().unwrap();
        let mr =
            a.mr.expect("registered list carries the block's descriptor");
        let (cap, used) = (l.capacity(), l.in_use());
        let rest: Vec<Elem> = (0..3).map(|_| l.alloc().unwrap()).collect();
        assert!(
            rest.iter().all(|e| e.mr == Some(mr)),
            "one registration per block"
        );

        src.fail.set(true);
        assert!(matches!(l.alloc(), Err(FreelistError::Alloc { .. })));
        src.fail.set(false);
        reg_fail.set(true);
        assert!(matches!(l.alloc(), Err(FreelistError::Register { .. })));
        assert_eq!((l.capacity(), l.in_use()), (cap, used + 3));
        assert_eq!(
            src.live.get(),
            1,
            "the block of the failed registration was freed"
        );
        assert_eq!(regs.get(), 1);

        reg_fail.set(false);
        let b = l.alloc().unwrap();
        assert_ne!(b.mr, Some(mr), "a new block has its own registration");
        l.free(a);
        l.free(b);
        for e in rest {
            l.free(e);
        }
        drop(l);
        assert_eq!(
            (src.live.get(), regs.get()),
            (0, 0),
            "everything released on drop"
        );
    }

    proptest! {
        /// Any sequence of allocs and frees: elements are distinct, stay in
        /// bounds, in_use tracks the model, and LIFO order holds.
        #[test]
        fn model_check(ops in proptest::collection::vec(any::<bool>(), 0..400)) {
            let mut l = host(48, 5, 23);
            let mut held: Vec<Elem> = Vec::new();
            let mut last_freed: Option<NonNull<u8>> = None;
            for alloc in ops {
                if alloc {
                    match l.alloc() {
                        Ok(e) => {
                            if let Some(p) = last_freed.take() { prop_assert_eq!(e.ptr, p); }
                            prop_assert!(held.iter().all(|h| h.ptr != e.ptr));
                            held.push(e);
                        }
                        Err(FreelistError::Exhausted { .. }) => prop_assert_eq!(held.len(), 23),
                        Err(e) => prop_assert!(false, "{}", e),
                    }
                } else if let Some(e) = held.pop() {
                    last_freed = Some(e.ptr);
                    l.free(e);
                }
                prop_assert_eq!(l.in_use(), held.len());
                prop_assert!(l.capacity() <= 23);
            }
            for e in held.drain(..) { l.free(e); }
        }
    }
}
