//! Both halves of the handshake's state, apart from any I/O (quinn's
//! style). The listener's book: which `Conn`s it takes, ignores or evicts,
//! what it remembers of accepted ones, and when `accept` reports a failure.
//! The connecting side: when its `Conn` is due (again), which `Ack` it takes,
//! and when it gives up. each protocol's listen and send comms drive them
//! with real comms and messages; the tests below with plain values.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Handshakes a listener keeps pending at once. NCCL connects one peer to
/// each listener; more are tolerated (a restart storm connects many at once,
/// and a pending handshake costs a receive comm of a few KiB). Beyond this a
/// new `Conn` evicts the oldest handshake whose Ack has not gone out yet;
/// one whose Ack went out is never evicted (its peer may already be sending:
/// it expires only if the peer does not confirm within two heartbeat
/// periods), so a new `Conn` finding only those is refused, and its connect
/// repeats it until there is room. So forged `Conn`s cannot grow a listener,
/// nor break a connection it acknowledged, and they hold a slot for at most
/// two heartbeat periods each.
pub const MAX_PENDING: usize = 64;
/// Connection nonces a listener remembers as accepted (a late repeat of their
/// `Conn` is ignored).
pub(crate) const ACCEPTED_MEMORY: usize = 16;

/// A random 64-bit nonce from the kernel.
pub(crate) fn nonce() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        // Fall back on time and address entropy; nonces only need to differ.
        let t = Instant::now().elapsed().as_nanos() as u64 ^ (std::process::id() as u64) << 32;
        return t ^ (&b as *const _ as u64);
    }
    u64::from_le_bytes(b)
}

/// One handshake in progress: the comm being set up for it (`T`), the
/// connecting side's nonce, its Ack (`A`), and its deadlines.
#[derive(Debug)]
pub(crate) struct Pending<T, A> {
    pub(crate) comm: T,
    pub(crate) conn: u64,
    pub(crate) ack: A,
    /// The Ack is to be sent: at first, and again after a repeated `Conn`
    /// (the connecting side did not get it: an Ack the provider took can
    /// still be lost, as a `Conn` can).
    pub(crate) due: bool,
    /// The Ack went out at least once: the handshake is never evicted.
    pub(crate) answered: bool,
    /// When it fails unconfirmed: its `limit`, or two heartbeat periods
    /// after the last Ack, whichever comes first.
    pub(crate) deadline: Instant,
    /// The latest it may end: the connecting side gives up by then.
    pub(crate) limit: Instant,
}

impl<T, A> Pending<T, A> {
    /// A handshake for `conn`, admitted at `now`, whose peer gives up after
    /// `timeout`.
    pub(crate) fn new(comm: T, conn: u64, ack: A, now: Instant, timeout: Duration) -> Self {
        Self {
            comm,
            conn,
            ack,
            due: true,
            answered: false,
            deadline: now + timeout,
            limit: now + timeout,
        }
    }
    /// The Ack went out at `now`: the peer confirms within `window` or not
    /// at all (unless it repeats its `Conn`).
    pub(crate) fn answered_at(&mut self, now: Instant, window: Duration) {
        self.due = false;
        self.answered = true;
        self.deadline = self.limit.min(now + window);
    }
}

/// What became of a pending handshake after one step.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Still waiting.
    Waiting,
    /// The peer confirmed: hand the comm to NCCL.
    Confirmed,
    /// It failed or expired, and why.
    Failed(String),
}

/// The book.
#[derive(Debug)]
pub(crate) struct Handshakes<T, A> {
    /// Oldest first.
    pending: Vec<Pending<T, A>>,
    /// Recently accepted connection nonces, oldest first.
    accepted: VecDeque<u64>,
    /// Why the last handshake failed, reported once nothing else is pending.
    failed: Option<String>,
    /// `Conn`s refused for want of room.
    refused: u64,
}

impl<T, A> Default for Handshakes<T, A> {
    fn default() -> Self {
        Self {
            pending: Vec::new(),
            accepted: VecDeque::new(),
            failed: None,
            refused: 0,
        }
    }
}

