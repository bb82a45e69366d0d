//! The threaded steps of a cell: progress threads beside a service thread, and a peer in another process.

use super::*;

/// Rounds each progress thread runs, and pairs the service thread cycles.
pub(super) const THREAD_ROUNDS: usize = 48;
pub(super) const SERVICE_PAIRS: usize = 6;

/// A service thread (listen, connect, accept, regMr, deregMr, close) beside
/// two progress threads (isend, irecv, test, each on a pair of its own) on
/// the same table at once, as NCCL runs them. Returns the checks made.
pub(super) unsafe fn threads(
    n: &dyn Net,
    ctx: *mut c_void,
    version: u32,
    provider: &str,
) -> Res<usize> {
    let checks = || Checks {
        v: version,
        provider: provider.to_owned(),
        n: 0,
    };
    let mut c0 = checks();
    // SAFETY: NCCL's conventions, as in `cell`.
    let pairs = unsafe { [pair(n, &mut c0, ctx, true)?, pair(n, &mut c0, ctx, false)?] };
    let ctx_a = ctx as usize;
    let results: Vec<Res<usize>> = std::thread::scope(|sc| {
        let mut hs = Vec::new();
        for (k, p) in pairs.iter().enumerate() {
            let (s, r) = (p.s as usize, p.r as usize);
            hs.push(sc.spawn(move || -> Res<usize> {
                let mut c = checks();
                let (s, r) = (s as *mut c_void, r as *mut c_void);
                let len = 20_000 + 1000 * k;
                let mut dst = vec![0u8; len];
                let (mut smh, mut rmh) = (null(), null());
                // SAFETY: the buffers outlive every request (each round waits).
                unsafe {
                    for round in 0..THREAD_ROUNDS {
                        let src = pattern(round as u64, k as c_int, len);
                        c.ok(
                            "regMr",
                            "progress thread",
                            n.reg_mr(s, src.as_ptr() as *mut c_void, len, &mut smh),
                        )?;
                        c.ok(
                            "regMr",
                            "progress thread",
                            n.reg_mr(r, dst.as_mut_ptr().cast(), len, &mut rmh),
                        )?;
                        let rq = irecv(
                            n,
                            &mut c,
                            r,
                            &mut [dst.as_mut_ptr().cast()],
                            &[len],
                            &mut [7],
                            &mut [rmh],
                        )?;
                        let sq = isend(n, &mut c, s, &src, 7, smh)?;
                        let sizes = wait_all(n, &mut c, &[sq, rq], round % 2 == 1)?;
                        c.that(
                            sizes[1][0] == len as c_int && dst == src,
                            "test",
                            format_args!("progress thread {k}, round {round}"),
                            format_args!("{len} bytes as sent"),
                            format_args!(
                                "{} bytes, content {}",
                                sizes[1][0],
                                if dst == src { "equal" } else { "different" }
                            ),
                        )?;
                        c.ok("deregMr", "progress thread", n.dereg_mr(s, smh))?;
                        c.ok("deregMr", "progress thread", n.dereg_mr(r, rmh))?;
                    }
                }
                Ok(c.n)
            }));
        }
        hs.push(sc.spawn(move || -> Res<usize> {
            let mut c = checks();
            let ctx = ctx_a as *mut c_void;
            let buf = vec![0u8; 1 << 16];
            // SAFETY: NCCL's conventions; `buf` outlives its registrations.
            unsafe {
                for i in 0..SERVICE_PAIRS {
                    let p = pair(n, &mut c, ctx, i % 2 == 0)?;
                    let (mut a, mut b) = (null(), null());
                    c.ok(
                        "regMr",
                        "service thread",
                        n.reg_mr(p.s, buf.as_ptr() as *mut c_void, buf.len(), &mut a),
                    )?;
                    c.ok(
                        "regMr",
                        "service thread",
                        n.reg_mr(p.r, buf.as_ptr() as *mut c_void, 4096, &mut b),
                    )?;
                    c.ok("deregMr", "service thread", n.dereg_mr(p.s, a))?;
                    c.ok("deregMr", "service thread", n.dereg_mr(p.r, b))?;
                    c.ok("closeSend", "service thread", n.close_send(p.s))?;
                    c.ok("closeRecv", "service thread", n.close_recv(p.r))?;
                }
            }
            Ok(c.n)
        }));
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a thread panicked".to_owned()))
            })
            .collect()
    });
    let mut total = c0.n;
    for r in results {
        total += r?;
    }
    for p in pairs {
        // SAFETY: both comms are live and idle.
        unsafe {
            c0.ok("closeSend", "after the threads", n.close_send(p.s))?;
            c0.ok("closeRecv", "after the threads", n.close_recv(p.r))?;
        }
    }
    Ok(total + 4)
}

pub(super) unsafe fn two_process(
    n: &dyn Net,
    c: &mut Checks,
    ctx: *mut c_void,
    version: u32,
    provider: &str,
    peer: &Path,
) -> Res<usize> {
    let server = crate::peer::Server::spawn(peer, version, provider, 16)?;
    let mut h = server.handle;
    let size = 1usize << 20;
    let msgs: Vec<u8> = (0..16u64).flat_map(|i| pattern(i, 3, size)).collect();
    let (mut s, mut mh) = (null(), null());
    // SAFETY: NCCL's conventions; `msgs` outlives the requests.
    unsafe {
        until("connect to the peer", || {
            c.rc(
                "connect",
                "to another process",
                n.connect(ctx, 0, h.as_mut_ptr().cast(), &mut s, true),
            )?;
            Ok(!s.is_null())
        })?;
        c.n += 1;
        c.ok(
            "regMr",
            "two-process buffers",
            n.reg_mr(s, msgs.as_ptr() as *mut c_void, msgs.len(), &mut mh),
        )?;
        let mut reqs = Vec::new();
        for i in 0..16 {
            reqs.push(isend(n, c, s, &msgs[i * size..(i + 1) * size], 3, mh)?);
            if reqs.len() == 8 {
                wait_all(n, c, &reqs, false)?;
                reqs.clear();
            }
        }
        wait_all(n, c, &reqs, false)?;
    }
    let verdict = server.finish()?;
    // SAFETY: as above.
    unsafe {
        c.ok("deregMr", "two-process buffers", n.dereg_mr(s, mh))?;
        c.ok("closeSend", "two-process comm", n.close_send(s))?;
    }
    let moved = verdict
        .strip_prefix("ok 16 ")
        .and_then(|b| b.parse::<usize>().ok())
        .ok_or_else(|| format!("peer: {verdict}"))?;
    Ok(moved)
}
