//! The bootstrap connection and the two processes of a provider's run.
//!
//! A run is one TCP connection between a client process (the side that
//! times) and a server process (the side that answers). The client's first
//! line is `weft-bench 1 <provider> <raw-split> <vdev> <post-size>`; from
//! then on the client sends commands (`prep`, `rma`, `symreg`, `bw`, `lat`,
//! `quit`), one per line, and the server answers each with `ok ...`, or
//! with `error <what>` when it failed, after which it ends. The listener
//! (`--listen`, or this machine's own run) hands each accepted connection
//! to a fresh server process, whose stdin and stdout are the socket: the
//! plugin fixes its provider once per process, as NCCL's does.
//!
//! The listener trusts whoever connects, as NCCL's bootstrap does: run it
//! on the cluster's own network only.

use std::os::fd::OwnedFd;
use std::process::Child;

use nccl_net_weft::tools::fabric::Device;
use nccl_net_weft::tools::Config;

use super::*;

/// What both sides of a run must agree on.
#[derive(Debug, Default, Clone)]
pub(super) struct Options {
    /// Raw uses one endpoint per direction.
    pub(super) raw_split: bool,
    /// Weft's comms run on a virtual device of device 0 alone.
    pub(super) vdev: bool,
    /// Receives post at least this many bytes (0: the message's size).
    pub(super) post_size: usize,
}

impl Options {
    /// The client's first line.
    fn line(&self, provider: &str) -> String {
        format!(
            "weft-bench 1 {provider} {} {} {}",
            u8::from(self.raw_split),
            u8::from(self.vdev),
            self.post_size
        )
    }

    /// The provider and options of a client's first line.
    fn parse(line: &str) -> Res<(String, Self)> {
        let w: Vec<&str> = line.split_whitespace().collect();
        let flag = |i: usize| match w.get(i) {
            Some(&"0") => Ok(false),
            Some(&"1") => Ok(true),
            _ => Err(format!("not a weft bench client: {line:?}")),
        };
        match (w.first(), w.get(1), w.get(2)) {
            (Some(&"weft-bench"), Some(&"1"), Some(p)) if w.len() == 6 => Ok((
                (*p).to_owned(),
                Self {
                    raw_split: flag(3)?,
                    vdev: flag(4)?,
                    post_size: w[5]
                        .parse()
                        .map_err(|e| format!("post size {:?}: {e}", w[5]))?,
                },
            )),
            (Some(&"weft-bench"), Some(v), _) => Err(format!(
                "the client speaks weft bench protocol {v}, this side 1: run the same Weft on both hosts"
            )),
            _ => Err(format!("not a weft bench client: {line:?}")),
        }
    }
}

/// The plan of a client: what it measures, and how often.
pub(super) struct Plan {
    pub(super) sizes: Vec<usize>,
    pub(super) impls: Vec<String>,
    pub(super) opts: Options,
    pub(super) windows: Vec<usize>,
    pub(super) reps: usize,
    pub(super) quick: bool,
    pub(super) lat_max: usize,
}

impl Plan {
    /// The command line that gives a client process this plan.
    pub(super) fn args(&self) -> Vec<String> {
        let sizes: Vec<String> = self.sizes.iter().map(usize::to_string).collect();
        let mut a = vec![
            "--reps".to_owned(),
            self.reps.to_string(),
            "--impls".to_owned(),
            self.impls.join(","),
            "--sizes".to_owned(),
            sizes.join(","),
            "--post-size".to_owned(),
            self.opts.post_size.to_string(),
        ];
        for (on, flag) in [
            (self.quick, "--quick"),
            (self.opts.raw_split, "--raw-split"),
            (self.opts.vdev, "--vdev"),
        ] {
            if on {
                a.push(flag.to_owned());
            }
        }
        a
    }
}

/// The implementations of repetition `rep`, in alternating order.
pub(super) fn order(plan: &Plan, rep: usize) -> Vec<&'static str> {
    let mut v: Vec<&'static str> = IMPLS
        .into_iter()
        .filter(|i| plan.impls.iter().any(|p| p == i))
        .collect();
    if rep % 2 == 1 {
        v.reverse();
    }
    v
}

