//! The receiving side of a virtual device's comm: a message's parts are posted once its header came.

use super::*;

pub(super) fn rail_devices<C: Comm + ?Sized>(rails: &[Arc<C>]) -> Result<Vec<Arc<DeviceState>>> {
    if rails.is_empty() || rails.len() > MAX_RAILS {
        return Err(Error::internal(format!(
            "a virtual device of {} rails (1 ..= {MAX_RAILS})",
            rails.len()
        )));
    }
    Ok(rails.iter().map(|r| Arc::clone(&r.rails()[0])).collect())
}

// -------------------------------------------------------------- receiving

/// Where a receive stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Behind an earlier receive of its tag: its header is not posted yet.
    Queued,
    /// Its header is posted (or waits for rail 0 to take it).
    Header,
    /// Its parts are posted (or wait for their rails).
    Parts,
}

/// A receive.
#[derive(Debug, Clone, Copy)]
pub struct RecvMsg {
    pub(super) data: usize,
    pub(super) cap: usize,
    pub(super) tag: i32,
    pub(super) number: u32,
    pub(super) mems: [Mem; MAX_RAILS],
    pub(super) stage: Stage,
    pub(super) header: Option<ReqId>,
    /// The size the header announced.
    pub(super) size: usize,
    pub(super) members: Members,
}

/// The receiver's state; `x` holds, per tag, the receives in NCCL's
/// order: the first one's header is posted, the others wait their turn.
pub(super) type RecvHalf = Half<RecvMsg, HashMap<i32, VecDeque<u32>>>;

impl StripedRecv {
    pub(super) fn new(rails: Vec<Arc<dyn Receiver>>, stripe: usize) -> Result<Self> {
        Self::open(rails, stripe, HashMap::new())
    }

