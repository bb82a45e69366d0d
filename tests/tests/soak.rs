//! A cluster's bad day, bounded: 8 processes on 4 namespace hosts (a rank of
//! each protocol per host, 4 rdma ranks and 4 sendrecv ranks, over tcp on
//! the hosts' two rails), opening and closing comms all the time (`weft-soak
//! rank`: new comms every epoch, on rail 0, rail 1 or the virtual device
//! that fuses both, in turn; 6 verified messages each way from 8 B to
//! 1 MiB; one epoch in 7 aborted with transfers in flight), ranks SIGKILLed and started again every few seconds, and a third
//! party per protocol (`weft-soak garbage`) sending junk, forged control
//! messages and forged `Conn`s to every listener as it appears (tagged junk
//! too at the rdma ranks). What must hold: every byte verified; a failure is
//! taken only from a comm whose partner was killed or replaced; RSS and fds
//! of the ranks that were never killed flat after warm-up. The counts are
//! printed.
//!
//! Run by `./weft soak [SECONDS]` (600 s by default; `WEFT_SOAK_SECS`), not
//! by `./weft test`: see docs/testing.md for why.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use weft_tests::netns::Cluster;

const SOAK: &str = env!("CARGO_BIN_EXE_weft-soak");
const PROTOCOLS: [&str; 2] = ["rdma", "sendrecv"];
const HOSTS: usize = 4;

/// The last `n` lines of the log at `path`.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Starts a soak process on host `h`; Weft's log (stderr) goes to `log`.
fn spawn(c: &Cluster, h: usize, protocol: &str, args: &[String], log: &Path) -> Child {
    let mut cmd = c.command(h, SOAK);
    cmd.args(args)
        .env("WEFT_PROTOCOL", protocol)
        .env("WEFT_PROVIDER", "tcp")
        // Both rails as devices: an epoch runs on rail 0, rail 1 or the
        // virtual device of both.
        .env("WEFT_IFACE", "r")
        .env("FI_TCP_IFACE", "r")
        .env("WEFT_PEER_TIMEOUT", "5")
        // The provider's own warnings go into the same log.
        .env("FI_LOG_LEVEL", "warn")
        .env("WEFT_SOAK_ABORT", "1")
        .env("NCCL_DEBUG", "WARN")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).expect("a log file"));
    cmd.spawn().expect("spawn weft-soak")
}

/// A field `name N` of a rank's line.
fn field(line: &str, name: &str) -> u64 {
    let mut it = line.split(' ');
    while let Some(w) = it.next() {
        if w == name {
            return it.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        }
    }
    0
}

