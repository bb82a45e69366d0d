//! A small cluster on one machine: network namespaces as hosts.
//!
//! [`Cluster::new`] makes `hosts` namespaces and one switch namespace. Each
//! host has `rails` veth links, `r0`, `r1`, ..., each into a bridge of its
//! rail in the switch namespace, with address `10.(200 + rail).0.(host + 1)/24`
//! (a private range that exists only inside these namespaces). Nothing is
//! routed out of them. Everything is deleted when the cluster is dropped,
//! also when a test fails (deleting a namespace deletes its links). Needs
//! root (CI has it).

use std::process::Command;
use std::time::Instant;

/// The hosts and switch of one test.
#[derive(Debug)]
pub struct Cluster {
    prefix: String,
    hosts: usize,
    rails: usize,
}

fn ip(args: &[&str]) -> Result<(), String> {
    run(
        Command::new("ip").args(args),
        &format!("ip {}", args.join(" ")),
        " (is iproute2 installed? these tests make network namespaces: run them as root)",
    )
}

/// Runs `cmd` (described as `what`) to success; its stderr (and `hint`)
/// otherwise.
fn run(cmd: &mut Command, what: &str, hint: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}{hint}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what}: {}{hint}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Cluster {
    /// `hosts` hosts with `rails` rails each.
    pub fn new(hosts: usize, rails: usize) -> Result<Self, String> {
        // Short and unique per process: interface names have 15 bytes.
        let prefix = format!("wf{}", std::process::id() % 100_000);
        let c = Self {
            prefix,
            hosts,
            rails,
        };
        // Leftovers of a killed earlier run with the same pid are removed first.
        c.teardown();
        let sw = c.switch();
        ip(&["netns", "add", &sw])?;
        for r in 0..rails {
            let br = format!("br{r}");
            ip(&["-n", &sw, "link", "add", &br, "type", "bridge"])?;
            ip(&["-n", &sw, "link", "set", &br, "up"])?;
        }
        for h in 0..hosts {
            let ns = c.host(h);
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            for r in 0..rails {
                let (inner, outer) = (format!("r{r}"), format!("h{h}r{r}"));
                ip(&[
                    "-n", &ns, "link", "add", &inner, "type", "veth", "peer", "name", &outer,
                    "netns", &sw,
                ])?;
                ip(&["-n", &ns, "addr", "add", &c.addr(h, r, true), "dev", &inner])?;
                ip(&["-n", &ns, "link", "set", &inner, "up"])?;
                ip(&[
                    "-n",
                    &sw,
                    "link",
                    "set",
                    &outer,
                    "master",
                    &format!("br{r}"),
                ])?;
                ip(&["-n", &sw, "link", "set", &outer, "up"])?;
            }
        }
        Ok(c)
    }

    /// Host `h`'s namespace.
    pub fn host(&self, h: usize) -> String {
        format!("{}h{h}", self.prefix)
    }

    fn switch(&self) -> String {
        format!("{}sw", self.prefix)
    }

    /// Host `h`'s address on rail `r` (with the prefix length if `cidr`).
    pub fn addr(&self, h: usize, r: usize, cidr: bool) -> String {
        format!(
            "10.{}.0.{}{}",
            200 + r,
            h + 1,
            if cidr { "/24" } else { "" }
        )
    }

    /// A command run inside host `h` (`ip netns exec`).
    pub fn command(&self, h: usize, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.host(h), program]);
        c
    }

    /// Takes host `h`'s rail `r` down or up, at the switch (as a cable or
    /// a switch port would go).
    pub fn set_link(&self, h: usize, r: usize, up: bool) -> Result<(), String> {
        ip(&[
            "-n",
            &self.switch(),
            "link",
            "set",
            &format!("h{h}r{r}"),
            if up { "up" } else { "down" },
        ])
    }

    /// Shapes what host `h` sends on rail `r` with a token bucket (`tc
    /// qdisc replace ... tbf`): `rate` (tc's units, e.g. `200mbit`) and a
    /// queue of `limit` bytes; what does not fit the queue is dropped, as on
    /// a congested link. This kernel has tbf, but not netem (random loss,
    /// delay, reordering) nor any tc action to drop with.
    pub fn shape(&self, h: usize, r: usize, rate: &str, limit: u32) -> Result<(), String> {
        run(
            self.command(h, "tc")
                .args(["qdisc", "replace", "dev", &format!("r{r}"), "root", "tbf"])
                .args(["rate", rate, "burst", "16kb", "limit", &limit.to_string()]),
            &format!("tc qdisc ... tbf on host {h} rail {r}"),
            "",
        )
    }

    /// Puts the kernel's netem on what host `h` sends on rail `r` ([`netem`]).
    /// Only where the kernel has `sch_netem` (the verbs guests of `./weft
    /// test-verbs` do; this machine's kernel does not, hence [`Self::wire`]).
    pub fn netem(&self, h: usize, r: usize, args: &[&str]) -> Result<(), String> {
        netem(|| self.command(h, "tc"), &format!("r{r}"), args)
            .map_err(|e| format!("host {h}: {e}"))
    }

    /// What the qdisc of host `h`'s rail `r` reports ([`qdisc_stats`]).
    pub fn qdisc_stats(&self, h: usize, r: usize) -> String {
        qdisc_stats(self.command(h, "tc"), &format!("r{r}"))
    }

    /// Packets the queue of host `h`'s rail `r` dropped so far.
    pub fn drops(&self, h: usize, r: usize) -> Result<u64, String> {
        let out = self
            .command(h, "tc")
            .args(["-s", "qdisc", "show", "dev", &format!("r{r}")])
            .output()
            .map_err(|e| format!("tc: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.split("dropped ")
            .skip(1)
            .map(|t| {
                t.split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
                    .ok_or_else(|| format!("tc -s qdisc: {text}"))
            })
            .sum()
    }

    /// Puts a faulty wire between host `h`'s rail `r` and the rest of the
    /// rail: its switch port moves to a bridge of its own, joined to the
    /// rail's bridge by `wire` (the `weft-wire` binary) through two tap
    /// devices, which loses, delays and reorders frames as `faults` (its
    /// options) say. The wire stops when the returned handle is dropped.
    pub fn wire(&self, h: usize, r: usize, wire: &str, faults: &[&str]) -> Result<Wire, String> {
        use std::io::BufRead;
        let sw = self.switch();
        let (port, br, ta, tb) = (
            format!("h{h}r{r}"),
            format!("w{h}r{r}"),
            format!("ta{h}r{r}"),
            format!("tb{h}r{r}"),
        );
        ip(&["-n", &sw, "link", "add", &br, "type", "bridge"])?;
        for tap in [&ta, &tb] {
            ip(&["-n", &sw, "tuntap", "add", "dev", tap, "mode", "tap"])?;
        }
        ip(&["-n", &sw, "link", "set", &port, "master", &br])?;
        ip(&["-n", &sw, "link", "set", &tb, "master", &br])?;
        ip(&["-n", &sw, "link", "set", &ta, "master", &format!("br{r}")])?;
        for l in [&br, &ta, &tb] {
            ip(&["-n", &sw, "link", "set", l, "up"])?;
        }
        let mut child = Command::new("ip")
            .args(["netns", "exec", &sw, wire, &ta, &tb])
            .args(faults)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("{wire}: {e}"))?;
        let mut lines = std::io::BufReader::new(child.stdout.take().expect("piped")).lines();
        match lines.next() {
            Some(Ok(l)) if l == "ready" => {}
            other => {
                let _ = child.kill();
                return Err(format!("{wire} did not start: {other:?}"));
            }
        }
        let last = std::sync::Arc::new(std::sync::Mutex::new((Instant::now(), String::new())));
        let keep = std::sync::Arc::clone(&last);
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                *keep.lock().unwrap_or_else(|e| e.into_inner()) = (Instant::now(), l);
            }
        });
        Ok(Wire { child, last })
    }

    fn teardown(&self) {
        for h in 0..self.hosts {
            let _ = ip(&["netns", "del", &self.host(h)]);
        }
        let _ = ip(&["netns", "del", &self.switch()]);
    }

    /// Rails per host.
    pub fn rails(&self) -> usize {
        self.rails
    }
}

