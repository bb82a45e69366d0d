//! The data steps of a cell: the size sweep, registrations that are global, windows into one registration, truncation, a corrupted handle, DMA-BUF refused.

use super::*;

/// The data steps' memory: a pattern of 64 MiB + 1 registered on the first
/// pair's send comm, a receive buffer of 64 MiB + 64 on its receive comm.
pub(super) struct Mem {
    pub(super) src: Vec<u8>,
    pub(super) dst: Vec<u8>,
    pub(super) smh: *mut c_void,
    pub(super) rmh: *mut c_void,
    pub(super) max: usize,
}

impl Mem {
    /// # Safety
    /// `a` is a live pair of `n`.
    pub(super) unsafe fn register(n: &dyn Net, c: &mut Checks, a: &Pair, version: u32) -> Res<Mem> {
        let max = 64usize << 20;
        let mut m = Mem {
            src: pattern(version as u64, 5, max + 1),
            dst: vec![0u8; max + 64],
            smh: null(),
            rmh: null(),
            max,
        };
        // SAFETY: live comms; the buffers live in `m`, which the caller keeps
        // until it deregisters them.
        unsafe {
            c.ok(
                "regMr",
                format_args!("sendComm, {} bytes", m.src.len()),
                n.reg_mr(a.s, m.src.as_ptr() as *mut c_void, m.src.len(), &mut m.smh),
            )?;
            c.ok(
                "regMr",
                format_args!("recvComm, {} bytes", m.dst.len()),
                n.reg_mr(a.r, m.dst.as_mut_ptr().cast(), m.dst.len(), &mut m.rmh),
            )?;
        }
        Ok(m)
    }
}

/// Sizes 0 B .. 64 MiB, each received into the whole buffer and its content
/// checked, then `iflush` of the host buffer (a NULL request: done).
///
/// # Safety
/// `a` is a live pair of `n` and `m`'s handles are registered on it.
pub(super) unsafe fn size_sweep(n: &dyn Net, c: &mut Checks, a: &Pair, m: &mut Mem) -> Res {
    let max = m.max;
    for size in [0usize, 1, 4095, 4096, 65536, 1 << 20, 16 << 20, max] {
        // SAFETY: the buffers and handles of `m`, live through the wait.
        let sizes = unsafe {
            let rq = irecv(
                n,
                c,
                a.r,
                &mut [m.dst.as_mut_ptr().cast()],
                &[max + 64],
                &mut [5],
                &mut [m.rmh],
            )?;
            let sq = isend(n, c, a.s, &m.src[..size], 5, m.smh)?;
            wait_all(n, c, &[sq, rq], false)?
        };
        c.that(
            sizes[0][0] as usize == size,
            "test",
            format_args!("send of {size} B"),
            size,
            sizes[0][0],
        )?;
        c.that(
            sizes[1][0] as usize == size,
            "test",
            format_args!("receive of {size} B into {} B", max + 64),
            size,
            sizes[1][0],
        )?;
        c.that(
            m.dst[..size] == m.src[..size],
            "irecv",
            format_args!("{size} B"),
            "the bytes sent",
            "different bytes",
        )?;
        // iflush on host memory: NULL request, which NCCL treats as done.
        let mut fl = std::ptr::without_provenance_mut::<c_void>(0xbad);
        // SAFETY: the received buffer and its handle; `fl` is writable.
        let r = unsafe {
            n.iflush(
                a.r,
                &mut [m.dst.as_mut_ptr().cast()],
                &mut [sizes[1][0]],
                &mut [m.rmh],
                &mut fl,
            )
        };
        c.ok("iflush", "n=1, host memory", r)?;
        c.that(
            fl.is_null(),
            "iflush",
            "host memory",
            "a NULL request",
            format_args!("{fl:p}"),
        )?;
    }
    Ok(())
}

/// A buffer with its registration, kept until NCCL would deregister it.
pub(super) struct Reg {
    pub(super) _buf: Vec<u8>,
    pub(super) mh: *mut c_void,
}

