//! RMA groups of 2–4 processes (`weft-rma-rank`), each driving one of the
//! `ncclRmaPlugin_vN` tables as NCCL's RMA and GIN proxies do, on tcp and
//! shm, with NCCL's CUDA registrations made of the fake driver's device
//! memory (`tests/c/fake_cuda.c` with `WEFT_TEST_HMEM=system`): puts of
//! 0 B … 64 MiB checked the moment their signal shows (a signal seen
//! before its puts fails the rank), every signal op, signal-only ops,
//! 32 puts in flight per peer, weak signals into host memory, gets and
//! flushes, forged handles and out-of-window offsets refused; and a rank
//! that dies after connecting.

use std::process::{Child, Command, Stdio};

const RANK: &str = env!("CARGO_BIN_EXE_weft-rma-rank");
const FAKE: &str = env!("WEFT_FAKE_CUDA_DIR");

fn spawn(
    version: u32,
    rank: u32,
    n: u32,
    dir: &std::path::Path,
    provider: &str,
    env: &[(&str, &str)],
    scenario: &str,
) -> Child {
    let rest = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let mut c = Command::new(RANK);
    c.args([version.to_string(), rank.to_string(), n.to_string()])
        .arg(dir)
        .arg(scenario)
        .env("LD_LIBRARY_PATH", format!("{FAKE}:{rest}"))
        .env("WEFT_TEST_HMEM", "system")
        .env("WEFT_PROVIDER", provider)
        .env("WEFT_PROTOCOL", "rdma")
        .env("WEFT_IFACE", "lo")
        .env("FI_TCP_IFACE", "lo")
        .env("NCCL_DEBUG", "INFO")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawn weft-rma-rank")
}

/// Runs a group of `n` ranks; each rank's stdout, in rank order.
fn group(
    version: u32,
    n: u32,
    provider: &str,
    env: &[(&str, &str)],
    scenario: &str,
) -> Vec<String> {
    let dir = tempdir();
    let kids: Vec<Child> = (0..n)
        .map(|r| spawn(version, r, n, &dir, provider, env, scenario))
        .collect();
    let outs: Vec<_> = kids
        .into_iter()
        .map(|k| k.wait_with_output().expect("wait"))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    outs.iter()
        .enumerate()
        .map(|(r, o)| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            println!("--- v{version} {provider} rank {r} of {n}\n{text}");
            assert!(
                o.status.success(),
                "v{version} {provider} rank {r} of {n}: {}\n{text}\n{}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            );
            text
        })
        .collect()
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "weft-rma-{}-{:x}",
        std::process::id(),
        weft_nonce()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn weft_nonce() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

fn full_ok(outs: &[String], max_put: usize, v16: bool) {
    for out in outs {
        for size in [0usize, 1, 4096, 65536, 1 << 20] {
            if size <= max_put {
                assert!(
                    out.contains(&format!(
                        "ok put {size} B to every rank, seen with its signal"
                    )),
                    "{size}"
                );
            }
        }
        assert!(
            out.contains(&format!("ok put {max_put} B to every rank")),
            "{max_put}"
        );
        for line in [
            "ok devices 1 netDeviceType 2",
            "ok 32 puts in flight per peer, then a signal-only ADD seen after them",
            "ok weak signals into host memory",
            "ok gets from every rank, flushed",
            "ok refused: past the window, forged handle",
            "ok done",
        ] {
            assert!(out.contains(line), "{line}");
        }
        assert_eq!(out.contains("ok flushesAllPutsOnAnySignal false"), v16);
    }
}

#[test]
fn two_ranks_every_table_on_shm() {
    weft_tests::isolated!();
    for v in [13, 14, 15, 16] {
        let outs = group(v, 2, "shm", &[("MAX_PUT", "1048576")], "full");
        full_ok(&outs, 1 << 20, v == 16);
    }
}

#[test]
fn two_ranks_every_table_on_tcp() {
    weft_tests::isolated!();
    for v in [13, 14, 15, 16] {
        let outs = group(v, 2, "tcp", &[("MAX_PUT", "1048576")], "full");
        full_ok(&outs, 1 << 20, v == 16);
    }
}

/// 64 MiB puts (cut into 8 MiB writes) between two ranks, v16.
#[test]
fn puts_up_to_64_mib() {
    weft_tests::isolated!();
    for provider in ["tcp", "shm"] {
        let outs = group(16, 2, provider, &[("MAX_PUT", "67108864")], "full");
        full_ok(&outs, 64 << 20, true);
    }
}

#[test]
fn four_ranks_on_tcp_and_shm() {
    weft_tests::isolated!();
    for provider in ["tcp", "shm"] {
        let outs = group(15, 4, provider, &[("MAX_PUT", "1048576")], "full");
        full_ok(&outs, 1 << 20, false);
    }
}

/// A rank that dies after connecting: the other's requests to it fail
/// within WEFT_PEER_TIMEOUT (here 3 s), its puts to itself go on, and
/// later puts to the dead rank fail at once.
#[test]
fn a_dead_rank_fails_its_requests_and_the_others_go_on() {
    weft_tests::isolated!();
    for provider in ["tcp", "shm"] {
        let outs = group(
            14,
            2,
            provider,
            &[("WEFT_PEER_TIMEOUT", "3")],
            "die-after-connect",
        );
        assert!(outs[1].contains("ok rank 1 leaves"));
        let o = &outs[0];
        let line = o
            .lines()
            .find(|l| l.starts_with("ok the dead rank's put failed"))
            .expect("failed");
        let secs: f64 = line
            .split(" after ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(secs < 30.0, "{provider}: {line}");
        assert!(line.contains("hasError true"), "{provider}: {line}");
        assert!(
            !o.contains("ok after: put to the dead rank rc 0"),
            "{provider}"
        );
        assert!(o.contains("ok done"), "{provider}");
    }
}

/// A put through a key its target deregistered (to the provider, a
/// forged key): shm's provider refuses it, the target's memory stays as
/// it was, the signal behind it is held and, after WEFT_PEER_TIMEOUT, the
/// target declares the sender dead instead of waiting forever. (tcp's
/// provider refuses it too, and then drops the connection, so there the
/// signal never arrives: the dead-rank test covers what follows.)
#[test]
fn a_put_through_a_stale_key_is_refused_and_its_signal_held() {
    weft_tests::isolated!();
    let outs = group(16, 2, "shm", &[("WEFT_PEER_TIMEOUT", "3")], "stale-key");
    assert!(
        outs[0].contains("ok rank 0's put through the stale key"),
        "{}",
        outs[0]
    );
    assert!(
        outs[1].contains("ok the stale-key put left rank 1's memory as it was"),
        "{}",
        outs[1]
    );
}

/// `WEFT_RMA=off`: the same rank, with GPU memory registrable, is told
/// there are no RMA devices (NCCL would use its own backends).
#[test]
fn weft_rma_off_claims_no_device() {
    weft_tests::isolated!();
    let dir = tempdir();
    let out = spawn(16, 0, 1, &dir, "shm", &[("WEFT_RMA", "off")], "full")
        .wait_with_output()
        .expect("wait");
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && text.contains("error devices = 0"),
        "{text}"
    );
}
