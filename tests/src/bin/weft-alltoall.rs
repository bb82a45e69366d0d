//! One rank of an all-to-all through the net tables' core, for the
//! namespace cluster test (`tests/tests/cluster.rs`).
//!
//! ```text
//! weft-alltoall RANK NRANKS DIR COMMS MESSAGES SIZE
//! ```
//!
//! As NCCL does, one listener per incoming comm: rank T listens once for
//! each comm k from each rank F and writes the handle to `DIR/F-T-K.handle`;
//! rank F connects to it. So every rank opens `COMMS` send comms to every
//! other rank and accepts `COMMS` receive comms from each. Then every pair
//! of comms carries
//! `MESSAGES` messages of `SIZE` bytes, every one verified. Prints one line:
//! `ok RANK bytes B comms C endpoints E fds F rss_kb R`, or `error ...`.

use std::ffi::c_void;
use std::path::PathBuf;
use std::time::Instant;

use weft::core::{self, RecvArg};
use weft::proto::wire::HANDLE_SIZE;
use weft_tests::host::{self, pattern};
use weft_tests::peer::{hex, unhex};

fn arg(i: usize) -> Result<String, String> {
    std::env::args()
        .nth(i)
        .ok_or_else(|| "usage: weft-alltoall RANK NRANKS DIR COMMS MESSAGES SIZE".to_owned())
}

fn num(i: usize) -> Result<usize, String> {
    arg(i)?.parse().map_err(|e| format!("argument {i}: {e}"))
}

/// The tag of messages from rank `from`'s comm `k`.
fn tag(from: usize, k: usize) -> i32 {
    (from * 64 + k) as i32
}

