//! Building a CollNet group: listen, the full mesh of comms (and the reducers), close.

use super::*;

/// `listen(dev)` on context `ctx`: the core listener, whose handle is the
/// CollNet handle.
pub fn listen(ctx: *mut c_void, dev: i32, handle: &mut [u8; HANDLE_SIZE]) -> Result<*mut c_void> {
    let l = core::listen(ctx, dev, handle)?;
    Ok(LISTENS.insert(Arc::new(CollListen {
        ctx: ctx as usize,
        dev,
        listen: l as usize,
    })))
}

/// `closeListen`.
pub fn close_listen(l: *mut c_void) -> Result<()> {
    let l = LISTENS.remove(l).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet closeListen: {l:p} is not a live listen comm"
        ))
    })?;
    core::close_listen(p(l.listen))
}

/// `connect(handles, rank, listenComm)`: builds the group; returns once
/// every rank, and every reducer `WEFT_COLLNET_REDUCERS` names, is
/// connected both ways.
pub fn connect(
    handles: &[[u8; HANDLE_SIZE]],
    rank: usize,
    listen: *mut c_void,
) -> Result<*mut c_void> {
    let reducers = reducer_handles()?;
    connect_with(handles, rank, listen, &reducers)
}

/// The reducers' handles, as `WEFT_COLLNET_REDUCERS` names them.
pub(super) fn reducer_handles() -> Result<Vec<[u8; HANDLE_SIZE]>> {
    core::collnet_reducers()?
        .iter()
        .map(|r| match r {
            ReducerRef::Handle(h) => Ok(*h),
            ReducerRef::File(path) => {
                let f = path.display();
                let text = std::fs::read_to_string(path).map_err(|e| {
                    Error::usage(format!(
                        "WEFT_COLLNET_REDUCERS: cannot read {f}: {e}; start `weft-reducer --handle-file {f}` first, or fix the list"
                    ))
                })?;
                crate::nccl::handle_from_hex(&text).ok_or_else(|| {
                    Error::usage(format!(
                        "WEFT_COLLNET_REDUCERS: {f} holds no reducer handle ({} hex digits, as `weft-reducer --handle-file` writes)",
                        2 * HANDLE_SIZE
                    ))
                })
            }
        })
        .collect()
}

/// A group being built: the comms so far and the greetings' buffer. What
/// is still here when it is dropped (a failed `connect`) is closed.
#[derive(Debug)]
pub(super) struct Building {
    /// Send comm per rank (0: not yet, or this rank) and per reducer.
    pub(super) send: Vec<usize>,
    pub(super) rsend: Vec<usize>,
    pub(super) accepted: Vec<usize>,
    /// My greeting (8 bytes), the joins (one per reducer), then room for
    /// one greeting per accepted comm; registered once a comm exists.
    pub(super) arena: Vec<u8>,
    pub(super) mh: usize,
}

impl Drop for Building {
    fn drop(&mut self) {
        for &s in self.send.iter().chain(&self.rsend).filter(|&&s| s != 0) {
            let _ = core::close_send(p(s));
        }
        for &r in &self.accepted {
            let _ = core::close_recv(p(r));
        }
        if self.mh != 0 {
            let _ = core::dereg_mr(std::ptr::null_mut(), p(self.mh));
        }
    }
}

