//! Weft against raw libfabric on the same provider, two processes, one run.
//!
//! ```text
//! weft-bench [--providers shm,tcp] [--version 12] [--reps 5] [--quick]
//!            [--sizes 8,64,...] [--impls raw,rma,weft] [--raw-split] [--out DIR]
//!            [--micro | --micro-only] [--no-plot] [--vdev]
//! ```
//!
//! `--vdev`: Weft's comms run on a virtual device of device 0 alone
//! (`makeVDevice`, v9+), so the figures show what the striping layer
//! (headers, one more one-way latency) costs on one rail.
//!
//! For each provider a client process and a server process are started (the
//! provider is fixed per process). Both open (a) a raw libfabric RDM endpoint
//! with our `libfabric-sys` wrappers and (b) Weft through its exported table
//! `ncclNetPlugin_v<version>`, loaded with `dlopen` as NCCL does. Then, for
//! every size, raw and Weft rounds alternate (the order flips every
//! repetition), each repeated `--reps` times:
//!
//! * **bandwidth** with windows of 8 and 32: the receiver posts a window of
//!   receives and sends "go"; the sender then sends the window. Message counts
//!   are bounded, and the receiver paces every window, so no message is ever
//!   unexpected and neither side's memory grows with the run.
//! * **message rate** at 8 B: the bandwidth test's messages per second.
//! * **latency**: ping-pong, half the round-trip time.
//!
//! Raw uses `fi_tsend`/`fi_trecv` with the same tags, window and buffers as
//! Weft's `isend`/`irecv`. Raw RMA (`rma`, the RDMA protocol's baseline)
//! moves the same data with `fi_writedata` straight into the peer's buffer
//! at the same offset (addresses and keys swapped once per size, no control
//! message per write); a receive completes when a write's immediate arrives.
//! Its "go" messages stay tagged, as in the other two. Output: a table (medians, spread = (max-min)/median,
//! Weft/raw), `bench.csv`, `bench.json` and `bench.png` (bandwidth vs size) in
//! `--out` (default `target/bench`). `--micro` adds instruction counts of the
//! micro-benchmark cases under callgrind (see `weft-micro`); `--micro-only`
//! runs just those.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::fabric::{Completion, Domain, Endpoint, FiAddr, Mr, ACCESS_ALL};
use weft_tests::emu::check as rc;
use weft_tests::emu::{self, Net};
use weft_tests::peer::{hex, unhex_bytes as unhex};

/// Tags: data and pings go client -> server, "go" and pongs server -> client.
#[derive(Debug, Clone, Copy)]
enum Tag {
    Data = 1,
    Go = 2,
    Ping = 3,
    Pong = 4,
}

/// Bytes of data memory per buffer set: larger windows reuse slots.
const SLOT_BYTES: usize = 256 << 20;
/// Bytes a bandwidth round aims to move.
const ROUND_BYTES: usize = 256 << 20;
/// Most messages in a bandwidth round.
const ROUND_MSGS: usize = 20_000;
/// Untimed ping-pongs before each latency round.
const WARMUP: usize = 20;

type Res<T> = Result<T, String>;

// ------------------------------------------------------------ transports

/// A request of either transport.
#[derive(Debug, Clone, Copy)]
enum Req {
    Raw(usize),
    Weft(*mut c_void),
}

/// Registered memory: one buffer, usable by both transports.
struct Buf {
    data: Vec<u8>,
    raw: Option<Mr>,
    /// Weft memory handles on (send comm, receive comm).
    weft: (*mut c_void, *mut c_void),
}

impl Buf {
    fn ptr(&self, off: usize) -> *mut u8 {
        self.data.as_ptr().wrapping_add(off).cast_mut()
    }
}