impl<T, A> Handshakes<T, A> {
    /// Whether a `Conn` with this nonce is already pending or was accepted
    /// (a repeat).
    #[cfg(test)]
    fn knows(&self, conn: u64) -> bool {
        self.pending.iter().any(|p| p.conn == conn) || self.accepted.contains(&conn)
    }

    /// A repeated `Conn` with this nonce: a pending handshake already
    /// answered is answered again (its connecting side never got the Ack);
    /// one accepted, or not answered yet, needs nothing. Whether it was
    /// known at all.
    pub(crate) fn repeated(&mut self, conn: u64) -> bool {
        if let Some(p) = self.pending.iter_mut().find(|p| p.conn == conn) {
            p.due |= p.answered;
            return true;
        }
        self.accepted.contains(&conn)
    }

    /// Whether no handshake is pending.
    pub(crate) fn idle(&self) -> bool {
        self.pending.is_empty()
    }

    /// Whether a new handshake can be taken: there is room, or one whose
    /// Ack has not gone out can make room.
    pub(crate) fn has_room(&self) -> bool {
        self.pending.len() < MAX_PENDING || self.pending.iter().any(|p| !p.answered)
    }

    /// Counts a `Conn` refused for want of room ([`Handshakes::has_room`]);
    /// the first of a listener, and every 1000th, is a WARN.
    pub(crate) fn refuse_logged(&mut self, dev: usize) {
        self.refused += 1;
        if self.refused % 1000 == 1 {
            tracing::warn!(
                "listener on device {dev}: {MAX_PENDING} handshakes pending, all answered; refused a new one ({} so far; a real connect repeats its request). NCCL connects one peer per listener: is something sending forged connection requests?",
                self.refused
            );
        }
    }

    /// Takes a new handshake: `Ok(None)`, or `Ok(Some(evicted))` when the
    /// oldest one not yet acknowledged made room; `Err(p)` (refused) when
    /// every pending one was acknowledged.
    pub(crate) fn admit(
        &mut self,
        p: Pending<T, A>,
    ) -> std::result::Result<Option<Pending<T, A>>, Pending<T, A>> {
        if self.pending.len() < MAX_PENDING {
            self.pending.push(p);
            return Ok(None);
        }
        let Some(i) = self.pending.iter().position(|q| !q.answered) else {
            return Err(p);
        };
        let evicted = self.pending.remove(i);
        self.pending.push(p);
        Ok(Some(evicted))
    }

    /// Steps every pending handshake with `step`, oldest first, until one is
    /// confirmed; returns its comm. Failed ones are dropped (and reported
    /// through `on_fail`) while the others go on. `Err` only when one failed
    /// and nothing else is pending: NCCL connects one peer per listener, so
    /// that peer died.
    pub(crate) fn step_all(
        &mut self,
        mut step: impl FnMut(&mut Pending<T, A>) -> Step,
        mut on_fail: impl FnMut(&str),
    ) -> std::result::Result<Option<T>, String> {
        let mut i = 0;
        while i < self.pending.len() {
            match step(&mut self.pending[i]) {
                Step::Waiting => i += 1,
                Step::Confirmed => {
                    let p = self.pending.remove(i);
                    self.accepted.push_back(p.conn);
                    if self.accepted.len() > ACCEPTED_MEMORY {
                        self.accepted.pop_front();
                    }
                    return Ok(Some(p.comm));
                }
                Step::Failed(why) => {
                    on_fail(&why);
                    self.pending.remove(i);
                    self.failed = Some(why);
                }
            }
        }
        match self.failed.take() {
            Some(why) if self.pending.is_empty() => Err(why),
            _ => Ok(None),
        }
    }
}

/// Where a connecting side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// `Conn` not sent yet.
    SendConn,
    /// `Conn` sent; waiting for the listener's `Ack`.
    AwaitAck,
    /// Connected: data may flow.
    Ready,
}

/// The connecting side's handshake.
#[derive(Debug)]
pub(crate) struct Connecting {
    phase: Phase,
    /// Our nonce; the `Ack` must echo it.
    conn: u64,
    /// When `Conn` was last sent.
    conn_sent: Option<Instant>,
    /// The wait before the next repeat: [`FIRST_RESEND`], doubling after
    /// each repeat up to `resend`.
    gap: Duration,
    /// `Conn` is repeated at most this far apart until the `Ack` comes.
    resend: Duration,
    deadline: Instant,
}

