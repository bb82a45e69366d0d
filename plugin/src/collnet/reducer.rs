//! The reduction server: what `weft-reducer` runs.
//!
//! A reducer listens on one device; its listen handle is what
//! `WEFT_COLLNET_REDUCERS` gives the ranks. Each rank of a CollNet group
//! connects to it and sends a [`Join`] (group key, rank, group size, which
//! of the group's reducers this is, and the rank's own listen handle). Once
//! every rank of the group has joined, the reducer connects back to each
//! and greets it; the ranks' `connect` returns only then, so the group is
//! ready at every reducer when it is ready at the ranks.
//!
//! **All-reduce.** Each rank sends every reducer a [`Header`] and then the
//! reducer's shard of its input, in chunks; the reducer reduces chunk by
//! chunk **in rank order** (so results are bit-identical to the in-plugin
//! algorithm's) and sends each reduced chunk back to every rank. Headers
//! of all ranks must agree (operation number, type, op, shard, chunk): a
//! disagreement fails the group with an error naming both ranks.
//!
//! One thread serves every group, single-threaded over the core's comms;
//! each group keeps up to [`ACTIVE`] operations in progress and [`WINDOW`]
//! chunks of each in flight, in slots of `ranks x chunk` bytes (registered
//! once, reused). A group ends when one of its comms fails: at the end of
//! a job (the ranks closed their comms) that is logged at INFO, during an
//! operation at WARN; its comms are closed and the ranks see their
//! requests fail.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::time::{Duration, Instant};

use super::reduce;
use super::wire::{self, Header, Join, GREETING_LEN, HEADER_TAG, HELLO_TAG};
use super::{op_tags, recv, send};
use crate::core::{self, props, Context, ListenComm, MemHandle, RecvComm, Request, SendComm};
use crate::error::{Error, Result};
use crate::nccl::HANDLE_SIZE;

/// Operations of a group in progress at once (more are queued).
pub const ACTIVE: usize = 2;
/// Chunks of an operation in flight.
pub const WINDOW: usize = 4;
/// Headers a group may have queued before the reducer stops taking more.
const QUEUED: usize = 16;

/// A registered buffer (the registration goes before the memory: fields
/// drop in order).
#[derive(Debug)]
struct Buf {
    mh: MemHandle,
    mem: Vec<u8>,
}

impl Buf {
    /// `len` bytes registered through `comm`.
    fn new(comm: &RecvComm, len: usize) -> Result<Self> {
        let mut mem = vec![0u8; len];
        let mh = comm.reg_mr(mem.as_mut_ptr().cast::<c_void>(), len, props::PTR_HOST)?;
        Ok(Self { mh, mem })
    }
    fn at(&self, off: usize) -> usize {
        self.mem.as_ptr() as usize + off
    }
    /// Deregisters; with `clean` false (the provider may still write into
    /// it) the memory is leaked instead of freed.
    fn release(self, clean: bool) {
        let Buf { mh, mem } = self;
        drop(mh);
        if !clean {
            std::mem::forget(mem);
        }
    }
}

/// A request's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Q {
    Todo,
    Posted(Request),
    Done,
}

