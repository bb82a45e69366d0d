//! The collective engine: one request (`Coll`) of an all-reduce, all-gather or reduce-scatter, its shards and its phases.

use super::*;

/// What a collective does with the two phases (see the module's "All-reduce").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Both: reduce-scatter, then all-gather of the reduced shards.
    AllReduce,
    /// Phase 2 only: each rank's part to every rank.
    AllGather,
    /// Phase 1 only: each shard reduced at its owner.
    ReduceScatter,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all-reduce",
            Kind::AllGather => "all-gather",
            Kind::ReduceScatter => "reduce-scatter",
        }
    }
}

/// A collective in progress: its [`Spec`], the chunks and transfer
/// streams it derives, and its scratch.
#[derive(Debug)]
pub struct Coll {
    pub(super) g: Arc<CollComm>,
    pub(super) kind: Kind,
    /// What the caller asked: sizes, shards, buffers, handles.
    pub(super) s: Spec,
    /// Its sequence number in the group.
    pub(super) seq: u32,
    pub(super) tag: [i32; 2],
    pub(super) chunks: Vec<Vec<Chunk>>,
    pub(super) p1_send: Vec<Stream>,
    pub(super) p1_recv: Vec<Stream>,
    pub(super) p2_send: Vec<Stream>,
    pub(super) p2_recv: Vec<Stream>,
    /// Through reducers: phase 1 is `p1_send[k]` to reducer k, phase 2
    /// `p2_recv[k]` from it, and `hdr[k]` the header that opens the
    /// operation there (its bytes at the start of `scratch`).
    pub(super) served: bool,
    pub(super) hdr: Vec<Stream>,
    /// Chunks of my shard ready for phase 2 (reduced, or given).
    pub(super) ready: usize,
    /// The peers' contributions to my shard, one shard-sized slot per rank.
    pub(super) scratch: Scratch,
    /// The scratch may be reused: nothing of the provider's is left in it.
    pub(super) clean: bool,
}

/// What a collective is asked to do. Shards are byte ranges of the
/// operation's global buffer; the addresses say where each lives here.
#[derive(Debug)]
pub(super) struct Spec {
    pub(super) ty: DataType,
    pub(super) op: RedOp,
    /// Bytes `test` reports.
    pub(super) bytes: usize,
    pub(super) shards: Vec<(usize, usize)>,
    /// Phase 1: where shard j starts in my input (sent to rank j; mine is
    /// my own contribution), where my reduced shard goes, and the input's
    /// memory handle.
    pub(super) p1_src: Vec<usize>,
    pub(super) p1_out: usize,
    pub(super) smh: Option<Arc<MemHandle>>,
    /// Phase 2: where my shard starts (sent to every rank), where shard j
    /// lands, and the memory handles of both.
    pub(super) p2_src: usize,
    pub(super) p2_dst: Vec<usize>,
    pub(super) p2_src_mh: Option<Arc<MemHandle>>,
    pub(super) p2_dst_mh: Option<Arc<MemHandle>>,
    /// Phase 2 may overwrite bytes phase 1 still sends (all-reduce in place).
    pub(super) hazard: bool,
}

