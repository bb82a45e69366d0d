//! Virtual devices: one comm over several rails (NCCL's NIC fusion,
//! `makeVDevice`), for either protocol.
//!
//! A virtual device of one rail does not stripe: its comms are the rail's
//! own (`core::connect` and [`StripedListen`] hand them out as they are),
//! header-free, unless the test switch `WEFT_TEST_STRIPE_ONE_RAIL` asks for
//! the protocol below on one rail.
//!
//! A comm on a virtual device is one member comm per rail, each an ordinary
//! comm of the protocol on that rail's device, connected rail to rail (rail
//! `i` of the sender to rail `i` of the listener; the listen handle lists
//! every rail's listener, see [`super::wire::encode_rails`]). Liveness,
//! credits and truncation are the members' own.
//!
//! **Messages.** The sender alone knows a message's size and the receiver
//! alone its buffer's, so every message starts with a [`HEADER_LEN`]-byte
//! header on rail 0, under the message's own tag: `{magic, number, size,
//! first rail}`. Both sides cut the message alike from it ([`layout`]): one
//! part on the `first` rail when it is smaller than `WEFT_STRIPE_SIZE`
//! (the sender turns `first` round-robin, so small messages spread over the
//! rails), else one part per rail, in 4 KiB-aligned slices of equal size.
//! The sender posts the header and every part at once; the receiver posts a
//! message's parts when its header arrived, and the next header of the same
//! tag after them, so each rail sees each tag's parts in the same order on
//! both sides (the members match per tag, in order). A receive is done when
//! all its parts are; `test` reports the bytes the parts brought, which
//! must add up to the header's size.
//!
//! A message of at most [`INLINE_MAX`] bytes between devices that take host
//! memory only travels inside its header (a header slot is [`SLOT`] bytes)
//! and has no parts: one message, as on a physical device. Devices that take
//! GPU memory never inline (no CPU copy touches GPU data).
//!
//! What this costs: the header, and, on the receiving side, the wait for it
//! before a message's parts are offered (RDMA) or matched (tagged): about
//! one extra one-way latency per message with parts (docs/perf/vdev.txt).
//!
//! **Errors.** A header that is short, not Weft's, out of order or names a
//! rail that does not exist breaks the comm with a message saying so. A
//! message larger than the receive buffer is cut to the buffer's size per
//! part, so the members report the truncation on both sides and nothing is
//! written past the buffer; the receive fails saying both sizes. A rail
//! whose peer closed (its `Bye` came and all it sent there was matched) has
//! not failed: the other rails may still hold what the peer sent before, and
//! only a request that needs the closed rail fails. When one
//! rail fails (its peer went silent, its link went down) the comm fails as a
//! whole: that request and every later one (the parts on the other rails
//! keep NCCL's buffers until the comm is closed, as any comm closed with
//! receives in flight). A comm does not carry on over the remaining rails.
//!
//! Grouped receives are not striped: a striped virtual device reports
//! `maxRecvs = 1` (one of one rail reports its rail's).
//!
//! Files, as `comms/` is split: this one holds what both sides share (the
//! member comms, a side's state `Half`, the generic `Striped` comm);
//! `header` the header codec and the cut (`layout`); `send`, `recv` and
//! `listen` the three comms.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
#[cfg(feature = "testing")]
use std::sync::mpsc::{Receiver as Rx, Sender as Tx};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::pool::Pool;
use super::sync::try_lock;
use super::wire::MAX_RAILS;
use super::{
    Comm, DeviceState, Done, Hold, Listener, Mem, Receiver, RecvBuf, ReqId, Sender, MAX_RECVS,
    MAX_REQUESTS,
};
use crate::error::{Error, Kind, Result};
use crate::fabric::Mr;
use crate::mr::Region;

/// What a rail still has to post, in order: a header (always on rail 0) or
/// a part of request `slot`.
#[derive(Debug, Clone, Copy)]
struct Post {
    slot: u32,
    part: Option<Part>,
}

/// The member requests of one request.
#[derive(Debug, Clone, Copy)]
struct Members {
    n: u8,
    ids: [(u8, ReqId); MAX_RAILS + 1],
    /// Which of them finished, and the bytes each moved.
    done: u16,
    bytes: usize,
    /// Posts not yet taken by their rail.
    unposted: u8,
}

impl Members {
    const NONE: Members = Members {
        n: 0,
        ids: [(0, ReqId { slot: 0, gen: 0 }); MAX_RAILS + 1],
        done: 0,
        bytes: 0,
        unposted: 0,
    };

    fn push(&mut self, rail: usize, id: ReqId) {
        self.ids[usize::from(self.n)] = (rail as u8, id);
        self.n += 1;
        self.unposted -= 1;
    }