/// Accepts connections on `listener` (at most `max`), each served by a
/// fresh `weft bench --serve` process whose stdin and stdout are the
/// socket; returns those processes (with `max`) or waits for each in a
/// thread of its own (without: `--listen` serves the next run meanwhile).
pub(super) fn serve_connections(
    listener: &TcpListener,
    max: Option<usize>,
    plugin: Option<&str>,
) -> Res<Vec<Child>> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut servers = Vec::new();
    while max.is_none_or(|m| servers.len() < m) {
        let (stream, from) = listener.accept().map_err(|e| format!("accept: {e}"))?;
        if max.is_none() {
            eprintln!("weft bench: a run from {from}");
        }
        // The server never waits longer than this for its client (the
        // option goes with the socket into the server process).
        stream
            .set_read_timeout(Some(PATIENCE))
            .map_err(|e| e.to_string())?;
        let input = stream.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&exe);
        cmd.args(["bench", "--serve"])
            .stdin(Stdio::from(OwnedFd::from(input)))
            .stdout(Stdio::from(OwnedFd::from(stream)));
        if let Some(p) = plugin {
            cmd.args(["--plugin", p]);
        }
        let mut child = cmd.spawn().map_err(|e| format!("{}: {e}", exe.display()))?;
        if max.is_some() {
            servers.push(child);
        } else {
            std::thread::spawn(move || match child.wait() {
                Ok(status) => eprintln!("weft bench: the run from {from} ended ({status})"),
                Err(e) => eprintln!("weft bench: the run from {from}: {e}"),
            });
        }
    }
    Ok(servers)
}

