//! Reliable-datagram endpoints and their tagged and RMA operations.

use std::ptr;
use std::sync::Arc;

use libfabric_sys as fi;

use super::av::{Av, FiAddr};
use super::cq::Cq;
use super::domain::{close_fid, Domain};
use super::error::{check, FiError};
use super::local::LocalEp;

/// An enabled RDM endpoint bound to one CQ (send and receive) and one AV.
/// Dropping it closes the endpoint before the CQ and AV it holds. While open
/// it is recorded in [`super::local`] under its name.
#[derive(Debug)]
pub struct Endpoint {
    /// NULL once [`Endpoint::shutdown`] closed it.
    ptr: *mut fi::fid_ep,
    local: Option<Arc<LocalEp>>,
    cq: Arc<Cq>,
    av: Arc<Av>,
    _domain: Arc<Domain>,
}

// SAFETY: opened on a FI_THREAD_SAFE domain.
unsafe impl Send for Endpoint {}
// SAFETY: as above.
unsafe impl Sync for Endpoint {}

impl Endpoint {
    /// Opens an endpoint on `domain`, binds `cq` for send and receive
    /// completions and `av`, and enables it.
    pub fn open(domain: &Arc<Domain>, cq: &Arc<Cq>, av: &Arc<Av>) -> Result<Self, FiError> {
        match Self::open_once(domain, cq, av) {
            Err(e)
                if e.code == fi::FI_EBUSY
                    && domain.info().provider() == super::provider::SHM
                    && super::local::remove_stale_shm_regions() > 0 =>
            {
                Self::open_once(domain, cq, av)
            }
            r => r,
        }
    }

