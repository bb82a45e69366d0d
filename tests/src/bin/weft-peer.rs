//! The other process of the two-process tests: drives the plugin's core from
//! commands on stdin, one per line, and answers each on stdout.
//!
//! ```text
//! init <provider>             -> ok
//! init-on <provider> <iface>  -> ok devices <name,...>
//! vdev <dev,dev,...>          -> vdev <index> <name> <speed>   (makeVDevice)
//! listen [dev]                -> handle <hex>
//! accept                      -> ok
//! close-listen                -> ok
//! connect <hex> [dev]         -> ok
//! half-connect <hex>          -> ok    (speaks the handshake by hand: sends Conn, reads
//!                                       the Ack, never confirms; stays that way)
//! send <count> <size> <tag>   -> ok <bytes>    (window of 8, content from host::pattern)
//! recv <count> <size> <tag>   -> ok <bytes>    (verified)
//! poll <tag> <iterations>     -> ok            (progress with one receive posted for <tag>, never matched)
//! post-send <size> <tag> <tries> -> ok posted | ok held   (one isend, retried up to <tries> times
//!                                       while NULL; never waited for; the buffer stays until exit)
//! rss                         -> rss <kB>
//! quit                        -> (closes everything, exits 0)
//! ```
//! Any failure answers `error <message>` and exits 1.

use std::ffi::c_void;
use std::io::{BufRead, Write};

use weft::core;
use weft_tests::host::{self, pattern};
use weft_tests::peer::{hex, unhex};

const WINDOW: usize = 8;

struct Peer {
    provider: String,
    /// What `half-connect` keeps open.
    half: Option<Box<dyn std::any::Any>>,
    ctx: *mut c_void,
    listen: *mut c_void,
    send: *mut c_void,
    recv: *mut c_void,
    /// CollNet: the listener, then the group.
    coll_listen: *mut c_void,
    coll: *mut c_void,
}

/// This rank's share of a CollNet test all-reduce: element `i` of rank `r`
/// is `(r + 1) * (i % 1000)`, so the sum over `n` ranks is exact in f32.
pub fn coll_data(rank: usize, count: usize) -> Vec<f32> {
    (0..count)
        .map(|i| ((rank + 1) * (i % 1000)) as f32)
        .collect()
}

/// An in-place f32 sum all-reduce of [`coll_data`] on `g`, checked.
fn coll_allreduce(g: *mut c_void, rank: usize, n: usize, count: usize) -> Result<(), String> {
    use weft::collnet;
    let mut v = coll_data(rank, count);
    let p: *mut c_void = v.as_mut_ptr().cast();
    let mh = collnet::reg_mr(g, p, count * 4, 1).map_err(|e| e.to_string())?;
    // SAFETY: registered, in place, outlives the request.
    let q =
        unsafe { collnet::iallreduce(g, p, p, count, 7, 0, mh, mh) }.map_err(|e| e.to_string())?;
    loop {
        match collnet::test(q) {
            Ok(Some(_)) => break,
            Ok(None) => std::thread::yield_now(),
            Err(e) => return Err(e.to_string()),
        }
    }
    collnet::dereg_mr(mh).map_err(|e| e.to_string())?;
    let tri = (n * (n + 1) / 2) as f32;
    match v
        .iter()
        .enumerate()
        .find(|&(i, &x)| x != (i % 1000) as f32 * tri)
    {
        Some((i, x)) => Err(format!("all-reduce element {i} is {x}")),
        None => Ok(()),
    }
}