/// A faulty wire ([`Cluster::wire`]); stops when dropped.
#[derive(Debug)]
pub struct Wire {
    child: std::process::Child,
    last: std::sync::Arc<std::sync::Mutex<(Instant, String)>>,
}

impl Wire {
    /// What the wire did until now: `relayed N lost N early N`, from the
    /// first report it makes after this call (it reports every 100 ms).
    pub fn counts(&self) -> String {
        let asked = Instant::now();
        crate::poll_until("the wire's report", || {
            let (at, line) = &*self.last.lock().unwrap_or_else(|e| e.into_inner());
            (*at > asked).then(|| line.clone())
        })
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Puts the kernel's netem on what interface `dev` sends, as `args` say
/// alone (`tc qdisc del`, then `tc qdisc add dev DEV root netem ARGS`, e.g.
/// `loss 1%` or `delay 10ms 5ms`: a `replace` would keep the options of
/// the netem before), with `tc()` as the command (`tc`, or `ip netns exec
/// NS tc` for a host of a [`Cluster`]).
pub fn netem(tc: impl Fn() -> Command, dev: &str, args: &[&str]) -> Result<(), String> {
    clear_qdisc(tc(), dev);
    run(
        tc().args(["qdisc", "add", "dev", dev, "root", "netem"])
            .args(args),
        &format!("tc qdisc add ... netem {} on {dev}", args.join(" ")),
        "",
    )
}

/// Removes interface `dev`'s root qdisc (netem's), if it has one; run by
/// `tc` as for [`netem`].
pub fn clear_qdisc(mut tc: Command, dev: &str) {
    let _ = tc.args(["qdisc", "del", "dev", dev, "root"]).output();
}

/// What the qdiscs of interface `dev` report (`tc -s qdisc show`), run by
/// `tc` as for [`netem`].
pub fn qdisc_stats(mut tc: Command, dev: &str) -> String {
    tc.args(["-s", "qdisc", "show", "dev", dev])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_else(|e| format!("tc: {e}"))
}
