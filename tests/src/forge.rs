//! A raw endpoint that speaks Weft's wire format by hand, to act as a buggy
//! or hostile peer or a third party on the fabric: forged `Conn`s to a
//! listener, forged `Ack`s to a connecting comm, addresses of any length, a
//! whole handshake as a Weft send comm makes it ([`Forger::connect_to`]),
//! and writes with any key, address and immediate ([`Forger::write`]).

use std::cell::Cell;
use std::sync::Arc;

use weft::fabric::{Completion, Domain, Endpoint, FiAddr, Mr, ACCESS_ALL};
use weft::proto::wire::{Ctrl, ListenHandle, CTRL_MAX};
use weft::testing::{frame, unframe, CTRL_HEAD};

/// The hand-driven peer.
#[derive(Debug)]
pub struct Forger {
    // Field order is drop order: the endpoint closes before its buffers go.
    ep: Endpoint,
    _mr: Mr,
    buf: Vec<u8>,
    src_mr: Mr,
    src: Vec<u8>,
    _domain: Arc<Domain>,
    /// The comm id messages are sent to (see [`Forger::aim`]).
    id: Cell<u32>,
    /// The token messages carry (see [`Forger::sign`]).
    token: Cell<u32>,
    /// How long a send waits for the provider to take it before it is given
    /// up (see [`Forger::impatient`]); `None`: until the tests' timeout,
    /// then a panic.
    patience: Cell<Option<std::time::Duration>>,
}

/// The forger's own token (what it signs with unless told otherwise).
const OWN_TOKEN: u32 = 0x5eed_f00d;

/// What a forger learned by connecting to a listener as a send comm.
#[derive(Debug, Clone, Copy)]
pub struct Linked {
    /// The receive comm's endpoint in the forger's AV.
    pub to: FiAddr,
    /// The receive comm's id there.
    pub id: u32,
    /// The receive comm's token.
    pub token: u32,
}

/// Bytes of the forger's registered source buffer for writes.
pub const WRITE_MAX: usize = 1 << 20;

impl Forger {
    /// Opens an endpoint on `provider`'s loopback domain (opened for RMA,
    /// as the rdma protocol opens it) with one control receive posted.
    pub fn open(provider: &str) -> Self {
        Self::open_on(crate::loopback_domain_for(provider, true).expect("forger domain"))
    }

