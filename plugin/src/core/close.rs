//! Closing comms: each close drops its comm in the calling thread once it holds the last reference.

#![forbid(unsafe_code)]

use super::*;

/// `closeSend`.
pub fn close_send(comm: *mut c_void) -> Result<()> {
    owned::close_token::<Sender>(comm).ok_or_else(|| {
        Error::bad_handle(format!("closeSend: {comm:p} is not a live Weft send comm"))
    })
}

/// `closeRecv`.
pub fn close_recv(comm: *mut c_void) -> Result<()> {
    owned::close_token::<Receiver>(comm).ok_or_else(|| {
        Error::bad_handle(format!(
            "closeRecv: {comm:p} is not a live Weft receive comm"
        ))
    })
}

/// `closeListen`.
pub fn close_listen(comm: *mut c_void) -> Result<()> {
    owned::close_token::<Listener>(comm).ok_or_else(|| {
        Error::bad_handle(format!(
            "closeListen: {comm:p} is not a live Weft listen comm"
        ))
    })
}

/// Closes connected comm `c`, taken out of its registry: its profiler
/// events end, and it is dropped here ([`last_ref`]).
pub(super) fn closed<C: proto::Comm + ?Sized>(c: Arc<Connected<C>>, call: &str) {
    c.events.stop_all();
    last_ref(c, call);
}

/// Drops a closed comm here, once nobody else holds it: its drop is the
/// close (it waits until the provider is done with NCCL's buffers), and
/// NCCL frees or reuses them as soon as the close returns. The keeper holds
/// a comm for the length of one heartbeat tick; if it let go of the last
/// reference after the close returned, the comm's waits ran in the keeper
/// while the provider still wrote into (or read from) memory NCCL had
/// freed (the soak: rxm crashed copying into a closed receive comm's
/// buffer). Bounded by `WEFT_PEER_TIMEOUT` (a keeper stuck inside the
/// provider), with a WARN.
pub(super) fn last_ref<C: proto::Comm + ?Sized>(c: Arc<Connected<C>>, what: &str) {
    let timeout = peer_timeout().unwrap_or(std::time::Duration::from_secs(30));
    let deadline = Instant::now() + timeout;
    while Arc::strong_count(&c) > 1 || Arc::strong_count(&c.comm) > 1 {
        if Instant::now() > deadline {
            tracing::warn!(
                "{what}: another thread still holds the comm after {timeout:?} (a keeper stuck in the provider?); it finishes closing there"
            );
            break;
        }
        std::thread::yield_now();
    }
    drop(c);
}
