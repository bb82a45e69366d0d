//! CollNet in software: groups of 2 and 3 ranks (threads of one process,
//! each with its own context) over tcp on lo and over shm, driven through
//! the CollNet core as NCCL drives the tables: listen, connect with every
//! handle, regMr, iallreduce, test, closeColl.
//!
//! Every (type, op) with pseudo-random data is checked against a reference
//! reduction written here (rank order, pairwise, per type), and every rank's
//! result must be bit-identical to every other's.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};

use half::{bf16, f16};
use weft::collnet::reducer::{Reducer, Stats};
use weft::collnet::{self, reduce::DataType, reduce::RedOp, reduce::E4M3, reduce::E5M2};
use weft::core;
use weft::proto::wire::HANDLE_SIZE;
use weft_tests::host;

/// A deterministic byte stream (xorshift), one per (rank, case).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Input of `count` elements of `ty` for `rank`: integers over their whole
/// range, floats as small finite values (so sums and products stay
/// meaningful), fp8 over every finite code.
fn input(ty: DataType, count: usize, seed: u64) -> Vec<u8> {
    let raw = bytes(seed, count * 8);
    let f = |i: usize| {
        let v = u32::from_le_bytes(raw[i * 8..i * 8 + 4].try_into().unwrap());
        (v % 2001) as f32 / 100.0 - 10.0
    };
    let mut out = Vec::with_capacity(count * ty.size());
    for i in 0..count {
        let r = &raw[i * 8..i * 8 + 8];
        match ty {
            DataType::F16 => out.extend(f16::from_f32(f(i)).to_ne_bytes()),
            DataType::Bf16 => out.extend(bf16::from_f32(f(i)).to_ne_bytes()),
            DataType::F32 => out.extend(f(i).to_ne_bytes()),
            DataType::F64 => out.extend(f64::from(f(i)).to_ne_bytes()),
            DataType::F8E4M3 => out.push(r[0] & 0xf7 & !(u8::from(r[0] & 0x7f == 0x7f))),
            DataType::F8E5M2 => out.push(r[0] & 0xbf),
            _ => out.extend(&r[..ty.size()]),
        }
    }
    out
}

/// The reference: `a op b` per element, written out per type.
fn reference(ty: DataType, op: RedOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    macro_rules! each {
        ($t:ty, $f:expr) => {
            a.chunks(std::mem::size_of::<$t>())
                .zip(b.chunks(std::mem::size_of::<$t>()))
                .flat_map(|(x, y)| {
                    let x = <$t>::from_ne_bytes(x.try_into().unwrap());
                    let y = <$t>::from_ne_bytes(y.try_into().unwrap());
                    let f: fn($t, $t) -> $t = $f;
                    f(x, y).to_ne_bytes()
                })
                .collect()
        };
    }
    macro_rules! int {
        ($t:ty) => {
            match op {
                RedOp::Sum => each!($t, |x, y| x.wrapping_add(y)),
                RedOp::Prod => each!($t, |x, y| x.wrapping_mul(y)),
                RedOp::Max => each!($t, |x, y| if x > y { x } else { y }),
                RedOp::Min => each!($t, |x, y| if x < y { x } else { y }),
            }
        };
    }
    // A float type computed in f32 and rounded back (f32 itself: no rounding).
    macro_rules! float {
        ($t:ty, $to:expr, $from:expr) => {
            match op {
                RedOp::Sum => each!($t, |x, y| $from($to(x) + $to(y))),
                RedOp::Prod => each!($t, |x, y| $from($to(x) * $to(y))),
                RedOp::Max => each!($t, |x, y| $from($to(x).max($to(y)))),
                RedOp::Min => each!($t, |x, y| $from($to(x).min($to(y)))),
            }
        };
    }
    fn f32op(op: RedOp, x: f32, y: f32) -> f32 {
        match op {
            RedOp::Sum => x + y,
            RedOp::Prod => x * y,
            RedOp::Max => x.max(y),
            RedOp::Min => x.min(y),
        }
    }
    match ty {
        DataType::I8 => int!(i8),
        DataType::U8 => int!(u8),
        DataType::I32 => int!(i32),
        DataType::U32 => int!(u32),
        DataType::I64 => int!(i64),
        DataType::U64 => int!(u64),
        DataType::F32 => float!(f32, |x| x, |v| v),
        DataType::F64 => match op {
            RedOp::Sum => each!(f64, |x, y| x + y),
            RedOp::Prod => each!(f64, |x, y| x * y),
            RedOp::Max => each!(f64, |x, y| x.max(y)),
            RedOp::Min => each!(f64, |x, y| x.min(y)),
        },
        DataType::F16 => float!(f16, f16::to_f32, f16::from_f32),
        DataType::Bf16 => float!(bf16, bf16::to_f32, bf16::from_f32),
        DataType::F8E4M3 => a
            .iter()
            .zip(b)
            .map(|(&x, &y)| E4M3.encode(f32op(op, E4M3.decode(x), E4M3.decode(y))))
            .collect(),
        DataType::F8E5M2 => a
            .iter()
            .zip(b)
            .map(|(&x, &y)| E5M2.encode(f32op(op, E5M2.decode(x), E5M2.decode(y))))
            .collect(),
    }
}

