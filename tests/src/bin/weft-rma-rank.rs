//! One rank of an RMA group, driving one of Weft's `ncclRmaPlugin_vN`
//! tables the way NCCL's RMA proxy and GIN proxy do, for
//! `tests/tests/rma_group.rs`. Run with the fake CUDA driver on
//! `LD_LIBRARY_PATH` and `WEFT_TEST_HMEM=system`, so that NCCL's CUDA
//! registrations (signals, flush buffer, windows) are the fake driver's
//! device memory, which is host memory the test can read.
//!
//! ```text
//! weft-rma-rank VERSION RANK NRANKS DIR [SCENARIO]
//!   VERSION   13 | 14 | 15 | 16
//!   DIR       where ranks leave their handles (rank.N) for one another
//!   SCENARIO  full (default): puts of 0 B .. MAX_PUT verified at the
//!             signal, every signal op, signal-only ops, 32 x maxRecvs puts
//!             in flight per peer, gets and flushes, refused forgeries;
//!             die-after-connect: rank 1 exits once connected, rank 0
//!             must see rank 1's requests fail within WEFT_PEER_TIMEOUT
//!             while its own puts to itself go on;
//!             stale-key: rank 1 deregisters a buffer whose key rank 0
//!             still holds, rank 0 puts into it and signals; rank 1's
//!             provider must refuse the put (its memory unchanged), the
//!             signal must never be applied, and rank 1 must declare
//!             rank 0 dead within WEFT_PEER_TIMEOUT
//! ```
//!
//! Prints `ok ...` lines; any failure prints `error ...` and exits 1.

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

/// `NCCL_PTR_HOST`, `NCCL_PTR_CUDA`.
const PTR_HOST: c_int = 1;
const PTR_CUDA: c_int = 2;
/// `NCCL_NET_MR_FLAG_FORCE_SO`, `NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET`.
const FORCE_SO: u64 = 1;
const NEVER_RESET: u64 = 2;
const INC: u32 = 1;
const ADD: u32 = 2;

type P = *mut c_void;

/// One RMA table, as closures over its members with the newest
/// signatures (older versions' extra or missing arguments filled in).
/// Each field is the C member's own signature, hence the long types.
#[allow(clippy::type_complexity)]
struct Api {
    init: Box<dyn Fn(&mut P) -> c_int>,
    devices: Box<dyn Fn(&mut c_int) -> c_int>,
    net_device_type: Box<dyn Fn(c_int) -> (c_int, c_int)>,
    listen: Box<dyn Fn(P, c_int, P, &mut P) -> c_int>,
    connect: Box<dyn Fn(P, *mut P, c_int, c_int, P, &mut P) -> c_int>,
    create_context: Box<dyn Fn(P, c_int, &mut P) -> c_int>,
    reg: Box<dyn Fn(P, P, usize, c_int, u64, &mut P) -> c_int>,
    dereg: Box<dyn Fn(P, P) -> c_int>,
    destroy: Box<dyn Fn(P) -> c_int>,
    close_coll: Box<dyn Fn(P) -> c_int>,
    close_listen: Box<dyn Fn(P) -> c_int>,
    iput: Box<dyn Fn(P, c_int, u64, P, usize, u64, P, u32, &mut P) -> c_int>,
    iput_signal:
        Box<dyn Fn(P, u64, P, usize, u64, P, u32, u64, P, u64, u32, bool, &mut P) -> c_int>,
    iget: Box<dyn Fn(P, u64, P, usize, u64, P, u32, &mut P) -> c_int>,
    iflush: Box<dyn Fn(P, P, u32, &mut P) -> c_int>,
    test: Box<dyn Fn(P, P, &mut c_int) -> c_int>,
    progress: Box<dyn Fn(P) -> c_int>,
    query: Box<dyn Fn(P, &mut bool) -> c_int>,
    rma_props: Option<Box<dyn Fn(P, &mut bool) -> c_int>>,
    finalize: Box<dyn Fn(P) -> c_int>,
}