/// regIsGlobal: a handle registered on one comm serves another comm of the
/// device (the second pair sends with the first pair's send handle).
/// Returns the buffer registered on `b`'s receive comm.
///
/// # Safety
/// `b` is a live pair of `n`; `m.smh` is live.
pub(super) unsafe fn reg_is_global(n: &dyn Net, c: &mut Checks, b: &Pair, m: &Mem) -> Res<Reg> {
    let mut bmh = null();
    let mut bdst = vec![0u8; 4096];
    // SAFETY: `bdst` lives until the caller deregisters it (in the `Reg`).
    unsafe {
        c.ok(
            "regMr",
            "second recvComm",
            n.reg_mr(b.r, bdst.as_mut_ptr().cast(), bdst.len(), &mut bmh),
        )?;
        let rq = irecv(
            n,
            c,
            b.r,
            &mut [bdst.as_mut_ptr().cast()],
            &[4096],
            &mut [6],
            &mut [bmh],
        )?;
        let sq = isend(n, c, b.s, &m.src[..4096], 6, m.smh)?;
        wait_all(n, c, &[sq, rq], false)?;
    }
    c.that(
        bdst[..] == m.src[..4096],
        "isend",
        "mhandle from another comm (regIsGlobal)",
        "the bytes sent",
        "different bytes",
    )?;
    Ok(Reg {
        _buf: bdst,
        mh: bmh,
    })
}

/// Windows: 32 grouped receives (n = maxRecvs) on the receive comm, 32 x 8
/// sends on the send comm, all in flight, tested in reverse order; each
/// buffer gets its tag's message, FIFO. Returns the window buffers.
///
/// # Safety
/// `a` is a live pair of `n`; `m.smh` is live.
pub(super) unsafe fn windows(n: &dyn Net, c: &mut Checks, a: &Pair, m: &Mem) -> Res<Reg> {
    let slot = 256usize;
    let mut wbuf = vec![0u8; 32 * 8 * slot];
    let mut wmh = null();
    let src = &m.src;
    // SAFETY: `wbuf` lives until the caller deregisters it (in the `Reg`);
    // every request is waited for before the buffers are read.
    let sizes = unsafe {
        c.ok(
            "regMr",
            "window buffers",
            n.reg_mr(a.r, wbuf.as_mut_ptr().cast(), wbuf.len(), &mut wmh),
        )?;
        let mut rreqs = Tracker::new(true);
        for w in 0..32 {
            let mut bufs: Vec<*mut c_void> = (0..8)
                .map(|k| wbuf.as_mut_ptr().wrapping_add((w * 8 + k) * slot).cast())
                .collect();
            let mut tags: Vec<c_int> = (0..8).map(|k| 200 + k).collect();
            rreqs.push(irecv(
                n,
                c,
                a.r,
                &mut bufs,
                &[slot; 8],
                &mut tags,
                &mut [wmh; 8],
            )?);
        }
        let mut sreqs = Vec::new();
        for w in 0..32usize {
            for k in (0..8usize).rev() {
                let off = (w * 8 + k) * 7;
                sreqs.push(isend_progress(
                    n,
                    c,
                    a.s,
                    &src[off..off + 100 + k],
                    200 + k as c_int,
                    m.smh,
                    &mut rreqs,
                )?);
            }
        }
        wait_all(n, c, &sreqs, true)?;
        rreqs.wait(n, c)?
    };
    for w in 0..32usize {
        for k in 0..8usize {
            let got = &wbuf[(w * 8 + k) * slot..(w * 8 + k) * slot + 100 + k];
            let off = (w * 8 + k) * 7;
            c.that(
                sizes[w][k] as usize == 100 + k && got == &src[off..off + 100 + k],
                "irecv",
                format_args!("window {w}, buffer {k}, tag {}", 200 + k),
                "its tag's message, FIFO",
                format_args!("size {}", sizes[w][k]),
            )?;
        }
    }
    Ok(Reg {
        _buf: wbuf,
        mh: wmh,
    })
}