/// Tests `q` until done; an error (a dead peer) is returned, not a panic.
fn wait(q: *mut c_void) -> Result<core::Done, String> {
    loop {
        match core::test(q) {
            Ok(Some(d)) => return Ok(d),
            Ok(None) => std::thread::yield_now(),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Sends `count` messages, keeping up to WINDOW in flight.
fn send(comm: *mut c_void, count: u64, size: usize, tag: i32) -> Result<u64, String> {
    let msgs: Vec<Vec<u8>> = (0..count).map(|i| pattern(i, tag, size + 1)).collect();
    let mhs: Vec<*mut c_void> = msgs.iter().map(|m| host::reg(comm, m)).collect();
    let mut inflight = std::collections::VecDeque::new();
    for (m, &mh) in msgs.iter().zip(&mhs) {
        if inflight.len() == WINDOW {
            wait(inflight.pop_front().expect("window"))?;
        }
        let q = loop {
            match host::isend_raw(
                comm,
                m.as_ptr() as *mut c_void,
                size,
                tag,
                mh,
                std::ptr::null_mut(),
            ) {
                Ok(Some(q)) => break q,
                Ok(None) => std::thread::yield_now(),
                Err(e) => return Err(e.to_string()),
            }
        };
        inflight.push_back(q);
    }
    for q in inflight {
        wait(q)?;
    }
    for mh in mhs {
        core::dereg_mr(comm, mh).expect("deregMr");
    }
    Ok(count * size as u64)
}

/// Receives and verifies `count` messages, up to WINDOW posted at once.
fn recv(comm: *mut c_void, count: u64, size: usize, tag: i32) -> Result<u64, String> {
    let mut bufs: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0u8; size + 1]).collect();
    let mhs: Vec<*mut c_void> = bufs.iter().map(|b| host::reg(comm, b)).collect();
    let mut inflight = std::collections::VecDeque::new();
    let mut next = 0u64;
    let mut bytes = 0;
    for seq in 0..count {
        while next < count && inflight.len() < WINDOW {
            let slot = (next % WINDOW as u64) as usize;
            let arg = core::RecvArg {
                data: bufs[slot].as_mut_ptr().cast(),
                size: size + 1,
                tag,
                mhandle: mhs[slot],
                phandle: std::ptr::null_mut(),
            };
            let q = loop {
                match host::irecv_raw(comm, &[arg]) {
                    Ok(Some(q)) => break q,
                    Ok(None) => std::thread::yield_now(),
                    Err(e) => return Err(e.to_string()),
                }
            };
            inflight.push_back((next, slot, q));
            next += 1;
        }
        let (s, slot, q) = inflight.pop_front().expect("posted");
        debug_assert_eq!(s, seq);
        let d = wait(q)?;
        if d.sizes[0] != size || bufs[slot][..size] != pattern(seq, tag, size)[..] {
            return Err(format!(
                "message {seq} of {size} bytes with tag {tag}: wrong size ({}) or content",
                d.sizes[0]
            ));
        }
        bytes += size as u64;
    }
    for mh in mhs {
        core::dereg_mr(comm, mh).expect("deregMr");
    }
    Ok(bytes)
}

/// A connecting side that stops half way: it sends a valid Conn to the
/// listener of `handle` and waits for the Ack, but never says `Alive`. What
/// it returns keeps its endpoint open.
fn half_connect(provider: &str, handle: &[u8; 128]) -> Result<Box<dyn std::any::Any>, String> {
    use weft::fabric::{Endpoint, Mr, ACCESS_ALL};
    use weft::proto::wire::{Ctrl, ListenHandle, CTRL_MAX};
    use weft::testing::{frame, unframe, CTRL_HEAD};
    let e = |e: weft::fabric::FiError| e.to_string();
    let domain = weft_tests::loopback_domain(provider)?;
    let ep = Endpoint::open_own(&domain).map_err(e)?;
    let h = ListenHandle::decode(handle).map_err(|e| e.to_string())?;
    let listener = ep.av().insert(&h.addr).map_err(e)?;
    let buf = vec![0u8; CTRL_HEAD + CTRL_MAX];
    // SAFETY: `buf` is live and unmoved for as long as the registration,
    // which is returned with it.
    let mr = unsafe { Mr::register(&domain, buf.as_ptr(), buf.len(), ACCESS_ALL) }.map_err(e)?;
    // SAFETY: the buffer and its registration are returned together with
    // the endpoint and outlive it (the process is killed with them open).
    unsafe {
        ep.recv(
            buf.as_ptr().cast_mut(),
            buf.len(),
            mr.desc(),
            libfabric_sys::FI_ADDR_UNSPEC,
            std::ptr::null_mut(),
        )
    }
    .map_err(e)?;
    let msg = frame(
        h.id,
        0x4a1f,
        &Ctrl::Conn {
            listener: h.nonce,
            conn: 42,
            id: 1,
            addr: ep.name().map_err(e)?,
        },
    );
    let mut c = [weft::fabric::Completion::default(); 4];
    let mut sent = false;
    weft_tests::poll_until("the listener's Ack", || {
        if !sent {
            match ep.inject(&msg, listener) {
                Ok(()) => sent = true,
                Err(err) if err.is_again() => {}
                Err(err) => panic!("half-connect: {err}"),
            }
        }
        (ep.cq().read(&mut c).expect("half-connect cq") > 0).then_some(())
    });
    match unframe(&buf[..c[0].len]).map(|(_, _, b)| Ctrl::decode(b)) {
        Some(Ok(Ctrl::Ack { conn: 42, .. })) => Ok(Box::new((ep, mr, buf, domain))),
        other => Err(format!("half-connect: expected the Ack, got {other:?}")),
    }
}

impl Peer {
    fn run(&mut self, line: &str) -> Result<Option<String>, String> {
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Result<u64, String> {
            w.get(i)
                .ok_or("missing argument")?
                .parse::<u64>()
                .map_err(|e| e.to_string())
        };
        Ok(Some(match w.first().copied() {
            Some("init") => {
                self.provider = w.get(1).ok_or("init needs a provider")?.to_string();
                self.ctx = host::init(&self.provider);
                "ok".into()
            }
            // init-on PROVIDER IFACE: as init, on interface IFACE instead of lo
            // (inside a namespace of tests/src/netns.rs).
            Some("init-on") => {
                self.provider = w.get(1).ok_or("init-on needs a provider")?.to_string();
                let iface = w.get(2).ok_or("init-on needs an interface")?;
                std::env::set_var("WEFT_PROVIDER", &self.provider);
                std::env::set_var("WEFT_IFACE", iface);
                std::env::set_var("FI_TCP_IFACE", iface);
                self.ctx = core::init(core::InitArgs {
                    traffic_class: -1,
                    ..Default::default()
                })
                .map_err(|e| e.to_string())?;
                let names = host::device_names()?;
                format!("ok devices {}", names.join(","))
            }
            // vdev DEV,DEV,...: fuses the devices (makeVDevice).
            Some("vdev") => {
                let devs = w
                    .get(1)
                    .ok_or("vdev needs devices")?
                    .split(',')
                    .map(|d| d.parse::<i32>().map_err(|e| e.to_string()))
                    .collect::<Result<Vec<_>, _>>()?;
                let v = core::make_vdevice(&devs, 8).map_err(|e| e.to_string())?;
                let p = core::properties(v).map_err(|e| e.to_string())?;
                format!("vdev {v} {} {}", p.name.to_string_lossy(), p.speed)
            }
            // listen [DEV] (device 0 by default)
            Some("listen") => {
                let dev = w
                    .get(1)
                    .map_or(Ok(0), |d| d.parse::<i32>())
                    .map_err(|e| e.to_string())?;
                let mut h = [0u8; 128];
                self.listen = core::listen(self.ctx, dev, &mut h).map_err(|e| e.to_string())?;
                format!("handle {}", hex(&h))
            }
            Some("accept") => {
                self.recv = host::accept(self.listen);
                core::close_listen(self.listen).map_err(|e| e.to_string())?;
                self.listen = std::ptr::null_mut();
                "ok".into()
            }
            Some("close-listen") => {
                core::close_listen(self.listen).map_err(|e| e.to_string())?;
                self.listen = std::ptr::null_mut();
                "ok".into()
            }
            // connect HANDLE [DEV]
            Some("connect") => {
                let mut h = unhex(w.get(1).ok_or("connect needs a handle")?)?;
                let dev = w
                    .get(2)
                    .map_or(Ok(0), |d| d.parse::<i32>())
                    .map_err(|e| e.to_string())?;
                self.send = weft_tests::poll_until("connect", || {
                    core::connect(self.ctx, dev, None, &mut h).expect("connect")
                });
                "ok".into()
            }
            Some("half-connect") => {
                let h = unhex(w.get(1).ok_or("half-connect needs a handle")?)?;
                self.half = Some(half_connect(&self.provider, &h)?);
                "ok".into()
            }
            Some("send") => format!(
                "ok {}",
                send(self.send, num(1)?, num(2)? as usize, num(3)? as i32)?
            ),
            Some("recv") => format!(
                "ok {}",
                recv(self.recv, num(1)?, num(2)? as usize, num(3)? as i32)?
            ),
            Some("poll") => {
                let mut b = vec![0u8; 64];
                let mh = host::reg(self.recv, &b);
                let q = host::irecv(self.recv, &mut [&mut b[..]], &[num(1)? as i32], &[mh]);
                for _ in 0..num(2)? {
                    if core::test(q).map_err(|e| e.to_string())?.is_some() {
                        return Err("the never-matched receive completed".into());
                    }
                }
                // The receive stays posted; it goes with the comm at quit.
                std::mem::forget(b);
                "ok".into()
            }
            Some("post-send") => {
                let size = num(1)? as usize;
                let b = pattern(0, num(2)? as i32, size);
                let mh = host::reg(self.send, &b);
                let mut posted = false;
                for _ in 0..num(3)? {
                    let q = host::isend_raw(
                        self.send,
                        b.as_ptr() as *mut c_void,
                        size,
                        num(2)? as i32,
                        mh,
                        std::ptr::null_mut(),
                    )
                    .map_err(|e| e.to_string())?;
                    if q.is_some() {
                        posted = true;
                        break;
                    }
                    std::thread::yield_now();
                }
                // The send (if any) may still read it: it lives until exit.
                std::mem::forget(b);
                if posted { "ok posted" } else { "ok held" }.into()
            }
            Some("coll-listen") => {
                let mut h = [0u8; 128];
                self.coll_listen =
                    weft::collnet::listen(self.ctx, 0, &mut h).map_err(|e| e.to_string())?;
                format!("handle {}", hex(&h))
            }
            // coll-connect RANK HANDLE...: builds the group (blocks).
            Some("coll-connect") => {
                let rank = num(1)? as usize;
                let hs = w[2..]
                    .iter()
                    .map(|h| unhex(h))
                    .collect::<Result<Vec<_>, _>>()?;
                self.coll = weft::collnet::connect(&hs, rank, self.coll_listen)
                    .map_err(|e| e.to_string())?;
                weft::collnet::close_listen(self.coll_listen).map_err(|e| e.to_string())?;
                "ok".into()
            }
            // coll-allreduce RANK NRANKS COUNT: runs one and checks it.
            Some("coll-allreduce") => {
                coll_allreduce(
                    self.coll,
                    num(1)? as usize,
                    num(2)? as usize,
                    num(3)? as usize,
                )?;
                "ok".into()
            }
            Some("rss") => format!("rss {}", weft_tests::status_kb("VmRSS")),
            Some("quit") => return Ok(None),
            other => return Err(format!("unknown command {other:?}")),
        }))
    }
}

fn main() {
    let mut peer = Peer {
        provider: String::new(),
        half: None,
        ctx: std::ptr::null_mut(),
        listen: std::ptr::null_mut(),
        send: std::ptr::null_mut(),
        recv: std::ptr::null_mut(),
        coll_listen: std::ptr::null_mut(),
        coll: std::ptr::null_mut(),
    };
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        match peer.run(&line) {
            Ok(Some(reply)) => {
                writeln!(out, "{reply}")
                    .and_then(|_| out.flush())
                    .expect("stdout");
            }
            Ok(None) => break,
            Err(e) => {
                writeln!(out, "error {e}")
                    .and_then(|_| out.flush())
                    .expect("stdout");
                std::process::exit(1);
            }
        }
    }
    if !peer.send.is_null() {
        core::close_send(peer.send).expect("closeSend");
    }
    if !peer.recv.is_null() {
        core::close_recv(peer.recv).expect("closeRecv");
    }
    if !peer.coll.is_null() {
        weft::collnet::close_coll(peer.coll).expect("closeColl");
    }
}
