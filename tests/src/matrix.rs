//! One cell of the version matrix: API version x provider, driven through
//! the dlopen'ed table exactly as that version's NCCL drives a plugin (the
//! symbol NCCL looks up, `init` with its logger, `devices`/`getProperties`,
//! then listen/connect/accept polled until non-NULL, and the data path; see
//! docs/versions.md). Every check is counted; a failure names the
//! version, the call, the arguments that mattered and what was expected.

use std::ffi::{c_int, c_void};
use std::fmt::Display;
use std::path::Path;

use crate::emu::{self, Net};
use crate::host::pattern;
use crate::poll_until;

/// Counts checks and words failures.
struct Checks {
    v: u32,
    provider: String,
    n: usize,
}

type Res<T = ()> = Result<T, String>;

impl Checks {
    fn fail(
        &self,
        call: &str,
        args: impl Display,
        expected: impl Display,
        got: impl Display,
    ) -> String {
        format!(
            "ncclNet v{} over {}: {call}({args}): expected {expected}, got {got}",
            self.v, self.provider
        )
    }
    /// A call that must return ncclSuccess.
    fn ok(&mut self, call: &str, args: impl Display, r: c_int) -> Res {
        self.n += 1;
        if r == 0 {
            Ok(())
        } else {
            Err(self.fail(call, args, "ncclSuccess (0)", format!("result {r}")))
        }
    }
    /// A call inside a poll loop: must succeed, counted once by the caller.
    fn rc(&self, call: &str, args: impl Display, r: c_int) -> Res {
        if r == 0 {
            Ok(())
        } else {
            Err(self.fail(call, args, "ncclSuccess (0)", format!("result {r}")))
        }
    }
    /// A condition.
    fn that(
        &mut self,
        cond: bool,
        call: &str,
        args: impl Display,
        expected: impl Display,
        got: impl Display,
    ) -> Res {
        self.n += 1;
        if cond {
            Ok(())
        } else {
            Err(self.fail(call, args, expected, got))
        }
    }
}

fn null<T>() -> *mut T {
    std::ptr::null_mut()
}

/// Polls `f` (which returns Ok(true) when done) with the test timeout.
fn until(what: &str, mut f: impl FnMut() -> Res<bool>) -> Res {
    poll_until(what, || match f() {
        Ok(true) => Some(Ok(())),
        Ok(false) => None,
        Err(e) => Some(Err(e)),
    })
}

struct Pair {
    s: *mut c_void,
    r: *mut c_void,
}

/// listen + connect/accept polled together; `null_devcomm` picks the NULL
/// form of the device-handle argument for connect (accept gets the other).
unsafe fn pair(n: &dyn Net, c: &mut Checks, ctx: *mut c_void, null_devcomm: bool) -> Res<Pair> {
    // SAFETY: forwarded.
    unsafe { pair_on(n, c, ctx, 0, null_devcomm) }
}

/// [`pair`] on device `dev`.
unsafe fn pair_on(
    n: &dyn Net,
    c: &mut Checks,
    ctx: *mut c_void,
    dev: c_int,
    null_devcomm: bool,
) -> Res<Pair> {
    let mut h = [0u8; 128];
    let mut l = null();
    // SAFETY: NCCL's conventions; the handle outlives the calls.
    unsafe {
        c.ok(
            "listen",
            format_args!("dev={dev}"),
            n.listen(ctx, dev, h.as_mut_ptr().cast(), &mut l),
        )?;
        c.that(
            !l.is_null(),
            "listen",
            format_args!("dev={dev}"),
            "a listen comm",
            "NULL",
        )?;
        let (mut s, mut r): (*mut c_void, *mut c_void) = (null(), null());
        until("connect + accept", || {
            if s.is_null() {
                c.rc(
                    "connect",
                    format_args!(
                        "dev={dev}, devComm={}",
                        if null_devcomm { "NULL" } else { "&NULL" }
                    ),
                    n.connect(ctx, dev, h.as_mut_ptr().cast(), &mut s, null_devcomm),
                )?;
            }
            if r.is_null() {
                c.rc("accept", "listenComm", n.accept(l, &mut r, !null_devcomm))?;
            }
            Ok(!s.is_null() && !r.is_null())
        })?;
        c.n += 2;
        // NCCL closes the listener as soon as accept returns a comm.
        c.ok("closeListen", "right after accept", n.close_listen(l))?;
        Ok(Pair { s, r })
    }
}

/// Requests being tested; `poll` tests every one not yet done, once.
struct Tracker {
    reqs: Vec<*mut c_void>,
    done: Vec<bool>,
    sizes: Vec<Vec<c_int>>,
    rev: bool,
}

