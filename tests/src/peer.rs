//! The test side of a two-process run: spawns `weft-peer` and talks to it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// A running `weft-peer`.
#[derive(Debug)]
pub struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    /// Spawns the peer binary (its path comes from Cargo at build time).
    pub fn spawn(exe: &str) -> Self {
        Self::spawn_with(Command::new(exe))
    }

    /// Spawns the peer as `cmd` says (inside a namespace, with more
    /// environment).
    pub fn spawn_with(mut cmd: Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        Self {
            child,
            stdin,
            stdout,
        }
    }

    /// A `weft-peer` in another kernel (the other guest of `./weft
    /// test-verbs`), served by `tools/vm/remote-peer` at `addr` (`host:port`):
    /// its stdin and stdout are a TCP connection through `busybox nc`, and
    /// the first line it reads is its environment, `env` (`WEFT_*` and `FI_*`
    /// only). Its stderr goes to a log in that guest.
    pub fn remote(addr: &str, env: &[(&str, &str)]) -> Self {
        let (host, port) = addr
            .rsplit_once(':')
            .unwrap_or_else(|| panic!("a remote peer is host:port, not {addr:?}"));
        let mut p = Self::spawn_with({
            let mut nc = Command::new("busybox");
            nc.args(["nc", host, port]);
            nc
        });
        let line: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        p.start(&line.join(" "));
        p
    }

    /// Sends one command and returns the peer's answer (panics on `error`).
    pub fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").expect("write to peer");
        self.stdin.flush().expect("flush to peer");
        let mut reply = String::new();
        self.stdout.read_line(&mut reply).expect("read from peer");
        let reply = reply.trim().to_owned();
        assert!(
            !reply.is_empty() && !reply.starts_with("error"),
            "peer answered {reply:?} to {line:?}"
        );
        reply
    }

    /// Sends a command without waiting (the answer comes later with [`Peer::reply`]).
    pub fn start(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to peer");
        self.stdin.flush().expect("flush to peer");
    }

    /// Reads the answer to a started command, whatever it is (an `error`
    /// line included; empty if the peer exited).
    pub fn reply_raw(&mut self) -> String {
        let mut reply = String::new();
        let _ = self.stdout.read_line(&mut reply);
        reply.trim().to_owned()
    }

    /// Reads the answer to a started command.
    pub fn reply(&mut self) -> String {
        let mut reply = String::new();
        self.stdout.read_line(&mut reply).expect("read from peer");
        let reply = reply.trim().to_owned();
        assert!(
            !reply.is_empty() && !reply.starts_with("error"),
            "peer answered {reply:?}"
        );
        reply
    }

    /// Connects this process and the peer both ways (the peer must have run
    /// `init`): returns (send comm to the peer, receive comm from it); the
    /// peer holds the other ends.
    pub fn pair(
        &mut self,
        ctx: *mut std::ffi::c_void,
    ) -> (*mut std::ffi::c_void, *mut std::ffi::c_void) {
        let reply = self.cmd("listen");
        let mut h = unhex(reply.strip_prefix("handle ").expect("handle")).expect("peer handle");
        self.start("accept");
        let s = crate::host::connect(ctx, &mut h);
        assert_eq!(self.reply(), "ok");
        let (hh, l) = crate::host::listen(ctx);
        self.start(&format!("connect {}", hex(&hh)));
        let r = crate::host::accept(l);
        weft::core::close_listen(l).expect("closeListen");
        assert_eq!(self.reply(), "ok");
        (s, r)
    }

    /// Kills the peer (SIGKILL) and reaps it: a peer that dies.
    pub fn kill(mut self) {
        self.child.kill().expect("kill peer");
        let _ = self.child.wait();
        weft::fabric::local::remove_shm_regions(self.child.id());
    }

    /// The local ports of the peer's TCP sockets (its endpoints' listening
    /// and connected ones), from its fds and the namespace's `/proc/net/tcp`.
    pub fn tcp_ports(&self) -> Vec<u16> {
        let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|d| {
                d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                    .filter_map(|l| {
                        let l = l.to_string_lossy().into_owned();
                        Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
                    })
                    .collect()
            })
            .unwrap_or_default();
        tcp_sockets()
            .into_iter()
            .filter(|s| inodes.contains(&s.inode))
            .map(|s| s.local_port)
            .collect()
    }

    /// Asks the peer to quit and checks it exited cleanly.
    pub fn quit(mut self) {
        self.start("quit");
        let status = self.child.wait().expect("wait for peer");
        assert!(status.success(), "peer exited with {status}");
    }
}

