//! A buggy NCCL host and a hostile peer, in one process (tcp and shm): forged
//! handles and control messages, addresses of any length, stale and foreign
//! pointers, buffers outside their registration, NULL out-pointers, one end
//! of a connection closed under the other, and a comm whose lock is held as
//! a stuck keeper would. Each must be a clear error, never a crash, a hang or
//! memory that grows.

use std::ffi::c_void;
use std::sync::mpsc;

use weft::core;
use weft::proto::wire::{self, Ctrl, ListenHandle, HANDLE_SIZE};
use weft::proto::MAX_PENDING;
use weft_tests::capture::{lines, weft_test_capture_logger};
use weft_tests::forge::Forger;
use weft_tests::host::*;
use weft_tests::{both, poll_until, status_kb};

/// A context whose log lines are captured.
fn init_logged(provider: &str) -> *mut c_void {
    configure(provider);
    core::init(core::InitArgs {
        logger: Some(weft_test_capture_logger),
        traffic_class: -1,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("init over {provider}: {e}"))
}

fn logged(text: &str) -> usize {
    lines().iter().filter(|l| l.text.contains(text)).count()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// A handle with a consistent check value whose address is empty or shorter
/// than the provider's: `connect` refuses it before libfabric reads it.
fn short_handle_addresses(provider: &str) {
    let ctx = init(provider);
    let (good, l) = listen(ctx);
    let real = ListenHandle::decode(&good).unwrap();
    // Empty; one byte short of the real address (shm: the string without its
    // NUL); and short binary ones (tcp) or strings without a NUL (shm).
    let mut cases: Vec<Vec<u8>> = vec![Vec::new(), real.addr[..real.addr.len() - 1].to_vec()];
    if provider == "tcp" {
        cases.extend([vec![2], vec![2, 0, 1, 2, 127]]);
    } else {
        cases.push(b"fi_shm://1".to_vec());
    }
    for addr in cases {
        let len = addr.len();
        let mut h = [0u8; HANDLE_SIZE];
        ListenHandle {
            nonce: real.nonce,
            addr,
            ..real.clone()
        }
        .encode(&mut h)
        .unwrap();
        let e = core::connect(ctx, 0, None, &mut h).expect_err("a short address must be refused");
        assert_eq!(
            e.kind,
            core::Kind::BadListenHandle,
            "{provider}, {len} bytes: {e}"
        );
        assert!(e.msg.contains("address"), "{provider}, {len} bytes: {e}");
    }
    // The listener is unharmed.
    let mut good = good;
    let (s, r) = connect_pair(ctx, &mut good, l);
    core::close_listen(l).unwrap();
    close_pair(s, r);
}
both!(short_handle_addresses: tcp_short_handle_addresses, shm_short_handle_addresses);

/// Conns with the listener's nonce and an empty, short or oversized address:
/// the listener logs and drops them, and accepts the real connection.
fn forged_conn_addresses(provider: &str) {
    let ctx = init_logged(provider);
    let (mut h, l) = listen(ctx);
    let real = ListenHandle::decode(&h).unwrap();
    let f = Forger::open(provider);
    let to = f.peer(&real.addr);
    f.aim(real.id);
    let mut short = f.name();
    short.truncate(short.len() - 1);
    // Empty; one byte short (shm: no NUL); for tcp also 3 bytes of a sockaddr.
    let mut cases = vec![Vec::new(), short];
    if provider == "tcp" {
        cases.push(vec![2, 0, 1]);
    }
    let n = cases.len();
    for (conn, addr) in cases.into_iter().enumerate() {
        let msg = Ctrl::Conn {
            listener: real.nonce,
            conn: conn as u64,
            id: 1,
            addr,
        };
        f.send_while(to, &msg, || assert!(core::accept(l).unwrap().is_none()));
    }
    poll_until("the listener to drop the forged Conns", || {
        assert!(core::accept(l).unwrap().is_none());
        (logged("bad handshake message") + logged("unusable address") >= n).then_some(())
    });
    let (s, r) = connect_pair(ctx, &mut h, l);
    core::close_listen(l).unwrap();
    close_pair(s, r);
}
both!(forged_conn_addresses: tcp_forged_conn_addresses, shm_forged_conn_addresses);

/// An Ack with an empty or short address: the connecting side ignores it and
/// keeps waiting for a real one.
fn forged_ack_addresses(provider: &str) {
    let ctx = init_logged(provider);
    let f = Forger::open(provider);
    let (real, l) = listen(ctx);
    let proto = ListenHandle::decode(&real).unwrap().proto;
    core::close_listen(l).unwrap();
    let mut h = [0u8; HANDLE_SIZE];
    ListenHandle {
        nonce: 77,
        addr: f.name(),
        id: 0,
        proto,
    }
    .encode(&mut h)
    .unwrap();
    let conn = poll_until("the Conn at the fake listener", || {
        assert!(core::connect(ctx, 0, None, &mut h).unwrap().is_none());
        match f.try_recv() {
            Some(Ctrl::Conn {
                listener: 77,
                conn,
                id,
                addr,
            }) => Some((conn, addr, id)),
            _ => None,
        }
    });
    let back = f.peer(&conn.1);
    f.aim(conn.2);
    let mut short = f.name();
    short.truncate(short.len() - 1);
    for addr in [Vec::new(), vec![1, 2, 3], short] {
        f.send(
            back,
            &Ctrl::Ack {
                conn: conn.0,
                credits: 8,
                eager: 0,
                announce: false,
                id: 1,
                addr,
            },
        );
    }
    poll_until("the connecting side to ignore the forged Acks", || {
        assert!(core::connect(ctx, 0, None, &mut h).unwrap().is_none());
        (logged("bad control message") + logged("unusable address") >= 3).then_some(())
    });
}
both!(forged_ack_addresses: tcp_forged_ack_addresses, shm_forged_ack_addresses);

/// A Conn whose Ack is lost (the provider took it, as it can take a Conn
/// and lose it): the connecting side repeats its Conn, and the listener
/// answers it again; `accept` hands out the comm only once the peer itself
/// confirmed it, and the comm then carries the peer's messages.
fn a_lost_ack_is_answered_again(provider: &str) {
    let ctx = init_logged(provider);
    let (h, l) = listen(ctx);
    let real = ListenHandle::decode(&h).unwrap();
    let f = Forger::open(provider);
    let to = f.peer(&real.addr);
    f.aim(real.id);
    f.sign(0x5157_0001);
    let conn = Ctrl::Conn {
        listener: real.nonce,
        conn: 0xA11CE,
        id: 77,
        addr: f.name(),
    };
    let not_yet = || {
        assert!(
            core::accept(l).unwrap().is_none(),
            "{provider}: accepted before the peer confirmed"
        )
    };
    let ack = || {
        poll_until("the listener's Ack", || {
            not_yet();
            match f.try_recv() {
                Some(Ctrl::Ack {
                    conn: 0xA11CE,
                    id,
                    addr,
                    ..
                }) => Some((id, addr)),
                _ => None,
            }
        })
    };
    f.send_while(to, &conn, not_yet);
    let first = ack();
    // That Ack was "lost": the Conn comes again, and so must the Ack.
    f.send_while(to, &conn, not_yet);
    let again = ack();
    assert_eq!(first, again, "{provider}: the same handshake answered");
    let back = f.peer(&again.1);
    f.aim(again.0);
    f.send_while(back, &Ctrl::Alive, || {});
    let r = poll_until("accept after the peer confirmed", || {
        core::accept(l).unwrap()
    });
    core::close_listen(l).unwrap();
    core::close_recv(r).unwrap();
}
both!(a_lost_ack_is_answered_again: tcp_a_lost_ack_is_answered_again, shm_a_lost_ack_is_answered_again);

/// One `accept` that must not hand out a comm: forged handshakes expire
/// (an error once none is left pending), none is ever confirmed.
fn quiet_accept(l: *mut c_void) {
    match core::accept(l) {
        Ok(None) => {}
        Ok(Some(_)) => panic!("accepted a forged connection"),
        Err(e) => assert!(e.msg.contains("never confirmed"), "{e}"),
    }
}

/// A flood of forged Conns (valid addresses, the right nonce), far more
/// than MAX_PENDING, while the host keeps accepting: the listener holds at
/// most MAX_PENDING handshakes, refuses the rest once all are answered, grows
/// neither fds nor memory, and a real connection made right after the flood
/// is accepted (once the forged ones' confirm window passed) and works.
fn forged_conns_are_bounded(provider: &str) {
    std::env::set_var("WEFT_PEER_TIMEOUT", "4");
    let ctx = init_logged(provider);
    let (mut h, l) = listen(ctx);
    let real = ListenHandle::decode(&h).unwrap();
    let f = Forger::open(provider);
    let to = f.peer(&real.addr);
    f.aim(real.id);
    assert!(core::accept(l).unwrap().is_none());
    let (fds0, rss0) = (open_fds(), status_kb("VmRSS"));
    let n = MAX_PENDING as u64 + 200;
    for conn in 0..n {
        let msg = Ctrl::Conn {
            listener: real.nonce,
            conn: 1000 + conn,
            id: 1,
            addr: f.name(),
        };
        f.send_while(to, &msg, || quiet_accept(l));
        quiet_accept(l);
    }
    poll_until(
        "the listener to refuse the forged Conns beyond its room",
        || {
            quiet_accept(l);
            (logged("refused a new one") >= 1).then_some(())
        },
    );
    let (fds1, rss1) = (open_fds(), status_kb("VmRSS"));
    println!(
        "{provider}: {n} forged Conns: +{} fds, +{} MB",
        fds1 - fds0,
        (rss1.saturating_sub(rss0)) / 1024
    );
    // A pending handshake is a receive comm on the shared endpoint.
    assert!(fds1 - fds0 <= 10, "{provider}: {fds0} -> {fds1} fds");
    assert!(
        rss1.saturating_sub(rss0) < 64 * 1024,
        "{provider}: RSS {rss0} -> {rss1} kB"
    );
    // The forged handshakes expire within their confirm window (two
    // heartbeat periods); with nothing else pending, accept says so once.
    let e = poll_until("the forged handshakes to expire", || core::accept(l).err());
    assert!(e.msg.contains("never confirmed"), "{provider}: {e}");
    let (s, r) = connect_pair(ctx, &mut h, l);
    // The real comm works.
    send_verified(s, r, 5, 5000);
    assert_eq!(
        logged("dropped the oldest"),
        0,
        "answered handshakes are never evicted"
    );
    core::close_listen(l).unwrap();
    close_pair(s, r);
}
both!(forged_conns_are_bounded: tcp_forged_conns_are_bounded, shm_forged_conns_are_bounded);

/// Both ends in one process: closing one end leaves the other with a clear
/// error from its next send or heartbeat, never a crash (libfabric 1.17's
/// shm segfaults when it sends to a closed endpoint of the same process).
fn close_one_end_in_process(provider: &str) {
    std::env::set_var("WEFT_PEER_TIMEOUT", "0.8");
    let ctx = init(provider);
    for close_recv_first in [true, false] {
        let (s, r) = pair(ctx);
        let buf = pattern(0, 1, 64);
        let smh = reg(s, &buf);
        if close_recv_first {
            core::close_recv(r).unwrap();
            // The keeper's next Alive, and isend, find the peer closed.
            let e = poll_until("the send comm to fail", || {
                match isend_raw(
                    s,
                    buf.as_ptr() as *mut c_void,
                    buf.len(),
                    1,
                    smh,
                    std::ptr::null_mut(),
                ) {
                    Ok(Some(q)) => {
                        let _ = core::test(q);
                        None
                    }
                    Ok(None) => None,
                    Err(e) => Some(e),
                }
            });
            assert_eq!(e.kind, core::Kind::PeerClosed, "{provider}: {e}");
            core::dereg_mr(s, smh).unwrap();
            core::close_send(s).unwrap();
        } else {
            let mut dst = vec![0u8; 64];
            let rmh = reg(r, &dst);
            core::close_send(s).unwrap();
            // The receive fails when tested, or at once where the closed
            // end said so (rdma's Bye).
            let args = [core::RecvArg {
                data: dst.as_mut_ptr().cast(),
                size: dst.len(),
                tag: 1,
                mhandle: rmh,
                phandle: std::ptr::null_mut(),
            }];
            let mut q = None;
            let e = poll_until("the receive to fail", || match q {
                None => match irecv_raw(r, &args) {
                    Ok(posted) => {
                        q = posted;
                        None
                    }
                    Err(e) => Some(e),
                },
                Some(q) => core::test(q).err(),
            });
            assert!(
                matches!(e.kind, core::Kind::PeerClosed | core::Kind::PeerDead),
                "{provider}: {e}"
            );
            core::dereg_mr(s, smh).unwrap();
            core::dereg_mr(r, rmh).unwrap();
            core::close_recv(r).unwrap();
        }
    }
    // A connect to a listener of this process that was closed.
    let (mut h, l) = listen(ctx);
    core::close_listen(l).unwrap();
    let e = poll_until(
        "connect to a closed listener to fail",
        || match core::connect(ctx, 0, None, &mut h) {
            Ok(None) => None,
            Ok(Some(_)) => panic!("connected to a closed listener"),
            Err(e) => Some(e),
        },
    );
    println!("{provider}: {e}");
}
both!(close_one_end_in_process: tcp_close_one_end_in_process, shm_close_one_end_in_process);

/// A page-aligned anonymous mapping of `len` bytes.
fn map(len: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}

/// regMr(b, 1 MiB) = h1; regMr(b + 4 KiB, 4 KiB) = h2; deregMr(h1); the rest
/// unmapped: h2 covers its 4 KiB only. And memory registered, freed and
/// mapped again is registered afresh.
fn sub_range_outlives_no_parent(provider: &str) {
    const MIB: usize = 1 << 20;
    let ctx = init(provider);
    let (s, r) = pair(ctx);
    let b = map(MIB);
    let h1 = core::reg_mr(s, b.cast(), MIB, 1).unwrap();
    // SAFETY: inside the mapping.
    let sub = unsafe { b.add(4096) };
    let h2 = core::reg_mr(s, sub.cast(), 4096, 1).unwrap();
    core::dereg_mr(s, h1).unwrap();
    // SAFETY: unmapping the parts of our own mapping outside h2.
    unsafe {
        libc::munmap(b.cast(), 4096);
        libc::munmap(b.add(8192).cast(), MIB - 8192);
    }
    // SAFETY: the offset lies in the (now unmapped) range; it is only passed
    // as a pointer value, which the core must refuse.
    let far = unsafe { b.add(MIB / 2) };
    let e = isend_raw(s, far.cast(), 4096, 3, h2, std::ptr::null_mut())
        .expect_err("a buffer outside the sub-range handle must be refused");
    assert_eq!(e.kind, core::Kind::BadBuffer, "{provider}: {e}");
    // Inside h2: moves data.
    // SAFETY: `sub` is still mapped, 4096 bytes.
    let src = unsafe { std::slice::from_raw_parts_mut(sub, 4096) };
    src.copy_from_slice(&pattern(3, 3, 4096));
    let mut dst = vec![0u8; 4096];
    let rmh = reg(r, &dst);
    let rq = irecv(r, &mut [&mut dst[..]], &[3], &[rmh]);
    let sq = isend(s, src, 3, h2);
    wait2(sq, rq);
    assert!(dst[..] == src[..]);
    core::dereg_mr(s, h2).unwrap();
    core::dereg_mr(r, rmh).unwrap();
    // SAFETY: our last mapped page.
    unsafe { libc::munmap(sub.cast(), 4096) };

    // register -> free -> remap at the same address -> register: fresh.
    let before = core::device_stats(0).unwrap();
    let a = map(8 * 4096);
    let h = core::reg_mr(s, a.cast(), 8 * 4096, 1).unwrap();
    core::dereg_mr(s, h).unwrap();
    // SAFETY: our mapping, unmapped and mapped again at the same address.
    let again = unsafe {
        libc::munmap(a.cast(), 8 * 4096);
        libc::mmap(
            a.cast(),
            8 * 4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    assert_eq!(again.cast::<u8>(), a);
    let h = core::reg_mr(s, a.cast(), 8 * 4096, 1).unwrap();
    let after = core::device_stats(0).unwrap();
    assert_eq!(
        after.mr_misses - before.mr_misses,
        2,
        "{provider}: the second registration must be new: {before:?} -> {after:?}"
    );
    core::dereg_mr(s, h).unwrap();
    // SAFETY: our mapping.
    unsafe { libc::munmap(a.cast(), 8 * 4096) };
    close_pair(s, r);
}
both!(sub_range_outlives_no_parent: tcp_sub_range_outlives_no_parent, shm_sub_range_outlives_no_parent);

/// regMr(rb + 1024, 1024): a buffer must lie in those 1024 bytes, not merely
/// in the registered pages.
#[test]
fn buffers_are_checked_against_the_registered_range() {
    weft_tests::isolated!();
    let ctx = init("tcp");
    let (s, r) = pair(ctx);
    let mut rb = vec![0u8; 8192];
    let base = rb.as_mut_ptr();
    // SAFETY: inside `rb`.
    let mh = core::reg_mr(r, unsafe { base.add(1024) }.cast(), 1024, 1).unwrap();
    let arg = |off: usize, size: usize| core::RecvArg {
        // SAFETY: inside `rb`.
        data: unsafe { base.add(off) }.cast(),
        size,
        tag: 1,
        mhandle: mh,
        phandle: std::ptr::null_mut(),
    };
    for (off, size) in [(0, 4096), (1024, 1025), (1023, 10), (2048, 1)] {
        let e = irecv_raw(r, &[arg(off, size)]).expect_err("outside the registered range");
        assert_eq!(e.kind, core::Kind::BadBuffer, "{off}+{size}: {e}");
        let e = isend_raw(s, arg(off, size).data, size, 1, mh, std::ptr::null_mut())
            .expect_err("outside the registered range");
        assert_eq!(e.kind, core::Kind::BadBuffer, "{off}+{size}: {e}");
    }
    let q = poll_until("irecv", || irecv_raw(r, &[arg(1024, 1024)]).unwrap());
    let src = pattern(0, 1, 1024);
    let smh = reg(s, &src);
    let sq = isend(s, &src, 1, smh);
    wait2(sq, q);
    assert!(rb[1024..2048] == src[..] && rb[..1024].iter().all(|&b| b == 0));
    assert!(rb[2048..].iter().all(|&b| b == 0));
    core::dereg_mr(r, mh).unwrap();
    core::dereg_mr(s, smh).unwrap();
    close_pair(s, r);
}

/// A request pointer already completed, a closed comm's pointer and forged
/// connect-stage bytes never name a live object.
#[test]
fn stale_pointers_never_alias_live_objects() {
    weft_tests::isolated!();
    let ctx = init("tcp");
    let (s, r) = pair(ctx);
    let src = pattern(0, 2, 100_000);
    let smh = reg(s, &src);
    let mut dst = vec![0u8; 100_000];
    let rmh = reg(r, &dst);
    // r1 completes; r2 takes the freed slot.
    let rq1 = irecv(r, &mut [&mut dst[..]], &[2], &[rmh]);
    let sq1 = isend(s, &src, 2, smh);
    wait2(sq1, rq1);
    let rq2 = irecv(r, &mut [&mut dst[..]], &[2], &[rmh]);
    let sq2 = isend(s, &src, 2, smh);
    for stale in [rq1, sq1] {
        let e = core::test(stale).expect_err("a completed request is stale");
        assert_eq!(e.kind, core::Kind::BadHandle, "{e}");
    }
    let (d2, _) = wait2(rq2, sq2);
    assert_eq!(d2.sizes[0], 100_000, "the stale test consumed nothing");
    core::dereg_mr(s, smh).unwrap();
    core::dereg_mr(r, rmh).unwrap();

    // A closed comm's pointer is never handed out again.
    close_pair(s, r);
    let (s2, r2) = pair(ctx);
    assert!(s2 != s && r2 != r && s2 != r && r2 != s);
    assert!(core::reg_mr(s, src.as_ptr() as *mut c_void, 10, 1).is_err());
    assert!(core::close_send(s).is_err());

    // Connect-stage bytes naming a live send comm: refused, the comm unharmed.
    let (mut h, l) = listen(ctx);
    wire::write_stage(&mut h, Some(s2 as usize));
    let e = core::connect(ctx, 0, None, &mut h).expect_err("forged stage");
    assert_eq!(e.kind, core::Kind::BadListenHandle, "{e}");
    assert!(e.msg.contains("connect stage"), "{e}");
    wire::write_stage(&mut h, None);
    let (s3, r3) = connect_pair(ctx, &mut h, l);
    core::close_listen(l).unwrap();
    // Once connected the stage is cleared; putting the comm's own token
    // back does not return it a second time.
    wire::write_stage(&mut h, Some(s3 as usize));
    assert!(core::connect(ctx, 0, None, &mut h).is_err());
    send_verified(s2, r2, 9, 10);
    close_pair(s2, r2);
    close_pair(s3, r3);
}

/// listen and regMr with a NULL out-pointer create nothing.
#[test]
fn null_out_pointers_create_nothing() {
    weft_tests::isolated!();
    use weft::adapter::net;
    let ctx = init("tcp");
    let (s, r) = pair(ctx);
    let fds = open_fds();
    let mut h = [0u8; HANDLE_SIZE];
    for _ in 0..20 {
        let a = net::args::listen {
            ctx,
            dev: 0,
            handle: h.as_mut_ptr().cast(),
            listenComm: std::ptr::null_mut(),
        };
        // SAFETY: valid handle buffer; the NULL out-pointer is the test.
        assert!(unsafe { net::listen(a) }.is_err());
    }
    assert_eq!(open_fds(), fds, "a refused listen left endpoints open");
    let buf = vec![0u8; 4096];
    let before = core::device_stats(0).unwrap();
    let a = net::args::regMr {
        comm: s,
        data: buf.as_ptr() as *mut c_void,
        size: weft::adapter::CSize::Size(buf.len()),
        type_: 1,
        mhandle: std::ptr::null_mut(),
    };
    // SAFETY: a valid buffer; the NULL out-pointer is the test.
    assert!(unsafe { net::regMr(a) }.is_err());
    assert_eq!(
        core::device_stats(0).unwrap(),
        before,
        "a refused regMr registered"
    );
    close_pair(s, r);
}

/// Another thread holds comm `comm` (its state lock, and a reference), as a
/// keeper stuck inside the provider would, from when this returns until
/// `release` fires; join the handle after.
fn hold_from_another_thread(comm: *mut c_void) -> (mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let (held_tx, held) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let c = comm as usize;
    let holder = std::thread::spawn(move || {
        weft::testing::hold_comm(c as *mut c_void, &held_tx, &release_rx).unwrap();
    });
    held.recv().unwrap();
    (release, holder)
}

/// While another thread holds a comm (a keeper stuck inside the provider),
/// isend, irecv and test on it return "not yet" at once instead of waiting,
/// and other comms carry on.
#[test]
fn the_data_path_never_waits_for_a_held_comm() {
    weft_tests::isolated!();
    let ctx = init("shm");
    let (s, r) = pair(ctx);
    let (s2, r2) = pair(ctx);
    let src = pattern(0, 4, 1000);
    let smh = reg(s, &src);
    let mut dst = vec![0u8; 1000];
    let rmh = reg(r, &dst);
    let rq = irecv(r, &mut [&mut dst[..]], &[4], &[rmh]);
    let (release, holder) = hold_from_another_thread(r);
    // These would deadlock the test if they waited for the holder.
    assert_eq!(core::test(rq).unwrap(), None);
    let arg = core::RecvArg {
        data: dst.as_mut_ptr().cast(),
        size: 10,
        tag: 5,
        mhandle: rmh,
        phandle: std::ptr::null_mut(),
    };
    assert_eq!(irecv_raw(r, &[arg]).unwrap(), None);
    // Another comm moves data meanwhile.
    send_verified(s2, r2, 4, 1000);
    release.send(()).unwrap();
    holder.join().unwrap();
    wait2(isend(s, &src, 4, smh), rq);
    assert!(dst == src);
    core::dereg_mr(s, smh).unwrap();
    core::dereg_mr(r, rmh).unwrap();
    close_pair(s, r);
    close_pair(s2, r2);
}

/// A comm closed while another thread holds it (the keeper, in the middle
/// of its heartbeat tick): `closeRecv` returns only once it has dropped
/// the comm itself, i.e. after the holder let go, never before (then the
/// comm's close, and its waits for the provider, ran in the holder after
/// NCCL had freed the buffers: the soak's crash inside rxm). The wait for
/// the holder is seen from outside as "not returned yet"; that check is
/// bounded (1 s) and can only pass wrongly on a slow machine, never fail
/// wrongly. Afterwards the receive's request is gone and the device serves
/// a fresh pair.
#[test]
fn a_close_waits_for_a_thread_that_holds_the_comm() {
    weft_tests::isolated!();
    let ctx = init("tcp");
    let (s, r) = pair(ctx);
    let mut dst = vec![0u8; 1000];
    let rmh = reg(r, &dst);
    let rq = irecv(r, &mut [&mut dst[..]], &[4], &[rmh]);
    let (release, holder) = hold_from_another_thread(r);
    let rp = r as usize;
    let (closed_tx, closed) = mpsc::channel();
    let closer = std::thread::spawn(move || {
        core::close_recv(rp as *mut c_void).unwrap();
        closed_tx.send(()).unwrap();
    });
    // The close has begun once the comm is gone from the registry.
    poll_until("closeRecv to begin", || {
        core::test(rq).is_err().then_some(())
    });
    assert!(
        closed
            .recv_timeout(std::time::Duration::from_secs(1))
            .is_err(),
        "closeRecv returned while another thread still held the comm"
    );
    release.send(()).unwrap();
    closed.recv().unwrap();
    holder.join().unwrap();
    closer.join().unwrap();
    core::dereg_mr(s, rmh).unwrap();
    core::close_send(s).unwrap();
    let (s2, r2) = pair(ctx);
    send_verified(s2, r2, 4, 1000);
    close_pair(s2, r2);
}

/// shm regions left in /dev/shm by a dead process whose pid this process
/// now has (killed, or exited without closing): libfabric 1.17's shm refuses
/// such an endpoint with EBUSY, and Weft then removes the regions of its own
/// pid that no open endpoint of it owns and opens again. The removal itself
/// is tested here (a stale region of this very pid cannot be made on
/// purpose): it takes the strays and leaves the open endpoints' regions.
#[test]
fn shm_regions_left_under_this_pid_are_removed() {
    weft_tests::isolated!();
    let pid = std::process::id();
    let ctx = init_logged("shm");
    let (s, r) = pair(ctx);
    let regions = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|f| f.starts_with(&format!("{pid}:")))
            .collect()
    };
    let live = regions();
    assert!(!live.is_empty(), "shm endpoints have regions in /dev/shm");
    let stale: Vec<String> = (90..93).map(|i| format!("{pid}:0:{i}")).collect();
    for f in &stale {
        std::fs::write(format!("/dev/shm/{f}"), b"left by a dead process").unwrap();
    }
    assert_eq!(weft::fabric::local::remove_stale_shm_regions(), stale.len());
    let mut after = regions();
    after.sort();
    let mut want = live.clone();
    want.sort();
    assert_eq!(after, want, "only the strays went");
    assert!(logged(&format!("left by an earlier process with pid {pid}")) >= stale.len());
    send_verified(s, r, 3, 4096);
    close_pair(s, r);
}

mod peers;