impl Tracker {
    fn new(rev: bool) -> Self {
        Self {
            reqs: Vec::new(),
            done: Vec::new(),
            sizes: Vec::new(),
            rev,
        }
    }
    fn push(&mut self, r: *mut c_void) {
        self.reqs.push(r);
        self.done.push(false);
        self.sizes.push(vec![-1; 64]);
    }
    /// One pass of test() over the requests not done; true when all are.
    unsafe fn poll(&mut self, n: &dyn Net, c: &Checks) -> Res<bool> {
        let k = self.reqs.len();
        for j in 0..k {
            let i = if self.rev { k - 1 - j } else { j };
            if !self.done[i] {
                let mut d = 0;
                // SAFETY: each request is live until reported done; `sizes[i]`
                // has room for any n.
                let r = unsafe { n.test(self.reqs[i], &mut d, self.sizes[i].as_mut_ptr()) };
                if r != 0 {
                    return Err(c.fail(
                        "test",
                        format_args!("request #{i}"),
                        "ncclSuccess",
                        format_args!("result {r}"),
                    ));
                }
                self.done[i] = d == 1;
            }
        }
        Ok(self.done.iter().all(|&d| d))
    }
    /// Tests until all are done; returns the sizes each reported.
    unsafe fn wait(mut self, n: &dyn Net, c: &mut Checks) -> Res<Vec<Vec<c_int>>> {
        // SAFETY: forwarded.
        until("test() done", || unsafe { self.poll(n, c) })?;
        c.n += self.reqs.len();
        Ok(self.sizes)
    }
}

/// Tests every request until all are done; returns the sizes each reported.
unsafe fn wait_all(
    n: &dyn Net,
    c: &mut Checks,
    reqs: &[*mut c_void],
    order_rev: bool,
) -> Res<Vec<Vec<c_int>>> {
    let mut t = Tracker::new(order_rev);
    for &r in reqs {
        t.push(r);
    }
    // SAFETY: forwarded.
    unsafe { t.wait(n, c) }
}

/// `isend`, retried while the request is NULL; between tries the other end's
/// requests are tested, as the peer's own progress thread would.
unsafe fn isend_progress(
    n: &dyn Net,
    c: &mut Checks,
    s: *mut c_void,
    buf: &[u8],
    tag: c_int,
    mh: *mut c_void,
    other: &mut Tracker,
) -> Res<*mut c_void> {
    // NCCL does not clear *request: start from a stale value.
    let (data, size) = (buf.as_ptr(), buf.len());
    let mut req = std::ptr::without_provenance_mut::<c_void>(0xdead);
    until("isend request", || {
        // SAFETY: forwarded NCCL conventions.
        let r = unsafe { n.isend(s, data as *mut c_void, size, tag, mh, &mut req) };
        if r != 0 {
            return Err(c.fail(
                "isend",
                format_args!("size={size}, tag={tag}"),
                "ncclSuccess",
                format_args!("result {r}"),
            ));
        }
        if req.is_null() {
            // SAFETY: forwarded.
            unsafe { other.poll(n, c)? };
        }
        Ok(!req.is_null() && req as usize != 0xdead)
    })?;
    c.n += 1;
    Ok(req)
}

/// `isend` with nothing else to progress.
unsafe fn isend(
    n: &dyn Net,
    c: &mut Checks,
    s: *mut c_void,
    buf: &[u8],
    tag: c_int,
    mh: *mut c_void,
) -> Res<*mut c_void> {
    // SAFETY: forwarded.
    unsafe { isend_progress(n, c, s, buf, tag, mh, &mut Tracker::new(false)) }
}

unsafe fn irecv(
    n: &dyn Net,
    c: &mut Checks,
    r: *mut c_void,
    bufs: &mut [*mut c_void],
    sizes: &[usize],
    tags: &mut [c_int],
    mhs: &mut [*mut c_void],
) -> Res<*mut c_void> {
    // v9+: NCCL may leave NCCL_NET_OPTIONAL_RECV_COMPLETION (0x1) there.
    let mut req = std::ptr::without_provenance_mut::<c_void>(0x1);
    until("irecv request", || {
        // SAFETY: forwarded NCCL conventions.
        let rc = unsafe { n.irecv(r, bufs, sizes, tags, mhs, &mut req) };
        if rc != 0 {
            return Err(c.fail(
                "irecv",
                format_args!("n={}, sizes={sizes:?}, tags={tags:?}", bufs.len()),
                "ncclSuccess",
                format_args!("result {rc}"),
            ));
        }
        Ok(!req.is_null() && req as usize != 0x1)
    })?;
    c.n += 1;
    Ok(req)
}

/// A step's failure, prefixed with the step's name.
fn named<T>(step: &str, r: Res<T>) -> Res<T> {
    r.map_err(|e| format!("step `{step}`: {e}"))
}

