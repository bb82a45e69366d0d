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

mod data;
mod threads;
mod vdev;
use data::*;
use threads::*;
use vdev::*;

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
                c.rc("test", format_args!("request #{i}"), r)?;
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
        c.rc("isend", format_args!("size={size}, tag={tag}"), r)?;
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
        let args = format_args!("n={}, sizes={sizes:?}, tags={tags:?}", bufs.len());
        c.rc("irecv", args, rc)?;
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
                    "ncclSuccess (0)",
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