impl Coll {
    pub(super) fn start(g: Arc<CollComm>, kind: Kind, s: Spec) -> Result<*mut c_void> {
        let seq = {
            let mut q = g.seq.lock().unwrap_or_else(|e| e.into_inner());
            if g.live.load(Ordering::Relaxed) >= TAG_OPS as usize {
                return Err(Error::usage(format!(
                    "CollNet {}: {TAG_OPS} collectives already in flight on this group; test some to completion first",
                    kind.name()
                )));
            }
            let v = *q;
            *q = q.wrapping_add(1);
            v
        };
        let n = g.nranks;
        let me = g.rank;
        let ts = s.ty.size();
        let chunk = (CHUNK / ts).max(1) * ts;
        let chunks: Vec<Vec<Chunk>> = s
            .shards
            .iter()
            .map(|&(a, b)| {
                (a..b)
                    .step_by(chunk)
                    .map(|off| Chunk {
                        off,
                        len: chunk.min(b - off),
                    })
                    .collect()
            })
            .collect();
        if kind == Kind::AllReduce && g.nreducers > 0 {
            return Self::start_served(g, s, seq, chunk, chunks);
        }
        let reduce = kind != Kind::AllGather;
        let gather = kind != Kind::ReduceScatter;
        let my_len = s.shards[me].1 - s.shards[me].0;
        let scratch = if reduce && my_len > 0 {
            g.take_scratch(my_len * n + chunk.min(my_len))?
        } else {
            Scratch::default()
        };
        let streams = |on: bool, shard: &dyn Fn(usize) -> usize| -> Vec<Stream> {
            (0..n)
                .map(|j| {
                    Stream::new(if on && j != me {
                        chunks[shard(j)].len()
                    } else {
                        0
                    })
                })
                .collect()
        };
        let c = Coll {
            kind,
            seq,
            tag: op_tags(seq),
            served: false,
            hdr: Vec::new(),
            p1_send: streams(reduce, &|j| j),
            p1_recv: streams(reduce, &|_| me),
            p2_send: streams(gather, &|_| me),
            p2_recv: streams(gather, &|j| j),
            ready: if reduce { 0 } else { chunks[me].len() },
            chunks,
            s,
            scratch,
            clean: true,
            g,
        };
        if kind == Kind::AllGather && my_len > 0 && c.s.p2_src != c.s.p2_dst[me] {
            // SAFETY: my part, `my_len` bytes in NCCL's send buffer and in
            // its receive window (the caller checked both); they may overlap.
            unsafe { std::ptr::copy(c.s.p2_src as *const u8, c.s.p2_dst[me] as *mut u8, my_len) };
        }
        Ok(c.launch())
    }

    /// The request for `self`, counted in flight until dropped.
    pub(super) fn launch(self) -> *mut c_void {
        self.g.live.fetch_add(1, Ordering::Relaxed);
        REQS.insert(Arc::new(Mutex::new(self)))
    }

    /// An all-reduce through the group's reducers: `s.shards` are theirs.
    pub(super) fn start_served(
        g: Arc<CollComm>,
        s: Spec,
        seq: u32,
        chunk: usize,
        chunks: Vec<Vec<Chunk>>,
    ) -> Result<*mut c_void> {
        let m = g.nreducers;
        let mut scratch = g.take_scratch(m * Header::LEN)?;
        for (k, &(off, end)) in s.shards.iter().enumerate() {
            let h = Header {
                bye: false,
                seq,
                ty: s.ty,
                op: s.op,
                total: s.bytes as u64,
                off: off as u64,
                len: (end - off) as u64,
                chunk: chunk as u32,
            };
            scratch.buf[k * Header::LEN..][..Header::LEN].copy_from_slice(&h.encode());
        }
        let along = |k: usize| Stream::new(chunks[k].len());
        let c = Coll {
            kind: Kind::AllReduce,
            seq,
            tag: op_tags(seq),
            served: true,
            hdr: (0..m).map(|_| Stream::new(1)).collect(),
            p1_send: (0..m).map(along).collect(),
            p1_recv: Vec::new(),
            p2_send: Vec::new(),
            p2_recv: (0..m).map(along).collect(),
            ready: 0,
            chunks,
            s,
            scratch,
            clean: true,
            g,
        };
        Ok(c.launch())
    }

