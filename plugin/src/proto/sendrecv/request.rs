//! Requests: what a comm's pool holds per NCCL request, how completions
//! and failures land in it, and how `test` reports it.

use super::*;

/// What happened to one sub-operation that failed.
#[derive(Debug, Clone, Copy)]
pub(super) struct ReqErr {
    pub(super) fi_err: u32,
    pub(super) len: usize,
    pub(super) olen: usize,
    pub(super) tag: u64,
    pub(super) sub: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Send,
    Recv,
}

/// A request in a comm's pool; its address is the handle NCCL tests.
#[derive(Debug, Clone, Copy)]
pub(super) struct Request {
    pub(super) kind: Kind,
    pub(super) n: u8,
    pub(super) remaining: u8,
    pub(super) sizes: [usize; MAX_RECVS],
    pub(super) bufs: [RecvBuf; MAX_RECVS],
    pub(super) err: Option<ReqErr>,
}

pub(super) fn decode_ctx(ctx: *mut c_void) -> (*const u8, u8) {
    let a = ctx as usize;
    (
        (a & !(SLOT_ALIGN - 1)) as *const u8,
        (a & (SLOT_ALIGN - 1)) as u8,
    )
}

/// Turns a failed sub-operation into the error `test` reports.
pub(super) fn req_error(kind: Kind, e: ReqErr, capacity: usize, link: &Link) -> Error {
    let peer = &link.name;
    if e.fi_err == PEER_DEAD {
        return link.dead_error();
    }
    let what = if kind == Kind::Send {
        "send"
    } else {
        "receive"
    };
    if e.fi_err == fi::FI_ETRUNC {
        let tag = e.tag as u32 as i32;
        // Providers differ in what they report (shm gives no lengths).
        let sent = if e.olen > 0 {
            format!("{} bytes", e.len + e.olen)
        } else {
            "more bytes than fit".to_owned()
        };
        let msg = format!(
            "message truncated: the {peer} sent {sent} with tag {tag} into receive buffer {} of {capacity} bytes; \
             NCCL never sends more than the receiver posted, so both ranks must run the same NCCL",
            e.sub
        );
        tracing::warn!("{msg}");
        return Error::internal(msg);
    }
    let msg = format!(
        "{what} to/from peer {peer} failed: {} (fi errno {})",
        crate::fabric::strerror(e.fi_err),
        e.fi_err
    );
    tracing::warn!("{msg}");
    Error::remote(msg)
}

pub(super) fn completion_err(e: &CompletionError) -> ReqErr {
    ReqErr {
        fi_err: e.err,
        len: e.len,
        olen: e.olen,
        tag: e.tag,
        sub: 0,
    }
}

/// Applies one completion, or failure, to the request its context names.
/// `len` is recorded for receives (a send's size is known when it is posted).
pub(super) fn complete(
    reqs: &mut Pool<Request>,
    ctx: *mut c_void,
    outcome: std::result::Result<Option<usize>, ReqErr>,
    who: &str,
) -> Result<()> {
    let (slot, sub) = decode_ctx(ctx);
    let r = reqs
        .index_of(slot)
        .and_then(|i| reqs.get_mut(i))
        .filter(|r| sub < r.n)
        .ok_or_else(|| Error::system(format!("{who}: completion for an unknown request")))?;
    match outcome {
        Ok(Some(len)) => r.sizes[usize::from(sub)] = len,
        Ok(None) => {}
        Err(e) => {
            if r.err.is_none() {
                r.err = Some(ReqErr { sub, ..e });
            }
        }
    }
    r.remaining = r.remaining.saturating_sub(1);
    Ok(())
}

/// `test` through a comm's state lock: "not done" while another thread
/// holds it.
pub(super) fn test_locked<S: Side>(m: &Mutex<S>, id: ReqId) -> Result<Option<Done>> {
    match try_lock(m) {
        Some(mut st) => test_side(&mut *st, id),
        None => Ok(None),
    }
}

/// `test` on a comm of either side. The CQ is read only while the request
/// is unfinished (an injected send is done when posted; a receive may have
/// been completed by an earlier read), and never once the peer is dead.
pub(super) fn test_side<S: Side>(st: &mut S, id: ReqId) -> Result<Option<Done>> {
    let (_, reqs, link) = st.parts();
    let unfinished = test_request(reqs, id, S::KIND)?;
    if unfinished && link.dead.is_none() {
        st.progress()?;
    }
    let (_, reqs, link) = st.parts();
    finish(reqs, id.slot, link)
}

/// Checks that request `id` is live in `reqs` and of the slot's current
/// generation (a request NCCL still holds, not an earlier one of the same
/// slot); returns whether it is still unfinished.
pub(super) fn test_request(reqs: &mut Pool<Request>, id: ReqId, what: &str) -> Result<bool> {
    let current = reqs.is_current(id.slot, id.gen);
    reqs.get_mut(id.slot)
        .filter(|_| current)
        .map(|r| r.remaining > 0)
        .ok_or_else(|| {
            Error::internal(format!(
                "test: not a live {what} request (already completed and reported, or a stale pointer)"
            ))
        })
}

/// Completes request `i` if it is done: frees it and returns its sizes or error.
/// `i` was validated by `test_request`; progress never frees a request.
pub(super) fn finish(reqs: &mut Pool<Request>, i: u32, link: &Link) -> Result<Option<Done>> {
    let r = reqs
        .get_mut(i)
        .ok_or_else(|| Error::internal("test: the request was freed during progress"))?;
    if r.remaining > 0 {
        return Ok(None);
    }
    // Copy out only what the answer needs: a request is a few hundred bytes.
    let (kind, err, done) = (
        r.kind,
        r.err,
        Done {
            n: usize::from(r.n),
            sizes: r.sizes,
        },
    );
    let cap = err.map_or(0, |e| r.bufs[usize::from(e.sub) % MAX_RECVS].size);
    reqs.release(i);
    match err {
        Some(e) => Err(req_error(kind, e, cap, link)),
        None => Ok(Some(done)),
    }
}