/// One all-reduce on `g` (a connected collective comm), in place or not;
/// returns the result.
fn allreduce(g: *mut c_void, ty: DataType, op: RedOp, data: &[u8], in_place: bool) -> Vec<u8> {
    let count = data.len() / ty.size();
    let mut send = data.to_vec();
    let mut recv = if in_place {
        Vec::new()
    } else {
        vec![0u8; data.len()]
    };
    let len = send.len().max(1);
    let smh = collnet::reg_mr(g, send.as_mut_ptr().cast(), len, 1).expect("regMr send");
    let rmh = if in_place {
        smh
    } else {
        collnet::reg_mr(g, recv.as_mut_ptr().cast(), len, 1).expect("regMr recv")
    };
    let out: *mut c_void = if in_place {
        send.as_mut_ptr().cast()
    } else {
        recv.as_mut_ptr().cast()
    };
    // SAFETY: both buffers hold `count` elements, registered, and outlive the request.
    let req = unsafe {
        collnet::iallreduce(
            g,
            send.as_mut_ptr().cast(),
            out,
            count,
            ty as i32,
            op as i32,
            smh,
            rmh,
        )
    }
    .expect("iallreduce");
    let bytes = weft_tests::poll_until("the all-reduce", || collnet::test(req).expect("test"));
    assert_eq!(bytes, data.len());
    collnet::dereg_mr(smh).unwrap();
    if !in_place {
        collnet::dereg_mr(rmh).unwrap();
    }
    if in_place {
        send
    } else {
        recv
    }
}

/// `n` ranks, each a thread with its own context: the group is built, then
/// `work(rank, group)` runs on every rank; what each returns is collected.
fn group<T: Send + 'static>(
    provider: &'static str,
    n: usize,
    work: impl Fn(usize, *mut c_void) -> T + Send + Sync + 'static,
) -> Vec<T> {
    served(provider, n, 0, work).0
}

/// [`group`] through `m` reducers, each a thread with its own context
/// serving until the ranks are done; also returns each reducer's stats.
fn served<T: Send + 'static>(
    provider: &'static str,
    n: usize,
    m: usize,
    work: impl Fn(usize, *mut c_void) -> T + Send + Sync + 'static,
) -> (Vec<T>, Vec<Stats>) {
    served_after(provider, n, m, |_| {}, work)
}

/// [`served`], with `before(reducer handles)` run once the reducers listen
/// and before the ranks start.
fn served_after<T: Send + 'static>(
    provider: &'static str,
    n: usize,
    m: usize,
    before: impl FnOnce(&[[u8; HANDLE_SIZE]]),
    work: impl Fn(usize, *mut c_void) -> T + Send + Sync + 'static,
) -> (Vec<T>, Vec<Stats>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let reducers: Vec<_> = (0..m)
        .map(|k| {
            let (stop, tx) = (Arc::clone(&stop), tx.clone());
            std::thread::spawn(move || {
                let ctx = host::init_logged(provider);
                let mut r = Reducer::new(ctx, 0).expect("reducer");
                tx.send((k, r.handle())).unwrap();
                // Once the ranks are done, the reducer still sees its groups
                // to their end (the last operation's sends complete, the
                // goodbyes arrive), so its counts are whole; within reason.
                let mut since: Option<std::time::Instant> = None;
                r.run(|r| {
                    if !stop.load(Ordering::Relaxed) {
                        return false;
                    }
                    let t = *since.get_or_insert_with(std::time::Instant::now);
                    r.groups() == 0 || t.elapsed() > std::time::Duration::from_secs(30)
                });
                let s = r.stats();
                drop(r);
                core::finalize(ctx).unwrap();
                s
            })
        })
        .collect();
    let mut rh = vec![[0u8; HANDLE_SIZE]; m];
    for _ in 0..m {
        let (k, h) = rx.recv().expect("a reducer's handle");
        rh[k] = h;
    }
    before(&rh);
    let rh = Arc::new(rh);
    let handles = Arc::new(Mutex::new(vec![[0u8; HANDLE_SIZE]; n]));
    let barrier = Arc::new(Barrier::new(n));
    let work = Arc::new(work);
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let (handles, barrier, work, rh) = (
                Arc::clone(&handles),
                Arc::clone(&barrier),
                Arc::clone(&work),
                Arc::clone(&rh),
            );
            std::thread::spawn(move || {
                let ctx = host::init_logged(provider);
                let mut h = [0u8; HANDLE_SIZE];
                let l = collnet::listen(ctx, 0, &mut h).expect("listen");
                handles.lock().unwrap()[rank] = h;
                barrier.wait();
                let hs = handles.lock().unwrap().clone();
                let g = collnet::connect_with(&hs, rank, l, &rh).expect("connect");
                collnet::close_listen(l).unwrap();
                let out = work(rank, g);
                barrier.wait();
                collnet::close_coll(g).unwrap();
                core::finalize(ctx).unwrap();
                out
            })
        })
        .collect();
    let out = threads
        .into_iter()
        .map(|t| t.join().expect("rank"))
        .collect();
    stop.store(true, Ordering::Relaxed);
    let stats = reducers
        .into_iter()
        .map(|t| t.join().expect("reducer"))
        .collect();
    (out, stats)
}