    /// One step through the reducers: the header, then the shard's chunks
    /// up to reducer k and its reduced chunks back into place (in place
    /// only once the same bytes went up).
    pub(super) fn step_served(&mut self) -> Result<bool> {
        let m = self.g.nreducers;
        let l = self.g.links()?;
        let (hdr, hmh) = (self.scratch.buf.as_ptr() as usize, self.scratch.mh.as_ref());
        let hazard = self.s.hazard;
        let turn = self.g.header_turn.load(Ordering::Acquire);
        if turn != self.seq && self.g.header_lost.load(Ordering::Acquire) {
            return Err(Error::remote(format!(
                "an earlier collective of this group (#{turn}) failed before it reached every reducer, \
                 so the reducers can no longer pair this one's parts; close the communicator"
            )));
        }
        let my_turn = turn == self.seq;
        for k in 0..m {
            let at = |e: Error| {
                e.context(format!(
                    "reducer {k} of {m} (if it ended the group, its log says why)"
                ))
            };
            let (up, down) = (Some(&l.reducers[k].0), Some(&l.reducers[k].1));
            let (g, t, ch, s) = (&self.g, self.tag, &self.chunks, &self.s);
            pump(
                &mut self.hdr[k],
                |_| my_turn,
                // SAFETY: header k in the registered scratch, kept until done.
                |_| unsafe { send(up, hdr + k * Header::LEN, Header::LEN, HEADER_TAG, hmh) },
            )
            .map_err(at)?;
            let (sk, src) = (s.shards[k].0, s.p1_src[k]);
            pump(
                &mut self.p1_send[k],
                |_| true,
                |c| {
                    let c = ch[k][c];
                    // SAFETY: chunk c of shard k of NCCL's input, registered with smh.
                    unsafe { send(up, src + (c.off - sk), c.len, t[0], s.smh.as_deref()) }
                },
            )
            .map_err(at)?;
            let (dst, sent) = (s.p2_dst[k], &self.p1_send[k]);
            pump(
                &mut self.p2_recv[k],
                |c| !hazard || sent.done[c],
                |c| {
                    let c = ch[k][c];
                    // SAFETY: chunk c of shard k's place in NCCL's output, registered.
                    unsafe {
                        recv(
                            down,
                            dst + (c.off - sk),
                            c.len,
                            t[1],
                            s.p2_dst_mh.as_deref(),
                        )
                    }
                },
            )
            .map_err(at)?;
            let whole = [Chunk {
                off: 0,
                len: Header::LEN,
            }];
            self.hdr[k].test(&whole, &AtomicU64::new(0)).map_err(at)?;
            self.p1_send[k].test(&ch[k], &g.sent).map_err(at)?;
            self.p2_recv[k].test(&ch[k], &g.received).map_err(at)?;
        }
        if my_turn && self.headers_posted() {
            // Every header of this operation is with the provider, in order
            // after the earlier operations': the next one's turn.
            self.g
                .header_turn
                .store(self.seq.wrapping_add(1), Ordering::Release);
        }
        Ok((0..m).all(|k| {
            self.hdr[k].finished() && self.p1_send[k].finished() && self.p2_recv[k].finished()
        }))
    }

    /// Every header of a served operation is posted.
    fn headers_posted(&self) -> bool {
        self.hdr.iter().all(|h| h.next == h.done.len())
    }