/// Runs one cell; returns the number of checks that passed. The cell is a
/// sequence of named steps, in the order NCCL's calls come; a failure names
/// its step, then the call.
///
/// `peer` is a binary that serves `--serve <version> --provider <p>` (the demo).
pub fn cell(version: u32, provider: &str, peer: &Path) -> Res<usize> {
    crate::host::configure(provider);
    let lib = emu::open();
    let mut c = Checks {
        v: version,
        provider: provider.to_owned(),
        n: 0,
    };
    let c = &mut c;
    named("lookup", lookup(&lib, c))?;
    let n = emu::net(&lib, version);
    let n = &*n;
    // Every unsafe block below ("as above") calls a step that drives the
    // table as this version's NCCL does: `ctx` is what `init` returned, the
    // comms and handles passed are live ones of this table, buffers outlive
    // the requests on them.
    // SAFETY: `n` was opened by `emu::net`; `init` is its first call.
    let ctx = named("init", unsafe { init(n, c) })?;
    // SAFETY: as above.
    let nd = named("devices", unsafe { devices(n, c) })?;
    // Two connections: both forms of the device-handle argument.
    // SAFETY: as above.
    let a = named("pair with NULL devComm", unsafe { pair(n, c, ctx, true) })?;
    // SAFETY: as above.
    let b = named("pair with &NULL devComm", unsafe { pair(n, c, ctx, false) })?;
    // SAFETY: as above; `a` is live.
    let mut m = named("register", unsafe { Mem::register(n, c, &a, version) })?;
    named("regMrDmaBuf refused", dmabuf_refused(n, c, a.r, &mut m.dst))?;
    // SAFETY: as above; `a` and `m`'s handles are live.
    named("size sweep", unsafe { size_sweep(n, c, &a, &mut m) })?;
    // SAFETY: as above; `b` and `m`'s send handle are live.
    let bmh = named("regIsGlobal", unsafe { reg_is_global(n, c, &b, &m) })?;
    // SAFETY: as above; `a` and `m`'s send handle are live.
    let wmh = named("windows", unsafe { windows(n, c, &a, &m) })?;
    let (bmh, wmh) = (&bmh, &wmh);
    if provider.starts_with("tcp") || provider == "shm" {
        // SAFETY: as above; `a` and `m`'s send handle are live.
        named("truncation", unsafe { truncation(n, c, &a, &m) })?;
    }
    // NCCL deregisters, then closes.
    // SAFETY: as above; each handle was registered on the comm named and is
    // deregistered once, and nothing is in flight.
    named("deregister and close", unsafe {
        for (comm, mh) in [(a.s, m.smh), (a.r, m.rmh), (b.r, bmh.mh), (a.r, wmh.mh)] {
            c.ok("deregMr", "", n.dereg_mr(comm, mh))?;
        }
        c.ok("closeSend", "", n.close_send(a.s))?;
        c.ok("closeSend", "", n.close_send(b.s))?;
        c.ok("closeRecv", "", n.close_recv(a.r))?;
        c.ok("closeRecv", "", n.close_recv(b.r))
    })?;
    // NCCL's threads: a service thread opens, registers and closes comms
    // while two progress threads move data on comms of their own.
    // SAFETY: as above.
    c.n += named("threads", unsafe { threads(n, ctx, version, provider) })?;
    // SAFETY: as above.
    named("corrupted handle", unsafe { corrupted_handle(n, c, ctx) })?;
    // Two processes: the peer receives 16 x 1 MiB through the same table.
    // SAFETY: as above.
    let moved = named("two processes", unsafe {
        two_process(n, c, ctx, version, provider, peer)
    })?;
    c.that(
        moved == 16 << 20,
        "isend",
        "to another process",
        "16 MiB verified by the peer",
        moved,
    )?;
    if version >= 9 {
        // NIC fusion (v9+).
        // SAFETY: as above.
        named("makeVDevice", unsafe { vdev(n, c, ctx, nd) })?;
    } else {
        // SAFETY: as above.
        let made = unsafe { n.make_vdevice(1, &[0]) };
        c.that(
            made.is_none(),
            "makeVDevice",
            "",
            "no such member before v9",
            "one",
        )?;
    }
    if version >= 11 {
        // SAFETY: as above; the last use of `ctx`.
        let r = unsafe { n.finalize(ctx) };
        named("finalize", c.ok("finalize", "last context", r))?;
    }
    Ok(c.n)
}

/// NCCL's loader: newest version first, the first symbol found wins, and it
/// must be this cell's.
fn lookup(lib: &libloading::os::unix::Library, c: &mut Checks) -> Res {
    let version = c.v;
    let found = (5..=version).rev().find(|k| {
        // SAFETY: only the symbol's presence is read.
        unsafe { lib.get::<*const c_void>(format!("ncclNetPlugin_v{k}").as_bytes()) }.is_ok()
    });
    c.that(
        found == Some(version),
        "dlsym",
        "newest-first lookup",
        format_args!("ncclNetPlugin_v{version}"),
        format_args!("{found:?}"),
    )
}

/// The name read right after dlsym (NCCL_NET=Weft selects it; 2.12 compares
/// case-sensitively), then `init`; from v11 each communicator gets a context
/// of its own, and `finalize` ends one. Returns the context the rest uses.
///
/// # Safety
/// `n` is a table as [`emu::net`] opens it.
unsafe fn init(n: &dyn Net, c: &mut Checks) -> Res<*mut c_void> {
    let name = n.name();
    c.that(name == "Weft", "name", "before init", "\"Weft\"", &name)?;
    let mut ctx = null();
    // SAFETY: NCCL's first call of the table, with a writable context slot.
    c.ok("init", "first communicator", unsafe { n.init(&mut ctx) })?;
    if c.v >= 11 {
        c.that(!ctx.is_null(), "init", "v11+", "a context", "NULL")?;
        let mut more = [null::<c_void>(); 2];
        for m in &mut more {
            // SAFETY: as above.
            c.ok("init", "another communicator", unsafe { n.init(m) })?;
            c.that(
                !m.is_null() && *m != ctx,
                "init",
                "another communicator",
                "a new context",
                format_args!("{m:p}"),
            )?;
        }
        for m in more {
            // SAFETY: each context `init` returned, finalized once.
            c.ok("finalize", "per context", unsafe { n.finalize(m) })?;
        }
    }
    Ok(ctx)
}

