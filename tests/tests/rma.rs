//! The RMA tables (`ncclRmaPlugin_v13` … `_v16`) as NCCL's RMA loader
//! drives them: `init` twice per communicator (NCCL 2.30.7: once for RMA,
//! once as its GIN proxy's backend), `getProperties(0)` (the v13 loader
//! requires a GIN-proxy device), `devices`, and teardown, in a process
//! with no CUDA driver: no device can register NCCL's CUDA memory, so
//! `devices` must be 0 with one INFO line saying why, and every member that
//! takes an RMA object must refuse what it is given, clear its outputs, and
//! leave the host running. `rma_group.rs` runs the data path.

use std::ffi::{c_int, c_void, CStr};
use std::ptr::null_mut;

use weft_tests::capture;
use weft_tests::host::configure;

/// `ncclInvalidUsage`, `ncclInternalError`: what a refused call returns.
const INVALID_USAGE: c_int = 5;
const INTERNAL: c_int = 3;
/// Something that looks like a pointer NCCL might pass back but is no
/// object of Weft's.
const FORGED: *mut c_void = 0x5000_0000_0000_1230_usize as *mut c_void;
/// A stale output value, which a refused call must overwrite with NULL.
const STALE: *mut c_void = 0xdead_beef_usize as *mut c_void;

/// Runs the members every RMA version shares, through `$t` (module `$m`);
/// expanded inside an `unsafe` block, whose SAFETY comment covers it.
macro_rules! common {
    ($m:ident, $t:ident, $props:ident) => {{
        use weft::$m as v;
        {
            let t = &v::$t;
            let name = (CStr::from_ptr(t.name));
            assert_eq!(name.to_str().unwrap(), "Weft");
            // Two contexts per communicator, independent.
            let (mut a, mut b) = (null_mut(), null_mut());
            let logger = Some(capture::weft_test_capture_logger as weft::log::NcclDebugLogger);
            assert_eq!((t.init.unwrap()(&mut a, 7, logger)), 0);
            assert_eq!((t.init.unwrap()(&mut b, 7, logger)), 0);
            assert!(
                !a.is_null() && !b.is_null() && a != b,
                "two contexts: {a:p} {b:p}"
            );
            // The v13 loader's check right after init.
            let mut p: v::$props = (std::mem::zeroed());
            assert_eq!((t.getProperties.unwrap()(0, &mut p)), 0);
            assert_eq!(p.netDeviceType, 2, "NCCL_NET_DEVICE_GIN_PROXY");
            assert_eq!(p.maxRecvs, 1);
            let net = weft::core::properties(0).unwrap();
            assert_eq!(
                (CStr::from_ptr(p.name)),
                net.name.as_c_str(),
                "the same NIC"
            );
            assert_eq!(p.guid, net.guid);
            let n = weft::core::physical_devices().unwrap() as c_int;
            assert_ne!(
                (t.getProperties.unwrap()(n, &mut p)),
                0,
                "device {n} does not exist"
            );
            assert_ne!((t.getProperties.unwrap()(0, null_mut())), 0, "NULL props");
            let mut ndev: c_int = -1;
            assert_eq!((t.devices.unwrap()(&mut ndev)), 0);
            assert_eq!(ndev, 0, "no RMA device is claimed");
            // listen: refused, its output NULL.
            let mut handle = [0u8; 128];
            let mut l = STALE;
            let rc = (t.listen.unwrap()(a, 0, handle.as_mut_ptr().cast(), &mut l));
            assert_eq!((rc, l), (INVALID_USAGE, null_mut()));
            let rc = (t.listen.unwrap()(FORGED, 0, handle.as_mut_ptr().cast(), &mut l));
            assert_eq!((rc, l), (INTERNAL, null_mut()), "a forged context");
            // connect with a forged listen comm.
            let mut hp: *mut c_void = handle.as_mut_ptr().cast();
            let mut coll = STALE;
            let rc = (t.connect.unwrap()(a, &mut hp, 1, 0, FORGED, &mut coll));
            assert_eq!((rc, coll), (INTERNAL, null_mut()));
            // test: done stays 0.
            let mut done: c_int = 1;
            assert_eq!((t.test.unwrap()(FORGED, FORGED, &mut done)), INTERNAL);
            assert_eq!(done, 0);
            let mut has = true;
            assert_eq!((t.queryLastError.unwrap()(FORGED, &mut has)), INTERNAL);
            assert!(!has);
            assert_eq!((t.deregMrSym.unwrap()(FORGED, FORGED)), INTERNAL);
            assert_eq!((t.destroyContext.unwrap()(FORGED)), INTERNAL);
            assert_eq!((t.closeColl.unwrap()(FORGED)), INTERNAL);
            assert_eq!((t.closeListen.unwrap()(FORGED)), INTERNAL);
            let mut rq = STALE;
            assert_eq!((t.iflush.unwrap()(FORGED, 0, FORGED, 0, &mut rq)), INTERNAL);
            assert_eq!(rq, null_mut());
            (t, a, b)
        }
    }};
}

/// Finalizes both contexts; a second finalize of one is refused.
fn finalize(f: unsafe extern "C" fn(*mut c_void) -> c_int, a: *mut c_void, b: *mut c_void) {
    // SAFETY: `finalize` takes any pointer: it refuses what is no live context.
    unsafe {
        assert_eq!((f(a)), 0);
        assert_eq!((f(b)), 0);
        assert_eq!((f(a)), INTERNAL, "a finalized context is refused");
    }
}

