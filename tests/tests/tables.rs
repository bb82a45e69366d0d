//! The CollNet tables, loaded with dlopen. (The net tables are driven by the
//! version matrix, tests/tests/matrix.rs.)

use std::ffi::c_void;

use weft_tests::emu;

/// Every CollNet table: exported, `name` readable before init, `init`
/// succeeds in its version's shape, and `devices()` = 0 (no CollNet here).
#[test]
fn collnet_tables_report_no_devices() {
    weft_tests::isolated!();
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