/// `devices`, then `getProperties` of each device and of two that do not
/// exist. Returns the number of devices.
///
/// # Safety
/// `n` was initialised ([`init`]).
unsafe fn devices(n: &dyn Net, c: &mut Checks) -> Res<c_int> {
    let mut nd = 0;
    // SAFETY: a writable count.
    c.ok("devices", "", unsafe { n.devices(&mut nd) })?;
    c.that(nd >= 1, "devices", "", ">= 1", nd)?;
    for d in 0..nd {
        // SAFETY: `props` passes a struct of this version.
        match unsafe { n.props(d) } {
            Ok((pname, speed, recvs, rg)) => {
                c.that(
                    !pname.is_empty() && speed > 0 && recvs == 8,
                    "getProperties",
                    d,
                    "name, speed > 0, maxRecvs 8",
                    format_args!("{pname:?}, {speed}, {recvs}"),
                )?;
                if c.v >= 8 {
                    c.that(rg == 1, "getProperties", d, "regIsGlobal 1", rg)?;
                }
            }
            Err(r) => {
                return Err(c.fail(
                    "getProperties",
                    d,
                    "ncclSuccess",
                    format_args!("result {r}"),
                ))
            }
        }
    }
    for bad in [nd, -1] {
        // SAFETY: as above.
        let r = unsafe { n.props(bad) }.err();
        c.that(
            r == Some(3),
            "getProperties",
            bad,
            "ncclInternalError (3) for a device that does not exist",
            format_args!("{r:?}"),
        )?;
    }
    Ok(nd)
}

/// The data steps' memory: a pattern of 64 MiB + 1 registered on the first
/// pair's send comm, a receive buffer of 64 MiB + 64 on its receive comm.
struct Mem {
    src: Vec<u8>,
    dst: Vec<u8>,
    smh: *mut c_void,
    rmh: *mut c_void,
    max: usize,
}

impl Mem {
    /// # Safety
    /// `a` is a live pair of `n`.
    unsafe fn register(n: &dyn Net, c: &mut Checks, a: &Pair, version: u32) -> Res<Mem> {
        let max = 64usize << 20;
        let mut m = Mem {
            src: pattern(version as u64, 5, max + 1),
            dst: vec![0u8; max + 64],
            smh: null(),
            rmh: null(),
            max,
        };
        // SAFETY: live comms; the buffers live in `m`, which the caller keeps
        // until it deregisters them.
        unsafe {
            c.ok(
                "regMr",
                format_args!("sendComm, {} bytes", m.src.len()),
                n.reg_mr(a.s, m.src.as_ptr() as *mut c_void, m.src.len(), &mut m.smh),
            )?;
            c.ok(
                "regMr",
                format_args!("recvComm, {} bytes", m.dst.len()),
                n.reg_mr(a.r, m.dst.as_mut_ptr().cast(), m.dst.len(), &mut m.rmh),
            )?;
        }
        Ok(m)
    }
}

/// Sizes 0 B .. 64 MiB, each received into the whole buffer and its content
/// checked, then `iflush` of the host buffer (a NULL request: done).
///
/// # Safety
/// `a` is a live pair of `n` and `m`'s handles are registered on it.
unsafe fn size_sweep(n: &dyn Net, c: &mut Checks, a: &Pair, m: &mut Mem) -> Res {
    let max = m.max;
    for size in [0usize, 1, 4095, 4096, 65536, 1 << 20, 16 << 20, max] {
        // SAFETY: the buffers and handles of `m`, live through the wait.
        let sizes = unsafe {
            let rq = irecv(
                n,
                c,
                a.r,
                &mut [m.dst.as_mut_ptr().cast()],
                &[max + 64],
                &mut [5],
                &mut [m.rmh],
            )?;
            let sq = isend(n, c, a.s, &m.src[..size], 5, m.smh)?;
            wait_all(n, c, &[sq, rq], false)?
        };
        c.that(
            sizes[0][0] as usize == size,
            "test",
            format_args!("send of {size} B"),
            size,
            sizes[0][0],
        )?;
        c.that(
            sizes[1][0] as usize == size,
            "test",
            format_args!("receive of {size} B into {} B", max + 64),
            size,
            sizes[1][0],
        )?;
        c.that(
            m.dst[..size] == m.src[..size],
            "irecv",
            format_args!("{size} B"),
            "the bytes sent",
            "different bytes",
        )?;
        // iflush on host memory: NULL request, which NCCL treats as done.
        let mut fl = std::ptr::without_provenance_mut::<c_void>(0xbad);
        // SAFETY: the received buffer and its handle; `fl` is writable.
        let r = unsafe {
            n.iflush(
                a.r,
                &mut [m.dst.as_mut_ptr().cast()],
                &mut [sizes[1][0]],
                &mut [m.rmh],
                &mut fl,
            )
        };
        c.ok("iflush", "n=1, host memory", r)?;
        c.that(
            fl.is_null(),
            "iflush",
            "host memory",
            "a NULL request",
            format_args!("{fl:p}"),
        )?;
    }
    Ok(())
}

/// A buffer with its registration, kept until NCCL would deregister it.
struct Reg {
    _buf: Vec<u8>,
    mh: *mut c_void,
}

