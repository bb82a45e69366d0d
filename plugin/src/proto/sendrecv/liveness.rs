//! Liveness: heartbeats from the keeper thread, and declaring a silent or
//! broken peer dead.

use super::*;

/// The parts of a connected comm's state the liveness logic needs.
pub(super) trait Side {
    /// "send comm to" or "receive comm from", for log lines.
    const WHAT: &'static str;
    /// "send" or "receive", for errors about requests.
    const KIND: &'static str;
    /// True once the link has a peer.
    fn linked(&self) -> bool;
    /// The endpoint, requests and link, borrowed together.
    fn parts(&mut self) -> (&mut Endpoint, &mut Pool<Request>, &mut Link);
    /// Reads the CQ and applies what it holds.
    fn progress(&mut self) -> Result<()>;
}

/// Declares the peer dead: closes the comm's endpoint, then fails every
/// request in flight, and logs one WARN naming the peer.
///
/// The endpoint is closed first so that a request is reported failed only
/// when the provider owns none of its buffers any more: NCCL may free or
/// reuse them as soon as `test` says so. (Cancelling would not do: rxm cannot
/// cancel a send, and a send to a hung peer may never complete.)
pub(super) fn die<S: Side>(st: &mut S, why: String) {
    let (ep, reqs, link) = st.parts();
    if link.dead.is_some() {
        return;
    }
    ep.shutdown();
    let mut failed = 0;
    let live: Vec<u32> = reqs.live().collect();
    for i in live {
        let Some(r) = reqs.get_mut(i) else { continue };
        if r.remaining == 0 {
            continue;
        }
        if r.err.is_none() {
            r.err = Some(ReqErr {
                fi_err: PEER_DEAD,
                len: 0,
                olen: 0,
                tag: 0,
                sub: 0,
            });
        }
        r.remaining = 0;
        failed += 1;
    }
    warn_dead(S::WHAT, &link.name, &why, failed);
    link.dead = Some(why);
}

/// One heartbeat tick of a comm (from the keeper thread): says `Alive`
/// when due, makes progress, and declares the peer dead after
/// `timeout - period` of silence.
pub(super) fn keepalive<S: Side>(st: &mut S, timeout: Duration, now: Instant) {
    if !st.linked() {
        return;
    }
    let period = heartbeat_period(timeout);
    let (ep, _, link) = st.parts();
    if link.dead.is_some() {
        return;
    }
    if link.alive_due(now, period) {
        match send_ctrl(ep, &link.peer, &Ctrl::Alive) {
            Ok(()) => link.last_said = Some(now),
            Err(e) if e.is_again() => {}
            Err(e) => {
                return die(
                    st,
                    format!("the provider reports the connection to the peer broken ({e})"),
                )
            }
        }
    }
    if let Err(e) = st.progress() {
        return die(st, format!("progress failed: {e}"));
    }
    let (_, _, link) = st.parts();
    let silent = link.silence(now);
    if silent + period >= timeout {
        die(st, silent_peer(silent, timeout));
    }
}

/// A heartbeat tick through a comm's state lock; skipped while busy.
pub(super) fn keepalive_locked<S: Side>(m: &Mutex<S>, timeout: Duration, now: Instant) {
    if let Some(mut st) = keeper_lock(m) {
        keepalive(&mut *st, timeout, now);
    }
}
