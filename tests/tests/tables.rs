//! Every exported table, loaded with dlopen and driven with its version's
//! exact signatures: name before init, init in the version's shape, devices,
//! properties (valid and out-of-range), listen/connect/accept with both forms
//! of the device-handle argument, registration, a size sweep with content
//! checks, a grouped receive, iflush, test with int sizes, close, finalize,
//! and a corrupted handle.

use std::ffi::{c_int, c_void};

use weft_tests::emu::{self, Net};
use weft_tests::host::pattern;
use weft_tests::poll_until;

fn ok(what: &str, v: u32, r: c_int) {
    assert_eq!(r, 0, "ncclNet v{v} {what} returned {r}");
}

fn connect_accept(n: &dyn Net, ctx: *mut c_void, null_devcomm: bool) -> (*mut c_void, *mut c_void) {
    let v = n.version();
    let mut h = [0u8; 128];
    let mut l = std::ptr::null_mut();
    // SAFETY: NCCL's calling convention, with buffers that outlive the calls.
    unsafe {
        ok("listen", v, n.listen(ctx, 0, h.as_mut_ptr().cast(), &mut l));
        assert!(!l.is_null(), "v{v}: listen returned a NULL comm");
        let (mut s, mut r): (*mut c_void, *mut c_void) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        poll_until("connect + accept through the table", || {
            if s.is_null() {
                ok(
                    "connect",
                    v,
                    n.connect(ctx, 0, h.as_mut_ptr().cast(), &mut s, null_devcomm),
                );
            }
            if r.is_null() {
                ok("accept", v, n.accept(l, &mut r, !null_devcomm));
            }
            (!s.is_null() && !r.is_null()).then_some(())
        });
        // NCCL closes the listener as soon as accept returned.
        ok("closeListen", v, n.close_listen(l));
        (s, r)
    }
}

/// Tests every request until all are done, with NCCL's int sizes arrays
/// (one thread drives both ends, so each loop progresses both).
fn wait(n: &dyn Net, reqs: &mut [(*mut c_void, &mut [c_int])]) {
    let v = n.version();
    let mut done = vec![false; reqs.len()];
    poll_until("test() done", || {
        for ((req, sizes), d) in reqs.iter_mut().zip(done.iter_mut()) {
            if !*d {
                let mut flag = 0;
                // SAFETY: `sizes` has room for every buffer of the request.
                ok("test", v, unsafe {
                    n.test(*req, &mut flag, sizes.as_mut_ptr())
                });
                *d = flag == 1;
            }
        }
        done.iter().all(|&d| d).then_some(())
    });
}