fn run() -> Result<String, String> {
    let (rank, n) = (num(1)?, num(2)?);
    let dir = PathBuf::from(arg(3)?);
    let (comms, messages, size) = (num(4)?, num(5)?, num(6)?);
    let e = |e: weft::error::Error| e.to_string();
    // The provider and interface come from the environment (WEFT_PROVIDER,
    // WEFT_IFACE, FI_TCP_IFACE: the namespace's rail).
    let ctx = core::init(core::InitArgs {
        traffic_class: -1,
        ..Default::default()
    })
    .map_err(e)?;
    // As NCCL does: one listener per incoming connection. The receiver of
    // comm k from rank `from` writes its handle to DIR/FROM-TO-K.handle.
    let want: Vec<(usize, usize)> = (0..n)
        .filter(|&r| r != rank)
        .flat_map(|r| (0..comms).map(move |k| (r, k)))
        .collect();
    let mut listens = Vec::new();
    for &(from, k) in &want {
        let (h, l) = host::listen(ctx);
        let name = format!("{from}-{rank}-{k}");
        let tmp = dir.join(format!("{name}.tmp"));
        std::fs::write(&tmp, hex(&h)).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, dir.join(format!("{name}.handle"))).map_err(|e| e.to_string())?;
        listens.push(l);
    }
    let mut hs: Vec<[u8; HANDLE_SIZE]> = Vec::new();
    for &(to, k) in &want {
        let path = dir.join(format!("{rank}-{to}-{k}.handle"));
        let text =
            weft_tests::poll_until("the peers' handles", || std::fs::read_to_string(&path).ok());
        hs.push(unhex(text.trim())?);
    }
    // Connect every send comm while accepting on every listener.
    let mut sends: Vec<Option<*mut c_void>> = vec![None; want.len()];
    let mut recvs: Vec<Option<*mut c_void>> = vec![None; want.len()];
    weft_tests::poll_until("connect and accept every comm", || {
        for (i, s) in sends.iter_mut().enumerate() {
            if s.is_none() {
                *s = core::connect(ctx, 0, None, &mut hs[i]).expect("connect");
            }
        }
        for (i, r) in recvs.iter_mut().enumerate() {
            if r.is_none() {
                *r = core::accept(listens[i]).expect("accept");
            }
        }
        (sends.iter().all(Option::is_some) && recvs.iter().all(Option::is_some)).then_some(())
    });
    for l in listens {
        core::close_listen(l).map_err(e)?;
    }
    let sends: Vec<*mut c_void> = sends.into_iter().map(|s| s.expect("connected")).collect();
    let recvs: Vec<*mut c_void> = recvs.into_iter().map(|r| r.expect("accepted")).collect();
    let out: Vec<Vec<Vec<u8>>> = want
        .iter()
        .map(|&(_, k)| {
            (0..messages)
                .map(|m| pattern(m as u64, tag(rank, k), size))
                .collect()
        })
        .collect();
    let mut inb: Vec<Vec<Vec<u8>>> = (0..recvs.len())
        .map(|_| (0..messages).map(|_| vec![0u8; size]).collect())
        .collect();
    let t0 = Instant::now();
    let mut bytes = 0u64;
    for m in 0..messages {
        // Each request with what it is, for the error if one never ends.
        let mut reqs: Vec<(*mut c_void, String)> = Vec::new();
        let mut mhs = Vec::new();
        for (i, &r) in recvs.iter().enumerate() {
            let (from, k) = want[i];
            let mh = host::reg(r, &inb[i][m]);
            let arg = RecvArg {
                data: inb[i][m].as_mut_ptr().cast(),
                size,
                tag: tag(from, k),
                mhandle: mh,
                phandle: std::ptr::null_mut(),
            };
            let q = weft_tests::poll_until("irecv", || host::irecv_raw(r, &[arg]).expect("irecv"));
            reqs.push((q, format!("the receive from rank {from} comm {k}")));
            mhs.push((r, mh));
        }
        for (i, &s) in sends.iter().enumerate() {
            let mh = host::reg(s, &out[i][m]);
            let q = host::isend(s, &out[i][m], tag(rank, want[i].1), mh);
            reqs.push((
                q,
                format!("the send to rank {} comm {}", want[i].0, want[i].1),
            ));
            mhs.push((s, mh));
        }
        // Wait for each in turn, testing only it (the pattern that found a
        // rare hang: see docs/many-hosts.md); say which never ended.
        let limit = Instant::now() + weft_tests::timeout();
        for (at, (q, what)) in reqs.iter().enumerate() {
            while core::test(*q).map_err(e)?.is_none() {
                if Instant::now() > limit {
                    let later: Vec<&str> = reqs[at + 1..]
                        .iter()
                        .filter(|(q, _)| core::test(*q).ok().flatten().is_none())
                        .map(|(_, w)| w.as_str())
                        .collect();
                    return Err(format!(
                        "message {m}: {what} not done after {:?} (WEFT_TEST_TIMEOUT) with every peer alive; \
                         also not done: [{}]",
                        weft_tests::timeout(),
                        later.join(", ")
                    ));
                }
                std::thread::yield_now();
            }
        }
        for (c, mh) in mhs {
            core::dereg_mr(c, mh).map_err(e)?;
        }
        for (i, buf) in inb.iter().enumerate() {
            let (from, k) = want[i];
            if buf[m] != pattern(m as u64, tag(from, k), size) {
                return Err(format!("message {m} from rank {from} comm {k} differs"));
            }
            bytes += size as u64;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let rss = weft_tests::status_kb("VmRSS");
    for s in sends {
        core::close_send(s).map_err(e)?;
    }
    for r in recvs {
        core::close_recv(r).map_err(e)?;
    }
    core::finalize(ctx).map_err(e)?;
    Ok(format!(
        "ok {rank} bytes {bytes} comms {} fds {fds} rss_kb {rss} secs {secs:.2}",
        2 * want.len()
    ))
}

fn main() {
    match run() {
        Ok(line) => println!("{line}"),
        Err(e) => {
            println!("error {e}");
            std::process::exit(1);
        }
    }
}