/// regIsGlobal: a handle registered on one comm serves another comm of the
/// device (the second pair sends with the first pair's send handle).
/// Returns the buffer registered on `b`'s receive comm.
///
/// # Safety
/// `b` is a live pair of `n`; `m.smh` is live.
unsafe fn reg_is_global(n: &dyn Net, c: &mut Checks, b: &Pair, m: &Mem) -> Res<Reg> {
    let mut bmh = null();
    let mut bdst = vec![0u8; 4096];
    // SAFETY: `bdst` lives until the caller deregisters it (in the `Reg`).
    unsafe {
        c.ok(
            "regMr",
            "second recvComm",
            n.reg_mr(b.r, bdst.as_mut_ptr().cast(), bdst.len(), &mut bmh),
        )?;
        let rq = irecv(
            n,
            c,
            b.r,
            &mut [bdst.as_mut_ptr().cast()],
            &[4096],
            &mut [6],
            &mut [bmh],
        )?;
        let sq = isend(n, c, b.s, &m.src[..4096], 6, m.smh)?;
        wait_all(n, c, &[sq, rq], false)?;
    }
    c.that(
        bdst[..] == m.src[..4096],
        "isend",
        "mhandle from another comm (regIsGlobal)",
        "the bytes sent",
        "different bytes",
    )?;
    Ok(Reg {
        _buf: bdst,
        mh: bmh,
    })
}

/// Windows: 32 grouped receives (n = maxRecvs) on the receive comm, 32 x 8
/// sends on the send comm, all in flight, tested in reverse order; each
/// buffer gets its tag's message, FIFO. Returns the window buffers.
///
/// # Safety
/// `a` is a live pair of `n`; `m.smh` is live.
unsafe fn windows(n: &dyn Net, c: &mut Checks, a: &Pair, m: &Mem) -> Res<Reg> {
    let slot = 256usize;
    let mut wbuf = vec![0u8; 32 * 8 * slot];
    let mut wmh = null();
    let src = &m.src;
    // SAFETY: `wbuf` lives until the caller deregisters it (in the `Reg`);
    // every request is waited for before the buffers are read.
    let sizes = unsafe {
        c.ok(
            "regMr",
            "window buffers",
            n.reg_mr(a.r, wbuf.as_mut_ptr().cast(), wbuf.len(), &mut wmh),
        )?;
        let mut rreqs = Tracker::new(true);
        for w in 0..32 {
            let mut bufs: Vec<*mut c_void> = (0..8)
                .map(|k| wbuf.as_mut_ptr().wrapping_add((w * 8 + k) * slot).cast())
                .collect();
            let mut tags: Vec<c_int> = (0..8).map(|k| 200 + k).collect();
            rreqs.push(irecv(
                n,
                c,
                a.r,
                &mut bufs,
                &[slot; 8],
                &mut tags,
                &mut [wmh; 8],
            )?);
        }
        let mut sreqs = Vec::new();
        for w in 0..32usize {
            for k in (0..8usize).rev() {
                let off = (w * 8 + k) * 7;
                sreqs.push(isend_progress(
                    n,
                    c,
                    a.s,
                    &src[off..off + 100 + k],
                    200 + k as c_int,
                    m.smh,
                    &mut rreqs,
                )?);
            }
        }
        wait_all(n, c, &sreqs, true)?;
        rreqs.wait(n, c)?
    };
    for w in 0..32usize {
        for k in 0..8usize {
            let got = &wbuf[(w * 8 + k) * slot..(w * 8 + k) * slot + 100 + k];
            let off = (w * 8 + k) * 7;
            c.that(
                sizes[w][k] as usize == 100 + k && got == &src[off..off + 100 + k],
                "irecv",
                format_args!("window {w}, buffer {k}, tag {}", 200 + k),
                "its tag's message, FIFO",
                format_args!("size {}", sizes[w][k]),
            )?;
        }
    }
    Ok(Reg {
        _buf: wbuf,
        mh: wmh,
    })
}

/// Truncation: 150 B into a 100 B receive is an error from `test()` (and,
/// under rdma, which learns the receiver's size first, from `isend`), and
/// nothing is written past the buffer. Only where the provider reports it.
///
/// # Safety
/// `a` is a live pair of `n`; `m.smh` is live.
unsafe fn truncation(n: &dyn Net, c: &mut Checks, a: &Pair, m: &Mem) -> Res {
    let mut small = vec![0x5Au8; 200];
    let mut tmh = null();
    // SAFETY: `small` outlives the receive and is deregistered here.
    unsafe {
        c.ok(
            "regMr",
            "truncation buffer",
            n.reg_mr(a.r, small.as_mut_ptr().cast(), small.len(), &mut tmh),
        )?;
        let rq = irecv(
            n,
            c,
            a.r,
            &mut [small.as_mut_ptr().cast()],
            &[100],
            &mut [9],
            &mut [tmh],
        )?;
        // SENDRECV reports it at the receiver only; rdma learns the
        // receiver's size first, so isend itself fails too.
        let mut sq = null();
        let mut sent = 0;
        until("isend of a truncated message", || {
            sent = n.isend(a.s, m.src.as_ptr() as *mut c_void, 150, 9, m.smh, &mut sq);
            Ok(sent != 0 || !sq.is_null())
        })?;
        c.that(
            sent == 0 || sent == 3,
            "isend",
            "150 B for a 100 B receive",
            "ncclSuccess, or ncclInternalError (3)",
            format_args!("result {sent}"),
        )?;
        let mut got = 0;
        until("truncated receive", || {
            let (mut d1, mut d2) = (0, 0);
            let mut sz = [0 as c_int; 64];
            if !sq.is_null() {
                let _ = n.test(sq, &mut d1, sz.as_mut_ptr());
            }
            got = n.test(rq, &mut d2, sz.as_mut_ptr());
            Ok(got != 0 || d2 == 1)
        })?;
        c.that(
            got == 3,
            "test",
            "150 B into a 100 B receive",
            "ncclInternalError (3)",
            format_args!("result {got}"),
        )?;
        c.that(
            small[100..].iter().all(|&x| x == 0x5A),
            "irecv",
            "truncated",
            "nothing written past the buffer",
            "bytes past the buffer",
        )?;
        c.ok("deregMr", "truncation buffer", n.dereg_mr(a.r, tmh))
    }
}