/// Every type and op, several sizes (1 element, odd counts, several chunks),
/// in place and not: each rank's result equals the reference and every
/// other rank's, bit for bit.
fn every_type_and_op(provider: &'static str, n: usize, m: usize) {
    let counts = [1usize, 7, 1000, 3 * (collnet::CHUNK / 4) + 5];
    let (results, stats) = served(provider, n, m, move |rank, g| {
        let mut out = Vec::new();
        for (ci, &count) in counts.iter().enumerate() {
            for ty in DataType::ALL {
                for op in RedOp::ALL {
                    // Large counts for a few types only: the point there is chunking.
                    if ci == 3 && !matches!(ty, DataType::F32 | DataType::U8 | DataType::Bf16) {
                        continue;
                    }
                    let seed = (rank as u64 + 1) * 1_000_003
                        + (ty as u64) * 101
                        + op as u64
                        + ci as u64 * 7;
                    let data = input(ty, count, seed);
                    let in_place = (ty as usize + op as usize) % 2 == 0;
                    out.push(((count, ty, op), allreduce(g, ty, op, &data, in_place)));
                }
            }
        }
        out
    });
    let cases = results[0].len();
    assert!(cases > 100, "{cases} cases");
    for i in 0..cases {
        let ((count, ty, op), got) = &results[0][i];
        let mut want = input(
            *ty,
            *count,
            1_000_003
                + (*ty as u64) * 101
                + *op as u64
                + counts.iter().position(|c| c == count).unwrap() as u64 * 7,
        );
        for rank in 1..n {
            let seed = (rank as u64 + 1) * 1_000_003
                + (*ty as u64) * 101
                + *op as u64
                + counts.iter().position(|c| c == count).unwrap() as u64 * 7;
            want = reference(*ty, *op, &want, &input(*ty, *count, seed));
        }
        for r in &results {
            assert_eq!(
                &r[i].1, got,
                "{provider}: {ty:?} {op:?} x{count}: ranks differ"
            );
        }
        assert!(
            got == &want,
            "{provider}: {ty:?} {op:?} x{count}: differs from the reference"
        );
    }
    // Through reducers, each reduced every one (the ranks did not).
    for s in &stats {
        assert_eq!(s.ops, cases as u64, "{provider}: a reducer's operations");
        assert_eq!(s.failed, 0);
    }
    println!(
        "{provider}: {cases} all-reduces over {n} ranks and {m} reducers, every rank bit-identical to the reference"
    );
}

#[test]
fn shm_every_type_and_op_three_ranks() {
    weft_tests::isolated!();
    every_type_and_op("shm", 3, 0);
}

#[test]
fn tcp_every_type_and_op_two_ranks() {
    weft_tests::isolated!();
    every_type_and_op("tcp", 2, 0);
}

/// Several all-reduces in flight at once, issued in the same order on every
/// rank and completed in any order.
#[test]
fn shm_requests_in_flight() {
    weft_tests::isolated!();
    requests_in_flight(0);
}

fn requests_in_flight(m: usize) {
    let (results, _) = served("shm", 3, m, |rank, g| {
        let k = 6;
        let mut bufs: Vec<Vec<u8>> = (0..k)
            .map(|i| input(DataType::I32, 5000 + i, (rank * 10 + i) as u64))
            .collect();
        let mhs: Vec<_> = bufs
            .iter_mut()
            .map(|b| collnet::reg_mr(g, b.as_mut_ptr().cast(), b.len(), 1).unwrap())
            .collect();
        let mut reqs: Vec<Option<*mut c_void>> = bufs
            .iter_mut()
            .zip(&mhs)
            .map(|(b, &mh)| {
                let p: *mut c_void = b.as_mut_ptr().cast();
                // SAFETY: registered, in place, outlives the request.
                Some(unsafe { collnet::iallreduce(g, p, p, b.len() / 4, 2, 0, mh, mh) }.unwrap())
            })
            .collect();
        // Test the newest first.
        weft_tests::poll_until("all requests", || {
            for r in reqs.iter_mut().rev() {
                if let Some(q) = *r {
                    if collnet::test(q).unwrap().is_some() {
                        *r = None;
                    }
                }
            }
            reqs.iter().all(Option::is_none).then_some(())
        });
        for mh in mhs {
            collnet::dereg_mr(mh).unwrap();
        }
        bufs
    });
    for i in 0..6 {
        let mut want = input(DataType::I32, 5000 + i, i as u64);
        for rank in 1..3 {
            want = reference(
                DataType::I32,
                RedOp::Sum,
                &want,
                &input(DataType::I32, 5000 + i, (rank * 10 + i) as u64),
            );
        }
        for r in &results {
            assert!(r[i] == want, "request {i}");
        }
    }
}

/// Support is claimed for every type and op implemented, and only those.
#[test]
fn reduce_support_is_what_is_implemented() {
    weft_tests::isolated!();
    for ty in 0..12 {
        for op in 0..4 {
            assert!(collnet::reduce_support(ty, op), "type {ty} op {op}");
        }
        assert!(
            !collnet::reduce_support(ty, 4),
            "avg reaches the network as sum"
        );
    }
    assert!(!collnet::reduce_support(12, 0));
    assert!(!collnet::reduce_support(-1, 0));
}

/// The window of the global buffer (`per_rank` bytes per rank) a call
/// covers, cut to each rank's part.
fn parts(n: usize, per_rank: usize, off: usize, len: usize) -> Vec<(usize, usize)> {
    (0..n)
        .map(|j| {
            let a = (j * per_rank).max(off).min(off + len);
            let b = ((j + 1) * per_rank).min(off + len);
            (a, b.max(a))
        })
        .collect()
}

