//! The RDMA receive path: buffers offered with `Rtr` (unless eager
//! messages that came first fill them), eager messages copied in, and
//! writes completed when their immediate and their size both arrived.

use super::*;

impl RecvState {
    /// RDMA: numbers the buffers of request `slot` per tag, fills them from
    /// eager messages that came first, and offers to the sender those an
    /// eager message cannot fill (larger than [`RecvState::eager_max`]) or
    /// that it asked for. A small receive is not offered: its message comes
    /// eagerly, so an offer would be one more message on the wire for
    /// nothing; a sender that cannot send it eagerly asks ([`Ctrl::Want`]).
    /// So is a larger one while the comm is *lazy*: [`LAZY_AFTER`] large
    /// receives in a row were filled eagerly (NCCL posts whole steps,
    /// whatever it sends), until a `Want` says its message is large.
    pub(super) fn offer(&mut self, seat: &Seat, slot: u32) -> Result<()> {
        let Some(mut r) = self.reqs.get(slot).copied() else {
            return Ok(());
        };
        let n = usize::from(r.n);
        for i in 0..n {
            let next = self.next_idx.entry(r.tags[i]).or_insert(0);
            r.idxs[i] = *next;
            *next = next.wrapping_add(1);
        }
        let mut subs = 0u8;
        for i in 0..n {
            let key = (r.tags[i], r.idxs[i]);
            if let Some(at) = self.wanted.iter().position(|&w| w == key) {
                self.wanted.swap_remove(at);
                subs |= 1 << i;
            } else if r.caps[i] > self.eager_max as u64 && !self.lazy {
                subs |= 1 << i;
            }
        }
        if let Some(q) = self.reqs.get_mut(slot) {
            q.idxs = r.idxs;
        }
        // Eager messages that came first go straight in.
        for i in 0..n {
            if let Some(data) = self.stash.remove(&(r.tags[i], r.idxs[i])) {
                self.fill(slot, i as u8, &data);
                self.spare.push(data);
                subs &= !(1 << i);
            }
        }
        self.send_rtr(seat, slot, subs)
    }

    /// Offers buffers `subs` of request `slot` in one `Rtr`, with the
    /// credits owed. Nothing after the sender's `Bye` (`check_after_bye`:
    /// it takes no offer any more). Offers are numbered per tag, not per
    /// Rtr, so a buffer not offered leaves no gap the sender waits on.
    fn send_rtr(&mut self, seat: &Seat, slot: u32, subs: u8) -> Result<()> {
        if self.peer.bye_heard || subs == 0 {
            return Ok(());
        }
        let mut tickets = [0u32; MAX_RECVS];
        for t in &mut tickets {
            let (key, n) = &mut self.tickets;
            *n += 1;
            *t = std::hash::BuildHasher::hash_one(&*key, *n) as u32;
        }
        let Some(r) = self.reqs.get_mut(slot) else {
            return Ok(());
        };
        let subs = subs & r.all() & !r.offered;
        let mut bufs = Entries::new();
        for s in (0..usize::from(r.n)).filter(|&s| subs & (1 << s) != 0) {
            r.tickets[s] = tickets[s];
            bufs.push(RtrBuf {
                ticket: tickets[s],
                tag: r.tags[s],
                idx: r.idxs[s],
                size: r.caps[s],
                addr: r.addrs[s],
                key: r.keys[s],
            });
        }
        r.offered |= subs;
        r.wanted &= !subs;
        if bufs.is_empty() {
            return Ok(());
        }
        // The credits owed ride back on the offer.
        let credits = self.credits_owed.min(u32::from(u16::MAX));
        self.credits_owed -= credits;
        let rtr = Ctrl::Rtr {
            seq: self.seq,
            slot: slot as u8,
            credits: credits as u16,
            subs,
            bufs,
        };
        self.seq = self.seq.wrapping_add(1);
        self.peer.send(seat.ep(), rtr)
    }

    /// The sender asks for message `idx` of `tag`: its receive, if posted
    /// and not offered, is offered once this read of the CQ is done;
    /// one not yet posted is offered when it is.
    pub(super) fn on_want(&mut self, tag: i32, idx: u32, large: bool) {
        if large {
            // Large messages come: offer large receives as they are posted,
            // and those posted meanwhile now (else each would wait for a
            // `Want` of its own).
            self.wasted = 0;
            if std::mem::take(&mut self.lazy) {
                self.offer_large_posted();
            }
        }
        let posted = self.reqs.live().find_map(|i| {
            let r = self.reqs.get(i)?;
            (0..r.n)
                .find(|&s| {
                    let s = usize::from(s);
                    let bit = 1 << s;
                    r.tags[s] == tag && r.idxs[s] == idx && (r.landed | r.sized) & bit == 0
                })
                .map(|s| (i, s))
        });
        if let Some((slot, sub)) = posted {
            if let Some(r) = self.reqs.get_mut(slot) {
                if r.offered & (1 << sub) == 0 {
                    r.wanted |= 1 << sub;
                    self.want_due = true;
                }
            }
            return;
        }
        // Not posted yet (numbers ahead of the next receive's), or done.
        let next = self.next_idx.get(&tag).copied().unwrap_or(0);
        if idx.wrapping_sub(next) >= u32::MAX / 2 || self.wanted.contains(&(tag, idx)) {
            return;
        }
        if self.wanted.try_push((tag, idx)).is_err() {
            tracing::warn!(
                "receive comm from {}: ignored a request for message {idx} of tag {tag}: {WANTED} are asked for already",
                self.peer.link.name
            );
        }
    }

