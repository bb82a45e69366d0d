//! The sending side: the connecting half of the handshake, credits coming
//! back, and the send data path.

use super::*;

/// A sending comm (also the state of a `connect` in progress).
pub struct SendComm {
    pub(crate) dev: Arc<DeviceState>,
    /// NCCL's traffic class for this connection (-1: undefined). Kept; no
    /// provider in use here applies one.
    pub traffic_class: i32,
    /// The nonce of the listener it connects to (from NCCL's handle).
    pub(super) listener_nonce: u64,
    pub(super) inner: Mutex<SendState>,
}

pub(super) struct SendState {
    pub(super) ep: Endpoint,
    pub(super) ctrl: CtrlBufs,
    pub(super) reqs: Pool<Request>,
    /// The handshake (see [`Connecting`]).
    pub(super) connect: Connecting,
    pub(super) listener: Peer,
    pub(super) listener_nonce: u64,
    pub(super) link: Link,
    pub(super) credits: u32,
    pub(super) max_credits: u32,
    pub(super) eager: usize,
}

impl std::fmt::Debug for SendComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SendComm(dev {})", self.dev.index)
    }
}

impl SendComm {
    /// Starts connecting to the listener named by `handle`.
    pub fn start(dev: Arc<DeviceState>, handle: &ListenHandle, traffic_class: i32) -> Result<Self> {
        let ep = open_endpoint(&dev)?;
        let ctrl = CtrlBufs::new(&dev, &ep, CTRL_POSTED, false)?;
        let listener = Peer::insert(&ep, &handle.addr).map_err(|e| {
            if e.code == fi::FI_ENOTCONN {
                Error::remote(format!("connect: the listener is gone: {e}"))
            } else {
                Error::internal(format!("the handle's listener address is unusable: {e}"))
            }
        })?;
        let reqs = Pool::new(MAX_REQUESTS * MAX_RECVS).map_err(|e| Error::system(e.to_string()))?;
        let eager = dev.eager_size.min(dev.dev.inject_size);
        let connect = Connecting::new(
            nonce(),
            Instant::now(),
            heartbeat_period(dev.peer_timeout),
            dev.peer_timeout,
        );
        Ok(Self {
            dev,
            traffic_class,
            listener_nonce: handle.nonce,
            inner: Mutex::new(SendState {
                ep,
                ctrl,
                reqs,
                connect,
                listener,
                listener_nonce: handle.nonce,
                link: Link::new(),
                credits: 0,
                max_credits: 0,
                eager,
            }),
        })
    }
}

impl Sender for SendComm {
    fn listener_nonce(&self) -> u64 {
        self.listener_nonce
    }

    fn step_connect(&self) -> Result<bool> {
        let mut st = lock(&self.inner);
        handshake::connect_step(
            &mut *st,
            |st| &mut st.connect,
            |st| {
                let msg = Ctrl::Conn {
                    listener: st.listener_nonce,
                    conn: st.connect.conn(),
                    id: 0,
                    addr: st.ep.name()?,
                };
                send_ctrl(&st.ep, &st.listener, &msg)
            },
            SendState::progress,
            self.dev.peer_timeout,
        )
    }

    /// `Ok(None)` when out of credits or requests, or while another
    /// thread holds the comm.
    unsafe fn isend(
        &self,
        data: *const u8,
        size: usize,
        tag: i32,
        desc: *mut c_void,
        phandle: *mut c_void,
    ) -> Result<Option<ReqId>> {
        let Some(mut st) = try_lock(&self.inner) else {
            return Ok(None);
        };
        if st.connect.phase() != Phase::Ready {
            return Err(Error::internal(
                "isend on a comm whose connect has not finished",
            ));
        }
        st.link.check()?;
        if st.credits == 0 {
            st.progress()?;
            if st.credits == 0 {
                return Ok(None);
            }
        }
        let mut req = Request {
            kind: Kind::Send,
            n: 1,
            remaining: 1,
            sizes: [0; MAX_RECVS],
            bufs: [RecvBuf::EMPTY; MAX_RECVS],
            err: None,
        };
        req.sizes[0] = size;
        req.bufs[0] = RecvBuf {
            data: data.cast_mut(),
            size,
            tag,
            desc,
            key: 0,
            base: 0,
            phandle,
        };
        let inject = size <= st.eager;
        if inject {
            req.remaining = 0;
        }
        let Some((ptr, idx)) = st.reqs.insert(req) else {
            st.progress()?;
            return Ok(None);
        };
        let tag = u64::from(tag as u32);
        let SendState { ep, link, .. } = &*st;
        let posted = if inject {
            // SAFETY: NCCL guarantees `data..data+size` is readable (checked
            // against its registration by the caller); fi_tinject copies it now.
            let bytes = unsafe { std::slice::from_raw_parts(data, size) };
            link.peer.send("fi_tinject", |a| ep.tinject(bytes, a, tag))
        } else {
            link.peer.send("fi_tsend", |a| {
                // SAFETY: the buffer stays valid until NCCL sees the request
                // done, which is after its completion; ptr is this request's slot.
                unsafe { ep.tsend(data, size, desc, a, tag, ptr.as_ptr().cast()) }
            })
        };
        match posted {
            Ok(()) => {
                st.credits -= 1;
                Ok(Some(ReqId {
                    slot: idx,
                    gen: st.reqs.gen(idx),
                }))
            }
            Err(e) => {
                st.reqs.release(idx);
                if e.is_again() {
                    st.progress()?;
                    Ok(None)
                } else {
                    Err(Error::remote(format!("isend of {size} bytes failed: {e}")))
                }
            }
        }
    }
}