/// All-gather and reduce-scatter over whole and partial windows, as NCCL
/// calls them (one part each; `sendData`/`recvData` start where the window
/// meets the rank's part): every rank's result against a reference.
fn gather_and_scatter(provider: &'static str, n: usize) {
    let per_rank = 3 * (collnet::CHUNK / 2) + 12; // several chunks, whole f32s
    let windows = [
        (0, n * per_rank),
        (per_rank / 2 + 2, per_rank + 8),
        (per_rank - 4, 8),
    ];
    let input = move |rank: usize| bytes(rank as u64 + 77, n * per_rank);
    let results = group(provider, n, move |rank, g| {
        let mut out = Vec::new();
        let full = input(rank);
        for &(off, len) in &windows {
            let ps = parts(n, per_rank, off, len);
            let (a, b) = ps[rank];
            // All-gather: my part of the window (from my own global input).
            let mut mine = full[a..b.max(a)].to_vec();
            mine.push(0); // never an empty buffer to register
            let mut recv = vec![0u8; len];
            let smh = collnet::reg_mr(g, mine.as_mut_ptr().cast(), mine.len(), 1).unwrap();
            let rmh = collnet::reg_mr(g, recv.as_mut_ptr().cast(), len, 1).unwrap();
            // SAFETY: registered buffers that outlive the request.
            let q = unsafe {
                collnet::iallgather(
                    g,
                    mine.as_mut_ptr().cast(),
                    recv.as_mut_ptr().cast(),
                    len,
                    rmh,
                    per_rank,
                    off,
                    len,
                    smh,
                )
            }
            .expect("iallgather");
            weft_tests::poll_until("all-gather", || collnet::test(q).unwrap());
            collnet::dereg_mr(smh).unwrap();
            collnet::dereg_mr(rmh).unwrap();
            // Reduce-scatter (f32 sum): the window of my global input.
            let mut send = full[off..off + len].to_vec();
            for c in send.chunks_mut(4) {
                let v = (u32::from_ne_bytes(c.try_into().unwrap()) % 1000) as f32;
                c.copy_from_slice(&v.to_ne_bytes());
            }
            let mut got = vec![0u8; (b - a).max(1)];
            let smh = collnet::reg_mr(g, send.as_mut_ptr().cast(), len, 1).unwrap();
            let rmh = collnet::reg_mr(g, got.as_mut_ptr().cast(), got.len(), 1).unwrap();
            // SAFETY: registered buffers that outlive the request.
            let q = unsafe {
                collnet::ireducescatter(
                    g,
                    send.as_mut_ptr().cast(),
                    len,
                    smh,
                    got.as_mut_ptr().cast(),
                    per_rank,
                    off,
                    len,
                    7,
                    0,
                    rmh,
                )
            }
            .expect("ireducescatter");
            weft_tests::poll_until("reduce-scatter", || collnet::test(q).unwrap());
            collnet::dereg_mr(smh).unwrap();
            collnet::dereg_mr(rmh).unwrap();
            got.truncate(b - a);
            out.push((recv, got));
        }
        out
    });
    for (w, &(off, len)) in windows.iter().enumerate() {
        let ps = parts(n, per_rank, off, len);
        // All-gather: the window of the concatenated parts.
        let global: Vec<u8> = (0..n)
            .flat_map(|j| input(j)[j * per_rank..(j + 1) * per_rank].to_vec())
            .collect();
        for (rank, r) in results.iter().enumerate() {
            assert!(
                r[w].0 == global[off..off + len],
                "{provider}: all-gather window {w}, rank {rank}"
            );
        }
        // Reduce-scatter: each rank's part of the window, summed in rank order.
        let f32s = |rank: usize| -> Vec<u8> {
            let mut v = input(rank)[off..off + len].to_vec();
            for c in v.chunks_mut(4) {
                let x = (u32::from_ne_bytes(c.try_into().unwrap()) % 1000) as f32;
                c.copy_from_slice(&x.to_ne_bytes());
            }
            v
        };
        let mut sum = f32s(0);
        for rank in 1..n {
            sum = reference(DataType::F32, RedOp::Sum, &sum, &f32s(rank));
        }
        for (rank, r) in results.iter().enumerate() {
            let (a, b) = ps[rank];
            assert!(
                r[w].1 == sum[a - off..b - off],
                "{provider}: reduce-scatter window {w}, rank {rank}"
            );
        }
    }
    println!(
        "{provider}: all-gather and reduce-scatter over {} windows, {n} ranks, as the reference",
        windows.len()
    );
}

#[test]
fn shm_gather_and_scatter_three_ranks() {
    weft_tests::isolated!();
    gather_and_scatter("shm", 3);
}

#[test]
fn tcp_gather_and_scatter_two_ranks() {
    weft_tests::isolated!();
    gather_and_scatter("tcp", 2);
}

const PEER: &str = env!("CARGO_BIN_EXE_weft-peer");
use weft_tests::peer::{hex, unhex, Peer};

/// Rank 1 in a peer process: see [`process_group`].
fn two_process_group(provider: &str) -> (Peer, *mut c_void, *mut c_void) {
    let (mut peers, ctx, g) = process_group(provider, 2);
    (peers.pop().expect("rank 1"), ctx, g)
}