/// Truncation: 150 B into a 100 B receive is an error from `test()` (and,
/// under rdma, which learns the receiver's size first, from `isend`), and
/// nothing is written past the buffer. Only where the provider reports it.
///
/// # Safety
/// `a` is a live pair of `n`; `m.smh` is live.
pub(super) unsafe fn truncation(n: &dyn Net, c: &mut Checks, a: &Pair, m: &Mem) -> Res {
    let mut small = vec![0x5Au8; 200];
    let mut tmh = null();
    // SAFETY: `small` outlives the receive and is deregistered here.
    unsafe {
        c.ok(
            "regMr",
            "truncation buffer",
            n.reg_mr(a.r, small.as_mut_ptr().cast(), small.len(), &mut tmh),
        )?;
        let rq = irecv(
            n,
            c,
            a.r,
            &mut [small.as_mut_ptr().cast()],
            &[100],
            &mut [9],
            &mut [tmh],
        )?;
        // SENDRECV reports it at the receiver only; rdma learns the
        // receiver's size first, so isend itself fails too.
        let mut sq = null();
        let mut sent = 0;
        until("isend of a truncated message", || {
            sent = n.isend(a.s, m.src.as_ptr() as *mut c_void, 150, 9, m.smh, &mut sq);
            Ok(sent != 0 || !sq.is_null())
        })?;
        c.that(
            sent == 0 || sent == 3,
            "isend",
            "150 B for a 100 B receive",
            "ncclSuccess, or ncclInternalError (3)",
            format_args!("result {sent}"),
        )?;
        let mut got = 0;
        until("truncated receive", || {
            let (mut d1, mut d2) = (0, 0);
            let mut sz = [0 as c_int; 64];
            if !sq.is_null() {
                let _ = n.test(sq, &mut d1, sz.as_mut_ptr());
            }
            got = n.test(rq, &mut d2, sz.as_mut_ptr());
            Ok(got != 0 || d2 == 1)
        })?;
        c.that(
            got == 3,
            "test",
            "150 B into a 100 B receive",
            "ncclInternalError (3)",
            format_args!("result {got}"),
        )?;
        c.that(
            small[100..].iter().all(|&x| x == 0x5A),
            "irecv",
            "truncated",
            "nothing written past the buffer",
            "bytes past the buffer",
        )?;
        c.ok("deregMr", "truncation buffer", n.dereg_mr(a.r, tmh))
    }
}

/// A corrupted handle: an error and no comm, no crash, no hang.
///
/// # Safety
/// `ctx` is `n`'s live context.
pub(super) unsafe fn corrupted_handle(n: &dyn Net, c: &mut Checks, ctx: *mut c_void) -> Res {
    let mut bad = [0x42u8; 128];
    let mut sc = null();
    // SAFETY: a 128-byte handle buffer and a writable comm slot.
    let r = unsafe { n.connect(ctx, 0, bad.as_mut_ptr().cast(), &mut sc, true) };
    c.that(
        r == 3 && sc.is_null(),
        "connect",
        "corrupted handle",
        "ncclInternalError (3) and no comm",
        format_args!("result {r}"),
    )
}

/// `regMrDmaBuf` (v6+ tables serve it): on a device that did not claim
/// `NCCL_PTR_DMABUF` (none does without a GPU) it is refused as misuse, with
/// no handle written; a NULL handle slot is refused too.
pub(super) fn dmabuf_refused(
    n: &dyn Net,
    c: &mut Checks,
    comm: *mut c_void,
    buf: &mut [u8],
) -> Res {
    const CUDA: c_int = 2;
    const INVALID_USAGE: c_int = 5;
    let mut mh: *mut c_void = null();
    let (data, len) = (buf.as_mut_ptr().cast(), buf.len());
    // SAFETY: `comm` is a live receive comm of this table; `buf` is live;
    // `mh` is a writable slot (a NULL one is the second call's point).
    let Some(r) = (unsafe { n.reg_mr_dma_buf(comm, data, len, CUDA, 0, 0, &mut mh) }) else {
        return c.that(
            c.v < 6,
            "regMrDmaBuf",
            "absent",
            "a member of every v6+ table",
            "none",
        );
    };
    c.that(
        r == INVALID_USAGE && mh.is_null(),
        "regMrDmaBuf",
        "recvComm, CUDA, fd 0, on a device without NCCL_PTR_DMABUF",
        "ncclInvalidUsage (5), no handle",
        format_args!("result {r}, handle {mh:p}"),
    )?;
    // SAFETY: as above.
    let r = unsafe { n.reg_mr_dma_buf(comm, data, len, CUDA, 0, 0, null()) }.unwrap_or(0);
    c.that(
        r != 0,
        "regMrDmaBuf",
        "NULL mhandle",
        "an error",
        "ncclSuccess",
    )
}
