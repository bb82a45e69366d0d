//! The RDMA receive path: buffers offered with `Rtr` (unless eager
//! messages that came first fill them), eager messages copied in, and
//! writes completed when their immediate and their size both arrived.

use super::*;

impl RecvState {
    /// RDMA: numbers the buffers per tag, fills them from eager messages
    /// that came first, and offers them to the sender.
    pub(super) fn offer(&mut self, seat: &Seat, slot: u32, bufs: &[RecvBuf]) -> Result<()> {
        let mut idxs = [0; MAX_RECVS];
        for (i, b) in bufs.iter().enumerate() {
            let next = self.next_idx.entry(b.tag).or_insert(0);
            idxs[i] = *next;
            *next = next.wrapping_add(1);
        }
        if let Some(r) = self.reqs.get_mut(slot) {
            r.idxs = idxs;
        }
        // Eager messages that came first go straight in.
        let mut filled = 0;
        for (i, b) in bufs.iter().enumerate() {
            if let Some(data) = self.stash.remove(&(b.tag, idxs[i])) {
                self.fill(slot, i as u8, &data);
                self.spare.push(data);
                filled += 1;
            }
        }
        if self.peer.bye_heard || filled == bufs.len() {
            // Served from the stash whole: nothing to offer (and after the
            // sender's Bye, `check_after_bye`, it takes no offer any more).
            // Offers are numbered per tag, not per Rtr, so skipping one
            // leaves no gap the sender waits on.
            return Ok(());
        }
        let mut tickets = [0u32; MAX_RECVS];
        for t in &mut tickets[..bufs.len()] {
            let (key, n) = &mut self.tickets;
            *n += 1;
            *t = std::hash::BuildHasher::hash_one(&*key, *n) as u32;
        }
        if let Some(r) = self.reqs.get_mut(slot) {
            r.tickets = tickets;
        }
        let offsets = self.offsets;
        // The credits owed ride back on the offer.
        let credits = self.credits_owed.min(u32::from(u16::MAX));
        self.credits_owed -= credits;
        let rtr = Ctrl::Rtr {
            seq: self.seq,
            slot: slot as u8,
            credits: credits as u16,
            bufs: bufs
                .iter()
                .zip(idxs)
                .zip(tickets)
                .map(|((b, idx), ticket)| {
                    let mem = Mem::first(b.mem);
                    RtrBuf {
                        ticket,
                        tag: b.tag,
                        idx,
                        size: b.size as u64,
                        addr: if offsets {
                            (b.data as usize - mem.base) as u64
                        } else {
                            b.data as u64
                        },
                        key: mem.key,
                    }
                })
                .collect(),
        };
        self.seq = self.seq.wrapping_add(1);
        self.peer.send(seat.ep(), rtr)
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
