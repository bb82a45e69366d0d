//! Liveness: a comm's view of its peer, heartbeats from the keeper thread,
//! and declaring a silent or broken peer dead.

use super::*;

/// A comm's view of its peer: where it is and whether it still answers.
pub(super) struct Link {
    /// The peer.
    pub(super) peer: Peer,
    /// The peer's address in words, for log lines and errors.
    pub(super) name: String,
    /// Something arrived from the peer since the keeper last looked (set on
    /// the data path, where reading the clock would cost).
    pub(super) heard: bool,
    /// When the keeper last saw `heard` (or the link was made).
    pub(super) last_heard: Instant,
    /// When this end last sent `Alive` (None: due now).
    pub(super) last_said: Option<Instant>,
    /// Why the peer was declared dead.
    pub(super) dead: Option<String>,
}

impl Link {
    pub(super) fn new() -> Self {
        Self {
            peer: Peer::NONE,
            name: "(not connected)".to_owned(),
            heard: false,
            last_heard: Instant::now(),
            last_said: None,
            dead: None,
        }
    }

    /// Records the peer's endpoint name; its life is counted from now.
    pub(super) fn connect(
        &mut self,
        ep: &Endpoint,
        name: &[u8],
    ) -> std::result::Result<(), FiError> {
        self.peer = Peer::insert(ep, name)?;
        self.name = ep.av().straddr(name);
        self.last_heard = Instant::now();
        Ok(())
    }

    /// An error if the peer was declared dead.
    pub(super) fn check(&self) -> Result<()> {
        match &self.dead {
            Some(why) => Err(Error::remote(why.clone())),
            None => Ok(()),
        }
    }
}

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
    tracing::warn!(
        "{} {}: {why}; {failed} request(s) in flight failed, and the comm takes no new ones. \
         Check that process (its log, the OOM killer, the node); raise WEFT_PEER_TIMEOUT if it was only slow",
        S::WHAT,
        link.name
    );
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
    if link
        .last_said
        .is_none_or(|t| now.saturating_duration_since(t) >= period)
    {
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
    if std::mem::take(&mut link.heard) {
        link.last_heard = now;
    }
    let silent = now.saturating_duration_since(link.last_heard);
    if silent + period >= timeout {
        die(
            st,
            format!(
                "peer silent for {:.1} s (WEFT_PEER_TIMEOUT = {:.1} s): its process died, hangs, or the network is down",
                silent.as_secs_f64(),
                timeout.as_secs_f64()
            ),
        );
    }
}

/// Holds a comm's state lock until `release` fires (or its sender goes),
/// signalling `held` once it is held: what a keeper stuck inside the
/// provider does. For tests of the data path's independence.
pub(super) fn hold<S>(m: &Mutex<S>, held: &Tx<()>, release: &Rx<()>) {
    let _st = lock(m);
    let _ = held.send(());
    let _ = release.recv();
}

/// A heartbeat tick through a comm's state lock; skipped while busy.
pub(super) fn keepalive_locked<S: Side>(m: &Mutex<S>, timeout: Duration, now: Instant) {
    if let Some(mut st) = keeper_lock(m) {
        keepalive(&mut *st, timeout, now);
    }
}
