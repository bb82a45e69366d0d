//! The receiving side: grouped receives, their posting order, and credits
//! going back.

use super::*;

/// A receiving comm.
pub struct RecvComm {
    pub(crate) dev: Arc<DeviceState>,
    pub(super) inner: Mutex<RecvState>,
}

pub(super) struct RecvState {
    // Field order is drop order: the endpoint closes before its buffers go.
    pub(super) ep: Endpoint,
    pub(super) ctrl: CtrlBufs,
    pub(super) reqs: Pool<Request>,
    pub(super) link: Link,
    /// Sub-receives not yet posted (FI_EAGAIN), in order.
    pub(super) to_post: VecDeque<(u32, u8)>,
    pub(super) owed: u32,
}

impl std::fmt::Debug for RecvComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecvComm(dev {})", self.dev.index)
    }
}

impl RecvComm {
    pub(super) fn open(dev: Arc<DeviceState>) -> Result<Self> {
        let ep = open_endpoint(&dev)?;
        let ctrl = CtrlBufs::new(&dev, &ep, CTRL_POSTED, false)?;
        let reqs = Pool::new(MAX_REQUESTS).map_err(|e| Error::system(e.to_string()))?;
        Ok(Self {
            dev,
            inner: Mutex::new(RecvState {
                ep,
                ctrl,
                reqs,
                link: Link::new(),
                to_post: VecDeque::with_capacity(MAX_REQUESTS * MAX_RECVS),
                owed: 0,
            }),
        })
    }
}

impl Receiver for RecvComm {
    /// `Ok(None)` when all requests are in use, or while another thread
    /// holds the comm.
    unsafe fn irecv(&self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        super::super::check_recv_count(bufs.len())?;
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        st.link.check()?;
        let mut req = Request {
            kind: Kind::Recv,
            n: bufs.len() as u8,
            remaining: bufs.len() as u8,
            sizes: [0; MAX_RECVS],
            bufs: [RecvBuf::EMPTY; MAX_RECVS],
            err: None,
        };
        req.bufs[..bufs.len()].copy_from_slice(bufs);
        let Some((ptr, idx)) = st.reqs.insert(req) else {
            st.progress()?;
            return Ok(None);
        };
        // Post straight away unless earlier receives wait (posting order is
        // matching order); what the provider refuses for now waits in order.
        // No progress here: NCCL tests the request next, and every read of
        // the CQ costs a system call on tcp.
        let mut post_all = || -> Result<()> {
            let mut first_waiting = 0;
            if st.to_post.is_empty() {
                while first_waiting < bufs.len()
                    && st.post(&bufs[first_waiting], ptr.as_ptr(), first_waiting)?
                {
                    first_waiting += 1;
                }
            }
            for sub in first_waiting..bufs.len() {
                st.to_post.push_back((idx, sub as u8));
            }
            st.post_pending()
        };
        if let Err(e) = post_all() {
            // A hard provider error, possibly part way through a grouped
            // receive: the comm cannot go on. Closing its endpoint takes back
            // what was posted; this request, which NCCL never sees, is freed.
            die(&mut *st, format!("posting a receive failed: {e}"));
            st.reqs.release(idx);
            return Err(e);
        }
        Ok(Some(ReqId {
            slot: idx,
            gen: st.reqs.gen(idx),
        }))
    }
}

impl Locked for RecvComm {
    type State = RecvState;
    fn device(&self) -> &Arc<DeviceState> {
        &self.dev
    }
    fn state(&self) -> &Mutex<RecvState> {
        &self.inner
    }
}

impl Side for RecvState {
    const WHAT: &'static str = "receive comm from";
    const KIND: &'static str = "receive";
    fn linked(&self) -> bool {
        self.link.peer.addr != fi::FI_ADDR_NOTAVAIL
    }
    fn parts(&mut self) -> (&mut Endpoint, &mut Pool<Request>, &mut Link) {
        (&mut self.ep, &mut self.reqs, &mut self.link)
    }
    fn progress(&mut self) -> Result<()> {
        RecvState::progress(self)
    }
}

impl RecvState {
    /// Posts sub-receive `sub` of the request in `slot`: `Ok(false)` when
    /// the provider says "not now" (FI_EAGAIN).
    pub(super) fn post(&self, b: &RecvBuf, slot: *mut Request, sub: usize) -> Result<bool> {
        let ctx = (slot as usize + sub) as *mut c_void;
        // SAFETY: NCCL keeps the buffer valid until the request completes;
        // the context names this request's slot and sub-receive.
        let posted = unsafe {
            self.ep.trecv(
                b.data,
                b.size,
                b.desc,
                self.link.peer.addr,
                u64::from(b.tag as u32),
                0,
                ctx,
            )
        };
        match posted {
            Ok(()) => Ok(true),
            Err(e) if e.is_again() => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Posts the sub-receives that had to wait, in order.
    pub(super) fn post_pending(&mut self) -> Result<()> {
        while let Some(&(idx, sub)) = self.to_post.front() {
            let (Some(slot), Some(b)) = (
                self.reqs.ptr(idx),
                self.reqs.get_mut(idx).map(|r| r.bufs[usize::from(sub)]),
            ) else {
                self.to_post.pop_front();
                continue;
            };
            if !self.post(&b, slot.as_ptr(), usize::from(sub))? {
                return Ok(());
            }
            self.to_post.pop_front();
        }
        Ok(())
    }

    pub(super) fn progress(&mut self) -> Result<()> {
        self.ctrl.repost_waiting(&self.ep)?;
        let Self {
            ep,
            ctrl,
            reqs,
            link,
            owed,
            ..
        } = self;
        drain(&**ep.cq(), |ev| match ev {
            Event::Done(c) => {
                link.heard = true;
                if let Some(i) = ctrl.find(c.op_context) {
                    return recv_ctrl(ctrl, ep, i, c.len);
                }
                // Every matched message, delivered or failed, frees a credit.
                *owed += 1;
                complete(reqs, c.op_context, Ok(Some(c.len)), "receive comm")
            }
            Event::Failed(e) => {
                if let Some(i) = ctrl.find(e.context) {
                    tracing::warn!("receive comm: dropped a bad control message: {e}");
                    return ctrl.repost(ep, i);
                }
                *owed += 1;
                complete(reqs, e.context, Err(completion_err(&e)), "receive comm")
            }
        })?;
        self.post_pending()?;
        if self.owed >= CREDIT_BATCH {
            match send_ctrl(
                &self.ep,
                &self.link.peer,
                &Ctrl::Credit { count: self.owed },
            ) {
                Ok(()) => self.owed = 0,
                Err(e) if e.is_again() => {}
                Err(e) => {
                    return Err(Error::remote(format!(
                        "returning credits to the sender failed: {e}"
                    )))
                }
            }
        }
        Ok(())
    }
}

/// A control message to a receive comm: only `Alive` is expected.
pub(super) fn recv_ctrl(ctrl: &mut CtrlBufs, ep: &Endpoint, i: usize, len: usize) -> Result<()> {
    let msg = Ctrl::decode(ctrl.bytes(i, len));
    ctrl.repost(ep, i)?;
    match msg {
        Ok(Ctrl::Alive) => {}
        Ok(other) => tracing::warn!("receive comm: ignored unexpected control message {other:?}"),
        Err(e) => tracing::warn!("receive comm: ignored a bad control message: {e}"),
    }
    Ok(())
}