/// The members every version shares; `$props` its properties struct.
macro_rules! common {
    ($m:ident, $t:ident, $props:ident, $more:expr) => {{
        use weft::$m as v;
        let t = &v::$t;
        let f: fn(&mut Api) = $more;
        // SAFETY: each closure calls one member of the table with the
        // pointers this program passes, as NCCL would pass them.
        let mut a = unsafe {
            Api {
                init: Box::new(|c| {
                    t.init.unwrap()(c, 7, Some(weft_tests::capture::weft_test_stderr_logger))
                }),
                devices: Box::new(|n| t.devices.unwrap()(n)),
                net_device_type: Box::new(|d| {
                    let mut p: v::$props = std::mem::zeroed();
                    let rc = t.getProperties.unwrap()(d, &mut p);
                    (rc, p.netDeviceType)
                }),
                listen: Box::new(|c, d, h, l| t.listen.unwrap()(c, d, h, l)),
                connect: Box::new(|c, h, n, r, l, o| t.connect.unwrap()(c, h, n, r, l, o)),
                create_context: Box::new(|_, _, _| -1),
                reg: Box::new(|_, _, _, _, _, _| -1),
                dereg: Box::new(|c, m| t.deregMrSym.unwrap()(c, m)),
                destroy: Box::new(|c| t.destroyContext.unwrap()(c)),
                close_coll: Box::new(|c| t.closeColl.unwrap()(c)),
                close_listen: Box::new(|c| t.closeListen.unwrap()(c)),
                iput: Box::new(|_, _, _, _, _, _, _, _, _| -1),
                iput_signal: Box::new(|_, _, _, _, _, _, _, _, _, _, _, _, _| -1),
                iget: Box::new(|_, _, _, _, _, _, _, _| -1),
                iflush: Box::new(|c, m, r, q| t.iflush.unwrap()(c, 0, m, r, q)),
                test: Box::new(|c, r, d| t.test.unwrap()(c, r, d)),
                progress: Box::new(|_| -1),
                query: Box::new(|c, h| t.queryLastError.unwrap()(c, h)),
                rma_props: None,
                finalize: Box::new(|c| t.finalize.unwrap()(c)),
            }
        };
        f(&mut a);
        a
    }};
}

/// The members v15 and later share (`optFlags` before `request`).
macro_rules! optflags {
    ($a:ident, $m:ident, $t:ident, $cfg:ident, $opt:expr) => {{
        use weft::$m as v;
        let t = &v::$t;
        // SAFETY: as in `common!`.
        unsafe {
            $a.create_context = Box::new(|c, n, o| {
                let mut cfg = v::$cfg {
                    nContexts: n,
                    trafficClass: -1,
                    rankStride: 1,
                };
                t.createContext.unwrap()(c, &mut cfg, o)
            });
            $a.reg = Box::new(|c, d, s, ty, fl, o| t.regMrSym.unwrap()(c, d, s, ty, fl, o));
            $a.iput = Box::new(|c, k, so, sm, s, d, dm, r, q| {
                t.iput.unwrap()(c, k, so, sm, s, d, dm, r, $opt, q)
            });
            $a.iput_signal = Box::new(|c, so, sm, s, d, dm, r, go, gm, gv, op, strong, q| {
                t.iputSignal.unwrap()(c, 0, so, sm, s, d, dm, r, go, gm, gv, op, strong, $opt, q)
            });
            $a.iget = Box::new(|c, ro, rm, s, lo, lm, r, q| {
                t.iget.unwrap()(c, 0, ro, rm, s, lo, lm, r, $opt, q)
            });
            $a.progress = Box::new(|c| t.rmaProgress.unwrap()(c));
        }
    }};
}

