//! The core across two processes: this test and a spawned `weft-peer`.

use weft::core;
use weft_tests::host::{self, pattern};
use weft_tests::peer::Peer;

const PEER: &str = env!("CARGO_BIN_EXE_weft-peer");

/// The peer receives; this process connects and sends, then the roles swap
/// on a second connection.
fn both_directions(provider: &str) {
    let mut peer = Peer::spawn(PEER);
    peer.cmd(&format!("init {provider}"));
    let ctx = host::init(provider);

    let (s, r) = peer.pair(ctx);

    // This process -> peer.
    for (count, size) in [(64u64, 0usize), (200, 1000), (40, 1 << 20)] {
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
            "{provider}: {count} x {size} B"
        );
        for mh in mhs {
            core::dereg_mr(s, mh).unwrap();
        }
    }

    // Peer -> this process.
    let (count, size) = (300u64, 4000usize);
    peer.start(&format!("send {count} {size} 11"));
    let mut buf = vec![0u8; size];
    let mh = host::reg(r, &buf);
    for seq in 0..count {
        let q = host::irecv(r, &mut [&mut buf[..]], &[11], &[mh]);
        let d = host::wait(q);
        assert_eq!(d.sizes[0], size);
        assert!(
            buf == pattern(seq, 11, size),
            "{provider}: message {seq} differs"
        );
    }
    assert_eq!(peer.reply(), format!("ok {}", count * size as u64));
    core::dereg_mr(r, mh).unwrap();
    core::close_send(s).unwrap();
    core::close_recv(r).unwrap();
    peer.quit();
}

#[test]
fn tcp_two_processes() {
    weft_tests::isolated!();
    both_directions("tcp");
}

#[test]
fn shm_two_processes() {
    weft_tests::isolated!();
    both_directions("shm");
}