/// The first repeat of an unanswered `Conn`. A `Conn` the provider took
/// can still be lost (seen on tcp;ofi_rxm while its connection comes up):
/// repeating it soon, then less and less often, bounds the cost of a loss
/// to milliseconds without flooding a listener that is only slow.
pub(crate) const FIRST_RESEND: Duration = Duration::from_millis(20);

impl Connecting {
    /// A handshake with nonce `conn`, started at `now`, repeating `Conn`
    /// every `resend` and giving up after `timeout`.
    pub(crate) fn new(conn: u64, now: Instant, resend: Duration, timeout: Duration) -> Self {
        Self {
            phase: Phase::SendConn,
            conn,
            conn_sent: None,
            gap: FIRST_RESEND.min(resend),
            resend,
            deadline: now + timeout,
        }
    }
    /// Our nonce.
    pub(crate) fn conn(&self) -> u64 {
        self.conn
    }
    /// The phase.
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }
    /// Whether `Conn` should be sent now (first time, or again).
    pub(crate) fn conn_due(&self, now: Instant) -> bool {
        match self.phase {
            Phase::SendConn => true,
            Phase::AwaitAck => self
                .conn_sent
                .is_some_and(|t| now.saturating_duration_since(t) >= self.gap),
            Phase::Ready => false,
        }
    }
    /// `Conn` went out at `now`.
    pub(crate) fn conn_sent(&mut self, now: Instant) {
        if self.phase != Phase::Ready {
            if self.conn_sent.is_some() {
                self.gap = (self.gap * 2).min(self.resend);
            }
            self.phase = Phase::AwaitAck;
            self.conn_sent = Some(now);
        }
    }
    /// Whether an `Ack` echoing `conn` is the one awaited (else it is
    /// ignored: a stray, a repeat, or forged).
    pub(crate) fn takes_ack(&self, conn: u64) -> bool {
        self.phase == Phase::AwaitAck && conn == self.conn
    }
    /// The awaited `Ack` was taken: connected.
    pub(crate) fn connected(&mut self) {
        self.phase = Phase::Ready;
    }
    /// Whether it is past its deadline without being connected.
    pub(crate) fn expired(&self, now: Instant) -> bool {
        self.phase != Phase::Ready && now > self.deadline
    }
}

impl<T, A> Handshakes<T, A> {
    /// [`Handshakes::admit`], with the WARN an eviction or a refusal
    /// deserves.
    pub(crate) fn admit_logged(&mut self, p: Pending<T, A>, dev: usize) {
        match self.admit(p) {
            Ok(None) => {}
            Ok(Some(_)) => tracing::warn!(
                "listener on device {dev}: {MAX_PENDING} handshakes pending; dropped the oldest one not yet answered for a new one \
                 (NCCL connects one peer per listener: is something sending forged connection requests?)"
            ),
            Err(_) => self.refuse_logged(dev),
        }
    }
}

/// The WARN for a message at a listener that is not a Conn for it.
pub(crate) fn ignored_at_listener(
    dev: usize,
    msg: std::result::Result<super::wire::Ctrl, super::wire::CtrlError>,
) {
    match msg {
        Ok(super::wire::Ctrl::Conn { listener, .. }) => tracing::warn!(
            "listener on device {dev}: ignored a connection meant for listener {listener:#x} (stale handle?)"
        ),
        Ok(other) => tracing::warn!("listener: ignored unexpected control message {other:?}"),
        Err(e) => {
            tracing::warn!("listener on device {dev}: ignored a bad handshake message: {e}")
        }
    }
}