    /// One step: posts what may go, tests what is in flight, reduces what
    /// arrived. `true` once everything is done.
    pub(super) fn step(&mut self) -> Result<bool> {
        if self.served {
            return self.step_served();
        }
        let n = self.g.nranks;
        let me = self.g.rank;
        let my0 = self.s.shards[me].0;
        if n == 1 {
            if self.kind != Kind::AllGather {
                let len = self.s.shards[0].1 - self.s.shards[0].0;
                if len > 0 && self.s.p1_src[0] != self.s.p1_out {
                    // SAFETY: NCCL's buffers of `len` bytes each (checked by
                    // the caller); `copy` allows them to overlap.
                    unsafe {
                        std::ptr::copy(self.s.p1_src[0] as *const u8, self.s.p1_out as *mut u8, len)
                    };
                }
            }
            return Ok(true);
        }
        let l = self.g.links()?;
        let (scratch, scratch_mh) = (
            self.scratch.buf.as_mut_ptr() as usize,
            self.scratch.mh.as_ref(),
        );
        for j in (0..n).filter(|&j| j != me) {
            let at = |e: Error| e.context(format!("rank {j} of {n}"));
            let (g, t, ch) = (&self.g, self.tag, &self.chunks);
            // Phase 1: shard j of my input to rank j; rank j's copy of my
            // shard into its scratch slot.
            let (sj, src) = (self.s.shards[j].0, self.s.p1_src[j]);
            pump(
                &mut self.p1_send[j],
                |_| true,
                |k| {
                    let c = ch[j][k];
                    // SAFETY: chunk k of shard j of NCCL's input, registered with smh.
                    unsafe {
                        send(
                            l.send[j].as_ref(),
                            src + (c.off - sj),
                            c.len,
                            t[0],
                            self.s.smh.as_deref(),
                        )
                    }
                },
            )
            .map_err(at)?;
            let slot = scratch + j * (self.s.shards[me].1 - my0);
            pump(
                &mut self.p1_recv[j],
                |_| true,
                |k| {
                    let c = ch[me][k];
                    // SAFETY: rank j's slot of this request's registered scratch.
                    unsafe {
                        recv(
                            l.recv[j].as_ref(),
                            slot + (c.off - my0),
                            c.len,
                            t[0],
                            scratch_mh,
                        )
                    }
                },
            )
            .map_err(at)?;
            self.p1_send[j].test(&ch[j], &g.sent).map_err(at)?;
            self.p1_recv[j].test(&ch[me], &g.received).map_err(at)?;
        }
        // Reduce, in order, the chunks of my shard whose contributions are all in.
        if self.kind != Kind::AllGather {
            while self.ready < self.chunks[me].len()
                && (0..n).all(|j| j == me || self.p1_recv[j].done[self.ready])
            {
                self.reduce_chunk(self.ready);
                self.ready += 1;
            }
        }
        for j in (0..n).filter(|&j| j != me) {
            let at = |e: Error| e.context(format!("rank {j} of {n}"));
            let (g, t, ch) = (&self.g, self.tag, &self.chunks);
            // Phase 2: my ready chunks to rank j; rank j's chunks into their
            // place, in place only once my phase-1 send of those bytes is done.
            let ready = self.ready;
            pump(
                &mut self.p2_send[j],
                |k| k < ready,
                |k| {
                    let c = ch[me][k];
                    // SAFETY: chunk k of my part of NCCL's buffer, registered.
                    unsafe {
                        send(
                            l.send[j].as_ref(),
                            self.s.p2_src + (c.off - my0),
                            c.len,
                            t[1],
                            self.s.p2_src_mh.as_deref(),
                        )
                    }
                },
            )
            .map_err(at)?;
            let (sj, dst, sent) = (self.s.shards[j].0, self.s.p2_dst[j], &self.p1_send[j]);
            let hazard = self.s.hazard;
            pump(
                &mut self.p2_recv[j],
                |k| !hazard || sent.done[k],
                |k| {
                    let c = ch[j][k];
                    // SAFETY: chunk k of shard j's place in NCCL's output, registered.
                    unsafe {
                        recv(
                            l.recv[j].as_ref(),
                            dst + (c.off - sj),
                            c.len,
                            t[1],
                            self.s.p2_dst_mh.as_deref(),
                        )
                    }
                },
            )
            .map_err(at)?;
            self.p2_send[j].test(&ch[me], &g.sent).map_err(at)?;
            self.p2_recv[j].test(&ch[j], &g.received).map_err(at)?;
        }
        Ok(self.ready == self.chunks[me].len()
            && (0..n).all(|j| {
                self.p1_send[j].finished()
                    && self.p2_send[j].finished()
                    && self.p2_recv[j].finished()
            }))
    }