#[test]
#[ignore = "a separate command: ./weft soak [SECONDS] (it would double ./weft test's time)"]
fn a_clusters_bad_day() {
    weft_tests::isolated!();
    let secs: u64 = std::env::var("WEFT_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let c = Cluster::new(HOSTS, 2).expect("the cluster");
    let root = std::env::temp_dir().join(format!("weft-soak-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let end = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + secs;
    let rank_args = |p: &str, r: usize| -> Vec<String> {
        let dir = root.join(p);
        vec![
            "rank".into(),
            r.to_string(),
            HOSTS.to_string(),
            dir.to_string_lossy().into_owned(),
            end.to_string(),
        ]
    };
    // Weft's log of every process, one file each, kept when the soak fails.
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let mut started = 0usize;
    let mut log = |what: &str| {
        started += 1;
        logs.join(format!("{started:03}-{what}.log"))
    };
    // ranks[g][h]: the rank of protocol g on host h, whether it is the
    // first of its line (never killed), and its log.
    let mut ranks: Vec<Vec<Option<(Child, bool, PathBuf)>>> = Vec::new();
    for p in PROTOCOLS {
        std::fs::create_dir_all(root.join(p)).unwrap();
        let mut row = Vec::new();
        for h in 0..HOSTS {
            let l = log(&format!("{p}-{h}"));
            row.push(Some((spawn(&c, h, p, &rank_args(p, h), &l), true, l)));
        }
        ranks.push(row);
    }
    let garbage: Vec<Child> = PROTOCOLS
        .iter()
        .enumerate()
        .map(|(g, p)| {
            let dir = root.join(p).to_string_lossy().into_owned();
            let tagged = if *p == "rdma" { "1" } else { "0" };
            let args = ["garbage".into(), dir, secs.to_string(), tagged.into()];
            spawn(&c, (g + 1) % HOSTS, p, &args, &log(&format!("garbage-{p}")))
        })
        .collect();
    // Kill a rank every few seconds (never the two of host 0, whose RSS and
    // fds are the survivors' figures) and start it again.
    let start = Instant::now();
    let mut kills = 0usize;
    let mut lines = Vec::new();
    let mut victim = 0usize;
    while start.elapsed() + Duration::from_secs(8) < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(4));
        let g = victim % 2;
        let h = 1 + (victim / 2) % (HOSTS - 1);
        victim += 1;
        let (mut child, _, l) = ranks[g][h].take().expect("a rank");
        let _ = child.kill();
        let out = child.wait_with_output().expect("the killed rank");
        if let Some(line) = String::from_utf8_lossy(&out.stdout).lines().next() {
            // It finished before the kill.
            lines.push((PROTOCOLS[g], h, line.to_owned(), false, l));
        }
        let l = log(&format!("{}-{h}", PROTOCOLS[g]));
        ranks[g][h] = Some((
            spawn(&c, h, PROTOCOLS[g], &rank_args(PROTOCOLS[g], h), &l),
            false,
            l,
        ));
        kills += 1;
    }
    for (g, row) in ranks.into_iter().enumerate() {
        for (h, (child, first, l)) in row.into_iter().flatten().enumerate() {
            let out = child.wait_with_output().expect("a rank");
            let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            lines.push((PROTOCOLS[g], h, line, first, l));
        }
    }
    let mut junk = Vec::new();
    for g in garbage {
        let out = g.wait_with_output().expect("the third party");
        junk.push(String::from_utf8_lossy(&out.stdout).trim().to_owned());
    }
    println!(
        "soak: {secs} s, 8 ranks on 4 hosts, {kills} kills and restarts; third parties: {junk:?}"
    );
    let (mut epochs, mut msgs, mut bytes, mut gone, mut aborted, mut fused) = (0, 0, 0, 0, 0, 0);
    for (p, h, l, first, log) in &lines {
        println!(
            "  {p} host {h}{}: {l}",
            if *first { " (never killed)" } else { "" }
        );
        assert!(
            l.starts_with("ok"),
            "{p} rank on host {h}: {l}\nthe end of its log ({}):\n{}",
            log.display(),
            tail(log, 40)
        );
        epochs += field(l, "epochs");
        msgs += field(l, "msgs");
        bytes += field(l, "bytes");
        gone += field(l, "gone");
        aborted += field(l, "aborted");
        fused += field(l, "fused");
        if *first && field(l, "epochs") > 8 {
            let rss = field(l, "rss1").saturating_sub(field(l, "rss0")) / 1024;
            let fds = field(l, "fds1").saturating_sub(field(l, "fds0"));
            assert!(
                rss < 32,
                "{p} host {h}: RSS grew by {rss} MB after warm-up: {l}"
            );
            assert!(fds <= 8, "{p} host {h}: {fds} more fds after warm-up: {l}");
        }
    }
    for j in &junk {
        assert!(j.starts_with("ok garbage"), "third party: {j}");
    }
    println!(
        "soak: {epochs} epochs ({fused} of them verified on the virtual device), {msgs} messages, {} MB verified, {gone} epochs skipped for a killed partner, {aborted} aborted",
        bytes >> 20
    );
    assert!(msgs > 0 && bytes > 0, "something moved");
    assert!(
        fused > 0,
        "some epochs moved their data on the virtual device"
    );
    let _ = std::fs::remove_dir_all(&root);
}
