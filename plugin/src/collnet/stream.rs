//! A stream of chunks over one net comm: what is posted, what is in flight, and pumping it.

use super::*;

/// One chunk of a transfer: where, how long, and its request while posted.
#[derive(Debug, Clone, Copy)]
pub(super) struct Chunk {
    pub(super) off: usize,
    pub(super) len: usize,
}

/// A transfer stream to or from one peer in one phase: its chunks, the next
/// to post, and the requests in flight (chunk index, request).
#[derive(Debug, Default)]
pub(super) struct Stream {
    pub(super) next: usize,
    pub(super) done: Vec<bool>,
    pub(super) inflight: Vec<(usize, Request)>,
}

impl Stream {
    pub(super) fn new(chunks: usize) -> Self {
        Self {
            next: 0,
            done: vec![false; chunks],
            inflight: Vec::new(),
        }
    }
    pub(super) fn finished(&self) -> bool {
        self.done.iter().all(|&d| d)
    }
    /// Tests what is in flight; marks what completed and adds its bytes
    /// (`chunks` are the stream's) to `count`.
    pub(super) fn test(&mut self, chunks: &[Chunk], count: &AtomicU64) -> Result<()> {
        let mut i = 0;
        while i < self.inflight.len() {
            let (c, q) = self.inflight[i];
            if q.test()?.is_some() {
                self.done[c] = true;
                count.fetch_add(chunks[c].len as u64, Ordering::Relaxed);
                self.inflight.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }
}

/// Posts stream `s`'s next chunks, in order, while its window has room
/// and `may(chunk)` allows; `post` returns the request, or `None` when the
/// comm cannot take it now.
pub(super) fn pump(
    s: &mut Stream,
    may: impl Fn(usize) -> bool,
    mut post: impl FnMut(usize) -> Result<Option<Request>>,
) -> Result<()> {
    while s.inflight.len() < WINDOW && s.next < s.done.len() && may(s.next) {
        let Some(q) = post(s.next)? else { break };
        s.inflight.push((s.next, q));
        s.next += 1;
    }
    Ok(())
}

/// Sends `len` bytes at `addr` (registered with `mh`) on `comm`.
///
/// # Safety
/// The range is registered with `mh` and stays valid until the request is done.
pub(crate) unsafe fn send(
    comm: Option<&SendComm>,
    addr: usize,
    len: usize,
    tag: i32,
    mh: Option<&MemHandle>,
) -> Result<Option<Request>> {
    let (comm, mh) = both(comm, mh, "send")?;
    // SAFETY: the caller's contract.
    unsafe { comm.isend(addr as *mut c_void, len, tag, mh) }
}

/// Receives `len` bytes on `comm` into `addr` (registered with `mh`).
///
/// # Safety
/// As for [`send`], and the range is writable.
pub(crate) unsafe fn recv(
    comm: Option<&RecvComm>,
    addr: usize,
    len: usize,
    tag: i32,
    mh: Option<&MemHandle>,
) -> Result<Option<Request>> {
    let (comm, mh) = both(comm, mh, "receive")?;
    // SAFETY: the caller's contract.
    unsafe { comm.irecv(addr as *mut c_void, len, tag, mh) }
}

/// The comm and the memory handle of a transfer, which a group has for
/// every peer it moves bytes with (a comm per peer, and a registration once
/// it has any comm).
fn both<'a, C>(
    comm: Option<&'a C>,
    mh: Option<&'a MemHandle>,
    what: &str,
) -> Result<(&'a C, &'a MemHandle)> {
    comm.zip(mh).ok_or_else(|| {
        Error::internal(format!(
            "CollNet: a {what} with no comm or no memory handle (the group has no such peer)"
        ))
    })
}