    /// Marks every posted large receive not offered yet as wanted (offered
    /// with what the sender asked for, [`Self::offer_wanted`]).
    fn offer_large_posted(&mut self) {
        let eager_max = self.eager_max as u64;
        for i in 0..self.reqs.capacity() as u32 {
            let Some(r) = self.reqs.get_mut(i) else {
                continue;
            };
            let large = (0..r.n)
                .filter(|&s| r.caps[usize::from(s)] > eager_max)
                .fold(0u8, |m, s| m | (1 << s));
            let due = large & !(r.offered | r.landed | r.sized);
            if due != 0 {
                r.wanted |= due;
                self.want_due = true;
            }
        }
    }

    /// Offers what the sender asked for ([`Self::on_want`]).
    pub(super) fn offer_wanted(&mut self, seat: &Seat) -> Result<()> {
        self.want_due = false;
        let mut due = [(0u32, 0u8); MAX_REQUESTS];
        let mut n = 0;
        for i in self.reqs.live() {
            if let Some(r) = self.reqs.get(i).filter(|r| r.wanted != 0) {
                due[n] = (i, r.wanted);
                n += 1;
            }
        }
        for &(slot, subs) in &due[..n] {
            self.send_rtr(seat, slot, subs)?;
        }
        Ok(())
    }

    /// Eager message `idx` of `tag`: into its receive if posted, else kept
    /// until it is.
    pub(super) fn on_eager(&mut self, tag: i32, idx: u32, data: &[u8]) {
        let found = self.reqs.live().find_map(|i| {
            let r = self.reqs.get(i)?;
            (0..r.n)
                .find(|&s| {
                    let s = usize::from(s);
                    r.tags[s] == tag && r.idxs[s] == idx && r.sized & (1 << s) == 0
                })
                .map(|s| (i, s))
        });
        match found {
            Some((slot, sub)) => self.fill(slot, sub, data),
            None if self.stash.len() < EAGER_CREDITS as usize => {
                // Into a buffer an earlier stashed message left.
                let mut kept = self.spare.pop().unwrap_or_default();
                kept.clear();
                kept.extend_from_slice(data);
                self.stash.insert((tag, idx), kept);
            }
            None => tracing::warn!(
                "receive comm from {}: dropped an eager message beyond its {EAGER_CREDITS} credits (tag {tag})",
                self.peer.link.name
            ),
        }
    }

    /// Copies eager data into buffer `sub` of request `slot` (nothing past
    /// it: a larger message is a truncation error) and owes a credit back.
    pub(super) fn fill(&mut self, slot: u32, sub: u8, data: &[u8]) {
        self.credits_owed += 1;
        let Some(r) = self.reqs.get_mut(slot) else {
            return;
        };
        let s = usize::from(sub);
        if r.caps[s] > self.eager_max as u64 {
            // A large receive got a small message: LAZY_AFTER times in a row
            // (no write between), and offering the next ones would be wasted
            // too.
            self.wasted = self.wasted.saturating_add(1);
            self.lazy |= self.wasted >= LAZY_AFTER;
        }
        if data.len() as u64 <= r.caps[s] && !data.is_empty() {
            // SAFETY: NCCL keeps the buffer writable for its size until the
            // request is reported done (its irecv contract); the data fits.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), r.data[s] as *mut u8, data.len())
            };
        }
        r.landed |= 1 << sub;
        r.size(sub, data.len() as u64, false);
    }

    /// A write landed in buffer `sub` of `slot`; `hi`: its immediate's
    /// upper 32 bits (wide immediates), the size XOR the offer's ticket. One
    /// that decodes to no size the buffer can hold did not come from the
    /// peer the buffer was offered to (a Weft sender checks the size first):
    /// it is dropped.
    pub(super) fn on_landed(&mut self, slot: u8, sub: u8, hi: Option<u32>) {
        // A large message came by write: offers are not wasted.
        self.wasted = 0;
        let Some(r) = self.buffer(slot, sub, "a write") else {
            return;
        };
        let s = usize::from(sub);
        let size = hi.map(|hi| crate::proto::wire::immediate_size(hi, r.tickets[s]));
        if let Some(Some(size)) = size {
            if size > r.caps[s] {
                self.peer
                    .link
                    .stranger("a write whose immediate matches no offer");
                return;
            }
            r.size(sub, size, true);
        }
        r.landed |= 1 << sub;
    }
}