    /// Tests the members not yet finished; `Ok(true)` once every post was
    /// taken and every member finished.
    fn test<C: Comm + ?Sized>(&mut self, rails: &[Arc<C>]) -> Result<bool> {
        for i in 0..usize::from(self.n) {
            if self.done & (1 << i) != 0 {
                continue;
            }
            let (rail, id) = self.ids[i];
            if let Some(d) = rails[usize::from(rail)]
                .test(id)
                .map_err(on_rail(usize::from(rail)))?
            {
                self.done |= 1 << i;
                self.bytes += d.sizes[..d.n].iter().sum::<usize>();
            }
        }
        Ok(self.unposted == 0 && self.done.count_ones() == u32::from(self.n))
    }
}

fn done(size: usize) -> Done {
    let mut sizes = [0; MAX_RECVS];
    sizes[0] = size;
    Done { n: 1, sizes }
}

/// The first failure breaks the comm: it is kept and every request after
/// it gets it.
fn broken(failed: &mut Option<Error>, e: Error) -> Error {
    if failed.is_none() {
        tracing::warn!("virtual device comm failed: {e}");
    }
    failed.get_or_insert(e).clone()
}

/// An error naming the first rail whose peer was declared dead: a comm on
/// a virtual device fails as a whole when one rail does, whether or not
/// that rail had anything in flight. A rail whose peer closed its comm
/// (`Kind::PeerClosed`: it said `Bye` and everything it sent there was
/// matched) has not failed: the other rails may still hold what the peer
/// sent before its close, and a request that needs the closed rail fails
/// through it (it takes no receive the peer's messages cannot fill).
fn rails_alive<C: Comm + ?Sized>(rails: &[Arc<C>]) -> Result<()> {
    for (r, rail) in rails.iter().enumerate() {
        match rail.alive() {
            Err(e) if e.kind != Kind::PeerClosed => return Err(on_rail(r)(e)),
            _ => {}
        }
    }
    Ok(())
}

/// Names the rail in an error of one of its member comms: every error a
/// member returns goes through it, so whichever call sees a rail fail first,
/// the operator learns which rail.
fn on_rail(r: usize) -> impl FnOnce(Error) -> Error {
    move |e| e.context(format!("virtual device, rail {r}"))
}

fn peer_names<C: Comm + ?Sized>(rails: &[Arc<C>]) -> String {
    rails
        .iter()
        .map(|r| r.peer_name())
        .collect::<Vec<_>>()
        .join(" + ")
}

/// Forwards what [`Comm`] asks of a striped comm to its rails.
macro_rules! comm_over_rails {
    ($t:ty) => {
        impl Comm for $t {
            fn rails(&self) -> &[Arc<DeviceState>] {
                &self.devs
            }
            fn test(&self, id: ReqId) -> Result<Option<Done>> {
                self.test_req(id)
            }
            /// Also moves the comm on where NCCL has not tested it for a
            /// while (a receive's parts are posted when its header is read).
            fn keepalive(&self, now: Instant) {
                for r in &self.rails {
                    r.keepalive(now);
                }
                if let Some(mut st) = try_lock(&self.st) {
                    if st.failed.is_none() {
                        if let Err(e) = self.progress(&mut st) {
                            broken(&mut st.failed, e);
                        }
                    }
                }
            }
            fn peer_name(&self) -> String {
                peer_names(&self.rails)
            }
            fn alive(&self) -> Result<()> {
                rails_alive(&self.rails)
            }
            #[cfg(feature = "testing")]
            fn hold(&self, held: &Tx<()>, release: &Rx<()>) {
                self.rails[0].hold(held, release);
            }
            #[cfg(feature = "testing")]
            fn endpoint_open(&self) -> bool {
                self.rails.iter().any(|r| r.endpoint_open())
            }
        }
    };
}

/// One side of a comm on a virtual device: its requests (`R`), their
/// header slots, what each rail has still to post, messages per tag (sent,
/// or receives posted), the first failure, and the side's own state `X`.
struct Half<R: Copy, X> {
    reqs: Pool<R>,
    headers: Headers,
    queues: Vec<VecDeque<Post>>,
    counts: HashMap<i32, u32>,
    failed: Option<Error>,
    /// Per request slot: what keeps NCCL's buffer registered on every rail
    /// until the request is reported done (receives; see [`Hold`]).
    holds: Vec<Option<Hold>>,
    x: X,
}

impl<R: Copy, X> Half<R, X> {
    /// Request `slot` no longer holds its buffer's registration.
    fn let_go(&mut self, slot: u32) {
        if let Some(h) = self.holds.get_mut(slot as usize) {
            *h = None;
        }
    }
}

/// A comm on a virtual device: one member comm (`C`) per rail and the
/// state of its side.
pub struct Striped<C: ?Sized, R: Copy, X> {
    rails: Vec<Arc<C>>,
    devs: Vec<Arc<DeviceState>>,
    stripe: usize,
    st: Mutex<Half<R, X>>,
}

