//! The accepting side of the handshake: listeners, pending handshakes and
//! their bounds.

use super::*;

/// A listening comm.
pub struct ListenComm {
    pub(crate) dev: Arc<DeviceState>,
    pub(super) nonce: u64,
    pub(super) inner: Mutex<ListenState>,
}

/// A connection being accepted: its receive comm and, until sent, its Ack.
pub(super) type Pending = handshake::Pending<Arc<RecvComm>, Ctrl>;

pub(super) struct ListenState {
    // Field order is drop order: the endpoint closes before its buffers go.
    pub(super) ep: Endpoint,
    pub(super) ctrl: CtrlBufs,
    /// The handshakes in progress and what is remembered of finished ones.
    pub(super) book: Handshakes<Arc<RecvComm>, Ctrl>,
}

impl std::fmt::Debug for ListenComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ListenComm(dev {})", self.dev.index)
    }
}

impl ListenComm {
    /// Opens a listener on `dev` and returns it with its handle.
    pub fn open(dev: Arc<DeviceState>) -> Result<(Self, ListenHandle)> {
        let ep = open_endpoint(&dev)?;
        let ctrl = CtrlBufs::new(&dev, &ep, CTRL_POSTED, false)?;
        let handle = ListenHandle {
            nonce: nonce(),
            addr: ep.name()?,
            id: 0,
            proto: super::super::wire::PROTO_SENDRECV,
        };
        Ok((
            Self {
                dev,
                nonce: handle.nonce,
                inner: Mutex::new(ListenState {
                    ep,
                    ctrl,
                    book: Handshakes::default(),
                }),
            },
            handle,
        ))
    }

    /// Handles one handshake message: a valid Conn opens a receive comm
    /// whose Ack is sent by `accept`; anything else is logged and dropped.
    pub(super) fn on_conn(&self, st: &mut ListenState, comp: &Completion) -> Result<()> {
        let Some(i) = st.ctrl.find(comp.op_context) else {
            return Err(Error::internal(
                "listener: completion for an unknown buffer",
            ));
        };
        let msg = Ctrl::decode(st.ctrl.bytes(i, comp.len));
        st.ctrl.repost(&st.ep, i)?;
        let dev = self.dev.index;
        match msg {
            Ok(Ctrl::Conn {
                listener,
                conn,
                addr,
                ..
            }) if listener == self.nonce => {
                if st.book.knows(conn) {
                    tracing::debug!("listener on device {dev}: ignored a repeated Conn");
                    return Ok(());
                }
                if let Some(check) = self.dev.domain.check_addr(&addr).err() {
                    tracing::warn!(
                        "listener on device {dev}: dropped a connection request with an unusable address: {check}"
                    );
                    return Ok(());
                }
                let comm = Arc::new(RecvComm::open(Arc::clone(&self.dev))?);
                let name = {
                    let rs = &mut *lock(&comm.inner);
                    if let Err(e) = rs.link.connect(&rs.ep, &addr) {
                        tracing::warn!(
                            "listener on device {dev}: dropped a connection request with an unusable address: {e}"
                        );
                        return Ok(());
                    }
                    rs.ep.name()?
                };
                st.book.admit_logged(
                    Pending {
                        comm,
                        conn,
                        ack: Some(Ctrl::Ack {
                            conn,
                            credits: CREDITS,
                            eager: 0,
                            id: 0,
                            addr: name,
                        }),
                        deadline: Instant::now() + self.dev.peer_timeout,
                    },
                    dev,
                );
            }
            other => handshake::ignored_at_listener(dev, other),
        }
        Ok(())
    }

    /// One step of pending handshake `p`: sends its Ack when due, lets its
    /// endpoint progress, and says whether the peer confirmed, or why it
    /// failed or expired.
    pub(super) fn step_pending(&self, p: &mut Pending, now: Instant) -> Step {
        let rs = &mut *lock(&p.comm.inner);
        if let Some(ack) = &p.ack {
            match send_ctrl(&rs.ep, &rs.link.peer, ack) {
                Ok(()) => p.ack = None,
                Err(e) if e.is_again() => {}
                Err(e) => {
                    return Step::Failed(format!(
                        "accept: cannot answer the connecting peer {}: {e}",
                        rs.link.name
                    ))
                }
            }
        }
        // Let the new endpoint make progress on its connection.
        if let Err(e) = rs.progress() {
            return Step::Failed(format!(
                "accept: handshake with {} failed: {e}",
                rs.link.name
            ));
        }
        let answered = p.ack.is_none();
        if answered && rs.link.heard {
            return Step::Confirmed;
        }
        if now > p.deadline {
            let stage = if answered {
                "never confirmed the connection"
            } else {
                "could not be answered"
            };
            return Step::Failed(format!(
                "accept: the connecting peer {} {stage} within {:.1} s (WEFT_PEER_TIMEOUT): its process died or hangs",
                rs.link.name,
                self.dev.peer_timeout.as_secs_f64()
            ));
        }
        Step::Waiting
    }

    /// One accept step: a receive comm when a connection is complete. A
    /// handshake that fails or expires is dropped with a warning, and the
    /// others carry on; `accept` reports the failure only when nothing else
    /// is pending (NCCL connects one peer per listener, so that peer died).
    pub(super) fn accept_comm(&self) -> Result<Option<Arc<RecvComm>>> {
        let mut st = lock(&self.inner);
        let st = &mut *st;
        st.ctrl.repost_waiting(&st.ep)?;
        let cq = Arc::clone(st.ep.cq());
        drain(&*cq, |ev| match ev {
            Event::Done(comp) => self.on_conn(st, comp),
            Event::Failed(e) => {
                // A control receive failed (e.g. an oversized message):
                // nothing of ours is lost; repost and carry on.
                tracing::warn!(
                    "listener on device {}: dropped a bad handshake message: {e}",
                    self.dev.index
                );
                match st.ctrl.find(e.context) {
                    Some(i) => st.ctrl.repost(&st.ep, i),
                    None => Ok(()),
                }
            }
        })?;
        let now = Instant::now();
        st.book
            .step_all(|p| self.step_pending(p, now), |why| tracing::warn!("{why}"))
            .map_err(Error::remote)
    }
}

impl Listener for ListenComm {
    fn accept(&self) -> Result<Option<Arc<dyn Receiver>>> {
        Ok(self.accept_comm()?.map(|c| -> Arc<dyn Receiver> { c }))
    }
}
