//! Fabric and domain: the roots every other libfabric object hangs from.

use std::collections::HashSet;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};

use libfabric_sys as fi;

use super::error::{check, FiError};
use super::info::{InfoRef, OwnedInfo};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Closes a libfabric object, logging (never panicking on) a failure: this runs in `Drop`.
pub(crate) fn close_fid(fid: *mut fi::fid, what: &'static str) {
    // SAFETY: callers pass the fid of an object they own and never use again.
    let ret = unsafe { fi::fi_close(fid) };
    if ret != 0 {
        tracing::warn!(
            "fi_close({what}) failed: {}; the object may leak",
            super::error::strerror(ret.unsigned_abs())
        );
    }
}

/// An open fabric (`fi_fabric`). Closed when the last domain using it is gone.
#[derive(Debug)]
pub struct Fabric {
    ptr: *mut fi::fid_fabric,
}

// SAFETY: libfabric fabric objects may be used from any thread; Weft opens
// every domain FI_THREAD_SAFE (see `Hints`).
unsafe impl Send for Fabric {}
// SAFETY: as above.
unsafe impl Sync for Fabric {}

impl Fabric {
    /// Opens the fabric an `fi_getinfo` entry describes.
    pub fn open(info: InfoRef<'_>) -> Result<Arc<Self>, FiError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: fabric_attr comes from a live fi_info; `ptr` receives the object.
        check("fi_fabric", unsafe {
            fi::fi_fabric((*info.raw()).fabric_attr, &mut ptr, ptr::null_mut())
        })?;
        Ok(Arc::new(Self { ptr }))
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: `ptr` is a live fabric; every child holds an Arc to it, so none remain.
        close_fid(unsafe { &raw mut (*self.ptr).fid }, "fabric");
    }
}

/// A permutation of the 64-bit values keyed by `secret`: four Feistel
/// rounds whose round function is SipHash under the secret's random keys.
/// Distinct inputs give distinct outputs, and without the secret one output
/// says nothing of another.
fn permute(secret: &impl std::hash::BuildHasher, n: u64) -> u64 {
    let (mut l, mut r) = ((n >> 32) as u32, n as u32);
    for round in 0..4u8 {
        let f = secret.hash_one((round, r)) as u32;
        (l, r) = (r, l ^ f);
    }
    (u64::from(l) << 32) | u64::from(r)
}

/// An open domain (`fi_domain`): one NIC. Keeps its fabric and its `fi_info` alive.
#[derive(Debug)]
pub struct Domain {
    ptr: *mut fi::fid_domain,
    info: OwnedInfo,
    next_key: AtomicU64,
    /// The secret that makes requested keys unpredictable ([`Domain::requested_key`]).
    key_secret: std::hash::RandomState,
    /// MR modes honoured as if the provider required them
    /// ([`DomainOptions::strict`]).
    strict: u32,
    /// [`DomainOptions::hmem_as_system`].
    hmem_as_system: bool,
    /// `FI_MR_ENDPOINT`: the endpoint every registration is bound to (the
    /// one peers reach this domain's memory through), once it is open.
    mr_endpoint: Mutex<Option<usize>>,
    /// With `FI_MR_ENDPOINT` emulated: the descriptors of registrations
    /// bound and enabled (what such a provider would accept).
    enabled: Mutex<HashSet<usize>>,
    /// The length of this domain's endpoint names (learned from the first
    /// endpoint; 0 until then).
    name_len: AtomicUsize,
    /// Set once the device claimed GPU memory: its endpoints then ask the
    /// provider not to call CUDA itself (`FI_OPT_CUDA_API_PERMITTED`).
    gpu_memory: AtomicBool,
    /// What the provider answered to that, said once per domain.
    cuda_api_said: Once,
    _fabric: Arc<Fabric>,
}

// SAFETY: domains are opened FI_THREAD_SAFE.
unsafe impl Send for Domain {}
// SAFETY: as above.
unsafe impl Sync for Domain {}

impl Domain {
    /// Opens the fabric and domain that an `fi_getinfo` entry describes.
    pub fn open(info: InfoRef<'_>) -> Result<Arc<Self>, FiError> {
        Self::open_with(info, DomainOptions::default())
    }

