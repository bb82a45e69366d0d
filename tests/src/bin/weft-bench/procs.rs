//! The server and client processes, and the plan of rounds they run.

use super::*;

/// `--serve`: the receiving process, driven by commands on stdin.
pub(super) fn serve(provider: &str, version: u32, split: bool) -> Res<()> {
    let lib = emu::open();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut out = std::io::stdout();
    let mut say = |s: &str| -> Res<()> {
        writeln!(out, "{s}")
            .and_then(|()| out.flush())
            .map_err(|e| e.to_string())
    };
    let mut next = || -> Res<String> {
        lines
            .next()
            .ok_or("client went away")?
            .map_err(|e| e.to_string())
    };
    // The server speaks first; the client answers with its own hello.
    let mut side = connect(provider, version, split, &lib, &mut say, &mut next)?;
    let mut bufs: Option<Bufs> = None;
    loop {
        let line = next()?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Res<usize> {
            w.get(i)
                .ok_or("missing argument")?
                .parse()
                .map_err(|e: std::num::ParseIntError| e.to_string())
        };
        match w.first().copied() {
            Some("prep") => {
                if let Some(b) = bufs.take() {
                    b.free(&side)?;
                }
                let b = bufs.insert(Bufs::new(&side, num(1)?, num(2)?)?);
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
                let b = bufs.as_ref().ok_or("prep first")?;
                bw_recv(
                    side.transport(w[1])?,
                    &b.data,
                    &b.small,
                    num(2)?,
                    num(3)?,
                    num(4)?,
                )?;
            }
            Some("lat") => {
                let b = bufs.as_ref().ok_or("prep first")?;
                pong(side.transport(w[1])?, &b.data, &b.pong, num(2)?, num(3)?)?;
            }
            Some("quit") => {
                close(side, bufs, version)?;
                return say(&format!("ok {}", weft_tests::status_kb("VmHWM")));
            }
            other => return Err(format!("unknown command {other:?}")),
        }
        say("ok")?;
    }
}

/// The server process as the client sees it.
pub(super) struct Server {
    pub(super) child: Child,
    pub(super) stdin: ChildStdin,
    pub(super) stdout: BufReader<ChildStdout>,
}

impl Server {
    pub(super) fn say(&mut self, s: &str) -> Res<()> {
        writeln!(self.stdin, "{s}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("server: {e}"))
    }
    pub(super) fn hear(&mut self) -> Res<String> {
        let mut l = String::new();
        self.stdout.read_line(&mut l).map_err(|e| e.to_string())?;
        if l.is_empty() {
            let _ = self.child.wait();
            return Err("the server process ended".into());
        }
        Ok(l.trim().to_owned())
    }
    pub(super) fn ok(&mut self) -> Res<String> {
        let l = self.hear()?;
        if l.starts_with("ok") {
            Ok(l)
        } else {
            Err(format!("server: {l}"))
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

pub(super) struct Plan {
    pub(super) sizes: Vec<usize>,
    /// "raw" and/or "weft" (both unless profiling one).
    pub(super) impls: Vec<String>,
    /// Raw uses one endpoint per direction.
    pub(super) raw_split: bool,
    pub(super) windows: Vec<usize>,
    pub(super) reps: usize,
    pub(super) quick: bool,
    pub(super) lat_max: usize,
}

/// The implementations of repetition `rep`, in alternating order.
pub(super) fn order(plan: &Plan, rep: usize) -> Vec<&'static str> {
    let mut v: Vec<&'static str> = ["raw", "rma", "weft", "put"]
        .into_iter()
        .filter(|i| plan.impls.iter().any(|p| p == i))
        .collect();
    if rep % 2 == 1 {
        v.reverse();
    }
    v
}

/// `--client`: starts the server, runs every round, prints JSON lines.
pub(super) fn client(provider: &str, version: u32, plan: &Plan) -> Res<()> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["--serve", provider, "--version", &version.to_string()])
        .args(plan.raw_split.then_some("--raw-split"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut srv = Server {
        stdin: child.stdin.take().ok_or("stdin")?,
        stdout: BufReader::new(child.stdout.take().ok_or("stdout")?),
        child,
    };
    let lib = emu::open();
    let hello = srv.hear()?;
    let mut side = connect(
        provider,
        version,
        plan.raw_split,
        &lib,
        |s| srv.say(s),
        || Ok(hello.clone()),
    )?;
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
                emit(record(provider, test, size, window, imp, unit, v))?;
            }
            eprintln!("  {provider}: bandwidth {size} B, window {window}: done");
        }
        if size <= plan.lat_max {
            let iters = lat_iters(size, plan.quick);
            let mut vals: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
            for rep in 0..plan.reps {
                for imp in order(plan, rep) {
                    srv.say(&format!("lat {imp} {size} {iters}"))?;
                    let secs =
                        ping(side.transport(imp)?, &b.data, &b.pong, size, iters)?.as_secs_f64();
                    srv.ok()?;
                    vals.entry(imp)
                        .or_default()
                        .push(secs / (2 * iters) as f64 * 1e6);
                }
            }
            for (imp, v) in &vals {
                emit(record(provider, "lat", size, 1, imp, "us", v))?;
            }
        }
    }
    close(side, bufs, version)?;
    srv.say("quit")?;
    let server_hwm = srv.ok()?;
    let _ = srv.child.wait();
    emit(serde_json::json!({
        "provider": provider, "test": "memory",
        "client_hwm_kb": weft_tests::status_kb("VmHWM"),
        "server_hwm_kb": server_hwm.strip_prefix("ok ").and_then(|s| s.parse::<u64>().ok()),
    }))
}
