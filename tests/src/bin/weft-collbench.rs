//! CollNet all-reduce, in-plugin and through reduction servers, against a
//! ring all-reduce over the net comms, in one run, same ranks, same buffers.
//!
//! ```text
//! weft-collbench [--providers shm,tcp] [--ranks 2] [--reducers 1]
//!                [--sizes 65536,1048576,16777216] [--reps 5] [--quick]
//! ```
//!
//! Each provider runs in a process of its own (a process fixes its
//! provider at its first init); the ranks and the reducers
//! (`collnet::reducer`, what `weft-reducer` runs) are threads of that
//! process, each with its own context. For every size (bytes of fp32, sum)
//! every algorithm runs `--reps` times, in rotating order; the table gives rank 0's
//! median time, algorithm bandwidth (size / time) and bus bandwidth
//! (algbw x 2(n-1)/n, NCCL's convention), and the payload bytes rank 0
//! sent and received per operation, counted by each implementation.

use std::ffi::c_void;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};

use weft::collnet::reducer::Reducer;
use weft::collnet::{self, reduce};
use weft::core::{self, RecvArg};
use weft::proto::wire::HANDLE_SIZE;
use weft_tests::host;

type Res<T> = Result<T, String>;

fn p(v: usize) -> *mut c_void {
    v as *mut c_void
}

/// A ring over the net comms: a send comm to the next rank, a receive comm
/// from the previous one.
struct Ring {
    rank: usize,
    n: usize,
    send: usize,
    recv: usize,
}