/// Rank 0 here, ranks 1.. in peer processes: the group is built across `n`
/// processes (each `connect` blocks until all are in). The peers inherit
/// this process's environment (`WEFT_COLLNET_REDUCERS` among it).
fn process_group(provider: &str, n: usize) -> (Vec<Peer>, *mut c_void, *mut c_void) {
    let mut peers: Vec<Peer> = (1..n).map(|_| Peer::spawn(PEER)).collect();
    let ctx = host::init(provider);
    let mut hs = vec![[0u8; HANDLE_SIZE]; n];
    for (i, peer) in peers.iter_mut().enumerate() {
        peer.cmd(&format!("init {provider}"));
        let h = peer.cmd("coll-listen");
        hs[i + 1] = unhex(h.strip_prefix("handle ").expect("handle")).unwrap();
    }
    let l = collnet::listen(ctx, 0, &mut hs[0]).expect("listen");
    let all: Vec<String> = hs.iter().map(|h| hex(h)).collect();
    for (i, peer) in peers.iter_mut().enumerate() {
        peer.start(&format!("coll-connect {} {}", i + 1, all.join(" ")));
    }
    let g = collnet::connect(&hs, 0, l).expect("connect across processes");
    collnet::close_listen(l).unwrap();
    for peer in &mut peers {
        assert_eq!(peer.reply(), "ok");
    }
    (peers, ctx, g)
}

/// A `weft-reducer` process; killed when dropped, unless it exited.
struct ReducerProc {
    child: std::process::Child,
}

impl ReducerProc {
    /// Starts one over `provider` on loopback that exits after serving one
    /// group, and points this process (and the peers it spawns later) at it.
    fn start(provider: &str) -> Self {
        use std::io::BufRead;
        host::configure(provider);
        let mut child = std::process::Command::new(weft_tests::emu::weft_bin("weft-reducer"))
            .args(["--groups", "1"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn weft-reducer");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the reducer's handle");
        let hex = line
            .trim()
            .strip_prefix("handle ")
            .unwrap_or_else(|| panic!("weft-reducer said {line:?}"))
            .to_owned();
        std::env::set_var("WEFT_COLLNET_REDUCERS", &hex);
        Self { child }
    }

    /// Waits for it to exit (it does once its group ended): its stderr.
    fn finish(mut self) -> String {
        use std::io::Read;
        let mut err = String::new();
        self.child
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut err)
            .unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "weft-reducer: {status}\n{err}");
        err
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        weft::fabric::local::remove_shm_regions(self.child.id());
    }
}

impl Drop for ReducerProc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

/// The test pattern's all-reduce on rank 0 (the peer runs its half).
fn start_allreduce(g: *mut c_void, count: usize) -> (Vec<f32>, *mut c_void, *mut c_void) {
    let mut v: Vec<f32> = (0..count).map(|i| (i % 1000) as f32).collect();
    let p: *mut c_void = v.as_mut_ptr().cast();
    let mh = collnet::reg_mr(g, p, count * 4, 1).unwrap();
    // SAFETY: registered, in place; the caller keeps `v` until done.
    let q = unsafe { collnet::iallreduce(g, p, p, count, 7, 0, mh, mh) }.unwrap();
    (v, mh, q)
}

fn across_processes(provider: &str) {
    across(provider, 2, 3 * (collnet::CHUNK / 4) + 1);
}

/// An all-reduce of `count` floats over `n` processes (each checks its
/// result: the peers [`weft_tests::peer`]'s pattern, rank 0 here).
fn across(provider: &str, n: usize, count: usize) {
    let (mut peers, ctx, g) = process_group(provider, n);
    for (i, peer) in peers.iter_mut().enumerate() {
        peer.start(&format!("coll-allreduce {} {n} {count}", i + 1));
    }
    let (v, mh, q) = start_allreduce(g, count);
    weft_tests::poll_until("the all-reduce", || collnet::test(q).unwrap());
    for peer in &mut peers {
        assert_eq!(peer.reply(), "ok", "{provider}: a peer's result");
    }
    let tri = (n * (n + 1) / 2) as f32;
    assert!(
        v.iter()
            .enumerate()
            .all(|(i, &x)| x == (i % 1000) as f32 * tri),
        "{provider}: rank 0's result"
    );
    collnet::dereg_mr(mh).unwrap();
    for peer in peers {
        peer.quit();
    }
    collnet::close_coll(g).unwrap();
    core::finalize(ctx).unwrap();
}

#[test]
fn tcp_allreduce_across_two_processes() {
    weft_tests::isolated!();
    across_processes("tcp");
}

#[test]
fn shm_allreduce_across_two_processes() {
    weft_tests::isolated!();
    across_processes("shm");
}

