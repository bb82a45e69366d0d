//! The tagged receive path (`WEFT_PROTOCOL=sendrecv`): NCCL's buffers
//! posted to the shared endpoint in NCCL's order, the large ones announced
//! to the sender, and what is still posted taken back when the peer dies or
//! the comm closes.

use super::*;

impl RecvState {
    /// Tagged: posts the buffers of request `slot` unless earlier ones wait
    /// (posting order is matching order); what the provider refuses for now
    /// waits in order. No CQ read here: NCCL tests the request next, and
    /// every read costs a system call on tcp.
    pub(super) fn post_all(&mut self, seat: &Seat, slot: u32) -> Result<()> {
        let n = self.reqs.get(slot).map_or(0, |r| r.n);
        for sub in 0..n {
            self.to_post.push_back((slot, sub));
        }
        self.post_pending(seat)
    }

    /// Posts the waiting buffers, in order, until the provider says "not now".
    pub(super) fn post_pending(&mut self, seat: &Seat) -> Result<()> {
        while let Some(&(slot, sub)) = self.to_post.front() {
            let Some(r) = self.reqs.get(slot) else {
                self.to_post.pop_front();
                continue;
            };
            let s = usize::from(sub);
            let ep = seat.ep();
            // SAFETY: NCCL keeps the buffer writable for its size until the
            // request is reported done or the comm closed, and neither
            // happens while the provider holds it (see `finished`, Drop);
            // the context names this comm, request and buffer.
            let posted = unsafe {
                ep.trecv(
                    r.data[s] as *mut u8,
                    r.caps[s] as usize,
                    r.descs[s] as *mut std::ffi::c_void,
                    self.peer.link.peer.addr,
                    data_tag(seat.id, r.tags[s]),
                    0,
                    context(seat.id, (slot << 3) | u32::from(sub)),
                )
            };
            match posted {
                Ok(()) => {}
                Err(e) if e.is_again() => return self.announce_posted(seat),
                Err(e) => return Err(e.into()),
            }
            if let Some(r) = self.reqs.get_mut(slot) {
                r.posted |= 1 << sub;
                self.max_cap = self.max_cap.max(r.caps[s] as usize);
                let tag = r.tags[s];
                if self.tags.len() < GRAVE_TAGS && !self.tags.contains(&tag) {
                    self.tags.push(tag);
                }
                let count = self.posted_count.entry(tag).or_insert(0);
                *count = count.wrapping_add(1);
                if r.caps[s] as usize > self.announce_above {
                    match self.announce.iter_mut().find(|(t, _)| *t == tag) {
                        Some(e) => e.1 = *count,
                        None => self.announce.push((tag, *count)),
                    }
                }
            }
            self.to_post.pop_front();
        }
        self.announce_posted(seat)
    }

    /// Tagged: tells the sender which large receives are now posted, so it
    /// sends into them (never ahead of them: libfabric's rxm keeps a large
    /// message that arrives before its receive as a rendezvous request that
    /// points at the connection, and reads through it once a receive
    /// matches, even after it freed the connection of a peer that died).
    pub(super) fn announce_posted(&mut self, seat: &Seat) -> Result<()> {
        while !self.announce.is_empty() {
            let n = self.announce.len().min(MAX_RECVS);
            let counts: Entries<(i32, u32)> = self.announce.drain(..n).collect();
            self.peer.send(seat.ep(), Ctrl::Posted { counts })?;
        }
        Ok(())
    }

    /// Tagged: asks the provider to give back every buffer still posted
    /// (each comes back as a cancelled or finished receive).
    pub(super) fn cancel_posted(&mut self, seat: &Seat) {
        let live: Vec<u32> = self.reqs.live().collect();
        for slot in live {
            let Some(r) = self.reqs.get_mut(slot) else {
                continue;
            };
            let ask = r.posted & !r.cancelled;
            r.cancelled |= ask;
            for sub in (0..8u8).filter(|s| ask & (1 << s) != 0) {
                // SAFETY: the context is one this comm posted; cancelling an
                // operation the provider already finished is harmless
                // (-FI_ENOENT), its completion arrives as usual.
                let _ = unsafe {
                    seat.ep()
                        .cancel(context(seat.id, (slot << 3) | u32::from(sub)))
                };
            }
        }
    }

    /// Tagged: the provider returned buffer `local` (slot << 3 | buffer),
    /// with a message of `len` bytes, or failed (truncated, cancelled).
    pub(super) fn on_received(&mut self, local: u32, outcome: std::result::Result<usize, CompletionError>) {
        let (slot, sub) = (local >> 3, (local & 7) as u8);
        let name = &self.peer.link.name;
        let Some(r) = self
            .reqs
            .get_mut(slot)
            .filter(|r| r.posted & (1 << sub) != 0)
        else {
            tracing::warn!(
                "receive comm from {name}: ignored a completion for buffer {sub} of request slot {slot}, which it has not posted"
            );
            return;
        };
        r.posted &= !(1 << sub);
        let bit = 1 << sub;
        match outcome {
            Ok(len) => r.sizes[usize::from(sub)] = len,
            Err(e) if e.err == fi::FI_ECANCELED => return,
            Err(e) if e.err == fi::FI_ETRUNC => {
                // Providers differ in what they report (shm gives no lengths).
                let size = (e.olen > 0).then_some((e.len + e.olen) as u64);
                r.trunc.get_or_insert((sub, size, false));
            }
            Err(e) => {
                r.failed.get_or_insert((sub, e.err));
            }
        }
        r.landed |= bit;
        r.sized |= bit;
        // Every matched message, delivered or failed, frees a credit.
        self.credits_owed += 1;
        self.matched = self.matched.wrapping_add(1);
        self.settle_after_bye();
    }
}
