//! Completion queues in `FI_CQ_FORMAT_TAGGED`.

use std::ffi::CStr;
use std::ptr;
use std::sync::Arc;

use libfabric_sys as fi;

use super::av::FiAddr;
use super::domain::{close_fid, Domain};
use super::error::{check, strerror, FiError};

/// One successful completion.
pub type Completion = fi::fi_cq_tagged_entry;

/// Whether `c` reports a peer's write into this endpoint's memory, for a
/// user that sends no message with remote CQ data (as Weft does not): the
/// data flag alone says so. libfabric 2.x's shm reports only
/// `FI_REMOTE_CQ_DATA` for such a write (`FI_RMA | FI_REMOTE_WRITE` need
/// `FI_RMA_EVENT`); 1.17 and rxm report all three.
pub fn is_remote_write(c: &Completion) -> bool {
    c.flags & (u64::from(fi::FI_REMOTE_WRITE) | fi::FI_REMOTE_CQ_DATA as u64) != 0
}

/// A completion that finished with an error (`fi_cq_readerr`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("operation failed: {text} (fi errno {err}, provider says: {prov_text}); {len} of the data moved, {olen} bytes did not fit")]
pub struct CompletionError {
    /// The context the operation was posted with.
    pub context: *mut libc::c_void,
    /// Positive libfabric error number (`FI_ETRUNC`, `FI_ECANCELED`, ...).
    pub err: u32,
    /// Provider-specific error number.
    pub prov_errno: i32,
    /// Bytes that did fit.
    pub len: usize,
    /// Bytes that did not fit (truncation).
    pub olen: usize,
    /// The tag of the failed operation.
    pub tag: u64,
    /// `fi_strerror(err)`.
    pub text: String,
    /// `fi_cq_strerror(prov_errno)`.
    pub prov_text: String,
}

// SAFETY: `context` is an opaque token owned by whoever posted the operation;
// this type never dereferences it.
unsafe impl Send for CompletionError {}
// SAFETY: as above.
unsafe impl Sync for CompletionError {}

/// What reading a CQ can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CqError {
    /// An operation completed with an error.
    #[error(transparent)]
    Completion(#[from] CompletionError),
    /// The queue itself failed.
    #[error(transparent)]
    Fi(#[from] FiError),
}

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    ptr: *mut fi::fid_cq,
    _domain: Arc<Domain>,
}

// SAFETY: opened on a FI_THREAD_SAFE domain.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// Opens a CQ of `size` entries (0 = provider default) with tagged entries.
    pub fn open(domain: &Arc<Domain>, size: usize) -> Result<Arc<Self>, FiError> {
        let mut attr = fi::fi_cq_attr {
            size,
            format: fi::fi_cq_format_FI_CQ_FORMAT_TAGGED,
            wait_obj: fi::fi_wait_obj_FI_WAIT_NONE,
            ..Default::default()
        };
        let mut ptr = ptr::null_mut();
        // SAFETY: domain is live, attr initialised, `ptr` receives the CQ.
        check("fi_cq_open", unsafe {
            fi::fi_cq_open(domain.raw(), &mut attr, &mut ptr, ptr::null_mut())
        })?;
        Ok(Arc::new(Self {
            ptr,
            _domain: Arc::clone(domain),
        }))
    }

    /// Reads up to `out.len()` completions; `Ok(0)` when none are ready. This
    /// also drives progress for providers with manual progress (rxm, shm).
    pub fn read(&self, out: &mut [Completion]) -> Result<usize, CqError> {
        // SAFETY: `out` is writable for out.len() tagged entries, the format
        // this CQ was opened with.
        let ret = unsafe { fi::fi_cq_read(self.ptr, out.as_mut_ptr().cast(), out.len()) };
        self.outcome(ret)
    }

    /// [`Cq::read`], with each completion's source address in `src` (its
    /// address in the endpoint's AV; `FI_ADDR_NOTAVAIL` for a source not in
    /// it, or where the endpoint lacks `FI_SOURCE`).
    pub fn read_from(&self, out: &mut [Completion], src: &mut [FiAddr]) -> Result<usize, CqError> {
        let n = out.len().min(src.len());
        // SAFETY: `out` and `src` are writable for `n` entries each, in the
        // format this CQ was opened with.
        let ret =
            unsafe { fi::fi_cq_readfrom(self.ptr, out.as_mut_ptr().cast(), n, src.as_mut_ptr()) };
        self.outcome(ret)
    }

    fn outcome(&self, ret: isize) -> Result<usize, CqError> {
        if ret >= 0 {
            return Ok(usize::try_from(ret).unwrap_or(0));
        }
        let code = ret.unsigned_abs();
        if code == fi::FI_EAGAIN as usize {
            return Ok(0);
        }
        if code == fi::FI_EAVAIL as usize {
            return Err(self.read_error()?.into());
        }
        Err(FiError::new("fi_cq_read", ret as i64).into())
    }

    fn read_error(&self) -> Result<CompletionError, FiError> {
        let mut e = fi::fi_cq_err_entry::default();
        // SAFETY: `e` is a zeroed err entry (err_data NULL, so the provider uses its own buffer).
        check("fi_cq_readerr", unsafe {
            fi::fi_cq_readerr(self.ptr, &mut e, 0)
        })?;
        // SAFETY: fi_cq_strerror returns a NUL-terminated string owned by the CQ
        // (or static) that stays valid until the next call on this CQ; copied at once.
        let prov = unsafe {
            let p = fi::fi_cq_strerror(self.ptr, e.prov_errno, e.err_data, ptr::null_mut(), 0);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        let err = e.err.unsigned_abs();
        Ok(CompletionError {
            context: e.op_context,
            err,
            prov_errno: e.prov_errno,
            len: e.len,
            olen: e.olen,
            tag: e.tag,
            text: strerror(err),
            prov_text: prov,
        })
    }

    pub(crate) fn fid(&self) -> *mut fi::fid {
        // SAFETY: `ptr` is live for as long as `self`.
        unsafe { &raw mut (*self.ptr).fid }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        close_fid(self.fid(), "cq");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(flags: u64) -> Completion {
        Completion {
            flags,
            ..Default::default()
        }
    }

    #[test]
    fn a_peer_write_is_known_by_its_data_flag_or_its_write_flag() {
        let (rma, write, data) = (
            u64::from(fi::FI_RMA),
            u64::from(fi::FI_REMOTE_WRITE),
            fi::FI_REMOTE_CQ_DATA as u64,
        );
        // libfabric 1.17 (shm, rxm): all three; 2.x shm: the data flag alone.
        assert!(is_remote_write(&with(rma | write | data)));
        assert!(is_remote_write(&with(data)));
        // Weft's own operations: sends, tagged and control receives, writes.
        for own in [
            u64::from(fi::FI_SEND) | u64::from(fi::FI_TAGGED),
            u64::from(fi::FI_RECV) | u64::from(fi::FI_TAGGED),
            u64::from(fi::FI_RECV) | u64::from(fi::FI_MSG),
            rma | u64::from(fi::FI_WRITE),
        ] {
            assert!(!is_remote_write(&with(own)), "{own:#x}");
        }
    }
}