    fn open_once(domain: &Arc<Domain>, cq: &Arc<Cq>, av: &Arc<Av>) -> Result<Self, FiError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: domain and its info are live; `ptr` receives the endpoint.
        check("fi_endpoint", unsafe {
            fi::fi_endpoint(domain.raw(), domain.info().raw(), &mut ptr, ptr::null_mut())
        })?;
        // Own it first so an error below still closes it.
        let mut ep = Self {
            ptr,
            local: None,
            cq: Arc::clone(cq),
            av: Arc::clone(av),
            _domain: Arc::clone(domain),
        };
        let flags = u64::from(fi::FI_TRANSMIT | fi::FI_RECV);
        // SAFETY: ep, cq and av are live objects of the same domain.
        unsafe {
            check("fi_ep_bind(cq)", fi::fi_ep_bind(ep.ptr, cq.fid(), flags))?;
            check("fi_ep_bind(av)", fi::fi_ep_bind(ep.ptr, av.fid(), 0))?;
        }
        if domain.gpu_memory() {
            forbid_cuda_calls(domain, ep.ptr);
        }
        // SAFETY: ep is live and bound.
        let enabled = check("fi_enable", unsafe { fi::fi_enable(ep.ptr) });
        enabled.map_err(|e| explain_enable_failure(domain.info().provider(), e))?;
        let name = ep.name()?;
        domain.note_name_len(name.len());
        // shm names carry the process id, so they are never another process's.
        let process_unique = domain.info().provider() == super::provider::SHM;
        ep.local = Some(LocalEp::register(name, process_unique));
        Ok(ep)
    }

    /// Closes the endpoint (once; afterwards every operation fails with
    /// `FI_ESHUTDOWN`). Its CQ and AV stay open until dropped.
    fn shutdown(&mut self) {
        if let Some(l) = &self.local {
            l.close();
        }
        if !self.ptr.is_null() {
            // SAFETY: `ptr` is live and closed once (it is NULL afterwards).
            close_fid(unsafe { &raw mut (*self.ptr).fid }, "endpoint");
            self.ptr = ptr::null_mut();
        }
    }

    /// The domain it was opened on.
    pub(crate) fn domain(&self) -> &Arc<Domain> {
        &self._domain
    }

    /// The raw endpoint, for binding registrations to it.
    pub(crate) fn raw(&self) -> *mut fi::fid_ep {
        self.ptr
    }

    fn live(&self, call: &'static str) -> Result<*mut fi::fid_ep, FiError> {
        if self.ptr.is_null() {
            Err(FiError::new(call, i64::from(fi::FI_ESHUTDOWN)))
        } else {
            Ok(self.ptr)
        }
    }

    /// Opens an endpoint with a CQ and an AV of its own on `domain` (how
    /// Weft gives every comm its endpoint).
    pub fn open_own(domain: &Arc<Domain>) -> Result<Self, FiError> {
        Self::open_sized(domain, 0)
    }

    /// [`Endpoint::open_own`] with a CQ of `cq_size` entries (0: the
    /// provider's default).
    pub fn open_sized(domain: &Arc<Domain>, cq_size: usize) -> Result<Self, FiError> {
        let cq = Cq::open(domain, cq_size)?;
        let av = Av::open(domain)?;
        Self::open(domain, &cq, &av)
    }

    /// The endpoint's address, to be inserted in a peer's AV.
    pub fn name(&self) -> Result<Vec<u8>, FiError> {
        let ep = self.live("fi_getname")?;
        let mut buf = vec![0u8; 64];
        loop {
            let mut len = buf.len();
            // SAFETY: `buf` is writable for `len` bytes; libfabric writes at most
            // that and reports the needed length.
            let ret =
                unsafe { fi::fi_getname(&raw mut (*ep).fid, buf.as_mut_ptr().cast(), &mut len) };
            if ret == -(fi::FI_ETOOSMALL as i32) && len > buf.len() {
                buf.resize(len, 0);
                continue;
            }
            check("fi_getname", ret)?;
            buf.truncate(len);
            return Ok(buf);
        }
    }

    /// The completion queue every operation of this endpoint reports to.
    pub fn cq(&self) -> &Arc<Cq> {
        &self.cq
    }

    /// The address vector peers are inserted into.
    pub fn av(&self) -> &Arc<Av> {
        &self.av
    }

    /// Posts a tagged send. `FI_EAGAIN` means "progress the CQ and retry".
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and unchanged until the completion for
    /// `ctx` is read; `desc` must be the MR descriptor for that memory (or NULL
    /// where the provider needs none).
    pub unsafe fn tsend(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut libc::c_void,
        dest: FiAddr,
        tag: u64,
        ctx: *mut libc::c_void,
    ) -> Result<(), FiError> {
        let ep = self.live("fi_tsend")?;
        self.check_desc("fi_tsend", len, desc)?;
        // SAFETY: upheld by the caller as documented.
        check("fi_tsend", unsafe {
            fi::fi_tsend(ep, buf.cast(), len, desc, dest, tag, ctx)
        })
        .map(drop)
    }

    /// Posts a tagged receive matching `tag` with `ignore` bits masked.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and writable until the completion for
    /// `ctx` is read; `desc` as for [`Endpoint::tsend`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn trecv(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut libc::c_void,
        src: FiAddr,
        tag: u64,
        ignore: u64,
        ctx: *mut libc::c_void,
    ) -> Result<(), FiError> {
        let ep = self.live("fi_trecv")?;
        self.check_desc("fi_trecv", len, desc)?;
        // SAFETY: upheld by the caller as documented.
        check("fi_trecv", unsafe {
            fi::fi_trecv(ep, buf.cast(), len, desc, src, tag, ignore, ctx)
        })
        .map(drop)
    }

    /// Sends an untagged message of `len` bytes from `buf`.
    ///
    /// # Safety
    /// As for [`Endpoint::tsend`].
    pub unsafe fn send(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut libc::c_void,
        dest: FiAddr,
        ctx: *mut libc::c_void,
    ) -> Result<(), FiError> {
        let ep = self.live("fi_send")?;
        self.check_desc("fi_send", len, desc)?;
        // SAFETY: upheld by the caller as documented.
        check("fi_send", unsafe {
            fi::fi_send(ep, buf.cast(), len, desc, dest, ctx)
        })
        .map(drop)
    }

    /// Posts an untagged receive (any message from `src`).
    ///
    /// # Safety
    /// As for [`Endpoint::trecv`].
    pub unsafe fn recv(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut libc::c_void,
        src: FiAddr,
        ctx: *mut libc::c_void,
    ) -> Result<(), FiError> {
        let ep = self.live("fi_recv")?;
        self.check_desc("fi_recv", len, desc)?;
        // SAFETY: upheld by the caller as documented.
        check("fi_recv", unsafe {
            fi::fi_recv(ep, buf.cast(), len, desc, src, ctx)
        })
        .map(drop)
    }

    /// Writes `len` bytes into a peer's registered memory at `raddr` (key
    /// `key`): with `Some(data)`, `fi_writedata`, which raises a completion
    /// there carrying `data` (remote CQ data); with `None`, `fi_write`, which
    /// the target never sees. `FI_EAGAIN` means "progress the CQ and retry".
    ///
    /// # Safety
    /// As for [`Endpoint::tsend`]: the source stays valid and unchanged until
    /// the completion for `ctx` is read.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn writedata(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut libc::c_void,
        data: Option<u64>,
        dest: FiAddr,
        raddr: u64,
        key: u64,
        ctx: *mut libc::c_void,
    ) -> Result<(), FiError> {
        let what = if data.is_some() { "fi_writedata" } else { "fi_write" };
        let ep = self.live(what)?;
        self.check_desc(what, len, desc)?;
        // SAFETY: upheld by the caller as documented; the remote range is the
        // peer's to validate (its provider checks the key and bounds).
        check(what, unsafe {
            match data {
                Some(data) => fi::fi_writedata(ep, buf.cast(), len, desc, data, dest, raddr, key, ctx),
                None => fi::fi_write(ep, buf.cast(), len, desc, dest, raddr, key, ctx),
            }
        })
        .map(drop)
    }

    /// Reads `len` bytes of a peer's registered memory at `raddr` (key
    /// `key`) into `buf` (`fi_read`). `FI_EAGAIN` means "progress the CQ and
    /// retry".
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and writable until the completion for
    /// `ctx` is read; `desc` as for [`Endpoint::tsend`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn read(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut libc::c_void,
        src: FiAddr,
        raddr: u64,
        key: u64,
        ctx: *mut libc::c_void,
    ) -> Result<(), FiError> {
        let ep = self.live("fi_read")?;
        self.check_desc("fi_read", len, desc)?;
        // SAFETY: upheld by the caller as documented; the remote range is the
        // peer's to validate (its provider checks the key and bounds).
        check("fi_read", unsafe {
            fi::fi_read(ep, buf.cast(), len, desc, src, raddr, key, ctx)
        })
        .map(drop)
    }

    /// Where Weft honours `FI_MR_LOCAL` without the provider requiring it
    /// (`WEFT_TEST_MR_MODE=local`): a buffer posted without its
    /// registration's descriptor is refused, as such a provider would.
    fn check_desc(
        &self,
        call: &'static str,
        len: usize,
        desc: *mut libc::c_void,
    ) -> Result<(), FiError> {
        if len > 0 && desc.is_null() && self._domain.strict(fi::FI_MR_LOCAL) {
            return Err(FiError {
                call,
                code: fi::FI_EINVAL,
                text: "FI_MR_LOCAL: a local buffer posted without its registration's descriptor"
                    .to_owned(),
            });
        }
        if !desc.is_null()
            && self._domain.strict(fi::FI_MR_ENDPOINT)
            && !self._domain.is_enabled(desc as usize)
        {
            return Err(FiError {
                call,
                code: fi::FI_EINVAL,
                text: "FI_MR_ENDPOINT: a buffer posted with the descriptor of a registration that is not bound and enabled"
                    .to_owned(),
            });
        }
        Ok(())
    }

    /// Sends a small message that libfabric copies at once (no completion).
    pub fn tinject(&self, data: &[u8], dest: FiAddr, tag: u64) -> Result<(), FiError> {
        let ep = self.live("fi_tinject")?;
        // SAFETY: fi_tinject copies `data` before returning.
        check("fi_tinject", unsafe {
            fi::fi_tinject(ep, data.as_ptr().cast(), data.len(), dest, tag)
        })
        .map(drop)
    }

    /// Sends a small untagged message that libfabric copies at once (no
    /// completion).
    pub fn inject(&self, data: &[u8], dest: FiAddr) -> Result<(), FiError> {
        let ep = self.live("fi_inject")?;
        // SAFETY: fi_inject copies `data` before returning.
        check("fi_inject", unsafe {
            fi::fi_inject(ep, data.as_ptr().cast(), data.len(), dest)
        })
        .map(drop)
    }

    /// [`Endpoint::inject`] with remote CQ data (`fi_injectdata`). Weft
    /// itself never sends one; hostile-input tests do.
    pub fn injectdata(&self, data: &[u8], cq_data: u64, dest: FiAddr) -> Result<(), FiError> {
        let ep = self.live("fi_injectdata")?;
        // SAFETY: fi_injectdata copies `data` before returning.
        check("fi_injectdata", unsafe {
            fi::fi_injectdata(ep, data.as_ptr().cast(), data.len(), cq_data, dest)
        })
        .map(drop)
    }

    /// [`Endpoint::tinject`] with remote CQ data (`fi_tinjectdata`). Weft
    /// itself never sends one; hostile-input tests do.
    pub fn tinjectdata(
        &self,
        data: &[u8],
        cq_data: u64,
        dest: FiAddr,
        tag: u64,
    ) -> Result<(), FiError> {
        let ep = self.live("fi_tinjectdata")?;
        // SAFETY: fi_tinjectdata copies `data` before returning.
        check("fi_tinjectdata", unsafe {
            fi::fi_tinjectdata(ep, data.as_ptr().cast(), data.len(), cq_data, dest, tag)
        })
        .map(drop)
    }

    /// Cancels a posted operation by its context; its completion (if any) is
    /// reported as `FI_ECANCELED`.
    ///
    /// # Safety
    /// `ctx` must be a context posted on this endpoint whose completion has
    /// not been read yet (libfabric matches it against posted operations).
    pub unsafe fn cancel(&self, ctx: *mut libc::c_void) -> Result<(), FiError> {
        let ep = self.live("fi_cancel")?;
        // SAFETY: the endpoint is live; the caller vouches for `ctx`.
        check("fi_cancel", unsafe {
            fi::fi_cancel(&raw mut (*ep).fid, ctx)
        })
        .map(drop)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Closed before `cq` and `av` (fields drop after this body runs).
        self.shutdown();
    }
}