/// A corrupted handle: an error and no comm, no crash, no hang.
///
/// # Safety
/// `ctx` is `n`'s live context.
unsafe fn corrupted_handle(n: &dyn Net, c: &mut Checks, ctx: *mut c_void) -> Res {
    let mut bad = [0x42u8; 128];
    let mut sc = null();
    // SAFETY: a 128-byte handle buffer and a writable comm slot.
    let r = unsafe { n.connect(ctx, 0, bad.as_mut_ptr().cast(), &mut sc, true) };
    c.that(
        r == 3 && sc.is_null(),
        "connect",
        "corrupted handle",
        "ncclInternalError (3) and no comm",
        format_args!("result {r}"),
    )
}

/// `regMrDmaBuf` (v6+ tables serve it): on a device that did not claim
/// `NCCL_PTR_DMABUF` (none does without a GPU) it is refused as misuse, with
/// no handle written; a NULL handle slot is refused too.
fn dmabuf_refused(n: &dyn Net, c: &mut Checks, comm: *mut c_void, buf: &mut [u8]) -> Res {
    const CUDA: c_int = 2;
    const INVALID_USAGE: c_int = 5;
    let mut mh: *mut c_void = null();
    let (data, len) = (buf.as_mut_ptr().cast(), buf.len());
    // SAFETY: `comm` is a live receive comm of this table; `buf` is live;
    // `mh` is a writable slot (a NULL one is the second call's point).
    let Some(r) = (unsafe { n.reg_mr_dma_buf(comm, data, len, CUDA, 0, 0, &mut mh) }) else {
        return c.that(
            c.v < 6,
            "regMrDmaBuf",
            "absent",
            "a member of every v6+ table",
            "none",
        );
    };
    c.that(
        r == INVALID_USAGE && mh.is_null(),
        "regMrDmaBuf",
        "recvComm, CUDA, fd 0, on a device without NCCL_PTR_DMABUF",
        "ncclInvalidUsage (5), no handle",
        format_args!("result {r}, handle {mh:p}"),
    )?;
    // SAFETY: as above.
    let r = unsafe { n.reg_mr_dma_buf(comm, data, len, CUDA, 0, 0, null()) }.unwrap_or(0);
    c.that(
        r != 0,
        "regMrDmaBuf",
        "NULL mhandle",
        "an error",
        "ncclSuccess",
    )
}