impl Locked for SendComm {
    type State = SendState;
    fn device(&self) -> &Arc<DeviceState> {
        &self.dev
    }
    fn state(&self) -> &Mutex<SendState> {
        &self.inner
    }
}

impl Side for SendState {
    const WHAT: &'static str = "send comm to";
    const KIND: &'static str = "send";
    fn linked(&self) -> bool {
        self.connect.phase() == Phase::Ready
    }
    fn parts(&mut self) -> (&mut Endpoint, &mut Pool<Request>, &mut Link) {
        (&mut self.ep, &mut self.reqs, &mut self.link)
    }
    fn progress(&mut self) -> Result<()> {
        SendState::progress(self)
    }
}

impl SendState {
    pub(super) fn progress(&mut self) -> Result<()> {
        self.ctrl.repost_waiting(&self.ep)?;
        let cq = Arc::clone(self.ep.cq());
        drain(&*cq, |ev| match ev {
            Event::Done(c) if c.flags & u64::from(fi::FI_RECV) != 0 => {
                self.link.heard = true;
                self.on_ctrl(c)
            }
            Event::Done(c) => complete(&mut self.reqs, c.op_context, Ok(None), "send comm"),
            Event::Failed(e) => match self.ctrl.find(e.context) {
                Some(i) => {
                    tracing::warn!("send comm: dropped a bad control message: {e}");
                    self.ctrl.repost(&self.ep, i)
                }
                None => complete(
                    &mut self.reqs,
                    e.context,
                    Err(completion_err(&e)),
                    "send comm",
                ),
            },
        })
    }

    pub(super) fn on_ctrl(&mut self, comp: &Completion) -> Result<()> {
        let Some(i) = self.ctrl.find(comp.op_context) else {
            return Err(Error::system(
                "send comm: completion for an unknown control buffer",
            ));
        };
        let msg = Ctrl::decode(self.ctrl.bytes(i, comp.len));
        self.ctrl.repost(&self.ep, i)?;
        match msg {
            Ok(Ctrl::Credit { count }) if self.connect.phase() == Phase::Ready => {
                // A peer can never grant more than it announced.
                self.credits = self.credits.saturating_add(count).min(self.max_credits);
            }
            Ok(Ctrl::Alive) => {}
            Ok(Ctrl::Ack {
                conn,
                credits,
                addr,
                ..
            }) if self.connect.takes_ack(conn) => {
                if let Err(e) = self.link.connect(&self.ep, &addr) {
                    tracing::warn!("send comm: ignored an Ack with an unusable address: {e}");
                    return Ok(());
                }
                self.max_credits = credits.clamp(1, CREDITS);
                self.credits = self.max_credits;
                self.connect.connected();
                // The first Alive confirms the connection to `accept`; when
                // the provider is busy the keeper sends it on its next tick.
                match send_ctrl(&self.ep, &self.link.peer, &Ctrl::Alive) {
                    Ok(()) => self.link.last_said = Some(Instant::now()),
                    Err(e) if e.is_again() => {}
                    Err(e) => {
                        return Err(Error::remote(format!(
                            "connect: cannot reach the accepting peer {}: {e}",
                            self.link.name
                        )))
                    }
                }
            }
            Ok(other) => tracing::warn!("send comm: ignored unexpected control message {other:?}"),
            Err(e) => tracing::warn!("send comm: ignored a bad control message: {e}"),
        }
        Ok(())
    }
}