    /// [`Domain::open`], behaving as `options` say (the test switches).
    pub fn open_with(info: InfoRef<'_>, options: DomainOptions) -> Result<Arc<Self>, FiError> {
        let info = info.to_owned()?;
        let fabric = Fabric::open(info.as_ref())?;
        let mut ptr = ptr::null_mut();
        // SAFETY: fabric and info are live; `ptr` receives the domain.
        check("fi_domain", unsafe {
            fi::fi_domain(fabric.ptr, info.as_ref().raw(), &mut ptr, ptr::null_mut())
        })?;
        Ok(Arc::new(Self {
            ptr,
            info,
            next_key: AtomicU64::new(1),
            key_secret: std::hash::RandomState::new(),
            strict: options.strict,
            hmem_as_system: options.hmem_as_system,
            mr_endpoint: Mutex::new(None),
            enabled: Mutex::new(HashSet::new()),
            name_len: AtomicUsize::new(0),
            gpu_memory: AtomicBool::new(false),
            cuda_api_said: Once::new(),
            _fabric: fabric,
        }))
    }

    /// Marks the domain as taking GPU memory (before its first endpoint).
    pub fn set_gpu_memory(&self) {
        self.gpu_memory.store(true, Ordering::Relaxed);
    }

    /// Whether the domain takes GPU memory.
    pub fn gpu_memory(&self) -> bool {
        self.gpu_memory.load(Ordering::Relaxed)
    }

    /// Runs `say` the first time only (what the provider answered to
    /// `FI_OPT_CUDA_API_PERMITTED`, logged once per domain).
    pub(crate) fn say_cuda_api_once(&self, say: impl FnOnce()) {
        self.cuda_api_said.call_once(say);
    }

    /// The `fi_info` this domain was opened with (used again for endpoints).
    pub fn info(&self) -> InfoRef<'_> {
        self.info.as_ref()
    }

    /// The MR modes Weft honours on this domain: the provider's, and those
    /// a test switch adds.
    pub fn mr_mode(&self) -> u32 {
        self.info().mr_mode() | self.strict
    }

    /// `FI_MR_ENDPOINT`: from now on, registrations are bound to the
    /// endpoint `ep` (a raw `fid_ep` that outlives them: the device's
    /// passive hub endpoint).
    pub(crate) fn set_mr_endpoint(&self, ep: *mut fi::fid_ep) {
        *lock(&self.mr_endpoint) = Some(ep as usize);
    }

    /// The endpoint for registrations is closing: registrations fail again
    /// until another is set.
    pub(crate) fn clear_mr_endpoint(&self, ep: *mut fi::fid_ep) {
        let mut e = lock(&self.mr_endpoint);
        if *e == Some(ep as usize) {
            *e = None;
        }
    }

    /// The endpoint registrations are bound to, if set.
    pub(crate) fn mr_endpoint(&self) -> Option<*mut fi::fid_ep> {
        lock(&self.mr_endpoint).map(|p| p as *mut fi::fid_ep)
    }

    /// Emulated `FI_MR_ENDPOINT`: records (or forgets) an enabled
    /// registration's descriptor.
    pub(crate) fn note_enabled(&self, desc: usize, on: bool) {
        let mut e = lock(&self.enabled);
        if on {
            e.insert(desc);
        } else {
            e.remove(&desc);
        }
    }

    /// Emulated `FI_MR_ENDPOINT`: whether `desc` names an enabled
    /// registration.
    pub(crate) fn is_enabled(&self, desc: usize) -> bool {
        lock(&self.enabled).contains(&desc)
    }

    /// Whether Weft behaves as if the provider required MR mode `bit`
    /// without it doing so (a test switch: Weft checks its own obligations).
    pub(crate) fn strict(&self, bit: u32) -> bool {
        self.strict & bit != 0
    }

    /// Whether device memory registers as host memory here
    /// ([`DomainOptions::hmem_as_system`]).
    pub(crate) fn hmem_as_system(&self) -> bool {
        self.hmem_as_system
    }

    /// The key to request for a new registration: 0 where the provider picks
    /// keys (`FI_MR_PROV_KEY`), else a key unique within this domain that a
    /// third party cannot guess from the keys it was given: a keyed
    /// permutation of a counter ([`permute`], secret per domain). A key
    /// opens exactly the bytes NCCL registered ([`crate::mr`]), to whoever
    /// holds it; only the peer a buffer is offered to learns its key. Peers
    /// only ever get the key the provider reports (`fi_mr_key`).
    pub(crate) fn requested_key(&self) -> u64 {
        if self.info().mr_mode() & fi::FI_MR_PROV_KEY != 0 {
            return 0;
        }
        permute(
            &self.key_secret,
            self.next_key.fetch_add(1, Ordering::Relaxed),
        )
    }

    /// Records the length of an endpoint name of this domain.
    pub(crate) fn note_name_len(&self, len: usize) {
        self.name_len.store(len, Ordering::Relaxed);
    }

    /// Checks that `name` is one whole endpoint address of this domain's
    /// provider before libfabric reads it: libfabric reads as many bytes as
    /// its address format needs, whatever the buffer holds, so an address
    /// from a handle or a control message that is empty or short would make
    /// it read past the buffer (or dial heap bytes). String addresses (shm)
    /// must be NUL-terminated inside `name`; binary ones (sockaddr, EFA) must
    /// be exactly as long as this domain's own endpoint names.
    pub fn check_addr(&self, name: &[u8]) -> Result<(), String> {
        if self.info().addr_format() == fi::FI_ADDR_STR {
            return match name.iter().position(|&b| b == 0) {
                Some(0) => Err("empty address string".to_owned()),
                Some(_) => Ok(()),
                None if name.is_empty() => Err("empty address".to_owned()),
                None => Err(format!(
                    "address string of {} bytes without its terminating NUL",
                    name.len()
                )),
            };
        }
        let want = match self.name_len.load(Ordering::Relaxed) {
            0 => self.info().src_addrlen(),
            n => n,
        };
        if want == 0 || name.len() != want {
            return Err(format!(
                "address of {} bytes, but {} addresses are {want} bytes",
                name.len(),
                self.info().provider()
            ));
        }
        Ok(())
    }

    pub(crate) fn raw(&self) -> *mut fi::fid_domain {
        self.ptr
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: `ptr` is live; endpoints, CQs, AVs and MRs hold an Arc to the
        // domain, so all of them are closed before this runs.
        close_fid(unsafe { &raw mut (*self.ptr).fid }, "domain");
    }
}

