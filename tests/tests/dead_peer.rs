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

/// closeListen with a handshake half done: everything is released, and the
/// connecting side fails within the timeout instead of hanging.
#[test]
fn tcp_close_listen_mid_handshake() {
    std::env::set_var("WEFT_PEER_TIMEOUT", "3");
    let ctx = host::init("tcp");
    let (mut h, l) = host::listen(ctx);
    // One connect step sends the Conn; one accept step reads it and opens the
    // receive comm whose Ack is still to go out.
    assert!(core::connect(ctx, 0, None, &mut h).unwrap().is_none());
    let mut accepted = None;
    for _ in 0..1000 {
        accepted = core::accept(l).unwrap();
        if accepted.is_some() {
            break;
        }
    }
    core::close_listen(l).unwrap();
    assert!(
        core::accept(l).is_err(),
        "a closed listener is an error, not freed memory"
    );
    let res = weft_tests::poll_until("connect to finish or fail", || {
        match core::connect(ctx, 0, None, &mut h) {
            Ok(None) => None,
            other => Some(other),
        }
    });
    match (accepted, res) {
        // The Ack made it out before the close: a normal connection.
        (Some(r), Ok(Some(s))) => host::close_pair(s, r),
        // Otherwise connect reports the listener gone.
        (_, Err(e)) => assert_eq!(e.code, core::Code::Remote, "{e}"),
        (a, r) => panic!("unexpected outcome: accept {a:?}, connect {r:?}"),
    }
}
