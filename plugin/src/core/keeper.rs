//! The keeper: a thread per loaded plugin that says `Alive` on every
//! connected comm and declares silent peers dead (see
//! [`crate::proto::comms`], "Liveness"). NCCL only calls into a plugin when
//! it has work for it, so a rank busy elsewhere would otherwise fall silent.
//!
//! A provider call can fail to return (seen on shm: spinning on a peer's
//! region lock after a wedged receive). So the keeper thread is watched: it
//! beats after every comm it visits, and when it stays on one comm for two
//! periods a watchdog starts a new keeper, which skips comms it cannot lock
//! (the stuck one). The stuck thread exits if it ever returns. Other comms
//! keep their heartbeats, and NCCL's calls never wait on the keeper (they
//! only try the comm's lock).
//!
//! Between periods it also runs when hurried (`proto::sync::hurry`): a comm whose
//! control message the provider refused for now (`-FI_EAGAIN`, e.g. while
//! rxm connects) keeps it queued, and the comm may not be called again soon
//! (NCCL's connect returns the comm; the peer's accept waits for that
//! message). A hurried tick progresses every comm, which sends what they
//! owe, about every 100 µs until nothing is owed.
//!
//! It starts with the first context and stops at the last `finalize`: the
//! watchdog and every keeper that finishes are joined, so an unloaded plugin
//! leaves no thread behind; a keeper still stuck in the provider then is
//! left to itself with a warning rather than hanging `finalize`.

#![forbid(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Error, Result};
use crate::proto::sync::{hurried, set_waker, take_hurry, Waker};

/// The name of a keeper thread (as `/proc/<pid>/task/*/comm` shows it).
pub const THREAD_NAME: &str = "weft-keeper";
/// The name of the watchdog thread.
pub const WATCHDOG_NAME: &str = "weft-watchdog";

/// What a tick reports as it goes: one beat per comm visited.
#[derive(Debug, Default)]
pub struct Pulse {
    beats: AtomicU64,
    busy: AtomicBool,
}

impl Pulse {
    /// Says "still moving" (after each comm).
    pub fn beat(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
    }
}

/// The work of one tick.
pub type Tick = fn(Instant, &Pulse);

#[derive(Debug)]
struct Shared {
    period: Duration,
    tick: Tick,
    stop: Mutex<bool>,
    wake: Condvar,
    /// The generation of the keeper that should run; older ones exit.
    current: AtomicU64,
    pulse: Pulse,
}

impl Waker for Shared {
    fn wake(&self) {
        let _stop = self.stop.lock().unwrap_or_else(|e| e.into_inner());
        self.wake.notify_all();
    }
}

impl Shared {
    /// The keeper's wait: one period, or less when hurried (then a pause of
    /// 100 µs, so that a provider refusing for a while is not spun on);
    /// false once stopped.
    fn sleep_or_hurry(&self) -> bool {
        let stop = self.stop.lock().unwrap_or_else(|e| e.into_inner());
        let (stop, _) = self
            .wake
            .wait_timeout_while(stop, self.period, |s| !*s && !hurried())
            .unwrap_or_else(|e| e.into_inner());
        let running = !*stop;
        drop(stop);
        if running && take_hurry() {
            std::thread::sleep(Duration::from_micros(100));
        }
        running
    }

    /// Waits one period; false once stopped.
    fn sleep(&self) -> bool {
        let stop = self.stop.lock().unwrap_or_else(|e| e.into_inner());
        let (stop, _) = self
            .wake
            .wait_timeout_while(stop, self.period, |s| !*s)
            .unwrap_or_else(|e| e.into_inner());
        !*stop
    }
}

/// The running keeper; dropping it stops and joins its threads.
#[derive(Debug)]
pub struct Keeper {
    shared: Arc<Shared>,
    watchdog: Option<JoinHandle<()>>,
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map_err(|e| {
            Error::system(format!(
                "cannot start the {name} thread: {e} (is the process out of threads or memory?)"
            ))
        })
}

fn keeper(shared: Arc<Shared>, gen: u64) {
    while shared.sleep_or_hurry() && shared.current.load(Ordering::Acquire) == gen {
        shared.pulse.busy.store(true, Ordering::Release);
        if catch_unwind(AssertUnwindSafe(|| {
            (shared.tick)(Instant::now(), &shared.pulse)
        }))
        .is_err()
        {
            tracing::error!("the keeper's heartbeat tick panicked; it carries on");
        }
        shared.pulse.busy.store(false, Ordering::Release);
        shared.pulse.beat();
    }
}

fn spawn_keeper(shared: &Arc<Shared>, gen: u64) -> Result<JoinHandle<()>> {
    let s = Arc::clone(shared);
    spawn(THREAD_NAME, move || keeper(s, gen))
}

/// Joins `t` if it finishes within `wait`; otherwise leaves it (stuck in
/// the provider) with a warning.
fn join_or_leave(t: JoinHandle<()>, wait: Duration) {
    let deadline = Instant::now() + wait;
    while !t.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    if t.is_finished() {
        let _ = t.join();
    } else {
        tracing::warn!(
            "a keeper thread is still stuck inside the provider at the last finalize; it is left running \
             (the library stays loaded). See the earlier warning for the comm it was on"
        );
    }
}