/// Waits for a server process whose run is over (its client has its last
/// answer); one that has not exited after [`PATIENCE`] hangs in its exit,
/// and is killed with a warning: its figures are complete and checked.
pub(super) fn reap(mut server: Child) {
    let start = Instant::now();
    while start.elapsed() < PATIENCE {
        match server.try_wait() {
            Ok(Some(_)) | Err(_) => return,
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    eprintln!(
        "weft bench: warning: the server process {} did not exit within {} s after its run ended; killed",
        server.id(),
        PATIENCE.as_secs()
    );
    let _ = server.kill();
    let _ = server.wait();
}

/// The device Weft uses for `provider` (`auto`: the one it picks), found
/// the way the plugin finds it, from this process's environment.
fn device(provider: &str) -> Res<Device> {
    if provider != "auto" {
        std::env::set_var("WEFT_PROVIDER", provider);
    }
    let config = Config::from_env().map_err(|e| e.to_string())?;
    let (_, devices) = tools::survey(&config).map_err(|e| e.to_string())?;
    devices.into_iter().next().ok_or_else(|| {
        format!("Weft finds no device for provider {provider} here (`weft info` says why)")
    })
}

/// `--serve`: one run's server, on the connection that is its stdin and
/// stdout. A failure is also sent to the client, so that it ends at once
/// with the reason.
pub(super) fn serve_session(plugin: Option<String>) -> Res<()> {
    let mut out = std::io::stdout();
    let mut say = |s: &str| -> Res<()> {
        writeln!(out, "{s}")
            .and_then(|()| out.flush())
            .map_err(|e| format!("the client went away: {e}"))
    };
    let r = serve_inner(plugin, &mut say);
    if let Err(e) = &r {
        let _ = say(&format!("error {}", e.replace('\n', " ")));
    }
    r
}

fn serve_inner(plugin: Option<String>, say: &mut dyn FnMut(&str) -> Res<()>) -> Res<()> {
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut next = || -> Res<String> {
        lines
            .next()
            .ok_or("the client went away")?
            .map_err(|e| e.to_string())
    };
    let (provider, opts) = Options::parse(&next()?)?;
    POST_SIZE.get_or_init(|| opts.post_size);
    let dev = device(&provider)?;
    let lib = open_plugin(plugin)?;
    // The server speaks first; the client answers with its own hello.
    let mut side = connect(&dev, &opts, &lib, &mut *say, &mut next)?;
    let mut bufs: Option<Bufs> = None;
    loop {
        let line = next()?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Res<usize> {
            w.get(i)
                .ok_or_else(|| format!("{line:?}: missing argument"))?
                .parse()
                .map_err(|e: std::num::ParseIntError| format!("{line:?}: {e}"))
        };
        match w.first().copied() {
            Some("prep") => {
                if let Some(b) = bufs.take() {
                    b.free(&side)?;
                }
                let size = num(1)?;
                let b = bufs.insert(Bufs::new(&side, size, num(2)?)?);
                stamp(&mut b.pong.data, size, 1, PONG_SLOT);
                // Raw RMA: pongs go to the client's pong buffer; data and
                // pings come to this side's data buffer.
                side.raw.remote[Tag::Pong as usize] = (num(3)? as u64, num(4)? as u64);
                say(&format!(
                    "ok {} {}",
                    side.raw.base(&b.data),
                    b.data.raw.as_ref().map_or(0, Mr::key)
                ))?;
                continue;
            }
            Some("rma") => {
                // Weft's RMA (`put`): rank 0 here, rank 1 the client.
                let (mut put, l, mut mine) = Put::listen(&lib)?;
                let mut theirs: [u8; 128] = unhex(w.get(1).ok_or("rma: no handle")?)?
                    .try_into()
                    .map_err(|_| "rma: the handle is not 128 bytes")?;
                say(&format!("ok {}", hex(&mine)))?;
                put.connect(l, [&mut mine, &mut theirs], 0)?;
                side.put = Some(put);
            }
            Some("symreg") => {
                let b = bufs.as_mut().ok_or("prep first")?;
                let put = side.put.as_ref().ok_or("rma first")?;
                put.register(&mut b.data)?;
                put.register(&mut b.pong)?;
            }
            Some("bw") => {
                let b = bufs.as_mut().ok_or("prep first")?;
                let (imp, size, window, count) = (w[1], num(2)?, num(3)?, num(4)?);
                let n = touched(&b.data, size, count);
                clear(&mut b.data.data, size, n);
                bw_recv(side.transport(imp)?, &b.data, &b.small, size, window, count)?;
                check(&b.data.data, size, n, 0, &format!("{imp} bandwidth"))?;
            }
            Some("lat") => {
                let b = bufs.as_mut().ok_or("prep first")?;
                let (imp, size) = (w[1], num(2)?);
                clear(&mut b.data.data, size, 1);
                pong(side.transport(imp)?, &b.data, &b.pong, size, num(3)?)?;
                check(&b.data.data, size, 1, 0, &format!("{imp} pings"))?;
            }
            Some("quit") => {
                close(side, bufs)?;
                return say(&format!("ok {}", status_kb("VmHWM")));
            }
            _ => return Err(format!("unknown command {line:?}")),
        }
        say("ok")?;
    }
}

/// The server as the client sees it: the bootstrap connection.
pub(super) struct Server {
    to: TcpStream,
    from: BufReader<TcpStream>,
}

impl Server {
    /// Connects to `addr`, retrying while nothing listens there yet.
    fn connect(addr: &str) -> Res<Self> {
        let start = Instant::now();
        let to = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) if start.elapsed() > PATIENCE => {
                    return Err(format!(
                        "cannot reach {addr} ({e}): is `weft bench --listen` running there?"
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        };
        let _ = to.set_nodelay(true);
        to.set_read_timeout(Some(PATIENCE))
            .map_err(|e| e.to_string())?;
        let from = BufReader::new(to.try_clone().map_err(|e| e.to_string())?);
        Ok(Self { to, from })
    }

    pub(super) fn say(&mut self, s: &str) -> Res<()> {
        writeln!(self.to, "{s}")
            .and_then(|()| self.to.flush())
            .map_err(|e| format!("the other side: {e}"))
    }

    /// The next line, or the other side's error.
    pub(super) fn hear(&mut self) -> Res<String> {
        let mut l = String::new();
        self.from.read_line(&mut l).map_err(|e| {
            format!(
                "no word from the other side in {} s: {e}",
                PATIENCE.as_secs()
            )
        })?;
        let l = l.trim();
        if l.is_empty() {
            return Err("the other side ended without saying why (its log says)".into());
        }
        match l.strip_prefix("error ") {
            Some(e) => Err(format!("the other side failed: {e}")),
            None => Ok(l.to_owned()),
        }
    }

    pub(super) fn ok(&mut self) -> Res<String> {
        let l = self.hear()?;
        if l.starts_with("ok") {
            Ok(l)
        } else {
            Err(format!("the other side said {l:?}"))
        }
    }
}

/// One measured point, as the client reports it (a JSON line).
pub(super) fn record(
    provider: &str,
    test: &str,
    size: usize,
    window: usize,
    imp: &str,
    unit: &str,
    values: &[f64],
) -> serde_json::Value {
    serde_json::json!({
        "provider": provider, "test": test, "size": size, "window": window,
        "impl": imp, "unit": unit, "values": values,
    })
}

/// Says what runs: one line, redrawn on a terminal, else a line per step.
fn progress(provider: &str, what: &str) {
    let mut e = std::io::stderr();
    let _ = if e.is_terminal() {
        write!(e, "\r\x1b[2K  {provider}: {what}")
    } else {
        writeln!(e, "  {provider}: {what}")
    };
    let _ = e.flush();
}

/// `--client`: connects to the server at `to`, runs every round, prints
/// JSON lines.
pub(super) fn client(provider: &str, to: &str, plan: &Plan, plugin: Option<String>) -> Res<()> {
    POST_SIZE.get_or_init(|| plan.opts.post_size);
    let dev = device(provider)?;
    let label = if provider == "auto" {
        &dev.provider
    } else {
        provider
    };
    let lib = open_plugin(plugin)?;
    let mut srv = Server::connect(to)?;
    // The server opens the provider this side found.
    srv.say(&plan.opts.line(&dev.provider))?;
    let hello = srv.hear()?;
    let mut side = connect(&dev, &plan.opts, &lib, |s| srv.say(s), || Ok(hello.clone()))?;
    if plan.impls.iter().any(|i| i == "put") {
        let (mut put, l, mut mine) = Put::listen(&lib)?;
        srv.say(&format!("rma {}", hex(&mine)))?;
        let reply = srv.ok()?;
        let mut theirs: [u8; 128] =
            unhex(reply.split_whitespace().nth(1).ok_or("rma: no handle")?)?
                .try_into()
                .map_err(|_| "rma: the server's handle is not 128 bytes")?;
        put.connect(l, [&mut theirs, &mut mine], 1)?;
        srv.ok()?;
        side.put = Some(put);
    }
    let mut bufs: Option<Bufs> = None;
    let mut out = std::io::stdout();
    let mut emit = |v: serde_json::Value| -> Res<()> {
        writeln!(out, "{v}")
            .and_then(|()| out.flush())
            .map_err(|e| e.to_string())
    };
    for &size in &plan.sizes {
        let maxw = plan.windows.iter().copied().max().unwrap_or(1);
        let n = slots(size, maxw);
        if let Some(b) = bufs.take() {
            b.free(&side)?;
        }
        let b = bufs.insert(Bufs::new(&side, size, n)?);
        stamp(&mut b.data.data, size, n, 0);
        srv.say(&format!(
            "prep {size} {n} {} {}",
            side.raw.base(&b.pong),
            b.pong.raw.as_ref().map_or(0, Mr::key)
        ))?;
        let theirs: Vec<u64> = srv
            .ok()?
            .split_whitespace()
            .skip(1)
            .filter_map(|w| w.parse().ok())
            .collect();
        let [base, key] = theirs[..] else {
            return Err(format!("prep: the server sent {theirs:?}"));
        };
        side.raw.remote[Tag::Data as usize] = (base, key);
        side.raw.remote[Tag::Ping as usize] = (base, key);
        if let Some(put) = &side.put {
            // Symmetric: the server registers its data and pong buffers now too.
            srv.say("symreg")?;
            put.register(&mut b.data)?;
            put.register(&mut b.pong)?;
            srv.ok()?;
        }
        for &window in &plan.windows {
            let count = round_count(size, window, plan.quick);
            let mut vals: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
            for rep in 0..plan.reps {
                for imp in order(plan, rep) {
                    let what = format!("{imp} bandwidth {}, window {window}", human(size));
                    progress(
                        label,
                        &format!("{what}, repetition {}/{}", rep + 1, plan.reps),
                    );
                    srv.say(&format!("bw {imp} {size} {window} {count}"))?;
                    let secs =
                        bw_send(side.transport(imp)?, &b.data, &b.small, size, window, count)?
                            .as_secs_f64();
                    srv.ok()?;
                    vals.entry(imp)
                        .or_default()
                        .push((count * size) as f64 / secs / 1e6);
                    if size == 8 {
                        vals.entry(match imp {
                            "raw" => "raw-rate",
                            "rma" => "rma-rate",
                            "put" => "put-rate",
                            _ => "weft-rate",
                        })
                        .or_default()
                        .push(count as f64 / secs / 1e6);
                    }
                }
            }
            for (imp, v) in &vals {
                let (imp, test, unit) = match imp.strip_suffix("-rate") {
                    Some(i) => (i, "rate", "Mmsg/s"),
                    None => (*imp, "bw", "MB/s"),
                };
                emit(record(label, test, size, window, imp, unit, v))?;
            }
        }
        if size <= plan.lat_max {
            let iters = lat_iters(size, plan.quick);
            let mut vals: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
            for rep in 0..plan.reps {
                for imp in order(plan, rep) {
                    let what = format!("{imp} half round trip {}", human(size));
                    progress(
                        label,
                        &format!("{what}, repetition {}/{}", rep + 1, plan.reps),
                    );
                    srv.say(&format!("lat {imp} {size} {iters}"))?;
                    clear(&mut b.pong.data, size, 1);
                    let secs =
                        ping(side.transport(imp)?, &b.data, &b.pong, size, iters)?.as_secs_f64();
                    srv.ok()?;
                    check(&b.pong.data, size, 1, PONG_SLOT, &format!("{imp} pongs"))?;
                    vals.entry(imp)
                        .or_default()
                        .push(secs / (2 * iters) as f64 * 1e6);
                }
            }
            for (imp, v) in &vals {
                emit(record(label, "lat", size, 1, imp, "us", v))?;
            }
        }
    }
    progress(label, "done\n");
    close(side, bufs)?;
    srv.say("quit")?;
    let server_hwm = srv.ok()?;
    emit(serde_json::json!({
        "provider": label, "test": "memory",
        "client_hwm_kb": status_kb("VmHWM"),
        "server_hwm_kb": server_hwm.strip_prefix("ok ").and_then(|s| s.parse::<u64>().ok()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_round_trips_and_strangers_are_refused() {
        let o = Options {
            raw_split: true,
            vdev: false,
            post_size: 524_288,
        };
        let (p, back) = Options::parse(&o.line("tcp;ofi_rxm")).expect("parses");
        assert_eq!(p, "tcp;ofi_rxm");
        assert!(back.raw_split && !back.vdev && back.post_size == 524_288);
        for bad in [
            "",
            "GET / HTTP/1.1",
            "weft-bench 1 tcp 2 0 0",
            "weft-bench 1 tcp 0 0",
        ] {
            assert!(Options::parse(bad).is_err(), "{bad:?} accepted");
        }
        let e = Options::parse("weft-bench 2 tcp 0 0 0").unwrap_err();
        assert!(e.contains("same Weft on both hosts"), "{e}");
    }
}
