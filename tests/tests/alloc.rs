//! The data path allocates nothing once warm: after a warm-up, a steady
//! isend / irecv / test cycle through NCCL's token API (one thread drives
//! both ends, as a rank sending to itself does) makes no heap allocation on
//! that thread, on either protocol and provider, for an eager size and for
//! one that travels as a write or a rendezvous, with the receive posted
//! first and (every other message) the send tried first. A global allocator counts
//! the thread's allocations while the cycle runs, and keeps the backtrace
//! of the first one, which the failure prints.
//!
//! What other threads do (the keeper's heartbeats, libfabric's own
//! threads) is not counted: they run beside NCCL's, not in its path.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::Mutex;
use std::time::Instant;

use weft::core::{self, RecvArg};
use weft_tests::host::*;

struct Counting;

thread_local! {
    /// Count this thread's allocations now.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

/// The first counted allocation's backtrace.
static FIRST: Mutex<Option<String>> = Mutex::new(None);

fn note() {
    let _ = COUNTING.try_with(|c| {
        if !c.get() {
            return;
        }
        ALLOCS.with(|a| a.set(a.get() + 1));
        // Capturing allocates: not counted, and not captured again.
        c.set(false);
        let mut first = FIRST.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = Some(std::backtrace::Backtrace::force_capture().to_string());
        }
        drop(first);
        c.set(true);
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counting touches only const-initialised thread locals and a mutex, none of
// which allocates on the counted path.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note();
        // SAFETY: as above.
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Polls `step` until it gives a value, without allocating (a deadline
/// of the suite's timeout; the panic message allocates, once).
fn spin<T>(what: &str, mut step: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + weft_tests::timeout();
    loop {
        if let Some(v) = step() {
            return v;
        }
        if Instant::now() > deadline {
            COUNTING.with(|c| c.set(false));
            panic!("{what}: not done within the suite's timeout");
        }
        std::hint::spin_loop();
    }
}

/// One message of `src.len()` bytes from `s` to `r`, both ends driven
/// here; `send_first`: the send is tried before the receive is posted (an
/// eager message then waits at the receiver for its receive).
fn cycle(
    s: *mut c_void,
    r: *mut c_void,
    src: &[u8],
    smh: *mut c_void,
    recv: &[RecvArg],
    send_first: bool,
) {
    let send = || {
        isend_raw(
            s,
            src.as_ptr() as *mut c_void,
            src.len(),
            recv[0].tag,
            smh,
            std::ptr::null_mut(),
        )
        .expect("isend")
    };
    let early = if send_first { send() } else { None };
    let rq = spin("irecv", || irecv_raw(r, recv).expect("irecv"));
    let sq = early.unwrap_or_else(|| spin("isend", send));
    let (mut sd, mut rd) = (false, false);
    spin("the two requests", || {
        sd = sd || core::test(sq).expect("test send").is_some();
        if !rd {
            if let Some(d) = core::test(rq).expect("test receive") {
                assert_eq!(d.sizes[0], src.len(), "received size");
                rd = true;
            }
        }
        (sd && rd).then_some(())
    });
}

/// Warm-up cycles (pools, maps and queues reach their steady size), then
/// the counted ones.
const WARM: usize = 2000;
const COUNTED: usize = 2000;

fn steady_state_allocates_nothing(provider: &str) {
    let ctx = init(provider);
    let (s, r) = pair(ctx);
    // 8 B injected, 4 KiB eager from a bounce buffer on tcp (rdma), 64 KiB
    // written (rdma) or sent by rendezvous (sendrecv).
    for len in [8usize, 4 << 10, 64 << 10] {
        let src = pattern(1, 7, len);
        let mut dst = vec![0u8; len];
        let (smh, rmh) = (reg(s, &src), reg(r, &dst));
        let recv = [RecvArg {
            data: dst.as_mut_ptr().cast(),
            size: len,
            tag: 7,
            mhandle: rmh,
            phandle: std::ptr::null_mut(),
        }];
        for i in 0..WARM {
            cycle(s, r, &src, smh, &recv, i % 2 == 1);
        }
        *FIRST.lock().unwrap() = None;
        ALLOCS.with(|a| a.set(0));
        COUNTING.with(|c| c.set(true));
        for i in 0..COUNTED {
            cycle(s, r, &src, smh, &recv, i % 2 == 1);
        }
        COUNTING.with(|c| c.set(false));
        let n = ALLOCS.with(Cell::get);
        assert!(dst == src, "{provider}: {len} bytes arrived changed");
        assert!(
            n == 0,
            "{provider}, {len} B: {n} allocations in {COUNTED} steady isend/irecv/test cycles ({:.2} per cycle); the first:\n{}",
            n as f64 / COUNTED as f64,
            FIRST.lock().unwrap().as_deref().unwrap_or("?")
        );
        core::dereg_mr(s, smh).expect("deregMr");
        core::dereg_mr(r, rmh).expect("deregMr");
    }
    close_pair(s, r);
    core::finalize(ctx).expect("finalize");
}

weft_tests::each!(steady_state_allocates_nothing: tcp_rdma, tcp_sendrecv, shm_rdma, shm_sendrecv);