/// `makeVDevice` (v9+): bad requests refused with nothing made; a virtual
/// device of device 0 numbered after the `nd` physical ones, with the
/// properties NCCL expects; data over it verified, below and above
/// `WEFT_STRIPE_SIZE` and several messages in flight; handles of a
/// physical and a virtual device do not connect.
unsafe fn vdev(n: &dyn Net, c: &mut Checks, ctx: *mut c_void, nd: c_int) -> Res {
    let cap = if c.v >= 12 { 8 } else { 4 };
    // SAFETY: NCCL's conventions, as in `cell`.
    unsafe {
        for (ndevs, devs, what) in [
            (0, vec![], "no device"),
            (
                cap + 1,
                vec![0; cap as usize],
                "more devices than vProps holds",
            ),
            (1, vec![nd], "a device that is not physical"),
            (1, vec![-1], "a negative device"),
            (2, vec![0, 0], "the same device twice"),
        ] {
            let r = n.make_vdevice(ndevs, &devs);
            c.that(
                matches!(r, Some((3, _))),
                "makeVDevice",
                what,
                "ncclInternalError (3)",
                format_args!("{r:?}"),
            )?;
        }
        let mut now = 0;
        c.ok("devices", "after refused makeVDevice", n.devices(&mut now))?;
        c.that(now == nd, "devices", "after refused makeVDevice", nd, now)?;
        let r = n.make_vdevice(1, &[0]);
        c.that(
            r == Some((0, nd)),
            "makeVDevice",
            "{1, [0]}",
            format_args!("ncclSuccess and index {nd}"),
            format_args!("{r:?}"),
        )?;
        let v = nd;
        c.ok("devices", "after makeVDevice", n.devices(&mut now))?;
        c.that(now == nd + 1, "devices", "after makeVDevice", nd + 1, now)?;
        let (pname, pspeed, ..) = n.props(0).map_err(|r| format!("getProperties(0): {r}"))?;
        let got = n.props(v);
        c.that(
            got.as_ref().is_ok_and(|(name, speed, recvs, _)| {
                *name == pname && *speed == pspeed && *recvs == 1
            }),
            "getProperties",
            v,
            format_args!("name {pname:?}, speed {pspeed}, maxRecvs 1"),
            format_args!("{got:?}"),
        )?;
        let (vp, vp0) = (n.vprops(v), n.vprops(0));
        c.that(
            vp.as_deref() == Some(&[0][..]) && vp0.as_deref() == Some(&[0][..]),
            "getProperties",
            "vProps of the virtual device and of device 0",
            "[0] and [0]",
            format_args!("{vp:?} and {vp0:?}"),
        )?;

        let p = pair_on(n, c, ctx, v, true)?;
        let max = 4usize << 20;
        let src = pattern(u64::from(c.v) + 77, 3, max);
        let mut dst = vec![0u8; max];
        let (mut smh, mut rmh) = (null(), null());
        c.ok(
            "regMr",
            "virtual device, sendComm",
            n.reg_mr(p.s, src.as_ptr() as *mut c_void, max, &mut smh),
        )?;
        c.ok(
            "regMr",
            "virtual device, recvComm",
            n.reg_mr(p.r, dst.as_mut_ptr().cast(), max, &mut rmh),
        )?;
        for size in [0usize, 1, 4096, 200_000, max] {
            dst.fill(0);
            let rq = irecv(
                n,
                c,
                p.r,
                &mut [dst.as_mut_ptr().cast()],
                &[max],
                &mut [3],
                &mut [rmh],
            )?;
            let sq = isend(n, c, p.s, &src[..size], 3, smh)?;
            let sizes = wait_all(n, c, &[sq, rq], size % 2 == 0)?;
            c.that(
                sizes[0][0] as usize == size
                    && sizes[1][0] as usize == size
                    && dst[..size] == src[..size],
                "test",
                format_args!("virtual device, {size} B"),
                "both sides report the size, the bytes arrive",
                format_args!("{} and {}", sizes[0][0], sizes[1][0]),
            )?;
        }
        // Eight messages of one tag in flight, sizes on both sides of the
        // stripe size, each in its own slice of the buffer.
        let slice = max / 8;
        let mut rreqs = Tracker::new(true);
        for k in 0..8 {
            rreqs.push(irecv(
                n,
                c,
                p.r,
                &mut [dst.as_mut_ptr().wrapping_add(k * slice).cast()],
                &[slice],
                &mut [4],
                &mut [rmh],
            )?);
        }
        let len = |k: usize| if k % 2 == 0 { slice - k } else { 1000 + k };
        let mut sreqs = Vec::new();
        for k in 0..8 {
            sreqs.push(isend_progress(
                n,
                c,
                p.s,
                &src[k..k + len(k)],
                4,
                smh,
                &mut rreqs,
            )?);
        }
        // Receives and sends tested together, as the two ranks' proxies
        // would (a receive's parts are posted once its header is read).
        for q in sreqs {
            rreqs.push(q);
        }
        let sizes = rreqs.wait(n, c)?;
        for k in 0..8 {
            c.that(
                sizes[k][0] as usize == len(k)
                    && dst[k * slice..k * slice + len(k)] == src[k..k + len(k)],
                "irecv",
                format_args!("virtual device, message {k} of 8 in flight"),
                format_args!("{} B, in order", len(k)),
                sizes[k][0],
            )?;
        }
        // Grouped receives: the virtual device said maxRecvs = 1.
        let mut q = null();
        let r = n.irecv(
            p.r,
            &mut [
                dst.as_mut_ptr().cast(),
                dst.as_mut_ptr().wrapping_add(8).cast(),
            ],
            &[8, 8],
            &mut [1, 2],
            &mut [rmh, rmh],
            &mut q,
        );
        c.that(
            r == 3 && q.is_null(),
            "irecv",
            "n = 2 on a virtual device",
            "ncclInternalError (3)",
            format_args!("result {r}"),
        )?;
        c.ok("deregMr", "virtual device", n.dereg_mr(p.s, smh))?;
        c.ok("deregMr", "virtual device", n.dereg_mr(p.r, rmh))?;
        c.ok("closeSend", "virtual device", n.close_send(p.s))?;
        c.ok("closeRecv", "virtual device", n.close_recv(p.r))?;

        // A virtual device's handle does not connect a physical device, nor
        // the other way round.
        for (ldev, cdev) in [(v, 0), (0, v)] {
            let mut h = [0u8; 128];
            let mut l = null();
            c.ok(
                "listen",
                ldev,
                n.listen(ctx, ldev, h.as_mut_ptr().cast(), &mut l),
            )?;
            let mut sc = null();
            let r = n.connect(ctx, cdev, h.as_mut_ptr().cast(), &mut sc, true);
            c.that(
                r == 3 && sc.is_null(),
                "connect",
                format_args!("dev {cdev} to a listener on dev {ldev}"),
                "ncclInternalError (3)",
                format_args!("result {r}"),
            )?;
            c.ok("closeListen", ldev, n.close_listen(l))?;
        }
    }
    Ok(())
}

/// Rounds each progress thread runs, and pairs the service thread cycles.
const THREAD_ROUNDS: usize = 48;
const SERVICE_PAIRS: usize = 6;