/// [`connect`] with the reducers given (tests run reducers in-process).
///
/// Every comm opens with a greeting that says whose it is: each rank sends
/// its rank on its send comm to every other rank, and a [`wire::Join`] to
/// every reducer; a reducer connects back once all the group's ranks
/// joined and greets with [`wire::REDUCER_BIT`] and its index. `connect`
/// gives up when nothing progresses for `WEFT_PEER_TIMEOUT`.
pub fn connect_with(
    handles: &[[u8; HANDLE_SIZE]],
    rank: usize,
    listen: *mut c_void,
    reducers: &[[u8; HANDLE_SIZE]],
) -> Result<*mut c_void> {
    let l = LISTENS.get(listen).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet connect: {listen:p} is not a live listen comm"
        ))
    })?;
    let (n, m) = (handles.len(), reducers.len());
    if rank >= n || n > wire::MAX_RANKS as usize {
        return Err(Error::internal(format!(
            "CollNet connect: rank {rank} of a group of {n}"
        )));
    }
    if m > wire::MAX_REDUCERS as usize {
        return Err(Error::usage(format!(
            "WEFT_COLLNET_REDUCERS names {m} reducers; at most {}",
            wire::MAX_REDUCERS
        )));
    }
    let timeout = core::peer_timeout()?;
    let key = wire::group_key(handles);
    let peers = n - 1 + m;
    let join_at = GREETING_LEN;
    let theirs_at = join_at + m * Join::LEN;
    let mut b = Building {
        send: vec![0; n],
        rsend: vec![0; m],
        accepted: Vec::new(),
        arena: vec![0; theirs_at + peers * GREETING_LEN],
        mh: 0,
    };
    b.arena[..GREETING_LEN].copy_from_slice(&(rank as u64).to_le_bytes());
    for k in 0..m {
        let j = Join {
            key,
            rank: rank as u32,
            nranks: n as u32,
            index: k as u32,
            nreducers: m as u32,
            handle: handles[rank],
        };
        b.arena[join_at + k * Join::LEN..][..Join::LEN].copy_from_slice(&j.encode());
    }
    let base = b.arena.as_mut_ptr() as usize;
    let mut hs: Vec<[u8; HANDLE_SIZE]> = handles.to_vec();
    let mut rh: Vec<[u8; HANDLE_SIZE]> = reducers.to_vec();
    // Greetings out (per rank, then per reducer) and in (per accepted comm).
    let mut out = vec![false; n + m];
    out[rank] = true;
    let mut inn = vec![false; peers];
    let mut reqs: Vec<usize> = Vec::new();
    let mut last_progress = Instant::now();
    loop {
        let mut progressed = false;
        for (j, h) in hs.iter_mut().enumerate() {
            if j != rank && b.send[j] == 0 {
                if let Some(s) = core::connect(p(l.ctx), l.dev, None, h)? {
                    b.send[j] = s as usize;
                    progressed = true;
                }
            }
        }
        for (k, h) in rh.iter_mut().enumerate() {
            if b.rsend[k] == 0 {
                let s = core::connect(p(l.ctx), l.dev, None, h)
                    .map_err(|e| e.context(format!("CollNet connect: reducer {k} of {m}")))?;
                if let Some(s) = s {
                    b.rsend[k] = s as usize;
                    progressed = true;
                }
            }
        }
        while b.accepted.len() < peers {
            match core::accept(p(l.listen))? {
                Some(r) => {
                    b.accepted.push(r as usize);
                    progressed = true;
                }
                None => break,
            }
        }
        if b.mh == 0 {
            let any = b.send.iter().chain(&b.rsend).chain(&b.accepted);
            if let Some(&c) = any.into_iter().find(|&&c| c != 0) {
                b.mh = core::reg_mr(p(c), p(base), b.arena.len(), props::PTR_HOST)? as usize;
            }
        }
        if b.mh != 0 {
            for (j, posted) in out.iter_mut().enumerate() {
                let (comm, at, len) = if j < n {
                    (b.send[j], 0, GREETING_LEN)
                } else {
                    (b.rsend[j - n], join_at + (j - n) * Join::LEN, Join::LEN)
                };
                if *posted || comm == 0 {
                    continue;
                }
                // SAFETY: `len` bytes of the registered arena, kept until
                // the requests are done (or their comms closed).
                if let Some(q) = unsafe { send(comm, base + at, len, HELLO_TAG, b.mh) }? {
                    *posted = true;
                    reqs.push(q as usize);
                }
            }
            for (i, &r) in b.accepted.iter().enumerate() {
                if inn[i] {
                    continue;
                }
                let at = theirs_at + i * GREETING_LEN;
                // SAFETY: as above, this comm's own greeting slot.
                if let Some(q) = unsafe { recv(r, base + at, GREETING_LEN, HELLO_TAG, b.mh) }? {
                    inn[i] = true;
                    reqs.push(q as usize);
                }
            }
        }
        let before = reqs.len();
        let mut i = 0;
        while i < reqs.len() {
            if core::test(p(reqs[i]))?.is_some() {
                reqs.swap_remove(i);
            } else {
                i += 1;
            }
        }
        progressed |= reqs.len() != before;
        if reqs.is_empty()
            && b.accepted.len() == peers
            && out.iter().all(|&o| o)
            && inn.iter().all(|&i| i)
        {
            break;
        }
        if progressed {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > timeout {
            let missing: Vec<usize> = (0..n).filter(|&j| j != rank && b.send[j] == 0).collect();
            let reducers: Vec<usize> = (0..m).filter(|&k| b.rsend[k] == 0).collect();
            return Err(Error::remote(format!(
                "CollNet connect: rank {rank} of {n}: no progress for {:.1} s (WEFT_PEER_TIMEOUT); \
                 not connected to ranks {missing:?} or reducers {reducers:?}; {} of {peers} comms accepted \
                 (a reducer connects back once every rank of the group has joined it), {} greetings in flight",
                timeout.as_secs_f64(),
                b.accepted.len(),
                reqs.len()
            )));
        }
        std::thread::yield_now();
    }
    // Whose is each accepted comm?
    let mut recv = vec![0usize; n];
    let mut rrecv = vec![0usize; m];
    for (i, &c) in b.accepted.iter().enumerate() {
        let at = theirs_at + i * GREETING_LEN;
        let v = u64::from_le_bytes(b.arena[at..at + 8].try_into().expect("8 bytes"));
        let slot = if v & wire::REDUCER_BIT != 0 {
            usize::try_from(v & !wire::REDUCER_BIT)
                .ok()
                .and_then(|k| rrecv.get_mut(k))
        } else {
            usize::try_from(v)
                .ok()
                .filter(|&j| j != rank)
                .and_then(|j| recv.get_mut(j))
        };
        match slot {
            Some(s) if *s == 0 => *s = c,
            _ => {
                return Err(Error::remote(format!(
                    "CollNet connect: rank {rank} of {n}: a peer greeted as {v:#x}: not a rank or reducer of this group, or twice"
                )))
            }
        }
    }
    b.accepted.clear();
    let send = std::mem::take(&mut b.send);
    let reducers = std::mem::take(&mut b.rsend)
        .into_iter()
        .zip(rrecv)
        .collect();
    drop(b);
    Ok(COMMS.insert(Arc::new(CollComm {
        rank,
        nranks: n,
        dev: l.dev,
        send,
        recv,
        reducers,
        seq: Mutex::new(0),
        live: AtomicUsize::new(0),
        sent: AtomicU64::new(0),
        received: AtomicU64::new(0),
        pool: Mutex::new(Vec::new()),
    })))
}

