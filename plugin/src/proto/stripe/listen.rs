//! Listening on a virtual device: one listener per rail, accepted rail by rail.

#![forbid(unsafe_code)]

use super::*;

pub(super) struct ListenState {
    pub(super) got: Vec<Option<Arc<dyn Receiver>>>,
    pub(super) handed: bool,
}

/// A listener on a virtual device: one member listener per rail. It
/// accepts one connection (NCCL listens once per connection); a further
/// one is closed at once with a WARN, so its sender fails instead of
/// pairing rails of two peers.
pub struct StripedListen {
    pub(super) rails: Vec<Arc<dyn Listener>>,
    pub(super) stripe: usize,
    /// Its comm speaks the striping protocol (else, on one rail, it is the
    /// rail's own comm).
    pub(super) striped: bool,
    pub(super) st: Mutex<ListenState>,
}

impl std::fmt::Debug for StripedListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StripedListen({} rails)", self.rails.len())
    }
}

impl StripedListen {
    /// A listener over `rails` (rail order = the virtual device's);
    /// `striped`: its comm speaks the striping protocol, else (one rail) it
    /// is the rail's own comm.
    pub fn new(rails: Vec<Arc<dyn Listener>>, stripe: usize, striped: bool) -> Self {
        let got = vec![None; rails.len()];
        Self {
            rails,
            stripe,
            striped,
            st: Mutex::new(ListenState { got, handed: false }),
        }
    }
}

impl Listener for StripedListen {
    fn accept(&self) -> Result<Option<Arc<dyn Receiver>>> {
        // Never wait for the keeper (it moves the comm on in the background).
        let Some(mut st) = try_lock(&self.st) else {
            return Ok(None);
        };
        for (r, l) in self.rails.iter().enumerate() {
            let Some(c) = l.accept().map_err(on_rail(r))? else {
                continue;
            };
            if st.handed || st.got[r].is_some() {
                tracing::warn!(
                    "listener on a virtual device: closed a second connection on rail {r} from {}: a virtual device's listen comm takes one connection",
                    c.peer_name()
                );
                continue;
            }
            st.got[r] = Some(c);
        }
        if st.handed || st.got.iter().any(Option::is_none) {
            return Ok(None);
        }
        st.handed = true;
        let mut rails: Vec<_> = st.got.iter_mut().map(|c| c.take().expect("all")).collect();
        if !self.striped {
            return Ok(rails.pop());
        }
        Ok(Some(Arc::new(StripedRecv::new(rails, self.stripe)?)))
    }

    fn tend(&self, now: Instant) {
        for l in &self.rails {
            l.tend(now);
        }
        // Rails accepted before the others say Alive like the rest.
        if let Some(st) = try_lock(&self.st) {
            for c in st.got.iter().flatten() {
                c.keepalive(now);
            }
        }
    }
}
