//! One process of the soak (`tests/tests/soak.rs`): a rank that opens and
//! closes comms all the time, or the third party beside them.
//!
//! ```text
//! weft-soak rank RANK NRANKS DIR END       -> ok RANK epochs E msgs M bytes B gone G aborted A fused V rss0 R rss1 R fds0 F fds1 F
//! weft-soak garbage DIR SECONDS TAGGED      -> ok garbage sent N
//! ```
//!
//! **A rank** works in epochs. In epoch `e` it receives from rank
//! `from = rank - k` and sends to `to = rank + k` (mod NRANKS, `k = 1 + e %
//! (NRANKS - 1)`), on comms made for that epoch alone, on the device
//! [`device_of`] names for the epoch (the host's rail 0, its rail 1, or the
//! virtual device that fuses both, in turn): it listens, writes
//! the handle to `DIR/e-FROM-RANK.handle` (with its pid), connects to
//! `DIR/e-RANK-TO.handle`, moves 6 messages each way (8 B to 1 MiB, every
//! byte verified), and closes both. Its pid is in `DIR/RANK.pid` and the
//! epoch it reached in `DIR/RANK.epoch`: the driver SIGKILLs ranks and
//! starts them again, and a restarted rank goes on after every epoch any
//! rank reached. A partner that died or was replaced (its pid file names
//! another process, or no live one) is skipped for that epoch and counted
//! as `gone`. With `WEFT_SOAK_ABORT=1`, one epoch in 7 a rank *aborts*: once its requests are
//! posted it marks `DIR/e-RANK.abort` and closes both comms with their
//! transfers in flight, as NCCL's abort and `ncclCommShrink` do; its
//! partners' failures in that epoch are excused too. Anything else that fails (an error from a comm whose peer is
//! alive and the same process, a byte that differs) ends the rank with
//! `error ...`. After epoch 8 (the warm-up) it records RSS and open fds,
//! and again at the end.
//!
//! **The garbage process** reads every handle as it appears and sends its
//! listener junk (every rail's listener of a virtual device): random bytes,
//! framed control messages to random and real ids with random tokens, forged
//! `Conn`s, and (with TAGGED=1, for the rdma ranks, whose endpoints drop
//! tagged messages) tagged junk.
//!
//! Both kinds run with both rails as devices (`WEFT_IFACE=r`).

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use weft::core::{self, RecvArg};
use weft::proto::wire::{self, Ctrl, HANDLE_SIZE};
use weft_tests::host::{self, pattern};
use weft_tests::peer::{hex, unhex};

/// Message sizes of one epoch, each way.
const SIZES: [usize; 6] = [8, 100, 4096, 65_536, 300_000, 1 << 20];

fn args() -> Vec<String> {
    std::env::args().collect()
}

fn num(a: &[String], i: usize) -> Result<u64, String> {
    a.get(i)
        .ok_or_else(|| format!("argument {i} missing"))?
        .parse()
        .map_err(|e| format!("argument {i}: {e}"))
}

/// The devices of an epoch: what [`device_of`] chooses from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dev {
    Rail0,
    Rail1,
    Fused,
}

/// Epoch `e`'s device: rail 0, rail 1 and the virtual device of both, in
/// turn (every rank and the third party agree on it by the epoch alone).
fn device_of(e: u64) -> Dev {
    [Dev::Rail0, Dev::Rail1, Dev::Fused][(e % 3) as usize]
}

/// The epoch of a handle file `E-FROM-TO.handle`.
fn epoch_of(path: &Path) -> Option<u64> {
    path.file_name()?.to_str()?.split('-').next()?.parse().ok()
}

/// The physical devices of rails 0 and 1 (`WEFT_IFACE=r` finds both, in
/// libfabric's order), by their names.
fn rails() -> Result<[i32; 2], String> {
    let names = host::device_names()?;
    let at = |r: &str| {
        names
            .iter()
            .position(|x| x == r)
            .map(|i| i as i32)
            .ok_or_else(|| format!("no device {r} among {names:?} (WEFT_IFACE=r)"))
    };
    Ok([at("r0")?, at("r1")?])
}

/// A small xorshift generator (junk need not be good randomness).
struct Rng(u64);