/// A rank killed while an all-reduce waits on it: the other rank's request
/// fails within the peer timeout, naming the dead peer.
fn rank_killed(provider: &str) {
    const T: u64 = 2;
    std::env::set_var("WEFT_PEER_TIMEOUT", T.to_string());
    let (peer, ctx, g) = two_process_group(provider);
    let (_v, mh, q) = start_allreduce(g, 100_000);
    // The peer is alive and never joins: nothing completes, nothing fails.
    for _ in 0..1000 {
        assert!(
            collnet::test(q).unwrap().is_none(),
            "{provider}: done without the peer"
        );
    }
    let killed = std::time::Instant::now();
    peer.kill();
    let err = weft_tests::poll_until("the all-reduce to fail", || match collnet::test(q) {
        Ok(None) => None,
        Ok(Some(_)) => panic!("{provider}: an all-reduce completed with a rank dead"),
        Err(e) => Some(e),
    });
    let took = killed.elapsed();
    println!("{provider}: all-reduce failed {took:?} after the peer was killed: {err}");
    assert_eq!(err.code, core::Code::Remote, "{provider}: {err}");
    assert!(
        err.msg.contains("rank 1 of 2")
            && (err.msg.contains("WEFT_PEER_TIMEOUT") || err.msg.contains("broken")),
        "{provider}: the error names the rank and why: {err}"
    );
    assert!(
        took < std::time::Duration::from_secs(2 * T + 3),
        "{provider}: took {took:?}"
    );
    collnet::dereg_mr(mh).unwrap();
    collnet::close_coll(g).unwrap();
    core::finalize(ctx).unwrap();
}

#[test]
fn tcp_rank_killed_fails_the_all_reduce() {
    weft_tests::isolated!();
    rank_killed("tcp");
}

#[test]
fn shm_rank_killed_fails_the_all_reduce() {
    weft_tests::isolated!();
    rank_killed("shm");
}

/// A group of four ranks (threads) on shm: every op on int32 and bf16, and
/// an all-gather and reduce-scatter window, against the reference.
#[test]
fn shm_four_ranks() {
    weft_tests::isolated!();
    let results = group("shm", 4, |rank, g| {
        let mut out = Vec::new();
        for ty in [DataType::I32, DataType::Bf16] {
            for op in RedOp::ALL {
                let data = input(ty, 1001, (rank * 31 + ty as usize * 7 + op as usize) as u64);
                out.push(allreduce(g, ty, op, &data, rank % 2 == 0));
            }
        }
        out
    });
    let mut i = 0;
    for ty in [DataType::I32, DataType::Bf16] {
        for op in RedOp::ALL {
            let mut want = input(ty, 1001, (ty as usize * 7 + op as usize) as u64);
            for rank in 1..4 {
                want = reference(
                    ty,
                    op,
                    &want,
                    &input(ty, 1001, (rank * 31 + ty as usize * 7 + op as usize) as u64),
                );
            }
            for (rank, r) in results.iter().enumerate() {
                assert!(r[i] == want, "{ty:?} {op:?}: rank {rank}");
            }
            i += 1;
        }
    }
}

/// The same under sendrecv, where the dead rank's receives are posted to
/// the provider: the failed all-reduce first gets them back.
#[test]
fn tcp_rank_killed_fails_the_all_reduce_sendrecv() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_PROTOCOL", "sendrecv");
    rank_killed("tcp");
}

#[test]
fn shm_rank_killed_fails_the_all_reduce_sendrecv() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_PROTOCOL", "sendrecv");
    rank_killed("shm");
}

// ---- Reduction servers ----

#[test]
fn shm_through_two_reducers_every_type_and_op_three_ranks() {
    weft_tests::isolated!();
    every_type_and_op("shm", 3, 2);
}

#[test]
fn tcp_through_a_reducer_every_type_and_op_two_ranks() {
    weft_tests::isolated!();
    every_type_and_op("tcp", 2, 1);
}

#[test]
fn shm_through_reducers_requests_in_flight() {
    weft_tests::isolated!();
    requests_in_flight(2);
}

/// The point of a reducer: each rank sends and receives the buffer once,
/// where the in-plugin algorithm moves 2(n-1)/n of it each way. Counted by
/// the ranks and by the reducers.
#[test]
fn shm_through_a_reducer_each_rank_moves_the_buffer_once() {
    weft_tests::isolated!();
    let count = 2 * collnet::CHUNK / 4 + 3;
    let bytes = (count * 4) as u64;
    let run = |m: usize| {
        served("shm", 4, m, move |rank, g| {
            let data = input(DataType::F32, count, rank as u64);
            allreduce(g, DataType::F32, RedOp::Sum, &data, true);
            collnet::bytes_moved(g).unwrap()
        })
    };
    let (mesh, _) = run(0);
    let (via, stats) = run(1);
    for (rank, (&(ms, mr), &(vs, vr))) in mesh.iter().zip(&via).enumerate() {
        println!("rank {rank}: in-plugin sent {ms} received {mr}; through a reducer sent {vs} received {vr}");
        assert_eq!((vs, vr), (bytes, bytes), "rank {rank} through the reducer");
        // 2 (n-1)/n = 1.5 of the buffer each way, give or take the odd element.
        assert!(
            ms > bytes * 14 / 10 && mr > bytes * 14 / 10,
            "rank {rank} in-plugin"
        );
    }
    assert_eq!(
        (stats[0].bytes_in, stats[0].bytes_out),
        (4 * bytes, 4 * bytes)
    );
}

