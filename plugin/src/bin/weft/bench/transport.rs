//! The two transports measured side by side: raw libfabric (tagged, or RMA
//! writes) and Weft through its exported table; connecting and closing them.

use nccl_net_weft::net_v12::{ncclNetCommConfig_v12_t, ncclNetVDeviceProps_v12_t, ncclNet_v12_t};
use nccl_net_weft::rma_v16::{ncclRmaConfig_v16_t, ncclRma_v16_t};
use nccl_net_weft::tools::fabric::{is_remote_write, Device};

use super::*;

/// `regMr`'s type for host memory (NCCL_PTR_HOST).
const PTR_HOST: c_int = 1;

/// A request of either transport.
#[derive(Debug, Clone, Copy)]
pub(super) enum Req {
    Raw(usize),
    Weft(*mut c_void),
    /// A put (or signal-only op) of Weft's RMA table.
    Put(*mut c_void),
    /// A receive of RMA data: done once the tag's signal reaches the count.
    Signal(usize, u64),
}

/// Registered memory: one buffer, usable by both transports.
pub(super) struct Buf {
    pub(super) data: Vec<u8>,
    pub(super) raw: Option<Mr>,
    /// Weft memory handles on (send comm, receive comm).
    pub(super) weft: (*mut c_void, *mut c_void),
    /// Its symmetric handle on Weft's RMA collComm (`put`), once made.
    pub(super) sym: *mut c_void,
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
    /// Raw endpoints on `dev`, the device Weft uses.
    pub(super) fn open(dev: &Device, split: bool) -> Res<Self> {
        let domain = Domain::open(dev.info_for(true))
            .map_err(|e| format!("{} {}: fi_domain: {e}", dev.provider, dev.domain))?;
        let open = || Endpoint::open_own(&domain).map_err(|e| format!("raw endpoint: {e}"));
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
                    if is_remote_write(comp) {
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
        op: impl Fn(&Self, *mut c_void) -> Result<(), FiError>,
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
                        Some(tag as u64),
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
        let size = posted(size, tag);
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
    pub(super) net: &'static ncclNet_v12_t,
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
        let (isend, comm) = (member!(self.net, isend), self.send);
        until_req("isend", |req| {
            // SAFETY: NCCL's contract: a live comm, a registered buffer that
            // outlives the request, a valid out pointer.
            unsafe {
                isend(
                    comm,
                    b.ptr(off).cast(),
                    size,
                    tag as c_int,
                    b.weft.0,
                    std::ptr::null_mut(),
                    req,
                )
            }
        })
    }

    fn recv(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req> {
        let (irecv, comm) = (member!(self.net, irecv), self.recv);
        let mut size = posted(size, tag);
        let (mut data, mut tag, mut mh) = (b.ptr(off).cast(), tag as c_int, b.weft.1);
        let mut ph = std::ptr::null_mut();
        until_req("irecv", |req| {
            // SAFETY: as for send; one buffer per receive, its arrays live
            // locals.
            unsafe {
                irecv(
                    comm, 1, &mut data, &mut size, &mut tag, &mut mh, &mut ph, req,
                )
            }
        })
    }

    fn done(&mut self, r: Req) -> Res<bool> {
        let Req::Weft(q) = r else {
            return Err("a raw request on the Weft transport".into());
        };
        let (mut done, mut sizes) = (0, [0 as c_int; 8]);
        let test = member!(self.net, test);
        // SAFETY: `q` is a live request of this table.
        rc("test", unsafe { test(q, &mut done, sizes.as_mut_ptr()) })?;
        Ok(done == 1)
    }
}

/// Both transports of one process (and Weft's RMA, with `put`).
pub(super) struct Side {
    pub(super) raw: Raw,
    pub(super) weft: Weft,
    pub(super) put: Option<Put>,
}

/// A process's buffers: data slots, the pong buffer, and a small one for "go".
pub(super) struct Bufs {
    pub(super) data: Buf,
    pub(super) pong: Buf,
    pub(super) small: Buf,
}

/// `--post-size`: receives post at least this many bytes (0: the
/// message's size), reaching past their slot into the next ones (only the
/// message's bytes are written), so buffers get this much room at the end.
pub(super) fn post_size() -> usize {
    *POST_SIZE.get().unwrap_or(&0)
}

/// `--post-size`, fixed once per process by the plan it runs.
pub(super) static POST_SIZE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// What a receive of a `size`-byte message with `tag` posts: the
/// benchmark's own "go" messages land in their small buffer as they are.
fn posted(size: usize, tag: Tag) -> usize {
    match tag {
        Tag::Go => size,
        _ => size.max(post_size()),
    }
}

impl Bufs {
    pub(super) fn new(side: &Side, size: usize, slots: usize) -> Res<Self> {
        Ok(Self {
            data: side.buf(size * slots + post_size())?,
            pong: side.buf(size.max(post_size()))?,
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
        let reg = member!(w.net, regMr);
        let p = data.as_ptr() as *mut c_void;
        // SAFETY: live comms; the buffer outlives its handles (`unreg`).
        unsafe {
            rc("regMr", reg(w.send, p, data.len(), PTR_HOST, &mut s))?;
            rc("regMr", reg(w.recv, p, data.len(), PTR_HOST, &mut r))?;
        }
        Ok(Buf {
            data,
            raw: Some(raw),
            weft: (s, r),
            sym: std::ptr::null_mut(),
        })
    }

    pub(super) fn unreg(&self, b: Buf) -> Res<()> {
        if let (Some(p), false) = (&self.put, b.sym.is_null()) {
            // SAFETY: a handle of this side's live collComm.
            rc("deregMrSym", unsafe {
                (p.t.deregMrSym.ok_or("no deregMrSym")?)(p.coll, b.sym)
            })?;
        }
        let w = &self.weft;
        let dereg = member!(w.net, deregMr);
        // SAFETY: handles of this side's live comms.
        unsafe {
            rc("deregMr", dereg(w.send, b.weft.0))?;
            rc("deregMr", dereg(w.recv, b.weft.1))?;
        }
        Ok(())
    }

    pub(super) fn transport(&mut self, which: &str) -> Res<&mut dyn Transport> {
        self.raw.rma = which == "rma";
        match which {
            "raw" | "rma" => Ok(&mut self.raw),
            "weft" => Ok(&mut self.weft),
            "put" => self
                .put
                .as_mut()
                .map(|p| p as &mut dyn Transport)
                .ok_or_else(|| "put: Weft's RMA was not connected".to_owned()),
            other => Err(format!("unknown transport {other:?}")),
        }
    }
}

/// Opens both transports and connects them to the peer whose hello line is
/// read with `read` after ours is written with `write`; `dev` is the device
/// Weft uses (the raw endpoints open on it too).
pub(super) fn connect(
    dev: &Device,
    opts: &Options,
    lib: &Lib,
    mut write: impl FnMut(&str) -> Res<()>,
    mut read: impl FnMut() -> Res<String>,
) -> Res<Side> {
    let mut raw = Raw::open(dev, opts.raw_split)?;
    // SAFETY: the plugin exports its v12 table under this name.
    let net: &'static ncclNet_v12_t = unsafe { lib.table("ncclNetPlugin_v12")? };
    let (mut ctx, mut l) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut h = [0u8; 128];
    let mut d = 0;
    let mut cfg = ncclNetCommConfig_v12_t { trafficClass: -1 };
    // SAFETY: NCCL's calling convention throughout; the outputs are live
    // locals.
    unsafe {
        rc(
            "init",
            member!(net, init)(&mut ctx, 0x5eed, &mut cfg, None, std::ptr::null_mut()),
        )?;
        if opts.vdev {
            let mut p: ncclNetVDeviceProps_v12_t = std::mem::zeroed();
            p.ndevs = 1;
            p.devs[0] = 0;
            rc(
                "makeVDevice({1, [0]})",
                member!(net, makeVDevice)(&mut d, &mut p),
            )?;
        }
        rc(
            "listen",
            member!(net, listen)(ctx, d, h.as_mut_ptr().cast(), &mut l),
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
            .map_err(|e| format!("the peer's raw address: {e}"))
    };
    raw.peer = insert(&raw.ep, a_rx)?;
    if let Some((rx, from)) = &mut raw.rx {
        *from = insert(rx, a)?;
    }
    let mut ph: [u8; 128] = unhex(ph)?
        .try_into()
        .map_err(|_| "the peer's Weft handle is not 128 bytes")?;
    let (mut s, mut r): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
    let (connect, accept) = (member!(net, connect), member!(net, accept));
    let start = Instant::now();
    while s.is_null() || r.is_null() {
        // SAFETY: as above; the handle buffer is the same on every call.
        unsafe {
            if s.is_null() {
                let mut dc = std::ptr::null_mut();
                rc(
                    "connect",
                    connect(ctx, d, ph.as_mut_ptr().cast(), &mut s, &mut dc),
                )?;
            }
            if r.is_null() {
                let mut dc = std::ptr::null_mut();
                rc("accept", accept(l, &mut r, &mut dc))?;
            }
        }
        if start.elapsed() > PATIENCE {
            return Err(format!(
                "Weft's connect/accept did not finish in {} s",
                PATIENCE.as_secs()
            ));
        }
    }
    // SAFETY: the listener is no longer needed.
    unsafe { rc("closeListen", member!(net, closeListen)(l))? };
    let weft = Weft {
        net,
        ctx,
        send: s,
        recv: r,
    };
    Ok(Side {
        raw,
        weft,
        put: None,
    })
}

pub(super) fn close(side: Side, bufs: Option<Bufs>) -> Res<()> {
    if let Some(b) = bufs {
        b.free(&side)?;
    }
    if let Some(p) = &side.put {
        p.close()?;
    }
    let w = &side.weft;
    // SAFETY: live comms and context, closed once.
    unsafe {
        rc("closeSend", member!(w.net, closeSend)(w.send))?;
        rc("closeRecv", member!(w.net, closeRecv)(w.recv))?;
        rc("finalize", member!(w.net, finalize)(w.ctx))?;
    }
    Ok(())
}

/// Weft's one-sided RMA through its `ncclRmaPlugin_v16` table, as the
/// `put` transport: a message is an `iputSignal` (strong INC) from the
/// sender's buffer into the peer's same buffer at the same offset, the
/// signal of its tag counting it; a receive completes once that signal
/// reaches its count (raw `rma` does the same with `fi_writedata` and
/// its immediate). "go" is a signal-only op.
pub(super) struct Put {
    pub(super) t: &'static ncclRma_v16_t,
    ctx: *mut c_void,
    pub(super) coll: *mut c_void,
    rctx: *mut c_void,
    /// One 64-bit signal per tag, host memory the plugin adds to.
    sig: Box<[u64; 5]>,
    sig_mh: *mut c_void,
    asked: [u64; 5],
    peer: u32,
}

impl Put {
    /// `init`, `devices`, `listen`: the context and this rank's handle.
    pub(super) fn listen(lib: &Lib) -> Res<(Self, *mut c_void, [u8; 128])> {
        // SAFETY: the plugin exports its v16 RMA table under this name.
        let t: &'static ncclRma_v16_t = unsafe { lib.table("ncclRmaPlugin_v16")? };
        let (mut ctx, mut l, mut n) = (std::ptr::null_mut(), std::ptr::null_mut(), 0);
        let mut h = [0u8; 128];
        // SAFETY: NCCL's calling convention; the outputs are live locals.
        unsafe {
            rc("RMA init", member!(t, init)(&mut ctx, 0, None))?;
            rc("RMA devices", member!(t, devices)(&mut n))?;
            if n < 1 {
                return Err("put: Weft claims no RMA device here (it claims one only where CUDA memory registers: its INFO line at init says why; run with NCCL_DEBUG=INFO)".into());
            }
            rc(
                "RMA listen",
                member!(t, listen)(ctx, 0, h.as_mut_ptr().cast(), &mut l),
            )?;
        }
        let p = Self {
            t,
            ctx,
            coll: std::ptr::null_mut(),
            rctx: std::ptr::null_mut(),
            sig: Box::new([0; 5]),
            sig_mh: std::ptr::null_mut(),
            asked: [0; 5],
            peer: 0,
        };
        Ok((p, l, h))
    }

    /// `connect` (collective: both ranks call it), `createContext`, and
    /// the signals' symmetric registration.
    pub(super) fn connect(
        &mut self,
        l: *mut c_void,
        handles: [&mut [u8; 128]; 2],
        rank: u32,
    ) -> Res<()> {
        let t = self.t;
        let mut hs: Vec<*mut c_void> = handles.into_iter().map(|h| h.as_mut_ptr().cast()).collect();
        self.peer = 1 - rank;
        let mut cfg = ncclRmaConfig_v16_t {
            nContexts: 1,
            trafficClass: -1,
            rankStride: 1,
        };
        // SAFETY: NCCL's calling convention; the handles live across the call.
        unsafe {
            rc(
                "RMA connect",
                member!(t, connect)(
                    std::ptr::null_mut(),
                    hs.as_mut_ptr(),
                    2,
                    rank as c_int,
                    l,
                    &mut self.coll,
                ),
            )?;
            rc("RMA closeListen", member!(t, closeListen)(l))?;
            rc(
                "RMA createContext",
                member!(t, createContext)(self.coll, &mut cfg, &mut self.rctx),
            )?;
            rc(
                "RMA regMrSym (signals)",
                member!(t, regMrSym)(
                    self.coll,
                    self.sig.as_mut_ptr().cast(),
                    40,
                    1,
                    0,
                    &mut self.sig_mh,
                ),
            )?;
        }
        Ok(())
    }

    /// `regMrSym` of a buffer (symmetric: the peer registers its own
    /// buffer of the same role at the same time).
    pub(super) fn register(&self, b: &mut Buf) -> Res<()> {
        // SAFETY: the buffer outlives its handle (`Side::unreg`).
        rc("RMA regMrSym", unsafe {
            member!(self.t, regMrSym)(self.coll, b.ptr(0).cast(), b.data.len(), 1, 0, &mut b.sym)
        })
    }

    fn close(&self) -> Res<()> {
        let t = self.t;
        // SAFETY: this side's live objects, closed once.
        unsafe {
            rc(
                "RMA deregMrSym",
                member!(t, deregMrSym)(self.coll, self.sig_mh),
            )?;
            rc("RMA destroyContext", member!(t, destroyContext)(self.rctx))?;
            rc("RMA closeColl", member!(t, closeColl)(self.coll))?;
            rc("RMA finalize", member!(t, finalize)(self.ctx))
        }
    }
}

impl Transport for Put {
    fn send(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req> {
        let (src, len, mh) = match tag {
            Tag::Go => (0, 0, std::ptr::null_mut()),
            _ => (off as u64, size, b.sym),
        };
        let t = self.t;
        let mut q = std::ptr::null_mut();
        // SAFETY: live context and handles; the buffer outlives the request.
        rc("iputSignal", unsafe {
            member!(t, iputSignal)(
                self.rctx,
                0,
                src,
                mh,
                len,
                src,
                mh,
                self.peer,
                tag as u64 * 8,
                self.sig_mh,
                0,
                1,
                true,
                0,
                &mut q,
            )
        })?;
        Ok(Req::Put(q))
    }

    fn recv(&mut self, _b: &Buf, _off: usize, _size: usize, tag: Tag) -> Res<Req> {
        let t = tag as usize;
        self.asked[t] += 1;
        Ok(Req::Signal(t, self.asked[t]))
    }

    fn done(&mut self, r: Req) -> Res<bool> {
        let t = self.t;
        match r {
            Req::Put(q) => {
                let mut done = 0;
                // SAFETY: a live request of this collComm.
                rc("RMA test", unsafe {
                    member!(t, test)(self.coll, q, &mut done)
                })?;
                Ok(done == 1)
            }
            Req::Signal(tag, want) => {
                // SAFETY: the live RMA context.
                rc("rmaProgress", unsafe { member!(t, rmaProgress)(self.rctx) })?;
                // SAFETY: the plugin adds to it atomically, from this thread.
                let v = unsafe { std::ptr::read_volatile(&self.sig[tag]) };
                Ok(v >= want)
            }
            _ => Err("not a request of the put transport".into()),
        }
    }
}