/// A sending comm on a virtual device (also while it connects).
pub type StripedSend = Striped<dyn Sender, SendMsg, usize>;
/// A receiving comm on a virtual device.
pub type StripedRecv = Striped<dyn Receiver, RecvMsg, HashMap<i32, VecDeque<u32>>>;

impl<C: Comm + ?Sized, R: Copy, X> std::fmt::Debug for Striped<C, R, X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Striped({} rails: {})",
            self.rails.len(),
            peer_names(&self.rails)
        )
    }
}

impl<C: Comm + ?Sized, R: Copy, X> Striped<C, R, X> {
    /// A comm over `rails` (one member per rail), striping messages of
    /// `stripe` bytes and more; `x` starts the side's own state.
    fn open(rails: Vec<Arc<C>>, stripe: usize, x: X) -> Result<Self> {
        let devs = rail_devices(&rails)?;
        let st = Half {
            reqs: Pool::new(MAX_REQUESTS).map_err(|e| Error::system(e.to_string()))?,
            headers: Headers::new(&devs[0])?,
            queues: vec![VecDeque::new(); rails.len()],
            counts: HashMap::new(),
            failed: None,
            holds: vec![None; MAX_REQUESTS],
            x,
        };
        Ok(Self {
            rails,
            devs,
            stripe,
            st: Mutex::new(st),
        })
    }

    /// Tests request `id` with `step` (which moves the comm on and says
    /// whether the request is done); a finished or failed request is
    /// freed, and a failure breaks the comm. Never waits for the keeper.
    fn test_with(
        &self,
        id: ReqId,
        step: impl FnOnce(&mut Half<R, X>) -> Result<Option<Done>>,
    ) -> Result<Option<Done>> {
        let Some(mut st) = try_lock(&self.st) else {
            return Ok(None);
        };
        if let Some(e) = st.failed.clone() {
            st.reqs.release(id.slot);
            st.let_go(id.slot);
            return Err(e);
        }
        if !st.reqs.is_current(id.slot, id.gen) {
            return Err(Error::internal(format!(
                "test: request {} of a virtual device's comm is not live",
                id.slot
            )));
        }
        let r = step(&mut st);
        if !matches!(r, Ok(None)) {
            st.reqs.release(id.slot);
            st.let_go(id.slot);
        }
        r.map_err(|e| broken(&mut st.failed, e))
    }
}

impl<C: Comm + ?Sized, R: Copy, X> Striped<C, R, X> {
    /// Posts a request (`call`: isend, irecv) of `tag` with its
    /// registrations `mem`, one per rail: `place` makes and queues it from
    /// its number among its tag's messages and the registrations, and
    /// returns its slot; then the comm moves on (`progress`). `Ok(None)`
    /// while every request is in use or the keeper holds the comm.
    fn post_with(
        &self,
        call: &str,
        mem: &[Mem],
        hold: Option<&Hold>,
        tag: i32,
        progress: impl Fn(&mut Half<R, X>) -> Result<()>,
        place: impl FnOnce(&mut Half<R, X>, u32, [Mem; MAX_RAILS]) -> Option<u32>,
    ) -> Result<Option<ReqId>> {
        let n = self.rails.len();
        if mem.len() != n {
            return Err(Error::internal(format!(
                "{call}: {} registrations for a comm of {n} rails",
                mem.len()
            )));
        }
        let Some(mut st) = try_lock(&self.st) else {
            return Ok(None);
        };
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        if st.reqs.in_use() >= MAX_REQUESTS {
            progress(&mut st).map_err(|e| broken(&mut st.failed, e))?;
            return Ok(None);
        }
        let number = *st.counts.get(&tag).unwrap_or(&0);
        let mut mems = [Mem::NONE; MAX_RAILS];
        mems[..n].copy_from_slice(mem);
        let Some(slot) = place(&mut st, number, mems) else {
            return Ok(None);
        };
        if let Some(h) = st.holds.get_mut(slot as usize) {
            *h = hold.cloned();
        }
        st.counts.insert(tag, number.wrapping_add(1));
        progress(&mut st).map_err(|e| broken(&mut st.failed, e))?;
        Ok(Some(ReqId {
            slot,
            gen: st.reqs.gen(slot),
        }))
    }
}

// ---------------------------------------------------------------- sending

// After the macro above: the sides use it.
mod header;
mod listen;
mod recv;
mod send;
pub use header::*;
pub use listen::*;
pub use recv::*;
pub use send::*;

#[cfg(test)]
mod tests {
    use super::*;

    fn covers(parts: &[Part], size: usize) {
        let mut at = 0;
        for p in parts {
            assert_eq!(p.off, at, "{parts:?}");
            at += p.len;
        }
        assert_eq!(at, size, "{parts:?}");
    }

