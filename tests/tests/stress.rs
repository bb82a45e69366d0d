//! Concurrency: 8 comm pairs driven by 4 threads at once, 10 000 verified
//! messages per pair, while another thread registers and deregisters memory
//! on the same comms (NCCL does both).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use weft::core::{self, RecvArg};
use weft_tests::host::{self, pattern};
use weft_tests::poll_until;

const PAIRS: usize = 8;
const THREADS: usize = 4;
const MESSAGES: u64 = 10_000;
const WINDOW: usize = 8;
const SIZES: [usize; 5] = [0, 64, 1000, 4096, 9000];

#[derive(Clone, Copy)]
struct Pair {
    s: usize,
    r: usize,
    tag: i32,
}

/// Moves MESSAGES messages over one pair from the calling thread (it drives
/// both ends, window of WINDOW), verifying every byte.
fn drive(p: Pair) {
    let (s, r) = (p.s as *mut c_void, p.r as *mut c_void);
    let max = *SIZES.iter().max().unwrap();
    let src: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0u8; max + 1]).collect();
    let mut dst: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0u8; max + 1]).collect();
    let smh: Vec<_> = src.iter().map(|b| host::reg(s, b)).collect();
    let rmh: Vec<_> = dst.iter().map(|b| host::reg(r, b)).collect();
    let mut src = src;
    let mut next = 0u64;
    let mut inflight: std::collections::VecDeque<(u64, usize, *mut c_void, Option<*mut c_void>)> =
        Default::default();
    let mut done = 0u64;
    while done < MESSAGES {
        while next < MESSAGES && inflight.len() < WINDOW {
            let slot = (next % WINDOW as u64) as usize;
            let size = SIZES[(next % SIZES.len() as u64) as usize];
            src[slot][..size].copy_from_slice(&pattern(next, p.tag, size));
            let arg = RecvArg {
                data: dst[slot].as_mut_ptr().cast(),
                size: max,
                tag: p.tag,
                mhandle: rmh[slot],
                phandle: std::ptr::null_mut(),
            };
            let rq = poll_until("irecv", || host::irecv_raw(r, &[arg]).unwrap());
            inflight.push_back((next, slot, rq, None));
            next += 1;
        }
        // Post pending sends, then test the oldest pair of requests.
        for (seq, slot, _, sq) in inflight.iter_mut() {
            if sq.is_none() {
                let size = SIZES[(*seq % SIZES.len() as u64) as usize];
                *sq = host::isend_raw(
                    s,
                    src[*slot].as_ptr() as *mut c_void,
                    size,
                    p.tag,
                    smh[*slot],
                    std::ptr::null_mut(),
                )
                .unwrap();
                if sq.is_none() {
                    break; // keep order: no later send before this one
                }
            }
        }
        let (seq, slot, rq, sq) = *inflight.front().unwrap();
        let Some(sq) = sq else { continue };
        let (sd, rd) = host::wait2(sq, rq);
        let size = SIZES[(seq % SIZES.len() as u64) as usize];
        assert_eq!(
            (sd.sizes[0], rd.sizes[0]),
            (size, size),
            "pair tag {}: message {seq}",
            p.tag
        );
        assert!(
            dst[slot][..size] == pattern(seq, p.tag, size)[..],
            "pair tag {}: message {seq} differs",
            p.tag
        );
        inflight.pop_front();
        done += 1;
    }
    for mh in smh.into_iter().chain(rmh) {
        core::dereg_mr(s, mh).unwrap();
    }
}

#[test]
fn tcp_eight_pairs_four_threads_with_registration_alongside() {
    weft_tests::isolated!();
    run("tcp");
}

#[test]
fn shm_eight_pairs_four_threads_with_registration_alongside() {
    weft_tests::isolated!();
    run("shm");
}

#[test]
fn tcp_eight_pairs_four_threads_sendrecv() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_PROTOCOL", "sendrecv");
    run("tcp");
}

#[test]
fn shm_eight_pairs_four_threads_sendrecv() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_PROTOCOL", "sendrecv");
    run("shm");
}

fn run(provider: &str) {
    let ctx = host::init(provider);
    let pairs: Vec<Pair> = (0..PAIRS)
        .map(|i| {
            let (s, r) = host::pair(ctx);
            Pair {
                s: s as usize,
                r: r as usize,
                tag: 40 + i as i32,
            }
        })
        .collect();
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    // regMr/deregMr on the same comms while they carry data.
    let reg = {
        let stop = Arc::clone(&stop);
        let pairs = pairs.clone();
        std::thread::spawn(move || {
            let bufs: Vec<Vec<u8>> = (0..4).map(|i| vec![i as u8; 3 * 4096 + i]).collect();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let p = pairs[(n as usize) % PAIRS];
                let comm = if n % 2 == 0 { p.s } else { p.r } as *mut c_void;
                let b = &bufs[(n as usize) % bufs.len()];
                let mh = core::reg_mr(comm, b.as_ptr() as *mut c_void, b.len(), 1).unwrap();
                core::dereg_mr(comm, mh).unwrap();
                n += 1;
                std::thread::yield_now();
            }
            n
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let mine: Vec<Pair> = pairs.iter().copied().skip(t).step_by(THREADS).collect();
            std::thread::spawn(move || {
                // Each thread drives its pairs in turn; all threads run at once.
                for p in mine {
                    drive(p);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker panicked");
    }
    stop.store(true, Ordering::Relaxed);
    let regs = reg.join().expect("registration thread panicked");
    println!(
        "{provider}: {} messages over {PAIRS} pairs in {:.2} s; {regs} regMr/deregMr alongside",
        PAIRS as u64 * MESSAGES,
        start.elapsed().as_secs_f64()
    );
    assert!(regs > 0);
    for p in pairs {
        host::close_pair(p.s as *mut c_void, p.r as *mut c_void);
    }
}