fn drive(version: u32) {
    weft_tests::host::configure("tcp");
    let lib = emu::open();
    let n = emu::net(&lib, version);
    let v = n.version();
    assert_eq!(n.name(), "Weft", "v{v}: name must be readable before init");
    let mut ctx = std::ptr::null_mut();
    // SAFETY: every call below follows NCCL's conventions for this version.
    unsafe {
        ok("init", v, n.init(&mut ctx));
        if v >= 11 {
            assert!(!ctx.is_null(), "v{v}: init must return a context");
            let mut ctx2 = std::ptr::null_mut();
            ok("second init", v, n.init(&mut ctx2));
            assert!(
                !ctx2.is_null() && ctx2 != ctx,
                "v{v}: one context per communicator"
            );
            ok("finalize of the second context", v, n.finalize(ctx2));
        }
        let mut nd = 0;
        ok("devices", v, n.devices(&mut nd));
        assert_eq!(nd, 1, "v{v}: WEFT_IFACE=lo keeps one device");
        let (name, speed, max_recvs, rg) = n
            .props(0)
            .unwrap_or_else(|r| panic!("v{v}: getProperties(0) returned {r}"));
        assert_eq!(
            (name.as_str(), speed, max_recvs),
            ("lo", 10_000, 8),
            "v{v}: properties"
        );
        if v >= 8 {
            assert_eq!(rg, 1, "v{v}: regIsGlobal");
        }
        for bad in [1, -1, 99] {
            assert_eq!(
                n.props(bad).err(),
                Some(3),
                "v{v}: getProperties({bad}) must fail with ncclInternalError"
            );
        }

        let (s, r) = connect_accept(&*n, ctx, v % 2 == 0);
        let max = 1usize << 20;
        let src = pattern(v as u64, 7, max + 1);
        let mut dst = vec![0u8; max + 64];
        let (mut smh, mut rmh) = (std::ptr::null_mut(), std::ptr::null_mut());
        ok(
            "regMr(send)",
            v,
            n.reg_mr(s, src.as_ptr() as *mut c_void, src.len(), &mut smh),
        );
        ok(
            "regMr(recv)",
            v,
            n.reg_mr(r, dst.as_mut_ptr().cast(), dst.len(), &mut rmh),
        );
        for size in [0usize, 1, 4096, 8193, max] {
            // NCCL does not clear *request: start from stale values.
            // 0x1 is NCCL_NET_OPTIONAL_RECV_COMPLETION (v9+): an ordinary receive here.
            let (mut sreq, mut rreq) = (
                std::ptr::without_provenance_mut::<c_void>(0xdead),
                std::ptr::without_provenance_mut::<c_void>(0x1),
            );
            let mut data = [dst.as_mut_ptr().cast::<c_void>()];
            let mut tags = [7];
            let mut mhs = [rmh];
            poll_until("irecv request", || {
                ok(
                    "irecv",
                    v,
                    n.irecv(r, &mut data, &[max + 64], &mut tags, &mut mhs, &mut rreq),
                );
                (!rreq.is_null()).then_some(())
            });
            poll_until("isend request", || {
                ok(
                    "isend",
                    v,
                    n.isend(s, src.as_ptr() as *mut c_void, size, 7, smh, &mut sreq),
                );
                (!sreq.is_null() && sreq as usize != 0xdead).then_some(())
            });
            let (mut ssz, mut rsz) = ([-1], [-1; 64]);
            wait(&*n, &mut [(sreq, &mut ssz[..]), (rreq, &mut rsz[..])]);
            assert_eq!(ssz[0] as usize, size, "v{v}: send size");
            assert_eq!(
                rsz[0] as usize, size,
                "v{v}: received size of a {size}-byte message"
            );
            assert!(
                dst[..size] == src[..size],
                "v{v}: {size}-byte payload differs"
            );
            let mut fl = std::ptr::null_mut::<c_void>();
            let mut fsz = [rsz[0]];
            ok(
                "iflush",
                v,
                n.iflush(r, &mut data, &mut fsz, &mut mhs, &mut fl),
            );
            assert!(
                fl.is_null(),
                "v{v}: iflush on host memory is a NULL (complete) request"
            );
        }
        // Grouped receive, n = maxRecvs, tags pick the buffer.
        let mut data: Vec<*mut c_void> = (0..8)
            .map(|i| dst.as_mut_ptr().wrapping_add(i * 1024).cast())
            .collect();
        let mut tags: Vec<c_int> = (0..8).map(|i| 100 + i).collect();
        let mut mhs = vec![rmh; 8];
        let mut rreq = std::ptr::null_mut();
        poll_until("grouped irecv", || {
            ok(
                "irecv(n=8)",
                v,
                n.irecv(r, &mut data, &[1024; 8], &mut tags, &mut mhs, &mut rreq),
            );
            (!rreq.is_null()).then_some(())
        });
        let mut sends = Vec::new();
        for t in (0..8).rev() {
            let mut sreq = std::ptr::null_mut();
            let off = t as usize * 1000;
            poll_until("isend request", || {
                ok(
                    "isend",
                    v,
                    n.isend(
                        s,
                        src.as_ptr().wrapping_add(off) as *mut c_void,
                        10 + t as usize,
                        100 + t,
                        smh,
                        &mut sreq,
                    ),
                );
                (!sreq.is_null()).then_some(())
            });
            sends.push(sreq);
        }
        let mut rsz = [-1; 64];
        let mut ssz = [[0]; 8];
        let mut all: Vec<(*mut c_void, &mut [c_int])> = sends
            .iter()
            .zip(ssz.iter_mut())
            .map(|(&q, s)| (q, &mut s[..]))
            .collect();
        all.push((rreq, &mut rsz[..]));
        wait(&*n, &mut all);
        for t in 0..8usize {
            assert_eq!(rsz[t], 10 + t as c_int, "v{v}: grouped size {t}");
            assert!(
                dst[t * 1024..t * 1024 + 10 + t] == src[t * 1000..t * 1000 + 10 + t],
                "v{v}: grouped buffer {t}"
            );
        }
        // NCCL deregisters, then closes.
        ok("deregMr", v, n.dereg_mr(s, smh));
        ok("deregMr", v, n.dereg_mr(r, rmh));
        ok("closeSend", v, n.close_send(s));
        ok("closeRecv", v, n.close_recv(r));
        // A corrupted handle is an error (ncclInternalError), not a crash or a hang.
        let mut bad = [0x42u8; 128];
        let mut sc = std::ptr::null_mut();
        assert_eq!(
            n.connect(ctx, 0, bad.as_mut_ptr().cast(), &mut sc, true),
            3,
            "v{v}: corrupted handle"
        );
        assert!(sc.is_null());
        if v >= 11 {
            ok("finalize", v, n.finalize(ctx));
        }
    }
    let lines = weft_tests::capture::lines();
    assert!(
        lines
            .iter()
            .any(|l| l.text.contains("connect failed") && l.text.contains("handle")),
        "v{v}: the corrupted handle was not reported through NCCL's logger: {lines:#?}"
    );
}

