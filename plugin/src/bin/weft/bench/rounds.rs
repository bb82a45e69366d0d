//! One measured round: bandwidth windows, ping-pong.

use super::*;

/// Slots of `size` bytes the data buffer `data` holds (the room left at
/// its end for `--post-size` receives aside).
pub(super) fn slots_in(data: &Buf, size: usize) -> usize {
    data.data.len().saturating_sub(post_size()) / size.max(1)
}

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
    let n = slots_in(data, size);
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
    let n = slots_in(data, size);
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

/// The pattern of the sending buffers: a cycle of 251 bytes (a prime, so
/// that no power-of-two slot size repeats it), shifted per size and slot so
/// that a message landing in the wrong slot, or shifted, reads wrong.
const CYCLE: usize = 251;
/// The slot number of the pong buffer's pattern (no data slot has it).
pub(super) const PONG_SLOT: usize = 1000;
/// Bytes copied or compared at once.
const CHUNK: usize = 64 << 10;

fn cycle() -> &'static [u8] {
    static C: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    C.get_or_init(|| (0..CHUNK + CYCLE).map(|i| (i % CYCLE) as u8).collect())
}

/// The pattern of `slot`'s `len` bytes, chunk by chunk: (offset, bytes).
fn pattern(size: usize, slot: usize, len: usize) -> impl Iterator<Item = (usize, &'static [u8])> {
    let shift = (slot * 7 + size) % CYCLE;
    (0..len).step_by(CHUNK).map(move |c| {
        let n = CHUNK.min(len - c);
        let at = (c + shift) % CYCLE;
        (c, &cycle()[at..at + n])
    })
}

/// Writes the pattern of `slots` slots of `size` bytes into `buf` from
/// `first_slot` on (a sending buffer, once per size).
pub(super) fn stamp(buf: &mut [u8], size: usize, slots: usize, first_slot: usize) {
    for j in 0..slots {
        let s = &mut buf[j * size..(j + 1) * size];
        for (c, p) in pattern(size, first_slot + j, size) {
            s[c..c + p.len()].copy_from_slice(p);
        }
    }
}

/// Clears what a round will write, so that what it did not deliver reads
/// wrong afterwards.
pub(super) fn clear(buf: &mut [u8], size: usize, slots: usize) {
    buf[..size * slots].fill(0);
}

/// Checks that `slots` slots of `size` bytes in `buf` hold the sender's
/// pattern; the first wrong byte otherwise.
pub(super) fn check(
    buf: &[u8],
    size: usize,
    slots: usize,
    first_slot: usize,
    what: &str,
) -> Res<()> {
    for j in 0..slots {
        let s = &buf[j * size..(j + 1) * size];
        for (c, p) in pattern(size, first_slot + j, size) {
            let got = &s[c..c + p.len()];
            if got != p {
                let k = got.iter().zip(p).position(|(a, b)| a != b).unwrap_or(0);
                return Err(format!(
                    "{what}: {size}-byte message {j} is wrong at byte {}: {:#04x}, not {:#04x} (data corrupted or not delivered)",
                    c + k,
                    got[k],
                    p[k]
                ));
            }
        }
    }
    Ok(())
}

/// How many slots a bandwidth round of `count` messages writes.
pub(super) fn touched(data: &Buf, size: usize, count: usize) -> usize {
    let n = slots_in(data, size);
    count.min(n.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_check_finds_a_wrong_slot_a_shift_and_a_lost_byte() {
        let (size, slots) = (100_000, 3);
        let mut sent = vec![0u8; size * slots];
        stamp(&mut sent, size, slots, 0);
        check(&sent, size, slots, 0, "t").expect("its own pattern");
        // A message in the wrong slot.
        let mut got = sent.clone();
        got.copy_within(0..size, size);
        assert!(check(&got, size, slots, 0, "t").is_err());
        // Shifted by one byte.
        let mut got = vec![0u8; size * slots];
        got[1..].copy_from_slice(&sent[..size * slots - 1]);
        assert!(check(&got, size, slots, 0, "t").is_err());
        // One byte never delivered.
        let mut got = sent.clone();
        got[2 * size + 77_777] = 0;
        let e = check(&got, size, slots, 0, "t").unwrap_err();
        assert!(e.contains("message 2 is wrong at byte 77777"), "{e}");
        // The pong pattern is not a data slot's.
        let mut pong = vec![0u8; size];
        stamp(&mut pong, size, 1, PONG_SLOT);
        assert!(check(&pong, size, 1, 0, "t").is_err());
    }
}