impl Rng {
    fn new() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self(t ^ (u64::from(std::process::id()) << 32) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn pid_of(dir: &Path, rank: u64) -> Option<u32> {
    std::fs::read_to_string(dir.join(format!("{rank}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.split(' ').nth(2) == Some("Z"))
}

/// Whether rank `rank`'s process `pid` is gone (dead or replaced).
fn gone(dir: &Path, rank: u64, pid: u32) -> bool {
    pid_of(dir, rank) != Some(pid) || !alive(pid)
}

/// A line in this rank's log (stderr), in the Weft log's format, so that a
/// failure reads as one story: which epoch, which comm came up when.
fn note(text: &str) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    eprintln!(
        "{}.{:03} [{}] SOAK {text}",
        t.as_secs(),
        t.subsec_millis(),
        std::process::id()
    );
}

fn write_atomic(path: &Path, text: &str) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, path).map_err(|e| e.to_string())
}

/// What became of one epoch's pair of comms.
enum Outcome {
    /// Both directions moved and verified every message.
    Done(u64),
    /// A partner died or was replaced (or went on without this rank).
    Gone,
    /// This rank aborted the epoch.
    Aborted,
}

struct Rank {
    rank: u64,
    n: u64,
    dir: PathBuf,
    ctx: *mut c_void,
    /// The device index of each [`Dev`], in its order.
    devs: [i32; 3],
    deadline: Instant,
    /// Whether this rank aborts an epoch now and then (`WEFT_SOAK_ABORT=1`).
    aborts: bool,
}

impl Rank {
    fn fds() -> usize {
        std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
    }

    /// One epoch: see the module's documentation.
    fn epoch(&self, e: u64) -> Result<Outcome, String> {
        let k = 1 + e % (self.n - 1);
        let from = (self.rank + self.n - k) % self.n;
        let to = (self.rank + k) % self.n;
        let dev = self.devs[device_of(e) as usize];
        let (h, l) = host::listen_on(self.ctx, dev);
        let me = std::process::id();
        note(&format!(
            "epoch {e}: to rank {to}, from rank {from}, on device {dev} ({:?})",
            device_of(e)
        ));
        write_atomic(
            &self.dir.join(format!("{e}-{from}-{}.handle", self.rank)),
            &format!("{me} {}", hex(&h)),
        )?;
        let out = self.pair(e, from, to, l);
        core::close_listen(l).map_err(|e| e.to_string())?;
        out
    }

    /// The epoch's two directions, each on its own: one that cannot go on
    /// (its partner died) never cuts the other short, as NCCL's ranks go on
    /// with their other peers.
    fn pair(&self, e: u64, from: u64, to: u64, l: *mut c_void) -> Result<Outcome, String> {
        let mut send = Half::new(e, to, true);
        let mut recv = Half::new(e, from, false);
        recv.pid = pid_of(&self.dir, from);
        let limit = Instant::now() + Duration::from_secs(180);
        // Now and then a rank aborts, as NCCL's abort and ncclCommShrink
        // leave it: it closes both comms with their transfers in flight.
        let aborts = self.aborts && (e + self.rank) % 7 == 3;
        let posted = |h: &Half| h.settled() || (h.comm.is_some() && h.reqs.len() == SIZES.len());
        while !(send.settled() && recv.settled()) {
            self.step_send(&mut send)?;
            self.step_recv(&mut recv, l)?;
            if aborts && posted(&send) && posted(&recv) {
                write_atomic(&self.dir.join(format!("{e}-{}.abort", self.rank)), "")?;
                Self::close(&mut send);
                Self::close(&mut recv);
                return Ok(Outcome::Aborted);
            }
            if Instant::now() > limit {
                return Err(format!(
                    "epoch {e}: not settled after 180 s: {} / {}",
                    send.state(),
                    recv.state()
                ));
            }
            std::thread::yield_now();
        }
        Self::close(&mut send);
        Self::close(&mut recv);
        let mut bytes = 0;
        for h in [&mut send, &mut recv] {
            match h.end.take().expect("settled") {
                Ok(b) => bytes += b,
                Err(None) => return Ok(Outcome::Gone),
                Err(Some(why)) => return Err(why),
            }
        }
        if !recv.inb.is_empty() {
            for (m, buf) in recv.inb.iter().enumerate() {
                let want = pattern(e * 16 + m as u64, from as i32, buf.len());
                if *buf != want {
                    return Err(format!(
                        "epoch {e}: message {m} from rank {from} differs: {}",
                        differs(buf, &want, from)
                    ));
                }
            }
        }
        Ok(Outcome::Done(bytes))
    }

    /// Whether rank `r` finished epoch `e` already (without this rank: it
    /// took this rank's predecessor for gone).
    fn passed(&self, r: u64, e: u64) -> bool {
        std::fs::read_to_string(self.dir.join(format!("{r}.epoch")))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .is_some_and(|x| x >= e)
    }

    /// Deregisters and closes `h`'s comm, whatever is in flight.
    fn close(h: &mut Half) {
        if let Some(c) = h.comm.take() {
            for &mh in &h.mhs {
                let _ = core::dereg_mr(c, mh);
            }
            let _ = if h.sends {
                core::close_send(c)
            } else {
                core::close_recv(c)
            };
        }
    }

    /// Whether `h`'s partner died or was replaced, went on without it, or
    /// aborted the epoch.
    fn partner_gone(&self, h: &Half) -> bool {
        let marked = |name: String| self.dir.join(name).exists();
        h.pid.is_none_or(|p| gone(&self.dir, h.partner, p))
            || self.passed(h.partner, h.e)
            || marked(format!("{}-{}.abort", h.e, h.partner))
            || marked(format!("{}-{}-{}.skip", h.e, h.partner, self.rank))
    }

    /// Settles `h` as gone, and says so: a partner that comes after all
    /// (a restarted rank) finds the epoch given up instead of a listener
    /// nobody accepts on.
    fn give_up(&self, h: &mut Half) {
        note(&format!(
            "epoch {}: gave up {} rank {} (gone)",
            h.e,
            if h.sends {
                "sending to"
            } else {
                "receiving from"
            },
            h.partner
        ));
        let _ = write_atomic(
            &self
                .dir
                .join(format!("{}-{}-{}.skip", h.e, self.rank, h.partner)),
            "",
        );
        h.end = Some(Err(None));
    }

    /// Ends `h` after an error: excused (gone) if its partner is gone.
    fn fail(&self, h: &mut Half, why: String) {
        note(&format!("epoch {}: rank {}: {why}", h.e, h.partner));
        if self.partner_gone(h) {
            return self.give_up(h);
        }
        h.end = Some(Err(Some(format!(
            "epoch {} ({} rank {}), both alive: {why}",
            h.e,
            if h.sends { "to" } else { "from" },
            h.partner
        ))));
    }

    fn step_send(&self, h: &mut Half) -> Result<(), String> {
        if h.settled() {
            return Ok(());
        }
        if h.handle.is_none() {
            let path = self
                .dir
                .join(format!("{}-{}-{}.handle", h.e, self.rank, h.partner));
            if let Ok(t) = std::fs::read_to_string(&path) {
                let (pid, hx) = t.trim().split_once(' ').ok_or("a bad handle file")?;
                h.pid = Some(pid.parse().map_err(|_| "a bad pid")?);
                h.handle = Some(unhex(hx)?);
            } else {
                if pid_of(&self.dir, h.partner).is_none_or(|p| !alive(p))
                    || self.passed(h.partner, h.e)
                {
                    self.give_up(h);
                }
                return Ok(());
            }
        }
        if h.comm.is_none() {
            let handle = h.handle.as_mut().expect("read above");
            let dev = self.devs[device_of(h.e) as usize];
            match core::connect(self.ctx, dev, None, handle) {
                Ok(Some(c)) => {
                    note(&format!("epoch {}: connected to rank {}", h.e, h.partner));
                    h.comm = Some(c)
                }
                Ok(None) if self.partner_gone(h) => self.give_up(h),
                Ok(None) => {}
                Err(err) => self.fail(h, err.to_string()),
            }
            return Ok(());
        }
        self.step_transfer(h)
    }

    fn step_recv(&self, h: &mut Half, l: *mut c_void) -> Result<(), String> {
        if h.settled() {
            return Ok(());
        }
        if h.comm.is_none() {
            match core::accept(l) {
                Ok(Some(c)) => {
                    note(&format!("epoch {}: accepted from rank {}", h.e, h.partner));
                    h.comm = Some(c)
                }
                Ok(None) if self.partner_gone(h) => self.give_up(h),
                Ok(None) => {}
                Err(err) => self.fail(h, format!("accept: {err}")),
            }
            return Ok(());
        }
        self.step_transfer(h)
    }

    /// Posts what is not posted yet, tests what is: 6 messages (8 B to
    /// 1 MiB), all in flight at once.
    fn step_transfer(&self, h: &mut Half) -> Result<(), String> {
        let c = h.comm.expect("a comm");
        if h.reqs.is_empty() && h.out.is_empty() && h.inb.is_empty() {
            if h.sends {
                h.out = SIZES
                    .iter()
                    .enumerate()
                    .map(|(m, &n)| pattern(h.e * 16 + m as u64, self.rank as i32, n))
                    .collect();
            } else {
                h.inb = SIZES.iter().map(|&n| vec![0u8; n]).collect();
            }
        }
        while h.reqs.len() < SIZES.len() {
            let m = h.reqs.len();
            let (ptr, len) = if h.sends {
                (h.out[m].as_ptr() as *mut c_void, h.out[m].len())
            } else {
                (h.inb[m].as_mut_ptr().cast(), h.inb[m].len())
            };
            if h.mhs.len() == m {
                match core::reg_mr(c, ptr, len, 1) {
                    Ok(mh) => h.mhs.push(mh),
                    Err(err) => {
                        self.fail(h, format!("regMr: {err}"));
                        return Ok(());
                    }
                }
            }
            let mh = h.mhs[m];
            let posted = if h.sends {
                host::isend_raw(c, ptr, len, m as i32, mh, std::ptr::null_mut())
            } else {
                let arg = [RecvArg {
                    data: ptr,
                    size: len,
                    tag: m as i32,
                    mhandle: mh,
                    phandle: std::ptr::null_mut(),
                }];
                host::irecv_raw(c, &arg)
            };
            match posted {
                Ok(Some(q)) => {
                    h.reqs.push(q);
                    h.done.push(false);
                }
                Ok(None) => break,
                Err(err) => {
                    self.fail(h, format!("post: {err}"));
                    return Ok(());
                }
            }
        }
        for i in 0..h.reqs.len() {
            if h.done[i] {
                continue;
            }
            match core::test(h.reqs[i]) {
                Ok(Some(_)) => h.done[i] = true,
                Ok(None) => {}
                Err(err) => {
                    self.fail(h, format!("test: {err}"));
                    return Ok(());
                }
            }
        }
        if h.reqs.len() == SIZES.len() && h.done.iter().all(|&d| d) {
            h.end = Some(Ok(SIZES.iter().sum::<usize>() as u64));
        }
        Ok(())
    }
}

/// One direction of an epoch.
struct Half {
    e: u64,
    partner: u64,
    sends: bool,
    /// The partner's process (from its handle, or its pid file).
    pid: Option<u32>,
    handle: Option<[u8; HANDLE_SIZE]>,
    comm: Option<*mut c_void>,
    out: Vec<Vec<u8>>,
    inb: Vec<Vec<u8>>,
    mhs: Vec<*mut c_void>,
    reqs: Vec<*mut c_void>,
    done: Vec<bool>,
    /// Bytes moved; `Err(None)`: the partner is gone; `Err(Some)`: a failure.
    end: Option<Result<u64, Option<String>>>,
}

impl Half {
    fn new(e: u64, partner: u64, sends: bool) -> Self {
        Self {
            e,
            partner,
            sends,
            pid: None,
            handle: None,
            comm: None,
            out: Vec::new(),
            inb: Vec::new(),
            mhs: Vec::new(),
            reqs: Vec::new(),
            done: Vec::new(),
            end: None,
        }
    }
    fn settled(&self) -> bool {
        self.end.is_some()
    }
    fn state(&self) -> String {
        format!(
            "{} rank {}: comm {}, {} posted, done {:?}, end {:?}",
            if self.sends { "to" } else { "from" },
            self.partner,
            self.comm.is_some(),
            self.reqs.len(),
            self.done,
            self.end
        )
    }
}

/// What a received message holds instead of `want`: where it first differs,
/// how many bytes do, whether it is another message's pattern from `from`
/// (an earlier epoch's, or another size's) or zeros, the runs of differing
/// bytes (a run ends after 16 equal ones) with their addresses, and the
/// first run's bytes in hex.
fn differs(got: &[u8], want: &[u8], from: u64) -> String {
    let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
    let zeros = got[first..].iter().take_while(|&&b| b == 0).count();
    // pattern() depends on the sequence only through seq * 7 + tag (mod 256).
    let shift = got[first].wrapping_sub(want[first]);
    let same_shift = got[first..]
        .iter()
        .zip(&want[first..])
        .take_while(|(a, b)| a.wrapping_sub(**b) == shift)
        .count();
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for i in (0..got.len()).filter(|&i| got[i] != want[i]) {
        match runs.last_mut() {
            Some(r) if i <= r.1 + 16 => r.1 = i,
            _ => runs.push((i, i)),
        }
    }
    let base = got.as_ptr() as usize;
    let shown: Vec<String> = runs
        .iter()
        .take(8)
        .map(|&(a, b)| format!("{a}..={b} (at {:#x})", base + a))
        .collect();
    let hex: String = runs.first().map_or(String::new(), |&(a, b)| {
        got[a..=b.min(a + 95)]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    });
    format!(
        "{n} of {} bytes from byte {first}; {zeros} zeros there; the next {same_shift} bytes are the pattern shifted by {shift} (seq*7+tag off by that mod 256; from {from}); buffer at {base:#x}; {} run(s): {}; first run holds {hex}",
        got.len(),
        runs.len(),
        shown.join(", ")
    )
}

fn rank(a: &[String]) -> Result<String, String> {
    let (rank, n) = (num(a, 2)?, num(a, 3)?);
    let dir = PathBuf::from(a.get(4).ok_or("DIR missing")?);
    // The end, in seconds since 1970 (the same for a rank started again).
    let end = num(a, 5)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_secs();
    write_atomic(
        &dir.join(format!("{rank}.pid")),
        &std::process::id().to_string(),
    )?;
    let ctx = core::init(core::InitArgs {
        traffic_class: -1,
        // Weft's log to stderr, which the soak keeps in a file per rank.
        logger: Some(weft_tests::capture::weft_test_stderr_logger),
        ..Default::default()
    })
    .map_err(|e| e.to_string())?;
    let [r0, r1] = rails()?;
    let fused = core::make_vdevice(&[r0, r1], 4).map_err(|e| e.to_string())?;
    let me = Rank {
        rank,
        n,
        dir: dir.clone(),
        ctx,
        devs: [r0, r1, fused],
        deadline: Instant::now() + Duration::from_secs(end.saturating_sub(now)),
        aborts: std::env::var("WEFT_SOAK_ABORT").is_ok_and(|v| v == "1"),
    };
    // A rank started again begins after every epoch any rank reached, and
    // says so at once: partners still in earlier epochs skip it there (an
    // epoch's listener answers only while its rank accepts).
    let reached = (0..n)
        .filter_map(|r| {
            std::fs::read_to_string(dir.join(format!("{r}.epoch")))
                .ok()?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .max();
    let mut e = reached.map_or(0, |x| x + 2);
    if e > 0 {
        write_atomic(&dir.join(format!("{rank}.epoch")), &(e - 1).to_string())?;
    }
    let (mut epochs, mut bytes, mut lost, mut aborted) = (0u64, 0u64, 0u64, 0u64);
    // Epochs that moved and verified everything on the virtual device.
    let mut fused = 0u64;
    let (mut rss0, mut fds0) = (0, 0);
    while Instant::now() < me.deadline {
        match me.epoch(e)? {
            Outcome::Done(b) => {
                bytes += b;
                fused += u64::from(device_of(e) == Dev::Fused);
            }
            Outcome::Gone => lost += 1,
            Outcome::Aborted => aborted += 1,
        }
        write_atomic(&dir.join(format!("{rank}.epoch")), &e.to_string())?;
        epochs += 1;
        if epochs == 8 {
            rss0 = weft_tests::status_kb("VmRSS");
            fds0 = Rank::fds();
        }
        e += 1;
    }
    let (rss1, fds1) = (weft_tests::status_kb("VmRSS"), Rank::fds());
    core::finalize(ctx).map_err(|e| e.to_string())?;
    Ok(format!(
        "ok {rank} epochs {epochs} msgs {} bytes {bytes} gone {lost} aborted {aborted} fused {fused} rss0 {rss0} rss1 {rss1} fds0 {fds0} fds1 {fds1}",
        epochs.saturating_sub(lost + aborted) * 2 * SIZES.len() as u64
    ))
}

fn garbage(a: &[String]) -> Result<String, String> {
    let dir = PathBuf::from(a.get(2).ok_or("DIR missing")?);
    let secs = num(a, 3)?;
    let tagged = num(a, 4)? == 1;
    let config = weft::config::load().map_err(|e| e.to_string())?;
    let devs = weft::device::discover(&config).map_err(|e| e.to_string())?;
    // A forger on each rail (its listeners are reachable from it alone).
    let forger = |rail: &str| -> Result<weft_tests::forge::Forger, String> {
        let dev = devs
            .iter()
            .find(|d| d.domain == rail)
            .ok_or_else(|| format!("no device {rail} (WEFT_IFACE=r)"))?;
        let domain = weft::fabric::Domain::open(dev.info_for(true)).map_err(|e| e.to_string())?;
        let f = weft_tests::forge::Forger::open_on(domain);
        // Its targets die all the time: rxm refuses sends to a dead one for
        // ever, so what is not taken within a second is dropped (seen: the
        // third party stuck 300 s on one killed rank's listener).
        f.impatient(Duration::from_secs(1));
        Ok(f)
    };
    let forgers = [forger("r0")?, forger("r1")?];
    let mut rng = Rng::new();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut seen = std::collections::HashSet::new();
    let mut sent = 0u64;
    while Instant::now() < deadline {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut fresh = Vec::new();
        for ent in entries.flatten() {
            let name = ent.file_name().to_string_lossy().into_owned();
            if name.ends_with(".handle") && seen.insert(name.clone()) {
                fresh.push(ent.path());
            }
        }
        for p in fresh {
            if Instant::now() > deadline {
                break;
            }
            let Some(e) = epoch_of(&p) else { continue };
            let Some((pid, handles)) = std::fs::read_to_string(&p).ok().and_then(|t| {
                let (pid, hx) = t.trim().split_once(' ')?;
                let h: [u8; HANDLE_SIZE] = unhex(hx).ok()?;
                Some((pid.parse::<u32>().ok()?, wire::decode_any(&h).ok()?.0))
            }) else {
                continue;
            };
            // A killed rank's listener takes nothing, and each refused send
            // costs the forger its patience: aim at the living only.
            if !alive(pid) {
                continue;
            }
            // Which forger reaches each listener of the handle.
            let on: &[usize] = match device_of(e) {
                Dev::Rail0 => &[0],
                Dev::Rail1 => &[1],
                Dev::Fused => &[0, 1],
            };
            'target: for (h, &r) in handles.iter().zip(on) {
                let f = &forgers[r];
                let to = f.peer(&h.addr);
                for i in 0..8u64 {
                    let junk: Vec<u8> =
                        (0..1 + rng.next() % 60).map(|_| rng.next() as u8).collect();
                    let id = if i % 2 == 0 { h.id } else { rng.next() as u32 };
                    f.aim(id);
                    f.sign(rng.next() as u32);
                    let msg = match i % 4 {
                        0 => Ctrl::Alive,
                        1 => Ctrl::Bye {
                            sent: rng.next() as u32,
                        },
                        2 => Ctrl::Credit { count: 64 },
                        _ => Ctrl::Conn {
                            listener: h.nonce,
                            conn: rng.next(),
                            id: rng.next() as u32,
                            addr: f.name(),
                        },
                    };
                    // Refused: the rank died since (a second lost, not more).
                    if !f.inject_while(to, &junk, || {}) || !f.send_while(to, &msg, || {}) {
                        break 'target;
                    }
                    if tagged {
                        let _ = f.tsend(to, 1000, rng.next(), || {});
                    }
                    sent += 2 + u64::from(tagged);
                }
            }
        }
        for f in &forgers {
            while f.try_recv().is_some() {}
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(format!("ok garbage sent {sent}"))
}

fn main() {
    let a = args();
    let r = match a.get(1).map(String::as_str) {
        Some("rank") => rank(&a),
        Some("garbage") => garbage(&a),
        _ => Err("usage: weft-soak rank RANK NRANKS DIR END | garbage DIR SECONDS TAGGED".into()),
    };
    match r {
        Ok(line) => println!("{line}"),
        Err(e) => {
            println!("error {e}");
            std::process::exit(1);
        }
    }
}