/// Hex encoding of bytes, as the peer processes print and read handles.
pub use weft::nccl::hex;

/// A handle from hex (an error naming what was wrong).
pub fn unhex(s: &str) -> Result<[u8; 128], String> {
    let v = unhex_bytes(s).map_err(|e| format!("handle: {e}"))?;
    let n = v.len();
    v.try_into()
        .map_err(|_| format!("a handle is 256 hex digits, got {}", 2 * n))
}

/// Bytes from hex.
pub fn unhex_bytes(s: &str) -> Result<Vec<u8>, String> {
    weft::nccl::unhex(s).ok_or_else(|| format!("{s:?} is not hex bytes"))
}

/// A receiving process started with `exe --serve <version> --provider <p>
/// --messages <n>` (the demo), with the handle it printed.
#[derive(Debug)]
pub struct Server {
    /// The process.
    pub child: Child,
    /// Its stdout, after the handle line.
    pub out: BufReader<ChildStdout>,
    /// Its listen handle.
    pub handle: [u8; 128],
}

impl Server {
    /// Starts the server and reads its handle.
    pub fn spawn(
        exe: &std::path::Path,
        version: u32,
        provider: &str,
        messages: usize,
    ) -> Result<Self, String> {
        let mut child = Command::new(exe)
            .args([
                "--serve",
                &version.to_string(),
                "--provider",
                provider,
                "--messages",
                &messages.to_string(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", exe.display()))?;
        let mut out = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        out.read_line(&mut line).map_err(|e| e.to_string())?;
        let handle = unhex(
            line.trim()
                .strip_prefix("handle ")
                .ok_or_else(|| format!("receiver said {line:?}"))?,
        )?;
        Ok(Self { child, out, handle })
    }

    /// Stops the receiver (SIGKILL) after a failure and returns what it had
    /// printed, for the error message.
    pub fn abort(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        weft::fabric::local::remove_shm_regions(self.child.id());
        let mut said = String::new();
        let _ = std::io::Read::read_to_string(&mut self.out, &mut said);
        if said.trim().is_empty() {
            "nothing".to_owned()
        } else {
            said.trim().replace('\n', " | ")
        }
    }

    /// Reads the receiver's verdict (`ok <messages> <bytes>`) and waits for it.
    pub fn finish(mut self) -> Result<String, String> {
        let mut line = String::new();
        self.out.read_line(&mut line).map_err(|e| e.to_string())?;
        let status = self.child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("receiver: {} ({status})", line.trim()));
        }
        Ok(line.trim().to_owned())
    }
}

/// Waits until this process holds no TCP connection to any of `ports`
/// (established or close-wait: its provider has not closed it yet),
/// calling `progress` meanwhile (something that keeps the endpoints read).
pub fn until_closed_here(ports: &[u16], mut progress: impl FnMut()) {
    crate::poll_until("this side's connections to the peer to close", || {
        progress();
        let open = tcp_sockets()
            .iter()
            .filter(|t| ports.contains(&t.remote_port) && matches!(t.state, 1 | 8))
            .count();
        (open == 0).then_some(())
    });
}

/// One line of `/proc/net/tcp` (IPv4; Weft's tests run on 127.0.0.1).
#[derive(Debug, Clone)]
pub struct TcpSocket {
    /// Local and remote ports.
    pub local_port: u16,
    pub remote_port: u16,
    /// The kernel's state number (1 established, 8 close-wait, 10 listen).
    pub state: u8,
    /// The socket's inode, as `/proc/PID/fd` links name it.
    pub inode: String,
}

/// The TCP sockets of this network namespace.
pub fn tcp_sockets() -> Vec<TcpSocket> {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let port = |a: &str| {
        a.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(TcpSocket {
                local_port: port(f.get(1)?)?,
                remote_port: port(f.get(2)?)?,
                state: u8::from_str_radix(f.get(3)?, 16).ok()?,
                inode: (*f.get(9)?).to_owned(),
            })
        })
        .collect()
}
