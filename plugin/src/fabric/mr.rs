//! Memory regions (`fi_mr_reg`).

use std::ptr;
use std::sync::Arc;

use libfabric_sys as fi;

use super::domain::{close_fid, Domain};
use super::error::{check, FiError};
use crate::memkind::MemKind;

/// A registered memory region; deregistered on drop.
#[derive(Debug)]
pub struct Mr {
    ptr: *mut fi::fid_mr,
    _domain: Arc<Domain>,
}

// SAFETY: opened on a FI_THREAD_SAFE domain; desc/key are plain reads.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

/// Access rights for a registration: local send/recv plus remote RMA.
pub const ACCESS_ALL: u64 = (fi::FI_SEND | fi::FI_RECV | fi::FI_READ | fi::FI_WRITE) as u64
    | (fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE) as u64;

impl Mr {
    /// Registers `len` bytes at `addr` for `access`.
    ///
    /// # Safety
    /// `addr..addr+len` must stay mapped until the returned `Mr` is dropped.
    pub unsafe fn register(
        domain: &Arc<Domain>,
        addr: *const u8,
        len: usize,
        access: u64,
    ) -> Result<Self, FiError> {
        if domain.strict(fi::FI_MR_ALLOCATED) {
            check_mapped(addr, len)?;
        }
        let mut ptr = ptr::null_mut();
        let key = domain.requested_key();
        // SAFETY: the caller keeps the range mapped; domain is live; `ptr`
        // receives the MR.
        check("fi_mr_reg", unsafe {
            fi::fi_mr_reg(
                domain.raw(),
                addr.cast(),
                len,
                access,
                0,
                key,
                0,
                &mut ptr,
                ptr::null_mut(),
            )
        })?;
        Self::registered(domain, ptr)
    }

    /// Registers `len` bytes at `addr` of memory `kind`: host memory as
    /// [`Mr::register`] does, device memory with `fi_mr_regattr`, naming its
    /// `iface` (`FI_HMEM_CUDA`) and device. With the test switch
    /// `WEFT_TEST_HMEM=system`, device memory is registered as host memory
    /// (for the fake driver in the test tree, whose device memory is host
    /// memory, on a libfabric built without CUDA).
    ///
    /// # Safety
    /// As for [`Mr::register`].
    pub unsafe fn register_kind(
        domain: &Arc<Domain>,
        addr: *const u8,
        len: usize,
        access: u64,
        kind: MemKind,
    ) -> Result<Self, FiError> {
        let MemKind::Cuda(dev) = kind else {
            // SAFETY: forwarded contract.
            return unsafe { Self::register(domain, addr, len, access) };
        };
        let iov = fi::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len,
        };
        let mut attr = device_attr(domain, access, dev);
        fi::set_mr_iov(&mut attr, &iov);
        attr.iov_count = 1;
        let mut ptr = ptr::null_mut();
        // SAFETY: `attr` and `iov` outlive the call; the caller keeps the
        // range allocated; `ptr` receives the MR.
        check("fi_mr_regattr", unsafe {
            fi::fi_mr_regattr(domain.raw(), &attr, 0, &mut ptr)
        })?;
        Self::registered(domain, ptr)
    }

    /// Registers `len` bytes of device `dev`'s memory at `addr` through the
    /// DMA-BUF `fd` that holds them, from `offset` on (`FI_MR_DMABUF`; NCCL's
    /// `regMrDmaBuf`). `-FI_ENOSYS` where the headers Weft was built with
    /// have no DMA-BUF registration (libfabric before 1.20).
    ///
    /// # Safety
    /// As for [`Mr::register`]; `fd` is open for the call.
    pub unsafe fn register_dmabuf(
        domain: &Arc<Domain>,
        addr: *const u8,
        len: usize,
        access: u64,
        dev: i32,
        fd: i32,
        offset: u64,
    ) -> Result<Self, FiError> {
        let mut attr = device_attr(domain, access, dev);
        // The DMA-BUF's start in this address space, so that base_addr +
        // offset is `addr` (what peers write to with FI_MR_VIRT_ADDR).
        let base = (addr as u64).checked_sub(offset).ok_or_else(|| FiError {
            call: "fi_mr_regattr",
            code: fi::FI_EINVAL,
            text: format!("DMA-BUF offset {offset} is larger than the address {addr:p} it is at"),
        })?;
        let range = fi::DmabufRange {
            fd,
            offset,
            len,
            base_addr: base as *mut libc::c_void,
        };
        let mut ptr = ptr::null_mut();
        // SAFETY: `attr` outlives the call; the caller keeps the memory
        // allocated and `fd` open; `ptr` receives the MR.
        check("fi_mr_regattr(FI_MR_DMABUF)", unsafe {
            fi::mr_regattr_dmabuf(domain.raw(), &mut attr, &range, 0, &mut ptr)
        })?;
        Self::registered(domain, ptr)
    }

    /// The `Mr` of a registration `fi_mr_reg`/`fi_mr_regattr` just made:
    /// bound and enabled where the domain wants that (`FI_MR_ENDPOINT`).
    fn registered(domain: &Arc<Domain>, ptr: *mut fi::fid_mr) -> Result<Self, FiError> {
        let mr = Self {
            ptr,
            _domain: Arc::clone(domain),
        };
        if domain.mr_mode() & fi::FI_MR_ENDPOINT != 0 {
            mr.bind_and_enable(domain)?;
        }
        Ok(mr)
    }

    /// `FI_MR_ENDPOINT`: binds the registration to the domain's endpoint for
    /// registrations and enables it. Where the mode is only emulated, the
    /// provider's `-FI_ENOSYS` (it associates registrations with domains)
    /// counts as done.
    fn bind_and_enable(&self, domain: &Domain) -> Result<(), FiError> {
        let ep = domain.mr_endpoint().ok_or_else(|| FiError {
            call: "fi_mr_bind",
            code: fi::FI_EINVAL,
            text: "FI_MR_ENDPOINT: no endpoint to bind the registration to yet (the device's endpoints open with its first comm)".to_owned(),
        })?;
        let emulated = domain.strict(fi::FI_MR_ENDPOINT);
        let tolerate = |r: i32| {
            if emulated && r == -(fi::FI_ENOSYS as i32) {
                0
            } else {
                r
            }
        };
        // SAFETY: `ptr` is a live MR; `ep` is the domain's live endpoint for
        // registrations (it is closed only after every comm and
        // registration of the device).
        unsafe {
            check(
                "fi_mr_bind",
                tolerate(fi::fi_mr_bind(self.ptr, &raw mut (*ep).fid, 0)),
            )?;
            check("fi_mr_enable", tolerate(fi::fi_mr_enable(self.ptr)))?;
        }
        if emulated {
            domain.note_enabled(self.desc() as usize, true);
        }
        Ok(())
    }

    /// The local descriptor passed with data-transfer calls (may be NULL).
    pub fn desc(&self) -> *mut libc::c_void {
        // SAFETY: `ptr` is a live MR.
        unsafe { fi::fi_mr_desc(self.ptr) }
    }

    /// The remote key a peer uses for RMA.
    pub fn key(&self) -> u64 {
        // SAFETY: `ptr` is a live MR.
        unsafe { fi::fi_mr_key(self.ptr) }
    }
}

