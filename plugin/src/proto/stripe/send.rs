//! The sending side of a virtual device's comm: headers and parts posted on every rail at once.

use super::*;

/// A send.
#[derive(Debug, Clone, Copy)]
pub struct SendMsg {
    pub(super) data: usize,
    pub(super) size: usize,
    /// The header message's length (with an inline message).
    pub(super) head: usize,
    pub(super) tag: i32,
    pub(super) mems: [Mem; MAX_RAILS],
    pub(super) members: Members,
}

/// The sender's state; `x` is the rail the next message starts on.
pub(super) type SendHalf = Half<SendMsg, usize>;

impl StripedSend {
    /// A sender over `rails` (one member per rail, connecting), striping
    /// messages of `stripe` bytes and more.
    pub fn new(rails: Vec<Arc<dyn Sender>>, stripe: usize) -> Result<Self> {
        Self::open(rails, stripe, 0)
    }

    /// Hands each rail what it can take now, in order.
    pub(super) fn progress(&self, st: &mut SendHalf) -> Result<()> {
        rails_alive(&self.rails)?;
        for (r, rail) in self.rails.iter().enumerate() {
            while let Some(&post) = st.queues[r].front() {
                let Some(&req) = st.reqs.get(post.slot) else {
                    st.queues[r].pop_front();
                    continue;
                };
                let (ptr, len, mem) = match post.part {
                    None => (
                        st.headers.slot(post.slot).cast_const(),
                        req.head,
                        st.headers.mem,
                    ),
                    Some(p) => ((req.data + p.off) as *const u8, p.len, req.mems[r]),
                };
                // SAFETY: a header slot lives as long as the comm; a part
                // lies in NCCL's buffer, which NCCL keeps until the request
                // is done (the core checked it against its registration).
                let id = unsafe { rail.isend(ptr, len, req.tag, &[mem], std::ptr::null_mut()) }
                    .map_err(on_rail(r))?;
                let Some(id) = id else { break };
                st.queues[r].pop_front();
                if let Some(q) = st.reqs.get_mut(post.slot) {
                    q.members.push(r, id);
                }
            }
        }
        Ok(())
    }

    pub(super) fn test_req(&self, id: ReqId) -> Result<Option<Done>> {
        self.test_with(id, |st| {
            self.progress(st)?;
            let req = *st.reqs.get(id.slot).expect("live");
            let mut m = req.members;
            let finished = m.test(&self.rails)?;
            st.reqs.get_mut(id.slot).expect("live").members = m;
            Ok(finished.then(|| done(req.size)))
        })
    }
}

impl Sender for StripedSend {
    fn listener_nonce(&self) -> u64 {
        self.rails[0].listener_nonce()
    }

    fn step_connect(&self) -> Result<bool> {
        let mut all = true;
        for (r, rail) in self.rails.iter().enumerate() {
            all &= rail.step_connect().map_err(on_rail(r))?;
        }
        Ok(all)
    }

    unsafe fn isend(
        &self,
        data: *const u8,
        size: usize,
        tag: i32,
        mem: &[Mem],
        _phandle: *mut c_void,
    ) -> Result<Option<ReqId>> {
        let n = self.rails.len();
        let progress = |st: &mut SendHalf| self.progress(st);
        // No CPU touches GPU data: only host-memory devices inline.
        let inline = size <= INLINE_MAX && !self.devs.iter().any(|d| d.cuda);
        self.post_with("isend", mem, None, tag, progress, |st, number, mems| {
            let first = st.x;
            let parts = if inline {
                Parts::default()
            } else {
                layout(size, n, first, self.stripe)
            };
            let req = SendMsg {
                data: data as usize,
                size,
                head: HEADER_LEN + if inline { size } else { 0 },
                tag,
                mems,
                members: Members {
                    unposted: 1 + parts.len() as u8,
                    ..Members::NONE
                },
            };
            let (_, slot) = st.reqs.insert(req)?;
            if !inline {
                st.x = (first + 1) % n;
            }
            let header = Header {
                number,
                size: size as u64,
                first: first as u8,
                inline,
            }
            .encode();
            let at = st.headers.slot(slot);
            // SAFETY: the slot is SLOT bytes of this comm's headers; an
            // inline message (at most INLINE_MAX bytes, host memory) is
            // readable by the caller's contract.
            unsafe {
                std::ptr::copy_nonoverlapping(header.as_ptr(), at, HEADER_LEN);
                if inline {
                    std::ptr::copy_nonoverlapping(data, at.add(HEADER_LEN), size);
                }
            };
            st.queues[0].push_back(Post { slot, part: None });
            for &p in parts.iter() {
                st.queues[p.rail].push_back(Post {
                    slot,
                    part: Some(p),
                });
            }
            Some(slot)
        })
    }
}

comm_over_rails!(StripedSend);
