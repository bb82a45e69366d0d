//! The target's ordering rule for one sender, without I/O: a signal is
//! applied only once every write its sender issued before it has landed,
//! and one sender's signals are applied in the order they came.
//!
//! Writes carry no sequence number (an immediate is 4 bytes on verbs and
//! EFA, and names the comm): the target counts them, and each signal
//! message carries how many writes its sender had issued to this target
//! when it sent it. Counting is enough because a signal waits for a
//! *number* of writes, not for particular ones: writes may land in any
//! order among themselves, and a signal may overtake them, as tcp and shm
//! allow (they order neither writes against messages nor writes among
//! themselves once cut into chunks).

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A signal waiting for its writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal {
    /// Writes the sender had issued to this target when it sent this.
    pub after: u64,
    /// The registration (by its number in the collComm) holding the value.
    pub seq: u32,
    /// The value's offset in it.
    pub off: u64,
    /// What to add.
    pub value: u64,
}

/// One sender's writes landed here and its signals not yet applied.
#[derive(Debug, Default)]
pub struct Arrivals {
    landed: u64,
    waiting: VecDeque<(Signal, Instant)>,
}

impl Arrivals {
    /// One of the sender's writes landed.
    pub fn landed(&mut self) {
        self.landed += 1;
    }

    /// One of the sender's signals arrived, `now`.
    pub fn signal(&mut self, s: Signal, now: Instant) {
        self.waiting.push_back((s, now));
    }

    /// The next signal that may be applied now, in the sender's order.
    pub fn ready(&mut self) -> Option<Signal> {
        match self.waiting.front() {
            Some((s, _)) if s.after <= self.landed => self.waiting.pop_front().map(|(s, _)| s),
            _ => None,
        }
    }

    /// Forgets the signals still waiting (their sender was declared dead:
    /// they will never be applied).
    pub fn forget(&mut self) -> usize {
        let n = self.waiting.len();
        self.waiting.clear();
        n
    }

    /// How long the oldest signal has waited for its writes at `now`, and
    /// how many it still lacks. A write the target's provider refused (a
    /// stale or forged key) never lands and is never reported to its
    /// sender on tcp or shm, so without this bound its sender's later
    /// signals would wait forever.
    pub fn stalled(&self, now: Instant) -> Option<(Duration, u64)> {
        self.waiting
            .front()
            .map(|(s, t)| (now.saturating_duration_since(*t), s.after - self.landed.min(s.after)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(after: u64, value: u64) -> Signal {
        Signal { after, seq: 0, off: 0, value }
    }

    impl Arrivals {
        fn signal_now(&mut self, s: Signal) {
            self.signal(s, Instant::now());
        }
        fn waiting(&self) -> usize {
            self.waiting.len()
        }
    }

    #[test]
    fn a_signal_held_for_a_write_that_never_lands_says_how_long_and_how_many() {
        let mut a = Arrivals::default();
        let t0 = Instant::now();
        assert_eq!(a.stalled(t0), None);
        a.landed();
        a.signal(sig(3, 1), t0);
        let (waited, lacking) = a.stalled(t0 + Duration::from_secs(5)).expect("held");
        assert_eq!((waited, lacking), (Duration::from_secs(5), 2));
        a.landed();
        a.landed();
        assert_eq!(a.ready().map(|s| s.value), Some(1));
        assert_eq!(a.stalled(t0 + Duration::from_secs(6)), None);
        a.signal(sig(9, 2), t0);
        assert_eq!(a.forget(), 1);
        assert_eq!(a.stalled(t0), None);
    }

    fn drain(a: &mut Arrivals) -> Vec<u64> {
        std::iter::from_fn(|| a.ready()).map(|s| s.value).collect()
    }

    #[test]
    fn a_signal_that_overtook_its_writes_waits_for_all_of_them() {
        let mut a = Arrivals::default();
        a.signal_now(sig(3, 1));
        assert_eq!(drain(&mut a), Vec::<u64>::new());
        a.landed();
        a.landed();
        assert_eq!(drain(&mut a), Vec::<u64>::new());
        a.landed();
        assert_eq!(drain(&mut a), vec![1]);
        assert_eq!(a.waiting(), 0);
    }

    #[test]
    fn signal_only_ops_apply_at_once_when_nothing_is_outstanding() {
        let mut a = Arrivals::default();
        a.signal_now(sig(0, 1000));
        assert_eq!(drain(&mut a), vec![1000]);
    }

    #[test]
    fn signals_keep_their_order_even_when_a_later_one_could_go() {
        // A signal-only op (after = 2) behind a put+signal (after = 5):
        // the later must not be applied before the earlier.
        let mut a = Arrivals::default();
        for _ in 0..2 {
            a.landed();
        }
        a.signal_now(sig(5, 1));
        a.signal_now(sig(5, 2));
        assert_eq!(drain(&mut a), Vec::<u64>::new());
        for _ in 0..3 {
            a.landed();
        }
        assert_eq!(drain(&mut a), vec![1, 2]);
    }

    #[test]
    fn writes_landing_before_their_signal_let_it_go_on_arrival() {
        let mut a = Arrivals::default();
        for _ in 0..32 {
            a.landed();
        }
        a.signal_now(sig(32, 7));
        a.signal_now(sig(33, 8));
        assert_eq!(drain(&mut a), vec![7]);
        a.landed();
        assert_eq!(drain(&mut a), vec![8]);
    }

    proptest::proptest! {
        /// Whatever order writes and signals arrive in, a signal is applied
        /// only after the writes issued before it, and signals in order.
        #[test]
        fn never_before_its_writes(events in proptest::collection::vec(proptest::bool::ANY, 0..200)) {
            // The sender's stream: true = a write, false = a signal after
            // the writes so far. The target sees all writes (in any
            // order, which counting cannot tell apart) and the signals in
            // order, interleaved by `events`' shuffle below.
            let mut issued = 0u64;
            let mut signals = VecDeque::new();
            let mut writes = 0u64;
            for &w in &events {
                if w { issued += 1; writes += 1; } else { signals.push_back(sig(issued, signals.len() as u64)); }
            }
            let mut a = Arrivals::default();
            let mut applied = Vec::new();
            let mut landed = 0u64;
            // Deliver signals first where possible (the worst case), writes after.
            for (i, s) in signals.iter().enumerate() {
                a.signal_now(*s);
                if i % 2 == 0 && landed < writes { a.landed(); landed += 1; }
                while let Some(s) = a.ready() {
                    proptest::prop_assert!(s.after <= landed);
                    applied.push(s.value);
                }
            }
            while landed < writes {
                a.landed();
                landed += 1;
                while let Some(s) = a.ready() {
                    proptest::prop_assert!(s.after <= landed);
                    applied.push(s.value);
                }
            }
            let want: Vec<u64> = (0..signals.len() as u64).collect();
            proptest::prop_assert_eq!(applied, want);
            proptest::prop_assert_eq!(a.waiting(), 0);
        }
    }
}