/// Ranks that issue different all-reduces (a broken contract NCCL never
/// breaks) fail, instead of getting a wrong result, and the reducer's log
/// says why.
#[test]
fn tcp_ranks_that_disagree_fail_and_the_reducer_says_why() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_PEER_TIMEOUT", "5");
    let (errs, stats) = served("tcp", 2, 1, |rank, g| {
        let count = 1000 + rank; // rank 1 asks for one element more
        let mut v = input(DataType::F32, count, 1);
        let p: *mut c_void = v.as_mut_ptr().cast();
        let mh = collnet::reg_mr(g, p, v.len(), 1).unwrap();
        // SAFETY: registered, in place, kept until the request ends.
        let q = unsafe { collnet::iallreduce(g, p, p, count, 7, 0, mh, mh) }.unwrap();
        let e = weft_tests::poll_until("the all-reduce to fail", || match collnet::test(q) {
            Ok(None) => None,
            Ok(Some(_)) => panic!("rank {rank}: an all-reduce of mismatched sizes completed"),
            Err(e) => Some(e),
        });
        collnet::dereg_mr(mh).unwrap();
        e
    });
    for (rank, e) in errs.iter().enumerate() {
        println!("rank {rank}: {e}");
        assert_eq!(e.code, core::Code::Remote, "rank {rank}: {e}");
        assert!(e.msg.contains("reducer 0 of 1"), "rank {rank}: {e}");
    }
    assert_eq!(stats[0].failed, 1, "the reducer ended the group");
    let why = weft_tests::capture::lines()
        .into_iter()
        .find(|l| l.text.contains("disagree"))
        .expect("the reducer logs why it ended the group");
    println!("reducer: {}", why.text);
    assert_eq!(why.level, weft::log::level::WARN);
    assert!(why.text.contains("ranks 0 and 1") && why.text.contains("len: 4000"));
}

/// Four processes, four ranks, the in-plugin algorithm.
#[test]
fn tcp_four_processes() {
    weft_tests::isolated!();
    across("tcp", 4, 300_001);
}

/// Four processes through a `weft-reducer` process: three ranks (this
/// process and two peers) and the reducer, which counts what it did.
fn through_a_reducer_process(provider: &str) {
    let reducer = ReducerProc::start(provider);
    let count = 3 * (collnet::CHUNK / 4) + 1;
    across(provider, 3, count);
    let log = reducer.finish();
    println!("{provider}: weft-reducer said:\n{log}");
    // Its comms to ranks that had closed and exited close at once: before,
    // their answering Bye, refused for ever once a rank's process was gone
    // (seen under load), held each close for WEFT_PEER_TIMEOUT (2 x 60 s).
    assert!(
        !log.contains("closing the send comm"),
        "{provider}: a close of the reducer waited: {log}"
    );
    let bytes = 3 * count * 4;
    assert!(
        log.contains(&format!(
            "1 groups served (0 failed), 1 all-reduces, {bytes} bytes in, {bytes} bytes out"
        )),
        "{provider}: {log}"
    );
}

#[test]
fn tcp_through_a_reducer_process() {
    weft_tests::isolated!();
    through_a_reducer_process("tcp");
}

#[test]
fn shm_through_a_reducer_process() {
    weft_tests::isolated!();
    through_a_reducer_process("shm");
}

/// Through a reducer, a rank killed or the reducer killed while an
/// all-reduce waits: rank 0's request fails within the peer timeout (the
/// reducer ends the group when a rank dies; rank 0 sees the reducer die).
fn killed_through_a_reducer(provider: &str, kill_the_reducer: bool) {
    const T: u64 = 2;
    std::env::set_var("WEFT_PEER_TIMEOUT", T.to_string());
    let mut reducer = ReducerProc::start(provider);
    let (peer, ctx, g) = two_process_group(provider);
    let (_v, mh, q) = start_allreduce(g, 100_000);
    for _ in 0..1000 {
        assert!(collnet::test(q).unwrap().is_none(), "done without rank 1");
    }
    let killed = std::time::Instant::now();
    if kill_the_reducer {
        reducer.kill();
    } else {
        peer.kill();
    }
    let err = weft_tests::poll_until("the all-reduce to fail", || match collnet::test(q) {
        Ok(None) => None,
        Ok(Some(_)) => panic!("{provider}: an all-reduce completed"),
        Err(e) => Some(e),
    });
    let took = killed.elapsed();
    println!("{provider}: failed {took:?} after the kill: {err}");
    assert_eq!(err.code, core::Code::Remote, "{provider}: {err}");
    assert!(err.msg.contains("reducer 0 of 1"), "{provider}: {err}");
    assert!(
        took < std::time::Duration::from_secs(2 * T + 3),
        "{provider}: took {took:?}"
    );
    collnet::dereg_mr(mh).unwrap();
    collnet::close_coll(g).unwrap();
    core::finalize(ctx).unwrap();
    if !kill_the_reducer {
        let log = reducer.finish();
        assert!(
            log.contains("1 groups served (1 failed)"),
            "{provider}: {log}"
        );
    }
}

#[test]
fn tcp_rank_killed_through_a_reducer() {
    weft_tests::isolated!();
    killed_through_a_reducer("tcp", false);
}

#[test]
fn shm_rank_killed_through_a_reducer() {
    weft_tests::isolated!();
    killed_through_a_reducer("shm", false);
}

#[test]
fn tcp_reducer_killed() {
    weft_tests::isolated!();
    killed_through_a_reducer("tcp", true);
}

#[test]
fn shm_reducer_killed() {
    weft_tests::isolated!();
    killed_through_a_reducer("shm", true);
}