/// `e` with what to do added to its text, where the cause of an
/// `fi_enable` failure is known. rxm sizes the CQ of its core endpoints
/// (verbs) as its receive queue plus its transmit queue times
/// `FI_UNIVERSE_SIZE` (256 by default) entries, which is more than a device
/// with a small `max_cqe` takes (Soft-RoCE's rxe: 32767), and the core
/// refuses the CQ with `FI_EINVAL`.
fn explain_enable_failure(provider: &str, mut e: FiError) -> FiError {
    if e.code == fi::FI_EINVAL && provider.starts_with("verbs") && provider.contains("rxm") {
        e.text = format!(
            "{}: rxm asks {provider} for a CQ of (rx + tx queue) x FI_UNIVERSE_SIZE entries, more \
             than a device with a small max_cqe (rxe: 32767) takes; export FI_UNIVERSE_SIZE no \
             larger than the job's peer count (e.g. 64)",
            e.text
        );
    }
    e
}

/// On a device that takes GPU memory: asks the provider not to call CUDA
/// itself (`FI_OPT_CUDA_API_PERMITTED` = false, before `fi_enable`), so that
/// it never does on NCCL's proxy thread, where CUDA calls can deadlock with
/// NCCL's own. Where libfabric cannot promise that, says why (once per
/// domain); the endpoint opens either way.
fn forbid_cuda_calls(domain: &Domain, ep: *mut fi::fid_ep) {
    let answer = match fi::OPT_CUDA_API_PERMITTED {
        None => Err(format!(
            "not known to the headers of libfabric {} Weft was built with (1.18+)",
            fi::version_text(fi::HEADERS_FI_VERSION)
        )),
        Some(opt) => {
            let permitted = false;
            // SAFETY: `ep` is a live, not yet enabled endpoint; the option
            // is a bool read during the call.
            let r = unsafe {
                fi::fi_setopt(
                    &raw mut (*ep).fid,
                    fi::FI_OPT_ENDPOINT as i32,
                    opt,
                    (&raw const permitted).cast(),
                    std::mem::size_of::<bool>(),
                )
            };
            match -r as u32 {
                0 => Ok(()),
                fi::FI_EOPNOTSUPP => Err(
                    "the provider calls CUDA itself (it copies through the host); NCCL's proxy thread may \
                     then make CUDA calls: if NCCL hangs, disable GPUDirect with NCCL_NET_GDR_LEVEL=LOC"
                        .to_owned(),
                ),
                fi::FI_EINVAL => Err("this libfabric has no CUDA support, so there is nothing to forbid".to_owned()),
                _ => Err(format!(
                    "the provider does not take the option ({})",
                    super::error::FiError::new("fi_setopt", i64::from(r))
                )),
            }
        }
    };
    let provider = domain.info().provider();
    domain.say_cuda_api_once(|| match answer {
        Ok(()) => tracing::info!(
            target: "weft::init",
            "{provider}: FI_OPT_CUDA_API_PERMITTED = false accepted: the provider will not call CUDA"
        ),
        Err(why) => tracing::info!(
            target: "weft::init",
            "{provider}: FI_OPT_CUDA_API_PERMITTED not set: {why}"
        ),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::strerror;

    /// The rxe CQ-size failure says what to export; other providers' and
    /// other errors' text stays libfabric's own.
    #[test]
    fn enable_failure_on_verbs_rxm_names_the_universe_size() {
        let einval = || FiError::new("fi_enable", i64::from(fi::FI_EINVAL));
        let e = explain_enable_failure("verbs;ofi_rxm", einval());
        assert!(e.text.starts_with(&strerror(fi::FI_EINVAL)), "{}", e.text);
        assert!(e.text.contains("export FI_UNIVERSE_SIZE"), "{}", e.text);
        assert_eq!(e.code, fi::FI_EINVAL);
        for (prov, err) in [
            ("tcp;ofi_rxm", einval()),
            ("verbs", einval()),
            ("verbs;ofi_rxm", FiError::new("fi_enable", i64::from(fi::FI_ENOMEM))),
        ] {
            let want = err.text.clone();
            assert_eq!(explain_enable_failure(prov, err).text, want, "{prov}");
        }
    }
}
