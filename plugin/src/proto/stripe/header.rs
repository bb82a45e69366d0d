//! The header that opens every message on a virtual device, and how a message is cut over the rails (`layout`): both sides cut alike from it.

use super::*;

/// Bytes of a message header.
pub const HEADER_LEN: usize = 24;
/// A header slot: a header and, for a message of at most [`INLINE_MAX`]
/// bytes between host-memory devices, the message itself.
pub const SLOT: usize = 4096;
/// The largest message that travels inside its header.
pub const INLINE_MAX: usize = SLOT - HEADER_LEN;
pub(super) const HEADER_MAGIC: u32 = 0x5746_5348; // "WFSH"
/// Stripes are multiples of this (whole pages on either side).
pub const STRIPE_ALIGN: usize = 4096;

/// One part of a message: `len` bytes at `off`, over rail `rail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Part {
    /// The rail.
    pub rail: usize,
    /// Offset in the message.
    pub off: usize,
    /// Length.
    pub len: usize,
}

/// A message's parts, at most one per rail, in message order (a fixed
/// array: cutting a message allocates nothing).
#[derive(Debug, Clone, Copy, Default)]
pub struct Parts {
    pub(super) n: usize,
    pub(super) p: [Part; MAX_RAILS],
}

impl std::ops::Deref for Parts {
    type Target = [Part];
    fn deref(&self) -> &[Part] {
        &self.p[..self.n]
    }
}

/// How a message of `size` bytes goes over `rails` rails (at most
/// [`MAX_RAILS`]): one part on rail `first` below `stripe` bytes (or on one
/// rail), else one part per rail in [`STRIPE_ALIGN`]-aligned slices of
/// equal size (the last may be shorter; a rail whose slice would start past
/// the end gets none), starting with rail `first`. Parts are in message
/// order and cover it exactly.
pub fn layout(size: usize, rails: usize, first: usize, stripe: usize) -> Parts {
    let rails = rails.clamp(1, MAX_RAILS);
    let first = first % rails;
    let mut parts = Parts::default();
    if rails == 1 || size < stripe.max(1) {
        parts.p[0] = Part {
            rail: first,
            off: 0,
            len: size,
        };
        parts.n = 1;
        return parts;
    }
    let slice = size.div_ceil(rails).next_multiple_of(STRIPE_ALIGN);
    for i in 0..rails {
        let off = i * slice;
        if off >= size {
            break;
        }
        parts.p[i] = Part {
            rail: (first + i) % rails,
            off,
            len: slice.min(size - off),
        };
        parts.n = i + 1;
    }
    parts
}

/// A message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The message's number among its tag's.
    pub number: u32,
    /// Its size.
    pub size: u64,
    /// The rail its first part goes over.
    pub first: u8,
    /// The message follows the header in the same message (no parts).
    pub inline: bool,
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.number.to_le_bytes());
        b[8..16].copy_from_slice(&self.size.to_le_bytes());
        b[16] = self.first;
        b[17] = u8::from(self.inline);
        b
    }

    /// Reads and checks the header of message `number` on a comm of `rails`
    /// rails from the bytes that arrived (the header, and an inline
    /// message's bytes after it); `Err` says what is wrong with it.
    pub fn decode(b: &[u8], number: u32, rails: usize) -> std::result::Result<Self, String> {
        if b.len() < HEADER_LEN {
            return Err(format!(
                "a message header of {} bytes (at least {HEADER_LEN})",
                b.len()
            ));
        }
        let magic = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != HEADER_MAGIC {
            return Err(format!(
                "a message header that is not Weft's (magic {magic:#010x})"
            ));
        }
        let h = Header {
            number: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            size: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            first: b[16],
            inline: b[17] == 1,
        };
        if h.number != number {
            return Err(format!(
                "the header of message {} of its tag where message {number} was due",
                h.number
            ));
        }
        if usize::from(h.first) >= rails || b[17] > 1 || b[18..HEADER_LEN].iter().any(|&x| x != 0) {
            return Err(format!(
                "a message header naming rail {} of {rails}, or with stray bytes",
                h.first
            ));
        }
        let body = if h.inline { h.size } else { 0 };
        if (b.len() - HEADER_LEN) as u64 != body {
            return Err(format!(
                "a message header of a {}{}-byte message followed by {} bytes",
                if h.inline { "inline " } else { "" },
                h.size,
                b.len() - HEADER_LEN
            ));
        }
        Ok(h)
    }
}

/// A comm's headers: one slot per request, in host memory registered on
/// rail 0's device (only Weft reads and writes them).
pub(super) struct Headers {
    pub(super) buf: Box<[u8]>,
    pub(super) dev: Arc<DeviceState>,
    pub(super) region: Option<Arc<Region<Mr>>>,
    pub(super) mem: Mem,
}

impl Headers {
    pub(super) fn new(dev: &Arc<DeviceState>) -> Result<Self> {
        let buf = vec![0u8; MAX_REQUESTS * SLOT].into_boxed_slice();
        // SAFETY: `buf` is this struct's; the registration is released in
        // Drop, before the buffer is freed.
        let region = unsafe { dev.mr.register(buf.as_ptr() as usize, buf.len()) }
            .map_err(|e| Error::system(format!("registering a virtual device's headers: {e}")))?;
        let d = region.desc();
        let mem = Mem {
            desc: d.desc,
            key: d.key,
            base: region.range().start,
        };
        Ok(Self {
            buf,
            dev: Arc::clone(dev),
            region: Some(region),
            mem,
        })
    }

    pub(super) fn slot(&mut self, slot: u32) -> *mut u8 {
        let at = slot as usize * SLOT;
        self.buf[at..at + SLOT].as_mut_ptr()
    }

    pub(super) fn read(&self, slot: u32) -> &[u8] {
        let at = slot as usize * SLOT;
        &self.buf[at..at + SLOT]
    }
}

impl Drop for Headers {
    fn drop(&mut self) {
        if let Some(r) = self.region.take() {
            self.dev.mr.release(r);
        }
    }
}