    /// [`Forger::open`] on a domain of the caller's choosing (another
    /// host's rail, say).
    pub fn open_on(domain: Arc<Domain>) -> Self {
        let ep = Endpoint::open_own(&domain).expect("forger endpoint");
        let buf = vec![0u8; CTRL_HEAD + CTRL_MAX + 8192];
        // SAFETY: `buf` lives, unmoved, as long as the registration (both
        // are fields of the forger, dropped after the endpoint).
        let mr = unsafe { Mr::register(&domain, buf.as_ptr(), buf.len(), ACCESS_ALL) }
            .expect("forger registration");
        let src = vec![0xEEu8; WRITE_MAX];
        // SAFETY: as above.
        let src_mr = unsafe { Mr::register(&domain, src.as_ptr(), src.len(), ACCESS_ALL) }
            .expect("forger source registration");
        let f = Self {
            ep,
            _mr: mr,
            buf,
            src_mr,
            src,
            _domain: domain,
            id: Cell::new(0),
            token: Cell::new(OWN_TOKEN),
            patience: Cell::new(None),
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
    /// a Conn names).
    pub fn aim(&self, id: u32) {
        self.id.set(id);
    }

    /// Sends from now on carry `token` (as if from the comm that has it).
    pub fn sign(&self, token: u32) {
        self.token.set(token);
    }

    /// Speaks again as itself to the receive comm it connected to.
    pub fn as_itself(&self, linked: &Linked) {
        self.aim(linked.id);
        self.sign(OWN_TOKEN);
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
    /// Whether the provider took it (always, unless [`Forger::impatient`]).
    pub fn send_while(&self, to: FiAddr, msg: &Ctrl, progress: impl FnMut()) -> bool {
        let b = frame(self.id.get(), self.token.get(), msg);
        self.inject_while(to, &b, progress)
    }

    /// Injects `bytes` as they are (an untagged message) to `to`; whether
    /// the provider took them (always, unless [`Forger::impatient`]).
    pub fn inject_while(&self, to: FiAddr, bytes: &[u8], progress: impl FnMut()) -> bool {
        self.retry("fi_inject", || self.ep.inject(bytes, to), progress)
    }

    /// Injects `bytes` with remote CQ data `data` (untagged, or tagged with
    /// `tag`), as no Weft peer ever sends.
    pub fn inject_data_while(
        &self,
        to: FiAddr,
        bytes: &[u8],
        data: u64,
        tag: Option<u64>,
        progress: impl FnMut(),
    ) {
        let send = || match tag {
            None => self.ep.injectdata(bytes, data, to),
            Some(t) => self.ep.tinjectdata(bytes, data, to, t),
        };
        self.retry("fi_injectdata", send, progress);
    }

    /// Calls `send` until the provider takes it, reading the forger's CQ
    /// and calling `progress` between tries; whether it was taken (false
    /// only when impatient).
    fn retry(
        &self,
        what: &str,
        mut send: impl FnMut() -> Result<(), weft::fabric::FiError>,
        mut progress: impl FnMut(),
    ) -> bool {
        let mut c = [Completion::default(); 4];
        self.until(what, || {
            match send() {
                Ok(()) => return Some(()),
                Err(e) if e.is_again() => {}
                Err(e) => panic!("forger {what}: {e}"),
            }
            let _ = self.ep.cq().read(&mut c);
            progress();
            None
        })
        .is_some()
    }

    /// From now on a send the provider does not take within `d` is given up
    /// silently (a third party aiming at peers that may have died: rxm
    /// refuses sends to them for ever).
    pub fn impatient(&self, d: std::time::Duration) {
        self.patience.set(Some(d));
    }

    /// [`crate::poll_until`], or, when impatient, `None` after the patience.
    fn until<T>(&self, what: &str, mut step: impl FnMut() -> Option<T>) -> Option<T> {
        let Some(d) = self.patience.get() else {
            return Some(crate::poll_until(what, step));
        };
        let start = std::time::Instant::now();
        while start.elapsed() < d {
            if let Some(v) = step() {
                return Some(v);
            }
            std::thread::yield_now();
        }
        None
    }

    /// The next control message that arrives (polls once; `None` if none).
    pub fn try_recv(&self) -> Option<Ctrl> {
        self.try_recv_framed().map(|(_, _, m)| m)
    }

    /// [`Forger::try_recv`] with the header: the comm id it names and the
    /// sending comm's token.
    pub fn try_recv_framed(&self) -> Option<(u32, u32, Ctrl)> {
        let mut c = [Completion::default(); 1];
        match self.ep.cq().read(&mut c) {
            Ok(1) => {
                let msg = unframe(&self.buf[..c[0].len])
                    .and_then(|(id, t, b)| Some((id, t, Ctrl::decode(b).ok()?)));
                self.post();
                msg
            }
            _ => None,
        }
    }

    /// Connects to the listener of `handle` the way a Weft send comm does
    /// (`Conn`, the `Ack`, a first `Alive`), calling `progress` (the host's
    /// `accept`) until it is answered. From then on, messages go to the new
    /// receive comm, signed with this forger's own token.
    pub fn connect_to(&self, handle: &ListenHandle, mut progress: impl FnMut()) -> Linked {
        let listener = self.peer(&handle.addr);
        self.aim(handle.id);
        let conn = 0xC0FF_EE00 ^ u64::from(self.token.get());
        let msg = Ctrl::Conn {
            listener: handle.nonce,
            conn,
            id: 77,
            addr: self.name(),
        };
        self.sign(OWN_TOKEN);
        self.send_while(listener, &msg, &mut progress);
        let (id, token, addr) = crate::poll_until("the listener's Ack", || {
            progress();
            match self.try_recv_framed() {
                Some((
                    _,
                    token,
                    Ctrl::Ack {
                        conn: c, id, addr, ..
                    },
                )) if c == conn => Some((id, token, addr)),
                _ => None,
            }
        });
        let to = self.peer(&addr);
        self.aim(id);
        self.send_while(to, &Ctrl::Alive, &mut progress);
        Linked { to, id, token }
    }

    /// Writes `len` bytes of 0xEE from its own buffer to `addr` with `key` at
    /// `to`, with immediate `imm`; waits for the outcome (`Err`: the
    /// provider refused it, at either end), calling `progress` meanwhile.
    pub fn write(
        &self,
        to: FiAddr,
        len: usize,
        addr: u64,
        key: u64,
        imm: u64,
        progress: impl FnMut(),
    ) -> Result<(), String> {
        assert!(len <= WRITE_MAX);
        let ctx = 0x77usize as *mut libc::c_void;
        // SAFETY: the source is `len` registered bytes owned by the forger,
        // which outlives the endpoint; the remote range is whatever the test
        // names (that is the point).
        let post = || unsafe {
            self.ep.writedata(
                self.src.as_ptr(),
                len,
                self.src_mr.desc(),
                Some(imm),
                to,
                addr,
                key,
                ctx,
            )
        };
        self.post_and_wait("the write", ctx, post, progress)
    }

    /// Sends `len` bytes of 0xEE as a *tagged* message with `tag` to `to`
    /// (data no Weft peer sends under rdma) and waits for the outcome,
    /// calling `progress` meanwhile.
    pub fn tsend(
        &self,
        to: FiAddr,
        len: usize,
        tag: u64,
        progress: impl FnMut(),
    ) -> Result<(), String> {
        assert!(len <= WRITE_MAX);
        let ctx = 0x78usize as *mut libc::c_void;
        // SAFETY: the source is `len` registered bytes owned by the forger,
        // which outlives the endpoint.
        let post = || unsafe {
            self.ep
                .tsend(self.src.as_ptr(), len, self.src_mr.desc(), to, tag, ctx)
        };
        self.post_and_wait("the tagged send", ctx, post, progress)
    }

    /// Sends `bytes` as they are (an untagged message of any size, e.g. a
    /// control message larger than the receiver's buffers) to `to` and
    /// waits for the outcome, calling `progress` meanwhile.
    pub fn send_bytes(
        &mut self,
        to: FiAddr,
        bytes: &[u8],
        progress: impl FnMut(),
    ) -> Result<(), String> {
        assert!(bytes.len() <= WRITE_MAX);
        self.src[..bytes.len()].copy_from_slice(bytes);
        let ctx = 0x79usize as *mut libc::c_void;
        // SAFETY: the source is registered bytes owned by the forger, which
        // outlives the endpoint, unchanged until the completion.
        let post = || unsafe {
            self.ep
                .send(self.src.as_ptr(), bytes.len(), self.src_mr.desc(), to, ctx)
        };
        let out = self.post_and_wait("the send", ctx, post, progress);
        self.src[..bytes.len()].fill(0xEE);
        out
    }

    /// Posts an operation with `post` until the provider takes it, then
    /// waits for its outcome ([`Forger::wait_for`]), calling `progress`
    /// between tries.
    fn post_and_wait(
        &self,
        what: &str,
        ctx: *mut libc::c_void,
        mut post: impl FnMut() -> Result<(), weft::fabric::FiError>,
        mut progress: impl FnMut(),
    ) -> Result<(), String> {
        let posted = self.until(what, || match post() {
            Ok(()) => Some(()),
            Err(e) if e.is_again() => {
                progress();
                None
            }
            Err(e) => panic!("forger, {what}: {e}"),
        });
        if posted.is_none() {
            return Err(format!("{what}: the provider took nothing (gave up)"));
        }
        self.wait_for(ctx, what, progress)
    }

    /// Reads the forger's CQ until the operation posted with `ctx` ends
    /// (control messages that arrive meanwhile are dropped and their
    /// receive posted again), for at most 10 s.
    fn wait_for(
        &self,
        ctx: *mut libc::c_void,
        what: &str,
        mut progress: impl FnMut(),
    ) -> Result<(), String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut c = [Completion::default(); 1];
        loop {
            match self.ep.cq().read(&mut c) {
                Ok(1) if c[0].op_context == ctx => return Ok(()),
                Ok(1) => self.post(),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
            if std::time::Instant::now() > deadline {
                return Err(format!("{what} never completed"));
            }
            progress();
        }
    }
}
