//! An NCCL host in miniature: opens the built plugin with `dlopen(RTLD_NOW |
//! RTLD_LOCAL)` like NCCL's loader, finds `ncclNetPlugin_vN`, and calls it
//! with that version's exact signatures. [`Net`] is the version-free view the
//! tests drive; one implementation per API version is generated below from
//! the shape of that version's calls (reference §1.2).
//!
//! SAFETY (every `unsafe` block in the generated impls): each forwards one
//! call to the plugin's table with the caller's arguments; the `Net` methods
//! are `unsafe fn`s whose contract is NCCL's calling convention for that
//! member (valid or NULL pointers, buffers that outlive the request), so the
//! blocks add no obligation of their own.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;

use weft as g;

/// The plugin under test: `WEFT_TEST_PLUGIN`, else the cdylib next to the
/// test binaries.
pub fn plugin_path() -> PathBuf {
    if let Ok(p) = std::env::var("WEFT_TEST_PLUGIN") {
        return PathBuf::from(p);
    }
    // Test binaries live in target/<profile>/deps, binaries in target/<profile>.
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("exe dir");
    [dir, dir.parent().unwrap_or(dir)]
        .iter()
        .map(|d| d.join("libnccl_net_weft.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| dir.join("libnccl_net_weft.so"))
}

/// A program of the `weft` package (`weft`, `weft-reducer`), built beside
/// the plugin by `./weft test` and by `cargo test --workspace`.
pub fn weft_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("exe dir");
    [dir, dir.parent().unwrap_or(dir)]
        .iter()
        .map(|d| d.join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!("{name} is not built: run `cargo build -p weft` (./weft test does)")
        })
}

/// The NCCL releases that pick each net API version (reference §4.3).
pub fn releases(version: u32) -> &'static str {
    weft::NCCL_RELEASES
        .iter()
        .find(|(v, _)| *v == version)
        .map_or("?", |(_, r)| r)
}

/// `Ok` for ncclSuccess, else an error naming the call and the code.
pub fn check(what: &str, r: c_int) -> Result<(), String> {
    if r == 0 {
        Ok(())
    } else {
        Err(format!("{what} returned {r}"))
    }
}

/// Opens the plugin as NCCL does.
pub fn open() -> libloading::os::unix::Library {
    let p = plugin_path();
    // SAFETY: loading Weft runs no initialisers beyond Rust's statics.
    unsafe { libloading::os::unix::Library::open(Some(&p), libc::RTLD_NOW | libc::RTLD_LOCAL) }
        .unwrap_or_else(|e| {
            panic!(
                "dlopen {}: {e} (run the README's test command, which builds it)",
                p.display()
            )
        })
}

