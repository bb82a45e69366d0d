//! `fi_getinfo` results: hints in, an owned list out, read through safe accessors.

use std::ffi::{CStr, CString};
use std::fmt;
use std::ptr::{self, NonNull};

use libfabric_sys as fi;

use super::error::{check, FiError};

/// What we ask `fi_getinfo` for. Every domain Weft opens is `FI_THREAD_SAFE`:
/// the wrappers in this module are `Send + Sync` on that basis.
#[derive(Debug, Clone)]
pub struct Hints {
    /// `FI_TAGGED | FI_MSG | ...`: only what is needed (asking for
    /// `FI_REMOTE_COMM` hides shm on libfabric 1.17).
    pub caps: u64,
    /// Endpoint type; Weft uses reliable datagram (`FI_EP_RDM`) only.
    pub ep_type: fi::fi_ep_type,
    /// Memory-registration modes the caller can honour.
    pub mr_mode: u32,
    /// A libfabric provider name, e.g. `tcp;ofi_rxm` or `shm`; `None` = any.
    pub provider: Option<String>,
}

impl Hints {
    /// Reliable tagged messaging, the base every Weft protocol needs, with
    /// each completion's source (`FI_SOURCE`) and receives that match one
    /// source only (`FI_DIRECTED_RECV`): endpoints are shared by many comms,
    /// and a comm takes messages, writes and data from its own peer only.
    pub fn rdm_tagged(provider: Option<&str>) -> Self {
        Self {
            caps: u64::from(fi::FI_TAGGED)
                | u64::from(fi::FI_MSG)
                | fi::FI_SOURCE
                | fi::FI_DIRECTED_RECV,
            ep_type: fi::fi_ep_type_FI_EP_RDM,
            // Modes the fabric layer honours: it registers what it sends (LOCAL),
            // addresses are virtual, buffers are allocated, keys come from the
            // provider, registrations are bound to the device's passive endpoint.
            mr_mode: fi::FI_MR_LOCAL
                | fi::FI_MR_VIRT_ADDR
                | fi::FI_MR_ALLOCATED
                | fi::FI_MR_PROV_KEY
                | fi::FI_MR_ENDPOINT,
            provider: provider.map(str::to_owned),
        }
    }
}

/// An owned list of `fi_info` entries, freed with `fi_freeinfo`.
pub struct InfoList {
    head: Option<NonNull<fi::fi_info>>,
}

// SAFETY: the list is owned (nobody else holds its pointers) and only read after
// construction; libfabric allows fi_info structures to move between threads.
unsafe impl Send for InfoList {}
// SAFETY: shared access only reads the entries.
unsafe impl Sync for InfoList {}

impl InfoList {
    /// Calls `fi_getinfo` with `hints`. No matching provider gives an empty list.
    pub fn get(hints: &Hints) -> Result<Self, FiError> {
        // SAFETY: fi_allocinfo returns a zeroed fi_info with its attribute structs
        // allocated, or NULL on allocation failure (checked).
        let raw = NonNull::new(unsafe { fi::fi_allocinfo() })
            .ok_or_else(|| FiError::new("fi_allocinfo", i64::from(fi::FI_ENOMEM)))?;
        let h = OwnedInfo(raw);
        // SAFETY: `raw` and its attribute pointers were allocated by fi_allocinfo
        // and are exclusively ours until fi_freeinfo (in OwnedInfo's drop). The
        // provider name is strdup'ed because fi_freeinfo frees it with free().
        unsafe {
            let p = raw.as_ptr();
            (*p).caps = hints.caps;
            (*p).mode = 0;
            (*(*p).ep_attr).type_ = hints.ep_type;
            (*(*p).domain_attr).mr_mode = i32::try_from(hints.mr_mode).unwrap_or(i32::MAX);
            (*(*p).domain_attr).threading = fi::fi_threading_FI_THREAD_SAFE;
            if let Some(name) = &hints.provider {
                let c = CString::new(name.as_str())
                    .map_err(|_| FiError::new("fi_getinfo", i64::from(fi::FI_EINVAL)))?;
                (*(*p).fabric_attr).prov_name = libc::strdup(c.as_ptr());
            }
        }
        let mut out: *mut fi::fi_info = ptr::null_mut();
        // SAFETY: hints is a valid fi_info; `out` receives a list we own.
        let ret = unsafe {
            fi::fi_getinfo(
                libfabric_sys::api_version(),
                ptr::null(),
                ptr::null(),
                0,
                h.0.as_ptr(),
                &mut out,
            )
        };
        drop(h);
        if ret == -(fi::FI_ENODATA as i32) {
            return Ok(Self { head: None });
        }
        check("fi_getinfo", ret)?;
        Ok(Self {
            head: NonNull::new(out),
        })
    }

    /// The entries, in libfabric's order of preference.
    pub fn iter(&self) -> impl Iterator<Item = InfoRef<'_>> + '_ {
        let mut cur = self.head.map(|p| p.as_ptr().cast_const());
        std::iter::from_fn(move || {
            let p = cur?;
            // SAFETY: every entry in the list stays valid while `self` lives.
            let r = unsafe { &*p };
            cur = (!r.next.is_null()).then_some(r.next.cast_const());
            Some(InfoRef(r))
        })
    }

    /// True when no provider matched.
    #[cfg(feature = "testing")]
    pub fn is_empty(&self) -> bool {
        self.head.is_none()
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        if let Some(p) = self.head {
            // SAFETY: the list came from fi_getinfo and is freed exactly once.
            unsafe { fi::fi_freeinfo(p.as_ptr()) };
        }
    }
}