fn watchdog(shared: Arc<Shared>, first: JoinHandle<()>) {
    let mut running = first;
    let mut gen = 0;
    let mut stuck_since: Option<u64> = None;
    let mut stale = Vec::new();
    while shared.sleep() {
        let beats = shared.pulse.beats.load(Ordering::Relaxed);
        if !shared.pulse.busy.load(Ordering::Acquire) || stuck_since != Some(beats) {
            stuck_since = Some(beats);
            continue;
        }
        // Busy on the same comm for two periods: stuck in the provider.
        gen += 1;
        shared.current.store(gen, Ordering::Release);
        shared.pulse.busy.store(false, Ordering::Release);
        tracing::warn!(
            "the keeper thread has been inside one comm's provider call for over {:.1} s; a new keeper takes over \
             and skips that comm (NCCL's calls on it report \"not done\"). The provider may be wedged on a dead peer",
            (shared.period * 2).as_secs_f64()
        );
        match spawn_keeper(&shared, gen) {
            Ok(t) => stale.push(std::mem::replace(&mut running, t)),
            Err(e) => tracing::error!("{e}; heartbeats stop"),
        }
        stuck_since = None;
    }
    let wait = (shared.period * 2).max(Duration::from_secs(1));
    join_or_leave(running, wait);
    for t in stale {
        join_or_leave(t, Duration::ZERO);
    }
}

impl Keeper {
    /// Starts a keeper that calls `tick` every `period`, and its watchdog.
    pub fn start(period: Duration, tick: Tick) -> Result<Self> {
        let shared = Arc::new(Shared {
            period,
            tick,
            stop: Mutex::new(false),
            wake: Condvar::new(),
            current: AtomicU64::new(0),
            pulse: Pulse::default(),
        });
        let waker: Weak<Shared> = Arc::downgrade(&shared);
        set_waker(waker as Weak<dyn Waker>);
        let first = spawn_keeper(&shared, 0)?;
        let s = Arc::clone(&shared);
        let watchdog = match spawn(WATCHDOG_NAME, move || watchdog(s, first)) {
            Ok(w) => w,
            Err(e) => {
                Self::signal_stop(&shared);
                return Err(e);
            }
        };
        Ok(Self {
            shared,
            watchdog: Some(watchdog),
        })
    }

    fn signal_stop(shared: &Shared) {
        *shared.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
        shared.wake.notify_all();
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        Self::signal_stop(&self.shared);
        if let Some(t) = self.watchdog.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    static TICKS: AtomicU32 = AtomicU32::new(0);

    fn count(_: Instant, p: &Pulse) {
        TICKS.fetch_add(1, Ordering::SeqCst);
        p.beat();
    }

    #[test]
    fn ticks_until_dropped_then_joins() {
        let k = Keeper::start(Duration::from_millis(1), count).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while TICKS.load(Ordering::SeqCst) < 3 {
            assert!(Instant::now() < deadline, "the keeper never ticked");
            std::thread::yield_now();
        }
        drop(k);
        let after = TICKS.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            TICKS.load(Ordering::SeqCst),
            after,
            "ticked after being dropped"
        );
    }

    /// A "comm" the first keeper gets stuck in until the test lets it go.
    static STUCK: Mutex<()> = Mutex::new(());
    static OTHERS: AtomicU32 = AtomicU32::new(0);
    static ENTERED_STUCK: AtomicU32 = AtomicU32::new(0);

    fn one_stuck_comm(_: Instant, p: &Pulse) {
        // Comm 1: the provider call that does not return (while the test
        // holds STUCK). Like the real keeper, later keepers only try it.
        if ENTERED_STUCK.load(Ordering::SeqCst) == 0 {
            ENTERED_STUCK.store(1, Ordering::SeqCst);
            drop(STUCK.lock().unwrap_or_else(|e| e.into_inner()));
        } else if let Ok(g) = STUCK.try_lock() {
            drop(g);
        }
        p.beat();
        // Comm 2: healthy.
        OTHERS.fetch_add(1, Ordering::SeqCst);
        p.beat();
    }

    #[test]
    fn a_stuck_comm_does_not_stop_the_others_or_finalize() {
        let hold = STUCK.lock().unwrap();
        let k = Keeper::start(Duration::from_millis(5), one_stuck_comm).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while ENTERED_STUCK.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the keeper never ticked");
            std::thread::yield_now();
        }
        // The first keeper is now stuck; the healthy comm must go on beating.
        let before = OTHERS.load(Ordering::SeqCst);
        while OTHERS.load(Ordering::SeqCst) < before + 5 {
            assert!(
                Instant::now() < deadline,
                "heartbeats stopped while one comm was stuck"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // Stopping does not wait for the stuck thread.
        drop(k);
        drop(hold);
    }
}