    #[test]
    fn small_messages_go_whole_round_robin() {
        for first in 0..4 {
            let p = layout(1000, 2, first, 65536);
            assert_eq!(
                *p,
                [Part {
                    rail: first % 2,
                    off: 0,
                    len: 1000
                }]
            );
        }
        assert_eq!(
            layout(0, 3, 1, 65536).len(),
            1,
            "an empty message is one part"
        );
        assert_eq!(layout(1 << 30, 1, 0, 65536).len(), 1, "one rail");
    }

    #[test]
    fn large_messages_stripe_over_every_rail_aligned() {
        for rails in 2..=MAX_RAILS {
            for size in [65536, 65537, 1 << 20, (1 << 20) + 3, 64 << 20] {
                for first in 0..rails {
                    let p = layout(size, rails, first, 65536);
                    covers(&p, size);
                    let slice = p[0].len;
                    assert_eq!(p.len(), size.div_ceil(slice), "{size} over {rails}");
                    assert!(p.len() <= rails);
                    if size >= rails * rails * STRIPE_ALIGN {
                        assert_eq!(p.len(), rails, "{size} over {rails}: every rail");
                    }
                    for (i, part) in p.iter().enumerate() {
                        assert_eq!(part.rail, (first + i) % rails);
                        assert_eq!(part.off % STRIPE_ALIGN, 0);
                        assert!(part.len > 0);
                    }
                }
            }
        }
        // Fewer slices than rails when the size is just above the threshold.
        let p = layout(4097, 4, 0, 4096);
        covers(&p, 4097);
        assert_eq!(p.len(), 2);
    }

    /// A member comm whose requests fail (its peer died) or stay pending.
    #[derive(Debug)]
    struct Member {
        dead: bool,
    }

    impl Comm for Member {
        fn rails(&self) -> &[Arc<DeviceState>] {
            &[]
        }
        fn test(&self, _: ReqId) -> Result<Option<Done>> {
            if self.dead {
                Err(Error::peer_dead("peer declared dead".to_owned()))
            } else {
                Ok(None)
            }
        }
        fn keepalive(&self, _: Instant) {}
        fn peer_name(&self) -> String {
            "member".into()
        }
        fn alive(&self) -> Result<()> {
            // Still alive as far as the keeper knows: the failure is seen
            // first by a test (the race CI met).
            Ok(())
        }
        #[cfg(feature = "testing")]
        fn hold(&self, _: &Tx<()>, _: &Rx<()>) {}
        #[cfg(feature = "testing")]
        fn endpoint_open(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_member_failing_its_test_names_its_rail() {
        let rails = [
            Arc::new(Member { dead: false }),
            Arc::new(Member { dead: true }),
        ];
        let mut m = Members::NONE;
        m.unposted = 2;
        m.push(0, ReqId { slot: 0, gen: 1 });
        m.push(1, ReqId { slot: 0, gen: 1 });
        let e = m.test(&rails).unwrap_err().to_string();
        assert!(e.contains("virtual device, rail 1: "), "{e}");
        assert!(e.contains("peer declared dead"), "{e}");
    }

    #[test]
    fn headers_round_trip_and_bad_ones_say_why() {
        let h = Header {
            number: 7,
            size: 1 << 33,
            first: 1,
            inline: false,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b, 7, 2), Ok(h));
        assert!(Header::decode(&b[..10], 7, 2)
            .unwrap_err()
            .contains("10 bytes"));
        assert!(Header::decode(&b, 8, 2).unwrap_err().contains("message 7"));
        assert!(Header::decode(&b, 7, 1)
            .unwrap_err()
            .contains("rail 1 of 1"));
        let mut bad = b;
        bad[0] ^= 1;
        assert!(Header::decode(&bad, 7, 2).unwrap_err().contains("not Weft"));
        let mut bad = b;
        bad[20] = 1;
        assert!(Header::decode(&bad, 7, 2).unwrap_err().contains("stray"));
        let mut bad = b;
        bad[17] = 2;
        assert!(Header::decode(&bad, 7, 2).unwrap_err().contains("stray"));
        // A header with bytes after it that it does not announce.
        let mut long = b.to_vec();
        long.extend_from_slice(&[1, 2, 3]);
        assert!(Header::decode(&long, 7, 2)
            .unwrap_err()
            .contains("followed by 3 bytes"));
    }

    #[test]
    fn inline_headers_carry_exactly_their_message() {
        let h = Header {
            number: 0,
            size: 5,
            first: 0,
            inline: true,
        };
        let mut b = h.encode().to_vec();
        b.extend_from_slice(b"hello");
        assert_eq!(Header::decode(&b, 0, 2), Ok(h));
        assert!(Header::decode(&b[..HEADER_LEN + 4], 0, 2)
            .unwrap_err()
            .contains("inline 5-byte message followed by 4 bytes"));
    }
}