impl Q {
    /// Tests a posted request of `len` bytes; `true` if it just completed
    /// (its bytes are added to `count`). A message of another size (a peer
    /// that truncated or forged one) is an error.
    fn test(&mut self, len: usize, count: &mut u64) -> Result<bool> {
        if let Q::Posted(q) = *self {
            if let Some(d) = q.test()? {
                *self = Q::Done;
                if d.sizes[0] != len {
                    return Err(Error::remote(format!(
                        "a message of {} bytes where {len} were due",
                        d.sizes[0]
                    )));
                }
                *count += len as u64;
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// One rank of a group, as the reducer sees it: the comm it joined on,
/// the comm connected back to it, and its listen handle.
#[derive(Debug)]
struct Member {
    recv: RecvComm,
    send: Option<SendComm>,
    handle: [u8; HANDLE_SIZE],
}

/// One chunk of an operation in flight: every rank's copy lands in its
/// part of the slot; the reduction goes into rank 0's part and back out.
#[derive(Debug)]
struct Work {
    len: usize,
    slot: Buf,
    up: Vec<Q>,
    reduced: bool,
    down: Vec<Q>,
}

/// An all-reduce at this reducer.
#[derive(Debug)]
struct Op {
    h: Header,
    tags: [i32; 2],
    next: usize,
    work: VecDeque<Work>,
}

impl Op {
    fn finished(&self) -> bool {
        self.next as u64 >= self.h.len && self.work.is_empty()
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for ranks to join.
    Joining,
    /// Every rank joined: connecting back and greeting.
    Greeting,
    Serving,
}

/// A group this reducer serves.
#[derive(Debug)]
struct Group {
    key: u64,
    n: usize,
    index: u32,
    nreducers: u32,
    /// Each rank, once joined.
    members: Vec<Option<Member>>,
    /// Each rank's comms, once serving (every rank joined and was
    /// connected back to): taken from `members`.
    links: Vec<(RecvComm, SendComm)>,
    phase: Phase,
    since: Instant,
    /// Greeting (8 bytes) then one header slot per rank.
    msgs: Buf,
    greet: Vec<Q>,
    hdr: Vec<Q>,
    ops: VecDeque<Op>,
    /// Every rank said goodbye.
    bye: bool,
    free: Vec<Buf>,
    done: u64,
    bytes_in: u64,
    bytes_out: u64,
}

/// A comm accepted whose join has not arrived yet. Dropping it closes the
/// comm (which takes its receive back from the provider), then frees the
/// buffer.
#[derive(Debug)]
struct Pending {
    recv: RecvComm,
    buf: Buf,
    q: Q,
    since: Instant,
}

/// What a reducer did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Groups that completed joining.
    pub groups: u64,
    /// Of those, groups that ended.
    pub ended: u64,
    /// Groups that ended while an operation was in progress, or never
    /// completed joining.
    pub failed: u64,
    /// All-reduces completed.
    pub ops: u64,
    /// Payload bytes received from and sent to ranks.
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// A reduction server on one device.
#[derive(Debug)]
pub struct Reducer {
    ctx: Context,
    dev: i32,
    listen: ListenComm,
    handle: [u8; HANDLE_SIZE],
    timeout: Duration,
    pending: Vec<Pending>,
    groups: Vec<Group>,
    stats: Stats,
}

impl Reducer {
    /// Listens on device `dev` of context `ctx`.
    pub fn new(ctx: *mut c_void, dev: i32) -> Result<Self> {
        let mut handle = [0u8; HANDLE_SIZE];
        let ctx = Context::of(ctx)?;
        let listen = ctx.listen(dev, &mut handle)?;
        Ok(Self {
            ctx,
            dev,
            listen,
            handle,
            timeout: core::peer_timeout()?,
            pending: Vec::new(),
            groups: Vec::new(),
            stats: Stats::default(),
        })
    }

    /// The handle ranks connect to (`WEFT_COLLNET_REDUCERS`).
    pub fn handle(&self) -> [u8; HANDLE_SIZE] {
        self.handle
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Groups being served now.
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// Serves until `done(self)` (asked after every pass); idle, it backs
    /// off to short sleeps.
    pub fn run(&mut self, mut done: impl FnMut(&Self) -> bool) {
        let mut idle = 0u32;
        while !done(self) {
            if self.step() {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if idle > 10_000 {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// One pass over everything; `true` if anything progressed.
    pub fn step(&mut self) -> bool {
        let mut progressed = self.accept();
        let mut i = 0;
        while i < self.groups.len() {
            let step = self.groups[i].step(&self.ctx, self.dev, self.timeout);
            let g = &mut self.groups[i];
            self.stats.bytes_in += std::mem::take(&mut g.bytes_in);
            self.stats.bytes_out += std::mem::take(&mut g.bytes_out);
            self.stats.ops += std::mem::take(&mut g.done);
            let why = match step {
                // After every rank's goodbye, what is in flight still finishes.
                Ok(moved) if !(g.bye && g.ops.is_empty()) => {
                    progressed |= moved;
                    i += 1;
                    continue;
                }
                Ok(_) => None,
                Err(e) => Some(e),
            };
            let g = self.groups.swap_remove(i);
            if why.is_some() && g.busy() {
                self.stats.failed += 1;
            }
            if g.phase != Phase::Joining {
                self.stats.ended += 1;
            }
            g.end(why, self.timeout);
            progressed = true;
        }
        progressed
    }

    /// Accepts new comms and reads their joins.
    fn accept(&mut self) -> bool {
        let mut progressed = false;
        loop {
            match self.listen.accept() {
                Ok(Some(recv)) => {
                    progressed = true;
                    // On an error the comm is dropped: closed.
                    match Buf::new(&recv, Join::LEN) {
                        Ok(buf) => self.pending.push(Pending {
                            recv,
                            buf,
                            q: Q::Todo,
                            since: Instant::now(),
                        }),
                        Err(e) => {
                            tracing::warn!(target: "weft::collnet", "reducer: cannot register a join buffer: {e}");
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(target: "weft::collnet", "reducer: accept failed: {e}");
                    break;
                }
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let pd = &mut self.pending[i];
            let step = (|| -> Result<bool> {
                if pd.q == Q::Todo {
                    let (at, mh) = (pd.buf.at(0), Some(&pd.buf.mh));
                    // SAFETY: the pending comm's own registered join buffer.
                    if let Some(q) = unsafe { recv(Some(&pd.recv), at, Join::LEN, HELLO_TAG, mh) }?
                    {
                        pd.q = Q::Posted(q);
                    }
                }
                pd.q.test(Join::LEN, &mut 0)
            })();
            match step {
                Ok(false) if pd.since.elapsed() <= 2 * self.timeout => i += 1,
                Ok(false) => {
                    let pd = self.pending.swap_remove(i);
                    tracing::warn!(target: "weft::collnet",
                        "reducer: a comm accepted {:.1} s ago never sent its join; closed",
                        pd.since.elapsed().as_secs_f64());
                    drop(pd);
                    progressed = true;
                }
                Ok(true) => {
                    let pd = self.pending.swap_remove(i);
                    progressed = true;
                    let join = Join::decode(&pd.buf.mem);
                    match join {
                        Ok(j) => {
                            let Pending { recv, buf, .. } = pd;
                            drop(buf);
                            // A join refused drops (closes) its comm.
                            if let Err(e) = self.admit(j, recv) {
                                tracing::warn!(target: "weft::collnet", "reducer: join refused: {e}");
                            }
                        }
                        Err(e) => {
                            tracing::warn!(target: "weft::collnet", "reducer: {e}; the comm is closed");
                            drop(pd);
                        }
                    }
                }
                Err(e) => {
                    let pd = self.pending.swap_remove(i);
                    tracing::warn!(target: "weft::collnet", "reducer: a comm failed before its join: {e}");
                    drop(pd);
                    progressed = true;
                }
            }
        }
        progressed
    }

    /// Adds a joined rank to its group (a new one for a new key).
    fn admit(&mut self, j: Join, recv: RecvComm) -> Result<()> {
        let i = match self.groups.iter().position(|g| g.key == j.key) {
            Some(i) => i,
            None => {
                let n = j.nranks as usize;
                let msgs = Buf::new(&recv, GREETING_LEN + n * Header::LEN)?;
                self.groups.push(Group {
                    key: j.key,
                    n,
                    index: j.index,
                    nreducers: j.nreducers,
                    members: (0..n).map(|_| None).collect(),
                    links: Vec::new(),
                    phase: Phase::Joining,
                    since: Instant::now(),
                    msgs,
                    greet: vec![Q::Todo; n],
                    hdr: vec![Q::Todo; n],
                    ops: VecDeque::new(),
                    bye: false,
                    free: Vec::new(),
                    done: 0,
                    bytes_in: 0,
                    bytes_out: 0,
                });
                self.groups.len() - 1
            }
        };
        let g = &mut self.groups[i];
        let r = j.rank as usize;
        if g.phase != Phase::Joining
            || j.nranks as usize != g.n
            || (j.index, j.nreducers) != (g.index, g.nreducers)
            || g.members[r].is_some()
        {
            return Err(Error::remote(format!(
                "group {:016x}: rank {r} of {} joins as reducer {} of {}, but the group has {} ranks and takes this \
                 reducer for {} of {}{} (every rank must list the same WEFT_COLLNET_REDUCERS in the same order)",
                g.key,
                j.nranks,
                j.index,
                j.nreducers,
                g.n,
                g.index,
                g.nreducers,
                if g.members[r.min(g.n - 1)].is_some() {
                    "; or this rank joined twice"
                } else {
                    ""
                }
            )));
        }
        g.members[r] = Some(Member {
            recv,
            send: None,
            handle: j.handle,
        });
        g.since = Instant::now();
        if g.members.iter().all(Option::is_some) {
            g.phase = Phase::Greeting;
            self.stats.groups += 1;
            tracing::info!(target: "weft::collnet",
                "reducer: group {:016x}: all {} ranks joined (this is reducer {} of {})", g.key, g.n, g.index, g.nreducers);
        }
        Ok(())
    }
}

/// Waits until `deadline` for a posted request to end (done or failed);
/// `true` if nothing of the provider's is left on it.
fn finish(q: Q, deadline: Instant) -> bool {
    let Q::Posted(q) = q else { return true };
    loop {
        match q.test() {
            Ok(None) if Instant::now() < deadline => std::thread::yield_now(),
            Ok(None) => return false,
            _ => return true,
        }
    }
}

impl Group {
    /// Not between operations: joining, or an operation begun (a header in).
    fn busy(&self) -> bool {
        self.phase != Phase::Serving || !self.ops.is_empty() || self.hdr.contains(&Q::Done)
    }

    /// One step of this group; `true` if anything progressed.
    fn step(&mut self, ctx: &Context, dev: i32, timeout: Duration) -> Result<bool> {
        match self.phase {
            Phase::Joining => {
                if self.since.elapsed() > 2 * timeout {
                    let joined = self.members.iter().filter(|m| m.is_some()).count();
                    return Err(Error::remote(format!(
                        "only {joined} of {} ranks joined within {:.1} s",
                        self.n,
                        (2 * timeout).as_secs_f64()
                    )));
                }
                Ok(false)
            }
            Phase::Greeting => self.greet(ctx, dev, timeout),
            Phase::Serving => self.serve(),
        }
    }

    /// Connects back to every rank and greets it.
    fn greet(&mut self, ctx: &Context, dev: i32, timeout: Duration) -> Result<bool> {
        let mut progressed = false;
        let mine = wire::REDUCER_BIT | u64::from(self.index);
        self.msgs.mem[..GREETING_LEN].copy_from_slice(&mine.to_le_bytes());
        for r in 0..self.n {
            let m = self.members[r].as_mut().expect("every rank joined");
            if m.send.is_none() {
                m.send = ctx
                    .connect(dev, None, &mut m.handle)
                    .map_err(|e| e.context(format!("connecting back to rank {r}")))?;
                progressed |= m.send.is_some();
            }
            if m.send.is_some() && self.greet[r] == Q::Todo {
                // SAFETY: the group's registered greeting, kept with the group.
                if let Some(q) = unsafe {
                    send(
                        m.send.as_ref(),
                        self.msgs.at(0),
                        GREETING_LEN,
                        HELLO_TAG,
                        Some(&self.msgs.mh),
                    )
                }? {
                    self.greet[r] = Q::Posted(q);
                }
            }
            progressed |= self.greet[r]
                .test(GREETING_LEN, &mut 0)
                .map_err(|e| e.context(format!("greeting rank {r}")))?;
        }
        if self.greet.iter().all(|&q| q == Q::Done) {
            // Every rank joined and every greeting went: each has both.
            self.links = std::mem::take(&mut self.members)
                .into_iter()
                .flatten()
                .filter_map(|m| Some((m.recv, m.send?)))
                .collect();
            self.phase = Phase::Serving;
            progressed = true;
        } else if !progressed && self.since.elapsed() > 2 * timeout {
            return Err(Error::remote(format!(
                "could not connect back to every rank within {:.1} s",
                (2 * timeout).as_secs_f64()
            )));
        } else if progressed {
            self.since = Instant::now();
        }
        Ok(progressed)
    }

    /// Headers in, operations started, chunks reduced and sent back.
    fn serve(&mut self) -> Result<bool> {
        let mut progressed = false;
        let n = self.n;
        // Headers: one receive posted per rank; once all arrived, an operation.
        for r in 0..n {
            if self.hdr[r] == Q::Todo && self.ops.len() < QUEUED && !self.bye {
                let at = self.msgs.at(GREETING_LEN + r * Header::LEN);
                let c = self.links.get(r).map(|l| &l.0);
                let mh = Some(&self.msgs.mh);
                // SAFETY: rank r's header slot of the group's registered buffer.
                if let Some(q) = unsafe { recv(c, at, Header::LEN, HEADER_TAG, mh) }
                    .map_err(|e| e.context(format!("rank {r}")))?
                {
                    self.hdr[r] = Q::Posted(q);
                }
            }
            progressed |= self.hdr[r]
                .test(Header::LEN, &mut 0)
                .map_err(|e| e.context(format!("rank {r}")))?;
        }
        if self.hdr.iter().all(|&q| q == Q::Done) {
            let slot = |r: usize| &self.msgs.mem[GREETING_LEN + r * Header::LEN..][..Header::LEN];
            let h = Header::decode(slot(0)).map_err(|e| Error::remote(format!("rank 0: {e}")))?;
            for r in 1..n {
                let hr =
                    Header::decode(slot(r)).map_err(|e| Error::remote(format!("rank {r}: {e}")))?;
                if hr != h {
                    return Err(Error::remote(format!(
                        "ranks 0 and {r} disagree on an all-reduce: {h:?} vs {hr:?}; every rank must issue \
                         the same collectives, with the same counts, types and ops, in the same order"
                    )));
                }
            }
            self.hdr.iter_mut().for_each(|q| *q = Q::Todo);
            if h.bye {
                self.bye = true;
                return Ok(true);
            }
            self.ops.push_back(Op {
                h,
                tags: op_tags(h.seq),
                next: 0,
                work: VecDeque::new(),
            });
            progressed = true;
        }
        let mut i = 0;
        while i < self.ops.len().min(ACTIVE) {
            progressed |= self.advance(i)?;
            if self.ops[i].finished() {
                let op = self.ops.remove(i).expect("in range");
                debug_assert!(op.work.is_empty());
                self.done += 1;
                progressed = true;
            } else {
                i += 1;
            }
        }
        Ok(progressed)
    }

    /// Moves operation `i` on.
    fn advance(&mut self, i: usize) -> Result<bool> {
        let n = self.n;
        let mut progressed = false;
        let members = &self.links;
        let any = &members
            .first()
            .ok_or_else(|| Error::internal("reducer: a group serving no rank"))?
            .0;
        let op = &mut self.ops[i];
        let chunk = op.h.chunk as usize;
        let ty = op.h.ty;
        let rop = op.h.op;
        // Start chunks while the window has room.
        while op.work.len() < WINDOW && (op.next as u64) < op.h.len {
            let len = chunk.min((op.h.len - op.next as u64) as usize);
            let slot = match self.free.iter().position(|b| b.mem.len() >= n * chunk) {
                Some(k) => self.free.swap_remove(k),
                None => Buf::new(any, n * chunk)?,
            };
            op.work.push_back(Work {
                len,
                slot,
                up: vec![Q::Todo; n],
                reduced: false,
                down: vec![Q::Todo; n],
            });
            op.next += len;
            progressed = true;
        }
        for (r, (rc, _)) in members.iter().enumerate() {
            let at = |e: Error| e.context(format!("rank {r} of {n}"));
            // Receives and sends go out in chunk order per rank (matching is
            // in order per tag), so stop at the first one a comm refuses.
            let mut blocked = false;
            for w in op.work.iter_mut().filter(|w| w.up[r] == Q::Todo) {
                if blocked {
                    break;
                }
                let dst = w.slot.at(r * chunk);
                let mh = Some(&w.slot.mh);
                // SAFETY: rank r's part of the chunk's registered slot.
                match unsafe { recv(Some(rc), dst, w.len, op.tags[0], mh) }.map_err(at)? {
                    Some(q) => w.up[r] = Q::Posted(q),
                    None => blocked = true,
                }
            }
            for w in op.work.iter_mut() {
                progressed |= w.up[r].test(w.len, &mut self.bytes_in).map_err(at)?;
            }
        }
        // Reduce in chunk order, each over the ranks in rank order.
        for w in op.work.iter_mut() {
            if w.reduced {
                continue;
            }
            if !w.up.iter().all(|&q| q == Q::Done) {
                break;
            }
            let (first, rest) = w.slot.mem.split_at_mut(chunk);
            for r in 1..n {
                reduce::reduce(
                    ty,
                    rop,
                    &mut first[..w.len],
                    &rest[(r - 1) * chunk..][..w.len],
                );
            }
            w.reduced = true;
            progressed = true;
        }
        for (r, (_, sc)) in members.iter().enumerate() {
            let at = |e: Error| e.context(format!("rank {r} of {n}"));
            for w in op
                .work
                .iter_mut()
                .filter(|w| w.reduced && w.down[r] == Q::Todo)
            {
                let (at0, mh) = (w.slot.at(0), Some(&w.slot.mh));
                // SAFETY: the reduced chunk, rank 0's part of the registered
                // slot, kept until every send of it is done.
                match unsafe { send(Some(sc), at0, w.len, op.tags[1], mh) }.map_err(at)? {
                    Some(q) => w.down[r] = Q::Posted(q),
                    None => break,
                }
            }
            for w in op.work.iter_mut() {
                progressed |= w.down[r].test(w.len, &mut self.bytes_out).map_err(at)?;
            }
        }
        while op
            .work
            .front()
            .is_some_and(|w| w.down.iter().all(|&q| q == Q::Done))
        {
            let w = op.work.pop_front().expect("front");
            self.free.push(w.slot);
            progressed = true;
        }
        Ok(progressed)
    }

    /// Ends the group, because its ranks said goodbye (`why` is `None`) or
    /// after an error: waits (up to the peer timeout) for what is posted,
    /// closes the comms, frees what the provider no longer holds.
    fn end(self, why: Option<Error>, timeout: Duration) {
        let what = format!("reducer: group {:016x} ({} ranks)", self.key, self.n);
        match why {
            None => tracing::info!(target: "weft::collnet", "{what}: every rank closed it"),
            Some(e) if self.busy() => tracing::warn!(target: "weft::collnet", "{what} ended: {e}"),
            Some(e) => tracing::info!(target: "weft::collnet",
                "{what} ended between operations (its ranks went away without closing it): {e}"),
        }
        let deadline = Instant::now() + timeout;
        let mut clean = true;
        for &q in self.greet.iter().chain(&self.hdr) {
            clean &= finish(q, deadline);
        }
        let mut slots = self.free;
        for op in self.ops {
            for w in op.work {
                let mut ok = true;
                for &q in w.up.iter().chain(&w.down) {
                    ok &= finish(q, deadline);
                }
                if ok {
                    slots.push(w.slot);
                } else {
                    w.slot.release(false);
                }
            }
        }
        // The comms close, then the buffers go.
        drop(self.members);
        drop(self.links);
        self.msgs.release(clean);
        for s in slots {
            s.release(true);
        }
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        for g in std::mem::take(&mut self.groups) {
            g.end(
                Some(Error::remote("the reducer is shutting down")),
                self.timeout,
            );
        }
        // The pending comms close, then the listener (fields drop after this).
        self.pending.clear();
    }
}
