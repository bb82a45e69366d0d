//! A listener that is gone: connect must fail within WEFT_PEER_TIMEOUT,
//! never poll forever (the first part of "fail fast").

use std::time::{Duration, Instant};

use weft::core;
use weft_tests::host;
use weft_tests::peer::{unhex, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_weft-peer");

fn connect_to_dead_listener(provider: &str) {
    std::env::set_var("WEFT_PEER_TIMEOUT", "3");
    let mut peer = Peer::spawn(PEER);
    peer.cmd(&format!("init {provider}"));
    let mut h = unhex(peer.cmd("listen").strip_prefix("handle ").expect("handle")).unwrap();
    peer.kill();
    let ctx = host::init(provider);
    let start = Instant::now();
    let err = weft_tests::poll_until("connect to fail", || {
        match core::connect(ctx, 0, None, &mut h) {
            Ok(None) => None,
            Ok(Some(_)) => panic!("{provider}: connected to a listener whose process is dead"),
            Err(e) => Some(e),
        }
    });
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(3) + Duration::from_secs(30),
        "{provider}: took {took:?}"
    );
    assert_eq!(err.code, core::Code::Remote, "{err}");
    assert!(err.msg.contains("listener"), "{err}");
    println!("{provider}: connect to a dead listener failed after {took:?}: {err}");
}

#[test]
fn tcp_connect_to_dead_listener_fails() {
    connect_to_dead_listener("tcp");
}

#[test]
fn shm_connect_to_dead_listener_fails() {
    connect_to_dead_listener("shm");
}