impl fmt::Debug for InfoList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One owned `fi_info` entry (a copy made with `fi_dupinfo`).
pub struct OwnedInfo(NonNull<fi::fi_info>);

// SAFETY: owned copy, read-only after construction.
unsafe impl Send for OwnedInfo {}
// SAFETY: shared access only reads it.
unsafe impl Sync for OwnedInfo {}

impl OwnedInfo {
    /// A borrowed view.
    pub fn as_ref(&self) -> InfoRef<'_> {
        // SAFETY: the pointer is valid for as long as `self`.
        InfoRef(unsafe { self.0.as_ref() })
    }
}

impl Drop for OwnedInfo {
    fn drop(&mut self) {
        // SAFETY: allocated by fi_allocinfo/fi_dupinfo and freed once. fi_freeinfo
        // frees a whole list, so a copy is always made with `next` cleared.
        unsafe { fi::fi_freeinfo(self.0.as_ptr()) };
    }
}

impl fmt::Debug for OwnedInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_ref().fmt(f)
    }
}

/// A borrowed `fi_info` entry.
#[derive(Clone, Copy)]
pub struct InfoRef<'a>(&'a fi::fi_info);

fn cstr<'a>(p: *const libc::c_char) -> &'a str {
    if p.is_null() {
        return "";
    }
    // SAFETY: libfabric's name fields are NUL-terminated strings that live as
    // long as their fi_info; callers bound the lifetime by the InfoRef.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

impl<'a> InfoRef<'a> {
    pub(crate) fn raw(&self) -> *mut fi::fi_info {
        ptr::from_ref(self.0).cast_mut()
    }
    fn fabric_attr(&self) -> Option<&'a fi::fi_fabric_attr> {
        // SAFETY: attribute pointers of a valid fi_info are NULL or valid.
        unsafe { self.0.fabric_attr.as_ref() }
    }
    fn domain_attr(&self) -> Option<&'a fi::fi_domain_attr> {
        // SAFETY: as above.
        unsafe { self.0.domain_attr.as_ref() }
    }
    /// Provider name, e.g. `tcp;ofi_rxm`.
    pub fn provider(&self) -> &'a str {
        self.fabric_attr().map_or("", |a| cstr(a.prov_name))
    }
    /// Fabric name (for tcp: the subnet).
    pub fn fabric_name(&self) -> &'a str {
        self.fabric_attr().map_or("", |a| cstr(a.name))
    }
    /// Domain name (for tcp and verbs: the interface or NIC).
    pub fn domain_name(&self) -> &'a str {
        self.domain_attr().map_or("", |a| cstr(a.name))
    }
    /// Capabilities the provider grants.
    pub fn caps(&self) -> u64 {
        self.0.caps
    }
    /// Largest message one send can carry.
    pub fn max_msg_size(&self) -> usize {
        // SAFETY: as above.
        unsafe { self.0.ep_attr.as_ref() }.map_or(0, |a| a.max_msg_size)
    }
    /// Largest message `fi_tinject` accepts.
    pub fn inject_size(&self) -> usize {
        // SAFETY: as above.
        unsafe { self.0.tx_attr.as_ref() }.map_or(0, |a| a.inject_size)
    }
    /// The transmit side's message ordering (`FI_ORDER_*` bits).
    pub fn tx_msg_order(&self) -> u64 {
        // SAFETY: as above.
        unsafe { self.0.tx_attr.as_ref() }.map_or(0, |a| a.msg_order)
    }
    /// Endpoints the domain supports.
    pub fn max_endpoints(&self) -> usize {
        self.domain_attr().map_or(0, |a| a.ep_cnt)
    }
    /// Memory-registration modes the provider requires.
    pub fn mr_mode(&self) -> u32 {
        self.domain_attr()
            .map_or(0, |a| u32::try_from(a.mr_mode).unwrap_or(0))
    }
    /// Largest tag bits the provider supports (`mem_tag_format`).
    pub fn tag_format(&self) -> u64 {
        // SAFETY: as above.
        unsafe { self.0.ep_attr.as_ref() }.map_or(0, |a| a.mem_tag_format)
    }
    /// The provider's address format (`FI_SOCKADDR_IN`, `FI_ADDR_STR`, ...).
    pub fn addr_format(&self) -> u32 {
        self.0.addr_format
    }
    /// The length of the provider's endpoint addresses (0 if not given).
    pub fn src_addrlen(&self) -> usize {
        self.0.src_addrlen
    }
    /// Bytes of remote CQ data (immediate data) a write can carry.
    pub fn cq_data_size(&self) -> usize {
        self.domain_attr().map_or(0, |a| a.cq_data_size)
    }
    /// An owned copy of this entry alone.
    pub fn to_owned(self) -> Result<OwnedInfo, FiError> {
        // SAFETY: fi_dupinfo deep-copies one entry (the copy's `next` is NULL).
        let p = unsafe { fi::fi_dupinfo(self.0) };
        NonNull::new(p)
            .map(OwnedInfo)
            .ok_or_else(|| FiError::new("fi_dupinfo", i64::from(fi::FI_ENOMEM)))
    }
}

impl fmt::Debug for InfoRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Info")
            .field("provider", &self.provider())
            .field("fabric", &self.fabric_name())
            .field("domain", &self.domain_name())
            .finish()
    }
}
