//! NCCL's profiler (net v10+): every send and every receive buffer that came
//! with a `phandle` starts one net event under it and stops it exactly once:
//! when `test` reports it done (with the bytes moved), when it fails, or
//! when its comm closes with it in flight. An emulated `ncclProfilerCallback`
//! records what Weft reports.

use std::ffi::{c_int, c_void, CStr};
use std::sync::Mutex;

use weft::core::profiler::{NetEvent, EVENT_START, EVENT_STOP, OP_RECV, OP_SEND, PLUGIN_ID};
use weft::core::{self, RecvArg};
use weft_tests::host::*;

/// What one call reported (the descriptor copied out, without its pointer).
#[derive(Debug, Clone)]
struct Seen {
    kind: c_int,
    handle: usize,
    parent: usize,
    op: u8,
    device: i32,
    tag: i32,
    size: u64,
    peer: String,
}

static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());
static NEXT: Mutex<usize> = Mutex::new(0x1000);

unsafe extern "C" fn record(
    e: *mut *mut c_void,
    kind: c_int,
    parent: *mut c_void,
    plugin_id: i64,
    ext: *mut c_void,
) -> c_int {
    assert_eq!(plugin_id, PLUGIN_ID);
    // SAFETY: Weft passes its event descriptor and a valid handle slot.
    let ev = unsafe { *ext.cast::<NetEvent>() };
    // SAFETY: the peer text lives for the call.
    let peer = unsafe { CStr::from_ptr(ev.peer) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: as above.
    let slot = unsafe { &mut *e };
    if kind == EVENT_START {
        let mut n = NEXT.lock().unwrap();
        *n += 16;
        *slot = *n as *mut c_void;
    }
    SEEN.lock().unwrap().push(Seen {
        kind,
        handle: *slot as usize,
        parent: parent as usize,
        op: ev.op,
        device: ev.device,
        tag: ev.tag,
        size: ev.size,
        peer,
    });
    0
}

fn seen() -> Vec<Seen> {
    SEEN.lock().unwrap().clone()
}

#[test]
fn every_net_event_pairs_up() {
    weft_tests::isolated!();
    configure("tcp");
    let ctx = core::init(core::InitArgs {
        profiler: Some(record as *const () as usize),
        traffic_class: -1,
        ..Default::default()
    })
    .unwrap();
    let (s, r) = pair(ctx);
    let src = pattern(1, 7, 3000);
    let smh = reg(s, &src);
    let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 4000]).collect();
    let rmhs: Vec<_> = bufs.iter().map(|b| reg(r, b)).collect();
    // A grouped receive of 3 buffers, each with its own phandle; 3 sends.
    let phandles = [0xA0usize, 0xB0, 0xC0];
    let args: Vec<RecvArg> = bufs
        .iter_mut()
        .zip(&rmhs)
        .zip(phandles)
        .enumerate()
        .map(|(i, ((b, &mh), ph))| RecvArg {
            data: b.as_mut_ptr().cast(),
            size: b.len(),
            tag: 10 + i as i32,
            mhandle: mh,
            phandle: ph as *mut c_void,
        })
        .collect();
    let rq = weft_tests::poll_until("irecv", || irecv_raw(r, &args).unwrap());
    let mut sends = Vec::new();
    for i in 0..3 {
        let len = 1000 * (i + 1);
        let q = weft_tests::poll_until("isend", || {
            isend_raw(
                s,
                src.as_ptr() as *mut c_void,
                len,
                10 + i as i32,
                smh,
                (0x100 + 16 * i) as *mut c_void,
            )
            .unwrap()
        });
        sends.push(q);
    }
    for q in sends {
        wait(q);
    }
    let d = wait(rq);
    assert_eq!(&d.sizes[..3], &[1000, 2000, 3000]);
    // A receive left in flight, stopped by closeRecv.
    let mut last = vec![0u8; 64];
    let lmh = reg(r, &last);
    let arg = RecvArg {
        data: last.as_mut_ptr().cast(),
        size: 64,
        tag: 99,
        mhandle: lmh,
        phandle: 0xF0 as *mut c_void,
    };
    weft_tests::poll_until("irecv", || irecv_raw(r, &[arg]).unwrap());
    // A send and a receive without a phandle make no event (the receive is
    // posted first: a receiver-driven protocol starts a send only then).
    let mut plain = vec![0u8; 64];
    let pmh = reg(r, &plain);
    let pq = irecv(r, &mut [&mut plain[..]], &[5], &[pmh]);
    wait(isend(s, &src[..10], 5, smh));
    wait(pq);
    core::dereg_mr(r, pmh).unwrap();
    for mh in rmhs.into_iter().chain([lmh]) {
        core::dereg_mr(r, mh).unwrap();
    }
    core::dereg_mr(s, smh).unwrap();
    close_pair(s, r);

    let all = seen();
    let starts: Vec<&Seen> = all.iter().filter(|e| e.kind == EVENT_START).collect();
    let stops: Vec<&Seen> = all.iter().filter(|e| e.kind == EVENT_STOP).collect();
    assert_eq!(
        starts.len(),
        7,
        "3 receive buffers + 3 sends + 1 left in flight: {all:#?}"
    );
    for st in &starts {
        let n = stops.iter().filter(|e| e.handle == st.handle).count();
        assert_eq!(n, 1, "event {:#x} stopped {n} times", st.handle);
        assert!(!st.peer.is_empty() && st.device == 0, "{st:?}");
    }
    assert_eq!(stops.len(), starts.len());
    // Parents are NCCL's phandles; receives report the bytes received.
    let recv_stops: Vec<(i32, u64)> = stops
        .iter()
        .filter(|e| e.op == OP_RECV)
        .map(|e| (e.tag, e.size))
        .collect();
    for want in [(10, 1000), (11, 2000), (12, 3000)] {
        assert!(recv_stops.contains(&want), "{recv_stops:?}");
    }
    let parents: Vec<usize> = starts.iter().map(|e| e.parent).collect();
    for p in [0xA0, 0xB0, 0xC0, 0x100, 0x110, 0x120, 0xF0] {
        assert!(parents.contains(&p), "{p:#x} not a parent: {parents:x?}");
    }
    assert_eq!(starts.iter().filter(|e| e.op == OP_SEND).count(), 3);
}
