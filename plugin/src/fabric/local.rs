//! The endpoints of this process, by name.
//!
//! NCCL opens net connections inside one process (several GPUs per process,
//! CollNet, its own loopback tests). libfabric 1.17's shm provider crashes the
//! process when it sends to an endpoint of the same process that was closed
//! (`fi_tinject` into the unmapped region), so Weft never sends to a closed
//! local endpoint: every endpoint records its name here while it is open, and
//! a send to a local peer holds that peer's [`LocalEp`] read lock, which the
//! peer's close takes for writing before `fi_close`. A peer found closed is an
//! error for the sender, never a send.
//!
//! Names of closed endpoints are remembered too (a bounded set) for providers
//! whose names carry the process id (shm: `fi_shm://<pid>:…`), so a connect
//! to a listener of this process that was already closed is refused as well.
//! For tcp a closed endpoint's address may be reused by another process, so
//! it is not remembered (and tcp does not crash there).

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, LazyLock, Mutex, RwLock, RwLockReadGuard, Weak};

/// Closed names remembered at most (oldest forgotten first).
const CLOSED_MAX: usize = 4096;

/// One open endpoint of this process.
#[derive(Debug)]
pub struct LocalEp {
    name: Vec<u8>,
    open: RwLock<bool>,
    /// Its name can never belong to another process.
    process_unique: bool,
}

/// A read guard that keeps a local peer open while a send to it runs.
pub type OpenGuard<'a> = RwLockReadGuard<'a, bool>;

impl LocalEp {
    /// Records an endpoint that was just opened.
    pub(crate) fn register(name: Vec<u8>, process_unique: bool) -> Arc<Self> {
        let ep = Arc::new(Self {
            name,
            open: RwLock::new(true),
            process_unique,
        });
        let mut t = table();
        t.closed_forget(&ep.name);
        t.live.insert(ep.name.clone(), Arc::downgrade(&ep));
        ep
    }

    /// Marks the endpoint closed; returns once no send to it is running.
    /// Called before the endpoint is closed in libfabric.
    pub(crate) fn close(&self) {
        let mut open = self.open.write().unwrap_or_else(|e| e.into_inner());
        if !*open {
            return;
        }
        *open = false;
        let mut t = table();
        // Only this endpoint's own entry (a newer one may have its name).
        if t.live
            .get(&self.name)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), self))
        {
            t.live.remove(&self.name);
        }
        if self.process_unique {
            t.closed_remember(self.name.clone());
        }
    }

    /// A guard to hold while sending to this endpoint; `None` if closed.
    pub fn open_guard(&self) -> Option<OpenGuard<'_>> {
        let g = self.open.read().unwrap_or_else(|e| e.into_inner());
        (*g).then_some(g)
    }
}

/// Endpoints of this process open now.
#[cfg(feature = "testing")]
pub fn open_endpoints() -> usize {
    table()
        .live
        .values()
        .filter(|w| w.strong_count() > 0)
        .count()
}

/// Removes shm regions named for this process's pid that no open endpoint
/// of this process owns: a dead process that had the same pid left them
/// (shm unlinks its region when an endpoint closes; a process that exits
/// without closing, or is killed, leaves it in `/dev/shm`), and libfabric
/// 1.17's shm refuses (`EBUSY`) to open an endpoint whose region exists.
/// Returns how many were removed.
pub fn remove_stale_shm_regions() -> usize {
    remove_shm_regions(std::process::id())
}

/// Removes the shm regions of process `pid` (libfabric 1.17's shm names them
/// `/dev/shm/<pid>:<n>:<n>`) except those of endpoints open in this
/// process: for `pid` a process that is gone (killed, or exited without
/// closing). Returns how many were removed.
pub fn remove_shm_regions(pid: u32) -> usize {
    let prefix = format!("{pid}:");
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    let ours: Vec<Vec<u8>> = {
        let t = table();
        t.live
            .iter()
            .filter(|(_, w)| w.strong_count() > 0)
            .map(|(n, _)| n.split(|&b| b == 0).next().unwrap_or(n).to_vec())
            .collect()
    };
    let mut removed = 0;
    for e in dir.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        if !file.starts_with(&prefix) || ours.contains(&format!("fi_shm://{file}").into_bytes()) {
            continue;
        }
        if std::fs::remove_file(e.path()).is_ok() {
            tracing::warn!(
                "removed /dev/shm/{file}, an shm region left by an earlier process with pid {pid}; \
                 processes that exit without closing their endpoints (or are killed) leave these"
            );
            removed += 1;
        }
    }
    removed
}

/// What a peer's name says about where it lives.
#[derive(Debug, Clone)]
pub enum Locality {
    /// Another process (or not known to be this one).
    Remote,
    /// An open endpoint of this process.
    Local(Arc<LocalEp>),
    /// An endpoint of this process that was closed.
    Closed,
}

/// Looks a peer's endpoint name up.
pub fn locate(name: &[u8]) -> Locality {
    let t = table();
    if let Some(ep) = t.live.get(name).and_then(Weak::upgrade) {
        return Locality::Local(ep);
    }
    if t.closed.contains(name) {
        return Locality::Closed;
    }
    Locality::Remote
}

#[derive(Default)]
struct Table {
    live: HashMap<Vec<u8>, Weak<LocalEp>>,
    closed: HashSet<Vec<u8>>,
    closed_order: VecDeque<Vec<u8>>,
}

impl Table {
    fn closed_remember(&mut self, name: Vec<u8>) {
        if self.closed.insert(name.clone()) {
            self.closed_order.push_back(name);
        }
        while self.closed_order.len() > CLOSED_MAX {
            if let Some(old) = self.closed_order.pop_front() {
                self.closed.remove(&old);
            }
        }
    }
    fn closed_forget(&mut self, name: &[u8]) {
        if self.closed.remove(name) {
            self.closed_order.retain(|n| n != name);
        }
    }
}

fn table() -> std::sync::MutexGuard<'static, Table> {
    static T: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);
    T.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_closed_and_remote_names() {
        let a = LocalEp::register(b"fi_shm://1:0:0\0".to_vec(), true);
        let b = LocalEp::register(b"tcp-a".to_vec(), false);
        assert!(matches!(locate(b"fi_shm://1:0:0\0"), Locality::Local(_)));
        assert!(matches!(locate(b"elsewhere"), Locality::Remote));
        assert!(a.open_guard().is_some());
        a.close();
        b.close();
        assert!(a.open_guard().is_none(), "closed");
        assert!(matches!(locate(b"fi_shm://1:0:0\0"), Locality::Closed));
        assert!(
            matches!(locate(b"tcp-a"), Locality::Remote),
            "a tcp address may be reused by another process"
        );
        let again = LocalEp::register(b"fi_shm://1:0:0\0".to_vec(), true);
        assert!(matches!(locate(b"fi_shm://1:0:0\0"), Locality::Local(_)));
        again.close();
    }
}