/// One `connect` step of either protocol, its I/O given as closures over
/// the comm's state `st`: sends the Conn when due (`send_conn`; "not now"
/// is no error), reads what came back (`progress`), and reports
/// `Ok(true)` once connected, or an error once `timeout` passed unanswered.
pub(crate) fn connect_step<S>(
    st: &mut S,
    connecting: impl Fn(&mut S) -> &mut Connecting,
    send_conn: impl FnOnce(&mut S) -> std::result::Result<(), crate::fabric::FiError>,
    progress: impl FnOnce(&mut S) -> crate::error::Result<()>,
    timeout: Duration,
) -> crate::error::Result<bool> {
    use crate::error::Error;
    let now = Instant::now();
    if connecting(st).conn_due(now) {
        match send_conn(st) {
            Ok(()) => connecting(st).conn_sent(now),
            Err(e) if e.is_again() => {}
            Err(e) => {
                return Err(Error::peer_dead(format!(
                    "connect: cannot reach the listener: {e}"
                )))
            }
        }
    }
    progress(st)?;
    if connecting(st).phase() == Phase::Ready {
        return Ok(true);
    }
    if connecting(st).expired(Instant::now()) {
        return Err(Error::peer_dead(format!(
            "connect: no answer from the listener within {:.1} s (WEFT_PEER_TIMEOUT): is the peer process alive and using the same Weft?",
            timeout.as_secs_f64()
        )));
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_is_repeated_until_the_right_ack_and_then_never() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut c = Connecting::new(42, t0, s, 8 * s);
        assert!(
            c.conn_due(t0) && !c.takes_ack(42),
            "no Ack before the Conn went out"
        );
        c.conn_sent(t0);
        assert_eq!(c.phase(), Phase::AwaitAck);
        // Repeated after 20 ms, then 40, 80, ... up to the period.
        let mut at = t0;
        let mut gap = FIRST_RESEND;
        while gap < s {
            assert!(
                !c.conn_due(at + gap - Duration::from_millis(1)),
                "not before {gap:?}"
            );
            assert!(c.conn_due(at + gap), "repeated after {gap:?}");
            at += gap;
            c.conn_sent(at);
            gap *= 2;
        }
        assert!(
            !c.conn_due(at + s / 2) && c.conn_due(at + s),
            "then every period"
        );
        c.conn_sent(t0 + s);
        assert!(!c.takes_ack(41), "another connect's Ack");
        assert!(c.takes_ack(42));
        c.connected();
        assert!(
            !c.conn_due(t0 + 3 * s) && !c.takes_ack(42),
            "a repeated Ack is ignored"
        );
        assert!(!c.expired(t0 + 100 * s), "a connected side never expires");
    }

    #[test]
    fn an_unanswered_connect_expires_at_its_deadline() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut c = Connecting::new(1, t0, s, 8 * s);
        c.conn_sent(t0);
        assert!(!c.expired(t0 + 8 * s) && c.expired(t0 + 8 * s + Duration::from_millis(1)));
    }

    fn p(conn: u64) -> Pending<u64, ()> {
        Pending::new(conn, conn, (), Instant::now(), Duration::ZERO)
    }

    #[test]
    fn a_flood_evicts_the_oldest_unanswered_and_stays_bounded() {
        let mut b = Handshakes::default();
        let mut evicted = Vec::new();
        let n = MAX_PENDING as u64 + 36;
        for c in 0..n {
            if let Ok(Some(e)) = b.admit(p(c)) {
                evicted.push(e.conn);
            }
        }
        assert_eq!(evicted, (0..36).collect::<Vec<_>>(), "oldest first");
        assert_eq!(b.pending.len(), MAX_PENDING);
        assert!(b.knows(n - 1) && !b.knows(0));
    }

    /// A handshake whose Ack went out is never evicted: with only those
    /// pending a new Conn is refused; once one is unanswered again (a new
    /// one admitted after others expired), only that one can go.
    #[test]
    fn an_answered_handshake_is_never_evicted() {
        let mut b = Handshakes::default();
        for c in 0..MAX_PENDING as u64 {
            b.admit(p(c)).unwrap();
        }
        for q in &mut b.pending {
            q.answered_at(Instant::now(), Duration::from_secs(1)); // every Ack went out
        }
        assert!(!b.has_room());
        assert_eq!(
            b.admit(p(1000)).map(|_| ()).map_err(|r| r.conn),
            Err(1000),
            "refused"
        );
        assert!(!b.knows(1000) && (0..MAX_PENDING as u64).all(|c| b.knows(c)));
        b.pending[5].answered = false;
        assert!(b.has_room());
        let e = b
            .admit(p(1001))
            .unwrap()
            .expect("evicts the unanswered one");
        assert_eq!(e.conn, 5);
        assert!((0..MAX_PENDING as u64)
            .filter(|&c| c != 5)
            .all(|c| b.knows(c)));
    }

    /// A repeated `Conn` makes the listener answer again, but only a
    /// handshake it answered already; the deadline after the new answer
    /// never passes the connecting side's own.
    #[test]
    fn a_repeated_conn_is_answered_again() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Handshakes::default();
        b.admit(Pending::new(1, 1, (), t0, 8 * s)).unwrap();
        b.admit(Pending::new(2, 2, (), t0, 8 * s)).unwrap();
        assert!(
            b.repeated(1) && b.pending[0].due,
            "not answered yet: due anyway"
        );
        b.pending[0].answered_at(t0, 2 * s);
        assert!(!b.pending[0].due && b.pending[0].deadline == t0 + 2 * s);
        assert!(b.repeated(1), "known");
        assert!(b.pending[0].due, "answered again");
        assert!(!b.pending[1].answered && b.pending[1].due);
        b.pending[0].answered_at(t0 + 7 * s, 2 * s);
        assert_eq!(b.pending[0].deadline, t0 + 8 * s, "never past the limit");
        assert!(!b.repeated(3), "an unknown Conn is a new one");
    }

    #[test]
    fn the_confirmed_one_is_returned_and_its_repeats_ignored() {
        let mut b = Handshakes::default();
        for c in [7, 8, 9] {
            b.admit(p(c)).unwrap();
        }
        let got = b.step_all(
            |p| {
                if p.conn == 8 {
                    Step::Confirmed
                } else {
                    Step::Waiting
                }
            },
            |_| {},
        );
        assert_eq!(got, Ok(Some(8)));
        assert!(b.knows(8), "a late repeat of an accepted Conn is ignored");
        assert!(b.repeated(8));
        assert_eq!(b.pending.len(), 2);
        for c in 100..100 + ACCEPTED_MEMORY as u64 {
            b.admit(p(c)).unwrap();
            let only_c = |p: &mut Pending<u64, ()>| {
                if p.conn == c {
                    Step::Confirmed
                } else {
                    Step::Waiting
                }
            };
            assert_eq!(b.step_all(only_c, |_| {}), Ok(Some(c)));
        }
        assert!(!b.knows(8), "accepted nonces are remembered only so long");
    }

    /// A failed handshake is skipped while another is pending (a forged one
    /// beside the real one), and reported once nothing else is pending.
    #[test]
    fn a_failure_is_reported_only_when_nothing_else_is_pending() {
        let mut b = Handshakes::default();
        b.admit(p(1)).unwrap(); // forged: fails
        b.admit(p(2)).unwrap(); // real: confirms on the second step
        let mut warned = Vec::new();
        let mut round = 0;
        let mut step = |p: &mut Pending<u64, ()>| match (p.conn, round) {
            (1, _) => Step::Failed("forged".to_owned()),
            (2, 0) => Step::Waiting,
            _ => Step::Confirmed,
        };
        assert_eq!(
            b.step_all(&mut step, |w| warned.push(w.to_owned())),
            Ok(None)
        );
        assert_eq!(warned, ["forged"]);
        round = 1;
        let mut step = |p: &mut Pending<u64, ()>| match (p.conn, round) {
            (2, 1) => Step::Confirmed,
            _ => Step::Waiting,
        };
        assert_eq!(b.step_all(&mut step, |_| {}), Ok(Some(2)));
        // The only handshake fails: an error.
        b.admit(p(3)).unwrap();
        let r = b.step_all(|_| Step::Failed("peer died".to_owned()), |_| {});
        assert_eq!(r, Err("peer died".to_owned()));
        assert_eq!(
            b.step_all(|_| Step::Waiting, |_| {}),
            Ok(None),
            "reported once"
        );
    }
}
