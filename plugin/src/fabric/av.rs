//! Address vector: peer endpoint names -> `fi_addr_t`.

use std::collections::HashMap;
use std::ptr;
use std::sync::{Arc, Mutex};

use libfabric_sys as fi;

use super::domain::{close_fid, Domain};
use super::error::{check, FiError};

/// A libfabric address (`fi_addr_t`) in an address vector.
pub type FiAddr = fi::fi_addr_t;

/// An address vector of type `FI_AV_TABLE`.
#[derive(Debug)]
pub struct Av {
    ptr: *mut fi::fid_av,
    domain: Arc<Domain>,
    /// Names inserted so far: a name is inserted once, however many comms
    /// reach it through this AV (shm's AV refuses a peer's 257th insert).
    known: Mutex<HashMap<Vec<u8>, FiAddr>>,
}

// SAFETY: opened on a FI_THREAD_SAFE domain.
unsafe impl Send for Av {}
// SAFETY: as above.
unsafe impl Sync for Av {}

impl Av {
    /// Opens an address vector on `domain`.
    pub fn open(domain: &Arc<Domain>) -> Result<Arc<Self>, FiError> {
        let mut attr = fi::fi_av_attr {
            type_: fi::fi_av_type_FI_AV_TABLE,
            ..Default::default()
        };
        let mut ptr = ptr::null_mut();
        // SAFETY: domain is live, attr is initialised, `ptr` receives the AV.
        check("fi_av_open", unsafe {
            fi::fi_av_open(domain.raw(), &mut attr, &mut ptr, ptr::null_mut())
        })?;
        Ok(Arc::new(Self {
            ptr,
            domain: Arc::clone(domain),
            known: Mutex::new(HashMap::new()),
        }))
    }

    /// Inserts one peer name (as returned by `Endpoint::name`) and returns
    /// its address. A name that is not one whole address of the domain's
    /// format is refused before libfabric sees it ([`Domain::check_addr`]).
    pub fn insert(&self, name: &[u8]) -> Result<FiAddr, FiError> {
        self.domain.check_addr(name).map_err(|why| FiError {
            call: "fi_av_insert",
            code: fi::FI_EINVAL,
            text: format!("refused a peer address: {why}"),
        })?;
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&a) = known.get(name) {
            return Ok(a);
        }
        let mut addr: FiAddr = fi::FI_ADDR_NOTAVAIL;
        // SAFETY: `name` holds one whole address of the provider's format
        // (checked just above), so libfabric reads only inside it; `addr`
        // receives the result.
        let n = check("fi_av_insert", unsafe {
            fi::fi_av_insert(
                self.ptr,
                name.as_ptr().cast(),
                1,
                &mut addr,
                0,
                ptr::null_mut(),
            )
        })?;
        if n != 1 || addr == fi::FI_ADDR_NOTAVAIL {
            return Err(FiError::new(
                "fi_av_insert",
                i64::from(fi::FI_EADDRNOTAVAIL),
            ));
        }
        known.insert(name.to_vec(), addr);
        Ok(addr)
    }

    /// Removes an address inserted earlier.
    pub fn remove(&self, addr: FiAddr) -> Result<(), FiError> {
        let mut a = addr;
        // SAFETY: AV is live; `a` is one address.
        check("fi_av_remove", unsafe {
            fi::fi_av_remove(self.ptr, &mut a, 1, 0)
        })?;
        self.known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, v| *v != addr);
        Ok(())
    }

    /// A printable form of a peer name (e.g. `fi_sockaddr_in://127.0.0.1:4242`),
    /// for log lines; the hex bytes when the provider cannot format it.
    pub fn straddr(&self, name: &[u8]) -> String {
        let mut buf = [0u8; 128];
        let mut len = buf.len();
        if self.domain.check_addr(name).is_err() {
            return name.iter().map(|b| format!("{b:02x}")).collect();
        }
        // SAFETY: AV is live; `name` holds one whole address of this provider
        // (checked just above); libfabric writes at most `len` bytes
        // into `buf` and returns it, NUL-terminated when it fits.
        let p = unsafe {
            fi::fi_av_straddr(
                self.ptr,
                name.as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if p.is_null() {
            return name.iter().map(|b| format!("{b:02x}")).collect();
        }
        let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    pub(crate) fn fid(&self) -> *mut fi::fid {
        // SAFETY: `ptr` is live for as long as `self`.
        unsafe { &raw mut (*self.ptr).fid }
    }
}

impl Drop for Av {
    fn drop(&mut self) {
        close_fid(self.fid(), "av");
    }
}
