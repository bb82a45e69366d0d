//! How threads take a comm's state, for every protocol: NCCL's data path
//! never waits ([`try_lock`]), the keeper tries a few times ([`keeper_lock`]),
//! and a poisoned lock is taken anyway (a panic was already caught and
//! reported at the C boundary; the state is plain data). And how a comm
//! asks the thread that tends comms (the core's keeper) for a tick soon
//! ([`hurry`]) without knowing that thread: the keeper registers a
//! [`Waker`] here.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(feature = "testing")]
use std::sync::mpsc::{Receiver as Rx, Sender as Tx};
use std::sync::{Mutex, MutexGuard, TryLockError, Weak};

/// What wakes the thread that tends comms before its period is up.
pub trait Waker: Send + Sync {
    /// Wakes it (never waits on a comm).
    fn wake(&self);
}

/// A comm owes a control message the provider refused for now.
static HURRY: AtomicBool = AtomicBool::new(false);
/// The tending thread's waker (none, or gone, while no keeper runs).
static WAKER: Mutex<Option<Weak<dyn Waker>>> = Mutex::new(None);

/// Asks for a tick soon: a comm whose control message the provider refused
/// for now may not be called again soon, and the tick sends what it owes.
/// Cheap when already asked; never waits on a comm.
pub fn hurry() {
    if HURRY.swap(true, Ordering::AcqRel) {
        return;
    }
    let waker = lock(&WAKER).as_ref().and_then(Weak::upgrade);
    if let Some(w) = waker {
        w.wake();
    }
}

/// Whether a tick was asked for.
pub fn hurried() -> bool {
    HURRY.load(Ordering::Acquire)
}

/// Takes the request for a tick: whether there was one.
pub fn take_hurry() -> bool {
    HURRY.swap(false, Ordering::AcqRel)
}

/// The thread that tends comms from now on.
pub fn set_waker(w: Weak<dyn Waker>) {
    *lock(&WAKER) = Some(w);
}

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
#[cfg(feature = "testing")]
pub(crate) fn hold<S>(m: &Mutex<S>, held: &Tx<()>, release: &Rx<()>) {
    let _st = lock(m);
    let _ = held.send(());
    let _ = release.recv();
}