    /// Hands each rail what it can take now, in order.
    pub(super) fn post(&self, st: &mut RecvHalf) -> Result<()> {
        for (r, rail) in self.rails.iter().enumerate() {
            while let Some(&post) = st.queues[r].front() {
                let Some(&req) = st.reqs.get(post.slot) else {
                    st.queues[r].pop_front();
                    continue;
                };
                let header_mem = [st.headers.mem];
                let buf = match post.part {
                    None => RecvBuf {
                        data: st.headers.slot(post.slot),
                        size: SLOT,
                        tag: req.tag,
                        mem: &header_mem,
                        phandle: std::ptr::null_mut(),
                        hold: None,
                    },
                    // Cut to the buffer: nothing lands past it.
                    Some(p) => RecvBuf {
                        data: (req.data + p.off.min(req.cap)) as *mut u8,
                        size: p.len.min(req.cap.saturating_sub(p.off)),
                        tag: req.tag,
                        mem: &req.mems[r..=r],
                        phandle: std::ptr::null_mut(),
                        hold: st.holds.get(post.slot as usize).and_then(Option::as_ref),
                    },
                };
                // SAFETY: a header slot lives as long as the comm; a part
                // lies in NCCL's buffer (cut to its capacity), which NCCL
                // keeps until the request is done.
                let id = unsafe { rail.irecv(&[buf]) }.map_err(on_rail(r))?;
                let Some(id) = id else { break };
                st.queues[r].pop_front();
                if let Some(q) = st.reqs.get_mut(post.slot) {
                    match post.part {
                        None => q.header = Some(id),
                        Some(_) => q.members.push(r, id),
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads the headers that arrived, queues their parts and the next
    /// header of their tag; `Ok(true)` if anything moved.
    pub(super) fn headers(&self, st: &mut RecvHalf) -> Result<bool> {
        let n = self.rails.len();
        let mut moved = false;
        // A receive waits in Stage::Header exactly while it is the first of
        // its tag: the requests are few (MAX_REQUESTS), so look at each
        // rather than gather the tags' fronts (no allocation per test).
        for slot in 0..MAX_REQUESTS as u32 {
            let Some(&req) = st.reqs.get(slot) else {
                continue;
            };
            let Some(hid) = req.header.filter(|_| req.stage == Stage::Header) else {
                continue;
            };
            let Some(d) = self.rails[0].test(hid).map_err(on_rail(0))? else {
                continue;
            };
            let got = &st.headers.read(slot)[..d.sizes[0].min(SLOT)];
            let bad = |why: String| {
                Error::protocol(format!(
                    "virtual device comm from {}: tag {}: {why}; the peer is not a matching Weft, or the stream is corrupted",
                    peer_names(&self.rails),
                    req.tag
                ))
            };
            let h = Header::decode(got, req.number, n).map_err(bad)?;
            let size = usize::try_from(h.size).unwrap_or(usize::MAX);
            let parts = if h.inline {
                if self.devs.iter().any(|d| d.cuda) {
                    return Err(bad(
                        "an inline message for a device that takes GPU memory (no CPU copies there): the two hosts' devices differ".into(),
                    ));
                }
                if size <= req.cap {
                    // SAFETY: NCCL's buffer holds `cap` >= `size` bytes and
                    // is host memory (no rail takes GPU memory).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            got[HEADER_LEN..].as_ptr(),
                            req.data as *mut u8,
                            size,
                        )
                    };
                }
                Parts::default()
            } else {
                layout(size, n, usize::from(h.first), self.stripe)
            };
            if let Some(q) = st.reqs.get_mut(slot) {
                q.stage = Stage::Parts;
                q.size = size;
                q.members.unposted = parts.len() as u8;
                if h.inline {
                    q.members.bytes = size;
                }
            }
            for &p in parts.iter() {
                st.queues[p.rail].push_back(Post {
                    slot,
                    part: Some(p),
                });
            }
            let q = st.x.get_mut(&req.tag).expect("its tag");
            q.pop_front();
            if let Some(&next) = q.front() {
                if let Some(r) = st.reqs.get_mut(next) {
                    r.stage = Stage::Header;
                }
                st.queues[0].push_back(Post {
                    slot: next,
                    part: None,
                });
            } else {
                st.x.remove(&req.tag);
            }
            moved = true;
        }
        Ok(moved)
    }

    pub(super) fn progress(&self, st: &mut RecvHalf) -> Result<()> {
        rails_alive(&self.rails)?;
        loop {
            self.post(st)?;
            if !self.headers(st)? {
                return Ok(());
            }
        }
    }

    pub(super) fn test_req(&self, id: ReqId) -> Result<Option<Done>> {
        self.test_with(id, |st| {
            self.progress(st)?;
            let req = *st.reqs.get(id.slot).expect("live");
            if req.stage != Stage::Parts {
                return Ok(None);
            }
            let mut m = req.members;
            let finished = m.test(&self.rails)?;
            st.reqs.get_mut(id.slot).expect("live").members = m;
            if !finished {
                return Ok(None);
            }
            if req.size > req.cap {
                return Err(Error::remote(format!(
                    "receive: peer {} sent {} bytes with tag {} into a buffer of {}: message truncated, nothing written past the buffer",
                    peer_names(&self.rails),
                    req.size,
                    req.tag,
                    req.cap
                ))
                .of_kind(Kind::Truncated));
            }
            if m.bytes != req.size {
                return Err(Error::remote(format!(
                    "receive: the rails brought {} bytes of a {}-byte message (tag {})",
                    m.bytes, req.size, req.tag
                )));
            }
            Ok(Some(done(req.size)))
        })
    }
}

impl Receiver for StripedRecv {
    unsafe fn irecv(&self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        let [b] = bufs else {
            return Err(Error::internal(format!(
                "irecv with n = {} on a virtual device, which reported maxRecvs = 1",
                bufs.len()
            )));
        };
        let progress = |st: &mut RecvHalf| self.progress(st);
        self.post_with(
            "irecv",
            b.mem,
            b.hold,
            b.tag,
            progress,
            |st, number, mems| {
                let req = RecvMsg {
                    data: b.data as usize,
                    cap: b.size,
                    tag: b.tag,
                    number,
                    mems,
                    stage: Stage::Queued,
                    header: None,
                    size: 0,
                    members: Members::NONE,
                };
                let (_, slot) = st.reqs.insert(req)?;
                let q = st.x.entry(b.tag).or_default();
                q.push_back(slot);
                if q.len() == 1 {
                    st.reqs.get_mut(slot).expect("inserted").stage = Stage::Header;
                    st.queues[0].push_back(Post { slot, part: None });
                }
                Some(slot)
            },
        )
    }
}

comm_over_rails!(StripedRecv);

// -------------------------------------------------------------- listening
