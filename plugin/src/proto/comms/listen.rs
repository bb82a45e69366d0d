//! The accepting side: a listener is an id on the passive endpoint.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::super::handshake::{self, Handshakes, Pending, Step};
use super::super::wire::{Ctrl, ListenHandle};
use super::super::{Comm, Listener, Receiver};
use super::*;

/// A listening comm.
pub struct ListenComm {
    dev: Arc<DeviceState>,
    path: Path,
    seat: Seat,
    nonce: u64,
    book: Mutex<Book>,
}

/// The listener's state: handshakes in progress, and what they came to
/// before NCCL's `accept` asked (the keeper moves them on meanwhile).
#[derive(Default)]
struct Book {
    shakes: Handshakes<Arc<RecvComm>, Ctrl>,
    /// Confirmed comms, oldest first, for `accept` to hand out.
    ready: VecDeque<Arc<RecvComm>>,
    /// Why the last handshake failed when nothing else was pending.
    failed: Option<String>,
}

impl std::fmt::Debug for ListenComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} ListenComm(dev {}, id {})",
            self.path, self.dev.index, self.seat.id
        )
    }
}

impl ListenComm {
    /// A listener on `dev` for comms of `path` (protocol `proto` on the
    /// wire), and its handle, which carries `nonce`.
    pub fn open(
        dev: Arc<DeviceState>,
        path: Path,
        proto: u8,
        nonce: u64,
    ) -> Result<(Self, ListenHandle)> {
        let seat = Seat::new(&dev, Port::Passive)?;
        let handle = ListenHandle {
            nonce,
            addr: seat.hub.name(Port::Passive).to_vec(),
            id: seat.id,
            proto,
        };
        Ok((
            Self {
                dev,
                path,
                seat,
                nonce: handle.nonce,
                book: Mutex::new(Book::default()),
            },
            handle,
        ))
    }

    /// A Conn opens a receive comm whose Ack `accept` sends; anything else
    /// is logged and dropped.
    fn on_ctrl(
        &self,
        book: &mut Handshakes<Arc<RecvComm>, Ctrl>,
        token: u32,
        bytes: &[u8],
    ) -> Result<()> {
        let dev = self.dev.index;
        match Ctrl::decode(bytes) {
            Ok(Ctrl::Conn {
                listener,
                conn,
                id,
                addr,
            }) if listener == self.nonce => {
                if book.repeated(conn) {
                    tracing::debug!(
                        "listener on device {dev}: a repeated Conn (answered again if pending)"
                    );
                    return Ok(());
                }
                if !book.has_room() {
                    book.refuse_logged(dev);
                    return Ok(());
                }
                if let Err(check) = self.dev.domain.check_addr(&addr) {
                    tracing::warn!(
                        "listener on device {dev}: dropped a connection request with an unusable address: {check}"
                    );
                    return Ok(());
                }
                let comm = Arc::new(RecvComm::open(Arc::clone(&self.dev), self.path)?);
                let ack = match comm.link_to(&addr, id, token) {
                    Ok(rid) => Ctrl::Ack {
                        conn,
                        credits: self.path.credits().0,
                        eager: match self.path {
                            Path::Rdma => self.seat.hub.eager_max() as u32,
                            Path::Tagged => {
                                u32::try_from(super::unannounced_max(&self.dev)).unwrap_or(u32::MAX)
                            }
                        },
                        announce: self.path == Path::Rdma && self.seat.hub.announce(),
                        id: rid,
                        addr: self.seat.hub.name(Port::Passive).to_vec(),
                    },
                    Err(e) => {
                        tracing::warn!(
                            "listener on device {dev}: dropped a connection request with an unusable address: {e}"
                        );
                        return Ok(());
                    }
                };
                book.admit_logged(
                    Pending::new(comm, conn, ack, Instant::now(), self.dev.peer_timeout),
                    dev,
                );
            }
            other => handshake::ignored_at_listener(dev, other),
        }
        Ok(())
    }

    fn step(&self, p: &mut Pending<Arc<RecvComm>, Ctrl>, now: Instant) -> Step {
        if p.due {
            match p.comm.say(p.ack.clone()) {
                // A live peer confirms as soon as it reads the Ack: an
                // answered handshake is never evicted, so it may hold its
                // place only so long (see `MAX_PENDING`).
                Ok(()) => p.answered_at(now, 2 * heartbeat_period(self.dev.peer_timeout)),
                Err(e) => {
                    return Step::Failed(format!(
                        "accept: cannot answer the connecting peer {}: {e}",
                        p.comm.peer_name()
                    ))
                }
            }
        }
        let answered = p.answered;
        match p.comm.confirmed() {
            Err(e) => Step::Failed(format!(
                "accept: handshake with {} failed: {e}",
                p.comm.peer_name()
            )),
            Ok(true) if answered => Step::Confirmed,
            Ok(_) if now > p.deadline => Step::Failed(format!(
                "accept: the connecting peer {} never confirmed the connection (within two heartbeat periods of the answer, WEFT_PEER_TIMEOUT / 4 = {:.1} s): its process died or hangs",
                p.comm.peer_name(),
                self.dev.peer_timeout.as_secs_f64() / 4.0
            )),
            Ok(_) => Step::Waiting,
        }
    }
}

impl ListenComm {
    /// Reads what arrived, answers Conns and steps every handshake; what is
    /// confirmed or failed is kept in `book` for `accept`.
    fn turn(&self, book: &mut Book) -> Result<()> {
        self.seat.poll(|ev, bytes| {
            match ev {
                Ev::Ctrl { token, .. } => self.on_ctrl(&mut book.shakes, token, bytes)?,
                other => tracing::warn!("listener: ignored {other:?}"),
            }
            Ok(())
        })?;
        let now = Instant::now();
        loop {
            match book
                .shakes
                .step_all(|p| self.step(p, now), |why| tracing::warn!("{why}"))
            {
                Ok(Some(c)) => book.ready.push_back(c),
                Ok(None) => return Ok(()),
                Err(why) => {
                    book.failed = Some(why);
                    return Ok(());
                }
            }
        }
    }
}

impl Listener for ListenComm {
    fn accept(&self) -> Result<Option<Arc<dyn Receiver>>> {
        let mut book = lock(&self.book);
        self.turn(&mut book)?;
        if let Some(c) = book.ready.pop_front() {
            return Ok(Some(c));
        }
        // NCCL connects one peer per listener: a failure is its answer only
        // when nothing else is pending.
        match book.failed.take() {
            Some(why) if book.shakes.idle() => Err(Error::peer_dead(why)),
            _ => Ok(None),
        }
    }

    fn tend(&self, now: Instant) {
        let Some(mut book) = try_lock(&self.book) else {
            return;
        };
        if let Err(e) = self.turn(&mut book) {
            tracing::warn!("listener on device {}: {e}", self.dev.index);
        }
        // Confirmed comms not handed to NCCL yet say Alive like the others.
        for c in &book.ready {
            c.keepalive(now);
        }
    }
}