/// A service thread (listen, connect, accept, regMr, deregMr, close) beside
/// two progress threads (isend, irecv, test, each on a pair of its own) on
/// the same table at once, as NCCL runs them. Returns the checks made.
unsafe fn threads(n: &dyn Net, ctx: *mut c_void, version: u32, provider: &str) -> Res<usize> {
    let checks = || Checks {
        v: version,
        provider: provider.to_owned(),
        n: 0,
    };
    let mut c0 = checks();
    // SAFETY: NCCL's conventions, as in `cell`.
    let pairs = unsafe { [pair(n, &mut c0, ctx, true)?, pair(n, &mut c0, ctx, false)?] };
    let ctx_a = ctx as usize;
    let results: Vec<Res<usize>> = std::thread::scope(|sc| {
        let mut hs = Vec::new();
        for (k, p) in pairs.iter().enumerate() {
            let (s, r) = (p.s as usize, p.r as usize);
            hs.push(sc.spawn(move || -> Res<usize> {
                let mut c = checks();
                let (s, r) = (s as *mut c_void, r as *mut c_void);
                let len = 20_000 + 1000 * k;
                let mut dst = vec![0u8; len];
                let (mut smh, mut rmh) = (null(), null());
                // SAFETY: the buffers outlive every request (each round waits).
                unsafe {
                    for round in 0..THREAD_ROUNDS {
                        let src = pattern(round as u64, k as c_int, len);
                        c.ok(
                            "regMr",
                            "progress thread",
                            n.reg_mr(s, src.as_ptr() as *mut c_void, len, &mut smh),
                        )?;
                        c.ok(
                            "regMr",
                            "progress thread",
                            n.reg_mr(r, dst.as_mut_ptr().cast(), len, &mut rmh),
                        )?;
                        let rq = irecv(
                            n,
                            &mut c,
                            r,
                            &mut [dst.as_mut_ptr().cast()],
                            &[len],
                            &mut [7],
                            &mut [rmh],
                        )?;
                        let sq = isend(n, &mut c, s, &src, 7, smh)?;
                        let sizes = wait_all(n, &mut c, &[sq, rq], round % 2 == 1)?;
                        c.that(
                            sizes[1][0] == len as c_int && dst == src,
                            "test",
                            format_args!("progress thread {k}, round {round}"),
                            format_args!("{len} bytes as sent"),
                            format_args!(
                                "{} bytes, content {}",
                                sizes[1][0],
                                if dst == src { "equal" } else { "different" }
                            ),
                        )?;
                        c.ok("deregMr", "progress thread", n.dereg_mr(s, smh))?;
                        c.ok("deregMr", "progress thread", n.dereg_mr(r, rmh))?;
                    }
                }
                Ok(c.n)
            }));
        }
        hs.push(sc.spawn(move || -> Res<usize> {
            let mut c = checks();
            let ctx = ctx_a as *mut c_void;
            let buf = vec![0u8; 1 << 16];
            // SAFETY: NCCL's conventions; `buf` outlives its registrations.
            unsafe {
                for i in 0..SERVICE_PAIRS {
                    let p = pair(n, &mut c, ctx, i % 2 == 0)?;
                    let (mut a, mut b) = (null(), null());
                    c.ok(
                        "regMr",
                        "service thread",
                        n.reg_mr(p.s, buf.as_ptr() as *mut c_void, buf.len(), &mut a),
                    )?;
                    c.ok(
                        "regMr",
                        "service thread",
                        n.reg_mr(p.r, buf.as_ptr() as *mut c_void, 4096, &mut b),
                    )?;
                    c.ok("deregMr", "service thread", n.dereg_mr(p.s, a))?;
                    c.ok("deregMr", "service thread", n.dereg_mr(p.r, b))?;
                    c.ok("closeSend", "service thread", n.close_send(p.s))?;
                    c.ok("closeRecv", "service thread", n.close_recv(p.r))?;
                }
            }
            Ok(c.n)
        }));
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a thread panicked".to_owned()))
            })
            .collect()
    });
    let mut total = c0.n;
    for r in results {
        total += r?;
    }
    for p in pairs {
        // SAFETY: both comms are live and idle.
        unsafe {
            c0.ok("closeSend", "after the threads", n.close_send(p.s))?;
            c0.ok("closeRecv", "after the threads", n.close_recv(p.r))?;
        }
    }
    Ok(total + 4)
}

unsafe fn two_process(
    n: &dyn Net,
    c: &mut Checks,
    ctx: *mut c_void,
    version: u32,
    provider: &str,
    peer: &Path,
) -> Res<usize> {
    let server = crate::peer::Server::spawn(peer, version, provider, 16)?;
    let mut h = server.handle;
    let size = 1usize << 20;
    let msgs: Vec<u8> = (0..16u64).flat_map(|i| pattern(i, 3, size)).collect();
    let (mut s, mut mh) = (null(), null());
    // SAFETY: NCCL's conventions; `msgs` outlives the requests.
    unsafe {
        until("connect to the peer", || {
            c.rc(
                "connect",
                "to another process",
                n.connect(ctx, 0, h.as_mut_ptr().cast(), &mut s, true),
            )?;
            Ok(!s.is_null())
        })?;
        c.n += 1;
        c.ok(
            "regMr",
            "two-process buffers",
            n.reg_mr(s, msgs.as_ptr() as *mut c_void, msgs.len(), &mut mh),
        )?;
        let mut reqs = Vec::new();
        for i in 0..16 {
            reqs.push(isend(n, c, s, &msgs[i * size..(i + 1) * size], 3, mh)?);
            if reqs.len() == 8 {
                wait_all(n, c, &reqs, false)?;
                reqs.clear();
            }
        }
        wait_all(n, c, &reqs, false)?;
    }
    let verdict = server.finish()?;
    // SAFETY: as above.
    unsafe {
        c.ok("deregMr", "two-process buffers", n.dereg_mr(s, mh))?;
        c.ok("closeSend", "two-process comm", n.close_send(s))?;
    }
    let moved = verdict
        .strip_prefix("ok 16 ")
        .and_then(|b| b.parse::<usize>().ok())
        .ok_or_else(|| format!("peer: {verdict}"))?;
    Ok(moved)
}
