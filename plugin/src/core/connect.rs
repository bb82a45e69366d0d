//! `listen`, `connect` and `accept`: the handle, the connect stage, protocol and device-shape checks.

#![forbid(unsafe_code)]

use super::*;

/// `listen(ctx, dev, handle)`: never blocks. On a virtual device, one
/// listener per rail and a handle that lists them all.
pub fn listen(ctx_p: *mut c_void, dev: i32, handle: &mut [u8; HANDLE_SIZE]) -> Result<*mut c_void> {
    let c = ctx(ctx_p)?;
    Ok(listen_on(&c, dev, handle)?.into_token())
}

/// [`listen`] in context `c`.
pub(super) fn listen_on(
    c: &Ctx,
    dev: i32,
    handle: &mut [u8; HANDLE_SIZE],
) -> Result<Owned<Listener>> {
    let d = device(&c.plugin, dev)?;
    let nonce = proto::handshake::nonce();
    let comm = if d.virtual_ {
        let mut rails = Vec::with_capacity(d.rails.len());
        let mut handles = Vec::with_capacity(d.rails.len());
        for (i, r) in d.rails.iter().enumerate() {
            let (l, h) = c
                .plugin
                .protocol
                .listen(Arc::clone(r), nonce.wrapping_add(i as u64))?;
            rails.push(l);
            handles.push(h);
        }
        wire::encode_rails(&handles, handle).map_err(|e| Error::system(e.to_string()))?;
        Arc::new(proto::stripe::StripedListen::new(
            rails,
            c.plugin.config.stripe_size,
            d.striped,
        ))
    } else {
        let (l, h) = c.plugin.protocol.listen(Arc::clone(&d.rails[0]), nonce)?;
        h.encode(handle).map_err(|e| Error::system(e.to_string()))?;
        l
    };
    Ok(Owned::record(Listener {
        comm,
        dev: d.index,
        profiler: c.profiler,
    }))
}

/// `connect(ctx, dev, handle)`: one non-blocking step; `Some` once connected.
/// `traffic_class` is the v10 per-connect config (None: the context's).
///
/// While it is in progress, the comm lives in the `connecting` registry and
/// its token in the handle's stage area (NCCL passes the same buffer on every
/// call). A stage naming anything but a connect in progress to this handle's
/// listener (a handle reused, corrupted or forged) is refused, so `connect`
/// never hands out a comm twice.
pub fn connect(
    ctx_p: *mut c_void,
    dev: i32,
    traffic_class: Option<i32>,
    handle: &mut [u8; HANDLE_SIZE],
) -> Result<Option<*mut c_void>> {
    let c = ctx(ctx_p)?;
    Ok(connect_on(&c, dev, traffic_class, handle)?.map(Owned::into_token))
}

/// [`connect`] in context `c`.
pub(super) fn connect_on(
    c: &Ctx,
    dev: i32,
    traffic_class: Option<i32>,
    handle: &mut [u8; HANDLE_SIZE],
) -> Result<Option<Owned<Sender>>> {
    let stage = wire::read_stage(handle).map_err(|e| Error::bad_listen_handle(e.to_string()))?;
    let (rails, striped) =
        wire::decode_any(handle).map_err(|e| Error::bad_listen_handle(e.to_string()))?;
    let h = &rails[0];
    let ours = c.plugin.protocol.wire_id();
    if h.proto != ours {
        let name = |p: u8| match p {
            wire::PROTO_SENDRECV => "sendrecv".to_owned(),
            wire::PROTO_RDMA => "rdma".to_owned(),
            p => format!("unknown ({p})"),
        };
        return Err(Error::bad_listen_handle(format!(
            "connect: the listener uses protocol {}, this rank {}; set the same WEFT_PROTOCOL on every rank \
             (with auto, the same provider and libfabric)",
            name(h.proto),
            name(ours)
        )));
    }
    let d = device(&c.plugin, dev)?;
    if striped != d.virtual_ || rails.len() != d.rails.len() {
        let what = |v: bool, n: usize| {
            if v {
                format!("a virtual device of {n} rail(s)")
            } else {
                "a physical device".to_owned()
            }
        };
        return Err(Error::bad_listen_handle(format!(
            "connect: the listener is on {}, this connect on device {dev}, {}; NCCL fused NICs differently on the two hosts (give them the same NICs, or set NCCL_NET_MERGE_LEVEL=LOC to fuse none)",
            what(striped, rails.len()),
            what(d.virtual_, d.rails.len())
        )));
    }
    let (comm, p) = match stage {
        None => {
            let tc = traffic_class.unwrap_or(c.traffic_class);
            if tc != -1 {
                // libfabric sets a traffic class per endpoint
                // (`tx_attr.tclass`), and a device's endpoints carry every
                // comm of it: one comm's class cannot be applied alone.
                tracing::debug!(target: "weft::connect", "device {dev}: traffic class {tc} asked; not applied (endpoints are shared by the device's comms)");
            }
            let comm: Arc<dyn proto::Sender> = if d.striped {
                let members = d
                    .rails
                    .iter()
                    .zip(&rails)
                    .map(|(r, h)| c.plugin.protocol.connect(Arc::clone(r), h))
                    .collect::<Result<Vec<_>>>()?;
                Arc::new(proto::stripe::StripedSend::new(
                    members,
                    c.plugin.config.stripe_size,
                )?)
            } else {
                c.plugin.protocol.connect(Arc::clone(&d.rails[0]), h)?
            };
            let p = REG.connecting.insert(Arc::clone(&comm));
            wire::write_stage(handle, Some(p as usize));
            (comm, p)
        }
        Some(p) => {
            let p = p as *mut c_void;
            let comm = REG
                .connecting
                .get(p)
                .filter(|comm| comm.listener_nonce() == h.nonce)
                .ok_or_else(|| {
                    Error::bad_listen_handle(
                        "connect: the handle's connect stage names no connect in progress to this listener (handle reused or corrupted)",
                    )
                })?;
            (comm, p)
        }
    };
    match comm.step_connect() {
        Ok(true) => {
            wire::write_stage(handle, None);
            REG.connecting.remove(p);
            Ok(Some(Owned::record(Sender::new(comm, d.index, c.profiler))))
        }
        Ok(false) => Ok(None),
        Err(e) => {
            REG.connecting.remove(p);
            wire::write_stage(handle, None);
            Err(e)
        }
    }
}

/// `accept(listenComm)`: one non-blocking step; `Some` once a peer connected.
pub fn accept(listen: *mut c_void) -> Result<Option<*mut c_void>> {
    let l = REG.listen.get(listen).ok_or_else(|| {
        Error::bad_handle(format!("accept: {listen:p} is not a live Weft listen comm"))
    })?;
    Ok(accept_on(&l)?.map(Owned::into_token))
}

/// [`accept`] on listener `l`.
pub(super) fn accept_on(l: &Listener) -> Result<Option<Owned<Receiver>>> {
    Ok(l.comm
        .accept()?
        .map(|comm| Owned::record(Receiver::new(comm, l.dev, l.profiler))))
}
