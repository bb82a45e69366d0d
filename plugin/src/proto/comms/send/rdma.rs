//! The RDMA send path: eager when small, else a write into the buffer the
//! receiver offered.

use super::*;

impl SendComm {
    /// An RDMA send: eager when small, else a write into the buffer the
    /// receiver offered (`Ok(None)` until it is offered).
    ///
    /// # Safety
    /// As [`Sender::isend`].
    pub(super) unsafe fn isend_rdma(
        &self,
        st: &mut SendState,
        data: *const u8,
        size: usize,
        tag: i32,
        desc: *mut c_void,
    ) -> Result<Option<ReqId>> {
        let k = st.sent.get(&tag).copied().unwrap_or(0);
        let eager_now =
            |st: &SendState| size <= st.eager_max && st.credits > 0 && st.reqs.in_use() < st.reqs.capacity();
        let mut at = st.offer(tag, k);
        // A message that goes eagerly needs no offer: no CQ read first (on
        // tcp each is a system call). Its receive, if offered meanwhile,
        // checks its size on arrival.
        if at.is_none() && !eager_now(st) {
            st.progress(&self.seat)?;
            at = st.offer(tag, k);
        }
        // The receiver's size is known once offered: check it first.
        if let Some(at) = at {
            let o = st.offers[at];
            if size as u64 > o.buf.size {
                st.offers.remove(at);
                st.sent.insert(tag, k.wrapping_add(1));
                let trunc = Ctrl::Trunc {
                    slot: o.slot,
                    sub: o.sub,
                    size: size as u64,
                };
                st.peer.send(self.seat.ep(), trunc)?;
                return Err(truncation(
                    "send",
                    &st.peer.link.name,
                    Some(size as u64),
                    tag,
                    o.buf.size,
                    false,
                ));
            }
        }
        // Small messages go eagerly, offered or not: one message (injected,
        // or from a bounce buffer where the provider injects less), copied
        // into the buffer at the receiver (a write costs more for small
        // sizes: shm moves it by a system call, rxm by a rendezvous, and it
        // waits for an offer).
        if eager_now(st) {
            // SAFETY: NCCL guarantees `data..data+size` is readable (checked
            // against its registration by the caller); it is copied now.
            let bytes = unsafe { std::slice::from_raw_parts(data, size) };
            let SendState { scratch, peer, .. } = &mut *st;
            let mut head = [0u8; CTRL_HEAD + EAGER_HEAD];
            frame_head(&mut head, peer.id, peer.me);
            head[CTRL_HEAD..].copy_from_slice(&Ctrl::eager_head(tag, k));
            let sent =
                self.seat
                    .hub
                    .send_eager(self.seat.port, &peer.link.peer, self.seat.id, &head, bytes, scratch);
            match sent {
                Ok(true) => {}
                Ok(false) => {
                    // Every bounce buffer is with the provider: its
                    // completions free them.
                    st.progress(&self.seat)?;
                    return Ok(None);
                }
                Err(e) if e.is_again() => {
                    st.progress(&self.seat)?;
                    return Ok(None);
                }
                Err(e) => {
                    return Err(Error::remote(format!(
                        "isend of {size} bytes to {} failed: {e}",
                        st.peer.link.name
                    ))
                    .of_kind(Kind::Provider(e.code)))
                }
            }
            st.credits -= 1;
            st.sent.insert(tag, k.wrapping_add(1));
            // Its buffer, if already offered, is filled: the offer is spent
            // (one offered later is skipped on arrival).
            if let Some(at) = at {
                st.offers.remove(at);
            }
            let (_, idx) = st
                .reqs
                .insert(SReq {
                    size,
                    done: true,
                    err: None,
                    dst: None,
                    ticks: 0,
                })
                .expect("room checked above");
            return Ok(Self::req_id(st, idx));
        }
        let Some(at) = at else {
            // Not eager and not offered: a receive an eager message could
            // fill is offered only when asked for (too large to go eagerly,
            // out of credits, or the receiver's eager limit is above this
            // side's). Asked once; a full request pool waits for room.
            let room = st.reqs.in_use() < st.reqs.capacity();
            if room && st.asked != Some((tag, k)) {
                let large = size > st.eager_max;
                st.peer.send(self.seat.ep(), Ctrl::Want { tag, idx: k, large })?;
                st.asked = Some((tag, k));
            }
            return Ok(None);
        };
        let o = st.offers[at];
        let Some((_, idx)) = st.reqs.insert(SReq {
            size,
            done: size == 0,
            err: None,
            dst: Some((o.slot, o.sub)),
            ticks: 0,
        }) else {
            st.progress(&self.seat)?;
            return Ok(None);
        };
        // The size rides in the immediate where the hub has 8 bytes of it;
        // else (and for an empty message, which writes nothing) in a Wrote.
        // Where the receiver never sees immediates, the write carries none
        // and its Wrote, which the provider delivers after the data
        // (FI_ORDER_SAW), tells the receiver it landed.
        let announced = st.writes_announced;
        let in_imm = (size > 0 && !announced && self.seat.hub.wide()).then_some(size as u64);
        if size > 0 {
            let imm = (!announced)
                .then(|| immediate(st.peer.id, (o.slot << 3) | o.sub, in_imm, o.buf.ticket));
            let ep = self.seat.ep();
            let posted = st.peer.link.peer.send("a write", |a| {
                // SAFETY: NCCL keeps `data..data+size` (checked against its
                // registration by the caller) until the request is done,
                // which is after the write's completion; the remote range is
                // the one the receiver offered, and `size` fits it.
                unsafe {
                    ep.writedata(
                        data,
                        size,
                        desc,
                        imm,
                        a,
                        o.buf.addr,
                        o.buf.key,
                        context(self.seat.id, idx),
                    )
                }
            });
            if let Err(e) = posted {
                st.reqs.release(idx);
                if e.is_again() {
                    st.progress(&self.seat)?;
                    return Ok(None);
                }
                return Err(Error::remote(format!(
                    "isend of {size} bytes to {} failed: {e}",
                    st.peer.link.name
                ))
                .of_kind(Kind::Provider(e.code)));
            }
        }
        st.offers.remove(at);
        st.sent.insert(tag, k.wrapping_add(1));
        if announced || in_imm.is_none_or(|s| s >= u64::from(NO_SIZE)) {
            let wrote = Ctrl::Wrote {
                slot: o.slot,
                sub: o.sub,
                size: size as u64,
            };
            if let Err(e) = st.peer.send(self.seat.ep(), wrote) {
                die(st, format!("telling the receiver a size failed: {e}"));
            }
        }
        Ok(Self::req_id(st, idx))
    }
}
