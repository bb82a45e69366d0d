//! The virtual-device step of a cell: NIC fusion through `makeVDevice`, and data over the fused device.

use super::*;

/// `makeVDevice` (v9+): bad requests refused with nothing made; a virtual
/// device of device 0 numbered after the `nd` physical ones, with the
/// properties NCCL expects; data over it verified, below and above
/// `WEFT_STRIPE_SIZE` and several messages in flight; handles of a
/// physical and a virtual device do not connect.
pub(super) unsafe fn vdev(n: &dyn Net, c: &mut Checks, ctx: *mut c_void, nd: c_int) -> Res {
    let cap = if c.v >= 12 { 8 } else { 4 };
    // SAFETY: NCCL's conventions, as in `cell`.
    unsafe {
        for (ndevs, devs, what) in [
            (0, vec![], "no device"),
            (
                cap + 1,
                vec![0; cap as usize],
                "more devices than vProps holds",
            ),
            (1, vec![nd], "a device that is not physical"),
            (1, vec![-1], "a negative device"),
            (2, vec![0, 0], "the same device twice"),
        ] {
            let r = n.make_vdevice(ndevs, &devs);
            c.that(
                matches!(r, Some((3, _))),
                "makeVDevice",
                what,
                "ncclInternalError (3)",
                format_args!("{r:?}"),
            )?;
        }
        let mut now = 0;
        c.ok("devices", "after refused makeVDevice", n.devices(&mut now))?;
        c.that(now == nd, "devices", "after refused makeVDevice", nd, now)?;
        let r = n.make_vdevice(1, &[0]);
        c.that(
            r == Some((0, nd)),
            "makeVDevice",
            "{1, [0]}",
            format_args!("ncclSuccess and index {nd}"),
            format_args!("{r:?}"),
        )?;
        let v = nd;
        c.ok("devices", "after makeVDevice", n.devices(&mut now))?;
        c.that(now == nd + 1, "devices", "after makeVDevice", nd + 1, now)?;
        // One rail: the rail's own comms, so its grouped receives too.
        let (pname, pspeed, precvs, _) =
            n.props(0).map_err(|r| format!("getProperties(0): {r}"))?;
        let got = n.props(v);
        c.that(
            got.as_ref().is_ok_and(|(name, speed, recvs, _)| {
                *name == pname && *speed == pspeed && *recvs == precvs
            }),
            "getProperties",
            v,
            format_args!("name {pname:?}, speed {pspeed}, maxRecvs {precvs}"),
            format_args!("{got:?}"),
        )?;
        let (vp, vp0) = (n.vprops(v), n.vprops(0));
        c.that(
            vp.as_deref() == Some(&[0][..]) && vp0.as_deref() == Some(&[0][..]),
            "getProperties",
            "vProps of the virtual device and of device 0",
            "[0] and [0]",
            format_args!("{vp:?} and {vp0:?}"),
        )?;

        let p = pair_on(n, c, ctx, v, true)?;
        let max = 4usize << 20;
        let src = pattern(u64::from(c.v) + 77, 3, max);
        let mut dst = vec![0u8; max];
        let (mut smh, mut rmh) = (null(), null());
        c.ok(
            "regMr",
            "virtual device, sendComm",
            n.reg_mr(p.s, src.as_ptr() as *mut c_void, max, &mut smh),
        )?;
        c.ok(
            "regMr",
            "virtual device, recvComm",
            n.reg_mr(p.r, dst.as_mut_ptr().cast(), max, &mut rmh),
        )?;
        for size in [0usize, 1, 4096, 200_000, max] {
            dst.fill(0);
            let rq = irecv(
                n,
                c,
                p.r,
                &mut [dst.as_mut_ptr().cast()],
                &[max],
                &mut [3],
                &mut [rmh],
            )?;
            let sq = isend(n, c, p.s, &src[..size], 3, smh)?;
            let sizes = wait_all(n, c, &[sq, rq], size % 2 == 0)?;
            c.that(
                sizes[0][0] as usize == size
                    && sizes[1][0] as usize == size
                    && dst[..size] == src[..size],
                "test",
                format_args!("virtual device, {size} B"),
                "both sides report the size, the bytes arrive",
                format_args!("{} and {}", sizes[0][0], sizes[1][0]),
            )?;
        }
        // Eight messages of one tag in flight, sizes on both sides of the
        // stripe size, each in its own slice of the buffer.
        let slice = max / 8;
        let mut rreqs = Tracker::new(true);
        for k in 0..8 {
            rreqs.push(irecv(
                n,
                c,
                p.r,
                &mut [dst.as_mut_ptr().wrapping_add(k * slice).cast()],
                &[slice],
                &mut [4],
                &mut [rmh],
            )?);
        }
        let len = |k: usize| if k % 2 == 0 { slice - k } else { 1000 + k };
        let mut sreqs = Vec::new();
        for k in 0..8 {
            sreqs.push(isend_progress(
                n,
                c,
                p.s,
                &src[k..k + len(k)],
                4,
                smh,
                &mut rreqs,
            )?);
        }
        // Receives and sends tested together, as the two ranks' proxies
        // would (a receive's parts are posted once its header is read).
        for q in sreqs {
            rreqs.push(q);
        }
        let sizes = rreqs.wait(n, c)?;
        for k in 0..8 {
            c.that(
                sizes[k][0] as usize == len(k)
                    && dst[k * slice..k * slice + len(k)] == src[k..k + len(k)],
                "irecv",
                format_args!("virtual device, message {k} of 8 in flight"),
                format_args!("{} B, in order", len(k)),
                sizes[k][0],
            )?;
        }
        // Grouped receives: no more than the virtual device said (maxRecvs,
        // its rail's own on one rail).
        let over = precvs as usize + 1;
        let mut q = null();
        let r = n.irecv(
            p.r,
            &mut (0..over)
                .map(|k| dst.as_mut_ptr().wrapping_add(8 * k).cast())
                .collect::<Vec<_>>(),
            &vec![8; over],
            &mut (1..=over as i32).collect::<Vec<_>>(),
            &mut vec![rmh; over],
            &mut q,
        );
        c.that(
            r == 3 && q.is_null(),
            "irecv",
            format_args!("n = {over} on a virtual device of maxRecvs {precvs}"),
            "ncclInternalError (3)",
            format_args!("result {r}"),
        )?;
        c.ok("deregMr", "virtual device", n.dereg_mr(p.s, smh))?;
        c.ok("deregMr", "virtual device", n.dereg_mr(p.r, rmh))?;
        c.ok("closeSend", "virtual device", n.close_send(p.s))?;
        c.ok("closeRecv", "virtual device", n.close_recv(p.r))?;

        // A virtual device's handle does not connect a physical device, nor
        // the other way round.
        for (ldev, cdev) in [(v, 0), (0, v)] {
            let mut h = [0u8; 128];
            let mut l = null();
            c.ok(
                "listen",
                ldev,
                n.listen(ctx, ldev, h.as_mut_ptr().cast(), &mut l),
            )?;
            let mut sc = null();
            let r = n.connect(ctx, cdev, h.as_mut_ptr().cast(), &mut sc, true);
            c.that(
                r == 3 && sc.is_null(),
                "connect",
                format_args!("dev {cdev} to a listener on dev {ldev}"),
                "ncclInternalError (3)",
                format_args!("result {r}"),
            )?;
            c.ok("closeListen", ldev, n.close_listen(l))?;
        }
    }
    Ok(())
}
