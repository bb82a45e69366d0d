//! The two transports measured side by side: raw libfabric (tagged, or RMA
//! writes) and Weft through its exported table; connecting and closing them.

use super::*;

/// A request of either transport.
#[derive(Debug, Clone, Copy)]
pub(super) enum Req {
    Raw(usize),
    Weft(*mut c_void),
}

/// Registered memory: one buffer, usable by both transports.
pub(super) struct Buf {
    pub(super) data: Vec<u8>,
    pub(super) raw: Option<Mr>,
    /// Weft memory handles on (send comm, receive comm).
    pub(super) weft: (*mut c_void, *mut c_void),
}

impl Buf {
    pub(super) fn ptr(&self, off: usize) -> *mut u8 {
        self.data.as_ptr().wrapping_add(off).cast_mut()
    }
}

/// What a round needs from a transport: post, and poll for completion.
pub(super) trait Transport {
    fn send(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req>;
    fn recv(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req>;
    /// Progress; true once `r` is done (it is then released).
    fn done(&mut self, r: Req) -> Res<bool>;
}

pub(super) fn wait_all(t: &mut dyn Transport, reqs: &[Req]) -> Res<()> {
    let mut pending: Vec<Req> = reqs.to_vec();
    let start = Instant::now();
    while !pending.is_empty() {
        let mut i = 0;
        while i < pending.len() {
            if t.done(pending[i])? {
                pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if start.elapsed() > Duration::from_secs(120) {
            return Err(format!("{} requests not done after 120 s", pending.len()));
        }
    }
    Ok(())
}

/// Raw libfabric: one RDM endpoint, tagged messages to one peer; with
/// `--raw-split`, a second endpoint for receiving (one per direction, as
/// Weft's send and receive comms have). In `rma` mode, data, pings and
/// pongs are `fi_writedata`s instead.
pub(super) struct Raw {
    pub(super) domain: Arc<Domain>,
    pub(super) ep: Endpoint,
    pub(super) peer: FiAddr,
    /// The receiving endpoint and the peer's sending address, when split.
    pub(super) rx: Option<(Endpoint, FiAddr)>,
    /// Completion seen, by context index.
    pub(super) done: Vec<bool>,
    pub(super) free: Vec<usize>,
    /// Writes instead of tagged messages (except "go").
    pub(super) rma: bool,
    /// Where the peer's buffer for each tag is: (address or 0 where the
    /// provider addresses by offset, key).
    pub(super) remote: [(u64, u64); 5],
    /// Writes landed per tag, receives asked per tag, and the receives
    /// waiting: (context index, tag, the landed count that completes it).
    pub(super) landed: [u64; 5],
    pub(super) asked: [u64; 5],
    pub(super) waiting: Vec<(usize, usize, u64)>,
}

impl Raw {
    pub(super) fn open(provider: &str, split: bool) -> Res<Self> {
        let domain = weft_tests::loopback_domain_for(provider, true)?;
        let open = || Endpoint::open_own(&domain).map_err(|e| e.to_string());
        let ep = open()?;
        let rx = if split {
            Some((open()?, libfabric_sys::FI_ADDR_NOTAVAIL))
        } else {
            None
        };
        Ok(Self {
            domain,
            ep,
            rx,
            peer: libfabric_sys::FI_ADDR_NOTAVAIL,
            done: Vec::new(),
            free: Vec::new(),
            rma: false,
            remote: [(0, 0); 5],
            landed: [0; 5],
            asked: [0; 5],
            waiting: Vec::new(),
        })
    }

    /// The address a peer writes buffer `b` at: its virtual address, or 0
    /// where the provider addresses registrations by offset.
    pub(super) fn base(&self, b: &Buf) -> u64 {
        let virt = self.domain.mr_mode() & libfabric_sys::FI_MR_VIRT_ADDR != 0;
        if virt {
            b.ptr(0) as u64
        } else {
            0
        }
    }

    pub(super) fn slot(&mut self) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.done[i] = false;
                i
            }
            None => {
                self.done.push(false);
                self.done.len() - 1
            }
        }
    }

    pub(super) fn progress(&mut self) -> Res<()> {
        let mut c = [Completion::default(); 16];
        for ep in std::iter::once(&self.ep).chain(self.rx.as_ref().map(|r| &r.0)) {
            loop {
                let n = ep.cq().read(&mut c).map_err(|e| format!("raw cq: {e:?}"))?;
                for comp in &c[..n] {
                    if weft::fabric::is_remote_write(comp) {
                        let tag = (comp.data as usize).min(4);
                        self.landed[tag] += 1;
                        let landed = self.landed;
                        let done = &mut self.done;
                        self.waiting.retain(|&(i, t, want)| {
                            let arrived = landed[t] >= want;
                            done[i] |= arrived;
                            !arrived
                        });
                    } else {
                        self.done[comp.op_context as usize - 1] = true;
                    }
                }
                if n < c.len() {
                    break;
                }
            }
        }
        Ok(())
    }
}

impl Raw {
    /// Posts one operation (`op` gets the context), progressing while the
    /// provider says FI_EAGAIN.
    pub(super) fn post(
        &mut self,
        what: &str,
        op: impl Fn(&Self, *mut c_void) -> Result<(), weft::fabric::FiError>,
    ) -> Res<Req> {
        let i = self.slot();
        loop {
            match op(self, (i + 1) as *mut c_void) {
                Ok(()) => return Ok(Req::Raw(i)),
                Err(e) if e.is_again() => self.progress()?,
                Err(e) => return Err(format!("{what}: {e}")),
            }
        }
    }
}

impl Transport for Raw {
    fn send(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req> {
        let desc = b.raw.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
        if self.rma && !matches!(tag, Tag::Go) {
            let (base, key) = self.remote[tag as usize];
            return self.post("fi_writedata", |r, ctx| {
                // SAFETY: as for a tagged send; the remote range is the
                // peer's registered buffer for this tag, at the same offset.
                unsafe {
                    r.ep.writedata(
                        b.ptr(off),
                        size,
                        desc,
                        tag as u64,
                        r.peer,
                        base + off as u64,
                        key,
                        ctx,
                    )
                }
            });
        }
        self.post("fi_tsend", |r, ctx| {
            // SAFETY: the buffer outlives the request (rounds wait for every
            // request before their buffers go); the context is a plain index.
            unsafe { r.ep.tsend(b.ptr(off), size, desc, r.peer, tag as u64, ctx) }
        })
    }

    fn recv(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req> {
        let desc = b.raw.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
        if self.rma && !matches!(tag, Tag::Go) {
            // The peer writes into `b` at `off`: this receive is the next
            // write of its tag to land.
            let i = self.slot();
            let t = tag as usize;
            self.asked[t] += 1;
            if self.landed[t] >= self.asked[t] {
                self.done[i] = true;
            } else {
                self.waiting.push((i, t, self.asked[t]));
            }
            return Ok(Req::Raw(i));
        }
        self.post("fi_trecv", |r, ctx| {
            let (ep, from) = r.rx.as_ref().map_or((&r.ep, r.peer), |x| (&x.0, x.1));
            // SAFETY: as for send.
            unsafe { ep.trecv(b.ptr(off), size, desc, from, tag as u64, 0, ctx) }
        })
    }

    fn done(&mut self, r: Req) -> Res<bool> {
        let Req::Raw(i) = r else {
            return Err("a Weft request on the raw transport".into());
        };
        if !self.done[i] {
            self.progress()?;
        }
        if self.done[i] {
            self.free.push(i);
            return Ok(true);
        }
        Ok(false)
    }
}

/// Weft through an exported table: a send comm to the peer and a receive
/// comm from it.
pub(super) struct Weft {
    pub(super) net: Box<dyn Net>,
    pub(super) ctx: *mut c_void,
    pub(super) send: *mut c_void,
    pub(super) recv: *mut c_void,
}

/// Calls `post` until it hands out a request (NULL means "retry later").
pub(super) fn until_req(what: &str, mut post: impl FnMut(&mut *mut c_void) -> c_int) -> Res<Req> {
    let mut req: *mut c_void = std::ptr::null_mut();
    while req.is_null() {
        rc(what, post(&mut req))?;
    }
    Ok(Req::Weft(req))
}

impl Transport for Weft {
    fn send(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req> {
        let (net, comm) = (&self.net, self.send);
        until_req("isend", |req| {
            // SAFETY: NCCL's contract: a live comm, a registered buffer that
            // outlives the request, a valid out pointer.
            unsafe { net.isend(comm, b.ptr(off).cast(), size, tag as c_int, b.weft.0, req) }
        })
    }

    fn recv(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req> {
        let (net, comm) = (&self.net, self.recv);
        until_req("irecv", |req| {
            // SAFETY: as for send; one buffer per receive.
            unsafe {
                net.irecv(
                    comm,
                    &mut [b.ptr(off).cast()],
                    &[size],
                    &mut [tag as c_int],
                    &mut [b.weft.1],
                    req,
                )
            }
        })
    }

    fn done(&mut self, r: Req) -> Res<bool> {
        let Req::Weft(q) = r else {
            return Err("a raw request on the Weft transport".into());
        };
        let (mut done, mut sizes) = (0, [0 as c_int; 8]);
        // SAFETY: `q` is a live request of this table.
        rc("test", unsafe {
            self.net.test(q, &mut done, sizes.as_mut_ptr())
        })?;
        Ok(done == 1)
    }
}

/// Both transports of one process.
pub(super) struct Side {
    pub(super) raw: Raw,
    pub(super) weft: Weft,
}

/// A process's buffers: data slots, the pong buffer, and a small one for "go".
pub(super) struct Bufs {
    pub(super) data: Buf,
    pub(super) pong: Buf,
    pub(super) small: Buf,
}

impl Bufs {
    pub(super) fn new(side: &Side, size: usize, slots: usize) -> Res<Self> {
        Ok(Self {
            data: side.buf(size * slots)?,
            pong: side.buf(size)?,
            small: side.buf(64)?,
        })
    }

    pub(super) fn free(self, side: &Side) -> Res<()> {
        side.unreg(self.data)?;
        side.unreg(self.pong)?;
        side.unreg(self.small)
    }
}

impl Side {
    /// A buffer of `len` bytes registered with both transports.
    pub(super) fn buf(&self, len: usize) -> Res<Buf> {
        let data = vec![0x5au8; len.max(8)];
        // SAFETY: `data` lives in the returned Buf with its registration, and
        // is deregistered (dropped) before it is freed (field order).
        let raw = unsafe { Mr::register(&self.raw.domain, data.as_ptr(), data.len(), ACCESS_ALL) }
            .map_err(|e| e.to_string())?;
        let (w, mut s, mut r) = (&self.weft, std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: live comms; the buffer outlives its handles (`unreg`).
        unsafe {
            rc(
                "regMr",
                w.net
                    .reg_mr(w.send, data.as_ptr() as *mut c_void, data.len(), &mut s),
            )?;
            rc(
                "regMr",
                w.net
                    .reg_mr(w.recv, data.as_ptr() as *mut c_void, data.len(), &mut r),
            )?;
        }
        Ok(Buf {
            data,
            raw: Some(raw),
            weft: (s, r),
        })
    }

    pub(super) fn unreg(&self, b: Buf) -> Res<()> {
        let w = &self.weft;
        // SAFETY: handles of this side's live comms.
        unsafe {
            rc("deregMr", w.net.dereg_mr(w.send, b.weft.0))?;
            rc("deregMr", w.net.dereg_mr(w.recv, b.weft.1))?;
        }
        Ok(())
    }

    pub(super) fn transport(&mut self, which: &str) -> Res<&mut dyn Transport> {
        self.raw.rma = which == "rma";
        match which {
            "raw" | "rma" => Ok(&mut self.raw),
            "weft" => Ok(&mut self.weft),
            other => Err(format!("unknown transport {other:?}")),
        }
    }
}

/// Opens both transports and connects them to the peer whose hello line is
/// read with `read` after ours is written with `write`.
pub(super) fn connect(
    provider: &str,
    version: u32,
    split: bool,
    lib: &libloading::os::unix::Library,
    mut write: impl FnMut(&str) -> Res<()>,
    mut read: impl FnMut() -> Res<String>,
) -> Res<Side> {
    weft_tests::host::pin_to_loopback(provider);
    let mut raw = Raw::open(provider, split)?;
    let net = emu::net(lib, version);
    let (mut ctx, mut l) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut h = [0u8; 128];
    let mut dev = 0;
    // SAFETY: NCCL's calling convention throughout.
    unsafe {
        rc("init", net.init(&mut ctx))?;
        if std::env::var_os("WEFT_BENCH_VDEV").is_some() {
            dev = match net.make_vdevice(1, &[0]) {
                Some((0, d)) => d,
                other => return Err(format!("makeVDevice({{1, [0]}}): {other:?} (needs v9+)")),
            };
        }
        rc(
            "listen",
            net.listen(ctx, dev, h.as_mut_ptr().cast(), &mut l),
        )?;
    }
    // hello <sending endpoint> <Weft handle> <receiving endpoint>
    let me = raw.ep.name().map_err(|e| e.to_string())?;
    let me_rx = match &raw.rx {
        Some((rx, _)) => rx.name().map_err(|e| e.to_string())?,
        None => me.clone(),
    };
    write(&format!("hello {} {} {}", hex(&me), hex(&h), hex(&me_rx)))?;
    let hello = read()?;
    let w: Vec<&str> = hello.split_whitespace().collect();
    let (Some(&"hello"), Some(a), Some(ph), Some(a_rx)) = (w.first(), w.get(1), w.get(2), w.get(3))
    else {
        return Err(format!("peer said {hello:?}"));
    };
    let insert = |ep: &Endpoint, name: &str| -> Res<FiAddr> {
        ep.av()
            .insert(&unhex(name)?)
            .map_err(|e| format!("peer address: {e}"))
    };
    raw.peer = insert(&raw.ep, a_rx)?;
    if let Some((rx, from)) = &mut raw.rx {
        *from = insert(rx, a)?;
    }
    let mut ph: [u8; 128] = unhex(ph)?
        .try_into()
        .map_err(|_| "peer handle is not 128 bytes")?;
    let (mut s, mut r): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
    let start = Instant::now();
    while s.is_null() || r.is_null() {
        // SAFETY: as above; the handle buffer is the same on every call.
        unsafe {
            if s.is_null() {
                rc(
                    "connect",
                    net.connect(ctx, dev, ph.as_mut_ptr().cast(), &mut s, true),
                )?;
            }
            if r.is_null() {
                rc("accept", net.accept(l, &mut r, true))?;
            }
        }
        if start.elapsed() > Duration::from_secs(120) {
            return Err("connect/accept did not finish in 120 s".into());
        }
    }
    // SAFETY: the listener is no longer needed.
    unsafe { rc("closeListen", net.close_listen(l))? };
    let weft = Weft {
        net,
        ctx,
        send: s,
        recv: r,
    };
    Ok(Side { raw, weft })
}

pub(super) fn close(side: Side, bufs: Option<Bufs>, version: u32) -> Res<()> {
    if let Some(b) = bufs {
        b.free(&side)?;
    }
    let w = &side.weft;
    // SAFETY: live comms and context, closed once.
    unsafe {
        rc("closeSend", w.net.close_send(w.send))?;
        rc("closeRecv", w.net.close_recv(w.recv))?;
        if version >= 11 {
            rc("finalize", w.net.finalize(w.ctx))?;
        }
    }
    Ok(())
}