/// The INFO line that says why no RMA device is claimed, with each
/// device's reason.
fn says_why() {
    let lines = capture::lines();
    let why: Vec<_> = lines
        .iter()
        .filter(|l| l.text.contains("RMA: 0 devices"))
        .collect();
    assert_eq!(why.len(), 1, "one INFO line per plugin start: {lines:#?}");
    assert_eq!(why[0].level, 3, "INFO");
    assert!(
        why[0]
            .text
            .contains("device 0: no GPU memory registration (NCCL_PTR_CUDA not claimed"),
        "{}",
        why[0].text
    );
}

fn all_tables(provider: &str) {
    // One test process per test (nextest), so setting NCCL_DEBUG is safe:
    // at INFO the log is forwarded to the capturing logger.
    std::env::set_var("NCCL_DEBUG", "INFO");
    configure(provider);
    let mut ctxs = Vec::new();
    // SAFETY: the table's members, called as NCCL calls them: every
    // pointer is NULL, a live local, or a value Weft must refuse without
    // dereferencing it (FORGED; STALE outputs it overwrites).
    unsafe {
        let (t, a, b) = common!(rma_v13, ncclRmaPlugin_v13, ncclNetProperties_v13_t);
        // v13: the GIN shapes, with their extra outputs cleared.
        let (mut c, mut dh) = (STALE, STALE.cast());
        let rc = t.createContext.unwrap()(FORGED, null_mut(), &mut c, &mut dh);
        assert_eq!((rc, c, dh), (INTERNAL, null_mut(), null_mut()));
        let (mut mh, mut gh) = (STALE, STALE);
        let mut buf = [0u8; 64];
        let rc = t.regMrSym.unwrap()(FORGED, buf.as_mut_ptr().cast(), 64, 1, 0, &mut mh, &mut gh);
        assert_eq!((rc, mh, gh), (INTERNAL, null_mut(), null_mut()));
        let mut rq = STALE;
        let rc = t.iputSignal.unwrap()(
            FORGED, 0, 0, FORGED, 8, 0, FORGED, 1, 0, FORGED, 1, 1, &mut rq,
        );
        assert_eq!((rc, rq), (INTERNAL, null_mut()));
        assert_eq!((t.ginProgress.unwrap()(FORGED)), INTERNAL);
        ctxs.push((t.finalize.unwrap(), a, b));
    }
    // SAFETY: the table's members, called as NCCL calls them: every
    // pointer is NULL, a live local, or a value Weft must refuse without
    // dereferencing it (FORGED; STALE outputs it overwrites).
    unsafe {
        let (t, a, b) = common!(rma_v14, ncclRmaPlugin_v14, ncclNetProperties_v14_t);
        let mut rq = STALE;
        let rc = t.iput.unwrap()(FORGED, 0, 0, FORGED, 8, 0, FORGED, 1, &mut rq);
        assert_eq!((rc, rq), (INTERNAL, null_mut()));
        assert_eq!((t.rmaProgress.unwrap()(FORGED)), INTERNAL);
        ctxs.push((t.finalize.unwrap(), a, b));
    }
    // SAFETY: the table's members, called as NCCL calls them: every
    // pointer is NULL, a live local, or a value Weft must refuse without
    // dereferencing it (FORGED; STALE outputs it overwrites).
    unsafe {
        let (t, a, b) = common!(rma_v15, ncclRmaPlugin_v15, ncclNetProperties_v15_t);
        let mut rq = STALE;
        let rc = t.iget.unwrap()(FORGED, 0, 0, FORGED, 8, 0, FORGED, 1, 1, &mut rq);
        assert_eq!((rc, rq), (INTERNAL, null_mut()));
        ctxs.push((t.finalize.unwrap(), a, b));
    }
    // SAFETY: the table's members, called as NCCL calls them: every
    // pointer is NULL, a live local, or a value Weft must refuse without
    // dereferencing it (FORGED; STALE outputs it overwrites).
    unsafe {
        let (t, a, b) = common!(rma_v16, ncclRmaPlugin_v16, ncclNetProperties_v16_t);
        let mut rp = weft::rma_v16::ncclRmaProperties_v16_t {
            flushesAllPutsOnAnySignal: true,
        };
        assert_eq!((t.getRmaProperties.unwrap()(FORGED, &mut rp)), INTERNAL);
        assert!(!rp.flushesAllPutsOnAnySignal, "never claimed");
        let mut rq = STALE;
        let rc = t.iputSignal.unwrap()(
            FORGED,
            0,
            0,
            null_mut(),
            0,
            0,
            null_mut(),
            1,
            0,
            FORGED,
            1,
            1,
            true,
            0,
            &mut rq,
        );
        assert_eq!((rc, rq), (INTERNAL, null_mut()));
        ctxs.push((t.finalize.unwrap(), a, b));
    }
    says_why();
    for (f, a, b) in ctxs {
        finalize(f, a, b);
    }
}

#[test]
fn every_rma_table_serves_contexts_and_claims_no_device_tcp() {
    weft_tests::isolated!();
    all_tables("tcp");
}

#[test]
fn every_rma_table_serves_contexts_and_claims_no_device_shm() {
    weft_tests::isolated!();
    all_tables("shm");
}
