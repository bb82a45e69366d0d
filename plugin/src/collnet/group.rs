//! Building a CollNet group: listen, the full mesh of comms (and the reducers), close.

use super::*;

/// `listen(dev)` on context `ctx`: the core listener, whose handle is the
/// CollNet handle.
pub fn listen(ctx: *mut c_void, dev: i32, handle: &mut [u8; HANDLE_SIZE]) -> Result<*mut c_void> {
    let ctx = Context::of(ctx)?;
    let listen = ctx.listen(dev, handle)?;
    Ok(LISTENS.insert(Arc::new(CollListen { ctx, dev, listen })))
}

/// `closeListen`.
pub fn close_listen(l: *mut c_void) -> Result<()> {
    // The core listener closes with the last holder (a connect may still
    // be using it).
    LISTENS.remove(l).map(drop).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet closeListen: {l:p} is not a live listen comm"
        ))
    })
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
/// is still here when it is dropped (a failed `connect`) is closed, and the
/// registration goes before the arena (fields drop in order).
#[derive(Debug)]
pub(super) struct Building {
    /// Send comm per rank (none: not yet, or this rank) and per reducer.
    pub(super) send: Vec<Option<SendComm>>,
    pub(super) rsend: Vec<Option<SendComm>>,
    pub(super) accepted: Vec<RecvComm>,
    pub(super) mh: Option<MemHandle>,
    /// My greeting (8 bytes), the joins (one per reducer), then room for
    /// one greeting per accepted comm; registered once a comm exists.
    pub(super) arena: Vec<u8>,
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
        send: (0..n).map(|_| None).collect(),
        rsend: (0..m).map(|_| None).collect(),
        accepted: Vec::new(),
        mh: None,
        arena: vec![0; theirs_at + peers * GREETING_LEN],
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
    let mut reqs: Vec<Request> = Vec::new();
    let mut last_progress = Instant::now();
    loop {
        let mut progressed = false;
        for (j, h) in hs.iter_mut().enumerate() {
            if j != rank && b.send[j].is_none() {
                b.send[j] = l.ctx.connect(l.dev, None, h)?;
                progressed |= b.send[j].is_some();
            }
        }
        for (k, h) in rh.iter_mut().enumerate() {
            if b.rsend[k].is_none() {
                b.rsend[k] = l
                    .ctx
                    .connect(l.dev, None, h)
                    .map_err(|e| e.context(format!("CollNet connect: reducer {k} of {m}")))?;
                progressed |= b.rsend[k].is_some();
            }
        }
        while b.accepted.len() < peers {
            match l.listen.accept()? {
                Some(r) => {
                    b.accepted.push(r);
                    progressed = true;
                }
                None => break,
            }
        }
        if b.mh.is_none() {
            let len = b.arena.len();
            let through = b.send.iter().chain(&b.rsend).flatten().next();
            b.mh = match (through, b.accepted.first()) {
                (Some(s), _) => Some(s.reg_mr(base as *mut c_void, len, props::PTR_HOST)?),
                (None, Some(r)) => Some(r.reg_mr(base as *mut c_void, len, props::PTR_HOST)?),
                (None, None) => None,
            };
        }
        if b.mh.is_some() {
            for (j, posted) in out.iter_mut().enumerate() {
                let (comm, at, len) = if j < n {
                    (&b.send[j], 0, GREETING_LEN)
                } else {
                    (&b.rsend[j - n], join_at + (j - n) * Join::LEN, Join::LEN)
                };
                if *posted || comm.is_none() {
                    continue;
                }
                let mh = b.mh.as_ref();
                // SAFETY: `len` bytes of the registered arena, kept until
                // the requests are done (or their comms closed).
                if let Some(q) = unsafe { send(comm.as_ref(), base + at, len, HELLO_TAG, mh) }? {
                    *posted = true;
                    reqs.push(q);
                }
            }
            for (i, r) in b.accepted.iter().enumerate() {
                if inn[i] {
                    continue;
                }
                let at = theirs_at + i * GREETING_LEN;
                let mh = b.mh.as_ref();
                // SAFETY: as above, this comm's own greeting slot.
                if let Some(q) = unsafe { recv(Some(r), base + at, GREETING_LEN, HELLO_TAG, mh) }? {
                    inn[i] = true;
                    reqs.push(q);
                }
            }
        }
        let before = reqs.len();
        let mut i = 0;
        while i < reqs.len() {
            if reqs[i].test()?.is_some() {
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
            let missing: Vec<usize> = (0..n)
                .filter(|&j| j != rank && b.send[j].is_none())
                .collect();
            let reducers: Vec<usize> = (0..m).filter(|&k| b.rsend[k].is_none()).collect();
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
    let mut recv: Vec<Option<RecvComm>> = (0..n).map(|_| None).collect();
    let mut rrecv: Vec<Option<RecvComm>> = (0..m).map(|_| None).collect();
    for (i, c) in std::mem::take(&mut b.accepted).into_iter().enumerate() {
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
            Some(s) if s.is_none() => *s = Some(c),
            _ => {
                return Err(Error::remote(format!(
                    "CollNet connect: rank {rank} of {n}: a peer greeted as {v:#x}: not a rank or reducer of this group, or twice"
                )))
            }
        }
    }
    // Every greeting named a distinct slot, and there are as many as slots.
    let reducers = std::mem::take(&mut b.rsend)
        .into_iter()
        .zip(rrecv)
        .map(|(s, r)| s.zip(r))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Error::internal("CollNet connect: a reducer without both comms"))?;
    let links = Links {
        send: std::mem::take(&mut b.send),
        recv,
        reducers,
    };
    drop(b);
    Ok(COMMS.insert(Arc::new(CollComm {
        rank,
        nranks: n,
        dev: l.dev,
        nreducers: m,
        links: Mutex::new(Some(Arc::new(links))),
        seq: Mutex::new(0),
        header_turn: AtomicU32::new(0),
        header_lost: AtomicBool::new(false),
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
    /// The group's comms; an error once `closeColl` took them.
    pub(super) fn links(&self) -> Result<Arc<Links>> {
        let l = self.links.lock().unwrap_or_else(|e| e.into_inner());
        l.clone()
            .ok_or_else(|| Error::bad_handle("CollNet: the group is closed (closeColl)"))
    }

    /// Registers host memory through one of the group's send comms; `None`
    /// for a group of one (it has no comm, and moves nothing).
    pub(super) fn reg_mr(&self, data: *mut c_void, len: usize) -> Result<Option<MemHandle>> {
        let l = self.links()?;
        let reducers = l.reducers.iter().map(|r| &r.0);
        match l.send.iter().flatten().chain(reducers).next() {
            Some(s) => Ok(Some(s.reg_mr(data, len, props::PTR_HOST)?)),
            None => Ok(None),
        }
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
        let mh = self.reg_mr(buf.as_mut_ptr().cast(), len)?;
        Ok(Scratch { mh, buf })
    }

    /// Tells every reducer this rank closes the group (a header with `bye`),
    /// so that the reducer ends it between operations rather than finding
    /// its comms closed; waits up to the peer timeout for the sends. Best
    /// effort: a reducer that is gone is only logged.
    pub(super) fn bye(&self) {
        let m = self.nreducers;
        let Ok(l) = self.links() else { return };
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
        let mut q: Vec<Option<Request>> = vec![None; m];
        let mut left: Vec<usize> = (0..m).collect();
        let at = s.buf.as_ptr() as usize;
        while !left.is_empty() && Instant::now() < deadline {
            left.retain(|&k| {
                let mut step = || -> Result<bool> {
                    if q[k].is_none() {
                        let c = Some(&l.reducers[k].0);
                        let mh = s.mh.as_ref();
                        // SAFETY: header k of the registered scratch, kept
                        // until the request ends (or the deadline leaks it).
                        q[k] =
                            unsafe { send(c, at + k * Header::LEN, Header::LEN, HEADER_TAG, mh) }?;
                    }
                    Ok(match q[k] {
                        Some(r) => r.test()?.is_some(),
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
            // Deregistered, then freed.
            drop(old);
        }
    }
}

/// `closeColl`: says goodbye to the reducers, closes the group's comms
/// (once no step of a request holds them) and frees its scratch buffers.
pub fn close_coll(c: *mut c_void) -> Result<()> {
    let g = COMMS.remove(c).ok_or_else(|| {
        Error::bad_handle(format!(
            "CollNet closeColl: {c:p} is not a live collective comm"
        ))
    })?;
    g.bye();
    drop(std::mem::take(
        &mut *g.pool.lock().unwrap_or_else(|e| e.into_inner()),
    ));
    let links = g.links.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(links);
    Ok(())
}