pub(super) fn comm(c: *mut c_void, call: &str) -> Result<Arc<CollComm>> {
    COMMS.get(c).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet {call}: {c:p} is not a live collective comm"
        ))
    })
}

impl CollComm {
    /// A comm to register memory through (any of the group's).
    pub(super) fn any(&self) -> Option<usize> {
        let reducers = self.reducers.iter().map(|r| r.0);
        self.send.iter().copied().chain(reducers).find(|&s| s != 0)
    }

    /// A registered scratch buffer of at least `len` bytes: the smallest
    /// kept one that is large enough, or a new one.
    pub(super) fn take_scratch(&self, len: usize) -> Result<Scratch> {
        if len == 0 {
            return Ok(Scratch::default());
        }
        {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            let fits = (0..pool.len()).filter(|&i| pool[i].buf.len() >= len);
            if let Some(i) = fits.min_by_key(|&i| pool[i].buf.len()) {
                return Ok(pool.swap_remove(i));
            }
        }
        let mut buf = vec![0u8; len];
        let mh = match self.any() {
            Some(any) => {
                core::reg_mr(p(any), buf.as_mut_ptr().cast(), len, props::PTR_HOST)? as usize
            }
            None => 0,
        };
        Ok(Scratch { buf, mh })
    }

    /// Tells every reducer this rank closes the group (a header with `bye`),
    /// so that the reducer ends it between operations rather than finding
    /// its comms closed; waits up to the peer timeout for the sends. Best
    /// effort: a reducer that is gone is only logged.
    pub(super) fn bye(&self) {
        let m = self.reducers.len();
        if m == 0 {
            return;
        }
        let mut s = match self.take_scratch(m * Header::LEN) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(target: "weft::collnet", "CollNet closeColl: no goodbye to the reducers: {e}");
                return;
            }
        };
        let bye = Header {
            bye: true,
            seq: 0,
            ty: DataType::U8,
            op: RedOp::Sum,
            total: 0,
            off: 0,
            len: 0,
            chunk: 1,
        };
        for k in 0..m {
            s.buf[k * Header::LEN..][..Header::LEN].copy_from_slice(&bye.encode());
        }
        let deadline = Instant::now() + core::peer_timeout().unwrap_or(Duration::from_secs(30));
        let mut q: Vec<Option<usize>> = vec![None; m];
        let mut left: Vec<usize> = (0..m).collect();
        let at = s.buf.as_ptr() as usize;
        while !left.is_empty() && Instant::now() < deadline {
            left.retain(|&k| {
                let mut step = || -> Result<bool> {
                    if q[k].is_none() {
                        let c = self.reducers[k].0;
                        // SAFETY: header k of the registered scratch, kept
                        // until the request ends (or the deadline leaks it).
                        q[k] = unsafe {
                            send(c, at + k * Header::LEN, Header::LEN, HEADER_TAG, s.mh)
                        }?
                        .map(|q| q as usize);
                    }
                    Ok(match q[k] {
                        Some(r) => core::test(p(r))?.is_some(),
                        None => false,
                    })
                };
                match step() {
                    Ok(done) => !done,
                    Err(e) => {
                        tracing::info!(target: "weft::collnet",
                            "CollNet closeColl: no goodbye to reducer {k} of {m}: {e}");
                        false
                    }
                }
            });
            std::thread::yield_now();
        }
        if left.is_empty() {
            self.give_back(s);
        } else {
            std::mem::forget(s);
            tracing::warn!(target: "weft::collnet",
                "CollNet closeColl: reducers {left:?} did not take this rank's goodbye within WEFT_PEER_TIMEOUT; closing anyway");
        }
    }

    /// Keeps `s` for a later operation (the smallest goes when too many are kept).
    pub(super) fn give_back(&self, s: Scratch) {
        if s.buf.is_empty() {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(s);
        if pool.len() > POOL {
            let i = (0..pool.len())
                .min_by_key(|&i| pool[i].buf.len())
                .expect("not empty");
            let old = pool.swap_remove(i);
            drop(pool);
            if old.mh != 0 {
                let _ = core::dereg_mr(std::ptr::null_mut(), p(old.mh));
            }
        }
    }
}

/// `closeColl`: says goodbye to the reducers, closes the group's comms.
pub fn close_coll(c: *mut c_void) -> Result<()> {
    let g = COMMS.remove(c).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet closeColl: {c:p} is not a live collective comm"
        ))
    })?;
    g.bye();
    let mut first = Ok(());
    for s in std::mem::take(&mut *g.pool.lock().unwrap_or_else(|e| e.into_inner())) {
        if s.mh != 0 {
            first = first.and(core::dereg_mr(std::ptr::null_mut(), p(s.mh)));
        }
    }
    let reducers = g.reducers.iter();
    for &s in g
        .send
        .iter()
        .chain(reducers.clone().map(|r| &r.0))
        .filter(|&&s| s != 0)
    {
        first = first.and(core::close_send(p(s)));
    }
    for &r in g
        .recv
        .iter()
        .chain(reducers.map(|r| &r.1))
        .filter(|&&r| r != 0)
    {
        first = first.and(core::close_recv(p(r)));
    }
    first
}