/// The largest size the issue names: 64 MiB of fp32 and three elements
/// more (an odd count), in-plugin and through a reducer, on 2 ranks.
#[test]
fn shm_64_mib_in_plugin_and_through_a_reducer() {
    weft_tests::isolated!();
    let count = (64 << 20) / 4 + 3;
    for m in [0, 1] {
        let (results, _) = served("shm", 2, m, move |rank, g| {
            let data = input(DataType::F32, count, 77 + rank as u64);
            allreduce(g, DataType::F32, RedOp::Sum, &data, rank == 0)
        });
        let want = reference(
            DataType::F32,
            RedOp::Sum,
            &input(DataType::F32, count, 77),
            &input(DataType::F32, count, 78),
        );
        for (rank, r) in results.iter().enumerate() {
            assert!(
                r == &want,
                "{m} reducer(s): rank {rank} differs from the reference"
            );
        }
        println!("64 MiB + 3 floats, {m} reducer(s): both ranks bit-identical to the reference");
    }
}

/// Garbage from a peer at a reducer (a join of the wrong size, a forged
/// join) is refused with a warning naming what was wrong, and the reducer
/// serves the next group as before.
#[test]
fn tcp_a_reducer_refuses_forged_joins_and_carries_on() {
    weft_tests::isolated!();
    let forge = |rh: &[[u8; HANDLE_SIZE]]| {
        let ctx = host::init_logged("tcp");
        let forged = |bytes: Vec<u8>| {
            let mut h = rh[0];
            let s = host::connect(ctx, &mut h);
            let mh = host::reg(s, &bytes);
            host::wait(host::isend(s, &bytes, collnet::wire::HELLO_TAG, mh));
            (s, mh, bytes)
        };
        let short = forged(vec![0xab; 20]);
        let mut bad = vec![0xab; collnet::wire::Join::LEN];
        bad[..4].copy_from_slice(b"WFRJ");
        let garbage = forged(bad);
        let warned = |what: &str| {
            weft_tests::capture::lines()
                .iter()
                .any(|l| l.text.contains("reducer") && l.text.contains(what))
        };
        weft_tests::poll_until("the reducer's warnings", || {
            (warned("20 bytes where 160 were due") && warned("malformed CollNet join"))
                .then_some(())
        });
        for (s, mh, _bytes) in [short, garbage] {
            core::dereg_mr(s, mh).unwrap();
            core::close_send(s).unwrap();
        }
        core::finalize(ctx).unwrap();
    };
    let (results, stats) = served_after("tcp", 2, 1, forge, |rank, g| {
        let data = input(DataType::I32, 1000, rank as u64);
        allreduce(g, DataType::I32, RedOp::Sum, &data, false)
    });
    let want = reference(
        DataType::I32,
        RedOp::Sum,
        &input(DataType::I32, 1000, 0),
        &input(DataType::I32, 1000, 1),
    );
    assert!(
        results.iter().all(|r| r == &want),
        "the group after the garbage"
    );
    assert_eq!((stats[0].groups, stats[0].ops, stats[0].failed), (1, 1, 0));
    for l in weft_tests::capture::lines()
        .iter()
        .filter(|l| l.text.contains("reducer:"))
    {
        println!("{}", l.text);
    }
}

/// Every CollNet buffer is checked against its handle's registered range
/// before anything is allocated: a count one element past a 1 MiB
/// registration, 2^28 elements and 2^40 elements (a 4 TiB scratch, had it
/// been allocated) are refused with an error naming the buffer; so are an
/// all-gather part and a reduce-scatter window past theirs. Then the group
/// still reduces.
#[test]
fn shm_buffers_outside_their_registration_are_refused() {
    weft_tests::isolated!();
    let results = group("shm", 2, |_, g| {
        const LEN: usize = 1 << 20;
        let mut a = vec![0u8; LEN];
        let mut b = vec![0u8; LEN];
        let (pa, pb): (*mut c_void, *mut c_void) = (a.as_mut_ptr().cast(), b.as_mut_ptr().cast());
        let amh = collnet::reg_mr(g, pa, LEN, 1).unwrap();
        let bmh = collnet::reg_mr(g, pb, LEN, 1).unwrap();
        let mut errors = Vec::new();
        for count in [LEN / 4 + 1, 1 << 28, 1 << 40] {
            // SAFETY: the core must refuse these before touching either buffer.
            let r = unsafe { collnet::iallreduce(g, pa, pb, count, 7, 0, amh, bmh) };
            errors.push(r.expect_err("a count past the registration").msg);
        }
        // SAFETY: as above (the window is the whole 2 x 1 MiB buffer, which
        // the 1 MiB receive buffer cannot hold).
        let r = unsafe { collnet::iallgather(g, pa, pb, 2 * LEN, bmh, LEN, 0, 2 * LEN, amh) };
        errors.push(r.expect_err("a gather window past its registration").msg);
        // SAFETY: as above.
        let r =
            unsafe { collnet::ireducescatter(g, pa, 2 * LEN, amh, pb, LEN, 0, 2 * LEN, 2, 0, bmh) };
        errors.push(r.expect_err("a scatter window past its registration").msg);
        collnet::dereg_mr(amh).unwrap();
        collnet::dereg_mr(bmh).unwrap();
        let data = input(DataType::I32, 1000, 3);
        (
            errors,
            allreduce(g, DataType::I32, RedOp::Sum, &data, false),
        )
    });
    for (errors, sum) in results {
        for e in &errors {
            assert!(
                e.contains("outside its memory handle's registered range"),
                "{e}"
            );
        }
        let data = input(DataType::I32, 1000, 3);
        assert!(sum == reference(DataType::I32, RedOp::Sum, &data, &data));
    }
}