/// What a round needs from a transport: post, and poll for completion.
trait Transport {
    fn send(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req>;
    fn recv(&mut self, b: &Buf, off: usize, size: usize, tag: Tag) -> Res<Req>;
    /// Progress; true once `r` is done (it is then released).
    fn done(&mut self, r: Req) -> Res<bool>;
}

fn wait_all(t: &mut dyn Transport, reqs: &[Req]) -> Res<()> {
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
struct Raw {
    domain: Arc<Domain>,
    ep: Endpoint,
    peer: FiAddr,
    /// The receiving endpoint and the peer's sending address, when split.
    rx: Option<(Endpoint, FiAddr)>,
    /// Completion seen, by context index.
    done: Vec<bool>,
    free: Vec<usize>,
    /// Writes instead of tagged messages (except "go").
    rma: bool,
    /// Where the peer's buffer for each tag is: (address or 0 where the
    /// provider addresses by offset, key).
    remote: [(u64, u64); 5],
    /// Writes landed per tag, receives asked per tag, and the receives
    /// waiting: (context index, tag, the landed count that completes it).
    landed: [u64; 5],
    asked: [u64; 5],
    waiting: Vec<(usize, usize, u64)>,
}

impl Raw {
    fn open(provider: &str, split: bool) -> Res<Self> {
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
    fn base(&self, b: &Buf) -> u64 {
        let virt = self.domain.mr_mode() & libfabric_sys::FI_MR_VIRT_ADDR != 0;
        if virt {
            b.ptr(0) as u64
        } else {
            0
        }
    }

    fn slot(&mut self) -> usize {
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

    fn progress(&mut self) -> Res<()> {
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
    fn post(
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
struct Weft {
    net: Box<dyn Net>,
    ctx: *mut c_void,
    send: *mut c_void,
    recv: *mut c_void,
}

/// Calls `post` until it hands out a request (NULL means "retry later").
fn until_req(what: &str, mut post: impl FnMut(&mut *mut c_void) -> c_int) -> Res<Req> {
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
struct Side {
    raw: Raw,
    weft: Weft,
}

/// A process's buffers: data slots, the pong buffer, and a small one for "go".
struct Bufs {
    data: Buf,
    pong: Buf,
    small: Buf,
}

impl Bufs {
    fn new(side: &Side, size: usize, slots: usize) -> Res<Self> {
        Ok(Self {
            data: side.buf(size * slots)?,
            pong: side.buf(size)?,
            small: side.buf(64)?,
        })
    }

    fn free(self, side: &Side) -> Res<()> {
        side.unreg(self.data)?;
        side.unreg(self.pong)?;
        side.unreg(self.small)
    }
}

impl Side {
    /// A buffer of `len` bytes registered with both transports.
    fn buf(&self, len: usize) -> Res<Buf> {
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

    fn unreg(&self, b: Buf) -> Res<()> {
        let w = &self.weft;
        // SAFETY: handles of this side's live comms.
        unsafe {
            rc("deregMr", w.net.dereg_mr(w.send, b.weft.0))?;
            rc("deregMr", w.net.dereg_mr(w.recv, b.weft.1))?;
        }
        Ok(())
    }

    fn transport(&mut self, which: &str) -> Res<&mut dyn Transport> {
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
fn connect(
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

fn close(side: Side, bufs: Option<Bufs>, version: u32) -> Res<()> {
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

// ------------------------------------------------------------ rounds

/// Slots of `size` bytes in the data buffer for a window.
fn slots(size: usize, window: usize) -> usize {
    window.min((SLOT_BYTES / size.max(1)).max(1))
}

/// Messages in a bandwidth round: about ROUND_BYTES, whole windows.
fn round_count(size: usize, window: usize, quick: bool) -> usize {
    let target = if quick { ROUND_BYTES / 64 } else { ROUND_BYTES };
    let n = (target / size.max(1)).clamp(window, if quick { 2000 } else { ROUND_MSGS });
    n.div_ceil(window) * window
}

/// Ping-pongs in a latency round.
fn lat_iters(size: usize, quick: bool) -> usize {
    let n = (64 << 20) / size.max(1);
    n.clamp(10, if quick { 200 } else { 2000 })
}

/// The sender of a bandwidth round; returns the time from the first "go" to
/// the last one (the receiver's word that everything arrived).
#[inline(never)] // callgrind finds it by name
fn bw_send(
    t: &mut dyn Transport,
    data: &Buf,
    small: &Buf,
    size: usize,
    window: usize,
    count: usize,
) -> Res<Duration> {
    let n = data.data.len() / size.max(1);
    let go = t.recv(small, 0, 4, Tag::Go)?;
    wait_all(t, &[go])?;
    let start = Instant::now();
    let mut sent = 0;
    let mut reqs = Vec::with_capacity(window);
    while sent < count {
        let next_go = t.recv(small, 0, 4, Tag::Go)?;
        reqs.clear();
        for k in 0..window {
            reqs.push(t.send(data, ((sent + k) % n.max(1)) * size, size, Tag::Data)?);
        }
        wait_all(t, &reqs)?;
        sent += window;
        wait_all(t, &[next_go])?;
    }
    Ok(start.elapsed())
}

/// The receiver of a bandwidth round: a window of receives, then "go".
#[inline(never)]
fn bw_recv(
    t: &mut dyn Transport,
    data: &Buf,
    small: &Buf,
    size: usize,
    window: usize,
    count: usize,
) -> Res<()> {
    let n = data.data.len() / size.max(1);
    let mut got = 0;
    let mut reqs = Vec::with_capacity(window + 1);
    while got < count {
        reqs.clear();
        for k in 0..window {
            reqs.push(t.recv(data, ((got + k) % n.max(1)) * size, size, Tag::Data)?);
        }
        reqs.push(t.send(small, 8, 4, Tag::Go)?);
        wait_all(t, &reqs)?;
        got += window;
    }
    let fin = t.send(small, 8, 4, Tag::Go)?;
    wait_all(t, &[fin])
}

/// The pinging side of a latency round; returns the time of `iters` round trips.
#[inline(never)]
fn ping(t: &mut dyn Transport, data: &Buf, pong: &Buf, size: usize, iters: usize) -> Res<Duration> {
    let mut start = Instant::now();
    for i in 0..WARMUP + iters {
        if i == WARMUP {
            start = Instant::now();
        }
        let r = t.recv(pong, 0, size, Tag::Pong)?;
        let s = t.send(data, 0, size, Tag::Ping)?;
        wait_all(t, &[s, r])?;
    }
    Ok(start.elapsed())
}

/// The answering side of a latency round.
#[inline(never)]
fn pong(t: &mut dyn Transport, data: &Buf, pong: &Buf, size: usize, iters: usize) -> Res<()> {
    let total = WARMUP + iters;
    let mut r = t.recv(data, 0, size, Tag::Ping)?;
    for i in 0..total {
        wait_all(t, &[r])?;
        if i + 1 < total {
            r = t.recv(data, 0, size, Tag::Ping)?;
        }
        let s = t.send(pong, 0, size, Tag::Pong)?;
        wait_all(t, &[s])?;
    }
    Ok(())
}

// ------------------------------------------------------------ processes

/// `--serve`: the receiving process, driven by commands on stdin.
fn serve(provider: &str, version: u32, split: bool) -> Res<()> {
    let lib = emu::open();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut out = std::io::stdout();
    let mut say = |s: &str| -> Res<()> {
        writeln!(out, "{s}")
            .and_then(|()| out.flush())
            .map_err(|e| e.to_string())
    };
    let mut next = || -> Res<String> {
        lines
            .next()
            .ok_or("client went away")?
            .map_err(|e| e.to_string())
    };
    // The server speaks first; the client answers with its own hello.
    let mut side = connect(provider, version, split, &lib, &mut say, &mut next)?;
    let mut bufs: Option<Bufs> = None;
    loop {
        let line = next()?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Res<usize> {
            w.get(i)
                .ok_or("missing argument")?
                .parse()
                .map_err(|e: std::num::ParseIntError| e.to_string())
        };
        match w.first().copied() {
            Some("prep") => {
                if let Some(b) = bufs.take() {
                    b.free(&side)?;
                }
                let b = bufs.insert(Bufs::new(&side, num(1)?, num(2)?)?);
                // Raw RMA: pongs go to the client's pong buffer; data and
                // pings come to this side's data buffer.
                side.raw.remote[Tag::Pong as usize] = (num(3)? as u64, num(4)? as u64);
                say(&format!(
                    "ok {} {}",
                    side.raw.base(&b.data),
                    b.data.raw.as_ref().map_or(0, Mr::key)
                ))?;
                continue;
            }
            Some("bw") => {
                let b = bufs.as_ref().ok_or("prep first")?;
                bw_recv(
                    side.transport(w[1])?,
                    &b.data,
                    &b.small,
                    num(2)?,
                    num(3)?,
                    num(4)?,
                )?;
            }
            Some("lat") => {
                let b = bufs.as_ref().ok_or("prep first")?;
                pong(side.transport(w[1])?, &b.data, &b.pong, num(2)?, num(3)?)?;
            }
            Some("quit") => {
                close(side, bufs, version)?;
                return say(&format!("ok {}", weft_tests::status_kb("VmHWM")));
            }
            other => return Err(format!("unknown command {other:?}")),
        }
        say("ok")?;
    }
}

/// The server process as the client sees it.
struct Server {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Server {
    fn say(&mut self, s: &str) -> Res<()> {
        writeln!(self.stdin, "{s}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("server: {e}"))
    }
    fn hear(&mut self) -> Res<String> {
        let mut l = String::new();
        self.stdout.read_line(&mut l).map_err(|e| e.to_string())?;
        if l.is_empty() {
            let _ = self.child.wait();
            return Err("the server process ended".into());
        }
        Ok(l.trim().to_owned())
    }
    fn ok(&mut self) -> Res<String> {
        let l = self.hear()?;
        if l.starts_with("ok") {
            Ok(l)
        } else {
            Err(format!("server: {l}"))
        }
    }
}

/// One measured point, as the client reports it (a JSON line).
fn record(
    provider: &str,
    test: &str,
    size: usize,
    window: usize,
    imp: &str,
    unit: &str,
    values: &[f64],
) -> serde_json::Value {
    serde_json::json!({
        "provider": provider, "test": test, "size": size, "window": window,
        "impl": imp, "unit": unit, "values": values,
    })
}

struct Plan {
    sizes: Vec<usize>,
    /// "raw" and/or "weft" (both unless profiling one).
    impls: Vec<String>,
    /// Raw uses one endpoint per direction.
    raw_split: bool,
    windows: Vec<usize>,
    reps: usize,
    quick: bool,
    lat_max: usize,
}

/// The implementations of repetition `rep`, in alternating order.
fn order(plan: &Plan, rep: usize) -> Vec<&'static str> {
    let mut v: Vec<&'static str> = ["raw", "rma", "weft"]
        .into_iter()
        .filter(|i| plan.impls.iter().any(|p| p == i))
        .collect();
    if rep % 2 == 1 {
        v.reverse();
    }
    v
}

/// `--client`: starts the server, runs every round, prints JSON lines.
fn client(provider: &str, version: u32, plan: &Plan) -> Res<()> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["--serve", provider, "--version", &version.to_string()])
        .args(plan.raw_split.then_some("--raw-split"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut srv = Server {
        stdin: child.stdin.take().ok_or("stdin")?,
        stdout: BufReader::new(child.stdout.take().ok_or("stdout")?),
        child,
    };
    let lib = emu::open();
    let hello = srv.hear()?;
    let mut side = connect(
        provider,
        version,
        plan.raw_split,
        &lib,
        |s| srv.say(s),
        || Ok(hello.clone()),
    )?;
    let mut bufs: Option<Bufs> = None;
    let mut out = std::io::stdout();
    let mut emit = |v: serde_json::Value| -> Res<()> {
        writeln!(out, "{v}")
            .and_then(|()| out.flush())
            .map_err(|e| e.to_string())
    };
    for &size in &plan.sizes {
        let maxw = plan.windows.iter().copied().max().unwrap_or(1);
        let n = slots(size, maxw);
        if let Some(b) = bufs.take() {
            b.free(&side)?;
        }
        let b = bufs.insert(Bufs::new(&side, size, n)?);
        srv.say(&format!(
            "prep {size} {n} {} {}",
            side.raw.base(&b.pong),
            b.pong.raw.as_ref().map_or(0, Mr::key)
        ))?;
        let theirs: Vec<u64> = srv
            .ok()?
            .split_whitespace()
            .skip(1)
            .filter_map(|w| w.parse().ok())
            .collect();
        let [base, key] = theirs[..] else {
            return Err(format!("prep: the server sent {theirs:?}"));
        };
        side.raw.remote[Tag::Data as usize] = (base, key);
        side.raw.remote[Tag::Ping as usize] = (base, key);
        for &window in &plan.windows {
            let count = round_count(size, window, plan.quick);
            let mut vals: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
            for rep in 0..plan.reps {
                for imp in order(plan, rep) {
                    srv.say(&format!("bw {imp} {size} {window} {count}"))?;
                    let secs =
                        bw_send(side.transport(imp)?, &b.data, &b.small, size, window, count)?
                            .as_secs_f64();
                    srv.ok()?;
                    vals.entry(imp)
                        .or_default()
                        .push((count * size) as f64 / secs / 1e6);
                    if size == 8 {
                        vals.entry(match imp {
                            "raw" => "raw-rate",
                            "rma" => "rma-rate",
                            _ => "weft-rate",
                        })
                        .or_default()
                        .push(count as f64 / secs / 1e6);
                    }
                }
            }
            for (imp, v) in &vals {
                let (imp, test, unit) = match imp.strip_suffix("-rate") {
                    Some(i) => (i, "rate", "Mmsg/s"),
                    None => (*imp, "bw", "MB/s"),
                };
                emit(record(provider, test, size, window, imp, unit, v))?;
            }
            eprintln!("  {provider}: bandwidth {size} B, window {window}: done");
        }
        if size <= plan.lat_max {
            let iters = lat_iters(size, plan.quick);
            let mut vals: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
            for rep in 0..plan.reps {
                for imp in order(plan, rep) {
                    srv.say(&format!("lat {imp} {size} {iters}"))?;
                    let secs =
                        ping(side.transport(imp)?, &b.data, &b.pong, size, iters)?.as_secs_f64();
                    srv.ok()?;
                    vals.entry(imp)
                        .or_default()
                        .push(secs / (2 * iters) as f64 * 1e6);
                }
            }
            for (imp, v) in &vals {
                emit(record(provider, "lat", size, 1, imp, "us", v))?;
            }
        }
    }
    close(side, bufs, version)?;
    srv.say("quit")?;
    let server_hwm = srv.ok()?;
    let _ = srv.child.wait();
    emit(serde_json::json!({
        "provider": provider, "test": "memory",
        "client_hwm_kb": weft_tests::status_kb("VmHWM"),
        "server_hwm_kb": server_hwm.strip_prefix("ok ").and_then(|s| s.parse::<u64>().ok()),
    }))
}

// ------------------------------------------------------------ report

fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let med = if s.is_empty() {
        f64::NAN
    } else if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    (
        med,
        *s.first().unwrap_or(&f64::NAN),
        *s.last().unwrap_or(&f64::NAN),
    )
}

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// An axis label in decimal units (the log axis ticks at powers of ten).
fn decimal(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.0} GB", x / 1e9),
        x if x >= 1e6 => format!("{:.0} MB", x / 1e6),
        x if x >= 1e3 => format!("{:.0} kB", x / 1e3),
        x => format!("{x:.0} B"),
    }
}

/// A row key: (provider, test, size, window).
type Key = (String, String, usize, usize);

fn collect(records: &[serde_json::Value]) -> BTreeMap<Key, BTreeMap<String, Vec<f64>>> {
    let mut m: BTreeMap<Key, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    for r in records {
        let (Some(p), Some(t), Some(s), Some(w), Some(i), Some(v)) = (
            r["provider"].as_str(),
            r["test"].as_str(),
            r["size"].as_u64(),
            r["window"].as_u64(),
            r["impl"].as_str(),
            r["values"].as_array(),
        ) else {
            continue;
        };
        m.entry((p.into(), t.into(), s as usize, w as usize))
            .or_default()
            .insert(i.into(), v.iter().filter_map(|x| x.as_f64()).collect());
    }
    m
}

/// The table on stdout and the rows of the CSV.
fn table(m: &BTreeMap<Key, BTreeMap<String, Vec<f64>>>) -> (String, String) {
    let mut t = String::new();
    let mut csv =
        String::from("provider,test,size,window,impl,unit,median,min,max,n,weft_over_raw\n");
    let mut last = String::new();
    for ((p, test, size, w), imps) in m {
        let head = format!("{p} {test}");
        if head != last {
            let what = match test.as_str() {
                "bw" => {
                    "unidirectional bandwidth, MB/s (median of reps; spread = (max-min)/median)"
                }
                "rate" => "message rate at 8 B, million messages/s",
                _ => "ping-pong latency, half round trip, us",
            };
            t.push_str(&format!(
                "\n{p}: {what}\n{:<9} {:>6} {:>11} {:>7} {:>11} {:>7} {:>10} {:>11} {:>10}\n",
                "size",
                "window",
                "raw",
                "spread",
                "weft",
                "spread",
                "weft/raw",
                "raw write",
                "weft/write"
            ));
            last = head;
        }
        let unit = match test.as_str() {
            "bw" => "MB/s",
            "rate" => "Mmsg/s",
            _ => "us",
        };
        let (rm, rlo, rhi) = stats(imps.get("raw").map_or(&[][..], |v| v));
        let (wm, wlo, whi) = stats(imps.get("weft").map_or(&[][..], |v| v));
        let ratio = wm / rm;
        let diff = if test == "lat" {
            format!("{:+.2} us", wm - rm)
        } else {
            format!("{ratio:.3}")
        };
        // Raw fi_writedata, the RDMA protocol's baseline (where measured).
        let (mm, mlo, mhi) = stats(imps.get("rma").map_or(&[][..], |v| v));
        let vs_write = if mm.is_nan() {
            "-".to_owned()
        } else if test == "lat" {
            format!("{:+.2} us", wm - mm)
        } else {
            format!("{:.3}", wm / mm)
        };
        t.push_str(&format!(
            "{:<9} {:>6} {:>11.3} {:>6.1}% {:>11.3} {:>6.1}% {:>10} {:>11.3} {:>10}\n",
            human(*size),
            w,
            rm,
            (rhi - rlo) / rm * 100.0,
            wm,
            (whi - wlo) / wm * 100.0,
            diff,
            mm,
            vs_write
        ));
        for (imp, (med, lo, hi), n) in [
            ("raw", (rm, rlo, rhi), imps.get("raw").map_or(0, Vec::len)),
            ("rma", (mm, mlo, mhi), imps.get("rma").map_or(0, Vec::len)),
            ("weft", (wm, wlo, whi), imps.get("weft").map_or(0, Vec::len)),
        ] {
            if n == 0 {
                continue;
            }
            csv.push_str(&format!(
                "{p},{test},{size},{w},{imp},{unit},{med:.4},{lo:.4},{hi:.4},{n},{ratio:.4}\n"
            ));
        }
    }
    (t, csv)
}

/// Bandwidth vs size, raw and Weft, one line each per provider (largest window).
fn plot(m: &BTreeMap<Key, BTreeMap<String, Vec<f64>>>, path: &Path, title: &str) -> Res<()> {
    use plotters::prelude::*;
    let font = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").map_err(|e| {
        format!("the plot needs DejaVuSans.ttf ({e}): install fonts-dejavu-core (./weft setup)")
    })?;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    )
    .map_err(|_| "cannot use DejaVuSans.ttf as a font")?;
    let wmax = m
        .keys()
        .filter(|k| k.1 == "bw")
        .map(|k| k.3)
        .max()
        .unwrap_or(1);
    let mut series: BTreeMap<(String, String), Vec<(f64, f64)>> = BTreeMap::new();
    for ((p, test, size, w), imps) in m {
        if test != "bw" || *w != wmax {
            continue;
        }
        for (imp, v) in imps {
            series
                .entry((p.clone(), imp.clone()))
                .or_default()
                .push((*size as f64, stats(v).0));
        }
    }
    let (xmin, xmax) = series
        .values()
        .flatten()
        .fold((f64::MAX, 1.0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let ymax = series.values().flatten().fold(1.0f64, |a, p| a.max(p.1));
    let ymin = series
        .values()
        .flatten()
        .fold(f64::MAX, |a, p| a.min(p.1))
        .max(1e-3);
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| format!("plot: {e}");
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (xmin..xmax * 1.2).log_scale(),
            (ymin * 0.8..ymax * 1.5).log_scale(),
        )
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc(format!("bandwidth, MB/s (window {wmax})"))
        .x_label_formatter(&|x| decimal(*x))
        .draw()
        .map_err(|x| e(&x))?;
    let colours = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (i, ((p, imp), pts)) in series.iter().enumerate() {
        let c = colours[(i / 2) % colours.len()];
        let style = if imp == "raw" {
            c.mix(0.45).stroke_width(3)
        } else {
            c.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(pts.clone(), style))
            .map_err(|x| e(&x))?
            .label(format!("{p} {imp}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart
            .draw_series(pts.iter().map(|&(x, y)| Circle::new((x, y), 3, c.filled())))
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

/// Instructions per operation of each micro case, under callgrind.
fn micro(quick: bool) -> Res<(String, serde_json::Value)> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let bin = exe.with_file_name("weft-micro");
    let n: u64 = if quick { 2000 } else { 100_000 };
    let cases = [
        ("c-pair", "cfl_bench_pair", n, 1.0, "C freelist alloc+free"),
        (
            "weft-pair",
            "weft_tests::micro::freelist_pair",
            n,
            1.0,
            "Weft freelist alloc+free",
        ),
        (
            "c-burst",
            "cfl_bench_burst",
            n / 256,
            512.0,
            "C freelist, 256 allocs then 256 frees, per op",
        ),
        (
            "weft-burst",
            "weft_tests::micro::freelist_burst",
            n / 256,
            512.0,
            "Weft freelist, 256 allocs then 256 frees, per op",
        ),
        (
            "mr-hit",
            "weft_tests::micro::mr_hit",
            n,
            1.0,
            "MR cache hit (lookup + release)",
        ),
        (
            "core-devices",
            "weft_tests::micro::core_devices",
            n,
            1.0,
            "devices(), core directly",
        ),
        (
            "v5-devices",
            "weft_tests::micro::table_devices",
            n,
            1.0,
            "devices(), through the v5 adapter",
        ),
        (
            "v12-devices",
            "weft_tests::micro::table_devices",
            n,
            1.0,
            "devices(), through the v12 adapter",
        ),
    ];
    let dir = std::env::temp_dir().join(format!("weft-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut text = format!("\nmicro-costs: instructions per operation (valgrind --tool=callgrind, {n} repetitions, loop included)\n");
    let mut json = serde_json::Map::new();
    for (case, func, reps, ops, what) in cases {
        let out = dir.join(format!("callgrind.{case}"));
        let st = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--toggle-collect={func}"))
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&bin)
            .args([case, &reps.to_string()])
            .env("WEFT_PROVIDER", "shm")
            .output()
            .map_err(|e| format!("cannot run valgrind ({e}): ./weft setup installs it"))?;
        if !st.status.success() {
            return Err(format!(
                "callgrind {case}: {}",
                String::from_utf8_lossy(&st.stderr)
            ));
        }
        let f = std::fs::read_to_string(&out).map_err(|e| e.to_string())?;
        let ir: f64 = f
            .lines()
            .find_map(|l| {
                l.strip_prefix("summary:")
                    .or_else(|| l.strip_prefix("totals:"))
            })
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .ok_or_else(|| format!("callgrind {case}: no totals"))?;
        let per = ir / (reps as f64 * ops);
        text.push_str(&format!("  {what:<52} {per:>8.1}\n"));
        json.insert(case.to_owned(), serde_json::json!(per));
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok((text, serde_json::Value::Object(json)))
}

fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut providers = vec!["shm".to_owned(), "tcp".to_owned()];
    let mut version = 12u32;
    let mut reps = 5usize;
    let mut quick = false;
    let mut sizes: Option<Vec<usize>> = None;
    let mut impls = vec!["raw".to_owned(), "rma".to_owned(), "weft".to_owned()];
    let mut raw_split = false;
    let mut out = PathBuf::from("target/bench");
    let (mut micro_too, mut plot_too) = (false, true);
    let (mut serve_p, mut client_p) = (None, None);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--providers" => providers = val()?.split(',').map(str::to_owned).collect(),
            "--version" => version = val()?.parse().map_err(|e| format!("--version: {e}"))?,
            "--reps" => reps = val()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--sizes" => {
                sizes = Some(
                    val()?
                        .split(',')
                        .map(|s| s.parse().map_err(|e| format!("--sizes: {e}")))
                        .collect::<Res<_>>()?,
                )
            }
            "--impls" => impls = val()?.split(',').map(str::to_owned).collect(),
            "--out" => out = PathBuf::from(val()?),
            "--serve" => serve_p = Some(val()?),
            "--client" => client_p = Some(val()?),
            "--quick" => quick = true,
            "--micro" => micro_too = true,
            "--raw-split" => raw_split = true,
            "--micro-only" => {
                micro_too = true;
                providers.clear();
                plot_too = false;
            }
            "--no-plot" => plot_too = false,
            // Read by both processes (the server inherits it).
            "--vdev" => std::env::set_var("WEFT_BENCH_VDEV", "1"),
            "-h" | "--help" => {
                println!("usage: weft-bench [--providers shm,tcp] [--version 12] [--reps 5] [--quick] [--sizes 8,64,...] [--impls raw,rma,weft] [--raw-split] [--out DIR] [--micro | --micro-only] [--no-plot] [--vdev]");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    let sizes = sizes.unwrap_or_else(|| {
        if quick {
            vec![8, 4096, 65536, 1 << 20]
        } else {
            vec![
                8,
                64,
                512,
                4096,
                16384,
                65536,
                262144,
                1 << 20,
                4 << 20,
                16 << 20,
                64 << 20,
            ]
        }
    });
    let plan = Plan {
        sizes,
        impls: impls.clone(),
        raw_split,
        windows: vec![8, 32],
        reps,
        quick,
        lat_max: 1 << 20,
    };
    if let Some(p) = serve_p {
        return serve(&p, version, raw_split);
    }
    if let Some(p) = client_p {
        return client(&p, version, &plan);
    }

    // The orchestrator: one client (and server) per provider.
    let started = Instant::now();
    let load_before = weft_tests::load_average();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut records = Vec::new();
    for p in &providers {
        eprintln!(
            "weft-bench: {p} (plugin {}, table v{version})",
            emu::plugin_path().display()
        );
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--client",
            p,
            "--version",
            &version.to_string(),
            "--reps",
            &reps.to_string(),
        ])
        .args(["--impls", &impls.join(",")])
        .args(raw_split.then_some("--raw-split"))
        .args([
            "--sizes",
            &plan
                .sizes
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ]);
        if quick {
            cmd.arg("--quick");
        }
        let o = cmd
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&o.stdout);
        if !o.status.success() {
            return Err(format!("{p}: the client failed: {text}"));
        }
        for l in text.lines() {
            records.push(
                serde_json::from_str::<serde_json::Value>(l)
                    .map_err(|e| format!("{p}: {e}: {l}"))?,
            );
        }
    }
    let m = collect(&records);
    let (tab, csv) = table(&m);
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let load_after = weft_tests::load_average();
    let header = format!(
        "weft-bench {} UTC; {cpus} CPUs ({model}); libfabric {}; table v{version}; {} rep(s) per point, raw and Weft alternating; load average {load_before} (start), {load_after} (end); {:.0} s",
        sh("date", &["-u", "+%Y-%m-%d %H:%M"]),
        libfabric_sys::version_text(libfabric_sys::running_version()),
        reps,
        started.elapsed().as_secs_f64()
    );
    println!("{header}");
    print!("{tab}");
    for r in records.iter().filter(|r| r["test"] == "memory") {
        println!(
            "\n{}: peak resident memory: client {} MB, server {} MB",
            r["provider"].as_str().unwrap_or("?"),
            r["client_hwm_kb"].as_u64().unwrap_or(0) / 1024,
            r["server_hwm_kb"].as_u64().unwrap_or(0) / 1024
        );
    }
    let micro_json = if micro_too {
        let (t, j) = micro(quick)?;
        print!("{t}");
        j
    } else {
        serde_json::Value::Null
    };
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let csv_path = out.join("bench.csv");
    std::fs::write(&csv_path, csv).map_err(|e| e.to_string())?;
    let json = serde_json::json!({
        "header": header,
        "records": records.iter().filter(|r| r["test"] != "memory").collect::<Vec<_>>(),
        "memory": records.iter().filter(|r| r["test"] == "memory").collect::<Vec<_>>(),
        "micro_instructions_per_op": micro_json,
    });
    let json_path = out.join("bench.json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let mut wrote = vec![csv_path, json_path];
    if plot_too {
        let png = out.join("bench.png");
        plot(
            &m,
            &png,
            &format!("Weft (v{version} table) vs raw libfabric, two processes on one host"),
        )?;
        wrote.push(png);
    }
    println!(
        "\nwrote {}",
        wrote
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