/// How a domain behaves beyond what its provider asks: the test switches
/// (`WEFT_TEST_MR_MODE`, `WEFT_TEST_HMEM`, read with the configuration),
/// all off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DomainOptions {
    /// MR modes (`FI_MR_*` bits) neither provider here requires, which Weft
    /// then honours and checks as if it did:
    /// - `FI_MR_LOCAL`: every buffer posted to an endpoint carries its
    ///   registration's descriptor, else the post fails;
    /// - `FI_MR_PROV_KEY`: keys are arbitrary 64-bit values, and peers get
    ///   only what `fi_mr_key` reports;
    /// - `FI_MR_ALLOCATED`: a registration of memory that is not mapped
    ///   fails before the provider sees it;
    /// - `FI_MR_ENDPOINT`: every registration is bound to the device's
    ///   passive endpoint and enabled before use (`fi_mr_bind`, which the
    ///   providers here answer `-FI_ENOSYS`, is called and that answer taken
    ///   as success), and a buffer posted with the descriptor of a
    ///   registration not enabled is refused.
    pub strict: u32,
    /// Device memory is registered as host memory (see
    /// [`super::Mr::register_kind`]).
    pub hmem_as_system: bool,
}

#[cfg(test)]
mod tests {
    use super::permute;

    /// Requested keys are unique (a permutation) and not a counter: two
    /// domains' secrets give unrelated keys, and consecutive keys differ in
    /// about half their bits.
    #[test]
    fn requested_keys_are_unique_and_unpredictable() {
        let (a, b) = (std::hash::RandomState::new(), std::hash::RandomState::new());
        let keys: std::collections::HashSet<u64> = (0..100_000).map(|n| permute(&a, n)).collect();
        assert_eq!(keys.len(), 100_000, "a permutation never repeats a key");
        let flips: u32 = (1..1000)
            .map(|n| (permute(&a, n) ^ permute(&a, n + 1)).count_ones())
            .sum();
        let mean = f64::from(flips) / 999.0;
        assert!(
            (24.0..40.0).contains(&mean),
            "consecutive keys differ in {mean:.1} bits"
        );
        assert_ne!(permute(&a, 1), permute(&b, 1), "secrets differ per domain");
    }
}
