//! One CollNet cell of the version matrix: the CollNet table of one API
//! version, loaded with dlopen and driven as NCCL drives it, by two ranks
//! (threads) of this process (`weft-demo --collnet-cell V`, run by
//! `tests/tests/matrix.rs`).
//!
//! The table is exported, its `name` readable before init, `init` in its
//! version's shape, `devices()` = the net devices, `reduceSupport` yes for
//! every (type, op) NCCL asks; then a group of two built with `listen` and
//! one `connect` each, an in-place fp32 sum all-reduce through
//! `regMr`/`iallreduce`/`test`, `iflush`, on v8+ an all-gather and a
//! reduce-scatter through their version's scatter-gather part, and
//! `deregMr`, `closeColl`, `closeListen` (and `finalize` on v11+). Every
//! check is an assertion (a failed one ends the cell's process); the count
//! of those that passed is returned.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};

static CHECKS: AtomicUsize = AtomicUsize::new(0);

/// `assert_eq!`, counted.
macro_rules! ok {
    ($($t:tt)*) => {{
        assert_eq!($($t)*);
        CHECKS.fetch_add(1, Ordering::Relaxed);
    }};
}

/// Drives CollNet table `version` (5 ..= 12); the number of checks passed.
pub fn cell(version: u32) -> Result<usize, String> {
    use weft as g;
    let lib = crate::emu::open();
    let null = std::ptr::null_mut::<c_void>;
    macro_rules! collnet {
        ($m:ident, $t:ident, $v:literal, $init:ident, $listen:ident, $size:ty, $count:ty $(, $sge:ident, $sz:ty)?) => {{
            let name = concat!("ncclCollNetPlugin_v", $v);
            // SAFETY: the symbol is a static table of this type (ABI guard).
            let t: &g::$m::$t = unsafe {
                let s: libloading::os::unix::Symbol<*const g::$m::$t> = lib.get(name.as_bytes()).expect(name);
                &**s
            };
            // SAFETY: `name` is a static C string.
            ok!(unsafe { std::ffi::CStr::from_ptr(t.name) }.to_str().unwrap(), "Weft", "{name}");
            let handles = Mutex::new(vec![[0u8; 128]; 2]);
            let barrier = Barrier::new(2);
            let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
                let rank = |rank: usize| {
                    let (handles, barrier) = (&handles, &barrier);
                    move || {
                        #[allow(unused_mut, unused_assignments)]
                        let mut ctx = null();
                        // SAFETY: NCCL's calling convention for this version throughout.
                        unsafe {
                            let init = t.init.unwrap();
                            ok!(collnet!(@init init, ctx, $init), 0, "{name} init");
                            let mut n = -1;
                            ok!((t.devices.unwrap())(&mut n), 0, "{name} devices");
                            assert!(n >= 1, "{name}: devices() = {n}");
                            for ty in 0..12 {
                                for op in 0..4 {
                                    let mut yes = -1;
                                    ok!((t.reduceSupport.unwrap())(ty, op, &mut yes), 0);
                                    ok!(yes, 1, "{name}: type {ty} op {op}");
                                }
                            }
                            let mut h = [0u8; 128];
                            let mut l = null();
                            let listen = t.listen.unwrap();
                            ok!(collnet!(@listen listen, ctx, h, l, $listen), 0, "{name} listen");
                            handles.lock().unwrap()[rank] = h;
                            barrier.wait();
                            let mut hs = handles.lock().unwrap().clone();
                            let mut ptrs: Vec<*mut c_void> = hs.iter_mut().map(|h| h.as_mut_ptr().cast()).collect();
                            let mut coll = null();
                            let r = (t.connect.unwrap())(ptrs.as_mut_ptr(), 2, rank as i32, l, &mut coll);
                            ok!(r, 0, "{name} connect");
                            assert!(!coll.is_null());
                            ok!((t.closeListen.unwrap())(l), 0);
                            let mut buf: Vec<f32> = (0..1000).map(|i| (i * (rank + 1)) as f32).collect();
                            let bytes = (buf.len() * 4) as $size;
                            let mut mh = null();
                            ok!((t.regMr.unwrap())(coll, buf.as_mut_ptr().cast(), bytes, 1, &mut mh), 0);
                            let p: *mut c_void = buf.as_mut_ptr().cast();
                            let mut req = null();
                            let r = (t.iallreduce.unwrap())(coll, p, p, buf.len() as $count, 7, 0, mh, mh, &mut req);
                            ok!(r, 0, "{name} iallreduce");
                            let (mut done, mut size) = (0, 0);
                            crate::poll_until("the all-reduce", || {
                                assert_eq!((t.test.unwrap())(req, &mut done, &mut size), 0);
                                (done == 1).then_some(())
                            });
                            ok!(size, 4000);
                            let mut freq = null();
                            ok!((t.iflush.unwrap())(coll, p, 4000, mh, &mut freq), 0);
                            assert!(freq.is_null(), "host memory needs no flush");
                            ok!((t.deregMr.unwrap())(coll, mh), 0);
                            $(collnet!(@sge t, coll, rank, $m, $sge, $sz);)?
                            barrier.wait();
                            ok!((t.closeColl.unwrap())(coll), 0);
                            collnet!(@fin t, ctx, $init);
                            buf
                        }
                    }
                };
                let a = s.spawn(rank(0));
                let b = s.spawn(rank(1));
                vec![a.join().unwrap(), b.join().unwrap()]
            });
            let want: Vec<f32> = (0..1000).map(|i| (i * 3) as f32).collect();
            ok!(sums[0], want, "{name}: rank 0");
            ok!(sums[1], want, "{name}: rank 1");
        }};
        (@init $f:ident, $ctx:ident, log) => { $f(crate::emu::logger()) };
        (@init $f:ident, $ctx:ident, ctx) => {{
            let r = $f(&mut $ctx, 7, crate::emu::logger());
            assert!(!$ctx.is_null(), "CollNet v11+ init must return a context");
            r
        }};
        (@listen $f:ident, $ctx:ident, $h:ident, $l:ident, dev) => { $f(0, $h.as_mut_ptr().cast(), &mut $l) };
        (@listen $f:ident, $ctx:ident, $h:ident, $l:ident, ctx) => { $f($ctx, 0, $h.as_mut_ptr().cast(), &mut $l) };
        // v8+: all-gather of 16 bytes per rank and an fp32 sum reduce-scatter,
        // whole window, one part each, as NCCL passes them.
        (@sge $t:ident, $coll:ident, $rank:ident, $m:ident, $sge:ident, $sz:ty) => {{
            let mut mine = [$rank as u8; 16];
            let mut all = [9u8; 32];
            let (mut smh, mut rmh, mut req) = (null(), null(), null());
            ok!(($t.regMr.unwrap())($coll, mine.as_mut_ptr().cast(), 16, 1, &mut smh), 0);
            ok!(($t.regMr.unwrap())($coll, all.as_mut_ptr().cast(), 32, 1, &mut rmh), 0);
            let mut part = g::$m::$sge { mhandle: rmh, address: all.as_mut_ptr().cast(), size: 32 as $sz };
            let r = ($t.iallgather.unwrap())($coll, mine.as_mut_ptr().cast(), 1, &mut part, 16, 0, 32, smh, &mut req);
            ok!(r, 0, "iallgather");
            let (mut done, mut size) = (0, 0);
            crate::poll_until("the all-gather", || {
                assert_eq!(($t.test.unwrap())(req, &mut done, &mut size), 0);
                (done == 1).then_some(())
            });
            let mut want = [0u8; 32];
            want[16..].fill(1);
            ok!(all, want, "all-gather");
            let mut send = [($rank + 1) as f32; 8];
            let mut out = [0f32; 4];
            let (mut s2, mut o2) = (null(), null());
            ok!(($t.regMr.unwrap())($coll, send.as_mut_ptr().cast(), 32, 1, &mut s2), 0);
            ok!(($t.regMr.unwrap())($coll, out.as_mut_ptr().cast(), 16, 1, &mut o2), 0);
            let mut part = g::$m::$sge { mhandle: s2, address: send.as_mut_ptr().cast(), size: 32 as $sz };
            let r = ($t.ireducescatter.unwrap())($coll, 1, &mut part, out.as_mut_ptr().cast(), 16, 0, 32, 7, 0, o2, &mut req);
            ok!(r, 0, "ireducescatter");
            crate::poll_until("the reduce-scatter", || {
                assert_eq!(($t.test.unwrap())(req, &mut done, &mut size), 0);
                (done == 1).then_some(())
            });
            ok!(out, [3.0f32; 4], "reduce-scatter");
            for h in [smh, rmh, s2, o2] {
                ok!(($t.deregMr.unwrap())($coll, h), 0);
            }
        }};
        (@fin $t:ident, $ctx:ident, log) => { let _ = $ctx; };
        (@fin $t:ident, $ctx:ident, ctx) => { ok!(($t.finalize.unwrap())($ctx), 0) };
    }
    match version {
        5 => collnet!(collnet_v5, ncclCollNet_v5_t, 5, log, dev, i32, i32),
        6 => collnet!(collnet_v6, ncclCollNet_v6_t, 6, log, dev, i32, i32),
        7 => collnet!(collnet_v7, ncclCollNet_v7_t, 7, log, dev, i32, i32),
        8 => collnet!(
            collnet_v8,
            ncclCollNet_v8_t,
            8,
            log,
            dev,
            usize,
            i32,
            ncclNetSGE_v8_t,
            u32
        ),
        9 => collnet!(
            collnet_v9,
            ncclCollNet_v9_t,
            9,
            log,
            dev,
            usize,
            usize,
            ncclNetSGE_v9_t,
            usize
        ),
        10 => collnet!(
            collnet_v10,
            ncclCollNet_v10_t,
            10,
            log,
            dev,
            usize,
            usize,
            ncclNetSGE_v10_t,
            usize
        ),
        11 => collnet!(
            collnet_v11,
            ncclCollNet_v11_t,
            11,
            ctx,
            ctx,
            usize,
            usize,
            ncclNetSGE_v11_t,
            usize
        ),
        12 => collnet!(
            collnet_v12,
            ncclCollNet_v12_t,
            12,
            ctx,
            ctx,
            usize,
            usize,
            ncclNetSGE_v12_t,
            usize
        ),
        v => return Err(format!("no CollNet table v{v} (5 ..= 12)")),
    }
    Ok(CHECKS.load(Ordering::Relaxed))
}
