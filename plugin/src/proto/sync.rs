//! How threads take a comm's state, for every protocol: NCCL's data path
//! never waits ([`try_lock`]), the keeper tries a few times ([`keeper_lock`]),
//! and a poisoned lock is taken anyway (a panic was already caught and
//! reported at the C boundary; the state is plain data).

use std::sync::mpsc::{Receiver as Rx, Sender as Tx};
use std::sync::{Mutex, MutexGuard, TryLockError};

/// How often a comm's lock is tried before the keeper skips it for a tick.
const KEEPER_TRIES: u32 = 64;

/// Takes the lock, waiting (set-up and tear-down paths only).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A comm's state for a data-path call (`isend`, `irecv`, `test`), or `None`
/// while another thread holds it: the call then answers "not yet" (a NULL
/// request, not done) instead of waiting, so NCCL's progress thread never
/// blocks behind the keeper, even one stuck inside the provider.
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// The keeper's way in: a few tries, then the comm is skipped for this tick
/// (NCCL's thread is using it, and what it does keeps the peer informed).
pub(crate) fn keeper_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    for _ in 0..KEEPER_TRIES {
        if let Some(g) = try_lock(m) {
            return Some(g);
        }
        std::thread::yield_now();
    }
    None
}

/// Holds a comm's state lock until `release` fires (or its sender goes),
/// signalling `held` once it is held: what a keeper stuck inside the
/// provider does. For tests of the data path's independence.
pub(crate) fn hold<S>(m: &Mutex<S>, held: &Tx<()>, release: &Rx<()>) {
    let _st = lock(m);
    let _ = held.send(());
    let _ = release.recv();
}