#[test]
fn net_v5() {
    drive(5);
}
#[test]
fn net_v6() {
    drive(6);
}
#[test]
fn net_v7() {
    drive(7);
}
#[test]
fn net_v8() {
    drive(8);
}
#[test]
fn net_v9() {
    drive(9);
}
#[test]
fn net_v10() {
    drive(10);
}
#[test]
fn net_v11() {
    drive(11);
}
#[test]
fn net_v12() {
    drive(12);
}

/// Every CollNet table: exported, `name` readable before init, `init`
/// succeeds in its version's shape, and `devices()` = 0 (no CollNet here).
#[test]
fn collnet_tables_report_no_devices() {
    use weft as g;
    let lib = emu::open();
    macro_rules! collnet {
        ($m:ident, $t:ident, $v:literal, $($init:tt)*) => {{
            let name = concat!("ncclCollNetPlugin_v", $v);
            // SAFETY: the symbol is a static table of this type (ABI guard).
            let t: &g::$m::$t = unsafe {
                let s: libloading::os::unix::Symbol<*const g::$m::$t> = lib.get(name.as_bytes()).expect(name);
                &**s
            };
            // SAFETY: `name` is a static C string.
            assert_eq!(unsafe { std::ffi::CStr::from_ptr(t.name) }.to_str().unwrap(), "Weft", "{name}");
            #[allow(unused_mut)]
            let mut ctx: *mut c_void = std::ptr::null_mut();
            let mut n = -1;
            // SAFETY: NCCL's calling convention for this version.
            unsafe {
                let init = t.init.unwrap();
                let r = collnet!(@init init, ctx, $($init)*);
                assert_eq!(r, 0, "{name} init");
                assert_eq!((t.devices.unwrap())(&mut n), 0, "{name} devices");
                assert_eq!(n, 0, "{name}: devices() must be 0");
                let mut supported = -1;
                assert_eq!((t.reduceSupport.unwrap())(0, 0, &mut supported), 0);
                assert_eq!(supported, 0, "{name}: nothing is supported");
                collnet!(@fin t, ctx, $($init)*);
            }
        }};
        (@init $f:ident, $ctx:ident, log) => { $f(emu::logger()) };
        (@init $f:ident, $ctx:ident, ctx) => {{
            let r = $f(&mut $ctx, 7, emu::logger());
            assert!(!$ctx.is_null(), "CollNet v11+ init must return a context");
            r
        }};
        (@fin $t:ident, $ctx:ident, log) => { let _ = $ctx; };
        (@fin $t:ident, $ctx:ident, ctx) => { assert_eq!(($t.finalize.unwrap())($ctx), 0) };
    }
    collnet!(collnet_v5, ncclCollNet_v5_t, 5, log);
    collnet!(collnet_v6, ncclCollNet_v6_t, 6, log);
    collnet!(collnet_v7, ncclCollNet_v7_t, 7, log);
    collnet!(collnet_v8, ncclCollNet_v8_t, 8, log);
    collnet!(collnet_v9, ncclCollNet_v9_t, 9, log);
    collnet!(collnet_v10, ncclCollNet_v10_t, 10, log);
    collnet!(collnet_v11, ncclCollNet_v11_t, 11, ctx);
    collnet!(collnet_v12, ncclCollNet_v12_t, 12, ctx);
}