impl Ring {
    /// One ring all-reduce (fp32 sum) of `buf` (registered as `mh`), with
    /// `tmp` (registered as `tmh`) for the incoming segment; returns the
    /// payload bytes (sent, received).
    fn allreduce(&self, buf: &mut [f32], mh: usize, tmp: &mut [u8], tmh: usize) -> Res<(u64, u64)> {
        let (n, r) = (self.n, self.rank);
        let count = buf.len();
        let seg = |k: usize| (count * k / n * 4, count * (k + 1) / n * 4);
        let base = buf.as_mut_ptr() as usize;
        let (mut sent, mut got) = (0u64, 0u64);
        let mut step = |s: usize, send_seg: usize, recv_seg: usize, into_tmp: bool| -> Res<()> {
            let (sa, sb) = seg(send_seg);
            let (ra, rb) = seg(recv_seg);
            let tag = s as i32;
            let dst = if into_tmp {
                tmp.as_mut_ptr() as usize
            } else {
                base + ra
            };
            let arg = RecvArg {
                data: p(dst),
                size: rb - ra,
                tag,
                mhandle: p(if into_tmp { tmh } else { mh }),
                phandle: std::ptr::null_mut(),
            };
            // As NCCL's proxy does: post both, and keep testing the receive
            // while the send waits for the receiver's offer (NULL request).
            let (mut rq, mut sq) = (None, None);
            let (mut rdone, mut sdone) = (false, false);
            let start = Instant::now();
            while !(rdone && sdone) {
                if rq.is_none() {
                    // SAFETY: registered buffers that outlive the request.
                    rq = unsafe { core::irecv(p(self.recv), &[arg]) }.map_err(|e| e.to_string())?;
                }
                if sq.is_none() {
                    // SAFETY: as above.
                    sq = unsafe {
                        core::isend(
                            p(self.send),
                            p(base + sa),
                            sb - sa,
                            tag,
                            p(mh),
                            std::ptr::null_mut(),
                        )
                    }
                    .map_err(|e| e.to_string())?;
                }
                if let (Some(q), false) = (rq, rdone) {
                    rdone = core::test(q).map_err(|e| e.to_string())?.is_some();
                }
                if let (Some(q), false) = (sq, sdone) {
                    sdone = core::test(q).map_err(|e| e.to_string())?.is_some();
                }
                if start.elapsed() > Duration::from_secs(120) {
                    return Err("a ring step did not finish in 120 s".into());
                }
                std::thread::yield_now();
            }
            sent += (sb - sa) as u64;
            got += (rb - ra) as u64;
            if into_tmp {
                // SAFETY: the segment lies inside `buf`.
                let acc =
                    unsafe { std::slice::from_raw_parts_mut((base + ra) as *mut u8, rb - ra) };
                reduce::reduce(
                    reduce::DataType::F32,
                    reduce::RedOp::Sum,
                    acc,
                    &tmp[..rb - ra],
                );
            }
            Ok(())
        };
        for s in 0..n - 1 {
            step(s, (r + n - s) % n, (r + 2 * n - s - 1) % n, true)?;
        }
        for s in 0..n - 1 {
            step(n + s, (r + 1 + n - s) % n, (r + n - s) % n, false)?;
        }
        Ok((sent, got))
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The all-reduces compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alg {
    /// CollNet, reduced among the ranks.
    InPlugin,
    /// CollNet through the reducers.
    Reducers,
    /// A ring over the net comms.
    Ring,
}

/// One result row: size, algorithm, median seconds, payload bytes (sent,
/// received) per operation at rank 0.
type Row = (usize, Alg, f64, (u64, u64));

/// Runs one thread's body; a failure ends the whole process at once with
/// that error (the other threads would wait for it for ever, at a barrier
/// or for a reducer's handle).
fn fail_fast(who: &str, body: impl FnOnce() -> Res<()>) -> Res<()> {
    body().inspect_err(|e| {
        eprintln!("weft-collbench: {who} failed: {e}");
        std::process::exit(1);
    })
}

/// One provider: `n` ranks and `m` reducers as threads.
fn one(provider: &'static str, n: usize, m: usize, sizes: Vec<usize>, reps: usize) -> Res<()> {
    let algs: Vec<Alg> = if m > 0 {
        vec![Alg::InPlugin, Alg::Reducers, Alg::Ring]
    } else {
        vec![Alg::InPlugin, Alg::Ring]
    };
    let stop = Arc::new(AtomicBool::new(false));
    let fail = std::env::var("WEFT_COLLBENCH_FAIL").unwrap_or_default();
    let (tx, rx) = std::sync::mpsc::channel();
    let reducers: Vec<_> = (0..m)
        .map(|k| {
            let (stop, tx, fail) = (Arc::clone(&stop), tx.clone(), fail.clone());
            std::thread::spawn(move || {
                fail_fast(&format!("reducer {k}"), || {
                    let e = |e: weft::error::Error| e.to_string();
                    if fail == "reducer" {
                        return Err("failed on purpose (WEFT_COLLBENCH_FAIL=reducer)".into());
                    }
                    let ctx = host::init(provider);
                    let mut r = Reducer::new(ctx, 0).map_err(e)?;
                    tx.send((k, r.handle())).map_err(|e| e.to_string())?;
                    r.run(|_| stop.load(Ordering::Relaxed));
                    drop(r);
                    core::finalize(ctx).map_err(e)
                })
            })
        })
        .collect();
    // Only the reducers hold senders now: a reducer that ends without its
    // handle ends the wait (and `fail_fast` ends the process first).
    drop(tx);
    let mut red_h = vec![[0u8; HANDLE_SIZE]; m];
    for _ in 0..m {
        let (k, h) = rx
            .recv()
            .map_err(|_| "a reducer ended before it gave its handle".to_owned())?;
        red_h[k] = h;
    }
    let red_h = Arc::new(red_h);
    let coll_h = Arc::new(Mutex::new(vec![[0u8; HANDLE_SIZE]; n]));
    let served_h = Arc::new(Mutex::new(vec![[0u8; HANDLE_SIZE]; n]));
    let ring_h = Arc::new(Mutex::new(vec![[0u8; HANDLE_SIZE]; n]));
    let barrier = Arc::new(Barrier::new(n));
    let rows: Arc<Mutex<Vec<Row>>> = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let (coll_h, served_h, ring_h, red_h, barrier, rows, sizes, algs) = (
                Arc::clone(&coll_h),
                Arc::clone(&served_h),
                Arc::clone(&ring_h),
                Arc::clone(&red_h),
                Arc::clone(&barrier),
                Arc::clone(&rows),
                sizes.clone(),
                algs.clone(),
            );
            let fail = fail.clone();
            std::thread::spawn(move || {
                fail_fast(&format!("rank {rank}"), || {
                    let e = |e: weft::error::Error| e.to_string();
                    if fail == "rank" && rank == n - 1 {
                        return Err("failed on purpose (WEFT_COLLBENCH_FAIL=rank)".into());
                    }
                    let ctx = host::init(provider);
                    let mut h = [0u8; HANDLE_SIZE];
                    let cl = collnet::listen(ctx, 0, &mut h).map_err(e)?;
                    coll_h.lock().unwrap()[rank] = h;
                    let sl = collnet::listen(ctx, 0, &mut h).map_err(e)?;
                    served_h.lock().unwrap()[rank] = h;
                    let (rh, rl) = host::listen(ctx);
                    ring_h.lock().unwrap()[rank] = rh;
                    barrier.wait();
                    let hs = coll_h.lock().unwrap().clone();
                    let g = collnet::connect_with(&hs, rank, cl, &[]).map_err(e)?;
                    collnet::close_listen(cl).map_err(e)?;
                    let gs = if m > 0 {
                        let hs = served_h.lock().unwrap().clone();
                        Some(collnet::connect_with(&hs, rank, sl, &red_h).map_err(e)?)
                    } else {
                        None
                    };
                    collnet::close_listen(sl).map_err(e)?;
                    let mut next = ring_h.lock().unwrap()[(rank + 1) % n];
                    // The ring: connect to the next rank while accepting from the previous.
                    let (mut s, mut r) = (None, None);
                    while s.is_none() || r.is_none() {
                        if s.is_none() {
                            s = core::connect(ctx, 0, None, &mut next).map_err(e)?;
                        }
                        if r.is_none() {
                            r = core::accept(rl).map_err(e)?;
                        }
                    }
                    core::close_listen(rl).map_err(e)?;
                    let ring = Ring {
                        rank,
                        n,
                        send: s.unwrap() as usize,
                        recv: r.unwrap() as usize,
                    };
                    for &size in &sizes {
                        let count = size / 4;
                        let mut buf: Vec<f32> = (0..count).map(|i| (i % 100) as f32).collect();
                        let mut tmp = vec![0u8; size / n + 8];
                        let ptr: *mut c_void = buf.as_mut_ptr().cast();
                        let cmh = collnet::reg_mr(g, ptr, size, 1).map_err(e)?;
                        let smh = match gs {
                            Some(gs) => collnet::reg_mr(gs, ptr, size, 1).map_err(e)?,
                            None => std::ptr::null_mut(),
                        };
                        let rmh = core::reg_mr(p(ring.send), ptr, size, 1).map_err(e)? as usize;
                        let tmh = core::reg_mr(p(ring.send), tmp.as_mut_ptr().cast(), tmp.len(), 1)
                            .map_err(e)? as usize;
                        let mut times = vec![Vec::new(); algs.len()];
                        let mut bytes = vec![(0, 0); algs.len()];
                        for rep in 0..reps {
                            // Each algorithm first in turn, so none always follows the same one.
                            for i in (0..algs.len()).map(|i| (i + rep) % algs.len()) {
                                barrier.wait();
                                let t0 = Instant::now();
                                let (group, mh) = match algs[i] {
                                    Alg::InPlugin => (g, cmh),
                                    Alg::Reducers => (gs.expect("reducers"), smh),
                                    Alg::Ring => {
                                        bytes[i] = ring.allreduce(&mut buf, rmh, &mut tmp, tmh)?;
                                        times[i].push(t0.elapsed().as_secs_f64());
                                        continue;
                                    }
                                };
                                let before = collnet::bytes_moved(group).map_err(e)?;
                                // SAFETY: registered, in place, outlives the request.
                                let q = unsafe {
                                    collnet::iallreduce(group, ptr, ptr, count, 7, 0, mh, mh)
                                }
                                .map_err(e)?;
                                while collnet::test(q).map_err(e)?.is_none() {
                                    std::thread::yield_now();
                                }
                                times[i].push(t0.elapsed().as_secs_f64());
                                let after = collnet::bytes_moved(group).map_err(e)?;
                                bytes[i] = (after.0 - before.0, after.1 - before.1);
                            }
                        }
                        barrier.wait();
                        collnet::dereg_mr(cmh).map_err(e)?;
                        if !smh.is_null() {
                            collnet::dereg_mr(smh).map_err(e)?;
                        }
                        core::dereg_mr(std::ptr::null_mut(), p(rmh)).map_err(e)?;
                        core::dereg_mr(std::ptr::null_mut(), p(tmh)).map_err(e)?;
                        if rank == 0 {
                            let mut rows = rows.lock().unwrap();
                            for (i, &alg) in algs.iter().enumerate() {
                                rows.push((size, alg, median(&mut times[i]), bytes[i]));
                            }
                        }
                    }
                    barrier.wait();
                    collnet::close_coll(g).map_err(e)?;
                    if let Some(gs) = gs {
                        collnet::close_coll(gs).map_err(e)?;
                    }
                    core::close_send(p(ring.send)).map_err(e)?;
                    core::close_recv(p(ring.recv)).map_err(e)?;
                    core::finalize(ctx).map_err(e)?;
                    Ok(())
                })
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "a rank panicked")??;
    }
    stop.store(true, Ordering::Relaxed);
    for t in reducers {
        t.join().map_err(|_| "a reducer panicked")??;
    }
    let bus = 2.0 * (n - 1) as f64 / n as f64;
    println!(
        "\n{provider}, {n} ranks and {m} reducer(s) (threads of one process), fp32 sum, median of {reps}, rank 0:"
    );
    println!(
        "{:>10}  {:<12} {:>11} {:>9} {:>9} {:>9}  {:>10} {:>10}",
        "bytes", "algorithm", "median us", "algbw", "busbw", "vs ring", "sent/op", "recv/op"
    );
    let rows = rows.lock().unwrap();
    for &(size, alg, t, (sent, recv)) in rows.iter() {
        let ring = rows
            .iter()
            .find(|r| r.0 == size && r.1 == Alg::Ring)
            .map_or(t, |r| r.2);
        let gb = size as f64 / t / 1e9;
        let name = match alg {
            Alg::InPlugin => "in-plugin".to_owned(),
            Alg::Reducers => format!("reducers x{m}"),
            Alg::Ring => "ring".to_owned(),
        };
        println!(
            "{size:>10}  {name:<12} {:>11.1} {gb:>9.3} {:>9.3} {:>9.3}  {sent:>10} {recv:>10}",
            t * 1e6,
            gb * bus,
            ring / t
        );
    }
    println!(
        "(algbw and busbw in GB/s; busbw = algbw x 2(n-1)/n, NCCL's convention for every algorithm; \
         vs ring = ring time / this time; bytes are payload per operation at rank 0)"
    );
    Ok(())
}

fn main() {
    // A panicking thread ends the process too (see `fail_fast`).
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        hook(info);
        std::process::exit(101);
    }));
    let mut providers = vec!["shm".to_owned(), "tcp".to_owned()];
    let mut ranks = 2usize;
    let mut reducers = 1usize;
    let mut sizes = vec![65536usize, 1 << 20, 16 << 20];
    let mut reps = 5usize;
    let mut single: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_default();
        match a.as_str() {
            "--providers" => providers = val().split(',').map(str::to_owned).collect(),
            "--ranks" => ranks = val().parse().expect("--ranks N"),
            "--reducers" => reducers = val().parse().expect("--reducers N"),
            "--sizes" => {
                sizes = val()
                    .split(',')
                    .map(|s| s.parse().expect("--sizes bytes,..."))
                    .collect()
            }
            "--reps" => reps = val().parse().expect("--reps N"),
            "--quick" => {
                sizes = vec![65536, 1 << 20];
                reps = 3;
            }
            "--one" => single = Some(val()),
            _ => {
                println!("usage: weft-collbench [--providers shm,tcp] [--ranks 2] [--reducers 1] [--sizes 65536,...] [--reps 5] [--quick]");
                return;
            }
        }
    }
    if let Some(prov) = single {
        let prov: &'static str = Box::leak(prov.into_boxed_str());
        if let Err(e) = one(prov, ranks, reducers, sizes, reps) {
            eprintln!("weft-collbench: {e}");
            std::process::exit(1);
        }
        return;
    }
    let exe = std::env::current_exe().expect("own path");
    let sizes_arg = sizes
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    for prov in providers {
        let ok = std::process::Command::new(&exe)
            .args([
                "--one",
                &prov,
                "--ranks",
                &ranks.to_string(),
                "--reducers",
                &reducers.to_string(),
                "--sizes",
                &sizes_arg,
                "--reps",
                &reps.to_string(),
            ])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("weft-collbench: {prov} failed");
            std::process::exit(1);
        }
    }
}
