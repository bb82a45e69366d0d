//! A raw endpoint that speaks Weft's control messages by hand, to act as a
//! buggy or hostile peer: forged `Conn`s to a listener, forged `Ack`s to a
//! connecting comm, addresses of any length.

use std::cell::Cell;
use std::sync::Arc;

use weft::fabric::{Completion, Domain, Endpoint, FiAddr, Mr, ACCESS_ALL};
use weft::proto::wire::{Ctrl, CTRL_MAX};
use weft::proto::{frame, unframe, CTRL_ID};

/// The hand-driven peer.
#[derive(Debug)]
pub struct Forger {
    // Field order is drop order: the endpoint closes before its buffer goes.
    ep: Endpoint,
    _mr: Mr,
    buf: Vec<u8>,
    _domain: Arc<Domain>,
    /// The comm id messages are sent to (see [`Forger::aim`]).
    id: Cell<u32>,
}

impl Forger {
    /// Opens an endpoint on `provider`'s loopback domain with one control
    /// receive posted.
    pub fn open(provider: &str) -> Self {
        let domain = crate::loopback_domain(provider).expect("forger domain");
        let ep = Endpoint::open_own(&domain).expect("forger endpoint");
        let buf = vec![0u8; CTRL_ID + CTRL_MAX];
        // SAFETY: `buf` lives, unmoved, as long as the registration (both
        // are fields of the forger, dropped after the endpoint).
        let mr = unsafe { Mr::register(&domain, buf.as_ptr(), buf.len(), ACCESS_ALL) }
            .expect("forger registration");
        let f = Self {
            ep,
            _mr: mr,
            buf,
            _domain: domain,
            id: Cell::new(0),
        };
        f.post();
        f
    }

    fn post(&self) {
        // SAFETY: the buffer and its registration outlive the endpoint.
        unsafe {
            self.ep.recv(
                self.buf.as_ptr().cast_mut(),
                self.buf.len(),
                self._mr.desc(),
                libfabric_sys::FI_ADDR_UNSPEC,
                std::ptr::null_mut(),
            )
        }
        .expect("forger control receive");
    }

    /// Sends from now on go to comm `id` at their peer (the id a handle or
    /// a Conn names; 0 where each endpoint has one comm).
    pub fn aim(&self, id: u32) {
        self.id.set(id);
    }

    /// This endpoint's name (a valid address to put in messages).
    pub fn name(&self) -> Vec<u8> {
        self.ep.name().expect("forger name")
    }

    /// Inserts a peer's name.
    pub fn peer(&self, name: &[u8]) -> FiAddr {
        self.ep.av().insert(name).expect("forger av insert")
    }

    /// Sends `msg` to `to`, retrying while the provider is busy.
    pub fn send(&self, to: FiAddr, msg: &Ctrl) {
        self.send_while(to, msg, || {});
    }

    /// [`Forger::send`], calling `progress` between tries (the receiving
    /// side in this process must make progress for shm to take the message).
    pub fn send_while(&self, to: FiAddr, msg: &Ctrl, mut progress: impl FnMut()) {
        let b = frame(self.id.get(), msg);
        let mut c = [Completion::default(); 4];
        crate::poll_until("forger send", || {
            match self.ep.inject(&b, to) {
                Ok(()) => return Some(()),
                Err(e) if e.is_again() => {}
                Err(e) => panic!("forger send: {e}"),
            }
            let _ = self.ep.cq().read(&mut c);
            progress();
            None
        });
    }

    /// The next control message that arrives (polls once; `None` if none).
    pub fn try_recv(&self) -> Option<Ctrl> {
        let mut c = [Completion::default(); 1];
        match self.ep.cq().read(&mut c) {
            Ok(1) => {
                let msg = unframe(&self.buf[..c[0].len]).and_then(|(_, b)| Ctrl::decode(b).ok());
                self.post();
                msg
            }
            _ => None,
        }
    }
}
