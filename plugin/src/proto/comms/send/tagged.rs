//! The tagged send path (`WEFT_PROTOCOL=sendrecv`): one tagged message
//! per NCCL send, a large one only into a receive the receiver announced.

use super::*;

impl SendComm {
    /// A tagged send: injected when small (done at once), else posted.
    ///
    /// # Safety
    /// As [`Sender::isend`].
    pub(super) unsafe fn isend_tagged(
        &self,
        st: &mut SendState,
        data: *const u8,
        size: usize,
        tag: i32,
        desc: *mut c_void,
    ) -> Result<Option<ReqId>> {
        if st.credits == 0 {
            st.progress(&self.seat)?;
            if st.credits == 0 {
                return Ok(None);
            }
        }
        let number = st.sent.get(&tag).copied().unwrap_or(0);
        if size > st.unannounced_max && !st.is_announced(tag, number) {
            st.progress(&self.seat)?;
            if !st.is_announced(tag, number) {
                return Ok(None);
            }
        }
        let inject = size <= st.inject_max;
        let Some((_, idx)) = st.reqs.insert(SReq {
            size,
            done: inject,
            err: None,
            dst: None,
            ticks: 0,
        }) else {
            st.progress(&self.seat)?;
            return Ok(None);
        };
        let to = data_tag(st.peer.id, tag);
        let ep = self.seat.ep();
        let posted = if inject {
            let bytes: &[u8] = if size == 0 {
                &[]
            } else {
                // SAFETY: NCCL guarantees `data..data+size` is readable
                // (checked against its registration by the caller);
                // fi_tinject copies it now.
                unsafe { std::slice::from_raw_parts(data, size) }
            };
            st.peer
                .link
                .peer
                .send("fi_tinject", |a| ep.tinject(bytes, a, to))
        } else {
            st.peer.link.peer.send("fi_tsend", |a| {
                // SAFETY: NCCL keeps the buffer until the request is done,
                // which is after its completion (or the peer's death, after
                // which the provider only reads it).
                unsafe { ep.tsend(data, size, desc, a, to, context(self.seat.id, idx)) }
            })
        };
        match posted {
            Ok(()) => {
                st.credits -= 1;
                st.sent_tagged = st.sent_tagged.wrapping_add(1);
                st.sent.insert(tag, number.wrapping_add(1));
                Ok(Self::req_id(st, idx))
            }
            Err(e) => {
                st.reqs.release(idx);
                if e.is_again() {
                    st.progress(&self.seat)?;
                    return Ok(None);
                }
                Err(Error::remote(format!(
                    "isend of {size} bytes to {} failed: {e}",
                    st.peer.link.name
                ))
                .of_kind(Kind::Provider(e.code)))
            }
        }
    }
}
