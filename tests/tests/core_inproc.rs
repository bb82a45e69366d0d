//! The protocol core through its Rust API, both ends in one process.

use weft::core;
use weft_tests::host::*;

fn exchange_sizes(provider: &str) {
    let ctx = init(provider);
    let (mut h, l) = listen(ctx);
    let (s, r) = connect_pair(ctx, &mut h, l);
    core::close_listen(l).unwrap();
    for (seq, len) in [0usize, 1, 7, 4096, 8192, 8193, 65536, 1 << 20, 4 << 20]
        .into_iter()
        .enumerate()
    {
        // One spare byte so even a 0-byte message has a real address.
        let src = pattern(seq as u64, 3, len + 1);
        let src = &src[..len];
        let mut dst = vec![0u8; len + 100];
        let smh = reg(s, &src[..]);
        let rmh = reg(r, &dst);
        let rq = irecv(r, &mut [&mut dst[..]], &[3], &[rmh]);
        let sq = isend(s, src, 3, smh);
        let (sd, rd) = wait2(sq, rq);
        assert_eq!(sd.sizes[0], len, "{provider}: send size");
        assert_eq!(rd.n, 1);
        assert_eq!(
            rd.sizes[0], len,
            "{provider}: a larger receive buffer reports the real size"
        );
        assert!(
            dst[..len] == src[..],
            "{provider}: {len}-byte payload differs"
        );
        core::dereg_mr(s, smh).unwrap();
        core::dereg_mr(r, rmh).unwrap();
    }
    core::close_send(s).unwrap();
    core::close_recv(r).unwrap();
}

#[test]
fn tcp_sizes() {
    exchange_sizes("tcp");
}

#[test]
fn shm_sizes() {
    exchange_sizes("shm");
}
