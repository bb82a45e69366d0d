//! Virtual devices in one process: `makeVDevice` through the core, and
//! comms on a virtual device of one rail over shm and tcp (every part of
//! the striping protocol but the second rail; two rails between hosts are
//! in tests/tests/cluster.rs).

use weft::core;
use weft_tests::host;

fn one_rail(provider: &str, protocol: &str) {
    std::env::set_var("WEFT_PROTOCOL", protocol);
    std::env::set_var("WEFT_STRIPE_SIZE", "65536");
    let ctx = host::init(provider);
    let nd = core::devices().unwrap() as i32;
    let v = core::make_vdevice(&[0], 4).expect("makeVDevice");
    assert_eq!(v, nd);
    let (s, r) = host::pair_on(ctx, v);
    for len in [1usize, 24, 4096, 65535, 65536, 1 << 20, 3 << 20] {
        host::send_verified(s, r, 7, len);
    }
    // An empty message, into a buffer of 64 bytes.
    let (src, mut dst) = (vec![1u8; 64], vec![0u8; 64]);
    let (smh, rmh) = (host::reg(s, &src), host::reg(r, &dst));
    let rq = host::irecv(r, &mut [&mut dst[..]], &[8], &[rmh]);
    let sq = host::isend(s, &src[..0], 8, smh);
    let (a, b) = host::wait2(sq, rq);
    assert_eq!((a.sizes[0], b.sizes[0]), (0, 0));
    host::close_pair(s, r);
    core::finalize(ctx).unwrap();
}

#[test]
fn one_rail_shm_rdma() {
    one_rail("shm", "rdma");
}

#[test]
fn one_rail_shm_sendrecv() {
    one_rail("shm", "sendrecv");
}

#[test]
fn one_rail_tcp_rdma() {
    one_rail("tcp", "rdma");
}

#[test]
fn one_rail_tcp_sendrecv() {
    one_rail("tcp", "sendrecv");
}
