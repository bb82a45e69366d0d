//! A faulty wire for the namespace cluster (tests/src/netns.rs): relays
//! Ethernet frames between two tap devices, losing, delaying and
//! reordering them as `tc qdisc ... netem` would, for kernels without
//! netem (this machine's).
//!
//! ```text
//! weft-wire TAP_A TAP_B [--loss P] [--delay MS] [--jitter MS] [--reorder P] [--seed N]
//! ```
//! Each frame, either way: lost with probability `P` (0..1); else, with
//! probability `--reorder`, sent at once, ahead of the frames held back;
//! else held `delay ± jitter` ms (uniform), so jitter reorders too. Prints
//! `ready` once both taps are open, then every 100 ms the frames it relayed,
//! lost and sent early; it runs until it is killed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// `struct ifreq` as TUNSETIFF reads it: a name and the flags.
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// Opens the existing tap device `name` (made by `ip tuntap add`).
fn open_tap(name: &str) -> Result<OwnedFd, String> {
    // SAFETY: a plain open of a device node; the result is checked.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(format!(
            "open /dev/net/tun: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = IfReq {
        name: [0; 16],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short,
        _pad: [0; 22],
    };
    let n = name.len().min(15);
    req.name[..n].copy_from_slice(&name.as_bytes()[..n]);
    // SAFETY: TUNSETIFF reads an ifreq, which `req` is laid out as.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
        return Err(format!(
            "TUNSETIFF {name}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(fd)
}

/// Frames held back, soonest first: (due in ns, arrival order, the tap
/// they go to, the frame).
type Held = BinaryHeap<Reverse<(u64, u64, usize, Vec<u8>)>>;

/// xorshift64*: reproducible with `--seed`.
struct Rng(u64);

impl Rng {
    /// Uniform in 0..1.
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: weft-wire TAP_A TAP_B [--loss P] [--delay MS] [--jitter MS] [--reorder P] [--seed N]");
        std::process::exit(2);
    }
    let opt = |name: &str, default: f64| -> f64 {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    let (loss, delay, jitter, reorder) = (
        opt("--loss", 0.0),
        opt("--delay", 0.0),
        opt("--jitter", 0.0),
        opt("--reorder", 0.0),
    );
    let mut rng = Rng(opt("--seed", 1.0) as u64 | 1);
    let taps = [
        open_tap(&args[1]).unwrap_or_else(|e| panic!("{e}")),
        open_tap(&args[2]).unwrap_or_else(|e| panic!("{e}")),
    ];
    let mut out = std::io::stdout();
    writeln!(out, "ready")
        .and_then(|()| out.flush())
        .expect("stdout");

    let start = Instant::now();
    let ns = |t: Instant| t.duration_since(start).as_nanos() as u64;
    let mut held: Held = BinaryHeap::new();
    let (mut relayed, mut lost, mut early, mut order) = (0u64, 0u64, 0u64, 0u64);
    let mut last_report = Instant::now();
    let mut buf = vec![0u8; 65536];
    loop {
        let now = ns(Instant::now());
        // Send what is due.
        while held.peek().is_some_and(|Reverse((due, ..))| *due <= now) {
            let Reverse((_, _, to, frame)) = held.pop().expect("peeked");
            // SAFETY: writes `frame` to an open tap; a full queue drops it,
            // as a wire would.
            unsafe { libc::write(taps[to].as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
            relayed += 1;
        }
        let timeout = held.peek().map_or(100, |Reverse((due, ..))| {
            ((due.saturating_sub(now)) / 1_000_000).clamp(0, 100) as i32
        });
        let mut fds = [
            libc::pollfd {
                fd: taps[0].as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: taps[1].as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        for from in 0..2 {
            if fds[from].revents & libc::POLLIN == 0 {
                continue;
            }
            loop {
                // SAFETY: reads one frame into `buf`.
                let n = unsafe {
                    libc::read(taps[from].as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
                };
                if n <= 0 {
                    break;
                }
                let frame = buf[..n as usize].to_vec();
                if rng.unit() < loss {
                    lost += 1;
                    continue;
                }
                let hold = if rng.unit() < reorder {
                    early += 1;
                    0.0
                } else {
                    (delay + jitter * (2.0 * rng.unit() - 1.0)).max(0.0)
                };
                order += 1;
                let due = ns(Instant::now()) + (hold * 1e6) as u64;
                held.push(Reverse((due, order, 1 - from, frame)));
            }
        }
        if last_report.elapsed() >= Duration::from_millis(100) {
            last_report = Instant::now();
            let _ = writeln!(out, "relayed {relayed} lost {lost} early {early}")
                .and_then(|()| out.flush());
        }
    }
}
