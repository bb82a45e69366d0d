//! One measured round: bandwidth windows, ping-pong.

use super::*;

/// Slots of `size` bytes in the data buffer for a window.
pub(super) fn slots(size: usize, window: usize) -> usize {
    window.min((SLOT_BYTES / size.max(1)).max(1))
}

/// Messages in a bandwidth round: about ROUND_BYTES, whole windows.
pub(super) fn round_count(size: usize, window: usize, quick: bool) -> usize {
    let target = if quick { ROUND_BYTES / 64 } else { ROUND_BYTES };
    let n = (target / size.max(1)).clamp(window, if quick { 2000 } else { ROUND_MSGS });
    n.div_ceil(window) * window
}

/// Ping-pongs in a latency round.
pub(super) fn lat_iters(size: usize, quick: bool) -> usize {
    let n = (64 << 20) / size.max(1);
    n.clamp(10, if quick { 200 } else { 2000 })
}

/// The sender of a bandwidth round; returns the time from the first "go" to
/// the last one (the receiver's word that everything arrived).
#[inline(never)] // callgrind finds it by name
pub(super) fn bw_send(
    t: &mut dyn Transport,
    data: &Buf,
    small: &Buf,
    size: usize,
    window: usize,
    count: usize,
) -> Res<Duration> {
    let n = data.data.len().saturating_sub(post_size()) / size.max(1);
    let go = t.recv(small, 0, 4, Tag::Go)?;
    wait_all(t, &[go])?;
    let start = Instant::now();
    let mut sent = 0;
    let mut reqs = Vec::with_capacity(window);
    while sent < count {
        let next_go = t.recv(small, 0, 4, Tag::Go)?;
        reqs.clear();
        for k in 0..window {
            reqs.push(t.send(data, ((sent + k) % n.max(1)) * size, size, Tag::Data)?);
        }
        wait_all(t, &reqs)?;
        sent += window;
        wait_all(t, &[next_go])?;
    }
    Ok(start.elapsed())
}

/// The receiver of a bandwidth round: a window of receives, then "go".
#[inline(never)]
pub(super) fn bw_recv(
    t: &mut dyn Transport,
    data: &Buf,
    small: &Buf,
    size: usize,
    window: usize,
    count: usize,
) -> Res<()> {
    let n = data.data.len().saturating_sub(post_size()) / size.max(1);
    let mut got = 0;
    let mut reqs = Vec::with_capacity(window + 1);
    while got < count {
        reqs.clear();
        for k in 0..window {
            reqs.push(t.recv(data, ((got + k) % n.max(1)) * size, size, Tag::Data)?);
        }
        reqs.push(t.send(small, 8, 4, Tag::Go)?);
        wait_all(t, &reqs)?;
        got += window;
    }
    let fin = t.send(small, 8, 4, Tag::Go)?;
    wait_all(t, &[fin])
}

/// The pinging side of a latency round; returns the time of `iters` round trips.
#[inline(never)]
pub(super) fn ping(
    t: &mut dyn Transport,
    data: &Buf,
    pong: &Buf,
    size: usize,
    iters: usize,
) -> Res<Duration> {
    let mut start = Instant::now();
    for i in 0..WARMUP + iters {
        if i == WARMUP {
            start = Instant::now();
        }
        let r = t.recv(pong, 0, size, Tag::Pong)?;
        let s = t.send(data, 0, size, Tag::Ping)?;
        wait_all(t, &[s, r])?;
    }
    Ok(start.elapsed())
}

/// The answering side of a latency round.
#[inline(never)]
pub(super) fn pong(
    t: &mut dyn Transport,
    data: &Buf,
    pong: &Buf,
    size: usize,
    iters: usize,
) -> Res<()> {
    let total = WARMUP + iters;
    let mut r = t.recv(data, 0, size, Tag::Ping)?;
    for i in 0..total {
        wait_all(t, &[r])?;
        if i + 1 < total {
            r = t.recv(data, 0, size, Tag::Ping)?;
        }
        let s = t.send(pong, 0, size, Tag::Pong)?;
        wait_all(t, &[s])?;
    }
    Ok(())
}
