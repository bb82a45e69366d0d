//! The keeper: one thread per loaded plugin that says `Alive` on every
//! connected comm and declares silent peers dead (see
//! [`crate::proto::sendrecv`], "Liveness"). NCCL only calls into a plugin when
//! it has work for it, so a rank busy elsewhere would otherwise fall silent.
//!
//! It starts with the first context and is joined at the last `finalize`, so
//! an unloaded plugin leaves no thread behind.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Error, Result};

/// The running keeper; dropping it stops and joins the thread.
#[derive(Debug)]
pub struct Keeper {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// The name of the keeper thread (as `/proc/<pid>/task/*/comm` shows it).
pub const THREAD_NAME: &str = "weft-keeper";

impl Keeper {
    /// Starts a thread that calls `tick` every `period` until dropped.
    pub fn start(period: Duration, tick: fn(Instant)) -> Result<Self> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(THREAD_NAME.to_owned())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(period) {
                    if catch_unwind(AssertUnwindSafe(|| tick(Instant::now()))).is_err() {
                        tracing::error!("the keeper's heartbeat tick panicked; it carries on");
                    }
                }
            })
            .map_err(|e| {
                Error::system(format!(
                    "cannot start the keeper thread: {e} (is the process out of threads or memory?)"
                ))
            })?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        // Closing the channel wakes the thread at once.
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    static TICKS: AtomicU32 = AtomicU32::new(0);

    fn count(_: Instant) {
        TICKS.fetch_add(1, Ordering::SeqCst);
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
}