/// A version-free view of one `ncclNet_vN_t`. Sizes are `usize` here; each
/// implementation converts to what its version passes.
#[allow(clippy::missing_safety_doc, missing_docs)]
/// One version's table, callable from any thread (NCCL's service and
/// progress threads call it at once).
pub trait Net: Sync {
    fn version(&self) -> u32;
    fn name(&self) -> String;
    /// v11+ return a context; older versions NULL.
    unsafe fn init(&self, ctx: &mut *mut c_void) -> c_int;
    unsafe fn devices(&self, n: &mut c_int) -> c_int;
    /// (name, speed, maxRecvs, regIsGlobal or -1 where the version lacks it)
    unsafe fn props(&self, dev: c_int) -> Result<(String, c_int, c_int, c_int), c_int>;
    unsafe fn listen(
        &self,
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        lc: *mut *mut c_void,
    ) -> c_int;
    unsafe fn connect(
        &self,
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        sc: *mut *mut c_void,
        null_devcomm: bool,
    ) -> c_int;
    unsafe fn accept(&self, lc: *mut c_void, rc: *mut *mut c_void, null_devcomm: bool) -> c_int;
    unsafe fn reg_mr(
        &self,
        comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        mh: *mut *mut c_void,
    ) -> c_int;
    unsafe fn dereg_mr(&self, comm: *mut c_void, mh: *mut c_void) -> c_int;
    /// `regMrDmaBuf` (v6+); None where the table has no such member.
    #[allow(clippy::too_many_arguments)]
    unsafe fn reg_mr_dma_buf(
        &self,
        comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        ty: c_int,
        offset: u64,
        fd: c_int,
        mh: *mut *mut c_void,
    ) -> Option<c_int>;
    unsafe fn isend(
        &self,
        sc: *mut c_void,
        data: *mut c_void,
        size: usize,
        tag: c_int,
        mh: *mut c_void,
        req: *mut *mut c_void,
    ) -> c_int;
    unsafe fn irecv(
        &self,
        rc: *mut c_void,
        data: &mut [*mut c_void],
        sizes: &[usize],
        tags: &mut [c_int],
        mhs: &mut [*mut c_void],
        req: *mut *mut c_void,
    ) -> c_int;
    unsafe fn iflush(
        &self,
        rc: *mut c_void,
        data: &mut [*mut c_void],
        sizes: &mut [c_int],
        mhs: &mut [*mut c_void],
        req: *mut *mut c_void,
    ) -> c_int;
    unsafe fn test(&self, req: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> c_int;
    unsafe fn close_send(&self, c: *mut c_void) -> c_int;
    unsafe fn close_recv(&self, c: *mut c_void) -> c_int;
    unsafe fn close_listen(&self, c: *mut c_void) -> c_int;
    unsafe fn finalize(&self, ctx: *mut c_void) -> c_int;
    /// `makeVDevice` with `ndevs` and `devs` (v9+; `None` where the table
    /// has no such member): the result and the index written.
    unsafe fn make_vdevice(&self, ndevs: c_int, devs: &[c_int]) -> Option<(c_int, c_int)>;
    /// `vProps` of device `dev` (v9+).
    unsafe fn vprops(&self, dev: c_int) -> Option<Vec<c_int>>;
}

/// NCCL's debug logger: the capturing one from `c/capture_logger.c`.
pub fn logger() -> Option<g::adapter::Logger> {
    Some(crate::capture::weft_test_capture_logger)
}

macro_rules! net_impl {
    ($name:ident, $m:ident, $T:ident, $P:ident, $v:literal,
     init: $init:ident, ctx: $ctx:ident, connect: $conn:ident, accept: $acc:ident,
     regsize: $rs:ty, size: $sz:ty, phandle: $ph:ident, regglobal: $rg:ident, vdev: $vd:ident,
     dmabuf: $db:ident) => {
        /// The table of this version, as NCCL sees it.
        #[allow(missing_debug_implementations)]
        pub struct $name(pub &'static g::$m::$T);

        impl Net for $name {
            fn version(&self) -> u32 { $v }
            fn name(&self) -> String {
                // SAFETY: `name` is a static C string, valid before init.
                unsafe { CStr::from_ptr(self.0.name as *const c_char) }.to_string_lossy().into_owned()
            }
            unsafe fn init(&self, ctx: &mut *mut c_void) -> c_int {
                net_impl!(@init $init, self.0, ctx)
            }
            unsafe fn devices(&self, n: &mut c_int) -> c_int { unsafe { (self.0.devices.unwrap())(n) } }
            unsafe fn props(&self, dev: c_int) -> Result<(String, c_int, c_int, c_int), c_int> {
                // NCCL does not zero the struct: fill it with garbage first.
                let mut p: g::$m::$P = unsafe { std::mem::transmute([0xA5u8; std::mem::size_of::<g::$m::$P>()]) };
                let r = unsafe { (self.0.getProperties.unwrap())(dev, &mut p) };
                if r != 0 { return Err(r); }
                let name = unsafe { CStr::from_ptr(p.name) }.to_string_lossy().into_owned();
                Ok((name, p.speed, p.maxRecvs, net_impl!(@rg $rg, p)))
            }
            unsafe fn listen(&self, ctx: *mut c_void, dev: c_int, handle: *mut c_void, lc: *mut *mut c_void) -> c_int {
                net_impl!(@listen $ctx, self.0, ctx, dev, handle, lc)
            }
            unsafe fn connect(&self, ctx: *mut c_void, dev: c_int, handle: *mut c_void, sc: *mut *mut c_void, null_devcomm: bool) -> c_int {
                let _ = (ctx, null_devcomm);
                net_impl!(@connect $conn, self.0, ctx, dev, handle, sc, null_devcomm)
            }
            unsafe fn accept(&self, lc: *mut c_void, rc: *mut *mut c_void, null_devcomm: bool) -> c_int {
                let _ = null_devcomm;
                net_impl!(@accept $acc, self.0, lc, rc, null_devcomm)
            }
            unsafe fn reg_mr(&self, comm: *mut c_void, data: *mut c_void, size: usize, mh: *mut *mut c_void) -> c_int {
                unsafe { (self.0.regMr.unwrap())(comm, data, size as $rs, 1, mh) }
            }
            unsafe fn dereg_mr(&self, comm: *mut c_void, mh: *mut c_void) -> c_int { unsafe { (self.0.deregMr.unwrap())(comm, mh) } }
            unsafe fn reg_mr_dma_buf(&self, comm: *mut c_void, data: *mut c_void, size: usize, ty: c_int, offset: u64, fd: c_int, mh: *mut *mut c_void) -> Option<c_int> {
                net_impl!(@dmabuf $db, self.0, comm, data, size, ty, offset, fd, mh)
            }
            unsafe fn isend(&self, sc: *mut c_void, data: *mut c_void, size: usize, tag: c_int, mh: *mut c_void, req: *mut *mut c_void) -> c_int {
                net_impl!(@isend $ph, self.0, sc, data, size as $sz, tag, mh, req)
            }
            unsafe fn irecv(&self, rc: *mut c_void, data: &mut [*mut c_void], sizes: &[usize], tags: &mut [c_int], mhs: &mut [*mut c_void], req: *mut *mut c_void) -> c_int {
                let mut s: Vec<$sz> = sizes.iter().map(|&x| x as $sz).collect();
                let n = data.len() as c_int;
                net_impl!(@irecv $ph, self.0, rc, n, data.as_mut_ptr(), s.as_mut_ptr(), tags.as_mut_ptr(), mhs.as_mut_ptr(), req)
            }
            unsafe fn iflush(&self, rc: *mut c_void, data: &mut [*mut c_void], sizes: &mut [c_int], mhs: &mut [*mut c_void], req: *mut *mut c_void) -> c_int {
                unsafe { (self.0.iflush.unwrap())(rc, data.len() as c_int, data.as_mut_ptr(), sizes.as_mut_ptr(), mhs.as_mut_ptr(), req) }
            }
            unsafe fn test(&self, req: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> c_int { unsafe { (self.0.test.unwrap())(req, done, sizes) } }
            unsafe fn close_send(&self, c: *mut c_void) -> c_int { unsafe { (self.0.closeSend.unwrap())(c) } }
            unsafe fn close_recv(&self, c: *mut c_void) -> c_int { unsafe { (self.0.closeRecv.unwrap())(c) } }
            unsafe fn close_listen(&self, c: *mut c_void) -> c_int { unsafe { (self.0.closeListen.unwrap())(c) } }
            unsafe fn finalize(&self, ctx: *mut c_void) -> c_int {
                net_impl!(@finalize $init, self.0, ctx)
            }
            unsafe fn make_vdevice(&self, ndevs: c_int, devs: &[c_int]) -> Option<(c_int, c_int)> {
                net_impl!(@mkv $vd, self.0, $m, ndevs, devs)
            }
            unsafe fn vprops(&self, dev: c_int) -> Option<Vec<c_int>> {
                net_impl!(@vprops $vd, self.0, $m, $P, dev)
            }
        }
    };
    (@dmabuf no, $t:expr, $c:ident, $d:ident, $s:ident, $ty:ident, $o:ident, $fd:ident, $mh:ident) => {{
        let _ = ($c, $d, $s, $ty, $o, $fd, $mh);
        None
    }};
    (@dmabuf yes, $t:expr, $c:ident, $d:ident, $s:ident, $ty:ident, $o:ident, $fd:ident, $mh:ident) => {{
        let f = $t.regMrDmaBuf?;
        Some(unsafe { f($c, $d, $s, $ty, $o, $fd, $mh) })
    }};
    (@mkv none, $t:expr, $m:ident, $n:ident, $devs:ident) => {{ let _ = ($n, $devs); None }};
    (@mkv $VP:ident, $t:expr, $m:ident, $n:ident, $devs:ident) => {{
        let mut p: g::$m::$VP = unsafe { std::mem::zeroed() };
        p.ndevs = $n;
        for (slot, d) in p.devs.iter_mut().zip($devs) {
            *slot = *d;
        }
        let mut d: c_int = -7;
        let f = $t.makeVDevice?;
        Some((unsafe { f(&mut d, &mut p) }, d))
    }};
    (@vprops none, $t:expr, $m:ident, $P:ident, $dev:ident) => {{ let _ = $dev; None }};
    (@vprops $VP:ident, $t:expr, $m:ident, $P:ident, $dev:ident) => {{
        let mut p: g::$m::$P = unsafe { std::mem::zeroed() };
        if unsafe { ($t.getProperties.unwrap())($dev, &mut p) } != 0 {
            return None;
        }
        let n = usize::try_from(p.vProps.ndevs).ok()?.min(p.vProps.devs.len());
        Some(p.vProps.devs[..n].to_vec())
    }};
    (@init log, $t:expr, $ctx:ident) => {{ *$ctx = std::ptr::null_mut(); unsafe { ($t.init.unwrap())(logger()) } }};
    (@init logprof, $t:expr, $ctx:ident) => {{ *$ctx = std::ptr::null_mut(); unsafe { ($t.init.unwrap())(logger(), std::ptr::null_mut()) } }};
    (@init ctx, $t:expr, $ctx:ident) => {{
        let mut cfg = g::adapter::CommConfig { traffic_class: -1 };
        unsafe { ($t.init.unwrap())($ctx, 0x5eed, (&raw mut cfg).cast(), logger(), std::ptr::null_mut()) }
    }};
    (@finalize ctx, $t:expr, $ctx:ident) => { unsafe { ($t.finalize.unwrap())($ctx) } };
    (@finalize $other:ident, $t:expr, $ctx:ident) => {{ let _ = $ctx; 0 }};
    (@rg yes, $p:ident) => { $p.regIsGlobal };
    (@rg no, $p:ident) => { -1 };
    (@listen noctx, $t:expr, $ctx:ident, $d:ident, $h:ident, $l:ident) => {{ let _ = $ctx; unsafe { ($t.listen.unwrap())($d, $h, $l) } }};
    (@listen ctx, $t:expr, $ctx:ident, $d:ident, $h:ident, $l:ident) => { unsafe { ($t.listen.unwrap())($ctx, $d, $h, $l) } };
    (@connect plain, $t:expr, $ctx:ident, $d:ident, $h:ident, $s:ident, $nd:ident) => { unsafe { ($t.connect.unwrap())($d, $h, $s) } };
    (@connect dev, $t:expr, $ctx:ident, $d:ident, $h:ident, $s:ident, $nd:ident) => {{
        let mut dc = std::ptr::null_mut();
        unsafe { ($t.connect.unwrap())($d, $h, $s, if $nd { std::ptr::null_mut() } else { &mut dc }) }
    }};
    (@connect config, $t:expr, $ctx:ident, $d:ident, $h:ident, $s:ident, $nd:ident) => {{
        let mut dc = std::ptr::null_mut();
        let mut cfg = g::adapter::CommConfig { traffic_class: -1 };
        unsafe { ($t.connect.unwrap())($d, (&raw mut cfg).cast(), $h, $s, if $nd { std::ptr::null_mut() } else { &mut dc }) }
    }};
    (@connect ctx, $t:expr, $ctx:ident, $d:ident, $h:ident, $s:ident, $nd:ident) => {{
        let mut dc = std::ptr::null_mut();
        unsafe { ($t.connect.unwrap())($ctx, $d, $h, $s, if $nd { std::ptr::null_mut() } else { &mut dc }) }
    }};
    (@accept plain, $t:expr, $l:ident, $r:ident, $nd:ident) => { unsafe { ($t.accept.unwrap())($l, $r) } };
    (@accept dev, $t:expr, $l:ident, $r:ident, $nd:ident) => {{
        let mut dc = std::ptr::null_mut();
        unsafe { ($t.accept.unwrap())($l, $r, if $nd { std::ptr::null_mut() } else { &mut dc }) }
    }};
    (@isend no, $t:expr, $($a:expr),*) => { unsafe { ($t.isend.unwrap())($($a),*) } };
    (@isend yes, $t:expr, $sc:expr, $d:expr, $s:expr, $tag:expr, $mh:expr, $req:expr) => {
        unsafe { ($t.isend.unwrap())($sc, $d, $s, $tag, $mh, std::ptr::null_mut(), $req) }
    };
    (@irecv no, $t:expr, $($a:expr),*) => { unsafe { ($t.irecv.unwrap())($($a),*) } };
    (@irecv yes, $t:expr, $rc:expr, $n:expr, $d:expr, $s:expr, $tags:expr, $mhs:expr, $req:expr) => {{
        let mut ph = vec![std::ptr::null_mut::<c_void>(); $n as usize];
        unsafe { ($t.irecv.unwrap())($rc, $n, $d, $s, $tags, $mhs, ph.as_mut_ptr(), $req) }
    }};
}

net_impl!(NetV5, net_v5, ncclNet_v5_t, ncclNetProperties_v5_t, 5, init: log, ctx: noctx, connect: plain, accept: plain, regsize: c_int, size: c_int, phandle: no, regglobal: no, vdev: none, dmabuf: no);
net_impl!(NetV6, net_v6, ncclNet_v6_t, ncclNetProperties_v6_t, 6, init: log, ctx: noctx, connect: plain, accept: plain, regsize: c_int, size: c_int, phandle: no, regglobal: no, vdev: none, dmabuf: yes);
net_impl!(NetV7, net_v7, ncclNet_v7_t, ncclNetProperties_v7_t, 7, init: log, ctx: noctx, connect: dev, accept: dev, regsize: c_int, size: c_int, phandle: no, regglobal: no, vdev: none, dmabuf: yes);
net_impl!(NetV8, net_v8, ncclNet_v8_t, ncclNetProperties_v8_t, 8, init: log, ctx: noctx, connect: dev, accept: dev, regsize: usize, size: c_int, phandle: no, regglobal: yes, vdev: none, dmabuf: yes);
net_impl!(NetV9, net_v9, ncclNet_v9_t, ncclNetProperties_v9_t, 9, init: log, ctx: noctx, connect: dev, accept: dev, regsize: usize, size: usize, phandle: no, regglobal: yes, vdev: ncclNetVDeviceProps_v9_t, dmabuf: yes);
net_impl!(NetV10, net_v10, ncclNet_v10_t, ncclNetProperties_v10_t, 10, init: logprof, ctx: noctx, connect: config, accept: dev, regsize: usize, size: usize, phandle: yes, regglobal: yes, vdev: ncclNetVDeviceProps_v10_t, dmabuf: yes);
net_impl!(NetV11, net_v11, ncclNet_v11_t, ncclNetProperties_v11_t, 11, init: ctx, ctx: ctx, connect: ctx, accept: dev, regsize: usize, size: usize, phandle: yes, regglobal: yes, vdev: ncclNetVDeviceProps_v11_t, dmabuf: yes);
net_impl!(NetV12, net_v12, ncclNet_v12_t, ncclNetProperties_v12_t, 12, init: ctx, ctx: ctx, connect: ctx, accept: dev, regsize: usize, size: usize, phandle: yes, regglobal: yes, vdev: ncclNetVDeviceProps_v12_t, dmabuf: yes);

/// The exported table `name` of the loaded plugin, as a `T` (one of the
/// generated table types: its layout is checked by tests/tests/abi.rs).
/// The library must stay loaded while the table is used.
pub fn sym<T>(lib: &libloading::os::unix::Library, name: &str) -> &'static T {
    // SAFETY: the symbol is a static table of type T (layout checked by
    // the ABI guard); the library stays loaded for the whole test.
    unsafe {
        let s: libloading::os::unix::Symbol<*const T> = lib
            .get(name.as_bytes())
            .unwrap_or_else(|e| panic!("dlsym {name}: {e}"));
        &**s
    }
}

/// Looks up `ncclNetPlugin_v<version>` and wraps it.
pub fn net(lib: &libloading::os::unix::Library, version: u32) -> Box<dyn Net> {
    let name = format!("ncclNetPlugin_v{version}");
    match version {
        5 => Box::new(NetV5(sym(lib, &name))),
        6 => Box::new(NetV6(sym(lib, &name))),
        7 => Box::new(NetV7(sym(lib, &name))),
        8 => Box::new(NetV8(sym(lib, &name))),
        9 => Box::new(NetV9(sym(lib, &name))),
        10 => Box::new(NetV10(sym(lib, &name))),
        11 => Box::new(NetV11(sym(lib, &name))),
        12 => Box::new(NetV12(sym(lib, &name))),
        v => panic!("no ncclNet v{v}"),
    }
}