/// The attributes of a registration of device `dev`'s memory (its memory
/// not yet set): `iface = FI_HMEM_CUDA` and the device, or with
/// `WEFT_TEST_HMEM=system` host memory (see [`Mr::register_kind`]).
fn device_attr(domain: &Domain, access: u64, dev: i32) -> fi::fi_mr_attr {
    let mut attr = fi::fi_mr_attr {
        access,
        requested_key: domain.requested_key(),
        ..Default::default()
    };
    if domain.hmem_as_system() {
        attr.iface = fi::fi_hmem_iface_FI_HMEM_SYSTEM;
    } else {
        attr.iface = fi::fi_hmem_iface_FI_HMEM_CUDA;
        attr.device.cuda = dev;
    }
    attr
}

/// `FI_MR_ALLOCATED` honoured by Weft itself (`WEFT_TEST_MR_MODE=allocated`):
/// every page of `addr..addr+len` must be mapped.
fn check_mapped(addr: *const u8, len: usize) -> Result<(), FiError> {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let start = addr as usize & !(page - 1);
    let end = (addr as usize).saturating_add(len.max(1));
    let pages = (end - start).div_ceil(page);
    let mut vec = vec![0u8; pages];
    // SAFETY: mincore only reads the page tables of the range and writes
    // one byte per page into `vec`, which has room for all of them.
    let r = unsafe { libc::mincore(start as *mut libc::c_void, pages * page, vec.as_mut_ptr()) };
    if r != 0 {
        return Err(FiError {
            call: "fi_mr_reg",
            code: fi::FI_EINVAL,
            text: format!(
                "FI_MR_ALLOCATED: {len} bytes at {addr:p} are not all allocated (mapped) memory"
            ),
        });
    }
    Ok(())
}

impl Drop for Mr {
    fn drop(&mut self) {
        if self._domain.strict(fi::FI_MR_ENDPOINT) {
            self._domain.note_enabled(self.desc() as usize, false);
        }
        // SAFETY: `ptr` is live and closed once.
        close_fid(unsafe { &raw mut (*self.ptr).fid }, "mr");
    }
}