fn api(version: u32) -> Api {
    match version {
        13 => common!(rma_v13, ncclRmaPlugin_v13, ncclNetProperties_v13_t, |a| {
            use weft::rma_v13 as v;
            let t = &v::ncclRmaPlugin_v13;
            // SAFETY: as in `common!`.
            unsafe {
                a.create_context = Box::new(|c, n, o| {
                    let mut cfg: v::ncclGinConfig_v13_t = std::mem::zeroed();
                    cfg.nContexts = n;
                    cfg.trafficClass = -1;
                    let mut dev = null_mut();
                    t.createContext.unwrap()(c, &mut cfg, o, &mut dev)
                });
                a.reg = Box::new(|c, d, s, ty, fl, o| {
                    let mut gin = null_mut();
                    t.regMrSym.unwrap()(c, d, s, ty, fl, o, &mut gin)
                });
                a.iput = Box::new(|c, k, so, sm, s, d, dm, r, q| {
                    t.iput.unwrap()(c, k, so, sm, s, d, dm, r, q)
                });
                a.iput_signal = Box::new(|c, so, sm, s, d, dm, r, go, gm, gv, op, _strong, q| {
                    t.iputSignal.unwrap()(c, 0, so, sm, s, d, dm, r, go, gm, gv, op, q)
                });
                a.iget = Box::new(|c, ro, rm, s, lo, lm, r, q| {
                    t.iget.unwrap()(c, 0, ro, rm, s, lo, lm, r, q)
                });
                a.progress = Box::new(|c| t.ginProgress.unwrap()(c));
            }
        }),
        14 => common!(rma_v14, ncclRmaPlugin_v14, ncclNetProperties_v14_t, |a| {
            use weft::rma_v14 as v;
            let t = &v::ncclRmaPlugin_v14;
            // SAFETY: as in `common!`.
            unsafe {
                a.create_context = Box::new(|c, n, o| {
                    let mut cfg = v::ncclRmaConfig_v14_t {
                        nContexts: n,
                        trafficClass: -1,
                        rankStride: 1,
                    };
                    t.createContext.unwrap()(c, &mut cfg, o)
                });
                a.reg = Box::new(|c, d, s, ty, fl, o| t.regMrSym.unwrap()(c, d, s, ty, fl, o));
                a.iput = Box::new(|c, k, so, sm, s, d, dm, r, q| {
                    t.iput.unwrap()(c, k, so, sm, s, d, dm, r, q)
                });
                a.iput_signal = Box::new(|c, so, sm, s, d, dm, r, go, gm, gv, op, strong, q| {
                    t.iputSignal.unwrap()(c, 0, so, sm, s, d, dm, r, go, gm, gv, op, strong, q)
                });
                a.iget = Box::new(|c, ro, rm, s, lo, lm, r, q| {
                    t.iget.unwrap()(c, 0, ro, rm, s, lo, lm, r, q)
                });
                a.progress = Box::new(|c| t.rmaProgress.unwrap()(c));
            }
        }),
        15 => common!(rma_v15, ncclRmaPlugin_v15, ncclNetProperties_v15_t, |a| {
            // optFlags 1: the aggregation hint, which must change nothing.
            optflags!(a, rma_v15, ncclRmaPlugin_v15, ncclRmaConfig_v15_t, 1);
        }),
        16 => common!(rma_v16, ncclRmaPlugin_v16, ncclNetProperties_v16_t, |a| {
            optflags!(a, rma_v16, ncclRmaPlugin_v16, ncclRmaConfig_v16_t, 0);
            use weft::rma_v16 as v;
            let t = &v::ncclRmaPlugin_v16;
            // SAFETY: as in `common!`.
            unsafe {
                a.rma_props = Some(Box::new(|c, out| {
                    let mut p = v::ncclRmaProperties_v16_t {
                        flushesAllPutsOnAnySignal: true,
                    };
                    let rc = t.getRmaProperties.unwrap()(c, &mut p);
                    *out = p.flushesAllPutsOnAnySignal;
                    rc
                }));
            }
        }),
        v => fail(format!("no RMA table v{v}")),
    }
}

fn fail(msg: String) -> ! {
    println!("error {msg}");
    std::process::exit(1)
}

fn check(what: &str, rc: c_int) {
    if rc != 0 {
        fail(format!("{what} returned {rc}"));
    }
}

/// Device memory of the fake driver (host memory it knows as device memory).
fn cuda_alloc(bytes: usize) -> *mut u8 {
    let drv = weft::gpu::driver().unwrap_or_else(|e| fail(format!("no driver: {e}")));
    drv.alloc(0, bytes)
        .unwrap_or_else(|e| fail(format!("cuMemAlloc: {e}")))
        .as_ptr()
}

/// A 64-bit value in (fake) device memory.
fn read_u64(p: *const u8, i: usize) -> u64 {
    // SAFETY: `p` is an 8-byte aligned allocation of at least i+1 values;
    // the plugin writes it through the (fake) driver, from this process.
    unsafe { std::ptr::read_volatile(p.cast::<u64>().add(i)) }
}

struct Rank {
    a: Api,
    rank: u32,
    n: u32,
    coll: P,
    ctx: P,
    deadline: Duration,
    /// What the barrier slot has reached.
    acks: std::cell::Cell<u64>,
}

