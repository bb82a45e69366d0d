//! Reading a completion queue: whole batches, the first error after.

#![forbid(unsafe_code)]

use crate::error::Result;
use crate::fabric::{Completion, CompletionError, Cq, CqError, FiAddr};

/// Completions read per `fi_cq_read`.
pub(crate) const CQ_BATCH: usize = 16;

/// One entry of a completion queue.
pub(crate) enum Event<'a> {
    /// An operation finished, and where from (the source address in the
    /// endpoint's AV; `FI_ADDR_NOTAVAIL` when unknown).
    Done(&'a Completion, FiAddr),
    /// An operation failed.
    Failed(CompletionError),
}

/// What [`drain`] reads: a CQ (or, in tests, a scripted queue).
pub(crate) trait CqSource {
    fn read(
        &self,
        out: &mut [Completion],
        src: &mut [FiAddr],
    ) -> std::result::Result<usize, CqError>;
}

impl CqSource for Cq {
    fn read(
        &self,
        out: &mut [Completion],
        src: &mut [FiAddr],
    ) -> std::result::Result<usize, CqError> {
        Cq::read_from(self, out, src)
    }
}

/// Reads `cq` until it is empty, handing every entry to `on`. Reading is
/// also what drives progress for rxm and shm, and on tcp every read is a
/// `poll` system call: a read that returns fewer entries than asked for
/// emptied the queue, so it is the last. Every completion read is applied
/// even when one of them fails (a completion read is gone from the queue);
/// the first error is returned after the batch.
pub(crate) fn drain(
    cq: &(impl CqSource + ?Sized),
    mut on: impl FnMut(Event<'_>) -> Result<()>,
) -> Result<()> {
    let mut c = [Completion::default(); CQ_BATCH];
    let mut src = [libfabric_sys::FI_ADDR_NOTAVAIL; CQ_BATCH];
    let mut first_err = None;
    let mut keep = |r: Result<()>| {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    };
    loop {
        match cq.read(&mut c, &mut src) {
            Ok(0) => break,
            Ok(n) => {
                for (comp, &from) in c[..n].iter().zip(&src[..n]) {
                    keep(on(Event::Done(comp, from)));
                }
                if n < c.len() {
                    break;
                }
            }
            Err(CqError::Completion(e)) => keep(on(Event::Failed(e))),
            Err(CqError::Fi(e)) => {
                keep(Err(e.into()));
                break;
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::cell::RefCell;
    use std::collections::VecDeque;
    use std::ffi::c_void;

    /// Hands out a scripted sequence of reads.
    struct Script(RefCell<VecDeque<std::result::Result<Vec<usize>, CqError>>>);

    impl CqSource for Script {
        fn read(
            &self,
            out: &mut [Completion],
            _src: &mut [FiAddr],
        ) -> std::result::Result<usize, CqError> {
            match self.0.borrow_mut().pop_front() {
                None => Ok(0),
                Some(Err(e)) => Err(e),
                Some(Ok(ids)) => {
                    for (o, id) in out.iter_mut().zip(&ids) {
                        o.op_context = *id as *mut c_void;
                    }
                    Ok(ids.len().min(out.len()))
                }
            }
        }
    }

    /// A failure while applying one completion of a batch does not drop
    /// the others already read: all are applied, then the first error is
    /// returned.
    #[test]
    fn drain_applies_the_whole_batch_before_failing() {
        let full: Vec<usize> = (1..=CQ_BATCH).collect();
        let cq = Script(RefCell::new(
            [Ok(full), Ok(vec![100, 101])].into_iter().collect(),
        ));
        let mut seen = Vec::new();
        let r = drain(&cq, |ev| {
            let Event::Done(c, _) = ev else {
                unreachable!()
            };
            let id = c.op_context as usize;
            seen.push(id);
            if id == 2 || id == 100 {
                Err(Error::system(format!("bad {id}")))
            } else {
                Ok(())
            }
        });
        let mut want: Vec<usize> = (1..=CQ_BATCH).collect();
        want.extend([100, 101]);
        assert_eq!(seen, want, "every completion read was applied");
        assert!(
            r.unwrap_err().msg.contains("bad 2"),
            "the first error is returned"
        );
    }
}
