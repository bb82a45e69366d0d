//! Drives the core API the way NCCL's proxy does: poll loops for connect and
//! accept, NULL requests retried, `test` until done. Used by the in-process
//! tests, the two-process peer and the stress test.

use std::ffi::c_void;

use weft::core::{self, Done, RecvArg};
use weft::proto::wire::HANDLE_SIZE;

use crate::poll_until;

/// Points the plugin (and libfabric's tcp provider) at `provider` on
/// loopback (verbs: on its test device, [`crate::test_iface`]). Call before the first init of a process.
///
/// On verbs it also sets, where unset, what libfabric 2.1 needs on
/// Soft-RoCE (docs/verbs.md): `FI_UNIVERSE_SIZE=64` (at 256 rxm's CQ
/// exceeds rxe's `max_cqe`) and `FI_OFI_RXM_USE_SRX=1` (without a shared
/// receive context rxm crashes when a connection closes).
pub fn pin_to_loopback(provider: &str) {
    std::env::set_var("WEFT_PROVIDER", provider);
    std::env::set_var("WEFT_IFACE", crate::test_iface(provider));
    std::env::set_var("FI_TCP_IFACE", "lo");
    for (k, v) in verbs_defaults(provider) {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
}

/// What the tests set for `provider` where the environment does not: on
/// verbs (Soft-RoCE, docs/verbs.md) a universe rxe's CQs can hold and
/// rxm's shared receive context (libfabric 2.1's rxm crashes at close
/// without it); nothing for the other providers.
pub fn verbs_defaults(provider: &str) -> &'static [(&'static str, &'static str)] {
    if provider.starts_with("verbs") {
        &[("FI_UNIVERSE_SIZE", "64"), ("FI_OFI_RXM_USE_SRX", "1")]
    } else {
        &[]
    }
}

/// [`pin_to_loopback`], plus a generous peer timeout for tests that do not
/// set one. Call before the first init of a process (nextest runs every
/// test in a process of its own).
pub fn configure(provider: &str) {
    pin_to_loopback(provider);
    if std::env::var_os("WEFT_PEER_TIMEOUT").is_none() {
        std::env::set_var("WEFT_PEER_TIMEOUT", "60");
    }
}

/// A context for `provider` (the first call in a process fixes the provider).
pub fn init(provider: &str) -> *mut c_void {
    init_with_logger(provider, None)
}

/// [`init`], with Weft's log going to the capturing logger
/// ([`crate::capture::lines`]).
pub fn init_logged(provider: &str) -> *mut c_void {
    init_with_logger(provider, Some(crate::capture::weft_test_capture_logger))
}

