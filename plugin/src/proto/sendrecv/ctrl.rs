//! The control channel: registered buffers kept posted for control
//! messages, the peers they go to (guarding peers in this process), and
//! injecting one.

use super::*;

/// Registered buffers kept posted for control messages.
pub(super) struct CtrlBufs {
    pub(super) list: Freelist<HostPages, DomainRegistrar>,
    pub(super) posted: Vec<Elem>,
    /// Buffers the provider refused to take back for now (FI_EAGAIN),
    /// reposted at the next progress.
    pub(super) unposted: Vec<usize>,
}

impl CtrlBufs {
    pub(super) fn new(dev: &DeviceState, ep: &Endpoint) -> Result<Self> {
        let mut list = Freelist::new(
            HostPages,
            DomainRegistrar(Arc::clone(&dev.domain)),
            Params {
                elem_size: CTRL_MAX,
                align: SLOT_ALIGN,
                elems_per_block: CTRL_POSTED,
                max_elems: CTRL_POSTED,
            },
        )
        .map_err(|e| Error::system(e.to_string()))?;
        let mut posted = Vec::with_capacity(CTRL_POSTED);
        for _ in 0..CTRL_POSTED {
            posted.push(list.alloc().map_err(|e| Error::system(e.to_string()))?);
        }
        let mut me = Self {
            list,
            posted,
            unposted: Vec::new(),
        };
        for i in 0..CTRL_POSTED {
            me.repost(ep, i)?;
        }
        Ok(me)
    }

    /// Posts buffer `i` again; when the provider says "not now" it is kept
    /// for [`CtrlBufs::repost_waiting`] (a retryable condition is no error).
    pub(super) fn repost(&mut self, ep: &Endpoint, i: usize) -> Result<()> {
        match self.post(ep, i) {
            Err(e) if e.is_again() => {
                self.unposted.push(i);
                Ok(())
            }
            r => r.map_err(Error::from),
        }
    }

    /// Retries the buffers that could not be posted yet.
    pub(super) fn repost_waiting(&mut self, ep: &Endpoint) -> Result<()> {
        for i in std::mem::take(&mut self.unposted) {
            self.repost(ep, i)?;
        }
        Ok(())
    }

    pub(super) fn post(&self, ep: &Endpoint, i: usize) -> std::result::Result<(), FiError> {
        let e = &self.posted[i];
        let desc = e.mr.map_or(std::ptr::null_mut(), |m| m.desc);
        // SAFETY: the buffer is CTRL_MAX bytes of registered memory owned by
        // this list, which outlives the endpoint (fields drop ep first); the
        // context is the buffer's own address.
        unsafe {
            ep.trecv(
                e.ptr.as_ptr(),
                CTRL_MAX,
                desc,
                fi::FI_ADDR_UNSPEC,
                CTRL_TAG,
                0,
                e.ptr.as_ptr().cast(),
            )
        }
    }

    /// Which posted buffer a completion context names.
    pub(super) fn find(&self, ctx: *mut c_void) -> Option<usize> {
        self.posted
            .iter()
            .position(|e| e.ptr.as_ptr().cast() == ctx)
    }

    pub(super) fn bytes(&self, i: usize, len: usize) -> &[u8] {
        // SAFETY: the buffer is CTRL_MAX bytes; the provider finished writing
        // `len` of them when it reported the completion.
        unsafe { std::slice::from_raw_parts(self.posted[i].ptr.as_ptr(), len.min(CTRL_MAX)) }
    }
}

impl Drop for CtrlBufs {
    fn drop(&mut self) {
        for e in self.posted.drain(..) {
            self.list.free(e);
        }
    }
}

/// A peer endpoint: its address in a comm's AV and, when it lives in this
/// process, its record there (see [`crate::fabric::local`]).
pub(super) struct Peer {
    pub(super) addr: FiAddr,
    pub(super) local: Option<Arc<LocalEp>>,
}

impl Peer {
    pub(super) const NONE: Peer = Peer {
        addr: fi::FI_ADDR_NOTAVAIL,
        local: None,
    };

    /// Inserts a peer's endpoint name into `ep`'s AV. The name was checked
    /// against the domain's address format by the AV; an endpoint of this
    /// process that is already closed is refused.
    pub(super) fn insert(ep: &Endpoint, name: &[u8]) -> std::result::Result<Self, FiError> {
        let local = match local::locate(name) {
            Locality::Closed => return Err(closed_peer("fi_av_insert")),
            Locality::Local(l) => Some(l),
            Locality::Remote => None,
        };
        Ok(Self {
            addr: ep.av().insert(name)?,
            local,
        })
    }

    /// Runs a send to this peer. A peer in this process is kept open while
    /// it runs; a closed one is an error, never a send (shm crashes on those).
    pub(super) fn send(
        &self,
        call: &'static str,
        f: impl FnOnce(FiAddr) -> std::result::Result<(), FiError>,
    ) -> std::result::Result<(), FiError> {
        match &self.local {
            None => f(self.addr),
            Some(l) => {
                let _open = l.open_guard().ok_or_else(|| closed_peer(call))?;
                f(self.addr)
            }
        }
    }
}

pub(super) fn closed_peer(call: &'static str) -> FiError {
    FiError {
        call,
        code: fi::FI_ENOTCONN,
        text: "the peer endpoint, in this same process, was closed".to_owned(),
    }
}

/// Injects a control message.
pub(super) fn send_ctrl(ep: &Endpoint, to: &Peer, msg: &Ctrl) -> std::result::Result<(), FiError> {
    let mut b = [0u8; CTRL_MAX];
    let n = msg.encode(&mut b);
    to.send("fi_tinject", |a| ep.tinject(&b[..n], a, CTRL_TAG))
}
