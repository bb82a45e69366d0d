//! `tracing` -> NCCL's logger.
//!
//! NCCL hands a C-variadic `ncclDebugLogger_t` to `init`. Every `tracing`
//! event is forwarded to it with a constant `"%s"` format and the rendered
//! text as its one argument, so text from a peer or a path can never act as a
//! format string. Until a logger is set, events are dropped: the plugin never
//! prints to stdout or stderr on its own.
//!
//! Levels: ERROR and WARN -> `NCCL_LOG_WARN`, INFO -> `NCCL_LOG_INFO`,
//! DEBUG and TRACE -> `NCCL_LOG_TRACE`. Subsystem: events with a target under
//! `weft::init` carry `NCCL_INIT | NCCL_NET`, all others `NCCL_NET`.

use std::ffi::{c_char, c_int, c_ulong, CString};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Once;

use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

/// `ncclDebugLogger_t`.
pub type NcclDebugLogger = unsafe extern "C" fn(
    level: c_int,
    flags: c_ulong,
    file: *const c_char,
    line: c_int,
    fmt: *const c_char,
    ...
);

/// `ncclDebugLogLevel` values (reference §3.3).
pub mod level {
    /// `NCCL_LOG_WARN`.
    pub const WARN: i32 = 2;
    /// `NCCL_LOG_INFO`.
    pub const INFO: i32 = 3;
    /// `NCCL_LOG_TRACE`.
    pub const TRACE: i32 = 5;
}

/// `ncclDebugLogSubSys` flags used by Weft.
pub mod subsys {
    /// `NCCL_INIT`.
    pub const INIT: u64 = 0x1;
    /// `NCCL_NET`.
    pub const NET: u64 = 0x10;
}

/// Text put before every message, as NCCL's own transports do (`NET/IB : ...`).
pub const PREFIX: &str = "NET/Weft : ";

static LOGGER: AtomicUsize = AtomicUsize::new(0);
/// Most verbose NCCL level that is forwarded (from `NCCL_DEBUG`), to keep
/// formatting off the hot path when NCCL would drop the line anyway.
static MAX_LEVEL: AtomicU8 = AtomicU8::new(level::TRACE as u8);

/// Installs NCCL's logger (`None` removes it) and makes sure the forwarding
/// layer is the process's `tracing` subscriber. Called from every `init`.
pub fn set_logger(logger: Option<NcclDebugLogger>) {
    install_subscriber();
    let max = match std::env::var("NCCL_DEBUG")
        .unwrap_or_default()
        .to_ascii_uppercase()
        .as_str()
    {
        "TRACE" => level::TRACE,
        "INFO" => level::INFO,
        _ => level::WARN,
    };
    MAX_LEVEL.store(max as u8, Ordering::Relaxed);
    LOGGER.store(logger.map_or(0, |f| f as usize), Ordering::Release);
}

/// Installs [`NcclLayer`] as the global subscriber once. If the host process
/// (a Rust test, a bench) already set one, that one stays.
pub fn install_subscriber() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::registry().with(NcclLayer).try_init();
    });
}

fn logger() -> Option<NcclDebugLogger> {
    match LOGGER.load(Ordering::Acquire) {
        0 => None,
        // SAFETY: the only non-zero values stored are `NcclDebugLogger`
        // function pointers (set_logger), so this round-trips one.
        p => Some(unsafe { std::mem::transmute::<usize, NcclDebugLogger>(p) }),
    }
}

/// Maps a `tracing` level to NCCL's.
pub fn nccl_level(l: &Level) -> i32 {
    match *l {
        Level::ERROR | Level::WARN => level::WARN,
        Level::INFO => level::INFO,
        _ => level::TRACE,
    }
}

/// Maps an event target to NCCL subsystem flags.
pub fn nccl_flags(target: &str) -> u64 {
    if target.starts_with("weft::init") {
        subsys::INIT | subsys::NET
    } else {
        subsys::NET
    }
}

/// The layer that forwards events to NCCL's logger.
#[derive(Debug, Clone, Copy, Default)]
pub struct NcclLayer;

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

/// Renders an event's message and fields as one line.
fn render(event: &Event<'_>) -> String {
    let mut t = Text(String::from(PREFIX));
    event.record(&mut t);
    t.0
}

/// A C string with interior NULs replaced, so no text is ever lost.
fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

impl<S: Subscriber> Layer<S> for NcclLayer {
    // Whether a callsite is wanted changes at run time (set_logger, NCCL_DEBUG),
    // so tracing must ask `enabled` every time rather than cache a verdict.
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        Interest::sometimes()
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        LOGGER.load(Ordering::Relaxed) != 0
            && nccl_level(meta.level()) <= i32::from(MAX_LEVEL.load(Ordering::Relaxed))
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let Some(log) = logger() else { return };
        let meta = event.metadata();
        let text = c_string(&render(event));
        let file = c_string(meta.file().unwrap_or("weft"));
        let line = meta
            .line()
            .and_then(|l| c_int::try_from(l).ok())
            .unwrap_or(0);
        // SAFETY: NCCL's logger is a printf-like variadic function; the format
        // is the constant "%s" and the one argument is a NUL-terminated string
        // that outlives the call. `file` is NUL-terminated too.
        unsafe {
            log(
                nccl_level(meta.level()),
                nccl_flags(meta.target()) as c_ulong,
                file.as_ptr(),
                line,
                c"%s".as_ptr(),
                text.as_ptr(),
            );
        }
    }
}

/// For Weft's own programs (`weft-reducer`): every event at `max` or
/// more severe goes to stderr as one line, level first, instead of to an
/// NCCL logger. Installed as the process's subscriber; call it before the
/// first `init`.
pub fn to_stderr(max: Level) {
    let _ = tracing_subscriber::registry()
        .with(StderrLayer(max))
        .try_init();
}

struct StderrLayer(Level);

impl<S: Subscriber> Layer<S> for StderrLayer {
    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        *meta.level() <= self.0
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let text = render(event);
        eprintln!(
            "{:5} {}",
            event.metadata().level(),
            text.strip_prefix(PREFIX).unwrap_or(&text)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_flags() {
        assert_eq!(nccl_level(&Level::ERROR), level::WARN);
        assert_eq!(nccl_level(&Level::WARN), level::WARN);
        assert_eq!(nccl_level(&Level::INFO), level::INFO);
        assert_eq!(nccl_level(&Level::DEBUG), level::TRACE);
        assert_eq!(nccl_level(&Level::TRACE), level::TRACE);
        assert_eq!(nccl_flags("weft::init"), subsys::INIT | subsys::NET);
        assert_eq!(nccl_flags("nccl_net_weft::fabric"), subsys::NET);
    }

    #[test]
    fn nul_bytes_do_not_drop_text() {
        assert_eq!(c_string("a\0b").to_str().unwrap(), "a\\0b");
    }
}
