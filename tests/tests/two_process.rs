//! The core across two processes: this test and a spawned `weft-peer`.

use weft::core;
use weft_tests::host::{self, pattern};
use weft_tests::peer::{unhex, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_weft-peer");

/// The peer receives; this process connects and sends, then the roles swap
/// on a second connection.
fn both_directions(provider: &str) {
    let mut peer = Peer::spawn(PEER);
    peer.cmd(&format!("init {provider}"));
    let ctx = host::init(provider);
    exchange(
        &mut peer,
        ctx,
        provider,
        &[(64, 0), (200, 1000), (40, 1 << 20)],
        (300, 4000),
    );
    peer.quit();
}

/// A send and a receive comm to `peer`: `count` messages of `size` bytes
/// this process -> peer for each of `to_peer`, then `from_peer` the other
/// way, every byte checked; both comms closed. `what` names the case.
fn exchange(
    peer: &mut Peer,
    ctx: *mut std::ffi::c_void,
    what: &str,
    to_peer: &[(u64, usize)],
    from_peer: (u64, usize),
) {
    let (s, r) = peer.pair(ctx);

    // This process -> peer.
    for &(count, size) in to_peer {
        peer.start(&format!("recv {count} {size} 7"));
        let msgs: Vec<Vec<u8>> = (0..count).map(|i| pattern(i, 7, size + 1)).collect();
        let mhs: Vec<_> = msgs.iter().map(|m| host::reg(s, m)).collect();
        let mut inflight = std::collections::VecDeque::new();
        for (m, &mh) in msgs.iter().zip(&mhs) {
            if inflight.len() == 8 {
                host::wait(inflight.pop_front().unwrap());
            }
            inflight.push_back(host::isend(s, &m[..size], 7, mh));
        }
        for q in inflight {
            host::wait(q);
        }
        assert_eq!(
            peer.reply(),
            format!("ok {}", count * size as u64),
            "{what}: {count} x {size} B"
        );
        for mh in mhs {
            core::dereg_mr(s, mh).unwrap();
        }
    }

    // Peer -> this process.
    let (count, size) = from_peer;
    peer.start(&format!("send {count} {size} 11"));
    let mut buf = vec![0u8; size];
    let mh = host::reg(r, &buf);
    for seq in 0..count {
        let q = host::irecv(r, &mut [&mut buf[..]], &[11], &[mh]);
        let d = host::wait(q);
        assert_eq!(d.sizes[0], size);
        assert!(
            buf == pattern(seq, 11, size),
            "{what}: message {seq} differs"
        );
    }
    assert_eq!(peer.reply(), format!("ok {}", count * size as u64));
    core::dereg_mr(r, mh).unwrap();
    core::close_send(s).unwrap();
    core::close_recv(r).unwrap();
}

/// Every test runs under `protocol` (the peer inherits the environment).
fn with_protocol(protocol: &str, provider: &str) {
    std::env::set_var("WEFT_PROTOCOL", protocol);
    both_directions(provider);
    assert_eq!(core::protocol_name().unwrap(), protocol);
}

#[test]
fn tcp_two_processes() {
    weft_tests::isolated!();
    with_protocol("rdma", "tcp");
}

#[test]
fn shm_two_processes() {
    weft_tests::isolated!();
    with_protocol("rdma", "shm");
}

#[test]
fn tcp_two_processes_sendrecv() {
    weft_tests::isolated!();
    with_protocol("sendrecv", "tcp");
}

#[test]
fn shm_two_processes_sendrecv() {
    weft_tests::isolated!();
    with_protocol("sendrecv", "shm");
}

/// rdma as on a provider with 4-byte immediates (EFA, verbs): every size
/// travels in a `Wrote` control message instead of the immediate.
#[test]
fn tcp_two_processes_narrow_immediates() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_TEST_NARROW_IMM", "1");
    with_protocol("rdma", "tcp");
}

#[test]
fn shm_two_processes_narrow_immediates() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_TEST_NARROW_IMM", "1");
    with_protocol("rdma", "shm");
}

/// rdma with registrations addressed by offset, not virtual address (shm
/// offers either; the plugin asks for offsets under the test switch).
#[test]
fn shm_two_processes_offset_addressing() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_TEST_MR_OFFSET", "1");
    with_protocol("rdma", "shm");
    assert!(
        !weft::testing::virt_addr(0).unwrap(),
        "shm was asked for offsets but reports FI_MR_VIRT_ADDR"
    );
}

/// Both protocols as on a provider that requires `FI_MR_LOCAL`,
/// `FI_MR_PROV_KEY`, `FI_MR_ALLOCATED` and `FI_MR_ENDPOINT` (neither here
/// does): Weft checks its own obligations, so a buffer posted without its
/// descriptor or with one of a registration not bound and enabled, a key
/// assumed rather than read back, or a registration of unmapped memory
/// fails the exchange (`fabric.rs` shows each check failing).
fn strict_mr_modes(protocol: &str, provider: &str) {
    std::env::set_var("WEFT_TEST_MR_MODE", "local,prov_key,allocated,endpoint");
    with_protocol(protocol, provider);
}

#[test]
fn tcp_two_processes_strict_mr_modes() {
    weft_tests::isolated!();
    strict_mr_modes("rdma", "tcp");
}

#[test]
fn shm_two_processes_strict_mr_modes() {
    weft_tests::isolated!();
    strict_mr_modes("rdma", "shm");
}

#[test]
fn tcp_two_processes_strict_mr_modes_sendrecv() {
    weft_tests::isolated!();
    strict_mr_modes("sendrecv", "tcp");
}

#[test]
fn shm_two_processes_strict_mr_modes_sendrecv() {
    weft_tests::isolated!();
    strict_mr_modes("sendrecv", "shm");
}

/// Ranks with different protocols: `connect` fails at once, naming both
/// and the setting to fix.
#[test]
fn protocol_mismatch_is_named() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_PROTOCOL", "sendrecv");
    let mut peer = Peer::spawn(PEER);
    peer.cmd("init tcp");
    std::env::set_var("WEFT_PROTOCOL", "rdma");
    let ctx = host::init("tcp");
    let mut h = unhex(peer.cmd("listen").strip_prefix("handle ").expect("handle")).unwrap();
    let e = core::connect(ctx, 0, None, &mut h).expect_err("a mismatch must fail");
    assert_eq!(e.kind, core::Kind::BadListenHandle, "{e}");
    assert!(
        e.msg.contains("sendrecv") && e.msg.contains("rdma") && e.msg.contains("WEFT_PROTOCOL"),
        "{e}"
    );
    peer.quit();
}

/// rdma as on verbs;ofi_rxm with a shared receive context, where a write's
/// remote CQ data never reaches the target: writes carry none and each is
/// announced by a `Wrote`, which tcp;ofi_rxm delivers after the write's data
/// (FI_ORDER_SAW). A receiver that waited for immediates would wait forever.
#[test]
fn tcp_two_processes_announced_writes() {
    weft_tests::isolated!();
    std::env::set_var("WEFT_TEST_ANNOUNCE_WRITES", "1");
    with_protocol("rdma", "tcp");
}

/// Both protocols on verbs;ofi_rxm over Soft-RoCE (a guest of ./weft
/// test-verbs): the peer is another process on the same rxe device.
fn verbs(provider: &str) {
    let protocol = std::env::var("WEFT_PROTOCOL").expect("set by on_verbs!");
    both_directions(provider);
    assert_eq!(core::protocol_name().unwrap(), protocol);
}
weft_tests::on_verbs!(verbs: verbs_two_processes, verbs_two_processes_sendrecv);