impl Rank {
    /// Tests `req` until done, calling the progress member in the loop.
    fn wait(&self, req: P, what: &str) {
        let t0 = Instant::now();
        loop {
            check("rmaProgress", (self.a.progress)(self.ctx));
            let mut done = 0;
            check(
                &format!("test ({what})"),
                (self.a.test)(self.coll, req, &mut done),
            );
            if done == 1 {
                return;
            }
            if t0.elapsed() > self.deadline {
                fail(format!("{what}: not done after {:?}", self.deadline));
            }
        }
    }
    /// Every rank adds 1 to every rank's last signal slot (signal-only
    /// ops) and waits until all have: a barrier, counted in `self.acks`.
    fn barrier(&self, sig: &*mut u8, sig_mh: P, what: &str) {
        for peer in 0..self.n {
            let mut q = null_mut();
            let off = u64::from(self.n) * 8;
            check(
                &format!("barrier signal ({what})"),
                (self.a.iput_signal)(
                    self.ctx,
                    0,
                    null_mut(),
                    0,
                    0,
                    null_mut(),
                    peer,
                    off,
                    sig_mh,
                    0,
                    INC,
                    true,
                    &mut q,
                ),
            );
            self.wait(q, what);
        }
        self.acks.set(self.acks.get() + u64::from(self.n));
        self.wait_signal(*sig, self.n as usize, self.acks.get(), what);
    }
    /// Progresses until the signal `i` of `sig` is at least `want`.
    fn wait_signal(&self, sig: *const u8, i: usize, want: u64, what: &str) -> u64 {
        let t0 = Instant::now();
        loop {
            let v = read_u64(sig, i);
            if v >= want {
                return v;
            }
            check("rmaProgress", (self.a.progress)(self.ctx));
            if t0.elapsed() > self.deadline {
                fail(format!("{what}: signal {i} is {v}, waited for {want}"));
            }
        }
    }
}

