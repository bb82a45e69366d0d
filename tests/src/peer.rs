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
        let mut child = Command::new(exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {exe}: {e}"));
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        Self {
            child,
            stdin,
            stdout,
        }
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

    /// Asks the peer to quit and checks it exited cleanly.
    pub fn quit(mut self) {
        self.start("quit");
        let status = self.child.wait().expect("wait for peer");
        assert!(status.success(), "peer exited with {status}");
    }
}

/// Hex encoding of a handle, as `weft-peer` reads it.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The inverse of [`hex`].
pub fn unhex(s: &str) -> [u8; 128] {
    let v: Vec<u8> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect();
    v.try_into().expect("128-byte handle")
}
