//! RMA groups of 2–4 processes (`weft-rma-rank`), each driving one of the
//! `ncclRmaPlugin_vN` tables as NCCL's RMA and GIN proxies do, on tcp and
//! shm, with NCCL's CUDA registrations made of the fake driver's device
//! memory (`tests/c/fake_cuda.c` with `WEFT_TEST_HMEM=system`): puts of
//! 0 B … 64 MiB checked the moment their signal shows (a signal seen
//! before its puts fails the rank), every signal op, signal-only ops,
//! 32 puts in flight per peer, weak signals into host memory, gets and
//! flushes, forged handles and out-of-window offsets refused; a rank that
//! dies after connecting, a stale key, `WEFT_RMA=off`. Every table between
//! two ranks on tcp and shm is the version matrix's RMA rows (`matrix.rs`).

use weft_tests::rma_group::{self, full_lacks};

const RANK: &str = env!("CARGO_BIN_EXE_weft-rma-rank");

/// Runs a group of `n` ranks; each rank's stdout, in rank order (every rank
/// must exit 0).
fn group(
    version: u32,
    n: u32,
    provider: &str,
    env: &[(&str, &str)],
    scenario: &str,
) -> Vec<String> {
    rma_group::run(RANK, version, n, provider, env, scenario)
        .into_iter()
        .enumerate()
        .map(|(r, o)| {
            println!("--- v{version} {provider} rank {r} of {n}\n{}", o.stdout);
            assert!(
                o.ok,
                "v{version} {provider} rank {r} of {n}:\n{}\n{}",
                o.stdout, o.stderr
            );
            o.stdout
        })
        .collect()
}

fn full_ok(outs: &[String], max_put: usize, v16: bool) {
    for out in outs {
        let lacks = full_lacks(out, max_put, v16);
        assert!(lacks.is_empty(), "lacks {lacks:?}:\n{out}");
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

/// Puts with announced writes, as on verbs;ofi_rxm with a shared receive
/// context (`WEFT_TEST_ANNOUNCE_WRITES`: the provider behaves as if it lost
/// a write's remote CQ data): every put is a plain `fi_write`, nothing is
/// counted at the target, and each signal is applied as it arrives, since
/// tcp;ofi_rxm delivers it after the writes issued before it (9 MiB puts:
/// two writes each). The full scenario checks every put's data the moment
/// its signal shows, so a signal that overtook its puts fails the rank.
#[test]
fn announced_writes_three_ranks_on_tcp() {
    weft_tests::isolated!();
    let env = [("MAX_PUT", "9437184"), ("WEFT_TEST_ANNOUNCE_WRITES", "1")];
    for (r, o) in rma_group::run(RANK, 16, 3, "tcp", &env, "full")
        .into_iter()
        .enumerate()
    {
        assert!(o.ok, "rank {r}:\n{}\n{}", o.stdout, o.stderr);
        let lacks = full_lacks(&o.stdout, 9 << 20, true);
        assert!(lacks.is_empty(), "rank {r} lacks {lacks:?}:\n{}", o.stdout);
        assert!(
            o.stderr
                .contains(&format!("puts to 3 rank(s) {}", rma_group::PLAIN_WRITES)),
            "rank {r} did not say its puts are plain writes:\n{}",
            o.stderr
        );
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
    let out = rma_group::run(RANK, 16, 1, "shm", &[("WEFT_RMA", "off")], "full");
    assert!(
        !out[0].ok && out[0].stdout.contains("error devices = 0"),
        "{out:?}"
    );
}