/// The byte rank `r` puts at position `i` of round `round`.
fn pattern(r: u32, round: u32, i: usize) -> u8 {
    (i as u32).wrapping_mul(31).wrapping_add(r * 7 + round * 13) as u8
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        fail("usage: weft-rma-rank VERSION RANK NRANKS DIR [SCENARIO]".into());
    }
    let version: u32 = args[1].parse().unwrap_or_else(|_| fail("VERSION".into()));
    let rank: u32 = args[2].parse().unwrap_or_else(|_| fail("RANK".into()));
    let n: u32 = args[3].parse().unwrap_or_else(|_| fail("NRANKS".into()));
    let dir = PathBuf::from(&args[4]);
    let scenario = args.get(5).map_or("full", String::as_str).to_owned();
    weft_tests::host::configure(&std::env::var("WEFT_PROVIDER").unwrap_or("shm".into()));
    let a = api(version);

    // NCCL 2.30.7: init for RMA, init again as the GIN proxy's backend
    // (a "net" context stands in for what connect is handed).
    let (mut rma_ctx, mut net_ctx) = (null_mut(), null_mut());
    check("init", (a.init)(&mut rma_ctx));
    check("init (second)", (a.init)(&mut net_ctx));
    let mut ndev = 0;
    check("devices", (a.devices)(&mut ndev));
    if ndev < 1 {
        fail(format!("devices = {ndev}"));
    }
    let (rc, ty) = (a.net_device_type)(0);
    check("getProperties", rc);
    println!("ok devices {ndev} netDeviceType {ty}");

    let mut handle = [0u8; 128];
    let mut listen = null_mut();
    check(
        "listen",
        (a.listen)(rma_ctx, 0, handle.as_mut_ptr().cast(), &mut listen),
    );
    std::fs::write(dir.join(format!("rank.{rank}.tmp")), handle).unwrap();
    std::fs::rename(
        dir.join(format!("rank.{rank}.tmp")),
        dir.join(format!("rank.{rank}")),
    )
    .unwrap();
    let mut all: Vec<[u8; 128]> = Vec::new();
    let t0 = Instant::now();
    for r in 0..n {
        let p = dir.join(format!("rank.{r}"));
        loop {
            if let Ok(b) = std::fs::read(&p) {
                all.push(b.try_into().unwrap());
                break;
            }
            if t0.elapsed() > Duration::from_secs(60) {
                fail(format!("no handle from rank {r}"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let mut ptrs: Vec<P> = all.iter_mut().map(|h| h.as_mut_ptr().cast()).collect();
    let mut coll = null_mut();
    check(
        "connect",
        (a.connect)(
            net_ctx,
            ptrs.as_mut_ptr(),
            n as c_int,
            rank as c_int,
            listen,
            &mut coll,
        ),
    );
    check("closeListen", (a.close_listen)(listen));
    let mut ctx = null_mut();
    check("createContext", (a.create_context)(coll, 1, &mut ctx));
    println!("ok connected rank {rank} of {n}");
    if let Some(f) = &a.rma_props {
        let mut flushes = true;
        check("getRmaProperties", f(coll, &mut flushes));
        println!("ok flushesAllPutsOnAnySignal {flushes}");
    }

    let timeout = std::env::var("WEFT_TEST_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let me = Rank {
        a,
        rank,
        n,
        coll,
        ctx,
        deadline: Duration::from_secs(timeout),
        acks: Default::default(),
    };
    match scenario.as_str() {
        "die-after-connect" => return die_after_connect(&me),
        "stale-key" => return stale_key(&me, &dir),
        _ => {}
    }
    full(&me);
    // Teardown as NCCL's RMA proxy does it.
    check("destroyContext", (me.a.destroy)(ctx));
    check("closeColl", (me.a.close_coll)(coll));
    check("finalize", (me.a.finalize)(rma_ctx));
    check("finalize (second)", (me.a.finalize)(net_ctx));
    println!("ok done");
}

/// Signals: NCCL's (nranks+1) x 8 B, CUDA, FORCE_SO | NEVER_RESET.
fn signals(r: &Rank) -> (*mut u8, P) {
    let sig = cuda_alloc((r.n as usize + 1) * 8);
    // cuMemAlloc does not zero (nor does the fake driver: whatever the heap
    // held is there), and NCCL clears its signals before use: so must this,
    // or a stale value reads as a signal already applied.
    // SAFETY: (n + 1) * 8 bytes just allocated; the fake driver's device
    // memory is host memory; nothing else uses it yet.
    unsafe { std::ptr::write_bytes(sig, 0, (r.n as usize + 1) * 8) };
    let mut mh = null_mut();
    check(
        "regMrSym (signals)",
        (r.a.reg)(
            r.coll,
            sig.cast(),
            (r.n as usize + 1) * 8,
            PTR_CUDA,
            FORCE_SO | NEVER_RESET,
            &mut mh,
        ),
    );
    (sig, mh)
}

fn full(r: &Rank) {
    let n = r.n as usize;
    let max_put: usize = std::env::var("MAX_PUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64 << 20);
    let (sig, sig_mh) = signals(r);
    // A window: rank j's put lands at [j * slot, (j+1) * slot).
    let slot = max_put;
    let win_len = slot * n;
    let win = cuda_alloc(win_len);
    let mut win_mh = null_mut();
    check(
        "regMrSym (window)",
        (r.a.reg)(r.coll, win.cast(), win_len, PTR_CUDA, 0, &mut win_mh),
    );
    let src = cuda_alloc(slot);
    let mut src_mh = null_mut();
    check(
        "regMrSym (source)",
        (r.a.reg)(r.coll, src.cast(), slot, PTR_CUDA, 0, &mut src_mh),
    );
    // A host registration (the GIN inline buffer is host memory).
    let mut host = vec![0u64; 64];
    let mut host_mh = null_mut();
    check(
        "regMrSym (host)",
        (r.a.reg)(
            r.coll,
            host.as_mut_ptr().cast(),
            64 * 8,
            PTR_HOST,
            0,
            &mut host_mh,
        ),
    );

    // Puts of every size, each with a strong INC signal; the target checks
    // the data the moment it sees the signal.
    let sizes: Vec<usize> = [
        0,
        1,
        8,
        4095,
        4096,
        65536,
        1 << 20,
        8 << 20,
        9 << 20,
        64 << 20,
    ]
    .into_iter()
    .filter(|&s| s <= max_put)
    .collect();
    for (round, &size) in sizes.iter().enumerate() {
        let round = round as u32;
        // SAFETY: `src` holds `slot` >= size bytes; no operation reads it now.
        let s = unsafe { std::slice::from_raw_parts_mut(src, size) };
        for (i, b) in s.iter_mut().enumerate() {
            *b = pattern(r.rank, round, i);
        }
        let mut reqs = Vec::new();
        for peer in 0..r.n {
            let mut q = null_mut();
            let off = (r.rank as usize * slot) as u64;
            check(
                &format!("iputSignal {size} B to {peer}"),
                (r.a.iput_signal)(
                    r.ctx,
                    0,
                    src_mh,
                    size,
                    off,
                    win_mh,
                    peer,
                    (r.rank as u64) * 8,
                    sig_mh,
                    0,
                    INC,
                    true,
                    &mut q,
                ),
            );
            if q.is_null() {
                fail("iputSignal gave a NULL request".into());
            }
            reqs.push(q);
        }
        // Every rank's put into this rank: check it as soon as its signal shows.
        for from in 0..r.n {
            r.wait_signal(
                sig,
                from as usize,
                u64::from(round) + 1,
                &format!("round {round} ({size} B) from {from}"),
            );
            // SAFETY: rank `from`'s slot of the window, written before its signal.
            let got = unsafe { std::slice::from_raw_parts(win.add(from as usize * slot), size) };
            if let Some(i) = (0..size).find(|&i| got[i] != pattern(from, round, i)) {
                fail(format!("round {round}: {size} B from rank {from}: byte {i} not there when its signal was"));
            }
        }
        for q in reqs {
            r.wait(q, "iputSignal");
        }
        // The next round rewrites the same slots: not before every rank checked this one.
        r.barrier(&sig, sig_mh, &format!("round {round} checked"));
        println!("ok put {size} B to every rank, seen with its signal");
    }
    let base = sizes.len() as u64;

    // 32 x maxRecvs (1) plain puts in flight per peer, then one ADD signal
    // carrying 1000: it must not show before all 32.
    let size = 4096.min(slot / 32);
    let mut reqs = Vec::new();
    for peer in 0..r.n {
        for k in 0..32 {
            let mut q = null_mut();
            let off = (r.rank as usize * slot + k * size) as u64;
            check(
                "iput",
                (r.a.iput)(r.ctx, 0, 0, src_mh, size, off, win_mh, peer, &mut q),
            );
            reqs.push(q);
        }
        let mut q = null_mut();
        check(
            "iputSignal (signal only, ADD)",
            (r.a.iput_signal)(
                r.ctx,
                0,
                null_mut(),
                0,
                0,
                null_mut(),
                peer,
                (r.rank as u64) * 8,
                sig_mh,
                1000,
                ADD,
                true,
                &mut q,
            ),
        );
        reqs.push(q);
    }
    for from in 0..r.n {
        r.wait_signal(sig, from as usize, base + 1000, &format!("ADD from {from}"));
        for k in 0..32 {
            // SAFETY: inside the window.
            let got = unsafe {
                std::slice::from_raw_parts(win.add(from as usize * slot + k * size), size)
            };
            let want: Vec<u8> = (0..size)
                .map(|i| pattern(from, base as u32 - 1, i))
                .collect();
            if got != &want[..] {
                fail(format!(
                    "put {k} from rank {from} not there when the ADD signal was"
                ));
            }
        }
    }
    for q in reqs {
        r.wait(q, "32 puts");
    }
    r.barrier(&sig, sig_mh, "32 puts checked");
    println!("ok 32 puts in flight per peer, then a signal-only ADD seen after them");

    // A weak signal into host memory (INC) from every rank.
    let mut reqs = Vec::new();
    for peer in 0..r.n {
        let mut q = null_mut();
        check(
            "iputSignal (weak, host)",
            (r.a.iput_signal)(
                r.ctx,
                0,
                src_mh,
                8,
                (r.rank as usize * slot) as u64,
                win_mh,
                peer,
                (r.rank as u64) * 8,
                host_mh,
                0,
                INC,
                false,
                &mut q,
            ),
        );
        reqs.push(q);
    }
    for from in 0..n {
        let t0 = Instant::now();
        // SAFETY: the host buffer lives until the end; the plugin adds atomically.
        while unsafe { std::ptr::read_volatile(host.as_ptr().add(from)) } < 1 {
            check("rmaProgress", (r.a.progress)(r.ctx));
            if t0.elapsed() > r.deadline {
                fail(format!("host signal from {from}"));
            }
        }
    }
    for q in reqs {
        r.wait(q, "weak signal");
    }
    println!("ok weak signals into host memory");

    // Gets: each rank reads every rank's source buffer, then flushes.
    let dst = cuda_alloc(slot);
    let mut dst_mh = null_mut();
    check(
        "regMrSym (get destination)",
        (r.a.reg)(r.coll, dst.cast(), slot, PTR_CUDA, 0, &mut dst_mh),
    );
    let get = size.min(slot);
    for peer in 0..r.n {
        let mut q = null_mut();
        check(
            "iget",
            (r.a.iget)(r.ctx, 0, src_mh, get, 0, dst_mh, peer, &mut q),
        );
        r.wait(q, "iget");
        let mut f = null_mut();
        check("iflush", (r.a.iflush)(r.ctx, dst_mh, peer, &mut f));
        if !f.is_null() {
            r.wait(f, "iflush");
        }
        // SAFETY: `get` bytes of `dst`, read back by the get just done.
        let got = unsafe { std::slice::from_raw_parts(dst, get) };
        let want: Vec<u8> = (0..get)
            .map(|i| pattern(peer, base as u32 - 1, i))
            .collect();
        if got != &want[..] {
            fail(format!("get from rank {peer}: wrong bytes"));
        }
    }
    println!("ok gets from every rank, flushed");

    // Refused without losing anything: a put past the window's end, a
    // forged handle, a rank outside the group, an unknown signal op.
    let mut q = std::ptr::dangling_mut::<c_void>();
    let rc = (r.a.iput)(
        r.ctx,
        0,
        0,
        src_mh,
        16,
        (win_len - 8) as u64,
        win_mh,
        0,
        &mut q,
    );
    if rc == 0 || !q.is_null() {
        fail(format!(
            "a put past the window's end: rc {rc}, request {q:p}"
        ));
    }
    let forged = 0x5000_0000_0000_1230_usize as P;
    let rc = (r.a.iput)(r.ctx, 0, 0, forged, 16, 0, win_mh, 0, &mut q);
    if rc == 0 || !q.is_null() {
        fail(format!("a forged handle: rc {rc}"));
    }
    let rc = (r.a.iput)(r.ctx, 0, 0, src_mh, 16, 0, win_mh, r.n, &mut q);
    if rc == 0 {
        fail("a rank outside the group was taken".into());
    }
    let rc = (r.a.iput_signal)(
        r.ctx, 0, src_mh, 8, 0, win_mh, 0, 0, sig_mh, 1, 7, true, &mut q,
    );
    if rc == 0 {
        fail("signal op 7 was taken".into());
    }
    let mut has = true;
    check("queryLastError", (r.a.query)(r.ctx, &mut has));
    if has {
        fail("queryLastError: an error after refused calls only".into());
    }
    println!(
        "ok refused: past the window, forged handle, rank {}, signal op 7",
        r.n
    );

    r.barrier(&sig, sig_mh, "teardown");
    for mh in [dst_mh, host_mh, src_mh, win_mh, sig_mh] {
        check("deregMrSym", (r.a.dereg)(r.coll, mh));
    }
    if (r.a.dereg)(r.coll, sig_mh) == 0 {
        fail("a second deregMrSym was taken".into());
    }
    drop(host);
}

/// Rank 1 leaves right after connecting; rank 0's puts to it must fail
/// within WEFT_PEER_TIMEOUT, its puts to itself go on.
fn die_after_connect(r: &Rank) {
    let (sig, sig_mh) = signals(r);
    let buf = cuda_alloc(1 << 20);
    let mut mh = null_mut();
    check(
        "regMrSym",
        (r.a.reg)(r.coll, buf.cast(), 1 << 20, PTR_CUDA, 0, &mut mh),
    );
    if r.rank == 1 {
        println!("ok rank 1 leaves");
        // SAFETY: exits without unwinding, as a killed process would.
        unsafe { libc::_exit(0) };
    }
    let t0 = Instant::now();
    let mut failed = None;
    let mut own = 0u64;
    while failed.is_none() {
        let mut q = null_mut();
        let rc = (r.a.iput)(r.ctx, 0, 0, mh, 1 << 20, 0, mh, 1, &mut q);
        if rc != 0 {
            failed = Some(("iput", rc));
            break;
        }
        let t1 = Instant::now();
        loop {
            check("rmaProgress", (r.a.progress)(r.ctx));
            let mut done = 0;
            let rc = (r.a.test)(r.coll, q, &mut done);
            if rc != 0 {
                failed = Some(("test", rc));
                break;
            }
            if done == 1 {
                break;
            }
            if t1.elapsed() > r.deadline {
                fail("a put to the dead rank neither completed nor failed".into());
            }
        }
        // The rank itself goes on.
        let mut q = null_mut();
        check(
            "iputSignal to itself",
            (r.a.iput_signal)(
                r.ctx, 0, mh, 64, 4096, mh, 0, 0, sig_mh, 0, INC, true, &mut q,
            ),
        );
        r.wait(q, "put to itself");
        own += 1;
        r.wait_signal(sig, 0, own, "own signal");
        if t0.elapsed() > r.deadline {
            fail("puts to the dead rank never failed".into());
        }
    }
    let mut has = false;
    check("queryLastError", (r.a.query)(r.ctx, &mut has));
    let (what, rc) = failed.unwrap();
    println!(
        "ok the dead rank's put failed in {what} (rc {rc}) after {:.1} s; hasError {has}; {own} puts to itself",
        t0.elapsed().as_secs_f64()
    );
    // Later puts to the dead rank fail at once; to itself they still work.
    let mut q = null_mut();
    let rc = (r.a.iput)(r.ctx, 0, 0, mh, 64, 0, mh, 1, &mut q);
    println!("ok after: put to the dead rank rc {rc}");
    let mut q = null_mut();
    check(
        "iput to itself after",
        (r.a.iput)(r.ctx, 0, 0, mh, 64, 8192, mh, 0, &mut q),
    );
    r.wait(q, "put to itself after");
    println!("ok done");
}

/// A put through a key its target deregistered (what a forged key is to
/// the provider): never lands, and the signal behind it is never applied.
fn stale_key(r: &Rank, dir: &std::path::Path) {
    let (sig, sig_mh) = signals(r);
    const MARK: u8 = 0xa5;
    let stale = cuda_alloc(4096);
    // SAFETY: 4096 bytes just allocated.
    unsafe { std::ptr::write_bytes(stale, MARK, 4096) };
    let mut stale_mh = null_mut();
    check(
        "regMrSym (stale)",
        (r.a.reg)(r.coll, stale.cast(), 4096, PTR_CUDA, 0, &mut stale_mh),
    );
    let src = cuda_alloc(4096);
    let mut src_mh = null_mut();
    check(
        "regMrSym (source)",
        (r.a.reg)(r.coll, src.cast(), 4096, PTR_CUDA, 0, &mut src_mh),
    );
    r.barrier(&sig, sig_mh, "registered");
    if r.rank == 1 {
        check("deregMrSym (stale)", (r.a.dereg)(r.coll, stale_mh));
    }
    r.barrier(&sig, sig_mh, "deregistered");
    let done = dir.join("stale.sent");
    if r.rank == 0 {
        let mut q = null_mut();
        check(
            "iputSignal (stale key)",
            (r.a.iput_signal)(
                r.ctx, 0, src_mh, 64, 0, stale_mh, 1, 0, sig_mh, 0, INC, true, &mut q,
            ),
        );
        let t0 = Instant::now();
        let rc = loop {
            check("rmaProgress", (r.a.progress)(r.ctx));
            let mut done = 0;
            let rc = (r.a.test)(r.coll, q, &mut done);
            if rc != 0 || done == 1 {
                break rc;
            }
            if t0.elapsed() > r.deadline {
                fail("a put through a stale key neither completed nor failed".into());
            }
        };
        println!("ok rank 0's put through the stale key: test rc {rc}");
        std::fs::write(&done, b"").unwrap();
        // Stay until rank 1 is done with what it checks.
        let t0 = Instant::now();
        while !dir.join("stale.checked").exists() && t0.elapsed() < r.deadline {
            check("rmaProgress", (r.a.progress)(r.ctx));
        }
        return;
    }
    if r.rank == 1 {
        let t0 = Instant::now();
        let mut has = false;
        while !has {
            check("rmaProgress", (r.a.progress)(r.ctx));
            check("queryLastError", (r.a.query)(r.ctx, &mut has));
            if t0.elapsed() > r.deadline {
                fail("no error after a signal behind a refused put".into());
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        if read_u64(sig, 0) != 0 {
            fail("the signal behind a refused put was applied".into());
        }
        // SAFETY: still allocated (only deregistered).
        let got = unsafe { std::slice::from_raw_parts(stale, 4096) };
        if got.iter().any(|&b| b != MARK) {
            fail("the put through the stale key changed rank 1's memory".into());
        }
        std::fs::write(dir.join("stale.checked"), b"").unwrap();
        println!("ok the stale-key put left rank 1's memory as it was; its signal was held, and after {secs:.1} s rank 0 was declared dead");
    }
}