fn init_with_logger(provider: &str, logger: Option<weft::log::NcclDebugLogger>) -> *mut c_void {
    configure(provider);
    core::init(core::InitArgs {
        logger,
        traffic_class: -1,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("init over {provider}: {e}"))
}

/// The names of the running plugin's devices, in NCCL's numbering.
pub fn device_names() -> Result<Vec<String>, String> {
    let n = weft::core::devices().map_err(|e| e.to_string())? as i32;
    (0..n)
        .map(|d| weft::core::properties(d).map(|p| p.name.to_string_lossy().into_owned()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

/// listen on device 0.
pub fn listen(ctx: *mut c_void) -> ([u8; HANDLE_SIZE], *mut c_void) {
    listen_on(ctx, 0)
}

/// listen on device `dev`.
pub fn listen_on(ctx: *mut c_void, dev: i32) -> ([u8; HANDLE_SIZE], *mut c_void) {
    let mut h = [0u8; HANDLE_SIZE];
    let l = core::listen(ctx, dev, &mut h).expect("listen");
    (h, l)
}

/// Polls connect and accept together (both sides in one thread) until both
/// return comms.
pub fn connect_pair(
    ctx: *mut c_void,
    handle: &mut [u8; HANDLE_SIZE],
    listen: *mut c_void,
) -> (*mut c_void, *mut c_void) {
    connect_pair_on(ctx, 0, handle, listen)
}

/// [`connect_pair`] on device `dev`.
pub fn connect_pair_on(
    ctx: *mut c_void,
    dev: i32,
    handle: &mut [u8; HANDLE_SIZE],
    listen: *mut c_void,
) -> (*mut c_void, *mut c_void) {
    let (mut s, mut r) = (None, None);
    poll_until("connect + accept", || {
        if s.is_none() {
            s = core::connect(ctx, dev, None, handle).expect("connect");
        }
        if r.is_none() {
            r = core::accept(listen).expect("accept");
        }
        Some((s?, r?))
    })
}

/// A connected pair on device 0, set up as NCCL does it (the listener is
/// closed as soon as accept returned).
pub fn pair(ctx: *mut c_void) -> (*mut c_void, *mut c_void) {
    pair_on(ctx, 0)
}

/// [`pair`] on device `dev`.
pub fn pair_on(ctx: *mut c_void, dev: i32) -> (*mut c_void, *mut c_void) {
    let (mut h, l) = listen_on(ctx, dev);
    let sr = connect_pair_on(ctx, dev, &mut h, l);
    core::close_listen(l).expect("closeListen");
    sr
}

/// Closes both ends of a pair.
pub fn close_pair(s: *mut c_void, r: *mut c_void) {
    core::close_send(s).expect("closeSend");
    core::close_recv(r).expect("closeRecv");
}

/// Polls connect alone (the listener is in another process).
pub fn connect(ctx: *mut c_void, handle: &mut [u8; HANDLE_SIZE]) -> *mut c_void {
    poll_until("connect", || {
        core::connect(ctx, 0, None, handle).expect("connect")
    })
}

/// Polls accept alone.
pub fn accept(listen: *mut c_void) -> *mut c_void {
    poll_until("accept", || core::accept(listen).expect("accept"))
}

/// Registers a host buffer on `comm`.
pub fn reg(comm: *mut c_void, buf: &[u8]) -> *mut c_void {
    core::reg_mr(comm, buf.as_ptr() as *mut c_void, buf.len(), 1).expect("regMr")
}

/// Posts a send, retrying while the plugin returns a NULL request.
pub fn isend(comm: *mut c_void, buf: &[u8], tag: i32, mh: *mut c_void) -> *mut c_void {
    poll_until("isend request", || {
        isend_raw(
            comm,
            buf.as_ptr() as *mut c_void,
            buf.len(),
            tag,
            mh,
            std::ptr::null_mut(),
        )
        .expect("isend")
    })
}

/// Posts a grouped receive, retrying while the plugin returns a NULL request.
pub fn irecv(
    comm: *mut c_void,
    bufs: &mut [&mut [u8]],
    tags: &[i32],
    mhs: &[*mut c_void],
) -> *mut c_void {
    let args: Vec<RecvArg> = bufs
        .iter_mut()
        .zip(tags)
        .zip(mhs)
        .map(|((b, &tag), &mh)| RecvArg {
            data: b.as_mut_ptr().cast(),
            size: b.len(),
            tag,
            mhandle: mh,
            phandle: std::ptr::null_mut(),
        })
        .collect();
    poll_until("irecv request", || irecv_raw(comm, &args).expect("irecv"))
}

/// Moves `len` bytes of a pattern from `s` to `r` with `tag`: registers
/// both buffers, sends, receives, checks size and content, deregisters. A
/// pair that passes still works.
pub fn send_verified(s: *mut c_void, r: *mut c_void, tag: i32, len: usize) {
    let src = pattern(u64::from(tag as u32), tag, len);
    let mut dst = vec![0u8; len];
    let (smh, rmh) = (reg(s, &src), reg(r, &dst));
    let rq = irecv(r, &mut [&mut dst[..]], &[tag], &[rmh]);
    let (_, d) = wait2(isend(s, &src, tag, smh), rq);
    assert_eq!(d.sizes[0], len, "received size");
    assert!(dst == src, "{len} bytes with tag {tag} arrived changed");
    core::dereg_mr(s, smh).expect("deregMr");
    core::dereg_mr(r, rmh).expect("deregMr");
}

/// Tests until done.
pub fn wait(req: *mut c_void) -> Done {
    poll_until("request completion", || core::test(req).expect("test"))
}

/// Tests two requests until both are done (one thread drives both ends).
pub fn wait2(a: *mut c_void, b: *mut c_void) -> (Done, Done) {
    let (mut da, mut db) = (None, None);
    poll_until("two completions", || {
        if da.is_none() {
            da = core::test(a).expect("test");
        }
        if db.is_none() {
            db = core::test(b).expect("test");
        }
        Some((da?, db?))
    })
}

/// A deterministic payload: byte i of message `seq` with tag `tag`.
pub fn pattern(seq: u64, tag: i32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(31)
                .wrapping_add(seq * 7 + tag as u64) as u8
        })
        .collect()
}

/// [`core::isend`] with the tests' contract: the caller keeps the buffer
/// alive and unchanged until the request is done or the comm closed (or
/// passes a buffer the core must refuse). Test support whose purpose is to
/// hand the core raw and bogus pointers, so it is not `unsafe` itself.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn isend_raw(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: i32,
    mh: *mut c_void,
    phandle: *mut c_void,
) -> weft::core::Result<Option<*mut c_void>> {
    // SAFETY: the test contract above.
    unsafe { core::isend(comm, data, size, tag, mh, phandle) }
}

/// Posts with `post` until it gives a request (or fails), then tests that
/// until it ends: what became of it.
pub fn end_of(
    what: &str,
    mut post: impl FnMut() -> weft::core::Result<Option<*mut c_void>>,
) -> weft::core::Result<Done> {
    let q = poll_until(what, || post().transpose())?;
    poll_until(what, || core::test(q).transpose())
}

/// [`core::irecv`] with the tests' contract (see [`isend_raw`]).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn irecv_raw(comm: *mut c_void, args: &[RecvArg]) -> weft::core::Result<Option<*mut c_void>> {
    // SAFETY: the test contract of `isend_raw`.
    unsafe { core::irecv(comm, args) }
}