    /// Reduces chunk `c` of my shard over every rank's contribution, in
    /// rank order, into its output.
    pub(super) fn reduce_chunk(&mut self, c: usize) {
        let me = self.g.rank;
        let ch = self.chunks[me][c];
        let shard_len = self.s.shards[me].1 - self.s.shards[me].0;
        let rel = ch.off - self.s.shards[me].0;
        let own = self.s.p1_src[me] + rel;
        let contribution = |k: usize, scratch: &[u8]| -> *const u8 {
            if k == me {
                own as *const u8
            } else {
                scratch[k * shard_len + rel..].as_ptr()
            }
        };
        let out = self.s.p1_out + rel;
        let len = ch.len;
        // Where to reduce: straight into the output when it holds
        // contribution 0 already (in place at rank 0) or overlaps no input;
        // else aside, in the scratch's last chunk, then copied out.
        let seeded = out == own && me == 0;
        let direct = seeded || out + len <= own || own + len <= out;
        let at = self.g.nranks * shard_len;
        let dst = if direct {
            out as *mut u8
        } else {
            self.scratch.buf[at..at + len].as_mut_ptr()
        };
        if !seeded {
            // SAFETY: `dst` is `len` bytes that overlap no contribution (the
            // output, checked apart, or the scratch's tail, apart from every
            // slot); contribution 0 is `len` bytes of NCCL's input or scratch.
            unsafe { std::ptr::copy_nonoverlapping(contribution(0, &self.scratch.buf), dst, len) };
        }
        for k in 1..self.g.nranks {
            // SAFETY: as above; `dst` and contribution `k` do not overlap.
            let (d, src) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dst, len),
                    std::slice::from_raw_parts(contribution(k, &self.scratch.buf), len),
                )
            };
            reduce::reduce(self.s.ty, self.s.op, d, src);
        }
        if !direct {
            // SAFETY: the output chunk lies inside NCCL's output buffer (which
            // may be the input: the contributions were read above).
            unsafe { std::ptr::copy_nonoverlapping(dst, out as *mut u8, len) };
        }
    }
}

impl Coll {
    /// After a failure: waits (up to `WEFT_PEER_TIMEOUT`) until every
    /// request still in flight is finished or failed, so that no provider
    /// writes into the scratch buffer after it is freed.
    pub(super) fn abandon(&mut self) {
        if self.served && !self.headers_posted() {
            self.g.header_lost.store(true, Ordering::Release);
        }
        let deadline = Instant::now() + core::peer_timeout().unwrap_or(Duration::from_secs(30));
        // A failed collective's scratch is never reused (a peer that broke
        // the protocol may still be writing); it is freed only if nothing
        // of the provider's is left in it.
        let mut clean = true;
        for s in self
            .p1_send
            .iter_mut()
            .chain(&mut self.p1_recv)
            .chain(&mut self.p2_send)
            .chain(&mut self.p2_recv)
            .chain(&mut self.hdr)
        {
            for (_, q) in s.inflight.drain(..) {
                while matches!(q.test(), Ok(None)) {
                    if Instant::now() > deadline {
                        clean = false;
                        break;
                    }
                    std::thread::yield_now();
                }
            }
        }
        if clean {
            // Deregistered, then freed.
            drop(std::mem::take(&mut self.scratch));
        }
        self.clean = false;
    }
}

impl Drop for Coll {
    fn drop(&mut self) {
        self.g.live.fetch_sub(1, Ordering::Relaxed);
        let s = std::mem::take(&mut self.scratch);
        if self.clean {
            self.g.give_back(s);
        } else {
            // The provider may still hold part of it: never reuse or free it.
            std::mem::forget(s);
        }
    }
}

/// Shards of `count` elements of `size` bytes over `n` ranks (balanced by
/// element), as byte ranges.
pub(super) fn even_shards(count: usize, size: usize, n: usize) -> Vec<(usize, usize)> {
    (0..n)
        .map(|j| (count * j / n * size, count * (j + 1) / n * size))
        .collect()
}

/// Rank parts of `per_rank` bytes cut to the window `[off, off + len)`.
pub(super) fn window_shards(
    n: usize,
    per_rank: usize,
    off: usize,
    len: usize,
) -> Vec<(usize, usize)> {
    (0..n)
        .map(|j| {
            let a = (j * per_rank).max(off);
            let b = ((j + 1) * per_rank).min(off + len);
            if a < b {
                (a, b)
            } else {
                (a.min(off + len), a.min(off + len))
            }
        })
        .collect()
}
